"""The one channel interface every rank talks through, and the waiting rules it keeps.

Two layouts (``--servers``). Separate servers: ranks 0..S-1 are servers (rank 0 also
scheduler and MDP server), ranks S..S+P-1 workers. Colocated servers: rank 0 is scheduler
and MDP server only, ranks 1..P workers, and worker rank s + 1 also serves shard s (S = P).
Broadcast groups: ``WORLD`` (every rank, root 0) carries the control message; group ``s``
(server s, rank 0, and the workers; root server s) carries shard s's averaged gradient.
Colocated servers send their shard's average point to point instead (tag BCAST: a
worker's link then carries one copy per other worker, as a star, where MPI's broadcast
algorithms for long messages relay pieces through the members).

Two implementations: :class:`~mpigrad.runtime.wire.mpi.MpiChannel` (nonblocking buffer
calls on preallocated arrays, the hot path) and
:class:`~mpigrad.runtime.wire.loopback.LoopbackNetwork` (every rank an object in one
process, for protocol unit tests in milliseconds). Every wait has a timeout whose message
names the silent rank(s); waits sleep-poll with back-off instead of spinning a core, unless
every rank of the node has a core of its own (``--wait``, :func:`set_waiting`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator

import numpy as np

WORLD = "world"

_FIRST_SLEEP = 50e-6
#: The back-off's cap. MPICH's TCP transport moves data only inside MPI calls, so a rank
#: asleep holds up a transfer in flight (a rendezvous handshake, a socket buffer to refill):
#: in the network lab a 2 ms cap added about 30 ms to a 36 ms iteration (P = 2, colocated,
#: 2 bits, 100 MB/s); 0.5 ms keeps that gain and cost 2 % of wall time with 9 ranks on 2 cores
#: (0.2 ms: 10 %).
_MAX_SLEEP = 5e-4


class PeerTimeout(RuntimeError):
    """A peer did not answer within the run's --timeout."""


class PeerFailed(RuntimeError):
    """Rank 0 received a peer's error report (message 8): the message names the rank."""


#: Whether waits poll without sleeping (``set_waiting``): where every rank of the node has
#: a core of its own, a sleeping rank only adds its wake-up to every message's latency.
_spin = False


def set_waiting(spin: bool) -> None:
    """This process's waits from now on: poll without sleeping (``spin``) or sleep-poll with
    back-off (where ranks outnumber cores: a spinning rank takes the core a computing rank needs)."""
    global _spin
    _spin = bool(spin)


def waiting_spins() -> bool:
    return _spin


class Backoff:
    """Between polls: sleep 50 us doubling to 0.5 ms, or nothing when waits spin
    (:func:`set_waiting`); PeerTimeout past the deadline either way."""

    def __init__(self, timeout: float, describe: Callable[[], str]):
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.describe = describe
        self.delay = _FIRST_SLEEP

    def sleep(self) -> None:
        if time.monotonic() > self.deadline:
            raise PeerTimeout(f"{self.describe()} within {self.timeout:g} s")
        if _spin:
            return
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, _MAX_SLEEP)


def worker_ranks(servers: int, size: int, colocated: bool = False) -> list[int]:
    """The workers' ranks: 1..size-1 when colocated, else S..size-1."""
    return list(range(1 if colocated else servers, size))


def server_ranks(servers: int, size: int, colocated: bool = False) -> list[int]:
    """The rank serving each shard s: worker rank s + 1 when colocated, else rank s."""
    return worker_ranks(servers, size, colocated) if colocated else list(range(servers))


def group_members(group, servers: int, size: int, colocated: bool = False) -> list[int]:
    """Ranks of a broadcast group, root first."""
    if group == WORLD:
        return list(range(size))
    if colocated:
        raise ValueError("colocated servers broadcast their shards point to point, not in groups")
    workers = worker_ranks(servers, size)
    if servers == 1:
        return [0, *workers]
    return [group, *([0] if group else []), *workers]


