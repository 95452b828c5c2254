"""``mpigrad simulate`` (mpigrad/simulate/): the messages come from mpigrad's own code (a
config's traffic is a real run's, frame for frame), SimGrid's replay agrees with mpigrad's
clock where both model the same network (one worker per node, no latency, cm02: within 2 %;
nodes of 2: as ``clockmodel.Nodes``; a ring: 2 (P - 1) / P G / B), and the command's errors
are one line. The tests that run SimGrid are skipped where ``python3-simgrid`` is missing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from mpigrad.cli import main
from mpigrad.clockmodel import IterationTraffic
from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.simulate.plan import Phase, Program, breakdown, hierarchical_allreduce_phases, mpigrad_phases, nic_bytes
from mpigrad.simulate.platform import Placement, Platform, natural_key
from mpigrad.simulate.simgrid_module import simgrid_path
from mpigrad.simulate.traffic import traffic_of, trace_iterations
from mpigrad.trace import read_raw
from mpigrad.trace.writer import write_closed

needs_simgrid = pytest.mark.skipif(not simgrid_path().is_file(), reason="SimGrid's Python module: "
                                   "apt-get install python3-simgrid")

#: The recorded runs: (name, options, workers). Fix 4 on a small model, 10 MB/s, no latency,
#: 10 ms of compute per iteration (test_exchanges.run: every rank a thread on the loopback channel).
RUNS = {
    "star": (dict(servers=1), 2),
    "sharded": (dict(servers=2), 2),
    "colocated": (dict(servers="colocated"), 3),
    "flat2x2": (dict(servers="colocated", ranks_per_node=2, exchange="flat"), 4),
    "hier2x2": (dict(servers="colocated", ranks_per_node=2, exchange="hierarchical"), 4),
}
METHOD = dict(codec="uniform", policy="fixed", bits=4, latency=0.0)


def _config(options: dict) -> RunConfig:
    from test_exchanges import BASE

    return RunConfig(**{**BASE, **METHOD, **options})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    from test_exchanges import run

    traces = {}
    for name, (options, workers) in RUNS.items():
        folder = tmp_path_factory.mktemp(name)
        codes, errors, config = run(folder, {**METHOD, **options}, workers)
        assert not errors, errors
        traces[name] = config.trace
    return traces


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["simulate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


# ---- the messages: a config's traffic is a real run's ---------------------------------------
@pytest.mark.parametrize("name", list(RUNS))
def test_a_configs_traffic_is_the_traffic_its_run_recorded(runs, name):
    options, workers = RUNS[name]
    ours = traffic_of(_config(options), workers, METHOD["bits"])
    recorded = trace_iterations(runs[name], 4).iterations
    assert len(recorded) == 4
    for row in recorded:
        assert row.traffic.frames_in == ours.frames_in and row.traffic.frames_out == ours.frames_out
        assert row.traffic == ours  # the losses', the Control's bytes, ahead, the slices too


def test_a_codec_whose_frames_depend_on_the_data_is_simulated_at_its_bound():
    from mpigrad.simulate.traffic import config_traffic

    config = _config(dict(servers=1, codec="qsgd", codec_opts={"coding": "elias"}))
    ours = config_traffic(config, 2, 4)
    assert ours.bound and all(n > 0 for n in ours.traffic.frames_out)
    assert not config_traffic(_config(dict(servers=1)), 2, 4).bound


# ---- the plan, without SimGrid --------------------------------------------------------------
def _hier_traffic():
    return IterationTraffic(40, 40, tuple(tuple(100 if w % 2 == s % 2 else 0 for w in range(4)) for s in range(4)),
                            (108,) * 4, True, ahead=True, hierarchical=True, slice_bytes=(800, 800))


def test_the_plan_sends_what_the_clock_charges_on_nodes():
    from mpigrad.clockmodel import LinkModel, Nodes

    traffic = _hier_traffic()
    program = mpigrad_phases(traffic, 2, 0.01, 0.001)
    names = [phase.name for phase in program.phases]
    assert names == ["control", "compute", "losses", "intra_reduce", "gradients", "broadcast", "intra_gather", "local"]
    assert [program.phases[k].name for k in program.order][:3] == ["compute", "losses", "control"]
    platform = Platform(2, 2)
    placement = Placement.of(platform, 4, 4, True)
    assert placement.host == (0, 0, 0, 1, 1)
    per_host = nic_bytes(program, placement, 2)
    charged = LinkModel(1e7, 0.0, nodes=Nodes(2, 1e10, 0.0)).node_breakdown(traffic)
    # besides the exchange's: node 1's two workers' losses to rank 0 and their Controls from it
    assert sum(out for out, _ in per_host) == charged.nic_bytes + 2 * 40 + 2 * 40
    assert sum(into for _, into in per_host) == sum(out for out, _ in per_host)


def test_the_breakdown_adds_up_to_the_iterations():
    program = Program([Phase("a"), Phase("b"), Phase("c")], order=[1, 0, 2])
    seconds, phases = breakdown([program], [0, 0], [[0.5, 1.0, 2.0], [2.5, 2.2, 4.0]])
    assert seconds == [2.0, 2.0]
    assert phases == pytest.approx({"b": (1.0 + 0.2) / 2, "a": (0.0 + 0.3) / 2, "c": (1.0 + 1.5) / 2})
    assert sum(phases.values()) == pytest.approx(sum(seconds) / 2)


def test_the_hierarchical_all_reduce_crosses_each_nic_with_2_n_minus_1_over_n_of_the_gradient():
    G, N, L = 8000, 4, 2
    phases = hierarchical_allreduce_phases(G, N, L)
    placement = Placement.workers_only(Platform(N, L))
    per_host = nic_bytes(Program(phases), placement, N)
    assert all(out == into == 2 * (N - 1) * G // N for out, into in per_host)
    assert len(phases) == 2 * (L - 1) + 2 * (N - 1)


def test_hosts_go_in_natural_order():
    assert sorted(["h10", "h2", "h1", "x"], key=natural_key) == ["h1", "h2", "h10", "x"]


# ---- SimGrid against mpigrad's clock ---------------------------------------------------------
def _comm(result) -> float:
    return sum(seconds for name, seconds in result.phases.items() if name not in ("compute", "local"))


@needs_simgrid
@pytest.mark.parametrize("name", ["star", "sharded", "colocated", "flat2x2", "hier2x2"])
def test_simgrid_agrees_with_the_recorded_clock_without_latency(runs, name):
    from mpigrad.simulate.sources import simulate_trace

    simulation = simulate_trace(runs[name], sample=3)
    ours = simulation.mpigrad
    recorded = [it.t_comm for it in trace_iterations(runs[name], 3).iterations]
    t_comm = sum(recorded) / len(recorded)
    assert ours.clock["recorded_t_comm"] == pytest.approx(t_comm)
    assert ours.clock["comm_seconds"] == pytest.approx(t_comm, rel=1e-12)  # the clock on this platform: the run's
    assert _comm(ours) == pytest.approx(t_comm, rel=0.02), ours.phases
    assert ours.seconds_per_iteration == pytest.approx(ours.clock["seconds_per_iteration"], rel=0.02)
    assert sum(ours.phases.values()) == pytest.approx(ours.seconds_per_iteration)


@needs_simgrid
def test_with_latency_simgrid_pays_it_once_per_round_where_the_clock_serialises_it(runs):
    from mpigrad.simulate.sources import simulate_trace

    ours = simulate_trace(runs["star"], sample=1, latency=1e-3).mpigrad
    # the clock: 2 frames into the server one after another, 2 copies out: 4 latencies; SimGrid: 2
    assert ours.clock["comm_seconds"] - _comm(ours) == pytest.approx(2e-3, rel=0.05)


@needs_simgrid
def test_lv08_is_slower_than_cm02_by_its_bandwidth_factor_at_least(runs):
    from mpigrad.simulate.sources import simulate_trace

    cm02 = simulate_trace(runs["colocated"], sample=1).mpigrad
    lv08 = simulate_trace(runs["colocated"], sample=1, model="lv08").mpigrad
    assert _comm(lv08) >= _comm(cm02) / 0.97 * 0.999


@needs_simgrid
def test_a_ring_all_reduce_takes_2_p_minus_1_over_p_of_the_gradient_over_the_rate():
    from mpigrad.simulate.sources import simulate_config

    config = _config(dict(servers="colocated", ranks_per_node=2, exchange="hierarchical", bandwidth=1e8))
    simulation = simulate_config(config, 3, sample=1, peers=["fp32", "fp16", "hierarchical", "powersgd2"])
    P, G = 6, 4 * sum(_parameters(config))
    fp32, fp16, hierarchical, powersgd = simulation.peers
    assert fp32.phases["allreduce"] == pytest.approx(2 * (P - 1) / P * G / 1e8, rel=0.01)
    assert fp16.phases["allreduce"] == pytest.approx(2 * (P - 1) / P * G / 2 / 1e8, rel=0.01)
    assert fp32.nic_bytes_per_node[0][0] == pytest.approx(2 * (P - 1) / P * G, rel=0.01)
    assert hierarchical.phases["allreduce"] == pytest.approx(2 * 2 / 3 * G / 1e8, rel=0.01)  # N = 3 nodes
    assert set(powersgd.phases) == {"compute", "allreduce_rest", "allreduce_p", "allreduce_q"}


def _parameters(config: RunConfig) -> list[int]:
    from mpigrad.simulate.traffic import model_shapes
    import math

    return [math.prod(shape) for shape in model_shapes(config)]


@needs_simgrid
def test_a_platform_file_of_the_users_gives_the_generated_platforms_times(runs, tmp_path):
    from mpigrad.simulate.sources import simulate_trace

    xml = tmp_path / "mine.xml"
    xml.write_text("<?xml version='1.0'?>\n<!DOCTYPE platform SYSTEM \"https://simgrid.org/simgrid.dtd\">\n"
                   "<platform version=\"4.1\">\n"
                   "  <cluster id=\"c\" prefix=\"h\" suffix=\"\" radical=\"1-3\" speed=\"2Gf\" core=\"1\" "
                   "bw=\"10MBps\" lat=\"0us\" sharing_policy=\"SPLITDUPLEX\" loopback_bw=\"10GBps\" "
                   "loopback_lat=\"5us\"/>\n"
                   "</platform>\n")
    generated = simulate_trace(runs["colocated"], sample=1).mpigrad
    mine = simulate_trace(runs["colocated"], sample=1, platform_file=str(xml)).mpigrad
    assert mine.seconds_per_iteration == pytest.approx(generated.seconds_per_iteration, rel=1e-6)
    assert mine.hosts == ("h1", "h2", "h3") and mine.clock is None


# ---- the command ----------------------------------------------------------------------------
@needs_simgrid
def test_the_json_output(runs, capsys):
    code, out, err = cli(capsys, runs["hier2x2"], "--json", "--sample", "2", "--peers", "fp32")
    assert code == 0, err
    result = json.loads(out)
    assert {"seconds_per_iteration", "phases", "nic_bytes_per_node", "model", "peers", "platform",
            "clock"} <= set(result)
    assert result["model"] == "cm02" and result["iterations"] == 2
    assert result["seconds_per_iteration"] == pytest.approx(sum(result["iteration_seconds"]) / 2)
    assert sum(result["phases"].values()) == pytest.approx(result["seconds_per_iteration"])
    assert [node["host"] for node in result["nic_bytes_per_node"]] == ["node-0", "node-1"]
    assert result["platform"]["ranks_per_node"] == 2 and result["platform"]["nodes"] == 2
    assert set(result["peers"]) == {"fp32"} and result["peers"]["fp32"]["label"] == "DDP fp32"


@needs_simgrid
def test_the_text_output_of_a_config(capsys):
    code, out, err = cli(capsys, "--nodes", "2", "--config", REPO / "examples" / "compare" / "fix2.toml",
                         "--servers", "colocated", "--sample", "1", "--peers", "fp16")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("mpigrad simulate: 2 node(s) of one worker, rank 0 on node 0")
    assert lines[2].startswith("mpigrad Fix (2-bit) (colocated): ") and "mpigrad's clock" in lines[2]
    assert any(line.startswith("DDP fp16 hook: ") for line in lines)


def _edited(source, path, **attrs):
    raw = read_raw(source)
    write_closed(path, raw.specs, raw.arrays, {**raw.attrs, **attrs})
    return path


@pytest.mark.parametrize("args, message", [
    (["--peers", "none"], "--nodes N is needed to simulate a config"),
    (["--nodes", "0", "--peers", "none"], "--nodes must be at least 1, got 0"),
    (["--nodes", "2", "--bandwidth", "10"], "bandwidth '10' has no unit"),
    (["--nodes", "2", "--latency", "soon"], "cannot read duration 'soon'"),
    (["--nodes", "2", "--ranks-per-node", "auto"], "--ranks-per-node auto is what MPI finds at launch"),
    (["--nodes", "2", "--peers", "ring"], "--peers: unknown peer 'ring'"),
    (["--nodes", "2", "--platform", "missing.xml", "--peers", "none"], "--platform missing.xml: no such file"),
    (["--nodes", "2", "--bandwidth", "10MB/s@0s,1GB/s@60s"], "a bandwidth or latency schedule"),
    (["--nodes", "2", "--codec", "powersgd"], "sends two rounds per iteration, not simulated from a config"),
    (["--nodes", "2", "--check"], "--check and --ranks check a train job"),
])
def test_the_commands_errors_are_one_line(capsys, args, message):
    code, out, err = cli(capsys, *args)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert err.startswith("mpigrad simulate: error: ")


@pytest.mark.parametrize("run, args, message", [
    ("flat2x2", ["--ranks-per-node", "3"], "--ranks-per-node 3 does not divide the trace's 4 workers"),
    ("hier2x2", ["--ranks-per-node", "4"], "is a hierarchical run on nodes of 2, whose messages depend on them"),
    ("star", ["--ranks-per-node", "2"], "nodes of several workers are built for --servers colocated runs"),
    ("hier2x2", ["--nodes", "3"], "--nodes 3: "),
    ("hier2x2", ["--codec", "fp32"], "--codec: a trace's run is its own"),
    ("hier2x2", ["--sample", "0"], "--sample must be at least 1"),
    ("hier2x2", ["--bandwidth", "0MB/s"], "must be positive"),
])
def test_a_traces_errors_are_one_line(runs, capsys, run, args, message):
    code, out, err = cli(capsys, runs[run], "--peers", "none", *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_trace_that_is_not_complete_is_refused(runs, tmp_path, capsys):
    stopped = _edited(runs["star"], tmp_path / "stopped.h5", status="stopped", complete=False)
    code, out, err = cli(capsys, stopped, "--peers", "none")
    assert code == 2 and "trace status 'stopped'; only a complete run is simulated" in err and err.count("\n") == 1


def test_without_simgrid_the_command_names_the_package(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MPIGRAD_SIMGRID", str(tmp_path / "no-simgrid.so"))
    code, out, err = cli(capsys, "--nodes", "2", "--peers", "none")
    assert code == 2 and err.count("\n") == 1
    assert "SimGrid's Python module is not installed" in err and "apt-get install python3-simgrid" in err
    from mpigrad.simulate.simgrid_module import load_simgrid

    if "simgrid" not in sys.modules:
        with pytest.raises(UsageError, match="apt-get install python3-simgrid"):
            load_simgrid()


@needs_simgrid
def test_a_platform_with_too_few_hosts_is_refused(runs, tmp_path, capsys):
    xml = tmp_path / "small.xml"
    xml.write_text("<?xml version='1.0'?>\n<!DOCTYPE platform SYSTEM \"https://simgrid.org/simgrid.dtd\">\n"
                   "<platform version=\"4.1\">\n  <cluster id=\"c\" prefix=\"h\" suffix=\"\" radical=\"0-1\" "
                   "speed=\"1Gf\" bw=\"10MBps\" lat=\"0us\"/>\n</platform>\n")
    code, out, err = cli(capsys, runs["colocated"], "--platform", xml, "--peers", "none")
    assert code == 2 and "has 2 host(s); the simulation needs 3" in err and err.count("\n") == 1, err


def test_the_engine_imports_neither_torch_nor_the_runtime():
    heavy = "{'torch', 'mpi4py', 'numba', 'mpigrad.runtime', 'numpy'}"
    code = f"import sys, mpigrad.simulate.engine; assert not {heavy} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
