"""Sparse Jacobians with AutoSparse: against the dense Jacobian, against asdex and sparsejac,
colors against bandwidth, and the time to detect and color a pattern.

    python benchmarks/sparse.py [--quick] [--n 10000]
    python benchmarks/run.py --sparse [--quick]          # the same

The function is tridiagonal, f: R^n -> R^n, y_i = 2 x_i**2 - x_{i-1} - x_{i+1}**3, in float32.
Every time is the median of rounds in which the contenders run one after the other
(interleaved), so that a slow spell of a shared machine falls on all of them; each ratio comes
from one run. asdex and sparsejac are used here only, never by diffiface.
Writes benchmarks/results/sparse.json, sparse.md and sparse.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import diffiface as di
from diffiface import sparse

RESULTS = Path(__file__).resolve().parent / "results"


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


def interleaved(contenders: dict[str, Callable[[], Any]], rounds: int, repeat: int) -> dict[str, float]:
    """Median seconds per call of each contender: ``rounds`` rounds, each calling every one
    ``repeat`` times in turn."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for call in contenders.values():  # warm up (compile) outside the timing
        call()
    for _ in range(rounds):
        for name, call in contenders.items():
            start = time.perf_counter()
            for _ in range(repeat):
                call()
            times[name].append((time.perf_counter() - start) / repeat)
    return {name: float(np.median(values)) for name, values in times.items()}


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
    with_dense = interleaved(
        {
            "diffiface": lambda: _ready(di.jacobian(tridiagonal_jax, backend, x, prep=prep)),
            "dense": lambda: _ready(di.jacobian(tridiagonal_jax, "jax", x, prep=dense_prep)),
        },
        max(3, rounds // 3),
        repeat=1,
    )
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
    pattern = sparse.KnownPattern(_banded(n, 2))  # the tridiagonal pattern: torch f is not traced by jax
    backend = di.AutoSparse(engine, detector=pattern)
    prep = di.prepare_jacobian(tridiagonal_torch, backend, x)
    dense_prep = di.prepare_jacobian(tridiagonal_torch, engine, x)
    ours = di.jacobian(tridiagonal_torch, backend, x, prep=prep)
    dense = di.jacobian(tridiagonal_torch, engine, x, prep=dense_prep)
    torch.testing.assert_close(ours.to_dense(), dense)
    del dense
    timed = interleaved(
        {
            "diffiface": lambda: di.jacobian(tridiagonal_torch, backend, x, prep=prep),
            "dense": lambda: di.jacobian(tridiagonal_torch, engine, x, prep=dense_prep),
        },
        max(3, rounds // 3),
        repeat=1,
    )
    return {
        "colors": int(prep.coloring.count),
        "seconds": timed,
        "speedup_vs_dense": timed["dense"] / timed["diffiface"],
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
        f"Generated by `python benchmarks/sparse.py{' --quick' if meta['quick'] else ''}` on {meta['date']} "
        f"({meta['cpu_count']} CPUs, {meta['machine']}; load average {meta['load_average_before']} before). "
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
    d = results["detection"]
    lines += [
        "",
        f"## Detection and coloring (GlobalDetector, n = {n})",
        "",
        f"Detection {d['detection_s']:.3f} s + coloring {d['coloring_s']:.3f} s = {d['total_s']:.3f} s (goal < 2 s).",
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
    args = parser.parse_args(argv)
    rounds = 5 if args.quick else 15
    results: dict[str, Any] = {
        "meta": {
            "quick": args.quick,
            "n": args.n,
            "rounds": rounds,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_average_before": [round(v, 2) for v in os.getloadavg()],
        }
    }
    if di.available("jax"):
        results["jax"] = run_jax(args.n, rounds)
        results["detection"] = run_detection(args.n, max(3, rounds // 3))
    if di.available("torch"):
        for mode in ("autograd", "func"):
            results[f"torch-{mode}"] = run_torch(args.n, rounds, mode)
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
