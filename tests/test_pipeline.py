"""The pipelined iteration (``--pipeline``): the same run as the sequential protocol, its
buckets, its options, and its clock (the in-process loopback channel here; real mpiexec
runs in test_train_mpi.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mpigrad.clockmodel import LinkModel, PipelinedTraffic
from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.runtime.plan.checks import check_options
from mpigrad.runtime.plan.layout import Layout, Segment, pipeline_buckets, plan_shards
from mpigrad.runtime.wire import BackwardReport
from mpigrad.trace import load
from test_runtime_loopback import run

COLUMNS = ("loss", "bits")


@pytest.mark.parametrize("options", [
    dict(codec="qsgd", policy="adaptive", bits=2, error_feedback="residual", workers=3, shard_chunk=1500),
    dict(codec="uniform", policy="lgreco", bits=3, workers=2, eval_every=3),
    dict(codec="fp32", policy="fixed", workers=2, model="resnet20", model_opts={}, data="synthetic",
         data_opts={"shape": [3, 8, 8], "train_size": 64, "test_size": 16}, min_quantize_size=500),
], ids=["qsgd-adaptive-residual-chunks", "uniform-lgreco", "fp32-resnet-batchnorm"])
def test_the_pipelined_iteration_gives_the_sequential_run_bit_for_bit(tmp_path, options):
    """Same losses, bits, bytes, parameters (checksums), policy records and evaluations as
    the sequential protocol: per bucket, the same float operations in the same order."""
    workers = options.pop("workers")
    code1, errors1, seq = run(tmp_path, servers="colocated", workers=workers, name="seq.h5", **options)
    code2, errors2, pipe = run(tmp_path, servers="colocated", workers=workers, name="pipe.h5", pipeline=True,
                               **options)
    assert code1 == code2 == 0 and not errors1 and not errors2, (errors1, errors2)
    a, b = load(seq.trace), load(pipe.trace)
    for column in COLUMNS:
        np.testing.assert_array_equal(a.steps[column], b.steps[column], err_msg=column)
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    pd.testing.assert_frame_equal(a.policy, b.policy)  # policies that do not read the clock
    if len(a.eval):
        np.testing.assert_array_equal(a.eval["test_loss"], b.eval["test_loss"])
    # a frame per bucket: 16 header bytes more per bucket beyond the first of each shard
    for column in ("bytes_up", "bytes_down"):
        extra = b.steps[column].to_numpy() - a.steps[column].to_numpy()
        assert ((extra > 0) & (extra < 0.05 * a.steps[column].to_numpy())).all(), (column, extra)


def test_a_non_finite_gradient_is_named_in_the_pipeline(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIGRAD_INJECT_FAULT", "nan-grad:2:3")
    code, errors, config = run(tmp_path, servers="colocated", workers=2, timeout=5.0, pipeline=True)
    assert code != 0
    messages = " | ".join(str(e) for e in errors.values())
    assert "worker rank 2 computed a non-finite gradient at iteration 3" in messages, messages
    assert load(config.trace).status == "failed"


def test_the_buckets_follow_backward_and_cover_every_piece():
    layout = Layout((Segment("a", 0, 100), Segment("b", 100, 300)), Segment("small layers", 400, 10), 410)
    shards = plan_shards(layout, 2, lambda p: p.size, chunk=100)
    buckets = pipeline_buckets(shards, limit=200)
    parts = [[(s, part) for s, part in enumerate(parts) if part] for parts in buckets]
    assert all(len(bucket) == 1 for bucket in parts)  # each on one shard, as that shard's part
    layers = [{p.layer for p in part.pieces} for [(_, part)] in parts]
    assert layers == [{1}, {1}, {0}, {-1}]  # last layer first, the small layers last
    for b, [(s, part)] in enumerate(parts):
        assert set(part.pieces) <= set(shards[s].pieces) and (part.server, part.bucket) == (s, b)
        assert sum(p.size for p in part.pieces) <= 200 or len(part.pieces) == 1
    assert sorted(p.index for [(_, part)] in parts for p in part.pieces) == list(range(5))
    assert len(pipeline_buckets(shards, limit=1)) == 5  # one piece each


def test_bad_combinations_are_one_line_errors():
    with pytest.raises(UsageError, match="pipeline needs servers = colocated"):
        RunConfig(pipeline=True, servers=2, lr=0.01).validate()
    with pytest.raises(UsageError, match="drop --pipeline"):
        check_options(RunConfig(pipeline=True, servers="colocated", codec="powersgd", policy="fixed", lr=0.01))


def test_a_pipelined_gpu_run_needs_an_mpi_with_threads():
    """The hooks of a GPU's backward run on autograd's device thread and call MPI: below
    MPI_THREAD_SERIALIZED that is refused in one line; CPU runs and sequential runs pass."""
    from mpi4py import MPI

    from mpigrad.runtime.run.preflight import check_thread_level

    pipelined = RunConfig(servers="colocated", pipeline=True, device="cuda")
    for level in (MPI.THREAD_SINGLE, MPI.THREAD_FUNNELED):
        with pytest.raises(UsageError, match="needs MPI_THREAD_SERIALIZED or more, and this MPI gave MPI_THREAD_") as info:
            check_thread_level(pipelined, level)
        assert "\n" not in str(info.value) and "drop --pipeline" in str(info.value)
    check_thread_level(pipelined, MPI.THREAD_SERIALIZED)
    check_thread_level(pipelined, MPI.THREAD_MULTIPLE)
    check_thread_level(RunConfig(servers="colocated", pipeline=True, device="cpu"), MPI.THREAD_SINGLE)
    check_thread_level(RunConfig(servers="colocated", device="cuda"), MPI.THREAD_SINGLE)
    import torch

    if not torch.cuda.is_available():  # auto takes the CPU where there is no GPU
        check_thread_level(RunConfig(servers="colocated", pipeline=True, device="auto"), MPI.THREAD_SINGLE)
    assert MPI.Query_thread() >= MPI.THREAD_SERIALIZED  # what the test suite's MPI gives


def test_the_backward_report_round_trips_and_refuses_a_wrong_size():
    report = BackwardReport(0.5, 0.6, [0.1, 0.4], [0.2, 0.5], [1, 2, 3, 4, 5, 6], [7, 0])
    buf = BackwardReport.buffer(2, 3)
    assert BackwardReport.unpack(report.pack(buf), 2, 3) == report
    with pytest.raises(ValueError):
        BackwardReport.unpack(buf, 3, 3)


def _traffic(ready, size=1_000_000, buckets=1):
    P = len(ready)
    frames = tuple(tuple(tuple(0 if w == s else size // buckets for w in range(P)) for _ in range(buckets))
                   for s in range(P))
    return PipelinedTraffic(40, 32, ready, frames, tuple((size // buckets,) * buckets for _ in range(P)))


def test_the_pipelined_clock_with_one_bucket_is_the_sequential_clock():
    """One bucket ready at once: loss gather, Control, frames, averages, one after another
    (P = 2: each node sends one frame and one average; P = 4: all-to-all without a clash)."""
    link = LinkModel(10e6, 1e-3)
    for P in (2, 4):
        traffic = _traffic(((0.0,),) * P)
        sequential = (link.losses(P, 40, colocated=True) + link.control(P, 1, 32, colocated=True)
                      + link.gradients(traffic.frames and [[traffic.frames[s][0][w] for w in range(P)]
                                                           for s in range(P)], colocated=True)
                      + link.broadcasts(P, [1_000_000] * P, colocated=True))
        # the same, but for the frames of a worker that had the Control early going early
        controls = P * link.message(32)
        assert sequential - controls <= link.pipelined(traffic) <= sequential


def test_the_pipelined_clock_hides_communication_behind_backward():
    """Two buckets: the first one's frames cross while backward makes the second; a node
    averages its shard once its own backward has ended, so after backward its link carries
    the last bucket's frame and both averages."""
    link = LinkModel(10e6, 0.0)
    one = link.pipelined(_traffic(((0.0,), (0.0,))))
    late = link.pipelined(_traffic(((0.05, 0.3), (0.05, 0.3)), buckets=2))
    assert late == pytest.approx(0.3 + 3 * 0.05, abs=1e-5)
    assert late < 0.3 + one  # sequential: backward, then all of it
    busy = link.pipelined(_traffic(((0.0, 0.01), (0.0, 0.01)), buckets=2))
    assert busy == pytest.approx(one, abs=1e-5)  # the link was the bottleneck throughout


