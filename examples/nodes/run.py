"""Does the verdict move when workers share a NIC? The comparison's central methods on 4
workers as 4 nodes of 1, and as 2 nodes of 2 with the flat and the hierarchical exchange.

    python examples/nodes/run.py --out runs/nodes            # every run, then the report
    python examples/nodes/run.py --out runs/nodes --list     # the planned runs
    python examples/nodes/run.py --out runs/nodes --report   # only the report
    python examples/nodes/run.py --out runs/nodes-smoke --smoke   # Fix 2 and FP32, 1 seed, 6 iterations

The settings are examples/compare's (base.toml: the embedded digits, the paper CNN with
``fc_sizes = [1024, 2048]``, 400 iterations, 50 ms of compute charged per iteration, 10 MB/s
and 0.5 ms per NIC on the simulated clock) with colocated servers and 4 workers: mpiexec -n 5.
Methods: FP32, Fix 2/4/8, MQGrad (from 2 bits, 2..8) and PowerSGD r2 with 8-bit factors;
seeds 1, 2, 3.

The runs go one after another in one MPI job (``mpigrad sweep``). A flat run's messages do
not depend on its nodes, and where its policy does not read the clock neither do its bits
or losses: its 2 x 2 flat trace is its 4 x 1 trace re-charged on nodes of 2
(``mpigrad trace retime --ranks-per-node 2``), not a second run. MQGrad reads the clock and
PowerSGD's two rounds cannot be re-timed: they run on both. The report
(OUT/nodes.{txt,md,csv,png}) is ``mpigrad trace compare``'s: time to a training loss of 2.5
smoothed over 20 iterations, with 95 % intervals over the seeds, by method and layout.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RANKS = 5
SEEDS = (1, 2, 3)
TARGET_LOSS, SMOOTH, AT = 2.5, 20, "30s,60s"
METHODS = {
    "fp32": ["--codec", "fp32", "--policy", "fixed"],
    "fix2": ["--policy", "fixed", "--bits", "2"],
    "fix4": ["--policy", "fixed", "--bits", "4"],
    "fix8": ["--policy", "fixed", "--bits", "8"],
    "mqgrad": ["--policy", "mqgrad", "--bits", "2", "--policy-opt", "min_bits=2", "--policy-opt", "max_bits=8"],
    "lowrank": ["--codec", "powersgd", "--policy", "fixed", "--codec-opt", "rank=2", "--codec-opt", "factor_bits=8",
                "--codec-opt", "rest_bits=8", "--codec-opt", "start=0"],
}
#: layout -> (--ranks-per-node, --exchange)
LAYOUTS = {"4x1": (1, "flat"), "2x2-flat": (2, "flat"), "2x2-hier": (2, "hierarchical")}
#: Methods whose 2 x 2 flat trace is their 4 x 1 trace re-timed (no clock in their bits, one round).
RETIMED = ("fp32", "fix2", "fix4", "fix8")


def trace_of(out: Path, method: str, layout: str, seed: int) -> Path:
    return out / f"{method}-{layout}-s{seed}.h5"


#: --smoke: the pipeline end to end in seconds (tests/test_nodes_example.py).
SMOKE = dict(methods=("fix2", "fp32"), seeds=(1,), extra=["--iterations", "6", "--eval-every", "3"])


def plan(out: Path, methods=tuple(METHODS), seeds=SEEDS,
         extra: list[str] = ()) -> tuple[list[list[str]], list[tuple[Path, Path]]]:
    """(the sweep's runs as train options, the (4 x 1 trace, 2 x 2 flat trace) pairs to re-time)."""
    runs, retimed = [], []
    for method in methods:
        options = METHODS[method]
        for layout, (L, exchange) in LAYOUTS.items():
            for seed in seeds:
                trace = trace_of(out, method, layout, seed)
                if layout == "2x2-flat" and method in RETIMED:
                    retimed.append((trace_of(out, method, "4x1", seed), trace))
                    continue
                runs.append(["--config", str(HERE / "base.toml"), *options, "--ranks-per-node", str(L),
                             "--exchange", exchange, "--seed", str(seed), "--trace", str(trace), *extra])
    return runs, retimed


def run_all(out: Path, runs: list[list[str]], retimed: list[tuple[Path, Path]]) -> int:
    from mpigrad.mpiexec import mpiexec_command

    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / "runs.txt"
    runs_file.write_text("".join(shlex.join(run) + "\n" for run in runs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    sweep = subprocess.run(mpiexec_command(RANKS, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", "sweep",
                                                   str(runs_file)]), env=env)
    if sweep.returncode != 0:
        print(f"run.py: the sweep exited {sweep.returncode}: rerun to continue where it stopped", file=sys.stderr)
        return sweep.returncode
    for source, target in retimed:
        if not target.exists():
            subprocess.run([sys.executable, "-m", "mpigrad", "trace", "retime", str(source), "--bandwidth", "10MB/s",
                            "--ranks-per-node", "2", "-o", str(target)], check=True)
    return 0


def report(out: Path, target_loss: float = TARGET_LOSS, smooth: int = SMOOTH) -> None:
    from mpigrad.analysis import parse_points, render
    from mpigrad.analysis.compare import compare_columns, compare_rows, group_runs, partial_note, plot_compare
    from mpigrad.trace import load

    traces = [load(path) for path in sorted(out.glob("*.h5"))]
    points = parse_points(AT)
    groups = group_runs(traces)
    rows = compare_rows(groups, target_loss, points, smooth=smooth)
    columns = compare_columns(target_loss, points)
    for fmt, suffix in (("text", "txt"), ("markdown", "md"), ("csv", "csv")):
        (out / f"nodes.{suffix}").write_text(render(rows, columns, fmt) + (partial_note(rows) if fmt != "csv" else ""))
    plot_compare(groups, out / "nodes.png", smooth=smooth, title="4 workers: 4 nodes of 1, 2 nodes of 2 (flat, hierarchical)")
    print(render(rows, columns, "text") + partial_note(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the traces and the report")
    parser.add_argument("--list", action="store_true", help="print the planned runs and exit")
    parser.add_argument("--report", action="store_true", help="only write the report from the traces in OUT")
    parser.add_argument("--smoke", action="store_true", help="Fix 2 and FP32, one seed, 6 iterations (the pipeline)")
    args = parser.parse_args(argv)
    runs, retimed = plan(args.out, **SMOKE) if args.smoke else plan(args.out)
    if args.list:
        for run in runs:
            print(shlex.join(run))
        for source, target in retimed:
            print(f"retime {source} -> {target}")
        return 0
    if not args.report:
        code = run_all(args.out, runs, retimed)
        if code:
            return code
    report(args.out, *((4.6, 1) if args.smoke else ()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
