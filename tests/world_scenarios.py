"""Scenarios of the world harness's own tests (``tests/test_worlds.py``), run by
``tests/world_server.py`` as ``main(comm, kind)`` on the scenario's communicator."""

from __future__ import annotations

import sys
import threading
import time

#: Set by the ``leak-thread`` scenario; never set: its thread runs until the world ends.
_forever = threading.Event()


def main(comm, kind: str) -> int:
    rank = comm.Get_rank()
    print(f"scenario {kind}: rank {rank} of {comm.Get_size()}", flush=True)
    if kind == "ok":
        return 0
    if kind == "exit-3":
        print(f"rank {rank} says no", file=sys.stderr, flush=True)
        return 3 if rank == 1 else 0
    if kind == "leak-thread" and rank == 1:
        threading.Thread(target=_forever.wait, name="scenario-leak", daemon=True).start()
    if kind == "leak-env" and rank == 0:
        import os
        os.environ["MPIGRAD_SCENARIO_LEFT"] = "1"
        import torch
        torch.set_num_threads(torch.get_num_threads() + 1)
    if kind == "abort":
        comm.Barrier()  # every rank has printed
        if rank == 1:
            comm.Abort(5)
    if kind == "hang":
        time.sleep(600)
    if kind == "venv-module":  # a module of the world's installation, first imported by a scenario
        import iniconfig
        print(f"rank {rank}: {id(sys.modules['iniconfig'])} {iniconfig.__file__}", flush=True)
    if kind == "import":  # a user's plugin, from the folder or $PYTHONPATH as a fresh process finds it
        try:
            import probe_plugin
        except ImportError as exc:
            print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
            return 4
        print(f"rank {rank}: {probe_plugin.VALUE}", flush=True)
    return 0
