"""RunConfig: units, TOML, precedence, validation messages; the network model's arithmetic."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mpigrad.cli import main
from mpigrad.config import RunConfig, parse_assignments
from mpigrad.units import format_duration, format_rate, parse_duration, parse_rate
from mpigrad.errors import UsageError
from mpigrad.clockmodel import Constant, Network
from mpigrad.runtime.measure.clock import LinkModel


@pytest.mark.parametrize("text, value", [
    ("10MB/s", 1e7), ("10MBps", 1e7), ("125MiB/s", 125 * 2**20), ("2.5e6B/s", 2.5e6), ("1kB/s", 1e3),
    # bits, as network people write them: a lower-case b or "bit"
    ("100Mbps", 1.25e7), ("100Mbit/s", 1.25e7), ("1Gbit/s", 1.25e8), ("10Gb/s", 1.25e9), ("8b/s", 1.0),
])
def test_rates(text, value):
    assert parse_rate(text) == value


@pytest.mark.parametrize("text, spellings", [
    ("10", "write e.g. 10MB/s (bytes per second) or 10Mbit/s (bits per second)"),
    (10, "write e.g. 10MB/s (bytes per second) or 10Mbit/s (bits per second)"),
    (1e7, "write e.g. 10MB/s (bytes per second) or 80Mbit/s (bits per second)"),  # a TOML number
])
def test_a_rate_without_unit_is_refused_showing_both_spellings(text, spellings):
    with pytest.raises(UsageError, match="has no unit") as info:
        parse_rate(text)
    assert spellings in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("text, spellings", [
    ("100mbps", "write 100Mbit/s or 100Mbps for bits, 100MB/s for bytes"),
    ("10GB/S", "write 10Gbit/s or 10Gbps for bits, 10GB/s for bytes"),
])
def test_a_unit_that_differs_only_in_case_is_ambiguous(text, spellings):
    with pytest.raises(UsageError, match="is ambiguous") as info:
        parse_rate(text)
    assert spellings in str(info.value)


@pytest.mark.parametrize("rate, text", [(1e7, "10MB/s (80Mbit/s)"), (1.25e8, "125MB/s (1Gbit/s)"),
                                        (1.25e7, "12.5MB/s (100Mbit/s)")])
def test_format_rate_gives_bytes_and_bits_that_read_back(rate, text):
    assert format_rate(rate) == text
    as_bytes, as_bits = text.split(" ")
    assert parse_rate(as_bytes) == parse_rate(as_bits.strip("()")) == rate


@pytest.mark.parametrize("text, value", [("50ms", 0.05), ("2h", 7200.0), ("30", 30.0), ("250us", 2.5e-4)])
def test_durations(text, value):
    assert math.isclose(parse_duration(text), value)


@pytest.mark.parametrize("bad", ["fast", "-5MB/s", "10 parsecs/s"])
def test_bad_rate_says_how_to_write_one(bad):
    with pytest.raises(UsageError, match="use e.g. 100Mbps, 100Mbit/s or 10Gb/s \\(bits\\), 10MB/s"):
        parse_rate(bad)


@pytest.mark.parametrize("bad", ["0MB/s", "0Mbps", "1e400GB/s"])
def test_a_rate_must_be_positive_and_finite(bad):
    """One rule for every rate: --bandwidth, the lab's --rate, --node-rate and events."""
    with pytest.raises(UsageError, match=f"bandwidth '{bad}' must be positive and finite"):
        parse_rate(bad)


