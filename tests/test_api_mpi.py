"""mpigrad.Session under real mpiexec: examples/api/train.py (its own model, data, AdamW,
OneCycleLR and a DataLoader with worker processes) against the same loop under torch DDP
(gloo), with the comparison's methods, and every misuse of tests/api_misuse.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpigrad.trace import load

from conftest import REPO, assert_same_trace, mpiexec, without_launcher_notice, world_pool

pytestmark = pytest.mark.mpi

EXAMPLE = REPO / "examples" / "api" / "train.py"
MISUSE = REPO / "tests" / "api_misuse.py"
COMPARE = REPO / "examples" / "compare"


def run_script(ranks: int, argv: list, env: dict, timeout: float = 180, world: bool = False) -> subprocess.CompletedProcess:
    """``mpiexec -n RANKS python -m mpi4py ARGV``; a hang fails the test. ``world``: in this
    worker's shared world instead where worlds are on (the script's ``main(argv, comm=)`` on
    a communicator of its ranks: examples/api/train.py's)."""
    pool = world_pool() if world else None
    try:
        if pool is not None:
            result = pool.run(ranks, {"program": str(argv[0]), "argv": [str(a) for a in argv[1:]]}, timeout)
        else:
            result = subprocess.run(mpiexec(ranks, [sys.executable, "-m", "mpi4py", *map(str, argv)]), env=env,
                                    capture_output=True, text=True, timeout=timeout)
    except (subprocess.TimeoutExpired, TimeoutError) as exc:
        pytest.fail(f"mpiexec did not finish within {timeout} s: {argv}\n{exc}")
    result.stderr = without_launcher_notice(result.stderr)
    assert "Numba kernel(s) during the run" not in result.stderr, result.stderr
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(prefix, workers: int = 2) -> list[list[float]]:
    return [json.loads((prefix.parent / f"{prefix.name}-{k}.json").read_text()) for k in range(workers)]


@pytest.mark.each_mpi
def test_the_example_in_float32_gives_ddps_losses_to_the_last_bit(tmp_path, mpi_env):
    """fp32 at P = 2: mpigrad's exchange puts in .grad what DDP's all-reduce does, so AdamW,
    OneCycleLR and the DataLoader's batches give every loss of DDP (gloo), bit for bit; the
    trace records them."""
    trace = tmp_path / "fp32.h5"
    mine = run_script(3, [EXAMPLE, "--config", COMPARE / "fp32.toml", "--trace", trace,
                          "--losses", tmp_path / "mpigrad"], mpi_env, world=True)
    assert mine.returncode == 0, mine.stderr
    assert "model script StripesNet on the script's data" in mine.stdout
    assert "fp32.toml's batch_size, data, eval_every, lr, model, model_opts, weight_decay are the script's" in mine.stdout
    assert "fp32: nothing quantized" in mine.stdout and "quantized layer(s)" not in mine.stdout
    config_line = next(line for line in mine.stdout.splitlines() if line.startswith("config: "))
    assert " bits=" not in config_line and "batch_size=" not in config_line, config_line
    ddp = run_script(2, [EXAMPLE, "--ddp", "--port", free_port(), "--losses", tmp_path / "ddp"], mpi_env)
    assert ddp.returncode == 0, ddp.stderr
    ours, theirs = losses(tmp_path / "mpigrad"), losses(tmp_path / "ddp")
    assert len(ours[0]) == len(theirs[0]) == 48  # 3 epochs of 16 batches per worker
    assert ours == theirs
    assert ours[0][-1] < 0.6 * ours[0][0]  # it learns
    run = load(trace)
    assert run.complete and len(run.steps) == 48
    for k in range(2):
        np.testing.assert_array_equal(run.workers[f"loss_{k}"].to_numpy(), np.array(ours[k]))
    assert run.config["optimizer"] == "script AdamW" and run.config["codec"] == "fp32"
    assert run.config["batch_size"] is None and run.config["lr"] is None  # the script's keys: not used by mpigrad


#: The example's options in the runs below (MQGrad with error feedback: state to checkpoint).
OPTIONS = ["--set", "progress_every=8", "--set", "error_feedback=residual", "--loader-workers", "1"]


