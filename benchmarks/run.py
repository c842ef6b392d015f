"""Standard benchmarks of diffiface: overhead against each engine's native call, gradient cost
against f's cost as the input grows, finite-difference evaluation counts, import time and
first-call (preparation) time.

    python benchmarks/run.py [--quick] [--cpus 0]

Writes benchmarks/results/results.json, results.md and PNG plots beside them. With
``--cpus``, the process runs on those CPUs only (``os.sched_setaffinity``), diffiface and the
native calls alike, and the overhead section is run a second time, in a child process on
every CPU, for comparison: on a small shared machine, the engines' worker threads and the
scheduler add more noise to a 100-microsecond call than diffiface adds time.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import diffiface as di
from diffiface.test import Scenario
from diffiface.test._benchmark import CountingFunction, benchmark_differentiation, time_call, time_pair

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


def tiny_map(x):
    return ns(x).tanh(x) * x


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
        Scenario("tiny-10-jacobian", tiny_map, x10, "jacobian", reference=None, frameworks=fw),
        Scenario("tiny-10", tiny, x10, "hessian", reference=None, frameworks=fw),
        Scenario("tiny-10-map", tiny_map, x10, "jvp", tangent=t10, reference=None, frameworks=fw),
        Scenario("tiny-10-map", tiny_map, x10, "vjp", tangent=t10, reference=None, frameworks=fw),
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


def run_fd_vectorize(rounds, sizes=(10, 100, 1000)):
    """Central-difference gradient, point by point against one batched call of f."""

    def batched_tiny(x):
        return np.sum(np.tanh(x) * x, axis=-1)

    rows = []
    for n in sizes:
        x = np.random.default_rng(3).normal(size=n)
        loop = time_call(functools.partial(di.gradient, batched_tiny, di.AutoFiniteDifferences(), x), rounds)[0]
        vec = time_call(
            functools.partial(di.gradient, batched_tiny, di.AutoFiniteDifferences(vectorize=True), x), rounds
        )[0]
        rows.append({"n": n, "pointwise_s": loop, "vectorized_s": vec, "speedup": loop / vec})
    return rows


def run_numpy_io(names, rounds):
    """The extra cost of numpy in / numpy out (conversions both ways), prepared gradient."""
    rows = []
    for name in names:
        fw = FRAMEWORK[name]
        rng = np.random.default_rng(4)
        for label, f, size, ctx in (("tiny-10", tiny, 10, ()), (f"mlp-{MLP_SIZE}", mlp_loss, MLP_SIZE, True)):
            values = rng.normal(size=size) * 0.1
            data = rng.normal(size=(64, 48))
            native_x = array(fw, values)
            numpy_x = np.asarray(native_x) if fw != "torch" else native_x.numpy()
            contexts_native = (di.Constant(array(fw, data)),) if ctx else ()
            contexts_numpy = (
                (di.Constant(np.asarray(array(fw, data)) if fw != "torch" else array(fw, data).numpy()),) if ctx else ()
            )
            b = backend(name)
            prep_native = di.prepare_gradient(f, b, native_x, *contexts_native)
            prep_numpy = di.prepare_gradient(f, b, numpy_x, *contexts_numpy)
            native_s = time_call(
                functools.partial(di.gradient, f, b, native_x, *contexts_native, prep=prep_native), rounds
            )[0]
            numpy_s = time_call(
                functools.partial(di.gradient, f, b, numpy_x, *contexts_numpy, prep=prep_numpy), rounds
            )[0]
            rows.append(
                {
                    "backend": name,
                    "scenario": label,
                    "native_arrays_s": native_s,
                    "numpy_s": numpy_s,
                    "extra_s": numpy_s - native_s,
                }
            )
    return rows


def run_hessian_modes(names, rounds, n=50):
    """Hessian forward-over-reverse against reverse-over-reverse, per engine."""
    rows = []
    rng = np.random.default_rng(5)
    for name in names:
        fw = FRAMEWORK[name]
        x = array(fw, rng.normal(size=n))
        if fw == "jax":
            import jax

            g = jax.jit(jax.jacfwd(jax.grad(tiny))), jax.jit(jax.jacrev(jax.grad(tiny)))
            for mode, fn in zip(
                ("forward-over-reverse (jax.jacfwd)", "reverse-over-reverse (jax.jacrev)"), g, strict=True
            ):
                rows.append(
                    {
                        "engine": name,
                        "mode": mode,
                        "via": "native",
                        "seconds": time_call(functools.partial(fn, x), rounds)[0],
                    }
                )
            prep = di.prepare_hessian(tiny, di.AutoJAX(), x)
            rows.append(
                {
                    "engine": name,
                    "mode": "forward-over-reverse",
                    "via": "diffiface",
                    "seconds": time_call(functools.partial(di.hessian, tiny, di.AutoJAX(), x, prep=prep), rounds)[0],
                }
            )
        elif name == "torch":
            for mode, b in (
                ("reverse-over-reverse (autograd mode)", di.AutoTorch()),
                ("forward-over-reverse (func mode)", di.AutoTorch(mode="func")),
            ):
                prep = di.prepare_hessian(tiny, b, x)
                rows.append(
                    {
                        "engine": name,
                        "mode": mode,
                        "via": "diffiface",
                        "seconds": time_call(functools.partial(di.hessian, tiny, b, x, prep=prep), rounds)[0],
                    }
                )
        elif name == "autograd":
            prep = di.prepare_hessian(tiny, di.AutoAutograd(), x)
            rows.append(
                {
                    "engine": name,
                    "mode": "reverse-over-reverse",
                    "via": "diffiface",
                    "seconds": time_call(functools.partial(di.hessian, tiny, di.AutoAutograd(), x, prep=prep), rounds)[
                        0
                    ],
                }
            )
    return rows


def run_pymanopt(rounds, n=100):
    """The closest Python peer: pymanopt's autodiff backends, same gradient and hvp, numpy in/out."""
    try:
        import pymanopt
        from pymanopt.manifolds import Euclidean
    except ImportError:
        return [{"note": "pymanopt is not installed: pip install pymanopt (a benchmark-only dependency)"}]
    rows = []
    rng = np.random.default_rng(6)
    x, v = rng.normal(size=n), rng.normal(size=n)
    manifold = Euclidean(n)
    decorators = {
        "autograd": pymanopt.function.autograd,
        "torch": pymanopt.function.pytorch,
        "jax": pymanopt.function.jax,
    }
    for name, decorate in decorators.items():
        if not di.available(name):
            continue
        cost = decorate(manifold)(tiny)
        gradient, hvp = cost.get_gradient_operator(), cost.get_hessian_operator()
        b = backend(name)
        prep_g = di.prepare_gradient(tiny, b, x)
        prep_h = di.prepare_hvp(tiny, b, x, v)
        for op, theirs, ours in (
            ("gradient", functools.partial(gradient, x), functools.partial(di.gradient, tiny, b, x, prep=prep_g)),
            ("hvp", functools.partial(hvp, x, v), functools.partial(di.hvp, tiny, b, x, v, prep=prep_h)),
        ):
            assert np.allclose(np.asarray(theirs()), ours(), rtol=1e-5, atol=1e-8), (name, op)
            us, _, pm, ratio = time_pair(ours, theirs, rounds)  # interleaved rounds: load weighs on both alike
            rows.append(
                {"backend": name, "operator": op, "n": n, "pymanopt_s": pm, "diffiface_s": us, "speedup": 1 / ratio}
            )
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


