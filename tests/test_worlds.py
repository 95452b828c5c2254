"""The shared worlds of the test suite (``tests/worlds.py``, ``tests/world_server.py``):
they give a run what a fresh ``mpiexec`` gives it (exit code, each rank's output), and a
scenario that aborts, hangs or leaves its processes changed ends its world, fails, and the
next scenario gets a fresh one: sharing a world cannot hide a leak (issue 65, item 5)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import mpiexec  # noqa: E402
from worlds import LEFT_STATE, WorldPool, world_env_differs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = str(Path(__file__).resolve().with_name("world_scenarios.py"))


@pytest.fixture(scope="module")
def pool(tmp_path_factory, mpi_env):
    """The module's pool: its tests share a world as the suite's runs do (a test that ends
    its world leaves the next a fresh one); each counts what it did with ``starts``."""
    pool = WorldPool(tmp_path_factory.mktemp("worlds"), mpi_env, mpiexec)
    yield pool
    pool.close()


class Starts:
    """The pool's worlds and scenarios since a test began: ``restarts()`` the worlds started
    beyond the one its first scenario needed (0 where it found one alive), ``served()`` the
    scenarios the pool's present world served in that time."""

    def __init__(self, pool: WorldPool):
        self.pool, self.world, self.started = pool, pool.world, pool.started
        self.served_before = pool.world.served if pool.world is not None else 0

    def restarts(self) -> int:
        return self.pool.started - self.started - (self.world is None)

    def served(self) -> int:
        return self.pool.world.served - (self.served_before if self.pool.world is self.world else 0)


@pytest.fixture
def starts(pool):
    return Starts(pool)


def scenario(kind: str) -> dict:
    return {"script": SCENARIOS, "args": [kind]}


@pytest.mark.mpi
def test_a_world_serves_many_scenarios_and_gives_each_its_exit_code_and_output(pool, starts):
    first = pool.run(3, scenario("ok"), timeout=60)
    assert first.returncode == 0
    assert first.stdout == "".join(f"scenario ok: rank {rank} of 3\n" for rank in range(3))
    refused = pool.run(2, scenario("exit-3"), timeout=60)  # two of the world's ranks: a communicator of 2
    assert refused.returncode == 3
    assert refused.stderr == "rank 0 says no\nrank 1 says no\n"
    assert pool.run(4, scenario("ok"), timeout=60).returncode == 0
    assert starts.restarts() == 0 and starts.served() == 3


@pytest.mark.mpi
def test_a_scenario_that_leaves_state_behind_fails_and_the_next_gets_a_fresh_world(pool, starts):
    leaked = pool.run(3, scenario("leak-thread"), timeout=60)
    assert leaked.returncode == LEFT_STATE
    assert "world: rank 1 left the process changed after the scenario: thread(s) still running: scenario-leak" \
        in leaked.stderr
    changed = pool.run(3, scenario("leak-env"), timeout=60)
    assert changed.returncode == LEFT_STATE and starts.restarts() == 1
    assert "torch threads: 1 before, 2 now" in changed.stderr
    assert pool.run(3, scenario("ok"), timeout=60).returncode == 0
    assert starts.restarts() == 2


@pytest.mark.mpi
def test_an_abort_ends_the_world_with_its_code_and_a_hang_is_killed(pool, starts):
    aborted = pool.run(3, scenario("abort"), timeout=60)
    assert aborted.returncode == 5  # the abort's code, as a fresh mpiexec reports it
    assert "scenario abort: rank 0 of 3" in aborted.stdout
    assert pool.run(3, scenario("ok"), timeout=60).returncode == 0
    with pytest.raises(TimeoutError):
        pool.run(3, scenario("hang"), timeout=3)
    assert pool.world is None
    assert pool.run(3, scenario("ok"), timeout=60).returncode == 0
    assert starts.restarts() == 2


@pytest.mark.mpi
def test_a_scenario_imports_from_its_folder_and_pythonpath_as_a_fresh_process_and_forgets_it(pool, starts, tmp_path):
    """A user's plugin: found in the scenario's folder or on its ``$PYTHONPATH``, as a fresh
    ``python -m mpi4py -m mpigrad`` there finds it, and forgotten after the scenario: the
    next imports its own, and one without the path finds none (not the world's folder's)."""
    def imported(ran):
        return [line.split(": ")[1] for line in ran.stdout.splitlines() if line.startswith("rank ")]

    for name in ("a", "b", "here"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "probe_plugin.py").write_text(f"VALUE = {name!r}\n")
    ran = pool.run(2, {**scenario("import"), "env": {"PYTHONPATH": str(tmp_path / "a")}}, timeout=60)
    assert ran.returncode == 0 and imported(ran) == ["a", "a"], ran.stderr
    ran = pool.run(2, {**scenario("import"), "env": {"PYTHONPATH": "b"}, "cwd": str(tmp_path)}, timeout=60)
    assert ran.returncode == 0 and imported(ran) == ["b", "b"], ran.stderr  # relative to the folder
    ran = pool.run(2, {**scenario("import"), "cwd": str(tmp_path / "here")}, timeout=60)
    assert ran.returncode == 0 and imported(ran) == ["here", "here"], ran.stderr
    ran = pool.run(2, scenario("import"), timeout=60)
    assert ran.returncode == 4 and "No module named 'probe_plugin'" in ran.stderr
    assert starts.restarts() == 0


