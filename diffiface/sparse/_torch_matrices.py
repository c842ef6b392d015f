"""AutoSparse's results on torch tensors: sparse CSR tensors (the functions of
:mod:`diffiface.sparse._numpy_matrices`)."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np


def promote(names: list[str]) -> Any:
    """The common dtype of these dtype names (torch's rule)."""
    torch = sys.modules["torch"]
    dtype = getattr(torch, names[0])
    for name in names[1:]:
        dtype = torch.promote_types(dtype, getattr(torch, name))
    return dtype


def like(flat: Any, vector: np.ndarray) -> Any:
    return sys.modules["torch"].from_numpy(np.ascontiguousarray(vector)).to(dtype=flat.dtype, device=flat.device)


def cast(array: Any, dtype: Any) -> Any:
    return array.to(dtype)


def index_like(flat: Any, index: np.ndarray) -> Any:
    return sys.modules["torch"].from_numpy(index).to(flat.device)


def take(compressed: Any, index: Any) -> Any:
    # (indexing by a tensor is slow on some of torch's outputs: 10 ms at 3e4)
    return sys.modules["torch"].index_select(compressed.reshape(-1), 0, index)


_CSR_WARNED = False
"""Whether torch has given its once-per-process warning on sparse CSR tensors (under a filter
that hid it): later results are built without changing the warning filters."""


def sparse(holder: Any, indptr: np.ndarray, indices: np.ndarray, values: Any, shape: tuple[int, int]) -> Any:
    global _CSR_WARNED
    torch = sys.modules["torch"]
    device = values.device

    def build() -> Any:
        return torch.sparse_csr_tensor(
            torch.from_numpy(indptr.copy()).to(device),
            torch.from_numpy(indices.copy()).to(device),
            values,
            size=shape,
            check_invariants=False,  # built from a canonical pattern
        )

    if _CSR_WARNED:
        return build()
    with warnings.catch_warnings():  # torch says once per process that sparse CSR is in beta
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        matrix = build()
    _CSR_WARNED = True
    return matrix


def dense(rows: np.ndarray, indices: np.ndarray, values: Any, shape: tuple[int, int]) -> Any:
    torch = sys.modules["torch"]
    matrix = torch.zeros(shape, dtype=values.dtype, device=values.device)
    matrix[torch.from_numpy(rows).to(values.device), torch.from_numpy(indices).to(values.device)] = values
    return matrix
