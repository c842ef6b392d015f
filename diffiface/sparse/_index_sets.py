"""Index sets: which input numbers each element of an array depends on, and the rules that carry
them through operations. Shared by the tracers of jax programs (``_jax_trace``),
torch-written (``_torch_trace``) and numpy-written (``_numpy_trace``) functions.

An array's sets are a boolean ``scipy.sparse.csr_array`` with one row per element (C order) and
one column per input number, or ``None`` where the array depends on no input. Every rule is
conservative: it may add a dependency, never drop one.

Positions. An operation that only moves elements (a slice, a roll, a concatenation, an index
with known indices, a pad) is run by its own library on arrays of *positions*: element ``e`` of
operand ``k`` holds ``1 + offset_k + e``, ``0`` stands for "depends on nothing" (a constant, a
padding), so the library's own code says where each output element comes from, and
:func:`gather` picks those rows.

Second order. A Hessian pattern is found with the same sets and one accumulator, :class:`Pairs`:
every nonlinear operation adds the pairs of inputs its second derivative may couple (for an
elementwise ``g(u)``, ``S_u x S_u`` per element, ``S`` the sets; for a product ``u * v``,
``S_u x S_v``). By the chain rule for second derivatives, the Hessian of the output is a sum
over operations of such terms, so the union of the pairs holds every nonzero of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from scipy.sparse import csr_array

Rows = Any  # csr_array (elements x inputs, bool), or None: depends on nothing

__all__ = ["Pairs", "Rows", "gather", "positions", "union"]


def _sp() -> Any:
    import scipy.sparse as sp

    return sp


def size(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def empty(rows: int, n: int) -> csr_array:
    return _sp().csr_array((rows, n), dtype=bool)


def canonical(rows: Any) -> csr_array:
    rows = _sp().csr_array(rows)
    rows.sum_duplicates()
    if rows.dtype != bool:
        rows.data = rows.data != 0
        rows = rows.astype(bool)
    rows.eliminate_zeros()
    return rows


def identity(sizes: Sequence[int]) -> list[csr_array]:
    """The sets of inputs of ``sizes`` laid end to end: each element depends on itself alone."""
    n = int(sum(sizes))
    blocks, offset = [], 0
    for count in sizes:
        rows = np.arange(count)
        blocks.append(_sp().csr_array((np.ones(count, dtype=bool), (rows, offset + rows)), shape=(count, n)))
        offset += count
    return blocks


def stack(blocks: Sequence[Rows], sizes: Sequence[int], n: int) -> csr_array:
    """One pattern from the rows of outputs of ``sizes`` laid end to end."""
    present = [empty(k, n) if rows is None else rows for rows, k in zip(blocks, sizes, strict=True)]
    return canonical(_sp().vstack(present, format="csr")) if present else empty(0, n)


def positions(shape: Sequence[int], offset: int = 0) -> np.ndarray:
    """1-based positions of an array of ``shape`` whose first element sits at ``offset``."""
    return np.arange(1 + offset, 1 + offset + size(shape), dtype=np.int64).reshape(tuple(shape))


def gather(sources: Sequence[Rows], sizes: Sequence[int], where: Any, n: int) -> Rows:
    """The rows picked by the 1-based positions ``where`` (any shape; ``0``: nothing) from the
    operands' rows laid end to end (operand ``k`` has ``sizes[k]`` elements)."""
    where = np.asarray(where, dtype=np.int64).reshape(-1)
    return gather_all(sources, sizes, np.arange(where.size), where, where.size, n)


def gather_all(sources: Sequence[Rows], sizes: Sequence[int], targets: Any, where: Any, count: int, n: int) -> Rows:
    """``count`` rows, row ``targets[k]`` uniting the rows at the 1-based positions ``where[k]``
    of the operands' rows laid end to end (as :func:`gather`'s); a row no target names is empty."""
    if all(s is None for s in sources):
        return None
    targets = np.asarray(targets, dtype=np.int64).reshape(-1)
    where = np.asarray(where, dtype=np.int64).reshape(-1)
    blocks = [empty(1, n)] + [empty(k, n) if rows is None else rows for rows, k in zip(sources, sizes, strict=True)]
    stacked = _sp().vstack(blocks, format="csr")
    return apply(selection(targets, where, (count, stacked.shape[0])), stacked)