@pytest.fixture(scope="module")
def mqgrad_straight(tmp_path_factory, mpi_env):
    """examples/api/train.py with MQGrad and error feedback, straight through: its trace."""
    trace = tmp_path_factory.mktemp("straight") / "mqgrad.h5"
    result = run_script(3, [EXAMPLE, "--config", COMPARE / "mqgrad.toml", "--trace", trace, *OPTIONS], mpi_env,
                        world=True)
    assert result.returncode == 0, result.stderr
    assert "iter 48/48" in result.stdout
    return trace


def test_the_comparisons_methods_trace_what_trace_summary_and_compare_read(tmp_path, mpi_env, mqgrad_straight):
    """Fix (2-bit) with colocated servers and the pipelined iteration (session.backward
    sends each bucket as backward produces it), MQGrad with one server: traces that ``trace
    summary`` and ``compare`` read and label."""
    result = run_script(3, [EXAMPLE, "--config", COMPARE / "fix2.toml", "--trace", tmp_path / "fix2.h5", *OPTIONS,
                            "--set", "servers=colocated", "--set", "pipeline=true"], mpi_env, world=True)
    assert result.returncode == 0, result.stderr
    assert "iter 48/48" in result.stdout and "each worker serving a shard (colocated)" in result.stdout
    shutil.copy(mqgrad_straight, tmp_path / "mqgrad.h5")
    summary = subprocess.run([sys.executable, "-m", "mpigrad", "trace", "summary", tmp_path / "fix2.h5",
                              tmp_path / "mqgrad.h5"], capture_output=True, text=True, env=mpi_env)
    assert summary.returncode == 0, summary.stderr
    assert "Fix (2-bit)" in summary.stdout and "MQGrad" in summary.stdout
    compare = subprocess.run([sys.executable, "-m", "mpigrad", "trace", "compare", "--target-loss", "1.3",
                              tmp_path / "fix2.h5", tmp_path / "mqgrad.h5"], capture_output=True, text=True, env=mpi_env)
    assert compare.returncode == 0, compare.stderr
    assert "Fix (2-bit)" in compare.stdout and "MQGrad" in compare.stdout
    print(compare.stdout)
    fix2, mqgrad = load(tmp_path / "fix2.h5"), load(tmp_path / "mqgrad.h5")
    assert (fix2.steps["bits"] == 2).all() and fix2.config["optimizer"] == "script AdamW"
    assert fix2.config["pipeline"] and fix2.config["servers"] == "colocated"
    assert len(mqgrad.policy) > 0 and mqgrad.config["policy"] == "mqgrad"  # the agent's own rows


MISUSES = {
    "models-differ": (1, "the model on rank 2 differs from rank 0's", None),
    "foreign-optimizer": (1, "the optimizer on rank 1 holds a parameter that is not the model's", None),
    "iterations-differ": (1, "worker rank 2 failed at iteration 0: worker rank 2 runs 3 iterations and rank 0 4: "
                             "set session.iterations alike on every rank", "failed"),
    "no-backward": (1, "worker rank 2 failed at iteration 1: exchange() found no gradient on any parameter", "failed"),
    "leaves-early": (1, "worker rank 2 failed at iteration 2: worker rank 2 left the training loop after 2 of 4 "
                        "iterations", "failed"),
    "raises": (1, "worker rank 1 failed at iteration 1: ValueError: the script's own bug", "failed"),
    "same-batches": (0, "the 2 workers' losses at iteration 0 are equal to the last bit: do they read the same "
                        "batches?", "complete"),
    "exchanges-twice": (1, "worker rank 2 failed at iteration 3: exchange() called twice without a backward() in "
                           "between (iteration 3)", "failed"),
}


def assert_one_line_per_rank(stderr: str, ranks: int = 3) -> list[str]:
    """mpigrad's errors reached stderr as one line each (``mpigrad: rank R: error: ...``), at
    most one per rank, and no traceback; the launcher's own abort notice aside. Returns them."""
    assert "Traceback" not in stderr and 'File "' not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("mpigrad: rank ") and ": error: " in line]
    assert len(errors) <= ranks and len({line.split(":")[1] for line in errors}) == len(errors), stderr
    return errors


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_each_misuse_ends_with_a_line_naming_it(tmp_path, mpi_env, case):
    code, line, status = MISUSES[case]
    trace = tmp_path / "misuse.h5"
    result = run_script(3, [MISUSE, "--case", case, "--trace", trace], mpi_env, timeout=120)
    assert (result.returncode != 0) == bool(code), result.stdout + result.stderr
    assert line in result.stdout + result.stderr
    errors = assert_one_line_per_rank(result.stderr)
    assert bool(errors) == bool(code), result.stderr
    if status is None:  # refused on every rank alike, before anything was written
        assert not trace.exists()
        assert (result.stdout + result.stderr).count(line) >= 2, result.stderr
        return
    with h5py.File(trace, "r") as f:
        assert f.attrs["status"] == status
        error = f.attrs.get("error", "")
    if case == "same-batches":  # and an exchange past the run's end is refused on each worker
        for rank in (1, 2):
            assert f"rank {rank}: exchange() called for iteration 5, but the run has 4" in result.stdout
    else:
        assert error == line or error.startswith(line), error  # the trace says who and why


