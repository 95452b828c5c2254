"""Synthetic images at any shape, for benchmarks: learnable, seeded, fast to generate.

Each class k has a mean image ``m_k``: i.i.d. N(0, signal**2) values on a grid of
``BLOCK`` x ``BLOCK`` pixel blocks (coarse, so it survives the CNN's pooling). An example
of class k is ``(m_k + noise) / sqrt(1 + signal**2)`` with N(0, 1) noise, so pixels have
mean 0 and variance 1 over the data without a normalising pass. Labels cycle through the
classes and are shuffled. The same seed gives the same arrays.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from ..options import check_bool
from .datasets import DataError, Dataset, check_count, check_no_data_dir, check_seed

__all__ = ["make_synthetic", "parse_shape", "BLOCK"]

BLOCK = 4
_CHUNK = 256


def make_synthetic(*, data_dir=None, seed: int = 0, shape=(3, 32, 32), classes: int = 10,
                   train_size: int = 4096, test_size: int = 1024, signal: float = 0.25,
                   augmentable: bool = False) -> Dataset:
    """``train_size`` + ``test_size`` images of ``shape`` (C, H, W) in ``classes`` classes;
    ``augmentable``: let ``--augment`` crop and flip them (a stand-in for natural images)."""
    check_no_data_dir("synthetic", data_dir)
    seed = check_seed(seed)
    shape = parse_shape(shape)
    classes = check_count("classes", classes, minimum=2)
    train_size = check_count("train_size", train_size)
    test_size = check_count("test_size", test_size)
    if isinstance(signal, bool) or not isinstance(signal, (int, float)) \
            or not math.isfinite(signal) or signal <= 0:
        raise DataError(f"signal must be a finite number > 0, got {signal!r}")

    rng = np.random.default_rng([seed, 0x5E7])
    channels, height, width = shape
    coarse = rng.normal(0.0, signal, (classes, channels, -(-height // BLOCK), -(-width // BLOCK)))
    means = coarse.repeat(BLOCK, axis=2).repeat(BLOCK, axis=3)[:, :, :height, :width].astype(np.float32)
    scale = np.float32(1.0 / math.sqrt(1.0 + signal * signal))
    splits = []
    for size in (train_size, test_size):
        labels = rng.permutation(np.arange(size, dtype=np.int64) % classes)
        images = rng.standard_normal((size, *shape), dtype=np.float32)
        for start in range(0, size, _CHUNK):  # chunks bound the temporary means[labels]
            part = slice(start, start + _CHUNK)
            images[part] += means[labels[part]]
            images[part] *= scale
        splits += [images, labels]
    augmentable = check_bool("augmentable", augmentable, error=DataError)
    return Dataset("synthetic", *splits, num_classes=classes, input_shape=shape, augmentable=augmentable)


def parse_shape(shape) -> tuple[int, int, int]:
    """(C, H, W) from a sequence of three positive ints or a string such as ``"3x32x32"``."""
    values = shape
    if isinstance(shape, str):
        values = re.split(r"[x,\s]+", shape.strip().lower())
        try:
            values = [int(v) for v in values]
        except ValueError:
            raise DataError(f"shape must look like 3x32x32, got {shape!r}") from None
    if not isinstance(values, Sequence) or len(values) != 3 or any(
            isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in values):
        raise DataError(f"shape must be three positive integers (C, H, W), got {shape!r}")
    return tuple(int(v) for v in values)
