"""Finishing: results converted to mirror the inputs (x's array type, dtype and device; f's
output structure), in the dtype :func:`promoted_dtype` gives a derivative."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import optree

from . import _arrays, _complex, _placement
from . import tree as _tree
from ._call import _ARRAY_KINDS, _LEAF, Call, Operator

if TYPE_CHECKING:  # (_programs finishes inside a compiled program with promoted_dtype)
    from ._programs import _Output


# -- results: mirror the inputs ----------------------------------------------------------------------


def _finisher(
    op: Operator, call: Call, output: _Output
) -> tuple[Callable[[tuple[Any, ...]], Any], Callable[[Any], Any] | None]:
    """``finish(native_parts)``: the result mirroring the inputs; and where the result is one
    leaf mirroring x's one leaf, ``mirror(leaf)`` for it (else None)."""
    x_spec = call.signature.x_spec
    x_likes = list(call.x_leaves)
    family = _arrays.family({_arrays.kind(leaf) for leaf in x_likes}) if x_likes else "numpy"
    python_x = family == "python"

    like: Any = x_likes[0] if x_likes else None

    def as_y(value: Any) -> Any:
        return _to_family(value, family, python_x, like)

    single_x = x_spec == _LEAF

    x_dtypes = [_weak_or_dtype(leaf) for leaf in x_likes]

    def block(value: Any, dtype: str | None, like_j: Any = None) -> Any:
        if family == "jax" and like_j is not None:  # laid out as x_j (_placement's rule)
            return _cast(_placement.block_like(as_y(value), like_j), dtype)
        return _cast(as_y(value), dtype)

    def convert(kind: str, value: Any) -> Any:
        # (f's output is one array when its recorded structure is _LEAF itself)
        if kind == "value":
            return as_y(value)
        if kind in ("y", "dy"):
            if kind == "y":
                if output.spec is _LEAF:
                    return as_y(value[0])
                return optree.tree_unflatten(output.spec, [as_y(v) for v in value])
            x_dtype = x_dtypes[0] if x_dtypes else None
            dtypes = output.dtypes
            if output.spec is _LEAF:
                return block(value[0], promoted_dtype(dtypes[0] if dtypes else None, x_dtype))
            return optree.tree_unflatten(
                output.spec,
                [block(v, promoted_dtype(d, x_dtype)) for v, d in zip(value, _padded(dtypes, len(value)), strict=True)],
            )
        if kind == "x":
            if single_x:
                return _mirror(value[0], like)
            return optree.tree_unflatten(x_spec, [_mirror(v, like) for v, like in zip(value, x_likes, strict=True)])
        if kind == "jacobian":
            dtypes = _padded(output.dtypes, len(value))
            if single_x and output.spec is _LEAF:
                return block(value[0][0], promoted_dtype(dtypes[0], x_dtypes[0]), like)
            rows = [
                optree.tree_unflatten(
                    x_spec,
                    [block(b, promoted_dtype(dy, dx), lx) for b, dx, lx in zip(row, x_dtypes, x_likes, strict=True)],
                )
                for row, dy in zip(value, dtypes, strict=True)
            ]
            return optree.tree_unflatten(output.spec, rows)
        if single_x:
            return block(value[0][0], x_dtypes[0], like)
        rows = [
            optree.tree_unflatten(
                x_spec,
                [block(b, promoted_dtype(di, dj), lj) for b, dj, lj in zip(row, x_dtypes, x_likes, strict=True)],
            )
            for row, di in zip(value, x_dtypes, strict=True)
        ]
        return optree.tree_unflatten(x_spec, rows)

    has_aux = call.signature.has_aux
    kinds = [kind for _, kind in op.parts]

    def finish(native: tuple[Any, ...]) -> Any:
        parts = [convert(kind, value) for kind, value in zip(kinds, native, strict=False)]
        if has_aux:
            aux = _tree.map(as_y, native[-1])
            return ((parts[0], aux), *parts[1:]) if len(parts) > 1 else (parts[0], aux)
        return parts[0] if len(parts) == 1 else tuple(parts)

    if len(kinds) == 1 and not has_aux:
        only = kinds[0]

        def finish(native: tuple[Any, ...]) -> Any:
            return convert(only, native[0])

    if (
        kinds == ["x"]
        and not has_aux
        and x_spec == _LEAF
        and _arrays.kind(like) in _ARRAY_KINDS
        and not isinstance(like, np.generic)  # a numpy scalar x gets a 0-d array, as from _mirror
    ):
        # the hot path of gradient, vjp and hvp on one array: no tree to rebuild, and most
        # often nothing to convert
        cls, dtype, tensor = type(like), like.dtype, _arrays.kind(like) == "torch"
        layout = _layout(like)  # jax: the result stays laid out as x

        def mirror(value: Any) -> Any:
            if (
                type(value) is cls
                and value.dtype == dtype
                and not (tensor and value.requires_grad)
                and (layout is None or layout.holds(value))
            ):
                return value
            return _mirror(value, like)

        def first(native: tuple[Any, ...]) -> Any:
            return mirror(native[0][0])

        return first, mirror
    if (
        kinds == ["x"]
        and not has_aux
        and all(_arrays.kind(leaf) in _ARRAY_KINDS and not isinstance(leaf, np.generic) for leaf in x_likes)
    ):
        # a gradient, vjp or hvp of a tree of arrays: where each leaf came back in its type and
        # dtype (and for torch, detached), the tree is only rebuilt
        expected = [(type(leaf), leaf.dtype, _arrays.kind(leaf) == "torch", _layout(leaf)) for leaf in x_likes]
        unflatten = optree.tree_unflatten
        count = len(expected)

        def tree(native: tuple[Any, ...]) -> Any:
            values = native[0]
            if len(values) == count:
                for value, (cls, dtype, tensor, layout) in zip(values, expected, strict=False):
                    if (
                        type(value) is not cls
                        or value.dtype != dtype
                        or (tensor and value.requires_grad)
                        or (layout is not None and not layout.holds(value))
                    ):
                        return finish(native)
                return unflatten(x_spec, list(values))
            return finish(native)  # pragma: no cover - the engine returns one leaf per leaf of x

        return tree, None
    return finish, None


