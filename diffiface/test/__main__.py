"""python -m diffiface.test: every installed backend on the bundled scenarios.

Shows its progress while it works (a bar on a terminal; off one, a line per finished group),
then a table (backend x scenario group: passed, failed, skipped, worst error, seconds,
references, skip reasons cited by number below it, in full), and exits with status 1 on any
failure, 2 on a wrong option or a selection that checks nothing. ``--help`` says what a check
is, what the groups hold, and what the columns mean.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._adapters import available, install_hint, labels, names_of, normalize
from ._main_job import (
    BACKENDS,
    GROUPS,
    Plan,
    Progress,
    dense_scenarios,
    parts,
    planned_rows,
    run,
    sampling_first,
    sparse_scenarios,
)
from ._running import Report, backend_label

# the names tests and scripts know these by
_BACKENDS = BACKENDS
# by default, every backend but compiled torch, whose first call of each prep compiles with
# Inductor (seconds each: hours over the scenarios); --backends torch-compile asks for it. mlx's
# compile takes milliseconds: it runs by default.
_SLOW_TO_COMPILE = ("torch-compile",)
_DEFAULT = [name for name in BACKENDS if name not in _SLOW_TO_COMPILE]
_GROUPS = GROUPS


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _accepted() -> list[str]:
    """Every backend name the API takes (``di.gradient(f, name, x)``), from the registry: the
    engines' names and the names of their option sets (``torch-func``, ``torch-autograd``)."""
    return list(dict.fromkeys(name for backend in labels().values() for name in sorted(names_of(backend))))


def _canonical(names: Sequence[str]) -> list[str]:
    """Each name as the main job and its table know it (``torch-autograd`` is ``torch``), once."""
    return list(dict.fromkeys(backend_label(normalize(name)) for name in names))


_HELP = """\
what a check is:
  One row of the report: one backend on one scenario (a function, a point x, contexts and an
  operator such as gradient or hvp). The backend computes the operator unprepared and with a
  prep made at another point of the same shape, two calls each; every result must match the
  scenario's reference (analytic, finite differences in float64, or a second engine: the
  "references" column) within the tolerances of its dtype. A check also fails when the call
  changed x or a Constant, when f gives two values at one x, or when a prep is accepted for
  another function.

the scenario groups (--scenarios):
  core     every operator on scalars, vectors, matrices, empty and pytree inputs, with
           Constant and Cache contexts, float64 and float32
  layers   the layer zoo, written once for every array framework: dense, conv, pooling,
           RNN/LSTM/GRU cells, normalisation, attention, embedding, dropout
  torch    the same layers as torch.nn modules (torch only; not with --quick)
  sparse   sparse Jacobians and Hessians on AutoSparse of each engine, with known patterns
  complex  complex inputs and outputs, in torch's convention (docs/complex.md)

the table's columns:
  passed, failed, skipped   rows of that backend and group; a skipped count cites its reasons
                            by number ([1,3]), listed in full below the table
  rel error                 the worst relative error of a passed row, max|result - reference|
                            / max|reference| over the whole result: how close the backend came
  seconds                   the rows' time, preparation and calls together

examples:
  python -m diffiface.test --quick                      a fast subset, float64 only
  python -m diffiface.test --backends jax,torch-func    two engines, every group
  python -m diffiface.test --scenarios layers --operators gradient,hvp
  python -m diffiface.test --format json > rows.json    every row, with its message

exit status:
  0  every check passed or was skipped (each skip with its reason)
  1  a check failed (each failure is printed with its reference and message)
  2  a wrong option, or a selection that checks nothing
"""


def _notes(groups: Sequence[str], quick: bool) -> list[str]:
    """What the run leaves out because a package is missing, or by --quick's design."""
    import importlib.util

    notes = []
    if "layers" in groups and importlib.util.find_spec("array_api_compat") is None:
        notes.append('layers: skipped, array_api_compat is not installed: pip install "diffiface[test]"')
    if "torch" in groups:
        if importlib.util.find_spec("torch") is None:
            notes.append('torch modules: skipped, torch is not installed: pip install "diffiface[torch]"')
        elif quick:
            notes.append("torch modules: not part of --quick (run without --quick to check them)")
    return notes


def _operators_of(groups: Sequence[str], quick: bool) -> list[str]:
    found = [s.operator for s in dense_scenarios(groups, quick, None) + sparse_scenarios(groups, quick, None)]
    return sorted(set(found))


