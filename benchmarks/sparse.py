"""Sparse Jacobians with AutoSparse: against the dense Jacobian, against asdex and sparsejac,
colors against bandwidth, and the time to detect and color a pattern.

    python benchmarks/sparse.py [--quick] [--n 10000]
    python benchmarks/run.py --sparse [--quick]          # the same

The function is tridiagonal, f: R^n -> R^n, y_i = 2 x_i**2 - x_{i-1} - x_{i+1}**3, in float32,
written once with jax.numpy and once with torch (each found by the default detector: jax's
jaxpr, torch's aten operations as f runs). Beside it: an arrowhead map (one dense row, one dense column;
the bidirectional coloring), the Hessian of a chained Rosenbrock function written with
autograd.numpy (the numpy tracer), dense Jacobians at n = 100 by batched products against
one product per column, and batched Hessian-vector products (100 tangents; the sparse Hessian's
colors as one batch) against one hvp per tangent or color.
Every time is the median of rounds in which the contenders run one after the other
(interleaved), so that a slow spell of a shared machine falls on all of them; each ratio comes
from one run. asdex and sparsejac are used here only, never by diffiface.
Writes benchmarks/results/sparse.json, sparse.md and sparse.png.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _timing import interleaved

import diffiface as di
from diffiface import sparse

RESULTS = Path(__file__).resolve().parent / "results"

DENSE_ONCE = [False]
"""--dense-once: each dense operator timed by one prepared call (after its warm-up), on a machine
too loaded to repeat a dense Jacobian of 10^4 x 10^4 several times; the sparse ones by medians."""


def tridiagonal_jax(x: Any) -> Any:
    y = 2 * x**2
    return y.at[1:].add(-x[:-1]).at[:-1].add(-(x[1:] ** 3))


def tridiagonal_torch(x: Any) -> Any:
    import torch

    zero = x[:1] * 0
    return 2 * x**2 - torch.cat([zero, x[:-1]]) - torch.cat([x[1:] ** 3, zero])


def _ready(out: Any) -> Any:
    """Wait for an asynchronous result (jax), whatever its type."""
    import jax

    leaves = [getattr(out, "data", out)]
    return jax.block_until_ready(leaves)


def run_jax(n: int, rounds: int) -> dict[str, Any]:
    import asdex
    import jax
    import jax.numpy as jnp
    import sparsejac
    from jax.experimental import sparse as jax_sparse

    x = jnp.linspace(0.1, 1.0, n, dtype=jnp.float32)
    backend = di.AutoSparse("jax")
    prep = di.prepare_jacobian(tridiagonal_jax, backend, x)
    dense_prep = di.prepare_jacobian(tridiagonal_jax, "jax", x)
    with_asdex = jax.jit(asdex.jacobian(tridiagonal_jax, x))
    pattern = prep.pattern
    rows = np.repeat(np.arange(n), np.diff(pattern.indptr))
    bcoo = jax_sparse.BCOO(
        (jnp.ones(pattern.nnz, jnp.float32), jnp.asarray(np.stack([rows, pattern.indices], 1))), shape=(n, n)
    )
    with_sparsejac = jax.jit(sparsejac.jacfwd(tridiagonal_jax, sparsity=bcoo))

    ours = di.jacobian(tridiagonal_jax, backend, x, prep=prep)
    for name, other in (("asdex", with_asdex(x)), ("sparsejac", with_sparsejac(x))):
        np.testing.assert_allclose(np.asarray(ours.todense()), np.asarray(other.todense()), rtol=1e-6, err_msg=name)

    sparse_only = interleaved(
        {
            "diffiface": lambda: _ready(di.jacobian(tridiagonal_jax, backend, x, prep=prep)),
            "asdex": lambda: _ready(with_asdex(x)),
            "sparsejac": lambda: _ready(with_sparsejac(x)),
        },
        rounds,
        repeat=20,
    )
    contenders = {"diffiface": lambda: _ready(di.jacobian(tridiagonal_jax, backend, x, prep=prep))}
    if DENSE_ONCE[0]:  # the dense call once (after its warm-up), the sparse one by its median
        _ready(di.jacobian(tridiagonal_jax, "jax", x, prep=dense_prep))
        start = time.perf_counter()
        _ready(di.jacobian(tridiagonal_jax, "jax", x, prep=dense_prep))
        once = time.perf_counter() - start
    else:
        contenders["dense"] = lambda: _ready(di.jacobian(tridiagonal_jax, "jax", x, prep=dense_prep))
    with_dense = interleaved(contenders, max(3, rounds // 3), repeat=1)
    if DENSE_ONCE[0]:
        with_dense["dense"] = once
    return {
        "colors": int(prep.coloring.count),
        "seconds": sparse_only,
        "dense_seconds": with_dense["dense"],
        "sparse_seconds_beside_dense": with_dense["diffiface"],
        "speedup_vs_dense": with_dense["dense"] / with_dense["diffiface"],
        "ratio_vs_asdex": sparse_only["diffiface"] / sparse_only["asdex"],
        "ratio_vs_sparsejac": sparse_only["diffiface"] / sparse_only["sparsejac"],
    }


def run_torch(n: int, rounds: int, mode: str) -> dict[str, Any]:
    import torch

    x = torch.linspace(0.1, 1.0, n, dtype=torch.float32)
    engine = di.AutoTorch(mode=mode)
    backend = di.AutoSparse(engine)  # the default detector: torch's aten operations
    prep = di.prepare_jacobian(tridiagonal_torch, backend, x)
    # conservative: the band, and x[:1] * 0 (f's padding) counts as depending on x[0]
    assert prep.detection.tracer == "torch" and (_banded(n, 2).astype(int) - prep.pattern.astype(int) > 0).nnz == 0
    dense_prep = di.prepare_jacobian(tridiagonal_torch, engine, x)
    ours = di.jacobian(tridiagonal_torch, backend, x, prep=prep)
    start = time.perf_counter()
    dense = di.jacobian(tridiagonal_torch, engine, x, prep=dense_prep)
    once = time.perf_counter() - start
    torch.testing.assert_close(ours.to_dense(), dense)
    del dense
    contenders = {"diffiface": lambda: di.jacobian(tridiagonal_torch, backend, x, prep=prep)}
    if not DENSE_ONCE[0]:
        contenders["dense"] = lambda: di.jacobian(tridiagonal_torch, engine, x, prep=dense_prep)
    timed = interleaved(contenders, max(3, rounds // 3), repeat=1)
    timed.setdefault("dense", once)
    return {
        "colors": int(prep.coloring.count),
        "seconds": timed,
        "speedup_vs_dense": timed["dense"] / timed["diffiface"],
        "detected_nnz": int(prep.pattern.nnz),
    }


def arrowhead_jax(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.concatenate([jnp.sum(x**2)[None], x[1:] * x[0] + jnp.sin(x[1:])])


def arrowhead_torch(x: Any) -> Any:
    import torch

    return torch.cat([torch.sum(x**2)[None], x[1:] * x[0] + torch.sin(x[1:])])


def rosenbrock_autograd(x: Any) -> Any:
    import autograd.numpy as anp

    return anp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


def rosenbrock_torch(x: Any) -> Any:
    import torch

    return torch.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


def rosenbrock_jax(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


def _sparse_against_dense(
    f: Callable[..., Any], engine: Any, x: Any, rounds: int, hessian: bool = False, ready: Any = None
) -> dict[str, Any]:
    """Detection, colors and the speed-up of the prepared sparse operator over the prepared dense one."""
    ready = ready or (lambda out: out)
    backend = di.AutoSparse(engine)
    prepare = di.prepare_hessian if hessian else di.prepare_jacobian
    operator = di.hessian if hessian else di.jacobian
    start = time.perf_counter()
    prep = prepare(f, backend, x)
    prepared = time.perf_counter() - start
    dense_prep = prepare(f, engine, x)
    ours = operator(f, backend, x, prep=prep)
    start = time.perf_counter()
    dense = operator(f, engine, x, prep=dense_prep)
    ready(dense)
    once = time.perf_counter() - start
    # (a float64 BCOO densifies in float64 only under jax's x64)
    with sys.modules["jax"].enable_x64(True) if "jax" in sys.modules else contextlib.nullcontext():
        matrix = ours.to_dense() if hasattr(ours, "to_dense") else ours.todense()
        np.testing.assert_allclose(np.asarray(matrix), np.asarray(dense), rtol=1e-4, atol=1e-5)
    del matrix, dense
    contenders = {"diffiface": lambda: ready(operator(f, backend, x, prep=prep))}
    if rounds > 1 and not DENSE_ONCE[0]:
        contenders["dense"] = lambda: ready(operator(f, engine, x, prep=dense_prep))
    timed = interleaved(contenders, max(rounds, 3), repeat=1)
    timed.setdefault("dense", once)  # a dense operator too slow to repeat: its one (prepared) call
    return {
        "colors": int(prep.coloring.count),
        "sides": prep.coloring.sides,
        "mode": prep.coloring.mode,
        "tracer": prep.detection.tracer,
        "prepare_s": prepared,
        "seconds": timed,
        "speedup_vs_dense": timed["dense"] / timed["diffiface"],
    }


def _detection_seconds(f: Callable[..., Any], x: Any, rounds: int, hessian: bool = False) -> dict[str, float]:
    """Global detection alone: the first call (with the tracer's one-time start) and the median after."""
    find = sparse.hessian_pattern if hessian else sparse.jacobian_pattern
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        find(f, x)
        times.append(time.perf_counter() - start)
    return {"first_s": times[0], "median_s": float(np.median(times[1:] if len(times) > 1 else times))}


_FRESH = """
import json, sys, time
sys.path.insert(0, {folder!r})
{before}
import torch
import diffiface
from diffiface import sparse as found
import sparse as bench

x = torch.linspace(0.1, 1.0, {n}, dtype=torch.float32)
times = []
for _ in range({rounds}):
    start = time.perf_counter()
    found.jacobian_pattern(bench.tridiagonal_torch, x)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def _fresh_process_detection(n: int, rounds: int, scipy_before: bool = False) -> dict[str, float]:
    """The torch tridiagonal map's detection in a new Python process: its first call pays every one-time
    cost after ``import torch, diffiface`` (scipy.sparse's import too, unless ``scipy_before``)."""
    import subprocess

    folder = str(Path(__file__).resolve().parent)
    code = _FRESH.format(folder=folder, before="import scipy.sparse" if scipy_before else "", n=n, rounds=rounds)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, check=True
    )
    times = json.loads(result.stdout.strip().splitlines()[-1])
    return {"first_s": times[0], "median_s": float(np.median(times[1:] if len(times) > 1 else times))}


def run_detection_alone(n: int, rounds: int) -> dict[str, Any]:
    """Detection alone, the torch and numpy tracers: in this process, and the torch one in fresh ones."""
    out: dict[str, Any] = {}
    if di.available("torch"):
        import torch

        x = torch.linspace(0.1, 1.0, n, dtype=torch.float64)
        out["detect torch tridiagonal"] = _detection_seconds(tridiagonal_torch, x.float(), max(3, rounds // 2))
        out["detect torch arrowhead"] = _detection_seconds(arrowhead_torch, x, max(3, rounds // 2))
        out["detect torch tridiagonal, fresh process"] = _fresh_process_detection(n, max(3, rounds // 2))
        out["detect torch tridiagonal, fresh process, scipy.sparse imported before"] = _fresh_process_detection(
            n, max(3, rounds // 2), scipy_before=True
        )
    if di.available("autograd"):
        x = np.linspace(0.1, 1.0, n)
        out["detect autograd rosenbrock hessian"] = _detection_seconds(
            rosenbrock_autograd, x, max(3, rounds // 2), True
        )
    return out


def run_engines_own_code(n: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = run_detection_alone(n, rounds)
    if di.available("torch"):
        import torch

        x = torch.linspace(0.1, 1.0, n, dtype=torch.float64)
        out["arrowhead torch"] = _sparse_against_dense(arrowhead_torch, di.AutoTorch(), x, max(2, rounds // 5))
        out["arrowhead torch-func"] = _sparse_against_dense(
            arrowhead_torch, di.AutoTorch(mode="func"), x, max(2, rounds // 5)
        )
    if di.available("jax"):
        import jax
        import jax.numpy as jnp

        with jax.enable_x64(True):  # a float64 array, made in a scope: diffiface keeps float64 itself
            x = jnp.linspace(0.1, 1.0, n, dtype=jnp.float64)
        out["arrowhead jax"] = _sparse_against_dense(arrowhead_jax, di.AutoJAX(), x, max(2, rounds // 5), ready=_ready)
    if di.available("autograd"):
        x = np.linspace(0.1, 1.0, n)
        out["rosenbrock hessian autograd"] = _sparse_against_dense(rosenbrock_autograd, di.AutoAutograd(), x, 1, True)
    return out


def run_batched(n: int, rounds: int) -> dict[str, Any]:
    """A dense Jacobian at n by batched products (the engine's vmap) against one product per column."""
    out: dict[str, Any] = {}

    def compare(name: str, f: Callable[..., Any], engine: Any, x: Any, eye: list[Any], ready: Any) -> None:
        from diffiface import _adapters

        adapter = _adapters.adapter_for(_adapters.normalize(engine))
        jvp_prep = di.prepare_jvp(f, engine, x, eye[0])
        jac_prep = di.prepare_jacobian(f, engine, x)
        batch = di.Tangents(*eye)
        batch_prep = di.prepare_batched_jvp(f, engine, x, batch)
        cotangents = [t * 0.5 for t in eye]
        vjp_prep = di.prepare_vjp(f, engine, x, cotangents[0])
        cobatch = di.Tangents(*cotangents)
        cobatch_prep = di.prepare_batched_vjp(f, engine, x, cobatch)

        def fn(leaves: Any) -> Any:
            return f(leaves[0]), None

        xs = (x,)
        tangents = [(t,) for t in eye]
        gc.collect()
        timed = interleaved(  # the public pair, then the adapters' pair: two groups, so that the garbage of
            {  # the (eager, slow) adapter calls falls on neither of the first two
                "jacobian (batched)": lambda: ready(di.jacobian(f, engine, x, prep=jac_prep)),
                "one jvp per column": lambda: ready([di.jvp(f, engine, x, t, prep=jvp_prep) for t in eye]),
                "batched_jvp": lambda: ready(list(di.batched_jvp(f, engine, x, batch, prep=batch_prep))),
                "batched_vjp": lambda: ready(list(di.batched_vjp(f, engine, x, cobatch, prep=cobatch_prep))),
                "one vjp per row": lambda: ready([di.vjp(f, engine, x, t, prep=vjp_prep) for t in cotangents]),
            },
            max(rounds, 5),
            repeat=3,
        )
        gc.collect()
        timed |= interleaved(
            {
                "adapter batch": lambda: ready(adapter.value_and_pushforwards(fn, xs, tangents)[2]),
                "adapter loop": lambda: ready([adapter.value_and_pushforward(fn, xs, t)[2] for t in tangents]),
            },
            rounds,
            repeat=1,
        )
        out[name] = {
            "seconds": timed,
            "speedup": timed["one jvp per column"] / timed["jacobian (batched)"],
            "adapter_speedup": timed["adapter loop"] / timed["adapter batch"],
            "batched_jvp_speedup": timed["one jvp per column"] / timed["batched_jvp"],
            "batched_vjp_speedup": timed["one vjp per row"] / timed["batched_vjp"],
        }

    if di.available("jax"):
        import jax.numpy as jnp

        x = jnp.linspace(0.1, 1.0, n)
        compare("jax", tridiagonal_jax, di.AutoJAX(), x, list(jnp.eye(n)), _ready)
    if di.available("torch"):
        import torch

        x = torch.linspace(0.1, 1.0, n)
        compare("torch.func", tridiagonal_torch, di.AutoTorch(mode="func"), x, list(torch.eye(n)), lambda o: o)
    return out


def run_batched_hvp(n: int, rounds: int, sparse_n: int) -> dict[str, Any]:
    """di.batched_hvp of n tangents against a loop of prepared di.hvp (the chained Rosenbrock
    function at n), and the sparse Hessian at sparse_n: its colors as one batched hvp (the route
    now) against one prepared hvp per color and a value_and_gradient (the route before, rebuilt
    here from the same prep's colors)."""
    out: dict[str, Any] = {"products": {}, "sparse_hessian": {}}
    if di.available("jax"):
        import jax.numpy as jnp

        x = jnp.linspace(0.1, 1.0, n)
        out["products"]["jax"] = _hvp_products(rosenbrock_jax, di.AutoJAX(), x, list(jnp.eye(n)), rounds, _ready)
    if di.available("torch"):
        import torch

        for name, engine in (("torch.func", di.AutoTorch(mode="func")), ("torch", di.AutoTorch())):
            x = torch.linspace(0.1, 1.0, n, dtype=torch.float64)
            eye = list(torch.eye(n, dtype=torch.float64))
            out["products"][name] = _hvp_products(rosenbrock_torch, engine, x, eye, rounds, lambda o: o)
            x = torch.linspace(0.1, 1.0, sparse_n, dtype=torch.float64)
            out["sparse_hessian"][name] = _sparse_hessian_colors(rosenbrock_torch, engine, x, rounds)
    return out


def _hvp_products(f: Callable[..., Any], engine: Any, x: Any, eye: list[Any], rounds: int, ready: Any) -> Any:
    batch = di.Tangents(*eye)
    hvp_prep = di.prepare_hvp(f, engine, x, eye[0])
    batch_prep = di.prepare_batched_hvp(f, engine, x, batch)
    gc.collect()
    timed = interleaved(
        {
            "batched_hvp": lambda: ready(list(di.batched_hvp(f, engine, x, batch, prep=batch_prep))),
            "loop of hvp": lambda: ready([di.hvp(f, engine, x, t, prep=hvp_prep) for t in eye]),
        },
        max(rounds, 5),
        repeat=1,
    )
    return {"seconds": timed, "speedup": timed["loop of hvp"] / timed["batched_hvp"]}


def _sparse_hessian_colors(f: Callable[..., Any], engine: Any, x: Any, rounds: int) -> Any:
    import torch

    backend = di.AutoSparse(engine)
    prep = di.prepare_hessian(f, backend, x)
    seeds = np.asarray(prep.coloring.seeds)
    colors = [torch.from_numpy(np.ascontiguousarray(seeds[:, k])).to(x.dtype) for k in range(seeds.shape[1])]
    one_prep = di.prepare_hvp(f, engine, x, colors[0])
    gradient_prep = di.prepare_value_and_gradient(f, engine, x)

    def before() -> Any:
        di.value_and_gradient(f, engine, x, prep=gradient_prep)
        return [di.hvp(f, engine, x, c, prep=one_prep) for c in colors]

    gc.collect()
    timed = interleaved(
        {"one batched hvp (now)": lambda: di.hessian(f, backend, x, prep=prep), "one hvp per color (before)": before},
        max(rounds, 5),
        repeat=1,
    )
    return {
        "n": int(x.shape[0]),
        "colors": int(prep.coloring.count),
        "seconds": timed,
        "speedup": timed["one hvp per color (before)"] / timed["one batched hvp (now)"],
    }


def _banded(n: int, band: int) -> Any:
    """The n-by-n pattern with ``band`` diagonals beside the main one (``band // 2`` below)."""
    import scipy.sparse

    lower = band // 2
    offsets = list(range(-lower, band - lower + 1))
    diagonals = [np.ones(n - abs(k), dtype=bool) for k in offsets]
    return scipy.sparse.diags_array(diagonals, offsets=offsets, shape=(n, n), dtype=bool).tocsr()


def run_colors(n: int) -> list[dict[str, Any]]:
    rows = []
    for band in (2, 4, 5, 10, 20, 40):
        pattern = _banded(n, band).tocsr()
        symmetric = (pattern + pattern.T).astype(bool).tocsr()
        rows.append(
            {
                "bandwidth": band,
                "bandwidth + 1": band + 1,
                "column colors": int(sparse.color_jacobian(pattern, mode="column").count),
                "row colors": int(sparse.color_jacobian(pattern, mode="row").count),
                "star colors (symmetric)": int(sparse.color_hessian(symmetric).count),
            }
        )
    return rows


def run_detection(n: int, rounds: int) -> dict[str, float]:
    import jax.numpy as jnp

    x = jnp.linspace(0.1, 1.0, n, dtype=jnp.float32)
    detect, color = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        pattern = sparse.jacobian_pattern(tridiagonal_jax, x)
        middle = time.perf_counter()
        sparse.color_jacobian(pattern)
        detect.append(middle - start)
        color.append(time.perf_counter() - middle)
    return {
        "detection_s": float(np.median(detect)),
        "coloring_s": float(np.median(color)),
        "total_s": float(np.median(np.add(detect, color))),
    }


def write(results: dict[str, Any]) -> str:
    meta, n = results["meta"], results["meta"]["n"]
    lines = [
        "# Sparse Jacobians (AutoSparse)",
        "",
        f"Generated by `python benchmarks/sparse.py{' --quick' if meta['quick'] else ''}"
        f"{' --dense-once' if meta.get('dense_once') else ''}"
        f"{' --torch-threads ' + str(meta['torch_threads']) if meta.get('torch_threads') else ''}` on {meta['date']} "
        f"({meta['cpu_count']} CPUs, {meta['machine']}; load average {meta['load_average_before']} before, "
        f"{meta.get('load_average_after')} after: a shared machine). "
        f"Tridiagonal f: R^n -> R^n, n = {n}, float32, prepared; medians of interleaved rounds.",
        "",
        "## Against asdex and sparsejac (jax, same function and pattern)",
        "",
        "| | diffiface | asdex | sparsejac |",
        "|---|---|---|---|",
    ]
    if "jax" in results:
        jx = results["jax"]
        s = jx["seconds"]
        lines += [
            f"| µs per Jacobian | {s['diffiface'] * 1e6:.0f} | {s['asdex'] * 1e6:.0f} | {s['sparsejac'] * 1e6:.0f} |",
            f"| diffiface / other | 1 | {jx['ratio_vs_asdex']:.2f} | {jx['ratio_vs_sparsejac']:.2f} |",
            "",
            "## Against the dense Jacobian (prepared)",
            "",
            "| engine | colors | sparse (ms) | dense (ms) | speed-up |",
            "|---|---|---|---|---|",
            f"| jax | {jx['colors']} | {jx['sparse_seconds_beside_dense'] * 1e3:.3f} | {jx['dense_seconds'] * 1e3:.1f} "
            f"| {jx['speedup_vs_dense']:.0f}x |",
        ]
    for mode in ("autograd", "func"):
        key = f"torch-{mode}"
        if key in results:
            t = results[key]
            lines.append(
                f"| {key} | {t['colors']} | {t['seconds']['diffiface'] * 1e3:.3f} | {t['seconds']['dense'] * 1e3:.1f} "
                f"| {t['speedup_vs_dense']:.0f}x |"
            )
    own = results.get("own_code", {})
    if own:
        lines += [
            "",
            f"## The engines' own code, default detection (n = {n}, float64)",
            "",
            "| case | tracer | coloring | products (forward + reverse) | prepare (s) | sparse (ms) | dense (ms) "
            "| speed-up |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in own.items():
            if name.startswith("detect"):
                continue
            sides = r["sides"]
            lines.append(
                f"| {name} | {r['tracer']} | {r['mode']} | {r['colors']} ({sides['forward']} + {sides['reverse']}) "
                f"| {r['prepare_s']:.2f} | {r['seconds']['diffiface'] * 1e3:.2f} | {r['seconds']['dense'] * 1e3:.0f} "
                f"| {r['speedup_vs_dense']:.0f}x |"
            )
        lines += ["", "| detection alone | first call (s) | median after (s) |", "|---|---|---|"]
        for name, r in own.items():
            if name.startswith("detect"):
                lines.append(f"| {name.removeprefix('detect ')} | {r['first_s']:.3f} | {r['median_s']:.3f} |")
        lines += [
            "",
            "Detection alone, n = 10^4 (the tridiagonal map in float32, the others in float64). In this "
            "process the first call is a warm one where an earlier section prepared the same engine (none does "
            "under --only detection); the "
            "fresh-process rows are the first detection of a new process, timed from after `import torch, "
            "diffiface` (with scipy.sparse's import, about 0.25 s, unless imported before), and the median "
            "of the calls after it.",
        ]
        section = meta.get("detection_section")
        if section is not None:  # (run alone: --only detection)
            lines += [
                "",
                f"The detection rows alone: `python benchmarks/sparse.py --only detection"
                f"{' --quick' if section['quick'] else ''}` on {section['date']} (load average "
                f"{section['load_average_before']} before, {section.get('load_average_after')} after).",
            ]
    batched = results.get("batched", {})
    if batched:
        lines += [
            "",
            f"## Dense Jacobian at n = {meta.get('batched_n', 100)}: batched products against one per column",
            "",
            "| engine | jacobian, batched (ms) | one jvp per column (ms) | speed-up | adapter batch (ms) "
            "| adapter loop (ms) | speed-up |",
            "|---|---|---|---|---|---|---|",
        ]
        section = meta.get("batched_section")
        if section is not None:  # (run alone, after the rest: --only batched)
            lines[-3:-3] = [
                "",
                f"This section alone: `python benchmarks/sparse.py --only batched{' --quick' if section['quick'] else ''}"
                f"{' --torch-threads ' + str(section['torch_threads']) if section.get('torch_threads') else ''}` on "
                f"{section['date']} (load average {section['load_average_before']} before, "
                f"{section.get('load_average_after')} after).",
            ]
        for name, r in batched.items():
            t = r["seconds"]
            lines.append(
                f"| {name} | {t['jacobian (batched)'] * 1e3:.2f} | {t['one jvp per column'] * 1e3:.2f} "
                f"| {r['speedup']:.1f}x | {t['adapter batch'] * 1e3:.2f} | {t['adapter loop'] * 1e3:.2f} "
                f"| {r['adapter_speedup']:.1f}x |"
            )
        lines += [
            "",
            "The first pair goes through the public operators (the Jacobian is the engine's vmapped "
            "jacrev/jacfwd); the second calls the adapters' value_and_pushforwards (one vmapped program) "
            "against value_and_pushforward per column, without the operators around them.",
        ]
        if all("batched_jvp" in r["seconds"] for r in batched.values()):
            lines += [
                "",
                f"### The public batched products: {meta.get('batched_n', 100)} tangents in one call against a "
                "Python loop of prepared calls",
                "",
                "| engine | di.batched_jvp (ms) | loop of di.jvp (ms) | speed-up | di.batched_vjp (ms) "
                "| loop of di.vjp (ms) | speed-up |",
                "|---|---|---|---|---|---|---|",
            ]
            for name, r in batched.items():
                t = r["seconds"]
                lines.append(
                    f"| {name} | {t['batched_jvp'] * 1e3:.2f} | {t['one jvp per column'] * 1e3:.2f} "
                    f"| {r['batched_jvp_speedup']:.1f}x | {t['batched_vjp'] * 1e3:.2f} "
                    f"| {t['one vjp per row'] * 1e3:.2f} | {r['batched_vjp_speedup']:.1f}x |"
                )
            lines += [
                "",
                "Both prepared (prepare_batched_jvp / prepare_jvp, and the vjp pair); the batch is one "
                "vmapped program on both engines (jax: jit of jax.vmap over jax.linearize / jax.vjp; "
                "torch.func: torch.func.vmap, f evaluated once).",
            ]
    hvps = results.get("batched_hvp")
    if hvps:
        lines += [
            "",
            f"### Batched Hessian-vector products: {meta.get('batched_n', 100)} tangents of the chained Rosenbrock "
            "function in one call against a Python loop of prepared di.hvp",
            "",
            "| engine | di.batched_hvp (ms) | loop of di.hvp (ms) | speed-up |",
            "|---|---|---|---|",
        ]
        for name, r in hvps["products"].items():
            t = r["seconds"]
            lines.append(
                f"| {name} | {t['batched_hvp'] * 1e3:.2f} | {t['loop of hvp'] * 1e3:.2f} | {r['speedup']:.1f}x |"
            )
        lines += [
            "",
            "One vmapped program on jax (jit) and torch.func (forward over reverse); torch's autograd mode builds "
            "f and its gradient's graph once and runs one backward pass through it per tangent.",
        ]
        if hvps["sparse_hessian"]:
            lines += [
                "",
                "### The sparse Hessian's colors: one batched hvp against one hvp per color",
                "",
                "| engine | n | colors | di.hessian, AutoSparse (ms) | one hvp per color + value_and_gradient (ms) "
                "| speed-up |",
                "|---|---|---|---|---|---|",
            ]
            for name, r in hvps["sparse_hessian"].items():
                t = r["seconds"]
                lines.append(
                    f"| {name} | {r['n']} | {r['colors']} | {t['one batched hvp (now)'] * 1e3:.2f} "
                    f"| {t['one hvp per color (before)'] * 1e3:.2f} | {r['speedup']:.1f}x |"
                )
            lines += [
                "",
                "The chained Rosenbrock function in float64. The right column is the route before this change "
                "(a prepared value_and_gradient and one prepared hvp per color), rebuilt from the same prep's "
                "colors, without the gather.",
            ]
    d = results["detection"]
    lines += [
        "",
        f"## Detection and coloring (GlobalDetector, n = {n})",
        "",
        f"Detection {d['detection_s']:.3f} s + coloring {d['coloring_s']:.3f} s = {d['total_s']:.3f} s (goal < 0.5 s).",
        "",
        f"## Colors on banded patterns (n = {n})",
        "",
        "| bandwidth | bandwidth + 1 | column colors | row colors | star colors (symmetric) |",
        "|---|---|---|---|---|",
    ]
    for row in results["colors"]:
        lines.append("| " + " | ".join(str(v) for v in row.values()) + " |")
    lines += [
        "",
        "Star colors are those of the pattern made symmetric, whose bandwidth is twice the larger side: "
        "an odd bandwidth (2 below, 3 above for 5) becomes 6, hence 7 colors.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    if "jax" in results:
        s = results["jax"]["seconds"]
        names = list(s)
        left.bar(names, [s[k] * 1e6 for k in names], color=["tab:blue", "tab:gray", "tab:gray"])
        left.set_ylabel("µs per prepared Jacobian (median)")
        left.set_title(f"jax, tridiagonal, n = {results['meta']['n']}")
    bands = [row["bandwidth"] for row in results["colors"]]
    right.plot(bands, [b + 1 for b in bands], "k--", label="bandwidth + 1")
    right.plot(bands, [row["column colors"] for row in results["colors"]], "o", label="column colors")
    right.plot(bands, [row["star colors (symmetric)"] for row in results["colors"]], "s", label="star colors")
    right.set_xlabel("bandwidth")
    right.set_ylabel("colors")
    right.legend()
    right.set_title("colors on banded patterns")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--n", type=int, default=10_000, help="the size of x and f(x) (default 10000)")
    parser.add_argument("--dense-once", action="store_true", help="time each dense operator by one call")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch's intra-op threads (on a loaded machine, 2 threads spin against other processes: torch.sin "
        "of 10^4 numbers took 13 ms with 2 threads, 0.17 ms with 1)",
    )
    parser.add_argument(
        "--only",
        choices=["batched", "detection"],
        default=None,
        help="run one section and put it into the results written before (sparse.json), keeping the others",
    )
    args = parser.parse_args(argv)
    DENSE_ONCE[0] = args.dense_once
    if args.torch_threads is not None and di.available("torch"):
        import torch

        torch.set_num_threads(args.torch_threads)
    rounds = 5 if args.quick else 15
    results: dict[str, Any] = {
        "meta": {
            "quick": args.quick,
            "dense_once": args.dense_once,
            "torch_threads": args.torch_threads,
            "n": args.n,
            "rounds": rounds,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_average_before": [round(v, 2) for v in os.getloadavg()],
        }
    }
    RESULTS.mkdir(parents=True, exist_ok=True)

    def done(section: str) -> None:  # progress, and what is done kept should a later section fail
        print(f"{time.strftime('%H:%M:%S')} {section} done (load {os.getloadavg()[0]:.1f})", flush=True)
        (RESULTS / "sparse.json").write_text(json.dumps(results, indent=1))

    if args.only == "batched":  # the other sections as the last full run wrote them
        previous = json.loads((RESULTS / "sparse.json").read_text())
        previous["meta"]["batched_section"] = results["meta"]
        results = previous
        results["batched"] = run_batched(100, rounds)
        results["batched_hvp"] = run_batched_hvp(100, rounds, args.n)
        results["meta"]["batched_section"]["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
        (RESULTS / "sparse.json").write_text(json.dumps(results, indent=1))
        text = write(results)
        (RESULTS / "sparse.md").write_text(text)
        print(text)
        return results
    if args.only == "detection":  # the detection rows anew, the rest as the last full run wrote it
        previous = json.loads((RESULTS / "sparse.json").read_text())
        previous["meta"]["detection_section"] = results["meta"]
        results = previous
        results.setdefault("own_code", {}).update(run_detection_alone(args.n, rounds))
        results["meta"]["detection_section"]["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
        (RESULTS / "sparse.json").write_text(json.dumps(results, indent=1))
        text = write(results)
        (RESULTS / "sparse.md").write_text(text)
        print(text)
        return results
    if di.available("jax"):
        results["jax"] = run_jax(args.n, rounds)
        results["detection"] = run_detection(args.n, max(3, rounds // 3))
        done("jax")
    if di.available("torch"):
        for mode in ("autograd", "func"):
            results[f"torch-{mode}"] = run_torch(args.n, rounds, mode)
            done(f"torch-{mode}")
    results["own_code"] = run_engines_own_code(args.n, rounds)
    done("own code")
    results["meta"]["batched_n"] = 100
    results["batched"] = run_batched(100, rounds)
    results["batched_hvp"] = run_batched_hvp(100, rounds, args.n)
    done("batched")
    results["colors"] = run_colors(args.n)
    results["meta"]["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sparse.json").write_text(json.dumps(results, indent=1))
    text = write(results)
    (RESULTS / "sparse.md").write_text(text)
    plot(results, RESULTS / "sparse.png")
    print(text)
    return results


if __name__ == "__main__":
    main()
