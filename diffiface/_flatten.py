"""Flattening one known tree structure fast: a Python function written for the structure.

optree's and jax's C flattening is fast when warm, but a prepared call runs it right after the
engine's program has emptied the processor's caches, where flattening a nested dict of four
arrays costs 10 to 25 µs, more than the rest of the call's own steps. A function that indexes the
tree as the structure says (``t["l1"]["w"]``) costs about one microsecond there.

:func:`structure_flatten` writes such a function for a structure of tuples, lists, dicts (with
str or int keys) and None, the nodes optree and jax take apart alike, and checks it against the
C flattening on the prepared tree itself. Every other node (a namedtuple, an OrderedDict, a
registered class) keeps the C flattening.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["Flatten", "structure_flatten"]

Flatten = Callable[[Any], tuple[Any, Any]]
"""``flatten(tree) -> (leaves, structure)``."""


class _Other:
    """The structure of a tree of another structure: unequal to every structure, from either
    side of ``==`` and ``!=`` (jax's structures answer ``!=`` with False for an object of
    another type)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


_MISS = (None, _Other())
_LARGEST = 256  # leaves; a larger tree keeps the C flattening (its function would be long)


def structure_flatten(spec: Any, key: Any, tree: Any, flatten: Flatten) -> Flatten | None:
    """A function ``tree -> (leaves, key)`` for trees of optree structure ``spec``, found by
    indexing; for a tree whose nodes (types, lengths, keys) differ, ``(None, other)``, where
    ``other`` is unequal to every structure (the structure it is compared with is ``key``, so
    such a tree does not fit, as under ``flatten``). A leaf's own type is not tested (the plan
    tests it). None where ``spec`` holds a node it does not write for, or is one leaf, or
    where the function does not give what ``flatten`` gives for ``tree``, the prepared tree."""
    if spec is None or spec.is_leaf() or spec.num_leaves > _LARGEST or str(spec.namespace):
        return None
    lines: list[str] = []
    leaves: list[str] = []
    names = (f"n{i}" for i in itertools.count())
    if not _write(spec, "tree", lines, leaves, names):
        return None
    body = "\n".join(f"        {line}" for line in lines)
    source = (
        "def flatten(tree):\n"
        "    try:\n"
        f"{body}\n"
        f"        return [{', '.join(leaves)}], KEY\n"
        "    except KeyError:\n"
        "        return MISS\n"
    )
    namespace: dict[str, Any] = {"KEY": key, "MISS": _MISS}
    exec(compile(source, "<diffiface: flatten a known structure>", "exec"), namespace)
    written: Flatten = namespace["flatten"]
    found, found_key = written(tree)
    expected, expected_key = flatten(tree)
    if found_key is not key or expected_key != key or len(found) != len(expected):
        return None
    if not all(a is b for a, b in zip(found, expected, strict=True)):
        return None
    return written


def _write(node: Any, expr: str, lines: list[str], leaves: list[str], names: Any) -> bool:
    """Append the lines that test ``node``'s type and size at ``expr``, and its leaves'
    expressions; False where a node is of a kind not written for."""
    if node.is_leaf():
        leaves.append(expr)
        return True
    kind = node.type
    if kind is type(None):
        lines.append(f"if {expr} is not None: return MISS")
        return True
    if kind not in (tuple, list, dict):
        return False
    entries = node.entries()
    if kind is dict and not all(type(entry) in (str, int) for entry in entries):
        return False
    name = next(names)
    lines.append(f"{name} = {expr}")
    lines.append(f"if type({name}) is not {kind.__name__} or len({name}) != {len(entries)}: return MISS")
    return all(
        _write(child, f"{name}[{entry!r}]", lines, leaves, names)
        for child, entry in zip(node.children(), entries, strict=True)
    )
