"""``mpigrad train``: parse options on every rank, check the launch, dispatch by rank.

Launch with ``mpiexec -n P+1 python -m mpi4py -m mpigrad train [options]`` (or ``srun``):
rank 0 is the parameter server, ranks 1..P are workers. ``python -m mpi4py`` makes an
uncaught exception abort every rank instead of leaving the others hanging.
``mpigrad train --check [--ranks N] [options]`` checks a job in one process, without MPI
(``jobcheck.check_job``), and exits 0 with a short report or 2 with one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Iterable, NoReturn

from ...config import DEFAULT_LR, OPTIONS, Option, RunConfig, parse_assignments
from ...errors import UsageError
from ...units import format_rate
from ..plan.environment import apply_thread_settings, export_thread_variables, threads_per_rank

EXIT_FAILURE = 1
EXIT_USAGE = 2


#: The groups of ``train --help``, in order; each option's declaration names its group
#: (config.Option.group), and within a group the options follow the field order of RunConfig
#: (but for an option's ``shown_before``).
GROUPS = ("run", "model and data", "quantization", "parameter servers", "network model", "output", "robustness")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` options, generated from RunConfig's declarations (config.OPTIONS) after
    the launch's own ``--config``, ``--check`` and ``--ranks``; every default is None so a
    --config file is not overridden."""
    d = RunConfig()
    parser.epilog = (f"Defaults follow the MQGrad paper ({d.codec} codec, {d.policy} policy from {d.bits} bits, "
                     f"batch {d.batch_size}, {format_rate(d.bandwidth, bits=False)}; lr {DEFAULT_LR['cifar10']} on "
                     f"cifar10, {DEFAULT_LR[d.data]} on the default {d.data}). "
                     "Launch: mpiexec -n P+1 python -m mpi4py -m mpigrad train")
    parser.formatter_class = RegistryHelpFormatter
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    _add_launch_arguments(groups["run"])
    for declared in help_order(OPTIONS.values()):
        groups[declared.group].add_argument(declared.flag, **declared.arguments())


def _add_launch_arguments(group) -> None:
    """``--config``, ``--check`` and ``--ranks``: options of the launch, not of the run (no
    RunConfig field; ``config_from_args`` leaves them out)."""
    group.add_argument("--config", metavar="FILE", help="TOML file whose keys mirror these options")
    group.add_argument("--check", action="store_true", help="check the job and exit, in this one process, without "
                       "mpiexec (on a login node, before it queues): the options, the trace path, the data, model, "
                       "layout and optimizer, and the world of --ranks N ranks (else SLURM_NTASKS, else the "
                       "config's '# ranks' line); prints a short report and exits 0, or one line and exits 2")
    group.add_argument("--ranks", type=int, metavar="N", help="with --check: the world size to check the job for "
                       "(the N of mpiexec -n N)")


def help_order(declarations: Iterable[Option]) -> list[Option]:
    """The options with a flag, in the order ``--help`` lists them (the usage line too): by
    group (``GROUPS``), within one in field order, each option with ``shown_before`` moved
    just ahead of the option it names (ValueError if that one is not in its group)."""
    flagged = [declared for declared in declarations if declared.flag is not None]
    order = [declared for declared in flagged if declared.shown_before is None]
    for declared in flagged:
        if declared.shown_before is not None:
            names = [(other.name, other.group) for other in order]
            order.insert(names.index((declared.shown_before, declared.group)), declared)
    return sorted(order, key=lambda declared: GROUPS.index(declared.group))


