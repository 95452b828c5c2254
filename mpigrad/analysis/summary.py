"""Per-run figures: the `summary` table (one row per run) and the `info` description.

Definitions (all sums run over the rows of the ``steps`` table):

- total bytes = sum(bytes_up + bytes_down);
- compression ratio against float32 = iterations * attrs["float32_bytes_per_iteration"] / total bytes;
- time to target loss = the clock at the first iteration whose loss (trailing mean over
  ``smooth`` iterations) is at or below the target;
- quantization overhead fraction = sum(t_encode + t_decode + t_policy) / the clock's value at
  the last iteration (sim_time by default, i.e. the run's length on the simulated clock).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from ..config import describe_recipe
from ..units import format_duration
from ..trace import STEPS_COLUMNS, Trace, network
from .labels import WALL_CLOCK, clock_name, nodes_label, trace_ranks_per_node
from .tables import CLOCKS, AnalysisError, Column

__all__ = ["require_steps", "marked_label", "smoothed_loss", "time_to_target", "iterations_to_target", "overhead_fraction",
           "compression_ratio", "summarize", "summary_columns", "describe", "nodes_text"]


def require_steps(trace: Trace) -> None:
    """AnalysisError unless ``trace`` has at least one steps row with the standard columns."""
    steps = trace.steps
    missing = [name for name in STEPS_COLUMNS if name not in steps.columns]
    if "steps" in trace.tables and missing:
        raise AnalysisError(f"{trace.path}: steps table lacks columns {missing}")
    if len(steps) == 0:
        raise AnalysisError(f"{trace.path}: the run recorded no iterations (status {trace.status})")


def marked_label(trace: Trace, label: str) -> str:
    """``label`` with the run's status appended unless it completed: "MQGrad [failed]"."""
    return label if trace.status == "complete" else f"{label} [{trace.status}]"


def smoothed_loss(trace: Trace, smooth: int = 1) -> np.ndarray:
    """Training loss per iteration, averaged over the last ``smooth`` iterations (fewer at the start)."""
    if smooth < 1:
        raise AnalysisError(f"smoothing window must be at least 1 iteration, got {smooth}")
    loss = trace.steps["loss"]
    return (loss if smooth == 1 else loss.rolling(smooth, min_periods=1).mean()).to_numpy(dtype=np.float64)


def time_to_target(trace: Trace, target: float, clock: str = "sim", smooth: int = 1) -> float | None:
    """Seconds on ``clock`` until the (smoothed) loss first reaches ``target``; None if never."""
    row = _first_at_target(trace, target, smooth)
    return None if row is None else float(trace.steps[CLOCKS[clock]].iloc[row])


def iterations_to_target(trace: Trace, target: float, smooth: int = 1) -> int | None:
    """Iterations run until the (smoothed) loss first reaches ``target`` (that iteration
    included); None if never. The same rule as ``time_to_target``."""
    row = _first_at_target(trace, target, smooth)
    return None if row is None else row + 1


def _first_at_target(trace: Trace, target: float, smooth: int) -> int | None:
    reached = np.flatnonzero(smoothed_loss(trace, smooth) <= target)
    return None if reached.size == 0 else int(reached[0])


def overhead_fraction(trace: Trace, clock: str = "sim") -> float | None:
    """Share of the run's time on ``clock`` spent encoding, decoding and choosing bits."""
    steps = trace.steps
    total = float(steps[CLOCKS[clock]].iloc[-1])
    spent = float((steps["t_encode"] + steps["t_decode"] + steps["t_policy"]).sum())
    return spent / total if total > 0 else None


def compression_ratio(trace: Trace) -> float | None:
    """float32 traffic over actual traffic; None without ``float32_bytes_per_iteration``."""
    per_iteration = trace.attrs.get("float32_bytes_per_iteration")
    sent = int((trace.steps["bytes_up"] + trace.steps["bytes_down"]).sum())
    if not isinstance(per_iteration, (int, float)) or isinstance(per_iteration, bool) or sent <= 0:
        return None
    return float(per_iteration) * len(trace.steps) / sent


