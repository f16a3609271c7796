"""Imports in ``embeddings/`` run one way (issue 11, item 8; STYLE.md point 11): tasks call services,
services send work through ``embeddings.dispatch``, which names tasks and never imports them.

Read from the source with ``ast`` (nothing is imported), counting imports inside functions too: a
deferred import is still a dependency, it only hides the circle from Python's import machinery.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = "embeddings"


def modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package (migrations left out: generated)."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if "migrations" in rel.parts:
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its body (functions too).

    ``from a.b import c`` counts ``a.b.c`` when that is a module, else ``a.b``; relative imports are
    resolved against ``name``'s package.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import embeddings.services.x.y`` → its module
                target = target.rpartition(".")[0]
            if target and target != name and target != PACKAGE:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A shortest import circle from ``start`` back to itself (breadth first), or None."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for dep in sorted(graph.get(node, ())):
                if dep == start:
                    return paths[node] + [start]
                if dep not in paths:
                    paths[dep] = paths[node] + [dep]
                    nxt.append(dep)
        frontier = nxt
    return None


def test_the_reader_sees_the_imports_that_matter():
    """The walk itself: module- and function-level imports, ``from pkg import module`` resolved."""
    graph = import_graph()
    assert "embeddings.services.pipeline" in graph["embeddings.tasks"]       # module level
    assert "embeddings.services.reconcile" in graph["embeddings.tasks"]      # inside a function
    assert "embeddings.dispatch" in graph["embeddings.services.jobs"]        # inside job_dispatch
    assert "embeddings.services.sink" in graph["embeddings.services.pipeline"]


def test_no_service_imports_the_tasks_module():
    graph = import_graph()
    offenders = sorted(m for m, deps in graph.items()
                       if "embeddings.tasks" in deps and (m.startswith("embeddings.services") or m == "embeddings.dispatch"))
    assert offenders == []


def test_tasks_and_services_are_on_no_import_circle():
    """No circle passes through the tasks module, the dispatch module or any service that sends
    work (the circle of seven files the issue names ran tasks → pipeline → jobs → tasks)."""
    graph = import_graph()
    senders = ["embeddings.tasks", "embeddings.dispatch", "embeddings.services.sink", "embeddings.services.calls"]
    circles = {m: c for m in senders if (c := cycle_through(graph, m)) is not None}
    assert circles == {}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Every import circle, as the strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


#: The one circle left, not on the sending path: ``images`` (row services) dispatches a job's
#: re-queued copies and refreshes jobs through ``jobs``, which creates and cancels images through
#: ``images``. Breaking it means moving job dispatch below both; listed here so that it cannot grow
#: and any new circle fails.
KNOWN = [{"embeddings.services.images", "embeddings.services.jobs"}]


def test_no_import_circle_but_the_known_one():
    assert circles(import_graph()) == KNOWN


def test_a_circle_is_detected():
    """The check fails on a circle (guards against a reader that silently sees nothing)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert cycle_through(graph, "d") is None
    assert circles(graph) == [{"a", "b", "c"}]
