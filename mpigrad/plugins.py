"""User factories named ``package.module:factory`` (``--model`` and ``--data`` plugins).

``load_factory`` imports the module and returns the callable; ``call_factory`` checks the
keyword arguments against its signature and calls it. Every failure becomes one line in
the caller's error class (``ModelError``, ``DataError``), naming the spec and the cause.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, Callable

__all__ = ["is_plugin", "load_factory", "call_factory"]

_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_plugin(name: Any) -> bool:
    """True for a ``module:attribute`` spec rather than a registry name."""
    return isinstance(name, str) and ":" in name


def load_factory(spec: str, error: type[Exception]) -> Callable[..., Any]:
    """The callable ``spec`` = ``package.module:factory`` (``factory`` may be dotted) names."""
    if not _SPEC.fullmatch(spec):
        raise error(f"{spec!r} is not of the form package.module:factory")
    module_name, _, attribute = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a plugin's import can fail in any way
        raise error(f"cannot import {module_name!r} for {spec}: {_describe(exc)} (the module must be "
                    "importable on every rank: installed, in the working directory, or on PYTHONPATH)") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise error(f"{spec}: module {module_name!r} has no attribute {attribute!r}") from None
    if not callable(target):
        raise error(f"{spec} is a {type(target).__name__}, not a callable factory")
    return target


def call_factory(spec: str, factory: Callable[..., Any], kwargs: dict[str, Any],
                 error: type[Exception]) -> Any:
    """``factory(**kwargs)``; a signature that does not take them, or any exception, is ``error``."""
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise error(f"factory {spec} cannot take {', '.join(sorted(kwargs))}: {exc}") from None
    except ValueError:  # no signature to inspect (some builtins): let the call decide
        pass
    try:
        return factory(**kwargs)
    except error as exc:
        raise error(f"factory {spec}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's code, reported in one line
        raise error(f"factory {spec} failed: {_describe(exc)}") from None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
