"""``mpigrad train --check`` (issue 64 item 12): the job checked in one process, without
mpiexec, before it queues: a short report and exit 0, or one line and exit 2; no trace,
checkpoint or folder written either way."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from unittest import mock

import numba
import torch

import mpigrad.cli
import mpigrad.runtime
from conftest import REPO

#: Imported here, not first inside check()'s environment and redirected streams: their thread
#: counts and logging handlers are the suite's, not one check's.
IMPORTED_FIRST = (numba, torch, mpigrad.runtime)

PAPER = REPO / "examples" / "paper-12nodes" / "fix2.toml"
#: What a launcher or Slurm puts in the environment; a check sees none of it but what a test gives.
LAUNCHERS = ("SLURM_", "PMI_", "OMPI_", "PMIX_", "HYDRA_")


def _environment(environ: dict) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith(LAUNCHERS)}
    env.update(environ)
    return env


def check_command(tmp_path, *argv: str, **environ: str) -> subprocess.CompletedProcess:
    """``mpigrad train --check ARGV`` as a user runs it: a process of its own in ``tmp_path``."""
    return subprocess.run([sys.executable, "-m", "mpigrad", "train", "--check", *argv], cwd=tmp_path,
                          env=_environment(environ), capture_output=True, text=True, timeout=120)


def check(tmp_path, *argv: str, **environ: str) -> subprocess.CompletedProcess:
    """The same check in this process (``mpigrad.cli.main``, the command's entry), in
    ``tmp_path`` with the environment ``environ``: its exit code, stdout and stderr, as
    :func:`check_command` gives them, without paying a Python start-up and torch's import."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    with mock.patch.dict(os.environ, _environment(environ), clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        os.chdir(tmp_path)
        try:
            code = mpigrad.cli.main(["train", "--check", *argv])
        except SystemExit as exc:  # argparse's refusals; --help's exit(None) is 0
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        finally:
            os.chdir(here)
    return subprocess.CompletedProcess(["mpigrad", "train", "--check", *argv], code, out.getvalue(), err.getvalue())


def test_a_good_job_is_reported_and_nothing_is_written(tmp_path):
    began = time.monotonic()
    done = check_command(tmp_path, "--ranks", "3", "--lr-schedule", "CosineAnnealingLR", "--lr-warmup", "20",
                 "--iterations", "50", "--trace", "runs/a.h5")
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - began < 60
    lines = done.stdout.splitlines()
    assert lines[0] == ("model paper-cnn on digits: 9,143,498 parameters, 2 quantized layer(s) holding 98.4% "
                        "(uniform, mqgrad)")
    assert lines[1] == "recipe: lr 0.01, sgd CosineAnnealingLR(T_max=50) warm-up 20"
    assert lines[2] == "world: 3 ranks (--ranks): 1 server rank(s), 2 worker(s)"
    assert lines[3] == "trace: runs/a.h5 (new), checkpoint runs/a.h5.ckpt"
    assert lines[-1].startswith("mpigrad train --check: ok in ") and lines[-1].endswith(" s (no rank started)")
    assert done.stderr == ""
    assert list(tmp_path.iterdir()) == []  # no trace, no runs/ folder


def test_the_paper_config_on_digits_and_its_world(tmp_path):
    done = check(tmp_path, "--config", str(PAPER), "--data", "digits", "--lr", "0.01")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:4] == [
        f"mpigrad: note: {PAPER}'s data_dir = 'data/cifar10' went with its data 'cifar10', which --data digits "
        "replaced: dropped",
        "model paper-cnn on digits: 9,143,498 parameters, 1 quantized layer(s) holding 96.8% (uniform, fixed)",
        "recipe: lr 0.01",
        f"world: 12 ranks ({PAPER}'s '# ranks' line): 1 server rank(s), 11 worker(s)"]
    done = check(tmp_path, "--config", str(PAPER), "--data", "digits", "--ranks", "3")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"mpigrad train: error: {PAPER} is written for 12 ranks (its '# ranks: 12' "
                                        "line) but this run has 3: launch with mpiexec -n 12, or edit that line in a copy"]


