"""``mpigrad simulate`` (mpigrad/simulate/): the messages come from mpigrad's own code (a
config's traffic is a real run's, frame for frame; PowerSGD's two rounds too; a config at a
recorded MQGrad run's bits is that run's traffic, iteration by iteration), SimGrid's replay
agrees with mpigrad's clock where both model the same network (one worker per node, no
latency, cm02: within 2 %; nodes of 2: as ``clockmodel.Nodes``; a ring: 2 (P - 1) / P G / B),
and the command's errors are one line. The tests that run SimGrid are skipped where
``python3-simgrid`` is missing."""

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
from mpigrad.simulate.traffic import (clock_link, clock_seconds, config_traffic, recorded_bits, trace_iterations,
                                      traffic_of)
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


# ---- PowerSGD from a config: the two rounds its run sends -----------------------------------
#: examples/compare/lowrank.toml's codec (PowerSGD r2, 8-bit factors and rest) on the small
#: model, 1 ms per message (so that the clock charges each round's latencies).
POWERSGD = dict(codec="powersgd", codec_opts={"rank": 2, "factor_bits": 8, "rest_bits": 8}, policy="fixed",
                latency=1e-3)
POWERSGD_RUNS = {name: RUNS[name] for name in ("sharded", "flat2x2", "hier2x2")}


@pytest.fixture(scope="module")
def powersgd_runs(tmp_path_factory) -> dict[str, str]:
    from test_exchanges import run

    traces = {}
    for name, (options, workers) in POWERSGD_RUNS.items():
        codes, errors, config = run(tmp_path_factory.mktemp(f"powersgd-{name}"), {**POWERSGD, **options}, workers)
        assert not errors, errors
        traces[name] = config.trace
    return traces


@pytest.mark.parametrize("name", list(POWERSGD_RUNS))
def test_powersgd_from_a_config_sends_the_two_rounds_its_run_sent(powersgd_runs, name):
    from test_exchanges import BASE

    options, workers = POWERSGD_RUNS[name]
    config = RunConfig(**{**BASE, **POWERSGD, **options})
    ours = traffic_of(config, workers, 4)
    assert ours.frames_in2 and len(ours.frames_out2) == ours.servers
    raw = read_raw(powersgd_runs[name])
    steps, servers = raw.arrays["steps"], raw.arrays["servers"]
    L = config.ranks_per_node
    link = clock_link(config.bandwidth, config.latency, L, config.intra_bandwidth, config.intra_latency,
                      config.colocated)
    assert len(steps["iteration"]) == 4
    for row in range(4):  # the trace sums the two rounds: each server's frames from each worker, its broadcasts
        assert [[a + b for a, b in zip(one, two)] for one, two in zip(ours.frames_in, ours.frames_in2)] == \
            servers["frame_bytes"][row].tolist()
        assert [a + b for a, b in zip(ours.frames_out, ours.frames_out2)] == servers["bytes_out"][row].tolist()
        assert (ours.bytes_up, ours.bytes_down, ours.ahead) == (steps["bytes_up"][row], steps["bytes_down"][row],
                                                                bool(steps["control_ahead"][row]))
        # the run's clock charged the rounds one by one, each with its latencies: ours, to the last bit
        assert clock_seconds(link, ours, config.compute_time, 0.0)[1] == pytest.approx(steps["t_comm"][row],
                                                                                       rel=1e-12)


@pytest.mark.parametrize("name", list(POWERSGD_RUNS))
def test_a_powersgd_trace_is_replayed_in_its_two_rounds(powersgd_runs, name):
    from test_exchanges import BASE

    options, workers = POWERSGD_RUNS[name]
    config = RunConfig(**{**BASE, **POWERSGD, **options})
    run = trace_iterations(powersgd_runs[name], 4)
    ours = traffic_of(config, workers, 4)
    link = clock_link(config.bandwidth, config.latency, config.ranks_per_node, config.intra_bandwidth,
                      config.intra_latency, config.colocated)
    for it in run.iterations:  # the config's rounds, each with its latencies: the run's t_comm to the last bit
        assert it.traffic.frames_in2 == ours.frames_in2 and it.traffic.frames_out == ours.frames_out
        assert clock_seconds(link, it.traffic, config.compute_time, 0.0)[1] == pytest.approx(it.t_comm, rel=1e-12)


