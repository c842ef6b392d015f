"""Threads: one prep shared by many threads gives the results of serial calls, and the cache
behind unprepared calls stays consistent when many threads fill it at once."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import diffiface as di
import diffiface._adapters as adapters
from diffiface._arrays import numpy_like
from diffiface._prep import prep_cache

BACKENDS = ["jax", "torch", "torch-func", "autograd", "finite_differences", "scipy"]
THREADS = 8


def need(backend: str) -> None:
    if not di.available(backend):
        pytest.skip(f'the {backend} backend is not installed: pip install "diffiface[{adapters.info(backend).extra}]"')


def make_backend(name: str) -> Any:
    if name == "torch-func":
        need("torch")
        return di.AutoTorch(mode="func")
    need(name)
    return name


def calls_per_thread(name: str, operator: str) -> int:
    # 200 calls per thread on every backend. scipy's adaptive Hessian calls f point by point in
    # Python (about 50 ms a call): for its hvp, 8 calls per thread keep the test fast and still
    # interleave the threads many times; its gradient makes the full 200.
    return 8 if (name, operator) == ("scipy", "hvp") else 200


xp_of = numpy_like  # the numpy-like module of a leaf's framework


def energy(x: Any, weights: Any) -> Any:
    xp = xp_of(x)
    return xp.sum(weights * xp.sin(x)) + xp.sum(x * x) * xp.sum(x)


def as_numpy(value: Any) -> np.ndarray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().numpy()
    return np.asarray(value)


def run_threads(count: int, work: Callable[[int], None]) -> None:
    """Run ``work(i)`` in ``count`` threads released together; re-raise the first failure."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:  # reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("operator", ["gradient", "hvp"])
def test_shared_prep_gives_serial_results(name: str, operator: str) -> None:
    backend = make_backend(name)
    weights = di.Constant(np.array([1.0, -2.0, 0.5]))
    points = [np.array([0.1 * i, -0.3 + 0.05 * i, 0.7 - 0.1 * i]) for i in range(THREADS)]
    tangent = np.array([1.0, 0.5, -0.25])
    extra = (tangent,) if operator == "hvp" else ()
    op = getattr(di, operator)
    prep = getattr(di, f"prepare_{operator}")(energy, backend, points[0], *extra, weights)
    expected = [as_numpy(op(energy, backend, x, *extra, weights, prep=prep)).copy() for x in points]
    errors: list[Any] = [None] * THREADS
    n = calls_per_thread(name, operator)

    def work(i: int) -> None:
        for k in range(n):
            j = (i + k) % THREADS  # each thread walks through every point
            got = as_numpy(op(energy, backend, points[j], *extra, weights, prep=prep))
            np.testing.assert_array_equal(got, expected[j], err_msg=f"thread {i}, call {k}")
        if name == "scipy":
            errors[i] = prep.error  # the estimate of this thread's own last call

    run_threads(THREADS, work)
    if name == "scipy":
        for i, error in enumerate(errors):
            assert error is not None, f"thread {i} has no error estimate"


def test_jax_float32_and_float64_preps_in_parallel() -> None:
    """The scoped jax.enable_x64 of float64 calls must not leak into float32 calls of other threads."""
    need("jax")
    import jax

    flag = jax.config.read("jax_enable_x64")
    x64 = np.array([0.3, -0.2, 0.9])
    x32 = x64.astype(np.float32)
    weights64, weights32 = (
        di.Constant(np.array([1.0, 2.0, 3.0])),
        di.Constant(np.array([1.0, 2.0, 3.0], dtype=np.float32)),
    )
    prep64 = di.prepare_gradient(energy, "jax", x64, weights64)
    prep32 = di.prepare_gradient(energy, "jax", x32, weights32)
    expected64 = di.gradient(energy, "jax", x64, weights64, prep=prep64)
    expected32 = di.gradient(energy, "jax", x32, weights32, prep=prep32)

    def work(i: int) -> None:
        for _ in range(200):
            if i % 2:
                got = di.gradient(energy, "jax", x64, weights64, prep=prep64)
                assert got.dtype == np.float64
                np.testing.assert_array_equal(got, expected64)
            else:
                got = di.gradient(energy, "jax", x32, weights32, prep=prep32)
                assert got.dtype == np.float32
                np.testing.assert_array_equal(got, expected32)

    run_threads(THREADS, work)
    assert jax.config.read("jax_enable_x64") == flag


@pytest.mark.parametrize("name", ["finite_differences", "jax", "torch"])
def test_unprepared_call_cache_is_thread_safe(name: str) -> None:
    """Many threads, each with its own functions, and one function shared by all, on several
    shapes (more than a function's 16 cache slots, so entries are evicted as others read)."""
    backend = make_backend(name)
    shared_scale = 3.0

    def shared(x: Any) -> Any:
        return shared_scale * (x * x).sum()

    # jax compiles each new (function, shape) once: fewer shapes keep it fast
    sizes = list(range(1, 10 if name == "jax" else 21))
    rounds = 1 if name == "jax" else 10

    def work(i: int) -> None:
        scale = float(i + 1)

        def own(x: Any) -> Any:  # a distinct function per thread
            return scale * (x * x).sum()

        for r in range(rounds):
            for n in sizes[(i + r) % 3 :: 3]:
                x = np.linspace(-1.0, 1.0, n)
                np.testing.assert_allclose(as_numpy(di.gradient(own, backend, x)), 2 * scale * x, rtol=1e-6, atol=1e-8)
                np.testing.assert_allclose(
                    as_numpy(di.gradient(shared, backend, x)), 2 * shared_scale * x, rtol=1e-6, atol=1e-8
                )
                assert len(prep_cache) >= 0  # reading the size while others write must not fail

    run_threads(16, work)


_FIRST_FORWARD_CALLS = """
import sys, threading, warnings
warnings.simplefilter("error")
import numpy as np, torch
import diffiface as di

def f(x):
    return {"a": torch.sin(x) * x, "b": x**2}

x = np.ones(2)
prep = di.prepare_jacobian(f, "torch", x)  # (forward mode: a Jacobian of 2 inputs and 4 outputs)
errors = []

def work():
    try:
        for _ in range(20):
            di.jacobian(f, "torch", x, prep=prep)
    except BaseException as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=work) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert not errors, errors
torch.func.jacfwd(torch.sin)(torch.ones(2))  # (torch's own forward mode after ours: no warning)
print("ok")
"""


def test_threads_first_forward_mode_calls_leave_torch_warmed() -> None:
    """Four threads' first forward-mode calls at once, in a fresh process under ``-W error``: one
    warms torch's forward mode (its scripted decompositions load, their deprecation warning
    silenced) while the others wait, so that no later forward-mode call of torch's own meets the
    warning. Before, a thread whose throwaway dual level collided with another's marked the warm-up
    done with nothing loaded, and a later ``torch.func.jacfwd`` raised."""
    import subprocess

    need("torch")
    done = subprocess.run([sys.executable, "-c", _FIRST_FORWARD_CALLS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
