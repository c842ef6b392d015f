"""Complex numbers: one convention (torch's) on every engine, the refusals, and the checker.

See docs/complex.md. The scenarios with analytic references are
``diffiface.test._complex_scenarios``; here every engine runs all of them, and the parts of
the convention that a scenario cannot state (mirroring, refusals, holomorphy, preparation,
custom rules that return the conjugate) are tested one by one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import FIRST_ORDER, SECOND_ORDER, namespace, require

import diffiface as di
from diffiface.test import check_gradients, complex_scenarios, test_differentiation
from diffiface.test._complex_scenarios import abs2_sum, conj_times, square

Z = np.array([3 + 4j, 0.5 - 1.25j, -0.75 + 0.25j])


def _as(backend_id: str, array: np.ndarray) -> Any:
    """``array`` as a user of the backend's framework passes it."""
    if backend_id.startswith("torch"):
        import torch

        return torch.tensor(array)
    return array


NO_COMPLEX = {
    "pytensor": "pytensor has no complex convention diffiface keeps: it refuses complex numbers with "
    "UnsupportedOperationError (tests/test_engine_pytensor.py checks the refusal)"
}


def require_complex(backend_id: str) -> Any:
    """``require``, skipping the engines that refuse complex numbers, with the reason."""
    if backend_id in NO_COMPLEX:
        pytest.skip(NO_COMPLEX[backend_id])
    return require(backend_id)


def _takes_complex128(backend_id: str) -> None:
    """Skip a test written for complex128 on an engine without it (mlx: complex64 only; its
    refusal of complex128 is tests/test_engine_mlx.py's test_complex128_is_refused)."""
    if backend_id == "mlx":
        pytest.skip("mlx has complex64 only and refuses complex128 (tested in tests/test_engine_mlx.py)")


def _numpy(value: Any) -> np.ndarray:
    if type(value).__module__.startswith("torch"):
        return value.detach().numpy()  # type: ignore[no-any-return]
    return np.asarray(value)


def _complex_of(re: Any, im: Any) -> Any:
    if type(re).__module__.startswith("torch"):
        import torch

        return torch.complex(re, im)
    if type(re).__module__.startswith("jax"):
        import jax

        return jax.lax.complex(re, im)
    if type(re).__module__.startswith("tensorflow"):
        import tensorflow as tf

        return tf.complex(re, im)
    return re + 1j * im


# -- every engine, every scenario -------------------------------------------------------------------


@pytest.mark.parametrize("backend_id", list(FIRST_ORDER))
def test_every_engine_on_every_complex_scenario(backend_id: str) -> None:
    backend = require_complex(backend_id)
    scenarios = complex_scenarios()
    assert {s.operator for s in scenarios} >= {"gradient", "jvp", "vjp", "jacobian", "derivative", "hvp"}
    broken: dict[str, list[str]] = {}
    refused = 0
    if backend_id == "mlx":
        # mlx has complex64 only (complex128 is refused: tests/test_engine_mlx.py), and its hvps
        # of a complex x are refused (mlx 0.32's second derivative through mx.abs of a complex
        # array is zero): those scenarios are reported skipped, never passed with wrong values
        scenarios = complex_scenarios(("complex64",))
        refused = sum(s.operator in ("hvp", "batched_hvp") for s in scenarios)
        assert refused
    # (the Cayley scenario's solve: TensorFlow's numpy API has no linalg, and it is skipped there)
    refused += sum(backend_id.startswith("tensorflow") and "tensorflow" not in s.frameworks for s in scenarios)
    report = test_differentiation([backend], scenarios, broken=broken)
    counts = report.counts()
    assert counts.get("passed", 0) + counts.get("xfailed", 0) == len(scenarios) - refused, report.summary()
    assert counts.get("skipped", 0) == refused, report.summary()
    assert counts.get("xfailed", 0) == sum(map(len, broken.values())), report.summary()


