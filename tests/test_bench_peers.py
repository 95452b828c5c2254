"""``mpigrad bench peers``: torch DDP (fp32, fp16 hook, PowerSGD) beside mpigrad, one tiny real run."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from mpigrad.bench.peers import VARIANTS, powersgd_bytes, powersgd_elements, ring_allreduce_bytes
from mpigrad.cli import main as cli_main

TINY = """# ranks: 3
policy = "fixed"
codec = "fp32"
iterations = 8
batch_size = 16
lr = 0.05
weight_decay = 0.004
model = "paper-cnn"
data = "digits"
seed = 1
[model_opts]
fc_sizes = [64, 64]
"""
#: Smoothed over 2 losses, every variant reached it in the measured runs (first losses ~2.41).
TARGET = 2.40


def test_ring_and_powersgd_bytes_by_hand():
    assert ring_allreduce_bytes(2, 1000) == 4000          # 2 (P-1)/P * 4 n at P = 2
    assert ring_allreduce_bytes(4, 1000) == 6000
    assert ring_allreduce_bytes(2, 1000, 2) == 2000       # the fp16 hook
    shapes = [(64, 3, 5, 5), (64,), (384, 192), (10, 192)]
    # (64, 75) r 2: P 128, Q 150; (64,) is a vector: 64 uncompressed; (384, 192): P 768, Q 384;
    # (10, 192): 202 * 2 * 2 = 808 < 1920, so P 20, Q 384.
    assert powersgd_elements(shapes, 2) == (64, 916, 918)
    assert powersgd_bytes(2, shapes, 2) == 4 * (64 + 916 + 918)
    assert powersgd_bytes(4, shapes, 2) == 6 * (64 + 916 + 918)
    # (10, 192) at rank 4: 202 * 4 * 2 = 1616 < 1920 still compressed; at rank 5 it is not.
    assert powersgd_elements([(10, 192)], 4) == (0, 40, 768)
    assert powersgd_elements([(10, 192)], 5) == (1920, 0, 0)


def test_the_byte_rule_is_torchs():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    for n, m in [(64, 75), (64, 1), (10, 192), (2, 2), (300, 4), (5, 5)]:
        for rank in (1, 2, 4):
            r = min(n, m, rank)
            compressed = powersgd_elements([(n, m)], rank)[0] == 0
            assert compressed == _should_compress(n, m, r, 2)[0], (n, m, rank)


@pytest.fixture(scope="module")
def peers_run(tmp_path_factory, mpi_env, world_relay):
    root = tmp_path_factory.mktemp("peers")
    config = root / "tiny.toml"
    config.write_text(TINY)
    out = root / "out"
    command = [sys.executable, "-m", "mpigrad", "bench", "peers", "--config", str(config), "--out", str(out),
               "--warmup", "2", "--target-loss", str(TARGET), "--smooth", "2", "--seeds", "1,2", "--breakdown"]
    try:
        # mpigrad's runs in this worker's world, DDP's under their own mpiexec
        done = subprocess.run(command, env=world_relay(mpi_env), capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("bench peers did not finish")
    assert done.returncode == 0, done.stderr
    return out, done.stdout


@pytest.mark.mpi
def test_every_variant_trains_and_is_tabled(peers_run):
    from mpigrad.trace import load

    out, stdout = peers_run
    report = json.loads((out / "peers.json").read_text())
    methods = [row["method"] for row in report["rows"]]
    assert methods == [v.label for v in VARIANTS.values()] + ["FP32"]
    assert report["workers"] == 2 and report["powersgd_start"] == 2 and report["seeds"] == [1, 2]
    for row in report["rows"]:
        assert row["method"] in stdout and len(row["traces"]) == 2
        for name, seed in zip(row["traces"], (1, 2)):
            trace = load(out / name)
            assert trace.config["seed"] == seed and name.endswith(f"-seed{seed}.h5")
            losses = trace.steps["loss"].to_numpy()
            assert len(losses) == 8 and np.isfinite(losses).all() and losses[-1] < losses[0]
            if "peer" in trace.config:  # each rank's losses, and the global loss their mean
                ranks = trace.workers[["loss_0", "loss_1"]].to_numpy()
                assert np.allclose(ranks.mean(axis=1), losses) and not np.allclose(ranks[:, 0], ranks[:, 1])
        assert row["s_per_iteration"] > 0 and row["s_p10"] <= row["s_per_iteration"] <= row["s_p90"]
        assert row["reached"] == 2 and row["iterations_to_target"] >= 1 and row["seconds_to_target"] > 0
    mpigrad = report["rows"][-1]
    assert mpigrad["iteration_vs_mpigrad"] == 1.0 and mpigrad["target_vs_mpigrad"] == 1.0
    assert f"compare them with: mpigrad trace compare {out}/*.h5 --target-loss {TARGET:g} --smooth 2" in stdout


@pytest.mark.mpi
def test_breakdown_splits_each_iteration_from_the_traces_and_phase_logs(peers_run):
    """--breakdown: per method the medians of the trace's own columns (DDP's compute and
    hook seconds written there), the rest what they leave of s/it; mpigrad's phases from its
    ranks' logs (rank 0 gathers the losses while the workers compute)."""
    from mpigrad.bench.breakdown import PHASE_ORDER, worker_compute
    from mpigrad.trace import load

    out, stdout = peers_run
    report = json.loads((out / "peers.json").read_text())
    rows = report["breakdown"]["rows"]
    assert [r["method"] for r in rows] == [r["method"] for r in report["rows"]]
    assert "where an iteration goes" in stdout and "mpigrad's phases" in stdout
    for row, peer_row in zip(rows, report["rows"]):
        traces = [load(out / name) for name in peer_row["traces"]]
        first = [3 if "PowerSGD" in row["method"] else 2] * 2     # PowerSGD's start + 1
        pick = lambda col: np.concatenate([t.steps[col].to_numpy(float)[f:] for t, f in zip(traces, first)])  # noqa
        wall = np.concatenate([np.diff(t.steps["wall_time"].to_numpy(float), prepend=0.0)[f:]
                               for t, f in zip(traces, first)])
        codec = np.nan_to_num(pick("t_encode")) + np.nan_to_num(pick("t_decode")) + pick("t_policy")
        assert np.isfinite(pick("t_compute")).all()      # DDP's forward + backward, too
        compute = pick("t_compute")
        if "peer" not in traces[0].config:  # mpigrad: its workers' begin phase, wall seconds
            compute = np.concatenate([worker_compute(out / f"phases-seed{seed}", 8, [1, 2])[f:]
                                      for seed, f in zip((1, 2), first)])
        assert row["s_per_iteration"] == pytest.approx(np.median(wall))
        assert row["compute"] == pytest.approx(np.median(compute)) and row["compute"] > 0
        assert row["codec"] == pytest.approx(np.median(codec)) and row["wire"] is None
        assert row["rest"] == pytest.approx(np.median(wall - compute - codec))
        assert (row["codec"] == 0) == (row["method"] == "DDP fp32")   # no hook: no codec work
    phases = {p["phase"]: p for p in report["breakdown"]["phases"]}
    assert set(phases) <= set(PHASE_ORDER) and {"begin", "losses", "gradients", "end"} <= set(phases)
    assert phases["begin"]["worker_ms"] > 0 and phases["losses"]["rank0_ms"] > 0
    assert phases["begin"]["rank0_device_ms"] is None       # no GPU: host times only
    assert sorted(p.name for p in out.glob("phases-seed*")) == ["phases-seed1", "phases-seed2"]


