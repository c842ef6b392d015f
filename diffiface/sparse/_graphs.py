"""The graph primitives of the colorings: a pattern read as a boolean CSR array, the vertex
orders, and the greedy partial distance-2 coloring of a pattern's columns. The one-sided
colorings (:mod:`._coloring`) and the bidirectional ones (:mod:`._bicoloring`) both build on
them."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _arrays
from .._errors import InvalidInputError, UnsupportedOperationError
from .._keys import HELD_LEVELS, held_entries, slots

if TYPE_CHECKING:
    from scipy.sparse import csr_array

__all__ = ["GRAPH_LIMIT", "ORDERS", "as_pattern"]


ORDERS = ("natural", "largest_first", "smallest_last")
"""The vertex orders the greedy colorings take: ``natural`` (index order; a banded pattern gets
one color per diagonal), ``largest_first`` (most neighbors first), ``smallest_last``
(repeatedly set aside a vertex of fewest remaining neighbors, color in reverse)."""


GRAPH_LIMIT = 20_000_000
"""smallest_last for a Jacobian needs the column (row) intersection graph; where it would hold more
entries than this (a dense row), the coloring uses largest_first instead."""


@dataclass(frozen=True)
class Detection:
    """A pattern found by :class:`GlobalDetector`, the tracer that read it, and its notes (the
    operations it did not know, taken as dense)."""

    pattern: Any
    tracer: str
    notes: tuple[str, ...] = ()
    kept: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)
    """The arrays a plain object in a context holds that the tracer read as they are, whose
    values the pattern holds for (numpy arrays, under the torch tracer)."""


def leaf_function(
    f: Callable[..., Any],
    x: Any,
    values: list[Any],
    traced: Callable[[Any], bool],
    held: Callable[[Any], bool] | None = None,
) -> Any:
    """``f(x, *values)`` as a function of x's leaves, then of the contexts' leaves for which
    ``traced`` holds (the others kept), then of the arrays for which ``held`` (default
    ``traced``) holds among those a plain object in a context holds (:func:`_holding`),
    returning the leaves of its result; and those context leaves and arrays."""
    import optree

    from .. import tree

    leaves, spec = tree.flatten(x)
    k = len(leaves)
    context_leaves, context_spec = tree.flatten(values)
    found: list[Any] = []
    memo: dict[int, Rebuild | None] = {}
    rebuilds = {
        i: rebuild
        for i, leaf in enumerate(context_leaves)
        if (rebuild := _holding(leaf, held or traced, HELD_LEVELS, found, memo)) is not None
    }
    where = [i for i, leaf in enumerate(context_leaves) if i not in rebuilds and traced(leaf)]

    def run(*args: Any) -> list[Any]:
        new = list(context_leaves)
        for i, t in zip(where, args[k : k + len(where)], strict=True):
            new[i] = t
        replacements = iter(args[k + len(where) :])
        done: dict[int, Any] = {}
        for i, rebuild in rebuilds.items():
            new[i] = rebuild(replacements, done)
        return tree.leaves(f(optree.tree_unflatten(spec, list(args[:k])), *optree.tree_unflatten(context_spec, new)))

    return run, [context_leaves[i] for i in where] + found


Rebuild = Callable[[Iterator[Any], dict[int, Any]], Any]
"""A copy of an object with the arrays it holds replaced (:func:`_holding`): of the replacements,
taken in order, and of the copies made so far in this call (by the id of their original)."""


def _holding(
    value: Any, wanted: Callable[[Any], bool], levels: int, found: list[Any], memo: dict[int, Rebuild | None]
) -> Rebuild | None:
    """How to rebuild ``value``, a context's leaf, with the arrays ``wanted`` picks among those
    it holds replaced: in a plain object's attributes (``__dict__`` and slots), and in the lists,
    tuples and dicts among them (of at most 64 items), ``levels`` objects deep. A Constant is
    data the pattern must hold for, whatever it holds the data in: a model object's matrix is as
    abstract as a dict's. Its arrays are added to ``found``; the rebuild takes their
    replacements in that order and copies (``copy.copy``) what holds them, once each (an object
    held twice is one copy), never writing into the caller's objects. None where ``value``
    holds none (it reaches f as it is)."""
    key = id(value)
    if key in memo:  # (held twice: the same copy; or a cycle back to an object being read)
        return memo[key]
    memo[key] = None
    listed = held_entries(value, levels)  # (an array as a leaf is the tracer's to take or not)
    if listed is None:
        return None
    entries, levels = listed
    container = type(value) in (list, tuple, dict)
    parts: list[tuple[Any, Rebuild]] = []
    for name, entry in entries:
        if _arrays.is_array(entry) and wanted(entry):
            found.append(entry)
            parts.append((name, lambda replacements, done: next(replacements)))
        elif (inner := _holding(entry, wanted, levels, found, memo)) is not None:
            parts.append((name, inner))
    if not parts:
        return None
    if not container:
        try:
            copy.copy(value)
        except Exception as error:
            raise UnsupportedOperationError(
                f"GlobalDetector makes the arrays a Constant holds abstract, so that the pattern holds for "
                f"every value of them, and reads a copy of the {type(value).__name__} that holds them, which "
                f"cannot be copied ({type(error).__name__}: {first_line(error)}). Pass its arrays in a dict, "
                "tuple or dataclass pytree, or use LocalDetector(...) or KnownPattern(pattern)."
            ) from error
    own_slots = {} if container else slots(type(value))

    def rebuild(replacements: Iterator[Any], done: dict[int, Any]) -> Any:
        if key in done:
            return done[key]
        items: Any = dict(value) if type(value) is dict else list(value) if container else copy.copy(value)
        done[key] = items
        for name, part in parts:
            replacement = part(replacements, done)
            if container:
                items[name] = replacement
            elif name in own_slots:
                own_slots[name].__set__(items, replacement)
            else:  # (into its own dict: past a __setattr__ that refuses, a frozen dataclass's)
                items.__dict__[name] = replacement
        if type(value) is tuple:
            done[key] = items = tuple(items)
        return items

    memo[key] = rebuild
    return rebuild


def first_line(error: BaseException) -> str:
    """The first line of a tracer's error, for a message that names it."""
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


