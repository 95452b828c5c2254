"""The messages a simulation replays, from mpigrad's own code: one
:class:`~mpigrad.clockmodel.IterationTraffic` per iteration, with its local work.

From a config (:func:`traffic_of`): the model's layout, the shards and the compressors as
the ranks build them (``runtime/exchange/build.py``), each frame's size at the iteration's
bits from the compressor's ``exact_capacity`` (every codec that fixes its frame size: fp32,
fp16, uniform, sign, TernGrad, fixed-width QSGD), else ``capacity``, the bound a receiver
sizes its buffer by (QSGD's Elias stream, MCGQ: the frames are then at most that big, and
:func:`traffic_of` says so in ``ConfigTraffic.bound``). A two-round codec (PowerSGD): its
two rounds' factor frames as rank 0 of the run sizes them (``runtime/exchange/lowrank.py``'s
``LowRank.frame_sizes`` over ``build_factor_shards``), in ``IterationTraffic``'s second round.
From a trace (:func:`trace_iterations`): exactly as ``mpigrad trace retime`` rebuilds each
row's traffic (``analysis/retime.py``), with the row's recorded local work; a two-round
codec's rows take the rounds of the run's config, checked against the row's sums. A recorded run's
bits per iteration (:func:`recorded_bits`), for a config's iterations at them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Sequence

from ..clockmodel import IterationTraffic, LinkModel, Nodes, PipelinedTraffic, comm_start, iteration_seconds
from ..config import COLOCATED, RunConfig
from ..costmodel import LocalWork
from ..errors import UsageError
from ..trace import TraceError, read_raw

__all__ = ["ConfigTraffic", "TraceIteration", "TraceRun", "RecordedBits", "traffic_of", "config_traffic",
           "trace_iterations", "recorded_bits", "model_shapes"]


@dataclass(frozen=True)
class ConfigTraffic:
    """A config's iteration: its ``traffic``, ``bound`` (True where some frame's size is the
    codec's bound, not its exact size), the quantized layers' count, the parameters' shapes
    (for the peers), what the cost model charges (``local_work``, as rank 0 builds it) and
    ``notes`` on what the iteration leaves out (lines for the report)."""

    traffic: IterationTraffic
    bound: bool
    layers: int
    shapes: tuple[tuple[int, ...], ...]
    local_work: LocalWork
    notes: tuple[str, ...] = ()


def _bits_list(bits: int | Sequence[int], layers: int) -> list[int]:
    if isinstance(bits, int):
        return [int(bits)] * max(layers, 1)
    bits = [int(b) for b in bits]
    if len(bits) != max(layers, 1):
        raise UsageError(f"bits per layer: {len(bits)} given, the model has {max(layers, 1)} quantized layer(s)")
    return bits


def traffic_of(config: RunConfig, workers: int, bits: int | Sequence[int]) -> IterationTraffic:
    """The messages of one iteration of ``config`` on ``workers`` workers at ``bits`` (one
    width for every quantized layer, or one per layer), as the runtime sends and its clock
    charges them; ``config`` as the launch resolves it (``ranks_per_node`` a number,
    ``exchange`` flat or hierarchical: :func:`mpigrad.runtime.plan.topology.resolve_topology`)."""
    return config_traffic(config, workers, bits).traffic


def config_traffic(config: RunConfig, workers: int, bits: int | Sequence[int],
                   control_ahead: bool | None = None) -> ConfigTraffic:
    """:func:`traffic_of` with what else a simulation needs of the config (:class:`ConfigTraffic`).
    ``control_ahead``: whether the iteration's Control goes ahead of the losses (None: as the
    runtime sends the config's first one: ``control = "ahead"`` and a policy that knows its
    bits before the losses). A two-round codec's iteration is a compressed one (from its
    ``start`` on). UsageError (one line) for a run this cannot lay out: PowerSGD's per-layer
    settings (menus), the pipelined iteration, a model, data set, codec or policy that cannot
    be built."""
    from ..codecs import CodecError
    from ..data import DataError
    from ..models import ModelError
    from ..policies import PolicyError

    try:
        return _config_traffic(config, workers, bits, control_ahead)
    except (CodecError, DataError, ModelError, PolicyError) as exc:
        raise UsageError(str(exc)) from None


def _frames_by_worker(sizes: Sequence[int], workers: int, ranks_per_node: int | None) -> tuple[tuple[int, ...], ...]:
    """``frames_in`` of one round: shard s's frame of ``sizes[s]`` bytes from every worker, or
    (the hierarchical exchange on nodes of ``ranks_per_node``) from the workers of its local
    rank only, 0 from the others (they send it none)."""
    L = ranks_per_node
    return tuple(tuple(n if L is None or w % L == s % L else 0 for w in range(workers)) for s, n in enumerate(sizes))


def _factor_frame_sizes(config: RunConfig, replica, codec, servers: int, widths: list[int]
                        ) -> tuple[list[int], list[int]]:
    """A two-round codec's frame bytes per server in round 1 (the P factors and the other
    layers) and round 2 (the Q factors): rank 0's ``LowRank`` over the run's factor shards
    (``tworounds._low_rank``), whose ``frame_sizes`` size every worker's frames and the
    broadcasts (its codecs' widths are their own: ``widths`` only name a plan's settings)."""
    from ..runtime.exchange.build import build_factor_shards
    from ..runtime.exchange.lowrank import LowRank

    lowrank = LowRank(replica.model, replica.layout, codec, config.seed, worker=False,
                      shards=build_factor_shards(config, replica.layout, codec, servers))
    return lowrank.frame_sizes(widths)


def _config_traffic(config: RunConfig, workers: int, bits: int | Sequence[int],
                    control_ahead: bool | None) -> ConfigTraffic:
    from ..policies import get_policy
    from ..runtime.exchange.build import (base_codec, broadcast_codec, build_broadcast_compressor,
                                          build_compressor, build_replica, build_shards, load_data, local_work)
    from ..runtime.exchange.broadcast import broadcast_widths
    from ..runtime.exchange.hierarchical import run_topology, slice_bytes
    from ..runtime.wire.messages import Control, FrameLength, LossReport

    if config.pipeline:
        raise UsageError("--pipeline from a config is not simulated: its overlap with backward needs the times "
                         "backward makes each bucket ready; simulate a pipelined run's trace instead")
    codec = base_codec(config)
    if codec.two_rounds and getattr(codec, "mixed", False):
        raise UsageError(f"codec {config.codec!r} with per-layer settings (--codec-opt ranks=/widths=, a policy's "
                         "choice per layer) is not simulated from a config: its frames follow the policy's "
                         "settings; give one rank (--codec-opt rank=R) and no menus")
    replica = build_replica(config, load_data(config))
    layout = replica.layout
    layers = len(layout.quantized)
    widths = _bits_list(bits, layers)
    colocated = config.colocated
    shard_count = workers if colocated else int(config.servers)
    shards = build_shards(config, layout, codec, shard_count)
    hierarchical = colocated and config.exchange == "hierarchical"
    topology = run_topology(config, workers) if hierarchical else None
    L = topology.ranks_per_node if hierarchical else None
    slices = slice_bytes(topology, shards, config.intra_codec) if hierarchical else ()
    bound = False
    notes: list[str] = []
    second_in: tuple[tuple[int, ...], ...] = ()
    second_out: tuple[int, ...] = ()
    if codec.two_rounds:  # the factors' two rounds, as rank 0 of the run sizes them (tworounds.LowRankRank0)
        first, second = _factor_frame_sizes(config, replica, codec, shard_count, widths)
        frames_in, second_in = _frames_by_worker(first, workers, L), _frames_by_worker(second, workers, L)
        frames_out = tuple(FrameLength.NBYTES + n for n in first)
        second_out = tuple(FrameLength.NBYTES + n for n in second)
        if codec.start > 0:
            notes.append(f"note: {config.codec} compresses from iteration {codec.start} on (start): the iterations "
                         "simulated are compressed ones, two rounds each (before it every layer goes in float32)")
        if config.compute_time is not None:
            notes.append(f"note: the cost model has no costs for {config.codec}'s matrix products: its local work "
                         "is not charged, as the run's clock charges none")
    else:
        stream = 1  # a worker's: the frames' sizes do not depend on the stream
        compressor = build_compressor(config, layout, codec, stream, shard_count)
        down = build_broadcast_compressor(config, codec, build_compressor(config, layout, codec, 0, shard_count))
        down_widths = broadcast_widths(widths, broadcast_codec(config)[1])

        def size(comp, shard, at) -> int:
            nonlocal bound
            exact = comp.exact_capacity(shard, at)
            if exact is None:
                bound = True
                return comp.capacity(shard, at)
            return exact

        frames_in = _frames_by_worker([size(compressor, shard, widths) for shard in shards], workers, L)
        frames_out = tuple(FrameLength.NBYTES + size(down, shard, down_widths) for shard in shards)
    policy = get_policy(config.policy_config(), n_layers=max(layers, 1), seed=config.seed)
    policy.setup_codec(codec)
    if control_ahead is None:
        control_ahead = config.control == "ahead" and policy.bits_ahead(0) is not None
    traffic = IterationTraffic(LossReport.NBYTES, Control(layers).buf.nbytes, frames_in, frames_out, colocated,
                               second_in, second_out, ahead=bool(control_ahead), hierarchical=hierarchical,
                               slice_bytes=slices)
    shapes = tuple(tuple(p.shape) for p in replica.model.parameters() if p.requires_grad)
    return ConfigTraffic(traffic, bound, layers, shapes, local_work(config, codec, policy, shards, workers),
                         tuple(notes))


def local_seconds(config: RunConfig, workers: int, ours: ConfigTraffic,
                  bits: int | Sequence[int] | None = None) -> float:
    """The cost model's charge for one iteration of ``ours`` at ``bits`` (default the
    config's; 0 with ``--cost-model none``, without ``--compute-time`` or for a two-round
    codec, as the run's clock charges them): the local work besides the compute."""
    from ..costmodel import CostModelError
    from ..runtime.plan.checks import cost_model

    model = cost_model(config)
    if model is None:
        return 0.0
    try:
        ours.local_work.check(model)
        return ours.local_work.seconds(model, _bits_list(config.bits if bits is None else bits, ours.layers))
    except CostModelError as exc:
        raise UsageError(f"--cost-model: {exc}") from None