def test_a_powersgd_trace_keeps_its_float32_rows_before_start(tmp_path):
    """Rows before the codec's ``start`` are one float32 round, the trace's own; from
    ``start`` on the config's two rounds, each row keeping its own loss and Control bytes."""
    from test_exchanges import BASE, run

    options = {**POWERSGD, "codec_opts": {**POWERSGD["codec_opts"], "start": 2}, **RUNS["sharded"][0]}
    codes, errors, config = run(tmp_path, options, 2)
    assert not errors, errors
    recorded = trace_iterations(config.trace, 4)
    raw = read_raw(config.trace)
    steps = raw.arrays["steps"]
    link = clock_link(config.bandwidth, config.latency, 1, config.intra_bandwidth, config.intra_latency, False)
    rounds = traffic_of(RunConfig(**{**BASE, **options}), 2, 4)
    for row, it in enumerate(recorded.iterations):
        assert bool(it.traffic.frames_in2) == (it.iteration >= 2), it.iteration
        if it.iteration >= 2:
            assert it.traffic.frames_in2 == rounds.frames_in2
        assert it.traffic.bytes_up + it.traffic.bytes_down == steps["bytes_up"][row] + steps["bytes_down"][row]
        assert clock_seconds(link, it.traffic, config.compute_time, 0.0)[1] == pytest.approx(it.t_comm, rel=1e-12)


def test_a_powersgd_trace_whose_config_does_not_rebuild_is_refused(powersgd_runs, tmp_path):
    import shutil

    import h5py

    damaged = tmp_path / "renamed.h5"
    shutil.copy(powersgd_runs["sharded"], damaged)
    with h5py.File(damaged, "r+") as f:
        config = json.loads(f.attrs["config"])
        config["model"] = "no-such-model"
        f.attrs["config"] = json.dumps(config)
    with pytest.raises(UsageError, match="its config does not rebuild its two rounds"):
        trace_iterations(damaged, 4)


def test_a_powersgd_trace_whose_frames_are_not_its_configs_rounds_is_refused(powersgd_runs, tmp_path):
    import shutil

    import h5py

    damaged = tmp_path / "damaged.h5"
    shutil.copy(powersgd_runs["sharded"], damaged)
    with h5py.File(damaged, "r+") as f:
        frames = f["servers"]["frame_bytes"]
        frames[1] = frames[1] + 4  # iteration 1: some bytes the config's rounds do not send
    with pytest.raises(UsageError, match="iteration 1: its frames are not the two rounds its config sends"):
        trace_iterations(damaged, 4)


@needs_simgrid
def test_simgrid_replays_a_powersgd_trace_as_its_config(powersgd_runs, capsys):
    from test_exchanges import BASE

    from mpigrad.simulate.sources import simulate_config

    options, workers = POWERSGD_RUNS["flat2x2"]
    config = RunConfig(**{**BASE, **POWERSGD, **options})
    code, out, err = cli(capsys, powersgd_runs["flat2x2"], "--sample", "2", "--peers", "none", "--json")
    assert code == 0, err
    replayed = json.loads(out)
    expected = simulate_config(config, 2, sample=1).mpigrad  # a config's local work: compute_time, no codec costs
    assert replayed["seconds_per_iteration"] == pytest.approx(expected.seconds_per_iteration, rel=1e-9)
    assert {"gradients2", "broadcast2"} <= set(replayed["phases"])


