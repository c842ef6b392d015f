"""Finite differences and scipy used as people use them: f that writes into what it is handed,
non-finite values, bad options, outputs that change shape, inputs too large to difference."""

from __future__ import annotations

import re
import types
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import diffiface as di
from diffiface._adapters import finite_differences as fd_module

pytest.importorskip("scipy", reason="these tests run the scipy backend beside finite differences")

from diffiface._adapters import scipy as scipy_module

METHODS = ("central", "forward", "backward", "complex")

# -- f that writes into its input ---------------------------------------------------------------


def _scaled_in_place(x: Any) -> Any:
    x *= 2
    return x


def _zeroed_in_place(x: Any) -> Any:
    x[0] = 0
    return x


def _added_with_out(x: Any) -> Any:
    np.add(x, 1, out=x)
    return x


WRITES: dict[str, Callable[[Any], Any]] = {
    "imul": _scaled_in_place,
    "setitem": _zeroed_in_place,
    "ufunc-out": _added_with_out,
}

# operator -> (call(f_vector, f_scalar, f_scalar_x, backend, x, t)); f_vector maps a vector to a vector
OPERATORS: dict[str, Callable[..., Any]] = {
    "gradient": lambda w, backend, x, t: di.gradient(lambda x: (w(x) ** 2).sum(), backend, x),
    "jacobian": lambda w, backend, x, t: di.jacobian(lambda x: w(x) ** 2, backend, x),
    "jvp": lambda w, backend, x, t: di.jvp(lambda x: w(x) ** 2, backend, x, t),
    "vjp": lambda w, backend, x, t: di.vjp(lambda x: w(x) ** 2, backend, x, t),
    "hvp": lambda w, backend, x, t: di.hvp(lambda x: (w(x) ** 3).sum(), backend, x, t),
    "hessian": lambda w, backend, x, t: di.hessian(lambda x: (w(x) ** 3).sum(), backend, x),
}


def _snapshot(*arrays: Any) -> list[np.ndarray]:
    return [np.array(a, copy=True) for a in arrays]


def _assert_unchanged(arrays: tuple[Any, ...], copies: list[np.ndarray]) -> None:
    for array, copy in zip(arrays, copies, strict=True):
        assert np.asarray(array).tobytes() == copy.tobytes(), "the caller's array changed"


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
@pytest.mark.parametrize("operator", list(OPERATORS), ids=list(OPERATORS))
@pytest.mark.parametrize("method", METHODS, ids=METHODS)
def test_fd_write_into_x_is_refused(method: str, operator: str, write: str) -> None:
    x = np.array([1.0, 2.0, 3.0])
    t = np.array([0.5, -1.0, 2.0])
    copies = _snapshot(x, t)
    with pytest.raises(di.MutationError, match=r"f wrote into its input x.*read-only.*di\.Cache"):
        OPERATORS[operator](WRITES[write], di.AutoFiniteDifferences(method=method), x, t)
    _assert_unchanged((x, t), copies)


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
@pytest.mark.parametrize("operator", ["gradient", "jacobian", "jvp", "vjp"])
def test_fd_vectorized_write_into_x_is_refused(operator: str, write: str) -> None:
    x = np.array([1.0, 2.0, 3.0])
    t = np.array([0.5, -1.0, 2.0])
    copies = _snapshot(x, t)
    backend = di.AutoFiniteDifferences(vectorize=True)

    def gradient(w: Callable[[Any], Any], backend: Any, x: Any, t: Any) -> Any:
        return di.gradient(lambda x: (w(x) ** 2).sum(axis=-1), backend, x)  # f broadcasts over the batch

    call = gradient if operator == "gradient" else OPERATORS[operator]
    with pytest.raises(di.MutationError, match="f wrote into its input x"):
        call(WRITES[write], backend, x, t)
    _assert_unchanged((x, t), copies)


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
@pytest.mark.parametrize("operator", list(OPERATORS), ids=list(OPERATORS))
def test_scipy_write_into_x_is_refused(operator: str, write: str) -> None:
    x = np.array([1.0, 2.0])
    t = np.array([0.5, -1.0])
    copies = _snapshot(x, t)
    with pytest.raises(di.MutationError, match="f wrote into its input x"):
        OPERATORS[operator](WRITES[write], di.AutoScipy(maxiter=2), x, t)
    _assert_unchanged((x, t), copies)


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
@pytest.mark.parametrize(
    "operator",
    ["derivative", "second_derivative"],
)
def test_scalar_operators_refuse_writes(operator: str, backend: str) -> None:
    x = np.array(1.5)
    copy = x.copy()

    def f(x: Any) -> Any:
        x += 1
        return np.stack([x, x**2])

    with pytest.raises(di.MutationError):
        getattr(di, operator)(f, backend, x)
    assert x.tobytes() == copy.tobytes()


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
def test_write_into_a_constant_is_refused_and_the_constant_kept(backend: str) -> None:
    x = np.array([1.0, 2.0])
    c = np.array([3.0, 4.0])
    copies = _snapshot(x, c)

    def f(x: Any, c: Any) -> Any:
        c[0] += 1
        return (c * x**2).sum()

    with pytest.raises(di.MutationError, match=r"di\.Constant"):
        di.gradient(f, backend, x, di.Constant(c))
    _assert_unchanged((x, c), copies)


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
def test_write_into_a_cache_is_allowed(backend: str) -> None:
    x = np.array([1.0, 2.0])
    scratch = np.zeros(2)

    def f(x: Any, scratch: Any) -> Any:
        scratch[:] = x**2
        return scratch.sum()

    grad = di.gradient(f, backend, x, di.Cache(scratch))
    np.testing.assert_allclose(grad, 2 * x, rtol=1e-6)


