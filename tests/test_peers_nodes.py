"""``mpigrad bench peers --ranks-per-node L``: DDP and mpigrad on the same nodes of L workers
(docs/peers.rst, "Nodes"), each method's bytes out of each node's NIC per iteration, and the
model of DDP on nodes (``analysis.peers``: a ring in node order puts 2 (P - 1) / P x G out of
each NIC, not L times that).

The first tests need neither MPI nor root (the formula, the model, the refusals); one runs
the bench on loopback (the model's NIC bytes in peers.json); the lab test needs root, ``ip
netns`` and tc's tbf, marked and skipped as tests/test_bench_peers.py's lab test is.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from mpigrad.analysis.peers import model_peer_trace, networks_of, nic_bytes_per_node
from mpigrad.analysis.tables import AnalysisError
from mpigrad.bench.peers import check_nodes, lab_traffic, ring_allreduce_bytes
from mpigrad.cli import main as cli_main
from mpigrad.errors import UsageError
from mpigrad.trace import Trace

#: tests/test_bench_peers.py's TINY without its '# ranks' line, so that P = 4 runs.
TINY = """policy = "fixed"
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


def _trace(config: dict, workers: int, up, down, nic=None, wall=None) -> Trace:
    """A loaded trace's shape for the model: ``steps`` (and ``bytes_nic`` where given), the
    ``workers`` attribute; one value or one per iteration."""
    up, down = np.atleast_1d(np.asarray(up, float)), np.atleast_1d(np.asarray(down, float))
    steps = {"iteration": np.arange(len(up)), "bytes_up": up, "bytes_down": down,
             "wall_time": np.asarray(wall if wall is not None else 0.01 * np.arange(1, len(up) + 1), float),
             "loss": np.full(len(up), 2.0)}
    if nic is not None:
        steps["bytes_nic"] = np.atleast_1d(np.asarray(nic, float))
    return Trace(path=None, schema_version=1, config=config, attrs={"workers": workers},
                 tables={"steps": pd.DataFrame(steps)}, arrays={"steps": dict(steps)})


def _ddp(workers: int, ranks_per_node: int, gradient_bytes: float, iterations: int = 1) -> Trace:
    """A DDP fp32 trace as the bench writes it: bytes_up = bytes_down = P x half a rank's ring bytes."""
    ring = 2 * (workers - 1) / workers * gradient_bytes
    half = [workers * ring / 2] * iterations
    return _trace({"peer": {"system": "torch DDP", "hook": "allreduce"}, "label": "DDP fp32", "seed": 1,
                   "ranks_per_node": ranks_per_node}, workers, half, half)


def test_a_ring_in_node_order_puts_one_rank_s_ring_bytes_on_each_nic():
    """By hand: G = 4000 bytes (1000 float32 gradients), P = 4 ranks on 2 nodes of 2 in node
    order (0 1 | 2 3): each rank sends 2 (P - 1) / P x G = 6000 bytes to the next, and of
    each node only rank 1 (to 2) and rank 3 (to 0) send across: 6000 bytes out of each NIC,
    not 2 x 6000. On one node of 4 nothing crosses a NIC; L = 3 cannot hold 4 ranks."""
    G = 4000
    assert ring_allreduce_bytes(4, 1000) == 2 * 3 / 4 * G == 6000
    ddp = _ddp(4, 2, G)
    assert nic_bytes_per_node(ddp).tolist() == [6000.0]
    assert nic_bytes_per_node(ddp, 1).tolist() == [6000.0]      # one rank per node: the same bytes
    assert nic_bytes_per_node(ddp, 4).tolist() == [0.0]         # one node
    with pytest.raises(AnalysisError, match="cannot sit on nodes of 3"):
        nic_bytes_per_node(ddp, 3)
    # mpigrad on 2 nodes of 2 (its trace's bytes_nic: every message across a NIC once)
    hier = _trace({"servers": "colocated", "ranks_per_node": 2, "exchange": "hierarchical"}, 4, 2000, 2000, nic=9000)
    assert nic_bytes_per_node(hier).tolist() == [4500.0]
    # colocated, one worker per node: a worker's frames and P - 1 copies of its average
    assert nic_bytes_per_node(_trace({"servers": "colocated"}, 4, 3000, 5000)).tolist() == [2000.0]
    assert nic_bytes_per_node(_trace({"servers": 1}, 4, 3000, 5000)) is None   # the server's node is not a worker's


