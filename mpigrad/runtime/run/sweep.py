"""``mpigrad sweep RUNS``: the runs of a file one after another inside one MPI job, in the
same processes (:func:`.world.train_in_world`), so that the job pays its start-up (imports,
Numba's cache, MPI's wire-up) once, not once per run.

Each non-blank line of RUNS (``#`` starts a comment) holds one run's ``mpigrad train``
options, split as a shell would (``shlex``), each with its own ``--trace``::

    --config examples/compare/fix4.toml --trace runs/fix4.h5
    --config examples/compare/mqgrad.toml --trace runs/mqgrad.h5 --seed 2

Launched as ``mpigrad train`` is (``mpiexec -n P+1 python -m mpi4py -m mpigrad sweep
RUNS``, or ``srun``). A line whose trace is complete is skipped, one whose trace stopped at
a checkpoint resumes (``--resume`` added): so a requeued job goes on where it stopped. A
line the launch checks refuse (bad options, a taken trace, a checkpoint from another
configuration) is reported and the next run starts; the sweep then exits 2. A run stopped
by a signal or ``--walltime`` (exit 75, its checkpoint written) ends the sweep with 75, for
Slurm to requeue it; a rank's failure during a run aborts the job (MPI_Abort), as it would
``mpigrad train``'s.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from ...errors import UsageError
from .. import EXIT_REQUEUE
from .launch import EXIT_USAGE

__all__ = ["read_runs", "add_arguments", "run", "sweep_on"]


def read_runs(path: Path) -> list[tuple[int, list[str]]]:
    """Each run of the file: (its line number, its options). UsageError (one line) where the
    file cannot be read, a line does not split, or none holds a run."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read the runs file {path}: {exc.strerror or exc}") from None
    runs = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            argv = shlex.split(line, comments=True)
        except ValueError as exc:
            raise UsageError(f"{path}, line {number}: {exc}") from None
        if argv:
            runs.append((number, argv))
    if not runs:
        raise UsageError(f"{path} holds no run (one line of mpigrad train options per run)")
    return runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", type=Path, metavar="RUNS",
                        help="a file of runs: one line of mpigrad train options each (# comments)")


def _planned(argv: list[str]) -> tuple[list[str] | None, str]:
    """The options to run a line with (None: skip it) and what the log says of it: a
    complete trace is skipped, a stopped one resumed."""
    from .preflight import trace_status
    from .world import train_parser

    try:
        args = train_parser().parse_args(argv)
    except UsageError:
        return argv, ""  # the run's own check reports it
    trace = Path(args.trace) if args.trace else None
    status = trace_status(trace) if trace is not None and trace.is_file() else None
    if status == "complete":
        return None, f"skipped: {trace} is complete"
    if status == "stopped" and not args.resume:
        return [*argv, "--resume"], f"resumed: {trace} stopped at a checkpoint"
    return argv, ""


def run(args: argparse.Namespace) -> int:
    """The launched sweep: every rank ends together with the sweep's code where it is not
    0 (75 after a stopped run, 2 after a refused line), as ``mpigrad train`` ends, not
    through ``python -m mpi4py``'s MPI_Abort of a non-zero exit."""
    from mpi4py import MPI

    from .launch import end_together

    code = sweep_on(args.runs, MPI.COMM_WORLD, time.monotonic())
    if code:
        end_together(MPI.COMM_WORLD, code)
    return code


def sweep_on(path: Path, comm, started: float | None = None) -> int:
    """The runs of the file ``path`` one after another on the ranks of ``comm``; collective.
    ``started`` (time.monotonic): when the job began, which each run's ``--walltime``
    counts from (default: now). Returns 0, ``EXIT_REQUEUE`` (a run stopped) or 2 (a line
    refused); UsageError where the file holds no runs."""
    started = time.monotonic() if started is None else started
    runs = read_runs(path)
    from ..wire.mpi import bcast_asleep
    from .world import CHECK_SECONDS, train_in_world

    rank = comm.Get_rank()
    refused = 0
    for index, (number, argv) in enumerate(runs, 1):
        planned, why = bcast_asleep(comm, _planned(argv) if rank == 0 else None, CHECK_SECONDS,
                                    "rank 0 did not read the next run's line")
        head = f"mpigrad sweep: run {index}/{len(runs)} (line {number})"
        if rank == 0:
            print(f"{head}: {why}" if why else f"{head}: {shlex.join(planned)}", flush=True)
        if planned is None:
            continue
        began = time.monotonic()
        code = train_in_world(planned, comm, started)
        if rank == 0:
            print(f"{head}: exit {code} after {time.monotonic() - began:.1f} s", flush=True)
        if code == EXIT_REQUEUE:
            return EXIT_REQUEUE  # the job is stopping: the later runs wait for the requeue
        refused += code == EXIT_USAGE
    if rank == 0 and refused:
        print(f"mpigrad sweep: {refused} of {len(runs)} run(s) refused (exit 2 above)", file=sys.stderr, flush=True)
    return EXIT_USAGE if refused else 0