@pytest.mark.parametrize(
    "pair", ["fd-over-jax", "fd-over-torch", "jax-over-jax", "torch-over-torch", "autograd-over-autograd"]
)
def test_second_order_pairs_on_the_complex_hvp_scenarios(pair: str) -> None:
    backend = require(SECOND_ORDER[pair])
    scenarios = [s for s in complex_scenarios(("complex128",)) if s.operator in ("hvp", "gradient")]
    report = test_differentiation([backend], scenarios)
    assert report.counts().get("passed", 0) == len(scenarios), report.summary()
    z = _as("torch" if "torch" in pair else "numpy", Z)
    gradient, hvp = di.gradient_and_hvp(abs2_sum, backend, z, z)  # (a black-box outer defers the gradient)
    np.testing.assert_allclose(_numpy(gradient), 2 * Z, rtol=1e-6)
    np.testing.assert_allclose(_numpy(hvp), 2 * Z, rtol=1e-5)


# -- the convention, by its example ---------------------------------------------------------------------


@pytest.mark.parametrize("backend_id", list(FIRST_ORDER))
def test_abs2_at_3_plus_4j_is_6_plus_8j(backend_id: str) -> None:
    backend = require_complex(backend_id)
    _takes_complex128(backend_id)
    z = _as(backend_id, np.array([3 + 4j]))
    gradient = di.gradient(abs2_sum, backend, z)
    np.testing.assert_allclose(_numpy(gradient), [6 + 8j], rtol=1e-6)
    assert type(gradient) is type(z)
    assert gradient.dtype == z.dtype


@pytest.mark.parametrize("backend_id", ["jax", "torch-autograd", "autograd", "finite_differences"])
def test_a_python_complex_gives_a_python_complex(backend_id: str) -> None:
    backend = require_complex(backend_id)
    gradient = di.gradient(lambda z: abs(z) ** 2, backend, 3 + 4j)
    assert type(gradient) is complex
    assert abs(gradient - (6 + 8j)) < 1e-6
    derivative = di.derivative(square, backend, 1 + 2j)
    assert type(derivative) is complex
    assert abs(derivative - (2 + 4j)) < 1e-6


@pytest.mark.parametrize("backend_id", list(FIRST_ORDER))
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_dtype_and_array_type_mirror_x(backend_id: str, dtype: Any) -> None:
    backend = require_complex(backend_id)
    if np.dtype(dtype) == np.complex128:
        _takes_complex128(backend_id)
    z = _as(backend_id, Z.astype(dtype))
    results = [di.gradient(abs2_sum, backend, z), di.vjp(square, backend, z, z)]
    if backend_id == "mlx":  # (its hvps of a complex x are refused: tests/test_engine_mlx.py)
        with pytest.raises(di.UnsupportedOperationError):
            di.hvp(abs2_sum, backend, z, z)
    else:
        results.append(di.hvp(abs2_sum, backend, z, z))
    for result in results:
        assert type(result) is type(z)
        assert result.dtype == z.dtype
    jacobian = di.jacobian(square, backend, z)
    assert type(jacobian) is type(z) and jacobian.dtype == z.dtype
    np.testing.assert_allclose(
        _numpy(jacobian),
        np.diag(2 * Z),
        rtol=1e-3 if dtype == np.complex64 else 1e-6,
        atol=1e-3 if dtype == np.complex64 else 1e-8,
    )


@pytest.mark.parametrize("backend_id", ["jax", "torch-func", "finite_differences"])
def test_a_complex_constant_passes_through(backend_id: str) -> None:
    backend = require_complex(backend_id)
    w = np.array([1 - 1j, 2 + 0.5j, -1j])
    before = w.copy()
    gradient = di.gradient(lambda z, w: (abs(z * w) ** 2).sum(), backend, _as(backend_id, Z), di.Constant(w))
    np.testing.assert_allclose(_numpy(gradient), 2 * Z * np.abs(w) ** 2, rtol=1e-6)
    np.testing.assert_array_equal(w, before)


