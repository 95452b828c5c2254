"""Link shaping: each node's link limited in both directions by tbf, link events (a new
rate, down, up) applied at given times during a run, and rate schedules (the schedules of
``mpigrad train --bandwidth``, :mod:`mpigrad.clockmodel`) followed on the real clock.

Node I's link is two queues: tbf on ``lab0`` inside the node (what it sends) and tbf on
``vI`` in the hub (what it receives). "down" takes the hub's end down: the node's frames
are dropped on the wire, its sockets see nothing but silence (as when a cable is pulled).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

from ..errors import UsageError
from ..units import format_duration, format_rate, parse_duration, parse_rate
from .host import LabError, run
from .netns import GSO_MAX_SIZE, IFACE, Topology

#: tbf's queue: packets wait at most this long before tbf drops them.
_QUEUE_LATENCY = "400ms"
#: The bucket: what passes at line speed after the link idled. A real link has none, so keep
#: it small: 2 ms of the rate (at least 16 KiB). With the kernel's high-resolution timers tbf
#: still carries the rate (payload 4-5 % under it, the TCP/IP headers, at 4, 10 and 100 MB/s);
#: the 10 ms bucket used before let 1 MB through in 1.1 ms after an idle gap at 100 MB/s, and
#: every small exchange ran faster than the link (docs/lab.rst).
_MIN_BURST = 16 * 1024
_BURST_SECONDS = 0.002
# A queued packet larger than the bucket never leaves (netns.GSO_MAX_SIZE); ~11 segments' headers.
assert GSO_MAX_SIZE + 11 * 100 <= _MIN_BURST


def tbf_burst(rate: float) -> int:
    """The bucket's size in bytes for ``rate`` bytes/s: what passes at line speed after idling."""
    return max(_MIN_BURST, int(rate * _BURST_SECONDS))


def tbf_arguments(rate: float) -> list[str]:
    """tc arguments for a tbf of ``rate`` bytes/s."""
    return ["tbf", "rate", f"{round(rate * 8)}bit", "burst", str(tbf_burst(rate)), "latency", _QUEUE_LATENCY]


def netem_arguments(latency: float) -> list[str]:
    return ["netem", "delay", f"{latency * 1e6:.0f}us"]


class Links:
    """The links of a built lab. ``rates[i]`` is node i's configured rate (bytes/s)."""

    def __init__(self, topology: Topology, latency: float = 0.0):
        self.topology = topology
        self.latency = latency
        self.rates: dict[int, float] = {}
        self.down: set[int] = set()

    def _ends(self, index: int) -> list[list[str]]:
        node = self.topology.node(index)
        return [["-n", node.namespace, "qdisc", "replace", "dev", IFACE],
                ["-n", self.topology.hub, "qdisc", "replace", "dev", node.hub_port]]

    def set_rate(self, index: int, rate: float) -> None:
        """Limit node ``index``'s link to ``rate`` bytes/s in both directions (with netem's delay
        under it when ``latency`` is set)."""
        for end in self._ends(index):
            if self.latency:
                run(["tc", *end, "root", "handle", "1:", *netem_arguments(self.latency)])
                run(["tc", *end, "parent", "1:1", "handle", "2:", *tbf_arguments(rate)])
            else:
                run(["tc", *end, "root", *tbf_arguments(rate)])
        self.rates[index] = rate

    def set_down(self, index: int, down: bool) -> None:
        node = self.topology.node(index)
        run(["ip", "-n", self.topology.hub, "link", "set", node.hub_port, "down" if down else "up"])
        (self.down.add if down else self.down.discard)(index)

    def path_rate(self, sender: int, receiver: int) -> float:
        """What a transfer from ``sender`` to ``receiver`` should carry: the slower link's rate."""
        return min(self.rates[sender], self.rates[receiver])


# ---- link events ----------------------------------------------------------------------------
_EVENT = re.compile(r"(?P<at>[^:]+):(?:node)?(?P<node>\d+):(?P<action>down|up|rate=(?P<rate>.+))")


