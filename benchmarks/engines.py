"""The engines against their own fastest call: diffiface's prepared gradient, the backend by its
string name, against the call a user of the engine writes for the same gradient.

    python benchmarks/run.py --engines [--quick] [--cpus 0]
    python benchmarks/engines.py [--quick] [--cpus 0]

Each engine's rows run in a process of their own, as its users run it: no other engine's
imports, thread pools or allocator weigh on them. Optionally pinned to ``--cpus``; each row times
diffiface and the native call in interleaved rounds (the median over rounds of the ratio within a
round). Each engine's rows come
from ``benchmarks/engine_rows/<engine>.py``: ``ENGINE``, its backend name, and ``cases(quick)``,
a list of ``(label, ours, native)`` where ``ours`` is diffiface's prepared gradient and
``native`` the engine's own fastest call (a ``tf.function``-compiled tape, a compiled PyTensor
function of ``grad``, ``mx.compile(mx.grad(f))``, ``torch.compile(torch.func.grad(f))``), each
returning the finished gradient. The labels are ``"10 inputs"`` (``sum(tanh(x) * x)`` on 10
float32 inputs) and ``"MLP size"`` (the 48-96-48-1 tanh MLP of ``benchmarks/run.py``, its
parameters one float32 vector, a 64 x 48 batch as a Constant). A rows module may add rows of
other labels (a floor such as pytensor's "10 inputs (trust_input native)"), reported with no
goal. An engine that is not installed is reported as skipped, with the reason.

Writes benchmarks/results/engines.json and .md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from diffiface.test._benchmark import time_pair

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROWS = HERE / "engine_rows"

GOALS = {"10 inputs": 1.25, "MLP size": 1.10}
"""diffiface / the engine's own fastest call, the most each row may take (issue 40)."""


def _modules() -> list[str]:
    return sorted(path.stem for path in ROWS.glob("*.py") if not path.stem.startswith("_"))


def _load(name: str) -> Any:
    """A rows module by its file (its name is its engine's, which an import by name would take
    for the engine's own package)."""
    spec = importlib.util.spec_from_file_location(f"engine_rows_{name}", ROWS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "numpy"):
        value = value.detach() if hasattr(value, "detach") else value
        return np.asarray(value.numpy())
    return np.asarray(value)


def _same(a: Any, b: Any) -> bool:
    a, b = _as_numpy(a), _as_numpy(b)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-4, atol=1e-6))


def run(quick: bool) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Every engine's rows, each engine's in a process of its own (the CPUs pinned are its)."""
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    for name in _modules():
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "rows.json"
            command = [sys.executable, __file__, "--engine", name, "--out", str(out)] + (["--quick"] if quick else [])
            code = subprocess.run(command, check=False).returncode
            if code != 0 or not out.exists():  # a failing engine is reported, never hidden
                skipped.append({"module": name, "reason": f"failed: its process exited with status {code}"})
                continue
            found = json.loads(out.read_text())
        rows += found["rows"]
        skipped += found["skipped"]
    return rows, skipped


def run_engine(name: str, quick: bool) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The rows of one engine (``benchmarks/engine_rows/<name>.py``), in this process."""
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    try:
        module = _load(name)
        started = time.perf_counter()
        cases = [(module.ENGINE, *case) for case in module.cases(quick)]
        if hasattr(module, "cases_jit"):  # (the engine's jit option, against the same native call)
            cases += [(f"{module.ENGINE} (jit=True)", *case) for case in module.cases_jit(quick)]
    except ImportError as exc:
        skipped.append({"module": name, "reason": f"not installed ({exc})"})
        return rows, skipped
    except Exception as exc:  # a failing row is reported, never hidden
        skipped.append({"module": name, "reason": f"failed: {type(exc).__name__}: {exc}"})
        traceback.print_exc()
        return rows, skipped
    for engine, label, ours, native in cases:
        first = time.perf_counter()
        same = _same(ours(), native())
        compile_s = time.perf_counter() - first  # both first calls: traces and compiles
        median, _, native_median, ratio = time_pair(ours, native, rounds=5 if quick else 21)
        goal = GOALS.get(label)
        rows.append(
            {
                "engine": engine,
                "label": label,
                "native_s": native_median,
                "diffiface_s": median,
                "ratio": ratio,
                "goal": goal,
                "met": None if goal is None else ratio <= goal,
                "check": "same" if same else "DIFFERENT",
                "first_calls_s": compile_s,
                "setup_s": time.perf_counter() - started,
            }
        )
        print(f"{engine:24s} {label:10s} ratio {ratio:.3f} ({'same' if same else 'DIFFERENT'})", flush=True)
    return rows, skipped


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:  # (outside a checkout)
        return "unknown"


def write(rows: list[dict[str, Any]], skipped: list[dict[str, str]], meta: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engines.json").write_text(json.dumps({"meta": meta, "rows": rows, "skipped": skipped}, indent=1) + "\n")
    lines = [
        "# The engines against their own fastest call",
        "",
        f"Generated by `{meta['command']}` on {meta['when']} at commit {meta['commit']} ({meta['platform']}, "
        f"{meta['versions']}). `ratio` = diffiface / native, the median over interleaved rounds of the ratio "
        "within a round. `first calls` is the time of both first calls (traces and compiles).",
        "",
        "| engine | row | native_s | diffiface_s | ratio | goal | met | check | first calls (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        met = "-" if r["met"] is None else ("yes" if r["met"] else f"no (+{(r['ratio'] / r['goal'] - 1) * 100:.1f}%)")
        lines.append(
            f"| {r['engine']} | {r['label']} | {r['native_s']:.3g} | {r['diffiface_s']:.3g} | {r['ratio']:.3g} | "
            f"{r['goal'] or '-'} | {met} | {r['check']} | {r['first_calls_s']:.3g} |"
        )
    for s in skipped:
        lines.append(f"| {s['module']} | skipped: {s['reason']} | | | | | | | |")
    (RESULTS / "engines.md").write_text("\n".join(lines) + "\n")


def _versions() -> str:
    found = []
    for name in ("torch", "tensorflow", "pytensor", "mlx.core"):
        try:
            module = importlib.import_module(name)
            found.append(f"{name.split('.')[0]} {getattr(module, '__version__', '?')}")
        except Exception:  # (not installed: its rows say so)
            continue
    return ", ".join(found) or "no engine"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 21")
    parser.add_argument("--cpus", default=None, help="pin to these CPUs, e.g. 0 or 0,1")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # (one engine's rows, in this process: run's child)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.engine:
        rows, skipped = run_engine(args.engine, args.quick)
        Path(args.out).write_text(json.dumps({"rows": rows, "skipped": skipped}) + "\n")
        return
    rows, skipped = run(args.quick)
    command = (
        "python benchmarks/run.py --engines"
        + (" --quick" if args.quick else "")
        + (f" --cpus {args.cpus}" if args.cpus else "")
    )
    meta = {
        "command": command,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": _commit(),
        "platform": platform.platform(),
        "versions": _versions(),
        "cpus": sorted(os.sched_getaffinity(0)),
    }
    write(rows, skipped, meta)


if __name__ == "__main__":
    main()
