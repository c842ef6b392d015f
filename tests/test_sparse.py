"""AutoSparse: sparse Jacobians and Hessians on every engine (detection, coloring, decompression).

The sparse scenarios run through the suite's own machinery (``test_differentiation``) on
AutoSparse of every engine with every detector; the rest checks what the scenarios do not:
result types, ``dense=True``, pytrees, preparation, the value forms, option validation, the
number of engine products per Jacobian, mutation, wrong patterns and the opt-in check.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
from conftest import FIRST_ORDER

import diffiface as di
import diffiface._batched as batched
import diffiface._operators as operators
from diffiface import sparse
from diffiface._adapters import info
from diffiface.test import assert_allclose, default_tolerances, run_sparse, sparse_scenarios

HAS_JAX = importlib.util.find_spec("jax") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_jax = pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")


def tridiagonal(x: Any) -> Any:
    """y_i = 2 x_i**2 - x_{i-1} - x_{i+1}**3 (a tridiagonal Jacobian), by slicing only."""
    y = 2 * x**2
    middle = y[1:-1] - x[:-2] - x[2:] ** 3
    return (y[:1] - x[1:2] ** 3, middle, y[-1:] - x[-2:-1])


def chain(x: Any) -> Any:
    return ((x[1:] - x[:-1]) ** 2).sum() + (x**4).sum()


def tridiagonal_pattern(n: int) -> np.ndarray:
    rows, cols = np.indices((n, n))
    return np.abs(rows - cols) <= 1


# -- the scenarios, through test_differentiation -----------------------------------------------------


@pytest.mark.parametrize("engine", list(FIRST_ORDER.values()), ids=list(FIRST_ORDER))
def test_sparse_scenarios(engine: di.Backend) -> None:
    if not di.available(engine):
        pytest.skip(f"{engine.name} is not installed")
    report = run_sparse([engine], quick=True)
    assert not report.failed, report.summary()
    counts = report.counts()
    # every scenario ran with the global, local and known detectors (scipy's local Hessian
    # patterns, dense adaptive Hessians, are skipped with the reason: too slow for a test)
    scenarios = sparse_scenarios(quick=True)
    expected = 3 * len(scenarios)
    assert counts.get("passed", 0) + counts.get("skipped", 0) == expected
    hessians = sum("hessian" in s.operator for s in scenarios)
    if isinstance(engine, di.AutoPyTensor):  # (it runs the scenarios written for every framework's numpy_like)
        foreign = sum(not {"numpy", "jax", "torch", "autograd"} <= s.frameworks for s in scenarios)
    else:
        family = None if engine.black_box else info(engine).arrays
        foreign = sum(family is not None and family not in s.frameworks for s in scenarios)  # another engine's code
    assert counts.get("skipped", 0) == (hessians if isinstance(engine, di.AutoScipy) else 0) + 3 * foreign, (
        report.table()
    )


def test_scenario_references_are_right() -> None:
    """The analytic references agree with a dense engine (the scenarios' own truth)."""
    for scenario in sparse_scenarios():
        own = {"torch": "torch", "autograd": "autograd"}
        engine = next((own[k] for k in own if k in scenario.frameworks and di.available(own[k])), None)
        engine = engine or (
            "autograd" if di.available("autograd") and "numpy" not in scenario.frameworks else "finite_differences"
        )
        result = getattr(di, scenario.operator)(scenario.f, engine, *scenario.arguments())
        assert_allclose(result, scenario.reference, rtol=1e-5, atol=1e-5)
        assert scenario.pattern.shape[1] == int(np.prod(np.shape(np.asarray(scenario.x))))


# -- result types ---------------------------------------------------------------------------------


def test_numpy_gives_scipy_csr() -> None:
    import scipy.sparse

    x = np.linspace(0.1, 1.0, 8)
    backend = di.AutoSparse("finite_differences", detector=sparse.KnownPattern(tridiagonal_pattern(8)))
    jac = di.jacobian(tridiagonal, backend, x)
    assert isinstance(jac, scipy.sparse.csr_array)
    assert jac.shape == (8, 8) and jac.dtype == np.float64 and jac.nnz == 22
    dense = di.jacobian(tridiagonal, "finite_differences", x)
    expected = np.concatenate(dense)
    np.testing.assert_allclose(jac.toarray(), expected, rtol=1e-7, atol=1e-9)


@needs_torch
@pytest.mark.parametrize("mode", ["autograd", "func"])
def test_torch_gives_sparse_csr_tensor(mode: str) -> None:
    import torch

    x = torch.linspace(0.1, 1.0, 8, dtype=torch.float32)
    jac = di.jacobian(tridiagonal, di.AutoSparse(di.AutoTorch(mode=mode)), x)
    assert jac.layout == torch.sparse_csr and jac.dtype == torch.float32 and tuple(jac.shape) == (8, 8)
    dense = di.jacobian(tridiagonal, di.AutoTorch(mode=mode), x)
    expected = torch.cat(dense)
    torch.testing.assert_close(jac.to_dense(), expected)


@needs_jax
def test_jax_gives_bcoo() -> None:
    import jax.numpy as jnp
    from jax.experimental import sparse as jax_sparse

    x = jnp.linspace(0.1, 1.0, 8, dtype=jnp.float32)
    prep = di.prepare_jacobian(tridiagonal, di.AutoSparse("jax"), x)
    route = prep.plan.program.sparse.route
    assert type(route).__name__ == "_CompiledRoute"  # one compiled program, no silent fallback
    assert type(route.products).__module__ == "diffiface.sparse._jax_products"
    jac = di.jacobian(tridiagonal, di.AutoSparse("jax"), x, prep=prep)
    assert isinstance(jac, jax_sparse.BCOO) and jac.dtype == jnp.float32 and jac.shape == (8, 8)
    dense = di.jacobian(tridiagonal, "jax", x)
    expected = np.concatenate([np.asarray(block) for block in dense])
    np.testing.assert_allclose(np.asarray(jac.todense()), expected, *default_tolerances("float32"))
    hess = di.hessian(chain, di.AutoSparse("jax"), x)
    assert isinstance(hess, jax_sparse.BCOO) and hess.shape == (8, 8)
    np.testing.assert_allclose(
        np.asarray(hess.todense()), np.asarray(di.hessian(chain, "jax", x)), *default_tolerances("float32")
    )


@pytest.mark.parametrize("name", ["jax", "torch-autograd", "autograd", "finite_differences"])
def test_dense_true_is_the_dense_operators_result(name: str) -> None:
    engine = FIRST_ORDER[name]
    if not di.available(engine):
        pytest.skip(f"{name} is not installed")
    x = {"a": np.linspace(0.1, 1.0, 5), "b": np.linspace(0.5, 2.0, 6).reshape(3, 2)}

    def f(x: Any) -> Any:
        return {"u": x["a"][1:] * x["a"][:-1], "v": x["b"] ** 2 * x["a"][:3, None]}

    def g(x: Any) -> Any:
        return (x["a"][1:] * x["a"][:-1]).sum() + (x["b"][:, 0] ** 3 * x["a"][:3]).sum()

    tolerance = {"rtol": 1e-5, "atol": 1e-5}
    assert_allclose(di.jacobian(f, di.AutoSparse(engine, dense=True), x), di.jacobian(f, engine, x), **tolerance)
    assert_allclose(di.hessian(g, di.AutoSparse(engine, dense=True), x), di.hessian(g, engine, x), **tolerance)


def test_pytrees_flatten_in_ravel_order() -> None:
    x = {"b": np.linspace(1.0, 2.0, 3), "a": np.linspace(0.1, 0.4, 2)}

    def f(x: Any) -> Any:
        return [x["a"] * 2.0, x["b"][:2] * x["a"]]

    flat, unravel = di.tree.ravel(x)
    jac = di.jacobian(f, di.AutoSparse("finite_differences"), x)
    expected = di.jacobian(lambda v: di.tree.ravel(f(unravel(v)))[0], "finite_differences", flat)
    assert jac.shape == (4, 5)
    np.testing.assert_allclose(jac.toarray(), expected, atol=1e-9)


def test_float32_stays_float32_and_mixed_promotes() -> None:
    x32 = np.linspace(0.1, 1.0, 6).astype(np.float32)
    backend = di.AutoSparse("autograd", detector=sparse.LocalDetector())
    assert di.jacobian(tridiagonal, backend, x32).dtype == np.float32
    mixed = {"a": x32, "b": np.ones(2)}
    assert di.jacobian(lambda x: x["a"] * x["b"].sum(), backend, mixed).dtype == np.float64


def test_scipy_evaluates_a_float32_x_in_float64_as_its_dense_operator() -> None:
    # the compressed route once rounded x + S z to float32: its Jacobian was off by about 1e-3
    def f(x: Any) -> Any:
        return np.concatenate([x[1:] * x[0] - np.sin(x[:-1]), [np.sum(x**2)]])

    x = np.random.default_rng(5).normal(size=6).astype(np.float32)
    x64 = x.astype(np.float64)
    expected = np.zeros((6, 6))
    expected[np.arange(5), np.arange(1, 6)] = x64[0]
    expected[np.arange(5), 0] += x64[1:]
    expected[np.arange(5), np.arange(5)] -= np.cos(x64[:-1])
    expected[5] = 2 * x64
    value, jac = di.value_and_jacobian(f, di.AutoSparse("scipy"), x)
    assert jac.dtype == np.float32 and value.dtype == np.float32
    np.testing.assert_array_equal(value, f(x))
    np.testing.assert_allclose(jac.toarray(), expected, atol=1e-6)


# -- preparation -----------------------------------------------------------------------------------


def test_prep_is_reused_and_strict() -> None:
    x = np.linspace(0.1, 1.0, 6)
    backend = di.AutoSparse("finite_differences")
    prep = di.prepare_jacobian(tridiagonal, backend, x)
    assert prep.coloring.count == 3 and prep.pattern.shape == (6, 6)
    first = di.jacobian(tridiagonal, backend, x, prep=prep)
    second = di.jacobian(tridiagonal, backend, 2 * x, prep=prep)
    assert not np.allclose(first.toarray(), second.toarray())
    with pytest.raises(di.PreparationMismatchError, match="shape"):
        di.jacobian(tridiagonal, backend, np.ones(7), prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="dtype"):
        di.jacobian(tridiagonal, backend, x.astype(np.float32), prep=prep)
    with pytest.raises(di.PreparationMismatchError):
        di.jacobian(lambda v: tridiagonal(v), backend, x, prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="backend"):
        di.jacobian(tridiagonal, "finite_differences", x, prep=prep)
    loose = di.prepare_jacobian(tridiagonal, backend, x, strict=False)
    assert di.jacobian(tridiagonal, backend, np.ones(7), prep=loose).shape == (7, 7)


def test_unprepared_calls_detect_once_per_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = sparse.detect  # what a sparse operator's preparation calls

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(sparse, "detect", counting)

    def f(x: Any) -> Any:  # a function of its own: no earlier call prepared it
        return tridiagonal(x)

    x = np.linspace(0.1, 1.0, 6)
    backend = di.AutoSparse("finite_differences")
    for _ in range(3):
        di.jacobian(f, backend, x)
    assert len(calls) == 1
    di.jacobian(f, backend, np.ones(9))
    assert len(calls) == 2


# -- value forms and the other operators --------------------------------------------------------------


@pytest.mark.parametrize("name", ["jax", "torch-func", "finite_differences", "scipy"])
def test_value_forms(name: str) -> None:
    engine = FIRST_ORDER[name]
    if not di.available(engine):
        pytest.skip(f"{name} is not installed")
    x = np.linspace(0.1, 1.0, 6)
    y, jac = di.value_and_jacobian(tridiagonal, di.AutoSparse(engine), x)
    assert_allclose(y, tridiagonal(x))
    assert jac.shape == (6, 6)
    value, gradient, hess = di.value_gradient_and_hessian(chain, di.AutoSparse(engine), x)
    dense_value, dense_gradient, dense_hess = di.value_gradient_and_hessian(chain, engine, x)
    assert_allclose(value, dense_value)
    assert_allclose(gradient, dense_gradient, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(hess.toarray(), dense_hess, rtol=1e-5, atol=1e-6)


def test_other_operators_use_the_wrapped_backend() -> None:
    x = np.linspace(0.1, 1.0, 4)
    backend = di.AutoSparse("finite_differences")
    assert_allclose(di.gradient(chain, backend, x), di.gradient(chain, "finite_differences", x))
    prep = di.prepare_jvp(tridiagonal, backend, x, x)
    assert_allclose(di.jvp(tridiagonal, backend, x, x, prep=prep), di.jvp(tridiagonal, "finite_differences", x, x))
    assert di.available(backend) == di.available("finite_differences")


# -- options -----------------------------------------------------------------------------------------


def test_options_are_validated() -> None:
    with pytest.raises(di.InvalidBackendOptionError, match="coloring"):
        di.AutoSparse("jax", coloring="diagonal")  # type: ignore[arg-type]
    with pytest.raises(di.InvalidBackendOptionError, match="detector"):
        di.AutoSparse("jax", detector="global")
    with pytest.raises(di.InvalidBackendOptionError, match="dense"):
        di.AutoSparse("jax", dense=1)  # type: ignore[arg-type]
    with pytest.raises(di.InvalidBackendOptionError, match="order"):
        di.AutoSparse("jax", order="random")
    with pytest.raises(di.InvalidBackendOptionError, match="reverse mode"):
        di.AutoSparse("finite_differences", coloring="row")
    with pytest.raises(di.InvalidBackendOptionError):
        di.AutoSparse(di.AutoSparse("jax"))  # type: ignore[arg-type]
    with pytest.raises(di.UnknownBackendError):
        di.AutoSparse("no-such-engine")
    backend = di.AutoSparse("torch-func")
    assert backend.backend == di.AutoTorch(mode="func")
    assert repr(backend) == "AutoSparse(AutoTorch(mode='func'), detector=GlobalDetector())"
    assert hash(backend) == hash(di.AutoSparse(di.AutoTorch(mode="func")))


def test_wrong_pattern_shape_is_refused() -> None:
    x = np.linspace(0.1, 1.0, 6)
    with pytest.raises(di.InvalidInputError, match="shape"):
        di.jacobian(tridiagonal, di.AutoSparse("finite_differences", detector=sparse.KnownPattern(np.eye(5))), x)
    with pytest.raises(di.InvalidInputError, match="rows"):
        di.jacobian(tridiagonal, di.AutoSparse("finite_differences", detector=sparse.KnownPattern(np.eye(4, 6))), x)


def test_check_catches_a_pattern_that_misses_nonzeros() -> None:
    x = np.linspace(0.1, 1.0, 6)
    missing = sparse.KnownPattern(np.eye(6, dtype=bool))
    # without the check, the missing entries are silently absent (documented)
    assert di.jacobian(tridiagonal, di.AutoSparse("autograd", detector=missing), x).nnz == 6
    with pytest.raises(di.DiffifaceError, match="misses nonzeros"):
        di.jacobian(tridiagonal, di.AutoSparse("autograd", detector=missing, check=True), x)
    right = di.AutoSparse("autograd", detector=sparse.KnownPattern(tridiagonal_pattern(6)), check=True)
    assert di.jacobian(tridiagonal, right, x).nnz == 16


# -- cost: one batch of products for the colors --------------------------------------------------------


@pytest.mark.parametrize(
    ("coloring", "product"),
    [("column", "value_and_batched_jvp"), ("row", "value_and_batched_vjp")],
    ids=["column", "row"],
)
def test_one_batch_of_products_for_the_colors(monkeypatch: pytest.MonkeyPatch, coloring: str, product: str) -> None:
    """The colors' products are one batched call (one product per color in it, on autograd a loop)."""
    batches: list[int] = []
    original = getattr(batched, product)

    def counting(f: Any, backend: Any, x: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        batches.append(len(batch))
        return original(f, backend, x, batch, *args, **kwargs)

    x = np.linspace(0.1, 1.0, 40)
    backend = di.AutoSparse("autograd", coloring=coloring)  # type: ignore[arg-type]
    prep = di.prepare_jacobian(tridiagonal, backend, x)
    monkeypatch.setattr(batched, product, counting)
    di.jacobian(tridiagonal, backend, x, prep=prep)
    assert prep.coloring.count == 3 and batches == [3]


@needs_torch
@pytest.mark.parametrize("coloring", ["column", "row"])
def test_the_colors_are_one_vmapped_program_on_torch_func(coloring: str) -> None:
    """On torch.func a sparse Jacobian evaluates f once for all its colors."""
    import torch

    calls = []

    def banded(x: Any) -> Any:
        calls.append(1)
        return torch.cat([x[:1] ** 2, x[1:] * x[:-1], x[-1:] * 3.0])

    x = torch.linspace(0.1, 1.0, 40, dtype=torch.float64)
    backend = di.AutoSparse(di.AutoTorch(mode="func"), coloring=coloring)  # type: ignore[arg-type]
    prep = di.prepare_jacobian(banded, backend, x)
    calls.clear()
    result = di.jacobian(banded, backend, x, prep=prep)
    assert prep.coloring.count >= 2 and len(calls) == 1
    assert_allclose(result.to_dense(), di.jacobian(banded, di.AutoTorch(mode="func"), x))


@pytest.mark.parametrize("operator", ["hessian", "value_gradient_and_hessian"])
@pytest.mark.parametrize("engine", ["autograd", "finite_differences", "torch", "torch-func"])
def test_the_colors_of_a_hessian_are_one_batched_hvp(
    monkeypatch: pytest.MonkeyPatch, engine: str, operator: str
) -> None:
    """One batched hvp for every color (not one hvp per color), equal to the dense Hessian."""
    backend: Any = di.AutoTorch(mode="func") if engine == "torch-func" else engine
    if not di.available(backend):
        pytest.skip(f"{engine} is not installed")
    batches: list[int] = []
    single: list[int] = []
    original, original_single = batched.batched_hvp, operators.hvp

    def counting(f: Any, backend: Any, x: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        batches.append(len(batch))
        return original(f, backend, x, batch, *args, **kwargs)

    def counting_single(*args: Any, **kwargs: Any) -> Any:
        single.append(1)
        return original_single(*args, **kwargs)

    x: Any = np.linspace(0.1, 1.0, 40)
    if engine.startswith("torch"):
        import torch

        x = torch.from_numpy(x)
    sparse_backend = di.AutoSparse(backend)
    prep = getattr(di, "prepare_" + operator)(chain, sparse_backend, x)
    monkeypatch.setattr(batched, "batched_hvp", counting)
    monkeypatch.setattr(operators, "hvp", counting_single)
    result = getattr(di, operator)(chain, sparse_backend, x, prep=prep)
    assert prep.coloring.count == 3 and batches == [3] and not single
    # (the exact Hessian; second differences are good to about 1e-6 here)
    tolerances = {"rtol": 1e-5, "atol": 1e-6} if engine == "finite_differences" else {}
    hessian = result if operator == "hessian" else result[2]
    hessian = np.asarray(hessian.to_dense() if engine.startswith("torch") else hessian.toarray())
    assert_allclose(hessian, _chain_hessian(np.linspace(0.1, 1.0, 40)), **tolerances)
    if operator == "value_gradient_and_hessian":
        value, gradient, _ = di.value_gradient_and_hessian(chain, backend, x)
        assert_allclose(result[0], value, **tolerances)
        assert_allclose(result[1], gradient, **tolerances)


def _chain_hessian(x: np.ndarray) -> np.ndarray:
    """The Hessian of :func:`chain`: 2 D.T D + diag(12 x**2), D the forward differences."""
    differences = np.diff(np.eye(x.size), axis=0)
    return 2 * differences.T @ differences + np.diag(12 * x**2)


@needs_torch
@pytest.mark.parametrize(("operator", "evaluations"), [("hessian", 1), ("value_gradient_and_hessian", 2)])
def test_a_sparse_hessian_on_torch_func_evaluates_f_once_for_its_colors(operator: str, evaluations: int) -> None:
    """torch.func: the colors are one vmapped program, f evaluated once in it; the value and
    gradient of value_gradient_and_hessian are one more evaluation."""
    import torch

    calls = []

    def counted(x: Any) -> Any:
        calls.append(1)
        return chain(x)

    x = torch.linspace(0.1, 1.0, 40, dtype=torch.float64)
    backend = di.AutoSparse(di.AutoTorch(mode="func"))
    prep = getattr(di, "prepare_" + operator)(counted, backend, x)
    calls.clear()
    result = getattr(di, operator)(counted, backend, x, prep=prep)
    assert prep.coloring.count == 3 and len(calls) == evaluations
    hessian = result if operator == "hessian" else result[2]
    assert_allclose(hessian.to_dense(), di.hessian(chain, di.AutoTorch(mode="func"), x))


def test_finite_differences_evaluate_f_twice_per_color() -> None:
    evaluations = []

    def counted(x: Any) -> Any:
        evaluations.append(1)
        return tridiagonal(x)

    x = np.linspace(0.1, 1.0, 200)
    backend = di.AutoSparse("finite_differences", detector=sparse.KnownPattern(tridiagonal_pattern(200)))
    prep = di.prepare_jacobian(counted, backend, x)
    evaluations.clear()
    di.jacobian(counted, backend, x, prep=prep)
    # central differences: two evaluations per color (and at most one at x), not 2 * 200
    assert len(evaluations) <= 2 * 3 + 3


# -- nothing mutated -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["jax", "torch-autograd", "autograd", "finite_differences", "scipy"])
def test_nothing_mutated(name: str) -> None:
    engine = FIRST_ORDER[name]
    if not di.available(engine):
        pytest.skip(f"{name} is not installed")
    x = np.linspace(0.1, 1.0, 6)
    scale = np.array([2.0])
    x_copy, scale_copy = x.copy(), scale.copy()

    def f(x: Any, scale: Any) -> Any:
        return scale * x[1:] * x[:-1]

    di.jacobian(f, di.AutoSparse(engine), x, di.Constant(scale))

    def broken(x: Any, scale: Any) -> Any:
        raise ValueError("f failed")

    with pytest.raises(ValueError, match="f failed"):
        di.jacobian(broken, di.AutoSparse(engine, detector=sparse.KnownPattern(np.eye(6))), x, di.Constant(scale))
    np.testing.assert_array_equal(x, x_copy)
    np.testing.assert_array_equal(scale, scale_copy)


# -- second order and torch Hessians -----------------------------------------------------------------


@pytest.mark.parametrize(
    "engine",
    [
        di.SecondOrder(di.AutoJAX(), di.AutoJAX()),
        di.SecondOrder(di.AutoFiniteDifferences(), di.AutoAutograd()),
        di.SecondOrder(di.AutoTorch(), di.AutoTorch()),
    ],
    ids=["jax-over-jax", "differences-over-autograd", "torch-over-torch"],
)
def test_second_order_hessians(engine: di.SecondOrder) -> None:
    if not di.available(engine):
        pytest.skip(f"{engine.outer.name} or {engine.inner.name} is not installed")
    x = np.linspace(0.1, 1.0, 12)
    prep = di.prepare_hessian(chain, di.AutoSparse(engine), x)
    assert prep.coloring.count == 3
    hess = di.hessian(chain, di.AutoSparse(engine), x, prep=prep)
    np.testing.assert_allclose(hess.toarray(), di.hessian(chain, engine, x), rtol=1e-5, atol=1e-6)
    # first-order operators and Jacobians use the inner backend
    jac = di.jacobian(tridiagonal, di.AutoSparse(engine), x)
    expected = np.concatenate(di.jacobian(tridiagonal, engine.inner, x))
    np.testing.assert_allclose(jac.toarray(), expected, rtol=1e-6, atol=1e-8)


@needs_torch
def test_torch_hessian_is_sparse_csr() -> None:
    import torch

    x = torch.linspace(0.1, 1.0, 10, dtype=torch.float64)
    value, gradient, hess = di.value_gradient_and_hessian(chain, di.AutoSparse("torch"), x)
    dense_value, dense_gradient, dense_hess = di.value_gradient_and_hessian(chain, "torch", x)
    assert hess.layout == torch.sparse_csr and hess.dtype == torch.float64
    torch.testing.assert_close(hess.to_dense(), dense_hess)
    assert_allclose(gradient, dense_gradient)
    assert_allclose(value, dense_value)


@pytest.mark.parametrize("name", ["jax", "torch", "autograd", "finite_differences"])
def test_a_local_pattern_is_found_again_where_a_constant_changes(name: str) -> None:
    # expected: a local pattern holds for the Constant it was found with (the matrix's zeros are
    # the Jacobian's); unprepared calls with matrices of other bands, and a prepared call whose
    # matrix is written in place, give each matrix's own Jacobian, not one of the first's pattern
    if not di.available(name):
        pytest.skip(f"the {name} backend is not installed")
    n = 30
    x = np.linspace(0.3, 1.7, n)
    backend = di.AutoSparse(name, detector=sparse.LocalDetector(), dense=True)

    def banded(band: int) -> np.ndarray:
        rows, cols = np.indices((n, n))
        mask = (cols - rows <= band - band // 2) & (rows - cols <= band // 2)
        return np.where(mask, np.random.default_rng(band).uniform(0.5, 1.5, (n, n)), 0.0)

    def linear(v: Any, matrix: Any) -> Any:
        return matrix @ v

    for band in (2, 6, 12):
        matrix = banded(band)
        got = np.asarray(di.jacobian(linear, backend, x, di.Constant(matrix)))
        np.testing.assert_allclose(got, matrix, rtol=1e-6, atol=1e-6)
    matrix = banded(2)
    prep = di.prepare_jacobian(linear, backend, x, di.Constant(matrix))
    matrix[:] = banded(12)  # (in place: the same array, other zeros)
    got = np.asarray(di.jacobian(linear, backend, x, di.Constant(matrix), prep=prep))
    np.testing.assert_allclose(got, matrix, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_float32_jax_x_decompresses_without_jaxs_int64_warning(jit: bool) -> None:
    """The decompression's index is int64; jax outside x64 warned that it truncates it (an error
    where warnings are errors, as in a test suite) on every eager call with float32 jax arrays."""
    import jax.numpy as jnp

    x = jnp.asarray([1.0, 2.0, 3.0], dtype=jnp.float32)
    backend = di.AutoSparse(di.AutoJAX(jit=jit))
    jacobian = di.jacobian(lambda v, w: w * v, backend, x, di.Constant(np.array([1.0, 0.0, 2.0], np.float32)))
    hessian = di.hessian(lambda v: (v**3).sum(), backend, x)
    np.testing.assert_array_equal(np.asarray(jacobian.todense()), np.diag([1.0, 0.0, 2.0]))
    np.testing.assert_array_equal(np.asarray(hessian.todense()), np.diag([6.0, 12.0, 18.0]))
    assert jacobian.dtype == hessian.dtype == jnp.float32
