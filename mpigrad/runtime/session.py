"""One training session on one rank: launch checks, warm-up, resume, run, checkpoint, exit code."""

from __future__ import annotations

import socket
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from ..codecs import CodecError, get_codec
from ..errors import UsageError
from ..policies import PolicyError, get_policy
from ..models import check_model
from . import EXIT_REQUEUE, checkpoint
from .build import base_codec, load_data
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
        if size < config.servers + 1:
            raise UsageError(f"--servers {config.servers} needs at least {config.servers + 1} MPI ranks "
                             f"(S servers and at least one worker), this run has {size}")
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
        if moving and not codec.takes_policy_bits:
            raise UsageError(f"codec option levels fixes the quantization, but policy {config.policy!r} "
                             "chooses bits: use --policy fixed, or drop levels")
        if codec.takes_policy_bits:
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
    from .wire.mpi import MpiChannel

    rank = comm.Get_rank()
    # Rank 0 compiles first, so the others load from the Numba cache.
    if rank == 0:
        warm_up(config)
    comm.Barrier()
    if rank != 0:
        warm_up(config)
    stop = StopFlag(config.walltime, started).install()
    channel = MpiChannel(comm, config.servers, config.timeout)
    if rank == 0:
        log = lambda message: print(message, flush=True)  # noqa: E731
        return run_parameter_server(config, channel, stop, argv, log)
    return run_other_rank(config, channel)


def run_parameter_server(config, channel, stop: StopFlag, argv: list[str], log) -> int:
    """Rank 0's session: resume, trace, iterate, then checkpoint (exit 75) or finish (0)."""
    from .server import ParameterServer
    from .tracing import RunTrace

    server = ParameterServer(config, channel, stop, log=log)
    ident = checkpoint.identity(config.to_dict(), channel.size)
    start = 0
    if config.resume:
        state = checkpoint.load(config.checkpoint_path, ident)
        server.load_state_dict(state["server"])
        start = server.iteration
        if start >= config.iterations:
            raise UsageError(f"--resume: the checkpoint is at iteration {start}, --iterations is "
                             f"{config.iterations}: raise --iterations to continue")
        replica = state["server"]["replica"]
        channel.scatter_object([None] + list(state.get("servers", [])) + [(w, replica) for w in state["workers"]])
        log(f"mpigrad: resuming from {config.checkpoint_path} at iteration {start}")
    # Every rank has built its part once this gather returns: no timeout runs before.
    hosts = channel.gather_object(socket.gethostname())
    channel.bcast_object(start)
    trace = RunTrace.open(config, layout=server.replica.layout, workers=server.workers, servers=server.servers,
                          policy_columns=server.policy.record_columns(),
                          data_description=server.data_description, hosts=hosts, argv=argv,
                          resume_at=start if config.resume else None)
    if not config.resume:
        describe_run(config, server, channel.size, log)
    try:
        stopped = server.run(trace, start)
    except BaseException:
        trace.close("failed")
        raise
    if stopped:
        states = channel.gather_object(None)
        checkpoint.save(config.checkpoint_path, ident, server.state_dict(), states[server.servers:],
                        servers=states[1:server.servers])
        trace.close("stopped")
        log(f"mpigrad: {stop.reason}: stopped after iteration {server.iteration}, checkpoint "
            f"{config.checkpoint_path}; exit {EXIT_REQUEUE} (resume with --resume)")
        return EXIT_REQUEUE
    trace.close("complete")
    config.checkpoint_path.unlink(missing_ok=True)  # a finished run has nothing to resume
    log(trace.final_summary())
    return 0


def run_other_rank(config, channel) -> int:
    """A worker's or a shard server's session."""
    if channel.rank < channel.servers:
        from .server import ShardServer
        role = ShardServer(config, channel)
        if config.resume:
            role.load_state_dict(channel.scatter_object(None))
    else:
        from .worker import Worker
        role = Worker(config, channel)
        if config.resume:
            role.load_state_dict(*channel.scatter_object(None))
    channel.gather_object(socket.gethostname())
    start = channel.bcast_object(None)
    if role.run(start):
        channel.gather_object(role.state_dict())
        return EXIT_REQUEUE
    return 0


def describe_run(config, server, size: int, log) -> None:
    layout = server.replica.layout
    quantized = sum(s.size for s in layout.quantized)
    servers = "server" if server.servers == 1 else f"{server.servers} servers"
    log(f"mpigrad {_version()}: {size - server.servers} workers + {servers}, MPI: {MPI.Get_library_version().splitlines()[0]}")
    log(f"model {config.model} on {server.data_description}: {layout.total:,} parameters, "
        f"{len(layout.quantized)} quantized layer(s) holding {quantized / max(layout.total, 1):.1%}")
    if server.buffer_sync.size:
        log(f"model buffers (BatchNorm statistics): {server.buffer_sync.size:,} values, averaged over the "
            "workers after each evaluated iteration, before a checkpoint and at the end")
    log("config: " + " ".join(f"{k}={v}" for k, v in sorted(config.to_dict().items())))


def _version() -> str:
    from .. import __version__
    return __version__
