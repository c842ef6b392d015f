"""The mlx engine: what mlx users pass (mx.array trees, an mlx.nn model's parameters), float64
kept on the CPU at float32's accuracy, complex64 in the project's convention, complex128
refused, inputs never mutated, the scenario suite, and the checker's tolerances."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import diffiface as di
from diffiface.test import check_gradients, core_scenarios, layer_scenarios, test_differentiation

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")
from mlx.utils import tree_flatten  # noqa: E402

BACKENDS = [di.AutoMLX(), di.AutoMLX(compile=False)]
IDS = ["compiled", "eager"]


def _np(a: object) -> np.ndarray:
    return np.array(a)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_every_operator_against_closed_forms(backend: di.Backend) -> None:
    x = mx.array(np.linspace(-1.0, 1.2, 5), dtype=mx.float32)
    xn = np.linspace(-1.0, 1.2, 5)
    f = lambda x: mx.sum(mx.sin(x) * x * x)  # noqa: E731
    grad = np.cos(xn) * xn**2 + 2 * xn * np.sin(xn)
    second = -np.sin(xn) * xn**2 + 4 * xn * np.cos(xn) + 2 * np.sin(xn)
    g = di.gradient(f, backend, x)
    assert isinstance(g, mx.array) and g.dtype == mx.float32
    np.testing.assert_allclose(_np(g), grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_np(di.hessian(f, backend, x)), np.diag(second), rtol=1e-5, atol=1e-5)
    v = mx.array(np.arange(5.0), dtype=mx.float32)
    np.testing.assert_allclose(_np(di.hvp(f, backend, x, v)), second * np.arange(5.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(di.jacobian(mx.sin, backend, x)), np.diag(np.cos(xn)), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(_np(di.jvp(mx.sin, backend, x, v)), np.cos(xn) * np.arange(5.0), rtol=1e-6)
    np.testing.assert_allclose(_np(di.vjp(mx.sin, backend, x, v)), np.cos(xn) * np.arange(5.0), rtol=1e-6)
    d = di.derivative(lambda t: {"a": mx.sin(t), "b": [t**2]}, backend, 0.5)
    assert type(d["a"]) is float and d["a"] == pytest.approx(np.cos(0.5), rel=1e-6)
    assert d["b"][0] == pytest.approx(1.0)
    assert di.second_derivative(mx.sin, backend, 0.5) == pytest.approx(-np.sin(0.5), rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_a_write_into_a_slice_f_made_is_differentiated_in_every_batch(backend: di.Backend) -> None:
    # mlx's vmap of a vjp through a slice write kept the overwritten entries' cotangents: the
    # vmapped rows of a Jacobian, a Hessian and batched products were wrong, with no error
    def f(x):
        y = x * 2
        y[1:3] = x[3:5] ** 2  # (entries 1 and 2 of y no longer depend on x[1], x[2])
        return y

    xn = np.array([0.1, 0.2, 0.3, 0.4, 0.5], dtype=np.float32)
    x = mx.array(xn)
    jac = np.diag([2.0, 0, 0, 2, 2])
    jac[1, 3], jac[2, 4] = 2 * xn[3], 2 * xn[4]
    np.testing.assert_allclose(_np(di.jacobian(f, backend, x)), jac, rtol=1e-6)
    eye = [mx.array(row) for row in np.eye(5, dtype=np.float32)]
    for k, row in enumerate(di.batched_jvp(f, backend, x, di.Tangents(*eye))):
        np.testing.assert_allclose(_np(row), jac[:, k], rtol=1e-6)
    for k, row in enumerate(di.batched_vjp(f, backend, x, di.Tangents(*eye))):
        np.testing.assert_allclose(_np(row), jac[k], rtol=1e-6)
    u = np.array([1.0, -1, 2, 0.5, 3], dtype=np.float32)
    y = 2 * xn
    y[1:3] = xn[3:5] ** 2
    hessian = 2 * jac.T @ np.diag(u) @ jac
    hessian[3, 3] += 4 * u[1] * y[1]
    hessian[4, 4] += 4 * u[2] * y[2]
    s = lambda x: mx.sum(f(x) ** 2 * mx.array(u))  # noqa: E731
    np.testing.assert_allclose(_np(di.hessian(s, backend, x)), hessian, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_an_mlx_nn_model_parameters(backend: di.Backend) -> None:
    """What mlx users differentiate: model.trainable_parameters(), with the model updated from
    the tree diffiface is handed; the gradient has its structure and matches mx.grad's."""
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    data = mx.random.normal((16, 4))
    target = mx.random.normal((16, 1))

    def loss(params: dict, data: mx.array, target: mx.array) -> mx.array:
        # f puts the parameters it is given in the model, and the model's own back after: under
        # mx.compile an array left in the model would be the compiler's placeholder
        own = model.parameters()
        model.update(params)
        try:
            return mx.mean((model(data) - target) ** 2)
        finally:
            model.update(own)

    params = model.trainable_parameters()
    before = [(k, _np(v)) for k, v in tree_flatten(params)]
    value, grads = di.value_and_gradient(loss, backend, params, di.Constant(data), di.Constant(target))
    expected_value, expected = nn.value_and_grad(model, lambda m, d, t: mx.mean((m(d) - t) ** 2))(model, data, target)
    assert float(value) == pytest.approx(float(expected_value), rel=1e-6)
    got, want = dict(tree_flatten(grads)), dict(tree_flatten(expected))
    assert got.keys() == want.keys()
    for key in want:
        assert isinstance(got[key], mx.array) and got[key].dtype == mx.float32
        np.testing.assert_allclose(_np(got[key]), _np(want[key]), rtol=1e-5, atol=1e-6, err_msg=key)
    for (key, old), (_, new) in zip(before, tree_flatten(params), strict=True):
        np.testing.assert_array_equal(old, _np(new), err_msg=key)  # never mutated
    mx.eval(model(data))  # the model holds its own arrays still


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_float64_stays_float64(backend: di.Backend) -> None:
    """A float64 numpy array is not made float32 (mx.array's own default): it stays float64,
    computed on the CPU; the results mirror it."""
    x = np.linspace(-1.0, 1.0, 4)
    g = di.gradient(lambda x: mx.sum(x**3), backend, x)
    assert isinstance(g, np.ndarray) and g.dtype == np.float64
    np.testing.assert_allclose(g, 3 * x**2, rtol=1e-15)  # (products: exact in float64)
    x64 = mx.array(x, dtype=mx.float64)
    g64 = di.gradient(lambda x: mx.sum(mx.sin(x)), backend, x64)
    assert g64.dtype == mx.float64
    # mlx's float64 cos is accurate to float32 only: what the docs say
    np.testing.assert_allclose(_np(g64), np.cos(x), rtol=1e-6)
    assert di.gradient(lambda x: x**3, backend, 2.0) == pytest.approx(12.0, rel=1e-15)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_complex_convention(backend: di.Backend) -> None:
    z = mx.array(np.array([3 + 4j, -1 + 0.5j], dtype=np.complex64))
    g = di.gradient(lambda z: mx.sum(mx.abs(z) ** 2), backend, z)
    np.testing.assert_allclose(_np(g), [6 + 8j, -2 + 1j], rtol=1e-6)
    zn = np.array([1 + 2j, -0.5 + 0.25j], dtype=np.complex64)
    v = np.array([0.5 - 1j, 2 + 0j], dtype=np.complex64)
    np.testing.assert_allclose(di.jvp(lambda z: z * z, backend, zn, v), 2 * zn * v, rtol=1e-6)
    np.testing.assert_allclose(di.vjp(lambda z: z * z, backend, zn, v), np.conj(2 * zn) * v, rtol=1e-6)
    # a map that is not holomorphic: the vjp is the jvp's adjoint under Re<a, b>
    f = lambda z: z * mx.conj(z) + z  # noqa: E731
    u = np.array([0.3 + 0.7j, -1.1 + 0.2j], dtype=np.complex64)
    lhs = np.real(np.vdot(v, di.jvp(f, backend, zn, u)))
    rhs = np.real(np.vdot(di.vjp(f, backend, zn, v), u))
    assert lhs == pytest.approx(rhs, rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_reverse_products_of_a_complex_x_follow_the_convention_through_power(backend: di.Backend) -> None:
    """mlx's vjp of a complex power returns 2 z u where the convention's adjoint is conj(2 z) u,
    with no error (its jvp is right): the gradient of sum(real(z**2)) came back as 2 z. A complex
    x's reverse products are the adjoint of mlx's forward mode now."""
    zn = np.array([3 + 4j, 1 - 2j], dtype=np.complex64)
    u = np.array([0.5 - 1j, 2 + 0j], dtype=np.complex64)
    g = di.gradient(lambda z: mx.sum(mx.real(z**2)), backend, zn)
    np.testing.assert_allclose(_np(g), np.conj(2 * zn), rtol=1e-5)
    np.testing.assert_allclose(_np(di.vjp(lambda z: z**3, backend, zn, u)), np.conj(3 * zn**2) * u, rtol=1e-5)
    # a holomorphic f's Jacobian (the complex wrapper differentiates real parts, through z**2)
    np.testing.assert_allclose(_np(di.jacobian(lambda z: z**2, backend, zn)), np.diag(2 * zn), rtol=1e-5)
    # a real leaf beside the complex one, in a tree
    tree = {"z": zn, "w": np.array([1.5, -2.0], dtype=np.float32)}
    got = di.gradient(lambda p: mx.sum(mx.real(p["z"] ** 2)) + mx.sum(p["w"] ** 3), backend, tree)
    np.testing.assert_allclose(_np(got["z"]), np.conj(2 * zn), rtol=1e-5)
    np.testing.assert_allclose(_np(got["w"]), 3 * tree["w"] ** 2, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_an_operation_without_a_rule_is_refused_by_name(backend: di.Backend) -> None:
    """mlx's RuntimeError or ValueError for an operation without a reverse-mode rule (an
    inverse) reached the caller raw. Operations without a forward-mode rule (a product, a
    cumulative maximum) are served: a real x's jvps and Hessians go through the pullback."""
    x = np.array([0.5, -1.2, 2.0], dtype=np.float32)
    t = np.ones(3, np.float32)
    want = np.array([[0.0, 2.0, -1.2], [2.0, 0.0, 0.5], [-1.2, 0.5, 0.0]])  # prod's Hessian
    np.testing.assert_allclose(_np(di.hessian(lambda v: mx.prod(v), backend, x)), want, atol=1e-6)
    np.testing.assert_allclose(_np(di.jvp(lambda v: mx.cummax(v), backend, x, t)), [1.0, 1.0, 1.0])
    with pytest.raises(di.UnsupportedOperationError, match="no reverse-mode rule"):
        di.gradient(lambda v: mx.sum(mx.linalg.inv(mx.diag(v), stream=mx.cpu)), backend, x)


@pytest.mark.parametrize("operator", ["hvp", "batched_hvp"])
def test_second_order_of_a_complex_x_is_refused(operator: str) -> None:
    """mlx 0.32's hvp of |z|^2 written with mx.abs comes out wrong with no error (the derivative
    of abs's vjp on a complex array is zero; the first derivative is right), so every second
    derivative of a complex x (an hvp, a batch of them) is refused, with what to use instead
    (the Hessian and the second derivative of a complex x are refused on every engine); a real x
    is served."""
    zn = np.array([1 + 2j, -0.5 + 0.25j], dtype=np.complex64)
    v = np.array([0.5 - 1j, 2 + 0j], dtype=np.complex64)
    if operator == "hvp":
        call = lambda: di.hvp(lambda z: mx.sum(mx.abs(z) ** 2), "mlx", zn, v)  # noqa: E731
    else:
        call = lambda: di.batched_hvp(lambda z: mx.sum(mx.abs(z) ** 2), "mlx", zn, di.Tangents(v, v))  # noqa: E731
    with pytest.raises(di.UnsupportedOperationError, match="AutoJAX"):
        call()
    x = np.array([1.0, -2.0], dtype=np.float32)
    np.testing.assert_allclose(di.hvp(lambda z: mx.sum(mx.abs(z) ** 3), "mlx", x, x), 6 * np.abs(x) * x, rtol=1e-5)


def test_complex128_is_refused() -> None:
    """As x and as a Constant's array: what the engine cannot do (the suite reports it skipped),
    named, never a conversion error."""
    with pytest.raises(di.UnsupportedOperationError, match="complex64 only"):
        di.gradient(lambda z: mx.sum(mx.abs(z) ** 2), "mlx", np.array([1 + 2j]))
    with pytest.raises(di.UnsupportedOperationError, match="context's numpy array is complex128"):
        di.gradient(
            lambda z, c: mx.sum(mx.abs(z * c) ** 2),
            "mlx",
            np.array([1 + 2j], np.complex64),
            di.Constant(np.array([1j])),
        )


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_inputs_and_constants_never_mutated(backend: di.Backend) -> None:
    x = mx.array([1.0, 2.0, 3.0])
    c = mx.array([5.0, 6.0, 7.0])

    def f(x: mx.array, c: mx.array) -> mx.array:
        x[0] = 10.0
        c[1] = 0.0
        return mx.sum(x * c)

    g = di.gradient(f, backend, x, di.Constant(c))
    np.testing.assert_array_equal(_np(x), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(_np(c), [5.0, 6.0, 7.0])
    np.testing.assert_array_equal(_np(g), [0.0, 0.0, 7.0])


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_a_numpy_scalar_constant_or_closure_is_no_silent_zero(backend: di.Backend) -> None:
    """A numpy scalar (data.std()) times an mx.array reads the array through numpy: as a
    Constant it gave a zero gradient (compile=False) or blamed f for a numpy call (compile=True),
    and closed over, a zero gradient. The Constant is an array of mlx now; the closure's cut is
    refused where f runs uncompiled (compiled, mlx refuses it as f runs)."""
    scale = np.array([1.0, 2.0, 4.0]).std()
    x = np.array([1.0, 2.0, 3.0])
    got = di.gradient(lambda v, c: c * mx.sum(v**2), backend, x, di.Constant(scale))
    np.testing.assert_allclose(got, 2 * scale * x, rtol=1e-6)
    with pytest.raises(di.DiffifaceError, match=r"trace|reads the value"):
        di.gradient(lambda v: scale * mx.sum(v**2), backend, x)
    # an output apart from x, a numpy scalar, has derivative zero
    np.testing.assert_array_equal(di.jacobian(lambda v: (mx.sum(v), np.float64(2.0)), backend, x)[1], np.zeros(3))


def test_prepared_gradient_takes_new_values() -> None:
    f = lambda x, c: mx.sum(mx.tanh(x) * c)  # noqa: E731
    x = mx.array(np.linspace(-1, 1, 6), dtype=mx.float32)
    c = mx.array(np.ones(6), dtype=mx.float32)
    prep = di.prepare_gradient(f, "mlx", x, di.Constant(c))
    for scale in (1.0, 2.5):
        y = x * scale
        got = di.gradient(f, "mlx", y, di.Constant(c * scale), prep=prep)
        np.testing.assert_allclose(_np(got), scale / np.cosh(_np(y)) ** 2, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_a_mismatch_names_the_arrays_as_mlx_users_know_them(backend: di.Backend) -> None:
    f = lambda x: mx.sum(x * x)  # noqa: E731
    prep = di.prepare_gradient(f, backend, mx.ones(3))
    with pytest.raises(di.PreparationMismatchError) as caught:
        di.gradient(f, backend, mx.ones(4, dtype=mx.float16), prep=prep)
    message = str(caught.value)
    assert "prepared for an mlx array of shape (3,) and dtype float32" in message
    assert "called with an mlx array of shape (4,) and dtype float16" in message


def test_numpy_f_is_explained() -> None:
    with pytest.raises(di.DiffifaceError, match="mlx"):
        di.gradient(lambda x: np.sum(np.sin(np.asarray(x))), "mlx", mx.ones(3))


def test_scenario_suite_and_layer_zoo() -> None:
    report = test_differentiation([di.AutoMLX(compile=False)], core_scenarios(quick=True))
    assert not report.failed, report
    report = test_differentiation([di.AutoMLX()], core_scenarios(quick=True, dtypes=("float32",)))
    assert not report.failed, report
    layers = test_differentiation([di.AutoMLX(compile=False)], layer_scenarios(quick=True))
    assert not layers.failed, layers


def test_checker_tolerances_follow_mlx_precision() -> None:
    """float64 on mlx is float32-accurate: the checker passes a right gradient (no wolf cried)
    and still fails one that is 1% off."""
    f = lambda x: mx.sum(mx.sin(3 * x) * mx.exp(x) * mx.cos(x) ** 2)  # noqa: E731
    x = mx.array(np.linspace(-2, 2, 40), dtype=mx.float64)
    check_gradients(f, x, backends=["mlx"])

    @mx.custom_function
    def scaled(x: mx.array) -> mx.array:
        return mx.sin(x)

    @scaled.vjp
    def _(primals: tuple, cotangent: mx.array, output: mx.array) -> mx.array:
        return cotangent * mx.cos(primals[0]) * 1.01

    with pytest.raises(di.GradientCheckError):
        check_gradients(lambda x: mx.sum(scaled(x)), x, backends=["mlx"])


def test_differentiate_with_mlx_inside_jax_and_torch() -> None:
    """mlx's f inside jax's and torch's differentiation, first and second order, dtypes kept."""
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    f = lambda x: mx.sum(mx.sin(x) * x)  # noqa: E731
    xn = np.linspace(-1.0, 1.0, 4).astype(np.float32)
    first = np.cos(xn) * xn + np.sin(xn)
    second = 2 * np.cos(xn) - xn * np.sin(xn)
    g = di.differentiate_with(f, "mlx")
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(g))(jax.numpy.asarray(xn))), first, rtol=1e-6)
    hessian_sum = jax.grad(lambda x: jax.numpy.sum(jax.grad(g)(x)))(jax.numpy.asarray(xn))
    np.testing.assert_allclose(np.asarray(hessian_sum), second, rtol=1e-5, atol=1e-6)
    g32 = di.differentiate_with(f, "mlx")  # (one g per signature of x, held while torch uses it)
    t = torch.tensor(xn, requires_grad=True)
    g32(t).backward()
    np.testing.assert_allclose(t.grad.numpy(), first, rtol=1e-6)
    g64 = di.differentiate_with(f, "mlx")
    t64 = torch.tensor(xn.astype(np.float64), requires_grad=True)
    y = g64(t64)
    y.backward()
    assert y.dtype == torch.float64 and t64.grad is not None and t64.grad.dtype == torch.float64


def test_an_operation_without_a_forward_rule_is_served_through_the_pullback() -> None:
    """mlx has no jvp rule for a scatter (``x.at[...].add``): a jvp and an hvp of a real x were
    refused; through the pullback they are served, equal to jax's (39; 6, 24, 8)."""

    def f(x: mx.array) -> mx.array:
        y = mx.zeros((3,)).at[mx.array([0, 2])].add(x[:2] ** 2)
        return mx.sum(y * x)

    x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    np.testing.assert_allclose(di.gradient(f, "mlx", x), [3.0, 12.0, 4.0], rtol=1e-6)
    np.testing.assert_allclose(_np(di.jvp(f, "mlx", x, x)), 39.0, rtol=1e-6)
    np.testing.assert_allclose(_np(di.hvp(f, "mlx", x, x)), [6.0, 24.0, 8.0], rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_every_product_follows_a_custom_functions_vjp_rule(backend: di.Backend) -> None:
    """mlx's forward mode ignores a ``mx.custom_function``'s ``vjp`` rule and differentiates its
    operations: a softplus whose primal overflows at 100, with the stable rule sigmoid(x), gave a
    NaN jvp, derivative and Jacobian row where its gradient reads 1; a straight-through round's
    Jacobian read round(v) where its gradient reads round(v) + v. Each product follows the rule."""

    @mx.custom_function
    def softplus(v: Any) -> Any:
        return mx.log1p(mx.exp(v))

    @softplus.vjp
    def _(v: Any, cotangent: Any, output: Any) -> Any:
        return cotangent * mx.sigmoid(v)

    @mx.custom_function
    def straight(v: Any) -> Any:
        return mx.round(v)

    @straight.vjp
    def _(v: Any, cotangent: Any, output: Any) -> Any:
        return cotangent

    x = np.array([100.0, 0.5, -3.0], dtype=np.float32)
    right = 1 / (1 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(_np(di.jvp(softplus, backend, x, np.ones(3, np.float32))), right, rtol=1e-5)
    np.testing.assert_allclose(np.diag(_np(di.jacobian(softplus, backend, x))), right, rtol=1e-5)
    np.testing.assert_allclose(_np(di.derivative(lambda s: softplus(s * mx.ones(2)), backend, 100.0)), [1.0, 1.0])
    v = np.array([0.3, 1.6], dtype=np.float32)
    np.testing.assert_allclose(np.diag(_np(di.jacobian(lambda u: straight(u) * u, backend, v))), np.round(v) + v)
    hvp = di.hvp(lambda u: mx.sum(straight(u) * u), backend, v, np.ones(2, np.float32))
    np.testing.assert_allclose(_np(hvp), [2.0, 2.0])


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_a_complex_output_of_a_real_x_pulls_back_by_the_convention(backend: di.Backend) -> None:
    """mlx's vjp of a complex power is conjugated; a real x whose output is complex pulled a
    complex cotangent back through it: the vjp of (v + i)**2 along (i, 1) read (-2, -3) where
    Re(conj(2 (v + i)) u) is (2, -3), and its Jacobian, once taken by rows, conj(2 (v + i))."""
    x = np.array([0.5, -1.5], np.float32)
    u = np.array([1j, 1], np.complex64)
    want = np.real(np.conj(2 * (x + 1j)) * u)
    for _ in range(2):  # (the first call learns the output's kind)
        np.testing.assert_allclose(_np(di.vjp(lambda v: (v + 1j) ** 2, backend, x, u)), want, rtol=1e-5)
        np.testing.assert_allclose(
            _np(di.jacobian(lambda v: (v + 1j) ** 2, backend, x)), np.diag(2 * (x + 1j)), rtol=1e-5
        )


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_a_write_by_f_into_x_leaves_the_callers_array(backend: di.Backend) -> None:
    """An mlx array takes writes (x[0] = v): f runs on arrays of its own, also outside a
    transform (a vjp's value, a Jacobian's rows), so the caller's x is never changed."""

    def f(v: Any) -> Any:
        v[0] = 10.0
        return v * v

    for call in (
        lambda x: di.vjp(f, backend, x, mx.ones(3)),
        lambda x: di.value_and_vjp(f, backend, x, mx.ones(3)),
        lambda x: di.jacobian(f, backend, x),
        lambda x: di.batched_vjp(f, backend, x, di.Tangents(mx.ones(3), mx.ones(3))),
    ):
        x = mx.array([1.0, 2.0, 3.0])
        call(x)
        np.testing.assert_array_equal(np.array(x), [1.0, 2.0, 3.0])


def test_f_that_hands_an_mlx_array_to_torch_is_told_so() -> None:
    """torch's compiled functions refuse another framework's array with their own TypeError
    ("must be Tensor, not array"), with no frame of torch's to find: said by name."""
    torch = pytest.importorskip("torch")
    with pytest.raises(di.FrameworkMismatchError, match="another framework"):
        di.gradient(lambda v: torch.sin(v).sum(), "mlx", mx.array([0.5]))


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_a_gather_through_indices_of_x_is_named(backend: di.Backend) -> None:
    """mlx's ValueError for a gather whose indices come from x (mx.argsort) reached the caller
    raw; it is an UnsupportedOperationError that says to stop the indices' gradient, and with
    mx.stop_gradient the gradient is served: each rank's weight at its entry."""
    x = np.array([0.3, -1.0, 2.0, 0.5], np.float32)
    with pytest.raises(di.UnsupportedOperationError, match="stop_gradient"):
        di.gradient(lambda v: mx.sum(mx.take(v, mx.argsort(v)) * mx.arange(4)), backend, x)
    got = di.gradient(lambda v: mx.sum(mx.take(v, mx.stop_gradient(mx.argsort(v))) * mx.arange(4)), backend, x)
    want = np.empty(4, np.float32)
    want[np.argsort(x)] = np.arange(4)
    np.testing.assert_allclose(_np(got), want)


def _a_batch_norm_write_refused(backend: Any) -> tuple[Any, Any, Any]:
    """A Constant network whose BatchNorm, in train mode, sets its running statistics: ``f``'s
    call is refused naming them and the network is left as it was; then ``(f, net, data)``,
    the network in eval mode."""
    from mlx import nn
    from mlx.utils import tree_flatten

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.norm = nn.Linear(2, 2), nn.BatchNorm(2)

        def __call__(self, v: Any) -> Any:
            return self.norm(self.lin(v))

    mx.random.seed(0)
    net, data = Net(), mx.random.normal((4, 2))
    before = {path: np.array(array) for path, array in tree_flatten(net)}

    def f(w: Any, model: Any, d: Any) -> Any:
        return mx.sum(model(d * w))

    with pytest.raises(di.MutationError, match=r"norm\.running_mean"):
        di.gradient(f, backend, mx.ones(2), di.Constant(net), di.Constant(data))
    assert all(np.array_equal(np.array(array), before[path]) for path, array in tree_flatten(net))
    net.eval()
    return f, net, data


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
def test_a_constant_module_written_under_finite_differences_is_put_back_and_refused(backend: str) -> None:
    """Finite differences watched torch modules and TensorFlow variables in a Constant, not
    mlx.nn modules: a train-mode BatchNorm moved its running statistics at every point, the
    gradient came out about 1e-4 where 0.5 is right, and the caller's module stayed changed.
    It is put back and refused by name; in eval mode finite differences give mlx's gradient."""
    f, net, data = _a_batch_norm_write_refused(backend)
    want = _np(di.gradient(f, di.AutoMLX(compile=False), mx.ones(2), di.Constant(net), di.Constant(data)))
    got = _np(di.gradient(f, "finite_differences", mx.ones(2), di.Constant(net), di.Constant(data)))
    # (differences of f computed in float32: a few parts in 1e3 of f's scale)
    np.testing.assert_allclose(got, want, atol=1e-2 * float(np.abs(want).max()))


def test_a_write_into_a_constant_module_is_put_back_and_refused() -> None:
    """Under compile=False f reaches a Constant mlx.nn module as it is: a train-mode BatchNorm
    set its running statistics in the caller's module, and an element write into a weight
    changed it, with no error. Both are put back and refused by name; in eval mode the same call
    is served."""
    from mlx import nn

    backend = di.AutoMLX(compile=False)
    f, net, data = _a_batch_norm_write_refused(backend)
    assert _np(di.gradient(f, backend, mx.ones(2), di.Constant(net), di.Constant(data))).shape == (2,)

    lin = nn.Linear(2, 1)
    weight = np.array(lin.weight)

    def g(v: Any, layer: Any) -> Any:
        layer.weight[0, 0] = 100.0
        return mx.sum(layer(v))

    with pytest.raises(di.MutationError, match="weight"):
        di.gradient(g, backend, mx.ones(2), di.Constant(lin))
    np.testing.assert_array_equal(np.array(lin.weight), weight)


def test_check_gradients_leaves_a_constant_module_as_it_was() -> None:
    """The checker's own calls of f copied torch modules only: a Constant mlx.nn module's
    train-mode BatchNorm set its running statistics in the caller's module, with no error from
    the checker. They watch it as the engines do: put back and refused by name."""
    f, net, data = _a_batch_norm_write_refused("finite_differences")
    net.train()
    before = {path: np.array(array) for path, array in tree_flatten(net)}
    with pytest.raises(di.MutationError, match=r"norm\.running_mean"):
        check_gradients(f, mx.ones(2), di.Constant(net), di.Constant(data))
    assert all(np.array_equal(np.array(array), before[path]) for path, array in tree_flatten(net))


def test_bfloat16_where_numpy_has_no_bfloat16() -> None:
    # expected: numpy's TypeError "data type 'bfloat16' not understood" came out of three places:
    # a pullback by the columns of mlx's forward mode (a complex x, or a complex output) built
    # each leaf's unit tangents as a numpy array of the leaf's dtype, and a Python float as the
    # cotangent of a bfloat16 output, or as the tangent of a bfloat16 x, was cast through numpy's
    # name of the dtype. numpy knows bfloat16 once ml_dtypes is imported (jax imports it): the
    # check runs in a process without it.
    code = """
        import sys
        import numpy as np
        import mlx.core as mx
        import diffiface as di

        x = mx.array([0.5, 1.0], dtype=mx.bfloat16)
        u = mx.array(np.array([1 + 1j, 1 + 1j], np.complex64))
        params = {"z": mx.array(np.array([1 + 2j], np.complex64)), "r": mx.array([0.5], dtype=mx.bfloat16)}

        def f(p):
            return mx.sum(mx.real(p["z"] * mx.conj(p["z"]))) + mx.sum(p["r"].astype(mx.float32) ** 2)

        for backend in (di.AutoMLX(), di.AutoMLX(compile=False)):
            got = di.vjp(lambda v: 1j * v.astype(mx.complex64) ** 2, backend, x, u)
            assert got.dtype == mx.bfloat16
            np.testing.assert_allclose(np.array(got.astype(mx.float32)), [1.0, 2.0])  # Re(conj(u) 2i x)
            grads = di.gradient(f, backend, params)
            np.testing.assert_allclose(np.array(grads["z"]), [2 + 4j])
            assert grads["r"].dtype == mx.bfloat16
            np.testing.assert_allclose(np.array(grads["r"].astype(mx.float32)), [1.0])
            pulled = di.vjp(lambda v: mx.sum(v * v), backend, x, 2.0)  # (a float: any float dtype)
            assert pulled.dtype == mx.bfloat16
            np.testing.assert_allclose(np.array(pulled.astype(mx.float32)), [2.0, 4.0])
            pushed = di.jvp(lambda v: v**3, backend, mx.array(0.5, dtype=mx.bfloat16), 1.0)
            assert pushed.dtype == mx.bfloat16 and pushed.item() == 0.75
        assert "ml_dtypes" not in sys.modules
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
def test_differentiate_with_takes_a_numpy_constant(backend: Any) -> None:
    """A numpy array in a Constant reaches f as an mlx array, on the compiled value of g as on
    the eager one: the compiled program was handed the numpy array itself, which mx.compile
    refuses with its own ValueError."""
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    c = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    f = lambda x, c: mx.sum(mx.sin(x) * c)  # noqa: E731
    xn = np.array([0.3, -1.2, 0.7], dtype=np.float32)
    g = di.differentiate_with(f, backend)
    got = jax.grad(lambda x: g(x, di.Constant(c)))(jax.numpy.asarray(xn))
    np.testing.assert_allclose(np.asarray(got), np.cos(xn) * c, rtol=1e-6)
    gt = di.differentiate_with(f, backend)
    t = torch.tensor(xn, requires_grad=True)
    gt(t, di.Constant(c)).backward()
    np.testing.assert_allclose(t.grad.numpy(), np.cos(xn) * c, rtol=1e-6)
    np.testing.assert_allclose(di.differentiate_with(f, backend)(xn, di.Constant(c)), np.sum(np.sin(xn) * c), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS, ids=IDS)
@pytest.mark.parametrize("out", [None, "label", [None], {"a": "label"}], ids=["none", "str", "list", "dict"])
def test_a_scalar_operator_refuses_an_output_that_is_no_number(backend: Any, out: Any) -> None:
    """Eagerly, an output that is no mx.array was taken for one cut from mlx's trace and f was
    evaluated again to tell: None gave an IndexError, a string an error about array families.
    It is refused as the output it is, as the other operators refuse it."""
    x = mx.array([1.0, 2.0])
    for operator in (di.gradient, di.hessian, di.value_and_gradient):
        with pytest.raises(di.InvalidOutputError):
            operator(lambda v: out, backend, x)
