"""The guarantees of DESIGN.md section 1, one group each, on every backend."""

from __future__ import annotations

import gc
import weakref
from collections import namedtuple
from typing import Any

import numpy as np
import optree
import pytest
from conftest import BLACK_BOX, FIRST_ORDER, namespace, require, to_numpy

import diffiface as di

Pair = namedtuple("Pair", ["u", "v"])

TORCH_BACKENDS = ("torch-autograd", "torch-func", *BLACK_BOX)
JAX_BACKENDS = ("jax", *BLACK_BOX)


def loss(x: Any) -> Any:
    xp = namespace(x)
    return xp.sum(xp.sin(x) * x**2)


def uses_only_a(p: Any) -> Any:
    xp = namespace(p)
    return xp.sum(p["a"] ** 2)


def _all_operators(f: Any, backend: Any, x: Any, t: Any, *contexts: Any) -> list[Any]:
    """Every operator that applies to a scalar-valued f of an array x."""
    return [
        di.gradient(f, backend, x, *contexts),
        di.value_and_gradient(f, backend, x, *contexts),
        di.jacobian(f, backend, x, *contexts),
        di.hessian(f, backend, x, *contexts),
        di.value_gradient_and_hessian(f, backend, x, *contexts),
        di.jvp(f, backend, x, t, *contexts),
        di.vjp(f, backend, x, np.ones((), dtype=x.dtype) if isinstance(x, np.ndarray) else 1.0, *contexts),
        di.hvp(f, backend, x, t, *contexts),
        di.gradient_and_hvp(f, backend, x, t, *contexts),
    ]


# -- 1. results mirror inputs -------------------------------------------------------------------


def test_numpy_in_numpy_out(backend: Any) -> None:
    x = {"a": np.array([0.5, -1.0]), "b": [np.array([[1.0, 2.0]]), None], "c": Pair(np.array(0.3), None)}

    def f(p: Any) -> Any:
        xp = namespace(p)
        return xp.sum(p["a"] ** 2) + xp.sum(xp.sin(p["b"][0])) * p["c"].u

    g = di.gradient(f, backend, x)
    assert optree.tree_structure(g) == optree.tree_structure(x)
    for got, like in zip(optree.tree_leaves(g), optree.tree_leaves(x), strict=True):
        assert type(got) is np.ndarray
        assert got.shape == like.shape
        assert got.dtype == like.dtype


def test_python_float_in_python_float_out(backend: Any) -> None:
    f = lambda s: namespace(s).sin(s) * s  # noqa: E731
    assert type(di.gradient(f, backend, 0.7)) is float
    assert type(di.derivative(f, backend, 0.7)) is float
    assert type(di.second_derivative(f, backend, 0.7)) is float
    value, gradient = di.value_and_gradient(f, backend, 0.7)
    assert type(value) is float
    assert type(gradient) is float
    assert type(di.hessian(f, backend, 0.7)) is float
    tree = di.gradient(lambda p: p[0] * p[1] ** 2, backend, (1.5, 2.0))
    assert type(tree) is tuple
    assert all(type(leaf) is float for leaf in tree)
    assert np.allclose(tree, (4.0, 6.0))


def test_unused_inputs_get_zeros(backend: Any) -> None:
    x = {"a": np.array([1.0, 2.0]), "unused": np.array([3.0, 4.0, 5.0]), "also": 1.0}
    g = di.gradient(uses_only_a, backend, x)
    assert g["unused"] is not None
    assert isinstance(g["unused"], np.ndarray)
    # scipy's extrapolation leaves rounding noise where the exact difference is 0
    np.testing.assert_allclose(g["unused"], np.zeros(3), rtol=0, atol=1e-10 if backend.name == "scipy" else 0)
    assert abs(g["also"]) <= (1e-10 if backend.name == "scipy" else 0)
    assert type(g["also"]) is float
    np.testing.assert_allclose(g["a"], [2.0, 4.0], rtol=1e-6)
    jac = di.jacobian(lambda p: p["a"] * 2.0, backend, x)
    np.testing.assert_allclose(jac["unused"], np.zeros((2, 3)), rtol=0, atol=1e-10 if backend.name == "scipy" else 0)


