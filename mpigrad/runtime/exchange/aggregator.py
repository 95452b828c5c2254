"""A server's shard of the exchange: :class:`ShardAggregator` receives its slice of every
worker's frame, decodes and adds them in rank order, averages and re-encodes the average
for the broadcast; the helpers the ways of aggregating share around it (a two-round codec's
factor aggregators, message 6's packing, the energies by layer).

Used by every way that serves a shard (``ShardServer``, rank 0 with separate servers, a
colocated worker, the pipelined buckets). Imports :mod:`..wire`, :mod:`..plan` and the
rest of :mod:`.`, never the roles."""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from ...codecs import CodecError
from ...config import RunConfig
from ...counters import copied, launched, synchronized
from ...errors import TrainingError
from .broadcast import broadcast_widths
from .lowrank import LowRank
from ..wire import TAG_GRAD, Channel, FrameError, FrameLength, ReceiveBuffers, is_error_frame

__all__ = ["ShardAggregator", "by_layer", "unpack_average", "factor_aggregators", "stalled"]


class ShardAggregator:
    """One server's shard: receive, decode-add in rank order, average, re-encode.

    ``decoder`` decodes the workers' frames, ``compressor`` re-encodes the average with the
    broadcast's codec (``--broadcast-codec``; the same object when it is the workers'), at
    ``broadcast_bits`` when fixed, else at the iteration's bits. After ``encode``,
    ``grad_sum`` holds the workers' average of this shard's pieces before the re-encode:
    what the policies observe and what ``norm_ratio`` compares the broadcast with.
    """

    def __init__(self, config: RunConfig, channel: Channel, shard, decoder, compressor, total: int,
                 broadcast_bits: int | None, device: torch.device | None = None, contributors: list[int] | None = None):
        """``device``: the sum lives in that device's memory (the device path: ``decoder``
        and ``compressor`` are then device compressors, runtime/exchange/device.py).
        ``contributors``: the ranks whose frames of this shard it averages, in rank order
        (default every worker; a hierarchical exchange's: one worker of each node)."""
        self.config, self.channel, self.shard = config, channel, shard
        self.decoder, self.compressor, self.broadcast_bits = decoder, compressor, broadcast_bits
        self.workers = list(channel.workers if contributors is None else contributors)
        self.grad_sum = (np.zeros(total, np.float32) if device is None
                         else torch.zeros(total, dtype=torch.float32, device=device))
        self.quantized = [piece for piece in shard.pieces if piece.quantized]
        self.average = np.empty(sum(piece.size for piece in self.quantized), np.float32)
        #: The workers' frames: in pinned memory the device decode copies from, on the device path.
        self.recv_buffers = ReceiveBuffers(self.workers, decoder.frame_memory)
        self.frame_len = FrameLength.buffer()
        #: A server that broadcasts to its group (rank 0, ``ShardServer``; colocated workers
        #: send point to point): after a whole-shard ``encode``, the broadcast's message,
        #: ``FrameLength`` then the frame (``self.frame`` is its tail), one buffer reused.
        self.broadcasts = not channel.colocated
        self._message = np.empty(0, np.uint8)
        self.message = self._message
        self.frame: np.ndarray | None = None

    def aggregate(self, m: int, local: tuple[int, np.ndarray] | None = None,
                  tag: int = TAG_GRAD) -> tuple[list[int], float, float]:
        """Receive and sum every contributor's frame of this shard; return (bytes per contributor,
        slowest worker's encode s, decode CPU s). ``local``: (this rank, its own frame) for a
        worker that serves a shard (colocated): that frame is not received but taken as is.
        ``tag``: the round's (TAG_FACTORS for a two-round codec's second).

        Frames are decoded as they arrive but added in rank order (a frame that overtakes a
        lower rank's waits, still encoded, in its receive buffer), so the float sum, and with
        it the whole run, does not depend on arrival order. The first worker decodes straight
        into the sum, the others add to it as they decode (``accumulate=True``).
        """
        sizes = {}
        encode_max = decode_seconds = 0.0
        arrived: dict[int, np.ndarray] = dict([local]) if local is not None else {}
        remote = [rank for rank in self.workers if rank not in arrived]
        order = iter(self.workers)
        next_rank = next(order)
        first = next_rank
        describe = lambda pending: (f"worker rank(s) {', '.join(map(str, pending))} sent no gradient "  # noqa: E731
                                    f"for iteration {m}")
        received = self.channel.frames(remote, tag, self.recv_buffers, describe)
        for rank, frame in itertools.chain(list(arrived.items()), received):
            if is_error_frame(frame):
                raise TrainingError(f"worker rank {rank} computed a non-finite gradient at iteration {m}")
            sizes[rank] = frame.size
            arrived[rank] = frame
            while next_rank in arrived:
                start = time.process_time()
                try:
                    encode_seconds = self.decoder.decode(arrived.pop(next_rank), self.shard, self.grad_sum,
                                                            accumulate=next_rank != first)
                except (CodecError, FrameError) as exc:
                    raise TrainingError(f"bad gradient frame from worker rank {next_rank} at iteration "
                                        f"{m}: {exc}") from None
                decode_seconds += time.process_time() - start
                encode_max = max(encode_max, encode_seconds)
                next_rank = next(order, None)
        return [sizes[rank] for rank in self.workers], encode_max, decode_seconds

    def encode(self, bits: list[int], transform=None, shard=None) -> float:
        """Average the sum and re-encode it into ``self.frame``; return the CPU seconds.
        ``transform(average)``, when given, changes the average in place before the encode
        (PowerSGD's orthogonalisation of P). ``shard``: a part of this shard (a pipelined
        bucket's) to average and encode alone; by default the whole shard."""
        start = time.process_time()
        into_message = shard is None and self.broadcasts
        shard = self.shard if shard is None else shard
        scale = np.float32(1.0 / len(self.workers))
        for piece in shard.pieces:
            part = self.grad_sum[piece.offset:piece.offset + piece.size]
            if isinstance(part, torch.Tensor):
                launched("torch")
                part.mul_(scale.item())  # the same float32 product
            else:
                np.multiply(part, scale, out=part)
        if transform is not None:
            transform(self.grad_sum)
        widths = self.broadcast_widths(bits)
        if into_message:  # FrameLength, then the frame
            capacity = FrameLength.NBYTES + self.compressor.capacity(shard, widths)
            if self._message.size < capacity:
                self._message = np.empty(capacity, np.uint8)
            self.frame = self.compressor.encode(self.grad_sum, widths, shard, out=self._message[FrameLength.NBYTES:])
            self.message = self._message[:FrameLength.NBYTES + self.frame.size]
            self.message[:FrameLength.NBYTES].view(np.int64)[0] = self.frame.size
        else:  # in the compressor's buffer of this shard (or pipelined bucket)
            self.frame = self.compressor.encode(self.grad_sum, widths, shard)
        self.frame_len[0] = self.frame.size
        return time.process_time() - start

    def broadcast_widths(self, bits: list[int]) -> list[int]:
        """The widths the broadcast re-encodes at, the iteration's ``bits`` given."""
        return broadcast_widths(bits, self.broadcast_bits)

    def broadcast_capacity(self, bits: list[int], shard) -> int:
        """The largest frame ``encode`` can make of ``shard`` (or a part of it) at ``bits``."""
        return self.compressor.capacity(shard, self.broadcast_widths(bits))

    def broadcast_size(self, bits: list[int]) -> int | None:
        """The size of this shard's frame at ``bits`` where its codecs fix it, else None."""
        return self.compressor.exact_capacity(self.shard, self.broadcast_widths(bits))

    def energies(self, n_layers: int) -> list[float]:
        """||g||^2 of this shard's part of each quantized layer, g the average (after ``encode``)."""
        return self.update_energies(self.grad_sum, n_layers)

    def update_energies(self, update: np.ndarray, n_layers: int) -> list[float]:
        """||Q(g)||^2 of this shard's part of each quantized layer, Q(g) the decoded broadcast.
        On the device path each piece's dot product stays on the device and all are read
        with one synchronisation, however many pieces the shard has (the same floats)."""
        parts = [update[p.offset:p.offset + p.size] for p in self.quantized]
        if parts and isinstance(update, torch.Tensor):
            dots = [torch.dot(u, u) for u in parts]
            launched("torch", len(dots) + (len(dots) > 1))
            synchronized("energy read")  # one read of the device values
            return by_layer(self.quantized, (torch.stack(dots) if len(dots) > 1 else dots[0].reshape(1)).tolist(),
                            n_layers)
        return by_layer(self.quantized, [float(np.dot(u, u)) for u in parts], n_layers)

    def energy_pair(self, update, n_layers: int, wait) -> tuple[list[float], list[float]]:
        """(:meth:`energies`, :meth:`update_energies` of ``update``). On the device path the
        two dot products of every piece stay on the device, copied behind them into pinned
        memory, and ``wait()`` (the rank's one read of its device status,
        :meth:`~.device.DeviceStatus.wait`) ends the copy: no synchronisation of their own,
        the same floats."""
        if not (self.quantized and isinstance(update, torch.Tensor)):
            return self.energies(n_layers), self.update_energies(update, n_layers)
        dots = [torch.dot(u, u) for source in (self.grad_sum, update)
                for u in (source[p.offset:p.offset + p.size] for p in self.quantized)]
        launched("torch", len(dots) + 2)  # the dot products, their stack and its copy
        values = torch.empty(len(dots), dtype=torch.float32, pin_memory=update.is_cuda)
        values.copy_(torch.stack(dots), non_blocking=True)
        copied("to_host", values.nbytes)
        wait()
        values = values.tolist()
        n = len(self.quantized)
        return by_layer(self.quantized, values[:n], n_layers), by_layer(self.quantized, values[n:], n_layers)

    def pack_average(self) -> np.ndarray:
        """The average of this shard's quantized pieces, in piece order (message 6)."""
        pos = 0
        for piece in self.quantized:
            part = self.grad_sum[piece.offset:piece.offset + piece.size]
            if isinstance(part, torch.Tensor):
                copied("to_host", 4 * piece.size)
                synchronized("average to host")  # a blocking copy, for a policy that reads the average
                part = part.cpu().numpy()
            self.average[pos:pos + piece.size] = part
            pos += piece.size
        return self.average

