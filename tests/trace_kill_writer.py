"""A real process writing a trace through TraceWriter, for the SIGKILL tests in test_trace.py.

    python tests/trace_kill_writer.py PATH MODE FLUSH_EVERY

MODE "append": append rows forever, flushing every FLUSH_EVERY iterations.
MODE "resume": the same, but every 3 flushes close the trace as "stopped" and reopen it
with ``open_append`` one block before the end, as a requeued job does after a checkpoint.

Prints "ready" once the file exists, then one line per completed event, after the event:
"flushed N", "closed N", "resumed N" (N = rows in the file). Row values depend only on the
iteration (see ``steps_row`` and friends), so a test can check every row it reads back.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from mpigrad.trace import TraceWriter, default_tables

WORKERS = 3
EVAL_EVERY = 7


def tables() -> dict:
    return default_tables(WORKERS)


def steps_row(i: int) -> dict:
    return {"iteration": i, "wall_time": 0.5 * (i + 1), "sim_time": 2.0 * (i + 1), "loss": 1.0 / (i + 1),
            "bits": 2 + i % 7, "bytes_up": 1000 * i, "bytes_down": 7 * i, "t_compute": 0.1,
            "t_encode": 1e-3 * (i % 5), "t_decode": 2e-3, "t_comm": 0.25, "t_policy": 1e-5 * i}


def workers_row(i: int) -> dict:
    return {"iteration": i, "loss": i + 0.25 * np.arange(WORKERS), "t_compute": np.full(WORKERS, 0.1 * i),
            "bytes_sent": i * 10 + np.arange(WORKERS)}


def eval_row(i: int) -> dict:
    return {"iteration": i, "wall_time": 0.5 * (i + 1), "sim_time": 2.0 * (i + 1),
            "test_loss": 2.0 / (i + 1), "test_accuracy": i / (i + 100)}


def append_iteration(writer: TraceWriter, i: int) -> None:
    writer.append("steps", steps_row(i))
    writer.append("workers", workers_row(i))
    if i % EVAL_EVERY == 0:
        writer.append("eval", eval_row(i))


def main(path: str, mode: str, flush_every: int) -> None:
    writer = TraceWriter(path, config={"policy": {"id": "fixed", "bits": 2}}, tables=tables(),
                         flush_every=flush_every)
    print("ready", flush=True)
    i = 0
    while True:
        append_iteration(writer, i)
        i += 1
        if i % flush_every == 0:
            writer.flush()
            print(f"flushed {i}", flush=True)
            if mode == "resume" and i % (3 * flush_every) == 0:
                writer.close("stopped")
                print(f"closed {i}", flush=True)
                i -= flush_every
                writer = TraceWriter.open_append(path, tables=tables(), truncate_at=i,
                                                 flush_every=flush_every)
                print(f"resumed {i}", flush=True)
        time.sleep(1e-4)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
