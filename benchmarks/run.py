"""Standard benchmarks of diffiface: overhead against each engine's native call, gradient cost
against f's cost as the input grows, finite-difference evaluation counts, import time and
first-call (preparation) time.

    python benchmarks/run.py [--quick] [--cpus 0]
    python benchmarks/run.py --shapes [--quick] [--cpus 0]   # every call shape only: shapes.json/md/png
    python benchmarks/run.py --sparse [--quick]              # sparse Jacobians: sparse.json/md/png
    python benchmarks/run.py --torch-users [--quick] [--cpus 0]  # what torch users pass: torch_users.json/md
    python benchmarks/run.py --engines [--quick] [--cpus 0]  # each engine against its own fastest call: engines.json/md

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


def _mlp_hidden(params, data):
    """The two tanh layers of the benchmark MLP on one flat parameter vector: their output,
    the array namespace, and the offset where the head's parameters start."""
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
    z = m.tanh(data @ w1 + b1)
    return m.tanh(z @ w2 + b2), m, i


def mlp_loss(params, data):
    z, m, i = _mlp_hidden(params, data)
    d = z.shape[-1]
    out = z @ params[i : i + d] + params[i + d]
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


def pair_cost(a, b):
    m = ns(a)
    return m.sum(m.tanh(a) * b) + m.sum(a * a)


def pair_loss(ab):
    return pair_cost(*ab)


