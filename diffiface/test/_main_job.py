"""The main job's plan and runner: which rows ``python -m diffiface.test`` checks, what it leaves
out and why, and the run itself, in this process or in several, with a progress display that
follows every row of every worker."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import queue
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

from .._backends import AutoAutograd, AutoFiniteDifferences, AutoJAX, AutoScipy, AutoTorch, Backend
from ._running import Row, backend_label, scenario_group, test_differentiation
from ._scenario import Scenario
from ._sparse_scenarios import SparseScenario

BACKENDS: dict[str, Backend] = {
    "finite_differences": AutoFiniteDifferences(),
    "jax": AutoJAX(),
    "torch": AutoTorch(),
    "torch-func": AutoTorch(mode="func"),
    "autograd": AutoAutograd(),
    "scipy": AutoScipy(),
}
GROUPS = ("core", "layers", "torch", "sparse")

# -- what is left out, and why ------------------------------------------------------------------------
#
# scipy's adaptive differences cost one to two orders of magnitude more than any other engine
# (each call refines its step over up to 10 iterations of an order-8 formula; a Hessian
# evaluates f on n**2 points per iteration). Unbudgeted, they took about three quarters of the
# main job's row-seconds. They get a budget: the rows left out are skipped, with the reason in
# the table's skip reasons, never dropped.

#: Tags scipy is skipped on, in every run, with the reason.
_SCIPY_ALWAYS = {"piecewise": "scipy's wide first step (0.5) crosses the kinks of piecewise layers"}
#: Tags scipy is skipped on to keep the full run within its budget, with the reason.
_SCIPY_FULL = {
    "float32": "scipy budget: scipy runs on the float64 scenarios only (its float32 rows repeat them in float32)",
}
#: With --quick, also these.
_SCIPY_QUICK = {
    "second_order": "--quick's scipy budget: no scipy second order (seconds per adaptive Hessian)",
}
#: The sparse scenarios' scipy rows in the full run: one detector of three, by operator.
_SPARSE_SCIPY_FULL = (
    "scipy budget: sparse scipy runs with the known pattern only (the detectors are checked on every other engine)"
)
_SPARSE_SCIPY_QUICK = "--quick's scipy budget: no sparse scipy (the detectors are checked on every other engine)"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the main job checks: the dense scenarios (by index) on the backends, then the sparse
    scenarios (by index), each on AutoSparse of the backends with each detector."""

    groups: tuple[str, ...]
    quick: bool
    operators: tuple[str, ...] | None
    backends: tuple[str, ...]
    dense: tuple[int, ...]
    sparse: tuple[int, ...]


def dense_scenarios(groups: Sequence[str], quick: bool, operators: Sequence[str] | None) -> list[Scenario]:
    """The dense scenarios of ``groups`` (with --quick: the quick subsets in float64), of
    ``operators`` when given."""
    from . import _scenarios

    chosen: list[Scenario] = []
    dtypes = ("float64",) if quick else ("float64", "float32")
    if "core" in groups:
        chosen += _scenarios.core_scenarios(dtypes=dtypes, quick=quick)
    if "layers" in groups and _has("array_api_compat"):
        chosen += _scenarios.layer_scenarios(dtypes=dtypes, quick=quick)
    if "torch" in groups and _has("torch") and not quick:
        chosen += _scenarios.torch_module_scenarios()
    return [s for s in chosen if not operators or s.operator in operators]


def sparse_scenarios(groups: Sequence[str], quick: bool, operators: Sequence[str] | None) -> list[SparseScenario]:
    if "sparse" not in groups:
        return []
    from ._sparse_scenarios import sparse_scenarios as bundled

    return [s for s in bundled(quick=quick) if not operators or s.operator in operators]


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def skip_selector(quick: bool) -> dict[str, Iterable[str]]:
    """The scenario tags each backend label is skipped on, for test_differentiation."""
    tags = set(_SCIPY_ALWAYS) | (set(_SCIPY_QUICK) if quick else set(_SCIPY_FULL))
    return {"scipy": tags}


def sparse_skip_selector(quick: bool) -> dict[str, Iterable[str]]:
    """The sparse rows left out: on scipy, every detector but the known pattern (full run), or
    all (--quick)."""
    detectors = ("global", "local", "known") if quick else ("global", "local")
    return {f"sparse-scipy-{detector}-dense": {"*"} for detector in detectors}


def explain_skips(rows: list[Row], quick: bool) -> list[Row]:
    """Each row skipped on request gets the reason it was left out."""
    reasons = {**_SCIPY_ALWAYS, **(_SCIPY_QUICK if quick else _SCIPY_FULL)}
    for row in rows:
        if row.message != "skipped on request":
            continue
        if row.backend.startswith("sparse-"):
            row.message = _SPARSE_SCIPY_QUICK if quick else _SPARSE_SCIPY_FULL
            continue
        row.message = next((reason for tag, reason in reasons.items() if tag in row.tags), row.message)
    return rows


# -- the parts, run here or in a worker -----------------------------------------------------------------

