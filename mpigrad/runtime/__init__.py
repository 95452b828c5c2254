"""The training runtime: rank 0 as parameter server and MDP server, ranks 1..P as workers.

Launch through ``mpigrad train`` (see :mod:`mpigrad.runtime.run.launch`). This package's
``__init__`` imports nothing, so the launch checks run before torch and Numba start.
"""

#: Exit code of a run that stopped at an iteration boundary and checkpointed (requeue it
#: with --resume); 0 is a finished run, 1 a failure, 2 a usage error.
EXIT_REQUEUE = 75
