"""Global sparsity detection for numpy- and autograd.numpy-written functions: ``f`` runs once on
:class:`IndexSetArray`, an array type that holds no values, only the index sets of its elements
(``_index_sets``), and follows numpy's ``__array_ufunc__`` and ``__array_function__`` protocols.
autograd.numpy calls numpy's own functions on arguments that are not autograd's boxes, so the
same type follows autograd-written code.

Rules: ufuncs unite their operands' sets (broadcast); functions that only move elements
(concatenate, stack, roll, pad, take, indexing with known indices...) are run by numpy on arrays
of positions; reductions, cumulative functions, diff, dot/matmul, einsum (tensordot, inner,
kron), convolve, correlate, polyval and sort have their own rules; any other function, and any
whose rule does not fit its operands, is dense (``sets.Trace.dense``). Comparisons give booleans
whose values are not known: a Python ``if`` on them, ``float(x[0])``, or indexing with them is
refused with the reason, since the pattern could change with x. Anything else that stops the
trace (a function that fails on sample values, ``.strides``) is a :class:`TracerFailure`: the
whole function is then dense.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.lib.mixins

from .. import _arrays, tree
from .._errors import InvalidOutputError, UnsupportedOperationError
from .._families import autograd as _autograd
from . import _index_sets as sets
from ._graphs import Detection, leaf_function

__all__ = ["IndexSetArray", "TracerFailure", "dense_pattern", "trace_pattern"]


_ACTIVE = threading.local()
"""The trace running in this thread (``_ACTIVE.trace``), told of each refusal and failure."""


class _Raised(Exception):
    caught = False
    """Whether f caught one of the tracer's exceptions (this one, or a refusal before it) and went on."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # kept where f catches it: the branch f takes instead is not what f does at x
        trace = getattr(_ACTIVE, "trace", None)
        if trace is not None and trace.raised is None:
            trace.raised = self
        if trace is not None and trace.refused is None and isinstance(self, TracerRefusal):
            trace.refused = self


class TracerRefusal(_Raised):
    """f did something whose result depends on values the detector does not have."""


class _Writes(TracerRefusal):
    """f writes into an array in place as numpy does (its views see the write): no other
    tracer's semantics (jax's copies) would follow it either."""


class _Converts(TracerRefusal, TypeError):
    """f turns an array of the tracer into a plain array: jax.numpy's functions do, so jax may
    read f instead. A TypeError, as jax's own for its tracers: an ``except TypeError`` in f
    that would catch jax's catches this one, and so counts as caught."""


def another_tracer_may_follow(error: BaseException) -> bool:
    """Whether another tracer may read f after this one stopped with ``error``: only where f
    handed x's arrays to another library (whose functions convert them, or fail on them: a
    :class:`TracerFailure`) and caught none of the tracer's refusals. A refusal for a value or a
    write stands, as does anything f caught: another tracer's exceptions could send f down a
    branch (its ``except``) that is not what f does at x."""
    stopped = error if isinstance(error, TracerFailure) else error.__cause__
    return isinstance(stopped, (_Converts, TracerFailure)) and not stopped.caught


class TracerFailure(_Raised):
    """The tracer cannot follow f, not even as a dense operation: the whole function is taken as
    dense (every output depending on every input)."""


class _MissingAttribute(TracerFailure, AttributeError):
    """An array attribute the tracer has no counterpart for (``.strides``, ``.flags``): an
    AttributeError to ``hasattr``, and the whole function dense even where f catches it."""


class _Trace(sets.Trace):
    def __init__(self, n: int, hessian: bool) -> None:
        super().__init__(n, hessian, "numpy")
        self.raised: _Raised | None = None
        self.refused: TracerRefusal | None = None


_METHODS = {
    "sum", "mean", "prod", "max", "min", "std", "var", "cumsum", "cumprod", "clip", "ravel", "squeeze", "swapaxes", "dot",
}  # fmt: skip
"""The array methods that are numpy's functions of the array (``a.sum(...)``: ``np.sum(a, ...)``)."""

_LINEAR_UFUNCS = {"add", "subtract", "negative", "positive", "conjugate", "real"}
_PIECEWISE_LINEAR = {"absolute", "fabs", "maximum", "minimum", "fmax", "fmin", "clip", "sign", "floor", "ceil"}


def _refusing(what: str) -> Callable[..., Any]:
    """The array method that refuses, with the reason, what f does with a value (``what``)."""

    def refuse(self: IndexSetArray, *args: Any) -> Any:
        raise self._refuse(what)

    return refuse


