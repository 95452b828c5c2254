"""Shared test helpers: launching real mpiexec runs with timeouts and a shared Numba cache;
how the suite runs in parallel (pytest-xdist) and its quick tier."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The device codecs' kernels run in Numba's CUDA simulator unless MPIGRAD_TEST_GPU=1 asks for
# the real device (a GPU machine: the same tests then run the compiled kernels, and the
# ``cuda`` marker's tests run too). Numba reads this when it is first imported: here, first.
if os.environ.get("MPIGRAD_TEST_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

# Text tables fit COLUMNS where it is set: a test that wants a width sets it itself, so that
# neither the user's shell nor pytest-xdist's workers (which set COLUMNS=80) decide one.
for _variable in ("COLUMNS", "LINES"):
    os.environ.pop(_variable, None)

# Bytecode is written (into __pycache__, which git ignores) even where PYTHONDONTWRITEBYTECODE
# is set, as on some CI images: there, every rank of every real run compiled mpigrad's modules
# from source (0.2 to 0.3 CPU-seconds a process, over 600 processes a run) and each xdist worker
# rewrote every test module anew (some 10 s). The real runs inherit this environment.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def _parse_one_thread_at_a_time() -> None:
    """Many tests run a run's ranks as threads of this process. CPython 3.11's ``ast`` keeps
    the parser's recursion depth per interpreter, not per thread (gh-106905), so two threads
    parsing at once (NumPy reading an .npz header, ``inspect.signature`` of a builtin as
    ``numpy.ma`` is imported) could fail with "AST constructor recursion depth mismatch":
    a rank of stop 69's CI did. Real runs are processes of one thread each and never meet it;
