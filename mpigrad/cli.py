"""The ``mpigrad`` command: ``mpigrad COMMAND [options]``.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; only the chosen command's module is imported, so ``mpigrad trace``
works on a laptop without MPI.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from . import __version__
from .errors import UsageError
from .mpiexec import launch_rank

COMMANDS = {
    "train": ("mpigrad.runtime.run.launch", "train a CNN data-parallel over MPI (run under mpiexec/srun)"),
    "trace": ("mpigrad.analysis.cli", "summarise, tabulate, plot and export HDF5 traces"),
    "bench": ("mpigrad.bench", "throughput benchmarks (codecs, iteration overhead)"),
    "data": ("mpigrad.data.cli", "fetch and verify datasets on a login node"),
    "sweep": ("mpigrad.runtime.run.sweep", "run a file's mpigrad train runs one after another in one MPI job"),
    "simulate": ("mpigrad.simulate.cli", "replay mpigrad's iterations and DDP's on a SimGrid platform at any scale"),
    "doctor": ("mpigrad.runtime.run.doctor", "check the MPI launch, threads and versions"),
    "lab": ("mpigrad.lab.cli", "run on real rate-limited links: network namespaces on one machine (root)"),
}




#: Seconds a rank other than 0 waits before it exits on a usage error. Under mpiexec every
#: rank fails alike and only rank 0 prints; Open MPI's launcher ends the job at the first
#: non-zero exit, and a rank 0 it kills before its line is forwarded says nothing (CI lost
#: "unknown codec 'nope'" so, once in three runs here, with no wait).
_USAGE_EXIT_WAIT = 1.0


def usage_exit(line: str) -> int:
    """Print ``line`` (rank 0 only, when launched under MPI) and return 2, the usage-error
    exit code; the other ranks return it after ``_USAGE_EXIT_WAIT``, so rank 0 exits first."""
    if launch_rank() == 0:
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(_USAGE_EXIT_WAIT)
    return 2


class CommandParser(argparse.ArgumentParser):
    """argparse with one-line errors, printed by rank 0 only when launched under MPI."""

    def error(self, message: str):
        sys.exit(usage_exit(f"{self.prog}: error: {message} (see {self.prog} --help)"))


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="mpigrad", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Communication-efficient data-parallel training over MPI.",
        epilog=f"commands:\n{lines}\n\nRun 'mpigrad COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"mpigrad {__version__}")
    parser.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND")
    return parser


def command_parser(name: str) -> tuple:
    """(module, parser) of the command ``name`` (a key of COMMANDS): the parser that
    ``mpigrad NAME`` parses with, subcommands included."""
    module_name, text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = CommandParser(prog=f"mpigrad {name}", description=text)
    module.add_arguments(parser)
    return module, parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        _top_parser().parse_args(argv)  # prints help, version or the usage error and exits
        return 2
    name, rest = argv[0], argv[1:]
    module, parser = command_parser(name)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except UsageError as exc:  # under mpiexec every rank fails alike: one line, from rank 0
        return usage_exit(f"mpigrad {name}: error: {exc}")
    except BrokenPipeError:  # output piped into head and the like
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"mpigrad {name}: interrupted", file=sys.stderr)
        return 130
