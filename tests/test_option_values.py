"""Optimizer and schedule option values checked before any rank works (issue 64 items 2, 8,
9 and 6's train part): one line naming the option, the README's cosine line working as
written, a command-line --data dropping a config file's data_dir, and a directory as the
trace refused as a directory."""

from __future__ import annotations

import pytest

from mpigrad.cli import command_parser
from mpigrad.errors import UsageError
from mpigrad.optim import LearningRate, OptimizerError, check_recipe, schedule_class
from mpigrad.options import check_overwrite, check_values
from mpigrad.runtime.plan.checks import check_options, check_trace
from mpigrad.runtime.run.launch import config_from_args


def config_of(*argv: str):
    """The RunConfig ``mpigrad train ARGV`` runs with (the CLI's own path)."""
    _, parser = command_parser("train")
    return config_from_args(parser.parse_args(list(argv)))


def refusal(*argv: str) -> str:
    with pytest.raises(UsageError) as info:
        check_options(config_of(*argv))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("argv, message", [
    (["--optimizer-opt", "nesterov=yes", "--optimizer-opt", "momentum=0.9"],
     "optimizer 'sgd': nesterov must be true or false, got 'yes'"),
    (["--optimizer-opt", "dampening=yes", "--optimizer-opt", "momentum=0.9"],
     "optimizer 'sgd': dampening must be a number, got 'yes'"),
    (["--optimizer-opt", "momentum=high"], "optimizer 'sgd': momentum must be a number, got 'high'"),
    (["--optimizer-opt", "momentum=true"], "optimizer 'sgd': momentum must be a number, got True"),
    (["--optimizer", "adamw", "--optimizer-opt", "betas=0.9"],
     "optimizer 'adamw': betas must be a list of 2 numbers, e.g. [0.9, 0.999], got 0.9"),
    (["--optimizer", "adamw", "--optimizer-opt", "betas=[0.9]"],
     "optimizer 'adamw': betas must be a list of 2 numbers, e.g. [0.9, 0.999], got [0.9]"),
    (["--optimizer", "adam", "--optimizer-opt", "amsgrad=1"], "optimizer 'adam': amsgrad must be true or false, got 1"),
    (["--lr-schedule", "CosineAnnealingLR", "--lr-schedule-opt", "T_max=abc"],
     "lr schedule 'CosineAnnealingLR': T_max must be an integer, got 'abc'"),
    (["--lr-schedule", "MultiStepLR", "--lr-schedule-opt", "milestones=100"],
     "lr schedule 'MultiStepLR': milestones must be a list of integers, e.g. [100, 200], got 100"),
    (["--lr-schedule", "StepLR", "--lr-schedule-opt", "step_size=4.0"],
     "lr schedule 'StepLR': step_size must be an integer, got 4.0"),
    (["--lr-schedule", "CyclicLR", "--lr-schedule-opt", "base_lr=0.01", "--lr-schedule-opt", "max_lr=0.1",
      "--lr-schedule-opt", "mode=tri"],
     "lr schedule 'CyclicLR': mode must be one of 'triangular', 'triangular2', 'exp_range', got 'tri'"),
])
def test_a_value_of_the_wrong_kind_is_refused_naming_its_option(argv, message):
    assert refusal(*argv) == message


@pytest.mark.parametrize("argv", [
    ["--optimizer-opt", "nesterov=true", "--optimizer-opt", "momentum=0.9"],
    ["--optimizer-opt", "momentum=1"],  # an integer where torch's float goes
    ["--optimizer", "adamw", "--optimizer-opt", "betas=[0.9,0.99]"],
    ["--optimizer", "rprop", "--optimizer-opt", "step_sizes=[1e-6,50]"],
    ["--optimizer", "sgd", "--optimizer-opt", "momentum=0.9", "--optimizer-opt", "fused=null"],
    ["--lr-schedule", "MultiStepLR", "--lr-schedule-opt", "milestones=[100,200]"],
    ["--lr-schedule", "OneCycleLR", "--lr-schedule-opt", "max_lr=0.1"],
])
def test_values_of_the_right_kind_pass(argv):
    check_options(config_of(*argv))


def test_errors_only_a_step_raises_are_caught_in_one_line(monkeypatch):
    import torch

    def broken_step(self, closure=None):
        raise RuntimeError("_fused_sgd_() received an invalid combination of arguments - got (...), but expected"
                           "\n one of:\n * (TensorList self, ...)\n")

    monkeypatch.setattr(torch.optim.SGD, "step", broken_step)
    with pytest.raises(OptimizerError) as info:
        check_recipe("sgd", {"momentum": 0.9}, None, {}, 0, "none")
    assert str(info.value) == ("optimizer 'sgd': its first step fails: _fused_sgd_() received an invalid combination "
                               "of arguments - got (...), but expected")


def test_check_recipe_steps_the_optimizer_with_a_gradient(monkeypatch):
    import torch

    seen = []
    original = torch.optim.Adam.step

    def step(self, closure=None):
        seen.append([p.grad is not None for group in self.param_groups for p in group["params"]])
        return original(self, closure)

    monkeypatch.setattr(torch.optim.Adam, "step", step)
    check_recipe("adam", {}, None, {}, 0, "none")
    assert seen == [[True]]


