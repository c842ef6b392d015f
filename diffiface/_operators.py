"""The public operators. Each one validates, normalises and dispatches; the work is done by
the adapters, through :mod:`diffiface._dispatch`.

Every operator ``op`` has ``prepare_op``, taking the same arguments (without ``prep``) plus
``strict``, and returning a :class:`~diffiface.Prep` to pass back as ``prep=``.

``has_aux=True`` (``f`` returns ``(value, aux)``) is taken by ``value_and_gradient``,
``value_and_jvp`` and ``value_and_vjp``; every other operator accepts the keyword only to
refuse it with :class:`~diffiface.InvalidInputError`, naming the operator that takes it.

With an :class:`~diffiface.AutoSparse` backend the Jacobian and Hessian operators take the
sparse route of :mod:`diffiface._sparse_operators` and the others use the wrapped backend:
:mod:`diffiface._dispatch` decides, once for every operator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._backends import Backend
from ._complex import holomorphic as _holomorphic
from ._dispatch import evaluate, prepare
from ._prep import Prep

BackendLike = Backend | str


def derivative(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
) -> Any:
    """The derivative of ``f`` at a scalar ``x``, shaped as ``f(x)``.

    For a complex ``x``, ``f'(x)`` of a holomorphic ``f``: a map that is not holomorphic is refused,
    or ``holomorphic=True`` asserts it, as for :func:`jacobian`. See :func:`prepare_derivative`.

    Examples
    --------
    >>> import diffiface as di
    >>> di.derivative(lambda x: x**3, "finite_differences", 2.0)  # doctest: +ELLIPSIS
    12.0000000...
    """
    return evaluate("derivative", _holomorphic(f) if holomorphic else f, backend, x, None, contexts, prep, has_aux)


def prepare_derivative(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
    holomorphic: bool = False,
) -> Prep:
    """Prepare :func:`derivative` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("derivative", _holomorphic(f) if holomorphic else f, backend, x, None, contexts, strict, has_aux)


def value_and_derivative(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
) -> Any:
    """``(f(x), derivative)`` at a scalar ``x``. See :func:`prepare_value_and_derivative`."""
    return evaluate(
        "value_and_derivative", _holomorphic(f) if holomorphic else f, backend, x, None, contexts, prep, has_aux
    )


def prepare_value_and_derivative(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
    holomorphic: bool = False,
) -> Prep:
    """Prepare :func:`value_and_derivative` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare(
        "value_and_derivative", _holomorphic(f) if holomorphic else f, backend, x, None, contexts, strict, has_aux
    )


def second_derivative(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, prep: Prep | None = None, has_aux: bool = False
) -> Any:
    """The second derivative of ``f`` at a scalar ``x``, shaped as ``f(x)``. See
    :func:`prepare_second_derivative`."""
    return evaluate("second_derivative", f, backend, x, None, contexts, prep, has_aux)


def prepare_second_derivative(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, strict: bool = True, has_aux: bool = False
) -> Prep:
    """Prepare :func:`second_derivative` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("second_derivative", f, backend, x, None, contexts, strict, has_aux)


def value_derivative_and_second_derivative(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, prep: Prep | None = None, has_aux: bool = False
) -> Any:
    """``(f(x), derivative, second derivative)`` at a scalar ``x``. See
    :func:`prepare_value_derivative_and_second_derivative`."""
    return evaluate("value_derivative_and_second_derivative", f, backend, x, None, contexts, prep, has_aux)


def prepare_value_derivative_and_second_derivative(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, strict: bool = True, has_aux: bool = False
) -> Prep:
    """Prepare :func:`value_derivative_and_second_derivative` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("value_derivative_and_second_derivative", f, backend, x, None, contexts, strict, has_aux)


def gradient(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, prep: Prep | None = None, has_aux: bool = False
) -> Any:
    """The gradient of a scalar-valued ``f`` at ``x``, shaped as ``x``. See :func:`prepare_gradient`.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> di.gradient(lambda x: (x**2).sum(), "finite_differences", np.array([1.0, 2.0])).round(6)
    array([2., 4.])
    """
    return evaluate("gradient", f, backend, x, None, contexts, prep, has_aux)


def prepare_gradient(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, strict: bool = True, has_aux: bool = False
) -> Prep:
    """Prepare :func:`gradient` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("gradient", f, backend, x, None, contexts, strict, has_aux)


def value_and_gradient(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, prep: Prep | None = None, has_aux: bool = False
) -> Any:
    """``(f(x), gradient)``; with ``has_aux=True``, ``((value, aux), gradient)``. See
    :func:`prepare_value_and_gradient`."""
    return evaluate("value_and_gradient", f, backend, x, None, contexts, prep, has_aux)


def prepare_value_and_gradient(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, strict: bool = True, has_aux: bool = False
) -> Prep:
    """Prepare :func:`value_and_gradient` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("value_and_gradient", f, backend, x, None, contexts, strict, has_aux)


def jacobian(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
) -> Any:
    """The Jacobian of ``f`` at ``x``: per leaf ``y.shape + x.shape``; for pytrees the structure of
    ``f(x)`` holding the structure of ``x``, as ``jax.jacobian`` nests it.

    For a complex ``x`` the entries are ``df_i/dz_j`` of a holomorphic ``f``; a map that is not
    holomorphic is refused (:class:`~diffiface.UnsupportedOperationError`, checked on the
    values, which runs jax without jit), unless ``holomorphic=True`` asserts it: then nothing
    is checked and the Jacobian is taken along the real axis (see docs/complex.md).
    See :func:`prepare_jacobian`.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> di.jacobian(lambda x: 2 * x, "finite_differences", np.array([1.0, 2.0])).round(6)
    array([[2., 0.],
           [0., 2.]])
    """
    return evaluate("jacobian", _holomorphic(f) if holomorphic else f, backend, x, None, contexts, prep, has_aux)


def prepare_jacobian(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
    holomorphic: bool = False,
) -> Prep:
    """Prepare :func:`jacobian` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("jacobian", _holomorphic(f) if holomorphic else f, backend, x, None, contexts, strict, has_aux)


