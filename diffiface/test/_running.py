"""Running scenarios: :func:`test_differentiation`, :func:`check_gradients` and their report."""

from __future__ import annotations

import contextlib
import dataclasses
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
from .._backends import AutoFiniteDifferences, AutoJAX, AutoScipy, AutoSparse, AutoTorch, Backend, SecondOrder
from .._errors import FrameworkMismatchError, PreparationMismatchError, UnsupportedOperationError
from . import _on_device
from ._compare import assert_allclose, default_tolerances, max_errors
from ._scenario import Scenario, promote, promote_contexts, shifted
from ._snapshot import changes, snapshot

__all__ = ["Report", "Row", "backend_label", "check_gradients", "test_differentiation"]


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

    def table(
        self, fmt: str = "table", lines: list[dict[str, Any]] | None = None, *, width: int = 120, details: bool = False
    ) -> str:
        """The grouped rows as an aligned text table of at most ``width`` columns, long cells cut
        with ``...``; each group's skipped count cites its skip reasons by number (``3 [1,2]``),
        and below the table they are listed (each on one line, cut; ``details=True``: in full).
        ``fmt="markdown"``: a markdown table with the reasons in full in their own column."""
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
            text.append(
                "skip reasons:" + ("" if details else " (in full with --details, or per row with --format json)")
            )
            for number, reason in enumerate(reasons, 1):
                mark = f"[{number}] "
                if details:
                    text.extend(
                        textwrap.wrap(reason, width, initial_indent=mark, subsequent_indent=" " * len(mark)) or [mark]
                    )
                else:
                    text.append(_cut(mark + reason, width))
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

    Returns a :class:`Report`; raises ``AssertionError`` with its summary when anything failed
    (unless ``raise_on_failure=False``).
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
            reason = _skip_reason(backend, scenario, label, skip)
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
    message = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
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


def _skip_reason(backend: Backend, scenario: Scenario, label: str, skip: Selector) -> str | None:
    if not available(backend):
        return f"{label} is not installed: {install_hint(backend)}"
    if _matches(skip, label, scenario):
        return "skipped on request"
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
    return {"jax": "jax", "torch": "torch", "autograd": "autograd"}[inner.name]


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
        return float(np.asarray(_arrays.to_numpy(reference)))
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


def _determinism_problem(scenario: Scenario) -> str | None:
    """Two calls of f at the same input must agree."""
    try:
        first, second = scenario.evaluate(), scenario.evaluate()
    except Exception:
        return None
    a, b = _tree.leaves(first), _tree.leaves(second)
    for u, v in zip(a, b, strict=False):
        if _arrays.kind(u) in ("numpy", "torch", "jax", "python"):
            x, y = np.asarray(_arrays.to_numpy(u)), np.asarray(_arrays.to_numpy(v))
            if x.shape != y.shape or not np.array_equal(x, y, equal_nan=True):
                return (
                    "f is not deterministic: two calls with the same input gave different values, so it "
                    "probably draws from a global random generator. Pass a seeded generator or key "
                    "as a di.Constant and draw from it explicitly."
                )
    return None


# -- check_gradients ----------------------------------------------------------------------------------

_PROJECTION_THRESHOLD = 4096


