"""Faults at the seams between the routes (issue 18), one test each: what a caller's state,
f's own exceptions, unusual numpy arrays, nested contexts, a prep, an aux and a cotangent
must come out as, on every backend they concern."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import namespace, native_tree, require, to_numpy, tolerance

import diffiface as di

TORCH_MODES = ("torch-autograd", "torch-func")


def _torch() -> Any:
    require("torch-autograd")
    import torch

    return torch


# -- 1. grad mode: the caller's, whatever f does with it -----------------------------------------


FORWARD_IN_TORCH = ("jvp", "derivative")
"""The operators torch computes in forward mode, which grad mode does not concern."""


@pytest.mark.parametrize("caller_mode", [True, False], ids=["caller-grad-on", "caller-grad-off"])
@pytest.mark.parametrize("when", ["after", "before", "raising"])
@pytest.mark.parametrize(
    "op", ["gradient", "value_and_gradient", "jvp", "vjp", "jacobian", "hvp", "hessian", "derivative"]
)
@pytest.mark.parametrize("mode", TORCH_MODES)
def test_f_that_switches_grad_mode_off_leaves_the_callers_mode(
    mode: str, op: str, when: str, caller_mode: bool
) -> None:
    """f turns grad mode off and leaves it off: after computing its output (the derivative is
    right), before (reverse mode sees no graph: refused, never zeros), or before raising."""
    torch = _torch()
    backend = require(mode)

    class Raised(Exception):
        pass

    def f(v: Any) -> Any:
        if when == "before":
            torch.set_grad_enabled(False)
        y = (v**3).sum() if v.ndim else v**3
        torch.set_grad_enabled(False)  # and never back on
        if when == "raising":
            raise Raised
        return y

    x = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    s = torch.tensor(1.5, dtype=torch.float64)
    calls: dict[str, Callable[[], Any]] = {
        "gradient": lambda: di.gradient(f, backend, x),
        "value_and_gradient": lambda: di.value_and_gradient(f, backend, x)[1],
        "jvp": lambda: di.jvp(f, backend, x, torch.ones_like(x)),
        "vjp": lambda: di.vjp(f, backend, x, torch.tensor(1.0, dtype=torch.float64)),
        "jacobian": lambda: di.jacobian(f, backend, x),
        "hvp": lambda: di.hvp(f, backend, x, torch.ones_like(x)),
        "hessian": lambda: di.hessian(f, backend, x),
        "derivative": lambda: di.derivative(f, backend, s),
    }
    expected = {
        "gradient": 3 * x**2,
        "value_and_gradient": 3 * x**2,
        "jvp": (3 * x**2).sum(),
        "vjp": 3 * x**2,
        "jacobian": 3 * x**2,
        "hvp": 6 * x,
        "hessian": torch.diag(6 * x),
        "derivative": 3 * s**2,
    }[op]
    previous = torch.is_grad_enabled()
    torch.set_grad_enabled(caller_mode)
    try:
        if when == "raising":
            with pytest.raises(Raised):
                calls[op]()
        elif when == "before" and op not in FORWARD_IN_TORCH:
            with pytest.raises(di.InvalidOutputError, match="grad mode off"):
                calls[op]()
        else:
            result = calls[op]()
            np.testing.assert_allclose(to_numpy(result), to_numpy(expected), rtol=1e-10)
        after = torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(previous)
    assert after is caller_mode, f"the caller's grad mode was {caller_mode}, after the call it is {after}"


# -- 2. numpy code under torch --------------------------------------------------------------------


A = np.array([[2.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 3.0]])


class _Own(TypeError):
    pass


OWN_TYPE_ERROR = "unsupported operand type(s) for @: 'numpy.ndarray' and 'Tensor'"


def _numpy_f(case: str) -> Callable[[Any], Any]:
    if case == "matmul":
        return lambda v: (A @ v).sum()
    if case == "multiply":
        return lambda v: (A[0] * v).sum()
    if case == "add":
        return lambda v: (A[0] + v).sum()
    if case == "compare":
        return lambda v: (v * (A[0] < v)).sum()

    def own(v: Any) -> Any:  # f's own TypeError, worded as the interpreter's: not a mismatch
        raise TypeError(OWN_TYPE_ERROR)

    return own


@pytest.mark.parametrize("case", ["matmul", "multiply", "add", "compare", "own"])
@pytest.mark.parametrize("mode", TORCH_MODES)
def test_numpy_operator_on_a_tensor_is_a_framework_mismatch(mode: str, case: str) -> None:
    backend = require(mode)
    f = _numpy_f(case)
    x = np.array([0.5, 1.0, 2.0])
    with pytest.raises(TypeError) as info:
        di.gradient(f, backend, x)
    if case == "own":
        assert type(info.value) is TypeError and str(info.value) == OWN_TYPE_ERROR, (
            f"f's own TypeError came back as {type(info.value).__name__}: {info.value}"
        )
        return
    assert isinstance(info.value, di.FrameworkMismatchError), f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert "numpy array and a torch tensor" in message
    assert "torch.as_tensor" in message and "di.Constant" in message
    assert type(info.value.__cause__) is TypeError  # the original is kept


# -- 3. f's StopIteration under finite differences ------------------------------------------------


STOPPING_BACKENDS = {
    "fd-central": di.AutoFiniteDifferences(),
    "fd-forward": di.AutoFiniteDifferences(method="forward"),
    "fd-backward": di.AutoFiniteDifferences(method="backward"),
    "fd-complex": di.AutoFiniteDifferences(method="complex"),
    "fd-vectorized": di.AutoFiniteDifferences(vectorize=True),
    "scipy": di.AutoScipy(),
    "autograd": di.AutoAutograd(),
}


@pytest.mark.parametrize("op", ["gradient", "jacobian", "jvp", "vjp", "hessian", "hvp", "derivative"])
@pytest.mark.parametrize("name", list(STOPPING_BACKENDS))
def test_stop_iteration_from_f_reaches_the_caller(name: str, op: str) -> None:
    backend = require(STOPPING_BACKENDS[name])
    raised = StopIteration("f's own")
    evaluations = [0]

    # finite differences: the first evaluation succeeds, the failure comes from a perturbed
    # point (f's calls there ran inside a generator); autograd traces f once, and vectorized
    # finite differences may need one batched evaluation only
    succeeding = 0 if name in ("autograd", "fd-vectorized") else 1

    def f(v: Any) -> Any:
        evaluations[0] += 1
        if evaluations[0] > succeeding:
            raise raised
        xp = namespace(v)
        # (over the last axis: vectorized finite differences evaluate a batch of points at once)
        return xp.sum(v**2, axis=-1) if op in ("gradient", "hessian", "hvp") else v**2

    x = np.array([0.5, 1.0, 2.0])
    calls: dict[str, Callable[[], Any]] = {
        "gradient": lambda: di.gradient(f, backend, x),
        "jacobian": lambda: di.jacobian(f, backend, x),
        "jvp": lambda: di.jvp(f, backend, x, np.ones(3)),
        "vjp": lambda: di.vjp(f, backend, x, np.ones(3)),
        "hessian": lambda: di.hessian(f, backend, x),
        "hvp": lambda: di.hvp(f, backend, x, np.ones(3)),
        "derivative": lambda: di.derivative(f, backend, 1.5),
    }
    with pytest.raises(BaseException) as info:  # noqa: PT011 - which one is the question
        calls[op]()
    assert info.value is raised, f"f's StopIteration came back as {type(info.value).__name__}: {info.value}"


# -- 4. a context wrapped twice -------------------------------------------------------------------


@pytest.mark.parametrize("inner", [di.Constant, di.Cache], ids=["Constant", "Cache"])
@pytest.mark.parametrize("outer", [di.Constant, di.Cache], ids=["Constant", "Cache"])
def test_a_context_wrapped_twice_is_refused(outer: type, inner: type) -> None:
    with pytest.raises(di.ContextError) as info:
        outer(inner(np.ones(3)))
    message = str(info.value)
    assert f"di.{outer.__name__}(di.{inner.__name__}(" in message and "wrapped once" in message
    assert outer(np.ones(3)).value.shape == (3,)  # wrapped once: as before


# -- 5. big-endian floats, as read from FITS or HDF5 ----------------------------------------------


@pytest.mark.parametrize("dtype", [">f8", ">f4"])
def test_big_endian_floats_are_served(backend_id: str, backend: di.Backend, dtype: str) -> None:
    native = np.dtype(dtype).newbyteorder("=")
    x = np.array([0.5, 1.0, 2.0], dtype=dtype)
    c = np.array([3.0, -1.0, 0.25], dtype=dtype)
    x_before, c_before = x.copy(), c.copy()
    rtol, atol = tolerance(backend_id, native)

    def f(v: Any, w: Any) -> Any:
        return namespace(v).sum(w * v**2)

    prep = di.prepare_gradient(f, backend, x, di.Constant(c))
    for result in (
        di.gradient(f, backend, x, di.Constant(c)),
        di.gradient(f, backend, x, di.Constant(c), prep=prep),
        di.gradient(f, backend, x, di.Constant(c), prep=prep),
    ):
        assert isinstance(result, np.ndarray)
        # a native-order array of x's number type, as numpy's own operations on x return
        assert result.dtype == native and result.dtype.isnative, result.dtype
        np.testing.assert_allclose(result, 2 * c.astype(np.float64) * x.astype(np.float64), rtol=rtol, atol=atol)
    jacobian = di.jacobian(lambda v: v**2, backend, x)
    assert jacobian.dtype == native
    np.testing.assert_allclose(jacobian, np.diag(2 * x.astype(np.float64)), rtol=rtol, atol=atol)
    assert x.dtype == np.dtype(dtype) and x.tobytes() == x_before.tobytes()
    assert c.dtype == np.dtype(dtype) and c.tobytes() == c_before.tobytes()


# -- 6. numpy masked arrays -----------------------------------------------------------------------


@pytest.mark.parametrize("role", ["x", "x-tree", "tangent", "cotangent", "Constant", "Constant-tree"])
def test_masked_arrays_are_refused(backend: di.Backend, role: str) -> None:
    masked = np.ma.masked_array([0.5, 1.0, 2.0], mask=[False, True, False])
    x = np.array([0.5, 1.0, 2.0])

    def square(v: Any, *_: Any) -> Any:
        return v**2

    def total(v: Any, *_: Any) -> Any:
        return namespace(v).sum(v**2)

    calls: dict[str, Callable[[], Any]] = {
        "x": lambda: di.gradient(total, backend, masked),
        "x-tree": lambda: di.gradient(lambda t: total(t["a"]) + total(t["b"]), backend, {"a": x, "b": masked}),
        "tangent": lambda: di.jvp(square, backend, x, masked),
        "cotangent": lambda: di.vjp(square, backend, x, masked),
        "Constant": lambda: di.gradient(total, backend, x, di.Constant(masked)),
        "Constant-tree": lambda: di.gradient(total, backend, x, di.Constant({"w": x, "mask": masked})),
    }
    with pytest.raises(di.InvalidInputError) as info:
        calls[role]()
    message = str(info.value)
    assert "masked array" in message and ".filled(" in message and "di.Constant(" in message
    assert not masked.mask[0] and masked.mask[1]  # the caller's array as it was


# -- 7. a prep is neither pickled nor copied ------------------------------------------------------


@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy", "deepcopy-inside"])
@pytest.mark.parametrize("backend_name", ["jax", "torch", "finite_differences"])
def test_a_prep_refuses_pickling_and_copying(backend_name: str, how: str) -> None:
    backend = require({"jax": "jax", "torch": "torch-autograd"}.get(backend_name, backend_name))
    x = np.array([0.5, 1.0, 2.0])

    def f(v: Any) -> Any:
        return (v**2).sum()

    prep = di.prepare_gradient(f, backend, x)
    act: Callable[[], Any] = {
        "pickle": lambda: pickle.dumps(prep),
        "copy": lambda: copy.copy(prep),
        "deepcopy": lambda: copy.deepcopy(prep),
        "deepcopy-inside": lambda: copy.deepcopy({"state": [prep]}),
    }[how]
    with pytest.raises(di.DiffifaceError) as info:
        act()
    message = str(info.value)
    assert "prepare_gradient" in message and "again" in message
    np.testing.assert_allclose(di.gradient(f, backend, x, prep=prep), 2 * x)  # still usable


# -- 8. aux rides along as f returned it ----------------------------------------------------------


@pytest.mark.parametrize("op", ["value_and_gradient", "value_and_jvp", "value_and_vjp"])
def test_aux_comes_back_as_f_returned_it(backend_id: str, backend: di.Backend, op: str) -> None:
    x = np.array([0.5, 1.0, 2.0])

    def f(v: Any) -> Any:
        y = namespace(v).sum(v**2) if op == "value_and_gradient" else v**2
        # keys out of sorted order; leaves of every kind
        aux = {"zeta": "hello", "alpha": 3, "mid": None, "scale": 2.5, "pair": ("a", 1), "double": v * 2}
        return y, aux

    calls: dict[str, Callable[[], Any]] = {
        "value_and_gradient": lambda: di.value_and_gradient(f, backend, x, has_aux=True),
        "value_and_jvp": lambda: di.value_and_jvp(f, backend, x, np.ones(3), has_aux=True),
        "value_and_vjp": lambda: di.value_and_vjp(f, backend, x, np.ones(3), has_aux=True),
    }
    rtol, atol = tolerance(backend_id, np.float64)
    for _ in range(2):  # preparing, then from the cache of preparations
        (_, aux), _ = calls[op]()
        assert list(aux) == ["zeta", "alpha", "mid", "scale", "pair", "double"], list(aux)
        assert type(aux["zeta"]) is str and aux["zeta"] == "hello"
        assert type(aux["alpha"]) is int and aux["alpha"] == 3
        assert aux["mid"] is None
        assert type(aux["scale"]) is float and aux["scale"] == 2.5
        assert type(aux["pair"]) is tuple and aux["pair"] == ("a", 1)
        assert isinstance(aux["double"], np.ndarray)  # an array: in x's array type
        np.testing.assert_allclose(aux["double"], 2 * x, rtol=rtol, atol=atol)


# -- 9. a vjp's cotangent is checked against f's output -------------------------------------------


def _framework_output(framework: str) -> tuple[Callable[[Any], Any], Any, Any]:
    """f of a Python float returning two numbers in ``framework``'s arrays; a cotangent in that
    framework; one in the other framework, which f's output is not in."""
    torch = _torch()
    require("jax")
    import jax
    import jax.numpy as jnp

    if framework == "torch":

        def f_torch(s: Any) -> Any:
            s = torch.as_tensor(s, dtype=torch.float64)
            return torch.stack([s, 2 * s**2])

        with jax.enable_x64(True):
            other = jnp.ones(2)
        return f_torch, torch.ones(2, dtype=torch.float64), other

    def f_jax(s: Any) -> Any:
        s = jnp.asarray(s)  # float64: finite differences of a float x run in a scoped x64
        return jnp.stack([s, 2 * s**2])

    with jax.enable_x64(True):
        cotangent = jnp.ones(2)
    return f_jax, cotangent, torch.ones(2, dtype=torch.float64)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("backend_id", ["finite_differences", "scipy"])
