"""Bandwidth and latency schedules (issue 24, item 3): the parser, the piecewise charge of a
message that crosses a change, the Markov process drawn from the seed, per-link rates, a real
run whose simulated clock shows the change, resume equality and re-timing with a schedule."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SMALL_RUN, assert_same_trace, run_mpi
from mpigrad.clockmodel import Constant, IterationTraffic, LinkModel, Markov, Network, Steps, transfer_seconds
from mpigrad.cli import main
from mpigrad.config import RunConfig
from mpigrad.units import network_from, parse_bandwidth, parse_latency, parse_link_bandwidth, parse_schedule
from mpigrad.errors import UsageError
from mpigrad.trace import load


# ---- the parser ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, kept", [
    ("10MB/s", 1e7),
    ("100Mbps", 1.25e7),
    ("10MB/s@0s,1GB/s@60s,10MB/s@120s", "10MB/s@0s,1GB/s@60s,10MB/s@120s"),
    (" 10MB/s@0s, 1GB/s@1m ", "10MB/s@0s,1GB/s@1m"),      # spaces dropped, units kept as written
    ("10MB/s,1GB/s@60s,repeat@120s", "10MB/s,1GB/s@60s,repeat@120s"),
    ("markov:10MB/s,1GB/s,dwell=30s,60s", "markov:10MB/s,1GB/s,dwell=30s,60s"),
])
def test_bandwidth_is_a_rate_or_a_schedule_kept_as_written(text, kept):
    assert parse_bandwidth(text) == kept


@pytest.mark.parametrize("text", ["4MB/s@0s,1MB/s@0.3s,repeat@0.6s", "1MB/s,2MB/s@0.1s,3MB/s@0.7s,repeat@0.9s",
                                  "markov:1MB/s,2MB/s,dwell=0.1s,0.3s"])
def test_a_schedule_changes_exactly_at_its_change_times(text):
    """at() and next_change() agree to the last bit, period after period (0.6 + 0.3 is
    0.8999999999999999 in floats: the change is there, not one period later)."""
    schedule, t = parse_schedule(text, seed=1), 0.0
    for _ in range(3000):
        change = schedule.next_change(t)
        assert change > t and schedule.at(change) != schedule.at(math.nextafter(change, 0.0)), change
        t = change
    assert t > 100


def test_schedules_parse_to_their_steps():
    steps = parse_schedule("10MB/s@0s,1GB/s@60s,10MB/s@2m")
    assert isinstance(steps, Steps) and steps.period is None
    assert steps.times == (0.0, 60.0, 120.0) and steps.values == (1e7, 1e9, 1e7)
    repeating = parse_schedule("10MB/s,1GB/s@60s,repeat@120s")
    assert repeating.times == (0.0, 60.0) and repeating.period == 120.0
    assert [repeating.at(t) for t in (0, 59.9, 60, 119.9, 120, 185, 240)] == [1e7, 1e7, 1e9, 1e9, 1e7, 1e9, 1e7]
    assert [repeating.next_change(t) for t in (0, 60, 130, 180)] == [60.0, 120.0, 180.0, 240.0]
    markov = parse_schedule("markov:10MB/s,80Mbit/s,dwell=30s,1m", seed=4)
    assert isinstance(markov, Markov) and markov.values == (1e7, 1e7) and markov.dwell == (30.0, 60.0)
    latency = parse_schedule("0s@0s,20ms@60s", "latency")
    assert latency.values == (0.0, 0.02) and parse_latency("0.5ms") == 0.0005
    assert parse_latency("markov:0s,20ms,dwell=60s,10s") == "markov:0s,20ms,dwell=60s,10s"
    assert isinstance(parse_schedule("10MB/s"), Constant)


def test_link_bandwidth_from_the_command_line_and_from_toml(tmp_path):
    assert parse_link_bandwidth(["1=1MB/s", "2=10MB/s@0s, 1MB/s@5s"]) == {"1": "1MB/s", "2": "10MB/s@0s,1MB/s@5s"}
    assert parse_link_bandwidth({"01": "1MB/s"}) == {"1": "1MB/s"}
    config_file = tmp_path / "run.toml"
    config_file.write_text('bandwidth = "10MB/s@0s,1GB/s@60s"\n[link_bandwidth]\n1 = "1MB/s"\n')
    config = RunConfig.from_sources(str(config_file), {"link_bandwidth": ["2=2MB/s"], "latency": "0s@0s,1ms@9s"})
    assert config.bandwidth == "10MB/s@0s,1GB/s@60s" and config.latency == "0s@0s,1ms@9s"
    assert config.link_bandwidth == {"1": "1MB/s", "2": "2MB/s"}  # the command line adds to the file's table
    # The network comes back from the config's JSON (the trace's config attribute, which
    # trace retime reads, and the checkpoint's identity).
    saved = json.loads(config.to_json())
    network = network_from(saved["bandwidth"], saved["latency"], saved["link_bandwidth"], saved["seed"])
    assert network.rate(1).value == 1e6 and network.rate(0).at(61) == 1e9 and network.latency.at(9) == 1e-3
    assert config.link_model().network.rate(2).value == 2e6
    assert RunConfig().link_model().network is None  # a constant network: the old code path


@pytest.mark.parametrize("options, message", [
    (["--bandwidth", "10MB/s@0s,1GB/s@60s,1MB/s@30s"], "times must increase (30s after 1m)"),
    (["--bandwidth", "10MB/s@5s,1GB/s@60s"], "the first value must start at 0s"),
    (["--bandwidth", "10MB/s,1GB/s"], "'1GB/s' has no @TIME"),
    (["--bandwidth", "10MB/s@0s,1GB/s@"], "'1GB/s@' is not VALUE@TIME"),
    (["--bandwidth", "10MB/s@0s,1GB/s@60s,repeat@60s"], "repeat@1m must come after the last change (1m)"),
    (["--bandwidth", "10MB/s@0s,10@60s"], "bandwidth '10' has no unit"),
    (["--bandwidth", "10MB/s@0s,1GB/s@soon"], "cannot read duration 'soon'"),
    (["--bandwidth", "markov:10MB/s,1GB/s,dwell=30s"], "a Markov schedule is markov:VALUE,VALUE,dwell=MEAN,MEAN"),
    (["--bandwidth", "markov:10MB/s,1GB/s,dwell=0s,3s"], "mean dwell times must be positive"),
    (["--latency", "1ms@0s,2MB/s@3s"], "cannot read duration '2MB/s'"),
    (["--link-bandwidth", "1:1MB/s"], "--link-bandwidth '1:1MB/s': use RANK=RATE"),
    (["--link-bandwidth", "one=1MB/s"], "'one' is not a rank"),
    (["--bandwidth", "10MB/s@0s,1GB/s@60s", "--net-mode", "off"], "needs a modelled network"),
    (["--link-bandwidth", "1=1MB/s", "--net-mode", "off"], "needs a modelled network"),
])
def test_bad_schedules_are_refused_in_one_line(options, message):
    overrides = {}
    for option, value in zip(options[::2], options[1::2]):
        key = option[2:].replace("-", "_")
        overrides[key] = [value] if key == "link_bandwidth" else value
    with pytest.raises(UsageError) as info:
        RunConfig.from_sources(None, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_train_refuses_a_bad_schedule_with_one_line_and_exit_2():
    result = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--bandwidth", "10MB/s@0s,1GB/s@-1s"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("mpigrad train: error: cannot read duration '-1s'"), result.stderr


# ---- the charge ---------------------------------------------------------------------------
SLOW_FAST = Steps((0.0, 60.0), (10e6, 1e9))   # 10 MB/s, then 1 GB/s from 60 s


def test_a_message_crossing_a_change_pays_each_part_at_its_rate():
    none = Constant(0.0)
    # 20 MB sent at 59 s: 10 MB in the last second at 10 MB/s, 10 MB at 1 GB/s (10 ms).
    assert transfer_seconds(20e6, 59.0, SLOW_FAST, none) == pytest.approx(1.01, rel=1e-15)
    assert transfer_seconds(5e6, 10.0, SLOW_FAST, none) == 0.5       # wholly before
    assert transfer_seconds(5e6, 60.0, SLOW_FAST, none) == 0.005     # wholly after (the change is at 60 s)
    # The latency in force when the message is sent, then the bytes from the send time on.
    assert transfer_seconds(20e6, 59.0, SLOW_FAST, Steps((0.0, 59.5), (0.001, 0.5))) == pytest.approx(1.011)
    # Two changes inside one message: 1 s at 10 MB/s, 1 s at 1 GB/s, then 10 MB/s again.
    pulse = Steps((0.0, 1.0, 2.0), (10e6, 1e9, 10e6))
    assert transfer_seconds(10e6 + 1e9 + 5e6, 0.0, pulse, none) == pytest.approx(2.5)
    # A repeating schedule wraps: at 125 s it is slow again, and fast from 180 s.
    repeating = Steps((0.0, 60.0), (10e6, 1e9), period=120.0)
    assert transfer_seconds(20e6, 179.0, repeating, none) == pytest.approx(1.01)


def test_phases_run_in_sequence_from_the_start_and_a_constant_network_changes_nothing():
    separate = IterationTraffic(12, 40, ((1000, 1200), (700, 900)), (2100, 1500))
    colocated = IterationTraffic(12, 40, ((0, 1200, 800), (700, 0, 600), (900, 500, 0)), (2100, 1500, 1700),
                                 colocated=True)
    for traffic, latency, broadcast in itertools.product((separate, colocated), (0.0, 1e-3), ("star", "tree", "mpich")):
        plain = LinkModel(1e6, latency, broadcast=broadcast)
        constant = LinkModel(1e6, latency, broadcast=broadcast, network=Network(Constant(1e6), Constant(latency)))
        for start in (0.0, 3.7):  # bit for bit the same as the formula, wherever it starts
            assert constant.comm_seconds(traffic, start) == plain.comm_seconds(traffic)
    # One phase by hand: rank 0 gathers two 1 MB loss reports at 1 MB/s from 59.5 s; the
    # second straddles 60 s, after which the network runs at 2 MB/s.
    link = LinkModel(1e6, 0.0, network=Network(Steps((0.0, 60.0), (1e6, 2e6)), Constant(0.0)))
    assert link.losses(2, 1_000_000, start=59.5) == pytest.approx(0.5 + 0.25 + 0.5)
    # With one server and latency 0 an iteration's messages are one stream of bytes_up + bytes_down.
    traffic = IterationTraffic(12, 40, ((1000, 1200),), (2100,))
    total = traffic.bytes_up + traffic.bytes_down
    link = LinkModel(1e6, 0.0, network=Network(Steps((0.0, 0.005), (1e6, 1e8)), Constant(0.0)))
    slow = 0.005 - 0.001
    assert link.comm_seconds(traffic, 0.001) == pytest.approx(slow + (total - slow * 1e6) / 1e8, rel=1e-12)


def test_a_slow_link_slows_the_messages_that_cross_it():
    """Two servers; rank 1's link at 1 MB/s (a straggler), the rest at 10 MB/s: its shard's
    round takes the slow rate, and rank 0's does not."""
    traffic = IterationTraffic(0, 0, ((1000, 1000), (4000, 4000)), (500, 500))
    network = Network(Constant(1e7), Constant(0.0), {1: Constant(1e6)})
    link = LinkModel(1e7, 0.0, network=network)
    assert link.gradients(traffic.frames_in) == pytest.approx(8000 / 1e6)
    # Server 1 broadcasts to 2 workers and rank 0 at 1 MB/s; rank 0 to 2 workers at 10 MB/s.
    assert link.broadcasts(2, traffic.frames_out) == pytest.approx(3 * 500 / 1e6)
    # A worker's slow link slows its own messages only: rank 2 at 1 MB/s, worker rank 3 at 10 MB/s.
    worker = LinkModel(1e7, 0.0, network=Network(Constant(1e7), Constant(0.0), {2: Constant(1e6)}))
    assert worker.gradients(((1000, 1000),)) == pytest.approx(1000 / 1e6 + 1000 / 1e7)
    # Colocated servers (worker w at rank w + 1 serves shard w): node 2's link (rank 2) at
    # 1 MB/s slows what it sends and receives; its own frame crosses no link.
    colocated = IterationTraffic(0, 0, ((0, 1000, 1000), (1000, 0, 1000), (1000, 1000, 0)), (500, 500, 500),
                                 colocated=True)
    link = LinkModel(1e7, 0.0, network=Network(Constant(1e7), Constant(0.0), {2: Constant(1e6)}))
    assert link.gradients(colocated.frames_in, colocated=True) == pytest.approx(2 * 1000 / 1e6)
    assert link.broadcasts(3, colocated.frames_out, colocated=True) == pytest.approx(2 * 500 / 1e6)
    assert link.losses(3, 100, colocated=True, servers=3) == pytest.approx(100 / 1e7 + 100 / 1e6 + 100 / 1e7)
    # A schedule on one link: the path follows the slower link at each moment.
    path = Network(Constant(5e6), Constant(0.0), {1: Steps((0.0, 10.0), (1e7, 1e6))}).path(0, 1)
    assert [path.at(t) for t in (0, 9.9, 10)] == [5e6, 5e6, 1e6] and path.next_change(0) == 10.0


