"""What several families build on: the test of a list of leaves by metadata read in C, and the
parts of the family API that most families answer alike."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any


class MetaLeaves:
    """The test of a list of leaves: their types, and the metadata ``meta`` reads of each (an
    ``operator.attrgetter``, so no Python frame per leaf). A plan inlines this test where it
    finds one (``type(test) is MetaLeaves``), since a call costs a frame on the hot path."""

    __slots__ = ("meta", "metas", "types")

    def __init__(self, leaves: list[Any], meta: Callable[[Any], Any]) -> None:
        self.meta = meta
        self.types = list(map(type, leaves))
        self.metas = list(map(meta, leaves))

    def __call__(self, leaves: list[Any]) -> bool:
        return list(map(type, leaves)) == self.types and list(map(self.meta, leaves)) == self.metas


def no_refusal(leaf: Any) -> str | None:
    """``x_refusal`` of a family whose every leaf has values to differentiate at."""
    return None


def unopened(result: Any) -> Any:
    """``opened`` of a family with no traced containers."""
    return result


def untraced(leaf: Any) -> Any:
    """``traced`` of a family whose leaves trace no other value."""
    return leaf


class SameShapeDtype:
    """The test that a later leaf has the prepared one's shape and dtype (for families whose
    leaves say both, and nothing else matters: mlx's, TensorFlow's)."""

    __slots__ = ("dtype", "shape")

    def __init__(self, leaf: Any) -> None:
        self.shape, self.dtype = tuple(leaf.shape), leaf.dtype

    def test(self, value: Any) -> bool:
        return tuple(value.shape) == self.shape and value.dtype == self.dtype  # type: ignore[no-any-return]


def no_scope(dtypes: Iterable[str]) -> contextlib.nullcontext[None]:
    """No dtype needs a scope in this family."""
    return contextlib.nullcontext()


def no_eval_shape(fn: Callable[..., Any], avals: list[tuple[tuple[int, ...], str]]) -> None:
    """No abstract evaluation in this family: f is evaluated at zeros."""
    return None


def no_ravel(leaves: list[Any]) -> None:
    """No layout over several devices in this family: the plain ravel serves."""
    return None