def run_main_job(full=True, jobs=None):
    """Wall time of the main job, ``python -m diffiface.test`` (``--quick``, then the full job),
    each in a fresh process as a user runs it: imports, worker start-up and all."""
    rows = []
    for quick in (True, False) if full else (True,):
        command = [sys.executable, "-m", "diffiface.test", "--no-progress", "--format", "json"]
        command += (["--quick"] if quick else []) + (["-j", str(jobs)] if jobs else [])
        start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(command, capture_output=True, text=True)
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
        # CPU seconds of the job and its workers: on a shared machine, wall time depends on the
        # neighbours; CPU time much less
        report = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {"rows": []}
        statuses = [row["status"] for row in report["rows"]]
        rows.append(
            {
                "job": "python -m diffiface.test" + (" --quick" if quick else ""),
                "jobs": jobs or os.cpu_count(),
                "wall_s": round(wall, 1),
                "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
                "load_average": round(os.getloadavg()[0], 1),
                "checks": len(statuses),
                "passed": statuses.count("passed"),
                "failed": len(statuses) - statuses.count("passed") - statuses.count("skipped"),
                "exit_status": done.returncode,
            }
        )
    return rows


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
    ax.axhline(GOALS["tiny-10"], color="gray", ls="--", lw=0.8, label="goal, tiny function (prepared)")
    ax.axhline(GOALS[f"mlp-{MLP_SIZE}"], color="gray", ls=":", lw=0.8, label="goal, MLP (prepared)")
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


