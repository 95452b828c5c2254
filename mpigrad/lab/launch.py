"""Running a command in the lab: which rank runs in which node, and how.

Where the ranks go is :class:`Placement`, the one rule: by default one rank per node, rank I
in node I; with ``--ranks-per-node L``, L ranks in every node's namespace behind its one
link (and under ``--launch mpi`` rank 0, mpigrad's scheduler, an extra rank in node 0, as
``mpigrad train`` places it).

Two ways (``--launch``):

``mpi``   one ``mpiexec`` whose rank r runs inside the namespace of its node
          (``mpiexec -n 1 ip netns exec NAME-0 CMD : -n 1 ip netns exec NAME-1 CMD ...``), with
          the variables that make MPICH talk TCP over the lab's interface
          (:data:`MPICH_VARIABLES`; with nodes of several ranks :data:`MPICH_NETMOD`, and
          hydra told the nodes as hosts, so that the ranks of one node share memory:
          :func:`mpi_plan`). Open MPI is refused: its ranks fail MPI_Init across the lab's
          namespaces here (docs/lab.rst).
``each``  the command started once per rank inside its node, told its place by environment
          variables (:func:`rank_environment`): torch DDP over gloo and other peers run as is.

Either way each process gets :func:`rank_environment`. The command runs in a session of its
own, so that :meth:`CommandRun.stop` ends all of it (mpiexec, its proxies, the ranks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from ..errors import UsageError
from ..mpiexec import find_mpiexec, mpiexec_flavour
from .host import in_namespace
from .netns import IFACE, Topology

#: MPICH (ch4) between nodes: TCP through libfabric on the lab's interface.
MPICH_NETMOD = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": IFACE}
#: MPICH with one rank per node: no shared memory between ranks at all (one hydra proxy
#: starts every rank, so MPICH would take them all for one node and bypass the links).
MPICH_VARIABLES = {"MPIR_CVAR_NOLOCAL": "1", **MPICH_NETMOD}
MASTER_PORT = "29500"


@dataclass(frozen=True)
class Placement:
    """Which rank runs in which node: the lab's one rule (docs/lab.rst, "Nodes of several ranks").

    ``ranks_per_node`` None (``--nodes N`` alone, and the rate check): one rank per node,
    rank I in node I, N ranks. L with ``scheduler`` (``--launch mpi``): rank 0, mpigrad's
    scheduler, is an extra rank in node 0, then L ranks to a node in rank order: node 0
    holds ranks 0..L, node k > 0 ranks kL+1..kL+L, N L + 1 ranks (what
    ``runtime.plan.topology.Topology.rank_nodes`` says of a colocated run: worker w, rank
    w + 1, on node w // L). L without it (``--launch each``: DDP peers have no rank 0 of
    their own): node k holds ranks kL..kL+L-1, N L ranks."""

    nodes: int
    ranks_per_node: int | None = None
    scheduler: bool = True

    def __post_init__(self):
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise UsageError(f"--ranks-per-node {self.ranks_per_node}: give a whole number L >= 1 of ranks per node")

    @classmethod
    def of(cls, launch: str, nodes: int, ranks_per_node: int | None = None) -> "Placement":
        """The placement of ``--launch mpi|each`` (rank 0 extra under ``mpi`` only)."""
        return cls(nodes, ranks_per_node, scheduler=launch == "mpi")

    @property
    def rank_nodes(self) -> list[int]:
        """The node of every rank, in rank order."""
        if self.ranks_per_node is None:
            return list(range(self.nodes))
        L = self.ranks_per_node
        return [0] * int(self.scheduler) + [w // L for w in range(self.nodes * L)]

    @property
    def ranks(self) -> int:
        return len(self.rank_nodes)

    def node_ranks(self, node: int) -> list[int]:
        """The ranks in ``node``, in rank order."""
        return [rank for rank, at in enumerate(self.rank_nodes) if at == node]

    def local_rank(self, rank: int) -> int:
        """``rank``'s place among the ranks of its node (0 for the first)."""
        return self.node_ranks(self.rank_nodes[rank]).index(rank)

    def describe(self) -> str:
        """'node 0: ranks 0-2; node 1: ranks 3-4' (the first 8 nodes)."""
        def span(ranks):
            return f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"
        listed = "; ".join(f"node {k}: {span(self.node_ranks(k))}" for k in range(min(self.nodes, 8)))
        return listed + (f"; ... {self.nodes - 8} more" if self.nodes > 8 else "")


