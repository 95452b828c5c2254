"""A simulation: mpigrad's iterations and the peers' on one platform, run on SimGrid.

:func:`simulate` takes the iterations (each an :class:`~mpigrad.clockmodel.IterationTraffic`
with its local work), the platform and the peers, runs each method's iterations in one
SimGrid simulation of its own (``engine.py``), and returns a :class:`Simulation`: per method
the seconds per iteration (the mean: the last rank's end of the last iteration over their
count), the phases' breakdown (``plan.breakdown``), each NIC's bytes per iteration, and
mpigrad's own clock on the same network where the platform is generated, and how long the
simulation took (``timing``). ``replay``: ``exact`` (one actor per rank) or ``hosts`` (one
actor per node, ``plan.aggregate`` and ``plan.compress_steps``), ``auto`` choosing by the
ranks' count (docs/simulate.rst, "Speed: the hosts' replay").
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from typing import Sequence

from ..clockmodel import IterationTraffic, PipelinedTraffic
from ..errors import UsageError
from .engine import NETWORK_MODELS, run_plan
from .plan import (SMALL, TINY, Groups, Program, aggregate, breakdown, compress_steps, ddp_phases, mpigrad_phases,
                   nic_bytes, pipelined_phases, weighted_mean)
from .platform import Placement, Platform
from .simgrid_module import check_simgrid

__all__ = ["REPLAYS", "EXACT_UP_TO", "replay_mode", "Iteration", "MethodResult", "Simulation", "peer_labels",
           "DEFAULT_PEERS", "simulate", "peer_collectives"]

#: The peers by name (``--peers``): DDP's variants as ``mpigrad bench peers`` names them
#: (``bench/peers.py`` ``VARIANTS``), and the hierarchical all-reduce in float32.
HIERARCHICAL = "hierarchical"
DEFAULT_PEERS = ("fp32", "fp16", "powersgd2", HIERARCHICAL)


def _variants() -> dict:
    from ..bench.peers import VARIANTS

    return VARIANTS


def peer_labels() -> dict[str, str]:
    """Each peer's name (``--peers``) and label."""
    return {**{name: variant.label for name, variant in _variants().items()},
            HIERARCHICAL: "hierarchical all-reduce fp32"}


@dataclass(frozen=True)
class Iteration:
    """One iteration to simulate: its messages, the compute before them and the rest of the
    local work after them (seconds, on every worker); the peers' iteration has the same
    compute. A pipelined one (``pipelined``, a trace's buckets) is replayed bucket by bucket
    (``plan.pipelined_phases``) after ``forward`` seconds of forward pass, its backward's
    buckets as they were ready."""

    traffic: IterationTraffic
    compute: float
    rest: float
    pipelined: PipelinedTraffic | None = None
    forward: float = 0.0

    def program(self, ranks_per_node: int) -> Program:
        """This iteration's phases on nodes of ``ranks_per_node`` workers."""
        if self.pipelined is not None:
            return pipelined_phases(self.pipelined, self.forward, self.rest, ranks_per_node)
        return mpigrad_phases(self.traffic, ranks_per_node, self.compute, self.rest)


@dataclass(frozen=True)
class MethodResult:
    """One method's simulated iterations: ``seconds_per_iteration`` (mean), each iteration's
    seconds, the mean seconds of each phase, and each host's NIC (out, in) bytes per
    iteration (the means weighted where the simulation's iterations are: ``simulate``'s
    ``weights``); ``clock``: mpigrad's clock on the same network (``seconds_per_iteration``,
    ``comm_seconds``, and for a trace ``recorded_t_comm``), None where it cannot say."""

    name: str
    label: str
    seconds_per_iteration: float
    iteration_seconds: tuple[float, ...]
    phases: dict[str, float]
    nic_bytes_per_node: tuple[tuple[int, int], ...]
    hosts: tuple[str, ...] = ()
    clock: dict | None = None
    timing: dict | None = None

    def to_json(self) -> dict:
        return {"label": self.label, "seconds_per_iteration": self.seconds_per_iteration,
                "iteration_seconds": list(self.iteration_seconds), "phases": self.phases,
                "nic_bytes_per_node": [{"host": host, "out": out, "in": into}
                                       for host, (out, into) in zip(self.hosts, self.nic_bytes_per_node)],
                **({"clock": self.clock} if self.clock is not None else {}),
                **({"timing": self.timing} if self.timing is not None else {})}


