"""Datasets (digits, CIFAR-10 python batches, synthetic; teacher in test_teacher.py) and per-worker sharding."""

import pickle
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpigrad.data import DataError, Dataset, ShardSampler, available_datasets, load_dataset
from mpigrad.data.cifar10 import SUBDIR, TEST_FILE, TRAIN_FILES
from mpigrad.data.digits import stratified_split


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


def assert_well_formed(ds: Dataset):
    for x, y in ((ds.train_x, ds.train_y), (ds.test_x, ds.test_y)):
        assert x.dtype == np.float32 and x.ndim == 4 and x.shape[1:] == ds.input_shape
        assert y.dtype == np.int64 and y.shape == (x.shape[0],)
        assert y.min() >= 0 and y.max() < ds.num_classes
        assert np.isfinite(x).all()


# ---- registry ----------------------------------------------------------------------------

def test_registry_lists_the_four_datasets():
    assert available_datasets() == ["cifar10", "digits", "synthetic", "teacher"]


def test_unknown_dataset_names_the_available_ones():
    with pytest.raises(DataError, match="unknown dataset 'mnist'; available: cifar10, digits, synthetic, teacher"):
        load_dataset("mnist")
    assert issubclass(DataError, ValueError)


@pytest.mark.parametrize("name, options, message", [
    ("digits", dict(shape=(1, 8, 8)), r"dataset 'digits': unknown option\(s\) shape; valid: test_fraction$"),
    ("synthetic", dict(test_fraction=0.2), r"unknown option\(s\) test_fraction; valid: shape, classes, "),
    ("digits", dict(data_dir="/tmp"), "needs no data directory"),
    ("synthetic", dict(data_dir="/tmp"), "needs no data directory"),
    ("digits", dict(seed=-1), "seed"),
    ("digits", dict(seed=1.5), "seed"),
])
def test_bad_options_are_rejected(name, options, message):
    with pytest.raises(DataError, match=message):
        load_dataset(name, **options)


# ---- digits ------------------------------------------------------------------------------

def test_digits_shapes_split_and_standardisation(digits):
    assert_well_formed(digits)
    assert digits.name == "digits" and digits.input_shape == (1, 8, 8) and digits.num_classes == 10
    assert digits.train_size + digits.test_size == 1797
    assert abs(digits.test_size - 0.2 * 1797) <= 10
    assert abs(float(digits.train_x.mean())) < 1e-5
    assert abs(float(digits.train_x.std()) - 1.0) < 1e-4
    assert digits.describe() == "digits: 1438 train / 359 test, 1x8x8, 10 classes"


def test_embedded_digits_are_the_uci_optdigits_test_set():
    """The embedded file holds what scikit-learn's load_digits returns (checked when it was
    embedded; the hash pins it): 1797 images, pixel values 0..16, UCI's class counts."""
    import hashlib

    from mpigrad.data.digits import DIGITS_SHA256, digits_arrays
    images, labels = digits_arrays()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8 and images.max() == 16
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest() == DIGITS_SHA256


def test_digits_split_is_seeded(digits):
    again = load_dataset("digits", seed=0)
    other = load_dataset("digits", seed=1)
    np.testing.assert_array_equal(again.test_x, digits.test_x)
    np.testing.assert_array_equal(again.test_y, digits.test_y)
    assert not np.array_equal(other.test_x, digits.test_x)


def test_digits_test_fraction_option():
    small = load_dataset("digits", test_fraction=0.1)
    assert abs(small.test_size - 180) <= 10


def test_stratified_split_is_disjoint_covering_and_per_class():
    labels = np.repeat(np.arange(4), [10, 20, 3, 7])
    np.random.default_rng(0).shuffle(labels)
    train, test = stratified_split(labels, 0.3, seed=5)
    assert train.dtype == test.dtype == np.int64
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.arange(labels.size))
    for label, count in enumerate([10, 20, 3, 7]):
        assert (labels[test] == label).sum() == max(round(count * 0.3), 1)
    again, _ = stratified_split(labels, 0.3, seed=5)
    np.testing.assert_array_equal(again, train)


