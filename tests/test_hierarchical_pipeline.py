"""The pipelined hierarchical iteration (``--pipeline`` with ``--exchange hierarchical``,
runtime/exchange/hierarchical_pipeline.py): the sequential hierarchical run bit for bit on
2 nodes of 2 workers (the in-process loopback channel; the real run under mpiexec is in
test_hierarchical.py), the clock's charge of it with the reduce-scatter and all-gather
inside the nodes, and what the config takes and still refuses."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mpigrad.clockmodel import IterationTraffic, LinkModel, Nodes, PipelinedTraffic
from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.runtime.exchange import ways
from mpigrad.runtime.exchange.hierarchical_pipeline import HierarchicalPipelined, HierarchicalPipelinedWorker
from mpigrad.runtime.exchange.pipeline import Pipelined
from mpigrad.runtime.plan.topology import resolve_topology
from mpigrad.runtime.wire import TAG_INTRA, PeerTimeout
from mpigrad.runtime.wire.loopback import LoopbackChannel
from mpigrad.trace import load
from test_runtime_loopback import run

HIERARCHICAL = dict(servers="colocated", workers=4, ranks_per_node=2, exchange="hierarchical")


@pytest.mark.parametrize("options", [
    dict(codec="qsgd", policy="adaptive", bits=2, error_feedback="residual", shard_chunk=1500),
    dict(codec="uniform", policy="lgreco", bits=3, intra_codec="bf16", error_feedback="residual"),
    dict(codec="qsgd", policy="fixed", bits=4, intra_codec="fp16"),
], ids=["fp32-inside-qsgd-adaptive-residual-chunks", "bf16-inside-uniform-lgreco-residual", "fp16-inside-qsgd"])
def test_the_pipelined_hierarchical_iteration_gives_the_sequential_run_bit_for_bit(tmp_path, monkeypatch, options):
    """Same losses, bits, parameters (checksums every iteration) and policy records as the
    sequential hierarchical run; rank 0 charges each bucket's messages inside the nodes, a
    slice's buckets making up its slice, and the overlap charges less than the sequential.
    The node columns are the overlapped schedule's (``pipelined_hierarchical_round``), not
    the sequential rounds'."""
    charged, rounds = [], []
    real = LinkModel.pipelined_hierarchical_round

    def recording(link, traffic, *args, **kwargs):
        charged.append(traffic)
        rounds.append(real(link, traffic, *args, **kwargs))
        return rounds[-1]

    monkeypatch.setattr(LinkModel, "pipelined_hierarchical_round", recording)
    code1, errors1, seq = run(tmp_path, name="seq.h5", **HIERARCHICAL, **options)
    assert not charged
    code2, errors2, pipe = run(tmp_path, name="pipe.h5", pipeline=True, **HIERARCHICAL, **options)
    assert code1 == code2 == 0 and not errors1 and not errors2, (errors1, errors2)
    a, b = load(seq.trace), load(pipe.trace)
    assert b.config["pipeline"] and b.config["exchange"] == "hierarchical"
    for column in ("loss", "bits"):
        np.testing.assert_array_equal(a.steps[column], b.steps[column], err_msg=column)
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    pd.testing.assert_frame_equal(a.policy, b.policy)  # policies that do not read the clock
    assert a.attrs["shards"]["slice_bytes"] == b.attrs["shards"]["slice_bytes"]
    np.testing.assert_array_equal(a.steps["bytes_intra"], b.steps["bytes_intra"])
    assert len(charged) == len(b.steps)
    slices = b.attrs["shards"]["slice_bytes"]
    for traffic in charged:
        shard = [next(s for s in range(4) if traffic.bcast[s][k]) for k in range(len(traffic.intra))]
        assert [sum(n for n, s in zip(traffic.intra, shard) if s % 2 == j) for j in range(2)] == slices
    assert (b.steps["t_comm"].to_numpy() < a.steps["t_comm"].to_numpy()).all()
    for column, attr in [("bytes_nic", "nic_bytes"), ("bytes_intra", "intra_bytes"), ("t_nic", "nic_seconds"),
                         ("t_intra", "intra_seconds")]:
        np.testing.assert_array_equal(b.steps[column], [getattr(r, attr) for r in rounds], err_msg=column)
    assert not np.array_equal(a.steps["t_nic"], b.steps["t_nic"])  # the overlapped schedule's, not the rounds'


