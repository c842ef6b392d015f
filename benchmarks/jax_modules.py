"""What equinox users pass: the module itself as x, against the call they write on the same loss.

    taskset -c 1 python benchmarks/jax_modules.py [--quick]

One process, one CPU; each row times diffiface's prepared gradient (the backend by its string
name, the batch a ``di.Constant`` of jax arrays) and the native call in interleaved rounds (the
median over rounds of the ratio within a round). The native call is equinox's own idiom,
``eqx.filter_jit(eqx.filter_grad(loss))(model, batch)``: an equinox module holds leaves that
are not arrays (an MLP's activation functions), which ``jax.jit`` refuses as arguments. The
``floor`` column times diffiface against ``jax.jit(jax.grad(...))`` of the module's arrays
alone (``eqx.partition``, the rest closed over), which no Python call on the whole module can
beat. The rows:

- ``MLP``: ``eqx.nn.MLP(64, 16, width_size=128, depth=2)``, a batch of 64 rows, float32;
- ``Linear``: ``eqx.nn.Linear(64, 16)``, every leaf an array, the same batch.

Writes benchmarks/results/jax_modules.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _timing import write_results

import diffiface as di
from diffiface.test._benchmark import time_pair


def loss(model: Any, batch: tuple[Any, Any]) -> Any:
    inputs, targets = batch
    return jnp.mean((jax.vmap(model)(inputs) - targets) ** 2)


def cases() -> dict[str, Any]:
    key = jax.random.PRNGKey(0)
    rng = np.random.default_rng(0)
    batch = (jnp.asarray(rng.normal(size=(64, 64)), jnp.float32), jnp.asarray(rng.normal(size=(64, 16)), jnp.float32))
    return {
        "MLP": (eqx.nn.MLP(64, 16, width_size=128, depth=2, key=key), batch),
        "Linear": (eqx.nn.Linear(64, 16, key=key), batch),
    }


def calls(model: Any, batch: Any) -> dict[str, Callable[[], Any]]:
    constant = di.Constant(batch)
    prep = di.prepare_gradient(loss, "jax", model, constant)
    native = eqx.filter_jit(eqx.filter_grad(loss))
    params, static = eqx.partition(model, eqx.is_array)
    floor = jax.jit(jax.grad(lambda p, b: loss(eqx.combine(p, static), b)))
    ours = di.gradient(loss, "jax", model, constant, prep=prep)
    if not eqx.tree_equal(ours, native(model, batch), rtol=1e-5, atol=1e-7):
        raise AssertionError("diffiface's gradient is not equinox's")
    return {
        "diffiface": lambda: jax.block_until_ready(di.gradient(loss, "jax", model, constant, prep=prep)),
        "native": lambda: jax.block_until_ready(native(model, batch)),
        "floor": lambda: jax.block_until_ready(floor(params, batch)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 21")
    rounds = 5 if parser.parse_args().quick else 21
    rows = []
    for name, (model, batch) in cases().items():
        timed = calls(model, batch)
        ours_s, _, native_s, ratio = time_pair(timed["diffiface"], timed["native"], rounds)
        _, _, floor_s, floor_ratio = time_pair(timed["diffiface"], timed["floor"], rounds)
        rows.append(
            {
                "row": name,
                "diffiface_s": ours_s,
                "native_s": native_s,
                "ratio": ratio,
                "floor_s": floor_s,
                "floor": floor_ratio,
            }
        )
        print(f"{name}: {ratio:.3f} x native, {floor_ratio:.3f} x floor", flush=True)
    write_results(
        "jax_modules",
        "taskset -c 1 python benchmarks/jax_modules.py",
        "What equinox users pass",
        f"jax {jax.__version__}, equinox {eqx.__version__}; `ratio` = diffiface / native "
        f"(`eqx.filter_jit(eqx.filter_grad(loss))`), `floor` = diffiface / `jax.jit(jax.grad)` of the "
        f"module's arrays alone; each the median over {rounds} interleaved rounds of the ratio within a round.",
        ["row", "native_s", "diffiface_s", "ratio", "floor_s", "floor"],
        rows,
        lambda r: [
            r["row"],
            f"{r['native_s']:.3g}",
            f"{r['diffiface_s']:.3g}",
            f"{r['ratio']:.3f}",
            f"{r['floor_s']:.3g}",
            f"{r['floor']:.3f}",
        ],
        jax=jax.__version__,
        equinox=eqx.__version__,
        rounds=rounds,
    )


if __name__ == "__main__":
    main()
