"""The rate check over MPI, run by :mod:`.ratecheck` under the lab's ``mpiexec``, one rank
per node::

    python -m mpigrad.lab.mpiprobe CHUNK:COUNT[,CHUNK:COUNT...]   # one pair per rank, ring order
    python -m mpigrad.lab.mpiprobe --exchange BYTES[:REPEATS]     # the colocated servers' exchange

For each rank I in turn, rank I sends COUNT messages of CHUNK bytes (numpy uint8 buffers,
``Send``/``Recv`` as the training runs do) to rank I+1 (mod N); the receiver times from the
first message's arrival to the last's, so the first (tbf's burst) is not counted. Rank 0
prints one JSON line: a list of ``{"sender", "receiver", "bytes", "seconds"}``.

``--exchange``: ranks 1..N-1 (rank 0 idle, as under ``--servers colocated``) each send BYTES
to every other and receive BYTES from every other, all posted at once and waited on by
polling with the runtime's back-off (:class:`~mpigrad.runtime.wire.channel.Backoff`); the
pattern of a colocated round. Rank 0 prints ``MPIPROBE-EXCHANGE`` and a JSON object: the
median seconds over REPEATS (default 5; one more first, not counted) and the payload each
rank sent, so that the exchange's rate can be held against the link's.
"""

from __future__ import annotations

import json
import sys
import time


def exchange(spec: str) -> int:
    """``--exchange BYTES[:REPEATS]``: see the module's docstring."""
    import numpy as np
    from mpi4py import MPI

    from ..runtime.wire.channel import Backoff

    nbytes, _, repeats = spec.partition(":")
    nbytes, repeats = int(nbytes), int(repeats or 5)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    others = [r for r in range(1, size) if r != rank] if rank else []
    out = np.ones(nbytes, np.uint8)
    inbox = {r: np.empty(nbytes, np.uint8) for r in others}
    times = []
    for _ in range(repeats + 1):
        comm.Barrier()
        started = time.perf_counter()
        requests = [comm.Irecv(inbox[r], source=r, tag=4) for r in others] + \
            [comm.Isend(out, dest=r, tag=4) for r in others]
        backoff = Backoff(120.0, lambda: f"rank {rank}: the exchange did not finish")
        while not MPI.Request.Testall(requests):
            backoff.sleep()
        comm.Barrier()
        times.append(time.perf_counter() - started)
    if rank == 0:
        print("MPIPROBE-EXCHANGE " + json.dumps({"ranks": size - 1, "bytes_each": nbytes,
                                                  "sent_per_rank": nbytes * (size - 2),
                                                  "seconds": sorted(times[1:])[repeats // 2]}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--exchange"] and len(argv) == 2:
        return exchange(argv[1])
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    plan = [tuple(int(v) for v in item.split(":")) for item in argv[0].split(",")]
    results = []
    comm.Barrier()
    for sender in range(size):
        chunk, count = plan[sender % len(plan)]
        receiver = (sender + 1) % size
        buf = np.zeros(chunk, np.uint8)
        result = None
        if rank == sender:
            comm.Send(buf[:1], dest=receiver, tag=1)  # connect first: not timed
            comm.Recv(buf[:1], source=receiver, tag=2)
            for _ in range(count):
                comm.Send(buf, dest=receiver, tag=3)
        elif rank == receiver:
            comm.Recv(buf[:1], source=sender, tag=1)
            comm.Send(buf[:1], dest=sender, tag=2)
            comm.Recv(buf, source=sender, tag=3)
            started = time.perf_counter()
            for _ in range(count - 1):
                comm.Recv(buf, source=sender, tag=3)
            result = {"sender": sender, "receiver": receiver, "bytes": chunk * (count - 1),
                      "seconds": time.perf_counter() - started}
        results.append(comm.gather(result, root=0))
        comm.Barrier()
    if rank == 0:
        found = [r for gathered in results for r in gathered if r is not None]
        print("MPIPROBE " + json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
