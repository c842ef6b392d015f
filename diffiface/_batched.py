"""Many tangents at once: :class:`Tangents`, :func:`batched_jvp`, :func:`batched_vjp`.

Why a wrapper type. A tangent of x has x's structure, and x may be a tuple or a list: a tuple of
tangents would read as one tangent of a tuple x, or the other way round, depending on x. A batch
is therefore never a plain container: it is ``Tangents(t1, t2, ...)``, a type no pytree library
flattens, so a batch passed where one tangent is expected fails with a clear error, and one
tangent is never read as a batch.

The engines run a batch as one program where they have vmap (jax: ``jax.vmap`` over
``jax.linearize``/``jax.vjp``; torch.func: ``torch.func.vmap``), a loop elsewhere: the adapters'
``value_and_pushforwards`` and ``value_and_pullbacks``, which the dense Jacobians by rows and
columns use. The public functions here run the batch through the prepared ``jvp``/``vjp``
operator (one preparation, every check of the operator on each tangent).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ._errors import InvalidInputError

__all__ = ["Tangents", "batched_jvp", "batched_vjp"]


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


def _check(name: str, tangents: Any) -> Tangents:
    if not isinstance(tangents, Tangents):
        raise InvalidInputError(
            f"{name} takes a batch as di.Tangents(t1, t2, ...), got {type(tangents).__name__}: a tuple or list "
            "would be ambiguous with one tangent of a tuple or list x. For one tangent use di."
            f"{name.removeprefix('batched_')}."
        )
    return tangents


def batched_jvp(f: Callable[..., Any], backend: Any, x: Any, tangents: Tangents, *contexts: Any) -> Tangents:
    """The Jacobian-vector products of ``f`` at ``x`` along each tangent of the batch, as
    :class:`Tangents` (each result mirrors ``f(x)``). The jvp is prepared once for the batch."""
    from . import _operators as ops

    batch = _check("batched_jvp", tangents)
    if not len(batch):
        return Tangents()
    prep = ops.prepare_jvp(f, backend, x, batch[0], *contexts)
    return Tangents(*(ops.jvp(f, backend, x, t, *contexts, prep=prep) for t in batch))


def batched_vjp(f: Callable[..., Any], backend: Any, x: Any, cotangents: Tangents, *contexts: Any) -> Tangents:
    """The vector-Jacobian products of ``f`` at ``x`` of each cotangent of the batch (each shaped
    as ``f(x)``), as :class:`Tangents` (each result mirrors ``x``). The vjp is prepared once."""
    from . import _operators as ops

    batch = _check("batched_vjp", cotangents)
    if not len(batch):
        return Tangents()
    prep = ops.prepare_vjp(f, backend, x, batch[0], *contexts)
    return Tangents(*(ops.vjp(f, backend, x, t, *contexts, prep=prep) for t in batch))
