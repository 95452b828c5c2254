"""One training session on one rank: launch checks, warm-up, resume, run, checkpoint, exit code."""

from __future__ import annotations

import pickle
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
from mpi4py import MPI

from ...codecs import get_codec
from ...units import format_duration, format_network_value, format_rate
from ...data.augment import build_augmentation
from ...errors import UsageError
from ...machine import mpi_library_line, mpi_library_version
from ...models import check_model
from ...trace import TraceError, network, root_attrs
from ...options import check_overwrite
from ..measure import checkpoint
from .. import EXIT_REQUEUE
from ..exchange.build import base_codec, broadcast_codec, load_data
from ..plan.checks import check_world
from ..plan.environment import check_world_size
from ..roles.stopping import StopFlag
from ..exchange.warmup import KernelWatch, late_device_kernels, run_codecs, warm_up
from ..wire import PeerTimeout

if TYPE_CHECKING:
    import torch


def check_launch(config, comm: MPI.Comm, model=None) -> None:
    """Every check that can fail before work starts; rank 0 decides, all ranks agree.
    ``model``: a script's (:class:`mpigrad.Session`), checked in place of the config's
    model and data."""
    message = None
    if comm.Get_rank() == 0:
        message = _launch_problem(config, comm.Get_size(), model)
    message = comm.bcast(message, root=0)
    if message:
        raise UsageError(message)


#: MPI's thread levels by value, for messages.
THREAD_LEVELS = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                 MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED", MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}


def check_thread_level(config, provided: int) -> None:
    """UsageError where a pipelined run on a GPU (``--device cuda`` or ``auto``) would call MPI
    from autograd's device thread, which the main thread did not start, and this MPI gave
    less than MPI_THREAD_SERIALIZED (``provided``, MPI_Query_thread): the calls would race or
    corrupt MPI's state. A CPU run's backward calls the hooks on the main thread."""
    from ..plan.gpu import workers_device

    if not config.pipeline or provided >= MPI.THREAD_SERIALIZED or workers_device(config) == "cpu":
        return
    raise UsageError(f"--pipeline --device {config.device}: the gradients' frames go from autograd's device "
                     f"thread, which needs MPI_THREAD_SERIALIZED or more, and this MPI gave "
                     f"{THREAD_LEVELS.get(provided, provided)} (mpi4py asks for mpi4py.rc.thread_level, 'multiple' "
                     f"by default; the MPI may be built without thread support): drop --pipeline, or use such an MPI")


def _resume_attrs(trace) -> dict:
    """The root attributes of the trace ``--resume`` continues; UsageError (one line) where it
    cannot be read."""
    try:
        return root_attrs(trace)
    except TraceError as exc:
        raise UsageError(f"--resume: {exc}") from None


def check_resume_files(config, script: bool = False) -> None:
    """UsageError (one line) where ``--resume`` has nothing to continue: no trace, a complete
    one, or (``mpigrad train``'s; a script keeps its own state) no checkpoint. One rule for
    the launched ranks and ``mpigrad train --check``."""
    trace = Path(config.trace)
    if not trace.exists():
        raise UsageError(f"--resume: the trace {trace} to continue does not exist")
    if trace_status(trace) == "complete":
        raise UsageError(f"--resume: trace {trace} is complete, there is nothing to resume "
                         "(start a new run with another --trace, or --force without --resume)")
    if not script and not checkpoint.exists(config.checkpoint_path):
        raise UsageError(f"--resume: no checkpoint at {config.checkpoint_path}")


def _launch_problem(config, size: int, model=None) -> str | None:
    try:
        check_world_size(size)  # first: a PMI mismatch under srun also shows as size 1
        check_world(config, size, script=model is not None)
        check_thread_level(config, MPI.Query_thread())
        if model is None:
            dataset = load_data(config)
            build_augmentation(config.augment, config.augment_opts, dataset)  # does this data set take it?
            model = check_model(config.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes,
                                seed=config.seed, **config.model_opts)
        check_quantizes_something(config, model)
        trace = Path(config.trace)
        if config.resume:
            check_resume_files(config, script=model is not None)
            network.resume_change(trace, _resume_attrs(trace), network.current(), config.force)  # refused unless --force
        else:
            check_overwrite([trace], config.force, error=UsageError, alternative=" or --trace to choose another")
        make_parent_directory(trace, "trace")
        make_parent_directory(config.checkpoint_path, "checkpoint")
    except (UsageError, ValueError) as exc:
        return str(exc)
    return None