class IndexSetArray(numpy.lib.mixins.NDArrayOperatorsMixin):
    """An array of index sets: ``rows`` (elements x inputs, boolean csr) or ``None`` (depends on
    no input). ``known`` is False for booleans and integers computed from x: their values are
    not known."""

    __array_priority__ = 1000

    def __init__(self, trace: _Trace, shape: Sequence[int], rows: Any, dtype: Any = np.float64, view: bool = False):
        self.trace = trace
        self.shape = tuple(int(s) for s in shape)
        self.rows = rows
        self.dtype = np.dtype(dtype)
        self.is_view = view
        self.base: IndexSetArray | None = None
        """Where this is an indexed view of a traced array, that array (the root of its views),
        and ``where``, this view's positions in it: a write into the base is read again."""
        self.where: Any = None
        self.views: list[weakref.ref[IndexSetArray]] = []
        self.reshaped = False  # a reshaped or transposed view of it was taken (not followed)

    # -- array attributes ----------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return sets.size(self.shape)

    @property
    def floating(self) -> bool:
        return self.dtype.kind in "fc"

    @property
    def T(self) -> IndexSetArray:
        return np.transpose(self)  # type: ignore[return-value]

    @property
    def real(self) -> IndexSetArray:
        return self

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __iter__(self) -> Any:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"IndexSetArray(shape={self.shape}, dtype={self.dtype})"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # protocols probed by numpy and others: absent, not a failure
            raise AttributeError(name)
        if name in _METHODS:  # a.sum(...): np.sum(a, ...), on the tracer through __array_function__
            return functools.partial(getattr(np, name), self)
        raise _MissingAttribute(f"f reads .{name} of an array computed from x, which the tracer does not have")

    # -- what depends on values: refused ---------------------------------------------------------

    def _refuse(self, what: str) -> TracerRefusal:
        return TracerRefusal(f"f {what} of an array computed from x; the pattern could then change with x's values")

    __bool__ = _refusing("branches (a Python `if`, `and`, `or`, `while`) on a value")
    __float__ = _refusing("converts to a Python number (float(...)) a value")
    __int__ = _refusing("converts to a Python number (int(...)) a value")
    __index__ = _refusing("uses as an index a value")
    item = _refusing("reads a Python number (.item()) from a value")
    tolist = _refusing("reads Python numbers (.tolist()) from the values")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise _Converts(
            "f turns an array computed from x into a plain numpy array (np.array(...), np.asarray(...), "
            "writing it into an array made with np.zeros(...) or np.empty(...)), which drops what it depends "
            "on; make such arrays with np.zeros_like(x) (or concatenate the pieces) instead"
        )

    # -- methods -----------------------------------------------------------------------------------

    def view(self, *args: Any) -> IndexSetArray:
        return self

    def copy(self) -> IndexSetArray:
        return IndexSetArray(self.trace, self.shape, self.rows, self.dtype)

    def astype(self, dtype: Any, **kwargs: Any) -> IndexSetArray:
        dtype = np.dtype(dtype)
        if kwargs.get("copy", True) is False and dtype == self.dtype:
            return self  # (numpy's own array, not a copy: a later write into either is seen by both)
        return IndexSetArray(self.trace, self.shape, self.rows if dtype.kind in "fc" else None, dtype)

    def reshape(self, *shape: Any, **kwargs: Any) -> Any:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return np.reshape(self, shape, **kwargs)

    def flatten(self, order: Any = "C") -> Any:
        return np.ravel(self, order).copy()  # type: ignore[call-overload]

    def transpose(self, *axes: Any) -> Any:
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return np.transpose(self, axes or None)

    conj = view

    def _writes_in_place(self, *args: Any, **kwargs: Any) -> Any:
        raise _Writes("f sorts, fills or resizes an array in place, which the detector does not follow")

    sort = fill = put = partition = resize = itemset = _writes_in_place

    # -- indexing ----------------------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Any:
        unknown = _unknown_indices(key)
        if unknown is not None:  # integers whose values are not known: any element may be read
            where = sets.positions(self.shape)[unknown]
            rows = sets.all_of(self.rows, where.size) if self.rows is not None else None
            return IndexSetArray(self.trace, np.shape(where), rows, self.dtype)
        key = _index_key(key)
        where = sets.positions(self.shape)[key]
        rows = sets.gather([self.rows], [self.size], where, self.trace.n) if self.rows is not None else None
        view = not _fancy(key) and np.ndim(where) > 0  # (one element, a number, is a copy)
        out = IndexSetArray(self.trace, np.shape(where), rows, self.dtype, view=view)
        if view:  # (numpy's view sees a later write into the array: it is read again then)
            root = self if self.base is None else self.base
            out.base, out.where = root, where if self.base is None else self.where[key]
            root.views.append(weakref.ref(out))
        return out

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.reshaped:
            raise _Writes(
                "f writes into an array after taking a reshaped or transposed view of it (v = a.T; "
                "a[0] = ...), which the detector does not follow; take a copy (a.T.copy())"
            )
        if self.is_view:
            raise _Writes(
                "f writes into a slice or view of an array (y = a[1:]; y[0] = ...), which the detector does "
                "not follow back to the array; write into the array itself (a[1] = ...)"
            )
        key = _index_key(key)
        own = sets.positions(self.shape)
        value_shape = np.shape(own[key])
        if isinstance(value, IndexSetArray):
            source = value.rows
            value_positions = np.broadcast_to(sets.positions(value.shape, self.size), value_shape)
            size = value.size
        else:
            if _holds_tracer(value):  # (a list of numbers computed from x: what each depends on is not read)
                raise _Converts(
                    "f writes a list or tuple of values computed from x into an array (a[1:] = [x[0], ...]), "
                    "which the detector does not follow; write an array (np.stack([...]) of them) instead"
                )
            source = None
            value_positions = np.zeros(value_shape, dtype=np.int64)
            size = 0
        own[key] = value_positions
        self.rows = sets.gather([self.rows, source], [self.size, size], own, self.trace.n)
        for ref in self.views:  # (each view of this array, read again)
            view = ref()
            if view is not None:
                view.rows = sets.gather([self.rows], [self.size], view.where, self.trace.n)

    # -- the protocols ---------------------------------------------------------------------------

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if kwargs.get("out") is not None:
            raise _Writes(
                f"f writes the result of np.{ufunc.__name__} into out=... (or x += ...), which the detector "
                "does not follow; compute a new array (y = x + ...)"
            )
        if _holds_tracer(list(kwargs.values())):  # (initial=, where=: values the rules below do not read)
            return _dense(self.trace, ufunc if method == "__call__" else getattr(ufunc, method), inputs, kwargs)
        if method == "__call__":
            # (a gufunc, np.vecdot: over its core axes; matmul with axes= or axis= moves its core
            # axes, which the product's rule, on the last two, does not follow)
            if ufunc.signature is not None and (ufunc.__name__ != "matmul" or {"axes", "axis"} & set(kwargs)):
                return _dense(self.trace, ufunc, inputs, kwargs)
            try:
                if ufunc.__name__ == "matmul":
                    return _matmul(self.trace, inputs[0], inputs[1])
                return _ufunc(self.trace, ufunc, inputs, kwargs)
            except TracerRefusal:
                raise
            except Exception:  # a rule that does not fit these operands: conservative instead
                return _dense(self.trace, ufunc, inputs, kwargs)
        if method == "reduce":
            linear = ufunc.__name__ in _LINEAR_UFUNCS
            return _reduce(self.trace, inputs[0], kwargs.get("axis", 0), kwargs.get("keepdims", False), linear)
        if method == "accumulate":
            return _cumulative(self.trace, inputs[0], kwargs.get("axis", 0), ufunc.__name__ == "add")
        if method == "outer":
            a, b = (_lift(self.trace, v) for v in inputs[:2])
            a2 = np.reshape(a, a.shape + (1,) * b.ndim)
            return _ufunc(self.trace, ufunc, (a2, b), kwargs)
        raise TracerRefusal(f"f calls np.{ufunc.__name__}.{method}, which the detector does not follow")

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        name = func.__name__
        # (out= by position too: np.sum(x, 0, None, o) writes into o, which f may return)
        if name in _WRITES or _by_name(func, args, kwargs).get("out") is not None:
            raise _Writes(
                f"f writes into an array with np.{name}{'' if name in _WRITES else '(..., out=...)'}, which "
                "the detector does not follow; compute a new array instead (np.where, concatenation)"
            )
        handler = _FUNCTIONS.get(name)
        if handler is None and name in _MOVES and not _computes_values(name, args, kwargs):
            handler = _move
        if handler is None:
            return _dense(self.trace, func, args, kwargs)
        try:
            return handler(self.trace, func, args, kwargs)
        except TracerRefusal:
            raise
        except Exception:  # a rule that does not fit these operands: conservative instead
            return _dense(self.trace, func, args, kwargs)


# --- helpers ----------------------------------------------------------------------------------------


def _holds_tracer(value: Any) -> bool:
    """Whether ``value`` is, or a list or tuple holds (at any depth), an array computed from x."""
    if isinstance(value, IndexSetArray):
        return True
    return isinstance(value, (list, tuple)) and any(map(_holds_tracer, value))


