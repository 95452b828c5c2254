"""The default dataset: scikit-learn's bundled handwritten digits (no download).

1797 real 8 x 8 grey images of the digits 0-9 (UCI optdigits test set), pixel values
0..16. Scaled to [0, 1], split into train and test stratified by class with a seeded
shuffle, then standardised with the training set's mean and std.
"""

from __future__ import annotations

import numpy as np

from .datasets import DataError, Dataset, check_no_data_dir, check_seed, standardise_per_channel

__all__ = ["load_digits", "stratified_split"]


def load_digits(*, data_dir=None, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """Digits as 1 x 8 x 8 images; ``test_fraction`` of each class goes to the test split."""
    check_no_data_dir("digits", data_dir)
    seed = check_seed(seed)
    from sklearn.datasets import load_digits as sklearn_digits  # heavy import, only when used

    bunch = sklearn_digits()
    images = (bunch.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    labels = bunch.target.astype(np.int64)
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
