"""Batches of products: di.Tangents, batched_jvp and batched_vjp, and the adapters' batched
methods (vmapped on jax and torch.func, a loop elsewhere) against one product at a time."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import diffiface as di
from diffiface import _adapters
from diffiface.test import assert_allclose

BACKENDS = ["jax", "torch", "torch-func", "autograd", "finite_differences"]


def _installed(backend: str) -> None:
    if not di.available(backend):
        pytest.skip(f"{backend} is not installed")


def f(x: Any) -> Any:
    return {"a": x["p"] ** 2 * x["q"][0], "b": x["q"] * 3.0}


def _point() -> dict[str, np.ndarray]:
    return {"p": np.array([1.0, 2.0, 3.0]), "q": np.array([0.5, -1.0])}


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_jvp_and_vjp_match_one_at_a_time(backend: str) -> None:
    _installed(backend)
    x = _point()
    rng = np.random.default_rng(0)
    tangents = [{"p": rng.standard_normal(3), "q": rng.standard_normal(2)} for _ in range(4)]
    cotangents = [{"a": rng.standard_normal(3), "b": rng.standard_normal(2)} for _ in range(4)]
    pushed = di.batched_jvp(f, backend, x, di.Tangents(*tangents))
    pulled = di.batched_vjp(f, backend, x, di.Tangents(*cotangents))
    assert isinstance(pushed, di.Tangents) and len(pushed) == 4
    for t, result in zip(tangents, pushed, strict=True):
        assert_allclose(result, di.jvp(f, backend, x, t))
    for c, result in zip(cotangents, pulled, strict=True):
        assert_allclose(result, di.vjp(f, backend, x, c))
    assert len(di.batched_jvp(f, backend, x, di.Tangents())) == 0


def test_a_tuple_is_never_a_batch() -> None:
    """x a tuple: a tuple tangent is one tangent of it, and a batch is only ever Tangents."""
    x = (np.array([1.0, 2.0]), np.array([3.0]))
    g = lambda x: x[0] * x[1]  # noqa: E731
    one = (np.array([1.0, 0.0]), np.array([0.0]))
    assert_allclose(di.jvp(g, "finite_differences", x, one), np.array([3.0, 0.0]))
    with pytest.raises(di.InvalidInputError, match="Tangents"):
        di.batched_jvp(g, "finite_differences", x, one)  # type: ignore[arg-type]
    with pytest.raises(di.DiffifaceError):
        di.jvp(g, "finite_differences", x, di.Tangents(one, one))


@pytest.mark.parametrize("backend", ["jax", "torch-func", "torch", "autograd"])
def test_adapter_batches_match_the_loop(backend: str) -> None:
    """The vmapped batch (jax, torch.func) gives what one product per tangent gives."""
    _installed(backend)
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
