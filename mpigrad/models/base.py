"""``ModelError`` and the option checks models share."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real

__all__ = ["ModelError", "check_int", "check_ints", "check_weight_decay"]


class ModelError(ValueError):
    """An unknown model name or invalid model options; the message says which."""


def check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ModelError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_ints(name: str, values, length: int) -> tuple[int, ...]:
    """``length`` positive integers from a sequence (not a string)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != length \
            or any(isinstance(v, bool) or not isinstance(v, Integral) or v < 1 for v in values):
        raise ModelError(f"{name} must be a sequence of {length} positive integers, got {values!r}")
    return tuple(int(v) for v in values)


def check_weight_decay(weight_decay) -> float:
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, Real) \
            or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ModelError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    return float(weight_decay)
