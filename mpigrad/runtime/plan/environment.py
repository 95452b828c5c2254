"""Launch-environment checks shared by ``mpigrad doctor`` and ``mpigrad train``.

Plain functions over an ``environ`` mapping (``os.environ`` by default), so they run and
test without MPI or Slurm; nothing here imports mpi4py. torch and Numba are imported only
inside the functions that need them.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import UsageError

__all__ = [
    "THREAD_VARIABLES", "SKIP_NTASKS_CHECK", "RankInfo",
    "check_world_size", "threads_per_rank", "export_thread_variables", "apply_thread_settings",
    "probe_rank", "ranks_per_host", "oversubscription_warnings", "format_ranks", "cores_for_each", "cpu_affinity",
]

#: Variables that thread pools read at start-up; the jobscripts export them all.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")

#: Set to 1 to accept a world size that differs from SLURM_NTASKS on purpose.
SKIP_NTASKS_CHECK = "MPIGRAD_SKIP_NTASKS_CHECK"


def _positive_int_variable(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a whole number") from None
    if value < 1:
        raise UsageError(f"{name}={raw} must be at least 1")
    return value


def check_world_size(size: int, environ: Mapping[str, str] = os.environ) -> None:
    """Raise UsageError when the MPI world size differs from ``SLURM_NTASKS``.

    Under ``srun`` with a PMI that the MPI library does not speak, every task starts as
    its own world of size 1; without this check such a job trains N copies of the model.
    Outside Slurm (no ``SLURM_NTASKS``) there is nothing to compare and it returns.
    """
    expected = _positive_int_variable(environ, "SLURM_NTASKS")
    if expected is None or expected == size or environ.get(SKIP_NTASKS_CHECK, "") == "1":
        return
    if size == 1:
        raise UsageError(
            f"world size 1 but SLURM_NTASKS={expected}: srun's PMI does not match this MPI; "
            f"use srun --mpi=pmix or --mpi=pmi2 (see srun --mpi=list), "
            f"or launch with the MPI's own mpiexec -n {expected}")
    raise UsageError(
        f"world size {size} but SLURM_NTASKS={expected}: launch one rank per Slurm task "
        f"(srun, or mpiexec -n {expected}), or set {SKIP_NTASKS_CHECK}=1 if this is deliberate")


def threads_per_rank(requested: int | None = None, environ: Mapping[str, str] = os.environ) -> int:
    """Threads each rank should use: ``requested``, else ``SLURM_CPUS_PER_TASK``, else 1."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise UsageError(f"threads per rank must be a whole number >= 1, got {requested!r}")
        return requested
    from_slurm = _positive_int_variable(environ, "SLURM_CPUS_PER_TASK")
    return 1 if from_slurm is None else from_slurm


