"""Separate servers (``--servers S``, S >= 1): ranks 0..S-1 serve one shard each, the
workers send shard s's frame to server s, each server sums its shard's P frames in rank
order, averages, re-encodes and broadcasts it; rank 0 also receives and decodes every
shard's broadcast into its replica.

One class for the star (S = 1, the paper's one parameter server) and the sharded servers
(S > 1, BytePS's layout): the star is the sharded protocol with one shard, message for
message (rank 0's broadcast group is then alone, no shard server exists and no report is
gathered), so a subclass would add a name and no code.
"""

from __future__ import annotations

import time

from ...codecs import CodecError
from ...config import RunConfig
from ...errors import TrainingError
from ...policies import policy_class
from .aggregator import ShardAggregator, stalled
from .broadcast import broadcast_frames, broadcast_widths, frame_sizes
from .build import SERVER_STREAM, broadcast_codec, build_broadcast_compressor, build_compressor, build_shards
from .way import Rank0Parts, Rank0Side, ServerParts, ShardServerSide, Way, WorkerParts, WorkerSide
from ..wire import (TAG_AVERAGE, TAG_GRAD, TAG_LOSS, TAG_REPORT, FrameError, FrameLength, ReceiveBuffers,
                    ServerReport)

__all__ = ["SeparateServers", "ServersWorker", "ServersShardServer", "ServersRank0"]


class SeparateServers(Way):
    """Separate server ranks: one (the star) or S sharded."""

    @staticmethod
    def chosen(config: RunConfig) -> bool:
        return not config.colocated

    def worker(self, parts: WorkerParts) -> "ServersWorker":
        return ServersWorker(parts)

    def shard_server(self, parts: ServerParts) -> "ServersShardServer":
        return ServersShardServer(parts)

    def rank0(self, parts: Rank0Parts) -> "ServersRank0":
        return ServersRank0(parts)


class ServersWorker(WorkerSide):
    """A worker of separate servers: frames to the servers, every shard's broadcast back."""

    def __init__(self, parts: WorkerParts):
        super().__init__(parts)
        self.lengths = [FrameLength.buffer() for _ in range(self.servers)]
        self.frames = ReceiveBuffers(range(self.servers), self.replica.frame_memory)
        self.broadcast_bits = broadcast_codec(self.config)[1]

    def broadcast(self, m: int) -> None:
        decoder, shards = self.parts.broadcast_decoder, self.shards
        update = self.replica.codec_update
        self.take_broadcast(m, None, None, decoder, shards, broadcast_widths(self.control_msg.bits, self.broadcast_bits),
                            lambda s, frame: decoder.decode(frame, shards[s], update), "gradient")

    def post(self, m: int, frames, tag: int, what: str, aggregator, first: bool = True) -> None:
        self.channel.send(list(zip(frames, self.server_ranks)), tag,
                          lambda pending: f"server rank(s) {', '.join(map(str, pending))} took no {what} "
                                          f"for iteration {m}")

    def take_broadcast(self, m: int, aggregator, transform, compressor, shards, bits, decode, what: str,
                       first: bool = True) -> None:
        """Every server's broadcast frame of ``shards`` (encoded by ``compressor``'s codecs at
        ``bits``), as views of reused buffers (``broadcast.broadcast_frames``), decoded in
        shard order."""
        frames = broadcast_frames(self.channel, list(range(self.servers)), frame_sizes(compressor, shards, bits),
                                  dict(enumerate(self.lengths)), self.frames, None,
                                  lambda: f"the servers sent no {what} for iteration {m}")
        for s in range(self.servers):
            decode(s, frames[s])