@pytest.mark.parametrize("backend_name", TORCH_BACKENDS)
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_torch_in_torch_out(backend_name: str, dtype_name: str) -> None:
    backend = require(backend_name)
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)
    x = {"w": torch.tensor([0.5, -1.0], dtype=dtype, requires_grad=True), "b": torch.tensor(0.2, dtype=dtype)}

    def f(p: Any) -> Any:
        return torch.sum(torch.sin(p["w"]) * p["b"])

    # x requires grad, but grad mode is off: the results are detached. (Under grad mode they keep
    # the graph x carries, for an outer differentiation: tests/test_torch_real_use.py.)
    with torch.no_grad():
        results = (di.gradient(f, backend, x), di.hvp(f, backend, x, {k: torch.ones_like(v) for k, v in x.items()}))
        jac = di.jacobian(lambda p: torch.sin(p["w"]) * p["b"], backend, x)
    for result in results:
        for key in x:
            assert isinstance(result[key], torch.Tensor)
            assert result[key].dtype == dtype
            assert not result[key].requires_grad
            assert result[key].grad_fn is None
    assert isinstance(jac["w"], torch.Tensor)
    assert jac["w"].shape == (2, 2)
    assert jac["w"].dtype == dtype
    assert not jac["w"].requires_grad


@pytest.mark.parametrize("backend_name", JAX_BACKENDS)
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_jax_in_jax_out(backend_name: str, dtype_name: str) -> None:
    backend = require(backend_name)
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    with jax.enable_x64(True):
        x = {"w": jnp.asarray([0.5, -1.0], dtype=dtype_name), "b": jnp.asarray(0.2, dtype=dtype_name)}
    g = di.gradient(lambda p: jnp.sum(jnp.sin(p["w"]) * p["b"]), backend, x)
    for key in x:
        assert isinstance(g[key], jax.Array)
        assert g[key].dtype == np.dtype(dtype_name)
        assert g[key].shape == x[key].shape
    np.testing.assert_allclose(
        np.asarray(g["w"]), np.cos([0.5, -1.0]) * 0.2, rtol=1e-3 if dtype_name == "float32" else 1e-7
    )


# -- 2. nothing is mutated ------------------------------------------------------------------------


def _snapshot(tree: Any) -> list[bytes]:
    return [to_numpy(leaf).tobytes() + str(to_numpy(leaf).dtype).encode() for leaf in optree.tree_leaves(tree)]


def test_inputs_and_constants_unchanged(backend: Any) -> None:
    x = np.array([0.3, -1.2, 2.0])
    a = np.array([[2.0, 1.0, 0.0], [0.5, 3.0, -1.0], [0.0, 0.25, 1.0]])
    before_x, before_a = _snapshot(x), _snapshot(a)

    def f(x: Any, a: Any) -> Any:
        xp = namespace(x)
        return 0.5 * xp.sum(x * xp.matmul(a, x)) + xp.sum(xp.sin(x))

    _all_operators(f, backend, x, np.ones(3), di.Constant(a))
    assert _snapshot(x) == before_x
    assert _snapshot(a) == before_a
    assert x.flags.writeable
    assert a.flags.writeable


