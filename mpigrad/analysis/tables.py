"""Paper-style tables (accuracy at given times, Tables 1-2), text/CSV/Markdown rendering, CSV export."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

from .. import options
from ..trace import Trace

__all__ = ["AnalysisError", "Column", "Point", "CLOCKS", "METRICS", "NOT_AVAILABLE", "NOT_YET",
           "render", "fit_width", "wrap", "parse_points", "value_at", "accuracy_table", "export_csv"]

#: Clock name -> time column (seconds since the run started).
CLOCKS = {"sim": "sim_time", "wall": "wall_time"}
#: Table metric -> (eval column, scale, text format).
METRICS = {"accuracy": ("test_accuracy", 100.0, ".1f"), "loss": ("test_loss", 1.0, ".4g")}
#: Cell for a time after the run had ended (the paper's "N/A").
NOT_AVAILABLE = "N/A"
#: Cell for a time before the run's first evaluation.
NOT_YET = "-"
_UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min|h|d)$")


class AnalysisError(ValueError):
    """Bad analysis input (option values, traces that cannot answer the question)."""


@dataclass(frozen=True)
class Column:
    """A table column: the row key, its header, the format of floats in text/Markdown,
    and whether text/Markdown align it to the left (labels) or the right (numbers)."""

    key: str
    header: str
    spec: str = ".4g"
    left: bool = False


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return NOT_AVAILABLE
    if isinstance(value, float):
        return "nan" if math.isnan(value) else format(value, spec)
    return str(value)


def render(rows: Sequence[dict[str, Any]], columns: Sequence[Column], fmt: str = "text") -> str:
    """Rows as an aligned text table, CSV (full precision) or a Markdown table.

    ``None`` is shown as "N/A"; strings are shown as they are.
    """
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([c.header for c in columns])
        for row in rows:
            writer.writerow([NOT_AVAILABLE if row.get(c.key) is None else
                             repr(row[c.key]) if isinstance(row[c.key], float) else row[c.key]
                             for c in columns])
        return out.getvalue()
    cells = [[_cell(row.get(c.key), c.spec) for c in columns] for row in rows]
    if fmt == "markdown":
        lines = ["| " + " | ".join(c.header for c in columns) + " |",
                 "|" + "|".join("---" if c.left else "---:" for c in columns) + "|"]
        lines += ["| " + " | ".join(line) + " |" for line in cells]
        return "\n".join(lines) + "\n"
    if fmt != "text":
        raise AnalysisError(f"unknown table format {fmt!r} (text, csv, markdown)")
    widths = [max([len(c.header)] + [len(line[k]) for line in cells]) for k, c in enumerate(columns)]

    def line(values: Iterable[str]) -> str:
        return "  ".join(v.ljust(w) if c.left else v.rjust(w)
                         for v, w, c in zip(values, widths, columns)).rstrip()

    return "\n".join([line(c.header for c in columns)] + [line(cells_) for cells_ in cells]) + "\n"


def fit_width(rows: Sequence[dict[str, Any]], columns: Sequence[Column], shorts: Sequence[str], width: int, *,
              label: str = "method", notes: Sequence[str] = ("excluded",)) -> tuple[str, list[dict[str, Any]]]:
    """A text table that fits ``width`` columns where it can, and the rows as it shows them.
    As ``render`` when it fits; else each ``label`` cell longer than its short name
    (``shorts``, one per row, e.g. the method without the config keys) becomes
    ``short [k]`` and the ``notes`` columns leave the table (then, if it is still too wide, the
    columns N/A in every row too), and a key below it, wrapped to ``width``, gives each
    ``[k]``'s full label and notes and names the columns left out."""
    text = render(rows, columns, "text")
    if max(map(len, text.splitlines()), default=0) <= width:
        return text, list(rows)
    shown, key = [], []
    for row, short in zip(rows, shorts):
        row = dict(row)
        extra = [f"{c}: {row[c]}" for c in notes if row.get(c) not in (None, "-", "")]
        if len(row[label]) > len(short) or extra:
            mark = f"[{len(key) + 1}]"
            key.append(f"{mark} {'; '.join([row[label], *extra])}")
            row[label] = f"{short} {mark}"
        shown.append(row)
    kept = [c for c in columns if c.key not in notes]
    text = render(shown, kept, "text")
    empty = [c for c in kept if c.key != label and all(row.get(c.key) is None for row in rows)]
    if max(map(len, text.splitlines())) > width and empty:
        text = render(shown, [c for c in kept if c not in empty], "text")
        key.append(f"N/A in every row, left out: {', '.join(c.header for c in empty)}")
    return text + wrap(key, width), shown


def wrap(lines: Iterable[str], width: int) -> str:
    """Lines of notes wrapped to ``width`` columns, each continuation indented."""
    import textwrap

    return "".join(textwrap.fill(line, width, subsequent_indent="    ", break_on_hyphens=False) + "\n"
                   for line in lines)


