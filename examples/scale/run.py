"""A map at scale, simulated: seconds per iteration of mpigrad's FP32 and Fix 2/4/8 (colocated
servers, the flat and the hierarchical exchange) and of DDP's ring all-reduce in fp32 and
with the fp16 hook, on 2, 8 and 32 nodes of 4 workers at 1 and 10 Gb/s, replayed on SimGrid
(``mpigrad simulate``, docs/simulate.rst).

    python examples/scale/run.py                          # the table (RST) and the crossovers
    python examples/scale/run.py --nodes 2,8 --rates 1Gb/s --sample 2

The task is examples/compare's (the paper CNN with fc [1024, 2048] on the embedded digits:
9.16 MB of float32 gradient; 50 ms of compute per iteration, the codecs' work by the cost
model), each message 10 us, inside a node 10 GB/s and 5 us. No training runs: each
iteration's messages come from the config (``mpigrad.simulate.traffic.traffic_of``), every
iteration alike, so one iteration (``--sample 1``, the default here) says as much as more.
Needs ``apt-get install python3-simgrid``. Prints the table that docs/simulate.rst shows,
then the crossovers: where, along the nodes at one rate, the order of two methods turns.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.simulate.sources import simulate_config
from mpigrad.units import parse_rate

REPO = Path(__file__).resolve().parents[2]
#: mpigrad's methods: (column, examples/compare config).
METHODS = [("FP32", "fp32"), ("Fix 2", "fix2"), ("Fix 4", "fix4"), ("Fix 8", "fix8")]
EXCHANGES = [("flat", "flat"), ("hier", "hierarchical")]
#: DDP's variants as ``mpigrad simulate --peers`` names them, and their columns.
PEERS = [("fp32", "DDP fp32"), ("fp16", "DDP fp16")]
RANKS_PER_NODE = 4
LATENCY = "10us"


def cell(nodes: int, rate: str, sample: int) -> dict[str, float]:
    """Seconds per iteration of every column on ``nodes`` nodes of 4 at ``rate``."""
    seconds: dict[str, float] = {}
    for column, name in METHODS:
        for tag, exchange in EXCHANGES:
            config = RunConfig.from_sources(str(REPO / "examples" / "compare" / f"{name}.toml"), {
                "servers": "colocated", "ranks_per_node": RANKS_PER_NODE, "exchange": exchange,
                "bandwidth": rate, "latency": LATENCY})
            peers = [peer for peer, _ in PEERS] if (name, exchange) == ("fp32", "flat") else []
            simulation = simulate_config(config, nodes, sample=sample, peers=peers)
            seconds[f"{column} {tag}"] = simulation.mpigrad.seconds_per_iteration
            for peer, result in zip(PEERS, simulation.peers):
                seconds[peer[1]] = result.seconds_per_iteration
    return seconds


def columns() -> list[str]:
    return [f"{column} {tag}" for column, _ in METHODS for tag, _ in EXCHANGES] + [label for _, label in PEERS]


def table(results: dict[tuple[int, str], dict[str, float]]) -> str:
    """The results as an RST simple table, seconds per iteration."""
    heads = ["nodes", "rate", *columns()]
    rows = [[f"{nodes}x{RANKS_PER_NODE}", rate, *(f"{seconds[c]:.4f}" for c in columns())]
            for (nodes, rate), seconds in results.items()]
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(heads)]
    rule = "  ".join("=" * w for w in widths)
    line = lambda cells: "  ".join(c.rjust(w) if k > 1 else c.ljust(w)  # noqa: E731
                                   for k, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([rule, line(heads), rule, *(line(r) for r in rows), rule])


def pairs() -> list[tuple[str, str]]:
    """The pairs whose order the crossovers follow: each method flat against hierarchical,
    and each of mpigrad's columns against each of DDP's."""
    ours = [f"{column} {tag}" for column, _ in METHODS for tag, _ in EXCHANGES]
    return ([(f"{column} flat", f"{column} hier") for column, _ in METHODS]
            + [(x, label) for x in ours for _, label in PEERS])


def crossovers(results: dict[tuple[int, str], dict[str, float]]) -> list[str]:
    """Where the faster of two columns (``pairs``) changes from one node count to the next at
    one rate, and the fastest column of each cell."""
    lines = []
    rates = list(dict.fromkeys(rate for _, rate in results))
    for rate in rates:
        cells = sorted((nodes, seconds) for (nodes, r), seconds in results.items() if r == rate)
        for (n0, a), (n1, b) in zip(cells, cells[1:]):
            for x, y in pairs():
                if (a[x] < a[y]) != (b[x] < b[y]):
                    faster, slower = (x, y) if b[x] < b[y] else (y, x)
                    lines.append(f"{rate}: {faster} overtakes {slower} between {n0} and {n1} nodes "
                                 f"({b[faster]:.4f} against {b[slower]:.4f} s at {n1})")
        for nodes, seconds in cells:
            best = min(columns(), key=seconds.get)
            lines.append(f"{rate}, {nodes} nodes: fastest {best} ({seconds[best]:.4f} s)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="2,8,32", help="node counts (default 2,8,32), 4 workers each")
    parser.add_argument("--rates", default="1Gb/s,10Gb/s", help="NIC rates (default 1Gb/s,10Gb/s)")
    parser.add_argument("--sample", type=int, default=1, help="iterations simulated per cell (default 1)")
    args = parser.parse_args(argv)
    try:
        nodes = [int(n) for n in args.nodes.split(",")]
        rates = [rate.strip() for rate in args.rates.split(",")]
        for rate in rates:
            parse_rate(rate)
        started = time.monotonic()
        results = {}
        for n in nodes:
            for rate in rates:
                results[(n, rate)] = cell(n, rate, args.sample)
                print(f"# {n} nodes at {rate}: done after {time.monotonic() - started:.0f} s", file=sys.stderr,
                      flush=True)
    except (UsageError, ValueError) as exc:
        print(f"examples/scale/run.py: error: {exc}", file=sys.stderr)
        return 2
    print(table(results))
    print()
    for line in crossovers(results):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
