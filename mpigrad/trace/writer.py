"""TraceWriter: rank 0's buffered, crash-safe HDF5 trace writer.

Crash safety rests on three rules:

- Rows are appended in SWMR mode (HDF5 single-writer/multiple-reader), which keeps the file
  consistent on disk at every moment; each table's committed row count (its ``_rows``
  dataset) is written only after the block's data is flushed, so a reader sees exactly the
  rows of the completed flushes even when the writer is killed in the middle of one.
- Every other change (creating the file, closing it, truncating rows on resume) is made on
  a temporary file in the same folder that replaces ``path`` atomically.
- Between flushes, ``append`` only copies values into preallocated numpy buffers.

A live file is written for a cheap flush: uncompressed, and each table's datasets grow
geometrically ahead of ``_rows`` (read ``_rows`` rows of a live file). ``close`` rewrites it
compact: exactly the committed rows, gzip-compressed, in larger chunks.

A file whose writer was killed keeps HDF5's "open for SWMR writing" mark: ``load`` reads it,
and so does ``h5py.File(path, "r", swmr=True)``; ``h5clear -s FILE`` removes the mark for
tools that refuse it.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Mapping

import h5py
import numpy as np
from h5py import h5s

from .. import __version__, options
from .attrs import encode_attr, write_attrs
from .schema import FORMAT_NAME, ROWS_DATASET, SCHEMA_VERSION, TraceError, validate_tables

__all__ = ["TraceWriter", "TraceExists", "STATUSES", "repair", "write_closed"]

#: Status values ``close`` accepts: a run that finished, one stopped at an iteration
#: boundary with a checkpoint (to be requeued), one that raised, and one whose writer died
#: without a known cause (set by ``mpigrad trace repair``). A file still being written, or
#: whose writer was killed, reads as "running".
STATUSES = ("complete", "stopped", "failed", "incomplete")
#: Root attributes that describe how a session ended; a resumed session drops them.
END_ATTRS = ("complete", "status", "end_time", "error", "last_iteration")
#: Attributes that the writer owns; the runtime's ``attrs`` may not set them.
RESERVED_ATTRS = frozenset({"format", "schema_version", "mpigrad_version", "config", "start_time",
                            "end_time", "complete", "status", "resumes", "json_attrs"})
_CHUNK_BYTES_MAX = 1 << 20
#: A live chunk is one flush block; HDF5 refuses chunks of 4 GiB or more.
_LIVE_CHUNK_BYTES_MAX = 1 << 30
#: Rows per chunk of a closed trace's datasets (capped at _CHUNK_BYTES_MAX bytes).
_CLOSED_CHUNK_ROWS = 4096
#: A table's datasets first grow to this many flushes of rows, then double.
_MIN_CAPACITY_FLUSHES = 8
_COMPRESSION = {"compression": "gzip", "compression_opts": 1}
#: SWMR needs the HDF5 1.10 file format; capping it there keeps traces readable by any HDF5 >= 1.10.
_LIBVER = ("v110", "v110")


class TraceExists(TraceError):
    """The trace path is taken: a directory, or a file that exists (without ``force``). The
    launch checks refuse both before any rank works; a run that meets it at the trace's
    creation (another run took the path since) exits 2 as they do."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


