"""HDF5 traces: writer, reader, resume, crash safety (real processes killed with SIGKILL)."""

from __future__ import annotations

import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import trace_kill_writer as kill_writer
from mpigrad.trace import (EVAL_COLUMNS, SCHEMA_VERSION, STEPS_COLUMNS, TraceError, TraceWriter,
                           checksum_columns, default_tables, load, method_label, slurm_ids,
                           step_columns, workers_columns)

KILL_SCRIPT = Path(__file__).with_name("trace_kill_writer.py")
P = 3
POLICY_COLUMNS = {"iteration": ("i8", ()), "t": ("i8", ()), "action": ("i1", ()),
                  "exploratory": ("?", ()), "q_values": ("f4", (7,)), "smoothed": ("f8", (2, 3))}
CONFIG = {"codec": {"id": "uniform", "bits": 4}, "policy": {"id": "mqgrad", "T": 5},
          "workers": P, "iterations": 25, "lr": 0.2, "network": {"bandwidth": 1e7, "latency": 1e-4},
          "seed": 7, "data": "digits"}


def all_tables() -> dict:
    return {"steps": step_columns({"bits_layers": ("i4", (2,))}), "workers": workers_columns(P),
            "eval": dict(EVAL_COLUMNS), "policy": POLICY_COLUMNS, "checksums": checksum_columns(P + 1)}


def rows_for(i: int) -> dict[str, dict]:
    """One row of every table for iteration i; values differ per row and per column."""
    steps = {name: (i + k / 7 if dtype == "f8" else i * 3 + k) for k, (name, (dtype, _)) in
             enumerate(STEPS_COLUMNS.items())}
    steps["iteration"] = i
    steps["bits_layers"] = np.array([2 + i % 7, 8 - i % 7])
    return {
        "steps": steps,
        "workers": {"iteration": i, "loss": np.arange(P) + i / 3, "t_compute": np.full(P, 0.01 * i),
                    "bytes_sent": 1000 * i + np.arange(P)},
        "eval": {"iteration": i, "wall_time": i * 0.5, "sim_time": i * 2.0, "test_loss": 1 / (i + 1),
                 "test_accuracy": i / 100},
        "policy": {"iteration": i, "t": i // 5, "action": i % 2, "exploratory": i % 3 == 0,
                   "q_values": np.linspace(0, 1, 7, dtype=np.float32) * i,
                   "smoothed": np.arange(6.0).reshape(2, 3) + i},
        "checksums": {"iteration": i, "checksum": np.array([2**63 + i, 1, 2, 3 + i], dtype=np.uint64)},
    }


def write_rows(writer: TraceWriter, iterations) -> None:
    for i in iterations:
        for table, row in rows_for(i).items():
            writer.append(table, row)


def expected_column(table: str, column: str, iterations) -> np.ndarray:
    dtype, shape = all_tables()[table][column]
    return np.array([rows_for(i)[table][column] for i in iterations], dtype=dtype).reshape(-1, *shape)


def assert_rows(trace, iterations) -> None:
    iterations = list(iterations)
    for table, columns in all_tables().items():
        for column, (dtype, shape) in columns.items():
            stored = trace.array(table, column)
            assert stored.dtype == np.dtype(dtype), (table, column)
            np.testing.assert_array_equal(stored, expected_column(table, column, iterations))


ATTRS = {"argv": ["mpigrad", "train", "--bits", "4"], "hosts": ["node1", "node2"], "ranks": P + 1,
         "seed": 7, "float32_bytes_per_iteration": 123456, "ratio": 0.25, "cuda": False,
         "dataset": "digits 1797 images", "nothing": None, "shape": np.array([3, 4], dtype=np.int32),
         "slurm": {"job_id": "42"}, "versions": {"python": "3.11"}, "big": np.int64(2**62)}


@pytest.fixture
def full_trace(tmp_path) -> Path:
    path = tmp_path / "run.h5"
    writer = TraceWriter(path, config=CONFIG, attrs=ATTRS, tables=all_tables(), flush_every=10)
    write_rows(writer, range(25))  # two full blocks and a partial one
    writer.set_attr("final", {"loss": 0.5})
    writer.close()
    return path


