"""Colorings of sparsity patterns, and the index that decompresses a colored product.

A column coloring groups columns that share no row: ``J @ seeds`` then holds every nonzero of
``J`` alone in its entry. A row coloring does the same for rows and ``seeds.T @ J``. A star
coloring of a symmetric pattern lets ``H @ seeds`` hold every nonzero ``H[i, j]`` alone in
``[i, color(j)]`` or in ``[j, color(i)]``. Each greedy pass visits the vertices once and keeps,
per row (or per vertex), the colors already met as the bits of a Python integer, so the whole
coloring costs a few Python operations per nonzero (see the design notes for the numbers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import InvalidInputError
from ._graphs import (
    ORDERS,
    _check_order,
    _graph_order,
    _partial_distance2,
    as_pattern,
)

if TYPE_CHECKING:
    from scipy.sparse import csr_array

__all__ = ["ORDERS", "Coloring", "as_pattern", "color_hessian", "color_jacobian"]


@dataclass(frozen=True, eq=False)
class Coloring:
    """A coloring of a sparsity pattern, with what compresses and decompresses a matrix of it.

    Attributes
    ----------
    pattern
        The pattern colored: ``m x n`` for a Jacobian, ``n x n`` (symmetric) for a Hessian, a
        canonical boolean ``scipy.sparse.csr_array``.
    mode
        ``"column"`` (compress with ``J @ seeds``, forward mode), ``"row"`` (``seeds.T @ J``,
        reverse mode), ``"star"`` (``H @ seeds``, Hessian-vector products) or
        ``"bidirectional"`` (both: ``J @ seeds`` for the columns, ``row_seeds.T @ J`` for the
        rows of ``row_colors >= 0``; see ``diffiface.sparse._bicoloring``).
    colors
        The color of each column (column, star, bidirectional: ``-1`` for a column no forward
        product needs) or row (row), ``0 .. count - 1``.
    count
        The number of colors: the number of products the compression takes (bidirectional:
        forward and reverse together).
    seeds
        ``n x count`` (column, star) or ``m x count`` (row) float64 matrix of zeros and ones:
        column ``k`` is the sum of the unit vectors of color ``k``. Made on first use and kept.
    index
        int64, one entry per nonzero of ``pattern`` in its CSR data order:
        ``compressed.reshape(-1)[index]`` is the CSR data of the matrix, where ``compressed``
        is the product named under ``mode``; bidirectional: the products laid end to end, the
        ``column_count`` forward ones (``m`` numbers each) then the ``row_count`` reverse ones
        (``n`` each).
    row_colors
        Bidirectional only: the color of each row read by reverse products, ``-1`` for the others.
    row_count
        Bidirectional only: the number of reverse products.

    Examples
    --------
    >>> import numpy as np
    >>> from diffiface.sparse import color_jacobian
    >>> J = np.diag([1.0, 2.0, 3.0]) + np.diag([4.0, 5.0], 1)
    >>> coloring = color_jacobian(J != 0)
    >>> coloring.mode, coloring.count, coloring.colors.tolist()
    ('column', 2, [0, 1, 0])
    >>> (J @ coloring.seeds).reshape(-1)[coloring.index].tolist()
    [1.0, 4.0, 2.0, 5.0, 3.0]
    """

    pattern: csr_array
    mode: str
    colors: np.ndarray
    count: int
    index: np.ndarray
    row_colors: np.ndarray | None = None
    row_count: int = 0

    @property
    def column_count(self) -> int:
        """The forward products (bidirectional), or ``count``."""
        return self.count - self.row_count

    @property
    def sides(self) -> dict[str, int]:
        """The products per side: ``{"forward": ..., "reverse": ...}`` (a star coloring's
        Hessian-vector products count as forward)."""
        if self.mode == "row":
            return {"forward": 0, "reverse": self.count}
        return {"forward": self.column_count, "reverse": self.row_count}

    @functools.cached_property
    def seeds(self) -> np.ndarray:
        """The column seeds (column, star, bidirectional) or row seeds (row)."""
        return _seeds(self.colors, self.column_count)

    @functools.cached_property
    def row_seeds(self) -> np.ndarray:
        """Bidirectional: the ``m x row_count`` seeds of the reverse products."""
        if self.row_colors is None:
            return np.zeros((self.pattern.shape[0], 0))
        return _seeds(self.row_colors, self.row_count)

    def decompress(self, compressed: Any, reverse: Any = None) -> csr_array:
        """The matrix, as a ``scipy.sparse.csr_array``, from a numpy ``compressed`` product
        (bidirectional: ``J @ seeds`` and ``reverse``, ``row_seeds.T @ J``)."""
        import scipy.sparse as sp

        if self.mode == "bidirectional":
            forward = np.asarray(compressed).reshape(self.pattern.shape[0], self.column_count)
            backward = np.zeros((0,)) if reverse is None else np.asarray(reverse)
            compressed = np.concatenate([forward.T.reshape(-1), backward.reshape(-1)])
        data = np.asarray(compressed).reshape(-1)[self.index]
        p = self.pattern
        return sp.csr_array((data, p.indices.copy(), p.indptr.copy()), shape=p.shape)


def _seeds(colors: np.ndarray, count: int) -> np.ndarray:
    seeds = np.zeros((colors.shape[0], count))
    used = colors >= 0
    seeds[np.arange(colors.shape[0])[used], colors[used]] = 1.0
    return seeds


# --- greedy colorings ------------------------------------------------------------------------------


def _make(pattern: csr_array, mode: str, colors: np.ndarray) -> Coloring:
    """The coloring of ``mode`` (column, row, star) with ``colors``, and its index."""
    count = int(colors.max()) + 1 if colors.size else 0
    rows = np.repeat(np.arange(pattern.shape[0], dtype=np.int64), np.diff(pattern.indptr))
    if mode == "star":
        index = _star_index(pattern, colors, count, rows)
    elif mode == "column":
        index = rows * count + colors[pattern.indices]
    else:
        index = colors[rows] * pattern.shape[1] + pattern.indices
    return Coloring(pattern, mode, colors, count, index.astype(np.int64, copy=False))


def color_jacobian(pattern: Any, mode: str = "auto", order: str = "natural") -> Coloring:
    """A partial distance-2 coloring of a Jacobian's sparsity pattern.

    Parameters
    ----------
    pattern
        ``m x n``: a scipy.sparse matrix or array, or a 2-d array whose nonzeros are the pattern.
    mode
        ``"column"`` (columns sharing no row share a color: ``J @ seeds``, one
        Jacobian-vector product per color), ``"row"`` (``seeds.T @ J``, one vector-Jacobian
        product per color), ``"bidirectional"`` (some rows by reverse products, the rest by
        forward ones: see :attr:`Coloring.row_colors`), or ``"auto"``: whichever needs fewest
        colors, column on a tie, bidirectional only where it takes fewer than both.
    order
        The order the greedy coloring visits columns (rows) in: ``"natural"`` (index order:
        a banded pattern gets one color per diagonal), ``"largest_first"`` or ``"smallest_last"``
        (see :data:`ORDERS`).

    Examples
    --------
    >>> import numpy as np
    >>> from diffiface.sparse import color_jacobian
    >>> arrow = np.eye(4, dtype=bool)
    >>> arrow[:, 0] = True  # one dense column: rows cannot share a color, columns can
    >>> color_jacobian(arrow).mode, color_jacobian(arrow).count
    ('column', 2)
    """
    _check_order(order)
    p = as_pattern(pattern)
    if mode not in ("auto", "column", "row", "bidirectional"):
        raise InvalidInputError(f"Unknown coloring mode {mode!r}; use 'auto', 'column', 'row' or 'bidirectional'.")
    if mode == "bidirectional":
        found: Coloring = _bidirectional(p, order)
        return found
    if mode == "column":
        return _make(p, "column", _partial_distance2(p, order))
    if mode == "row":
        return _make(p, "row", _partial_distance2(as_pattern(p.T), order))
    columns = _partial_distance2(p, order)
    rows = _partial_distance2(as_pattern(p.T), order)
    one_sided = _make(p, "row", rows) if rows.max(initial=-1) < columns.max(initial=-1) else _make(p, "column", columns)
    both = _bidirectional(p, order, to_beat=one_sided.count)
    # taken where it has both sides and takes fewer products (forward products alone, of the
    # columns some row needs, are a column coloring)
    sides = both is not None and both.row_count and both.column_count
    return both if sides and both.count < one_sided.count else one_sided


def _bidirectional(p: csr_array, order: str, to_beat: int | None = None) -> Any:
    """The bidirectional coloring (None where, given ``to_beat``, none takes fewer products)."""
    from . import _bicoloring

    found = _bicoloring.split(p, order, to_beat)
    if found is None:
        return None
    index = _bicoloring.index(p, found)
    return Coloring(p, "bidirectional", found.column_colors, found.count, index, found.row_colors, found.row_count)


def color_hessian(pattern: Any, order: str = "natural") -> Coloring:
    """A star coloring of a symmetric (Hessian) sparsity pattern: ``H @ seeds`` holds every
    nonzero ``H[i, j]`` alone in entry ``[i, color(j)]`` or ``[j, color(i)]``.

    The pattern is made symmetric (its union with its transpose) before coloring.

    Examples
    --------
    >>> import numpy as np
    >>> from diffiface.sparse import color_hessian
    >>> H = np.diag([2.0] * 6) + np.diag([-1.0] * 5, 1) + np.diag([-1.0] * 5, -1)
    >>> coloring = color_hessian(H != 0)
    >>> coloring.count
    3
    >>> bool(((H @ coloring.seeds).reshape(-1)[coloring.index] == H[H != 0]).all())
    True
    """
    _check_order(order)
    p = as_pattern(pattern, what="Hessian pattern")
    if p.shape[0] != p.shape[1]:
        raise InvalidInputError(f"A Hessian pattern is square; got shape {tuple(p.shape)}.")
    p = as_pattern(p + p.T, what="Hessian pattern")
    return _make(p, "star", _star(p, order))


def _star(pattern: csr_array, order: str) -> np.ndarray:
    """A greedy star coloring: a distance-1 coloring in which every path on four vertices uses at
    least three colors.

    Vertex ``v`` may not take (a) a color of a neighbor ``w``; (b) a color of a neighbor ``x`` of an
    uncolored neighbor ``w``; (c) the color of ``x``, a neighbor of a colored neighbor ``w``, when
    ``x`` has another neighbor of ``w``'s color (``v - w - x - y`` would be a two-colored path). For
    (c), each vertex ``x`` keeps its colored neighbors grouped by color, and each colored ``w``
    keeps as bits the colors of its neighbors ``x`` holding two or more neighbors of ``w``'s color.
    """
    n = pattern.shape[0]
    graph = pattern.copy()
    graph.setdiag(False)
    graph.eliminate_zeros()
    indptr = graph.indptr.tolist()
    indices = graph.indices.tolist()
    if order == "natural" or n == 0:
        visit = list(range(n))
    elif order == "largest_first":
        visit = np.argsort(-np.diff(graph.indptr), kind="stable").tolist()
    else:
        visit = _graph_order(graph)
    color = [-1] * n
    seen = [0] * n  # per vertex: the colors of its colored neighbors, as bits
    twice = [0] * n  # per colored w: colors of neighbors x with >= 2 neighbors of w's color
    # per (x, color): the one colored neighbor of x of that color, or -1 once there are two or more
    holder: dict[int, int] = {}
    for v in visit:
        neighbors = indices[indptr[v] : indptr[v + 1]]
        forbidden = 0
        for w in neighbors:
            cw = color[w]
            forbidden |= seen[w] if cw < 0 else (1 << cw) | twice[w]
        c = (~forbidden & (forbidden + 1)).bit_length() - 1
        color[v] = c
        bit = 1 << c
        mine = 0
        base = v * n
        for x in neighbors:
            seen[x] |= bit
            key = x * n + c
            first = holder.get(key)
            cx = color[x]
            if first is None:
                holder[key] = v
            else:
                if first >= 0:
                    holder[key] = -1
                    if cx >= 0:
                        twice[first] |= 1 << cx
                if cx >= 0:
                    mine |= 1 << cx
            # v is an x for its colored neighbor x (as a w): two of x's color around v -> x learns c
            if cx >= 0 and holder.get(base + cx) == -1:
                twice[x] |= bit
        twice[v] = mine
    return np.asarray(color, dtype=np.int64)


def _star_index(pattern: csr_array, colors: np.ndarray, count: int, rows: np.ndarray) -> np.ndarray:
    """For each nonzero ``(i, j)`` (``i`` in ``rows``): ``i * count + color(j)`` where ``j`` is the
    only column of its color in row ``i``, else ``j * count + color(i)``."""
    cols = pattern.indices.astype(np.int64)
    direct = rows * count + colors[cols]
    keys, inverse, counts = np.unique(direct, return_inverse=True, return_counts=True)
    alone = counts[inverse] == 1
    index = np.where(alone, direct, cols * count + colors[rows])
    # The mirrored key is the direct key of the entry (j, i), present since the pattern is
    # symmetric; the star property makes it unique. Checked, since a wrong index is a wrong value.
    mirrored = index[~alone]
    if mirrored.size and (counts[np.searchsorted(keys, mirrored)] != 1).any():
        raise AssertionError("internal error: the star coloring does not decompress directly")
    return index  # type: ignore[no-any-return]
