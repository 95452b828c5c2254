"""The ``Dataset`` record every loader returns, ``DataError``, and shared checks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import options

__all__ = ["Dataset", "DataError", "standardise_per_channel", "check_seed", "check_count",
           "check_no_data_dir"]


class DataError(ValueError):
    """A dataset that cannot be loaded or sharded as asked; the message names the cause."""


@dataclass(eq=False)
class Dataset:
    """Train and test arrays of one dataset, ready for the model.

    ``train_x``/``test_x`` are float32 (N, C, H, W) and normalised; ``train_y``/``test_y``
    int64 (N,) labels in ``[0, num_classes)``; ``input_shape`` is (C, H, W).
    """

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    input_shape: tuple[int, int, int]
    #: Its images survive random crops and horizontal flips (``--augment crop-flip``):
    #: natural images such as CIFAR-10's, not digits (a mirrored digit is another symbol).
    augmentable: bool = False

    def __post_init__(self) -> None:
        self.input_shape = tuple(int(d) for d in self.input_shape)
        if len(self.input_shape) != 3 or min(self.input_shape) < 1:
            raise DataError(f"{self.name}: input_shape must be (C, H, W), got {self.input_shape}")
        self.num_classes = check_count("num_classes", self.num_classes, minimum=2)
        for split in ("train", "test"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            if x.dtype != np.float32 or x.ndim != 4 or x.shape[1:] != self.input_shape:
                raise DataError(f"{self.name}: {split}_x is {x.dtype} {x.shape}, "
                                f"expected float32 (N, {self.input_shape})")
            if y.dtype != np.int64 or y.shape != (x.shape[0],):
                raise DataError(f"{self.name}: {split}_y is {y.dtype} {y.shape}, "
                                f"expected int64 ({x.shape[0]},)")
            if x.shape[0] == 0:
                raise DataError(f"{self.name}: the {split} split is empty")
            low, high = int(y.min()), int(y.max())
            if low < 0 or high >= self.num_classes:
                raise DataError(f"{self.name}: {split}_y holds labels {low}..{high}, "
                                f"outside 0..{self.num_classes - 1}")

    @property
    def train_size(self) -> int:
        return self.train_x.shape[0]

    @property
    def test_size(self) -> int:
        return self.test_x.shape[0]

    def describe(self) -> str:
        """One line, e.g. ``digits: 1438 train / 359 test, 1x8x8, 10 classes``."""
        shape = "x".join(map(str, self.input_shape))
        return (f"{self.name}: {self.train_size} train / {self.test_size} test, "
                f"{shape}, {self.num_classes} classes")


def standardise_per_channel(train_x: np.ndarray, *others: np.ndarray) -> None:
    """In place: subtract the training set's per-channel mean, divide by its std, in all arrays.

    A constant channel (std 0) is only centred.
    """
    mean = train_x.mean(axis=(0, 2, 3), dtype=np.float64)
    std = train_x.std(axis=(0, 2, 3), dtype=np.float64)
    scale = 1.0 / np.where(std > 0, std, 1.0)
    for x in (train_x, *others):
        x -= mean.astype(np.float32)[:, None, None]
        x *= scale.astype(np.float32)[:, None, None]


def check_seed(seed) -> int:
    return options.check_int("seed", seed, 0, 2**63 - 1, error=DataError)


def check_count(name: str, value, minimum: int = 1) -> int:
    return options.check_int(name, value, minimum, error=DataError)


def check_no_data_dir(name: str, data_dir) -> None:
    if data_dir is not None:
        raise DataError(f"dataset {name!r} needs no data directory (got {str(data_dir)!r}); "
                        f"--data-dir is for cifar10")
