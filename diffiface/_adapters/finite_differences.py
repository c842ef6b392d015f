"""Finite differences on the input's own array type.

``x`` is flattened to one float64 numpy vector (``_Point``); every perturbed point is turned
back into leaves of x's own kinds (torch tensors, jax arrays, numpy arrays, Python floats)
before ``f`` is called, so a function written for any framework can be differentiated.
``x`` itself is never touched: perturbations are applied to copies.

Steps, per coordinate, balance truncation against rounding: ``eps**p * max(1, |x_i|)`` with
``eps`` the machine epsilon of the leaf's dtype and ``p = 1/3`` (central), ``1/2`` (forward,
backward), ``1/4`` (second differences); each step is rounded so that ``x_i + h`` is exact.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import _arrays
from .._errors import InvalidOutputError
from . import _base
from ._base import Blocks, Deferred, Fn, Leaves

_POWER = {"central": 1 / 3, "forward": 1 / 2, "backward": 1 / 2}


class _Point:
    """``x`` as one float64 vector, with the way back to leaves of x's kinds and dtypes."""

    def __init__(self, xs: Leaves, promote: bool = False) -> None:
        self.likes = tuple(_promoted(x) for x in xs) if promote else xs
        arrays = [_arrays.to_numpy(x) for x in xs]
        self.shapes = [a.shape for a in arrays]
        self.dtypes = [a.dtype for a in arrays]  # x's own, also when the likes are promoted
        self.offsets = np.cumsum([0, *(a.size for a in arrays)])
        self.vector = np.concatenate([a.reshape(-1).astype(np.float64) for a in arrays]) if arrays else np.zeros(0)
        self.eps = np.concatenate([np.full(a.size, np.finfo(a.dtype).eps) for a in arrays]) if arrays else np.zeros(0)
        self.size = self.vector.size

    def leaves(self, vector: np.ndarray) -> Leaves:
        complex_step = np.iscomplexobj(vector)
        leaves = []
        for i, like in enumerate(self.likes):
            piece = vector[self.offsets[i] : self.offsets[i + 1]].reshape(self.shapes[i])
            if isinstance(like, float):
                leaves.append(complex(piece.item()) if complex_step else float(piece.item()))
                continue
            dtype = _complex_dtype(like) if complex_step else None
            leaves.append(_arrays.from_numpy(piece, like, dtype=dtype))
        return tuple(leaves)

    def batch_leaves(self, points: np.ndarray) -> Leaves:
        """Leaves holding ``k`` points along a new leading axis (``points`` is ``(k, n)``)."""
        complex_step = np.iscomplexobj(points)
        k = points.shape[0]
        leaves = []
        for i, like in enumerate(self.likes):
            piece = points[:, self.offsets[i] : self.offsets[i + 1]].reshape((k, *self.shapes[i]))
            if isinstance(like, float):
                leaves.append(piece)
                continue
            dtype = _complex_dtype(like) if complex_step else None
            leaves.append(_arrays.from_numpy(piece, like, dtype=dtype))
        return tuple(leaves)

    def steps(self, power: float, fixed: float | None, exact: bool = True) -> np.ndarray:
        if fixed is not None:
            return np.full(self.size, float(fixed))
        steps = self.eps**power * np.maximum(1.0, np.abs(self.vector))
        return self._exact(steps) if exact else steps

    def _exact(self, steps: np.ndarray) -> np.ndarray:
        """Steps rounded so that ``x + h`` is representable in each leaf's dtype."""
        out = np.empty_like(steps)
        for i, like in enumerate(self.likes):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            dtype = np.dtype(_arrays.dtype_name(like))
            x = self.vector[lo:hi].astype(dtype)
            out[lo:hi] = (x + steps[lo:hi].astype(dtype)).astype(np.float64) - x.astype(np.float64)
        return out


def _promoted(leaf: Any) -> Any:
    """A float32 numpy leaf as float64 (f then computes in float64); other leaves as they are."""
    if isinstance(leaf, np.ndarray) and leaf.dtype != np.float64:
        return leaf.astype(np.float64)
    return leaf


def _complex_dtype(like: Any) -> Any:
    name = _arrays.dtype_name(like)
    target = "complex64" if name in ("float32", "float16", "bfloat16") else "complex128"
    if _arrays.kind(like) == "torch":
        return getattr(sys.modules["torch"], target)
    return np.dtype(target)


