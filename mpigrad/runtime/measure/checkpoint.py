"""Checkpoints: written atomically by rank 0, the last two kept, refused when the run does not match.

A checkpoint holds rank 0's state (model, policy, codec RNG counters, error-feedback memory,
clocks, iteration, traffic so far), every worker's (data order and position, codec
counters, memories) and every other server's (its shard's codec counters and memories).
``save`` writes it to a temporary file in the same folder, fsyncs it, moves the previous
checkpoint to ``PATH.prev`` and renames the new one to ``PATH``: a crash at any moment
leaves at least one whole checkpoint. The file starts with a magic, the payload's
length and its CRC-32, so a truncated or damaged file is recognised before torch reads it;
``load`` then falls back to ``PATH.prev`` with a one-line warning.
"""

from __future__ import annotations

import io
import os
import struct
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

from ...config import normal_shard_chunk
from ...errors import UsageError

FORMAT = 2
_MAGIC = b"MPIGRADC"
_HEAD = struct.Struct("<8sHQI")  # magic, format, payload length, payload CRC-32
# Options that may differ between the run that wrote a checkpoint and the one resuming it.
MAY_CHANGE = {"iterations", "trace_flush", "eval_every", "eval_samples", "progress_every",
              "checksum_every", "norm_every", "timeout", "walltime", "resume", "force", "threads", "device",
              "checkpoint", "checkpoint_every", "trace", "data_dir"}


class DamagedCheckpoint(ValueError):
    """A checkpoint file that is truncated, corrupted or not a checkpoint at all."""


#: Options added since checkpoints were first written, left out of the identity at these
#: values (their default, the behaviour before they existed): a checkpoint written before an
#: option existed is resumed by a run that leaves it unset.
#: (cost_model "none" is the clock of the configs written before --cost-model existed, control
#: "paper" the protocol of those written before --control.)
ADDED_AT_DEFAULT = {"link_bandwidth": {}, "cost_model": "none", "control": "paper",
                    # the recipe's keys: the paper's plain SGD at a constant rate, in float32,
                    # the l2 term in the loss, no augmentation (mpigrad/optim.py, data/augment.py)
                    "optimizer": "sgd", "optimizer_opts": {}, "lr_schedule": None, "lr_schedule_opts": {},
                    "lr_warmup": 0, "lr_scaling": "none", "weight_decay_in": "loss", "augment": "none",
                    "augment_opts": {}, "autocast": "none", "momentum_correction": 0.0,
                    # nodes (issue 62): a worker per node, the flat exchange (the identity is
                    # taken after the launch resolved ``auto``), its defaults inside a node
                    "ranks_per_node": 1, "exchange": "flat", "intra_codec": "fp32", "intra_bandwidth": 10e9,
                    "intra_latency": 5e-6}


def identity(config: dict[str, Any], world_size: int) -> dict[str, Any]:
    kept = {k: v for k, v in normal_shard_chunk(config).items()
            if k not in MAY_CHANGE and not (k in ADDED_AT_DEFAULT and v == ADDED_AT_DEFAULT[k])}
    return {"config": kept, "world_size": world_size}


def previous_path(path: Path) -> Path:
    """Where the checkpoint before the newest one is kept."""
    path = Path(path)
    return path.with_name(path.name + ".prev")


def paths(path: Path) -> tuple[Path, Path]:
    """The newest and the previous checkpoint's paths, newest first."""
    return Path(path), previous_path(path)


def exists(path: Path) -> bool:
    return any(p.exists() for p in paths(path))


def remove(path: Path) -> None:
    """Delete both checkpoints (a finished run has nothing to resume)."""
    for p in paths(path):
        p.unlink(missing_ok=True)


def contents(ident: dict[str, Any], server: dict, workers: list[dict], servers: list[dict] = ()) -> dict:
    """A checkpoint's contents: the run's identity, rank 0's state, each worker's and each
    shard server's (ranks 1..S-1). ``save`` writes them; a script's run
    (:class:`mpigrad.Session`) gives them to the script, which saves them with its own."""
    return {"format": FORMAT, "identity": ident, "server": server, "workers": workers, "servers": list(servers)}


def check(state: Any, ident: dict[str, Any], source: str) -> dict:
    """``state`` (checkpoint contents from ``source``, e.g. a script's file) checked to be
    a checkpoint of this run; UsageError (one line) otherwise."""
    if not isinstance(state, dict) or state.get("format") != FORMAT or "identity" not in state:
        raise UsageError(f"resume: {source} is not the state of an mpigrad run (Session.state_dict()) of this "
                         f"mpigrad (format {FORMAT})")
    _check_identity(source, state["identity"], ident)
    return state


