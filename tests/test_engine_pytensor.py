"""The pytensor engine: f written with pytensor.tensor, traced once per prep and compiled.

Most tests compile with mode="FAST_COMPILE" (the results are the same; the compiles quicker);
the default mode (numba in PyTensor 3.0) is exercised by the project's parametrised tests and the scenarios.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import pytest

import diffiface as di

pt = pytest.importorskip("pytensor.tensor")
pytensor = pytest.importorskip("pytensor")

QUICK = di.AutoPyTensor(mode="FAST_COMPILE")


def logp(params: dict[str, Any], data: dict[str, Any]) -> Any:
    mu = data["X"] @ params["beta"]
    sigma = pt.exp(params["log_sigma"])
    return pt.sum(-0.5 * ((data["y"] - mu) / sigma) ** 2 - pt.log(sigma)) - 0.5 * pt.sum(params["beta"] ** 2)


def _data(dtype: Any = np.float64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"X": rng.normal(size=(20, 3)).astype(dtype), "y": rng.normal(size=20).astype(dtype)}


def _expected_logp_grad(params: dict[str, np.ndarray], data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    X, y = data["X"].astype(np.float64), data["y"].astype(np.float64)
    beta, s = params["beta"].astype(np.float64), float(params["log_sigma"])
    r = y - X @ beta
    return {
        "beta": X.T @ r / np.exp(2 * s) - beta,
        "log_sigma": np.asarray(np.sum(r**2) / np.exp(2 * s) - len(y)),
    }


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gradient_of_a_log_density_keeps_structure_and_dtype(dtype: Any) -> None:
    data = _data(dtype)
    params = {"beta": np.array([0.3, -0.2, 0.1], dtype=dtype), "log_sigma": np.array(0.2, dtype=dtype)}
    before = {k: v.copy() for k, v in params.items()}, {k: v.copy() for k, v in data.items()}
    value, grad = di.value_and_gradient(logp, QUICK, params, di.Constant(data))
    expected = _expected_logp_grad(params, data)
    rtol = 1e-10 if dtype == np.float64 else 1e-4
    assert set(grad) == {"beta", "log_sigma"}
    for key in grad:
        assert type(grad[key]) is np.ndarray and grad[key].dtype == dtype and grad[key].shape == params[key].shape
        np.testing.assert_allclose(grad[key], expected[key], rtol=rtol, atol=rtol)
    assert np.asarray(value).dtype == dtype
    for saved, now in zip(before, (params, data), strict=True):  # nothing mutated
        for key in saved:
            np.testing.assert_array_equal(saved[key], now[key])


def test_new_context_values_run_the_same_compiled_function(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffiface._adapters import pytensor as adapter

    compiles = []
    real = adapter._function
    monkeypatch.setattr(adapter, "_function", lambda *a, **k: compiles.append(1) or real(*a, **k))
    x = np.array([0.5, -1.0, 2.0])

    def f(x: Any, c: Any, s: Any) -> Any:
        return pt.sum(pt.sin(x) * c) * s

    prep = di.prepare_gradient(f, QUICK, x, di.Constant(np.ones(3)), di.Constant(np.float64(2.0)))
    assert len(compiles) == 1
    for c, s in ((np.arange(3.0), 0.5), (np.full(3, -1.0), 3.0)):
        got = di.gradient(f, QUICK, x, di.Constant(c), di.Constant(np.float64(s)), prep=prep)
        np.testing.assert_allclose(got, np.cos(x) * c * s, rtol=1e-12)
    assert len(compiles) == 1


def test_a_float_constant_is_a_python_number_of_the_graph() -> None:
    # expected: f's arithmetic on a Python float Constant is Python's, as numpy's would be (a
    # float32 variable made of it first gave 0.125 for the derivative 1000000.1 - 1e6 = 0.1);
    # a new value is a new graph of its own, never the old one's
    x = np.array([0.3, -0.7], np.float32)

    def f(v: Any, c: Any) -> Any:
        return pt.sum(v * (c - 1e6))

    prep = di.prepare_gradient(f, QUICK, x, di.Constant(1000000.1), strict=False)
    for c in (1000000.1, 1000000.3):
        got = di.gradient(f, QUICK, x, di.Constant(c), prep=prep)
        np.testing.assert_allclose(got, [c - 1e6] * 2, rtol=1e-6)


def test_a_float_beside_leaves_of_two_dtypes_keeps_float64_exact() -> None:
    # (the float was made a float32 array after x's first leaf: the float64 leaf's derivative
    # came out 0.10000000149011612)
    x = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([3.0])}

    def f(x: Any, s: Any) -> Any:
        return pt.sum(x["a"] * s) + pt.sum(x["b"] * s)

    prep = di.prepare_gradient(f, QUICK, x, di.Constant(0.1))
    for s in (0.1, 0.3):
        grad = di.gradient(f, QUICK, x, di.Constant(s), prep=prep)
        assert grad["b"][0] == s
        np.testing.assert_allclose(grad["a"], [s, s], rtol=1e-6)


def test_static_contexts_compile_once_per_value() -> None:
    def f(x: Any, power: int) -> Any:
        return pt.sum(x**power)

    x = np.array([1.0, 2.0])
    prep = di.prepare_gradient(f, QUICK, x, di.Constant(2))
    np.testing.assert_allclose(di.gradient(f, QUICK, x, di.Constant(2), prep=prep), 2 * x)
    np.testing.assert_allclose(di.gradient(f, QUICK, x, di.Constant(3), prep=prep), 3 * x**2)


def test_every_operator_against_closed_forms() -> None:
    x = np.array([0.3, -0.7, 1.1])
    t = np.array([1.0, 0.5, -2.0])

    def f(x: Any) -> Any:
        return pt.sum(pt.sin(x) * x**2)

    def g(x: Any) -> Any:
        return {"a": pt.exp(x), "b": [x[0] * x[1]]}

    d1 = np.cos(x) * x**2 + 2 * x * np.sin(x)
    d2 = -np.sin(x) * x**2 + 4 * x * np.cos(x) + 2 * np.sin(x)
    np.testing.assert_allclose(di.gradient(f, QUICK, x), d1, rtol=1e-12)
    np.testing.assert_allclose(di.hessian(f, QUICK, x), np.diag(d2), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(di.hvp(f, QUICK, x, t), d2 * t, rtol=1e-12)
    jac = di.jacobian(g, QUICK, x)
    np.testing.assert_allclose(jac["a"], np.diag(np.exp(x)), rtol=1e-12)
    np.testing.assert_allclose(jac["b"][0], [x[1], x[0], 0.0], rtol=1e-12)
    jvp = di.jvp(g, QUICK, x, t)
    np.testing.assert_allclose(jvp["a"], np.exp(x) * t, rtol=1e-12)
    np.testing.assert_allclose(jvp["b"][0], x[1] * t[0] + x[0] * t[1], rtol=1e-12)
    vjp = di.vjp(g, QUICK, x, {"a": t, "b": [np.array(2.0)]})
    np.testing.assert_allclose(vjp, np.exp(x) * t + 2 * np.array([x[1], x[0], 0.0]), rtol=1e-12)
    assert di.derivative(lambda s: pt.sin(s) * s, QUICK, 0.4) == pytest.approx(np.cos(0.4) * 0.4 + np.sin(0.4))
    second = di.second_derivative(lambda s: pt.sin(s) * s, QUICK, 0.4)
    assert isinstance(second, float) and second == pytest.approx(-np.sin(0.4) * 0.4 + 2 * np.cos(0.4))


def test_unused_input_gets_zeros() -> None:
    grad = di.gradient(lambda x: pt.sum(x["used"] ** 2), QUICK, {"used": np.ones(2), "unused": np.ones(3)})
    np.testing.assert_array_equal(grad["unused"], np.zeros(3))
    np.testing.assert_array_equal(grad["used"], 2 * np.ones(2))


def test_complex_numbers_are_refused() -> None:
    with pytest.raises(di.UnsupportedOperationError, match="complex"):
        di.gradient(lambda z: pt.sum(pt.abs(z) ** 2), QUICK, np.array([3 + 4j]))
    with pytest.raises(di.UnsupportedOperationError, match="complex"):
        di.jacobian(lambda x: x * (1 + 1j), QUICK, np.array([1.0, 2.0]))


def test_python_control_flow_on_values_is_refused_with_the_fix() -> None:
    def f(x: Any) -> Any:
        if pt.sum(x) > 0:
            return pt.sum(x)
        return -pt.sum(x)

    with pytest.raises(di.FrameworkMismatchError, match="switch"):
        di.gradient(f, QUICK, np.ones(2))


def test_numpy_functions_are_refused_with_the_fix() -> None:
    with pytest.raises(di.FrameworkMismatchError, match=r"pytensor\.tensor"):
        di.gradient(lambda x: np.sum(np.tanh(x)), QUICK, np.ones(2))


def test_evaluating_a_symbolic_variable_inside_f_is_refused_with_the_fix() -> None:
    """``.eval()`` on x inside f raised PyTensor's own MissingInputError: x has no value while f
    builds its graph."""
    c = np.array([1.0, 2.0])
    for call in (
        lambda: di.gradient(lambda x: pt.sum(x) * float(x[0].eval()), QUICK, np.ones(2)),
        lambda: di.hessian(lambda x, c: pt.sum(x * c.eval()), QUICK, np.ones(2), di.Constant(c)),
        lambda: di.jvp(lambda x: x * x.eval(), QUICK, np.ones(2), np.ones(2)),
    ):
        with pytest.raises(di.FrameworkMismatchError, match="symbolic"):
            call()


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(di.InvalidBackendOptionError, match="FAST_COMPILE"):
        di.AutoPyTensor(mode="DEBUG")


def test_preparation_in_many_threads() -> None:
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            x = np.linspace(0.0, 1.0, 3 + k)
            results[k] = di.gradient(lambda x: pt.sum(pt.tanh(x) * x), QUICK, x)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for k, got in results.items():
        x = np.linspace(0.0, 1.0, 3 + k)
        np.testing.assert_allclose(got, np.tanh(x) + x / np.cosh(x) ** 2, rtol=1e-12)


def test_one_prep_called_from_many_threads_at_once() -> None:
    # A compiled function keeps its arguments and outputs in storage of its own between setting
    # and reading them: calls from threads at once must not take each other's values.
    def f(x: Any) -> Any:
        return pt.sum(pt.tanh(x) * x)

    prep = di.prepare_gradient(f, QUICK, np.zeros(10))
    wrong: list[int] = []
    errors: list[BaseException] = []

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        for _ in range(300):
            x = rng.normal(size=10)
            try:
                got = di.gradient(f, QUICK, x, prep=prep)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
                continue
            if not np.allclose(got, np.tanh(x) + x / np.cosh(x) ** 2, rtol=1e-12):
                wrong.append(k)  # pragma: no cover - reported below

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads switch often: a race shows within these calls)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, f"{len(wrong)} wrong gradients"
    assert not errors, errors


def _scaled_tanh(x: Any, c: Any, s: Any) -> Any:
    return pt.sum(pt.tanh(x) * s) * pt.sum(c**2)


def _scaled_tanh_grad(x: Any, c: np.ndarray, s: float) -> np.ndarray:
    x64 = np.asarray(x, dtype=np.float64)
    return (1 - np.tanh(x64) ** 2) * s * np.sum(c**2)  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", [QUICK, "pytensor"], ids=["FAST_COMPILE", "default"])
def test_the_compiled_function_gets_only_the_prepared_shapes_and_dtypes(backend: Any) -> None:
    # The compiled function does not check its arguments (trust_input): the plan does, and a
    # call of another shape or dtype never reaches it. Compiled code would read other bytes.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 4)).astype(np.float32)
    c = rng.normal(size=5)
    prep = di.prepare_gradient(_scaled_tanh, backend, x, di.Constant(c), di.Constant(0.5))
    others: dict[str, Any] = {
        "float64": x.astype(np.float64),
        "big-endian": x.astype(">f4"),
        "another shape": rng.normal(size=(4, 3)).astype(np.float32),
        "a numpy scalar": np.float32(0.3),
        "a 0-d array": np.array(0.3, dtype=np.float32),
    }
    for name, other in others.items():
        with pytest.raises(di.PreparationMismatchError):
            di.gradient(_scaled_tanh, backend, other, di.Constant(c), di.Constant(0.5), prep=prep)
        if backend is not QUICK:  # (each compiles anew: the default mode's compiles take long)
            continue
        got = di.gradient(_scaled_tanh, backend, other, di.Constant(c), di.Constant(0.5))  # prepared anew
        assert type(got) is type(other) and got.shape == other.shape, name  # (a numpy scalar's a numpy scalar)
        assert got.dtype == other.dtype.newbyteorder("="), name
        tol = 1e-12 if np.asarray(other).dtype == np.float64 else 1e-5
        np.testing.assert_allclose(got, _scaled_tanh_grad(other, c, 0.5), rtol=tol, atol=tol, err_msg=name)
    for context in (c.astype(np.float32), c[:4], np.float64(2.0)):
        with pytest.raises(di.PreparationMismatchError):
            di.gradient(_scaled_tanh, backend, x, di.Constant(context), di.Constant(0.5), prep=prep)
    with pytest.raises(di.PreparationMismatchError):
        di.gradient(_scaled_tanh, backend, x, di.Constant(c), di.Constant(np.float64(0.5)), prep=prep)
    # The prepared shape and dtype in any layout, and new values: the same function, right values.
    big = rng.normal(size=(6, 8)).astype(np.float32)
    frozen = x.copy()
    frozen.setflags(write=False)
    for name, value in {
        "strided": big[::2, ::2],
        "Fortran order": np.asfortranarray(big[:3, :4]),
        "read-only": frozen,
    }.items():
        new_c, new_s = rng.normal(size=5), float(rng.normal())
        got = di.gradient(_scaled_tanh, backend, value, di.Constant(new_c), di.Constant(new_s), prep=prep)
        assert type(got) is np.ndarray and got.dtype == np.float32 and got.shape == (3, 4), name
        np.testing.assert_allclose(got, _scaled_tanh_grad(value, new_c, new_s), rtol=1e-5, atol=1e-5, err_msg=name)


def test_results_of_computed_and_kept_leaves() -> None:
    # aux holds values the compiled function does not compute (an int, a string) beside arrays
    def f(x: Any) -> Any:
        return pt.sum(x**2), {"n": 3, "tag": "ok", "twice": 2 * x}

    x = np.array([0.5, -1.0, 2.0])
    prep = di.prepare_value_and_gradient(f, QUICK, x, has_aux=True)
    for point in (x, x + 1.0):
        (value, aux), grad = di.value_and_gradient(f, QUICK, point, has_aux=True, prep=prep)
        assert value == pytest.approx(np.sum(point**2))
        assert aux["n"] == 3 and aux["tag"] == "ok"
        np.testing.assert_allclose(aux["twice"], 2 * point, rtol=1e-12)
        np.testing.assert_allclose(grad, 2 * point, rtol=1e-12)


def test_default_mode_agrees() -> None:
    data = _data()
    params = {"beta": np.array([0.1, 0.2, 0.3]), "log_sigma": np.array(-0.1)}
    grad = di.gradient(logp, "pytensor", params, di.Constant(data))
    expected = _expected_logp_grad(params, data)
    for key in grad:
        np.testing.assert_allclose(grad[key], expected[key], rtol=1e-10)


@pytest.mark.parametrize("where", ["x", "constant"])
def test_float16_that_numba_cannot_compile_is_refused_with_the_modes_that_can(where: str) -> None:
    """numba, the default mode's linker, has no float16: a diffiface error naming the modes that
    compile without it, not numba's bare NotImplementedError."""
    half = np.array([1.0, 2.0], dtype=np.float16)
    x, contexts = (half, ()) if where == "x" else (half.astype(np.float32), (di.Constant(half),))
    pytest.importorskip("numba")
    with pytest.raises(di.UnsupportedOperationError, match=r"float16.*mode='CVM'"):
        di.gradient(lambda x, *c: pt.sum(x**2), "pytensor", x, *contexts)
    grad = di.gradient(lambda x, *c: pt.sum(x**2), di.AutoPyTensor(mode="CVM"), x, *contexts)
    np.testing.assert_array_equal(grad, 2 * x)


