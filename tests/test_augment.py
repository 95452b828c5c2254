"""Random crops and flips of training batches (mpigrad/data/augment.py): against a per-image
reference, drawn from (seed, worker, iteration) alone, and refused where they do not fit.
Real runs: tests/test_optim_mpi.py (a stop and resume with them) and tests/test_bench_peers.py
(DDP given the same crops and flips)."""

from __future__ import annotations

import numpy as np
import pytest

from mpigrad.config import RunConfig, describe_recipe
from mpigrad.data import DataError, load_dataset
from mpigrad.data.augment import CropFlip, build_augmentation, check_augmentation
from mpigrad.errors import UsageError
from mpigrad.runtime.plan.checks import check_options


def batch(n: int = 9, shape=(3, 6, 7), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)


def reference(x: np.ndarray, padding: int, rows, cols, flips) -> np.ndarray:
    """One image at a time, as torchvision's RandomCrop(padding) then RandomHorizontalFlip."""
    out = np.empty_like(x)
    _, _, height, width = x.shape
    for i, image in enumerate(x):
        padded = np.zeros((image.shape[0], height + 2 * padding, width + 2 * padding), np.float32)
        padded[:, padding:padding + height, padding:padding + width] = image
        crop = padded[:, rows[i]:rows[i] + height, cols[i]:cols[i] + width]
        out[i] = crop[:, :, ::-1] if flips[i] else crop
    return out


@pytest.mark.parametrize("padding, flip", [(1, True), (2, True), (4, False)])
def test_a_batch_is_cropped_and_flipped_as_one_image_at_a_time(padding, flip):
    x = batch()
    augmentation = CropFlip(padding=padding, flip=flip)
    (rows, cols), flips = augmentation.draws(len(x), 7, 1, 33)
    out = augmentation(x, 7, 1, 33)
    assert out.dtype == np.float32 and out.shape == x.shape and out.flags.c_contiguous
    np.testing.assert_array_equal(out, reference(x, padding, rows, cols, flips))
    assert flips.any() == flip


def test_the_draws_are_a_function_of_seed_worker_and_iteration():
    augmentation = CropFlip(padding=4)
    x = batch(64, (3, 32, 32))
    same = augmentation(x, 5, 0, 10)
    np.testing.assert_array_equal(same, augmentation(x, 5, 0, 10))  # a replay or a resume draws alike
    for other in [(6, 0, 10), (5, 1, 10), (5, 0, 11)]:
        assert not np.array_equal(same, augmentation(x, *other)), other
    (rows, cols), flips = augmentation.draws(4000, 5, 0, 10)
    assert rows.min() == cols.min() == 0 and rows.max() == cols.max() == 8  # offsets 0..2p
    assert 0.45 < flips.mean() < 0.55


def test_the_centre_crop_unflipped_is_the_image():
    x = batch()
    augmentation = CropFlip(padding=2, flip=False)
    for iteration in range(50):
        (rows, cols), _ = augmentation.draws(len(x), 0, 0, iteration)
        out = augmentation(x, 0, 0, iteration)
        centre = (rows == 2) & (cols == 2)
        np.testing.assert_array_equal(out[centre], x[centre])


@pytest.mark.parametrize("name, options, words", [
    ("crop", {}, "unknown augmentation 'crop'; choose from none, crop-flip"),
    ("crop-flip", {"pad": 4}, "augmentation 'crop-flip': unknown option(s) pad; valid: padding, flip"),
    ("crop-flip", {"padding": 0}, "augment padding must be"),
    ("crop-flip", {"flip": "yes"}, "augment flip must be true or false"),
    ("none", {"padding": 2}, "--augment-opt without --augment"),
])
def test_a_bad_augmentation_is_one_line(name, options, words):
    with pytest.raises(DataError, match=None) as caught:
        check_augmentation(name, options)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    config = RunConfig.from_sources(None, {"augment": name, "augment_opts": options})
    with pytest.raises(UsageError) as refused:  # before MPI: mpigrad train's option check
        check_options(config)
    assert words in str(refused.value)


def test_only_data_sets_that_allow_it_are_augmented():
    with pytest.raises(DataError, match="dataset 'digits' does not take --augment crop-flip"):
        build_augmentation("crop-flip", {}, load_dataset("digits"))
    small = load_dataset("synthetic", shape=[1, 4, 4], train_size=8, test_size=8, augmentable=True)
    with pytest.raises(DataError, match="augment padding 4 is not smaller than the 4x4 images"):
        build_augmentation("crop-flip", {}, small)
    assert build_augmentation("crop-flip", {"padding": 3}, small).padding == 3
    assert build_augmentation("none", {}, load_dataset("digits")) is None
    with pytest.raises(DataError, match="augmentable must be true or false"):
        load_dataset("synthetic", augmentable="yes")


def test_the_recipe_names_the_augmentation():
    assert describe_recipe({}) == "sgd"
    assert describe_recipe({"augment": "crop-flip"}) == "sgd crop-flip"
    assert describe_recipe({"augment": "crop-flip", "augment_opts": {"padding": 2}}) == "sgd crop-flip(padding=2)"


def test_the_launch_check_refuses_a_data_set_that_does_not_allow_it(tmp_path):
    """What every rank of ``mpigrad train --augment crop-flip`` on the digits hears before work
    (rank 0's launch check, exit 2): one line."""
    from mpigrad.runtime.run.preflight import _launch_problem

    config = RunConfig.from_sources(None, {"augment": "crop-flip", "trace": str(tmp_path / "run.h5")})
    problem, _ = _launch_problem(config, 3)
    assert problem.startswith("dataset 'digits' does not take --augment crop-flip") and "\n" not in problem
    allowed = RunConfig.from_sources(None, {"augment": "crop-flip", "trace": str(tmp_path / "run.h5"), "data": "synthetic",
                                            "data_opts": {"shape": [3, 12, 12], "augmentable": True}})
    assert _launch_problem(allowed, 3)[0] is None and not (tmp_path / "run.h5").exists()


def test_one_bool_check_for_every_option():
    """options.check_bool: True, False and NumPy's bools pass; 1, "true" and None are named."""
    from mpigrad.options import check_bool

    assert check_bool("flip", True) is True and check_bool("flip", np.bool_(False)) is False
    for bad in (1, "true", None):
        with pytest.raises(DataError, match=rf"^augment flip must be true or false, got {bad!r}$"):
            CropFlip(flip=bad)
