"""Write the numbers of the docs from the files they come from.

A page holds generated text between two markers; the first names the file (or the registry)
the text is read from and the generator that renders it::

    <!-- generated from benchmarks/results/shapes.json by scripts/benchmark_docs.py: readme-performance -->
    ...
    <!-- end generated -->

Nobody types these numbers: ``python scripts/benchmark_docs.py`` rewrites every marked region
of README.md and docs/**/*.md from the files under ``benchmarks/results/``;
``python scripts/benchmark_docs.py --check`` says which regions are out of date (tests/test_docs.py
runs the same check). After a new benchmark run, run the script and commit the pages with the
results.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"
REGISTRY = "the backend registry"

REGION = re.compile(
    r"<!-- generated from (?P<source>[^ ]+(?: [^ ]+)*?) by scripts/benchmark_docs\.py: (?P<name>[\w-]+) -->\n"
    r"(?P<body>.*?)"
    r"<!-- end generated -->",
    re.S,
)


def _load(name: str) -> dict[str, Any]:
    return json.loads((ROOT / RESULTS / name).read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _span(values: list[float]) -> str:
    if not values:
        return "—"
    low, high = min(values), max(values)
    return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}\u2013{high:.2f}"


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} µs"


def _machine(meta: dict[str, Any]) -> str:
    cpus = meta.get("cpus")
    pinned = f", the process pinned to CPU {', '.join(map(str, cpus))}" if cpus else ""
    return f"Linux x86_64, {meta['cpu_count']} CPUs, no GPU{pinned}, Python {meta['python']}"


def _load_average(meta: dict[str, Any]) -> str:
    before = meta.get("load_average_before")
    return f"; load average {before[0]:.2f} in the minute before" if before else ""


# --- the shapes run: every operator on every call layout ----------------------------------------

ENGINES = (  # (backend in the results, how a reader names it, the native call it is compared with)
    ("jax", "jax", "`jax.jit(jax.grad(f))`"),
    ("torch", "torch", "`torch.autograd.grad`"),
    ("torch-func", 'torch, `mode="func"`', "`torch.func.grad`"),
    ("autograd", "autograd", "`autograd.grad`"),
)
SHAPES = ("flat", "tuple", "dict", "flax", "torch-module")
BACKENDS = ("jax", "jax-x64", "torch", "torch-func", "autograd")
BACKEND_WORDS = {
    "jax": "jax",
    "jax-x64": "jax, float64",
    "torch": "torch",
    "torch-func": 'torch, `mode="func"`',
    "autograd": "autograd",
}
SHAPE_WORDS = {
    "flat": "one vector",
    "tuple": "a `(W, b)` tuple",
    "dict": "a nested dict",
    "flax": "flax linen params",
    "torch-module": "a torch module's parameters",
}


def _shape_rows(**match: Any) -> list[dict[str, Any]]:
    rows = _load("shapes.json")["rows"]
    return [r for r in rows if "ratio" in r and all(r.get(k) == v for k, v in match.items())]


def _one(rows: list[dict[str, Any]], **match: Any) -> float | None:
    found = [r["ratio"] for r in rows if all(r.get(k) == v for k, v in match.items())]
    return found[0] if found else None


def shapes_conditions() -> str:
    meta = _load("shapes.json")["meta"]
    return (
        f"Measured on {meta['date'][:10]} with `python benchmarks/run.py --shapes --cpus 0` "
        f"({_machine(meta)}{_load_average(meta)}); each number is the median, over "
        f"{meta['rounds']} interleaved rounds, of diffiface's time divided by the native call's "
        "time in the same round.\n"
    )


def readme_performance() -> str:
    """The README's one table: the prepared gradient against the engine's own call."""
    meta = _load("shapes.json")["meta"]
    rows = _shape_rows(operator="gradient", prepared=True, variant=None)
    body = []
    for backend, engine, native in ENGINES:
        model = {"jax": "flax", "torch": "torch-module", "torch-func": "torch-module"}.get(backend)
        body.append(
            [
                engine,
                native,
                _ratio(_one(rows, backend=backend, size="10-input", shape="flat")),
                _ratio(_one(rows, backend=backend, size="mlp", shape="flat")),
                _ratio(_one(rows, backend=backend, size="mlp", shape="dict")),
                _ratio(_one(rows, backend=backend, size="mlp", shape=model) if model else None),
            ]
        )
    table = _table(
        ["engine", "compared with", "10 inputs", "MLP, one vector", "MLP, nested dict", "MLP, framework model"],
        body,
    )
    return (
        table + f"\nPrepared gradient, diffiface's time / the native call's time (1.00 = no overhead); MLP: two "
        f"tanh layers, about 9.4k parameters, batch of 64, float32; framework model: flax linen params "
        f"(jax) or a `torch.nn` module's parameters. Measured {meta['date'][:10]} on a "
        f"{meta['cpu_count']}-CPU Linux machine without a GPU, one CPU pinned, median of "
        f"{meta['rounds']} interleaved rounds.\n"
    )


def gradient_by_shape(size: str) -> str:
    rows = _shape_rows(operator="gradient", variant=None, size=size)
    body = []
    for shape in SHAPES:
        cells = []
        for backend in BACKENDS:
            prepared = _one(rows, backend=backend, shape=shape, prepared=True)
            unprepared = _one(rows, backend=backend, shape=shape, prepared=False)
            if prepared is None:
                cells.append("—")
            elif unprepared is None:
                cells.append(_ratio(prepared))
            else:
                cells.append(f"{_ratio(prepared)} ({_ratio(unprepared)})")
        if any(c != "—" for c in cells):
            body.append([SHAPE_WORDS[shape], *cells])
    return _table(["x", *(BACKEND_WORDS[b] for b in BACKENDS)], body)


def operators_by_backend(size: str) -> str:
    rows = _shape_rows(prepared=True, variant=None, size=size)
    operators = [op for op in ("gradient", "jvp", "vjp", "hvp", "jacobian", "hessian") if _one(rows, operator=op)]
    body = []
    for backend in BACKENDS:
        cells = [
            _span([r["ratio"] for r in rows if r["backend"] == backend and r["operator"] == op]) for op in operators
        ]
        body.append([BACKEND_WORDS[backend], *cells])
    return _table(["backend", *operators], body)


def floors() -> str:
    rows = [r for r in _load("shapes.json")["rows"] if "over_floor" in r]
    body = []
    for backend, words in (("torch", "torch"), ("torch-func", BACKEND_WORDS["torch-func"])):
        for size in ("mlp", "10-input"):
            for variant, floor in (
                ("floor: a wrapper that copies x once", "copies x, nothing else"),
                ("floor: a wrapper that keeps the contract", "copies x and checks the contexts"),
            ):
                picked = [r for r in rows if r["backend"] == backend and r["size"] == size and r["variant"] == variant]
                if picked:
                    body.append(
                        [
                            words,
                            "MLP" if size == "mlp" else "10 inputs",
                            floor,
                            _span([r["over_floor"] for r in picked]),
                            str(len(picked)),
                        ]
                    )
    return _table(["engine", "size", "the least a wrapper does", "diffiface / wrapper", "cases"], body)


def jax_floor() -> str:
    rows = _shape_rows(backend="jax", operator="gradient", prepared=True)
    body = []
    for size in ("mlp", "10-input"):
        floor = [r for r in rows if r["size"] == size and r.get("variant") == "floor: one Python frame around jit"]
        shapes = {r["shape"] for r in floor}
        ours = [r["ratio"] for r in rows if r["size"] == size and r.get("variant") is None and r["shape"] in shapes]
        if floor:
            body.append(
                [
                    "MLP" if size == "mlp" else "10 inputs",
                    _span([r["ratio"] for r in floor]),
                    _span(ours),
                    str(len(floor)),
                ]
            )
    return _table(["size", "one Python call around the jitted gradient / native", "diffiface / native", "cases"], body)


def user_forms() -> str:
    rows = _shape_rows(prepared=True)
    body = []
    for variant, words in (
        ("backend by name", "the backend by its string name"),
        ("numpy contexts", "numpy batches, against `jax.jit` given numpy"),
    ):
        for backend in BACKENDS:
            picked = [r["ratio"] for r in rows if r.get("variant") == variant and r["backend"] == backend]
            if picked:
                body.append([words, BACKEND_WORDS[backend], _span(picked), str(len(picked))])
    return _table(["call", "backend", "diffiface / native", "cases"], body)


# --- the older, broader run: import, finite differences, Hessians, pymanopt ----------------------


def torch_users(name: str = "torch_users.json") -> str:
    """torch users' own objects (Parameters, big batches, frozen backbones) against their own call."""
    data = _load(name)
    meta, rows = data["meta"], data["rows"]
    body = [
        [
            row["what"],
            f"`{row['backend']}`",
            _ratio(row["ratio"]),
            _ratio(row["floor"]) if row.get("floor") else "—",
            _ratio(row["goal"]) if row["goal"] else "—",
        ]
        for row in rows
    ]
    table = _table(["what the user passes", "backend", "diffiface / native", "floor / native", "goal"], body)
    return (
        table + "\nPrepared gradient by string name, diffiface's time / the user's own call's time: "
        '`torch.autograd.grad(loss, parameters)` for `"torch"`, `torch.func.grad(loss)` for `"torch-func"`. '
        "Floor: the same native call on `detach().requires_grad_()` aliases of the parameters, which f gets "
        "since x is independent of what f closes over; "
        f"torch {meta['torch']}, one torch thread, measured {meta['date'][:10]} on a {meta['cpu_count']}-CPU "
        f"Linux machine without a GPU, one CPU pinned, median of {meta['rounds']} interleaved rounds.\n"
    )


