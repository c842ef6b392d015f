"""Finite differences on the input's own array type.

``x`` is flattened to one float64 numpy vector (``_Point``); every perturbed point, a fresh
copy, is turned back into leaves of x's own kinds (torch tensors, jax arrays, numpy arrays,
Python floats) before ``f`` is called, so a function written for any framework can be
differentiated; ``f`` may only read it (:meth:`._black_box.BlackBoxAdapter.run`). The steps
are those :class:`~diffiface.AutoFiniteDifferences` documents, each rounded so that
``x_i + h`` is exact; along a tangent, :func:`_step_along`'s. Sizes are bounded (the ``MAX_*``
limits) unless the backend's ``max_inputs`` is set: above them a call is refused before any
allocation.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _arrays
from .._errors import (
    InputTooLargeError,
    InvalidBackendOptionError,
    InvalidInputError,
    InvalidOutputError,
    UnsupportedOperationError,
)
from . import _base, _on_device
from ._base import Blocks, Deferred, Fn, Leaves, as_tuple, shaped_as
from ._black_box import (
    BlackBoxAdapter,
    _blocks,
    _fit,
    _flatten_out,
    _hessian_blocks,
    _inside_torch,
    _is_dtensor,
    _largest,
    _Layout,
    _Point,
    _real_dtype,
    _sharded_torch,
    _split,
    _split_out,
    _times_non_finite,
    _traced_by_torch,
    check_size,
)
from ._on_device import _POWER

# The most inputs (entries of x, all leaves together) of an operator; :meth:`Adapter._check_size` says why.
MAX_INPUTS = 100_000
MAX_HESSIAN_INPUTS = 1_000
MAX_VECTORIZED_INPUTS = 4_000
MAX_JACOBIAN_ENTRIES = 25_000_000
"""The most entries (outputs times inputs) of a Jacobian, unless ``max_inputs`` is set (200 MB in float64)."""


class Adapter(BlackBoxAdapter):
    xp = np

    def __init__(self, backend: Any, info: Any) -> None:
        super().__init__(backend, info)
        self.method: str = backend.method
        self.fixed_step: float | None = backend.step
        self.complex_outputs = self.method == "complex"
        self.vectorize: bool = backend.vectorize
        self.batches = self.vectorize

    def _check_size(self, xs: Leaves, operator: str, hessian: bool = False) -> None:
        if hessian:
            limit, why = MAX_HESSIAN_INPUTS, "a Hessian costs about 2 n² evaluations of f"
        elif self.vectorize:
            limit, why = MAX_VECTORIZED_INPUTS, "with vectorize=True all 2 n² perturbed numbers are built at once"
        else:
            limit, why = MAX_INPUTS, "one or two evaluations of f per input"
        check_size(self.backend, xs, operator, limit, why)

    # -- evaluations ----------------------------------------------------------------------------

    def _evaluate(self, fn: Fn, point: _Point, vector: np.ndarray, layout: _Layout | None = None) -> np.ndarray:
        """``f`` at ``vector``, flat, in float64 (the imaginary part for a complex step).
        Fills ``layout`` with the output's shapes and dtypes if it is empty, else checks that
        the output has the same shapes."""
        out, _ = self.run(fn, point.leaves(vector))
        flat, found = _flatten_out(out)
        if layout is not None:
            _fit(layout, found)
        return self._real(flat, vector, as_tuple(out))

    def _first(self, fn: Fn, point: _Point, vector: np.ndarray) -> float:
        """The first number of f at ``vector`` (a scalar f's value)."""
        return float(self._evaluate(fn, point, vector)[0])

    def _value(self, fn: Fn, point: _Point, layout: _Layout | None = None) -> tuple[Any, Any, np.ndarray, _Layout]:
        out, aux = self.run(fn, point.leaves(point.vector), kept=True)
        point.coarsen(out)
        flat, found = _flatten_out(out)
        if layout is not None:
            _fit(layout, found)
        return out, aux, flat.astype(np.float64), found

    def _column(
        self, fn: Fn, point: _Point, direction: Any, h: float, value: np.ndarray | None, layout: _Layout
    ) -> np.ndarray:
        """``(f(x + h d) - f(x - h d)) / 2h`` (or the one-sided or complex-step form) along
        ``d`` (an array, or the index of a unit vector). A plain function, not a generator:
        a StopIteration that f raises reaches the caller as it is."""
        if self.method == "complex":
            return self._evaluate(fn, point, _shifted(point.vector, direction, 1j * h), layout) / h

        def at(sign: int) -> np.ndarray:
            return self._evaluate(fn, point, _shifted(point.vector, direction, sign * h), layout)

        plus, minus, width = _on_device.ends(self.method, at, lambda: value)
        return (plus - minus) / (width * h)  # type: ignore[no-any-return]

    def _steps(self, point: _Point, power: float | None = None) -> np.ndarray:
        if power is None and self.method == "complex":  # no cancellation: any tiny step will do, and no rounding
            steps = point.steps(2.0, self.fixed_step, exact=False)
            if self.fixed_step is not None:
                point.check_complex_step(self.backend, self.fixed_step)
            return steps
        steps = point.steps(_POWER[self.method] if power is None else power, self.fixed_step)
        if self.fixed_step is not None:
            point.check_step(self.backend, steps)
        return steps

    def _start(self, fn: Fn, xs: Leaves) -> tuple[_Point, Any, Any, np.ndarray | None, _Layout]:
        """The point, ``f(x)`` (now, except for the complex step, which needs no rounding bound
        and defers it) and the layout of ``f(x)`` (filled by the first evaluation; every later one
        must fit it). ``f(x)`` comes first since its precision bounds the steps (:meth:`_Point.coarsen`)."""
        point = _Point(xs)
        if self.method != "complex":
            out, aux, flat, layout = self._value(fn, point)
            return point, out, aux, flat, layout
        layout = _Layout()
        evaluated = Deferred(lambda: self._value(fn, point, layout))
        return point, Deferred(lambda: evaluated.force()[0]), Deferred(lambda: evaluated.force()[1]), None, layout

    def _layout(self, out: Any, layout: _Layout) -> _Layout:
        """The layout of f(x); evaluates f(x) only if no evaluation has given it yet."""
        found = _flatten_out(_base.force(out))[1]
        _fit(layout, found)
        return layout

    def _unit_columns(self, fn: Fn, point: _Point, value: np.ndarray | None, layout: _Layout) -> list[np.ndarray]:
        """The Jacobian's columns, one per coordinate of x: point by point, or all in one
        batched call of f when ``vectorize``."""
        if not self.vectorize:
            columns: list[np.ndarray] = []
            steps = self._steps(point)
            for i in range(point.size):
                column = self._column(fn, point, i, steps[i], value, layout)
                if not columns:  # the first tells the number of outputs: refuse a huge matrix now
                    check_entries(self.backend, column.size, point.size)
                columns.append(column)
            return columns
        n = point.size
        if n == 0:
            return []
        h = self._steps(point)
        x, steps = point.vector, np.diag(h)
        if self.method == "central":
            values = self._evaluate_batch(fn, point, np.concatenate([x + steps, x - steps]), layout)
            rows = (values[:n] - values[n:]) / (2 * h[:, None])
        elif self.method == "forward":
            rows = (self._evaluate_batch(fn, point, x + steps, layout) - value) / h[:, None]
        elif self.method == "backward":
            rows = (value - self._evaluate_batch(fn, point, x - steps, layout)) / h[:, None]
        else:
            rows = self._evaluate_batch(fn, point, x + 1j * steps, layout) / h[:, None]
        return list(rows)

    def _evaluate_batch(self, fn: Fn, point: _Point, points: np.ndarray, layout: _Layout) -> np.ndarray:
        """f at ``k`` points in one call: a ``(k, m)`` float64 array of flat outputs."""
        k = points.shape[0]
        outs = self.run(fn, point.leaves(points), batched=True)
        arrays = [np.asarray(_arrays.to_numpy(out)) for out in outs]
        for array in arrays:
            if array.shape[:1] != (k,):
                raise InvalidOutputError(
                    f"With vectorize=True, f gets {k} points at once (a leading axis of length {k} on every "
                    f"leaf of x) and must return one output per point; it returned shape {array.shape}. Reduce "
                    "over the other axes only (say .sum(axis=-1)), or use vectorize=False."
                )
        _fit(layout, _Layout((a.shape[1:], _real_dtype(a.dtype)) for a in arrays))
        flat = np.concatenate([a.reshape(k, -1) for a in arrays], axis=1) if arrays else np.zeros((k, 0))
        return self._real(flat, points, arrays)

    def _real(self, flat: np.ndarray, points: np.ndarray, outputs: Any) -> np.ndarray:
        """f's flat values in float64: the imaginary part at complex-step points, else the real part."""
        if np.iscomplexobj(points):
            _refuse_real(self.backend, [np.asarray(_arrays.to_numpy(y)) for y in outputs])
        if np.iscomplexobj(flat):
            return flat.imag if np.iscomplexobj(points) else flat.real
        return flat.astype(np.float64)

    def _matrix(self, fn: Fn, xs: Leaves, operator: str) -> tuple[Any, Any, np.ndarray, _Point, _Layout]:
        self._check_size(xs, operator)
        point, out, aux, value, layout = self._start(fn, xs)
        columns = self._unit_columns(fn, point, value, layout)
        layout = self._layout(out, layout)
        m = sum(math.prod(shape) for shape, _ in layout)
        matrix = np.stack(columns, axis=1) if columns else np.zeros((m, 0))
        return out, aux, matrix, point, layout

    # -- first order ------------------------------------------------------------------------------

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        self._check_size(xs, "A gradient")
        if _on_device.applies(xs, self.method, self.fixed_step, self.vectorize):
            return _on_device.value_and_gradient(fn, xs, self.method, self.run)
        point, out, aux, value, layout = self._start(fn, xs)
        columns = self._unit_columns(fn, point, value, layout)
        grad = np.array([column[0] for column in columns], dtype=np.float64)
        return out, aux, _split(grad, point)

    def value_and_jacobian(self, fn: Fn, xs: Leaves, mode: str | None = None) -> tuple[Any, Any, Blocks]:
        out, aux, matrix, point, layout = self._matrix(fn, xs, "A Jacobian")
        return out, aux, _blocks(matrix, layout, point)

    def value_and_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any]:
        out, aux, blocks = self.value_and_jacobian(fn, xs)
        return out, aux, tuple(row[0] for row in blocks)

    def pullback_function(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
        out, aux, matrix, point, _ = self._matrix(fn, xs, "A vjp (through the whole Jacobian)")
        return out, aux, lambda touts: _split(_flatten_out(touts)[0] @ matrix, point)

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        if _sharded_torch(xs) or _sharded_torch(txs):
            return self._sharded_pushforward(fn, xs, txs)
        if (
            _on_device.applies(xs, self.method, self.fixed_step, self.vectorize)
            and all(isinstance(t, sys.modules["jax"].Array) for t in txs)
            and _on_device.finite(txs)
        ):
            return _on_device.value_and_pushforward(fn, xs, txs, self.method, self.run)
        point, out, aux, value, layout = self._start(fn, xs)
        direction = _Point(txs).vector if txs else np.zeros(0)
        finite = np.isfinite(direction)
        column = self._directional(fn, point, np.where(finite, direction, 0.0), value, layout)
        # A non-finite tangent entry t_i contributes J[:, i] * t_i, as forward mode would
        # (inf or nan where J[:, i] is not zero): never masked by a step of 0.
        unit_steps = None
        for i in np.flatnonzero(~finite):
            if unit_steps is None:
                unit_steps = self._steps(point)
            unit = self._column(fn, point, int(i), unit_steps[i], value, layout)
            part = _times_non_finite(unit, direction[i])
            column = part if column is None else column + part
        layout = self._layout(out, layout)
        if column is None:
            column = np.zeros(sum(math.prod(shape) for shape, _ in layout))
        touts = _split_out(column, layout)
        return out, aux, touts if layout.tuple_out else touts[0]

    def _sharded_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        """``J @ t`` of an f of DTensors by one difference along ``t``, computed collectively on
        every rank: the points ``x ± h t`` are DTensor arithmetic on each rank's own slices, and
        the only numbers brought together are scalars (the largest ``|t_i|`` and
        ``|t_i| / max(1, |x_i|)`` of each leaf, for the step). f's outputs stay as f returned them (DTensors: on their mesh, as placed)."""
        torch = sys.modules["torch"]
        if any(_arrays.kind(x) == "torch" and _traced_by_torch(x) for x in xs):
            raise _inside_torch()
        if self.method == "complex":
            raise UnsupportedOperationError(
                "AutoFiniteDifferences(method='complex') on DTensors: complex DTensor arithmetic has no "
                "sharding rules for every operator f may use. Use method='central' (the default)."
            )
        if len(txs) != len(xs) or any(_is_dtensor(x) != _is_dtensor(t) for x, t in zip(xs, txs, strict=False)):
            raise InvalidInputError(
                "The tangent of a DTensor x must be a DTensor like it (same device mesh; same placements "
                "or any other, torch redistributes), and a plain tensor's a plain tensor: make it with "
                "torch.distributed.tensor.distribute_tensor(t, x.device_mesh, x.placements)."
            )
        largest_t = [_largest(t) for t in txs]
        scale_t = max(largest_t, default=0.0)
        if not math.isfinite(scale_t):
            raise InvalidInputError(
                "A tangent of a DTensor x holds inf or NaN: one finite difference along it cannot give "
                "the product that forward mode would (inf or NaN only where f depends on those entries). "
                "Pass a finite tangent."
            )
        # f(x) on copies (f may not reach the caller's x), made only where f(x) is asked for
        evaluated = Deferred(lambda: self.run(fn, tuple(x.clone() for x in xs), kept=True))
        if scale_t == 0.0:
            out = _base.force(evaluated.force()[0])
            zeros = tuple(torch.zeros_like(y) for y in as_tuple(out))
            return out, evaluated.force()[1], shaped_as(out, zeros)
        if self.fixed_step is not None:
            h = self.fixed_step / scale_t
        else:  # the rule of _step_along, on each rank's slices
            moved = [(x, t) for x, t, largest in zip(xs, txs, largest_t, strict=True) if largest > 0]
            eps = max(float(torch.finfo(x.dtype).eps) for x, _ in moved)
            ratio = max(_largest(t / x.detach().abs().nan_to_num(1.0, 1.0).clamp(min=1.0)) for x, t in moved)
            h = eps ** _POWER[self.method] / ratio

        def at(sign: int) -> Any:
            return self.run(fn, tuple(x + (sign * h) * t for x, t in zip(xs, txs, strict=True)))[0]

        def value() -> Any:
            return _base.force(evaluated.force()[0])

        plus, minus, width = _on_device.ends(self.method, at, value)
        touts = tuple(
            ((a.to(torch.float64) - b.to(torch.float64)) / (width * h)).to(a.dtype)
            for a, b in zip(as_tuple(plus), as_tuple(minus), strict=True)
        )
        out = Deferred(value) if self.method == "central" else value()
        return out, Deferred(lambda: evaluated.force()[1]), shaped_as(plus, touts)

    def _directional(
        self, fn: Fn, point: _Point, direction: np.ndarray, value: np.ndarray | None, layout: _Layout
    ) -> np.ndarray | None:
        """``J @ direction`` (a finite direction) by one difference along it; None when it is 0."""
        scale = float(np.max(np.abs(direction))) if direction.size else 0.0
        if scale == 0.0:
            return None
        if self.fixed_step is None:
            h = _step_along(point, direction, 2.0 if self.method == "complex" else _POWER[self.method])
        else:
            h = self.fixed_step / scale
            if self.method == "complex":
                point.check_complex_step(self.backend, h * scale)
            else:
                point.check_step(self.backend, point._exact(h * direction), direction != 0)
        return self._column(fn, point, direction, h, value, layout)

    # -- second order ---------------------------------------------------------------------------

    def value_gradient_and_hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves, Blocks]:
        self._check_size(xs, "A Hessian", hessian=True)
        point = _Point(xs)
        out, aux, f0, _ = self._value(fn, point)
        _, _, grads = self.value_and_gradient(fn, xs)
        x, n = point.vector, point.size
        h = self._steps(point, 1 / 4)
        f = functools.partial(self._first, fn, point)
        hessian = np.empty((n, n))
        for i in range(n):
            ei = np.zeros(n)
            ei[i] = h[i]
            hessian[i, i] = (f(x + 2 * ei) - 2 * f0[0] + f(x - 2 * ei)) / (4 * h[i] * h[i])
            for j in range(i + 1, n):
                ej = np.zeros(n)
                ej[j] = h[j]
                value = (f(x + ei + ej) - f(x + ei - ej) - f(x - ei + ej) + f(x - ei - ej)) / (4 * h[i] * h[j])
                hessian[i, j] = hessian[j, i] = value
        return out, aux, grads, _hessian_blocks(hessian, point)

    gradient_and_hvp = _base.hvp_as_a_batch

    def gradient_and_hvps(self, fn: Fn, xs: Leaves, batch: Any) -> tuple[Any, Any, Leaves, list[Leaves]]:
        """The gradient once, then the differences of the gradient along each tangent."""
        self._check_size(xs, "A Hessian-vector product")
        point = _Point(xs)
        out, aux, grads = self.value_and_gradient(fn, xs)
        return out, aux, grads, [self._hvp_along(fn, point, txs) for txs in batch]

    def _hvp_along(self, fn: Fn, point: _Point, txs: Leaves) -> Leaves:
        v = _Point(txs).vector if txs else np.zeros(0)
        finite = np.isfinite(v)
        hv = self._hvp(fn, point, np.where(finite, v, 0.0))
        for i in np.flatnonzero(~finite):  # H[:, i] * v_i, as forward mode would: never masked
            unit = np.zeros(point.size)
            unit[i] = 1.0
            hv = hv + _times_non_finite(self._hvp(fn, point, unit), v[i])
        return _split(hv, point)

    def _hvp(self, fn: Fn, point: _Point, v: np.ndarray) -> np.ndarray:
        """``H @ v`` for a finite ``v``: differences of the gradient along ``v``."""
        scale = float(np.max(np.abs(v))) if v.size else 0.0
        hv = np.zeros(point.size)
        if not scale:
            return hv
        x = point.vector
        t = self.fixed_step / scale if self.fixed_step is not None else _step_along(point, v, 1 / 4)
        h = self._steps(point, 1 / 4)
        if self.fixed_step is not None:
            point.check_step(self.backend, point._exact(t * v), v != 0)
        f = functools.partial(self._first, fn, point)
        tv = t * v
        plus, minus = x + tv, x - tv
        for i in range(point.size):  # each point a fresh array (f may keep what it was given)
            a, b = f(_shifted(plus, i, h[i])), f(_shifted(plus, i, -h[i]))
            c, d = f(_shifted(minus, i, h[i])), f(_shifted(minus, i, -h[i]))
            hv[i] = (a - b - c + d) / (4 * t * h[i])
        return hv

    def value_derivative_and_second_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
        point = _Point(xs)
        out, aux, f0, layout = self._value(fn, point)
        _, _, derivs = self.value_and_derivative(fn, xs)
        h = self._steps(point, 1 / 4)
        x = point.vector
        second = (
            (self._evaluate(fn, point, x + h, layout) - 2 * f0 + self._evaluate(fn, point, x - h, layout))
            / (h[0] * h[0])
            if point.size
            else f0 * 0
        )
        return out, aux, derivs, _split_out(second, layout)


