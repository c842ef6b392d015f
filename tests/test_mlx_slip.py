"""The mlx user's slip: f runs the model it closes over, not the parameters it is given.

x is ``model.trainable_parameters()`` of an ``mlx.nn`` module, the module's own arrays, and f
calls ``model(data)`` rather than computing from its argument (``model.update(p)`` first, or a
function of the parameters): mlx differentiates the arrays f is given, and every derivative
came back zeros, with no error. An f whose output truly does not depend on x keeps its zero
derivative."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import diffiface as di

mx = pytest.importorskip("mlx.core", reason='the mlx backend is not installed: pip install "diffiface[mlx]"')
nn = pytest.importorskip("mlx.nn")
utils = pytest.importorskip("mlx.utils")

BACKENDS = [pytest.param(di.AutoMLX(), id="compiled"), pytest.param(di.AutoMLX(compile=False), id="eager")]
OPERATORS = ["gradient", "value_and_gradient", "vjp", "jvp", "jacobian", "hvp", "hessian"]
SLIP = "reads the arrays of x itself"
DATA = mx.array(np.linspace(-1.0, 1.0, 10, dtype=np.float32).reshape(5, 2))


def _model() -> tuple[Any, Any]:
    """A model and x, its trainable arrays (the module's own objects)."""
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    mx.eval(model.parameters())
    return model, model.trainable_parameters()


def _leaves(tree: Any) -> list[Any]:
    return [leaf for _, leaf in utils.tree_flatten(tree)]


def _on(params: Any, data: Any) -> Any:
    """The model's outputs for ``params``, computed on a model of their own (the caller's is
    never written)."""
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    model.update(params)
    return model(data).reshape(-1)


def _scalar(f: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    return lambda p, data: mx.mean(f(p, data) ** 2)


def _call(operator: str, f: Callable[[Any, Any], Any], backend: Any, x: Any, prepared: bool) -> Any:
    """``operator`` on f (the vector-valued one; the scalar operators take the mean square of
    its outputs), with its own tangent, prepared first where asked."""
    data = di.Constant(DATA)
    tangent: tuple[Any, ...] = ()
    if operator in ("gradient", "value_and_gradient", "hvp", "hessian"):
        f = _scalar(f)
    if operator in ("jvp", "hvp"):
        tangent = (utils.tree_map(mx.ones_like, x),)
    if operator == "vjp":
        tangent = (mx.ones(5, dtype=mx.float32),)
    prep = getattr(di, f"prepare_{operator}")(f, backend, x, *tangent, data) if prepared else None
    return getattr(di, operator)(f, backend, x, *tangent, data, prep=prep)


def _flat(found: Any) -> list[Any]:
    return [leaf for leaf in _leaves(found) if isinstance(leaf, mx.array)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("operator", OPERATORS)
def test_an_f_that_runs_the_model_instead_of_its_argument_is_refused(
    backend: Any, prepared: bool, operator: str
) -> None:
    model, x = _model()

    def slip(p: Any, data: Any) -> Any:
        return model(data).reshape(-1)

    with pytest.raises(di.InvalidOutputError, match=SLIP):
        _call(operator, slip, backend, x, prepared)
    # f on its argument is served, its derivative through x; the caller's model is unchanged
    found = _call(operator, _on, backend, x, prepared)
    assert any(bool(mx.any(leaf != 0)) for leaf in _flat(found))
    assert all(a is b for a, b in zip(_leaves(model.trainable_parameters()), _leaves(x), strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_call_is_refused_again(backend: Any) -> None:
    """The check runs on a program's first call that returns: a call it refused leaves the
    next one checked too."""
    model, x = _model()

    def slip(p: Any, data: Any) -> Any:
        return mx.mean(model(data) ** 2)

    for _ in range(2):
        with pytest.raises(di.InvalidOutputError, match=SLIP):
            di.gradient(slip, backend, x, di.Constant(DATA))
    # (a compiled prep runs f as it is made; an eager one, at its first call)
    preps: list[Any] = []

    def prepared() -> Any:
        preps.append(di.prepare_gradient(slip, backend, x, di.Constant(DATA)))
        return di.gradient(slip, backend, x, di.Constant(DATA), prep=preps[-1])

    with pytest.raises(di.InvalidOutputError, match=SLIP):
        prepared()
    for prep in preps:
        with pytest.raises(di.InvalidOutputError, match=SLIP):
            di.gradient(slip, backend, x, di.Constant(DATA), prep=prep)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_an_f_that_does_not_depend_on_x_keeps_its_zero_derivative(backend: Any, prepared: bool) -> None:
    _, x = _model()
    another = utils.tree_map(lambda a: a + 1, x)
    mx.eval(another)  # (a lazy array's graph reads x's own arrays: the read of x itself that is refused)
    others = {
        "a Constant only": lambda p, data: mx.sum(data**2),
        "a constant": lambda p, data: mx.array(1.0, dtype=mx.float32),
        "x through stop_gradient": lambda p, data: mx.sum(mx.stop_gradient(_leaves(p)[0]) ** 2),
        "x's own array through stop_gradient": lambda p, data: mx.sum(mx.stop_gradient(_leaves(x)[0]) ** 2),
        "another model's arrays": lambda p, data: mx.sum(_on(another, data) ** 2),
    }
    for name, f in others.items():
        for operator in ("gradient", "hessian"):
            found = _call(operator, f, backend, x, prepared)
            assert all(bool(mx.all(g == 0)) for g in _flat(found)), (name, operator)
    # x's own array, given as a Constant too, is f's to read
    found = di.gradient(lambda p, c: mx.sum(c**2), backend, x, di.Constant(_leaves(x)[0]))
    assert all(bool(mx.all(g == 0)) for g in _flat(found))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_regulariser_on_the_closed_over_model_keeps_the_derivative_through_x(backend: Any) -> None:
    """f reads x's arrays through its argument and, beside, through the model it closes over
    (a penalty on the model's weights): the derivative through the argument is served."""
    model, x = _model()

    def regularised(p: Any, data: Any) -> Any:
        return mx.mean(_on(p, data) ** 2) + mx.sum(model.layers[0].weight ** 2)

    found = di.gradient(regularised, backend, x, di.Constant(DATA))
    expected = di.gradient(_scalar(_on), backend, x, di.Constant(DATA))
    for a, b in zip(_leaves(found), _leaves(expected), strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6)
    assert any(bool(mx.any(leaf != 0)) for leaf in _leaves(found))