@pytest.mark.parametrize("case, line", [
    ("no-serve", "mpigrad: rank 0: error: the script on rank 0 ended without calling session.serve(), which serves "
                 "the workers"),
    ("serve-late", "error: rank 0 sent no set-up data within 10 s: does the script call session.serve() on rank 0?"),
])
def test_a_rank_0_that_does_not_serve_is_named_within_the_timeout(tmp_path, mpi_env, case, line):
    """Rank 0's script ends without serve(): rank 0 says so at exit and ends every rank. Rank
    0 busy elsewhere (asleep for 120 s): each worker gives up after the Session's timeout
    (10 s), not twice it, asking for serve(). One line per rank, no trace."""
    trace = tmp_path / "misuse.h5"
    result = run_script(3, [MISUSE, "--case", case, "--trace", trace], mpi_env, timeout=90)
    assert result.returncode != 0, result.stdout + result.stderr
    errors = assert_one_line_per_rank(result.stderr)
    assert errors and all(line in error for error in errors), result.stderr
    assert not trace.exists()


def start_example(trace, env, *extra) -> subprocess.Popen:
    command = mpiexec(3, [sys.executable, "-m", "mpi4py", str(EXAMPLE), "--config", str(COMPARE / "mqgrad.toml"),
                          "--trace", str(trace), *OPTIONS, *map(str, extra)])
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def interrupt_after(process: subprocess.Popen, line: str, sig: int) -> tuple[int, str, str]:
    """Send ``sig`` to the whole run (as Slurm's forwarding does) once ``line`` is printed."""
    out = []
    for text in process.stdout:
        out.append(text)
        if line in text:
            os.killpg(process.pid, sig)
            break
    try:
        rest, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the run did not end after {signal.Signals(sig).name}: {''.join(out)}")
    return process.returncode, "".join(out) + rest, without_launcher_notice(err)


def test_a_scripts_run_stopped_killed_and_resumed_is_the_straight_run(tmp_path, mpi_env, mqgrad_straight):
    """MQGrad with error feedback: a walltime signal stops the run (worker 0 saves the model,
    AdamW, OneCycleLR and mpigrad's state, every rank exits 75), the resumed run checkpoints
    every 8 iterations and is killed (SIGKILL), the next resumes from its last checkpoint: the
    trace is the straight run's, row for row."""
    trace, saved = tmp_path / "requeued.h5", tmp_path / "requeued.pt"
    code, out, err = interrupt_after(start_example(trace, mpi_env, "--checkpoint", saved), "iter 16/48",
                                     signal.SIGUSR1)
    assert code == 75, out + err
    assert "received SIGUSR1: stopped after iteration" in out and "checkpoint to worker rank 1" in out
    assert load(trace).status == "stopped" and saved.exists()
    stopped_at = len(load(trace).steps)
    code, out, err = interrupt_after(start_example(trace, mpi_env, "--checkpoint", saved, "--set",
                                                   "checkpoint_every=8"), "iter 40/48", signal.SIGKILL)
    assert f"resuming from the state given at iteration {stopped_at}" in out, out + err
    assert "checkpoint after iteration 24: to worker rank 1" in out
    result = run_script(3, [EXAMPLE, "--config", COMPARE / "mqgrad.toml", "--trace", trace, *OPTIONS,
                            "--checkpoint", saved, "--set", "checkpoint_every=8"], mpi_env)
    assert result.returncode == 0, result.stderr
    resumed_at = re.search(r"resuming from the state given at iteration (\d+)", result.stdout)
    assert resumed_at and int(resumed_at.group(1)) in (32, 40), result.stdout  # the kill came after 40's line
    assert_same_trace(load(mqgrad_straight), load(trace))
    assert not saved.exists()  # the finished run removed its checkpoint