def check_gradients(
    f: Callable[..., Any],
    x: Any,
    *contexts: Any,
    backends: Sequence[Backend | str] | str = "available",
    reference: Backend | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    projections: int | None = None,
    seed: int = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
) -> Report:
    """Check the gradient of ``f`` at ``x`` on every backend, in one call.

    Every requested backend (by default every installed engine that takes x's framework) is
    compared with the finite-difference ground truth and with each other; ``x`` and the
    contexts must not be mutated and ``f`` must be deterministic. A backend that cannot run
    ``f`` (written for another framework; torch.func and a ``torch.autograd.Function``
    without ``setup_context``) is reported skipped, with the reason.

    The ground truth runs in float64 whatever x's dtype (float32 leaves of x and of the
    Constant contexts are cast, the structure kept; when f computes another value in float64,
    say it draws random numbers of the default dtype, it stays at x's precision), and its own
    noise, about ``eps**(2/3) * |f(x)| * sqrt(n)`` for n inputs, is added to the default
    ``atol`` (a given ``atol`` is used as it is). For a large ``x``
    (more than 4096 numbers, or when ``projections`` is given) the comparison is on ``k``
    random directions ``u``: ``u . grad f`` against a Richardson-extrapolated central
    difference of ``t -> f(x + t u)`` in float64, which costs 4k evaluations of f instead of 2n.

    With ``has_aux=True``, ``f`` returns ``(value, aux)``: the value is differentiated and the
    aux ignored (it must be deterministic too).

    For a complex x, the gradient is ``df/dRe x + i df/dIm x`` (docs/complex.md), checked also
    along random complex directions, which tell a gradient from its conjugate (a custom rule
    returning the conjugate fails, and is told so). ``holomorphic=True`` checks a
    complex-valued ``f`` asserted holomorphic instead: the Cauchy-Riemann equations, and each
    backend's ``jacobian(..., holomorphic=True)``.

    Each row of the returned :class:`Report` names its reference. Warnings the engines raise
    are collected on the rows (:attr:`Report.warnings`), never failures. Raises
    ``AssertionError`` naming every disagreement.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> from diffiface.test import check_gradients
    >>> report = check_gradients(lambda x, c: (c * np.sin(x)).sum(), np.linspace(0, 1, 5),
    ...                          di.Constant(2.0), backends=["finite_differences"])
    >>> [(row.status, row.reference) for row in report.rows]
    [('passed', 'scipy')]
    """
    report = Report()
    automatic = backends == "available"
    chosen = _available_backends(x) if automatic else [normalize(b) for b in backends]
    if not chosen:
        raise AssertionError('no backend to check: install one (pip install "diffiface[jax]") or pass backends=...')
    from . import _complex_checks  # complex x: its own truth (the lead re-wires this after the merge)

    if holomorphic:
        return _complex_checks.check_holomorphic(f, x, contexts, chosen, rtol, atol)
    complex_x = _complex_checks.applies(x)
    operator = "value_and_gradient" if has_aux else "gradient"
    scenario = Scenario("f", f, x, operator, tuple(contexts), reference=None, has_aux=has_aux)
    outside = Row("(reference)", "f", "gradient", "passed")
    wide = any(_arrays.dtype_name(leaf) == "float64" for leaf in _tree.leaves(x))
    sharded = _sharded(x)  # DTensors: checked along random directions, collectively, nothing gathered
    with _warnings_apart(outside), _float64_scope() if wide else contextlib.nullcontext():
        problem = _sharded_determinism_problem(scenario) if sharded else _determinism_problem(scenario)
        if problem:
            raise AssertionError(problem)
        value = f(x, *scenario.context_values)
        value = value[0] if has_aux else value
    size = sum(int(np.prod(_arrays.shape(leaf))) for leaf in _tree.leaves(x))
    noise = _difference_noise(_sharded_scalar(value) if sharded else value, size)
    k = projections if projections is not None else (8 if size > _PROJECTION_THRESHOLD or sharded else 0)
    k = 0 if complex_x else k  # (complex x: its directions below)
    rng = np.random.default_rng(seed)
    placed = bool(k) and not sharded and _on_device.applies(x)  # jax arrays on devices of their own: kept there
    directions: list[Any]
    if sharded:
        directions = [_sharded_direction(x, seed, i) for i in range(k)]
    elif placed:
        directions = list(_on_device.random_directions(x, k, seed))
    else:
        directions = [_random_direction(x, rng) for _ in range(k)]
    projected: dict[str, np.ndarray] = {}
    estimate: float | None = None
    with _warnings_apart(outside):
        if k and sharded:
            truth = _sharded_projected_truth(f, x, contexts, directions, has_aux)
            truth_label = "central differences along random directions (float64, collective)"
        elif k:
            truth = (
                np.array(_on_device.projected_truth(f, x, tuple(contexts), directions, has_aux), dtype=np.float64)
                if placed
                else _projected_truth(f, x, contexts, directions, has_aux)
            )
            truth_label = "central differences along random directions (float64)"
        else:
            reference_backend = normalize(reference) if reference is not None else AutoFiniteDifferences()
            if isinstance(reference_backend, AutoFiniteDifferences) and reference_backend in chosen:
                # no backend checks itself: scipy's adaptive differences judge finite differences
                reference_backend = AutoScipy() if available(AutoScipy()) else reference_backend
            truth_scenario = dataclasses.replace(scenario, reference=reference_backend)
            wide = _promotes(truth_scenario) and not _changes_in_float64(truth_scenario, value)
            truth_scenario = dataclasses.replace(truth_scenario, tags=frozenset(() if wide else {"no_promote"}))
            truth, estimate = _reference_with_estimate(truth_scenario, reference_backend)
            truth_label = _reference_label(reference_backend, wide)
    gradients: dict[str, Any] = {}
    against_truth: dict[str, float] = {}
    for backend in chosen:
        label = backend_label(backend)
        row = Row(label, "f", "gradient", "passed", reference=truth_label, warnings=outside.warnings)
        report.rows.append(row)
        if not available(backend):
            row.status, row.message = "skipped", f"not installed: {install_hint(backend)}"
            continue
        constants = [c for c in contexts if isinstance(c, di.Constant)]
        taken = snapshot(_local_views((x, [c.value for c in constants])) if sharded else (x, constants))
        start = time.perf_counter()
        with _warnings_apart(row):
            try:
                if has_aux:
                    (_, _aux), gradient = di.value_and_gradient(f, backend, x, *contexts, has_aux=True)
                else:
                    gradient = di.gradient(f, backend, x, *contexts)
                row.seconds = time.perf_counter() - start
                changed = changes(taken)
                if changed:
                    raise AssertionError(f"the call mutated {', '.join(changed[:4])}")
                gradients[label] = gradient
                if k:
                    dot: Callable[[Any, Any], float] = _sharded_dot if sharded else _on_device.dot if placed else _dot
                    got = projected[label] = np.array([dot(gradient, u) for u in directions])
                    _close_projections(got, truth, rtol, atol, noise, row)
                else:
                    tolerance = _with_noise(atol, x, noise if _is_difference(truth_label) else 0.0)
                    row.abs_error, row.rel_error = max_errors(gradient, _like(truth, gradient))
                    try:
                        assert_allclose(gradient, _like(truth, gradient), rtol, tolerance)
                    except AssertionError:
                        against_truth[label] = row.abs_error
                        raise
            except Exception as exc:
                row.status, row.message = _outcome(exc)
                if k and row.status == "failed" and label in gradients:
                    against_truth[label] = row.abs_error
    if complex_x:
        _complex_checks.check_adjoint(report, f, x, contexts, gradients, has_aux, seed, rtol)
    labels = list(gradients)
    disagreements: set[str] = set()
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            row = Row(f"{a} vs {b}", "f", "gradient", "passed", reference=b)
            report.rows.append(row)
            try:
                if sharded:  # their projections: nothing but scalars leaves a rank
                    _close_projections(projected[a], projected[b], rtol, atol, 0.0, row)
                else:
                    assert_allclose(gradients[a], _like(gradients[b], gradients[a]), rtol, atol, check_dtype=False)
            except AssertionError as exc:
                row.status, row.message = "failed", str(exc)
                disagreements.update((a, b))
    _hint_truth_at_fault(report, against_truth, disagreements, noise, estimate)
    if report.failed:
        raise AssertionError(report.summary())
    return report


