"""``mpigrad bench iteration --model``: real mpiexec runs of the chosen model, figures read from traces."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.mpi


def test_bench_iteration_runs_the_chosen_model(mpi_env, world_relay):
    command = [sys.executable, "-m", "mpigrad", "bench", "iteration", "--model", "resnet20", "--workers", "1",
               "--servers", "1,colocated", "--iterations", "8", "--warmup", "2", "--", "--batch-size", "8",
               "--wait", "sleep"]  # two ranks on two cores would spin: rank 0's CPU time then is its wall time
    try:
        # its runs in this worker's world: each run's figures are its own iterations'
        result = subprocess.run(command, env=world_relay(mpi_env), capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired:
        pytest.fail("bench iteration did not finish")
    assert result.returncode == 0, result.stderr
    assert "resnet20 on synthetic 3x32x32" in result.stdout
    assert "of it polls = the part of it spent polling" in result.stdout and "x S=1 = that over" in result.stdout
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["model"] == "resnet20" and [r["workers"] for r in report["results"]] == [1, 1]
    assert [r["servers"] for r in report["results"]] == [1, "colocated"]
    for row in report["results"]:
        assert row["compute_ms"] > 0 and row["encode_ms"] > 0 and row["decode_ms"] > 0
        assert 0 < row["overhead_fraction_wall"] < 1 and row["rank0_cpu_ms"] > 0
    # That rank 0 serving no shard does less (no decode and re-encode of its own) is a speed
    # claim: the bench's own output shows it; as an assertion it failed under CI's load (medians
    # of 2 iterations once came out 4.0 against 3.7 ms, and 6 did not make it safe).


def test_bench_trace_prints_the_cost_per_flush_interval():
    command = [sys.executable, "-m", "mpigrad", "bench", "trace", "--iterations", "300", "--flush", "100,50",
               "--repeat", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["100", "50"] and rows[0][2] == "1.00"
    assert all(float(row[1]) > 0 and float(row[3]) > 0 for row in rows)


def test_bench_trace_refuses_a_bad_flush_list():
    command = [sys.executable, "-m", "mpigrad", "bench", "trace", "--flush", "100,x"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--flush must be comma-separated integers" in result.stderr
