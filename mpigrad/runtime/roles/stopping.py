"""Stop requests: SIGUSR1/SIGTERM (Slurm's walltime warning, scancel) and the --walltime deadline.

Signal handlers only set a flag; rank 0 reads it once per iteration, so every rank stops at
the same iteration boundary and the checkpoint is consistent.
"""

from __future__ import annotations

import signal
import time

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopFlag:
    def __init__(self, walltime: float | None = None, started: float | None = None):
        self.walltime = walltime
        self.started = time.monotonic() if started is None else started
        self.signal_name: str | None = None

    def install(self) -> "StopFlag":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def requested(self, mean_iteration_seconds: float = 0.0, reserve: float = 0.0) -> bool:
        """True once a stop signal arrived, or when two more iterations plus ``reserve``
        seconds (for writing the checkpoint) would pass the walltime."""
        if self.signal_name:
            return True
        if self.walltime is None:
            return False
        elapsed = time.monotonic() - self.started
        return elapsed + 2 * mean_iteration_seconds + reserve >= self.walltime

    @property
    def reason(self) -> str:
        return f"received {self.signal_name}" if self.signal_name else "walltime deadline near"
