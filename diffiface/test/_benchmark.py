"""``benchmark_differentiation``: the scenarios timed, prepared and unprepared, beside the native call.

Each row says how long one operator call takes through diffiface (median and minimum over
several rounds, :func:`time.perf_counter`), how many Python-level calls of ``f`` one call makes
(counted by wrapping ``f``; under ``jax.jit`` these are traces, so a warm compiled call counts 0),
and, where the engine has an idiomatic call of its own for the operator, how long that takes
(``native_s``) and the ratio of the two, round by round.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

import diffiface as di

from .. import tree as _tree
from .._adapters import normalize
from .._backends import AutoAutograd, AutoJAX, AutoTorch, Backend
from ._running import _family, backend_label
from ._scenario import Scenario

__all__ = ["benchmark_differentiation", "CountingFunction"]


class CountingFunction:
    """``f`` with a count of its Python-level calls."""

    def __init__(self, f: Callable[..., Any]) -> None:
        self.f = f
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.f(*args, **kwargs)


def _block(result: Any) -> Any:
    """Wait for asynchronous engines (jax) so that the clock measures the work."""
    try:
        for leaf in _tree.leaves(result):
            ready = getattr(leaf, "block_until_ready", None)
            if ready is not None:
                ready()
    except Exception:
        pass
    return result


def _autorange(call: Callable[[], Any], target_s: float = 0.02) -> int:
    """How many calls make one round last about ``target_s`` (at least 1)."""
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            _block(call())
        elapsed = time.perf_counter() - start
        if elapsed >= target_s or number >= 1_000_000:
            return number
        number = max(number * 2, int(number * target_s / max(elapsed, 1e-9) * 1.1))


def time_call(call: Callable[[], Any], rounds: int = 5, number: int | None = None) -> tuple[float, float]:
    """(median, min) seconds per call of ``call`` over ``rounds`` rounds of ``number`` calls."""
    _block(call())  # warm up (compilation, caches)
    number = number or _autorange(call)
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(number):
            _block(call())
        per_call.append((time.perf_counter() - start) / number)
    return statistics.median(per_call), min(per_call)


def time_pair(
    call: Callable[[], Any], native: Callable[[], Any], rounds: int = 5, number: int | None = None
) -> tuple[float, float, float, float]:
    """(median, min, native median) seconds per call, and the median over rounds of the
    ratio of ``call``'s time to ``native``'s in the same round. Rounds of the two calls are
    interleaved so that load from elsewhere on the machine weighs on both alike; the ratio
    within a round follows slow changes of that load, which a ratio of medians would not.
    Which of the two runs first alternates from round to round: the second of a pair runs
    measurably faster or slower than the first (caches, the allocator), by a percent or two."""
    _block(call())
    _block(native())
    number = number or _autorange(call)
    ours: list[float] = []
    theirs: list[float] = []
    pairs = ((native, theirs), (call, ours))
    for i in range(rounds):
        for fn, times in pairs if i % 2 == 0 else pairs[::-1]:
            start = time.perf_counter()
            for _ in range(number):
                _block(fn())
            times.append((time.perf_counter() - start) / number)
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return statistics.median(ours), min(ours), statistics.median(theirs), statistics.median(ratios)


def native_call(backend: Backend, scenario: Scenario) -> Callable[[], Any] | None:
    """The engine's own fastest idiomatic call for ``scenario``'s operator; None where there is
    none (finite differences, scipy, pytree inputs for torch/autograd, operators not covered).

    Contexts are closed over, except under ``jax.jit``, where array contexts are arguments of
    the jitted function (``jax.jit(jax.grad(f))(x, data)``), as they are of diffiface's
    program: a closed-over array is a constant of the compiled program, which a new value
    would recompile."""
    op = scenario.operator
    ctx = scenario.context_values
    f = scenario.f
    x, tx = scenario.x, scenario.tangent

    def g(z: Any) -> Any:
        return f(z, *ctx)

    if isinstance(backend, AutoJAX):
        import jax

        arrays = all(isinstance(c, (jax.Array, np.ndarray)) for c in ctx)
        context_args = ctx if arrays else ()

        def bound(c: tuple[Any, ...]) -> Callable[[Any], Any]:
            return (lambda z: f(z, *c)) if arrays else g

        transforms: dict[str, Callable[..., Any]] = {
            "gradient": lambda z, *c: jax.grad(bound(c))(z),
            "value_and_gradient": lambda z, *c: jax.value_and_grad(bound(c))(z),
            "jacobian": lambda z, *c: jax.jacrev(bound(c))(z),
            "hessian": lambda z, *c: jax.hessian(bound(c))(z),
            "jvp": lambda z, v, *c: jax.jvp(bound(c), (z,), (v,))[1],
            "vjp": lambda z, v, *c: jax.vjp(bound(c), z)[1](v)[0],
            "hvp": lambda z, v, *c: jax.jvp(jax.grad(bound(c)), (z,), (v,))[1],  # forward over reverse
        }
        if op not in transforms:
            return None
        fn = jax.jit(transforms[op]) if backend.jit else transforms[op]
        args = (x, tx, *context_args) if tx is not None else (x, *context_args)
        return functools.partial(fn, *args)
    if isinstance(backend, AutoTorch):
        import torch

        if not isinstance(x, torch.Tensor):
            return None
        if backend.mode == "func":
            if op == "gradient":
                fn = torch.func.grad(g)
                return lambda: fn(x)
            if op == "jacobian":
                fn = torch.func.jacrev(g)
                return lambda: fn(x)
            if op == "hessian":
                fn = torch.func.hessian(g)
                return lambda: fn(x)
            if op == "hvp":
                return lambda: torch.func.jvp(torch.func.grad(g), (x,), (tx,))[1]
            if op == "jvp":
                return lambda: torch.func.jvp(g, (x,), (tx,))[1]
            if op == "vjp":
                return lambda: torch.func.vjp(g, x)[1](tx)[0]
            return None
        if op == "gradient":

            def grad() -> Any:
                z = x.detach().requires_grad_(True)
                return torch.autograd.grad(g(z), z)[0]

            return grad
        if op == "jacobian":
            return lambda: torch.autograd.functional.jacobian(g, x)
        if op == "hvp":

            def double_backward() -> Any:
                z = x.detach().requires_grad_(True)
                (grad,) = torch.autograd.grad(g(z), z, create_graph=True)
                return torch.autograd.grad(grad, z, grad_outputs=tx)[0]

            return double_backward
        if op == "hessian":
            return lambda: torch.autograd.functional.hessian(g, x)
        if op == "jvp":
            return lambda: torch.autograd.functional.jvp(g, x, tx)[1]
        if op == "vjp":
            return lambda: torch.autograd.functional.vjp(g, x, tx)[1]
        return None
    if isinstance(backend, AutoAutograd):
        import autograd

        if op == "gradient":
            fn = autograd.grad(g)
            return lambda: fn(x)
        if op == "jacobian":
            fn = autograd.jacobian(g)
            return lambda: fn(x)
        if op == "hvp":
            fn = autograd.hessian_vector_product(g)
            return lambda: fn(x, tx)
        if op == "hessian":
            fn = autograd.hessian(g)
            return lambda: fn(x)
        if op == "vjp":
            return lambda: autograd.make_vjp(g)(x)[0](tx)
        if op == "jvp":
            fn = autograd.differential_operators.make_jvp_reversemode(g)
            return lambda: fn(x)(tx)
        return None
    return None


def _fits(backend: Backend, scenario: Scenario) -> bool:
    family = _family(backend)
    return family is None or family in scenario.frameworks


def benchmark_differentiation(
    backends: Sequence[Backend | str],
    scenarios: Iterable[Scenario],
    operators: Iterable[str] | None = None,
    rounds: int = 5,
    number: int | None = None,
) -> list[dict[str, Any]]:
    """Time every backend on every scenario, unprepared and prepared, beside the native call.

    Parameters
    ----------
    backends, scenarios:
        As for :func:`test_differentiation`; a backend skips scenarios written for another
        framework.
    operators:
        Keep only scenarios of these operators (default: all).
    rounds, number:
        ``rounds`` rounds of ``number`` calls each (``number`` None: as many as make a round last
        about 20 ms); the median and minimum per-call times are reported.

    Returns
    -------
    A list of rows (dicts): ``backend``, ``scenario``, ``operator``, ``prepared`` (bool),
    ``calls_of_f`` (Python-level calls of ``f`` during one warm operator call; traces under
    ``jax.jit``), ``calls_first`` (during the first call, preparation included), ``first_s`` (the
    first call's time: preparation and compilation), ``median_s``, ``min_s``, ``native_s`` (None
    where the engine has no idiomatic call of its own) and ``ratio`` (the median over rounds of
    diffiface's time over the native call's time in the same round, from interleaved rounds).
    """
    wanted = None if operators is None else set(operators)
    rows: list[dict[str, Any]] = []
    scenarios = list(scenarios)
    for backend_like in backends:
        backend = normalize(backend_like)
        label = backend_label(backend)
        for scenario in scenarios:
            if wanted is not None and scenario.operator not in wanted:
                continue
            if not _fits(backend, scenario):
                continue
            operator = getattr(di, scenario.operator)
            prepare = getattr(di, "prepare_" + scenario.operator)
            native = native_call(backend, scenario)
            kwargs: dict[str, Any] = {"has_aux": True} if scenario.has_aux else {}
            for prepared in (False, True):
                counted = CountingFunction(scenario.f)  # a fresh f: a cold cache for first_s
                args = scenario.arguments()
                start = time.perf_counter()
                if prepared:
                    prep = prepare(counted, backend, *args, **kwargs)
                    _block(operator(counted, backend, *args, prep=prep, **kwargs))
                    call = functools.partial(operator, counted, backend, *args, prep=prep, **kwargs)
                else:
                    _block(operator(counted, backend, *args, **kwargs))
                    call = functools.partial(operator, counted, backend, *args, **kwargs)
                first_s = time.perf_counter() - start
                calls_first = counted.calls
                counted.calls = 0
                _block(call())
                calls_of_f = counted.calls
                ratio = None
                if native is not None:
                    median_s, min_s, native_s, ratio = time_pair(call, native, rounds, number)
                else:
                    (median_s, min_s), native_s = time_call(call, rounds, number), None
                rows.append(
                    {
                        "backend": label,
                        "scenario": scenario.name,
                        "operator": scenario.operator,
                        "prepared": prepared,
                        "calls_of_f": calls_of_f,
                        "calls_first": calls_first,
                        "first_s": first_s,
                        "median_s": median_s,
                        "min_s": min_s,
                        "native_s": native_s,
                        "ratio": ratio,
                    }
                )
    return rows
