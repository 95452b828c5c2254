"""`mpigrad trace ACTION`: info, summary, table, plot and export for HDF5 traces, retime
(a run's simulated clock under another network), and repair for the trace of a run whose
writer died.

Never imports mpi4py, torch or numba; only ``retime`` and ``repair`` write (through mpigrad.trace).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Callable

from ..config import BROADCASTS
from ..units import parse_bandwidth, parse_duration, parse_latency, parse_link_bandwidth, parse_rate
from ..errors import UsageError
from ..trace import Trace, TraceError, load
from .tables import (CLOCKS, METRICS, AnalysisError, accuracy_table, export_csv, fit_width, parse_points, render,
                     table_key, wrap)

_FORMATS = ("text", "csv", "markdown")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    info = actions.add_parser("info", help="config, versions, length and status of one run")
    info.add_argument("file")
    info.add_argument("--full", action="store_true",
                      help="print every attribute and the config whole (without it, long values are summarised)")

    summary = actions.add_parser("summary", help="one row per run: losses, accuracy, traffic, overhead")
    summary.add_argument("files", nargs="+", metavar="FILE")
    summary.add_argument("--target-loss", type=float, help="also report the time to reach this loss")
    summary.add_argument("--clock", choices=sorted(CLOCKS), default="sim",
                         help="clock for the quantization overhead fraction (default: sim)")
    _add_smooth(summary)
    _add_format(summary)

    table = actions.add_parser("table", help="test accuracy at given times (the paper's Tables 1-2)")
    table.add_argument("files", nargs="+", metavar="FILE")
    table.add_argument("--at", required=True, metavar="POINTS",
                       help="comma-separated durations (5h,15h,30h; units s, m, h, d) or iteration counts "
                            "(300: after 300 iterations, as the progress line's 'iter 300/300')")
    table.add_argument("--iterations", action="store_true", help="read --at as iteration numbers only")
    table.add_argument("--clock", choices=sorted(CLOCKS), default="sim",
                       help="clock that durations refer to (default: sim)")
    table.add_argument("--metric", choices=sorted(METRICS), default="accuracy",
                       help="test accuracy in %% (default) or test loss")
    _add_format(table)

    plot = actions.add_parser("plot", help="loss, accuracy and bits against time or iteration")
    plot.add_argument("files", nargs="+", metavar="FILE")
    plot.add_argument("-o", "--output", required=True, help="image file (.png, .pdf or .svg)")
    plot.add_argument("--x", choices=("sim", "wall", "iteration"), default="sim",
                      help="x axis: simulated time (default), wall-clock time or iteration")
    plot.add_argument("--no-accuracy", action="store_true", help="leave out the test accuracy panel")
    plot.add_argument("--title")
    _add_smooth(plot)

    compare = actions.add_parser(
        "compare", help="methods over seeds: time to a target loss with 95%% CIs, loss/accuracy at times, bytes",
        description="Group runs by the config keys in which they differ (the seed excepted) and "
                    "report per group: runs, how many reached the target, mean time to target on "
                    "the simulated clock with its 95% confidence interval (Student t), the ratio to "
                    "the best fixed-bits group, megabytes sent, and loss and accuracy at given times. "
                    "Runs whose trace is not complete are flagged and left out.")
    compare.add_argument("files", nargs="+", metavar="RUN")
    compare.add_argument("--target-loss", type=float, required=True, help="training loss to reach")
    compare.add_argument("--by", action="append", metavar="KEY",
                         help="group by this config key only (repeatable; e.g. lr, policy, policy_opts.T)")
    compare.add_argument("--at", metavar="TIMES", help="simulated times for loss and accuracy columns, e.g. 60s,5m")
    compare.add_argument("--plot", metavar="FILE", help="also draw mean curves with 95%% bands (.png, .pdf, .svg)")
    compare.add_argument("--peers", metavar="FILE",
                         help="also the DDP runs of `mpigrad bench peers` (its peers.json or its folder), each "
                              "modelled on every simulated network of the runs (mpigrad/analysis/peers.py): "
                              "groups of their own, and the vs_best_ddp column")
    compare.add_argument("--include-incomplete", action="store_true",
                         help="use stopped, failed or running traces in the statistics too")
    _add_smooth(compare)
    _add_format(compare)

    export = actions.add_parser("export", help="write every table as CSV and the attributes as JSON")
    export.add_argument("file")
    export.add_argument("--csv", required=True, metavar="DIR", help="output folder (created if needed)")
    export.add_argument("--force", action="store_true", help="overwrite existing files in DIR")

    retime = actions.add_parser(
        "retime", help="re-charge a complete run's simulated clock under another network",
        description="Write a copy of TRACE whose simulated times (steps sim_time and t_comm, eval "
                    "sim_time) are charged again, by the runtime's clock model, at the given bandwidth, "
                    "latency and broadcast, from the bytes and local costs the run recorded; losses, "
                    "accuracies, bits and bytes are kept. Refused for a policy whose bits depend on the "
                    "clock (MQGrad), a run that is not complete, and a --net-mode off run.")
    retime.add_argument("file", metavar="TRACE")
    retime.add_argument("--bandwidth", required=True, metavar="RATE|SCHEDULE",
                        help="e.g. 100MB/s or 1Gbit/s, or a schedule on the simulated clock as for mpigrad train: "
                             "10MB/s@0s,1GB/s@60s[,repeat@120s] or markov:10MB/s,1GB/s,dwell=30s,60s (drawn "
                             "from the run's seed)")
    retime.add_argument("--latency", metavar="DURATION|SCHEDULE", help="per message, e.g. 1ms, or a schedule "
                        "(default: the run's)")
    retime.add_argument("--link-bandwidth", action="append", metavar="RANK=RATE|SCHEDULE",
                        help="rank RANK's link at its own rate or schedule, repeatable (default: the run's)")
    retime.add_argument("--broadcast", choices=BROADCASTS, help="broadcast shape (default: the run's)")
    retime.add_argument("--ranks-per-node", type=int, metavar="L",
                        help="charge the run on nodes of L workers, each behind one NIC at --bandwidth (default: "
                             "the run's nodes; a flat colocated run takes any L that divides its workers, a "
                             "hierarchical one only its own)")
    retime.add_argument("--intra-bandwidth", metavar="RATE", help="with nodes: each worker's link inside its node "
                        "(default: the run's)")
    retime.add_argument("--intra-latency", metavar="DURATION", help="with nodes: the latency inside a node "
                        "(default: the run's)")
    retime.add_argument("--cost-model", metavar="none|default|FILE",
                        help="charge the run's local work (a --compute-time run's policy, encode, decode, average) "
                             "by this cost model instead of the one the run recorded; none: charge none")
    retime.add_argument("-o", "--output", required=True, metavar="OUT", help="the re-timed trace (.h5)")
    retime.add_argument("--force", action="store_true", help="overwrite OUT if it exists")

    repair = actions.add_parser(
        "repair", help="close the trace of a run whose writer died (status failed or incomplete)",
        description="For a trace whose writer was killed: rewrite it atomically without HDF5's "
                    "open-for-writing mark, so that any HDF5 tool opens it, with status 'failed' "
                    "(--error) or 'incomplete' and the last iteration recorded. Only for a run "
                    "that has ended. A closed trace is left as it is.")
    repair.add_argument("file")
    repair.add_argument("--error", metavar="TEXT",
                        help="what went wrong (e.g. 'launcher exit 137'): recorded, status 'failed'")


def _add_smooth(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smooth", type=int, default=1, metavar="N",
                        help="average the training loss over the last N iterations (default: 1)")


def _add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=_FORMATS, default="text", help="output format (default: text)")


def run(args: argparse.Namespace) -> int:
    try:
        return _ACTIONS[args.action](args)
    except (TraceError, AnalysisError) as exc:
        raise UsageError(str(exc)) from None


class _Skipped:
    """Files of a multi-file action that could not be read: reported, then a non-zero exit."""

    def __init__(self):
        self.count = 0

    def exit_code(self, code: int) -> int:
        return EXIT_SKIPPED if self.count and code == 0 else code


#: Exit code of a multi-file action that skipped unreadable files and reported the rest.
EXIT_SKIPPED = 1


def _load_runs(paths: list[str], skipped: _Skipped | None = None) -> tuple[list[Trace], list[str]]:
    """Traces and their labels (``labels.run_labels``). With ``skipped``, a file that cannot be
    read is reported on stderr in one line and left out; without, it stops the action."""
    from .labels import run_labels
    from .summary import require_steps

    traces = []
    for path in paths:
        try:
            trace = load(path)
            require_steps(trace)
        except (TraceError, AnalysisError) as exc:
            if skipped is None or len(paths) == 1:
                raise
            print(f"mpigrad trace: error: {exc} (skipped)", file=sys.stderr, flush=True)
            skipped.count += 1
            continue
        traces.append(trace)
    if not traces:
        raise AnalysisError("none of the files could be read")
    return traces, run_labels(traces)


def _info(args: argparse.Namespace) -> int:
    from .summary import describe

    lines = describe(load(args.file), full=args.full)
    width = max(len(key) for key, _ in lines)
    for key, text in lines:
        indented = text.replace("\n", "\n" + " " * (width + 2))
        print(f"{key:<{width}}  {indented}")
    return 0


def _summary(args: argparse.Namespace) -> int:
    from .labels import file_labels
    from .summary import summarize, summary_columns

    skipped = _Skipped()
    traces, labels = _load_runs(args.files, skipped)
    files = file_labels([trace.path for trace in traces])
    rows = [summarize(trace, label, target_loss=args.target_loss, clock=args.clock, smooth=args.smooth, run=file)
            for trace, label, file in zip(traces, labels, files)]
    print(render(rows, summary_columns(target_loss=args.target_loss, clock=args.clock), args.format), end="")
    return skipped.exit_code(0)


def _marked_runs(paths: list[str], skipped: _Skipped | None = None) -> tuple[list[Trace], list[str]]:
    """Runs and their labels, each marked with its status unless it completed."""
    from .summary import marked_label

    traces, labels = _load_runs(paths, skipped)
    return traces, [marked_label(trace, label) for trace, label in zip(traces, labels)]


def _table(args: argparse.Namespace) -> int:
    points = parse_points(args.at, iterations=args.iterations)
    skipped = _Skipped()
    traces, labels = _marked_runs(args.files, skipped)
    rows, columns = accuracy_table(traces, labels, points, clock=args.clock, metric=args.metric)
    print(render(rows, columns, args.format), end="")
    if args.format == "text":
        print(table_key(rows, clock=args.clock, metric=args.metric, iterations=points[0].is_iteration))
    return skipped.exit_code(0)


def _plot(args: argparse.Namespace) -> int:
    from .plots import plot_traces

    skipped = _Skipped()
    traces, labels = _marked_runs(args.files, skipped)
    output = plot_traces(traces, labels, args.output, x=args.x, smooth=args.smooth,
                         accuracy=not args.no_accuracy, title=args.title)
    print(f"wrote {output}")
    return skipped.exit_code(0)


def _compare(args: argparse.Namespace) -> int:
    from .compare import (
        compare_columns, compare_key, compare_rows, group_runs, partial_note, plot_compare, provenance_warnings,
        rows_clock,
    )

    points = parse_points(args.at) if args.at else []
    if args.smooth < 1:
        raise AnalysisError(f"smoothing window must be at least 1 iteration, got {args.smooth}")
    skipped = _Skipped()
    traces, _ = _load_runs(args.files, skipped)
    if args.peers:
        from .peers import load_peer_runs, model_peers_at, networks_of

        networks = networks_of(traces)
        if not networks:
            raise AnalysisError("--peers: none of the runs has a simulated network to model DDP on")
        traces = [*traces, *model_peers_at(load_peer_runs(args.peers), networks)]
    groups = group_runs(traces, args.by, include_incomplete=args.include_incomplete)
    for line in provenance_warnings(groups):
        print(line, file=sys.stderr)
    rows = compare_rows(groups, args.target_loss, points, smooth=args.smooth)
    columns = compare_columns(args.target_loss, points, rows_clock(rows))
    width = _terminal_width() if args.format == "text" else None
    if width:  # long labels in a key below the table, to fit the terminal
        shorts = [(group.runs or group.excluded)[0].label for group in groups]
        table, shown = fit_width(rows, columns, shorts, width)
        shown_columns = [c for c in columns if c.header in table.splitlines()[0].split()]
        notes = compare_key(shown_columns, args.target_loss) + partial_note(shown, args.target_loss).splitlines()
        print(table + wrap(notes, width), end="")
    else:
        print(render(rows, columns, args.format), end="")
        if args.format != "csv":  # the key, then the footnotes, under the table
            print("".join(f"{line}\n" for line in compare_key(columns, args.target_loss))
                  + partial_note(rows, args.target_loss), end="")
    if args.plot:
        print(f"wrote {plot_compare(groups, args.plot, smooth=args.smooth, target_loss=args.target_loss)}")
    return skipped.exit_code(0)


def _terminal_width() -> int | None:
    """The columns a text table should fit: ``COLUMNS`` where set, else the terminal's when
    stdout is one; None when it is a file or a pipe (lines kept whole, for grep and scripts)."""
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def _export(args: argparse.Namespace) -> int:
    (trace,), _ = _load_runs([args.file])
    for path in export_csv(trace, args.csv, force=args.force):
        print(f"wrote {path}")
    return 0


def _retime(args: argparse.Namespace) -> int:
    from .retime import retime

    latency = None if args.latency is None else parse_latency(args.latency)
    links = None if args.link_bandwidth is None else parse_link_bandwidth(args.link_bandwidth)
    print(retime(args.file, args.output, bandwidth=parse_bandwidth(args.bandwidth), latency=latency,
                 broadcast=args.broadcast, link_bandwidth=links, force=args.force, cost_model=args.cost_model,
                 ranks_per_node=args.ranks_per_node,
                 intra_bandwidth=None if args.intra_bandwidth is None else parse_rate(args.intra_bandwidth),
                 intra_latency=None if args.intra_latency is None else parse_duration(args.intra_latency)))
    return 0


def _repair(args: argparse.Namespace) -> int:
    from ..trace import repair

    print(repair(args.file, error=args.error))
    return 0


_ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "info": _info, "summary": _summary, "table": _table, "plot": _plot, "compare": _compare,
    "export": _export, "retime": _retime, "repair": _repair,
}
