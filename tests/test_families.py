"""The array families (diffiface/_families): one module per framework, the same API in each."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from diffiface import _arrays, _families
from diffiface._errors import UnsupportedOperationError

API = {
    "NAME",
    "ARRAY",
    "PASSED_THROUGH",
    "GRAPH",
    "owns",
    "signature",
    "numpy_like",
    "to_numpy",
    "from_numpy",
    "mirror",
    "as_own",
    "cast",
    "block_like",
    "layout",
    "same",
    "leaves_test",
    "jit_checked",
}


@pytest.mark.parametrize("family", _families.FAMILIES, ids=lambda f: f.NAME)
def test_every_family_has_the_one_api(family: _families.Family) -> None:
    missing = {name for name in API if not hasattr(family, name)}
    assert not missing, f"the {family.NAME} family lacks {sorted(missing)}"
    assert _families.by_kind(family.NAME) is family


def test_a_kind_without_a_family_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedOperationError, match="'theano'"):
        _arrays.by_kind("theano")


def test_each_leaf_finds_its_family() -> None:
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    leaves = {"python": 1.5, "numpy": np.float32(1.0), "torch": torch.ones(2), "jax": jnp.ones(2), "other": "text"}
    for kind, leaf in leaves.items():
        assert _arrays.kind(leaf) == kind
        family = _arrays.family_of(leaf)
        assert (family.NAME if family is not None else "other") == kind
        assert _arrays.leaf_signature(leaf)[0] == kind


def test_a_masked_array_is_refused() -> None:
    from diffiface._errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="masked"):
        _arrays.kind(np.ma.masked_array([1.0, 2.0], mask=[False, True]))


def test_finding_a_family_imports_no_framework() -> None:
    code = (
        "import sys, numpy as np\n"
        "from diffiface import _arrays\n"
        "for leaf in (np.ones(2), 1.0, 'text', object()):\n"
        "    _arrays.kind(leaf); _arrays.leaf_signature(leaf); _arrays.to_numpy(np.ones(1))\n"
        "print(sorted(m for m in ('torch', 'jax', 'autograd') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
