"""Option values, one rule each: the integer check codecs, policies and models share, the
one check that refuses unknown option names (codec, policy, model and data options alike,
listing the valid ones), and the one ``KEY=VALUE`` parser (``--model-opt``, ``--data-opt``,
``--codec-opt``, ``--policy-opt``), and the one refusal to overwrite a result file
without ``--force`` (``check_overwrite``), and the check of options' values against a
signature (``check_values``: an optimizer's or a schedule's options, by the types of their
parameters).

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

__all__ = ["check_int", "check_bool", "check_keys", "keyword_names", "check_values", "parse_value", "parse_assignments",
           "check_overwrite"]


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


def check_values(owner: str, function: Callable[..., Any], given: dict[str, Any], *,
                 error: type[Exception] = ValueError) -> None:
    """``error`` (one line) for the first value of ``given`` whose kind ``function``'s
    parameter of that name does not take: its annotation says the kind (``bool``, ``float``,
    ``int``, ``tuple[float, float]``, ``Iterable[int]``, ``Literal['min', 'max']``, unions of
    these, ``None`` among them), else the type of its default (a bool default takes a bool, a
    float one a number, an int one an integer, a tuple or list one a list of as many values
    of its elements' kinds). A float takes an int but never a bool; an int takes neither a
    bool nor a float (4.0). A parameter whose kind cannot be read (a callable, a class
    torch does not spell out, no annotation and no default, ``**kwargs``) is not checked:
    building and using the object decides. The message names the owner and the option:
    ``optimizer 'sgd': nesterov must be true or false, got 'yes'``."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return
    for name, value in given.items():
        parameter = parameters.get(name)
        if parameter is None or parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            continue
        kinds = _parameter_kinds(parameter)
        if kinds is None or any(_matches(kind, value) for kind in kinds):
            continue
        default = parameter.default if isinstance(parameter.default, (tuple, list)) else None
        raise error(f"{owner}: {name} must be {' or '.join(_describe(kind, default) for kind in kinds)}, "
                    f"got {value!r}")


#: A value's kind, as ``check_values`` reads it from a signature: ("bool",), ("int",),
#: ("float",), ("str",), ("none",), ("literal", values), ("tuple", [kind lists]) of a fixed
#: length, ("list", kind list) of any length; a kind list is the alternatives of a union.
_Kind = tuple


def _parameter_kinds(parameter: inspect.Parameter) -> list[_Kind] | None:
    """The kinds ``parameter`` takes (alternatives), None where it cannot be read."""
    annotation = parameter.annotation
    if annotation is not parameter.empty:
        text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        kinds = _parse_kinds(text.strip("'\"").replace("typing.", "").replace("torch.", ""))
        if kinds is not None:
            if parameter.default is None and ("none",) not in kinds:
                kinds.append(("none",))
            return kinds
    if parameter.default is parameter.empty:
        return None
    return _default_kinds(parameter.default)


def _default_kinds(default: Any) -> list[_Kind] | None:
    if default is None:
        return None  # None says nothing of what else it takes
    if isinstance(default, bool):
        return [("bool",)]
    if isinstance(default, Integral):
        return [("int",)]
    if isinstance(default, float):
        return [("float",)]
    if isinstance(default, str):
        return [("str",)]
    if isinstance(default, (tuple, list)) and default:
        elements = [_default_kinds(item) for item in default]
        if all(element is not None for element in elements):
            # 50 among floats, as in Rprop's step_sizes=(1e-06, 50): a number
            elements = [[("float",)] if kinds == [("int",)] and any(other == [("float",)] for other in elements)
                        else kinds for kinds in elements]
            return [("tuple", elements)]
    return None


def _split_top(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part.strip() for part in parts]


_NAMES = {"bool": ("bool",), "int": ("int",), "float": ("float",), "str": ("str",), "None": ("none",),
          "NoneType": ("none",)}


def _parse_kinds(text: str) -> list[_Kind] | None:
    """The kinds an annotation's text names, None where one alternative cannot be read."""
    text = text.strip()
    outer, _, inner = text.partition("[")
    if outer in ("Union", "Optional") and text.endswith("]"):
        kinds = [kind for part in _split_top(inner[:-1], ",") for kind in (_parse_kinds(part) or [None])]
        if outer == "Optional":
            kinds.append(("none",))
        return None if None in kinds else kinds
    alternatives = _split_top(text, "|")
    kinds: list[_Kind] = []
    for part in alternatives:
        if part == "Tensor":
            continue  # torch takes a tensor where a float goes; a command line gives none
        if part in _NAMES:
            kinds.append(_NAMES[part])
            continue
        outer, _, inner = part.partition("[")
        if not part.endswith("]"):
            return None
        inner = inner[:-1]
        if outer == "Literal":
            import ast
            try:
                kinds.append(("literal", tuple(ast.literal_eval(f"({inner},)"))))
            except (ValueError, SyntaxError):
                return None
        elif outer in ("tuple", "Tuple"):
            items = _split_top(inner, ",")
            if len(items) == 2 and items[1] == "...":
                element = _parse_kinds(items[0])
                if element is None:
                    return None
                kinds.append(("list", element))
            else:
                elements = [_parse_kinds(item) for item in items]
                if any(element is None for element in elements):
                    return None
                kinds.append(("tuple", elements))
        elif outer in ("list", "List", "Iterable", "Sequence"):
            element = _parse_kinds(inner)
            if element is None:
                return None
            kinds.append(("list", element))
        else:
            return None
    return kinds or None


def _matches(kind: _Kind, value: Any) -> bool:
    tag = kind[0]
    if tag == "bool":
        return isinstance(value, bool)
    if tag == "int":
        return isinstance(value, Integral) and not isinstance(value, bool)
    if tag == "float":
        return isinstance(value, (Integral, float)) and not isinstance(value, bool)
    if tag == "str":
        return isinstance(value, str)
    if tag == "none":
        return value is None
    if tag == "literal":
        return any(value == choice and type(value) is type(choice) for choice in kind[1])
    if not isinstance(value, (list, tuple)):
        return False
    if tag == "tuple":
        return len(value) == len(kind[1]) and all(any(_matches(k, item) for k in kinds)
                                                  for kinds, item in zip(kind[1], value))
    return all(any(_matches(k, item) for k in kind[1]) for item in value)  # "list"


def _describe(kind: _Kind, default: tuple | list | None = None) -> str:
    """``kind`` in words; ``default``: the parameter's (a tuple or list), the example."""
    tag = kind[0]
    if tag == "literal":
        return "one of " + ", ".join(map(repr, kind[1]))
    if tag == "tuple":
        described = [_element(kinds) for kinds in kind[1]]
        same = len(set(described)) == 1
        what = f"{len(described)} {described[0]}s" if same else ", ".join(described)
        example = (", ".join(map(json.dumps, default)) if default is not None and len(default) == len(kind[1])
                   else ", ".join(_example(kinds) for kinds in kind[1]))
        return f"a list of {what}, e.g. [{example}]"
    if tag == "list":
        return f"a list of {_element(kind[1])}s, e.g. [{_example(kind[1], 1)}, {_example(kind[1], 2)}]"
    return {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
            "none": "null"}[tag]


def _element(kinds: list[_Kind]) -> str:
    return " or ".join({"bool": "boolean", "int": "integer", "float": "number", "str": "string", "none": "null"}
                       .get(kind[0], "value") for kind in kinds)


def _example(kinds: list[_Kind], k: int = 1) -> str:
    return {"bool": "true", "int": str(100 * k), "float": str(0.1 * k), "str": '"x"'}.get(kinds[0][0], "...")


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
    """``error`` naming the first of ``paths`` that is a directory (``--force`` or not: a
    directory is never overwritten), or, unless ``force``, that exists: the one rule of
    every writer of result files (``train``'s trace, ``trace retime`` and ``trace export``,
    ``bench calibrate``, ``bench peers``, ``bench clock``), called before any work starts, so
    that a refusal writes nothing. One line: ``{path} is a directory, not a file: give the
    path of a file (in it or elsewhere)`` or ``{path} exists; pass --force to overwrite
    it{alternative}`` (e.g. ``" or --trace to choose another"``)."""
    paths = [Path(path) for path in paths]
    for path in paths:
        if path.is_dir():
            raise error(f"{path} is a directory, not a file: give the path of a file (in it or elsewhere)")
    if force:
        return
    for path in paths:
        if path.exists():
            raise error(f"{path} exists; pass --force to overwrite it{alternative}")
