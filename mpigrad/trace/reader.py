"""Reading traces: ``load(path) -> Trace`` with pandas DataFrames, and ``read_raw`` (numpy only).

A file is opened normally first, so HDF5 checks it fully (a truncated file is caught there);
a file still marked as being written (a live writer, or one that was killed) is then
opened in SWMR-read mode. Only the committed rows of each table are read.

A damaged file (bytes overwritten anywhere) is a ``TraceError`` of one line, never an h5py
exception: whatever h5py raises while the file is read (``OSError``, ``RuntimeError``,
``KeyError``, ``ValueError``, ``TypeError``) is turned into one, and the file's global heap
collections (its text attributes) are checked before any is read, since HDF5 loops forever
on some damaged ones (``_check_global_heaps``). A block that HDF5 never reads (free space)
can be damaged without effect: such a file reads as it was written.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np

from .attrs import read_attrs
from .network import text
from .schema import (FORMAT_NAME, ROWS_DATASET, SCHEMA_VERSION, TABLE_NAMES, TraceError, column_spec,
                     flat_names)

__all__ = ["Trace", "load", "read_raw", "root_attrs", "method_label"]

_TABLE_ORDER = {name: k for k, name in enumerate(TABLE_NAMES)}  # standard tables first


class RawTrace(NamedTuple):
    path: Path
    schema_version: int
    attrs: dict[str, Any]
    specs: dict[str, dict[str, tuple[np.dtype, tuple[int, ...]]]]
    arrays: dict[str, dict[str, np.ndarray]]


def read_raw(path: str | os.PathLike) -> RawTrace:
    """Attributes, table specs and committed rows (numpy arrays of shape (rows, *shape))."""
    path = Path(path)
    h5file = _open(path)
    try:
        with h5file:
            return _read_open(path, h5file)
    except TraceError:
        raise
    except H5PY_ERRORS as exc:  # what h5py raises on a damaged file (closing it included)
        raise TraceError(f"{path}: truncated or damaged trace ({_first_line(exc)})") from None


#: What h5py raises while it reads a damaged file: OSError and KeyError (an object that cannot
#: be opened), RuntimeError (an attribute or link that cannot be looked up), ValueError and
#: TypeError (undecodable contents, a dataspace or type that makes no sense).
H5PY_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)


def _read_open(path: Path, h5file: h5py.File) -> RawTrace:
    """``read_raw`` of the open ``h5file``."""
    _check_global_heaps(path, h5file)
    try:
        attrs = read_attrs(h5file)
    except H5PY_ERRORS as exc:  # undecodable JSON or an unreadable attribute
        raise TraceError(f"{path}: damaged trace attributes ({_first_line(exc)})") from None
    if attrs.get("format") != FORMAT_NAME:
        raise TraceError(f"{path} is an HDF5 file but not an mpigrad trace "
                         f"(no format={FORMAT_NAME!r} root attribute)")
    version = attrs.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise TraceError(f"{path}: damaged trace (bad schema_version {version!r})")
    if version > SCHEMA_VERSION:
        raise TraceError(f"{path} has trace schema version {version}, newer than this "
                         f"mpigrad reads ({SCHEMA_VERSION}); upgrade mpigrad")
    specs, arrays = {}, {}
    names = sorted(h5file, key=lambda name: (_TABLE_ORDER.get(name, len(_TABLE_ORDER)), name))
    for table in names:
        group = h5file[table]
        if isinstance(group, h5py.Group) and "columns" in group.attrs:
            specs[table], arrays[table] = _read_table(path, table, group)
    return RawTrace(path, version, attrs, specs, arrays)


#: The start of an HDF5 global heap collection: signature "GCOL", version 1, 3 reserved bytes.
_GLOBAL_HEAP_START = b"GCOL\x01\x00\x00\x00"


def _check_global_heaps(path: Path, h5file: h5py.File) -> None:
    """TraceError where one of the file's global heap collections (HDF5 keeps variable-length
    strings there: the trace's text attributes) is damaged: a collection that does not fit in
    the file, or an object whose size does not fit in its collection. HDF5 (2.0 still) parses
    such a collection without checking them, and can loop forever over it; this walks each
    collection as HDF5 does (HDF5 file format, "Global Heap"), reading nothing else."""
    length_bytes = h5file.id.get_create_plist().get_sizes()[1]  # HDF5's "size of lengths"
    align = lambda size: -(-size // 8) * 8  # noqa: E731  (objects are aligned to 8 bytes)
    header, object_header = align(len(_GLOBAL_HEAP_START) + length_bytes), 8 + length_bytes
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = data.find(_GLOBAL_HEAP_START)
        while start >= 0:
            size = int.from_bytes(data[start + 8:start + 8 + length_bytes], "little")
            end = start + size
            if size < header or end > len(data):
                raise TraceError(f"{path}: damaged trace (a global heap at byte {start} claims {size} bytes)")
            at = start + header
            while at + object_header <= end:  # a smaller rest is free space
                index = int.from_bytes(data[at:at + 2], "little")
                stored = int.from_bytes(data[at + 8:at + 8 + length_bytes], "little")
                step = object_header + align(stored) if index else stored  # object 0: the free space, whole
                if step == 0 or at + step > end:
                    raise TraceError(f"{path}: damaged trace (global heap object at byte {at} claims {stored} bytes)")
                at += step
            start = data.find(_GLOBAL_HEAP_START, start + 1)


def root_attrs(path: str | os.PathLike) -> dict[str, Any]:
    """The root attributes of the trace at ``path`` (``attrs.read_attrs``), without reading its
    tables; TraceError (one line) where it cannot be opened as a trace."""
    with _open(Path(path)) as f:
        return read_attrs(f)


def writer_mark(path: str | os.PathLike) -> bool:
    """True when HDF5 marks the file as open for writing (a live writer, or a dead one's
    leftover) so that plain ``h5py.File(path, "r")`` refuses it."""
    try:
        h5py.File(path, "r").close()
    except OSError as exc:
        return "already open for write" in _first_line(exc)
    return False


def _open(path: Path) -> h5py.File:
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    if path.is_dir():
        raise TraceError(f"{path} is a directory, not a trace file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        reason = _first_line(exc)
    if "already open for write" in reason:  # a live writer, or one that was killed
        try:
            return h5py.File(path, "r", swmr=True)
        except OSError as exc:
            reason = _first_line(exc)
            if "not already open for SWMR" in reason:
                raise TraceError(f"{path} was left open by a non-SWMR writer; "
                                 f"`h5clear -s {path}` clears the mark") from None
    if "signature not found" in reason:
        raise TraceError(f"{path} is not an HDF5 file (so not an mpigrad trace)")
    if "truncated file" in reason:
        sizes = re.search(r"eof = (\d+).*stored_eof = (\d+)", reason)
        detail = f": {sizes.group(1)} of {sizes.group(2)} bytes present" if sizes else ""
        raise TraceError(f"{path} is truncated{detail} (an interrupted copy?)")
    if "lock" in reason:
        reason += " (on file systems without locking, set HDF5_USE_FILE_LOCKING=FALSE)"
    raise TraceError(f"cannot open {path}: {reason}")


def _read_table(path: Path, table: str, group: h5py.Group):
    columns = json.loads(group.attrs["columns"])
    if not isinstance(columns, dict):
        raise TraceError(f"{path}: table {table!r}: its columns attribute is not a JSON object (damaged trace)")
    try:
        specs = {name: column_spec(table, name, spec) for name, spec in columns.items()}
    except TraceError as exc:
        raise TraceError(f"{path}: {exc} (damaged trace)") from None
    rows = int(group[ROWS_DATASET][()])
    if rows < 0:
        raise TraceError(f"{path}: table {table!r} claims {rows} committed rows (damaged trace)")
    arrays = {}
    for name in specs:
        dataset = group[name]
        if dataset.shape[1:] != specs[name][1]:
            raise TraceError(f"{path}: table {table!r} column {name!r} has rows of shape {dataset.shape[1:]}, "
                             f"its spec says {specs[name][1]} (damaged trace)")
        if dataset.shape[0] < rows:
            raise TraceError(f"{path}: table {table!r} column {name!r} holds {dataset.shape[0]} "
                             f"rows, {rows} were committed (damaged trace)")
        arrays[name] = dataset[:rows]
    return specs, arrays


def _first_line(exc: BaseException) -> str:
    """The useful part of an h5py error: "Unable to ... open file (REASON)" -> REASON."""
    text = str(exc).strip()
    text = text.splitlines()[0] if text else type(exc).__name__
    match = re.fullmatch(r"Unable to (?:\w+ )?open file \((.*)\)", text)
    return match.group(1) if match else text


# ---- labels -------------------------------------------------------------------------------
_POLICY_LABELS = {"adaptive": "Adaptive", "mqgrad": "MQGrad", "accordion": "Accordion", "lgreco": "L-GreCo",
                  "aimd": "AIMD", "progress": "Progress"}
_PLAIN_CODECS = {"fp32": "FP32", "fp16": "FP16"}
_DEFAULT_CODEC = "uniform"
#: The built-in codecs whose width a policy sets (``Codec.accepts_bits``; a test holds this to
#: the registry): only their runs are labelled by a width. Any other codec's run is labelled
#: without one ("Fix [sign]", "Fix [TopK]": a reader cannot know a plugin's width, and a
#: config's ``bits`` is its unused default there); where runs differ in bits, the group
#: labels add ``bits=N``.
WIDTH_CODECS = ("qsgd", "uniform")


#: Appended to the label of a trace that ``mpigrad trace retime`` wrote (config ``retimed``).
RETIMED_MARK = " (retimed)"


def method_label(config: dict[str, Any]) -> str:
    """The paper's method label: "Fix (2-bit)", "Adaptive", "MQGrad" (plus "[codec]" when
    the codec is not the paper's uniform quantizer); ``config["label"]`` overrides; either
    ends in " (retimed)" for a re-timed trace."""
    if not isinstance(config, dict):
        return "unknown"
    mark = RETIMED_MARK if config.get("retimed") is True else ""
    if isinstance(config.get("label"), str) and config["label"]:
        return config["label"] + mark
    return _method(config) + mark


def _method(config: dict[str, Any]) -> str:
    codec = _component(config, "codec")
    policy = _component(config, "policy")
    codec_id = str(codec.get("id", _DEFAULT_CODEC))
    if codec_id in _PLAIN_CODECS:
        return _PLAIN_CODECS[codec_id]
    if codec_id == "powersgd":  # low rank: the rank is the method, and the widths when not float32
        widths = [f"{what} {codec[key]}-bit" for what, key in (("factors", "factor_bits"), ("rest", "rest_bits"))
                  if codec.get(key, 32) != 32]
        if codec.get("ranks"):  # per-layer settings a policy chooses (L-GreCo)
            menus = " ".join(f"{key} {codec[key]}" for key in ("ranks", "widths") if codec.get(key))
            widths.insert(0, menus.replace("[", "").replace("]", "").replace(", ", ","))
            label = _POLICY_LABELS.get(str(policy.get("id")), str(policy.get("id")))
            return f"PowerSGD {label} r{codec.get('rank', 1)} ({', '.join(widths)})"
        return f"PowerSGD r{codec.get('rank', 1)}" + (f" ({', '.join(widths)})" if widths else "")
    policy_id = str(policy.get("id", "fixed"))
    if policy_id == "fixed":
        bits = policy.get("bits", codec.get("bits")) if codec_id in WIDTH_CODECS else None
        label = f"Fix ({bits}-bit)" if bits is not None else "Fix"
    else:  # a plugin package.module:Class is labelled by its class name
        label = _POLICY_LABELS.get(policy_id, policy_id.rpartition(":")[2])
    # a codec plugin package.module:Class, too, by its class name
    return label if codec_id == _DEFAULT_CODEC else f"{label} [{codec_id.rpartition(':')[2]}]"


def _component(config: dict[str, Any], name: str) -> dict[str, Any]:
    """A codec or policy config, from the nested form ({"codec": {"id": ...}}) or from
    ``mpigrad train``'s flat one ("codec": "uniform", "codec_opts": {...}, "bits": 4)."""
    value = config.get(name)
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        return {}
    options = config.get(f"{name}_opts") if isinstance(config.get(f"{name}_opts"), dict) else {}
    resolved = {"id": value, **options}
    if isinstance(config.get("bits"), int):
        resolved.setdefault("bits", config["bits"])
    return resolved


