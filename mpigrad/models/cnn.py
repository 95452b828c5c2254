"""The CNN of MQGrad's experiments (Sec. 4.1), sized from the input shape.

Layers, for a C x H x W input and K classes (paper: 3 x 32 x 32, K = 10)::

    conv 5x5, C -> 64, 'SAME', ReLU      32 x 32
    max-pool 3x3 stride 2, 'VALID'       15 x 15
    LRN
    conv 5x5, 64 -> 64, 'SAME', ReLU     15 x 15
    LRN
    max-pool 3x3 stride 2, 'VALID'        7 x 7
    fc 64*7*7 = 3136 -> 2304, ReLU       (l2 term, quantized by MQGrad)
    fc 2304 -> 3840, ReLU                (l2 term, quantized by MQGrad)
    fc 3840 -> K                         logits

Tiny inputs: a pooling window never exceeds the feature map, it shrinks to
``min(3, size)`` along each axis (stride stays 2), so every stage keeps at least
1 x 1. An 8 x 8 digit goes 8 -> 3 -> 1 (flatten 64); a 4 x 4 input 4 -> 1 -> 1.

LRN follows the TF CIFAR-10 tutorial (``tf.nn.lrn(depth_radius=4, bias=1.0,
alpha=0.001 / 9, beta=0.75)``): TF divides by ``(bias + alpha * s)**beta`` where ``s`` is
the sum of squares over the 2 * 4 + 1 = 9 neighbouring channels; torch's
``LocalResponseNorm`` divides by ``(k + alpha / size * s)**beta``, so the same layer is
``size=9, alpha=0.001, beta=0.75, k=1.0``. At the channel edges both sum only the channels
that exist and keep the 1/9.

Loss: mean cross-entropy + ``weight_decay * sum(w**2) / 2`` over the weights of the two
big fully connected layers (biases excluded), i.e. TF's ``weight_decay * tf.nn.l2_loss(w)``,
whose gradient adds ``weight_decay * w``; the tutorial's value is 0.004
(``DEFAULT_WEIGHT_DECAY``). Parameters keep torch's default initialisation (scaled by each
layer's fan-in, deterministic under ``torch.manual_seed``), not the tutorial's fixed-std
truncated normals.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Classifier, check_int, check_ints, half_squared_norm

__all__ = ["PaperCNN", "DEFAULT_WEIGHT_DECAY", "pooled_size", "half_squared_norm"]

DEFAULT_WEIGHT_DECAY = 0.004
KERNEL_SIZE = 5
POOL_WINDOW = 3
POOL_STRIDE = 2
LRN = dict(size=9, alpha=0.001, beta=0.75, k=1.0)


def pooled_size(size: int) -> tuple[int, int]:
    """(window, output size) of one 3x3/2 'VALID' pooling axis of length ``size``."""
    window = min(POOL_WINDOW, size)
    return window, (size - window) // POOL_STRIDE + 1


class PaperCNN(Classifier):
    """MQGrad's 5-layer CNN for ``input_shape = (C, H, W)`` and ``num_classes`` classes.

    ``forward(x)`` maps a float (N, C, H, W) batch to (N, num_classes) logits.
    Invalid options raise ``ModelError`` (a ValueError).
    """

    model_id = "paper-cnn"

    def __init__(self, input_shape: Sequence[int], num_classes: int,
                 fc_sizes: Sequence[int] = (2304, 3840), conv_channels: int = 64):
        super().__init__()
        self.input_shape = check_ints("input_shape", input_shape, length=3)
        self.num_classes = check_int("num_classes", num_classes, minimum=2)
        self.fc_sizes = check_ints("fc_sizes", fc_sizes, length=2)
        self.conv_channels = check_int("conv_channels", conv_channels)

        channels, height, width = self.input_shape
        (pool1_h, height), (pool1_w, width) = pooled_size(height), pooled_size(width)
        (pool2_h, height), (pool2_w, width) = pooled_size(height), pooled_size(width)
        self.flat_features = self.conv_channels * height * width

        padding = KERNEL_SIZE // 2
        self.features = nn.Sequential(
            nn.Conv2d(channels, conv_channels, KERNEL_SIZE, padding=padding),
            nn.ReLU(),
            nn.MaxPool2d((pool1_h, pool1_w), stride=POOL_STRIDE),
            nn.LocalResponseNorm(**LRN),
            nn.Conv2d(conv_channels, conv_channels, KERNEL_SIZE, padding=padding),
            nn.ReLU(),
            nn.LocalResponseNorm(**LRN),
            nn.MaxPool2d((pool2_h, pool2_w), stride=POOL_STRIDE),
        )
        self.fc1 = nn.Linear(self.flat_features, self.fc_sizes[0])
        self.fc2 = nn.Linear(self.fc_sizes[0], self.fc_sizes[1])
        self.classifier = nn.Linear(self.fc_sizes[1], self.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.classifier(x)

    def l2_parameters(self) -> list[nn.Parameter]:
        """The tensors the l2 term covers: the weights of the two big fully connected layers."""
        return [self.fc1.weight, self.fc2.weight]

    def quantized_parameters(self) -> list[nn.Parameter]:
        """The tensors the paper quantizes (Sec. 4.1: "the third and fourth layers have about
        99.2% of the network parameters"): the weights of the two big fully connected layers.
        Their biases (fc_sizes[0] + fc_sizes[1] values) travel as float32 with the rest."""
        return [self.fc1.weight, self.fc2.weight]

    def get_config(self) -> dict:
        """JSON-able options; ``build_model(config.pop("id"), **config)`` rebuilds the architecture."""
        return {"id": self.model_id, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes, "fc_sizes": list(self.fc_sizes),
                "conv_channels": self.conv_channels}

    def extra_repr(self) -> str:
        return f"input_shape={self.input_shape}, flat_features={self.flat_features}"

