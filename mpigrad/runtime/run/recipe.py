"""``mpigrad train``'s worker: the library's documented loop (:class:`mpigrad.Session`'s, one
:class:`~.script.ScriptWorker` exchange per iteration) with mpigrad's recipe: the config's
data shard and augmentation (:class:`Recipe`), its model, and its optimizer and schedule as
the replica's update rule, which the exchange applies (per bucket in a pipelined run), so
that train and a script share one iteration, one protocol and one trace writer."""

from __future__ import annotations

import time

import numpy as np
import torch

from ...config import RunConfig
from ...data import ShardSampler
from ...data.augment import build_augmentation
from ...errors import UsageError
from .. import EXIT_REQUEUE
from ..exchange.build import build_config_model, forward_context, load_data, release_data
from .follower import RankFailure
from .script import ScriptWorker
from ..wire import PeerTimeout

__all__ = ["Recipe", "run_train_worker"]


class Recipe:
    """One worker's data under ``mpigrad train``: its shard of the config's training set (a
    copy: the full set is released once the model is built), the :class:`ShardSampler` that
    draws its batches, and the config's augmentation. ``number`` is the worker's 1-based
    number (its shard and augmentation stream), ``workers`` their count."""

    def __init__(self, config: RunConfig, number: int, workers: int):
        self.config, self.number = config, number
        dataset = load_data(config)
        self.sampler = ShardSampler(len(dataset.train_y), number - 1, workers, config.batch_size, config.seed)
        #: This worker's examples, sorted global indices (rows of ``train_x``/``train_y``).
        self.shard = self.sampler.shard
        self.train_x = np.ascontiguousarray(dataset.train_x[self.shard])
        self.train_y = np.ascontiguousarray(dataset.train_y[self.shard])
        self.augmentation = build_augmentation(config.augment, config.augment_opts, dataset)

    def batch(self, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Iteration ``m``'s batch (the sampler's next), augmented if the run asks, on ``device``."""
        idx = np.searchsorted(self.shard, self.sampler.next_batch())
        batch = self.train_x[idx]
        if self.augmentation is not None:
            batch = self.augmentation(batch, self.config.seed, self.number - 1, m)
        return torch.from_numpy(batch).to(device), torch.from_numpy(self.train_y[idx]).to(device)

    def state_dict(self) -> dict:
        """The sampler's position (a checkpoint's ``"sampler"``)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def run_train_worker(config: RunConfig, channel) -> int:
    """A worker's part of ``mpigrad train``: the documented loop (zero the gradients, the
    batch, forward, backward, exchange) until the run's end (0) or rank 0's stop (the state
    sent, ``EXIT_REQUEUE``). An error other than a UsageError or a silent peer comes out as
    a :class:`RankFailure` carrying the iteration (-1 before the first), for the launcher to
    report to rank 0."""
    worker = None
    try:
        recipe = Recipe(config, channel.workers.index(channel.rank) + 1, len(channel.workers))
        model = build_config_model(config, load_data(config))
        release_data()  # the shard is a copy: let the full dataset go
        worker = ScriptWorker(config, channel, model, recipe)
        replica, log = worker.role.replica, worker.role.phase_log
        while not worker.over:
            m = worker.iteration
            if log is not None:
                log.record("start")  # before the batch: the phase "begin" is the compute
            cpu, wall = time.process_time(), time.perf_counter()
            x, y = recipe.batch(m, replica.device)
            worker.zero_gradients()
            with forward_context(config, replica.device):
                loss = model.loss(model(x), y, config.loss_weight_decay)
            if config.pipeline:  # backward runs in the exchange, bucket by bucket
                value = worker.read_loss(loss)
                step = worker.backward_read(loss, value, time.process_time() - cpu, time.perf_counter() - wall)
            else:
                loss.backward()
                value = worker.read_loss(loss)
                step = worker.exchange(value, time.process_time() - cpu, time.perf_counter() - wall)
            if step.stop:
                return EXIT_REQUEUE
        return 0
    except (UsageError, PeerTimeout, RankFailure):  # a silent peer (rank 0 itself, often): nobody to report to
        raise
    except Exception as exc:
        raise RankFailure(exc, channel, worker.iteration if worker is not None else -1) from exc
