"""Python numbers: float, int, bool and complex (and their subclasses)."""

from __future__ import annotations

from typing import Any, Final

import numpy as np

NAME: Final = "python"
ARRAY: Final = False


def owns(cls: type) -> bool:
    return issubclass(cls, (float, int, complex))


def signature(leaf: Any) -> tuple[Any, ...]:
    return (NAME, type(leaf))


def numpy_like() -> Any:
    return np


def to_numpy(leaf: Any) -> np.ndarray:
    return np.asarray(leaf, dtype=np.complex128 if isinstance(leaf, complex) else np.float64)


def from_numpy(array: np.ndarray, like: Any, dtype: Any) -> Any:
    return array.item() if array.ndim == 0 else array
