"""Set-up shared by the server and the workers: data, model replica, codecs, seeds."""

from __future__ import annotations

import json

import numpy as np
import torch

from ..codecs import Codec, get_codec
from ..config import RunConfig
from ..data import Dataset, load_dataset
from ..errors import UsageError
from ..feedback import ErrorFeedback
from ..models import build_model
from .replica import FrameEncoder, Replica



def derive_seed(*parts: int) -> int:
    """A 63-bit seed from (run seed, rank, layer, ...), independent across parts."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for, but torch sees no CUDA device here")
    return torch.device(name)


def base_codec(config: RunConfig) -> Codec:
    codec_config = config.codec_config()
    codec = get_codec(codec_config)
    if codec.accepts_bits and "levels" not in codec_config:
        codec = codec.with_bits(config.bits)
    return codec


_loaded: dict[str, Dataset] = {}


def load_data(config: RunConfig) -> Dataset:
    """The run's dataset; loaded once per process (the launch check and the run share it)."""
    key = json.dumps([config.data, config.data_dir, config.seed, config.data_opts], sort_keys=True)
    if key not in _loaded:
        _loaded.clear()
        _loaded[key] = load_dataset(config.data, data_dir=config.data_dir, seed=config.seed,
                                    **config.data_opts)
    return _loaded[key]


def build_replica(config: RunConfig, dataset: Dataset) -> Replica:
    model = build_model(config.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes,
                        seed=config.seed, **config.model_opts)
    return Replica(model, config.min_quantize_size, resolve_device(config.device))


def build_encoder(config: RunConfig, replica: Replica, codec: Codec, rank: int) -> FrameEncoder:
    n_layers = len(replica.layout.quantized)
    seeds = [derive_seed(config.seed, rank, layer) for layer in range(n_layers)]
    feedback = None
    if config.error_feedback != "none":
        feedback = ErrorFeedback(mode=config.error_feedback)
    return FrameEncoder(replica.layout, codec, seeds, feedback)
