"""scipy: the adaptive finite differences of ``scipy.differentiate`` (``jacobian``, ``hessian``).

scipy calls ``f`` on batches of points (a trailing axis); diffiface evaluates the user's ``f``
point by point, each point as leaves of x's own kinds, so ``f`` needs no vectorising, and hands
it fresh points as finite differences do (:meth:`._black_box.BlackBoxAdapter.run`). float32 numpy inputs are
evaluated in float64 (adaptive steps need its precision; results come back in float32). ``jvp``
and ``hvp`` take one directional derivative (of ``f``, of scipy's gradient) along the tangent,
so their cost grows with the size of x, not its square.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import scipy.differentiate

from .. import _arrays
from .._errors import InvalidBackendOptionError
from ._base import Blocks, Fn, Leaves, as_tuple, shaped_as
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
)

# The most inputs (entries of x) of an operator, unless ``max_inputs`` says: :meth:`Adapter._check` says why.
MAX_INPUTS = 1_000
MAX_SECOND_ORDER_INPUTS = 100

_STATUS = {
    -1: "its error estimate grew before it met the tolerances",
    -2: "it ran all maxiter={maxiter} iterations before its error estimate met the tolerances",
    -3: "f gave a non-finite value at a point it evaluated (a step that left f's domain, or an overflow)",
}
"""scipy.differentiate's failed statuses, in words."""


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

    def _flat(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, np.ndarray, _Layout, Any, _Point, _Tolerance]:
        """f(x) at a fresh copy of x (x's own kinds and dtypes), and f on scipy's batches at
        the (float64) promoted point; every output must keep the shapes of f(x). The tolerance
        follows the values f takes."""
        own = _Point(xs)
        out, aux = self.run(fn, own.leaves(own.vector), kept=True)
        flat, layout = _flatten_out(out)
        point = _Point(xs, promote=True)
        tolerance = _Tolerance(self.backend, point, layout)

        def batched(v: np.ndarray) -> np.ndarray:
            columns = v.reshape(point.size, -1)
            values = []
            for k in range(columns.shape[1]):
                value, found = _flatten_out(self.run(fn, point.leaves(columns[:, k]))[0])
                _fit(layout, found)
                values.append(value)
                tolerance.saw(value)
            return np.stack(values, axis=-1).astype(np.float64).reshape((flat.size, *v.shape[1:]))

        return out, aux, flat, layout, batched, point, tolerance

    def _check(self, xs: Leaves, operator: str, second: bool = False) -> None:
        if second:
            limit, why = MAX_SECOND_ORDER_INPUTS, "scipy's Hessian evaluates f about order² n² times"
        else:
            limit, why = MAX_INPUTS, "scipy's Jacobian evaluates f at about order n points per iteration"
        check_size(self.backend, xs, operator, limit, why)

    def _jacobian(
        self, fn: Fn, xs: Leaves, operator: str = "A Jacobian"
    ) -> tuple[Any, Any, np.ndarray, np.ndarray, _Point, _Layout]:
        self._check(xs, operator)
        out, aux, flat, layout, batched, point, tolerance = self._flat(fn, xs)
        if point.size == 0 or flat.size == 0:
            zeros = np.zeros((flat.size, point.size))
            return out, aux, zeros, zeros, point, layout
        result = self._differentiate("jacobian", batched, point.vector)
        jac = np.asarray(result.df).reshape(flat.size, point.size)
        err = np.asarray(result.error).reshape(flat.size, point.size)
        x = point.vector
        self._refuse_failed(
            result.status,
            jac,
            err,
            lambda k, j: f"the derivative of output {k} with respect to entry {j} of x (x_j = {x[j]:.6g})",
            ~np.isfinite(flat)[:, None] | ~np.isfinite(x)[None, :],
            tolerance,
        )
        return out, aux, jac, err, point, layout

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
        out, aux, flat, layout, batched, point, tolerance = self._flat(fn, xs)
        t = _Point(txs).vector if txs else np.zeros(0)

        def along(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            # d/ds f(x + s u) at 0: scipy's adaptive steps and error estimate, at the cost of one input, not n
            def g(s: np.ndarray) -> np.ndarray:
                shifts = s.reshape(-1)
                return batched(point.vector[:, None] + u[:, None] * shifts[None, :]).reshape((flat.size, *s.shape[1:]))  # type: ignore[no-any-return]

            return self._directional(
                g, flat.size, point, u, np.isfinite(flat).all(), tolerance, "output {k} along the tangent"
            )

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

    def pullback_function(self, fn: Fn, xs: Leaves) -> Any:
        out, aux, jac, _, point, _ = self._jacobian(fn, xs, "A vjp (through the whole Jacobian)")
        return out, aux, lambda touts: _split(_flatten_out(touts)[0] @ jac, point)

    # -- second order ---------------------------------------------------------------------------

    def value_gradient_and_hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves, Blocks]:
        self._check(xs, "A Hessian", second=True)
        out, aux, _, _, batched, point, tolerance = self._flat(fn, xs)
        n, x = point.size, point.vector
        hess = err = np.zeros((n, n))
        if n:
            result = self._differentiate("hessian", lambda v: batched(v)[0], x)
            hess, err = np.asarray(result.ddf).reshape(n, n), np.asarray(result.error).reshape(n, n)
            self._refuse_failed(
                result.status,
                hess,
                err,
                lambda i, j: (
                    f"the second derivative with respect to entries {i} and {j} of x (x_i = {x[i]:.6g}, x_j = {x[j]:.6g})"
                ),
                _non_finite(x, _flatten_out(out)[0]),
                tolerance,
                second=True,
            )
        _, _, grads = self.value_and_gradient(fn, xs)
        self._local.error = (_zeros_like(out), None, self._local.error[2], _hessian_blocks(err, point))
        return out, aux, grads, _hessian_blocks(hess, point)

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
        _, _, flat, _, batched, point, tolerance = self._flat(fn, xs)
        propagates = _non_finite(point.vector, flat)

        def gradient(y: np.ndarray) -> np.ndarray:
            result = self._differentiate("jacobian", lambda w: batched(w)[0], y)
            df = np.asarray(result.df)
            self._refuse_failed(
                result.status,
                df,
                np.asarray(result.error),
                lambda j: f"the gradient's entry {j} at a point near x (x_j = {y[j]:.6g})",
                propagates,
                tolerance,
            )
            return df  # type: ignore[no-any-return]

        def along(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            # d/ds grad f(x + s u) at 0, each gradient by scipy's adaptive jacobian: linear in
            # the size of x, where the whole Hessian would be quadratic
            def g(s: np.ndarray) -> np.ndarray:
                grads_along = [gradient(point.vector + shift * u) for shift in s.reshape(-1)]
                return np.stack(grads_along, axis=-1).reshape((point.size, *s.shape[1:]))

            return self._directional(
                g,
                point.size,
                point,
                u,
                not propagates,
                tolerance,
                "the gradient's entry {k} along the tangent",
                second=True,
            )

        hvps, errors = [], []
        for txs in batch:
            hv, error = _linear_in(along, _Point(txs).vector if txs else np.zeros(0), point.size)
            hvps.append(_split(hv, point))
            errors.append(_split(error, point))
        self._local.error = (_zeros_like(out), None, grad_err, errors)
        return out, aux, grads, hvps

    def value_derivative_and_second_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
        self._check(xs, "A second derivative", second=True)
        out, aux, flat, layout, batched, point, tolerance = self._flat(fn, xs)
        _, _, derivs = self.value_and_derivative(fn, xs)
        deriv_err = self._local.error[2]
        seconds, errors = np.zeros(flat.size), np.zeros(flat.size)
        x = point.vector
        for k in range(flat.size):
            result = self._differentiate("hessian", lambda v, k=k: batched(v)[k], x)
            seconds[k], errors[k] = np.asarray(result.ddf).reshape(-1)[0], np.asarray(result.error).reshape(-1)[0]
            self._refuse_failed(
                np.asarray(result.status).reshape(-1)[:1],
                seconds[k : k + 1],
                errors[k : k + 1],
                lambda _, k=k: f"the second derivative of output {k} (at x = {x[0]:.6g})",
                _non_finite(x, flat[k : k + 1]),
                tolerance,
                second=True,
            )
        self._local.error = (_zeros_like(out), None, deriv_err, _split_out(errors, layout))
        return out, aux, derivs, _split_out(seconds, layout)

    # -- scipy's verdicts ------------------------------------------------------------------------

    def _differentiate(self, how: str, g: Any, x: np.ndarray) -> Any:
        """scipy.differentiate's ``how`` (``"jacobian"`` or ``"hessian"``) of ``g`` at ``x``,
        refused where no point scipy evaluated moved an entry of x (:meth:`_refuse_lost`)."""
        moved = np.zeros(x.size, dtype=bool)

        def recorded(v: np.ndarray) -> Any:
            moved[:] |= (v.reshape(x.size, -1) != x[:, None]).any(axis=1)
            return g(v)

        result = getattr(scipy.differentiate, how)(recorded, x, **self._options)
        self._refuse_lost(~moved & np.isfinite(x), x)
        return result

    def _refuse_lost(self, lost: np.ndarray, x: np.ndarray, along: str = "") -> None:
        """Refuse where every step scipy tried along an entry of x was lost to rounding
        (``x_j + step == x_j``): f never saw a moved point, and scipy may report the derivative
        it then estimates, 0, as converged."""
        if not lost.any():
            return
        j = int(np.flatnonzero(lost)[0])
        initial_step = getattr(self.backend, "initial_step", None)
        raise InvalidBackendOptionError(
            f"scipy.differentiate's steps{along} are lost to rounding at entry {j} of x "
            f"(x_j = {x[j]:.6g}): x_j + step == x_j for every step it tried "
            f"(from initial_step={initial_step!r} down), so f never saw a moved point and "
            "its derivative would come out 0. Set AutoScipy(initial_step=...) near the scale of x, or use "
            "AutoFiniteDifferences(), whose steps follow |x|, or an automatic-differentiation backend."
        )

    def _refuse_failed(
        self,
        status: Any,
        estimate: np.ndarray,
        error: np.ndarray,
        where: Any,
        propagates: Any,
        tolerance: _Tolerance,
        second: bool = False,
    ) -> None:
        """Refuse an estimate that is not finite, or that scipy reports as failed (``status``
        not 0) with an error above what ``tolerance`` allows (a failed status where the entry
        itself is near 0 is scipy's relative tolerance unmet, not a wrong derivative). NaN and
        inf pass where x or f(x) holds them (``propagates``). ``where(*index)`` names the entry."""
        status = np.asarray(status).reshape(estimate.shape)
        finite = np.isfinite(estimate)
        scale = float(np.max(np.abs(estimate[finite]), initial=0.0))
        backend: Any = self.backend
        with np.errstate(invalid="ignore"):
            unmet = (status != 0) & ~(error <= tolerance.allowed(scale, second))
        failed = (unmet | ~finite) & ~np.asarray(propagates, dtype=bool)
        if not failed.any():
            return
        index = tuple(int(i) for i in np.argwhere(failed)[0])
        code = int(status[index])
        meaning = _STATUS.get(code, "a non-finite estimate").format(maxiter=backend.maxiter)
        raise InvalidBackendOptionError(
            f"scipy.differentiate could not estimate {where(*index)}: status {code}, {meaning} (its estimate "
            f"{estimate[index]:.6g}, error {error[index]:.3g}); diffiface returns no estimate that scipy "
            f"rejects. Its first step, initial_step={backend.initial_step!r}, is absolute: far from 0 it "
            "is lost to rounding, and near a domain edge or a fast oscillation it is too long. Set "
            "AutoScipy(initial_step=...) near the scale on which f changes at x (and maxiter, atol, rtol if "
            "needed), or use AutoFiniteDifferences() or an automatic-differentiation backend. "
            "(Entries of x count in diffiface.tree.ravel order.)"
        )

    def _directional(
        self,
        g: Any,
        size: int,
        point: _Point,
        u: np.ndarray,
        checked: bool,
        tolerance: _Tolerance,
        what: str,
        second: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``d/ds g(s)`` at 0 for ``g: R -> R^size``, ``g(s)`` a function of ``x + s u`` (on a
        batch of ``s``), by scipy's adaptive differences, and its error estimate. An output that
        took one value at every point scipy evaluated has derivative exactly 0 (scipy's weighted
        sum of equal values leaves rounding, which an infinite tangent would turn into inf), as
        forward mode gives it; but only where the points moved: a step lost to rounding
        (``x_i + s u_i == x_i`` in x's dtype for every ``s``) is refused. ``checked``: whether to
        refuse scipy's failures (not where x or f(x) is non-finite, whose NaN and inf pass)."""
        low = np.full(size, np.inf)
        high = np.full(size, -np.inf)
        moved = np.zeros(point.size, dtype=bool)

        def recorded(s: np.ndarray) -> np.ndarray:
            for shift in s.reshape(-1):
                moved[:] |= point._exact(shift * u) != 0
            values = g(s)
            flat = values.reshape(size, -1)
            np.minimum(low, flat.min(axis=1, initial=np.inf), out=low)
            np.maximum(high, flat.max(axis=1, initial=-np.inf), out=high)
            return values  # type: ignore[no-any-return]

        result = scipy.differentiate.jacobian(recorded, np.zeros(1), **self._options)
        df = np.asarray(result.df).reshape(size)
        error = np.asarray(result.error).reshape(size)
        self._refuse_lost((u != 0) & ~moved & np.isfinite(point.vector), point.vector, " along the tangent")
        constant = low == high
        df, error = np.where(constant, 0.0, df), np.where(constant, 0.0, error)
        if checked:
            self._refuse_failed(result.status, df, error, lambda k: what.format(k=k), constant, tolerance, second)
        return df, error


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


def _zeros_like(out: Any) -> Any:
    """The error of a value scipy computed directly: zero, shaped as the value."""
    return shaped_as(out, tuple(np.zeros(np.shape(_arrays.to_numpy(y))) for y in as_tuple(out)))


def _non_finite(x: np.ndarray, values: np.ndarray) -> bool:
    """Whether x or f(x) holds a non-finite number (which derivatives carry on, never refused)."""
    return not (np.isfinite(x).all() and np.isfinite(values).all())


class _Tolerance:
    """The error a result may keep where scipy's own tolerance was not met: ``rtol`` times the
    larger of the result's largest entry and the largest ``|f|`` scipy saw over ``max(1, |x|)``
    (so a result that is 0 everywhere is measured against f's own scale). ``rtol`` is the
    square root of the epsilon of the coarsest dtype among x and f(x), its fourth root for a
    second derivative, or the user's ``rtol`` if larger; the user's ``atol`` is added."""

    def __init__(self, backend: Any, point: _Point, layout: _Layout) -> None:
        dtypes = [d for d in (*point.dtypes, *(dtype for _, dtype in layout)) if np.issubdtype(d, np.inexact)]
        self.eps = float(max((np.finfo(d).eps for d in dtypes), default=np.finfo(np.float64).eps))
        self.rtol, self.atol = backend.rtol or 0.0, backend.atol or 0.0
        finite = point.vector[np.isfinite(point.vector)]
        self.unit = max(1.0, float(np.max(np.abs(finite), initial=0.0)))
        self.largest = 0.0

    def saw(self, values: np.ndarray) -> None:
        finite = np.abs(values[np.isfinite(values)])
        self.largest = max(self.largest, float(np.max(finite, initial=0.0)))

    def allowed(self, scale: float, second: bool) -> float:
        rtol = max(self.eps ** (0.25 if second else 0.5), self.rtol)
        return float(rtol * max(scale, self.largest / self.unit) + self.atol)