def rank_environment(topology: Topology, placement: Placement, rank: int) -> dict[str, str]:
    """What rank ``rank`` is told: its node's address, node 0's, the interface, and the
    variables torch.distributed reads (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    GLOO_SOCKET_IFNAME); with ``--ranks-per-node`` also MPIGRAD_LAB_RANKS_PER_NODE and
    torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE (its place among its node's ranks, and their
    number: L + 1 in node 0 under ``--launch mpi``). MASTER_PORT keeps a value already set."""
    index = placement.rank_nodes[rank]
    node, first = topology.node(index), topology.node(0)
    env = {"MPIGRAD_LAB_NODE": str(index), "MPIGRAD_LAB_NODES": str(topology.nodes),
           "MPIGRAD_LAB_ADDR": node.address, "MPIGRAD_LAB_MASTER": first.address, "MPIGRAD_LAB_IFACE": IFACE,
           "RANK": str(rank), "WORLD_SIZE": str(placement.ranks), "MASTER_ADDR": first.address,
           "MASTER_PORT": os.environ.get("MASTER_PORT", MASTER_PORT), "GLOO_SOCKET_IFNAME": IFACE}
    if placement.ranks_per_node is not None:
        env.update(MPIGRAD_LAB_RANKS_PER_NODE=str(placement.ranks_per_node),
                   LOCAL_RANK=str(placement.local_rank(rank)), LOCAL_WORLD_SIZE=str(len(placement.node_ranks(index))))
    return env


#: mpigrad's MPI commands, which ``expand_command`` writes out and ``--launch each`` refuses.
MPI_COMMANDS = ("train", "doctor")


def expand_command(command: list[str], launch: str = "mpi") -> list[str]:
    """``train ...`` or ``doctor ...`` is short for ``python -m mpi4py -m mpigrad train ...``;
    under ``--launch each`` they are refused (each node would be a one-rank MPI world)."""
    if not command:
        raise UsageError("no command to run")
    if command[0] in MPI_COMMANDS:
        if launch != "mpi":
            raise UsageError(f"mpigrad {command[0]} needs one MPI world over the nodes: use --launch mpi")
        return [sys.executable, "-m", "mpi4py", "-m", "mpigrad", *command]
    return list(command)


#: train's option, and the shortest prefix argparse takes for it (``--ranks`` is another option).
RANKS_PER_NODE = "--ranks-per-node"
_RANKS_PER_NODE_PREFIX = "--ranks-"


def _train_at(command: list[str]) -> int | None:
    """The index of ``train`` in an mpigrad train command (``train ...``, ``python -m mpi4py
    -m mpigrad train ...``, ``.../mpigrad train ...``), None for any other command."""
    for i, word in enumerate(command):
        if word == "train" and (i == 0 or os.path.basename(command[i - 1]) == "mpigrad"):
            return i
    return None


def declared_ranks_per_node(arguments: list[str]) -> str | None:
    """The ``--ranks-per-node`` value train ``arguments`` give (the last, as argparse takes
    it; ``--ranks-per-node=L`` and argparse's prefixes down to ``--ranks-`` too), else None."""
    found = None
    for i, word in enumerate(arguments):
        name, eq, value = word.partition("=")
        if name.startswith(_RANKS_PER_NODE_PREFIX) and RANKS_PER_NODE.startswith(name):
            found = value if eq else (arguments[i + 1] if i + 1 < len(arguments) else None)
    return found


def pass_ranks_per_node(command: list[str], ranks_per_node: int | None) -> list[str]:
    """``command`` with ``--ranks-per-node L`` added right after ``train`` when it is an
    mpigrad train command (:func:`_train_at`) that declares none: the lab's L ranks per node
    become the run's nodes. Unchanged for ``ranks_per_node`` None (the lab's default, one
    rank per node), for any other command, and for a train command that declares the same L
    or ``auto`` (MPI's shared-memory split, which sees the lab's nodes); UsageError (one
    line) for one that declares another L. A config file's ``ranks_per_node`` is overridden
    by the option added."""
    at = _train_at(command) if ranks_per_node is not None else None
    if at is None:
        return list(command)
    declared = declared_ranks_per_node(command[at + 1:])
    if declared is None:
        return [*command[:at + 1], RANKS_PER_NODE, str(ranks_per_node), *command[at + 1:]]
    if declared.strip() == "auto" or (declared.strip().isdigit() and int(declared) == ranks_per_node):
        return list(command)
    raise UsageError(f"--ranks-per-node {ranks_per_node} puts {ranks_per_node} rank(s) in each node, and the train "
                     f"command declares --ranks-per-node {declared}: give both the same L, or drop train's (the lab "
                     "passes its own)")


