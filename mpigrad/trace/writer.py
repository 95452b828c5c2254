"""TraceWriter: rank 0's buffered, crash-safe HDF5 trace writer.

Crash safety rests on three rules:

- Rows are appended in SWMR mode (HDF5 single-writer/multiple-reader), which keeps the file
  consistent on disk at every moment; each table's committed row count (its ``_rows``
  dataset) is written only after the block's data is flushed, so a reader sees exactly the
  rows of the completed flushes even when the writer is killed in the middle of one.
- Every other change (creating the file, finalising attributes at close, truncating rows on
  resume) is made on a temporary file in the same folder that replaces ``path`` atomically.
- Between flushes, ``append`` only copies values into preallocated numpy buffers.

A file whose writer was killed keeps HDF5's "open for SWMR writing" mark: ``load`` reads it,
and so does ``h5py.File(path, "r", swmr=True)``; ``h5clear -s FILE`` removes the mark for
tools that refuse it.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import h5py
import numpy as np
from h5py import h5s

from .. import __version__, options
from .attrs import encode_attr, write_attrs
from .schema import FORMAT_NAME, ROWS_DATASET, SCHEMA_VERSION, TraceError, validate_tables

__all__ = ["TraceWriter", "STATUSES", "repair"]

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
_COMPRESSION = {"compression": "gzip", "compression_opts": 1}
#: SWMR needs the HDF5 1.10 file format; capping it there keeps traces readable by any HDF5 >= 1.10.
_LIBVER = ("v110", "v110")


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
        if self.path.exists() and not force:
            raise TraceError(f"{self.path} exists; pass --force to overwrite it")
        root = {"format": FORMAT_NAME, "schema_version": SCHEMA_VERSION,
                "mpigrad_version": __version__, "start_time": _now(), "config": dict(config),
                **_user_attrs(attrs)}
        self._create(root, initial_rows=None)

    @classmethod
    def open_append(cls, path: str | os.PathLike, *, tables: Mapping[str, Mapping], truncate_at: int,
                    attrs: Mapping[str, Any] | None = None, flush_every: int = 100) -> "TraceWriter":
        """Continue the trace at ``path`` from iteration ``truncate_at`` (a checkpoint's next one).

        Rows with ``iteration >= truncate_at`` (written after the checkpoint) are dropped;
        the tables must match the file's exactly; ``attrs`` update the root attributes.
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
                  "mpigrad_version": __version__, "dropped_rows": dropped}
        root["resumes"] = list(raw.attrs.get("resumes", [])) + [resume]
        self._create(root, initial_rows=kept)
        return self

    # ---- construction ---------------------------------------------------------------
    def _setup(self, path: str | os.PathLike, tables: Mapping[str, Mapping], flush_every: int) -> None:
        self.path = Path(path)
        self.flush_every = options.check_int("flush_every", flush_every, 1, error=TraceError)
        self._specs = validate_tables(tables)
        if self.path.is_dir():
            raise TraceError(f"{self.path} is a directory, not a trace file")
        if not self.path.parent.is_dir():
            raise TraceError(f"cannot create {self.path}: folder {self.path.parent} does not exist")
        self._file: h5py.File | None = None
        self._pending_attrs: dict[str, Any] = {}
        # Hot-path state: per table, (name, buffer, per-row shape) for each column.
        self._columns = {table: [(name, np.empty((self.flush_every, *shape), dtype), shape)
                                 for name, (dtype, shape) in specs.items()]
                         for table, specs in self._specs.items()}
        self._pending = dict.fromkeys(self._specs, 0)
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
            for table, specs in self._specs.items():
                rows = initial_rows[table] if initial_rows else None
                self._committed[table] = len(rows["iteration"]) if rows else 0
                group = h5file.create_group(table)
                group.attrs["columns"] = json.dumps(
                    {name: [dtype.str, list(shape)] for name, (dtype, shape) in specs.items()})
                self._datasets[table] = [
                    _create_column(group, name, dtype, shape, self.flush_every,
                                   rows[name] if rows else None).id
                    for name, (dtype, shape) in specs.items()]
                counter = group.create_dataset(ROWS_DATASET, data=np.int64(self._committed[table]))
                self._row_counters[table] = counter.id
            h5file.flush()
            h5file.swmr_mode = True
            os.replace(temp, self.path)
        except BaseException:
            h5file.close()
            temp.unlink(missing_ok=True)
            raise
        self._file = h5file
        self._memory_spaces: dict[tuple, h5s.SpaceID] = {}

    # ---- appending ------------------------------------------------------------------
    def append(self, table: str, row: Mapping[str, Any]) -> None:
        """Buffer one row: ``row`` maps every column of ``table`` to a value of its shape."""
        try:
            columns = self._columns[table]
        except KeyError:
            self._require_open()
            raise TraceError(f"unknown table {table!r}; this trace has {', '.join(self._columns)}") from None
        n = self._pending[table]
        if n == self.flush_every:
            self.flush()
            n = 0
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
        self._pending[table] = n + 1

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
        arrays = {name: np.asarray(block[name]) for name, _, _ in columns}
        n = len(arrays["iteration"])
        for name, _, shape in columns:
            if arrays[name].shape != (n, *shape):
                raise TraceError(f"{table}/{name}: block of shape {arrays[name].shape}, expected {(n, *shape)}")
        done = 0
        while done < n:
            if self._pending[table] == self.flush_every:
                self.flush()
            start = self._pending[table]
            take = min(n - done, self.flush_every - start)
            for name, buffer, _ in columns:
                buffer[start:start + take] = arrays[name][done:done + take]
            self._pending[table] = start + take
            done += take

    def flush(self) -> None:
        """Append every buffered row to the file; they survive the process being killed."""
        self._require_open()
        blocks = [(table, n) for table, n in self._pending.items() if n]
        if not blocks:
            return
        for table, n in blocks:
            start = self._committed[table]
            for (_, buffer, shape), dataset in zip(self._columns[table], self._datasets[table]):
                dataset.set_extent((start + n, *shape))
                file_space = dataset.get_space()
                file_space.select_hyperslab((start,) + (0,) * len(shape), (n, *shape))
                dataset.write(self._memory_space(n, shape), file_space, buffer[:n])
        self._file.flush()
        for table, n in blocks:
            self._committed[table] += n
            self._pending[table] = 0
            self._row_counters[table].write(h5s.ALL, h5s.ALL, np.array(self._committed[table], np.int64))
        self._file.flush()

    def _memory_space(self, n: int, shape: tuple[int, ...]) -> h5s.SpaceID:
        key = (n, shape)
        space = self._memory_spaces.get(key)
        if space is None:
            space = self._memory_spaces[key] = h5s.create_simple((n, *shape))
        return space

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
        return {table: self._committed[table] + self._pending[table] for table in self._pending}

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
        final = {**self._pending_attrs, "complete": status == "complete", "status": status,
                 "end_time": _now()}
        _rewrite_attrs(self.path, final)

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
    self = TraceWriter.__new__(TraceWriter)
    self._setup(path, raw.specs, flush_every=100)
    self._create({name: value for name, value in raw.attrs.items() if name not in END_ATTRS},
                 initial_rows=raw.arrays)
    self._pending_attrs.update({"last_iteration": last, "repaired": _now()})
    if error:
        self._pending_attrs["error"] = error
    elif "error" in raw.attrs:
        self._pending_attrs["error"] = raw.attrs["error"]
    self.close(new_status)
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


def _create_column(group: h5py.Group, name: str, dtype: np.dtype, shape: tuple[int, ...],
                   flush_every: int, initial: np.ndarray | None) -> h5py.Dataset:
    row_bytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    chunk_rows = max(1, min(flush_every, _CHUNK_BYTES_MAX // row_bytes))
    rows = 0 if initial is None else len(initial)
    dataset = group.create_dataset(name, shape=(rows, *shape), maxshape=(None, *shape), dtype=dtype,
                                   chunks=(chunk_rows, *shape), shuffle=dtype.itemsize > 1,
                                   **_COMPRESSION)
    if rows:
        dataset[...] = initial
    return dataset


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


def _rewrite_attrs(path: Path, attrs: dict[str, Any]) -> None:
    """Set root attributes of a closed trace through a copy that atomically replaces it."""
    temp = _temp_path(path)
    try:
        shutil.copyfile(path, temp)
        with h5py.File(temp, "r+", libver=_LIBVER) as h5file:
            write_attrs(h5file, attrs)
        with open(temp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _hdf5_reason(exc: OSError) -> str:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "lock" in reason:
        reason += " (on file systems without locking, set HDF5_USE_FILE_LOCKING=FALSE)"
    return reason
