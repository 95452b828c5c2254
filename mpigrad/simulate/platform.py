"""The platform a simulation runs on, and where each rank sits on it.

Generated (:func:`generated`): one SimGrid ``<cluster>`` of hosts ``node-0``, ``node-1``, ...:
the workers' N nodes first, each a host of L cores (one per worker) whose private link is
its NIC (``bandwidth``, SPLITDUPLEX: each direction its own rate, as full duplex), behind a
non-blocking switch (no backbone: only the NICs are shared); inside a host the loopback
link (``intra_bandwidth``, ``intra_latency``; SimGrid makes it a fat pipe: every flow at the
full rate) carries what its workers send each other. A message between two hosts crosses
the sender's NIC up and the receiver's NIC down, each with half the ``latency``, so that it
pays ``latency`` once, as on mpigrad's clock. Separate servers (``--servers S``) get S more
hosts (``node-N`` ... ``node-(N+S-1)``), one NIC each, as the clock gives every server its
own link; with colocated servers rank 0, the scheduler, is an actor on node 0's host beside
its workers (``runtime/plan/topology.py``: rank 0 on node 0).

A file (:func:`from_file`, ``--platform FILE.xml``: SimGrid's own format): its hosts in
natural order of their names (``node-2`` before ``node-10``) take the places of the
generated ones: the first N hold the workers' nodes, L consecutive workers each (rank 0 on
the first), the next S the separate servers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..units import format_duration, format_rate
from .engine import natural_key  # noqa: F401  (the hosts' order, the engine's rule)

__all__ = ["Platform", "Placement", "generated", "from_file", "natural_key"]


@dataclass(frozen=True)
class Platform:
    """Hosts for ``nodes`` worker nodes of ``ranks_per_node`` and ``server_hosts`` separate
    servers. ``file``: a platform of the user's (its links are its own: ``bandwidth`` and the
    rest are then None), else the generated cluster's NIC ``bandwidth`` (bytes/s),
    ``latency`` (s per message), ``intra_bandwidth`` and ``intra_latency``."""

    nodes: int
    ranks_per_node: int
    server_hosts: int = 0
    bandwidth: float | None = None
    latency: float | None = None
    intra_bandwidth: float | None = None
    intra_latency: float | None = None
    file: str | None = None

    @property
    def hosts(self) -> int:
        return self.nodes + self.server_hosts

    @property
    def generated(self) -> bool:
        return self.file is None

    def xml(self) -> str:
        """The generated cluster in SimGrid's XML (platform version 4.1)."""
        if not self.generated:
            raise ValueError("a platform file's XML is the file")
        return ("<?xml version='1.0'?>\n"
                "<!DOCTYPE platform SYSTEM \"https://simgrid.org/simgrid.dtd\">\n"
                "<platform version=\"4.1\">\n"
                f"  <cluster id=\"mpigrad\" prefix=\"node-\" suffix=\"\" radical=\"0-{self.hosts - 1}\" speed=\"1Gf\" "
                f"core=\"{self.ranks_per_node}\" bw=\"{_bps(self.bandwidth)}\" lat=\"{_seconds(self.latency / 2)}\" "
                f"sharing_policy=\"SPLITDUPLEX\" loopback_bw=\"{_bps(self.intra_bandwidth)}\" "
                f"loopback_lat=\"{_seconds(self.intra_latency)}\"/>\n"
                "</platform>\n")

    def write(self, folder: Path) -> str:
        """The platform file to load: the user's, or the generated XML written into ``folder``."""
        if not self.generated:
            return self.file
        path = Path(folder) / "platform.xml"
        path.write_text(self.xml())
        return str(path)

    def describe(self, colocated: bool) -> str:
        """One line: the nodes, where rank 0 sits, the links."""
        workers = self.nodes * self.ranks_per_node
        shape = (f"{self.nodes} node(s) of {self.ranks_per_node} worker(s) ({workers} workers)"
                 if self.ranks_per_node > 1 else f"{self.nodes} node(s) of one worker")
        where = ("rank 0 on node 0 beside its workers" if colocated else
                 f"{self.server_hosts} server host(s) of their own, rank 0 the first")
        if not self.generated:
            return f"{shape}, {where}, on the hosts of {self.file}"
        inside = (f"; inside a node {format_rate(self.intra_bandwidth)}, {format_duration(self.intra_latency)}"
                  if self.ranks_per_node > 1 else "")
        return (f"{shape}, {where}; NICs of {format_rate(self.bandwidth)}, latency "
                f"{format_duration(self.latency)}, full duplex{inside}")

    def record(self) -> dict:
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "server_hosts": self.server_hosts,
                "bandwidth": self.bandwidth, "latency": self.latency, "intra_bandwidth": self.intra_bandwidth,
                "intra_latency": self.intra_latency, "file": self.file}


def _bps(rate: float) -> str:
    return f"{rate!r}Bps"


def _seconds(seconds: float) -> str:
    return f"{seconds!r}s"


def generated(nodes: int, ranks_per_node: int, server_hosts: int, bandwidth: float, latency: float,
              intra_bandwidth: float, intra_latency: float) -> Platform:
    """The generated cluster; UsageError (one line, naming the option) for values it cannot take."""
    _check_shape(nodes, ranks_per_node)
    for value, option in ((bandwidth, "--bandwidth"), (intra_bandwidth, "--intra-bandwidth")):
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"{option} must be a positive rate, got {value!r} bytes/s")
    for value, option in ((latency, "--latency"), (intra_latency, "--intra-latency")):
        if not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"{option} must be a duration >= 0, got {value!r} s")
    return Platform(nodes, ranks_per_node, server_hosts, float(bandwidth), float(latency), float(intra_bandwidth),
                    float(intra_latency))


def from_file(path: str, nodes: int, ranks_per_node: int, server_hosts: int) -> Platform:
    """A platform of the user's (SimGrid checks it when the simulation loads it)."""
    _check_shape(nodes, ranks_per_node)
    if not Path(path).is_file():
        raise UsageError(f"--platform {path}: no such file")
    return Platform(nodes, ranks_per_node, server_hosts, file=str(Path(path).resolve()))


def _check_shape(nodes: int, ranks_per_node: int) -> None:
    if nodes < 1:
        raise UsageError(f"--nodes must be at least 1, got {nodes}")
    if ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node must be at least 1, got {ranks_per_node}")


@dataclass(frozen=True)
class Placement:
    """Where mpigrad's ranks sit: ``host[rank]`` (an index into the platform's hosts) and
    ``node[rank]``; ranks are mpigrad's (``clockmodel._ranks``): colocated, rank 0 then
    worker w at rank w + 1; else servers 0..S-1, then worker w at rank S + w."""

    host: tuple[int, ...]

    @classmethod
    def of(cls, platform: Platform, workers: int, servers: int, colocated: bool) -> "Placement":
        L = platform.ranks_per_node
        if workers != platform.nodes * L:
            raise UsageError(f"{workers} workers do not fill {platform.nodes} node(s) of {L}")
        if colocated:
            return cls((0, *(w // L for w in range(workers))))
        return cls((*(platform.nodes + s for s in range(servers)), *(w // L for w in range(workers))))

    @classmethod
    def workers_only(cls, platform: Platform) -> "Placement":
        """A peer's ranks (DDP: P ranks, no scheduler): rank r is worker r, in node order."""
        L = platform.ranks_per_node
        return cls(tuple(w // L for w in range(platform.nodes * L)))
