"""``mpigrad bench``: throughput benchmarks (not timed tests), one module per bench.

Each module exposes ``add_arguments(parser)`` and ``run(args) -> int``; only the chosen
bench's module is run. ``codecs`` times every codec's encode/decode, ``iteration`` whole
training iterations, ``trace`` the trace writer alone, ``peers`` torch DDP (uncompressed,
fp16 and PowerSGD hooks) beside mpigrad on the same task, ``calibrate`` the cost model of
local work (:mod:`mpigrad.costmodel`) that deterministic runs charge, ``clock`` the simulated
clock against the network lab, ``api`` a script's loop over :class:`mpigrad.Session` against
``mpigrad train`` on the same config, ``device`` the device path's launches, synchronisations
and copies per iteration.
"""

from __future__ import annotations

import argparse
import importlib

#: bench name -> (module, one-line description)
SUBCOMMANDS = {
    "codecs": ("mpigrad.bench.codecs", "encode/decode throughput of every codec against np.copyto and its NumPy twin"),
    "iteration": ("mpigrad.bench.iteration", "time per training iteration and codec/policy/trace overhead"),
    "trace": ("mpigrad.bench.trace", "rank 0's trace-writer CPU time per iteration and at close"),
    "peers": ("mpigrad.bench.peers", "torch DDP (fp32, fp16 hook, PowerSGD) beside mpigrad on one config's task"),
    "clock": ("mpigrad.bench.clock", "the simulated clock against a real rate-limited network (lab, root): "
              "sim/real per iteration"),
    "calibrate": ("mpigrad.bench.calibrate", "measure the cost model of policy/encode/decode/average "
                  "that --compute-time runs charge (-o FILE, JSON)"),
    "api": ("mpigrad.bench.api", "the library's loop (mpigrad.Session) against mpigrad train on one config: "
            "ms per iteration and whether the losses are the same"),
    "device": ("mpigrad.bench.device", "the device path's kernel launches, host synchronisations and copies "
               "per iteration and phase (on a GPU, else in Numba's CUDA simulator)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module_name, text) in SUBCOMMANDS.items():
        child = sub.add_parser(name, help=text, description=text)
        module = importlib.import_module(module_name)
        module.add_arguments(child)
        child.set_defaults(bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args.bench_run(args) or 0)
