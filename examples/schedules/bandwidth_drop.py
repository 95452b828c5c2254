"""What the adaptive policies do with their bits when the bandwidth drops and comes back.

Runs examples/compare's MQGrad, Accordion, L-GreCo and progress configs and examples/map's
AIMD (digits, 2 workers + 1 server, deterministic clock) on a bandwidth schedule, then draws each run's bits (the mean
over the quantized layers) and its simulated seconds per iteration against simulated time,
under the schedule's bandwidth::

    python examples/schedules/bandwidth_drop.py --out runs/drop

With ``--lab`` (root: docs/lab.rst) the same runs go through ``mpigrad lab --nodes 3 --rate
SCHEDULE -- train --net-mode off``: real links that tc changes at the schedule's times,
counted from the command's start, so each change is moved ``--lab-offset`` seconds later
(the run's start-up before its iteration 0, where its clock starts; about 6 s here).

Existing complete traces in OUT are kept (the script can be re-run to redraw the figure).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("mqgrad", "accordion", "lgreco", "aimd", "progress")
#: Where each policy's config is: examples/compare, or examples/map for AIMD (a map method).
CONFIG_DIRS = (REPO / "examples" / "compare", REPO / "examples" / "map")
#: 100 MB/s, 10 MB/s from 10 s to 50 s of simulated time, then 100 MB/s again.
SCHEDULE = "100MB/s@0s,10MB/s@10s,100MB/s@50s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder of the traces and the figure")
    parser.add_argument("--schedule", default=SCHEDULE, help=f"the bandwidth schedule (default {SCHEDULE})")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--lab", action="store_true", help="run in a network lab on the real clock (root)")
    parser.add_argument("--lab-offset", type=float, default=6.0,
                        help="seconds of start-up before iteration 0 in the lab (default 6)")
    args = parser.parse_args(argv)

    from mpigrad.mpiexec import mpiexec_command
    from mpigrad.trace import TraceError, load

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    traces = {}
    suffix = "-lab" if args.lab else ""
    for policy in args.policies:
        trace = out / f"{policy}{suffix}.h5"
        if not _complete(trace, load, TraceError):
            config = next((d / f"{policy}.toml" for d in CONFIG_DIRS if (d / f"{policy}.toml").exists()), None)
            if config is None:
                raise SystemExit(f"no config {policy}.toml in examples/compare or examples/map")
            train = ["--config", str(config), "--seed", str(args.seed),
                     "--trace", str(trace), "--force"]
            if args.lab:
                command = [sys.executable, "-m", "mpigrad", "lab", "--name", "mgldrop", "--nodes", "3", "--rate",
                           shifted(args.schedule, args.lab_offset), "--check", "none", "--",
                           "train", *train, "--net-mode", "off"]
            else:
                command = mpiexec_command(3, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", "train", *train,
                                              "--bandwidth", args.schedule])
            print(" ".join(command), flush=True)
            subprocess.run(command, check=True)
        traces[policy] = load(trace)
    figure = out / f"bits-under-a-bandwidth-drop{suffix}.png"
    where = (f"lab, real links (net-mode off), changed {args.lab_offset:g} s later from the command's start"
             if args.lab else "simulated clock")
    draw(traces, args.schedule, figure, where)
    print(f"wrote {figure}")
    for policy, trace in traces.items():
        bits = trace.steps.filter(like="bits_layers").mean(axis=1)
        print(f"{policy}: mean bits {bits.mean():.2f}, simulated time {trace.steps['sim_time'].iloc[-1]:.1f} s, "
              f"final loss {trace.steps['loss'].iloc[-1]:.3f}")
    return 0


def shifted(schedule_text: str, offset: float) -> str:
    """The schedule with each change ``offset`` seconds later (the first value from 0 s)."""
    from mpigrad.clockmodel import Steps
    from mpigrad.units import format_duration, format_rate, parse_schedule

    schedule = parse_schedule(schedule_text, "bandwidth")
    if not isinstance(schedule, Steps) or schedule.period is not None:
        raise SystemExit("--lab shifts a plain RATE@TIME,... schedule only")
    return ",".join(f"{format_rate(v, bits=False)}@{format_duration(t + offset if t else 0.0)}"
                    for t, v in zip(schedule.times, schedule.values))


def draw(traces: dict, schedule_text: str, path: Path, where: str = "simulated clock") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from mpigrad.units import parse_schedule

    schedule = parse_schedule(schedule_text, "bandwidth")
    end = max(float(t.steps["sim_time"].iloc[-1]) for t in traces.values())
    grid = np.linspace(0.0, end, 2000)
    fig, (top, middle, bottom) = plt.subplots(3, 1, sharex=True, figsize=(8, 7.5),
                                              gridspec_kw={"height_ratios": [1, 1.4, 1.4]})
    top.step(grid, [schedule.at(t) / 1e6 for t in grid], where="post", color="black")
    top.set_ylabel("bandwidth (MB/s)")
    top.set_yscale("log")
    top.set_title(f"--bandwidth {schedule_text}\n{where}", fontsize="medium")
    for policy, trace in traces.items():
        steps = trace.steps
        sim = steps["sim_time"].to_numpy()
        middle.plot(sim, np.diff(sim, prepend=0.0), label=trace.label, lw=1)
        # iteration m ends at sim[m]: its bits hold from the end of m - 1 to sim[m]
        bottom.step(sim, steps.filter(like="bits_layers").mean(axis=1), where="pre", label=trace.label, lw=1.2)
    middle.set_ylabel("s per iteration")
    middle.set_yscale("log")
    bottom.set_ylabel("bits (mean over layers)")
    bottom.set_xlabel("time since iteration 0 (s): " + ("wall clock" if "lab" in where else "simulated"))
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