def _unknown_indices(key: Any) -> Any:
    """``key`` with each integer IndexSetArray replaced by zeros of its shape (what gives the
    result's shape), or None where there is none."""
    keys = key if isinstance(key, tuple) else (key,)
    if not any(isinstance(k, IndexSetArray) and k.dtype.kind in "iu" for k in keys):
        return None
    replaced = tuple(
        np.zeros(k.shape, dtype=np.int64) if isinstance(k, IndexSetArray) and k.dtype.kind in "iu" else k for k in keys
    )
    return replaced if isinstance(key, tuple) else replaced[0]


def _index_key(key: Any) -> Any:
    for k in key if isinstance(key, tuple) else (key,):
        if isinstance(k, IndexSetArray):
            raise k._refuse("indexes with values (a boolean mask or integers)")
    return key


def _fancy(key: Any) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (list, np.ndarray)) for k in keys)


def _lift(trace: _Trace, value: Any) -> IndexSetArray:
    if isinstance(value, IndexSetArray):
        return value
    array = np.asarray(value)
    return IndexSetArray(trace, array.shape, None, array.dtype if array.dtype.kind in "fcbiu" else np.float64)


def _known(value: Any) -> bool:
    return not isinstance(value, IndexSetArray)


def _shape_of(value: Any) -> tuple[int, ...]:
    return value.shape if isinstance(value, IndexSetArray) else np.shape(value)


