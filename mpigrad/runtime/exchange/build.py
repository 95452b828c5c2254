"""Building a rank's parts from the config: data, model replica, codec, shards, compressor, seeds."""

from __future__ import annotations

import contextlib
import json
import threading

import numpy as np
import torch

from ...codecs import Codec
from ...config import RunConfig
from ...data import Dataset, load_dataset
from ...feedback import ErrorFeedback
from ...models import build_model
from ...optim import LearningRate, UpdateRule
from ...costmodel import LocalWork
from ..plan.checks import base_codec, broadcast_codec
from ..plan.gpu import resolve_device
from .compressor import GradientCompressor
from ..plan.layout import Chunks, Layout, Shard, pieces_of, plan_shards, resolve_chunks
from .replica import Replica

__all__ = ["SERVER_STREAM", "derive_seed", "base_codec", "broadcast_codec", "load_data", "release_data",
           "build_config_model", "forward_context", "build_replica", "train_replica", "script_replica", "shard_chunks", "build_shards",
           "build_factor_shards", "build_compressor"]

#: The RNG stream of the servers' re-encode; worker k (1-based) encodes with stream k.
SERVER_STREAM = 0


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from (run seed, stream, layer, ...), independent across parts."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> np.uint64(1))


_loaded: dict[str, Dataset] = {}


def load_data(config: RunConfig) -> Dataset:
    """The run's dataset; loaded once per process (the launch check and the run share it)."""
    key = json.dumps([config.data, config.data_dir, config.seed, config.data_opts], sort_keys=True)
    dataset = _loaded.get(key)
    if dataset is None:
        dataset = load_dataset(config.data, data_dir=config.data_dir, seed=config.seed, **config.data_opts)
        _loaded.clear()
        _loaded[key] = dataset
    return dataset


def release_data() -> None:
    """Drop the loaded dataset once a rank has what it keeps (rank 0: the test split; a worker:
    its shard; a shard server: nothing). In-process ranks may load it again."""
    _loaded.clear()


_seeding = threading.Lock()  # in-process ranks (loopback) share torch's global RNG


def build_config_model(config: RunConfig, dataset: Dataset) -> torch.nn.Module:
    """The run's model as every rank builds it: ``config.model`` sized for ``dataset``,
    initialised from ``config.seed`` (the same weights on every rank, and in a DDP peer)."""
    with _seeding:
        return build_model(config.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes,
                           seed=config.seed, **config.model_opts)


def forward_context(config: RunConfig, device: torch.device):
    """The context of a worker's forward pass and loss: torch.autocast in bfloat16 under
    ``autocast = "bf16"`` (backward follows it; parameters and gradients stay float32), else
    nothing."""
    if config.autocast == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_replica(config: RunConfig, dataset: Dataset, workers: int | None = None, servers: int = 1) -> Replica:
    """The run's replica (its model built by :func:`build_config_model`); with ``workers``
    (a rank that applies updates) its update rule, as :func:`train_replica` attaches it."""
    model = build_config_model(config, dataset)
    if workers is not None:
        return train_replica(config, model, workers, servers)
    return Replica(model, config.min_quantize_size, resolve_device(config.device), base_codec(config))


def train_replica(config: RunConfig, model: torch.nn.Module, workers: int, servers: int = 1) -> Replica:
    """The replica around ``model`` (the config's) on ``--device``, of a rank that applies the
    run's updates: the run's optimizer over the layout's pieces (those of ``servers``
    servers), at the schedule's rates for ``workers`` workers."""
    replica = Replica(model, config.min_quantize_size, resolve_device(config.device), base_codec(config))
    cut = shard_chunks(config, replica.layout, servers)
    pieces = [(piece.offset, piece.size) for piece in pieces_of(replica.layout, cut)]
    rule = UpdateRule(config.optimizer, config.update_options, pieces, replica.flat, config.lr)
    rate = LearningRate(config.lr, config.lr_schedule, config.lr_schedule_opts, config.lr_warmup,
                        config.lr_scaling, workers)
    replica.use_update_rule(rule, rate)
    return replica


def script_replica(config: RunConfig, model: torch.nn.Module) -> Replica:
    """The replica around a script's own ``model`` (:class:`mpigrad.Session`), where it is (its
    parameters' device): no update rule, the script's optimizer applies the update."""
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    return Replica(model, config.min_quantize_size, device, base_codec(config))


def shard_chunks(config: RunConfig, layout: Layout, servers: int) -> Chunks:
    """How the run cuts its layout into pieces with ``servers`` servers (``--shard-chunk``;
    auto keeps whole layers for a plugin optimizer, which gets each piece as a layer). A
    two-round codec under the hierarchical exchange keeps whole layers (its factor shards'
    pieces): a node's slice of the gradient is then whole matrices, whose factors the slice's
    local rank computes."""
    from ...plugins import is_plugin

    if base_codec(config).two_rounds and hierarchical_exchange(config):
        return Chunks()
    return resolve_chunks(config.shard_chunk, layout, servers, whole_layers=is_plugin(config.optimizer))


