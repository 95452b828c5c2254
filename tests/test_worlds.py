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

SCENARIOS = str(Path(__file__).resolve().with_name("world_scenarios.py"))


@pytest.fixture
def pool(tmp_path, mpi_env):
    pool = WorldPool(tmp_path / "worlds", mpi_env, mpiexec)
    yield pool
    pool.close()


def scenario(kind: str) -> dict:
    return {"script": SCENARIOS, "args": [kind]}


@pytest.mark.mpi
def test_a_world_serves_many_scenarios_and_gives_each_its_exit_code_and_output(pool):
    first = pool.run(3, scenario("ok"), timeout=60)
    assert first.returncode == 0
    assert first.stdout == "".join(f"scenario ok: rank {rank} of 3\n" for rank in range(3))
    refused = pool.run(2, scenario("exit-3"), timeout=60)  # two of the world's ranks: a communicator of 2
    assert refused.returncode == 3
    assert refused.stderr == "rank 0 says no\nrank 1 says no\n"
    assert pool.run(4, scenario("ok"), timeout=60).returncode == 0
    assert pool.started == 1 and pool.world.served == 3


@pytest.mark.mpi
def test_a_scenario_that_leaves_state_behind_fails_and_the_next_gets_a_fresh_world(pool):
    leaked = pool.run(3, scenario("leak-thread"), timeout=60)
    assert leaked.returncode == LEFT_STATE
    assert "world: rank 1 left the process changed after the scenario: thread(s) still running: scenario-leak" \
        in leaked.stderr
    changed = pool.run(3, scenario("leak-env"), timeout=60)
    assert changed.returncode == LEFT_STATE and pool.started == 2
    assert "torch threads: 1 before, 2 now" in changed.stderr
    assert pool.run(3, scenario("ok"), timeout=60).returncode == 0
    assert pool.started == 3


@pytest.mark.mpi
def test_an_abort_ends_the_world_with_its_code_and_a_hang_is_killed(pool):
    aborted = pool.run(3, scenario("abort"), timeout=60)
    assert aborted.returncode == 5  # the abort's code, as a fresh mpiexec reports it
    assert "scenario abort: rank 0 of 3" in aborted.stdout
    assert pool.run(3, scenario("ok"), timeout=60).returncode == 0
    with pytest.raises(TimeoutError):
        pool.run(3, scenario("hang"), timeout=3)
    assert pool.world is None
    assert pool.run(3, scenario("ok"), timeout=60).returncode == 0
    assert pool.started == 3


def test_a_world_takes_only_mpigrads_run_time_variables():
    base = {"PATH": "/bin", "NUMBA_NUM_THREADS": "1", "MPIGRAD_PHASE_LOG": "/x"}
    assert world_env_differs(dict(base), base) == {}
    assert world_env_differs({**base, "MPIGRAD_WAIT_LOG": "/y"}, base) == {"MPIGRAD_WAIT_LOG": "/y"}
    with pytest.raises(ValueError, match="meant to fail"):
        world_env_differs({**base, "MPIGRAD_INJECT_FAULT": "raise:1:2"}, base)
    assert world_env_differs({"PATH": "/bin", "NUMBA_NUM_THREADS": "1"}, base) == {"MPIGRAD_PHASE_LOG": None}
    with pytest.raises(ValueError, match="NUMBA_ENABLE_CUDASIM, NUMBA_NUM_THREADS"):
        world_env_differs({**base, "NUMBA_NUM_THREADS": "2", "NUMBA_ENABLE_CUDASIM": "1"}, base)