def run_pymanopt(rounds, n=100):
    """The closest Python peer: pymanopt's autodiff backends, same gradient and hvp, numpy in/out,
    on a flat point and on a point of two arrays (pymanopt's product manifold, a tuple here)."""
    try:
        import pymanopt
        from pymanopt.manifolds import Euclidean, Product
    except ImportError:
        return [{"note": "pymanopt is not installed: pip install pymanopt (a benchmark-only dependency)"}]
    rows = []
    rng = np.random.default_rng(6)
    x, v = rng.normal(size=n), rng.normal(size=n)
    half = n // 2
    pair = (rng.normal(size=half), rng.normal(size=half))
    pair_v = (rng.normal(size=half), rng.normal(size=half))
    decorators = {
        "autograd": pymanopt.function.autograd,
        "torch": pymanopt.function.pytorch,
        "jax": pymanopt.function.jax,
    }
    for name, decorate in decorators.items():
        if not di.available(name):
            continue
        b = backend(name)
        for point, f_ours, f_theirs, manifold, at, along in (
            ("flat", tiny, tiny, Euclidean(n), x, v),
            ("tuple", pair_loss, pair_cost, Product([Euclidean(half), Euclidean(half)]), pair, pair_v),
        ):
            cost = decorate(manifold)(f_theirs)
            gradient, hvp = cost.get_gradient_operator(), cost.get_hessian_operator()
            prep_g = di.prepare_gradient(f_ours, b, at)
            prep_h = di.prepare_hvp(f_ours, b, at, along)
            args = (*at, *along) if point == "tuple" else (at, along)
            for op, theirs, ours in (
                (
                    "gradient",
                    functools.partial(gradient, *(at if point == "tuple" else (at,))),
                    functools.partial(di.gradient, f_ours, b, at, prep=prep_g),
                ),
                ("hvp", functools.partial(hvp, *args), functools.partial(di.hvp, f_ours, b, at, along, prep=prep_h)),
            ):
                assert same_values(ours(), tuple(theirs()) if point == "tuple" else theirs(), 1e-5, 1e-8), (name, op)
                us, _, pm, ratio = time_pair(ours, theirs, rounds)  # interleaved rounds: load weighs on both alike
                rows.append(
                    {
                        "backend": name,
                        "operator": op,
                        "point": point,
                        "n": n,
                        "pymanopt_s": pm,
                        "diffiface_s": us,
                        "speedup": 1 / ratio,
                    }
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


def _row_seconds_by_group(rows):
    """Row-seconds per scenario group, scipy's apart: ``core 12.3 (scipy 4.5)``..."""
    groups = {"core": "core", "layer": "layers", "torch_module": "torch", "sparse": "sparse"}
    total, scipy = {}, {}
    for row in rows:
        group = next((name for tag, name in groups.items() if tag in row["tags"]), "other")
        total[group] = total.get(group, 0.0) + row["seconds"]
        if "scipy" in row["backend"]:
            scipy[group] = scipy.get(group, 0.0) + row["seconds"]
    return ", ".join(f"{g} {total[g]:.0f} (scipy {scipy.get(g, 0.0):.0f})" for g in total)


def run_main_job(full=True, jobs=None):
    """Wall time of the main job, ``python -m diffiface.test`` (``--quick``, then the full job),
    each in a fresh process as a user runs it: imports, worker start-up and all."""
    rows = []
    for quick in (True, False) if full else (True,):
        command = [sys.executable, "-m", "diffiface.test", "--no-progress", "--format", "json"]
        command += (["--quick"] if quick else []) + (["-j", str(jobs)] if jobs else [])
        load_before = os.getloadavg()[0]
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
                "load_average": f"{load_before:.1f} to {os.getloadavg()[0]:.1f}",
                # the rows' own seconds (summed over the processes), and scipy's share of them
                "row_s": round(sum(row["seconds"] for row in report["rows"]), 1),
                "scipy_row_s": round(sum(row["seconds"] for row in report["rows"] if "scipy" in row["backend"]), 1),
                "row_s_by_group": _row_seconds_by_group(report["rows"]),
                "checks": len(statuses),
                "passed": statuses.count("passed"),
                "failed": len(statuses) - statuses.count("passed") - statuses.count("skipped"),
                "exit_status": done.returncode,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------
# Call shapes: every pytree layout users pass, for every operator, against the engine's own call
# ---------------------------------------------------------------------------------------------

SHAPE_GOALS = {("mlp", True): 1.05, ("mlp", False): 1.10, ("10-input", True): 1.25}
"""Gradient, diffiface / native, the most the overhead may be, by (size, prepared): 1.05 prepared
at MLP size, 1.10 unprepared at MLP size, 1.25 prepared on the 10-input function."""

SHAPE_BACKENDS = ("jax", "jax-x64", "torch", "torch-func", "autograd")
SHAPE_ORDER = ("flat", "tuple", "dict", "flax", "torch-module")
OPS_ALL = ("gradient", "jvp", "vjp", "hvp", "jacobian")


def shape_goal(size, operator, prepared):
    """The goal of a row of the shapes section (None: no goal for that row)."""
    if operator != "gradient":
        return None
    return SHAPE_GOALS.get((size, prepared))


def shape_table(rows, size="mlp"):
    """One line per shape, one column per backend: the gradient's ratio "prepared (unprepared)"
    at ``size``; "-" where the shape does not apply to the backend or the call failed."""
    cells = {}
    for r in rows:
        if r.get("size") != size or r.get("operator") != "gradient" or r.get("ratio") is None or r.get("variant"):
            continue
        cells.setdefault((r["shape"], r["backend"]), {})[r["prepared"]] = r["ratio"]
    backends = [b for b in SHAPE_BACKENDS if any(k[1] == b for k in cells)]
    shapes = [s for s in SHAPE_ORDER if any(k[0] == s for k in cells)]
    out = []
    for shape in shapes:
        line = {"shape": shape}
        for b in backends:
            got = cells.get((shape, b), {})
            prep, unprep = got.get(True), got.get(False)
            text = "-" if prep is None else f"{prep:.2f}"
            if unprep is not None:
                text += f" ({unprep:.2f})"
            line[b] = text
        out.append(line)
    return out, ["shape", *backends]


def _leaf_module(tree):
    import optree

    return ns(optree.tree_leaves(tree)[0])


def _head4(z):
    """A small output: the batch mean of the first 4 columns."""
    return _leaf_module(z).mean(z[:, :4], 0)


def _mlp_out(params, data):
    z, m, i = _mlp_hidden(params, data)
    d = z.shape[-1]
    return z @ m.reshape(params[i : i + d * 4], (d, 4))


def flat_head(params, data):
    return _head4(_mlp_out(params, data))


def tuple_loss(wb, xy):
    w, b = wb
    x, y = xy
    m = ns(w)
    r = m.tanh(x @ w + b) - y
    return m.mean(r * r)


def tuple_head(wb, xy):
    w, b = wb
    return _head4(ns(w).tanh(xy[0] @ w + b))


def _dict_out(params, batch):
    m = ns(params["layer1"]["w"])
    z = m.tanh(batch["x"] @ params["layer1"]["w"] + params["layer1"]["b"])
    return z @ params["layer2"]["w"] + params["layer2"]["b"]


def dict_head(params, batch):
    return _head4(_dict_out(params, batch))


def dict_loss(params, batch):
    r = _dict_out(params, batch) - batch["y"]
    return ns(r).mean(r * r)


def small_loss(x, c):
    m = ns(x)
    return m.sum(m.tanh(x * c) * x)


def small_map(x, c):
    return ns(x).tanh(x * c) * x


def small_tuple_loss(ab, cd):
    return small_loss(ab[0], cd[0]) + small_loss(ab[1], cd[1])


def small_tuple_map(ab, cd):
    m = ns(ab[0])
    return m.tanh(ab[0] * cd[0]) * ab[1] + cd[1]


def small_dict_map(params, batch):
    m = ns(params["layer1"]["w"])
    z = m.tanh(params["layer1"]["w"] * batch["x"] + m.sum(params["layer1"]["b"]))
    return m.sum(params["layer2"]["w"] * z) * params["layer2"]["b"]


def small_dict_loss(params, batch):
    r = small_dict_map(params, batch) - batch["y"]
    return ns(r).sum(r * r)


def shape_cases(name, rng):
    """The cases of the shapes section for one backend label: dicts of shape, size, the scalar
    loss and small-output head, x, the contexts (each passed as one ``di.Constant``), the
    operators, and a tangent for x and a cotangent for the head's output."""
    fw = FRAMEWORK[name.replace("-x64", "")]

    def arr(values):
        values = np.asarray(values)
        if fw == "jax":
            import jax.numpy as jnp

            return jnp.asarray(values, dtype=jnp.float64 if name == "jax-x64" else jnp.float32)
        return array(fw, values)

    def normal(*shape, scale=1.0):
        return arr(rng.normal(size=shape) * scale)

    def like(tree):
        import optree

        def leaf_like(leaf):
            values = rng.normal(size=leaf.shape)
            if fw == "jax":
                import jax.numpy as jnp

                return jnp.asarray(values, dtype=leaf.dtype)  # (flax params stay float32 under x64)
            return array(fw, values)

        return optree.tree_map(leaf_like, tree)

    cases = []
    data = normal(64, 48)
    n_flat = 48 * 96 + 96 + 96 * 48 + 48 + 48 * 4
    flat = normal(n_flat, scale=0.1)
    cases.append(
        {
            "shape": "flat",
            "size": "mlp",
            "loss": mlp_loss_shapes,
            "head": flat_head,
            "x": flat,
            "ctx": (data,),
            "ops": OPS_ALL,
        }
    )
    wb = (normal(48, 192, scale=0.1), normal(192, scale=0.1))
    xy = (data, normal(64, 192))
    cases.append(
        {"shape": "tuple", "size": "mlp", "loss": tuple_loss, "head": tuple_head, "x": wb, "ctx": (xy,), "ops": OPS_ALL}
    )
    params = {
        "layer1": {"w": normal(48, 96, scale=0.1), "b": normal(96, scale=0.1)},
        "layer2": {"w": normal(96, 48, scale=0.1), "b": normal(48, scale=0.1)},
    }
    batch = {"x": data, "y": normal(64, 48)}
    cases.append(
        {
            "shape": "dict",
            "size": "mlp",
            "loss": dict_loss,
            "head": dict_head,
            "x": params,
            "ctx": (batch,),
            "ops": OPS_ALL,
        }
    )
    if fw == "jax":
        try:
            import flax.linen as nn
            import jax
        except ImportError as error:
            cases.append({"shape": "flax", "size": "mlp", "skip": f"flax is not installed ({error})"})
        else:

            class Net(nn.Module):
                @nn.compact
                def __call__(self, z):
                    return nn.Dense(48)(jax.numpy.tanh(nn.Dense(96)(z)))

            net = Net()
            flax_params = net.init(jax.random.PRNGKey(0), batch["x"])["params"]

            def flax_loss(p, b):
                r = net.apply({"params": p}, b["x"]) - b["y"]
                return jax.numpy.mean(r * r)

            def flax_head(p, b):
                return _head4(net.apply({"params": p}, b["x"]))

            cases.append(
                {
                    "shape": "flax",
                    "size": "mlp",
                    "loss": flax_loss,
                    "head": flax_head,
                    "x": flax_params,
                    "ctx": (batch,),
                    "ops": OPS_ALL,
                }
            )
    if fw == "torch":
        import torch

        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Tanh(), torch.nn.Linear(96, 48))
        named = {k: v.detach() for k, v in module.named_parameters()}  # detached: see the notes

        def module_loss(p, b):
            r = torch.func.functional_call(module, p, (b["x"],)) - b["y"]
            return torch.mean(r * r)

        def module_head(p, b):
            return _head4(torch.func.functional_call(module, p, (b["x"],)))

        cases.append(
            {
                "shape": "torch-module",
                "size": "mlp",
                "loss": module_loss,
                "head": module_head,
                "x": named,
                "ctx": (batch,),
                "ops": OPS_ALL,
            }
        )
    c10 = normal(10)
    ops10 = (*OPS_ALL, "hessian")
    cases.append(
        {
            "shape": "flat",
            "size": "10-input",
            "loss": small_loss,
            "head": small_map,
            "x": normal(10),
            "ctx": (c10,),
            "ops": ops10,
        }
    )
    cases.append(
        {
            "shape": "tuple",
            "size": "10-input",
            "loss": small_tuple_loss,
            "head": small_tuple_map,
            "x": (normal(5), normal(5)),
            "ctx": ((normal(5), normal(5)),),
            "ops": ops10,
        }
    )
    small_params = {"layer1": {"w": normal(3), "b": normal(2)}, "layer2": {"w": normal(3), "b": normal(2)}}
    cases.append(
        {
            "shape": "dict",
            "size": "10-input",
            "loss": small_dict_loss,
            "head": small_dict_map,
            "x": small_params,
            "ctx": ({"x": normal(3), "y": normal(2)},),
            "ops": ops10,
        }
    )
    for case in cases:
        if "skip" in case:
            continue
        case["tx"] = like(case["x"])
        if case["head"] is not None:
            case["ty"] = like(case["head"](case["x"], *case["ctx"]))
    return cases


