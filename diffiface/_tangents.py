"""A batch of tangents (or cotangents): :class:`Tangents`.

Why a wrapper type. A tangent of x has x's structure, and x may be a tuple or a list: a tuple of
tangents would read as one tangent of a tuple x, or the other way round, depending on x. A batch
is therefore never a plain container: it is ``Tangents(t1, t2, ...)``. No pytree library takes it
apart by default (jax's and optree's own registries treat it as one leaf); diffiface's namespace
knows it as a node of its tangents, so that a batched operator flattens a batch in one pass and
its prep compares each tangent's leaves. An operator of one tangent refuses a batch by type.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optree

from .tree import NAMESPACE

__all__ = ["Tangents"]


class Tangents:
    """A batch of tangents (or cotangents), each shaped as one tangent of x (or of f(x)).

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> batch = di.Tangents(np.array([1.0, 0.0]), np.array([0.0, 1.0]))
    >>> [t.round(6).tolist() for t in di.batched_jvp(lambda x: x**2, "finite_differences", np.array([1.0, 2.0]), batch)]
    [[2.0, 0.0], [0.0, 4.0]]
    """

    __slots__ = ("items",)

    def __init__(self, *items: Any) -> None:
        self.items = tuple(items)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]

    def __repr__(self) -> str:
        return f"Tangents({len(self.items)} tangents)"

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


def _children(batch: Tangents) -> tuple[tuple[Any, ...], None]:
    return batch.items, None


def _from_children(_: None, children: Any) -> Tangents:
    return Tangents(*children)


optree.register_pytree_node(Tangents, _children, _from_children, namespace=NAMESPACE)  # type: ignore[arg-type]
