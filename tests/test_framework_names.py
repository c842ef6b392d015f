"""Framework names outside the family modules and the adapters (issue 39).

Each framework's knowledge belongs in its family module (``diffiface/_families``) and its
adapter (``diffiface/_adapters``, whose ``__init__`` is the registry); the rest of the package
dispatches by family. A module counts as naming a framework when it holds a string constant
that is a framework's name or a dotted module path under one (``"torch"``, ``"jax.numpy"``),
as a kind comparison or a ``sys.modules`` lookup does, or imports one (``import jax``; numpy,
the host every family converts through, may be imported anywhere). Prose in docstrings does not
count.

A module that belongs to one framework says so by its file name: the name, less leading
underscores, is the framework's name or starts with it and an underscore (``_bridges/jax.py``,
``sparse/_torch_trace.py``). Such a module may name its own framework and that framework's
modules; any other framework it names counts, as in every generic module.

The modules not yet cleaned are listed in :data:`NOT_YET_CLEANED`; their test is a strict
xfail, so cleaning one without taking it off the list fails, and the list is how the rest of
issue 39 is tracked.
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

_FRAMEWORKS = ("torch", "jax", "autograd", "numpy")
_NAME = re.compile(rf"({'|'.join(_FRAMEWORKS)})(\.\w+)*")

NOT_YET_CLEANED = (
    "_backends.py",
    "_prep.py",
)
"""Modules that still name a framework, as paths under ``diffiface/``."""


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
    whether it is imported."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.append((node.value, False))
        elif isinstance(node, ast.Import):
            names.extend((alias.name, True) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names.append((node.module, True))
    return names


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


def test_the_list_names_existing_modules() -> None:
    assert set(NOT_YET_CLEANED) <= set(_modules())
    assert "_arrays.py" in _modules()


@pytest.mark.parametrize("module", [m for m in _modules() if m not in NOT_YET_CLEANED])
def test_cleaned_modules_name_no_framework(module: str) -> None:
    assert framework_names(module) == 0, f"diffiface/{module} names a framework: move that branch to its family"


@pytest.mark.xfail(strict=True, reason="issue 39: the module still names a framework")
@pytest.mark.parametrize("module", NOT_YET_CLEANED)
def test_modules_not_yet_cleaned(module: str, record_property: pytest.RecordProperty) -> None:
    count = framework_names(module)
    record_property("framework_names", count)
    print(f"diffiface/{module}: {count} framework names")
    assert count == 0
