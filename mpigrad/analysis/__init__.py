"""Trace analysis: summaries, paper-style tables and plots (`mpigrad trace ...`).

Reads HDF5 trace files only; never imports mpi4py. matplotlib is imported only by
``plots.plot_traces``. Install with ``pip install 'mpigrad[analysis]'``.
"""

from .labels import group_labels, run_labels
from .summary import (compression_ratio, describe, overhead_fraction, summarize, summary_columns,
                      time_to_target)
from .tables import AnalysisError, accuracy_table, export_csv, parse_points, render, value_at

__all__ = ["AnalysisError", "summarize", "summary_columns", "describe", "time_to_target",
           "overhead_fraction", "compression_ratio", "run_labels", "group_labels", "accuracy_table",
           "parse_points", "value_at", "render", "export_csv", "plot_traces"]


def plot_traces(*args, **kwargs):
    """See ``mpigrad.analysis.plots.plot_traces`` (imports matplotlib on first use)."""
    from .plots import plot_traces as plot

    return plot(*args, **kwargs)
