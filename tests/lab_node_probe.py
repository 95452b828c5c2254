"""Run by ``mpigrad lab --ranks-per-node L`` (tests/test_lab_nodes.py): where MPI sees each
rank, and what two transfers cost on the node's interfaces.

    python tests/lab_node_probe.py A-B:BYTES [A-B:BYTES ...]

Every rank reports its lab node (``MPIGRAD_LAB_NODE``), the node MPI's shared-memory split
puts it on (named by its lowest rank), and the lab's LOCAL_RANK / LOCAL_WORLD_SIZE. Then,
one pair at a time, rank A sends BYTES to rank B in one message (after a 1-byte round trip
that connects them, not counted) and B answers with 1 byte; A reads its namespace's byte
counters (``/sys/class/net/{lab0,lo}/statistics/tx_bytes``) before and after. Rank 0
prints ``NODEPROBE`` and one JSON object: ``ranks`` (one entry per rank) and ``pairs``
(``{"sender", "receiver", "bytes", "seconds", "link_sent", "loopback_sent"}``).
"""

import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI


def sent(device: str) -> int:
    with open(f"/sys/class/net/{device}/statistics/tx_bytes") as handle:
        return int(handle.read())


comm = MPI.COMM_WORLD
rank = comm.Get_rank()
shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
me = {"rank": rank, "lab_node": int(os.environ["MPIGRAD_LAB_NODE"]), "mpi_node": shared.allgather(rank)[0],
      "local_rank": int(os.environ["LOCAL_RANK"]), "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
      "world_size": int(os.environ["WORLD_SIZE"]), "env_rank": int(os.environ["RANK"])}
ranks = comm.gather(me, root=0)
pairs = []
for item in sys.argv[1:]:
    pair, _, size = item.partition(":")
    a, b = (int(r) for r in pair.split("-"))
    buf = np.ones(int(size), np.uint8)
    result = None
    comm.Barrier()
    if rank == a:
        comm.Send(buf[:1], dest=b, tag=1)
        comm.Recv(buf[:1], source=b, tag=2)
        link, loop = sent("lab0"), sent("lo")
        started = time.perf_counter()
        comm.Send(buf, dest=b, tag=3)
        comm.Recv(buf[:1], source=b, tag=4)
        seconds = time.perf_counter() - started
        result = {"sender": a, "receiver": b, "bytes": buf.size, "seconds": seconds,
                  "link_sent": sent("lab0") - link, "loopback_sent": sent("lo") - loop}
    elif rank == b:
        comm.Recv(buf[:1], source=a, tag=1)
        comm.Send(buf[:1], dest=a, tag=2)
        comm.Recv(buf, source=a, tag=3)
        comm.Send(buf[:1], dest=a, tag=4)
    gathered = comm.gather(result, root=0)
    if rank == 0:
        pairs.append(next(r for r in gathered if r is not None))
comm.Barrier()
if rank == 0:
    print("NODEPROBE " + json.dumps({"ranks": ranks, "pairs": pairs}), flush=True)
