"""The rate check before a run: one short transfer per link, payload rate carried against
the rate configured.

Transfers go round the ring, node I to node I+1 (mod N), one at a time: together they pass
every node's link in both directions (I's sending queue, I+1's receiving queue). A transfer
carries the slower of its two links; it is ``faithful`` within 10 % of that. Two probes:
``mpi`` (:mod:`.mpiprobe`: MPI messages under the lab's mpiexec, what a run's ranks see) and
``tcp`` (:mod:`.probe`: one plain socket per pair, no MPI needed). Both count payload only:
a link of R bytes/s on the wire carries about 0.956 R of TCP payload (1448 of every 1514
bytes of a full frame).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from .host import LabError, in_namespace
from .launch import mpi_plan
from .netns import Topology
from .shaping import Links, tbf_burst

#: How far a carried rate may be off the configured one before the lab warns.
TOLERANCE = 0.10
#: The highest rate at which this kind of machine (2 cores, loaded) carried MPI payload within TOLERANCE
#: (docs/lab.rst, "Measured rates").
FAITHFUL_UP_TO = 300e6
_PORT = 47011
_SECONDS = 0.6
_MIN_BYTES = 256 * 1024


@dataclass(frozen=True)
class LinkCheck:
    """One transfer: ``carried`` payload bytes/s against ``configured`` (both bytes/s)."""

    sender: int
    receiver: int
    configured: float
    carried: float
    payload: int

    @property
    def deviation(self) -> float:
        """(carried - configured) / configured: -0.25 is a 25 % shortfall."""
        return self.carried / self.configured - 1.0

    @property
    def faithful(self) -> bool:
        return abs(self.deviation) <= TOLERANCE

    def describe(self) -> str:
        line = (f"node {self.sender} -> node {self.receiver}: carried {self.carried / 1e6:.2f} MB/s of "
                f"{self.configured / 1e6:.2f} MB/s configured ({self.deviation:+.1%}, "
                f"{self.payload / 1e6:.1f} MB)")
        if not self.faithful:
            short = "short by" if self.deviation < 0 else "over by"
            line += f"  WARNING: {short} {abs(self.deviation):.0%}, outside {TOLERANCE:.0%}"
        return line


def check_link(topology: Topology, links: Links, sender: int, receiver: int, seconds: float = _SECONDS,
               timeout: float = 60.0) -> LinkCheck:
    """Time one transfer of about ``seconds`` at the configured rate from ``sender`` to ``receiver``."""
    configured = links.path_rate(sender, receiver)
    skip = 2 * tbf_burst(configured)  # both tbf buckets' bursts pass at line speed
    size = max(_MIN_BYTES, int(configured * seconds)) + skip
    to = topology.node(receiver)
    probe = [sys.executable, "-m", "mpigrad.lab.probe"]
    receiving = subprocess.Popen(in_namespace(to.namespace, [*probe, "recv", to.address, str(_PORT), str(skip)]),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if receiving.stdout.readline().strip() != "ready":
            raise LabError(f"rate check: the receiver in node {receiver} did not start: "
                           f"{receiving.stderr.read().strip()[-300:]}")
        sending = subprocess.run(
            in_namespace(topology.node(sender).namespace, [*probe, "send", to.address, str(_PORT), str(size)]),
            capture_output=True, text=True, timeout=timeout)
        if sending.returncode:
            last = (sending.stderr.strip().splitlines() or [f"exit {sending.returncode}"])[-1]
            raise LabError(f"rate check: node {sender} could not send to node {receiver}: {last}")
        out, err = receiving.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LabError(f"rate check: node {sender} -> node {receiver} did not finish within {timeout:g} s") from None
    finally:
        if receiving.poll() is None:
            receiving.kill()
            receiving.wait()
    try:
        counted = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise LabError(f"rate check: the receiver in node {receiver} printed no result: {err.strip()[-300:]}") from None
    carried = counted["bytes"] / counted["seconds"] if counted["seconds"] > 0 else 0.0
    return LinkCheck(sender, receiver, configured, carried, counted["bytes"])


def check_links(topology: Topology, links: Links, probe: str = "mpi", log=print) -> list[LinkCheck]:
    """Check every link (the ring of transfers) with the ``mpi`` or ``tcp`` probe; log each result."""
    if probe == "mpi":
        checks = check_links_mpi(topology, links)
    else:
        checks = [check_link(topology, links, sender, (sender + 1) % topology.nodes)
                  for sender in range(topology.nodes)]
    for check in checks:
        log(f"lab: rate check ({probe}) {check.describe()}")
    return checks


_MPI_MESSAGES = 8


def check_links_mpi(topology: Topology, links: Links, seconds: float = _SECONDS,
                    timeout: float = 120.0) -> list[LinkCheck]:
    """The ring of transfers as MPI messages, all in one mpiexec of one rank per node."""
    plan = []
    for sender in range(topology.nodes):
        rate = links.path_rate(sender, (sender + 1) % topology.nodes)
        chunk = max(2 * tbf_burst(rate), int(rate * seconds / (_MPI_MESSAGES - 1)))
        plan.append(f"{chunk}:{_MPI_MESSAGES}")
    launch = mpi_plan(topology, [sys.executable, "-m", "mpigrad.lab.mpiprobe", ",".join(plan)])
    try:
        done = subprocess.run(launch.commands[0], env=launch.env, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise LabError(f"rate check: the MPI transfers did not finish within {timeout:g} s") from None
    found = [line for line in done.stdout.splitlines() if line.startswith("MPIPROBE ")]
    if done.returncode or not found:
        lines = [line for line in (done.stderr.strip() or done.stdout.strip()).splitlines()
                 if line.strip("- ")]                # not the dashes of Open MPI's framed notices
        tail = lines[-1:]
        raise LabError(f"rate check: mpiexec exited {done.returncode}: {' '.join(tail)}")
    return [LinkCheck(r["sender"], r["receiver"], links.path_rate(r["sender"], r["receiver"]),
                      r["bytes"] / r["seconds"] if r["seconds"] > 0 else 0.0, r["bytes"])
            for r in json.loads(found[0][len("MPIPROBE "):])]


def summary(checks: list[LinkCheck]) -> str:
    """The closing line of a rate check."""
    off = [c for c in checks if not c.faithful]
    limit = f"this kind of machine shaped faithfully up to {FAITHFUL_UP_TO / 1e6:g} MB/s when measured (docs/lab.rst)"
    if not off:
        return (f"lab: every link carried its rate within {TOLERANCE:.0%} (payload: about 4.4 % below the wire "
                f"rate is TCP/IP headers); {limit}")
    worst = min(off, key=lambda c: c.deviation if c.deviation < 0 else -c.deviation)
    return (f"lab: WARNING: {len(off)} of {len(checks)} transfers outside {TOLERANCE:.0%} of their rate (worst "
            f"{worst.deviation:+.0%}): a loaded machine or a rate beyond what it can shape; {limit}")
