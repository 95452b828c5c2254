"""Root attributes: how values are stored, and the run metadata helpers.

Booleans, integers, floats, strings and numeric arrays are stored as native HDF5
attributes. ``None``, dicts, lists and tuples are stored as JSON text, and their names are
listed (as JSON) in the attribute ``json_attrs`` so that a reader decodes exactly those.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from typing import Any, Mapping

import h5py
import numpy as np

from ..machine import cpu_model, cpu_signature, mpi_library_version, torch_cpu_capability
from .schema import TraceError

__all__ = ["collect_versions", "slurm_ids", "encode_attr", "write_attrs", "read_attrs"]

JSON_ATTRS = "json_attrs"

_SLURM_VARIABLES = {
    "SLURM_JOB_ID": "job_id", "SLURM_ARRAY_JOB_ID": "array_job_id",
    "SLURM_ARRAY_TASK_ID": "array_task_id", "SLURM_RESTART_COUNT": "restart_count",
    "SLURM_JOB_NAME": "job_name", "SLURM_CLUSTER_NAME": "cluster",
    "SLURM_JOB_NODELIST": "nodelist", "SLURM_NTASKS": "ntasks",
}


def collect_versions() -> dict[str, str]:
    """Versions of Python, the numeric stack, HDF5 and MPI, and the machine they ran on (the
    CPU model, torch's CPU capability), for the ``versions`` attribute.

    Packages are looked up in the installed metadata, never imported; torch's capability
    and the MPI library string are included only when the caller has imported torch and
    ``mpi4py.MPI`` already.
    """
    versions = {"python": platform.python_version(), "platform": platform.platform(),
                "cpu": cpu_model(), "cpu_signature": cpu_signature(), "numpy": np.__version__, "h5py": h5py.__version__,
                "hdf5": h5py.version.hdf5_version}
    for dist in ("numba", "torch", "mpi4py"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    capability = torch_cpu_capability()
    if capability is not None:
        versions["torch_cpu_capability"] = capability
    library = mpi_library_version()
    if library is not None:
        versions["mpi_library"] = library
    return versions


def slurm_ids(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Slurm job, array and restart ids of the current job (empty outside Slurm)."""
    environ = os.environ if environ is None else environ
    return {key: environ[var] for var, key in _SLURM_VARIABLES.items() if environ.get(var)}


def encode_attr(name: str, value: Any) -> tuple[Any, bool]:
    """``(value as stored, stored as JSON?)``; TraceError for a value that cannot be stored."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value), False
    if isinstance(value, (int, np.integer)):
        if not -2**63 <= int(value) < 2**63:
            raise TraceError(f"attribute {name!r}: integer {value} does not fit in 64 bits")
        return np.int64(value), False
    if isinstance(value, (float, np.floating)):
        return np.float64(value), False
    if isinstance(value, str):
        return value, False
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf" and value.ndim >= 1:
        return value, False
    if value is None or isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value), True
        except (TypeError, ValueError) as exc:
            raise TraceError(f"attribute {name!r} is not JSON-serialisable: {exc}") from None
    raise TraceError(f"attribute {name!r}: cannot store a value of type {type(value).__name__}")


def write_attrs(obj: h5py.HLObject, attrs: Mapping[str, Any]) -> None:
    """Write ``attrs`` on ``obj`` (merging ``json_attrs`` with the names already there)."""
    json_names = set(json.loads(obj.attrs[JSON_ATTRS])) if JSON_ATTRS in obj.attrs else set()
    for name, value in attrs.items():
        stored, as_json = encode_attr(name, value)
        obj.attrs[name] = stored
        (json_names.add if as_json else json_names.discard)(name)
    obj.attrs[JSON_ATTRS] = json.dumps(sorted(json_names))


def read_attrs(obj: h5py.HLObject) -> dict[str, Any]:
    """Attributes of ``obj`` as Python values (JSON ones decoded, numpy scalars unwrapped)."""
    json_names = set(json.loads(obj.attrs[JSON_ATTRS])) if JSON_ATTRS in obj.attrs else set()
    result = {}
    for name, value in obj.attrs.items():
        if name == JSON_ATTRS:
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if name in json_names:
            value = json.loads(value)
        elif isinstance(value, np.generic):
            value = value.item()
        result[name] = value
    return result