#: The config keys that make a run's model (``exchange.build.build_config_model``, ``load_data``).
MODEL_KEYS = ("model", "model_opts", "data", "data_dir", "data_opts", "seed")


def trace_config(config: dict, source, keys=MODEL_KEYS, what: str = "its model",
                 advice: str = ": give --peers none") -> RunConfig:
    """A RunConfig of a trace's ``keys`` (its model's by default, the rest defaults; every
    RunConfig key for ``keys=None``), to build the model the peers' buckets hold or the run's
    messages. UsageError (one line) naming ``what`` does not rebuild."""
    names = {f.name for f in fields(RunConfig)} if keys is None else set(keys)
    try:
        return RunConfig(**{key: value for key, value in config.items() if key in names})
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{source}: its config does not rebuild {what} ({exc}){advice}") from None


def model_shapes(config: RunConfig) -> tuple[tuple[int, ...], ...]:
    """The shapes of ``config``'s trainable parameters, in the model's order (what DDP's
    buckets hold)."""
    from ..runtime.exchange.build import build_config_model, load_data

    model = build_config_model(config, load_data(config))
    return tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)


# ---- a trace ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceIteration:
    """One steps row: its iteration, ``traffic``, ``compute`` (the slowest worker's compute,
    or the fixed ``compute_time``), ``rest`` (the rest of its local work: encode, decode and
    policy, or the cost model's charge) and ``t_comm``, what mpigrad's clock charged; a
    pipelined run's row also its buckets (``pipelined``, the trace's ``buckets`` row) and the
    slowest worker's ``forward`` and ``backward`` seconds, as its clock took them."""

    iteration: int
    traffic: IterationTraffic
    compute: float
    rest: float
    t_comm: float
    pipelined: PipelinedTraffic | None = None
    forward: float = 0.0
    backward: float = 0.0


