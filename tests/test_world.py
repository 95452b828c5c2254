"""Runs that share a world (issue 65): ``mpigrad sweep`` runs a file's runs one after
another in the same MPI processes (``runtime/run/world.py``), and nothing one run leaves
behind reaches the next (``ProcessState``).

The promise tested: runs A, B, A in one world (B another codec, policy and server layout)
give A's trace twice, identical in every column but the wall-clock ones, and A's equals a
straight ``mpigrad train`` run of A's options in fresh processes."""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import SMALL_RUN, assert_same_trace, run_mpi  # noqa: E402

#: Deterministic (the simulated clock on a fixed compute time): two runs of A agree bit for bit.
DETERMINISTIC = [*SMALL_RUN, "--iterations", "8", "--net-mode", "virtual", "--compute-time", "20ms",
                 "--checksum-every", "4", "--eval-every", "4", "--cost-model", "none"]
A = [*DETERMINISTIC, "--policy", "fixed", "--bits", "2", "--seed", "21"]
B = [*DETERMINISTIC, "--codec", "qsgd", "--policy", "adaptive", "--bits", "4", "--error-feedback", "residual",
     "--servers", "colocated", "--seed", "22"]


def runs_file(path: Path, runs: list[list[str]]) -> Path:
    path.write_text("# a sweep of the test's\n" + "".join(shlex.join(argv) + "\n\n" for argv in runs))
    return path


@pytest.mark.mpi
def test_a_b_a_in_one_world_gives_a_twice_and_a_straight_run(tmp_path, mpi_env):
    from mpigrad.trace import load

    first, second, other, alone = (tmp_path / f"{name}.h5" for name in ("a1", "a2", "b", "alone"))
    runs = runs_file(tmp_path / "runs.txt", [[*A, "--trace", str(first)], [*B, "--trace", str(other)],
                                             [*A, "--trace", str(second)]])
    result = run_mpi(3, ["sweep", str(runs)], mpi_env, timeout=300)
    assert result.returncode == 0, result.stderr
    for index in (1, 2, 3):
        assert f"mpigrad sweep: run {index}/3 (line {2 * index}): exit 0" in result.stdout
    assert load(other).attrs["config"]["codec"] == "qsgd"
    assert_same_trace(load(first), load(second))
    straight = run_mpi(3, ["train", *A, "--trace", str(alone)], mpi_env)
    assert straight.returncode == 0, straight.stderr
    assert_same_trace(load(alone), load(first))


