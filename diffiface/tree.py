"""Pytree helpers, on optree: dicts, lists, tuples, namedtuples, ``None`` and registered types.

Examples
--------
>>> import numpy as np
>>> from diffiface import tree
>>> params = {"w": np.ones((2, 2), dtype=np.float32), "b": np.zeros(2)}
>>> flat, unravel = tree.ravel(params)
>>> flat.shape, flat.dtype
((6,), dtype('float64'))
>>> rebuilt = unravel(flat)
>>> rebuilt["w"].dtype, rebuilt["w"].shape
(dtype('float32'), (2, 2))
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import optree

from . import _arrays, _families
from ._errors import ArrayTypeError, InvalidInputError

__all__ = [
    "NAMESPACE",
    "flatten",
    "flatten_with_path",
    "leaves",
    "leaves_with_paths",
    "map",
    "path_string",
    "ravel",
    "structure",
]

PyTree = Any

NAMESPACE = "diffiface"
"""The optree namespace diffiface flattens with: register your own pytree types with
``optree.register_pytree_node(cls, flatten, unflatten, namespace="diffiface")`` (or
``@optree.register_pytree_node_class(namespace="diffiface")``). Types registered globally
work too, and so do types registered with jax's pytree registry (equinox modules,
``flax.struct`` dataclasses, ``nnx.State``, haiku containers): diffiface registers each in its
namespace the first time it meets one, flattening it one level through jax."""


def flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """The leaves of ``tree`` and its structure (``None`` is an empty node, not a leaf)."""
    leaves_, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    while _adopt_foreign_nodes(leaves_):  # each round registers at least one new class
        leaves_, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    return leaves_, spec


_ADOPTED: set[type] = set()
_BUILTIN_LEAVES = frozenset({str, bytes, bool, int, float, complex, type(None)})
"""Leaves no framework's registry makes nodes of: no registry is asked about them (nor can be
inside another engine's trace, such as torch.compile's of an aux that holds a string)."""
_ADOPT_LOCK = threading.Lock()


def _adopt_foreign_nodes(leaves_: list[Any]) -> bool:
    """Register with optree every class among ``leaves_`` that a framework's pytree registry
    flattens but optree took for a leaf; True if any was registered (the tree is then flattened
    again, to find those inside them).

    Cheap when there is none: one type lookup per leaf."""
    found = False
    for leaf in leaves_:
        if type(leaf) in _ADOPTED or type(leaf) in _BUILTIN_LEAVES or _arrays.kind(leaf) != "other":
            continue
        node = _families.foreign_node(leaf)
        if node is None:
            continue
        with _ADOPT_LOCK:
            if type(leaf) not in _ADOPTED:
                optree.register_pytree_node(type(leaf), *node, namespace=NAMESPACE)
                _ADOPTED.add(type(leaf))
        found = True
    return found


def flatten_with_path(tree: PyTree) -> tuple[list[tuple[Any, ...]], list[Any], optree.PyTreeSpec]:
    """Paths, leaves and structure of ``tree``."""
    flatten(tree)  # registers the jax pytree types it holds
    return optree.tree_flatten_with_path(tree, namespace=NAMESPACE)


def structure(tree: PyTree) -> optree.PyTreeSpec:
    """The structure of ``tree``, comparable with ``==``."""
    return flatten(tree)[1]


def leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree``, in flattening order."""
    return flatten(tree)[0]