def engines() -> str:
    """Each engine's prepared gradient against its own fastest call (benchmarks/engines.py)."""
    data = _load("engines.json")
    meta, rows = data["meta"], data["rows"]
    body = [
        [
            f"`{row['engine']}`",
            row["label"],
            _ratio(row["ratio"]),
            _ratio(row["goal"]) if row["goal"] else "—",
            row["check"],
            f"{row['setup_s']:.1f}",
        ]
        for row in rows
    ]
    body += [[f"`{row['module']}`", "skipped", "—", "—", row["reason"], "—"] for row in data["skipped"]]
    table = _table(["engine", "size", "diffiface / native", "goal", "check", "setup (s)"], body)
    return (
        table + f"\nPrepared gradient by string name; {meta['versions']}; measured {meta['when'][:10]} by "
        f"`{meta['command']}`, on CPUs {meta['cpus']}, interleaved rounds. `setup`: the seconds from loading the "
        "engine's rows to the end of this row's timing, preparations, traces and compiles included (cumulative per engine).\n"
    )


def readme_torch_users() -> str:
    """The README's short form of torch-users: the `"torch"` rows that have a goal."""
    data = _load("torch_users.json")
    meta = data["meta"]
    body = [
        [row["what"].split(", 64-128-16")[0], _ratio(row["ratio"]), _ratio(row["goal"])]
        for row in data["rows"]
        if row["backend"] == "torch" and row["goal"] and row["row"] != "e-recipe"
    ]
    table = _table(['what the user passes (`"torch"`)', "diffiface / `torch.autograd.grad`", "goal"], body)
    return (
        table + f"\nPrepared gradient; MLP 64-128-16, batch 64 unless said; torch {meta['torch']}, one thread, "
        f"{meta['date'][:10]}, one pinned CPU, median of {meta['rounds']} interleaved rounds.\n"
    )


