"""autograd as people use it: nested in itself (Hessians, gradient penalties, MAML), under
finite differences, given np.memmap inputs, and with functions that write into their input.

Every expected value is analytic. f(x) = sum(sin(x) * x**2) throughout, with
gradient G(x) = 2x sin x + x² cos x and diagonal Hessian H(x) = 2 sin x + 4x cos x - x² sin x.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import require

import diffiface as di

anp = pytest.importorskip("autograd.numpy")
Box = pytest.importorskip("autograd.tracer").Box

X = np.array([0.3, -0.7, 1.1])
V = np.array([0.5, 1.0, -2.0])


def f(x: Any) -> Any:
    return anp.sum(anp.sin(x) * x**2)


def G(x: np.ndarray) -> np.ndarray:
    return 2 * x * np.sin(x) + x**2 * np.cos(x)


def H(x: np.ndarray) -> np.ndarray:
    """The diagonal of the Hessian of f."""
    return 2 * np.sin(x) + 4 * x * np.cos(x) - x**2 * np.sin(x)


def H_prime(x: np.ndarray) -> np.ndarray:
    """d/dx of H (the third derivative of f, per coordinate)."""
    return 6 * np.cos(x) - 6 * x * np.sin(x) - x**2 * np.cos(x)


TIGHT = {"rtol": 1e-12, "atol": 1e-12}


# -- autograd nests in itself -----------------------------------------------------------------


def test_hessian_as_jacobian_of_inner_gradient() -> None:
    x = X.copy()
    hessian = di.jacobian(lambda v: di.gradient(f, "autograd", v), "autograd", x)
    assert type(hessian) is np.ndarray
    np.testing.assert_allclose(hessian, np.diag(H(X)), **TIGHT)
    np.testing.assert_array_equal(x, X)


def test_gradient_penalty() -> None:
    """d/dw sum(grad f(w)²) = 2 G(w) H(w)."""
    penalty_gradient = di.gradient(lambda w: (di.gradient(f, "autograd", w) ** 2).sum(), "autograd", X)
    np.testing.assert_allclose(penalty_gradient, 2 * G(X) * H(X), **TIGHT)


def test_inner_results_stay_traced() -> None:
    """Under an enclosing autograd computation the inner result is autograd's traced array,
    not numbers cut off from the trace; outside it, a plain numpy array."""
    seen: list[Any] = []

    def outer(w: Any) -> Any:
        inner = di.gradient(f, "autograd", w)
        seen.append(inner)
        return inner.sum()

    di.gradient(outer, "autograd", X)
    assert isinstance(seen[0], Box)
    assert type(di.gradient(f, "autograd", X)) is np.ndarray  # the same f untraced: the cache keeps them apart


def loss(w: Any, data: tuple[Any, Any]) -> Any:
    """0.5 |a w - b|² + sum(cos w): gradient a(aw - b) - sin w, Hessian diagonal a² - cos w."""
    a, b = data
    return 0.5 * anp.sum((a * w - b) ** 2) + anp.sum(anp.cos(w))


A_TRAIN, B_TRAIN = np.array([1.0, 2.0, 0.5]), np.array([0.2, -1.0, 0.3])
A_VAL, B_VAL = np.array([1.5, -0.5, 1.0]), np.array([1.0, 0.0, -0.4])


def test_maml_step() -> None:
    """The meta-gradient of L_val(w - lr ∇L_train(w)) is (1 - lr H_train(w)) ∇L_val(w')."""
    lr = 0.1

    def meta(w: Any) -> Any:
        adapted = w - lr * di.gradient(loss, "autograd", w, di.Constant((A_TRAIN, B_TRAIN)))
        return loss(adapted, (A_VAL, B_VAL))

    w = X
    adapted = w - lr * (A_TRAIN * (A_TRAIN * w - B_TRAIN) - np.sin(w))
    grad_val = A_VAL * (A_VAL * adapted - B_VAL) - np.sin(adapted)
    expected = (1 - lr * (A_TRAIN**2 - np.cos(w))) * grad_val
    np.testing.assert_allclose(di.gradient(meta, "autograd", w), expected, **TIGHT)


def test_traced_context() -> None:
    """An enclosing computation that differentiates with respect to a Constant's data:
    d/da sum(a(aw - b) - sin w) = 2aw - b."""
    w = X

    def through_data(a: Any) -> Any:
        return di.gradient(loss, "autograd", w, di.Constant((a, B_TRAIN))).sum()

    np.testing.assert_allclose(di.gradient(through_data, "autograd", A_TRAIN), 2 * A_TRAIN * w - B_TRAIN, **TIGHT)


def test_value_of_inner_value_and_gradient() -> None:
    """The value an inner value_and_gradient returns is traced too: its gradient is G."""
    result = di.gradient(lambda w: di.value_and_gradient(f, "autograd", w)[0], "autograd", X)
    np.testing.assert_allclose(result, G(X), **TIGHT)


def test_inner_hvp_under_outer_gradient() -> None:
    """d/dw sum(H(w) v) = H'(w) v, a third derivative through two levels of nesting."""
    result = di.gradient(lambda w: di.hvp(f, "autograd", w, V).sum(), "autograd", X)
    np.testing.assert_allclose(result, H_prime(X) * V, **TIGHT)


def test_inner_second_order_backend() -> None:
    backend = di.SecondOrder(di.AutoAutograd(), di.AutoAutograd())
    result = di.gradient(lambda w: di.hessian(f, backend, w).sum(), "autograd", X)
    np.testing.assert_allclose(result, H_prime(X), **TIGHT)


def test_nested_scalar() -> None:
    """A float x: second derivative of sin(s) s³ by nesting derivative in derivative."""
    s = 0.8
    second = di.derivative(lambda t: di.derivative(lambda u: anp.sin(u) * u**3, "autograd", t), "autograd", s)
    expected = 6 * s * np.sin(s) + 6 * s**2 * np.cos(s) - s**3 * np.sin(s)
    assert isinstance(second, float)
    assert second == pytest.approx(expected, rel=1e-12)


def test_prep_made_untraced_is_strict_about_traced_x() -> None:
    prep = di.prepare_gradient(f, "autograd", X)
    with pytest.raises(di.PreparationMismatchError):
        di.gradient(lambda w: di.gradient(f, "autograd", w, prep=prep).sum(), "autograd", X)


def test_finite_differences_over_inner_autograd_call() -> None:
    hessian = di.jacobian(lambda v: di.gradient(f, "autograd", v), "finite_differences", X)
    np.testing.assert_allclose(hessian, np.diag(H(X)), rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize(
    ("backend", "engine"),
    [
        pytest.param(di.AutoJAX(), "jax", id="jax"),
        pytest.param(di.AutoTorch(), "torch", id="torch"),
        pytest.param(di.AutoFiniteDifferences(), "finite_differences", id="finite_differences"),
        pytest.param(
            di.SecondOrder(di.AutoFiniteDifferences(), di.AutoAutograd()), "second_order", id="fd-over-autograd"
        ),
    ],
)
def test_traced_x_refused_by_other_engines(backend: di.Backend, engine: str) -> None:
    require(backend)
    with pytest.raises(di.ArrayTypeError, match="traced by autograd") as info:
        di.gradient(lambda w: di.gradient(lambda v: (v**2).sum(), backend, w).sum(), "autograd", X)
    assert engine in str(info.value)


# -- np.memmap inputs ---------------------------------------------------------------------------


@pytest.fixture
def memmap() -> Iterator[np.memmap]:
    with tempfile.TemporaryDirectory() as folder:
        array = np.memmap(os.path.join(folder, "x.dat"), dtype=np.float64, mode="w+", shape=(3,))
        array[:] = X
        yield array
        del array


def test_memmap_x(memmap: np.memmap) -> None:
    gradient = di.gradient(f, "autograd", memmap)
    assert type(gradient) is np.ndarray
    np.testing.assert_allclose(gradient, G(X), **TIGHT)
    np.testing.assert_allclose(di.hessian(f, "autograd", memmap), np.diag(H(X)), **TIGHT)
    np.testing.assert_array_equal(memmap, X)


def test_memmap_context_and_tangent(memmap: np.memmap) -> None:
    gradient = di.gradient(lambda w, c: anp.sum(w * c), "autograd", np.ones(3), di.Constant(memmap))
    np.testing.assert_allclose(gradient, X, **TIGHT)
    np.testing.assert_allclose(di.hvp(f, "autograd", X, memmap), H(X) * X, **TIGHT)


# -- f writes into its input ----------------------------------------------------------------------


def set_item(x: Any) -> Any:
    x[0] = 1.0
    return anp.sum(x)


def add_out(x: Any) -> Any:
    np.add(x, 1, out=x)
    return anp.sum(x)


def fill(x: Any) -> Any:
    x.fill(0.0)
    return anp.sum(x)


def copy_to(x: Any) -> Any:
    np.copyto(x, 0.0)
    return anp.sum(x)


@pytest.mark.parametrize("writer", [set_item, add_out, fill, copy_to], ids=lambda w: w.__name__)
@pytest.mark.parametrize("operator", ["gradient", "hessian"])
def test_write_into_x_is_a_mutation_error(writer: Any, operator: str) -> None:
    x = X.copy()
    with pytest.raises(di.MutationError, match="in place"):
        getattr(di, operator)(writer, "autograd", x)
    np.testing.assert_array_equal(x, X)


def test_augmented_assignment_rebinds_and_is_right() -> None:
    """x += 1 on a traced array makes a new array (Python rebinds the name): f(x) = sum(x + 1)."""

    def add_one(x: Any) -> Any:
        x += 1
        return anp.sum(x**2)

    x = X.copy()
    np.testing.assert_allclose(di.gradient(add_one, "autograd", x), 2 * (X + 1), **TIGHT)
    np.testing.assert_array_equal(x, X)


def test_write_into_read_only_constant_leaves_it_unchanged() -> None:
    """A Constant the engine hands f read-only (as diffiface's dispatch does): the write fails,
    is not mistaken for a framework mismatch, and the data stays as it was."""
    data = np.array([1.0, 2.0, 3.0])
    view = data.view()
    view.flags.writeable = False

    def writes_constant(w: Any, c: Any) -> Any:
        c[0] = 5.0
        return anp.sum(w * c)

    with pytest.raises((di.MutationError, ValueError)) as info:
        di.gradient(writes_constant, "autograd", X, di.Constant(view))
    assert not isinstance(info.value, di.FrameworkMismatchError)
    np.testing.assert_array_equal(data, [1.0, 2.0, 3.0])


def test_a_jvp_through_a_primitive_with_an_opaque_vjp_is_refused() -> None:
    """autograd's jvp differentiates f's pullback: a custom primitive whose vjp is plain numpy
    (or scipy) on the cotangent made it read as zero (or raise numpy's error). Refused by name;
    the Jacobian, reverse passes only, stays right, and an f apart from x keeps a zero jvp."""
    from autograd.extend import defvjp, primitive

    a = np.array([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]])

    @primitive
    def lin(b: Any) -> Any:
        return a @ b

    defvjp(lin, lambda ans, b: lambda g: np.dot(a.T, g))
    x, t = np.array([1.0, 2.0, 3.0]), np.array([0.5, -1.0, 2.0])
    with pytest.raises(di.UnsupportedOperationError, match="jacobian"):
        di.jvp(lin, "autograd", x, t)
    np.testing.assert_allclose(di.jacobian(lin, "autograd", x) @ t, a @ t)
    np.testing.assert_array_equal(di.jvp(lambda v: np.ones(2), "autograd", x, t), np.zeros(2))
