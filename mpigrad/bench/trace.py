"""``mpigrad bench trace``: rank 0's trace cost per iteration, without MPI or training.

Feeds a ``RunTrace`` synthetic iteration records shaped like a run's (``--workers``
workers, one server, two quantized layers, MQGrad's policy rows every T = 5 iterations,
checksums every 50) and reports, per ``--flush`` interval, the process CPU time
per iteration that ``RunTrace`` counts in ``trace_seconds`` (its flushes: gathering the kept
records' columns and writing them; median of ``--repeat`` runs), the CPU time of ``close``
(the compact rewrite, not in ``trace_seconds``), the closed file's size, and the ratio of
each interval's per-iteration cost to the first interval's, measured in the same run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from ..errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=int, default=2000, help="records per run (default 2000)")
    parser.add_argument("--flush", default="100,20", help="comma-separated --trace-flush values (default 100,20)")
    parser.add_argument("--workers", type=int, default=3, help="workers in the traced run (default 3)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per flush value; the median is shown (default 5)")


def run(args: argparse.Namespace) -> int:
    from ..options import check_int

    check_int("--iterations", args.iterations, 1, error=UsageError)
    check_int("--workers", args.workers, 1, error=UsageError)
    check_int("--repeat", args.repeat, 1, error=UsageError)
    try:
        flushes = [int(v) for v in args.flush.split(",")]
    except ValueError:
        raise UsageError(f"--flush must be comma-separated integers, got {args.flush!r}") from None
    for value in flushes:
        check_int("--flush", value, 1, error=UsageError)
    from ..policies import get_policy

    policy_columns = get_policy({"id": "mqgrad"}, n_layers=2).record_columns()
    records = _records(args.iterations, args.workers, policy_columns)
    print(f"trace cost: {args.iterations} iterations, {args.workers} workers, 1 server, 2 layers, "
          f"MQGrad policy rows; process CPU time, median of {args.repeat}")
    print(f"{'flush':>6} {'us/iteration':>13} {'x first':>8} {'close ms':>9} {'file kB':>8}")
    first = None
    with tempfile.TemporaryDirectory(prefix="mpigrad-bench-trace-") as tmp:
        for flush in flushes:
            runs = [_one_run(Path(tmp) / f"f{flush}-{k}.h5", records, args.workers, policy_columns, flush)
                    for k in range(args.repeat)]
            per_iteration, close, size = (float(np.median(values)) for values in zip(*runs))
            first = first or per_iteration
            print(f"{flush:>6} {per_iteration:>13.1f} {per_iteration / first:>8.2f} {close:>9.1f} {size / 1e3:>8.1f}")
    return 0


def _one_run(path: Path, records: list, workers: int, policy_columns: dict, flush: int) -> tuple[float, float, int]:
    from ..runtime.measure.tracing import RunTrace
    from ..trace import TraceWriter

    tables = RunTrace.tables(2, workers, 1, policy_columns)
    trace = RunTrace(TraceWriter(path, config={}, tables=tables, flush_every=flush))
    for record in records:
        trace.record(record)
    start = time.process_time()
    trace.close("complete")
    close = time.process_time() - start
    return 1e6 * trace.seconds / len(records), 1e3 * close, path.stat().st_size


def _records(iterations: int, workers: int, columns: dict) -> list:
    """Records with a real run's shapes and varied values (``columns``: the policy table's),
    built before any timing."""
    from ..runtime.measure.record import IterationRecord

    rng = np.random.default_rng(0)
    records = []
    for m in range(iterations):
        losses = (2.0 + rng.random(workers)).tolist()
        policy_rows = []
        if m % 5 == 4:
            row = {name: np.zeros(shape, dtype) + rng.random() if shape else np.dtype(dtype).type(rng.random() > 0.5)
                   for name, (dtype, shape) in columns.items()}
            row.update(t=m // 5, iteration=m, layer=0)
            policy_rows.append(row)
        records.append(IterationRecord(
            iteration=m, loss=float(np.mean(losses)), bits=[2, 2], bytes_up=int(rng.integers(1e6, 2e6)),
            bytes_down=int(rng.integers(1e6, 2e6)), t_compute=rng.random(), t_encode=rng.random(),
            t_decode=rng.random(), t_policy=rng.random(), t_comm=rng.random(), wall_time=0.1 * m,
            sim_time=0.2 * m, worker_losses=losses, worker_compute=rng.random(workers).tolist(),
            worker_bytes=rng.integers(1e5, 1e6, workers).tolist(), server_bytes_in=[int(rng.integers(1e6, 2e6))],
            server_bytes_out=[int(rng.integers(1e5, 1e6))],
            server_frame_bytes=[rng.integers(1e5, 1e6, workers).tolist()], server_t_decode=[rng.random()],
            server_t_encode=[rng.random()], norm_ratio=rng.random(2).tolist(),
            checksums=rng.integers(0, 2**62, workers + 1).tolist() if m % 50 == 0 else None,
            policy_rows=policy_rows))
    return records