def _value(scenario: Scenario) -> Any:
    value = scenario.evaluate()
    return value[0] if scenario.has_aux else value


def _changes_in_float64(scenario: Scenario, value: Any) -> bool:
    """Whether f on float64 copies of its arguments computes another value than f itself."""
    try:
        with _no_grad(), _float64_scope():
            wide = scenario.f(promote(scenario.x), *(c.value for c in promote_contexts(scenario.contexts)))
        wide = wide[0] if scenario.has_aux else wide
        assert_allclose(wide, _like(value, wide), *default_tolerances("float32"), check_dtype=False)
    except Exception:
        return True
    return False


def _reference_with_estimate(scenario: Scenario, backend: Backend) -> tuple[Any, float | None]:
    """The ground truth (value dropped when f has an aux), and scipy's own error estimate when
    scipy computes it."""
    if not isinstance(backend, AutoScipy):
        result = _computed_reference(scenario, backend, _promotes(scenario))
        return (result[1] if scenario.has_aux else result), None
    head = (promote(scenario.x),) if _promotes(scenario) else (scenario.x,)
    contexts = promote_contexts(scenario.contexts) if _promotes(scenario) else scenario.contexts
    kwargs = {"has_aux": True} if scenario.has_aux else {}
    prep = getattr(di, f"prepare_{scenario.operator}")(scenario.f, backend, *head, *contexts, **kwargs)
    result = getattr(di, scenario.operator)(scenario.f, backend, *head, *contexts, prep=prep, **kwargs)
    error = prep.error
    gradient_error = error[1] if scenario.has_aux and isinstance(error, tuple) else error
    leaves = [np.asarray(_arrays.to_numpy(e), dtype=np.float64) for e in _tree.leaves(gradient_error)]
    estimate = max((float(np.max(e)) for e in leaves if e.size), default=None)
    return (result[1] if scenario.has_aux else result), estimate