def test_the_cotangent_is_checked_against_f_output(backend_id: str, framework: str) -> None:
    backend = require(backend_id)
    f, cotangent, other = _framework_output(framework)
    rtol, atol = tolerance(backend_id, np.float64)
    for _ in range(2):  # preparing, then from the cache of preparations
        result = di.vjp(f, backend, 1.5, cotangent)
        assert type(result) is float  # mirrors x
        np.testing.assert_allclose(result, 1 + 4 * 1.5, rtol=rtol, atol=atol)
    # a cotangent of a framework f(x) is not in is refused, naming f(x)'s
    with pytest.raises(di.ArrayTypeError) as info:
        di.vjp(f, backend, 1.5, other)
    assert f"f(x) holds {framework} arrays" in str(info.value)


# -- an output whose shape follows x's values ----------------------------------------------------


def _positive_part(v: Any) -> Any:
    return v[v > 0] * 2.0


@pytest.mark.parametrize("backend_id", ["torch-autograd", "torch-func", "autograd", "finite_differences", "scipy"])
def test_an_output_that_changes_shape_is_recorded_again(backend_id: str) -> None:
    """An output of one array seen before skips its checks and record, but only where its
    shape is the recorded one: f(x) = x[x > 0] under one prep, x's signs changing between
    calls, gets its cotangent checked against each call's own f(x) and the jvp of each call's
    shape. (jax's compiled programs trace f, which cannot index by values.)"""
    backend = require(backend_id)
    if backend_id.startswith("torch"):
        torch = _torch()
        positive, mixed = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, -2.0, 3.0, -4.0])
        ones: Callable[[int], Any] = torch.ones
    else:
        positive, mixed = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, -2.0, 3.0, -4.0])
        ones = np.ones
    rtol, atol = tolerance(backend_id, np.float64 if not backend_id.startswith("torch") else np.float32)
    prep = di.prepare_vjp(_positive_part, backend, positive, ones(4))
    for _ in range(2):  # the second call: the output seen before
        np.testing.assert_allclose(to_numpy(di.vjp(_positive_part, backend, positive, ones(4), prep=prep)), 2.0)
    with pytest.raises(di.TangentMismatchError, match="shape"):  # f(x) has 2 entries now
        di.vjp(_positive_part, backend, mixed, ones(4), prep=prep)
    two = di.prepare_vjp(_positive_part, backend, mixed, ones(2))
    for _ in range(2):
        found = di.vjp(_positive_part, backend, mixed, ones(2), prep=two)
        np.testing.assert_allclose(to_numpy(found), [2.0, 0.0, 2.0, 0.0], rtol=rtol, atol=atol)
    with pytest.raises(di.TangentMismatchError, match="shape"):  # and 4 again
        di.vjp(_positive_part, backend, positive, ones(2), prep=two)
    jprep = di.prepare_jvp(_positive_part, backend, positive, ones(4))
    for x, want in ((positive, [2.0] * 4), (mixed, [2.0, 2.0]), (positive, [2.0] * 4)):
        np.testing.assert_allclose(
            to_numpy(di.jvp(_positive_part, backend, x, ones(4), prep=jprep)), want, rtol=rtol, atol=atol
        )


