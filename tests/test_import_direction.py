"""Imports run one way (STYLE.md point 11): tasks call services, services send work through
``embeddings.dispatch``, which names tasks and never imports them; no module and no folder of the
app imports one that imports it back; the ground-floor libraries import nothing of the app.

Read from the source with ``ast`` (nothing is imported), counting imports inside functions too: a
deferred import is still a dependency, it only hides the circle from Python's import machinery.
Every module of the tree is read; Django's generated schema migrations (``embeddings/migrations/``)
alone are left out.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

#: The project's own top-level packages: the app, its Django project, and the ground floor.
PACKAGES = ("embeddings", "project", "workers", "queueing", "benchmarks", "scripts")

#: Plain libraries on the ground floor: no Django, Celery, Redis or app import, so they can be
#: run, tested and benchmarked alone. ``queueing`` is numbers in, numbers out.
GROUND = {
    "workers": ("embeddings", "project", "benchmarks", "scripts", "queueing", "django", "celery", "kombu", "redis"),
    "queueing": ("embeddings", "project", "benchmarks", "scripts", "workers", "django", "celery", "kombu", "redis",
                 "torch"),
}

#: Django's generated schema migrations: written by ``makemigrations``, never imported by the app.
GENERATED = ROOT / "embeddings" / "migrations"

#: The one arrow that runs back up between folders, as Django wires it: the project's URL table
#: (and the WSGI entry point) name the app's views, and the app reads the project's settings,
#: Celery app and lane names.
URL_WIRING = {("project", "embeddings")}


def modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if GENERATED in path.parents:
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def raw_imports(name: str, path: Path) -> set[str]:
    """Every dotted name module ``name`` imports anywhere in its body (functions too), relative
    imports resolved against its package; ``from a import b`` gives ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules that module ``name`` imports: ``a.b.c`` counts when it is a module,
    else its nearest enclosing module (``from a.b import name`` → ``a.b``)."""
    found: set[str] = set()
    for target in raw_imports(name, path):
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name and not (target in PACKAGES and target not in known):
            found.add(target)
    found.discard(name)
    return {t for t in found if not name.startswith(t + ".")}  # a package's own __init__ is no arrow


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


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Every import circle, as the strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
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


def rooms(graph: dict[str, set[str]], folder: str) -> dict[str, set[str]]:
    """The graph between the rooms of ``folder`` (a dotted package): each module inside it counts as
    its first part below ``folder`` (a file, or a sub-folder as a whole), arrows within one room
    dropped. A circle here is an arrow running back up between two rooms of that folder."""
    prefix = folder + "."

    def room(module: str) -> str | None:
        if not module.startswith(prefix):
            return None
        return prefix + module[len(prefix):].split(".")[0]

    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        src = room(module)
        if src is None:
            continue
        out.setdefault(src, set()).update(d for d in map(room, deps) if d is not None and d != src)
    return out


def folders() -> list[str]:
    """Every package of the app, ``embeddings`` itself included, as dotted names."""
    return sorted(".".join(p.relative_to(ROOT).parts) for p in [ROOT / "embeddings", *(ROOT / "embeddings").rglob("*")]
                  if p.is_dir() and (p / "__init__.py").exists() and p != GENERATED)


def test_the_reader_sees_the_imports_that_matter():
    """The walk itself: module- and function-level imports, ``from pkg import module`` resolved,
    every package read (the last guard skipped any path with a part named ``migrations``)."""
    graph = import_graph()
    assert "embeddings.services.queues.bulk" in graph["embeddings.tasks"]     # module level
    assert "embeddings.services.reconcile" in graph["embeddings.tasks"]       # inside a function
    assert "embeddings.dispatch" in graph["embeddings.services.catalogue.jobs"]  # inside job_create
    assert "embeddings.sink" in graph["embeddings.services.queues.bulk"]
    assert "embeddings.services.lifecycle.model_migrations" in graph
    assert "embeddings.api.model_migrations" in graph
    assert "embeddings.migrations" not in graph and not any(m.startswith("embeddings.migrations.") for m in graph)
    assert "queueing.wait_model" in graph["queueing.wait_ahead"]
    assert {"embeddings", "embeddings.services.catalogue", "embeddings.lane_control"} <= set(folders())


def test_no_service_imports_the_tasks_module():
    graph = import_graph()
    offenders = sorted(m for m, deps in graph.items()
                       if "embeddings.tasks" in deps and m != "embeddings.worker_boot" and m.startswith("embeddings.")
                       and not m.startswith(("embeddings.api", "embeddings.site", "embeddings.management")))
    assert offenders == []


def test_no_import_circle_anywhere():
    assert circles(import_graph()) == []


def test_no_arrow_runs_back_up_between_the_rooms_of_any_folder_of_the_app():
    """Inside each folder of ``embeddings/`` the files and sub-folders are layered: no two of them
    import each other, directly or round a circle."""
    graph = import_graph()
    found = {folder: c for folder in folders() if (c := circles(rooms(graph, folder)))}
    assert found == {}


def test_between_top_level_packages_only_djangos_url_wiring_runs_back_up():
    graph = import_graph()
    top = {p: set() for p in PACKAGES}
    for module, deps in graph.items():
        src = module.split(".")[0]
        top[src].update(d.split(".")[0] for d in deps if d.split(".")[0] != src)
    back = {(a, b) for a in top for b in top[a] if a in top[b]}
    assert {tuple(sorted(pair)) for pair in back} <= {tuple(sorted(p)) for p in URL_WIRING}


def test_ground_floor_packages_import_nothing_above_them():
    offenders = {}
    for name, path in modules().items():
        banned = GROUND.get(name.split(".")[0])
        if banned is None:
            continue
        bad = sorted(t for t in raw_imports(name, path) if t.split(".")[0] in banned)
        if bad:
            offenders[name] = bad
    assert offenders == {}


def test_a_circle_is_detected():
    """The checks fail on a circle (guards against a reader that silently sees nothing)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert cycle_through(graph, "d") is None
    assert circles(graph) == [{"a", "b", "c"}]
    layered = {"p.x.a": {"p.y.b"}, "p.y.b": {"p.x.c"}, "p.x.c": set()}  # no module circle, a room circle
    assert circles(layered) == []
    assert circles(rooms(layered, "p")) == [{"p.x", "p.y"}]
