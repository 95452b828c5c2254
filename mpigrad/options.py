"""Option values, one rule each: the integer check codecs, policies and models share, the
one check that refuses unknown option names (codec, policy, model and data options alike,
listing the valid ones), and the one ``KEY=VALUE`` parser (``--model-opt``, ``--data-opt``,
``--codec-opt``, ``--policy-opt``), and the one refusal to overwrite a result file
without ``--force`` (``check_overwrite``).

A leaf module: it imports nothing from mpigrad, and each caller passes its own error class
and message prefix, so a bad option still names its owner (``qsgd: bits ...``).
"""

from __future__ import annotations

import inspect
import json
import os
from numbers import Integral
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

__all__ = ["check_int", "check_bool", "check_keys", "keyword_names", "parse_value", "parse_assignments", "check_overwrite"]


def check_bool(name: str, value: Any, *, error: type[Exception] = ValueError, prefix: str = "") -> bool:
    """``value`` as a bool (a NumPy bool too); ``error`` otherwise, with the message
    ``{prefix}{name} must be true or false, got {value!r}``: 1, "yes" and "true" are refused."""
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")  # without importing it
    if not (isinstance(value, bool) or numpy_bool):
        raise error(f"{prefix}{name} must be true or false, got {value!r}")
    return bool(value)


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None, *,
              error: type[Exception] = ValueError, prefix: str = "") -> int:
    """``value`` as an int in [low, high] (either bound optional); ``error`` otherwise, with
    the message ``{prefix}{name} must be an integer{bounds}, got {value!r}``. Bools and
    floats are rejected, even 4.0: an option typed as a float is a mistake worth naming."""
    if isinstance(value, bool) or not isinstance(value, Integral) \
            or (low is not None and value < low) or (high is not None and value > high):
        raise error(f"{prefix}{name} must be an integer{_bounds(low, high)}, got {value!r}")
    return int(value)


def keyword_names(function: Callable[..., Any], *, exclude: Iterable[str] = ()) -> list[str] | None:
    """The names ``function`` (or a class's ``__init__``) takes as keywords, in signature
    order, less ``exclude``; None when it takes ``**kwargs`` or has no signature to read
    (then any name may be valid, and the call itself decides)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    excluded = set(exclude)
    return [p.name for p in parameters
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in excluded]


def check_keys(owner: str, given: Iterable[str], valid: Sequence[str] | None, *,
               error: type[Exception] = ValueError) -> None:
    """``error`` when ``given`` holds a name not in ``valid`` (None: any name), one line that
    names the unknown ones and lists the valid ones:
    ``codec 'qsgd': unknown option(s) bucket; valid: bits, levels, bucket_size, ...``."""
    if valid is None:
        return
    unknown = [key for key in given if key not in valid]
    if unknown:
        choices = f"valid: {', '.join(valid)}" if valid else "it takes no options"
        raise error(f"{owner}: unknown option(s) {', '.join(unknown)}; {choices}")


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


def check_overwrite(paths: Iterable[str | os.PathLike], force: bool, *, error: type[Exception] = ValueError,
                    alternative: str = "") -> None:
    """``error`` naming the first of ``paths`` that exists, unless ``force``: the one rule of
    every writer of result files (``train``'s trace, ``trace retime`` and ``trace export``,
    ``bench calibrate``, ``bench peers``, ``bench clock``), called before any work starts, so
    that a refusal writes nothing. One line: ``{path} exists; pass --force to overwrite
    it{alternative}`` (e.g. ``" or --trace to choose another"``)."""
    if force:
        return
    for path in paths:
        if Path(path).exists():
            raise error(f"{path} exists; pass --force to overwrite it{alternative}")
