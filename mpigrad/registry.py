"""One registry for every kind of thing mpigrad looks up by name: codecs, policies, models
and data sets (and, through the same class, any later kind).

A :class:`Registry` holds the built-ins, registered at import (``register``), and, apart
from them, the plugins this process has loaded by spec (``package.module:Name``), so that
``names()`` and ``--help`` list mpigrad's own only. ``lookup(name)`` resolves a built-in's
name, a plugin spec (loaded and admitted once) or a loaded plugin's own name (what its
config says, so that a config read back builds the same class in a process that loaded it).

Plugin admission is written once, in :meth:`Registry.admit`: the spec loads (``plugins``),
the object is a subclass of the registry's base, it names itself with the id attribute (a
name of its own, not a spec), it implements every abstract method, the kind's own checks
(``admission``) hold, and no name or key it claims is taken by another class. Each refusal
is one line in the registry's error class, naming the spec.

A leaf module beside ``plugins``: it imports nothing else from mpigrad.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Generic, Iterable, TypeVar

from .plugins import is_plugin, load_factory

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names to the classes (or factories) of one kind.

    Hyperparameters: ``kind`` (``"codec"``: the word in messages), ``error`` (the kind's
    one-line error class), ``id_attr`` (the class attribute that names a class: ``codec_id``;
    None for a registry of factories named at registration), ``keys`` (further class
    attributes that must be unique among registered and loaded classes, each looked up by
    :meth:`by`: a codec's ``wire_id``), ``base`` and ``base_name`` (what a plugin must
    subclass, and how messages name it), ``admission`` (the kind's own checks of a plugin
    class, raising ``error``), ``plugin_hint`` (the unknown-name message's end, after the list
    of names: how it offers a plugin).
    State: the built-ins and the loaded plugins, by name and by each key."""

    def __init__(self, kind: str, error: type[Exception], *, id_attr: str | None = None, keys: Iterable[str] = (),
                 base: type | None = None, base_name: str = "", admission: Callable[[str, type], None] | None = None,
                 plugin_hint: str = ", or package.module:factory"):
        if (base is None) != (id_attr is None):
            raise ValueError("a registry of plugin classes needs both base and id_attr; one of factories neither")
        self.kind, self.error, self.id_attr, self.keys = kind, error, id_attr, tuple(keys)
        self.base, self.base_name, self.admission, self.plugin_hint = base, base_name, admission, plugin_hint
        self._builtin: dict[str, T] = {}
        self._plugins: dict[str, T] = {}
        self._builtin_keys: dict[str, dict[Any, T]] = {key: {} for key in self.keys}
        self._plugin_keys: dict[str, dict[Any, T]] = {key: {} for key in self.keys}

    def register(self, obj: T, name: str | None = None) -> T:
        """Add a built-in under ``name`` (default: its ``id_attr``) and its keys; ValueError
        (a bug in mpigrad, not the user's) where another object holds one of them. Returns
        ``obj``, so that it serves as a class decorator."""
        name = name if name is not None else getattr(obj, self.id_attr)
        tables = [(self._builtin, name, f"{self.kind} {name!r}")]
        tables += [(self._builtin_keys[key], getattr(obj, key), f"{self.kind} {key} {getattr(obj, key)!r}")
                   for key in self.keys]
        for table, value, what in tables:
            if value in table and table[value] is not obj:
                raise ValueError(f"{what} registered twice ({_qualname(table[value])}, {_qualname(obj)})")
        for table, value, _ in tables:
            table[value] = obj
        return obj

    def names(self) -> list[str]:
        """Sorted names of the built-ins (loaded plugins are not listed)."""
        return sorted(self._builtin)

    def lookup(self, name: Any) -> T:
        """The built-in ``name``, the plugin class a spec names (admitted on first use), or a
        loaded plugin's own name; ``error`` listing the built-ins otherwise."""
        if is_plugin(name):
            return self.admit(name)
        try:
            return self._builtin[name] if name in self._builtin else self._plugins[name]
        except (KeyError, TypeError):
            raise self.error(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}"
                             f"{self.plugin_hint}") from None

    def by(self, key: str, value: Any) -> T | None:
        """The built-in or loaded plugin whose attribute ``key`` is ``value`` (None: none here)."""
        return self._builtin_keys[key].get(value) or self._plugin_keys[key].get(value)

    def is_loaded_plugin(self, obj: Any) -> bool:
        """True where ``obj`` is a plugin class admitted in this process under its own name."""
        return self.id_attr is not None and self._plugins.get(getattr(obj, self.id_attr, None)) is obj

    def admit(self, spec: str) -> T:
        """Load the plugin class ``spec`` names and check it (one line in ``error`` for each
        breach); then register it under its own name and keys for this process."""
        cls = load_factory(spec, self.error)
        if self.base is None:
            raise ValueError(f"the {self.kind} registry holds factories: call plugins.load_factory")
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            what = f"the class {cls.__qualname__}" if isinstance(cls, type) else f"a {type(cls).__name__}"
            raise self.error(f"{self.kind} {spec} is {what}, not a subclass of {self.base_name}")
        name = cls.__dict__.get(self.id_attr)
        if not isinstance(name, str) or not name or is_plugin(name):
            raise self.error(f"{self.kind} {spec} must set {self.id_attr} = \"a-name-of-its-own\" (no ':')")
        if inspect.isabstract(cls):
            raise self.error(f"{self.kind} {spec} does not implement {', '.join(sorted(cls.__abstractmethods__))}")
        if self.admission is not None:
            self.admission(spec, cls)
        claims = [(self._builtin, name, self.id_attr), (self._plugins, name, self.id_attr)]
        claims += [(self._plugin_keys[key], getattr(cls, key, None), key) for key in self.keys]
        for table, value, what in claims:
            taken = table.get(value, cls)
            if taken is not cls:
                raise self.error(f"{self.kind} {spec}: {what} {value!r} is taken by {_qualname(taken)}")
        self._plugins[name] = cls
        for key in self.keys:
            self._plugin_keys[key][getattr(cls, key, None)] = cls
        return cls

    def plugins_loaded(self) -> tuple[dict[str, T], dict[str, dict[Any, T]]]:
        """A copy of the loaded plugins' tables (by name, and by each key), for
        :meth:`forget_plugins_since`; equal copies: the same plugins loaded."""
        return dict(self._plugins), {key: dict(table) for key, table in self._plugin_keys.items()}

    def forget_plugins_since(self, loaded: tuple[dict[str, T], dict[str, dict[Any, T]]]) -> None:
        """Put the loaded plugins back as :meth:`plugins_loaded` found them: a plugin admitted
        since is forgotten (a run that shares its process with the next admits its own)."""
        by_name, by_key = loaded
        self._plugins.clear()
        self._plugins.update(by_name)
        for key, table in self._plugin_keys.items():
            table.clear()
            table.update(by_key[key])


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
