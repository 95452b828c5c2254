"""Stand-in for ``python -m mpi4py -m mpigrad train`` in the jobscript tests.

Honours the train command's contract as the jobscripts rely on it:

- ``--config FILE --trace PATH [--resume]``, ``--walltime`` and ``--checkpoint-every`` (accepted,
  not acted on); ``iterations`` is read from the TOML config;
- every rank turns SIGUSR1/SIGTERM into a flag; rank 0 stops all ranks at the next
  iteration boundary, writes a checkpoint next to the trace and every rank exits 75;
- ``--resume`` continues from that checkpoint (exit 2 without one); without ``--resume``
  an existing trace is never overwritten (exit 2); a finished run exits 0.

The "trace" is a text file with one JSON row per iteration; the checkpoint is
``PATH.ckpt.json``. Each rank appends a record of its start (argv, world size, thread and
cache variables, first iteration, exit code) to ``$FAKE_STEP_LOG`` when that is set.
Per-iteration sleep: ``$FAKE_STEP_SECONDS`` (default 0.05). With
``$FAKE_STEP_HOLD_TRACE`` equal to ``--trace`` (and no ``--resume``), rank 0 holds at
iteration 2, rows 0 and 1 written, until a stop signal arrives (at most 30 s): a test that
signals once the trace exists then always catches the run midway.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import tomllib

from mpi4py import MPI

EXIT_REQUEUE = 75
HOLD_AT = 2
HOLD_SECONDS = 30.0
RECORDED_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                      "NUMBA_NUM_THREADS", "SRUN_CPUS_PER_TASK", "NUMBA_CACHE_DIR",
                      "HDF5_USE_FILE_LOCKING", "PYTHONUNBUFFERED", "SLURM_JOB_ID",
                      "SLURM_RESTART_COUNT", "SLURM_NTASKS", "SLURM_PROCID", "SLURMD_NODENAME",
                      "CUDA_VISIBLE_DEVICES")

stop_requested = False


def _request_stop(signum, frame):
    global stop_requested
    stop_requested = True


def _record(entry: dict) -> None:
    log = os.environ.get("FAKE_STEP_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _start_iteration(args) -> tuple[int, int]:
    """(first iteration, exit code if the run cannot start) -- decided on rank 0."""
    checkpoint = args.trace + ".ckpt.json"
    if args.resume:
        if not os.path.exists(checkpoint):
            return 0, 2
        with open(checkpoint) as f:
            start = json.load(f)["iteration"]
        with open(args.trace) as f:    # drop rows written after the checkpoint
            rows = [line for line in f if json.loads(line)["iteration"] < start]
        with open(args.trace, "w") as f:
            f.writelines(rows)
        return start, 0
    if os.path.exists(args.trace):
        return 0, 2
    return 0, 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="fake_step")
    parser.add_argument("--config", required=True)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--resume", action="store_true")
    # Added by the jobscripts; accepted (and recorded in argv) as mpigrad train does.
    parser.add_argument("--walltime")
    parser.add_argument("--checkpoint-every")
    args = parser.parse_args()
    signal.signal(signal.SIGUSR1, _request_stop)
    signal.signal(signal.SIGTERM, _request_stop)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    with open(args.config, "rb") as f:
        iterations = int(tomllib.load(f)["iterations"])
    pause = float(os.environ.get("FAKE_STEP_SECONDS", "0.05"))
    hold = os.environ.get("FAKE_STEP_HOLD_TRACE") == args.trace and not args.resume

    start, code = _start_iteration(args) if rank == 0 else (0, 0)
    start, code = comm.bcast((start, code), root=0)
    record = {"argv": sys.argv[1:], "rank": rank, "size": comm.Get_size(), "start": start,
              "env": {name: os.environ.get(name) for name in RECORDED_VARIABLES}}
    if code:
        _record({**record, "exit": code})
        return code
    trace = open(args.trace, "a") if rank == 0 else None
    iteration = start
    while iteration < iterations:
        if rank == 0 and hold and iteration == HOLD_AT:
            deadline = time.monotonic() + HOLD_SECONDS
            while not stop_requested and time.monotonic() < deadline:
                time.sleep(0.01)
        if comm.bcast(stop_requested if rank == 0 else None, root=0):
            if rank == 0:
                trace.close()
                with open(args.trace + ".ckpt.json", "w") as f:
                    json.dump({"iteration": iteration}, f)
            _record({**record, "stopped_at": iteration, "exit": EXIT_REQUEUE})
            return EXIT_REQUEUE
        if rank == 0:
            trace.write(json.dumps({"iteration": iteration}) + "\n")
            trace.flush()
        time.sleep(pause)
        iteration += 1
    if rank == 0:
        trace.close()
    _record({**record, "exit": 0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
