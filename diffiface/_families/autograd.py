"""autograd's boxes: the values an enclosing autograd call traces (numpy arrays otherwise)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

import numpy as np

# a box answers its value's shape and dtype: the tests are numpy's
from .numpy import block_like as block_like
from .numpy import cast as cast
from .numpy import jit_checked as jit_checked
from .numpy import layout as layout
from .numpy import leaves_test as leaves_test
from .numpy import same as same

NAME: Final = "autograd"
ARRAY: Final = False
PASSED_THROUGH: Final = True
"""Its values belong to an enclosing autograd call's trace, which differentiates through them:
results pass them on untouched."""
GRAPH: Final = False


def owns(cls: type) -> bool:
    return cls.__module__.startswith("autograd")


def signature(leaf: Any) -> tuple[Any, ...]:
    return (NAME, tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", type(leaf)))


def numpy_like() -> Any:
    return sys.modules["autograd.numpy"]


def to_numpy(leaf: Any) -> np.ndarray:
    return np.asarray(leaf)


def from_numpy(array: np.ndarray, like: Any, dtype: Any) -> Any:
    return np.asarray(array, dtype=getattr(like, "dtype", None) if dtype is None else dtype)


def mirror(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    return value


def as_own(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is None or value_family is _SELF:
        return value
    return np.asarray(as_numpy(value))


_SELF = sys.modules[__name__]
"""This module, as the family a value is compared with."""