class RegistryHelpFormatter(argparse.HelpFormatter):
    """Fills ``%(codecs)s`` and ``%(policies)s`` in option help from the registries, only
    when help is printed (the codec registry imports Numba)."""

    def _expand_help(self, action: argparse.Action) -> str:
        if "%(codecs)s" in (action.help or "") or "%(policies)s" in (action.help or ""):
            from ...codecs import available as codecs
            from ...policies import available as policies

            action = argparse.Action(action.option_strings, action.dest, help=action.help % {
                "codecs": " | ".join(codecs()), "policies": " | ".join(policies())})
        return super()._expand_help(action)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    overrides = {key: value for key, value in vars(args).items()
                 if key not in ("config", "check", "ranks") and not key.endswith("_opt")}
    for option in OPTIONS.values():
        if option.table and option.flag:  # --NAME-opt KEY=VALUE, repeated: the NAME_opts table
            overrides[option.name] = parse_assignments(getattr(args, option.flag[2:].replace("-", "_")), option.flag)
    return RunConfig.from_sources(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    """Check the options before MPI, torch or data start (every rank alike, so a bad option
    ends each rank with exit 2 and one line from rank 0, fast); then launch checks and work."""
    started = time.monotonic()
    if getattr(args, "ranks", None) is not None and not getattr(args, "check", False):
        raise UsageError("--ranks goes with --check (a launched run's world size is mpiexec's -n)")
    config = config_from_args(args)
    export_thread_variables(threads_per_rank(config.threads))  # before Numba's pool starts
    if getattr(args, "check", False):
        return check_only(config, args.ranks)
    from ...mpiexec import launch_rank
    from ..plan.checks import check_options, check_trace

    check_options(config)  # UsageError: cli prints it (rank 0 only) and exits 2
    check_trace(config)  # a directory, or an existing trace without --force
    if launch_rank() == 0:
        for note in config.notes:
            print(note, flush=True)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    code = run_on(config, comm, sys.argv, started)
    if code:
        end_together(comm, code)  # e.g. 75 after a checkpoint, 2 on a launch check's refusal
    return code


def run_on(config: RunConfig, comm, argv: list[str], started: float | None = None) -> int:
    """One run of ``config`` on the ranks of ``comm``, collective: the launch checks, the
    rank's GPU, then its part of the run. Returns 0 (done), ``EXIT_REQUEUE`` (stopped with
    a checkpoint) or ``EXIT_USAGE`` where the launch checks refused it (every rank alike,
    before any work: rank 0 printed the line). A failure during the run (a usage error one
    rank found, a rank's error, a silent peer) cannot leave the ranks in step: it aborts
    ``comm`` (MPI_Abort) with exit 2 or 1, the error printed first."""
    rank = comm.Get_rank()
    try:
        # Before torch starts its thread pools.
        apply_thread_settings(threads_per_rank(config.threads))
        from .preflight import check_launch
        check_launch(config, comm)
        from ..plan.gpu import bind_rank
        bind_rank(config, comm)  # the rank's GPU (UsageError on every rank alike) and TF32
    except UsageError as exc:
        # Every rank gets here together (the checks are deterministic or broadcast).
        if rank == 0:
            print(f"mpigrad train: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    from .session import run_rank
    try:
        return run_rank(config, comm, argv, started)
    except UsageError as exc:
        if rank == 0:
            print(f"mpigrad train: error: {exc}", file=sys.stderr, flush=True)
        abort_world(comm, EXIT_USAGE)
    except Exception as exc:  # noqa: BLE001 - every rank must end, not hang
        from ...trace.writer import TraceExists
        if isinstance(exc, TraceExists):  # another run took the trace path after the launch checks
            print(f"mpigrad train: error: {exc}", file=sys.stderr, flush=True)
            abort_world(comm, EXIT_USAGE)  # a clash, as the launch checks refuse it: not a failure
        if os.environ.get("MPIGRAD_DEBUG"):
            traceback.print_exc()
        print(f"mpigrad train: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        from .follower import RankFailure
        if isinstance(exc, RankFailure):
            exc.report()  # rank 0 closes the trace "failed" and ends the run (returns if it does not)
        abort_world(comm, EXIT_FAILURE)
    return EXIT_FAILURE


def check_only(config: RunConfig, ranks: int | None) -> int:
    """``mpigrad train --check``: the config's notes, then ``jobcheck.check_job``'s report on
    stdout and 0 (UsageError, one line and exit 2 through the cli, on the first problem)."""
    began = time.monotonic()
    from .jobcheck import check_job

    for note in config.notes:
        print(note, flush=True)
    lines = check_job(config, ranks)
    for line in lines:
        print(line)
    print(f"mpigrad train --check: ok in {time.monotonic() - began:.1f} s (no rank started)", flush=True)
    return 0


def abort_world(comm, code: int) -> NoReturn:
    """MPI_Abort every rank, after giving the launcher a moment to forward our last message
    (an abort can kill its output forwarding before the line gets out). Does not return:
    MPICH's MPI_Abort returned now and then on a loaded machine before its launcher killed
    the rank (the test worlds' rank went on and wrote its code, stop 69's CI), and a rank
    that goes on after an abort may write what it must not."""
    time.sleep(_FORWARD_SECONDS)
    comm.Abort(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_FORWARD_SECONDS = 0.5


def end_together(comm, code: int) -> NoReturn:
    """Finalize every rank cleanly, then exit each with ``code`` (a non-zero one from rank 0
    first).

    A finalized MPI exits with a non-zero code instead of calling MPI_Abort (whose banner
    would follow the one-line error, and which kills ranks that may still be writing).
    Only for paths that every rank reaches together, with every file closed.
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    comm.Barrier()
    MPI.Finalize()
    if code and rank:
        # Rank 0 (which printed the one line) exits first: Open MPI's launcher ends the job at
        # the first non-zero exit, and output of a rank it then kills can be lost.
        time.sleep(_FORWARD_SECONDS)
    # Every file is closed (trace) or fsynced (checkpoint) by now: skip the interpreter's
    # teardown of torch, Numba and h5py, which takes seconds per rank (a stop near the
    # walltime should not spend them; measured in the issue-13 report).
    _exit_skipping_teardown(code)


def save_coverage() -> None:
    """Where coverage.py measures this process (a coverage run of the test suite), write what
    it measured so far: an exit that skips Python's exit handlers (below), or a test world's
    abort, would lose it. Nothing otherwise."""
    coverage = sys.modules.get("coverage")
    current = getattr(getattr(coverage, "Coverage", None), "current", None)
    measuring = current() if current is not None else None
    if measuring is not None:
        measuring.save()


def _exit_skipping_teardown(code: int) -> NoReturn:
    """Exit through the C library's ``exit``: its atexit handlers run, Python's do not.

    Not ``os._exit``: MPICH tells its process manager that a rank finished from a C atexit
    handler (PMI finalize), and hydra SIGKILLs the ranks still running when one exits
    without it, so ``mpiexec`` reported 9 instead of ``code`` whenever a rank was late.
    """
    save_coverage()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import ctypes

        libc_exit = ctypes.PyDLL(None).exit  # PyDLL: the GIL stays held while C tears down
    except (ImportError, OSError, AttributeError):  # no C library to load: lose only the handlers
        os._exit(code)
    libc_exit(code)
    os._exit(code)  # not reached