@pytest.mark.parametrize("fraction", [0, 1, 1.5, -0.2, "0.2", True])
def test_stratified_split_rejects_bad_fractions(fraction):
    with pytest.raises(DataError, match="test_fraction"):
        stratified_split(np.arange(20) % 2, fraction, seed=0)


def test_stratified_split_rejects_a_class_with_one_example():
    with pytest.raises(DataError, match="class 2 has 1 example"):
        stratified_split(np.array([0, 0, 1, 1, 2]), 0.5, seed=0)


# ---- CIFAR-10 ----------------------------------------------------------------------------

def _py2_str(b):
    return (b"U" + bytes([len(b)]) + b) if len(b) < 256 else (b"T" + struct.pack("<I", len(b)) + b)


def _py2_int(v):
    return b"K" + bytes([v]) if 0 <= v < 256 else b"J" + struct.pack("<i", v)


def py2_batch(data, labels):
    """Pickle opcodes as Python 2's cPickle wrote the real batches (str payloads, numpy.core)."""
    n, width = data.shape
    dtype = (b"cnumpy\ndtype\n" + _py2_str(b"u1") + _py2_int(0) + _py2_int(1) + b"\x87R(" + _py2_int(3)
             + _py2_str(b"|") + b"NNN" + _py2_int(-1) + _py2_int(-1) + _py2_int(0) + b"tb")
    array = (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + _py2_int(0) + b"\x85"
             + _py2_str(b"b") + b"\x87R(" + _py2_int(1) + _py2_int(n) + _py2_int(width) + b"\x86"
             + dtype + b"\x89" + _py2_str(data.tobytes()) + b"tb")
    label_list = b"](" + b"".join(_py2_int(int(v)) for v in labels) + b"e"
    return (b"\x80\x02}(" + _py2_str(b"batch_label") + _py2_str(b"fake batch")
            + _py2_str(b"data") + array + _py2_str(b"labels") + label_list + b"u.")


def write_batch(path, data, labels, protocol=2, keys=(b"data", b"labels")):
    batch = {b"batch_label": b"fake", keys[0]: data, keys[1]: labels,
             b"filenames": [b"x.png"] * len(labels)}
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=protocol)


def fake_cifar(directory, per_batch=12, test=8, seed=0):
    """Write six small batch files in the real files' format.

    Return (raw train, train labels, raw test, test labels) as uint8 (N, 3, 32, 32) and ints.
    """
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    raws, labels = [], []
    for name in TRAIN_FILES + (TEST_FILE,):
        n = test if name == TEST_FILE else per_batch
        # Channels get different brightness so a wrong reshape or channel stats show up.
        data = np.concatenate([rng.integers(lo, lo + 60, (n, 1024)) for lo in (10, 100, 190)], axis=1)
        data = data.astype(np.uint8)
        y = rng.integers(0, 10, n)
        (directory / name).write_bytes(py2_batch(data, y))
        raws.append(data)
        labels.append(y)
    train_raw = np.concatenate(raws[:5]).reshape(-1, 3, 32, 32)
    return train_raw, np.concatenate(labels[:5]), raws[5].reshape(-1, 3, 32, 32), labels[5]


