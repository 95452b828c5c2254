"""One training session on one rank: warm-up, channel, resume, run, checkpoint, exit code.
The launch checks before it are :mod:`.preflight`'s, the start-up text :mod:`.startup`'s,
the other ranks' roles :mod:`.follower`'s."""

from __future__ import annotations

import socket
import sys
import time

from mpi4py import MPI

from ...errors import UsageError
from ...trace import network
from .. import EXIT_REQUEUE
from ..exchange.warmup import KernelWatch, late_device_kernels, run_codecs, warm_up
from ..measure import checkpoint
from ..measure.tracing import RunTrace
from ..plan.environment import threads_per_rank
from ..plan.topology import resolve_in_process
from ..roles.server import ParameterServer
from ..roles.stopping import StopFlag
from ..wire import PeerTimeout
from ..wire.mpi import MpiChannel, barrier, choose_waiting
from .follower import RankFailure, deliver_checkpoint, follower_role
from .preflight import resume_attrs
from .recipe import run_train_worker
from .script import script_record
from .startup import describe_run


def run_rank(config, comm: MPI.Comm, argv: list[str], started: float | None = None) -> int:
    """Run this rank's part; ``started`` (time.monotonic) is when the process began, for --walltime."""
    rank = comm.Get_rank()
    compiled_s = warm_up_in_turn(config, comm)
    watch = KernelWatch()
    try:
        return _run_role(config, comm, argv, started, compiled_s)
    finally:
        report_late_kernels(rank, watch)


def warm_up_in_turn(config, comm: MPI.Comm) -> float:
    """Compile every kernel the run can use before its first iteration (``warmup.warm_up``):
    rank 0 first, so the others load from the Numba cache (waiting without spinning: on a
    shared node a spinning rank slows the compile it waits for). Returns this rank's seconds."""
    codecs = run_codecs(config)
    if comm.Get_rank() == 0:
        compiled_s = warm_up(config, codecs)
    barrier(comm, config.timeout, "rank 0 did not finish compiling the Numba kernels")
    if comm.Get_rank() != 0:
        compiled_s = warm_up(config, codecs)
    return compiled_s


def report_late_kernels(rank: int, watch: KernelWatch) -> None:
    """Name on stderr any kernel compiled (or first launched on a device) after the warm-up."""
    late = watch.compiled()
    if late:
        print(f"mpigrad: rank {rank} compiled {len(late)} Numba kernel(s) during the run, their time inside "
              f"its iterations' t_encode/t_decode (the warm-up missed them): {', '.join(late)}",
              file=sys.stderr, flush=True)
    late = late_device_kernels()
    if late:
        print(f"mpigrad: rank {rank} first launched {len(late)} device Numba kernel(s) during the run, compiled "
              f"inside its iterations on a GPU (the device warm-up missed them): {', '.join(late)}",
              file=sys.stderr, flush=True)


def open_channel(config, comm: MPI.Comm):
    """This rank's MpiChannel of the run, with the waiting mode its node's cores allow."""
    # Rank 0 detects and names a silent rank; the others give it twice as long before
    # concluding that rank 0 itself is gone (they would otherwise time out together with it).
    timeout = config.timeout if comm.Get_rank() == 0 else 2 * config.timeout
    channel = MpiChannel(comm, config.shard_count(comm.Get_size()), timeout, colocated=config.colocated)
    channel.waits = choose_waiting(comm, config.wait, threads_per_rank(config.threads), channel.timeout)
    return channel


def _run_role(config, comm: MPI.Comm, argv: list[str], started: float | None, compiled_s: float) -> int:
    rank = comm.Get_rank()
    stop = StopFlag(config.walltime, started).install()
    channel = open_channel(config, comm)
    if rank == 0:
        log = lambda message: print(message, flush=True)  # noqa: E731
        return run_parameter_server(config, channel, stop, argv, log, warm_up_s=compiled_s)
    return run_other_rank(config, channel)


