"""A script's ``mpigrad.Session`` as a call on a communicator (issue 65, item 1): runs A, B, A
of a script's loop in the same processes of a world, on a communicator split from it, give
A's trace twice, identical in every column but the wall-clock ones; and the world harness
finds the processes as they were after the three (``ProcessState``: the Session put back
its threads, signal handlers and the runtime's module state), else the scenario fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import assert_same_trace, mpiexec, world_pool  # noqa: E402
from worlds import WorldPool  # noqa: E402

SCRIPT = str(Path(__file__).resolve().with_name("session_sweep.py"))


@pytest.mark.mpi
def test_sessions_a_b_a_in_one_world_give_a_twice_and_leave_nothing_behind(tmp_path, mpi_env):
    from mpigrad.trace import load

    shared = world_pool()  # this worker's world, warm with the runs before (where worlds are on)
    pool = shared or WorldPool(tmp_path / "worlds", mpi_env, mpiexec)
    try:
        result = pool.run(3, {"script": SCRIPT, "args": [str(tmp_path)]}, timeout=240)  # 3 of the world's ranks
    finally:
        if shared is None:
            pool.close()
    assert result.returncode == 0, result.stderr[-3000:]
    first, other, second = (load(tmp_path / f"{name}.h5") for name in ("a1", "b", "a2"))
    assert other.attrs["config"]["codec"] == "qsgd" and other.attrs["config"]["servers"] == "colocated"
    assert first.complete and len(first.steps) == 6
    assert_same_trace(first, second)