@dataclass(frozen=True)
class LinkEvent:
    """At ``at`` seconds after the command starts: node ``node``'s link goes down, up, or to
    ``rate`` bytes/s."""

    at: float
    node: int
    action: str
    rate: float | None = None

    @classmethod
    def parse(cls, text: str) -> "LinkEvent":
        """``5s:node2:down``, ``13s:node2:up``, ``3s:node1:rate=1MB/s`` (``node`` optional)."""
        match = _EVENT.fullmatch(text.strip())
        if not match:
            raise UsageError(f"--event {text!r}: use TIME:nodeI:down, TIME:nodeI:up or TIME:nodeI:rate=RATE, "
                             "e.g. 5s:node2:down")
        at = parse_duration(match["at"])
        if at < 0:
            raise UsageError(f"--event {text!r}: the time must be >= 0")
        rate = parse_rate(match["rate"]) if match["rate"] else None
        return cls(at, int(match["node"]), "rate" if rate is not None else match["action"], rate)

    def text(self) -> str:
        """The event as ``--event`` takes it, normalised: '12s:node2:down', '3s:node1:rate=1MB/s'."""
        action = f"rate={format_rate(self.rate, bits=False)}" if self.action == "rate" else self.action
        return f"{format_duration(self.at)}:node{self.node}:{action}"

    def describe(self) -> str:
        what = {"down": "link down", "up": "link up"}.get(self.action) or f"rate {self.rate / 1e6:g} MB/s"
        return f"node {self.node} {what}"

    def apply(self, links: Links) -> None:
        if self.action == "rate":
            links.set_rate(self.node, self.rate)
        else:
            links.set_down(self.node, self.action == "down")


class EventSchedule:
    """Applies link events in time order from a background thread, from ``start()`` on;
    ``stop()`` ends it. Each event applied, failed or dropped (not yet due at ``stop()``) is
    logged; ``applied`` holds (seconds after start, event), ``errors`` the failures' text."""

    def __init__(self, links: Links, events: list[LinkEvent], log=print):
        self.links = links
        self.events = sorted(events, key=lambda e: e.at)
        self.log = log
        self.applied: list[tuple[float, LinkEvent]] = []
        self.errors: list[str] = []
        self._next = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lab-events", daemon=True)

    def start(self) -> "EventSchedule":
        self.started = time.monotonic()
        if self.events:
            self._thread.start()
        return self

    def _run(self) -> None:
        for event in self.events:
            if self._stop.wait(max(0.0, self.started + event.at - time.monotonic())):
                return
            self._next += 1
            try:
                event.apply(self.links)
            except LabError as exc:
                self.errors.append(str(exc))
                self.log(f"lab: event {event.describe()} failed: {exc}")
                continue
            elapsed = time.monotonic() - self.started
            self.applied.append((elapsed, event))
            self.log(f"lab: {elapsed:.1f} s: {event.describe()}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for event in self.events[self._next:]:
            self.log(f"lab: event at {event.at:g} s ({event.describe()}) dropped: the command ended first")


# ---- rate schedules ---------------------------------------------------------------------------
class RateSchedules:
    """Follows each node's rate schedule (a :mod:`mpigrad.clockmodel` schedule of bytes/s:
    ``Steps``, ``Markov``) on the real clock from ``start()``, seconds after it as the
    schedule's own: at each change a ``tc qdisc replace`` of the node's two ends (what
    ``Links.set_rate`` does), from a background thread; ``stop()`` ends it. ``applied`` holds
    (seconds after start, node, rate) of each change made, ``errors`` the failures' text.
    A schedule with no change (``Constant``) is only the rate set when the lab is built."""

    def __init__(self, links: Links, schedules: dict, log=print):
        self.links = links
        self.schedules = {node: s for node, s in schedules.items() if not s.constant}
        self.log = log
        self.applied: list[tuple[float, int, float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lab-rate-schedules", daemon=True)

    def start(self) -> "RateSchedules":
        self.started = time.monotonic()
        if self.schedules:
            self._thread.start()
        return self

    def _run(self) -> None:
        t = 0.0
        while True:
            t = min(s.next_change(t) for s in self.schedules.values())
            if t == float("inf") or self._stop.wait(max(0.0, self.started + t - time.monotonic())):
                return
            for node, schedule in self.schedules.items():
                rate = schedule.at(t)
                if rate == self.links.rates.get(node):
                    continue
                try:
                    self.links.set_rate(node, rate)
                except LabError as exc:
                    self.errors.append(str(exc))
                    self.log(f"lab: schedule: node {node} rate {rate / 1e6:g} MB/s failed: {exc}")
                    continue
                elapsed = time.monotonic() - self.started
                self.applied.append((elapsed, node, rate))
                self.log(f"lab: {elapsed:.1f} s: node {node} rate {rate / 1e6:g} MB/s (schedule: {t:g} s)")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