def run_parameter_server(config, channel, stop: StopFlag, argv: list[str], log, warm_up_s: float | None = None,
                         model=None, resume_state: dict | None = None) -> int:
    """Rank 0's session: resume, trace, iterate, then checkpoint (exit 75) or finish (0).
    ``warm_up_s``: the seconds rank 0's warm-up took, for the start-up lines.

    ``model``: a script's (:class:`mpigrad.Session`), else the config's. A script's run
    writes no checkpoint file: each checkpoint's contents go to the first worker
    (:func:`.follower.deliver_checkpoint`), whose script saves them, and it resumes from
    ``resume_state``, those contents as the script loaded them."""
    script = model is not None
    # An in-process run: --exchange auto as the launch resolves it (the notes go to whichever
    # of its ranks resolved it first: rank 0 logs those it got).
    for note in resolve_in_process(config, channel.size):
        log(f"mpigrad: {note}")
    server = ParameterServer(config, channel, stop, log=log, model=model)
    ident = checkpoint.identity(config.to_dict(), channel.size)
    start = resume_server(config, channel, server, ident, log, resume_state if script else None) if config.resume else 0
    # Another network than the trace's was refused in check_launch unless --force: say so.
    changed = network.resume_change(config.trace, resume_attrs(config.trace), network.current(), force=True) if config.resume else None
    trace, device_warm_ups = open_run_trace(config, channel, server, argv, start, script)
    describe_run(config, server, channel.size, log, warm_up_s, device_warm_ups)  # a resumed session's too
    if changed:
        log(changed)
    checkpoints = CheckpointWriter(config, channel, server, trace, ident, script)

    def periodic_checkpoint() -> None:
        written = checkpoints.save()
        log(f"mpigrad: checkpoint after iteration {server.iteration}: {checkpoints.destination} ({written})")

    try:
        stopped = server.run(trace, start, on_checkpoint=periodic_checkpoint)
        if stopped:
            written = checkpoints.save()
    except BaseException as exc:
        trace.fail(str(exc) or type(exc).__name__, last_iteration=server.iteration - 1)
        raise
    trace.add_seconds("rank0_cpu_seconds", server.iteration_cpu_seconds)
    trace.add_seconds("rank0_wait_cpu_seconds", server.iteration_wait_cpu_seconds)
    if stopped:
        trace.close("stopped")
        resume = "Session(..., resume=the state)" if script else "--resume"
        log(f"mpigrad: {stop.reason}: stopped after iteration {server.iteration}, checkpoint "
            f"{checkpoints.destination}; exit {EXIT_REQUEUE} (resume with {resume}; checkpoint {written})")
        return EXIT_REQUEUE
    trace.close("complete")
    if not script:
        checkpoint.remove(config.checkpoint_path)  # a finished run has nothing to resume
    log(trace.final_summary())
    return 0


def resume_server(config, channel, server, ident: dict, log, script_state: dict | None = None) -> int:
    """Load rank 0's state from the checkpoint file, or from a script's ``script_state`` (the
    contents its script saved and loaded), hand every other rank its own, and return the
    iteration the run goes on from."""
    if script_state is not None:
        state, path = checkpoint.check(script_state, ident, "the state given"), "the state given"
    else:
        state, path = checkpoint.load(config.checkpoint_path, ident, warn=log)
    server.load_state_dict(state["server"])
    start = server.iteration
    if start >= config.iterations:
        raise UsageError(f"--resume: the checkpoint is at iteration {start}, --iterations is "
                         f"{config.iterations}: raise --iterations to continue")
    replica = state["server"]["replica"]
    channel.scatter_object([None] + list(state.get("servers", [])) + [(w, replica) for w in state["workers"]])
    log(f"mpigrad: resuming from {path} at iteration {start}")
    return start


