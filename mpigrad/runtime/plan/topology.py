"""Which workers share a node, and the exchange that follows from it.

A run's nodes are ``--ranks-per-node L`` (``ranks_per_node`` in a config): L consecutive
workers to a node, worker w on node w // L at local rank w % L; rank 0, the scheduler and
MDP server, is an extra rank on node 0 (its messages are a few bytes each). ``auto`` takes
the nodes MPI's shared-memory split finds (``MPI_Comm_split_type(COMM_TYPE_SHARED)``, as
Horovod builds its node communicator); a declared L wins over what MPI sees, with a note,
since the network model, the lab and the tests on one machine declare nodes that MPI sees
as one.

:func:`resolve_topology` is the one place the declared or found nodes become a
:class:`Topology` and ``--exchange auto`` becomes ``flat`` or ``hierarchical``; the launch
(``run.preflight``) writes both into the config, so the trace records the resolved values
and a replay of it takes the same way. An in-process run (the loopback channel: no launch)
resolves ``--exchange auto`` by the same rule when its ranks start
(:func:`resolve_in_process`), so it takes the way an MPI launch would.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Sequence

from ...config import AUTO, AUTO_CHUNK, RunConfig
from ...errors import UsageError
from .checks import base_codec
from .gpu import workers_device

__all__ = ["Topology", "resolve_topology", "resolve_in_process", "mpi_nodes"]


@dataclass(frozen=True)
class Topology:
    """``workers`` workers in nodes of ``ranks_per_node``, in worker order; ``source``: where
    L came from (``declared``, ``mpi``, or ``default``: one worker per node, the model's
    assumption when nothing says otherwise)."""

    workers: int
    ranks_per_node: int
    source: str = "default"

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.workers % self.ranks_per_node:
            raise ValueError(f"{self.ranks_per_node} workers per node do not divide {self.workers} workers")

    @property
    def nodes(self) -> int:
        return self.workers // self.ranks_per_node

    def node_of(self, worker: int) -> int:
        """The node of worker ``worker`` (0-based worker index, not the MPI rank)."""
        return worker // self.ranks_per_node

    def local_rank(self, worker: int) -> int:
        return worker % self.ranks_per_node

    def node_workers(self, node: int) -> list[int]:
        """The workers of ``node``, in local-rank order."""
        L = self.ranks_per_node
        return list(range(node * L, node * L + L))

    def cross_group(self, local: int) -> list[int]:
        """The workers of local rank ``local`` on every node, in node order: the workers that
        exchange one slice across nodes in a hierarchical exchange."""
        return [node * self.ranks_per_node + local for node in range(self.nodes)]

    def rank_nodes(self, colocated: bool = True, servers: int = 1) -> list[int]:
        """The node of every MPI rank: rank 0 (and separate server ranks) on node 0, worker w
        (rank w + 1, or S + w) on ``node_of(w)``."""
        first = 1 if colocated else servers
        return [0] * first + [self.node_of(w) for w in range(self.workers)]

    def describe(self, colocated: bool = True, servers: int = 1) -> str:
        """One line for the start-up text and ``mpigrad doctor``: the nodes, where L came
        from, the ranks of each node (up to 8 nodes listed) and where rank 0 sits."""
        if self.ranks_per_node == 1 and self.source == "default":
            beside = ("rank 0, the scheduler, beside worker 0" if colocated else
                      "rank 0 and the other server ranks on links of their own")
            return (f"nodes: {self.workers} of one worker each (the model's default; --ranks-per-node L declares "
                    f"nodes of several); {beside}")
        where = {"declared": f"--ranks-per-node {self.ranks_per_node}", "mpi": "MPI's shared-memory split",
                 "default": "the default"}[self.source]
        by_node: dict[int, list[int]] = {}
        for rank, node in enumerate(self.rank_nodes(colocated, servers)):
            by_node.setdefault(node, []).append(rank)
        listed = "; ".join(f"node {node}: ranks {_span(ranks)}" for node, ranks in list(by_node.items())[:8])
        more = f"; ... {len(by_node) - 8} more" if len(by_node) > 8 else ""
        return (f"nodes: {self.nodes} of {self.ranks_per_node} worker(s) (from {where}); {listed}{more}; "
                "rank 0, the scheduler, on node 0")

    def record(self) -> dict:
        """The trace's ``topology`` attribute."""
        return {"workers": self.workers, "ranks_per_node": self.ranks_per_node, "nodes": self.nodes,
                "source": self.source, "rank0_node": 0}


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)) \
        else ", ".join(map(str, ranks))


def mpi_nodes(comm) -> list[int]:
    """Collective over ``comm``: the node of every rank as MPI's shared-memory split finds it,
    each node named by its lowest rank in ``comm``."""
    from .gpu import node_of

    return comm.allgather(node_of(comm)[0])


def _found_ranks_per_node(nodes: Sequence[int], first_worker: int) -> tuple[int | None, str]:
    """(workers per node, a description) of MPI's ``nodes`` (per rank), or (None, why) where
    its nodes do not hold equal runs of consecutive workers."""
    workers = list(nodes[first_worker:])
    runs: list[tuple[int, int]] = []
    for node in workers:
        if runs and runs[-1][0] == node:
            runs[-1] = (node, runs[-1][1] + 1)
        else:
            runs.append((node, 1))
    distinct = len({node for node, _ in runs})
    counts = sorted({count for _, count in runs})
    shown = f"{distinct} node(s) holding {', '.join(str(c) for _, c in runs[:8])}{' ...' if len(runs) > 8 else ''} worker(s)"
    if distinct != len(runs) or len(counts) != 1:
        return None, shown + " (not equal runs of consecutive workers)"
    return counts[0], shown