def test_differentiate_with_inside_jax_and_torch() -> None:
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    c = np.array([1.0, 2.0, 3.0])

    def f(x: Any, c: Any) -> Any:
        return pt.sin(x) * c

    x = np.array([0.1, 0.2, 0.3], dtype=np.float32)
    g = di.differentiate_with(f, QUICK)
    got = jax.grad(lambda z: jax.numpy.sum(g(z, di.Constant(c))))(jax.numpy.asarray(x))
    np.testing.assert_allclose(np.asarray(got), np.cos(x) * c, rtol=1e-5)
    g64 = di.differentiate_with(f, QUICK)
    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    g64(xt, di.Constant(c)).sum().backward()
    assert xt.grad is not None and xt.grad.dtype == torch.float64
    np.testing.assert_allclose(xt.grad.numpy(), np.cos(x.astype(np.float64)) * c, rtol=1e-12)
    with pytest.raises(di.UnsupportedOperationError, match="first order only"):
        jax.hessian(lambda z: jax.numpy.sum(g(z, di.Constant(c))))(jax.numpy.asarray(x))
    # jax's Jacobians batch g's products through its flat Jacobian, whose reshape PyTensor took
    # only with a tuple (a bare -1 raised inside f's trace, a first-order call refused)
    # (x and f(x) of one dtype: the products are a flat Jacobian's)
    h = di.differentiate_with(lambda v: pt.sin(v) * v, QUICK)
    for jacobian in (jax.jacrev, jax.jacfwd):
        got = jacobian(h)(jax.numpy.asarray(x))
        np.testing.assert_allclose(np.asarray(got), np.diag(np.cos(x) * x + np.sin(x)), rtol=1e-5)


