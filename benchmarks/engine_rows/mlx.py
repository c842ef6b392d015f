"""Benchmark rows of the mlx engine: diffiface's prepared gradient by the name "mlx" against
mlx's own fastest call, ``mx.compile(mx.grad(f))``; each call returns the gradient evaluated
(``mx.eval``), since mlx is lazy.

    PYTHONPATH=. python benchmarks/engine_rows/mlx.py [--quick]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import diffiface as di

ENGINE = "mlx"

D, H = 48, 96
MLP_SIZE = D * H + H + H * D + D + D + 1  # benchmarks/run.py's MLP_SIZE


def tiny(x: Any) -> Any:
    import mlx.core as mx

    return mx.sum(mx.tanh(x) * x)


def mlp_loss(params: Any, data: Any) -> Any:
    """benchmarks/run.py's ``mlp_loss`` (48-96-48-1, tanh) on one flat parameter vector."""
    import mlx.core as mx

    i = 0
    w1 = mx.reshape(params[i : i + D * H], (D, H))
    i += D * H
    b1 = params[i : i + H]
    i += H
    w2 = mx.reshape(params[i : i + H * D], (H, D))
    i += H * D
    b2 = params[i : i + D]
    i += D
    z = mx.tanh(data @ w1 + b1)
    z = mx.tanh(z @ w2 + b2)
    out = z @ params[i : i + D] + params[i + D]
    return mx.mean(out * out)


def cases(quick: bool) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """``(label, ours, native)`` for "10 inputs" and "MLP size"."""
    import mlx.core as mx

    rng = np.random.default_rng(0)
    x = mx.array(rng.normal(size=10).astype(np.float32))
    params = mx.array((rng.normal(size=MLP_SIZE) * 0.1).astype(np.float32))
    data = mx.array(rng.normal(size=(64, D)).astype(np.float32))

    tiny_prep = di.prepare_gradient(tiny, ENGINE, x)
    tiny_native = mx.compile(mx.grad(tiny))
    mlp_prep = di.prepare_gradient(mlp_loss, ENGINE, params, di.Constant(data))
    mlp_native = mx.compile(mx.grad(mlp_loss))

    def ours_tiny() -> Any:
        g = di.gradient(tiny, ENGINE, x, prep=tiny_prep)
        mx.eval(g)
        return g

    def native_tiny() -> Any:
        g = tiny_native(x)
        mx.eval(g)
        return g

    def ours_mlp() -> Any:
        g = di.gradient(mlp_loss, ENGINE, params, di.Constant(data), prep=mlp_prep)
        mx.eval(g)
        return g

    def native_mlp() -> Any:
        g = mlp_native(params, data)
        mx.eval(g)
        return g

    return [("10 inputs", ours_tiny, native_tiny), ("MLP size", ours_mlp, native_mlp)]


def main() -> None:
    import os
    import time

    # run as a script, this file's folder leads sys.path and its name would hide the mlx package
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]

    from diffiface.test._benchmark import time_pair

    quick = "--quick" in sys.argv
    start = time.perf_counter()
    rows = cases(quick)
    for label, ours, native in rows:
        first = time.perf_counter()
        ours()
        ours_first = time.perf_counter() - first
        first = time.perf_counter()
        native()
        native_first = time.perf_counter() - first
        median, _, native_median, ratio = time_pair(ours, native, rounds=5 if quick else 11)
        print(
            f"{label:10s} ours {median * 1e6:9.1f} us  native {native_median * 1e6:9.1f} us  ratio {ratio:5.2f}  "
            f"first call: ours {ours_first:.3f} s, native {native_first:.3f} s"
        )
    print(f"(prepared in {time.perf_counter() - start:.2f} s)")


if __name__ == "__main__":
    main()
