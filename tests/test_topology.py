"""Nodes of several workers (issue 62), where a user sees them: ``resolve_topology``'s rule
(declared, default, auto from MPI's nodes, and what it refuses), ``Topology.describe``, the
``nodes:`` line of ``train --check`` and of the start-up text, Slurm's tasks per node set
against a declared L, ``mpigrad doctor``'s node map, and the trace: its ``topology``
attribute, ``trace info``'s ``nodes`` line and ``trace compare``'s labels."""

from __future__ import annotations

import io
import os
import threading

import pandas as pd
import pytest

from mpigrad.cli import main
from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.runtime.plan.nodes import (format_counts, nodes_line, parse_tasks_per_node, slurm_layout,
                                        slurm_nodes_notes)
from mpigrad.runtime.plan.topology import Topology, resolve_topology
from mpigrad.trace import TraceWriter, default_tables, load

COLOCATED = dict(servers="colocated")


@pytest.fixture(autouse=True)
def many_cores(monkeypatch):
    """resolve_topology notes nodes of more workers than this machine's cores: not the point here."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)


def colocated(**options) -> RunConfig:
    return RunConfig(**{**COLOCATED, **options})


# --- resolve_topology ---------------------------------------------------------------------

def test_a_declared_L_and_the_default():
    topology, exchange, notes = resolve_topology(colocated(ranks_per_node=2), 5)
    assert (topology, exchange, notes) == (Topology(4, 2, "declared"), "hierarchical", [])
    assert (topology.nodes, topology.node_workers(1), topology.cross_group(1)) == (2, [2, 3], [1, 3])
    assert resolve_topology(RunConfig(), 3) == (Topology(2, 1, "default"), "flat", [])
    assert resolve_topology(colocated(), 5) == (Topology(4, 1, "default"), "flat", [])


def test_auto_takes_mpis_nodes_and_refuses_uneven_ones():
    auto = colocated(ranks_per_node="auto")
    # rank 0 and workers 0, 1 on the node of rank 0; workers 2, 3 on the node of rank 3
    assert resolve_topology(auto, 5, [0, 0, 0, 3, 3]) == (Topology(4, 2, "mpi"), "hierarchical", [])
    assert resolve_topology(auto, 5, [0] * 5) == (Topology(4, 4, "mpi"), "flat", [])  # one node
    with pytest.raises(UsageError, match=r"^--ranks-per-node auto: MPI places the workers on 2 node\(s\) holding "
                                         r"1, 3 worker\(s\) \(not equal runs .*--ranks-per-node L"):
        resolve_topology(auto, 5, [0, 0, 2, 2, 2])
    with pytest.raises(UsageError, match=r"not equal runs"):  # nodes whose workers are not consecutive
        resolve_topology(auto, 5, [0, 0, 1, 0, 1])
    with pytest.raises(UsageError, match=r"^--ranks-per-node auto takes the nodes MPI finds at launch"):
        resolve_topology(auto, 5)


def test_what_cannot_be_is_refused_in_one_line():
    for config, size, pattern in [
        (colocated(ranks_per_node=2), 4, r"^--ranks-per-node 2 does not divide the 3 workers: launch a multiple of 2"),
        (colocated(ranks_per_node=3), 5, r"^--ranks-per-node 3 does not divide the 4 workers"),
        (colocated(ranks_per_node=2, exchange="hierarchical"), 3,
         r"^--exchange hierarchical on one node \(2 workers, 2 per node\): nothing crosses a NIC; use --exchange flat"),
    ]:
        with pytest.raises(UsageError, match=pattern) as caught:
            resolve_topology(config, size)
        assert "\n" not in str(caught.value)


def test_the_exchange_auto_and_hierarchical_resolve_to():
    """auto is hierarchical only where servers are colocated, nodes hold several workers and
    there is more than one node; hierarchical at one worker per node is the flat exchange."""
    assert resolve_topology(colocated(ranks_per_node=2), 5)[1] == "hierarchical"
    assert resolve_topology(colocated(ranks_per_node=2), 3)[1] == "flat"        # one node
    assert resolve_topology(colocated(ranks_per_node=1), 5)[1] == "flat"        # one worker per node
    assert resolve_topology(colocated(ranks_per_node=2, exchange="flat"), 5)[1] == "flat"
    assert resolve_topology(colocated(ranks_per_node=2, codec="powersgd"), 5)[1:] == ("hierarchical", [])
    assert resolve_topology(colocated(ranks_per_node=2, codec="powersgd", shard_chunk=1000), 5)[2] == [
        "note: --shard-chunk 1000 is not used: PowerSGD on the hierarchical exchange keeps whole layers in its "
        "shards (a slice's matrices are its local rank's)"]
    menus = dict(codec="powersgd", codec_opts={"ranks": [1, 2]})  # PowerSGD's per-layer settings too
    assert resolve_topology(colocated(ranks_per_node=2, **menus), 5)[1:] == ("hierarchical", [])
    assert resolve_topology(colocated(ranks_per_node=2, exchange="hierarchical", **menus), 5)[1:] == ("hierarchical", [])
    _, exchange, notes = resolve_topology(colocated(exchange="hierarchical"), 5)
    assert (exchange, notes) == ("flat", ["note: --exchange hierarchical with one worker per node is the flat exchange"])


def test_gpu_workers_and_what_auto_finds_are_held_to_the_nodes_rules():
    """Workers on GPUs: auto takes the flat exchange (the device path), an explicit
    hierarchical runs with a note that its codecs are on the host, and the pipelined one is
    refused; an L that auto finds meets the config's own refusals of nodes (separate servers,
    schedules, ...) as a declared one does."""
    _, exchange, notes = resolve_topology(colocated(ranks_per_node=2, device="cuda"), 5)
    assert exchange == "flat" and notes == [
        "note: nodes of several workers on GPUs, flat exchange (the device path where the codecs have kernels; "
        "--exchange hierarchical puts about 1/L of its bytes on each NIC, its codecs on the host)"]
    _, exchange, notes = resolve_topology(colocated(ranks_per_node=2, device="cuda", exchange="hierarchical"), 5)
    assert exchange == "hierarchical" and notes == [
        "note: --exchange hierarchical with --device cuda: the codecs run on the host (the slices are host arrays), "
        "each worker's gradient copied out and the update back every iteration; --exchange flat takes the device "
        "path where the codecs have kernels, and puts about L times the bytes on a NIC"]
    with pytest.raises(UsageError, match=r"^--exchange hierarchical with --pipeline and --device cuda is not built"):
        resolve_topology(colocated(ranks_per_node=2, device="cuda", exchange="hierarchical", pipeline=True), 5)
    for config, pattern in [(RunConfig(ranks_per_node="auto"), "is built for --servers colocated"),
                            (colocated(ranks_per_node="auto", bandwidth="1MB/s@0s,2MB/s@5s"), "a schedule")]:
        with pytest.raises(UsageError, match=pattern):
            resolve_topology(config, 5, [0, 0, 0, 3, 3] if config.colocated else [0, 0, 0, 3, 3])


def test_a_checkpoint_from_before_the_nodes_resumes():
    """Written before the nodes' options existed: none of them in its identity; a run at their
    defaults (the launch resolves exchange auto to flat) resumes it, one on nodes does not."""
    from mpigrad.runtime.measure import checkpoint

    now = {**RunConfig.from_sources(None, {}).to_dict(), "exchange": "flat"}
    before = {key: value for key, value in now.items()
              if key not in ("ranks_per_node", "exchange", "intra_codec", "intra_bandwidth", "intra_latency")}
    assert checkpoint.identity(now, 3) == checkpoint.identity(before, 3)
    assert checkpoint.identity({**now, "ranks_per_node": 2}, 3) != checkpoint.identity(now, 3)


def test_a_declared_L_wins_over_mpi_with_a_note():
    topology, exchange, notes = resolve_topology(colocated(ranks_per_node=2), 5, [0] * 5)
    assert (topology.source, exchange) == ("declared", "hierarchical")
    assert notes == ["note: --ranks-per-node 2 declares 2 node(s) of 2 worker(s); MPI sees 1 node(s) holding 4 "
                     "worker(s): the declared nodes are used (by the network model, and by the exchange's groups)"]
    assert resolve_topology(colocated(ranks_per_node=2), 5, [0, 0, 0, 3, 3])[2] == []  # MPI agrees: no note


def test_describe_puts_rank_0_on_node_0_and_spans_each_nodes_ranks():
    text = Topology(4, 2, "declared").describe()
    assert text.startswith("nodes: 2 of 2 worker(s) (from --ranks-per-node 2); node 0: ranks 0-2; node 1: ranks 3, 4;")
    assert text.endswith("rank 0, the scheduler, on node 0")
    assert Topology(4, 2).rank_nodes() == [0, 0, 0, 1, 1]
    assert "(from MPI's shared-memory split); node 0: ranks 0-4; node 1: ranks 5-8" in Topology(8, 4, "mpi").describe()
    many = Topology(20, 2, "declared").describe()
    assert "node 7: ranks 15, 16; ... 2 more;" in many and "node 8" not in many
    assert Topology(3, 1).describe().startswith("nodes: 3 of one worker each (the model's default")


# --- the nodes line and Slurm's tasks per node ---------------------------------------------

def test_the_nodes_line_says_the_exchange_except_for_the_default():
    config = colocated(ranks_per_node=2)
    assert nodes_line(Topology(4, 2, "declared"), "hierarchical", config).endswith(
        "; exchange: hierarchical (a reduce-scatter and an all-gather inside each node at fp32; across the nodes, "
        "each local rank's slice by the uniform codec)")
    assert nodes_line(Topology(4, 2, "declared"), "flat", config).endswith(
        "; exchange: flat (every worker sends a shard to every other, across a NIC or not)")
    assert nodes_line(Topology(4, 1), "flat", colocated()) == Topology(4, 1).describe()  # short: no exchange
    assert nodes_line(Topology(2, 1), "flat", RunConfig()) is None  # separate servers: links of their own


def test_slurms_tasks_per_node_are_read_in_both_forms():
    assert parse_tasks_per_node("5,4(x3)") == [5, 4, 4, 4]
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert format_counts([5, 4, 4, 4]) == "5,4(x3)" and format_counts([3]) == "3"
    for bad in ("", "5,x", "0", "4(x0)", "4(3)"):
        with pytest.raises(UsageError, match=r"^SLURM_TASKS_PER_NODE=.* is not Slurm's list of tasks per node"):
            parse_tasks_per_node(bad)
    assert slurm_layout({}) is None
    assert slurm_layout({"SLURM_TASKS_PER_NODE": "3(x2)"}).counts == (3, 3)
    both = {"SLURM_TASKS_PER_NODE": "5,4", "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NUM_NODES": "2"}
    assert slurm_layout(both).counts == (5, 4)  # what Slurm placed, over the --ntasks-per-node bound
    layout = slurm_layout({"SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NUM_NODES": "2"})
    assert layout.counts == (4, 4) and layout.rank_nodes(7) == [0, 0, 0, 0, 1, 1, 1]
    assert slurm_layout({"SLURM_NTASKS_PER_NODE": "4"}, size=9).counts == (4, 4, 4)
    assert slurm_layout({"SLURM_NTASKS_PER_NODE": "2(x2)"}).counts == (2, 2)
    assert slurm_layout({"SLURM_JOB_NUM_NODES": "3"}).nodes_only == 3
    assert slurm_layout({"SLURM_TASKS_PER_NODE": "2", "SLURM_DISTRIBUTION": "cyclic:block"}).distribution == "cyclic"
    assert slurm_layout({"SLURM_TASKS_PER_NODE": "2", "SLURM_DISTRIBUTION": "*:cyclic"}).distribution == "block"


def test_slurm_against_a_declared_L_wants_rank_0s_slot_on_node_0():
    config = colocated(ranks_per_node=4)
    topology = resolve_topology(config, 9)[0]
    assert slurm_nodes_notes(config, 9, topology, environ={"SLURM_TASKS_PER_NODE": "5,4"}) == []
    [note] = slurm_nodes_notes(config, 9, topology, environ={"SLURM_TASKS_PER_NODE": "3(x3)"})
    assert note.startswith("note: --ranks-per-node 4 wants 5,4 tasks per node (rank 0 and 4 workers on node 0, 4 on "
                           "each other); Slurm lays out 3(x3) (SLURM_TASKS_PER_NODE): the declared nodes are used")
    uniform = {"SLURM_NTASKS_PER_NODE": "5", "SLURM_JOB_NUM_NODES": "2"}  # fills node 0 with 5, node 1 with 4
    assert slurm_nodes_notes(config, 9, topology, environ=uniform) == []
    assert "Slurm's job has 3 (SLURM_JOB_NUM_NODES=3)" in slurm_nodes_notes(
        config, 9, topology, environ={"SLURM_JOB_NUM_NODES": "3"})[0]
    assert "not checked against Slurm's" in slurm_nodes_notes(
        config, 9, topology, environ={"SLURM_TASKS_PER_NODE": "5,x"})[0]
    assert "distribution cyclic" in slurm_nodes_notes(
        config, 9, topology, environ={"SLURM_TASKS_PER_NODE": "3(x3)", "SLURM_DISTRIBUTION": "cyclic"})[0]
    assert "fewer than the world's 9 ranks" in slurm_nodes_notes(
        config, 9, topology, environ={"SLURM_TASKS_PER_NODE": "4"})[0]
    # the default of one worker per node, and nodes MPI found, are not set against Slurm's
    default = resolve_topology(colocated(), 9)[0]
    assert slurm_nodes_notes(colocated(), 9, default, environ={"SLURM_TASKS_PER_NODE": "3(x3)"}) == []
    assert slurm_nodes_notes(config, 9, Topology(8, 4, "mpi"), environ={"SLURM_TASKS_PER_NODE": "3(x3)"}) == []


def test_a_launch_checks_a_declared_L_against_slurm_and_the_cores(monkeypatch, tmp_path):
    """The launch's checks (preflight) add Slurm's note for a declared L, as --check and the
    doctor do; nodes that MPI found, of more workers than this machine's cores, get a note."""
    from mpigrad.runtime.run.preflight import _launch_problem

    config = colocated(ranks_per_node=4, trace=str(tmp_path / "run.h5"))
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "3(x3)")
    message, (topology, exchange, notes) = _launch_problem(config, 9)
    assert message is None and (topology.ranks_per_node, exchange) == (4, "hierarchical")
    assert [note for note in notes if note.startswith("note: --ranks-per-node 4 wants 5,4 tasks per node")], notes
    monkeypatch.delenv("SLURM_TASKS_PER_NODE")
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    auto = colocated(ranks_per_node="auto")
    notes = resolve_topology(auto, 9, [0] * 5 + [1] * 4)[2]
    assert "note: 4 workers per node, more than this machine's 2 cores: the modelled nodes share them" in notes[0]
    assert not [n for n in resolve_topology(auto, 5, [0, 0, 0, 1, 1])[2] if "cores" in n]


