"""The toy engine's adapter: one forward pass of dual numbers per tangent.

It implements ``value_and_pushforward`` only; diffiface derives every other operator from it
(gradients and Jacobians column by column, Hessians as pushforwards of gradients). ``f`` is
called with numpy object arrays of duals, on which numpy's ufuncs (``np.sin``, ``np.exp``...)
call the duals' methods element by element; results are numpy float arrays of x's dtype.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from diffiface import UnsupportedOperationError
from diffiface._adapters import _base

from .dual import Dual, new_tag

_local = threading.local()  # the float dtype of the pass running in this thread


class Adapter(_base.Adapter):
    xp = np

    def to_native(self, leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray):
            return leaf
        return np.asarray(leaf, dtype=np.float64)

    def output_leaf(self, leaf: Any, like: Any) -> Any:
        if isinstance(leaf, (np.ndarray, Dual)):
            return leaf
        return np.asarray(leaf, dtype=getattr(_local, "dtype", None) or np.float64)  # a Python float

    def output_values(self, leaf: Any) -> Any:  # type: ignore[override]
        """The float values an output leaf of f stands for, in the dtype of the pass's x."""
        if not isinstance(leaf, Dual) and (not isinstance(leaf, np.ndarray) or leaf.dtype != object):
            return leaf  # f's output does not depend on x (or x is empty): its own floats
        values = np.empty(np.shape(leaf), dtype=object)
        items = np.asarray(leaf, dtype=object)
        for index in np.ndindex(values.shape):
            item = items[index]
            while isinstance(item, Dual):
                item = item.value
            values[index] = item
        return values.astype(getattr(_local, "dtype", np.float64))

    def explain_failure(self, exc: BaseException) -> str | None:
        """An operation on duals that they do not have (a ufunc other than sin, cos, exp and log,
        a complex number) is f written for more than this engine, which then cannot run it."""
        chain: BaseException | None = exc
        for _ in range(8):
            if chain is None:
                break
            # (numpy's ufuncs on the object arrays f gets call a method of each item)
            text = str(chain)
            if isinstance(chain, (TypeError, AttributeError)) and ("Dual" in text or "loop of ufunc" in text):
                return (
                    f"f uses an operation that the toy engine's dual numbers lack ({chain}); they have "
                    "+, -, *, /, ** and numpy's sin, cos, exp and log, on real numbers."
                )
            chain = chain.__cause__ or chain.__context__
        return None

    def value_and_pushforward(self, fn: Any, xs: Any, txs: Any) -> tuple[Any, Any, Any]:
        tag = new_tag()
        floats = [x.dtype for x in xs if x.dtype != object]
        outer = getattr(_local, "dtype", None)
        dtype = np.result_type(*floats) if floats else outer if outer is not None else np.dtype(np.float64)
        _local.dtype = dtype
        try:
            out, aux = fn(tuple(_lift(x, t, tag) for x, t in zip(xs, txs, strict=True)))
        finally:
            _local.dtype = outer
        aux = _values(aux, tag, dtype)  # (a Hessian's gradient pass returns f's value as aux)
        if isinstance(out, tuple):
            pairs = [_split(y, tag, dtype) for y in out]
            return tuple(v for v, _ in pairs), aux, tuple(t for _, t in pairs)
        value, tangent = _split(out, tag, dtype)
        return value, aux, tangent


def _lift(x: np.ndarray, t: Any, tag: int) -> np.ndarray:
    """x as an object array of duals of the pass ``tag``, with tangent ``t``."""
    if np.iscomplexobj(x) or np.iscomplexobj(t):
        raise UnsupportedOperationError("the toy engine differentiates functions of real numbers only.")
    lifted = np.empty(np.shape(x), dtype=object)
    t = np.broadcast_to(np.asarray(t, dtype=object), np.shape(x))
    for index in np.ndindex(np.shape(x)):
        lifted[index] = Dual(_scalar(x[index]), _scalar(t[index]), tag)
    return lifted


def _scalar(value: Any) -> Any:
    return value if isinstance(value, Dual) else float(value)


def _split(y: Any, tag: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """An output leaf's values and tangents of the pass ``tag``: float arrays of ``dtype``, or
    object arrays where they still hold an outer pass's duals."""
    y = np.asarray(y, dtype=object)
    values = np.empty(y.shape, dtype=object)
    tangents = np.empty(y.shape, dtype=object)
    for index in np.ndindex(y.shape):
        item = y[index]
        if isinstance(item, Dual) and item.tag == tag:
            values[index], tangents[index] = item.value, item.tangent
        else:
            values[index], tangents[index] = item, 0.0
    return _narrow(values, dtype), _narrow(tangents, dtype)


def _values(aux: Any, tag: int, dtype: Any) -> Any:
    """``aux`` with the duals of the pass ``tag`` replaced by their values."""
    if isinstance(aux, Dual) or (isinstance(aux, np.ndarray) and aux.dtype == object):
        return _split(aux, tag, dtype)[0]
    if type(aux) in (tuple, list):
        return type(aux)(_values(item, tag, dtype) for item in aux)
    if type(aux) is dict:
        return {key: _values(item, tag, dtype) for key, item in aux.items()}
    return aux


def _narrow(array: np.ndarray, dtype: Any) -> np.ndarray:
    if not any(isinstance(item, Dual) for item in array.flat):
        return array.astype(dtype)
    return array
