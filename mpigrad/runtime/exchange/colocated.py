"""Colocated servers (``--servers colocated``): no separate server ranks; worker rank s + 1
also serves shard s. Its ``gradients`` posts the frames for the other shards, aggregates
its own shard meanwhile, then waits for its sends; in ``broadcast`` it sends its re-encoded
shard to every other worker and decodes the others' as they arrive, point to point; it
sends its ServerReport in ``reports``. Rank 0 takes part in neither gradient round: it
gathers the P reports, and when the buffers are due it receives the first worker's
parameters after that worker's SGD step (message 9, in ``end``), off both clocks.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from ...codecs import CodecError
from ...config import RunConfig
from ...policies import policy_class
from .aggregator import ShardAggregator
from .buffers import ParameterSync
from .build import (SERVER_STREAM, broadcast_codec, build_broadcast_compressor, build_compressor,
                    hierarchical_exchange)
from .device import on_device
from .way import Rank0Parts, Rank0Side, Way, WorkerParts, WorkerSide
from ..wire import TAG_AVERAGE, TAG_BCAST, TAG_REPORT, FrameError, FrameLength, ReceiveBuffers, ServerReport

__all__ = ["Colocated", "ColocatedWorker", "ColocatedRank0"]


class Colocated(Way):
    """Every worker serves one shard; rank 0 serves none."""

    @staticmethod
    def chosen(config: RunConfig) -> bool:
        return config.colocated and not config.pipeline and not hierarchical_exchange(config)

    def worker(self, parts: WorkerParts) -> "ColocatedWorker":
        return ColocatedWorker(parts)

    def rank0(self, parts: Rank0Parts) -> "ColocatedRank0":
        return ColocatedRank0(parts)


class ColocatedWorker(WorkerSide):
    """A worker that serves its shard (a :class:`~.aggregator.ShardAggregator` of its own,
    on the same path as its codecs: the device's where they run there)."""

    def __init__(self, parts: WorkerParts):
        super().__init__(parts)
        config, channel, replica, codec = parts.config, parts.channel, parts.replica, parts.codec
        self.served = self.server_ranks.index(self.rank)
        layout = replica.layout
        decoder = build_compressor(config, layout, codec, SERVER_STREAM, self.servers)
        server_compressor = build_broadcast_compressor(config, codec, decoder)
        if replica.codecs_on_device:  # the same codecs as the worker's: the same path
            decoder, server_compressor = on_device(replica, decoder, server_compressor)
        self.server_compressor = server_compressor
        #: The shards this worker's frames go to (``post``'s frames, in this order), the ranks
        #: whose frames of its own shard it averages, and the ranks its shard's average goes to:
        #: every shard and every worker here (a hierarchical exchange: its node's slice, and the
        #: workers of its local rank).
        self.sent_shards, self.contributors, self.broadcast_peers = self.exchange_groups(channel)
        self.aggregator = ShardAggregator(config, channel, self.shards[self.served], decoder,
                                          self.server_compressor, layout.total, broadcast_codec(config)[1],
                                          device=decoder.device, contributors=self.contributors)
        self.n_layers = len(layout.quantized)
        self.report = ServerReport.buffer(len(channel.workers), max(self.n_layers, 1))
        # PowerSGD's policies read the workers' setting errors, not the average (message 11)
        self.send_average = policy_class(config.policy).uses_gradients and not codec.two_rounds
        self.bcast_buffers = ReceiveBuffers(channel.workers, replica.frame_memory)
        #: Rank 0 holds the parameters only after a synchronisation: the first worker sends its own.
        self.parameter_sync = ParameterSync(replica, channel)

    def broadcast(self, m: int) -> None:
        decoder, shards = self.parts.broadcast_decoder, self.shards
        update = self.replica.codec_update
        self.take_broadcast(m, self.aggregator, None, None, shards, None,
                            lambda s, frame: decoder.decode(frame, shards[s], update), "gradient")

    # ---- the transport -----------------------------------------------------------------
    def post(self, m: int, frames, tag: int, what: str, aggregator, first: bool = True) -> None:
        """Post the other shards' frames, aggregate this one's meanwhile (every worker sends
        before it receives: no send waits on a receive not yet posted), then wait for the sends."""
        describe = lambda pending: (f"server rank(s) {', '.join(map(str, pending))} took no {what} "  # noqa: E731
                                    f"for iteration {m}")
        targets = list(zip(self.sent_shards, frames))
        pending = self.channel.start_send([(frame, self.server_ranks[s]) for s, frame in targets if s != self.served],
                                          tag)
        own = frames[self.sent_shards.index(self.served)]
        sizes, encode, decode = aggregator.aggregate(m, local=(self.rank, own), tag=tag)
        self.channel.finish_send(pending, describe)
        sizes = self.sizes_by_worker(sizes)
        if first:
            self.sizes, self.worker_encode, self.t_decode = sizes, encode, decode
        else:
            self.sizes = [a + b for a, b in zip(self.sizes, sizes)]
            self.worker_encode += encode
            self.t_decode += decode

    def exchange_groups(self, channel) -> tuple[list[int], list[int], list[int]]:
        """(the shards this worker sends frames to, the ranks whose frames of its shard it
        averages, the ranks it sends its shard's average to)."""
        return list(range(self.servers)), list(channel.workers), [rank for rank in channel.workers if rank != self.rank]

    def sizes_by_worker(self, sizes: list[int]) -> list[int]:
        """The aggregator's frame bytes per contributor as the ServerReport has them: one per
        worker (here, every worker contributes)."""
        return sizes

    def take_broadcast(self, m: int, aggregator, transform, compressor, shards, bits, decode, what: str,
                       first: bool = True) -> None:
        """Re-encode this worker's shard (``aggregator``'s, after ``transform``), send it to
        every other worker, and ``decode(shard, frame)`` every shard (its own from memory,
        the others' as they arrive)."""
        t_encode = self._exchange_shards(m, aggregator, transform, decode)
        nbytes = aggregator.frame.size + FrameLength.NBYTES
        if first:
            self.t_encode, self.bytes_out = t_encode, nbytes
        else:
            self.t_encode += t_encode
            self.bytes_out += nbytes

    def _exchange_shards(self, m: int, agg, transform, decode) -> float:
        """:meth:`take_broadcast`'s exchange; return the encode's CPU seconds."""
        t_encode = agg.encode(self.control_msg.bits, transform)
        others = self.broadcast_peers
        pending = self.channel.start_send([(agg.frame, rank) for rank in others], TAG_BCAST)
        arrivals = self.channel.frames(others, TAG_BCAST, self.bcast_buffers,
                                       lambda pending: f"worker rank(s) {', '.join(map(str, pending))} "
                                                       f"sent no shard for iteration {m}")
        for rank, frame in itertools.chain([(self.rank, agg.frame)], arrivals):
            start = time.process_time()  # the decode's own time, not the wait for the next shard
            try:
                decode(self.server_ranks.index(rank), frame)
            except (CodecError, FrameError) as exc:
                raise RuntimeError(f"bad shard frame from worker rank {rank} at iteration {m}: {exc}") from None
            self.t_decode += time.process_time() - start
        self.channel.finish_send(pending, lambda pending: f"worker rank(s) {', '.join(map(str, pending))} "
                                                          f"took no shard for iteration {m}")
        return t_encode

    # ---- the reports, the state ----------------------------------------------------------
    def reports(self, m: int, one_round: bool = True) -> None:
        """The served shard's ServerReport, backward report (pipelined) and average to rank 0."""
        agg, layers = self.aggregator, max(self.n_layers, 1)
        if not one_round or not self.config.norm_due(m):  # no ||g|| on a server of factors: norm_ratio NaN
            energies = update_energies = [0.0] * layers
        else:
            energies, update_energies = agg.energy_pair(self.replica.codec_update, layers, self._read_device_status)
        ServerReport(self.bytes_out, self.t_decode, self.t_encode, self.worker_encode,
                     self.sizes, energies, update_energies).pack(self.report)
        self.channel.send([(self.report, 0)], TAG_REPORT, lambda pending: f"rank 0 took no report for iteration {m}")
        self.report_more(m)
        if self.send_average:
            self.channel.send([(agg.pack_average(), 0)], TAG_AVERAGE,
                              lambda pending: f"rank 0 took no average for iteration {m}")

    def report_more(self, m: int) -> None:
        """What goes between the ServerReport and the average (the pipelined's message 10)."""

    def end(self, m: int, sync: bool) -> None:
        if sync:  # message 9 from the first worker, where rank 0 reads the parameters
            self.parameter_sync.run(m)

    def _read_device_status(self) -> None:
        """The iteration's one read of the device status (the decodes' since the last wait),
        with the energies' copy queued before it (``ShardAggregator.energy_pair``)."""
        self.replica.device_status.wait(site="decodes' status and energies")

    def state_dict(self) -> dict:
        return {"server_compressor": self.server_compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.server_compressor.load_state_dict(state["server_compressor"])


class ColocatedRank0(Rank0Side):
    """Rank 0 of colocated servers: it serves no shard and applies no update; it gathers the
    P workers' reports and, where the buffers are due, takes the first worker's parameters."""

    def __init__(self, parts: Rank0Parts):
        super().__init__(parts)
        self.average = np.zeros(parts.replica.layout.total, np.float32)
        self.serve_remote(0)
        self.parameter_sync = ParameterSync(parts.replica, parts.channel)

    def reports(self, m: int, sizes2: list[int] | None = None) -> None:
        reports = self.gather_reports(m, [])
        # rank 0 took part in no broadcast: the frames' sizes come reported
        self.frame_bytes = [int(r.bytes_out) - FrameLength.NBYTES for r in reports]
        self.worker_encode = max(r.worker_encode for r in reports)
        self.server_reports = reports

    def end(self, m: int, lr: float, sync: bool) -> None:
        if sync:  # the parameters, where rank 0 reads them
            self.clock.clocks.pause()
            self.parameter_sync.run(m)
            self.clock.clocks.resume()

    def update_energy(self, layer: int, segment, servers: list[ServerReport]) -> float:
        """||Q(g)||^2 of one layer from each server's report (rank 0 decodes no broadcast)."""
        return sum(report.update_energies[layer] for report in servers)
