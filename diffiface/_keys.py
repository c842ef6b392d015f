"""What a static leaf (of x, or of a context) is compared by between calls."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import types
from typing import Any

from . import _arrays
from ._families import CODE_MODULES, PACKAGES

__all__ = ["held_arrays", "held_entries", "held_signature", "is_static", "key_or_identity", "slots", "static_key"]


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


# -- the arrays a context's plain object holds ---------------------------------------------------

HELD_LEVELS = 3
"""Objects deep that a context's plain object is looked into for the arrays it holds
(``trainer.model.w``: two)."""
_MOST_ITEMS = 64
"""The longest list, tuple or dict looked into there."""
_NOT_HOLDERS = (int, float, complex, str, bytes, bool, type(None), type, types.ModuleType, types.FunctionType)


def held_entries(value: Any, levels: int) -> tuple[list[tuple[Any, Any]], int] | None:
    """The entries of ``value`` (a context's leaf, or what it holds) looked into for the arrays
    it holds, each name and object, and the levels left below them: a list's, tuple's or dict's
    items (of at most 64), a plain object's attributes (``__dict__`` and slots) where ``levels``
    is not 0 and no framework defines its class. None where ``value`` is not looked into (an
    array, a number, a class, a framework's object)."""
    if isinstance(value, _NOT_HOLDERS) or _is_held(value):
        return None
    if type(value) in (list, tuple, dict):
        if len(value) > _MOST_ITEMS:
            return None
        return (list(value.items()) if type(value) is dict else list(enumerate(value))), levels
    if levels == 0 or any(klass.__module__.partition(".")[0] in PACKAGES for klass in type(value).__mro__[:-1]):
        return None
    own = getattr(value, "__dict__", None)
    entries = list(own.items()) if type(own) is dict else []
    for name, slot in slots(type(value)).items():
        with contextlib.suppress(AttributeError):  # (a slot not set)
            entries.append((name, slot.__get__(value, None)))
    return entries, levels - 1


def held_arrays(value: Any, levels: int = HELD_LEVELS) -> list[Any]:
    """The arrays ``value`` holds (:func:`held_entries`, ``levels`` objects deep), and the values
    a trace holds (autograd's boxes, symbolic variables), in the order of its entries; each
    holder looked into once."""
    found: list[Any] = []
    _held(value, levels, set(), found)
    return found


def _held(value: Any, levels: int, seen: set[int], found: list[Any]) -> None:
    if id(value) in seen:  # (held twice, or a cycle back to an object being read)
        return
    seen.add(id(value))
    listed = held_entries(value, levels)
    if listed is None:
        return
    entries, below = listed
    for _, entry in entries:
        if _is_held(entry):
            found.append(entry)
        else:
            _held(entry, below, seen, found)


def _is_held(value: Any) -> bool:
    """An array, or a value a trace holds (an autograd box, a symbolic variable): a leaf of an
    array family, not a Python number."""
    return _arrays.kind(value) not in ("python", "other")


def held_signature(value: Any) -> tuple[Any, ...]:
    """The shapes, dtypes and array types of the arrays a context's plain object holds
    (:func:`held_arrays`): a sparsity pattern found for them holds for their values, not for
    other shapes. Empty for anything that holds none."""
    return tuple(_arrays.leaf_signature(array) for array in held_arrays(value))


def slots(cls: type) -> dict[str, Any]:
    """The slots of ``cls``'s instances (its classes' ``__slots__``), each name and the member
    that reads it, where the class resolves the name to that member (not a property of a
    subclass); empty for most classes. Found once per class (up to ``_MOST_CLASSES`` classes)."""
    found = _SLOTS.get(cls)
    if found is None:
        found = {}
        for klass in cls.__mro__[:-1]:
            names = klass.__dict__.get("__slots__", ())
            for name in (names,) if isinstance(names, str) else names:
                member = klass.__dict__.get(name)
                if type(member) is types.MemberDescriptorType and name not in found and getattr(cls, name) is member:
                    found[name] = member
        if len(_SLOTS) < _MOST_CLASSES:
            _SLOTS[cls] = found
    return found


_MOST_CLASSES = 256
_SLOTS: dict[type, dict[str, Any]] = {}
