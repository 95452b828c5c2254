"""Where a simulation's iterations come from: a config (:func:`simulate_config`; at the bits
a recorded run chose, iteration by iteration: :func:`simulate_recorded_bits`) or a trace
(:func:`simulate_trace`), each on its platform, with mpigrad's own clock beside SimGrid's
where the platform is generated. ``mpigrad simulate`` and ``examples/scale/run.py`` call these.
"""

from __future__ import annotations

from typing import Sequence

from ..config import RunConfig
from ..errors import UsageError
from .platform import Platform, from_file, generated
from .replay import Iteration, Simulation, simulate

__all__ = ["simulate_config", "simulate_recorded_bits", "simulate_trace", "layout_name"]


def layout_name(traffic) -> str:
    """The way of aggregating in a few words: ``one server``, ``S servers``, ``colocated``,
    ``colocated, hierarchical``."""
    if traffic.hierarchical:
        return "colocated, hierarchical"
    if traffic.colocated:
        return "colocated"
    return "one server" if traffic.servers == 1 else f"{traffic.servers} servers"


def _platform(platform_file: str | None, nodes: int, L: int, traffic, bandwidth: float, latency: float,
              intra_bandwidth: float, intra_latency: float) -> Platform:
    server_hosts = 0 if traffic.colocated else traffic.servers
    if platform_file:
        return from_file(platform_file, nodes, L, server_hosts)
    return generated(nodes, L, server_hosts, bandwidth, latency, intra_bandwidth, intra_latency)


def simulate_config(config: RunConfig, nodes: int, *, sample: int = 3, model: str = "cm02",
                    peers: Sequence[str] = (), platform_file: str | None = None, replay: str = "auto") -> Simulation:
    """``sample`` iterations of ``config`` (``mpigrad train``'s options) on ``nodes`` nodes of
    its ``ranks_per_node`` workers, at its bits, its ``compute_time`` (and cost model) the local
    work (none without one), on the platform of its ``bandwidth``, ``latency``,
    ``intra_bandwidth`` and ``intra_latency`` (or ``platform_file``). UsageError (one line)."""
    if sample < 1:
        raise UsageError(f"--sample must be at least 1 iteration, got {sample}")
    at = "two rounds per iteration" if _two_rounds(config) else f"at {config.bits} bits"
    return _simulate_config(config, nodes, [(config.bits, None)] * sample, None,
                            f"the config {at}, {sample} iteration(s)", model=model, peers=peers,
                            platform_file=platform_file, replay=replay)


def _two_rounds(config: RunConfig) -> bool:
    """Whether ``config``'s codec sends two rounds per iteration (its bits are its own widths)."""
    from ..codecs import CodecError
    from ..runtime.plan.checks import base_codec

    try:
        return base_codec(config).two_rounds
    except CodecError as exc:
        raise UsageError(str(exc)) from None


def simulate_recorded_bits(config: RunConfig, nodes: int, trace: str, *, model: str = "cm02",
                           peers: Sequence[str] = (), platform_file: str | None = None,
                           replay: str = "auto") -> Simulation:
    """``config``'s iterations at the bits a recorded run chose, iteration by iteration: each
    steps row of the complete trace ``trace`` (``traffic.recorded_bits``) is one iteration of
    ``config`` on ``nodes`` nodes of its ``ranks_per_node`` workers at that row's width per
    quantized layer, its Control ahead of the losses where the row's went ahead; the rest is
    ``config``'s, as in :func:`simulate_config` (the layout, the platform, the local work at the
    row's bits). The distinct (bits, ahead) are simulated once each, in the order of their
    first row, each alone from an idle platform (as :func:`simulate_config`'s one iteration),
    weighted by how many rows had them (``Simulation.weights``), so that the means are over
    the run's iterations. UsageError (one line), also where the trace's codec is not
    ``config``'s (its bits would be another codec's widths)."""
    from .traffic import recorded_bits

    recorded = recorded_bits(trace)
    if recorded.codec != config.codec:
        raise UsageError(f"{trace}: its run's codec is {recorded.codec!r}, the config's {config.codec!r}: its bits "
                         "are widths of the config's codec only")
    kinds = recorded.kinds()
    shown = ", ".join(f"{_widths(bits)}{' ahead' if ahead else ''} x {count}" for bits, ahead, count in kinds)
    return _simulate_config(config, nodes, [(bits, ahead) for bits, ahead, _ in kinds],
                            [count for _, _, count in kinds],
                            f"{trace}'s bits, {len(recorded.bits)} iteration(s): {shown}", model=model,
                            peers=peers, platform_file=platform_file, replay=replay)