def mlp_loss_shapes(params, data):
    out = _mlp_out(params, data)
    return ns(out).mean(out * out)


def shape_native(name, op, f, x, ctx, t):
    """The engine's own call for ``op`` on pytree ``x`` with contexts ``ctx`` (closed over, but
    under jax.jit they are arguments, as in diffiface's program); None where there is none."""
    fw = FRAMEWORK[name.replace("-x64", "")]
    if fw == "jax":
        import jax

        def bound(c):
            return lambda z: f(z, *c)

        transforms = {
            "gradient": lambda z, *c: jax.grad(f)(z, *c),
            "jacobian": lambda z, *c: jax.jacrev(f)(z, *c),
            "hessian": lambda z, *c: jax.hessian(f)(z, *c),
            "jvp": lambda z, v, *c: jax.jvp(bound(c), (z,), (v,))[1],
            "vjp": lambda z, v, *c: jax.vjp(bound(c), z)[1](v)[0],
            "hvp": lambda z, v, *c: jax.jvp(lambda w: jax.grad(f)(w, *c), (z,), (v,))[1],
        }
        fn = jax.jit(transforms[op])
        args = (x, *ctx) if t is None else (x, t, *ctx)
        return functools.partial(fn, *args)
    if name == "torch-func":
        import torch.func as tf

        def g(z):
            return f(z, *ctx)

        if op == "gradient":
            fn = tf.grad(f)
            return lambda: fn(x, *ctx)
        if op == "jacobian":
            fn = tf.jacrev(f)
            return lambda: fn(x, *ctx)
        if op == "hessian":
            fn = tf.hessian(f)
            return lambda: fn(x, *ctx)
        if op == "jvp":
            return lambda: tf.jvp(g, (x,), (t,))[1]
        if op == "vjp":
            return lambda: tf.vjp(g, x)[1](t)[0]
        grad = tf.grad(f)
        return lambda: tf.jvp(lambda w: grad(w, *ctx), (x,), (t,))[1]
    if fw == "torch":
        import optree
        import torch

        leaves, spec = optree.tree_flatten(x)

        def on_leaves(*ls):
            return f(optree.tree_unflatten(spec, list(ls)), *ctx)

        if op == "gradient":

            def grad():
                zs = [leaf.detach().requires_grad_(True) for leaf in leaves]
                return optree.tree_unflatten(spec, list(torch.autograd.grad(on_leaves(*zs), zs)))

            return grad
        if op == "hvp":
            tl = optree.tree_leaves(t)

            def double_backward():
                zs = [leaf.detach().requires_grad_(True) for leaf in leaves]
                gs = torch.autograd.grad(on_leaves(*zs), zs, create_graph=True)
                return optree.tree_unflatten(spec, list(torch.autograd.grad(gs, zs, grad_outputs=tl)))

            return double_backward
        functional = torch.autograd.functional
        if op == "jvp":
            tl = tuple(optree.tree_leaves(t))
            return lambda: functional.jvp(on_leaves, tuple(leaves), tl)[1]
        if op == "vjp":
            return lambda: optree.tree_unflatten(spec, list(functional.vjp(on_leaves, tuple(leaves), t)[1]))
        if op == "jacobian":
            return lambda: optree.tree_unflatten(spec, list(functional.jacobian(on_leaves, tuple(leaves))))
        return lambda: functional.hessian(on_leaves, tuple(leaves))
    import autograd

    if op == "gradient":
        fn = autograd.grad(f)
        return lambda: fn(x, *ctx)
    if op == "jacobian":
        fn = autograd.jacobian(f)
        return lambda: fn(x, *ctx)
    if op == "hessian":
        fn = autograd.hessian(f)
        return lambda: fn(x, *ctx)
    if op == "hvp":
        fn = autograd.hessian_vector_product(f)
        return lambda: fn(x, *ctx, t)
    if op == "vjp":
        return lambda: autograd.make_vjp(lambda z: f(z, *ctx))(x)[0](t)
    fn = autograd.differential_operators.make_jvp_reversemode(lambda z: f(z, *ctx))
    return lambda: fn(x)(t)


