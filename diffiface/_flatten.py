"""Flattening one known tree structure fast: a Python function written for the structure; and
:func:`generated`, the one place where diffiface compiles code written at run time.

A prepared call flattens right after the engine's program has emptied the processor's caches,
where optree's and jax's C flattening of a nested dict can cost more than the rest of the call;
a function that indexes the tree as the structure says (``t["l1"]["w"]``) costs a fraction.
:func:`structure_flatten` writes one for tuples, lists, dicts (str or int keys) and None, and
checks it against the C flattening on the prepared tree; other nodes keep the C flattening.
"""

from __future__ import annotations

import collections
import itertools
import linecache
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Flatten", "generated", "key_orders", "structure_flatten", "structure_unflatten"]

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
_DEEPEST = 32
"""Levels of nodes; a deeper tree keeps the C flattening (Python's parser refuses an expression
nested some 200 levels deep, and the writers recurse once per level)."""

_SERIAL = itertools.count()


def generated(source: str, name: str, namespace: dict[str, Any]) -> Any:
    """The function ``name`` that ``source`` defines, run in ``namespace``: the one place
    diffiface compiles code it writes. Each source gets a file name of its own, and its text is
    registered in :mod:`linecache` (until the function is collected), so that tracebacks and
    pdb show the generated lines."""
    filename = f"<diffiface generated {name} #{next(_SERIAL)}>"
    code = compile(source, filename, "exec")
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(code, namespace)
    function = namespace[name]
    weakref.finalize(function, linecache.cache.pop, filename, None)
    return function


def key_orders(spec: Any) -> tuple[tuple[Any, ...], ...]:
    """The keys of each dict of two or more keys in an optree structure, in their order
    (structures compare equal whatever the order; results mirror it)."""
    orders = []
    pending = [spec]
    while pending:  # (without recursion: a tree may be deeper than Python's stack)
        node = pending.pop()
        if node.type is dict and node.num_children > 1:
            orders.append(tuple(node.unflatten(list(range(node.num_leaves)))))
        pending += node.children()
    return tuple(orders)


def _too_deep(spec: Any) -> bool:
    """Whether a structure nests more than :data:`_DEEPEST` levels of nodes (found without
    recursion, which such a tree could exhaust)."""
    level = [spec]
    for _ in range(_DEEPEST + 1):
        level = [child for node in level for child in node.children()]
        if not level:
            return False
    return True


def structure_flatten(spec: Any, key: Any, tree: Any, flatten: Flatten) -> Flatten | None:
    """A function ``tree -> (leaves, key)`` for trees of optree structure ``spec``, found by
    indexing; for a tree whose nodes (types, lengths, keys) differ, ``(None, other)``, where
    ``other`` is unequal to every structure, as ``flatten``'s would be. A leaf's own type is not
    tested (the plan tests it). None where ``spec`` is one leaf or holds a node not written for,
    or where the function does not give what ``flatten`` gives for ``tree``, the prepared tree."""
    if spec is None or spec.is_leaf() or spec.num_leaves > _LARGEST or str(spec.namespace) or _too_deep(spec):
        return None
    lines: list[str] = []
    leaves: list[str] = []
    if not _write(spec, "tree", lines, leaves, (f"n{i}" for i in itertools.count())):
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
    written: Flatten = generated(source, "flatten", {"KEY": key, "MISS": _MISS})
    found, found_key = written(tree)
    expected, expected_key = flatten(tree)
    if found_key is not key or expected_key != key or len(found) != len(expected):
        return None
    if not all(a is b for a, b in zip(found, expected, strict=True)):
        return None
    return written