a lock costs the suite nothing on a Python that has no such bug."""
    import ast
    import threading

    parse, lock = ast.parse, threading.RLock()

    def parse_alone(*args, **kwargs):
        with lock:
            return parse(*args, **kwargs)

    parse_alone.__wrapped__ = parse
    ast.parse = parse_alone


_parse_one_thread_at_a_time()


def load_script(path: Path, name: str):
    """The example script at ``path`` imported as module ``name`` (registered in sys.modules,
    where dataclasses look their module up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def fuzz_tally(script: Path, seed: int, mutations: int, timeout: float = 300) -> dict[str, int]:
    """Run a fuzzer script (``tests/fuzz_*.py --seed S --mutations N``) in a subprocess, so
    that a segfault in a kernel fails the test instead of killing pytest; fail unless it
    exits 0, and return its tally (``kind:outcome`` -> count) from its stdout."""
    result = subprocess.run([sys.executable, str(script), "--seed", str(seed), "--mutations", str(mutations)],
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (f"fuzzer exited with {result.returncode} (negative: killed by a signal)\n"
                                    f"stdout: {result.stdout}\nstderr: {result.stderr[-4000:]}")
    return {key: int(value) for key, value in (item.split("=") for item in result.stdout.split())}


def mpiexec(ranks: int, argv: list[str]) -> list[str]:
    """The command starting ``argv`` on ``ranks`` ranks with the venv's MPI (MPICH or Open MPI,
    with the flags it needs here: mpigrad.mpiexec)."""
    from mpigrad.errors import UsageError
    from mpigrad.mpiexec import mpiexec_command

    try:
        return mpiexec_command(ranks, argv)
    except UsageError as exc:
        pytest.fail(str(exc))


def _run_directory(tmp_path_factory) -> Path:
    """A directory of this test run's, the same for every xdist worker of it (their base
    temporary directories are siblings) and this session's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def mpi_env(tmp_path_factory) -> dict[str, str]:
    """Environment for subprocess runs: one thread per rank, one Numba cache for the test run
    (shared by the xdist workers: Numba writes its cache files atomically)."""
    cache = _run_directory(tmp_path_factory) / "numba-cache"
    cache.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               NUMBA_CACHE_DIR=str(cache),
               PYTHONUNBUFFERED="1", HDF5_USE_FILE_LOCKING="FALSE")
    for key in ("SLURM_NTASKS", "SLURM_JOB_ID", "MPIGRAD_INJECT_FAULT"):
        env.pop(key, None)
    global _world_env, _world_folder
    _world_env, _world_folder = env, _run_directory(tmp_path_factory) / f"worlds-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
    return env


#: The shared worlds' base environment and folder (``mpi_env``'s), and this process's pool.
_world_env: dict[str, str] | None = None
_world_folder: Path | None = None
_world_pool = None


def world_pool():
    """This pytest worker's :class:`worlds.WorldPool` (None where worlds are off)."""
    global _world_pool
    if _world_env is None or os.environ.get("MPIGRAD_TEST_WORLDS") == "0":
        return None
    if _world_pool is None:
        from worlds import WorldPool
        _world_pool = WorldPool(_world_folder, _world_env, mpiexec)
    return _world_pool


@pytest.fixture(scope="module")
def world_relay(mpi_env):
    """``world_relay(env)``: ``env`` for a command that starts runs itself (a shell running
    the documented commands, an example's run.py) with an ``mpiexec`` first on ``PATH`` and
    in ``$MPIGRAD_MPIEXEC`` that hands each plain ``mpigrad train`` run to this worker's
    world (``worlds.WorldRelay``: no start-up per run) and every other command to the real
    ``mpiexec``; ``env`` itself where worlds are off. Each relayed run's warm-up is checked
    at the end, as ``run_mpi`` checks it."""
    import tempfile

    from mpigrad.mpiexec import find_mpiexec

    relays, folders = [], []

    def relayed(env: dict[str, str]) -> dict[str, str]:
        pool = world_pool()
        if pool is None:
            return env
        from worlds import WorldRelay

        folders.append(Path(tempfile.mkdtemp(prefix="mgrelay")))  # short: a socket's path
        relays.append(WorldRelay(pool, folders[-1], timeout=200))
        return relays[-1].install(env, find_mpiexec())

    yield relayed
    for relay in relays:
        relay.close()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    late = [line for relay in relays for _, result in relay.runs for line in result.stderr.splitlines()
            if "Numba kernel(s) during the run" in line]
    assert not late, "\n".join(late)


def pytest_sessionfinish(session, exitstatus):
    if _world_pool is not None:
        _world_pool.close()


#: Open MPI's launcher frames a notice in dashes after any rank's non-zero exit (2 for a
#: usage error, 75 for a stop); MPICH's says nothing. Only that notice is removed.
_NON_ZERO_EXIT_NOTICE = re.compile(r"-{20,}\n(?:(?!-{20,}).*\n)*?.*(?:exited with non-zero status|returned\n?"
                                   r"\s*a non-zero exit code)(?:(?!-{20,}).*\n)*-{20,}\n?")


def without_launcher_notice(stderr: str) -> str:
    """``stderr`` less Open MPI's notice of a non-zero exit: what mpigrad itself printed."""
    return _NON_ZERO_EXIT_NOTICE.sub("", stderr)


def run_mpi(ranks: int, args: list[str], env: dict[str, str], timeout: float = 180,
            cwd: Path | None = None, own: bool = False) -> subprocess.CompletedProcess:
    """``mpiexec -n RANKS python -m mpi4py -m mpigrad ARGS``; a hang fails the test. Its
    ``stderr`` is what mpigrad printed (``without_launcher_notice``). A ``train`` run goes to
    this worker's shared world (``tests/worlds.py``) where a world gives what a fresh
    ``mpiexec`` would (its environment differs in ``MPIGRAD_*`` variables only), and so does
    a ``sweep RUNS``, unless ``own`` asks for an ``mpiexec`` of its own."""
    from mpiexec_relay import world_command

    pool = world_pool() if not own and world_command(args) else None
    changed = None
    if pool is not None:
        from worlds import world_env_differs
        try:
            changed = world_env_differs(env, _world_env)
        except ValueError:
            pool = None
    if pool is not None:
        try:
            result = pool.run(ranks, {"command": args[0], "argv": list(args[1:]), "env": changed,
                                      "cwd": str(cwd) if cwd else None}, timeout)
        except TimeoutError:
            pytest.fail(f"mpiexec run (in a shared world) did not finish within {timeout} s: {' '.join(args)}")
    else:
        command = mpiexec(ranks, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", *args])
        try:
            result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"mpiexec run did not finish within {timeout} s: {' '.join(args)}\n"
                        f"stdout: {exc.stdout}\nstderr: {exc.stderr}")
    result.stderr = without_launcher_notice(result.stderr)
    # Every real run checks the warm-up: a kernel first called inside the run is named here.
    late = [line for line in result.stderr.splitlines() if "Numba kernel(s) during the run" in line]
    assert not late, "\n".join(late)
    return result


#: Small but real: the paper CNN on the embedded digits with narrow FC layers, so the two
#: FC layers are still the quantized ones and an iteration takes milliseconds.
SMALL_RUN = ["--model-opt", "fc_sizes=[256,256]", "--min-quantize-size", "10000",
             "--eval-every", "10", "--progress-every", "10"]


#: Columns that hold measured (wall-clock) durations: they differ between any two runs.
WALL_CLOCK_COLUMNS = ("wall_time", "t_compute", "t_encode", "t_decode", "t_policy")


def assert_same_trace(expected, actual) -> None:
    """Two loaded traces hold the same rows in every table and every column but the
    wall-clock ones (what a deterministic run stopped and resumed must give)."""
    import numpy as np

    for table in ("steps", "workers", "eval", "policy", "checksums"):
        left, right = getattr(expected, table), getattr(actual, table)
        assert len(left) == len(right), f"{table}: {len(left)} rows, then {len(right)}"
        assert list(left.columns) == list(right.columns), table
        for column in left.columns:
            if not column.startswith(WALL_CLOCK_COLUMNS):
                np.testing.assert_array_equal(left[column].to_numpy(), right[column].to_numpy(),
                                              err_msg=f"{table}.{column}")


#: Markers of tests that need the whole machine: under ``-n`` (pytest-xdist) such a test runs
#: while no other test does (labs measure link rates, Slurm and the timing-sensitive waits
#: have deadlines, benchmarks time themselves); every other test shares the machine.
WHOLE_MACHINE = ("lab", "slurm", "serial")

#: Markers of the tests the quick tier (``-m quick``) leaves out: real runs and minutes-long
#: ones. It keeps every module's other tests and the real mpiexec runs marked ``quick``.
#: ``each_mpi`` is a real ``mpiexec`` run by its definition, whether or not its test also
#: says ``mpi`` (four 2 x 2 runs of the hierarchical exchange said only ``each_mpi``, and ran
#: in the quick tier).
NOT_QUICK = ("mpi", "each_mpi", "slow", "lab", "slurm", "cuda")


def _costly(item) -> bool:
    """A test the quick tier leaves out: one of ``NOT_QUICK``'s markers, or the ``world_relay``
    fixture (the command it runs starts real runs, as an example's run.py does)."""
    return any(item.get_closest_marker(name) for name in NOT_QUICK) or "world_relay" in getattr(item, "fixturenames", ())


def pytest_configure(config):
    """With ``MPIGRAD_TEST_TIMELINE=DIR``, record the run's timeline (``tests/timeline.py``).
    Under ``-n N`` (pytest-xdist), send each module's tests to one worker (``loadfile``: its
    module fixtures run once), in collection order (``pytest_collection_modifyitems``: the heaviest
    modules first), unless ``--dist`` names another way."""
    if os.environ.get("MPIGRAD_TEST_TIMELINE"):  # where the run's time goes: tests/timeline.py
        from timeline import Recorder
        config.pluginmanager.register(Recorder(Path(os.environ["MPIGRAD_TEST_TIMELINE"]), WHOLE_MACHINE,
                                               sample=not os.environ.get("PYTEST_XDIST_WORKER")), "mpigrad-timeline")
    if any(arg == "--dist" or arg.startswith("--dist=") for arg in map(str, config.invocation_params.args)):
        return
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the quick tier; skip ``cuda`` tests without a device; under xdist (whose workers
    collect), put the modules with the most real runs first, so that the last module to
    finish is a short one."""
    for item in items:
        if not _costly(item):
            item.add_marker(pytest.mark.quick)
    if os.environ.get("MPIGRAD_TEST_GPU") != "1":
        skip = pytest.mark.skip(reason="needs a CUDA device: run with MPIGRAD_TEST_GPU=1 on a GPU machine")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        modules: dict[str, list] = {}
        for item in items:
            modules.setdefault(item.nodeid.split("::")[0], []).append(item)
        items[:] = [item for tests in sorted(modules.values(), key=lambda tests: -sum(map(_costly, tests)))
                    for item in tests]


class _MachineLock:
    """A readers-writer lock over the machine for the xdist workers of one test run: a test
    shares the machine, or takes it whole once the tests in flight have ended (a gate file
    held by a waiting taker stops new sharers, so takers are not starved)."""

    def __init__(self, directory: Path):
        self._gate = open(directory / "machine.gate", "a")
        self._machine = open(directory / "machine.lock", "a")

    @contextmanager
    def held(self, whole: bool):
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._machine, fcntl.LOCK_EX if whole else fcntl.LOCK_SH)
        except BaseException:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
            raise
        if not whole:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._machine, fcntl.LOCK_UN)
            if whole:
                fcntl.flock(self._gate, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, a test marked ``lab``, ``slurm`` or ``serial`` runs alone (its set-up and
    tear-down, module fixtures included, inside the lock)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    config = item.config
    if not hasattr(config, "_mpigrad_machine_lock"):
        config._mpigrad_machine_lock = _MachineLock(_run_directory(config._tmp_path_factory))
    whole = any(item.get_closest_marker(name) for name in WHOLE_MACHINE)
    with config._mpigrad_machine_lock.held(whole):
        yield
