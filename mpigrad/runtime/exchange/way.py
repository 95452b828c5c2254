"""A way of aggregating, behind one interface: the side each role runs.

A *way* (:class:`Way`) is how one iteration's gradients reach the servers and come back
averaged: separate servers (:mod:`.servers`: one server, the paper's star, or S sharded),
colocated servers (:mod:`.colocated`), the hierarchical exchange on nodes
(:mod:`.hierarchical`), the pipelined iteration of the flat or the hierarchical exchange
(:mod:`.pipeline`, :mod:`.hierarchical_pipeline`), and PowerSGD's two low-rank rounds around
one of them (:mod:`.tworounds`). It makes one *side*
for each role: :meth:`Way.worker` (a :class:`WorkerSide`), :meth:`Way.shard_server` (a
:class:`ShardServerSide`, ranks 1..S-1 of separate servers) and :meth:`Way.rank0` (a
:class:`Rank0Side`). The roles (``roles/worker.py``, ``roles/shard.py``,
``roles/server.py``) own what every way shares (the replica, the losses, the Control, the
policy, the buffers, the SGD step, the record) and call their side in each phase of
:mod:`..roles.iteration`'s order; they never ask which way it is.

The sides implement the exchange's part of the phases: ``control`` (the worker's receipt of
the Control, or a plan chosen from it), ``gradients``, ``broadcast``, ``gradients2``,
``broadcast2`` and ``reports``; rank 0's side also charges the clock for the iteration's
communication (``charge_losses``, ``charge_control``, ``charge``) and gives the record its
traffic (``traffic``) and bits (``record_bits``). A side's default for a phase does nothing.

Which way a run takes is chosen at one place, :func:`.ways.choose_exchange`, through the
registry ``EXCHANGES`` (:mod:`.ways`): a new way is one file with its :class:`Way`, one test
and one registry line there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ...codecs import Codec, CodecError
from ...config import RunConfig
from ..measure.clock import IterationClock, IterationTraffic
from ..wire import TAG_AVERAGE, TAG_GRAD, TAG_REPORT, Channel, Control, FrameHeader, FrameLength, LossReport, ServerReport, error_frame
from .aggregator import unpack_average
from .device import finite

__all__ = ["Way", "WorkerParts", "ServerParts", "Rank0Parts", "WorkerSide", "ShardServerSide", "Rank0Side"]


@dataclass
class WorkerParts:
    """What a worker's side works with, built by the worker role: the replica, its layout
    shards (one per server), the workers' compressor and the broadcast's decoder (on the
    device where the replica's codecs are), the Control as received, ``gradient()`` (what the
    codecs encode this iteration: the flat gradient, with DGC's velocity where configured),
    ``take_control(m)`` (receive and check iteration m's Control) and ``applies_update``
    (the replica applies the run's update rule, not a script's optimizer)."""

    config: RunConfig
    channel: Channel
    replica: Any
    codec: Codec
    shards: tuple
    compressor: Any
    broadcast_decoder: Any
    control: Control
    gradient: Callable[[], Any]
    take_control: Callable[[int], None]
    applies_update: bool


@dataclass
class ServerParts:
    """What a shard server's side (rank s in 1..S-1) works with: its replica (for the layout
    and the model's shapes) and the Control as received."""

    config: RunConfig
    channel: Channel
    replica: Any
    codec: Codec
    control: Control


@dataclass
class Rank0Parts:
    """What rank 0's side works with: its replica (its update, for evaluation and
    checkpoints), the layout shards, the policy (a two-round codec's plan is checked against
    it), the clock it charges, the Control it sends, and whether a script trains (rank 0
    then applies no update)."""

    config: RunConfig
    channel: Channel
    replica: Any
    codec: Codec
    shards: tuple
    policy: Any
    clock: IterationClock
    control: Control
    script: bool


class Way:
    """One way of aggregating: the factory of each role's side. ``chosen(config)`` says
    whether a run of ``config`` takes it (exactly one one-round way holds for a checked
    config); a way that ``wraps`` another (the low-rank rounds) is built around the one
    chosen, where its own ``chosen`` holds."""

    #: Whether this way is built around another (``Way(inner)``), not chosen alone.
    wraps = False

    @staticmethod
    def chosen(config: RunConfig) -> bool:
        raise NotImplementedError

    def worker(self, parts: WorkerParts) -> "WorkerSide":
        raise NotImplementedError

    def shard_server(self, parts: ServerParts) -> "ShardServerSide":
        raise NotImplementedError(f"{type(self).__name__} has no shard servers")

    def rank0(self, parts: Rank0Parts) -> "Rank0Side":
        raise NotImplementedError


class WorkerSide:
    """A worker's part of the exchange. State: this iteration's counters of the shard it
    serves, where it serves one (``sizes``, ``worker_encode``, ``t_decode``, ``t_encode``,
    ``bytes_out``: its ServerReport's)."""

    #: The shard this worker aggregates (colocated servers), else None, and its aggregator.
    served: int | None = None
    aggregator = None
    #: Whether the exchange applies the update itself (the pipelined, bucket by bucket):
    #: the worker's ``end`` then takes no SGD step.
    applies_update = False
    #: The pipelined exchange: backward runs inside it (``begin`` gives it the loss).
    pipelined = False
    #: The worker ranks whose frames the served shard's aggregator averages (None: every worker).
    contributors: list[int] | None = None

    def __init__(self, parts: WorkerParts):
        self.parts = parts
        self.config, self.channel, self.replica = parts.config, parts.channel, parts.replica
        self.rank, self.servers, self.server_ranks = parts.channel.rank, parts.channel.servers, parts.channel.server_ranks
        self.shards, self.control_msg = parts.shards, parts.control
        self.t_decode = self.t_encode = self.worker_encode = 0.0
        self.bytes_out = 0
        #: The shards this worker's frames go to, one frame each in this order (``post``).
        self.sent_shards = list(range(self.servers))

    def frame_gradient(self, m: int):
        """The gradient this worker's frames of iteration m carry (flat host values): its own
        here; the hierarchical exchange's, its node's mean over the slice it sends."""
        return self.parts.gradient()

    #: Whether ``frame_gradient`` communicates (the hierarchical reduce-scatter): its time is
    #: then not the encode's.
    frame_gradient_communicates = False

    def refuse_non_finite(self, m: int) -> None:
        """Where this worker's frames of iteration m would be error frames (its gradient not
        finite): nothing here (the servers name this worker); the hierarchical exchange raises
        TrainingError naming the node's worker whose slice was not finite."""

    def gather_update(self, m: int) -> None:
        """After the decoded update of iteration m is written (by a wrapping way, e.g.
        PowerSGD's rounds): nothing here; the hierarchical exchange's all-gather inside the node."""

    def begin(self, m: int, lr: float, loss: torch.Tensor | None) -> None:
        """Iteration m begins at rate ``lr``; ``loss``: the loop's loss tensor (a pipelined
        run's, on which the exchange runs backward), else None."""

    def control(self, m: int) -> None:
        """Receive iteration m's Control (the pipelined exchange takes it in backward)."""
        self.parts.take_control(m)

    def gradients(self, m: int) -> None:
        """Encode this worker's gradient into one frame per shard and send them
        (:meth:`encode_gradient`, :meth:`post`)."""
        self.post(m, self.encode_gradient(), TAG_GRAD, "gradient", self.aggregator)

    def broadcast(self, m: int) -> None:
        raise NotImplementedError

    def gradients2(self, m: int) -> None:
        """The second round's up half (two-round codecs)."""

    def broadcast2(self, m: int) -> None:
        """The second round's down half (two-round codecs)."""

    def reports(self, m: int, one_round: bool = True) -> None:
        """What this worker reports to rank 0 (a served shard's ServerReport); ``one_round``
        False after two rounds (no ||g|| of a shard of factors: norm_ratio NaN)."""

    def end(self, m: int, sync: bool) -> None:
        """After the update of iteration m; ``sync``: the buffers' synchronisation is due."""

    # ---- the transport, which a way around this one reuses -------------------------------
    def encode_gradient(self, gradient: Callable[[], Any] | None = None, shards=None) -> list[np.ndarray]:
        """This iteration's gradient (``gradient()``, by default ``parts.gradient()``) encoded
        at the Control's bits, one frame per shard of ``shards`` (by default every shard),
        each stamped with the encode's CPU seconds (the gradient's making included); error
        frames where the codec refuses a gradient that is not finite."""
        bits = self.control_msg.bits
        shards = self.shards if shards is None else shards
        start = time.process_time()
        grad = (gradient or self.parts.gradient)()
        try:
            frames = self.parts.compressor.encode_shards(grad, bits, shards)
            seconds = time.process_time() - start
            for frame in frames:
                FrameHeader.set_encode_seconds(frame, seconds)
        except CodecError:
            if finite(grad):
                raise
            frames = [error_frame()] * len(shards)
        return frames

    def post(self, m: int, frames: list[np.ndarray], tag: int, what: str, aggregator, first: bool = True) -> None:
        """Send frame s to server s (``what`` names them in a timeout's message);
        ``aggregator``: this worker's, of the shard it serves, where it serves one."""
        raise NotImplementedError

    def take_broadcast(self, m: int, aggregator, transform, compressor, shards, bits: list[int], decode, what: str,
                       first: bool = True) -> None:
        """Every shard's average of this round: ``decode(s, frame)`` each. ``aggregator``
        (after ``transform``), ``compressor``, ``shards`` and ``bits``: the round's; ``first``:
        the iteration's first round (the served shard's counters start again)."""
        raise NotImplementedError

    def add_decode_seconds(self, seconds: float) -> None:
        """Decode work outside the rounds (a two-round codec's update), counted as decode."""
        self.t_decode += seconds

    def state_dict(self) -> dict:
        """The exchange's entries of the worker's checkpoint state."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ShardServerSide:
    """A shard server's part of the exchange (rank s in 1..S-1); ``compressor`` is the
    broadcast's, whose state its checkpoint holds."""

    compressor: Any = None
    served: int | None = None

    def __init__(self, parts: ServerParts):
        self.parts = parts
        self.config, self.channel, self.control_msg = parts.config, parts.channel, parts.control
        self.rank = parts.channel.rank

    def control(self, m: int) -> None:
        """After the Control of iteration m is in."""

    def gradients(self, m: int) -> None:
        raise NotImplementedError

    def broadcast(self, m: int) -> None:
        raise NotImplementedError

    def gradients2(self, m: int) -> None:
        pass

    def broadcast2(self, m: int) -> None:
        pass

    def reports(self, m: int, one_round: bool = True) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state["compressor"])


class Rank0Side:
    """Rank 0's part of the exchange: the shard it serves (if any), the servers' reports,
    the clock's charges of the iteration's communication and the record's traffic.

    Hyperparameters: ``served`` (0 where rank 0 serves shard 0, else None), ``updates_replica``
    (rank 0 decodes the broadcast and applies the update each iteration; else it holds the
    parameters only after a synchronisation), ``compressor`` (its broadcast compressor, or
    None), ``average`` (the whole average the policy observes), ``mixed`` (a codec whose
    per-layer settings the workers measure, message 11). State, per iteration:
    ``server_reports`` (every server's ServerReport, after ``reports``), ``worker_encode`` (the slowest worker's
    encode seconds), ``frame_bytes`` (each server's broadcast frame), ``compute`` (the
    workers' compute where the exchange measured it, else None)."""

    served: int | None = None
    updates_replica = False
    compressor: Any = None
    mixed = False
    #: The pipelined iteration's shard of each bucket (the trace's ``buckets`` table); None
    #: for an iteration of rounds.
    bucket_shard: list[int] | None = None

    def __init__(self, parts: Rank0Parts):
        self.parts = parts
        self.config, self.channel, self.replica, self.clock = parts.config, parts.channel, parts.replica, parts.clock
        self.control_msg, self.shards = parts.control, parts.shards
        self.servers = parts.channel.servers
        self.worker_ranks = parts.channel.workers
        self.workers = len(self.worker_ranks)
        self.n_layers = len(parts.replica.layout.quantized)
        self.update = parts.replica.update_host
        self.setting_errors: np.ndarray | None = None
        self.compute: list[float] | None = None

    # ---- the phases --------------------------------------------------------------------
    def charge_losses(self, reports: list[LossReport], ahead: int | None) -> None:
        """Charge the losses' gather (``ahead``: the bytes of a Control sent ahead of them)."""
        self.clock.losses(LossReport.NBYTES, max(self.clock.compute_seconds(r.compute_cpu, r.compute_wall)
                                                 for r in reports), ahead=ahead)

    def select(self, m: int, bits: list[int]) -> bool:
        """Before the Control of iteration m goes out with ``bits`` (the iteration's, kept as
        ``bits``): whether it asks the workers to measure their settings (message 11)."""
        self.bits = bits
        return False

    def charge_control(self, nbytes: int) -> None:
        self.clock.control(nbytes)

    def gradients(self, m: int) -> None:
        pass

    def broadcast(self, m: int) -> None:
        pass

    def gradients2(self, m: int) -> None:
        pass

    def broadcast2(self, m: int) -> None:
        pass

    def reports(self, m: int, sizes2: list[int] | None = None) -> None:
        """Gather the servers' reports into ``server_reports``; ``sizes2``: rank 0's own second-round
        frame bytes per worker (two rounds: its report counts both, and no ||g||)."""
        raise NotImplementedError

    def serve_remote(self, first: int) -> None:
        """The shards other ranks serve (``first``..S-1) and the rank serving each; their
        reports' rows and, where the policy observes the whole average, their parts of it
        (message 6: ``average`` is then the whole average, as with S = 1)."""
        codec, policy = self.parts.codec, self.parts.policy
        self.remote_shards = list(range(first, self.servers))
        self.server_of = self.channel.server_ranks
        self.receive_averages = bool(self.remote_shards) and policy.uses_gradients and not codec.two_rounds
        self.averages = {s: np.empty(sum(p.size for p in self.shards[s].pieces if p.quantized), np.float32)
                         for s in self.remote_shards} if self.receive_averages else {}
        self.report_rows = (ServerReport.buffer(self.workers, max(self.n_layers, 1), len(self.remote_shards))
                            if self.remote_shards else None)

    def gather_reports(self, m: int, reports: list[ServerReport]) -> list[ServerReport]:
        """``reports`` (rank 0's own), then the other servers' (message 5), and their parts of
        the average where the policy observes it (message 6)."""
        if self.remote_shards:
            ranks = [self.server_of[s] for s in self.remote_shards]
            self.channel.recv(list(zip(self.report_rows, ranks)), TAG_REPORT,
                              lambda pending: f"server rank(s) {', '.join(map(str, pending))} sent no "
                                              f"report for iteration {m}")
            reports += [ServerReport.unpack(row, self.workers) for row in self.report_rows]
        if self.receive_averages:
            self.channel.recv([(self.averages[s], self.server_of[s]) for s in self.averages], TAG_AVERAGE,
                              lambda pending: f"server rank(s) {', '.join(map(str, pending))} sent no "
                                              f"average for iteration {m}")
            for s, average in self.averages.items():
                unpack_average(self.shards[s], average, self.average)
        return reports

    def charge(self, m: int) -> None:
        """Charge the iteration's gradient rounds (after ``reports``)."""
        self.clock.gradients([r.sizes for r in self.server_reports])
        self.clock.broadcasts([FrameLength.NBYTES + n for n in self.frame_bytes])

    def end(self, m: int, lr: float, sync: bool) -> None:
        """The update on rank 0's replica; ``sync``: the buffers' synchronisation is due."""

    # ---- the record --------------------------------------------------------------------
    def traffic(self, m: int, ahead: bool) -> tuple[IterationTraffic, list[int]]:
        """The iteration's traffic and each server's broadcast bytes (its frames with their
        lengths), for the record."""
        frames_down = [FrameLength.NBYTES + n for n in self.frame_bytes]
        return (IterationTraffic(LossReport.NBYTES, self.control_msg.buf.nbytes,
                                 tuple(tuple(s.sizes) for s in self.server_reports), tuple(frames_down),
                                 self.channel.colocated, ahead=ahead), frames_down)

    def bucket_row(self) -> dict | None:
        """The iteration's ``buckets`` row (``PipelinedTraffic.bucket_columns``, with
        ``t_forward`` and ``t_backward``) as the clock charged it; None for rounds."""
        if self.bucket_shard is None:
            return None
        traffic, t_forward, t_backward = self.clock.pipelined_charged
        return {**traffic.bucket_columns(self.bucket_shard), "t_forward": t_forward, "t_backward": t_backward}

    def record_bits(self, m: int, bits: list[int]) -> tuple[list[int], list[int] | None]:
        """The record's bits per layer (the codec's own where it takes none from the policy)
        and settings (None: a codec without per-layer settings)."""
        codec = self.parts.codec
        return (bits if codec.takes_policy_bits else [codec.fixed_bits] * len(bits)), None

    def norm_ratio(self, servers: list[ServerReport]) -> list[float]:
        """||Q(g)|| / ||g|| per quantized layer: g the average of the workers' decoded
        gradients (||g||^2 from each server's report), Q(g) the decoded broadcast every rank
        applies (``update_energy``) (NaN where g = 0)."""
        ratios = []
        for layer, s in enumerate(self.replica.layout.quantized):
            update_energy = self.update_energy(layer, s, servers)
            energy = sum(report.energies[layer] for report in servers)
            ratios.append(math.sqrt(update_energy / energy) if energy > 0 else math.nan)
        return ratios or [math.nan]

    def update_energy(self, layer: int, segment, servers: list[ServerReport]) -> float:
        """||Q(g)||^2 of one quantized layer: rank 0's own update's."""
        u = self.update[segment.offset:segment.offset + segment.size]
        return float(np.dot(u, u))
