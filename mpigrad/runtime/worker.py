"""Workers (ranks S..S+P-1): compute loss and gradient on a shard of the data, send each
server its slice, apply the averaged update (MQGrad Alg. 1, worker side). The phase order
is in :mod:`.iteration`."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..codecs import CodecError
from ..config import RunConfig
from ..data import ShardSampler
from .buffers import BufferSync
from .build import (base_codec, build_broadcast_compressor, build_compressor, build_replica, build_shards,
                    load_data, release_data)
from .faults import Fault
from .iteration import FollowerRole
from .wire import (STATUS_NONFINITE_LOSS, STATUS_OK, STOP_AFTER, TAG_GRAD, TAG_LOSS, WORLD, Channel,
                   Control, FrameHeader, FrameLength, LossReport, error_frame)


class Worker(FollowerRole):
    def __init__(self, config: RunConfig, channel: Channel):
        self.config, self.channel = config, channel
        self.rank = channel.rank
        self.servers = channel.servers
        #: 1-based worker number: its data shard and RNG stream, whatever S is.
        self.number = self.rank - self.servers + 1
        workers = len(channel.workers)
        dataset = load_data(config)
        self.sampler = ShardSampler(len(dataset.train_y), self.number - 1, workers, config.batch_size,
                                    config.seed)
        # Keep only this worker's shard (sorted global indices -> rows of the copy).
        self.shard = self.sampler.shard
        self.train_x = np.ascontiguousarray(dataset.train_x[self.shard])
        self.train_y = np.ascontiguousarray(dataset.train_y[self.shard])
        self.replica = build_replica(config, dataset)
        release_data()  # the shard is a copy: let the full dataset go
        codec = base_codec(config)
        self.shards = build_shards(config, self.replica.layout, codec)
        self.compressor = build_compressor(config, self.replica.layout, codec, self.number)
        # Decodes the servers' broadcast (a worker never encodes with it: no state to keep).
        self.broadcast_decoder = build_broadcast_compressor(config, self.replica.layout, codec, self.compressor)
        self.buffer_sync = BufferSync(self.replica.model, channel)
        self.loss_buf = LossReport.buffer()
        self.control_msg = Control(len(self.replica.layout.quantized))
        self.lengths = [FrameLength.buffer() for _ in range(self.servers)]
        self.frames = [np.empty(0, np.uint8) for _ in range(self.servers)]
        self.iteration = 0
        self.fault = Fault.from_environment(self.rank)

    def _compute(self) -> tuple[float, float, float]:
        """Forward and backward on the next batch; return (loss, CPU s, wall s)."""
        cpu, wall = time.process_time(), time.perf_counter()
        idx = np.searchsorted(self.shard, self.sampler.next_batch())
        device = self.replica.device
        x = torch.from_numpy(self.train_x[idx]).to(device)
        y = torch.from_numpy(self.train_y[idx]).to(device)
        model = self.replica.model
        self.replica.flat_grad.zero_()
        loss = model.loss(model(x), y, self.config.weight_decay)
        loss.backward()
        return loss.item(), time.process_time() - cpu, time.perf_counter() - wall

    # ---- the phases of one iteration (order: iteration.py) ----------------------------------
    def begin(self, m: int) -> None:
        self.computed = self._compute()

    def losses(self, m: int) -> None:
        loss, cpu, wall = self.computed
        if self.fault:
            loss = self.fault.before_send(m, loss, self.replica.gradient_to_host())
        checksum = -1.0
        if self.config.checksum_every and m % self.config.checksum_every == 0:
            checksum = float(self.replica.checksum())
        status = STATUS_OK if np.isfinite(loss) else STATUS_NONFINITE_LOSS
        LossReport(loss, cpu, wall, checksum, status).pack(self.loss_buf)
        self.channel.send([(self.loss_buf, 0)], TAG_LOSS, lambda _: f"rank 0 took no loss for iteration {m}")

    def control(self, m: int) -> None:
        self.channel.broadcast([(self.control_msg.buf, WORLD)], lambda: f"rank 0 sent no bits for iteration {m}")
        if self.control_msg.iteration != m:
            raise RuntimeError(f"protocol out of step: rank 0 is at iteration {self.control_msg.iteration}, "
                               f"rank {self.rank} at {m}")

    def gradients(self, m: int) -> None:
        bits = self.control_msg.bits
        start = time.process_time()
        grad = self.replica.gradient_to_host()
        try:
            frames = [self.compressor.encode(grad, bits, shard) for shard in self.shards]
            seconds = time.process_time() - start
            for frame in frames:
                FrameHeader.set_encode_seconds(frame, seconds)
        except CodecError:
            if np.isfinite(grad).all():
                raise
            frames = [error_frame()] * self.servers
        self.channel.send(list(zip(frames, range(self.servers))), TAG_GRAD,
                          lambda pending: f"server rank(s) {', '.join(map(str, pending))} took no gradient "
                                          f"for iteration {m}")

    def broadcast(self, m: int) -> None:
        describe = lambda: f"the servers sent no gradient for iteration {m}"  # noqa: E731
        self.channel.broadcast([(self.lengths[s], s) for s in range(self.servers)], describe)
        views = []
        for s in range(self.servers):
            size = int(self.lengths[s][0])
            if self.frames[s].size < size:
                self.frames[s] = np.empty(size, np.uint8)
            views.append(self.frames[s][:size])
        self.channel.broadcast([(view, s) for s, view in enumerate(views)], describe)
        update = self.replica.update_host
        for shard, view in zip(self.shards, views):
            self.broadcast_decoder.decode(view, shard, update)

    def reports(self, m: int) -> None:
        pass

    def end(self, m: int) -> bool:
        self.replica.apply_update(self.replica.update_host, self.config.lr)
        if self.fault:
            self.fault.after_update(m, self.replica.flat)
        self.iteration = m + 1
        return self.control_msg.command == STOP_AFTER

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict, replica_state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.compressor.load_state_dict(state["compressor"])
        self.replica.load_state_dict(replica_state)
