"""A worked mpigrad plugin: a data factory and a model factory in one importable module.

Bars: noisy C x S x S images holding one bright bar, horizontal, vertical or along
either diagonal (4 classes), drawn at a random offset. From the repository root::

    PYTHONPATH=examples/plugins mpiexec -n 3 python -m mpi4py -m mpigrad train \\
        --config examples/plugins/bars.toml --trace runs/bars.h5

mpigrad calls ``load_bars(data_dir=..., seed=..., **data_opts)`` and
``make_model(input_shape=..., num_classes=..., seed=..., **model_opts)`` on every rank
(the module must import there too: PYTHONPATH, the working directory, or installed).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mpigrad.data import DataError, Dataset

CLASSES = ("horizontal", "vertical", "diagonal", "antidiagonal")


def _draw(rng: np.random.Generator, count: int, channels: int, size: int, noise: float):
    labels = rng.integers(0, len(CLASSES), count)
    images = rng.normal(0.0, noise, (count, channels, size, size)).astype(np.float32)
    offsets = rng.integers(-(size // 4), size // 4 + 1, count)
    line = np.arange(size)
    for i, (label, offset) in enumerate(zip(labels, offsets)):
        centre = size // 2 + offset
        if label == 0:
            images[i, :, centre, :] += 1.0
        elif label == 1:
            images[i, :, :, centre] += 1.0
        else:
            cols = (line + offset) % size if label == 2 else (size - 1 - line + offset) % size
            images[i, :, line, cols] += 1.0
    return images, labels.astype(np.int64)


def load_bars(*, data_dir=None, seed: int = 0, size: int = 12, channels: int = 1,
              train_size: int = 2000, test_size: int = 500, noise: float = 0.5) -> Dataset:
    """The data factory: the same seed gives the same images on every rank."""
    if data_dir is not None:
        raise DataError("bars is generated: it takes no --data-dir")
    if size < 4 or channels < 1 or train_size < 1 or test_size < 1 or noise < 0:
        raise DataError("bars needs size >= 4, channels, train_size, test_size >= 1 and noise >= 0")
    rng = np.random.default_rng(seed)
    train_x, train_y = _draw(rng, train_size, channels, size, noise)
    test_x, test_y = _draw(rng, test_size, channels, size, noise)
    return Dataset("bars", train_x, train_y, test_x, test_y, num_classes=len(CLASSES),
                   input_shape=(channels, size, size))


class SmallNet(nn.Module):
    """conv3x3 - norm - ReLU - conv3x3/2 - norm - ReLU - global average pool - linear."""

    def __init__(self, channels: int, num_classes: int, width: int, norm: str):
        super().__init__()

        def norm_layer(c: int) -> nn.Module:
            return nn.BatchNorm2d(c) if norm == "batch" else nn.GroupNorm(4, c)

        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), norm_layer(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), norm_layer(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def make_model(*, input_shape, num_classes: int, seed: int, width: int = 16, norm: str = "batch") -> nn.Module:
    """The model factory. mpigrad has already seeded torch with ``seed``; a factory with its
    own random initialisation must draw it from ``seed`` so that every rank agrees."""
    if norm not in ("group", "batch"):
        raise ValueError(f"norm must be 'group' or 'batch', got {norm!r}")
    if width % 4:
        raise ValueError(f"width must be a multiple of 4 (GroupNorm's 4 groups), got {width}")
    return SmallNet(input_shape[0], num_classes, width, norm)
