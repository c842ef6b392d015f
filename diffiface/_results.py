"""Finishing: results converted to mirror the inputs (x's array type, dtype and device; f's
output structure), in the dtype :func:`promoted_dtype` gives a derivative."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import optree

from . import _arrays
from ._call import _ARRAY_KINDS, _LEAF, Call, Operator, _Output
from ._families import _jax_placement as _placement
from ._flatten import structure_unflatten
from ._tangents import Tangents
from .tree import NAMESPACE

# -- results: mirror the inputs ----------------------------------------------------------------------


class Finisher:
    """``finish(native_parts)``: a program's result mirroring the inputs: x's structure, array
    type, dtype and device for what mirrors x, f's output structure for what mirrors f(x), the
    promoted dtype (:func:`promoted_dtype`) for blocks relating two leaves."""

    __slots__ = ("has_aux", "kinds", "like", "output", "own", "single_x", "x_dtypes", "x_likes", "x_spec")

    def __init__(self, op: Operator, call: Call, output: _Output) -> None:
        self.x_spec = call.signature.x_spec
        self.x_likes = list(call.x_leaves)
        family = _arrays.family({_arrays.kind(leaf) for leaf in self.x_likes}) if self.x_likes else _NO_X
        self.own = _arrays.by_kind(family)  # (one family: _checks._check_x refuses an x of several)
        self.like: Any = self.x_likes[0] if self.x_likes else None
        self.single_x = self.x_spec == _LEAF
        self.x_dtypes = [_weak_or_dtype(leaf) for leaf in self.x_likes]
        self.output = output
        self.has_aux = call.signature.has_aux
        self.kinds = [kind for _, kind in op.parts]

    def as_y(self, value: Any) -> Any:
        """An output-shaped result in the array type of x (numpy for Python numbers), dtype kept."""
        return self.own.as_own(value, _arrays.family_of(value), self.like, _arrays.to_numpy)

    def block(self, value: Any, dtype: str | None, like_j: Any = None) -> Any:
        value = self.as_y(value)
        if like_j is not None:  # laid out as x_j (_placement's rule)
            value = self.own.block_like(value, like_j)
        return _cast(value, dtype)

    def convert(self, kind: str, value: Any) -> Any:
        # (f's output is one array when its recorded structure is _LEAF itself)
        output, x_spec, x_dtypes, x_likes, block = self.output, self.x_spec, self.x_dtypes, self.x_likes, self.block
        if kind == "value":
            return self.as_y(value)
        if kind == "y":
            if output.spec is _LEAF:
                return self.as_y(value[0])
            return optree.tree_unflatten(output.spec, [self.as_y(v) for v in value])
        if kind == "dy":
            x_dtype = x_dtypes[0] if x_dtypes else None
            dtypes = output.dtypes
            if output.spec is _LEAF:
                return block(value[0], promoted_dtype(dtypes[0] if dtypes else None, x_dtype))
            return optree.tree_unflatten(
                output.spec,
                [block(v, promoted_dtype(d, x_dtype)) for v, d in zip(value, _padded(dtypes, len(value)), strict=True)],
            )
        if kind == "x":
            if self.single_x:
                return _mirror(value[0], self.like)
            return optree.tree_unflatten(x_spec, [_mirror(v, like) for v, like in zip(value, x_likes, strict=True)])
        if kind == "jacobian":
            dtypes = _padded(output.dtypes, len(value))
            if self.single_x and output.spec is _LEAF:
                return block(value[0][0], promoted_dtype(dtypes[0], x_dtypes[0]), self.like)
            return optree.tree_unflatten(output.spec, self._rows(value, dtypes))
        if kind == "ys":  # a batch's products, each shaped as f(x)
            return Tangents(*[self.convert("y", v) for v in value])
        if kind == "xs":  # a batch's products, each shaped as x
            return Tangents(*[self.convert("x", v) for v in value])
        if self.single_x:  # a hessian
            return block(value[0][0], x_dtypes[0], self.like)
        return optree.tree_unflatten(x_spec, self._rows(value, x_dtypes))

    def _rows(self, value: Any, row_dtypes: Any) -> list[Any]:
        """A Jacobian's or a Hessian's rows, each in x's structure, each block in the dtype its
        row's and its column's dtypes promote to."""
        x_spec, x_dtypes, x_likes, block = self.x_spec, self.x_dtypes, self.x_likes, self.block
        return [
            optree.tree_unflatten(
                x_spec,
                [block(b, promoted_dtype(dy, dx), lx) for b, dx, lx in zip(row, x_dtypes, x_likes, strict=True)],
            )
            for row, dy in zip(value, row_dtypes, strict=True)
        ]

    def __call__(self, native: tuple[Any, ...]) -> Any:
        kinds = self.kinds
        if len(kinds) == 1 and not self.has_aux:
            return self.convert(kinds[0], native[0])
        parts = [self.convert(kind, value) for kind, value in zip(kinds, native, strict=False)]
        if self.has_aux:
            aux = _aux_as_returned(native[-1], self.as_y)
            return ((parts[0], aux), *parts[1:]) if len(parts) > 1 else (parts[0], aux)
        return parts[0] if len(parts) == 1 else tuple(parts)


class MirrorOne:
    """The finisher of a gradient, vjp or hvp of one array: most often nothing to convert."""

    __slots__ = ("cls", "dtype", "layout", "like")

    def __init__(self, like: Any) -> None:
        self.like = like
        self.cls, self.dtype = type(like), like.dtype
        self.layout = _layout(like)  # jax: the result stays laid out as x

    def mirror(self, value: Any) -> Any:
        if type(value) is self.cls and value.dtype == self.dtype and (self.layout is None or self.layout.holds(value)):
            return value
        return _mirror(value, self.like)

    def __call__(self, native: tuple[Any, ...]) -> Any:
        return self.mirror(native[0][0])


class RebuildTree:
    """The finisher of a gradient, vjp or hvp of a tree of arrays: once the finisher has passed
    a result's arrays through unchanged, later results of the same types, dtypes and layouts are
    only rebuilt (``trusted``, a compiled program's: once seen to fit, untested)."""

    __slots__ = ("dtypes", "finish", "layouts", "rebuild", "seen_fit", "trusted", "types")

    def __init__(self, call: Call, finish: Finisher, trusted: bool) -> None:
        spec = call.signature.x_spec
        self.rebuild = structure_unflatten(spec) or spec.unflatten  # (written for the structure, see _flatten)
        layouts = [_layout(leaf) for leaf in call.x_leaves]
        self.layouts = None if all(layout is None for layout in layouts) else layouts
        self.types: list[type] | None = None  # (each array's as the finisher passed it through)
        self.dtypes: list[Any] | None = None
        self.finish = finish
        self.trusted = trusted
        self.seen_fit = False

    def __call__(self, native: tuple[Any, ...]) -> Any:
        values = native[0]
        if self.seen_fit:
            return self.rebuild(values)
        layouts = self.layouts
        if (  # (the tests in C, leaf by leaf: this runs on every call)
            list(map(type, values)) == self.types
            and list(map(_dtype, values)) == self.dtypes
            and (layouts is None or all(lay is None or lay.holds(v) for v, lay in zip(values, layouts, strict=True)))
        ):
            self.seen_fit = self.trusted
            return self.rebuild(values)
        result = self.finish(native)
        found = optree.tree_leaves(result, namespace=NAMESPACE)
        if len(found) == len(values) and all(a is b for a, b in zip(found, values, strict=True)):
            self.types, self.dtypes = list(map(type, values)), list(map(_dtype, values))
        return result


_dtype = operator.attrgetter("dtype")


def finisher(op: Operator, call: Call, output: _Output, compiled: bool) -> tuple[Callable[[Any], Any], Any]:
    """The finisher of a program's results; and where the result is one leaf mirroring x's one
    leaf, the :class:`MirrorOne` that mirrors it (else None). ``compiled``: the program's result
    types are fixed by its trace."""
    finish = Finisher(op, call, output)
    kinds = finish.kinds
    like = finish.like
    if kinds == ["x"] and not finish.has_aux:
        arrays = all(
            _arrays.kind(leaf) in _ARRAY_KINDS and not isinstance(leaf, np.generic)  # a numpy scalar: a 0-d array
            for leaf in finish.x_likes
        )
        if arrays and finish.single_x:
            one = MirrorOne(like)
            return one, one
        if arrays:
            return RebuildTree(call, finish, compiled), None
    return finish, None


def _aux_as_returned(riding: Any, as_y: Callable[[Any], Any]) -> Any:
    """f's aux from its leaves and structure (as ``_closer`` set them apart): in f's structure
    and key order; array leaves in x's array type, every other leaf (a string, a number,
    None) as f returned it. None where no aux came (an error estimate has none)."""
    if riding is None:
        return None
    leaves, spec = riding
    return optree.tree_unflatten(spec, [_aux_leaf(leaf, as_y) for leaf in leaves])


def _aux_leaf(leaf: Any, as_y: Callable[[Any], Any]) -> Any:
    """An aux array, or value an enclosing trace holds, in x's array type unless no other array
    type holds it (a jax PRNG key, whose dtype numpy has not); any other leaf as f returned it."""
    family = _arrays.family_of(leaf)
    if family is None or not (family.ARRAY or family.PASSED_THROUGH):
        return leaf
    try:
        return as_y(leaf)
    except TypeError:
        return leaf


def _layout(leaf: Any) -> _placement.Layout | None:
    """The test that a result is laid out as ``leaf`` (a jax array's sharding); None: no test."""
    family = _arrays.family_of(leaf)
    return None if family is None else family.layout(leaf)  # type: ignore[no-any-return]


def promoted_dtype(a: str | None, b: str | None) -> str | None:
    """The dtype of a derivative relating a leaf of dtype ``a`` to one of dtype ``b``: the wider
    of the two, so that no precision is lost on either side (float16 with bfloat16 gives
    float32, as both jax and torch promote them). ``None`` is a Python number's weak dtype,
    which takes the other's; and the answer where either is complex, since :func:`_cast` casts
    float blocks only (a complex block, or a complex step's real one, stays as computed)."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    if "complex" in a or "complex" in b:
        return None
    width = max(_arrays.FLOAT_WIDTHS.get(a, 64), _arrays.FLOAT_WIDTHS.get(b, 64))
    return "float64" if width == 64 else "float32"


def _weak_or_dtype(leaf: Any) -> str | None:
    """A leaf's dtype name; None for a Python number, which takes the dtype it meets."""
    return None if _arrays.kind(leaf) == "python" else _arrays.dtype_name(leaf)


def _padded(dtypes: tuple[str | None, ...], count: int) -> tuple[str | None, ...]:
    return dtypes if len(dtypes) == count else (None,) * count


def _cast(value: Any, dtype: str | None) -> Any:
    """A result block in the dtype the promotion rule gives (where it is an array)."""
    if dtype is None or getattr(value, "dtype", None) is None:
        return value
    name = _arrays.dtype_name(value)
    # (a real block stays real: a complex step's output is complex)
    if name == dtype or not _arrays.is_float_dtype(name) or not _arrays.is_float_dtype(dtype):
        return value
    family = _arrays.family_of(value)
    return value.astype(dtype) if family is None else family.cast(value, dtype)


def _mirror(value: Any, like: Any) -> Any:
    """``value`` with ``like``'s array type and dtype (and device)."""
    value_family = _arrays.family_of(value)
    if value_family is not None and value_family.PASSED_THROUGH:
        return value
    family = _arrays.family_of(like)
    return value if family is None else family.mirror(value, value_family, like, _arrays.to_numpy)


_NO_X = _arrays.kind_of_type(np.ndarray)  # (the family of results when x has no leaves)