def test_phase_rows_read_device_times_where_a_rank_logged_them(tmp_path):
    """A rank on a GPU logs "d" (ms per phase on its stream): the phase table shows them
    beside the host's; a rank without them leaves the device columns empty."""
    from mpigrad.bench.breakdown import phase_rows

    log = tmp_path / "phases"
    log.mkdir()
    for rank, device in ((0, None), (1, {"begin": 4.0, "gradients": 1.5}), (2, {"begin": 6.0, "gradients": 0.5})):
        lines = []
        for m in range(3):
            line = {"m": m, "rank": rank, "t": {"start": 10.0 * m, "begin": 10.0 * m + 0.002 * (rank + 1),
                                                 "gradients": 10.0 * m + 0.01}}
            if device:
                line["d"] = device
            lines.append(json.dumps(line))
        (log / f"rank-{rank}.jsonl").write_text("\n".join(lines) + "\n")
    rows = {r.phase: r for r in phase_rows([log], [1], [1, 2])}
    assert rows["begin"].rank0_ms == pytest.approx(2.0) and rows["begin"].worker_ms == pytest.approx(6.0)
    assert rows["gradients"].worker_ms == pytest.approx(10.0 - 4.0)      # the slowest worker's span
    assert rows["begin"].worker_device_ms == pytest.approx(6.0) and rows["gradients"].worker_device_ms == 1.5
    assert rows["begin"].rank0_device_ms is None


