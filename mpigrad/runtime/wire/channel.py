"""The one channel interface every rank talks through, and the waiting rules it keeps.

Ranks 0..S-1 are servers (rank 0 also scheduler and MDP server), ranks S..S+P-1 workers.
Broadcast groups: ``WORLD`` (every rank, root 0) carries the control message; group ``s``
(server s, rank 0, and the workers; root server s) carries shard s's averaged gradient.

Two implementations: :class:`~mpigrad.runtime.wire.mpi.MpiChannel` (nonblocking buffer
calls on preallocated arrays, the hot path) and
:class:`~mpigrad.runtime.wire.loopback.LoopbackNetwork` (every rank an object in one
process, for protocol unit tests in milliseconds). Every wait has a timeout whose message
names the silent rank(s); waits sleep-poll with back-off instead of spinning a core.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator

import numpy as np

WORLD = "world"

_FIRST_SLEEP = 50e-6
_MAX_SLEEP = 2e-3


class PeerTimeout(RuntimeError):
    """A peer did not answer within the run's --timeout."""


class PeerFailed(RuntimeError):
    """Rank 0 received a peer's error report (message 8): the message names the rank."""


class Backoff:
    """Sleep between polls, 50 us doubling to 2 ms; PeerTimeout past the deadline."""

    def __init__(self, timeout: float, describe: Callable[[], str]):
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.describe = describe
        self.delay = _FIRST_SLEEP

    def sleep(self) -> None:
        if time.monotonic() > self.deadline:
            raise PeerTimeout(f"{self.describe()} within {self.timeout:g} s")
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, _MAX_SLEEP)


def group_members(group, servers: int, size: int) -> list[int]:
    """Ranks of a broadcast group, root first."""
    if group == WORLD:
        return list(range(size))
    workers = list(range(servers, size))
    if servers == 1:
        return [0, *workers]
    return [group, *([0] if group else []), *workers]


class Channel(ABC):
    """One rank's end of the run's communication. ``timeout`` bounds every wait."""

    rank: int
    size: int
    servers: int
    timeout: float

    @property
    def workers(self) -> list[int]:
        return list(range(self.servers, self.size))

    def members(self, group) -> list[int]:
        return group_members(group, self.servers, self.size)

    # ---- hot path: preallocated buffers -------------------------------------------------
    @abstractmethod
    def send(self, items: list[tuple[np.ndarray, int]], tag: int, describe: Callable[[list[int]], str]) -> None:
        """Send each ``(buffer, destination)``; return when every send completed.
        ``describe`` gets the destinations still pending on timeout."""

    @abstractmethod
    def recv(self, items: list[tuple[np.ndarray, int]], tag: int, describe: Callable[[list[int]], str]) -> None:
        """Receive fixed-size messages into each ``(buffer, source)``."""

    @abstractmethod
    def frames(self, sources: list[int], tag: int, buffers: dict[int, np.ndarray],
               describe: Callable[[list[int]], str]) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(source, view)`` for one variable-size message from each source, in
        arrival order. ``buffers[source]`` is reused and replaced by a larger one when a
        message does not fit; a view stays valid until the next call for that source."""

    @abstractmethod
    def broadcast(self, items: list[tuple[np.ndarray, Any]], describe: Callable[[], str]) -> None:
        """Take part in the broadcast of each ``(buffer, group)`` (all posted, then all
        awaited): the group's root sends its buffer, members receive into theirs."""

    @abstractmethod
    def has_message(self, source: int, tag: int) -> bool:
        """Whether a message from ``source`` with ``tag`` has arrived and waits to be received
        (for diagnosis: which peers went on while a broadcast stalled)."""

    def report_error(self, iteration: int, text: str) -> None:
        """A worker or shard server that cannot go on tells rank 0 (message 8), then waits up
        to ``timeout`` for rank 0 to record it and end the run; returns if rank 0 does not.
        In-process ranks (loopback) share the exception instead: nothing to send."""

    # ---- set-up and checkpoint plane: pickled objects, rank 0 as root ----------------------
    @abstractmethod
    def gather_object(self, obj: Any, what: str = "set-up data") -> list[Any] | None:
        """Rank 0 gets every rank's ``obj`` (a list by rank), the others None; ``what`` names
        the data in a timeout's message (e.g. "checkpoint state after iteration 80")."""

    @abstractmethod
    def scatter_object(self, objs: list[Any] | None) -> Any: ...

    @abstractmethod
    def bcast_object(self, obj: Any) -> Any: ...
