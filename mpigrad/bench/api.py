"""``mpigrad bench api``: the library's loop against ``mpigrad train``, per iteration.

Runs the same config (``--config FILE`` and ``--set KEY=VALUE``, over train's defaults) as
real ``mpiexec`` jobs, alternately: ``mpigrad train``, and ``mpigrad.bench.api_loop``, which
is train's recipe written as a script's own loop over :class:`mpigrad.Session` (its model,
shard of batches, optimizer and rates built as train builds them; torch's optimizer steps).
Reported: each run's rank-0 wall time per iteration (median over the iterations after
``--warmup``), the loop's over train's per pair of runs and of the medians over the pairs,
the pairs' spread, and the goal's verdict only where the spread does not straddle it
(:func:`verdict`);
and whether each pair's losses (every worker's, every iteration) are equal to the last bit,
which they are where torch's optimizer computes train's update (plain SGD does). The pairs
alternate which run goes first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..config import COLOCATED, RunConfig, dump_toml, load_toml, parse_assignments
from ..errors import UsageError
from ..mpiexec import MPIEXEC_HELP, mpiexec_command

#: What the bench sets over the user's config: no evaluation or progress lines inside the
#: timed iterations (the loop evaluates nothing), the wall clock as it is.
FORCED = {"eval_every": 0, "progress_every": 0}
#: Keys that would stop or resume a timed run (a checkpoint, a walltime): refused here.
TRAIN_ONLY = ("resume", "checkpoint", "checkpoint_every", "walltime")
#: The ratio the issue asks the loop to stay within.
GOAL = 1.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE", help="a train config (TOML) for both runs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config key over the file's, e.g. --set codec=uniform, or a table's entry, "
                        "--set model_opts.fc_sizes=[64,64] (repeatable)")
    parser.add_argument("--workers", type=int, default=2, help="workers P (default 2)")
    parser.add_argument("--iterations", type=int, default=60, help="iterations per run (default 60)")
    parser.add_argument("--warmup", type=int, default=10, help="iterations left out of the medians (default 10)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="pairs of runs (train, then the loop), alternating (default 3)")
    parser.add_argument("--mpiexec", default=None, help=MPIEXEC_HELP)


def run(args: argparse.Namespace) -> int:
    from ..trace import load

    if args.workers < 1 or args.repeats < 1 or args.warmup < 1:
        raise UsageError("--workers, --repeats and --warmup must be >= 1")
    if args.iterations <= args.warmup + 1:
        raise UsageError("--iterations must exceed --warmup by at least 2")
    values = bench_config(args.config, args.set, args.iterations)
    config = RunConfig.from_sources(None, values)  # every value checked before any run
    ranks = args.workers + (1 if config.servers == COLOCATED else config.servers)
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", MKL_NUM_THREADS="1")
    where = "colocated servers" if config.servers == COLOCATED else f"{config.servers} server(s)"
    print(f"mpigrad bench api: {config.model} on {config.data}, P={args.workers} workers, {where}, "
          f"{config.codec} codec, policy {config.policy}{', pipelined' if config.pipeline else ''}; "
          f"{args.iterations} iterations per run, the first {args.warmup} left out; {os.cpu_count()} CPUs here"
          + (" (oversubscribed: wall times include waiting for a core)" if ranks > (os.cpu_count() or 1) else ""),
          flush=True)
    print(f"{'pair':>4} {'train ms/it':>12} {'loop ms/it':>11} {'loop/train':>11}", flush=True)
    rows, equal = [], None
    with tempfile.TemporaryDirectory(prefix="mpigrad-bench-api-") as tmp:
        for pair in range(1, args.repeats + 1):
            traces = {}
            # Alternate which goes first, so that an order effect falls on both sides.
            for kind in ("train", "loop") if pair % 2 else ("loop", "train"):
                trace = Path(tmp) / f"{kind}-{pair}.h5"
                path = Path(tmp) / f"{kind}-{pair}.toml"
                path.write_text(dump_toml({**values, "trace": str(trace)}))
                _launch(kind, path, ranks, args.mpiexec, env)
                traces[kind] = load(trace)
            same = losses_equal(traces["train"], traces["loop"])
            if equal is None or (equal.startswith("equal") and not same.startswith("equal")):
                equal = same if same.startswith("equal") else f"pair {pair}: {same}"
            row = {kind: per_iteration_ms(traces[kind], args.warmup) for kind in ("train", "loop")}
            row["ratio"] = row["loop"] / row["train"]
            rows.append(row)
            print(f"{pair:>4} {row['train']:>12.2f} {row['loop']:>11.2f} {row['ratio']:>11.3f}", flush=True)
    train_ms = float(np.median([r["train"] for r in rows]))
    loop_ms = float(np.median([r["loop"] for r in rows]))
    ratios = [r["ratio"] for r in rows]
    ratio = loop_ms / train_ms
    goal = verdict(ratios, GOAL)
    print(f"median: train {train_ms:.2f} ms/it, the loop {loop_ms:.2f} ms/it: {ratio:.3f}x "
          f"(pairs {min(ratios):.3f}-{max(ratios):.3f}); goal <= {GOAL}x: {goal}")
    pairs = f"{args.repeats} pair" + ("" if args.repeats == 1 else "s")
    print(f"losses: {equal}" + (f", in all {pairs}" if equal.startswith("equal") else ""))
    print(json.dumps({"bench": "api", "workers": args.workers, "config": values, "pairs": rows,
                      "train_ms": train_ms, "loop_ms": loop_ms, "ratio": ratio,
                      "spread": [min(ratios), max(ratios)], "goal": goal.split(":")[0], "losses": equal}))
    return 0


def verdict(ratios: list[float], goal: float) -> str:
    """The goal's verdict from the pairs' ratios (loop over train): ``met`` where every pair is
    within it, ``missed`` where none is, and no verdict where the pairs' spread straddles it
    (one pair says nothing of the spread): a verdict that another run could flip is none."""
    if len(ratios) < 2:
        return "no verdict: one pair shows no spread (--repeats 3 or more)"
    if max(ratios) <= goal:
        return "met"
    if min(ratios) > goal:
        return "missed"
    return (f"no verdict: the pairs' spread {min(ratios):.3f}-{max(ratios):.3f}x straddles it "
            "(more --repeats, on a quieter machine)")


def bench_config(config_file: str | None, assignments: list[str], iterations: int) -> dict:
    """The runs' config values: the file's, then ``--set``'s (tables merged), then the bench's
    own (``FORCED``, ``iterations``); train's own keys (``TRAIN_ONLY``) refused."""
    values = load_toml(config_file) if config_file else {}
    for key, value in (parse_assignments(assignments, "--set") or {}).items():
        table, dot, entry = key.partition(".")
        if dot:  # a table's entry: model_opts.fc_sizes=[64,64]
            values[table] = {**values.get(table, {}), entry: value}
        else:
            values[key] = value
    train_only = sorted(key for key in TRAIN_ONLY if values.get(key))
    if train_only:
        raise UsageError(f"{', '.join(train_only)}: the bench times whole runs without checkpoints: leave it out")
    values = {**values, **FORCED, "iterations": iterations}
    try:
        dump_toml(values)  # what both runs will read: a value TOML cannot hold is refused now
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return {key: value for key, value in values.items() if value is not None}


