"""Residual networks: the CIFAR ResNet-20 of He et al. (2016) and torchvision's ResNet-18.

Both are sized from the input shape ``(C, H, W)``: the first convolution takes C channels,
stages halve the feature map with stride-2 convolutions (3x3, padding 1, so a side of 1
stays 1 and no input is too small), and a global average pool feeds the classifier, so any
H x W works. ResNet-20 on 3 x 32 x 32: maps 32 -> 16 -> 8, 0.27M parameters; on the 1 x 8 x 8
digits 8 -> 4 -> 2.

``resnet20`` (He et al., Sec. 4.2): 3x3 conv to ``width`` (16) channels, then three stages of
``(depth - 2) / 6`` basic blocks with ``width * (1, 2, 4)`` channels; shortcuts are identities,
subsampled and zero-padded in channels where a stage starts (the paper's option A, no
parameters). ``depth`` 32, 44, 56, 110 give the other CIFAR ResNets.

``resnet18`` (torchvision's layout): four stages of two basic blocks with ``width * (1, 2, 4,
8)`` channels (64..512), 1x1-conv + norm projection shortcuts where shape changes (option B).
The stem follows the input: the ImageNet stem (7x7/2 conv, 3x3/2 max-pool) for inputs of at
least 64 x 64, the usual CIFAR stem (3x3/1 conv, no pool) below, or as ``stem`` says. On
3 x 32 x 32 with 10 classes: 11.17M parameters.

Normalisation, ``norm``: ``"batch"`` (BatchNorm2d, the default, as in torchvision),
``"group"`` (GroupNorm with ``groups`` groups: no running statistics, nothing to synchronise
between replicas) or ``"none"``. Initialisation as torchvision: Kaiming-normal (fan-out)
convolutions, norm scales 1 and shifts 0, torch's default linear layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Classifier, ModelError, check_choice, check_int, check_ints

__all__ = ["ResNet20", "ResNet18", "NORMS", "STEMS"]

NORMS = ("batch", "group", "none")
STEMS = ("auto", "cifar", "imagenet")
#: Inputs at least this many pixels high and wide get the ImageNet stem under ``stem="auto"``.
IMAGENET_STEM_MIN_SIDE = 64


def _norm_layer(norm: str, channels: int, groups: int) -> nn.Module:
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    if norm == "group":
        return nn.GroupNorm(groups, channels)
    return nn.Identity()


class _BasicBlock(nn.Module):
    """conv3x3 (stride s) - norm - ReLU - conv3x3 - norm, plus the shortcut, then ReLU."""

    def __init__(self, in_channels: int, channels: int, stride: int, shortcut: str, norm: str, groups: int):
        super().__init__()
        bias = norm == "none"
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=bias)
        self.bn1 = _norm_layer(norm, channels, groups)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=bias)
        self.bn2 = _norm_layer(norm, channels, groups)
        self.stride = stride
        self.pad_channels = 0
        self.downsample = None
        if stride != 1 or in_channels != channels:
            if shortcut == "pad":
                self.pad_channels = channels - in_channels
            else:
                self.downsample = nn.Sequential(
                    nn.Conv2d(in_channels, channels, 1, stride=stride, bias=bias),
                    _norm_layer(norm, channels, groups))

    def _shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.downsample is not None:
            return self.downsample(x)
        if self.stride != 1:
            x = x[:, :, ::self.stride, ::self.stride]
        if self.pad_channels:
            half = self.pad_channels // 2
            x = F.pad(x, (0, 0, 0, 0, half, self.pad_channels - half))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self._shortcut(x))


class _ResNet(Classifier):
    """Stem, stages of basic blocks, global average pool, linear classifier."""

    model_id = ""

    def _build(self, input_shape, num_classes, norm: str, groups: int, width: int,
               stage_blocks: Sequence[int], shortcut: str, imagenet_stem: bool) -> None:
        self.input_shape = check_ints("input_shape", input_shape, length=3)
        self.num_classes = check_int("num_classes", num_classes, minimum=2)
        self.norm = check_choice("norm", norm, NORMS)
        self.groups = check_int("groups", groups)
        self.width = check_int("width", width)
        widths = [self.width * 2 ** i for i in range(len(stage_blocks))]
        if self.norm == "group" and any(w % self.groups for w in widths):
            raise ModelError(f"groups={self.groups} must divide every stage's channels {widths}")
        channels = self.input_shape[0]
        bias = self.norm == "none"
        if imagenet_stem:
            stem = [nn.Conv2d(channels, self.width, 7, stride=2, padding=3, bias=bias),
                    _norm_layer(self.norm, self.width, self.groups), nn.ReLU(inplace=True),
                    nn.MaxPool2d(3, stride=2, padding=1)]
        else:
            stem = [nn.Conv2d(channels, self.width, 3, padding=1, bias=bias),
                    _norm_layer(self.norm, self.width, self.groups), nn.ReLU(inplace=True)]
        self.stem = nn.Sequential(*stem)
        stages, in_channels = [], self.width
        for i, (blocks, out_channels) in enumerate(zip(stage_blocks, widths)):
            layers = []
            for b in range(blocks):
                stride = 2 if i > 0 and b == 0 else 1
                layers.append(_BasicBlock(in_channels, out_channels, stride, shortcut, self.norm, self.groups))
                in_channels = out_channels
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_channels, self.num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet20(_ResNet):
    """CIFAR ResNet of ``depth = 6n + 2`` layers (default 20) for ``input_shape = (C, H, W)``."""

    model_id = "resnet20"

    def __init__(self, input_shape: Sequence[int], num_classes: int, depth: int = 20, width: int = 16,
                 norm: str = "batch", groups: int = 8):
        super().__init__()
        self.depth = check_int("depth", depth, minimum=8)
        if (self.depth - 2) % 6:
            raise ModelError(f"depth must be 6n + 2 (20, 32, 44, 56, 110), got {depth!r}")
        n = (self.depth - 2) // 6
        self._build(input_shape, num_classes, norm, groups, width, (n, n, n), "pad", imagenet_stem=False)

    def get_config(self) -> dict:
        """JSON-able options; ``build_model(config.pop("id"), **config)`` rebuilds the architecture."""
        return {"id": self.model_id, "input_shape": list(self.input_shape), "num_classes": self.num_classes,
                "depth": self.depth, "width": self.width, "norm": self.norm, "groups": self.groups}


class ResNet18(_ResNet):
    """torchvision's ResNet-18 layout for ``input_shape = (C, H, W)``, its stem chosen by size."""

    model_id = "resnet18"

    def __init__(self, input_shape: Sequence[int], num_classes: int, width: int = 64, norm: str = "batch",
                 groups: int = 32, stem: str = "auto"):
        super().__init__()
        self.stem_kind = check_choice("stem", stem, STEMS)
        shape = check_ints("input_shape", input_shape, length=3)
        imagenet = stem == "imagenet" or (stem == "auto" and min(shape[1:]) >= IMAGENET_STEM_MIN_SIDE)
        self._build(shape, num_classes, norm, groups, width, (2, 2, 2, 2), "project", imagenet_stem=imagenet)
        self.imagenet_stem = imagenet

    def get_config(self) -> dict:
        """JSON-able options; ``build_model(config.pop("id"), **config)`` rebuilds the architecture."""
        return {"id": self.model_id, "input_shape": list(self.input_shape), "num_classes": self.num_classes,
                "width": self.width, "norm": self.norm, "groups": self.groups, "stem": self.stem_kind}

    def extra_repr(self) -> str:
        return f"input_shape={self.input_shape}, stem={'imagenet' if self.imagenet_stem else 'cifar'}"
