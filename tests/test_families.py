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
    "ARRAY_METHODS",
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
    "CODE_MODULES",
    "PACKAGES",
    "exchange",
    "dtype_scope",
    "conj",
    "parts",
    "from_parts",
    "private_copy",
    "eval_shape",
    "laid_out_ravel",
    "x_refusal",
    "values",
    "opened",
    "traced",
    "contents",
    "describe",
    "trace_of",
}


def test_the_api_list_is_the_protocols() -> None:
    declared = {name for name in vars(_families.Family) if not name.startswith("_")}
    assert declared == API


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


def _complex_leaf(kind: str) -> object:
    values = np.array([1.0 + 2.0j, -3.0 + 0.5j])
    if kind == "python":
        return complex(values[0])
    if kind == "numpy":
        return values
    module = pytest.importorskip(kind)
    return module.numpy.asarray(values) if kind == "jax" else module.as_tensor(values)


@pytest.mark.parametrize("kind", ["python", "numpy", "torch", "jax"])
def test_a_family_takes_complex_numbers_apart_and_back(kind: str) -> None:
    leaf = _complex_leaf(kind)
    family = _families.by_kind(kind)
    expected = np.asarray(_arrays.to_numpy(leaf))
    re, im = family.parts(leaf)
    assert _arrays.kind(re) == _arrays.kind(leaf)
    np.testing.assert_array_equal(_arrays.to_numpy(re), expected.real)
    np.testing.assert_array_equal(_arrays.to_numpy(im), expected.imag)
    np.testing.assert_array_equal(_arrays.to_numpy(family.from_parts(re, im)), expected)
    np.testing.assert_array_equal(_arrays.to_numpy(family.conj(leaf)), expected.conj())


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_private_copy_is_the_callers_only_where_writes_go_unchecked(kind: str) -> None:
    module = pytest.importorskip(kind)
    leaf = module.ones(3) if kind == "torch" else np.ones(3)
    copy = _families.by_kind(kind).private_copy(leaf)
    assert (copy is not leaf) == (kind == "torch")  # (numpy: f gets read-only views instead)
    if kind == "torch":
        copy[0] = 5.0
        assert float(leaf[0]) == 1.0


def test_torch_takes_an_ml_dtypes_bfloat16_array_exactly() -> None:
    """torch.from_numpy refuses ml_dtypes' bfloat16 (which to_numpy gives once jax is imported):
    the checker's copies of a bfloat16 x raised torch's TypeError."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    leaf = torch.tensor([0.3, 0.7, -1.1], dtype=torch.bfloat16)
    family = _families.by_kind("torch")
    array = family.to_numpy(leaf)
    assert array.dtype.name == "bfloat16"
    for back in (family.from_numpy(array, None, None), family.from_numpy(array, leaf, None)):
        assert back.dtype == torch.bfloat16
        assert torch.equal(back, leaf)
    assert family.from_numpy(array, None, torch.float64).dtype == torch.float64
    assert torch.equal(family.as_own(array, _families.by_kind("numpy"), leaf, np.asarray), leaf)
