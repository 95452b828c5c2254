"""PowerSGD's two low-rank rounds (``--codec powersgd``, :mod:`.lowrank`) around a one-round
way (separate or colocated servers), as error feedback wraps a compressor.

Before the codec's ``start`` iteration each side is the inner way's. From ``start`` on,
``gradients``/``broadcast`` carry round 1 (worker: P_i = M_i Q for each low-rank layer and
the other layers as float32; each server, for the layers of its shard: sum in rank order,
average, orthogonalise each P, broadcast P^ and the other layers' average), then
``gradients2``/``broadcast2`` round 2 (each server: the Q_i of its layers, summed,
averaged, broadcast; rank 0 decodes every shard's, as in round 1); the update is written in
``broadcast2``, on the workers and, where it serves shard 0, on rank 0. Each round goes
through the inner way's transport (a worker's ``post`` and ``take_broadcast``, a server's
``receive`` and ``send_shard``, rank 0's ``receive``, ``send_round``, ``broadcast_round``),
with the shard's factor aggregators of the iteration's plan (``aggregator.factor_aggregators``).

With the codec's menus (``ranks``/``widths``) every rank selects the iteration's factor
plan from the Control's setting codes in ``control`` (rank 0 before it sends it); after an
iteration whose Control says ``measure`` the workers send rank 0 their setting errors in
``reports`` (message 11), which rank 0 receives there for the policy's next decision.

A side here defines what it changes; anything else is the inner side's (``Around``).
"""

from __future__ import annotations

import time

import numpy as np

from ...codecs import CodecError
from ...config import RunConfig
from ...errors import TrainingError
from ...policies import PolicyError
from .aggregator import factor_aggregators
from .broadcast import frame_sizes
from .build import base_codec, build_factor_shards
from .lowrank import LowRank
from .way import Rank0Parts, ServerParts, Way, WorkerParts
from ..measure.clock import IterationTraffic
from ..wire import TAG_FACTORS, TAG_GRAD, TAG_SETTINGS, FrameHeader, FrameLength, LossReport, error_frame

__all__ = ["LowRankRounds", "LowRankWorker", "LowRankShardServer", "LowRankRank0"]


class LowRankRounds(Way):
    """The two rounds of a two-round codec around ``inner``, the one-round way of the run."""

    wraps = True

    def __init__(self, inner: Way):
        self.inner = inner

    @staticmethod
    def chosen(config: RunConfig) -> bool:
        return base_codec(config).two_rounds

    def worker(self, parts: WorkerParts) -> "LowRankWorker":
        return LowRankWorker(self.inner, parts)

    def shard_server(self, parts: ServerParts) -> "LowRankShardServer":
        return LowRankShardServer(self.inner, parts)

    def rank0(self, parts: Rank0Parts) -> "LowRankRank0":
        return LowRankRank0(self.inner, parts)


class Around:
    """A side around another way's side (``inner``): what it does not define is the inner's."""

    def __getattr__(self, name: str):
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def _low_rank(parts, worker: bool) -> LowRank:
    """The rank's PowerSGD: factor layouts over the run's layout shards (and, on a worker,
    the error memory and Q)."""
    replica, config = parts.replica, parts.config
    return LowRank(replica.model, replica.layout, parts.codec, config.seed, worker=worker,
                   shards=build_factor_shards(config, replica.layout, parts.codec, parts.channel.servers))