def _difference_noise(value: Any, size: int) -> float:
    """The rounding noise of a float64 central difference of ``f``: each evaluation of f errs by
    about ``eps * |f| * sqrt(n)`` (n, the number of inputs, stands for the number of terms a
    loss sums), divided by a step of ``eps**(1/3)`` at least."""
    values = [np.asarray(_arrays.to_numpy(v), dtype=np.float64) for v in _tree.leaves(value)]
    magnitude = max((float(np.max(np.abs(v))) for v in values if v.size), default=0.0)
    if not np.isfinite(magnitude):
        return 0.0
    eps = float(np.finfo(np.float64).eps)
    return float(eps ** (2 / 3) * magnitude * np.sqrt(max(size, 1)))


def _with_noise(atol: float | None, x: Any, noise: float) -> float | None:
    """A given ``atol`` as it is; by default, the widest dtype default of x plus the noise."""
    if atol is not None or not noise:
        return atol
    return max((default_tolerances(_arrays.dtype_name(leaf))[1] for leaf in _tree.leaves(x)), default=0.0) + noise


def _hint_truth_at_fault(
    report: Report, against_truth: dict[str, float], disagreements: set[str], noise: float, estimate: float | None
) -> None:
    """Say when finite differences may be the side at fault: the engines that failed against
    them agree with each other, or the error is within the differences' own error."""
    failed = [row for row in report.rows if row.backend in against_truth and row.status == "failed"]
    if not failed:
        return
    own = f"scipy's error estimate is {estimate:.3g}" if estimate is not None else f"their noise is about {noise:.3g}"
    agreeing = len(failed) >= 2 and not (disagreements & set(against_truth))
    for row in failed:
        if agreeing:
            names = ", ".join(r.backend for r in failed)
            row.message += (
                f" [the automatic engines {names} agree with each other but not with {row.reference}: "
                f"finite differences may be the side at fault ({own}; a large or ill-conditioned f, a kink near x)]"
            )
        elif against_truth[row.backend] <= 10 * max(noise, estimate or 0.0):
            row.message += (
                f" [the error is within ten times the finite differences' own error ({own}): "
                "they may be the side at fault]"
            )


def _available_backends(x: Any) -> list[Backend]:
    kinds = {_arrays.kind(leaf) for leaf in _tree.leaves(x)}
    family = _arrays.family(kinds)
    by_family: dict[str, list[Backend]] = {"torch": [AutoTorch(), AutoTorch(mode="func")], "jax": [AutoJAX()]}
    candidates = by_family.get(family, [AutoJAX(), AutoTorch(), AutoTorch(mode="func"), di.AutoAutograd()])
    return [b for b in candidates if available(b)]


def _random_direction(x: Any, rng: np.random.Generator) -> list[np.ndarray]:
    leaves = _tree.leaves(x)
    parts = [rng.standard_normal(_arrays.shape(leaf)) for leaf in leaves]
    norm = np.sqrt(sum(float(np.sum(p * p)) for p in parts)) or 1.0
    return [p / norm for p in parts]


