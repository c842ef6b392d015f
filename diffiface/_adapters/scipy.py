"""scipy: the adaptive finite differences of ``scipy.differentiate`` (``jacobian``, ``hessian``).

scipy refines each derivative until its own error estimate meets the tolerances; the
estimate of the last call, shaped as the result, is read through ``prep.error``. numpy inputs
in float32 are evaluated in float64 (adaptive steps need its precision; results come back in
float32). scipy calls
``f`` on batches of points (a trailing axis); diffiface evaluates the user's ``f`` point by
point, each point as leaves of x's own kinds, so ``f`` needs no vectorising.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import scipy.differentiate

from .. import _arrays
from . import _base
from ._base import Blocks, Fn, Leaves
from .finite_differences import (
    _blocks,
    _flatten_out,
    _hessian_blocks,
    _Layout,
    _no_grad,
    _Point,
    _split,
    _split_out,
    context_like_x,
)


class Adapter(_base.Adapter):
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

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        return context_like_x(leaf, like)

    def take_error(self) -> Any:
        error = getattr(self._local, "error", None)
        self._local.error = None
        return error

    # -- evaluating f on scipy's batches ---------------------------------------------------------

    def _flat(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, np.ndarray, _Layout, Any, _Point]:
        """f(x) at x itself, and f on scipy's batches at the (float64) promoted point."""
        with _no_grad():
            out, aux = fn(xs)
        flat, layout = _flatten_out(out)
        point = _Point(xs, promote=True)

        def batched(v: np.ndarray) -> np.ndarray:
            columns = v.reshape(point.size, -1)
            with _no_grad():
                values = [_flatten_out(fn(point.leaves(columns[:, k]))[0])[0] for k in range(columns.shape[1])]
            return np.stack(values, axis=-1).astype(np.float64).reshape((flat.size, *v.shape[1:]))

        return out, aux, flat, layout, batched, point

    def _jacobian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, np.ndarray, np.ndarray, _Point, _Layout]:
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
        out, aux, jac, err, point, _ = self._jacobian(fn, xs)
        self._local.error = (_zeros_like(out), None, _split(err[0], point))
        return out, aux, _split(jac[0], point)

    def value_and_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any]:
        out, aux, jac, err, _, layout = self._jacobian(fn, xs)
        self._local.error = (_zeros_like(out), None, _split_out(err[:, 0], layout))
        return out, aux, _split_out(jac[:, 0], layout)

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        out, aux, jac, err, _, layout = self._jacobian(fn, xs)
        t = _Point(txs).vector
        touts = _split_out(jac @ t, layout)
        self._local.error = (_zeros_like(out), None, _split_out(err @ np.abs(t), layout))
        return out, aux, touts if layout.tuple_out else touts[0]

    def value_and_pullback(self, fn: Fn, xs: Leaves, touts: Any) -> tuple[Any, Any, Leaves]:
        out, aux, jac, err, point, _ = self._jacobian(fn, xs)
        t = _flat_tangent(touts)
        self._local.error = (_zeros_like(out), None, _split(np.abs(t) @ err, point))
        return out, aux, _split(t @ jac, point)

    def pullback_function(self, fn: Fn, xs: Leaves) -> Any:
        out, aux, jac, _, point, _ = self._jacobian(fn, xs)
        return out, aux, lambda touts: _split(_flat_tangent(touts) @ jac, point)

    # -- second order ---------------------------------------------------------------------------

    def _hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, np.ndarray, np.ndarray, _Point]:
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
        out, aux, hess, hess_err, point = self._hessian(fn, xs)
        _, _, grads = self.value_and_gradient(fn, xs)
        grad_err = self._local.error[2]
        v = _Point(txs).vector
        self._local.error = (_zeros_like(out), None, grad_err, _split(hess_err @ np.abs(v), point))
        return out, aux, grads, _split(hess @ v, point)

    def value_derivative_and_second_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
        out, aux, flat, layout, batched, point = self._flat(fn, xs)
        _, _, derivs = self.value_and_derivative(fn, xs)
        deriv_err = self._local.error[2]
        seconds, errors = np.zeros(flat.size), np.zeros(flat.size)
        for k in range(flat.size):
            result = scipy.differentiate.hessian(lambda v, k=k: batched(v)[k], point.vector, **self._options)
            seconds[k], errors[k] = np.asarray(result.ddf).reshape(-1)[0], np.asarray(result.error).reshape(-1)[0]
        self._local.error = (_zeros_like(out), None, deriv_err, _split_out(errors, layout))
        return out, aux, derivs, _split_out(seconds, layout)


def _flat_tangent(touts: Any) -> np.ndarray:
    leaves = touts if isinstance(touts, tuple) else (touts,)
    arrays = [np.reshape(np.asarray(_arrays.to_numpy(leaf), dtype=np.float64), -1) for leaf in leaves]
    return np.concatenate(arrays) if arrays else np.zeros(0)


def _zeros_like(out: Any) -> Any:
    """The error of a value scipy computed directly: zero, shaped as the value."""
    if isinstance(out, tuple):
        return tuple(np.zeros(np.shape(_arrays.to_numpy(y))) for y in out)
    return np.zeros(np.shape(_arrays.to_numpy(out)))
