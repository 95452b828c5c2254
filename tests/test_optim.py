"""The update rule (mpigrad/optim.py): torch optimizers over the layout's flat pieces, the
learning-rate schedule, and the refusals of a recipe that cannot be built."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from mpigrad.config import RunConfig, describe_recipe
from mpigrad.errors import UsageError
from mpigrad.optim import OPTIMIZERS, LearningRate, OptimizerError, UpdateRule, build_torch_optimizer, recipe_description
from mpigrad.policies import Policy
from mpigrad.runtime.plan.checks import check_options

#: Three pieces of a 23-element flat buffer, as a layout cuts it.
PIECES = [(0, 10), (10, 8), (18, 5)]


def updates(steps: int, n: int = 23) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(n, generator=generator) for _ in range(steps)]


def run_rule(name: str, options: dict, *, piece_by_piece: bool, lr: float = 0.05) -> torch.Tensor:
    flat = torch.linspace(-1, 1, 23)
    rule = UpdateRule(name, options, PIECES, flat, lr)
    for update in updates(5):
        if piece_by_piece:
            for offset, size in PIECES:
                rule.apply(flat, update, lr, offset, offset + size)
        else:
            rule.apply(flat, update, lr, 0, 23)
    return flat


def run_torch(name: str, options: dict, lr: float = 0.05) -> torch.Tensor:
    """The same optimizer over the buffer's three pieces as three parameters of one model."""
    flat = torch.linspace(-1, 1, 23)
    params = [flat[offset:offset + size].clone() for offset, size in PIECES]
    optimizer = build_torch_optimizer(name, params, lr, options)
    for update in updates(5):
        for param, (offset, size) in zip(params, PIECES):
            param.grad = update[offset:offset + size].clone()
        optimizer.step()
    return torch.cat(params)


def test_plain_sgd_is_the_papers_update_bit_for_bit():
    flat, expected = torch.linspace(-1, 1, 23), torch.linspace(-1, 1, 23)
    rule = UpdateRule("sgd", {}, PIECES, flat, 0.05)
    assert rule.plain and rule.optimizers == []
    for update in updates(3):
        rule.apply(flat, update, 0.05, 0, 23)
        expected.add_(update, alpha=-0.05)
    assert torch.equal(flat, expected)


@pytest.mark.parametrize("name, options", [
    ("sgd", {"momentum": 0.9, "nesterov": True}),
    ("sgd", {"momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-3}),
    ("adam", {}), ("AdamW", {"weight_decay": 0.01}), ("rmsprop", {"momentum": 0.5}),
])
def test_an_optimizer_over_flat_pieces_is_torchs_over_layers_bit_for_bit(name, options):
    whole = run_rule(name, options, piece_by_piece=False)
    assert torch.equal(whole, run_torch(name, options))
    assert torch.equal(run_rule(name, options, piece_by_piece=True), whole)  # the pipelined order


def test_the_rule_state_round_trips_and_continues_identically():
    flat = torch.linspace(-1, 1, 23)
    rule = UpdateRule("sgd", {"momentum": 0.9}, PIECES, flat, 0.1)
    steps = updates(4)
    for update in steps[:2]:
        rule.apply(flat, update, 0.1, 0, 23)
    saved, saved_flat = rule.state_dict(), flat.clone()
    for update in steps[2:]:
        rule.apply(flat, update, 0.1, 0, 23)
    again = saved_flat.clone()
    other = UpdateRule("sgd", {"momentum": 0.9}, PIECES, again, 0.1)
    other.load_state_dict(saved)
    for update in steps[2:]:
        other.apply(again, update, 0.1, 0, 23)
    assert torch.equal(again, flat)
    with pytest.raises(ValueError, match="another layout"):
        UpdateRule("sgd", {"momentum": 0.9}, [(0, 23)], flat, 0.1).load_state_dict(saved)


def test_an_update_that_does_not_start_a_piece_is_refused():
    flat = torch.zeros(23)
    with pytest.raises(ValueError, match="does not start a piece"):
        UpdateRule("adam", {}, PIECES, flat, 0.1).apply(flat, torch.ones(23), 0.1, 3, 10)


def test_the_rate_warms_up_then_follows_the_schedule():
    rate = LearningRate(0.1, "MultiStepLR", {"milestones": [6, 8], "gamma": 0.1}, warmup=4)
    rates = [rate.at(m) for m in range(10)]
    assert rates[:4] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    assert rates[4:] == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.001])
    assert LearningRate(0.1, scaling="linear", workers=4).at(0) == pytest.approx(0.4)
    assert LearningRate(0.1).constant and not LearningRate(0.1, warmup=2).constant


