"""Workers (ranks S..S+P-1, or 1..P with colocated servers): compute loss and gradient on a
shard of the data, send each server its slice, apply the averaged update (MQGrad Alg. 1,
worker side). With colocated servers a worker also serves one shard (a
:class:`~.server.ShardAggregator` of its own). The phase order is in :mod:`.iteration`."""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from ...codecs import CodecError
from ...config import RunConfig
from ...feedback import MomentumCorrection
from ...policies import policy_class
from ..exchange.broadcast import broadcast_frames, broadcast_widths, frame_sizes
from ..exchange.buffers import BufferSync, ParameterSync, sync_due
from ..exchange.build import (SERVER_STREAM, base_codec, broadcast_codec, build_broadcast_compressor, build_compressor,
                              build_factor_shards, build_shards, script_replica, train_replica)
from ..exchange.device import check_decodes, finite, on_device
from .faults import Fault
from ..measure.phaselog import PhaseLog
from .iteration import FollowerRole
from ..exchange.lowrank import LowRank
from ..exchange.pipeline import PipelinedExchange
from ..wire import (STATUS_NONFINITE_LOSS, STATUS_OK, STOP_AFTER, TAG_AVERAGE, TAG_BACKWARD, TAG_BCAST, TAG_FACTORS, TAG_GRAD, TAG_LOSS,
                    TAG_REPORT, TAG_SETTINGS, WORLD, BackwardReport, Channel, Control, FrameError, FrameHeader, FrameLength, LossReport, ServerReport,
                    ReceiveBuffers, error_frame)


