"""Runs that share a world: ``mpigrad train`` runs one after another in the same processes,
each a call on a communicator (:func:`train_in_world`), with nothing one run leaves behind
reaching the next (:class:`ProcessState`).

A run changes its process: torch's and Numba's thread counts, TF32, the global RNGs, the
thread variables, the stop signals' handlers, the rank's bound GPU, the device warm-up's
record, the waiting mode, the loaded data set, the plugin codecs and policies it admitted.
:class:`ProcessState` takes all of that before a run and puts it back after, and names what
is still different (:meth:`ProcessState.differences`): a thread left running, an HDF5 file
left open, a value it could not put back. What is meant to carry over, carries: imported
modules, Numba's compiled kernels (the next run's warm-up finds them compiled), torch's
started pools.

A failure during a run (a rank's error, a silent peer) cannot leave the ranks in step for
another: it aborts the world, as ``mpigrad train`` does (:func:`.launch.run_on`). A run the
launch checks refuse (every rank alike, before any work) returns 2 and the world goes on.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import h5py
import numba
import numpy as np
import torch

from ...codecs.base import CODECS
from ...errors import UsageError
from ...policies.base import POLICIES
from ..exchange import build, warmup
from ..plan import gpu
from ..wire import channel
from ..wire.mpi import barrier, bcast_asleep
from ..plan.checks import check_options, check_trace
from ..plan.environment import THREAD_VARIABLES
from ..roles.stopping import STOP_SIGNALS
from . import launch
from .launch import EXIT_USAGE, config_from_args, run_on

__all__ = ["ProcessState", "train_in_world", "train_parser"]


#: How long the ranks of a shared world wait for rank 0's check of a run's options or of a
#: sweep's next line (its trace read on a slow shared filesystem included).
CHECK_SECONDS = 600.0

#: The registries that admit plugin classes by spec (a run's ``--codec pkg.mod:Class``).
_PLUGIN_REGISTRIES = (CODECS, POLICIES)


def _module_state() -> dict[str, Any]:
    """The runtime's module-level state a run sets, by name."""
    return {"bound GPU (plan.gpu)": gpu._bound, "device warm-up record (exchange.warmup)": warmup._device_warmed,
            "waiting mode (wire.channel)": channel._spin, "loaded data sets (exchange.build)": dict(build._loaded),
            **{f"loaded {registry.kind} plugins": registry.plugins_loaded() for registry in _PLUGIN_REGISTRIES}}


def _restore_module_state(state: dict[str, Any]) -> None:
    gpu._bound = state["bound GPU (plan.gpu)"]
    warmup._device_warmed = state["device warm-up record (exchange.warmup)"]
    channel._spin = state["waiting mode (wire.channel)"]
    build._loaded.clear()  # the run's data set released, the one loaded before it (if any) back
    build._loaded.update(state["loaded data sets (exchange.build)"])
    for registry in _PLUGIN_REGISTRIES:  # the next run admits its own plugins (a world forgets their modules)
        registry.forget_plugins_since(state[f"loaded {registry.kind} plugins"])


def _open_hdf5_files() -> int:
    return len(h5py.h5f.get_obj_ids(types=h5py.h5f.OBJ_FILE))