def hierarchical_exchange(config: RunConfig) -> bool:
    """Whether a run of ``config`` takes the hierarchical exchange (sequential, or pipelined
    with ``--pipeline``): colocated, ``--exchange hierarchical`` on nodes of several workers
    (with one worker per node it is the flat exchange)."""
    return config.colocated and config.exchange == "hierarchical" and config.ranks_per_node != 1


def build_shards(config: RunConfig, layout: Layout, codec: Codec, shards: int) -> tuple[Shard, ...]:
    """The run's ``shards`` shards (``Channel.servers``): its pieces (``shard_chunks``)
    dealt as ``plan_shards`` says, by the bytes each takes at the initial bits."""
    return plan_shards(layout, shards, piece_bytes(codec), shard_chunks(config, layout, shards))


def build_factor_shards(config: RunConfig, layout: Layout, codec: Codec, shards: int) -> tuple[Shard, ...]:
    """A two-round (low-rank) codec's layer shards: whole layers, whatever ``--shard-chunk``
    says (the factors of a matrix go to one server), dealt by bytes as ``plan_shards`` says.
    ``build_shards``' pieces carry its float32 iterations before ``start``."""
    return plan_shards(layout, shards, piece_bytes(codec), 0)


def piece_bytes(codec: Codec):
    """A piece's bytes at the initial bits (what shards are balanced by), as a function."""
    return lambda piece: codec.max_encoded_size(piece.size) if piece.quantized else 4 * piece.size


def piece_seeds(config: RunConfig, pieces: list, stream: int) -> dict[int, int]:
    """Each quantized piece's RNG seed on ``stream``: (seed, stream, layer), and the chunk's
    number k > 0 for a layer's later chunks."""
    seeds, chunk = {}, {}
    for piece in pieces:
        if piece.quantized:
            k = chunk[piece.layer] = chunk.get(piece.layer, -1) + 1
            seeds[piece.index] = derive_seed(*((config.seed, stream, piece.layer) + ((k,) if k else ())))
    return seeds


def build_compressor(config: RunConfig, layout: Layout, codec: Codec, stream: int,
                     servers: int) -> GradientCompressor:
    """A compressor over the run's pieces with ``servers`` servers; ``stream`` is
    SERVER_STREAM or the worker's number."""
    return _compressor(config, pieces_of(layout, shard_chunks(config, layout, servers)), codec, stream)


def _compressor(config: RunConfig, pieces: list, codec: Codec, stream: int) -> GradientCompressor:
    feedback = ErrorFeedback(mode=config.error_feedback) if config.error_feedback != "none" else None
    return GradientCompressor(pieces, codec, piece_seeds(config, pieces, stream), feedback)


def build_broadcast_compressor(config: RunConfig, codec: Codec, compressor: GradientCompressor) -> GradientCompressor:
    """The compressor of the servers' broadcast (``--broadcast-codec``): ``compressor`` (built
    for the workers' ``codec``) when the broadcast uses that codec, else one of its own over
    the same pieces on stream SERVER_STREAM. Servers re-encode the average with it, every
    rank decodes the broadcast with it; a server's checkpoint holds its state."""
    down = broadcast_codec(config)[0]
    if down.get_config() == codec.get_config():
        return compressor
    return _compressor(config, compressor.pieces, down, SERVER_STREAM)


def local_work(config: RunConfig, codec: Codec, policy, shards, workers: int) -> LocalWork:
    """What the cost model charges per iteration (:mod:`mpigrad.costmodel`): the pieces of
    every shard and the codecs, of ``workers`` workers. The one rule for rank 0
    (``ParameterServer``) and ``mpigrad simulate``."""
    down, down_bits = broadcast_codec(config)
    if down_bits is None and not down.takes_policy_bits:
        down_bits = down.fixed_bits
    elif down_bits is None and not codec.takes_policy_bits:
        # The trace then records the workers' fixed bits, not the policy's: name the
        # broadcast's width here (a policy that cannot move bits for such a codec).
        lowest, highest = policy.bits_range()
        down_bits = lowest if lowest == highest else None
    L = config.ranks_per_node
    slices = L if hierarchical_exchange(config) and isinstance(L, int) else 1
    return LocalWork(workers, codec.codec_id, None if codec.takes_policy_bits else codec.fixed_bits,
                     down.codec_id, down_bits, config.error_feedback,
                     tuple(tuple((p.layer, p.size) for p in shard.pieces) for shard in shards), config.policy,
                     slices)