def test_the_model_charges_the_nic_s_bytes_at_its_rate_and_the_slower_hop():
    """model_peer_trace on nodes: 50 ms of compute, 2 (P - 1) = 6 ring steps of 1 ms, and
    each NIC's 6000 bytes at 1 MB/s: the same clock on 2 nodes of 2 as on 4 nodes of 1 (a ring
    in node order crosses each NIC once); with links inside a node slower than the NIC (1 kB/s)
    they set the step; on one node of 4 only they count."""
    ddp = _ddp(4, 2, 4000, iterations=3)
    nic = 0.05 + 6 * 0.001 + 6000 / 1e6
    for L in (1, 2):
        modelled = model_peer_trace(ddp, 1e6, 0.001, 0.05, ranks_per_node=L, intra_bandwidth=10e9, intra_latency=5e-6)
        np.testing.assert_allclose(modelled.steps["sim_time"], nic * np.arange(1, 4))
        assert modelled.config["ranks_per_node"] == L and modelled.label == "DDP fp32 (modelled)"
    slow = model_peer_trace(ddp, 1e6, 0.001, 0.05, ranks_per_node=2, intra_bandwidth=1e3, intra_latency=0.0)
    np.testing.assert_allclose(slow.steps["t_comm"], [6000 / 1e3] * 3)
    one = model_peer_trace(ddp, 1e6, 0.001, 0.05, ranks_per_node=4, intra_bandwidth=1e8, intra_latency=1e-5)
    np.testing.assert_allclose(one.steps["t_comm"], [6 * 1e-5 + 6000 / 1e8] * 3)
    with pytest.raises(AnalysisError):
        model_peer_trace(ddp, 1e6, 0.001, 0.05, ranks_per_node=3, intra_bandwidth=1e9)


def test_the_networks_of_runs_on_nodes_carry_their_nodes():
    base = {"bandwidth": 1e7, "latency": 0.0005, "compute_time": 0.05, "net_mode": "virtual"}
    flat = _trace({**base}, 4, 1, 1)
    nodes = _trace({**base, "ranks_per_node": 2, "intra_bandwidth": 5e9, "intra_latency": 1e-6,
                    "exchange": "hierarchical"}, 4, 1, 1)
    other = _trace({**nodes.config, "exchange": "flat"}, 4, 1, 1)
    assert networks_of([flat, nodes, nodes, other]) == [
        {"bandwidth": 1e7, "latency": 0.0005, "compute_time": 0.05},
        {"bandwidth": 1e7, "latency": 0.0005, "compute_time": 0.05, "ranks_per_node": 2, "intra_bandwidth": 5e9,
         "intra_latency": 1e-6, "exchange": "hierarchical", "intra_codec": "fp32"},
        {"bandwidth": 1e7, "latency": 0.0005, "compute_time": 0.05, "ranks_per_node": 2, "intra_bandwidth": 5e9,
         "intra_latency": 1e-6, "exchange": "flat", "intra_codec": "fp32"}]


def test_the_lab_s_counts_per_node_are_read_from_its_lines():
    log = ("lab: command exited 0 after 3.1 s\n"
           "lab: node 0 during the command: link 0.552 MB out, 0.555 MB in; loopback 0.010 MB\n"
           "lab: node 1 during the command: link 1.250 MB out, 1.000 MB in; loopback 0.000 MB\n")
    assert lab_traffic(log) == {0: {"out": 552e3, "in": 555e3, "loopback": 10e3},
                                1: {"out": 1.25e6, "in": 1e6, "loopback": 0.0}}
    assert lab_traffic("lab: command exited 0 after 3.1 s\n") == {}


@pytest.mark.parametrize("args, message", [
    (["--workers", "4", "--ranks-per-node", "3"], "--ranks-per-node 3 does not divide the 4 workers"),
    (["--workers", "4", "--ranks-per-node", "0"], "--ranks-per-node must be at least 1, got 0"),
    (["--workers", "4", "--ranks-per-node", "x"], "argument --ranks-per-node: invalid int value: 'x'"),
    (["--workers", "4", "--ranks-per-node", "4", "--lab", "10MB/s"], "4 workers make one node, and a lab needs at "
                                                                      "least 2"),
    (["--workers", "4", "--ranks-per-node", "2", "--", "--servers", "2"], "mpigrad runs with colocated servers on the "
                                                                           "bench's nodes"),
    (["--workers", "4", "--ranks-per-node", "2", "--", "--servers", "colocated", "--ranks-per-node", "4"],
     "declare ranks_per_node 4: give one L"),
    (["--workers", "4", "--", "--servers", "colocated", "--ranks-per-node", "auto"], "ranks_per_node auto"),
])
def test_node_refusals_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    try:
        code = cli_main(["bench", "peers", "--config", str(config), "--out", str(tmp_path / "out"), *args])
    except SystemExit as exc:  # argparse's own refusal (CommandParser: one line)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(UsageError, match="does not divide"):
        check_nodes(2, 5, False)
    check_nodes(2, 4, True)


