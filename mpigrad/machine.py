"""What a run ran on: the CPU, the kernels torch picked for it, the MPI library.

A leaf module (no mpigrad imports). torch and mpi4py are consulted only when the caller
has imported them already, so asking never starts MPI or loads torch.

Float results depend on these: torch's CPU kernels (chosen per CPU: ``AVX512``, ``AVX2``,
``DEFAULT``; ``ATEN_CPU_CAPABILITY`` lowers the choice) round differently, so two machines
that differ here may give traces that agree only within float noise (docs/runtime.rst,
"The same run").
"""

from __future__ import annotations

import hashlib
import platform
import sys
from collections.abc import Mapping

__all__ = ["cpu_model", "cpu_signature", "torch_cpu_capability", "mpi_library_version", "mpi_library_line",
           "mpi_implementation", "fingerprint", "FINGERPRINT_KEYS"]

#: What must match for two runs of one seed to be expected bit for bit alike.
FINGERPRINT_KEYS = ("cpu", "cpu_signature", "torch_cpu_capability", "torch", "numpy", "numba")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``; elsewhere what ``platform``
    knows), or ``"unknown"``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Processor", "cpu model"):
                    return " ".join(value.split()) or "unknown"
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_signature() -> str:
    """What tells CPUs of one model name apart (a VM may call them all "AMD EPYC"): vendor,
    family/model/stepping and a digest of the feature flags, from ``/proc/cpuinfo``, e.g.
    ``AuthenticAMD 25/17/1 flags 3f9c0a1b2c4d``; ``"unknown"`` where there is none."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break                      # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown"
    if not fields:
        return "unknown"
    flags = hashlib.sha1(" ".join(sorted(fields.get("flags", "").split())).encode()).hexdigest()[:12]
    return (f"{fields.get('vendor_id', '?')} {fields.get('cpu family', '?')}/{fields.get('model', '?')}/"
            f"{fields.get('stepping', '?')} flags {flags}")


def torch_cpu_capability() -> str | None:
    """The vector instruction set of torch's CPU kernels (e.g. ``AVX512``), or None when
    torch is not imported (or too old to say)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except AttributeError:
        return None


def mpi_library_version(mpi=None) -> str | None:
    """``MPI.Get_library_version()`` without the trailing NUL byte Open MPI returns and without
    surrounding whitespace; None when mpi4py.MPI is neither given nor imported."""
    mpi = mpi if mpi is not None else sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return None
    return mpi.Get_library_version().replace("\x00", "").strip()


def mpi_library_line(library: str | None) -> str:
    """The first line of an MPI library string with its runs of spaces collapsed, for one-line
    reports: ``MPICH Version: 5.0.2`` for MPICH's ``MPICH Version:      5.0.2``; ``unknown``
    for None or an empty string."""
    lines = (library or "").splitlines()
    return " ".join(lines[0].split()) if lines and lines[0].strip() else "unknown"


def mpi_implementation(library: str | None) -> str:
    """The MPI implementation a library string names: ``Open MPI``, ``MPICH``, ``Intel MPI``,
    ``MVAPICH``, ``Microsoft MPI`` or ``unknown``."""
    text = (library or "").lower()
    for marker, name in (("open mpi", "Open MPI"), ("openrte", "Open MPI"), ("intel", "Intel MPI"),
                         ("mvapich", "MVAPICH"), ("microsoft", "Microsoft MPI"), ("mpich", "MPICH")):
        if marker in text:
            return name
    return "unknown"


def fingerprint(versions: Mapping[str, object]) -> dict[str, object]:
    """The ``FINGERPRINT_KEYS`` of a versions record (``trace.collect_versions()``, or a
    trace's root attributes); None for a key the record lacks."""
    return {key: versions.get(key) for key in FINGERPRINT_KEYS}
