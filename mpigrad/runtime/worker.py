"""Ranks 1..P: compute loss and gradient on a shard, quantize, exchange, update (Alg. 1, worker)."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from mpi4py import MPI

from ..codecs import CodecError
from ..config import RunConfig
from ..data import ShardSampler
from . import comm as mpi
from .buffers import BufferSync, sync_due
from .common import base_codec, build_encoder, build_replica, load_data
from .protocol import (CONTROL_FIXED, LOSS_FIELDS, STATUS_NONFINITE_LOSS, STATUS_OK, STOP_AFTER,
                       TAG_GRAD, TAG_LOSS, LossMessage, error_frame)
from .faults import Fault
from .replica import FrameDecoder, set_frame_encode_seconds


class Worker:
    def __init__(self, config: RunConfig, comm: MPI.Comm):
        self.config = config
        self.comm = comm
        self.rank = comm.Get_rank()
        workers = comm.Get_size() - 1
        dataset = load_data(config)
        self.sampler = ShardSampler(len(dataset.train_y), self.rank - 1, workers, config.batch_size,
                                    config.seed)
        # Keep only this worker's shard (sorted global indices -> rows of the copy).
        self.shard = self.sampler.shard
        self.train_x = np.ascontiguousarray(dataset.train_x[self.shard])
        self.train_y = np.ascontiguousarray(dataset.train_y[self.shard])
        # The shard is a copy: let the full training split go (rank 0 drops it too).
        dataset.train_x = dataset.train_x[:0]
        dataset.train_y = dataset.train_y[:0]
        self.replica = build_replica(config, dataset)
        codec = base_codec(config)
        self.encoder = build_encoder(config, self.replica, codec, rank=self.rank)
        self.decoder = FrameDecoder(self.replica.layout, codec)
        self.buffer_sync = BufferSync(self.replica.model, comm, 2 * config.timeout)
        n_layers = max(len(self.replica.layout.quantized), 1)
        self.loss_buf = np.zeros(LOSS_FIELDS, np.float64)
        self.control = np.zeros(CONTROL_FIXED + n_layers, np.int64)
        self.frame_len = np.zeros(1, np.int64)
        self.bcast_frame = np.empty(0, np.uint8)
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

    def step(self, m: int) -> bool:
        """Run iteration m; return True when rank 0 asked to stop after it."""
        # Rank 0 detects and names a silent worker; workers give it twice as long before
        # concluding that rank 0 itself is gone.
        config, timeout = self.config, 2 * self.config.timeout
        loss, cpu, wall = self._compute()
        if self.fault:
            loss = self.fault.before_send(m, loss, self.replica.gradient_to_host())
        checksum = -1.0
        if config.checksum_every and m % config.checksum_every == 0:
            checksum = float(self.replica.checksum())
        status = STATUS_OK if math.isfinite(loss) else STATUS_NONFINITE_LOSS
        LossMessage(loss, cpu, wall, checksum, status).pack(self.loss_buf)
        mpi.send(self.comm, self.loss_buf, 0, TAG_LOSS, timeout, lambda: f"rank 0 took no loss for iteration {m}")
        mpi.bcast(self.comm, self.control, timeout, lambda: f"rank 0 sent no bits for iteration {m}")
        if int(self.control[1]) != m:
            raise RuntimeError(f"protocol out of step: rank 0 is at iteration {int(self.control[1])}, "
                               f"rank {self.rank} at {m}")
        bits = [int(b) for b in self.control[CONTROL_FIXED:]]

        start = time.process_time()
        grad = self.replica.gradient_to_host()
        try:
            frame = self.encoder.encode(grad, bits)
            set_frame_encode_seconds(frame, time.process_time() - start)
        except CodecError:
            if np.isfinite(grad).all():
                raise
            frame = error_frame()
        mpi.send(self.comm, frame, 0, TAG_GRAD, timeout, lambda: f"rank 0 took no gradient for iteration {m}")

        mpi.bcast(self.comm, self.frame_len, timeout, lambda: f"rank 0 sent no gradient for iteration {m}")
        size = int(self.frame_len[0])
        if self.bcast_frame.size < size:
            self.bcast_frame = np.empty(size, np.uint8)
        mpi.bcast(self.comm, self.bcast_frame[:size], timeout, lambda: f"rank 0 sent no gradient for iteration {m}")
        update = self.replica.update_host
        self.decoder.decode(self.bcast_frame[:size], update)
        self.replica.apply_update(update, config.lr)
        if self.fault:
            self.fault.after_update(m, self.replica.flat)
        return int(self.control[0]) == STOP_AFTER

    def run(self, start_iteration: int = 0) -> bool:
        """Iterate until the end or until rank 0 asks to stop; True when stopped for requeue."""
        for m in range(start_iteration, self.config.iterations):
            stop_after = self.step(m)
            self.iteration = m + 1
            if sync_due(self.config, m, stop_after):
                self.buffer_sync.run(m)
            if stop_after:
                return True
        return False

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "encoder": self.encoder.state_dict()}

    def load_state_dict(self, state: dict, replica_state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.encoder.load_state_dict(state["encoder"])
        self.replica.load_state_dict(replica_state)
