"""The lab's network: N node namespaces on a bridge, built and torn down as one unit.

Layout of lab NAME with N nodes (nothing is created in the host's own namespace)::

    namespace NAME-hub   bridge br0, and v0 .. v{N-1}: the hub's end of each node's veth
    namespace NAME-I     lab0: node I's end, address SUBNET.I+1/PREFIX, and lo

Every name the lab makes starts with its ``NAME-`` prefix. The bridge's alias records the
owner process (``mpigrad-lab pid=PID start=TICKS``): a lab of the same name whose owner is
gone is stale and is removed before a new one is built; one whose owner still runs is
refused, and so are namespaces of the lab's names that record no owner (they may be someone
else's).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import time
from dataclasses import dataclass, field

from ..errors import UsageError
from .host import LabError, run

IFACE = "lab0"
BRIDGE = "br0"
#: The largest packet (a GSO super-packet) the stack hands a lab link. tbf can never send a
#: queued packet larger than its bucket, and a rate change keeps the queue: at 100 MB/s a
#: 64 KB super-packet queues, at 10 MB/s the bucket is 20 KB, and the link carried nothing
#: until the rate rose again (a 4 MB message stalled for the 20 s of a drop). Every packet
#: under the smallest bucket (lab.shaping's 16 KiB, with the headers of its segments) cannot.
GSO_MAX_SIZE = 15000
_NAME = re.compile(r"[a-z][a-z0-9]{0,11}")
_OWNER = re.compile(r"mpigrad-lab pid=(\d+) start=(\d+)")


@dataclass(frozen=True)
class Node:
    """One node: its namespace, the hub's end of its veth, its address."""

    index: int
    namespace: str
    hub_port: str
    address: str


@dataclass(frozen=True)
class Topology:
    """Names and addresses of lab ``name`` with ``nodes`` nodes on ``subnet``; builds nothing."""

    name: str
    nodes: int
    subnet: str = "10.77.0.0/24"

    def __post_init__(self):
        if not _NAME.fullmatch(self.name):
            raise UsageError(f"lab name {self.name!r}: use 1-12 lower-case letters and digits, starting "
                             "with a letter")
        if self.nodes < 2:
            raise UsageError(f"a lab needs at least 2 nodes, got {self.nodes}")
        try:
            network = ipaddress.ip_network(self.subnet)
        except ValueError as exc:
            raise UsageError(f"--subnet {self.subnet!r}: {exc}") from None
        if network.version != 4 or network.num_addresses - 2 < self.nodes:
            raise UsageError(f"--subnet {self.subnet} has no room for {self.nodes} IPv4 node addresses")

    @property
    def hub(self) -> str:
        return f"{self.name}-hub"

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(self.subnet)

    @property
    def node_list(self) -> list[Node]:
        hosts = self.network.hosts()
        return [Node(i, f"{self.name}-{i}", f"v{i}", str(next(hosts))) for i in range(self.nodes)]

    def node(self, index: int) -> Node:
        if not 0 <= index < self.nodes:
            raise UsageError(f"node {index} is not in this lab of {self.nodes} nodes (0..{self.nodes - 1})")
        return self.node_list[index]

    def owns(self, namespace: str) -> bool:
        """Whether a namespace name is one this lab's name makes."""
        return namespace == self.hub or re.fullmatch(rf"{re.escape(self.name)}-\d+", namespace) is not None


@dataclass(frozen=True)
class Traffic:
    """Bytes a node's interfaces counted (frames, headers included): ``sent`` and
    ``received`` on its link (``lab0``, what tbf shapes), ``loopback`` on its ``lo`` (TCP
    between its own processes, e.g. gloo peers of one node; MPICH's shared memory shows on
    neither)."""

    sent: int
    received: int
    loopback: int

    def __sub__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.sent - other.sent, self.received - other.received, self.loopback - other.loopback)


def traffic(node: Node) -> Traffic:
    """What ``node``'s interfaces have counted since the lab was built (``ip -s link``)."""
    done = run(["ip", "-n", node.namespace, "-j", "-s", "link", "show"])
    try:
        stats = {link["ifname"]: link["stats64"] for link in json.loads(done.stdout)}
        return Traffic(stats[IFACE]["tx"]["bytes"], stats[IFACE]["rx"]["bytes"], stats["lo"]["tx"]["bytes"])
    except (ValueError, KeyError, TypeError):
        raise LabError(f"ip -s link in {node.namespace} gave no byte counters for {IFACE} and lo") from None


def owner_alias(pid: int) -> str:
    """The bridge alias that records lab owner ``pid`` (with its start time: pids are reused)."""
    stat = _stat(pid)
    return f"mpigrad-lab pid={pid} start={stat[1] if stat else 0}"


