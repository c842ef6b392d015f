"""Context arguments: the extra, non-differentiated arguments of ``f``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ._errors import ContextError

__all__ = ["Cache", "Constant", "Context"]

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Context(Generic[T]):
    """Base class of context wrappers; holds one value (any pytree)."""

    value: T

    def __post_init__(self) -> None:
        if isinstance(self.value, Context):
            outer, inner = type(self).__name__, type(self.value).__name__
            fix = (
                f"Pass di.{outer}(value)."
                if outer == inner
                else f"Pass di.{outer}(value) or di.{inner}(value), whichever the value is, not one inside the other."
            )
            raise ContextError(
                f"di.{outer}(di.{inner}(...)) wraps a context in another; a context is wrapped once. {fix}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


class Constant(Context[T]):
    """Read-only data passed to ``f`` after ``x``: a model, a batch, a state, hyper-parameters.

    diffiface never mutates it. Numpy array leaves are converted to the backend's array type;
    every other leaf (a ``torch.nn.Module``, a jax PRNG key, a string, a Python number) reaches
    ``f`` as it is.
    """


class Cache(Context[T]):
    """Scratch space that ``f`` may overwrite; its value on entry does not matter.

    It is never copied: array leaves are converted as a Constant's are (torch shares memory
    with numpy), everything else reaches ``f`` as it is, so ``f`` can write into it.
    """


_OPAQUE = (int, float, complex, str, bytes, bool, type(None), type)
_MOST = 64
"""The longest list, tuple or dict :func:`held` looks into."""


def held(leaf: object, wanted: Callable[[object], bool], depth: int = 2) -> list[object]:
    """The objects ``wanted`` picks (an engine's models: a ``torch.nn.Module``, a Keras model)
    that a Constant's leaf holds: the leaf itself, or objects in its attributes, and in the
    lists, tuples and dicts among them (of at most 64 items), ``depth`` objects deep
    (``di.Constant(trainer)``, whose ``trainer.model`` f calls). An engine's guard watches each
    as it watches a Constant model."""
    if wanted(leaf):
        return [leaf]
    if depth == 0 or isinstance(leaf, _OPAQUE):
        return []
    found: list[object] = []
    seen = {id(leaf)}
    todo: list[tuple[object, int]] = [(leaf, depth)]
    while todo:
        value, left = todo.pop()
        if isinstance(value, (list, tuple, dict)):
            if len(value) > _MOST:  # (data, not a few models: not walked on every call)
                continue
            items: Iterable[object] = value.values() if isinstance(value, dict) else value
        else:
            attributes = getattr(value, "__dict__", None)
            if type(attributes) is not dict or left == 0:
                continue
            items = attributes.values()
            left -= 1
        for item in items:
            if id(item) in seen or isinstance(item, _OPAQUE):
                continue
            seen.add(id(item))
            if wanted(item):
                found.append(item)
            else:
                todo.append((item, left))
    return found