class _Layout(list[tuple[tuple[int, ...], Any]]):
    """Shapes and dtypes of the leaves of f(x); ``tuple_out`` tells a tuple from one leaf."""

    tuple_out = True


def _flatten_out(out: Any) -> tuple[np.ndarray, _Layout]:
    leaves = out if isinstance(out, tuple) else (out,)
    arrays = [np.asarray(_arrays.to_numpy(leaf)) for leaf in leaves]
    layout = _Layout((a.shape, _real_dtype(a.dtype)) for a in arrays)
    layout.tuple_out = isinstance(out, tuple)
    vector = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    return vector, layout


def _real_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return np.dtype(np.float32) if dtype == np.complex64 else np.dtype(np.float64) if dtype.kind == "c" else dtype


class Adapter(_base.Adapter):
    xp = np

    def __init__(self, backend: Any, info: Any) -> None:
        super().__init__(backend, info)
        self.method: str = backend.method
        self.fixed_step: float | None = backend.step
        self.complex_outputs = self.method == "complex"
        self.vectorize: bool = backend.vectorize
        self.batches = self.vectorize

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        return context_like_x(leaf, like)

    # -- evaluations ----------------------------------------------------------------------------

    def _call(self, fn: Fn, point: _Point, vector: np.ndarray) -> tuple[Any, Any]:
        with _no_grad():
            return fn(point.leaves(vector))

    def _evaluate(self, fn: Fn, point: _Point, vector: np.ndarray, layout: _Layout | None = None) -> np.ndarray:
        """``f`` at ``vector``, flat, in float64 (the imaginary part for a complex step).
        Fills ``layout`` with the output's shapes and dtypes if it is empty."""
        out, _ = self._call(fn, point, vector)
        flat, found = _flatten_out(out)
        if layout is not None and not layout:
            layout.extend(found)
            layout.tuple_out = found.tuple_out
        if np.iscomplexobj(flat):
            return flat.imag if np.iscomplexobj(vector) else flat.real
        return flat.astype(np.float64)

    def _first(self, fn: Fn, point: _Point, vector: np.ndarray) -> float:
        """The first number of f at ``vector`` (a scalar f's value)."""
        return float(self._evaluate(fn, point, vector)[0])

    def _value(self, fn: Fn, point: _Point) -> tuple[Any, Any, np.ndarray, _Layout]:
        out, aux = self._call(fn, point, point.vector)
        flat, layout = _flatten_out(out)
        return out, aux, flat.astype(np.float64), layout

    def _columns(
        self,
        fn: Fn,
        point: _Point,
        directions: Iterator[tuple[np.ndarray, float]],
        value: np.ndarray | None,
        layout: _Layout,
    ) -> Iterator[np.ndarray]:
        """``(f(x + h d) - f(x - h d)) / 2h`` (or the one-sided or complex-step form) per direction."""
        x = point.vector
        for direction, h in directions:
            if self.method == "central":
                plus = self._evaluate(fn, point, x + h * direction, layout)
                yield (plus - self._evaluate(fn, point, x - h * direction)) / (2 * h)
            elif self.method == "forward":
                assert value is not None
                yield (self._evaluate(fn, point, x + h * direction) - value) / h
            elif self.method == "backward":
                assert value is not None
                yield (value - self._evaluate(fn, point, x - h * direction)) / h
            else:
                yield self._evaluate(fn, point, x + 1j * h * direction, layout) / h

    def _unit_directions(self, point: _Point) -> Iterator[tuple[np.ndarray, float]]:
        steps = self._steps(point)
        for i in range(point.size):
            e = np.zeros(point.size)
            e[i] = 1.0
            yield e, steps[i]

    def _steps(self, point: _Point) -> np.ndarray:
        if self.method == "complex":  # no cancellation: any tiny step will do, and no rounding
            return point.steps(2.0, self.fixed_step, exact=False)
        return point.steps(_POWER[self.method], self.fixed_step)

    def _needs_value(self) -> bool:
        return self.method in ("forward", "backward")

    def _start(self, fn: Fn, xs: Leaves) -> tuple[_Point, Any, Any, np.ndarray | None, _Layout]:
        """The point, ``f(x)`` (now if the method needs it, else deferred) and the layout of
        ``f(x)`` (filled by the first evaluation)."""
        point = _Point(xs)
        if self._needs_value():
            out, aux, flat, layout = self._value(fn, point)
            return point, out, aux, flat, layout
        evaluated = Deferred(lambda: self._value(fn, point))
        return point, Deferred(lambda: evaluated.force()[0]), Deferred(lambda: evaluated.force()[1]), None, _Layout()

    def _layout(self, out: Any, layout: _Layout) -> _Layout:
        """The layout of f(x); evaluates f(x) only if no evaluation has given it yet."""
        if not layout:
            found = _flatten_out(_base.force(out))[1]
            layout.extend(found)
            layout.tuple_out = found.tuple_out
        return layout

    def _unit_columns(self, fn: Fn, point: _Point, value: np.ndarray | None, layout: _Layout) -> list[np.ndarray]:
        """The Jacobian's columns, one per coordinate of x: point by point, or all in one
        batched call of f when ``vectorize``."""
        if not self.vectorize:
            return list(self._columns(fn, point, self._unit_directions(point), value, layout))
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
        with _no_grad():
            outs = fn.batched(point.batch_leaves(points))  # type: ignore[attr-defined]
        arrays = [np.asarray(_arrays.to_numpy(out)) for out in outs]
        for array in arrays:
            if array.shape[:1] != (k,):
                raise InvalidOutputError(
                    f"With vectorize=True, f gets {k} points at once (a leading axis of length {k} on every "
                    f"leaf of x) and must return one output per point; it returned shape {array.shape}. Reduce "
                    "over the other axes only (say .sum(axis=-1)), or use vectorize=False."
                )
        if not layout:
            layout.extend((a.shape[1:], _real_dtype(a.dtype)) for a in arrays)
        flat = np.concatenate([a.reshape(k, -1) for a in arrays], axis=1) if arrays else np.zeros((k, 0))
        if np.iscomplexobj(flat):
            return flat.imag if np.iscomplexobj(points) else flat.real
        return flat.astype(np.float64)

    def _matrix(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, np.ndarray, _Point, _Layout]:
        point, out, aux, value, layout = self._start(fn, xs)
        columns = self._unit_columns(fn, point, value, layout)
        layout = self._layout(out, layout)
        m = sum(math.prod(shape) for shape, _ in layout)
        matrix = np.stack(columns, axis=1) if columns else np.zeros((m, 0))
        return out, aux, matrix, point, layout

    # -- first order ------------------------------------------------------------------------------

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        point, out, aux, value, _ = self._start(fn, xs)
        columns = self._unit_columns(fn, point, value, _Layout())
        grad = np.array([column[0] for column in columns], dtype=np.float64)
        return out, aux, _split(grad, point)

    def value_and_jacobian(self, fn: Fn, xs: Leaves, mode: str | None = None) -> tuple[Any, Any, Blocks]:
        out, aux, matrix, point, layout = self._matrix(fn, xs)
        return out, aux, _blocks(matrix, layout, point)

    def value_and_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any]:
        out, aux, blocks = self.value_and_jacobian(fn, xs)
        return out, aux, tuple(row[0] for row in blocks)

    def pullback_function(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
        out, aux, matrix, point, _ = self._matrix(fn, xs)

        def vjp(touts: Any) -> Leaves:
            leaves = touts if isinstance(touts, tuple) else (touts,)
            t = (
                np.concatenate([np.asarray(_arrays.to_numpy(leaf), dtype=np.float64).reshape(-1) for leaf in leaves])
                if leaves
                else np.zeros(0)
            )
            return _split(t @ matrix, point)

        return out, aux, vjp

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        point, out, aux, value, layout = self._start(fn, xs)
        direction = _Point(txs).vector if txs else np.zeros(0)
        scale = float(np.max(np.abs(direction))) if direction.size else 0.0
        if scale == 0.0:
            h = 0.0
        elif self.fixed_step is not None:
            h = self.fixed_step / scale
        else:
            power = 2.0 if self.method == "complex" else _POWER[self.method]
            eps = float(np.max(point.eps)) if point.size else np.finfo(np.float64).eps
            h = eps**power * max(1.0, float(np.max(np.abs(point.vector)))) / scale
        column = next(self._columns(fn, point, iter([(direction, h)]), value, layout)) if h else None
        layout = self._layout(out, layout)
        if column is None:
            column = np.zeros(sum(math.prod(shape) for shape, _ in layout))
        touts = _split_out(column, layout)
        return out, aux, touts if layout.tuple_out else touts[0]

    # -- second order ---------------------------------------------------------------------------

    def value_gradient_and_hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves, Blocks]:
        point = _Point(xs)
        out, aux, f0, _ = self._value(fn, point)
        _, _, grads = self.value_and_gradient(fn, xs)
        x, n = point.vector, point.size
        h = point.steps(1 / 4, self.fixed_step)
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
        layout = [(shape, np.dtype(np.float64)) for shape in point.shapes]
        return out, aux, grads, _hessian_blocks(hessian, point, layout)

    def gradient_and_hvp(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Leaves, Leaves]:
        point = _Point(xs)
        out, aux, grads = self.value_and_gradient(fn, xs)
        v = _Point(txs).vector if txs else np.zeros(0)
        scale = float(np.max(np.abs(v))) if v.size else 0.0
        hv = np.zeros(point.size)
        if scale:
            x = point.vector
            eps = float(np.max(point.eps))
            t = (self.fixed_step or eps**0.25 * max(1.0, float(np.max(np.abs(x))))) / scale
            h = point.steps(1 / 4, self.fixed_step)
            f = functools.partial(self._first, fn, point)
            for i in range(point.size):
                ei = np.zeros(point.size)
                ei[i] = h[i]
                tv = t * v
                hv[i] = (f(x + tv + ei) - f(x + tv - ei) - f(x - tv + ei) + f(x - tv - ei)) / (4 * t * h[i])
        return out, aux, grads, _split(hv, point)

    def value_derivative_and_second_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
        point = _Point(xs)
        out, aux, f0, layout = self._value(fn, point)
        _, _, derivs = self.value_and_derivative(fn, xs)
        h = point.steps(1 / 4, self.fixed_step)
        x = point.vector
        second = (
            (self._evaluate(fn, point, x + h) - 2 * f0 + self._evaluate(fn, point, x - h)) / (h[0] * h[0])
            if point.size
            else f0 * 0
        )
        return out, aux, derivs, _split_out(second, layout)