@dataclass(frozen=True)
class TraceRun:
    """A trace's rows to simulate and what the simulation needs of its run."""

    path: str
    config: dict
    iterations: tuple[TraceIteration, ...]
    rows: int
    ranks_per_node: int
    layers: int

    @property
    def workers(self) -> int:
        return self.iterations[0].traffic.workers

    @property
    def colocated(self) -> bool:
        return self.iterations[0].traffic.colocated


def trace_iterations(path: str | os.PathLike, count: int, spread: bool = False) -> TraceRun:
    """The first ``count`` steps rows of the trace at ``path`` (``spread``: ``count`` rows
    spread evenly over the run, its first and last among them). UsageError (one line) for a
    trace that is not complete, not of ``mpigrad train``, or of a run whose messages the trace
    does not keep apart (a two-round codec's rounds are rebuilt from its config:
    :func:`_two_rounds_of`), and a pipelined run whose trace keeps no buckets table. A
    pipelined row keeps its buckets (``TraceIteration.pipelined``)."""
    from ..analysis.labels import flat_config
    from ..analysis.retime import codec_two_rounds, local_costs, recorded_buckets, recorded_traffic, retime_refusal

    path = Path(path)
    if count < 1:
        raise UsageError(f"--sample must be at least 1 iteration, got {count}")
    raw = _read_complete(path, "only a complete run is simulated")
    config = raw.attrs.get("config")
    pipelined = isinstance(config, dict) and bool(config.get("pipeline"))
    reason = retime_refusal(config, rounds_rebuilt=True, buckets_recorded="buckets" in raw.arrays)
    if reason and "reads the clock" not in reason:  # a replay keeps the run's bits: that one does not matter
        raise UsageError(f"{path}: {reason}")
    flat = flat_config(config)
    colocated = flat.get("servers") == COLOCATED
    hierarchical = config.get("exchange") == "hierarchical"
    slice_bytes = (raw.attrs.get("shards") or {}).get("slice_bytes") if hierarchical else ()
    if hierarchical and not slice_bytes:
        raise UsageError(f"{path}: a hierarchical run whose trace records no slices (shards.slice_bytes)")
    try:
        traffic = recorded_traffic(path, raw, colocated=colocated, slice_bytes=slice_bytes or ())
        compute_time = config.get("compute_time")
        local = local_costs(path, raw.attrs, compute_time, None)
        buckets = recorded_buckets(path, raw, hierarchical=hierarchical) if pipelined else None
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    steps = raw.arrays["steps"]
    if not traffic:
        raise UsageError(f"{path}: the trace has no iterations")
    if codec_two_rounds(flat.get("codec")):
        traffic = _two_rounds_of(path, config, traffic, steps["iteration"])
    total = len(traffic)
    if spread and count > 1:
        rows = sorted({round(k * (total - 1) / (count - 1)) for k in range(min(count, total))})
    else:
        rows = list(range(min(count, total)))
    chosen = []
    for row in rows:
        if compute_time is not None:
            compute = float(compute_time)
            rest = local[1].seconds(local[0], [int(b) for b in steps["bits_layers"][row]]) if local else 0.0
        else:
            compute = float(steps["t_compute"][row])
            rest = float(steps["t_encode"][row] + steps["t_decode"][row] + steps["t_policy"][row])
        one = TraceIteration(int(steps["iteration"][row]), traffic[row], compute, rest, float(steps["t_comm"][row]))
        if buckets is not None:
            table = raw.arrays["buckets"]
            if compute_time is not None:  # as its clock charged it: every bucket ready when the compute ends
                one = replace(one, pipelined=replace(buckets[row], ready=tuple((0.0,) * len(r) for r in
                                                                                buckets[row].ready)), forward=compute)
            else:
                one = replace(one, pipelined=buckets[row], forward=float(table["t_forward"][row]),
                              backward=float(table["t_backward"][row]))
        chosen.append(one)
    layers = int(steps["bits_layers"].shape[1]) if "bits_layers" in steps else 1
    return TraceRun(str(path), config, tuple(chosen), total, int(config.get("ranks_per_node", 1) or 1), layers)