def map(func: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:  # noqa: A001
    """Apply ``func`` leaf by leaf to ``tree`` and trees of the same structure."""
    flatten(tree)  # registers the jax pytree types it holds
    return optree.tree_map(func, tree, *rest, namespace=NAMESPACE)


def path_string(path: tuple[Any, ...]) -> str:
    """A readable path such as ``['layer'][0]``; the empty path (a bare leaf) is ``''``."""
    return "".join(f"[{entry!r}]" for entry in path)


def leaves_with_paths(tree: PyTree) -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs in flattening order, paths as :func:`path_string` writes them."""
    paths, leaves_, _ = flatten_with_path(tree)
    return [(path_string(p), leaf) for p, leaf in zip(paths, leaves_, strict=True)]


def ravel(tree: PyTree) -> tuple[Any, Callable[[Any], PyTree]]:
    """One flat vector holding every leaf of ``tree``, and the function that rebuilds the tree.

    The vector has the leaves' array type (numpy for numpy arrays and Python numbers, torch
    for tensors, jax for jax arrays) and their common dtype; ``unravel`` restores every leaf's
    shape, dtype and array type (Python numbers come back as Python numbers).

    Raises
    ------
    ArrayTypeError
        If the tree mixes array types (say numpy and torch), or ``unravel`` is given a vector
        of another array type than ``ravel`` returned.
    InvalidInputError
        If ``unravel`` is given a vector of another shape, or a complex one.
    """
    leaves_, spec = flatten(tree)
    kinds = [_arrays.kind(leaf) for leaf in leaves_]
    if "other" in kinds:
        path, leaf = leaves_with_paths(tree)[kinds.index("other")]
        raise ArrayTypeError(
            f"tree.ravel flattens arrays and numbers, and the tree holds a {type(leaf).__name__} at {path or 'its root'}, "
            "which is neither (a function, a string, an object). diffiface's dense operators pass such leaves "
            "of x to f as they are (static, as eqx.filter_grad does); AutoSparse and tree.ravel take arrays "
            "only. Split the arrays off: params, static = eqx.partition(model, eqx.is_inexact_array); "
            "differentiate lambda params, static: loss(eqx.combine(params, static)) with respect to params, "
            "passing di.Constant(static)."
        )
    family = _arrays.family(set(kinds))
    found = _arrays.BY_KIND.get(family)
    if found is None or not (found.ARRAY or family == "python"):
        raise ArrayTypeError(
            "tree.ravel needs the leaves of one array framework (Python numbers may go with "
            f"any); found {sorted(set(kinds))}. Convert the leaves to one framework first."
        )
    own: _families.Family = found
    laid_out = own.laid_out_ravel(leaves_)
    if laid_out is not None:
        flat, parts = laid_out
    else:
        numbers = not own.ARRAY
        if numbers:  # Python numbers only: raveled as the host's float64 arrays
            own = _families.HOST
        xp = own.numpy_like()
        scope = own.dtype_scope  # (jax makes float64 arrays only where x64 is on: on here, never globally)
        dtypes = {_arrays.dtype_name(leaf) for leaf, kind in zip(leaves_, kinds, strict=True) if kind != "python"}
        with scope(dtypes):
            arrays = [
                (np.asarray(leaf, dtype=np.float64) if numbers else xp.asarray(leaf)) if kind == "python" else leaf
                for leaf, kind in zip(leaves_, kinds, strict=True)
            ]
            shapes = [tuple(a.shape) for a in arrays]
            sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
            names = [_arrays.dtype_name(a) for a in arrays]
            flat = xp.concatenate([xp.reshape(a, (-1,)) for a in arrays]) if arrays else xp.zeros((0,))
        offsets = np.cumsum([0, *sizes])

        def parts(vector: Any) -> list[Any]:
            rebuilt = []
            with scope(dtypes):
                for i, (kind, shape_, name) in enumerate(zip(kinds, shapes, names, strict=True)):
                    piece = xp.reshape(vector[offsets[i] : offsets[i + 1]], shape_)
                    piece = own.cast(piece, name)
                    rebuilt.append(_python_scalar(piece) if kind == "python" else piece)
            return rebuilt

    flat_dtype = _arrays.dtype_name(flat)
    total = int(flat.shape[0])

    def unravel(vector: Any) -> PyTree:
        _check_vector(vector, own, total, flat_dtype)
        return optree.tree_unflatten(spec, parts(vector))

    return flat, unravel


def _check_vector(vector: Any, own: _families.Family, size: int, flat_dtype: str) -> None:
    """What unravel takes: a real vector of the raveled tree's size and array type (the host's
    for Python numbers), at least as precise as the raveled vector, so that no leaf comes back of
    another type, or typed wider than the precision its values hold."""
    found = _arrays.family_of(vector)
    # (a value an enclosing engine traces, an autograd box, stands for the host's array it holds)
    if found is not own and not (found is not None and found.PASSED_THROUGH and own is _families.HOST):
        raise ArrayTypeError(
            f"unravel takes a {own.NAME} vector, as tree.ravel returned; got a {type(vector).__name__}. "
            f"Convert it to {own.NAME} first."
        )
    shape = tuple(getattr(vector, "shape", ()))
    if shape != (size,):
        raise InvalidInputError(f"unravel takes a vector of shape ({size},), as tree.ravel returned; got {shape}.")
    dtype = _arrays.dtype_name(vector)
    if "complex" in dtype:
        raise InvalidInputError(
            f"unravel takes a real vector; got dtype {dtype}, whose imaginary part would be dropped. "
            "Pass the real and imaginary parts separately."
        )
    if _arrays.FLOAT_WIDTHS.get(dtype, 64) < _arrays.FLOAT_WIDTHS.get(flat_dtype, 0):
        raise InvalidInputError(
            f"unravel takes a vector of dtype {flat_dtype}, as tree.ravel returned; got {dtype}, which "
            f"would come back as {flat_dtype} leaves holding {dtype} precision. Cast it to {flat_dtype} first."
        )


def _python_scalar(piece: Any) -> Any:
    value = piece.item()
    return float(value) if isinstance(value, (int, float)) else value
