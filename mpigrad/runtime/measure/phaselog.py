"""A diagnostic log of when each rank ends each phase of each iteration, for
``mpigrad bench clock``'s per-phase comparison (not a trace: every rank writes its own file).

``MPIGRAD_PHASE_LOG=DIR`` makes rank r append one JSON line per iteration to
``DIR/rank-r.jsonl``: ``{"m": iteration, "rank": r, "t": {phase: perf_counter at its end}}``,
the phases of :mod:`.iteration` (``begin`` ... ``end``) and ``start``, when the iteration
began; rank 0 adds ``"sim"``, what the clock charged each communication phase (seconds).
``time.perf_counter`` is the host's monotonic clock, so the ranks' times compare only where
they share a host, as in the network lab. A rank whose model is on a GPU adds ``"d"``: per
phase, the milliseconds between the CUDA events recorded on the current stream at the end of
the phase before and at its end (the device's timeline; the line is written after the last
event completes). A rank on the device path adds ``"c"``: per phase that asked anything of
the device, ``{"launches", "syncs", "to_device", "to_host", "sites"}`` (its kernel launches,
host synchronisations, bytes copied each way and where: :mod:`mpigrad.counters`).
Unset, it costs one dictionary lookup at start-up. Read by ``mpigrad bench clock``, ``mpigrad
bench device`` and ``mpigrad bench peers --breakdown``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

ENV = "MPIGRAD_PHASE_LOG"


class PhaseLog:
    """One rank's log; ``record`` after each phase, ``flush`` after each iteration."""

    def __init__(self, path: Path, rank: int, device=None):
        self.rank = rank
        self.file = path.open("a", buffering=1)
        self.times: dict[str, float] = {}
        #: torch.cuda with a model on a GPU (device-side times), else None.
        self.cuda = None
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch
            self.cuda = torch.cuda
        self.events: list[tuple[str, object]] = []
        from ...counters import snapshot
        self._counts = snapshot
        self._last = snapshot()
        self.counts: dict[str, dict] = {}

    @classmethod
    def from_environment(cls, rank: int, device=None) -> "PhaseLog | None":
        """The log ``MPIGRAD_PHASE_LOG`` asks for, else None; ``device``: the rank's torch
        device (a GPU adds device-side times)."""
        directory = os.environ.get(ENV)
        if not directory:
            return None
        Path(directory).mkdir(parents=True, exist_ok=True)
        return cls(Path(directory) / f"rank-{rank}.jsonl", rank, device)

    def record(self, phase: str) -> None:
        self.times[phase] = time.perf_counter()
        now = self._counts()
        spent, self._last = now - self._last, now
        if spent.sites or spent.bytes_to_device or spent.bytes_to_host:
            self.counts[phase] = {"launches": spent.launches, "syncs": spent.synchronizations,
                                  "to_device": spent.bytes_to_device, "to_host": spent.bytes_to_host,
                                  "sites": dict(spent.sites)}
        if self.cuda is not None:
            event = self.cuda.Event(enable_timing=True)
            event.record()
            self.events.append((phase, event))

    def flush(self, m: int, sim: dict | None = None) -> None:
        line = {"m": m, "rank": self.rank, "t": self.times}
        if sim is not None:
            line["sim"] = sim
        if self.counts:
            line["c"], self.counts = self.counts, {}
        if self.events:
            self.events[-1][1].synchronize()
            line["d"] = {phase: before.elapsed_time(event)
                         for (_, before), (phase, event) in zip(self.events, self.events[1:])}
            self.events = []
        self.file.write(json.dumps(line) + "\n")
        self.times = {}


def read(directory: Path) -> dict[int, dict[int, dict]]:
    """Every rank's lines: ``{iteration: {rank: line}}``."""
    lines: dict[int, dict[int, dict]] = {}
    for path in sorted(Path(directory).glob("rank-*.jsonl")):
        for text in path.read_text().splitlines():
            line = json.loads(text)
            lines.setdefault(line["m"], {})[line["rank"]] = line
    return lines
