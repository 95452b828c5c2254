"""Workers (ranks S..S+P-1, or 1..P with colocated servers): compute loss and gradient on a
shard of the data, send each server its slice, apply the averaged update (MQGrad Alg. 1,
worker side). How the gradient travels is the run's way of aggregating, whose worker side
(``exchange``, :mod:`..exchange.way`) this role drives; the phase order is in :mod:`.iteration`."""

from __future__ import annotations

import numpy as np
import torch

from ...config import RunConfig
from ...feedback import MomentumCorrection
from ..exchange.buffers import BufferSync, sync_due
from ..exchange.build import base_codec, build_broadcast_compressor, build_compressor, build_shards, script_replica, train_replica
from ..exchange.device import check_decodes, exchange_host_reason, on_device
from ..exchange.way import WorkerParts
from ..exchange.ways import choose_exchange
from .faults import Fault
from ..measure.phaselog import PhaseLog
from .iteration import FollowerRole
from ..wire import STATUS_NONFINITE_LOSS, STATUS_OK, STOP_AFTER, TAG_LOSS, WORLD, Channel, Control, LossReport


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
        # Where the codecs run: on the GPU when the replica is there, they have kernels and the
        # way of aggregating works in device memory.
        self.compressor, self.broadcast_decoder = on_device(self.replica, compressor, broadcast_decoder,
                                                            host_reason=exchange_host_reason(config))
        #: The seconds the device warm-up took (None on the host path): every device kernel the
        #: run can use launched once here, so that none compiles inside an iteration.
        self.device_warm_up_s = None
        if self.replica.codecs_on_device:
            from ..exchange.warmup import run_codecs, warm_up_device
            self.device_warm_up_s = warm_up_device(run_codecs(config), self.replica.device)
        #: DGC's momentum correction (--momentum-correction M): the codecs encode the velocity.
        self.momentum = MomentumCorrection(config.momentum_correction) if config.momentum_correction else None
        self.buffer_sync = BufferSync(self.replica.model, channel)
        self.loss_buf = LossReport.buffer()
        self.control_msg = Control(len(self.replica.layout.quantized))
        self.iteration = 0
        self.fault = Fault.from_environment(self.rank)
        self.phase_log = PhaseLog.from_environment(self.rank, self.replica.device)  # MPIGRAD_PHASE_LOG
        #: This worker's side of the run's way of aggregating (:mod:`..exchange.ways`).
        self.exchange = choose_exchange(config).worker(WorkerParts(
            config, channel, self.replica, codec, self.shards, self.compressor, self.broadcast_decoder,
            self.control_msg, self._gradient, self.take_control, self.applies_update))
        #: The pipelined exchange (--pipeline: backward runs in it), else None.
        self.pipeline = self.exchange if self.exchange.pipelined else None

    # ---- the phases of one iteration (order: iteration.py) ----------------------------------
    def begin(self, m: int) -> None:
        #: This iteration's learning rate (the pipelined iteration applies buckets at it).
        self.lr = self.replica.lr(m, self.config.lr)
        self.computed, self.computed_ahead = self.computed_ahead, None
        if self.computed is None:
            raise RuntimeError(f"iteration {m} began without the loop's loss (Worker.take_computed)")
        loss, self.script_loss = self.script_loss, None  # a pipelined run's: backward runs in ``gradients``
        self.exchange.begin(m, self.lr, loss)

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
        self.exchange.control(m)

    def take_control(self, m: int) -> None:
        """Receive iteration m's Control (rank 0's broadcast to the world)."""
        self.channel.broadcast([(self.control_msg.buf, WORLD)], lambda: f"rank 0 sent no bits for iteration {m}")
        if self.control_msg.iteration != m:
            raise RuntimeError(f"protocol out of step: rank 0 is at iteration {self.control_msg.iteration}, "
                               f"rank {self.rank} at {m}")

    def _gradient(self):
        """What the codecs encode this iteration: the flat gradient (DGC's velocity with
        momentum correction)."""
        grad = self.replica.codec_gradient()
        if self.momentum is not None:
            grad = self.momentum.accumulate(grad)
        return grad

    def gradients(self, m: int) -> None:
        self.exchange.gradients(m)

    def broadcast(self, m: int) -> None:
        self.exchange.broadcast(m)

    def gradients2(self, m: int) -> None:
        self.exchange.gradients2(m)

    def broadcast2(self, m: int) -> None:
        self.exchange.broadcast2(m)

    def reports(self, m: int) -> None:
        self.exchange.reports(m)

    def end(self, m: int) -> bool:
        check_decodes(self.replica)  # the device path's deferred decodes, read once, before the update
        if not self.applies_update:  # the script's optimizer applies it: the average where .grad is read
            self.replica.update_to_gradient()
        elif not self.exchange.applies_update:  # pipelined: applied bucket by bucket
            self.replica.step(self.lr)
        if self.fault:
            self.fault.after_update(m, self.replica.flat)
        self.exchange.end(m, sync_due(self.config, m, self.control_msg.command))
        self.iteration = m + 1
        return self.control_msg.command == STOP_AFTER

    def state_dict(self) -> dict:
        state = {"compressor": self.compressor.state_dict()}
        if self.recipe is not None:
            state["sampler"] = self.recipe.state_dict()
        state.update(self.exchange.state_dict())  # a served shard's compressor, PowerSGD's memory
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
        self.exchange.load_state_dict(state)
        if self.recipe is not None:  # a script's model is the script's to load
            self.replica.load_state_dict(replica_state)
        self.replica.load_update_state_dict(state.get("update"))
        if self.momentum is not None:
            self.momentum.load_state_dict(state["momentum_correction"], like=self.replica.codec_gradient())
