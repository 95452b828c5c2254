"""Run under mpiexec with 3 ranks: rank 0 receives one frame from ranks 1 and 2
(``MpiChannel.frames``, as a server receives gradients) while rank 2's frame stalls on the way.

Rank 2 starts sending a large frame and then makes no MPI call for ``--hold`` seconds: its
frame begins to arrive and stops, as one does when a link goes down in the middle of it
(MPICH moves a large message only inside MPI calls of both sides). Rank 1 sends a small
frame a little later. Rank 0 writes the one line of its timeout and ``RECEIVED <ranks>``
to the file its one argument names (not stdout: the abort that ends the script can end the
launcher's forwarding of the lines first, as it did in stop 69's CI).
"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpigrad.runtime.wire import PeerTimeout, ReceiveBuffers
from mpigrad.runtime.wire.mpi import MpiChannel

TAG = 42
HOLD = 8.0
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
channel = MpiChannel(comm, 1, timeout=2.0)
comm.Barrier()
if rank == 0:
    buffers = ReceiveBuffers([1, 2])
    received = []
    try:
        for source, _ in channel.frames([1, 2], TAG, buffers,
                                        lambda pending: f"worker rank(s) {', '.join(map(str, pending))} sent no frame"):
            received.append(source)
    except PeerTimeout as exc:
        lines = [f"TIMEOUT {exc}"]
    else:
        lines = []
    lines.append(f"RECEIVED {' '.join(map(str, received))}")
    with open(sys.argv[1] + ".partial", "w") as out:
        out.write("".join(line + "\n" for line in lines))
    os.replace(sys.argv[1] + ".partial", sys.argv[1])
    comm.Abort(0)  # rank 2's frame will never be received
elif rank == 2:
    request = comm.Isend(np.ones(64 << 20, np.uint8), dest=0, tag=TAG)
    time.sleep(HOLD)  # silent, as behind a downed link
    sys.exit(0)
else:
    time.sleep(0.5)  # rank 2's frame is first
    comm.Send(np.ones(1000, np.uint8), dest=0, tag=TAG)
    time.sleep(HOLD)