class LowRankWorker(Around):
    """A worker's two rounds (its error memory and Q in ``lowrank``)."""

    def __init__(self, inner: Way, parts: WorkerParts):
        self.parts, self.control_msg = parts, parts.control
        self.lowrank = _low_rank(parts, worker=True)
        self.inner = inner.worker(parts)
        #: The factor shards this worker's frames go to (``inner.sent_shards``; a hierarchical
        #: exchange's slice, whose layers alone this worker computes).
        self.sent_shards = self.inner.sent_shards
        if len(self.sent_shards) < self.inner.servers:
            self.lowrank.own([self.lowrank.shards[s] for s in self.sent_shards])
        self.factor_aggregators = self._aggregators()

    def _aggregators(self) -> tuple:
        """The served shard's factor aggregators under the running plan ((None, None) where
        this worker serves no shard)."""
        served = self.inner.served
        if served is None:
            return None, None
        return factor_aggregators(self.parts.config, self.parts.channel, self.lowrank, served, self.inner.contributors)

    def control(self, m: int) -> None:
        self.inner.control(m)
        if self.lowrank.active(m):  # the iteration's factor plan (settings checked against the menu)
            self.lowrank.select(self.control_msg.bits)
            self.factor_aggregators = self._aggregators()

    def gradients(self, m: int) -> None:
        if not self.lowrank.active(m):
            return self.inner.gradients(m)
        start = time.process_time()  # the gradient's making is the encode's, as encode_gradient counts it
        grad = self.inner.frame_gradient(m)
        if self.inner.frame_gradient_communicates:  # the reduce-scatter's wait is communication
            start = time.process_time()
        lowrank = self.lowrank  # round 1: P_i = M_i Q and the other layers
        self._send_factors(m, lowrank.first_factors(grad), lowrank.compressor1, lowrank.rounds[0], TAG_GRAD, start, 0)

    def broadcast(self, m: int) -> None:
        if not self.lowrank.active(m):
            return self.inner.broadcast(m)
        lowrank, served = self.lowrank, self.inner.served  # round 1: P^ and the rest
        transform = lowrank.orthogonalizer(lowrank.rounds[0][served]) if served is not None else None
        self.inner.take_broadcast(m, self.factor_aggregators[0], transform, lowrank.compressor1, lowrank.rounds[0],
                                  self.control_msg.bits,
                                  lambda s, frame: lowrank.compressor1.decode(frame, lowrank.rounds[0][s], lowrank.p_buf),
                                  "gradient")

    def gradients2(self, m: int) -> None:
        if self.lowrank.active(m):  # round 2: Q_i = M_i^T P^
            start = time.process_time()
            lowrank = self.lowrank
            self._send_factors(m, lowrank.second_factors(), lowrank.compressor2, lowrank.rounds[1], TAG_FACTORS,
                               start, 1)

    def broadcast2(self, m: int) -> None:
        if not self.lowrank.active(m):
            return
        lowrank = self.lowrank  # the averaged Q of every shard
        self.inner.take_broadcast(m, self.factor_aggregators[1], None, lowrank.compressor2, lowrank.rounds[1],
                                  self.control_msg.bits,
                                  lambda s, frame: lowrank.compressor2.decode(frame, lowrank.rounds[1][s], lowrank.q_buf),
                                  "second-round factors", first=False)
        start = time.process_time()
        lowrank.apply(self.parts.replica.update_host)  # the update P^ Q^T, the error memory, the next Q
        self.inner.add_decode_seconds(time.process_time() - start)
        self.inner.gather_update(m)

    def _send_factors(self, m: int, vector: np.ndarray, compressor, shards, tag: int, start: float,
                      round_: int) -> None:
        """Encode a round's factors into one frame per server and send them (the inner's ``post``)."""
        try:
            frames = [compressor.encode(vector, self.control_msg.bits, shards[s]) for s in self.sent_shards]
            seconds = time.process_time() - start
            for frame in frames:
                FrameHeader.set_encode_seconds(frame, seconds)
        except CodecError:
            if np.isfinite(vector).all():
                raise
            self.inner.refuse_non_finite(m)
            frames = [error_frame()] * len(self.sent_shards)
        self.inner.post(m, frames, tag, "factors", self.factor_aggregators[round_], first=round_ == 0)

    def reports(self, m: int, one_round: bool = True) -> None:
        active = self.lowrank.active(m)
        self.inner.reports(m, one_round=one_round and not active)
        if active and self.control_msg.measure:  # message 11, after 5 as rank 0 takes them
            self.setting_errors = self.lowrank.setting_errors()
            self.parts.channel.send([(self.setting_errors, 0)], TAG_SETTINGS,
                                    lambda pending: f"rank 0 took no setting errors for iteration {m}")

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "lowrank": self.lowrank.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.lowrank.load_state_dict(state["lowrank"])


class LowRankShardServer(Around):
    """A shard server's two rounds: its shard's factors, one aggregator per round."""

    def __init__(self, inner: Way, parts: ServerParts):
        self.parts = parts
        self.inner = inner.shard_server(parts)
        self.lowrank = _low_rank(parts, worker=False)
        self.factor_aggregators = factor_aggregators(parts.config, parts.channel, self.lowrank, self.inner.served)

    def control(self, m: int) -> None:
        self.inner.control(m)
        if self.lowrank.active(m):  # the iteration's factor plan (settings checked against the menu)
            self.lowrank.select(self.parts.control.bits)
            self.factor_aggregators = factor_aggregators(self.parts.config, self.parts.channel, self.lowrank,
                                                         self.inner.served)

    def gradients(self, m: int) -> None:
        if not self.lowrank.active(m):
            return self.inner.gradients(m)
        self.inner.receive(m, self.factor_aggregators[0])

    def broadcast(self, m: int) -> None:
        if not self.lowrank.active(m):
            return self.inner.broadcast(m)
        lowrank = self.lowrank  # round 1: this shard's P^ (orthogonalised), and the other layers if it holds them
        self.inner.send_shard(m, self.factor_aggregators[0], lowrank.orthogonalizer(lowrank.rounds[0][self.inner.served]))

    def gradients2(self, m: int) -> None:
        if self.lowrank.active(m):  # round 2: this shard's Q_i
            self.inner.receive(m, self.factor_aggregators[1], TAG_FACTORS, first=False)

    def broadcast2(self, m: int) -> None:
        if self.lowrank.active(m):
            self.inner.send_shard(m, self.factor_aggregators[1], first=False)

    def reports(self, m: int, one_round: bool = True) -> None:
        self.inner.reports(m, one_round=one_round and not self.lowrank.active(m))


