"""jax arrays and tracers."""

from __future__ import annotations

import sys
from typing import Any, Final

import numpy as np

NAME: Final = "jax"
ARRAY: Final = True


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