# ---- round trip -------------------------------------------------------------------------------
def test_round_trip_of_every_field(full_trace):
    trace = load(full_trace)
    assert trace.config == CONFIG
    assert_rows(trace, range(25))
    for name, value in ATTRS.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(trace.attrs[name], value)
        else:
            assert trace.attrs[name] == value and type(trace.attrs[name]) is type(value.item() if
                                                                                  isinstance(value, np.generic) else value)
    assert trace.attrs["final"] == {"loss": 0.5}
    assert trace.attrs["schema_version"] == SCHEMA_VERSION == trace.schema_version
    assert trace.attrs["format"] == "mpigrad-trace"
    start = datetime.datetime.fromisoformat(trace.attrs["start_time"])
    end = datetime.datetime.fromisoformat(trace.attrs["end_time"])
    assert start <= end and start.tzinfo is not None
    assert trace.status == "complete" and trace.complete
    assert trace.label == "MQGrad"
    # DataFrames: standard tables first, vectors flattened as x_0.., matrices as x_i_j.
    assert list(trace.tables) == ["steps", "workers", "eval", "policy", "checksums"]
    assert list(trace.workers.columns) == ["iteration", "loss_0", "loss_1", "loss_2", "t_compute_0",
                                           "t_compute_1", "t_compute_2", "bytes_sent_0", "bytes_sent_1",
                                           "bytes_sent_2"]
    assert "smoothed_1_2" in trace.policy.columns and "q_values_6" in trace.policy.columns
    assert trace.policy["smoothed_1_2"].tolist() == [5.0 + i for i in range(25)]
    assert trace.steps["iteration"].tolist() == list(range(25))
    assert trace.checksums["checksum_0"].iloc[3] == 2**63 + 3
    assert trace.steps["loss"].dtype == np.float64 and trace.policy["exploratory"].dtype == bool


def test_file_layout_is_resizable_chunked_compressed(full_trace):
    """A closed trace holds exactly the committed rows, compressed, in chunks larger than
    the flush block (here the whole 25 rows)."""
    with h5py.File(full_trace, "r") as h5file:
        assert json.loads(h5file["workers"].attrs["columns"])["loss"] == ["<f8", [P]]
        for table in all_tables():
            assert h5file[table]["_rows"][()] == 25
            for column in all_tables()[table]:
                dataset = h5file[table][column]
                assert dataset.maxshape[0] is None and dataset.chunks[0] == 25
                assert dataset.compression == "gzip" and dataset.shape[0] == 25


def test_a_live_file_is_uncompressed_and_grows_ahead_of_its_committed_rows(tmp_path):
    """While running, flushes write uncompressed flush-sized chunks into datasets extended
    geometrically (not at every flush); readers take ``_rows`` rows; close trims."""
    path = tmp_path / "live.h5"
    writer = TraceWriter(path, config=CONFIG, tables=all_tables(), flush_every=10)
    write_rows(writer, range(31))  # three flushes, one row buffered
    with h5py.File(path, "r", swmr=True) as h5file:
        steps = h5file["steps"]
        assert steps["_rows"][()] == 30
        assert steps["loss"].compression is None and steps["loss"].chunks[0] == 10
        assert steps["loss"].shape[0] == 80  # 8 flushes of capacity, extended once
    assert_rows(load(path), range(30))
    writer.close()
    with h5py.File(path, "r") as h5file:
        assert h5file["steps"]["loss"].shape[0] == 31 and h5file["steps"]["loss"].compression == "gzip"
    assert_rows(load(path), range(31))


def test_rows_are_flushed_in_blocks_and_readable_while_writing(tmp_path):
    path = tmp_path / "live.h5"
    writer = TraceWriter(path, config=CONFIG, tables=all_tables(), flush_every=10)
    write_rows(writer, range(10))
    assert len(load(path).steps) == 0            # buffered, nothing flushed yet
    write_rows(writer, range(10, 11))             # the 11th row flushes the full block
    live = load(path)
    assert len(live.steps) == 10 and live.status == "running" and not live.complete
    assert_rows(live, range(10))
    writer.flush()
    assert len(load(path).eval) == 11
    assert writer.rows["steps"] == 11
    writer.close("stopped")
    done = load(path)
    assert done.status == "stopped" and not done.complete
    assert_rows(done, range(11))