def test_differentiate_with_called_on_numpy_gives_numbers() -> None:
    """g called on numpy, outside any outer engine, is f's value: its graph of constants
    evaluated, never the symbolic variable f builds."""
    c = np.array([1.0, 2.0, 3.0])
    x = np.array([0.3, -1.2, 0.7])
    g = di.differentiate_with(lambda v, c: pt.sum(pt.sin(v) * c), QUICK)
    y = g(x, di.Constant(c))
    assert isinstance(y, np.ndarray) and y.dtype == np.float64 and y.shape == ()
    np.testing.assert_allclose(y, np.sum(np.sin(x) * c), rtol=1e-12)
    tree = di.differentiate_with(lambda p: {"s": pt.sin(p["a"]), "t": (p["a"] * 2.0,)}, QUICK)({"a": x})
    np.testing.assert_allclose(tree["s"], np.sin(x), rtol=1e-12)
    np.testing.assert_allclose(tree["t"][0], 2 * x, rtol=1e-12)


def test_complex_numbers_inside_f_are_refused() -> None:
    """PyTensor's gradients through complex operations follow no convention (an angle's read as
    zero, others raise its own TypeError): a complex value anywhere on f's graph is refused."""
    x = np.array([0.3, 0.8])
    for f in (
        lambda v: pt.sum(pt.angle(v + 1j * (1 + v))),
        lambda v: pt.sum(pt.real(pt.exp(1j * v))),
    ):
        with pytest.raises(di.UnsupportedOperationError, match="complex"):
            di.gradient(f, "pytensor", x)
    with pytest.raises(di.UnsupportedOperationError, match="complex"):
        di.gradient(lambda v, c: pt.sum(pt.real(v * c)), "pytensor", x, di.Constant(1j))