def test_a_mixed_tree_keeps_its_real_leaves_real() -> None:
    x = {"z": Z.copy(), "r": np.array([0.5, -2.0])}
    gradient = di.gradient(lambda p: (abs(p["z"]) ** 2).sum() * (p["r"] ** 2).sum(), "finite_differences", x)
    assert gradient["r"].dtype == np.float64 and gradient["z"].dtype == np.complex128
    np.testing.assert_allclose(gradient["z"], 2 * Z * 4.25, rtol=1e-6)
    np.testing.assert_allclose(gradient["r"], 2 * x["r"] * np.sum(np.abs(Z) ** 2), rtol=1e-6)


# -- the refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend_id", list(FIRST_ORDER))
def test_a_complex_valued_f_has_no_gradient(backend_id: str) -> None:
    backend = require_complex(backend_id)
    _takes_complex128(backend_id)
    with pytest.raises(di.InvalidOutputError, match=r"complex value.*Use jvp.*vjp"):
        di.gradient(lambda z: namespace(z).sum(z * z), backend, _as(backend_id, Z))


@pytest.mark.parametrize("backend_id", list(FIRST_ORDER))
def test_a_map_that_is_not_holomorphic_has_no_jacobian(backend_id: str) -> None:
    backend = require_complex(backend_id)
    _takes_complex128(backend_id)
    z = _as(backend_id, Z)
    with pytest.raises(di.UnsupportedOperationError, match=r"not holomorphic.*Use jvp"):
        di.jacobian(conj_times, backend, z)
    with pytest.raises(di.UnsupportedOperationError, match=r"real-valued.*use gradient"):
        di.jacobian(lambda z: namespace(z).reshape(abs2_sum(z), (1,)), backend, z)
    with pytest.raises(di.UnsupportedOperationError, match=r"not holomorphic"):
        di.derivative(conj_times, backend, _as(backend_id, np.asarray(1 + 1j)))


@pytest.mark.parametrize("backend_id", [b for b in FIRST_ORDER if b not in ("finite_differences", "scipy")])
def test_one_entry_not_holomorphic_beside_large_ones_is_found(backend_id: str) -> None:
    """An exact engine's df/dconj z is rounding: conj(z) z (not holomorphic, derivative about 5)
    beside a ten-thousandfold holomorphic z is found, where a norm of the whole block let the
    Jacobian pass, its df/dconj z dropped."""
    backend = require_complex(backend_id)
    _takes_complex128(backend_id)
    z = _as(backend_id, Z[:1])
    with pytest.raises(di.UnsupportedOperationError, match=r"not holomorphic"):
        di.jacobian(lambda z: 1e4 * square(z) + conj_times(z), backend, z)
    got = _numpy(di.jacobian(lambda z: 1e4 * square(z), backend, z))
    np.testing.assert_allclose(got, np.diag(2e4 * Z[:1]), rtol=1e-6)


def test_a_traced_complex_jacobian_is_refused_not_failed() -> None:
    """Holomorphy is checked on values, which a caller's jax.jit does not give: refused by name."""
    require("jax")
    import jax
    import jax.numpy as jnp

    z = jnp.asarray(Z.astype(np.complex64))
    with pytest.raises(di.UnsupportedOperationError, match=r"holomorphic=True"):
        jax.jit(lambda z: di.jacobian(square, "jax", z))(z)
    got = jax.jit(lambda z: di.jacobian(square, "jax", z, holomorphic=True))(z)
    np.testing.assert_allclose(np.asarray(got), np.diag(2 * Z), rtol=1e-5)