class Point(NamedTuple):
    """A column of an accuracy table: a time in seconds on a clock, or an iteration."""

    header: str
    value: float
    is_iteration: bool


def parse_points(text: str, *, iterations: bool = False) -> list[Point]:
    """Parse "5h,15h,30h" (durations with s, m/min, h or d) or "100,500" (iterations)."""
    points = []
    for token in (t.strip() for t in str(text).split(",")):
        if not token:
            raise AnalysisError(f"empty entry in {text!r}")
        if token.isdigit():
            points.append(Point(f"it {int(token)}", float(int(token)), True))
            continue
        match = _DURATION.match(token)
        if not match or iterations:
            expected = "an iteration number" if iterations else "a duration such as 5h, 90m, 30s or an iteration number"
            raise AnalysisError(f"bad point {token!r}: expected {expected}")
        points.append(Point(token, float(match.group(1)) * _UNITS[match.group(2)], False))
    if len({p.is_iteration for p in points}) > 1:
        raise AnalysisError(f"{text!r} mixes durations and iteration numbers")
    return points


def value_at(trace: Trace, point: Point, *, clock: str = "sim", metric: str = "accuracy") -> Any:
    """The metric of the last evaluation at or before ``point``: a float, "N/A" when the
    run had ended before ``point``, "-" when no evaluation had happened yet.

    An iteration point N means "after N iterations", as the progress line counts them
    ("iter 300/300"): the trace's row ``iteration`` m is the (m + 1)-th iteration."""
    column, scale, _ = METRICS[metric]
    steps, evals = trace.steps, trace.eval
    if len(steps) == 0:
        return NOT_AVAILABLE
    if point.is_iteration:
        reached, eval_at = steps["iteration"].iloc[-1] + 1, evals["iteration"] + 1 if len(evals) else None
    else:
        reached, eval_at = steps[CLOCKS[clock]].iloc[-1], evals[CLOCKS[clock]] if len(evals) else None
    if point.value > reached:
        return NOT_AVAILABLE
    if eval_at is None:
        return NOT_YET
    done = evals[eval_at <= point.value]
    return NOT_YET if len(done) == 0 else float(done[column].iloc[-1]) * scale


def accuracy_table(traces: Sequence[Trace], labels: Sequence[str], points: Sequence[Point], *,
                   clock: str = "sim", metric: str = "accuracy") -> tuple[list[dict], list[Column]]:
    """One row per run, one column per point (the paper's Tables 1-2)."""
    if clock not in CLOCKS:
        raise AnalysisError(f"unknown clock {clock!r} (sim, wall)")
    if metric not in METRICS:
        raise AnalysisError(f"unknown metric {metric!r} ({', '.join(METRICS)})")
    spec = METRICS[metric][2]
    columns = [Column("method", "method", left=True)] + [Column(f"p{k}", p.header, spec) for k, p in enumerate(points)]
    rows = []
    for trace, label in zip(traces, labels):
        row: dict[str, Any] = {"method": label}
        for k, point in enumerate(points):
            row[f"p{k}"] = value_at(trace, point, clock=clock, metric=metric)
        rows.append(row)
    return rows, columns


def table_key(rows: Sequence[dict], *, clock: str = "sim", metric: str = "accuracy", iterations: bool = False) -> str:
    """The line under a text ``trace table`` that says what its cells are, and what "-" and
    "N/A" mean where they appear."""
    what = "test accuracy (%)" if metric == "accuracy" else "test loss"
    where = ("within each point's iterations" if iterations
             else f"at or before each point on the {'simulated' if clock == 'sim' else 'wall'} clock")
    cells = {value for row in rows for key, value in row.items() if key != "method"}
    marks = [text for mark, text in ((NOT_YET, f"{NOT_YET}: not evaluated yet"),
                                     (NOT_AVAILABLE, f"{NOT_AVAILABLE}: past the run's end")) if mark in cells]
    return "; ".join([f"cells: the {what} of the last evaluation {where}", *marks])


def export_csv(trace: Trace, directory: str | Path, *, force: bool = False) -> list[Path]:
    """Write every table as ``DIR/<table>.csv`` and the root attributes as ``DIR/attrs.json``.

    Refuses to overwrite existing files unless ``force``; creates ``DIR`` if needed.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise AnalysisError(f"{directory} exists and is not a folder")
    targets = {name: directory / f"{name}.csv" for name in trace.tables}
    targets["attrs"] = directory / "attrs.json"
    options.check_overwrite(targets.values(), force, error=AnalysisError)
    directory.mkdir(parents=True, exist_ok=True)
    for name, frame in trace.tables.items():
        frame.to_csv(targets[name], index=False)
    targets["attrs"].write_text(json.dumps(trace.attrs, indent=2, default=_json_default) + "\n")
    return list(targets.values())


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot serialise {type(value).__name__}")