def by_layer(pieces, values: list[float], n_layers: int) -> list[float]:
    """Each of ``pieces``' value (``values``, in piece order) added into its layer's."""
    energies = [0.0] * n_layers
    for piece, value in zip(pieces, values):
        energies[piece.layer] += value
    return energies


def unpack_average(shard, average: np.ndarray, out: np.ndarray) -> None:
    """Write a server's message 6 for ``shard`` into ``out`` (the whole average's buffer)."""
    pos = 0
    for piece in shard.pieces:
        if piece.quantized:
            out[piece.offset:piece.offset + piece.size] = average[pos:pos + piece.size]
            pos += piece.size


def factor_aggregators(config: RunConfig, channel: Channel, lowrank: LowRank, server: int,
                       contributors: list[int] | None = None) -> tuple:
    """Server ``server``'s aggregators of a two-round codec's factors under the running plan
    (``lowrank.current``): (round 1, round 2), built on the plan's first use and kept with it;
    ``contributors``: the ranks whose frames they average (None: every worker)."""
    plan = lowrank.current
    if plan.aggregators is None:
        plan.aggregators = tuple(ShardAggregator(config, channel, shards[server], compressor, compressor, size, None,
                                                 contributors=contributors)
                                 for shards, compressor, size in ((plan.rounds[0], plan.compressor1, plan.p_size),
                                                                  (plan.rounds[1], plan.compressor2, plan.q_size)))
    return plan.aggregators


def stalled(m: int):
    """The describe() of a server's gradient broadcast of iteration m that stalled."""
    return lambda: f"gradient broadcast of iteration {m} stalled"