def _widths(bits: Sequence[int]) -> str:
    """A bit vector in a few characters: ``2`` where every layer has 2 bits, else ``2/4/8``."""
    return str(bits[0]) if len(set(bits)) == 1 else "/".join(map(str, bits))


def _simulate_config(config: RunConfig, nodes: int, iterations: Sequence[tuple], weights: Sequence[int] | None,
                     source: str, *, model: str, peers: Sequence[str], platform_file: str | None,
                     replay: str) -> Simulation:
    """``config``'s ``iterations``, each (bits, control ahead or None for the config's), on
    ``nodes`` nodes; each distinct one laid out once (``traffic.config_traffic``)."""
    from ..trace import method_label
    from .traffic import clock_link, clock_seconds, config_traffic, local_seconds, resolved_config

    L = config.ranks_per_node
    if not isinstance(L, int):
        raise UsageError("--ranks-per-node auto is what MPI finds at launch: give a number of workers per node")
    if nodes < 1:
        raise UsageError(f"--nodes must be at least 1, got {nodes}")
    workers = nodes * L
    config, notes = resolved_config(config, workers)
    compute = config.compute_time or 0.0
    keys = [(bits if isinstance(bits, int) else tuple(bits), ahead) for bits, ahead in iterations]
    laid_out: dict[tuple, tuple] = {}
    for key in keys:
        if key not in laid_out:
            bits, ahead = key
            ours = config_traffic(config, workers, bits, ahead)
            rest = local_seconds(config, workers, ours, bits) if config.compute_time is not None else 0.0
            laid_out[key] = (ours, Iteration(ours.traffic, compute, rest))
    first = next(iter(laid_out.values()))[0]
    traffic = first.traffic
    if config.compute_time is None:
        notes.append("note: no --compute-time: the iterations have no local work, communication only")
    if any(ours.bound for ours, _ in laid_out.values()):
        notes.append("note: the codec's frame sizes depend on the data: its frames are simulated at their bound "
                     "(the codec's capacity), the most they can take")
    notes += first.notes
    if config.broadcast != "star":
        notes.append(f"note: --broadcast {config.broadcast}: the broadcasts are simulated as a star, as colocated "
                     "servers send them (one copy to each receiver)")
    platform = _platform(platform_file, nodes, L, traffic, config.bandwidth, config.latency, config.intra_bandwidth,
                         config.intra_latency)
    chosen = [laid_out[key][1] for key in keys]
    clock = None
    if platform.generated:
        link = clock_link(platform.bandwidth, platform.latency, L, platform.intra_bandwidth, platform.intra_latency,
                          traffic.colocated)
        clock = []
        for it in chosen:
            seconds, t_comm = clock_seconds(link, it.traffic, it.compute, it.rest)
            clock.append({"seconds_per_iteration": seconds, "comm_seconds": t_comm})
    label = f"mpigrad {method_label(config.to_dict())} ({layout_name(traffic)})"
    return simulate(chosen, platform, label=label, source=source, model=model, peers=peers, shapes=first.shapes,
                    clock=clock, notes=notes, replay=replay, weights=weights)