class TraceWriter:
    """Append rows to the tables of a new trace file; see the module docstring.

    ``tables`` maps a table name to ``{column: (numpy dtype string, per-row shape)}``.
    ``append`` copies a row into memory; ``flush`` (called automatically when a table's
    buffer of ``flush_every`` rows is full and another row arrives) appends the buffered
    blocks to the file. ``set_attr`` values are written at ``close``.
    """

    def __init__(self, path: str | os.PathLike, *, config: Mapping[str, Any],
                 attrs: Mapping[str, Any] | None = None, tables: Mapping[str, Mapping],
                 force: bool = False, flush_every: int = 100):
        self._setup(path, tables, flush_every)
        if not isinstance(config, Mapping):
            raise TraceError(f"config must be a dict, got {type(config).__name__}")
        options.check_overwrite([self.path], force, error=TraceExists)
        root = {"format": FORMAT_NAME, "schema_version": SCHEMA_VERSION,
                "mpigrad_version": __version__, "start_time": _now(), "config": dict(config),
                **_user_attrs(attrs)}
        self._create(root, initial_rows=None)

    @classmethod
    def open_append(cls, path: str | os.PathLike, *, tables: Mapping[str, Mapping], truncate_at: int,
                    attrs: Mapping[str, Any] | None = None, flush_every: int = 100,
                    resume: Mapping[str, Any] | None = None) -> "TraceWriter":
        """Continue the trace at ``path`` from iteration ``truncate_at`` (a checkpoint's next one).

        Rows with ``iteration >= truncate_at`` (written after the checkpoint) are dropped;
        the tables must match the file's exactly; ``attrs`` update the root attributes;
        ``resume`` adds keys to this resume's ``resumes`` entry (the runtime's ``network``).
        """
        from .reader import read_raw

        self = cls.__new__(cls)
        self._setup(path, tables, flush_every)
        options.check_int("truncate_at", truncate_at, 0, error=TraceError)
        raw = read_raw(self.path)
        if raw.schema_version != SCHEMA_VERSION:
            raise TraceError(f"{self.path} has trace schema version {raw.schema_version}; this "
                             f"mpigrad appends only to version {SCHEMA_VERSION}")
        _check_same_tables(self.path, raw.specs, self._specs)
        kept, dropped = {}, {}
        for table, columns in raw.arrays.items():
            keep = columns["iteration"] < truncate_at
            kept[table] = {name: values[keep] for name, values in columns.items()}
            dropped[table] = int(keep.size - keep.sum())
        root = {name: value for name, value in raw.attrs.items() if name not in END_ATTRS}
        root.update(_user_attrs(attrs))
        resume = {"at_iteration": int(truncate_at), "time": _now(),
                  "mpigrad_version": __version__, "dropped_rows": dropped, **(resume or {})}
        root["resumes"] = list(raw.attrs.get("resumes", [])) + [resume]
        self._create(root, initial_rows=kept)
        return self

    # ---- construction ---------------------------------------------------------------
    def _setup(self, path: str | os.PathLike, tables: Mapping[str, Mapping], flush_every: int) -> None:
        self.path = Path(path)
        self.flush_every = options.check_int("flush_every", flush_every, 1, error=TraceError)
        self._specs = validate_tables(tables)
        for table, specs in self._specs.items():
            for name, (dtype, shape) in specs.items():
                chunk = self.flush_every * dtype.itemsize * int(np.prod(shape, dtype=np.int64))
                if chunk > _LIVE_CHUNK_BYTES_MAX:
                    raise TraceError(f"flush_every {self.flush_every} makes {table}/{name} blocks of "
                                     f"{chunk} bytes; at most {_LIVE_CHUNK_BYTES_MAX} (HDF5's chunk limit)")
        if self.path.is_dir():
            raise TraceExists(f"{self.path} is a directory, not a trace file")
        if not self.path.parent.is_dir():
            raise TraceError(f"cannot create {self.path}: folder {self.path.parent} does not exist")
        self._file: h5py.File | None = None
        self._pending_attrs: dict[str, Any] = {}
        # Hot-path state: per table, (name, buffer, per-row shape) for each column.
        # Zeroed: a flush writes whole chunks, rows past the filled ones included.
        self._columns = {table: [(name, np.zeros((self.flush_every, *shape), dtype), shape)
                                 for name, (dtype, shape) in specs.items()]
                         for table, specs in self._specs.items()}
        # The buffers hold one live chunk: buffer row i is file row _chunk_start + i, _fill
        # rows are filled, the file holds _committed rows (_committed - _chunk_start of them
        # from this buffer, written by an earlier flush of the same chunk).
        self._fill = dict.fromkeys(self._specs, 0)
        self._chunk_start = dict.fromkeys(self._specs, 0)
        self._committed = dict.fromkeys(self._specs, 0)

    def _create(self, root_attrs: dict[str, Any], initial_rows: dict[str, dict] | None) -> None:
        """Build the file under a temporary name, enter SWMR mode, then move it to ``path``."""
        temp = _temp_path(self.path)
        try:
            h5file = h5py.File(temp, "w", libver=_LIBVER)
        except OSError as exc:
            raise TraceError(f"cannot create {self.path}: {_hdf5_reason(exc)}") from None
        try:
            self._attrs = {**root_attrs, "complete": False, "status": "running"}
            write_attrs(h5file, self._attrs)
            self._datasets, self._row_counters = {}, {}
            self._capacity: dict[str, int] = {}
            for table, specs in self._specs.items():
                rows = initial_rows[table] if initial_rows else None
                self._committed[table] = len(rows["iteration"]) if rows else 0
                datasets, counter = _add_table(h5file, table, specs, rows, live_chunk_rows=self.flush_every)
                self._datasets[table] = [dataset.id for dataset in datasets]
                self._row_counters[table] = counter.id
                self._capacity[table] = count = self._committed[table]
                self._chunk_start[table] = start = count - count % self.flush_every
                self._fill[table] = count - start
                if rows:  # the buffer starts as the last, partial chunk
                    for name, buffer, _ in self._columns[table]:
                        buffer[:count - start] = rows[name][start:]
            h5file.flush()
            h5file.swmr_mode = True
            os.replace(temp, self.path)
        except BaseException:
            h5file.close()
            temp.unlink(missing_ok=True)
            raise
        self._file = h5file

    # ---- appending ------------------------------------------------------------------
    def append(self, table: str, row: Mapping[str, Any]) -> None:
        """Buffer one row: ``row`` maps every column of ``table`` to a value of its shape."""
        try:
            columns = self._columns[table]
        except KeyError:
            self._require_open()
            raise TraceError(f"unknown table {table!r}; this trace has {', '.join(self._columns)}") from None
        n = self._fill[table]
        if n == self.flush_every:
            self.flush()
            n = self._fill[table]
        try:
            for name, buffer, shape in columns:
                value = row[name]
                if shape and _shape(value) != shape:
                    raise TraceError(f"{table}/{name}: value of shape {np.shape(value)}, "
                                     f"expected {shape}")
                buffer[n] = value
        except KeyError as exc:
            raise TraceError(f"{table} row lacks column {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, TraceError):
                raise
            raise TraceError(f"{table}/{name}: cannot store {value!r}: {exc}") from None
        if len(row) != len(columns):
            extra = sorted(set(row) - {name for name, _, _ in columns})
            raise TraceError(f"{table} row has unknown columns {extra}")
        self._fill[table] = n + 1

    def extend(self, table: str, block: Mapping[str, Any]) -> None:
        """Buffer n rows at once: ``block`` maps every column to an array of shape (n, *shape)
        (one validation and one copy per column instead of per row)."""
        try:
            columns = self._columns[table]
        except KeyError:
            self._require_open()
            raise TraceError(f"unknown table {table!r}; this trace has {', '.join(self._columns)}") from None
        if set(block) != {name for name, _, _ in columns}:
            raise TraceError(f"{table} block columns {sorted(block)} are not the table's "
                             f"{sorted(name for name, _, _ in columns)}")
        # In the column's dtype: Python ints beyond 2**63 next to small ones would become floats.
        arrays = {name: np.asarray(block[name], dtype=buffer.dtype) for name, buffer, _ in columns}
        n = len(arrays["iteration"])
        for name, _, shape in columns:
            if arrays[name].shape != (n, *shape):
                raise TraceError(f"{table}/{name}: block of shape {arrays[name].shape}, expected {(n, *shape)}")
        done = 0
        while done < n:
            if self._fill[table] == self.flush_every:
                self.flush()
            start = self._fill[table]
            take = min(n - done, self.flush_every - start)
            for name, buffer, _ in columns:
                buffer[start:start + take] = arrays[name][done:done + take]
            self._fill[table] = start + take
            done += take

    def flush(self) -> None:
        """Append every buffered row to the file; they survive the process being killed.

        Each table's buffer is written whole as its chunk (HDF5's direct chunk write: no
        selection, conversion or filter, half the cost of a dataset write); rows past the
        buffered ones are past ``_rows``, so not data. A full buffer then starts the next chunk.
        """
        self._require_open()
        tables = [table for table in self._fill if self._chunk_start[table] + self._fill[table] > self._committed[table]]
        if not tables:
            return
        for table in tables:
            start = self._chunk_start[table]
            if start + self.flush_every > self._capacity[table]:
                self._grow(table, start + self.flush_every)
            for (_, buffer, shape), dataset in zip(self._columns[table], self._datasets[table]):
                dataset.write_direct_chunk((start,) + (0,) * len(shape), buffer)
        self._file.flush()
        for table in tables:
            self._committed[table] = self._chunk_start[table] + self._fill[table]
            self._row_counters[table].write(h5s.ALL, h5s.ALL, np.array(self._committed[table], np.int64))
            if self._fill[table] == self.flush_every:
                self._chunk_start[table] += self.flush_every
                self._fill[table] = 0
        self._file.flush()

    def _grow(self, table: str, rows: int) -> None:
        """Extend the table's datasets to hold at least ``rows`` rows, geometrically, so that
        a flush only writes chunks (extending at every flush was a fifth of its cost)."""
        capacity = max(rows, 2 * self._capacity[table], _MIN_CAPACITY_FLUSHES * self.flush_every)
        for (_, _, shape), dataset in zip(self._columns[table], self._datasets[table]):
            dataset.set_extent((capacity, *shape))
        self._capacity[table] = capacity

    # ---- attributes and closing ---------------------------------------------------------
    def set_attr(self, name: str, value: Any) -> None:
        """Set a root attribute (e.g. a final summary); written to the file at ``close``."""
        self._require_open()
        if name in RESERVED_ATTRS:
            raise TraceError(f"attribute {name!r} is managed by the trace writer")
        encode_attr(name, value)
        self._pending_attrs[name] = value

    def attrs_get(self, name: str, default: Any = None) -> Any:
        """A root attribute's value: the last ``set_attr`` one, else the one in the file."""
        return self._pending_attrs.get(name, self._attrs.get(name, default))

    @property
    def rows(self) -> dict[str, int]:
        """Rows per table, committed and buffered."""
        return {table: self._chunk_start[table] + self._fill[table] for table in self._fill}

    def close(self, status: str = "complete") -> None:
        """Flush, then record ``status`` (one of STATUSES) and the ``set_attr`` values."""
        if self._file is None:
            return
        if status not in STATUSES:
            raise TraceError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        try:
            self.flush()
        finally:
            self._file.close()
            self._file, self._columns = None, {}
        from .reader import read_raw

        raw = read_raw(self.path)
        final = {**raw.attrs, **self._pending_attrs, "complete": status == "complete", "status": status,
                 "end_time": _now()}
        write_closed(self.path, raw.specs, raw.arrays, final)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close("complete" if exc_type is None else "failed")

    def _require_open(self) -> None:
        if self._file is None:
            raise TraceError(f"trace writer for {self.path} is closed")


def _shape(value: Any) -> tuple[int, ...]:
    """np.shape without building an array from a flat list (the common per-row case: it is
    most of an append's cost)."""
    if isinstance(value, np.ndarray):
        return value.shape
    if isinstance(value, (list, tuple)) and not (value and isinstance(value[0], (list, tuple, np.ndarray))):
        return (len(value),)
    return np.shape(value)


def repair(path: str | os.PathLike, error: str | None = None) -> str:
    """Close the trace of a writer that died (``mpigrad trace repair``); return what was done.

    The file is rebuilt from a SWMR read (every committed row, every attribute) under a
    temporary name that then replaces it atomically, without HDF5's open-for-writing mark,
    so plain ``h5py.File(path, "r")`` opens it. Its status becomes "failed" when ``error``
    is given (recorded as the ``error`` attribute), "incomplete" otherwise, and
    ``last_iteration`` records the last iteration in the steps table (-1: none). A trace
    that is already closed is left alone, so repairing twice changes nothing.
    """
    from .reader import read_raw, writer_mark

    path = Path(path)
    raw = read_raw(path)
    status = str(raw.attrs.get("status", "running"))
    if not writer_mark(path) and status != "running":
        return f"{path}: closed with status {status!r}; nothing to repair"
    steps = raw.arrays.get("steps", {}).get("iteration")
    last = int(steps.max()) if steps is not None and steps.size else -1
    new_status = "failed" if error else "incomplete" if status == "running" else status
    attrs = {name: value for name, value in raw.attrs.items() if name not in END_ATTRS}
    attrs.update(last_iteration=last, repaired=_now(), complete=new_status == "complete", status=new_status,
                 end_time=_now())
    if error:
        attrs["error"] = error
    elif "error" in raw.attrs:
        attrs["error"] = raw.attrs["error"]
    write_closed(path, raw.specs, raw.arrays, attrs)
    return (f"{path}: repaired: status {new_status!r}, last iteration {last}, "
            f"{sum(len(t['iteration']) for t in raw.arrays.values())} rows kept")


def _user_attrs(attrs: Mapping[str, Any] | None) -> dict[str, Any]:
    attrs = dict(attrs or {})
    reserved = sorted(RESERVED_ATTRS.intersection(attrs))
    if reserved:
        raise TraceError(f"attributes {reserved} are managed by the trace writer")
    for name, value in attrs.items():
        encode_attr(name, value)
    return attrs


def _add_table(h5file: h5py.File, table: str, specs: Mapping, rows: Mapping[str, np.ndarray] | None, *,
               live_chunk_rows: int | None) -> tuple[list[h5py.Dataset], h5py.Dataset]:
    """Create ``table``'s group: its ``columns`` attribute, one resizable dataset per column
    holding ``rows`` (None: empty), and its ``_rows`` counter.

    A live table's chunks are its flush blocks (``live_chunk_rows``), uncompressed: a flush
    writes each column's block as one chunk, unfiltered (compressing a chunk at every flush
    was half of a flush's cost). A closed table is gzip-compressed in chunks of up to
    _CLOSED_CHUNK_ROWS rows (and _CHUNK_BYTES_MAX bytes).
    """
    group = h5file.create_group(table)
    group.attrs["columns"] = json.dumps({name: [dtype.str, list(shape)] for name, (dtype, shape) in specs.items()})
    count = len(rows["iteration"]) if rows else 0
    datasets = []
    for name, (dtype, shape) in specs.items():
        row_bytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        chunk_rows = live_chunk_rows or max(1, min(count, _CLOSED_CHUNK_ROWS, _CHUNK_BYTES_MAX // row_bytes))
        packing = {} if live_chunk_rows else {"shuffle": dtype.itemsize > 1, **_COMPRESSION}
        dataset = group.create_dataset(name, shape=(count, *shape), maxshape=(None, *shape), dtype=dtype,
                                       chunks=(chunk_rows, *shape), **packing)
        if count:
            dataset[...] = rows[name]
        datasets.append(dataset)
    return datasets, group.create_dataset(ROWS_DATASET, data=np.int64(count))


def write_closed(path: Path, specs: Mapping[str, Mapping], arrays: Mapping[str, Mapping], attrs: Mapping) -> None:
    """Replace ``path`` atomically with a closed trace: ``arrays`` (exactly the committed
    rows), compressed, with root attributes ``attrs`` and no open-for-writing mark."""
    temp = _temp_path(path)
    try:
        with h5py.File(temp, "w", libver=_LIBVER) as h5file:
            write_attrs(h5file, attrs)
            for table, table_specs in specs.items():
                _add_table(h5file, table, table_specs, arrays[table], live_chunk_rows=None)
        with open(temp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _check_same_tables(path: Path, found: dict, wanted: dict) -> None:
    if set(found) != set(wanted):
        raise TraceError(f"{path} has tables {sorted(found)}, this run writes {sorted(wanted)}")
    for table, specs in wanted.items():
        if found[table] != specs:
            raise TraceError(f"{path}: table {table!r} has columns {_describe(found[table])}, "
                             f"this run writes {_describe(specs)}")


def _describe(specs: dict) -> str:
    return ", ".join(f"{name}:{dtype.str}{list(shape) if shape else ''}"
                     for name, (dtype, shape) in specs.items())


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _hdf5_reason(exc: OSError) -> str:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "lock" in reason:
        reason += " (on file systems without locking, set HDF5_USE_FILE_LOCKING=FALSE)"
    return reason
