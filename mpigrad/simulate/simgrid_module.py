"""SimGrid's Python module, loaded on its own.

Debian's ``python3-simgrid`` (SimGrid 3.32) installs one extension file under
``/usr/lib/python3/dist-packages``. That directory is not put on ``sys.path``: it would
shadow the virtual environment's NumPy and the rest. :func:`load_simgrid` loads just that
file, once per process, as the module ``simgrid``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from ..errors import UsageError

__all__ = ["SIMGRID_PATH", "load_simgrid", "simgrid_path", "check_simgrid"]

#: Where ``apt-get install python3-simgrid`` puts the extension (Debian 12, Python 3.11).
SIMGRID_PATH = Path("/usr/lib/python3/dist-packages") / (
    f"simgrid.cpython-{sys.version_info.major}{sys.version_info.minor}-x86_64-linux-gnu.so")


def simgrid_path() -> Path:
    """The extension to load: ``MPIGRAD_SIMGRID`` (a path) where set, else :data:`SIMGRID_PATH`."""
    return Path(os.environ.get("MPIGRAD_SIMGRID") or SIMGRID_PATH)


def check_simgrid() -> None:
    """UsageError (one line, naming the fix) where the extension is not installed: what a
    simulation checks before it starts its child process (which loads it)."""
    path = simgrid_path()
    if not path.is_file():
        raise UsageError(f"SimGrid's Python module is not installed ({path} is missing): "
                         "apt-get install python3-simgrid")


def load_simgrid():
    """The ``simgrid`` module (S4U: ``Engine``, ``Actor``, ``Mailbox``, ``Comm``,
    ``this_actor``), loaded from :func:`simgrid_path` alone and kept in ``sys.modules``.
    UsageError (one line, naming the fix) where it is not installed or does not load."""
    loaded = sys.modules.get("simgrid")
    if loaded is not None:
        return loaded
    check_simgrid()
    path = simgrid_path()
    spec = importlib.util.spec_from_file_location("simgrid", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise UsageError(f"SimGrid's Python module {path} does not load ({exc}): apt-get install python3-simgrid "
                         "for this Python") from None
    sys.modules["simgrid"] = module
    return module
