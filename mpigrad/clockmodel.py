"""The clock model, in one place: what an iteration's messages and local work cost.

Network: every message costs ``latency + bytes / bandwidth``. A server's link is the
bottleneck of a parameter server: the P messages it receives in a round are serialised on
it, and a star broadcast sends one copy per receiver over it one after another. A
binomial-tree broadcast (``--broadcast tree``) takes ceil(log2(receivers + 1)) rounds of one
message each, the copies being forwarded by workers. ``--broadcast mpich`` is what the runtime's
``Ibcast`` does under MPICH with fewer than 8 ranks: a binomial tree whose every node sends to
all its children at once, so that they share its link and all have the message after as many
message times as it has children, then forward it in turn (5 ranks: 3 + 1 message times; 6
ranks: 3 + 1; 7: 3 + 2); colocated servers' shards, which the runtime sends point to point,
go as a star. With S servers each has its own link:
the gradient round takes as long as the slowest server's (its P frames of its shard), and so
does the broadcast round (server s > 0 also sends its shard to rank 0). Rank 0's loss
gather and its control broadcast (to the P workers and S - 1 other servers) are as with one
server; the servers' small reports to rank 0 are not charged.

Colocated servers (``--servers colocated``): worker w also serves shard w, and each node has
one link. A worker's frame to its own shard crosses no link; in the gradient round a node
receives the P - 1 other workers' frames of its shard and sends its P - 1 frames of the
others, each direction serialised on its link (full duplex: the round takes the slowest
direction of the slowest node); in the broadcast round a node sends its shard to the P - 1
others (star: one copy after another; tree: ceil(log2 P) rounds) while it receives the
P - 1 other shards, again the slower of the two. Rank 0 takes part in neither round; its
loss gather and Control broadcast (to the P workers) are as before.

Nodes of several workers (``--ranks-per-node L > 1``, colocated servers only): worker w sits
on node w // L (rank 0 beside node 0's workers; its loss gather and Control broadcast are
charged as above: a few bytes each). A node has one NIC of ``bandwidth``, full duplex, which
the node's concurrent flows share: in a round the node's NIC sends every byte its workers
send to other nodes and receives every byte they receive from them, and each worker pays
``latency`` per message it sends (or receives) across, one after another, while the bytes
share the NIC (a node's outbound side takes the most latency any of its workers pays plus
the node's outbound bytes over the rate; likewise inbound). Inside the node each worker has
a link of its own (``intra_bandwidth``, ``intra_latency``; full duplex, messages one after
another) that carries its messages to the node's other workers. A round takes the slowest
of every NIC's two sides and every worker's intra-node link's two sides, which run at once
(:class:`Nodes`). The flat colocated exchange's frames and shards go wherever their
receivers are; the hierarchical one (``IterationTraffic.hierarchical``) adds a
reduce-scatter and an all-gather of float slices inside the nodes (``Nodes.intra``), and its
frames and shards cross nodes only between the workers of one local rank; pipelined
(``LinkModel.pipelined_hierarchical``), each bucket's messages go one at a time on those
links and NICs as they are ready. With L = 1 none of this applies and every charge is the
per-link model's, to the last bit.

Local work runs in parallel across ranks, so a modelled iteration charges the slowest
worker's compute and encode, then the slowest server's decode/average/encode and rank 0's
policy time, or a fixed ``compute_time`` in place of the compute plus the cost model's
charge for the policy, encoding, decoding and averaging (:mod:`mpigrad.costmodel`) in place of the
rest (``iteration_seconds``).

Networks that change (``--bandwidth 10MB/s@0s,1GB/s@60s``, ``markov:...``,
``--link-bandwidth RANK=...``): a :class:`Network` of schedules on the simulated clock. A
message sent at simulated time t pays the latency in force at t, and its bytes at the rates
in force while they are sent, from t on (piecewise across a change); a message between two
ranks goes at the slower of their two links. An iteration's messages are charged in phase
order from the end of its compute (``comm_start``): the compute of the workers precedes the
loss gather, the codecs' and the policy's work (milliseconds) is added after. Without a
``Network`` (one constant rate and latency) nothing here looks at time, and the charges are
those of ``latency + bytes / bandwidth`` to the last bit.

The runtime (:mod:`mpigrad.runtime.measure.clock`) charges each phase as it happens and
``mpigrad trace retime`` re-charges a trace's recorded bytes: both through this module,
which imports neither MPI, torch nor Numba.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

__all__ = ["LinkModel", "Nodes", "NodeRound", "IterationTraffic", "PipelinedTraffic", "iteration_seconds", "comm_start", "Constant", "Steps", "Markov",
           "Network", "transfer_seconds"]


# ---- schedules: a value (a rate, a latency) as a step function of simulated time -------------
class Constant:
    """One value for ever."""

    constant = True

    def __init__(self, value: float):
        self.value = float(value)

    def at(self, t: float) -> float:
        return self.value

    def next_change(self, t: float) -> float:
        return math.inf

    def segment(self, t: float) -> tuple[float, float]:
        """(the value at t, the next change after t): ``at`` and ``next_change`` at once."""
        return self.value, math.inf

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class Steps:
    """``values[i]`` from ``times[i]`` on (``times[0] == 0``, increasing); with ``period``, the
    whole pattern starts over every ``period`` seconds (``period > times[-1]``)."""

    constant = False

    def __init__(self, times: Sequence[float], values: Sequence[float], period: float | None = None):
        self.times, self.values, self.period = tuple(map(float, times)), tuple(map(float, values)), period
        if not self.times or self.times[0] != 0.0 or len(self.times) != len(self.values):
            raise ValueError("a schedule needs one value per time, the first at 0")
        if any(b <= a for a, b in zip(self.times, self.times[1:])):
            raise ValueError("a schedule's times must increase")
        if period is not None and not (math.isfinite(period) and period > self.times[-1]):
            raise ValueError("a schedule's period must come after its last change")

    def _base(self, k: int) -> float:
        return k * self.period if k else 0.0

    def _find(self, t: float) -> tuple[int, int]:
        """(period k, step i) in force at t: the last change ``k * period + times[i] <= t``,
        computed as ``next_change`` computes change times, so the two agree to the last bit."""
        k = 0
        if self.period is not None and t >= self.period:
            k = math.floor(t / self.period)
            while self._base(k) > t:
                k -= 1
            while self._base(k + 1) <= t:
                k += 1
        base = self._base(k)
        i = max(0, bisect.bisect_right(self.times, t - base) - 1)
        while i + 1 < len(self.times) and base + self.times[i + 1] <= t:
            i += 1
        while i > 0 and base + self.times[i] > t:
            i -= 1
        return k, i

    def at(self, t: float) -> float:
        return self.values[self._find(t)[1]]

    def next_change(self, t: float) -> float:
        return self._next(t, *self._find(t))

    def segment(self, t: float) -> tuple[float, float]:
        k, i = self._find(t)
        return self.values[i], self._next(t, k, i)

    def _next(self, t: float, k: int, i: int) -> float:
        while True:  # the first change after t
            i += 1
            if i == len(self.times):
                if self.period is None:
                    return math.inf
                k, i = k + 1, 0
            change = self._base(k) + self.times[i]
            if change > t:
                return change

    def __repr__(self) -> str:
        return f"Steps({self.times!r}, {self.values!r}, period={self.period!r})"


class Markov:
    """A two-state Markov process: ``values[0]`` from time 0, then the other value, and so
    on, each state held for an exponentially distributed time of mean ``dwell[state]``. The
    change times are drawn from ``random.Random`` seeded by ``seed`` and ``stream`` (the
    run's seed and which schedule this is), one after another from time 0: the same process
    whatever order it is asked in, in every run and after a resume."""

    constant = False

    def __init__(self, values: Sequence[float], dwell: Sequence[float], seed: int, stream: str = "bandwidth"):
        self.values, self.dwell = tuple(map(float, values)), tuple(map(float, dwell))
        if len(self.values) != 2 or len(self.dwell) != 2:
            raise ValueError("a Markov schedule has two values and two mean dwell times")
        if not all(d > 0 and math.isfinite(d) for d in self.dwell):
            raise ValueError("mean dwell times must be positive")
        self.seed, self.stream = int(seed), stream
        self._rng = random.Random(f"mpigrad-network:{stream}:{self.seed}")
        self._changes = [0.0]   # the k-th change (k >= 1) enters state k % 2

    def _extend(self, t: float) -> None:
        changes = self._changes
        while changes[-1] <= t:
            state = (len(changes) - 1) % 2
            changes.append(changes[-1] - self.dwell[state] * math.log(1.0 - self._rng.random()))

    def changes(self, until: float) -> list[float]:
        """The change times in (0, until]."""
        self._extend(until)
        return [c for c in self._changes[1:] if c <= until]

    def at(self, t: float) -> float:
        self._extend(t)
        return self.values[(bisect.bisect_right(self._changes, t) - 1) % 2]

    def next_change(self, t: float) -> float:
        self._extend(t)
        return self._changes[bisect.bisect_right(self._changes, t)]

    def segment(self, t: float) -> tuple[float, float]:
        self._extend(t)
        k = bisect.bisect_right(self._changes, t)
        return self.values[(k - 1) % 2], self._changes[k]

    def __repr__(self) -> str:
        return f"Markov({self.values!r}, dwell={self.dwell!r}, seed={self.seed}, stream={self.stream!r})"


class _Slowest:
    """The smaller of several rate schedules at each time (a path over two links)."""

    constant = False

    def __init__(self, schedules: Sequence):
        self.schedules = tuple(schedules)

    def at(self, t: float) -> float:
        return min(s.at(t) for s in self.schedules)

    def next_change(self, t: float) -> float:
        return min(s.next_change(t) for s in self.schedules)

    def segment(self, t: float) -> tuple[float, float]:
        value, end = math.inf, math.inf
        for schedule in self.schedules:
            v, e = schedule.segment(t)
            value, end = min(value, v), min(end, e)
        return value, end


def transfer_seconds(nbytes: float, start: float, rate, latency) -> float:
    """Seconds to send ``nbytes`` from simulated time ``start``: ``latency`` in force at
    ``start``, plus the bytes at the ``rate`` in force while they go (each part of a message
    that crosses a change at its own rate). Constant schedules give ``latency + nbytes /
    rate`` exactly."""
    if rate.constant:
        return latency.at(start) + nbytes / rate.value
    t, left, spent = start, float(nbytes), 0.0
    while True:
        r, end = rate.segment(t)
        if end == math.inf or left <= r * (end - t):
            return latency.at(start) + (spent + left / r)
        left -= r * (end - t)
        spent += end - t
        t = end


@dataclass(frozen=True)
class Network:
    """Bandwidth (bytes/s) and latency (s) as schedules of simulated time: ``bandwidth`` is
    every link's, ``links[rank]`` overrides one rank's link (a slow server link)."""

    bandwidth: object
    latency: object
    links: Mapping[int, object] = field(default_factory=dict)
    _paths: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def rate(self, rank: int):
        return self.links.get(rank, self.bandwidth)

    def path(self, sender: int, receiver: int):
        """The rate schedule of a message from ``sender`` to ``receiver``: the slower link's."""
        key = (sender, receiver)
        path = self._paths.get(key)
        if path is None:
            a, b = self.rate(sender), self.rate(receiver)
            if a is b:
                path = a
            elif a.constant and b.constant:
                path = a if a.value <= b.value else b
            else:
                path = _Slowest((a, b))
            self._paths[key] = path
        return path

    def transfer_seconds(self, nbytes: float, start: float, sender: int, receiver: int) -> float:
        return transfer_seconds(nbytes, start, self.path(sender, receiver), self.latency)


def _ranks(workers: int, servers: int, colocated: bool):
    """(rank of worker w, rank serving shard s): servers 0..S-1 and workers S..S+P-1, or
    colocated, worker w at rank w + 1 serving shard w."""
    if colocated:
        return (lambda w: w + 1), (lambda s: s + 1)
    return (lambda w: servers + w), (lambda s: s)


def _binomial_arrivals(n: int, send, timed: bool = False) -> list[float]:
    """When each of ``n`` ranks (relative to the root, 0) holds the message of MPICH's binomial
    broadcast: rank r's parent is r less its lowest set bit, its children r + 2^k for every
    2^k below that bit (the root: below n); a parent sends to all its children at once, and
    they have it ``send(parent, children[, at])`` seconds after the parent had it (``at``)."""
    arrivals = [0.0] * n
    for r in range(n):  # a parent precedes its children
        low = r & -r if r else 1 << max(n - 1, 1).bit_length()
        children = [r + m for m in (1 << k for k in range(low.bit_length() - 1)) if r + m < n]
        if children:
            spent = send(r, children, arrivals[r]) if timed else send(r, children)
            for c in children:
                arrivals[c] = arrivals[r] + spent
    return arrivals


def comm_start(sim_start: float, compute_time: float | None, t_compute: float) -> float:
    """When an iteration's first message is sent on the simulated clock: after its compute
    (the fixed ``compute_time``, or the slowest worker's measured ``t_compute``)."""
    return sim_start + (compute_time if compute_time is not None else t_compute)


@dataclass(frozen=True)
class NodeRound:
    """One round's charge on nodes: ``seconds`` (the slowest NIC side or intra-node link side),
    ``nic_seconds`` and ``intra_seconds`` (the slowest of each kind), and the bytes that
    crossed NICs (each message once) and that stayed inside nodes."""

    seconds: float
    nic_seconds: float = 0.0
    intra_seconds: float = 0.0
    nic_bytes: int = 0
    intra_bytes: int = 0


@dataclass(frozen=True)
class Nodes:
    """Nodes of ``ranks_per_node`` workers: each node's NIC (the run's bandwidth and latency,
    given to :meth:`round`) and each worker's link inside its node (``intra_bandwidth``
    bytes/s, ``intra_latency`` s per message)."""

    ranks_per_node: int
    intra_bandwidth: float
    intra_latency: float

    def node_of(self, worker: int) -> int:
        return worker // self.ranks_per_node

    def intra_seconds(self, nbytes: int) -> float:
        """One message of ``nbytes`` on a worker's link inside its node (either side)."""
        return self.intra_latency + nbytes / self.intra_bandwidth

    def round(self, messages: Sequence[tuple[int, int, int]], bandwidth: float, latency: float) -> NodeRound:
        """Messages ``(nbytes, sending worker, receiving worker)`` sent at once (none of 0
        bytes, none to itself): the NICs' sides at ``bandwidth``, each worker paying
        ``latency`` per message across, and each worker's intra-node link's sides."""
        nic_out: dict[int, int] = {}
        nic_in: dict[int, int] = {}
        lat_out: dict[int, int] = {}
        lat_in: dict[int, int] = {}
        intra_out: dict[int, float] = {}
        intra_in: dict[int, float] = {}
        nic_bytes = intra_bytes = 0
        for nbytes, sender, receiver in messages:
            a, b = self.node_of(sender), self.node_of(receiver)
            if a == b:
                seconds = self.intra_seconds(nbytes)
                intra_out[sender] = intra_out.get(sender, 0.0) + seconds
                intra_in[receiver] = intra_in.get(receiver, 0.0) + seconds
                intra_bytes += nbytes
            else:
                nic_out[a] = nic_out.get(a, 0) + nbytes
                nic_in[b] = nic_in.get(b, 0) + nbytes
                lat_out[sender] = lat_out.get(sender, 0) + 1
                lat_in[receiver] = lat_in.get(receiver, 0) + 1
                nic_bytes += nbytes

        def side(node_bytes: dict[int, int], counts: dict[int, int]) -> float:
            worst: dict[int, int] = {}
            for worker, count in counts.items():
                node = self.node_of(worker)
                worst[node] = max(worst.get(node, 0), count)
            return max((worst.get(node, 0) * latency + n / bandwidth for node, n in node_bytes.items()), default=0.0)

        nic = max(side(nic_out, lat_out), side(nic_in, lat_in))
        intra = max(max(intra_out.values(), default=0.0), max(intra_in.values(), default=0.0))
        return NodeRound(max(nic, intra), nic, intra, nic_bytes, intra_bytes)

    def intra(self, slice_bytes: Sequence[int], workers: int) -> NodeRound:
        """A reduce-scatter (or all-gather) of slices inside every node of ``workers``
        workers: local rank j receives slice j (``slice_bytes[j]`` bytes) from each other
        worker of its node (and in the all-gather sends its own to each: the same messages
        the other way, the same time)."""
        L = self.ranks_per_node
        messages = [(slice_bytes[j], node * L + i, node * L + j) for node in range(workers // L)
                    for i in range(L) for j in range(L) if i != j and slice_bytes[j]]
        return self.round(messages, math.inf, 0.0)


class _Sides:
    """The two sides of links, each carrying one message at a time, keyed by whatever names
    a link (a rank, a node's NIC, a worker's intra-node link), all free from ``start`` on:
    a message leaves once it is ready and its sender's outgoing side is free, and comes in
    from then on once its receiver's incoming side is free."""

    def __init__(self, start: float, record: bool = False):
        self.start = start
        self.free_out: dict = {}
        self.free_in: dict = {}
        #: With ``record``: (side, from, to) of each message on each side it took.
        self.busy: list | None = [] if record else None

    def free(self, out_side) -> float:
        """When ``out_side`` can start its next message."""
        return self.free_out.get(out_side, self.start)

    def send(self, ready: float, out_side, in_side, seconds) -> float:
        """One message ready at ``ready`` taking ``seconds(t)`` on each side from t; return
        when it is in."""
        out = max(ready, self.free(out_side))
        self.free_out[out_side] = left = out + seconds(out)
        into = max(out, self.free_in.get(in_side, self.start))
        self.free_in[in_side] = end = into + seconds(into)
        if self.busy is not None:
            self.busy.append((out_side, out, left))
            self.busy.append((in_side, into, end))
        return end

    def covered(self, kind: str) -> float:
        """Seconds during which some side of ``kind`` ("nic", "intra", "rank") carried a message
        (the union of their busy intervals; ``record`` needed)."""
        total, reached = 0.0, -math.inf
        for begin, end in sorted((begin, end) for side, begin, end in self.busy if side[0] == kind):
            if end > reached:
                total += end - max(begin, reached)
                reached = end
        return total


@dataclass(frozen=True)
class LinkModel:
    bandwidth: float           # bytes per second
    latency: float             # seconds per message
    mode: str = "virtual"      # virtual | sleep | off
    broadcast: str = "star"    # star | tree | mpich
    #: Schedules and per-link rates (None: ``bandwidth`` and ``latency`` for every message at
    #: any time). With one, every charge depends on when and between which ranks it is sent:
    #: the phases take ``start`` (simulated seconds) and know the ranks (servers 0..S-1,
    #: workers S..S+P-1).
    network: Network | None = None
    #: Nodes of several workers (``--ranks-per-node L > 1``; colocated servers), else None:
    #: every worker a node of its own, each with its link.
    nodes: Nodes | None = None

    def message(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth

    def transfer_seconds(self, nbytes: int, start: float = 0.0, sender: int = 0, receiver: int = 0) -> float:
        """One message sent at simulated time ``start`` from ``sender`` to ``receiver``."""
        if self.network is None:
            return self.message(nbytes)
        return self.network.transfer_seconds(nbytes, start, sender, receiver)

    def gather(self, sizes: Sequence[int], start: float = 0.0, receiver: int = 0,
               senders: Sequence[int] | None = None) -> float:
        """Messages into one rank, serialised on its link (``senders[i]`` sends ``sizes[i]``;
        by default the receiver's link alone counts), one after another from ``start``."""
        if self.network is None:
            return sum(self.message(n) for n in sizes)
        senders = [receiver] * len(sizes) if senders is None else senders
        return self.serial([(n, sender, receiver) for sender, n in zip(senders, sizes)], start)

    def serial(self, messages: Sequence[tuple[int, int, int]], start: float = 0.0) -> float:
        """Messages ``(nbytes, sender, receiver)`` one after another from ``start`` (on one
        rank's link: into it, or out of it)."""
        spent = 0.0
        for n, sender, receiver in messages:
            spent += self.transfer_seconds(n, start + spent, sender, receiver)
        return spent

    def bcast(self, nbytes: int, workers: int, start: float = 0.0, sender: int = 0,
              receivers: Sequence[int] | None = None) -> float:
        """One message to ``workers`` receivers (any ranks, despite the name). With a network
        schedule, star: a copy to each of ``receivers`` in turn; tree: each round as long as
        the slowest copy to any of them would be at that round's start."""
        if self.network is None:
            if self.broadcast == "tree":
                return math.ceil(math.log2(workers + 1)) * self.message(nbytes)
            if self.broadcast == "mpich":
                return max(_binomial_arrivals(workers + 1, lambda parent, children: sum(self.message(nbytes) for _ in children)))
            return workers * self.message(nbytes)
        receivers = [sender] * workers if receivers is None else receivers
        if self.broadcast == "mpich":
            ranks = [sender, *receivers]
            return max(_binomial_arrivals(len(ranks), lambda parent, children, at: self.serial(
                [(nbytes, ranks[parent], ranks[c]) for c in children], start + at), timed=True))
        spent = 0.0
        if self.broadcast == "tree":
            for _ in range(math.ceil(math.log2(workers + 1))):
                spent += max(self.transfer_seconds(nbytes, start + spent, sender, r) for r in receivers)
            return spent
        for receiver in receivers:
            spent += self.transfer_seconds(nbytes, start + spent, sender, receiver)
        return spent

    def point_to_point(self) -> "LinkModel":
        """The model of broadcasts the runtime sends point to point (colocated shards): a
        star under ``mpich``, whose binomial tree is only ``Ibcast``'s."""
        return replace(self, broadcast="star") if self.broadcast == "mpich" else self

    # ---- the phases of an iteration (mpigrad.runtime.roles.iteration) ------------------------
    # ``start``: the phase's first message on the simulated clock (only a network schedule
    # looks at it); ranks: servers 0..S-1, workers S..S+P-1.
    def losses(self, workers: int, loss_bytes: int, start: float = 0.0, servers: int = 1,
               colocated: bool = False) -> float:
        """Rank 0 gathers one loss report from each worker."""
        if self.network is None:
            return self.gather([loss_bytes] * workers)
        worker, _ = _ranks(workers, servers, colocated)
        return self.gather([loss_bytes] * workers, start, 0, [worker(w) for w in range(workers)])

    def control(self, workers: int, servers: int, control_bytes: int, colocated: bool = False,
                start: float = 0.0) -> float:
        """Rank 0 broadcasts the Control to the workers and the other servers."""
        receivers = workers if colocated else workers + servers - 1
        if self.network is None:
            return self.bcast(control_bytes, receivers)
        return self.bcast(control_bytes, receivers, start, 0, range(1, 1 + receivers))

    def control_ahead(self, workers: int, servers: int, control_bytes: int, colocated: bool, sent: float,
                      start: float) -> float:
        """A Control sent ahead at ``sent`` (the iteration's start) whose exchange begins at
        ``start`` (the compute's end): the seconds the exchange still waits for it, 0 where it
        arrived during the compute."""
        return max(0.0, sent + self.control(workers, servers, control_bytes, colocated, start=sent) - start)

    def gradients(self, frames_in: Sequence[Sequence[int]], colocated: bool = False, start: float = 0.0) -> float:
        """Each server gathers its shard's frames (``frames_in[s]``, in worker order); the
        slowest server ends the round. Colocated: the slowest link direction of any node; on
        nodes of several workers (``nodes``), :meth:`Nodes.round` of the frames (a 0 in
        ``frames_in``: no frame)."""
        if self.nodes is not None and colocated:
            return self.node_gradients(frames_in).seconds
        if self.network is None:
            if not colocated:
                return max(self.gather(sizes) for sizes in frames_in)
            nodes = range(len(frames_in))
            inbound = max(self.gather([frames_in[s][w] for w in nodes if w != s]) for s in nodes)
            outbound = max(self.gather([frames_in[s][w] for s in nodes if s != w]) for w in nodes)
            return max(inbound, outbound)
        S = len(frames_in)
        worker, server = _ranks(len(frames_in[0]), S, colocated)
        if not colocated:
            return max(self.gather(sizes, start, server(s), [worker(w) for w in range(len(sizes))])
                       for s, sizes in enumerate(frames_in))
        nodes = range(S)  # node s is worker s and serves shard s: rank s + 1
        inbound = max(self.serial([(frames_in[s][w], worker(w), server(s)) for w in nodes if w != s], start)
                      for s in nodes)
        outbound = max(self.serial([(frames_in[s][w], worker(w), server(s)) for s in nodes if s != w], start)
                       for w in nodes)
        return max(inbound, outbound)

    def broadcasts(self, workers: int, frames_out: Sequence[int], colocated: bool = False,
                   start: float = 0.0, hierarchical: bool = False) -> float:
        """Server s broadcasts ``frames_out[s]`` bytes to the workers (and rank 0 when s > 0).
        Colocated: node s sends its shard to the P - 1 other workers while it receives theirs;
        on nodes of several workers, :meth:`Nodes.round` of those copies (``hierarchical``: to
        the other workers of its local rank only)."""
        if self.nodes is not None and colocated:
            return self.node_broadcasts(workers, frames_out, hierarchical).seconds
        if self.network is None:
            if not colocated:
                return max(self.bcast(n, workers + (s > 0)) for s, n in enumerate(frames_out))
            if workers < 2:
                return 0.0
            outbound = max(self.point_to_point().bcast(n, workers - 1) for n in frames_out)
            inbound = max(self.gather([n for t, n in enumerate(frames_out) if t != s]) for s in range(workers))
            return max(outbound, inbound)
        S = len(frames_out)
        worker, server = _ranks(workers, S, colocated)
        if not colocated:
            def members(s):  # the broadcast group's order (runtime.wire.channel.group_members)
                workers_ = [worker(w) for w in range(workers)]
                if self.broadcast != "mpich":
                    return [*workers_, *([0] if s else [])]
                return [*([0] if s else []), *workers_]
            return max(self.bcast(n, workers + (s > 0), start, server(s), members(s)) for s, n in enumerate(frames_out))
        if workers < 2:
            return 0.0
        outbound = max(self.point_to_point().bcast(n, workers - 1, start, server(s),
                                                   [worker(w) for w in range(workers) if w != s])
                       for s, n in enumerate(frames_out))
        inbound = max(self.serial([(n, server(t), worker(s)) for t, n in enumerate(frames_out) if t != s], start)
                      for s in range(workers))
        return max(outbound, inbound)

    def node_gradients(self, frames_in: Sequence[Sequence[int]]) -> NodeRound:
        """The gradient round on ``nodes``: worker w's frame to shard s (served by worker s)."""
        return self.nodes.round([(n, w, s) for s, sizes in enumerate(frames_in) for w, n in enumerate(sizes)
                                 if w != s and n], self.bandwidth, self.latency)

    def node_broadcasts(self, workers: int, frames_out: Sequence[int], hierarchical: bool = False) -> NodeRound:
        """The broadcast round on ``nodes``: shard s's average to every other worker, or
        (``hierarchical``) to the other workers of its local rank."""
        L = self.nodes.ranks_per_node
        return self.nodes.round([(n, s, w) for s, n in enumerate(frames_out) for w in range(workers)
                                 if w != s and (not hierarchical or w % L == s % L)], self.bandwidth, self.latency)

    def node_intra(self, slice_bytes: Sequence[int], workers: int) -> NodeRound:
        """A hierarchical exchange's reduce-scatter (or all-gather) inside the nodes."""
        return self.nodes.intra(slice_bytes, workers)

    def node_breakdown(self, traffic: "IterationTraffic") -> NodeRound:
        """The gradient rounds of ``traffic`` on ``nodes``, summed: seconds, the slowest NICs'
        and intra-node links' seconds of each round, and the bytes across NICs and inside
        nodes (the hierarchical exchange's slices among them)."""
        parts = []
        for phase, frames in traffic.phases():
            if phase == "intra":
                parts.append(self.node_intra(traffic.slice_bytes, traffic.workers))
            elif phase == "up":
                parts.append(self.node_gradients(frames))
            else:
                parts.append(self.node_broadcasts(traffic.workers, frames, traffic.hierarchical))
        return NodeRound(sum(p.seconds for p in parts), sum(p.nic_seconds for p in parts),
                         sum(p.intra_seconds for p in parts), sum(p.nic_bytes for p in parts),
                         sum(p.intra_bytes for p in parts))

    def comm_seconds(self, traffic: "IterationTraffic", start: float = 0.0, sent: float | None = None) -> float:
        """One iteration's modelled communication from simulated time ``start``
        (``comm_start``): its phases, summed in the order the runtime charges them (so that
        the float is the runtime's to the last bit), each from where the previous ended.
        ``traffic.ahead``: the Control left at ``sent`` (the iteration's start; default
        ``start``) and only what of its way outlasts the compute is charged; the losses
        travel beside the frames."""
        colocated = traffic.colocated
        if traffic.ahead:
            t_comm = self.control_ahead(traffic.workers, traffic.servers, traffic.control_bytes, colocated,
                                        start if sent is None else sent, start)
        else:
            t_comm = self.losses(traffic.workers, traffic.loss_bytes, start, traffic.servers, colocated)
            t_comm += self.control(traffic.workers, traffic.servers, traffic.control_bytes, colocated,
                                   start=start + t_comm)
        for phase, frames in traffic.phases():
            if phase == "intra":
                t_comm += self.node_intra(traffic.slice_bytes, traffic.workers).seconds
            elif phase == "up":
                t_comm += self.gradients(frames, colocated, start=start + t_comm)
            else:
                t_comm += self.broadcasts(traffic.workers, frames, colocated, start=start + t_comm,
                                          hierarchical=traffic.hierarchical)
        return t_comm

    def pipelined_iteration(self, traffic: "PipelinedTraffic", sim: float, compute_time: float | None,
                            t_forward: float, t_backward: float) -> tuple[float, "NodeRound | None"]:
        """A pipelined iteration that began at ``sim`` on the simulated clock: the charge of
        its communication not hidden behind backward, from the end of the slowest forward pass
        (``t_forward``; backward's slowest ``t_backward``), and on nodes its overlapped
        schedule (:meth:`pipelined_hierarchical_round`; else None). With a fixed
        ``compute_time`` backward's time per bucket is unknown: the buckets are charged as all
        ready when it ends (the communication's own pipelining still counts). The one rule
        of the runtime's clock and of ``trace retime``."""
        if compute_time is not None:
            traffic = replace(traffic, ready=tuple((0.0,) * len(ready) for ready in traffic.ready))
            t_backward = 0.0
        start = comm_start(sim, compute_time, t_forward)
        node_round = None
        if traffic.intra:  # on nodes: the schedule's NICs and intra-node links too
            node_round = self.pipelined_hierarchical_round(traffic, start, sent=sim)
            span = node_round.seconds
        else:
            span = self.pipelined(traffic, start, sent=sim)
        return self.charge(max(0.0, span - t_backward)), node_round

    def pipelined(self, traffic: "PipelinedTraffic", start: float = 0.0, sent: float | None = None) -> float:
        """The pipelined iteration's communication (colocated servers), from the end of the
        forward pass at ``start``: simulated seconds until the last worker holds every
        shard's average. It covers the backward pass, which it overlaps.

        Each node has a link, full duplex, each side carrying one message at a time for its
        ``transfer_seconds`` (:class:`_Sides`): a message leaves when it is ready and its
        sender's outgoing side is free, and comes in from then on once its receiver's incoming
        side is free (so a round's time is the busier side's, as in ``gradients``); messages in
        order of readiness, ties in the order posted. Ready:
        a loss report at ``start``; the Control when rank 0 has every loss (``ahead``: when
        it arrives from ``sent``, the iteration's start, or at ``start`` if sooner); worker w's frame
        of bucket b when it holds the Control and backward has produced the bucket
        (``traffic.ready[w][b]`` after ``start``), in bucket order, to the other shards in
        turn from its own (w + 1, w + 2, ...); node s's average of bucket b when every frame
        of it is in, its own backward has ended and its earlier buckets have gone out, to the
        other workers in the same turn. The codecs' work is not in it (charged apart).
        A hierarchical traffic (``traffic.intra``) is :meth:`pipelined_hierarchical`'s."""
        if traffic.intra:
            return self.pipelined_hierarchical(traffic, start, sent)
        P = traffic.workers
        worker = lambda w: w + 1  # noqa: E731  (colocated: worker w at rank w + 1 serves shard w)
        sides = _Sides(start)

        def send(ready: float, nbytes: int, sender: int, receiver: int) -> float:
            return sides.send(ready, sender, receiver, lambda t: self.transfer_seconds(nbytes, t, sender, receiver))

        control = self._pipelined_control(traffic, start, sent, send)
        buckets = len(traffic.ready[0]) if P else 0
        backward_end = [start + max(traffic.ready[w], default=0.0) for w in range(P)]
        # Each node's messages (ready, order posted, nbytes, receiver, bucket, kind), a heap per
        # sender: the next message to go is the one whose sender can start it first.
        queues: list[list] = [[] for _ in range(P)]
        posted = 0
        for w in range(P):
            for b in range(buckets):
                ready = max(control[w], start + traffic.ready[w][b])
                for k in range(1, P):
                    s = (w + k) % P
                    if traffic.frames[s][b][w]:
                        queues[w].append((ready, posted, traffic.frames[s][b][w], s, b, "frame"))
                        posted += 1
            heapq.heapify(queues[w])
        missing = {(s, b): sum(1 for w in range(P) if w != s and traffic.frames[s][b][w])
                   for s in range(P) for b in range(buckets) if traffic.bcast[s][b]}
        arrived = {key: start for key in missing}
        sent_out = [start] * P  # when node s's last average went out (its buckets in order)
        pending = {s: [b for b in range(buckets) if (s, b) in missing] for s in range(P)}
        done = start

        def release(s: int) -> None:
            """Queue node s's averages whose frames are all in, in bucket order."""
            nonlocal posted
            while pending[s] and missing[(s, pending[s][0])] == 0:
                b = pending[s].pop(0)
                ready = max(arrived[(s, b)], backward_end[s], sent_out[s])
                sent_out[s] = ready
                for k in range(1, P):
                    heapq.heappush(queues[s], (ready, posted, traffic.bcast[s][b], (s + k) % P, b, "average"))
                    posted += 1

        for s in range(P):
            release(s)
        while any(queues):
            sender = min((w for w in range(P) if queues[w]),
                         key=lambda w: (max(queues[w][0][0], sides.free(worker(w))), w))
            ready, _, nbytes, receiver, b, kind = heapq.heappop(queues[sender])
            end = send(ready, nbytes, worker(sender), worker(receiver))
            if kind == "frame":
                arrived[(receiver, b)] = max(arrived[(receiver, b)], end)
                missing[(receiver, b)] -= 1
                release(receiver)
            else:
                done = max(done, end)
        return max(done, *backward_end, *control) - start if P else 0.0

    def _pipelined_control(self, traffic: "PipelinedTraffic", start: float, sent: float | None, send) -> list[float]:
        """The loss reports to rank 0 at ``start`` and when each worker holds the Control
        (``send(ready, nbytes, sender rank, receiver rank)`` sends one message)."""
        P = traffic.workers
        losses_in = max(send(start, traffic.loss_bytes, w + 1, 0) for w in range(P))
        if traffic.ahead:
            at = start if sent is None else sent
            return [start + self.control_ahead(P, 1, traffic.control_bytes, True, at, start)] * P
        return [send(losses_in, traffic.control_bytes, 0, w + 1) for w in range(P)]

    def pipelined_hierarchical(self, traffic: "PipelinedTraffic", start: float = 0.0,
                               sent: float | None = None) -> float:
        """:meth:`pipelined_hierarchical_round`'s seconds."""
        return self.pipelined_hierarchical_round(traffic, start, sent).seconds

    def pipelined_hierarchical_round(self, traffic: "PipelinedTraffic", start: float = 0.0,
                                     sent: float | None = None) -> NodeRound:
        """The pipelined hierarchical iteration's communication on :attr:`nodes` of L workers
        (runtime/exchange/hierarchical_pipeline.py), from the end of the forward pass at
        ``start``: simulated seconds until the last worker holds the whole average.

        Sides as in :meth:`pipelined`, on nodes: a message inside a node takes the workers'
        intra-node links (``Nodes.intra_seconds``), one across takes the two nodes' NICs
        (``transfer_seconds``; a NIC side carries one message at a time, so the latencies of a
        node's workers follow one another, where ``Nodes.round`` overlaps them); the loss
        reports and the Control take rank 0's link and each worker's own, as the sequential
        clock charges them. Ready, bucket b being shard s's part, of slice i = s mod L:
        worker w's part of it (``intra[b]`` bytes) to its node's local rank i when it holds the
        Control and backward has produced it; the owner's frame (``frames[s][b][owner]``) to
        worker s when the node's L - 1 parts are in, its own is produced and its earlier
        slice buckets' frames have gone; worker s's average (``bcast[s][b]``) to the other
        workers of local rank i when every frame is in, its backward has ended and its earlier
        averages have gone; each worker of local rank i's all-gather of it (``intra[b]``) to
        its node's others once it holds the average, its backward has ended and its earlier
        slice buckets' have gone. Done when the last all-gather is in.

        Returns those seconds as a :class:`NodeRound`, with the overlapped schedule's NICs and
        intra-node links: ``nic_seconds``, the seconds during which some NIC side carried a
        worker's message (the union of their busy times, backward's overlap included),
        ``intra_seconds`` the same for the intra-node links (with one bucket ready at once,
        :meth:`node_breakdown`'s of the sequential rounds), and the bytes of the messages across
        NICs and inside nodes (each once)."""
        nodes = self.nodes
        if nodes is None:
            raise ValueError("a pipelined hierarchical traffic (intra) needs nodes of several workers "
                             "(LinkModel.nodes)")
        P, L = traffic.workers, nodes.ranks_per_node
        sides = _Sides(start, record=True)
        moved = {"nic": 0, "intra": 0}  # bytes

        def send(ready: float, nbytes: int, sender: int, receiver: int) -> float:  # ranks: rank 0's messages
            return sides.send(ready, ("rank", sender), ("rank", receiver),
                              lambda t: self.transfer_seconds(nbytes, t, sender, receiver))

        def out_side(sender: int, receiver: int):  # workers
            a, b = nodes.node_of(sender), nodes.node_of(receiver)
            return ("intra", sender) if a == b else ("nic", a)

        def send_between(ready: float, nbytes: int, sender: int, receiver: int) -> float:  # workers
            a, b = nodes.node_of(sender), nodes.node_of(receiver)
            moved["intra" if a == b else "nic"] += nbytes
            if a == b:
                return sides.send(ready, ("intra", sender), ("intra", receiver), lambda t: nodes.intra_seconds(nbytes))
            return sides.send(ready, ("nic", a), ("nic", b),
                              lambda t: self.transfer_seconds(nbytes, t, sender + 1, receiver + 1))

        control = self._pipelined_control(traffic, start, sent, send)
        buckets = len(traffic.ready[0]) if P else 0
        backward_end = [start + max(traffic.ready[w], default=0.0) for w in range(P)]
        shard = [next((s for s in range(P) if traffic.bcast[s][b]), None) for b in range(buckets)]
        node_of, local = nodes.node_of, (lambda w: w % L)  # noqa: E731
        queues: list[list] = [[] for _ in range(P)]
        posted = 0

        def push(w: int, ready: float, nbytes: int, receiver: int, b: int, kind: str) -> None:
            nonlocal posted
            heapq.heappush(queues[w], (ready, posted, nbytes, receiver, b, kind))
            posted += 1

        def owner(w: int, b: int) -> int:  # bucket b's slice owner on worker w's node
            return node_of(w) * L + local(shard[b])

        def node_peers(w: int) -> list[int]:
            return [node_of(w) * L + i for i in range(L) if i != local(w)]

        slice_buckets = [[b for b in range(buckets) if shard[b] is not None and local(shard[b]) == local(w)]
                         for w in range(P)]
        for w in range(P):
            for b in range(buckets):
                if shard[b] is not None and local(w) != local(shard[b]):
                    push(w, max(control[w], start + traffic.ready[w][b]), traffic.intra[b], owner(w, b), b, "part")
        parts_in = {(w, b): (L - 1, start) for w in range(P) for b in slice_buckets[w]}
        frames_in = {(s, b): (1 + sum(1 for w in range(P) if w != s and traffic.frames[s][b][w]), start)
                     for s in range(P) for b in slice_buckets[s] if shard[b] == s}
        means = {w: list(slice_buckets[w]) for w in range(P)}
        served = {s: [b for b in slice_buckets[s] if shard[b] == s] for s in range(P)}
        gathers = {w: list(slice_buckets[w]) for w in range(P)}
        holds: dict[tuple[int, int], float] = {}  # (worker, bucket): when its slice's average is in its update
        last_mean, last_average, last_gather = [start] * P, [start] * P, [start] * P
        done = start

        def arrive(table: dict, key, end: float) -> None:
            left, at = table[key]
            table[key] = (left - 1, max(at, end))

        def release(w: int) -> None:
            """Queue worker w's node means, averages and all-gathers whose inputs are in, each
            kind in its slice's bucket order."""
            while means[w] and parts_in[(w, means[w][0])][0] == 0:
                b = means[w].pop(0)
                ready = last_mean[w] = max(parts_in[(w, b)][1], control[w], start + traffic.ready[w][b], last_mean[w])
                if shard[b] == w:
                    arrive(frames_in, (w, b), ready)
                else:
                    push(w, ready, traffic.frames[shard[b]][b][w], shard[b], b, "frame")
            while served[w] and frames_in[(w, served[w][0])][0] == 0:
                b = served[w].pop(0)
                ready = last_average[w] = max(frames_in[(w, b)][1], backward_end[w], last_average[w])
                holds[(w, b)] = ready
                for v in range(P):
                    if v != w and local(v) == local(w):
                        push(w, ready, traffic.bcast[w][b], v, b, "average")
            while gathers[w] and (w, gathers[w][0]) in holds:
                b = gathers[w].pop(0)
                ready = last_gather[w] = max(holds[(w, b)], backward_end[w], last_gather[w])
                for v in node_peers(w):
                    push(w, ready, traffic.intra[b], v, b, "gather")

        for w in range(P):
            release(w)
        while any(queues):
            sender = min((w for w in range(P) if queues[w]),
                         key=lambda w: (max(queues[w][0][0], sides.free(out_side(w, queues[w][0][3]))), w))
            ready, _, nbytes, receiver, b, kind = heapq.heappop(queues[sender])
            end = send_between(ready, nbytes, sender, receiver)
            if kind == "part":
                arrive(parts_in, (receiver, b), end)
            elif kind == "frame":
                arrive(frames_in, (receiver, b), end)
            elif kind == "average":
                holds[(receiver, b)] = end
            else:
                done = max(done, end)
            release(receiver)
        seconds = max(done, *backward_end, *control) - start if P else 0.0
        return NodeRound(seconds, sides.covered("nic"), sides.covered("intra"), moved["nic"], moved["intra"])

    # ---- how the runtime applies a phase ---------------------------------------------
    def charge(self, seconds: float) -> float:
        """Apply a modelled communication phase: sleep in ``sleep`` mode; return the charge."""
        if self.mode == "sleep" and seconds > 0:
            time.sleep(seconds)
        return seconds if self.mode != "off" else 0.0

    @property
    def modelled(self) -> bool:
        return self.mode != "off"


@dataclass(frozen=True)
class IterationTraffic:
    """The messages of one iteration that the clock charges.

    ``loss_bytes``: one worker's loss report; ``control_bytes``: one copy of the Control;
    ``frames_in[s][w]``: worker w's gradient frame to server s; ``frames_out[s]``: one copy
    of server s's broadcast, its 8-byte length included; ``colocated``: worker w serves
    shard w (its frame to it and its broadcast to itself cross no link, rank 0 gets none).
    ``frames_in2``/``frames_out2``: a two-round codec's second round (PowerSGD's Q factors),
    laid out as the first; empty for one round. The byte totals count both rounds.
    ``ahead``: the Control went before the losses (``control = "ahead"``): neither is
    charged (their bytes still count).
    """

    loss_bytes: int
    control_bytes: int
    frames_in: tuple[tuple[int, ...], ...]
    frames_out: tuple[int, ...]
    colocated: bool = False
    frames_in2: tuple[tuple[int, ...], ...] = ()
    frames_out2: tuple[int, ...] = ()
    ahead: bool = False
    #: The hierarchical exchange (colocated, nodes of L = ``len(slice_bytes)`` workers): a
    #: reduce-scatter of ``slice_bytes[j]``-byte slices inside each node before the gradient
    #: round and an all-gather after the broadcast, whose copies go to the workers of the
    #: shard's local rank only; ``frames_in`` is 0 where a worker sends a shard no frame.
    hierarchical: bool = False
    slice_bytes: tuple[int, ...] = ()

    def _rounds(self):
        """(frames_in, frames_out) of each round."""
        first = ((self.frames_in, self.frames_out),)
        return first + ((self.frames_in2, self.frames_out2),) if self.frames_in2 else first

    def phases(self):
        """The gradient rounds' phases in the order they run, as (kind, frames): ``("up",
        frames_in)`` and ``("down", frames_out)`` per round (a two-round codec's one after the
        other), and in a hierarchical exchange ``("intra", None)`` before the first round (the
        reduce-scatter inside the nodes) and after the last (the all-gather)."""
        rounds = [(kind, frames) for frames_in, frames_out in self._rounds()
                  for kind, frames in (("up", frames_in), ("down", frames_out))]
        return [("intra", None), *rounds, ("intra", None)] if self.hierarchical else rounds

    @property
    def servers(self) -> int:
        return len(self.frames_in)

    @property
    def workers(self) -> int:
        return len(self.frames_in[0])

    @property
    def server_bytes_in(self) -> tuple[int, ...]:
        """Bytes of workers' frames that reach each server over a link (both rounds)."""
        return tuple(sum(sum(n for w, n in enumerate(frames[s]) if not (self.colocated and w == s))
                         for frames, _ in self._rounds())
                     for s in range(self.servers))

    @property
    def worker_bytes_sent(self) -> tuple[int, ...]:
        """Bytes of gradient frames each worker sends over its link (both rounds)."""
        return tuple(sum(sizes[w] for frames, _ in self._rounds() for s, sizes in enumerate(frames)
                         if not (self.colocated and w == s))
                     for w in range(self.workers))

    @property
    def copies_out(self) -> tuple[int, ...]:
        """How many copies of each server's broadcast cross a link."""
        P = self.workers
        if self.hierarchical:
            return tuple(P // len(self.slice_bytes) - 1 for _ in range(self.servers))
        return tuple(P - 1 if self.colocated else P + (s > 0) for s in range(self.servers))

    @property
    def intra_bytes(self) -> int:
        """Bytes of the hierarchical exchange's slices inside the nodes (both collectives)."""
        if not self.hierarchical:
            return 0
        L = len(self.slice_bytes)
        return 2 * (self.workers // L) * (L - 1) * sum(self.slice_bytes)

    @property
    def bytes_up(self) -> int:
        """Bytes into servers: every worker's frames and loss reports."""
        return sum(self.server_bytes_in) + self.workers * self.loss_bytes

    @property
    def bytes_down(self) -> int:
        """Bytes out of servers: every copy of the Control and of each broadcast."""
        P, S = self.workers, self.servers
        controls = P if self.colocated else P + S - 1
        return controls * self.control_bytes + sum(c * n for _, out in self._rounds()
                                                   for c, n in zip(self.copies_out, out))

    @classmethod
    def from_totals(cls, bytes_up: int, bytes_down: int, frames_in: Sequence[Sequence[int]],
                    frames_out: Sequence[int], colocated: bool = False, ahead: bool = False,
                    slice_bytes: Sequence[int] = ()) -> "IterationTraffic":
        """The traffic whose ``bytes_up`` and ``bytes_down`` these are: the loss report's and
        the Control's sizes solved from them (a trace records the totals and the frames).
        ValueError when no whole sizes give those totals."""
        frames_in = tuple(tuple(int(n) for n in sizes) for sizes in frames_in)
        frames_out = tuple(int(n) for n in frames_out)
        slices = tuple(int(n) for n in slice_bytes)
        probe = cls(0, 0, frames_in, frames_out, colocated, hierarchical=bool(slices), slice_bytes=slices)
        P, S = probe.workers, probe.servers
        loss, loss_left = divmod(int(bytes_up) - probe.bytes_up, P)
        control, control_left = divmod(int(bytes_down) - probe.bytes_down, P if colocated else P + S - 1)
        if loss < 0 or control < 0 or loss_left or control_left:
            raise ValueError(f"bytes up {bytes_up} and down {bytes_down} do not add up from the frames "
                             f"({frames_in} in, {frames_out} out)")
        return cls(loss, control, frames_in, frames_out, colocated, ahead=ahead, hierarchical=bool(slices),
                   slice_bytes=slices)


@dataclass(frozen=True)
class PipelinedTraffic:
    """The messages of one pipelined iteration (colocated servers) and when backward made
    them ready: ``ready[w][b]`` seconds after backward began, worker w had bucket b;
    ``frames[s][b][w]``: worker w's frame of bucket b to shard s (0: none; its own shard's
    crosses no link); ``bcast[s][b]``: one copy of shard s's average of bucket b (0: none);
    ``ahead``: the Control was at the workers when the forward pass ended; ``intra``: the
    pipelined hierarchical iteration's (on ``LinkModel.nodes``), bucket b's message inside a
    node (a reduce-scatter's part, an all-gather's average) ``intra[b]`` bytes, and frames
    only from each bucket's slice owners; empty for the flat exchange."""

    loss_bytes: int
    control_bytes: int
    ready: tuple[tuple[float, ...], ...]
    frames: tuple[tuple[tuple[int, ...], ...], ...]
    bcast: tuple[tuple[int, ...], ...]
    ahead: bool = False
    intra: tuple[int, ...] = ()

    @property
    def workers(self) -> int:
        return len(self.ready)

    def bucket_columns(self, shard: Sequence[int]) -> dict[str, list]:
        """This traffic as a trace's ``buckets`` row (``trace.schema.bucket_columns``), each
        bucket b being shard ``shard[b]``'s part: ``ready[w][b]``, ``frames[b][w]`` (worker
        w's frame of it to its shard), ``bcast[b]``, ``shard``, ``intra`` (0 for the flat
        exchange) and the loss report's and the Control's bytes. ValueError where a bucket
        has bytes on a shard other than its own (a traffic this row would not keep)."""
        B = len(shard)
        for s, (frames, bcast) in enumerate(zip(self.frames, self.bcast)):
            if any((bcast[b] or any(frames[b])) and s != shard[b] for b in range(B)):
                raise ValueError(f"shard {s} holds bytes of another shard's bucket")
        return {"loss_bytes": self.loss_bytes, "control_bytes": self.control_bytes,
                "ready": [list(r) for r in self.ready],
                "frames": [list(self.frames[s][b]) for b, s in enumerate(shard)],
                "bcast": [self.bcast[s][b] for b, s in enumerate(shard)], "shard": list(shard),
                "intra": list(self.intra) if self.intra else [0] * B}

    @classmethod
    def from_bucket_columns(cls, row: Mapping[str, object], ahead: bool, hierarchical: bool) -> "PipelinedTraffic":
        """The traffic of a trace's ``buckets`` row (:meth:`bucket_columns`); ``ahead`` the
        row's ``control_ahead``, ``hierarchical`` whether its ``intra`` counts. ValueError
        (one line) for a row whose shapes or values no run sends."""
        ready = [[float(t) for t in r] for r in row["ready"]]
        frames = [[int(n) for n in f] for f in row["frames"]]
        bcast, shard = [int(n) for n in row["bcast"]], [int(s) for s in row["shard"]]
        intra = [int(n) for n in row["intra"]]
        P, B = len(ready), len(shard)
        if (not P or any(len(r) != B for r in ready) or len(frames) != B or any(len(f) != P for f in frames)
                or len(bcast) != B or len(intra) != B):
            raise ValueError("its buckets' columns do not have one shape")
        if any(not 0 <= s < P for s in shard) or min(bcast + intra + [n for f in frames for n in f]) < 0:
            raise ValueError("a bucket's shard or bytes out of range")
        if any(not (math.isfinite(t) and t >= 0) for r in ready for t in r):
            raise ValueError("a bucket's ready time is not a time")
        zeros = (0,) * P
        return cls(int(row["loss_bytes"]), int(row["control_bytes"]), tuple(map(tuple, ready)),
                   tuple(tuple(tuple(frames[b]) if shard[b] == s else zeros for b in range(B)) for s in range(P)),
                   tuple(tuple(bcast[b] if shard[b] == s else 0 for b in range(B)) for s in range(P)),
                   ahead, tuple(intra) if hierarchical else ())


def iteration_seconds(t_comm: float, compute_time: float | None, t_compute: float, t_encode: float,
                      t_decode: float, t_policy: float, t_local: float = 0.0) -> float:
    """Simulated seconds of one modelled iteration: a fixed ``compute_time`` (deterministic
    runs) plus ``t_local``, the cost model's policy, encode, decode and average
    (:mod:`mpigrad.costmodel`; 0 with ``--cost-model none``), or the measured local work,
    plus its communication."""
    if compute_time is not None:
        return compute_time + t_local + t_comm
    return t_compute + t_encode + t_decode + t_policy + t_comm
