"""What each rank does in one simulated iteration: phases of local work and of messages.

mpigrad's iteration (:func:`mpigrad_phases`), from an :class:`~mpigrad.clockmodel.IterationTraffic`
in the runtime's order (``runtime/roles/iteration.py``; ``LinkModel.comm_seconds`` charges
the same phases): the workers' compute; the losses, each worker to rank 0; the Control, rank
0 to every worker (and to the other servers), a star; with the hierarchical exchange the
reduce-scatter inside each node; the gradient frames, worker w's frame of shard s to the
rank serving it (none of 0 bytes, none to itself); each server's broadcast, one copy to each
receiver (a star: point to point, as colocated servers send it; the runtime's ``Ibcast`` of
separate servers is replayed the same way); the all-gather inside the nodes; a two-round
codec's second round; the rest of the local work. The losses go eagerly (a worker goes on
before rank 0 has its report), the servers take the gradient frames as they come (their
receives are posted with the losses', so that a frame does not wait for the loss gather),
and with the Control ahead (``traffic.ahead``) rank 0 sends the Control when the iteration
starts and the workers wait for it only before they send their frames, so that its way
overlaps the compute, as the runtime does. The servers' reports to
rank 0 (a few hundred bytes, off mpigrad's clock too) are not sent.

The peers (:func:`ring_phases` and the functions after it): DDP's ring all-reduce (2 (P -
1) steps, each rank sending its successor 1/P of the buffer, ranks in node order), and the
hierarchical all-reduce (a ring inside each node reduce-scatters, local rank j of every node
all-reduces its 1/L across the nodes in a ring of its own, a ring inside each node
all-gathers), after the same compute.

A phase's time in the breakdown (:func:`breakdown`): how much later the last rank ends it
than the last rank ended the phase before it in the iteration's order (or the iteration
before), so that the phases add up to the iteration; a phase whose messages all arrived while
others ran (the Control ahead, during the compute) takes 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..clockmodel import IterationTraffic, PipelinedTraffic
from .platform import Placement

__all__ = ["Phase", "Program", "mpigrad_phases", "pipelined_phases", "ring_phases", "hierarchical_allreduce_phases", "ddp_phases",
           "breakdown", "weighted_mean", "nic_bytes", "PHASE_ORDER", "Groups", "aggregate", "compress_steps", "TINY",
           "SMALL", "bundle"]

#: The breakdown's order of mpigrad's phases (an iteration's order; the Control ahead is
#: sent first but counted here, where it is waited for).
PHASE_ORDER = ("compute", "losses", "control", "intra_reduce", "gradients", "broadcast", "gradients2",
               "broadcast2", "intra_gather", "local")


@dataclass
class Phase:
    """``work`` (rank -> seconds), or ``messages`` ``(sender, receiver, bytes)``; the senders
    wait for their sends at ``send_wait`` and the receivers for their receives at
    ``recv_wait``: None (at once, before the next phase), ``"end"`` (the iteration's end) or
    the name of a later phase (just before it). ``post_with``: an earlier phase, with which
    the receivers post their receives (as MPI queues a message that comes before its
    receive is posted), else they post them at this phase. ``fifo``: each message goes
    after its sender's earlier fifo messages to the same receiver are through (one
    connection's order: ``engine.py``). ``relay``: an earlier phase; a rank that receives in
    it and sends in this one forwards what it received: its sends go once those receives are
    in, it has reached this phase and its earlier relays of this kind have gone, while the
    rank goes on (``engine.py``)."""

    name: str
    work: dict[int, float] = field(default_factory=dict)
    messages: list[tuple[int, int, int]] = field(default_factory=list)
    send_wait: str | None = None
    recv_wait: str | None = None
    post_with: str | None = None
    floor: dict[int, float] = field(default_factory=dict)
    fifo: bool = False
    relay: str | None = None

    @property
    def kind(self) -> str:
        """The breakdown's name: ``name`` up to a ``:`` (a pipelined iteration's phases are
        one per bucket, ``gradients:3``, so that a wait names its own bucket's)."""
        return self.name.partition(":")[0]


@dataclass
class Program:
    """One iteration's phases in the order the ranks run them, and the breakdown's order of
    their indices."""

    phases: list[Phase]
    order: list[int] | None = None

    def to_json(self) -> list[dict]:
        """The engine's form (``engine.py``): a wait named by a later phase becomes its index."""
        index = {}
        for k, phase in enumerate(self.phases):
            index.setdefault(phase.name, k)

        def wait(name: str | None, k: int):
            if name is None or name == "end":
                return name
            later = [j for j, phase in enumerate(self.phases) if phase.name == name and j > k]
            return later[0] if later else "end"

        def earlier(name: str | None, k: int):
            if name is None:
                return None
            before = [j for j, phase in enumerate(self.phases) if phase.name == name and j < k]
            return before[-1] if before else None

        return [{"work": {str(r): s for r, s in phase.work.items() if s > 0},
                 "messages": [list(m) for m in phase.messages if m[2] > 0],
                 "send_wait": wait(phase.send_wait, k), "recv_wait": wait(phase.recv_wait, k),
                 "post_at": earlier(phase.post_with, k), **({"fifo": True} if phase.fifo else {}),
                 **({"relay": earlier(phase.relay, k), "chain": phase.kind} if phase.relay else {}),
                 **({"floor": {str(r): t for r, t in phase.floor.items()}} if phase.floor else {})}
                for k, phase in enumerate(self.phases)]

    def breakdown_order(self) -> list[int]:
        return list(range(len(self.phases))) if self.order is None else self.order


def _ranks(traffic: IterationTraffic):
    """(rank of worker w, rank serving shard s), as ``clockmodel._ranks``."""
    if traffic.colocated:
        return (lambda w: w + 1), (lambda s: s + 1)
    S = traffic.servers
    return (lambda w: S + w), (lambda s: s)


def _intra(traffic: IterationTraffic, name: str, ranks_per_node: int, worker, gather: bool) -> Phase:
    """The hierarchical exchange's reduce-scatter (local rank i sends slice j to local rank j
    of its node) or all-gather (the same messages the other way)."""
    L, P = ranks_per_node, traffic.workers
    messages = []
    for node in range(P // L):
        for i in range(L):
            for j in range(L):
                if i != j and traffic.slice_bytes[j]:
                    a, b = worker(node * L + i), worker(node * L + j)
                    messages.append((b, a, traffic.slice_bytes[j]) if gather else (a, b, traffic.slice_bytes[j]))
    return Phase(name, messages=messages)


def mpigrad_phases(traffic: IterationTraffic, ranks_per_node: int, compute: float, rest: float) -> Program:
    """mpigrad's iteration of ``traffic`` on nodes of ``ranks_per_node`` workers (the
    hierarchical exchange's groups), ``compute`` seconds of compute on every worker first and
    ``rest`` seconds of its other local work last."""
    P, S = traffic.workers, traffic.servers
    worker, server = _ranks(traffic)
    workers = [worker(w) for w in range(P)]
    control_to = workers if traffic.colocated else [*workers, *range(1, S)]
    first_exchange = "intra_reduce" if traffic.hierarchical else "gradients"
    phases = []
    if traffic.ahead:
        phases.append(Phase("control", messages=[(0, r, traffic.control_bytes) for r in control_to],
                            send_wait="losses", recv_wait=first_exchange))
    phases.append(Phase("compute", work={r: compute for r in workers}))
    phases.append(Phase("losses", messages=[(r, 0, traffic.loss_bytes) for r in workers], send_wait="end"))
    if not traffic.ahead:
        phases.append(Phase("control", messages=[(0, r, traffic.control_bytes) for r in control_to]))
    L = ranks_per_node
    ups = downs = intras = 0
    for kind, frames in traffic.phases():  # the clock's order (a two-round codec's rounds in turn)
        if kind == "intra":
            intras += 1
            phases.append(_intra(traffic, "intra_reduce" if intras == 1 else "intra_gather", L, worker,
                                 gather=intras > 1))
        elif kind == "up":
            ups += 1
            phases.append(Phase("gradients" + ("2" if ups > 1 else ""), messages=[
                (worker(w), server(s), n) for s, sizes in enumerate(frames) for w, n in enumerate(sizes)
                if n and not (traffic.colocated and w == s)]))
            if ups == 1:  # a worker's frames follow its loss report: they are taken as they come
                phases[-1].post_with = "losses"
        else:
            downs += 1
            copies = []
            for s, n in enumerate(frames):
                if traffic.colocated:
                    receivers = [w for w in range(P) if w != s and (not traffic.hierarchical or w % L == s % L)]
                    copies += [(server(s), worker(w), n) for w in receivers]
                else:
                    copies += [(server(s), worker(w), n) for w in range(P)] + ([(server(s), 0, n)] if s else [])
            phases.append(Phase("broadcast" + ("2" if downs > 1 else ""), messages=copies))
    phases.append(Phase("local", work={r: rest for r in workers}))
    order = sorted(range(len(phases)), key=lambda k: (PHASE_ORDER.index(phases[k].name), k))
    return Program(phases, order)


def pipelined_phases(traffic: PipelinedTraffic, forward: float, rest: float, ranks_per_node: int = 1) -> Program:
    """mpigrad's pipelined iteration (``--pipeline``, colocated servers) of ``traffic``, as
    ``LinkModel.pipelined`` charges it: ``forward`` seconds of forward pass on every worker,
    its loss report to rank 0 (eager), the Control (ahead: sent as the iteration starts; else
    once rank 0 has every loss), waited for only before a worker's first message; then
    backward bucket by bucket, worker w working until ``traffic.ready[w][b]`` after its
    backward began and then posting bucket b's message, so that the exchange crosses the
    network while backward goes on; the ``rest`` of the local work last, once every average
    is in. A rank's messages to one rank go in bucket order, one after another (``Phase.fifo``,
    a relay's own order: a connection's, where concurrent flows would share it and end
    together). One phase per bucket and step, ``backward:b``, ``gradients:b``, ... folded by
    :attr:`Phase.kind` in the breakdown, taken in this order.

    The flat exchange (``runtime/exchange/pipeline.py``): bucket b's frame to the bucket's
    shard s; after its backward, each server in bucket order waits for its bucket's frames and
    sends the average to the other workers. The hierarchical one (``traffic.intra``, on nodes
    of ``ranks_per_node``: ``runtime/exchange/hierarchical_pipeline.py``), bucket b of shard s
    being slice i = s mod L's: each worker's part (``intra[b]`` bytes) to its node's local rank
    i (``intra_reduce:b``); that owner's frame to s once the node's parts are in and its own
    bucket is made (``gradients:b``, relayed: ``Phase.relay``); after backward, s's average to
    the other owners (``broadcast:b``) and each owner's all-gather of it to its node's others
    once it holds it (``intra_gather:b``, relayed)."""
    P = traffic.workers
    B = len(traffic.ready[0]) if P else 0
    L = ranks_per_node
    hierarchical = bool(traffic.intra)
    if hierarchical and (L < 2 or P % L):
        raise ValueError(f"a pipelined hierarchical iteration of {P} workers on nodes of {L}")
    worker = lambda w: w + 1  # noqa: E731  (colocated: worker w at rank w + 1 serves shard w)
    workers = [worker(w) for w in range(P)]
    shard = [next((s for s in range(P) if traffic.bcast[s][b] or any(traffic.frames[s][b])), 0) for b in range(B)]

    def owners(b: int) -> list[int]:
        """The workers that hold bucket b's node means: its slice's local rank on each node."""
        return [w for w in range(P) if w % L == shard[b] % L] if hierarchical else list(range(P))

    def node_of(w: int) -> list[int]:
        return [v for v in range(P) if v // L == w // L and v != w]

    first = "intra_reduce:0" if hierarchical else "gradients:0"
    control = Phase("control", messages=[(0, r, traffic.control_bytes) for r in workers], recv_wait=first)
    phases = []
    if traffic.ahead:
        control.send_wait = "losses"
        phases.append(control)
    phases.append(Phase("compute", work={r: forward for r in workers}))
    phases.append(Phase("losses", messages=[(r, 0, traffic.loss_bytes) for r in workers], send_wait="end"))
    if not traffic.ahead:
        phases.append(control)
    for b in range(B):
        s = shard[b]
        phases.append(Phase(f"backward:{b}", work={worker(w): traffic.ready[w][b] - (traffic.ready[w][b - 1] if b else 0.0)
                                                  for w in range(P)}))
        if hierarchical:
            parts = [(worker(v), worker(o), traffic.intra[b]) for o in owners(b) for v in node_of(o)]
            phases.append(Phase(f"intra_reduce:{b}", messages=parts, send_wait="end", recv_wait=f"broadcast:{b}",
                                post_with="losses", fifo=True))
        phases.append(Phase(f"gradients:{b}", messages=[(worker(w), worker(s), traffic.frames[s][b][w])
                                                        for w in owners(b) if w != s],
                            send_wait="end", recv_wait=f"broadcast:{b}", post_with="losses", fifo=True,
                            relay=f"intra_reduce:{b}" if hierarchical else None))
    for b in range(B):
        s = shard[b]
        phases.append(Phase(f"broadcast:{b}", messages=[(worker(s), worker(w), traffic.bcast[s][b])
                                                        for w in owners(b) if w != s],
                            send_wait="end", recv_wait="local", post_with="losses", fifo=True))
        if hierarchical:
            gathers = [(worker(o), worker(v), traffic.intra[b]) for o in owners(b) for v in node_of(o)]
            phases.append(Phase(f"intra_gather:{b}", messages=gathers, send_wait="end", recv_wait="local",
                                post_with="losses", fifo=True, relay=f"broadcast:{b}"))
    phases.append(Phase("local", work={r: rest for r in workers}))
    return Program(phases, list(range(len(phases))))


# ---- the peers -----------------------------------------------------------------------------
def _chunks(nbytes: int, parts: int) -> list[int]:
    """``nbytes`` cut into ``parts`` pieces as even as whole bytes allow."""
    base, extra = divmod(int(nbytes), parts)
    return [base + (k < extra) for k in range(parts)]


def ring_phases(name: str, ring: list[int], nbytes: int) -> list[Phase]:
    """A ring all-reduce of ``nbytes`` over the ranks ``ring`` (in ring order): a
    reduce-scatter then an all-gather, 2 (n - 1) steps, in step k rank ``ring[i]`` sends its
    successor the chunk (i - k) mod n (chunks as even as bytes allow)."""
    n = len(ring)
    if n < 2 or nbytes <= 0:
        return []
    chunks = _chunks(nbytes, n)
    phases = []
    for step in range(2 * (n - 1)):
        phases.append(Phase(name, messages=[(ring[i], ring[(i + 1) % n], chunks[(i - step) % n]) for i in range(n)]))
    return phases


def _half_ring(name: str, ring: list[int], nbytes: int) -> list[Phase]:
    """A ring reduce-scatter (or all-gather) of ``nbytes``: n - 1 steps of 1/n each."""
    n = len(ring)
    if n < 2 or nbytes <= 0:
        return []
    chunks = _chunks(nbytes, n)
    return [Phase(name, messages=[(ring[i], ring[(i + 1) % n], chunks[(i - step) % n]) for i in range(n)])
            for step in range(n - 1)]


def _parallel(groups: list[list[Phase]]) -> list[Phase]:
    """Phases of disjoint groups of ranks run side by side: step k of each in one phase."""
    steps = max((len(g) for g in groups), default=0)
    merged = []
    for k in range(steps):
        parts = [g[k] for g in groups if k < len(g)]
        merged.append(Phase(parts[0].name, messages=[m for p in parts for m in p.messages]))
    return merged


def hierarchical_allreduce_phases(nbytes: int, nodes: int, ranks_per_node: int) -> list[Phase]:
    """The hierarchical all-reduce of ``nbytes`` on ranks 0..N L - 1 (rank r on node r // L):
    a ring reduce-scatter inside every node, a ring all-reduce of each local rank's 1/L across
    the nodes (the L rings at once), a ring all-gather inside every node."""
    L, N = ranks_per_node, nodes
    node_rings = [[node * L + i for i in range(L)] for node in range(N)]
    cross_rings = [[node * L + j for node in range(N)] for j in range(L)]
    share = _chunks(nbytes, L)
    phases = _parallel([_half_ring("intra_reduce", ring, nbytes) for ring in node_rings])
    # Local rank j holds the node's sum of chunk (j + 1) mod L after the reduce-scatter.
    phases += _parallel([ring_phases("allreduce", ring, share[(j + 1) % L]) for j, ring in enumerate(cross_rings)])
    phases += _parallel([_half_ring("intra_gather", ring, nbytes) for ring in node_rings])
    return phases


def ddp_phases(collectives: list[tuple[str, int]], workers: int, compute: float, nodes: int = 1,
               ranks_per_node: int = 1, hierarchical: bool = False) -> Program:
    """A peer's iteration on ``workers`` ranks (rank r is worker r): ``compute`` seconds, then
    each collective ``(name, bytes)`` in turn, a ring all-reduce over the ranks in node order
    (``hierarchical``: the hierarchical all-reduce on ``nodes`` of ``ranks_per_node``)."""
    phases = [Phase("compute", work={r: compute for r in range(workers)})]
    for name, nbytes in collectives:
        if hierarchical:
            phases += hierarchical_allreduce_phases(nbytes, nodes, ranks_per_node)
        else:
            phases += ring_phases(name, list(range(workers)), nbytes)
    return Program(phases)


# ---- what the results say ------------------------------------------------------------------
def breakdown(programs: list[Program], sequence: list[int],
              ends: list[list[float | None]]) -> tuple[list[float], dict[str, float]]:
    """(each iteration's seconds, the mean seconds of each phase name per iteration) of the
    iterations ``sequence`` (indices into ``programs``) from the engine's ``ends[m][k]`` (the
    last rank's end of phase k of iteration m): see the module's docstring. Each iteration
    starts where the one before ended; the phases add up to the iterations."""
    seconds, totals, t = [], {}, 0.0
    for m, index in enumerate(sequence):
        program = programs[index]
        start = t
        for k in program.breakdown_order():
            name = program.phases[k].kind
            totals.setdefault(name, 0.0)
            end = ends[m][k]
            if end is None:
                continue
            end = max(t, end)
            totals[name] += end - t
            t = end
        seconds.append(t - start)
    return seconds, {name: total / max(len(sequence), 1) for name, total in totals.items()}


def weighted_mean(values: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """The mean of ``values`` (0 for none), each counted ``weights[m]`` times (default once):
    how a simulation's figures per iteration average iterations that each stand for several
    (``replay.simulate``'s ``weights``)."""
    if weights is None:
        return sum(values) / len(values) if values else 0.0
    total = sum(weights)
    return sum(w * v for w, v in zip(weights, values)) / total if total else 0.0


def nic_bytes(program: Program, placement: Placement, hosts: int) -> list[tuple[int, int]]:
    """(out, in) bytes of each host's NIC in one iteration of ``program``: every message
    between ranks on two hosts, once on each side."""
    out, into = [0] * hosts, [0] * hosts
    for phase in program.phases:
        for src, dst, n in phase.messages:
            a, b = placement.host[src], placement.host[dst]
            if a != b and n > 0:
                out[a] += n
                into[b] += n
    return list(zip(out, into))


# ---- the hosts' replay: one actor per node ---------------------------------------------------
@dataclass(frozen=True)
class Groups:
    """The actors of the hosts' replay: ``group[rank]`` (the actor a rank's messages and work
    go to) and ``host[group]`` (where each actor sits)."""

    group: tuple[int, ...]
    host: tuple[int, ...]

    @classmethod
    def of(cls, host_of_rank: Sequence[int], alone: Sequence[int] = ()) -> "Groups":
        """The ranks of each host one group, in the order their hosts first come; a rank of
        ``alone`` (rank 0, the scheduler beside node 0's workers) a group of its own."""
        keys: dict[tuple, int] = {}
        group, host = [], []
        for rank, h in enumerate(host_of_rank):
            key = ("rank", rank) if rank in alone else ("host", h)
            if key not in keys:
                keys[key] = len(host)
                host.append(h)
            group.append(keys[key])
        return cls(tuple(group), tuple(host))


#: The hosts' replay leaves out a message between two hosts of less than this share of its
#: phase's largest one (``aggregate``'s ``tiny``), its time kept as a floor.
TINY = 1e-3


#: The hosts' replay bundles the messages between two hosts of less than this share of their
#: phase's largest one (and not tiny): their bytes stay on each NIC, their pairing does not
#: (:func:`bundle`).
SMALL = 1e-2


def aggregate(program: Program, groups: Groups, tiny: float = 0.0, latency: float | None = None,
              bandwidth: float | None = None, small: float = 0.0) -> Program:
    """``program`` with one actor per group (:class:`Groups`): in each phase, a group's work
    the most of its ranks' (each rank has a core of its own), and one message per ordered pair
    of groups: between two hosts the sum of their ranks' messages (one flow, where the exact
    replay has many: the approximation docs/simulate.rst measures), on one host the largest
    (the loopback is a fat pipe, where each message takes its own latency + bytes / rate at
    once, so the largest ends last). The phases, their order and their waits are kept.

    With ``tiny`` > 0 (and the NICs' ``latency`` and ``bandwidth``), a message between two
    hosts of less than ``tiny`` times the phase's largest one is left out, and each end that
    waits for it at once ends the phase no sooner than latency + bytes / bandwidth after it
    posted (the phase's ``floor``): at 256 nodes of 4 the flat exchange's 65,280 flows per
    phase are some 9,000 of frames and 56,000 of empty shards' headers.

    With ``small`` > ``tiny``, the messages between hosts of at least ``tiny`` but less than
    ``small`` times the phase's largest are bundled (:func:`bundle`): the same bytes out of
    and into every NIC in a few flows."""
    phases = []
    for phase in program.phases:
        work: dict[int, float] = {}
        for rank, seconds in phase.work.items():
            g = groups.group[rank]
            work[g] = max(work.get(g, 0.0), seconds)
        merged: dict[tuple[int, int], int] = {}
        for src, dst, n in phase.messages:
            if n <= 0:
                continue
            key = (groups.group[src], groups.group[dst])
            if groups.host[key[0]] == groups.host[key[1]]:
                merged[key] = max(merged.get(key, 0), n)
            else:
                merged[key] = merged.get(key, 0) + n
        floor: dict[int, float] = {}
        if tiny > 0 and latency is not None and bandwidth:
            across = [n for (a, b), n in merged.items() if groups.host[a] != groups.host[b]]
            least = tiny * max(across, default=0)
            for (a, b), n in list(merged.items()):
                if groups.host[a] != groups.host[b] and n < least:
                    del merged[(a, b)]
                    t = latency + n / bandwidth
                    for g, wait in ((a, phase.send_wait), (b, phase.recv_wait)):
                        if wait is None:
                            floor[g] = max(floor.get(g, 0.0), t)
        if small > tiny and bandwidth:
            merged = bundle(merged, groups, small)
        phases.append(Phase(phase.name, work, [(a, b, n) for (a, b), n in merged.items()], phase.send_wait,
                            phase.recv_wait, phase.post_with, floor, phase.fifo, phase.relay))
    return Program(phases, program.order)


def bundle(flows: dict[tuple[int, int], int], groups: Groups, small: float) -> dict[tuple[int, int], int]:
    """``flows`` (group pair -> bytes, one phase) with those between two hosts of less than
    ``small`` times the largest such flow replaced by at most one per sending and receiving
    group: each group sends out, and takes in, the same bytes as before (its NIC's load is
    kept), but not to and from the same groups. Senders and receivers are paired in turn
    (the north-west corner rule), the receivers' list rotated by half, so that an even
    all-to-all (mpigrad's flat exchange of empty shards' headers: 65,280 flows per phase at
    256 nodes, each host to each) becomes one flow per host to the host half-way round;
    where that rotation puts a flow inside one host (two groups on a host: rank 0 beside
    node 0's workers), the next rotations are tried in turn.

    Why the time is kept: on the generated platform only NICs are shared, and a NIC that
    ends the phase carries the same bytes either way; what changes is how the small bytes
    share a NIC with the large ones, which max-min shares per flow (docs/simulate.rst,
    "Speed"). ``flows`` is returned as it is where fewer than two flows are small, or where
    every rotation would put a flow inside one host."""
    across = {key: n for key, n in flows.items() if groups.host[key[0]] != groups.host[key[1]]}
    least = small * max(across.values(), default=0)
    chosen = [key for key, n in across.items() if n < least]
    if len(chosen) < 2:
        return flows
    out: dict[int, int] = {}
    into: dict[int, int] = {}
    for a, b in chosen:
        out[a] = out.get(a, 0) + flows[(a, b)]
        into[b] = into.get(b, 0) + flows[(a, b)]
    senders, receivers = sorted(out), sorted(into)
    half = len(receivers) // 2
    for shift in range(half, half + len(receivers)):
        k = shift % len(receivers)
        paired = _north_west(senders, receivers[k:] + receivers[:k], out, into, groups.host)
        if paired is not None:
            break
    else:
        return flows
    gone = set(chosen)
    kept = {key: n for key, n in flows.items() if key not in gone}
    for key, n in paired.items():
        kept[key] = kept.get(key, 0) + n
    return kept


def _north_west(senders: list[int], receivers: list[int], out: dict[int, int], into: dict[int, int],
                host: Sequence[int]) -> dict[tuple[int, int], int] | None:
    """``out[a]`` bytes from each sender and ``into[b]`` to each receiver (equal totals),
    paired in the lists' order (the north-west corner rule); None where a pair would be two
    groups of one host."""
    paired: dict[tuple[int, int], int] = {}
    i = j = 0
    left_out, left_in = out[senders[0]], into[receivers[0]]
    while i < len(senders) and j < len(receivers):
        a, b = senders[i], receivers[j]
        if host[a] == host[b]:
            return None
        n = min(left_out, left_in)
        if n > 0:
            paired[(a, b)] = paired.get((a, b), 0) + n
        left_out -= n
        left_in -= n
        if left_out == 0:
            i += 1
            left_out = out[senders[i]] if i < len(senders) else 0
        if left_in == 0:
            j += 1
            left_in = into[receivers[j]] if j < len(receivers) else 0
    return paired


def compress_steps(program: Program, groups: Groups, latency: float, intra_latency: float,
                   most: int = 32) -> Program:
    """A ring's steps taken ``s`` at a time (``program`` a peer's, aggregated; its order the
    phases' own): a run of more than ``most`` consecutive phases of one name, no work and the
    same pairs (a ring's 2 (n - 1) steps, each pair's chunk in turn) becomes runs of s steps
    (s the fewest that leave at most ``most``), each one phase of the s steps' bytes per pair
    and then a wait of (s - 1) latencies (a step's: ``latency`` where a message crosses two
    hosts, else ``intra_latency``) on each of its groups, so that a step that pays latency +
    bytes / rate on links it has to itself (as a ring's do) takes the same time merged. Not
    for programs with a breakdown order of their own (mpigrad's)."""
    if program.order is not None:
        return program
    phases, k = [], 0
    items = program.phases
    while k < len(items):
        run = k
        pairs = _pairs(items[k])
        while (run + 1 < len(items) and pairs and not items[run + 1].work and items[run + 1].name == items[k].name
               and _pairs(items[run + 1]) == pairs):
            run += 1
        steps = items[k:run + 1]
        if len(steps) <= most or items[k].work:
            phases += steps
            k = run + 1
            continue
        size = -(-len(steps) // most)
        crosses = any(groups.host[a] != groups.host[b] for a, b in pairs)
        wait = (latency if crosses else intra_latency) or 0.0
        members = sorted({g for pair in pairs for g in pair})
        for start in range(0, len(steps), size):
            chunk = steps[start:start + size]
            total: dict[tuple[int, int], int] = {}
            for step in chunk:
                for a, b, n in step.messages:
                    total[(a, b)] = total.get((a, b), 0) + n
            phases.append(Phase(items[k].name, messages=[(a, b, n) for (a, b), n in total.items()]))
            if len(chunk) > 1 and wait > 0:
                phases.append(Phase(items[k].name, work={g: (len(chunk) - 1) * wait for g in members}))
        k = run + 1
    return Program(phases)


def _pairs(phase: Phase) -> frozenset:
    return frozenset((a, b) for a, b, n in phase.messages if n > 0)
