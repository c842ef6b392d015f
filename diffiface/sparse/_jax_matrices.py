"""AutoSparse's results on jax arrays: BCOO matrices (the functions of
:mod:`diffiface.sparse._numpy_matrices`)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np


def _x64(on: bool) -> Any:
    """A scope where jax keeps float64 (``jax.enable_x64``) when ``on``; else nothing."""
    return sys.modules["jax"].enable_x64(True) if on else contextlib.nullcontext()


def take(compressed: Any, index: Any) -> Any:
    """The decompression: ``compressed.reshape(-1)[index]``, under x64 where the index is int64
    (:func:`index_like`'s; outside x64 jax warns that it truncates it to int32)."""
    with _x64(str(index.dtype) == "int64"):
        return compressed.reshape(-1)[index]


def promote(names: list[str]) -> Any:
    """The common dtype of these dtype names (numpy's rule: no strict mode)."""
    return sys.modules["jax.numpy"].dtype(np.result_type(*names).name)


def like(flat: Any, vector: np.ndarray) -> Any:
    with _x64(str(flat.dtype) == "float64"):
        return sys.modules["jax.numpy"].asarray(vector, dtype=flat.dtype)


def cast(array: Any, dtype: Any) -> Any:
    with _x64(str(dtype) == "float64"):
        return array.astype(dtype)


def index_like(flat: Any, index: np.ndarray) -> Any:
    with _x64(True):
        return sys.modules["jax.numpy"].asarray(index)


def sparse(holder: Any, indptr: np.ndarray, indices: np.ndarray, values: Any, shape: tuple[int, int]) -> Any:
    """A BCOO matrix; ``holder`` keeps its structure and indices, from which the next one is
    rebuilt: BCOO's constructor checks its arguments, which costs more than the products of a
    small Jacobian."""
    entries = getattr(holder, "_bcoo_indices", None)
    if entries is None:
        rows = np.repeat(np.arange(shape[0]), np.diff(indptr))
        entries = sys.modules["jax.numpy"].asarray(np.stack([rows, indices], axis=1).astype(np.int32))
        holder._bcoo_indices = entries
    treedef = getattr(holder, "_bcoo_treedef", None)
    if treedef is None:
        from jax.experimental import sparse as jax_sparse

        made = jax_sparse.BCOO((values, entries), shape=shape, indices_sorted=True, unique_indices=True)
        holder._bcoo_treedef = sys.modules["jax"].tree_util.tree_structure(made)
        return made
    return treedef.unflatten((values, entries))


def dense(rows: np.ndarray, indices: np.ndarray, values: Any, shape: tuple[int, int]) -> Any:
    with _x64("float64" in str(values.dtype)):
        return sys.modules["jax.numpy"].zeros(shape, dtype=values.dtype).at[rows, indices].set(values)