def _write(node: Any, expr: str, lines: list[str], leaves: list[str], names: Iterator[str]) -> bool:
    """Append the lines of Python that test ``node``'s type and size at ``expr`` (``return MISS``
    where they differ; a dict with other keys raises KeyError), and its leaves' expressions, in
    the structure's order; local variables are named from ``names``. False where a node is of a
    kind not written for."""
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
    if kind is dict and len(entries) > 1:  # (results mirror x's keys in x's order: another order misses)
        order = tuple(node.unflatten(list(range(node.num_leaves))))
        if len(order) == 2:  # (its keys are indexed below: the first one tells the order)
            lines.append(f"if next(iter({name})) != {order[0]!r}: return MISS")
        else:
            lines.append(f"if tuple({name}) != {order!r}: return MISS")
    return all(
        _write(child, f"{name}[{entry!r}]", lines, leaves, names)
        for child, entry in zip(node.children(), entries, strict=True)
    )


def structure_unflatten(spec: Any, largest: int | None = _LARGEST) -> Callable[[Any], Any] | None:
    """A function ``leaves -> tree`` that builds a tree of optree structure ``spec`` as
    ``spec.unflatten`` does (dict keys in the order ``spec`` keeps), written for the
    structure; None where ``spec`` holds a node other than tuples, lists, dicts with str or
    int keys (an ``OrderedDict`` too), namedtuples and None, is one leaf, or has more than
    ``largest`` leaves (None: any number). Written in Python, it is also what torch.compile
    traces, where it cannot trace optree's C rebuild."""
    if spec is None or spec.is_leaf() or str(spec.namespace) or _too_deep(spec):
        return None
    if largest is not None and spec.num_leaves > largest:
        return None
    example = spec.unflatten(list(range(spec.num_leaves)))
    classes: dict[str, type] = {}
    expression = _build(example, classes)
    if expression is None:
        return None
    source = f"def unflatten(leaves):\n    return {expression}\n"
    written: Callable[[Any], Any] = generated(source, "unflatten", classes)
    leaves = [object() for _ in range(spec.num_leaves)]
    built, expected = written(leaves), spec.unflatten(leaves)
    if _shape_of(built) != _shape_of(expected):
        return None
    return written


def _build(node: Any, classes: dict[str, type]) -> str | None:
    """The expression that builds ``node`` (a tree whose leaves are their indices) from
    ``leaves``, naming the classes it calls in ``classes``; None where a node is not written for."""
    kind = type(node)
    if kind is int:
        return f"leaves[{node}]"
    if node is None:
        return "None"
    if kind is dict or kind is collections.OrderedDict:
        if not all(type(key) in (str, int) for key in node):
            return None
        items = [(key, _build(value, classes)) for key, value in node.items()]
        if any(item is None for _, item in items):
            return None
        written = "{" + ", ".join(f"{key!r}: {item}" for key, item in items) + "}"
        return written if kind is dict else f"{_named(kind, classes)}({written})"
    if kind is tuple or kind is list or _is_namedtuple(kind):
        parts = [_build(value, classes) for value in node]
        if any(part is None for part in parts):
            return None
        inner = ", ".join(parts)  # type: ignore[arg-type]
        if kind is list:
            return f"[{inner}]"
        if kind is tuple:
            return f"({inner},)" if parts else "()"
        return f"{_named(kind, classes)}({inner})"
    return None


def _is_namedtuple(kind: type) -> bool:
    return issubclass(kind, tuple) and hasattr(kind, "_fields")


def _named(kind: type, classes: dict[str, type]) -> str:
    """The name ``kind`` has in the written function's namespace ``classes``."""
    name = f"C{len(classes)}"
    classes[name] = kind
    return name


def _shape_of(tree: Any) -> Any:
    """A tree's nodes, keys in order, and leaves by identity: what two builds must share."""
    kind = type(tree)
    if kind is dict or kind is collections.OrderedDict:
        return (kind, [(key, _shape_of(value)) for key, value in tree.items()])
    if kind is tuple or kind is list or _is_namedtuple(kind):
        return (kind, [_shape_of(value) for value in tree])
    return ("leaf", id(tree)) if tree is not None else ("none",)
