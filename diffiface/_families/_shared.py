"""What several families build on: the test of a list of leaves by metadata read in C, and the
parts of the family API that most families answer alike."""

from __future__ import annotations

from collections.abc import Callable
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
