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

from .._adapters import labels
from .._backends import Backend
from ._running import Row, backend_label, scenario_group, test_differentiation
from ._scenario import Scenario
from ._sparse_scenarios import SparseScenario

BACKENDS: dict[str, Backend] = labels()  # (from the registry, the one table of engines)
GROUPS = ("core", "layers", "torch", "sparse", "complex")

# -- what is left out, and why ------------------------------------------------------------------------
#
# scipy's adaptive differences cost one to two orders of magnitude more than any other engine
# (each call refines its step over up to 10 iterations of an order-8 formula; a Hessian
# evaluates f on n**2 points per iteration). Unbudgeted, they took most of the full run's
# row-seconds (the sparse scipy Hessians of the banded quadratics above all). They get a budget,
# below: each row left out is in the report, skipped, with its reason, and the table cites the
# reasons.

#: Tags scipy is skipped on in every run, with the reason.
_SCIPY_ALWAYS = {"piecewise": "scipy's wide first step (0.5) crosses the kinks of piecewise layers"}
#: Tags scipy is also skipped on in the full run, with the reason.
_SCIPY_FULL = {
    "float32": "scipy budget: no scipy on float32 scenarios (its float64 rows check the same functions)",
}
#: Tags scipy is also skipped on with --quick, with the reason.
_SCIPY_QUICK = {
    "second_order": "--quick's scipy budget: no scipy second order (seconds per adaptive Hessian)",
}
#: In the full run, scipy checks one torch module in this many (a fixed sample, by position).
_TORCH_SAMPLE = 5
_TORCH_REASON = (
    f"scipy budget: scipy checks 1 torch module in {_TORCH_SAMPLE} (a fixed sample; the same layers run on "
    "scipy in the layers group)"
)
#: With --quick, scipy checks one layer in this many (a fixed sample, by position).
_LAYER_SAMPLE = 3
_LAYER_REASON = f"--quick's scipy budget: scipy checks 1 layer in {_LAYER_SAMPLE} (a fixed sample)"
#: Second-order operators whose scipy rows repeat another's adaptive Hessian (the value and
#: gradient come with it): in the full run, scipy checks ``hessian``, ``hvp`` and
#: ``second_derivative`` only.
_REPEATS = (
    "value_gradient_and_hessian",
    "gradient_and_hvp",
    "gradient_and_batched_hvp",
    "value_derivative_and_second_derivative",
)
_REPEATS_REASON = (
    "scipy budget: scipy's second-order value_* variants are left out (its hessian, hvp and "
    "second_derivative rows run the same adaptive differences)"
)
#: Sparse Hessians that take scipy minutes (an adaptive Hessian per color block).
_COSTLY_SPARSE = ("banded5_quadratic", "banded10_quadratic", "banded20_quadratic")


def _sparse_budget(label: str, scenario: Scenario, quick: bool) -> str | None:
    """Why the AutoSparse row ``label`` on ``scenario`` is left out (None: it runs). On scipy,
    sparse Jacobians run with every detector (with --quick, the known pattern); sparse Hessians
    once, by ``hessian`` with the known pattern, except the banded quadratics (none with --quick).
    Every other engine runs every row."""
    if not label.startswith("sparse-scipy-"):
        return None
    known = label.startswith("sparse-scipy-known")
    if "jacobian" in scenario.tags:
        if quick and not known:
            return "--quick's scipy budget: sparse scipy Jacobians with the known pattern only"
        return None
    if quick:
        return "--quick's scipy budget: no sparse scipy Hessians (every other engine checks them)"
    if not known or scenario.operator != "hessian":
        return (
            "scipy budget: sparse scipy Hessians by hessian with the known pattern only (the detectors and "
            "value_gradient_and_hessian are checked on every other engine)"
        )
    if scenario.name in _COSTLY_SPARSE:
        return "scipy budget: no scipy on the banded quadratics' Hessians (minutes of adaptive Hessians each)"
    return None


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
    if "complex" in groups:
        from ._complex_scenarios import complex_scenarios

        chosen += complex_scenarios(dtypes=("complex128",) if quick else ("complex128", "complex64"))
    return [s for s in chosen if not operators or s.operator in operators]