def main(argv: Sequence[str] | None = None) -> int:
    from .._call import OPERATORS

    accepted = _accepted()
    parser = argparse.ArgumentParser(
        prog="python -m diffiface.test",
        description=(
            "Check every installed diffiface backend on the bundled scenarios, against their references, "
            "and print a table of the checks by backend and scenario group."
        ),
        epilog=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backends",
        default=",".join(_DEFAULT),
        help=f"comma-separated backend names, as di.gradient takes them: {', '.join(accepted)} (default: "
        f"{', '.join(_DEFAULT)})",
    )
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
    # (the skip reasons are always in full now; the flag stays for the scripts that pass it)
    parser.add_argument("--details", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress display (neither the bar nor the lines per group)"
    )
    args = parser.parse_args(argv)

    names = _names(args.backends)
    unknown = [name for name in names if name not in accepted]
    if unknown or not names:
        parser.error(f"unknown backends {', '.join(unknown) or '(none given)'}; choose from {', '.join(accepted)}")
    names = _canonical(names)
    groups = _names(args.scenarios)
    unknown = [name for name in groups if name not in _GROUPS]
    if unknown or not groups:
        parser.error(
            f"unknown scenario groups {', '.join(unknown) or '(none given)'}; choose from {', '.join(_GROUPS)}"
        )
    operators = _names(args.operators) if args.operators is not None else None
    unknown = [name for name in operators or () if name not in OPERATORS]
    if unknown or operators == []:
        parser.error(
            f"unknown operators {', '.join(unknown) or '(none given)'}; choose from {', '.join(sorted(OPERATORS))}"
        )
    if args.jobs < 1:
        parser.error("-j/--jobs takes a positive number of processes")

    installed = tuple(name for name in names if available(_BACKENDS[name]))
    missing = [f"{backend_label(_BACKENDS[n])} ({install_hint(_BACKENDS[n])})" for n in names if n not in installed]
    if not installed:
        parser.error(f"the selection checks nothing: none of its backends is installed: {'; '.join(missing)}")
    dense = dense_scenarios(groups, args.quick, operators)
    sparse = sparse_scenarios(groups, args.quick, operators)
    if not dense and not sparse:
        known = _operators_of(groups, args.quick)
        parser.error(
            f"the selection checks nothing: the groups {', '.join(groups)}"
            + (" (--quick)" if args.quick else "")
            + (f" have no scenario of {', '.join(operators)}" if operators else " have no scenario here")
            + (f"; their operators are {', '.join(known)}" if known else "")
        )
    plan = Plan(
        tuple(groups),
        args.quick,
        tuple(operators) if operators else None,
        installed,
        tuple(range(len(dense))),
        tuple(range(len(sparse))),
    )
    part_list = parts(plan, dense, size=max(1, len(dense) // (8 * args.jobs)))
    progress = None
    if not args.no_progress:
        terminal = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
        progress = Progress(sys.stderr, planned_rows(plan, dense, sparse), args.jobs, terminal)
    start = time.perf_counter()
    try:
        report = Report(run(plan, part_list, args.jobs, progress, sampling_first(part_list, dense)))
    finally:
        if progress is not None:
            progress.close()
    seconds = time.perf_counter() - start
    return _print(report, args, names, installed, _notes(groups, args.quick), seconds)


def _print(
    report: Report, args: Any, names: list[str], installed: tuple[str, ...], notes: list[str], seconds: float
) -> int:
    # a backend that is not installed is reported as skipped, in every format
    missing = {
        backend_label(
            _BACKENDS[name]
        ): f"{backend_label(_BACKENDS[name])} is not installed: {install_hint(_BACKENDS[name])}"
        for name in names
        if name not in installed
    }
    # (a selection whose every check is skipped passes nothing: refused, as one with no backend installed)
    why = report.nothing_checked()
    nothing = f"the selection checks nothing: {'; '.join([why, *missing.values()])}" if why else None
    if args.format == "json":
        print(
            json.dumps(
                {
                    "rows": [
                        vars(row) | {"tags": sorted(row.tags), "warnings": list(row.warnings)} for row in report.rows
                    ],
                    "not installed": [{"backend": label, "reason": reason} for label, reason in missing.items()],
                    "warnings": report.warnings,
                    "seconds": round(seconds, 3),
                },
                default=str,
            )
        )
        return _refused(nothing) if nothing else 1 if report.failed else 0
    lines = report.grouped()
    for label, reason in missing.items():
        line = {
            **dict.fromkeys(lines[0], 0),
            "backend": label,
            "group": "-",
            "references": "",
            "skip reasons": [reason],
        }
        if "skipped" in line:
            line["skipped"] = 1
        lines.append(line)
    print(report.table(args.format, lines))
    for note in notes:
        print(note)
    if report.failed:
        print(report.summary())
    else:
        for line_text in report.warnings_text():
            print(line_text)
    counts = report.counts()
    print(
        f"{counts.get('passed', 0)} passed, {len(report.failed)} failed, "
        f"{counts.get('skipped', 0) + len(missing)} skipped in {seconds:.1f} s"
    )
    return _refused(nothing) if nothing else 1 if report.failed else 0


def _refused(message: str) -> int:
    """Exit status 2 with ``message`` on stderr, as argparse refuses a selection that checks nothing."""
    print(f"python -m diffiface.test: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
