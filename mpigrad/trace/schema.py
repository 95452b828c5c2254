"""The trace file layout: schema version, standard tables and column validation.

A trace is one HDF5 file. Root attributes hold the run's metadata; each table is a group
whose columns are resizable, chunked datasets of shape ``(rows, *per_row_shape)``
(compressed once the writer closes the file; see trace/writer.py).
A table is described by a dict ``{column name: (numpy dtype string, per-row shape)}``;
every table has an integer ``iteration`` column (used to truncate rows on resume).

Units: times are seconds (float64); ``wall_time`` and ``sim_time`` are cumulative since
the run started (at the end of the row's iteration); ``t_*`` are per-iteration durations.
"""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from .. import options

__all__ = [
    "SCHEMA_VERSION", "FORMAT_NAME", "TraceError", "Columns", "STEPS_COLUMNS", "EVAL_COLUMNS",
    "TABLE_NAMES", "step_columns", "layer_step_columns", "node_step_columns", "NODE_COLUMNS", "workers_columns", "servers_columns", "bucket_columns", "checksum_columns", "default_tables",
    "validate_tables", "column_spec", "flat_names",
]

#: Bumped whenever a reader of the previous version would misread a new file.
SCHEMA_VERSION = 1
#: Value of the root attribute ``format`` that marks an HDF5 file as an mpigrad trace.
FORMAT_NAME = "mpigrad-trace"
#: Name of the scalar dataset in every table group that counts its committed rows.
ROWS_DATASET = "_rows"

Columns = Mapping[str, "tuple[str, tuple[int, ...]]"]


class TraceError(ValueError):
    """A trace that cannot be written or read as asked; the message says why, in one line."""


STEPS_COLUMNS: dict[str, tuple[str, tuple[int, ...]]] = {
    "iteration": ("i8", ()),
    "wall_time": ("f8", ()),    # s since start, measured
    "sim_time": ("f8", ()),     # s since start, with the modelled network
    "loss": ("f8", ()),         # global training loss (mean of the workers' losses)
    "bits": ("i4", ()),         # bits the gradients were quantized with
    "bytes_up": ("i8", ()),     # worker -> server bytes, all workers together
    "bytes_down": ("i8", ()),   # server -> worker bytes, all workers together
    "t_compute": ("f8", ()),
    "t_encode": ("f8", ()),
    "t_decode": ("f8", ()),
    "t_comm": ("f8", ()),       # modelled communication time
    "t_policy": ("f8", ()),     # time the bit policy took to decide
}

EVAL_COLUMNS: dict[str, tuple[str, tuple[int, ...]]] = {
    "iteration": ("i8", ()),
    "wall_time": ("f8", ()),
    "sim_time": ("f8", ()),
    "test_loss": ("f8", ()),
    "test_accuracy": ("f8", ()),  # fraction in [0, 1]
}

#: Tables that ``mpigrad.trace.load`` exposes as attributes of a Trace.
TABLE_NAMES = ("steps", "workers", "servers", "eval", "policy", "checksums")

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_DTYPE_KINDS = "biuf"


