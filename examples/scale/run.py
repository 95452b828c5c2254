"""A map at scale, simulated: seconds per iteration of mpigrad's FP32, FP16, Fix 2/4/8,
PowerSGD r2 with 8-bit factors and MQGrad at the bits of a recorded run (colocated servers,
the flat and the hierarchical exchange) against DDP's ring all-reduce in fp32, with the fp16
hook, with the PowerSGD hook (rank 2) and the hierarchical all-reduce, on 2 to 256 nodes of 4
workers at 1 to 100 Gb/s, replayed on SimGrid (``mpigrad simulate``, docs/simulate.rst), and
where each stops paying against DDP.

    python examples/scale/run.py                          # the whole map: some 45 minutes here
    python examples/scale/run.py --nodes 2,8 --rates 1Gb/s
    python examples/scale/run.py --smoke                  # 2 nodes, one rate, a few columns (tests)

The task is examples/compare's (the paper CNN with fc [1024, 2048] on the embedded digits:
9.16 MB of float32 gradient; 50 ms of compute per iteration, the codecs' work by the cost
model), each message 10 us, inside a node 10 GB/s and 5 us. No training runs: each
iteration's messages come from the config (``mpigrad.simulate.traffic.traffic_of``), every
iteration alike, so one iteration says as much as more; PowerSGD's from examples/compare/
lowrank.toml (its two rounds as the runtime sizes them). MQGrad's column is
examples/compare/mqgrad.toml's config at the bits a recorded run of it chose, iteration by
iteration (``--mqgrad-trace``, default tests/data/mqgrad-compare-seed1.h5: 400 iterations on
1 server + 2 workers at 10 MB/s; ``simulate_recorded_bits``): each iteration of the map's
layout at its row's widths and Control, each distinct one simulated once and weighted by its
rows, the column their mean over the run's iterations. ``--replay auto`` (the command's
default): the exact replay up to 128 ranks, one actor per node above. Prints the table that
docs/results.rst shows, the crossovers (for each of mpigrad's columns and each rate, the node
counts where it beats the fastest of DDP's variants, and where that stops), the share of the
per-message latency at the largest node count (the same cells at latency 0), and with
``--figure PATH`` a figure of the table. Needs ``apt-get install python3-simgrid``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.simulate.sources import simulate_config, simulate_recorded_bits
from mpigrad.simulate.traffic import recorded_bits
from mpigrad.units import parse_rate

REPO = Path(__file__).resolve().parents[2]
#: mpigrad's methods: (column, examples/compare config).
METHODS = [("FP32", "fp32"), ("FP16", "fp16"), ("Fix 2", "fix2"), ("Fix 4", "fix4"), ("Fix 8", "fix8"),
           ("PowerSGD 8b", "lowrank"), ("MQGrad", "mqgrad")]
#: The methods simulated at the bits of a recorded run of their config (``--mqgrad-trace``).
RECORDED = {"mqgrad"}
#: The recorded MQGrad run: examples/compare/mqgrad.toml (seed 1), 1 server + 2 workers at 10 MB/s.
MQGRAD_TRACE = REPO / "tests" / "data" / "mqgrad-compare-seed1.h5"
EXCHANGES = [("flat", "flat"), ("hier", "hierarchical")]
#: DDP's variants as ``mpigrad simulate --peers`` names them, and their columns.
PEERS = [("fp32", "DDP fp32"), ("fp16", "DDP fp16"), ("powersgd2", "PowerSGD r2"), ("hierarchical", "DDP hier")]
RANKS_PER_NODE = 4
LATENCY = "10us"
NODES = "2,8,32,128,256"
RATES = "1Gb/s,10Gb/s,100Gb/s"
#: ``--smoke``: one small cell, four columns.
SMOKE = dict(nodes="2", rates="10Gb/s", methods="fix2,lowrank,mqgrad", exchanges="hier", peers="fp32")


def _config(name: str, exchange: str, rate: str, latency: str) -> RunConfig:
    return RunConfig.from_sources(str(REPO / "examples" / "compare" / f"{name}.toml"), {
        "servers": "colocated", "ranks_per_node": RANKS_PER_NODE, "exchange": exchange, "bandwidth": rate,
        "latency": latency})


def cell(nodes: int, rate: str, methods, exchanges, peers, latency: str = LATENCY,
         timings: list | None = None, mqgrad_trace: Path = MQGRAD_TRACE,
         nic_out: dict[str, int] | None = None) -> dict[str, float]:
    """Seconds per iteration of every column on ``nodes`` nodes of 4 at ``rate`` (a recorded
    method's: the mean over ``mqgrad_trace``'s iterations at their bits); ``nic_out`` gets
    each column's busiest NIC's bytes out per iteration."""
    seconds: dict[str, float] = {}
    for k, (column, name) in enumerate(methods):
        for j, (tag, exchange) in enumerate(exchanges):
            wanted = [peer for peer, _ in peers] if (k, j) == (0, 0) else []
            config = _config(name, exchange, rate, latency)
            if name in RECORDED:
                simulation = simulate_recorded_bits(config, nodes, str(mqgrad_trace), peers=wanted)
            else:
                simulation = simulate_config(config, nodes, sample=1, peers=wanted)
            seconds[f"{column} {tag}"] = simulation.mpigrad.seconds_per_iteration
            for (_, label), result in zip(peers, simulation.peers):
                seconds[label] = result.seconds_per_iteration
            if timings is not None:
                timings += [result.timing for result in (simulation.mpigrad, *simulation.peers)]
            if nic_out is not None:
                for key, result in [(f"{column} {tag}", simulation.mpigrad),
                                    *((label, result) for (_, label), result in zip(peers, simulation.peers))]:
                    nic_out[key] = max((out for out, _ in result.nic_bytes_per_node), default=0)
    return seconds


def ours(methods, exchanges) -> list[str]:
    return [f"{column} {tag}" for column, _ in methods for tag, _ in exchanges]


def table(results: dict[tuple[int, str], dict[str, float]], columns: list[str]) -> str:
    """The results as an RST simple table, seconds per iteration."""
    heads = ["nodes", "rate", *columns]
    rows = [[f"{nodes}x{RANKS_PER_NODE}", rate, *(f"{seconds[c]:.4f}" for c in columns)]
            for (nodes, rate), seconds in results.items()]
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(heads)]
    rule = "  ".join("=" * w for w in widths)
    line = lambda cells: "  ".join(c.rjust(w) if k > 1 else c.ljust(w)  # noqa: E731
                                   for k, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([rule, line(heads), rule, *(line(r) for r in rows), rule])


def crossovers(results: dict[tuple[int, str], dict[str, float]], mine: list[str], theirs: list[str]) -> list[str]:
    """For each rate and each of ``mine``: the node counts where it beats the fastest of
    ``theirs`` (by how much at the largest of them), and the first node count from which it
    does not; and each cell's fastest column."""
    lines = []
    rates = list(dict.fromkeys(rate for _, rate in results))
    for rate in rates:
        cells = sorted((nodes, seconds) for (nodes, r), seconds in results.items() if r == rate)
        for column in mine:
            wins = [nodes for nodes, s in cells if s[column] < min(s[t] for t in theirs)]
            if not wins:
                lines.append(f"{rate}: {column} never beats DDP's best")
                continue
            last = max(wins)
            s = dict(cells)[last]
            best = min(theirs, key=s.get)
            stops = [nodes for nodes, _ in cells if nodes > last]
            lines.append(f"{rate}: {column} beats DDP's best at {', '.join(map(str, wins))} node(s) "
                         f"({s[column]:.4f} against {best} {s[best]:.4f} s at {last})"
                         + (f"; not from {stops[0]} on" if stops else ""))
        for nodes, seconds in cells:
            fastest = min(mine + theirs, key=seconds.get)
            lines.append(f"{rate}, {nodes} nodes: fastest {fastest} ({seconds[fastest]:.4f} s)")
    return lines