@pytest.mark.parametrize("backend_id", ["jax", "torch-autograd", "finite_differences"])
def test_holomorphic_true_takes_the_real_axis_unchecked(backend_id: str) -> None:
    """Asserted, holomorphy is not checked: the Jacobian is df/dRe z, which for conj(z) z is
    2 Re z (the honest answer to what was asked, and why the assertion is the caller's)."""
    backend = require_complex(backend_id)
    z = _as(backend_id, Z)
    np.testing.assert_allclose(_numpy(di.jacobian(square, backend, z, holomorphic=True)), np.diag(2 * Z), rtol=1e-6)
    got = _numpy(di.jacobian(conj_times, backend, z, holomorphic=True))
    np.testing.assert_allclose(got, np.diag(2 * Z.real), rtol=1e-6, atol=1e-9)


def test_holomorphic_true_compiles_with_jit_and_the_check_runs_eagerly() -> None:
    require("jax")
    import jax.numpy as jnp

    z = jnp.asarray(Z.astype(np.complex64))
    prep = di.prepare_jacobian(square, "jax", z, holomorphic=True)
    np.testing.assert_allclose(
        np.asarray(di.jacobian(square, "jax", z, prep=prep, holomorphic=True)), np.diag(2 * Z), rtol=1e-5
    )
    with pytest.raises(di.PreparationMismatchError):  # a prep for the assertion is not one for the check
        di.jacobian(square, "jax", z, prep=prep)
    checked = di.prepare_jacobian(square, "jax", z)  # the check reads values: run without jit
    np.testing.assert_allclose(np.asarray(di.jacobian(square, "jax", z, prep=checked)), np.diag(2 * Z), rtol=1e-5)
    with pytest.raises(di.UnsupportedOperationError, match="not holomorphic"):
        di.prepare_jacobian(conj_times, "jax", z)  # (preparing runs it once)


def test_the_complex_step_is_refused_on_complex_x() -> None:
    with pytest.raises(di.InvalidBackendOptionError, match=r"method='complex'.*central differences"):
        di.gradient(abs2_sum, di.AutoFiniteDifferences(method="complex"), Z)
    with pytest.raises(di.InvalidBackendOptionError, match=r"method='complex'.*tangents"):
        di.vjp(lambda x: x * (1 + 1j), di.AutoFiniteDifferences(method="complex"), np.ones(3), Z)


@pytest.mark.parametrize("backend_id", ["jax", "finite_differences"])
def test_the_hessian_is_refused_pointing_to_hvp(backend_id: str) -> None:
    backend = require_complex(backend_id)
    with pytest.raises(di.UnsupportedOperationError, match=r"Use hvp"):
        di.hessian(abs2_sum, backend, Z)
    with pytest.raises(di.UnsupportedOperationError, match=r"derivative of the derivative with holomorphy asserted"):
        di.second_derivative(square, backend, np.asarray(1 + 1j))


def test_autosparse_refuses_complex_x_with_the_reason() -> None:
    with pytest.raises(di.UnsupportedOperationError, match=r"AutoSparse does not take a complex x.*real directions"):
        di.jacobian(square, di.AutoSparse(di.AutoFiniteDifferences()), Z)


def test_a_real_cotangent_of_a_complex_output_is_the_complex_one_it_means() -> None:
    got = di.vjp(lambda x: x * (1 + 2j), "finite_differences", np.ones(2), np.ones(2))
    want = di.vjp(lambda x: x * (1 + 2j), "finite_differences", np.ones(2), np.ones(2, dtype=complex))
    np.testing.assert_allclose(got, want)
    np.testing.assert_allclose(got, [1.0, 1.0])


def test_a_real_cotangent_of_another_precision_is_refused() -> None:
    with pytest.raises(di.TangentMismatchError, match=r"cast the cotangent to complex128"):
        di.vjp(lambda x: x * (1 + 2j), "finite_differences", np.ones(2), np.ones(2, dtype=np.float32))


# -- real x, complex inside or out ------------------------------------------------------------------------