def simulate_trace(path: str, *, sample: int = 3, spread: bool = False, nodes: int | None = None,
                   ranks_per_node: int | None = None, bandwidth: float | None = None, latency: float | None = None,
                   intra_bandwidth: float | None = None, intra_latency: float | None = None,
                   platform_file: str | None = None, model: str = "cm02", peers: Sequence[str] = (),
                   replay: str = "auto") -> Simulation:
    """``sample`` steps rows of the trace at ``path`` (the first, or ``spread`` over the run)
    replayed at the run's bits with their recorded local work, on its nodes (or
    ``ranks_per_node`` others, for a flat colocated run) and network (or the one given).
    UsageError (one line)."""
    from ..trace import method_label
    from .traffic import clock_link, clock_seconds, model_shapes, trace_config, trace_iterations

    run = trace_iterations(path, sample, spread)
    config = run.config
    workers, colocated = run.workers, run.colocated
    first = run.iterations[0].traffic
    first_pipelined = run.iterations[0].pipelined is not None
    L = run.ranks_per_node if ranks_per_node is None else ranks_per_node
    if L != run.ranks_per_node and first.hierarchical:
        raise UsageError(f"--ranks-per-node {L}: {path} is a hierarchical run on nodes of {run.ranks_per_node}, "
                         "whose messages depend on them")
    if L > 1 and not colocated:
        raise UsageError(f"--ranks-per-node {L}: nodes of several workers are built for --servers colocated runs "
                         f"({path} ran separate servers)")
    if L < 1 or workers % L:
        raise UsageError(f"--ranks-per-node {L} does not divide the trace's {workers} workers")
    if nodes is not None and nodes != workers // L:
        raise UsageError(f"--nodes {nodes}: {path} ran {workers} workers, {workers // L} node(s) of {L}")
    defaults = RunConfig()

    def recorded(name: str, given):
        if given is not None:
            return float(given)
        value = config.get(name, getattr(defaults, name))
        if isinstance(value, str):
            raise UsageError(f"{path} ran with a {name} schedule ({value}): give --{name.replace('_', '-')} with "
                             "one value")
        return float(value)

    bandwidth, latency = recorded("bandwidth", bandwidth), recorded("latency", latency)
    intra_bandwidth, intra_latency = recorded("intra_bandwidth", intra_bandwidth), recorded("intra_latency",
                                                                                             intra_latency)
    platform = _platform(platform_file, workers // L, L, first, bandwidth, latency, intra_bandwidth, intra_latency)
    notes = []
    if config.get("broadcast", "star") != "star":
        notes.append(f"note: the run's --broadcast {config['broadcast']}: the broadcasts are simulated as a star "
                     "(one copy to each receiver)")
    clock = None
    if platform.generated:
        link = clock_link(bandwidth, latency, L, intra_bandwidth, intra_latency, colocated)
        clock = []
        for it in run.iterations:
            seconds, t_comm = clock_seconds(link, it.traffic, it.compute, it.rest, it.pipelined, it.forward,
                                            it.backward)
            clock.append({"seconds_per_iteration": seconds, "comm_seconds": t_comm, "recorded_t_comm": it.t_comm})
        if first_pipelined and L != run.ranks_per_node:
            clock = None  # a pipelined run's schedule is charged on its own nodes only (as trace retime)
            notes.append(f"note: mpigrad's clock charges a pipelined run on its own {run.ranks_per_node} worker(s) "
                         f"per node only: not shown for {L}")
    shapes = model_shapes(trace_config(config, path)) if peers else ()
    rows = [it.iteration for it in run.iterations]
    label = f"mpigrad {method_label(config)} ({layout_name(first)})"
    if first_pipelined:
        notes.append("note: a pipelined run: its frames replayed bucket by bucket as backward made them ready, "
                     "after the slowest worker's forward pass; the peers' all-reduces after the whole compute "
                     "(DDP's own overlap with backward is not replayed)")
    return simulate([Iteration(it.traffic, it.compute, it.rest, it.pipelined, it.forward) for it in run.iterations],
                    platform, label=label,
                    source=f"{path}: iteration(s) {_span(rows)} of {run.rows}, at the run's bits", model=model,
                    peers=peers, shapes=shapes, clock=clock, notes=notes, replay=replay)


def _span(rows: list[int]) -> str:
    if len(rows) > 2 and rows == list(range(rows[0], rows[-1] + 1)):
        return f"{rows[0]}-{rows[-1]}"
    return ", ".join(map(str, rows))