def value_and_jacobian(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
) -> Any:
    """``(f(x), jacobian)``. See :func:`prepare_value_and_jacobian`."""
    return evaluate(
        "value_and_jacobian", _holomorphic(f) if holomorphic else f, backend, x, None, contexts, prep, has_aux
    )


def prepare_value_and_jacobian(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
    holomorphic: bool = False,
) -> Prep:
    """Prepare :func:`value_and_jacobian` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare(
        "value_and_jacobian", _holomorphic(f) if holomorphic else f, backend, x, None, contexts, strict, has_aux
    )


def hessian(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, prep: Prep | None = None, has_aux: bool = False
) -> Any:
    """The Hessian of a scalar-valued ``f`` at ``x``: per pair of leaves ``x_i.shape + x_j.shape``,
    nested as ``jax.hessian`` nests it. See :func:`prepare_hessian`.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> di.hessian(lambda x: x[0] * x[1], "finite_differences", np.array([1.0, 2.0])).round(6)
    array([[0., 1.],
           [1., 0.]])
    """
    return evaluate("hessian", f, backend, x, None, contexts, prep, has_aux)


def prepare_hessian(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, strict: bool = True, has_aux: bool = False
) -> Prep:
    """Prepare :func:`hessian` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("hessian", f, backend, x, None, contexts, strict, has_aux)


def value_gradient_and_hessian(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, prep: Prep | None = None, has_aux: bool = False
) -> Any:
    """``(f(x), gradient, hessian)``. See :func:`prepare_value_gradient_and_hessian`."""
    return evaluate("value_gradient_and_hessian", f, backend, x, None, contexts, prep, has_aux)


def prepare_value_gradient_and_hessian(
    f: Callable[..., Any], backend: BackendLike, x: Any, *contexts: Any, strict: bool = True, has_aux: bool = False
) -> Prep:
    """Prepare :func:`value_gradient_and_hessian` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("value_gradient_and_hessian", f, backend, x, None, contexts, strict, has_aux)


def jvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tx: Any,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> Any:
    """The Jacobian-vector product of ``f`` at ``x`` along ``tx`` (shaped as ``x``), shaped as ``f(x)``.
    See :func:`prepare_jvp`.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> di.jvp(lambda x: x**2, "finite_differences", np.array([1.0, 2.0]), np.array([1.0, 0.0])).round(6)
    array([2., 0.])
    """
    return evaluate("jvp", f, backend, x, tx, contexts, prep, has_aux)


def prepare_jvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tx: Any,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`jvp` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("jvp", f, backend, x, tx, contexts, strict, has_aux)


def value_and_jvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tx: Any,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> Any:
    """``(f(x), jvp)``; with ``has_aux=True``, ``((f(x), aux), jvp)``. See :func:`prepare_value_and_jvp`."""
    return evaluate("value_and_jvp", f, backend, x, tx, contexts, prep, has_aux)


def prepare_value_and_jvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tx: Any,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`value_and_jvp` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("value_and_jvp", f, backend, x, tx, contexts, strict, has_aux)


def vjp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    ty: Any,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> Any:
    """The vector-Jacobian product of ``f`` at ``x`` with ``ty`` (shaped as ``f(x)``), shaped as ``x``.
    See :func:`prepare_vjp`.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> di.vjp(lambda x: x**2, "finite_differences", np.array([1.0, 2.0]), np.array([0.0, 1.0])).round(6)
    array([0., 4.])
    """
    return evaluate("vjp", f, backend, x, ty, contexts, prep, has_aux)


def prepare_vjp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    ty: Any,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`vjp` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("vjp", f, backend, x, ty, contexts, strict, has_aux)


def value_and_vjp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    ty: Any,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> Any:
    """``(f(x), vjp)``; with ``has_aux=True``, ``((f(x), aux), vjp)``. See :func:`prepare_value_and_vjp`."""
    return evaluate("value_and_vjp", f, backend, x, ty, contexts, prep, has_aux)


def prepare_value_and_vjp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    ty: Any,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`value_and_vjp` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("value_and_vjp", f, backend, x, ty, contexts, strict, has_aux)


def hvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tx: Any,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> Any:
    """The Hessian-vector product of a scalar-valued ``f`` at ``x`` along ``tx``, shaped as ``x``. See
    :func:`prepare_hvp`."""
    return evaluate("hvp", f, backend, x, tx, contexts, prep, has_aux)


def prepare_hvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tx: Any,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`hvp` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("hvp", f, backend, x, tx, contexts, strict, has_aux)


def gradient_and_hvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tx: Any,
    *contexts: Any,
    prep: Prep | None = None,
    has_aux: bool = False,
) -> Any:
    """``(gradient, hvp)`` of a scalar-valued ``f`` at ``x`` along ``tx``. See :func:`prepare_gradient_and_hvp`."""
    return evaluate("gradient_and_hvp", f, backend, x, tx, contexts, prep, has_aux)


def prepare_gradient_and_hvp(
    f: Callable[..., Any],
    backend: BackendLike,
    x: Any,
    tx: Any,
    *contexts: Any,
    strict: bool = True,
    has_aux: bool = False,
) -> Prep:
    """Prepare :func:`gradient_and_hvp` for arguments shaped like these; pass the result as ``prep=``."""
    return prepare("gradient_and_hvp", f, backend, x, tx, contexts, strict, has_aux)
