"""The ground truth of :func:`~diffiface.test.check_gradients` for complex x.

A gradient ``g`` of a real ``f`` of complex ``x`` is, in diffiface's convention,
``df/dRe x + i df/dIm x``: the one ``g`` with ``d/dt f(x + t u) = Re<g, u>`` for every complex
direction ``u``. Two checks follow from it:

- **the adjoint identity along complex directions**: ``Re<g, u>`` of every engine against a
  Richardson-extrapolated central difference of ``t -> f(x + t u)`` in complex128. A direction
  with real parts only cannot tell ``g`` from ``conj(g)`` (``Re<conj g, u> = Re<g, u>`` for real
  ``u``); with imaginary parts it can. This is what catches the classic convention bug: a
  custom rule (a ``torch.autograd.Function``, a ``jax.custom_vjp``) that returns the conjugate
  of the gradient, jax's own convention;
- **holomorphy**, where the caller asserts it (``check_gradients(..., holomorphic=True)`` of a
  complex-valued f): the Cauchy-Riemann equations ``df/dIm z = i df/dRe z`` by central
  differences along the real and the imaginary axis of each entry, and every engine's
  ``jacobian(..., holomorphic=True)`` against ``df/dRe z``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import optree

import diffiface as di

from .. import _arrays
from .. import tree as _tree
from .._complex import is_complex
from .._errors import GradientCheckError
from ._compare import assert_allclose, default_tolerances

if TYPE_CHECKING:
    from ._running import Report

__all__ = ["applies", "check_adjoint", "check_holomorphic", "complex_directions", "directional_truth"]


def applies(x: Any) -> bool:
    """Whether x holds a complex leaf."""
    return any(is_complex(leaf) for leaf in _tree.leaves(x))


def complex_directions(x: Any, count: int, seed: int = 0) -> list[list[np.ndarray]]:
    """``count`` random directions, one array per leaf of x: complex with both parts drawn
    where the leaf is complex, real where it is real (float64 or complex128)."""
    rng = np.random.default_rng(seed)
    directions = []
    for _ in range(count):
        direction = []
        for leaf in _tree.leaves(x):
            shape = _arrays.shape(leaf)
            real = rng.standard_normal(shape)
            direction.append(real + 1j * rng.standard_normal(shape) if is_complex(leaf) else real)
        directions.append(direction)
    return directions


def _wide(leaf: Any) -> np.ndarray:
    array = np.asarray(_arrays.to_numpy(leaf))
    return array.astype(np.complex128 if np.iscomplexobj(array) else np.float64)


def _back(values: np.ndarray, like: Any) -> Any:
    """``values`` as ``like``'s array type, in the wide dtype of its kind (complex128, float64)."""
    kind = _arrays.kind(like)
    if kind == "python":
        return complex(values) if isinstance(like, complex) else float(values)
    if kind == "torch":
        return sys.modules["torch"].from_numpy(np.ascontiguousarray(values)).to(like.device)
    if kind == "jax":
        return sys.modules["jax.numpy"].asarray(values)
    return values


def _scope() -> Any:
    from ._running import _float64_scope

    return _float64_scope()


def _no_grad() -> Any:
    from ._running import _no_grad as no_grad

    return no_grad()


