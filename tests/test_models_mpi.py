"""ResNets under a real mpiexec: learning, BatchNorm statistics across replicas, checksums."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO, mpiexec, run_mpi, world_pool
from mpigrad.trace import load

pytestmark = pytest.mark.mpi

RESNET20 = ["--model", "resnet20", "--lr", "0.1", "--weight-decay", "5e-4", "--min-quantize-size", "2000",
            "--policy", "fixed", "--bits", "4", "--progress-every", "10"]


def test_resnet20_learns_digits_and_rank0_evaluates_with_the_workers_statistics(tmp_path, mpi_env):
    trace = tmp_path / "r20.h5"
    result = run_mpi(3, ["train", "--trace", str(trace), *RESNET20, "--iterations", "60",
                         "--eval-every", "30", "--checksum-every", "10"], mpi_env, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "model resnet20 on digits" in result.stdout and "269,434 parameters" in result.stdout
    tr = load(tmp_path / "r20.h5")
    # Rank 0 never trains: without the averaged running statistics its eval-mode BatchNorm
    # would normalise with mean 0 / variance 1 and score near chance (0.1).
    assert list(tr.eval["iteration"]) == [29, 59]
    assert tr.eval["test_accuracy"].iloc[-1] > 0.8, tr.eval
    # Parameters (BatchNorm's scales and shifts among them) agree bit for bit on every rank.
    assert list(tr.checksums["iteration"]) == [0, 10, 20, 30, 40, 50]
    assert tr.checksums.filter(like="checksum").nunique(axis=1).eq(1).all()


def test_a_diverged_replica_is_still_caught_with_batchnorm(tmp_path, mpi_env):
    env = dict(mpi_env, MPIGRAD_INJECT_FAULT="diverge:2:3")
    result = run_mpi(3, ["train", "--trace", str(tmp_path / "d.h5"), *RESNET20, "--iterations", "20",
                         "--eval-every", "0", "--checksum-every", "5"], env, timeout=400)
    assert result.returncode == 1
    assert ("replicas diverged before iteration 5: parameter checksum of rank(s) 2 differs from rank 0's"
            in result.stderr), result.stderr


@pytest.fixture(scope="module")
def buffer_sync_checks(mpi_env):
    """tests/buffer_sync_ranks.py on 4 ranks, with 1 then 2 servers in the same mpiexec (in
    this worker's world where worlds are on: the script's ``main(argv, comm=)``)."""
    script = REPO / "tests" / "buffer_sync_ranks.py"
    pool = world_pool()
    try:
        if pool is not None:
            return pool.run(4, {"program": str(script), "argv": ["1", "2"]}, timeout=300)
        command = mpiexec(4, [sys.executable, "-m", "mpi4py", str(script), "1", "2"])
        return subprocess.run(command, env=mpi_env, capture_output=True, text=True, timeout=300)
    except (subprocess.TimeoutExpired, TimeoutError):
        pytest.fail("buffer synchronisation hung")


@pytest.mark.parametrize("servers", [1, 2])
def test_buffer_sync_leaves_every_rank_with_the_workers_average(buffer_sync_checks, servers):
    result = buffer_sync_checks
    assert result.returncode == 0, result.stdout + result.stderr
    # mpiexec may interleave the ranks' lines
    assert (sorted(re.findall(rf"servers {servers}: rank \d+: (?:ok|MISMATCH)", result.stdout))
            == [f"servers {servers}: rank {r}: ok" for r in range(4)]), result.stdout