@pytest.mark.parametrize("backend_id", list(FIRST_ORDER))
def test_real_x_to_complex_y(backend_id: str) -> None:
    backend = require_complex(backend_id)
    _takes_complex128(backend_id)
    x = _as(backend_id, np.array([1.0, 2.0]))
    w = _as(backend_id, np.array([1 + 1j, -2 + 0.5j]))

    def f(x: Any) -> Any:  # x (1 + 2j), built from its parts (jax's strict promotion takes no float * complex)
        return _complex_of(x, 2 * x)

    np.testing.assert_allclose(_numpy(di.jacobian(f, backend, x)), np.diag([1 + 2j, 1 + 2j]), rtol=1e-6)
    np.testing.assert_allclose(_numpy(di.jvp(f, backend, x, x)), (1 + 2j) * np.array([1.0, 2.0]), rtol=1e-6)
    vjp = di.vjp(f, backend, x, w)  # Re(conj(J) w), real as x is
    assert not np.iscomplexobj(_numpy(vjp))
    np.testing.assert_allclose(_numpy(vjp), [3.0, -1.0], rtol=1e-6)
    derivative = di.derivative(f, backend, _as(backend_id, np.asarray(1.0)))
    np.testing.assert_allclose(_numpy(derivative), 1 + 2j, rtol=1e-6)


# -- scipy's error estimates ---------------------------------------------------------------------------


def test_scipy_estimates_the_error_of_both_parts() -> None:
    require("scipy")
    prep = di.prepare_gradient(abs2_sum, "scipy", Z)
    di.gradient(abs2_sum, "scipy", Z, prep=prep)
    error = prep.error
    assert error is not None and np.iscomplexobj(error) and error.shape == Z.shape
    assert np.all(np.isfinite(error.real)) and np.all(np.isfinite(error.imag))
    assert np.max(np.abs(error)) < 1e-6


# -- check_gradients for complex x ------------------------------------------------------------------------


def _abs2(z: Any) -> Any:
    return (abs(z) ** 2).sum()


def test_check_gradients_passes_every_engine_on_a_complex_x() -> None:
    report = check_gradients(lambda z: abs2_sum(z), Z)
    assert any(row.backend.endswith("(complex directions)") for row in report.rows)
    assert not report.failed


def test_check_gradients_catches_a_torch_rule_that_returns_the_conjugate() -> None:
    require("torch-autograd")
    import torch

    class Abs2(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, z: Any) -> Any:
            ctx.save_for_backward(z)
            return (z.abs() ** 2).sum()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (z,) = ctx.saved_tensors
            return grad * 2 * z.conj()  # the bug: jax's convention inside a torch rule

    with pytest.raises(AssertionError, match=r"conjugate of diffiface's"):
        check_gradients(Abs2.apply, torch.tensor(Z), backends=["torch"])


def test_check_gradients_catches_a_jax_rule_that_returns_the_conjugate() -> None:
    require("jax")
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def abs2(z: Any) -> Any:
        return (jnp.abs(z) ** 2).sum()

    def forward(z: Any) -> Any:
        return abs2(z), z

    def backward(z: Any, grad: Any) -> Any:
        return (grad.astype(z.dtype) * 2 * z,)  # the bug: torch's convention inside a jax rule (jax wants 2 conj(z))

    abs2.defvjp(forward, backward)
    with pytest.raises(AssertionError, match=r"conjugate of diffiface's"):
        check_gradients(abs2, jnp.asarray(Z), backends=["jax"])


def test_check_gradients_checks_an_asserted_holomorphy() -> None:
    report = check_gradients(square, Z, backends=["jax", "finite_differences"], holomorphic=True)
    assert not report.failed
    with pytest.raises(AssertionError, match=r"not holomorphic at x"):
        check_gradients(conj_times, Z, backends=["finite_differences"], holomorphic=True)


