"""Finite differences on the input's own array type.

``x`` is flattened to one float64 numpy vector (``_Point``); every perturbed point is turned
back into leaves of x's own kinds (torch tensors, jax arrays, numpy arrays, Python floats)
before ``f`` is called, so a function written for any framework can be differentiated.
``x`` itself is never touched: perturbations are applied to copies.

Steps, per coordinate, balance truncation against rounding: ``eps**p * max(1, |x_i|)`` with
``eps`` the machine epsilon of the leaf's dtype and ``p = 1/3`` (central), ``1/2`` (forward,
backward), ``1/4`` (second differences); each step is rounded so that ``x_i + h`` is exact.

``f`` must only read what it is handed. numpy points and numpy Constants reach it read-only
(a write raises numpy's "read-only" ValueError, turned into :class:`MutationError`); torch
points and Constants are watched through their version counters (and Constants are copies,
so the caller's tensor never changes); jax arrays are immutable. Every evaluation point is a
fresh array, so no evaluation can shift the next.

Sizes are bounded (:data:`MAX_INPUTS`, :data:`MAX_HESSIAN_INPUTS`, :data:`MAX_VECTORIZED_INPUTS`,
:data:`MAX_JACOBIAN_ENTRIES`): above them the call is refused before anything is allocated,
unless the backend's ``max_inputs`` option raises the input limit.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import _arrays
from .._errors import (
    InputTooLargeError,
    InvalidBackendOptionError,
    InvalidInputError,
    InvalidOutputError,
    MutationError,
    UnsupportedOperationError,
)
from . import _base, _on_device
from ._base import Blocks, Deferred, Fn, Leaves

_POWER = {"central": 1 / 3, "forward": 1 / 2, "backward": 1 / 2}

MAX_INPUTS = 100_000
"""The most inputs (entries of x, all leaves together) finite differences take for first-order
operators: a gradient costs one or two evaluations of f per input."""
MAX_HESSIAN_INPUTS = 1_000
"""The most inputs for a Hessian by finite differences: it costs about 2 n² evaluations of f."""
MAX_VECTORIZED_INPUTS = 4_000
"""The most inputs with ``vectorize=True``: all 2 n perturbed points (2 n² numbers) are built at once."""
MAX_JACOBIAN_ENTRIES = 25_000_000
"""The most entries (outputs times inputs) of a Jacobian built by finite differences (200 MB in float64)."""


def check_size(backend: Any, xs: Leaves, operator: str, limit: int, what: str) -> None:
    """Refuse, before any allocation, an ``x`` with more inputs than ``limit`` (or the
    backend's ``max_inputs`` when set)."""
    n = sum(math.prod(_arrays.shape(x)) for x in xs)
    chosen = getattr(backend, "max_inputs", None)
    limit = limit if chosen is None else chosen
    if n > limit:
        raise InputTooLargeError(
            f"{operator} by {type(backend).__name__} of an x with {n:,} inputs: above the limit of "
            f"{limit:,} inputs ({what}). Use an automatic-differentiation backend (jax, torch, autograd), "
            "or check gradients along a few random directions with diffiface.test.check_gradients; for a "
            f"deliberate run, raise the limit with {type(backend).__name__}(max_inputs={n})."
        )


def check_entries(backend: Any, m: int, n: int) -> None:
    """Refuse a Jacobian of more than :data:`MAX_JACOBIAN_ENTRIES` entries (unless ``max_inputs`` is set)."""
    if getattr(backend, "max_inputs", None) is None and m * n > MAX_JACOBIAN_ENTRIES:
        raise InputTooLargeError(
            f"A Jacobian by {type(backend).__name__} of {m:,} outputs by {n:,} inputs has {m * n:,} entries: "
            f"above the limit of {MAX_JACOBIAN_ENTRIES:,}. Use vjp or jvp (one row or column), an "
            "automatic-differentiation backend, or, for a deliberate run, set "
            f"{type(backend).__name__}(max_inputs=...)."
        )


# -- what f must not write into -------------------------------------------------------------


class _Watch:
    """The arrays of one call that f must only read: torch Constant copies with their version
    counters, and whether numpy Constants were handed over read-only."""

    __slots__ = ("numpy_constants", "tensors")

    def __init__(self) -> None:
        self.tensors: list[tuple[Any, int | None]] = []
        self.numpy_constants = False


_pending = threading.local()
"""Constants converted for the call about to run in this thread; its closed ``fn`` takes them
at its first evaluation (conversion happens right before the adapter runs, so a nested call's
Constants go to the nested ``fn``)."""


def _pending_watch() -> _Watch:
    watch = getattr(_pending, "watch", None)
    if watch is None:
        watch = _pending.watch = _Watch()
    return watch


def _watch_of(fn: Any) -> _Watch:
    watch = getattr(fn, "_diffiface_watch", None)
    if watch is None:
        watch = getattr(_pending, "watch", None) or _Watch()
        _pending.watch = None
        with contextlib.suppress(AttributeError):
            fn._diffiface_watch = watch
    return watch  # type: ignore[no-any-return]


def _read_only(array: Any) -> Any:
    """A read-only view of a numpy array (other leaves as they are)."""
    if type(array) is np.ndarray:
        view = array.view()
        view.flags.writeable = False
        return view
    return array


def _version(tensor: Any) -> int | None:
    try:
        return tensor._version  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):  # inference tensors keep no version counter
        return None


