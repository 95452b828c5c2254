"""What the adaptive policies do with their bits when the bandwidth drops and comes back.

Runs examples/compare's MQGrad, Accordion and L-GreCo configs (digits, 2 workers + 1
server, deterministic clock) on a bandwidth schedule, then draws each run's bits (the mean
over the quantized layers) and its simulated seconds per iteration against simulated time,
under the schedule's bandwidth::

    python examples/schedules/bandwidth_drop.py --out runs/drop

Existing complete traces in OUT are kept (the script can be re-run to redraw the figure).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("mqgrad", "accordion", "lgreco")
#: 100 MB/s, 10 MB/s from 10 s to 50 s of simulated time, then 100 MB/s again.
SCHEDULE = "100MB/s@0s,10MB/s@10s,100MB/s@50s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder of the traces and the figure")
    parser.add_argument("--schedule", default=SCHEDULE, help=f"the bandwidth schedule (default {SCHEDULE})")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    args = parser.parse_args(argv)

    from mpigrad.mpiexec import mpiexec_command
    from mpigrad.trace import TraceError, load

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    traces = {}
    for policy in args.policies:
        trace = out / f"{policy}.h5"
        if not _complete(trace, load, TraceError):
            command = mpiexec_command(3, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", "train", "--config",
                                          str(REPO / "examples" / "compare" / f"{policy}.toml"), "--bandwidth",
                                          args.schedule, "--seed", str(args.seed), "--trace", str(trace), "--force"])
            print(" ".join(command), flush=True)
            subprocess.run(command, check=True)
        traces[policy] = load(trace)
    figure = out / "bits-under-a-bandwidth-drop.png"
    draw(traces, args.schedule, figure)
    print(f"wrote {figure}")
    for policy, trace in traces.items():
        bits = trace.steps.filter(like="bits_layers").mean(axis=1)
        print(f"{policy}: mean bits {bits.mean():.2f}, simulated time {trace.steps['sim_time'].iloc[-1]:.1f} s, "
              f"final loss {trace.steps['loss'].iloc[-1]:.3f}")
    return 0


def draw(traces: dict, schedule_text: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from mpigrad.config import parse_schedule

    schedule = parse_schedule(schedule_text, "bandwidth")
    end = max(float(t.steps["sim_time"].iloc[-1]) for t in traces.values())
    grid = np.linspace(0.0, end, 2000)
    fig, (top, middle, bottom) = plt.subplots(3, 1, sharex=True, figsize=(8, 7.5),
                                              gridspec_kw={"height_ratios": [1, 1.4, 1.4]})
    top.step(grid, [schedule.at(t) / 1e6 for t in grid], where="post", color="black")
    top.set_ylabel("bandwidth (MB/s)")
    top.set_yscale("log")
    top.set_title(f"--bandwidth {schedule_text}")
    for policy, trace in traces.items():
        steps = trace.steps
        sim = steps["sim_time"].to_numpy()
        middle.plot(sim, np.diff(sim, prepend=0.0), label=trace.label, lw=1)
        bottom.step(sim, steps.filter(like="bits_layers").mean(axis=1), where="post", label=trace.label, lw=1.2)
    middle.set_ylabel("s per iteration")
    middle.set_yscale("log")
    bottom.set_ylabel("bits (mean over layers)")
    bottom.set_xlabel("simulated time (s)")
    bottom.legend(loc="upper right", fontsize="small")
    for axis in (top, middle, bottom):
        for change in (t for t in _changes(schedule, end)):
            axis.axvline(change, color="grey", lw=0.6, ls=":")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _complete(trace: Path, load, error) -> bool:
    try:
        return trace.exists() and load(trace).complete
    except error:
        return False


def _changes(schedule, end: float) -> list[float]:
    changes, t = [], 0.0
    while (t := schedule.next_change(t)) <= end:
        changes.append(t)
    return changes


if __name__ == "__main__":
    sys.exit(main())