def test_slurm_says_what_auto_would_find_at_launch():
    auto = colocated(ranks_per_node="auto")
    assert slurm_nodes_notes(auto, 9, environ={"SLURM_TASKS_PER_NODE": "5,4"}) == [
        "note: Slurm's layout of 5,4 tasks per node (SLURM_TASKS_PER_NODE) gives --ranks-per-node auto 2 node(s) of 4 "
        "worker(s), exchange hierarchical (if MPI's nodes are Slurm's)"]
    [refused] = slurm_nodes_notes(auto, 9, environ={"SLURM_TASKS_PER_NODE": "3(x3)"})
    assert refused.startswith("note: Slurm's layout of 3(x3) tasks per node (SLURM_TASKS_PER_NODE): --ranks-per-node "
                              "auto would be refused at launch: --ranks-per-node auto: MPI places the workers on 3 "
                              "node(s) holding 2, 3, 3 worker(s)")
    assert "would find 4 worker(s) per node where Slurm places 5,4 tasks per node" in slurm_nodes_notes(
        auto, 9, environ={"SLURM_JOB_NUM_NODES": "2"})[0]
    assert "do not split evenly" in slurm_nodes_notes(auto, 9, environ={"SLURM_JOB_NUM_NODES": "3"})[0]
    assert slurm_nodes_notes(auto, 9, environ={}) == []


