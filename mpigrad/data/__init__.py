"""Datasets the runtime trains on, in a registry keyed by name, and per-worker sharding::

    ds = load_dataset("digits")                        # bundled, no download
    ds = load_dataset("cifar10", data_dir="~/cifar")   # the python batches, local
    ds = load_dataset("synthetic", shape=(3, 32, 32), train_size=4096)
    ds = load_dataset("teacher", shape=(1, 12, 12), classes=4)   # labelled by a random CNN
    ds = load_dataset("mypkg.data:load", seed=0, size=1000)   # a user's factory
    sampler = ShardSampler(ds.train_size, worker_index, num_workers, batch_size, seed)
    x, y = ds.train_x[idx], ds.train_y[idx] where idx = sampler.next_batch()

Loaders share the signature ``loader(*, data_dir=None, seed=0, **options) -> Dataset`` and
raise ``DataError`` (a ValueError) with a one-line cause. A plugin factory named
``package.module:factory`` has the same signature and must return a ``Dataset`` (see
docs/models.rst). This package needs only NumPy (the digits are embedded: digits.npz).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from ..options import check_keys, keyword_names
from ..plugins import call_factory, is_plugin, load_factory
from ..registry import Registry
from .cifar10 import load_cifar10
from .datasets import DataError, Dataset
from .digits import load_digits
from .sharding import ShardSampler
from .synthetic import make_synthetic
from .teacher import make_teacher

__all__ = ["Dataset", "DataError", "ShardSampler", "available_datasets", "load_dataset"]

#: The built-in data sets by name; a plugin is a factory (``package.module:factory``).
DATASETS: Registry[Callable[..., Dataset]] = Registry("dataset", DataError)
for _name, _loader in (("digits", load_digits), ("cifar10", load_cifar10), ("synthetic", make_synthetic),
                       ("teacher", make_teacher)):
    DATASETS.register(_loader, _name)


#: What every loader and factory is given besides the user's data options.
_CONTRACT = ("data_dir", "seed")


def available_datasets() -> list[str]:
    """Sorted names accepted by ``load_dataset``."""
    return DATASETS.names()


def load_dataset(name: str, data_dir=None, seed: int = 0, **options: Any) -> Dataset:
    """Load dataset ``name``; DataError for an unknown name, bad options or bad files."""
    if is_plugin(name):
        factory = load_factory(name, DataError)
        check_keys(f"data factory {name}", options, keyword_names(factory, exclude=_CONTRACT), error=DataError)
        dataset = call_factory(name, factory, dict(data_dir=data_dir, seed=seed, **options), DataError)
        if not isinstance(dataset, Dataset):
            raise DataError(f"data factory {name} returned {type(dataset).__name__}, "
                            "expected an mpigrad.data.Dataset")
        return dataset
    loader = DATASETS.lookup(name)
    check_keys(f"dataset {name!r}", options, keyword_names(loader, exclude=_CONTRACT), error=DataError)
    try:
        inspect.signature(loader).bind(data_dir=data_dir, seed=seed, **options)
    except TypeError as exc:
        raise DataError(f"bad options for dataset {name!r}: {exc}") from None
    return loader(data_dir=data_dir, seed=seed, **options)
