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


# ---- options a run would not use: refused by one check (runtime.checks.check_given_options) ----
def given_bits(**options):
    from mpigrad.config import RunConfig

    return RunConfig.from_sources(None, {"bits": 4, **options})


@pytest.mark.parametrize("options, words", [
    (dict(policy="aimd"), "--bits does not apply to --policy aimd: it chooses its widths itself, from its own "
                          "options (--policy-opt min_bits, max_bits)"),
    (dict(policy="progress"), "--policy progress: it chooses its widths itself"),
    (dict(policy="mpigrad.policies.progress:ProgressPolicy"), "--policy mpigrad.policies.progress:ProgressPolicy"),
    (dict(policy="accordion"), "(--policy-opt low_bits, high_bits)"),
    (dict(policy="lgreco"), "--policy lgreco: it chooses its widths itself"),
    (dict(policy="schedule", policy_opts={"schedule": "0:2,5:4"}), "(--policy-opt schedule, min_bits, max_bits)"),
    (dict(policy="fixed", codec="fp32"), "--bits does not apply to --codec fp32: it has no bits option (it sends "
                                         "32-bit values)"),
    (dict(policy="fixed", codec="fp16"), "--codec fp16: it has no bits option (it sends 16-bit values)"),
    (dict(policy="fixed", codec="mcgq"), "--codec mcgq: it has no bits option"),
    (dict(policy="fixed", codec="qsgd", codec_opts={"levels": 3}), "--codec qsgd: its levels fix the quantization"),
    (dict(policy="fixed", codec="powersgd"), "--bits does not apply to --codec powersgd: its widths are"),
])
def test_bits_a_run_would_not_use_are_refused_in_one_line(options, words):
    from mpigrad.errors import UsageError
    from mpigrad.runtime.plan.checks import check_options

    with pytest.raises(UsageError) as info:
        check_options(given_bits(**options))
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("options", [
    dict(policy="fixed"), dict(policy="mqgrad"), dict(policy="adaptive"),  # its width, or start width
    dict(policy="fixed", codec="sign", broadcast_codec="uniform"),  # the broadcast follows the policy's bits
])
def test_bits_a_run_uses_are_taken(options):
    from mpigrad.runtime.plan.checks import check_options

    check_options(given_bits(**options))


def test_only_bits_the_user_set_are_refused_and_a_config_file_counts(tmp_path):
    """The default width is no one's choice; ``bits = N`` in a config file is the user's."""
    from mpigrad.config import RunConfig
    from mpigrad.errors import UsageError
    from mpigrad.runtime.plan.checks import check_options

    check_options(RunConfig.from_sources(None, {"policy": "aimd"}))
    path = tmp_path / "aimd.toml"
    path.write_text('policy = "aimd"\nbits = 8\n')
    with pytest.raises(UsageError, match="--bits does not apply to --policy aimd"):
        check_options(RunConfig.from_sources(str(path), {}))


@pytest.mark.parametrize("args", [["--policy", "aimd", "--bits", "4"], ["--policy", "progress", "--bits", "3"]])
def test_train_refuses_bits_a_policy_does_not_take_before_mpi_starts(args):
    done = subprocess.run([sys.executable, "-m", "mpigrad", "train", *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--bits does not apply to --policy {args[1]}" in lines[0], done.stderr


def test_a_config_files_bits_go_with_its_method_when_the_command_line_replaces_it():
    """examples/hard/fix2.toml sets bits = 2 for its fixed policy: run with --policy progress
    (docs/policies.rst's loops, examples/compare/lowrank.py's --codec powersgd), its width goes
    with the method it was written for; --bits on the command line is still refused."""
    from mpigrad.config import RunConfig
    from mpigrad.errors import UsageError
    from mpigrad.runtime.plan.checks import check_options

    from mpigrad.runtime.plan.checks import base_codec, replaced_bits_note

    replaced = RunConfig.from_sources("examples/hard/fix2.toml", {"policy": "progress"})
    check_options(replaced)
    with pytest.raises(UsageError, match="--bits does not apply to --policy progress"):
        check_options(RunConfig.from_sources("examples/hard/fix2.toml", {"policy": "progress", "bits": 3}))
    # not without a word: rank 0's start-up lines say which width went, and why
    assert replaced_bits_note(replaced, base_codec(replaced)) == (
        "mpigrad: note: examples/hard/fix2.toml's bits = 2 went with its method, which the command line "
        "replaced; they do not apply to --policy progress: it chooses its widths itself, from its own options "
        "(--policy-opt min_bits, max_bits)")
    lowrank = RunConfig.from_sources("examples/hard/fix2.toml", {"codec": "powersgd"})
    assert replaced_bits_note(lowrank, base_codec(lowrank)).endswith(
        "do not apply to --codec powersgd: its widths are --codec-opt factor_bits=B and rest_bits=B (its rank "
        "--codec-opt rank=R)")
    kept = RunConfig.from_sources("examples/hard/fix2.toml", {"codec": "qsgd"})       # qsgd takes the file's 2
    assert replaced_bits_note(kept, base_codec(kept)) is None
    assert replaced_bits_note(RunConfig.from_sources("examples/hard/fix2.toml", {}), base_codec(kept)) is None
