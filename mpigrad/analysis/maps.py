"""The map over bandwidths: time to a target relative to FP32, per method and bandwidth.

Reads traces only (each a run, a re-timed run, or a DDP run modelled by ``analysis.peers``).
A trace's *cell* is (method, network): the method is its label without the " (retimed)"
mark (re-timing does not change the method), the network its ``bandwidth`` (a rate or a
schedule, as its config keeps it). Per cell and learning rate, the runs (seeds) give times
to the target on the simulated clock; the cell's **best rate** is the one with the least
mean time among the rates whose every run reached the target (none: the cell did not reach
it). Then, per cell at its best rate:

- ``ratio`` = the method's time over FP32's at FP32's best rate on the same network, paired by
  seed (each seed's ratio; mean and 95 % Student t interval over the seeds both reached it
  with; with one seed no interval). Below 1: faster than FP32.
- ``vs_ddp`` = the method's mean time over the best DDP variant's mean on that network
  (DDP's runs are one rate's, modelled; no interval: the two sides have no shared seeds
  in the sense of one run's randomness).

``crossover`` states, from the ratios (not by hand), below which bandwidth a method beats a
reference: a method whose mean ratio is below 1 on a contiguous range of the lowest
bandwidths of the grid and at or above 1 beyond it crosses between the last bandwidth where
it wins and the next, at the point where the log ratio, interpolated linearly in log
bandwidth, reaches 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..units import format_network_value
from ..trace import Trace
from ..trace.reader import RETIMED_MARK
from .compare import config_kind, mean_ci
from .labels import flat_config
from .summary import time_to_target
from .tables import AnalysisError, Column

__all__ = ["Cell", "map_cells", "map_rows", "map_columns", "crossover", "crossovers", "none_beats",
           "plot_map", "FP32", "method_of", "congestion_rows", "congestion_columns"]

#: The reference method of the map (mpigrad with every gradient in float32).
FP32 = "FP32"


def method_of(trace: Trace) -> str:
    """The trace's method: its label without the re-timed mark."""
    label = trace.label
    return label[: -len(RETIMED_MARK)] if label.endswith(RETIMED_MARK) else label


def network_of(trace: Trace) -> float | str:
    return trace.config.get("bandwidth")


#: The rate of a script's run (mpigrad.Session), which its trace does not know: its optimizer's.
SCRIPT_RATE = "script's"


@dataclass
class Cell:
    """One (method, network) at every rate: ``times[lr][seed]`` = seconds to the target,
    None for a run that never reached it."""

    method: str
    network: float | str
    times: dict[float | str, dict[int, float | None]] = field(default_factory=dict)
    kind: str | None = None        # compare.config_kind: "fp32", "fixed", "ddp" or None

    @property
    def ddp(self) -> bool:
        return self.kind == "ddp"

    def best_lr(self) -> float | str | None:
        """The rate of least mean time among those run on every seed of the cell (means over
        different seeds do not compare) whose every run reached the target (``SCRIPT_RATE``
        for a script's runs, whose rate is the script's)."""
        seeds = {seed for runs in self.times.values() for seed in runs}
        reached = {lr: np.mean(list(t.values())) for lr, t in self.times.items()
                   if set(t) == seeds and all(v is not None for v in t.values())}
        return min(reached, key=lambda lr: (reached[lr], math.inf if lr == SCRIPT_RATE else lr)) if reached else None

    def best(self) -> dict[int, float] | None:
        lr = self.best_lr()
        return None if lr is None else dict(self.times[lr])


def map_cells(traces: Sequence[Trace], target_loss: float, smooth: int) -> list[Cell]:
    """The traces' cells, in the order first seen; incomplete traces are left out."""
    cells: dict[tuple[str, str], Cell] = {}
    for trace in traces:
        if trace.status != "complete":
            continue
        network = network_of(trace)
        method = method_of(trace)
        cell = cells.setdefault((method, repr(network)), Cell(method, network, kind=config_kind(trace.config)))
        lr = flat_config(trace.config).get("lr")
        lr = SCRIPT_RATE if lr is None else float(lr)
        seed = int(trace.config.get("seed", trace.attrs.get("seed", 0)))
        cell.times.setdefault(lr, {})[seed] = time_to_target(trace, target_loss, "sim", smooth)
    return list(cells.values())