def _as_numpy_leaves(tree):
    import optree

    out = []
    for leaf in optree.tree_leaves(tree):
        if hasattr(leaf, "detach"):
            leaf = leaf.detach().cpu().numpy()
        out.append(np.asarray(leaf, dtype=np.float64))
    return out


def same_values(ours, theirs, rtol=1e-4, atol=1e-5):
    """Whether two results hold the same values leaf by leaf (pytree containers may differ in kind)."""
    a, b = _as_numpy_leaves(ours), _as_numpy_leaves(theirs)
    return len(a) == len(b) and all(
        u.shape == v.shape and np.allclose(u, v, rtol=rtol, atol=atol) for u, v in zip(a, b, strict=True)
    )


def _shape_rows_for(name, rounds):
    rows = []
    b = backend(name.replace("-x64", ""))
    for case in shape_cases(name, np.random.default_rng(7)):
        base = {"backend": name, "shape": case["shape"], "size": case["size"]}
        if "skip" in case:
            rows.append({**base, "operator": "gradient", "note": case["skip"]})
            continue
        constants = tuple(di.Constant(c) for c in case["ctx"])
        calls = {}  # the prepared diffiface call of each operator, timed against its floors too
        for op in case["ops"]:
            scalar = op in ("gradient", "hvp", "hessian")
            f = case["loss"] if scalar else case["head"]
            t = {"jvp": case["tx"], "hvp": case["tx"], "vjp": case.get("ty")}.get(op)
            args = (case["x"],) if t is None else (case["x"], t)
            for prepared in (True, False) if op == "gradient" else (True,):
                row = {**base, "operator": op, "prepared": prepared}
                row["goal"] = shape_goal(case["size"], op, prepared)
                side = "diffiface"
                try:
                    kw = {"prep": getattr(di, "prepare_" + op)(f, b, *args, *constants)} if prepared else {}
                    ours = functools.partial(getattr(di, op), f, b, *args, *constants, **kw)
                    result = ours()
                    side = "native"
                    native = shape_native(name, op, f, case["x"], case["ctx"], t)
                    row["check"] = "same" if same_values(result, native()) else "DIFFERENT"
                    side = "timing"
                    us, _, them, ratio = time_pair(ours, native, rounds)
                    row.update(diffiface_s=us, native_s=them, ratio=ratio)
                    if prepared:
                        calls[op] = ours
                except Exception as error:  # recorded, so that one failure does not hide the rest
                    message = str(error).splitlines()[0][:100] if str(error) else ""
                    row["note"] = f"{side} call failed: {type(error).__name__}: {message}"
                rows.append(row)
            if op == "gradient":
                rows += _variant_rows(name, case, base, f, args, rounds, calls.get(op))
            elif name.startswith("torch") and op in FLOORED:  # (their bounds, as the gradient's)
                for contract in (False, True):
                    rows.append(_clone_once_row(name, case, base, f, args, rounds, op, contract, calls.get(op)))
    return rows


def _numpy_tree(tree):
    import optree

    return optree.tree_map(lambda leaf: np.asarray(leaf), tree)


def _variant_rows(name, case, base, f, args, rounds, ours=None):
    """The prepared gradient as users also call it: the backend by its string name (the
    README's style), and under jax the batch as numpy arrays, against jit given the same
    numpy arrays; the floors (``ours``: the prepared gradient, timed against the torch ones)."""
    variants = [("backend by name", name.replace("-x64", ""), case["ctx"])]
    if name.startswith("jax") and case["shape"] in ("flat", "tuple", "dict"):
        variants.append(("numpy contexts", backend(name.replace("-x64", "")), tuple(map(_numpy_tree, case["ctx"]))))
    rows = []
    if name.startswith("jax"):  # the least any Python function around jit's call costs
        rows.append(_one_frame_row(name, case, base, f, args, rounds))
    if name.startswith("torch"):  # the least a call that keeps the caller's x safe costs
        rows.append(_clone_once_row(name, case, base, f, args, rounds, ours=ours))
        # (and the least one that keeps the whole contract: contexts checked, Constants copied)
        rows.append(_clone_once_row(name, case, base, f, args, rounds, contract=True, ours=ours))
    for variant, b, ctx in variants:
        row = {**base, "operator": "gradient", "prepared": True, "variant": variant}
        row["goal"] = shape_goal(case["size"], "gradient", True)
        constants = tuple(di.Constant(c) for c in ctx)
        try:
            prep = di.prepare_gradient(f, b, *args, *constants)
            ours = functools.partial(di.gradient, f, b, *args, *constants, prep=prep)
            native = shape_native(name, "gradient", f, case["x"], ctx, None)
            row["check"] = "same" if same_values(ours(), native()) else "DIFFERENT"
            us, _, them, ratio = time_pair(ours, native, rounds)
            row.update(diffiface_s=us, native_s=them, ratio=ratio)
        except Exception as error:
            message = str(error).splitlines()[0][:100] if str(error) else ""
            row["note"] = f"call failed: {type(error).__name__}: {message}"
        rows.append(row)
    return rows


