"""The ways of aggregating by name, and the one place a run's is chosen.

``EXCHANGES`` (a :class:`~mpigrad.registry.Registry` of :class:`~.way.Way` factories) names
each way; :func:`choose_exchange` builds a run's: the one one-round way whose ``chosen``
holds for the config, inside each wrapping way whose ``chosen`` holds (the low-rank rounds
of a two-round codec). The combinations the protocol does not run (``--pipeline`` without
colocated servers, a two-round codec with ``--pipeline``, ``--pipeline`` on nodes of several
workers with the flat exchange) are refused by the config's own
checks (``RunConfig.validate``, ``check_nodes``, ``plan.checks.check_two_rounds``) before any
role is built.

Adding a way: its file in this folder (a :class:`~.way.Way` with the sides it changes), its
test, and its line below.
"""

from __future__ import annotations

from ...config import RunConfig
from ...errors import UsageError
from ...registry import Registry
from .colocated import Colocated
from .hierarchical import Hierarchical
from .hierarchical_pipeline import HierarchicalPipelined
from .pipeline import Pipelined
from .servers import SeparateServers
from .tworounds import LowRankRounds
from .way import Way

__all__ = ["EXCHANGES", "choose_exchange", "exchange_names"]

#: The ways of aggregating, by name.
EXCHANGES: Registry = Registry("exchange", UsageError, plugin_hint="")
EXCHANGES.register(SeparateServers, "servers")    # --servers S: the star (S = 1) or S sharded servers
EXCHANGES.register(Colocated, "colocated")        # --servers colocated: each worker serves a shard
EXCHANGES.register(Hierarchical, "hierarchical")  # --exchange hierarchical: colocated on nodes, slices across
EXCHANGES.register(Pipelined, "pipelined")        # --pipeline: colocated, bucket by bucket in backward
EXCHANGES.register(HierarchicalPipelined, "hierarchical-pipelined")  # --pipeline, --exchange hierarchical
EXCHANGES.register(LowRankRounds, "lowrank")      # a two-round codec (powersgd) around one of them


def exchange_names(config: RunConfig) -> list[str]:
    """The registered names of ``config``'s way, the one-round way first, then each way
    built around it. ValueError (a bug in a way's ``chosen``) unless exactly one one-round
    way holds."""
    ways = [(name, EXCHANGES.lookup(name)) for name in EXCHANGES.names()]
    chosen = [name for name, way in ways if not way.wraps and way.chosen(config)]
    if len(chosen) != 1:
        raise ValueError(f"the ways of aggregating {chosen or 'none'} hold for one run: each config takes one")
    return chosen + [name for name, way in ways if way.wraps and way.chosen(config)]


def choose_exchange(config: RunConfig) -> Way:
    """The way of aggregating a run of ``config`` takes (every role builds its side from it)."""
    first, *around = exchange_names(config)
    way = EXCHANGES.lookup(first)()
    for name in around:
        way = EXCHANGES.lookup(name)(way)
    return way