def selection(rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int]) -> csr_array:
    """The 0/1 matrix of ``shape`` with a one at each ``(rows[k], cols[k])`` (as :func:`apply` reads it)."""
    return _sp().csr_array((np.ones(rows.size, dtype=bool), (rows, cols)), shape=shape)


def union(rows: Sequence[Rows]) -> Rows:
    present = [r for r in rows if r is not None]
    if not present:
        return None
    total = present[0]
    for r in present[1:]:
        total = total + r
    return canonical(total)


def apply(matrix: Any, rows: Rows) -> Rows:
    """``matrix @ rows`` as sets: output ``i`` unites the rows ``j`` with ``matrix[i, j] != 0``."""
    if rows is None:
        return None
    m = _sp().csr_array(matrix).astype(np.float32)
    m.eliminate_zeros()  # (kron builds dense blocks, with their zeros stored)
    m.data = np.ones_like(m.data)
    return canonical(m @ rows.astype(np.float32))


def all_of(rows: Rows, count: int) -> Rows:
    """Each of ``count`` elements depending on everything in ``rows``."""
    if rows is None:
        return None
    columns = np.unique(rows.indices)
    grid_rows = np.repeat(np.arange(count, dtype=np.int64), columns.size)
    grid_cols = np.tile(columns, count)
    data = np.ones(grid_rows.size, dtype=bool)
    return canonical(_sp().csr_array((data, (grid_rows, grid_cols)), shape=(count, rows.shape[1])))


def everything(rows: Sequence[Rows]) -> Rows:
    """One row: every input that any element of any of ``rows`` depends on (arrays of any sizes)."""
    return union([all_of(r, 1) for r in rows])


def broadcast(rows: Rows, shape: Sequence[int], out_shape: Sequence[int], n: int) -> Rows:
    """The rows of an operand of ``shape`` broadcast to ``out_shape``."""
    if rows is None:
        return None
    if tuple(shape) == tuple(out_shape):
        return rows
    return gather([rows], [size(shape)], np.broadcast_to(positions(shape), tuple(out_shape)), n)


def elementwise(operands: Sequence[tuple[Rows, Sequence[int]]], out_shape: Sequence[int], n: int) -> list[Rows]:
    """Each operand's rows broadcast to ``out_shape`` (the sets an elementwise operation unites)."""
    return [broadcast(rows, shape, out_shape, n) for rows, shape in operands]


def reduction_matrix(shape: Sequence[int], axes: Sequence[int]) -> Any:
    """The 0/1 matrix (outputs x inputs) of a reduction of ``shape`` over ``axes`` (kept dims)."""
    shape = tuple(shape)
    axes = sorted({a % len(shape) for a in axes}) if shape else []
    out_shape = tuple(1 if d in axes else s for d, s in enumerate(shape))
    source = np.arange(size(shape), dtype=np.int64)
    grid = np.indices(shape).reshape(len(shape), -1) if shape else np.zeros((0, 1), dtype=np.int64)
    for a in axes:
        grid[a] = 0
    target = np.ravel_multi_index(tuple(grid), out_shape) if shape else np.zeros(1, dtype=np.int64)
    return _sp().csr_array(
        (np.ones(source.size, dtype=np.float32), (target, source)), shape=(size(out_shape), size(shape))
    )


def cumulative_matrix(shape: Sequence[int], axis: int, reverse: bool = False) -> Any:
    """The 0/1 matrix of a cumulative operation (cumsum, cumprod, cummax) along ``axis``."""
    sp = _sp()
    shape = tuple(shape)
    axis %= len(shape)
    before, length, after = size(shape[:axis]), shape[axis], size(shape[axis + 1 :])
    ones = np.ones((length, length), dtype=np.float32)
    triangle = sp.csr_array(np.triu(ones) if reverse else np.tril(ones))
    return sp.kron(sp.kron(sp.eye_array(before), triangle), sp.eye_array(after), format="csr")


