"""Checkpoints: one file written atomically by rank 0, refused when the run does not match.

The file holds rank 0's state (model, policy, codec RNG counters, error-feedback memory,
clocks, iteration), every worker's (data order and position, codec counters, memories) and
every other server's (its shard's codec counters and memories).
It is written to a temporary file in the same directory, fsynced, then renamed over the old
one: a crash while writing leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError

FORMAT = 1
# Options that may differ between the run that wrote a checkpoint and the one resuming it.
MAY_CHANGE = {"iterations", "trace_flush", "eval_every", "eval_samples", "progress_every",
              "checksum_every", "timeout", "walltime", "resume", "force", "threads", "device",
              "checkpoint", "trace", "data_dir"}


def identity(config: dict[str, Any], world_size: int) -> dict[str, Any]:
    kept = {k: v for k, v in config.items() if k not in MAY_CHANGE}
    return {"config": kept, "world_size": world_size}


def save(path: Path, ident: dict[str, Any], server: dict, workers: list[dict], servers: list[dict] = ()) -> None:
    """Write rank 0's state, each worker's and each shard server's (ranks 1..S-1)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save({"format": FORMAT, "identity": ident, "server": server, "workers": workers,
                        "servers": list(servers)}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: Path, ident: dict[str, Any]) -> dict:
    """Read a checkpoint and check that it belongs to this run; UsageError otherwise."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise UsageError(f"--resume: checkpoint {path} is unreadable ({type(exc).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"--resume: {path} is not an mpigrad checkpoint of format {FORMAT}")
    saved = state["identity"]
    if saved["world_size"] != ident["world_size"]:
        raise UsageError(f"--resume: checkpoint {path} was written by {saved['world_size']} ranks, "
                         f"this run has {ident['world_size']}")
    differing = sorted(k for k in set(saved["config"]) | set(ident["config"])
                       if saved["config"].get(k) != ident["config"].get(k))
    if differing:
        detail = ", ".join(f"{k}: {saved['config'].get(k)!r} -> {ident['config'].get(k)!r}" for k in differing)
        raise UsageError(f"--resume: checkpoint {path} is from a different configuration ({detail})")
    return state
