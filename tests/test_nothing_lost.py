"""Nothing is lost: a call that fails half-way leaves x and the contexts bit-for-bit as they
were and hands the user's own exception back; unprepared calls with fresh functions leak
neither cache entries nor memory, and never keep f alive."""

from __future__ import annotations

import gc
import sys
import tracemalloc
import weakref
from typing import Any

import numpy as np
import optree
import pytest

import diffiface as di
import diffiface._adapters as adapters
from diffiface._prep import prep_cache

ALL = ["finite_differences", "scipy", "jax", "torch", "autograd"]


def need(backend: str) -> None:
    if not di.available(backend):
        pytest.skip(f'the {backend} backend is not installed: pip install "diffiface[{adapters.info(backend).extra}]"')


def bits(*trees: Any) -> list[Any]:
    out: list[Any] = []
    for tree in trees:
        if isinstance(tree, di.Context):
            tree = tree.value
        leaves, spec = optree.tree_flatten(tree)
        out.append(str(spec))
        for leaf in leaves:
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(leaf, torch.Tensor):
                out.append(
                    (
                        "torch",
                        leaf.dtype,
                        tuple(leaf.shape),
                        leaf.requires_grad,
                        leaf.grad is None,
                        leaf.detach().numpy().tobytes(),
                    )
                )
            else:
                array = np.asarray(leaf)
                out.append((type(leaf).__name__, array.dtype.str, array.shape, array.tobytes()))
    return out


class Stop(Exception):
    pass


def failing_at(k: int, error: BaseException) -> Any:
    """A smooth f of (x, Constant, Cache) that raises ``error`` at its k-th evaluation."""
    count = [0]

    def f(x: Any, weights: Any, scratch: Any) -> Any:
        count[0] += 1
        if count[0] == k:
            raise error
        v = x["v"]
        return (weights * v * v).sum() + (v[:1] * scratch[:1]).sum() * 0.0 + x["s"] * v.sum()

    f.count = count  # type: ignore[attr-defined]
    return f


def inputs(kind: str = "numpy") -> tuple[Any, di.Constant[Any], di.Cache[Any]]:
    x = {"v": np.array([0.5, -1.0, 2.0]), "s": np.array(0.25)}
    weights = di.Constant(np.array([1.0, 2.0, 3.0]))
    scratch = di.Cache(np.array([7.0, 8.0]))
    if kind == "torch":
        import torch

        x = {k: torch.tensor(v, requires_grad=(k == "v")) for k, v in x.items()}
    return x, weights, scratch


def call(operator: str, f: Any, backend: Any, x: Any, *contexts: Any) -> Any:
    if operator in ("jvp", "hvp"):
        t = optree.tree_map(lambda a: a * 0 + 1, x)
        return getattr(di, operator)(f, backend, x, t, *contexts)
    if operator == "vjp":
        return di.vjp(f, backend, x, 1.0, *contexts)
    return getattr(di, operator)(f, backend, x, *contexts)


# (backend, operator, k): k-th evaluation raises. Finite differences and scipy evaluate f many
# times per call, so k lands in the middle; the AD engines evaluate f once (tracing), k = 1.
CASES = [
    *[("finite_differences", op, k) for op in ("gradient", "jacobian", "hessian", "hvp") for k in (1, 2, 5)],
    *[("finite_differences", "jvp", k) for k in (1, 2)],  # central differences: two evaluations
    *[("scipy", op, k) for op in ("gradient", "jacobian", "hessian") for k in (1, 7)],
    *[(b, op, 1) for b in ("jax", "torch", "autograd") for op in ("gradient", "jacobian", "hessian", "hvp", "vjp")],
]


@pytest.mark.parametrize(("backend", "operator", "k"), CASES, ids=[f"{b}-{o}-at{k}" for b, o, k in CASES])
def test_failure_half_way_leaves_inputs_untouched(backend: str, operator: str, k: int) -> None:
    need(backend)
    x, weights, scratch = inputs()
    before = bits(x, weights, scratch)
    error = Stop(f"evaluation {k}")
    f = failing_at(k, error)
    with pytest.raises(Stop) as caught:
        call(operator, f, backend, x, weights, scratch)
    assert caught.value is error
    assert f.count[0] == k
    assert bits(x, weights, scratch) == before


@pytest.mark.parametrize("backend", ["torch", "finite_differences"])
def test_failure_half_way_leaves_torch_tensors_untouched(backend: str) -> None:
    need("torch")
    x, weights, scratch = inputs("torch")
    before = bits(x, weights, scratch)
    error = Stop("half-way")
    f = failing_at(3 if backend == "finite_differences" else 1, error)
    with pytest.raises(Stop) as caught:
        di.hessian(f, backend, x, weights, scratch)
    assert caught.value is error
    assert bits(x, weights, scratch) == before
    assert x["v"].grad is None
    assert x["v"].requires_grad
    assert not x["s"].requires_grad


@pytest.mark.parametrize(
    ("backend", "operator", "k"),
    [
        ("finite_differences", "hessian", 6),
        ("scipy", "jacobian", 4),
        ("jax", "hessian", 1),
        ("torch", "jacobian", 1),
        ("autograd", "hvp", 1),
    ],
)
def test_keyboard_interrupt_passes_through(backend: str, operator: str, k: int) -> None:
    need(backend)
    jax = sys.modules.get("jax")
    flag = jax.config.read("jax_enable_x64") if jax is not None else None
    x, weights, scratch = inputs()
    before = bits(x, weights, scratch)
    interrupt = KeyboardInterrupt()
    f = failing_at(k, interrupt)
    with pytest.raises(KeyboardInterrupt) as caught:
        call(operator, f, backend, x, weights, scratch)
    assert caught.value is interrupt
    assert bits(x, weights, scratch) == before
    if jax is not None:  # a scoped jax.enable_x64 is left on the way out
        assert sys.modules["jax"].config.read("jax_enable_x64") == flag
    # the same inputs work again afterwards
    f.count[0] = -(10**6)
    result = call(operator, f, backend, x, weights, scratch)
    assert optree.tree_leaves(result)
    assert bits(x, weights, scratch) == before


def test_fresh_closures_leak_no_cache_entries_nor_memory() -> None:
    x = np.array([0.5, -0.25])
    base = len(prep_cache)

    def one(i: int) -> None:
        scale = float(i % 7)
        grad = di.gradient(lambda x: scale * (x * x).sum(), "finite_differences", x)
        assert grad.shape == (2,)

    for i in range(300):  # warm up: imports, first-time allocations
        one(i)
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        peak_entries = 0
        for i in range(10_000):
            one(i)
            if i % 500 == 0:
                peak_entries = max(peak_entries, len(prep_cache))
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert peak_entries <= base + 16, f"the cache grew to {peak_entries} entries"
    assert len(prep_cache) <= base + 1
    assert grown < 1_000_000, f"memory grew by {grown} bytes over 10,000 calls"


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_f_dies_after_the_call(backend: str, prepared: bool) -> None:
    need(backend)
    x = np.array([0.5, -0.25, 1.0])

    class Model:
        def __call__(self, x: Any) -> Any:
            return (x * x).sum()

    f = Model().__call__ if backend == "autograd" else (lambda x: (x * x).sum())
    ref = weakref.ref(f.__self__) if backend == "autograd" else weakref.ref(f)
    if prepared:
        prep = di.prepare_gradient(f, backend, x)
        di.gradient(f, backend, x, prep=prep)
        del prep
    else:
        di.gradient(f, backend, x)
    del f
    gc.collect()
    assert ref() is None, "diffiface keeps f alive after the call"