GOALS = {"tiny-10": 1.2, f"mlp-{MLP_SIZE}": 1.05}
"""Prepared diffiface / native, the most the overhead may be (the MLP's unprepared: 1.5)."""


def goal_rows(overhead):
    """The gradient rows of the overhead section against the goals."""
    rows = []
    for r in overhead:
        if r["operator"] != "gradient" or r["ratio"] is None:
            continue
        goal = 1.5 if not r["prepared"] else GOALS[r["scenario"]]
        if not r["prepared"] and not r["scenario"].startswith("mlp"):
            continue
        rows.append(
            {
                "backend": r["backend"],
                "scenario": r["scenario"],
                "prepared": r["prepared"],
                "ratio": f"{r['ratio']:.3f}",
                "goal": goal,
                "met": "yes" if r["ratio"] <= goal else f"no (+{r['ratio'] / goal - 1:.1%})",
            }
        )
    return rows


def overhead_everywhere(quick):
    """The overhead section run again in a child process on every CPU."""
    child = subprocess.run(
        [sys.executable, __file__, "--overhead-only"] + (["--quick"] if quick else []),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(child.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, no 1e6 size")
    parser.add_argument("--cpus", help="run on these CPUs only, as in --cpus 0 or --cpus 0,1")
    parser.add_argument("--overhead-only", action="store_true", help="print the overhead rows as JSON, and stop")
    parser.add_argument(
        "--main-job",
        choices=("quick", "full"),
        help="time python -m diffiface.test (--quick only, or --quick and the full job), write main_job.json/md, stop",
    )
    args = parser.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    names = [
        n
        for n in ("jax", "torch", "torch-func", "autograd")
        if di.available(FRAMEWORK[n] if n != "torch-func" else "torch")
    ]
    rounds = 3 if args.quick else 15
    if args.main_job:
        RESULTS.mkdir(parents=True, exist_ok=True)
        rows = run_main_job(full=args.main_job == "full")
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(), "machine": platform.platform()}
        (RESULTS / "main_job.json").write_text(json.dumps({"meta": meta, "main_job": rows}, indent=1))
        text = "\n".join(
            [
                "# The main job's wall time",
                "",
                f"Generated by `python benchmarks/run.py --main-job {args.main_job}` on {meta['date']} "
                f"({meta['cpu_count']} CPUs, {meta['machine']}); one run each, in a fresh process.",
                "",
                table(rows, list(rows[0])),
                "",
            ]
        )
        (RESULTS / "main_job.md").write_text(text)
        print(text)
        return
    if args.overhead_only:
        with contextlib.redirect_stdout(sys.stderr):
            rows = run_overhead(names, rounds)
        print(json.dumps(rows))
        return
    sizes = [10, 1_000, 100_000] + ([] if args.quick else [1_000_000])
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = {
        "meta": {
            "quick": args.quick,
            "python": platform.python_version(),
            "machine": platform.platform(),
            "rounds": rounds,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cpus": sorted(os.sched_getaffinity(0)),
            "cpu_count": os.cpu_count(),
        },
        "import": run_import_time(3 if args.quick else 7),
        "fd_counts": run_fd_counts(),
        "overhead": run_overhead(names, rounds),
        "scaling": run_scaling(names, sizes, rounds),
        "fd_vectorize": run_fd_vectorize(rounds),
        "numpy_io": run_numpy_io(names, rounds),
        "hessian_modes": run_hessian_modes(names, rounds),
        "pymanopt": run_pymanopt(rounds),
    }
    results["goals"] = goal_rows(results["overhead"])
    if args.cpus:
        results["overhead_all_cpus"] = overhead_everywhere(args.quick)
        results["goals_all_cpus"] = goal_rows(results["overhead_all_cpus"])
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
        f"Generated by `python benchmarks/run.py{' --quick' if args.quick else ''}"
        f"{' --cpus ' + args.cpus if args.cpus else ''}` on {results['meta']['date']} "
        f"(Python {results['meta']['python']}, {results['meta']['machine']}, CPU, running on CPUs "
        f"{results['meta']['cpus']} of {results['meta']['cpu_count']}). Times in seconds, median of {rounds} rounds.",
        "",
        "## Goals",
        "",
        "Gradient, diffiface time / native time (the median over interleaved rounds of the ratio within each "
        "round), against the goals: prepared, "
        "at most 1.2 on the tiny function and 1.05 on the MLP; unprepared, at most 1.5 on the MLP.",
        "",
        table(results["goals"], ["backend", "scenario", "prepared", "ratio", "goal", "met"]),
        "",
        *(
            [
                "The same, measured in a process on every CPU (no affinity), where the engines' worker threads and "
                "the scheduler weigh on a call as well:",
                "",
                table(results["goals_all_cpus"], ["backend", "scenario", "prepared", "ratio", "goal", "met"]),
                "",
            ]
            if args.cpus
            else []
        ),
        "## Overhead against the native call",
        "",
        "`ratio` = diffiface time / native time, the median over interleaved rounds of the ratio within each round "
        "(jax: `jax.jit(jax.grad(f))(x, *context_arrays)` etc.; torch: `torch.autograd.grad`; "
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
        *(
            [
                "The same section in a process on every CPU:",
                "",
                table(
                    results["overhead_all_cpus"],
                    ["backend", "scenario", "operator", "prepared", "median_s", "native_s", "ratio", "calls_of_f"],
                ),
                "",
            ]
            if args.cpus
            else []
        ),
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
        "## Finite differences: one batched call of f (`vectorize=True`) against point by point",
        "",
        "Central-difference gradient of `sum(tanh(x) * x, axis=-1)` (numpy).",
        "",
        table(results["fd_vectorize"], ["n", "pointwise_s", "vectorized_s", "speedup"]),
        "",
        "## The extra cost of numpy in / numpy out",
        "",
        "Prepared gradient with the engine's own arrays in, then with numpy arrays in (converted to the engine's "
        "arrays and back on every call).",
        "",
        table(results["numpy_io"], ["backend", "scenario", "native_arrays_s", "numpy_s", "extra_s"]),
        "",
        "## Hessian: forward-over-reverse against reverse-over-reverse (n = 50)",
        "",
        table(results["hessian_modes"], ["engine", "mode", "via", "seconds"]),
        "",
        "## The closest Python peer: pymanopt (numpy in and out, n = 100)",
        "",
        "`speedup` = pymanopt time / diffiface time, the median over interleaved rounds of the ratio within each "
        "round (above 1: diffiface is faster).",
        "",
        table(results["pymanopt"], ["backend", "operator", "n", "pymanopt_s", "diffiface_s", "speedup", "note"]),
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