# ---- the Markov process -------------------------------------------------------------------
def test_the_markov_process_is_drawn_from_the_seed():
    def process(seed, stream="bandwidth"):
        return Markov((10e6, 1e9), (30.0, 60.0), seed, stream)

    first = process(7).changes(5000)
    assert first == process(7).changes(5000)                         # same seed, same process
    assert first != process(8).changes(5000)                         # another seed, another one
    assert first != process(7, "link1").changes(5000)                # each link its own stream
    backwards = process(7)
    assert backwards.at(4000) == process(7).at(4000)                 # asked out of order: the same
    assert backwards.changes(5000) == first
    # Alternating states from the first, with dwell times of the given means (about 2200 of each).
    a = process(7)
    changes = [0.0, *a.changes(200_000)]
    dwell = np.diff(changes)
    assert abs(dwell[0::2].mean() - 30.0) < 3 and abs(dwell[1::2].mean() - 60.0) < 6
    assert a.at(0.0) == 10e6 and a.at(changes[1]) == 1e9 and a.at(changes[2]) == 10e6
    assert a.next_change(changes[1]) == changes[2]
    # The config's process is the run seed's: the same Markov schedule in two builds of one seed.
    one, two = (network_from("markov:10MB/s,1GB/s,dwell=1s,2s", 0.0, {"1": "markov:1MB/s,2MB/s,dwell=1s,1s"}, 3)
                for _ in range(2))
    assert one.bandwidth.changes(100) == two.bandwidth.changes(100)
    assert one.rate(1).changes(100) == two.rate(1).changes(100) != one.bandwidth.changes(100)


