"""check_gradients: a layer author's one call, and its ground truth."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optree

import diffiface as di

from .. import _arrays
from .. import tree as _tree
from .._adapters import available, install_hint, normalize
from .._backends import AutoFiniteDifferences, AutoJAX, AutoScipy, AutoTorch, Backend
from . import _on_device
from ._compare import assert_allclose, default_tolerances, max_errors
from ._running import (
    Report,
    Row,
    _changes_in_float64,
    _computed_reference,
    _determinism_problem,
    _float64_scope,
    _is_difference,
    _like,
    _no_grad,
    _outcome,
    _promotes,
    _reference_label,
    _value,
    _warnings_apart,
    backend_label,
)
from ._scenario import Scenario, promote, promote_contexts
from ._snapshot import changes, snapshot

__all__ = ["check_gradients"]


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
    from .._adapters.finite_differences import _largest

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