def as_pattern(pattern: Any, shape: tuple[int, int] | None = None, what: str = "pattern") -> csr_array:
    """``pattern`` (a scipy.sparse matrix or array, or a 2-d array-like whose nonzeros are the
    pattern) as a canonical boolean ``csr_array``: sorted indices, no duplicates, no stored zeros.

    Raises
    ------
    InvalidInputError
        If it is not 2-d, or not of ``shape`` when given.
    """
    import scipy.sparse as sp

    if sp.issparse(pattern):
        matrix = sp.csr_array(pattern, copy=True)
    else:
        try:
            dense = np.asarray(pattern)
        except Exception as error:
            raise InvalidInputError(
                f"The {what} must be a scipy.sparse matrix or a 2-d boolean array; got {type(pattern).__name__}."
            ) from error
        if dense.ndim != 2 or dense.dtype == object:
            raise InvalidInputError(
                f"The {what} must be a scipy.sparse matrix or a 2-d boolean array; got "
                f"{type(pattern).__name__} of shape {dense.shape} and dtype {dense.dtype}."
            )
        matrix = sp.csr_array(dense != 0)
    if shape is not None and tuple(matrix.shape) != tuple(shape):
        raise InvalidInputError(f"The {what} has shape {tuple(matrix.shape)}; expected {tuple(shape)}.")
    matrix.sum_duplicates()
    matrix.data = matrix.data != 0
    matrix.eliminate_zeros()
    matrix = matrix.astype(bool)
    matrix.sort_indices()
    matrix.indices = matrix.indices.astype(np.int64, copy=False)
    matrix.indptr = matrix.indptr.astype(np.int64, copy=False)
    return matrix


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise InvalidInputError(f"Unknown coloring order {order!r}; use one of {', '.join(map(repr, ORDERS))}.")


def _partial_distance2(matrix: csr_array, order: str) -> np.ndarray:
    """Colors of the columns of ``matrix`` such that no two columns of one color share a row."""
    import scipy.sparse as sp

    m, n = matrix.shape
    by_column = sp.csc_array(matrix)
    by_column.sort_indices()
    visit = _order(matrix, by_column, order)
    cindptr = by_column.indptr.tolist()
    crows = by_column.indices.tolist()
    used = [0] * m  # per row: the colors of its columns colored so far, as bits
    colors = [0] * n
    for j in visit:
        rows = crows[cindptr[j] : cindptr[j + 1]]
        forbidden = 0
        for r in rows:
            forbidden |= used[r]
        c = (~forbidden & (forbidden + 1)).bit_length() - 1  # the lowest bit not set
        colors[j] = c
        bit = 1 << c
        for r in rows:
            used[r] |= bit
    return np.asarray(colors, dtype=np.int64)


def _order(matrix: csr_array, by_column: Any, order: str) -> list[int]:
    """The order in which the columns of ``matrix`` are colored."""
    n = matrix.shape[1]
    if order == "natural" or n == 0:
        return list(range(n))
    if order == "largest_first":
        # The degree in the column intersection graph, bounded by the sum over a column's rows of
        # their lengths: exact where rows share at most one column with each other, and cheap
        # where the graph itself would not fit in memory (one dense row).
        row_lengths = np.diff(matrix.indptr)
        lengths_of_entries = row_lengths[by_column.indices]
        col_of_entries = np.repeat(np.arange(n), np.diff(by_column.indptr))
        weight = np.bincount(col_of_entries, weights=lengths_of_entries - 1, minlength=n)
        return np.argsort(-weight, kind="stable").tolist()  # type: ignore[no-any-return]
    row_lengths = np.diff(matrix.indptr).astype(np.float64)
    if float((row_lengths**2).sum()) > GRAPH_LIMIT:
        return _order(matrix, by_column, "largest_first")
    graph = (by_column.T.astype(np.int32) @ matrix.astype(np.int32)).tocsr()  # the column intersection graph
    graph.setdiag(0)
    graph.eliminate_zeros()
    return _graph_order(graph)


def _graph_order(graph: Any) -> list[int]:
    """The smallest_last order of the vertices of a symmetric CSR graph (no diagonal): remove a
    vertex of smallest remaining degree, again and again; color in the reverse order. Buckets of
    vertices by degree keep it linear in the edges."""
    n = graph.shape[0]
    indptr = graph.indptr.tolist()
    indices = graph.indices.tolist()
    degree = np.diff(graph.indptr).tolist()
    buckets: list[dict[int, None]] = [{} for _ in range(max(degree, default=0) + 1)]
    for v in range(n):
        buckets[degree[v]][v] = None
    removed = [False] * n
    picked: list[int] = []
    low = 0
    for _ in range(n):
        while not buckets[low]:
            low += 1
        v = next(iter(buckets[low]))
        del buckets[low][v]
        removed[v] = True
        picked.append(v)
        for w in indices[indptr[v] : indptr[v + 1]]:
            if not removed[w]:
                d = degree[w]
                del buckets[d][w]
                degree[w] = d - 1
                buckets[d - 1][w] = None
        low = max(low - 1, 0)
    return picked[::-1]