def test_policies_are_not_handed_the_network():
    """What a policy sees is the Observation (loss, last iteration's time, gradients, codec)
    and its own config: nothing of the schedule."""
    import dataclasses

    from mpigrad.policies.base import Observation

    assert {f.name for f in dataclasses.fields(Observation)}.isdisjoint({"bandwidth", "latency", "network",
                                                                         "link_bandwidth"})
    config = RunConfig.from_sources(None, {"bandwidth": "10MB/s@0s,1GB/s@60s", "link_bandwidth": ["1=1MB/s"],
                                           "policy": "mqgrad"})
    assert not any("MB/s" in str(value) for value in config.policy_config().values())


# ---- real runs ----------------------------------------------------------------------------
#: Local work a fixed 20 ms (--cost-model none), so that the clock can be checked by hand;
#: the paper's Control round trip, so that every message of an iteration is on its clock.
FIX2 = [*SMALL_RUN, "--iterations", "8", "--eval-every", "4", "--policy", "fixed", "--bits", "2",
        "--codec", "uniform", "--seed", "5", "--net-mode", "virtual", "--compute-time", "20ms", "--cost-model", "none",
        "--control", "paper"]
#: 1 MB/s, then 100 MB/s from 0.5 s: iterations 0 and 1 slow (about 0.26 s each), one
#: straddling, the rest fast.
SCHEDULE = "1MB/s@0s,100MB/s@0.5s"


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory, mpi_env):
    tmp = tmp_path_factory.mktemp("schedules")
    traces = {}
    for name, extra in {"scheduled": ["--bandwidth", SCHEDULE], "constant": ["--bandwidth", "10MB/s"]}.items():
        traces[name] = tmp / f"{name}.h5"
        result = run_mpi(3, ["train", "--trace", str(traces[name]), *FIX2, *extra], mpi_env)
        assert result.returncode == 0, result.stderr
        if name == "scheduled":
            assert f"network: {SCHEDULE} (schedule on the simulated clock) per link" in result.stdout
    return traces


