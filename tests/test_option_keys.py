"""One rule for option dictionaries: codec, policy, model and data options (built-in or a
plugin's) refuse an unknown key in one line that lists the valid ones, through
mpigrad.options.check_keys."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mpigrad import options
from mpigrad.codecs import CodecError, get_codec
from mpigrad.data import DataError, load_dataset
from mpigrad.models import ModelError, build_model
from mpigrad.policies import PolicyError, get_policy


@pytest.mark.parametrize("build, error, message", [
    (lambda: get_codec({"id": "qsgd", "bucket": 512}), CodecError,
     "codec 'qsgd': unknown option(s) bucket; valid: bits, levels, bucket_size, norm, coding, seed, checksum"),
    (lambda: get_codec({"id": "fp32", "bits": 4}), CodecError, "codec 'fp32': unknown option(s) bits; valid: checksum"),
    (lambda: get_policy({"id": "fixed", "bitz": 4}), PolicyError, "policy 'fixed': unknown option(s) bitz; valid: bits"),
    (lambda: build_model("paper-cnn", input_shape=(1, 8, 8), num_classes=10, dropout=0.5), ModelError,
     "model 'paper-cnn': unknown option(s) dropout; valid: fc_sizes, conv_channels"),
    (lambda: load_dataset("digits", shape=[1, 8, 8]), DataError,
     "dataset 'digits': unknown option(s) shape; valid: test_fraction"),
    (lambda: load_dataset("cifar10", size=3), DataError, "dataset 'cifar10': unknown option(s) size; it takes no options"),
])
def test_an_unknown_key_is_one_line_listing_the_valid_ones(build, error, message):
    with pytest.raises(error) as info:
        build()
    assert str(info.value) == message


def test_check_keys_and_keyword_names():
    def factory(*, input_shape, seed, width=16, norm="batch"):
        pass

    assert options.keyword_names(factory, exclude=("input_shape", "seed")) == ["width", "norm"]
    assert options.keyword_names(lambda **kwargs: None) is None  # anything goes: the call decides
    options.check_keys("x", ["width"], ["width", "norm"])
    options.check_keys("x", ["anything"], None)
    with pytest.raises(KeyError, match="x: unknown option\\(s\\) wdth, nrm; valid: width, norm"):
        options.check_keys("x", ["wdth", "width", "nrm"], ["width", "norm"], error=KeyError)


def test_train_refuses_an_unknown_codec_option_before_mpi_starts():
    result = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--codec", "qsgd", "--codec-opt", "bucket=512"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == ("mpigrad train: error: codec 'qsgd': unknown option(s) bucket; valid: bits, levels, "
                             "bucket_size, norm, coding, seed, checksum\n")