def check_entries(backend: Any, m: int, n: int) -> None:
    """Refuse a Jacobian of more than :data:`MAX_JACOBIAN_ENTRIES` entries (unless ``max_inputs`` is set)."""
    if getattr(backend, "max_inputs", None) is None and m * n > MAX_JACOBIAN_ENTRIES:
        raise InputTooLargeError(
            f"A Jacobian by {type(backend).__name__} of {m:,} outputs by {n:,} inputs has {m * n:,} entries: "
            f"above the limit of {MAX_JACOBIAN_ENTRIES:,}. Use vjp or jvp (one row or column), an "
            "automatic-differentiation backend, or, for a deliberate run, set "
            f"{type(backend).__name__}(max_inputs=...)."
        )


def _shifted(x: np.ndarray, direction: Any, amount: Any) -> np.ndarray:
    """A fresh ``x + amount * direction``; ``direction`` an array or the index of a unit vector."""
    if isinstance(direction, (int, np.integer)):
        shifted = x.astype(np.result_type(x, amount))  # a copy
        shifted[direction] += amount
        return shifted
    return x + amount * direction  # type: ignore[no-any-return]


def _step_along(point: _Point, direction: np.ndarray, power: float) -> float:
    """The step ``s`` of a difference along a non-zero ``direction`` ``v``: the largest with
    ``s |v_i| <= eps**p * max(1, |x_i|)`` on every input that ``v`` moves, the per-coordinate
    step of a gradient. So no input moves further than its own step, however large another
    input is; ``eps`` is that of the coarsest dtype among the inputs moved (their rounding
    bounds the step from below), and a non-finite ``x_i`` counts as 1."""
    moved = direction != 0
    x = point.vector[moved]
    scale = np.where(np.isfinite(x), np.maximum(1.0, np.abs(x)), 1.0)
    eps = float(np.max(point.eps[moved]))
    return float(eps**power / np.max(np.abs(direction[moved]) / scale))


def _refuse_real(backend: Any, outputs: list[np.ndarray]) -> None:
    """Refuse a real output of f at a complex-step point: its imaginary part, the complex step's
    derivative, is lost (f took abs, .real or a real cast, so is not analytic)."""
    for i, y in enumerate(outputs):
        if y.size and not np.iscomplexobj(y):
            where = f"output leaf {i} ({y.dtype}, shape {y.shape})" if len(outputs) > 1 else f"its output ({y.dtype})"
            raise InvalidBackendOptionError(
                f"{type(backend).__name__}(method='complex') called f at complex points x + ih and f returned "
                f"a real number in {where}: f is not analytic there (it takes abs, .real, casts to a real "
                "dtype, or returns a constant made without x), so the imaginary part that carries the derivative "
                "is lost and the complex step cannot differentiate f. Use central differences (AutoFiniteDifferences(method='central'), the default)."
            )