def test_toml_then_command_line_precedence(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('iterations = 50\nbandwidth = "1Gbit/s"\ncodec = "qsgd"\nbits = 4\n'
                    '[codec_opts]\nbucket_size = 256\nnorm = "l2"\n[policy_opts]\nepsilon = 0.2\n')
    config = RunConfig.from_sources(str(path), {"iterations": 7, "codec_opts": {"norm": "max"}, "lr": None})
    assert config.iterations == 7 and config.bandwidth == 1.25e8
    assert config.codec_opts == {"bucket_size": 256, "norm": "max"}
    assert config.policy_config() == {"id": "mqgrad", "initial_bits": 4, "epsilon": 0.2}
    assert config.lr == 0.01  # digits' default learning rate
    assert RunConfig.from_sources(None, {"policy": "fixed", "bits": 8}).policy_config() == {"id": "fixed", "bits": 8}


@pytest.mark.parametrize("content, message", [
    ("iterations = 'many'", "iterations must be an integer"),
    ("itterations = 5", "unknown option 'itterations'"),
    ("latency = '3 fortnights'", "cannot read duration"),
    ("net_mode = 'warp'", "net_mode must be one of virtual, sleep, off"),
    ("iterations = [", "is not valid TOML"),
    ("codec_opts = 3", "codec_opts must be a table"),
    ("lr = -0.1", "lr must be a positive number, got -0.1"),
])
def test_bad_config_files(tmp_path, content, message):
    path = tmp_path / "bad.toml"
    path.write_text(content + "\n")
    with pytest.raises(UsageError, match=message):
        RunConfig.from_sources(str(path), {})


def test_missing_config_file(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        RunConfig.from_sources(str(tmp_path / "nope.toml"), {})


def test_assignments():
    assert parse_assignments(["fc_sizes=[64,64]", "norm=l2", "flag=true", "bucket-size=8"], "--x") == \
        {"fc_sizes": [64, 64], "norm": "l2", "flag": True, "bucket_size": 8}
    with pytest.raises(UsageError, match="expects KEY=VALUE"):
        parse_assignments(["oops"], "--codec-opt")


def test_train_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for field in (f.name for f in dataclasses.fields(RunConfig)):
        if not field.endswith("_opts"):
            assert "--" + field.replace("_", "-") in out, field


def test_star_and_tree_link_models():
    star = LinkModel(bandwidth=1e6, latency=1e-3)
    assert star.message(1000) == pytest.approx(2e-3)
    assert star.gather([1000, 3000]) == pytest.approx(2e-3 + 4e-3)
    assert star.bcast(1000, workers=8) == pytest.approx(8 * 2e-3)
    tree = LinkModel(bandwidth=1e6, latency=1e-3, broadcast="tree")
    assert tree.bcast(1000, workers=8) == pytest.approx(4 * 2e-3)  # ceil(log2(9)) rounds
    assert LinkModel(1e6, 0.0, mode="off").charge(5.0) == 0.0


def test_mpich_broadcast_model_is_a_binomial_tree_whose_copies_share_a_link():
    m = 2e-3  # one message: 1 ms latency + 1000 B at 1 MB/s
    mpich = LinkModel(bandwidth=1e6, latency=1e-3, broadcast="mpich")
    # receivers -> message times: the root's children share its link, then they forward
    # (3 ranks: 2; 5 ranks: root to 1, 2, 4 (3), 2 to 3 (4); 6: 4 to 5 as well; 7: 4 to 5 and 6 (5)).
    for receivers, times in {1: 1, 2: 2, 3: 3, 4: 4, 5: 4, 6: 5, 7: 6}.items():
        assert mpich.bcast(1000, workers=receivers) == pytest.approx(times * m), receivers
    # P = 4 with one server: the broadcast phase as the star's; two servers: server 1's group
    # of six ranks (it, rank 0, four workers) takes four message times, the star five.
    star = LinkModel(bandwidth=1e6, latency=1e-3)
    assert mpich.broadcasts(4, [1000]) == pytest.approx(star.broadcasts(4, [1000]))
    assert mpich.broadcasts(4, [1000, 1000]) == pytest.approx(4 * m)
    assert star.broadcasts(4, [1000, 1000]) == pytest.approx(5 * m)
    # Colocated shards go point to point in the runtime: a star under mpich.
    assert mpich.broadcasts(4, [1000] * 4, colocated=True) == star.broadcasts(4, [1000] * 4, colocated=True)
    # With a network each copy goes at the slower of its two links: rank 3 (relative rank 3 of
    # the group [0, 1, 2, 3, 4]) has a tenth of the rate and gets its copy from rank 2 after
    # the root's three fast ones.
    slow = Network(Constant(1e6), Constant(1e-3), links={3: Constant(1e5)})
    linked = LinkModel(bandwidth=1e6, latency=1e-3, broadcast="mpich", network=slow)
    assert linked.bcast(1000, 4, 0.0, 0, [1, 2, 3, 4]) == pytest.approx(3 * m + 1e-3 + 1000 / 1e5)
    assert linked.bcast(1000, 4, 0.0, 0, [3, 1, 2, 4]) == pytest.approx(2 * m + 1e-3 + 1000 / 1e5 + m)


@pytest.mark.parametrize("value, interval", [
    (500, ("iterations", 500)), ("500", ("iterations", 500)), ("30m", ("seconds", 1800.0)),
    ("90s", ("seconds", 90.0)), ("1.5h", ("seconds", 5400.0)), (None, None),
])
def test_checkpoint_every_takes_iterations_or_a_duration(value, interval):
    config = RunConfig.from_sources(None, {"checkpoint_every": value})
    assert config.checkpoint_interval == interval
    # Kept as written, so that the trace's config and a TOML file read back the same.
    assert RunConfig.from_sources(None, {"checkpoint_every": config.checkpoint_every}) == config


@pytest.mark.parametrize("value, message", [
    (0, "checkpoint_every must be a positive"), ("0s", "checkpoint_every must be a positive"),
    ("soon", "cannot read checkpoint interval 'soon'"), ("5 parsecs", "cannot read duration"),
    (1.5, "checkpoint_every must be iterations (500) or a duration (30m)"),
])
def test_bad_checkpoint_every_is_refused(value, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig.from_sources(None, {"checkpoint_every": value})


def test_periodic_checkpoint_schedule():
    from mpigrad.runtime.measure.checkpoint import Schedule

    every = Schedule(("iterations", 10))
    assert [done for done in range(1, 41) if every.due(done)] == [10, 20, 30, 40]
    now = [0.0]
    timed = Schedule(("seconds", 60.0), clock=lambda: now[0])
    now[0] = 59.0
    assert not timed.due(5)
    now[0] = 60.0
    assert timed.due(6)
    timed.written()
    now[0] = 100.0
    assert not timed.due(7) and not Schedule(None).due(10)


def test_a_config_files_ranks_line_is_read_but_is_no_option(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("# For 1 server + 3 workers.\n# ranks: 4\niterations = 5\n")
    config = RunConfig.from_sources(str(path), {})
    assert config.declared_ranks == (str(path), 4)
    assert "declared_ranks" not in config.to_dict()
    assert RunConfig.from_sources(None, {}).declared_ranks is None
    with pytest.raises(UsageError, match="unknown option 'declared_ranks'"):
        RunConfig.from_sources(None, {"declared_ranks": 4})


@pytest.mark.parametrize("seconds, text", [(0.0, "0s"), (5e-4, "0.5ms"), (2e-5, "20us"), (0.02, "20ms"), (90.0, "1.5m"),
                                           (7200.0, "2h")])
def test_format_duration_reads_back(seconds, text):
    assert format_duration(seconds) == text
    assert math.isclose(parse_duration(text), seconds)