def test_check_values_reads_annotations_and_defaults():
    def f(a: bool = False, b: float = 0, c=3, d=(0.5, 1.2), e: int | None = None, g: Literal['x', 'y'] = "x",  # noqa: F821
          h=None, *, k: Callable[[int], float] = None):  # noqa: F821 - annotations as strings (torch's schedulers)
        pass

    check_values("f", f, {"a": True, "b": 1, "c": 4, "d": [1, 2.5], "e": None, "g": "y", "h": "anything",
                          "k": "not checked"})
    for given, message in [({"c": 4.0}, "f: c must be an integer, got 4.0"),
                           ({"d": [1, 2, 3]}, "f: d must be a list of 2 numbers, e.g. [0.5, 1.2], got [1, 2, 3]"),
                           ({"e": "5"}, "f: e must be an integer or null, got '5'"),
                           ({"a": "false"}, "f: a must be true or false, got 'false'"),
                           ({"g": "z"}, "f: g must be one of 'x', 'y', got 'z'")]:
        with pytest.raises(ValueError, match="^" + __import__("re").escape(message) + "$"):
            check_values("f", f, given)


def test_private_schedulers_are_not_offered():
    with pytest.raises(OptimizerError) as info:
        schedule_class("Cosine")
    assert "_LRScheduler" not in str(info.value) and "CosineAnnealingLR" in str(info.value)
    with pytest.raises(OptimizerError):
        schedule_class("_LRScheduler")


def test_the_readme_cosine_line_works_as_written():
    """README: ``--lr-schedule CosineAnnealingLR --lr-warmup 20``: T_max is the run's iterations."""
    config = config_of("--lr-schedule", "CosineAnnealingLR", "--lr-warmup", "20", "--iterations", "120")
    check_options(config)
    assert config.lr_schedule_opts == {"T_max": 120}
    rate = LearningRate(config.lr, config.lr_schedule, config.lr_schedule_opts, config.lr_warmup,
                        config.lr_scaling)
    assert rate.at(0) == pytest.approx(config.lr / 20)
    assert rate.at(19) == pytest.approx(config.lr * 0.5 * (1 + __import__("math").cos(__import__("math").pi * 19 / 120)))
    assert rate.at(120) == pytest.approx(0.0, abs=1e-12)  # eta_min at the run's end
    # given, T_max is kept; OneCycleLR gets total_steps unless epochs is given
    assert config_of("--lr-schedule", "cosineannealinglr", "--lr-schedule-opt", "T_max=50").lr_schedule_opts == \
        {"T_max": 50}
    assert config_of("--lr-schedule", "OneCycleLR", "--lr-schedule-opt", "max_lr=0.1",
                     "--iterations", "40").lr_schedule_opts == {"max_lr": 0.1, "total_steps": 40}
    one_cycle = config_of("--lr-schedule", "OneCycleLR", "--lr-schedule-opt", "max_lr=0.1", "--iterations", "40")
    LearningRate(one_cycle.lr, one_cycle.lr_schedule, one_cycle.lr_schedule_opts).at(40)  # steps to the end
    assert "total_steps" not in config_of("--lr-schedule", "OneCycleLR", "--lr-schedule-opt", "max_lr=0.1",
                                          "--lr-schedule-opt", "epochs=2", "--lr-schedule-opt",
                                          "steps_per_epoch=10").lr_schedule_opts


def test_a_command_line_data_set_drops_the_config_files_data_dir(tmp_path):
    path = tmp_path / "paper.toml"
    path.write_text('data = "cifar10"\ndata_dir = "data/cifar10"\n')
    config = config_of("--config", str(path), "--data", "digits")
    assert config.data == "digits" and config.data_dir is None
    assert config.notes == (f"mpigrad: note: {path}'s data_dir = 'data/cifar10' went with its data 'cifar10', "
                            "which --data digits replaced: dropped",)
    kept = config_of("--config", str(path), "--data", "cifar10")
    assert kept.data_dir == "data/cifar10" and kept.notes == ()
    given = config_of("--config", str(path), "--data", "synthetic", "--data-dir", "elsewhere")
    assert given.data_dir == "elsewhere" and given.notes == ()


def test_a_directory_is_refused_as_a_directory_even_with_force(tmp_path):
    with pytest.raises(UsageError) as info:
        check_trace(config_of("--trace", str(tmp_path), "--force"))
    assert str(info.value) == f"{tmp_path} is a directory, not a file: give the path of a file (in it or elsewhere)"
    assert "overwrite" not in str(info.value)
    with pytest.raises(ValueError, match="is a directory"):
        check_overwrite([tmp_path], False)
    trace = tmp_path / "run.h5"
    trace.write_bytes(b"")
    with pytest.raises(UsageError, match=r"run\.h5 exists; pass --force to overwrite it or --trace to choose another$"):
        check_trace(config_of("--trace", str(trace)))
    check_trace(config_of("--trace", str(trace), "--force"))
    check_trace(config_of("--trace", str(tmp_path / "new" / "run.h5")))


def test_a_trace_taken_at_creation_is_a_clash_not_a_failure(tmp_path):
    """A second run that finds the trace created after its launch checks exits 2 (launch.run
    tells TraceExists from other errors)."""
    from mpigrad.trace.writer import TraceExists, TraceWriter

    trace = tmp_path / "run.h5"
    trace.write_bytes(b"")
    tables = {"steps": {"iteration": ("i8", ())}}
    with pytest.raises(TraceExists):
        TraceWriter(trace, config={}, tables=tables)
    with pytest.raises(TraceExists):
        TraceWriter(tmp_path, config={}, tables=tables, force=True)
