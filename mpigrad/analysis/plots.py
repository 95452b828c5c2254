"""Paper-style figures: training loss, test accuracy and bits against time or iteration.

matplotlib is imported only here, inside ``plot_traces``, and drawn through the Agg canvas
directly (no pyplot, no global backend switch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..trace import Trace
from .labels import LOSS_ALONE, LOSS_TAGS, LOSS_WITH_L2, SCRIPT_LOSS, loss_quantity
from .summary import require_steps, smoothed_loss
from .tables import AnalysisError

__all__ = ["plot_traces", "X_AXES", "FORMATS"]

#: --x choice -> (steps/eval column, axis name)
X_AXES = {"sim": ("sim_time", "Simulated time"), "wall": ("wall_time", "Wall-clock time"),
          "iteration": ("iteration", "Iteration")}
FORMATS = (".png", ".pdf", ".svg")
_MAX_POINTS = 4000   # per line; longer runs are thinned evenly
_MAX_MARKERS = 40    # evaluations drawn as dots up to this many per run


def _time_unit(longest_seconds: float) -> tuple[str, float]:
    if longest_seconds >= 2 * 3600:
        return "h", 3600.0
    if longest_seconds >= 2 * 60:
        return "min", 60.0
    return "s", 1.0


def _thin(n: int) -> slice:
    return slice(None, None, max(1, n // _MAX_POINTS))


def plot_traces(traces: Sequence[Trace], labels: Sequence[str], output: str | Path, *, x: str = "sim",
                smooth: int = 1, accuracy: bool = True, title: str | None = None) -> Path:
    """Draw loss, test accuracy (when evaluated) and bits, one line per run, into ``output``:
    each run its colour and, in turn, a line style (``LINESTYLES``), so that equal curves
    show; the bits axis ticked at integers only; ``title`` or ``default_title``'s; where the
    runs' losses are different quantities (``labels.loss_quantity``), each legend label
    says which."""
    output = check_output(output)
    if x not in X_AXES:
        raise AnalysisError(f"unknown x axis {x!r} ({', '.join(X_AXES)})")
    for trace in traces:
        require_steps(trace)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    column, axis_name = X_AXES[x]
    if x == "iteration":
        unit, scale, xlabel = "", 1.0, axis_name
    else:
        unit, scale = _time_unit(max(float(t.steps[column].iloc[-1]) for t in traces))
        xlabel = f"{axis_name} ({unit})"
    with_accuracy = accuracy and any(len(t.eval) and "test_accuracy" in t.eval for t in traces)
    panels = ["loss"] + (["accuracy"] if with_accuracy else []) + ["bits"]
    heights = {"loss": 3.0, "accuracy": 2.2, "bits": 1.6}
    figure = Figure(figsize=(6.4, sum(heights[p] for p in panels) + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = dict(zip(panels, figure.subplots(len(panels), 1, sharex=True,
                                            gridspec_kw={"height_ratios": [heights[p] for p in panels]})))
    quantities = [loss_quantity(t.config) for t in traces]
    if len(set(quantities)) > 1:
        labels = [f"{label} [{LOSS_TAGS[quantity]}]" for label, quantity in zip(labels, quantities)]
    for k, (trace, label) in enumerate(zip(traces, labels)):
        color, style = f"C{k % 10}", LINESTYLES[k % len(LINESTYLES)]
        steps = trace.steps
        xs = steps[column].to_numpy(dtype=np.float64) / scale
        loss = smoothed_loss(trace, smooth)
        keep = _thin(len(xs))
        axes["loss"].plot(xs[keep], loss[keep], color=color, lw=1.4, ls=style, alpha=_ALPHA, label=label)
        axes["bits"].plot(xs[keep], steps["bits"].to_numpy()[keep], color=color, lw=1.2, ls=style, alpha=_ALPHA,
                          drawstyle="steps-post", label=label)
        if with_accuracy and len(trace.eval):
            evals = trace.eval
            axes["accuracy"].plot(evals[column].to_numpy(dtype=np.float64) / scale,
                                  100 * evals["test_accuracy"].to_numpy(), color=color, lw=1.4, ls=style,
                                  alpha=_ALPHA, marker=_MARKERS[k % len(_MARKERS)] if len(evals) <= _MAX_MARKERS
                                  else None, ms=4, label=label)
    axes["loss"].set_ylabel(loss_axis_label(smooth, quantities))
    legend_below(figure, axes["loss"], title="method")
    if with_accuracy:
        axes["accuracy"].set_ylabel("Test accuracy (%)")
    axes["bits"].set_ylabel("Bits")
    low = min(int(t.steps["bits"].min()) for t in traces)
    high = max(int(t.steps["bits"].max()) for t in traces)
    axes["bits"].set_ylim(low - 0.5, high + 0.5)
    # integers only, the one width of a fixed run too (min_n_ticks=1: MaxNLocator's default
    # of 2 falls back to 1.6 and 2.4 where the axis holds one integer)
    axes["bits"].yaxis.set_major_locator(MaxNLocator(nbins=min(high - low + 1, 6), integer=True, min_n_ticks=1))
    axes["bits"].set_xlabel(xlabel)
    return finish(figure, axes.values(), output, title or default_title(traces))


#: Line styles of the curves, in turn with the colours (solid, dashed, dotted, dash-dot): a
#: curve equal to another's still shows its colour between the other's dashes.
LINESTYLES = ("-", (0, (5, 3)), (0, (1, 2)), (0, (6, 2, 1, 2)))
#: Markers of the evaluations, in turn, and the curves' opacity: overlapping curves show through.
_MARKERS = ("o", "s", "^", "D", "v")
_ALPHA = 0.85


def default_title(traces: Sequence[Trace]) -> str:
    """The figure's title without ``--title``: what the runs trained, where their configs
    agree on it (``paper_cnn on cifar10, 4 workers``), and how many runs are drawn."""
    parts = []
    for key, text in (("model", "{}"), ("data", "on {}"), ("workers", "{} workers")):
        values = {str(t.config.get(key)) for t in traces if isinstance(t.config, dict) and t.config.get(key) is not None}
        if len(values) == 1 and len([t for t in traces if t.config.get(key) is not None]) == len(traces):
            parts.append(text.format(values.pop()))
    runs = f"{len(traces)} run{'s' * (len(traces) != 1)}"
    return f"{' '.join(parts)} ({runs})" if parts else runs


#: The loss axis's name by what the runs' losses measure (``labels.loss_quantity``).
LOSS_AXIS_NAMES = {LOSS_WITH_L2: "Training loss + l2", LOSS_ALONE: "Training loss",
                   SCRIPT_LOSS: "Training loss (the script's)"}


def loss_axis_label(smooth: int, quantities: Sequence[str] = (LOSS_WITH_L2,)) -> str:
    """The loss axis: what the traces' ``loss`` column measures (``quantities``, one per run:
    ``labels.loss_quantity``): "Training loss + l2" where every run's loss has the l2 term,
    "Training loss" where none has, and a name that says they differ otherwise (the legend
    labels then say which is which); the smoothing on a line of its own, so that a short
    panel shows it whole."""
    kinds = set(quantities) or {LOSS_WITH_L2}
    name = LOSS_AXIS_NAMES[kinds.pop()] if len(kinds) == 1 else "Training loss (differs by run: see legend)"
    return name + (f"\n(mean of {smooth} it.)" if smooth > 1 else "")


#: Characters per line of a legend label under a figure 6.4 in wide at the legend's font (medium);
#: longer labels wrap (a figure wider than 6.4 in allows proportionally more).
_LEGEND_CHARACTERS = 66


def legend_below(figure, ax, **options) -> None:
    """The legend of ``ax``'s lines under the panels, where it covers no curve (``ncols``:
    that many columns, else 1 for long labels and 2 otherwise); labels too long for the
    figure's width are wrapped, never cut off at its edges."""
    import textwrap

    handles, labels = ax.get_legend_handles_labels()
    columns = options.pop("ncols", None) or (1 if max(map(len, labels), default=0) > 30 else min(len(labels), 2))
    width = int(_LEGEND_CHARACTERS * figure.get_figwidth() / 6.4 / max(columns, 1))
    labels = [textwrap.fill(label, width, subsequent_indent="  ", break_on_hyphens=False) for label in labels]
    figure.legend(handles, labels, loc="outside lower center", ncols=max(columns, 1), frameon=False,
                  fontsize="medium", **options)
    lines = sum(label.count("\n") + 1 for label in labels) / max(columns, 1)
    figure.set_figheight(figure.get_figheight() + _LEGEND_LINE_INCHES * lines)  # the panels keep their height


#: The height of a line of the legend (medium font and spacing), added to the figure's.
_LEGEND_LINE_INCHES = 0.22


def check_output(output: str | Path) -> Path:
    """``output`` as a Path; AnalysisError unless it is a .png/.pdf/.svg in an existing folder."""
    output = Path(output)
    if output.suffix.lower() not in FORMATS:
        raise AnalysisError(f"output {output} must end in {', '.join(FORMATS)}")
    if not output.parent.is_dir():
        raise AnalysisError(f"cannot write {output}: folder {output.parent} does not exist")
    return output


def finish(figure, axes, output: Path, title: str | None) -> Path:
    """Grid and x from 0 on every panel, the title, then save."""
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_xlim(left=0)
    if title:
        figure.suptitle(title)
    figure.savefig(output, dpi=150)
    return output
