"""The rate check over MPI, run by :mod:`.ratecheck` under the lab's ``mpiexec``, one rank
per node::

    python -m mpigrad.lab.mpiprobe CHUNK:COUNT[,CHUNK:COUNT...]   # one pair per rank, ring order

For each rank I in turn, rank I sends COUNT messages of CHUNK bytes (numpy uint8 buffers,
``Send``/``Recv`` as the training runs do) to rank I+1 (mod N); the receiver times from the
first message's arrival to the last's, so the first (tbf's burst) is not counted. Rank 0
prints one JSON line: a list of ``{"sender", "receiver", "bytes", "seconds"}``.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
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
