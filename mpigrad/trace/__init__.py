"""HDF5 run traces: one file per run, written by rank 0, read by ``mpigrad trace``.

    w = TraceWriter("run.h5", config=config, attrs={"argv": sys.argv, "versions": collect_versions()},
                    tables=default_tables(workers=4), flush_every=100)
    w.append("steps", {"iteration": 0, "wall_time": 0.1, ...})
    w.close("complete")
    tr = load("run.h5")          # tr.config, tr.attrs, tr.steps (DataFrame), tr.label, tr.status

Never imports mpi4py, torch or numba; reading needs pandas (``mpigrad[analysis]``).
The layout is documented in docs/trace.rst.
"""

from .attrs import collect_versions, slurm_ids
from .reader import Trace, load, method_label, read_raw, root_attrs, writer_mark
from .schema import (EVAL_COLUMNS, SCHEMA_VERSION, STEPS_COLUMNS, TABLE_NAMES, TraceError,
                     checksum_columns, default_tables, step_columns, workers_columns)
from .writer import STATUSES, TraceWriter, repair

__all__ = [
    "TraceWriter", "Trace", "TraceError", "load", "read_raw", "method_label", "SCHEMA_VERSION",
    "STEPS_COLUMNS", "EVAL_COLUMNS", "TABLE_NAMES", "STATUSES", "step_columns",
    "workers_columns", "checksum_columns", "default_tables", "collect_versions", "slurm_ids",
    "repair", "writer_mark", "root_attrs",
]