def _dot(gradient: Any, direction: list[np.ndarray]) -> float:
    leaves = _tree.leaves(gradient)
    return float(
        sum(
            np.sum(np.asarray(_arrays.to_numpy(g), dtype=np.float64) * u)
            for g, u in zip(leaves, direction, strict=True)
        )
    )


def _projected_truth(
    f: Callable[..., Any],
    x: Any,
    contexts: tuple[Any, ...],
    directions: list[list[np.ndarray]],
    has_aux: bool = False,
) -> np.ndarray:
    """``u . grad f`` by Richardson-extrapolated central differences of ``t -> f(x + t u)``,
    in float64: x and the Constant contexts cast (their structure and array types kept), and
    f evaluated under the scope the engines use for float64 (jax's x64, scoped)."""
    leaves, spec = _tree.flatten(promote(x))
    values = tuple(c.value for c in promote_contexts(tuple(contexts)))
    scale = max(
        [1.0] + [float(np.max(np.abs(_arrays.to_numpy(leaf)))) for leaf in leaves if np.size(_arrays.to_numpy(leaf))]
    )
    h = float(np.finfo(np.float64).eps ** (1 / 5)) * scale

    def along(direction: list[np.ndarray], t: float) -> float:
        moved = [
            _arrays.from_numpy(np.asarray(_arrays.to_numpy(leaf), dtype=np.float64) + t * u, leaf)
            for leaf, u in zip(leaves, direction, strict=True)
        ]
        out = f(optree.tree_unflatten(spec, moved), *values)
        return float(np.asarray(_arrays.to_numpy(out[0] if has_aux else out), dtype=np.float64))

    def central(u: list[np.ndarray], step: float) -> float:
        return (along(u, step) - along(u, -step)) / (2 * step)

    with _no_grad(), _float64_scope():
        # Richardson: the O(h^2) terms of two central differences cancel
        return np.array([(4 * central(u, h / 2) - central(u, h)) / 3 for u in directions])


def _float64_scope() -> Any:
    """jax's x64 for the duration (scoped, the global flag untouched), as the engines run a
    float64 computation; nothing when jax is not loaded or x64 is already on."""
    jax = sys.modules.get("jax")
    if jax is not None and not jax.config.read("jax_enable_x64"):
        return jax.enable_x64(True)
    return contextlib.nullcontext()


def _close_projections(
    got: np.ndarray, truth: Any, rtol: float | None, atol: float | None, noise: float, row: Row
) -> None:
    rtol = 1e-4 if rtol is None else rtol
    atol = 1e-6 + noise if atol is None else atol
    scale = max(1.0, float(np.max(np.abs(truth))))
    err = np.abs(got - truth)
    row.abs_error = float(np.max(err)) if err.size else 0.0
    row.rel_error = row.abs_error / scale
    if np.any(err > atol + rtol * scale):
        i = int(np.argmax(err))
        raise AssertionError(
            f"projection {i}: u . grad f = {got[i]:.8g}, finite differences give {truth[i]:.8g} "
            f"(abs error {err[i]:.3g}, rtol {rtol:g}, atol {atol:g})"
        )


# -- DTensors (torch.distributed.tensor): every rank runs check_gradients; scalars are all it shares --


def _dtensor_class() -> Any:
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _sharded(x: Any) -> bool:
    """Whether a leaf of ``x`` is a DTensor."""
    kind = _dtensor_class()
    return kind is not None and any(isinstance(leaf, kind) for leaf in _tree.leaves(x))


def _sharded_scalar(value: Any) -> float:
    """A scalar as a float, the same on every rank: a DTensor's (partial or replicated) by one
    scalar all-reduce."""
    if isinstance(value, _dtensor_class()):
        if value.numel() != 1:
            raise AssertionError(f"f must return a scalar; it returned a DTensor of shape {tuple(value.shape)}")
        replicate = sys.modules["torch.distributed.tensor"].Replicate()
        value = value.redistribute(value.device_mesh, [replicate] * value.device_mesh.ndim).to_local()
    return float(np.asarray(_arrays.to_numpy(value), dtype=np.float64))


def _local_views(tree: Any) -> Any:
    """DTensor leaves as this rank's slices (views: a write into x shows), for the snapshot."""
    kind = _dtensor_class()
    return _tree.map(lambda leaf: leaf.to_local() if isinstance(leaf, kind) else leaf, tree)