def summarize(trace: Trace, label: str | None = None, *, target_loss: float | None = None,
              clock: str = "sim", smooth: int = 1, run: str | None = None) -> dict[str, Any]:
    """One summary row (raw values; None where not available); ``run`` names the file
    (default its stem; ``labels.file_labels`` tells files of one name apart)."""
    if clock not in CLOCKS:
        raise AnalysisError(f"unknown clock {clock!r} (sim, wall)")
    require_steps(trace)
    steps, evals = trace.steps, trace.eval
    loss = smoothed_loss(trace, smooth)
    accuracy = evals["test_accuracy"].to_numpy() if "test_accuracy" in evals else np.empty(0)
    row = {
        "run": run or trace.name, "method": label or trace.label, "status": trace.status,
        "iterations": len(steps), "final_loss": float(loss[-1]),
        "best_loss": float(np.nanmin(loss)) if not np.isnan(loss).all() else None,
        "best_accuracy": float(np.nanmax(accuracy)) * 100 if accuracy.size and not np.isnan(accuracy).all() else None,
        "total_mb": float((steps["bytes_up"] + steps["bytes_down"]).sum()) / 1e6,
        "ratio_fp32": compression_ratio(trace),
        "sim_time": float(steps["sim_time"].iloc[-1]), "wall_time": float(steps["wall_time"].iloc[-1]),
        "overhead": _percent(overhead_fraction(trace, clock)),
    }
    if target_loss is not None:
        row["target_sim"] = time_to_target(trace, target_loss, "sim", smooth)
        row["target_wall"] = time_to_target(trace, target_loss, "wall", smooth)
    return row


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction


def summary_columns(*, target_loss: float | None = None, clock: str = "sim") -> list[Column]:
    columns = [Column("run", "run", left=True), Column("method", "method", left=True),
               Column("status", "status", left=True),
               Column("iterations", "iterations"), Column("final_loss", "final_loss"),
               Column("best_loss", "best_loss"), Column("best_accuracy", "best_acc_%", ".1f"),
               Column("total_mb", "total_MB", ".1f"), Column("ratio_fp32", "ratio_vs_fp32", ".2f"),
               Column("sim_time", "sim_time_s", ".1f"), Column("wall_time", "wall_time_s", ".1f")]
    if target_loss is not None:
        columns += [Column("target_sim", f"sim_s_to_{target_loss:g}", ".1f"),
                    Column("target_wall", f"wall_s_to_{target_loss:g}", ".1f")]
    return columns + [Column("overhead", f"quant_%_{clock}", ".2f")]


#: Characters of a value that ``trace info`` shows whole without ``--full``.
INFO_WIDTH = 100


def duration_text(steps, config) -> str:
    """The run's length: on the simulated clock and the wall clock, or on the wall clock
    alone where it had no network model (``labels.clock_name``)."""
    wall = f"{steps['wall_time'].iloc[-1]:.1f} s wall clock"
    if clock_name(config) == WALL_CLOCK:
        return f"{wall} (no network model: net_mode off)"
    return f"{steps['sim_time'].iloc[-1]:.1f} s simulated, {wall}"


def recipe_line(config: dict[str, Any]) -> str:
    """A run's recipe from its config: ``config.describe_recipe``'s words, the rate and the
    loss's l2 term where the config has them (``sgd(momentum=0.9) crop-flip, lr 0.02, l2 in
    the loss 0.004``)."""
    parts = [describe_recipe(config)]
    if isinstance(config.get("lr"), (int, float)):
        parts.append(f"lr {config['lr']:g}")
    decay = config.get("weight_decay")
    if config.get("weight_decay_in", "loss") == "loss" and isinstance(decay, (int, float)) and decay:
        parts.append(f"l2 in the loss {decay:g}")
    return ", ".join(parts)


