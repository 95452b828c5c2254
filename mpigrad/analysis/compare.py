"""`mpigrad trace compare`: methods over seeds, time-to-target with confidence intervals.

Runs are grouped by the config keys in which they differ, the seed excepted (or by the keys
given with ``--by``); each group is one method (or one method at one learning rate). Per
group, over its runs (seeds):

- ``runs``: complete runs used / runs given; incomplete or failed runs (trace status not
  "complete") are flagged in ``excluded`` and left out unless ``include_incomplete``;
- ``reached``: runs whose (smoothed) training loss reached the target, of those used;
- time to target on the simulated clock: mean and the half-width of its 95 % confidence
  interval (Student t, n - 1 degrees of freedom), over the runs that reached it. When some
  runs never reached it, the mean is marked as over the reaching runs only (``reached``
  says how many), never silently averaged with them;
- ``vs_fp32``, ``vs_best_fixed``, ``vs_best_ddp``: the group's mean time to target
  divided by that of the reference group on the same network model (``NETWORK_KEYS``:
  times at different bandwidths are not compared) whose runs all reached the target:
  mpigrad in float32 (codec ``fp32``, policy ``fixed``), the fastest fixed width of a
  quantizing codec (policy ``fixed``; fp32, fp16 and low rank are baselines, not widths),
  the fastest DDP variant (``bench peers``' runs, modelled on the same network by
  ``analysis.peers``); ``reference_kind`` is the rule. None where a side is missing or
  some of its runs did not reach the target;
- ``sent_mb``: mean megabytes sent per run (up and down);
- training loss (smoothed) and test accuracy at the given simulated times, means over runs.

Runs whose ``loss`` column measures different quantities (``labels.loss_quantity``: with the
paper's l2 term, without it, a script's own) are never ranked on one target: they form
groups of their own (labels tagged ``[loss+l2]``, ``[loss]`` where several quantities are
shown), the ratios and the fastest group are taken among groups of one quantity, and a
footnote names the groups of each quantity. ``fastest``: the group with the least mean time
to target among those of its network and loss quantity whose runs all reached it. A group
none of whose runs reached the target has ``lowest_loss``, the least smoothed loss any of
them got to.

A group whose runs come from different CPUs or library versions (``mixed_provenance``) is
named in a one-line warning: such runs of one seed agree only within float noise.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..machine import FINGERPRINT_KEYS
from ..trace import Trace
from .labels import (LOSS_TAGS, MIXED_CLOCKS, NETWORK_KEY, SIMULATED, WALL_CLOCK, clock_name, common_clock,
                     differing_keys, file_labels, flat_config, format_value, group_key, group_labels,
                     labelled_config, loss_quantity)
from .summary import require_steps, smoothed_loss, time_to_target
from .tables import NOT_AVAILABLE, NOT_YET, AnalysisError, Column, Point, value_at

__all__ = ["Group", "group_runs", "compare_rows", "config_kind", "compare_columns", "compare_key", "partial_note",
           "student_t95", "mean_ci", "mixed_provenance", "provenance_warnings"]

#: Root attributes that say which machine and libraries a run's floats came from.
PROVENANCE_KEYS = (*FINGERPRINT_KEYS, "mpi_library")


#: Two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom (printed tables).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)


def student_t95(df: int) -> float:
    """Two-sided 95 % quantile of Student's t with ``df`` >= 1 degrees of freedom: the table
    up to 30, beyond it the Cornish-Fisher expansion around the normal quantile (error < 1e-4)."""
    if df < 1:
        raise AnalysisError(f"Student t needs at least 1 degree of freedom, got {df}")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.959963984540054
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def mean_ci(values: Sequence[float]) -> tuple[float | None, float | None]:
    """(mean, half-width of the 95 % CI); None where there are too few values."""
    values = [float(v) for v in values]
    if not values:
        return None, None
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, None
    return mean, student_t95(len(values) - 1) * float(np.std(values, ddof=1)) / math.sqrt(len(values))


@dataclass
class Group:
    label: str
    key: str
    runs: list[Trace] = field(default_factory=list)         # used in the statistics
    excluded: list[Trace] = field(default_factory=list)     # incomplete or failed, left out

    @property
    def fixed_bits(self) -> bool:
        flat = flat_config(self.runs[0].config if self.runs else self.excluded[0].config)
        return flat.get("policy", flat.get("policy.id")) == "fixed"


def group_runs(traces: Sequence[Trace], by: Sequence[str] | None = None, *,
               include_incomplete: bool = False) -> list[Group]:
    """Groups in the order their first run was given."""
    if not traces:
        raise AnalysisError("no runs to compare")
    configs = [labelled_config(t) for t in traces]
    keys = differing_keys(configs) if not by else list(by)
    if by:
        known = set().union(*(flat_config(c) for c in configs))
        unknown = [k for k in by if k not in known]
        if unknown:
            raise AnalysisError(f"--by {', '.join(unknown)}: no run has that config key "
                                f"(keys look like lr, policy, policy_opts.epsilon)")
    labels = group_labels(configs, keys)
    quantities = [loss_quantity(t.config) for t in traces]
    if len(set(quantities)) > 1:  # never one group, nor one unmarked label, for two quantities
        labels = [f"{label} [{LOSS_TAGS[quantity]}]" for label, quantity in zip(labels, quantities)]
    groups: dict[str, Group] = {}
    for trace, config, label, quantity in zip(traces, configs, labels, quantities):
        require_steps(trace)
        key = json.dumps([group_key(config, keys), quantity])
        group = groups.setdefault(key, Group(label, key))
        if trace.status == "complete" or include_incomplete:
            group.runs.append(trace)
        else:
            group.excluded.append(trace)
    return list(groups.values())


def mixed_provenance(group: Group) -> dict[str, list[str]]:
    """``PROVENANCE_KEYS`` whose recorded values differ among the group's runs -> those values
    (traces that do not record a key are left out of its comparison)."""
    runs = group.runs + group.excluded
    mixed = {}
    for key in PROVENANCE_KEYS:
        seen = sorted({" ".join(str(t.attrs[key]).split()) for t in runs if t.attrs.get(key) is not None})
        if len(seen) > 1:
            mixed[key] = seen
    return mixed


def provenance_warnings(groups: Sequence[Group]) -> list[str]:
    """One line per group that mixes machines or library versions."""
    lines = []
    for group in groups:
        mixed = mixed_provenance(group)
        if mixed:
            what = "; ".join(f"{key} {' / '.join(values)}" for key, values in mixed.items())
            lines.append(f"warning: {group.label}: runs from different machines or libraries ({what}): "
                         "the same seed agrees only within float noise across them")
    return lines


def _loss_at(trace: Trace, seconds: float, smooth: int) -> float | None:
    steps = trace.steps
    done = np.flatnonzero(steps["sim_time"].to_numpy() <= seconds)
    if seconds > steps["sim_time"].iloc[-1] or done.size == 0:
        return None
    return float(smoothed_loss(trace, smooth)[done[-1]])


def compare_rows(groups: Sequence[Group], target_loss: float, points: Sequence[Point] = (), *,
                 smooth: int = 1) -> list[dict[str, Any]]:
    """One row per group (raw values; None where not available)."""
    if any(p.is_iteration for p in points):
        raise AnalysisError("compare --at takes simulated times (60s, 5m, 2h), not iterations")
    rows = []
    every = [t for group in groups for t in group.runs + group.excluded]
    files = dict(zip(map(id, every), file_labels([t.path for t in every])))
    for group in groups:
        times = [time_to_target(t, target_loss, "sim", smooth) for t in group.runs]
        reached = [x for x in times if x is not None]
        mean, ci = mean_ci(reached)
        n = len(group.runs)
        row: dict[str, Any] = {
            "method": group.label, "runs": f"{n}/{n + len(group.excluded)}",
            "excluded": ", ".join(f"{files[id(t)]} ({t.status})" for t in group.excluded) or "-",
            "reached": f"{len(reached)}/{n}", "target_mean": mean, "target_ci": ci,
            "target_partial": bool(n) and len(reached) < n,
            "clock": clock_name((group.runs or group.excluded)[0].config),
            "sent_mb": float(np.mean([(t.steps["bytes_up"] + t.steps["bytes_down"]).sum() / 1e6
                                      for t in group.runs])) if n else None,
            "loss_quantity": loss_quantity((group.runs or group.excluded)[0].config),
            "lowest_loss": min((x for x in (_lowest(smoothed_loss(t, smooth)) for t in group.runs) if x is not None),
                               default=None),
        }
        for k, point in enumerate(points):
            losses = [x for x in (_loss_at(t, point.value, smooth) for t in group.runs) if x is not None]
            accuracies = [value_at(t, point, clock="sim", metric="accuracy") for t in group.runs]
            accuracies = [a for a in accuracies if a not in (NOT_AVAILABLE, NOT_YET)]
            row[f"loss{k}"] = float(np.mean(losses)) if losses else None
            row[f"acc{k}"] = float(np.mean(accuracies)) if accuracies else None
        rows.append((group, row))
    firsts = [labelled_config((group.runs or group.excluded)[0]) for group, _ in rows]
    differing = [k for k in differing_keys(firsts) if k in NETWORK_KEYS or k.startswith("link_bandwidth.")]
    networks = [network_label(config, differing) for config in firsts]
    for (_, row), network in zip(rows, networks):
        row["network"] = network
    alike = [(network, row["loss_quantity"]) for (_, row), network in zip(rows, networks)]  # like with like
    for column, kind in (("vs_fp32", "fp32"), ("vs_best_fixed", "fixed"), ("vs_best_ddp", "ddp")):
        _ratio_to(rows, alike, column, kind)
    fastest: dict[Any, float] = {}
    for (_, row), key in zip(rows, alike):
        if _reached_by_all(row):
            fastest[key] = min(fastest.get(key, math.inf), row["target_mean"])
    for (_, row), key in zip(rows, alike):
        row["fastest"] = _reached_by_all(row) and row["target_mean"] == fastest[key]
    return [row for _, row in rows]


def _lowest(losses: np.ndarray) -> float | None:
    """The least of ``losses`` (NaN left out); None where every one is NaN."""
    return None if np.isnan(losses).all() else float(np.nanmin(losses))


def _reached_by_all(row: dict[str, Any]) -> bool:
    return row["target_mean"] is not None and not row["target_partial"]


def _ratio_to(rows, networks: Sequence[Any], column: str, kind: str) -> None:
    """``row[column]``: the group's mean time to target over the least of the groups of
    ``kind`` (``reference_kind``) of its ``networks`` entry (network and loss quantity) whose
    runs all reached it; None where either side is missing or partial."""
    best: dict[str, float] = {}
    for (group, row), network in zip(rows, networks):
        if reference_kind(group) == kind and _reached_by_all(row):
            best[network] = min(best.get(network, math.inf), row["target_mean"])
    for (_, row), network in zip(rows, networks):
        row[column] = row["target_mean"] / best[network] if network in best and _reached_by_all(row) else None


def reference_kind(group: Group) -> str | None:
    """What a group is a reference for (``config_kind`` of its first run's config)."""
    return config_kind((group.runs or group.excluded)[0].config)


def config_kind(config: dict[str, Any]) -> str | None:
    """What a run is a reference for: "ddp" (a DDP run of bench peers), "fp32" (mpigrad
    with every gradient in float32, policy ``fixed``), "fixed" (a fixed width of a quantizing
    codec: policy ``fixed``, codec other than ``BASELINE_CODECS``), else None (a moving policy,
    fp16, low rank). The one rule for vs_fp32, vs_best_fixed and vs_best_ddp (and the map's)."""
    if isinstance(config.get("peer"), dict):
        return "ddp"
    flat = flat_config(config)
    if flat.get("policy", flat.get("policy.id")) != "fixed":
        return None
    codec = flat.get("codec", flat.get("codec.id"))
    if codec == "fp32":
        return "fp32"
    return None if codec in BASELINE_CODECS else "fixed"


#: Codecs whose fixed-policy runs are baselines, not fixed widths of a quantizer: float32,
#: float16 and low rank (``powersgd``) never enter ``vs_best_fixed``'s reference.
BASELINE_CODECS = ("fp32", "fp16", "powersgd")


#: Config keys of the network model, and the network the run really had (``labels.NETWORK_KEY``):
#: vs_best_fixed compares groups that agree on them (and on ``link_bandwidth.RANK``, each rank's own link).
#: ``nodes``: the nodes and their exchange (labels.py folds ranks_per_node, exchange and
#: intra_codec into it): a ratio compares runs on the same nodes.
NETWORK_KEYS = ("bandwidth", "latency", "net_mode", "broadcast", NETWORK_KEY, "nodes")


def network_label(config: dict[str, Any], keys: Sequence[str]) -> str:
    """A run's values of the network ``keys``, e.g. 'bandwidth=10MB/s, latency=0s'."""
    flat = flat_config(config)
    return ", ".join(f"{k}={format_value(flat.get(k), k)}" for k in keys)


#: The time-to-target column's prefix by the clock that timed the runs (``labels.common_clock``).
TIME_PREFIX = {SIMULATED: "sim_s", WALL_CLOCK: "wall_s", MIXED_CLOCKS: "s"}


def rows_clock(rows: Sequence[dict[str, Any]]) -> str:
    """The clock that timed every row's runs (``labels.common_clock``)."""
    return common_clock([row["clock"] for row in rows])


def compare_columns(target_loss: float, points: Sequence[Point] = (), clock: str = SIMULATED) -> list[Column]:
    """``clock``: the clock that timed the runs, which names the time column (``sim_s_to_X``,
    ``wall_s_to_X``, or ``s_to_X`` for both)."""
    columns = [Column("method", "method", left=True), Column("runs", "runs"), Column("reached", "reached"),
               Column("target_mean", f"{TIME_PREFIX[clock]}_to_{target_loss:g}", ".1f"), Column("target_ci", "ci95_s", ".1f"),
               Column("vs_fp32", "vs_fp32", ".2f"), Column("vs_best_fixed", "vs_best_fixed", ".2f"),
               Column("vs_best_ddp", "vs_best_ddp", ".2f"), Column("sent_mb", "sent_MB", ".1f")]
    for k, point in enumerate(points):
        columns += [Column(f"loss{k}", f"loss@{point.header}", ".4g"), Column(f"acc{k}", f"acc%@{point.header}", ".1f")]
    return columns + [Column("excluded", "excluded", left=True)]


def partial_note(rows: Sequence[dict[str, Any]], target_loss: float | None = None) -> str:
    """The footnotes: the fastest group to the target (of each network and loss quantity);
    groups whose mean covers only the runs that reached the target; groups none of whose runs
    reached it, with the lowest smoothed loss they got to; the loss quantities when the groups'
    differ; the clocks and network models when the groups ran on more than one."""
    notes = ""
    target = "the target" if target_loss is None else f"the target {target_loss:g}"
    seconds = {SIMULATED: "simulated s", WALL_CLOCK: "s wall clock"}
    fastest = [f"{row['method']} ({row['target_mean']:.1f} {seconds[row['clock']]})"
               for row in rows if row.get("fastest")]
    if fastest:
        notes += (f"* fastest to {target} (least mean time of the groups whose runs all reached it, "
                  f"among groups of one network and loss quantity): {'; '.join(fastest)}\n")
    partial = [row["method"] for row in rows if row["target_partial"] and row["target_mean"] is not None]
    if partial:
        notes += ("* some runs never reached the target: the mean and CI cover the runs that did "
                  f"(see reached): {'; '.join(partial)}\n")
    missed = [row for row in rows if row["target_mean"] is None and row["runs"][0] != "0"]
    if missed:
        lowest = "; ".join(f"{row['method']} (lowest {row['lowest_loss']:.4g})" if row.get("lowest_loss") is not None
                           else row["method"] for row in missed)
        notes += f"* no run reached {target}, so no time to it; the lowest smoothed loss of their runs: {lowest}\n"
    quantities = list(dict.fromkeys(row["loss_quantity"] for row in rows if row.get("loss_quantity")))
    if len(quantities) > 1:
        kinds = " | ".join(f"{quantity}: {'; '.join(row['method'] for row in rows if row['loss_quantity'] == quantity)}"
                           for quantity in quantities)
        notes += ("* the groups' losses are different quantities, one target does not rank them: vs_* and the "
                  f"fastest compare like with like ({kinds})\n")
    if rows_clock(rows) == MIXED_CLOCKS:
        walled = [row["method"] for row in rows if row["clock"] == WALL_CLOCK]
        notes += ("* s_to_: some groups were timed by the simulated clock and some by the wall clock (net_mode "
                  f"off: {'; '.join(walled)}): their times are not measured alike\n")
    networks = list(dict.fromkeys(row["network"] for row in rows if row["network"]))
    if networks:
        notes += ("* the groups ran on different network models; vs_best_fixed compares each with the "
                  f"best fixed-bits group on its own ({' | '.join(networks)})\n")
    return notes


def compare_key(columns: Sequence[Column], target_loss: float) -> list[str]:
    """The key under a text or Markdown compare table: one line per column shown (``columns``,
    as the table shows them) that says what it holds, and when it is N/A."""
    target = f"{target_loss:g}"
    headers = {c.key: c.header for c in columns}
    meanings = {
        "runs": "complete runs used / runs given",
        "reached": f"runs whose smoothed training loss got to {target} or below, of those used",
        "target_mean": f"mean time to {target} over the runs that reached it; N/A where none did",
        "target_ci": "half-width of that mean's 95 % confidence interval (Student t); N/A with fewer than 2 runs "
                     "that reached the target (one seed gives no spread)",
        "vs_fp32": "mean time to target over FP32's (fixed policy) on the same network and loss quantity; below 1: "
                   "faster; N/A unless both groups' runs all reached it",
        "vs_best_fixed": "the same over the fastest fixed width of a quantizing codec",
        "vs_best_ddp": "the same over the fastest DDP variant (--peers)",
        "sent_mb": "mean megabytes sent per run, up and down",
        "excluded": "runs left out: not complete (--include-incomplete uses them)",
    }
    lines = [f"{headers[key]}: {text}" for key, text in meanings.items() if key in headers]
    losses = [c.header for c in columns if c.key.startswith("loss")]
    accuracies = [c.header for c in columns if c.key.startswith("acc")]
    if losses:
        lines.append(f"{', '.join(losses)}: mean smoothed training loss at that simulated time; "
                     f"{', '.join(accuracies)}: mean test accuracy (%) of the last evaluation by then")
    return ["key: " + lines[0], *lines[1:]] if lines else []




def plot_compare(groups: Sequence[Group], output, *, smooth: int = 1, points: int = 200, title: str | None = None,
                 target_loss: float | None = None):
    """Mean smoothed training loss (and test accuracy) against time per group (the clock
    that timed the runs names the axis: ``labels.common_clock``),
    with a 95 % confidence band, on a grid up to the shortest run of each group; the test
    accuracy also as dots at the group's evaluations where they are few (a run evaluated
    once, at its end, is one dot); a dotted grey line at ``target_loss`` where given; the loss
    axis named by what the groups' losses measure (``plots.loss_axis_label``); ``title``, or
    one that says how many groups and which target."""
    from .plots import LINESTYLES, _MAX_MARKERS, _time_unit, check_output, finish, legend_below, loss_axis_label

    output = check_output(output)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    used = [g for g in groups if g.runs]
    if not used:
        raise AnalysisError("no complete runs to plot")
    longest = max(float(t.steps["sim_time"].iloc[-1]) for g in used for t in g.runs)
    unit, scale = _time_unit(longest)
    with_accuracy = any(len(t.eval) for g in used for t in g.runs)
    figure = Figure(figsize=(6.4, 6.2 if with_accuracy else 4.0), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2 if with_accuracy else 1, 1, sharex=True, squeeze=False)[:, 0]
    for k, group in enumerate(used):
        color = f"C{k % 10}"
        end = min(float(t.steps["sim_time"].iloc[-1]) for t in group.runs)
        grid = np.linspace(0.0, end, points)
        curves = np.array([np.interp(grid, t.steps["sim_time"].to_numpy(float), smoothed_loss(t, smooth))
                           for t in group.runs])
        style = LINESTYLES[k % len(LINESTYLES)]
        _band(axes[0], grid / scale, curves, color, f"{group.label} (n={len(group.runs)})", style)
        if with_accuracy:
            evaluated = [t for t in group.runs if len(t.eval)]
            if evaluated:
                acc = np.array([np.interp(grid, t.eval["sim_time"].to_numpy(float),
                                          100 * t.eval["test_accuracy"].to_numpy(float),
                                          left=np.nan) for t in evaluated])
                _band(axes[1], grid / scale, acc, color, group.label, style)
                iterations, times, accuracies = _mean_evaluations(evaluated)
                if len(iterations) <= _MAX_MARKERS:
                    axes[1].plot(times / scale, accuracies, "o", color=color, ms=4)
    if target_loss is not None:
        axes[0].axhline(target_loss, color="0.45", lw=0.9, ls=":", label=f"target loss {target_loss:g}")
    axes[0].set_ylabel(loss_axis_label(smooth, [loss_quantity(g.runs[0].config) for g in used]))
    legend_below(figure, axes[0])
    if with_accuracy:
        axes[1].set_ylabel("Test accuracy (%)")
    clock = common_clock([clock_name(t.config) for g in used for t in g.runs])
    axes[-1].set_xlabel(f"{X_AXIS_NAME[clock]} ({unit})")
    return finish(figure, axes, output, title or f"Mean over seeds, {len(used)} group{'s' * (len(used) != 1)}"
                  + (f", target loss {target_loss:g}" if target_loss is not None else ""))


#: The x axis's name by the clock that timed the runs.
X_AXIS_NAME = {SIMULATED: "Simulated time", WALL_CLOCK: "Wall-clock time", MIXED_CLOCKS: "Time (simulated or wall clock)"}


def _mean_evaluations(runs: Sequence[Trace]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per iteration at which any of ``runs`` was evaluated: the iteration, and the mean over
    those runs of its simulated time and test accuracy (%)."""
    rows = np.concatenate([t.eval[["iteration", "sim_time", "test_accuracy"]].to_numpy(float) for t in runs])
    iterations = np.unique(rows[:, 0])
    means = np.array([rows[rows[:, 0] == i, 1:].mean(axis=0) for i in iterations]).reshape(-1, 2)
    return iterations, means[:, 0], 100 * means[:, 1]


def _band(ax, xs, curves, color, label, linestyle="-"):
    """Mean of ``curves`` (runs x points; NaN before a run's first evaluation) and its 95 % band."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: nothing to draw there
        mean = np.nanmean(curves, axis=0)
        half = None
        if len(curves) > 1:
            half = student_t95(len(curves) - 1) * np.nanstd(curves, axis=0, ddof=1) / math.sqrt(len(curves))
    ax.plot(xs, mean, color=color, lw=1.4, ls=linestyle, label=label)
    if half is not None:
        ax.fill_between(xs, mean - half, mean + half, color=color, alpha=0.2, lw=0)