def test_int8_inside_the_node_rounds_each_buckets_message_in_blocks_of_its_own(tmp_path):
    """``--intra-codec int8`` with ``--pipeline``: a bucket's message has blocks of its own
    (256 values from its first), where the sequential run's run across the slice; pieces of
    1500 values here, so that buckets start off the slice's blocks (with whole layers of this
    model every bucket starts on one, and the two runs were the same bit for bit). Every
    replica stays the same bit for bit (checksums every iteration: rank 0 ends a run whose
    replicas diverge); the first loss is the sequential run's (before any update) and the
    later ones near it, the parameters not its own (another rounding); the bytes inside the
    node are each bucket's int8 message, a few scales more than the sequential run's slices."""
    options = dict(codec="qsgd", policy="fixed", bits=4, intra_codec="int8", checksum_every=1, shard_chunk=1500)
    code1, errors1, seq = run(tmp_path, name="seq.h5", **HIERARCHICAL, **options)
    code2, errors2, pipe = run(tmp_path, name="pipe.h5", pipeline=True, **HIERARCHICAL, **options)
    assert code1 == code2 == 0 and not errors1 and not errors2, (errors1, errors2)
    a, b = load(seq.trace), load(pipe.trace)
    assert b.config["pipeline"] and b.config["intra_codec"] == "int8" and len(b.steps) == len(a.steps) > 2
    assert b.steps["loss"].iloc[0] == a.steps["loss"].iloc[0]
    np.testing.assert_allclose(b.steps["loss"], a.steps["loss"], rtol=0.02)
    assert not np.array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    more = b.steps["bytes_intra"].to_numpy() - a.steps["bytes_intra"].to_numpy()
    assert (more > 0).all() and (more % 4 == 0).all() and (more < 0.05 * a.steps["bytes_intra"]).all()


@pytest.mark.parametrize("culprit", [1, 2])
def test_a_non_finite_gradient_is_named_by_its_nodes_owner(tmp_path, monkeypatch, culprit):
    """A node-0 worker's gradient goes NaN: the owner of the slice it lands in names it (from
    backward's hook), whichever of the node's two workers it is, as the sequential
    hierarchical run does (tests/test_hierarchical_faults.py)."""
    monkeypatch.setenv("MPIGRAD_INJECT_FAULT", f"nan-grad:{culprit}:2")
    code, errors, config = run(tmp_path, timeout=8.0, pipeline=True, **HIERARCHICAL)
    assert code != 0
    text = " | ".join(f"{rank}: {error}" for rank, error in sorted(errors.items()))
    assert f"worker rank {culprit} computed a non-finite gradient at iteration 2" in text
    assert f"worker rank {3 - culprit} computed" not in text
    assert load(config.trace).status == "failed"


@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
def test_a_silent_node_worker_is_named_by_its_slices_owner(tmp_path, monkeypatch, pipeline):
    """Rank 2 (node 0, local rank 1) sends nothing inside its node: rank 1, which owns slice 0
    there, times out naming it as the sequential hierarchical run does (one line builder,
    ``hierarchical.silence``), on the pipelined path too, with the other peers it still waits
    for (rank 3, whose average of slice 0 waits for rank 1's frame) after it."""
    real = LoopbackChannel.send

    def silent(channel, items, tag, describe):
        return real(channel, [] if channel.rank == 2 and tag == TAG_INTRA else items, tag, describe)

    monkeypatch.setattr(LoopbackChannel, "send", silent)
    code, errors, _ = run(tmp_path, timeout=4.0, pipeline=pipeline, **HIERARCHICAL)
    assert code != 0 and isinstance(errors.get(1), PeerTimeout), errors
    line = str(errors[1])
    if pipeline:
        assert line == ("node worker rank(s) 2 sent no slice for iteration 0; worker rank(s) 3 sent no shard for "
                        "iteration 0 within 4 s")
    else:
        assert line == "node worker rank(s) 2 sent no slice for iteration 0 within 4 s"


def test_auto_takes_the_hierarchical_pipeline_in_process_as_the_launch_does(tmp_path, monkeypatch):
    """``--exchange auto`` on nodes of several workers: an in-process run resolves it by the
    launch's rule (``resolve_topology``, written into the config by ``resolve_in_process``), so
    a pipelined one takes the hierarchical pipelined exchange, not the flat pipeline; the
    trace records the resolved exchange, as a launched run's."""
    from mpigrad.runtime.plan.topology import resolve_in_process

    for pipeline, names in [(True, ["hierarchical-pipelined"]), (False, ["hierarchical"])]:
        config = RunConfig(lr=0.1, servers="colocated", pipeline=pipeline, ranks_per_node=2, exchange="auto")
        config.validate()
        assert resolve_in_process(config, 5) == [] and config.exchange == "hierarchical"
        assert ways.exchange_names(config) == names
    one_node = RunConfig(lr=0.1, servers="colocated", ranks_per_node=2)
    resolve_in_process(one_node, 3)
    assert one_node.exchange == "flat" and ways.exchange_names(one_node) == ["colocated"]
    built = []
    real = HierarchicalPipelinedWorker.__init__

    def counting(self, parts):
        built.append(parts.channel.rank)
        real(self, parts)

    monkeypatch.setattr(HierarchicalPipelinedWorker, "__init__", counting)
    options = {**HIERARCHICAL, "exchange": "auto", "iterations": 2}
    code, errors, config = run(tmp_path, pipeline=True, **options)
    assert code == 0 and not errors, errors
    assert sorted(built) == [1, 2, 3, 4]
    trace = load(config.trace)
    assert trace.config["exchange"] == "hierarchical" and trace.config["pipeline"]