def test_a_repeated_one_array_output_skips_its_checks() -> None:
    """The cheap path is taken (the output's checks not entered again) for a torch vjp of one
    array of the recorded shape, and left where the shape changes."""
    import sys

    torch = _torch()
    entered: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.replace("\\", "/").endswith("diffiface/_checks.py"):
            entered.append(frame.f_code.co_name)

    def checks(x: Any, t: Any) -> list[str]:
        entered.clear()
        sys.setprofile(profile)
        try:
            di.vjp(_positive_part, "torch", x, t, prep=prep)
        finally:
            sys.setprofile(None)
        return list(entered)

    x, t = torch.tensor([1.0, 2.0, 3.0]), torch.ones(3)
    prep = di.prepare_vjp(_positive_part, "torch", x, t)
    di.vjp(_positive_part, "torch", x, t, prep=prep)
    assert "_checked" not in checks(x, t)
    with pytest.raises(di.TangentMismatchError):
        checks(torch.tensor([1.0, -2.0, 3.0]), t)
    assert "_checked" in entered


def _traced_and_constant(v: Any, k: Any) -> Any:
    xp = namespace(v)
    return {"traced": xp.sin(v) * k, "constant": k * 2.0}


def _traced_and_cut(v: Any, k: Any) -> Any:
    xp = namespace(v)
    if type(v).__module__.startswith("torch"):
        untraced = v.detach()
    else:
        from autograd.tracer import getval

        untraced = getval(v)
    return {"traced": xp.sin(v) * k, "cut": k * untraced.sum()}