def _one_frame_row(name, case, base, f, args, rounds):
    """jax's own jitted gradient called through one Python function of diffiface's signature
    that reads the contexts' values and checks nothing: the floor of any API in Python, beside
    which the goals can be read (on the core the benchmark pins, a frame costs more than warm)."""
    import jax

    row = {**base, "operator": "gradient", "prepared": True, "variant": "floor: one Python frame around jit"}
    row["goal"] = shape_goal(case["size"], "gradient", True)
    jitted = jax.jit(lambda z, *c: jax.grad(f)(z, *c))

    def one_frame(f, backend, x, *contexts, prep=None):
        return jitted(x, *[c.value for c in contexts])

    constants = tuple(di.Constant(c) for c in case["ctx"])
    ours = functools.partial(one_frame, f, "jax", *args, *constants, prep=None)
    native = shape_native(name, "gradient", f, case["x"], case["ctx"], None)
    row["check"] = "same" if same_values(ours(), native()) else "DIFFERENT"
    us, _, them, ratio = time_pair(ours, native, rounds)
    row.update(diffiface_s=us, native_s=them, ratio=ratio)
    return row


def _clone_once_row(name, case, base, f, args, rounds, op="gradient", contract=False, ours=None):
    """torch's own ``op`` (gradient, jvp, vjp, hvp, jacobian or hessian) through one Python
    function of diffiface's signature that does the least a strict prepared call must: flatten x
    once (optree), compare its structure and each leaf's (type, shape, dtype, device) with the
    prepared ones, copy x once (what keeps the caller's tensors safe where f writes into its
    input), the engine's own operation on the copies (autograd's on the copies' leaves: one
    backward pass, or two for the hvp; forward mode's duals of the copies for the jvp;
    ``torch.autograd.functional``'s Jacobian and Hessian; or ``torch.func.grad``, ``jvp``,
    ``vjp``, ``jvp`` of ``grad``, ``jacrev``, ``hessian``), the result rebuilt. The torch goal
    is 1.05 times this wrapper's ratio.

    With ``contract``, the wrapper also does what diffiface's contract asks of the contexts (a
    strict prep compares their shapes and dtypes; a Constant is unchanged after any call, also
    where f writes into it): it flattens each context value and compares its structure and each
    leaf's (type, shape, dtype, device) with the prepared ones, gives f a copy of each Constant
    tensor, and reads the version counters of the copies of x and of the Constants after f, to
    see a write by. It compares the tangent or cotangent the same way (a strict prep's signature
    holds it), and works on copies of a jvp's or an hvp's tangent (a write by f into x reaches
    a jvp's tangent, and an hvp's result may be the tangent itself), their counters read too.

    ``ours``, diffiface's prepared call of the same operator, is also timed against the wrapper
    itself, in rounds of their own (``over_floor``: the median ratio of diffiface's time to the
    wrapper's within a round). Each row's native call is timed at another moment than the next
    row's, and on this shared machine the same native call's time moves by up to half from one
    row to the next, so that a quotient of two rows' ratios is far noisier than this."""
    variant = "floor: a wrapper that keeps the contract" if contract else "floor: a wrapper that copies x once"
    row = {**base, "operator": op, "prepared": True, "variant": variant}
    constants = tuple(di.Constant(c) for c in case["ctx"])
    tangent = args[1] if len(args) > 1 else None
    wrapper = clone_once_wrapper(name, case, f, op, contract, tangent)
    floor = functools.partial(wrapper, f, name, *args, *constants, prep=None)
    native = shape_native(name, op, f, case["x"], case["ctx"], tangent)
    row["check"] = "same" if same_values(floor(), native()) else "DIFFERENT"
    us, _, them, ratio = time_pair(floor, native, rounds)
    row.update(diffiface_s=us, native_s=them, ratio=ratio)
    if ours is not None:
        row["over_floor"] = time_pair(ours, floor, rounds)[3]
    return row


