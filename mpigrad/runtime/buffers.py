"""Model buffers across replicas: BatchNorm running statistics averaged over the workers.

Parameters are trained by the exchanged gradients and stay bit-identical on every rank.
Buffers (BatchNorm's running means and variances, its batch counter, any other
``register_buffer``) are not: each worker updates its own on its own shard, and rank 0,
which never runs a training forward pass, would evaluate with the initial ones. Training
itself never reads them (BatchNorm normalises by the batch's statistics in training mode),
so they need to agree only where they are read or kept: before rank 0 evaluates, before a
checkpoint, and at the end of the run. There, ``BufferSync.run`` gathers every worker's
buffers to rank 0, averages them over the workers in rank order in float64 (integer
buffers rounded back), and broadcasts the average, which every rank, rank 0 included,
copies into its model; this is timm's ``distribute_bn(..., reduce=True)``. A model with no
buffers (the paper CNN, GroupNorm or norm-free nets) skips it: nothing is sent.

The replica checksum covers parameters only: buffers legitimately differ between the
synchronisations, and right after one they are identical by construction.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ..config import RunConfig
from . import comm as mpi


def sync_due(config: RunConfig, m: int, stop_after: bool) -> bool:
    """Whether buffers are synchronised after iteration ``m`` (the same answer on every rank)."""
    last = m + 1 == config.iterations
    evaluates = bool(config.eval_every) and (m + 1) % config.eval_every == 0
    return last or evaluates or stop_after


class BufferSync:
    """Average a replica's buffers over the workers; a no-op for a model without buffers."""

    def __init__(self, model: torch.nn.Module, comm: MPI.Comm, timeout: float):
        self.buffers = [b for b in model.buffers()]
        self.size = sum(b.numel() for b in self.buffers)
        self.comm = comm
        self.timeout = timeout
        self.rank = comm.Get_rank()
        self.workers = comm.Get_size() - 1
        self._send = np.zeros(self.size, np.float64)
        self._gathered = np.zeros((self.workers + 1, self.size), np.float64) if self.rank == 0 else None

    def run(self, m: int) -> None:
        """Collective over every rank, after iteration ``m``."""
        if not self.size:
            return
        if self.rank:
            self._pack(self._send)
        describe = lambda: f"buffer synchronisation after iteration {m} stalled"  # noqa: E731
        mpi.wait(self.comm.Igather(self._send, self._gathered, root=0), self.timeout, describe)
        if self.rank == 0:
            np.mean(self._gathered[1:], axis=0, out=self._send)
        mpi.bcast(self.comm, self._send, self.timeout, describe)
        self._unpack(self._send)

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
