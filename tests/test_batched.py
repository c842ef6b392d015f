"""Batches of products: di.Tangents and the batched operators (batched_jvp, batched_vjp, their
value_and_ and prepare_ forms) against the operators of one tangent, on every engine, for a
pytree x with a context, float32 and float64; one vmapped program on jax and torch.func
(counted: f's evaluations), a loop elsewhere; and the adapters' batch methods."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import optree
import pytest
from conftest import FIRST_ORDER, namespace, native_tree, require

import diffiface as di
from diffiface import _adapters
from diffiface.test import assert_allclose

BACKENDS = ["jax", "torch-autograd", "torch-func", "autograd", "finite_differences"]


def f(x: Any, scale: Any) -> Any:
    xp = namespace(x)
    return {"a": xp.sin(x["p"]) * x["q"][0] * scale, "b": x["q"] ** 2 * 3.0}


def _point() -> tuple[dict[str, np.ndarray], np.ndarray]:
    return {"p": np.array([1.0, 2.0, 3.0]), "q": np.array([0.5, -1.0])}, np.array([1.5, -0.5, 2.0])


@contextlib.contextmanager
def _precision(backend_id: str, dtype: str) -> Iterator[None]:
    if backend_id == "jax" and dtype == "float64":
        import jax

        with jax.enable_x64(True):  # (scoped: the global flag is the other tests' too)
            yield
    else:
        yield


def _batches(backend_id: str, dtype: str, count: int = 4) -> tuple[Any, Any, Any, Any]:
    rng = np.random.default_rng(0)
    x, scale = _point()
    tangents = [{"p": rng.standard_normal(3), "q": rng.standard_normal(2)} for _ in range(count)]
    cotangents = [{"a": rng.standard_normal(3), "b": rng.standard_normal(2)} for _ in range(count)]
    native = [native_tree(backend_id, t, dtype) for t in (x, scale, tangents, cotangents)]
    return native[0], di.Constant(native[1]), native[2], native[3]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("backend_id", BACKENDS)
def test_batched_operators_match_one_tangent_at_a_time(backend_id: str, dtype: str) -> None:
    backend = require(FIRST_ORDER[backend_id])
    with _precision(backend_id, dtype):
        x, scale, tangents, cotangents = _batches(backend_id, dtype)
        pushes = [di.jvp(f, backend, x, t, scale) for t in tangents]
        pulls = [di.vjp(f, backend, x, c, scale) for c in cotangents]
        value = f(x, scale.value)
        batch, cobatch = di.Tangents(*tangents), di.Tangents(*cotangents)
        prepared = {
            name: getattr(di, "prepare_" + name)(f, backend, x, b, scale)
            for name, b in (
                ("batched_jvp", batch),
                ("value_and_batched_jvp", batch),
                ("batched_vjp", cobatch),
                ("value_and_batched_vjp", cobatch),
            )
        }
        for prep in (None, "prepared"):

            def call(name: str, b: Any, prep: Any = prep) -> Any:
                return getattr(di, name)(f, backend, x, b, scale, prep=prepared[name] if prep else None)

            pushed, pulled = call("batched_jvp", batch), call("batched_vjp", cobatch)
            (y1, pushed_too), (y2, pulled_too) = (
                call("value_and_batched_jvp", batch),
                call("value_and_batched_vjp", cobatch),
            )
            for results, expected in ((pushed, pushes), (pushed_too, pushes), (pulled, pulls), (pulled_too, pulls)):
                assert isinstance(results, di.Tangents) and len(results) == len(expected)
                for result, want in zip(results, expected, strict=True):
                    assert_allclose(result, want)
            for y in (y1, y2):
                assert_allclose(y, value)


def test_a_batch_of_one_and_a_scalar_x() -> None:
    """A batch of one tangent, and a Python-float x with float tangents."""
    for backend in ("jax", "torch", "finite_differences"):
        require(backend)
        g = lambda x: x**3  # noqa: E731
        assert [round(v, 6) for v in di.batched_jvp(g, backend, 2.0, di.Tangents(1.0, 0.5))] == [12.0, 6.0]
        x = np.array([1.0, 2.0])
        (one,) = di.batched_vjp(lambda x: x**2, backend, x, di.Tangents(np.array([1.0, 1.0])))
        assert_allclose(one, di.vjp(lambda x: x**2, backend, x, np.array([1.0, 1.0])))


def test_value_and_batched_jvp_with_aux() -> None:
    require("torch")

    def g(x: Any) -> Any:
        return x**2, {"note": "kept", "sum": x.sum()}

    x = np.array([1.0, 2.0])
    for backend in ("jax", di.AutoTorch(mode="func"), "autograd"):
        require(backend)
        (y, aux), pushed = di.value_and_batched_jvp(
            g, backend, x, di.Tangents(np.ones(2), np.array([1.0, 0.0])), has_aux=True
        )
        assert aux["note"] == "kept" and float(aux["sum"]) == 3.0
        assert_allclose(y, x**2)
        assert_allclose(pushed[1], np.array([2.0, 0.0]))


# -- one program where the engine has vmap --------------------------------------------------------


class _Counted:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: Any, scale: Any) -> Any:
        self.calls += 1
        return f(x, scale)


@pytest.mark.parametrize("backend_id", ["jax-eager", "torch-func"])
@pytest.mark.parametrize("operator", ["batched_jvp", "batched_vjp"])
def test_a_batch_is_one_evaluation_of_f_on_the_vmapped_engines(backend_id: str, operator: str) -> None:
    """Five tangents, one evaluation of f per call: one program, not a product per tangent."""
    backend = require(di.AutoJAX(jit=False) if backend_id == "jax-eager" else FIRST_ORDER["torch-func"])
    native = "jax" if backend_id == "jax-eager" else "torch-func"
    x, scale, tangents, cotangents = _batches(native, "float32", count=5)
    batch = di.Tangents(*(tangents if operator == "batched_jvp" else cotangents))
    g = _Counted()
    prep = getattr(di, "prepare_" + operator)(g, backend, x, batch, scale)
    for _ in range(2):
        before = g.calls
        getattr(di, operator)(g, backend, x, batch, scale, prep=prep)
        assert g.calls - before == 1
    before = g.calls
    getattr(di, operator)(g, backend, x, batch, scale)
    assert g.calls - before == 1


@pytest.mark.parametrize("operator", ["batched_jvp", "batched_vjp"])
def test_jit_traces_f_once_for_the_batch(operator: str) -> None:
    backend = require("jax")
    x, scale, tangents, cotangents = _batches("jax", "float32", count=5)
    batch = di.Tangents(*(tangents if operator == "batched_jvp" else cotangents))
    g = _Counted()
    prep = getattr(di, "prepare_" + operator)(g, backend, x, batch, scale)
    assert g.calls == 1  # the trace
    for _ in range(3):
        getattr(di, operator)(g, backend, x, batch, scale, prep=prep)
    assert g.calls == 1


def test_the_other_engines_loop_over_the_batch() -> None:
    """torch.autograd and autograd: one forward product per tangent; one pullback of f for every cotangent."""
    for backend in ("torch-autograd", "autograd"):
        require(FIRST_ORDER[backend])
        x, scale, tangents, cotangents = _batches(
            "torch-func" if backend.startswith("torch") else "numpy", "float64", 5
        )
        g = _Counted()
        di.batched_jvp(g, FIRST_ORDER[backend], x, di.Tangents(*tangents), scale)
        assert g.calls == 5
        g.calls = 0
        di.batched_vjp(g, FIRST_ORDER[backend], x, di.Tangents(*cotangents), scale)
        assert g.calls == 1


# -- what is refused ---------------------------------------------------------------------------


def test_a_tuple_is_never_a_batch() -> None:
    """x a tuple: a tuple tangent is one tangent of it, and a batch is only ever Tangents."""
    x = (np.array([1.0, 2.0]), np.array([3.0]))
    g = lambda x: x[0] * x[1]  # noqa: E731
    one = (np.array([1.0, 0.0]), np.array([0.0]))
    assert_allclose(di.jvp(g, "finite_differences", x, one), np.array([3.0, 0.0]))
    for bad in (one, [one, one], (one, one)):
        with pytest.raises(di.InvalidInputError, match=r"di\.Tangents\(t1, t2, \.\.\.\)"):
            di.batched_jvp(g, "finite_differences", x, bad)  # type: ignore[arg-type]
    with pytest.raises(di.InvalidInputError, match=r"di\.batched_jvp"):
        di.jvp(g, "finite_differences", x, di.Tangents(one, one))
    with pytest.raises(di.InvalidInputError, match=r"di\.batched_vjp"):
        di.vjp(g, "finite_differences", x, di.Tangents(np.ones(2)))
    prep = di.prepare_batched_jvp(g, "finite_differences", x, di.Tangents(one, one))
    with pytest.raises(di.InvalidInputError, match="Tangents"):  # (prepared: the same refusal)
        di.batched_jvp(g, "finite_differences", x, (one, one), prep=prep)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend_id", BACKENDS)
def test_batches_that_do_not_fit_are_refused(backend_id: str) -> None:
    backend = require(FIRST_ORDER[backend_id])
    with _precision(backend_id, "float64"):
        x, scale, tangents, cotangents = _batches(backend_id, "float64", count=3)
        short = native_tree(backend_id, {"p": np.ones(2), "q": np.ones(2)}, "float64")
        with pytest.raises(di.TangentMismatchError, match=r"Tangent 1 of the batch.*\['p'\] has shape"):
            di.batched_jvp(f, backend, x, di.Tangents(tangents[0], short, tangents[2]), scale)
        with pytest.raises(di.TangentMismatchError, match=r"Tangent 2 of the batch.*structure"):
            di.batched_jvp(f, backend, x, di.Tangents(tangents[0], tangents[1], {"p": tangents[2]["p"]}), scale)
        bad_cotangent = {"a": cotangents[0]["a"][:2], "b": cotangents[0]["b"]}
        with pytest.raises(di.TangentMismatchError, match=r"Cotangent 1 of the batch.*shape"):
            di.batched_vjp(f, backend, x, di.Tangents(cotangents[0], bad_cotangent), scale)
        for operator in ("batched_jvp", "batched_vjp"):
            with pytest.raises(di.InvalidInputError, match=r"empty di\.Tangents"):
                getattr(di, operator)(f, backend, x, di.Tangents(), scale)


def test_a_prep_is_for_its_batch() -> None:
    x, scale, tangents, _ = _batches("numpy", "float64", count=3)
    prep = di.prepare_batched_jvp(f, "finite_differences", x, di.Tangents(*tangents), scale)
    with pytest.raises(di.PreparationMismatchError, match="tangent"):
        di.batched_jvp(f, "finite_differences", x, di.Tangents(*tangents[:2]), scale, prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="operator"):
        di.jvp(f, "finite_differences", x, tangents[0], scale, prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="backend"):
        di.batched_jvp(f, "autograd", x, di.Tangents(*tangents), scale, prep=prep)
    loose = di.prepare_batched_jvp(f, "finite_differences", x, di.Tangents(*tangents), scale, strict=False)
    two = di.batched_jvp(f, "finite_differences", x, di.Tangents(*tangents[:2]), scale, prep=loose)
    assert_allclose(two[1], di.jvp(f, "finite_differences", x, tangents[1], scale))
    with pytest.raises(di.InvalidInputError, match="has_aux"):
        di.batched_jvp(f, "finite_differences", x, di.Tangents(*tangents), scale, has_aux=True)


def test_nothing_is_mutated() -> None:
    require("torch")
    x, scale, tangents, cotangents = _batches("torch-func", "float64", count=3)
    copies = optree.tree_map(lambda t: t.clone(), (x, scale.value, tangents, cotangents))
    for backend in ("torch", di.AutoTorch(mode="func")):
        di.batched_jvp(f, backend, x, di.Tangents(*tangents), scale)
        di.batched_vjp(f, backend, x, di.Tangents(*cotangents), scale)
    after = (x, scale.value, tangents, cotangents)
    for a, b in zip(optree.tree_leaves(after), optree.tree_leaves(copies), strict=True):
        assert a.equal(b) and not a.requires_grad and a.grad is None


# -- the adapters' batch methods ----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["jax", "torch-func", "torch", "autograd"])
def test_adapter_batches_match_the_loop(backend: str) -> None:
    """The vmapped batch (jax, torch.func) gives what one product per tangent gives."""
    if not di.available(backend):
        pytest.skip(f"{backend} is not installed")
    if backend == "jax":
        import jax

        with jax.enable_x64(True):  # (scoped: the global flag is the other tests' too)
            _batches_match_the_loop(backend)
    else:
        _batches_match_the_loop(backend)


def _batches_match_the_loop(backend: str) -> None:
    b = _adapters.normalize(backend)
    adapter = _adapters.adapter_for(b)
    xp = adapter.xp
    if backend.startswith("torch"):
        import torch

        xs = (torch.linspace(0.1, 1.0, 5, dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64))
        eye = [(torch.eye(5, dtype=torch.float64)[k], torch.zeros(1, dtype=torch.float64)) for k in range(5)]
    else:
        lib = np
        if backend == "jax":
            import jax.numpy as lib  # type: ignore[no-redef]
        xs = (lib.linspace(0.1, 1.0, 5), lib.asarray([2.0]))
        eye = [(lib.eye(5)[k], lib.zeros(1)) for k in range(5)]

    def fn(leaves: Any) -> Any:
        a, b = leaves
        return (a**3 * b[0], a[:2] ** 2), None

    out, _, touts = adapter.value_and_pushforwards(fn, xs, eye)
    assert len(touts) == 5
    expected_out = fn(xs)[0]
    for got, want in zip(out, expected_out, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12)
    for txs, tout in zip(eye, touts, strict=True):
        expected = adapter.value_and_pushforward(fn, xs, txs)[2]
        for got, want in zip(tout, expected, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12)
    cotangents = [(xp.ones_like(out[0]) * (k + 1), xp.ones_like(out[1])) for k in range(3)]
    _, _, grads = adapter.value_and_pullbacks(fn, xs, cotangents)
    _, _, vjp = adapter.pullback_function(fn, xs)
    for c, grad in zip(cotangents, grads, strict=True):
        for got, want in zip(grad, vjp(c), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12)


# -- batched Hessian-vector products ----------------------------------------------------------------


def loss(x: Any, scale: Any) -> Any:
    """A scalar of a dict x, with a Constant: every second derivative nonzero."""
    xp = namespace(x)
    return xp.sum(xp.sin(x["p"]) * scale) * x["q"][0] + xp.sum(x["q"] ** 3) * xp.sum(x["p"] ** 2)


HVP_BACKENDS: dict[str, Any] = {
    **{name: FIRST_ORDER[name] for name in BACKENDS},
    "scipy": FIRST_ORDER["scipy"],
    "jax-over-jax": di.SecondOrder(di.AutoJAX(), di.AutoJAX()),
    "torch-over-torch": di.SecondOrder(di.AutoTorch(mode="func"), di.AutoTorch(mode="func")),
    "torch-autograd-twice": di.SecondOrder(di.AutoTorch(), di.AutoTorch()),
    "fd-over-jax": di.SecondOrder(di.AutoFiniteDifferences(), di.AutoJAX()),
    "fd-over-torch": di.SecondOrder(di.AutoFiniteDifferences(), di.AutoTorch()),
}
"""Every engine, and SecondOrder pairs: one engine twice (its own second order) and two engines."""


def _arrays_of(backend_id: str) -> str:
    """The test id of the arrays a backend takes (its inner engine's for a pair)."""
    for name in ("jax", "torch"):
        if backend_id.startswith(name) or backend_id.endswith(name):
            return "torch-func" if name == "torch" else name
    return "numpy"


def _hvp_batch(backend_id: str, dtype: str, count: int) -> tuple[Any, Any, list[Any]]:
    rng = np.random.default_rng(1)
    x, scale = _point()
    tangents = [{"p": rng.standard_normal(3), "q": rng.standard_normal(2)} for _ in range(count)]
    arrays = _arrays_of(backend_id)
    return (
        native_tree(arrays, x, dtype),
        di.Constant(native_tree(arrays, scale, dtype)),
        [native_tree(arrays, t, dtype) for t in tangents],
    )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("backend_id", list(HVP_BACKENDS))
def test_batched_hvp_matches_one_hvp_at_a_time(backend_id: str, dtype: str) -> None:
    backend = require(HVP_BACKENDS[backend_id])
    with _precision(_arrays_of(backend_id), dtype):
        x, scale, tangents = _hvp_batch(backend_id, dtype, 2 if backend_id == "scipy" else 4)
        expected = [di.hvp(loss, backend, x, t, scale) for t in tangents]
        gradient = di.gradient(loss, backend, x, scale)
        batch = di.Tangents(*tangents)
        preps = {
            name: getattr(di, "prepare_" + name)(loss, backend, x, batch, scale)
            for name in ("batched_hvp", "gradient_and_batched_hvp")
        }
        for prepared in (False, True):
            hvps = di.batched_hvp(loss, backend, x, batch, scale, prep=preps["batched_hvp"] if prepared else None)
            grad, hvps_too = di.gradient_and_batched_hvp(
                loss, backend, x, batch, scale, prep=preps["gradient_and_batched_hvp"] if prepared else None
            )
            assert_allclose(grad, gradient)
            for results in (hvps, hvps_too):
                assert isinstance(results, di.Tangents) and len(results) == len(expected)
                for result, want in zip(results, expected, strict=True):
                    assert_allclose(result, want)  # (mirrors x: dict, array type, dtype)


def test_batched_hvp_is_the_hessian_times_each_tangent() -> None:
    """Against the exact Hessian (not only the engine's own hvp): H of x @ A @ x / 2 is A."""
    a = np.array([[2.0, 1.0, 0.0], [1.0, 3.0, -1.0], [0.0, -1.0, 4.0]])
    tangents = [np.array([1.0, 0.0, 0.0]), np.array([0.5, -2.0, 1.0])]
    x = np.array([0.3, -0.1, 0.2])
    for backend_id in ("jax", "torch-autograd", "torch-func", "autograd", "finite_differences"):
        backend = require(FIRST_ORDER[backend_id])
        with _precision(backend_id, "float64"):
            native = native_tree(backend_id, (x, a, tangents), "float64")
            hvps = di.batched_hvp(
                lambda x, a: x @ a @ x / 2, backend, native[0], di.Tangents(*native[2]), di.Constant(native[1])
            )
        for result, t in zip(hvps, tangents, strict=True):
            assert_allclose(np.asarray(result), a @ t, rtol=1e-6, atol=1e-6)


class _CountedLoss:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: Any, scale: Any) -> Any:
        self.calls += 1
        return loss(x, scale)