@pytest.mark.parametrize("backend_name", BLACK_BOX)
def test_unchanged_when_f_raises_half_way(backend_name: str) -> None:
    backend = require(backend_name)
    x = np.array([0.3, -1.2, 2.0])
    constant = {"scale": np.array([1.0, 2.0, 3.0])}
    before = _snapshot((x, constant))
    calls = []

    class Boom(Exception):
        pass

    def f(x: Any, c: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise Boom("third call")
        return np.sum(x**2 * c["scale"])

    with pytest.raises(Boom):
        di.gradient(f, backend, x, di.Constant(constant))
    assert _snapshot((x, constant)) == before


@pytest.mark.parametrize("backend_name", TORCH_BACKENDS)
def test_torch_flags_grads_and_modules_unchanged(backend_name: str) -> None:
    backend = require(backend_name)
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    ).double()
    model.eval()  # f only reads the model: batch norm uses its running stats
    batch = torch.randn(5, 3, dtype=torch.float64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)  # requires_grad False
    before_x = x.detach().clone()

    def f(p: Any, model: Any, batch: Any) -> Any:
        with torch.no_grad() if not torch.is_grad_enabled() else torch.enable_grad():
            out = torch.func.functional_call(model, {}, (batch * p["x"] + p["y"],))
        return torch.sum(out**2)

    p = {"x": x, "y": y}
    t = {"x": torch.ones(3, dtype=torch.float64), "y": torch.ones(3, dtype=torch.float64)}
    di.gradient(f, backend, p, di.Constant(model), di.Constant(batch))
    di.hvp(f, backend, p, t, di.Constant(model), di.Constant(batch))
    assert x.grad is None
    assert y.grad is None
    assert x.requires_grad
    assert not y.requires_grad
    assert torch.equal(x.detach(), before_x)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), f"{name} changed"
    for name, parameter in model.named_parameters():
        assert parameter.grad is None, f"{name}.grad was set"
        assert parameter.requires_grad


# -- 3. no silent precision loss --------------------------------------------------------------------


def test_float64_stays_float64(backend: Any) -> None:
    seen = []

    def f(x: Any) -> Any:
        seen.append(str(getattr(x, "dtype", type(x))))
        return namespace(x).sum(x**2)

    x = np.array([1.0 + 1e-9, 3.0])
    g = di.gradient(f, backend, x)
    assert g.dtype == np.float64
    # 2 + 2e-9 is not a float32 number: the computation ran in float64.
    assert (
        abs(g[0] - (2.0 + 2e-9)) < 1e-12
        if backend.name not in ("finite_differences", "scipy")
        else abs(g[0] - 2) < 1e-6
    )
    assert all("32" not in dtype for dtype in seen), seen


@pytest.mark.parametrize("backend_name", ["jax", "jax-over-jax", "fd-over-jax"])
def test_jax_float64_is_scoped(backend_name: str) -> None:
    backend = require(backend_name)
    jax = pytest.importorskip("jax")
    assert not jax.config.read("jax_enable_x64")
    x = np.array([1.0 + 1e-9, 3.0])
    g = di.gradient(lambda x: jax.numpy.sum(x**2), backend, x)
    h = di.hessian(lambda x: jax.numpy.sum(x**3), backend, x)
    assert g.dtype == np.float64
    assert h.dtype == np.float64
    assert abs(g[0] - (2.0 + 2e-9)) < 1e-12
    assert not jax.config.read("jax_enable_x64")
    assert jax.numpy.ones(2).dtype == np.float32  # still the user's default


def test_float32_stays_float32(backend: Any) -> None:
    x = np.array([0.5, -1.0], dtype=np.float32)
    for result in _all_operators(loss, backend, x, np.ones(2, dtype=np.float32)):
        for leaf in optree.tree_leaves(result):
            assert to_numpy(leaf).dtype == np.float32, result


# -- 4. NaN propagates -----------------------------------------------------------------------------------


def test_nan_propagates(backend: Any) -> None:
    x = np.array([np.nan, 1.0])
    g = di.gradient(lambda x: namespace(x).sum(x**2), backend, x)
    assert np.isnan(g[0])
    h = di.hessian(lambda x: namespace(x).sum(x**3), backend, x)
    assert np.isnan(h[0, 0])


# -- 5. preparation is strict -----------------------------------------------------------------------------


