"""Framework names outside the family modules and the adapters (issue 39).

Each framework's knowledge belongs in its family module (``diffiface/_families``) and its
adapter (``diffiface/_adapters``, whose ``__init__`` is the registry); the rest of the package
dispatches by family. A module counts as naming a framework when it holds a string constant
that is a framework's name or a dotted module path under one (``"torch"``, ``"jax.numpy"``),
as a kind comparison or a ``sys.modules`` lookup does. Prose in docstrings does not count.

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

_NAME = re.compile(r"(torch|jax|autograd|numpy)(\.\w+)*")

NOT_YET_CLEANED = (
    "_backends.py",
    "_bridges/__init__.py",
    "_bridges/_inner.py",
    "_bridges/jax.py",
    "_bridges/torch.py",
    "_call.py",
    "_checks.py",
    "_complex.py",
    "_keys.py",
    "_placement.py",
    "_prep.py",
    "_sparse_operators.py",
    "sparse/_detection.py",
    "sparse/_jaxpr.py",
    "sparse/_numpy_trace.py",
    "sparse/_torch_trace.py",
    "tree.py",
)
"""Modules that still name a framework, as paths under ``diffiface/``."""


def _modules() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] not in EXEMPT:
            found.append(relative.as_posix())
    return found


def framework_names(module: str) -> int:
    """How many string constants in ``diffiface/<module>`` name a framework or its modules."""
    tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.fullmatch(node.value)
    )


def test_the_counter_counts() -> None:
    tree = ast.parse('import sys\nif kind == "torch" or "jax.numpy" in sys.modules:\n    """torch, jax."""\n')
    counted = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and _NAME.fullmatch(n.value)
    ]
    assert counted == ["torch", "jax.numpy"]


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
