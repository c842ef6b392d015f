"""scipy: the adaptive finite differences of ``scipy.differentiate`` (``jacobian``, ``hessian``).

scipy refines each derivative until its own error estimate meets the tolerances; the
estimate of the last call, shaped as the result, is read through ``prep.error``. numpy inputs
in float32, arrays and scalars, are evaluated in float64 (adaptive steps need its precision;
results come back in float32). scipy calls
``f`` on batches of points (a trailing axis); diffiface evaluates the user's ``f`` point by
point, each point as leaves of x's own kinds, so ``f`` needs no vectorising.

Like finite differences, ``f`` gets fresh points, numpy ones read-only and torch ones watched
(see :mod:`.finite_differences`), never the caller's arrays. ``jvp`` and ``hvp`` take one
directional derivative (of ``f``, of scipy's gradient) along the tangent, so their cost
grows with the size of x, not its square. Sizes are bounded by :data:`MAX_INPUTS` and
:data:`MAX_SECOND_ORDER_INPUTS` (or the backend's ``max_inputs``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import scipy.differentiate

from .. import _arrays
from ._base import Blocks, Fn, Leaves
from ._black_box import (
    BlackBoxAdapter,
    _blocks,
    _fit,
    _flatten_out,
    _hessian_blocks,
    _Layout,
    _Point,
    _split,
    _split_out,
    _times_non_finite,
    check_size,
    run_f,
)

MAX_INPUTS = 1_000
"""The most inputs (entries of x) for scipy's Jacobians and gradients: each iteration
evaluates f at about ``order * n`` points and holds ``n²`` of them."""
MAX_SECOND_ORDER_INPUTS = 100
"""The most inputs for scipy's Hessians (about ``order² * n²`` evaluations per iteration)."""

_NAME = "scipy"