def export_thread_variables(threads: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Export ``threads`` in ``THREAD_VARIABLES`` without importing anything (``NUMBA_NUM_THREADS``
    only while Numba is not imported yet: it refuses a changed value once its pool exists)."""
    numba_loaded = "numba" in sys.modules
    for name in THREAD_VARIABLES:
        if name == "NUMBA_NUM_THREADS" and numba_loaded:
            continue
        environ[name] = str(threads)


def apply_thread_settings(threads: int, environ: MutableMapping[str, str] = os.environ) -> dict[str, int]:
    """Use ``threads`` threads in torch and Numba and export them in ``THREAD_VARIABLES``
    (``NUMBA_NUM_THREADS`` only while Numba is not imported yet).

    The variables reach child processes and libraries loaded later; pools that already
    started keep their size. Numba cannot exceed the pool it was imported with
    (``numba.config.NUMBA_NUM_THREADS``), so its count is capped there. torch's inter-op
    pool can only be sized before torch first uses it; after that it is left alone.
    Returns the counts in force: ``{"torch": ..., "numba": ...}``.
    """
    threads = threads_per_rank(threads, environ)
    export_thread_variables(threads, environ)
    import numba
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # the inter-op pool already started; its size is fixed for good
        pass
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    return {"torch": torch.get_num_threads(), "numba": numba.get_num_threads()}


@dataclass(frozen=True)
class RankInfo:
    """What one rank sees of its host: gathered by rank 0 for reports and checks."""

    rank: int
    host: str
    pid: int
    cpus: tuple[int, ...]            # CPUs this process may run on (its affinity mask)
    thread_env: dict[str, str]       # THREAD_VARIABLES that are set, as set
    torch_threads: int
    numba_threads: int


def cpu_affinity() -> tuple[int, ...]:
    """The CPUs this process may run on (all of them where the OS has no affinity call)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # macOS and Windows have no affinity call
        return tuple(range(os.cpu_count() or 1))


def machine_id() -> str:
    """Which machine's cores this process shares: its host name and the kernel's boot id.
    Processes in different network namespaces of one kernel (``mpigrad lab``'s nodes) share
    it, where MPI's shared-memory split puts each on a node of its own."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # no procfs (macOS): the host name alone
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def probe_rank(rank: int, environ: Mapping[str, str] = os.environ) -> RankInfo:
    """Describe the calling process (imports torch and Numba to read their pool sizes)."""
    import numba
    import torch

    return RankInfo(
        rank=rank, host=socket.gethostname(), pid=os.getpid(), cpus=cpu_affinity(),
        thread_env={name: environ[name] for name in THREAD_VARIABLES if name in environ},
        torch_threads=torch.get_num_threads(), numba_threads=numba.get_num_threads())


def ranks_per_host(ranks: Sequence[RankInfo]) -> dict[str, list[RankInfo]]:
    """Ranks grouped by host name, hosts in order of their lowest rank."""
    hosts: dict[str, list[RankInfo]] = {}
    for info in sorted(ranks, key=lambda r: r.rank):
        hosts.setdefault(info.host, []).append(info)
    return hosts


def format_ranks(ranks: Sequence[int]) -> str:
    """Compact rank list: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    spans: list[list[int]] = []          # [first, last] of each run of consecutive ranks
    for r in sorted(set(ranks)):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _first_count(value: str | None) -> int:
    """Outermost thread count of a variable such as ``"4"`` or OpenMP's nested ``"4,2"``; 0 if unreadable."""
    head = (value or "").split(",")[0].strip()
    return int(head) if head.isdigit() else 0


def cores_for_each(cpus: Sequence[Sequence[int]], threads: int) -> bool:
    """Whether the ranks of one node, bound to ``cpus`` each (their affinity), have a core
    per thread between them: ranks x threads <= the CPUs they may run on."""
    return len(cpus) * threads <= len(set().union(*map(set, cpus)))


def oversubscription_warnings(ranks: Sequence[RankInfo], threads: int) -> list[str]:
    """One line per problem: hosts running more threads than they have CPUs for the job,
    and thread variables that ask for more threads than ``threads`` per rank."""
    warnings = []
    for host, infos in ranks_per_host(ranks).items():
        available = len(set().union(*(info.cpus for info in infos)))
        wanted = len(infos) * threads
        if wanted > available:
            warnings.append(
                f"host {host}: {len(infos)} ranks x {threads} threads = {wanted} threads on "
                f"{available} CPUs: oversubscribed; lower --threads/--cpus-per-task or run "
                f"fewer ranks per node")
        narrow = [info.rank for info in infos if len(info.cpus) < threads]
        if narrow and wanted <= available:
            warnings.append(
                f"host {host}: ranks {format_ranks(narrow)} are bound to fewer CPUs than their "
                f"{threads} threads; check srun --cpus-per-task / --cpu-bind")
    for name in THREAD_VARIABLES:
        too_many = [info.rank for info in ranks if _first_count(info.thread_env.get(name)) > threads]
        if too_many:
            warnings.append(
                f"{name} exceeds {threads} thread(s) per rank on ranks {format_ranks(too_many)}: "
                f"libraries that read it will oversubscribe; export {name}={threads}")
    return warnings