def clone_once_wrapper(name, case, f, op="gradient", contract=False, tangent=None):
    """The wrapper :func:`_clone_once_row` times (called as diffiface is, f first; ``tangent``:
    the prepared tangent or cotangent)."""
    import optree
    import torch

    def signature(tree):
        found, structure = optree.tree_flatten(tree)
        return structure, [(type(v), v.shape, v.dtype, v.device) for v in found]

    spec, sig = signature(case["x"])
    tangent_signature = signature(tangent) if tangent is not None else None
    context_signatures = [signature(c) for c in case["ctx"]]
    functional = name == "torch-func"
    grad = torch.func.grad(f) if functional else None
    # (the Jacobian and Hessian as the native calls make them: built once, or on x's leaves)
    transform = {"jacobian": torch.func.jacrev, "hessian": torch.func.hessian}.get(op) if functional else None
    whole = None if transform is None else transform(f)
    if (op == "jvp" and not functional) or op == "hessian":
        import warnings

        # (torch scripts its forward-mode decompositions on the process's first dual, which
        # torch.func's Hessian makes too, warning that torch.jit.script is deprecated: a
        # throwaway dual first, that warning silenced)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*")
            with torch.autograd.forward_ad.dual_level():
                torch.autograd.forward_ad.make_dual(torch.zeros(()), torch.zeros(()))

    def contract_values(contexts):
        values, copies = [], []
        for c, (c_spec, c_sig) in zip(contexts, context_signatures, strict=True):
            found, structure = optree.tree_flatten(c.value)
            if structure != c_spec or [(type(v), v.shape, v.dtype, v.device) for v in found] != c_sig:
                raise ValueError("not the prepared call")
            fresh = [v.clone() for v in found]
            copies += fresh
            values.append(optree.tree_unflatten(structure, fresh))
        return values, copies

    def unwritten(copies, versions):
        if [v._version for v in copies] != versions:
            raise ValueError("f wrote into its input or a Constant")

    def contract_tangent(tangent):
        found, structure = optree.tree_flatten(tangent)
        if (structure, [(type(v), v.shape, v.dtype, v.device) for v in found]) != tangent_signature:
            raise ValueError("not the prepared call")
        if op == "vjp":  # (the cotangent reaches neither f nor the result)
            return tangent, []
        fresh = [v.clone() for v in found]  # (f's write into x reaches a jvp's tangent; an hvp may return it)
        return optree.tree_unflatten(structure, fresh), fresh

    reverse = not functional and op in ("gradient", "vjp", "hvp")  # (autograd's backward passes)

    def clone_once(f, backend, x, *rest, prep=None):
        tangent, contexts = (None, rest) if op in ("gradient", "jacobian", "hessian") else (rest[0], rest[1:])
        found, structure = optree.tree_flatten(x)
        if structure != spec or [(type(v), v.shape, v.dtype, v.device) for v in found] != sig:
            raise ValueError("not the prepared call")
        if contract:
            values, copies = contract_values(contexts)
            if tangent is not None:
                tangent, tangent_copies = contract_tangent(tangent)
                copies += tangent_copies
        else:
            values, copies = [c.value for c in contexts], []
        # x copied once: leaves of a fresh graph for autograd's reverse mode, else plain copies
        fresh = [v.detach().clone().requires_grad_(True) if reverse else v.clone() for v in found]
        copies += fresh
        versions = [v._version for v in copies] if contract else None
        if functional:
            copied = optree.tree_unflatten(spec, fresh)
            if op == "gradient":
                out = grad(copied, *values)
            elif op == "vjp":
                out = torch.func.vjp(lambda z: f(z, *values), copied)[1](tangent)[0]
            elif op == "jvp":
                out = torch.func.jvp(lambda z: f(z, *values), (copied,), (tangent,))[1]
            elif whole is not None:
                out = whole(copied, *values)
            else:
                out = torch.func.jvp(lambda w: grad(w, *values), (copied,), (tangent,))[1]
            if contract:
                unwritten(copies, versions)
            return out
        if op == "jvp":  # the engine's forward mode: duals of the copies
            forward_ad = torch.autograd.forward_ad
            with forward_ad.dual_level():
                tangents = optree.tree_leaves(tangent)
                duals = [forward_ad.make_dual(v, t) for v, t in zip(fresh, tangents, strict=True)]
                out = f(optree.tree_unflatten(spec, duals), *values)
                if contract:
                    unwritten(copies, versions)
                return optree.tree_map(lambda y: forward_ad.unpack_dual(y).tangent, out)
        if op in ("jacobian", "hessian"):  # torch.autograd.functional's, on copies of x's leaves

            def on_leaves(*leaves):
                return f(optree.tree_unflatten(spec, list(leaves)), *values)

            out = getattr(torch.autograd.functional, op)(on_leaves, tuple(fresh))
            if contract:
                unwritten(copies, versions)
            return optree.tree_unflatten(spec, list(out)) if op == "jacobian" else out
        with torch.enable_grad():
            out = f(optree.tree_unflatten(spec, fresh), *values)
            if contract:
                unwritten(copies, versions)
            if op == "gradient":
                gs = torch.autograd.grad(out, fresh)
            elif op == "vjp":
                gs = torch.autograd.grad(optree.tree_leaves(out), fresh, grad_outputs=optree.tree_leaves(tangent))
            else:
                first = torch.autograd.grad(out, fresh, create_graph=True)
                gs = torch.autograd.grad(first, fresh, grad_outputs=optree.tree_leaves(tangent))
        return optree.tree_unflatten(spec, list(gs))

    return clone_once


def run_shapes(names, rounds):
    rows = []
    for name in names:
        print(f"shapes: {name}", flush=True)
        if name == "jax-x64":
            import jax

            with jax.enable_x64(True):  # the scope covers the arrays, diffiface's calls and the native ones
                rows += _shape_rows_for(name, rounds)
        else:
            rows += _shape_rows_for(name, rounds)
    return rows