@pytest.mark.mpi
def test_each_run_says_when_it_starts_and_ends(peers_run):
    _, stdout = peers_run
    assert "PowerSGD from iteration 2" in stdout and "12 run(s): DDP fp32, DDP fp16 hook" in stdout
    for k, (seed, method) in enumerate([(s, m) for s in (1, 2) for m in [v.label for v in VARIANTS.values()]
                                        + ["mpigrad FP32"]]):
        run = f"] run {k + 1}/12: {method}, seed {seed}: "
        assert run + "started" in stdout and run + "finished, 8 iterations in " in stdout, stdout


@pytest.mark.mpi
def test_bytes_per_node_follow_the_hooks(peers_run):
    from mpigrad.data import load_dataset
    from mpigrad.models import build_model
    from mpigrad.trace import load

    out, _ = peers_run
    digits = load_dataset("digits", seed=1)
    model = build_model("paper-cnn", input_shape=digits.input_shape, num_classes=digits.num_classes, seed=1,
                        fc_sizes=[64, 64])
    shapes = [tuple(p.shape) for p in model.parameters()]
    n = sum(p.numel() for p in model.parameters())
    rows = {row["method"]: row for row in json.loads((out / "peers.json").read_text())["rows"]}
    assert rows["DDP fp32"]["sent_mb_per_node"] == pytest.approx(ring_allreduce_bytes(2, n) / 1e6)
    assert rows["DDP fp16 hook"]["sent_mb_per_node"] == pytest.approx(ring_allreduce_bytes(2, n, 2) / 1e6)
    for rank in (1, 2, 4):
        trace = load(out / f"ddp-powersgd{rank}-seed1.h5")
        per_node = (trace.steps["bytes_up"] + trace.steps["bytes_down"]).to_numpy() / 2
        # iterations 0 and 1 all-reduce the whole bucket (start_powerSGD_iter = 2), then P and Q
        assert per_node[:2] == pytest.approx(ring_allreduce_bytes(2, n), abs=1)
        assert per_node[2:] == pytest.approx(powersgd_bytes(2, shapes, rank), abs=1)
    # mpigrad fp32: a worker's frame is its float32 gradient plus a header of a few bytes
    assert rows["FP32"]["sent_mb_per_node"] == pytest.approx(4 * n / 1e6, rel=1e-3)


@pytest.mark.mpi
def test_ddp_fp32_and_mpigrad_fp32_losses_track(peers_run):
    """Same init, shards, batches, lr and weight decay: measured identical to the last bit
    here (P = 2: the two-term sum does not depend on the order); the band allows float noise."""
    from mpigrad.trace import load

    out, _ = peers_run
    for seed in (1, 2):
        ddp = load(out / f"ddp-fp32-seed{seed}.h5").steps["loss"].to_numpy()
        ours = load(out / f"mpigrad-seed{seed}.h5").steps["loss"].to_numpy()
        assert np.abs(ddp - ours).max() < 1e-4
    assert np.abs(ddp - load(out / "ddp-fp32-seed1.h5").steps["loss"].to_numpy()).max() > 1e-3  # seeds differ


@pytest.mark.mpi
def test_trace_compare_reads_ddp_runs_as_groups(peers_run, capsys):
    out, _ = peers_run
    files = sorted(str(p) for p in out.glob("*.h5"))
    assert cli_main(["trace", "compare", *files, "--target-loss", str(TARGET), "--smooth", "2"]) == 0
    captured = capsys.readouterr()
    table = captured.out
    for label in [v.label for v in VARIANTS.values()] + ["FP32"]:
        rows = [line.split() for line in table.splitlines() if line.startswith(label + " ")]
        assert len(rows) == 1 and "2/2" in rows[0], table  # one group, both seeds
    assert "different network" not in table + captured.err  # DDP's traces record the network as mpigrad's do
    from mpigrad.trace import load, network

    ddp_attrs = load(out / "ddp-fp32-seed1.h5").attrs
    assert network.text(ddp_attrs) == network.text(load(out / "mpigrad-seed1.h5").attrs) == "host"
    assert "not recorded" not in network.details(ddp_attrs)