def _two_rounds_of(path: Path, config: dict, recorded: list[IterationTraffic], iterations) -> list[IterationTraffic]:
    """A two-round codec's rows with their rounds apart: the trace sums the two rounds into
    its frame columns, so each compressed row (from the codec's ``start`` on) takes the
    rounds its run's config sends (:func:`config_traffic`, as for a config: PowerSGD's frames
    do not depend on the data's values, but its model and data set must still build here), after a check that they add up to the row's frames and
    broadcasts; the rows before ``start`` (one float32 round) are the trace's. UsageError
    (one line) where the config does not rebuild or its rounds are not the row's."""
    from ..runtime.plan.checks import base_codec

    what = "its two rounds"
    run = trace_config(config, path, keys=None, what=what, advice="")
    try:
        start = getattr(base_codec(run), "start", 0)
        rounds = config_traffic(run, recorded[0].workers, run.bits).traffic
    except (TypeError, ValueError, UsageError) as exc:
        raise UsageError(f"{path}: its config does not rebuild {what} ({exc})") from None
    rows = []
    for m, row in zip(iterations, recorded):
        if m < start:
            rows.append(row)
            continue
        summed = [[a + b for a, b in zip(one, two)] for one, two in zip(rounds.frames_in, rounds.frames_in2)]
        if (summed != [list(frames) for frames in row.frames_in]
                or [a + b for a, b in zip(rounds.frames_out, rounds.frames_out2)] != list(row.frames_out)):
            raise UsageError(f"{path}: iteration {int(m)}: its frames are not the two rounds its config sends "
                             f"({rounds.bytes_up + rounds.bytes_down} bytes, the trace "
                             f"{row.bytes_up + row.bytes_down}): not replayed")
        rows.append(replace(row, frames_in=rounds.frames_in, frames_out=rounds.frames_out,
                            frames_in2=rounds.frames_in2, frames_out2=rounds.frames_out2))
    return rows


