"""--model and --data plugins: the factory contract, one-line errors, the worked example under mpiexec."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from conftest import REPO, run_mpi
from mpigrad.data import DataError, Dataset, load_dataset
from mpigrad.models import ModelError, PluginModel, build_model, check_model
from mpigrad.trace import load

DIGITS = (1, 8, 8)
HERE = "plugin_factories"


def build(factory, **options):
    return build_model(f"{HERE}:{factory}", input_shape=DIGITS, num_classes=10, seed=0, **options)


def test_factory_gets_shape_classes_seed_and_options_and_keeps_its_own_l2_choice():
    model = build("linear", scale=0.0)
    assert isinstance(model, PluginModel)
    assert model.net.fc.in_features == 64 and model.net.fc.out_features == 10
    assert float(model.net.fc.weight.detach().abs().sum()) == 0.0  # scale=0.0 reached the factory
    assert model.l2_parameters() == [model.net.fc.bias]
    assert model.get_config() == {"id": f"{HERE}:linear", "input_shape": [1, 8, 8], "num_classes": 10,
                                  "scale": 0.0}
    assert model(torch.zeros(3, *DIGITS)).shape == (3, 10)


def test_a_plain_module_gets_the_default_loss_and_l2():
    model = build("plain_mlp")
    decayed = model.l2_parameters()
    assert [tuple(p.shape) for p in decayed] == [(16, 64), (10, 16)]
    x, y = torch.randn(4, *DIGITS), torch.tensor([0, 1, 2, 3])
    logits = model(x)
    l2 = sum(float(w.detach().square().sum()) for w in decayed) / 2
    torch.testing.assert_close(model.loss(logits, y, 0.01).item(),
                               torch.nn.functional.cross_entropy(logits, y).item() + 0.01 * l2)


def test_every_rank_builds_the_same_weights_from_the_seed():
    for factory in ("plain_mlp", "seeded_by_argument"):
        a, b = build(factory), build(factory)
        c = build_model(f"{HERE}:{factory}", input_shape=DIGITS, num_classes=10, seed=1)
        for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters()):
            assert torch.equal(pa, pb)
        assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


@pytest.mark.parametrize("spec, message", [
    ("plugin_factories", "unknown model 'plugin_factories'.*package.module:factory"),
    ("plugin_factories:", "is not of the form package.module:factory"),
    ("plugin factories:linear", "is not of the form"),
    ("no_such_module_here:f", "cannot import 'no_such_module_here' for no_such_module_here:f: "
                              "ModuleNotFoundError.*PYTHONPATH"),
    (f"{HERE}:missing", f"{HERE}:missing: module '{HERE}' has no attribute 'missing'"),
    (f"{HERE}:NOT_CALLABLE", "is a int, not a callable factory"),
    (f"{HERE}:returns_int", f"model factory {HERE}:returns_int returned int, expected a torch.nn.Module"),
    (f"{HERE}:no_parameters", "returned a module without parameters"),
    (f"{HERE}:raises", f"factory {HERE}:raises failed: RuntimeError: no GPU here$"),
    (f"{HERE}:no_seed", "cannot take input_shape, num_classes, seed: got an unexpected keyword argument 'seed'"),
    (f"{HERE}:wrong_classes", r"maps a \(2, 1, 8, 8\) batch to shape \(2, 11\) torch.float32, "
                              r"expected float logits of shape \(2, 10\)"),
    (f"{HERE}:wrong_input", r"fails on a \(2, 1, 8, 8\) batch: RuntimeError: mat1 and mat2"),
])
def test_a_bad_model_plugin_is_one_line_naming_the_cause(spec, message):
    with pytest.raises(ModelError, match=message) as info:
        check_model(spec, input_shape=DIGITS, num_classes=10)
    assert "\n" not in str(info.value)


def test_model_options_a_factory_does_not_take_are_named():
    with pytest.raises(ModelError, match=rf"model factory {HERE}:linear: unknown option\(s\) depth; valid: scale$"):
        build("linear", depth=3)


def test_data_plugin_gets_data_dir_seed_and_options():
    a = load_dataset(f"{HERE}:tiny_data", seed=3, size=30)
    b = load_dataset(f"{HERE}:tiny_data", seed=3, size=30)
    assert isinstance(a, Dataset) and a.train_size == 30 and a.input_shape == (1, 4, 4)
    np.testing.assert_array_equal(a.train_x, b.train_x)


@pytest.mark.parametrize("spec, options, message", [
    (f"{HERE}:data_as_dict", {}, f"data factory {HERE}:data_as_dict returned dict, expected an mpigrad.data.Dataset"),
    (f"{HERE}:data_bad_labels", {}, "train_y holds labels 0..5, outside 0..2"),
    (f"{HERE}:tiny_data", {"colour": 1}, rf"data factory {HERE}:tiny_data: unknown option\(s\) colour; valid: "),
    (f"{HERE}:gone", {}, "has no attribute 'gone'"),
])
def test_a_bad_data_plugin_is_one_line_naming_the_cause(spec, options, message):
    with pytest.raises(DataError, match=message):
        load_dataset(spec, **options)


@pytest.mark.parametrize("bad, message", [
    (dict(num_classes=1), "num_classes must be an integer >= 2"),
    (dict(input_shape=(1, 4)), r"input_shape must be \(C, H, W\)"),
    (dict(test_x=np.zeros((0, 1, 4, 4), np.float32), test_y=np.zeros(0, np.int64)), "the test split is empty"),
    (dict(test_y=np.full(10, -1, np.int64)), "test_y holds labels -1..-1, outside 0..2"),
])
def test_dataset_record_rejects_what_training_cannot_use(bad, message):
    fields = dict(name="t", train_x=np.zeros((10, 1, 4, 4), np.float32), train_y=np.zeros(10, np.int64),
                  test_x=np.zeros((10, 1, 4, 4), np.float32), test_y=np.zeros(10, np.int64),
                  num_classes=3, input_shape=(1, 4, 4))
    fields.update(bad)
    with pytest.raises(DataError, match=message):
        Dataset(**fields)


# ---- under mpiexec ----------------------------------------------------------------------

@pytest.fixture
def plugin_env(mpi_env):
    paths = [str(REPO / "examples" / "plugins"), str(REPO / "tests"), mpi_env.get("PYTHONPATH", "")]
    return dict(mpi_env, PYTHONPATH=os.pathsep.join(p for p in paths if p))


@pytest.mark.mpi
def test_worked_plugin_example_trains_under_mpiexec(tmp_path, plugin_env):
    trace = tmp_path / "bars.h5"
    result = run_mpi(3, ["train", "--config", str(REPO / "examples" / "plugins" / "bars.toml"),
                         "--trace", str(trace), "--iterations", "120", "--eval-every", "60",
                         "--checksum-every", "20"], plugin_env, timeout=400)
    assert result.returncode == 0, result.stderr
    assert "model bars:make_model on bars: 2000 train / 500 test, 1x12x12, 4 classes" in result.stdout
    tr = load(trace)
    assert tr.config["model"] == "bars:make_model" and tr.config["data"] == "bars:load_bars"
    # Four classes: chance is 0.25. The model has BatchNorm: rank 0 evaluates with the
    # workers' averaged running statistics.
    assert tr.eval["test_accuracy"].iloc[-1] > 0.6, tr.eval
    assert list(tr.checksums["iteration"]) == [0, 20, 40, 60, 80, 100]
    assert tr.checksums.filter(like="checksum").nunique(axis=1).eq(1).all()


@pytest.mark.mpi
@pytest.mark.parametrize("args, message", [
    (["--model", "bars:nope"], "mpigrad train: error: bars:nope: module 'bars' has no attribute 'nope'"),
    (["--data", "plugin_factories:data_as_dict"],
     "mpigrad train: error: data factory plugin_factories:data_as_dict returned dict, expected an mpigrad.data.Dataset"),
])
def test_a_bad_plugin_fails_before_training_with_one_line_and_exit_2(tmp_path, plugin_env, args, message):
    trace = tmp_path / "never.h5"
    started = time.monotonic()
    result = run_mpi(3, ["train", "--trace", str(trace), "--data", "bars:load_bars", *args], plugin_env,
                     timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == message
    assert not trace.exists()
    assert time.monotonic() - started < 240
