"""``mpigrad bench clock``: the simulated clock held against a real rate-limited network.

Each configuration trains once in a network lab (``mpigrad lab``: one node per rank, every
link tbf-limited both ways at the rate; with ``--ranks-per-node L``, nodes of L workers
behind one such link, whose workers talk through shared memory, and the run's
``--ranks-per-node L`` with each ``--exchange``) with ``--net-mode virtual --bandwidth`` the same
rate: the ranks' messages cross the real links, so rank 0's wall clock is the real run, while
its simulated clock charges the modelled messages plus the measured local work (no
``--compute-time``). Both clocks advance over the same iterations. Per configuration, over
the iterations after ``--warmup`` (medians):

- ``real s/it`` and ``sim s/it``: the wall and simulated clocks' increments, and their ratio;
- ``local s``: the measured local work both clocks contain (slowest worker's compute, encode,
  the slowest server's decode, the policy: ``steps`` columns);
- ``real comm`` (real minus local) against ``sim comm`` (the modelled messages, ``t_comm``).

Then, per communication phase (loss gather, Control, gradient gather, broadcast), real against
simulated seconds: the ranks log when they end each phase (``MPIGRAD_PHASE_LOG``,
:mod:`mpigrad.runtime.measure.phaselog`; the lab's nodes share one host clock). A real phase holds
the local work done in it (encoding in the gradient gather, decoding in both rounds); the
simulated one only the messages. Needs root, as the lab.

Beside mpigrad's clock, SimGrid's (``mpigrad simulate``, docs/simulate.rst): each run's trace
replayed on the lab's platform (the run's worker nodes, L workers each, NICs at the rate,
latency 0; ``--simgrid-model``, cm02 by default), in a child ``mpigrad simulate TRACE --json`` after the run; per row ``sg s/it``
(the median over the same steady iterations of its ``iteration_seconds``, with the trace's
recorded local work) and ``sg/real``. Without SimGrid's Python module the bench says so in one
line and the column reads ``-``; a trace that ``mpigrad simulate`` refuses gets its one-line
reason under its row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..config import BROADCASTS, COLOCATED, parse_servers
from ..errors import UsageError
from ..options import check_overwrite
from ..runtime.measure.phaselog import ENV as PHASE_ENV
from ..units import parse_rate

#: ``--codecs`` items: a name, and the train options it stands for.
CODECS = {"fp32": ["--codec", "fp32"], "uniform2": ["--codec", "uniform", "--bits", "2"],
          "uniform4": ["--codec", "uniform", "--bits", "4"], "uniform8": ["--codec", "uniform", "--bits", "8"],
          # PowerSGD rank 2, 8-bit factors and rest, from the first iteration: two rounds per iteration
          "powersgd2q8": ["--codec", "powersgd", "--codec-opt", "rank=2", "--codec-opt", "factor_bits=8",
                          "--codec-opt", "rest_bits=8"]}
#: The ``CODECS`` items that take two rounds per iteration (not pipelined).
TWO_ROUNDS = frozenset({"powersgd2q8"})
SHARD_CHUNK = 32768  # elements: lets several shards balance the paper CNN's two big layers (one-round codecs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts P (default 2,4)")
    parser.add_argument("--servers", default="1,colocated",
                        help="comma-separated layouts: server counts S, colocated, or pipeline (colocated with "
                             "--pipeline) (default 1,colocated)")
    parser.add_argument("--codecs", default="fp32,uniform2,uniform8",
                        help=f"comma-separated, of {', '.join(CODECS)} (default fp32,uniform2,uniform8)")
    parser.add_argument("--broadcast", default="star", help="comma-separated broadcast models: star, tree, mpich (default star)")
    parser.add_argument("--rates", default="10MB/s,100MB/s", help="comma-separated link rates (default 10MB/s,100MB/s)")
    parser.add_argument("--ranks-per-node", default="1",
                        help="comma-separated workers per node L (default 1: a node per rank); L > 1 runs colocated "
                             "servers only, in a lab of P/L nodes of L (mpigrad lab --ranks-per-node)")
    parser.add_argument("--exchange", default="auto",
                        help="comma-separated exchanges for L > 1: flat, hierarchical (default auto: hierarchical)")
    parser.add_argument("--iterations", type=int, default=15, help="iterations per run (default 15)")
    parser.add_argument("--warmup", type=int, default=4, help="iterations left out (default 4)")
    parser.add_argument("--simgrid-model", default="cm02", choices=("cm02", "lv08"),
                        help="the SimGrid column's network model, mpigrad simulate --network-model (default cm02)")
    parser.add_argument("--out", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="'mpigrad train' options after --, e.g. -- --model-opt fc_sizes=[64,64] "
                             "(default: the paper CNN with fc [1024, 2048] on the digits, lr 0.02)")


def _items(text: str, option: str, parse) -> list:
    values = [item.strip() for item in text.split(",") if item.strip()]
    if not values:
        raise UsageError(f"{option} lists nothing")
    try:
        return [parse(value) for value in values]
    except (UsageError, ValueError) as exc:
        raise UsageError(f"{option}: {exc}") from None


def _codec(name: str) -> str:
    if name not in CODECS:
        raise UsageError(f"unknown codec {name!r}; choose from {', '.join(CODECS)}")
    return name


def _broadcast(name: str) -> str:
    if name not in BROADCASTS:
        raise UsageError(f"broadcast must be one of {', '.join(BROADCASTS)}, got {name!r}")
    return name


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


PIPELINE = "pipeline"  # --servers item: colocated servers and the pipelined iteration


EXCHANGES = ("auto", "flat", "hierarchical")


def _exchange(name: str) -> str:
    if name not in EXCHANGES:
        raise UsageError(f"exchange must be one of {', '.join(EXCHANGES)}, got {name!r}")
    return "hierarchical" if name == "auto" else name


def _node_layouts(counts: list[int], exchanges: list[str], workers: list[int], layouts: list) -> list[tuple[int, str]]:
    """(L, exchange) of every node layout asked for; UsageError where L > 1 has no run to
    take it (no colocated layout, or no P it divides)."""
    if any(L > 1 for L in counts) and (COLOCATED not in layouts or not any(p % L == 0 for L in counts if L > 1
                                                                           for p in workers)):
        raise UsageError("--ranks-per-node L > 1 needs --servers colocated and a --workers P that L divides")
    return [(1, "flat")] * (1 in counts) + [(L, exchange) for L in counts if L > 1 for exchange in exchanges]


def _layout(text: str):
    return PIPELINE if text == PIPELINE else parse_servers(text)


def run(args: argparse.Namespace) -> int:
    from ..lab.host import unavailable_reason

    workers = _items(args.workers, "--workers", _count)
    layouts = _items(args.servers, "--servers", _layout)
    codecs = _items(args.codecs, "--codecs", _codec)
    broadcasts = _items(args.broadcast, "--broadcast", _broadcast)
    rates = _items(args.rates, "--rates", lambda text: (text, parse_rate(text)))
    nodes = _node_layouts(_items(args.ranks_per_node, "--ranks-per-node", _count),
                          _items(args.exchange, "--exchange", _exchange), workers, layouts)
    if PIPELINE in layouts and TWO_ROUNDS.intersection(codecs):
        raise UsageError(f"--servers pipeline does not run two-round codecs ({', '.join(sorted(TWO_ROUNDS))})")
    if args.iterations <= args.warmup + 1:
        raise UsageError("--iterations must exceed --warmup by at least 2")
    check_overwrite([args.out] if args.out else [], args.force, error=UsageError)
    reason = unavailable_reason()
    if reason:
        raise UsageError(f"mpigrad bench clock needs the network lab: {reason}")
    extra = [a for a in args.train_args if a != "--"] or ["--model-opt", "fc_sizes=[1024,2048]", "--lr", "0.02"]
    print(f"mpigrad bench clock: simulated against real per iteration, in a network lab; {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}; train options: {' '.join(extra)}", flush=True)
    simgrid_reason = simgrid_unavailable()
    if simgrid_reason:
        print(f"SimGrid column: not measured, {simgrid_reason}", flush=True)
    header = (f"{'P':>3} {'S':>4} {'L':>2} {'exch':>4} {'codec':>9} {'bcast':>5} {'rate':>8} {'real s/it':>10} {'sim s/it':>9} "
              f"{'sim/real':>9} {'local s':>8} {'real comm':>10} {'sim comm':>9} {'comm s/r':>9} {'sg s/it':>8} "
              f"{'sg/real':>8}")
    print(header, flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="mpigrad-bench-clock-") as tmp:
        for p, layout, codec, broadcast, (rate_text, _), (L, exchange) in itertools.product(
                workers, layouts, codecs, broadcasts, rates, nodes):
            if L > 1 and (layout != COLOCATED or p % L or codec in TWO_ROUNDS):
                continue  # nodes of several workers: colocated one-round runs whose P they divide
            trace = Path(tmp) / f"run-{len(results)}.h5"
            ranks = p + (1 if layout in (COLOCATED, PIPELINE) else layout)
            lab_nodes = ["--nodes", str(ranks)] if L == 1 else ["--nodes", str(p // L), "--ranks-per-node", str(L)]
            train_nodes = [] if L == 1 else ["--exchange", exchange]
            sharding = (["--servers", COLOCATED, "--pipeline"] if layout == PIPELINE else ["--servers", str(layout)]) + \
                (["--shard-chunk", str(SHARD_CHUNK)] if layout != 1 and codec not in TWO_ROUNDS else [])
            command = [sys.executable, "-m", "mpigrad", "lab", *lab_nodes, "--rate", rate_text,
                       "--name", "mgbc", "--check", "none", "--", "train", "--policy", "fixed", *CODECS[codec],
                       *sharding, *train_nodes, "--broadcast", broadcast, "--bandwidth", rate_text, "--net-mode", "virtual",
                       "--iterations", str(args.iterations), "--eval-every", "0", "--progress-every", "0",
                       "--trace", str(trace), *extra]
            phase_dir = Path(tmp) / f"phases-{len(results)}"
            done = subprocess.run(command, capture_output=True, text=True,
                                  env={**os.environ, PHASE_ENV: str(phase_dir)})
            if done.returncode != 0:
                print(done.stdout[-2000:] + done.stderr[-2000:], file=sys.stderr)
                raise UsageError(f"the run P={p} S={layout} {codec} {broadcast} at {rate_text} failed "
                                 f"(exit {done.returncode})")
            row = dict(workers=p, servers=layout, ranks_per_node=L, exchange=exchange if L > 1 else "flat",
                       codec=codec, broadcast=broadcast, rate=rate_text,
                       **_clocks(trace, args.warmup),
                       phases=_phases(phase_dir, p, layout, args.warmup, codec in TWO_ROUNDS))
            row.update(_simgrid(trace, p // L, L, rate_text, args.warmup, args.simgrid_model) if not simgrid_reason else
                       {"simgrid_s": None, "simgrid_over_real": None, "simgrid_note": simgrid_reason})
            results.append(row)
            print(_format(row), flush=True)
            print(_format_phases(row["phases"]), flush=True)
            if row["simgrid_s"] is None and not simgrid_reason:
                print(f"      SimGrid: {row['simgrid_note']}", flush=True)
    within = sum(abs(r["sim_over_real"] - 1) <= 0.10 for r in results)
    replayed = [r for r in results if r["simgrid_over_real"] is not None]
    simgrid_within = sum(abs(r["simgrid_over_real"] - 1) <= 0.10 for r in replayed)
    print(f"{within} of {len(results)} rows within 10 % on mpigrad's clock; "
          + (f"SimGrid {simgrid_within} of {len(replayed)} replayed rows" if not simgrid_reason else "SimGrid not measured"))
    report = {"bench": "clock", "load": os.getloadavg()[0], "train_args": extra, "simgrid": simgrid_reason or "measured",
              "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


def simgrid_unavailable() -> str | None:
    """Why the SimGrid column cannot be measured here (one line), or None: the check
    ``mpigrad simulate`` makes before it starts (its Python module is installed)."""
    from ..simulate.simgrid_module import check_simgrid

    try:
        check_simgrid()
    except UsageError as exc:
        return str(exc)
    return None


def _simgrid(trace: Path, nodes: int, ranks_per_node: int, rate: str, warmup: int, model: str = "cm02",
             timeout: float = 600) -> dict:
    """The run's trace replayed by ``mpigrad simulate`` (a child process, ``--json``) on the
    lab's platform: ``nodes`` nodes of ``ranks_per_node`` workers, NICs at ``rate``, latency 0
    (the lab adds none), SimGrid's network ``model`` (``--network-model``); every iteration of the trace, then the
    median over the steady ones (those ``_clocks`` times) of SimGrid's seconds per iteration,
    and of their ratios to the real ones. ``simgrid_s`` None, with the command's one-line
    reason in ``simgrid_note``, where it refuses the trace or fails."""
    from ..trace import load

    steps = load(trace).steps
    command = [sys.executable, "-m", "mpigrad", "simulate", str(trace), "--json", "--peers", "none",
               "--sample", str(len(steps)), "--nodes", str(nodes), "--ranks-per-node", str(ranks_per_node),
               "--bandwidth", rate, "--latency", "0", "--network-model", model]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"simgrid_s": None, "simgrid_over_real": None, "simgrid_note": f"mpigrad simulate took over {timeout:.0f} s"}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"mpigrad simulate exited {done.returncode}"]
        return {"simgrid_s": None, "simgrid_over_real": None, "simgrid_note": lines[-1]}
    result = json.loads(done.stdout)
    # iteration_seconds[m] is iteration m's; the wall clock's m-th diff is iteration m + 1's
    simgrid = np.asarray(result["iteration_seconds"], float)[warmup + 1:]
    real = np.diff(steps["wall_time"].to_numpy(float))[warmup:]
    if len(simgrid) != len(real) or not len(real):
        return {"simgrid_s": None, "simgrid_over_real": None,
                "simgrid_note": f"mpigrad simulate replayed {result.get('iterations')} iteration(s) of {len(steps)}"}
    return {"simgrid_s": float(np.median(simgrid)), "simgrid_over_real": float(np.median(simgrid / real)),
            "simgrid_model": result.get("model"), "simgrid_replay": result.get("replay")}


def _clocks(trace: Path, warmup: int) -> dict:
    """Medians over the steady iterations of one run's two clocks and their parts."""
    from ..trace import load

    steps = load(trace).steps
    real = np.diff(steps["wall_time"].to_numpy(float))[warmup:]
    sim = np.diff(steps["sim_time"].to_numpy(float))[warmup:]
    rows = steps.iloc[warmup + 1:]
    local = (rows["t_compute"] + rows["t_encode"] + rows["t_decode"] + rows["t_policy"]).to_numpy(float)
    real_comm, sim_comm = real - local, rows["t_comm"].to_numpy(float)
    med = lambda x: float(np.median(x))  # noqa: E731
    return {"real_s": med(real), "sim_s": med(sim), "sim_over_real": med(sim / real), "local_s": med(local),
            "real_comm_s": med(real_comm), "sim_comm_s": med(sim_comm),
            "comm_sim_over_real": med(sim_comm / np.maximum(real_comm, 1e-9))}


