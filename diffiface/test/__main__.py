"""``python -m diffiface.test``: every installed backend on the bundled scenarios.

Shows a progress bar while it works, then a table (backend x scenario group: passed, failed,
skipped, worst error), and exits with status 1 on any failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from .._adapters import available, install_hint
from .._backends import AutoAutograd, AutoFiniteDifferences, AutoJAX, AutoScipy, AutoTorch, Backend
from ._running import backend_label, test_differentiation
from ._scenario import Scenario

_BACKENDS: dict[str, Backend] = {
    "finite_differences": AutoFiniteDifferences(),
    "jax": AutoJAX(),
    "torch": AutoTorch(),
    "torch-func": AutoTorch(mode="func"),
    "autograd": AutoAutograd(),
    "scipy": AutoScipy(),
}

#: Known limits of the bundled suite, by backend label: skipped, with the reason in the docs.
_SKIP: dict[str, Iterable[str]] = {
    # scipy's adaptive differences start with a wide step (0.5), which crosses the kinks of
    # piecewise layers (max pooling, maxout): a known limit of the method, not a bug to report.
    "scipy": {"piecewise"},
}
#: With --quick, also scipy's second order on pytrees: each adaptive Hessian there takes seconds.
_QUICK_SKIP: dict[str, Iterable[str]] = {"scipy": {"piecewise", "second_order"}}


def _scenarios(groups: Sequence[str], quick: bool) -> tuple[list[Scenario], list[str]]:
    from . import _scenarios

    chosen: list[Scenario] = []
    notes = []
    if "core" in groups:
        chosen += _scenarios.core_scenarios(dtypes=("float64",) if quick else ("float64", "float32"), quick=quick)
    if "layers" in groups:
        if importlib.util.find_spec("array_api_compat") is None:
            notes.append('layers: skipped, array_api_compat is not installed: pip install "diffiface[test]"')
        else:
            chosen += _scenarios.layer_scenarios(dtypes=("float64",) if quick else ("float64", "float32"), quick=quick)
    if "torch" in groups:
        if importlib.util.find_spec("torch") is None:
            notes.append('torch modules: skipped, torch is not installed: pip install "diffiface[torch]"')
        elif not quick:
            chosen += _scenarios.torch_module_scenarios()
    return chosen, notes


def _progress(stream: Any) -> Any:
    start = time.perf_counter()

    def show(done: int, total: int, what: str) -> None:
        width = 30
        filled = int(width * done / max(total, 1))
        elapsed = time.perf_counter() - start
        stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {elapsed:5.0f}s {what[:40]:<40}")
        if done == total:
            stream.write("\n")
        stream.flush()

    return show


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffiface.test", description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(_BACKENDS), help=f"comma-separated, from {', '.join(_BACKENDS)}")
    parser.add_argument("--scenarios", default="core,layers,torch", help="comma-separated groups: core, layers, torch")
    parser.add_argument("--operators", default=None, help="comma-separated operator names (default: all)")
    parser.add_argument("--format", choices=("table", "markdown", "json"), default="table")
    parser.add_argument("--quick", action="store_true", help="a small subset, in about a minute")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    names = [name.strip() for name in args.backends.split(",") if name.strip()]
    unknown = [name for name in names if name not in _BACKENDS]
    if unknown:
        parser.error(f"unknown backends {unknown}; choose from {', '.join(_BACKENDS)}")
    backends = [_BACKENDS[name] for name in names]
    scenarios, notes = _scenarios([g.strip() for g in args.scenarios.split(",")], args.quick)
    if args.operators:
        wanted = {o.strip() for o in args.operators.split(",")}
        scenarios = [s for s in scenarios if s.operator in wanted]
    for backend in backends:
        if not available(backend):
            notes.append(f"{backend_label(backend)}: skipped, not installed: {install_hint(backend)}")
    installed = [b for b in backends if available(b)]
    progress = None if args.no_progress or args.format == "json" else _progress(sys.stderr)
    start = time.perf_counter()
    skip = _QUICK_SKIP if args.quick else _SKIP
    report = test_differentiation(installed, scenarios, skip=skip, raise_on_failure=False, progress=progress)
    seconds = time.perf_counter() - start

    lines = report.grouped()
    for backend in backends:
        if not available(backend):
            lines.append(
                {
                    **dict.fromkeys(lines[0] if lines else ["backend", "group"], 0),
                    "backend": backend_label(backend),
                    "group": "(not installed)",
                }
            )
    if args.format == "json":
        print(
            json.dumps(
                {"rows": [vars(row) | {"tags": sorted(row.tags)} for row in report.rows], "seconds": seconds},
                default=str,
            )
        )
    else:
        print(report.table(args.format, lines))
        for note in notes:
            print(note)
        counts = report.counts()
        print(
            f"{counts.get('passed', 0)} passed, {len(report.failed)} failed, {counts.get('skipped', 0)} skipped in {seconds:.0f} s"
        )
        if report.failed:
            print(report.summary())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