@needs_simgrid
def test_simgrid_replays_powersgds_two_rounds_as_the_clock_charges_them():
    from mpigrad.simulate.sources import simulate_config

    config = _config({**POWERSGD, "servers": "colocated", "ranks_per_node": 2, "exchange": "flat", "latency": 0.0})
    simulation = simulate_config(config, 2, sample=1, peers=[])
    ours = simulation.mpigrad
    assert {"gradients", "broadcast", "gradients2", "broadcast2"} <= set(ours.phases)
    assert all(ours.phases[name] > 0 for name in ("gradients", "gradients2", "broadcast", "broadcast2"))
    assert sum(ours.phases.values()) == pytest.approx(ours.seconds_per_iteration)
    assert _comm(ours) == pytest.approx(ours.clock["comm_seconds"], rel=0.02), ours.phases
    assert any("no costs for powersgd" in note for note in simulation.notes)


# ---- a config at a recorded run's bits (MQGrad) ---------------------------------------------
#: examples/compare/mqgrad.toml's run, 400 iterations on 1 server + 2 workers at 10 MB/s:
#: mpiexec -n 3 python -m mpi4py -m mpigrad train --config examples/compare/mqgrad.toml --trace ...
MQGRAD_TRACE = REPO / "tests" / "data" / "mqgrad-compare-seed1.h5"


def _mqgrad_config(**options) -> RunConfig:
    return RunConfig.from_sources(str(REPO / "examples" / "compare" / "mqgrad.toml"), options)


def test_the_config_at_a_recorded_rows_bits_is_the_rows_traffic():
    recorded = recorded_bits(MQGRAD_TRACE)
    assert len(recorded.bits) == len(recorded.ahead) == 400 and recorded.codec == "uniform"
    kinds = recorded.kinds()
    assert sum(count for *_, count in kinds) == 400
    assert {bits for bits, _, _ in kinds} == {(2, 2), (3, 3)} and {ahead for _, ahead, _ in kinds} == {False, True}
    rows = trace_iterations(MQGRAD_TRACE, 400).iterations
    config = _mqgrad_config()
    for bits, ahead, _ in kinds:  # the run's layout: 1 server, 2 workers
        row = next(row for row, b, a in zip(rows, recorded.bits, recorded.ahead) if (b, a) == (bits, ahead))
        assert config_traffic(config, 2, bits, ahead).traffic == row.traffic


def test_a_recorded_run_of_another_codec_is_refused():
    from mpigrad.simulate.sources import simulate_recorded_bits

    with pytest.raises(UsageError, match="its run's codec is 'uniform', the config's 'fp16'"):
        simulate_recorded_bits(_mqgrad_config(codec="fp16"), 2, str(MQGRAD_TRACE))


@needs_simgrid
def test_a_config_at_a_recorded_runs_bits_weights_each_distinct_iteration_by_its_rows():
    from mpigrad.simulate.sources import simulate_recorded_bits

    config = _mqgrad_config(servers="colocated", ranks_per_node=2, exchange="hierarchical", bandwidth="1Gb/s",
                            latency="10us")
    simulation = simulate_recorded_bits(config, 2, str(MQGRAD_TRACE), peers=["fp32"])
    kinds = recorded_bits(MQGRAD_TRACE).kinds()
    assert simulation.iterations == len(kinds) and simulation.weights == tuple(count for *_, count in kinds)
    ours = simulation.mpigrad
    weighted = sum(w * s for w, s in zip(simulation.weights, ours.iteration_seconds)) / 400
    assert ours.seconds_per_iteration == pytest.approx(weighted)
    assert sum(ours.phases.values()) == pytest.approx(ours.seconds_per_iteration)
    seconds = {(bits, ahead): s for (bits, ahead, _), s in zip(kinds, ours.iteration_seconds)}
    assert seconds[((3, 3), True)] > seconds[((2, 2), True)]  # 3 bits: bigger frames
    assert simulation.peers[0].seconds_per_iteration == pytest.approx(simulation.peers[0].iteration_seconds[0])
    assert "mqgrad-compare-seed1.h5's bits, 400 iteration(s)" in simulation.source


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
    (["--nodes", "2", "--codec", "powersgd", "--codec-opt", "ranks=1,2", "--policy", "lgreco"],
     "with per-layer settings (--codec-opt ranks=/widths=, a policy's choice per layer) is not simulated"),
    (["--nodes", "2", "--bits-from", "run.h5", "--sample", "2"], "--bits-from run.h5: the iterations are its run's"),
    (["--nodes", "2", "--bits-from", "missing.h5", "--peers", "none"], "cannot read the trace missing.h5"),
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