# --- mpigrad train --check --------------------------------------------------------------------

def test_the_checks_nodes_lines_and_notes():
    from mpigrad.runtime.run.jobcheck import check_nodes

    lines = check_nodes(colocated(ranks_per_node=2), 5, {})
    assert len(lines) == 1 and lines[0].startswith("nodes: 2 of 2 worker(s) (from --ranks-per-node 2); node 0: ranks "
                                                   "0-2; node 1: ranks 3, 4;")
    assert lines[0].endswith("exchange: hierarchical (a reduce-scatter and an all-gather inside each node at fp32; "
                             "across the nodes, each local rank's slice by the uniform codec)")
    assert check_nodes(RunConfig(), 3, {}) == []          # one server, one worker per node: nothing to say
    assert check_nodes(RunConfig(), None, {}) == []
    assert check_nodes(colocated(), 3, {})[0].startswith("nodes: 2 of one worker each")
    assert check_nodes(colocated(exchange="hierarchical"), 3, {})[1:] == [
        "mpigrad: note: --exchange hierarchical with one worker per node is the flat exchange"]
    assert check_nodes(colocated(ranks_per_node=2), None, {}) == [
        "nodes: 2 worker(s) per node (--ranks-per-node 2): not checked without the world's size, which needs a "
        "multiple of 2 workers"]
    slurm = check_nodes(colocated(ranks_per_node=4), 9, {"SLURM_TASKS_PER_NODE": "3(x3)"})
    assert slurm[-1].startswith("mpigrad: note: --ranks-per-node 4 wants 5,4 tasks per node")
    with pytest.raises(UsageError, match=r"^--ranks-per-node 2 does not divide the 3 workers"):
        check_nodes(colocated(ranks_per_node=2), 4, {})
    with pytest.raises(UsageError, match=r"^--exchange hierarchical on one node"):
        check_nodes(colocated(ranks_per_node=2, exchange="hierarchical"), 3, {})


