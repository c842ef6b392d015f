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

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import optree

from . import _arrays
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
    while _adopt_jax_nodes(leaves_):  # each round registers at least one new class
        leaves_, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    return leaves_, spec


_ADOPTED: set[type] = set()
_ADOPT_LOCK = threading.Lock()


def _adopt_jax_nodes(leaves_: list[Any]) -> bool:
    """Register with optree every class among ``leaves_`` that jax flattens but optree took
    for a leaf; True if any was registered (the tree is then flattened again, to find those
    inside them).

    Cheap when there is none: one type lookup per leaf."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    found = False
    for leaf in leaves_:
        if _arrays.kind(leaf) != "other" or type(leaf) in _ADOPTED:
            continue
        if jax.tree_util.all_leaves([leaf]):
            continue
        with _ADOPT_LOCK:
            if type(leaf) not in _ADOPTED:
                optree.register_pytree_node(type(leaf), _jax_children, _from_jax_children, namespace=NAMESPACE)
                _ADOPTED.add(type(leaf))
        found = True
    return found


def _jax_children(node: Any) -> tuple[list[Any], Any, list[Any]]:
    """One level of a jax pytree node: its children, jax's structure to rebuild it, and the
    children's names (an attribute's or a key's) for paths."""
    tree_util = sys.modules["jax"].tree_util
    pairs, treedef = tree_util.tree_flatten_with_path(node, is_leaf=lambda child: child is not node)
    return [child for _, child in pairs], treedef, [_entry_name(path[-1]) if path else None for path, _ in pairs]


def _entry_name(entry: Any) -> Any:
    for attribute in ("name", "key", "idx"):
        if hasattr(entry, attribute):
            return getattr(entry, attribute)
    return str(entry)


def _from_jax_children(treedef: Any, children: Any) -> Any:
    return sys.modules["jax"].tree_util.tree_unflatten(treedef, list(children))


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
    if family not in ("python", "numpy", "torch", "jax"):
        raise ArrayTypeError(
            "tree.ravel needs the leaves of one array framework (Python numbers may go with "
            f"any); found {sorted(set(kinds))}. Convert the leaves to one framework first."
        )
    xp = _namespace(family)
    wide = family == "jax" and any(_arrays.dtype_name(leaf) == "float64" for leaf in leaves_)
    placed = _placed_on_one_mesh(leaves_) if family == "jax" else None
    if placed is not None:
        return _ravel_on_devices(leaves_, spec, placed, wide)
    with _x64(wide):  # jax makes float64 arrays only where x64 is on: on here, never globally
        arrays = [_as_family(leaf, kind, family) for leaf, kind in zip(leaves_, kinds, strict=True)]
        shapes = [tuple(a.shape) for a in arrays]
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        dtypes = [a.dtype for a in arrays]
        flat = xp.concatenate([xp.reshape(a, (-1,)) for a in arrays]) if arrays else xp.zeros((0,))
    offsets = np.cumsum([0, *sizes])

    flat_dtype = _arrays.dtype_name(flat)

    def unravel(vector: Any) -> PyTree:
        _check_vector(vector, family, int(offsets[-1]), flat_dtype)
        rebuilt = []
        with _x64(wide):
            for i, (kind, shape_, dtype) in enumerate(zip(kinds, shapes, dtypes, strict=True)):
                piece = xp.reshape(vector[offsets[i] : offsets[i + 1]], shape_)
                piece = _cast(piece, dtype, family)
                rebuilt.append(_python_scalar(piece) if kind == "python" else piece)
        return optree.tree_unflatten(spec, rebuilt)

    return flat, unravel


def _placed_on_one_mesh(leaves_: list[Any]) -> Any:
    """The mesh of jax leaves that are all sharded over one mesh (not traced); else None."""
    jax = sys.modules["jax"]
    meshes = set()
    for leaf in leaves_:
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            return None
        sharding = leaf.sharding
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return None
        meshes.add(sharding.mesh)
    return next(iter(meshes)) if len(meshes) == 1 and len(next(iter(meshes)).devices.flat) > 1 else None