def step_columns(extra: Columns | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """STEPS_COLUMNS plus ``extra`` columns (e.g. per-layer bits); a name clash is an error."""
    columns = dict(STEPS_COLUMNS)
    for name, spec in (extra or {}).items():
        if name in columns:
            raise TraceError(f"extra steps column {name!r} clashes with a standard column")
        columns[name] = spec
    return columns


def layer_step_columns(layers: int, settings: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The run's per-layer steps columns (index i: quantized layer i): the bits each layer
    was quantized with and ``norm_ratio``, ||Q(g)|| / ||g|| of the broadcast update (g the
    workers' average, Q(g) the decoded broadcast; NaN where g = 0, and on the iterations
    ``--norm-every`` skips). ``settings`` (PowerSGD
    with ``ranks``/``widths``; traces before it have no such column): ``setting_layers``,
    each low-rank layer's setting code (r > 0 rank r, -b the whole layer at b bits;
    ``mpigrad.codecs.powersgd.setting_of``); ``bits_layers`` then holds the width its
    numbers travelled at (the factors' for a rank, b for a width)."""
    _check_count("layers", layers)
    columns = {"bits_layers": ("i4", (layers,)), "norm_ratio": ("f8", (layers,))}
    if settings:
        columns["setting_layers"] = ("i4", (layers,))
    return columns


def node_step_columns() -> dict[str, tuple[str, tuple[int, ...]]]:
    """The steps columns of a run on nodes of several workers (``--ranks-per-node L > 1``):
    the bytes that crossed NICs (each message once, every node together), the bytes that
    stayed inside nodes (the hierarchical exchange's slices, and the flat exchange's frames
    between workers of one node), and the seconds of the slowest NIC side and of the slowest
    intra-node link side, each summed over the gradient rounds (each round charges the larger
    of its two; with ``--net-mode off`` they are still the model's, while ``t_comm`` is
    measured). A pipelined run's are its overlapped schedule's
    (``LinkModel.pipelined_hierarchical_round``): its messages' bytes, and the seconds during
    which some NIC side (some intra-node link side) carried one, backward's overlap included."""
    return dict(zip(NODE_COLUMNS, (("i8", ()), ("i8", ()), ("f8", ()), ("f8", ()))))


#: The names of ``node_step_columns``, in order.
NODE_COLUMNS = ("bytes_nic", "bytes_intra", "t_nic", "t_intra")


def workers_columns(workers: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Per-iteration, per-worker values; index k of each vector is worker k (MPI rank S + k)."""
    _check_count("workers", workers)
    return {"iteration": ("i8", ()), "loss": ("f8", (workers,)),
            "t_compute": ("f8", (workers,)), "bytes_sent": ("i8", (workers,))}


def servers_columns(servers: int, workers: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Per-iteration, per-server values; index s is server rank s (rank 0 serves shard 0).
    ``bytes_in``: the workers' frames the server received; ``bytes_out``: one copy of its
    broadcast (length message included); ``frame_bytes[s, k]``: worker k's frame to server s
    (the messages the clock charges one by one); ``t_decode``/``t_encode``: its CPU seconds."""
    _check_count("servers", servers)
    _check_count("workers", workers)
    return {"iteration": ("i8", ()), "bytes_in": ("i8", (servers,)), "bytes_out": ("i8", (servers,)),
            "frame_bytes": ("i8", (servers, workers)), "t_decode": ("f8", (servers,)),
            "t_encode": ("f8", (servers,))}


def bucket_columns(workers: int, buckets: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A pipelined run's iteration bucket by bucket (``clockmodel.PipelinedTraffic``), what
    ``trace retime`` re-charges it from: ``ready[w, b]``, seconds after backward began that
    worker w had bucket b (on the clock the run charged: CPU or wall); ``frames[b, w]``,
    worker w's frame of bucket b to the bucket's shard ``shard[b]`` (0 for its own);
    ``bcast[b]``, one copy of its average; ``intra[b]``, the hierarchical exchange's message
    of it inside a node (0 for the flat); ``t_forward`` and ``t_backward``, the slowest
    worker's; the loss report's and the Control's bytes."""
    _check_count("workers", workers)
    _check_count("buckets", buckets)
    return {"iteration": ("i8", ()), "t_forward": ("f8", ()), "t_backward": ("f8", ()),
            "loss_bytes": ("i8", ()), "control_bytes": ("i8", ()), "ready": ("f8", (workers, buckets)),
            "frames": ("i8", (buckets, workers)), "bcast": ("i8", (buckets,)), "shard": ("i4", (buckets,)),
            "intra": ("i8", (buckets,))}


def checksum_columns(ranks: int, dtype: str = "u8") -> dict[str, tuple[str, tuple[int, ...]]]:
    """Parameter checksums, one per rank (index r is MPI rank r), every N iterations."""
    _check_count("ranks", ranks)
    return {"iteration": ("i8", ()), "checksum": (dtype, (ranks,))}


def default_tables(workers: int, policy_columns: Columns | None = None,
                   checksum_ranks: int | None = None) -> dict[str, dict]:
    """The standard table set: steps, workers, eval, plus policy and checksums when given."""
    tables: dict[str, dict] = {"steps": dict(STEPS_COLUMNS), "workers": workers_columns(workers),
                               "eval": dict(EVAL_COLUMNS)}
    if policy_columns is not None:
        tables["policy"] = dict(policy_columns)
    if checksum_ranks is not None:
        tables["checksums"] = checksum_columns(checksum_ranks)
    return tables


def _check_count(what: str, value: int) -> None:
    options.check_int(what, value, 1, error=TraceError)


def validate_tables(tables: Mapping[str, Columns]) -> dict[str, dict[str, tuple[np.dtype, tuple[int, ...]]]]:
    """Check a table set and return it normalised to ``{table: {column: (dtype, shape)}}``."""
    if not isinstance(tables, Mapping) or not tables:
        raise TraceError("tables must be a non-empty dict {table: {column: (dtype, shape)}}")
    result = {}
    for table, columns in tables.items():
        if not isinstance(table, str) or not _NAME.match(table):
            raise TraceError(f"bad table name {table!r} (letters, digits and _, starting with a letter)")
        if not isinstance(columns, Mapping) or not columns:
            raise TraceError(f"table {table!r} must map column names to (dtype, shape)")
        specs = {}
        for name, spec in columns.items():
            specs[name] = column_spec(table, name, spec)
        if "iteration" not in specs or specs["iteration"][0].kind not in "iu" or specs["iteration"][1]:
            raise TraceError(f"table {table!r} needs a scalar integer 'iteration' column")
        flat = flat_names(specs)
        if len(set(flat)) != len(flat):
            raise TraceError(f"table {table!r}: column names clash once vectors are flattened "
                             f"(a vector 'x' becomes x_0, x_1, ...)")
        result[table] = specs
    return result


def column_spec(table: str, name: object, spec: object) -> tuple[np.dtype, tuple[int, ...]]:
    """Validate one column's ``(dtype string, shape)``; return ``(numpy dtype, shape tuple)``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise TraceError(f"table {table!r}: bad column name {name!r}")
    try:
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[1], (tuple, list))):
            raise TypeError
        dtype = np.dtype(spec[0])
        shape = tuple(int(n) for n in spec[1])
    except (TypeError, ValueError):
        raise TraceError(f"column {table}/{name}: spec must be (numpy dtype string, shape tuple), "
                         f"got {spec!r}") from None
    if dtype.kind not in _DTYPE_KINDS:
        raise TraceError(f"column {table}/{name}: dtype {dtype} is not bool, integer or float")
    if any(n < 1 for n in shape):
        raise TraceError(f"column {table}/{name}: shape {shape} has a dimension below 1")
    return dtype.newbyteorder("="), shape


def flat_names(specs: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> list[str]:
    """DataFrame column names: a scalar keeps its name; a vector ``x`` of shape (k,) becomes
    ``x_0 .. x_{k-1}``; a matrix of shape (k, l) becomes ``x_0_0 .. x_{k-1}_{l-1}``."""
    names = []
    for name, (_, shape) in specs.items():
        if not shape:
            names.append(name)
        else:
            names.extend(f"{name}_" + "_".join(map(str, index)) for index in np.ndindex(*shape))
    return names