@pytest.mark.mpi
def test_trace_compare_models_the_ddp_runs_on_each_network_of_the_runs(peers_run, tmp_path, capsys):
    """--peers: bench peers' real DDP runs beside mpigrad's on the simulated clock, per network,
    with vs_best_ddp; the model's clock by hand for DDP fp32."""
    import io

    import pandas as pd

    from mpigrad.analysis.peers import load_peer_runs, model_peer_trace
    from test_compare import write

    out, _ = peers_run
    networks = [{"bandwidth": 1e6, "latency": 0.001, "compute_time": 0.05, "net_mode": "virtual"},
                {"bandwidth": 1e9, "latency": 0.001, "compute_time": 0.05, "net_mode": "virtual"}]
    # mpigrad's runs (synthetic): loss 2.0 - 0.1 (i + 1), 0.2 s per iteration at either rate
    files = [write(tmp_path / f"fp32-{k}-s{s}.h5", codec="fp32", seed=s, seconds_per_iteration=0.2, network=net,
                   iterations=8) for k, net in enumerate(networks) for s in (1, 2)]
    peers = load_peer_runs(out)
    assert sorted({t.label for t in peers}) == sorted(v.label for v in VARIANTS.values())   # mpigrad's row left out
    ddp = next(t for t in peers if t.label == "DDP fp32" and t.config["seed"] == 1)
    slow = model_peer_trace(ddp, 1e6, 0.001, 0.05)
    per_node = (ddp.steps["bytes_up"] + ddp.steps["bytes_down"]).to_numpy() / 2      # P = 2
    expected = np.cumsum(0.05 + 2 * 0.001 + per_node / 1e6)                          # one all-reduce, 2 ring steps
    assert np.allclose(slow.steps["sim_time"].to_numpy(), expected)
    assert slow.label == "DDP fp32 (modelled)" and list(slow.steps["loss"]) == list(ddp.steps["loss"])
    code = cli_main(["trace", "compare", *map(str, files), "--target-loss", str(TARGET), "--smooth", "2",
                     "--peers", str(out / "peers.json"), "--format", "csv"])
    table = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)
    assert code == 0
    ddp_rows = table[table["method"].str.startswith("DDP")]
    assert len(ddp_rows) == 2 * len(VARIANTS) and set(ddp_rows["runs"]) == {"2/2"}    # every variant on both networks
    for bandwidth in ("1MB/s", "1GB/s"):
        mine = table[table["method"].str.contains(f"bandwidth={bandwidth},", regex=False)]
        ddp_here = mine[mine["method"].str.startswith("DDP")]
        assert len(ddp_here) == len(VARIANTS) and "N/A" not in set(mine["vs_best_ddp"])
        assert ddp_here["vs_best_ddp"].astype(float).min() == 1.0     # the best DDP variant is the reference
        assert mine[mine["method"].str.startswith("FP32")]["vs_fp32"].astype(float).tolist() == [1.0]
    assert cli_main(["trace", "compare", *map(str, files), "--target-loss", "1", "--peers", str(tmp_path)]) == 2


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli_main(["bench", "peers", "--config", str(tmp_path / "none.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    assert cli_main(["bench", "peers", "--config", str(config), "--variants", "fp32,powersgd3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown DDP variant 'powersgd3'" in err
    assert cli_main(["bench", "peers", "--config", str(config), "--seeds", "1,x"]) == 2
    assert "--seeds expects comma-separated integers" in capsys.readouterr().err
    assert cli_main(["bench", "peers", "--config", str(config), "--", "--model-opt", "fc_sizes=[0]"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    # DDP gets the config's optimizer; momentum correction has none to match (no unlike runs compared)
    assert cli_main(["bench", "peers", "--config", str(config), "--", "--momentum-correction", "0.9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "momentum correction has no DDP twin" in err


def test_lab_and_variant_refusals_are_one_line(tmp_path, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    assert cli_main(["bench", "peers", "--config", str(config), "--variants", "none", "--no-mpigrad"]) == 2
    assert "leaves nothing to run" in capsys.readouterr().err
    assert cli_main(["bench", "peers", "--config", str(config), "--workers", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is written for 3 ranks" in err and "need 5" in err
    assert cli_main(["bench", "peers", "--config", str(config), "--lab", "10"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no unit" in err


@pytest.mark.mpi
def test_earlier_results_are_kept_unless_forced(tmp_path, capsys):
    """An existing trace or peers.json in --out: one line, exit 2, nothing written, before any
    run; --force runs and replaces it."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "out"
    out.mkdir()
    (out / "ddp-fp32-seed2.h5").write_bytes(b"keep me")
    command = ["bench", "peers", "--config", str(config), "--out", str(out), "--variants", "fp32",
               "--no-mpigrad", "--iterations", "3", "--warmup", "0", "--seeds", "1,2"]
    assert cli_main(command) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert f"{out / 'ddp-fp32-seed2.h5'} exists; pass --force to overwrite it" in captured.err
    assert sorted(p.name for p in out.iterdir()) == ["ddp-fp32-seed2.h5"]
    (out / "ddp-fp32-seed2.h5").unlink()
    (out / "peers.json").write_text("keep me")
    assert cli_main(command) == 2 and "peers.json exists" in capsys.readouterr().err
    assert cli_main([*command, "--force"]) == 0
    assert json.loads((out / "peers.json").read_text())["seeds"] == [1, 2]
    assert "--target-loss LOSS --smooth" in capsys.readouterr().out  # no target given: a placeholder


def test_an_earlier_breakdowns_phase_logs_are_replaced_with_force(tmp_path, capsys):
    """--breakdown's phase-log folder of an earlier run: without --force one line, exit 2; with
    it the bench goes on (the run empties the folder: a phase log appends), here to the next
    check, which refuses the workers."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "out"
    (out / "phases-seed1").mkdir(parents=True)
    command = ["bench", "peers", "--config", str(config), "--out", str(out), "--variants", "fp32", "--breakdown",
               "--iterations", "3", "--seeds", "1"]
    assert cli_main(command) == 2
    assert f"{out / 'phases-seed1'} exists; pass --force to overwrite it" in capsys.readouterr().err
    assert cli_main([*command, "--force", "--workers", "3", "--ranks-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert "exists" not in err and "is a directory" not in err and err.count("\n") == 1, err


@pytest.mark.mpi
def test_progress_lines_while_runs_go_and_no_powersgd_without_it(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    command = [sys.executable, "-m", "mpigrad", "bench", "peers", "--config", str(config), "--out", str(tmp_path / "o"),
               "--variants", "fp32", "--no-mpigrad", "--iterations", "3", "--warmup", "0", "--progress-interval", "0.5"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "PowerSGD" not in lines[0] and lines[1].startswith("1 run(s): DDP fp32 on each seed"), lines[:2]
    # DDP's ranks take seconds to import torch and meet: periodic lines before the run starts
    assert any(re.search(r"\] seed 1: starting DDP's 2 ranks, \d+ s so far$", line) for line in lines), lines
    assert any(line.endswith("] run 1/1: DDP fp32, seed 1: started") for line in lines)
    assert any("] run 1/1: DDP fp32, seed 1: finished, 3 iterations in " in line for line in lines)


def _lab_reason():
    from mpigrad.lab.host import unavailable_reason
    return unavailable_reason() if sys.platform.startswith("linux") else "network namespaces need Linux"


@pytest.mark.lab
@pytest.mark.mpi
@pytest.mark.skipif(_lab_reason() is not None, reason="mpigrad lab cannot run here")
def test_ddp_and_colocated_mpigrad_run_in_a_network_lab(tmp_path):
    """--lab: DDP's ranks in lab nodes of their own (--launch each), then mpigrad's (rank 0 on
    a node of its own) with colocated servers: both trained, the same losses, bytes per node
    as a ring all-reduce's, and no namespace left."""
    from mpigrad.lab.netns import namespaces
    from mpigrad.trace import load, network

    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "mpigrad", "bench", "peers", "--config", str(config), "--out", str(out),
               "--variants", "fp32", "--iterations", "5", "--warmup", "1", "--lab", "20MB/s", "--breakdown",
               "--", "--servers", "colocated", "--shard-chunk", "2048"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a network lab at 20MB/s per link" in done.stdout
    report = json.loads((out / "peers.json").read_text())
    assert report["lab"] == "20MB/s" and [r["method"] for r in report["rows"]] == ["DDP fp32", "FP32"]
    ddp, ours = report["rows"]
    assert abs(ddp["sent_mb_per_node"] - ours["sent_mb_per_node"]) < 0.02 * ddp["sent_mb_per_node"]
    ours_trace = load(out / "mpigrad-seed1.h5")
    assert ours_trace.config["servers"] == "colocated"
    np.testing.assert_allclose(load(out / "ddp-fp32-seed1.h5").steps["loss"], ours_trace.steps["loss"], atol=1e-4)
    assert [ns for ns in namespaces() if ns.startswith("mgbp-")] == []
    # DDP's trace records the lab its ranks ran in, as mpigrad's does: one network, one group
    ddp_attrs = load(out / "ddp-fp32-seed1.h5").attrs
    assert network.text(ddp_attrs) == network.text(ours_trace.attrs) == "lab 20MB/s"
    assert network.details(ddp_attrs) == "lab 20MB/s (2 nodes of mpigrad lab)"   # P ranks, where mpigrad has P + 1
    for row, peer_row in zip(report["breakdown"]["rows"], report["rows"]):   # the bytes at the link's rate
        assert row["wire"] == pytest.approx(peer_row["sent_mb_per_node"] * 1e6 / 20e6, rel=0.02)


def test_ddp_takes_nccl_only_where_each_rank_has_a_gpu_of_its_own():
    from mpigrad.bench.peers import ddp_backend

    assert ddp_backend("cpu", 4, 0) == ("gloo", None)
    assert ddp_backend("cuda", 2, 2) == ("nccl", None)
    backend, line = ddp_backend("cuda", 2, 1)
    assert backend == "gloo" and line.startswith("2 DDP ranks share 1 GPU: DDP runs over gloo on CUDA tensors")
    from mpigrad.bench.peers import mpigrad_gpu_ranks

    assert mpigrad_gpu_ranks(2, "colocated", True) == 2 and mpigrad_gpu_ranks(2, 1, False) == 3


def _bytes_trace(config: dict, up, down, bytes_in=None, bytes_out=None, sent=None):
    """A loaded trace's shape for ``node_bytes``: steps, and where given the per-server and
    per-worker byte columns (one iteration)."""
    import pandas as pd

    from mpigrad.trace import Trace

    arrays = {"steps": {"bytes_up": np.array([up]), "bytes_down": np.array([down])}}
    if bytes_in is not None:
        arrays["servers"] = {"bytes_in": np.array([bytes_in]), "bytes_out": np.array([bytes_out])}
        arrays["workers"] = {"bytes_sent": np.array([sent])}
    return Trace(path=None, schema_version=1, config=config, attrs={},
                 tables={"steps": pd.DataFrame({"bytes_up": [up], "bytes_down": [down]})}, arrays=arrays)


def test_wire_counts_the_busiest_node_where_shards_are_unequal():
    """Colocated shards of 900, 60 and 40 bytes per frame (a layer too large to share): node
    0 receives two 900-byte frames and sends its average twice, 1900 bytes each way, where an
    even split would give every node 1333; with two separate servers, server 0 sends its
    510-byte broadcast to 3 workers and receives 1500 bytes of frames and server 1's 110-byte
    broadcast; with the big shard on server 1, it sends 4 copies (rank 0 takes one). A DDP
    trace (a ring, even) keeps (up + down) / P."""
    from mpigrad.bench.breakdown import node_bytes

    frames, out = np.array([900, 60, 40]), np.array([900, 60, 40])
    colocated = _bytes_trace({"servers": "colocated"}, 2000, 2000, bytes_in=2 * frames, bytes_out=out,
                             sent=frames.sum() - frames)
    assert node_bytes(colocated, 3, 3, True).tolist() == [1900.0]
    servers = _bytes_trace({"servers": 2}, 1800, 1970, bytes_in=[1500, 300], bytes_out=[510, 110],
                           sent=[600, 600, 600])
    assert node_bytes(servers, 3, 2, False).tolist() == [1610.0]
    swapped = _bytes_trace({"servers": 2}, 1800, 2190, bytes_in=[300, 1500], bytes_out=[110, 510],
                           sent=[600, 600, 600])
    assert node_bytes(swapped, 3, 2, False).tolist() == [2040.0]
    ddp = _bytes_trace({"peer": "ddp"}, 2000, 2000)
    assert node_bytes(ddp, 2, 1, True).tolist() == [2000.0]


#: TINY under a CNN user's recipe: SGD with Nesterov momentum and its own weight decay, a
#: cosine schedule after a linear warm-up, random crops and flips (issue 44) of small
#: synthetic images that allow them, bf16 autocast; the config file gives both sides the
#: same recipe.
RECIPE_TOML = TINY.replace("iterations = 8", "iterations = 12").replace('data = "digits"', """data = "synthetic"
augment = "crop-flip"
weight_decay_in = "optimizer"
autocast = "bf16"
optimizer = "sgd"
lr_schedule = "CosineAnnealingLR"
lr_warmup = 3""").replace("[model_opts]", """[data_opts]
shape = [3, 12, 12]
augmentable = true
signal = 2.0
train_size = 512
test_size = 64
[augment_opts]
padding = 2
[optimizer_opts]
momentum = 0.9
nesterov = true
[lr_schedule_opts]
T_max = 12
[model_opts]""")


@pytest.mark.mpi
def test_ddp_and_mpigrad_give_the_same_losses_under_momentum_and_a_schedule(tmp_path, mpi_env, world_relay):
    """fp32 at P = 2: DDP's optimizer (its weight decay), schedule, augmentation and autocast, built from the same config,
    are mpigrad's (over its flat pieces; the same crops and flips per rank and iteration); the
    losses agree to the last bit (as for plain SGD here)."""
    from mpigrad.trace import load

    config = tmp_path / "recipe.toml"
    config.write_text(RECIPE_TOML)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "mpigrad", "bench", "peers", "--config", str(config), "--out", str(out),
               "--variants", "fp32", "--iterations", "12", "--warmup", "0", "--seeds", "1"]
    done = subprocess.run(command, env=world_relay(mpi_env), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert ("lr 0.05, sgd(momentum=0.9, nesterov=True, weight_decay=0.004) CosineAnnealingLR(T_max=12) warm-up 3 "
            "crop-flip(padding=2) autocast bf16, l2 in the loss 0," in done.stdout), done.stdout
    ddp = load(out / "ddp-fp32-seed1.h5").steps["loss"].to_numpy()
    ours = load(out / "mpigrad-seed1.h5")
    np.testing.assert_array_equal(ddp, ours.steps["loss"].to_numpy())
    assert ours.steps["lr"].iloc[0] == pytest.approx(0.05 / 3) and ddp[-1] < ddp[0]


def test_mpigrads_powersgd_gets_the_hooks_float32_iterations_unless_told_otherwise():
    """bench peers gives mpigrad's PowerSGD the hooks' start_powerSGD_iter (an equal warm-up),
    says so, and where the config or options set its start, says that the two differ."""
    from mpigrad.bench.peers import align_powersgd_start
    from mpigrad.config import RunConfig

    lowrank = RunConfig(codec="powersgd", policy="fixed", codec_opts={"rank": 2})
    extra, line = align_powersgd_start(lowrank, ["fp32", "powersgd1"], 25)
    assert extra == ["--codec-opt", "start=25"]
    assert line.startswith("mpigrad's PowerSGD from iteration 25 too, as the hooks (an equal warm-up in float32")
    told = RunConfig(codec="powersgd", policy="fixed", codec_opts={"rank": 2, "start": 0})
    assert align_powersgd_start(told, ["powersgd2"], 25) == (
        [], "mpigrad's PowerSGD from iteration 0 (its start option), the hooks from 25: not an equal warm-up")
    same = RunConfig(codec="powersgd", policy="fixed", codec_opts={"start": 25})
    assert align_powersgd_start(same, ["powersgd2"], 25) == ([], None)
    assert align_powersgd_start(lowrank, ["fp32", "fp16"], 25) == ([], None)          # no hook to match
    assert align_powersgd_start(RunConfig(), ["powersgd1"], 25) == ([], None)         # no low-rank codec


def test_the_periodic_lines_say_how_far_mpigrads_run_is():
    """bench peers reads mpigrad's progress lines (its runs print one every 2 % of the
    iterations) for the periodic lines' "iteration K/N", as it reads DDP's reports."""
    from mpigrad.bench.peers import run_progress

    log = ("mpigrad 0.1.0: 2 workers + scheduler, each worker serving a shard (colocated)\n"
           "iter   5/250  loss+l2 4.31  bits 32  sent 9.2 MB  sim 1.0s  wall 1.0s  ETA 49s\n"
           "iter  10/250  loss+l2 4.29  bits 8  sent 9.3 MB  sim 1.2s  wall 1.2s  ETA 29s\n"
           "iter  15/2")                                       # a line still being written
    assert run_progress(log) == "iteration 10/250"
    assert run_progress("mpigrad 0.1.0: starting\n") is None and run_progress("") is None
