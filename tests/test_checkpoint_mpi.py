"""Stop on a real signal, checkpoint, resume: the same trace as a run that never stopped."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SMALL_RUN, assert_same_trace, mpiexec, run_mpi, without_launcher_notice
from mpigrad.errors import UsageError
from mpigrad.runtime import EXIT_REQUEUE
from mpigrad.runtime.measure import checkpoint
from mpigrad.trace import load

pytestmark = pytest.mark.mpi

# Deterministic mode, and every kind of state a resume must restore: a learning policy,
# a stochastic codec (RNG counters), error-feedback memories, data order, both clocks.
RUN = [*SMALL_RUN, "--iterations", "120", "--net-mode", "virtual", "--compute-time", "20ms",
       "--codec", "qsgd", "--codec-opt", "bucket_size=256", "--policy", "mqgrad", "--bits", "2",
       "--error-feedback", "residual", "--seed", "3", "--progress-every", "5", "--trace-flush", "7"]


def start(trace, env, *extra, ranks: int = 3) -> subprocess.Popen:
    command = mpiexec(ranks, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", "train",
               "--trace", str(trace), *RUN, *extra])
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for_line(process: subprocess.Popen, needle: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if needle in line:
            return
        if not line and process.poll() is not None:
            break
    os.killpg(process.pid, signal.SIGKILL)
    pytest.fail(f"run never printed {needle!r}: {process.stderr.read()}")


def finish(process: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("run did not end after the signal")
    return process.returncode, out, without_launcher_notice(err)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, mpi_env):
    """The trace of RUN straight through, without a stop or a crash."""
    path = tmp_path_factory.mktemp("straight") / "straight.h5"
    result = run_mpi(3, ["train", "--trace", str(path), *RUN], mpi_env)
    assert result.returncode == 0, result.stderr
    return path


def assert_straight(straight, other) -> None:
    """``other`` completed and holds the straight run's rows (but the wall-clock columns)."""
    resumed = load(other)
    assert resumed.complete
    assert_same_trace(load(straight), resumed)