class LowRankRank0(Around):
    """Rank 0's two rounds: its factor layouts (for the frames' sizes) and, where it serves
    shard 0, that shard's aggregators; the plan it checks the policy's settings against;
    the workers' setting errors (``setting_errors``, for the policy's next decision: each
    layer's mean over the workers that measured it)."""

    def __init__(self, inner: Way, parts: Rank0Parts):
        self.parts, self.control_msg = parts, parts.control
        self.inner = inner.rank0(parts)
        self.lowrank = lowrank = _low_rank(parts, worker=False)  # colocated: for the frames' sizes only
        if self.inner.served is not None:
            self.factor_aggregators = factor_aggregators(parts.config, parts.channel, lowrank, self.inner.served)
        codec = parts.codec
        #: PowerSGD with menus: the workers' mean errors at each setting (message 11), the
        #: settings' bytes, for the policy's next decision (None until measured).
        self.mixed = codec.mixed
        self.setting_errors: np.ndarray | None = None
        self.setting_sizes = lowrank.setting_sizes() if self.mixed else None
        n_layers = len(parts.replica.layout.quantized)
        self.setting_rows = [np.zeros((n_layers, len(codec.menu))) for _ in parts.channel.workers] if self.mixed else []
        #: The hierarchical exchange's slices inside the nodes (``inner.slice_bytes``), else ().
        self.slice_bytes = tuple(getattr(self.inner, "slice_bytes", ()))
        workers = len(parts.channel.workers)
        #: Whether worker w sends shard s factor frames: every worker, or (hierarchical) the workers of s's local rank.
        L = len(self.slice_bytes) or 1
        self.sends = [[L == 1 or w % L == s % L for w in range(workers)] for s in range(parts.channel.servers)]
        #: How many workers measure each layer's setting errors: every worker, or (hierarchical)
        #: one per node, of the local rank whose slice holds the layer.
        self.measured_by = workers // L

    def _serves(self, m: int) -> bool:
        """True when iteration m is two rounds' and rank 0 serves shard 0 in it."""
        return self.inner.served is not None and self.lowrank.active(m)

    def select(self, m: int, bits: list[int]) -> bool:
        self.inner.select(m, bits)
        if not self.lowrank.active(m):
            return False
        policy = self.parts.policy
        try:  # the iteration's factor plan
            self.lowrank.select(bits)
        except CodecError as exc:
            raise PolicyError(f"policy {policy.policy_id!r} decided {bits} for iteration {m}: {exc}") from None
        if self.inner.served is not None:
            self.factor_aggregators = factor_aggregators(self.parts.config, self.parts.channel, self.lowrank,
                                                         self.inner.served)
        return self.mixed and policy.observes(m + 1)

    def gradients(self, m: int) -> None:
        if not self.lowrank.active(m):
            return self.inner.gradients(m)
        if self._serves(m):
            self.inner.receive(m, self.factor_aggregators[0])

    def broadcast(self, m: int) -> None:
        if not self.lowrank.active(m):
            return self.inner.broadcast(m)
        if self._serves(m):  # round 1: P^ (orthogonalised) and the other layers' average
            lowrank = self.lowrank
            self.inner.send_round(m, self.factor_aggregators[0], lowrank.orthogonalizer(lowrank.rounds[0][0]),
                                  frame_sizes(lowrank.compressor1, lowrank.rounds[0], self.inner.bits),
                                  lambda s, frame: lowrank.compressor1.decode(frame, lowrank.rounds[0][s], lowrank.p_buf))

    def gradients2(self, m: int) -> None:
        if self._serves(m):  # round 2: the workers' Q_i, summed in rank order
            self.sizes2, self.worker_encode2, self.t_decode2 = self.factor_aggregators[1].aggregate(m, tag=TAG_FACTORS)

    def broadcast2(self, m: int) -> None:
        if not self._serves(m):
            return
        lowrank, inner = self.lowrank, self.inner
        t_encode, t_decode, frame_bytes = inner.broadcast_round(
            m, self.factor_aggregators[1], None, frame_sizes(lowrank.compressor2, lowrank.rounds[1], inner.bits),
            lambda s, frame: lowrank.compressor2.decode(frame, lowrank.rounds[1][s], lowrank.q_buf))
        start = time.process_time()
        lowrank.apply(inner.update)  # P^ Q^T into rank 0's update, as every worker does
        inner.add_round(t_encode, t_decode + self.t_decode2 + time.process_time() - start, self.worker_encode2)
        self.frame_bytes2 = frame_bytes

    def reports(self, m: int, sizes2: list[int] | None = None) -> None:
        if not self.lowrank.active(m):
            return self.inner.reports(m)
        self.inner.reports(m, self.sizes2 if self._serves(m) else None)
        if self.control_msg.measure:  # message 11: the workers' errors at each setting, averaged in rank order
            self.parts.channel.recv(list(zip(self.setting_rows, self.parts.channel.workers)), TAG_SETTINGS,
                                    lambda pending: f"worker rank(s) {', '.join(map(str, pending))} sent no "
                                                    f"setting errors for iteration {m}")
            total = self.setting_rows[0].copy()
            for row in self.setting_rows[1:]:
                total += row
            self.setting_errors = total / self.measured_by
        if self._serves(m):
            self.factor_bytes = (self.inner.frame_bytes, self.frame_bytes2)
        else:  # the factor frames' sizes are the layout's
            self.factor_bytes = self.lowrank.frame_sizes(self.inner.bits)

    # ---- the charges and the record ------------------------------------------------------
    def charge(self, m: int) -> None:
        if not self.lowrank.active(m):
            return self.inner.charge(m)
        clock = self.parts.clock  # each round charged as it went: P up, P^ down, Q up, Q down
        rounds = self._factor_frames_in(self.inner.server_reports)
        hierarchical = bool(self.slice_bytes)  # and around them the slices inside the nodes
        if hierarchical:
            clock.intra("intra_reduce", self.slice_bytes)
        clock.gradients(rounds[0])
        clock.broadcasts([FrameLength.NBYTES + n for n in self.factor_bytes[0]], hierarchical=hierarchical)
        clock.gradients(rounds[1])
        clock.broadcasts([FrameLength.NBYTES + n for n in self.factor_bytes[1]], hierarchical=hierarchical)
        if hierarchical:
            clock.intra("intra_gather", self.slice_bytes)

    def traffic(self, m: int, ahead: bool) -> tuple[IterationTraffic, list[int]]:
        if not self.lowrank.active(m):
            return self.inner.traffic(m, ahead)
        # two rounds: the trace's frame and bytes columns count both
        frames_down = [FrameLength.NBYTES + n for n in self.factor_bytes[0]]
        second_down = tuple(FrameLength.NBYTES + n for n in self.factor_bytes[1])
        first_in, second_in = (tuple(tuple(sizes) for sizes in frames)
                               for frames in self._factor_frames_in(self.inner.server_reports))
        traffic = IterationTraffic(LossReport.NBYTES, self.control_msg.buf.nbytes, first_in, tuple(frames_down),
                                   self.parts.channel.colocated, second_in, second_down, ahead,
                                   hierarchical=bool(self.slice_bytes), slice_bytes=self.slice_bytes)
        return traffic, [a + b for a, b in zip(frames_down, second_down)]

    def record_bits(self, m: int, bits: list[int]) -> tuple[list[int], list[int] | None]:
        codec = self.parts.codec
        recorded, settings = self.inner.record_bits(m, bits)
        if not self.lowrank.active(m):  # before ``start``: the codec's own float32
            recorded = [codec.nominal_bits] * len(bits)
        if self.mixed:  # each layer's setting, and the width its numbers travelled at
            settings = list(bits)  # the Control's codes (before ``start``: float32 whatever they say)
            if self.lowrank.active(m):
                recorded = [lay.width or codec.factor_bits for lay in self.lowrank.layers]
        return recorded, settings

    def _factor_frames_in(self, reports) -> tuple[list[list[int]], list[list[int]]]:
        """Two rounds: the frames into each server per round and worker. Shard 0's come
        measured; another server reports the rounds' sum per worker, which its fixed factor
        frame sizes (float32, set by the layout) split; TrainingError when they do not add up.
        Colocated, every shard is a worker's (its own frame counted, not charged); in a
        hierarchical exchange only the workers of its local rank send it frames (0 for the rest)."""
        inner = self.inner
        own = inner.served is not None
        workers = len(self.parts.channel.workers)
        first, second = ([list(inner.sizes)], [list(self.sizes2)]) if own else ([], [])
        sizes1, sizes2 = self.lowrank.frame_sizes(inner.bits)
        for s, report in zip(inner.remote_shards, reports[1:] if own else reports):
            sends = self.sends[s]
            if any(n != (sizes1[s] + sizes2[s] if sends[w] else 0) for w, n in enumerate(report.sizes)):
                raise TrainingError(f"server rank {inner.server_of[s]} received factor frames of {report.sizes} "
                                    f"bytes, not {sizes1[s]} + {sizes2[s]}")
            first.append([sizes1[s] if sends[w] else 0 for w in range(workers)])
            second.append([sizes2[s] if sends[w] else 0 for w in range(workers)])
        return first, second
