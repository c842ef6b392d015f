"""python -m diffiface.test: every installed backend on the bundled scenarios.

Shows a progress bar on a terminal while it works, then a table (backend x scenario group:
passed, failed, skipped, worst error, references, skip reasons), and exits with status 1 on any
failure, 2 on a wrong option.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._adapters import available, install_hint
from .._backends import AutoAutograd, AutoFiniteDifferences, AutoJAX, AutoScipy, AutoTorch, Backend
from ._running import Report, Row, backend_label, run_cli_part, test_differentiation
from ._scenario import Scenario

_BACKENDS: dict[str, Backend] = {
    "finite_differences": AutoFiniteDifferences(),
    "jax": AutoJAX(),
    "torch": AutoTorch(),
    "torch-func": AutoTorch(mode="func"),
    "autograd": AutoAutograd(),
    "scipy": AutoScipy(),
}
_GROUPS = ("core", "layers", "torch", "sparse", "complex")

#: Known limits of the bundled suite, by backend label: skipped, with the reason in the docs.
_SKIP: dict[str, Iterable[str]] = {
    # scipy's adaptive differences start with a wide step (0.5), which crosses the kinks of
    # piecewise layers (max pooling, maxout): a known limit of the method, not a bug to report.
    "scipy": {"piecewise"},
}
#: With --quick, also scipy's second order on pytrees: each adaptive Hessian there takes seconds.
_QUICK_SKIP: dict[str, Iterable[str]] = {"scipy": {"piecewise", "second_order"}}
#: The reason shown for each tag skipped above.
_SKIP_REASONS = {
    "piecewise": "scipy's wide first step crosses the kinks of piecewise layers",
    "second_order": "--quick leaves out scipy's second order (seconds per adaptive Hessian)",
}


def _explain_skips(rows: list[Row]) -> list[Row]:
    for row in rows:
        if row.message == "skipped on request":
            tags = [tag for tag in _SKIP_REASONS if tag in row.tags]
            row.message = "; ".join(_SKIP_REASONS[tag] for tag in tags) or row.message
    return rows


def _scenarios(
    groups: Sequence[str], quick: bool, operators: Sequence[str] | None = None
) -> tuple[list[Scenario], list[str]]:
    from . import _scenarios

    chosen: list[Scenario] = []
    notes = []
    dtypes = ("float64",) if quick else ("float64", "float32")
    if "core" in groups:
        chosen += _scenarios.core_scenarios(dtypes=dtypes, quick=quick)
    if "layers" in groups:
        if importlib.util.find_spec("array_api_compat") is None:
            notes.append('layers: skipped, array_api_compat is not installed: pip install "diffiface[test]"')
        else:
            chosen += _scenarios.layer_scenarios(dtypes=dtypes, quick=quick)
    if "torch" in groups:
        if importlib.util.find_spec("torch") is None:
            notes.append('torch modules: skipped, torch is not installed: pip install "diffiface[torch]"')
        elif not quick:
            chosen += _scenarios.torch_module_scenarios()
    if "complex" in groups:
        from ._complex_scenarios import complex_scenarios

        chosen += complex_scenarios(dtypes=("complex128",) if quick else ("complex128", "complex64"))
    if operators:
        chosen = [s for s in chosen if s.operator in operators]
    return chosen, notes


def _sparse_parts(groups: Sequence[str], quick: bool, operators: Sequence[str] | None) -> list[int]:
    """The indices of the sparse scenarios to run (each runs on every engine and detector)."""
    if "sparse" not in groups:
        return []
    from ._sparse_scenarios import sparse_scenarios

    return [i for i, s in enumerate(sparse_scenarios(quick=quick)) if not operators or s.operator in operators]


# -- progress -------------------------------------------------------------------------------------

Progress = Callable[[int, int, str], None]


def _progress(stream: Any) -> tuple[Progress | None, Callable[[], None]]:
    """A progress display with an ETA and the row being checked; none when ``stream`` is not a
    terminal. rich draws it where installed, else a plain line redrawn in place."""
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return None, lambda: None
    if importlib.util.find_spec("rich") is not None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=Console(file=stream),
            transient=True,
        )
        task = bar.add_task("", total=None)
        bar.start()

        def show_rich(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what[:50])

        return show_rich, bar.stop
    start = time.perf_counter()

    def show(done: int, total: int, what: str) -> None:
        elapsed = time.perf_counter() - start
        eta = f"ETA {elapsed / done * (total - done):4.0f} s" if done else "ETA    ? s"
        filled = int(30 * done / max(total, 1))
        stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {eta} {what[:40]:<40}")
        stream.flush()

    return show, lambda: stream.write("\r" + " " * 100 + "\r")


# -- running, in this process or in several -----------------------------------------------------------

_WORKER_SCENARIOS: dict[tuple[Any, ...], list[Scenario]] = {}


def _run_part(
    groups: tuple[str, ...],
    quick: bool,
    operators: tuple[str, ...] | None,
    backend_names: tuple[str, ...],
    indices: tuple[int, ...],
) -> list[Row]:
    """In a worker process: the rows of some scenarios (by index in the list) on every backend.
    The scenarios are built again here (functions do not travel between processes)."""
    key = (groups, quick, operators)
    if key not in _WORKER_SCENARIOS:
        _WORKER_SCENARIOS[key] = _scenarios(groups, quick, operators)[0]
    scenarios = [_WORKER_SCENARIOS[key][i] for i in indices]
    backends = [_BACKENDS[name] for name in backend_names]
    report = test_differentiation(backends, scenarios, skip=_QUICK_SKIP if quick else _SKIP, raise_on_failure=False)
    return _explain_skips(report.rows)


def _run(
    groups: tuple[str, ...],
    quick: bool,
    operators: tuple[str, ...] | None,
    backend_names: tuple[str, ...],
    scenarios: list[Scenario],
    jobs: int,
    progress: Progress | None,
    sparse: Sequence[int] = (),
) -> Report:
    """The rows of every scenario on every backend, then those of the sparse scenarios at
    ``sparse`` (each on AutoSparse of every backend and detector), in worker processes when
    ``jobs > 1``."""
    from ._sparse_scenarios import run_sparse_part

    backends = [_BACKENDS[name] for name in backend_names]
    skip = _QUICK_SKIP if quick else _SKIP
    if jobs <= 1 or len(scenarios) + len(sparse) < 2:
        report = test_differentiation(backends, scenarios, skip=skip, raise_on_failure=False, progress=progress)
        _explain_skips(report.rows)
        for index in sparse:
            report.rows += run_sparse_part(quick, tuple(backends), index)
        return report
    # Scenarios dealt round-robin into small parts (each scenario's backends stay together and
    # share its reference); the parts run in processes started afresh (jax does not survive a
    # fork), and their rows are put back in the order of a run in one process.
    parts = [tuple(range(i, len(scenarios), jobs * 4)) for i in range(min(jobs * 4, len(scenarios)))]
    total = len(scenarios) * len(backends)
    rows: dict[int, list[Row]] = {}
    done = 0
    context = multiprocessing.get_context("spawn")
    sparse_rows: dict[int, list[Row]] = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(run_cli_part, groups, quick, operators, backend_names, part): part for part in parts}
        # the sparse scenarios in the same processes (started once: each start imports the engines)
        sparse_futures = {pool.submit(run_sparse_part, quick, tuple(backends), index): index for index in sparse}
        for future in concurrent.futures.as_completed([*futures, *sparse_futures]):
            if future in sparse_futures:
                sparse_rows[sparse_futures[future]] = future.result()
                continue
            part = futures[future]
            for index, start in zip(part, range(0, len(part) * len(backends), len(backends)), strict=True):
                rows[index] = future.result()[start : start + len(backends)]
            done += len(part) * len(backends)
            if progress is not None:
                progress(done, total, scenarios[part[-1]].name)
    return Report(
        [row for index in range(len(scenarios)) for row in rows[index]]
        + [row for index in sparse for row in sparse_rows[index]]
    )


# -- the command ------------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    from .._call import OPERATORS

    parser = argparse.ArgumentParser(
        prog="python -m diffiface.test",
        description="Check every installed diffiface backend on the bundled scenarios, against their references.",
    )
    parser.add_argument("--backends", default=",".join(_BACKENDS), help=f"comma-separated, from {', '.join(_BACKENDS)}")
    parser.add_argument(
        "--scenarios", default=",".join(_GROUPS), help=f"comma-separated groups, from {', '.join(_GROUPS)}"
    )
    parser.add_argument(
        "--operators", default=None, help="comma-separated operator names, such as gradient,hvp (default: all)"
    )
    parser.add_argument("--format", choices=("table", "markdown", "json"), default="table")
    parser.add_argument("--quick", action="store_true", help="a small subset in float64")
    parser.add_argument(
        "-j", "--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: the CPU count)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (none is drawn off a terminal)")
    args = parser.parse_args(argv)

    names = _names(args.backends)
    unknown = [name for name in names if name not in _BACKENDS]
    if unknown:
        parser.error(f"unknown backends {', '.join(unknown)}; choose from {', '.join(_BACKENDS)}")
    groups = _names(args.scenarios)
    unknown = [name for name in groups if name not in _GROUPS]
    if unknown or not groups:
        parser.error(
            f"unknown scenario groups {', '.join(unknown) or '(none given)'}; choose from {', '.join(_GROUPS)}"
        )
    operators = _names(args.operators) if args.operators else None
    unknown = [name for name in operators or () if name not in OPERATORS]
    if unknown:
        parser.error(f"unknown operators {', '.join(unknown)}; choose from {', '.join(sorted(OPERATORS))}")
    if args.jobs < 1:
        parser.error("-j/--jobs takes a positive number of processes")

    backends = [_BACKENDS[name] for name in names]
    scenarios, notes = _scenarios(groups, args.quick, operators)
    for backend in backends:
        if not available(backend):
            notes.append(f"{backend_label(backend)}: skipped, not installed: {install_hint(backend)}")
    installed = tuple(name for name in names if available(_BACKENDS[name]))
    progress, stop = (None, lambda: None) if args.no_progress or args.format == "json" else _progress(sys.stderr)
    start = time.perf_counter()
    try:
        report = _run(
            tuple(groups),
            args.quick,
            tuple(operators) if operators else None,
            installed,
            scenarios,
            args.jobs,
            progress,
            _sparse_parts(groups, args.quick, operators),
        )
    finally:
        stop()
    seconds = time.perf_counter() - start

    lines = report.grouped()
    for backend in backends:
        if not available(backend):
            lines.append(
                {
                    **dict.fromkeys(lines[0] if lines else ["backend", "group"], 0),
                    "backend": backend_label(backend),
                    "group": "(not installed)",
                    "references": "",
                    "skip reasons": f"not installed: {install_hint(backend)}",
                }
            )
    if args.format == "json":
        print(
            json.dumps(
                {
                    "rows": [
                        vars(row) | {"tags": sorted(row.tags), "warnings": list(row.warnings)} for row in report.rows
                    ],
                    "warnings": report.warnings,
                    "seconds": round(seconds, 3),
                },
                default=str,
            )
        )
    else:
        print(report.table(args.format, lines))
        for note in notes:
            print(note)
        counts = report.counts()
        print(
            f"{counts.get('passed', 0)} passed, {len(report.failed)} failed, {counts.get('skipped', 0)} skipped "
            f"in {seconds:.1f} s"
        )
        if report.failed:
            print(report.summary())
        else:
            for line in report.warnings_text():
                print(line)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
