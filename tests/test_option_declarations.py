"""Each ``mpigrad train`` option is declared once, as its RunConfig field (issue 61 item 4):
the flag, its help and the default it shows, the TOML key, the conversion and the option's
own check all come from that declaration (``config.OPTIONS``), and ``launch.add_arguments``
builds the parser from it. These tests hold the parser, the file keys, the defaults and
the checks to the declarations, so that an option written twice, or not at all, fails."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from mpigrad.cli import command_parser
from mpigrad.config import OPTIONS, Option, RunConfig, dump_toml
from mpigrad.errors import UsageError
from mpigrad.runtime.run.launch import GROUPS, config_from_args, help_order

#: The launch's own flags: options of ``mpigrad train``, not of the run (no RunConfig field).
LAUNCH_FLAGS = {"--config", "--check", "--ranks"}

#: ``RunConfig.to_dict()``'s keys in their order: traces record the config in this order and
#: checkpoints compare it, so a change here is a change of the trace format.
TO_DICT_KEYS = (
    "iterations", "batch_size", "lr", "weight_decay", "weight_decay_in", "optimizer", "optimizer_opts", "lr_schedule",
    "lr_schedule_opts", "lr_warmup", "lr_scaling", "model", "model_opts", "data", "data_dir", "data_opts", "augment",
    "augment_opts", "autocast", "codec", "codec_opts", "bits", "policy", "policy_opts", "min_quantize_size", "servers",
    "pipeline", "ranks_per_node", "exchange", "intra_codec", "control", "shard_chunk", "error_feedback", "momentum_correction", "bandwidth", "latency",
    "link_bandwidth", "intra_bandwidth", "intra_latency", "net_mode", "broadcast", "broadcast_codec", "compute_time", "cost_model", "seed", "trace",
    "force", "trace_flush", "eval_every", "eval_samples", "progress_every", "checksum_every", "norm_every", "timeout",
    "device", "share_gpu", "tf32", "wait", "threads", "walltime", "checkpoint", "checkpoint_every", "resume")


def _parser() -> argparse.ArgumentParser:
    return command_parser("train")[1]


def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings
            if flag not in ("-h", "--help")}


def test_every_field_is_a_declared_option():
    """No RunConfig field without its Option: flagged (a help group) or file-only (None)."""
    for f in dataclasses.fields(RunConfig):
        assert isinstance(f.metadata.get("option"), Option), f"{f.name} has no option(...) declaration"
    assert list(OPTIONS) == [f.name for f in dataclasses.fields(RunConfig)]


def test_to_dict_keeps_its_keys_and_order():
    assert tuple(RunConfig().to_dict()) == TO_DICT_KEYS
    assert tuple(OPTIONS) == TO_DICT_KEYS


def test_the_parser_has_exactly_the_declared_flags():
    actions = _flag_actions(_parser())
    declared = {option.flag: option for option in OPTIONS.values() if option.flag is not None}
    assert set(actions) == set(declared) | LAUNCH_FLAGS
    for flag, option in declared.items():
        action = actions[flag]
        assert action.dest == (option.name[:-1] if option.table else option.name), flag
        assert action.default is None, f"{flag}: a default would override the config file"
        assert action.type is option.type and action.metavar == (option.metavar or ("KEY=VALUE" if option.table else None))
        assert tuple(action.choices or ()) == tuple(option.choices or ()), flag
        if isinstance(option.default, bool):
            assert isinstance(action, argparse._StoreTrueAction), flag
        if option.table or option.append:
            assert isinstance(action, argparse._AppendAction), flag


def test_declared_defaults_are_the_dataclass_defaults():
    config = RunConfig()
    for name, option in OPTIONS.items():
        assert option.default == getattr(config, name), name
        if option.default is not None and option.parse is None and not option.table:
            assert isinstance(option.default, option.kind), f"{name}: default {option.default!r} not a {option.kind}"


def test_the_help_states_the_declared_defaults():
    """A help's ``(default X)`` names the declared default, and no ``{default}`` is left."""
    for name, option in OPTIONS.items():
        text = option.help_text()
        assert "{default}" not in text and "{value" not in text, name
        if option.default is None:
            continue
        shown = dataclasses.replace(option, help="{default}").help_text()
        for stated in re.findall(r"\(default ([^;):]+)[;)]", text):
            assert stated == shown, f"--help of {name} says default {stated!r}, the field's is {shown!r}"


def test_help_groups_and_order_come_from_the_declarations():
    parser = _parser()
    titles = [group.title for group in parser._action_groups if group.title not in ("positional arguments",
                                                                                     "options")]
    assert titles == list(GROUPS)
    shown = [option.flag for option in help_order(OPTIONS.values())]
    listed = [action.option_strings[0] for action in parser._actions if action.option_strings
              and action.option_strings[0] not in LAUNCH_FLAGS | {"-h"}]
    assert listed == shown
    for option in OPTIONS.values():
        assert option.group is None or option.group in GROUPS, option.name
        if option.shown_before is not None:
            assert OPTIONS[option.shown_before].group == option.group, option.name


def test_a_file_only_option_has_no_flag():
    option = Option(group=None, help="only in a config file", name="only_in_files", default=1)
    assert option.flag is None
    assert help_order([option, *OPTIONS.values()]) == help_order(OPTIONS.values())


#: Values for the round trip where the declaration's kind does not give one: as written.
SAMPLES = {"servers": "2", "shard_chunk": "12", "bandwidth": "1MB/s", "latency": "1ms", "compute_time": "50ms",
           "timeout": "10m", "walltime": "2h", "checkpoint_every": "30m", "link_bandwidth": "1=1MB/s",
           "ranks_per_node": "2", "intra_bandwidth": "1GB/s", "intra_latency": "1us"}