def test_the_check_of_auto_is_not_refused_and_says_what_slurm_implies():
    from mpigrad.runtime.run.jobcheck import check_nodes

    auto = colocated(ranks_per_node="auto")
    line = ("nodes: resolved at launch from MPI's shared-memory split (--ranks-per-node auto), and the exchange "
            "with them (--exchange auto)")
    assert check_nodes(auto, None, {}) == [line]
    assert check_nodes(auto, 9, {}) == [line]
    assert check_nodes(auto, 9, {"SLURM_TASKS_PER_NODE": "5,4"}) == [
        line, "mpigrad: note: Slurm's layout of 5,4 tasks per node (SLURM_TASKS_PER_NODE) gives --ranks-per-node auto "
              "2 node(s) of 4 worker(s), exchange hierarchical (if MPI's nodes are Slurm's)"]


# --- mpigrad doctor -----------------------------------------------------------------------

def test_doctors_node_map_slurms_tasks_and_the_runs_nodes():
    from mpigrad.runtime.run import doctor

    devices = [(rank, 0 if rank < 3 else 3, "n01" if rank < 3 else "n02", (), 0) for rank in range(5)]
    nodes = doctor._nodes(devices, 5, "colocated", "2", environ={"SLURM_TASKS_PER_NODE": "3,2"})
    assert nodes["of_rank"] == [0, 0, 0, 1, 1] and nodes["hosts"] == ["n01", "n02"]
    assert nodes["topology"] == Topology(4, 2, "declared").record() and nodes["exchange"] == "hierarchical"
    assert nodes["notes"] == [] and nodes["refused"] is None
    lines = doctor._format_nodes(nodes)
    assert lines[0] == "nodes (MPI's shared-memory split): 2 node(s): node 0 ranks 0-2 (n01); node 1 ranks 3-4 (n02)"
    assert lines[1] == "  Slurm            3,2 tasks per node (SLURM_TASKS_PER_NODE)"
    assert lines[2].startswith("  --ranks-per-node 2: nodes: 2 of 2 worker(s)") and len(lines) == 3
    # one machine, two declared nodes: MPI's note, then Slurm's
    one = [(rank, 0, "n01", (), 0) for rank in range(5)]
    lines = doctor._format_nodes(doctor._nodes(one, 5, "colocated", "2", environ={"SLURM_TASKS_PER_NODE": "5"}))
    assert lines[0] == "nodes (MPI's shared-memory split): 1 node(s): node 0 ranks 0-4 (n01)"
    assert lines[3].startswith("  note: --ranks-per-node 2 declares 2 node(s) of 2 worker(s); MPI sees 1 node(s)")
    assert lines[4].startswith("  note: --ranks-per-node 2 wants 3,2 tasks per node")
    assert doctor._format_nodes(doctor._nodes(one, 5, "colocated", "auto", environ={}))[1].startswith(
        "  --ranks-per-node auto: nodes: 1 of 4 worker(s) (from MPI's shared-memory split)")
    refused = doctor._format_nodes(doctor._nodes(one[:4], 4, "colocated", "2", environ={}))
    assert refused[1].startswith("  a run with --ranks-per-node 2 would be refused: --ranks-per-node 2 does not divide")
    plain = doctor._format_nodes(doctor._nodes(one, 5, environ={}))
    assert len(plain) == 1  # no Slurm, no --ranks-per-node: the map alone