def results_conditions() -> str:
    meta = _load("results.json")["meta"]
    return (
        f"Measured on {meta['date'][:10]} with `python benchmarks/run.py --cpus 0` ({_machine(meta)}); "
        f"medians of {meta['rounds']} rounds.\n"
    )


def import_cost() -> str:
    found = _load("results.json")["import"]
    frameworks = ", ".join(found["frameworks_imported"]) or "none"
    return _table(
        [
            "`python -c 'import diffiface'`",
            "`python -c 'import numpy, optree'`",
            "diffiface's own share",
            "frameworks imported",
        ],
        [
            [
                _seconds(found["python_import_diffiface_s"]),
                _seconds(found["python_import_numpy_optree_s"]),
                _seconds(found["diffiface_own_s"]),
                frameworks,
            ]
        ],
    )


def pymanopt() -> str:
    rows = _load("results.json")["pymanopt"]
    body = [
        [
            r["backend"],
            r["operator"],
            str(r["n"]),
            _seconds(r["pymanopt_s"]),
            _seconds(r["diffiface_s"]),
            _ratio(r["speedup"]),
        ]
        for r in rows
    ]
    return _table(["backend", "operator", "n", "pymanopt", "diffiface", "pymanopt / diffiface"], body)


def hessian_modes() -> str:
    rows = _load("results.json")["hessian_modes"]
    body = [[r["engine"], r["mode"], r["via"], _seconds(r["seconds"])] for r in rows]
    return _table(["engine", "mode", "through", "time"], body)