def _is_read_only_write(exc: BaseException) -> bool:
    return type(exc) is ValueError and str(exc).endswith("read-only")


def run_f(fn: Any, leaves: Leaves, backend_name: str, batched: bool = False) -> Any:
    """``fn(leaves)`` (or ``fn.batched``) under ``torch.no_grad()``, refusing writes into the
    leaves (handed read-only or watched) and into the call's Constants."""
    watch = _watch_of(fn)
    tensors = [(t, _version(t)) for t in leaves if _arrays.kind(t) == "torch"] if "torch" in sys.modules else []
    try:
        with _no_grad():
            out = fn.batched(leaves) if batched else fn(leaves)
    except ValueError as exc:
        if _is_read_only_write(exc) and (watch.numpy_constants or any(type(a) is np.ndarray for a in leaves)):
            what = "its input x or a di.Constant" if watch.numpy_constants else "its input x"
            raise MutationError(
                f"f wrote into {what} (numpy: {exc!s}), which it must only read. The {backend_name} backend "
                "evaluates f at points near x and hands them to f read-only, since a write would shift the "
                "points that follow. Compute out of place (y = x * 2, not x *= 2), or pass scratch space "
                "as di.Cache(array)."
            ) from exc
        raise
    for tensor, version in tensors:
        if version is not None and _version(tensor) != version:
            raise MutationError(_torch_write(backend_name, "its input x"))
    for tensor, version in watch.tensors:
        if _version(tensor) != version:
            raise MutationError(_torch_write(backend_name, "a di.Constant"))
    return out


def _torch_write(backend_name: str, what: str) -> str:
    return (
        f"f wrote into {what} in place (its tensor's version counter moved: an operation such as "
        f"x.add_(1), x *= 2 or x[0] = 0), which it must only read. The {backend_name} backend evaluates f "
        "at points near x, and a write would shift the points that follow. Compute out of place "
        "(y = x * 2), or pass scratch space as di.Cache(tensor)."
    )


def constant_like_x(leaf: Any, like: Any) -> tuple[Any, bool]:
    """A Constant's leaf for f: numpy read-only (or, for torch x, a watched torch copy), torch
    a watched copy; so f can write into none of the caller's arrays unnoticed."""
    if type(leaf) is np.ndarray:
        target = _arrays.kind(like)
        if target == "torch":
            tensor = _arrays.from_numpy(np.array(leaf), like, dtype=_same_dtype(leaf, like))
            _pending_watch().tensors.append((tensor, _version(tensor)))
            return tensor, True
        if target == "jax":
            return context_like_x(leaf, like)  # jax copies into an immutable array
        _pending_watch().numpy_constants = True
        return _read_only(leaf), True
    if _arrays.kind(leaf) == "torch":
        tensor = leaf.detach().clone()
        _pending_watch().tensors.append((tensor, _version(tensor)))
        return tensor, True
    return context_like_x(leaf, like)


