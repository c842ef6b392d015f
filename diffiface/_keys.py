"""What a static leaf (of x, or of a context) is compared by between calls."""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from typing import Any

from . import _arrays
from ._families import CODE_MODULES

__all__ = ["is_static", "key_or_identity", "static_key"]


def is_static(leaf: Any) -> bool:
    """A leaf of x that is not differentiated but passed to f as it is: anything but an array or
    a Python float or complex (a function, an int, a bool, a string). ``eqx.filter_grad`` also
    passes a Python float as it is (a dropout's rate); diffiface differentiates it."""
    kind = _arrays.kind(leaf)
    return kind == "other" or (kind == "python" and not isinstance(leaf, (float, complex)))


def key_or_identity(leaf: Any) -> Any:
    """:func:`static_key`, or the leaf's identity where it has none (a static leaf of x, or a
    context value a program is built for: the prep holds it, so that identity is not reused)."""
    key = static_key(leaf)
    return ("identity", id(leaf)) if key is None else key


_BY_VALUE = (int, float, complex, str, bytes, bool, type(None))
_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type, functools.partial)


def static_key(value: Any) -> Any:
    """What a static leaf is compared by between calls: its value where it has one that can be
    hashed, its identity where it is code, which does not change; ``None`` where neither holds
    (a mutable object hashed by identity)."""
    cls = type(value)
    if cls is float:  # (by its bits: 0.0 == -0.0, and a program built for one is wrong for the other)
        return (cls, value.hex())
    if cls is complex:
        return (cls, value.real.hex(), value.imag.hex())
    if cls in _BY_VALUE:
        return (cls, value)
    # (a framework's wrapped functions are code too: jax.nn.relu is a jitted function, others
    # custom_jvp objects)
    if isinstance(value, (*_CODE, enum.Enum)) or (callable(value) and cls.__module__.split(".")[0] in CODE_MODULES):
        return (cls, id(value))
    if dataclasses.is_dataclass(value):
        # (a frozen dataclass hashes its fields: one that holds a mutable object, compared by
        # identity, would hide a change to it; and 1 == 1.0 would take one field for another)
        keys = tuple(static_key(getattr(value, field.name)) for field in dataclasses.fields(value))
        return None if cls.__hash__ is None or None in keys else (cls, keys)
    if cls.__hash__ is None or (
        cls.__hash__ is object.__hash__ and cls.__eq__ is object.__eq__  # type: ignore[comparison-overlap]
    ):
        return None  # unhashable, or hashed by identity: a change to it would go unseen
    try:
        hash(value)
    except TypeError:
        return None
    return (cls, value)