def cheap_gradient() -> str:
    rows = _load("results.json")["scaling"]
    sizes = sorted({r["n"] for r in rows})
    body = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        cells = [
            _ratio(next((r["cost_ratio"] for r in rows if r["backend"] == backend and r["n"] == n), None))
            for n in sizes
        ]
        body.append([backend, *cells])
    return _table(["backend", *[f"n = {n:,}" for n in sizes]], body)


def finite_differences_vectorised() -> str:
    rows = _load("results.json")["fd_vectorize"]
    body = [
        [f"{r['n']:,}", _seconds(r["pointwise_s"]), _seconds(r["vectorized_s"]), _ratio(r["speedup"])] for r in rows
    ]
    return _table(["n", "one call of f per point", "one vectorised call", "speed-up"], body)


# --- sparse, sharded, one engine inside another, the main job -----------------------------------


def sparse() -> str:
    found = _load("sparse.json")
    meta = found["meta"]
    body = []
    for key, words in (("jax", "jax"), ("torch-autograd", "torch"), ("torch-func", 'torch, `mode="func"`')):
        row = found[key]
        dense = row.get("dense_seconds", row["seconds"].get("dense"))
        body.append(
            [
                words,
                str(row["colors"]),
                _seconds(row["seconds"]["diffiface"]),
                _seconds(dense),
                f"{row['speedup_vs_dense']:,.0f}",
            ]
        )
    table = _table(["backend", "colours", "sparse Jacobian", "dense Jacobian", "dense / sparse"], body)
    return table + (
        f"\nA tridiagonal map of n = {meta['n']:,} inputs, prepared. Measured on {meta['date'][:10]} with "
        f"`python benchmarks/sparse.py` ({meta['cpu_count']} CPUs, torch on {meta['torch_threads']} thread"
        f"{_load_average(meta)}: a busy machine, so read the ratios, not the times); median of "
        f"{meta['rounds']} rounds.\n"
    )


def sharded() -> str:
    found = _load("sharded.json")
    setup = found["setup"]
    body = [
        [
            r["operator"],
            _seconds(r["first_call_s"]),
            _seconds(r["seconds"]),
            f"{r['peak_in_shards']:.2f}",
        ]
        for r in found["rows"]
    ]
    table = _table(["operator", "first call", "later calls", "peak memory per device, in parameter shards"], body)
    return table + (
        f"\n{setup['parameters']:,} {setup['dtype']} parameters on {setup['devices']} simulated CPU devices "
        f"(jax {setup['jax']}, mesh {setup['mesh']}; {setup['machine']}); memory: {setup['memory']}. "
        "Run with `python benchmarks/sharded.py`.\n"
    )


def sharded_memory() -> str:
    """The memory table of docs/large-models.md: what each operator adds per device."""
    found = _load("sharded.json")
    setup = found["setup"]
    body = [
        [
            f"`{r['operator']}`"
            if " " not in r["operator"]
            else f"`{r['operator'].split()[0]}` {' '.join(r['operator'].split()[1:])}",
            f"{r['extra_in_shards']:.1f}",
            f"{r['peak_in_shards']:.2f}",
            _seconds(r["seconds"]),
            _seconds(r["first_call_s"]),
        ]
        for r in found["rows"]
    ]
    table = _table(["operator", "extra per device", "peak per device", "a later call", "the first call"], body)
    return table + (
        f"\nIn shards of {setup['shard_bytes_per_device'] / 2**20:.2f} MiB (the model's part on one device) of "
        f"{setup['parameters']:,} {setup['dtype']} parameters on {setup['devices']} simulated CPU devices, a mesh of "
        f"{setup['mesh']}; {setup['machine']}, jax {setup['jax']} (`python benchmarks/sharded.py`).\n"
    )


