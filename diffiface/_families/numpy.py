"""numpy arrays and scalars (a masked array is refused: no engine honours its mask)."""

from __future__ import annotations

from typing import Any, Final

import numpy as np

NAME: Final = "numpy"
ARRAY: Final = True


def owns(cls: type) -> bool:
    if issubclass(cls, np.ma.MaskedArray):
        raise _masked_refused()
    return issubclass(cls, (np.ndarray, np.generic))


def _masked_refused() -> Exception:
    from .._errors import InvalidInputError

    # (never cached as a kind: every leaf of the class is refused, wherever it is met)
    return InvalidInputError(
        "A numpy masked array (np.ma.MaskedArray) was passed as x, as a tangent or in a context. "
        "No engine differentiates through its mask: jax refuses it, the others would drop the mask "
        "and compute on the hidden values too. Pass its values, a.filled(fill_value) or a.data, and "
        "its mask as a di.Constant(a.mask) that f applies (np.where(mask, 0.0, x), say)."
    )


def signature(leaf: Any) -> tuple[Any, ...]:
    return (NAME, tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", type(leaf)))


def numpy_like() -> Any:
    return np


def to_numpy(leaf: Any) -> np.ndarray:
    return np.asarray(leaf)


def from_numpy(array: np.ndarray, like: Any, dtype: Any) -> Any:
    return np.asarray(array, dtype=getattr(like, "dtype", None) if dtype is None else dtype)
