"""Sleep-polling waits on nonblocking MPI requests, with timeouts that name the silent peer.

MPI's blocking calls spin a core while they wait. With more ranks than cores (laptops, CI,
oversubscribed nodes) a spinning rank steals the cycles the computing ranks need, so every
wait here polls ``Test`` and sleeps between polls, backing off from 50 us to 2 ms.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from .protocol import TAG_GRAD

_FIRST_SLEEP = 50e-6
_MAX_SLEEP = 2e-3


class PeerTimeout(RuntimeError):
    """A peer did not answer within the run's --timeout."""


class _Backoff:
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


def wait(request: MPI.Request, timeout: float, describe: Callable[[], str]) -> None:
    backoff = _Backoff(timeout, describe)
    while not request.Test():
        backoff.sleep()


def wait_all(requests: list[MPI.Request], timeout: float, describe: Callable[[list[int]], str]) -> None:
    """Wait for every request; on timeout, ``describe`` gets the indices still pending."""
    pending = set(range(len(requests)))
    backoff = _Backoff(timeout, lambda: describe(sorted(pending)))
    while True:
        for i in list(pending):
            if requests[i].Test():
                pending.discard(i)
        if not pending:
            return
        backoff.sleep()


def bcast(comm: MPI.Comm, buf: np.ndarray, timeout: float, describe: Callable[[], str]) -> None:
    wait(comm.Ibcast(buf, root=0), timeout, describe)


def send(comm: MPI.Comm, buf: np.ndarray, dest: int, tag: int, timeout: float,
         describe: Callable[[], str]) -> None:
    wait(comm.Isend(buf, dest=dest, tag=tag), timeout, describe)


def iter_gradient_frames(comm: MPI.Comm, workers: int, timeout: float, buffers: list[np.ndarray],
                         iteration: int):
    """Yield (rank, frame view) for each worker's gradient frame, in arrival order.

    ``buffers[rank - 1]`` is that rank's reusable receive buffer, replaced by a larger one
    when a frame does not fit; a yielded view stays valid until the next iteration's call.
    """
    waiting = set(range(1, workers + 1))
    status = MPI.Status()

    def describe() -> str:
        return (f"worker rank(s) {', '.join(map(str, sorted(waiting)))} sent no gradient for "
                f"iteration {iteration}")

    backoff = _Backoff(timeout, describe)
    while waiting:
        if not comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_GRAD, status=status):
            backoff.sleep()
            continue
        source, count = status.Get_source(), status.Get_count(MPI.BYTE)
        if buffers[source - 1].size < count:
            buffers[source - 1] = np.empty(count, np.uint8)
        comm.Recv([buffers[source - 1], count, MPI.BYTE], source=source, tag=TAG_GRAD)
        waiting.discard(source)
        backoff = _Backoff(timeout, describe)
        yield source, buffers[source - 1][:count]
