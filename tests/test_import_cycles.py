"""No import cycles in the package, counting every import statement: at module level, inside
functions and under ``TYPE_CHECKING``. (``lint-imports`` keeps the layers; it leaves the imports
made only for type checking out, and a cycle through a function's import or a type is still a
cycle of knowledge between two modules.)"""

from __future__ import annotations

import ast
from pathlib import Path

import diffiface

PACKAGE = Path(diffiface.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of the package, and the modules of the package its import statements name
    (``from . import name`` names the submodule where one is called so, else the package)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    source = ".".join([*base, node.module] if node.module else base)
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" for alias in node.names]
                targets = [target if target in paths else source for target in targets]
            for target in targets:
                while target and target not in paths:  # (import a.b.c names a module a.b.c or its package)
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_function_and_type_checking_imports() -> None:
    graph = import_graph()
    assert "diffiface._errors" in graph["diffiface._backends"]  # (module level)
    assert "diffiface._backends" in graph["diffiface._adapters._base"]  # (inside a function)
    # (a cycle made of any of them is found)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (each a set of modules that reach each other):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )
