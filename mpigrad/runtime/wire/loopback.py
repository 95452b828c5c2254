"""An in-process channel: every rank an object in one Python process, each on a thread.

Messages are copied through per-rank mailboxes, so a rank never sees another's buffers;
broadcasts are copies from the root to each member. Waits honour the same timeout and
name the same silent ranks as the MPI channel. For protocol unit tests, not for speed.
:meth:`LoopbackNetwork.abort` ends every rank's waits at once, as MPI_Abort ends a real
world's ranks (which otherwise wait out their timeout for a rank that failed).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from typing import Any, Callable

import numpy as np

from .channel import Channel, PeerTimeout

_OBJECT = "object"


class WorldAborted(PeerTimeout):
    """The in-process world was aborted (:meth:`LoopbackNetwork.abort`): a rank's wait, or
    its next one, raises this at once, messages already queued or not."""


class _Mailbox:
    def __init__(self):
        self.cond = threading.Condition()
        self.queues: dict[tuple, deque] = defaultdict(deque)
        self.aborted: str | None = None  # why the world was aborted

    def check_aborted(self) -> None:
        if self.aborted is not None:
            raise WorldAborted(f"the world was aborted: {self.aborted}")

    def put(self, key: tuple, value: Any) -> None:
        with self.cond:
            self.queues[key].append(value)
            self.cond.notify_all()

    def take_any(self, keys: list[tuple], timeout: float, describe: Callable[[], str]) -> tuple[tuple, Any]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                self.check_aborted()
                for key in keys:
                    if self.queues.get(key):
                        return key, self.queues[key].popleft()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(f"{describe()} within {timeout:g} s")
                self.cond.wait(left)


class LoopbackNetwork:
    """``size`` ranks of which the first ``servers`` are servers; ``channel(rank)`` is one end."""

    def __init__(self, size: int, servers: int = 1, timeout: float = 5.0, colocated: bool = False):
        self.size, self.servers, self.timeout, self.colocated = size, servers, timeout, colocated
        self.boxes = [_Mailbox() for _ in range(size)]

    def channel(self, rank: int) -> "LoopbackChannel":
        return LoopbackChannel(self, rank)

    def abort(self, why: str) -> None:
        """End the world: every rank waiting on a message, and every later wait, raises
        :class:`WorldAborted` naming ``why``."""
        for box in self.boxes:
            with box.cond:
                box.aborted = why
                box.cond.notify_all()


class LoopbackChannel(Channel):
    def __init__(self, network: LoopbackNetwork, rank: int):
        self.net = network
        self.rank, self.size, self.servers, self.timeout = rank, network.size, network.servers, network.timeout
        self.colocated = network.colocated
        self.box = network.boxes[rank]

    def send(self, items, tag, describe) -> None:
        for buf, dest in items:
            self.net.boxes[dest].put((self.rank, tag), np.array(buf, copy=True))

    def start_send(self, items, tag):
        self.send(items, tag, None)

    def finish_send(self, pending, describe) -> None:
        pass

    def start_recv(self, items, tag):
        return [[buf, source, tag, None] for buf, source in items]

    def received(self, pending, index):
        self.box.check_aborted()
        empty = set()  # a source whose next message has not come: no later receive may take one
        for item in pending[:index + 1]:  # earlier receives from the same source match first
            buf, source, tag, count = item
            if count is None and (source, tag) not in empty:
                with self.box.cond:
                    queue = self.box.queues.get((source, tag))
                    data = queue.popleft() if queue else None
                if data is None:
                    empty.add((source, tag))
                else:
                    if data.size > buf.size:
                        raise RuntimeError(f"rank {self.rank}: message from rank {source} has {data.size} "
                                           f"bytes, the receive buffer {buf.size}")
                    buf[:data.size] = data
                    item[3] = data.size
        return pending[index][3]

    def test_send(self, pending) -> bool:
        return True

    def _recv_into(self, buf: np.ndarray, source: int, key_tag, describe) -> None:
        _, data = self.box.take_any([(source, key_tag)], self.timeout, describe)
        if data.size != buf.size or data.dtype != buf.dtype:
            raise RuntimeError(f"rank {self.rank}: message from rank {source} has {data.size} "
                               f"{data.dtype} values, the receive buffer {buf.size} {buf.dtype}")
        buf[...] = data.reshape(buf.shape)

    def recv(self, items, tag, describe) -> None:
        for i, (buf, source) in enumerate(items):
            self._recv_into(buf, source, tag, lambda i=i: describe([s for _, s in items[i:]]))

    def frames(self, sources, tag, buffers, describe):
        waiting = set(sources)
        while waiting:
            (source, _), data = self.box.take_any([(s, tag) for s in sorted(waiting)], self.timeout,
                                                  lambda: describe(sorted(waiting)))
            view = buffers.take(source, data.size)
            view[:] = data
            waiting.discard(source)
            yield source, view

    def has_message(self, source: int, tag: int) -> bool:
        with self.box.cond:
            return bool(self.box.queues.get((source, tag)))

    def broadcast(self, items, describe) -> None:
        for buf, group in items:
            members = self.members(group)
            if members[0] == self.rank:
                for member in members[1:]:
                    self.net.boxes[member].put((self.rank, ("bcast", group)), np.array(buf, copy=True))
        for buf, group in items:
            root = self.members(group)[0]
            if root != self.rank:
                self._recv_into(buf, root, ("bcast", group), describe)

    def gather_object(self, obj, what="set-up data"):
        if self.rank:
            self.net.boxes[0].put((self.rank, _OBJECT), obj)
            return None
        return [obj] + [self.box.take_any([(r, _OBJECT)], self.timeout, lambda r=r: f"rank {r} sent nothing")[1]
                        for r in range(1, self.size)]

    def scatter_object(self, objs):
        if self.rank:
            return self.box.take_any([(0, _OBJECT)], self.timeout, lambda: "rank 0 sent nothing")[1]
        for r in range(1, self.size):
            self.net.boxes[r].put((0, _OBJECT), objs[r])
        return objs[0]

    def bcast_object(self, obj):
        return self.scatter_object([obj] * self.size if self.rank == 0 else None)