def directional_truth(
    f: Callable[..., Any], x: Any, contexts: Sequence[Any], directions: list[list[np.ndarray]], has_aux: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``(truths, errors)``: ``d/dt f(x + t u)`` per direction, by Richardson-extrapolated central
    differences in complex128 (float64 for real leaves), and an estimate of each one's error
    (the gap between the extrapolation and the finer difference, plus rounding)."""
    leaves, spec = _tree.flatten(x)
    wide = [_wide(leaf) for leaf in leaves]
    values = tuple(c.value for c in contexts)
    scale = max([1.0] + [float(np.max(np.abs(w))) for w in wide if w.size])
    h = float(np.finfo(np.float64).eps ** (1 / 5)) * scale

    def along(direction: list[np.ndarray], t: float) -> float:
        moved = [_back(w + t * u, leaf) for w, u, leaf in zip(wide, direction, leaves, strict=True)]
        out = f(optree.tree_unflatten(spec, moved), *values)
        return float(np.real(np.asarray(_arrays.to_numpy(out[0] if has_aux else out))))

    truths, errors = [], []
    with _no_grad(), _scope():
        for u in directions:
            coarse = (along(u, h) - along(u, -h)) / (2 * h)
            fine = (along(u, h / 2) - along(u, -h / 2)) / h
            value = abs(along(u, 0.0))
            truths.append((4 * fine - coarse) / 3)
            rounding = float(np.finfo(np.float64).eps) * value / h * 4
            errors.append(abs(fine - coarse) / 3 + rounding)
    return np.array(truths), np.array(errors)


def _dot(gradient: Any, direction: list[np.ndarray]) -> float:
    """``Re<g, u>`` over the leaves."""
    return float(
        sum(
            np.real(np.vdot(_wide(g).reshape(-1), np.asarray(u).reshape(-1)))
            for g, u in zip(_tree.leaves(gradient), direction, strict=True)
        )
    )


def _conjugated(gradient: Any) -> Any:
    return _tree.map(lambda leaf: np.conj(_wide(leaf)), gradient)


def check_adjoint(
    report: Report,
    f: Callable[..., Any],
    x: Any,
    contexts: Sequence[Any],
    gradients: dict[str, Any],
    has_aux: bool = False,
    seed: int = 0,
    rtol: float | None = None,
    count: int = 4,
) -> None:
    """Rows ``<label> (complex directions)``: each engine's ``Re<g, u>`` against the directional
    truth along ``count`` random complex directions. A failing engine whose conjugate passes is
    told so: it returns ``df/dRe x - i df/dIm x``."""
    from ._running import Row

    directions = complex_directions(x, count, seed)
    truths, errors = directional_truth(f, x, contexts, directions, has_aux)
    dtypes = [_arrays.dtype_name(leaf) for leaf in _tree.leaves(x)]
    narrow = any(d in ("complex64", "float32") for d in dtypes)
    default_rtol, default_atol = default_tolerances("complex64" if narrow else "complex128")
    rtol = default_rtol if rtol is None else rtol
    for label, gradient in gradients.items():
        row = Row(
            f"{label} (complex directions)",
            "f",
            "gradient",
            "passed",
            reference="central differences along complex directions",
        )
        report.rows.append(row)
        got = np.array([_dot(gradient, u) for u in directions])
        # a direction whose difference errs by more than the gradient's norm (no unit direction
        # gives more) and a tenth of itself cannot judge: it crossed a branch cut or a jump
        norm = float(np.sqrt(sum(np.sum(np.abs(_wide(g)) ** 2) for g in _tree.leaves(gradient))))
        judged = ~(errors > np.maximum(norm, 0.1 * np.abs(truths)))
        if not np.any(judged):
            row.status = "skipped"
            row.message = (
                f"finite differences along complex directions cannot judge: their error estimate "
                f"({float(np.min(errors)):.2g} at least) exceeds the gradient's norm ({norm:.2g}), a branch cut or "
                "a jump of f near x"
            )
            continue
        truths_j, errors_j, got_j = truths[judged], errors[judged], got[judged]
        scale = float(np.max(np.abs(truths_j)))
        allowed = rtol * np.abs(truths_j) + default_atol + errors_j + rtol * scale * 1e-3
        gap = np.abs(got_j - truths_j)
        row.abs_error = float(np.max(gap))
        if np.all(gap <= allowed):
            continue
        worst = int(np.argmax(gap - allowed))
        row.status = "failed"
        row.message = (
            f"Re<gradient, u> = {got_j[worst]:.6g} but d/dt f(x + t u) = {truths_j[worst]:.6g} along a complex "
            f"direction u (error estimate {errors_j[worst]:.2g})"
        )
        conj = np.array([_dot(_conjugated(gradient), u) for u in directions])[judged]
        if np.all(np.abs(conj - truths_j) <= allowed):
            row.message += (
                ": the gradient is the conjugate of diffiface's, df/dRe x - i df/dIm x (jax's convention). A "
                "custom rule (torch.autograd.Function backward, jax.custom_vjp) that returns conj of the "
                "gradient does this; diffiface's convention is df/dRe x + i df/dIm x (docs/complex.md)."
            )


def check_holomorphic(
    f: Callable[..., Any],
    x: Any,
    contexts: Sequence[Any],
    backends: Sequence[Any],
    rtol: float | None = None,
    atol: float | None = None,
) -> Report:
    """The check of a complex-valued ``f`` asserted holomorphic at one complex array ``x``: the
    Cauchy-Riemann equations by central differences, then each backend's
    ``jacobian(f, backend, x, holomorphic=True)`` against ``df/dRe z``."""
    from ._running import Report, Row, _outcome

    report = Report()
    leaf = x
    if _arrays.kind(leaf) not in ("numpy", "torch", "jax", "python") or not is_complex(leaf):
        raise AssertionError("check_gradients(..., holomorphic=True) takes one complex array x (or a complex number)")
    wide = _wide(leaf)
    values = tuple(c.value for c in contexts)
    h = float(np.finfo(np.float64).eps ** (1 / 3)) * max(1.0, float(np.max(np.abs(wide))) if wide.size else 1.0)
    columns_re, columns_im = [], []
    outside = Row("(reference)", "f", "jacobian", "passed", reference="central differences along 1 and i")
    report.rows.append(outside)

    def at(point: np.ndarray) -> np.ndarray:
        out = f(_back(point, leaf), *values)
        return np.asarray(_arrays.to_numpy(out)).astype(np.complex128)

    with _no_grad(), _scope():
        y = at(wide)
        for k in range(wide.size):
            flat = np.zeros(wide.size, dtype=np.complex128)
            flat[k] = 1.0
            unit = flat.reshape(wide.shape)
            columns_re.append(((at(wide + h * unit) - at(wide - h * unit)) / (2 * h)).reshape(-1))
            columns_im.append(((at(wide + 1j * h * unit) - at(wide - 1j * h * unit)) / (2 * h)).reshape(-1))
    d_re = np.stack(columns_re, axis=-1) if columns_re else np.zeros((y.size, 0), dtype=np.complex128)
    d_im = np.stack(columns_im, axis=-1) if columns_im else np.zeros((y.size, 0), dtype=np.complex128)
    eps = float(np.finfo(np.float64).eps)
    noise = eps ** (2 / 3) * max(1.0, float(np.max(np.abs(y))) if y.size else 1.0) * 10
    gap = np.abs(d_im - 1j * d_re)
    if gap.size and float(np.max(gap)) > noise + 1e-6 * float(np.max(np.abs(d_re))):
        index = np.unravel_index(int(np.argmax(gap)), gap.shape)
        outside.status = "failed"
        outside.message = (
            f"f is not holomorphic at x: df/dIm z = {d_im[index]:.6g} but i df/dRe z = {1j * d_re[index]:.6g} "
            f"(entry {tuple(int(i) for i in index)}). Drop holomorphic=True: use jvp/vjp, or gradient of a real loss."
        )
    truth = d_re.reshape((*y.shape, *wide.shape))
    from ._running import backend_label

    for backend in backends:
        label = backend_label(_normalize(backend))
        row = Row(label, "f", "jacobian", "passed", reference="central differences along 1 and i")
        report.rows.append(row)
        try:
            jacobian = di.jacobian(f, backend, x, *contexts, holomorphic=True)
            got = _wide(jacobian)
            narrow = _arrays.dtype_name(leaf) == "complex64"
            tolerances = default_tolerances("complex64" if narrow else "complex128")
            assert_allclose(
                got,
                truth,
                tolerances[0] if rtol is None else rtol,
                (tolerances[1] + noise) if atol is None else atol,
                check_dtype=False,
            )
        except Exception as exc:
            row.status, row.message = _outcome(exc)
    if report.failed:
        raise GradientCheckError(report.summary(), report)
    return report


def _normalize(backend: Any) -> Any:
    from .._adapters import normalize

    return normalize(backend)
