"""Imports go down only: every module of isagi/, storage/ and app/ belongs to one layer of the
order declared in docs/architecture.md (the ```layers block), and imports only from its own
layer or the layers below it, without a cycle.

The graph is read from the syntax tree of every module, so an import inside a function or
under ``TYPE_CHECKING`` counts as much as one at the top: each is a dependency of the
module. ``import a.b.c`` and ``from a.b import c`` are edges to the deepest of those that
is a module of the project; a relative import is resolved against its package.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> the package it installs as (pyproject.toml maps app/ and storage/ under isagi)
PACKAGES = {"isagi": "isagi", "storage": "isagi.storage", "app": "isagi.app"}
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def declared_layers() -> list[tuple[str, list[str]]]:
    """(layer name, module patterns), bottom layer first, from the architecture page."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    blocks = re.findall(r"^```layers\n(.*?)^```", text, flags=re.M | re.S)
    assert len(blocks) == 1, "docs/architecture.md declares the layer order in one ```layers block"
    layers = []
    for line in blocks[0].splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, *patterns = line.split()
            layers.append((name, patterns))
    return layers[::-1]  # the page lists the top layer first


def project_modules() -> dict[str, Path]:
    """module name -> file, for every module of the three packages (Alembic's scripts too)."""
    found: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder)
            parts = [*package.split("."), *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _deepest(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" for alias in node.names]
        for target in targets:
            if target.split(".")[0] == "isagi":
                hit = _deepest(target, modules)
                if hit is not None and hit != module:
                    out.add(hit)
    return out


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> list[int]:
    return [i for i, (_, patterns) in enumerate(layers) if any(fnmatch.fnmatchcase(module, p) for p in patterns)]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_every_module_is_in_exactly_one_layer(graph):
    layers = declared_layers()
    unplaced = sorted(m for m in graph if len(layer_of(m, layers)) != 1)
    assert not unplaced, f"declare each in one line of the ```layers block of docs/architecture.md: {unplaced}"


def test_imports_only_go_down(graph):
    layers = declared_layers()
    upward = []
    for module, targets in sorted(graph.items()):
        (mine,) = layer_of(module, layers) or [None]
        for target in sorted(targets):
            (theirs,) = layer_of(target, layers) or [None]
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{module} ({layers[mine][0]}) -> {target} ({layers[theirs][0]})")
    assert not upward, "imports that go up:\n" + "\n".join(upward)


def test_there_is_no_import_cycle(graph):
    # Tarjan's strongly connected components: any component of more than one module is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_storage_imports_nothing_from_isagi_but_errors_and_the_version(graph):
    allowed = {"isagi", "isagi.errors"}
    wrong = {m: sorted(t for t in ts if not t.startswith("isagi.storage") and t not in allowed)
             for m, ts in graph.items() if m.startswith("isagi.storage")}
    wrong = {m: ts for m, ts in wrong.items() if ts}
    assert not wrong, f"storage imports more of isagi than its errors and version: {wrong}"


def test_the_walk_sees_imports_inside_functions_and_relative_ones(tmp_path):
    modules = {"isagi.a": tmp_path / "a.py", "isagi.b": tmp_path / "b.py", "isagi.c": tmp_path / "c.py",
               "isagi.pkg": tmp_path / "pkg" / "__init__.py", "isagi.pkg.d": tmp_path / "pkg" / "d.py"}
    src = ("def f():\n    from isagi.b import thing\n    import isagi.c\n"
           "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from isagi.pkg import d\n")
    modules["isagi.a"].write_text(src)
    assert imports_of("isagi.a", modules["isagi.a"], modules) == {"isagi.b", "isagi.c", "isagi.pkg.d"}
    (tmp_path / "pkg").mkdir()
    modules["isagi.pkg"].write_text("from . import d\nfrom .. import b\n")
    assert imports_of("isagi.pkg", modules["isagi.pkg"], modules) == {"isagi.pkg.d", "isagi.b"}


def test_the_owner_of_work_without_a_login_is_named_once():
    """One owner constant: ``storage.owners.LOCAL_OWNER``; no other module spells its value
    (a second spelling drifts: a renamed owner would leave sessions nobody can open).
    Migrations keep the value they were written with, frozen as migrations must be."""
    from isagi.storage.owners import LOCAL_OWNER

    spelled = []
    for module, path in project_modules().items():
        if module == "isagi.storage.owners" or module.startswith("isagi.storage.migrations"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value == LOCAL_OWNER:
                spelled.append(f"{module}:{node.lineno}")
    assert not spelled, f"import LOCAL_OWNER from storage.owners instead: {spelled}"


def test_the_front_ends_reach_sessions_only_through_the_service(graph):
    """app/ (the page and the API) opens, saves and finds sessions through
    :class:`isagi.session.service.SessionService` alone: it imports neither the session files
    (:mod:`isagi.session.files`, the folder) nor anything of storage/ (the ``.miku`` format, the
    history store); a second way in would drift from the first (issue 38)."""
    banned = ("isagi.session.files", "isagi.session.folder")
    wrong = {m: sorted(t for t in ts if t in banned or t.startswith("isagi.storage"))
             for m, ts in graph.items() if m.startswith("isagi.app")}
    wrong = {m: ts for m, ts in wrong.items() if ts}
    assert not wrong, f"app/ reaches past the session service: {wrong}"


SEAMS = ("engine", "keep", "store", "lm", "profile", "safety", "registry", "session", "entry", "sessions")


def test_the_front_ends_use_typed_seams_not_getattr():
    """No ``getattr(x, ...)`` on the engine, the keeper, the store, the session or the registry
    in app/: their types say what they have, so a renamed attribute is a type error, not a
    silent default (issue 38). ``getattr`` stays for what app/ does not own (requests, files)."""
    found = []
    for module, path in project_modules().items():
        if not module.startswith("isagi.app"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
                target = ast.unparse(node.args[0])
                if any(re.search(rf"\b{s}\b", target) for s in SEAMS):
                    found.append(f"{module}:{node.lineno} getattr({target}, ...)")
    assert not found, f"use the typed attribute instead: {found}"