# ---- the hosts' replay: one actor per node (--replay hosts) ---------------------------------
def test_the_hosts_plan_sums_across_hosts_and_takes_the_largest_inside_one():
    from mpigrad.simulate.plan import Groups, aggregate

    traffic = _hier_traffic()
    program = mpigrad_phases(traffic, 2, 0.01, 0.001)
    placement = Placement.of(Platform(2, 2), 4, 4, True)
    groups = Groups.of(placement.host, alone=(0,))
    assert groups.group == (0, 1, 1, 2, 2) and groups.host == (0, 0, 1)
    merged = aggregate(program, groups)
    assert [p.name for p in merged.phases] == [p.name for p in program.phases] and merged.order == program.order
    assert nic_bytes(merged, Placement(groups.host), 2) == nic_bytes(program, placement, 2)
    intra = merged.phases[3]  # intra_reduce: node 1's two workers' slices, the larger of the two
    assert sorted(intra.messages) == [(1, 1, 800), (2, 2, 800)]
    compute = merged.phases[1]
    assert compute.work == {1: 0.01, 2: 0.01}
    # a message between hosts of less than `tiny` of its phase's largest: left out, its time a floor
    phase = Program([Phase("x", messages=[(1, 3, 1000), (2, 3, 1)], recv_wait=None)])
    thin = aggregate(phase, Groups.of((0, 1, 2, 3)), tiny=1e-2, latency=1e-5, bandwidth=1e6)
    assert thin.phases[0].messages == [(1, 3, 1000)]
    assert thin.phases[0].floor == pytest.approx({2: 1e-5 + 1e-6, 3: 1e-5 + 1e-6})


def _nic_totals(flows: dict, host) -> tuple[dict, dict]:
    out, into = {}, {}
    for (a, b), n in flows.items():
        if host[a] != host[b]:
            out[host[a]] = out.get(host[a], 0) + n
            into[host[b]] = into.get(host[b], 0) + n
    return out, into


def test_small_flows_are_bundled_with_every_nics_bytes_kept():
    from mpigrad.simulate.plan import Groups, bundle

    groups = Groups.of(tuple(range(8)))
    # an all-to-all of headers (16 bytes each way) beside two large frames, and one flow inside a host kept
    flows = {(a, b): 16 + a for a in range(8) for b in range(8) if a != b}
    flows[(0, 3)] = 10_000
    flows[(5, 1)] = 12_000
    bundled = bundle(flows, groups, small=1e-2)
    assert len(bundled) <= 2 + 2 * 8 < len(flows)
    assert bundled[(0, 3)] >= 10_000 and bundled[(5, 1)] >= 12_000  # the large ones stay, maybe with some bytes more
    assert _nic_totals(bundled, groups.host) == _nic_totals(flows, groups.host)
    assert all(groups.host[a] != groups.host[b] for a, b in bundled)
    # an even all-to-all becomes one flow per host to the host half-way round
    even = bundle({(a, b): 16 for a in range(8) for b in range(8) if a != b} | {(8, 0): 100_000},
                  Groups.of(tuple(range(9))), 1e-2)
    assert even == {(a, (a + 4) % 8): 7 * 16 for a in range(8)} | {(8, 0): 100_000}
    # nothing to bundle: the flows as they were
    few = {(0, 1): 1000, (1, 2): 5}
    assert bundle(few, groups, 1e-2) is few
    # half-way round would have group 2 send to itself: the next rotation pairs them as they were
    inside = {(2, 3): 10_000, (2, 0): 3, (3, 2): 3}
    assert bundle(inside, Groups.of((0, 0, 1, 2), alone=(0,)), 1e-2) == inside
    # colocated, 3 nodes of 2, rank 0 a group beside node 0's: half-way round pairs group 2 with
    # itself, the next rotation bundles the seven headers into four flows
    three = Groups.of((0, 0, 0, 1, 1, 2, 2), alone=(0,))
    assert three.host == (0, 0, 1, 2)
    headers = {(1, 2): 16, (1, 3): 100_000, (2, 0): 40, (2, 1): 24, (2, 3): 40, (3, 0): 40, (3, 1): 24, (3, 2): 40}
    assert bundle(headers, three, 1e-2) == {(1, 3): 100_016, (2, 3): 24, (2, 0): 80, (3, 1): 48, (3, 2): 56}


