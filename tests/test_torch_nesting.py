"""Every diffiface operator nested in every other under torch, both modes and across them:
right against the analytic value, or a diffiface error, never a wrong number (a call inside an
outer differentiation that detached its result read as a zero derivative)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: its adapter is untested")

import diffiface as di  # noqa: E402

MODES = {"func": di.AutoTorch(mode="func"), "autograd": di.AutoTorch(mode="autograd")}


def _inner(name: str, backend: Any) -> Callable[[Any, Any], Any]:
    """The inner operator on f at point p (a tangent or cotangent of 2)."""
    return {
        "derivative": lambda f, p: di.derivative(f, backend, p),
        "jvp": lambda f, p: di.jvp(f, backend, p, torch.ones_like(p) * 2),
        "gradient": lambda f, p: di.gradient(f, backend, p),
        "vjp": lambda f, p: di.vjp(f, backend, p, torch.ones_like(p) * 2),
        "hvp": lambda f, p: di.hvp(f, backend, p, torch.ones_like(p) * 2),
    }[name]


def _outer(name: str, backend: Any) -> Callable[[Any, Any], Any]:
    return {
        "derivative": lambda g, x: di.derivative(g, backend, x),
        "jvp": lambda g, x: di.jvp(g, backend, x, torch.ones_like(x)),
        "gradient": lambda g, x: di.gradient(g, backend, x),
        "jacobian": lambda g, x: di.jacobian(g, backend, x),
        "vjp": lambda g, x: di.vjp(g, backend, x, torch.ones_like(x)),
    }[name]


# for f(w) = k w**3 at p: the inner operator's value, and its derivative in p
_VALUE = {"derivative": 3, "jvp": 6, "gradient": 3, "vjp": 6}
_SLOPE = {"derivative": 6, "jvp": 12, "gradient": 6, "vjp": 12, "hvp": 12}


def _value(name: str, p: complex, k: complex) -> complex:
    return 12 * p * k if name == "hvp" else _VALUE[name] * p**2 * k


def _slope(name: str, p: complex, k: complex) -> complex:
    return _SLOPE[name] * k if name == "hvp" else _SLOPE[name] * p * k


_REAL_ONLY = {"gradient", "vjp", "hvp"}
CASES = [
    (outer, om, inner, im, dtype, kind)
    for (om, im) in itertools.product(MODES, MODES)
    for outer in ("derivative", "jvp", "gradient", "jacobian", "vjp")
    for inner in ("derivative", "jvp", "gradient", "vjp", "hvp")
    for dtype in ("float64", "complex128")
    for kind in ("through x", "through a closure")
    if dtype == "float64" or not ({outer, inner} & _REAL_ONLY)
]


@pytest.mark.parametrize(("outer", "outer_mode", "inner", "inner_mode", "dtype", "kind"), CASES)
def test_a_nested_call_is_right_or_refused(
    outer: str, outer_mode: str, inner: str, inner_mode: str, dtype: str, kind: str
) -> None:
    dt = getattr(torch, dtype)
    x = torch.tensor(1.5 + (0.5j if dt.is_complex else 0), dtype=dt)
    c = torch.tensor(0.7, dtype=dt)
    inner_op, outer_op = _inner(inner, MODES[inner_mode]), _outer(outer, MODES[outer_mode])
    if kind == "through x":  # the inner point is the outer x: d/dx of op(w**3)(x)
        g, want = (lambda z: inner_op(lambda w: w**3, z)), _slope(inner, complex(x), 1)
    else:  # the inner point is fixed, f closes over the outer x: d/dx of op(w**3 x)(c)
        g, want = (lambda z: inner_op(lambda w: w**3 * z, c)), _value(inner, complex(c), 1)
    try:
        got = outer_op(g, x)
    except di.DiffifaceError:
        return  # a refusal is a right answer; a wrong number is not
    np.testing.assert_allclose(complex(got.detach()), want, rtol=1e-9)


def test_the_cases_that_must_compute_do() -> None:
    """The nestings torch runs (all of torch.func's, and reverse in autograd mode) are not
    refused: the matrix above would pass on refusals alone otherwise."""
    func, autograd = MODES["func"], MODES["autograd"]
    x = torch.tensor(1.5, dtype=torch.float64)
    cube = lambda w: w**3  # noqa: E731
    assert float(di.derivative(lambda z: di.derivative(cube, func, z), func, x)) == pytest.approx(9)
    assert float(di.jvp(lambda z: di.jvp(cube, func, z, torch.ones_like(z)), func, x, torch.ones_like(x))) == (
        pytest.approx(9)
    )
    assert float(di.gradient(lambda z: di.gradient(cube, autograd, z), autograd, x)) == pytest.approx(9)
    assert float(di.derivative(lambda z: di.gradient(cube, autograd, z), autograd, x)) == pytest.approx(9)
    assert float(di.gradient(lambda z: di.hvp(cube, func, z, torch.ones_like(z)), func, x)) == pytest.approx(6)
    z = torch.tensor(1.5 + 0.5j, dtype=torch.complex128)
    assert complex(
        di.derivative(lambda v: di.derivative(lambda w: w**3 * v, func, torch.tensor(0.7 + 0j)), func, z)
    ) == (pytest.approx(3 * 0.7**2))


@pytest.mark.parametrize("transform", ["jvp", "grad"])
def test_a_call_inside_torch_func_transforms_keeps_its_tangent(transform: str) -> None:
    func_mode = MODES["func"]
    x = torch.tensor(1.5, dtype=torch.float64)

    def g(z: Any) -> Any:
        return di.derivative(lambda w: w**3, func_mode, z)

    got = torch.func.jvp(g, (x,), (torch.ones_like(x),))[1] if transform == "jvp" else torch.func.grad(g)(x)
    assert float(got) == pytest.approx(9)


@pytest.mark.parametrize("inner_mode", list(MODES))
@pytest.mark.parametrize("outer", ["gradient", "jacobian", "derivative"])
def test_a_prepared_call_on_the_outer_x_as_a_constant_keeps_its_graph(inner_mode: str, outer: str) -> None:
    # expected: d/dz of the prepared gradient of w**3 z at c, z passed as a di.Constant: 3 c**2
    # (the fused call, which serves a prepared call, hands a nested one to the guard's steps)
    inner = MODES[inner_mode]
    c, x = torch.tensor(0.7, dtype=torch.float64), torch.tensor(1.5, dtype=torch.float64)

    def f(w: Any, z: Any) -> Any:
        return w**3 * z

    prep = di.prepare_gradient(f, inner, c, di.Constant(x))
    di.gradient(f, inner, c, di.Constant(x), prep=prep)  # (the prep's first call made)
    outer_backend = MODES["autograd"] if outer != "derivative" else MODES["func"]
    for _ in range(2):
        try:
            got = _outer(outer, outer_backend)(lambda z: di.gradient(f, inner, c, di.Constant(z), prep=prep), x)
        except di.DiffifaceError:
            assert (inner_mode, outer) == ("autograd", "derivative")  # (torch.autograd inside torch.func)
            continue
        assert float(got) == pytest.approx(3 * 0.7**2)


_VECTOR_INNER = {  # op(w -> w**3 z) at c, for f closing over the outer x = z; its value, by z
    "jacobian": (lambda b, z, c: di.jacobian(lambda w: w**3 * z, b, c).sum(0), lambda z, c: 3 * c**2 * z),
    "hessian": (lambda b, z, c: di.hessian(lambda w: (w**3 * z).sum(), b, c).sum(0), lambda z, c: 6 * c * z),
    "value_and_gradient": (
        lambda b, z, c: di.value_and_gradient(lambda w: (w**3 * z).sum(), b, c)[1],
        lambda z, c: 3 * c**2 * z,
    ),
}


@pytest.mark.parametrize(("outer_mode", "inner_mode"), list(itertools.product(MODES, MODES)))
@pytest.mark.parametrize("inner", list(_VECTOR_INNER))
@pytest.mark.parametrize("outer", ["jacobian", "hessian"])
def test_a_nested_jacobian_or_hessian_on_vectors_is_right_or_refused(
    outer: str, inner: str, outer_mode: str, inner_mode: str
) -> None:
    x, c = torch.tensor([1.5, -0.5], dtype=torch.float64), torch.tensor([0.7, 0.3], dtype=torch.float64)
    op, value = _VECTOR_INNER[inner]
    g = lambda z: op(MODES[inner_mode], z, c)  # noqa: E731
    if outer == "jacobian":
        run, want = (lambda: di.jacobian(g, MODES[outer_mode], x)), torch.diag(value(torch.ones(2), c))
    else:  # (g is linear in z: the Hessian of its squares is constant, 2 diag(value**2))
        run, want = (
            (lambda: di.hessian(lambda z: (g(z) ** 2).sum(), MODES[outer_mode], x)),
            2 * torch.diag(value(torch.ones(2), c) ** 2),
        )
    try:
        got = run()
    except di.DiffifaceError:
        assert (outer_mode, inner_mode) == ("func", "autograd")  # (torch.autograd inside torch.func)
        return
    torch.testing.assert_close(got.detach(), want.to(torch.float64))


@pytest.mark.parametrize("backend", ["torch", di.AutoTorch(create_graph=True), "torch-func"], ids=str)
def test_the_callers_forward_mode_runs_through_a_call(backend: Any) -> None:
    """Around a call, the caller's own torch.autograd.forward_ad level: a dual x's tangent is
    carried through, on every call of the prep (as through torch.autograd.grad), never dropped
    to a zero derivative; a forward mode inside it is refused by name."""
    import torch.autograd.forward_ad as forward_ad

    x = torch.tensor([0.3, -1.2, 0.8], dtype=torch.float64)
    v = torch.tensor([1.0, 0.5, -2.0], dtype=torch.float64)
    f = lambda y: (torch.sin(y) * y**2).sum()  # noqa: E731
    fv = lambda y: torch.sin(y) * y**2  # noqa: E731
    along = torch.func.hessian(f)(x) @ v
    vjp_along = torch.func.jvp(lambda y: torch.func.vjp(fv, y)[1](v)[0], (x,), (v,))[1]
    for _ in range(3):  # (a prep's first call copies x; its later ones do not)
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(x, v)
            grad = forward_ad.unpack_dual(di.gradient(f, backend, dual)).tangent
            pulled = forward_ad.unpack_dual(di.vjp(fv, backend, dual, v)).tangent
        assert grad is not None and pulled is not None
        torch.testing.assert_close(grad.detach(), along)
        torch.testing.assert_close(pulled.detach(), vjp_along)
    with forward_ad.dual_level(), pytest.raises(di.UnsupportedOperationError):
        di.jvp(fv, backend, forward_ad.make_dual(x, v), v)


def test_forward_mode_inside_a_torch_function_forward_carries_its_tangents() -> None:
    # expected: zeros, with no error. torch runs an autograd.Function's forward (and a bridge's
    # rule, inside it) with forward grad mode off, and the duals of the jvp carried no tangent
    torch = pytest.importorskip("torch")
    v = torch.ones(2, dtype=torch.float64)
    modes: list[bool] = []

    class Cubed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            out = di.jvp(lambda y: y**3, "torch", x, v)
            modes.append(torch._C._is_fwd_grad_enabled())  # (the caller's mode, restored: off)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad

    x = torch.tensor([0.5, 2.0], dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(Cubed.apply(x).detach(), 3 * x.detach() ** 2)
    assert modes == [False]