def _in_node(topology: Topology, placement: Placement, rank: int, command: list[str]) -> list[str]:
    env = [f"{k}={v}" for k, v in rank_environment(topology, placement, rank).items()]
    return in_namespace(topology.node(placement.rank_nodes[rank]).namespace, ["env", *env, *command])


@dataclass(frozen=True)
class LaunchPlan:
    """The processes to start: each an argv, all with ``env``."""

    commands: list[list[str]]
    env: dict[str, str]


def _placement(topology: Topology, placement: Placement | None, launch: str) -> Placement:
    placement = placement or Placement.of(launch, topology.nodes)
    if placement.nodes != topology.nodes:
        raise ValueError(f"a placement on {placement.nodes} nodes for a lab of {topology.nodes}")
    return placement


def mpi_plan(topology: Topology, command: list[str], mpiexec: str | None = None,
             placement: Placement | None = None) -> LaunchPlan:
    """One ``mpiexec``, rank r in its node's namespace (``placement``, default one rank per
    node). One rank per node: :data:`MPICH_VARIABLES` (no shared memory at all). Nodes of
    several ranks: hydra gets the nodes as hosts (``-launcher fork -hosts NAME-0:L+1,
    NAME-1:L,...``: one proxy per node, each forked here and starting its node's ranks,
    which hydra's process mapping then tells MPICH are one node's: they share memory, and
    MPI's shared-memory split finds the lab's nodes) and :data:`MPICH_NETMOD` between them."""
    placement = _placement(topology, placement, "mpi")
    mpiexec = find_mpiexec(mpiexec)
    if mpiexec_flavour(mpiexec) == "Open MPI":
        raise UsageError(f"{mpiexec} is Open MPI's, whose ranks fail MPI_Init across the lab's namespaces "
                         "('PML add procs failed', docs/lab.rst): run the lab from a virtual environment "
                         "with the mpich wheel, or use --launch each")
    if placement.ranks_per_node is None:
        env, argv = {**os.environ, **MPICH_VARIABLES}, [mpiexec]
    else:
        hosts = ",".join(f"{node.namespace}:{len(placement.node_ranks(node.index))}" for node in topology.node_list)
        env, argv = {**os.environ, **MPICH_NETMOD}, [mpiexec, "-launcher", "fork", "-hosts", hosts]
    for rank in range(placement.ranks):
        argv += [*([":"] if rank else []), "-n", "1", *_in_node(topology, placement, rank, command)]
    return LaunchPlan([argv], env)


def each_plan(topology: Topology, command: list[str], placement: Placement | None = None) -> LaunchPlan:
    """The command once per rank of ``placement`` (default one rank per node), in its node."""
    placement = _placement(topology, placement, "each")
    return LaunchPlan([_in_node(topology, placement, rank, command) for rank in range(placement.ranks)],
                      dict(os.environ))


@dataclass(frozen=True)
class RunResult:
    """How the command ended: the first non-zero exit code (0 when all succeeded), its wall seconds."""

    returncode: int
    seconds: float


class CommandRun:
    """The started processes of a plan, each in a session of its own."""

    def __init__(self, plan: LaunchPlan):
        self.started = time.monotonic()
        self.processes = [subprocess.Popen(argv, env=plan.env, start_new_session=True) for argv in plan.commands]

    def wait(self) -> RunResult:
        """Wait for every process; when one fails, the others are stopped (they would wait for it)."""
        code = 0
        pending = list(self.processes)
        while pending:
            for proc in list(pending):
                if proc.poll() is not None:
                    pending.remove(proc)
                    if proc.returncode and not code:
                        code = proc.returncode if proc.returncode > 0 else 128 - proc.returncode
                        self.stop()
            time.sleep(0.05)
        return RunResult(code, time.monotonic() - self.started)

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM every process group, SIGKILL what is left after ``grace`` seconds, and
        wait (up to ``grace`` more) until the groups are empty."""
        if not self._signal(signal.SIGTERM):
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._signal(0):
            time.sleep(0.05)
        self._signal(signal.SIGKILL)
        for proc in self.processes:
            proc.wait()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._signal(0):
            time.sleep(0.05)

    def _signal(self, sig: int) -> bool:
        """Send ``sig`` to every process group; whether any group still had a process."""
        alive = False
        for proc in self.processes:
            try:
                os.killpg(proc.pid, sig)
                alive = True
            except (ProcessLookupError, PermissionError):
                pass
        return alive