def closure_test() -> str:
    """The staleness test of an unprepared call: the settled test against the general one."""
    found = _load("closure_test.json")
    meta = found["meta"]
    body = [[r["case"], _seconds(r["settled_s"]), _seconds(r["general_s"]), _ratio(r["ratio"])] for r in found["rows"]]
    table = _table(["f reads", "settled test", "general test", "ratio"], body)
    return table + (
        f"\nMeasured {meta['date'][:10]} with `{meta['command']}` (Python {meta['python']}); ratio: the settled "
        "test's time / the general one's, the median of 15 interleaved rounds.\n"
    )


def jit_route() -> str:
    """jax's tier of the route, step by step, after the compiled program."""
    found = _load("jit_route.json")
    meta = found["meta"]
    body = [[r["call"], _seconds(r["seconds"]), f"{r['over_native_us']:+.2f} µs"] for r in found["rows"]]
    table = _table(["call", "time", "over the native call"], body)
    return table + (
        f"\nMeasured {meta['date'][:10]} with `{meta['command']}` (Python {meta['python']}, jax {meta['jax']}); the "
        f"median of {meta['rounds']} interleaved rounds.\n"
    )


def jax_modules() -> str:
    """An equinox module as x, against equinox's own call and the floor of jit on its arrays."""
    found = _load("jax_modules.json")
    meta = found["meta"]
    body = [
        [r["row"], _seconds(r["native_s"]), _seconds(r["diffiface_s"]), _ratio(r["ratio"]), _ratio(r["floor"])]
        for r in found["rows"]
    ]
    table = _table(["module", "equinox's call", "diffiface", "diffiface / equinox's", "diffiface / floor"], body)
    return table + (
        f"\nMeasured {meta['date'][:10]} with `{meta['command']}` (Python {meta['python']}, jax {meta['jax']}, "
        f"equinox {meta['equinox']}); ratios: the median of {meta['rounds']} interleaved rounds of the ratio within a round.\n"
    )


def torch_fused() -> str:
    """torch's fused calls against the guard's steps on the same prepared call."""
    found = _load("torch_fused.json")
    meta = found["meta"]
    body = [
        [
            r["case"],
            r["mode"],
            _seconds(r["fused_s"]),
            _seconds(r["plain_s"]),
            _ratio(r["plain_over_fused"]),
            "yes" if r["fused_call"] else "no",
        ]
        for r in found["rows"]
    ]
    table = _table(["case", "torch mode", "fused", "guard's steps", "steps / fused", "fused call"], body)
    return table + (
        f"\nMeasured {meta['date'][:10]} with `{meta['command']}` (Python {meta['python']}, torch {meta['torch']}, one "
        f"thread); the median of {meta['rounds']} interleaved rounds. Where the fused call is no, both sides take "
        "the guard's steps: their ratio is the run's noise.\n"
    )


def differentiate_with() -> str:
    found = _load("differentiate_with.json")
    inside_torch = found["jax_inside_torch"]
    inside_jax = found["torch_inside_jax"]
    body = [
        ["torch (`loss.backward()`)", "jax", _ratio(inside_torch["overhead"])],
        ["jax (`jax.grad`, eager)", "torch", _ratio(inside_jax["overhead"])],
        ["jax (`jax.jit(jax.grad)`)", "torch", _ratio(inside_jax["overhead_jit"])],
    ]
    table = _table(["outer engine", "inner engine", "through `g` / the inner engine called directly"], body)
    return table + (
        f"\nOne gradient step of an MLP (64 → 128 → 128 → 10, batch 64, float32), measured on "
        f"{found['date'][:10]} with `taskset -c 1 python benchmarks/differentiate_with.py` on "
        f"{found['cpus']} CPU; load average {found['load'][0]:.0f}: other jobs shared the machine, "
        "so the times are high and noisy.\n"
    )