# -- reshaping flat results --------------------------------------------------------------------


def context_like_x(leaf: Any, like: Any) -> tuple[Any, bool]:
    """A numpy context leaf in x's framework, so that f sees one framework."""
    if isinstance(leaf, np.ndarray) and _arrays.kind(like) in ("torch", "jax"):
        return _arrays.from_numpy(leaf, like, dtype=_same_dtype(leaf, like)), True
    return leaf, _arrays.is_array(leaf)


def _same_dtype(array: np.ndarray, like: Any) -> Any:
    if _arrays.kind(like) == "torch":
        return getattr(sys.modules["torch"], array.dtype.name, None)
    return array.dtype


def _split(vector: np.ndarray, point: _Point) -> Leaves:
    """A flat vector shaped as x (numpy pieces; the caller converts to x's kinds)."""
    return tuple(
        vector[point.offsets[i] : point.offsets[i + 1]].reshape(point.shapes[i]) for i in range(len(point.shapes))
    )


def _split_out(vector: np.ndarray, layout: list[Any]) -> Leaves:
    """A flat vector shaped as f(x), each piece in its output leaf's dtype."""
    pieces, start = [], 0
    for shape, dtype in layout:
        size = math.prod(shape)
        pieces.append(vector[start : start + size].reshape(shape).astype(dtype))
        start += size
    return tuple(pieces)