def _paired(mine: dict[int, float], reference: dict[int, float]) -> tuple[float | None, float | None, int]:
    ratios = [mine[s] / reference[s] for s in sorted(set(mine) & set(reference))]
    mean, ci = mean_ci(ratios)
    return mean, ci, len(ratios)


def bandwidth_value(network: float | str) -> float | None:
    """A constant rate in bytes/s; None for a schedule."""
    return float(network) if not isinstance(network, str) else None


def best_fixed_cells(cells: Sequence[Cell]) -> dict[str, Cell]:
    """repr(network) -> the ``fixed`` cell of least mean time at its best rate there."""
    best: dict[str, Cell] = {}
    for c in cells:
        times = c.best()
        if c.kind == "fixed" and times:
            key = repr(c.network)
            if key not in best or np.mean(list(times.values())) < np.mean(list(best[key].best().values())):
                best[key] = c
    return best


def map_rows(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """One row per cell: method, network, best rate, reached, mean time and its interval,
    ratio to FP32 and to the best fixed width (each paired by seed) with their intervals,
    ratio to the best DDP variant."""
    reference = {repr(c.network): c.best() for c in cells if c.method == FP32}
    best_fixed = best_fixed_cells(cells)
    ddp_best: dict[str, float] = {}
    for c in cells:
        best = c.best()
        if c.ddp and best:
            key = repr(c.network)
            ddp_best[key] = min(ddp_best.get(key, math.inf), float(np.mean(list(best.values()))))
    rows = []
    for c in cells:
        lr = c.best_lr()
        best = c.best()
        key = repr(c.network)
        runs = c.times.get(lr, {}) if lr is not None else {}
        reached = max((sum(v is not None for v in t.values()), len(t)) for t in c.times.values())
        mean, ci = mean_ci(list(best.values())) if best else (None, None)
        ratio = ratio_ci = None
        pairs = 0
        if best and reference.get(key):
            ratio, ratio_ci, pairs = _paired(best, reference[key])
        fixed = best_fixed.get(key)
        vs_fixed, vs_fixed_ci, _ = _paired(best, fixed.best()) if best and fixed else (None, None, 0)
        rows.append({"method": c.method, "network": format_network_value(c.network),
                     "bandwidth": bandwidth_value(c.network), "ddp": c.ddp,
                     "best_lr": lr, "seeds": len(runs),
                     "reached": f"{reached[0]}/{reached[1]}" if lr is None else f"{len(runs)}/{len(runs)}",
                     "time_mean": mean, "time_ci": ci, "vs_fp32": ratio, "vs_fp32_ci": ratio_ci,
                     "pairs": pairs, "best_fixed": fixed.method if fixed else None,
                     "vs_best_fixed": vs_fixed, "vs_best_fixed_ci": vs_fixed_ci,
                     "vs_ddp": mean / ddp_best[key] if mean is not None and key in ddp_best else None})
    return rows


def map_columns(target_loss: float) -> list[Column]:
    return [Column("method", "method", left=True), Column("network", "bandwidth"), Column("best_lr", "best_lr", "g"),
            Column("reached", "reached"), Column("time_mean", f"sim_s_to_{target_loss:g}", ".1f"),
            Column("time_ci", "ci95_s", ".1f"), Column("vs_fp32", "vs_fp32", ".3f"),
            Column("vs_fp32_ci", "vs_fp32_ci95", ".3f"), Column("vs_best_fixed", "vs_best_fixed", ".3f"),
            Column("vs_best_fixed_ci", "vs_best_fixed_ci95", ".3f"), Column("vs_ddp", "vs_best_ddp", ".3f")]


def map_pivot(rows: Sequence[dict[str, Any]], value: str = "vs_fp32") -> tuple[list[dict[str, Any]], list[Column]]:
    """The map's ``value`` ("vs_fp32" or "vs_best_fixed") and its 95 % interval as a table of
    a row per method and a column per constant bandwidth ("0.140 +- 0.023"; "-" where the
    method has none), for render()."""
    bandwidths = sorted({r["bandwidth"] for r in rows if r["bandwidth"]})
    names = {b: format_network_value(b) for b in bandwidths}
    table: dict[str, dict[str, Any]] = {}
    for r in rows:
        if not r["bandwidth"]:
            continue
        entry = table.setdefault(r["method"], {"method": r["method"], **{names[b]: "-" for b in bandwidths}})
        mean, ci = r.get(value), r.get(f"{value}_ci")
        if mean is not None:
            entry[names[r["bandwidth"]]] = f"{mean:.3f}" + ("" if ci is None else f" +- {ci:.3f}")
    columns = [Column("method", "method", left=True)] + [Column(names[b], names[b]) for b in bandwidths]
    return list(table.values()), columns


def crossover(points: Sequence[tuple[float, float | None]]) -> dict[str, Any]:
    """From (bandwidth, ratio) pairs (ratio < 1: the method wins; None: not known there):
    ``kind`` "all" (wins at every known bandwidth), "none", "below" (wins on the lowest
    bandwidths only; ``at`` the interpolated crossing in bytes/s, ``between`` the two grid
    bandwidths), "above" (wins on the highest only, likewise), "mixed", or "unknown";
    ``wins`` the bandwidths where it wins."""
    known = sorted((b, r) for b, r in points if r is not None and b is not None)
    if not known:
        return {"kind": "unknown", "wins": [], "at": None, "between": None}
    wins = [r < 1.0 for _, r in known]
    result = {"wins": [b for (b, _), w in zip(known, wins) if w], "at": None, "between": None}
    if all(wins):
        return {**result, "kind": "all"}
    if not any(wins):
        return {**result, "kind": "none"}
    flips = [k for k in range(1, len(wins)) if wins[k] != wins[k - 1]]
    if len(flips) != 1:
        return {**result, "kind": "mixed"}
    k = flips[0]
    (b0, r0), (b1, r1) = known[k - 1], known[k]
    x0, x1, y0, y1 = math.log(b0), math.log(b1), math.log(r0), math.log(r1)
    at = math.exp(x0 + (0.0 - y0) * (x1 - x0) / (y1 - y0)) if y1 != y0 else math.sqrt(b0 * b1)
    return {**result, "kind": "below" if wins[0] else "above", "at": at, "between": (b0, b1)}


def _sentence(method: str, reference: str, result: dict[str, Any]) -> str:
    rate = lambda b: format_network_value(b)  # noqa: E731
    kind = result["kind"]
    if kind == "all":
        return f"{method} beats {reference} at every bandwidth of the map"
    if kind == "none":
        return f"{method} beats {reference} at no bandwidth of the map"
    if kind == "unknown":
        return f"{method} vs {reference}: no bandwidth where both reached the target"
    if kind == "mixed":
        return f"{method} beats {reference} at {', '.join(map(rate, result['wins']))} only (not one range)"
    b0, b1 = result["between"]
    side = "below" if kind == "below" else "above"
    at = float(f"{result['at']:.2g}")  # an interpolation between grid points: two figures
    return (f"{method} beats {reference} {side} about {rate(at)} "
            f"(between {rate(b0)} and {rate(b1)} of the map)")


def crossovers(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method (DDP variants included), the crossover against FP32 and, where the rows
    have DDP variants, against the best of them (not for a DDP variant), with a sentence each."""
    out = []
    any_ddp = any(r["ddp"] for r in rows)
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method and r["bandwidth"] is not None]
        entry = {"method": method}
        for column, reference in (("vs_fp32", FP32), ("vs_ddp", "the best DDP variant")):
            if method == FP32 and column == "vs_fp32":
                continue
            result = crossover([(r["bandwidth"], r[column]) for r in mine])
            if column == "vs_ddp" and (not any_ddp or (mine and mine[0]["ddp"])):
                continue
            entry[column] = result
            entry[column + "_text"] = _sentence(method, reference, result)
        out.append(entry)
    return out


def none_beats(rows: Sequence[dict[str, Any]]) -> list[float]:
    """The bandwidths of the map at which no method (DDP included) beats FP32."""
    bandwidths = sorted({r["bandwidth"] for r in rows if r["bandwidth"] is not None})
    return [b for b in bandwidths
            if not any(r["vs_fp32"] is not None and r["vs_fp32"] < 1.0 for r in rows
                       if r["bandwidth"] == b and r["method"] != FP32)]


def plot_map(rows: Sequence[dict[str, Any]], output, *, title: str | None = None):
    """Time to the target relative to FP32 against bandwidth (log axis): a line per method
    through its bandwidths, with its 95 % band (paired by seed) where it has one."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .plots import check_output, legend_below

    output = check_output(output)
    methods = [m for m in dict.fromkeys(r["method"] for r in rows)
               if any(r["method"] == m and r["vs_fp32"] is not None and r["bandwidth"] for r in rows)]
    if not methods:
        raise AnalysisError("no method has a ratio to FP32 at a constant bandwidth: nothing to plot")
    figure = Figure(figsize=(8.0, 6.4), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    palette = matplotlib.colormaps["tab20"]
    for k, method in enumerate(methods):
        # tab20's ten strong hues first, then their light twins: 20 lines before a colour repeats
        color = palette((2 * k) % 20 + (k // 10) % 2)
        marker = "os^vD"[(k // 10) % 5]
        mine = sorted((r["bandwidth"], r["vs_fp32"], r["vs_fp32_ci"]) for r in rows
                      if r["method"] == method and r["vs_fp32"] is not None and r["bandwidth"])
        xs = np.array([b for b, _, _ in mine]) / 1e6
        ys = np.array([y for _, y, _ in mine])
        half = np.array([np.nan if c is None else c for _, _, c in mine])
        style = "--" if "DDP" in method else "-"
        ax.plot(xs, ys, style, marker=marker, ms=3.5, color=color, lw=1.3, label=method)
        if np.isfinite(half).any():
            ax.fill_between(xs, ys - np.nan_to_num(half), ys + np.nan_to_num(half), color=color,
                            alpha=0.12, lw=0)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("Bandwidth (MB/s, simulated)")
    ax.set_ylabel("Time to target / FP32's (best rate each)")
    ax.grid(True, which="both", alpha=0.3)
    legend_below(figure, ax, ncols=2)
    if title:
        figure.suptitle(title)
    figure.savefig(output)
    return output



def congestion_rows(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """Per cell (a method on one schedule, each at the one rate it ran at): time to the
    target (mean, 95 % interval), and its ratio to the best fixed width on that network
    (least mean time of the ``fixed`` cells), paired by seed, with its interval; ``beats``:
    "yes" when the interval lies below 1, "no" when above, "not resolved" when it spans 1."""
    best_fixed = best_fixed_cells(cells)
    rows = []
    for c in cells:
        times = c.best()
        key = repr(c.network)
        mean, ci = mean_ci(list(times.values())) if times else (None, None)
        ratio = ratio_ci = None
        reference = best_fixed.get(key)
        if times and reference is not None:
            ratio, ratio_ci, _ = _paired(times, reference.best())
        if ratio is None or ratio_ci is None or reference is c:
            beats = "-"
        else:
            beats = "yes" if ratio + ratio_ci < 1 else "no" if ratio - ratio_ci > 1 else "not resolved"
        total = max(len(t) for t in c.times.values())
        reached = max(sum(v is not None for v in t.values()) for t in c.times.values())
        rows.append({"method": c.method, "network": format_network_value(c.network), "lr": c.best_lr(),
                     "reached": f"{reached}/{total}", "time_mean": mean, "time_ci": ci,
                     "best_fixed": reference.method if reference else None,
                     "vs_best_fixed": ratio, "vs_best_fixed_ci": ratio_ci, "beats": beats, "kind": c.kind})
    return rows


def congestion_columns(target_loss: float) -> list[Column]:
    return [Column("method", "method", left=True), Column("network", "bandwidth", left=True),
            Column("lr", "lr", "g"), Column("reached", "reached"),
            Column("time_mean", f"sim_s_to_{target_loss:g}", ".1f"), Column("time_ci", "ci95_s", ".1f"),
            Column("best_fixed", "best_fixed", left=True), Column("vs_best_fixed", "vs_best_fixed", ".3f"),
            Column("vs_best_fixed_ci", "ci95", ".3f"), Column("beats", "beats_best_fixed")]
