"""Run the whole comparison of examples/compare/ and write its tables and figures.

    python examples/compare/run.py --out runs/compare            # everything, then the report
    python examples/compare/run.py --out runs/compare --smoke    # 2 methods x 2 seeds x 12 iterations
    python examples/compare/run.py --out runs/compare --list     # the planned runs, one a line
    python examples/compare/run.py --out runs/compare --report   # only the tables and figures
    python examples/compare/run.py --out runs/compare-momentum --lrs 0.002,0.004,0.008 --shared-lr 0.004 \
        --optimizer sgd --optimizer-opt momentum=0.9 --optimizer-opt nesterov=true \
        --lr-schedule CosineAnnealingLR --lr-schedule-opt T_max=400 --lr-warmup 20   # under a recipe

Runs go one after another (mpiexec -n 3: 1 server + 2 workers), each writing
OUT/<method>-lr<lr>-s<seed>.h5. A trace whose status is "complete" is skipped, so an
interrupted comparison continues where it stopped; an incomplete one is run again from the
start (--force). Every method runs at the shared learning rate (the configs' ``lr``, or
--shared-lr); the methods in LR_GRID_METHODS also run at every rate of LR_GRID (or --lrs).
Options run.py does not know go to every ``mpigrad train`` (a recipe: ``--optimizer``,
``--lr-schedule``, ...). Then the report, from the
traces only (``mpigrad trace compare``):

- OUT/shared-lr.{txt,md,csv,png}: every method at the shared learning rate;
- OUT/best-lr.{txt,md,csv,png}: every method at its best rate of the grid (least mean time
  to the target loss over the seeds; where no rate reaches it, the least final loss);
- OUT/lr-grid.{txt,md,csv}: every (method, rate) group.

With --one-world the runs go one after another in one ``mpiexec`` (``mpigrad sweep``), so
the ranks' start-up (imports, Numba's cache) is paid once, not once per run.

On a cluster, examples/compare/array.sbatch runs the same plan as a Slurm job array (one
run per task), and ``--report`` writes the report afterwards.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
METHODS = ("fix2", "fix4", "fix8", "mqgrad", "adaptive", "accordion", "lgreco", "progress", "fp32", "fp16", "lowrank")
#: The baselines: mpigrad in float32 and float16, and its low-rank codec (PowerSGD r2, 8-bit
#: factors and rest); trace compare's vs_fp32 is the ratio to the first.
BASELINES = ("fp32", "fp16", "lowrank")
LR_GRID_METHODS = ("fix2", "fix4", "fix8", "mqgrad", *BASELINES)
LR_GRID = (0.01, 0.02, 0.04)
SHARED_LR = 0.02                 # the configs' lr
SEEDS = (1, 2, 3)
RANKS = 3
TARGET_LOSS = 2.5                # training loss (l2 term included), trailing mean over SMOOTH
SMOOTH = 20
AT = "60s,120s,180s"             # simulated times of the loss and accuracy columns
SMOKE = dict(methods=("fix2", "mqgrad"), seeds=(1, 2), lrs=(SHARED_LR,), iterations=12,
             target_loss=4.34, smooth=1, at="4s")


@dataclass(frozen=True)
class Run:
    method: str
    lr: float
    seed: int
    trace: Path

    @property
    def config(self) -> Path:
        return HERE / f"{self.method}.toml"


def plan(out: Path, methods=METHODS, seeds=SEEDS, lrs=LR_GRID, shared_lr: float = SHARED_LR) -> list[Run]:
    runs = []
    for method in methods:
        rates = sorted(set(lrs) | {shared_lr}) if method in LR_GRID_METHODS else [shared_lr]
        for lr in rates:
            for seed in seeds:
                runs.append(Run(method, lr, seed, out / f"{method}-lr{lr:g}-s{seed}.h5"))
    return runs


def status(trace: Path) -> str | None:
    """The trace's status attribute ("complete", "stopped", "failed", ...), None if absent
    or unreadable (read through mpigrad.trace's reader, as `mpigrad trace` does)."""
    from mpigrad.trace import TraceError, read_raw

    if not trace.exists():
        return None
    try:
        return str(read_raw(trace).attrs.get("status", "running"))
    except TraceError:
        return None


def train_options(run: Run, extra: list[str]) -> list[str]:
    """The run's ``mpigrad train`` options (an incomplete trace is started again: --force)."""
    return ["--config", str(run.config), "--seed", str(run.seed), "--lr", f"{run.lr:g}", "--trace", str(run.trace),
            "--force", *extra]


def mpigrad_command(args: list[str]) -> list[str]:
    """``mpigrad ARGS`` under this Python's MPI on RANKS ranks, with the flags that MPI needs
    (mpigrad.mpiexec)."""
    from mpigrad.mpiexec import mpiexec_command

    return mpiexec_command(RANKS, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", *args])


def run_environment() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env.setdefault(name, "1")
    return env


def run_all(runs: list[Run], extra: list[str], log=print) -> int:
    """Run every run whose trace is not complete; return the number that failed."""
    env = run_environment()
    failed = 0
    for k, run in enumerate(runs, 1):
        if status(run.trace) == "complete":
            log(f"[{k}/{len(runs)}] {run.trace.name}: complete, skipped")
            continue
        log(f"[{k}/{len(runs)}] {run.trace.name}: running")
        result = subprocess.run(mpigrad_command(["train", *train_options(run, extra)]), env=env, capture_output=True,
                                text=True)
        if result.returncode != 0:
            failed += 1
            last = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
            log(f"[{k}/{len(runs)}] {run.trace.name}: failed (exit {result.returncode}): {last}")
    return failed


def run_in_one_world(runs: list[Run], out: Path, extra: list[str], log=print) -> int:
    """Every run whose trace is not complete, one after another in one MPI job
    (``mpigrad sweep``: the processes start once); return the number left incomplete. A
    rank's failure aborts the job: the runs after it are then left for the next call."""
    todo = [run for run in runs if status(run.trace) != "complete"]
    log(f"{len(runs) - len(todo)} complete, skipped; {len(todo)} to run in one world")
    if not todo:
        return 0
    runs_file = out / "runs.txt"
    runs_file.write_text("".join(shlex.join(train_options(run, extra)) + "\n" for run in todo))
    result = subprocess.run(mpigrad_command(["sweep", str(runs_file)]), env=run_environment(), capture_output=True,
                            text=True)
    for line in result.stdout.splitlines():
        if line.startswith("mpigrad sweep: "):
            log(line)
    left = [run for run in todo if status(run.trace) != "complete"]
    if result.returncode != 0 or left:
        last = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
        log(f"the sweep exited {result.returncode} with {len(left)} run(s) incomplete: {last}")
    return len(left)


def best_rates(groups, rows, smooth: int) -> dict[str, str]:
    """Method label -> the label of its group at the best learning rate."""
    from mpigrad.analysis.labels import flat_config
    from mpigrad.trace import method_label

    best: dict[str, tuple] = {}
    for group, row in zip(groups, rows):
        if not group.runs:
            continue
        config = group.runs[0].config
        method = method_label(config)
        final = sum(float(t.steps["loss"].iloc[-smooth:].mean()) for t in group.runs) / len(group.runs)
        reached = row["target_mean"] is not None and not row["target_partial"]
        score = (0, row["target_mean"]) if reached else (1, final)
        if method not in best or score < best[method][0]:
            best[method] = (score, group.label, flat_config(config).get("lr"))
    return {method: label for method, (_, label, _) in best.items()}


def report(out: Path, runs: list[Run], target_loss: float, smooth: int, at: str, log=print,
           peers: Path | None = None, shared_lr: float = SHARED_LR) -> None:
    from mpigrad.analysis import parse_points, render
    from mpigrad.analysis.compare import (compare_columns, compare_rows, group_runs, partial_note,
                                          plot_compare)
    from mpigrad.trace import TraceError, load

    traces = []
    for run in runs:
        try:
            traces.append(load(run.trace))
        except TraceError as exc:
            log(f"report: left out {run.trace.name}: {exc}")
    if not traces:
        raise SystemExit("run.py: no traces to report on")
    if peers is not None:  # bench peers' DDP runs, modelled on the runs' simulated network
        from mpigrad.analysis.peers import load_peer_runs, model_peers_at, networks_of

        traces += model_peers_at(load_peer_runs(peers), networks_of(traces))
    points = parse_points(at)
    columns = compare_columns(target_loss, points)

    def write(name: str, groups, title: str, figure: bool) -> None:
        rows = compare_rows(groups, target_loss, points, smooth=smooth)
        for fmt, suffix in (("text", "txt"), ("markdown", "md"), ("csv", "csv")):
            note = partial_note(rows) if fmt != "csv" else ""
            (out / f"{name}.{suffix}").write_text(render(rows, columns, fmt) + note)
        if figure:
            plot_compare(groups, out / f"{name}.png", smooth=smooth, title=title)
        log(f"\n{title} (target loss {target_loss:g}, smoothed over {smooth} iterations)")
        log(render(rows, columns, "text") + partial_note(rows))

    shared = [t for t in traces if abs(float(t.config.get("lr", 0)) - shared_lr) < 1e-12]
    write("shared-lr", group_runs(shared), f"Every method at lr {shared_lr:g}", True)
    grid_groups = group_runs(traces)
    grid_rows = compare_rows(grid_groups, target_loss, points, smooth=smooth)
    write("lr-grid", grid_groups, "Every method at every learning rate", False)
    chosen = set(best_rates(grid_groups, grid_rows, smooth).values())
    best = [g for g in grid_groups if g.label in chosen]
    write("best-lr", best, "Every method at its best learning rate of the grid", True)
    log(f"\nwrote {out}/shared-lr.*, {out}/best-lr.*, {out}/lr-grid.*")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for traces and the report")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny version: 2 methods x 2 seeds x 12 iterations (checks the pipeline)")
    parser.add_argument("--list", action="store_true", help="print the planned runs and exit")
    parser.add_argument("--task", type=int, metavar="N",
                        help="print run N of the plan as 'CONFIG SEED LR TRACE' (nothing if complete); for job arrays")
    parser.add_argument("--report", action="store_true", help="only write the report from existing traces")
    parser.add_argument("--one-world", action="store_true",
                        help="run the runs in one MPI job (mpigrad sweep: each rank starts once, not once per run)")
    parser.add_argument("--target-loss", type=float, help=f"default {TARGET_LOSS} ({SMOKE['target_loss']} with --smoke)")
    parser.add_argument("--peers", type=Path, metavar="DIR",
                        help="a `mpigrad bench peers` result (peers.json or its folder): its DDP runs join the "
                             "report, modelled on the runs' network (mpigrad/analysis/peers.py), and vs_best_ddp")
    parser.add_argument("--lrs", help=f"the learning-rate grid, comma-separated (default "
                        f"{','.join(f'{lr:g}' for lr in LR_GRID)})")
    parser.add_argument("--shared-lr", type=float, default=SHARED_LR,
                        help=f"the rate every method runs at (default {SHARED_LR:g}, the configs')")
    args, extra = parser.parse_known_args(argv)
    lrs = tuple(float(lr) for lr in args.lrs.split(",")) if args.lrs else LR_GRID
    settings = dict(methods=METHODS, seeds=SEEDS, lrs=lrs, target_loss=TARGET_LOSS, smooth=SMOOTH, at=AT)
    if args.smoke:
        settings.update(SMOKE)
        extra = ["--iterations", str(SMOKE["iterations"]), "--eval-every", "6", *extra]
    target = args.target_loss if args.target_loss is not None else settings["target_loss"]
    runs = plan(args.out, settings["methods"], settings["seeds"], settings["lrs"], args.shared_lr)
    if args.list:
        for k, run in enumerate(runs):
            print(k, run.config, run.seed, f"{run.lr:g}", run.trace)
        return 0
    if args.task is not None:
        if not 0 <= args.task < len(runs):
            print(f"run.py: task {args.task} is outside the plan's {len(runs)} runs", file=sys.stderr)
            return 2
        run = runs[args.task]
        if status(run.trace) != "complete":
            print(run.config, run.seed, f"{run.lr:g}", run.trace)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    if not args.report:
        print(f"{len(runs)} runs into {args.out} (complete traces are skipped)", flush=True)
        log = lambda line: print(line, flush=True)  # noqa: E731
        failed = run_in_one_world(runs, args.out, extra, log) if args.one_world else run_all(runs, extra, log)
    report(args.out, runs, target, settings["smooth"], settings["at"], peers=args.peers, shared_lr=args.shared_lr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
