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


#: Where a private name may not be imported from: the project's packages and its tests.
OWN = (*PACKAGES, "tests")


def modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of ``packages`` (default: the project's)."""
    out = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            if GENERATED in path.parents:
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def from_module(node: ast.ImportFrom, package: str) -> str:
    """The dotted module a ``from ... import`` reads, a relative one resolved against ``package``
    (the importing module's package: ``from . import x`` in ``a.b.c`` reads ``a.b``)."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return base


def raw_imports(name: str, path: Path) -> set[str]:
    """Every dotted name module ``name`` imports anywhere in its body (functions too), relative
    imports resolved against its package; ``from a import b`` gives ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = from_module(node, package)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def private_imports(name: str, source: str, *, is_package: bool = False) -> list[str]:
    """``["module:_name", ...]``: every ``from module import _name`` (``as`` any alias, on one line
    or in parentheses over several, at module level or inside a function) in ``source``, the text of
    module ``name``, where ``module`` (relative imports resolved) is in one of :data:`OWN`. A leading
    underscore says "this module's own": another module that needs it needs a public name. Dunder
    names (``__version__``) are public.
    """
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = from_module(node, package)
            if base.split(".")[0] not in OWN:
                continue
            found += [f"{base}:{a.name}" for a in node.names
                      if a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__"))]
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
    assert "workers.model" in graph["embeddings.runtime"]                     # inside encoder_holder
    assert "embeddings.services.catalogue.images" in graph["embeddings.apps"]  # inside a signal handler
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


def test_no_module_imports_another_modules_private_name():
    """A ``_name`` is its module's own: no module of the project or its tests imports one
    from another of them."""
    offenders = {}
    for name, path in modules(OWN).items():
        found = private_imports(name, path.read_text(), is_package=path.name == "__init__.py")
        if found:
            offenders[name] = found
    assert offenders == {}


def test_a_private_import_is_detected():
    """The check fails on a private import, also in parentheses over several lines, aliased, relative,
    or inside a function (guards against a reader that silently sees nothing)."""
    source = """
from embeddings.api.search import parse_examples as _alias, SEARCH_FILES
from embeddings.api.search import (
    SearchView,
    _hidden as shown,
)
from . import _sibling
from ..services import _helper
from tests.conftest import __doc__, _fixture
from django.conf import _private_of_a_library


def f():
    from workers.vector_store import _inner
"""
    assert private_imports("embeddings.api.tokens", source) == [
        "embeddings.api.search:_hidden", "embeddings.api:_sibling", "embeddings.services:_helper",
        "tests.conftest:_fixture", "workers.vector_store:_inner"]
    assert private_imports("embeddings.api", "from . import _x", is_package=True) == ["embeddings.api:_x"]


#: Imports inside functions in ``embeddings/``: each would load torch in the web process or touch
#: Django's app registry before it is ready, and says so in a ``deferred: ...`` comment.
DEFERRED_IMPORTS = 14


def deferred_imports(source: str) -> list[tuple[int, str]]:
    """``(line, the line's text)`` of every import statement inside a function of ``source``."""
    lines = source.splitlines()
    found = []

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child.lineno, lines[child.lineno - 1]))
            visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


def test_imports_sit_at_the_top_but_for_the_few_that_say_why():
    """An import inside a function hides who depends on whom; the ones left keep torch out of the web
    process or wait for the app registry, and the count only goes down."""
    found = {f"{name}:{line}": text.strip() for name, path in modules().items() if name.startswith("embeddings.")
             for line, text in deferred_imports(path.read_text())}
    assert {k: v for k, v in found.items() if "deferred: " not in v} == {}
    assert len(found) <= DEFERRED_IMPORTS, sorted(found)


def test_a_deferred_import_is_found():
    source = "import os\n\ndef f():\n    import json  # deferred: would load torch\n    def g():\n        from a import b\n"
    assert deferred_imports(source) == [(4, "    import json  # deferred: would load torch"), (6, "        from a import b")]