#: The phases compared: the local work before the loss gather (the compute, on the clock all
#: local work), the four communication phases, and what follows the broadcast (reports, the
#: SGD step: nothing on the clock).
PHASES = ("compute", "losses", "control", "gradients", "broadcast", "after")


def _phases(directory: Path, workers: int, layout, warmup: int, two_rounds: bool = False) -> dict[str, list[float]]:
    """Per phase (``PHASES``), the medians of [real, simulated] seconds over the steady
    iterations: real from the ranks' phase log (the end of each phase on the last rank to
    end it, from the end of the phase before: the last worker's previous iteration, its
    compute, the loss gather on rank 0, the Control on every rank, gradients on the servers,
    broadcast and then the SGD step on the workers), simulated from the clock's charges
    (its local work under "compute"). A pipelined run's "gradients" holds its backward pass and every frame,
    its "broadcast" nothing, and its charge, one for the whole exchange, stands under
    "gradients". With ``two_rounds`` the second round's gradients and broadcast are added to
    the first's, as the clock charges them."""
    from ..runtime.measure.phaselog import read

    colocated = layout in (COLOCATED, PIPELINE)
    worker_ranks = list(range(1, workers + 1)) if colocated else list(range(layout, layout + workers))
    server_ranks = worker_ranks if colocated else list(range(layout))
    lines = read(directory)
    real: dict[str, list[float]] = {phase: [] for phase in PHASES}
    sim: dict[str, list[float]] = {phase: [] for phase in PHASES}
    steady = sorted(lines)[warmup + 1:]
    for m in steady:
        ranks = lines[m]
        if m - 1 not in lines:
            continue
        t = lambda rank, phase: ranks[rank]["t"][phase]  # noqa: E731
        started = max(lines[m - 1][w]["t"]["end"] for w in worker_ranks)
        compute = max(t(w, "begin") for w in worker_ranks)
        losses = t(0, "losses")
        control = max(t(rank, "control") for rank in ranks)
        gradients = max(t(s, "gradients") for s in server_ranks)
        receivers = worker_ranks if colocated else [0, *worker_ranks]
        broadcast = max(t(rank, "broadcast") for rank in receivers)
        after = max(t(w, "end") for w in worker_ranks)
        # Each phase ends no earlier than the one before on this chain: with the Control ahead
        # (``--control ahead``) the workers hold it before rank 0 has gathered the losses, and
        # its span is 0.
        losses = max(losses, compute)
        control = max(control, losses)
        gradients = max(gradients, control)
        broadcast = max(broadcast, gradients)
        spans = {"compute": compute - started, "losses": losses - compute, "control": control - losses,
                 "gradients": gradients - control, "broadcast": broadcast - gradients}
        if two_rounds:
            gradients2 = max(broadcast, *(t(s, "gradients2") for s in server_ranks))
            # the workers' (rank 0's decode and update of its replica is off their path)
            broadcast2 = max(gradients2, *(t(rank, "broadcast2") for rank in worker_ranks))
            spans["gradients"] += gradients2 - broadcast
            spans["broadcast"] += broadcast2 - gradients2
            broadcast = broadcast2
        spans["after"] = max(after, broadcast) - broadcast
        for phase, span in spans.items():
            real[phase].append(span)
        charged = ranks[0].get("sim", {})
        # a hierarchical exchange's reduce-scatter is on the way of the gradients, its all-gather the broadcast's
        inside = {"gradients": ("pipelined", "intra_reduce"), "broadcast": ("intra_gather",)}
        for phase in PHASES:
            name = "local" if phase == "compute" else phase
            sim[phase].append(charged.get(name, 0.0) + sum(charged.get(part, 0.0) for part in inside.get(phase, ())))
    return {phase: [float(np.median(real[phase])), float(np.median(sim[phase]))] if real[phase] else [0.0, 0.0]
            for phase in PHASES}


def _format_phases(phases: dict[str, list[float]]) -> str:
    return "      real (sim) s: " + "  ".join(f"{phase} {real:.4f} ({sim:.4f})" for phase, (real, sim) in phases.items())


def _format(r: dict) -> str:
    servers = {COLOCATED: "col", PIPELINE: "pipe"}.get(r["servers"], r["servers"])
    return (f"{r['workers']:>3} {servers:>4} {r.get('ranks_per_node', 1):>2} {r.get('exchange', 'flat')[:4]:>4} "
            f"{r['codec']:>9} {r['broadcast']:>5} {r['rate']:>8} {r['real_s']:>10.3f} "
            f"{r['sim_s']:>9.3f} {r['sim_over_real']:>9.2f} {r['local_s']:>8.3f} {r['real_comm_s']:>10.3f} "
            f"{r['sim_comm_s']:>9.3f} {r['comm_sim_over_real']:>9.2f} "
            + (f"{r['simgrid_s']:>8.3f} {r['simgrid_over_real']:>8.2f}" if r.get("simgrid_s") is not None
               else f"{'-':>8} {'-':>8}"))
