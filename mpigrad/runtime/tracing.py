"""The run's HDF5 trace, as rank 0 writes it: table layouts, root attributes, rows."""

from __future__ import annotations

import os
import time

from ..trace import TraceWriter, collect_versions, schema, slurm_ids


class RunTrace:
    """Rank 0's view of the trace: one call per iteration, buffered by the writer."""

    def __init__(self, writer: TraceWriter, workers: int):
        self.writer = writer
        self.workers = workers
        self.last_step: dict | None = None
        self.rows = 0
        self.seconds = 0.0  # CPU time spent tracing, flushes included



    @classmethod
    def open(cls, config, server, hosts: list[str], argv: list[str], resume_at: int | None) -> "RunTrace":
        workers = server.workers
        layout = server.replica.layout
        n_layers = max(len(layout.quantized), 1)
        tables = {
            "steps": {**schema.STEPS_COLUMNS, "bits_layers": ("i4", (n_layers,))},
            "workers": schema.workers_columns(workers),
            "eval": schema.EVAL_COLUMNS,
            "policy": server.policy.record_columns(),
            "checksums": schema.checksum_columns(workers + 1),
        }
        if resume_at is not None:
            writer = TraceWriter.open_append(config.trace, tables=tables, truncate_at=resume_at,
                                             flush_every=config.trace_flush)
            return cls(writer, workers)
        float32_bytes = 2 * workers * 4 * layout.total
        attrs = {
            "argv": " ".join(argv),
            "hosts": hosts,
            "ranks": len(hosts),
            "workers": workers,
            "seed": config.seed,
            "parameters": layout.total,
            "quantized_parameters": sum(s.size for s in layout.quantized),
            "quantized_layers": [s.name for s in layout.quantized],
            "float32_bytes_per_iteration": float32_bytes,
            "dataset": server.data_description,
            **collect_versions(),
            **slurm_ids(os.environ),
        }
        writer = TraceWriter(config.trace, config=config.to_dict(), attrs=attrs, tables=tables,
                             force=config.force, flush_every=config.trace_flush)
        return cls(writer, workers)

    def step(self, row: dict, workers: dict, checksums: list[int] | None, policy_rows: list[dict]) -> None:
        start = time.process_time()  # CPU time: oversubscribed ranks must not inflate it
        self.writer.append("steps", row)
        self.writer.append("workers", workers)
        if checksums is not None:
            self.writer.append("checksums", {"iteration": row["iteration"], "checksum": checksums})
        for policy_row in policy_rows:
            self.writer.append("policy", policy_row)
        self.last_step = row
        self.rows += 1
        self.seconds += time.process_time() - start

    def eval(self, row: dict) -> None:
        self.writer.append("eval", row)

    def flush(self) -> None:
        """Put every buffered row on disk (before a checkpoint, so no resume misses a row)."""
        self.writer.flush()

    def fail(self, error: str, last_iteration: int) -> None:
        """Close as "failed", recording the error and the last iteration that completed."""
        self.writer.set_attr("error", error)
        self.writer.set_attr("last_iteration", int(last_iteration))
        self.close("failed")

    def close(self, status: str) -> None:
        self.writer.set_attr("trace_seconds", self.seconds + float(self.writer.attrs_get("trace_seconds", 0.0)))
        self.writer.close(status=status)

    def final_summary(self) -> str:
        row = self.last_step or {}
        return (f"mpigrad: done: {self.rows} iterations this session, final loss "
                f"{row.get('loss', float('nan')):.4f}, simulated time {row.get('sim_time', 0.0):.1f} s; "
                f"trace {self.writer.path}")
