"""Run the widths of examples/hard/ over seeds and rates, then the report with iterations to target.

    python examples/hard/run.py --out runs/hard            # every run, then the report
    python examples/hard/run.py --out runs/hard --smoke    # 2 widths x 1 seed x 12 iterations
    python examples/hard/run.py --out runs/hard --list     # the planned runs, one a line
    python examples/hard/run.py --out runs/hard --report   # only the tables and figures

The same runner as examples/compare/run.py (one run after another under mpiexec -n 3, complete
traces skipped, ``mpigrad trace compare``'s tables written to OUT/{shared-lr,lr-grid,best-lr}.*),
with this task's widths, rates and target. It adds OUT/iterations.{txt,md}: per (width, rate),
over the plan's traces and any other trace in OUT (runs by hand, e.g. ``--codec qsgd``), the
iterations to the target loss (mean and 95 % interval over the seeds), and per width at its
best rate, those iterations relative to fp32's at its best rate: what a width costs per iteration.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_SPEC = importlib.util.spec_from_file_location("compare_run", HERE.parent / "compare" / "run.py")
runner = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = runner      # dataclasses look their module up there
_SPEC.loader.exec_module(runner)

METHODS = ("fp32", "fix8", "fix4", "fix2")
LR_GRID_METHODS = METHODS       # every width at every rate of the grid
LR_GRID = (0.1, 0.2)
SHARED_LR = 0.2                  # the configs' lr
SEEDS = (1, 2, 3)
TARGET_LOSS = 1.15               # training loss (l2 term included), trailing mean over SMOOTH
ITERATION_TARGETS = (1.3, TARGET_LOSS)   # the iterations tables: an early target and TARGET_LOSS
SMOOTH = 20
AT = "20s,40s"
SMOKE = dict(methods=("fp32", "fix2"), seeds=(1,), lrs=(SHARED_LR,), iterations=12,
             target_loss=3.0, smooth=1, at="1s")

for _name in ("HERE", "METHODS", "LR_GRID_METHODS", "LR_GRID", "SHARED_LR", "SEEDS", "TARGET_LOSS",
              "SMOOTH", "AT", "SMOKE"):
    setattr(runner, _name, globals()[_name])
_plan = runner.plan
# seed-major order: an interrupted measurement has whole seeds of every width
runner.plan = lambda *args, **kwargs: sorted(_plan(*args, **kwargs), key=lambda run: (run.seed, -run.lr))


def iteration_rows(traces, target_loss: float, smooth: int) -> list[dict]:
    """Per (width, rate) group: iterations to the target over the seeds; then per width at its
    best rate (fewest mean iterations, all seeds reaching), the ratio to fp32's best."""
    from mpigrad.analysis.compare import group_runs, mean_ci
    from mpigrad.analysis.labels import flat_config
    from mpigrad.analysis.summary import iterations_to_target, smoothed_loss

    rows = []
    for group in group_runs(traces):
        if not group.runs:
            continue
        flat = flat_config(group.runs[0].config)
        codec = flat.get("codec", flat.get("codec.id"))
        width = codec if codec in ("fp32", "fp16") else f"{codec} {flat.get('bits')}"
        counts = [iterations_to_target(t, target_loss, smooth) for t in group.runs]
        reached = [c for c in counts if c is not None]
        mean, ci = mean_ci(reached)
        final = sum(float(smoothed_loss(t, smooth)[-1]) for t in group.runs) / len(group.runs)
        rows.append(dict(width=width, lr=float(flat["lr"]), reached=f"{len(reached)}/{len(counts)}",
                         all_reached=len(reached) == len(counts), mean=mean, ci=ci, final=final,
                         per_seed=counts))
    best: dict[str, dict] = {}
    for row in rows:
        score = (0, row["mean"]) if row["all_reached"] else (1, -len(row["per_seed"]), row["final"])
        if row["width"] not in best or score < best[row["width"]]["score"]:
            best[row["width"]] = dict(row, score=score)
    reference = best.get("fp32")
    for row in rows:
        row["best"] = best[row["width"]]["lr"] == row["lr"]
        row["vs_fp32"] = (row["mean"] / reference["mean"] if reference and reference["all_reached"]
                          and row["all_reached"] else None)
    return rows


def render_iterations(rows, target_loss: float, smooth: int, markdown: bool) -> str:
    head = ["width", "lr", "reached", f"iters_to_{target_loss:g}", "ci95", "vs_fp32_best", "final_loss",
            "per_seed", "best_lr"]
    body = [[r["width"], f"{r['lr']:g}", r["reached"], "-" if r["mean"] is None else f"{r['mean']:.1f}",
             "-" if r["ci"] is None else f"{r['ci']:.1f}", "-" if r["vs_fp32"] is None else f"{r['vs_fp32']:.2f}",
             f"{r['final']:.3f}", " ".join("-" if c is None else str(c) for c in r["per_seed"]),
             "*" if r["best"] else ""] for r in rows]
    note = (f"iterations until the training loss (trailing mean of {smooth}) first reaches {target_loss:g}; "
            "mean and 95 % interval over the seeds that reached it; vs_fp32_best: the mean over fp32's "
            "mean at fp32's best rate (only where every seed reached the target); final_loss: the "
            "smoothed loss at the last iteration, mean over seeds; best_lr: the width's best rate\n")
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
    else:
        widths = [max(len(x) for x in column) for column in zip(head, *body)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]]
    return "\n".join(lines) + "\n\n" + note


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = runner.main(argv)
    if "--list" in argv or any(a.startswith("--task") for a in argv):
        return code
    from mpigrad.trace import TraceError, load

    out = Path(argv[argv.index("--out") + 1] if "--out" in argv
               else next(a.split("=", 1)[1] for a in argv if a.startswith("--out=")))
    smoke = "--smoke" in argv
    settings = SMOKE if smoke else dict(target_loss=TARGET_LOSS, smooth=SMOOTH)
    target = float(argv[argv.index("--target-loss") + 1]) if "--target-loss" in argv else settings["target_loss"]
    runs = runner.plan(out, *((SMOKE["methods"], SMOKE["seeds"], SMOKE["lrs"]) if smoke else (METHODS, SEEDS, LR_GRID)))
    planned = {run.trace for run in runs}
    traces = []   # the plan's runs, then any other trace in OUT (runs by hand, e.g. other codecs)
    for path in [run.trace for run in runs] + sorted(p for p in out.glob("*.h5") if p not in planned):
        try:
            traces.append(load(path))
        except TraceError:
            pass
    targets = (target,) if smoke or "--target-loss" in argv else ITERATION_TARGETS
    for suffix, markdown in (("txt", False), ("md", True)):
        tables = [render_iterations(iteration_rows(traces, t, settings["smooth"]), t, settings["smooth"], markdown)
                  for t in targets]
        (out / f"iterations.{suffix}").write_text("\n".join(tables))
    print(f"\nIterations to the target (trailing mean of {settings['smooth']})")
    print((out / "iterations.txt").read_text())
    return code


if __name__ == "__main__":
    sys.exit(main())