def make_parent_directory(path: Path, what: str) -> None:
    """Create the directory that will hold ``path``, as output options usually do
    (``--trace runs/a.h5`` in a fresh clone); UsageError naming it if that fails."""
    if path.parent.exists() and not path.parent.is_dir():
        raise UsageError(f"{path.parent}, where the {what} should go, is not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create directory {path.parent} for the {what}: {exc.strerror or exc}") from None


def check_quantizes_something(config, model: torch.nn.Module) -> None:
    """UsageError when a quantizing codec would apply to no layer (every layer smaller than
    --min-quantize-size, or a model that names none): the run would train in float32 while
    its log and trace say bits."""
    from ..exchange.replica import quantization_rule

    if config.codec == "fp32":
        return
    params = [p for p in model.parameters() if p.requires_grad]
    codec = base_codec(config)
    quantize = quantization_rule(model, config.min_quantize_size, codec)
    if any(quantize(p) for p in params):
        return
    if codec.two_rounds:
        raise UsageError(f"codec {config.codec!r} would compress no layer: no matrix of this model has "
                         f"(n + m) r * min_compression_rate < n m at rank {codec.rank}; lower the rank or "
                         "min_compression_rate, or use --codec fp32")
    rule = ("the model names no layer to quantize" if config.min_quantize_size is None else
            f"the largest layer of this model has {max((p.numel() for p in params), default=0):,} "
            f"elements, --min-quantize-size is {config.min_quantize_size:,}")
    raise UsageError(f"codec {config.codec!r} would quantize nothing: {rule}; set --min-quantize-size, "
                     "or use --codec fp32 for an unquantized run")


def trace_status(path: Path) -> str | None:
    """The status a trace file records ("complete", "stopped", ...), None if unreadable."""
    try:
        with h5py.File(path, "r", swmr=True) as f:
            status = f.attrs.get("status")
    except OSError:
        return None
    return status.decode() if isinstance(status, bytes) else status


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
    from ..wire.mpi import barrier

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
    from ..plan.environment import threads_per_rank
    from ..wire.mpi import MpiChannel, choose_waiting

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
    (:func:`deliver_checkpoint`), whose script saves them, and it resumes from
    ``resume_state``, those contents as the script loaded them."""
    from ..roles.server import ParameterServer
    from ..measure.tracing import RunTrace

    script = model is not None
    server = ParameterServer(config, channel, stop, log=log, model=model)
    ident = checkpoint.identity(config.to_dict(), channel.size)
    start = 0
    if config.resume:
        if script:
            state, path = checkpoint.check(resume_state, ident, "the state given"), "the state given"
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
    # Another network than the trace's was refused in check_launch unless --force: say so.
    changed = network.resume_change(config.trace, _resume_attrs(config.trace), network.current(), force=True) if config.resume else None
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
                          shards=server.shard_record())
    describe_run(config, server, channel.size, log, warm_up_s, device_warm_ups)  # a resumed session's too
    if changed:
        log(changed)

    def save_checkpoint() -> str:
        """Flush the trace, gather every rank's state, write it; return "SIZE MB, SECONDS s"."""
        began = time.perf_counter()
        clocks = server.clock.clocks
        clocks.pause()  # checkpoint time stays off the wall clock
        trace.flush()  # first: the trace must hold every row before the checkpoint's iteration
        state = server.state_dict()
        states = channel.gather_object(None, f"checkpoint state after iteration {server.iteration}")
        workers, servers = [states[r] for r in channel.workers], states[1:config.non_worker_ranks()]
        if script:
            size = deliver_checkpoint(channel, checkpoint.contents(ident, state, workers, servers))
        else:
            size = checkpoint.save(config.checkpoint_path, ident, state, workers, servers=servers)
        clocks.resume()
        return f"{size / 1e6:.1f} MB, {time.perf_counter() - began:.1f} s"

    #: Where a checkpoint goes, for the log lines.
    destination = f"to worker rank {channel.workers[0]}, for the script to save" if script else config.checkpoint_path

    def periodic_checkpoint() -> None:
        written = save_checkpoint()
        log(f"mpigrad: checkpoint after iteration {server.iteration}: {destination} ({written})")

    try:
        stopped = server.run(trace, start, on_checkpoint=periodic_checkpoint)
        if stopped:
            written = save_checkpoint()
    except BaseException as exc:
        trace.fail(str(exc) or type(exc).__name__, last_iteration=server.iteration - 1)
        raise
    trace.add_seconds("rank0_cpu_seconds", server.iteration_cpu_seconds)
    trace.add_seconds("rank0_wait_cpu_seconds", server.iteration_wait_cpu_seconds)
    if stopped:
        trace.close("stopped")
        resume = "Session(..., resume=the state)" if script else "--resume"
        log(f"mpigrad: {stop.reason}: stopped after iteration {server.iteration}, checkpoint "
            f"{destination}; exit {EXIT_REQUEUE} (resume with {resume}; checkpoint {written})")
        return EXIT_REQUEUE
    trace.close("complete")
    if not script:
        checkpoint.remove(config.checkpoint_path)  # a finished run has nothing to resume
    log(trace.final_summary())
    return 0