@dataclass(frozen=True)
class Simulation:
    """A simulation's record: the platform, the network model, the iterations' count and
    what they were (``source``), mpigrad's result, the peers', the notes; ``weights``: how
    many iterations each simulated one stands for (each then simulated alone; empty: one
    each, one after another)."""

    platform: Platform
    model: str
    iterations: int
    source: str
    mpigrad: MethodResult
    peers: tuple[MethodResult, ...] = ()
    notes: tuple[str, ...] = ()
    simgrid_version: str = ""
    colocated: bool = True
    replay: str = "exact"
    weights: tuple[float, ...] = ()

    def to_json(self) -> dict:
        """``--json``: mpigrad's figures at the top level, the peers by name."""
        top = self.mpigrad.to_json()
        return {"seconds_per_iteration": top.pop("seconds_per_iteration"), "phases": top.pop("phases"),
                "nic_bytes_per_node": top.pop("nic_bytes_per_node"), "model": self.model,
                "method": top.pop("label"), **top, "iterations": self.iterations,
                **({"iteration_weights": list(self.weights)} if self.weights else {}), "source": self.source,
                "platform": self.platform.record(), "simgrid_version": self.simgrid_version, "replay": self.replay,
                "peers": {peer.name: peer.to_json() for peer in self.peers}, "notes": list(self.notes)}


@dataclass
class _Runs:
    """Distinct programs and the sequence of them, for one method."""

    programs: list[Program] = field(default_factory=list)
    sequence: list[int] = field(default_factory=list)
    _keys: dict = field(default_factory=dict)

    def add(self, key, build) -> None:
        if key not in self._keys:
            self._keys[key] = len(self.programs)
            self.programs.append(build())
        self.sequence.append(self._keys[key])


#: ``--replay``: ``exact`` (one actor per rank, every message its own flow), ``hosts`` (one
#: actor per node, one flow per pair of nodes and phase: ``plan.aggregate``; a peer's ring
#: steps taken a few at a time: ``plan.compress_steps``), ``auto`` (exact up to
#: :data:`EXACT_UP_TO` ranks, else hosts).
REPLAYS = ("auto", "exact", "hosts")
EXACT_UP_TO = 128


def replay_mode(replay: str, ranks: int) -> str:
    """The replay ``replay`` (a :data:`REPLAYS` name) takes for ``ranks`` ranks."""
    if replay not in REPLAYS:
        raise UsageError(f"--replay must be one of {', '.join(REPLAYS)}, got {replay!r}")
    if replay == "auto":
        return "exact" if ranks <= EXACT_UP_TO else "hosts"
    return replay


def _run(name: str, label: str, runs: _Runs, placement: Placement, platform: Platform, model: str,
         folder: str, clock: dict | None = None, replay: str = "exact", alone: tuple[int, ...] = (),
         weights: Sequence[float] | None = None) -> tuple[MethodResult, str]:
    """One method's iterations (``runs``) on SimGrid: one simulation of them all, each iteration
    starting where the one before ended; with ``weights``, each distinct program in a simulation
    of its own from an idle platform, and every mean weighted (``simulate``)."""
    started = time.monotonic()
    tiny = TINY
    programs, hosts_of = runs.programs, placement.host
    if replay == "hosts":
        groups = Groups.of(placement.host, alone)
        small = SMALL if platform.generated else 0.0  # a platform file's routes may share more than NICs
        programs = [aggregate(program, groups, tiny, platform.latency, platform.bandwidth, small)
                    for program in programs]
        if platform.generated:
            programs = [compress_steps(program, groups, platform.latency, platform.intra_latency)
                        for program in programs]
        hosts_of = groups.host
    plan = {"platform": platform.write(folder), "model": model, "hosts": list(hosts_of),
            "programs": [program.to_json() for program in programs]}
    if weights is None:
        result = run_plan({**plan, "sequence": runs.sequence})
        seconds, phases = breakdown(programs, runs.sequence, result["ends"])
        timing = result.get("timing", {})
    else:  # each distinct iteration alone, as one iteration of a config is
        alone_runs = {index: run_plan({**plan, "sequence": [index]}) for index in dict.fromkeys(runs.sequence)}
        result = alone_runs[runs.sequence[0]]
        each = {index: breakdown(programs, [index], done["ends"]) for index, done in alone_runs.items()}
        seconds = [each[index][0][0] for index in runs.sequence]
        names = list(dict.fromkeys(phase for _, phases in each.values() for phase in phases))
        phases = {phase: weighted_mean([each[index][1].get(phase, 0.0) for index in runs.sequence], weights)
                  for phase in names}
        timing = _summed([done.get("timing", {}) for done in alone_runs.values()])
    at = Placement(tuple(hosts_of))
    per_iteration = [nic_bytes(programs[index], at, platform.hosts) for index in runs.sequence]
    per_node = tuple((round(weighted_mean([nics[host][0] for nics in per_iteration], weights)),
                      round(weighted_mean([nics[host][1] for nics in per_iteration], weights)))
                     for host in range(platform.hosts))
    mean = weighted_mean(seconds, weights)
    timing = {"replay": replay, "seconds": time.monotonic() - started, "ranks": len(placement.host),
              "messages": sum(len(phase.messages) for index in runs.sequence for phase in runs.programs[index].phases),
              **timing}
    return (MethodResult(name, label, mean, tuple(seconds), phases, per_node, tuple(result.get("hosts", ())), clock,
                         timing), result.get("simgrid_version", ""))


