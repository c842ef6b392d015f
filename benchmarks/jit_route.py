"""What jax's tier of the route costs after the compiled program, step by step, on the MLP of
``benchmarks/run.py`` (one float32 parameter vector, a 64 x 48 batch as a Constant):

    taskset -c 1 python benchmarks/jit_route.py

One process, one CPU, interleaved rounds (the median over rounds of each call's time). The
calls, each ending with the gradient ready:

- ``native``: ``jax.jit(jax.grad(mlp_loss))(params, data)``;
- ``compiled``: the prep's compiled program called on the leaves, no route;
- ``compiled, then list(map(type, ...))``: the same, after the type test written with the builtins
  ``list`` and ``map`` (what ``JitProgram.run`` did);
- ``compiled, then an index loop``: the same, after the same test written as a ``while`` loop
  (what it does now);
- ``JitProgram.run``: the route's tier on the call's arguments;
- ``di.gradient``: the public call with the prep.

Right after the engine's work the processor's caches hold little of Python's own code, and a
builtin that walks a sequence costs far more than in a loop of its own (a micro-benchmark); the
third and fourth rows show it. Writes benchmarks/results/jit_route.json and .md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
from _timing import interleaved, write_results
from run import MLP_SIZE, mlp_loss

import diffiface as di

RESULTS = Path(__file__).resolve().parent / "results"
ROUNDS = 21


def calls() -> dict[str, Callable[[], Any]]:
    rng = np.random.default_rng(0)
    params = jnp.asarray((rng.normal(size=MLP_SIZE) * 0.1).astype(np.float32))
    data = jnp.asarray(rng.normal(size=(64, 48)).astype(np.float32))
    constant = di.Constant(data)
    native = jax.jit(jax.grad(mlp_loss))
    prep = di.prepare_gradient(mlp_loss, "jax", params, constant)
    program = prep.plan.jit
    assert program is not None, "the prep is not of jax's tier"
    compiled = program.compiled
    leaves = [params, data]
    types = [type(params), type(data)]

    def by_map() -> Any:
        if list(map(type, leaves)) != types:
            raise AssertionError
        return compiled(params, data).block_until_ready()

    def by_loop() -> Any:
        i = 0
        while i < len(types):
            if type(leaves[i]) is not types[i]:
                raise AssertionError
            i += 1
        return compiled(params, data).block_until_ready()

    return {
        "native": lambda: native(params, data).block_until_ready(),
        "compiled": lambda: compiled(params, data).block_until_ready(),
        "compiled, then list(map(type, ...))": by_map,
        "compiled, then an index loop": by_loop,
        "JitProgram.run": lambda: program.run(
            "gradient", mlp_loss, "jax", params, None, (constant,), False
        ).block_until_ready(),
        "di.gradient": lambda: di.gradient(mlp_loss, "jax", params, constant, prep=prep).block_until_ready(),
    }


def main() -> None:
    medians = interleaved(calls(), rounds=ROUNDS, repeat=500, warmups=200)
    native = medians["native"]
    rows = [{"call": label, "seconds": s, "over_native_us": (s - native) * 1e6} for label, s in medians.items()]
    for row in rows:
        print(f"{row['call']}: {row['seconds'] * 1e6:.2f} us ({row['over_native_us']:+.2f} us)", flush=True)
    write_results(
        "jit_route",
        "taskset -c 1 python benchmarks/jit_route.py",
        "jax's tier of the route, step by step",
        f"jax {jax.__version__}; the median of {ROUNDS} interleaved rounds.",
        ["call", "seconds", "over native (us)"],
        rows,
        lambda r: [r["call"], f"{r['seconds']:.3g}", f"{r['over_native_us']:+.2f}"],
        jax=jax.__version__,
        rounds=ROUNDS,
    )


if __name__ == "__main__":
    main()
