"""numpy arrays and scalars (a masked array is refused: no engine honours its mask)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from ._shared import Contents, array_words
from ._shared import block_like as block_like
from ._shared import cast as cast
from ._shared import dtype_scope as dtype_scope
from ._shared import eval_shape as eval_shape
from ._shared import exchange as exchange  # (copied: a black box may return a buffer of its own that it writes again)
from ._shared import from_parts as from_parts
from ._shared import jit_checked as jit_checked
from ._shared import laid_out_ravel as laid_out_ravel
from ._shared import layout as layout
from ._shared import opened as opened

# (f gets read-only views of the caller's arrays: a write raises before it lands)
from ._shared import private_copy as private_copy
from ._shared import trace_of as trace_of
from ._shared import traced as traced
from ._shared import x_refusal as x_refusal

NAME: Final = "numpy"
ARRAY: Final = True
PASSED_THROUGH: Final = False
ARRAY_METHODS: Final = True
CODE_MODULES: Final[frozenset[str]] = frozenset()
PACKAGES: Final[frozenset[str]] = frozenset({"numpy", "scipy"})


def owns(cls: type) -> bool:
    if issubclass(cls, np.ma.MaskedArray):
        from .._errors import InvalidInputError

        # (never cached as a kind: every leaf of the class is refused, wherever it is met)
        raise InvalidInputError(
            "A numpy masked array (np.ma.MaskedArray) was passed as x, as a tangent or in a context. "
            "No engine differentiates through its mask: jax refuses it, the others would drop the mask "
            "and compute on the hidden values too. Pass its values, a.filled(fill_value) or a.data, and "
            "its mask as a di.Constant(a.mask) that f applies (np.where(mask, 0.0, x), say)."
        )
    return issubclass(cls, (np.ndarray, np.generic))


def signature(leaf: Any) -> tuple[Any, ...]:
    return (NAME, tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", type(leaf)))


def numpy_like() -> Any:
    return np


def to_numpy(leaf: Any) -> np.ndarray:
    return np.asarray(leaf)


def from_numpy(array: np.ndarray, like: Any, dtype: Any) -> Any:
    return np.asarray(array, dtype=getattr(like, "dtype", None) if dtype is None else dtype)


def in_native_byte_order(array: np.ndarray) -> np.ndarray:
    """``array`` itself where its bytes are in this machine's order, else a copy that is: a
    big-endian ``>f8`` array (as read from FITS or HDF5) is a float64 array, which jax and
    torch take only in native order."""
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def native_dtype(dtype: Any) -> Any:
    """``dtype`` in this machine's byte order (a numpy dtype; any other dtype as it is)."""
    if isinstance(dtype, np.dtype) and not dtype.isnative:
        return dtype.newbyteorder("=")
    return dtype


def mirror(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    array = value if value_family is _SELF else as_numpy(value)
    result = _writable(np.asarray(array, dtype=native_dtype(like.dtype)))  # (as numpy's own operations return)
    # a numpy scalar's result is a numpy scalar of its dtype, as numpy's operations on it give
    return result[()] if result.ndim == 0 and isinstance(like, np.generic) else result


def as_own(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is _SELF:
        return _writable(np.asarray(value))
    if value_family is not None and not value_family.ARRAY:  # a number, or a value traced through
        return value
    return _writable(np.asarray(as_numpy(value)))


def _writable(array: np.ndarray) -> np.ndarray:
    """A result the caller may write into: a read-only view (of an engine's buffer, of a
    read-only Constant) copied."""
    return array if array.flags.writeable else array.copy()


def same(leaf: Any) -> Callable[[Any], bool] | None:
    """The test that a later leaf has the prepared one's shape and dtype."""
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)

    def test(value: Any) -> bool:
        return value.shape == shape and value.dtype == dtype  # type: ignore[no-any-return]

    return test


def leaves_test(leaves: list[Any]) -> Callable[[list[Any]], bool] | None:
    return None


def conj(leaf: Any) -> Any:
    return np.conj(leaf)


def parts(leaf: Any) -> tuple[Any, Any]:
    array = np.asarray(leaf)
    return np.array(array.real), np.array(array.imag)  # (copies: a black box may perturb them in place)


_SELF = sys.modules[__name__]
"""This module, as the family a value is compared with."""


values = to_numpy


describe = array_words


def contents(value: Any, kept: int) -> Contents | None:
    """An ndarray's contents, compared by value (a numpy scalar is immutable: its identity says all)."""
    found = _view(value)
    return None if found is None else Contents(*found, _view, kept)


def _view(value: Any) -> tuple[np.ndarray, Any] | None:
    if isinstance(value, np.ndarray):
        return value, (value.shape, value.dtype)
    return None
