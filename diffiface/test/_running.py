"""Running scenarios: :func:`test_differentiation` and its report."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import optree

import diffiface as di

from .. import _arrays
from .. import tree as _tree
from .._adapters import available, info, install_hint, normalize
from .._adapters._black_box import guard_constants
from .._backends import AutoJAX, AutoScipy, AutoSparse, AutoTorch, Backend, SecondOrder
from .._errors import (
    FrameworkMismatchError,
    GradientCheckError,
    MutationError,
    PreparationMismatchError,
    UnsupportedOperationError,
)
from ._compare import assert_allclose, default_tolerances, max_errors
from ._scenario import Scenario, promote, promote_contexts, shifted
from ._snapshot import changes, snapshot

__all__ = ["Report", "Row", "backend_label", "test_differentiation"]


ON_REQUEST = "skipped on request"
"""A skipped row's message where the caller's ``skip`` asked for it."""


@dataclasses.dataclass
class Row:
    """One line of a report: a backend on a scenario."""

    backend: str
    scenario: str
    operator: str
    status: str
    """passed, failed, skipped, xfailed (broken, and failing as expected), xpassed (broken, yet
    passing: reported as a failure), soft_failed."""
    message: str = ""
    abs_error: float = 0.0
    rel_error: float = 0.0
    seconds: float = 0.0
    tags: frozenset[str] = frozenset()
    reference: str = ""
    """What the row was compared with: a backend label, ``analytic``, ``cross: <label>``..."""
    warnings: tuple[str, ...] = ()
    """Warnings the engines raised during the check: shown apart, never a failure."""


@dataclasses.dataclass
class Report:
    """The rows of a run. ``str(report)`` is the table and the summary; :meth:`table` renders
    the rows grouped by backend and scenario group, :attr:`failed` lists what went wrong."""

    rows: list[Row] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.table()}\n\n{self.summary()}"

    @property
    def failed(self) -> list[Row]:
        return [row for row in self.rows if row.status in ("failed", "xpassed")]

    def counts(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for row in self.rows:
            found[row.status] = found.get(row.status, 0) + 1
        return found

    def nothing_checked(self) -> str | None:
        """Where the report has rows and every one was skipped, not all on request, why (each
        backend's distinct reasons, its install line where it is not installed); else None. A run
        that checks nothing must not pass in silence: a CI test without the backends it names
        would go green."""
        if any(row.status != "skipped" for row in self.rows) or all(row.message == ON_REQUEST for row in self.rows):
            return None
        reasons = list(dict.fromkeys(f"{row.backend}: {row.message}" for row in self.rows))
        listed = "; ".join(reasons[:8]) + ("; ..." if len(reasons) > 8 else "")
        checks = "its check was" if len(self.rows) == 1 else f"each of its {len(self.rows)} checks was"
        return f"{checks} skipped ({listed})"

    @property
    def warnings(self) -> list[str]:
        """Every distinct warning the engines raised, once, in the order first seen."""
        return list(dict.fromkeys(w for row in self.rows for w in row.warnings))

    def summary(self) -> str:
        """A readable account in sentences: how many checks passed, were skipped, failed; every
        failure with the reference it was measured against; then the engines' warnings, once each."""
        counts = self.counts()
        total = len(self.rows)
        checks = f"{total} check" + ("" if total == 1 else "s")
        others = [
            f"{counts[status]} {status}"
            for status in ("passed", "skipped", "xfailed", "soft_failed")
            if counts.get(status)
        ]
        if not self.failed:
            head = f"None of the {checks} failed" if total else "No checks ran"
            lines = [head + (f" ({', '.join(others)})." if others else ".")]
        else:
            rest = f" ({', '.join(others)})" if others else ""
            lines = [f"{len(self.failed)} of the {checks} failed{rest}; each failure, with its reference:"]
            for row in self.failed:
                against = f" against {row.reference}" if row.reference else ""
                lines.append(
                    f"- {row.backend} on {row.scenario} ({row.operator}){against}: {row.status}: {row.message}"
                )
        lines.extend(self.warnings_text())
        return "\n".join(lines)

    def warnings_text(self) -> list[str]:
        """The engines' warnings as lines, once each (empty when there were none)."""
        found = self.warnings
        if not found:
            return []
        head = (
            "The engines raised 1 distinct warning"
            if len(found) == 1
            else f"The engines raised {len(found)} distinct warnings"
        )
        return [f"{head} (never a failure):", *(f"  {w}" for w in found)]

    def grouped(self, by: Callable[[Row], str] | None = None) -> list[dict[str, Any]]:
        """One line per backend and scenario group: passed, failed, skipped, the worst relative
        error of a passed row, seconds, the references (each named once) and the skip reasons
        (each once, as a list)."""
        by = by or _group
        groups: dict[tuple[str, str], dict[str, Any]] = {}
        for row in self.rows:
            group = by(row)
            key = (_shown_backend(row.backend, group), group)
            g = groups.setdefault(
                key,
                {
                    "backend": key[0],
                    "group": key[1],
                    "passed": 0,
                    "failed": 0,
                    "skipped": 0,
                    "xfailed": 0,
                    "rel error": 0.0,
                    "seconds": 0.0,
                    "references": [],
                    "skip reasons": [],
                },
            )
            status = {"xpassed": "failed", "soft_failed": "failed"}.get(row.status, row.status)
            g[status] = g.get(status, 0) + 1
            if row.status == "passed":
                g["rel error"] = max(g["rel error"], row.rel_error)
            g["seconds"] += row.seconds
            reference = _reference_name(row.reference)
            if reference and reference not in g["references"]:
                g["references"].append(reference)
            if row.status == "skipped" and row.message not in g["skip reasons"]:
                g["skip reasons"].append(row.message)
        for g in groups.values():
            g["references"] = ", ".join(g["references"])
        return list(groups.values())

    def table(self, fmt: str = "table", lines: list[dict[str, Any]] | None = None, *, width: int = 120) -> str:
        """The grouped rows as an aligned text table of at most ``width`` columns, long cells cut
        with ``...``; each group's skipped count cites its skip reasons by number (``3 [1,2]``),
        and below the table they are listed in full, wrapped at ``width``. ``fmt="markdown"``: a
        markdown table with the reasons in full in their own column."""
        lines = self.grouped() if lines is None else lines
        if not lines:
            return "(no checks)"
        columns = [c for c in lines[0] if c != "xfailed" or any(line.get(c) for line in lines)]
        if fmt == "markdown":
            cells = [[_cell(line[c], c, "; ") for c in columns] for line in lines]
            head = "| " + " | ".join(columns) + " |"
            rule = "|" + "|".join("---" for _ in columns) + "|"
            return "\n".join([head, rule, *("| " + " | ".join(row) + " |" for row in cells)])
        # the skip reasons numbered in order of first appearance, cited in the skipped column
        reasons: list[str] = []
        cited = "skip reasons" in columns and "skipped" in columns
        if cited:
            columns.remove("skip reasons")
        cells = []
        for line in lines:
            row = [_cell(line[column], column) for column in columns]
            if cited:
                numbers = []
                for reason in (
                    line["skip reasons"] if isinstance(line["skip reasons"], list) else [line["skip reasons"]]
                ):
                    if reason and reason not in reasons:
                        reasons.append(reason)
                    if reason:
                        numbers.append(reasons.index(reason) + 1)
                i = columns.index("skipped")
                row[i] = f"{row[i]} {_cited(numbers)}".strip()
            cells.append(row)
        widths = _fit([max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)], columns, width)
        text = ["  ".join(_cut(c, w).ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
        text.append("  ".join("-" * w for w in widths))
        text.extend(
            "  ".join(_cut(cell, w).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in cells
        )
        if reasons:
            text.append("")
            text.append("skip reasons:")
            for number, reason in enumerate(reasons, 1):
                mark = f"[{number}] "
                text.extend(
                    textwrap.wrap(reason, width, initial_indent=mark, subsequent_indent=" " * len(mark)) or [mark]
                )
        return "\n".join(text)


#: The tag of each bundled list, and the group name ``python -m diffiface.test --scenarios`` takes.
_GROUPS = {"core": "core", "layer": "layers", "torch_module": "torch", "sparse": "sparse", "complex": "complex"}


def scenario_group(tags: frozenset[str]) -> str:
    """The scenario list a scenario comes from, by its tags (the name ``--scenarios`` takes),
    else its first tag."""
    for tag, group in _GROUPS.items():
        if tag in tags:
            return group
    return min(tags) if tags else ""


def _group(row: Row) -> str:
    return scenario_group(row.tags)


def _cell(value: Any, column: str = "", separator: str = ", ") -> str:
    if isinstance(value, float):
        if column == "seconds":
            return f"{value:.1f}"
        return f"{value:.2g}" if value else "0"
    if isinstance(value, list):
        return separator.join(str(v) for v in value)
    return str(value)


#: The columns a table cuts first when it is too wide, in order, and the narrowest each may get.
_CUTTABLE = {"references": 16, "skip reasons": 12, "backend": 18}


def _fit(widths: list[int], columns: list[str], width: int) -> list[int]:
    """Column widths that fit ``width`` (two spaces between columns), narrowing the cuttable
    columns, widest first, down to their minimum."""
    widths = list(widths)
    excess = sum(widths) + 2 * (len(widths) - 1) - width
    for column, narrowest in _CUTTABLE.items():
        if excess <= 0:
            break
        if column in columns:
            i = columns.index(column)
            cut = min(excess, max(widths[i] - narrowest, 0))
            widths[i] -= cut
            excess -= cut
    return widths


def _cut(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, ending in ``...`` where it was cut."""
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def _cited(numbers: list[int]) -> str:
    """Footnote numbers as ``[1-3,5,6]``."""
    if not numbers:
        return ""
    numbers = sorted(set(numbers))
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return "[" + ",".join(f"{a}-{b}" if b > a + 1 else ",".join(map(str, range(a, b + 1))) for a, b in spans) + "]"


def _reference_name(reference: str) -> str:
    """A row's reference as the table names it: the engine alone (``finite_differences (float64)``
    is finite differences run on float64 copies of a float32 scenario: the same engine)."""
    return reference.removesuffix(" (float64)")


def _shown_backend(label: str, group: str) -> str:
    """A backend as the table shows it: in the sparse group, whose rows all run AutoSparse with
    dense results, without the ``sparse-`` and ``-dense`` that every one of them would carry."""
    if group == "sparse" and label.startswith("sparse-"):
        return label.removeprefix("sparse-").removesuffix("-dense")
    return label


def backend_label(backend: Backend | str) -> str:
    """A short readable name: ``jax``, ``torch-func``, ``finite_differences-forward``..."""
    backend = normalize(backend)
    if isinstance(backend, SecondOrder):
        return f"{backend_label(backend.outer)}-over-{backend_label(backend.inner)}"
    if isinstance(backend, AutoSparse):
        detector = type(backend.detector).__name__.removesuffix("Detector").removesuffix("Pattern").lower()
        label = f"sparse-{backend_label(backend.backend)}-{detector}"
        return label + ("-dense" if backend.dense else "")
    label = backend.name
    defaults = type(backend)()
    for field in dataclasses.fields(backend):
        value = getattr(backend, field.name)
        if value != getattr(defaults, field.name):
            label += f"-{value}" if isinstance(value, str) else f"-{field.name}={value}"
    return label


# -- test_differentiation -------------------------------------------------------------------------

Selector = dict[str, Iterable[str]] | None


def test_differentiation(
    backends: Sequence[Backend | str],
    scenarios: Iterable[Scenario],
    *,
    prepared: Sequence[bool] = (False, True),
    skip: Selector = None,
    broken: Selector = None,
    soft_fail: Selector = None,
    check_mutation: bool = True,
    check_determinism: bool = True,
    check_preparation: bool = True,
    raise_on_failure: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
    on_row: Callable[[Row], None] | None = None,
) -> Report:
    """Check every backend on every scenario against its reference.

    Each backend runs each scenario unprepared and prepared (the prep made at another point
    of the same shape, so that a prep that bakes in values is caught), two calls each; the
    results must match the reference by :func:`assert_allclose`. Also checked: ``x`` and the
    contexts are not mutated, ``f`` is deterministic (else it draws from a global random
    generator), and a prep is refused for another function.

    ``skip``, ``broken`` and ``soft_fail`` map a backend label (see :func:`backend_label`) to
    scenario names or tags: skipped; expected to fail (an unexpected pass is a failure);
    failures reported but not raised.

    Each row names its reference (a backend label, ``analytic``, ``cross: <label>``); a
    float32 scenario's finite-difference reference runs on float64 copies. A backend that
    cannot run ``f`` (another framework's f; torch.func and a ``torch.autograd.Function``
    without ``setup_context``) is skipped with the reason. When automatic engines fail against
    finite differences and agree with each other, their rows say the differences may be at
    fault. Warnings raised during a check are recorded on its row, never a failure.

    ``progress(done, total, what)`` is called as each row starts; ``on_row(row)`` as each row
    is finished (before ``broken`` and ``soft_fail`` are applied to its scenario's rows).

    Returns a :class:`Report`; raises ``AssertionError`` with its summary when anything failed,
    and a :class:`~diffiface.GradientCheckError` saying why when every check was skipped (no
    backend named is installed, or none can run these scenarios), so that a test checking nothing
    does not pass (neither unless ``raise_on_failure=False``).
    """
    chosen = [normalize(b) for b in backends]
    scenarios = list(scenarios)
    report = Report()
    references: dict[Any, Any] = {}
    total = len(chosen) * len(scenarios)
    done = 0
    deterministic: dict[int, str | None] = {}
    refusal_checked: set[tuple[str, str]] = set()
    for scenario in scenarios:
        # the results of automatic engines that failed against finite differences: when they
        # agree with each other, the finite differences are the suspect
        against_differences: list[tuple[Row, Any]] = []
        for backend in chosen:
            label = backend_label(backend)
            done += 1
            if progress is not None:
                progress(done, total, f"{label} {scenario.name}")
            row = Row(label, scenario.name, scenario.operator, "passed", tags=scenario.tags)
            report.rows.append(row)
            reason = skip_reason(backend, scenario, label, skip)
            if reason:
                row.status, row.message = "skipped", reason
                if on_row is not None:
                    on_row(row)
                continue
            start = time.perf_counter()
            seen: list[Any] = []
            with _warnings_apart(row):
                try:
                    if check_determinism:
                        if id(scenario) not in deterministic:
                            deterministic[id(scenario)] = _determinism_problem(scenario)
                        if deterministic[id(scenario)]:
                            raise AssertionError(deterministic[id(scenario)])
                    reference, row.reference = _reference(scenario, backend, references)
                    for use_prep in prepared:
                        _check_backend(scenario, backend, reference, use_prep, check_mutation, row, seen)
                    if check_preparation and (label, scenario.operator) not in refusal_checked:
                        _check_refusal(scenario, backend)
                        refusal_checked.add((label, scenario.operator))
                except Exception as exc:
                    row.status, row.message = _outcome(exc)
                    if row.status == "failed" and seen and _is_difference(row.reference) and _family(backend):
                        against_differences.append((row, seen[-1]))
            row.seconds = time.perf_counter() - start
            if on_row is not None:
                on_row(row)
        _hint_differences_at_fault(scenario, against_differences)
        for row in report.rows[-len(chosen) :] if chosen else []:
            _apply_expectations(row, scenario, broken, soft_fail)
    if raise_on_failure and report.failed:
        raise AssertionError(report.summary())
    why = report.nothing_checked()
    if raise_on_failure and why:
        raise GradientCheckError(
            f"test_differentiation checked nothing: {why}. Install the backends named, or name backends that can "
            "run these scenarios.",
            report,
        )
    return report


@contextlib.contextmanager
def _warnings_apart(row: Row) -> Any:
    """Record the warnings raised inside, onto ``row``: a warning is never a failed check, even
    when the caller runs with ``-W error`` (the filter here records every warning instead)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            found = [f"{w.category.__name__}: {str(w.message).splitlines()[0][:300]}" for w in caught]
            row.warnings = tuple(dict.fromkeys([*row.warnings, *found]))


def _outcome(exc: BaseException) -> tuple[str, str]:
    """``(status, message)`` of a check that raised: skipped when the backend cannot run ``f``
    at all (f is written for another framework; torch.func refuses a classic
    ``torch.autograd.Function``), else failed."""
    message = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if isinstance(exc, (FrameworkMismatchError, UnsupportedOperationError)):
        return "skipped", f"cannot run f: {message}"
    return "failed", message


def _is_difference(reference: str) -> bool:
    return reference.startswith(("finite_differences", "scipy"))


def _hint_differences_at_fault(scenario: Scenario, failures: list[tuple[Row, Any]]) -> None:
    """Two or more automatic engines that agree with each other, not with finite differences:
    say that the finite differences may be the side at fault."""
    if len(failures) < 2:
        return
    first = failures[0][1]
    for _, other in failures[1:]:
        try:
            assert_allclose(other, _like(first, other), scenario.rtol, scenario.atol, check_dtype=False)
        except AssertionError:
            return
    engines = ", ".join(row.backend for row, _ in failures)
    for row, _ in failures:
        row.message += (
            f" [the automatic engines {engines} agree with each other but not with {row.reference}: "
            "finite differences may be the side at fault (a large or ill-conditioned f, a kink near x)]"
        )


def _matches(selector: Selector, label: str, scenario: Scenario) -> bool:
    if not selector:
        return False
    for key in (label, label.split("-")[0], "*"):
        names = selector.get(key)
        if names is not None:
            names = set(names)
            if "*" in names or scenario.name in names or names & scenario.tags:
                return True
    return False


def skip_reason(backend: Backend, scenario: Scenario, label: str, skip: Selector) -> str | None:
    """Why ``backend`` cannot check ``scenario`` before it runs, or None."""
    if not available(backend):
        return f"{label} is not installed: {install_hint(backend)}"
    if _matches(skip, label, scenario):
        return ON_REQUEST
    if isinstance(backend, AutoSparse) and _dense_scipy_hessians(backend, scenario):
        return (
            "a local Hessian pattern on scipy evaluates dense adaptive Hessians at 3 points (50 s at 30 "
            "inputs); the same engine runs here with the global and the known pattern"
        )
    family = _family(backend)
    if family is None and not scenario.finite_differences_ok:
        return f"finite differences cannot serve here: {scenario.note}"
    if family is not None and family not in scenario.frameworks:
        return f"f is written for {', '.join(sorted(scenario.frameworks))}, not {family}"
    return None


def _dense_scipy_hessians(backend: AutoSparse, scenario: Scenario) -> bool:
    from .. import sparse

    return (
        isinstance(backend.backend, AutoScipy)
        and isinstance(backend.detector, sparse.LocalDetector)
        and "hessian" in scenario.operator
    )


def _family(backend: Backend) -> str | None:
    """The framework of arrays f receives under ``backend``; None for any (black boxes)."""
    if isinstance(backend, AutoSparse):
        backend = backend.backend
    inner = backend.inner if isinstance(backend, SecondOrder) else backend
    if info(inner).any_array_type:
        return None
    # (an engine of another package: the arrays its registry row declares)
    return {"jax": "jax", "torch": "torch", "autograd": "autograd"}.get(inner.name, info(inner).arrays)


def _apply_expectations(row: Row, scenario: Scenario, broken: Selector, soft_fail: Selector) -> None:
    if _matches(broken, row.backend, scenario):
        if row.status == "failed":
            row.status = "xfailed"
        elif row.status == "passed":
            row.status, row.message = "xpassed", "marked broken, but passed: remove it from `broken`"
    elif row.status == "failed" and _matches(soft_fail, row.backend, scenario):
        row.status = "soft_failed"


def _call(scenario: Scenario, backend: Backend, prep: Any = None, **extra: Any) -> Any:
    operator = getattr(di, scenario.operator)
    kwargs: dict[str, Any] = {"prep": prep} if prep is not None else {}
    if scenario.has_aux:
        kwargs["has_aux"] = True
    return operator(scenario.f, backend, *scenario.arguments(), **kwargs, **extra)


def _check_backend(
    scenario: Scenario,
    backend: Backend,
    reference: Any,
    use_prep: bool,
    check_mutation: bool,
    row: Row,
    seen: list[Any] | None = None,
) -> None:
    taken = (
        snapshot((scenario.x, scenario.tangent, [c for c in scenario.contexts if isinstance(c, di.Constant)]))
        if check_mutation
        else []
    )
    prep = None
    if use_prep:
        prepare = getattr(di, f"prepare_{scenario.operator}")
        moved = (shifted(scenario.x),) if scenario.tangent is None else (shifted(scenario.x), scenario.tangent)
        kwargs = {"has_aux": True} if scenario.has_aux else {}
        prep = prepare(scenario.f, backend, *moved, *scenario.contexts, **kwargs)
    mode = "prepared" if use_prep else "unprepared"
    for attempt in (1, 2):
        result = _call(scenario, backend, prep)
        compared = _without_aux(scenario, result)
        if seen is not None:
            seen.append(compared)
        try:
            _mirrors(scenario, compared, reference)
            assert_allclose(compared, _like(reference, compared), scenario.rtol, scenario.atol)
        except AssertionError as exc:
            raise AssertionError(f"{mode}, call {attempt}: {exc}") from None
        abs_err, rel_err = max_errors(compared, _like(reference, compared))
        row.abs_error, row.rel_error = max(row.abs_error, abs_err), max(row.rel_error, rel_err)
    if check_mutation:
        changed = changes(taken)
        if changed:
            raise AssertionError(
                f"{mode}: the call mutated {', '.join(changed[:4])}. x and Constants must stay as they "
                "were: return new state through has_aux=True (say a BatchNorm's running statistics), "
                "and put scratch space in a di.Cache."
            )


def _check_refusal(scenario: Scenario, backend: Backend) -> None:
    prepare = getattr(di, f"prepare_{scenario.operator}")
    args = scenario.arguments()
    kwargs = {"has_aux": True} if scenario.has_aux else {}
    prep = prepare(scenario.f, backend, *args, **kwargs)

    def other(*a: Any) -> Any:
        return scenario.f(*a)

    try:
        getattr(di, scenario.operator)(other, backend, *args, prep=prep, **kwargs)
    except PreparationMismatchError:
        return
    raise AssertionError("a prep made for f was accepted for another function: preparation is not strict")


def _without_aux(scenario: Scenario, result: Any) -> Any:
    if not scenario.has_aux:
        return result
    (value, _aux), *rest = result
    return (value, *rest)


def _mirrors(scenario: Scenario, result: Any, reference: Any) -> None:
    """The result has the reference's structure (shapes and values are compared next)."""
    if _tree.structure(result) != _tree.structure(reference):
        raise AssertionError(f"result structure {_tree.structure(result)} differs from {_tree.structure(reference)}")


def _like(reference: Any, result: Any) -> Any:
    """The reference in the result's array types and dtypes, so values compare alone."""
    return _tree.map(_leaf_like, reference, result)


def _leaf_like(reference: Any, like: Any) -> Any:
    kind = _arrays.kind(like)
    if kind == "python":
        value = np.asarray(_arrays.to_numpy(reference))
        return complex(value) if np.iscomplexobj(value) else float(value)
    array = np.asarray(_arrays.to_numpy(reference))
    if kind == "numpy":
        return array.astype(like.dtype)
    if kind == "jax":
        with _float64_scope():  # a float64 result stays float64 (jax demotes outside x64)
            return _arrays.from_numpy(array, like)
    if kind == "torch":
        return _arrays.from_numpy(array, like)
    return reference


# -- references -----------------------------------------------------------------------------------


def _reference(scenario: Scenario, backend: Backend, cache: dict[Any, Any]) -> tuple[Any, str]:
    """The result ``backend`` must match on ``scenario``, and the name of where it comes from."""
    reference = scenario.reference
    if not isinstance(reference, (Backend, str)):
        return (_without_aux(scenario, reference) if scenario.has_aux else reference), "analytic"
    if reference == "cross":
        twin = _cross_twin(backend, scenario)
        key = (id(scenario), backend_label(twin))
        if key not in cache:
            cache[key] = _without_aux(scenario, _call(scenario, twin))
        return cache[key], f"cross: {backend_label(twin)}"
    reference_backend = normalize(reference)
    if reference_backend == backend and _scipy_can_judge(backend, scenario):
        # no backend checks itself: finite differences are checked against scipy's adaptive
        # differences, another ground truth (an AD engine would be no ground truth)
        reference_backend = AutoScipy()
    key = (id(scenario), backend_label(reference_backend))
    if key not in cache:
        wide = _promotes(scenario) and not _changes_in_float64(scenario, _value(scenario))
        cache[key] = (_computed_reference(scenario, reference_backend, wide), _reference_label(reference_backend, wide))
    return cache[key]  # type: ignore[no-any-return]


def _reference_label(backend: Backend, wide: bool) -> str:
    label = backend_label(backend)
    return f"{label} (float64)" if wide else label


def _promotes(scenario: Scenario) -> bool:
    """Whether the ground truth runs on float64 copies of x, tangent and contexts."""
    if "no_promote" in scenario.tags:
        return False
    if "float32" in scenario.tags:
        return True
    leaves = [*_tree.leaves(scenario.x), *_tree.leaves(scenario.tangent)]
    return any(_arrays.dtype_name(leaf) in ("float32", "float16", "bfloat16") for leaf in leaves)


def _scipy_can_judge(backend: Backend, scenario: Scenario) -> bool:
    """scipy's adaptive steps start wide (0.5): they step over the kinks of piecewise functions."""
    return not isinstance(backend, AutoScipy) and "piecewise" not in scenario.tags and available(AutoScipy())


def _computed_reference(scenario: Scenario, backend: Backend, wide: bool | None = None) -> Any:
    """The reference backend's result, in float64 when the scenario is float32 and allows it."""
    operator = getattr(di, scenario.operator)
    kwargs = {"has_aux": True} if scenario.has_aux else {}
    if wide is None:
        wide = _promotes(scenario) and not _changes_in_float64(scenario, _value(scenario))
    if wide:
        head = (promote(scenario.x),) if scenario.tangent is None else (promote(scenario.x), promote(scenario.tangent))
        with _float64_copies_scope():
            result = operator(scenario.f, backend, *head, *promote_contexts(scenario.contexts), **kwargs)
    else:
        result = _call(scenario, backend)
    return _without_aux(scenario, result)


def _cross_twin(backend: Backend, scenario: Scenario) -> Backend:
    """Another automatic-differentiation code path for the same function."""
    if isinstance(backend, AutoTorch):
        return AutoTorch(mode="func" if backend.mode == "autograd" else "autograd")
    if isinstance(backend, AutoJAX):
        return AutoJAX(jit=not backend.jit)
    for candidate in (AutoTorch(mode="func"), AutoJAX(), di.AutoAutograd(), AutoTorch()):
        if candidate != backend and available(candidate) and _family(candidate) in scenario.frameworks:
            return candidate
    raise AssertionError("no second automatic-differentiation engine is installed to cross-check with")


_WRITE = (
    "f wrote into {what}{detail}, which it must only read. The checks call f on copies, so your "
    "arrays are as they were; but no engine can differentiate such an f. Compute out of place (y = x * 2, "
    "not x *= 2 or x.mul_(2)), return new state through has_aux=True (say a BatchNorm's running "
    "statistics), and pass scratch space as di.Cache(...)."
)


def _copied(leaf: Any, deep: bool) -> Any:
    """A copy of an array leaf f may write into unseen by the caller (jax arrays cannot change);
    ``deep``: torch modules too."""
    kind = _arrays.kind(leaf)
    if isinstance(leaf, np.ndarray):
        return leaf.copy()
    if kind == "torch":
        return leaf.detach().clone().requires_grad_(leaf.requires_grad and leaf.is_leaf)
    torch = sys.modules.get("torch")
    if deep and torch is not None and isinstance(leaf, torch.nn.Module):
        try:
            return copy.deepcopy(leaf)
        except Exception:  # (a module holding what cannot be copied: its writes are still seen)
            return leaf
    return leaf


def own_call(call: Callable[[], Any], contexts: Sequence[Any]) -> Any:
    """``call()``, the checker's own evaluation of f, with the models of the Constants among
    ``contexts`` that f reaches as they are (a Keras model, an ``mlx.nn`` module, a torch module
    no copy could be made of) watched as the black-box engines watch them: a write is put back
    and refused with a :class:`MutationError`."""
    return guard_constants(call, contexts, _WHY_WATCHED)


_WHY_WATCHED = "The checker evaluates f at x and at points near it, and a write would shift those that follow."


def _twice_on_copies(f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> tuple[Any, Any]:
    """f at x twice (the determinism check), each time on fresh copies of x and of the Constants'
    values: a write lands on a copy, and is reported as a :class:`MutationError`; a model no copy
    is made of is watched (:func:`own_call`)."""
    outs = []
    for _ in range(2):
        x_copy = _tree.map(lambda leaf: _copied(leaf, deep=True), x)
        values = [
            _tree.map(lambda leaf: _copied(leaf, deep=True), c.value) if isinstance(c, di.Constant) else c.value
            for c in contexts
        ]
        taken = [("x", snapshot(x_copy))] + [
            (f"the di.Constant at position {i + 1} after x", snapshot(v))
            for i, (c, v) in enumerate(zip(contexts, values, strict=True))
            if isinstance(c, di.Constant)
        ]
        outs.append(own_call(functools.partial(f, x_copy, *values), contexts))
        for what, before in taken:
            changed = changes(before)
            if changed:
                where = [c.removeprefix("value") for c in changed[:4] if c != "value"]
                detail = f" (at {', '.join(where)})" if where else ""
                raise MutationError(_WRITE.format(what=what, detail=detail))
    return outs[0], outs[1]


def _determinism_problem(scenario: Scenario) -> str | None:
    """Two calls of f at the same input must agree. They run on copies of x and the Constants'
    values: a write into them leaves the caller's arrays as they were, and is the MutationError
    that names it (not two values that differ)."""
    try:
        first, second = _twice_on_copies(scenario.f, scenario.x, scenario.contexts)
    except MutationError:
        raise
    except Exception:
        return None
    a, b = _tree.leaves(first), _tree.leaves(second)
    for u, v in zip(a, b, strict=False):
        if _arrays.kind(u) in ("numpy", "torch", "jax", "mlx", "python"):
            x, y = np.asarray(_arrays.to_numpy(u)), np.asarray(_arrays.to_numpy(v))
            if x.shape != y.shape or not np.array_equal(x, y, equal_nan=True):
                return (
                    "f is not deterministic: two calls with the same input gave different values, so it "
                    "probably draws from a global random generator. Pass a seeded generator or key "
                    "as a di.Constant and draw from it explicitly."
                )
    return None


def _value(scenario: Scenario) -> Any:
    value = scenario.evaluate()
    return value[0] if scenario.has_aux else value


def _on_float64_copies(scenario: Scenario) -> Any:
    """f's value (its aux dropped) on float64 copies of its arguments; None where f raises there."""
    try:
        with _no_grad(), _float64_copies_scope():
            wide = scenario.f(promote(scenario.x), *(c.value for c in promote_contexts(scenario.contexts)))
    except Exception:
        return None
    return wide[0] if scenario.has_aux else wide


def _changes_in_float64(scenario: Scenario, value: Any, wide: Any = None) -> bool:
    """Whether f on float64 copies of its arguments (``wide``, that value where the caller has
    it) computes another value than f itself."""
    if wide is None:
        wide = _on_float64_copies(scenario)
    try:
        assert wide is not None
        assert_allclose(wide, _like(value, wide), *default_tolerances("float32"), check_dtype=False)
    except Exception:
        return True
    return False


def jax_widened(f: Callable[..., Any], x: Any, contexts: Sequence[Any]) -> tuple[Callable[[Any], Any], str] | None:
    """f of x (its float64 copies, under x64), with what f computes in bfloat16 or float16 (a
    cast inside, mixed precision) computed in float64: f's jaxpr, traced once on ``x`` with the
    ``contexts``' values closed over, evaluated equation by equation with every float narrower
    than float64 widened, as torch's function mode widens a torch f (:func:`_widening`). Such a
    cast otherwise rounds f at that dtype's resolution on any copies, a staircase the ground
    truth's steps read. With the function, that narrowest dtype, the precision of the engines'
    results. None where f is left as it computes: x holds no jax array, f cannot be traced, or
    computes in no half-precision float, or its jaxpr holds a primitive with inner jaxprs that
    is not a call (a loop, a branch) or a bitcast, or its value widened is not f's within the
    narrowest dtype's tolerances."""
    jax = sys.modules.get("jax")
    if jax is None or not any(isinstance(leaf, jax.Array) for leaf in _tree.leaves(x)):
        return None
    try:
        closed, shapes = jax.make_jaxpr(lambda x: f(x, *contexts), return_shape=True)(x)
    except Exception:  # (an aux of strings, a tracer leaked: f's value as it computes it)
        return None
    structure = jax.tree_util.tree_structure(shapes)
    narrowest = _narrowest(closed.jaxpr)
    if narrowest is None:
        return None
    numpy = jax.numpy

    def widened(tree: Any) -> Any:
        outs = _evaluate_widened(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(tree), numpy)
        return jax.tree_util.tree_unflatten(structure, outs)

    try:  # (a primitive that takes no wider operand: f as it computes)
        value = widened(x)
        # (widened, f computes what it computes, without its rounding: else f as it computes)
        assert_allclose(value, f(x, *contexts), *default_tolerances(narrowest), check_dtype=False)
    except Exception:
        return None
    return widened, narrowest


_WIDER = {"bfloat16": "float64", "float16": "float64", "float32": "float64", "complex64": "complex128"}
_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call"}
)
"""Primitives whose inner jaxpr is the call itself: evaluated inline, widened."""


def _inner(eqn: Any) -> list[Any]:
    """The jaxprs an equation holds in its parameters (open ones, a closed one's own)."""
    found = []
    for param in eqn.params.values():
        for value in param if isinstance(param, (tuple, list)) else (param,):
            value = getattr(value, "jaxpr", value)
            if hasattr(value, "eqns"):
                found.append(value)
    return found


def _narrowest(jaxpr: Any) -> str | None:
    """The narrowest float dtype a jaxpr computes in, where it is a half-precision one and every
    primitive with inner jaxprs in it is a call (:data:`_CALLS`) of one; else None. (A cast to
    float32 inside is left to the truth's test of f rounding as x, which needs no trace: widened,
    a float32 constant f closes over would loosen a float64 check to float32's tolerances.)"""
    found: set[str] = set()
    pending = [jaxpr]
    while pending:
        for eqn in pending.pop().eqns:
            inner = _inner(eqn)
            if inner and (eqn.primitive.name not in _CALLS or len(inner) != 1):
                return None
            if eqn.primitive.name == "bitcast_convert_type":  # (its bits are its dtype's)
                return None
            pending += inner
            found.update(str(getattr(var.aval, "dtype", "")) for var in eqn.outvars)
    return next((name for name in ("bfloat16", "float16") if name in found), None)


def _evaluate_widened(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], numpy: Any) -> list[Any]:
    def widen(value: Any) -> Any:
        wider = _WIDER.get(str(getattr(value, "dtype", "")))
        return value if wider is None else numpy.asarray(value, dtype=wider)

    def param(value: Any) -> Any:
        return numpy.dtype(_WIDER[str(value)]) if isinstance(value, np.dtype) and str(value) in _WIDER else value

    env: dict[Any, Any] = {}

    def read(var: Any) -> Any:
        return widen(var.val) if type(var).__name__ == "Literal" else env[var]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = widen(value)
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = widen(value)
    for eqn in jaxpr.eqns:
        values = [read(var) for var in eqn.invars]
        inner = _inner(eqn)
        if inner:  # a call: its jaxpr inline (a closed one's constants with it)
            closed = next(v for v in eqn.params.values() if getattr(v, "jaxpr", v) is inner[0])
            outs = _evaluate_widened(inner[0], getattr(closed, "consts", ()), values, numpy)
        elif eqn.primitive.name == "reduce_precision":  # (a rounding to fewer bits: none when widened)
            outs = values
        else:
            outs = eqn.primitive.bind(*values, **{name: param(v) for name, v in eqn.params.items()})
            outs = outs if eqn.primitive.multiple_results else [outs]
        for var, value in zip(eqn.outvars, outs, strict=True):
            if type(var).__name__ != "DropVar":
                env[var] = value
    return [read(var) for var in jaxpr.outvars]


def _float64_scope() -> Any:
    """jax's x64 for the duration (scoped, the global flag untouched), as the engines run a
    float64 computation; nothing when jax is not loaded or x64 is already on."""
    jax = sys.modules.get("jax")
    if jax is not None and not jax.config.read("jax_enable_x64"):
        return jax.enable_x64(True)
    return contextlib.nullcontext()


def _float64_copies_scope() -> Any:
    """The scope in which f runs on float64 copies of its arguments, for a narrow f's ground
    truth: jax's x64 (:func:`_float64_scope`) and, where torch is loaded, each torch operation's
    float32, float16 and bfloat16 tensors widened to float64 (complex64 to complex128) as it
    runs. The tensors f closes over (its data, a model's weights) then compute in float64 with
    the copies, as numpy and jax promote them, where torch would refuse the pair (a matmul of
    float64 and float32) or round in float32, and finite differences could not see a wrong
    entry of 1% through float32's noise. Whether f computes the same value there is checked in
    this scope too (:func:`_changes_in_float64`): where it does not, the copies are not used."""
    scope = contextlib.ExitStack()
    scope.enter_context(_float64_scope())
    torch = sys.modules.get("torch")
    if torch is not None:
        scope.enter_context(_widening(torch)())
    return scope


@functools.cache
def _widening(torch: Any) -> type:
    """The torch function mode of :func:`_float64_copies_scope`. Each tensor it widens is widened
    once per scope, so that an operation that writes into it in place writes into the copy that
    later operations read."""
    wider = {
        torch.float32: torch.float64,
        torch.float16: torch.float64,
        torch.bfloat16: torch.float64,
        torch.complex64: torch.complex128,
    }

    # (a cast to a narrow dtype by name, which no dtype argument says: to float64 instead)
    casts = {torch.Tensor.float: torch.Tensor.double, torch.Tensor.half: torch.Tensor.double}
    casts[torch.Tensor.bfloat16] = torch.Tensor.double

    class Widening(torch.overrides.TorchFunctionMode):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.widened: dict[int, tuple[Any, Any]] = {}  # id -> (the tensor, kept alive; its copy)

        def widen(self, value: Any) -> Any:
            if isinstance(value, torch.dtype):  # (a dtype f asks for: torch.zeros(3, dtype=torch.float32))
                return wider.get(value, value)
            if not isinstance(value, torch.Tensor) or value.dtype not in wider:
                return value
            found = self.widened.get(id(value))
            if found is None:
                found = self.widened[id(value)] = (value, value.to(wider[value.dtype]))
            return found[1]

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            args, kwargs = optree.tree_map(self.widen, (args, kwargs or {}), none_is_leaf=True)  # type: ignore[arg-type]
            return casts.get(func, func)(*args, **kwargs)

    return Widening


def _no_grad() -> Any:
    torch = sys.modules.get("torch")
    return torch.no_grad() if torch is not None else contextlib.nullcontext()


test_differentiation.__test__ = False  # type: ignore[attr-defined]  # a library function, not a pytest test
