"""How ranks wait for messages (wire/channel.set_waiting, --wait): poll without sleeping where
every rank of the node has a core per thread, sleep-poll with back-off where they outnumber
the cores; the start-up line and the trace say which rank did which."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, SMALL_RUN, mpiexec, run_mpi, world_pool
from mpigrad.runtime.plan.environment import cores_for_each
from mpigrad.runtime.wire import channel


def test_a_node_has_a_core_for_each_when_its_ranks_threads_fit_its_cpus():
    assert cores_for_each([(0, 1), (0, 1)], 1)
    assert not cores_for_each([(0, 1), (0, 1), (0, 1)], 1)
    assert not cores_for_each([(0, 1), (0, 1)], 2)
    assert cores_for_each([(0,), (1,), (2, 3)], 1)
    assert not cores_for_each([(0,), (0,)], 1)  # bound to one CPU between them


def test_backoff_sleeps_only_when_waits_do_not_spin(monkeypatch):
    slept = []
    monkeypatch.setattr(channel.time, "sleep", slept.append)
    try:
        channel.set_waiting(True)
        backoff = channel.Backoff(60, lambda: "nothing")
        for _ in range(5):
            backoff.sleep()
        assert slept == []
        channel.set_waiting(False)
        backoff = channel.Backoff(60, lambda: "nothing")
        for _ in range(7):
            backoff.sleep()
        assert slept == [50e-6, 100e-6, 200e-6, 400e-6, 5e-4, 5e-4, 5e-4]
        channel.set_waiting(True)
        expired = channel.Backoff(-1, lambda: "rank 3 sent nothing")
        with pytest.raises(channel.PeerTimeout, match="rank 3 sent nothing within -1 s"):
            expired.sleep()  # a spinning wait still times out
    finally:
        channel.set_waiting(False)


@pytest.mark.mpi
def test_each_rank_waits_as_its_node_allows_and_the_trace_says_so(tmp_path, mpi_env):
    from mpigrad.trace import load

    cpus = sorted(os.sched_getaffinity(0))
    spins = cores_for_each([cpus, cpus], 1)  # two ranks, one thread each, on this machine's CPUs
    seen = {}
    for mode in ("auto", "sleep"):
        trace = tmp_path / f"{mode}.h5"
        result = run_mpi(2, ["train", "--trace", str(trace), *SMALL_RUN, "--iterations", "2", "--wait", mode],
                         mpi_env)
        assert result.returncode == 0, result.stderr
        seen[mode] = (load(trace).attrs["waits"], next(line for line in result.stdout.splitlines()
                                                       if line.startswith("waits: ")))
    assert seen["auto"][0] == ({"spin": [0, 1], "sleep": []} if spins else {"spin": [], "sleep": [0, 1]})
    assert seen["sleep"] == ({"spin": [], "sleep": [0, 1]},
                             "waits: sleep-polling with back-off to 0.5 ms on every rank (--wait sleep: asked for)")


@pytest.mark.mpi
@pytest.mark.serial  # the spinning wait's CPU seconds are the machine's to give: measured alone
def test_ranks_wait_for_a_busy_rank_0_asleep_not_spinning(mpi_env):
    """``wire.mpi.bcast_asleep`` (a shared world's options check, a sweep's next line, the
    launch checks): while rank 0 works 3 s, a waiting rank spends well under a tenth of that
    in CPU, where MPICH's plain blocking bcast spins (the control, measured in the same run)."""
    script, pool = REPO / "tests" / "wait_for_root.py", world_pool()
    if pool is not None:
        result = pool.run(3, {"script": str(script), "args": ["3"]}, timeout=120)
    else:
        result = subprocess.run(mpiexec(3, [sys.executable, "-m", "mpi4py", str(script), "3"]), env=mpi_env,
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    costs = [tuple(map(float, found)) for found in re.findall(r"asleep ([\d.]+) spinning ([\d.]+)", result.stdout)]
    assert len(costs) == 2, result.stdout
    for asleep, spinning in costs:
        assert asleep < 0.3, costs
        assert spinning > 2 * asleep, costs  # the control: a blocking wait here does cost CPU
    print(costs)