def _ravel_on_devices(leaves_: list[Any], spec: Any, mesh: Any, wide: bool) -> tuple[Any, Callable[[Any], PyTree]]:
    """ravel for leaves sharded over one mesh: the flat vector is made on the mesh's devices,
    sharded along all its axes (replicated when its size does not divide), and unravel gives
    back each leaf's sharding; nothing goes through the host."""
    jax = sys.modules["jax"]
    jnp = sys.modules["jax.numpy"]
    shapes = [tuple(leaf.shape) for leaf in leaves_]
    dtypes = [leaf.dtype for leaf in leaves_]
    shardings = [leaf.sharding for leaf in leaves_]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    offsets = [int(o) for o in np.cumsum([0, *sizes])]
    total = offsets[-1]
    axes = tuple(mesh.axis_names)
    split = jax.sharding.PartitionSpec(axes) if total % mesh.devices.size == 0 else jax.sharding.PartitionSpec()
    flat_sharding = jax.sharding.NamedSharding(mesh, split)
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

    def program(body: Callable[[Any], Any], out: Any) -> Callable[[Any], Any]:
        if explicit:  # (reshapes across sharded dims are the compiler's to lay out)
            return jax.jit(lambda arg: jax.sharding.auto_axes(body, out_sharding=out)(arg))  # type: ignore[no-any-return]
        return jax.jit(body, out_shardings=out)  # type: ignore[no-any-return]

    def join(arrays: list[Any]) -> Any:
        return jnp.concatenate([a.reshape(-1) for a in arrays])

    def part(vector: Any) -> list[Any]:
        return [
            vector[offsets[i] : offsets[i + 1]].reshape(shape).astype(dtype)
            for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True))
        ]

    with _x64(wide):
        flat = program(join, flat_sharding)(list(leaves_))
    flat_dtype = _arrays.dtype_name(flat)
    parts = program(part, shardings)

    def unravel(vector: Any) -> PyTree:
        _check_vector(vector, "jax", total, flat_dtype)
        with _x64(wide):
            return optree.tree_unflatten(spec, parts(vector))

    return flat, unravel


_WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def _check_vector(vector: Any, family: str, size: int, flat_dtype: str) -> None:
    """What unravel takes: a real vector of the raveled tree's size and array type (numpy for
    Python numbers), at least as precise as the raveled vector, so that no leaf comes back of
    another type, or typed wider than the precision its values hold."""
    kind = _arrays.kind(vector)
    expected = "numpy" if family == "python" else family
    if kind != expected and not (kind == "autograd" and expected == "numpy"):
        raise ArrayTypeError(
            f"unravel takes a {expected} vector, as tree.ravel returned; got a {type(vector).__name__}. "
            f"Convert it to {expected} first."
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
    if _WIDTH.get(dtype, 64) < _WIDTH.get(flat_dtype, 0):
        raise InvalidInputError(
            f"unravel takes a vector of dtype {flat_dtype}, as tree.ravel returned; got {dtype}, which "
            f"would come back as {flat_dtype} leaves holding {dtype} precision. Cast it to {flat_dtype} first."
        )


def _x64(on: bool) -> Any:
    """A scope where jax keeps float64 (``jax.enable_x64``) when ``on``; else nothing."""
    return sys.modules["jax"].enable_x64(True) if on else contextlib.nullcontext()


def _namespace(family: str) -> Any:
    if family == "torch":
        return sys.modules["torch"]
    if family == "jax":
        return sys.modules["jax.numpy"]
    return np


def _as_family(leaf: Any, kind: str, family: str) -> Any:
    if kind != "python":
        return leaf
    if family == "python":
        return np.asarray(leaf, dtype=np.float64)
    xp = _namespace(family)
    return xp.asarray(leaf)


def _cast(piece: Any, dtype: Any, family: str) -> Any:
    if family == "torch":
        return piece.to(dtype)
    return piece.astype(dtype)


def _python_scalar(piece: Any) -> Any:
    value = piece.item()
    return float(value) if isinstance(value, (int, float)) else value