def test_numpy_functions_on_x_are_refused_and_its_elementwise_ones_work() -> None:
    """numpy takes a symbolic variable for one object: np.linalg.norm(x) would be the norm of
    one number, a graph whose derivative is not f's. It is refused; numpy's elementwise
    functions (np.sin(x)) are PyTensor's own operations on x, and right."""
    x = np.array([0.3, 0.8, -0.5])
    with pytest.raises(di.FrameworkMismatchError, match="numpy function"):
        di.gradient(lambda v: pt.sum(np.linalg.norm(v)) ** 2, "pytensor", x)
    got = di.gradient(lambda v: pt.sum(np.sin(v) * v + np.multiply(v, v)), "pytensor", x)
    np.testing.assert_allclose(got, np.cos(x) * x + np.sin(x) + 2 * x, rtol=1e-12)
    # a numpy matrix or vector f closes over, on the left of an operator (a design matrix)
    design = np.arange(15.0).reshape(5, 3) / 10
    weights = np.array([1.0, -2.0, 0.5])
    got = di.gradient(lambda v: pt.sum(design @ v) + weights @ v + pt.sum((weights - v) ** 2), "pytensor", x)
    np.testing.assert_allclose(got, design.sum(0) + weights - 2 * (weights - x), rtol=1e-12)
    got = di.gradient(lambda v: pt.sum(np.maximum(weights, v) + weights / v), "pytensor", x)
    np.testing.assert_allclose(got, (x > weights) - weights / x**2, rtol=1e-12)
    # a numpy scalar on the left (np.float64(2.0) * x)
    got = di.gradient(lambda v: pt.sum(np.float64(2.0) * v + np.float32(3.0) + v), "pytensor", x)
    np.testing.assert_allclose(got, np.full(3, 3.0), rtol=1e-12)