def test_a_rings_steps_are_taken_a_few_at_a_time_with_their_latencies():
    from mpigrad.simulate.plan import Groups, compress_steps, ring_phases

    steps = ring_phases("allreduce", [0, 1, 2, 3], 4000)
    program = compress_steps(Program(steps), Groups.of((0, 1, 2, 3)), 1e-3, 1e-6, most=2)
    messages = [p for p in program.phases if p.messages]
    waits = [p for p in program.phases if p.work]
    assert len(steps) == 6 and len(messages) == 2 and len(waits) == 2
    assert sum(n for p in messages for _, _, n in p.messages) == sum(n for p in steps for _, _, n in p.messages)
    assert all(p.work == {g: 2e-3 for g in range(4)} for p in waits)  # 3 steps: 2 latencies more
    assert compress_steps(Program(steps, order=list(range(6))), Groups.of((0, 1, 2, 3)), 1e-3, 1e-6,
                          most=2).phases == steps  # mpigrad's own phases are never merged


def test_auto_takes_the_exact_replay_up_to_its_threshold():
    from mpigrad.simulate.replay import EXACT_UP_TO, replay_mode

    assert replay_mode("auto", EXACT_UP_TO) == "exact" and replay_mode("auto", EXACT_UP_TO + 1) == "hosts"
    assert replay_mode("exact", 10_000) == "exact" and replay_mode("hosts", 3) == "hosts"
    with pytest.raises(UsageError, match="--replay must be one of"):
        replay_mode("fast", 3)


@needs_simgrid
@pytest.mark.parametrize("exchange", ["flat", "hierarchical"])
def test_the_hosts_replay_gives_the_exact_replays_times(exchange):
    from mpigrad.simulate.sources import simulate_config

    config = _config(dict(servers="colocated", ranks_per_node=2, exchange=exchange, bandwidth=1e7, latency=1e-4,
                          compute_time=0.01))
    peers = ["fp32", "hierarchical"]
    exact = simulate_config(config, 4, sample=1, peers=peers, replay="exact")
    hosts = simulate_config(config, 4, sample=1, peers=peers, replay="hosts")
    assert exact.replay == "exact" and hosts.replay == "hosts"
    for a, b in zip((exact.mpigrad, *exact.peers), (hosts.mpigrad, *hosts.peers)):
        assert b.seconds_per_iteration == pytest.approx(a.seconds_per_iteration, rel=2e-3), a.name
        assert b.nic_bytes_per_node == a.nic_bytes_per_node
        assert b.timing["actors"] <= 5 < a.timing["actors"] and b.timing["transfers"] <= a.timing["transfers"]


