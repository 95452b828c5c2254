"""Running a command in the lab, one process per node.

Two ways (``--launch``):

``mpi``   one ``mpiexec`` whose rank I runs inside node I's namespace
          (``mpiexec -n 1 ip netns exec NAME-0 CMD : -n 1 ip netns exec NAME-1 CMD ...``), with
          the variables that make MPICH talk TCP over the lab's interface
          (:data:`MPICH_VARIABLES`). Open MPI is refused: its ranks fail MPI_Init across the
          lab's namespaces here (docs/lab.rst).
``each``  the command started once inside every node, told its place by environment
          variables (:func:`node_environment`): torch DDP over gloo and other peers run as is.

Either way each process gets :func:`node_environment`. The command runs in a session of its
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

#: MPICH (ch4): no shared memory between ranks, TCP through libfabric on the lab's interface.
MPICH_VARIABLES = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
                   "FI_TCP_IFACE": IFACE}
MASTER_PORT = "29500"


def node_environment(topology: Topology, index: int) -> dict[str, str]:
    """What a process on node ``index`` is told: its address, node 0's, the interface, and
    the variables torch.distributed reads (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    GLOO_SOCKET_IFNAME). MASTER_PORT keeps a value already set."""
    node, first = topology.node(index), topology.node(0)
    return {"MPIGRAD_LAB_NODE": str(index), "MPIGRAD_LAB_NODES": str(topology.nodes),
            "MPIGRAD_LAB_ADDR": node.address, "MPIGRAD_LAB_MASTER": first.address, "MPIGRAD_LAB_IFACE": IFACE,
            "RANK": str(index), "WORLD_SIZE": str(topology.nodes), "MASTER_ADDR": first.address,
            "MASTER_PORT": os.environ.get("MASTER_PORT", MASTER_PORT), "GLOO_SOCKET_IFNAME": IFACE}


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


def _in_node(topology: Topology, index: int, command: list[str]) -> list[str]:
    env = [f"{k}={v}" for k, v in node_environment(topology, index).items()]
    return in_namespace(topology.node(index).namespace, ["env", *env, *command])


@dataclass(frozen=True)
class LaunchPlan:
    """The processes to start: each an argv, all with ``env``."""

    commands: list[list[str]]
    env: dict[str, str]


def mpi_plan(topology: Topology, command: list[str], mpiexec: str | None = None) -> LaunchPlan:
    mpiexec = find_mpiexec(mpiexec)
    if mpiexec_flavour(mpiexec) == "Open MPI":
        raise UsageError(f"{mpiexec} is Open MPI's, whose ranks fail MPI_Init across the lab's namespaces "
                         "('PML add procs failed', docs/lab.rst): run the lab from a virtual environment "
                         "with the mpich wheel, or use --launch each")
    env = {**os.environ, **MPICH_VARIABLES}
    argv = [mpiexec]
    for i in range(topology.nodes):
        argv += [*([":"] if i else []), "-n", "1", *_in_node(topology, i, command)]
    return LaunchPlan([argv], env)


def each_plan(topology: Topology, command: list[str]) -> LaunchPlan:
    return LaunchPlan([_in_node(topology, i, command) for i in range(topology.nodes)], dict(os.environ))


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
