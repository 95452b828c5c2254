"""mpigrad.registry.Registry: the one registry of codecs, policies, models and data sets,
and the plugin admission written once (the kinds' own tests cover their messages)."""

import importlib
import sys
import textwrap

import pytest

from mpigrad.registry import Registry

pytestmark = pytest.mark.quick

BASE = textwrap.dedent("""
    from abc import ABC, abstractmethod

    class ThingError(ValueError):
        pass

    class Thing(ABC):
        thing_id = ""
        slot = 0

        @abstractmethod
        def run(self): ...
""")


@pytest.fixture(autouse=True)
def things(tmp_path, monkeypatch):
    """A kind of thing, in a module that the plugin modules import as the tests do."""
    global Thing, ThingError
    (tmp_path / "thing_base.py").write_text(BASE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("thing_base", "thing_plugins", "thing_plugins2"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    base = importlib.import_module("thing_base")
    Thing, ThingError = base.Thing, base.ThingError


def _registry():
    registry = Registry("thing", ThingError, id_attr="thing_id", keys=("slot",), base=Thing,
                        base_name="tests.Thing", plugin_hint=" (or package.module:Class)")

    @registry.register
    class One(Thing):
        thing_id, slot = "one", 1

        def run(self):
            return 1

    return registry, One


def test_built_ins_are_found_by_name_and_key_and_a_clash_is_refused():
    registry, one = _registry()
    assert registry.lookup("one") is one and registry.by("slot", 1) is one and registry.by("slot", 2) is None
    assert registry.names() == ["one"] and not registry.is_loaded_plugin(one)
    registry.register(one)  # the same class again: no clash
    other = type("Other", (one,), {"thing_id": "one", "slot": 3})
    with pytest.raises(ValueError, match="thing 'one' registered twice"):
        registry.register(other)
    same_slot = type("Same", (one,), {"thing_id": "two", "slot": 1})
    with pytest.raises(ValueError, match="thing slot 1 registered twice"):
        registry.register(same_slot)
    assert registry.lookup("one") is one and registry.by("slot", 1) is one  # a refused class leaves nothing
    with pytest.raises(ThingError, match=r"^unknown thing 'nope'; available: one \(or package.module:Class\)$"):
        registry.lookup("nope")
    with pytest.raises(ThingError, match="unknown thing"):
        registry.lookup(["unhashable"])


def test_a_plugin_is_admitted_once_apart_from_the_built_ins(tmp_path):
    (tmp_path / "thing_plugins.py").write_text(textwrap.dedent("""
        from thing_base import Thing

        class Good(Thing):
            thing_id, slot = "good", 7
            def run(self):
                return 7

        class Abstract(Thing):
            thing_id = "abstract"

        class Unnamed(Good):
            pass

        class Spec(Good):
            thing_id = "a:b"

        class Clash(Good):
            thing_id = "one"

        class SlotClash(Good):
            thing_id = "other"

        class NotAThing:
            thing_id = "x"

        value = 3
    """))
    registry, _ = _registry()
    good = registry.admit("thing_plugins:Good")
    assert registry.lookup("thing_plugins:Good") is good and registry.lookup("good") is good
    assert registry.is_loaded_plugin(good) and registry.by("slot", 7) is good and registry.names() == ["one"]
    for spec, message in [
        ("thing_plugins:Abstract", "thing thing_plugins:Abstract does not implement run"),
        ("thing_plugins:Unnamed", 'thing thing_plugins:Unnamed must set thing_id = "a-name-of-its-own"'),
        ("thing_plugins:Spec", "must set thing_id"),
        ("thing_plugins:Clash", "thing thing_plugins:Clash: thing_id .one. is taken by .*_registry.<locals>.One"),
        ("thing_plugins:SlotClash", "thing thing_plugins:SlotClash: slot 7 is taken by thing_plugins.Good"),
        ("thing_plugins:NotAThing", "is the class NotAThing, not a subclass of tests.Thing"),
        ("thing_plugins:value", "thing_plugins:value is a int, not a callable factory"),
        ("nomodule_xyz:Thing", "cannot import 'nomodule_xyz'"),
    ]:
        with pytest.raises(ThingError, match=message):
            registry.admit(spec)
    assert registry.lookup("good") is good and "other" not in registry._plugins


def test_a_kinds_own_admission_runs_after_the_shared_checks(tmp_path):
    (tmp_path / "thing_plugins2.py").write_text(textwrap.dedent("""
        from thing_base import Thing

        class Odd(Thing):
            thing_id, slot = "odd", 9
            def run(self):
                return 9
    """))
    seen = []

    def admission(spec, cls):
        seen.append((spec, cls.__name__))
        raise ThingError(f"thing {spec} has an odd slot")

    registry = Registry("thing", ThingError, id_attr="thing_id", keys=("slot",), base=Thing, base_name="Thing",
                        admission=admission)
    with pytest.raises(ThingError, match="thing thing_plugins2:Odd has an odd slot"):
        registry.admit("thing_plugins2:Odd")
    assert seen == [("thing_plugins2:Odd", "Odd")] and registry.by("slot", 9) is None


def test_a_registry_of_factories_names_each_at_registration():
    registry = Registry("model", ThingError)
    registry.register(len, "length")
    assert registry.lookup("length") is len and registry.names() == ["length"]
    with pytest.raises(ThingError, match=r"^unknown model 'x'; available: length, or package.module:factory$"):
        registry.lookup("x")
    with pytest.raises(ValueError, match="needs both base and id_attr"):
        Registry("thing", ThingError, id_attr="thing_id")