Part = tuple[str, tuple[int, ...]]
"""``("dense", indices)`` or ``("sparse", (index,))``."""

_WORKER: dict[str, Any] = {}


def parts(plan: Plan, scenarios: Sequence[Scenario], size: int) -> list[Part]:
    """The plan cut into parts of at most ``size`` dense scenarios, each of one group and in the
    order of the run (so a group is finished as early as it can be), then one part per sparse
    scenario."""
    cut: list[Part] = []
    current: list[int] = []
    for index in plan.dense:
        if current and (
            len(current) >= size or scenario_group(scenarios[current[0]].tags) != scenario_group(scenarios[index].tags)
        ):
            cut.append(("dense", tuple(current)))
            current = []
        current.append(index)
    if current:
        cut.append(("dense", tuple(current)))
    return cut + [("sparse", (index,)) for index in plan.sparse]


def run_part(plan: Plan, part: Part, on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """The rows of one part (see :func:`parts`). The scenarios are built once per process (their
    functions do not travel between processes)."""
    key = (plan.groups, plan.quick, plan.operators)
    if _WORKER.get("key") != key:
        _WORKER.update(
            key=key,
            dense=dense_scenarios(plan.groups, plan.quick, plan.operators),
            sparse=sparse_scenarios(plan.groups, plan.quick, plan.operators),
        )
    engines = [BACKENDS[name] for name in plan.backends]
    kind, indices = part
    if kind == "dense":
        report = test_differentiation(
            engines,
            [_WORKER["dense"][i] for i in indices],
            skip=skip_selector(plan.quick),
            raise_on_failure=False,
            on_row=on_row,
        )
        return explain_skips(report.rows, plan.quick)
    from ._sparse_scenarios import sparse_backends

    (index,) = indices
    scenario = _WORKER["sparse"][index]
    report = test_differentiation(
        sparse_backends(engines, scenario),
        [scenario],
        skip=sparse_skip_selector(plan.quick),
        raise_on_failure=False,
        on_row=on_row,
    )
    return explain_skips(report.rows, plan.quick)


def _start_worker(events: Any) -> None:
    _WORKER["events"] = events


def _run_in_worker(plan: Plan, number: int, part: Part) -> list[Row]:
    events = _WORKER["events"]

    def on_row(row: Row) -> None:
        events.put((number, scenario_group(row.tags), row.backend, row.seconds, f"{row.backend} {row.scenario}"))

    return run_part(plan, part, on_row)


def planned_rows(plan: Plan, dense: Sequence[Scenario], sparse: Sequence[SparseScenario]) -> list[tuple[str, str]]:
    """``(group, backend label)`` of every row the plan will check, in order: known before the
    first row starts."""
    from ._sparse_scenarios import sparse_backends

    engines = [BACKENDS[name] for name in plan.backends]
    labels = [backend_label(engine) for engine in engines]
    rows = [(scenario_group(dense[i].tags), label) for i in plan.dense for label in labels]
    for i in plan.sparse:
        rows += [("sparse", backend_label(b)) for b in sparse_backends(engines, sparse[i])]
    return rows


def run(plan: Plan, part_list: Sequence[Part], jobs: int, progress: Progress | None) -> list[Row]:
    """Every part's rows, in the order of a run in one process; in ``jobs`` worker processes
    (started afresh: jax does not survive a fork) when there are several parts."""
    results: dict[int, list[Row]] = {}
    if jobs <= 1 or len(part_list) < 2:
        _WORKER.clear()  # scenarios built afresh for each run in this process
        for number, part in enumerate(part_list):
            results[number] = run_part(plan, part, None if progress is None else _reporter(progress, number))
            if progress is not None:
                progress.part_done(number, results[number])
        return [row for number in range(len(part_list)) for row in results[number]]
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_start_worker, initargs=(events,)
    ) as pool:
        futures = {pool.submit(_run_in_worker, plan, n, part): n for n, part in enumerate(part_list)}
        pending = set(futures)
        while pending:
            finished, pending = concurrent.futures.wait(
                pending, timeout=0.25, return_when=concurrent.futures.FIRST_COMPLETED
            )
            _drain(events, progress)
            for future in finished:
                number = futures[future]
                results[number] = future.result()
                if progress is not None:
                    progress.part_done(number, results[number])
    return [row for number in range(len(part_list)) for row in results[number]]


def _reporter(progress: Progress, number: int) -> Callable[[Row], None]:
    def on_row(row: Row) -> None:
        progress.row(number, scenario_group(row.tags), row.backend, row.seconds, f"{row.backend} {row.scenario}")

    return on_row


def _drain(events: Any, progress: Progress | None) -> None:
    while True:
        try:
            event = events.get_nowait()
        except queue.Empty:
            return
        if progress is not None:
            progress.row(*event)