def test_the_world_from_slurm_or_unknown(tmp_path):
    done = check(tmp_path, "--servers", "2", SLURM_NTASKS="2")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["mpigrad train: error: --servers 2 needs at least 3 MPI ranks (S servers and "
                                        "at least one worker), this run has 2"]
    done = check(tmp_path, "--iterations", "5")
    assert done.returncode == 0, done.stderr
    assert ("world: size unknown (give --ranks N, or run inside the Slurm job): ranks, servers and --link-bandwidth "
            "not checked; this run needs at least 2") in done.stdout.splitlines()


def test_the_nodes_after_the_world_and_bad_nodes_in_one_line(tmp_path):
    """Nodes of several workers (tests/test_topology.py has the rule): the ``nodes:`` line
    after the world's, then the notes (here Slurm's tasks per node, which do not give node 0
    rank 0's slot); nodes that cannot be, refused as at launch."""
    done = check(tmp_path, "--servers", "colocated", "--ranks-per-node", "2", "--iterations", "5",
                 SLURM_NTASKS="5", SLURM_TASKS_PER_NODE="3,2(x1)", SLURM_DISTRIBUTION="block")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    world = lines.index("world: 5 ranks (SLURM_NTASKS): colocated servers, 4 worker(s)")
    assert lines[world + 1].startswith("nodes: 2 of 2 worker(s) (from --ranks-per-node 2); node 0: ranks 0-2; "
                                       "node 1: ranks 3, 4; rank 0, the scheduler, on node 0; exchange: hierarchical")
    assert not [line for line in lines if "Slurm" in line]  # Slurm's layout gives node 0 rank 0's slot: no note
    done = check(tmp_path, "--servers", "colocated", "--ranks-per-node", "2", "--iterations", "5",
                 SLURM_NTASKS="5", SLURM_TASKS_PER_NODE="2(x2),1")
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if "note" in line] == [
        "mpigrad: note: --ranks-per-node 2 wants 3,2 tasks per node (rank 0 and 2 workers on node 0, 2 on each other); "
        "Slurm lays out 2(x2),1 (SLURM_TASKS_PER_NODE): the declared nodes are used (by the network model, and by the "
        "exchange's groups, which then do not follow the machines): ask Slurm for that layout, or declare the L it gives"]
    for argv, line in [
        (["--ranks", "4", "--ranks-per-node", "2"], "--ranks-per-node 2 does not divide the 3 workers: launch a multiple "
         "of 2 workers (mpiexec -n 3), or choose L among their divisors"),
        (["--ranks", "3", "--ranks-per-node", "2", "--exchange", "hierarchical"], "--exchange hierarchical on one node "
         "(2 workers, 2 per node): nothing crosses a NIC; use --exchange flat, or declare nodes with --ranks-per-node"),
    ]:
        done = check(tmp_path, "--servers", "colocated", *argv)
        assert (done.returncode, done.stderr.splitlines(), done.stdout) == (2, [f"mpigrad train: error: {line}"], ""), argv
    done = check(tmp_path, "--servers", "colocated", "--ranks-per-node", "auto", "--iterations", "5", "--ranks", "5")
    assert done.returncode == 0, done.stderr
    assert ("nodes: resolved at launch from MPI's shared-memory split (--ranks-per-node auto), and the exchange with "
            "them (--exchange auto)") in done.stdout.splitlines()


def test_bad_jobs_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "old.h5").write_bytes(b"")
    for argv, line in [
        (["--optimizer-opt", "nesterov=yes", "--optimizer-opt", "momentum=0.9"],
         "optimizer 'sgd': nesterov must be true or false, got 'yes'"),
        (["--trace", "taken", "--force"], "taken is a directory, not a file: give the path of a file (in it or elsewhere)"),
        (["--trace", "old.h5"], "old.h5 exists; pass --force to overwrite it or --trace to choose another"),
        (["--trace", "none.h5", "--resume"], "--resume: the trace none.h5 to continue does not exist"),
    ]:
        done = check(tmp_path, *argv)
        assert (done.returncode, done.stderr.splitlines(), done.stdout) == (2, [f"mpigrad train: error: {line}"], ""), argv
    done = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--ranks", "3"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr.splitlines()) == (
        2, ["mpigrad train: error: --ranks goes with --check (a launched run's world size is mpiexec's -n)"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.h5", "taken"]
