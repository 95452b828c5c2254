"""Model buffers across replicas: BatchNorm running statistics averaged over the workers.

Parameters are trained by the exchanged gradients and stay bit-identical on every rank.
Buffers (BatchNorm's running means and variances, its batch counter, any other
``register_buffer``) are not: each worker updates its own on its own shard, and rank 0,
which never runs a training forward pass, would evaluate with the initial ones. Training
itself never reads them (BatchNorm normalises by the batch's statistics in training mode),
so they need to agree only where they are read or kept: before rank 0 evaluates, before a
checkpoint, and at the end of the run. There (the ``buffers`` phase of :mod:`.iteration`),
``BufferSync.run`` has every worker send its buffers to rank 0 (``BufferStats``, tag
BUFFERS), rank 0 averages them over the workers in rank order in float64 (integer buffers
rounded back) and broadcasts the average on the world, and every rank, rank 0 and the shard
servers included, copies it into its model; this is timm's ``distribute_bn(..., reduce=True)``.
A model with no buffers (the paper CNN, GroupNorm or norm-free nets) skips it: nothing is sent.

The replica checksum covers parameters only: buffers legitimately differ between the
synchronisations, and right after one they are identical by construction.
"""

from __future__ import annotations

import numpy as np
import torch

from ...counters import copied, synchronized
from ...config import RunConfig
from ..wire import CHECKPOINT_AFTER, STOP_AFTER, TAG_BUFFERS, TAG_PARAMS, WORLD, BufferStats, Channel


def sync_due(config: RunConfig, m: int, command: int) -> bool:
    """Whether buffers are synchronised after iteration ``m`` (the same answer on every rank):
    rank 0 evaluates then, or ``command`` (the iteration's Control command) stops or
    checkpoints after it, or the run ends."""
    last = m + 1 == config.iterations
    evaluates = bool(config.eval_every) and (m + 1) % config.eval_every == 0
    return last or evaluates or command in (STOP_AFTER, CHECKPOINT_AFTER)


class BufferSync:
    """Average a replica's buffers over the workers; a no-op for a model without buffers."""

    def __init__(self, model: torch.nn.Module, channel: Channel):
        self.buffers = list(model.buffers())
        self.size = sum(b.numel() for b in self.buffers)
        self.channel = channel
        self.average = BufferStats.buffer(self.size)
        self.rows = BufferStats.buffer(self.size, len(channel.workers)) if channel.rank == 0 else None

    def run(self, m: int) -> None:
        """Collective over every rank, after iteration ``m``."""
        if not self.size:
            return
        channel = self.channel
        if channel.rank == 0:
            channel.recv([(row, rank) for row, rank in zip(self.rows, channel.workers)], TAG_BUFFERS,
                         lambda pending: f"worker rank(s) {', '.join(map(str, pending))} sent no buffers "
                                         f"after iteration {m}")
            np.mean(self.rows, axis=0, out=self.average)
        elif channel.is_worker:
            self._pack(self.average)
            channel.send([(self.average, 0)], TAG_BUFFERS,
                         lambda _: f"rank 0 took no buffers after iteration {m}")
        channel.broadcast([(self.average, WORLD)], lambda: f"buffer synchronisation after iteration {m} stalled")
        self._unpack(self.average)

    def _pack(self, out: np.ndarray) -> None:
        offset = 0
        for b in self.buffers:
            n = b.numel()
            out[offset:offset + n] = b.detach().reshape(-1).to("cpu", torch.float64).numpy()
            offset += n

    def _unpack(self, values: np.ndarray) -> None:
        offset = 0
        with torch.no_grad():
            for b in self.buffers:
                n = b.numel()
                chunk = torch.from_numpy(values[offset:offset + n]).view(b.shape)
                if not b.is_floating_point():
                    chunk = chunk.round()
                b.copy_(chunk)
                offset += n


class ParameterSync:
    """Colocated servers: rank 0 takes part in no gradient broadcast, so its replica's
    parameters are brought up to date where it reads them (the buffers' synchronisation
    points: before it evaluates, checkpoints or ends). The first worker sends its flat
    parameters (message 9), rank 0 copies them into its replica; the workers' parameters are
    identical (checked by the checksums), so any worker's would do."""

    def __init__(self, replica, channel: Channel):
        self.replica, self.channel = replica, channel
        self.source = channel.workers[0]
        self.host = np.empty(replica.layout.total, np.float32) if channel.rank == 0 else None

    def run(self, m: int) -> None:
        """After iteration ``m``, on rank 0 and the first worker (the others do nothing)."""
        channel = self.channel
        if channel.rank == 0:
            channel.recv([(self.host, self.source)], TAG_PARAMS,
                         lambda pending: f"worker rank {self.source} sent no parameters after iteration {m}")
            with torch.no_grad():
                self.replica.flat.copy_(torch.from_numpy(self.host))
        elif channel.rank == self.source:
            if self.replica.codecs_on_device:
                copied("to_host", 4 * self.replica.flat.numel())
                synchronized("parameters to rank 0")
            flat = self.replica.flat.detach().to("cpu").numpy()
            channel.send([(flat, 0)], TAG_PARAMS, lambda _: f"rank 0 took no parameters after iteration {m}")
