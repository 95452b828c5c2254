"""mpigrad's import graph: no new import circle (module-level, lazy and inside functions
alike, and imports under ``if TYPE_CHECKING:`` too: a type's import is a dependency). The circles that
are still there are listed by name, so that one fixed must leave the list (the test fails
on a listed circle that is gone) and a new one fails the test (issue 61, item 1). And the
runtime's wings import downward only: plan < wire < measure < exchange < roles < run."""

import ast
from pathlib import Path

import pytest

import mpigrad

pytestmark = pytest.mark.quick

ROOT = Path(mpigrad.__file__).parent

#: The circles left to break, each as the sorted modules of one strongly connected part.
KNOWN_CIRCLES: set[tuple[str, ...]] = set()
#: The runtime's wings, lowest first: a module may import its own wing and those below.
WINGS = ("plan", "wire", "measure", "exchange", "roles", "run")


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
    unknown = found - KNOWN_CIRCLES
    assert not unknown, f"new import circle(s): {sorted(unknown)}"
    fixed = KNOWN_CIRCLES - found
    assert not fixed, f"circle(s) gone: take them out of KNOWN_CIRCLES: {sorted(fixed)}"


def wing(module: str) -> int | None:
    """The floor of a runtime module's wing (0 = plan), None outside the wings."""
    parts = module.split(".")
    if parts[:2] != ["mpigrad", "runtime"] or len(parts) < 3:
        return None
    return WINGS.index(parts[2]) if parts[2] in WINGS else None


def test_the_runtime_wings_import_downward_only():
    graph = module_imports()
    loose = sorted(m for m in graph if m.startswith("mpigrad.runtime.") and wing(m) is None)
    assert not loose, f"runtime modules outside the wings {WINGS}: {loose}"
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if wing(m) is not None
                    for t in targets if wing(t) is not None and wing(t) > wing(m))
    assert not upward, f"imports up the wings ({' < '.join(WINGS)}): {upward}"


def test_the_circle_finder_finds_a_lazy_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [("a", "b", "c")]
    edges = module_imports()
    assert "mpigrad.codecs.header" in edges["mpigrad.codecs.contract"]
    assert "mpigrad.codecs.contract" not in edges["mpigrad.codecs.header"]
    # a lazy import inside a function counts: bench.peers imports RunConfig that way
    assert "mpigrad.config" in edges["mpigrad.bench.peers"]
    assert "mpigrad.trace.reader" not in edges["mpigrad.trace.network"]
    # and the wing test sees a lazy upward import: session imports the roles below it
    assert wing("mpigrad.runtime.run.session") > wing("mpigrad.runtime.roles.server")
    assert "mpigrad.runtime.roles.server" in edges["mpigrad.runtime.run.session"]


def test_the_runtime_does_not_import_the_simulation():
    """mpigrad.simulate replays the runtime's messages (it imports the runtime's builders);
    the runtime never imports it, and its engine (the child process SimGrid runs in) imports
    neither the runtime nor the rest of the simulation."""
    graph = module_imports()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("mpigrad.runtime")
                    for t in targets if t.startswith("mpigrad.simulate"))
    assert not upward, f"the runtime imports the simulation: {upward}"
    engine = graph["mpigrad.simulate.engine"]
    assert engine <= {"mpigrad.errors", "mpigrad.simulate.simgrid_module"}, sorted(engine)