@pytest.mark.parametrize(
    ("backend_id", "evaluations"),
    [("jax-eager", 1), ("torch-func", 1), ("torch-autograd", 1), ("autograd", 1), ("jax-over-jax-eager", 1)],
)
@pytest.mark.parametrize("operator", ["batched_hvp", "gradient_and_batched_hvp"])
def test_a_batch_of_hvps_evaluates_f_once(backend_id: str, evaluations: int, operator: str) -> None:
    """Five tangents, f evaluated once per call: one vmapped program (jax, torch.func), or f and
    its gradient's graph once with a pullback per tangent (torch autograd mode, autograd)."""
    backends = {
        "jax-eager": di.AutoJAX(jit=False),
        "jax-over-jax-eager": di.SecondOrder(di.AutoJAX(jit=False), di.AutoJAX(jit=False)),
    }
    backend = require(backends.get(backend_id, FIRST_ORDER.get(backend_id)))
    arrays = "jax" if backend_id.startswith("jax") else "torch-func" if backend_id.startswith("torch") else "numpy"
    x, scale, tangents = _hvp_batch(arrays, "float32", 5)
    batch = di.Tangents(*tangents)
    g = _CountedLoss()
    prep = getattr(di, "prepare_" + operator)(g, backend, x, batch, scale)
    for _ in range(2):
        before = g.calls
        getattr(di, operator)(g, backend, x, batch, scale, prep=prep)
        assert g.calls - before == evaluations
    before = g.calls
    getattr(di, operator)(g, backend, x, batch, scale)
    assert g.calls - before == evaluations
    one = _CountedLoss()  # (the loop it replaces: an evaluation per tangent)
    for t in tangents:
        di.hvp(one, backend, x, t, scale)
    assert one.calls == 5 * evaluations


