"""Run under mpiexec with 4 ranks (2 servers, 2 workers): ``MpiChannel.broadcast`` with items
that are tuples of arrays (one message of their bytes, in place), beside plain arrays, as
``runtime/broadcast.py`` sends a length and its frame. Every rank prints ``OK`` or what differed."""

import numpy as np
from mpi4py import MPI

from mpigrad.runtime.wire import WORLD
from mpigrad.runtime.wire.mpi import MpiChannel

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
channel = MpiChannel(comm, 2, timeout=30.0)
problems = []
for trial, size in enumerate((1, 1000, 3 << 20)):
    expected = {s: (np.array([size + s], np.int64),
                    np.random.default_rng([trial, s]).integers(0, 256, size + s, dtype=np.uint8)) for s in (0, 1)}
    items = []
    for s in (0, 1):
        if rank in channel.members(s):
            parts = expected[s] if rank == s else (np.zeros(1, np.int64), np.zeros(size + s, np.uint8))
            items.append((parts, s))
    control = np.array([trial, 7], np.int64) if rank == 0 else np.zeros(2, np.int64)
    items.append((control, WORLD))
    channel.broadcast(items, lambda: "a broadcast stalled")
    for parts, s in items[:-1]:
        for got, want in zip(parts, expected[s]):
            if not np.array_equal(got, want):
                problems.append(f"trial {trial}: group {s}'s {want.dtype} part differs")
    if control.tolist() != [trial, 7]:
        problems.append(f"trial {trial}: the plain broadcast beside them differs")
print(f"rank {rank}: " + ("; ".join(problems) if problems else "OK"), flush=True)