# ---- the Trace object -----------------------------------------------------------------------
@dataclass(frozen=True)
class Trace:
    """A loaded trace. Tables are DataFrames with one row per record; a vector column
    ``x`` of shape (k,) appears as columns ``x_0 .. x_{k-1}`` (see ``array`` for the raw
    numpy layout). Missing tables are empty DataFrames."""

    path: Path
    schema_version: int
    config: dict[str, Any]
    attrs: dict[str, Any]
    tables: dict[str, Any]
    arrays: dict[str, dict[str, np.ndarray]] = field(repr=False)

    @property
    def steps(self):
        return self._table("steps")

    @property
    def workers(self):
        return self._table("workers")

    @property
    def servers(self):
        return self._table("servers")

    @property
    def eval(self):
        return self._table("eval")

    @property
    def policy(self):
        return self._table("policy")

    @property
    def checksums(self):
        return self._table("checksums")

    def _table(self, name: str):
        import pandas as pd

        return self.tables.get(name, pd.DataFrame())

    def array(self, table: str, column: str) -> np.ndarray:
        """A column as stored: shape (rows, *per-row shape)."""
        try:
            return self.arrays[table][column]
        except KeyError:
            raise TraceError(f"{self.path}: no column {table}/{column}") from None

    @property
    def status(self) -> str:
        """"complete", "stopped" (checkpointed, resumable), "failed" (see ``attrs["error"]``),
        "incomplete" (its writer died; closed by ``mpigrad trace repair``), or "running"
        (still running, or its writer died and the file was not repaired)."""
        return str(self.attrs.get("status", "running"))

    @property
    def complete(self) -> bool:
        return bool(self.attrs.get("complete", False))

    @property
    def label(self) -> str:
        return method_label(self.config)

    @property
    def network(self) -> str:
        """The network the run really had, in words: 'host', 'lab 10MB/s', 'lab 10MB/s until
        iteration 16, then host' (trace/network.py; 'host' for a trace that does not record it)."""

        return text(self.attrs)

    @property
    def name(self) -> str:
        return self.path.stem


def load(path: str | os.PathLike) -> Trace:
    """Read the trace at ``path``; TraceError (one line) for anything that is not a readable trace."""
    try:
        import pandas as pd
    except ImportError:
        raise TraceError("reading traces needs pandas: pip install 'mpigrad[analysis]'") from None
    raw = read_raw(path)
    tables = {}
    for table, specs in raw.specs.items():
        columns = {}
        for name, (_, shape) in specs.items():
            values = raw.arrays[table][name]
            if not shape:
                columns[name] = values
            else:
                flat = values.reshape(len(values), int(np.prod(shape)))
                for k, flat_name in enumerate(flat_names({name: specs[name]})):
                    columns[flat_name] = flat[:, k]
        tables[table] = pd.DataFrame(columns)
    config = raw.attrs.get("config")
    return Trace(raw.path, raw.schema_version, config if isinstance(config, dict) else {},
                 raw.attrs, tables, raw.arrays)

