"""jax arrays and tracers."""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Final

import numpy as np
import optree

from . import _jax_placement as _placement
from ._jax_placement import block_like as block_like
from ._jax_placement import laid_out_ravel as laid_out_ravel
from ._shared import Held, array_words, numpy_like_complex
from ._shared import cast as cast
from ._shared import contents as contents
from ._shared import opened as opened
from ._shared import private_copy as private_copy  # (immutable)
from ._shared import traced as traced
from ._shared import x_refusal as x_refusal

NAME: Final = "jax"
ARRAY: Final = True
PASSED_THROUGH: Final = False
ARRAY_METHODS: Final = True
CODE_MODULES: Final[frozenset[str]] = frozenset({"jax", "jaxlib"})
PACKAGES: Final[frozenset[str]] = frozenset({"jax", "jaxlib"})
"""Its wrapped functions (``jax.nn.relu`` is a jitted function, others custom_jvp objects)
are code: a static context holding one is compared by identity."""


def owns(cls: type) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and (issubclass(cls, jax.Array) or issubclass(cls, jax.core.Tracer))


def signature(leaf: Any) -> tuple[Any, ...]:
    if not isinstance(leaf, sys.modules["jax"].core.Tracer):
        # where its shards live: results are laid out as x (_jax_placement)
        return (NAME, tuple(leaf.shape), leaf.dtype, leaf.sharding)
    return (NAME, tuple(leaf.shape), leaf.dtype)


def numpy_like() -> Any:
    return sys.modules["jax.numpy"]


def to_numpy(leaf: Any) -> np.ndarray:
    return np.asarray(leaf)


def from_numpy(array: np.ndarray, like: Any, dtype: Any) -> Any:
    if like is None and dtype is None:  # (the array's own dtype, where jax keeps it)
        return sys.modules["jax.numpy"].asarray(array)
    return sys.modules["jax.numpy"].asarray(array, dtype=like.dtype if dtype is None else dtype)


def foreign_tree(leaf: Any) -> tuple[Any, ...]:
    """Structure and leaf shapes of a pytree only jax knows (a flax or equinox object)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return ()
    leaves, treedef = jax.tree_util.tree_flatten(leaf)
    if len(leaves) == 1 and leaves[0] is leaf:
        return ()
    return (treedef, tuple((tuple(getattr(a, "shape", ())), getattr(a, "dtype", None)) for a in leaves))


def foreign_contents(value: Any) -> Held | None:
    """What a closure keeps of a pytree only jax knows (a flax nnx ``Variable`` or module, an
    equinox module) that f reads: its structure and its leaves, compared by identity (an nnx
    ``Variable`` an optimizer updates holds a new array); None for anything else (a leaf, a
    dict, list or tuple, whose entries f names are followed as such, or no jax)."""
    jax = sys.modules.get("jax")
    if jax is None or isinstance(value, (dict, list, tuple)) or jax.tree_util.all_leaves([value]):
        return None
    try:
        return _SameLeaves(value)
    except Exception:  # (a node whose flattening fails now: not followed)
        return None


class _SameLeaves:
    __slots__ = ("leaves", "structure")

    def __init__(self, value: Any) -> None:
        leaves, self.structure = sys.modules["jax"].tree_util.tree_flatten(value)
        self.leaves = tuple(map(_reference, leaves))

    def holds(self, value: Any) -> bool:
        try:
            leaves, structure = sys.modules["jax"].tree_util.tree_flatten(value)
        except Exception:
            return False
        if structure != self.structure or len(leaves) != len(self.leaves):
            return False
        return all(kept() is leaf for kept, leaf in zip(self.leaves, leaves, strict=True))


def _reference(leaf: Any) -> Callable[[], Any]:
    """A weak reference to ``leaf`` where it takes one (a jax array), so that a closure does not
    keep a model's old arrays alive; else a strong one."""
    try:
        return weakref.ref(leaf)
    except TypeError:
        return lambda: leaf


def foreign_node(leaf: Any) -> tuple[Callable[[Any], Any], Callable[[Any, Any], Any]] | None:
    """How to flatten one level of a class only jax's pytree registry knows, and rebuild it."""
    jax = sys.modules.get("jax")
    if jax is None or jax.tree_util.all_leaves([leaf]):
        return None
    return _children, _from_children


