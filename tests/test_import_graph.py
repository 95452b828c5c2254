"""mpigrad's import graph: no new import circle (module-level, lazy and inside functions
alike, and imports under ``if TYPE_CHECKING:`` too: a type's import is a dependency). The circles that
are still there are listed by name, so that one fixed must leave the list (the test fails
on a listed circle that is gone) and a new one fails the test (issue 61, item 1)."""

import ast
from pathlib import Path

import pytest

import mpigrad

pytestmark = pytest.mark.quick

ROOT = Path(mpigrad.__file__).parent

#: The circles left to break, each as the sorted modules of one strongly connected part.
KNOWN_CIRCLES: set[tuple[str, ...]] = set()
#: The runtime's circle (recipe -> script -> session -> recipe, and what joins it) is one
#: strongly connected part of many modules: it is known while it holds these, whatever else.
KNOWN_RUNTIME_CIRCLE = {"mpigrad.runtime.run.recipe", "mpigrad.runtime.run.script", "mpigrad.runtime.run.session"}


def module_imports() -> dict[str, set[str]]:
    """Each mpigrad module's imports of other mpigrad modules, a package's of its own
    submodules left out (a package importing its parts is no circle)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                edges |= {t for t in [target, *(f"{target}.{a.name}" for a in node.names)] if t in modules}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
        graph[name] = {t for t in edges if t != name and not t.startswith(name + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(tuple(sorted(part)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_but_the_known_ones():
    found = set(circles(module_imports()))
    runtime = {part for part in found if KNOWN_RUNTIME_CIRCLE <= set(part)}
    assert len(runtime) <= 1
    unknown = found - KNOWN_CIRCLES - runtime
    assert not unknown, f"new import circle(s): {sorted(unknown)}"
    fixed = KNOWN_CIRCLES - found
    assert not fixed, f"circle(s) gone: take them out of KNOWN_CIRCLES: {sorted(fixed)}"
    assert runtime, "the runtime's circle is gone: take KNOWN_RUNTIME_CIRCLE out"


def test_the_circle_finder_finds_a_lazy_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [("a", "b", "c")]
    edges = module_imports()
    assert "mpigrad.codecs.header" in edges["mpigrad.codecs.contract"]
    assert "mpigrad.codecs.contract" not in edges["mpigrad.codecs.header"]
    # a lazy import inside a function counts: bench.peers imports RunConfig that way
    assert "mpigrad.config" in edges["mpigrad.bench.peers"]
    assert "mpigrad.trace.reader" not in edges["mpigrad.trace.network"]