def test_the_help_says_mpigrad_runs_colocated_on_nodes(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "peers", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--ranks-per-node L" in text and "node order" in text and "colocated servers (added" in text, text


def _gradient_bytes() -> int:
    """G: the float32 gradient of TINY's model, counted from the model itself."""
    from mpigrad.config import RunConfig
    from mpigrad.runtime.exchange.build import build_config_model, load_data

    config = RunConfig(model="paper-cnn", data="digits", model_opts={"fc_sizes": [64, 64]}, seed=1)
    model = build_config_model(config, load_data(config))
    return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def loopback_run(tmp_path_factory, mpi_env, world_relay):
    root = tmp_path_factory.mktemp("nodes")
    config = root / "tiny.toml"
    config.write_text(TINY)
    out = root / "out"
    command = [sys.executable, "-m", "mpigrad", "bench", "peers", "--config", str(config), "--out", str(out),
               "--workers", "4", "--ranks-per-node", "2", "--variants", "fp32,fp16", "--iterations", "4",
               "--warmup", "1", "--progress-interval", "0"]
    done = subprocess.run(command, env=world_relay(mpi_env), capture_output=True, text=True, timeout=300)  # mpigrad's run in the world
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout


@pytest.mark.mpi
def test_on_loopback_each_row_has_the_model_s_nic_bytes_per_node(loopback_run):
    """P = 4 on 2 nodes of 2 without a lab: the rows' NIC bytes are the model's, DDP fp32's
    2 (P - 1) / P x G (fp16: half), mpigrad's (hierarchical by auto) its trace's bytes_nic / 2;
    in the table beside s/it and in peers.json."""
    from mpigrad.trace import load

    out, stdout = loopback_run
    G = _gradient_bytes()
    report = json.loads((out / "peers.json").read_text())
    assert (report["ranks_per_node"], report["nodes"], report["nic_source"]) == (2, 2, "model")
    ddp32, ddp16, ours = report["rows"]
    assert ddp32["nic_bytes_per_node"] == ddp32["nic_bytes_per_node_model"] == pytest.approx(2 * 3 / 4 * G)
    assert ddp16["nic_bytes_per_node"] == pytest.approx(2 * 3 / 4 * G / 2)
    trace = load(out / "mpigrad-seed1.h5")
    assert (trace.config["servers"], trace.config["ranks_per_node"], trace.config["exchange"]) == (
        "colocated", 2, "hierarchical")
    assert ours["nic_bytes_per_node"] == pytest.approx(np.median(trace.steps["bytes_nic"][1:]) / 2)
    assert all(row["nic_measured"] is None for row in report["rows"])
    assert "nodes: 2 of 2 worker(s); DDP's ranks in node order" in stdout and "hierarchical exchange" in stdout
    header = next(line for line in stdout.splitlines() if line.startswith("method"))
    assert header.split()[:6] == ["method", "s/it", "p10-p90", "s", "NIC", "MB/node/it"], header
    row = next(line for line in stdout.splitlines() if line.startswith("DDP fp32 "))
    assert f"{2 * 3 / 4 * G / 1e6:.3f}" in row.split()[4]
    ddp_trace = load(out / "ddp-fp32-seed1.h5")
    assert ddp_trace.config["peer"]["ranks_per_node"] == 2 and ddp_trace.config["ranks_per_node"] == 2
    # the DDP traces record the nodes of mpigrad's run beside them: trace compare's ratios find both
    assert ddp_trace.config["exchange"] == "hierarchical"


@pytest.mark.mpi
def test_trace_compare_reads_the_bench_s_runs_on_nodes_as_one_network(loopback_run, capsys):
    out, _ = loopback_run
    assert cli_main(["trace", "compare", *map(str, sorted(out.glob("*.h5"))), "--target-loss", "2.45", "--smooth",
                     "2", "--format", "csv"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)
    ours = table[table["method"].str.startswith("FP32")]
    assert len(ours) == 1 and ours["vs_best_ddp"].iloc[0] != "N/A", table.to_string()


@pytest.mark.mpi
def test_trace_compare_models_the_ddp_runs_on_the_nodes_of_the_runs(loopback_run, tmp_path, capsys):
    """--peers with mpigrad runs on 2 nodes of 2 at 1 MB/s: each DDP run modelled there, each
    NIC's bytes (a rank's ring bytes) at the NIC's rate, 2 (P - 1) = 6 latencies per
    all-reduce; the modelled traces take the runs' nodes, so that compare's ratio to the
    best DDP variant (runs on the same nodes) has them."""
    from mpigrad.analysis.peers import load_peer_runs, model_peers_at
    from test_compare import write

    out, _ = loopback_run
    network = {"bandwidth": 1e6, "latency": 0.001, "compute_time": 0.05, "net_mode": "virtual",
               "ranks_per_node": 2, "servers": "colocated", "exchange": "hierarchical"}
    files = [write(tmp_path / f"fp32-s{s}.h5", codec="fp32", seed=s, seconds_per_iteration=0.2, network=network,
                   iterations=4, machine={"workers": 4}) for s in (1, 2)]
    from mpigrad.trace import load

    nets = networks_of([load(f) for f in files])
    assert len(nets) == 1 and nets[0]["ranks_per_node"] == 2 and nets[0]["intra_bandwidth"] == 10e9
    peers = load_peer_runs(out)
    modelled = model_peers_at(peers, nets)
    ddp = next(t for t in modelled if t.label == "DDP fp32 (modelled)")
    ring = (ddp.steps["bytes_up"] + ddp.steps["bytes_down"]).to_numpy() / 4
    np.testing.assert_allclose(ddp.steps["sim_time"], np.cumsum(0.05 + 6 * 0.001 + ring / 1e6))
    assert (ddp.config["ranks_per_node"], ddp.config["exchange"]) == (2, "hierarchical")
    assert cli_main(["trace", "compare", *map(str, files), "--target-loss", "2.45", "--smooth", "2",
                     "--peers", str(out), "--format", "csv"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False)
    methods = list(table["method"])
    assert any(m.startswith("DDP fp32 (modelled)") for m in methods), methods
    ours = table[table["method"].str.startswith("FP32")]
    assert len(ours) == 1 and ours["vs_best_ddp"].iloc[0] != "N/A", table.to_string()


def _lab_reason():
    from mpigrad.lab.host import unavailable_reason
    return unavailable_reason() if sys.platform.startswith("linux") else "network namespaces need Linux"


@pytest.mark.lab
@pytest.mark.mpi
@pytest.mark.skipif(_lab_reason() is not None, reason="mpigrad lab cannot run here")
def test_in_a_lab_of_two_nodes_of_two_the_nic_bytes_are_measured(tmp_path, mpi_env):
    """--lab 100MB/s --ranks-per-node 2, P = 4: DDP's 4 ranks two to a node, mpigrad's 5 (rank 0
    beside node 0's workers), hierarchical; each node's link counted by the lab: DDP fp32 within
    10 % of 2 (P - 1) / P x G, mpigrad's within 10 % of its trace's bytes_nic / 2 (frames,
    headers included, and mpigrad's start-up, over 12 iterations); no namespace left."""
    from mpigrad.lab.netns import namespaces
    from mpigrad.trace import load

    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "mpigrad", "bench", "peers", "--config", str(config), "--out", str(out),
               "--workers", "4", "--ranks-per-node", "2", "--variants", "fp32", "--iterations", "12",
               "--warmup", "2", "--progress-interval", "0", "--lab", "100MB/s"]
    done = subprocess.run(command, env=mpi_env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "peers.json").read_text())
    assert (report["ranks_per_node"], report["nodes"], report["nic_source"]) == (2, 2, "lab")
    ddp, ours = report["rows"]
    G = _gradient_bytes()
    ring = 2 * 3 / 4 * G
    bytes_nic = load(out / "mpigrad-seed1.h5").steps["bytes_nic"].to_numpy(float)
    print(f"\n[lab] DDP fp32: {ddp['nic_measured']} B out per node per iteration for a ring's {ring:.0f}, "
          f"{ddp['s_per_iteration']:.3f} s/it; mpigrad: {ours['nic_measured']} for bytes_nic/2 "
          f"{bytes_nic.mean() / 2:.0f}, {ours['s_per_iteration']:.3f} s/it")
    assert len(ddp["nic_measured"]) == len(ours["nic_measured"]) == 2
    for measured in ddp["nic_measured"]:
        assert abs(measured - ring) < 0.10 * ring, (measured, ring)
    for measured in ours["nic_measured"]:
        assert abs(measured - bytes_nic.mean() / 2) < 0.10 * bytes_nic.mean() / 2, (measured, bytes_nic.mean() / 2)
    assert ddp["nic_bytes_per_node"] == pytest.approx(np.mean(ddp["nic_measured"]))
    assert ddp["nic_bytes_per_node_model"] == pytest.approx(ring)
    assert "NIC bytes per node per iteration from the lab's counters" in done.stdout
    assert [ns for ns in namespaces() if ns.startswith("mgbp-")] == []