def _ufunc(trace: _Trace, ufunc: Any, inputs: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    out_shape = np.broadcast_shapes(*(_shape_of(v) for v in inputs))
    float_inputs = [v for v in inputs if isinstance(v, IndexSetArray) and v.floating]
    broadcast = sets.elementwise([(v.rows, v.shape) for v in float_inputs], out_shape, trace.n)
    # the dtype numpy would give, from the operands' dtypes
    probes = [np.ones((), dtype=v.dtype) if isinstance(v, IndexSetArray) else v for v in inputs]
    with np.errstate(all="ignore"):
        try:
            sample = ufunc(*probes)
        except Exception:
            sample = np.ones(())
    samples = sample if isinstance(sample, tuple) else (sample,)
    name = ufunc.__name__
    complex_input = any(isinstance(v, IndexSetArray) and v.dtype.kind == "c" for v in inputs)
    # (|z| and z / |z| of a complex z are no piecewise linear maps of its parts; a quotient by a constant is)
    linear = name in _LINEAR_UFUNCS or (name in _PIECEWISE_LINEAR and not complex_input)
    linear = linear or (name in ("true_divide", "divide") and broadcast[-1] is None)
    rows = trace.unite(broadcast, linear, name == "multiply")
    dtypes = [np.asarray(s).dtype for s in samples]
    outputs = [IndexSetArray(trace, out_shape, rows if dtype.kind in "fc" else None, dtype) for dtype in dtypes]
    return tuple(outputs) if len(outputs) > 1 else outputs[0]


def _axes(axis: Any, ndim: int) -> list[int]:
    if axis is None:
        return list(range(ndim))
    if isinstance(axis, (tuple, list)):
        return [int(a) % max(ndim, 1) for a in axis]
    return [int(axis) % max(ndim, 1)]


def _reduce(trace: _Trace, a: Any, axis: Any, keepdims: bool, linear: bool) -> Any:
    a = _lift(trace, a)
    axes = _axes(axis, a.ndim) if a.ndim else []
    kept = tuple(1 if d in axes else s for d, s in enumerate(a.shape))
    out_shape = kept if keepdims else tuple(s for d, s in enumerate(a.shape) if d not in axes)
    rows = sets.apply(sets.reduction_matrix(a.shape, axes), a.rows)
    rows = rows if linear else trace.nonlinear(rows)
    return IndexSetArray(trace, out_shape, rows, a.dtype if a.floating else np.float64)


def _cumulative(trace: _Trace, a: Any, axis: Any, linear: bool, whole: bool = False) -> Any:
    """Each output depending on its line along ``axis`` up to it, or (``whole``: sort) on all of it."""
    a = _lift(trace, a)
    if axis is None:
        a, axis = np.ravel(a), 0
    rows = sets.along(a.rows, a.shape, int(axis), whole)
    rows = rows if linear else trace.nonlinear(rows)
    return IndexSetArray(trace, a.shape, rows, a.dtype)


def _argument(args: Any, kwargs: dict[str, Any], position: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _by_name(func: Any, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call of numpy's ``func``, each under its parameter's name, however it
    was given: ``np.mean(a, 1, None, None, True)`` passes keepdims by position, and a rule that
    read it from the keywords alone would shape the result as without it (another broadcast
    later: a pattern that misses entries). Where the signature cannot be read, the keywords."""
    signature = _signature(func)
    if signature is None:
        return dict(kwargs)
    try:
        return dict(signature.bind(*args, **kwargs).arguments)
    except TypeError:
        return dict(kwargs)


@functools.lru_cache(maxsize=512)
def _signature(func: Any) -> Any:
    """``inspect.signature(func)``, read once per function; None where it cannot be read."""
    import inspect

    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


def _sum(linear: bool) -> Any:
    def handler(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        given = _by_name(func, args, kwargs)  # (keepdims, out, where: by position too)
        weighted = func.__name__ == "average" and given.get("weights") is not None
        # (np.average(..., returned=True) returns the sum of the weights beside the average)
        returned = func.__name__ == "average" and bool(given.get("returned", False))
        # (initial=, where= computed from x, also by position: what they depend on is not read)
        followed = _holds_tracer(list(args[1:])) or _holds_tracer(list(kwargs.values()))
        if given.get("out") is not None or given.get("where") is not None or weighted or returned or followed:
            return _dense(trace, func, args, kwargs)  # (np.average's weights: a ratio of two sums)
        axis = given.get("axis")
        keepdims = given.get("keepdims", False)
        keepdims = False if keepdims is getattr(np, "_NoValue", None) else bool(keepdims)
        return _reduce(trace, args[0], axis, keepdims, linear)

    return handler


def _norm(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    a = _lift(trace, args[0])
    given = _by_name(func, args, kwargs)  # (keepdims by position too)
    axis = given.get("axis")
    if axis is None and a.ndim == 2 and given.get("ord") not in (None, "fro"):
        axis = (0, 1)
    return _reduce(trace, a, axis, bool(given.get("keepdims", False)), False)


def _along(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """np.cumsum, np.cumprod, np.sort (``whole``: each output on all of its line)."""
    whole = func.__name__ == "sort"
    axis = _argument(args, kwargs, 1, "axis", -1 if whole else None)
    return _cumulative(trace, args[0], axis, func.__name__ == "cumsum", whole)


def _diff(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    a: Any = _lift(trace, args[0])
    order = int(_argument(args, kwargs, 1, "n", 1))
    axis = int(_argument(args, kwargs, 2, "axis", -1)) % max(a.ndim, 1)
    prepend, append = (_argument(args, kwargs, 3 + k, name, None) for k, name in enumerate(("prepend", "append")))
    if prepend is not None or append is not None:  # (as numpy: a number spans the other axes)
        edge = tuple(1 if d == axis else s for d, s in enumerate(a.shape))
        before, after = (e if e is None or np.ndim(e) else np.broadcast_to(e, edge) for e in (prepend, append))
        a = np.concatenate([e for e in (before, a, after) if e is not None], axis)
    head = (slice(None),) * axis
    for _ in range(order):
        a = a[(*head, slice(1, None))] - a[(*head, slice(None, -1))]
    return a.copy()


def _dot(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    a, b = args[0], args[1]
    a_shape, b_shape = _shape_of(a), _shape_of(b)
    if len(a_shape) == 0 or len(b_shape) == 0:
        return np.multiply(a, b)
    if len(a_shape) <= 2 and len(b_shape) <= 2:
        return _matmul(trace, a, b)
    return _tensordot(trace, func, (a, b, ([-1], [-2 if len(b_shape) > 1 else -1])), {})


def _outer(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    a, b = (np.ravel(v) for v in args[:2])
    return np.multiply(np.reshape(a, (-1, 1)), b)


def _matmul(trace: _Trace, a: Any, b: Any) -> Any:
    a_shape, b_shape = _shape_of(a), _shape_of(b)
    if len(a_shape) >= 2 and len(b_shape) >= 2 and max(len(a_shape), len(b_shape)) > 3:
        batch = "abcdefghijklmnopqrstuvw"[: max(len(a_shape), len(b_shape)) - 2]
        a_batch, b_batch = batch[len(batch) - len(a_shape) + 2 :], batch[len(batch) - len(b_shape) + 2 :]
        return _einsum(trace, np.einsum, (f"{a_batch}xy,{b_batch}yz->{batch}xz", a, b), {})
    if not (1 <= len(a_shape) <= 3 and 1 <= len(b_shape) <= 3):
        return _dense(trace, np.matmul, (a, b), {})
    squeeze_front = len(a_shape) == 1
    squeeze_back = len(b_shape) == 1
    a3 = (1, 1, a_shape[0]) if squeeze_front else (1, *a_shape) if len(a_shape) == 2 else a_shape
    b3 = (1, b_shape[0], 1) if squeeze_back else (1, *b_shape) if len(b_shape) == 2 else b_shape
    if a3[0] != b3[0] and 1 not in (a3[0], b3[0]):
        return _dense(trace, np.matmul, (a, b), {})
    left, right = (
        (v.rows, None, s) if isinstance(v, IndexSetArray) else (None, np.asarray(v) != 0, s)
        for v, s in ((a, a3), (b, b3))
    )
    rows = sets.matmul(left, right, trace.n, trace.pairs)
    out = [max(a3[0], b3[0]), a3[1], b3[2]]
    if len(a_shape) < 3 and len(b_shape) < 3:
        out = out[1:]
    if squeeze_back:
        out = out[:-1]
    if squeeze_front:
        out = out[:-1] if squeeze_back else out[:-2] + out[-1:]
    return IndexSetArray(trace, tuple(out), rows)


def _convolve(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """np.convolve(a, v, mode) and np.correlate(a, v, mode): each output a sum of products
    ``a[i] * v[j]`` (:func:`_sliding_products`); a constant operand's zeros drop their terms."""

    a, v = args[0], args[1]
    mode = _argument(args, kwargs, 2, "mode", "full" if func.__name__ == "convolve" else "valid")
    la, lv = int(np.size(a) if _known(a) else a.size), int(np.size(v) if _known(v) else v.size)
    length, k, i, j = _sliding_products(la, lv, mode, func.__name__ == "convolve")
    nonzero = np.ones(k.size, dtype=bool)
    for operand, index in ((a, i), (v, j)):
        if _known(operand):
            nonzero &= np.ravel(np.asarray(operand))[index] != 0
    k, i, j = k[nonzero], i[nonzero], j[nonzero]
    parts = []
    for operand, index, size in ((a, i, la), (v, j, lv)):
        if isinstance(operand, IndexSetArray) and operand.rows is not None:
            parts.append(sets.apply(sets.selection(k, index, (length, size)), operand.rows))
    if trace.pairs is not None and len(parts) == 2:  # each product couples its two factors
        trace.pairs.add(sets.gather([a.rows], [la], i + 1, trace.n), sets.gather([v.rows], [lv], j + 1, trace.n))
    return IndexSetArray(trace, (length,), sets.union(parts))


def _sliding_products(la: int, lv: int, mode: Any, convolve: bool) -> tuple[int, Any, Any, Any]:
    """The output length and the terms ``(k, i, j)`` (``out[k]`` sums ``a[i] * v[j]``) of
    np.convolve or np.correlate, as numpy computes them: the longer operand slides under the
    shorter, padded by ``n_left`` (none for "valid", half the shorter for "same", all but one of it
    for "full"); convolve reverses the shorter operand, correlate (when it swapped the operands)
    its output."""
    mode = mode if isinstance(mode, str) else ("valid", "same", "full")[mode]
    swap = lv > la
    longer, shorter = (lv, la) if swap else (la, lv)
    n_left = {"valid": 0, "same": shorter // 2, "full": shorter - 1}[mode]
    length = {"valid": longer - shorter + 1, "same": longer, "full": longer + shorter - 1}[mode]
    source = sets.taps((longer,), (shorter,), (length,), 1, -n_left, 1, 1)
    q, k = np.nonzero(source >= 0)
    p = source[q, k]
    if convolve:
        q = shorter - 1 - q
    elif swap:
        k = length - 1 - k
    return (length, k, q, p) if swap else (length, k, p, q)


def _signed_move(trace: _Trace, run: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
    """A function that only moves elements and fills in constants (autograd's ``r_``, ``c_``,
    ``make_diagonal``), run twice on the traced operands' positions as floats, with opposite
    signs: an output that changes sign comes from that position, one that does not is a constant."""
    sources: list[Any] = []
    sizes: list[int] = []

    def substitute(a: Any, sign: float) -> Any:
        if isinstance(a, IndexSetArray):
            if sign > 0:
                sources.append(a.rows)
                sizes.append(a.size)
            return sign * sets.positions(a.shape, sum(sizes) - a.size if sign > 0 else next(offsets)).astype(np.float64)
        if isinstance(a, (list, tuple)):
            return _rebuild(a, [substitute(b, sign) for b in a])
        return a

    plus = np.asarray(run(*substitute(tuple(args), 1.0), **kwargs))
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    offsets = iter(starts)
    minus = np.asarray(run(*substitute(tuple(args), -1.0), **kwargs))
    moved = plus != minus
    if not np.array_equal(plus[moved], -minus[moved]):
        raise TracerFailure("a function taken as a move computed with its operands")
    where = np.where(moved, np.rint(np.real(plus)), 0).astype(np.int64)
    return IndexSetArray(trace, plus.shape, sets.gather(sources, sizes, where, trace.n))


_EINSUM_GRID_LIMIT = 1 << 22
"""einsum's grid of every index (the product of all its sizes) above which it is taken as dense."""


def _einsum(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """np.einsum("ij,jk->ik", ...) as the product of its operands broadcast over the grid of
    every index, summed over the indices not kept: each output depends on the operand elements
    of its own terms only. The interleaved form, or a large grid: dense."""
    subscripts, operands = args[0], args[1:]
    if not isinstance(subscripts, str):
        return _dense(trace, func, args, kwargs)
    inputs, arrow, output = subscripts.replace(" ", "").partition("->")
    terms = inputs.split(",")
    # an ellipsis: letters of its own for the broadcast dimensions, aligned from the right
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in subscripts]
    widths = [len(_shape_of(o)) - len(t) + 3 if "..." in t else 0 for t, o in zip(terms, operands, strict=True)]
    broadcast = "".join(spare[: max(widths, default=0)])
    terms = [t.replace("...", broadcast[len(broadcast) - w :] if w else "") for t, w in zip(terms, widths, strict=True)]
    inputs = ",".join(terms)
    if not arrow:  # numpy's implicit output: the indices seen once, in alphabetical order
        output = broadcast + "".join(sorted(c for c in set(inputs) - {","} - set(broadcast) if inputs.count(c) == 1))
    output = output.replace("...", broadcast)
    letters = output + "".join(dict.fromkeys(c for c in inputs if c not in output + ","))
    sizes: dict[str, int] = {}
    for term, operand in zip(terms, operands, strict=True):
        for letter, length in zip(term, _shape_of(operand), strict=True):
            sizes[letter] = max(sizes.get(letter, 1), int(length))
    if sets.size([sizes[c] for c in letters]) > _EINSUM_GRID_LIMIT:
        return _dense(trace, func, args, kwargs)
    product: Any = None
    for term, operand in zip(terms, operands, strict=True):
        unique = "".join(dict.fromkeys(term))
        if unique != term:  # a repeated index reads a diagonal: a move
            operand = (
                _move(trace, np.einsum, (f"{term}->{unique}", operand), {})
                if isinstance(operand, IndexSetArray)
                else np.einsum(f"{term}->{unique}", operand)
            )
        order = sorted(range(len(unique)), key=lambda k: letters.index(unique[k]))
        own = dict(zip(unique, _shape_of(operand), strict=True))  # (a length 1 broadcasts)
        placed = np.reshape(np.transpose(operand, order), [own.get(c, 1) for c in letters])
        product = placed if product is None else product * placed
    summed = tuple(range(len(output), len(letters)))
    return np.sum(product, axis=summed) if summed else np.multiply(product, 1.0)


def _tensordot(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    a, b = args[0], args[1]
    axes = _argument(args, kwargs, 2, "axes", 2)
    na, nb = len(_shape_of(a)), len(_shape_of(b))
    if np.ndim(axes) == 0:
        a_axes, b_axes = list(range(na - int(axes), na)), list(range(int(axes)))
    else:
        a_axes, b_axes = ([int(v)] if np.ndim(v) == 0 else [int(k) for k in v] for v in axes)
    a_letters = [chr(ord("a") + k) for k in range(na)]
    b_letters = [chr(ord("a") + na + k) for k in range(nb)]
    for i, j in zip(a_axes, b_axes, strict=True):
        b_letters[j % nb] = a_letters[i % na]
    contracted = {a_letters[i % na] for i in a_axes}
    kept = [c for c in a_letters + b_letters if c not in contracted]
    return _einsum(trace, np.einsum, (f"{''.join(a_letters)},{''.join(b_letters)}->{''.join(kept)}", a, b), {})


def _inner(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    a, b = args[0], args[1]
    if not _shape_of(a) or not _shape_of(b):
        return np.multiply(a, b)
    return _tensordot(trace, func, (a, b, ([-1], [-1])), {})


def _kron(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """np.kron(a, b): a's and b's axes interleaved, multiplied, and merged pairwise."""
    a, b = args[0], args[1]
    ndim = max(len(_shape_of(a)), len(_shape_of(b)))
    a_shape = (1,) * (ndim - len(_shape_of(a))) + tuple(_shape_of(a))
    b_shape = (1,) * (ndim - len(_shape_of(b))) + tuple(_shape_of(b))
    spread_a = np.reshape(a, [d for s in a_shape for d in (s, 1)])
    spread_b = np.reshape(b, [d for s in b_shape for d in (1, s)])
    return np.reshape(spread_a * spread_b, [p * q for p, q in zip(a_shape, b_shape, strict=True)])


def _polyval(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """np.polyval(p, x) by Horner's rule, on the tracer's own operations."""
    p, x = args[0], args[1]
    if len(_shape_of(p)) != 1 or not _shape_of(p)[0]:
        return _dense(trace, func, args, kwargs)
    result = np.multiply(x, 0.0) + p[0]
    for k in range(1, _shape_of(p)[0]):
        result = result * x + p[k]
    return result


def _trace_of(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """np.trace: the sum of a diagonal, of axes 0 and 1 by default. np.linalg.trace (the array
    API's, with the same name) takes the diagonals of the last two axes, its offset by keyword
    alone: read as np.trace, a stack of matrices would sum the wrong entries."""
    if str(getattr(func, "__module__", "")).startswith("numpy.linalg"):
        offset, first, second = kwargs.get("offset", 0), -2, -1
    else:
        offset, first, second = (
            _argument(args, kwargs, k, name, d) for k, name, d in ((1, "offset", 0), (2, "axis1", 0), (3, "axis2", 1))
        )
    return np.sum(np.diagonal(args[0], offset, first, second), axis=-1)


def _take(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """np.take and np.take_along_axis: moves where the indices are known; integers whose values
    are not known (a Constant's, or computed from x) may read any element, as ``a[indices]`` does."""
    indices = _argument(args, kwargs, 1, "indices", None)
    if not (isinstance(indices, IndexSetArray) and indices.dtype.kind in "iu"):
        return _move(trace, func, args, kwargs)
    a = _lift(trace, args[0] if args else kwargs.get("a", kwargs.get("arr")))
    given = {"axis": _argument(args, kwargs, 2, "axis", None)} if len(args) > 2 or "axis" in kwargs else {}
    shape = func(np.zeros(a.shape, a.dtype), np.zeros(indices.shape, np.int64), **given).shape
    rows = sets.all_of(a.rows, int(np.prod(shape, dtype=np.int64))) if a.rows is not None else None
    return IndexSetArray(trace, shape, rows, a.dtype)


def _elementwise(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """A function of one array, element by element (sinc, i0, ...), as a nonlinear ufunc."""
    return _ufunc(trace, func, (args[0],), {})


def _where(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    if len(args) == 1:
        raise TracerRefusal("f calls np.where(condition) with one argument: its size depends on values")
    if _known(args[0]):
        return _move(trace, func, args, kwargs)
    return _select(trace, np.select, ([args[0]], [args[1]], args[2]), {})  # (np.where(c, a, b): np.select([c], [a], b))


def _select(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """np.select(conditions, choices, default): a move where the conditions are known; where they
    are not, each element depends on every choice's element there (np.where's too)."""
    conditions, choices = list(args[0]), list(args[1])
    default = _argument(args, kwargs, 2, "default", 0)
    if all(_known(c) for c in conditions):
        return _move(trace, func, args, kwargs)
    operands = [_lift(trace, v) for v in (*choices, default)]
    out_shape = np.broadcast_shapes(*(_shape_of(v) for v in (*conditions, *operands)))
    rows = sets.union(sets.elementwise([(v.rows, v.shape) for v in operands], out_shape, trace.n))
    return IndexSetArray(trace, out_shape, rows, np.result_type(*(v.dtype for v in operands)))


def _like(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    a = args[0]
    given = _by_name(func, args, kwargs)  # (shape and dtype by position too)
    shape = given.get("shape") or _shape_of(a)
    dtype = given.get("dtype") or (a.dtype if isinstance(a, IndexSetArray) else np.float64)
    fill = func.__name__ == "full_like" and _argument(args, kwargs, 1, "fill_value", 0)
    if _holds_tracer(fill):  # (also a list of them)
        return _dense(trace, func, args, kwargs)
    return IndexSetArray(trace, shape, None, dtype)


def _shape_only(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    probe = [np.zeros(v.shape, v.dtype) if isinstance(v, IndexSetArray) else v for v in args]
    return func(*probe, **kwargs)


def _clip(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    a = _lift(trace, args[0])
    lower = kwargs.get("min", _argument(args, kwargs, 1, "a_min", None))  # (numpy 2.1 names them min=, max=)
    upper = kwargs.get("max", _argument(args, kwargs, 2, "a_max", None))
    bounds = [lower, upper]
    bounds = [_lift(trace, b) for b in bounds if b is not None]
    out_shape = np.broadcast_shapes(a.shape, *[b.shape for b in bounds])
    rows = sets.union(sets.elementwise([(v.rows, v.shape) for v in (a, *bounds)], out_shape, trace.n))
    return IndexSetArray(trace, out_shape, rows, a.dtype)


_WRITES = frozenset({"put", "put_along_axis", "copyto", "place", "putmask", "fill_diagonal"})
"""numpy functions that write into an argument (none returns what it wrote)."""

_MOVING_PADS = frozenset({"constant", "edge", "reflect", "symmetric", "wrap", "empty"})


def _computes_values(name: str, args: Any, kwargs: Any) -> bool:
    """Whether a call of a function in :data:`_MOVES` computes its values from several entries
    (np.pad's statistic and ramp modes), which the moves' rule, by positions, does not follow."""
    if name != "pad":
        return False
    mode = kwargs.get("mode", args[2] if len(args) > 2 else "constant")
    odd = kwargs.get("reflect_type", "even") == "odd"  # (2 edge - mirror: a value from two entries)
    return not isinstance(mode, str) or mode not in _MOVING_PADS or odd


_COPIES = {
    "concatenate", "stack", "hstack", "vstack", "dstack", "column_stack", "roll", "take", "take_along_axis",
    "repeat", "tile", "pad", "triu", "tril", "copy", "append", "delete", "insert", "block", "diag", "select",
    "row_stack", "concat", "rot90",
}  # fmt: skip
"""Moves that give a new array (the others give views, into which f may not write)."""

_MOVES = _COPIES | {
    "reshape", "ravel", "transpose", "moveaxis", "swapaxes", "flip", "fliplr", "flipud", "squeeze", "expand_dims",
    "broadcast_to", "diagonal", "atleast_1d", "atleast_2d", "atleast_3d", "split", "array_split", "hsplit",
    "vsplit", "dsplit", "real", "rollaxis", "broadcast_arrays", "put_along_axis", "unstack", "permute_dims",
    "asarray", "asanyarray", "ascontiguousarray", "array_equal",
}  # fmt: skip
"""Functions that only move elements: run by numpy on positions."""


def _move(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    if func.__name__ == "array_equal":
        raise TracerRefusal("f compares arrays computed from x for equality: the pattern could change with values")
    sources: list[Any] = []
    sizes: list[int] = []
    view = func.__name__ not in _COPIES

    def substitute(a: Any) -> Any:
        if isinstance(a, IndexSetArray):
            if not a.floating:
                raise a._refuse(f"passes to np.{func.__name__} integers or booleans computed from x as the values")
            if view:  # (a write into it later would reach this view, which is not followed)
                (a if a.base is None else a.base).reshaped = True
            pos = sets.positions(a.shape, sum(sizes))
            sources.append(a.rows)
            sizes.append(a.size)
            return pos
        if isinstance(a, (list, tuple)):
            return _rebuild(a, [substitute(b) for b in a])
        if isinstance(a, np.ndarray) and a.dtype.kind in "fc":
            return np.zeros(a.shape, dtype=np.int64)
        if isinstance(a, float):
            return 0
        return a

    moved_args = substitute(tuple(args))
    moved_kwargs = {k: substitute(v) for k, v in kwargs.items() if k != "dtype"}
    out = func(*moved_args, **moved_kwargs)

    def wrap(o: Any) -> Any:
        if isinstance(o, (list, tuple)):
            return _rebuild(o, [wrap(p) for p in o])
        o = np.asarray(o)
        return IndexSetArray(trace, o.shape, sets.gather(sources, sizes, o, trace.n), view=view)

    return wrap(out)


def _public_name(func: Any) -> str:
    """``numpy.linalg.inv``, ``scipy.stats.logpdf``: the function's name in its public module."""
    module = getattr(func, "__module__", None) or "numpy"
    public = []
    for part in module.split("."):
        if part.startswith("_"):
            break
        public.append(part)
    return ".".join([*public, getattr(func, "__name__", type(func).__name__)])


def _rebuild(container: Any, parts: list[Any]) -> Any:
    """A list or tuple like ``container`` holding ``parts``; a named tuple (eigh's, svd's results)
    takes them as its fields."""
    if hasattr(container, "_fields"):
        return type(container)(*parts)
    return type(container)(parts)


def _sample(a: IndexSetArray, kind: int, rng: np.random.Generator) -> np.ndarray:
    """Values for a run of an unknown function: numbers in [0.5, 1.5] (inside the domain of
    logarithms and roots, rarely singular); failing that, identity matrices (symmetric positive
    definite: cholesky's, a covariance) and vectors of 1/size (a point of the simplex)."""
    if a.dtype.kind not in "fc":
        return np.ones(a.shape, a.dtype)
    if kind == 0:
        return rng.uniform(0.5, 1.5, a.shape).astype(a.dtype)
    if a.ndim >= 2 and a.shape[-1] == a.shape[-2]:
        return np.broadcast_to(np.eye(a.shape[-1], dtype=a.dtype), a.shape).copy()
    return np.full(a.shape, 1.0 / max(a.shape[-1] if a.shape else 1, 1), dtype=a.dtype)


def _dense(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """An unknown function: its outputs' shapes from a run on sample values (:func:`_sample`),
    each element depending on everything its operands depend on."""
    import warnings

    found: list[Any] = []
    rng = np.random.default_rng(0)

    def substitute(a: Any, kind: int) -> Any:
        if isinstance(a, IndexSetArray):
            found.append(a.rows)
            return _sample(a, kind, rng)
        if isinstance(a, (list, tuple)):
            return _rebuild(a, [substitute(b, kind) for b in a])
        if isinstance(a, dict):
            return {k: substitute(v, kind) for k, v in a.items()}
        return a

    errors = []
    for kind in (0, 1):
        found.clear()
        try:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = func(*substitute(tuple(args), kind), **substitute(dict(kwargs), kind))
            break
        except Exception as error:
            errors.append(error)
    else:
        raise TracerFailure(
            f"{_public_name(func)} could not run on sample values to learn its result's shape "
            f"({type(errors[0]).__name__}: {str(errors[0])[:200]})"
        ) from errors[0]
    every = trace.dense(found, _public_name(func))  # (operands of any sizes: polyval's p and x)

    def wrap(o: Any) -> Any:
        if isinstance(o, (list, tuple)):
            return _rebuild(o, [wrap(p) for p in o])
        if not isinstance(o, np.ndarray) and not np.isscalar(o):
            return o
        o = np.asarray(o)
        return IndexSetArray(trace, o.shape, sets.all_of(every, o.size) if o.dtype.kind in "fc" else None, o.dtype)

    return wrap(out)


_FUNCTIONS: dict[str, Callable[[_Trace, Any, Any, dict[str, Any]], Any]] = {
    "sum": _sum(True), "mean": _sum(True), "nansum": _sum(True), "nanmean": _sum(True), "average": _sum(True),
    "prod": _sum(False), "max": _sum(False), "amax": _sum(False), "min": _sum(False), "amin": _sum(False),
    "std": _sum(False), "var": _sum(False), "nanmax": _sum(False), "nanmin": _sum(False), "ptp": _sum(False),
    "norm": _norm, "cumsum": _along, "cumprod": _along, "diff": _diff, "dot": _dot,
    "inner": _inner, "outer": _outer, "matmul": lambda t, f, a, k: _matmul(t, a[0], a[1]),
    "vdot": lambda t, f, a, k: _inner(t, f, (np.ravel(a[0]), np.ravel(a[1])), {}),  # (flat: one number)
    "select": _select, "convolve": _convolve, "correlate": _convolve, "einsum": _einsum, "tensordot": _tensordot, "kron": _kron,
    "polyval": _polyval, "trace": _trace_of, "sinc": _elementwise, "i0": _elementwise, "nan_to_num": _elementwise,
    "around": _elementwise, "round": _elementwise, "fix": _elementwise, "angle": _elementwise, "imag": _elementwise,
    "real_if_close": _elementwise, "where": _where, "sort": _along, "zeros_like": _like, "ones_like": _like,
    "empty_like": _like, "full_like": _like, "shape": _shape_only, "ndim": _shape_only,
    "size": _shape_only, "clip": _clip, "result_type": _shape_only, "take": _take, "take_along_axis": _take,
}  # fmt: skip


# --- the entry ------------------------------------------------------------------------------------


def trace_pattern(f: Callable[..., Any], x: Any, values: list[Any], hessian: bool) -> Detection:
    """The Jacobian (``hessian=False``) or Hessian pattern of numpy-written ``f`` at ``x``."""
    leaves = tree.leaves(x)
    sizes = [int(np.prod(_arrays.shape(leaf), dtype=np.int64)) for leaf in leaves]
    trace = _Trace(int(sum(sizes)), hessian)
    traced = [
        IndexSetArray(trace, _arrays.shape(leaf), rows, np.dtype(_arrays.dtype_name(leaf)))
        for leaf, rows in zip(leaves, sets.identity(sizes), strict=True)
    ]
    run, contexts = leaf_function(f, x, values, lambda leaf: True)
    traced += [_abstract(trace, leaf) for leaf in contexts]
    outer, _ACTIVE.trace = getattr(_ACTIVE, "trace", None), trace
    try:
        with _autograd_arrays():
            outputs = run(*traced)
        if trace.raised is not None:
            trace.raised.caught = True
            raise trace.raised
        blocks = [o.rows if isinstance(o, IndexSetArray) and o.floating else None for o in outputs]
        out_sizes = [o.size if isinstance(o, IndexSetArray) else int(np.size(o)) for o in outputs]
    except TracerRefusal as error:
        error.caught |= trace.refused is not error
        raise UnsupportedOperationError(_refusal(str(error))) from error
    except TracerFailure as error:
        error.caught |= trace.refused is not None
        raise
    except Exception as error:  # the tracer's own failure (or f's: running f on x tells which)
        message = str(error).splitlines()[0][:200] if str(error) else ""
        failure = TracerFailure(f"{type(error).__name__}: {message}")
        failure.caught = trace.refused is not None
        raise failure from error
    finally:
        _ACTIVE.trace = outer
    if trace.pairs is not None:
        _check_scalar(sum(out_sizes))
    return Detection(trace.pattern(blocks, out_sizes), "numpy", tuple(dict.fromkeys(trace.notes)))


def _abstract(trace: _Trace, leaf: Any) -> Any:
    """A context's array leaf of any framework (a numpy scalar too) as an array without values,
    so that the pattern holds for every value it takes: a jax array's or a tensor's zeros are no
    more structural than a numpy array's."""
    if not (_arrays.is_array(leaf) or isinstance(leaf, np.generic)):
        return leaf
    name = _arrays.dtype_name(leaf)
    try:
        dtype = np.dtype(np.float64 if name == "bfloat16" else name)  # (numpy has no bfloat16 of its own)
    except TypeError:  # (not a number: a jax key, passed as it is)
        return leaf
    return IndexSetArray(trace, _arrays.shape(leaf), None, dtype) if dtype.kind in "fciub" else leaf


def _check_scalar(count: int) -> None:
    if count != 1:
        raise InvalidOutputError(f"A Hessian needs f to return one scalar; f returns {count} numbers.")


DENSE_LIMIT = 1 << 27
"""The most entries of a dense pattern for a whole function; a larger one is refused, since it
would cost more memory than a dense Jacobian and save no product."""


def dense_pattern(
    f: Callable[..., Any],
    x: Any,
    values: list[Any],
    hessian: bool,
    reason: str,
    evaluate: Callable[[], Any] | None = None,
) -> Detection:
    """The dense pattern, for an f no tracer could follow: every output depending on every input.
    f runs once to count its outputs, so that an exception f raises itself reaches the caller as
    f raised it: by ``evaluate`` where given (f as the backend's engine runs it), else on a copy
    of x."""
    import scipy.sparse as sp

    n = sum(int(np.prod(_arrays.shape(leaf), dtype=np.int64)) for leaf in tree.leaves(x))
    if evaluate is not None:
        out = evaluate()
    else:
        out = f(tree.map(lambda leaf: leaf.copy() if isinstance(leaf, np.ndarray) else leaf, x), *values)
    m = sum(int(np.prod(_arrays.shape(leaf), dtype=np.int64)) for leaf in tree.leaves(out))
    if hessian:
        _check_scalar(m)
    rows = n if hessian else m
    if rows * n > DENSE_LIMIT:
        raise UnsupportedOperationError(
            _refusal(
                f"the tracer could not follow f ({reason}), and the dense pattern it would take instead, "
                f"{rows} x {n}, is too large to be worth a sparse {'Hessian' if hessian else 'Jacobian'}; the "
                "dense operator computes the same"
            )
        )
    pattern = sets.canonical(sp.csr_array(np.ones((rows, n), dtype=bool)))
    return Detection(pattern, "numpy", (f"the numpy detector could not follow f ({reason}): dense",))


_PATCH_LOCK = threading.Lock()


_ELEMENTWISE_STATS = {f"autograd.scipy.stats.{name}" for name in ("beta", "chi2", "gamma", "norm", "poisson", "t")}
"""autograd's distributions whose functions broadcast their arguments, element by element."""


def _shaped(value: IndexSetArray, array_args: Any, array_kwargs: dict[str, Any]) -> IndexSetArray:
    """``value`` as ``np.array(value, *array_args, **array_kwargs)`` would shape it: ``ndmin``
    leading ones, ``dtype``."""
    dtype = array_kwargs.get("dtype", array_args[0] if array_args else None)
    if dtype is not None:
        value = value.astype(dtype)
    ndmin = int(array_kwargs.get("ndmin", 0))
    if ndmin > value.ndim:
        value = np.reshape(value, (1,) * (ndmin - value.ndim) + value.shape)  # type: ignore[assignment]
    return value


def _tracing(values: Any) -> _Trace | None:
    """The trace running in this thread where ``values`` hold its arrays; None elsewhere."""
    trace: _Trace | None = getattr(_ACTIVE, "trace", None)
    return trace if any(isinstance(leaf, IndexSetArray) for leaf in tree.leaves(list(values))) else None


def _autograd_patches() -> list[tuple[Any, str, Any]]:
    """(module, name, replacement) for what autograd runs outside numpy's protocols:
    ``np.array`` of arrays and of lists of traced elements, and its primitives that call scipy
    (``autograd.scipy.stats``, ``.signal``, ``.linalg``, ...), which take numpy arrays only."""
    module, namespaces, scipy_modules = _autograd.numpy_wrappers()
    scalar_or_array = getattr(module, "_array_from_scalar_or_array", None)
    from_args = getattr(module, "array_from_args", None)
    if scalar_or_array is None or from_args is None or getattr(scalar_or_array, "_diffiface_patch", False):
        return []

    def array_of_one(array_args: Any, array_kwargs: Any, scalar: Any) -> Any:
        if isinstance(scalar, IndexSetArray):
            return _shaped(scalar, array_args, array_kwargs)
        return scalar_or_array(array_args, array_kwargs, scalar)

    def array_of_elements(array_args: Any, array_kwargs: Any, *elements: Any) -> Any:
        if any(isinstance(e, IndexSetArray) for e in elements):
            return _shaped(np.stack(elements), array_args, array_kwargs)  # type: ignore[arg-type]
        return from_args(array_args, array_kwargs, *elements)

    array_of_one._diffiface_patch = True  # type: ignore[attr-defined]
    patches: list[tuple[Any, str, Any]] = [
        (module, "_array_from_scalar_or_array", array_of_one),
        (module, "array_from_args", array_of_elements),
    ]
    # f reads these from autograd.numpy, which imported them from numpy_wrapper
    for namespace in namespaces:
        for name, concatenator in (("r_", np.r_), ("c_", np.c_)):
            if hasattr(namespace, name):
                patches.append((namespace, name, _TracedConcatenator(getattr(namespace, name), concatenator)))
        make_diagonal = getattr(namespace, "make_diagonal", None)
        if make_diagonal is not None and hasattr(make_diagonal, "fun"):
            patches.append((namespace, "make_diagonal", _traced_primitive(make_diagonal, _signed_move)))
    for name, scipy_module in scipy_modules:
        for attribute, value in list(vars(scipy_module).items()):
            raw = getattr(value, "fun", None)
            if getattr(value, "_is_autograd_primitive", False) and not isinstance(raw, np.ufunc):
                rule = _broadcasting if name in _ELEMENTWISE_STATS else _dense
                patches.append((scipy_module, attribute, _traced_primitive(value, rule)))
    return patches


class _TracedConcatenator:
    """autograd's ``np.r_`` or ``np.c_``: numpy's, as a move, where the items hold traced arrays."""

    def __init__(self, original: Any, numpy_concatenator: Any) -> None:
        self.original = original
        self.numpy_concatenator = numpy_concatenator

    def __getitem__(self, items: Any) -> Any:
        trace = _tracing([items])
        if trace is None:
            return self.original[items]
        return _signed_move(
            trace,
            lambda *parts: self.numpy_concatenator[parts],
            tuple(items) if isinstance(items, tuple) else (items,),
            {},
        )


def _traced_primitive(primitive: Any, rule: Callable[[_Trace, Any, Any, dict[str, Any]], Any]) -> Any:
    """autograd's ``primitive`` by ``rule`` where its arguments hold traced arrays (a move for
    ``make_diagonal``, a nonlinear ufunc's broadcasting for a distribution, else dense); anything
    else goes to ``primitive``."""

    def traced(*args: Any, **kwargs: Any) -> Any:
        trace = _tracing((args, kwargs))
        if trace is None:
            return primitive(*args, **kwargs)
        return rule(trace, primitive.fun, args, kwargs)

    return traced


def _broadcasting(trace: _Trace, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    return _ufunc(trace, func, (*args, *kwargs.values()), {})


@contextlib.contextmanager
def _autograd_arrays() -> Any:
    """While f is traced, autograd's functions that numpy's protocols do not reach take traced
    arrays (:func:`_autograd_patches`); every other argument goes to autograd's own function,
    unchanged. A trace inside a trace finds them in place."""
    patches = _autograd_patches()
    if not patches:
        yield
        return
    with _PATCH_LOCK:
        originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
        for module, name, replacement in patches:
            setattr(module, name, replacement)
        try:
            yield
        finally:
            for module, name, original in originals:
                setattr(module, name, original)


def _refusal(reason: str) -> str:
    return (
        f"GlobalDetector could not read the sparsity pattern of numpy-written f: {reason}. Use "
        "LocalDetector(...) (dense derivatives at a few points, with the backend given) or KnownPattern(pattern)."
    )