def figure(results, mine: list[str], theirs: list[str], path: str) -> None:
    """Seconds per iteration against the node count, one panel per rate (matplotlib, Agg)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rates = list(dict.fromkeys(rate for _, rate in results))
    fig = Figure(figsize=(4.6 * len(rates), 4.2))
    FigureCanvasAgg(fig)
    # one colour per method (its flat and hierarchical lines alike), DDP's variants after them
    methods = list(dict.fromkeys(column.rsplit(" ", 1)[0] for column in mine)) + theirs
    palette = matplotlib.colormaps["tab20"]
    colour = {name: palette((2 * k) % 20 + (2 * k) // 20 % 2) for k, name in enumerate(methods)}  # dark shades first
    for k, rate in enumerate(rates):
        ax = fig.add_subplot(1, len(rates), k + 1)
        cells = sorted((nodes, seconds) for (nodes, r), seconds in results.items() if r == rate)
        xs = [nodes for nodes, _ in cells]
        for column in mine + theirs:
            style = "--" if column in theirs else ("-" if column.endswith("hier") else ":")
            method = column if column in theirs else column.rsplit(" ", 1)[0]
            ax.plot(xs, [s[column] for _, s in cells], style, marker="o", markersize=3, label=column,
                    color=colour[method])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{rate}, nodes of {RANKS_PER_NODE}")
        ax.set_xlabel("nodes")
        if k == 0:
            ax.set_ylabel("s per iteration")
    fig.axes[-1].legend(fontsize=5.5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _shown(path: Path) -> str:
    """``path`` as the docs name it: relative to the checkout where it is inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _pick(names: str, table_: list) -> list:
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    picked = [entry for entry in table_ if entry[1] in wanted or entry[0] in wanted]
    if len(picked) != len(wanted):
        raise UsageError(f"unknown column among {names!r}; choose from {', '.join(e[1] for e in table_)}")
    return picked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default=NODES, help=f"node counts (default {NODES}), 4 workers each")
    parser.add_argument("--rates", default=RATES, help=f"NIC rates (default {RATES})")
    parser.add_argument("--methods", default=",".join(name for _, name in METHODS),
                        help="mpigrad's methods (examples/compare configs; default all)")
    parser.add_argument("--exchanges", default="flat,hier", help="flat, hier or both (default)")
    parser.add_argument("--peers", default=",".join(name for name, _ in PEERS), help="DDP's variants (default all)")
    parser.add_argument("--no-latency-share", action="store_true",
                        help="skip the cells at latency 0 that give the latency's share at the largest node count")
    parser.add_argument("--figure", metavar="PATH", help="also draw the table (PNG)")
    parser.add_argument("--json", metavar="PATH", help="also write the cells as JSON")
    parser.add_argument("--mqgrad-trace", type=Path, default=MQGRAD_TRACE, metavar="TRACE",
                        help="the recorded run whose bits MQGrad's column takes, iteration by iteration (default "
                             f"{MQGRAD_TRACE.relative_to(REPO)})")
    parser.add_argument("--smoke", action="store_true", help="one small cell (2 nodes, 10Gb/s, Fix 2, PowerSGD 8b "
                        "and MQGrad hier, DDP fp32)")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.no_latency_share = True
    try:
        nodes = [int(n) for n in args.nodes.split(",")]
        rates = [rate.strip() for rate in args.rates.split(",")]
        for rate in rates:
            parse_rate(rate)
        methods = _pick(args.methods, METHODS)
        exchanges = _pick(args.exchanges, EXCHANGES)
        peers = _pick(args.peers, [(label, name) for name, label in PEERS])
        peers = [(name, label) for label, name in peers]
        started = time.monotonic()
        results, timings, nics = {}, [], {}
        for n in nodes:
            for rate in rates:
                nics[(n, rate)] = {}
                results[(n, rate)] = cell(n, rate, methods, exchanges, peers, timings=timings,
                                          mqgrad_trace=args.mqgrad_trace, nic_out=nics[(n, rate)])
                print(f"# {n} nodes at {rate}: done after {time.monotonic() - started:.0f} s", file=sys.stderr,
                      flush=True)
        shares = {}
        if not args.no_latency_share:
            largest = max(nodes)
            for rate in rates:
                shares[rate] = cell(largest, rate, methods, exchanges, peers, latency="0us",
                                    mqgrad_trace=args.mqgrad_trace)
    except (UsageError, ValueError) as exc:
        print(f"examples/scale/run.py: error: {exc}", file=sys.stderr)
        return 2
    mine = ours(methods, exchanges)
    theirs = [label for _, label in peers]
    print(table(results, mine + theirs))
    recorded = recorded_bits(args.mqgrad_trace) if any(name in RECORDED for _, name in methods) else None
    if recorded is not None:
        print(f"\nMQGrad at the bits of {_shown(args.mqgrad_trace)} (iterations: {len(recorded.bits)}; bits, Control "
              "ahead, count): " + ", ".join(f"{'/'.join(map(str, bits))} {'ahead' if ahead else 'after the losses'} "
                                           f"{count}" for bits, ahead, count in recorded.kinds()))
    print()
    for line in crossovers(results, mine, theirs):
        print(line)
    if shares:
        largest = max(nodes)
        print()
        print(f"the latency's share at {largest} nodes of {RANKS_PER_NODE} ({LATENCY} per message; the same cells "
              "at 0):")
        for rate, zero in shares.items():
            full = results[(largest, rate)]
            print(f"{rate}: " + ", ".join(f"{c} {100 * (full[c] - zero[c]) / full[c]:.1f} %" for c in mine + theirs))
    simulated = sum(t["seconds"] for t in timings)
    cpu = sum(t["cpu"] for t in timings)
    print(f"\n# {len(timings)} simulations: {simulated:.0f} s, SimGrid children {cpu:.0f} s of CPU; "
          f"{time.monotonic() - started:.0f} s in all", file=sys.stderr)
    if args.figure:
        figure(results, mine, theirs, args.figure)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cells": [{"nodes": n, "rate": r, "seconds": s, "nic_out_max": nics[(n, r)]}
                      for (n, r), s in results.items()],
            "latency_zero": shares,
            **({"mqgrad_trace": _shown(args.mqgrad_trace),
                "mqgrad_iterations": [{"bits": list(bits), "ahead": ahead, "iterations": count}
                                      for bits, ahead, count in recorded.kinds()]} if recorded else {})}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