class ServersShardServer(ShardServerSide):
    """Rank s in 1..S-1: the server of shard s."""

    def __init__(self, parts: ServerParts):
        super().__init__(parts)
        config, channel, codec = parts.config, parts.channel, parts.codec
        layout = parts.replica.layout
        self.served = self.rank
        self.n_layers = len(layout.quantized)
        shard = build_shards(config, layout, codec, channel.servers)[self.rank]
        decoder = build_compressor(config, layout, codec, SERVER_STREAM, channel.servers)
        self.compressor = build_broadcast_compressor(config, codec, decoder)
        self.aggregator = ShardAggregator(config, channel, shard, decoder, self.compressor, layout.total,
                                          broadcast_codec(config)[1])
        #: Rank 0's policy observes the whole average: send it this shard's part (message 6)
        #: (PowerSGD's policies read the workers' setting errors instead, message 11).
        self.send_average = policy_class(config.policy).uses_gradients and not codec.two_rounds
        self.report = ServerReport.buffer(len(channel.workers), max(self.n_layers, 1))

    def gradients(self, m: int) -> None:
        self.receive(m, self.aggregator)

    def broadcast(self, m: int) -> None:
        self.send_shard(m, self.aggregator)

    # ---- the transport, which a way around this one reuses -------------------------------
    def receive(self, m: int, aggregator: ShardAggregator, tag: int = TAG_GRAD, first: bool = True) -> None:
        """Receive and sum every worker's frame of this shard (``ShardAggregator.aggregate``);
        ``first``: the iteration's first round (the report's counters start again)."""
        sizes, encode, decode = aggregator.aggregate(m, tag=tag)
        if first:
            self.sizes, self.worker_encode, self.t_decode = sizes, encode, decode
            self.bytes_out = 0
        else:
            self.sizes = [a + b for a, b in zip(self.sizes, sizes)]
            self.worker_encode += encode
            self.t_decode += decode

    def send_shard(self, m: int, agg: ShardAggregator, transform=None, first: bool = True) -> None:
        """Average, re-encode (after ``transform``) and broadcast this shard."""
        bits = self.control_msg.bits
        t_encode = agg.encode(bits, transform)
        sizes = {self.rank: agg.broadcast_size(bits)}
        broadcast_frames(self.channel, [self.rank], sizes, {self.rank: agg.frame_len}, ReceiveBuffers(),
                         (self.rank, agg.message), stalled(m))
        self.bytes_out += agg.frame.size + FrameLength.NBYTES
        self.t_encode = t_encode if first else self.t_encode + t_encode

    def reports(self, m: int, one_round: bool = True) -> None:
        agg = self.aggregator
        layers = max(self.n_layers, 1)
        energies = agg.energies(layers) if one_round and self.config.norm_due(m) else [0.0] * layers
        ServerReport(self.bytes_out, self.t_decode, self.t_encode, self.worker_encode,
                     self.sizes, energies, [0.0] * layers).pack(self.report)
        self.channel.send([(self.report, 0)], TAG_REPORT,
                          lambda pending: f"rank 0 took no report for iteration {m}")
        if self.send_average:
            self.channel.send([(agg.pack_average(), 0)], TAG_AVERAGE,
                              lambda pending: f"rank 0 took no average for iteration {m}")


