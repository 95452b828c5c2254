"""Shard servers: ranks 1..S-1 of separate servers, one shard each. What a shard server does
with its shard is the run's way of aggregating, whose shard-server side (``exchange``,
:mod:`..exchange.way`) this role drives; the phase order is in :mod:`.iteration`."""

from __future__ import annotations

import torch

from ...config import RunConfig
from ..exchange.buffers import BufferSync
from ..exchange.build import base_codec, build_replica, load_data, release_data, script_replica
from ..exchange.way import ServerParts
from ..exchange.ways import choose_exchange
from .faults import Fault
from ..measure.phaselog import PhaseLog
from .iteration import FollowerRole
from ..wire import STOP_AFTER, WORLD, Channel, Control

__all__ = ["ShardServer"]


class ShardServer(FollowerRole):
    """Rank s in 1..S-1: the server of shard s."""

    def __init__(self, config: RunConfig, channel: Channel, model: torch.nn.Module | None = None):
        """``model``: a script's (:class:`mpigrad.Session`), else the config's is built."""
        self.config, self.channel = config, channel
        self.rank = channel.rank
        if model is not None:
            replica = script_replica(config, model)
        else:
            replica = build_replica(config, load_data(config))
            release_data()  # only the model's shape was needed
        codec = base_codec(config)
        self.n_layers = len(replica.layout.quantized)
        self.control_msg = Control(self.n_layers)
        #: This server's side of the run's way of aggregating (:mod:`..exchange.ways`).
        self.exchange = choose_exchange(config).shard_server(ServerParts(config, channel, replica, codec,
                                                                         self.control_msg))
        self.buffer_sync = BufferSync(replica.model, channel)
        self.iteration = 0
        self.fault = Fault.from_environment(self.rank)
        self.phase_log = PhaseLog.from_environment(self.rank, replica.device)  # MPIGRAD_PHASE_LOG

    def begin(self, m: int) -> None:
        pass

    def losses(self, m: int) -> None:
        pass

    def control(self, m: int) -> None:
        self.channel.broadcast([(self.control_msg.buf, WORLD)],
                               lambda: f"rank 0 sent no bits for iteration {m}")
        self.exchange.control(m)

    def gradients(self, m: int) -> None:
        self.exchange.gradients(m)

    def broadcast(self, m: int) -> None:
        self.exchange.broadcast(m)

    def gradients2(self, m: int) -> None:
        self.exchange.gradients2(m)

    def broadcast2(self, m: int) -> None:
        self.exchange.broadcast2(m)

    def reports(self, m: int) -> None:
        if self.fault:
            self.fault.before_send(m, 0.0, None)
        self.exchange.reports(m)

    def end(self, m: int) -> bool:
        self.iteration = m + 1
        return self.control_msg.command == STOP_AFTER

    def state_dict(self) -> dict:
        return self.exchange.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.exchange.load_state_dict(state)