#: The script's keys a script's trace still records as the config has them: they name the script's.
_SCRIPT_NAMED = ("model", "data", "optimizer")


def script_keys_unused(config: dict) -> dict:
    """A script's run's config dict (:class:`mpigrad.Session`) as it is recorded: each key
    the script owns (``mpigrad.api.SCRIPT_KEYS``) None, not used by mpigrad whatever the
    config file or the defaults said, but ``model``, ``data`` and ``optimizer``, which say
    ``script NAME``."""
    from ...api import SCRIPT_KEYS

    return {key: None if key in SCRIPT_KEYS and key not in _SCRIPT_NAMED else value for key, value in config.items()}


def script_record(config):
    """A copy of a script's run's ``config`` whose ``to_dict()`` (what its trace records as
    its config) is :func:`script_keys_unused`'s; its attributes are the config's, which the
    trace's other attributes read. The checkpoint's identity keeps the config's own dict."""
    import copy

    recorded = copy.copy(config)
    recorded.to_dict = lambda: script_keys_unused(config.to_dict())
    return recorded


def deliver_checkpoint(channel, contents: dict | None = None):
    """A script's checkpoint (:class:`mpigrad.Session`): rank 0 sends ``contents``
    (``checkpoint.contents``) to the first worker and returns their size in bytes; every
    other rank takes part and receives them (the first worker) or None."""
    if channel.rank == 0:
        payload = pickle.dumps(contents, protocol=pickle.HIGHEST_PROTOCOL)  # once: its size is the log's
        channel.scatter_object([payload if rank == channel.workers[0] else None for rank in range(channel.size)])
        return len(payload)
    payload = channel.scatter_object(None)
    return None if payload is None else pickle.loads(payload)


class RankFailure(RuntimeError):
    """A worker's or shard server's error (its text unchanged), raised from the original by
    :func:`run_other_rank` with the iteration it happened in. ``report()`` sends it to rank 0
    (message 8) and waits for rank 0 to close the trace "failed" and end the run."""

    def __init__(self, error: Exception, channel, iteration: int):
        super().__init__(str(error) or type(error).__name__)
        self.channel, self.iteration = channel, iteration

    def report(self) -> None:
        self.channel.report_error(self.iteration, str(self))


def follower_role(config, channel, model=None, recipe=None):
    """Build this worker's or shard server's role (a worker's around ``model``, with
    ``mpigrad train``'s ``recipe`` or a script's without; a shard server's around a script's
    ``model`` when given), load its checkpoint state on resume, and take part in the start-up
    exchange with rank 0 (:func:`run_parameter_server`); return the role, the iteration to
    start from and rank 0's number of iterations."""
    if not channel.is_worker:
        from ..roles.server import ShardServer
        role = ShardServer(config, channel, model)
        if config.resume:
            role.load_state_dict(channel.scatter_object(None))
    else:
        from ..roles.worker import Worker
        role = Worker(config, channel, model, recipe)
        if config.resume:
            role.load_state_dict(*channel.scatter_object(None))
    channel.gather_object((socket.gethostname(), getattr(role, "device_warm_up_s", None)))
    start, iterations = channel.bcast_object(None)
    return role, start, iterations


def run_other_rank(config, channel, model=None) -> int:
    """A worker's (``mpigrad train``'s: :func:`.recipe.run_train_worker`) or a shard server's
    session; an error (other than a UsageError) comes out as a :class:`RankFailure` carrying
    the iteration the role was in (-1 before it existed). ``model``: a script's (a shard
    server of :class:`mpigrad.Session`)."""
    if channel.is_worker:
        if model is not None:
            raise UsageError("a script's worker runs its own loop (mpigrad.Session.exchange), not run_other_rank")
        from .recipe import run_train_worker
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