@pytest.mark.each_mpi
def test_signal_checkpoint_resume_gives_the_straight_trace(tmp_path, mpi_env, straight):
    stopped = tmp_path / "stopped.h5"
    process = start(stopped, mpi_env)
    wait_for_line(process, "iter  20/120")
    os.killpg(process.pid, signal.SIGUSR1)  # what Slurm's --signal=B:USR1 forwarding does
    code, out, err = finish(process)
    assert code == EXIT_REQUEUE, err + out[-2000:]
    assert "received SIGUSR1: stopped after iteration" in out
    partial = load(stopped)
    assert partial.status == "stopped" and not partial.complete
    assert 20 <= len(partial.steps) < 120
    assert (tmp_path / "stopped.h5.ckpt").exists()

    resumed = run_mpi(3, ["train", "--trace", str(stopped), *RUN, "--resume"], mpi_env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {stopped}.ckpt at iteration {len(partial.steps)}" in resumed.stdout

    assert_straight(straight, stopped)
    assert (load(straight).steps["bits"].diff().fillna(0) >= 0).all()
    # "sent" counts the whole run's traffic, not just this session's.
    total_mb = (load(stopped).steps[["bytes_up", "bytes_down"]].to_numpy().sum()) / 1e6
    assert f"sent {total_mb:.1f} MB" in resumed.stdout.splitlines()[-2]


@pytest.mark.each_mpi
def test_two_servers_stop_on_a_signal_and_resume_to_their_straight_trace(tmp_path, mpi_env):
    """--servers 2 under real mpiexec: every shard server checkpoints its slice (error-feedback
    memory, codec RNG counters) at the same boundary, and the resumed run ends as a straight
    two-server run does."""
    sharded = ["--servers", "2", "--iterations", "80"]  # 70 iterations after the signal
    straight = tmp_path / "straight-s2.h5"
    result = run_mpi(4, ["train", "--trace", str(straight), *RUN, *sharded], mpi_env)
    assert result.returncode == 0, result.stderr

    stopped = tmp_path / "stopped-s2.h5"
    process = start(stopped, mpi_env, *sharded, ranks=4)
    wait_for_line(process, "iter 10/80")
    os.killpg(process.pid, signal.SIGUSR1)
    code, out, err = finish(process)
    assert code == EXIT_REQUEUE, err + out[-2000:]
    partial = load(stopped)
    assert partial.status == "stopped" and 10 <= len(partial.steps) < 80
    resumed = run_mpi(4, ["train", "--trace", str(stopped), *RUN, *sharded, "--resume"], mpi_env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"at iteration {len(partial.steps)}" in resumed.stdout
    assert_straight(straight, stopped)
    assert load(stopped).attrs["servers"] == 2


@pytest.mark.serial  # a race between the ranks' exits, counted over runs
@pytest.mark.each_mpi
def test_a_rank_late_to_exit_is_not_killed_and_mpiexec_reports_the_stop_code(mpi_env):
    """Every rank ends a stop with exit 75; hydra SIGKILLs the ranks still running when one
    exits without MPICH's PMI finalize (a C atexit handler), which ``os._exit`` skipped:
    mpiexec then reported 9 in 6 of 8 such runs of 6 ranks (2 of 8 with 2 ranks), hence
    three runs of six."""
    script = Path(__file__).with_name("late_rank_exit.py")
    command = mpiexec(6, [sys.executable, str(script), "5", "1.0", str(EXIT_REQUEUE)])
    for _ in range(3):
        result = subprocess.run(command, env=mpi_env, capture_output=True, text=True, timeout=60)
        assert result.returncode == EXIT_REQUEUE, result.stdout + result.stderr
        assert "BAD TERMINATION" not in result.stdout and without_launcher_notice(result.stderr) == ""


def rank_pids(trace) -> dict[int, int]:
    """PIDs of the MPI ranks training into ``trace``, by rank (Linux /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if str(trace).encode() in cmdline and b"mpi4py" in cmdline:
            ranks = [v.split(b"=", 1)[1] for v in environ
                     if v.startswith((b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK="))]
            if ranks:
                found[int(ranks[0])] = int(entry)
    return found


def assert_every_flushed_row(killed, at_least: int) -> None:
    """``killed``, the trace of a run whose writer (rank 0) was SIGKILLed, holds the rows
    written before the kill, in order and whole. Each evaluation and checkpoint (every 10
    iterations) writes every row kept so far, and between them the rows go out in batches of
    7 (--trace-flush), so a finished write ends the file after row 10k or 10k + 7; within a
    write, the writer commits each full chunk of 7 rows first, so a kill there leaves a
    multiple of 7."""
    assert killed.status == "running" and not killed.complete
    rows = len(killed.steps)
    assert rows >= at_least and (rows % 10 in (0, 7) or rows % 7 == 0), rows
    assert list(killed.steps["iteration"]) == list(range(rows))
    assert np.isfinite(killed.steps["loss"]).all()


@pytest.mark.each_mpi
@pytest.mark.parametrize("victim", [2, 0])
def test_sigkill_of_a_rank_loses_at_most_one_interval(tmp_path, mpi_env, straight, victim):
    """SIGKILL one rank mid-run; --resume continues from the newest periodic checkpoint and
    the finished trace equals the straight run's: no iteration missing or repeated. Killing
    rank 0, the writer, leaves a trace with every row flushed before the kill."""
    trace = tmp_path / "killed.h5"
    process = start(trace, mpi_env, "--checkpoint-every", "10")
    wait_for_line(process, "iter  45/120")  # so the checkpoint after iteration 40 exists
    pids = rank_pids(trace)
    assert sorted(pids) == [0, 1, 2], pids
    os.kill(pids[victim], signal.SIGKILL)
    code, out, err = finish(process)
    assert code != 0
    reached = max([45] + [int(line.split()[1].split("/")[0]) for line in out.splitlines()
                          if line.startswith("iter")])  # the last progress line before the kill
    assert checkpoint.exists(tmp_path / "killed.h5.ckpt")
    if victim == 0:
        assert_every_flushed_row(load(trace), at_least=40)  # the checkpoint after iteration 40 flushed

    resumed = run_mpi(3, ["train", "--trace", str(trace), *RUN, "--resume", "--checkpoint-every", "10"],
                      mpi_env)
    assert resumed.returncode == 0, resumed.stderr
    at = int(resumed.stdout.split("at iteration ")[1].split()[0])
    assert at % 10 == 0 and 40 <= at <= reached and reached - at <= 10 + 5, (at, reached)
    assert_straight(straight, trace)
    assert not checkpoint.exists(tmp_path / "killed.h5.ckpt")  # a finished run leaves none


def test_resume_with_a_different_config_is_refused(tmp_path, mpi_env, deadline_run):
    """A checkpoint resumes only the configuration and world size that wrote it; a refused
    resume leaves the checkpoint as it was, and is a launch check's refusal: one line, every
    rank ended together with exit 2, no MPI_Abort (in a world: the world lives on, as a
    sweep's next run starts). On a copy of the walltime run's stop."""
    assert deadline_run[0].returncode == EXIT_REQUEUE, deadline_run[0].stderr
    source = deadline_run[1]
    for name in (source.name, source.name + ".ckpt", source.name + ".ckpt.prev"):
        if (source.parent / name).exists():
            shutil.copy(source.parent / name, tmp_path / name)
    trace = tmp_path / source.name
    before = (tmp_path / "deadline.h5.ckpt").read_bytes()
    result = run_mpi(3, ["train", "--trace", str(trace), *DEADLINE_RUN, "--resume", "--lr", "0.5"],
                     mpi_env)
    assert result.returncode == 2
    assert "mpigrad train: error: --resume: checkpoint " in result.stderr
    assert "from a different configuration (lr: 0.01 -> 0.5)" in result.stderr
    assert "MPI_Abort" not in result.stdout + result.stderr, result.stderr
    result = run_mpi(4, ["train", "--trace", str(trace), *DEADLINE_RUN, "--resume"], mpi_env)
    assert result.returncode == 2
    assert "written by 3 ranks, this run has 4" in result.stderr
    assert "MPI_Abort" not in result.stdout + result.stderr, result.stderr
    assert (tmp_path / "deadline.h5.ckpt").read_bytes() == before
    for name in ("deadline.h5.ckpt", "deadline.h5.ckpt.prev"):  # a stopped trace whose checkpoint is gone
        (tmp_path / name).unlink(missing_ok=True)
    result = run_mpi(3, ["train", "--trace", str(trace), *DEADLINE_RUN, "--resume"], mpi_env)
    assert result.returncode == 2
    assert f"mpigrad train: error: --resume: no checkpoint at {trace}.ckpt" in result.stderr, result.stderr
    assert "MPI_Abort" not in result.stdout + result.stderr, result.stderr


def test_checkpoint_write_is_atomic(tmp_path):
    path = tmp_path / "run.ckpt"
    ident = {"config": {"lr": 0.1}, "world_size": 3}
    checkpoint.save(path, ident, {"iteration": 5, "w": torch.ones(3)}, [{}, {}])
    before = path.read_bytes()

    class Exploding:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save(path, ident, {"iteration": 6, "bad": Exploding()}, [{}, {}])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt"]
    assert checkpoint.load(path, ident)[0]["server"]["iteration"] == 5
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="no usable checkpoint: .*junk.ckpt is damaged"):
        checkpoint.load(tmp_path / "junk.ckpt", ident)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_two_checkpoints_kept_and_a_damaged_newest_falls_back(tmp_path, damage):
    path = tmp_path / "run.ckpt"
    ident = {"config": {"lr": 0.1}, "world_size": 3}
    for iteration in (10, 20, 30):
        checkpoint.save(path, ident, {"iteration": iteration, "w": torch.arange(1000.0)}, [{}, {}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt", "run.ckpt.prev"]
    assert checkpoint.load(path, ident)[0]["server"]["iteration"] == 30
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data[:len(data) - 100] if damage == "truncate" else
                           b"" if damage == "empty" else data))
    warnings = []
    state, used = checkpoint.load(path, ident, warn=warnings.append)
    assert state["server"]["iteration"] == 20 and used == checkpoint.previous_path(path)
    assert len(warnings) == 1 and "run.ckpt is damaged" in warnings[0] and "older" in warnings[0]
    checkpoint.previous_path(path).write_bytes(b"garbage")
    with pytest.raises(UsageError, match="no usable checkpoint"):
        checkpoint.load(path, ident)
    # A checkpoint of another run is refused, not skipped.
    checkpoint.save(path, {"config": {"lr": 0.5}, "world_size": 3}, {"iteration": 1}, [])
    with pytest.raises(UsageError, match="different configuration"):
        checkpoint.load(path, ident)


DEADLINE_RUN = [*SMALL_RUN, "--iterations", "100000", "--walltime", "10s"]


@pytest.fixture(scope="module")
def deadline_run(tmp_path_factory, mpi_env):
    """A run stopped by its --walltime deadline: its result and its trace's path."""
    trace = tmp_path_factory.mktemp("deadline") / "deadline.h5"
    return run_mpi(3, ["train", "--trace", str(trace), *DEADLINE_RUN], mpi_env), trace


@pytest.mark.each_mpi
def test_walltime_deadline_stops_at_a_boundary_with_a_checkpoint(deadline_run):
    result, trace = deadline_run
    assert result.returncode == EXIT_REQUEUE, result.stderr + result.stdout[-2000:]
    assert "walltime deadline near: stopped after iteration" in result.stdout
    assert result.stderr == ""  # every rank finalized cleanly: no MPI_Abort noise
    tr = load(trace)
    assert tr.status == "stopped" and 1 <= len(tr.steps) < 100000
    assert trace.with_name("deadline.h5.ckpt").exists()