@dataclass(frozen=True)
class RecordedBits:
    """A recorded run's bits, iteration by iteration: for each steps row of its trace, the
    width of each quantized layer (``bits[k]``, the row's ``bits_layers``) and whether its
    Control went ahead of the losses (``ahead[k]``, ``control_ahead``: MQGrad sends it ahead
    between two of its decisions); ``config``, the run's."""

    path: str
    config: dict
    bits: tuple[tuple[int, ...], ...]
    ahead: tuple[bool, ...]

    @property
    def codec(self) -> str | None:
        from ..analysis.labels import flat_config

        return flat_config(self.config).get("codec")

    def kinds(self) -> list[tuple[tuple[int, ...], bool, int]]:
        """The distinct iterations, (bits, ahead, how many rows had them), in the order of
        their first row."""
        counts: dict[tuple[tuple[int, ...], bool], int] = {}
        for key in zip(self.bits, self.ahead):
            counts[key] = counts.get(key, 0) + 1
        return [(bits, ahead, count) for (bits, ahead), count in counts.items()]


def recorded_bits(path: str | os.PathLike) -> RecordedBits:
    """The bits per iteration of the complete trace at ``path`` (:class:`RecordedBits`), every
    steps row. UsageError (one line) for a trace that cannot be read, is not complete, or
    records no bits per layer."""
    path = Path(path)
    raw = _read_complete(path, "only a complete run's bits are taken")
    steps = raw.arrays.get("steps") or {}
    if "bits_layers" not in steps or not len(steps["bits_layers"]):
        raise UsageError(f"{path}: the trace records no bits per layer (steps/bits_layers)")
    ahead = steps.get("control_ahead")  # older traces: every Control after the losses (as recorded_traffic)
    rows = len(steps["bits_layers"])
    return RecordedBits(str(path), dict(raw.attrs.get("config") or {}),
                        tuple(tuple(int(b) for b in row) for row in steps["bits_layers"]),
                        tuple(bool(a) for a in ahead) if ahead is not None else (False,) * rows)