def _children(node: Any) -> tuple[list[Any], Any, list[Any]]:
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


def _from_children(treedef: Any, children: Any) -> Any:
    return sys.modules["jax"].tree_util.tree_unflatten(treedef, list(children))


def jax_structure(spec: Any, leaves: list[Any]) -> tuple[Any, Any, Callable[[Any], Any]] | None:
    """The tree of optree structure ``spec`` on these leaves, jax's structure of it and jax's
    flattening, where jax is imported and takes that tree apart into the same leaves; else None.
    A class jax's registry knows (an equinox module, adopted into diffiface's namespace) is
    taken apart by jax in C, not one node at a time through that namespace; one only
    diffiface's namespace knows is a leaf to jax, and the leaves then differ."""
    jax = sys.modules.get("jax")
    if jax is None or spec is None:
        return None
    flatten = jax.tree_util.default_registry.flatten  # (the registry's own, in C: tree_flatten is a frame around it)
    tree = optree.tree_unflatten(spec, leaves)
    try:
        jax_leaves, jax_spec = flatten(tree)
    except Exception:  # (a tree jax cannot take apart)
        return None
    if len(jax_leaves) != len(leaves) or not all(a is b for a, b in zip(jax_leaves, leaves, strict=True)):
        return None
    return tree, jax_spec, flatten


def rebuilds_alike(spec: Any, leaves: list[Any]) -> bool:
    """Whether jax's pytrees take the tree of structure ``spec`` (optree's) apart into these
    leaves and rebuild it as optree does: the same node types, dict keys in the same order
    (jax sorts them; optree keeps the order they were given in)."""
    found = jax_structure(spec, leaves)
    if found is None:
        return False
    tree, jax_spec, _ = found
    return _same_nodes(tree, jax_spec.unflatten(leaves))


def _same_nodes(a: Any, b: Any) -> bool:
    """Whether two trees hold the same node types and dict key orders, inside the classes jax's
    registry opens too (an equinox module holding a dict)."""
    one_level = sys.modules["jax"].tree_util.default_registry.flatten_one_level
    pending = [(a, b)]
    while pending:  # (without recursion: a tree may be deeper than Python's stack)
        a, b = pending.pop()
        if type(a) is not type(b):
            return False
        if isinstance(a, dict):
            if list(a) != list(b):
                return False
            pending += [(a[key], b[key]) for key in a]
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return False
            pending += zip(a, b, strict=True)
        elif (opened := one_level(a)) is not None:  # (None: a leaf)
            pending += zip(opened[0], one_level(b)[0], strict=True)
    return True