@pytest.mark.mpi
def test_a_module_of_the_worlds_installation_is_kept_after_a_scenario_in_the_folder_that_holds_it(pool, starts):
    """A scenario run in the repository's folder (as the documented commands run, with CI's
    venv inside it) that first imports a module of the installation leaves it imported: the
    next scenario gets the same module (forgetting numba's lazily imported modules this way
    made the next run register numba's types twice and fail)."""
    def loaded(ran):  # each rank's module, by its id in that rank's process
        return dict(line.split(": ", 1) for line in ran.stdout.splitlines() if line.startswith("rank "))

    first = pool.run(2, {**scenario("venv-module"), "cwd": str(REPO)}, timeout=60)
    second = pool.run(2, {**scenario("venv-module"), "cwd": str(REPO)}, timeout=60)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert loaded(first) == loaded(second) and len(loaded(first)) == 2
    assert starts.restarts() == 0


def test_a_world_takes_only_mpigrads_run_time_variables():
    base = {"PATH": "/bin", "NUMBA_NUM_THREADS": "1", "MPIGRAD_PHASE_LOG": "/x"}
    assert world_env_differs(dict(base), base) == {}
    assert world_env_differs({**base, "MPIGRAD_WAIT_LOG": "/y"}, base) == {"MPIGRAD_WAIT_LOG": "/y"}
    with pytest.raises(ValueError, match="meant to fail"):
        world_env_differs({**base, "MPIGRAD_INJECT_FAULT": "raise:1:2"}, base)
    assert world_env_differs({"PATH": "/bin", "NUMBA_NUM_THREADS": "1"}, base) == {"MPIGRAD_PHASE_LOG": None}
    assert world_env_differs({**base, "PYTHONPATH": "plugins"}, base) == {"PYTHONPATH": "plugins"}  # put on sys.path
    with pytest.raises(ValueError, match="NUMBA_ENABLE_CUDASIM, NUMBA_NUM_THREADS"):
        world_env_differs({**base, "NUMBA_NUM_THREADS": "2", "NUMBA_ENABLE_CUDASIM": "1"}, base)


def test_the_relay_takes_plain_train_runs_only():
    from mpiexec_relay import relayed_run

    mpigrad = ["python", "-m", "mpi4py", "-m", "mpigrad"]
    assert relayed_run(["-n", "3", *mpigrad, "train", "--bits", "4"]) == (3, ["train", "--bits", "4"])
    assert relayed_run(["-n", "3", "/venv/bin/python3", *mpigrad[1:], "train"]) == (3, ["train"])
    assert relayed_run(["-n", "3", *mpigrad, "train", "--check"]) is None  # the launcher's own path
    assert relayed_run(["-n", "2", *mpigrad, "doctor"]) is None
    assert relayed_run(["-n", "5", *mpigrad, "sweep", "runs.txt"]) == (5, ["sweep", "runs.txt"])
    assert relayed_run(["-n", "5", *mpigrad, "sweep", "--help"]) is None
    assert relayed_run(["--oversubscribe", "--allow-run-as-root", "-n", "3", *mpigrad, "train"]) == (3, ["train"])
    assert relayed_run(["--host", "a", "-n", "3", *mpigrad, "train"]) is None
    assert relayed_run(["-n", "3", "python", "tests/fake_step.py"]) is None


@pytest.mark.mpi
def test_a_shell_s_train_runs_go_to_the_world_and_the_rest_to_mpiexec(pool, starts, tmp_path, mpi_env):
    """Through ``WorldRelay``'s ``mpiexec`` a shell's plain train run is served by the world
    (no start-up) and gives what the real ``mpiexec`` gives: its exit code and lines; a
    command with a variable a world cannot take goes to the real ``mpiexec``."""
    import subprocess

    from mpigrad.mpiexec import find_mpiexec
    from worlds import WorldRelay

    import tempfile
    folder = Path(tempfile.mkdtemp(prefix="mgrelay"))
    relay = WorldRelay(pool, folder, timeout=120)
    env = relay.install(dict(mpi_env), find_mpiexec())
    train = "mpiexec -n 3 python -m mpi4py -m mpigrad train"
    tiny = ("--model-opt fc_sizes=[32,32] --model-opt conv_channels=4 --min-quantize-size 500 --net-mode off "
            "--eval-every 0 --progress-every 1 --iterations 2")

    def shell(command):
        return subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=180)
    try:
        run = shell(f"{train} {tiny} --trace run.h5")
        assert run.returncode == 0, run.stderr
        assert "iter 2/2" in run.stdout and (tmp_path / "run.h5").exists()
        assert len(relay.runs) == 1 and starts.restarts() == 0 and starts.served() == 1, relay.declined
        relayed = shell(f"{train} --bits 99 --trace bad.h5")
        real = shell(f"EXTRA=1 {train} --bits 99 --trace bad.h5")  # EXTRA: a world cannot take it
        assert len(relay.runs) == 2 and starts.served() == 2
        assert relay.declined == [(["--bits", "99", "--trace", "bad.h5"], "variables a world cannot change: EXTRA")]
        assert relayed.returncode == real.returncode == 2
        from conftest import without_launcher_notice
        assert sorted(relayed.stderr.splitlines()) == sorted(without_launcher_notice(real.stderr).splitlines())
        assert "bits must be in 1..32, got 99" in relayed.stderr and not (tmp_path / "bad.h5").exists()
    finally:
        relay.close()
    assert not Path(relay.path).exists()
