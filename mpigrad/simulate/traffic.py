"""The messages a simulation replays, from mpigrad's own code: one
:class:`~mpigrad.clockmodel.IterationTraffic` per iteration, with its local work.

From a config (:func:`traffic_of`): the model's layout, the shards and the compressors as
the ranks build them (``runtime/exchange/build.py``), each frame's size at the iteration's
bits from the compressor's ``exact_capacity`` (every codec that fixes its frame size: fp32,
fp16, uniform, sign, TernGrad, fixed-width QSGD), else ``capacity``, the bound a receiver
sizes its buffer by (QSGD's Elias stream, MCGQ: the frames are then at most that big, and
:func:`traffic_of` says so in ``ConfigTraffic.bound``). From a trace
(:func:`trace_iterations`): exactly as ``mpigrad trace retime`` rebuilds each row's traffic
(``analysis/retime.py``), with the row's recorded local work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from ..clockmodel import IterationTraffic, LinkModel, Nodes, comm_start, iteration_seconds
from ..config import COLOCATED, RunConfig
from ..costmodel import LocalWork
from ..errors import UsageError
from ..trace import TraceError, read_raw

__all__ = ["ConfigTraffic", "TraceIteration", "TraceRun", "traffic_of", "config_traffic", "trace_iterations",
           "model_shapes"]


@dataclass(frozen=True)
class ConfigTraffic:
    """A config's iteration: its ``traffic``, ``bound`` (True where some frame's size is the
    codec's bound, not its exact size), the quantized layers' count, the parameters' shapes
    (for the peers) and what the cost model charges (``local_work``, as rank 0 builds it)."""

    traffic: IterationTraffic
    bound: bool
    layers: int
    shapes: tuple[tuple[int, ...], ...]
    local_work: LocalWork


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


def config_traffic(config: RunConfig, workers: int, bits: int | Sequence[int]) -> ConfigTraffic:
    """:func:`traffic_of` with what else a simulation needs of the config (:class:`ConfigTraffic`).
    UsageError (one line) for a run this cannot lay out: a two-round codec (PowerSGD), the
    pipelined iteration, a model, data set, codec or policy that cannot be built."""
    from ..codecs import CodecError
    from ..data import DataError
    from ..models import ModelError
    from ..policies import PolicyError

    try:
        return _config_traffic(config, workers, bits)
    except (CodecError, DataError, ModelError, PolicyError) as exc:
        raise UsageError(str(exc)) from None


def _config_traffic(config: RunConfig, workers: int, bits: int | Sequence[int]) -> ConfigTraffic:
    from ..policies import get_policy
    from ..runtime.exchange.build import (base_codec, broadcast_codec, build_broadcast_compressor,
                                          build_compressor, build_replica, build_shards, load_data)
    from ..runtime.exchange.broadcast import broadcast_widths
    from ..runtime.exchange.hierarchical import run_topology, slice_bytes
    from ..runtime.wire.messages import Control, FrameLength, LossReport

    if config.pipeline:
        raise UsageError("--pipeline is not simulated yet (its overlap with backward needs the buckets' times)")
    codec = base_codec(config)
    if codec.two_rounds:
        raise UsageError(f"codec {config.codec!r} sends two rounds per iteration, not simulated from a config yet: "
                         "simulate a trace of it, or compare it as a peer (DDP PowerSGD)")
    replica = build_replica(config, load_data(config))
    layout = replica.layout
    layers = len(layout.quantized)
    widths = _bits_list(bits, layers)
    colocated = config.colocated
    shard_count = workers if colocated else int(config.servers)
    shards = build_shards(config, layout, codec, shard_count)
    stream = 1  # a worker's: the frames' sizes do not depend on the stream
    compressor = build_compressor(config, layout, codec, stream, shard_count)
    down = build_broadcast_compressor(config, codec, build_compressor(config, layout, codec, 0, shard_count))
    down_widths = broadcast_widths(widths, broadcast_codec(config)[1])
    bound = False

    def size(comp, shard, at) -> int:
        nonlocal bound
        exact = comp.exact_capacity(shard, at)
        if exact is None:
            bound = True
            return comp.capacity(shard, at)
        return exact

    up = [size(compressor, shard, widths) for shard in shards]
    hierarchical = colocated and config.exchange == "hierarchical"
    slices: tuple[int, ...] = ()
    if hierarchical:
        topology = run_topology(config, workers)
        L = topology.ranks_per_node
        frames_in = tuple(tuple(up[s] if w % L == s % L else 0 for w in range(workers)) for s in range(shard_count))
        slices = slice_bytes(topology, shards, config.intra_codec)
    else:
        frames_in = tuple(tuple(up[s] for _ in range(workers)) for s in range(shard_count))
    frames_out = tuple(FrameLength.NBYTES + size(down, shard, down_widths) for shard in shards)
    policy = get_policy(config.policy_config(), n_layers=max(layers, 1), seed=config.seed)
    policy.setup_codec(codec)
    ahead = config.control == "ahead" and policy.bits_ahead(0) is not None
    traffic = IterationTraffic(LossReport.NBYTES, Control(layers).buf.nbytes, frames_in, frames_out, colocated,
                               ahead=ahead, hierarchical=hierarchical, slice_bytes=slices)
    shapes = tuple(tuple(p.shape) for p in replica.model.parameters() if p.requires_grad)
    from ..runtime.exchange.build import local_work

    return ConfigTraffic(traffic, bound, layers, shapes, local_work(config, codec, policy, shards, workers))


def local_seconds(config: RunConfig, workers: int, ours: ConfigTraffic) -> float:
    """The cost model's charge for one iteration of ``ours`` at the config's bits (0 with
    ``--cost-model none`` or without ``--compute-time``): the local work besides the compute."""
    from ..costmodel import CostModelError
    from ..runtime.plan.checks import cost_model

    model = cost_model(config)
    if model is None:
        return 0.0
    try:
        ours.local_work.check(model)
        return ours.local_work.seconds(model, _bits_list(config.bits, ours.layers))
    except CostModelError as exc:
        raise UsageError(f"--cost-model: {exc}") from None


#: The config keys that make a run's model (``exchange.build.build_config_model``, ``load_data``).
MODEL_KEYS = ("model", "model_opts", "data", "data_dir", "data_opts", "seed")


def trace_config(config: dict, source) -> RunConfig:
    """A RunConfig of a trace's model (its ``MODEL_KEYS``, the rest defaults), to build the
    model the peers' buckets hold. UsageError (one line)."""
    try:
        return RunConfig(**{key: config[key] for key in MODEL_KEYS if key in config})
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{source}: its config does not rebuild its model ({exc}): give --peers none") from None


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
    policy, or the cost model's charge) and ``t_comm``, what mpigrad's clock charged."""

    iteration: int
    traffic: IterationTraffic
    compute: float
    rest: float
    t_comm: float


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
    does not keep apart (two-round codecs, the pipelined iteration)."""
    from ..analysis.labels import flat_config
    from ..analysis.retime import local_costs, recorded_traffic, retime_refusal

    path = Path(path)
    if count < 1:
        raise UsageError(f"--sample must be at least 1 iteration, got {count}")
    try:
        raw = read_raw(path)
    except (OSError, TraceError) as exc:
        raise UsageError(f"cannot read the trace {path}: {exc}") from None
    status = str(raw.attrs.get("status", "running"))
    if status != "complete":
        raise UsageError(f"{path}: trace status {status!r}; only a complete run is simulated")
    config = raw.attrs.get("config")
    reason = retime_refusal(config)
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
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    steps = raw.arrays["steps"]
    total = len(traffic)
    if not total:
        raise UsageError(f"{path}: the trace has no iterations")
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
        chosen.append(TraceIteration(int(steps["iteration"][row]), traffic[row], compute, rest,
                                     float(steps["t_comm"][row])))
    layers = int(steps["bits_layers"].shape[1]) if "bits_layers" in steps else 1
    return TraceRun(str(path), config, tuple(chosen), total, int(config.get("ranks_per_node", 1) or 1), layers)


def clock_seconds(link: LinkModel, traffic: IterationTraffic, compute: float, rest: float) -> tuple[float, float]:
    """(seconds of the iteration, of its communication) on mpigrad's clock: ``link``'s
    ``comm_seconds`` from the end of the compute, plus the local work (``iteration_seconds``)."""
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