def test_prep_mismatch_names_the_part(backend_id: str, backend: Any) -> None:
    x = np.array([0.5, -1.0])
    c = np.array([1.0, 2.0])

    def f(x: Any, c: Any) -> Any:
        return namespace(x).sum(x * c)

    prep = di.prepare_gradient(f, backend, x, di.Constant(c))

    def g(x: Any, c: Any) -> Any:
        return namespace(x).sum(x * c)

    other = next(b for name, b in FIRST_ORDER.items() if name != backend_id and di.available(b))
    cases = {
        "f": lambda: di.gradient(g, backend, x, di.Constant(c), prep=prep),
        "backend": lambda: di.gradient(f, other, x, di.Constant(c), prep=prep),
        "shape": lambda: di.gradient(f, backend, np.ones(3), di.Constant(np.ones(3)), prep=prep),
        "float32": lambda: di.gradient(f, backend, x.astype(np.float32), di.Constant(c), prep=prep),
        "structure": lambda: di.gradient(f, backend, [x], di.Constant(c), prep=prep),
        "context 0": lambda: di.gradient(f, backend, x, di.Constant(np.ones(3)), prep=prep),
        "contexts": lambda: di.gradient(f, backend, x, prep=prep),
    }
    for part, bad_call in cases.items():
        with pytest.raises(di.PreparationMismatchError, match=part):
            bad_call()


def test_non_strict_prep_prepares_afresh(backend: Any) -> None:
    prep = di.prepare_gradient(loss, backend, np.array([0.5, -1.0]), strict=False)
    x = np.array([0.3, -1.2, 2.0])
    g = di.gradient(loss, backend, x, prep=prep)
    np.testing.assert_allclose(g, x**2 * np.cos(x) + 2 * x * np.sin(x), rtol=1e-6)
    g32 = di.gradient(loss, backend, x.astype(np.float32), prep=prep)
    assert g32.dtype == np.float32


# -- 7. finite differences on the input's own array type ------------------------------------------------------


@pytest.mark.parametrize("backend_name", BLACK_BOX)
def test_finite_differences_call_f_with_torch_tensors(backend_name: str) -> None:
    backend = require(backend_name)
    torch = pytest.importorskip("torch")
    seen = []

    def f(x: Any, c: Any) -> Any:
        seen.append((type(x), type(c), torch.is_grad_enabled(), x.dtype))
        return torch.sum(torch.sin(x) * c)

    x = torch.tensor([0.5, -1.0], dtype=torch.float64)
    g = di.gradient(f, backend, x, di.Constant(np.array([1.0, 2.0])))
    assert isinstance(g, torch.Tensor)
    torch.testing.assert_close(g, torch.cos(x) * torch.tensor([1.0, 2.0], dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert seen
    assert all(entry == (torch.Tensor, torch.Tensor, False, torch.float64) for entry in seen), set(seen)


@pytest.mark.parametrize("backend_name", BLACK_BOX)
def test_finite_differences_call_f_with_jax_arrays(backend_name: str) -> None:
    backend = require(backend_name)
    jax = pytest.importorskip("jax")
    seen = []

    def f(x: Any) -> Any:
        seen.append(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))
        return jax.numpy.sum(jax.numpy.sin(x))

    x = jax.numpy.asarray([0.5, -1.0])
    g = di.gradient(f, backend, x)
    assert isinstance(g, jax.Array)
    np.testing.assert_allclose(np.asarray(g), np.cos([0.5, -1.0]), rtol=1e-3)
    assert seen
    assert all(seen)


# -- the unprepared cache --------------------------------------------------------------------------------------


def test_unprepared_cache_traces_once() -> None:
    require("jax")
    jnp = pytest.importorskip("jax.numpy")
    calls = []

    def f(x: Any) -> Any:
        calls.append(1)
        return jnp.sum(x**2)

    x = np.array([1.0, 2.0])
    first = di.gradient(f, "jax", x)
    second = di.gradient(f, "jax", x + 1)
    assert len(calls) == 1
    np.testing.assert_allclose(first, 2 * x)
    np.testing.assert_allclose(second, 2 * (x + 1))
    di.gradient(f, "jax", np.ones(3))  # a new shape is a new signature
    assert len(calls) == 2


def test_cache_does_not_keep_f_alive(backend: Any) -> None:
    def make() -> Any:
        scale = np.array(2.0)

        def f(x: Any) -> Any:
            return namespace(x).sum(x**2) * float(scale)

        return f

    f = make()
    di.gradient(f, backend, np.array([1.0, 2.0]))
    di.hessian(f, backend, np.array([1.0, 2.0]))
    ref = weakref.ref(f)
    del f
    gc.collect()
    assert ref() is None