@pytest.mark.parametrize("operator", ["batched_hvp", "gradient_and_batched_hvp"])
def test_jit_traces_f_once_for_the_batch_of_hvps(operator: str) -> None:
    backend = require("jax")
    x, scale, tangents = _hvp_batch("jax", "float32", 5)
    batch = di.Tangents(*tangents)
    g = _CountedLoss()
    prep = getattr(di, "prepare_" + operator)(g, backend, x, batch, scale)
    assert g.calls == 1  # the trace
    for _ in range(3):
        getattr(di, operator)(g, backend, x, batch, scale, prep=prep)
    assert g.calls == 1


def test_finite_differences_take_the_gradient_once_for_the_batch() -> None:
    """The gradient's differences once, then four evaluations per input and tangent."""
    x, scale, tangents = _hvp_batch("numpy", "float64", 3)
    n = 5
    g = _CountedLoss()
    di.batched_hvp(g, "finite_differences", x, di.Tangents(*tangents), scale)
    batched_calls = g.calls
    g.calls = 0
    for t in tangents:
        di.hvp(g, "finite_differences", x, t, scale)
    assert batched_calls == g.calls - 2 * (2 * n + 1)  # (the loop's two more gradients, central: f(x), then 2n)
    assert batched_calls <= 2 * n + 1 + 3 * 4 * n