@pytest.mark.parametrize("backend_id", list(FIRST_ORDER))
def test_the_value_beside_a_complex_derivative_is_complex(backend_id: str) -> None:
    """A black-box engine computes f(x) only when asked: that value, too, is joined from its parts."""
    backend = require_complex(backend_id)
    _takes_complex128(backend_id)
    z, v = _as(backend_id, Z), _as(backend_id, Z[::-1].copy())
    value, jvp = di.value_and_jvp(square, backend, z, v)
    np.testing.assert_allclose(_numpy(value), Z * Z, rtol=1e-6)
    np.testing.assert_allclose(_numpy(jvp), 2 * Z * Z[::-1], rtol=1e-6)
    value, vjp = di.value_and_vjp(square, backend, z, v)
    np.testing.assert_allclose(_numpy(value), Z * Z, rtol=1e-6)
    np.testing.assert_allclose(_numpy(vjp), np.conj(2 * Z) * Z[::-1], rtol=1e-6)
    value, jacobian = di.value_and_jacobian(square, backend, z)
    np.testing.assert_allclose(_numpy(value), Z * Z, rtol=1e-6)
    np.testing.assert_allclose(_numpy(jacobian), np.diag(2 * Z), rtol=1e-6, atol=1e-8)
    gradient, hvp = di.gradient_and_hvp(abs2_sum, backend, z, v)
    np.testing.assert_allclose(_numpy(gradient), 2 * Z, rtol=1e-6)
    np.testing.assert_allclose(_numpy(hvp), 2 * Z[::-1], rtol=1e-6)


@pytest.mark.parametrize("backend_id", ["torch-autograd", "torch-func"])
def test_a_torch_conjugate_view_comes_back_as_numpy(backend_id: str) -> None:
    """torch.conj(z) is a lazy view numpy cannot read until resolved: numpy x, numpy result."""
    backend = require_complex(backend_id)
    import torch

    v = Z[::-1].copy()
    np.testing.assert_allclose(di.jvp(lambda z: torch.conj(z), backend, Z, v), np.conj(v))
    np.testing.assert_allclose(di.vjp(lambda z: torch.conj(z), backend, Z, v), np.conj(v))
    value, _ = di.value_and_jvp(lambda z: torch.conj(z), backend, Z, v)
    np.testing.assert_allclose(value, np.conj(Z))


def test_a_prep_made_on_real_outputs_refuses_complex_ones_later() -> None:
    """A call on real x whose f returned real values runs on the engine directly afterwards;
    an f whose output turns complex at another x of the same dtype is refused, never read as
    its real part."""
    prep = di.prepare_jvp(np.emath.sqrt, "finite_differences", np.array([4.0, 9.0]), np.ones(2))
    np.testing.assert_allclose(
        di.jvp(np.emath.sqrt, "finite_differences", np.array([4.0, 9.0]), np.ones(2), prep=prep),
        [0.25, 1 / 6],
        rtol=1e-6,
    )
    with pytest.raises(di.InvalidOutputError, match="returned real ones"):
        di.jvp(np.emath.sqrt, "finite_differences", np.array([-4.0, 9.0]), np.ones(2), prep=prep)


@pytest.mark.parametrize("backend_id", ["jax", "torch-autograd", "finite_differences"])
def test_a_function_marked_holomorphic_is_not_kept_alive(backend_id: str) -> None:
    """``holomorphic=True`` marks f in a table that must not outlive it: once the caller drops f
    (after an unprepared and a prepared call), f is collected and the table forgets it, as a
    function not so marked is."""
    import gc
    import weakref

    from diffiface import _complex

    backend = require_complex(backend_id)
    z = _as(backend_id, Z)

    def make() -> Any:
        def f(v: Any) -> Any:
            return v**2

        return f

    f = make()
    di.jacobian(f, backend, z, holomorphic=True)
    prep = di.prepare_jacobian(f, backend, z, holomorphic=True)
    np.testing.assert_allclose(
        _numpy(di.jacobian(f, backend, z, holomorphic=True, prep=prep)), np.diag(2 * Z), rtol=1e-6
    )
    reference = weakref.ref(f)
    assert id(f) in _complex._HOLOMORPHIC
    key = id(f)
    del f, prep
    gc.collect()
    assert reference() is None
    assert key not in _complex._HOLOMORPHIC
