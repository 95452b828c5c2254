"""The MPI channel: nonblocking mpi4py buffer calls on numpy arrays, sleep-polled.

MPI's blocking calls spin a core while they wait. With more ranks than cores (laptops, CI,
oversubscribed nodes) a spinning rank steals the cycles the computing ranks need, so every
wait here polls ``Test`` and sleeps between polls (:class:`~.channel.Backoff`). Rank 0 also
looks for a peer's error report (message 8) at every poll: a worker that raised is named,
and the trace closed, by rank 0 itself.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Callable, Iterator

import numpy as np
from mpi4py import MPI

from .channel import WORLD, Backoff, Channel, PeerFailed, ReceiveBuffers
from .messages import TAG_ERROR, TAG_OBJECT, ErrorReport, FrameError

#: How long a failed rank's error report may take to leave (it is small: sent eagerly).
_REPORT_SEND_SECONDS = 10.0
_REPORT_WAIT_SECONDS = 30.0


def _wait_all(requests: list, keys: list, timeout: float, describe: Callable[[list], str],
              poll: Callable[[], None] | None = None) -> float:
    """Wait for every request, sleep-polled; return the CPU seconds spent polling (after the
    first look found some still pending)."""
    pending = set(range(len(requests)))
    backoff = Backoff(timeout, lambda: describe([keys[i] for i in sorted(pending)]))
    started = None
    while True:
        for i in list(pending):
            if requests[i].Test():
                pending.discard(i)
        if not pending:
            return time.process_time() - started if started is not None else 0.0
        if started is None:
            started = time.process_time()
        if poll is not None:
            poll()
        backoff.sleep()


def choose_waiting(comm: MPI.Comm, mode: str, threads: int, timeout: float) -> dict[str, list[int]]:
    """Collective: set how this rank waits (``mode`` spin, sleep, or auto: spin where every
    rank of its machine has a core per thread, by the ranks' CPU affinity); return every
    rank's choice, ``{"spin": [ranks], "sleep": [ranks]}``, the same on every rank. A machine
    is ``environment.machine_id``'s, not MPI's shared-memory node: the network lab's
    namespaces are nodes to MPI and share one machine's cores. The first rank here waits for
    the last one's warm-up asleep (``barrier``), not spinning in the allgather."""
    from ..plan.environment import cores_for_each, cpu_affinity, machine_id
    from .channel import set_waiting

    barrier(comm, timeout, "a rank did not finish its warm-up")
    ranks = comm.allgather((machine_id(), cpu_affinity()))
    mine = ranks[comm.Get_rank()][0]
    spin = mode == "spin" or (mode == "auto" and cores_for_each([cpus for machine, cpus in ranks if machine == mine],
                                                                 threads))
    set_waiting(spin)
    choices = comm.allgather(spin)
    return {"spin": [r for r, c in enumerate(choices) if c], "sleep": [r for r, c in enumerate(choices) if not c]}


def barrier(comm: MPI.Comm, timeout: float, what: str) -> None:
    """MPI_Barrier, sleep-polled; PeerTimeout ("{what} within {timeout} s") past the timeout."""
    _wait_all([comm.Ibarrier()], [None], timeout, lambda pending: what)


def bcast_asleep(comm: MPI.Comm, value: Any, timeout: float, what: str, root: int = 0) -> Any:
    """``comm.bcast(value, root)``, the other ranks waiting for the root asleep (``barrier``
    first): MPICH's blocking bcast polls without sleeping, and where ranks outnumber cores the
    waiting ranks take the core the root computes ``value`` on (a shared world's options
    check, a run's launch checks; docs/runtime.rst, "How ranks wait", has the figures).
    PeerTimeout ("{what} within {timeout} s") past the timeout."""
    barrier(comm, timeout, what)
    return comm.bcast(value, root=root)


def check_error_reports(comm: MPI.Comm, role_of: Callable[[int], str]) -> None:
    """Rank 0: PeerFailed naming the rank (``role_of(rank)``: "worker", "server"), its
    iteration and its error when a peer sent an error report (message 8); nothing otherwise."""
    status = MPI.Status()
    if not comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_ERROR, status=status):
        return
    source = status.Get_source()
    buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
    comm.Recv([buf, MPI.BYTE], source=source, tag=TAG_ERROR)
    role = role_of(source)
    try:
        report = ErrorReport.unpack(buf)
    except FrameError as exc:
        raise PeerFailed(f"{role} rank {source} failed ({exc})") from None
    at = f" at iteration {report.iteration}" if report.iteration >= 0 else " before its first iteration"
    raise PeerFailed(f"{role} rank {source} failed{at}: {report.text}")


