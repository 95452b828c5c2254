"""Training-batch augmentation: He et al.'s random crop with padding and horizontal flip.

``CropFlip(padding=4, flip=True)`` pads each image of a batch with ``padding`` zeros on
every side and cuts an image of the original size at a random offset, then mirrors it left
to right with probability 1/2 (torchvision's ``RandomCrop(32, padding=4)`` and
``RandomHorizontalFlip()``, the CIFAR-10 recipe of He et al. 2016). The draws of a batch come
from ``(seed, worker_index, iteration)`` alone, so a replayed, requeued or resumed iteration
draws the same crops and flips, and a DDP peer given the same triple augments alike.

The data sets are normalised when loaded (mpigrad.data), so the padding zeros are the
per-channel mean, where torchvision pads the raw image with black before normalising.

Only data sets that say their images survive cropping and mirroring
(``Dataset.augmentable``: CIFAR-10, and plugins' or synthetic data that set it) take it: a
mirrored digit is another symbol.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..options import check_bool, check_keys
from .datasets import DataError, check_count

__all__ = ["AUGMENTATIONS", "CropFlip", "build_augmentation", "check_augmentation"]

_AUGMENT_STREAM = 0xA6E7

#: ``--augment`` choices.
AUGMENTATIONS = ("none", "crop-flip")


class CropFlip:
    """Random crop after zero padding, then a horizontal flip with probability 1/2, per image.
    Hyperparameters: ``padding`` (pixels on each side, >= 1) and ``flip``; no state."""

    def __init__(self, padding: int = 4, flip: bool = True):
        self.padding = check_count("augment padding", padding, minimum=1)
        self.flip = check_bool("augment flip", flip, error=DataError)

    def draws(self, batch: int, seed: int, worker_index: int, iteration: int) -> tuple[np.ndarray, np.ndarray]:
        """The batch's (row offsets, column offsets) in ``[0, 2 * padding]`` and flips, each
        of shape (batch,): a pure function of its arguments."""
        rng = np.random.default_rng([int(seed), _AUGMENT_STREAM, int(worker_index), int(iteration)])
        offsets = rng.integers(0, 2 * self.padding + 1, size=(2, batch))
        flips = rng.random(batch) < 0.5 if self.flip else np.zeros(batch, bool)
        return offsets, flips

    def __call__(self, x: np.ndarray, seed: int, worker_index: int, iteration: int) -> np.ndarray:
        """The augmented copy of batch ``x`` (N, C, H, W)."""
        n, _, height, width = x.shape
        p = self.padding
        (rows, cols), flips = self.draws(n, seed, worker_index, iteration)
        padded = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
        row_index = rows[:, None] + np.arange(height)                     # (N, H)
        col_index = cols[:, None] + np.arange(width)                      # (N, W)
        col_index = np.where(flips[:, None], col_index[:, ::-1], col_index)
        batch = np.arange(n)[:, None, None, None]
        channel = np.arange(x.shape[1])[None, :, None, None]
        return np.ascontiguousarray(padded[batch, channel, row_index[:, None, :, None], col_index[:, None, None, :]])


def check_augmentation(name: str, options: dict[str, Any]) -> CropFlip | None:
    """The augmentation ``name`` with ``options`` (None for "none"); DataError (one line)
    for an unknown name or option, or a bad value."""
    if name not in AUGMENTATIONS:
        raise DataError(f"unknown augmentation {name!r}; choose from {', '.join(AUGMENTATIONS)}")
    if name == "none":
        if options:
            raise DataError("--augment-opt without --augment: name the augmentation (crop-flip)")
        return None
    check_keys(f"augmentation {name!r}", options, ("padding", "flip"), error=DataError)
    return CropFlip(**options)


def build_augmentation(name: str, options: dict[str, Any], dataset) -> CropFlip | None:
    """``check_augmentation``, and DataError unless ``dataset`` takes it (``augmentable``,
    its images larger than the padding)."""
    augmentation = check_augmentation(name, options)
    if augmentation is None:
        return None
    if not dataset.augmentable:
        raise DataError(f"dataset {dataset.name!r} does not take --augment {name}: its images may not survive "
                        "cropping and mirroring (a mirrored digit is another symbol); CIFAR-10 does, and a "
                        "plugin's data set says so with Dataset.augmentable = True")
    _, height, width = dataset.input_shape
    if augmentation.padding >= min(height, width):
        raise DataError(f"augment padding {augmentation.padding} is not smaller than the {height}x{width} images")
    return augmentation