@pytest.mark.parametrize("backend_id", ["jax", "torch-autograd", "torch-func", "finite_differences", "autograd"])
def test_batched_hvp_of_complex_x_keeps_the_convention(backend_id: str) -> None:
    """A real loss of complex z, Re sum(z**2 w): its hvp along v is conj(2 w v), as one hvp gives."""
    backend = require(FIRST_ORDER[backend_id])
    rng = np.random.default_rng(2)
    z = rng.standard_normal(3) + 1j * rng.standard_normal(3)
    w = rng.standard_normal(3) + 1j * rng.standard_normal(3)
    vs = [rng.standard_normal(3) + 1j * rng.standard_normal(3) for _ in range(3)]

    def re_z2w(z: Any, w: Any) -> Any:
        xp = namespace(z)
        return xp.real(xp.sum(z * z * w))

    with _precision(backend_id, "float64"):
        native = native_tree(backend_id, (z, w, vs), "complex128")
        grad, hvps = di.gradient_and_batched_hvp(
            re_z2w, backend, native[0], di.Tangents(*native[2]), di.Constant(native[1])
        )
        singles = [di.hvp(re_z2w, backend, native[0], v, di.Constant(native[1])) for v in native[2]]
    assert_allclose(np.asarray(grad), np.conj(2 * z * w), rtol=1e-6, atol=1e-6)
    for result, single, v in zip(hvps, singles, vs, strict=True):
        assert_allclose(result, single)
        assert_allclose(np.asarray(result), np.conj(2 * w * v), rtol=1e-5, atol=1e-5)


