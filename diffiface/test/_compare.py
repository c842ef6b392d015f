"""The definition of "the right derivative": :func:`assert_allclose`."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _arrays
from .. import tree as _tree
from ..tree import path_string

__all__ = ["assert_allclose", "default_tolerances", "worst_error"]

#: Default ``(rtol, atol)`` by dtype: what a derivative must meet, wherever it comes from.
_TOLERANCES = {
    "float64": (1e-6, 1e-8),
    "float32": (1e-3, 1e-4),
    "float16": (3e-2, 1e-2),
    "bfloat16": (5e-2, 2e-2),
    "complex128": (1e-6, 1e-8),  # |actual - expected| of complex numbers, at their parts' precision
    "complex64": (1e-3, 1e-4),
}


def default_tolerances(dtype: str) -> tuple[float, float]:
    """``(rtol, atol)`` for a leaf of ``dtype`` (float64 tighter than float32)."""
    return _TOLERANCES.get(dtype, _TOLERANCES["float64"])


def assert_allclose(
    actual: Any, expected: Any, rtol: float | None = None, atol: float | None = None, *, check_dtype: bool = True
) -> None:
    """Assert that two derivatives are the same, recursively over pytrees.

    First the form: the same tree structure, and per leaf the same array type (numpy,
    torch, jax, Python number), shape and dtype. Then the values: per element
    ``|actual - expected| <= atol + rtol * |expected|``, NaN matching NaN and infinities
    matching exactly. Tolerances default by each leaf's dtype.

    Raises
    ------
    AssertionError
        Naming the leaf path, the worst index, both values, the absolute and relative
        error and the tolerance.

    Examples
    --------
    >>> import numpy as np
    >>> from diffiface.test import assert_allclose
    >>> assert_allclose({"w": np.ones(2)}, {"w": np.ones(2) + 1e-12})
    >>> assert_allclose({"w": np.ones(2)}, {"w": np.array([1.0, 1.1])})
    Traceback (most recent call last):
    ...
    AssertionError: ['w']: values differ at index (1,): actual 1, expected 1.1, abs error 0.1, rel error 0.0909 (rtol 1e-06, atol 1e-08)
    """
    a_leaves, a_spec = _tree.flatten(actual)
    e_leaves, e_spec = _tree.flatten(expected)
    if a_spec != e_spec:
        raise AssertionError(f"tree structures differ: actual {a_spec}, expected {e_spec}")
    paths = [path_string(p) for p in a_spec.paths()]
    for path, a, e in zip(paths, a_leaves, e_leaves, strict=True):
        _compare_leaf(path or "value", a, e, rtol, atol, check_dtype)


def _compare_leaf(path: str, a: Any, e: Any, rtol: float | None, atol: float | None, check_dtype: bool) -> None:
    kind_a, kind_e = _arrays.kind(a), _arrays.kind(e)
    if check_dtype and kind_a != kind_e:
        raise AssertionError(f"{path}: array types differ: actual {_describe(a)}, expected {_describe(e)}")
    shape_a, shape_e = _arrays.shape(a), _arrays.shape(e)
    if shape_a != shape_e:
        raise AssertionError(f"{path}: shapes differ: actual {shape_a}, expected {shape_e}")
    dtype_a, dtype_e = _arrays.dtype_name(a), _arrays.dtype_name(e)
    if check_dtype and dtype_a != dtype_e:
        raise AssertionError(f"{path}: dtypes differ: actual {dtype_a}, expected {dtype_e}")
    default_rtol, default_atol = default_tolerances(dtype_a)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    error = worst_error(a, e, rtol, atol)
    if error is not None:
        index, va, ve, abs_err, rel_err = error
        where = f" at index {index}" if shape_a else ""
        raise AssertionError(
            f"{path}: values differ{where}: actual {va:.6g}, expected {ve:.6g}, abs error {abs_err:.3g}, "
            f"rel error {rel_err:.3g} (rtol {rtol:g}, atol {atol:g})"
        )


def worst_error(a: Any, e: Any, rtol: float, atol: float) -> tuple[tuple[int, ...], float, float, float, float] | None:
    """The worst element out of tolerance as ``(index, actual, expected, abs, rel)``; None if all fit."""
    va, ve = _numbers(a), _numbers(e)
    with np.errstate(invalid="ignore", over="ignore"):
        nan_mismatch = np.isnan(va) != np.isnan(ve)
        inf_mismatch = (np.isinf(va) | np.isinf(ve)) & (va != ve) & ~np.isnan(va) & ~np.isnan(ve)
        finite = np.isfinite(va) & np.isfinite(ve)
        diff = np.where(finite, np.abs(va - ve), 0.0)
        excess = np.where(finite, diff - (atol + rtol * np.abs(ve)), 0.0)
    excess = np.where(nan_mismatch | inf_mismatch, np.inf, excess)
    if va.size == 0 or not np.any(excess > 0):
        return None
    flat = int(np.argmax(excess))
    index = tuple(int(i) for i in np.unravel_index(flat, va.shape)) if va.shape else ()
    x, y = va.reshape(-1)[flat].item(), ve.reshape(-1)[flat].item()
    abs_err = abs(x - y) if np.isfinite(x) and np.isfinite(y) else float("inf")
    rel_err = abs_err / abs(y) if y else float("inf")
    return index, x, y, abs_err, rel_err


def max_errors(actual: Any, expected: Any) -> tuple[float, float]:
    """The largest absolute error over all leaves, and the normwise relative error
    ``max|a - e| / max|e|`` over the whole result (finite elements only)."""
    worst_abs = scale = 0.0
    for a, e in zip(_tree.leaves(actual), _tree.leaves(expected), strict=False):
        va, ve = _numbers(a), _numbers(e)
        if va.shape != ve.shape or va.size == 0:
            continue
        with np.errstate(invalid="ignore"):
            diff = np.abs(va - ve)
        finite = np.isfinite(diff)
        if np.any(finite):
            worst_abs = max(worst_abs, float(np.max(diff[finite])))
            scale = max(scale, float(np.max(np.abs(ve[finite]))))
    return worst_abs, (worst_abs / scale if scale else (0.0 if worst_abs == 0 else float("inf")))


def _numbers(leaf: Any) -> np.ndarray:
    """A leaf's values in float64, or complex128 where it is complex (never its real part alone)."""
    array = np.asarray(_arrays.to_numpy(leaf))
    return array.astype(np.complex128 if np.iscomplexobj(array) else np.float64)


def _describe(leaf: Any) -> str:
    kind = _arrays.kind(leaf)
    return f"a Python {type(leaf).__name__}" if kind == "python" else f"a {kind} {type(leaf).__name__}"
