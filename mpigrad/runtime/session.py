"""One training session on one rank: launch checks, warm-up, resume, run, checkpoint, exit code."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from ..codecs import CodecError, get_codec
from ..errors import UsageError
from ..policies import PolicyError, get_policy
from ..models import check_model
from . import EXIT_REQUEUE, checkpoint
from .common import base_codec, load_data
from .environment import check_world_size
from .stopping import StopFlag


def check_launch(config, comm: MPI.Comm) -> None:
    """Every check that can fail before work starts; rank 0 decides, all ranks agree."""
    message = None
    if comm.Get_rank() == 0:
        message = _launch_problem(config, comm.Get_size())
    message = comm.bcast(message, root=0)
    if message:
        raise UsageError(message)


def _launch_problem(config, size: int) -> str | None:
    try:
        check_world_size(size)  # first: a PMI mismatch under srun also shows as size 1
        if size < 2:
            raise UsageError("mpigrad train needs at least 2 MPI ranks (rank 0 is the server, ranks 1.. "
                             "are workers): launch with mpiexec -n P+1 python -m mpi4py -m mpigrad train")
        if "bits" in config.codec_opts:
            raise UsageError("set the bits with --bits (bits = N at the top of a config file), "
                             "not as a codec option: the policy starts from it")
        codec = base_codec(config)
        policy = get_policy(config.policy_config(), n_layers=1, seed=config.seed)
        lowest, highest = policy.bits_range()
        moving = lowest != highest
        if moving and not codec.accepts_bits:
            raise UsageError(f"policy {config.policy!r} chooses bits, but codec {config.codec!r} has no "
                             "bits option: use --policy fixed, or a codec such as uniform or qsgd")
        if moving and "levels" in config.codec_opts:
            raise UsageError(f"codec option levels fixes the quantization, but policy {config.policy!r} "
                             "chooses bits: use --policy fixed, or drop levels")
        if codec.accepts_bits and "levels" not in config.codec_opts:
            policy.check_codec(codec)
        dataset = load_data(config)
        check_model(config.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes,
                    seed=config.seed, **config.model_opts)
        trace = Path(config.trace)
        if config.resume:
            if not trace.exists():
                raise UsageError(f"--resume: the trace {trace} to continue does not exist")
            if trace_status(trace) == "complete":
                raise UsageError(f"--resume: trace {trace} is complete, there is nothing to resume "
                                 "(start a new run with another --trace, or --force without --resume)")
            if not config.checkpoint_path.exists():
                raise UsageError(f"--resume: no checkpoint at {config.checkpoint_path}")
        elif trace.exists() and not config.force:
            raise UsageError(f"trace {trace} exists; pass --force to overwrite it or --trace to choose another")
        if not trace.parent.exists() and str(trace.parent):
            raise UsageError(f"directory {trace.parent} for the trace does not exist")
    except (UsageError, CodecError, PolicyError, ValueError) as exc:
        return str(exc)
    return None


def trace_status(path: Path) -> str | None:
    """The status a trace file records ("complete", "stopped", ...), None if unreadable."""
    try:
        with h5py.File(path, "r", swmr=True) as f:
            status = f.attrs.get("status")
    except OSError:
        return None
    return status.decode() if isinstance(status, bytes) else status


def warm_up(config) -> None:
    """Compile the Numba kernels (into the cache) by one encode/decode of a small array."""
    codec = base_codec(config)
    x = np.linspace(-1.0, 1.0, 4096, dtype=np.float32)
    for c in (codec, get_codec({"id": "fp32"})):
        c.decode(c.encode(x))


def run_rank(config, comm: MPI.Comm, argv: list[str], started: float | None = None) -> int:
    """Run this rank's part; ``started`` (time.monotonic) is when the process began, for --walltime."""
    rank = comm.Get_rank()
    # Rank 0 compiles first, so the others load from the Numba cache.
    if rank == 0:
        warm_up(config)
    comm.Barrier()
    if rank != 0:
        warm_up(config)
    stop = StopFlag(config.walltime, started).install()
    if rank == 0:
        return _run_server(config, comm, stop, argv)
    return _run_worker(config, comm)


def _run_server(config, comm: MPI.Comm, stop: StopFlag, argv: list[str]) -> int:
    from .server import Server
    from .tracing import RunTrace

    log = lambda message: print(message, flush=True)  # noqa: E731
    server = Server(config, comm, stop, log=log)
    ident = checkpoint.identity(config.to_dict(), comm.Get_size())
    start = 0
    if config.resume:
        state = checkpoint.load(config.checkpoint_path, ident)
        server.load_state_dict(state["server"])
        start = server.iteration
        if start >= config.iterations:
            raise UsageError(f"--resume: the checkpoint is at iteration {start}, --iterations is "
                             f"{config.iterations}: raise --iterations to continue")
        comm.scatter([None] + [(w, state["server"]["replica"]) for w in state["workers"]], root=0)
        log(f"mpigrad: resuming from {config.checkpoint_path} at iteration {start}")
    hosts = comm.gather(socket.gethostname(), root=0)
    comm.bcast(start, root=0)
    trace = RunTrace.open(config, server, hosts, argv, resume_at=start if config.resume else None)
    if not config.resume:
        describe_run(config, server, comm.Get_size(), log)
    try:
        stopped = server.run(trace, start)
    except BaseException:
        trace.close("failed")
        raise
    if stopped:
        workers = comm.gather(None, root=0)[1:]
        checkpoint.save(config.checkpoint_path, ident, server.state_dict(), workers)
        trace.close("stopped")
        log(f"mpigrad: {stop.reason}: stopped after iteration {server.iteration}, checkpoint "
            f"{config.checkpoint_path}; exit {EXIT_REQUEUE} (resume with --resume)")
        return EXIT_REQUEUE
    trace.close("complete")
    config.checkpoint_path.unlink(missing_ok=True)  # a finished run has nothing to resume
    log(trace.final_summary())
    return 0


def _run_worker(config, comm: MPI.Comm) -> int:
    from .worker import Worker

    worker = Worker(config, comm)
    if config.resume:
        worker_state, replica_state = comm.scatter(None, root=0)
        worker.load_state_dict(worker_state, replica_state)
    comm.gather(socket.gethostname(), root=0)
    start = comm.bcast(None, root=0)
    stopped = worker.run(start)
    if stopped:
        comm.gather(worker.state_dict(), root=0)
        return EXIT_REQUEUE
    return 0


def describe_run(config, server, size: int, log) -> None:
    layout = server.replica.layout
    quantized = sum(s.size for s in layout.quantized)
    log(f"mpigrad {_version()}: {size - 1} workers + server, MPI: {MPI.Get_library_version().splitlines()[0]}")
    log(f"model {config.model} on {server.data_description}: {layout.total:,} parameters, "
        f"{len(layout.quantized)} quantized layer(s) holding {quantized / max(layout.total, 1):.1%}")
    if server.buffer_sync.size:
        log(f"model buffers (BatchNorm statistics): {server.buffer_sync.size:,} values, averaged over the "
            "workers after each evaluated iteration, before a checkpoint and at the end")
    log("config: " + " ".join(f"{k}={v}" for k, v in sorted(config.to_dict().items())))


def _version() -> str:
    from .. import __version__
    return __version__
