"""Every operator on every backend, against hand-written analytic derivatives.

Each case is a function written once for every framework (through ``namespace``), an input,
and its derivatives worked out by hand in numpy: the gradient and the Hessian-vector product
for scalar functions, the Jacobian-vector product (and second derivative) for the others.
The expected result of every operator is built from these, shaped as diffiface promises.
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optree
import pytest
from conftest import (
    FIRST_ORDER,
    SECOND_ORDER,
    assert_tree_close,
    flat,
    namespace,
    nested,
    require,
    to_numpy,
    tolerance,
    unflat,
)

import diffiface as di

Pair = namedtuple("Pair", ["u", "v"])

# -- the functions and their derivatives, by hand ------------------------------------------------


def sum_sin(x: Any) -> Any:
    xp = namespace(x)
    return xp.sum(xp.sin(x) * x**2)


def sum_sin_grad(x: Any) -> Any:
    return x**2 * np.cos(x) + 2 * x * np.sin(x)


def sum_sin_hvp(x: Any, v: Any) -> Any:
    return ((2 - x**2) * np.sin(x) + 4 * x * np.cos(x)) * v


A = np.array([[2.0, 1.0, 0.0], [0.5, 3.0, -1.0], [0.0, 0.25, 1.0]])


def quadratic(x: Any, a: Any) -> Any:
    xp = namespace(x)  # (matmul, not @: TensorFlow's @ takes matrices only, its numpy's matmul vectors too)
    return 0.5 * xp.matmul(x, xp.matmul(a, x))


def exp_map(x: Any, c: float) -> Any:
    return namespace(x).exp(x) * c


def tree_loss(p: Any) -> Any:
    xp = namespace(p)
    w, s = p["w"]
    (b,) = p["b"]
    return s * xp.sum(w**2) + xp.sum(xp.sin(p["nt"].u)) + xp.sum(b**3) / 3


def tree_loss_grad(p: Any) -> Any:
    w, s = p["w"]
    (b,) = p["b"]
    return {"w": [2 * s * w, np.sum(w**2)], "nt": Pair(np.cos(p["nt"].u), None), "b": (b**2,), "skip": None}


def tree_loss_hvp(p: Any, v: Any) -> Any:
    w, s = p["w"]
    vw, vs = v["w"]
    (b,) = p["b"]
    (vb,) = v["b"]
    return {
        "w": [2 * s * vw + 2 * w * vs, 2 * np.sum(w * vw)],
        "nt": Pair(-np.sin(p["nt"].u) * v["nt"].u, None),
        "b": (2 * b * vb,),
        "skip": None,
    }


def tree_map_fn(p: Any) -> Any:
    xp = namespace(p)
    a, b = p["a"], p["nt"].u
    return {"sq": (a**2,), "mix": Pair(xp.sin(b) * xp.sum(a), None)}


def tree_map_value(p: Any) -> Any:
    a, b = p["a"], p["nt"].u
    return {"sq": (a**2,), "mix": Pair(np.sin(b) * np.sum(a), None)}


def tree_map_jvp(p: Any, t: Any) -> Any:
    a, b = p["a"], p["nt"].u
    ta, tb = t["a"], t["nt"].u
    return {"sq": (2 * a * ta,), "mix": Pair(np.cos(b) * tb * np.sum(a) + np.sin(b) * np.sum(ta), None)}


# -- cases ------------------------------------------------------------------------------------------


@dataclass
class Case:
    """``f(x, *contexts)``; ``scalar`` functions give ``grad`` and ``hvp``, the others ``value``,
    ``jvp`` and (for a scalar x) ``second``. Analytic functions take float64 numpy trees."""

    name: str
    f: Callable[..., Any]
    x: Callable[[Any], Any]
    """The input in a dtype."""
    scalar: bool
    contexts: Callable[[Any], tuple[Any, ...]] = lambda dtype: ()
    value: Callable[..., Any] | None = None
    grad: Callable[..., Any] | None = None
    hvp: Callable[..., Any] | None = None
    jvp: Callable[..., Any] | None = None
    second: Callable[..., Any] | None = None
    dtypes: tuple[Any, ...] = (np.float64, np.float32)
    python_float: bool = False
    tags: tuple[str, ...] = field(default=())


SHAPES = {
    "0d": np.array(0.7),
    "1d": np.array([0.3, -1.2, 2.0]),
    "2d": np.array([[0.5, -0.4], [1.1, 2.2], [0.1, -1.7]]),
    "empty": np.zeros(0),
}


def _sum_sin_case(label: str, value: Any) -> Case:
    return Case(
        f"sum_sin-{label}",
        sum_sin,
        (lambda dtype: value) if isinstance(value, float) else (lambda dtype: value.astype(dtype)),
        scalar=True,
        value=lambda x: np.sum(np.sin(x) * x**2),
        grad=sum_sin_grad,
        hvp=sum_sin_hvp,
        dtypes=(np.float64, np.float32) if label == "1d" else (np.float64,),
        python_float=isinstance(value, float),
    )


def _exp_map_case(label: str, value: Any) -> Case:
    return Case(
        f"exp_map-{label}",
        exp_map,
        (lambda dtype: value) if isinstance(value, float) else (lambda dtype: value.astype(dtype)),
        scalar=False,
        contexts=lambda dtype: (di.Constant(1.5),),
        value=lambda x: np.exp(x) * 1.5,
        jvp=lambda x, t: np.exp(x) * 1.5 * t,
        second=lambda x: np.exp(x) * 1.5,
        dtypes=(np.float64, np.float32) if label == "1d" else (np.float64,),
        python_float=isinstance(value, float),
    )


def _tree_x(dtype: Any) -> Any:
    return {
        "w": [np.array([0.4, -1.1], dtype=dtype), np.array(1.3, dtype=dtype)],
        "nt": Pair(np.array([[0.2, 0.9], [-0.6, 1.4]], dtype=dtype), None),
        "b": (np.array([1.0, -0.5, 0.25], dtype=dtype),),
        "skip": None,
    }


def _tree_map_x(dtype: Any) -> Any:
    return {"a": np.array([0.3, -0.8, 1.2], dtype=dtype), "nt": Pair(np.array([0.5, 2.0], dtype=dtype), None)}


CASES = [
    *(_sum_sin_case(label, value) for label, value in [("float", 0.7), *SHAPES.items()]),
    Case(
        "quadratic",
        quadratic,
        lambda dtype: np.array([0.5, -1.0, 2.0], dtype=dtype),
        scalar=True,
        contexts=lambda dtype: (di.Constant(A.astype(dtype)),),
        value=lambda x: 0.5 * x @ A @ x,
        grad=lambda x: 0.5 * (A + A.T) @ x,
        hvp=lambda x, v: 0.5 * (A + A.T) @ v,
    ),
    Case(
        "dict_pytree",
        tree_loss,
        _tree_x,
        scalar=True,
        value=lambda p: tree_loss(p),
        grad=tree_loss_grad,
        hvp=tree_loss_hvp,
    ),
    *(_exp_map_case(label, value) for label, value in [("float", 0.7), *SHAPES.items()]),
    Case("pytree_map", tree_map_fn, _tree_map_x, scalar=False, value=tree_map_value, jvp=tree_map_jvp),
]

FIRST = ("jacobian", "value_and_jacobian", "jvp", "value_and_jvp", "vjp", "value_and_vjp")
SCALAR_OUT = ("gradient", "value_and_gradient")
SECOND_SCALAR_OUT = ("hessian", "value_gradient_and_hessian", "hvp", "gradient_and_hvp")
SCALAR_IN = ("derivative", "value_and_derivative")
SECOND_SCALAR_IN = ("second_derivative", "value_derivative_and_second_derivative")
SECOND = SECOND_SCALAR_OUT + SECOND_SCALAR_IN


GRID_SECOND_ORDER = ("fd-over-torch", "jax-over-jax")
"""The combinations run over the whole grid; every one runs in test_second_order_combinations."""


def _is_scalar_input(case: Case) -> bool:
    return case.python_float or case.name.endswith("-0d")


def operators_of(case: Case) -> tuple[str, ...]:
    ops = FIRST
    if case.scalar:
        ops += SCALAR_OUT + SECOND_SCALAR_OUT
    if _is_scalar_input(case):
        ops += SCALAR_IN + SECOND_SCALAR_IN
    return ops


def _dtype_id(dtype: Any) -> str:
    return np.dtype(dtype).name


def _params() -> list[Any]:
    params = []
    for case in CASES:
        for op in operators_of(case):
            backends = [*FIRST_ORDER, *(GRID_SECOND_ORDER if op in SECOND else ())]
            for backend_id in backends:
                for dtype in case.dtypes:
                    suffix = "" if case.python_float else f"-{_dtype_id(dtype)}"
                    params.append(
                        pytest.param(op, backend_id, case, dtype, id=f"{op}-{backend_id}-{case.name}{suffix}")
                    )
    return params


# -- expected results ------------------------------------------------------------------------------


def tangent_like(tree: Any, dtype: Any, seed: float = 0.0) -> Any:
    """A fixed direction shaped as ``tree``."""
    vector = np.cos(np.arange(flat(tree).size) + 1.0 + seed)
    return unflat(vector, tree, dtype)


def expected(op: str, case: Case, x64: Any, t: Any) -> Any:
    """The result of ``op`` from the hand-written derivatives; ``t`` is the tangent (or cotangent)."""
    n = flat(x64).size
    basis = [unflat(np.eye(n)[k], x64) for k in range(n)]
    if case.scalar:
        assert case.grad is not None
        assert case.hvp is not None
        assert case.value is not None
        value = float(case.value(x64))
        g = flat(case.grad(x64))
        hess = np.stack([flat(case.hvp(x64, e)) for e in basis], axis=1) if n else np.zeros((0, 0))
        y, jac = value, g[None, :]
    else:
        assert case.value is not None
        assert case.jvp is not None
        y = case.value(x64)
        jac = np.stack([flat(case.jvp(x64, e)) for e in basis], axis=1) if n else np.zeros((flat(y).size, 0))
    jvp = unflat(jac @ flat(t), y) if op in ("jvp", "value_and_jvp") else None
    vjp = unflat(flat(t) @ jac, x64) if op in ("vjp", "value_and_vjp") else None
    results: dict[str, Any] = {
        "jacobian": nested(jac, y, x64),
        "jvp": jvp,
        "vjp": vjp,
    }
    if case.scalar:
        results["gradient"] = unflat(g, x64)
        results["hessian"] = nested(hess, x64, x64)
        if op in ("hvp", "gradient_and_hvp"):
            results["hvp"] = unflat(hess @ flat(t), x64)
    if _is_scalar_input(case):
        results["derivative"] = unflat(jac[:, 0], y)
        results["second_derivative"] = (
            unflat(hess[:, 0], y) if case.scalar else case.second(x64)  # type: ignore[misc]
        )
    table = {
        "value_and_gradient": ("value", "gradient"),
        "value_and_jacobian": ("value", "jacobian"),
        "value_gradient_and_hessian": ("value", "gradient", "hessian"),
        "value_and_jvp": ("value", "jvp"),
        "value_and_vjp": ("value", "vjp"),
        "gradient_and_hvp": ("gradient", "hvp"),
        "value_and_derivative": ("value", "derivative"),
        "value_derivative_and_second_derivative": ("value", "derivative", "second_derivative"),
    }
    results["value"] = y
    if op in table:
        return tuple(results[part] for part in table[op])
    return results[op]


def call(op: str, case: Case, backend: Any, x: Any, t: Any, contexts: tuple[Any, ...], **kwargs: Any) -> Any:
    operator = getattr(di, op)
    if op in ("jvp", "value_and_jvp", "vjp", "value_and_vjp", "hvp", "gradient_and_hvp"):
        return operator(case.f, backend, x, t, *contexts, **kwargs)
    return operator(case.f, backend, x, *contexts, **kwargs)


def tangent_for(op: str, case: Case, x: Any, dtype: Any) -> Any:
    if op in ("vjp", "value_and_vjp"):
        y = float(case.value(x)) if case.scalar else case.value(x)  # type: ignore[misc]
        like = y if not isinstance(y, float) or case.python_float else np.asarray(y)
        return tangent_like(like, dtype, seed=0.5)
    return tangent_like(x, dtype)


# -- the grid ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("op", "backend_id", "case", "dtype"), _params())
def test_operator(op: str, backend_id: str, case: Case, dtype: Any) -> None:
    backend = require(backend_id)
    x = case.x(dtype)
    x64 = case.x(np.float64)
    t = tangent_for(op, case, x, dtype)
    result = call(op, case, backend, x, t, case.contexts(dtype))
    want = expected(op, case, x64, optree.tree_map(lambda v: np.asarray(v, dtype=np.float64), t))
    rtol, atol = tolerance(backend_id, dtype, second_order=op in SECOND)
    assert_tree_close(result, want, rtol, atol, dtype=dtype)


# -- has_aux ------------------------------------------------------------------------------------------


def _with_aux(x: Any) -> Any:
    xp = namespace(x)
    y = xp.sin(x) * x**2
    return xp.sum(y), {"y": y, "label": "state"}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=_dtype_id)
def test_has_aux(backend_id: str, backend: Any, dtype: Any) -> None:
    x = SHAPES["1d"].astype(dtype)
    x64 = SHAPES["1d"]
    rtol, atol = tolerance(backend_id, dtype)
    y64 = np.sin(x64) * x64**2
    grad = sum_sin_grad(x64)

    (value, aux), g = di.value_and_gradient(_with_aux, backend, x, has_aux=True)
    assert aux["label"] == "state"
    assert_tree_close((value, aux["y"], g), (y64.sum(), y64, grad), rtol, atol, dtype=dtype)

    def pointwise(x: Any) -> Any:
        xp = namespace(x)
        return xp.sin(x) * x**2, {"total": xp.sum(x)}

    t = np.array([1.0, -2.0, 0.5], dtype=dtype)
    (y, aux), jvp = di.value_and_jvp(pointwise, backend, x, t, has_aux=True)
    jac = np.diag(sum_sin_grad(x64))
    assert_tree_close((y, aux["total"], jvp), (y64, x64.sum(), jac @ t.astype(np.float64)), rtol, atol, dtype=dtype)
    (y, aux), vjp = di.value_and_vjp(pointwise, backend, x, t, has_aux=True)
    assert_tree_close((y, aux["total"], vjp), (y64, x64.sum(), t.astype(np.float64) @ jac), rtol, atol, dtype=dtype)


# -- prepared and unprepared agree --------------------------------------------------------------------

PREPARED_OPS = ("gradient", "jacobian", "hessian", "jvp", "vjp", "hvp", "derivative", "second_derivative")


@pytest.mark.parametrize("op", PREPARED_OPS)
def test_prepared_equals_unprepared(backend_id: str, backend: Any, op: str) -> None:
    case = next(c for c in CASES if c.name == ("sum_sin-0d" if "derivative" in op else "sum_sin-1d"))
    x = case.x(np.float64)
    t = tangent_for(op, case, x, np.float64)
    contexts = case.contexts(np.float64)
    takes_tangent = op in ("jvp", "vjp", "hvp")
    prepare = getattr(di, f"prepare_{op}")
    prep = prepare(case.f, backend, x, t, *contexts) if takes_tangent else prepare(case.f, backend, x, *contexts)
    assert isinstance(prep, di.Prep)
    assert prep.operator == op
    prepared = call(op, case, backend, x, t, contexts, prep=prep)
    again = call(op, case, backend, x, t, contexts, prep=prep)
    unprepared = call(op, case, backend, x, t, contexts)
    for result in (again, unprepared):
        assert_tree_close(result, to_numpy(prepared), rtol=1e-12, atol=1e-12)


# -- engines against each other ------------------------------------------------------------------------


def test_torch_modes_agree() -> None:
    autograd_mode, func_mode = require("torch-autograd"), require("torch-func")
    x = _tree_x(np.float64)
    t = tangent_like(x, np.float64)
    for op in ("gradient", "hessian"):
        a = getattr(di, op)(tree_loss, autograd_mode, x)
        b = getattr(di, op)(tree_loss, func_mode, x)
        assert_tree_close(a, optree.tree_map(to_numpy, b), rtol=1e-12, atol=1e-12)
    a = di.gradient_and_hvp(tree_loss, autograd_mode, x, t)
    b = di.gradient_and_hvp(tree_loss, func_mode, x, t)
    assert_tree_close(a, optree.tree_map(to_numpy, b), rtol=1e-12, atol=1e-12)
    xm = _tree_map_x(np.float64)
    a = di.jacobian(tree_map_fn, autograd_mode, xm)
    b = di.jacobian(tree_map_fn, func_mode, xm)
    assert_tree_close(a, optree.tree_map(to_numpy, b), rtol=1e-12, atol=1e-12)


def _random_smooth(x: Any, weights: Any) -> Any:
    xp = namespace(x)
    hidden = xp.tanh(weights @ x)
    return xp.sum(hidden**2) + xp.sum(xp.cos(x) * x)


def test_all_backends_agree_on_a_random_smooth_function() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=5)
    weights = di.Constant(rng.normal(size=(4, 5)) / 2)
    results = {}
    for backend_id in (*FIRST_ORDER, *SECOND_ORDER):
        backend = ({**FIRST_ORDER, **SECOND_ORDER})[backend_id]
        if not di.available(backend):
            continue
        results[backend_id] = (
            di.gradient(_random_smooth, backend, x, weights),
            di.hessian(_random_smooth, backend, x, weights),
        )
    assert "finite_differences" in results
    reference = results.pop("jax", None) or results.pop("torch-autograd", None) or results.pop("finite_differences")
    for backend_id, (gradient, hessian) in results.items():
        rtol, atol = tolerance(backend_id, np.float64)
        assert_tree_close(gradient, reference[0], rtol, atol, dtype=np.float64)
        rtol, atol = tolerance(backend_id, np.float64, second_order=True)
        assert_tree_close(hessian, reference[1], rtol, atol, dtype=np.float64)


# -- finite-difference options -------------------------------------------------------------------------

FD_METHODS = {
    "central": (1e-8, 1e-3),
    "forward": (1e-6, 1e-2),
    "backward": (1e-6, 1e-2),
    "complex": (1e-12, 1e-5),
}


@pytest.mark.parametrize("method", list(FD_METHODS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=_dtype_id)
def test_finite_difference_methods(method: str, dtype: Any) -> None:
    tol = FD_METHODS[method][0 if dtype == np.float64 else 1]
    backend = di.AutoFiniteDifferences(method=method)
    x = SHAPES["2d"].astype(dtype)
    x64 = SHAPES["2d"]
    grad = sum_sin_grad(x64)
    assert_tree_close(di.gradient(sum_sin, backend, x), grad, tol, tol, dtype=dtype)
    t = np.cos(np.arange(6.0)).reshape(3, 2)
    assert_tree_close(
        di.jvp(exp_map, backend, x, t.astype(dtype), di.Constant(1.5)), np.exp(x64) * 1.5 * t, tol, tol, dtype=dtype
    )
    jacobian = di.jacobian(exp_map, backend, x, di.Constant(1.5))
    assert_tree_close(jacobian, np.diag((np.exp(x64) * 1.5).reshape(-1)).reshape(3, 2, 3, 2), tol, tol, dtype=dtype)
    value, derivative = di.value_and_derivative(
        lambda s: namespace(s).sin(s) * s, backend, dtype(0.7) if dtype == np.float32 else 0.7
    )
    assert math.isclose(float(derivative), math.cos(0.7) * 0.7 + math.sin(0.7), rel_tol=tol, abs_tol=tol)
    assert math.isclose(float(value), math.sin(0.7) * 0.7, rel_tol=1e-6)


@pytest.mark.parametrize("method", ["central", "forward", "backward", "complex"])
def test_finite_difference_fixed_step(method: str) -> None:
    """A fixed step of 1e-3 is used as given: the central error is h²/6 f''', the one-sided
    error h/2 f'' -- large enough to tell the step was used and not chosen."""
    h = 1e-3
    backend = di.AutoFiniteDifferences(method=method, step=h)
    x = np.array([0.5, 1.5])
    g = di.gradient(lambda x: namespace(x).sum(namespace(x).exp(x)), backend, x)
    exact = np.exp(x)
    if method == "central":
        np.testing.assert_allclose(g, exact * (np.sinh(h) / h), rtol=1e-9)
    elif method == "forward":
        np.testing.assert_allclose(g, exact * np.expm1(h) / h, rtol=1e-9)
    elif method == "backward":
        np.testing.assert_allclose(g, exact * -np.expm1(-h) / h, rtol=1e-9)
    else:
        np.testing.assert_allclose(g, exact * np.sin(h) / h, rtol=1e-12)
    default = di.gradient(lambda x: np.sum(np.exp(x)), di.AutoFiniteDifferences(method=method), x)
    assert not np.allclose(g, default, rtol=1e-9, atol=0) or method == "complex"


# -- scipy's error estimate -----------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["gradient", "jacobian", "hessian", "value_and_gradient"])
def test_scipy_error_estimate(op: str) -> None:
    backend = require("scipy")
    case = {"jacobian": CASES[-1]}.get(op) or next(c for c in CASES if c.name == "dict_pytree")
    x = case.x(np.float64)
    prep = getattr(di, f"prepare_{op}")(case.f, backend, x)
    assert prep.error is None
    result = getattr(di, op)(case.f, backend, x, prep=prep)
    error = prep.error
    assert error is not None
    assert optree.tree_structure(error) == optree.tree_structure(result)
    for e, r in zip(optree.tree_leaves(error), optree.tree_leaves(result), strict=True):
        assert isinstance(e, (np.ndarray, float, np.floating))
        assert np.shape(e) == np.shape(r)
        assert np.all(np.isfinite(e))
        assert np.all(np.abs(e) < 1e-6)


def test_second_order_combinations(second_order_backend: Any) -> None:
    """Explicit: each combination gives the hand-written hessian and hvp of a pytree loss."""
    x = _tree_x(np.float64)
    t = tangent_like(x, np.float64)
    case = next(c for c in CASES if c.name == "dict_pytree")
    outer = second_order_backend.outer
    rtol, atol = (1e-6, 1e-6) if outer.black_box else (1e-10, 1e-10)
    assert_tree_close(
        di.hessian(tree_loss, second_order_backend, x), expected("hessian", case, x, t), rtol, atol, dtype=np.float64
    )
    assert_tree_close(
        di.hvp(tree_loss, second_order_backend, x, t), expected("hvp", case, x, t), rtol, atol, dtype=np.float64
    )


def test_second_derivative_of_second_order_combinations(second_order_backend: Any) -> None:
    """d2/dt2 (t**3, sin t) = (6t, -sin t) through every combination, scalar in."""
    t = 0.7
    result = di.second_derivative(lambda s: [s**3, s * s * s], second_order_backend, t)
    assert np.allclose(result, [6 * t, 6 * t], rtol=1e-5)


def test_torch_modes_do_not_nest() -> None:
    with pytest.raises(di.UnsupportedOperationError, match="same mode twice"):
        di.SecondOrder(di.AutoTorch(), di.AutoTorch(mode="func"))


@pytest.mark.parametrize("method", ["central", "forward", "backward", "complex"])
def test_vectorized_finite_differences_match_pointwise(method: str) -> None:
    """vectorize=True evaluates every perturbation in one batched call of f, same results."""
    calls = []

    def f(p: Any) -> Any:
        calls.append(1)
        return (np.sin(p["a"]) * p["a"]).sum(axis=-1) + (p["b"] ** 2).sum(axis=(-2, -1))

    x = {"a": np.linspace(0.1, 1.0, 5), "b": np.arange(6.0).reshape(2, 3) / 6}
    pointwise = di.gradient(f, di.AutoFiniteDifferences(method=method), x)
    calls.clear()
    batched = di.gradient(f, di.AutoFiniteDifferences(method=method, vectorize=True), x)
    expected_calls = 1 if method == "complex" else 2  # f(x) (its precision bounds the steps), then the batch
    assert len(calls) == expected_calls
    for key in x:
        np.testing.assert_allclose(batched[key], pointwise[key], rtol=1e-12, atol=1e-12)


def test_vectorized_jacobian_and_vjp_on_torch() -> None:
    torch = pytest.importorskip("torch")

    def f(x: Any) -> Any:
        return torch.stack([x[..., 0] * x[..., 1], torch.sin(x[..., 0])], dim=-1)

    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    backend = di.AutoFiniteDifferences(vectorize=True)
    jac = di.jacobian(f, backend, x)
    assert isinstance(jac, torch.Tensor)
    torch.testing.assert_close(jac, torch.tensor([[2.0, 1.0], [math.cos(1.0), 0.0]], dtype=torch.float64))
    ty = torch.tensor([1.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(di.vjp(f, backend, x, ty), ty @ jac)


def test_vectorized_finite_differences_refuse_a_function_that_does_not_broadcast() -> None:
    x = np.ones(3)
    with pytest.raises(di.InvalidOutputError, match="leading axis"):
        di.gradient(lambda z: (z**2).sum(), di.AutoFiniteDifferences(vectorize=True), x)
    assert np.array_equal(x, np.ones(3))


@pytest.mark.parametrize("backend_id", ["jax", "torch-autograd", "torch-func", "autograd", "finite_differences"])
def test_a_python_float_cotangent_takes_a_float32_outputs_dtype(backend_id: str) -> None:
    """A Python float is any float dtype: as the cotangent of a float32 output it was made a
    float64 array, which jax's vjp refused with its own ValueError."""
    backend = require(backend_id)
    x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    got = di.vjp(lambda v: (v**2).sum(), backend, x, 2.0)
    np.testing.assert_allclose(np.asarray(got), 4 * x, rtol=1e-4)
    assert np.asarray(got).dtype == np.float32


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_a_python_float_leaf_is_weak_under_jax_as_jax_takes_it(jit: bool) -> None:
    """A Python float at a leaf of x reached f as a strong float64 array under x64: a float32 f
    (the float times float32 weights) computed in float64 and its value came back float64, where
    jax's own call keeps float32. It reaches f weakly typed, as jax takes a Python number."""
    require("jax")
    import jax
    import jax.numpy as jnp

    def f(t: Any) -> Any:
        return jnp.sum(t["scale"] * jnp.sin(t["w"]))

    x = {"scale": 1.5, "w": jnp.asarray([0.3, -1.2, 2.0], dtype=jnp.float32)}
    value, grads = di.value_and_gradient(f, di.AutoJAX(jit=jit), x)
    native_value, native_grads = jax.value_and_grad(f)(x)
    assert value.dtype == native_value.dtype == jnp.float32
    assert type(grads["scale"]) is float and grads["w"].dtype == jnp.float32
    np.testing.assert_allclose(grads["scale"], float(native_grads["scale"]), rtol=1e-6)
    np.testing.assert_allclose(grads["w"], native_grads["w"], rtol=1e-6)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_a_python_float_beside_float32_leaves_leaves_f_in_float32_under_jax(jit: bool) -> None:
    """A Python float in x (a temperature, a dropout rate) beside float32 arrays counted as
    float64 data: f ran inside jax's x64 scope, where ``jax.random.normal`` draws other numbers
    and arrays f makes are float64, so the gradient was of another function than the caller's.
    Beside float32 arrays it is float32 data, as jax takes it: f runs as the caller's call runs."""
    require("jax")
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)

    def f(p: Any, key: Any) -> Any:
        noise = jax.random.normal(key, p["w"].shape)
        return jnp.sum(p["w"] * noise * jnp.linspace(1.0, 2.0, 3)) / p["temperature"]

    x = {"w": jnp.ones(3, dtype=jnp.float32), "temperature": 2.0}
    value, grads = di.value_and_gradient(f, di.AutoJAX(jit=jit), x, di.Constant(key))
    native_value, native_grads = jax.value_and_grad(f)(x, key)
    assert value.dtype == native_value.dtype == jnp.float32
    np.testing.assert_allclose(grads["w"], native_grads["w"], rtol=1e-6)
    np.testing.assert_allclose(grads["temperature"], float(native_grads["temperature"]), rtol=1e-6)
    tx = {"w": jnp.full(3, 0.5, dtype=jnp.float32), "temperature": 1.0}  # (a Python float tangent too)
    tangent = di.jvp(f, di.AutoJAX(jit=jit), x, tx, di.Constant(key))
    native_tangent = jax.jvp(lambda p: f(p, key), (x,), (tx,))[1]
    assert tangent.dtype == native_tangent.dtype == jnp.float32
    np.testing.assert_allclose(tangent, native_tangent, rtol=1e-6)


@pytest.mark.parametrize("backend_id", ["autograd", "pytensor", "mlx", "finite_differences"])
def test_a_python_float_beside_float32_arrays_keeps_f_in_float32(backend_id: str) -> None:
    """A Python float at a leaf of x beside float32 arrays reached f as a float64 array where
    the engine has no weak numbers (autograd, PyTensor, mlx): f computed in float64, its value
    and Jacobian came back float64 where f(x) is float32, and a float32 cotangent was refused.
    It now takes the arrays' dtype, as numpy, jax and torch take a Python number."""
    backend = require(backend_id)
    x = {"v": np.array([1.0, 2.0], dtype=np.float32), "b": 1.5}

    def f(t: Any) -> Any:
        return t["v"] * t["b"]

    def loss(t: Any) -> Any:
        return f(t).sum()

    assert np.asarray(f(x)).dtype == np.float32  # (what f computes on x itself)
    value, grad = di.value_and_gradient(loss, backend, x)
    assert np.asarray(value).dtype == np.float32
    assert type(grad["b"]) is float and grad["b"] == pytest.approx(3.0, rel=1e-5)
    assert np.asarray(grad["v"]).dtype == np.float32
    np.testing.assert_allclose(np.asarray(grad["v"]), [1.5, 1.5], rtol=1e-5)
    jac = di.jacobian(f, backend, x)
    assert np.asarray(jac["v"]).dtype == np.asarray(jac["b"]).dtype == np.float32
    np.testing.assert_allclose(np.asarray(jac["b"]), [1.0, 2.0], rtol=1e-5)
    pulled = di.vjp(f, backend, x, np.ones(2, dtype=np.float32))
    assert type(pulled["b"]) is float and pulled["b"] == pytest.approx(3.0, rel=1e-5)
    prep = di.prepare_gradient(loss, backend, x)
    later = di.gradient(loss, backend, {"v": x["v"], "b": 2.5}, prep=prep)  # (the prep's conversion)
    np.testing.assert_allclose(np.asarray(later["v"]), [2.5, 2.5], rtol=1e-5)
    assert np.asarray(later["v"]).dtype == np.float32


@pytest.mark.parametrize("backend_id", ["jax", "torch-autograd", "torch-func", "autograd", "mlx", "pytensor"])
def test_an_x_without_leaves_has_empty_derivatives_on_every_engine(backend_id: str) -> None:
    """x with no leaves (the trainable parameters of a layer that has none): jax's and torch's
    Jacobians raised their own ValueError, and torch.func's Hessian, jvp and hvp an
    AssertionError or a RuntimeError, where the other engines gave empty results. The
    derivatives with respect to nothing are known without the engine: empty trees, and a jvp
    of zeros like f's output. So are a batch's (jax's and torch.func's vmap refused a batch of
    no leaves)."""
    backend = require(backend_id)
    xp = {"torch-autograd": "torch", "torch-func": "torch"}.get(backend_id, backend_id)
    if xp == "torch":
        import torch

        ones, one = (lambda: torch.ones(2, dtype=torch.float64)), (lambda: torch.tensor(2.0, dtype=torch.float64))
    elif xp == "mlx":
        import mlx.core as mx

        ones, one = (lambda: mx.ones(2)), (lambda: mx.array(2.0))
    elif xp == "pytensor":
        import pytensor.tensor as pt

        ones, one = (lambda: pt.ones(2)), (lambda: pt.constant(2.0))
    else:
        ones, one = (lambda: np.ones(2)), (lambda: np.float64(2.0))
    assert di.jacobian(lambda p: ones(), backend, {}) == {}
    value, gradient, hessian = di.value_gradient_and_hessian(lambda p: one(), backend, {})
    assert float(np.asarray(value)) == 2.0 and gradient == {} and hessian == {}
    assert di.hvp(lambda p: one(), backend, {}, {}) == {}
    assert di.vjp(lambda p: ones(), backend, {}, np.ones(2) if xp == "pytensor" else ones()) == {}
    pushed = np.asarray(di.jvp(lambda p: ones(), backend, {}, {}))
    assert pushed.shape == (2,) and not pushed.any()
    for pushed in di.batched_jvp(lambda p: ones(), backend, {}, di.Tangents({}, {})):
        assert np.asarray(pushed).shape == (2,) and not np.asarray(pushed).any()
    assert list(di.batched_hvp(lambda p: one(), backend, {}, di.Tangents({}, {}))) == [{}, {}]
    gradient, hvps = di.gradient_and_batched_hvp(lambda p: one(), backend, {}, di.Tangents({}))
    assert gradient == {} and list(hvps) == [{}]
    cotangent = np.ones(2) if xp == "pytensor" else ones()
    assert list(di.batched_vjp(lambda p: ones(), backend, {}, di.Tangents(cotangent, cotangent))) == [{}, {}]


def test_an_aux_prng_key_comes_back_as_f_returned_it() -> None:
    """An aux leaf numpy has no dtype for (a jax PRNG key, the next step's key) raised jax's
    TypeError where x is numpy and aux arrays are made numpy: it comes back as returned."""
    require("jax")
    import jax
    import jax.numpy as jnp

    def f(v: Any, key: Any) -> Any:
        key, sub = jax.random.split(key)
        return jnp.sum(v**2 * jax.random.uniform(sub, v.shape)), key

    x, key = np.ones(3), jax.random.key(0)
    (_, next_key), grad = di.value_and_gradient(f, "jax", x, di.Constant(key), has_aux=True)
    assert isinstance(grad, np.ndarray)
    assert jax.dtypes.issubdtype(next_key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(next_key), jax.random.key_data(jax.random.split(key)[0]))


class _Holder:
    """An object that is no pytree, holding an array."""

    def __init__(self, array: Any) -> None:
        self.array = array


@pytest.mark.parametrize("backend_id", [*FIRST_ORDER, "jax without jit", "tensorflow with jit"])
def test_an_aux_object_that_is_no_pytree_holding_traced_arrays_is_refused(backend_id: str) -> None:
    """An aux leaf no pytree registry takes apart (a plain object, an unregistered dataclass)
    holding an array f computed came back holding what the engine's trace left in it: a jax
    tracer, an autograd ArrayBox, a torch tensor keeping its graph (or a dead torch.func
    wrapper), an mlx placeholder, a symbolic pytensor variable, a tensor of a tf.function's
    graph. It is refused, naming the fix; the engines that call f with plain arrays (finite
    differences, TensorFlow's eager tape) return it as f did."""
    backend = require(backend_id.split()[0])
    if backend_id == "jax without jit":
        backend = di.AutoJAX(jit=False)
    if backend_id == "tensorflow with jit":
        backend = di.AutoTensorFlow(jit=True)
    plain = backend.black_box or backend_id == "tensorflow"  # (an eager tape's tensors hold their values)

    def f(v: Any) -> Any:
        xp = namespace(v)
        return xp.sum(v**2), {"state": _Holder(xp.sin(v))}

    x = np.array([0.5, 1.0, 2.0])
    calls = {
        "value_and_gradient": lambda: di.value_and_gradient(f, backend, x, has_aux=True),
        "prepared": lambda: di.value_and_gradient(
            f, backend, x, has_aux=True, prep=di.prepare_value_and_gradient(f, backend, x, has_aux=True)
        ),
        "value_and_vjp": lambda: di.value_and_vjp(f, backend, x, np.float64(1.0), has_aux=True),
        "value_and_batched_jvp": lambda: di.value_and_batched_jvp(f, backend, x, di.Tangents(x, x), has_aux=True),
    }
    for name, call in calls.items():
        # (f's arrays are plain ones there; torch's forward mode leaves its own plain too)
        if plain or (backend_id == "torch-autograd" and name == "value_and_batched_jvp"):
            (_, aux), _ = call()
            array = aux["state"].array
            assert getattr(array, "grad_fn", None) is None, name
            np.testing.assert_allclose(to_numpy(array), np.sin(x), rtol=1e-6, err_msg=name)
            continue
        with pytest.raises(di.InvalidOutputError, match=r"_Holder, which is no pytree.*register _Holder"):
            call()


@pytest.mark.parametrize("backend_id", ["jax", "jax without jit", "torch-autograd", "autograd", "finite_differences"])
def test_numpy_results_are_the_callers_to_write(backend_id: str) -> None:
    """numpy in, numpy out, writable as numpy's own results are: jax's came back as read-only
    views of its buffers (``g *= 0.5`` raised)."""
    backend = require(backend_id.split()[0])
    if backend_id == "jax without jit":
        backend = di.AutoJAX(jit=False)
    x = np.array([1.0, 2.0, 3.0])
    results = [
        di.gradient(lambda v: (v**2).sum(), backend, x),
        di.jacobian(lambda v: v**2, backend, x),
        di.jvp(lambda v: v**2, backend, x, np.ones(3)),
    ]
    for result in results:
        assert isinstance(result, np.ndarray)
        result *= 0.5  # (raises on a read-only array)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_forward_mode_through_a_custom_vjp_is_refused_by_name(jit: bool) -> None:
    """jax differentiates a custom_vjp function in reverse mode only: a derivative or jvp of one
    raised jax's TypeError (a second derivative its NotImplementedError), eagerly from f, under
    jit when jit lowers the trace, after f has run; prepared or not; the gradient works."""
    require("jax")
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def root(v: Any) -> Any:
        return jnp.sqrt(v)

    root.defvjp(lambda v: (jnp.sqrt(v), v), lambda v, g: (g * 0.5 / jnp.sqrt(v),))
    backend = di.AutoJAX(jit=jit)
    x = jnp.asarray([1.0, 4.0])
    for call in (
        lambda: di.derivative(root, backend, 1.0),
        lambda: di.second_derivative(root, backend, 1.0),
        lambda: di.jvp(root, backend, 1.0, 1.0),
        lambda: di.jvp(root, backend, x, x),
        lambda: di.jvp(root, backend, x, x, prep=di.prepare_jvp(root, backend, x, x)),
    ):
        with pytest.raises(di.UnsupportedOperationError, match="custom_vjp"):
            call()
    assert di.gradient(root, backend, 4.0) == 0.25


@pytest.mark.parametrize("empty", [(), {}], ids=["tuple", "dict"])
def test_jacobian_of_an_output_with_no_arrays_is_empty(backend: Any, empty: Any) -> None:
    """An f that returns no arrays has an empty Jacobian on every backend (jax's jacrev
    refused it with its own ValueError, torch.func's vjp with its RuntimeError)."""

    def f(x: Any) -> Any:
        return empty

    assert di.jacobian(f, backend, np.ones(2)) == empty
    assert di.jacobian(f, backend, np.ones(2), prep=di.prepare_jacobian(f, backend, np.ones(2))) == empty