def test_numpy_functions_on_what_f_derives_from_x_are_refused_too() -> None:
    """Only x's own variables refused numpy: np.linalg.norm(2 * x) was the absolute value of
    each entry (4.0 for a norm of 5.1, the gradient of sum |x|), and the Jacobian of
    np.linalg.norm(x - 1) a matrix. Every variable refuses while f is traced; numpy's
    elementwise functions on derived variables are PyTensor's own."""
    x = np.array([0.5, -1.5, 2.0])
    for f in (lambda v: pt.sum(np.linalg.norm(2.0 * v)) / 2, lambda v: np.linalg.norm(v - 1.0)):
        with pytest.raises(di.FrameworkMismatchError, match="numpy function"):
            di.gradient(f, "pytensor", x)
    with pytest.raises(di.FrameworkMismatchError, match="numpy function"):
        di.jacobian(lambda v: np.linalg.norm(v - 1.0), "pytensor", x)
    got = di.gradient(lambda v: pt.sum(np.sin(2.0 * v)), "pytensor", x)
    np.testing.assert_allclose(got, 2 * np.cos(2 * x), rtol=1e-12)
    # numpy's functions PyTensor has no operation for, its methods, and its writes: refused by name
    for f, what in (
        (lambda v: pt.sum(np.hypot(v, 1.0)), "np.hypot has no PyTensor operation"),
        (lambda v: pt.sum(np.add.accumulate(v)), "np.add.accumulate"),
        (lambda v: (np.add(v, 1.0, out=v), pt.sum(v**2))[1], "out="),
    ):
        with pytest.raises(di.FrameworkMismatchError, match=what):
            di.gradient(f, "pytensor", x)
    # outside a trace, a TensorVariable is as pytensor made it
    assert "__array__" not in pt.TensorVariable.__dict__


