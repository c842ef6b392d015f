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

__all__ = ["Pairs", "Rows", "Trace", "gather", "positions", "union"]


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
    n, starts = int(sum(sizes)), np.cumsum([0, *sizes])
    return [selection(np.arange(k), starts[i] + np.arange(k), (k, n)) for i, k in enumerate(sizes)]


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
    return canonical(sum(present[1:], start=present[0]))


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


def along(rows: Rows, shape: Sequence[int], axis: int, whole: bool = True, reverse: bool = False) -> Rows:
    """Each element depending on its line of ``rows`` along ``axis``: all of it (``whole``: a sort,
    a softmax), or up to it (a cumulative operation: cumsum, cummax; ``reverse``: from it on)."""
    if rows is None or not shape:
        return rows
    if whole:
        line = reduction_matrix(shape, [axis])
        return apply(line.T @ line, rows)
    sp, shape = _sp(), tuple(shape)
    axis %= len(shape)
    before, length, after = size(shape[:axis]), shape[axis], size(shape[axis + 1 :])
    ones = np.ones((length, length), dtype=np.float32)
    triangle = sp.csr_array(np.triu(ones) if reverse else np.tril(ones))
    return apply(sp.kron(sp.kron(sp.eye_array(before), triangle), sp.eye_array(after), format="csr"), rows)


def matmul(
    left: tuple[Rows, Any, Sequence[int]], right: tuple[Rows, Any, Sequence[int]], n: int, pairs: Pairs | None
) -> Rows:
    """The sets of ``a @ b``, each operand its rows, where a constant one is nonzero (any shape of
    its size; None for anywhere) and its shape: ``a`` (B, m, k), ``b`` (B, k, p) (either B may be
    1, broadcast). ``out[t, i, j]`` depends on ``a[t, i, c]`` where ``b[t, c, j]`` may be nonzero,
    and on ``b[t, c, j]`` where ``a[t, i, c]`` may be nonzero. Each product couples its factors."""
    (a, a_may, a_shape), (b, b_may, b_shape) = left, right
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


def taps(
    space: Sequence[int],
    kernel: Sequence[int],
    out_space: Sequence[int],
    scale: Any,
    shift: Any,
    step: Any,
    divisor: Any,
) -> np.ndarray:
    """taps x output positions of a window of shape ``kernel`` sliding over an input of spatial
    shape ``space``: the flat input position that tap ``k`` reads at output position ``s``,
    ``(s * scale + shift + k * step) / divisor`` where that is a whole position inside the
    input, else -1 (padding, a dilation hole). Per spatial axis, each a number or a sequence."""
    rank, bound = len(space), np.asarray(space, dtype=np.int64).reshape(-1)
    k = np.indices(tuple(kernel)).reshape(rank, size(kernel)).T[:, None, :]
    s = np.indices(tuple(out_space)).reshape(rank, size(out_space)).T[None, :, :]
    scale, shift, step, divisor = (np.asarray(v, dtype=np.int64) for v in (scale, shift, step, divisor))
    at, rest = np.divmod(s * scale + shift + k * step, divisor)
    inside = ((rest == 0) & (at >= 0) & (at < bound)).all(axis=-1)
    clipped = np.clip(at, 0, np.maximum(bound - 1, 0))
    return np.where(inside, np.ravel_multi_index(tuple(np.moveaxis(clipped, -1, 0)), tuple(space)), -1)  # type: ignore[no-any-return]