def _sharded_determinism_problem(scenario: Scenario) -> str | None:
    first, second = _sharded_scalar(_value(scenario)), _sharded_scalar(_value(scenario))
    if first == second or (np.isnan(first) and np.isnan(second)):
        return None
    return (
        "f is not deterministic: two calls with the same input gave different values, so it probably draws "
        "from a global random generator. Pass a seeded generator as a di.Constant and draw from it explicitly."
    )


def _sharded_direction(x: Any, seed: int, index: int) -> list[Any]:
    """A random unit direction with x's structure: float64 DTensors on each leaf's mesh with its
    placements (partial ones drawn replicated), plain tensors for plain leaves. Each rank draws
    only its own slice, from a generator seeded by ``seed``, the direction's index, the leaf and
    the rank's coordinates along the sharded mesh dimensions: ranks holding the same slice draw
    the same numbers, on every run."""
    torch = sys.modules["torch"]
    tensor_module = sys.modules["torch.distributed.tensor"]
    kind = _dtensor_class()
    parts = []
    for i, leaf in enumerate(_tree.leaves(x)):
        if not isinstance(leaf, kind):
            key = [seed, index, i]
            generator = torch.Generator().manual_seed(int(np.random.SeedSequence(key).generate_state(1)[0]))
            parts.append(torch.randn(tuple(leaf.shape), generator=generator, dtype=torch.float64).to(leaf.device))
            continue
        mesh, placements = leaf.device_mesh, leaf.placements
        coordinate = mesh.get_coordinate() or []
        sharded = [c for c, p in zip(coordinate, placements, strict=True) if p.is_shard()]
        key = [seed, index, i, *sharded]
        generator = torch.Generator().manual_seed(int(np.random.SeedSequence(key).generate_state(1)[0]))
        local = torch.randn(tuple(leaf.to_local().shape), generator=generator, dtype=torch.float64)
        placed = [tensor_module.Replicate() if p.is_partial() else p for p in placements]
        parts.append(
            kind.from_local(
                local.to(leaf.device), mesh, placed, run_check=False, shape=leaf.shape, stride=leaf.stride()
            )
        )
    norm = float(np.sqrt(sum(_sharded_scalar((p * p).sum()) for p in parts))) or 1.0
    return [p / norm for p in parts]


def _sharded_dot(gradient: Any, direction: list[Any]) -> float:
    """``u . grad`` in float64, per leaf a local product and one scalar all-reduce."""
    leaves = _tree.leaves(gradient)
    return sum(
        (_sharded_scalar((g.double() * u).sum()) for g, u in zip(leaves, direction, strict=True)),
        0.0,
    )


def _sharded_projected_truth(
    f: Callable[..., Any],
    x: Any,
    contexts: tuple[Any, ...],
    directions: list[list[Any]],
    has_aux: bool = False,
) -> np.ndarray:
    """:func:`_projected_truth` on DTensors: the points ``x + t u`` are DTensor arithmetic, on
    each rank's slices; f's values and the largest ``|x_i|`` are the only numbers shared."""
    from .._adapters._black_box import _largest

    leaves, spec = _tree.flatten(promote(x))
    values = tuple(c.value for c in promote_contexts(tuple(contexts)))
    scale = max([1.0, *(_largest(leaf) for leaf in leaves)])
    h = float(np.finfo(np.float64).eps ** (1 / 5)) * scale

    def along(direction: list[Any], t: float) -> float:
        moved = [leaf.double() + t * u for leaf, u in zip(leaves, direction, strict=True)]
        out = f(optree.tree_unflatten(spec, moved), *values)
        return _sharded_scalar(out[0] if has_aux else out)

    def central(u: list[Any], step: float) -> float:
        return (along(u, step) - along(u, -step)) / (2 * step)

    with _no_grad():
        return np.array([(4 * central(u, h / 2) - central(u, h)) / 3 for u in directions])


def _no_grad() -> Any:
    torch = sys.modules.get("torch")
    return torch.no_grad() if torch is not None else contextlib.nullcontext()


test_differentiation.__test__ = False  # type: ignore[attr-defined]  # a library function, not a pytest test