def describe(trace: Trace, full: bool = False) -> list[tuple[str, str]]:
    """(key, text) lines for `mpigrad trace info`: every attribute and the config; without
    ``full``, a screenful: the attributes it does not describe itself (a cost model, the MPI
    library's banner...) summarised where longer than INFO_WIDTH or of several lines (saying
    so), and the config as ``key=value`` pairs."""
    attrs, steps = trace.attrs, trace.steps
    status = {"complete": "complete (ended cleanly)", "stopped": "stopped (checkpointed, can be resumed)",
              "failed": "failed",
              "incomplete": "incomplete (its writer died; closed by mpigrad trace repair)",
              "running": "running, or its writer died (rows up to the last flush are readable; "
                         "mpigrad trace repair closes it)"}
    status_text = status.get(trace.status, trace.status)
    if "error" in attrs:
        status_text += f": {attrs['error']}"
    if "last_iteration" in attrs:
        status_text += f" (last complete iteration {attrs['last_iteration']})"
    lines = [("file", str(trace.path)), ("method", trace.label)]
    config = attrs.get("config")
    if isinstance(config, dict):
        lines.append(("recipe", recipe_line(config)))
    lines += [("status", status_text),
             ("schema", f"version {trace.schema_version}, written by mpigrad {attrs.get('mpigrad_version', '?')}"),
             ("started", str(attrs.get("start_time", "?"))), ("ended", str(attrs.get("end_time", "-")))]
    if len(steps):
        lines += [("iterations", f"{len(steps)} (iteration {int(steps['iteration'].iloc[0])} to "
                                 f"{int(steps['iteration'].iloc[-1])})"),
                  ("duration", duration_text(steps, attrs.get("config"))),
                  ("loss", f"first {steps['loss'].iloc[0]:.4g}, last {steps['loss'].iloc[-1]:.4g}")]
    else:
        lines.append(("iterations", "0 (no rows were flushed)"))
    lines.append(("tables", ", ".join(f"{name} {len(frame)} rows" for name, frame in trace.tables.items())))
    for resume in attrs.get("resumes", []):
        lines.append(("resumed", f"at iteration {resume.get('at_iteration')} on {resume.get('time')}"))
    lines.append(("network", network.details(attrs)))
    nodes = nodes_text(trace)
    if nodes:
        lines.append(("nodes", nodes))
    for key in ("argv", "hostnames", "hosts", "ranks", "slurm", "seed"):
        if key in attrs:
            value = attrs[key]
            lines.append((key, " ".join(map(str, value)) if key == "argv" and isinstance(value, list)
                          else _compact(value)))
    versions = attrs.get("versions")
    if isinstance(versions, dict):
        lines.append(("versions", ", ".join(f"{k} {str(v).splitlines()[0] if str(v) else v}"
                                            for k, v in versions.items())))
    shown = {"format", "schema_version", "mpigrad_version", "start_time", "end_time", "complete",
             "status", "error", "last_iteration", "config", "resumes", "network", "argv", "hostnames", "hosts", "ranks", "slurm", "seed", "versions",
             *(("topology",) if nodes else ())}
    others = [(key, _duration(value) if key.endswith("_seconds") else _compact(value))
              for key, value in attrs.items() if key not in shown]
    if full:
        return lines + others + [("config", json.dumps(trace.config, indent=2, sort_keys=True))]
    lines += [(key, _summarised(text, attrs[key])) for key, text in others]
    pairs = [f"{key}={_summarised(_compact(value), value, INFO_WIDTH // 2)}"
             for key, value in sorted(trace.config.items())]
    return lines + [("config", "\n".join(_wrapped(pairs, INFO_WIDTH)))]


def nodes_text(trace: Trace) -> str | None:
    """`trace info`'s ``nodes`` line for a run of nodes of several workers (the config's
    resolved ``ranks_per_node`` > 1; None for one worker per node, as in every trace written
    before the option existed): N nodes of L workers, the exchange and, from the ``topology``
    attribute where the run recorded it, where L came from."""
    config = trace.config if isinstance(trace.config, dict) else {}
    L = trace_ranks_per_node(config)
    if L == 1:
        return None
    topology = trace.attrs.get("topology")
    topology = topology if isinstance(topology, dict) else {}
    workers = topology.get("workers", trace.attrs.get("workers"))
    exchange = config.get("exchange", "auto")
    text = (f"{workers // L} of {L} workers" if isinstance(workers, int) else f"{L} workers each") + (
        f" ({nodes_label(config, workers)}), {exchange} exchange")
    if exchange == "hierarchical":
        text += f", {config.get('intra_codec', 'fp32')} inside each node"
    source = {"declared": "--ranks-per-node", "mpi": "MPI's shared-memory split (auto)"}.get(topology.get("source"))
    return text + (f"; L from {source}" if source else "") + f"; rank 0 on node {topology.get('rank0_node', 0)}"


def _summarised(text: str, value: Any = None, width: int = INFO_WIDTH) -> str:
    """``text`` if it is one line of at most ``width`` characters, else a shorter line that
    says what was left out (``trace info --full`` prints it)."""
    if len(text) <= width and "\n" not in text:
        return text
    if isinstance(value, str) and value.startswith("{"):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    if isinstance(value, dict):
        keys = ", ".join(map(str, value))
        head = "{" + (keys if len(keys) <= width // 2 else keys[:width // 2].rsplit(", ", 1)[0] + ", ...") + "}"
        return f"{head}: {len(value)} key{'s' * (len(value) != 1)}, {len(text)} characters (--full prints them)"
    if "\n" in text:
        first, rest = text.split("\n", 1)
        return f"{_summarised(first, width=width)} (and {rest.count(chr(10)) + 1} more lines: --full)"
    return f"{text[:width // 2]}... ({len(text)} characters: --full)"


def _wrapped(words: list[str], width: int) -> list[str]:
    lines: list[str] = []
    for word in words:
        if lines and len(lines[-1]) + 2 + len(word) <= width:
            lines[-1] += "  " + word
        else:
            lines.append(word)
    return lines


def _duration(value: Any) -> str:
    """A ``*_seconds`` attribute (``trace_seconds``, ``rank0_cpu_seconds``) as a duration a
    reader takes in at a glance (``units.format_duration``: '6.45us', '1.2s'), to 3
    significant digits; a value that is not a number as it is."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return format_duration(float(f"{value:.3g}"))
    return _compact(value)


def _compact(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value.tolist() if hasattr(value, "tolist") else value)
