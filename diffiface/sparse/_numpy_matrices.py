"""AutoSparse's results on numpy arrays (and Python numbers): scipy.sparse matrices.

Each ``sparse/_<family>_matrices.py`` has the same functions, which
:mod:`diffiface._sparse_operators` reaches by the family of x's flat vector (this module for
a family that has none): the dtype of a derivative, casts, the decompression of the colors'
products, and the Jacobian as a sparse or dense matrix of the family.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def promote(names: list[str]) -> Any:
    """The common dtype of these dtype names (numpy's rule)."""
    return np.result_type(*names)


def like(flat: Any, vector: np.ndarray) -> Any:
    """``vector`` as an array of ``flat``'s type and dtype (a tangent, a seed)."""
    return np.asarray(vector, dtype=flat.dtype)


def cast(array: Any, dtype: Any) -> Any:
    return array.astype(dtype)


def index_like(flat: Any, index: np.ndarray) -> Any:
    """The decompression's index, where ``flat``'s products are."""
    return index


def take(compressed: Any, index: Any) -> Any:
    """The decompression: ``compressed.reshape(-1)[index]``."""
    return compressed.reshape(-1)[index]


def sparse(holder: Any, indptr: np.ndarray, indices: np.ndarray, values: Any, shape: tuple[int, int]) -> Any:
    """The matrix of ``shape`` with ``values`` at a CSR pattern's entries (``holder``: an object
    whose attributes keep what the next matrix of the same pattern reuses)."""
    import scipy.sparse

    return scipy.sparse.csr_array((np.asarray(values), indices.copy(), indptr.copy()), shape=shape)


def dense(rows: np.ndarray, indices: np.ndarray, values: Any, shape: tuple[int, int]) -> Any:
    """The dense matrix of ``shape`` with ``values`` at ``(rows, indices)``, zeros elsewhere."""
    matrix = np.zeros(shape, dtype=np.asarray(values).dtype)
    matrix[rows, indices] = values
    return matrix
