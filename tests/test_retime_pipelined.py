"""`mpigrad trace retime` and `mpigrad simulate` of a pipelined run (``--pipeline``): its
trace keeps the iteration bucket by bucket (the ``buckets`` table: when backward made each
bucket ready on each worker, each bucket's frames and average), and the retime re-charges it
through the same ``LinkModel.pipelined_iteration`` the runtime charged it with; SimGrid
replays it bucket by bucket (``plan.pipelined_phases``). A deterministic run
(``compute_time``) re-timed to another rate and latency is that network's run, bit for bit;
with measured compute, re-timed to its own network it keeps its own times, and its ready
times are what the charge reads. Runs are in-process (each rank a thread on the loopback
channel, tests/test_exchanges.run)."""

from __future__ import annotations

import numpy as np
import pytest

from dataclasses import replace

from mpigrad.cli import main
from mpigrad.clockmodel import IterationTraffic, LinkModel, Nodes, PipelinedTraffic
from mpigrad.errors import UsageError
from mpigrad.simulate.engine import run_plan
from mpigrad.simulate.plan import Program, pipelined_phases
from mpigrad.simulate.platform import generated
from mpigrad.simulate.replay import Iteration, simulate
from mpigrad.simulate.simgrid_module import simgrid_path
from mpigrad.simulate.sources import simulate_trace
from mpigrad.simulate.traffic import trace_iterations
from mpigrad.trace import load, read_raw
from mpigrad.trace.writer import write_closed
from test_exchanges import run