def describe_run(config, server, size: int, log, warm_up_s: float | None = None,
                 device_warm_ups: list[float] = ()) -> None:
    """rank 0's start-up lines; ``device_warm_ups``: the workers' device warm-ups, seconds."""
    layout = server.replica.layout
    quantized = sum(s.size for s in layout.quantized)
    if server.colocated:
        servers = "scheduler, each worker serving a shard (colocated)"
    else:
        servers = "server" if server.servers == 1 else f"{server.servers} servers"
    log(f"mpigrad {_version()}: {server.workers} workers + {servers}, MPI: {mpi_library_line(mpi_library_version(MPI))}")
    held = ("fp32: nothing quantized" if config.codec == "fp32" else
            f"{len(layout.quantized)} quantized layer(s) holding {quantized / max(layout.total, 1):.1%}")
    log(f"model {config.model} on {server.data_description}: {layout.total:,} parameters, {held}")
    if server.buffer_sync.size:
        log(f"model buffers (BatchNorm statistics): {server.buffer_sync.size:,} values, averaged over the "
            "workers after each evaluated iteration, before a checkpoint and at the end")
    if server.servers > 1:
        log(shard_description(server.shards, server.codec, server.chunks, config.shard_chunk))
    log(f"network: {network_description(config)}")
    from ..plan.checks import replaced_bits_note
    note = replaced_bits_note(config, server.codec)
    if note:
        log(note)
    links = network.current()
    if links != network.HOST:  # in mpigrad lab: the real links, as the trace records them
        log(f"links: {network.describe(links)} (mpigrad lab)")
        warning = lab_clock_warning(config, links)
        if warning:
            log(warning)
    if config.compute_time is not None and config.net_mode != "off":
        log(f"local work: {local_work_description(config, server)}")
    waits = getattr(server.channel, "waits", None)
    if waits:
        log(f"waits: {waits_description(config.wait, waits)}")
    from ..exchange.device import codec_path
    where = codec_path(config, [server.codec, broadcast_codec(config)[0], get_codec({"id": "fp32"})])
    if where:
        log(where)
    if warm_up_s is not None:
        log(f"warm-up: every codec this run can use compiled or loaded from Numba's cache before iteration 0, "
            f"in {warm_up_s:.1f} s on rank 0")
    if device_warm_ups:
        log(f"device warm-up: every device kernel this run can use launched once on each of "
            f"{len(device_warm_ups)} worker(s) before iteration 0, in parallel, {max(device_warm_ups):.1f} s at most")
    log("config: " + config_description(config, server.codec, script=getattr(server, "script", False)))


def waits_description(mode: str, waits: dict[str, list[int]]) -> str:
    """The ``waits:`` start-up line: how the ranks wait for messages, and why."""
    from ..plan.environment import format_ranks

    why = {"auto": "auto: ", "spin": "--wait spin: ", "sleep": "--wait sleep: "}[mode]
    if not waits["sleep"]:
        return f"polling without sleeping on every rank ({why}{'each rank has a core per thread' if mode == 'auto' else 'asked for'})"
    if not waits["spin"]:
        reason = "ranks outnumber the cores of their node" if mode == "auto" else "asked for"
        return f"sleep-polling with back-off to 0.5 ms on every rank ({why}{reason})"
    return (f"polling without sleeping on ranks {format_ranks(waits['spin'])}, sleep-polling on ranks "
            f"{format_ranks(waits['sleep'])} (auto: by the cores of each node)")


#: Config keys the ``network:`` line states (in their units), left out of the ``config:`` line.
_NETWORK_KEYS = ("bandwidth", "latency", "link_bandwidth")


def config_description(config, codec=None, script: bool = False) -> str:
    """The ``config:`` line: every option but the network's (the ``network:`` line states
    it), a value with a unit as a user writes it (``compute_time=50ms``); without ``bits``
    where the run's ``codec`` takes none (``fp32``, a codec given by its levels), and for a
    ``script``'s run (:class:`mpigrad.Session`) without the keys the script owns but its
    model, data and optimizer (rank 0's note names those the config file set)."""
    from ...analysis.labels import format_value

    values = config.to_dict()
    left_out = set(_NETWORK_KEYS)
    if codec is not None and not codec.takes_policy_bits:
        left_out.add("bits")
    if script:
        from ...api import SCRIPT_KEYS

        left_out |= set(SCRIPT_KEYS) - set(_SCRIPT_NAMED)
    return " ".join(f"{k}={format_value(v, k)}" for k, v in sorted(values.items()) if k not in left_out)


