"""The MPI side of the test suite's shared worlds (``tests/worlds.py``): a long-lived
``mpiexec -n N python -m mpi4py tests/world_server.py DIR`` that runs the scenarios the
tests hand it, one at a time, each on a communicator of its own.

Rank 0 polls DIR for ``K.request.json`` (K = 0, 1, ...: written whole by a rename) and
sends it to every rank. The first ``ranks`` ranks split off a communicator and run the
scenario on it, their file descriptors 1 and 2 redirected to ``K.R.out`` and ``K.R.err``,
the scenario's environment and folder set, then put back; each writes its exit code to
``K.R.code`` (written whole by a rename) last. The others wait for the next request. A
scenario is ``mpigrad train``'s options (``runtime/run/world.train_in_world``), ``mpigrad
sweep``'s runs file (``"command": "sweep"``: ``runtime/run/sweep.sweep_on``), a user's
script whose ``main(argv, comm=)`` takes a communicator (``"program"``), or a script
whose ``main(comm)`` returns an exit code (the harness's own tests). After each, a rank
that finds the process changed (``ProcessState.differences``: a thread left running, a
file left open, a value not put back) says so on its stderr and exits the scenario with
``LEFT_STATE``: sharing a world must not hide it. ``K.request.json`` with ``"quit"`` ends
the world. A failure that aborts (MPI_Abort) ends the world too: the harness sees its
exit, reads what the ranks wrote, and starts another for the next test.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from mpi4py import MPI

#: The exit code of a scenario after which the process was not as before it.
LEFT_STATE = 97
#: After the code of a rank that called MPI_Abort: the world is ending.
ABORTED = "aborted"
#: An idle rank's sleep between polls: short next to a run, long enough to cost no core.
_POLL_SECONDS = 0.02


def _write_whole(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _next_request(folder: Path, number: int) -> dict:
    path = folder / f"{number}.request.json"
    while not path.exists():
        time.sleep(_POLL_SECONDS)
    return json.loads(path.read_text())


def _receive(comm, request: dict | None) -> dict:
    """Rank 0 sends ``request`` to every rank; each waits asleep (not spinning: an idle rank
    must not take a core from a scenario's ranks)."""
    if comm.Get_rank() == 0:
        for rank in range(1, comm.Get_size()):
            comm.send(request, dest=rank, tag=7)
        return request
    pending = comm.irecv(source=0, tag=7)
    while True:
        done, request = pending.test()
        if done:
            return request
        time.sleep(_POLL_SECONDS)


@contextlib.contextmanager
def _redirected(out: Path, err: Path):
    """File descriptors 1 and 2 (Python's and C's output alike) into ``out`` and ``err``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out, "wb") as o, open(err, "wb") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _world_roots(world_path: list[str]) -> list[str]:
    """The folders whose modules belong to the world, never to one scenario: the world's
    import path, the interpreter's installation (a venv inside a scenario's folder is the
    world's), mpigrad's package (an editable install's source tree) and this harness."""
    import mpigrad

    roots = [*world_path, sys.prefix, sys.base_prefix, sys.exec_prefix,
             os.path.dirname(os.path.abspath(mpigrad.__file__)),
             os.path.dirname(os.path.abspath(__file__))]
    return [os.path.abspath(root) for root in roots if root]


def _the_scenarios_own(source: str | None, entries: list[str], world: list[str]) -> bool:
    """Whether a module first imported during a scenario, from file ``source``, was found
    through the scenario's own import entries (its folder, its ``$PYTHONPATH``) and not the
    world's roots (``_world_roots``): the longest root that holds the file decides (CI's venv lies inside the folder
    a documented command runs in; forgetting numba's lazily imported modules there would
    register their types twice)."""
    if not source:
        return False
    source = os.path.abspath(source)
    holders = [root for root in {*world, *entries} if source.startswith(root.rstrip(os.sep) + os.sep)]
    if not holders:
        return False
    return max(holders, key=len) not in world


@contextlib.contextmanager
def _scenario_environment(env: dict, cwd: str | None, program: str | None = None):
    """The scenario's variables and folder, and the import path a fresh process started
    there would have: first the folder (``python -m mpi4py -m mpigrad``) or the program's
    own (``python -m mpi4py PROGRAM``), then ``$PYTHONPATH``'s entries (a user's plugins).
    Afterwards all is put back, and the modules found through those entries are forgotten:
    the next scenario imports its own."""
    before = {name: os.environ.get(name) for name in env}
    folder = os.getcwd()
    path, modules = list(sys.path), set(sys.modules)
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if cwd:
        os.chdir(cwd)
    first = os.path.dirname(os.path.abspath(program)) if program else os.getcwd()
    entries = [first, *(os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                        if entry)]
    sys.path[:] = [*entries, *path[1:]]  # path[0]: this script's folder, which a run's would not have
    importlib.invalidate_caches()
    try:
        yield
    finally:
        world = _world_roots(path[1:])
        for name in set(sys.modules) - modules:
            if _the_scenarios_own(getattr(sys.modules[name], "__file__", None), entries, world):
                del sys.modules[name]
        sys.path[:] = path
        importlib.invalidate_caches()
        os.chdir(folder)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _AbortsTheWorld(MPI.Intracomm):
    """A scenario's communicator whose ``Abort`` aborts the world, as a fresh ``mpiexec``'s
    run aborts ``MPI_COMM_WORLD``: the launcher then reports the abort's code (an abort of a
    part of the world makes it kill the rest, and report that)."""

    #: Where this rank writes its exit code first (the launcher does not always report an
    #: abort's code: hydra gave 0 for one now and then).
    code_path: Path | None = None

    def Abort(self, errorcode: int = 0):  # noqa: N802 - mpi4py's name
        """Does not return, as a fresh process's abort: MPICH's MPI_Abort returned now and
        then on a loaded machine, and the rank went on to finish the scenario and overwrite
        its code file with the scenario's 0 (stop 69's CI read 1 for an abort of 5)."""
        sys.stdout.flush()
        sys.stderr.flush()
        if self.code_path is not None:
            _write_whole(self.code_path, f"{errorcode} {ABORTED}")
        MPI.COMM_WORLD.Abort(errorcode)
        os._exit(errorcode)


def _run_program(request: dict, comm) -> int:
    """A user's script (``program``: its path) as ``python -m mpi4py PROGRAM ARGV`` would run
    it, its ``main(argv, comm=comm)`` on the scenario's communicator; the global RNGs it
    seeded put back after it (a fresh process's would not carry over; anything else it
    leaves is named as left behind)."""
    import random

    import numpy as np
    import torch

    rngs = random.getstate(), np.random.get_state(), torch.get_rng_state()
    spec = importlib.util.spec_from_file_location("world_program", request["program"])
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        return int(module.main(list(request.get("argv", [])), comm=comm) or 0)
    except SystemExit as exc:  # argparse's refusal, a sys.exit(N)
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        random.setstate(rngs[0])
        np.random.set_state(rngs[1])
        torch.set_rng_state(rngs[2])


def _let_its_threads_end(before: frozenset, seconds: float = 5.0) -> None:
    """A program's objects collected and the threads they started given ``seconds`` to end,
    as a fresh process's exit would join them (a DataLoader's worker queues' feeder threads
    end once its iterator is collected); a thread still running then is named as left."""
    import gc
    import threading

    gc.collect()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(t.ident not in before and t.is_alive() for t in threading.enumerate()):
        time.sleep(0.05)


def _run_scenario(request: dict, comm) -> int:
    if "program" in request:
        return _run_program(request, comm)
    if "script" in request:
        spec = importlib.util.spec_from_file_location("world_scenario", request["script"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return int(module.main(comm, *request.get("args", [])) or 0)
    from mpigrad.errors import UsageError
    from mpigrad.runtime.run.sweep import sweep_on
    from mpigrad.runtime.run.world import train_in_world

    command = request.get("command", "train")
    try:
        if command == "sweep":  # ``mpigrad sweep RUNS``
            runs, = request["argv"]
            return sweep_on(Path(runs), comm)
        return train_in_world(request["argv"], comm)
    except UsageError as exc:  # refused on every rank alike (the runs file's own checks), one line from rank 0
        if comm.Get_rank() == 0:
            print(f"mpigrad {command}: error: {exc}", file=sys.stderr, flush=True)
        return 2


def serve(folder: Path) -> None:
    from mpigrad.runtime.run.launch import save_coverage
    from mpigrad.runtime.run.world import ProcessState

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    number = 0
    while True:
        request = _receive(world, _next_request(folder, number) if rank == 0 else None)
        if request.get("quit"):
            return
        inside = rank < request["ranks"]
        comm = world.Split(0 if inside else MPI.UNDEFINED, rank)
        if inside:
            state = ProcessState.taken()
            with _redirected(folder / f"{number}.{rank}.out", folder / f"{number}.{rank}.err"):
                with _scenario_environment(request.get("env", {}), request.get("cwd"), request.get("program")):
                    scenario_comm = _AbortsTheWorld(comm)
                    scenario_comm.code_path = folder / f"{number}.{rank}.code"
                    code = _run_scenario(request, scenario_comm)
                if "program" in request:
                    _let_its_threads_end(state.threads)
                left = state.differences()
                if left:
                    print(f"world: rank {rank} left the process changed after the scenario: {'; '.join(left)}",
                          file=sys.stderr, flush=True)
                    code = LEFT_STATE
            comm.Free()
            save_coverage()  # a coverage run's data so far: a later scenario's abort would lose it
            _write_whole(folder / f"{number}.{rank}.code", str(code))
        number += 1


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
