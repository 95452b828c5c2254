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
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ...codecs import CodecError
from ...errors import TrainingError
from .device import finite
from .frames import EncodedFrames
from ..plan.layout import pipeline_buckets
from ..wire import TAG_BCAST, TAG_GRAD, BackwardReport, FrameError, error_frame, is_error_frame
from ..wire.channel import Backoff


class PipelinedExchange:
    """A colocated worker's pipelined gradient exchange. Hyperparameters: the worker (its
    replica, shards, compressors, channel) and the buckets; state: this iteration's frames,
    receives and times (all reset by :meth:`backward`)."""

    def __init__(self, worker):
        self.worker = worker
        self.buckets = pipeline_buckets(tuple(worker.shards))
        replica = worker.replica
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
        self.local: dict[int, np.ndarray] = {}
        self.sent = [[0] * len(self.worker.shards) for _ in range(B)]
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
            self.worker.channel.test_send(pending)

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
        w = self.worker
        w.take_control(self.m)
        bits, me, channel = w.control_msg.bits, w.serves, w.channel
        others = [rank for rank in channel.workers if rank != w.rank]
        self.own = [b for b, parts in enumerate(self.buckets) if parts[me] is not None]
        self.frames_in = {}
        items = []
        for b in self.own:
            capacity = w.compressor.capacity(self.buckets[b][me], bits)
            for rank in others:
                self.frames_in[(b, rank)] = len(items)
                items.append((self._buffer(("grad", b, rank), capacity), rank))
        self.grad_recv = channel.start_recv(items, TAG_GRAD)
        self.averages_in = {}
        items = []
        for b, parts in enumerate(self.buckets):
            for s, part in enumerate(parts):
                if part is not None and s != me:
                    capacity = w.aggregator.broadcast_capacity(bits, part)
                    self.averages_in[(b, s)] = len(items)
                    items.append((self._buffer(("avg", b, s), capacity), w.server_ranks[s]))
        self.avg_recv = channel.start_recv(items, TAG_BCAST)

    def _buffer(self, key, capacity: int) -> np.ndarray:
        return self.worker.pipeline_buffers.take(key, capacity)

    def _send(self, b: int) -> None:
        """Queue bucket b's frames (``queue_shards``: no wait inside backward) and send them
        once done, in bucket order (:meth:`_post_done`): the host path's are done at the
        call, so sent at once; the device path's when the device has done them (a later
        hook's :meth:`_flush`, or after backward)."""
        w = self.worker
        start = time.process_time()
        parts = [(s, part) for s, part in enumerate(self.buckets[b]) if part is not None]
        grad = w.replica.codec_gradient([p for _, part in parts for p in part.pieces])  # this bucket's only
        shards, bits = [part for _, part in parts], w.control_msg.bits
        queued = self._encoded(parts, grad, lambda: w.compressor.queue_shards(grad, bits, shards),
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
        w = self.worker
        for s, frame in frames:
            self.sent[b][s] = frame.size
        self.local.update((b, frame) for s, frame in frames if s == w.serves)
        remote = [(frame, w.server_ranks[s]) for s, frame in frames if s != w.serves]
        self.sends.append(w.channel.start_send(remote, TAG_GRAD))

    # ---- the shard's averages and the update ---------------------------------------------
    def exchange(self) -> None:
        """Serve this worker's shard and take every shard's average, bucket by bucket, as the
        frames arrive; apply each bucket's update once all of it is in."""
        w = self.worker
        m, channel = self.m, w.channel
        bits = w.control_msg.bits
        update = w.replica.codec_update
        ranks = channel.workers
        others = [rank for rank in ranks if rank != w.rank]
        self.sizes = {rank: 0 for rank in ranks}
        self.t_decode = self.t_encode = 0.0
        self.bytes_out = 0
        self.bcast = [0] * len(self.buckets)
        parts_left = [sum(part is not None for part in parts) for parts in self.buckets]
        own, averages = list(self.own), dict(self.averages_in)
        stalled = lambda: (f"worker rank {w.rank}: the frames of iteration {m} did not all arrive "  # noqa: E731
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
                    frames = [(rank, self.local[b] if rank == w.rank else
                               self.worker.pipeline_buffers[("grad", b, rank)][:counts[rank]]) for rank in ranks]
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
                frame = self.worker.pipeline_buffers[("avg", b, s)][:count]
                start = time.process_time()
                try:
                    w.broadcast_decoder.decode(frame, self.buckets[b][s], update)
                except (CodecError, FrameError) as exc:
                    raise RuntimeError(f"bad shard frame from worker rank {w.server_ranks[s]} at iteration "
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
        w, m = self.worker, self.m
        agg, part = w.aggregator, self.buckets[b][w.serves]
        first = frames[0][0]
        for rank, frame in frames:
            if is_error_frame(frame):
                raise TrainingError(f"worker rank {rank} computed a non-finite gradient at iteration {m}")
            self.sizes[rank] += frame.size
            start = time.process_time()
            try:
                agg.decoder.decode(frame, part, agg.grad_sum, accumulate=rank != first)
            except (CodecError, FrameError) as exc:
                raise TrainingError(f"bad gradient frame from worker rank {rank} at iteration {m}: {exc}") from None
            self.t_decode += time.process_time() - start
        self.t_encode += agg.encode(bits, shard=part)
        frame = agg.frame
        self.sends.append(w.channel.start_send([(frame, rank) for rank in others], TAG_BCAST))
        self.bcast[b] = frame.size
        self.bytes_out += frame.size
        start = time.process_time()
        w.broadcast_decoder.decode(frame, part, w.replica.codec_update)
        self.t_decode += time.process_time() - start

    def _apply_if_complete(self, b: int, parts_left: list[int], update: np.ndarray) -> None:
        if parts_left[b] or not self.worker.applies_update:  # a script's optimizer applies it after backward
            return
        replica, lr = self.worker.replica, self.worker.lr
        for part in self.buckets[b]:
            if part is not None:
                for piece in part.pieces:
                    replica.step(lr, piece.offset, piece.size)

    # ---- the report --------------------------------------------------------------------
    def report(self, cpu: float, wall: float, buf: np.ndarray) -> np.ndarray:
        """Message 10 for this iteration into ``buf``."""
        return BackwardReport(cpu, wall, self.ready_cpu, self.ready_wall,
                              [n for row in self.sent for n in row], self.bcast).pack(buf)
