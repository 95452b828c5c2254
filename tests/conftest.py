"""Shared test helpers: launching real mpiexec runs with timeouts and a shared Numba cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The device codecs' kernels run in Numba's CUDA simulator unless MPIGRAD_TEST_GPU=1 asks for
# the real device (a GPU machine: the same tests then run the compiled kernels, and the
# ``cuda`` marker's tests run too). Numba reads this when it is first imported: here, first.
if os.environ.get("MPIGRAD_TEST_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


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


@pytest.fixture(scope="session")
def mpi_env(tmp_path_factory) -> dict[str, str]:
    """Environment for subprocess runs: one thread per rank, one Numba cache for the session."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_CACHE_DIR=str(tmp_path_factory.mktemp("numba-cache")),
               PYTHONUNBUFFERED="1", HDF5_USE_FILE_LOCKING="FALSE")
    for key in ("SLURM_NTASKS", "SLURM_JOB_ID", "MPIGRAD_INJECT_FAULT"):
        env.pop(key, None)
    return env


#: Open MPI's launcher frames a notice in dashes after any rank's non-zero exit (2 for a
#: usage error, 75 for a stop); MPICH's says nothing. Only that notice is removed.
_NON_ZERO_EXIT_NOTICE = re.compile(r"-{20,}\n(?:(?!-{20,}).*\n)*?.*(?:exited with non-zero status|returned\n?"
                                   r"\s*a non-zero exit code)(?:(?!-{20,}).*\n)*-{20,}\n?")


def without_launcher_notice(stderr: str) -> str:
    """``stderr`` less Open MPI's notice of a non-zero exit: what mpigrad itself printed."""
    return _NON_ZERO_EXIT_NOTICE.sub("", stderr)


def run_mpi(ranks: int, args: list[str], env: dict[str, str], timeout: float = 180,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n RANKS python -m mpi4py -m mpigrad ARGS``; a hang fails the test. Its
    ``stderr`` is what mpigrad printed (``without_launcher_notice``)."""
    command = mpiexec(ranks, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", *args])
    try:
        result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpiexec run did not finish within {timeout} s: {' '.join(args)}\n"
                    f"stdout: {exc.stdout}\nstderr: {exc.stderr}")
    result.stderr = without_launcher_notice(result.stderr)
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


def pytest_collection_modifyitems(config, items):
    """``cuda`` tests need a real device: skipped (saying why) unless MPIGRAD_TEST_GPU=1."""
    if os.environ.get("MPIGRAD_TEST_GPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run with MPIGRAD_TEST_GPU=1 on a GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