def test_batched_hvp_refusals() -> None:
    x = (np.array([1.0, 2.0]), np.array([3.0]))
    g = lambda x: (x[0] ** 2).sum() * x[1][0]  # noqa: E731
    one = (np.array([1.0, 0.0]), np.array([0.0]))
    for bad in (one, [one, one], (one, one)):
        with pytest.raises(di.InvalidInputError, match=r"di\.Tangents\(t1, t2, \.\.\.\).*di\.hvp\b"):
            di.batched_hvp(g, "finite_differences", x, bad)  # type: ignore[arg-type]
    with pytest.raises(di.InvalidInputError, match=r"di\.batched_hvp takes a batch"):
        di.hvp(g, "finite_differences", x, di.Tangents(one, one))
    with pytest.raises(di.InvalidInputError, match=r"di\.gradient_and_batched_hvp takes a batch"):
        di.gradient_and_hvp(g, "finite_differences", x, di.Tangents(one))
    for operator in ("batched_hvp", "gradient_and_batched_hvp"):
        with pytest.raises(di.InvalidInputError, match=r"empty di\.Tangents"):
            getattr(di, operator)(g, "finite_differences", x, di.Tangents())
        with pytest.raises(di.InvalidInputError, match="has_aux"):
            getattr(di, operator)(g, "finite_differences", x, di.Tangents(one), has_aux=True)
    with pytest.raises(di.InvalidOutputError, match="scalar"):
        di.batched_hvp(lambda x: x[0] * 2.0, "finite_differences", x, di.Tangents(one))