# --- the start-up text and the trace ------------------------------------------------------------

def test_the_network_line_names_each_nodes_nic_and_the_links_inside():
    from mpigrad.runtime.run.startup import network_description

    assert network_description(colocated(ranks_per_node=2)) == (
        "10MB/s (80Mbit/s) per node's NIC (shared by its 2 workers), latency 0s per message; inside a node 10GB/s "
        "(80Gbit/s) per worker's link, latency 5us; star broadcast, simulated clock")
    assert network_description(colocated()) == ("10MB/s (80Mbit/s) per link, latency 0s per message, star broadcast, "
                                                "simulated clock")


def _loopback_run(tmp_path, topology: Topology | None, workers: int = 2, **options):
    """A tiny colocated run on threads (tests/test_runtime_loopback.py's way), with
    ``config.topology`` as the launch would set it; (rank 0's log, its trace)."""
    from mpigrad.runtime.roles.stopping import StopFlag
    from mpigrad.runtime.run.session import run_other_rank, run_parameter_server
    from mpigrad.runtime.wire.loopback import LoopbackNetwork

    config = RunConfig(model_opts={"fc_sizes": [64, 64]}, min_quantize_size=2000, iterations=2, batch_size=8,
                       net_mode="virtual", compute_time=0.01, eval_every=0, progress_every=0, seed=5, lr=0.01,
                       servers="colocated", trace=str(tmp_path / "run.h5"), **options)
    config.topology = topology
    net = LoopbackNetwork(workers + 1, workers, timeout=20.0, colocated=True)
    log: list[str] = []
    errors = {}

    def rank_main(rank):
        try:
            channel = net.channel(rank)
            if rank == 0:
                run_parameter_server(config, channel, StopFlag(), ["test"], log.append)
            else:
                run_other_rank(config, channel)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(workers + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(80)
    assert not errors, errors
    return log, load(config.trace)


def test_the_start_up_text_and_the_trace_record_the_nodes(tmp_path):
    """The ``nodes:`` line follows the ``network:`` line; the trace's ``topology`` attribute
    is the launch's record; a run without resolved nodes (in-process) has neither."""
    two = Topology(4, 2, "declared")
    log, trace = _loopback_run(tmp_path, two, workers=4, ranks_per_node=2, exchange="hierarchical")
    nodes = [line for line in log if line.startswith("nodes: ")]
    assert nodes == [nodes_line(two, "hierarchical", colocated(ranks_per_node=2))]
    assert nodes[0].startswith("nodes: 2 of 2 worker(s) (from --ranks-per-node 2); node 0: ranks 0-2; node 1: ranks "
                               "3, 4; rank 0, the scheduler, on node 0; exchange: hierarchical")
    assert log.index(nodes[0]) == next(i for i, line in enumerate(log) if line.startswith("network: ")) + 1
    assert trace.attrs["topology"] == two.record()
    (tmp_path / "one").mkdir()
    log, _ = _loopback_run(tmp_path / "one", Topology(2, 1))
    assert [line for line in log if line.startswith("nodes: ")] == [Topology(2, 1).describe()]  # short
    (tmp_path / "none").mkdir()
    log, trace = _loopback_run(tmp_path / "none", None)
    assert not [line for line in log if line.startswith("nodes: ")] and "topology" not in trace.attrs


# --- trace info and the labels --------------------------------------------------------------------

def _trace(path, workers=4, attrs=None, **config):
    config = {"policy": "fixed", "bits": 2, "seed": 0, "codec": "uniform", "trace": str(path), **config}
    writer = TraceWriter(path, config=config, attrs={"seed": 0, "workers": workers, **(attrs or {})},
                         tables=default_tables(workers), flush_every=50)
    for i in range(10):
        writer.append("steps", {"iteration": i, "wall_time": i + 1.0, "sim_time": i + 1.0, "loss": 2.0 - 0.1 * i,
                                "bits": 2, "bytes_up": 1000, "bytes_down": 1000, "t_compute": 0.0, "t_encode": 0.0,
                                "t_decode": 0.0, "t_comm": 1.0, "t_policy": 0.0})
    writer.close("complete")
    return path


def _trace_cli(capsys, *args):
    code = main(["trace", *map(str, args)])
    return code, capsys.readouterr().out


def test_trace_info_shows_the_nodes_of_several_workers(tmp_path, capsys):
    record = Topology(4, 2, "declared").record()
    hier = _trace(tmp_path / "hier.h5", attrs={"topology": record}, servers="colocated", ranks_per_node=2,
                  exchange="hierarchical", intra_codec="fp16")
    code, out = _trace_cli(capsys, "info", hier)
    nodes = [line for line in out.splitlines() if line.startswith("nodes ")]
    assert code == 0 and len(nodes) == 1
    assert nodes[0].split(None, 1)[1] == ("2 of 2 workers (2x2 hier fp16), hierarchical exchange, fp16 inside each "
                                          "node; L from --ranks-per-node; rank 0 on node 0")
    assert not [line for line in out.splitlines() if line.startswith("topology ")]  # told by the nodes line
    # a trace written before the option existed, and one of one worker per node: no nodes line
    for name, config in (("old.h5", {}), ("one.h5", {"ranks_per_node": 1, "exchange": "flat"})):
        code, out = _trace_cli(capsys, "info", _trace(tmp_path / name, **config))
        assert code == 0 and not [line for line in out.splitlines() if line.startswith("nodes ")]


def test_compare_labels_name_the_nodes_where_runs_differ_in_them(tmp_path, capsys):
    hier = _trace(tmp_path / "hier.h5", servers="colocated", ranks_per_node=2, exchange="hierarchical")
    flat = _trace(tmp_path / "flat.h5", servers="colocated", ranks_per_node=2, exchange="flat")
    one = _trace(tmp_path / "one.h5", servers="colocated", ranks_per_node=1, exchange="flat")
    code, out = _trace_cli(capsys, "summary", hier, flat, one, "--format", "csv")
    assert code == 0
    assert pd.read_csv(io.StringIO(out))["method"].tolist() == [
        "Fix (2-bit) nodes=2x2 hier", "Fix (2-bit) nodes=2x2 flat", "Fix (2-bit) nodes=one per node"]
    # a trace written before the options existed groups with one of one worker per node
    old = _trace(tmp_path / "old.h5", servers="colocated")
    code, out = _trace_cli(capsys, "compare", old, one, "--target-loss", "1.5", "--format", "csv")
    table = pd.read_csv(io.StringIO(out), keep_default_na=False)
    assert code == 0 and table["method"].tolist() == ["Fix (2-bit)"] and table["runs"].tolist() == ["2/2"]


def test_a_peers_config_takes_the_nodes_key_as_mpigrads_does():
    """A DDP trace's config (``bench peers``: a training config with ``peer`` and other keys
    of its own) has its nodes in one ``nodes`` key, as mpigrad's: no ``exchange=`` or
    ``ranks_per_node=`` label tells the two apart when they ran on the same nodes."""
    from mpigrad.analysis.labels import flat_config
    from mpigrad.config import RunConfig

    mpigrad = RunConfig(servers="colocated", ranks_per_node=2, exchange="hierarchical").to_dict()
    ddp = {**mpigrad, "peer": "ddp", "label": "DDP fp32"}
    for config in (mpigrad, ddp):
        flat = flat_config(config)
        assert flat["nodes"] == "2 per node hier" and not {"ranks_per_node", "exchange", "intra_codec"} & set(flat)