def _launch(kind: str, config_file: Path, ranks: int, mpiexec: str | None, env: dict) -> None:
    program = ["-m", "mpigrad", "train", "--config", str(config_file)] if kind == "train" else \
        ["-m", "mpigrad.bench.api_loop", str(config_file)]
    command = mpiexec_command(ranks, [sys.executable, "-m", "mpi4py", *program], mpiexec)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise UsageError(f"the {kind} run failed (exit {done.returncode}): {' '.join(command)}")


def per_iteration_ms(trace, warmup: int) -> float:
    """Rank 0's median wall milliseconds per iteration after the first ``warmup`` (>= 1), as
    ``bench iteration`` counts them: the iterations' ends apart."""
    wall = trace.steps["wall_time"].to_numpy()
    return 1e3 * float(np.median(np.diff(wall)[warmup - 1:]))


def losses_equal(train, loop) -> str:
    """Whether every worker's loss of every iteration is the same float in both traces, in words."""
    left, right = train.workers.filter(like="loss_"), loop.workers.filter(like="loss_")
    if left.shape != right.shape:
        return f"not comparable ({left.shape} against {right.shape})"
    a, b = left.to_numpy(), right.to_numpy()
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if same.all():
        return f"equal to the last bit (every worker's, all {a.shape[0]} iterations)"
    m = int(np.argwhere(~same.all(axis=1))[0][0])
    return (f"differ from iteration {m} on (train {a[m].tolist()}, the loop {b[m].tolist()}): "
            "the loop's optimizer does not compute train's update bit for bit")