@needs_simgrid
def test_bundled_small_flows_keep_the_exact_replays_times(monkeypatch):
    """PowerSGD's flat exchange: most shards hold no factor, their headers are small flows."""
    from mpigrad.simulate import replay
    from mpigrad.simulate.sources import simulate_config

    config = RunConfig.from_sources(str(REPO / "examples" / "compare" / "lowrank.toml"), dict(
        servers="colocated", ranks_per_node=2, exchange="flat", bandwidth="1Gb/s", latency="10us"))
    exact = simulate_config(config, 8, sample=1, replay="exact").mpigrad
    hosts = simulate_config(config, 8, sample=1, replay="hosts").mpigrad
    monkeypatch.setattr(replay, "SMALL", 0.0)
    unbundled = simulate_config(config, 8, sample=1, replay="hosts").mpigrad
    assert hosts.timing["transfers"] < unbundled.timing["transfers"] < exact.timing["transfers"]
    assert hosts.seconds_per_iteration == pytest.approx(exact.seconds_per_iteration, rel=2e-3)
    # bundling moves no NIC's bytes: the unbundled hosts' replay's times, phase by phase
    assert hosts.seconds_per_iteration == pytest.approx(unbundled.seconds_per_iteration, rel=1e-9)
    assert hosts.phases == pytest.approx(unbundled.phases, rel=1e-9)
    assert hosts.nic_bytes_per_node == unbundled.nic_bytes_per_node == exact.nic_bytes_per_node


@needs_simgrid
@pytest.mark.slow
def test_a_latency_never_makes_an_iteration_faster():
    """SimGrid's lazy updates (``network/optim:Lazy``, CM02's default) let 64 nodes' gradient
    phase through a NIC 1.3 times faster than its rate once the messages had a latency: the
    hierarchical columns of the map came out up to 16 % faster with 10 us than without. The
    engine runs ``network/optim:Full``; under Lazy this fails (0.0758 s against 0.0788)."""
    from mpigrad.simulate.sources import simulate_config

    seconds = {}
    for latency in ("0s", "1us"):
        config = RunConfig.from_sources(str(REPO / "examples" / "compare" / "fp16.toml"), dict(
            servers="colocated", ranks_per_node=4, exchange="hierarchical", bandwidth="10Gb/s", latency=latency))
        seconds[latency] = simulate_config(config, 64, sample=1, replay="hosts").mpigrad.seconds_per_iteration
    assert seconds["0s"] <= seconds["1us"] <= seconds["0s"] + 1e-5, seconds


@needs_simgrid
def test_time_prints_how_long_each_simulation_took(capsys):
    code, out, err = cli(capsys, "--nodes", "2", "--config", REPO / "examples" / "compare" / "fix2.toml",
                         "--servers", "colocated", "--sample", "1", "--peers", "fp32", "--time")
    assert code == 0, err
    timed = [line for line in out.splitlines() if line.startswith("  simulated in ")]
    assert len(timed) == 2 and all("s CPU" in line and "exact replay" in line for line in timed)
    assert out.splitlines()[-1].startswith("simulations: ")
    code, out, err = cli(capsys, "--nodes", "2", "--config", REPO / "examples" / "compare" / "fix2.toml",
                         "--servers", "colocated", "--sample", "1", "--peers", "none", "--json", "--replay", "hosts")
    result = json.loads(out)
    assert result["replay"] == "hosts" and {"wall", "cpu", "run_cpu", "actors", "transfers"} <= set(result["timing"])


@needs_simgrid
def test_the_scale_examples_smoke_run():
    done = subprocess.run([sys.executable, str(REPO / "examples" / "scale" / "run.py"), "--smoke"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Fix 2 hier" in done.stdout and "DDP fp32" in done.stdout and "2x4" in done.stdout
    assert "PowerSGD 8b hier" in done.stdout and "MQGrad hier" in done.stdout
    assert "MQGrad at the bits of tests/data/mqgrad-compare-seed1.h5 (iterations: 400;" in done.stdout
