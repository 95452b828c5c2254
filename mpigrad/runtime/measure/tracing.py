"""The run's HDF5 trace, as rank 0 writes it: tables from trace/schema.py, root attributes, records."""

from __future__ import annotations

import os
import time

from ...units import format_elapsed
from ...trace import TraceWriter, collect_versions, network, schema, slurm_ids
from ..plan.gpu import apply_tf32, workers_device
from .record import TABLE_COLUMNS, IterationRecord, table_block


def close_seconds(rows: int) -> float:
    """Time to keep in hand for closing a trace of ``rows`` iterations (the compact rewrite:
    measured 50-72 ms for 2000 rows and 160-180 ms for 20000; this is about twice that)."""
    return 0.5 + 20e-6 * rows


class RunTrace:
    """Rank 0's view of the trace: one ``record`` per iteration.

    ``record`` only keeps the record; every ``flush_every`` records (and at close) they are
    turned into column blocks and written and flushed together. Writing a row as the
    iteration ends cost 3-4x more than the same work in a loop (the iteration has streamed
    megabytes of gradients through the caches, evicting the writer's objects and buffers),
    and per-row conversion of Python lists was most of the rest. Rows reach the file at the
    same points as before: every ``flush_every`` iterations.
    """

    def __init__(self, writer: TraceWriter):
        self.writer = writer
        self.last: IterationRecord | None = None
        self.rows = 0
        self.seconds = 0.0  # CPU time spent tracing, flushes included
        self._pending: list[IterationRecord] = []

    @classmethod
    def open(cls, config, *, layout, workers: int, servers: int, policy_columns, data_description: str,
             hosts: list[str], argv: list[str], resume_at: int | None, cost_attrs=None,
             settings: bool = False, waits: dict | None = None, shards: dict | None = None,
             buckets: int | None = None) -> "RunTrace":
        """``settings``: the run chooses each low-rank layer's setting (``steps/setting_layers``);
        ``shards``: how the layout was cut and dealt (``ParameterServer.shard_record``);
        ``buckets``: the pipelined iteration's buckets (the ``buckets`` table), None for rounds."""
        from ...optim import rate_moves

        tables = cls.tables(max(len(layout.quantized), 1), workers, servers, policy_columns, settings,
                            ahead=config.control == "ahead", lr=rate_moves(config.lr_schedule, config.lr_warmup),
                            nodes=config.link_model().nodes is not None, buckets=buckets)
        if resume_at is not None:
            return cls(TraceWriter.open_append(config.trace, tables=tables, truncate_at=resume_at,
                                               flush_every=config.trace_flush,
                                               resume={network.ATTR: network.current()}))
        attrs = {
            network.ATTR: network.current(),  # the lab's, or the hosts' own (trace/network.py)
            "argv": " ".join(argv),
            "device": config.device,  # as given (auto stays auto)
            "workers_device": workers_device(config),  # what the workers trained on
            "tf32": apply_tf32(config.tf32),  # what torch used (runtime/plan/gpu.py)
            "waits": waits or {},  # which ranks polled without sleeping (wire/channel.set_waiting)
            "hosts": hosts,
            # The nodes the launch resolved (runtime/plan/topology.py); absent in-process.
            **({"topology": config.topology.record()} if config.topology is not None else {}),
            "ranks": len(hosts),
            "workers": workers,
            "servers": servers,
            "shards": shards or {},
            "seed": config.seed,
            "parameters": layout.total,
            "quantized_parameters": sum(s.size for s in layout.quantized),
            "quantized_layers": [s.name for s in layout.quantized],
            # colocated: each shard's P - 1 remote frames in, P - 1 copies out (ring all-reduce's)
            "float32_bytes_per_iteration": 2 * (workers - 1 if config.colocated else workers) * 4 * layout.total,
            "dataset": data_description,
            **collect_versions(),
            **slurm_ids(os.environ),
            # The local-work charge (ParameterServer.cost_attrs): the cost model, what it charges.
            **(cost_attrs or {"cost_model": None, "local_work": None}),
        }
        return cls(TraceWriter(config.trace, config=config.to_dict(), attrs=attrs, tables=tables,
                               force=config.force, flush_every=config.trace_flush))

    @staticmethod
    def tables(layers: int, workers: int, servers: int, policy_columns, settings: bool = False,
               ahead: bool = False, lr: bool = False, nodes: bool = False,
               buckets: int | None = None) -> dict[str, dict]:
        """The trace's tables for a run of ``workers`` workers and ``servers`` servers
        (``settings``: with ``steps/setting_layers``, PowerSGD's per-layer settings;
        ``ahead``: with ``steps/control_ahead``, whether each iteration's Control went ahead of
        its losses, ``control = "ahead"``; ``lr``: with ``steps/lr``, each iteration's rate,
        where a schedule or warm-up moves it; ``nodes``: with ``steps/bytes_nic``, ``bytes_intra``,
        ``t_nic`` and ``t_intra``, a run on nodes of several workers; ``buckets``: with the
        ``buckets`` table of a pipelined run's that many buckets)."""
        extra = schema.layer_step_columns(layers, settings)
        if nodes:
            extra.update(schema.node_step_columns())
        if ahead:
            extra["control_ahead"] = ("i1", ())
        if lr:
            extra["lr"] = ("f8", ())
        return {
            "steps": schema.step_columns(extra),
            "workers": schema.workers_columns(workers),
            "servers": schema.servers_columns(servers, workers),
            "eval": dict(schema.EVAL_COLUMNS),
            "policy": policy_columns,
            "checksums": schema.checksum_columns(workers + 1),
            **({"buckets": schema.bucket_columns(workers, buckets)} if buckets else {}),
        }

    def record(self, record: IterationRecord) -> None:
        """Keep ``record``; every ``flush_every`` records write and flush them (timed: keeping
        a record is a list append, cheaper than reading the CPU clock twice)."""
        self._pending.append(record)
        self.last = record
        self.rows += 1
        if len(self._pending) >= self.writer.flush_every:
            start = time.process_time()  # CPU time: oversubscribed ranks must not inflate it
            self._write_pending()
            self.seconds += time.process_time() - start

    def _write_pending(self) -> None:
        records, self._pending = self._pending, []
        if not records:
            return
        for table in TABLE_COLUMNS:
            if table != "buckets" or records[0].buckets is not None:
                self.writer.extend(table, table_block(table, records))
        checksums = [r for r in records if r.checksums is not None]
        if checksums:
            self.writer.extend("checksums", {"iteration": [r.iteration for r in checksums],
                                             "checksum": [r.checksums for r in checksums]})
        policy_rows = [row for r in records for row in r.policy_rows]
        if policy_rows and all(row.keys() == policy_rows[0].keys() for row in policy_rows):
            self.writer.extend("policy", {name: [row[name] for row in policy_rows] for name in policy_rows[0]})
        else:  # row by row, so that a malformed row gets the writer's message
            for row in policy_rows:
                self.writer.append("policy", row)
        self.writer.flush()

    def eval(self, row: dict) -> None:
        start = time.process_time()
        self._write_pending()  # the tables' rows stay in iteration order
        self.writer.append("eval", row)
        self.seconds += time.process_time() - start

    def flush(self) -> None:
        """Put every kept record and buffered row on disk (before a checkpoint, so that no
        resume misses a row)."""
        start = time.process_time()
        self._write_pending()
        self.writer.flush()
        self.seconds += time.process_time() - start

    def fail(self, error: str, last_iteration: int) -> None:
        """Close as "failed", recording the error and the last iteration that completed."""
        self.writer.set_attr("error", error)
        self.writer.set_attr("last_iteration", int(last_iteration))
        self.close("failed")

    def add_seconds(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to the root attribute ``name`` (summed over a run's sessions)."""
        self.writer.set_attr(name, float(seconds) + float(self.writer.attrs_get(name, 0.0)))

    def close(self, status: str) -> None:
        start = time.process_time()
        self._write_pending()
        self.seconds += time.process_time() - start
        self.add_seconds("trace_seconds", self.seconds)
        self.writer.close(status=status)

    def final_summary(self) -> str:
        loss = self.last.loss if self.last else float("nan")
        sim = self.last.sim_time if self.last else 0.0
        return (f"mpigrad: done: {self.rows} iterations this session, final loss {loss:.4f}, "
                f"simulated time {format_elapsed(sim)}; trace {self.writer.path}")