def test_a_plain_recipe_builds_no_torch_optimizer():
    """Building any torch optimizer imports torch._dynamo, 1.7 s of every rank's start-up: the
    default recipe (plain SGD at a constant rate) builds none (a fresh interpreter checks)."""
    probe = ("import sys\n"
             "from mpigrad.config import RunConfig\n"
             "from mpigrad.runtime.exchange.build import build_replica, load_data\n"
             "config = RunConfig.from_sources(None, {})\n"
             "replica = build_replica(config, load_data(config), workers=2)\n"
             "print(replica.lr(0, None), 'torch._dynamo' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(RunConfig.from_sources(None, {}).lr), "False"]
    schedule = LearningRate(0.1, "StepLR", {"step_size": 2})
    assert schedule._stand_in is not None and LearningRate(0.1, warmup=3)._stand_in is None


def test_the_rate_resumes_where_it_stopped():
    first = LearningRate(0.2, "CosineAnnealingLR", {"T_max": 10}, warmup=2)
    straight = [first.at(m) for m in range(10)]
    stopped = LearningRate(0.2, "CosineAnnealingLR", {"T_max": 10}, warmup=2)
    _ = [stopped.at(m) for m in range(4)]
    resumed = LearningRate(0.2, "CosineAnnealingLR", {"T_max": 10}, warmup=2)
    resumed.load_state_dict(stopped.state_dict())
    assert [resumed.at(m) for m in range(4, 10)] == straight[4:]


@pytest.mark.parametrize("options, words", [
    ({"momentum_correction": 1.0}, "momentum_correction must be in [0, 1) (0: off), got 1.0"),
    ({"momentum_correction": 0.9, "optimizer_opts": {"momentum": 0.9}},
     "momentum correction is the update's momentum, accumulated before the codec: the optimizer must be plain sgd"),
    ({"momentum_correction": 0.9, "optimizer": "adam"}, "the optimizer must be plain sgd"),
    ({"momentum_correction": 0.9, "servers": "colocated", "pipeline": True},
     "momentum correction with --pipeline is not built"),
])
def test_momentum_correction_is_refused_where_it_cannot_work_in_one_line(options, words):
    with pytest.raises(UsageError) as caught:
        RunConfig.from_sources(None, options)
    assert words in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("options, words", [
    ({"optimizer": "adamx"}, "unknown optimizer 'adamx'; choose from sgd, adam, adamw"),
    ({"optimizer": "lbfgs"}, "optimizer 'lbfgs' is refused: it needs a closure"),
    ({"optimizer": "sgd", "optimizer_opts": {"momentun": 0.9}},
     "optimizer 'sgd': unknown option(s) momentun; valid: momentum, dampening, weight_decay, nesterov"),
    ({"optimizer": "sgd", "optimizer_opts": {"momentum": -1}}, "optimizer 'sgd': Invalid momentum value: -1"),
    ({"lr_schedule": "cosine"}, "unknown lr schedule 'cosine'; choose from "),
    ({"lr_schedule": "StepLR"}, "lr schedule 'StepLR': "),
    ({"lr_schedule": "StepLR", "lr_schedule_opts": {"step": 3}}, "unknown option(s) step; valid: step_size, gamma"),
    ({"lr_schedule_opts": {"T_max": 3}}, "--lr-schedule-opt without --lr-schedule"),
    ({"lr_schedule": "StepLR", "lr_schedule_opts": {"step_size": "x"}}, "lr schedule 'StepLR': "),
    ({"optimizer": "no_such_module:factory"}, "cannot import 'no_such_module'"),
    ({"momentum_correction": 0.9, "codec": "powersgd", "policy": "fixed"},
     "--codec powersgd keeps its own error memory of the matrices, before which momentum correction is not built"),
])
def test_a_recipe_that_cannot_be_built_is_one_line(options, words):
    with pytest.raises(UsageError) as caught:
        check_options(RunConfig(**options))
    message = str(caught.value)
    assert words in message and "\n" not in message


def test_a_plugin_optimizer_gets_the_pieces(tmp_path, monkeypatch):
    (tmp_path / "my_optim.py").write_text(
        "import torch\n"
        "def heavy_ball(params, lr, beta=0.5):\n"
        "    return torch.optim.SGD(params, lr=lr, momentum=beta)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_options(RunConfig(optimizer="my_optim:heavy_ball", optimizer_opts={"beta": 0.8}))
    assert torch.equal(run_rule("my_optim:heavy_ball", {"beta": 0.8}, piece_by_piece=False),
                       run_torch("sgd", {"momentum": 0.8, "fused": False}))  # the factory's own choice
    with pytest.raises(UsageError, match="--shard-chunk cuts layers"):
        check_options(RunConfig(optimizer="my_optim:heavy_ball", shard_chunk=1000))
    with pytest.raises(OptimizerError, match="cannot take gamma"):
        build_torch_optimizer("my_optim:heavy_ball", [torch.zeros(2)], 0.1, {"gamma": 1})


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_listed_optimizer_steps_over_flat_pieces(name):
    moved = run_rule(name, {}, piece_by_piece=True)
    assert torch.isfinite(moved).all() and not torch.equal(moved, torch.linspace(-1, 1, 23))


def test_an_optimizer_that_can_fuse_its_pass_does_unless_told():
    param = [torch.zeros(3)]
    assert build_torch_optimizer("adam", param, 0.1, {}).defaults["fused"] is True
    assert build_torch_optimizer("adam", param, 0.1, {"foreach": True}).defaults["fused"] is None
    assert build_torch_optimizer("sgd", param, 0.1, {"fused": False}).defaults["fused"] is False
    assert "fused" not in build_torch_optimizer("rmsprop", param, 0.1, {}).defaults  # it has none


def test_the_recipe_in_a_few_words():
    assert recipe_description(RunConfig(lr=0.01)) == "lr 0.01"
    config = RunConfig(lr=0.1, optimizer="sgd", optimizer_opts={"momentum": 0.9, "nesterov": True},
                       lr_schedule="CosineAnnealingLR", lr_schedule_opts={"T_max": 300}, lr_warmup=5,
                       lr_scaling="linear")
    assert recipe_description(config) == ("lr 0.1, sgd(momentum=0.9, nesterov=True) lr x workers "
                                          "CosineAnnealingLR(T_max=300) warm-up 5")
    assert describe_recipe({"optimizer": "adam"}) == "adam" and describe_recipe({}) == "sgd"


def test_train_refuses_a_bad_optimizer_before_mpi_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--optimizer", "sgd", "--optimizer-opt",
                           "nesterov=true", "--trace", str(tmp_path / "t.h5")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "mpigrad train: error: optimizer 'sgd': Nesterov momentum requires a momentum and zero dampening"]
    assert not (tmp_path / "t.h5").exists()


@pytest.mark.parametrize("name", ["digits-momentum", "resnet20-cifar10"])
def test_the_shipped_recipes_load_and_pass_the_checks(name):
    """docs/training.rst runs the digits recipe; the CIFAR-10 one needs the data set."""
    from conftest import REPO
    from mpigrad.config import declared_ranks

    path = REPO / "examples" / "recipes" / f"{name}.toml"
    config = RunConfig.from_sources(str(path), {})
    check_options(config)
    assert config.optimizer_opts["momentum"] == 0.9 and config.lr_schedule
    rate = LearningRate(config.lr, config.lr_schedule, config.lr_schedule_opts, config.lr_warmup)
    if name == "resnet20-cifar10":  # He et al.: 0.1, divided by 10 at 32k and 48k
        assert declared_ranks(str(path)) == 5 and config.batch_size * 4 == 128
        assert [rate.at(m) for m in (0, 31999, 32000, 48000)] == pytest.approx([0.1, 0.1, 0.01, 0.001])
    else:
        assert rate.at(0) == pytest.approx(0.004 / 20) and rate.at(399) < 1e-6


def test_the_rate_of_a_recent_iteration_stays_at_hand():
    """The Control ahead of the losses asks for iteration m + 1's rate (the policy's
    observation) before iteration m's update asks for m's."""
    rate = LearningRate(1.0, "StepLR", {"step_size": 1, "gamma": 0.5})
    assert rate.at(3) == 0.125 and rate.at(2) == 0.25 and rate.at(3) == 0.125
    _ = rate.at(10)
    with pytest.raises(ValueError, match="the rate of iteration 2 is gone"):
        rate.at(2)


class RecordingPolicy(Policy):
    """A fixed 4-bit policy that keeps the rate each observation brought (a plugin)."""

    policy_id = "recording"
    seen: list[tuple[int, float]] = []

    def _config(self):
        return {}

    def bits_range(self):
        return 4, 4

    def decide(self, obs):
        RecordingPolicy.seen.append((obs.iteration, obs.lr))
        return (4,) * self.n_layers


@pytest.mark.parametrize("control", ["ahead", "after"])
def test_the_policy_observes_each_iterations_rate(tmp_path, control):
    from test_runtime_loopback import run

    RecordingPolicy.seen.clear()
    code, errors, _ = run(tmp_path, policy="test_optim:RecordingPolicy", bits=4, control=control,
                          lr_schedule="StepLR", lr_schedule_opts={"step_size": 2, "gamma": 0.5}, lr_warmup=2)
    assert code == 0 and not errors, errors
    expected = LearningRate(0.01, "StepLR", {"step_size": 2, "gamma": 0.5}, warmup=2)
    assert RecordingPolicy.seen == [(m, pytest.approx(expected.at(m))) for m in range(6)]


@pytest.mark.parametrize("servers", [1, "colocated"])
def test_a_stopped_run_with_adam_and_a_schedule_resumes_bit_for_bit_in_process(tmp_path, servers):
    from test_runtime_loopback import straight_and_resumed

    straight, resumed = straight_and_resumed(tmp_path, 2, servers=servers, optimizer="adam", lr=0.002,
                                             lr_schedule="CosineAnnealingLR", lr_schedule_opts={"T_max": 6})
    assert len(resumed.steps) == 6
    np.testing.assert_array_equal(straight.steps["loss"].to_numpy(), resumed.steps["loss"].to_numpy())
    np.testing.assert_array_equal(straight.steps["lr"].to_numpy(), resumed.steps["lr"].to_numpy())
    np.testing.assert_array_equal(straight.checksums.to_numpy(), resumed.checksums.to_numpy())


def test_the_weight_decay_acts_in_the_loss_or_in_the_optimizer_once():
    loss = RunConfig.from_sources(None, {"weight_decay": 1e-3})
    assert loss.loss_weight_decay == 1e-3 and loss.update_options == {}
    moved = RunConfig.from_sources(None, {"weight_decay": 1e-3, "weight_decay_in": "optimizer",
                                          "optimizer_opts": {"momentum": 0.9}})
    assert moved.loss_weight_decay == 0.0 and moved.update_options == {"momentum": 0.9, "weight_decay": 1e-3}
    assert describe_recipe(moved.to_dict()) == "sgd(momentum=0.9, weight_decay=0.001)"
    assert describe_recipe({"weight_decay": 0, "weight_decay_in": "optimizer"}) == "sgd"  # no decay at all
    for twice in ({"weight_decay": 1e-3, "optimizer_opts": {"weight_decay": 1e-4}},
                  {"weight_decay": 0, "weight_decay_in": "optimizer", "optimizer_opts": {"weight_decay": 1e-4}}):
        with pytest.raises(UsageError, match=r"weight decay given twice .*: give it once, as --weight-decay X "):
            RunConfig.from_sources(None, twice).validate()
    with pytest.raises(UsageError, match="weight_decay_in must be loss or optimizer, got 'model'"):
        RunConfig.from_sources(None, {"weight_decay_in": "model"}).validate()


def test_the_optimizers_decay_is_torchs_on_the_decoded_update():
    """--weight-decay-in optimizer: the replica's rule is torch's SGD with weight_decay, over
    the flat pieces, bit for bit; the loss's l2 term is gone (its coefficient is 0)."""
    config = RunConfig.from_sources(None, {"weight_decay": 0.01, "weight_decay_in": "optimizer"})
    flat = torch.linspace(-1, 1, 23)
    rule = UpdateRule(config.optimizer, config.update_options, PIECES, flat, 0.05)
    assert not rule.plain
    expected = flat.clone().requires_grad_(True)
    reference = torch.optim.SGD([expected], lr=0.05, weight_decay=0.01)
    for update in updates(3):
        rule.apply(flat, update, 0.05, 0, 23)
        expected.grad = update.clone()
        reference.step()
    torch.testing.assert_close(flat, expected.detach(), rtol=0, atol=0)


def test_bf16_autocast_keeps_gradients_float32_and_fp16_is_refused():
    """--autocast bf16: the worker's forward and loss in bfloat16 (a slightly different loss
    and gradient), the gradient it encodes float32; fp16 is refused in one line."""
    from mpigrad.runtime.exchange.build import build_replica, forward_context, load_data

    results = {}
    for autocast in ("none", "bf16"):
        config = RunConfig.from_sources(None, {"model_opts": {"fc_sizes": [64, 64]}, "autocast": autocast})
        dataset = load_data(config)
        replica = build_replica(config, dataset, workers=2)
        x, y = torch.from_numpy(dataset.train_x[:16]), torch.from_numpy(dataset.train_y[:16])
        replica.flat_grad.zero_()
        with forward_context(config, replica.device):
            loss = replica.model.loss(replica.model(x), y, config.loss_weight_decay)
        loss.backward()
        results[autocast] = (loss.detach(), replica.flat_grad.clone())
    (loss32, grad32), (loss16, grad16) = results["none"], results["bf16"]
    assert grad16.dtype == torch.float32 and loss16.dtype == torch.float32
    assert not torch.equal(grad32, grad16) and torch.allclose(loss32, loss16, rtol=2e-2)
    assert describe_recipe({"autocast": "bf16"}) == "sgd autocast bf16"
    with pytest.raises(UsageError, match="autocast must be none or bf16, got 'fp16'; fp16 needs a loss scale"):
        RunConfig.from_sources(None, {"autocast": "fp16"}).validate()


def test_a_checkpoint_from_before_the_recipe_keys_resumes_and_another_recipe_is_refused():
    """A checkpoint written before the recipe's keys existed has none of them: a run that leaves
    them at their defaults resumes it; one that changes any is another configuration."""
    from mpigrad.config import RECIPE_KEYS
    from mpigrad.runtime.measure import checkpoint

    now = RunConfig.from_sources(None, {}).to_dict()
    before = {key: value for key, value in now.items() if key not in RECIPE_KEYS}
    assert checkpoint.identity(now, 3) == checkpoint.identity(before, 3)
    for key, value in [("optimizer", "adam"), ("optimizer_opts", {"momentum": 0.9}), ("lr_warmup", 5),
                       ("weight_decay_in", "optimizer"), ("augment", "crop-flip"), ("autocast", "bf16")]:
        assert checkpoint.identity({**now, key: value}, 3) != checkpoint.identity(now, 3), key