def _traced_by_torch(x: Any) -> bool:
    """Whether a tensor carries an outer torch differentiation, which evaluating f on numbers
    would cut: it was computed from tensors that require grad, or is the input of an enclosing
    diffiface torch call, or a torch.func tensor (these have no storage), or a forward-mode
    dual. A leaf the caller made requiring grad (a module's parameter) is not: its finite
    differences are numbers, as a checker expects."""
    torch = sys.modules["torch"]
    if x.requires_grad and torch.is_grad_enabled():
        if x.grad_fn is not None:
            return True
        adapter = sys.modules.get("diffiface._adapters.torch")
        if adapter is not None and adapter.inside_a_call():
            return True
    if x.device.type != "meta":
        try:
            x.data_ptr()
        except RuntimeError:
            return True
    return torch.autograd.forward_ad.unpack_dual(x).tangent is not None


def _inside_torch() -> UnsupportedOperationError:
    return UnsupportedOperationError(
        "Finite differences were asked for inside a torch differentiation (x carries torch's "
        "graph, a torch.func transform or a forward-mode dual): torch cannot differentiate "
        "through them, and the outer derivative would silently lose this part. Differentiate "
        "the inner function with AutoTorch() too, or make the outer call finite differences "
        "(di.SecondOrder(di.AutoFiniteDifferences(), di.AutoTorch()) for second order)."
    )


