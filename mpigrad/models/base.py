"""``ModelError``, the option checks models share, and ``Classifier``: the loss every model trains on."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real

import torch
import torch.nn.functional as F
from torch import nn

from .. import options

__all__ = ["ModelError", "Classifier", "check_int", "check_ints", "check_choice", "check_weight_decay",
           "half_squared_norm"]


class ModelError(ValueError):
    """An unknown model name or invalid model options; the message says which."""


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum`` (bools and floats rejected), else ModelError."""
    return options.check_int(name, value, minimum, error=ModelError)


def check_ints(name: str, values, length: int) -> tuple[int, ...]:
    """``length`` positive integers from a sequence (not a string)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != length \
            or any(isinstance(v, bool) or not isinstance(v, Integral) or v < 1 for v in values):
        raise ModelError(f"{name} must be a sequence of {length} positive integers, got {values!r}")
    return tuple(int(v) for v in values)


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ModelError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_weight_decay(weight_decay) -> float:
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, Real) \
            or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ModelError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    return float(weight_decay)


class _HalfSquaredNorm(torch.autograd.Function):
    """``sum(w**2) / 2`` whose backward is the single pass ``g * w``.

    Autograd's own ``square().sum()`` backward makes several passes over the weights
    (about 3x slower); ``vector_norm(w)**2`` is fast but off by ~5e-4 relative in float32.
    """

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return 0.5 * weight.square().sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (weight,) = ctx.saved_tensors
        return weight * grad


def half_squared_norm(weight: torch.Tensor) -> torch.Tensor:
    """Scalar ``sum(weight**2) / 2`` (TF's ``l2_loss``), differentiable once."""
    return _HalfSquaredNorm.apply(weight)


class Classifier(nn.Module):
    """A module mapping (N, C, H, W) float batches to (N, K) logits, with the training loss.

    ``loss`` is mean cross-entropy + ``weight_decay * sum(w**2) / 2`` over ``l2_parameters()``,
    whose gradient adds ``weight_decay * w``. The default ``l2_parameters`` are the weights of
    convolutions and linear layers (every parameter of two or more dimensions): biases and
    normalisation scales and shifts are not decayed, as in timm.
    """

    def l2_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.ndim > 1]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, weight_decay: float) -> torch.Tensor:
        """Scalar: mean cross-entropy + ``weight_decay * sum(w**2) / 2`` over ``l2_parameters()``."""
        weight_decay = check_weight_decay(weight_decay)
        loss = F.cross_entropy(logits, targets)
        if weight_decay:
            l2 = sum(half_squared_norm(w) for w in self.l2_parameters())
            loss = loss + weight_decay * l2
        return loss