@pytest.mark.parametrize("op", ["vjp", "jvp", "jacobian"])
@pytest.mark.parametrize("backend_id", ["torch-autograd", "torch-func", "autograd", "jax"])
def test_an_output_leaf_that_does_not_depend_on_x_beside_one_that_does(backend_id: str, op: str) -> None:
    """An output leaf the engine does not trace, beside one it does: served where that leaf does
    not change with x (its derivative is zero), refused where it does (f cut the trace), as a
    scalar output is. (A constant leaf was refused because the traced one changed.)"""
    backend = require(backend_id)
    x, k = np.array([0.3, -1.2, 2.0]), np.array([1.5, 2.0, -0.5])
    if backend_id.startswith("torch"):
        torch = _torch()
        x, k = torch.tensor(x), torch.tensor(k)
        ones: Callable[[int], Any] = lambda n: torch.ones(n, dtype=torch.float64)  # noqa: E731
    else:
        ones = np.ones
    cotangent = {"traced": ones(3), "constant": ones(3)}
    calls = {
        "vjp": lambda f: di.vjp(f, backend, x, dict(cotangent), di.Constant(k)),
        "jvp": lambda f: di.jvp(f, backend, x, ones(3), di.Constant(k)),
        "jacobian": lambda f: di.jacobian(f, backend, x, di.Constant(k)),
    }
    xs, ks = to_numpy(x), to_numpy(k)
    got = calls[op](_traced_and_constant)
    expected = {
        "vjp": np.cos(xs) * ks,
        "jvp": {"traced": np.cos(xs) * ks, "constant": np.zeros(3)},
        "jacobian": {"traced": np.diag(np.cos(xs) * ks), "constant": np.zeros((3, 3))},
    }[op]
    if op == "vjp":
        np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-12)
    else:
        for name in ("traced", "constant"):
            np.testing.assert_allclose(to_numpy(got[name]), expected[name], rtol=1e-12)  # type: ignore[index]
    # (jax's trace has no untraced copy of x to take; torch.func's forward mode wraps every
    # tensor made inside alike, so that a detached one cannot be told apart: its product is
    # torch.func.jvp's own zero)
    if backend_id != "jax" and (backend_id, op) != ("torch-func", "jvp"):
        cotangent = {"traced": ones(3), "cut": ones(3)}
        with pytest.raises(di.InvalidOutputError, match="not through the"):
            calls[op](_traced_and_cut)


