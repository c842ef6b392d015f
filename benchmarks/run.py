"""Standard benchmarks of diffiface: overhead against each engine's native call, gradient cost
against f's cost as the input grows, finite-difference evaluation counts, import time and
first-call (preparation) time.

    python benchmarks/run.py [--quick]

Writes benchmarks/results/results.json, results.md and PNG plots beside them.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import diffiface as di
from diffiface.test import Scenario
from diffiface.test._benchmark import CountingFunction, benchmark_differentiation, time_call

RESULTS = Path(__file__).resolve().parent / "results"


def ns(x):
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        return torch
    if module.startswith("jax"):
        import jax.numpy as jnp

        return jnp
    import autograd.numpy as anp

    return anp


def tiny(x):
    m = ns(x)
    return m.sum(m.tanh(x) * x)


def mlp_loss(params, data):
    m = ns(params)
    d, h = 48, 96
    i = 0
    w1 = m.reshape(params[i : i + d * h], (d, h))
    i += d * h
    b1 = params[i : i + h]
    i += h
    w2 = m.reshape(params[i : i + h * d], (h, d))
    i += h * d
    b2 = params[i : i + d]
    i += d
    w3 = params[i : i + d]
    i += d
    b3 = params[i]
    z = m.tanh(data @ w1 + b1)
    z = m.tanh(z @ w2 + b2)
    out = z @ w3 + b3
    return m.mean(out * out)


MLP_SIZE = 48 * 96 + 96 + 96 * 48 + 48 + 48 + 1

FRAMEWORK = {"jax": "jax", "torch": "torch", "torch-func": "torch", "autograd": "autograd"}


def backend(name):
    return {
        "jax": di.AutoJAX(),
        "torch": di.AutoTorch(),
        "torch-func": di.AutoTorch(mode="func"),
        "autograd": di.AutoAutograd(),
    }[name]


def array(framework, values):
    values = np.asarray(values)
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.asarray(values, dtype=jnp.float32)
    if framework == "torch":
        import torch

        return torch.tensor(values, dtype=torch.float32)
    return values.astype(np.float64)


def overhead_scenarios(framework):
    rng = np.random.default_rng(0)
    x10 = array(framework, rng.normal(size=10))
    t10 = array(framework, rng.normal(size=10))
    p = array(framework, rng.normal(size=MLP_SIZE) * 0.1)
    tp = array(framework, rng.normal(size=MLP_SIZE))
    data = array(framework, rng.normal(size=(64, 48)))
    fw = frozenset({framework})
    return [
        Scenario("tiny-10", tiny, x10, "gradient", reference=None, frameworks=fw),
        Scenario("tiny-10", tiny, x10, "hvp", tangent=t10, reference=None, frameworks=fw),
        Scenario("tiny-10-jacobian", lambda x: ns(x).tanh(x) * x, x10, "jacobian", reference=None, frameworks=fw),
        Scenario(
            f"mlp-{MLP_SIZE}", mlp_loss, p, "gradient", contexts=(di.Constant(data),), reference=None, frameworks=fw
        ),
        Scenario(
            f"mlp-{MLP_SIZE}",
            mlp_loss,
            p,
            "hvp",
            tangent=tp,
            contexts=(di.Constant(data),),
            reference=None,
            frameworks=fw,
        ),
    ]


def run_overhead(names, rounds):
    rows = []
    for name in names:
        print(f"overhead: {name}", flush=True)
        rows += benchmark_differentiation([backend(name)], overhead_scenarios(FRAMEWORK[name]), rounds=rounds)
    return rows


def run_scaling(names, sizes, rounds):
    rows = []
    for name in names:
        fw = FRAMEWORK[name]
        for n in sizes:
            print(f"scaling: {name} n={n}", flush=True)
            x = array(fw, np.random.default_rng(1).normal(size=n))
            if fw == "jax":
                import jax

                f_call = jax.jit(tiny)
            else:
                f_call = tiny
            f_s = time_call(functools.partial(f_call, x), rounds)[0]
            prep = di.prepare_gradient(tiny, backend(name), x)
            g_s = time_call(functools.partial(di.gradient, tiny, backend(name), x, prep=prep), rounds)[0]
            rows.append({"backend": name, "n": n, "f_s": f_s, "gradient_s": g_s, "cost_ratio": g_s / f_s})
    return rows


def run_fd_counts(n=10):
    rng = np.random.default_rng(2)
    x, t = rng.normal(size=n), rng.normal(size=n)
    vec = lambda z: np.tanh(z) * z  # noqa: E731
    cases = {
        "gradient": (tiny, (x,)),
        "value_and_gradient": (tiny, (x,)),
        "jacobian": (vec, (x,)),
        "jvp": (vec, (x, t)),
        "vjp": (vec, (x, t)),
        "hvp": (tiny, (x, t)),
        "hessian": (tiny, (x,)),
    }
    rows = []
    for method in ("central", "forward"):
        b = di.AutoFiniteDifferences(method=method)
        for op, (f, args) in cases.items():
            for prepared in (False, True):
                counted = CountingFunction(f)
                try:
                    prep = getattr(di, "prepare_" + op)(counted, b, *args) if prepared else None
                    counted.calls = 0
                    getattr(di, op)(counted, b, *args, **({"prep": prep} if prep is not None else {}))
                    calls = counted.calls
                except Exception as error:
                    calls = f"error: {type(error).__name__}"
                rows.append({"method": method, "operator": op, "n": n, "prepared": prepared, "calls_of_f": calls})
    return rows


def run_import_time(repeats):
    def best(code):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times.append(time.perf_counter() - start)
        return min(times)

    base = best("import numpy, optree")
    full = best("import diffiface")
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import diffiface"], capture_output=True, text=True, check=True
    ).stderr
    cumulative = None
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[2].strip() == "diffiface":
            cumulative = int(parts[1]) * 1e-6
    heavy = [
        m
        for m in ("jax", "torch", "autograd", "scipy")
        if f"| {m}\n" in out + "\n" or any(line.split("|")[-1].strip() == m for line in out.splitlines())
    ]
    return {
        "python_import_diffiface_s": full,
        "python_import_numpy_optree_s": base,
        "diffiface_own_s": full - base,
        "importtime_cumulative_diffiface_s": cumulative,
        "frameworks_imported": heavy,
    }


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def table(rows, keys):
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def plots(results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["overhead"] if r["ratio"] is not None]
    labels = [f"{r['backend']}\n{r['scenario']}\n{r['operator']}" for r in rows if not r["prepared"]]
    unprep = [r["ratio"] for r in rows if not r["prepared"]]
    prep = [r["ratio"] for r in rows if r["prepared"]]
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.7), 5))
    pos = np.arange(len(labels))
    ax.bar(pos - 0.2, unprep, 0.4, label="unprepared")
    ax.bar(pos + 0.2, prep, 0.4, label="prepared")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(pos, labels, fontsize=6, rotation=90)
    ax.set_ylabel("diffiface time / native time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "overhead.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted({r["backend"] for r in results["scaling"]}):
        pts = [r for r in results["scaling"] if r["backend"] == name]
        ax.plot([p["n"] for p in pts], [p["cost_ratio"] for p in pts], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters n")
    ax.set_ylabel("gradient time / f time (prepared)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "scaling.png", dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, no 1e6 size")
    args = parser.parse_args()
    names = [
        n
        for n in ("jax", "torch", "torch-func", "autograd")
        if di.available(FRAMEWORK[n] if n != "torch-func" else "torch")
    ]
    rounds = 3 if args.quick else 7
    sizes = [10, 1_000, 100_000] + ([] if args.quick else [1_000_000])
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = {
        "meta": {
            "quick": args.quick,
            "python": platform.python_version(),
            "machine": platform.platform(),
            "rounds": rounds,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "import": run_import_time(3 if args.quick else 7),
        "fd_counts": run_fd_counts(),
        "overhead": run_overhead(names, rounds),
        "scaling": run_scaling(names, sizes, rounds),
    }
    results["first_call"] = [
        {
            "backend": r["backend"],
            "scenario": r["scenario"],
            "operator": r["operator"],
            "prepared": r["prepared"],
            "first_s": r["first_s"],
            "calls_first": r["calls_first"],
        }
        for r in results["overhead"]
    ]
    (RESULTS / "results.json").write_text(json.dumps(results, indent=1))
    md = [
        "# diffiface benchmarks",
        "",
        f"Generated by `python benchmarks/run.py{' --quick' if args.quick else ''}` on {results['meta']['date']} "
        f"(Python {results['meta']['python']}, {results['meta']['machine']}, CPU). Times in seconds, median of {rounds} rounds.",
        "",
        "## Overhead against the native call",
        "",
        "`ratio` = diffiface median / native median (jax: `jax.jit(jax.grad(f))` etc.; torch: `torch.autograd.grad`; "
        "torch-func: `torch.func.grad`; autograd: `autograd.grad`). `calls_of_f` is Python calls of f in one warm call "
        "(traces under jit).",
        "",
        table(
            results["overhead"],
            ["backend", "scenario", "operator", "prepared", "median_s", "native_s", "ratio", "calls_of_f"],
        ),
        "",
        "![overhead](overhead.png)",
        "",
        "## Gradient cost / f cost (prepared, f = sum(tanh(x) * x))",
        "",
        table(results["scaling"], ["backend", "n", "f_s", "gradient_s", "cost_ratio"]),
        "",
        "![scaling](scaling.png)",
        "",
        "## Finite-difference evaluations of f per call (n = 10)",
        "",
        table(results["fd_counts"], ["method", "operator", "prepared", "n", "calls_of_f"]),
        "",
        "## Import time",
        "",
        table([results["import"]], list(results["import"])),
        "",
        "## First call (preparation, tracing, compilation), fresh f",
        "",
        table(results["first_call"], ["backend", "scenario", "operator", "prepared", "first_s", "calls_first"]),
        "",
    ]
    (RESULTS / "results.md").write_text("\n".join(md))
    plots(results)
    print((RESULTS / "results.md").read_text())


if __name__ == "__main__":
    main()
