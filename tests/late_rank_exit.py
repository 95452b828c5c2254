"""Run under mpiexec: end every rank through mpigrad's stop path with one rank late.

Usage: late_rank_exit.py LATE_RANK SECONDS CODE. LATE_RANK sleeps SECONDS between
MPI_Finalize and its exit, as a rank descheduled on a loaded node would.
"""

import sys
import time

from mpi4py import MPI

from mpigrad.runtime.run import launch

late_rank, seconds, code = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
rank = MPI.COMM_WORLD.Get_rank()
finalize = MPI.Finalize


def late_finalize() -> None:
    finalize()
    if rank == late_rank:
        time.sleep(seconds)


MPI.Finalize = late_finalize
launch.end_together(MPI.COMM_WORLD, code)
