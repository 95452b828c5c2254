"""Factories for the plugin tests: good ones and each way a factory can be wrong."""

import numpy as np
import torch
from torch import nn

from mpigrad.data import Dataset

NOT_CALLABLE = 42


class Linear(nn.Module):
    """Flatten and one linear layer; ``l2_parameters`` is its own choice."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(int(np.prod(input_shape)), num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))

    def l2_parameters(self):
        return [self.fc.bias]


def linear(*, input_shape, num_classes, seed, scale=1.0):
    model = Linear(input_shape, num_classes)
    with torch.no_grad():
        model.fc.weight.mul_(scale)
    return model


def plain_mlp(*, input_shape, num_classes, seed):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 16), nn.ReLU(),
                         nn.Linear(16, num_classes))


def seeded_by_argument(*, input_shape, num_classes, seed):
    """Draws its initial weights from ``seed`` with its own generator."""
    model = plain_mlp(input_shape=input_shape, num_classes=num_classes, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def returns_int(*, input_shape, num_classes, seed):
    return 3


def no_parameters(*, input_shape, num_classes, seed):
    return nn.Flatten()


def wrong_classes(*, input_shape, num_classes, seed):
    return plain_mlp(input_shape=input_shape, num_classes=num_classes + 1, seed=seed)


def wrong_input(*, input_shape, num_classes, seed):
    return nn.Sequential(nn.Flatten(), nn.Linear(5, num_classes))


def raises(*, input_shape, num_classes, seed):
    raise RuntimeError("no GPU here\nsecond line")


def no_seed(*, input_shape, num_classes):
    return plain_mlp(input_shape=input_shape, num_classes=num_classes, seed=0)


def tiny_data(*, data_dir=None, seed=0, size=40):
    rng = np.random.default_rng(seed)
    y = np.arange(size) % 3
    x = (rng.normal(size=(size, 1, 4, 4)) + y[:, None, None, None]).astype(np.float32)
    return Dataset("tiny", x, y.astype(np.int64), x[:10].copy(), y[:10].astype(np.int64), num_classes=3,
                   input_shape=(1, 4, 4))


def data_as_dict(*, data_dir=None, seed=0):
    return {"train_x": np.zeros((4, 1, 2, 2), np.float32)}


def data_bad_labels(*, data_dir=None, seed=0):
    x = np.zeros((4, 1, 2, 2), np.float32)
    return Dataset("bad", x, np.array([0, 1, 2, 5]), x, np.zeros(4, np.int64), num_classes=3,
                   input_shape=(1, 2, 2))