@pytest.mark.parametrize(
    "backend",
    ["finite_differences", "scipy", di.AutoFiniteDifferences(method="forward")],
    ids=["finite_differences", "scipy", "forward"],
)
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_value_that_f_writes_again_is_f_at_x(backend: Any, kind: str) -> None:
    """f returns its Cache (and keeps it as its aux): the value and the aux are f at x, not
    the Cache as the last perturbed point left it."""
    if kind == "torch":
        torch = pytest.importorskip("torch")
        x, scratch, t = torch.tensor([1.0, 2.0, 3.0]).double(), torch.zeros(3).double(), torch.ones(3).double()
    else:
        x, scratch, t = np.array([1.0, 2.0, 3.0]), np.zeros(3), np.ones(3)

    def f(x: Any, scratch: Any) -> Any:
        scratch[:] = x**2
        return scratch

    def with_aux(x: Any, scratch: Any) -> Any:
        return f(x, scratch).sum(), {"squares": scratch}

    squares = np.array([1.0, 4.0, 9.0])
    values = [
        di.value_and_jacobian(f, backend, x, di.Cache(scratch))[0],
        di.value_and_jvp(f, backend, x, t, di.Cache(scratch))[0],
        di.value_and_vjp(f, backend, x, t, di.Cache(scratch))[0],
        di.value_and_derivative(lambda s, c: f(s * x, c), backend, 1.0, di.Cache(scratch))[0],
        di.value_and_gradient(with_aux, backend, x, di.Cache(scratch), has_aux=True)[0][1]["squares"],
    ]
    for value in values:
        assert value is not scratch
        np.testing.assert_array_equal(np.asarray(value), squares)


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
def test_f_raising_half_way_leaves_everything_unchanged(backend: str) -> None:
    x = np.array([1.0, 2.0, 3.0])
    c = np.array([1.0, 1.0, 1.0])
    copies = _snapshot(x, c)
    calls = [0]

    def f(x: Any, c: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("half-way")
        return (c * x**2).sum()

    with pytest.raises(RuntimeError, match="half-way"):
        di.gradient(f, backend, x, di.Constant(c))
    _assert_unchanged((x, c), copies)


def test_a_foreign_read_only_error_is_not_called_a_mutation() -> None:
    """f's own read-only array, written by f: numpy's error, not a MutationError about x."""
    frozen = np.zeros(3)
    frozen.flags.writeable = False

    def f(x: Any) -> Any:
        frozen[0] = 1
        return x.sum()

    with pytest.raises(ValueError, match="read-only") as info:
        di.gradient(f, "finite_differences", 1.5)  # a Python float: f gets no numpy array
    assert not isinstance(info.value, di.MutationError)


# -- torch: the version counter ------------------------------------------------------------------


@pytest.mark.parametrize("operator", ["gradient", "jacobian", "jvp", "hvp", "hessian"])
@pytest.mark.parametrize("method", ["central", "forward", "backward"])
def test_fd_torch_write_into_x_is_refused(method: str, operator: str) -> None:
    torch = pytest.importorskip("torch")
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    t = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    copies = [x.clone(), t.clone()]

    def write(x: Any) -> Any:
        x.mul_(2)
        return x

    with pytest.raises(di.MutationError, match="version counter"):
        OPERATORS[operator](write, di.AutoFiniteDifferences(method=method), x, t)
    assert torch.equal(x, copies[0]) and torch.equal(t, copies[1])


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
def test_torch_constant_written_is_refused_and_kept(backend: str) -> None:
    torch = pytest.importorskip("torch")
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    c = torch.tensor([3.0, 4.0], dtype=torch.float64)
    before = c.clone()

    def f(x: Any, c: Any) -> Any:
        c.add_(1)
        return (c * x**2).sum()

    with pytest.raises(di.MutationError, match=r"di\.Constant"):
        di.gradient(f, backend, x, di.Constant(c))
    assert torch.equal(c, before)


def test_scipy_torch_x_is_never_handed_to_f() -> None:
    torch = pytest.importorskip("torch")
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    before = x.clone()

    def f(x: Any) -> Any:
        x.add_(1)
        return (x**2).sum()

    with pytest.raises(di.MutationError):
        di.gradient(f, "scipy", x)
    assert torch.equal(x, before)


def test_out_of_place_f_still_right_with_constants() -> None:
    x = np.array([1.0, 2.0])
    c = np.array([3.0, 4.0])
    for backend in ("finite_differences", "scipy"):
        grad = di.gradient(lambda x, c: (c * x**2).sum(), backend, x, di.Constant(c))
        np.testing.assert_allclose(grad, 2 * c * x, rtol=1e-6)


# -- non-finite values --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
def test_jvp_along_a_non_finite_tangent_is_not_masked(backend: str, bad: float) -> None:
    x = np.array([1.0, 2.0, 3.0])
    t = np.array([bad, 0.0, 0.0])
    copies = _snapshot(x, t)
    result = di.jvp(lambda x: x**2, backend, x, t)
    assert not np.isfinite(result[0])  # 2 * 1 * bad, as forward mode gives
    if backend == "finite_differences":  # outputs that do not depend on x[0] stay 0, as in forward mode
        np.testing.assert_allclose(result[1:], [0.0, 0.0])
    else:  # scipy's weights leave ~1e-14 on a constant output: 0 or non-finite, never a wrong number
        assert all(r == 0.0 or not np.isfinite(r) for r in result[1:])
    _assert_unchanged((x, t), copies)


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
def test_hvp_along_a_non_finite_tangent_is_not_masked(backend: str) -> None:
    x = np.array([1.0, 2.0])
    result = di.hvp(lambda x: (x**3).sum(), backend, x, np.array([np.inf, 0.0]))
    assert np.isinf(result[0])
    assert result[1] == 0.0 or (backend == "scipy" and not np.isfinite(result[1]))


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
def test_nan_in_x_propagates(backend: str) -> None:
    x = np.array([np.nan, 2.0])
    grad = di.gradient(lambda x: (x**2).sum(), backend, x)
    assert np.isnan(grad[0])


def test_nan_in_output_propagates() -> None:
    def f(x: Any) -> Any:
        with np.errstate(invalid="ignore"):
            return np.sqrt(x).sum()

    grad = di.gradient(f, "finite_differences", np.array([-1.0, 4.0]))
    assert np.isnan(grad).all()  # f(x) itself is nan: never masked to a number


# -- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["central", "forward", "backward"])
@pytest.mark.parametrize("operator", ["gradient", "jvp", "hvp"])
def test_fd_step_that_rounds_to_nothing_is_refused(method: str, operator: str) -> None:
    backend = di.AutoFiniteDifferences(method=method, step=1e-300)
    x = np.array([1.0, 2.0])
    with pytest.raises(
        di.InvalidBackendOptionError, match=r"step=1e-300.*too small.*smallest step that moves.*4\.44e-16"
    ):
        OPERATORS[operator](lambda x: x, backend, x, np.array([1.0, 1.0]))


def test_fd_step_too_small_for_float32() -> None:
    x = np.array([1.0, 2.0], dtype=np.float32)
    with pytest.raises(di.InvalidBackendOptionError, match="too small"):
        di.gradient(lambda x: (x**2).sum(), di.AutoFiniteDifferences(step=1e-10), x)


def test_fd_fixed_step_is_rounded_to_be_exact() -> None:
    x = np.array([1.0, 3.0], dtype=np.float32)
    grad = di.gradient(lambda x: (x**2).sum(), di.AutoFiniteDifferences(step=1e-3), x)
    np.testing.assert_allclose(grad, 2 * x, rtol=1e-3)


def test_complex_step_subnormal_is_refused() -> None:
    with pytest.raises(di.InvalidBackendOptionError, match="subnormal"):
        di.gradient(lambda x: (x**2).sum(), di.AutoFiniteDifferences(method="complex", step=1e-310), np.ones(2))


BAD_OPTIONS = [
    (lambda: di.AutoFiniteDifferences(step=float("inf")), r"step=inf"),
    (lambda: di.AutoFiniteDifferences(step=0.0), r"step=0.0"),
    (lambda: di.AutoFiniteDifferences(method="centre"), r"method='centre'"),
    (lambda: di.AutoFiniteDifferences(vectorize=1), r"vectorize=1"),
    (lambda: di.AutoFiniteDifferences(max_inputs=0), r"max_inputs=0.*>= 1"),
    (lambda: di.AutoFiniteDifferences(max_inputs=True), r"max_inputs=True"),
    (lambda: di.AutoScipy(initial_step=float("inf")), r"initial_step=inf.*finite number > 0"),
    (lambda: di.AutoScipy(initial_step=-1.0), r"initial_step=-1.0"),
    (lambda: di.AutoScipy(step_factor=1.0), r"step_factor=1.0.*> 1"),
    (lambda: di.AutoScipy(atol=-1), r"atol=-1.*>= 0"),
    (lambda: di.AutoScipy(rtol=float("nan")), r"rtol=nan"),
    (lambda: di.AutoScipy(order=True), r"order=True.*even integer"),
    (lambda: di.AutoScipy(order=5), r"order=5"),
    (lambda: di.AutoScipy(maxiter=0), r"maxiter=0.*>= 1"),
    (lambda: di.AutoScipy(maxiter=2.0), r"maxiter=2.0"),
    (lambda: di.AutoScipy(max_inputs=-5), r"max_inputs=-5"),
]


@pytest.mark.parametrize(("make", "message"), BAD_OPTIONS, ids=[m for _, m in BAD_OPTIONS])
def test_bad_options_refused_when_built(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(di.InvalidBackendOptionError, match=message):
        make()


def test_good_scipy_options_still_work() -> None:
    backend = di.AutoScipy(atol=0.0, rtol=1e-10, step_factor=np.float64(3.0), maxiter=np.int64(5))
    grad = di.gradient(lambda x: (x**2).sum(), backend, np.array([1.0, 2.0]))
    np.testing.assert_allclose(grad, [2.0, 4.0], rtol=1e-8)


# -- outputs that change shape -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
@pytest.mark.parametrize("operator", ["jacobian", "jvp", "vjp"])
def test_output_that_changes_length_is_refused(backend: str, operator: str) -> None:
    x = np.array([1e-12, 1.0, 2.0])  # near the boundary of x > 0
    t = np.array([1.0, 0.0, 0.0])
    call = {
        "jacobian": lambda f: di.jacobian(f, backend, x),
        "jvp": lambda f: di.jvp(f, backend, x, t),
        "vjp": lambda f: di.vjp(f, backend, x, np.ones(3)),
    }[operator]
    with pytest.raises(di.InvalidOutputError, match="changed shape between evaluations at nearby points"):
        call(lambda x: x[x > 0])


@pytest.mark.parametrize("method", ["forward", "backward"])
def test_output_that_changes_length_one_sided(method: str) -> None:
    x = np.array([0.0 if method == "forward" else 1e-12, 1.0])  # the step crosses 0
    with pytest.raises(di.InvalidOutputError, match="changed shape"):
        di.jacobian(lambda x: x[x > 0], di.AutoFiniteDifferences(method=method), x)


# -- sizes -------------------------------------------------------------------------------------


def test_huge_gradient_refused_before_allocating() -> None:
    x = np.zeros(10_000_000)
    calls = [0]

    def f(x: Any) -> Any:
        calls[0] += 1
        return x.sum()

    with pytest.raises(di.InputTooLargeError, match=r"10,000,000 inputs.*100,000.*check_gradients.*max_inputs"):
        di.gradient(f, "finite_differences", x)
    assert calls[0] == 0


def test_hessian_limit_is_lower() -> None:
    assert fd_module.MAX_HESSIAN_INPUTS < fd_module.MAX_INPUTS
    with pytest.raises(di.InputTooLargeError, match=r"1,001 inputs.*1,000"):
        di.hessian(lambda x: (x**2).sum(), "finite_differences", np.zeros(1_001))


def test_vectorized_limit() -> None:
    with pytest.raises(di.InputTooLargeError, match="vectorize=True"):
        di.gradient(lambda x: x.sum(axis=-1), di.AutoFiniteDifferences(vectorize=True), np.zeros(10_000))


def test_jacobian_entries_limit() -> None:
    with pytest.raises(di.InputTooLargeError, match="entries"):
        di.jacobian(lambda x: np.resize(x, 30_000), "finite_differences", np.zeros(1_000))


def test_max_inputs_lowers_or_raises_the_limit() -> None:
    x = np.ones(20)
    with pytest.raises(di.InputTooLargeError, match="limit of 10 inputs"):
        di.gradient(lambda x: (x**2).sum(), di.AutoFiniteDifferences(max_inputs=10), x)
    grad = di.hessian(lambda x: (x**2).sum(), di.AutoFiniteDifferences(max_inputs=20), x)
    np.testing.assert_allclose(grad, 2 * np.eye(20), atol=1e-4)


def test_scipy_size_limits() -> None:
    with pytest.raises(di.InputTooLargeError, match="1,001 inputs"):
        di.gradient(lambda x: (x**2).sum(), "scipy", np.zeros(scipy_module.MAX_INPUTS + 1))
    with pytest.raises(di.InputTooLargeError, match="101 inputs"):
        di.hessian(lambda x: (x**2).sum(), "scipy", np.zeros(scipy_module.MAX_SECOND_ORDER_INPUTS + 1))


def test_fd_jvp_has_no_size_limit() -> None:
    x = np.ones(200_000)
    result = di.jvp(lambda x: 3 * x, "finite_differences", x, np.ones_like(x))
    np.testing.assert_allclose(result, 3.0, rtol=1e-6)


# -- scipy's directional jvp and hvp ------------------------------------------------------------


def test_scipy_jvp_and_hvp_directional_are_right_with_errors() -> None:
    x = np.array([0.5, 1.0, 1.5, 2.0])
    t = np.array([1.0, -2.0, 0.5, 3.0])

    def f(x: Any) -> Any:
        return np.sin(x) * x.sum()

    prep = di.prepare_jvp(f, "scipy", x, t)
    result = di.jvp(f, "scipy", x, t, prep=prep)
    expected = np.cos(x) * t * x.sum() + np.sin(x) * t.sum()
    np.testing.assert_allclose(result, expected, rtol=1e-9)
    assert prep.error is not None
    hv = di.hvp(lambda x: (x**3).sum() + x[0] * x[1], "scipy", x, t)
    expected_hv = 6 * x * t + np.array([t[1], t[0], 0.0, 0.0])
    np.testing.assert_allclose(hv, expected_hv, rtol=1e-8)


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
def test_a_constant_module_written_by_f_is_put_back_and_refused(backend: str) -> None:
    """A torch module in a Constant is read-only data: a batch norm in training mode (its running
    statistics) and a parameter set in place were left written, also where f raised, and every
    later point of the differences saw the moved weights. Put back bit for bit and refused."""
    if backend == "scipy":
        pytest.importorskip("scipy")
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    batch = torch.randn(8, 3, dtype=torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.ones(4, dtype=torch.float64)

    def loss(v: Any, m: Any, b: Any) -> Any:
        return (m(b) * v).sum()

    def writes(v: Any, m: Any, b: Any) -> Any:
        with torch.no_grad():
            m[0].weight.mul_(2.0)
        return (m.eval()(b) * v).sum()

    def raises(v: Any, m: Any, b: Any) -> Any:
        m(b)
        raise ValueError("f's own failure")

    for f in (loss, writes, raises):
        model.train()
        with pytest.raises(di.MutationError, match="module"):
            di.gradient(f, backend, x, di.Constant(model), di.Constant(batch))
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), name
    model.eval()
    got = di.gradient(loss, backend, x, di.Constant(model), di.Constant(batch))
    torch.testing.assert_close(got, model(batch).sum(0).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
@pytest.mark.parametrize("change", ["parameter", "mode", "mode-then-raise"])
def test_a_constant_module_changed_by_f_at_a_later_point_is_put_back_and_refused(backend: str, change: str) -> None:
    """f that sets a new parameter into a Constant module, or switches it to train mode (a
    dropout), at the second point of the differences: a gradient twice the right one, or of
    the order of 1e4, with no error, and the caller's module left changed."""
    if backend == "scipy":
        pytest.importorskip("scipy")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Dropout(0.5)).double().eval()
    weight = model[0].weight
    x = torch.randn(3, dtype=torch.float64)
    calls = [0]

    def f(x: Any, m: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            if change == "parameter":
                m[0].weight = torch.nn.Parameter(2 * m[0].weight.detach())
            else:
                m.train()
                if change == "mode-then-raise":
                    raise ValueError("f's own failure")
        return m(x).sum()

    with pytest.raises(di.MutationError, match="train or eval mode; put back"):
        di.gradient(f, backend, x, di.Constant(model))
    assert model[0].weight is weight and not model.training and not model[1].training


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
def test_a_module_an_object_in_a_constant_holds_is_watched(backend: str) -> None:
    """di.Constant(trainer) whose trainer.model is a train-mode BatchNorm: its running
    statistics moved at every point, with no error, and stayed moved."""
    if backend == "scipy":
        pytest.importorskip("scipy")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = types.SimpleNamespace(model=model)
    batch = torch.randn(8, 3, dtype=torch.float64)

    def loss(v: Any, trainer: Any, batch: Any) -> Any:
        return (trainer.model(batch) * v).sum()

    with pytest.raises(di.MutationError, match="running_mean"):
        di.gradient(loss, backend, torch.ones(4, dtype=torch.float64), di.Constant(trainer), di.Constant(batch))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
def test_a_complex_modules_parameters_are_differenced_as_real_ones(backend: str) -> None:
    """A complex nn.Parameter was refused as "inside a torch differentiation": its real and
    imaginary parts, taken keeping its graph, read as an outer one. Differenced as a real
    parameter is, and equal to torch's gradient; an outer torch differentiation of the
    differences is still refused (it would lose their part of the derivative)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3, dtype=torch.complex128)
    batch = torch.randn(5, 4, dtype=torch.complex128)

    def loss(p: Any, m: Any, b: Any) -> Any:
        return torch.func.functional_call(m, p, (b,)).abs().pow(2).sum()

    params = dict(layer.named_parameters())
    expected = di.gradient(loss, "torch", params, di.Constant(layer), di.Constant(batch))
    got = di.gradient(loss, backend, params, di.Constant(layer), di.Constant(batch))
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-7)
    assert not any(leaf.requires_grad for leaf in got.values())

    def outer(w: Any) -> Any:
        inner = di.gradient(lambda v: (v.abs() ** 2).sum(), backend, w)
        return inner.real.sum()

    with pytest.raises(di.UnsupportedOperationError, match="inside a torch differentiation"):
        di.gradient(outer, "torch", params["bias"])


# -- steps along a tangent on inputs of mixed scales ------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_fd_jvp_step_follows_the_inputs_the_tangent_moves(method: str) -> None:
    """A large input the tangent does not move leaves the step along the others their own size."""
    backend = di.AutoFiniteDifferences(method=method)
    x, t = np.array([1e8, 0.5]), np.array([0.0, 1.0])
    tolerance = 1e-9 if method in ("central", "complex") else 1e-6
    assert di.jvp(lambda x: np.sin(x[1]), backend, x, t) == pytest.approx(np.cos(0.5), abs=tolerance)


def test_fd_jvp_of_a_pytree_with_a_large_leaf() -> None:
    params = {"w": np.array([0.3, -1.2]), "n": 5e5}
    tangent = {"w": np.ones(2), "n": 0.0}

    def loss(p: Any) -> Any:
        return np.tanh(3 * p["w"]).sum() + 1e-6 * p["n"]

    expected = (3 / np.cosh(3 * params["w"]) ** 2).sum()
    assert di.jvp(loss, "finite_differences", params, tangent) == pytest.approx(expected, rel=1e-8)


def test_fd_jvp_step_is_small_on_each_moved_input() -> None:
    """Both inputs moved, one large: the step is bounded by the small one's scale."""
    x, t = np.array([1e8, 0.5]), np.array([1e-8, 1.0])
    expected = np.cos(1e8) * 1e-8 + np.cos(0.5)
    got = di.jvp(lambda x: np.sin(x[0]) + np.sin(x[1]), "finite_differences", x, t)
    assert got == pytest.approx(expected, rel=1e-8)


@pytest.mark.parametrize(
    "backend", ["finite_differences", di.SecondOrder(di.AutoFiniteDifferences(), di.AutoFiniteDifferences())]
)
def test_fd_hvp_step_follows_the_inputs_the_tangent_moves(backend: Any) -> None:
    x, t = np.array([1e8, 0.5]), np.array([0.0, 1.0])
    got = di.hvp(lambda x: np.sin(x[1]), backend, x, t)
    np.testing.assert_allclose(got, [0.0, -np.sin(0.5)], atol=1e-5)


# -- the complex step on an f that is not analytic ---------------------------------------------


def _real_of_abs(x: Any) -> Any:
    return np.sum(np.abs(x) ** 2)


def _real_part(x: Any) -> Any:
    return np.sum(x.real**2)


@pytest.mark.parametrize("f", [_real_of_abs, _real_part], ids=["abs", "real"])
@pytest.mark.parametrize("vectorize", [False, True], ids=["pointwise", "vectorized"])
@pytest.mark.parametrize("operator", ["gradient", "jvp", "jacobian"])
def test_complex_step_refuses_a_real_output(f: Callable[[Any], Any], vectorize: bool, operator: str) -> None:
    """A real output at a complex point carries no imaginary part: refused, never f(x) / h."""
    backend = di.AutoFiniteDifferences(method="complex", vectorize=vectorize)
    if vectorize:
        f = {_real_of_abs: lambda x: np.sum(np.abs(x) ** 2, axis=-1), _real_part: lambda x: np.sum(x.real**2, axis=-1)}[
            f
        ]
    x = np.array([1.0, 2.0])
    call = {
        "gradient": lambda: di.gradient(f, backend, x),
        "jvp": lambda: di.jvp(f, backend, x, np.ones(2)),
        "jacobian": lambda: di.jacobian(f, backend, x),
    }[operator]
    with pytest.raises(di.InvalidBackendOptionError, match=r"not analytic.*method='central'"):
        call()


def test_complex_step_names_the_real_output_leaf() -> None:
    backend = di.AutoFiniteDifferences(method="complex")
    with pytest.raises(di.InvalidBackendOptionError, match=r"output leaf 1 \(float64, shape \(2,\)\)"):
        di.jacobian(lambda x: (np.sin(x), np.abs(x)), backend, np.array([1.0, 2.0]))


def test_complex_step_of_an_analytic_f_is_still_exact() -> None:
    got = di.gradient(
        lambda x: np.sum(np.sqrt(x * x) * np.sin(x)), di.AutoFiniteDifferences(method="complex"), np.array([1.0, 2.0])
    )
    x = np.array([1.0, 2.0])
    np.testing.assert_allclose(got, np.sin(x) + x * np.cos(x), rtol=1e-14)


# -- scipy promotes float32 numpy inputs, arrays and scalars -----------------------------------


@pytest.mark.parametrize("make", [np.float32, lambda v: np.array(v, np.float32)], ids=["scalar", "array"])
def test_scipy_evaluates_float32_numpy_inputs_in_float64(make: Callable[[float], Any]) -> None:
    x = make(0.7)

    def f(t: Any) -> Any:
        return np.sin(t) * t

    second = di.second_derivative(f, "scipy", x)
    assert np.asarray(second).dtype == np.float32
    assert float(second) == pytest.approx(2 * np.cos(0.7) - 0.7 * np.sin(0.7), rel=1e-6)
    hv = di.hvp(f, "scipy", x, make(1.0))
    assert float(hv) == pytest.approx(2 * np.cos(0.7) - 0.7 * np.sin(0.7), rel=1e-6)


# -- scipy's own verdict on its estimates ------------------------------------------------------


SCIPY_FAILURES = {
    "no-convergence": (lambda: di.gradient(lambda x: np.sum(np.sin(1e4 * x)), "scipy", np.array([1e-5])), "status -1"),
    "maxiter": (lambda: di.gradient(lambda x: np.sum(2.0 * x), "scipy", np.array([1e15])), "status -2"),
    "domain": (lambda: di.gradient(lambda x: np.sum(np.log(x)), "scipy", np.array([0.1])), "status -3"),
    # (every step lost to rounding: newer scipy reports the 0 it then estimates as converged)
    "derivative": (lambda: di.derivative(lambda t: 2.0 * t, "scipy", 1e17), "lost to rounding"),
    "gradient-lost": (lambda: di.gradient(lambda x: np.sum(2.0 * x), "scipy", np.array([1e17])), "lost to rounding"),
    "float32-lost": (
        lambda: di.gradient(lambda x: np.sum(2.0 * x), "scipy", np.array([1e17], np.float32)),
        "lost to rounding",
    ),
    "second-lost": (lambda: di.second_derivative(lambda t: t**3, "scipy", 1e17), "lost to rounding"),
    "hessian": (lambda: di.hessian(lambda x: np.sum(x**2 * x[0]), "scipy", np.array([1e17, 1.0])), "lost to rounding"),
    "jvp-lost": (lambda: di.jvp(lambda x: 2.0 * x, "scipy", np.array([1e17]), np.ones(1)), "lost to rounding"),
    "hvp-lost": (lambda: di.hvp(lambda x: np.sum(x**2), "scipy", np.array([1e17]), np.ones(1)), "lost to rounding"),
}


@pytest.mark.parametrize("case", SCIPY_FAILURES)
def test_scipy_failures_are_refused(case: str) -> None:
    """An estimate scipy itself reports as failed, or a step lost to rounding, is refused with
    the entry of x and the way out; never returned (95.5 for 9950, 0 for 2)."""
    call, words = SCIPY_FAILURES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (log of the negative points scipy tries)
        with pytest.raises(di.InvalidBackendOptionError, match=re.escape(words)) as info:
            call()
    assert "initial_step" in str(info.value) and "of x (x_" in str(info.value)


def test_scipy_constant_directions_are_still_zero() -> None:
    """Outputs that do not depend on x have derivative exactly 0 along any tangent."""
    got = di.jvp(lambda x: (np.sin(x), np.ones(2)), "scipy", np.array([0.3, 0.5]), np.ones(2))
    np.testing.assert_allclose(got[0], np.cos([0.3, 0.5]), rtol=1e-8)
    assert np.array_equal(got[1], np.zeros(2))


def test_scipy_initial_step_near_the_scale_of_x_succeeds() -> None:
    got = di.gradient(lambda x: np.sum(2.0 * x), di.AutoScipy(initial_step=1e14), np.array([1e15]))
    np.testing.assert_allclose(got, [2.0], rtol=1e-8)


def test_fd_python_float_beside_float32_takes_float32_steps() -> None:
    """A Python float in x computes in float32 beside a float32 array: a step sized for float64
    was lost in float32's rounding (the cross term of the Hessian off by 0.4%)."""

    def f(x: dict[str, Any]) -> Any:
        return np.sum(np.sin(x["v"]) * x["b"])

    x = {"v": np.array([0.7], np.float32), "b": 1.3}
    h = di.hessian(f, "finite_differences", x)
    np.testing.assert_allclose(h["v"]["b"], [np.cos(0.7)], rtol=2e-4)
    np.testing.assert_allclose(di.gradient(f, "finite_differences", x)["b"], np.sin(0.7), rtol=2e-5)


def _float32_inside(v: np.ndarray) -> Any:
    """A float64 x, a float32 computation: its values are rounded to float32's precision."""
    w = v.astype(np.float32)
    return np.sum(np.sin(w) * np.exp(w))


@pytest.mark.parametrize("method", ["central", "forward"])
def test_fd_steps_are_bounded_by_the_precision_f_computes_in(method: str) -> None:
    """An f computing in float32 from a float64 x got steps chosen for float64 (eps**(1/4) about
    1e-4 for a Hessian), which float32's rounding swamps: the Hessian came out wrong by 210%,
    with no error. f(x)'s own dtype bounds the steps now."""
    x = np.array([0.7, -0.3, 1.1])
    gradient = np.exp(x) * (np.cos(x) + np.sin(x))
    hessian_diagonal = 2 * np.cos(x) * np.exp(x)
    backend = di.AutoFiniteDifferences(method=method)
    np.testing.assert_allclose(di.gradient(_float32_inside, backend, x), gradient, rtol=2e-3)
    np.testing.assert_allclose(np.diag(di.hessian(_float32_inside, backend, x)), hessian_diagonal, rtol=5e-3)
    # a float64 f keeps its float64 steps: as accurate as before
    g64 = di.gradient(lambda v: np.sum(np.sin(v) * np.exp(v)), backend, x)
    np.testing.assert_allclose(g64, gradient, rtol=1e-9 if method == "central" else 1e-6)


def test_fd_steps_of_mlx_float64_are_float32s() -> None:
    """mlx's float64 sin and exp are accurate to float32 only (its family's FLOAT64_PRECISION):
    steps for float64 gave a Hessian 21% off on one entry, with no error."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    x = np.array([0.7, -0.3, 1.1])
    hessian_diagonal = 2 * np.cos(x) * np.exp(x)
    got = di.hessian(lambda v: mx.sum(mx.sin(v) * mx.exp(v)), "finite_differences", mx.array(x, dtype=mx.float64))
    np.testing.assert_allclose(np.diag(np.array(got)), hessian_diagonal, rtol=5e-3)