def convolution(
    lhs: tuple[Rows, Any, np.ndarray],
    rhs: tuple[Rows, Any, np.ndarray],
    out_at: np.ndarray,
    source: np.ndarray,
    groups: int,
    weight_everywhere: bool = False,
) -> Rows:
    """The sets of a convolution. Each operand (its rows, where a constant one may be nonzero or
    None for anywhere, and its elements' flat indices) and ``out_at`` in the layout (batch or out
    channels, channels, spatial...): ``out[n, o, s]`` unites ``lhs[n, i, source[t, s]]``
    (:func:`taps`) over the taps ``t`` and input channels ``i`` of o's group where rhs may be
    nonzero, and ``rhs[o, i, t]`` where that lhs element may be nonzero, or, with
    ``weight_everywhere``, at every output position of channel ``o``."""
    (lhs_rows, lhs_may, lhs_at), (rhs_rows, rhs_may, rhs_at) = lhs, rhs
    batch, channels = lhs_at.shape[:2]
    outs, group_in = rhs_at.shape[:2]
    count = source.shape[0]
    o, ig, t = np.nonzero(
        np.ones((outs, group_in, count), dtype=bool) if rhs_may is None else rhs_may.reshape(outs, group_in, count)
    )
    i = (o // (outs // groups)) * group_in + ig
    src = source[t][:, None, :]  # (entries, 1, out positions)
    n = np.arange(batch)[None, :, None]
    so = np.arange(source.shape[1])[None, None, :]
    reads = np.broadcast_to(src >= 0, (t.size, batch, source.shape[1]))
    rows = np.broadcast_to(out_at.reshape(batch, outs, -1)[n, o[:, None, None], so], reads.shape)
    lhs_flat = lhs_at.reshape(batch, channels, -1)[n, i[:, None, None], np.maximum(src, 0)]
    parts = []
    if lhs_rows is not None:
        cols = np.broadcast_to(lhs_flat, reads.shape)[reads]
        parts.append(apply(selection(rows[reads], cols, (out_at.size, lhs_at.size)), lhs_rows))
    if rhs_rows is not None:
        valid = np.ones(reads.shape, dtype=bool) if weight_everywhere else reads
        if lhs_may is not None:
            valid = valid & lhs_may.reshape(batch, channels, -1)[n, i[:, None, None], np.maximum(src, 0)]
        cols = np.broadcast_to(rhs_at.reshape(outs, group_in, -1)[o, ig, t][:, None, None], reads.shape)[valid]
        parts.append(apply(selection(rows[valid], cols, (out_at.size, rhs_at.size)), rhs_rows))
    return union(parts)


class Trace:
    """What a tracer carries beside the sets: ``n`` inputs, the Hessian's :class:`Pairs` (None
    for a Jacobian), and notes naming the operations taken as dense. Its methods are the rules
    the numpy and torch tracers share, each with its second-order term."""

    def __init__(self, n: int, hessian: bool, tracer: str) -> None:
        self.n = n
        self.pairs = Pairs(n) if hessian else None
        self.notes: list[str] = []
        self.tracer = tracer

    def dense(self, rows: Sequence[Rows], what: str) -> Rows:
        """An operation not known (``what``), noted: one row, every input that any element of
        any of ``rows`` depends on (arrays of any sizes), each pair of them coupled."""
        every = everything(rows)
        self.notes.append(f"{what} is not known to the {self.tracer} detector: dense")
        return self.nonlinear(every)

    def nonlinear(self, rows: Rows) -> Rows:
        """``rows``, each element's sets coupled pair by pair (a nonlinear map of them)."""
        if self.pairs is not None:
            self.pairs.add_all(rows)
        return rows

    def unite(self, broadcast: Sequence[Rows], linear: bool, product: bool) -> Rows:
        """The union of an elementwise operation's operands (broadcast): a product couples its
        two factors, any other map that is not ``linear`` every pair of the union."""
        out = union(broadcast)
        if self.pairs is not None:
            present = [r for r in broadcast if r is not None]
            if product and len(present) == 2:
                self.pairs.add(present[0], present[1])
            elif present and not linear and not product:
                self.pairs.add_all(out)
        return out

    def pattern(self, blocks: Sequence[Rows], sizes: Sequence[int]) -> csr_array:
        """The Hessian pattern (f returns one number), or the Jacobian's: the outputs' rows."""
        return self.pairs.pattern() if self.pairs is not None else stack(blocks, sizes, self.n)


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