def test_one_worker_per_node_stays_the_flat_pipeline():
    for options in (dict(), dict(exchange="hierarchical"), dict(exchange="hierarchical", ranks_per_node=1)):
        config = RunConfig(lr=0.1, servers="colocated", pipeline=True, **options)
        config.validate()
        assert ways.exchange_names(config) == ["pipelined"] and type(ways.choose_exchange(config)) is Pipelined
    config = RunConfig(lr=0.1, servers="colocated", pipeline=True, ranks_per_node=2, exchange="hierarchical")
    config.validate()
    assert ways.exchange_names(config) == ["hierarchical-pipelined"]
    assert type(ways.choose_exchange(config)) is HierarchicalPipelined


def test_auto_takes_the_hierarchical_exchange_for_a_pipelined_run_and_the_rest_is_refused():
    pipelined = dict(servers="colocated", pipeline=True, ranks_per_node=2)
    assert resolve_topology(RunConfig(**pipelined), 5)[1:] == ("hierarchical", [])
    assert resolve_topology(RunConfig(**pipelined, exchange="hierarchical"), 5)[1] == "hierarchical"
    for config, size, pattern in [
        (RunConfig(**pipelined), 3, r"^--pipeline with --ranks-per-node L > 1 is built on the hierarchical exchange"),
        (RunConfig(**pipelined, device="cuda"), 5, r"^--pipeline with --ranks-per-node L > 1 is built on the hier"),
        (RunConfig(**pipelined, exchange="hierarchical", device="cuda"), 5,
         r"^--exchange hierarchical with --pipeline and --device cuda is not built yet"),
    ]:
        with pytest.raises(UsageError, match=pattern):
            resolve_topology(config, size)
    for options, message in [
        (dict(exchange="flat"), "--pipeline with --ranks-per-node L > 1 is built on the hierarchical exchange only"),
        (dict(codec="powersgd", policy="fixed"), None),
    ]:
        config = RunConfig(lr=0.1, **pipelined, **options)
        if message is None:  # a two-round codec with --pipeline: refused by its own check
            from mpigrad.runtime.plan.checks import base_codec, check_two_rounds

            with pytest.raises(UsageError, match="drop --pipeline"):
                check_two_rounds(config, base_codec(config))
            continue
        with pytest.raises(UsageError, match=message):
            config.validate()
    RunConfig(lr=0.1, **pipelined, intra_codec="int8").validate()  # each bucket's blocks (the next test)


# ---- the clock ---------------------------------------------------------------------------
P, L = 4, 2


def _traffic(ready, frame=1000, average=900, part=4000):
    """One bucket per shard, bucket b of shard b, in the order ``ready`` (per worker) has them."""
    buckets = len(ready[0])
    frames = tuple(tuple(tuple(frame if b == s and w % L == s % L and w != s else 0 for w in range(P))
                         for b in range(buckets)) for s in range(P))
    bcast = tuple(tuple(average if b == s else 0 for b in range(buckets)) for s in range(P))
    return PipelinedTraffic(0, 0, ready, frames, bcast, True, (part,) * buckets)


def test_the_pipelined_hierarchical_charge_holds_the_intra_node_phases():
    """One bucket ready at once: the reduce-scatter inside the node, the frame and the average
    across, the all-gather inside, one after another: the sequential hierarchical charge
    (``IterationTraffic.phases``) to rounding; each intra-node phase costs its message's time."""
    intra_bw, bw = 1e6, 1e5
    link = LinkModel(bw, 0.0, nodes=Nodes(L, intra_bw, 0.0))
    one = _traffic(((0.0,),) * P)
    assert link.pipelined(one) == pytest.approx(2 * 4000 / intra_bw + (1000 + 900) / bw)
    sequential = IterationTraffic(0, 0, tuple(tuple(1000 if s == 0 and w % L == 0 and w != 0 else 0 for w in range(P))
                                              for s in range(P)), (900, 0, 0, 0), True, ahead=True,
                                  hierarchical=True, slice_bytes=(4000, 0))
    assert [kind for kind, _ in sequential.phases()] == ["intra", "up", "down", "intra"]
    assert link.pipelined(one) == pytest.approx(link.comm_seconds(sequential))
    slower = LinkModel(bw, 0.0, nodes=Nodes(L, intra_bw / 2, 0.0))
    assert slower.pipelined(one) - link.pipelined(one) == pytest.approx(2 * 4000 / intra_bw)
    with pytest.raises(ValueError, match="needs nodes"):
        LinkModel(bw, 0.0).pipelined(one)