def plot_shapes(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("MLP (~9.4k parameters), prepared", lambda r: r["size"] == "mlp" and r["prepared"], 1.05),
        ("MLP, unprepared gradient", lambda r: r["size"] == "mlp" and not r["prepared"], 1.10),
        ("10-input function, prepared", lambda r: r["size"] == "10-input" and r["prepared"], 1.25),
        ("10-input function, unprepared gradient", lambda r: r["size"] == "10-input" and not r["prepared"], None),
    ]
    timed = [r for r in rows if r.get("ratio") is not None]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 16))
    for ax, (title, keep, goal) in zip(axes, panels, strict=True):
        sel = [r for r in timed if keep(r)]
        labels = [f"{r['backend']} {r['shape']} {r['operator']}" for r in sel]
        ratios = [r["ratio"] for r in sel]
        colours = ["C0" if r["operator"] == "gradient" else "C1" for r in sel]
        ax.bar(np.arange(len(sel)), ratios, color=colours)
        ax.axhline(1.0, color="k", lw=0.8)
        if goal is not None:
            ax.axhline(goal, color="red", ls="--", lw=1, label=f"goal (gradient): {goal}")
            ax.legend(loc="upper left")
        ax.set_xticks(np.arange(len(sel)), labels, fontsize=6, rotation=90)
        ax.set_ylabel("diffiface / native")
        ax.set_title(title + " (blue: gradient, orange: other operators)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FLOORED = ("gradient", "jvp", "vjp", "hvp", "jacobian", "hessian")
"""The torch operators timed through the two wrappers too (the copy-once and the contract one)."""


def floor_table(rows):
    """For each prepared torch row of an operator in ``FLOORED``: diffiface's ratio, each
    wrapper's (the floors), and diffiface's time over each wrapper's: the measure of the torch
    goal (1.05 times the copy-once wrapper), and what is left over the whole contract's least
    cost. That quotient is the floor row's ``over_floor`` where diffiface was timed against the
    wrapper itself, else diffiface's ratio divided by the wrapper's."""
    out = []
    for r in rows:
        if not (r["backend"].startswith("torch") and r["operator"] in FLOORED and r.get("prepared")):
            continue
        if r.get("variant") or r.get("ratio") is None:
            continue

        def floor(variant, r=r):
            for other in rows:
                same = all(other.get(k) == r[k] for k in ("backend", "shape", "size", "operator"))
                if same and other.get("variant") == variant and other.get("ratio") is not None:
                    over = other.get("over_floor", r["ratio"] / other["ratio"])
                    return other["ratio"], round(over, 3)
            return None, None

        once, over_once = floor("floor: a wrapper that copies x once")
        whole, over_whole = floor("floor: a wrapper that keeps the contract")
        out.append(
            {
                "backend": r["backend"],
                "shape": r["shape"],
                "size": r["size"],
                "operator": r["operator"],
                "diffiface": r["ratio"],
                "copy-once wrapper": once,
                "diffiface / it (goal 1.05)": over_once,
                "contract wrapper": whole,
                "diffiface / it": over_whole,
            }
        )
    return out


def write_shapes(rows, meta):
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "shapes.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    mlp, mlp_keys = shape_table(rows, "mlp")
    small, small_keys = shape_table(rows, "10-input")
    skipped = [r for r in rows if r.get("ratio") is None]
    md = [
        "# diffiface on every call shape",
        "",
        f"Generated by `python benchmarks/run.py --shapes{' --quick' if meta['quick'] else ''}"
        f"{' --cpus ' + meta['cpus_option'] if meta['cpus_option'] else ''}` on {meta['date']} "
        f"({meta['machine']}, running on CPUs {meta['cpus']} of {meta['cpu_count']}, load average {meta['load_average_before']} before and "
        f"{meta['load_average_after']} after: other jobs were running on the machine). `ratio` = diffiface time / "
        f"native time, the median over {meta['rounds']} interleaved rounds of the ratio within a round.",
        "",
        "Natives: jax `jax.jit(jax.grad(f))(params, *contexts)` (and `jax.jvp`, `jax.vjp`, forward-over-reverse "
        "hvp, `jax.jacrev`, `jax.hessian`, jitted, contexts as arguments), jax-x64 the same under "
        "`jax.enable_x64(True)` with float64 arrays; torch `torch.autograd.grad` on the leaves (and "
        "`torch.autograd.functional` for jvp, vjp, jacobian, hessian, double backward for hvp); torch-func "
        "`torch.func.grad` / `jvp` / `vjp` / `jacrev` / `hessian` on the pytree; autograd `autograd.grad` etc. "
        "Shapes: `flat` one vector and one array context; `tuple` `(W, b)` with an `(X, Y)` context; `dict` "
        "`{'layer1': {'w', 'b'}, 'layer2': {...}}` with a `{'x', 'y'}` batch; `flax` a linen Dense stack's "
        "`params`; `torch-module` `torch.func.functional_call` on a `named_parameters()` dict. The torch "
        "parameters are passed detached: a tensor that requires grad gets results that keep their graph, by "
        "design, and that is not the case timed. `check`: diffiface's result and the native one hold the same "
        "values.",
        "",
        "## Gradient by shape, MLP size: prepared (unprepared)",
        "",
        "Goals: 1.05 prepared, 1.10 unprepared.",
        "",
        table(mlp, mlp_keys),
        "",
        "## Gradient by shape, 10-input function: prepared (unprepared)",
        "",
        "Goal: 1.25 prepared.",
        "",
        table(small, small_keys),
        "",
        "## The prepared gradient as users also call it",
        "",
        '`backend by name`: `di.gradient(f, "jax", x, di.Constant(batch), prep=prep)`, the README\'s style; '
        "`numpy contexts`: the batch as numpy arrays under jax, against `jax.jit` given the same numpy arrays. "
        "Goal: no slower than the object form and jit. "
        "`floor: one Python frame around jit`: jax's own jitted gradient called through one Python function "
        "of diffiface's signature that reads the contexts' values and checks nothing, the least any API in "
        "Python costs on this core. `floor: a wrapper that copies x once`: torch's own gradient through one "
        "Python function that flattens x, compares its structure and each leaf's type, shape, dtype and device "
        "with the prepared ones, copies x once and rebuilds the result, the least a strict prepared torch call "
        "does for x; the torch and torch-func goal is 1.05 times its ratio. Both wrappers are timed for the "
        "jvp, the vjp, the hvp, the Jacobian and the Hessian too (the engine's own operation on the copy: "
        "forward mode's duals, one backward pass with the cotangent, or two; the native Jacobian and Hessian "
        "call on the copy). `floor: a wrapper that keeps the contract`: the same wrapper doing also what diffiface's "
        "contract asks of the contexts: each context flattened and each leaf's type, shape, dtype and device "
        "compared with the prepared ones (a strict prep), a copy of each Constant tensor given to f, and the "
        "version counters of the copies of x and of the Constants read after f (a write refused, the caller's "
        "tensors unchanged); the tangent or cotangent compared the same way, and a jvp's or an hvp's tangent "
        "copied (a write by f into x reaches a jvp's tangent; an hvp may return the tangent itself), its "
        "copies' counters read too.",
        "",
        table(
            [r for r in rows if r.get("variant") and r.get("ratio") is not None],
            ["backend", "shape", "size", "operator", "variant", "diffiface_s", "native_s", "ratio", "check"],
        ),
        "",
        "## torch against its floors",
        "",
        "Each prepared operator's ratio, each wrapper's (same run), and diffiface's time over each wrapper's: "
        "diffiface's prepared call timed against the wrapper itself, in interleaved rounds of their own (the "
        "median ratio within a round). A quotient of two rows' ratios would be far noisier: each row's native "
        "call is timed at another moment, and on a shared machine the same native call's time moves by up to "
        "half from one row to the next.",
        "",
        table(
            floor_table(rows),
            [
                "backend",
                "shape",
                "size",
                "operator",
                "diffiface",
                "copy-once wrapper",
                "diffiface / it (goal 1.05)",
                "contract wrapper",
                "diffiface / it",
            ],
        ),
        "",
        "## Every row",
        "",
        table(
            [r for r in rows if r.get("ratio") is not None and not r.get("variant")],
            ["backend", "shape", "size", "operator", "prepared", "diffiface_s", "native_s", "ratio", "goal", "check"],
        ),
        "",
        *(
            ["## Not timed", "", table(skipped, ["backend", "shape", "size", "operator", "prepared", "note"]), ""]
            if skipped
            else []
        ),
        "![shapes](shapes.png)",
        "",
    ]
    (RESULTS / "shapes.md").write_text("\n".join(md))
    plot_shapes(rows, RESULTS / "shapes.png")
    return "\n".join(md)


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
    """overhead.png (the README's headline: one panel per backend, a bar per case, unprepared and
    prepared, the goals drawn with their values) and scaling.png, from ``results``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    rows = [r for r in results["overhead"] if r["ratio"] is not None]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    ratios = [r["ratio"] for r in rows]
    low, high = min([*ratios, 0.9]) / 1.1, max([*ratios, 1.5]) * 1.25
    ticks = [t for t in (0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.2, 1.5, 2, 3, 4, 5, 7, 10, 15, 20) if low <= t <= high]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5), sharex=True)
    colours = {False: "#4c72b0", True: "#dd8452"}
    goals = [
        (GOALS["tiny-10"], "--", f"goal {GOALS['tiny-10']:g}: tiny function, prepared"),
        (GOALS[f"mlp-{MLP_SIZE}"], ":", f"goal {GOALS[f'mlp-{MLP_SIZE}']:g}: MLP, prepared"),
    ]
    for ax, backend in zip(axes.flat, backends, strict=False):
        cases = list(dict.fromkeys((r["scenario"], r["operator"]) for r in rows if r["backend"] == backend))
        by = {(r["scenario"], r["operator"], r["prepared"]): r["ratio"] for r in rows if r["backend"] == backend}
        pos = np.arange(len(cases))
        for shift, prepared in ((-0.2, False), (0.2, True)):
            values = [by.get((*case, prepared)) for case in cases]
            placed = [(p + shift, v) for p, v in zip(pos, values, strict=True) if v is not None]
            ax.barh([p for p, _ in placed], [v for _, v in placed], 0.4, color=colours[prepared], left=0)
            for p, v in placed:
                ax.text(v * 1.02, p, f"{v:.2f}", va="center", fontsize=8)
        ax.axvline(1.0, color="k", lw=0.8)
        for value, style, _ in goals:
            ax.axvline(value, color="#555555", ls=style, lw=1.0)
        ax.set_yticks(pos, [f"{scenario} {operator}" for scenario, operator in cases], fontsize=9)
        ax.invert_yaxis()
        ax.set_title(backend, fontsize=11)
        ax.set_xscale("log")
        ax.set_xlim(low, high)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelsize=9, labelbottom=True)
        ax.grid(axis="x", color="#dddddd", lw=0.5)
        ax.set_axisbelow(True)
    for ax in axes.flat[len(backends) :]:
        ax.set_visible(False)
    fig.supxlabel("diffiface time / native time (log scale; 1: no overhead)", fontsize=10, y=0.06)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[p]) for p in (False, True)]
    handles += [plt.Line2D([0], [0], color="#555555", ls=style) for _, style, _ in goals]
    labels = ["unprepared", "prepared", *(label for _, _, label in goals)]
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.suptitle(
        f"Overhead of one call over the engine's own (median of {results['meta']['rounds']} rounds)", fontsize=12
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(RESULTS / "overhead.png", dpi=100)
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
    parser.add_argument(
        "--shapes",
        action="store_true",
        help="time every call shape (flat, tuple, dict, flax, torch module) for every operator, "
        "write shapes.json/md/png, stop",
    )
    parser.add_argument("--overhead-only", action="store_true", help="print the overhead rows as JSON, and stop")
    parser.add_argument("--pymanopt-only", action="store_true", help="print the rows against pymanopt, and stop")
    parser.add_argument("--sparse", action="store_true", help="run benchmarks/sparse.py (sparse.json/md/png), stop")
    parser.add_argument(
        "--torch-users",
        action="store_true",
        help="run benchmarks/torch_users.py (what torch users pass, against their own call: torch_users.json/md), stop",
    )
    parser.add_argument(
        "--engines",
        action="store_true",
        help="run benchmarks/engines.py (each engine against its own fastest call: engines.json/md), stop",
    )
    parser.add_argument(
        "--plots-only", action="store_true", help="redraw overhead.png and scaling.png from results.json, and stop"
    )
    parser.add_argument(
        "--main-job",
        choices=("quick", "full"),
        help="time python -m diffiface.test (--quick only, or --quick and the full job), write main_job.json/md, stop",
    )
    args = parser.parse_args()
    if args.plots_only:
        plots(json.loads((RESULTS / "results.json").read_text()))
        return
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.sparse:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import sparse  # benchmarks/sparse.py

        sparse.main(["--quick"] if args.quick else [])
        return
    if args.torch_users:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import torch_users  # benchmarks/torch_users.py

        torch_users.main((["--quick"] if args.quick else []) + (["--cpus", args.cpus] if args.cpus else []))
        return
    if args.engines:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import engines  # benchmarks/engines.py

        engines.main((["--quick"] if args.quick else []) + (["--cpus", args.cpus] if args.cpus else []))
        return
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
    if args.shapes:
        shape_names = [n for n in SHAPE_BACKENDS if n.replace("-x64", "") in names]
        meta = {
            "quick": args.quick,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "rounds": rounds,
            "cpus_option": args.cpus,
            "load_average_before": [round(v, 2) for v in os.getloadavg()],
        }
        start = time.perf_counter()
        meta["rounds"] = rounds = 5 if args.quick else 15
        rows = run_shapes(shape_names, rounds)
        meta["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
        meta["wall_s"] = round(time.perf_counter() - start, 1)
        print(write_shapes(rows, meta))
        return
    if args.pymanopt_only:
        rows = run_pymanopt(rounds)
        print(table(rows, list(rows[0])))
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