def resolve_topology(config: RunConfig, size: int, nodes: Sequence[int] | None = None
                     ) -> tuple[Topology, str, list[str]]:
    """(the run's :class:`Topology`, its exchange, notes) for a world of ``size`` ranks;
    ``nodes``: MPI's node of each rank (:func:`mpi_nodes`; None where there is no MPI, as for
    ``mpigrad train --check``). UsageError (one line) for nodes that cannot be: L that does
    not divide the workers, ``auto`` without MPI or on uneven nodes, ``--exchange
    hierarchical`` on one node."""
    workers = size - config.non_worker_ranks()
    notes: list[str] = []
    declared = config.ranks_per_node
    found, seen = (None, "") if nodes is None else _found_ranks_per_node(nodes, config.non_worker_ranks())
    if declared == AUTO:
        if nodes is None:
            raise UsageError("--ranks-per-node auto takes the nodes MPI finds at launch: give a number to check the "
                             "job without MPI")
        if found is None:
            raise UsageError(f"--ranks-per-node auto: MPI places the workers on {seen}: give --ranks-per-node L, or "
                             "launch with as many workers on every node, in rank order (e.g. mpirun --map-by slot)")
        L, source = found, "mpi"
    else:
        L, source = int(declared), ("default" if declared == 1 else "declared")
        if workers % L:
            raise UsageError(f"--ranks-per-node {L} does not divide the {workers} workers: launch a multiple of "
                             f"{L} workers (mpiexec -n {L * max(1, workers // L) + config.non_worker_ranks()}), or "
                             "choose L among their divisors")
        if nodes is not None and L > 1 and found != L:
            notes.append(f"note: --ranks-per-node {L} declares {workers // L} node(s) of {L} worker(s); MPI sees "
                         f"{seen}: the declared nodes are used (by the network model, and by the exchange's groups)")
    topology = Topology(workers, L, source)
    if declared == AUTO:  # the config's own refusals of nodes, now that L is known
        config.check_nodes(L)
    on_gpu = workers_device(config) != "cpu"
    exchange = config.exchange
    if exchange == "hierarchical":
        if topology.nodes == 1:
            raise UsageError(f"--exchange hierarchical on one node ({workers} workers, {L} per node): nothing "
                             "crosses a NIC; use --exchange flat, or declare nodes with --ranks-per-node")
        if on_gpu and L > 1:
            if config.pipeline:
                raise UsageError(f"--exchange hierarchical with --pipeline and --device {config.device} is not built "
                                 "yet: drop --pipeline, or use --device cpu")
            notes.append(f"note: --exchange hierarchical with --device {config.device}: the codecs run on the host "
                         "(the slices are host arrays), each worker's gradient copied out and the update back every "
                         "iteration; --exchange flat takes the device path where the codecs have kernels, and puts "
                         "about L times the bytes on a NIC")
        if L == 1:
            notes.append("note: --exchange hierarchical with one worker per node is the flat exchange")
            exchange = "flat"
    elif exchange == AUTO:
        hierarchical = config.colocated and L > 1 and topology.nodes > 1 and not on_gpu
        exchange = "hierarchical" if hierarchical else "flat"
        if L > 1 and not hierarchical and topology.nodes > 1:
            notes.append("note: nodes of several workers on GPUs, flat exchange (the device path where the "
                         "codecs have kernels; --exchange hierarchical puts about 1/L of its bytes on each NIC, "
                         "its codecs on the host)")
        config.check_nodes(L, exchange)  # and now that the exchange is known
    cores = os.cpu_count() or 1
    if nodes is not None and L > cores:  # at launch: this machine's cores are the job's
        notes.append(f"note: {L} workers per node, more than this machine's {cores} cores: the modelled nodes "
                     "share them (compute is charged in CPU time)")
    if exchange == "hierarchical" and base_codec(config).two_rounds and config.shard_chunk != AUTO_CHUNK:
        notes.append(f"note: --shard-chunk {config.shard_chunk} is not used: PowerSGD on the hierarchical exchange "
                     "keeps whole layers in its shards (a slice's matrices are its local rank's)")
    return topology, exchange, notes


_in_process = threading.Lock()  # in-process ranks (threads) may share one config


def resolve_in_process(config: RunConfig, size: int) -> list[str]:
    """An in-process run's ``--exchange auto`` (every rank a thread, the loopback channel: no
    launch resolved it), by :func:`resolve_topology`'s rule for a world of ``size`` ranks
    without MPI's nodes (``--ranks-per-node auto`` is then refused), written into
    ``config.exchange``; its notes. The declared nodes stay unrecorded (``config.topology``
    None: no ``nodes:`` line, no ``topology`` attribute, as before). Nothing where the
    exchange is resolved already: by the launch (an MPI run's ranks), by another thread of
    this run, or given."""
    with _in_process:
        if config.topology is not None or config.exchange != AUTO:
            return []
        _, config.exchange, notes = resolve_topology(config, size)
        return notes