def _scaled_sine(v: Any, c: Any) -> Any:
    return namespace(v).sin(v) * c


@pytest.mark.parametrize("op", ["jvp", "vjp"])
def test_a_one_array_tangent_is_tested_as_x_is(backend_id: str, backend: di.Backend, op: str) -> None:
    """One array x, tangent and context: the plan's one-leaf test covers the tangent too (no
    list of leaves built), and a tangent of another shape, dtype or type still misses the plan:
    a strict prep refuses it, a prep that is not strict answers it with its own, right."""
    x, c, t = (native_tree(backend_id, np.array(a), "float64") for a in ([-1, 0.2, 1], [1.5, -2, 0.5], [1, 2, 3]))
    prepare, call = (di.prepare_jvp, di.jvp) if op == "jvp" else (di.prepare_vjp, di.vjp)
    prep = prepare(_scaled_sine, backend, x, t, di.Constant(c))
    assert prep.plan.single is not None and prep.plan.single[1] is not None
    rtol, atol = tolerance(backend_id, np.float64)
    want = np.cos(to_numpy(x)) * to_numpy(c) * to_numpy(t)
    for _ in range(2):
        np.testing.assert_allclose(
            to_numpy(call(_scaled_sine, backend, x, t, di.Constant(c), prep=prep)), want, rtol, atol
        )
    others = [
        native_tree(backend_id, np.ones(4), "float64"),  # another shape
        native_tree(backend_id, np.ones(3), "float16"),  # another dtype
        np.ones(3) if backend_id in ("jax", "torch-autograd", "torch-func") else [1.0, 1.0, 1.0],  # another type
    ]
    for other in others:
        with pytest.raises((di.PreparationMismatchError, di.TangentMismatchError)):
            call(_scaled_sine, backend, x, other, di.Constant(c), prep=prep)
    loose = prepare(_scaled_sine, backend, x, t, di.Constant(c), strict=False)
    x, c, t = (native_tree(backend_id, np.array(a), "float32") for a in ([0.5, 1, 2], [1, 2, 3], [3, -1, 2]))
    found = to_numpy(call(_scaled_sine, backend, x, t, di.Constant(c), prep=loose))
    want = np.cos(to_numpy(x)) * to_numpy(c) * to_numpy(t)
    np.testing.assert_allclose(found, want, rtol=1e-3, atol=1e-3)  # (float32 finite differences)
