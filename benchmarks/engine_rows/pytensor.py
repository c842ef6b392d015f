"""Benchmark rows of the pytensor engine: diffiface's prepared gradient by the name "pytensor"
against pytensor's own call for the same gradient, as a user writes it:
``pytensor.function([x, *contexts], pytensor.grad(f(x, *contexts), x))`` with its default
settings (the default mode, numba in PyTensor 3.0), which checks and converts its arguments on
every call. These rows ("10 inputs", "MLP size") carry the goals.

The rows "... (trust_input native)" time the same function called with ``trust_input = True``,
an opt-in that skips that check (a wrong argument then goes unnoticed): a floor, not what users
write, with no goal. diffiface's own compiled function is called that way, behind the checks of
its plan.

``python benchmarks/engine_rows/pytensor.py`` times the rows (and the first compile of each).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

ENGINE = "pytensor"

D, H = 48, 96
MLP_SIZE = D * H + H + H * D + D + D + 1


def tiny(x: Any) -> Any:
    import pytensor.tensor as pt

    return pt.sum(pt.tanh(x) * x)


def mlp_loss(params: Any, data: Any) -> Any:
    """The benchmarks' 48-96-48-1 tanh MLP on one flat parameter vector, in pytensor."""
    import pytensor.tensor as pt

    i = 0
    w1 = pt.reshape(params[i : i + D * H], (D, H))
    i += D * H
    b1 = params[i : i + H]
    i += H
    w2 = pt.reshape(params[i : i + H * D], (H, D))
    i += H * D
    b2 = params[i : i + D]
    i += D
    z = pt.tanh(pt.tanh(data @ w1 + b1) @ w2 + b2)
    out = z @ params[i : i + D] + params[i + D]
    return pt.mean(out * out)


def _native(
    f: Callable[..., Any], x: np.ndarray, *contexts: np.ndarray, trust_input: bool = False
) -> Callable[[], Any]:
    """pytensor's own gradient: ``pytensor.function`` of ``pytensor.grad``, compiled once, with
    its default settings (``trust_input``: called without the check of its arguments)."""
    import pytensor
    import pytensor.tensor as pt

    xv = pt.tensor("x", dtype=str(x.dtype), shape=x.shape)
    cv = [pt.tensor(f"c{i}", dtype=str(c.dtype), shape=c.shape) for i, c in enumerate(contexts)]
    gradient = pytensor.function([xv, *cv], pytensor.grad(f(xv, *cv), xv))
    if trust_input:
        gradient.trust_input = True
    return lambda: gradient(x, *contexts)


def cases(quick: bool) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    import diffiface as di

    rng = np.random.default_rng(0)
    x10 = rng.normal(size=10).astype(np.float32)
    params = (rng.normal(size=MLP_SIZE) * 0.1).astype(np.float32)
    data = rng.normal(size=(64, 48)).astype(np.float32)
    prep10 = di.prepare_gradient(tiny, "pytensor", x10)
    prep_mlp = di.prepare_gradient(mlp_loss, "pytensor", params, di.Constant(data))
    constant = di.Constant(data)

    def ours10() -> Any:
        return di.gradient(tiny, "pytensor", x10, prep=prep10)

    def ours_mlp() -> Any:
        return di.gradient(mlp_loss, "pytensor", params, constant, prep=prep_mlp)

    return [
        ("10 inputs", ours10, _native(tiny, x10)),
        ("MLP size", ours_mlp, _native(mlp_loss, params, data)),
        ("10 inputs (trust_input native)", ours10, _native(tiny, x10, trust_input=True)),
        ("MLP size (trust_input native)", ours_mlp, _native(mlp_loss, params, data, trust_input=True)),
    ]


def _first_compiles() -> None:
    """The first compile of each row's graph, diffiface's preparation and the native
    ``pytensor.function``, after two warm-up compiles of each on other shapes (the first
    compiles in a process load and compile numba's code for pytensor's operations too)."""
    import diffiface as di

    rng = np.random.default_rng(1)
    for n in (3, 4):
        warm = rng.normal(size=n).astype(np.float32)
        di.prepare_gradient(tiny, "pytensor", warm)
        _native(tiny, warm)
    for label, f, x, contexts in (
        ("10 inputs", tiny, rng.normal(size=11).astype(np.float32), ()),
        (
            "MLP size",
            mlp_loss,
            (rng.normal(size=MLP_SIZE) * 0.1).astype(np.float32),
            (rng.normal(size=(64, 48)).astype(np.float32),),
        ),
    ):
        start = time.perf_counter()
        di.prepare_gradient(f, "pytensor", x, *map(di.Constant, contexts))
        ours = time.perf_counter() - start
        start = time.perf_counter()
        _native(f, x, *contexts)
        native = time.perf_counter() - start
        print(f"{label}: preparation {ours * 1e3:.0f} ms, native compile {native * 1e3:.0f} ms")


if __name__ == "__main__":
    import os
    import sys

    # (run as a script, this file's folder leads sys.path, where this file would shadow pytensor)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    sys.modules.pop("pytensor", None)
    from diffiface.test._benchmark import time_pair

    _first_compiles()
    for label, ours, native in cases(quick=False):
        median, _, native_median, ratio = time_pair(ours, native, rounds=11)
        print(f"{label}: ours {median * 1e6:.1f} us, native {native_median * 1e6:.1f} us, ratio {ratio:.3f}")
