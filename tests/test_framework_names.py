"""Framework names outside the family modules and the adapters (issue 39).

Each framework's knowledge belongs in its family module (``diffiface/_families``) and its
adapter (``diffiface/_adapters``, whose ``__init__`` is the registry); the rest of the package
dispatches by family. A module counts as naming a framework when it holds a string constant
that is a framework's name or a dotted module path under one (``"torch"``, ``"jax.numpy"``),
as a kind comparison or a ``sys.modules`` lookup does, or imports one (``import jax``; numpy,
the host every family converts through, may be imported anywhere). Prose in docstrings does not
count, nor does what a backend's config class declares of itself (:func:`_declared`): its
``name`` class variable, which is the registry's key for its engine (a row's name is its
config's: tests/test_backends.py, and the registry checks an installed engine's), and the values
its options' ``Literal`` types allow, with a default among them (AutoTorch's
``mode="autograd"`` is torch's autograd, not the autograd package).

A module that belongs to one framework says so by its file name: the name, less leading
underscores, is the framework's name or starts with it and an underscore (``_bridges/jax.py``,
``sparse/_torch_trace.py``). Such a module may name its own framework and that framework's
modules; any other framework it names counts, as in every generic module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import diffiface

PACKAGE = Path(diffiface.__file__).parent
EXEMPT = ("_families", "_adapters", "test")
"""Folders whose modules are a framework's own files, the registry or the scenario suite."""

_FRAMEWORKS = ("torch", "jax", "autograd", "numpy", "tensorflow", "pytensor", "mlx")
_NAME = re.compile(rf"({'|'.join(_FRAMEWORKS)})(\.\w+)*")


def _modules() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] not in EXEMPT:
            found.append(relative.as_posix())
    return found


def owner(module: str) -> str | None:
    """The framework that ``diffiface/<module>`` belongs to by its file name, or None (generic)."""
    word = Path(module).stem.lstrip("_").split("_")[0]
    return word if word in _FRAMEWORKS else None


def framework_names(module: str) -> int:
    """How many string constants in ``diffiface/<module>`` name a framework or its modules, other
    than the module's own framework (:func:`owner`)."""
    return count_names((PACKAGE / module).read_text(encoding="utf-8"), owner(module))


def count_names(source: str, own: str | None = None) -> int:
    """How many string constants and import statements in ``source`` name a framework other than
    ``own``, or its modules (numpy, the host every family converts through, is imported anywhere)."""
    return sum(
        1
        for name, imported in _named(ast.parse(source))
        if (found := _NAME.fullmatch(name)) and found.group(1) != own and not (imported and found.group(1) == _HOST)
    )


_HOST = "numpy"


def _named(tree: ast.AST) -> list[tuple[str, bool]]:
    """The strings, and the modules imported (``import jax``, ``from torch import nn``), each with
    whether it is imported; less those a backend's config class declares (:func:`_declared`)."""
    names = []
    declared = _declared(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node not in declared:
            names.append((node.value, False))
        elif isinstance(node, ast.Import):
            names.extend((alias.name, True) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names.append((node.module, True))
    return names


def _declared(tree: ast.AST) -> set[ast.Constant]:
    """The string constants that a class deriving from ``Backend`` declares in the annotated
    assignments of its body: the value of its ``name`` ClassVar, and the values of a field's
    ``Literal`` type with its default where that is one of them."""
    found: set[ast.Constant] = set()
    for cls in ast.walk(tree):
        if not (isinstance(cls, ast.ClassDef) and any(_is(base, "Backend") for base in cls.bases)):
            continue
        for statement in cls.body:
            if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name):
                continue
            annotation, value = statement.annotation, statement.value
            if statement.target.id == "name" and _subscript_of(annotation, "ClassVar"):
                if isinstance(value, ast.Constant):
                    found.add(value)
            elif _subscript_of(annotation, "Literal"):
                allowed = {n for n in ast.walk(annotation) if isinstance(n, ast.Constant)}
                found |= allowed
                if isinstance(value, ast.Constant) and value.value in {n.value for n in allowed}:
                    found.add(value)
    return found


def _is(node: ast.expr, name: str) -> bool:
    return (isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.Attribute) and node.attr == name)


def _subscript_of(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Subscript) and _is(node.value, name)


def test_the_counter_counts() -> None:
    tree = ast.parse('import sys\nif kind == "torch" or "jax.numpy" in sys.modules:\n    """torch, jax."""\n')
    counted = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and _NAME.fullmatch(n.value)
    ]
    assert counted == ["torch", "jax.numpy"]


def test_a_module_belongs_to_a_framework_by_its_file_name() -> None:
    assert owner("_bridges/jax.py") == "jax"
    assert owner("sparse/_torch_trace.py") == "torch"
    assert owner("sparse/_numpy_trace.py") == "numpy"
    assert owner("_jaxpr.py") is None  # a word that starts with a framework's name is not it
    assert owner("_bridges/__init__.py") is None
    assert owner("tree.py") is None
    source = 'import sys\nif kind == "torch" or "jax.numpy" in sys.modules:\n    """torch, jax."""\n'
    assert count_names(source) == 2
    assert count_names(source, own="jax") == 1  # its own framework's names are its own; torch's count
    assert count_names(source, own="torch") == 1
    assert count_names("import jax.numpy as jnp\nfrom torch import nn\nfrom . import jax\nimport numpy\n") == 2


def test_a_backend_declares_its_own_name_and_its_options_words() -> None:
    source = (
        "class AutoX(Backend):\n"
        '    name: ClassVar[str] = "torch"\n'
        '    mode: Literal["autograd", "func"] = "autograd"\n'
        '    arrays: str = "jax"\n'
        "    def check(self):\n"
        '        return self.mode == "autograd"\n'
        "class Plain:\n"
        '    name: ClassVar[str] = "torch"\n'
    )
    assert count_names(source) == 3  # a plain field's default, a comparison, a name outside a Backend


def test_the_modules_are_found() -> None:
    assert {"_arrays.py", "_backends.py", "_prep.py", "_bridges/jax.py"} <= set(_modules())
    assert not any(module.startswith(EXEMPT) for module in _modules())


@pytest.mark.parametrize("module", _modules())
def test_cleaned_modules_name_no_framework(module: str) -> None:
    assert framework_names(module) == 0, f"diffiface/{module} names a framework: move that branch to its family"