def namespaces() -> list[str]:
    """Every network namespace on the host, by name."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    done = run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of a process, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])


def _alive(pid: int, start: int | None = None) -> bool:
    """Whether ``pid`` runs (a zombie does not), and is the process that started at ``start``."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and (start is None or stat[1] == start)


@dataclass
class Teardown:
    """What a teardown removed: namespaces and the processes it had to end in them."""

    namespaces: list[str] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)


class Lab:
    """A built lab. ``build`` makes it (removing a stale one of the same name first);
    ``teardown`` removes every namespace it made (and with them every link and qdisc),
    ending what still runs inside them first. Safe to call ``teardown`` more than once,
    and after a build that failed half-way."""

    def __init__(self, topology: Topology, log=print):
        self.topology = topology
        self.log = log
        self.made: list[str] = []

    # ---- build ------------------------------------------------------------------------------
    def build(self) -> "Lab":
        self._clear_stale()
        t = self.topology
        self._add_namespace(t.hub)
        hub = ["ip", "-n", t.hub]
        run([*hub, "link", "add", BRIDGE, "type", "bridge"])
        run([*hub, "link", "set", BRIDGE, "alias", owner_alias(os.getpid())])
        run([*hub, "link", "set", BRIDGE, "up"])
        prefix = t.network.prefixlen
        for node in t.node_list:
            self._add_namespace(node.namespace)
            run([*hub, "link", "add", node.hub_port, "type", "veth", "peer", "name", IFACE, "netns", node.namespace])
            run([*hub, "link", "set", node.hub_port, "master", BRIDGE, "gso_max_size", str(GSO_MAX_SIZE)])
            run([*hub, "link", "set", node.hub_port, "up"])
            inside = ["ip", "-n", node.namespace]
            run([*inside, "addr", "add", f"{node.address}/{prefix}", "dev", IFACE])
            run([*inside, "link", "set", IFACE, "gso_max_size", str(GSO_MAX_SIZE), "up"])
            run([*inside, "link", "set", "lo", "up"])
        return self

    def _add_namespace(self, namespace: str) -> None:
        run(["ip", "netns", "add", namespace])
        self.made.append(namespace)

    def _clear_stale(self) -> None:
        """Remove a lab of this name whose owner is gone; UsageError if its owner still runs."""
        t = self.topology
        found = [ns for ns in namespaces() if t.owns(ns)]
        if not found:
            return
        owner = self._owner() if t.hub in found else None
        if owner is None:
            raise UsageError(f"namespaces {', '.join(sorted(found))} exist but are no mpigrad lab's (no owner "
                             f"recorded in {t.hub}): remove them (ip netns delete NAME) or pick another --name")
        pid, start = owner
        if pid != os.getpid() and _alive(pid, start):
            raise UsageError(f"a lab named {t.name!r} is in use by process {pid} (namespaces "
                             f"{', '.join(sorted(found))}): pick another --name")
        self.log(f"lab: removing a stale lab {t.name!r} (its process {pid} is gone): {', '.join(sorted(found))}")
        remove_namespaces(found)

    def _owner(self) -> tuple[int, int] | None:
        """(pid, start time) recorded in the hub's bridge alias, None when there is none."""
        done = run(["ip", "-n", self.topology.hub, "-j", "link", "show", BRIDGE], check=False)
        try:
            alias = json.loads(done.stdout)[0].get("ifalias", "")
        except (ValueError, IndexError, AttributeError):
            return None
        match = _OWNER.fullmatch(alias or "")
        return (int(match.group(1)), int(match.group(2))) if match else None

    # ---- teardown -----------------------------------------------------------------------------
    def teardown(self) -> Teardown:
        made, self.made = self.made, []
        return remove_namespaces(made)

    def __enter__(self) -> "Lab":
        return self.build()

    def __exit__(self, *exc) -> None:
        self.teardown()


def remove_namespaces(names: list[str], grace: float = 3.0, settle: float = 1.0) -> Teardown:
    """End the processes inside ``names`` (after ``settle`` s for those already on their way
    out, e.g. ranks MPI_Abort is killing: SIGTERM, then SIGKILL after ``grace`` s), then
    delete the namespaces: their interfaces, bridge and qdiscs go with them."""
    result = Teardown()
    pids = sorted({pid for ns in names for pid in namespace_pids(ns)})
    deadline = time.monotonic() + settle
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.05)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    result.killed = pids
    errors = []
    for ns in names:
        try:
            run(["ip", "netns", "delete", ns])
            result.namespaces.append(ns)
        except LabError as exc:
            if ns in namespaces():
                errors.append(str(exc))
    if errors:
        raise LabError("; ".join(errors))
    return result


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
