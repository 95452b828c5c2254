"""``mpigrad bench iteration``: time per iteration, server CPU time and the codec/policy/trace overhead.

Runs real ``mpiexec -n P+S ... mpigrad train --servers S`` jobs (``--model``, the paper CNN by
default, on synthetic CIFAR-shaped data) for each P and S, then reads their traces. Reported per run:

- rank 0's wall time per iteration (median, first iterations skipped as warm-up), and its CPU
  time per iteration (mean over the run, the trace's ``rank0_cpu_seconds``): with
  ``--servers colocated`` rank 0 is scheduler only, and this is the scheduler's own work,
  and how much of it went to polling while waiting (which grows with the time waited);
- server CPU ms: the busiest server's decode + re-encode CPU time per iteration (median;
  rank 0's includes decoding every shard's broadcast), and its ratio to the S = 1 run of the
  same P when that run is in the same invocation;
- the overhead fraction: (encode + decode + policy + tracing) / iteration time, on the wall
  clock with no network model and on the simulated clock at ``--bandwidth`` (the paper's regime);
- trace us: rank 0's CPU time in the trace writer per iteration, flushes included.
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

from ..config import COLOCATED, parse_servers
from ..errors import UsageError
from ..mpiexec import MPIEXEC_HELP, mpiexec_command
from ..units import parse_rate

#: What the table's less obvious columns mean, printed under its header.
COLUMNS_KEY = ("key: rank0 CPU ms = rank 0's CPU time per iteration; of it polls = the part of it spent "
               "polling while waiting for messages (grows with the time waited); server CPU ms = the busiest "
               "server's decode + re-encode CPU per iteration; x S=1 = that over the same P's one-server run "
               "in this invocation (- if none); overhead wall/sim = (encode + decode + policy + trace) over "
               "the iteration, on the wall clock and on the simulated clock at --bandwidth")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts P (default 1,2,4,8)")
    parser.add_argument("--servers", default="1", help="comma-separated server counts S, or colocated "
                        "(every worker serves a shard), e.g. 1,2,colocated (default 1)")
    parser.add_argument("--shard-chunk", type=int, default=None, metavar="ELEMENTS",
                        help="passed to train for S > 1 runs (cut big layers so S servers can balance)")
    parser.add_argument("--model", default="paper-cnn",
                        help="model to train: paper-cnn (default), resnet20, resnet18, package.module:factory")
    parser.add_argument("--iterations", type=int, default=30, help="iterations per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="iterations skipped in the statistics (default 5)")
    parser.add_argument("--bandwidth", default="10MB/s", help="bandwidth for the simulated-clock column (default 10MB/s)")
    parser.add_argument("--mpiexec", default=None, help=MPIEXEC_HELP)
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="extra 'mpigrad train' options after --, e.g. -- --codec qsgd --bits 4")


def run(args: argparse.Namespace) -> int:
    from ..trace import load

    counts = _counts(args.workers, "--workers")
    server_counts = _server_layouts(args.servers)
    if args.iterations <= args.warmup:
        raise UsageError("--iterations must be larger than --warmup")
    parse_rate(args.bandwidth)  # a bad rate fails now, not after the runs
    extra = [a for a in args.train_args if a != "--"]
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", MKL_NUM_THREADS="1")
    print(f"mpigrad bench iteration: {args.model} on synthetic 3x32x32; {os.cpu_count()} CPUs here; runs with more ranks than CPUs "
          "are oversubscribed (wall times then include waiting for a core)")
    header = (f"{'P':>3} {'S':>3} {'rank0 ms/it':>12} {'rank0 CPU ms':>13} {'of it polls':>12} {'compute ms':>11} {'encode ms':>10} {'decode ms':>10} "
              f"{'server CPU ms':>14} {'x S=1':>6} {'policy ms':>10} {'trace us':>9} {'overhead wall':>14} "
              f"{'overhead sim':>13}")
    print(header)
    print(COLUMNS_KEY)
    results = []
    with tempfile.TemporaryDirectory(prefix="mpigrad-bench-") as tmp:
        for p, servers in [(p, s) for p in counts for s in server_counts]:
            trace = Path(tmp) / f"p{p}-s{servers}.h5"
            sharding = ["--servers", str(servers)]
            if servers != 1 and args.shard_chunk:
                sharding += ["--shard-chunk", str(args.shard_chunk)]
            ranks = p + (1 if servers == COLOCATED else servers)
            command = mpiexec_command(ranks, [sys.executable, "-m", "mpi4py", "-m",
                       "mpigrad", "train", "--model", args.model, "--data", "synthetic", "--data-opt", "shape=[3,32,32]",
                       "--policy", "fixed", "--iterations", str(args.iterations),
                       "--net-mode", "off", "--eval-every", "0", "--progress-every", "0",
                       "--trace", str(trace), *sharding, *extra], args.mpiexec)
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                raise UsageError(f"the P={p} S={servers} run failed (exit {done.returncode})")
            tr = load(trace)
            row = _row(p, servers, tr, args.warmup, args.bandwidth)
            single = next((r for r in results if r["workers"] == p and r["servers"] == 1), None)
            row["server_cpu_vs_one_server"] = row["server_cpu_ms"] / single["server_cpu_ms"] if single else None
            results.append(row)
            print(_format(results[-1]), flush=True)
    print(json.dumps({"bench": "iteration", "model": args.model, "results": results}))
    return 0


def _counts(text: str, option: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        raise UsageError(f"{option} expects comma-separated integers, got {text!r}") from None
    if any(n < 1 for n in counts):
        raise UsageError(f"{option} must be >= 1")
    return counts


def _server_layouts(text: str) -> list[int | str]:
    """``--servers``: server counts and ``colocated``, as train reads each."""
    layouts = []
    for item in text.split(","):
        try:
            layouts.append(parse_servers(item.strip()))
        except UsageError as exc:
            raise UsageError(f"--servers: {exc}") from None
    return layouts


def _row(p: int, servers: int | str, tr, warmup: int, bandwidth: str) -> dict:
    steps = tr.steps.iloc[warmup:]
    iteration = np.diff(tr.steps["wall_time"].to_numpy())[warmup - 1:] if warmup else \
        np.diff(np.concatenate([[0.0], tr.steps["wall_time"].to_numpy()]))
    trace_seconds = float(tr.attrs.get("trace_seconds", 0.0)) / max(len(tr.steps), 1)
    rank0_cpu = float(tr.attrs.get("rank0_cpu_seconds", 0.0)) / max(len(tr.steps), 1)
    rank0_polls = float(tr.attrs.get("rank0_wait_cpu_seconds", 0.0)) / max(len(tr.steps), 1)
    codec = (steps["t_encode"] + steps["t_decode"] + steps["t_policy"]).to_numpy() + trace_seconds
    # The same work on the simulated clock: measured local work plus the modelled traffic.
    rate = parse_rate(bandwidth)
    sim = (steps["t_compute"] + steps["t_encode"] + steps["t_decode"] + steps["t_policy"]).to_numpy() \
        + (steps["bytes_up"] + steps["bytes_down"]).to_numpy() / rate
    busy = tr.servers.iloc[warmup:]
    server_cpu = (busy.filter(like="t_decode").to_numpy() + busy.filter(like="t_encode").to_numpy()).max(axis=1)
    return {
        "workers": p,
        "servers": servers,
        "server_cpu_ms": 1e3 * float(np.median(server_cpu)),
        "rank0_ms_per_iteration": 1e3 * float(np.median(iteration)),
        "rank0_cpu_ms": 1e3 * rank0_cpu,
        "rank0_poll_cpu_ms": 1e3 * rank0_polls,
        "compute_ms": 1e3 * float(steps["t_compute"].median()),
        "encode_ms": 1e3 * float(steps["t_encode"].median()),
        "decode_ms": 1e3 * float(steps["t_decode"].median()),
        "policy_ms": 1e3 * float(steps["t_policy"].median()),
        "trace_ms": 1e3 * trace_seconds,
        "overhead_fraction_wall": float(codec.sum() / iteration.sum()),
        "overhead_fraction_sim": float(codec.sum() / sim.sum()),
    }


def _format(r: dict) -> str:
    ratio = r["server_cpu_vs_one_server"]
    ratio = f"{ratio:>6.2f}" if ratio is not None else f"{'-':>6}"
    servers = "col" if r["servers"] == COLOCATED else r["servers"]
    return (f"{r['workers']:>3} {servers:>3} {r['rank0_ms_per_iteration']:>12.1f} {r['rank0_cpu_ms']:>13.2f} "
            f"{r['rank0_poll_cpu_ms']:>12.2f} "
            f"{r['compute_ms']:>11.1f} "
            f"{r['encode_ms']:>10.2f} {r['decode_ms']:>10.2f} {r['server_cpu_ms']:>14.2f} {ratio} "
            f"{r['policy_ms']:>10.3f} {1e3 * r['trace_ms']:>9.1f} "
            f"{r['overhead_fraction_wall']:>13.1%} {r['overhead_fraction_sim']:>13.1%}")
