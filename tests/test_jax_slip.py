"""The jax user's slip: f runs the model it closes over, not the parameters it is given.

With equinox, ``params, static = eqx.partition(model, eqx.is_array)`` and f calling ``model``
rather than ``eqx.combine(params, static)``; with flax nnx, ``graphdef, state = nnx.split(m)``
and f calling ``m`` rather than ``nnx.merge(graphdef, state)``. x's arrays are the model's own,
which f reads as constants: every derivative came back zeros, with no error. An f whose output
truly does not depend on x keeps its zero derivative."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import diffiface as di

jax = pytest.importorskip("jax", reason='the jax backend is not installed: pip install "diffiface[jax]"')
jnp = pytest.importorskip("jax.numpy")

BACKENDS = [pytest.param("jax", id="jit"), pytest.param(di.AutoJAX(jit=False), id="eager")]
OPERATORS = ["gradient", "value_and_gradient", "vjp", "jvp", "jacobian", "hvp", "hessian"]
SLIP = "reads the arrays of x itself"


def _equinox() -> tuple[Any, Callable[[Any, Any], Any], Callable[[Any, Any], Any]]:
    """x, the slip (f runs the model), and f on its argument, for equinox: both map
    ``(params, data)`` to the model's outputs on a batch."""
    eqx = pytest.importorskip("equinox", reason="equinox is not installed: pip install equinox")
    model = eqx.nn.MLP(2, 1, 3, 1, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)

    def slip(p: Any, data: Any) -> Any:
        return jax.vmap(model)(data).reshape(-1)

    def right(p: Any, data: Any) -> Any:
        return jax.vmap(eqx.combine(p, static))(data).reshape(-1)

    return params, slip, right


def _nnx() -> tuple[Any, Callable[[Any, Any], Any], Callable[[Any, Any], Any]]:
    nnx = pytest.importorskip("flax.nnx", reason="flax is not installed: pip install flax")
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def slip(s: Any, data: Any) -> Any:
        return model(data).reshape(-1)

    def right(s: Any, data: Any) -> Any:
        return nnx.merge(graphdef, s)(data).reshape(-1)

    return state, slip, right


LIBRARIES = [pytest.param(_equinox, id="equinox"), pytest.param(_nnx, id="nnx")]
DATA = jnp.linspace(-1.0, 1.0, 10, dtype=jnp.float32).reshape(5, 2)


def _scalar(f: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    return lambda p, data: jnp.mean(f(p, data) ** 2)


def _call(operator: str, f: Callable[[Any, Any], Any], backend: Any, x: Any, prepared: bool) -> Any:
    """``operator`` on f (the vector-valued one; the scalar operators take the mean square of
    its outputs), with its own tangent, prepared first where asked."""
    data = di.Constant(DATA)
    tangent: tuple[Any, ...] = ()
    if operator in ("gradient", "value_and_gradient", "hvp", "hessian"):
        f = _scalar(f)
    if operator in ("jvp", "hvp"):
        tangent = (jax.tree.map(jnp.ones_like, x),)
    if operator == "vjp":
        tangent = (jnp.ones(5, jnp.float32),)
    prep = getattr(di, f"prepare_{operator}")(f, backend, x, *tangent, data) if prepared else None
    return getattr(di, operator)(f, backend, x, *tangent, data, prep=prep)


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("operator", OPERATORS)
def test_an_f_that_runs_the_model_instead_of_its_argument_is_refused(
    library: Any, backend: Any, prepared: bool, operator: str
) -> None:
    x, slip, right = library()
    with pytest.raises(di.InvalidOutputError, match=SLIP):
        _call(operator, slip, backend, x, prepared)
    # f on its argument is served, its derivative through x
    found = _call(operator, right, backend, x, prepared)
    assert any(bool(jnp.any(leaf != 0)) for leaf in jax.tree.leaves(found))


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_an_f_that_does_not_depend_on_x_keeps_its_zero_derivative(library: Any, backend: Any, prepared: bool) -> None:
    x, _, right = library()
    leaf = jax.tree.leaves(x)[0]
    another = jax.tree.map(lambda a: a + 1, x)
    others = {
        "a Constant only": lambda p, data: jnp.sum(data**2),
        "a constant": lambda p, data: jnp.asarray(1.0, jnp.float32),
        "x through stop_gradient": lambda p, data: jnp.sum(jax.lax.stop_gradient(jax.tree.leaves(p)[0]) ** 2),
        "another model's arrays": lambda p, data: jnp.sum(right(another, data) ** 2),
    }
    for name, f in others.items():
        for operator in ("gradient", "hessian"):
            found = _call(operator, f, backend, x, prepared)
            assert all(bool(jnp.all(g == 0)) for g in jax.tree.leaves(found)), (name, operator)
    # x's own array, given as a Constant too, is f's to read
    found = di.gradient(lambda p, c: jnp.sum(c**2), backend, x, di.Constant(leaf))
    assert all(bool(jnp.all(g == 0)) for g in jax.tree.leaves(found))


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_regulariser_on_the_closed_over_model_keeps_the_derivative_through_x(library: Any, backend: Any) -> None:
    """f reads x's arrays through its argument and, beside, through the model it closes over
    (a penalty on the model's weights): the derivative through the argument is served."""
    x, _, right = library()
    weight = jax.tree.leaves(x)[-1]

    def regularised(p: Any, data: Any) -> Any:
        return jnp.mean(right(p, data) ** 2) + jnp.sum(weight**2)

    found = di.gradient(regularised, backend, x, di.Constant(DATA))
    expected = di.gradient(_scalar(right), backend, x, di.Constant(DATA))
    for a, b in zip(jax.tree.leaves(found), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b))
    assert any(bool(jnp.any(leaf != 0)) for leaf in jax.tree.leaves(found))