def mirror(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is not _SELF:
        value = from_numpy(np.asarray(as_numpy(value)), like, None)
    elif value.dtype != like.dtype:
        value = value.astype(like.dtype)
    return _placement.like_x(value, like)


def as_own(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is None or value_family is _SELF:
        return value
    array = np.asarray(as_numpy(value))
    return _placement.on_devices_of(from_numpy(array, like, array.dtype), like)


def layout(leaf: Any) -> _placement.Layout | None:
    """The test of a concrete array's layout; None for a traced one (its layout is the trace's)."""
    if isinstance(leaf, sys.modules["jax"].core.Tracer):
        return None
    return _placement.Layout(leaf.sharding)


def same(leaf: Any) -> Callable[[Any], bool]:
    """The test that a later array has the prepared one's shape and dtype, and its layout where
    there is one to read (results are laid out as x: another layout is another prep): not a
    traced x's, which is the trace's, nor where jax has one device in this process."""
    shape, dtype = leaf.shape, leaf.dtype
    if isinstance(leaf, sys.modules["jax"].core.Tracer) or _one_device(leaf):

        def test(value: Any) -> bool:
            # (an array's abstract value answers shape and dtype at a quarter of its properties' cost)
            aval = value.aval
            return aval.shape == shape and aval.dtype == dtype  # type: ignore[no-any-return]

        return test
    layout = _placement.Layout(leaf.sharding)

    def laid_out(value: Any) -> bool:
        aval = value.aval
        return aval.shape == shape and aval.dtype == dtype and layout.holds(value)  # type: ignore[no-any-return]

    return laid_out


def _one_device(leaf: Any) -> bool:
    """Whether jax has one device in this process, where ``leaf`` lives."""
    return bool(sys.modules["jax"].device_count() == 1 and len(leaf.sharding.device_set) == 1)


def jit_checked(leaf: Any) -> bool:
    """Whether a program whose engine retraces for new shapes and dtypes (jit) checks this
    leaf itself: a concrete array where jax has one device (jit then keys its programs by
    exactly what a plan would compare)."""
    return not isinstance(leaf, sys.modules["jax"].core.Tracer) and _one_device(leaf)


class _OneDeviceLeaves:
    """:class:`_Leaves` where jax has one device in this process: every concrete array lives
    there, laid out the one way, so a layout needs no reading (a Python property per leaf)."""

    __slots__ = ("expected",)

    def __init__(self, leaves: list[Any]) -> None:
        self.expected = tuple((type(leaf), leaf.aval.shape, leaf.aval.dtype) for leaf in leaves)

    def __call__(self, leaves: list[Any]) -> bool:
        expected = self.expected
        if len(leaves) != len(expected):
            return False
        for leaf, (cls, shape, dtype) in zip(leaves, expected, strict=False):
            if type(leaf) is not cls:
                return False
            aval = leaf.aval
            if aval.shape != shape or aval.dtype != dtype:
                return False
        return True


class _Leaves:
    """The test of a list of concrete arrays, the common case under jax, with no call per leaf
    but the one its layout takes: type, abstract value's shape and dtype, layout."""

    __slots__ = ("expected",)

    def __init__(self, leaves: list[Any]) -> None:
        self.expected = tuple(
            (type(leaf), leaf.aval.shape, leaf.aval.dtype, _placement.Layout(leaf.sharding)) for leaf in leaves
        )

    def __call__(self, leaves: list[Any]) -> bool:
        expected = self.expected
        if len(leaves) != len(expected):
            return False
        for leaf, (cls, shape, dtype, layout) in zip(leaves, expected, strict=False):
            if type(leaf) is not cls:
                return False
            aval = leaf.aval
            if aval.shape != shape or aval.dtype != dtype:
                return False
            found = leaf.sharding
            if found is not layout.seen and found is not layout.sharding and not layout.holds(leaf):
                return False
        return True


def leaves_test(leaves: list[Any]) -> Callable[[list[Any]], bool] | None:
    """The test of a list of leaves all of this family, read inline; None where one is traced."""
    tracer = sys.modules["jax"].core.Tracer
    if any(isinstance(leaf, tracer) for leaf in leaves):
        return None
    return _OneDeviceLeaves(leaves) if all(map(_one_device, leaves)) else _Leaves(leaves)


def exchange(leaf: Any) -> Any:
    return leaf


def dtype_scope(dtypes: Iterable[str]) -> Any:
    """A scope where jax keeps these dtypes: ``jax.enable_x64`` where one is 64 bits wide and
    x64 is off (entered for the call only, never globally)."""
    jax = sys.modules.get("jax")
    wide = any(d in ("float64", "complex128") for d in dtypes)
    if jax is not None and wide and not jax.config.read("jax_enable_x64"):
        return jax.enable_x64(True)
    return contextlib.nullcontext()


conj, parts = numpy_like_complex("jax.numpy")


def from_parts(re: Any, im: Any) -> Any:
    return sys.modules["jax"].lax.complex(re, im)


def eval_shape(fn: Callable[..., Any], avals: list[tuple[tuple[int, ...], str]]) -> Any:
    """``fn``'s output structure, of ``jax.ShapeDtypeStruct`` leaves, for inputs of these shapes
    and dtypes, found without values."""
    jax = sys.modules["jax"]
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals]
    return jax.eval_shape(fn, *structs)


_SELF = sys.modules[__name__]

values = to_numpy


def describe(signature: tuple[Any, ...]) -> str:
    text = array_words(signature)
    if len(signature) > 3:
        text += f" laid out as {signature[3]}"
    return text


def trace_of(signature: tuple[Any, ...]) -> str | None:
    """A traced array's signature names no layout (:func:`signature`)."""
    return "a jax trace (inside jax.jit, jax.grad or jax.vmap)" if len(signature) == 3 else None
