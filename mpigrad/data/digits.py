"""The default dataset: handwritten digits embedded in the package (no download).

1797 real 8 x 8 grey images of the digits 0-9, pixel values 0..16: the test part of UCI's
"Optical Recognition of Handwritten Digits" (Alpaydin & Kaynak, 1998, CC BY 4.0), the same
values and order as scikit-learn's ``load_digits`` (``digits.npz``: uint8 ``images``
(1797, 8, 8) and ``labels``; ``DIGITS_SHA256`` pins them). Reading 45 kB here instead of
importing scikit-learn saves every rank seconds of start-up. Scaled to [0, 1], split into
train and test stratified by class with a seeded shuffle, then standardised with the
training set's mean and std.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from .datasets import DataError, Dataset, check_no_data_dir, check_seed, standardise_per_channel

__all__ = ["load_digits", "stratified_split", "digits_arrays", "DIGITS_SHA256"]

_FILE = Path(__file__).with_name("digits.npz")
#: sha256 of the embedded images' bytes followed by the labels' bytes.
DIGITS_SHA256 = "87ff0c9e40dc7e2c0e34e7257799c2e3f3aec1a016363bb11cad869ec428a826"


_LOCK = threading.Lock()
_ARRAYS: tuple[np.ndarray, np.ndarray] | None = None


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The embedded (images uint8 (1797, 8, 8), labels uint8 (1797,)), as stored: read once
    per process (every rank of an in-process run, every run of a shared world) and handed
    out read-only. The lock: NumPy reads an .npz header with ``ast.literal_eval``, and
    CPython 3.11's parser keeps its recursion depth per interpreter, not per thread, so two
    ranks of one process reading at once failed with "AST constructor recursion depth
    mismatch" (stop 69's CI; CPython gh-106905)."""
    global _ARRAYS
    with _LOCK:
        if _ARRAYS is None:
            with np.load(_FILE) as stored:
                images, labels = stored["images"], stored["labels"]
            images.setflags(write=False)
            labels.setflags(write=False)
            _ARRAYS = images, labels
        return _ARRAYS


def load_digits(*, data_dir=None, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """Digits as 1 x 8 x 8 images; ``test_fraction`` of each class goes to the test split."""
    check_no_data_dir("digits", data_dir)
    seed = check_seed(seed)
    stored_images, stored_labels = digits_arrays()
    images = (stored_images.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    labels = stored_labels.astype(np.int64)
    train, test = stratified_split(labels, test_fraction, seed)
    train_x, test_x = images[train], images[test]
    standardise_per_channel(train_x, test_x)
    return Dataset("digits", train_x, labels[train], test_x, labels[test],
                   num_classes=10, input_shape=(1, 8, 8))


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) sorted int64 indices; each class sends ``round(n_c * test_fraction)`` to test.

    Every class keeps at least one example on each side. Raise DataError if it cannot.
    """
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) \
            or not 0 < test_fraction < 1:
        raise DataError(f"test_fraction must be a number in (0, 1), got {test_fraction!r}")
    rng = np.random.default_rng([seed, 0x5D1])
    test_parts = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        if members.size < 2:
            raise DataError(f"class {label} has {members.size} example(s); cannot split it")
        n_test = min(max(round(members.size * test_fraction), 1), members.size - 1)
        test_parts.append(rng.permutation(members)[:n_test])
    test = np.sort(np.concatenate(test_parts)).astype(np.int64)
    train = np.setdiff1d(np.arange(labels.size, dtype=np.int64), test, assume_unique=True)
    return train, test