def _layout(leaf: Any) -> _placement.Layout | None:
    """The test of a concrete jax array's layout; None for other leaves (a traced one's layout
    is the trace's)."""
    jax = sys.modules.get("jax")
    if jax is None or _arrays.kind(leaf) != "jax" or isinstance(leaf, jax.core.Tracer):
        return None
    return _placement.Layout(leaf.sharding)


_PRECISION = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def promoted_dtype(a: str | None, b: str | None) -> str | None:
    """The dtype of a derivative relating a leaf of dtype ``a`` to one of dtype ``b``: the wider
    of the two, so that no precision is lost on either side (float16 with bfloat16 gives
    float32, as both jax and torch promote them). ``None`` is a Python number's weak dtype,
    which takes the other's."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    if "complex" in a or "complex" in b:
        return _complex.promoted(a, b)
    width = max(_PRECISION.get(a, 64), _PRECISION.get(b, 64))
    if width == 16:
        return "float32"
    return "float64" if width == 64 else "float32"


def _weak_or_dtype(leaf: Any) -> str | None:
    """A leaf's dtype name; None for a Python number, which takes the dtype it meets."""
    return None if _arrays.kind(leaf) == "python" else _arrays.dtype_name(leaf)


def _padded(dtypes: tuple[str | None, ...], count: int) -> tuple[str | None, ...]:
    return dtypes if len(dtypes) == count else (None,) * count


def _cast(value: Any, dtype: str | None) -> Any:
    """A result block in the dtype the promotion rule gives (where it is an array)."""
    if dtype is None:
        return value
    current = getattr(value, "dtype", None)
    if (
        current is None
        or _arrays.dtype_name(value) == dtype
        or not _arrays.is_float_dtype(_arrays.dtype_name(value))
        or not _arrays.is_float_dtype(dtype)  # a real block stays real: a complex step's output is complex
    ):
        return value
    if _arrays.kind(value) == "torch":
        return value.to(getattr(sys.modules["torch"], dtype))
    return value.astype(dtype)


def _to_family(value: Any, family: str, python_x: bool, like: Any) -> Any:
    """An output-shaped result in the array type of x (numpy for Python numbers), dtype kept."""
    kind = _arrays.kind(value)
    if family in ("python", "numpy"):
        if kind == "python" or kind == "autograd":  # autograd: traced by an enclosing autograd call
            return value
        array = np.asarray(value) if kind == "numpy" else _arrays.to_numpy(value)
        return array.item() if python_x and array.ndim == 0 else array
    if kind == family:
        # a nested call keeps the graph its inputs carried (_arrays.graph_state, set by the adapter)
        return value.detach() if kind == "torch" and not _arrays.graph_state.keep else value
    if kind not in ("python", "numpy", "autograd", "jax", "torch"):
        return value
    array = np.asarray(_arrays.to_numpy(value))
    converted = _arrays.from_numpy(array, like, dtype=_framework_dtype(array.dtype, family))
    return _placement.on_devices_of(converted, like) if family == "jax" else converted


def _framework_dtype(dtype: np.dtype[Any], family: str) -> Any:
    if family == "torch":
        return getattr(sys.modules["torch"], dtype.name)
    return dtype


def _mirror(value: Any, like: Any) -> Any:
    """``value`` with ``like``'s array type and dtype (and device)."""
    value_kind = _arrays.kind(value)
    if value_kind == "autograd":  # traced by an enclosing autograd call, which differentiates through it
        return value
    kind = _arrays.kind(like)
    if kind == "python":
        number = np.asarray(_arrays.to_numpy(value))
        return complex(number) if isinstance(like, complex) else float(number)
    if kind == "numpy":
        array = value if value_kind == "numpy" else _arrays.to_numpy(value)
        return np.asarray(array, dtype=like.dtype)
    if kind == "torch" and value_kind == "torch":  # computed on like's device
        if value.requires_grad and not _arrays.graph_state.keep:  # kept where x carried a graph
            value = value.detach()
        return value if value.dtype == like.dtype else value.to(like.dtype)
    if kind == "jax" and value_kind == "jax":
        return _placement.like_x(value if value.dtype == like.dtype else value.astype(like.dtype), like)
    if kind == "jax":
        return _placement.like_x(_arrays.from_numpy(np.asarray(_arrays.to_numpy(value)), like), like)
    if kind == "torch":
        return _arrays.from_numpy(np.asarray(_arrays.to_numpy(value)), like)
    return value