def open_run_trace(config, channel, server, argv: list[str], start: int, script: bool):
    """Once every rank has built its part (the start-up gather: hosts and the workers' device
    warm-ups), tell them where the run starts and open its trace; return (the trace, the
    device warm-ups' seconds)."""
    # Every rank has built its part once this gather returns: no timeout runs before.
    gathered = channel.gather_object((socket.gethostname(), None))
    hosts = [host for host, _ in gathered]
    device_warm_ups = [seconds for _, seconds in gathered if seconds is not None]
    channel.bcast_object((start, config.iterations))
    recorded = script_record(config) if script else config  # a script's keys: not used (None)
    trace = RunTrace.open(recorded, layout=server.replica.layout, workers=server.workers, servers=server.servers,
                          policy_columns=server.policy.record_columns(),
                          data_description=server.data_description, hosts=hosts, argv=argv,
                          resume_at=start if config.resume else None, cost_attrs=server.cost_attrs(),
                          settings=server.mixed, waits=getattr(channel, "waits", None),
                          shards=server.shard_record(), buckets=server.trace_buckets())
    return trace, device_warm_ups


class CheckpointWriter:
    """Rank 0's checkpoints of one session: the trace flushed, every rank's state gathered,
    written to ``--checkpoint`` (a script's: sent to the first worker, whose script saves it)."""

    def __init__(self, config, channel, server, trace, ident: dict, script: bool):
        self.config, self.channel, self.server, self.trace = config, channel, server, trace
        self.ident, self.script = ident, script
        #: Where a checkpoint goes, for the log lines.
        self.destination = (f"to worker rank {channel.workers[0]}, for the script to save" if script
                            else config.checkpoint_path)

    def save(self) -> str:
        """Flush the trace, gather every rank's state, write it; return "SIZE MB, SECONDS s"."""
        began = time.perf_counter()
        server, channel = self.server, self.channel
        clocks = server.clock.clocks
        clocks.pause()  # checkpoint time stays off the wall clock
        self.trace.flush()  # first: the trace must hold every row before the checkpoint's iteration
        state = server.state_dict()
        states = channel.gather_object(None, f"checkpoint state after iteration {server.iteration}")
        workers, servers = [states[r] for r in channel.workers], states[1:self.config.non_worker_ranks()]
        if self.script:
            size = deliver_checkpoint(channel, checkpoint.contents(self.ident, state, workers, servers))
        else:
            size = checkpoint.save(self.config.checkpoint_path, self.ident, state, workers, servers=servers)
        clocks.resume()
        return f"{size / 1e6:.1f} MB, {time.perf_counter() - began:.1f} s"


def run_other_rank(config, channel, model=None) -> int:
    """A worker's (``mpigrad train``'s: :func:`.recipe.run_train_worker`) or a shard server's
    session; an error (other than a UsageError) comes out as a :class:`RankFailure` carrying
    the iteration the role was in (-1 before it existed). ``model``: a script's (a shard
    server of :class:`mpigrad.Session`)."""
    resolve_in_process(config, channel.size)  # an in-process run: --exchange auto as the launch resolves it
    if channel.is_worker:
        if model is not None:
            raise UsageError("a script's worker runs its own loop (mpigrad.Session.exchange), not run_other_rank")
        return run_train_worker(config, channel)
    role = None
    try:
        role, start, _ = follower_role(config, channel, model)

        def send_state() -> None:
            channel.gather_object(role.state_dict(), f"checkpoint state after iteration {role.iteration}")
            if model is not None:  # a script's run: the contents go to the first worker
                deliver_checkpoint(channel)

        if role.run(start, on_checkpoint=send_state):
            send_state()
            return EXIT_REQUEUE
        return 0
    except (UsageError, PeerTimeout):  # a silent peer (rank 0 itself, often): nobody to report to
        raise
    except Exception as exc:
        raise RankFailure(exc, channel, role.iteration if role is not None else -1) from exc


