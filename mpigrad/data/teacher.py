"""Images labelled by a fixed random teacher network: seeded, learnable, not linearly separable.

A task where a linear classifier is not enough (``docs/results.rst``, "A task where bits
matter"). Images are i.i.d. N(0, 1) pixels of ``shape`` (C, H, W). The teacher, drawn from
the seed, is one layer of ``filters`` random 3x3 convolutions (valid padding, weights
N(0, 1 / (9 C))), the absolute value, an average pool onto ``grid`` x ``grid`` cells of the
map, and a random linear read-out to ``classes`` logits (weights N(0, 1)). The label is
the arg-max of the logits plus per-class offsets that balance the classes (fitted on a
calibration sample drawn first, so every split shares them).

The absolute value makes the teacher even, f(-x) = f(x), and the images symmetric, so a
linear function of the pixels sees x and -x with the same label and opposite scores: a
linear classifier stays near chance, while a small CNN (convolutions, ReLU, pooling) can
represent the teacher. Measured on seed 1 (tests/test_teacher.py): logistic regression on
the pixels 27 % test accuracy (chance 25 %), a 16-filter conv + ReLU + pool + linear
model 66 %, each after 300 Adam steps. The same seed gives the same arrays; the defaults
take about 1 s to generate.
"""

from __future__ import annotations

import math

import numpy as np

from .datasets import DataError, Dataset, check_count, check_no_data_dir, check_seed
from .synthetic import parse_shape

__all__ = ["make_teacher", "build_teacher", "Teacher", "KERNEL"]

KERNEL = 3
_CHUNK = 256
_SEED_TAG = 0x7EAC
_CALIBRATION = 8192   # images that fit the class offsets
_BALANCE_STEPS = 200


class Teacher:
    """The labelling network: ``filters`` 3x3 convolutions, abs, ``grid`` x ``grid``
    average pool, linear read-out to ``classes`` logits, class offsets for balance."""

    def __init__(self, rng: np.random.Generator, shape: tuple[int, int, int], classes: int,
                 filters: int, grid: int):
        channels, height, width = shape
        if height < KERNEL + grid - 1 or width < KERNEL + grid - 1:
            raise DataError(f"teacher: shape {shape} is too small for a {KERNEL}x{KERNEL} "
                            f"convolution and a {grid}x{grid} pool grid")
        self.shape, self.classes, self.grid = shape, classes, grid
        self.conv = rng.normal(0.0, 1.0 / math.sqrt(KERNEL * KERNEL * channels),
                               (channels * KERNEL * KERNEL, filters)).astype(np.float32)
        self.readout = rng.normal(0.0, 1.0, (filters * grid * grid, classes)).astype(np.float32)
        self.mean, self.std, self.offsets = 0.0, 1.0, np.zeros(classes)

    def features(self, images: np.ndarray) -> np.ndarray:
        """(N, filters * grid * grid): pooled |conv| responses of float32 (N, C, H, W)."""
        n = images.shape[0]
        patches = np.lib.stride_tricks.sliding_window_view(images, (KERNEL, KERNEL), axis=(2, 3))
        # patches: (N, C, H', W', k, k) -> (N, H', W', C*k*k), the order of self.conv's rows
        patches = patches.transpose(0, 2, 3, 1, 4, 5)
        out_h, out_w = patches.shape[1:3]
        maps = np.abs(patches.reshape(n, out_h, out_w, -1) @ self.conv)       # (N, H', W', F)
        rows = np.array_split(np.arange(out_h), self.grid)
        cols = np.array_split(np.arange(out_w), self.grid)
        cells = [maps[:, r[0]:r[-1] + 1, c[0]:c[-1] + 1].mean(axis=(1, 2)) for r in rows for c in cols]
        return np.stack(cells, axis=2).reshape(n, -1)                          # (N, F*g*g)

    def scores(self, images: np.ndarray) -> np.ndarray:
        """(N, classes) logits, standardised by the calibration sample, offsets added."""
        return (self.features(images) @ self.readout - self.mean) / self.std + self.offsets

    def balance(self, images: np.ndarray) -> None:
        """Standardise the logits on ``images`` and fit ``offsets`` so that their arg-max
        labels fall about evenly into the classes (steps against each class's excess share;
        deterministic)."""
        raw = self.features(images) @ self.readout
        self.mean, self.std = raw.mean(axis=0), raw.std()
        scores = (raw - self.mean) / self.std
        classes = scores.shape[1]
        offsets = np.zeros(classes)
        for step in range(_BALANCE_STEPS):
            share = np.bincount(np.argmax(scores + offsets, axis=1), minlength=classes) / len(scores)
            offsets -= 0.5 / (1 + step / 20) * (share - 1.0 / classes) * classes
        self.offsets = offsets

    def label(self, images: np.ndarray) -> np.ndarray:
        return np.argmax(self.scores(images), axis=1).astype(np.int64)


def make_teacher(*, data_dir=None, seed: int = 0, shape=(1, 12, 12), classes: int = 4,
                 train_size: int = 8192, test_size: int = 2048, filters: int = 4,
                 grid: int = 3) -> Dataset:
    """``train_size`` + ``test_size`` images of ``shape`` labelled by the seed's teacher."""
    check_no_data_dir("teacher", data_dir)
    seed = check_seed(seed)
    train_size = check_count("train_size", train_size)
    test_size = check_count("test_size", test_size)
    rng = np.random.default_rng([seed, _SEED_TAG])
    teacher = build_teacher(rng, shape=shape, classes=classes, filters=filters, grid=grid)
    splits = []
    for size in (train_size, test_size):
        images = rng.standard_normal((size, *teacher.shape), dtype=np.float32)
        labels = np.concatenate([teacher.label(images[start:start + _CHUNK])
                                 for start in range(0, size, _CHUNK)])
        splits += [images, labels]
    return Dataset("teacher", *splits, num_classes=teacher.classes, input_shape=teacher.shape)


def build_teacher(rng: np.random.Generator, *, shape=(1, 12, 12), classes: int = 4, filters: int = 4,
                  grid: int = 3) -> Teacher:
    """The teacher drawn from ``rng``, balanced on a calibration sample drawn next from it
    (``make_teacher`` then draws the images from the same generator)."""
    shape = parse_shape(shape)
    classes = check_count("classes", classes, minimum=2)
    filters = check_count("filters", filters)
    grid = check_count("grid", grid)
    teacher = Teacher(rng, shape, classes, filters, grid)
    teacher.balance(rng.standard_normal((_CALIBRATION, *shape), dtype=np.float32))
    return teacher
