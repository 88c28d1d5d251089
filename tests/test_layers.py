"""The layers of docs/DESIGN.md section 2, checked on the source: who may import whom.

Imports are read from the code (every ``import`` statement, in functions too;
those under ``if TYPE_CHECKING:`` do not run and do not count).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"millpond": ROOT / "client" / "millpond",
            "millpond_server": ROOT / "server" / "millpond_server"}


def modules() -> dict[str, Path]:
    found = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = [package, *path.relative_to(directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST):
    """Import nodes that execute (skipping ``if TYPE_CHECKING:`` bodies)."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = node.orelse
        pending.extend(children)


def imports_of(module: str) -> set[str]:
    """The project modules ``module`` imports."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # "from pkg import sub" imports the submodule pkg.sub when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        for name in names:
            while name and name not in MODULES:  # "import a.b.c" of a non-module attribute
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walker_sees_the_imports_it_should():
    """A check of the check: known edges are found, TYPE_CHECKING ones are not."""
    assert "millpond.core.fifo" in GRAPH["millpond.core.buffer"]
    assert "millpond.remote.connection" in GRAPH["millpond.client"]
    assert "millpond_server.operations" in GRAPH["millpond_server.service"]
    assert "millpond.client" not in GRAPH["millpond.remote.buffer"]  # only under TYPE_CHECKING
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_in_a_circle():
    assert cycles(GRAPH) == []


def test_the_engine_knows_nothing_of_grpc_protobuf_asyncio_or_sessions():
    allowed_project = ("millpond.core", "millpond.errors", "millpond._version")  # a constant
    for module, path in MODULES.items():
        if not module.startswith("millpond.core"):
            continue
        for node in _runtime_imports(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            for name in names:
                top = name.split(".")[0]
                assert top not in ("grpc", "google", "asyncio", "millpond_server"), (module, name)
        for imported in GRAPH[module]:
            assert imported.startswith(allowed_project), (module, imported)


def test_the_client_imports_no_server_module():
    for module, imported in GRAPH.items():
        if module.startswith("millpond."):
            assert not any(i.startswith("millpond_server") for i in imported), module


@pytest.mark.parametrize("entry", ["millpond_server.app", "millpond_server.cli"])
def test_the_daemon_does_not_load_the_client_library(entry):
    """``millpond serve`` imports the engine and the wire, not the client API."""
    code = (f"import sys, {entry}; from millpond_server.cli import cmd_serve; "
            "import millpond_server.app; "
            "print(' '.join(m for m in sys.modules if m.startswith('millpond')))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True, timeout=60).stdout.split())
    client_side = {"millpond.api", "millpond.client", "millpond.handle.buffer", "millpond.remote.buffer",
                   "millpond.remote.batcher", "millpond.remote.connection", "millpond.handle.sampler"}
    assert "millpond.core.buffer" in loaded
    assert not loaded & client_side, sorted(loaded & client_side)
