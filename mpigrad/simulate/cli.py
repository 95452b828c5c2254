"""``mpigrad simulate``: mpigrad's protocol, and its peers', replayed on SimGrid.

Two sources of iterations::

    mpigrad simulate TRACE.h5 [--sample K] [--spread] [platform options]
    mpigrad simulate --nodes N [--ranks-per-node L] [--config FILE] [--bits-from TRACE.h5] [mpigrad train options]

A trace: its first K steps rows (``--spread``: K rows spread over the run), each row's
messages as ``mpigrad trace retime`` rebuilds them and its recorded local work. A config
(``mpigrad train``'s options, read as ``train`` reads them): N nodes of L workers, each
iteration's messages at the config's bits (``traffic.traffic_of``), its ``--compute-time``
(and cost model) as the local work, 0 without one; with ``--bits-from``, at the bits a
recorded run chose, iteration by iteration (``sources.simulate_recorded_bits``). The
platform: ``--nodes``, ``--ranks-per-node``, ``--bandwidth``, ``--latency``,
``--intra-bandwidth`` and ``--intra-latency`` (train's options; default the config's or the
trace's), or ``--platform FILE.xml`` (``platform.py``). docs/simulate.rst has the rest.
"""

from __future__ import annotations

import argparse
import json

from ..config import OPTIONS
from ..errors import UsageError
from .engine import NETWORK_MODELS

__all__ = ["add_arguments", "run"]

#: The options of ``mpigrad train`` that describe the platform, taken with a trace too.
PLATFORM_OPTIONS = ("bandwidth", "latency", "ranks_per_node", "intra_bandwidth", "intra_latency")
#: This command's own options (the rest are ``mpigrad train``'s).
OWN_OPTIONS = ("source", "nodes", "platform", "sample", "spread", "network_model", "peers", "json", "replay", "time",
               "bits_from")
#: The iterations simulated by default.
DEFAULT_SAMPLE = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..runtime.run.launch import add_arguments as train_arguments
    from .replay import DEFAULT_PEERS, EXACT_UP_TO, REPLAYS, peer_labels

    parser.description = ("simulate mpigrad's iterations, and DDP's, on a SimGrid platform: from a trace, or from "
                          "a config (mpigrad train's options) on --nodes N of --ranks-per-node L workers")
    group = parser.add_argument_group("simulation")
    group.add_argument("source", nargs="?", metavar="TRACE", help="a complete trace to replay (default: simulate "
                       "the config that mpigrad train's options below describe)")
    group.add_argument("--nodes", type=int, metavar="N", help="the workers' nodes (a config: needed; a trace: its "
                       "workers / --ranks-per-node); separate servers get hosts of their own besides")
    group.add_argument("--platform", metavar="FILE.xml", help="a SimGrid platform file instead of the generated "
                       "cluster: its hosts in natural order of their names hold the nodes, then the servers")
    group.add_argument("--sample", type=int, metavar="K",
                       help=f"iterations simulated (default {DEFAULT_SAMPLE}; a trace: its first K rows)")
    group.add_argument("--spread", action="store_true", help="a trace: K rows spread over the run, not the first K")
    group.add_argument("--bits-from", metavar="TRACE", help="a config: its iterations at the bits a recorded run "
                       "(a complete trace of the config's codec) chose, each of its iterations' widths and Control, "
                       "each distinct one simulated once, alone, and weighted by its rows")
    group.add_argument("--network-model", default="cm02", choices=sorted(NETWORK_MODELS),
                       help="SimGrid's network model: cm02 (default: CM02 without the TCP window or cross "
                            "traffic, a message takes latency + bytes / bandwidth, concurrent flows share links "
                            "max-min fairly) or lv08 (SimGrid's default, fitted to TCP)")
    group.add_argument("--peers", default=",".join(DEFAULT_PEERS), metavar="LIST",
                       help=f"the peers simulated beside mpigrad on the same platform (default "
                            f"{','.join(DEFAULT_PEERS)}; none for none): {', '.join(peer_labels())}")
    group.add_argument("--replay", default="auto", choices=REPLAYS,
                       help=f"exact: one SimGrid actor per rank, every message a flow of its own; hosts: one actor "
                            f"per node, one flow per pair of nodes and phase (its ranks' bytes summed), a peer's ring "
                            f"steps a few at a time (docs/simulate.rst measures what it changes); auto (default): "
                            f"exact up to {EXACT_UP_TO} ranks, else hosts")
    group.add_argument("--time", action="store_true", help="also print how long each simulation took: wall and CPU "
                       "seconds of its SimGrid child, its actors and flows")
    group.add_argument("--json", action="store_true", help="print the results as one JSON object")
    train_arguments(parser)
    parser.epilog = ("The options of mpigrad train describe the simulated run (with a trace: only the platform's, "
                     "--ranks-per-node, --bandwidth, --latency, --intra-bandwidth, --intra-latency). Needs apt-get "
                     "install python3-simgrid. docs/simulate.rst")


def _peers(text: str) -> list[str]:
    from .replay import peer_labels

    if text.strip() == "none":
        return []
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in peer_labels()]
    if unknown or not names:
        raise UsageError(f"--peers: unknown peer {', '.join(map(repr, unknown)) or repr(text)}; choose from "
                         f"{', '.join(peer_labels())}, or none")
    return names


def _given(args: argparse.Namespace) -> list[str]:
    """The train options given on the command line (their RunConfig names)."""
    given = []
    for name, declared in OPTIONS.items():
        if declared.flag is None:
            continue
        if getattr(args, declared.flag[2:].replace("-", "_"), None) not in (None, []):
            given.append(name)
    return given