def test_posted_receives_take_a_sources_messages_in_the_order_they_were_posted():
    """MPI's non-overtaking rule, which the pipeline's bucket order rests on, on loopback too:
    a later receive never takes a message while an earlier one from that source waits."""
    from mpigrad.runtime.wire.loopback import LoopbackNetwork

    net = LoopbackNetwork(3)
    a, b, c = (net.channel(rank) for rank in range(3))
    first, second, other = np.zeros(4, np.uint8), np.zeros(4, np.uint8), np.zeros(4, np.uint8)
    pending = c.start_recv([(first, 0), (other, 1), (second, 0)], 7)
    assert c.received(pending, 2) is None
    a.send([(np.full(2, 1, np.uint8), 2)], 7, None)
    assert c.received(pending, 2) is None and c.received(pending, 0) == 2 and first[:2].tolist() == [1, 1]
    a.send([(np.full(3, 2, np.uint8), 2)], 7, None)
    b.send([(np.full(4, 3, np.uint8), 2)], 7, None)
    assert (c.received(pending, 2), c.received(pending, 1)) == (3, 4)
    assert second[:3].tolist() == [2, 2, 2] and other.tolist() == [3, 3, 3, 3]
    with pytest.raises(RuntimeError, match="receive buffer"):
        a.send([(np.zeros(9, np.uint8), 2)], 7, None)
        c.received(c.start_recv([(np.zeros(4, np.uint8), 0)], 7), 0)