@pytest.mark.mpi
def test_a_run_on_a_schedule_shows_the_change_on_its_clock(scheduled):
    trace = load(scheduled["scheduled"])
    assert trace.config["bandwidth"] == SCHEDULE   # recorded as written
    steps = trace.steps
    sim, t_comm = steps["sim_time"].to_numpy(), steps["t_comm"].to_numpy()
    total = (steps["bytes_up"] + steps["bytes_down"]).to_numpy()
    starts = np.concatenate([[0.0], sim[:-1]]) + 0.02    # messages follow the 20 ms compute
    np.testing.assert_array_equal(sim, np.cumsum(0.02 + t_comm))
    kinds = []
    for row in range(len(steps)):  # latency 0: an iteration's messages are one stream of its bytes
        if starts[row] + t_comm[row] <= 0.5:
            kinds.append("slow")
            assert t_comm[row] == pytest.approx(total[row] / 1e6, rel=1e-12)
        elif starts[row] >= 0.5:
            kinds.append("fast")
            assert t_comm[row] == pytest.approx(total[row] / 1e8, rel=1e-12)
        else:
            kinds.append("across")
            slow = 0.5 - starts[row]
            assert t_comm[row] == pytest.approx(slow + (total[row] - slow * 1e6) / 1e8, rel=1e-12)
    assert kinds == ["slow", "across"] + ["fast"] * 6, kinds


