"""What a rank's wait for a busy rank 0 costs, for tests/test_waiting.py: rank 0 computes for
``seconds`` (asleep: a stand-in for its options and launch checks) before each broadcast,
first ``wire.mpi.bcast_asleep``'s, then a plain ``comm.bcast``'s; every other rank prints the
CPU seconds each wait took it (``rank R: asleep A spinning S``). Run by a world as
``main(comm, seconds)``, or alone under ``mpiexec -n N python -m mpi4py tests/wait_for_root.py S``."""

from __future__ import annotations

import sys
import time


def main(comm, seconds: str) -> int:
    from mpigrad.runtime.wire.mpi import bcast_asleep

    rank, busy = comm.Get_rank(), float(seconds)
    costs = []
    for asleep in (True, False):
        if rank == 0:
            time.sleep(busy)
        began = time.process_time()
        value = (bcast_asleep(comm, "go", timeout=60, what="rank 0 sent nothing") if asleep
                 else comm.bcast("go", root=0))
        costs.append(time.process_time() - began)
        assert value == "go", value
    if rank:
        print(f"rank {rank}: asleep {costs[0]:.3f} spinning {costs[1]:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    from mpi4py import MPI

    sys.exit(main(MPI.COMM_WORLD, sys.argv[1]))