class _Point:
    """``x`` as one float64 vector, with the way back to leaves of x's kinds and dtypes."""

    def __init__(self, xs: Leaves, promote: bool = False) -> None:
        _refuse_sharded(xs)
        for x in xs:
            if _arrays.kind(x) == "jax" and isinstance(x, sys.modules["jax"].core.Tracer):
                raise UnsupportedOperationError(
                    "Finite differences were asked for inside a jax transformation (x is a traced jax "
                    "array): they evaluate f at numbers, which jax cannot trace. Differentiate the inner "
                    "function with AutoJAX() too, or make the outer call finite differences "
                    "(di.SecondOrder(di.AutoFiniteDifferences(), di.AutoJAX()) for second order)."
                )
            if _arrays.kind(x) == "torch" and _traced_by_torch(x):
                raise _inside_torch()
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
            leaves.append(_read_only(_arrays.from_numpy(piece, like, dtype=dtype)))
        return tuple(leaves)

    def batch_leaves(self, points: np.ndarray) -> Leaves:
        """Leaves holding ``k`` points along a new leading axis (``points`` is ``(k, n)``)."""
        complex_step = np.iscomplexobj(points)
        k = points.shape[0]
        leaves = []
        for i, like in enumerate(self.likes):
            piece = points[:, self.offsets[i] : self.offsets[i + 1]].reshape((k, *self.shapes[i]))
            if isinstance(like, float):
                leaves.append(_read_only(piece))
                continue
            dtype = _complex_dtype(like) if complex_step else None
            leaves.append(_read_only(_arrays.from_numpy(piece, like, dtype=dtype)))
        return tuple(leaves)

    def steps(self, power: float, fixed: float | None, exact: bool = True) -> np.ndarray:
        if fixed is not None:
            steps = np.full(self.size, float(fixed))
        else:
            steps = self.eps**power * np.maximum(1.0, np.abs(self.vector))
        return self._exact(steps) if exact else steps

    def check_step(self, backend: Any, steps: np.ndarray, where: np.ndarray | None = None) -> None:
        """Refuse a fixed step that rounds to 0 (``x_i + h == x_i`` in x's dtype) on some input
        (among ``where``): its derivative would come out 0."""
        lost = (steps == 0) & np.isfinite(self.vector)
        if where is not None:
            lost &= where
        if not lost.any():
            return
        spacing = np.zeros(self.size)
        for i, dtype in enumerate(self.dtypes):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            spacing[lo:hi] = np.spacing(np.abs(self.vector[lo:hi]).astype(dtype)).astype(np.float64)
        smallest = float(np.max(spacing[lost]))
        raise InvalidBackendOptionError(
            f"{type(backend).__name__}(step={backend.step!r}) is too small for this x: x_i + step == x_i in "
            f"x's dtype for {int(lost.sum())} of its {self.size} inputs, whose derivatives would come out 0. "
            f"The smallest step that moves every input is {smallest:.3g} (one spacing of floating-point "
            "numbers there); a much larger one balances rounding against truncation. Or use step=None to "
            "choose each input's step from its dtype and magnitude."
        )

    def check_complex_step(self, backend: Any, step: float) -> None:
        """Refuse a complex step below the smallest normal number of x's dtype: ``Im f(x + ih)``
        would lose its precision (or vanish) there."""
        tiny = max((float(np.finfo(np.result_type(d, np.float32)).tiny) for d in self.dtypes), default=0.0)
        if step < tiny:
            raise InvalidBackendOptionError(
                f"{type(backend).__name__}(step={backend.step!r}, method='complex') is too small for this x: "
                f"the imaginary parts of f would be subnormal or 0. Use a step of at least {tiny:.3g} "
                "(1e-20 serves nearly every function), or step=None."
            )

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
    complex_convention = "split"  # a complex leaf is differenced along its real and imaginary axes
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

    def constant_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        return constant_like_x(leaf, like)

    def _check_size(self, xs: Leaves, operator: str, hessian: bool = False) -> None:
        if hessian:
            check_size(self.backend, xs, operator, MAX_HESSIAN_INPUTS, "a Hessian costs about 2 n² evaluations of f")
        elif self.vectorize:
            check_size(
                self.backend,
                xs,
                operator,
                MAX_VECTORIZED_INPUTS,
                "with vectorize=True all 2 n² perturbed numbers are built at once",
            )
        else:
            check_size(self.backend, xs, operator, MAX_INPUTS, "one or two evaluations of f per input")

    # -- evaluations ----------------------------------------------------------------------------

    def run(self, fn: Fn, leaves: Leaves) -> tuple[Any, Any]:
        """f at ``leaves``, guarded (:func:`run_f`)."""
        return run_f(fn, leaves, self.backend.name)  # type: ignore[no-any-return]

    def _call(self, fn: Fn, point: _Point, vector: np.ndarray) -> tuple[Any, Any]:
        return run_f(fn, point.leaves(vector), self.backend.name)  # type: ignore[no-any-return]

    def _evaluate(self, fn: Fn, point: _Point, vector: np.ndarray, layout: _Layout | None = None) -> np.ndarray:
        """``f`` at ``vector``, flat, in float64 (the imaginary part for a complex step).
        Fills ``layout`` with the output's shapes and dtypes if it is empty, else checks that
        the output has the same shapes."""
        out, _ = self._call(fn, point, vector)
        flat, found = _flatten_out(out)
        if layout is not None:
            _fit(layout, found)
        if np.iscomplexobj(flat):
            return flat.imag if np.iscomplexobj(vector) else flat.real
        return flat.astype(np.float64)

    def _first(self, fn: Fn, point: _Point, vector: np.ndarray) -> float:
        """The first number of f at ``vector`` (a scalar f's value)."""
        return float(self._evaluate(fn, point, vector)[0])

    def _value(self, fn: Fn, point: _Point, layout: _Layout | None = None) -> tuple[Any, Any, np.ndarray, _Layout]:
        out, aux = self._call(fn, point, point.vector)
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
        x = point.vector
        column: np.ndarray
        if self.method == "central":
            plus = self._evaluate(fn, point, _shifted(x, direction, h), layout)
            column = (plus - self._evaluate(fn, point, _shifted(x, direction, -h), layout)) / (2 * h)
        elif self.method == "forward":
            assert value is not None
            column = (self._evaluate(fn, point, _shifted(x, direction, h), layout) - value) / h
        elif self.method == "backward":
            assert value is not None
            column = (value - self._evaluate(fn, point, _shifted(x, direction, -h), layout)) / h
        else:
            column = self._evaluate(fn, point, _shifted(x, direction, 1j * h), layout) / h
        return column

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

    def _needs_value(self) -> bool:
        return self.method in ("forward", "backward")

    def _start(self, fn: Fn, xs: Leaves) -> tuple[_Point, Any, Any, np.ndarray | None, _Layout]:
        """The point, ``f(x)`` (now if the method needs it, else deferred) and the layout of
        ``f(x)`` (filled by the first evaluation; every later one must fit it)."""
        point = _Point(xs)
        if self._needs_value():
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
        outs = run_f(fn, point.batch_leaves(points), self.backend.name, batched=True)
        arrays = [np.asarray(_arrays.to_numpy(out)) for out in outs]
        for array in arrays:
            if array.shape[:1] != (k,):
                raise InvalidOutputError(
                    f"With vectorize=True, f gets {k} points at once (a leading axis of length {k} on every "
                    f"leaf of x) and must return one output per point; it returned shape {array.shape}. Reduce "
                    "over the other axes only (say .sum(axis=-1)), or use vectorize=False."
                )
        found = _Layout((a.shape[1:], _real_dtype(a.dtype)) for a in arrays)
        found.tuple_out = layout.tuple_out if layout else len(arrays) != 1
        if layout:
            _fit(layout, found)
        else:
            layout.extend(found)
        flat = np.concatenate([a.reshape(k, -1) for a in arrays], axis=1) if arrays else np.zeros((k, 0))
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
        the only numbers brought together are scalars (the largest ``|x_i|`` and ``|t_i|``, for
        the step). f's outputs stay as f returned them (DTensors: on their mesh, as placed)."""
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
        scale_t = max((_largest(t) for t in txs), default=0.0)
        if not math.isfinite(scale_t):
            raise InvalidInputError(
                "A tangent of a DTensor x holds inf or NaN: one finite difference along it cannot give "
                "the product that forward mode would (inf or NaN only where f depends on those entries). "
                "Pass a finite tangent."
            )
        name = self.backend.name
        # f(x) on copies (f may not reach the caller's x), made only where f(x) is asked for
        evaluated = Deferred(lambda: run_f(fn, tuple(x.clone() for x in xs), name))
        if scale_t == 0.0:
            out = _base.force(evaluated.force()[0])
            zeros = tuple(torch.zeros_like(y) for y in _leaves_of(out))
            return out, evaluated.force()[1], zeros if isinstance(out, tuple) else zeros[0]
        eps = max(float(torch.finfo(x.dtype).eps) for x in xs)
        if self.fixed_step is not None:
            h = self.fixed_step / scale_t
        else:
            scale_x = max([1.0, *(_largest(x) for x in xs)])
            h = eps ** _POWER[self.method] * scale_x / scale_t

        def at(sign: float) -> Any:
            return run_f(fn, tuple(x + (sign * h) * t for x, t in zip(xs, txs, strict=True)), name)[0]

        def value() -> Any:
            return _base.force(evaluated.force()[0])

        plus = at(1.0) if self.method != "backward" else value()
        minus = at(-1.0) if self.method != "forward" else value()
        width = 1.0 if self.method != "central" else 2.0
        touts = tuple(
            ((a.to(torch.float64) - b.to(torch.float64)) / (width * h)).to(a.dtype)
            for a, b in zip(_leaves_of(plus), _leaves_of(minus), strict=True)
        )
        out = Deferred(value) if self.method == "central" else value()
        return out, Deferred(lambda: evaluated.force()[1]), touts if isinstance(plus, tuple) else touts[0]

    def _directional(
        self, fn: Fn, point: _Point, direction: np.ndarray, value: np.ndarray | None, layout: _Layout
    ) -> np.ndarray | None:
        """``J @ direction`` (a finite direction) by one difference along it; None when it is 0."""
        scale = float(np.max(np.abs(direction))) if direction.size else 0.0
        if scale == 0.0:
            return None
        if self.fixed_step is not None:
            h = self.fixed_step / scale
        else:
            power = 2.0 if self.method == "complex" else _POWER[self.method]
            eps = float(np.max(point.eps)) if point.size else np.finfo(np.float64).eps
            h = eps**power * max(1.0, float(np.max(np.abs(point.vector)))) / scale
        if self.fixed_step is not None:
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
        layout = [(shape, np.dtype(np.float64)) for shape in point.shapes]
        return out, aux, grads, _hessian_blocks(hessian, point, layout)

    def gradient_and_hvp(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Leaves, Leaves]:
        self._check_size(xs, "A Hessian-vector product")
        point = _Point(xs)
        out, aux, grads = self.value_and_gradient(fn, xs)
        v = _Point(txs).vector if txs else np.zeros(0)
        finite = np.isfinite(v)
        hv = self._hvp(fn, point, np.where(finite, v, 0.0))
        for i in np.flatnonzero(~finite):  # H[:, i] * v_i, as forward mode would: never masked
            unit = np.zeros(point.size)
            unit[i] = 1.0
            hv = hv + _times_non_finite(self._hvp(fn, point, unit), v[i])
        return out, aux, grads, _split(hv, point)

    def _hvp(self, fn: Fn, point: _Point, v: np.ndarray) -> np.ndarray:
        """``H @ v`` for a finite ``v``: differences of the gradient along ``v``."""
        scale = float(np.max(np.abs(v))) if v.size else 0.0
        hv = np.zeros(point.size)
        if not scale:
            return hv
        x = point.vector
        eps = float(np.max(point.eps))
        t = (self.fixed_step or eps**0.25 * max(1.0, float(np.max(np.abs(x))))) / scale
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