def test_a_flush_inside_a_block_and_the_rows_after_it_share_one_chunk(tmp_path):
    """A flush before the block is full (eval, checkpoint) writes the partial chunk; the rows
    after it land in the same chunk, rewritten whole at the next flush, and a resume that
    truncates inside a chunk continues it."""
    path = tmp_path / "partial.h5"
    writer = TraceWriter(path, config=CONFIG, tables=all_tables(), flush_every=10)
    write_rows(writer, range(4))
    writer.flush()
    assert_rows(load(path), range(4))
    write_rows(writer, range(4, 13))  # fills the chunk: rows 0-9 flushed, 10-12 buffered
    assert_rows(load(path), range(10))
    writer.flush()
    assert_rows(load(path), range(13))
    writer.close("stopped")
    resumed = TraceWriter.open_append(path, tables=all_tables(), truncate_at=7, flush_every=10)
    write_rows(resumed, range(7, 15))  # rows 7-9 complete the first chunk, 10-14 start the next
    assert_rows(load(path), range(10))
    resumed.close()
    assert_rows(load(path), range(15))


def test_extend_keeps_uint64_values_beyond_int64_exactly(tmp_path):
    """A block of Python ints mixing values >= 2**63 with small ones (checksums) must not
    pass through float64 on its way into a u8 column."""
    path = tmp_path / "u8.h5"
    tables = {"checksums": checksum_columns(2)}
    with TraceWriter(path, config=CONFIG, tables=tables, flush_every=4) as writer:
        writer.extend("checksums", {"iteration": [0, 1], "checksum": [[1, 2**63 + 5], [2**64 - 1, 7]]})
    np.testing.assert_array_equal(load(path).array("checksums", "checksum"),
                                  np.array([[1, 2**63 + 5], [2**64 - 1, 7]], dtype=np.uint64))


def test_flush_blocks_beyond_hdf5s_chunk_limit_are_refused(tmp_path):
    tables = {"steps": {"iteration": ("i8", ()), "big": ("f8", (1 << 20,))}}
    with pytest.raises(TraceError, match="flush_every 200 makes steps/big blocks of"):
        TraceWriter(tmp_path / "big.h5", config=CONFIG, tables=tables, flush_every=200)
    assert not (tmp_path / "big.h5").exists()


def test_context_manager_marks_a_raising_run_failed(tmp_path):
    path = tmp_path / "fail.h5"
    with pytest.raises(RuntimeError):
        with TraceWriter(path, config=CONFIG, tables=all_tables(), flush_every=4) as writer:
            write_rows(writer, range(6))
            raise RuntimeError("boom")
    trace = load(path)
    assert trace.status == "failed" and not trace.complete
    assert_rows(trace, range(6))


def test_set_attr_and_attrs_get(tmp_path):
    writer = TraceWriter(tmp_path / "a.h5", config=CONFIG, attrs={"trace_seconds": 1.5},
                         tables=all_tables())
    assert writer.attrs_get("trace_seconds") == 1.5 and writer.attrs_get("missing", 3) == 3
    writer.set_attr("trace_seconds", 2.5)
    assert writer.attrs_get("trace_seconds") == 2.5
    with pytest.raises(TraceError, match="managed by the trace writer"):
        writer.set_attr("status", "complete")
    with pytest.raises(TraceError, match="cannot store"):
        writer.set_attr("bad", object())
    writer.close()
    assert load(tmp_path / "a.h5").attrs["trace_seconds"] == 2.5


