"""mlx arrays (``mlx.core.array``): lazy, on the default device, with their own dtypes."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from ._shared import Contents, numpy_like_complex
from ._shared import block_like as block_like
from ._shared import dtype_scope as dtype_scope
from ._shared import eval_shape as eval_shape
from ._shared import exchange as exchange  # (crosses as a numpy copy: dlpack into mlx would make float64 float32)
from ._shared import from_parts as from_parts
from ._shared import laid_out_ravel as laid_out_ravel
from ._shared import layout as layout
from ._shared import leaves_test as leaves_test
from ._shared import opened as opened
from ._shared import same as same
from ._shared import trace_of as trace_of
from ._shared import traced as traced
from ._shared import x_refusal as x_refusal

NAME: Final = "mlx"
ARRAY: Final = True
PASSED_THROUGH: Final = False
ARRAY_METHODS: Final = True
FLOAT64_PRECISION: Final = "float32"
"""mlx's float64 transcendental functions (sin, cos, exp) are accurate to float32's precision:
the checker of diffiface.test reads this of f's float64 output."""


def owns(cls: type) -> bool:
    core = sys.modules.get("mlx.core")
    return core is not None and issubclass(cls, core.array)


def signature(leaf: Any) -> tuple[Any, ...]:
    return (NAME, tuple(leaf.shape), leaf.dtype)


def numpy_like() -> Any:
    return sys.modules["mlx.core"]


def to_numpy(leaf: Any) -> np.ndarray:
    # a copy: numpy's view of an mlx array writes into the array's own buffer
    core = sys.modules["mlx.core"]
    if leaf.dtype == core.bfloat16:  # (numpy has no bfloat16: its values, exactly, in float32)
        leaf = leaf.astype(core.float32)
    return np.array(leaf, copy=True)


def mlx_dtype(dtype: Any) -> Any:
    """The mlx dtype of a numpy dtype (or of its name); float64 stays float64. A name is mlx's
    own first: numpy knows no ``"bfloat16"`` unless ml_dtypes is imported (jax imports it)."""
    core = sys.modules["mlx.core"]
    if isinstance(dtype, core.Dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(core, dtype, None), core.Dtype):
        return getattr(core, dtype)
    name = np.dtype(dtype).name
    found = getattr(core, name, None)
    if not isinstance(found, core.Dtype):
        from .._errors import UnsupportedOperationError

        raise UnsupportedOperationError(
            f"mlx has no dtype {name}"
            + (" (its only complex dtype is complex64)" if name == "complex128" else "")
            + "; pass arrays of a dtype mlx has."
        )
    return found


def from_numpy(array: np.ndarray, like: Any, dtype: Any) -> Any:
    # (mx.array of a float64 numpy array without a dtype would make it float32)
    core = sys.modules["mlx.core"]
    if dtype is None:
        return core.array(array, dtype=mlx_dtype(array.dtype) if like is None else like.dtype)
    return core.array(array, dtype=mlx_dtype(dtype))


def mirror(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is not _SELF:
        return from_numpy(np.asarray(as_numpy(value)), like, None)
    return value if value.dtype == like.dtype else value.astype(like.dtype)


def as_own(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is None or value_family is _SELF:
        return value
    array = np.asarray(as_numpy(value))
    return from_numpy(array, like, array.dtype)


def cast(value: Any, dtype: str) -> Any:
    return value.astype(mlx_dtype(dtype))


def jit_checked(leaf: Any) -> bool:
    """An mlx array: ``mx.compile`` traces its function anew for each shape and dtype it meets
    (it is not given ``shapeless=True``), so a compiled program checks the leaf itself."""
    return type(leaf) is sys.modules["mlx.core"].array


_SELF = sys.modules[__name__]


CODE_MODULES: Final[frozenset[str]] = frozenset()
PACKAGES: Final[frozenset[str]] = frozenset({"mlx"})


conj, parts = numpy_like_complex("mlx.core")


def private_copy(leaf: Any) -> Any:
    return sys.modules["mlx.core"].array(leaf)  # (a copy: an mx.array takes item assignment)


values = to_numpy


def contents(value: Any, kept: int) -> Contents | None:
    """An array's contents, compared by value: an mx.array takes item assignment (``w[0] = 1``
    writes into the array f reads, which ``mx.compile`` baked in), as a numpy array does."""
    found = _view(value)
    return None if found is None else Contents(*found, _view, kept)


def _view(value: Any) -> tuple[np.ndarray, Any] | None:
    return (to_numpy(value), signature(value)) if owns(type(value)) else None


def describe(signature: tuple[Any, ...]) -> str:
    # (mlx prints its dtypes with their module, "mlx.core.float32")
    return f"an mlx array of shape {signature[1]} and dtype {str(signature[2]).rpartition('.')[2]}"


def is_module(value: object) -> bool:
    """Whether ``value`` is an ``mlx.nn`` module (none exists where mlx.nn is not imported)."""
    nn = sys.modules.get("mlx.nn")
    return nn is not None and isinstance(value, nn.Module)


def module_arrays(module: Any) -> list[tuple[str, Any]]:
    """Every array a module holds (parameters and state), by its path (``layers.0.weight``)."""
    from mlx.utils import tree_flatten

    return [(str(item[0]), item[1]) for item in tree_flatten(module)]


def put_back(
    modules: list[Any], kept: list[list[tuple[str, Any]]], copies: list[list[tuple[str, Any]]] | None
) -> list[str]:
    """The paths f wrote in ``modules`` since :func:`module_arrays` gave ``kept``: an array
    object replaced (``module.weight = ...``; a BatchNorm in train mode sets its running
    statistics so), added or removed, or, where ``copies`` of their values were kept, its
    elements written (``module.weight[0] = v``); each module's arrays put back."""
    from mlx.utils import tree_unflatten

    mx = sys.modules["mlx.core"]
    written: list[str] = []
    for i, (module, pairs) in enumerate(zip(modules, kept, strict=True)):
        now = dict(module_arrays(module))
        olds = pairs if copies is None else copies[i]
        changed = [
            path
            for (path, array), (_, old) in zip(pairs, olds, strict=True)
            if now.get(path) is not array
            or (copies is not None and not bool(mx.array_equal(array, old, equal_nan=True).item()))
        ]
        if changed or len(now) != len(pairs):
            written += changed or sorted(set(now) - {path for path, _ in pairs})
            module.update(tree_unflatten(list(olds)), strict=False)
    return written
