"""The run's nodes as a user reads them: the ``nodes:`` line (rank 0's start-up text and
``mpigrad train --check``), and Slurm's tasks per node set against the nodes a run declares.

Slurm says how many tasks each node of a job runs in ``SLURM_TASKS_PER_NODE`` (set in every
job and step, in node order, ``N(xK)`` for K nodes of N: ``5,4(x3)``) and, with
``--ntasks-per-node N``, in ``SLURM_NTASKS_PER_NODE`` (N on each of ``SLURM_JOB_NUM_NODES``
nodes); :func:`slurm_layout` reads them, the first where both are set. Slurm's default
block distribution gives a node consecutive ranks, as the run's nodes have them; under
another (``SLURM_DISTRIBUTION`` cyclic, plane, arbitrary) the ranks do not follow node
order and nothing is compared.

:func:`slurm_nodes_notes` is the one rule: nodes of L workers in worker order, rank 0 (the
scheduler) an extra rank on node 0 (``Topology.rank_nodes``), want L + 1 tasks on node 0
and L on each other node; a declared ``--ranks-per-node L`` whose Slurm layout differs gets a
note (the declared nodes are still used: by the network model, and by the exchange's groups,
which then do not follow the machines), and ``--ranks-per-node auto``, checked before the
launch, what the launch would find on Slurm's layout (``resolve_topology``'s own rule).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ...config import AUTO, RunConfig
from ...errors import UsageError
from .environment import _positive_int_variable
from .topology import Topology, resolve_topology

__all__ = ["nodes_line", "exchange_description", "SlurmLayout", "parse_tasks_per_node", "format_counts",
           "slurm_layout", "slurm_nodes_notes"]


def exchange_description(exchange: str, config: RunConfig) -> str:
    """The resolved ``exchange`` in words: what crosses a node's NIC and how."""
    if exchange == "hierarchical":
        return (f"hierarchical (a reduce-scatter and an all-gather inside each node at {config.intra_codec}; across "
                f"the nodes, each local rank's slice by the {config.codec} codec)")
    return "flat (every worker sends a shard to every other, across a NIC or not)"


def nodes_line(topology: Topology, exchange: str, config: RunConfig) -> str | None:
    """The ``nodes:`` line: ``topology.describe`` (rank 0's node, each node's ranks) and, for
    nodes other than the model's default of one worker each, the exchange that crosses them
    (the default's exchange is the flat one: the line stays short). None for the default
    with separate server ranks (``--servers S``): each rank has a link of its own, as always,
    and nothing sits beside a worker (``describe``'s default line is about colocated runs)."""
    default = topology.ranks_per_node == 1 and topology.source == "default"
    if default and not config.colocated:
        return None
    text = topology.describe(config.colocated, config.non_worker_ranks())
    return text if default else f"{text}; exchange: {exchange_description(exchange, config)}"


@dataclass(frozen=True)
class SlurmLayout:
    """Slurm's tasks on each node of the job, in node order; ``variable``: where they come
    from (``SLURM_TASKS_PER_NODE``; ``SLURM_NTASKS_PER_NODE=4, SLURM_JOB_NUM_NODES=2``); ``distribution``: ``SLURM_DISTRIBUTION``'s
    node level (``block`` where unset); ``nodes_only``: only ``SLURM_JOB_NUM_NODES`` said
    anything (``counts`` empty: how many nodes, not how many tasks on each)."""

    counts: tuple[int, ...]
    variable: str
    distribution: str = "block"
    nodes_only: int = 0

    def rank_nodes(self, size: int) -> list[int] | None:
        """The node of each of ``size`` ranks in block order (each node filled in turn), or
        None where the layout holds fewer tasks than ``size``."""
        nodes = [node for node, count in enumerate(self.counts) for _ in range(count)]
        return nodes[:size] if len(nodes) >= size else None


