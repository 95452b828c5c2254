"""Fault injection for testing failure handling with real MPI runs.

``MPIGRAD_INJECT_FAULT=KIND:RANK:ITERATION`` makes worker RANK misbehave at ITERATION:
``raise`` (an exception), ``hang`` (stop answering), ``exit`` (die without MPI_Abort),
``nan-loss`` (a non-finite loss), ``nan-grad`` (a non-finite gradient) or ``diverge``
(nudge its first parameter after the update: its replica checksum no longer matches). A
shard server (rank 1..S-1 with ``--servers S``) takes ``raise``, ``hang`` and ``exit``, just
before it reports to rank 0. Unset, it costs one dictionary lookup at start-up.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

KINDS = ("raise", "hang", "exit", "nan-loss", "nan-grad", "diverge")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    iteration: int

    @classmethod
    def from_environment(cls, rank: int) -> "Fault | None":
        spec = os.environ.get("MPIGRAD_INJECT_FAULT")
        if not spec:
            return None
        try:
            kind, fault_rank, iteration = spec.split(":")
            fault = cls(kind, int(fault_rank), int(iteration))
        except ValueError:
            raise ValueError(f"MPIGRAD_INJECT_FAULT must be KIND:RANK:ITERATION, got {spec!r}") from None
        if fault.kind not in KINDS:
            raise ValueError(f"MPIGRAD_INJECT_FAULT kind must be one of {', '.join(KINDS)}")
        return fault if fault.rank == rank else None

    def before_send(self, iteration: int, loss: float, grad) -> float:
        """Apply the fault at its iteration; return the (possibly poisoned) loss."""
        if iteration != self.iteration:
            return loss
        if self.kind == "raise":
            raise RuntimeError(f"injected fault at iteration {iteration}")
        if self.kind == "hang":
            while True:
                time.sleep(1.0)
        if self.kind == "exit":
            os._exit(3)
        if self.kind == "nan-loss":
            return float("nan")
        if self.kind == "nan-grad":
            grad[0] = float("nan")
        return loss

    def after_update(self, iteration: int, params) -> None:
        """``diverge``: add 1e-3 to the first parameter (a torch tensor) after the update."""
        if iteration == self.iteration and self.kind == "diverge":
            params.view(-1)[0] += 1e-3
