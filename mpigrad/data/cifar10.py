"""CIFAR-10 from a local directory of the python batches (no download here).

``data_dir`` holds ``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` (or holds the
tarball's ``cifar-10-batches-py`` folder that does). Each file is a pickled dict, read with
``encoding="bytes"``: ``b"data"`` a uint8 N x 3072 array, channel-major (reshape to
N, 3, 32, 32), ``b"labels"`` N integers in 0..9. Only the numpy globals such a file needs
may be unpickled, so a foreign pickle cannot run code. Any missing or malformed file raises
DataError naming it. Pixels are standardised per channel with the training set's mean and
std (computed exactly from per-channel histograms); a constant channel is only centred.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np

from .datasets import DataError, Dataset, check_seed

__all__ = ["load_cifar10", "TRAIN_FILES", "TEST_FILE", "SUBDIR", "read_batch"]

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
SUBDIR = "cifar-10-batches-py"
NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
_PIXELS = 3 * 32 * 32

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
}


def load_cifar10(*, data_dir=None, seed: int = 0) -> Dataset:
    """The 50000 training and 10000 test images; ``seed`` is accepted for symmetry (order is fixed)."""
    check_seed(seed)
    directory = _batch_directory(data_dir)
    test_raw, test_y = read_batch(directory / TEST_FILE)
    batches = [read_batch(directory / name) for name in TRAIN_FILES]
    train_raw = np.concatenate([images for images, _ in batches])
    train_y = np.concatenate([labels for _, labels in batches])
    del batches  # free the per-file copies before the float32 arrays are allocated
    mean, std = _channel_moments(train_raw)
    return Dataset("cifar10", _standardise(train_raw, mean, std), train_y,
                   _standardise(test_raw, mean, std), test_y,
                   num_classes=NUM_CLASSES, input_shape=IMAGE_SHAPE, augmentable=True)


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 (N, 3, 32, 32) images, int64 (N,) labels) of one batch file; DataError if malformed."""
    path = Path(path)
    where = repr(str(path))
    if not path.is_file():
        raise DataError(f"CIFAR-10 batch file {where} is missing")
    try:
        with open(path, "rb") as f:
            batch = _BatchUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, IndexError, KeyError, MemoryError) as exc:
        raise DataError(f"{where} is not a CIFAR-10 python batch (cannot unpickle: {exc})") from None
    except OSError as exc:
        raise DataError(f"cannot read CIFAR-10 batch file {where}: {exc.strerror or exc}") from None
    if not isinstance(batch, dict):
        raise DataError(f"{where} is not a CIFAR-10 python batch "
                        f"(holds a {type(batch).__name__}, not a dict)")
    data, labels = _entry(batch, "data", where), _entry(batch, "labels", where)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != _PIXELS or data.shape[0] == 0:
        got = (f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray)
               else type(data).__name__)
        raise DataError(f"{where}: b'data' must be a uint8 N x {_PIXELS} array, got {got}")
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu" or labels.shape != (data.shape[0],):
        raise DataError(f"{where}: b'labels' must be {data.shape[0]} integers (one per image), "
                        f"got {labels.dtype} of shape {labels.shape}")
    bad = (labels < 0) | (labels >= NUM_CLASSES)
    if bad.any():
        raise DataError(f"{where}: label {labels[bad][0]} at index {np.flatnonzero(bad)[0]} "
                        f"is outside 0..{NUM_CLASSES - 1}")
    return data.reshape(-1, *IMAGE_SHAPE), labels.astype(np.int64)


class _BatchUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedReader):
        super().__init__(file, encoding="bytes")

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return super().find_class(module, name)


def _entry(batch: dict, key: str, where: str):
    for candidate in (key.encode(), key):
        if candidate in batch:
            return batch[candidate]
    found = ", ".join(repr(k) for k in list(batch)[:6]) or "none"
    raise DataError(f"{where}: no b'{key}' entry in the pickled dict (keys: {found})")


def _batch_directory(data_dir) -> Path:
    if data_dir is None:
        raise DataError("cifar10 needs a data directory (--data-dir) holding the python batches "
                        f"({', '.join(TRAIN_FILES)}, {TEST_FILE})")
    directory = Path(data_dir).expanduser()
    if not directory.is_dir():
        raise DataError(f"CIFAR-10 data directory {str(directory)!r} does not exist or is not a directory")
    if not (directory / TRAIN_FILES[0]).exists() and (directory / SUBDIR).is_dir():
        directory = directory / SUBDIR
    return directory


def _channel_moments(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-channel mean and std (float64) of uint8 ``images``, from 256-bin histograms."""
    values = np.arange(256, dtype=np.float64)
    mean, std = np.empty(images.shape[1]), np.empty(images.shape[1])
    for c in range(images.shape[1]):
        counts = np.bincount(images[:, c].ravel(), minlength=256).astype(np.float64)
        mean[c] = counts @ values / counts.sum()
        std[c] = np.sqrt(counts @ (values - mean[c]) ** 2 / counts.sum())
    return mean, np.where(std > 0, std, 1.0)


def _standardise(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """float32 ``(images - mean) / std`` per channel, without an image-sized temporary."""
    out = np.empty(images.shape, np.float32)
    for c in range(images.shape[1]):
        np.multiply(images[:, c], np.float32(1.0 / std[c]), out=out[:, c])
        out[:, c] -= np.float32(mean[c] / std[c])
    return out