def _blocks(matrix: np.ndarray, layout: list[Any], point: _Point) -> Blocks:
    rows, start = [], 0
    for shape, dtype in layout:
        size = math.prod(shape)
        row = matrix[start : start + size]
        rows.append(
            tuple(
                row[:, point.offsets[j] : point.offsets[j + 1]].reshape((*shape, *point.shapes[j])).astype(dtype)
                for j in range(len(point.shapes))
            )
        )
        start += size
    return tuple(rows)


def _hessian_blocks(matrix: np.ndarray, point: _Point, layout: list[Any]) -> Blocks:
    """Blocks ``(i, j)`` in the dtype of x's leaves (float32 x gets a float32 Hessian)."""
    dtypes = point.dtypes
    return tuple(
        tuple(
            matrix[point.offsets[i] : point.offsets[i + 1], point.offsets[j] : point.offsets[j + 1]]
            .reshape((*point.shapes[i], *point.shapes[j]))
            .astype(np.result_type(dtypes[i], dtypes[j]))
            for j in range(len(point.shapes))
        )
        for i in range(len(point.shapes))
    )


@contextlib.contextmanager
def _no_grad() -> Iterator[None]:
    """``torch.no_grad()`` when torch is loaded: f is evaluated, never traced."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    with torch.no_grad():
        yield
