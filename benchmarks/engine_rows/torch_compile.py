"""Benchmark rows of compiled torch ("torch-compile"): diffiface's prepared gradient against
``torch.compile(torch.func.grad(f))``, the engine's own fastest call.

``python benchmarks/engine_rows/torch_compile.py`` times the rows (interleaved rounds, one torch
thread) and prints
the ratios and each side's first-compile time. The first call of each side compiles (Inductor,
seconds to a minute on a small machine): ``cases`` makes both calls ready, compiled, before it
returns them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from run import MLP_SIZE, mlp_loss, tiny

import diffiface as di

ENGINE = "torch-compile"

torch.set_num_threads(1)  # (one thread, as benchmarks/torch_users.py: both sides run alike on one CPU)

FIRST_COMPILE: dict[str, tuple[float, float]] = {}
"""Seconds of each row's first call, ``(ours, native)``: the compile."""


def _pair(
    label: str, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]
) -> tuple[str, Callable[[], Any], Callable[[], Any]]:
    prep = di.prepare_gradient(f, ENGINE, x, *contexts)
    native_grad = torch.compile(torch.func.grad(f))
    raw = tuple(c.value for c in contexts)

    def ours() -> Any:
        return di.gradient(f, ENGINE, x, *contexts, prep=prep).numpy()

    def native() -> Any:
        return native_grad(x, *raw).numpy()

    start = time.perf_counter()
    ours()
    middle = time.perf_counter()
    native()
    FIRST_COMPILE[label] = (middle - start, time.perf_counter() - middle)
    return label, ours, native


def cases(quick: bool) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=10).astype(np.float32))
    params = torch.from_numpy((rng.normal(size=MLP_SIZE) * 0.1).astype(np.float32))
    data = torch.from_numpy(rng.normal(size=(64, 48)).astype(np.float32))
    return [
        _pair("10 inputs", tiny, x, ()),
        _pair("MLP size", mlp_loss, params, (di.Constant(data),)),
    ]


if __name__ == "__main__":
    from diffiface.test._benchmark import time_pair

    for label, ours, native in cases(quick=False):
        median, _, native_median, ratio = time_pair(ours, native, rounds=11)
        first_ours, first_native = FIRST_COMPILE[label]
        print(
            f"{label}: ours {median * 1e6:.1f} us, native {native_median * 1e6:.1f} us, ratio {ratio:.3f}; "
            f"first call {first_ours:.1f} s (ours), {first_native:.1f} s (native)"
        )