def test_an_empty_tree_as_x() -> None:
    """x = {} has no leaves to trace: every operator recursed into itself (RecursionError)."""
    assert di.gradient(lambda v: pt.as_tensor(1.0), "pytensor", {}) == {}
    assert di.hessian(lambda v: pt.as_tensor(1.0), "pytensor", {}) == {}
    value, grad = di.value_and_gradient(lambda v: pt.as_tensor(2.0), "pytensor", {})
    assert float(value) == 2.0 and grad == {}


def test_an_empty_leaf_of_x_leaves_the_other_blocks_right() -> None:
    """An empty leaf's blocks hold no number (zeros of their shape); the other leaves' blocks
    are differentiated as ever."""
    x = {"empty": np.zeros((0,)), "b": np.array([1.0, 2.0])}
    hessian = di.hessian(lambda p: pt.sum(p["b"] ** 3) + pt.sum(p["empty"]), "pytensor", x)
    np.testing.assert_allclose(hessian["b"]["b"], np.diag(6 * x["b"]))
    assert hessian["empty"]["b"].shape == (0, 2) and hessian["b"]["empty"].shape == (2, 0)
    jacobian = di.jacobian(lambda p: p["b"] ** 2, "pytensor", x)
    np.testing.assert_allclose(jacobian["b"], np.diag(2 * x["b"]))
    assert jacobian["empty"].shape == (2, 0)


