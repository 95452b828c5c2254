"""``mpigrad bench iteration``: rank 0's time per iteration and the codec/policy/trace overhead.

Runs real ``mpiexec -n P+1 ... mpigrad train`` jobs (``--model``, the paper CNN by default,
on synthetic CIFAR-shaped data) for each P, then reads their traces. Reported per P:

- rank 0's wall time per iteration (median, first iterations skipped as warm-up);
- the overhead fraction: (encode + decode + policy + tracing) / iteration time, on the wall
  clock with no network model and on the simulated clock at ``--bandwidth`` (the paper's regime).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from .errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts P (default 1,2,4,8)")
    parser.add_argument("--model", default="paper-cnn",
                        help="model to train: paper-cnn (default), resnet20, resnet18, package.module:factory")
    parser.add_argument("--iterations", type=int, default=30, help="iterations per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="iterations skipped in the statistics (default 5)")
    parser.add_argument("--bandwidth", default="10MB/s", help="bandwidth for the simulated-clock column (default 10MB/s)")
    parser.add_argument("--mpiexec", default=None, help="mpiexec to use (default: the one beside python, else PATH)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="extra 'mpigrad train' options after --, e.g. -- --codec qsgd --bits 4")


def _mpiexec(explicit: str | None) -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    found = explicit or (str(beside) if beside.exists() else shutil.which("mpiexec"))
    if not found:
        raise UsageError("mpiexec not found: pip install mpich, or pass --mpiexec")
    return found


def run(args: argparse.Namespace) -> int:
    from .trace import load

    try:
        counts = [int(p) for p in args.workers.split(",")]
    except ValueError:
        raise UsageError(f"--workers expects comma-separated integers, got {args.workers!r}") from None
    if any(p < 1 for p in counts) or args.iterations <= args.warmup:
        raise UsageError("--workers must be >= 1 and --iterations larger than --warmup")
    extra = [a for a in args.train_args if a != "--"]
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", MKL_NUM_THREADS="1")
    print(f"mpigrad bench iteration: {args.model} on synthetic 3x32x32; {os.cpu_count()} CPUs here; runs "
          "with more ranks than CPUs are oversubscribed (wall times then include waiting for a core)")
    header = (f"{'P':>3} {'rank0 ms/it':>12} {'compute ms':>11} {'encode ms':>10} {'decode ms':>10} "
              f"{'policy ms':>10} {'trace ms':>9} {'overhead wall':>14} {'overhead sim':>13}")
    print(header)
    results = []
    with tempfile.TemporaryDirectory(prefix="mpigrad-bench-") as tmp:
        for p in counts:
            trace = Path(tmp) / f"p{p}.h5"
            command = [_mpiexec(args.mpiexec), "-n", str(p + 1), sys.executable, "-m", "mpi4py", "-m",
                       "mpigrad", "train", "--model", args.model, "--data", "synthetic", "--data-opt", "shape=[3,32,32]",
                       "--policy", "fixed", "--bits", "2", "--iterations", str(args.iterations),
                       "--net-mode", "off", "--eval-every", "0", "--progress-every", "0",
                       "--trace", str(trace), *extra]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                raise UsageError(f"the P={p} run failed (exit {done.returncode})")
            tr = load(trace)
            results.append(_row(p, tr, args.warmup, args.bandwidth))
            print(_format(results[-1]), flush=True)
    print(json.dumps({"bench": "iteration", "model": args.model, "results": results}))
    return 0


def _row(p: int, tr, warmup: int, bandwidth: str) -> dict:
    from .config import parse_rate

    steps = tr.steps.iloc[warmup:]
    iteration = np.diff(tr.steps["wall_time"].to_numpy())[warmup - 1:] if warmup else \
        np.diff(np.concatenate([[0.0], tr.steps["wall_time"].to_numpy()]))
    trace_seconds = float(tr.attrs.get("trace_seconds", 0.0)) / max(len(tr.steps), 1)
    codec = (steps["t_encode"] + steps["t_decode"] + steps["t_policy"]).to_numpy() + trace_seconds
    # The same work on the simulated clock: measured local work plus the modelled traffic.
    rate = parse_rate(bandwidth)
    sim = (steps["t_compute"] + steps["t_encode"] + steps["t_decode"] + steps["t_policy"]).to_numpy() \
        + (steps["bytes_up"] + steps["bytes_down"]).to_numpy() / rate
    return {
        "workers": p,
        "rank0_ms_per_iteration": 1e3 * float(np.median(iteration)),
        "compute_ms": 1e3 * float(steps["t_compute"].median()),
        "encode_ms": 1e3 * float(steps["t_encode"].median()),
        "decode_ms": 1e3 * float(steps["t_decode"].median()),
        "policy_ms": 1e3 * float(steps["t_policy"].median()),
        "trace_ms": 1e3 * trace_seconds,
        "overhead_fraction_wall": float(codec.sum() / iteration.sum()),
        "overhead_fraction_sim": float(codec.sum() / sim.sum()),
    }


def _format(r: dict) -> str:
    return (f"{r['workers']:>3} {r['rank0_ms_per_iteration']:>12.1f} {r['compute_ms']:>11.1f} "
            f"{r['encode_ms']:>10.2f} {r['decode_ms']:>10.2f} {r['policy_ms']:>10.3f} {r['trace_ms']:>9.3f} "
            f"{r['overhead_fraction_wall']:>13.1%} {r['overhead_fraction_sim']:>13.1%}")
