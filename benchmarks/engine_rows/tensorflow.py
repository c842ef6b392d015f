"""Benchmark rows of the TensorFlow engine: diffiface's prepared gradient against TensorFlow's own
fastest call, a ``tf.function``-compiled ``GradientTape`` gradient.

``cases_jit`` gives the rows with the goals: ``AutoTensorFlow(jit=True)``, whose prep runs one
``tf.function`` too, TensorFlow's compiled configuration as ``compile=True`` is compiled torch's.
``cases(quick)`` gives the default eager backend by its name (``"tensorflow"``), with no goal:
against ``tf.function`` (rows ", eager": each operation runs as the eager tape runs it, which no
prepared call takes to a graph's speed) and against the eager tape a user writes without
``tf.function`` (rows ", eager (eager tape native)"). Each callable returns the finished gradient
as numpy."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

import diffiface as di

ENGINE = "tensorflow"
MLP_SIZE = 48 * 96 + 96 + 96 * 48 + 48 + 48 + 1


def tiny(x: Any) -> Any:
    return tf.reduce_sum(tf.tanh(x) * x)


def mlp_loss(params: Any, data: Any) -> Any:
    """benchmarks/run.py's ``mlp_loss`` (48-96-48-1, tanh) on one flat parameter vector."""
    d, h = 48, 96
    i = 0
    w1 = tf.reshape(params[i : i + d * h], (d, h))
    i += d * h
    b1 = params[i : i + h]
    i += h
    w2 = tf.reshape(params[i : i + h * d], (h, d))
    i += h * d
    b2 = params[i : i + d]
    i += d
    z = tf.tanh(tf.tanh(data @ w1 + b1) @ w2 + b2)
    out = tf.linalg.matvec(z, params[i : i + d]) + params[i + d]
    return tf.reduce_mean(out * out)


def _eager(f: Callable[..., Any]) -> Callable[..., Any]:
    """The gradient a TensorFlow user writes: a ``GradientTape`` watching x."""

    def gradient(x: Any, *args: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = f(x, *args)
        return tape.gradient(value, x)

    return gradient


def _native(f: Callable[..., Any]) -> Callable[..., Any]:
    """The same tape compiled by ``tf.function``: TensorFlow's fastest call."""
    return tf.function(_eager(f))


def _cases(backend: Any, eager: bool = False) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    rng = np.random.default_rng(0)
    x10 = tf.constant(rng.normal(size=10), dtype=tf.float32)
    params = tf.constant(rng.normal(size=MLP_SIZE) * 0.1, dtype=tf.float32)
    data = tf.constant(rng.normal(size=(64, 48)), dtype=tf.float32)

    tiny_prep = di.prepare_gradient(tiny, backend, x10)
    tiny_native = _native(tiny)
    mlp_prep = di.prepare_gradient(mlp_loss, backend, params, di.Constant(data))
    mlp_native = _native(mlp_loss)
    rows = [
        (
            "10 inputs",
            lambda: di.gradient(tiny, backend, x10, prep=tiny_prep).numpy(),
            lambda: tiny_native(x10).numpy(),
        ),
        (
            "MLP size",
            lambda: di.gradient(mlp_loss, backend, params, di.Constant(data), prep=mlp_prep).numpy(),
            lambda: mlp_native(params, data).numpy(),
        ),
    ]
    if eager:
        tiny_eager, mlp_eager = _eager(tiny), _eager(mlp_loss)
        rows = [(f"{label}, eager", ours, native) for label, ours, native in rows]
        rows += [
            (f"{label} (eager tape native)", ours, native)
            for (label, ours, _), native in zip(
                rows, (lambda: tiny_eager(x10).numpy(), lambda: mlp_eager(params, data).numpy()), strict=True
            )
        ]
    return rows


def cases(quick: bool) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """The rows with diffiface's prepared gradient by the name ``"tensorflow"``."""
    return _cases(ENGINE, eager=True)


def cases_jit(quick: bool) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """The same rows with ``AutoTensorFlow(jit=True)``."""
    return _cases(di.AutoTensorFlow(jit=True))


def report() -> None:
    """Print each row's times, ratio and first calls (prep included) with ``time_pair``. Run it
    by path, as the lead's runner loads this module (run as a script, the module's own name
    would shadow tensorflow)::

        python -c "import importlib.util as u; s = u.spec_from_file_location('rows', \\
            'benchmarks/engine_rows/tensorflow.py'); m = u.module_from_spec(s); s.loader.exec_module(m); m.report()"
    """
    import time

    from diffiface.test._benchmark import time_pair

    for name, make in (("eager", cases), ("jit", cases_jit)):
        start = time.perf_counter()
        rows = make(False)
        prepared = time.perf_counter() - start  # (both rows' preps: each traces f once under jit)
        for label, ours, native in rows:
            first = time.perf_counter()
            ours()
            first_ours = time.perf_counter() - first
            first = time.perf_counter()
            native()
            first_native = time.perf_counter() - first
            median, _, native_median, ratio = time_pair(ours, native, rounds=11)
            print(
                f"{name:5} {label:9}  ours {median * 1e6:9.1f} us  native {native_median * 1e6:9.1f} us  "
                f"ratio {ratio:5.2f}  first call: ours {first_ours:.3f} s, native {first_native:.3f} s "
                f"(preps {prepared:.3f} s)"
            )