def clock_seconds(link: LinkModel, traffic: IterationTraffic, compute: float, rest: float,
                  pipelined: PipelinedTraffic | None = None, forward: float = 0.0,
                  backward: float = 0.0) -> tuple[float, float]:
    """(seconds of the iteration, of its communication) on mpigrad's clock: ``link``'s
    ``comm_seconds`` from the end of the compute, plus the local work (``iteration_seconds``);
    a pipelined iteration's (``pipelined``, from a trace) the communication not hidden behind
    backward, as its run charged it (``LinkModel.pipelined_iteration`` after ``forward``, with
    backward's ``backward`` seconds)."""
    if pipelined is not None:
        t_comm, _ = link.pipelined_iteration(pipelined, 0.0, None, forward, backward)
    else:
        t_comm = link.comm_seconds(traffic, comm_start(0.0, compute, 0.0), sent=0.0)
    return iteration_seconds(t_comm, compute, 0.0, 0.0, 0.0, 0.0, rest), t_comm


def clock_link(bandwidth: float, latency: float, ranks_per_node: int, intra_bandwidth: float,
               intra_latency: float, colocated: bool) -> LinkModel:
    """mpigrad's clock on a generated platform: one constant rate and latency, star
    broadcasts, and nodes of several workers (``Nodes``) where colocated servers have them."""
    nodes = Nodes(ranks_per_node, intra_bandwidth, intra_latency) if ranks_per_node > 1 and colocated else None
    return LinkModel(bandwidth, latency, "virtual", "star", nodes=nodes)


def resolved_config(config: RunConfig, workers: int) -> tuple[RunConfig, list[str]]:
    """``config`` for ``workers`` workers as the launch resolves it (its nodes and exchange,
    ``resolve_topology``), validated; and the notes the launch would print. UsageError (one line)."""
    from ..runtime.plan.topology import resolve_topology

    config.validate()
    if isinstance(config.bandwidth, str) or isinstance(config.latency, str) or config.link_bandwidth:
        raise UsageError("a bandwidth or latency schedule or --link-bandwidth is not simulated: the platform's "
                         "links have one rate and latency (give --bandwidth RATE --latency T)")
    try:
        topology, exchange, notes = resolve_topology(config, workers + config.non_worker_ranks(), None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return replace(config, ranks_per_node=topology.ranks_per_node, exchange=exchange), notes


def _read_complete(path: Path, use: str):
    """The raw trace at ``path``; UsageError (one line) where it cannot be read or its run is
    not complete (``use`` says what only a complete run gives)."""
    try:
        raw = read_raw(path)
    except (OSError, TraceError) as exc:
        raise UsageError(f"cannot read the trace {path}: {exc}") from None
    status = str(raw.attrs.get("status", "running"))
    if status != "complete":
        raise UsageError(f"{path}: trace status {status!r}; {use}")
    return raw
