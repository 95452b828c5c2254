"""``mpigrad bench device``: what the device path asks of the host per iteration, counted.

Runs one real ``mpiexec -n RANKS ... mpigrad train`` with the train options after ``--``, on
the GPU where torch sees one (``--device cuda --share-gpu``), else on the device path in
Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, ``MPIGRAD_DEVICE_CODECS=simulator``:
the kernels run as Python, slowly, so keep the model small), with the ranks' phase log
(:mod:`mpigrad.runtime.measure.phaselog`). Then, for the last iteration, per rank and phase: kernel
launches, host synchronisations (and where), bytes copied each way
(:mod:`mpigrad.counters`). The counts are made at the call sites, so they are
the same in the simulator as on a GPU; the times are not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import UsageError
from ..mpiexec import mpiexec_command

def _phases() -> tuple[str, ...]:
    """The phase log's phases in their order (runtime/roles/iteration.py), "start" first: what ran
    between the previous iteration's end and this one's start."""
    from ..runtime.roles.iteration import PHASES

    return ("start", "begin", *PHASES, "end")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=3, help="ranks of the run, P workers + servers (default 3)")
    parser.add_argument("--iterations", type=int, default=3,
                        help="iterations to run; the counts are the last one's (default 3)")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON, not as a table")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- then mpigrad train's options (the method, the model), e.g. -- --servers colocated "
                             "--codec uniform --bits 4 --model-opt conv_channels=4 (without a GPU, keep the model "
                             "small: the simulator runs every GPU thread as a Python thread)")


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2 or args.iterations < 1:
        raise UsageError("--ranks must be at least 2 and --iterations at least 1")
    train = [a for a in args.train_args if a != "--"]
    for option in ("--iterations", "--device"):
        if any(a == option or a.startswith(option + "=") for a in train):
            raise UsageError(f"bench device sets {option} itself (--iterations: give it before --; the device: "
                             "the GPU where torch sees one, else the simulator)")
    env = dict(os.environ)
    on_gpu = _gpu()
    if on_gpu:
        train = ["--device", "cuda", "--share-gpu", *train]
    else:
        env.update(NUMBA_ENABLE_CUDASIM="1", MPIGRAD_DEVICE_CODECS="simulator")
    with tempfile.TemporaryDirectory(prefix="mpigrad-bench-device-") as tmp:
        phases = Path(tmp) / "phases"
        env["MPIGRAD_PHASE_LOG"] = str(phases)
        if "--trace" not in train:
            train += ["--trace", str(Path(tmp) / "run.h5")]
        command = mpiexec_command(args.ranks, [sys.executable, "-m", "mpi4py", "-m", "mpigrad", "train",
                                               "--iterations", str(args.iterations), *train])
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-2000:] + done.stderr[-2000:], file=sys.stderr)
            raise UsageError(f"the run failed (exit {done.returncode})")
        path = next((line for line in done.stdout.splitlines() if line.startswith("codecs: ")), None)
        counts = last_iteration_counts(phases)
    where = "on the GPU" if on_gpu else "in Numba's CUDA simulator"
    if args.json:
        print(json.dumps({"where": where, "codecs": path, "iteration": args.iterations - 1, "ranks": counts}))
        return 0
    print(f"mpigrad bench device: {args.ranks} ranks, {where}; train options: {' '.join(train)}")
    print(path or "codecs: on the host (no device path: the counts are empty)")
    print(format_counts(counts, args.iterations - 1), end="")
    return 0


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def last_iteration_counts(directory: Path) -> dict[int, dict[str, dict]]:
    """rank -> phase -> counts of the last iteration in the phase log ``directory`` (ranks
    that asked nothing of a device have an empty dict)."""
    from ..runtime.measure.phaselog import read

    lines = read(directory)
    if not lines:
        raise UsageError(f"no phase log in {directory}")
    last = lines[max(lines)]
    return {rank: line.get("c", {}) for rank, line in sorted(last.items())}


def format_counts(counts: dict[int, dict[str, dict]], iteration: int) -> str:
    """One row per rank and phase, then each rank's total, e.g. ``rank 1  gradients  23  3
    ...``; the synchronisations' sites at the end of the row."""
    rows = [f"iteration {iteration}: kernel launches, host synchronisations, kB copied each way, per rank and phase",
            f"{'rank':>4}  {'phase':<10} {'launches':>8} {'syncs':>5} {'to dev kB':>9} {'to host kB':>10}  "
            "synchronised at"]
    for rank, phases in counts.items():
        total = {"launches": 0, "syncs": 0, "to_device": 0, "to_host": 0}
        order = _phases()
        for phase in sorted(phases, key=lambda p: order.index(p) if p in order else len(order)):
            c = phases[phase]
            for key in total:
                total[key] += c[key]
            sites = ", ".join(f"{site[6:]} x{n}" for site, n in sorted(c["sites"].items()) if site.startswith("sync:"))
            rows.append(f"{rank:>4}  {phase:<10} {c['launches']:>8} {c['syncs']:>5} {c['to_device'] / 1e3:>9.1f} "
                        f"{c['to_host'] / 1e3:>10.1f}  {sites}")
        rows.append(f"{rank:>4}  {'all':<10} {total['launches']:>8} {total['syncs']:>5} "
                    f"{total['to_device'] / 1e3:>9.1f} {total['to_host'] / 1e3:>10.1f}")
    return "\n".join(rows) + "\n"