def save(path: Path, ident: dict[str, Any], server: dict, workers: list[dict],
         servers: list[dict] = ()) -> int:
    """Write rank 0's state, each worker's and each shard server's (ranks 1..S-1), keeping
    the checkpoint it replaces as ``PATH.prev``; return its size in bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(bytes(_HEAD.size))  # filled in once the payload's length and CRC are known
            payload = _CrcWriter(handle)
            torch.save(contents(ident, server, workers, servers), payload)
            handle.seek(0)
            handle.write(_HEAD.pack(_MAGIC, FORMAT, payload.length, payload.crc))
            handle.flush()
            os.fsync(handle.fileno())
        if path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return _HEAD.size + payload.length


class _CrcWriter:
    """A write-only stream that passes bytes on and keeps their count and CRC-32."""

    def __init__(self, handle):
        self.handle, self.length, self.crc = handle, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.length += len(memoryview(data))
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _fsync_folder(folder: Path) -> None:
    """Make the renames durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read(path: Path) -> dict:
    """The checkpoint's contents; DamagedCheckpoint when its header, length or CRC is wrong."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(_HEAD.size)
            if len(head) < _HEAD.size:
                raise DamagedCheckpoint(f"{len(head)} bytes, shorter than a checkpoint header")
            magic, version, length, crc = _HEAD.unpack(head)
            if magic != _MAGIC:
                raise DamagedCheckpoint("not an mpigrad checkpoint")
            if version != FORMAT:
                raise DamagedCheckpoint(f"checkpoint format {version}, this mpigrad reads {FORMAT}")
            data = handle.read(length + 1)
    except OSError as exc:
        raise DamagedCheckpoint(exc.strerror or type(exc).__name__) from None
    if len(data) != length:
        raise DamagedCheckpoint(f"payload of {len(data)} bytes, the header says {length} (truncated?)")
    if zlib.crc32(data) != crc:
        raise DamagedCheckpoint("payload CRC-32 mismatch (corrupted)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a CRC-clean payload torch cannot read is damaged too
        raise DamagedCheckpoint(f"unreadable payload ({type(exc).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise DamagedCheckpoint("not an mpigrad checkpoint payload")
    return state


def load(path: Path, ident: dict[str, Any], warn: Callable[[str], None] = lambda line: None
         ) -> tuple[dict, Path]:
    """The newest whole checkpoint (``PATH``, else ``PATH.prev``) and its path, checked to
    belong to this run; ``warn`` gets one line when a damaged newest one is skipped.
    UsageError when there is none, or when it is from another configuration or world size."""
    skipped = []
    for candidate in paths(path):
        if not candidate.exists():
            continue
        try:
            state = read(candidate)
        except DamagedCheckpoint as exc:
            skipped.append(f"{candidate} is damaged ({exc})")
            continue
        _check_identity(candidate, state["identity"], ident)
        if skipped:
            warn(f"mpigrad: warning: {skipped[0]}; resuming from the older {candidate}")
        return state, candidate
    if skipped:
        raise UsageError(f"--resume: no usable checkpoint: {'; '.join(skipped)}")
    raise UsageError(f"--resume: no checkpoint at {path}")


def _check_identity(path: Path | str, saved: dict[str, Any], ident: dict[str, Any]) -> None:
    if saved["world_size"] != ident["world_size"]:
        raise UsageError(f"--resume: checkpoint {path} was written by {saved['world_size']} ranks, "
                         f"this run has {ident['world_size']}")
    differing = sorted(k for k in set(saved["config"]) | set(ident["config"])
                       if saved["config"].get(k) != ident["config"].get(k))
    if differing:
        detail = ", ".join(f"{k}: {saved['config'].get(k)!r} -> {ident['config'].get(k)!r}" for k in differing)
        raise UsageError(f"--resume: checkpoint {path} is from a different configuration ({detail})")


class Schedule:
    """When rank 0 writes a periodic checkpoint: every N iterations, or once ``S`` seconds
    of wall time have passed since the last one (``--checkpoint-every``)."""

    def __init__(self, interval: tuple[str, float] | None, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self.last = clock()

    def due(self, done: int) -> bool:
        """True when a checkpoint is due after ``done`` iterations."""
        if self.interval is None:
            return False
        kind, value = self.interval
        if kind == "iterations":
            return done % int(value) == 0
        return self.clock() - self.last >= value

    def written(self) -> None:
        self.last = self.clock()