def test_cifar10_loads_channel_major_images_standardised_by_training_channels(tmp_path):
    train_raw, train_y, test_raw, test_y = fake_cifar(tmp_path)
    ds = load_dataset("cifar10", data_dir=str(tmp_path))
    assert_well_formed(ds)
    assert ds.name == "cifar10" and ds.input_shape == (3, 32, 32) and ds.num_classes == 10
    assert ds.train_size == 60 and ds.test_size == 8
    np.testing.assert_array_equal(ds.train_y, train_y)
    np.testing.assert_array_equal(ds.test_y, test_y)
    mean = train_raw.mean(axis=(0, 2, 3), keepdims=True)
    std = train_raw.std(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(ds.train_x, (train_raw - mean) / std, atol=1e-5)
    np.testing.assert_allclose(ds.test_x, (test_raw - mean) / std, atol=1e-5)


def test_cifar10_finds_the_tarballs_subdirectory(tmp_path):
    fake_cifar(tmp_path / SUBDIR)
    assert load_dataset("cifar10", data_dir=tmp_path).train_size == 60


def test_cifar10_accepts_python3_pickles_with_str_keys(tmp_path):
    fake_cifar(tmp_path)
    data = np.full((4, 3072), 7, np.uint8)
    write_batch(tmp_path / TEST_FILE, data, np.array([1, 2, 3, 9]), protocol=5, keys=("data", "labels"))
    ds = load_dataset("cifar10", data_dir=tmp_path)
    np.testing.assert_array_equal(ds.test_y, [1, 2, 3, 9])


def test_cifar10_without_a_directory_says_what_it_needs():
    with pytest.raises(DataError, match="--data-dir.*data_batch_1.*test_batch"):
        load_dataset("cifar10")


def test_cifar10_missing_directory_is_named(tmp_path):
    with pytest.raises(DataError, match="nowhere.*does not exist"):
        load_dataset("cifar10", data_dir=tmp_path / "nowhere")


@pytest.mark.parametrize("missing", ["data_batch_3", "test_batch"])
def test_cifar10_missing_file_is_named(tmp_path, missing):
    fake_cifar(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(DataError, match=f"{missing}' is missing"):
        load_dataset("cifar10", data_dir=tmp_path)


def corrupt_not_pickle(path):
    path.write_bytes(b"this is not a pickle at all")


def corrupt_truncated(path):
    path.write_bytes(path.read_bytes()[:500])


def corrupt_list(path):
    path.write_bytes(pickle.dumps([1, 2, 3]))


def corrupt_missing_labels(path):
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8)}))


def corrupt_float_data(path):
    write_batch(path, np.zeros((2, 3072), np.float32), [0, 1])


def corrupt_wrong_width(path):
    write_batch(path, np.zeros((2, 3000), np.uint8), [0, 1])


def corrupt_label_count(path):
    write_batch(path, np.zeros((3, 3072), np.uint8), [0, 1])


def corrupt_label_ten(path):
    write_batch(path, np.zeros((3, 3072), np.uint8), [0, 10, 1])


def corrupt_label_negative(path):
    write_batch(path, np.zeros((3, 3072), np.uint8), [0, 1, -1])


def corrupt_string_labels(path):
    write_batch(path, np.zeros((2, 3072), np.uint8), ["cat", "dog"])


@pytest.mark.parametrize("corrupt, message", [
    (corrupt_not_pickle, "not a CIFAR-10 python batch"),
    (corrupt_truncated, "not a CIFAR-10 python batch"),
    (corrupt_list, "holds a list, not a dict"),
    (corrupt_missing_labels, "no b'labels' entry"),
    (corrupt_float_data, "b'data' must be a uint8 N x 3072 array, got float32"),
    (corrupt_wrong_width, r"got uint8 array of shape \(2, 3000\)"),
    (corrupt_label_count, "b'labels' must be 3 integers"),
    (corrupt_label_ten, "label 10 at index 1 is outside 0..9"),
    (corrupt_label_negative, "label -1 at index 2 is outside 0..9"),
    (corrupt_string_labels, "b'labels' must be 2 integers"),
])
def test_cifar10_malformed_file_is_named_with_the_cause(tmp_path, corrupt, message):
    fake_cifar(tmp_path)
    corrupt(tmp_path / "data_batch_4")
    with pytest.raises(DataError, match=message) as info:
        load_dataset("cifar10", data_dir=tmp_path)
    assert "data_batch_4" in str(info.value)
    assert "\n" not in str(info.value)