def main_job() -> str:
    found = _load("main_job.json")
    date = found["meta"]["date"][:10]
    quick, full = found["main_job"]
    return (
        f"On a {found['meta']['cpu_count']}-CPU Linux machine, measured {date} "
        f"(`python benchmarks/run.py --main-job full`): the full job took {full['wall_s']:.0f} s of wall "
        f"time and {full['cpu_s']:.0f} CPU-seconds ({full['checks']:,} checks), `--quick` "
        f"{quick['wall_s']:.0f} s and {quick['cpu_s']:.0f} CPU-seconds ({quick['checks']:,} checks).\n"
    )


def support_matrix() -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import support_matrix as matrix
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return matrix.support_matrix()  # type: ignore[no-any-return]


GENERATORS: dict[str, tuple[str, Callable[[], str]]] = {
    "readme-performance": (f"{RESULTS}/shapes.json", readme_performance),
    "shapes-conditions": (f"{RESULTS}/shapes.json", shapes_conditions),
    "gradient-mlp": (f"{RESULTS}/shapes.json", lambda: gradient_by_shape("mlp")),
    "gradient-10": (f"{RESULTS}/shapes.json", lambda: gradient_by_shape("10-input")),
    "operators-mlp": (f"{RESULTS}/shapes.json", lambda: operators_by_backend("mlp")),
    "operators-10": (f"{RESULTS}/shapes.json", lambda: operators_by_backend("10-input")),
    "floors": (f"{RESULTS}/shapes.json", floors),
    "jax-floor": (f"{RESULTS}/shapes.json", jax_floor),
    "user-forms": (f"{RESULTS}/shapes.json", user_forms),
    "results-conditions": (f"{RESULTS}/results.json", results_conditions),
    "import-cost": (f"{RESULTS}/results.json", import_cost),
    "cheap-gradient": (f"{RESULTS}/results.json", cheap_gradient),
    "hessian-modes": (f"{RESULTS}/results.json", hessian_modes),
    "finite-differences": (f"{RESULTS}/results.json", finite_differences_vectorised),
    "pymanopt": (f"{RESULTS}/results.json", pymanopt),
    "sparse": (f"{RESULTS}/sparse.json", sparse),
    "sharded": (f"{RESULTS}/sharded.json", sharded),
    "sharded-memory": (f"{RESULTS}/sharded.json", sharded_memory),
    "differentiate-with": (f"{RESULTS}/differentiate_with.json", differentiate_with),
    "closure-test": (f"{RESULTS}/closure_test.json", closure_test),
    "jit-route": (f"{RESULTS}/jit_route.json", jit_route),
    "jax-modules": (f"{RESULTS}/jax_modules.json", jax_modules),
    "torch-fused": (f"{RESULTS}/torch_fused.json", torch_fused),
    "main-job": (f"{RESULTS}/main_job.json", main_job),
    "torch-users": (f"{RESULTS}/torch_users.json", torch_users),
    "readme-torch-users": (f"{RESULTS}/torch_users.json", readme_torch_users),
    "torch-users-before": (f"{RESULTS}/torch_users_before.json", lambda: torch_users("torch_users_before.json")),
    "engines": (f"{RESULTS}/engines.json", engines),
    "support-matrix": (REGISTRY, support_matrix),
}


def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def regenerate(text: str, where: str = "") -> tuple[str, list[str]]:
    """``text`` with every marked region rendered again, and what was out of date in it."""
    problems: list[str] = []

    def render(match: re.Match[str]) -> str:
        name, source = match["name"], match["source"]
        if name not in GENERATORS:
            problems.append(f"{where}: no generator {name!r} (known: {', '.join(GENERATORS)})")
            return match.group(0)
        expected_source, generate = GENERATORS[name]
        if source != expected_source:
            problems.append(f"{where}: region {name!r} names {source}, but is generated from {expected_source}")
        body = generate()
        if body != match["body"]:
            problems.append(f"{where}: region {name!r} differs from what {expected_source} gives")
        return f"<!-- generated from {expected_source} by scripts/benchmark_docs.py: {name} -->\n{body}<!-- end generated -->"

    return REGION.sub(render, text), problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a region is out of date")
    args = parser.parse_args(argv)
    stale: list[str] = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new, problems = regenerate(text, str(page.relative_to(ROOT)))
        stale += problems
        if new != text and not args.check:
            page.write_text(new, encoding="utf-8")
            print(f"rewrote {page.relative_to(ROOT)}")
    if args.check and stale:
        print("\n".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
