"""jax arrays and tracers."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from .. import _placement

NAME: Final = "jax"
ARRAY: Final = True
PASSED_THROUGH: Final = False
GRAPH: Final = False


def owns(cls: type) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and (issubclass(cls, jax.Array) or issubclass(cls, jax.core.Tracer))


def signature(leaf: Any) -> tuple[Any, ...]:
    if not isinstance(leaf, sys.modules["jax"].core.Tracer):
        # where its shards live: results are laid out as x (diffiface._placement)
        return (NAME, tuple(leaf.shape), leaf.dtype, leaf.sharding)
    return (NAME, tuple(leaf.shape), leaf.dtype)


def numpy_like() -> Any:
    return sys.modules["jax.numpy"]


def to_numpy(leaf: Any) -> np.ndarray:
    return np.asarray(leaf)


def from_numpy(array: np.ndarray, like: Any, dtype: Any) -> Any:
    return sys.modules["jax.numpy"].asarray(array, dtype=like.dtype if dtype is None else dtype)


def foreign_tree(leaf: Any) -> tuple[Any, ...]:
    """Structure and leaf shapes of a pytree only jax knows (a flax or equinox object)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return ()
    leaves, treedef = jax.tree_util.tree_flatten(leaf)
    if len(leaves) == 1 and leaves[0] is leaf:
        return ()
    return (treedef, tuple((tuple(getattr(a, "shape", ())), getattr(a, "dtype", None)) for a in leaves))


def mirror(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is not _SELF:
        value = from_numpy(np.asarray(as_numpy(value)), like, None)
    elif value.dtype != like.dtype:
        value = value.astype(like.dtype)
    return _placement.like_x(value, like)


def as_own(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is None or value_family is _SELF:
        return value
    array = np.asarray(as_numpy(value))
    return _placement.on_devices_of(from_numpy(array, like, array.dtype), like)


def cast(value: Any, dtype: str) -> Any:
    return value.astype(dtype)


def block_like(value: Any, like: Any) -> Any:
    """A block of a derivative laid out as ``like``, the leaf of x it relates to."""
    return _placement.block_like(value, like)


def layout(leaf: Any) -> _placement.Layout | None:
    """The test of a concrete array's layout; None for a traced one (its layout is the trace's)."""
    if isinstance(leaf, sys.modules["jax"].core.Tracer):
        return None
    return _placement.Layout(leaf.sharding)


_SELF = sys.modules[__name__]
"""This module, as the family a value is compared with."""