class ServersRank0(Rank0Side):
    """Rank 0 with separate servers: the server of shard 0, which also decodes every
    shard's broadcast into its replica and applies the update."""

    served = 0
    updates_replica = True

    def __init__(self, parts: Rank0Parts):
        super().__init__(parts)
        config, channel, codec, layout = parts.config, parts.channel, parts.codec, parts.replica.layout
        decoder = build_compressor(config, layout, codec, SERVER_STREAM, self.servers)
        self.compressor = build_broadcast_compressor(config, codec, decoder)
        self.aggregator = ShardAggregator(config, channel, self.shards[0], decoder, self.compressor,
                                          layout.total, broadcast_codec(config)[1])
        self.average = self.aggregator.grad_sum
        self.serve_remote(1)
        self.lengths = {s: FrameLength.buffer() for s in range(1, self.servers)}
        self.frames = ReceiveBuffers(range(1, self.servers))

    def gradients(self, m: int) -> None:
        self.receive(m, self.aggregator)

    def broadcast(self, m: int) -> None:
        compressor, shards, update = self.compressor, self.shards, self.update
        self.send_round(m, self.aggregator, None,
                        frame_sizes(compressor, shards, self.aggregator.broadcast_widths(self.bits)),
                        lambda s, frame: compressor.decode(frame, shards[s], update))

    # ---- the transport, which a way around this one reuses -------------------------------
    def receive(self, m: int, aggregator: ShardAggregator) -> None:
        """Receive and sum every worker's frame of shard 0 (``ShardAggregator.aggregate``)."""
        self.sizes, self.worker_encode, self.t_decode = aggregator.aggregate(m)

    def send_round(self, m: int, agg: ShardAggregator, transform, sizes: list[int | None], decode) -> None:
        """The iteration's first broadcast round (:meth:`broadcast_round`), counted."""
        t_encode, t_decode, frame_bytes = self.broadcast_round(m, agg, transform, sizes, decode)
        self.t_encode = t_encode
        self.t_decode += t_decode
        self.frame_bytes = frame_bytes

    def add_round(self, t_encode: float, t_decode: float, worker_encode: float) -> None:
        """A later round's seconds, added to the iteration's."""
        self.t_encode += t_encode
        self.t_decode += t_decode
        self.worker_encode += worker_encode

    def broadcast_round(self, m: int, agg: ShardAggregator, transform, sizes: list[int | None],
                        decode) -> tuple[float, float, list[int]]:
        """Average and re-encode ``agg``'s shard, broadcast it with the other servers' shards
        (``sizes``: each frame's where every rank computes it, ``broadcast.broadcast_frames``),
        and ``decode(s, frame)`` every shard's; return (encode s, decode s, each frame's bytes)."""
        t_encode = agg.encode(self.bits, transform)
        try:
            frames = broadcast_frames(self.channel, list(range(self.servers)), sizes, {0: agg.frame_len, **self.lengths},
                                      self.frames, (0, agg.message), lambda: self._broadcast_stalled(m))
        except FrameError as exc:
            raise TrainingError(f"bad broadcast at iteration {m}: {exc}") from None
        start = time.process_time()
        for s, frame in frames.items():
            try:
                decode(s, frame)
            except (CodecError, FrameError) as exc:
                raise TrainingError(f"bad broadcast frame from server rank {s} at iteration {m}: {exc}") from None
        return t_encode, time.process_time() - start, [frame.size for frame in frames.values()]

    def _broadcast_stalled(self, m: int) -> str:
        """Why rank 0's gradient broadcast of iteration m stalled. A collective does not say
        which member is missing, but a worker it reached goes on and sends its loss for
        m + 1: the workers whose loss has not come are named when some others' has."""
        went_on = [rank for rank in self.worker_ranks if self.channel.has_message(rank, TAG_LOSS)]
        silent = [rank for rank in self.worker_ranks if rank not in went_on]
        if not went_on or not silent:
            return stalled(m)()
        return (f"worker rank(s) {', '.join(map(str, silent))} did not take the gradient broadcast of "
                f"iteration {m} (the other workers went on to iteration {m + 1})")

    # ---- the reports, the update ---------------------------------------------------------
    def own_report(self, m: int, sizes2: list[int] | None) -> list[ServerReport]:
        """Shard 0's report (two rounds, ``sizes2`` given: the frame bytes of both; norm_ratio
        has no ||g||, NaN)."""
        layers = max(self.n_layers, 1)
        if sizes2 is not None:
            return [ServerReport(0, self.t_decode, self.t_encode, self.worker_encode,
                                 [a + b for a, b in zip(self.sizes, sizes2)], [0.0] * layers, [0.0] * layers)]
        energies = self.aggregator.energies(layers) if self.config.norm_due(m) else [0.0] * layers
        return [ServerReport(0, self.t_decode, self.t_encode, self.worker_encode, self.sizes, energies,
                             [0.0] * layers)]

    def reports(self, m: int, sizes2: list[int] | None = None) -> None:
        self.server_reports = self.gather_reports(m, self.own_report(m, sizes2))

    def end(self, m: int, lr: float, sync: bool) -> None:
        if not self.parts.script:  # a script's optimizer is the workers' alone
            self.replica.apply_update(self.update, lr)