@pytest.mark.parametrize("backend_id", [*BACKENDS, "scipy"])
def test_batches_of_hvps_that_do_not_fit_are_refused(backend_id: str) -> None:
    backend = require(FIRST_ORDER[backend_id])
    with _precision(backend_id, "float64"):
        x, scale, tangents = _hvp_batch(backend_id, "float64", 3)
        short = native_tree(_arrays_of(backend_id), {"p": np.ones(2), "q": np.ones(2)}, "float64")
        for operator in ("batched_hvp", "gradient_and_batched_hvp"):
            with pytest.raises(di.TangentMismatchError, match=r"Tangent 1 of the batch.*\['p'\] has shape"):
                getattr(di, operator)(loss, backend, x, di.Tangents(tangents[0], short, tangents[2]), scale)
            with pytest.raises(di.TangentMismatchError, match=r"Tangent 2 of the batch.*structure"):
                getattr(di, operator)(
                    loss, backend, x, di.Tangents(tangents[0], tangents[1], {"p": tangents[2]["p"]}), scale
                )


def test_a_prep_of_hvps_is_for_its_batch() -> None:
    x, scale, tangents = _hvp_batch("numpy", "float64", 3)
    prep = di.prepare_batched_hvp(loss, "finite_differences", x, di.Tangents(*tangents), scale)
    with pytest.raises(di.PreparationMismatchError, match="tangent"):
        di.batched_hvp(loss, "finite_differences", x, di.Tangents(*tangents[:2]), scale, prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="operator"):
        di.gradient_and_batched_hvp(loss, "finite_differences", x, di.Tangents(*tangents), scale, prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="operator"):
        di.hvp(loss, "finite_differences", x, tangents[0], scale, prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="backend"):
        di.batched_hvp(loss, "autograd", x, di.Tangents(*tangents), scale, prep=prep)
    loose = di.prepare_batched_hvp(loss, "finite_differences", x, di.Tangents(*tangents), scale, strict=False)
    two = di.batched_hvp(loss, "finite_differences", x, di.Tangents(*tangents[:2]), scale, prep=loose)
    assert len(two) == 2
    assert_allclose(two[1], di.hvp(loss, "finite_differences", x, tangents[1], scale))


