"""mpigrad: communication-efficient data-parallel training over MPI.

The library API (docs/api.rst): :class:`Session` around a script's own model and loop,
:class:`Exchanged` (what one exchange did), :class:`UsageError` (a bad option or use, in one
line). They load on first use, so that ``import mpigrad`` stays light (no MPI, torch or Numba).
"""

__version__ = "0.1.0"

__all__ = ["Session", "Exchanged", "UsageError", "__version__"]


def __getattr__(name: str):
    if name in ("Session", "Exchanged"):
        from . import api

        return getattr(api, name)
    if name == "UsageError":
        from .errors import UsageError

        return UsageError
    raise AttributeError(f"module 'mpigrad' has no attribute {name!r}")