# ---- bad input to the writer ----------------------------------------------------------------------
def test_existing_file_is_refused_without_force(full_trace):
    before = full_trace.read_bytes()
    with pytest.raises(TraceError, match="exists; pass --force"):
        TraceWriter(full_trace, config=CONFIG, tables=all_tables())
    assert full_trace.read_bytes() == before
    with pytest.raises(TraceError, match="iteration"):  # a bad table set fails before touching the file
        TraceWriter(full_trace, config=CONFIG, tables={"steps": {"x": ("f8", ())}}, force=True)
    assert full_trace.read_bytes() == before
    TraceWriter(full_trace, config={"label": "new"}, tables=all_tables(), force=True).close()
    assert load(full_trace).label == "new" and len(load(full_trace).steps) == 0
    assert not [p for p in full_trace.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("tables, message", [
    ({}, "non-empty"),
    ({"steps": {"loss": ("f8", ())}}, "integer 'iteration'"),
    ({"steps": {"iteration": ("f8", ())}}, "integer 'iteration'"),
    ({"bad name": {"iteration": ("i8", ())}}, "bad table name"),
    ({"steps": {"iteration": ("i8", ()), "x/y": ("f8", ())}}, "bad column name"),
    ({"steps": {"iteration": ("i8", ()), "s": ("U8", ())}}, "not bool, integer or float"),
    ({"steps": {"iteration": ("i8", ()), "s": ("f8", (0,))}}, "dimension below 1"),
    ({"steps": {"iteration": ("i8", ()), "s": "f8"}}, "spec must be"),
    ({"steps": {"iteration": ("i8", ()), "x": ("f8", (2,)), "x_1": ("f8", ())}}, "clash"),
])
def test_bad_tables_are_rejected(tmp_path, tables, message):
    with pytest.raises(TraceError, match=message):
        TraceWriter(tmp_path / "t.h5", config={}, tables=tables)
    assert not (tmp_path / "t.h5").exists()


def test_bad_config_attrs_and_options_are_rejected(tmp_path):
    path = tmp_path / "t.h5"
    with pytest.raises(TraceError, match="not JSON"):
        TraceWriter(path, config={"x": object()}, tables=all_tables())
    with pytest.raises(TraceError, match="managed by the trace writer"):
        TraceWriter(path, config={}, attrs={"status": "x"}, tables=all_tables())
    with pytest.raises(TraceError, match="64 bits"):
        TraceWriter(path, config={}, attrs={"huge": 2**70}, tables=all_tables())
    with pytest.raises(TraceError, match="flush_every"):
        TraceWriter(path, config={}, tables=all_tables(), flush_every=0)
    with pytest.raises(TraceError, match="does not exist"):
        TraceWriter(tmp_path / "no" / "t.h5", config={}, tables=all_tables())
    with pytest.raises(TraceError, match="is a directory"):
        TraceWriter(tmp_path, config={}, tables=all_tables(), force=True)
    assert list(tmp_path.iterdir()) == []


def test_bad_rows_are_rejected_without_corrupting_the_buffer(tmp_path):
    path = tmp_path / "rows.h5"
    writer = TraceWriter(path, config={}, tables=all_tables(), flush_every=4)
    write_rows(writer, range(2))
    good = rows_for(2)
    bad_rows = [
        ("steps", {k: v for k, v in good["steps"].items() if k != "loss"}, "lacks column 'loss'"),
        ("steps", {**good["steps"], "extra": 1}, r"unknown columns \['extra'\]"),
        ("workers", {**good["workers"], "loss": 1.0}, r"shape \(\), expected \(3,\)"),
        ("workers", {**good["workers"], "loss": np.zeros(4)}, r"shape \(4,\), expected \(3,\)"),
        ("steps", {**good["steps"], "bits": "two"}, "cannot store 'two'"),
        ("nope", good["steps"], "unknown table 'nope'"),
    ]
    for table, row, message in bad_rows:
        with pytest.raises(TraceError, match=message):
            writer.append(table, row)
    write_rows(writer, range(2, 7))
    writer.close()
    with pytest.raises(TraceError, match="closed"):
        writer.append("steps", good["steps"])
    assert_rows(load(path), range(7))


# ---- reading bad files ---------------------------------------------------------------------------
def test_load_errors_are_one_line_and_say_what_is_wrong(tmp_path, full_trace):
    cases = {}
    cases["missing"] = (tmp_path / "missing.h5", "no such file")
    cases["dir"] = (tmp_path, "is a directory")
    text = tmp_path / "notes.h5"
    text.write_text("hello, not HDF5\n")
    cases["text"] = (text, "not an HDF5 file")
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as h5file:
        h5file["x"] = np.arange(3)
    cases["other"] = (other, "HDF5 file but not an mpigrad trace")
    newer = tmp_path / "newer.h5"
    shutil.copyfile(full_trace, newer)
    with h5py.File(newer, "r+") as h5file:
        h5file.attrs["schema_version"] = SCHEMA_VERSION + 1
    cases["newer"] = (newer, f"schema version {SCHEMA_VERSION + 1}, newer than this mpigrad reads")
    truncated = tmp_path / "truncated.h5"
    shutil.copyfile(full_trace, truncated)
    os.truncate(truncated, truncated.stat().st_size // 2)
    cases["truncated"] = (truncated, "is truncated")
    for name, (path, message) in cases.items():
        with pytest.raises(TraceError, match=message) as info:
            load(path)
        assert "\n" not in str(info.value), name


# ---- resume --------------------------------------------------------------------------------------
def test_open_append_truncates_after_the_checkpoint_and_continues(tmp_path):
    path = tmp_path / "resume.h5"
    writer = TraceWriter(path, config=CONFIG, attrs=ATTRS, tables=all_tables(), flush_every=8)
    write_rows(writer, range(30))
    writer.close("stopped")
    writer = TraceWriter.open_append(path, tables=all_tables(), truncate_at=21, attrs={"restarts": 1},
                                     flush_every=8)
    assert writer.rows["steps"] == 21
    assert writer.attrs_get("seed") == 7
    write_rows(writer, range(21, 40))
    writer.close()
    trace = load(path)
    assert_rows(trace, range(40))
    assert trace.status == "complete" and trace.config == CONFIG and trace.attrs["restarts"] == 1
    [resume] = trace.attrs["resumes"]
    assert resume["at_iteration"] == 21 and resume["dropped_rows"]["steps"] == 9
    assert trace.attrs["argv"] == ATTRS["argv"]


def test_open_append_refuses_other_tables_or_schema_and_keeps_the_file(tmp_path, full_trace):
    before = full_trace.read_bytes()
    other = all_tables()
    other["workers"] = workers_columns(P + 1)
    with pytest.raises(TraceError, match="table 'workers' has columns"):
        TraceWriter.open_append(full_trace, tables=other, truncate_at=5)
    with pytest.raises(TraceError, match="has tables"):
        TraceWriter.open_append(full_trace, tables=default_tables(P), truncate_at=5)
    with pytest.raises(TraceError, match="no such file"):
        TraceWriter.open_append(tmp_path / "nope.h5", tables=all_tables(), truncate_at=5)
    assert full_trace.read_bytes() == before


# ---- crash safety: real writer processes killed with SIGKILL ------------------------------------------
def _start_writer(path: Path, mode: str, flush_every: int) -> tuple[subprocess.Popen, list[str]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(KILL_SCRIPT.parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen([sys.executable, str(KILL_SCRIPT), str(path), mode, str(flush_every)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def collect():
        for line in process.stdout:
            lines.append(line.strip())
            ready.set()

    threading.Thread(target=collect, daemon=True).start()
    if not ready.wait(timeout=60):
        process.kill()
        pytest.fail(f"writer did not start: {process.stderr.read()}")
    return process, lines


def _legal_row_counts(last: str, flush_every: int) -> set[int]:
    """Rows the file may hold when the last line printed was ``last`` (the next event may
    have completed without being printed yet)."""
    event, _, count = last.partition(" ")
    n = int(count) if count else 0
    if event == "closed":
        return {n, n - flush_every}
    return {n, n + flush_every}


@pytest.mark.parametrize("mode", ["append", "resume"])
def test_sigkill_leaves_every_flushed_row_readable(tmp_path, mode):
    flush_every = 20
    rng = random.Random(f"kill-{mode}")
    for attempt in range(4):
        path = tmp_path / f"{mode}{attempt}.h5"
        process, lines = _start_writer(path, mode, flush_every)
        time.sleep(rng.uniform(0.05, 0.6))
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        time.sleep(0.05)  # let the reader thread take the last lines
        assert process.returncode == -signal.SIGKILL, process.stderr.read()
        trace = load(path)
        n = len(trace.steps)
        assert n in _legal_row_counts(lines[-1], flush_every), (lines[-3:], n)
        assert trace.status in ("running", "stopped")
        iterations = range(n)
        np.testing.assert_array_equal(trace.steps["iteration"], iterations)
        np.testing.assert_array_equal(trace.steps["loss"], [1.0 / (i + 1) for i in iterations])
        np.testing.assert_array_equal(trace.array("workers", "bytes_sent"),
                                      [kill_writer.workers_row(i)["bytes_sent"] for i in iterations])
        evals = [i for i in iterations if i % kill_writer.EVAL_EVERY == 0]
        np.testing.assert_array_equal(trace.eval["test_accuracy"],
                                      [kill_writer.eval_row(i)["test_accuracy"] for i in evals])
        with h5py.File(path, "r", swmr=True) as h5file:  # plain h5py opens it too
            assert h5file["steps/_rows"][()] == n
        # A requeued job resumes from a checkpoint even after its writer was killed.
        resumed = TraceWriter.open_append(path, tables=kill_writer.tables(), truncate_at=n // 2,
                                          flush_every=flush_every)
        for i in range(n // 2, n // 2 + 5):
            kill_writer.append_iteration(resumed, i)
        resumed.close()
        after = load(path)
        assert after.complete and after.steps["iteration"].tolist() == list(range(n // 2 + 5))
        with h5py.File(path, "r") as h5file:  # closed cleanly: no SWMR mark left
            assert h5file.attrs["status"] == "complete"


# ---- cost, metadata helpers, labels ---------------------------------------------------------------
@pytest.mark.serial  # a timed ratio
def test_buffered_tracing_costs_a_small_fraction_of_row_by_row_writes(tmp_path):
    """One steps row + one workers row per iteration, flushed every 100 iterations against
    every iteration, timed in the same run (a ratio, so that a slower or busier machine does
    not decide it; ``mpigrad bench trace`` measures the absolute cost: ~13-15 us per iteration
    at flush 100, ~0.9-1.3 ms row by row, on our 2-core machines)."""
    def cost(flush_every: int, iterations: int) -> float:
        rows = [kill_writer.steps_row(i) for i in range(iterations)]
        workers = [kill_writer.workers_row(i) for i in range(iterations)]
        best = float("inf")
        for attempt in range(3):
            writer = TraceWriter(tmp_path / f"cost{flush_every}-{attempt}.h5", config={},
                                 tables=kill_writer.tables(), flush_every=flush_every)
            start = time.perf_counter()
            for step, worker in zip(rows, workers):
                writer.append("steps", step)
                writer.append("workers", worker)
            writer.flush()
            best = min(best, (time.perf_counter() - start) / iterations)
            writer.close()
        return best

    buffered, row_by_row = cost(100, 2000), cost(1, 200)
    assert buffered * 5 < row_by_row, f"{buffered * 1e6:.1f} us against {row_by_row * 1e6:.1f} us row by row"


def test_collect_versions_and_slurm_ids():
    script = ("import json, sys; from mpigrad.trace import collect_versions; "
              "before = collect_versions(); assert 'mpi4py.MPI' not in sys.modules and 'torch' not in sys.modules; "
              "import mpi4py.MPI, torch; print(json.dumps([before, collect_versions()]))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    before, after = json.loads(result.stdout)
    for key in ("python", "numpy", "numba", "torch", "h5py", "hdf5", "mpi4py"):
        assert before[key], key
    assert "mpi_library" not in before and after["mpi_library"].startswith(("MPICH", "Open MPI", "Intel"))
    assert "\x00" not in after["mpi_library"] and after["mpi_library"] == after["mpi_library"].strip()
    assert before["cpu"] and before["cpu"] == after["cpu"]
    assert "torch_cpu_capability" not in before and after["torch_cpu_capability"] in (
        "DEFAULT", "AVX2", "AVX512", "NEON", "SVE256", "VSX", "ZVECTOR")
    env = {"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "2", "HOME": "/x",
           "SLURM_RESTART_COUNT": ""}
    assert slurm_ids(env) == {"job_id": "12", "array_job_id": "10", "array_task_id": "2"}
    assert slurm_ids({}) == {}


@pytest.mark.parametrize("config, label", [
    ({"codec": {"id": "uniform", "bits": 2}, "policy": {"id": "fixed", "bits": 2}}, "Fix (2-bit)"),
    ({"codec": {"id": "uniform", "bits": 8}, "policy": {"id": "fixed"}}, "Fix (8-bit)"),
    ({"codec": {"id": "uniform", "bits": 2}, "policy": {"id": "adaptive"}}, "Adaptive"),
    ({"codec": {"id": "uniform"}, "policy": {"id": "mqgrad"}}, "MQGrad"),
    ({"codec": {"id": "qsgd", "bits": 4}, "policy": {"id": "mqgrad"}}, "MQGrad [qsgd]"),
    ({"codec": {"id": "qsgd", "bits": 4}}, "Fix (4-bit) [qsgd]"),
    ({"codec": {"id": "fp32"}, "policy": {"id": "fixed", "bits": 32}}, "FP32"),
    ({"policy": {"id": "newpolicy"}}, "newpolicy"),
    ({"label": "mine", "policy": {"id": "mqgrad"}}, "mine"),
    ({}, "Fix"), ({"codec": "garbage", "policy": 3}, "Fix [garbage]"), (None, "unknown"),
    # mpigrad train's flat RunConfig form
    ({"codec": "uniform", "policy": "fixed", "bits": 4, "codec_opts": {}}, "Fix (4-bit)"),
    ({"codec": "uniform", "policy": "mqgrad", "bits": 2, "policy_opts": {"T": 5}}, "MQGrad"),
    ({"codec": "qsgd", "policy": "adaptive", "bits": 2}, "Adaptive [qsgd]"),
])
def test_method_labels(config, label):
    assert method_label(config) == label


def test_default_tables_match_the_issue():
    tables = default_tables(4, policy_columns={"iteration": ("i8", ())}, checksum_ranks=5)
    assert list(tables) == ["steps", "workers", "eval", "policy", "checksums"]
    assert list(STEPS_COLUMNS) == ["iteration", "wall_time", "sim_time", "loss", "bits", "bytes_up",
                                   "bytes_down", "t_compute", "t_encode", "t_decode", "t_comm", "t_policy"]
    assert tables["workers"]["loss"] == ("f8", (4,)) and tables["checksums"]["checksum"] == ("u8", (5,))
    with pytest.raises(TraceError, match="clashes"):
        step_columns({"loss": ("f8", ())})
    with pytest.raises(TraceError, match="must be an integer >= 1, got 0"):
        workers_columns(0)


# ---- repair -------------------------------------------------------------------------------------
def test_repair_closes_a_killed_writers_trace_once(tmp_path, capsys):
    from mpigrad.cli import main

    path = tmp_path / "killed.h5"
    process, lines = _start_writer(path, "append", 20)
    while not any(line.startswith("flushed") for line in lines):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "r")
    before = load(path)
    n = len(before.steps)
    assert before.status == "running" and n >= 20

    assert main(["trace", "repair", str(path)]) == 0
    assert f"status 'incomplete', last iteration {n - 1}" in capsys.readouterr().out
    with h5py.File(path, "r") as h5file:  # no SWMR mark left: plain h5py opens it
        assert h5file.attrs["status"] == "incomplete"
    after = load(path)
    assert after.status == "incomplete" and after.attrs["last_iteration"] == n - 1
    for table in ("steps", "workers", "eval"):
        assert getattr(after, table).equals(getattr(before, table)), table
    assert {k: v for k, v in after.attrs.items() if k not in ("status", "end_time", "last_iteration",
                                                              "repaired", "json_attrs")} == \
        {k: v for k, v in before.attrs.items() if k not in ("status", "json_attrs")}

    # Idempotent: a second repair (with or without an error) changes nothing and says so.
    content = path.read_bytes()
    assert main(["trace", "repair", str(path), "--error", "late"]) == 0
    assert "nothing to repair" in capsys.readouterr().out
    assert path.read_bytes() == content


def test_repair_with_an_error_marks_failed_and_leaves_complete_traces_alone(tmp_path, capsys):
    from mpigrad.cli import main

    path = tmp_path / "run.h5"
    writer = TraceWriter(path, config={"codec": "uniform"}, tables=kill_writer.tables(), flush_every=5)
    for i in range(12):
        kill_writer.append_iteration(writer, i)
    # Copied while the writer is open: the copy has the SWMR mark of a killed writer, and
    # the 10 rows of its two flushes (the last 2 rows are still in the writer's buffer).
    copy = tmp_path / "copy.h5"
    copy.write_bytes(path.read_bytes())
    writer.close()
    assert main(["trace", "repair", str(copy), "--error", "launcher exit 137"]) == 0
    assert "status 'failed', last iteration 9" in capsys.readouterr().out
    failed = load(copy)
    assert failed.status == "failed" and failed.attrs["error"] == "launcher exit 137"
    assert len(failed.steps) == 10

    content = path.read_bytes()
    assert main(["trace", "repair", str(path)]) == 0
    assert "closed with status 'complete'; nothing to repair" in capsys.readouterr().out
    assert path.read_bytes() == content

    (tmp_path / "junk.h5").write_bytes(b"junk")
    for bad in (tmp_path / "junk.h5", tmp_path / "missing.h5"):
        assert main(["trace", "repair", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mpigrad trace: error:") and len(err.strip().splitlines()) == 1
