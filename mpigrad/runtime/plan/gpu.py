"""GPUs in an MPI job: which device each rank trains on, and whether the MPI takes device buffers.

One GPU per rank, as DDP and Horovod users bind them: the ranks that compute on a GPU
(workers, and shard servers; not rank 0 when servers are colocated, where it only
schedules and evaluates) take, on each node, the device of their position among that
node's GPU ranks (MPI's shared-memory split gives the node under any launcher). Ranks that
see different devices (Slurm's ``--gpus-per-task`` or ``--gpu-bind``, which narrow
``CUDA_VISIBLE_DEVICES`` per task) are counted apart: each takes its own first device. More
GPU ranks than devices on a node is refused in one line, unless ``--share-gpu`` lets them
share round-robin (a one-GPU workstation, a test).

CUDA-aware MPI: Open MPI and MPICH 4.1+ answer ``MPIX_Query_cuda_support()``, older MPICH
``MPIX_GPU_query_support``; mpi4py binds neither, so they are called through ctypes on the
library mpi4py loaded. The pip wheels of both are built without CUDA.
"""

from __future__ import annotations

import ctypes
import os
from typing import Hashable

from ...errors import UsageError

#: MPICH's MPIX_GPU_SUPPORT_CUDA (mpi.h: CUDA 0, ZE 1, HIP 2).
_MPICH_GPU_CUDA = 0


def workers_device(config) -> str:
    """"cuda" when the run's workers train on GPUs (``--device cuda``, or ``auto`` where
    torch sees one), else "cpu": the same answer on every rank of a homogeneous job, and
    not this rank's own device (rank 0's replica stays on the CPU with colocated servers)."""
    if config.device == "cpu":
        return "cpu"
    if config.device == "cuda":
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gpu_rank(rank: int, colocated: bool) -> bool:
    """Whether world ``rank`` computes on a GPU in a ``--device cuda`` run: every rank but
    rank 0 with colocated servers (which serves no shard)."""
    return not (rank == 0 and colocated)


def plan_devices(ranks: list[tuple[int, Hashable, int]], share: bool, host: str) -> dict[int, int]:
    """World rank -> device index for one node's GPU ranks, each given as (world rank, the
    key of the devices it sees, how many it sees). Ranks are numbered in world order among
    those that see the same devices; UsageError (one line) when a group outnumbers its
    devices and ``share`` is False, or a rank sees none."""
    groups: dict[Hashable, list[int]] = {}
    counts: dict[Hashable, int] = {}
    for rank, key, count in sorted(ranks, key=lambda item: item[0]):
        if count < 1:
            raise UsageError(f"rank {rank} on {host} sees no CUDA device (CUDA_VISIBLE_DEVICES, or the "
                             "job's GPU request): use --device cpu, or ask Slurm for GPUs (--gpus-per-task)")
        groups.setdefault(key, []).append(rank)
        counts[key] = count
    plan = {}
    for key, members in groups.items():
        if len(members) > counts[key] and not share:
            raise UsageError(
                f"{len(members)} ranks train on a GPU on {host} ({', '.join(map(str, members))}) but see "
                f"{counts[key]} device{'s' * (counts[key] != 1)}: launch at most {counts[key]} GPU ranks per node "
                "(rank 0 needs none with --servers colocated), ask for a GPU per task (--gpus-per-task=1), "
                "or let them share with --share-gpu")
        plan.update({rank: i % counts[key] for i, rank in enumerate(members)})
    return plan