@pytest.mark.mpi
def test_a_refused_run_is_reported_and_the_next_one_runs_and_a_complete_one_is_skipped(tmp_path, mpi_env):
    from mpigrad.trace import load

    done, after = tmp_path / "done.h5", tmp_path / "after.h5"
    short = [*A, "--iterations", "2"]
    runs = runs_file(tmp_path / "runs.txt", [[*short, "--trace", str(done)], [*short, "--codec", "nope"],
                                             [*short, "--trace", str(after)]])
    result = run_mpi(3, ["sweep", str(runs)], mpi_env, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "unknown codec 'nope'" in result.stderr
    assert "1 of 3 run(s) refused" in result.stderr
    assert load(after).attrs["status"] == "complete"
    again = run_mpi(3, ["sweep", str(runs)], mpi_env, timeout=300)  # the requeued job's second go
    assert f"skipped: {done} is complete" in again.stdout
    assert f"skipped: {after} is complete" in again.stdout


@pytest.mark.mpi
def test_a_line_whose_checkpoint_is_of_another_configuration_is_refused_and_the_next_one_runs(tmp_path, mpi_env):
    """A stopped run's line resumes (``--resume`` added); where its checkpoint is of another
    configuration the launch checks refuse it on every rank alike, without MPI_Abort, and
    the sweep goes on to the next line (it used to abort the job at the checkpoint's load).
    A sweep's 75 and 2 end every rank together, as ``mpigrad train``'s do (they went through
    ``python -m mpi4py``'s MPI_Abort of a non-zero exit)."""
    from mpigrad.runtime import EXIT_REQUEUE
    from mpigrad.trace import load

    stopped, after = tmp_path / "stopped.h5", tmp_path / "after.h5"
    long = [*A, "--iterations", "100000", "--walltime", "6s", "--trace", str(stopped)]
    first = run_mpi(3, ["sweep", str(runs_file(tmp_path / "first.txt", [long]))], mpi_env, timeout=300)
    assert first.returncode == EXIT_REQUEUE, first.stderr
    assert "MPI_Abort" not in first.stdout + first.stderr, first.stderr  # every rank ended together with 75
    runs = runs_file(tmp_path / "runs.txt", [[*long, "--lr", "0.5"], [*A, "--iterations", "2", "--trace", str(after)]])
    result = run_mpi(3, ["sweep", str(runs)], mpi_env, timeout=300)
    assert result.returncode == 2, result.stderr
    assert f"resumed: {stopped} stopped at a checkpoint" in result.stdout
    assert "is from a different configuration (lr: " in result.stderr, result.stderr
    assert "MPI_Abort" not in result.stdout + result.stderr, result.stderr
    assert "mpigrad sweep: run 2/2 (line 4): exit 0" in result.stdout
    assert load(after).attrs["status"] == "complete" and load(stopped).attrs["status"] == "stopped"


def test_a_runs_file_that_holds_no_run_or_does_not_split_is_refused(tmp_path):
    from mpigrad.errors import UsageError
    from mpigrad.runtime.run.sweep import read_runs

    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    with pytest.raises(UsageError, match="holds no run"):
        read_runs(empty)
    quoted = tmp_path / "quoted.txt"
    quoted.write_text("--trace 'a.h5\n")
    with pytest.raises(UsageError, match="line 1: No closing quotation"):
        read_runs(quoted)
    with pytest.raises(UsageError, match="cannot read the runs file"):
        read_runs(tmp_path / "missing.txt")
    assert read_runs(runs_file(tmp_path / "two.txt", [["--seed", "1"], ["--seed", "2"]])) == [
        (2, ["--seed", "1"]), (4, ["--seed", "2"])]


def test_process_state_puts_back_what_a_run_changes():
    import numpy as np
    import torch

    from mpigrad.runtime.plan import gpu
    from mpigrad.runtime.run.world import ProcessState
    from mpigrad.runtime.wire import channel

    state = ProcessState.taken()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    torch.backends.cudnn.allow_tf32 = not torch.backends.cudnn.allow_tf32
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    gpu._bound, channel._spin = torch.device("cpu"), not channel._spin
    np.random.rand(3), torch.rand(3)
    changed = state.differences()
    for what in ("torch threads", "TF32 cuDNN", "handler of SIGUSR1", "bound GPU", "waiting mode",
                 "NumPy's global RNG moved", "torch's global RNG moved"):
        assert any(line.startswith(what) for line in changed), (what, changed)
    state.restore()
    assert state.differences() == []
    assert torch.get_num_threads() == threads and signal.getsignal(signal.SIGUSR1) is previous


def test_process_state_forgets_the_plugins_a_run_admitted(monkeypatch):
    """A run's plugin codec is not the next run's: after the restore the registry holds none,
    and the same module imported anew (as a world's next run imports its folder) is admitted
    again, where without the restore its fresh class would clash with the old one."""
    from mpigrad.codecs.base import CODECS

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples" / "plugins"))
    earlier = CODECS.plugins_loaded()  # this process's own (another test may have loaded topk), put back below
    CODECS.forget_plugins_since(({}, {key: {} for key in CODECS.keys}))
    try:
        _forgets_and_clashes(monkeypatch)
    finally:
        CODECS.forget_plugins_since(earlier)


def _forgets_and_clashes(monkeypatch) -> None:
    from mpigrad.codecs.base import CODECS, CodecError
    from mpigrad.runtime.run.world import ProcessState

    state = ProcessState.taken()
    first = CODECS.lookup("topk:TopK")
    assert CODECS.lookup("topk") is first
    assert any(line.startswith("loaded codec plugins") for line in state.differences())
    state.restore()
    assert state.differences() == []
    with pytest.raises(CodecError, match="unknown codec 'topk'"):
        CODECS.lookup("topk")
    monkeypatch.delitem(sys.modules, "topk")
    again = CODECS.lookup("topk:TopK")
    assert again is not first and CODECS.lookup("topk") is again
    state.restore()
    CODECS.lookup("topk:TopK")
    monkeypatch.delitem(sys.modules, "topk")
    with pytest.raises(CodecError, match=r"codec_id 'topk' is taken by topk\.TopK"):
        CODECS.lookup("topk:TopK")  # no restore between: two classes named alike clash, as before
    state.restore()


def test_process_state_names_a_thread_and_a_file_a_run_left_behind(tmp_path):
    """What cannot be put back is caught: a scenario that leaves them behind fails."""
    import h5py

    from mpigrad.runtime.run.world import ProcessState

    state = ProcessState.taken()
    stop = threading.Event()
    left = threading.Thread(target=stop.wait, name="left-running", daemon=True)
    left.start()
    handle = h5py.File(tmp_path / "open.h5", "w")
    try:
        changed = state.differences()
        assert "thread(s) still running: left-running" in changed
        assert "1 HDF5 file(s) left open" in changed
    finally:
        stop.set()
        left.join()
        handle.close()
    assert state.differences() == []
