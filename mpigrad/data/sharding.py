"""Disjoint, seeded shards of the training set and the batches each worker draws from its own.

The ``num_examples`` indices are permuted once with ``seed`` and cut into ``num_workers``
contiguous shards (sizes differ by at most one); worker ``worker_index`` (0-based) only ever
sees its shard. Each epoch visits the shard in a fresh order drawn from
``(seed, worker_index, epoch)`` and yields ``len(shard) // batch_size`` full batches; the
remainder is skipped for that epoch (a different remainder next epoch). The order is a pure
function of the hyperparameters, so ``state_dict()`` (epoch, position) is enough to resume.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .datasets import DataError, check_count, check_seed

__all__ = ["ShardSampler"]

_SHARD_STREAM = 0x54A2D
_EPOCH_STREAM = 0xE9C4


class ShardSampler:
    """Batches of training-set indices for one worker, never leaving its shard."""

    def __init__(self, num_examples: int, worker_index: int, num_workers: int,
                 batch_size: int, seed: int = 0):
        self.num_examples = check_count("num_examples", num_examples)
        self.num_workers = check_count("num_workers", num_workers)
        self.worker_index = check_count("worker_index", worker_index, minimum=0)
        if self.worker_index >= self.num_workers:
            raise DataError(f"worker_index {worker_index} is out of range for {num_workers} workers")
        self.batch_size = check_count("batch_size", batch_size)
        self.seed = check_seed(seed)

        permutation = np.random.default_rng([self.seed, _SHARD_STREAM]).permutation(self.num_examples)
        shard = np.array_split(permutation, self.num_workers)[self.worker_index]
        self.shard = np.sort(shard).astype(np.int64)
        self.shard.flags.writeable = False
        if self.shard.size < self.batch_size:
            raise DataError(
                f"worker {self.worker_index}'s shard holds {self.shard.size} examples "
                f"({self.num_examples} split {self.num_workers} ways), fewer than the batch size "
                f"{self.batch_size}; use a smaller batch, fewer workers or more data")
        self.batches_per_epoch = self.shard.size // self.batch_size

        self.epoch = 0
        self.position = 0  # batches already drawn in this epoch
        self._order = self._epoch_order(0)

    def next_batch(self) -> np.ndarray:
        """int64 indices (into the full training set) of this worker's next batch."""
        if self.position == self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        start = self.position * self.batch_size
        self.position += 1
        return self._order[start:start + self.batch_size].copy()

    def state_dict(self) -> dict[str, int]:
        """Where the sampler stands, plus the hyperparameters that fix the order."""
        return {"epoch": self.epoch, "position": self.position, "num_examples": self.num_examples,
                "worker_index": self.worker_index, "num_workers": self.num_workers,
                "batch_size": self.batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``; DataError if it belongs to a sampler with other hyperparameters."""
        if not isinstance(state, Mapping) or "epoch" not in state or "position" not in state:
            raise DataError(f"sampler state must be a mapping with 'epoch' and 'position', got {state!r}")
        mine = self.state_dict()
        for key in ("num_examples", "worker_index", "num_workers", "batch_size", "seed"):
            if key in state and state[key] != mine[key]:
                raise DataError(f"sampler state has {key}={state[key]!r}, this sampler {key}={mine[key]}")
        epoch = check_count("sampler state epoch", state["epoch"], minimum=0)
        position = check_count("sampler state position", state["position"], minimum=0)
        if position > self.batches_per_epoch:
            raise DataError(f"sampler state position {position} exceeds the "
                            f"{self.batches_per_epoch} batches of an epoch")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, _EPOCH_STREAM, self.worker_index, epoch])
        return rng.permutation(self.shard)

    def __repr__(self) -> str:
        return (f"ShardSampler(num_examples={self.num_examples}, worker_index={self.worker_index}, "
                f"num_workers={self.num_workers}, batch_size={self.batch_size}, seed={self.seed}, "
                f"epoch={self.epoch}, position={self.position})")
