"""examples/hard/: the teacher task's configs (they differ only in the width), a few
iterations of each through the loopback runtime, and run.py's tiny version under mpiexec."""

from __future__ import annotations

import subprocess
import sys
import threading
import tomllib

import numpy as np
import pytest

from conftest import REPO, load_script
from mpigrad.config import RunConfig
from mpigrad.data import load_dataset
from mpigrad.models import build_model
from mpigrad.runtime.plan.checks import check_options
from mpigrad.runtime.run.session import run_other_rank, run_parameter_server
from mpigrad.runtime.roles.stopping import StopFlag
from mpigrad.runtime.wire.loopback import LoopbackNetwork
from mpigrad.trace import load

HERE = REPO / "examples" / "hard"
SCRIPT = HERE / "run.py"


def load_run_py():
    return load_script(SCRIPT, "hard_run")


def test_the_configs_differ_only_in_the_width_and_quantize_every_convolution():
    run = load_run_py()
    assert run.METHODS == ("fp32", "fix8", "fix4", "fix2")
    shared = {}
    for method in run.METHODS:
        path = HERE / f"{method}.toml"
        assert "\n# ranks: 3\n" in path.read_text()
        config = RunConfig.from_sources(str(path), {})
        assert (config.data, config.model, config.lr, config.policy) == ("teacher", "resnet20", run.SHARED_LR, "fixed")
        assert (config.codec, config.bits) == (("fp32", config.bits) if method == "fp32" else ("uniform", int(method[3:])))
        with open(path, "rb") as f:
            shared[method] = {k: v for k, v in tomllib.load(f).items() if k not in ("codec", "bits")}
    assert all(c == shared["fix2"] for c in shared.values()), "the widths share everything else"
    # min_quantize_size takes every convolution and the classifier: all but BatchNorm's vectors
    config = RunConfig.from_sources(str(HERE / "fix2.toml"), {})
    data = load_dataset(config.data, seed=1, **{**config.data_opts, "train_size": 8, "test_size": 8})
    model = build_model(config.model, input_shape=data.input_shape, num_classes=data.num_classes)
    sizes = [p.numel() for p in model.parameters()]
    quantized = [n for n in sizes if n >= config.min_quantize_size]
    assert len(quantized) == 20 and sum(quantized) / sum(sizes) > 0.99   # 19 convolutions + the classifier


@pytest.mark.parametrize("method", ["fp32", "fix8", "fix4", "fix2", "lowrank", "progress", "mqgrad", "aimd", "accordion", "lgreco", "adaptive", "fp16"])
def test_each_config_trains_a_few_iterations(tmp_path, method):
    """Each config (the widths, and the map's other methods on this task: examples/map/run.py
    --setup hard), as shipped but for its length and data size, through the loopback runtime
    (every rank a thread of this process): a complete trace at the config's width."""
    overrides = dict(iterations=3, eval_every=0, progress_every=0, trace=str(tmp_path / "run.h5"),
                     data_opts={"train_size": 256, "test_size": 64})
    config = RunConfig.from_sources(str(HERE / f"{method}.toml"), overrides)
    check_options(config)       # what `mpigrad train` refuses before it starts
    net = LoopbackNetwork(3, 1, timeout=60.0)
    errors, codes = {}, {}

    def rank_main(rank):
        try:
            channel = net.channel(rank)
            codes[rank] = (run_parameter_server(config, channel, StopFlag(), ["test"], lambda message: None)
                           if rank == 0 else run_other_rank(config, channel))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert codes.get(0) == 0 and not errors, errors
    trace = load(config.trace)
    assert trace.complete and len(trace.steps) == 3 and np.isfinite(trace.steps["loss"]).all()
    assert trace.config["data"] == "teacher" and trace.config["codec"] == config.codec


@pytest.mark.mpi
def test_run_py_runs_and_reports_iterations_to_target(tmp_path, mpi_env, world_relay):
    out = tmp_path / "hard"
    listed = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--list"], env=mpi_env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == 24
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--smoke"], env=world_relay(mpi_env),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in out.glob("*.h5")) == ["fix2-lr0.2-s1.h5", "fp32-lr0.2-s1.h5"]
    table = (out / "iterations.md").read_text()
    assert "| width | lr | reached |" in table and "| fp32 | 0.2 | 1/1 |" in table
    assert (out / "shared-lr.md").exists() and (out / "best-lr.png").exists()
