"""Context arguments: the extra, non-differentiated arguments of ``f``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from ._errors import ContextError
from ._families._shared import held as held

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