def along(rows: Rows, shape: Sequence[int], axis: int) -> Rows:
    """Each element depending on the whole line of ``rows`` along ``axis`` (a sort, a softmax)."""
    line = reduction_matrix(shape, [axis])
    return apply(line.T @ line, rows)


def matmul(
    a: Rows,
    a_may: Any,
    a_shape: Sequence[int],
    b: Rows,
    b_may: Any,
    b_shape: Sequence[int],
    n: int,
    pairs: Pairs | None,
) -> Rows:
    """The sets of ``a @ b`` for ``a`` of shape (B, m, k) and ``b`` (B, k, p) (either B may be 1,
    broadcast): ``out[t, i, j]`` depends on ``a[t, i, c]`` where ``b[t, c, j]`` may be nonzero, and
    on ``b[t, c, j]`` where ``a[t, i, c]`` may be nonzero. ``a_may``, ``b_may``: where a constant
    operand is nonzero (any shape of its size), None for anywhere. Each product couples its factors."""
    batch, (_, m, k), p = max(a_shape[0], b_shape[0]), a_shape, b_shape[2]
    out_size = batch * m * p
    parts = []
    if a is not None:
        may = np.ones(b_shape, dtype=bool) if b_may is None else np.asarray(b_may).reshape(b_shape)
        t, c, j = np.nonzero(np.broadcast_to(may, (batch, k, p)))
        own = t if a_shape[0] == batch else np.zeros_like(t)
        i = np.arange(m)
        rows = ((t * m)[:, None] + i) * p + j[:, None]
        cols = ((own * m)[:, None] + i) * k + c[:, None]
        parts.append(apply(selection(rows.reshape(-1), cols.reshape(-1), (out_size, size(a_shape))), a))
    if b is not None:
        may = np.ones(a_shape, dtype=bool) if a_may is None else np.asarray(a_may).reshape(a_shape)
        t, i, c = np.nonzero(np.broadcast_to(may, (batch, m, k)))
        own = t if b_shape[0] == batch else np.zeros_like(t)
        j = np.arange(p)
        rows = ((t * m + i) * p)[:, None] + j
        cols = ((own * k + c) * p)[:, None] + j
        parts.append(apply(selection(rows.reshape(-1), cols.reshape(-1), (out_size, size(b_shape))), b))
    if pairs is not None and a is not None and b is not None:
        # column c of a with row c of b, batch by batch: the products a[t, i, c] * b[t, c, j]
        columns = apply(reduction_matrix(a_shape, [1]), a)
        lines = apply(reduction_matrix(b_shape, [2]), b)
        pairs.add(broadcast(columns, (a_shape[0], k), (batch, k), n), broadcast(lines, (b_shape[0], k), (batch, k), n))
    return union(parts)


class Pairs:
    """The pairs of inputs that a Hessian may couple, accumulated over the nonlinear operations
    of a trace (``None`` when only the first order is asked for)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.terms: list[Any] = []

    def add(self, left: Rows, right: Rows) -> None:
        """Couple, element by element, the sets of ``left`` with those of ``right`` (same rows)."""
        if left is None or right is None:
            return
        term = left.astype(np.float32).T @ right.astype(np.float32)
        self.terms.append(canonical(term))

    def add_all(self, rows: Rows) -> None:
        """Element by element, every pair of the sets of ``rows``: a nonlinear elementwise map."""
        self.add(rows, rows)

    def pattern(self) -> csr_array:
        sp = _sp()
        total = sp.csr_array((self.n, self.n), dtype=np.float32)
        for term in self.terms:
            total = total + term.astype(np.float32)
        total = total + total.T
        return canonical(total)