def shard_description(shards, codec, chunks, setting) -> str:
    """The shards' sizes at the initial bits, how far the largest is from an even split (the
    busiest server's link sets the round's time) and how the layers were cut (``chunks``,
    a ``layout.Chunks``, from ``--shard-chunk setting``)."""
    from ..exchange.build import piece_bytes

    size = piece_bytes(codec)
    loads = [sum(size(piece) for piece in shard.pieces) for shard in shards]
    even = sum(loads) / len(loads)
    pieces = sum(len(shard.pieces) for shard in shards)
    text = (f"shards at the initial bits: {', '.join(f'{n / 1e6:.2f}' for n in loads)} MB; the largest "
            f"{max(loads) / even:.2f}x an even split; {pieces} pieces, {chunks.describe()} (--shard-chunk {setting}"
            + ("; the factors go by whole layers" if codec.two_rounds else "") + ")")
    if max(loads) > 1.2 * even and not chunks.quantized:
        text += "; --shard-chunk auto or N cuts layers into pieces the servers can share"
    return text


def network_description(config) -> str:
    """The network model in words, the rate in bytes and in bits (``10MB/s (80Mbit/s)``)."""
    if config.net_mode == "off":
        return "not modelled (net_mode off: the simulated clock is the wall clock)"
    clock = "simulated clock" if config.net_mode == "virtual" else "real sleeps"
    rate = (f"{config.bandwidth} (schedule on the simulated clock)" if isinstance(config.bandwidth, str)
            else format_rate(config.bandwidth))
    latency = (f"{config.latency} (schedule)" if isinstance(config.latency, str) else format_duration(config.latency))
    links = "".join(f", rank {rank}'s link {format_network_value(value)}"
                    for rank, value in sorted(config.link_bandwidth.items(), key=lambda item: int(item[0])))
    return (f"{rate} per link{links}, latency {latency} per message, "
            f"{config.broadcast} broadcast, {clock}")


def lab_clock_warning(config, links: dict) -> str | None:
    """The line warning that a run in the lab (``links``) is timed by a network model of
    another rate than its links' (None where it is timed by the wire, net_mode off, or by a
    model of the links' own rate)."""
    if links.get("kind") != "lab" or config.net_mode == "off":
        return None
    model = format_network_value(config.bandwidth)
    if model == links.get("rate") and not links.get("node_rates") and not config.link_bandwidth:
        return None
    return (f"mpigrad: warning: timed by the network model ({model} per link), not by the lab's links "
            f"({network.describe(links)}): pass --net-mode off to be timed by the wire, or the links' rate "
            "as --bandwidth to model them")


def local_work_description(config, server) -> str:
    """What a --compute-time run charges for local work, in words."""
    compute = f"{format_duration(config.compute_time)} per iteration for compute"
    if server.clock.local_costs is None and server.codec.two_rounds:
        return (f"{compute}; policy, encode, decode and average not charged (no cost model has "
                f"{config.codec}'s matrix products)")
    if server.clock.local_costs is None:
        return f"{compute}; policy, encode, decode and average not charged (--cost-model none)"
    model, _ = server.clock.local_costs
    name = "the package's cost model" if config.cost_model == "default" else f"cost model {config.cost_model}"
    charged = model.charges_policy(config.policy)
    layers = max(len(server.replica.layout.quantized), 1)

    def ms(bits: int) -> str:
        return f"{1e3 * server.clock.local_seconds([bits] * layers):.2f} ms"

    if not server.codec.takes_policy_bits:  # its width is the codec's: the policy's bits change nothing
        cost = f"{ms(server.codec.fixed_bits)} per iteration"
    else:
        lowest, highest = server.policy.bits_range()
        cost = (f"{ms(lowest)} per iteration at {lowest} bits" if lowest == highest else
                f"{ms(lowest)} per iteration at {lowest} bits to {ms(highest)} at {highest} bits")
    text = (f"{compute}, {'policy, ' if charged else ''}encode, decode and average by {name} "
            f"(measured on {model.machine}): {cost}")
    return text if charged else f"{text}; policy {config.policy!r} not in the model: not charged"


def _version() -> str:
    from ... import __version__
    return __version__