class _Exploit:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_cifar10_refuses_pickles_that_would_run_code(tmp_path):
    fake_cifar(tmp_path)
    sentinel = tmp_path / "pwned"
    (tmp_path / TEST_FILE).write_bytes(pickle.dumps({b"data": _Exploit(sentinel), b"labels": [0]}))
    with pytest.raises(DataError, match="refusing to load global"):
        load_dataset("cifar10", data_dir=tmp_path)
    assert not sentinel.exists()


# ---- synthetic ---------------------------------------------------------------------------

def test_synthetic_defaults_are_cifar_shaped_and_standardised():
    ds = load_dataset("synthetic", seed=3)
    assert_well_formed(ds)
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10
    assert (ds.train_size, ds.test_size) == (4096, 1024)
    assert abs(float(ds.train_x.mean())) < 0.02
    assert abs(float(ds.train_x.std()) - 1.0) < 0.02
    assert np.bincount(ds.train_y).tolist() == [410] * 6 + [409] * 4  # balanced classes


def test_synthetic_is_seeded():
    kwargs = dict(shape=(2, 6, 5), train_size=50, test_size=10)
    a = load_dataset("synthetic", seed=1, **kwargs)
    b = load_dataset("synthetic", seed=1, **kwargs)
    c = load_dataset("synthetic", seed=2, **kwargs)
    np.testing.assert_array_equal(a.train_x, b.train_x)
    np.testing.assert_array_equal(a.test_y, b.test_y)
    assert not np.array_equal(a.train_x, c.train_x)


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 7, 10), "2x9x9"])
def test_synthetic_is_learnable_by_nearest_class_mean(shape):
    ds = load_dataset("synthetic", shape=shape, classes=5, train_size=500, test_size=200)
    assert ds.train_x.shape[0] == 500 and ds.test_x.shape[0] == 200
    flat_train = ds.train_x.reshape(500, -1)
    centroids = np.stack([flat_train[ds.train_y == k].mean(axis=0) for k in range(5)])
    flat_test = ds.test_x.reshape(200, -1)
    distances = ((flat_test[:, None, :] - centroids[None]) ** 2).sum(axis=2)
    accuracy = (distances.argmin(axis=1) == ds.test_y).mean()
    assert accuracy > 0.5  # chance is 0.2


@pytest.mark.parametrize("options, message", [
    (dict(shape=(3, 32)), "shape"),
    (dict(shape=(3, 0, 32)), "shape"),
    (dict(shape="3 by 32"), "shape must look like"),
    (dict(classes=1), "classes"),
    (dict(train_size=0), "train_size"),
    (dict(test_size=2.5), "test_size"),
    (dict(signal=0), "signal"),
    (dict(signal=float("nan")), "signal"),
])
def test_synthetic_rejects_bad_options(options, message):
    with pytest.raises(DataError, match=message):
        load_dataset("synthetic", **options)


# ---- sharding ----------------------------------------------------------------------------

def all_shards(num_examples, num_workers, batch_size, seed=0):
    return [ShardSampler(num_examples, w, num_workers, batch_size, seed) for w in range(num_workers)]