class Adapter(BlackBoxAdapter):
    xp = np
    estimates_errors = True

    def __init__(self, backend: Any, info: Any) -> None:
        super().__init__(backend, info)
        self._options = {
            "order": backend.order,
            "initial_step": backend.initial_step,
            "step_factor": backend.step_factor,
            "maxiter": backend.maxiter,
        }
        tolerances = {k: v for k, v in (("atol", backend.atol), ("rtol", backend.rtol)) if v is not None}
        if tolerances:
            self._options["tolerances"] = tolerances
        self._local = threading.local()

    def take_error(self) -> Any:
        error = getattr(self._local, "error", None)
        self._local.error = None
        return error

    # -- evaluating f on scipy's batches ---------------------------------------------------------

    def _flat(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, np.ndarray, _Layout, Any, _Point]:
        """f(x) at a fresh copy of x (x's own kinds and dtypes), and f on scipy's batches at
        the (float64) promoted point; every output must keep the shapes of f(x)."""
        own = _Point(xs)
        out, aux = run_f(fn, own.leaves(own.vector), _NAME)
        flat, layout = _flatten_out(out)
        point = _Point(xs, promote=True)

        def batched(v: np.ndarray) -> np.ndarray:
            columns = v.reshape(point.size, -1)
            values = []
            for k in range(columns.shape[1]):
                value, found = _flatten_out(run_f(fn, point.leaves(columns[:, k]), _NAME)[0])
                _fit(layout, found)
                values.append(value)
            return np.stack(values, axis=-1).astype(np.float64).reshape((flat.size, *v.shape[1:]))

        return out, aux, flat, layout, batched, point

    def _check(self, xs: Leaves, operator: str, second: bool = False) -> None:
        if second:
            check_size(
                self.backend, xs, operator, MAX_SECOND_ORDER_INPUTS, "scipy's Hessian evaluates f about order² n² times"
            )
        else:
            check_size(
                self.backend,
                xs,
                operator,
                MAX_INPUTS,
                "scipy's Jacobian evaluates f at about order n points per iteration",
            )

    def _jacobian(
        self, fn: Fn, xs: Leaves, operator: str = "A Jacobian"
    ) -> tuple[Any, Any, np.ndarray, np.ndarray, _Point, _Layout]:
        self._check(xs, operator)
        out, aux, flat, layout, batched, point = self._flat(fn, xs)
        if point.size == 0 or flat.size == 0:
            zeros = np.zeros((flat.size, point.size))
            return out, aux, zeros, zeros, point, layout
        result = scipy.differentiate.jacobian(batched, point.vector, **self._options)
        return (
            out,
            aux,
            np.asarray(result.df).reshape(flat.size, point.size),
            np.asarray(result.error).reshape(flat.size, point.size),
            point,
            layout,
        )

    # -- first order --------------------------------------------------------------------------------

    def value_and_jacobian(self, fn: Fn, xs: Leaves, mode: str | None = None) -> tuple[Any, Any, Blocks]:
        out, aux, jac, err, point, layout = self._jacobian(fn, xs)
        self._local.error = (_zeros_like(out), None, _blocks(err, layout, point))
        return out, aux, _blocks(jac, layout, point)

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        out, aux, jac, err, point, _ = self._jacobian(fn, xs, "A gradient")
        self._local.error = (_zeros_like(out), None, _split(err[0], point))
        return out, aux, _split(jac[0], point)

    def value_and_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any]:
        out, aux, jac, err, _, layout = self._jacobian(fn, xs)
        self._local.error = (_zeros_like(out), None, _split_out(err[:, 0], layout))
        return out, aux, _split_out(jac[:, 0], layout)

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        out, aux, flat, layout, batched, point = self._flat(fn, xs)
        t = _Point(txs).vector if txs else np.zeros(0)

        def along(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            # d/ds f(x + s u) at 0: scipy's adaptive steps and error estimate, at the cost of one input, not n
            def g(s: np.ndarray) -> np.ndarray:
                shifts = s.reshape(-1)
                return batched(point.vector[:, None] + u[:, None] * shifts[None, :]).reshape((flat.size, *s.shape[1:]))  # type: ignore[no-any-return]

            return _directional(g, flat.size, self._options)

        column, error = _linear_in(along, t, flat.size)
        touts = _split_out(column, layout)
        self._local.error = (_zeros_like(out), None, _split_out(error, layout))
        return out, aux, touts if layout.tuple_out else touts[0]

    def value_and_pushforwards(self, fn: Fn, xs: Leaves, batch: Any) -> tuple[Any, Any, list[Any]]:
        """One directional derivative per tangent, and the error estimate of each."""
        touts, errors = [], []
        out = aux = None
        for txs in batch:
            out, aux, tout = self.value_and_pushforward(fn, xs, txs)
            touts.append(tout)
            errors.append(self._local.error[2])
        if out is None:  # an empty batch: evaluate once for the value
            out, aux = fn(xs)
        self._local.error = (_zeros_like(out), None, errors)
        return out, aux, touts

    def value_and_pullback(self, fn: Fn, xs: Leaves, touts: Any) -> tuple[Any, Any, Leaves]:
        out, aux, jac, err, point, _ = self._jacobian(fn, xs, "A vjp (through the whole Jacobian)")
        t = _flat_tangent(touts)
        self._local.error = (_zeros_like(out), None, _split(np.abs(t) @ err, point))
        return out, aux, _split(t @ jac, point)

    def pullback_function(self, fn: Fn, xs: Leaves) -> Any:
        out, aux, jac, _, point, _ = self._jacobian(fn, xs, "A vjp (through the whole Jacobian)")
        return out, aux, lambda touts: _split(_flat_tangent(touts) @ jac, point)

    # -- second order ---------------------------------------------------------------------------

    def _hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, np.ndarray, np.ndarray, _Point]:
        self._check(xs, "A Hessian", second=True)
        out, aux, _, _, batched, point = self._flat(fn, xs)
        n = point.size
        if n == 0:
            return out, aux, np.zeros((0, 0)), np.zeros((0, 0)), point
        result = scipy.differentiate.hessian(lambda v: batched(v)[0], point.vector, **self._options)
        return out, aux, np.asarray(result.ddf).reshape(n, n), np.asarray(result.error).reshape(n, n), point

    def value_gradient_and_hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves, Blocks]:
        out, aux, hess, hess_err, point = self._hessian(fn, xs)
        _, _, grads = self.value_and_gradient(fn, xs)
        grad_err = self._local.error[2]
        self._local.error = (_zeros_like(out), None, grad_err, _hessian_blocks(hess_err, point, []))
        return out, aux, grads, _hessian_blocks(hess, point, [])

    def gradient_and_hvp(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Leaves, Leaves]:
        out, aux, grads, (hv,) = self.gradient_and_hvps(fn, xs, (txs,))
        value_err, _, grad_err, (error,) = self._local.error
        self._local.error = (value_err, None, grad_err, error)
        return out, aux, grads, hv

    def gradient_and_hvps(self, fn: Fn, xs: Leaves, batch: Any) -> tuple[Any, Any, Leaves, list[Leaves]]:
        """The gradient once, then one adaptive directional derivative of it per tangent, each
        with its error estimate."""
        out, aux, grads = self.value_and_gradient(fn, xs)  # checks the size against MAX_INPUTS
        grad_err = self._local.error[2]
        _, _, _, _, batched, point = self._flat(fn, xs)

        def gradient(y: np.ndarray) -> np.ndarray:
            return np.asarray(scipy.differentiate.jacobian(lambda w: batched(w)[0], y, **self._options).df)  # type: ignore[no-any-return]

        def along(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            # d/ds grad f(x + s u) at 0, each gradient by scipy's adaptive jacobian: linear in
            # the size of x, where the whole Hessian would be quadratic
            def g(s: np.ndarray) -> np.ndarray:
                grads_along = [gradient(point.vector + shift * u) for shift in s.reshape(-1)]
                return np.stack(grads_along, axis=-1).reshape((point.size, *s.shape[1:]))

            return _directional(g, point.size, self._options)

        hvps, errors = [], []
        for txs in batch:
            hv, error = _linear_in(along, _Point(txs).vector if txs else np.zeros(0), point.size)
            hvps.append(_split(hv, point))
            errors.append(_split(error, point))
        self._local.error = (_zeros_like(out), None, grad_err, errors)
        return out, aux, grads, hvps

    def value_derivative_and_second_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
        self._check(xs, "A second derivative", second=True)
        out, aux, flat, layout, batched, point = self._flat(fn, xs)
        _, _, derivs = self.value_and_derivative(fn, xs)
        deriv_err = self._local.error[2]
        seconds, errors = np.zeros(flat.size), np.zeros(flat.size)
        for k in range(flat.size):
            result = scipy.differentiate.hessian(lambda v, k=k: batched(v)[k], point.vector, **self._options)
            seconds[k], errors[k] = np.asarray(result.ddf).reshape(-1)[0], np.asarray(result.error).reshape(-1)[0]
        self._local.error = (_zeros_like(out), None, deriv_err, _split_out(errors, layout))
        return out, aux, derivs, _split_out(seconds, layout)


def _directional(g: Any, size: int, options: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``d/ds g(s)`` at 0 for ``g: R -> R^size`` (on a batch of ``s``) by scipy's adaptive
    differences, and its error estimate. An output that took one value at every point scipy
    evaluated has derivative exactly 0 (scipy's weighted sum of equal values leaves rounding,
    which an infinite tangent would turn into inf), as forward mode gives it."""
    low = np.full(size, np.inf)
    high = np.full(size, -np.inf)

    def recorded(s: np.ndarray) -> np.ndarray:
        values = g(s)
        flat = values.reshape(size, -1)
        np.minimum(low, flat.min(axis=1, initial=np.inf), out=low)
        np.maximum(high, flat.max(axis=1, initial=-np.inf), out=high)
        return values  # type: ignore[no-any-return]

    result = scipy.differentiate.jacobian(recorded, np.zeros(1), **options)
    df = np.asarray(result.df).reshape(size)
    error = np.asarray(result.error).reshape(size)
    constant = low == high
    return np.where(constant, 0.0, df), np.where(constant, 0.0, error)


def _linear_in(along: Any, t: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``A @ t`` and its error from ``along(u) -> (A @ u, error)``, for unit-scaled ``u``: one
    call along the finite part of ``t``, one per non-finite entry ``t_i`` (``A[:, i] * t_i``,
    as forward mode gives it: never masked)."""
    finite = np.isfinite(t)
    part = np.where(finite, t, 0.0)
    scale = float(np.max(np.abs(part))) if part.size else 0.0
    if scale == 0.0 or size == 0:
        column, error = np.zeros(size), np.zeros(size)
    else:
        column, error = along(part / scale)
        column, error = column * scale, error * scale
    for i in np.flatnonzero(~finite):
        unit = np.zeros(t.size)
        unit[i] = 1.0
        unit_column, unit_error = along(unit)
        column = column + _times_non_finite(unit_column, t[i])
        error = error + _times_non_finite(unit_error, abs(t[i]))
    return column, error


def _flat_tangent(touts: Any) -> np.ndarray:
    leaves = touts if isinstance(touts, tuple) else (touts,)
    arrays = [np.reshape(np.asarray(_arrays.to_numpy(leaf), dtype=np.float64), -1) for leaf in leaves]
    return np.concatenate(arrays) if arrays else np.zeros(0)


def _zeros_like(out: Any) -> Any:
    """The error of a value scipy computed directly: zero, shaped as the value."""
    if isinstance(out, tuple):
        return tuple(np.zeros(np.shape(_arrays.to_numpy(y))) for y in out)
    return np.zeros(np.shape(_arrays.to_numpy(out)))