_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's per-node task counts (``5,4(x3)`` -> ``[5, 4, 4, 4]``); UsageError (one line)
    for a value that is not of that form."""
    counts: list[int] = []
    for part in value.strip().split(","):
        match = _COUNT.match(part.strip())
        if not match or int(match.group(1)) < 1 or (match.group(2) is not None and int(match.group(2)) < 1):
            raise UsageError(f"{name}={value!r} is not Slurm's list of tasks per node (e.g. 5,4(x3)): unset it, "
                             "or launch inside the Slurm job")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def format_counts(counts) -> str:
    """Per-node counts as Slurm writes them: ``[5, 4, 4, 4]`` -> ``5,4(x3)``."""
    runs: list[list[int]] = []
    for count in counts:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    return ",".join(f"{count}(x{times})" if times > 1 else str(count) for count, times in runs)


def slurm_layout(environ: Mapping[str, str] = os.environ, size: int | None = None) -> SlurmLayout | None:
    """Slurm's tasks per node (module docstring), else None outside Slurm. ``size``: the
    world's, to lay out ``SLURM_NTASKS_PER_NODE=N`` without ``SLURM_JOB_NUM_NODES`` (as many
    nodes of N as the ranks fill). UsageError (one line) for a value that cannot be read."""
    distribution = environ.get("SLURM_DISTRIBUTION", "").strip().split(":")[0].split("=")[0].split(",")[0]
    distribution = "block" if distribution in ("", "*") else distribution
    tasks = environ.get("SLURM_TASKS_PER_NODE", "").strip()
    if tasks:
        return SlurmLayout(tuple(parse_tasks_per_node(tasks)), "SLURM_TASKS_PER_NODE", distribution)
    nodes = _positive_int_variable(environ, "SLURM_JOB_NUM_NODES")
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "").strip()
    if per_node:
        counts = parse_tasks_per_node(per_node, "SLURM_NTASKS_PER_NODE")
        if len(counts) == 1:
            times = nodes or (-(-size // counts[0]) if size else 1)
            counts = counts * times
        where = f"SLURM_NTASKS_PER_NODE={per_node}" + (f", SLURM_JOB_NUM_NODES={nodes}" if nodes else "")
        return SlurmLayout(tuple(counts), where, distribution)
    if nodes:
        return SlurmLayout((), f"SLURM_JOB_NUM_NODES={nodes}", distribution, nodes_only=nodes)
    return None


def slurm_nodes_notes(config: RunConfig, size: int, topology: Topology | None = None,
                      environ: Mapping[str, str] = os.environ) -> list[str]:
    """Notes (``note: ...`` lines) on Slurm's tasks per node against the run's nodes (the rule
    in the module docstring): ``topology``, the resolved nodes of a declared
    ``--ranks-per-node L``; for ``--ranks-per-node auto`` without a topology, what the launch
    would resolve on Slurm's layout. None (``[]``) outside Slurm, for the default of one worker per node, and for
    nodes MPI found (MPI's split is then the truth); a note that nothing is compared under a
    distribution other than block, or for a Slurm variable that cannot be read (they only
    inform: never an error)."""
    auto = config.ranks_per_node == AUTO and topology is None
    if not auto and (topology is None or topology.source != "declared"):
        return []
    try:
        layout = slurm_layout(environ, size)
    except UsageError as exc:
        return [f"note: {exc} (the nodes are not checked against Slurm's)"]
    if layout is None:
        return []
    if layout.distribution != "block":
        return [f"note: Slurm's distribution {layout.distribution} (SLURM_DISTRIBUTION) does not give a node "
                "consecutive ranks: the nodes are not checked against Slurm's tasks per node"]
    workers = size - config.non_worker_ranks()
    if layout.nodes_only:
        nodes = layout.nodes_only
        if auto:
            if workers % nodes or workers < nodes:
                return [f"note: Slurm's job has {nodes} node(s) ({layout.variable}) for {workers} workers: they do "
                        "not split evenly, and --ranks-per-node auto would be refused at launch if Slurm spreads "
                        "them over every node"]
            L = workers // nodes
            return [f"note: Slurm's job has {nodes} node(s) ({layout.variable}): --ranks-per-node auto would find "
                    f"{L} worker(s) per node where Slurm places {format_counts(_wanted(Topology(workers, L), config))} "
                    "tasks per node"]
        if topology.nodes != nodes:
            return [f"note: --ranks-per-node {topology.ranks_per_node} declares {topology.nodes} node(s); Slurm's "
                    f"job has {nodes} ({layout.variable}): the declared nodes are used (by the network model, and "
                    "by the exchange's groups)"]
        return []
    found = layout.rank_nodes(size)
    if found is None:
        return [f"note: Slurm's tasks per node ({layout.variable}) hold {sum(layout.counts)} tasks, fewer than the "
                f"world's {size} ranks: the nodes are not checked against Slurm's"]
    seen = format_counts(_counts(found))
    if auto:
        try:
            resolved, exchange, _ = resolve_topology(config, size, found)
        except UsageError as exc:
            return [f"note: Slurm's layout of {seen} tasks per node ({layout.variable}): --ranks-per-node auto "
                    f"would be refused at launch: {exc}"]
        return [f"note: Slurm's layout of {seen} tasks per node ({layout.variable}) gives --ranks-per-node auto "
                f"{resolved.nodes} node(s) of {resolved.ranks_per_node} worker(s), exchange {exchange} (if MPI's nodes "
                "are Slurm's)"]
    wanted = _wanted(topology, config)
    if _counts(found) == wanted:
        return []
    L = topology.ranks_per_node
    return [f"note: --ranks-per-node {L} wants {format_counts(wanted)} tasks per node (rank 0 and {L} workers on "
            f"node 0, {L} on each other); Slurm lays out {seen} ({layout.variable}): the declared nodes are used (by "
            "the network model, and by the exchange's groups, which then do not follow the machines): ask Slurm for "
            "that layout, or declare the L it gives"]


def _counts(rank_nodes: list[int]) -> list[int]:
    """Ranks per node, in node order, of a rank -> node list."""
    counts: dict[int, int] = {}
    for node in rank_nodes:
        counts[node] = counts.get(node, 0) + 1
    return list(counts.values())


def _wanted(topology: Topology, config: RunConfig) -> list[int]:
    """The tasks per node the run's nodes want (``Topology.rank_nodes``: rank 0 on node 0)."""
    return _counts(topology.rank_nodes(config.colocated, config.non_worker_ranks()))