@settings(max_examples=60, deadline=None)
@given(num_examples=st.integers(1, 400), seed=st.integers(0, 2**63 - 1), data=st.data())
def test_shards_are_disjoint_cover_the_data_and_batches_stay_inside(num_examples, seed, data):
    num_workers = data.draw(st.integers(1, min(9, num_examples)))
    batch_size = data.draw(st.integers(1, num_examples // num_workers))
    samplers = all_shards(num_examples, num_workers, batch_size, seed)
    shards = [s.shard for s in samplers]
    joined = np.concatenate(shards)
    np.testing.assert_array_equal(np.sort(joined), np.arange(num_examples))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    for sampler in samplers:
        allowed = set(sampler.shard.tolist())
        for _ in range(2 * sampler.batches_per_epoch + 1):
            batch = sampler.next_batch()
            assert batch.dtype == np.int64 and batch.shape == (batch_size,)
            assert set(batch.tolist()) <= allowed


def test_an_epoch_visits_distinct_examples_and_the_next_epoch_reshuffles():
    sampler = ShardSampler(1000, worker_index=2, num_workers=4, batch_size=32, seed=9)
    assert sampler.shard.size == 250 and sampler.batches_per_epoch == 7
    first = np.concatenate([sampler.next_batch() for _ in range(7)])
    assert len(set(first.tolist())) == 7 * 32
    assert sampler.epoch == 0
    second = np.concatenate([sampler.next_batch() for _ in range(7)])
    assert sampler.epoch == 1
    assert len(set(second.tolist())) == 7 * 32
    assert not np.array_equal(first, second)
    assert set(first.tolist()) != set(second.tolist())  # a different remainder is skipped


def test_same_seed_same_order_other_seed_other_shards():
    a, b = ShardSampler(300, 1, 3, 10, seed=4), ShardSampler(300, 1, 3, 10, seed=4)
    c = ShardSampler(300, 1, 3, 10, seed=5)
    for _ in range(25):
        np.testing.assert_array_equal(a.next_batch(), b.next_batch())
    assert not np.array_equal(a.shard, c.shard)


def test_state_dict_resumes_the_same_order_across_epochs():
    original = ShardSampler(90, 0, 2, 8, seed=1)  # 45 examples, 5 batches per epoch
    for _ in range(4):
        original.next_batch()
    state = original.state_dict()
    assert (state["epoch"], state["position"]) == (0, 4)
    expected = [original.next_batch() for _ in range(12)]
    resumed = ShardSampler(90, 0, 2, 8, seed=1)
    resumed.load_state_dict(dict(state))
    for batch in expected:
        np.testing.assert_array_equal(resumed.next_batch(), batch)
    assert resumed.state_dict() == original.state_dict()
    assert resumed.epoch == 3


def test_state_dict_with_only_epoch_and_position_is_enough():
    original = ShardSampler(90, 1, 2, 8, seed=1)
    for _ in range(13):
        original.next_batch()
    resumed = ShardSampler(90, 1, 2, 8, seed=1)
    resumed.load_state_dict({"epoch": np.int64(original.epoch), "position": original.position})
    np.testing.assert_array_equal(resumed.next_batch(), original.next_batch())


@pytest.mark.parametrize("state, message", [
    ({"epoch": 0, "position": 1, "seed": 2}, "seed=2, this sampler seed=1"),
    ({"epoch": 0, "position": 1, "worker_index": 0}, "worker_index=0"),
    ({"epoch": 0}, "'epoch' and 'position'"),
    ([0, 1], "'epoch' and 'position'"),
    ({"epoch": -1, "position": 0}, "epoch"),
    ({"epoch": 0, "position": 6}, "position 6 exceeds the 5 batches"),
])
def test_load_state_dict_rejects_foreign_or_bad_state(state, message):
    sampler = ShardSampler(90, 1, 2, 8, seed=1)
    with pytest.raises(DataError, match=message):
        sampler.load_state_dict(state)


@pytest.mark.parametrize("args, message", [
    ((100, 0, 20, 10), "shard holds 5 examples .*fewer than the batch size 10"),
    ((100, 3, 3, 10), "worker_index 3 is out of range for 3 workers"),
    ((100, -1, 3, 10), "worker_index"),
    ((0, 0, 1, 1), "num_examples"),
    ((100, 0, 0, 1), "num_workers"),
    ((100, 0, 1, 0), "batch_size"),
    ((100, 0, 1, True), "batch_size"),
    ((100.0, 0, 1, 4), "num_examples"),
])
def test_sampler_rejects_bad_hyperparameters(args, message):
    with pytest.raises(DataError, match=message):
        ShardSampler(*args)


def test_returned_batches_are_copies_and_the_shard_is_read_only():
    sampler = ShardSampler(40, 0, 1, 8)
    batch = sampler.next_batch()
    batch[:] = -1
    assert (sampler.next_batch() >= 0).all()
    with pytest.raises(ValueError):
        sampler.shard[0] = 5