# -- DTensors (torch.distributed.tensor): collective directional differences only ------------


def _is_dtensor(leaf: Any) -> bool:
    kind = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return kind is not None and isinstance(leaf, kind)


def _sharded_torch(leaves: Leaves) -> bool:
    """Whether a leaf is a DTensor (checked only once torch.distributed.tensor is imported)."""
    return "torch.distributed.tensor" in sys.modules and any(
        _arrays.kind(x) == "torch" and _is_dtensor(x) for x in leaves
    )


def _refuse_sharded(xs: Leaves) -> None:
    jax = sys.modules.get("jax")
    if jax is not None and any(
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and len(x.sharding.device_set) > 1
        and not x.sharding.is_fully_replicated  # (a replicated array is read from one device)
        for x in xs
    ):
        raise UnsupportedOperationError(
            "x holds a jax array sharded over several devices: finite differences of a Jacobian, vjp, "
            "Hessian or hvp (and of a gradient or jvp with the complex step, a fixed step, vectorize=True "
            "or a non-finite tangent) build their matrices in numpy, which would gather x on the host. "
            "On sharded arrays, finite differences give di.gradient and di.jvp on the devices; "
            "diffiface.test.check_gradients(f, x, ...) checks a gradient along random directions on "
            "them; AutoJAX() gives every operator without moving x."
        )
    if _sharded_torch(xs):
        raise UnsupportedOperationError(
            "x holds a DTensor (a tensor sharded over processes): finite differences of a gradient, vjp, "
            "Jacobian or Hessian perturb x one entry at a time, which needs x gathered in one process. "
            "Check the gradient along random directions instead (collective, nothing gathered): "
            "diffiface.test.check_gradients(f, x, ...) does so for DTensors, or "
            "di.jvp(f, di.AutoFiniteDifferences(), x, t) with a DTensor tangent t gives one product."
        )