def sparse_scenarios(groups: Sequence[str], quick: bool, operators: Sequence[str] | None) -> list[SparseScenario]:
    if "sparse" not in groups:
        return []
    from ._sparse_scenarios import sparse_scenarios as bundled

    return [s for s in bundled(quick=quick) if not operators or s.operator in operators]


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def skip_selector(quick: bool, scenarios: Sequence[Scenario]) -> dict[str, Iterable[str]]:
    """The scenario tags and names scipy is skipped on (see the budget above)."""
    tags = set(_SCIPY_ALWAYS) | (set(_SCIPY_QUICK) if quick else set(_SCIPY_FULL))
    sampled, every = ("layer", _LAYER_SAMPLE) if quick else ("torch_module", _TORCH_SAMPLE)
    names = dict.fromkeys(s.name for s in scenarios if sampled in s.tags)
    left_out = {name for i, name in enumerate(names) if i % every}
    if not quick:
        left_out |= {s.name for s in scenarios if s.operator in _REPEATS and "core" in s.tags}
    return {"scipy": tags | left_out}


def explain_skips(rows: list[Row], quick: bool) -> list[Row]:
    """Each row skipped on request gets the reason it was left out."""
    reasons = {**_SCIPY_ALWAYS, **(_SCIPY_QUICK if quick else _SCIPY_FULL)}
    for row in rows:
        if row.message == "skipped on request":
            found = next((reason for tag, reason in reasons.items() if tag in row.tags), None)
            sample = _LAYER_REASON if quick else _TORCH_REASON
            if found is None and row.operator in _REPEATS and not quick:
                found = _REPEATS_REASON
            row.message = found or (sample if {"layer", "torch_module"} & row.tags else row.message)
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
            skip=skip_selector(plan.quick, _WORKER["dense"]),
            raise_on_failure=False,
            on_row=on_row,
        )
        return explain_skips(report.rows, plan.quick)
    from ._sparse_scenarios import sparse_backends

    (index,) = indices
    scenario = _WORKER["sparse"][index]
    backends = sparse_backends(engines, scenario)
    reasons = {id(b): _sparse_budget(backend_label(b), scenario, plan.quick) for b in backends}
    ran = iter(
        test_differentiation(
            [b for b in backends if reasons[id(b)] is None], [scenario], raise_on_failure=False, on_row=on_row
        ).rows
    )
    rows = []
    for backend in backends:
        reason = reasons[id(backend)]
        if reason is None:
            rows.append(next(ran))
            continue
        row = Row(backend_label(backend), scenario.name, scenario.operator, "skipped", reason, tags=scenario.tags)
        if on_row is not None:
            on_row(row)
        rows.append(row)
    return rows


#: In each worker, before any engine is imported: one thread per engine, since the workers
#: already use every core (several threads per worker on a shared machine mostly wait for each
#: other). A variable the user has set is left as it is.
_ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
}


def _start_worker(events: Any) -> None:
    import os

    for name, value in _ONE_THREAD.items():
        os.environ.setdefault(name, value)
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


def run(
    plan: Plan, part_list: Sequence[Part], jobs: int, progress: Progress | None, order: Sequence[int] | None = None
) -> list[Row]:
    """Every part's rows, in plan order whatever the order they run in (``order``, by default
    the plan's); in ``jobs`` worker processes (started afresh: jax does not survive a fork) when
    there are several parts."""
    results: dict[int, list[Row]] = {}
    order = range(len(part_list)) if order is None else order
    if jobs <= 1 or len(part_list) < 2:
        _WORKER.clear()  # scenarios built afresh for each run in this process
        for number in order:
            part = part_list[number]
            results[number] = run_part(plan, part, None if progress is None else _reporter(progress, number))
            if progress is not None:
                progress.part_done(number, results[number])
        return [row for number in range(len(part_list)) for row in results[number]]
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_start_worker, initargs=(events,)
    ) as pool:
        futures = {pool.submit(_run_in_worker, plan, n, part_list[n]): n for n in order}
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


def sampling_first(part_list: Sequence[Part], scenarios: Sequence[Scenario]) -> list[int]:
    """The order to run the parts in: the first part of each group, then the rest, so that the
    progress display measures rows of each kind early (the rows are put back in plan order)."""
    firsts: dict[str, int] = {}
    for number, (kind, indices) in enumerate(part_list):
        firsts.setdefault("sparse" if kind == "sparse" else scenario_group(scenarios[indices[0]].tags), number)
    return [*firsts.values(), *(n for n in range(len(part_list)) if n not in firsts.values())]


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
