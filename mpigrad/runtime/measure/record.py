"""IterationRecord: what one iteration did, as ``ParameterServer.step`` returns it.

Tracing (:mod:`.tracing`) and the progress line consume records; neither reads the
server's internals. Times are seconds; ``t_*`` are per-iteration durations on the clock
the run charges (CPU time of one-thread ranks, see :mod:`.clock`), ``wall_time`` and
``sim_time`` are cumulative.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

from ...trace.schema import NODE_COLUMNS, bucket_columns


@dataclass
class IterationRecord:
    iteration: int
    loss: float                     # mean of the workers' losses
    bits: list[int]                 # bits per quantized layer, as the codec used them
    bytes_up: int                   # worker -> server bytes, every worker and server together
    bytes_down: int                 # server -> rank bytes, every broadcast copy together
    t_compute: float                # slowest worker's forward + backward
    t_encode: float                 # slowest worker's encode + slowest server's re-encode
    t_decode: float                 # slowest server's decode (rank 0's includes the broadcasts)
    t_policy: float                 # rank 0's bit decision
    t_comm: float                   # modelled (or, with --net-mode off, measured) communication
    wall_time: float
    sim_time: float
    worker_losses: list[float]
    worker_compute: list[float]
    worker_bytes: list[int]         # each worker's frames, all servers together
    server_bytes_in: list[int]      # per server: the frames it received
    server_bytes_out: list[int]     # per server: its broadcast frame (one copy, length included)
    server_frame_bytes: list[list[int]]  # per server, each worker's frame to it (what the clock charges)
    server_t_decode: list[float]
    server_t_encode: list[float]
    norm_ratio: list[float]         # ||Q(g)|| / ||g|| per quantized layer (g the workers' average)
    checksums: list[int] | None = None          # every rank's parameter CRC, on checksum iterations
    policy_rows: list[dict] = field(default_factory=list)
    settings: list[int] | None = None           # PowerSGD with menus: each layer's setting code
    control_ahead: bool | None = None           # control = "ahead": whether this Control went before the losses
    lr: float | None = None                     # the iteration's learning rate, where a schedule or warm-up moves it
    #: Nodes of several workers: (bytes across NICs, bytes inside nodes, the NICs' seconds,
    #: the intra-node links' seconds) of the gradient rounds (``LinkModel.node_breakdown``; a
    #: pipelined run's: its overlapped schedule's, ``LinkModel.pipelined_hierarchical_round``).
    nodes: tuple[int, int, float, float] | None = None
    #: The pipelined iteration bucket by bucket: the ``buckets`` table's row but its
    #: iteration (``Rank0Side.bucket_row``); None for rounds.
    buckets: dict | None = None


_get = operator.attrgetter
#: Each trace table's columns, as the function of a record that gives the column's value.
TABLE_COLUMNS: dict[str, dict[str, Callable[[IterationRecord], object]]] = {
    "steps": {"iteration": _get("iteration"), "wall_time": _get("wall_time"), "sim_time": _get("sim_time"),
              "loss": _get("loss"), "bits": lambda r: r.bits[0], "bits_layers": _get("bits"),
              "norm_ratio": _get("norm_ratio"), "bytes_up": _get("bytes_up"), "bytes_down": _get("bytes_down"),
              "t_compute": _get("t_compute"), "t_encode": _get("t_encode"), "t_decode": _get("t_decode"),
              "t_comm": _get("t_comm"), "t_policy": _get("t_policy"), "setting_layers": _get("settings"),
              "control_ahead": lambda r: int(r.control_ahead), "lr": _get("lr"),
              "bytes_nic": lambda r: r.nodes[0], "bytes_intra": lambda r: r.nodes[1],
              "t_nic": lambda r: r.nodes[2], "t_intra": lambda r: r.nodes[3]},
    "workers": {"iteration": _get("iteration"), "loss": _get("worker_losses"),
                "t_compute": _get("worker_compute"), "bytes_sent": _get("worker_bytes")},
    "servers": {"iteration": _get("iteration"), "bytes_in": _get("server_bytes_in"),
                "bytes_out": _get("server_bytes_out"),
                "frame_bytes": _get("server_frame_bytes"), "t_decode": _get("server_t_decode"),
                "t_encode": _get("server_t_encode")},
    "buckets": {"iteration": _get("iteration"),
                **{name: (lambda r, name=name: r.buckets[name]) for name in bucket_columns(1, 1) if name != "iteration"}},
}


def table_block(table: str, records: list[IterationRecord]) -> dict[str, list]:
    """The rows of ``records`` for one table, column by column (no dict per row: a trace
    flush gathers 100 records, and per-row dicts were most of its Python time). ``setting_layers``
    and ``control_ahead`` only for records that carry them (a run's records all do, or none)."""
    absent = {"setting_layers": records[0].settings is None, "control_ahead": records[0].control_ahead is None,
              "lr": records[0].lr is None, **dict.fromkeys(NODE_COLUMNS, records[0].nodes is None)}
    return {column: [value(r) for r in records] for column, value in TABLE_COLUMNS[table].items()
            if not absent.get(column, False)}