class Worker(FollowerRole):
    """A worker's role around ``model``, whose loss and gradient the loop that drives it
    computes (:class:`~.script.ScriptWorker`; ``begin`` takes the loss from
    :meth:`take_computed`). With a ``recipe`` (``mpigrad train``: the model is the config's,
    the data the recipe's) the replica applies the run's update rule (``end``, or the
    pipeline bucket by bucket) and the checkpoint holds the model and the sampler; without
    one (a script's, :class:`mpigrad.Session`) the script's optimizer applies the update:
    the decoded average is left in the model's ``.grad``."""

    def __init__(self, config: RunConfig, channel: Channel, model: torch.nn.Module, recipe=None):
        self.config, self.channel, self.recipe = config, channel, recipe
        self.rank = channel.rank
        self.servers = channel.servers
        self.server_ranks = channel.server_ranks
        #: 1-based worker number: its data shard and RNG stream, whatever the layout.
        self.number = channel.workers.index(self.rank) + 1
        workers = len(channel.workers)
        self.computed_ahead: tuple[float, float, float] | None = None
        self.replica = (script_replica(config, model) if recipe is None
                        else train_replica(config, model, workers, self.servers))
        #: Whether the replica applies the update (train's rule), not the script's optimizer.
        self.applies_update = recipe is not None
        codec = base_codec(config)
        self.shards = build_shards(config, self.replica.layout, codec, self.servers)
        compressor = build_compressor(config, self.replica.layout, codec, self.number, self.servers)
        # Decodes the servers' broadcast (a worker never encodes with it: no state to keep).
        broadcast_decoder = build_broadcast_compressor(config, codec, compressor)
        # Where the codecs run: on the GPU when the replica is there and they have kernels.
        self.compressor, self.broadcast_decoder = on_device(self.replica, compressor, broadcast_decoder)
        #: The seconds the device warm-up took (None on the host path): every device kernel the
        #: run can use launched once here, so that none compiles inside an iteration.
        self.device_warm_up_s = None
        if self.replica.codecs_on_device:
            from ..exchange.warmup import run_codecs, warm_up_device
            self.device_warm_up_s = warm_up_device(run_codecs(config), self.replica.device)
        #: DGC's momentum correction (--momentum-correction M): the codecs encode the velocity.
        self.momentum = MomentumCorrection(config.momentum_correction) if config.momentum_correction else None
        self.buffer_sync = BufferSync(self.replica.model, channel)
        self.parameter_sync = ParameterSync(self.replica, channel) if channel.colocated else None
        self.loss_buf = LossReport.buffer()
        self.control_msg = Control(len(self.replica.layout.quantized))
        self.lengths = [FrameLength.buffer() for _ in range(self.servers)]
        self.frames = ReceiveBuffers(range(self.servers), self.replica.frame_memory)
        self.broadcast_bits = broadcast_codec(config)[1]
        self.iteration = 0
        self.fault = Fault.from_environment(self.rank)
        self.phase_log = PhaseLog.from_environment(self.rank, self.replica.device)  # MPIGRAD_PHASE_LOG
        #: PowerSGD's factors, error memory and Q (two-round codecs), else None.
        self.lowrank = (LowRank(self.replica.model, self.replica.layout, codec, config.seed, worker=True,
                                shards=build_factor_shards(config, self.replica.layout, codec, self.servers))
                        if codec.two_rounds else None)
        #: The shard this worker serves (colocated servers), else None.
        self.serves = self.server_ranks.index(self.rank) if channel.colocated else None
        if self.serves is not None:
            from .server import ShardAggregator
            layout = self.replica.layout
            decoder = build_compressor(config, layout, codec, SERVER_STREAM, self.servers)
            server_compressor = build_broadcast_compressor(config, codec, decoder)
            if self.replica.codecs_on_device:  # the same codecs as the worker's: the same path
                decoder, server_compressor = on_device(self.replica, decoder, server_compressor)
            self.server_compressor = server_compressor
            self.aggregator = ShardAggregator(config, channel, self.shards[self.serves], decoder,
                                              self.server_compressor, layout.total, broadcast_codec(config)[1],
                                              device=decoder.device)
            self.n_layers = len(layout.quantized)
            self.report = ServerReport.buffer(workers, max(self.n_layers, 1))
            # PowerSGD's policies read the workers' setting errors, not the average (message 11)
            self.send_average = policy_class(config.policy).uses_gradients and not codec.two_rounds
            self.bcast_buffers = ReceiveBuffers(channel.workers, self.replica.frame_memory)
            if self.lowrank is not None:  # this shard's factors, one aggregator per round
                from .server import factor_aggregators
                self.factor_aggregators = factor_aggregators(config, channel, self.lowrank, self.serves)
        #: The pipelined iteration (--pipeline, colocated servers), else None.
        self.pipeline = PipelinedExchange(self) if config.pipeline else None
        if self.pipeline is not None:
            self.pipeline_buffers = ReceiveBuffers(memory=self.replica.frame_memory)
            self.backward_report = BackwardReport.buffer(len(self.pipeline.buckets), self.servers)

    # ---- the phases of one iteration (order: iteration.py) ----------------------------------
    def begin(self, m: int) -> None:
        #: This iteration's learning rate (the pipelined iteration applies buckets at it).
        self.lr = self.replica.lr(m, self.config.lr)
        self.computed, self.computed_ahead = self.computed_ahead, None
        if self.computed is None:
            raise RuntimeError(f"iteration {m} began without the loop's loss (Worker.take_computed)")
        if self.pipeline is not None:  # backward runs in ``gradients``, bucket by bucket
            self.loss_tensor, self.script_loss = self.script_loss, None

    def take_computed(self, loss: float, cpu: float, wall: float, tensor: torch.Tensor | None = None) -> None:
        """The loop's loss of the coming iteration and the CPU and wall seconds its compute
        took (``begin`` reports them); in a pipelined run the loss ``tensor`` too, on which
        ``gradients`` runs backward."""
        self.computed_ahead = (loss, cpu, wall)
        self.script_loss = tensor

    def losses(self, m: int) -> None:
        loss, cpu, wall = self.computed
        if self.fault:
            loss = self.fault.before_send(m, loss, self.replica.flat_grad)  # where the codecs read it, CPU or GPU
        checksum = -1.0
        if self.config.checksum_every and m % self.config.checksum_every == 0:
            checksum = float(self.replica.checksum())
        status = STATUS_OK if np.isfinite(loss) else STATUS_NONFINITE_LOSS
        LossReport(loss, cpu, wall, checksum, status).pack(self.loss_buf)
        self.channel.send([(self.loss_buf, 0)], TAG_LOSS, lambda _: f"rank 0 took no loss for iteration {m}")

    def control(self, m: int) -> None:
        if self.pipeline is None:  # pipelined: taken in backward, when the first bucket is ready
            self.take_control(m)

    def take_control(self, m: int) -> None:
        """Receive iteration m's Control (rank 0's broadcast to the world)."""
        self.channel.broadcast([(self.control_msg.buf, WORLD)], lambda: f"rank 0 sent no bits for iteration {m}")
        if self.control_msg.iteration != m:
            raise RuntimeError(f"protocol out of step: rank 0 is at iteration {self.control_msg.iteration}, "
                               f"rank {self.rank} at {m}")
        if self._two_rounds(m):  # the iteration's factor plan (settings checked against the menu)
            self.lowrank.select(self.control_msg.bits)
            if self.serves is not None:
                from .server import factor_aggregators
                self.factor_aggregators = factor_aggregators(self.config, self.channel, self.lowrank, self.serves)

    def _two_rounds(self, m: int) -> bool:
        return self.lowrank is not None and self.lowrank.active(m)

    def _send_factors(self, m: int, vector: np.ndarray, compressor, shards, tag: int, start: float,
                      round_: int = 0) -> None:
        """Encode a round's factors (two-round codecs) into one frame per server and send them;
        serving a shard (colocated), aggregate its frames meanwhile, as ``gradients`` does."""
        try:
            frames = [compressor.encode(vector, self.control_msg.bits, shard) for shard in shards]
            seconds = time.process_time() - start
            for frame in frames:
                FrameHeader.set_encode_seconds(frame, seconds)
        except CodecError:
            if np.isfinite(vector).all():
                raise
            frames = [error_frame()] * self.servers
        describe = lambda pending: (f"server rank(s) {', '.join(map(str, pending))} took no factors "  # noqa: E731
                                    f"for iteration {m}")
        if self.serves is None:
            self.channel.send(list(zip(frames, self.server_ranks)), tag, describe)
            return
        pending = self.channel.start_send([(frame, rank) for s, (frame, rank) in enumerate(zip(frames, self.server_ranks))
                                           if s != self.serves], tag)
        sizes, encode, decode = self.factor_aggregators[round_].aggregate(m, local=(self.rank, frames[self.serves]),
                                                                          tag=tag)
        self.channel.finish_send(pending, describe)
        if round_ == 0:
            self.sizes, self.worker_encode, self.t_decode = sizes, encode, decode
        else:
            self.sizes = [a + b for a, b in zip(self.sizes, sizes)]
            self.worker_encode += encode
            self.t_decode += decode

    def gradients(self, m: int) -> None:
        if self.pipeline is not None:  # backward, the frames and this shard's averages, bucket by bucket
            pipeline = self.pipeline
            self.backward_times = pipeline.backward(m, self.loss_tensor)
            del self.loss_tensor
            pipeline.exchange()
            self.sizes = [pipeline.sizes[rank] for rank in self.channel.workers]
            self.worker_encode, self.t_decode = pipeline.encode_seconds, pipeline.t_decode
            self.t_encode, self.bytes_out = pipeline.t_encode, pipeline.bytes_out + FrameLength.NBYTES
            return
        bits = self.control_msg.bits
        start = time.process_time()
        grad = self.replica.codec_gradient()
        if self.momentum is not None:
            grad = self.momentum.accumulate(grad)
        if self._two_rounds(m):  # round 1: P_i = M_i Q and the other layers
            lowrank = self.lowrank
            self._send_factors(m, lowrank.first_factors(grad), lowrank.compressor1, lowrank.rounds[0], TAG_GRAD, start)
            return
        try:
            frames = self.compressor.encode_shards(grad, bits, self.shards)
            seconds = time.process_time() - start
            for frame in frames:
                FrameHeader.set_encode_seconds(frame, seconds)
        except CodecError:
            if finite(grad):
                raise
            frames = [error_frame()] * self.servers
        describe = lambda pending: (f"server rank(s) {', '.join(map(str, pending))} took no gradient "  # noqa: E731
                                    f"for iteration {m}")
        if self.serves is None:
            self.channel.send(list(zip(frames, self.server_ranks)), TAG_GRAD, describe)
            return
        # Serving a shard: post the other shards' frames, aggregate this one's meanwhile
        # (every worker sends before it receives: no send waits on a receive not yet posted).
        pending = self.channel.start_send([(frame, rank) for s, (frame, rank) in enumerate(zip(frames, self.server_ranks))
                                           if s != self.serves], TAG_GRAD)
        self.sizes, self.worker_encode, self.t_decode = self.aggregator.aggregate(
            m, local=(self.rank, frames[self.serves]))
        self.channel.finish_send(pending, describe)

    def broadcast(self, m: int) -> None:
        if self.pipeline is not None:
            return  # the averages came bucket by bucket in ``gradients``
        describe = lambda: f"the servers sent no gradient for iteration {m}"  # noqa: E731
        if self.serves is not None and self._two_rounds(m):  # round 1 among the workers: P^ and the rest
            lowrank = self.lowrank
            self.t_encode = self._exchange_shards(
                m, self.factor_aggregators[0], lowrank.orthogonalizer(lowrank.rounds[0][self.serves]),
                lambda s, frame: lowrank.compressor1.decode(frame, lowrank.rounds[0][s], lowrank.p_buf))
            self.bytes_out = self.factor_aggregators[0].frame.size + FrameLength.NBYTES
            return
        if self.serves is not None:
            update = self.replica.codec_update
            self.t_encode = self._exchange_shards(
                m, self.aggregator, None, lambda s, frame: self.broadcast_decoder.decode(frame, self.shards[s], update))
            self.bytes_out = self.aggregator.frame.size + FrameLength.NBYTES
            return
        if self._two_rounds(m):  # round 1: P^ and the other layers' average
            lowrank = self.lowrank
            views = self._receive_broadcast(describe, lowrank.compressor1, lowrank.rounds[0], self.control_msg.bits)
            for shard, view in zip(lowrank.rounds[0], views):
                lowrank.compressor1.decode(view, shard, lowrank.p_buf)
            return
        views = self._receive_broadcast(describe, self.broadcast_decoder, self.shards,
                                        broadcast_widths(self.control_msg.bits, self.broadcast_bits))
        update = self.replica.codec_update
        for shard, view in zip(self.shards, views):
            self.broadcast_decoder.decode(view, shard, update)

    def _receive_broadcast(self, describe, compressor, shards, bits: list[int]) -> list[np.ndarray]:
        """Every server's broadcast frame of ``shards`` (encoded by ``compressor``'s codecs at
        ``bits``), as views of reused buffers (``broadcast.broadcast_frames``)."""
        frames = broadcast_frames(self.channel, list(range(self.servers)), frame_sizes(compressor, shards, bits),
                                  dict(enumerate(self.lengths)), self.frames, None, describe)
        return [frames[s] for s in range(self.servers)]

    def gradients2(self, m: int) -> None:
        if self._two_rounds(m):  # round 2: Q_i = M_i^T P^
            start = time.process_time()
            lowrank = self.lowrank
            self._send_factors(m, lowrank.second_factors(), lowrank.compressor2, lowrank.rounds[1], TAG_FACTORS, start,
                               1)

    def broadcast2(self, m: int) -> None:
        if not self._two_rounds(m):
            return
        lowrank = self.lowrank
        if self.serves is not None:  # round 2 among the workers: the averaged Q
            self.t_encode += self._exchange_shards(
                m, self.factor_aggregators[1], None,
                lambda s, frame: lowrank.compressor2.decode(frame, lowrank.rounds[1][s], lowrank.q_buf))
            self.bytes_out += self.factor_aggregators[1].frame.size + FrameLength.NBYTES
        else:  # the averaged Q from every server
            views = self._receive_broadcast(lambda: f"the servers sent no second-round factors for iteration {m}",
                                            lowrank.compressor2, lowrank.rounds[1], self.control_msg.bits)
            for shard, view in zip(lowrank.rounds[1], views):
                lowrank.compressor2.decode(view, shard, lowrank.q_buf)
        start = time.process_time()
        lowrank.apply(self.replica.update_host)  # the update P^ Q^T, the error memory, the next Q
        if self.serves is not None:
            self.t_decode += time.process_time() - start

    def _exchange_shards(self, m: int, agg, transform, decode) -> float:
        """Colocated: re-encode this worker's shard (``agg``'s, after ``transform``), send it to
        every other worker, and ``decode(shard, frame)`` every shard (its own from memory, the
        others' as they arrive); return the encode's CPU seconds."""
        t_encode = agg.encode(self.control_msg.bits, transform)
        others = [rank for rank in self.channel.workers if rank != self.rank]
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

    def reports(self, m: int) -> None:
        if self.serves is not None:
            self._server_reports(m)
        if self._two_rounds(m) and self.control_msg.measure:  # message 11, after 5 as rank 0 takes them
            self.setting_errors = self.lowrank.setting_errors()
            self.channel.send([(self.setting_errors, 0)], TAG_SETTINGS,
                              lambda pending: f"rank 0 took no setting errors for iteration {m}")

    def _server_reports(self, m: int) -> None:
        """Serving a shard (colocated): its ServerReport, backward report and average to rank 0."""
        agg, layers = self.aggregator, max(self.n_layers, 1)
        if self._two_rounds(m) or not self.config.norm_due(m):  # no ||g|| on a server of factors: norm_ratio NaN
            energies = update_energies = [0.0] * layers
        else:
            energies, update_energies = agg.energy_pair(self.replica.codec_update, layers, self._read_device_status)
        ServerReport(self.bytes_out, self.t_decode, self.t_encode, self.worker_encode,
                     self.sizes, energies, update_energies).pack(self.report)
        self.channel.send([(self.report, 0)], TAG_REPORT, lambda pending: f"rank 0 took no report for iteration {m}")
        if self.pipeline is not None:
            self.pipeline.report(*self.backward_times, self.backward_report)
            self.channel.send([(self.backward_report, 0)], TAG_BACKWARD,
                              lambda pending: f"rank 0 took no backward report for iteration {m}")
        if self.send_average:
            self.channel.send([(agg.pack_average(), 0)], TAG_AVERAGE,
                              lambda pending: f"rank 0 took no average for iteration {m}")

    def _read_device_status(self) -> None:
        """The iteration's one read of the device status (the decodes' since the last wait),
        with the energies' copy queued before it (``ShardAggregator.energy_pair``)."""
        self.replica.device_status.wait(site="decodes' status and energies")

    def end(self, m: int) -> bool:
        check_decodes(self.replica)  # the device path's deferred decodes, read once, before the update
        if not self.applies_update:  # the script's optimizer applies it: the average where .grad is read
            self.replica.update_to_gradient()
        elif self.pipeline is None:  # pipelined: applied bucket by bucket
            self.replica.step(self.lr)
        if self.fault:
            self.fault.after_update(m, self.replica.flat)
        if self.parameter_sync is not None and sync_due(self.config, m, self.control_msg.command):
            self.parameter_sync.run(m)
        self.iteration = m + 1
        return self.control_msg.command == STOP_AFTER

    def state_dict(self) -> dict:
        state = {"compressor": self.compressor.state_dict()}
        if self.recipe is not None:
            state["sampler"] = self.recipe.state_dict()
        if self.serves is not None:
            state["server_compressor"] = self.server_compressor.state_dict()
        if self.lowrank is not None:
            state["lowrank"] = self.lowrank.state_dict()
        update = self.replica.update_state_dict()
        if update is not None:
            state["update"] = update
        if self.momentum is not None:
            state["momentum_correction"] = self.momentum.state_dict()
        return state

    def load_state_dict(self, state: dict, replica_state: dict) -> None:
        if self.recipe is not None:
            self.recipe.load_state_dict(state["sampler"])
        self.compressor.load_state_dict(state["compressor"])
        if self.serves is not None:
            self.server_compressor.load_state_dict(state["server_compressor"])
        if self.lowrank is not None:
            self.lowrank.load_state_dict(state["lowrank"])
        if self.recipe is not None:  # a script's model is the script's to load
            self.replica.load_state_dict(replica_state)
        self.replica.load_update_state_dict(state.get("update"))
        if self.momentum is not None:
            self.momentum.load_state_dict(state["momentum_correction"], like=self.replica.codec_gradient())
