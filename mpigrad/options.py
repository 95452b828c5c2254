"""Option values, one rule each: the integer check codecs, policies and models share, and the
one ``KEY=VALUE`` parser (``--model-opt``, ``--data-opt``, ``--codec-opt``, ``--policy-opt``).

A leaf module: it imports nothing from mpigrad, and each caller passes its own error class
and message prefix, so a bad option still names its owner (``qsgd: bits ...``).
"""

from __future__ import annotations

import json
from numbers import Integral
from typing import Any

__all__ = ["check_int", "parse_value", "parse_assignments"]


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None, *,
              error: type[Exception] = ValueError, prefix: str = "") -> int:
    """``value`` as an int in [low, high] (either bound optional); ``error`` otherwise, with
    the message ``{prefix}{name} must be an integer{bounds}, got {value!r}``. Bools and
    floats are rejected, even 4.0: an option typed as a float is a mistake worth naming."""
    if isinstance(value, bool) or not isinstance(value, Integral) \
            or (low is not None and value < low) or (high is not None and value > high):
        raise error(f"{prefix}{name} must be an integer{_bounds(low, high)}, got {value!r}")
    return int(value)


def _bounds(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    return f" <= {high}" if high is not None else ""


def parse_value(text: str) -> Any:
    """A ``KEY=VALUE`` option's value: a JSON literal if it parses (``4``, ``0.5``,
    ``[64, 64]``, ``null``), ``true``/``false`` in any case, else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lowered = text.lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        return text


def parse_assignments(items: list[str] | None, what: str, *,
                      error: type[Exception] = ValueError) -> dict[str, Any] | None:
    """``["a=1", "b-c=x"]`` as ``{"a": 1, "b_c": "x"}`` (None for no items); ``error`` names
    ``what`` (the flag) and the item that is not ``KEY=VALUE``."""
    if not items:
        return None
    result = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise error(f"{what} expects KEY=VALUE, got {item!r}")
        result[key.strip().replace("-", "_")] = parse_value(value.strip())
    return result