def test_the_pipelined_hierarchical_round_gives_the_overlapped_schedules_nics_and_links():
    """The record's node columns of a pipelined run: the seconds during which some NIC (some
    intra-node link) carried a message in the overlapped schedule, and its bytes. One bucket
    ready at once: the sequential rounds' bytes and NIC seconds; the links' seconds are the
    reduce-scatter's and two all-gathers', node 0's running while the average crosses to node
    1 (the rounds charge one, after the broadcast). Buckets spread over backward: the NICs'
    and links' busy seconds are those of the whole iteration's messages, whatever backward
    hides (the span itself is then mostly backward)."""
    intra_bw, bw = 1e6, 1e5
    link = LinkModel(bw, 0.0, nodes=Nodes(L, intra_bw, 0.0))
    one = link.pipelined_hierarchical_round(_traffic(((0.0,),) * P))
    sequential = IterationTraffic(0, 0, tuple(tuple(1000 if s == 0 and w % L == 0 and w != 0 else 0 for w in range(P))
                                              for s in range(P)), (900, 0, 0, 0), True, ahead=True,
                                  hierarchical=True, slice_bytes=(4000, 0))
    rounds = link.node_breakdown(sequential)
    assert one.seconds == pytest.approx(link.pipelined(_traffic(((0.0,),) * P)))
    assert one.nic_seconds == pytest.approx(rounds.nic_seconds) == pytest.approx((1000 + 900) / bw)
    assert rounds.intra_seconds == pytest.approx(2 * 4000 / intra_bw)
    assert one.intra_seconds == pytest.approx(3 * 4000 / intra_bw)
    assert one.nic_seconds + one.intra_seconds > one.seconds  # they overlap each other
    assert (one.nic_bytes, one.intra_bytes) == (rounds.nic_bytes, rounds.intra_bytes)
    late = link.pipelined_hierarchical_round(_traffic(((0.0, 0.1, 0.2, 0.3),) * P))
    at_once = link.pipelined_hierarchical_round(_traffic(((0.0,) * 4,) * P))
    assert (late.nic_bytes, late.intra_bytes) == (at_once.nic_bytes, at_once.intra_bytes)
    # each bucket's frame and average cross once: ready at once, the two NICs carry them side by side
    assert at_once.nic_seconds < late.nic_seconds <= 4 * (1000 + 900) / bw + 1e-12
    assert at_once.intra_seconds <= late.intra_seconds
    assert late.nic_seconds + late.intra_seconds < late.seconds  # backward's 0.3 s is most of it


def test_the_pipelined_hierarchical_charge_hides_earlier_buckets_behind_backward():
    """Four buckets produced 0.1 s apart: what the earlier ones send inside the nodes and
    across overlaps backward; after it, the last bucket's reduce-scatter, frame, average and
    all-gather at least, and less than backward then the whole sequential exchange."""
    intra_bw, bw = 1e6, 1e5
    link = LinkModel(bw, 0.0, nodes=Nodes(L, intra_bw, 0.0))
    at_once = link.pipelined(_traffic(((0.0,) * 4,) * P))
    late = link.pipelined(_traffic(((0.0, 0.1, 0.2, 0.3),) * P))
    assert 0.3 + 2 * 4000 / intra_bw + (1000 + 900) / bw <= late < 0.3 + at_once


def test_a_pipelined_worker_on_a_gpu_is_refused_where_no_launch_checked():
    """An in-process run (no launch check resolves its topology) of the pipelined hierarchical
    exchange with its replica on a GPU: the worker refuses it in one line before building
    anything, as the launch does."""
    import types

    import torch

    parts = types.SimpleNamespace(config=RunConfig(lr=0.1, servers="colocated", pipeline=True, ranks_per_node=2,
                                                   exchange="hierarchical"),
                                  replica=types.SimpleNamespace(device=torch.device("cuda")))
    with pytest.raises(UsageError, match=r"^--exchange hierarchical with --pipeline and --device cuda is not built yet"):
        HierarchicalPipelinedWorker(parts)