def _value(name: str, value):
    """A platform option's value as ``train`` reads it (units parsed); UsageError for a schedule."""
    value = OPTIONS[name].convert(value)
    if name == "ranks_per_node" and not isinstance(value, int):
        raise UsageError("--ranks-per-node auto is what MPI finds at launch: give a number of workers per node")
    if isinstance(value, str):
        raise UsageError(f"--{name.replace('_', '-')} {value}: a schedule is not simulated (the platform's links "
                         "have one rate and latency)")
    return value


def run(args: argparse.Namespace) -> int:
    if args.check or args.ranks is not None:
        raise UsageError("--check and --ranks check a train job; mpigrad simulate takes --nodes N")
    peers = _peers(args.peers)
    from .sources import simulate_config, simulate_recorded_bits, simulate_trace

    sample = DEFAULT_SAMPLE if args.sample is None else args.sample
    common = dict(model=args.network_model, peers=peers, platform_file=args.platform, replay=args.replay)
    if args.bits_from and (args.source or args.sample is not None or args.spread):
        shown = "a trace to replay" if args.source else ("--sample" if args.sample is not None else "--spread")
        raise UsageError(f"--bits-from {args.bits_from}: the iterations are its run's, one of each kind; not with "
                         f"{shown}")
    if args.source:
        given = [name for name in _given(args) if name not in PLATFORM_OPTIONS]
        if args.config or given:
            shown = "--config" if args.config else f"--{given[0].replace('_', '-')}"
            raise UsageError(f"{shown}: a trace's run is its own; with a trace only the platform's options go "
                             "(--nodes, --ranks-per-node, --bandwidth, --latency, --intra-bandwidth, "
                             "--intra-latency, --platform)")
        values = {name: _value(name, getattr(args, name)) for name in PLATFORM_OPTIONS
                  if getattr(args, name) is not None}
        simulation = simulate_trace(args.source, sample=sample, spread=args.spread, nodes=args.nodes, **values,
                                    **common)
    else:
        if args.nodes is None:
            raise UsageError("--nodes N is needed to simulate a config: N nodes of --ranks-per-node L workers "
                             "(or give a trace)")
        if args.spread:
            raise UsageError("--spread picks a trace's rows: a config's iterations are all alike")
        from ..runtime.run.launch import config_from_args

        config = config_from_args(argparse.Namespace(**{key: value for key, value in vars(args).items()
                                                         if key not in OWN_OPTIONS}))
        if args.bits_from:
            simulation = simulate_recorded_bits(config, args.nodes, args.bits_from, **common)
        else:
            simulation = simulate_config(config, args.nodes, sample=sample, **common)
    if args.json:
        print(json.dumps(simulation.to_json(), indent=1))
    else:
        print(describe(simulation, timing=args.time))
    return 0


def _megabytes(n: float) -> str:
    return f"{n / 1e6:.3g}"


def timing_line(timing: dict) -> str:
    """``--time``: how long one method's simulation took."""
    return (f"  simulated in {timing['seconds']:.2f} s ({timing['replay']} replay; SimGrid child "
            f"{timing['wall']:.2f} s wall, {timing['cpu']:.2f} s CPU, of which the run {timing['run_wall']:.2f} s "
            f"wall, {timing['run_cpu']:.2f} s CPU; {timing['actors']} actors, {timing['transfers']} flows for "
            f"{timing['messages']} messages of {timing['ranks']} ranks)")


def describe(simulation, timing: bool = False) -> str:
    """The text report: the platform, then each method's seconds per iteration, its phases
    and its busiest NICs (``timing``: and how long its simulation took)."""
    replay = "" if simulation.replay == "exact" else f", {simulation.replay} replay (one actor per node)"
    lines = [f"mpigrad simulate: {simulation.platform.describe(simulation.colocated)}",
             f"SimGrid {simulation.simgrid_version}, network model {simulation.model}{replay}; {simulation.source}"]
    lines += simulation.notes
    total = 0.0
    for result in (simulation.mpigrad, *simulation.peers):
        head = f"{result.label}: {result.seconds_per_iteration:.4g} s/iteration"
        if result.clock:
            head += (f" (mpigrad's clock {result.clock['seconds_per_iteration']:.4g}, communication "
                     f"{result.clock['comm_seconds']:.4g}")
            if "recorded_t_comm" in result.clock:
                head += f", recorded {result.clock['recorded_t_comm']:.4g}"
            head += ")"
        lines.append(head)
        lines.append("  phases (s): " + "  ".join(f"{name} {seconds:.4g}" for name, seconds in result.phases.items()))
        if result.nic_bytes_per_node:
            out = max(range(len(result.nic_bytes_per_node)), key=lambda h: result.nic_bytes_per_node[h][0])
            into = max(range(len(result.nic_bytes_per_node)), key=lambda h: result.nic_bytes_per_node[h][1])
            name = lambda h: result.hosts[h] if h < len(result.hosts) else f"host {h}"  # noqa: E731
            lines.append(f"  NIC MB per iteration: most out {_megabytes(result.nic_bytes_per_node[out][0])} "
                         f"({name(out)}), most in {_megabytes(result.nic_bytes_per_node[into][1])} ({name(into)})")
        if timing and result.timing:
            lines.append(timing_line(result.timing))
            total += result.timing["seconds"]
    if timing:
        lines.append(f"simulations: {total:.2f} s in all")
    return "\n".join(lines)