# -- progress -----------------------------------------------------------------------------------------


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """What the main job shows while it runs. On a terminal: one bar over every planned row
    (sparse included), fed by every worker, with an estimate of the time left once the rows'
    measured costs can give one, and a line as each group is finished. Off a terminal: a first
    line with the plan, then one line per finished group (name, counts, elapsed)."""

    #: Before this many seconds of rows, or while more than a tenth of the rows left are of a
    #: (group, backend) not yet measured, no estimate is shown: it would be a guess.
    MIN_SECONDS = 5.0
    MAX_UNMEASURED = 0.1

    def __init__(self, stream: TextIO, planned: Sequence[tuple[str, str]], jobs: int, terminal: bool) -> None:
        self.stream, self.terminal, self.jobs = stream, terminal, jobs
        self.total = len(planned)
        self.planned: dict[tuple[str, str], int] = {}
        self.group_total: dict[str, int] = {}
        for group, label in planned:
            self.planned[(group, label)] = self.planned.get((group, label), 0) + 1
            self.group_total[group] = self.group_total.get(group, 0) + 1
        self.measured: dict[tuple[str, str], list[float]] = {}  # key: [rows, seconds]
        self.part_rows: dict[int, int] = {}
        self.finished_parts: set[int] = set()
        self.group_rows: dict[str, list[Row]] = {}
        self.start = time.perf_counter()
        self.first_row: float | None = None
        self.what = ""
        self.width = shutil.get_terminal_size((100, 20)).columns
        groups = ", ".join(f"{group} {count}" for group, count in self.group_total.items())
        self._line(f"checking {self.total} rows ({groups}) in {jobs} process{'es' if jobs > 1 else ''}")

    @property
    def done(self) -> int:
        return sum(self.part_rows.values())

    def row(self, part: int, group: str, label: str, seconds: float, what: str) -> None:
        """A row is finished (in this process or in a worker)."""
        if part in self.finished_parts:
            return  # counted already, by its part's final rows
        if self.first_row is None:
            self.first_row = time.perf_counter() - seconds
        self.part_rows[part] = self.part_rows.get(part, 0) + 1
        cost = self.measured.setdefault((group, label), [0, 0.0])
        cost[0] += 1
        cost[1] += seconds
        self.what = what
        self._draw()

    def part_done(self, part: int, rows: list[Row]) -> None:
        """A part's final rows (statuses settled): counts, and a line per group it finishes."""
        self.finished_parts.add(part)
        seen = self.part_rows.get(part, 0)
        for row in rows[seen:]:  # rows whose event has not arrived
            cost = self.measured.setdefault((scenario_group(row.tags), row.backend), [0, 0.0])
            cost[0] += 1
            cost[1] += row.seconds
        self.part_rows[part] = len(rows)
        for row in rows:
            self.group_rows.setdefault(scenario_group(row.tags), []).append(row)
        for group in {scenario_group(row.tags) for row in rows}:
            if len(self.group_rows[group]) == self.group_total.get(group, -1):
                self._group_line(group)
        self._draw()

    def eta(self) -> float | None:
        """Seconds left, from the measured cost of each (group, backend)'s rows so far and the
        rate at which row-seconds have been done; None while that would be a guess."""
        if self.first_row is None:
            return None
        spent = sum(cost[1] for cost in self.measured.values())
        elapsed = time.perf_counter() - self.first_row
        if spent < self.MIN_SECONDS or elapsed <= 0:
            return None
        left, unmeasured = 0.0, 0
        rows_left = 0
        for key, count in self.planned.items():
            rows, seconds = self.measured.get(key, [0, 0.0])
            remaining = max(count - int(rows), 0)
            rows_left += remaining
            if rows:
                left += remaining * seconds / rows
            else:
                unmeasured += remaining
        if rows_left and unmeasured > self.MAX_UNMEASURED * rows_left:
            return None
        return left * elapsed / spent

    def close(self) -> None:
        if self.terminal:
            self.stream.write("\r" + " " * (self.width - 1) + "\r")
            self.stream.flush()

    def _group_line(self, group: str) -> None:
        rows = self.group_rows[group]
        counts: dict[str, int] = {}
        for row in rows:
            counts[row.status] = counts.get(row.status, 0) + 1
        failed = sum(counts.get(s, 0) for s in ("failed", "xpassed", "soft_failed"))
        self._line(
            f"{group}: {len(rows)} rows, {counts.get('passed', 0)} passed, {failed} failed, "
            f"{counts.get('skipped', 0)} skipped; {_clock(time.perf_counter() - self.start)} elapsed"
        )

    def _line(self, text: str) -> None:
        if self.terminal:
            self.stream.write("\r" + " " * (self.width - 1) + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()
        self._draw()

    def _draw(self) -> None:
        if not self.terminal:
            return
        done, total = self.done, self.total
        filled = int(24 * done / max(total, 1))
        eta = self.eta()
        left = f"~{_clock(eta)} left" if eta is not None else "estimating"
        text = (
            f"[{'#' * filled}{'.' * (24 - filled)}] {done}/{total} {_clock(time.perf_counter() - self.start)} {left} "
        )
        room = max(self.width - 1 - len(text), 0)
        text += self.what[:room]
        self.stream.write("\r" + text.ljust(self.width - 1))
        self.stream.flush()