@pytest.mark.mpi
def test_a_constant_run_retimed_to_the_schedule_is_the_scheduled_run(scheduled, tmp_path, capsys):
    out = tmp_path / "retimed.h5"
    code = main(["trace", "retime", str(scheduled["constant"]), "--bandwidth", SCHEDULE, "-o", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"re-timed from 10MB/s latency 0s star to {SCHEDULE} latency 0s star" in captured.out
    retimed, target = load(out), load(scheduled["scheduled"])
    for table, column in (("steps", "sim_time"), ("steps", "t_comm"), ("eval", "sim_time")):
        np.testing.assert_array_equal(retimed.array(table, column), target.array(table, column),
                                      err_msg=f"{table}.{column}")
    assert retimed.config["bandwidth"] == SCHEDULE
    assert retimed.attrs["retimed_from_network"] == {"bandwidth": 1e7, "latency": 0.0, "broadcast": "star"}
    # And back: the scheduled run re-timed to 10 MB/s is the constant run.
    back = tmp_path / "back.h5"
    assert main(["trace", "retime", str(scheduled["scheduled"]), "--bandwidth", "10MB/s", "-o", str(back)]) == 0
    np.testing.assert_array_equal(load(back).array("steps", "sim_time"),
                                  load(scheduled["constant"]).array("steps", "sim_time"))
    # A bad schedule: one line, exit 2, nothing written.
    bad = tmp_path / "bad.h5"
    capsys.readouterr()
    assert main(["trace", "retime", str(scheduled["constant"]), "--bandwidth", "1MB/s@1s", "-o", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "the first value must start at 0s" in err and err.count("\n") == 1 and not bad.exists()


#: Markov congestion on every link, a slow repeating schedule on server 1's link, a latency
#: schedule: stopped after iteration 0 by a passed walltime, then resumed.
MARKOV = [*SMALL_RUN, "--iterations", "10", "--eval-every", "5", "--policy", "mqgrad", "--bits", "2",
          "--seed", "9", "--net-mode", "virtual", "--compute-time", "20ms", "--servers", "2",
          "--bandwidth", "markov:2MB/s,50MB/s,dwell=0.1s,0.05s", "--latency", "0s@0s,1ms@0.3s",
          "--link-bandwidth", "1=5MB/s@0s,1MB/s@0.2s,repeat@0.4s"]


@pytest.mark.mpi
def test_a_stopped_and_resumed_run_on_schedules_equals_the_straight_run(tmp_path, mpi_env):
    straight, stopped = tmp_path / "straight.h5", tmp_path / "stopped.h5"
    result = run_mpi(4, ["train", "--trace", str(straight), *MARKOV], mpi_env)
    assert result.returncode == 0, result.stderr
    first = run_mpi(4, ["train", "--trace", str(stopped), *MARKOV, "--walltime", "1s"], mpi_env)
    assert first.returncode == 75, first.stdout + first.stderr
    assert len(load(stopped).steps) < 10
    # Another schedule is another configuration: resuming under it is refused.
    other = [*MARKOV[:-1], "1=5MB/s@0s,1MB/s@0.3s,repeat@0.4s"]
    refused = run_mpi(4, ["train", "--trace", str(stopped), *other, "--resume"], mpi_env)
    assert refused.returncode == 2 and "different configuration (link_bandwidth" in refused.stderr, refused.stderr
    resumed = run_mpi(4, ["train", "--trace", str(stopped), *MARKOV, "--resume"], mpi_env)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_trace(load(straight), load(stopped))
    trace = load(straight)
    assert trace.config["link_bandwidth"] == {"1": "5MB/s@0s,1MB/s@0.2s,repeat@0.4s"}
    # The schedules moved the clock: not one rate for all iterations.
    per_byte = trace.steps["t_comm"] / (trace.steps["bytes_up"] + trace.steps["bytes_down"])
    assert per_byte.max() > 1.5 * per_byte.min()


# ---- the lab: the same schedules on the real clock ---------------------------------------------
class _RecordedLinks:
    """Links that record each rate set (no root, no tc)."""

    def __init__(self, rates):
        self.rates, self.down, self.set = dict(rates), set(), []

    def set_rate(self, node, rate):
        self.rates[node] = rate
        self.set.append((node, rate))


def test_lab_rate_schedules_change_the_links_at_their_times():
    from mpigrad.lab.shaping import RateSchedules

    pulse = Steps((0.0, 0.15, 0.3), (4e6, 1e6, 4e6))
    links = _RecordedLinks({0: 4e6, 1: 2e6})
    lines = []
    follower = RateSchedules(links, {0: pulse, 1: Constant(2e6)}, log=lines.append).start()
    time.sleep(0.6)
    follower.stop()
    assert links.set == [(0, 1e6), (0, 4e6)] and not follower.errors
    assert [at for at, _, _ in follower.applied] == [pytest.approx(0.15, abs=0.1), pytest.approx(0.3, abs=0.1)]
    assert lines[0].endswith("node 0 rate 1 MB/s (schedule: 0.15 s)")
    # A repeating schedule goes on until stopped; stop() ends it at once.
    links = _RecordedLinks({0: 4e6})
    follower = RateSchedules(links, {0: Steps((0.0, 0.05), (4e6, 1e6), period=0.1)}, log=lambda line: None).start()
    time.sleep(0.32)
    follower.stop()
    assert 4 <= len(links.set) <= 7 and links.set[:2] == [(0, 1e6), (0, 4e6)]


@pytest.mark.parametrize("args, message", [
    (["--latency", "0s@0s,1ms@5s", "--", "true"], "the lab applies one delay, not a latency schedule"),
    (["--rate", "4MB/s@0s,1MB/s@1s"], "a rate schedule needs a command to run"),
    (["--rate", "4MB/s@0s,1MB/s@0.5s", "--event", "1s:node1:rate=1MB/s", "--", "true"],
     "--event rate=... on node(s) 1, whose rate follows a schedule"),
    (["--node-rate", "1=4MB/s@1s", "--", "true"], "the first value must start at 0s"),
])
def test_lab_schedule_refusals_are_one_line_and_exit_2(args, message):
    result = subprocess.run([sys.executable, "-m", "mpigrad", "lab", "--name", "mgls", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def _lab_reason():
    from mpigrad.lab.host import unavailable_reason
    return unavailable_reason() if sys.platform.startswith("linux") else "network namespaces need Linux"


@pytest.mark.lab
@pytest.mark.skipif(_lab_reason() is not None, reason="mpigrad lab cannot run here")
def test_a_lab_follows_a_rate_schedule_from_the_commands_start():
    name = f"mgls{os.getpid() % 10000}"
    result = subprocess.run([sys.executable, "-m", "mpigrad", "lab", "--name", name, "--nodes", "2",
                             "--rate", "4MB/s@0s,1MB/s@0.3s", "--node-rate", "1=2MB/s",
                             "--check", "none", "--launch", "each", "--", "sleep", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "node 0: namespace" in result.stdout and "4 MB/s each way, then on a schedule" in result.stdout
    changes = [line for line in result.stdout.splitlines() if "(schedule: 0.3 s)" in line]
    assert len(changes) == 1 and "node 0 rate 1 MB/s" in changes[0], result.stdout  # node 1 stays at 2 MB/s


def test_a_checkpoint_from_before_link_bandwidth_is_resumed_by_a_run_without_it():
    from mpigrad.runtime.measure import checkpoint

    config = RunConfig().to_dict()
    before = {k: v for k, v in config.items() if k != "link_bandwidth"}   # written before the option
    assert checkpoint.identity(config, 3) == checkpoint.identity(before, 3)
    slow = {**config, "link_bandwidth": {"1": "1MB/s"}}
    assert checkpoint.identity(slow, 3) != checkpoint.identity(before, 3)


@pytest.mark.mpi
def test_colocated_servers_on_a_schedule_and_a_slow_link_retime_to_the_same_clock(tmp_path, mpi_env, capsys):
    """--servers colocated (each worker serves a shard), worker rank 2's link slow on a
    schedule: the run equals a constant run re-timed to that network, bit for bit."""
    network = ["--bandwidth", "2MB/s@0s,20MB/s@0.2s", "--link-bandwidth", "2=1MB/s@0s,5MB/s@0.4s"]
    traces = {}
    for name, extra in {"scheduled": network, "constant": ["--bandwidth", "10MB/s"]}.items():
        traces[name] = tmp_path / f"{name}.h5"
        result = run_mpi(3, ["train", "--trace", str(traces[name]), *FIX2, "--servers", "colocated", *extra], mpi_env)
        assert result.returncode == 0, result.stderr
    out = tmp_path / "retimed.h5"
    assert main(["trace", "retime", str(traces["constant"]), *network, "-o", str(out)]) == 0, capsys.readouterr().err
    retimed, target = load(out), load(traces["scheduled"])
    for table, column in (("steps", "sim_time"), ("steps", "t_comm"), ("eval", "sim_time")):
        np.testing.assert_array_equal(retimed.array(table, column), target.array(table, column),
                                      err_msg=f"{table}.{column}")
    assert target.config["link_bandwidth"] == {"2": "1MB/s@0s,5MB/s@0.4s"}
    per_byte = target.steps["t_comm"] / (target.steps["bytes_up"] + target.steps["bytes_down"])
    assert per_byte.iloc[0] > 3 * per_byte.iloc[-1]
