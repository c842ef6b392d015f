"""Bidirectional colorings of a Jacobian's pattern: some rows by reverse products, the rest of
the matrix by forward products.

The rule. Split the rows into a set ``R`` and the rest. Color the rows of ``R`` so that two rows
of one color share no column (a row coloring of ``J[R, :]``), and the columns so that two
columns of one color share no row outside ``R`` (a column coloring of ``J[~R, :]``). Then

- a vector-Jacobian product with the seed of row color ``c`` (ones on the rows of ``R`` of that
  color, zeros elsewhere) holds, in column ``j``, the one entry ``J[r, j]`` of that color: every
  entry of the rows of ``R``;
- a Jacobian-vector product with the seed of column color ``k`` holds, in row ``i`` outside
  ``R``, the one entry ``J[i, j]`` of that color: every other entry.

Every nonzero is read from exactly one product, alone in its entry, so decompression is a gather,
as one-sided colorings. The same holds with the roles of rows and columns exchanged (columns of
a set ``C`` by forward products, the rest by rows; a nonzero is then read by its column). An arrowhead (one dense row, one dense column,
a diagonal) takes 1 reverse and 2 forward products at any size, where a one-sided coloring takes
``n``.

The choice of ``R``: rows sorted by length, longest first; each prefix made of the rows at least
as long as one of the few longest lengths is tried (and the same for columns), and the split
of fewest products kept. This is the simple cousin of a star bicoloring of the bipartite graph
(Coleman and Verma): it never needs more products than the better one-sided coloring (the
empty ``R`` is a column coloring, ``R`` of all rows a row coloring), and it takes the dense rows
and columns out of the other side's way, which is where one-sided colorings lose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ._graphs import _partial_distance2, as_pattern

if TYPE_CHECKING:
    from scipy.sparse import csr_array

__all__ = ["CANDIDATES", "Split", "index", "split"]

CANDIDATES = 12
"""Split sizes tried on each side: one per distinct length among the longest rows (columns)."""


class Split:
    """A bidirectional coloring: ``row_colors[r]`` (``-1`` outside ``R``) and ``column_colors[j]``
    (``-1`` for a column no forward product needs)."""

    def __init__(self, row_colors: np.ndarray, column_colors: np.ndarray, by: str = "rows") -> None:
        self.by = by  # "rows": a nonzero of a row of R is read in reverse; "columns": of a column of C, forward
        self.row_colors = row_colors
        self.column_colors = column_colors
        self.row_count = int(row_colors.max()) + 1 if row_colors.size and row_colors.max() >= 0 else 0
        self.column_count = int(column_colors.max()) + 1 if column_colors.size and column_colors.max() >= 0 else 0

    @property
    def count(self) -> int:
        return self.row_count + self.column_count


def _colors(matrix: csr_array, order: str) -> np.ndarray:
    return _partial_distance2(as_pattern(matrix), order)


def _by_rows(pattern: csr_array, chosen: np.ndarray, order: str) -> Split:
    """Rows in ``chosen`` (a boolean mask) by reverse products, the rest by forward ones."""
    import scipy.sparse as sp

    m, n = pattern.shape
    keep = sp.diags_array(chosen.astype(np.float64), shape=(m, m)) @ pattern
    rest = sp.diags_array((~chosen).astype(np.float64), shape=(m, m)) @ pattern
    row_colors = np.full(m, -1, dtype=np.int64)
    if chosen.any():
        colors = _colors(sp.csr_array(keep.T), order)
        row_colors[chosen] = colors[chosen]
    column_colors = np.full(n, -1, dtype=np.int64)
    if (~chosen).any():
        colors = _colors(sp.csr_array(rest), order)
        used = np.diff(sp.csc_array(rest).indptr) > 0
        column_colors[used] = colors[used]
    return Split(_renumber(row_colors), _renumber(column_colors))


def _renumber(colors: np.ndarray) -> np.ndarray:
    """Colors ``0 .. k - 1`` for the colors used, ``-1`` kept."""
    out = np.full(colors.shape, -1, dtype=np.int64)
    used = colors >= 0
    if used.any():
        _, out[used] = np.unique(colors[used], return_inverse=True)
    return out


def _prefixes(lengths: np.ndarray) -> list[np.ndarray]:
    """The masks of the rows at least as long as each of the few longest distinct lengths."""
    distinct = np.unique(lengths[lengths > 0])[::-1][:CANDIDATES]
    return [lengths >= value for value in distinct]


def _lower_bound(pattern: csr_array, chosen: np.ndarray, lengths: np.ndarray) -> int:
    """Products a split by rows ``chosen`` needs at least: the rows of R sharing a column need
    distinct reverse colors, and the longest row outside R as many forward ones as its length."""
    rest = int(lengths[~chosen].max(initial=0))
    entries = np.repeat(chosen, lengths)
    shared = np.bincount(pattern.indices[entries], minlength=pattern.shape[1]).max(initial=0) if chosen.any() else 0
    return int(shared) + rest


def split(pattern: csr_array, order: str = "natural", to_beat: int | None = None) -> Split | None:
    """The bidirectional coloring of fewest products among the splits tried (see the module).
    With ``to_beat`` (the products of a one-sided coloring already found), splits that cannot
    take fewer are not colored, and None is returned where none does."""
    import scipy.sparse as sp

    m = pattern.shape[0]
    best: Split | None = None
    limit = to_beat

    def better(candidate: Split) -> None:
        nonlocal best, limit
        if limit is None or candidate.count < limit:
            best, limit = candidate, candidate.count

    row_lengths = np.diff(pattern.indptr)
    for chosen in [np.zeros(m, dtype=bool), *_prefixes(row_lengths)]:
        if limit is None or _lower_bound(pattern, chosen, row_lengths) < limit:
            better(_by_rows(pattern, chosen, order))
    transposed = sp.csr_array(pattern.T)
    column_lengths = np.diff(transposed.indptr)
    for chosen in _prefixes(column_lengths):
        if limit is None or _lower_bound(transposed, chosen, column_lengths) < limit:
            flipped = _by_rows(transposed, chosen, order)  # columns of C forward, the rest by rows
            better(Split(flipped.column_colors, flipped.row_colors, by="columns"))
    return best


def index(pattern: csr_array, found: Split) -> np.ndarray:
    """For each nonzero of ``pattern`` (CSR data order), where it sits in the products laid end to
    end: first the ``column_count`` forward products ``J @ s_k`` (``m`` numbers each), then the
    ``row_count`` reverse products ``w_c^T J`` (``n`` numbers each)."""
    m, n = pattern.shape
    rows = np.repeat(np.arange(m, dtype=np.int64), np.diff(pattern.indptr))
    cols = pattern.indices.astype(np.int64)
    reverse = found.row_colors[rows] >= 0 if found.by == "rows" else found.column_colors[cols] < 0
    forward_at = found.column_colors[cols] * m + rows
    reverse_at = found.column_count * m + found.row_colors[rows] * n + cols
    at = np.where(reverse, reverse_at, forward_at)
    unread = (~reverse & (found.column_colors[cols] < 0)) | (reverse & (found.row_colors[rows] < 0))
    if unread.any() or np.unique(at).size != at.size:  # a wrong index would be a wrong value: checked
        raise AssertionError("internal error: the bidirectional coloring does not read each nonzero alone")
    return at  # type: ignore[no-any-return]
