"""PowerSGD with quantized factors on the task of examples/compare: the runs and the table of
docs/peers.rst, "Quantized low-rank factors".

    python examples/compare/lowrank.py --out runs/lowrank            # the runs, then the table
    python examples/compare/lowrank.py --out runs/lowrank --report   # only the table
    python examples/compare/lowrank.py --out runs/lowrank --smoke    # 2 methods, 1 seed, 4 iterations
    python examples/compare/lowrank.py --out runs/mixed --methods fix2 psgd-f8 psgd-f8-lgreco psgd0-f8 psgd0-f8-lgreco

Every method runs fix2.toml's task (digits, paper CNN fc [1024, 2048], batch 32 per worker,
P = 2, one server) at lr 0.04 for 300 iterations with ``--cost-model none`` (the simulated
clock charges 50 ms of compute per iteration and the messages, nothing for encoding: no
cost model has PowerSGD's matrix products), once per seed at 10 MB/s, and seed 1 again at
100 MB/s: with a fixed policy, a fixed compute charge and frames of fixed size the losses
do not depend on the bandwidth and every seed's clock is the same, so one trace per method
gives the 100 MB/s clock of every seed (the table checks that the iterations to the target
agree where both rates ran a seed). Traces: OUT/<method>-<rate>-s<seed>.h5; complete ones
are skipped. The table (stdout and OUT/lowrank.md): bytes a worker sends per iteration
(at the last iteration, after PowerSGD's start; a ``MOVING`` method's the mean after the
start over the iterations and seeds), iterations and simulated seconds to the target (trailing mean of
20 losses <= 2.5), seconds per iteration after the start, final loss.

``psgd-f8-lgreco`` (``psgd0-f8-lgreco`` from iteration 0): PowerSGD whose per-layer setting L-GreCo chooses (``--codec-opt
ranks=1,2,4 widths=2,4,8``, ``--policy lgreco``; docs/policies.rst): its frames change with
its decisions, which differ per seed, so it runs every seed at every rate (``MOVING``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "fix2.toml"
START = 40  # PowerSGD's float32 iterations, 10 % of 400 as in docs/peers.rst
_P = ["--codec", "powersgd", "--codec-opt", "rank=2"]


def _psgd(start: int = START, **widths) -> list[str]:
    out = _P + ["--codec-opt", f"start={start}"]
    for key, value in widths.items():
        out += ["--codec-opt", f"{key}={value}"]
    return out


#: method -> the train options that make it, in the table's order
METHODS = {
    "fp32": ["--codec", "fp32"],
    "fix2": [],
    "psgd": _psgd(),
    "psgd-rest8": _psgd(rest_bits=8),
    "psgd-f8": _psgd(factor_bits=8),
    "psgd-f8-rest8": _psgd(factor_bits=8, rest_bits=8),
    "psgd-f4": _psgd(factor_bits=4),
    "psgd-f4-rest8": _psgd(factor_bits=4, rest_bits=8),
    "psgd0": _psgd(0),
    "psgd0-f8-rest8": _psgd(0, factor_bits=8, rest_bits=8),
    "psgd0-f8": _psgd(0, factor_bits=8),
    "psgd-f8-lgreco": _psgd(factor_bits=8, ranks="1,2,4", widths="2,4,8") + ["--policy", "lgreco"],
    "psgd0-f8-lgreco": _psgd(0, factor_bits=8, ranks="1,2,4", widths="2,4,8") + ["--policy", "lgreco"],
}
#: Methods whose frames (so clocks) differ per seed: every seed at every rate.
MOVING = ("psgd-f8-lgreco", "psgd0-f8-lgreco")
SEEDS = (1, 2, 3)
RATES = ("10MB/s", "100MB/s")
ITERATIONS, LR, TARGET, SMOOTH = 300, 0.04, 2.5, 20
SMOKE = dict(methods=("fix2", "psgd-f8-rest8"), seeds=(1,), iterations=4, target=4.3, smooth=1)


def trace_path(out: Path, method: str, rate: str, seed: int) -> Path:
    return out / f"{method}-{rate.replace('/', '')}-s{seed}.h5"


def plan(out: Path, methods, seeds) -> list[tuple[str, str, int, Path]]:
    """(method, rate, seed, trace): every seed at the first rate, seed 1 at the others
    (every seed for a ``MOVING`` method)."""
    return [(m, rate, seed, trace_path(out, m, rate, seed)) for m in methods for rate in RATES
            for seed in (seeds if rate == RATES[0] or m in MOVING else seeds[:1])]


def _status():
    spec = importlib.util.spec_from_file_location("compare_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.status


def run_all(runs, iterations: int) -> int:
    from mpigrad.mpiexec import mpiexec_command

    status, failed = _status(), 0
    env = {**os.environ, **{k: os.environ.get(k, "1") for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                                   "NUMBA_NUM_THREADS")}}
    for k, (method, rate, seed, trace) in enumerate(runs, 1):
        if status(trace) == "complete":
            continue
        print(f"[{k}/{len(runs)}] {trace.name}", flush=True)
        command = mpiexec_command(3, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", "train", "--config",
                                      str(CONFIG), *METHODS[method], "--lr", f"{LR:g}", "--iterations",
                                      str(iterations), "--cost-model", "none", "--eval-every", "0",
                                      "--bandwidth", rate, "--seed", str(seed), "--trace", str(trace), "--force"])
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            failed += 1
            print(f"  failed (exit {result.returncode}): {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return failed


def _mean(values, digits: int) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "not reached"
    spread = f" ± {np.std(values, ddof=1):.{digits}f}" if len(values) > 1 else ""
    return f"{np.mean(values):.{digits}f}{spread}"


def table(out: Path, methods, seeds, target: float, smooth: int) -> str:
    from mpigrad.analysis.summary import iterations_to_target
    from mpigrad.trace import load, method_label

    lines = ["| method | B sent / worker / it | its to target (per seed) | sim s to target, 10 MB/s | "
             "100 MB/s | sim s / it after start, 10 MB/s | 100 MB/s | final loss |",
             "|---|---|---|---|---|---|---|---|"]
    for method in methods:
        runs = {rate: [load(trace_path(out, method, rate, s)) for s in seeds
                       if trace_path(out, method, rate, s).exists()] for rate in RATES}
        slow, fast = runs[RATES[0]], runs[RATES[1]]
        if not slow:
            continue
        its = [iterations_to_target(t, target, smooth) for t in slow]
        moving = method in MOVING
        for trace in fast:  # another rate: the same losses; another seed at it: the same clock
            seed = int(trace.config["seed"])
            assert iterations_to_target(trace, target, smooth) == its[seeds.index(seed)], (method, seed)
            assert moving or np.array_equal(trace.steps["sim_time"], fast[0].steps["sim_time"]), (method, seed)

        def to_target(trace, own=None) -> str:  # the clock after each seed's iterations to the target
            if trace is None:
                return "-"
            clocks = own if own is not None else [trace] * len(its)  # MOVING: each seed's own clock
            return _mean([None if n is None or n > len(t.steps) else float(t.steps["sim_time"].iloc[n - 1])
                          for n, t in zip(its, clocks)], 1)

        def per_iteration(trace) -> str:  # median simulated seconds per iteration after the start
            return "-" if trace is None else f"{np.median(np.diff(trace.steps['sim_time'].to_numpy())[start + 1:]):.4f}"

        start = int(slow[0].config.get("codec_opts", {}).get("start", 0))
        first_fast = fast[0] if fast else None
        sent = int(slow[0].workers.filter(like="bytes_sent").to_numpy()[-1, 0])
        if moving:  # its frames change: the mean after the start, over the iterations and seeds
            sent = int(round(np.mean([t.workers.filter(like="bytes_sent").to_numpy()[start:, 0].mean()
                                      for t in slow])))
        final = np.mean([t.steps["loss"].to_numpy()[-smooth:].mean() for t in slow])
        lowrank = slow[0].config.get("codec") == "powersgd"
        label = method_label(slow[0].config) + (f" start {start}" if lowrank and start != START else "")
        lines.append(f"| {label} | {sent} | {', '.join(str(n) if n else '-' for n in its)} | "
                     f"{to_target(slow[0], slow if moving else None)} | "
                     f"{to_target(first_fast, fast if moving and len(fast) == len(slow) else None)} | "
                     f"{per_iteration(slow[0])} | "
                     f"{per_iteration(first_fast)} | {final:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--report", action="store_true", help="only the table, from existing traces")
    parser.add_argument("--smoke", action="store_true", help="2 methods, 1 seed, 4 iterations")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), metavar="METHOD",
                        help=f"only these methods (default all: {', '.join(METHODS)})")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), metavar="SEED",
                        help="the seeds (default 1 2 3)")
    args = parser.parse_args(argv)
    methods, seeds, iterations, target, smooth = (args.methods or list(METHODS), tuple(args.seeds), ITERATIONS,
                                                  TARGET, SMOOTH)
    if args.smoke:
        methods, seeds, iterations, target, smooth = (list(SMOKE["methods"]), SMOKE["seeds"], SMOKE["iterations"],
                                                      SMOKE["target"], SMOKE["smooth"])
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0 if args.report else run_all(plan(args.out, methods, seeds), iterations)
    text = table(args.out, methods, seeds, target, smooth)
    (args.out / "lowrank.md").write_text(text)
    print(text, end="")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