def test_an_output_whose_shape_follows_x_values_is_refused_at_a_new_x() -> None:
    # a graph traced where x[x > 0] had 2 entries ran at an x where it has 3: numba's raw
    # ValueError reached the caller
    def positive(x: Any) -> Any:
        return x[(x > 0).nonzero()]

    np.testing.assert_array_equal(di.vjp(positive, "pytensor", np.array([1.0, -1.0, 2.0]), np.ones(2)), [1, 0, 1])
    with pytest.raises(di.UnsupportedOperationError, match=r"shape depends on x's\s+values"):
        di.vjp(positive, "pytensor", np.array([1.0, 1.0, 2.0]), np.ones(2))


def test_a_shared_variable_as_x_is_refused_without_naming_its_own_backend() -> None:
    shared = pytensor.shared(np.array([1.0, 2.0, 3.0]))
    with pytest.raises(di.ArrayTypeError, match=r"Pass numpy arrays\.$"):
        di.gradient(lambda x: pt.sum(x**2), "pytensor", shared)


def test_a_float_constant_of_minus_zero_is_not_taken_for_zero() -> None:
    # expected: a static float is known by its bits: -0.0 == 0.0 in Python, and the graph built
    # for 0.0 was reused for -0.0, so atan2(c, -1) read +pi where it is -pi
    def f(v: Any, c: Any) -> Any:
        return pt.sum(v) * pt.arctan2(c, -1.0)

    for c in (0.0, -0.0, 0.0):
        got = di.gradient(f, QUICK, np.ones(2), di.Constant(c))
        np.testing.assert_allclose(got, [np.arctan2(c, -1.0)] * 2)


def test_an_operation_without_a_second_derivative_is_named() -> None:
    # expected: PyTensor's NullTypeGradError (pt.prod's gradient has no gradient; a jvp here is
    # two pullbacks) came out raw; it is an UnsupportedOperationError, and the Jacobian, whose
    # rows are plain gradients, is still served, right
    x = np.array([0.3, -1.2, 2.0])

    def f(v: Any) -> Any:
        return pt.prod(v) * v

    for call in (lambda: di.jvp(f, QUICK, x, np.ones(3)), lambda: di.hessian(lambda v: pt.prod(v), QUICK, x)):
        with pytest.raises(di.UnsupportedOperationError, match="no derivative"):
            call()
    p = np.prod(x)
    want = np.diag(np.full(3, p)) + np.outer(x, p / x)
    np.testing.assert_allclose(di.jacobian(f, QUICK, x), want, rtol=1e-12)


def test_a_python_float_cotangent_of_a_float32_output() -> None:
    # a Python number is taken as a cotangent of any float dtype: while the program is traced it
    # is a float64 symbolic variable, cast to the output's float32 by pytensor (numpy's asarray
    # of it was refused as f handing a symbolic variable to numpy)
    x = np.array([0.5, -1.0, 2.0], dtype=np.float32)

    def f(t: Any) -> Any:
        return pt.sum(t**2)

    got = di.vjp(f, QUICK, x, 2.0)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, 4.0 * x)
    value, pulled = di.value_and_vjp(lambda t: (pt.sum(t**2), 3 * t), QUICK, x, (2.0, np.ones(3, np.float32)))
    assert value[0].dtype == np.float32
    np.testing.assert_allclose(pulled, 4.0 * x + 3.0)


def test_a_numpy_scalar_constant_after_a_0d_array_is_converted() -> None:
    """A prep made for a 0-d array in a Constant, which the compiled function took as it was,
    handed a later numpy scalar (which fits the signature) to it unconverted: numba's error."""

    def f(x: Any, c: Any) -> Any:
        return pt.sum(x["a"] * x["b"] * c) + pt.sum(x["u"] ** 2 * c)

    x = {"a": np.asarray(0.7), "b": np.asarray(1.3), "u": np.array([0.1, 0.2])}
    prep = di.prepare_gradient(f, "pytensor", x, di.Constant(np.asarray(2.0)))
    di.gradient(f, "pytensor", x, di.Constant(np.asarray(2.0)), prep=prep)
    g = di.gradient(f, "pytensor", x, di.Constant(np.float64(-3.5)), prep=prep)
    np.testing.assert_allclose(g["a"], -3.5 * 1.3, rtol=1e-12)
    np.testing.assert_allclose(g["u"], -7.0 * x["u"], rtol=1e-12)