METHOD = dict(codec="uniform", policy="fixed", bits=4, servers="colocated", pipeline=True)
#: (name, options, workers): flat on 3 workers, hierarchical on 2 nodes of 2.
LAYOUTS = {
    "flat": (dict(), 3),
    "hierarchical": (dict(ranks_per_node=2, exchange="hierarchical"), 4),
}
SLOW = dict(bandwidth=1e7, latency=0.0)
FAST = dict(bandwidth=1e8, latency=1e-4)
RETIMED = (("steps", "sim_time"), ("steps", "t_comm"))
NODES = (("steps", "bytes_nic"), ("steps", "bytes_intra"), ("steps", "t_nic"), ("steps", "t_intra"))
KEPT = (("steps", "loss"), ("steps", "bytes_up"), ("steps", "bytes_down"), ("buckets", "ready"),
        ("buckets", "frames"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    traces = {}
    for layout, (options, workers) in LAYOUTS.items():
        for speed, network in (("slow", SLOW), ("fast", FAST), ("measured", {**SLOW, "compute_time": None})):
            codes, errors, config = run(tmp_path_factory.mktemp(f"{layout}-{speed}"),
                                        {**METHOD, **options, **network}, workers)
            assert not errors, errors
            traces[layout, speed] = config.trace
    return traces


def retime(capsys, source, out, *args) -> tuple[int, str, str]:
    code = main(["trace", "retime", str(source), "-o", str(out), *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_pipelined_trace_keeps_its_iteration_bucket_by_bucket(runs):
    raw = read_raw(runs["hierarchical", "measured"])
    buckets, steps = raw.arrays["buckets"], raw.arrays["steps"]
    rows, workers, count = buckets["ready"].shape
    assert (rows, workers) == (4, 4) and count > 2 and buckets["frames"].shape == (4, count, workers)
    np.testing.assert_array_equal(buckets["iteration"], steps["iteration"])
    ready = buckets["ready"]
    assert (ready >= 0).all() and (np.diff(ready, axis=2) >= 0).all()  # backward's order, last layer first
    assert (buckets["t_backward"] >= ready.max(axis=(1, 2)) - 1e-12).all()
    # each bucket's frames come from the other node's slice owner only (on the shard's own node
    # the owner is the shard's worker: its frame crosses no link)
    np.testing.assert_array_equal((buckets["frames"] > 0).sum(axis=2), np.full((4, count), 1))
    assert (buckets["intra"] > 0).all() and (buckets["bcast"] > 0).all()
    flat = read_raw(runs["flat", "measured"]).arrays["buckets"]
    assert (flat["intra"] == 0).all()
    frames = read_raw(runs["flat", "measured"]).arrays["servers"]["frame_bytes"]  # [row, shard, worker]
    by_shard = np.zeros_like(frames)
    for row in range(4):
        for b, s in enumerate(flat["shard"][row]):
            by_shard[row, s] += flat["frames"][row, b]
    own = np.eye(3, dtype=bool)  # a worker's frame to its own shard: in frame_bytes, but it crosses no link
    np.testing.assert_array_equal(by_shard, np.where(own, 0, frames))  # the buckets add up to each frame


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_deterministic_pipelined_run_retimed_is_the_other_networks_run(runs, tmp_path, capsys, layout):
    out = tmp_path / "retimed.h5"
    code, stdout, stderr = retime(capsys, runs[layout, "slow"], out, "--bandwidth", "100MB/s", "--latency", "100us")
    assert code == 0, stderr
    source, target, retimed = load(runs[layout, "slow"]), load(runs[layout, "fast"]), load(out)
    columns = RETIMED + (NODES if layout == "hierarchical" else ())
    for table, column in columns:
        np.testing.assert_array_equal(retimed.array(table, column), target.array(table, column),
                                      err_msg=f"{table}.{column}")
    for table, column in KEPT:
        np.testing.assert_array_equal(retimed.array(table, column), source.array(table, column))
    assert (source.array("steps", "t_comm") > retimed.array("steps", "t_comm")).all()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_measured_pipelined_run_retimed_to_its_own_network_keeps_its_times(runs, tmp_path, capsys, layout):
    source = runs[layout, "measured"]
    out = tmp_path / "same.h5"
    assert retime(capsys, source, out, "--bandwidth", "10MB/s")[0] == 0
    for table, column in RETIMED:
        np.testing.assert_array_equal(load(out).array(table, column), load(source).array(table, column))
    # the ready times are what the charge reads: every bucket ready when backward ends costs more
    raw = read_raw(source)
    arrays = {t: dict(c) for t, c in raw.arrays.items()}
    buckets = arrays["buckets"]
    buckets["ready"] = np.broadcast_to(buckets["t_backward"][:, None, None], buckets["ready"].shape).copy()
    late = tmp_path / "late.h5"
    write_closed(late, raw.specs, arrays, raw.attrs)
    assert retime(capsys, late, tmp_path / "late-retimed.h5", "--bandwidth", "10MB/s")[0] == 0
    assert (load(tmp_path / "late-retimed.h5").array("steps", "t_comm") >
            load(source).array("steps", "t_comm")).all()


def _edited(source, path, edit) -> str:
    raw = read_raw(source)
    specs = {t: dict(c) for t, c in raw.specs.items()}
    arrays = {t: {name: np.array(column) for name, column in c.items()} for t, c in raw.arrays.items()}
    edit(specs, arrays)
    write_closed(path, specs, arrays, raw.attrs)
    return path


def _no_buckets(specs, arrays):
    del specs["buckets"], arrays["buckets"]


def _shard_out_of_range(specs, arrays):
    arrays["buckets"]["shard"][1, 0] = 7


def _rows_missing(specs, arrays):
    arrays["buckets"] = {name: column[:-1] for name, column in arrays["buckets"].items()}


@pytest.mark.parametrize("edit, args, message", [
    (_no_buckets, [], "a pipelined run (--pipeline) whose trace keeps no buckets table"),
    (_shard_out_of_range, [], "iteration 1: a bucket's shard or bytes out of range"),
    (_rows_missing, [], "the buckets table's iterations are not the steps table's"),
    (None, ["--ranks-per-node", "1"], "a pipelined run's schedule is charged on its own 2 workers per node"),
])
def test_a_pipelined_trace_that_cannot_be_retimed_is_refused_in_one_line(runs, tmp_path, capsys, edit, args,
                                                                         message):
    source = runs["hierarchical", "slow"]
    if edit is not None:
        source = _edited(source, tmp_path / "edited.h5", edit)
    out = tmp_path / "out.h5"
    code, _, stderr = retime(capsys, source, out, "--bandwidth", "100MB/s", *args)
    assert code == 2 and message in stderr and stderr.count("\n") == 1, stderr
    assert not out.exists()


# ---- mpigrad simulate of a pipelined trace ------------------------------------------------
needs_simgrid = pytest.mark.skipif(not simgrid_path().is_file(), reason="SimGrid's Python module: "
                                   "apt-get install python3-simgrid")


@needs_simgrid
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("speed", ["slow", "measured"])
def test_simgrid_replays_a_pipelined_trace_bucket_by_bucket(runs, speed, layout):
    """The replay takes each bucket as backward made it ready; beside it, mpigrad's clock
    re-charges the trace's buckets as its run did (the recorded t_comm, bit for bit)."""
    source = runs[layout, speed]
    simulation = simulate_trace(source, sample=3)
    ours = simulation.mpigrad
    recorded = load(source).array("steps", "t_comm")[:3]
    assert ours.clock["recorded_t_comm"] == pytest.approx(recorded.mean(), rel=1e-12)
    assert ours.clock["comm_seconds"] == pytest.approx(recorded.mean(), rel=1e-12)
    assert sum(ours.phases.values()) == pytest.approx(ours.seconds_per_iteration)
    assert ours.phases["gradients"] > 0 and ours.phases["broadcast"] > 0
    assert (ours.phases["backward"] > 0) == (speed == "measured")  # a fixed compute: every bucket ready at its end
    if layout == "hierarchical":
        assert ours.phases["intra_reduce"] >= 0 and ours.phases["intra_gather"] > 0
    if speed == "slow":  # SimGrid shares a NIC among the slice owners' frames, the clock sends one at a time
        assert ours.seconds_per_iteration == pytest.approx(ours.clock["seconds_per_iteration"], rel=0.15)
    else:  # every worker takes the slowest forward pass: where another worker had the slowest backward, the
        # replay's compute is longer than the clock's t_compute (the slowest forward + backward of one worker)
        rows = [it for it in trace_iterations(source, 3).iterations]
        extra = np.mean([it.forward + it.backward - it.compute for it in rows])
        least = np.mean([it.forward + max(r[-1] for r in it.pipelined.ready) + it.rest for it in rows])
        assert least < ours.seconds_per_iteration <= (ours.clock["seconds_per_iteration"] + extra) * 1.02
    assert any("a pipelined run" in note for note in simulation.notes)


def _one_flow_per_side() -> tuple[PipelinedTraffic, IterationTraffic]:
    """Worker 0 sends two 1 MB frames, of buckets ready 0 and 50 ms into backward, to worker
    1, which serves both and sends back two 1 MB averages; no loss or Control bytes."""
    MB = 1_000_000
    frames = (((0, 0), (0, 0)), ((MB, 0), (MB, 0)))  # [shard][bucket][worker]
    pipelined = PipelinedTraffic(0, 0, ((0.0, 0.05), (0.0, 0.05)), frames, ((0, 0), (MB, MB)))
    traffic = IterationTraffic(0, 0, ((0, 0), (2 * MB, 0)), (0, 2 * MB), colocated=True)
    return pipelined, traffic


@needs_simgrid
def test_with_one_flow_per_side_the_replay_is_the_clocks_schedule(tmp_path):
    """One connection carries a pair's frames in bucket order (Phase.fifo): bucket 0's frame
    is in 0.1 s after the forward pass, bucket 1's 0.1 s later, each average leaves as its
    frame is in and backward is over: the clock's schedule to the nanosecond (shared, the two
    frames would end together)."""
    pipelined, traffic = _one_flow_per_side()
    forward, rest = 0.01, 0.002
    platform = generated(2, 1, 0, 1e7, 0.0, 1e10, 0.0)
    simulation = simulate([Iteration(traffic, forward + 0.05, rest, pipelined, forward)], platform, label="x",
                          source="hand-built")
    t_comm, _ = LinkModel(1e7, 0.0, "virtual", "star").pipelined_iteration(pipelined, 0.0, None, forward, 0.05)
    clock = forward + 0.05 + rest + t_comm
    assert clock == pytest.approx(0.312)
    assert simulation.mpigrad.seconds_per_iteration == pytest.approx(clock, abs=1e-9)
    program = pipelined_phases(pipelined, forward, rest)
    plan = {"platform": platform.write(str(tmp_path)), "model": "cm02", "hosts": [0, 0, 1],
            "programs": [program.to_json()], "sequence": [0]}
    names = [phase.name for phase in program.phases]
    ends = dict(zip(names, run_plan(plan)["ends"][0]))
    assert ends["gradients:0"] == pytest.approx(0.11) and ends["gradients:1"] == pytest.approx(0.21)
    shared = Program([replace(phase, fifo=False) for phase in program.phases], program.order)
    ends = dict(zip(names, run_plan({**plan, "programs": [shared.to_json()]})["ends"][0]))
    assert ends["gradients:0"] == pytest.approx(0.16)  # from 0.06 on the two frames share the NIC


def _two_nodes_of_two() -> tuple[PipelinedTraffic, IterationTraffic]:
    """The hierarchical exchange on 2 nodes of 2: two buckets of shard 0 (worker 0, slice 0),
    ready 0 and 50 ms into backward; each 1 MB part inside a node (workers 1 and 3 to their
    slice owners 0 and 2), 1 MB frames from owner 2 to worker 0 and 1 MB averages back, 1 MB
    all-gathers inside each node."""
    MB = 1_000_000
    zeros = ((0, 0, 0, 0), (0, 0, 0, 0))
    frames = (((0, 0, MB, 0), (0, 0, MB, 0)), zeros, zeros, zeros)
    bcast = ((MB, MB), (0, 0), (0, 0), (0, 0))
    pipelined = PipelinedTraffic(0, 0, ((0.0, 0.05),) * 4, frames, bcast, intra=(MB, MB))
    traffic = IterationTraffic(0, 0, ((0, 0, 2 * MB, 0), (0,) * 4, (0,) * 4, (0,) * 4), (2 * MB, 0, 0, 0),
                               colocated=True, hierarchical=True, slice_bytes=(2 * MB, 0))
    return pipelined, traffic


@needs_simgrid
def test_on_nodes_each_slice_owner_forwards_its_nodes_bucket_as_the_clock_has_it():
    """The owner's frame of a bucket leaves once its node's part is in and its own bucket is
    made, its all-gather once the average is in (Phase.relay): with one message per side at a
    time, the clock's schedule (pipelined_hierarchical_round), NICs and intra-node links."""
    pipelined, traffic = _two_nodes_of_two()
    forward, rest = 0.01, 0.002
    platform = generated(2, 2, 0, 1e7, 0.0, 1e10, 5e-6)
    simulation = simulate([Iteration(traffic, forward + 0.05, rest, pipelined, forward)], platform, label="x",
                          source="hand-built")
    nodes = Nodes(2, 1e10, 5e-6)
    t_comm, _ = LinkModel(1e7, 0.0, "virtual", "star", nodes=nodes).pipelined_iteration(pipelined, 0.0, None,
                                                                                       forward, 0.05)
    clock = forward + 0.05 + rest + t_comm
    assert clock == pytest.approx(0.3122, abs=2e-4)  # two frames and two averages of 0.1 s, one after another
    assert simulation.mpigrad.seconds_per_iteration == pytest.approx(clock, rel=1e-6)
    assert simulation.mpigrad.nic_bytes_per_node == ((2_000_000, 2_000_000), (2_000_000, 2_000_000))
    with pytest.raises(UsageError, match="the hosts' replay does not take a pipelined hierarchical run"):
        simulate([Iteration(traffic, forward + 0.05, rest, pipelined, forward)], platform, label="x",
                 source="hand-built", replay="hosts")


def test_the_pipelined_plan_waits_for_its_own_buckets():
    """Each bucket's frames are waited for by its server just before its own average, the
    Control before a worker's first frame, the averages before the local work."""
    pipelined, _ = _one_flow_per_side()
    program = pipelined_phases(pipelined, 0.01, 0.0)
    phases = program.to_json()
    index = {phase.name: k for k, phase in enumerate(program.phases)}
    for b in range(2):
        assert phases[index[f"gradients:{b}"]]["recv_wait"] == index[f"broadcast:{b}"]
        assert phases[index[f"gradients:{b}"]]["fifo"] and phases[index[f"broadcast:{b}"]]["fifo"]
        assert phases[index[f"broadcast:{b}"]]["recv_wait"] == index["local"]
    assert phases[index["control"]]["recv_wait"] == index["gradients:0"]
    assert [phase.kind for phase in program.phases] == ["compute", "losses", "control", "backward", "gradients",
                                                        "backward", "gradients", "broadcast", "broadcast", "local"]


def test_a_pipelined_trace_without_its_buckets_is_not_simulated(runs, tmp_path, capsys):
    source = _edited(runs["flat", "slow"], tmp_path / "edited.h5", _no_buckets)
    message = "a pipelined run (--pipeline) whose trace keeps no buckets table"
    code = main(["simulate", str(source), "--peers", "none"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_pipelined_config_is_refused_in_one_line(capsys):
    code = main(["simulate", "--nodes", "2", "--pipeline", "--servers", "colocated", "--peers", "none"])
    err = capsys.readouterr().err
    assert code == 2 and "--pipeline from a config is not simulated" in err and err.count("\n") == 1, err
