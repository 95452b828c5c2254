"""mpigrad: communication-efficient data-parallel training over MPI.

The library API (docs/api.rst): :class:`Session` around a script's own model and loop,
:class:`Exchanged` (what one exchange did), :class:`UsageError` (a bad option or use, in one
line), ``EXIT_REQUEUE`` (75: the exit code of a run stopped for a requeue). They load on first use, so that ``import mpigrad`` stays light (no MPI, torch or Numba).
"""

__version__ = "0.1.0"

__all__ = ["Session", "Exchanged", "UsageError", "EXIT_REQUEUE", "__version__"]


def __getattr__(name: str):
    if name in ("Session", "Exchanged"):
        from . import api

        return getattr(api, name)
    if name == "EXIT_REQUEUE":  # a run stopped for a requeue exits with it
        from .runtime import EXIT_REQUEUE

        return EXIT_REQUEUE
    if name == "UsageError":
        from .errors import UsageError

        return UsageError
    raise AttributeError(f"module 'mpigrad' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's globals and the names ``__getattr__`` loads on first use (``__all__``),
    so that ``dir(mpigrad)`` and tab completion show the API before it is loaded."""
    return sorted(set(globals()) | set(__all__))