@dataclass
class ProcessState:
    """What one run may change in its process, taken at a moment (:meth:`taken`).

    :meth:`restore` puts back what can be put back; :meth:`differences` names, in one line
    each, what differs between this state and the process's now (after a restore: what a run
    left behind that the next would inherit)."""

    values: dict[str, Any] = field(default_factory=dict)
    rng: tuple = ()
    threads: frozenset[int] = frozenset()
    hdf5_files: int = 0

    @classmethod
    def taken(cls) -> "ProcessState":
        values = {
            "torch threads": torch.get_num_threads(),
            "Numba threads": numba.get_num_threads(),
            "TF32 matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "TF32 cuDNN": bool(torch.backends.cudnn.allow_tf32),
            **{f"${name}": os.environ.get(name) for name in THREAD_VARIABLES},
            **{f"handler of {signal.Signals(sig).name}": signal.getsignal(sig) for sig in STOP_SIGNALS},
            **_module_state(),
        }
        rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        return cls(values, rng, frozenset(t.ident for t in threading.enumerate()), _open_hdf5_files())

    def restore(self, rng: bool = True) -> None:
        """Put the process back as it was when taken (threads and files excepted: they are
        the run's to end, and :meth:`differences` names them); ``rng=False``: the global
        RNGs excepted too (a script's Session: they are the script's own)."""
        values = self.values
        torch.set_num_threads(values["torch threads"])
        numba.set_num_threads(values["Numba threads"])
        torch.backends.cuda.matmul.allow_tf32 = values["TF32 matmul"]
        torch.backends.cudnn.allow_tf32 = values["TF32 cuDNN"]
        for name in THREAD_VARIABLES:
            if values[f"${name}"] is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = values[f"${name}"]
        for sig in STOP_SIGNALS:
            signal.signal(sig, values[f"handler of {signal.Signals(sig).name}"])
        _restore_module_state(values)
        if not rng:
            return
        python, numpy, torch_rng = self.rng
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(torch_rng)

    def differences(self) -> list[str]:
        """What differs now from this state, one line each (empty: nothing)."""
        now = ProcessState.taken()
        lines = [f"{name}: {_shown(self.values.get(name))!r} before, {_shown(value)!r} now"
                 for name, value in now.values.items() if value != self.values.get(name)]
        python, numpy, torch_rng = self.rng
        if random.getstate() != python:
            lines.append("Python's global RNG moved")
        if not _same_numpy_rng(np.random.get_state(), numpy):
            lines.append("NumPy's global RNG moved")
        if not bool((now.rng[2] == torch_rng).all()):
            lines.append("torch's global RNG moved")
        started = sorted(t.name for t in threading.enumerate() if t.ident not in self.threads and t.is_alive())
        if started:
            lines.append(f"thread(s) still running: {', '.join(started)}")
        if now.hdf5_files > self.hdf5_files:
            lines.append(f"{now.hdf5_files - self.hdf5_files} HDF5 file(s) left open")
        return lines


def _shown(value: Any) -> Any:
    """A value as a difference line shows it: a table (loaded data sets, plugins) by its names."""
    if isinstance(value, tuple) and value and isinstance(value[0], dict):  # a registry's plugin tables
        value = value[0]
    return sorted(map(str, value)) if isinstance(value, dict) else value


def _same_numpy_rng(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


class _RaisingParser(argparse.ArgumentParser):
    """``mpigrad train``'s options, a bad one a UsageError (one line), not an exit."""

    def error(self, message: str):
        raise UsageError(f"{message} (see mpigrad train --help)")


def train_parser() -> argparse.ArgumentParser:
    """A parser of ``mpigrad train``'s options (what follows ``mpigrad train``)."""
    parser = _RaisingParser(prog="mpigrad train", add_help=False)
    launch.add_arguments(parser)
    return parser


def _refusal(argv: list[str]):
    """(config, None), or (None, the one line) where the options or the trace path refuse the
    run (the checks ``mpigrad train`` runs before MPI)."""
    try:
        args = train_parser().parse_args(argv)
        if args.check or args.ranks is not None:
            raise UsageError("--check and --ranks check a job in one process: not a run of a shared world")
        config = config_from_args(args)
        check_options(config)
        check_trace(config)
    except UsageError as exc:
        return None, str(exc)
    return config, None


def train_in_world(argv: list[str], comm, started: float | None = None, log=print) -> int:
    """One ``mpigrad train`` run with the options ``argv`` (what follows ``mpigrad train``)
    on the ranks of ``comm``, in this process; collective. Rank 0 checks the options and
    the trace path and sends every rank its config (so that all agree); then the run goes as
    under ``mpigrad train`` (:func:`.launch.run_on`). ``started`` (time.monotonic): when
    the job began, which ``--walltime`` counts from. Returns 0, ``EXIT_REQUEUE`` (75: stopped
    with a checkpoint) or 2 (refused before any work: rank 0 printed why); the process is
    then as it was before (:class:`ProcessState`)."""
    state = ProcessState.taken()
    try:
        config, problem = bcast_asleep(comm, _refusal(argv) if comm.Get_rank() == 0 else None, CHECK_SECONDS,
                                       "rank 0 did not check the run's options")
        if problem is not None:
            if comm.Get_rank() == 0:
                print(f"mpigrad train: error: {problem}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        if comm.Get_rank() == 0:
            for note in config.notes:
                log(note)
        code = run_on(config, comm, ["mpigrad", "train", *argv], time.monotonic() if started is None else started)
        # Every rank done with the run's files before the next run's checks (asleep: rank 0
        # closes the trace while the workers wait).
        barrier(comm, config.timeout, "a rank did not finish the run")
        return code
    finally:
        state.restore()