def test_batched_hvp_mutates_nothing() -> None:
    require("torch")
    x, scale, tangents = _hvp_batch("torch-func", "float64", 3)
    copies = optree.tree_map(lambda t: t.clone(), (x, scale.value, tangents))
    for backend in ("torch", di.AutoTorch(mode="func")):
        di.batched_hvp(loss, backend, x, di.Tangents(*tangents), scale)
        di.gradient_and_batched_hvp(loss, backend, x, di.Tangents(*tangents), scale)
    for a, b in zip(optree.tree_leaves((x, scale.value, tangents)), optree.tree_leaves(copies), strict=True):
        assert a.equal(b) and not a.requires_grad and a.grad is None


def test_scipy_estimates_the_error_of_each_hvp_of_the_batch() -> None:
    """prep.error of a batched hvp on scipy: a Tangents of estimates, each the single hvp's."""
    require("scipy")
    x, scale, tangents = _hvp_batch("numpy", "float64", 2)
    prep = di.prepare_gradient_and_batched_hvp(loss, "scipy", x, di.Tangents(*tangents), scale)
    di.gradient_and_batched_hvp(loss, "scipy", x, di.Tangents(*tangents), scale, prep=prep)
    gradient_error, hvp_errors = prep.error
    assert isinstance(hvp_errors, di.Tangents) and len(hvp_errors) == 2
    for t, error in zip(tangents, hvp_errors, strict=True):
        one = di.prepare_gradient_and_hvp(loss, "scipy", x, t, scale)
        di.gradient_and_hvp(loss, "scipy", x, t, scale, prep=one)
        assert_allclose(gradient_error, one.error[0])
        assert_allclose(error, one.error[1])
        assert all(np.all(leaf < 1e-6) for leaf in optree.tree_leaves(error))