class MpiChannel(Channel):
    def __init__(self, comm: MPI.Comm, servers: int, timeout: float, colocated: bool = False):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.servers = servers
        self.colocated = colocated
        self.timeout = timeout
        #: CPU seconds this rank spent polling while it waited (MPI progress, error reports).
        self.wait_cpu_seconds = 0.0
        self._poll = (lambda: check_error_reports(comm, self.role_of)) if self.rank == 0 else None
        self._groups: dict[Any, MPI.Comm] = {WORLD: comm}
        if colocated:
            pass  # shards go point to point (TAG_BCAST): no group communicators
        elif servers == 1:
            self._groups[0] = comm
        else:
            world_group = comm.Get_group()
            for s in range(servers):
                members = self.members(s)
                if self.rank in members:  # collective over the members only, root first
                    self._groups[s] = comm.Create_group(world_group.Incl(members), tag=100 + s)
            world_group.Free()

    def send(self, items, tag, describe) -> None:
        self.finish_send(self.start_send(items, tag), describe)

    def start_send(self, items, tag):
        return [self.comm.Isend(buf, dest=dest, tag=tag) for buf, dest in items], [dest for _, dest in items]

    def finish_send(self, pending, describe) -> None:
        requests, destinations = pending
        self.wait_cpu_seconds += _wait_all(requests, destinations, self.timeout, describe, self._poll)

    def start_recv(self, items, tag):
        requests = [self.comm.Irecv([buf, buf.size, MPI.BYTE], source=source, tag=tag) for buf, source in items]
        return requests, [None] * len(requests)  # the counts, kept: a completed request is freed

    def received(self, pending, index):
        requests, counts = pending
        if counts[index] is None:
            status = MPI.Status()
            if requests[index].Test(status):
                counts[index] = status.Get_count(MPI.BYTE)
        return counts[index]

    def test_send(self, pending) -> bool:
        return MPI.Request.Testall(pending[0])

    def recv(self, items, tag, describe) -> None:
        requests = [self.comm.Irecv(buf, source=source, tag=tag) for buf, source in items]
        self.wait_cpu_seconds += _wait_all(requests, [source for _, source in items], self.timeout, describe,
                                           self._poll)

    def frames(self, sources, tag, buffers, describe) -> Iterator[tuple[int, np.ndarray]]:
        """Each source's frame as it completes. A frame is received from the moment it is seen
        (Iprobe) while the others are looked for and received beside it: a frame that stalls
        on the way (its link went down in the middle of it) holds up no other, and the
        timeout names the sources whose frames did not complete, not those queued behind it
        (the lab named ranks 1 and 2 for node 2's downed link). The timeout restarts whenever
        a frame starts or completes."""
        waiting = set(sources)  # frames not complete
        receiving: dict[int, tuple[Any, np.ndarray]] = {}  # started: source -> (request, its buffer)
        status = MPI.Status()
        backoff = Backoff(self.timeout, lambda: describe(sorted(waiting)))
        while waiting:
            done = [source for source, (request, _) in receiving.items() if request.Test()]
            for source in done:
                view = receiving.pop(source)[1]
                waiting.discard(source)
                backoff = Backoff(self.timeout, lambda: describe(sorted(waiting)))
                yield source, view
            if done:
                continue
            if len(receiving) < len(waiting) and self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
                source, count = status.Get_source(), status.Get_count(MPI.BYTE)
                if source not in waiting or source in receiving:
                    raise RuntimeError(f"rank {self.rank}: a second message with tag {tag} from rank {source}")
                view = buffers.take(source, count)
                # Not a blocking Recv: a link that fails while the message crosses would hang it
                # past every timeout (the lab saw it: rank 0 silent, the workers timing out).
                receiving[source] = (self.comm.Irecv([view, count, MPI.BYTE], source=source, tag=tag), view)
                backoff = Backoff(self.timeout, lambda: describe(sorted(waiting)))
                continue
            started = time.process_time()
            if self._poll is not None:
                self._poll()
            backoff.sleep()
            self.wait_cpu_seconds += time.process_time() - started

    def has_message(self, source: int, tag: int) -> bool:
        return bool(self.comm.Iprobe(source=source, tag=tag))

    def broadcast(self, items, describe) -> None:
        requests = [self._groups[group].Ibcast(buf, root=0) for buf, group in items]
        self.wait_cpu_seconds += _wait_all(requests, [group for _, group in items], self.timeout,
                                           lambda pending: describe(), self._poll)

    # The set-up and checkpoint plane: pickled objects as point-to-point byte messages (tag
    # OBJECT), so that every wait sleep-polls, times out and names the ranks it still waits
    # for (MPI's object collectives block: a rank that is gone hangs them, spinning).
    def gather_object(self, obj, what="set-up data"):
        if self.rank != 0:
            self._send_objects([(obj, 0)], f"rank 0 took no {what}")
            return None
        others = list(range(1, self.size))
        gathered = [obj] + [None] * len(others)
        buffers = ReceiveBuffers()
        describe = lambda pending: f"rank(s) {', '.join(map(str, pending))} sent no {what}"  # noqa: E731
        for source, view in self.frames(others, TAG_OBJECT, buffers, describe):
            gathered[source] = pickle.loads(view)
        return gathered

    def scatter_object(self, objs):
        if self.rank == 0:
            self._send_objects([(objs[rank], rank) for rank in range(1, self.size)],
                               "set-up data did not reach rank(s) {}")
            return objs[0]
        _, view = next(self.frames([0], TAG_OBJECT, ReceiveBuffers(), lambda pending: "rank 0 sent no set-up data"))
        return pickle.loads(view)

    def bcast_object(self, obj):
        return self.scatter_object([obj] * self.size if self.rank == 0 else None)

    def _send_objects(self, items: list, what: str) -> None:
        buffers = [(np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8), dest)
                   for obj, dest in items]
        self.send(buffers, TAG_OBJECT, lambda pending: what.format(", ".join(map(str, pending))))

    def report_error(self, iteration: int, text: str) -> None:
        request = self.comm.Isend(ErrorReport(iteration, text).pack(), dest=0, tag=TAG_ERROR)
        deadline = time.monotonic() + _REPORT_SEND_SECONDS
        while not request.Test():
            if time.monotonic() > deadline:
                return
            time.sleep(1e-3)
        # Rank 0 closes the trace and calls MPI_Abort, which ends this rank; if it does not
        # come, this rank aborts the run itself.
        time.sleep(min(self.timeout, _REPORT_WAIT_SECONDS))
