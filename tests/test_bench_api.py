"""``mpigrad bench api``: the library's loop (mpigrad.bench.api_loop over mpigrad.Session)
against ``mpigrad train``, real mpiexec runs; and the config it writes for both."""

import json
import subprocess
import sys

import pytest

from mpigrad.bench.api import bench_config, losses_equal, verdict
from mpigrad.config import RunConfig, dump_toml, load_toml
from mpigrad.errors import UsageError


@pytest.mark.quick
def test_a_config_written_as_toml_reads_back_the_same(tmp_path):
    values = {"codec": "uniform", "bits": 3, "lr": 1e-05, "pipeline": True, "servers": "colocated", "bandwidth": "10MB/s",
              "model_opts": {"fc_sizes": [64, 64]}, "data_opts": {"shape": [3, 32, 32], "name": 'a "b"'},
              "lr_schedule": None, "link_bandwidth": {"2": "5MB/s"}, "compute_time": 0.05}
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(values))
    assert load_toml(str(path)) == {k: v for k, v in values.items() if v is not None}
    assert RunConfig.from_sources(str(path), {}).to_dict() == RunConfig.from_sources(None, values).to_dict()
    with pytest.raises(ValueError, match="seed: a object has no TOML form"):
        dump_toml({"seed": object()})
    odd = {"label": 'x\x7fy\U0001f600\n\t"q\\', "data_opts": {"k\U0001f600": [1, 2.5, 1e-05], "n": {"m": True}},
           "c": -0.0, "d": float("inf")}
    path.write_text(dump_toml(odd), encoding="utf-8")
    assert load_toml(str(path)) == odd
    with pytest.raises(ValueError, match="model_opts.x: a value inside a table or list cannot be None"):
        dump_toml({"model_opts": {"x": None}})


@pytest.mark.quick
def test_the_bench_config_merges_the_file_and_sets_and_refuses_checkpoints(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('codec = "uniform"\nbits = 4\nmodel_opts = {fc_sizes = [64, 64]}\n')
    values = bench_config(str(path), ["bits=2", "model_opts.conv_channels=[8,8]"], 30)
    assert values["bits"] == 2 and values["iterations"] == 30 and values["eval_every"] == 0
    assert values["model_opts"] == {"fc_sizes": [64, 64], "conv_channels": [8, 8]}
    with pytest.raises(UsageError, match="checkpoint_every: the bench times whole runs"):
        bench_config(None, ["checkpoint_every=5"], 30)
    with pytest.raises(UsageError, match="model_opts.x: a value inside a table or list cannot be None"):
        bench_config(None, ["model_opts.x=null"], 30)


@pytest.mark.quick
def test_losses_equal_names_the_first_iteration_that_differs():
    import pandas as pd

    class Trace:
        def __init__(self, rows):
            self.workers = pd.DataFrame(rows, columns=["loss_0", "loss_1"])

    same = Trace([[1.0, 2.0], [0.5, float("nan")]])
    assert losses_equal(same, Trace([[1.0, 2.0], [0.5, float("nan")]])).startswith("equal to the last bit")
    text = losses_equal(same, Trace([[1.0, 2.0], [0.5, 0.25]]))
    assert text.startswith("differ from iteration 1 on")


@pytest.mark.mpi
def test_bench_api_races_the_loop_against_train_and_finds_the_same_losses(mpi_env, tmp_path, world_relay):
    """Plain SGD at a constant rate, uniform 3-bit with error feedback, colocated servers:
    torch's SGD in the script's loop computes train's update, so every loss is the same."""
    command = [sys.executable, "-m", "mpigrad", "bench", "api", "--iterations", "8", "--warmup", "2",
               "--repeats", "1", "--set", "codec=uniform", "--set", "bits=3", "--set", "error_feedback=residual",
               "--set", "servers=colocated", "--set", "wait=sleep"]
    try:
        # train's run in this worker's world (the loop's script under an mpiexec of its own)
        result = subprocess.run(command, env=world_relay(mpi_env), capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired:
        pytest.fail("bench api did not finish")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "P=2 workers, colocated servers, uniform codec" in result.stdout
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["losses"].startswith("equal to the last bit (every worker's, all 8 iterations)")
    assert len(report["pairs"]) == 1 and report["train_ms"] > 0 and report["loop_ms"] > 0
    assert report["ratio"] == pytest.approx(report["loop_ms"] / report["train_ms"])


@pytest.mark.quick
def test_the_goal_gets_a_verdict_only_outside_the_pairs_spread():
    # The 2-core machine's pairs spread 0.70-1.64x around a 1.02x goal: met in one run,
    # missed in the next, if the median alone decided.
    assert verdict([0.70, 0.83, 1.64], 1.02).startswith("no verdict: the pairs' spread 0.700-1.640x straddles it")
    assert verdict([0.95, 0.99, 1.01], 1.02) == "met"
    assert verdict([1.03, 1.10, 1.2], 1.02) == "missed"
    assert verdict([1.02, 1.021], 1.02).startswith("no verdict")
    assert verdict([0.9], 1.02).startswith("no verdict: one pair shows no spread")
