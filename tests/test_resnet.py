"""ResNet-20 and ResNet-18: sizes against the papers and torchvision, the sizing rule, options, learning."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mpigrad.data import load_dataset
from mpigrad.models import ModelError, ResNet18, ResNet20, available_models, build_model, check_model

CIFAR = (3, 32, 32)
DIGITS = (1, 8, 8)


def count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_registry_lists_both_resnets():
    assert {"resnet20", "resnet18", "paper-cnn"} <= set(available_models())
    assert isinstance(build_model("resnet20", input_shape=CIFAR, num_classes=10), ResNet20)
    assert isinstance(build_model("resnet18", input_shape=CIFAR, num_classes=10), ResNet18)


def test_resnet20_on_cifar_has_the_papers_parameter_count():
    # He et al. 2016, Table 6: ResNet-20 0.27M. With option-A shortcuts the count is exact:
    # stem 3*3*3*16 + 2*16; per block 2 convs 3x3 + 2 BN; fc 64*10 + 10.
    model = build_model("resnet20", input_shape=CIFAR, num_classes=10)
    convs = 3 * 3 * 3 * 16 + sum(9 * c_in * c + 9 * c * c + 4 * c
                                 for c_in, c in [(16, 16)] * 3 + [(16, 32)] + [(32, 32)] * 2
                                 + [(32, 64)] + [(64, 64)] * 2)
    assert count(model) == convs + 2 * 16 + 64 * 10 + 10 == 269_722
    # Deeper CIFAR ResNets from the same family (paper: ResNet-56 0.85M, ResNet-110 1.7M).
    assert count(build_model("resnet20", input_shape=CIFAR, num_classes=10, depth=56)) == 853_018
    assert 1.7e6 < count(build_model("resnet20", input_shape=CIFAR, num_classes=10, depth=110)) < 1.75e6


def test_resnet18_matches_torchvision_and_the_cifar_variant():
    # torchvision.models.resnet18(): 11,689,512 parameters at 3x224x224, 1000 classes.
    with torch.device("meta"):
        imagenet = build_model("resnet18", input_shape=(3, 224, 224), num_classes=1000)
    assert count(imagenet) == 11_689_512 and imagenet.imagenet_stem
    cifar = build_model("resnet18", input_shape=CIFAR, num_classes=10)
    assert not cifar.imagenet_stem
    # The CIFAR stem is a 3x3 conv instead of the 7x7 one; the fc has 10 outputs.
    assert count(cifar) == 11_689_512 - 7 * 7 * 3 * 64 + 3 * 3 * 3 * 64 - 512 * 990 - 990 == 11_173_962


@pytest.mark.parametrize("name", ["resnet20", "resnet18"])
@pytest.mark.parametrize("shape", [DIGITS, CIFAR, (1, 1, 1), (2, 5, 9), (3, 64, 64)])
def test_any_input_shape_gives_logits(name, shape):
    model = build_model(name, input_shape=shape, num_classes=7, seed=0, width=8, groups=4)
    model.train()
    assert model(torch.randn(3, *shape)).shape == (3, 7)


def test_stem_follows_the_input_size_unless_told():
    with torch.device("meta"):
        assert build_model("resnet18", input_shape=(3, 64, 64), num_classes=10).imagenet_stem
        assert not build_model("resnet18", input_shape=(3, 63, 64), num_classes=10).imagenet_stem
        assert build_model("resnet18", input_shape=CIFAR, num_classes=10, stem="imagenet").imagenet_stem
        assert not build_model("resnet18", input_shape=(3, 224, 224), num_classes=10, stem="cifar").imagenet_stem


def test_resnet20_stage_maps_halve_from_the_input():
    model = build_model("resnet20", input_shape=DIGITS, num_classes=10)
    x = model.stem(torch.zeros(2, *DIGITS))
    sides = []
    for stage in model.stages:
        x = stage(x)
        sides.append(tuple(x.shape[1:]))
    assert sides == [(16, 8, 8), (32, 4, 4), (64, 2, 2)]


def test_norm_options_decide_the_buffers():
    batch = build_model("resnet20", input_shape=DIGITS, num_classes=10)
    group = build_model("resnet20", input_shape=DIGITS, num_classes=10, norm="group")
    plain = build_model("resnet20", input_shape=DIGITS, num_classes=10, norm="none")
    # BatchNorm: running mean, var and batch counter per layer (19 layers); the others: none.
    assert sum(b.numel() for b in batch.buffers()) == 1395
    assert len(list(group.buffers())) == 0 and len(list(plain.buffers())) == 0
    assert count(group) == count(batch)
    assert any(isinstance(m, torch.nn.GroupNorm) for m in group.modules())
    assert not any(isinstance(m, (torch.nn.GroupNorm, torch.nn.BatchNorm2d)) for m in plain.modules())


def test_l2_covers_conv_and_linear_weights_only():
    model = build_model("resnet18", input_shape=CIFAR, num_classes=10)
    decayed = {id(p) for p in model.l2_parameters()}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.ndim > 1), name
    assert len(decayed) == 21  # 20 convolutions (17 3x3/7x7 + 3 projections) and the fc


def test_loss_is_cross_entropy_plus_the_l2_term():
    model = build_model("resnet20", input_shape=DIGITS, num_classes=10, seed=0)
    x, y = torch.randn(4, *DIGITS), torch.tensor([0, 1, 2, 3])
    logits = model(x)
    l2 = sum(float(w.detach().square().sum()) for w in model.l2_parameters()) / 2
    torch.testing.assert_close(model.loss(logits, y, 5e-4).item(),
                               F.cross_entropy(logits, y).item() + 5e-4 * l2, rtol=1e-5, atol=1e-6)


def test_initialisation_follows_torchvision_and_the_seed():
    a = build_model("resnet20", input_shape=CIFAR, num_classes=10, seed=3)
    b = build_model("resnet20", input_shape=CIFAR, num_classes=10, seed=3)
    c = build_model("resnet20", input_shape=CIFAR, num_classes=10, seed=4)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.stem[0].weight, c.stem[0].weight)
    conv = a.stages[2][1].conv2.weight  # 64 -> 64, 3x3: Kaiming fan-out std sqrt(2 / (64 * 9))
    assert abs(float(conv.detach().std()) - np.sqrt(2 / (64 * 9))) < 0.01
    assert torch.equal(a.stages[0][0].bn1.weight, torch.ones(16))


@pytest.mark.parametrize("name, options, message", [
    ("resnet20", dict(depth=21), "depth must be 6n"),
    ("resnet20", dict(depth=2), "depth must be an integer >= 8"),
    ("resnet20", dict(norm="layer"), "norm must be one of"),
    ("resnet20", dict(norm="group", groups=5), "groups=5 must divide"),
    ("resnet20", dict(width=0), "width"),
    ("resnet18", dict(stem="tiny"), "stem must be one of"),
    ("resnet18", dict(depth=20), r"model 'resnet18': unknown option\(s\) depth; valid: "),
    ("resnet18", dict(input_shape=(3, 32)), "input_shape"),
])
def test_bad_options_are_rejected_with_the_option_named(name, options, message):
    kwargs = dict(input_shape=CIFAR, num_classes=10)
    kwargs.update(options)
    with pytest.raises(ModelError, match=message):
        build_model(name, **kwargs)


@pytest.mark.parametrize("name", ["resnet20", "resnet18"])
def test_config_round_trips(name):
    model = build_model(name, input_shape=DIGITS, num_classes=10, norm="group", width=8, groups=4)
    config = model.get_config()
    assert config["id"] == name and config["norm"] == "group" and config["width"] == 8
    rebuilt = build_model(config.pop("id"), **config)
    assert [p.shape for p in rebuilt.parameters()] == [p.shape for p in model.parameters()]


def test_launch_check_builds_resnet18_on_the_meta_device_fast():
    check_model("resnet18", input_shape=(3, 224, 224), num_classes=1000)
    with pytest.raises(ModelError, match="stem"):
        check_model("resnet18", input_shape=CIFAR, num_classes=10, stem="big")


def test_resnet20_sgd_learns_digits_and_eval_needs_the_running_statistics():
    """Plain SGD on the digits: high test accuracy in eval mode, which reads the running
    statistics; with the initial statistics (what rank 0 would hold unsynchronised) it fails."""
    digits = load_dataset("digits", seed=0)
    model = build_model("resnet20", input_shape=DIGITS, num_classes=10, seed=0)
    fresh = build_model("resnet20", input_shape=DIGITS, num_classes=10, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    x, y = torch.from_numpy(digits.train_x), torch.from_numpy(digits.train_y)
    rng = np.random.default_rng(0)
    for _ in range(60):
        idx = torch.from_numpy(rng.choice(len(y), 64, replace=False))
        optimizer.zero_grad()
        model.loss(model(x[idx]), y[idx], 5e-4).backward()
        optimizer.step()
    test_x, test_y = torch.from_numpy(digits.test_x), digits.test_y
    model.eval()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1).numpy() == test_y).mean()
        fresh.load_state_dict({k: v for k, v in model.state_dict().items() if "running" not in k}, strict=False)
        fresh.eval()
        stale = (fresh(test_x).argmax(1).numpy() == test_y).mean()
    assert accuracy > 0.85, accuracy
    assert stale < accuracy - 0.2, (stale, accuracy)


@pytest.mark.parametrize("name", ["paper-cnn", "resnet20", "resnet18"])
def test_each_model_has_a_quick_config_that_loads_and_builds(name):
    from conftest import REPO
    from mpigrad.config import RunConfig
    from mpigrad.policies import get_policy

    path = REPO / "examples" / "models" / f"{name}.toml"
    config = RunConfig.from_sources(str(path), {})
    assert config.model == name and "# ranks: 4" in path.read_text()
    data = load_dataset(config.data, seed=config.seed, **config.data_opts)
    check_model(config.model, input_shape=data.input_shape, num_classes=data.num_classes, **config.model_opts)
    get_policy(config.policy_config(), n_layers=18, seed=config.seed)