def _largest(tensor: Any) -> float:
    """``max |tensor_i|`` as a Python float, the same on every rank for a DTensor (one scalar
    all-reduce); 0 for an empty tensor."""
    if tensor.numel() == 0:
        return 0.0
    largest = tensor.detach().abs().max()
    if _is_dtensor(largest):
        largest = largest.redistribute(largest.device_mesh, [_replicate()] * largest.device_mesh.ndim).to_local()
    return float(largest)


def _replicate() -> Any:
    return sys.modules["torch.distributed.tensor"].Replicate()


def _leaves_of(out: Any) -> Leaves:
    return out if isinstance(out, tuple) else (out,)


def _times_non_finite(column: np.ndarray, t: float) -> np.ndarray:
    """``column * t`` for a non-finite ``t``, with exact zeros of ``column`` (outputs that do not
    depend on that input) kept 0, as a forward-mode engine gives them."""
    with np.errstate(invalid="ignore"):
        return np.where(column != 0, column * t, 0.0)  # type: ignore[no-any-return]


def _shifted(x: np.ndarray, direction: Any, amount: Any) -> np.ndarray:
    """A fresh ``x + amount * direction``; ``direction`` an array or the index of a unit vector."""
    if isinstance(direction, (int, np.integer)):
        shifted = x.astype(np.result_type(x, amount))  # a copy
        shifted[direction] += amount
        return shifted
    return x + amount * direction  # type: ignore[no-any-return]


def _fit(layout: _Layout, found: _Layout) -> None:
    """Fill an empty ``layout`` with ``found``, or check that f's output kept its shapes."""
    if not layout:
        layout.extend(found)
        layout.tuple_out = found.tuple_out
        return
    before, after = [shape for shape, _ in layout], [shape for shape, _ in found]
    if before != after:
        raise InvalidOutputError(
            f"f's output changed shape between evaluations at nearby points: {_shapes(before)} at one, "
            f"{_shapes(after)} at another. Its derivative does not exist there (an output whose length "
            "depends on x's values, as x[x > 0], jumps). Return an output whose shape does not depend "
            "on x's values (say np.where(x > 0, x, 0) instead of x[x > 0])."
        )


def _shapes(shapes: list[tuple[int, ...]]) -> str:
    return ", ".join(f"shape {shape}" for shape in shapes) if shapes else "no output"


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
