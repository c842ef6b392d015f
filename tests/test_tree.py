"""diffiface.tree: ravel and unravel round trips, paths, mixed frameworks."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np
import optree
import pytest
from conftest import require, to_numpy

import diffiface as di
from diffiface import tree

Pair = namedtuple("Pair", ["u", "v"])


def _assert_same(rebuilt: Any, original: Any) -> None:
    assert optree.tree_structure(rebuilt) == optree.tree_structure(original)
    for a, b in zip(optree.tree_leaves(rebuilt), optree.tree_leaves(original), strict=True):
        assert type(a) is type(b)
        if isinstance(b, float):
            assert a == b
            continue
        assert tuple(a.shape) == tuple(b.shape)
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def test_ravel_numpy_mixed_shapes_and_dtypes() -> None:
    params = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": [np.array([0.5, -1.0]), np.array(2.5)],
        "nt": Pair(np.zeros((0, 2)), None),
        "none": None,
    }
    flat, unravel = tree.ravel(params)
    assert isinstance(flat, np.ndarray)
    assert flat.shape == (9,)
    assert flat.dtype == np.float64
    _assert_same(unravel(flat), params)
    changed = unravel(flat + 1)
    assert changed["w"].dtype == np.float32
    np.testing.assert_array_equal(changed["b"][1], 3.5)


def test_ravel_python_floats() -> None:
    flat, unravel = tree.ravel((1.5, [2.0, None], {"x": 3.0}))
    assert isinstance(flat, np.ndarray)
    np.testing.assert_array_equal(flat, [1.5, 2.0, 3.0])
    rebuilt = unravel(flat * 2)
    assert rebuilt == (3.0, [4.0, None], {"x": 6.0})
    assert all(type(v) is float for v in optree.tree_leaves(rebuilt))


@pytest.mark.parametrize("empty", [(), [], {}, None, {"a": None, "b": ()}], ids=repr)
def test_ravel_empty_trees(empty: Any) -> None:
    flat, unravel = tree.ravel(empty)
    assert flat.shape == (0,)
    assert unravel(flat) == empty


def test_ravel_namedtuple() -> None:
    value = Pair(np.array([1.0, 2.0]), Pair(np.array(3.0), None))
    flat, unravel = tree.ravel(value)
    rebuilt = unravel(flat)
    assert type(rebuilt) is Pair
    assert type(rebuilt.v) is Pair
    _assert_same(rebuilt, value)


def test_ravel_torch() -> None:
    require("torch")
    import torch

    params = {"w": torch.ones(2, 2, dtype=torch.float32), "b": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    flat, unravel = tree.ravel(params)
    assert isinstance(flat, torch.Tensor)
    assert flat.shape == (6,)
    _assert_same(unravel(flat), params)


def test_ravel_jax() -> None:
    require("jax")
    import jax
    import jax.numpy as jnp

    params = {"w": jnp.ones((2, 2)), "b": [jnp.asarray([1.0, 2.0]), None]}
    flat, unravel = tree.ravel(params)
    assert isinstance(flat, jax.Array)
    assert flat.shape == (6,)
    _assert_same(unravel(flat), params)


def test_ravel_mixed_frameworks_raise() -> None:
    require("torch")
    import torch

    with pytest.raises(di.ArrayTypeError, match="one array framework"):
        tree.ravel({"a": np.ones(2), "b": torch.ones(2)})
    with pytest.raises(TypeError):  # an ArrayTypeError is a TypeError too
        tree.ravel([np.ones(2), torch.ones(2)])


def test_python_numbers_go_with_any_framework() -> None:
    require("torch")
    import torch

    flat, unravel = tree.ravel({"a": torch.ones(2, dtype=torch.float64), "s": 2.0})
    assert isinstance(flat, torch.Tensor)
    rebuilt = unravel(flat)
    assert type(rebuilt["s"]) is float
    assert rebuilt["s"] == 2.0


def test_unravel_checks_the_length() -> None:
    _, unravel = tree.ravel([np.ones(3)])
    with pytest.raises(di.InvalidInputError, match=r"\(3,\)"):
        unravel(np.ones(4))


def test_leaves_with_paths() -> None:
    value = {"layer": [np.ones(2), Pair(np.zeros(1), None)], "b": 1.0}
    paths = [path for path, _ in tree.leaves_with_paths(value)]
    assert paths == ["['b']", "['layer'][0]", "['layer'][1][0]"]
    assert tree.leaves_with_paths(np.ones(2))[0][0] == ""
    assert tree.path_string(("a", 0)) == "['a'][0]"


def test_map_flatten_structure() -> None:
    value = {"a": [np.ones(2), None], "b": (np.zeros(1),)}
    doubled = tree.map(lambda v: v * 2, value)
    np.testing.assert_array_equal(doubled["a"][0], [2.0, 2.0])
    assert doubled["a"][1] is None
    leaves, spec = tree.flatten(value)
    assert len(leaves) == 2
    assert spec == tree.structure(value)
    assert len(tree.leaves(value)) == 2


class _Affine:
    def __init__(self, slope: Any, offset: Any) -> None:
        self.slope, self.offset = slope, offset


optree.register_pytree_node(
    _Affine,
    lambda a: ((a.slope, a.offset), None, ("slope", "offset")),
    lambda _, children: _Affine(*children),
    namespace=di.tree.NAMESPACE,
)


@pytest.mark.parametrize("name", ["finite_differences", "jax", "torch", "autograd"])
def test_types_registered_in_the_diffiface_namespace(name: str) -> None:
    if not di.available(name):
        pytest.skip(f'{name} is not installed: pip install "diffiface[{name}]"')
    x = _Affine(np.ones(2), 2.0)
    g = di.gradient(lambda a: (a.slope**2).sum() + a.offset**3, name, x)
    assert isinstance(g, _Affine)
    np.testing.assert_allclose(g.slope, [2.0, 2.0], rtol=1e-6)
    assert isinstance(g.offset, float)
    np.testing.assert_allclose(g.offset, 12.0, rtol=1e-6)
    flat, unravel = di.tree.ravel(x)
    assert flat.shape == (3,)
    assert isinstance(unravel(flat), _Affine)


def test_pytrees_only_jax_knows_pass_through_the_jax_backend() -> None:
    """A jax-registered class (as a flax.struct or equinox module is) is a pytree node for
    diffiface too: the gradient has the same class, prepared or not, on jax and on finite
    differences, and a mismatch names the field."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")

    @jax.tree_util.register_pytree_node_class
    class Params:
        def __init__(self, w: Any, b: Any) -> None:
            self.w, self.b = w, b

        def tree_flatten(self) -> tuple[tuple[Any, Any], None]:
            return (self.w, self.b), None

        @classmethod
        def tree_unflatten(cls, _: None, children: Any) -> Params:
            return cls(*children)

    def loss(p: Any) -> Any:
        return jnp.sum(p["layer"].w ** 2) + 3.0 * jnp.sum(p["layer"].b)

    x = {"layer": Params(jnp.ones(3), jnp.zeros(2))}
    for backend in (di.AutoJAX(), di.AutoJAX(jit=False)):
        g = di.gradient(loss, backend, x)
        assert isinstance(g["layer"], Params)
        np.testing.assert_allclose(g["layer"].w, 2 * np.ones(3))
        np.testing.assert_allclose(g["layer"].b, 3 * np.ones(2))
        prep = di.prepare_gradient(loss, backend, x)
        again = di.gradient(loss, backend, x, prep=prep)
        np.testing.assert_allclose(again["layer"].w, g["layer"].w)
    with pytest.raises(di.PreparationMismatchError, match=r"x\['layer'\]\[0\].*\(3,\).*float32.*\(4,\)"):
        di.gradient(loss, di.AutoJAX(jit=False), {"layer": Params(jnp.ones(4), jnp.zeros(2))}, prep=prep)
    fd = di.gradient(loss, "finite_differences", x)
    assert isinstance(fd["layer"], Params)
    np.testing.assert_allclose(fd["layer"].w, 2 * np.ones(3), rtol=1e-2)