#: What an option needs besides itself to be valid.
NEEDS = {"pipeline": {"servers": "colocated"}, "ranks_per_node": {"servers": "colocated"},
         "exchange": {"servers": "colocated"}}


def _sample(option: Option) -> tuple[object, list[str]]:
    """(TOML value, command-line words) of one value of ``option`` other than its default."""
    if option.name == "link_bandwidth":
        return {"1": "1MB/s"}, [option.flag, SAMPLES["link_bandwidth"]]
    if option.name in SAMPLES:
        return SAMPLES[option.name], [option.flag, SAMPLES[option.name]]
    if isinstance(option.default, bool):
        return True, [option.flag]
    if option.table:
        return {"k": 1}, [option.flag, "k=1"]
    if option.choices:
        value = option.choices[-1]
    elif option.kind is int:
        value = option.default + 1 if option.default else 3
    elif option.kind is float:
        value = 0.5
    else:
        value = "other.h5"
    return value, [option.flag, str(value)]


@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_toml_key_and_its_flag_give_the_same_config(name, tmp_path):
    """The field's name is the TOML key: ``name = value`` in a config file and ``--flag
    value`` give the same config, which differs from the default in that option."""
    option = OPTIONS[name]
    value, words = _sample(option)
    needs = NEEDS.get(name, {})
    path = tmp_path / "run.toml"
    path.write_text(dump_toml({**needs, name: value}))
    from_file = RunConfig.from_sources(str(path), {})
    argv = [word for key, needed in needs.items() for word in (OPTIONS[key].flag, needed)] + words
    from_flag = config_from_args(_parser().parse_args(argv))
    assert from_file.to_dict() == from_flag.to_dict()
    assert from_file.given == from_flag.given == {name, *needs}
    assert from_file.to_dict()[name] != RunConfig.from_sources(None, {}).to_dict()[name]


#: A value each option's own check refuses, and the message (as validate wrote it before
#: the checks were declared).
REFUSED = {
    "iterations": (0, "iterations must be at least 1"),
    "batch_size": (0, "batch_size must be at least 1"),
    "lr": (-0.1, "lr must be a positive number, got -0.1"),
    "weight_decay": (-1.0, "weight_decay must be >= 0"),
    "weight_decay_in": ("x", "weight_decay_in must be loss or optimizer, got 'x'"),
    "lr_warmup": (-1, "lr_warmup must be >= 0 iterations, got -1"),
    "lr_scaling": ("x", "lr_scaling must be none or linear, got 'x'"),
    "autocast": ("fp16", "autocast must be none or bf16, got 'fp16'; fp16 needs a loss scale whose overflow every "
                         "replica skips alike, which mpigrad does not have: use bf16"),
    "bits": (33, "bits must be in 1..32, got 33"),
    "min_quantize_size": (0, "min_quantize_size must be at least 1"),
    "ranks_per_node": (0, "ranks_per_node must be a number of workers (at least 1) or auto, got 0"),
    "exchange": ("x", "exchange must be one of auto, flat, hierarchical"),
    "intra_codec": ("x", "intra_codec must be one of fp32, fp16, bf16, int8"),
    "control": ("x", "control must be one of ahead, paper"),
    "shard_chunk": (-1, "shard_chunk must be auto or a number of elements >= 0 (0: never cut a layer), got -1"),
    "error_feedback": ("x", "error_feedback must be one of none, residual, accumulate"),
    "momentum_correction": (1.0, "momentum_correction must be in [0, 1) (0: off), got 1.0"),
    "bandwidth": (0.0, "bandwidth must be positive"),
    "latency": (-1.0, "latency must be >= 0"),
    "intra_bandwidth": (0.0, "intra_bandwidth must be positive"),
    "intra_latency": (-1.0, "intra_latency must be >= 0"),
    "net_mode": ("x", "net_mode must be one of virtual, sleep, off"),
    "broadcast": ("x", "broadcast must be one of star, tree, mpich"),
    "broadcast_codec": ("", "broadcast_codec must not be empty"),
    "compute_time": (-1.0, "compute_time must be >= 0"),
    "cost_model": ("", "cost_model must be default, none or a cost model file"),
    "seed": (-1, "seed must be a non-negative integer"),
    "trace": ("", "trace path must not be empty"),
    "trace_flush": (0, "trace_flush must be at least 1"),
    "eval_every": (-1, "eval_every must be >= 0 (0 disables evaluation)"),
    "eval_samples": (0, "eval_samples must be >= 1"),
    "progress_every": (-1, "progress_every must be >= 0"),
    "checksum_every": (-1, "checksum_every must be >= 0"),
    "norm_every": (-1, "norm_every must be >= 0 (0: never)"),
    "timeout": (0.0, "timeout must be positive"),
    "device": ("x", "device must be one of cpu, cuda, auto"),
    "tf32": ("x", "tf32 must be one of default, on, off"),
    "wait": ("x", "wait must be one of auto, spin, sleep"),
    "threads": (0, "threads must be at least 1"),
    "walltime": (0.0, "walltime must be positive"),
    "checkpoint_every": (0, "checkpoint_every must be a positive number of iterations or a duration such as 30m"),
}


def test_every_declared_check_is_covered_here():
    checked = {name for name, option in OPTIONS.items() if option.valid is not None or option.choices is not None}
    assert checked == set(REFUSED)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_declared_check_refuses_with_its_message(name):
    value, message = REFUSED[name]
    config = RunConfig(**{"lr": 0.1, name: value})
    with pytest.raises(UsageError) as info:
        config.validate()
    assert str(info.value) == message
    default = RunConfig(lr=0.1)
    default.validate()  # the default passes every check
