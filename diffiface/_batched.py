"""Many tangents at once: :func:`batched_jvp`, :func:`batched_vjp`, :func:`batched_hvp`, their
``value_and_`` / ``gradient_and_`` forms and ``prepare_`` functions, over a
:class:`~diffiface.Tangents` batch.

They are operators of the one route (:mod:`diffiface._dispatch`): the batch is flattened with
the call (its tangents' leaves one after another) and run by the adapters'
``value_and_pushforwards`` / ``pullbacks`` and ``gradient_and_hvps`` (each engine's way is in
its operator's docstring). A prep is made for a batch of a given size, each tangent with its
structure, shapes and dtypes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._dispatch import evaluate, prepare
from ._operators import BackendLike
from ._prep import Prep
from ._tangents import Tangents


def batched_jvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tangents: Tangents,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> Tangents:
    """The Jacobian-vector products of ``f`` at ``x`` along each tangent of the batch (each shaped
    as ``x``), as :class:`~diffiface.Tangents` of results shaped as ``f(x)``, in the batch's order.

    One program for the batch where the engine has vmap (jax, ``AutoTorch(mode="func")``), a loop
    elsewhere. A batch is always ``di.Tangents(...)``: a tuple or list is refused, since it would
    be ambiguous with one tangent of a tuple x. See :func:`prepare_batched_jvp`.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> pushed = di.batched_jvp(lambda x: x**2, "finite_differences", np.array([1.0, 2.0]),
    ...                         di.Tangents(np.array([1.0, 0.0]), np.array([0.0, 1.0])))
    >>> [t.round(6).tolist() for t in pushed]
    [[2.0, 0.0], [0.0, 4.0]]
    """
    return evaluate("batched_jvp", f, backend, x, tangents, contexts, prep, has_aux)  # type: ignore[no-any-return]


def prepare_batched_jvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tangents: Tangents,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`batched_jvp` for arguments shaped like these and a batch of this size; pass it as ``prep=``."""
    return prepare("batched_jvp", f, backend, x, tangents, contexts, strict, has_aux)


def value_and_batched_jvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tangents: Tangents,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> Any:
    """``(f(x), batched_jvp)``; with ``has_aux=True``, ``((f(x), aux), batched_jvp)``. f is
    evaluated once for the value and the batch. See :func:`prepare_value_and_batched_jvp`."""
    return evaluate("value_and_batched_jvp", f, backend, x, tangents, contexts, prep, has_aux)


def prepare_value_and_batched_jvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tangents: Tangents,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`value_and_batched_jvp`; pass the result as ``prep=``."""
    return prepare("value_and_batched_jvp", f, backend, x, tangents, contexts, strict, has_aux)


def batched_vjp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    cotangents: Tangents,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> Tangents:
    """The vector-Jacobian products of ``f`` at ``x`` with each cotangent of the batch (each shaped
    as ``f(x)``), as :class:`~diffiface.Tangents` of results shaped as ``x``, in the batch's order.

    f is evaluated once and its pullback applied to the whole batch: one vmapped program on jax
    and ``AutoTorch(mode="func")``, a loop elsewhere. See :func:`prepare_batched_vjp`.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> pulled = di.batched_vjp(lambda x: x**2, "finite_differences", np.array([1.0, 2.0]),
    ...                         di.Tangents(np.array([1.0, 0.0]), np.array([0.0, 1.0])))
    >>> [t.round(6).tolist() for t in pulled]
    [[2.0, 0.0], [0.0, 4.0]]
    """
    return evaluate("batched_vjp", f, backend, x, cotangents, contexts, prep, has_aux)  # type: ignore[no-any-return]


def prepare_batched_vjp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    cotangents: Tangents,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`batched_vjp` for arguments shaped like these and a batch of this size; pass it as ``prep=``."""
    return prepare("batched_vjp", f, backend, x, cotangents, contexts, strict, has_aux)


def value_and_batched_vjp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    cotangents: Tangents,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> Any:
    """``(f(x), batched_vjp)``; with ``has_aux=True``, ``((f(x), aux), batched_vjp)``. See
    :func:`prepare_value_and_batched_vjp`."""
    return evaluate("value_and_batched_vjp", f, backend, x, cotangents, contexts, prep, has_aux)


def prepare_value_and_batched_vjp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    cotangents: Tangents,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`value_and_batched_vjp`; pass the result as ``prep=``."""
    return prepare("value_and_batched_vjp", f, backend, x, cotangents, contexts, strict, has_aux)


def batched_hvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tangents: Tangents,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> Tangents:
    """The Hessian-vector products of a scalar ``f`` at ``x`` along each tangent of the batch
    (each shaped as ``x``), as :class:`~diffiface.Tangents` of results shaped as ``x``, in the
    batch's order.

    Forward over reverse, one vmapped program for the batch, on jax and
    ``AutoTorch(mode="func")``; f and its gradient once, then one pullback per tangent, on
    torch's autograd mode and autograd; the engine's own hvp per tangent on finite differences
    and scipy (the gradient once). See :func:`prepare_batched_hvp`.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> hvps = di.batched_hvp(lambda x: (x**3).sum(), "finite_differences", np.array([1.0, 2.0]),
    ...                       di.Tangents(np.array([1.0, 0.0]), np.array([0.0, 1.0])))
    >>> [t.round(4).tolist() for t in hvps]
    [[6.0, 0.0], [0.0, 12.0]]
    """
    return evaluate("batched_hvp", f, backend, x, tangents, contexts, prep, has_aux)  # type: ignore[no-any-return]


def prepare_batched_hvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tangents: Tangents,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`batched_hvp` for arguments shaped like these and a batch of this size; pass it as ``prep=``."""
    return prepare("batched_hvp", f, backend, x, tangents, contexts, strict, has_aux)


def gradient_and_batched_hvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tangents: Tangents,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> tuple[Any, Tangents]:
    """``(gradient, batched_hvp)``: the gradient of ``f`` at ``x`` and its Hessian-vector products
    along each tangent of the batch, from the same evaluation of f where the engine allows. See
    :func:`prepare_gradient_and_batched_hvp`.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> grad, hvps = di.gradient_and_batched_hvp(lambda x: (x**3).sum(), "finite_differences",
    ...     np.array([1.0, 2.0]), di.Tangents(np.array([1.0, 1.0])))
    >>> grad.round(4).tolist(), [t.round(4).tolist() for t in hvps]
    ([3.0, 12.0], [[6.0, 12.0]])
    """
    return evaluate("gradient_and_batched_hvp", f, backend, x, tangents, contexts, prep, has_aux)  # type: ignore[no-any-return]


def prepare_gradient_and_batched_hvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tangents: Tangents,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`gradient_and_batched_hvp`; pass the result as ``prep=``."""
    return prepare("gradient_and_batched_hvp", f, backend, x, tangents, contexts, strict, has_aux)
