"""differentiate_with: what g costs per call over calling the inner engine directly, at MLP size.

    taskset -c 1 python benchmarks/differentiate_with.py [--quick]

One gradient step of an MLP (batch 64, 64 -> 128 -> 128 -> 10, float32):
- a jax network inside torch: ``loss.backward()`` through g (g's forward, then its vjp), against
  the same two calls on the inner engine directly (the network's forward on jax arrays, then
  ``di.vjp(f, "jax", ...)``), and against jax alone (``jax.value_and_grad``, jitted);
- a torch network inside jax: ``jax.grad`` of a loss through g, eager and under ``jax.jit``,
  against the forward and ``di.vjp(f, "torch", ...)`` on torch tensors directly, and against
  torch alone (``loss.backward()``).
Each time is the median of rounds in which the contenders run one after the other (interleaved);
each ratio comes from one run. Writes benchmarks/results/differentiate_with.json and .md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import diffiface as di

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (64, 128, 128, 10)
BATCH = 64


def interleaved(contenders: dict[str, Callable[[], Any]], rounds: int, repeat: int) -> dict[str, float]:
    """Median seconds per call of each contender over ``rounds`` interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for call in contenders.values():  # warm up: preps, compilation
        call()
        call()
    for _ in range(rounds):
        for name, call in contenders.items():
            start = time.perf_counter()
            for _ in range(repeat):
                call()
            times[name].append((time.perf_counter() - start) / repeat)
    return {name: float(np.median(values)) for name, values in times.items()}


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i, (n, m) in enumerate(itertools.pairwise(SIZES)):
        out[f"w{i}"] = (rng.normal(size=(n, m)) / np.sqrt(n)).astype(np.float32)
        out[f"b{i}"] = np.zeros(m, dtype=np.float32)
    return out


def jax_inside_torch(rounds: int, repeat: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import torch

    def network(params: dict[str, Any], data: Any) -> Any:
        h = data
        for i in range(len(SIZES) - 1):
            h = h @ params[f"w{i}"] + params[f"b{i}"][None, :]
            if i < len(SIZES) - 2:
                h = jnp.tanh(h)
        return h

    data = np.random.default_rng(1).normal(size=(BATCH, SIZES[0])).astype(np.float32)
    g = di.differentiate_with(network, "jax")
    params = {k: torch.tensor(v, requires_grad=True) for k, v in _weights().items()}
    jax_params = {k: jnp.asarray(v) for k, v in _weights().items()}
    jax_data = jnp.asarray(data)
    constant = di.Constant(data)

    def through_g() -> None:
        for p in params.values():
            p.grad = None
        (g(params, constant) ** 2).mean().backward()

    def inner_directly() -> None:
        y = network(jax_params, jax_data)
        cotangent = 2 * y / y.size
        jax.block_until_ready(di.vjp(network, "jax", jax_params, cotangent, di.Constant(jax_data)))

    native = jax.jit(jax.value_and_grad(lambda p: jnp.mean(network(p, jax_data) ** 2)))

    def jax_alone() -> None:
        jax.block_until_ready(native(jax_params))

    seconds = interleaved(
        {"through g": through_g, "inner engine directly": inner_directly, "jax alone (jit)": jax_alone},
        rounds,
        repeat,
    )
    return {"seconds": seconds, "overhead": seconds["through g"] / seconds["inner engine directly"]}


def torch_inside_jax(rounds: int, repeat: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import torch

    layers: list[Any] = []
    for i, (n, m) in enumerate(itertools.pairwise(SIZES)):
        layers.append(torch.nn.Linear(n, m))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.Tanh())
    model = torch.nn.Sequential(*layers).eval()
    g = di.differentiate_with(lambda x, model: model(x), "torch")
    data = np.random.default_rng(1).normal(size=(BATCH, SIZES[0])).astype(np.float32)
    x = jnp.asarray(data)
    xt = torch.tensor(data)
    constant = di.Constant(model)

    def loss(x: Any) -> Any:
        return jnp.mean(g(x, constant) ** 2)

    grad = jax.grad(loss)
    jit_grad = jax.jit(jax.grad(loss))

    def eager() -> None:
        jax.block_until_ready(grad(x))

    def jitted() -> None:
        jax.block_until_ready(jit_grad(x))

    def inner_directly() -> None:
        with torch.no_grad():
            y = model(xt)
        di.vjp(lambda x, model: model(x), "torch", xt, 2 * y / y.numel(), constant)

    def torch_alone() -> None:
        leaf = xt.clone().requires_grad_()
        (model(leaf) ** 2).mean().backward()

    seconds = interleaved(
        {
            "through g (jax.grad)": eager,
            "through g (jax.jit(jax.grad))": jitted,
            "inner engine directly": inner_directly,
            "torch alone": torch_alone,
        },
        rounds,
        repeat,
    )
    direct = seconds["inner engine directly"]
    return {
        "seconds": seconds,
        "overhead": seconds["through g (jax.grad)"] / direct,
        "overhead_jit": seconds["through g (jax.jit(jax.grad))"] / direct,
    }


def _markdown(results: dict[str, Any]) -> str:
    lines = [
        "# differentiate_with: g's overhead per call",
        "",
        f"Generated by `taskset -c 1 python benchmarks/differentiate_with.py` on {results['date']} "
        f"({results['cpus']} CPUs, {results['platform']}; load average {results['load']} before). "
        f"One gradient step of an MLP {' -> '.join(map(str, SIZES))}, batch {BATCH}, float32; medians of "
        "interleaved rounds; ratios from one run.",
        "",
    ]
    for title, key, ratios in (
        ("A jax network inside torch (`loss.backward()`)", "jax_inside_torch", ("overhead",)),
        ("A torch network inside jax (`jax.grad`)", "torch_inside_jax", ("overhead", "overhead_jit")),
    ):
        block = results[key]
        direct = block["seconds"]["inner engine directly"]
        lines += [f"## {title}", "", "| | µs per step | / inner engine directly |", "|---|---|---|"]
        for name, seconds in block["seconds"].items():
            lines.append(f"| {name} | {seconds * 1e6:.0f} | {seconds / direct:.2f} |")
        lines.append("")
        lines.append("g's overhead: " + ", ".join(f"{r} {block[r]:.2f}x" for r in ratios) + ".")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    args = parser.parse_args()
    rounds, repeat = (3, 3) if args.quick else (15, 10)
    load = [round(v, 2) for v in os.getloadavg()]
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "load": load,
        "jax_inside_torch": jax_inside_torch(rounds, repeat),
        "torch_inside_jax": torch_inside_jax(rounds, repeat),
    }
    text = _markdown(results)
    print(text)
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "differentiate_with.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        (RESULTS / "differentiate_with.md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