def visible_devices() -> tuple[tuple[str, ...], int]:
    """(a key naming the CUDA devices this process sees, their count): the devices' UUIDs,
    so that ranks whose CUDA_VISIBLE_DEVICES read alike but name different devices (cgroups)
    are told apart."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    uuids = []
    for i in range(count):
        uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
        uuids.append(str(uuid) if uuid is not None else f"{os.environ.get('CUDA_VISIBLE_DEVICES', '*')}:{i}")
    return tuple(uuids), count


def plan_world(entries, colocated: bool, share: bool, require: bool = True) -> dict[int, int | None]:
    """Every rank's device index (None: the CPU) from ``entries``, one per world rank:
    (rank, node, node name, devices key, device count); UsageError where a node's plan is
    refused (:func:`plan_devices`). Without ``require`` (``--device auto``) a rank that sees
    no device trains on the CPU. The same entries give the same answer on every rank."""
    nodes: dict[Hashable, tuple[str, list]] = {}
    for rank, node, name, key, count in entries:
        if gpu_rank(rank, colocated) and (require or count):
            nodes.setdefault(node, (name, []))[1].append((rank, key, count))
    plan: dict[int, int | None] = {entry[0]: None for entry in entries}
    for name, ranks in nodes.values():
        plan.update(plan_devices(ranks, share, name))
    return plan


def node_of(comm) -> tuple[int, str]:
    """Collective: (this rank's node, named by its lowest world rank, as MPI's shared-memory
    split finds it under any launcher; the node's host name, for messages)."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        return node.bcast(rank, root=0), MPI.Get_processor_name()
    finally:
        node.Free()


def bind_devices(comm, colocated: bool, share: bool, require: bool = True) -> dict[int, int | None]:
    """Collective over ``comm``: every rank's device index (None: the CPU), the same dict on
    every rank, or UsageError on every rank alike. Only the ranks that compute on a GPU ask
    CUDA which devices they see (rank 0 with colocated servers never starts CUDA)."""
    rank = comm.Get_rank()
    key, count = visible_devices() if gpu_rank(rank, colocated) else ((), 0)
    entries = comm.allgather((rank, *node_of(comm), key, count))
    return plan_world(entries, colocated, share, require)


#: This rank's device once :func:`bind_rank_device` chose it, else None.
_bound = None


def resolve_device(name: str):
    """The torch device of ``--device name`` on this rank: the one bound to it, if any."""
    import torch

    from .checks import check_device

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(name)
    if name != "cpu" and _bound is not None:
        return _bound
    return torch.device(name)


def bind_rank_device(index: int | None):
    """Make CUDA device ``index`` this rank's (None: the CPU, for a rank that computes on no
    GPU); :func:`resolve_device` returns it from now on (a ``torch.device``)."""
    import torch

    global _bound
    _bound = torch.device("cpu") if index is None else torch.device("cuda", index)
    if index is not None:
        torch.cuda.set_device(_bound)
    return _bound


def bind_rank(config, comm) -> None:
    """Before a run's work: make this rank's device the one :func:`bind_devices` gives it
    (a ``--device cuda`` run; nothing on the CPU) and apply ``--tf32``."""
    apply_tf32(config.tf32)
    if config.device != "cpu":  # every rank takes part, whatever it sees (auto: those that see none, the CPU)
        plan = bind_devices(comm, config.colocated, config.share_gpu, require=config.device == "cuda")
        bind_rank_device(plan[comm.Get_rank()])


def apply_tf32(setting: str) -> dict:
    """Set TF32 for float32 matmuls and cuDNN convolutions (``on``/``off``; ``default``
    leaves torch's own: matmuls off, convolutions on); return what torch now uses, as the
    trace's ``tf32`` attribute records it."""
    import torch

    if setting != "default":
        torch.backends.cuda.matmul.allow_tf32 = setting == "on"
        torch.backends.cudnn.allow_tf32 = setting == "on"
    return {"setting": setting, "matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_conv": bool(torch.backends.cudnn.allow_tf32)}


def cuda_aware_mpi() -> tuple[bool, str]:
    """(whether this process's MPI takes CUDA device buffers, why we think so)."""
    library = _mpi_library()
    if library is None:
        return False, "the MPI library mpi4py loaded was not found to ask; staging through host memory"
    query = getattr(library, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype = ctypes.c_int
        supported = bool(query())
        return supported, f"MPIX_Query_cuda_support() returned {int(supported)}"
    query = getattr(library, "MPIX_GPU_query_support", None)
    if query is not None:
        flag = ctypes.c_int(0)
        code = query(ctypes.c_int(_MPICH_GPU_CUDA), ctypes.byref(flag))
        supported = code == 0 and bool(flag.value)
        return supported, f"MPIX_GPU_query_support(CUDA) set {flag.value} (return code {code})"
    return False, ("this MPI answers neither MPIX_Query_cuda_support nor MPIX_GPU_query_support: "
                   "taken as not CUDA-aware")


def _mpi_library():
    """The MPI shared library this process has loaded (through mpi4py), as a ctypes handle."""
    from mpi4py import MPI  # noqa: F401 - loads the library

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libmpi" in line and ".so" in line})
    except OSError:
        paths = []
    fallback = None
    for path in paths:  # the library that answers one of the queries (not a wrapper such as libmpi_cxx)
        if os.path.basename(path).startswith("libmpi"):
            try:
                library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                continue
            if hasattr(library, "MPIX_Query_cuda_support") or hasattr(library, "MPIX_GPU_query_support"):
                return library
            if hasattr(library, "MPI_Init"):
                fallback = library
    if fallback is not None:
        return fallback
    try:
        library = ctypes.CDLL(None)
        return library if hasattr(library, "MPI_Init") else None
    except OSError:
        return None
