"""The pipelined iteration (``--pipeline``, colocated servers): one worker's backward, its
frames and its shard's averages, bucket by bucket.

A *bucket* is a run of one quantized layer's pieces on one shard (up to
``layout.BUCKET_ELEMENTS``), or the small layers' pieces on one shard; buckets go in the order backward produces
them, last layer first (:func:`~.layout.pipeline_buckets`). The worker sends its loss after the forward pass and
runs backward with a post-accumulate-grad hook on every parameter; when a bucket's last
gradient is in (and every earlier bucket has been encoded), it takes the Control (rank 0
chose the bits meanwhile), encodes the bucket's frame for each shard and posts the sends (on
the device path: queues the encode, and posts the sends from a later hook, in bucket order,
once the device has done it, or after backward: no hook waits for the device). After
backward it serves its shard bucket by bucket: as soon as every worker's frame of a bucket
is in, it adds them in rank order, averages, re-encodes and sends the average to the other
workers; it decodes every shard's average of a bucket as it arrives and applies the update
to the bucket's parameters once all of it is in. Each float operation is the sequential
protocol's, on the same pieces in the same order, so the losses are the same bit for bit.

The worker's ``control`` and ``broadcast`` do nothing (both happen in ``gradients``), and
``reports`` adds message 10 (backward's times). Rank 0's phases are the colocated ones,
but it charges the whole iteration in ``reports`` (``LinkModel.pipelined``).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ...codecs import CodecError
from ...config import RunConfig
from ...errors import TrainingError
from .build import hierarchical_exchange
from .colocated import ColocatedRank0, ColocatedWorker
from .device import finite
from .frames import EncodedFrames
from .way import Rank0Parts, Way, WorkerParts
from ..measure.clock import PipelinedTraffic
from ..plan.layout import bucket_shards, pipeline_buckets
from ..wire import (TAG_BACKWARD, TAG_BCAST, TAG_GRAD, BackwardReport, FrameError, FrameLength, LossReport,
                    ReceiveBuffers, error_frame, is_error_frame)
from ..wire.channel import Backoff

__all__ = ["Pipelined", "PipelinedWorker", "PipelinedRank0"]


class Pipelined(Way):
    """The pipelined iteration (``--pipeline``; the config's checks ask for colocated servers)
    of the flat exchange (the hierarchical one's: :mod:`.hierarchical_pipeline`)."""

    @staticmethod
    def chosen(config: RunConfig) -> bool:
        return config.pipeline and not hierarchical_exchange(config)

    def worker(self, parts: WorkerParts) -> "PipelinedWorker":
        return PipelinedWorker(parts)

    def rank0(self, parts: Rank0Parts) -> "PipelinedRank0":
        return PipelinedRank0(parts)


class BucketedBackward(ColocatedWorker):
    """A colocated worker's backward, bucket by bucket: each bucket's frames encoded and
    sent as backward produces it. Hyperparameters: the worker's parts and the buckets;
    state: this iteration's frames, receives and times (all reset by :meth:`backward`)."""

    def __init__(self, parts: WorkerParts):
        super().__init__(parts)
        self.buckets = pipeline_buckets(tuple(self.shards))
        replica = self.replica
        layer_buckets: dict[int, list[int]] = {}  # a layer's buckets: its pieces (--shard-chunk)
        for b, parts in enumerate(self.buckets):
            piece = next(p for part in parts if part is not None for p in part.pieces)
            layer_buckets.setdefault(piece.layer, []).append(b)
        quantized = replica.layout.quantized
        base = replica.flat_grad.data_ptr()
        self.waiting_for = [0] * len(self.buckets)  # parameters each bucket still waits for
        self.handles = []
        for param in replica.model.parameters():
            if not param.requires_grad:
                continue
            offset = (param.grad.data_ptr() - base) // param.grad.element_size()
            layer = next((i for i, seg in enumerate(quantized) if seg.offset <= offset < seg.offset + seg.size), -1)
            buckets = tuple(layer_buckets[layer])
            for b in buckets:
                self.waiting_for[b] += 1
            self.handles.append(param.register_post_accumulate_grad_hook(lambda _, bs=buckets: self._produced(bs)))
        self.active = False

    # ---- backward and the frames ---------------------------------------------------------
    def backward(self, m: int, loss: torch.Tensor) -> tuple[float, float]:
        """Run backward, sending each bucket's frames as it is produced; return its (CPU s,
        wall s) without the encodes it ran (``encode_seconds``, charged as encode time)."""
        B = len(self.buckets)
        self.m = m
        self.left = list(self.waiting_for)
        self.ready = [False] * B
        self.ready_cpu, self.ready_wall = [0.0] * B, [0.0] * B
        self.next_bucket = 0
        self.sends: list = []
        #: This worker's own frame of each bucket of the shard it serves (it crosses no link).
        self.own_frames: dict[int, np.ndarray] = {}
        self.sent = [[0] * len(self.shards) for _ in range(B)]
        #: Buckets queued and not yet sent, in order: (bucket, parts, gradient, their
        #: PendingFrames, error frames where the encode refused) (the device path's; the host
        #: path's are done at the call and sent at once).
        self.in_flight: list = []
        self.encode_seconds = 0.0
        #: CPU and wall seconds of the work run inside backward that is not backward's (the
        #: encodes, taking the Control, posting the receives), kept out of its times.
        self.aside_cpu = self.aside_wall = 0.0
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()
        self.active = True
        try:
            loss.backward()
        finally:
            self.active = False
        for b in range(B):  # parameters backward did not reach (no gradient): their buckets now
            if not self.ready[b]:
                self._mark(b)
        self._flush(drain=True)
        return (time.process_time() - self.cpu0 - self.aside_cpu,
                time.perf_counter() - self.wall0 - self.aside_wall)

    def _produced(self, buckets: tuple[int, ...]) -> None:
        """A parameter's gradient is in: the buckets it belongs to wait for one less."""
        if not self.active:
            return
        for b in buckets:
            self.left[b] -= 1
            if self.left[b] == 0:
                self._mark(b)
        self._flush()
        for pending in self.sends:  # MPI moves data only inside its calls: keep the sends going
            self.channel.test_send(pending)

    def _mark(self, b: int) -> None:
        """Bucket b is produced: when, in backward's own time."""
        self.ready[b] = True
        self.ready_cpu[b] = time.process_time() - self.cpu0 - self.aside_cpu
        self.ready_wall[b] = time.perf_counter() - self.wall0 - self.aside_wall

    def _flush(self, drain: bool = False) -> None:
        """Encode every produced bucket whose predecessors have been encoded, in order, and
        send those done (on the device path, those whose queued frames the device has done;
        with ``drain``, after backward, all of them, waiting for those not done)."""
        cpu, wall = time.process_time(), time.perf_counter()
        while self.next_bucket < len(self.buckets) and self.ready[self.next_bucket]:
            if self.next_bucket == 0:
                self._start_receiving()
            self._send(self.next_bucket)
            self.next_bucket += 1
        if drain:  # the last first: on one stream the others are then done, and need no wait
            for item in reversed(self.in_flight):
                item[3].wait()
        self._post_done()
        self.aside_cpu += time.process_time() - cpu
        self.aside_wall += time.perf_counter() - wall

    def _start_receiving(self) -> None:
        """Take the Control (the bits), then post a receive for every frame this worker will
        get this iteration: the other workers' frames of its shard and the other shards'
        averages, each buffer as large as the frame can be at these bits."""
        self.parts.take_control(self.m)
        bits, me, channel = self.control_msg.bits, self.served, self.channel
        others = [rank for rank in channel.workers if rank != self.rank]
        self.own = [b for b, parts in enumerate(self.buckets) if parts[me] is not None]
        self.frames_in = {}
        items = []
        for b in self.own:
            capacity = self.parts.compressor.capacity(self.buckets[b][me], bits)
            for rank in others:
                self.frames_in[(b, rank)] = len(items)
                items.append((self._buffer(("grad", b, rank), capacity), rank))
        self.grad_recv = channel.start_recv(items, TAG_GRAD)
        self.averages_in = {}
        items = []
        for b, parts in enumerate(self.buckets):
            for s, part in enumerate(parts):
                if part is not None and s != me:
                    capacity = self.aggregator.broadcast_capacity(bits, part)
                    self.averages_in[(b, s)] = len(items)
                    items.append((self._buffer(("avg", b, s), capacity), self.server_ranks[s]))
        self.avg_recv = channel.start_recv(items, TAG_BCAST)

    def _buffer(self, key, capacity: int) -> np.ndarray:
        return self.pipeline_buffers.take(key, capacity)

    def _send(self, b: int) -> None:
        """Queue bucket b's frames (``queue_shards``: no wait inside backward) and send them
        once done, in bucket order (:meth:`_post_done`): the host path's are done at the
        call, so sent at once; the device path's when the device has done them (a later
        hook's :meth:`_flush`, or after backward)."""
        compressor = self.parts.compressor
        start = time.process_time()
        parts = [(s, part) for s, part in enumerate(self.buckets[b]) if part is not None]
        grad = self.replica.codec_gradient([p for _, part in parts for p in part.pieces])  # this bucket's only
        shards, bits = [part for _, part in parts], self.control_msg.bits
        queued = self._encoded(parts, grad, lambda: compressor.queue_shards(grad, bits, shards),
                               lambda: EncodedFrames([error_frame() for _ in parts]))
        self.encode_seconds += time.process_time() - start
        self.in_flight.append((b, parts, grad, queued))
        self._post_done()

    def _post_done(self) -> None:
        """Send the buckets in flight whose frames are done, in order, up to the first not done."""
        while self.in_flight and self.in_flight[0][3].ready():
            b, parts, grad, queued = self.in_flight.pop(0)
            start = time.process_time()
            frames = self._encoded(parts, grad, queued.frames, lambda: [error_frame() for _ in parts])
            self.encode_seconds += time.process_time() - start
            self._post(b, [(s, frame) for (s, _), frame in zip(parts, frames)])

    @staticmethod
    def _encoded(parts, grad, encode, refused):
        """``encode()``'s result; where it refuses (CodecError) a gradient that is not finite,
        ``refused()`` (the error frames that stand for the parts' frames)."""
        try:
            return encode()
        except CodecError:
            if all(finite(grad[p.offset:p.offset + p.size]) for _, part in parts for p in part.pieces):
                raise
            return refused()

    def _post(self, b: int, frames) -> None:
        """Send bucket b's frames ((shard, frame) pairs) to their servers; keep this worker's own."""
        for s, frame in frames:
            self.sent[b][s] = frame.size
        self.own_frames.update((b, frame) for s, frame in frames if s == self.served)
        remote = [(frame, self.server_ranks[s]) for s, frame in frames if s != self.served]
        self.sends.append(self.channel.start_send(remote, TAG_GRAD))


class PipelinedWorker(BucketedBackward):
    """A colocated worker's pipelined exchange: backward, its frames and its shard's
    averages, bucket by bucket, all in ``gradients``; the update applied bucket by bucket."""

    applies_update = True
    pipelined = True

    def __init__(self, parts: WorkerParts):
        super().__init__(parts)
        self.pipeline_buffers = ReceiveBuffers(memory=self.replica.frame_memory)
        self.backward_report = BackwardReport.buffer(len(self.buckets), self.servers)

    def begin(self, m: int, lr: float, loss: torch.Tensor | None) -> None:
        #: This iteration's learning rate, which the buckets are applied at, and its loss.
        self.lr, self.loss_tensor = lr, loss

    def control(self, m: int) -> None:
        pass  # taken in backward, when the first bucket is ready

    def gradients(self, m: int) -> None:
        self.backward_times = self.backward(m, self.loss_tensor)
        del self.loss_tensor
        self.exchange()
        self.sizes = [self.sizes_by_rank[rank] for rank in self.channel.workers]
        self.worker_encode = self.encode_seconds
        self.bytes_out = self.bucket_bytes + FrameLength.NBYTES

    def broadcast(self, m: int) -> None:
        pass  # the averages came bucket by bucket in ``gradients``

    # ---- the shard's averages and the update ---------------------------------------------
    def exchange(self) -> None:
        """Serve this worker's shard and take every shard's average, bucket by bucket, as the
        frames arrive; apply each bucket's update once all of it is in."""
        m, channel = self.m, self.channel
        bits = self.control_msg.bits
        update = self.replica.codec_update
        decoder = self.parts.broadcast_decoder
        ranks = channel.workers
        others = [rank for rank in ranks if rank != self.rank]
        self.sizes_by_rank = {rank: 0 for rank in ranks}
        self.t_decode = self.t_encode = 0.0
        self.bucket_bytes = 0
        self.bcast = [0] * len(self.buckets)
        parts_left = [sum(part is not None for part in parts) for parts in self.buckets]
        own, averages = list(self.own), dict(self.averages_in)
        stalled = lambda: (f"worker rank {self.rank}: the frames of iteration {m} did not all arrive "  # noqa: E731
                           f"(buckets of its shard left: {own}, other shards' averages left: "
                           f"{sorted(averages)})")
        backoff = Backoff(channel.timeout, stalled)
        while own or averages:
            progressed = False
            if own:
                b = own[0]
                counts = {}
                for rank in others:  # stop at the first frame not in
                    counts[rank] = channel.received(self.grad_recv, self.frames_in[(b, rank)])
                    if counts[rank] is None:
                        break
                if len(counts) == len(others) and all(n is not None for n in counts.values()):
                    frames = [(rank, self.own_frames[b] if rank == self.rank else
                               self.pipeline_buffers[("grad", b, rank)][:counts[rank]]) for rank in ranks]
                    self._average(b, frames, bits, others)
                    parts_left[b] -= 1
                    self._apply_if_complete(b, parts_left, update)
                    own.pop(0)
                    progressed = True
            waiting_on = set()  # a source's averages come in bucket order: test only its oldest
            for (b, s), index in list(averages.items()):
                if s in waiting_on:
                    continue
                count = channel.received(self.avg_recv, index)
                if count is None:
                    waiting_on.add(s)
                    continue
                frame = self.pipeline_buffers[("avg", b, s)][:count]
                start = time.process_time()
                try:
                    decoder.decode(frame, self.buckets[b][s], update)
                except (CodecError, FrameError) as exc:
                    raise RuntimeError(f"bad shard frame from worker rank {self.server_ranks[s]} at iteration "
                                       f"{m}: {exc}") from None
                self.t_decode += time.process_time() - start
                del averages[(b, s)]
                parts_left[b] -= 1
                self._apply_if_complete(b, parts_left, update)
                progressed = True
            if progressed:
                backoff = Backoff(channel.timeout, stalled)
            elif own or averages:
                for pending in self.sends:
                    channel.test_send(pending)
                backoff.sleep()
        for pending in self.sends:
            channel.finish_send(pending, lambda pending: f"worker rank(s) {', '.join(map(str, pending))} took no "
                                                         f"frame of iteration {m}")

    def _average(self, b: int, frames, bits, others) -> None:
        """Add bucket b's frames of this shard in rank order, average, re-encode, send the
        average to the other workers and decode it here."""
        m = self.m
        agg, part = self.aggregator, self.buckets[b][self.served]
        first = frames[0][0]
        for rank, frame in frames:
            if is_error_frame(frame):
                raise TrainingError(f"worker rank {rank} computed a non-finite gradient at iteration {m}")
            self.sizes_by_rank[rank] += frame.size
            start = time.process_time()
            try:
                agg.decoder.decode(frame, part, agg.grad_sum, accumulate=rank != first)
            except (CodecError, FrameError) as exc:
                raise TrainingError(f"bad gradient frame from worker rank {rank} at iteration {m}: {exc}") from None
            self.t_decode += time.process_time() - start
        self.t_encode += agg.encode(bits, shard=part)
        frame = agg.frame
        self.sends.append(self.channel.start_send([(frame, rank) for rank in others], TAG_BCAST))
        self.bcast[b] = frame.size
        self.bucket_bytes += frame.size
        start = time.process_time()
        self.parts.broadcast_decoder.decode(frame, part, self.replica.codec_update)
        self.t_decode += time.process_time() - start

    def _apply_if_complete(self, b: int, parts_left: list[int], update: np.ndarray) -> None:
        if parts_left[b] or not self.parts.applies_update:  # a script's optimizer applies it after backward
            return
        replica, lr = self.replica, self.lr
        for part in self.buckets[b]:
            if part is not None:
                for piece in part.pieces:
                    replica.step(lr, piece.offset, piece.size)

    def report_more(self, m: int) -> None:
        """Message 10 (backward's times, each bucket's ready times and frames) to rank 0."""
        cpu, wall = self.backward_times
        BackwardReport(cpu, wall, self.ready_cpu, self.ready_wall,
                       [n for row in self.sent for n in row], self.bcast).pack(self.backward_report)
        self.channel.send([(self.backward_report, 0)], TAG_BACKWARD,
                          lambda pending: f"rank 0 took no backward report for iteration {m}")


class PipelinedRank0(ColocatedRank0):
    """Rank 0 of the pipelined iteration: the colocated phases, the whole iteration charged
    in ``reports`` from the workers' backward reports (message 10)."""

    #: Each bucket's message inside a node (``PipelinedTraffic.intra``): none here; the
    #: pipelined hierarchical iteration's reduce-scatter and all-gather.
    intra_bytes: tuple[int, ...] = ()

    def __init__(self, parts: Rank0Parts):
        super().__init__(parts)
        #: The buckets, for the workers' backward reports.
        self.buckets = pipeline_buckets(self.shards)
        self.bucket_shard = bucket_shards(self.buckets)
        self.backward_rows = BackwardReport.buffer(len(self.buckets), self.servers, rows=self.workers)

    def charge_losses(self, reports: list[LossReport], ahead: int | None) -> None:
        self.loss_reports, self.ahead = reports, ahead is not None  # charged with the iteration

    def charge_control(self, nbytes: int) -> None:
        pass

    def charge(self, m: int) -> None:
        """Receive the workers' backward reports (message 10) and charge the pipelined
        iteration: its compute (forward + backward), and the communication not hidden
        behind backward (``IterationClock.pipelined``)."""
        self.channel.recv(list(zip(self.backward_rows, self.worker_ranks)), TAG_BACKWARD,
                          lambda pending: f"worker rank(s) {', '.join(map(str, pending))} sent no backward "
                                          f"report for iteration {m}")
        B, S = len(self.buckets), self.servers
        backward = [BackwardReport.unpack(row, B, S) for row in self.backward_rows]
        seconds = self.clock.compute_seconds
        forward = [seconds(r.compute_cpu, r.compute_wall) for r in self.loss_reports]
        self.compute = [f + seconds(b.cpu, b.wall) for f, b in zip(forward, backward)]
        traffic = PipelinedTraffic(
            LossReport.NBYTES, self.control_msg.buf.nbytes,
            tuple(tuple(seconds(c, w) for c, w in zip(b.ready_cpu, b.ready_wall)) for b in backward),
            tuple(tuple(tuple(backward[w].sent[b * S + s] if w != s else 0 for w in range(self.workers))
                        for b in range(B)) for s in range(S)),
            tuple(tuple(backward[s].bcast[b] for b in range(B)) for s in range(S)), self.ahead, self.intra_bytes)
        self.clock.pipelined(traffic, max(forward), max(seconds(b.cpu, b.wall) for b in backward))
