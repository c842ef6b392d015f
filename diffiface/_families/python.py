"""Python numbers: float, int, bool and complex (and their subclasses)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np

from ._shared import block_like as block_like
from ._shared import contents as contents
from ._shared import dtype_scope as dtype_scope
from ._shared import eval_shape as eval_shape
from ._shared import exchange as exchange  # (a number: copied, never shared)
from ._shared import jit_checked as jit_checked
from ._shared import laid_out_ravel as laid_out_ravel
from ._shared import layout as layout
from ._shared import opened as opened
from ._shared import private_copy as private_copy
from ._shared import trace_of as trace_of
from ._shared import traced as traced
from ._shared import x_refusal as x_refusal

NAME: Final = "python"
ARRAY: Final = False
PASSED_THROUGH: Final = False
ARRAY_METHODS: Final = True
CODE_MODULES: Final[frozenset[str]] = frozenset()
PACKAGES: Final[frozenset[str]] = frozenset()


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


def mirror(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    number = np.asarray(as_numpy(value))
    return complex(number) if isinstance(like, complex) else float(number)


def as_own(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if isinstance(value, _NUMPY):  # (read directly: a Python x's results most often come from numpy)
        array = np.asarray(value)
    elif value_family is not None and not value_family.ARRAY:  # a number, or a value traced through
        return value
    else:
        array = np.asarray(as_numpy(value))
    return array.item() if array.ndim == 0 else array


_NUMPY = (np.ndarray, np.generic)


def cast(value: Any, dtype: str) -> Any:
    return value


def same(leaf: Any) -> None:
    return None  # (a Python number's type says all)


def leaves_test(leaves: list[Any]) -> None:
    return None


def conj(leaf: Any) -> Any:
    return leaf.conjugate()


def parts(leaf: Any) -> tuple[Any, Any]:
    return leaf.real, leaf.imag


def from_parts(re: Any, im: Any) -> Any:
    return complex(re, im) if isinstance(im, (float, int)) else re + 1j * im


values = to_numpy


def describe(signature: tuple[Any, ...]) -> str:
    return f"a Python {signature[1].__name__}"