class ReceiveBuffers:
    """Byte buffers that variable-size messages are received into, by key (a source rank, a
    bucket's), each reused and replaced by a larger one when a message does not fit.

    ``memory`` decides where a buffer lives and when the host may write it again: None for
    plain NumPy memory; on the device path the replica's pinned host memory, which a
    decode copies to the device straight from, with no host copy (runtime/exchange/device.py
    ``FrameMemory``: ``allocate(size, key)``, and ``before_write(key)``, which waits until
    no copy out of the buffer is still queued)."""

    def __init__(self, keys=(), memory=None):
        self.memory = memory
        self._buffers: dict = {}
        for key in keys:
            self.take(key, 0)

    def take(self, key, size: int) -> np.ndarray:
        """The first ``size`` bytes of ``key``'s buffer (grown as needed), free to be written now."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.size < size:
            buffer = self._buffers[key] = (np.empty(size, np.uint8) if self.memory is None
                                           else self.memory.allocate(size, (id(self), key)))
        elif self.memory is not None:
            self.memory.before_write((id(self), key))
        return buffer[:size]

    def __getitem__(self, key) -> np.ndarray:
        """``key``'s whole buffer, as last taken."""
        return self._buffers[key]


class Channel(ABC):
    """One rank's end of the run's communication. ``timeout`` bounds every wait.
    ``servers`` is the number of shards S; ``colocated`` whether workers serve them."""

    rank: int
    size: int
    servers: int
    timeout: float
    colocated: bool = False
    #: CPU seconds spent polling while waiting (the MPI channel counts them; loopback: 0).
    wait_cpu_seconds: float = 0.0

    @property
    def workers(self) -> list[int]:
        return worker_ranks(self.servers, self.size, self.colocated)

    @property
    def server_ranks(self) -> list[int]:
        return server_ranks(self.servers, self.size, self.colocated)

    @property
    def is_worker(self) -> bool:
        return self.role_of(self.rank) == "worker"

    def role_of(self, rank: int) -> str:
        """What a rank is called in messages: "worker" (colocated ones too) or "server"."""
        return "worker" if rank != 0 and (self.colocated or rank >= self.servers) else "server"

    def members(self, group) -> list[int]:
        return group_members(group, self.servers, self.size, self.colocated)

    # ---- hot path: preallocated buffers -------------------------------------------------
    @abstractmethod
    def send(self, items: list[tuple[np.ndarray, int]], tag: int, describe: Callable[[list[int]], str]) -> None:
        """Send each ``(buffer, destination)``; return when every send completed.
        ``describe`` gets the destinations still pending on timeout."""

    @abstractmethod
    def start_send(self, items: list[tuple[np.ndarray, int]], tag: int) -> Any:
        """Post a send of each ``(buffer, destination)`` and return at once; the buffers must
        not change until :meth:`finish_send` with what this returned has returned."""

    @abstractmethod
    def finish_send(self, pending: Any, describe: Callable[[list[int]], str]) -> None:
        """Wait until the sends ``start_send`` posted completed (``describe`` as for send)."""

    @abstractmethod
    def start_recv(self, items: list[tuple[np.ndarray, int]], tag: int) -> Any:
        """Post a receive of one message of at most ``buffer.size`` bytes from each ``(buffer,
        source)`` and return at once. Receives from one source with one tag take its messages
        in the order both were posted (MPI's non-overtaking rule)."""

    @abstractmethod
    def received(self, pending: Any, index: int) -> int | None:
        """The byte count of the ``index``-th message :meth:`start_recv` posted, once it is in
        its buffer; None while it is not (a test that also moves transfers along)."""

    @abstractmethod
    def test_send(self, pending: Any) -> bool:
        """Whether the sends ``start_send`` posted have completed (moves them along); they
        must still be finished with :meth:`finish_send`."""

    @abstractmethod
    def recv(self, items: list[tuple[np.ndarray, int]], tag: int, describe: Callable[[list[int]], str]) -> None:
        """Receive fixed-size messages into each ``(buffer, source)``."""

    @abstractmethod
    def frames(self, sources: list[int], tag: int, buffers: ReceiveBuffers,
               describe: Callable[[list[int]], str]) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(source, view)`` for one variable-size message from each source, in
        arrival order, received into ``buffers.take(source, size)``; a view stays valid
        until the next call for that source."""

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