def _summed(timings: list[dict]) -> dict:
    """Several SimGrid children's timings as one: seconds and flows added, actors the most."""
    keys = dict.fromkeys(key for timing in timings for key in timing)
    return {key: (max if key == "actors" else sum)(timing.get(key, 0) for timing in timings) for key in keys}


def peer_collectives(peer: str, shapes: Sequence[Sequence[int]]) -> list[tuple[str, int]]:
    """The all-reduces of one iteration of ``peer`` for parameters of ``shapes``, as (name,
    bytes): DDP fp32 (and the hierarchical all-reduce) the whole gradient in float32, the fp16
    hook half of it, PowerSGD three float32 all-reduces: the uncompressed tensors, the P
    factors, the Q factors (``bench.peers.powersgd_elements``: torch's rule of which matrices
    it compresses, n x r and m x r factors of each)."""
    import math

    elements = sum(math.prod(shape) for shape in shapes)
    if peer in ("fp32", HIERARCHICAL):
        return [("allreduce", 4 * elements)]
    variant = _variants().get(peer)
    if variant is None:
        raise UsageError(f"unknown peer {peer!r}; choose from {', '.join(peer_labels())} (or none)")
    if variant.hook == "fp16":
        return [("allreduce", 2 * elements)]
    if variant.hook == "powersgd":
        from ..bench.peers import powersgd_elements

        rest, p, q = powersgd_elements(shapes, variant.rank)
        return [("allreduce_rest", 4 * rest), ("allreduce_p", 4 * p), ("allreduce_q", 4 * q)]
    return [("allreduce", 4 * elements)]


def simulate(iterations: Sequence[Iteration], platform: Platform, *, label: str, source: str, model: str = "cm02",
             peers: Sequence[str] = (), shapes: Sequence[Sequence[int]] = (), clock: list[dict] | None = None,
             notes: Sequence[str] = (), replay: str = "auto", weights: Sequence[float] | None = None) -> Simulation:
    """Simulate ``iterations`` of mpigrad and of each of ``peers`` on ``platform`` (SimGrid's
    network ``model``: a key of ``engine.NETWORK_MODELS``); ``clock``: mpigrad's clock of each
    iteration (dicts of seconds), averaged into the result. ``weights``: how many iterations
    each of ``iterations`` stands for (a recorded run's distinct iterations): each is then
    simulated alone, from an idle platform as one iteration of a config is (``sample`` 1), not
    after the one before, and every mean of the result (seconds, phases, NIC bytes, the clock)
    counts iteration m ``weights[m]`` times; default: the iterations one after another, each
    once. UsageError (one line)."""
    if model not in NETWORK_MODELS:
        raise UsageError(f"--network-model must be one of {', '.join(NETWORK_MODELS)}, got {model!r}")
    if not iterations:
        raise UsageError("nothing to simulate: no iterations")
    if weights is not None and (len(weights) != len(iterations) or any(w <= 0 for w in weights)):
        raise UsageError(f"weights: {len(iterations)} positive numbers needed, one per iteration, got {list(weights)}")
    first = iterations[0].traffic
    placement = Placement.of(platform, first.workers, first.servers, first.colocated)
    L = platform.ranks_per_node
    if first.hierarchical and len(first.slice_bytes) != L:
        raise UsageError(f"a hierarchical exchange of {len(first.slice_bytes)} workers per node runs on nodes of "
                         f"that many, not {L}")
    ours = _Runs()
    for it in iterations:
        ours.add((it.traffic, it.compute, it.rest, it.pipelined, it.forward), lambda it=it: it.program(L))
    mean_clock = None
    if clock:
        mean_clock = {key: weighted_mean([c[key] for c in clock], weights) for key in clock[0]}
    mode = replay_mode(replay, len(placement.host))
    if mode == "hosts" and any(it.pipelined is not None and it.pipelined.intra for it in iterations):
        raise UsageError("the hosts' replay does not take a pipelined hierarchical run (its slice owners forward "
                         "what their node sent them): give --replay exact")
    check_simgrid()
    with tempfile.TemporaryDirectory(prefix="mpigrad-simulate-") as folder:
        result, version = _run("mpigrad", label, ours, placement, platform, model, folder, mean_clock, mode,
                               alone=(0,) if first.colocated else (), weights=weights)
        peer_results = []
        workers = first.workers
        peer_placement = Placement.workers_only(platform)
        for peer in peers:
            collectives = peer_collectives(peer, shapes)
            runs = _Runs()
            for it in iterations:
                runs.add(it.compute, lambda it=it: ddp_phases(collectives, workers, it.compute, platform.nodes, L,
                                                              hierarchical=peer == HIERARCHICAL))
            peer_result, _ = _run(peer, peer_labels()[peer], runs, peer_placement, platform, model, folder,
                                  replay=mode, weights=weights)
            peer_results.append(peer_result)
    return Simulation(platform, model, len(iterations), source, result, tuple(peer_results), tuple(notes), version,
                      first.colocated, mode, tuple(weights or ()))
