"""The adversarial corpus: f written the way real users write it, checked against the contract.

For everything a user can write, diffiface gives the right derivative (checked here against an
analytic derivative written by hand) or raises a ``DiffifaceError`` subclass: never zeros, never a
stale value, never a raw engine error, never a change to the caller's data, never a change to
process-wide state. Each case writes its expected outcome before it runs; :func:`check_case`
(tests/_adversarial_helpers.py) runs it and checks the inputs, and an autouse fixture checks the
process-wide state (torch grad / inference mode, default dtype, forward-AD levels, jax's x64 flag).

Classes of cases, in order: 1 in-place f, 2 nesting, 3 call-site grad modes, 4 mutable contexts
under jit, 5 SecondOrder pairings, 6 non-finite values and options, 7 foreign arrays and misleading
errors, 8 dtype rules.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from _adversarial_helpers import (
    BACKENDS,
    BLACK_BOX_IDS,
    FD_IDS,
    RIGHT,
    RIGHT_OR_ERROR,
    RIGHT_OR_MUTATION,
    Snapshot,
    as_input,
    assert_says_what,
    check_case,
    d2h,
    dh,
    framework,
    h,
    need,
    need_module,
    process_state_unchanged,
    tolerance,
    total,
    xp_of,
)

import diffiface as di
from diffiface.test import default_tolerances

__all__ = ["process_state_unchanged"]  # the autouse fixture, imported so that pytest finds it

X0 = np.array([0.3, -0.7, 1.1])
T0 = np.array([0.5, -1.0, 2.0])


# == 1. in-place f ================================================================================


@dataclass(frozen=True)
class Write:
    """A way f writes in place. ``run(xp, x)`` does the write and returns what f computes with
    next; on a private copy, f computes ``h(d * x + c)`` scaled by ``k`` (the analytic model)."""

    name: str
    frameworks: tuple[str, ...]
    d: tuple[float, float, float] = (1.0, 1.0, 1.0)
    c: tuple[float, float, float] = (0.0, 0.0, 0.0)
    k: tuple[float, float, float] = (1.0, 1.0, 1.0)
    context: str | None = None  # "constant" or "cache": f takes a context it writes into


def _imul(x: Any) -> Any:
    x *= 2  # in place on numpy and torch; a rebinding on jax arrays and autograd's boxes
    return x


def _setitem(x: Any) -> Any:
    x[..., 0] = 0.0
    return x


def _np_add_out(x: Any) -> Any:
    np.add(x, 1.0, out=x)
    return x


def _mul_(x: Any) -> Any:
    x.mul_(2)
    return x


def _add_(x: Any) -> Any:
    x.add_(1.0)
    return x


def _tangent_write(x: Any) -> Any:
    import torch.autograd.forward_ad as fwad

    tangent = fwad.unpack_dual(x).tangent
    if tangent is not None:
        tangent.mul_(0)  # f writes into the tangent the engine gave it
    return x


def _unused(x: Any) -> Any:
    return x  # the context cases write into the context, not into x


WRITES: dict[str, tuple[Write, Callable[[Any], Any]]] = {
    "imul": (Write("imul", ("jax", "torch", "autograd", "numpy"), d=(2.0, 2.0, 2.0)), _imul),
    "setitem": (Write("setitem", ("torch", "autograd", "numpy"), d=(0.0, 1.0, 1.0)), _setitem),
    "np-add-out": (Write("np-add-out", ("numpy",), c=(1.0, 1.0, 1.0)), _np_add_out),
    "mul_": (Write("mul_", ("torch",), d=(2.0, 2.0, 2.0)), _mul_),
    "add_": (Write("add_", ("torch",), c=(1.0, 1.0, 1.0)), _add_),
    "tangent-write": (Write("tangent-write", ("torch",)), _tangent_write),
    # the Constant holds [1.5, 2, 3]; f sets its first entry to 5
    "constant-write": (
        Write("constant-write", ("torch", "autograd", "numpy"), k=(5.0, 2.0, 3.0), context="constant"),
        _unused,
    ),
    # the Cache may be overwritten: f fills it with 2 and uses it
    "cache-write": (Write("cache-write", ("torch", "autograd", "numpy"), k=(2.0, 2.0, 2.0), context="cache"), _unused),
}

OPERATORS = ("gradient", "jacobian", "jvp", "vjp", "hvp", "hessian")
SCALAR_OPS = ("gradient", "hvp", "hessian")


def _in_place_expectation(backend_id: str, write: Write) -> Any:
    fw = framework(backend_id)
    if write.name == "cache-write":
        if backend_id == "torch-func":
            # torch.func refuses, before anything is written, every in-place write into a tensor
            # that f closes over: refused with the reason and the mode that takes it
            return di.MutationError
        return RIGHT  # a Cache is scratch space f may overwrite
    if write.name == "imul" and fw in ("jax", "autograd"):
        return RIGHT  # `x *= 2` rebinds an immutable array: no write happens
    return RIGHT_OR_MUTATION  # a private copy gives the right answer; otherwise MutationError


def _in_place_params() -> list[Any]:
    params = []
    for backend_id in BACKENDS:
        fw = framework(backend_id)
        for write_name, (write, _) in WRITES.items():
            if fw not in write.frameworks:
                continue  # e.g. jax arrays cannot be written in place: not generated
            for op in OPERATORS:
                params.append(pytest.param(backend_id, write_name, op, id=f"{backend_id}-{write_name}-{op}"))
    return params


def _analytic(op: str, x: np.ndarray, t: np.ndarray, write: Write) -> np.ndarray:
    d, c, k = np.array(write.d), np.array(write.c), np.array(write.k)
    u = d * x + c
    first = k * d * dh(u)
    second = k * d * d * d2h(u)
    return {
        "gradient": first,
        "jacobian": np.diag(first),
        "jvp": first * t,
        "vjp": first * t,
        "hvp": second * t,
        "hessian": np.diag(second),
    }[op]


@pytest.mark.parametrize(("backend_id", "write_name", "op"), _in_place_params())
def test_in_place_f(backend_id: str, write_name: str, op: str) -> None:
    need(backend_id)
    backend = BACKENDS[backend_id]
    write, run = WRITES[write_name]
    fw = framework(backend_id)
    xp = xp_of(fw)
    expect = _in_place_expectation(backend_id, write)
    scalar = op in SCALAR_OPS

    def out(v: Any) -> Any:
        return total(v) if scalar else v

    contexts: tuple[Any, ...] = ()
    raw_context: Any = None
    if write.context is None:

        def f(x: Any) -> Any:
            return out(h(xp, run(x)))

    else:
        raw_context = np.array([1.5, 2.0, 3.0]) if write.context == "constant" else np.zeros(3)
        contexts = (di.Constant(raw_context) if write.context == "constant" else di.Cache(raw_context),)

        def f(x: Any, c: Any) -> Any:
            if write.context == "constant":
                c[..., 0] = 5.0  # f writes into the Constant's numpy array (or its converted copy)
            else:
                c[...] = 2.0
            return out(c * h(xp, x))

    x = as_input(X0, fw)
    t = as_input(T0, fw)
    if op in ("jvp", "vjp", "hvp"):
        call = lambda: getattr(di, op)(f, backend, x, t, *contexts)  # noqa: E731
        inputs: tuple[Any, ...] = (x, t)
    else:
        call = lambda: getattr(di, op)(f, backend, x, *contexts)  # noqa: E731
        inputs = (x,)
    if write.context == "constant":
        inputs = (*inputs, raw_context)  # a Cache may change; a Constant may not
    expected = _analytic(op, X0, T0, write)
    check_case(call, expect, expected, inputs=inputs, **tolerance(backend_id, second_order=op in ("hvp", "hessian")))


# == 2. nesting ===================================================================================

NEST_IDS = ("jax", "torch-autograd", "torch-func", "autograd", "fd-central")
NEST_SCENARIOS = ("jacobian-of-gradient", "gradient-penalty", "maml-step", "hvp-via-jvp-of-gradient")
LR = 0.1


def _nest_expectation(outer: str, inner: str) -> Any:
    if outer == inner and outer != "fd-central":
        return RIGHT  # the same engine traces through itself
    if outer == "fd-central":
        return RIGHT  # a black box only evaluates the inner call
    return RIGHT_OR_ERROR


@pytest.mark.parametrize("scenario", NEST_SCENARIOS)
@pytest.mark.parametrize("inner", NEST_IDS)
@pytest.mark.parametrize("outer", NEST_IDS)
def test_nesting(outer: str, inner: str, scenario: str) -> None:
    need(outer, inner)
    ob, ib = BACKENDS[outer], BACKENDS[inner]
    ixp = xp_of(framework(inner))
    expect = _nest_expectation(outer, inner)

    def f_inner(v: Any) -> Any:
        return total(h(ixp, v))

    def inner_grad(v: Any) -> Any:
        return di.gradient(f_inner, ib, v)

    x = as_input(X0, framework(outer))
    t = as_input(T0, framework(outer))
    if scenario == "jacobian-of-gradient":
        call = lambda: di.jacobian(inner_grad, ob, x)  # noqa: E731
        expected: Any = np.diag(d2h(X0))
    elif scenario == "gradient-penalty":
        call = lambda: di.gradient(lambda v: total(inner_grad(v) ** 2), ob, x)  # noqa: E731
        expected = 2 * dh(X0) * d2h(X0)
    elif scenario == "maml-step":

        def adapted_loss(w: Any) -> Any:
            return f_outer_loss(w - LR * inner_grad(w))

        oxp = xp_of(framework(outer))

        def f_outer_loss(w: Any) -> Any:
            return total(h(oxp, w))

        call = lambda: di.gradient(adapted_loss, ob, x)  # noqa: E731
        expected = dh(X0 - LR * dh(X0)) * (1 - LR * d2h(X0))
    else:
        call = lambda: di.jvp(inner_grad, ob, x, t)  # noqa: E731
        expected = d2h(X0) * T0
    check_case(call, expect, expected, inputs=(x, t), **tolerance(outer, inner, second_order=True))


# == 3. call-site grad modes ======================================================================

GRAD_MODES = ("no_grad", "inference_mode", "set_grad_enabled_false")


def _torch_case(op: str, backend_id: str) -> tuple[Callable[[Any], Any], Any, Any, np.ndarray]:
    import torch

    backend = BACKENDS[backend_id]
    x = torch.tensor(X0)
    t = torch.tensor(T0)
    if op == "gradient":
        return (lambda x_: di.gradient(lambda v: total(h(torch, v)), backend, x_)), x, t, dh(X0)
    if op == "jacobian":
        return (lambda x_: di.jacobian(lambda v: h(torch, v), backend, x_)), x, t, np.diag(dh(X0))
    if op == "jvp":
        return (lambda x_: di.jvp(lambda v: h(torch, v), backend, x_, t)), x, t, dh(X0) * T0
    return (lambda x_: di.hvp(lambda v: total(h(torch, v)), backend, x_, t)), x, t, d2h(X0) * T0


@pytest.mark.parametrize("op", ["gradient", "jacobian", "jvp", "hvp"])
@pytest.mark.parametrize("backend_id", ["torch-autograd", "torch-func"])
@pytest.mark.parametrize("grad_mode", GRAD_MODES)
def test_call_site_grad_mode(grad_mode: str, backend_id: str, op: str) -> None:
    need(backend_id)
    import torch

    expect = RIGHT
    run, x, t, expected = _torch_case(op, backend_id)
    tol = tolerance(backend_id)
    if grad_mode == "no_grad":
        with torch.no_grad():
            check_case(lambda: run(x), expect, expected, inputs=(x, t), **tol)
            assert not torch.is_grad_enabled(), "the caller's no_grad was not restored"
    elif grad_mode == "inference_mode":
        with torch.inference_mode():
            check_case(lambda: run(x), expect, expected, inputs=(x, t), **tol)
            assert torch.is_inference_mode_enabled(), "the caller's inference_mode was not restored"
    else:
        previous = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        try:
            check_case(lambda: run(x), expect, expected, inputs=(x, t), **tol)
            assert not torch.is_grad_enabled(), "the caller's set_grad_enabled(False) was not restored"
        finally:
            torch.set_grad_enabled(previous)


@pytest.mark.parametrize("op", ["gradient", "jacobian", "jvp", "hvp"])
@pytest.mark.parametrize("backend_id", ["torch-autograd", "torch-func"])
def test_inference_tensor_as_x(backend_id: str, op: str) -> None:
    need(backend_id)
    import torch

    expect = RIGHT_OR_ERROR  # an inference tensor cannot be recorded: a copy, or a clear error
    run, _, t, expected = _torch_case(op, backend_id)
    with torch.inference_mode():
        x = torch.tensor(X0)
    assert x.is_inference()
    check_case(lambda: run(x), expect, expected, inputs=(x, t), **tolerance(backend_id))


# == 4. mutable and unhashable contexts under jit =================================================


class _Holder:
    def __init__(self, a: float) -> None:
        self.a = a


def _jax_grad_scaled(scale: float) -> np.ndarray:
    return scale * dh(X0)


RIGHT_OR_CONTEXT = "right or ContextError"


def _check_context_case(call: Callable[[], Any], expected: np.ndarray, inputs: tuple[Any, ...]) -> None:
    """A changed context: the right (new) value, or a ContextError saying it cannot be static."""
    snapshot = Snapshot(*inputs)
    try:
        result = call()
    except di.ContextError as error:
        snapshot.assert_unchanged()
        assert_says_what(error, "static", "context")
        return
    except Exception as error:
        snapshot.assert_unchanged()
        raise AssertionError(f"expected {RIGHT_OR_CONTEXT}, got {type(error).__name__}: {error}") from error
    snapshot.assert_unchanged()
    np.testing.assert_allclose(np.asarray(result), expected, rtol=1e-6, atol=1e-9)


def _mutable_contexts() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None], Callable[[Any], float]]]:
    """name -> (make the context value, change it in place, read the scale inside f)."""

    def set_attr(o: Any) -> None:
        o.a = 3.0

    def set_key(d: Any) -> None:
        d["a"] = 3.0

    def set_item(lst: Any) -> None:
        lst[0] = 3.0

    def set_nested_array(d: Any) -> None:
        d["layer"]["w"] = np.array([3.0])

    def write_nested_array(d: Any) -> None:
        d["layer"]["w"][0] = 3.0

    return {
        "object-attribute": (lambda: _Holder(2.0), set_attr, lambda c: c.a),
        "dict-of-floats": (lambda: {"a": 2.0}, set_key, lambda c: c["a"]),
        "list-of-floats": (lambda: [2.0, 1.0], set_item, lambda c: c[0]),
        "nested-dict-new-array": (
            lambda: {"layer": {"w": np.array([2.0])}},
            set_nested_array,
            lambda c: c["layer"]["w"][0],
        ),
        "nested-dict-written-array": (
            lambda: {"layer": {"w": np.array([2.0])}},
            write_nested_array,
            lambda c: c["layer"]["w"][0],
        ),
    }


@pytest.mark.parametrize("prepared", [False, True], ids=("unprepared", "prepared"))
@pytest.mark.parametrize("kind", list(_mutable_contexts()))
def test_mutable_context_under_jit(kind: str, prepared: bool) -> None:
    need("jax")
    import jax.numpy as jnp

    make, change, read = _mutable_contexts()[kind]
    backend = di.AutoJAX()

    def f(x: Any, c: Any) -> Any:
        return read(c) * total(h(jnp, x))

    value = make()
    x = np.array(X0)
    # A context that cannot be compared between calls may be refused from the start (the
    # contract: "hashed by value, or refused with a message"): then there is nothing more to check.
    snapshot = Snapshot(x)
    try:
        prep = di.prepare_gradient(f, backend, x, di.Constant(value)) if prepared else None
        kwargs = {"prep": prep} if prepared else {}
        first = di.gradient(f, backend, x, di.Constant(value), **kwargs)
    except di.ContextError as error:
        snapshot.assert_unchanged()
        assert_says_what(error, "static", "context")
        return
    snapshot.assert_unchanged()
    np.testing.assert_allclose(np.asarray(first), _jax_grad_scaled(2.0), rtol=1e-6, atol=1e-9)
    change(value)
    _check_context_case(lambda: di.gradient(f, backend, x, di.Constant(value), **kwargs), _jax_grad_scaled(3.0), (x,))


def test_python_float_context_changing_every_call() -> None:
    need("jax")
    import jax.numpy as jnp

    from diffiface._prep import prep_cache

    backend = di.AutoJAX()

    def f(x: Any, s: Any) -> Any:
        return s * total(h(jnp, x))

    x = np.array(X0)
    before = len(prep_cache)
    expect = RIGHT
    for i in range(20):
        scale = 1.0 + 0.137 * i
        check_case(
            lambda s=scale: di.gradient(f, backend, x, di.Constant(s)), expect, _jax_grad_scaled(scale), inputs=(x,)
        )
    assert len(prep_cache) - before <= 4, f"the prep cache grew by {len(prep_cache) - before} for one f"


def test_nnx_state_updated_in_place() -> None:
    need("jax")
    need_module("flax")
    import jax.numpy as jnp
    from flax import nnx

    class Scale(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jnp.array(2.0, dtype=jnp.float32))

    state = nnx.state(Scale())
    x = X0.astype(np.float32)

    def f(v: Any, s: Any) -> Any:
        return s["w"][...] * total(h(jnp, v))

    backend = di.AutoJAX()
    expected2 = (2.0 * dh(X0.astype(np.float64))).astype(np.float32)
    rtol, atol = default_tolerances("float32")
    check_case(
        lambda: di.gradient(f, backend, x, di.Constant(state)), RIGHT, expected2, inputs=(x,), rtol=rtol, atol=atol
    )
    state["w"][...] = jnp.array(3.0, dtype=jnp.float32)
    snapshot = Snapshot(x)
    try:
        result = di.gradient(f, backend, x, di.Constant(state))
    except di.ContextError:
        snapshot.assert_unchanged()
        return
    snapshot.assert_unchanged()
    np.testing.assert_allclose(np.asarray(result), 3.0 * dh(X0), rtol=rtol, atol=atol)


def test_equinox_module_field_changes() -> None:
    need("jax")
    need_module("equinox")
    import equinox as eqx
    import jax.numpy as jnp

    class Model(eqx.Module):
        scale: float
        shift: Any

    def f(v: Any, m: Any) -> Any:
        return m.scale * total(h(jnp, v + m.shift))

    backend = di.AutoJAX()
    x = np.array(X0)
    expect = RIGHT
    for scale, shift in ((2.0, 0.0), (3.0, 0.5), (2.0, 0.0)):
        model = Model(scale, np.array(shift))
        check_case(
            lambda m=model: di.gradient(f, backend, x, di.Constant(m)), expect, scale * dh(X0 + shift), inputs=(x,)
        )


def test_threads_share_a_prep_with_their_own_contexts() -> None:
    need("jax")
    import jax.numpy as jnp

    backend = di.AutoJAX()

    def f(x: Any, s: Any) -> Any:
        return s["a"] * total(h(jnp, x))

    x = np.array(X0)
    prep = di.prepare_gradient(f, backend, x, di.Constant({"a": 1.0}))
    failures: list[str] = []

    def work(scale: float) -> None:
        for _ in range(15):
            try:
                got = np.asarray(di.gradient(f, backend, x, di.Constant({"a": scale}), prep=prep))
                if not np.allclose(got, scale * dh(X0), rtol=1e-6, atol=1e-9):
                    failures.append(f"scale {scale}: got {got}")
            except di.ContextError:
                pass  # refusing a context that cannot be static is allowed
            except Exception as error:
                failures.append(f"scale {scale}: {type(error).__name__}: {error}")

    snapshot = Snapshot(x)
    threads = [threading.Thread(target=work, args=(s,)) for s in (2.0, 5.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snapshot.assert_unchanged()
    assert not failures, failures[:4]


def test_output_structure_depends_on_context() -> None:
    need("jax")
    import jax.numpy as jnp

    backend = di.AutoJAX()

    def f(x: Any, c: Any) -> Any:
        y = h(jnp, x)
        return (y, 2 * y) if c["kind"] == "tuple" else {"a": y, "b": 3 * y}

    x = np.array(X0)
    jac = np.diag(dh(X0))
    expect = RIGHT
    for kind in ("tuple", "dict", "tuple"):
        expected = (jac, 2 * jac) if kind == "tuple" else {"a": jac, "b": 3 * jac}
        check_case(lambda k=kind: di.jacobian(f, backend, x, di.Constant({"kind": k})), expect, expected, inputs=(x,))


# == 5. SecondOrder pairings =====================================================================

PAIR_IDS = ("jax", "torch-autograd", "torch-func", "autograd", *FD_IDS, "scipy")
PAIR_IDS_FULL = (*PAIR_IDS, "fd-forward-vectorize", "fd-backward-vectorize", "fd-complex-vectorize")
PAIR_BACKENDS = {
    **BACKENDS,
    "fd-forward-vectorize": di.AutoFiniteDifferences(method="forward", vectorize=True),
    "fd-backward-vectorize": di.AutoFiniteDifferences(method="backward", vectorize=True),
    "fd-complex-vectorize": di.AutoFiniteDifferences(method="complex", vectorize=True),
}


def _fw_of_pair_id(pid: str) -> str:
    return framework(pid) if pid in BACKENDS else "numpy"


def _pairings() -> list[Any]:
    """Every outer (vectorised or not) over every inner on hessian and hvp; the inners'
    vectorised forward/backward/complex variants are left out (an inner gradient evaluates f
    the same way whatever its batching), and second_derivative runs the unvectorised outers:
    the corpus must run in 90 s on one core."""
    params = []
    for op in ("hessian", "hvp", "second_derivative"):
        outers = PAIR_IDS if op == "second_derivative" else PAIR_IDS_FULL
        for outer in outers:
            for inner in PAIR_IDS:
                params.append(pytest.param(outer, inner, op, id=f"{outer}-over-{inner}-{op}"))
    return params


@pytest.mark.parametrize(("outer", "inner", "op"), _pairings())
def test_second_order_pairing(outer: str, inner: str, op: str) -> None:
    ob, ib = PAIR_BACKENDS[outer], PAIR_BACKENDS[inner]
    need(ob, ib)
    try:
        backend = di.SecondOrder(ob, ib)
    except di.UnsupportedOperationError as error:
        assert_says_what(error)
        return  # refusing the pairing at construction is allowed
    expect = RIGHT  # constructed: the results must be right
    fw = _fw_of_pair_id(inner)
    xp = xp_of(fw)
    x = as_input(X0[:2], fw)
    t = as_input(T0[:2], fw)
    tol = tolerance(outer, inner, second_order=True)
    if op == "hessian":
        call = lambda: di.hessian(lambda v: total(h(xp, v)), backend, x)  # noqa: E731
        check_case(call, expect, np.diag(d2h(X0[:2])), inputs=(x,), **tol)
    elif op == "hvp":
        call = lambda: di.hvp(lambda v: total(h(xp, v)), backend, x, t)  # noqa: E731
        check_case(call, expect, d2h(X0[:2]) * T0[:2], inputs=(x, t), **tol)
    else:
        call = lambda: di.second_derivative(lambda v: h(xp, v), backend, 0.7)  # noqa: E731
        check_case(call, expect, d2h(np.array(0.7)), **tol)


# == 6. non-finite values and options ==========================================================


@pytest.mark.parametrize("backend_id", BLACK_BOX_IDS)
def test_fd_jvp_along_infinite_tangent(backend_id: str) -> None:
    need(backend_id)
    backend = BACKENDS[backend_id]
    x = np.array(X0)
    t = np.array([np.inf, 0.0, 0.0])
    # AD's pattern (jax.jvp of the same function): the first entry is inf or nan, the rest finite
    # (the Jacobian is diagonal), e.g. jax gives [inf, 0, 0] here.
    expected_nonfinite = np.array([True, False, False])

    def check(result: Any) -> None:
        got = np.asarray(result)
        assert np.array_equal(~np.isfinite(got), expected_nonfinite), f"non-finite pattern of {got}"
        assert not np.all(got == 0), f"an infinite tangent gave zeros: {got}"

    check_case(lambda: di.jvp(lambda v: h(np, v), backend, x, t), RIGHT, check, inputs=(x, t))


def test_jax_jvp_along_infinite_tangent_is_the_reference() -> None:
    """The pattern assumed above, as jax itself gives it (the brief's reference)."""
    need("jax")
    import jax
    import jax.numpy as jnp

    _, out = jax.jvp(
        lambda v: h(jnp, v), (jnp.asarray(X0, dtype=jnp.float32),), (jnp.asarray([np.inf, 0, 0], dtype=jnp.float32),)
    )
    assert np.array_equal(~np.isfinite(np.asarray(out)), [True, False, False])


@pytest.mark.parametrize("op", ["gradient", "jvp"])
@pytest.mark.parametrize("backend_id", list(BACKENDS))
def test_nan_in_x_propagates(backend_id: str, op: str) -> None:
    need(backend_id)
    backend = BACKENDS[backend_id]
    fw = framework(backend_id)
    xp = xp_of(fw)
    x0 = np.array([np.nan, 0.5, 1.0])
    x = as_input(x0, fw)
    t = as_input(np.ones(3), fw)
    right = dh(x0)
    tol = tolerance(backend_id)

    def check(result: Any) -> None:
        got = np.asarray(result.detach().numpy() if hasattr(result, "detach") else result, dtype=np.float64)
        assert np.isnan(got[0]), f"the NaN at x[0] was masked: {got}"
        for i in (1, 2):
            if op == "jvp":  # elementwise: the other entries do not see the NaN
                np.testing.assert_allclose(got[i], right[i], **tol)
            else:  # a sum: a black box may see the NaN in every difference; never a 0
                assert np.isnan(got[i]) or np.isclose(got[i], right[i], **tol), f"entry {i}: {got}"

    def quiet_h(v: Any) -> Any:
        with warnings.catch_warnings():  # numpy warns on sin(nan + ih) (complex step): f's own
            warnings.simplefilter("ignore", RuntimeWarning)  # warning, an exception under -W error
            return h(xp, v)

    if op == "gradient":
        call = lambda: di.gradient(lambda v: total(quiet_h(v)), backend, x)  # noqa: E731
        check_case(call, RIGHT, check, inputs=(x,))
    else:
        call = lambda: di.jvp(quiet_h, backend, x, t)  # noqa: E731
        check_case(call, RIGHT, check, inputs=(x, t))


BAD_OPTIONS: dict[str, Callable[[], di.Backend]] = {
    "fd-step-1e-300": lambda: di.AutoFiniteDifferences(step=1e-300),
    "fd-step-nan": lambda: di.AutoFiniteDifferences(step=float("nan")),
    "scipy-initial_step-inf": lambda: di.AutoScipy(initial_step=float("inf")),
    "scipy-atol-negative": lambda: di.AutoScipy(atol=-1),
    "scipy-rtol-negative": lambda: di.AutoScipy(rtol=-1),
    "scipy-atol-nan": lambda: di.AutoScipy(atol=float("nan")),
    "scipy-step_factor-1": lambda: di.AutoScipy(step_factor=1.0),
}


@pytest.mark.parametrize("name", list(BAD_OPTIONS))
def test_bad_backend_option(name: str) -> None:
    """Refused when made (InvalidBackendOptionError); for step=1e-300, which is a valid float
    whose steps vanish beside x, a DiffifaceError at call time is allowed too. Never a zero or
    NaN result."""
    try:
        backend = BAD_OPTIONS[name]()
    except di.InvalidBackendOptionError as error:
        assert_says_what(error)
        return
    need(backend)
    if name != "fd-step-1e-300":
        raise AssertionError(f"{name}: the backend was accepted; expected InvalidBackendOptionError")
    x = np.array(X0)
    check_case(lambda: di.gradient(lambda v: total(h(np, v)), backend, x), di.DiffifaceError, inputs=(x,))


# == 7. foreign array kinds and misleading errors ==============================================


@pytest.mark.parametrize("backend_id", list(BACKENDS))
def test_negative_stride_numpy_x(backend_id: str) -> None:
    need(backend_id)
    xp = xp_of(framework(backend_id))
    x = (np.arange(5.0) * 0.3)[::-1]
    assert x.strides[0] < 0
    check_case(
        lambda: di.gradient(lambda v: total(h(xp, v)), BACKENDS[backend_id], x),
        RIGHT,
        dh(np.arange(5.0)[::-1] * 0.3),
        inputs=(x,),
        **tolerance(backend_id),
    )


@pytest.mark.parametrize("backend_id", list(BACKENDS))
def test_memmap_x(backend_id: str, tmp_path: Any) -> None:
    need(backend_id)
    xp = xp_of(framework(backend_id))
    x = np.memmap(tmp_path / "x.dat", dtype=np.float64, mode="w+", shape=(3,))
    x[:] = X0
    x.flush()
    check_case(
        lambda: di.gradient(lambda v: total(h(xp, v)), BACKENDS[backend_id], x),
        RIGHT,
        dh(X0),
        inputs=(x,),
        **tolerance(backend_id),
    )


@pytest.mark.parametrize("backend_id", ["torch-autograd", "torch-func", "fd-central"])
def test_torch_meta_tensor_x(backend_id: str) -> None:
    need(backend_id)
    import torch

    x = torch.empty(3, dtype=torch.float64, device="meta")

    def check(result: Any) -> None:  # a meta result can only be checked for its kind and shape
        assert isinstance(result, torch.Tensor) and result.is_meta, f"got {result!r}"
        assert result.shape == (3,) and result.dtype == torch.float64

    check_case(
        lambda: di.gradient(lambda v: total(h(torch, v)), BACKENDS[backend_id], x), RIGHT_OR_ERROR, check, inputs=(x,)
    )


@pytest.mark.parametrize("op", ["jvp", "hvp"])
@pytest.mark.parametrize("backend_id", ["torch-autograd", "torch-func", "jax"])
def test_tangent_from_another_framework(backend_id: str, op: str) -> None:
    need(backend_id, "jax", "torch-autograd")
    import jax.numpy as jnp
    import torch

    fw = framework(backend_id)
    xp = xp_of(fw)
    x = as_input(X0, fw)
    t = jnp.asarray(T0, dtype=jnp.float32) if fw == "torch" else torch.tensor(T0)
    backend = BACKENDS[backend_id]
    expect = RIGHT_OR_ERROR  # converted, or an error naming the tangent's framework
    if op == "jvp":
        check_case(lambda: di.jvp(lambda v: h(xp, v), backend, x, t), expect, dh(X0) * T0, inputs=(x, t), rtol=1e-6)
    else:
        check_case(
            lambda: di.hvp(lambda v: total(h(xp, v)), backend, x, t), expect, d2h(X0) * T0, inputs=(x, t), rtol=1e-6
        )


class UserTypeError(TypeError):
    """f's own error; it must reach the caller as it is."""


@pytest.mark.parametrize("text", ["expected a Tensor, got a list", "my jax config is wrong"], ids=("Tensor", "jax"))
@pytest.mark.parametrize("backend_id", list(BACKENDS))
def test_f_own_type_error_propagates(backend_id: str, text: str) -> None:
    need(backend_id)
    fw = framework(backend_id)
    x = as_input(X0, fw)

    def f(v: Any) -> Any:
        raise UserTypeError(text)

    snapshot = Snapshot(x)
    with pytest.raises(TypeError) as info:
        di.gradient(f, BACKENDS[backend_id], x)
    snapshot.assert_unchanged()
    assert type(info.value) is UserTypeError, f"f's error was replaced by {type(info.value).__name__}: {info.value}"
    assert not isinstance(info.value, di.FrameworkMismatchError)


@pytest.mark.parametrize("backend_id", ["jax", "torch-autograd", "fd-central"])
def test_has_aux_on_gradient(backend_id: str) -> None:
    need(backend_id)
    fw = framework(backend_id)
    xp = xp_of(fw)
    x = as_input(X0, fw)
    check_case(
        lambda: di.gradient(lambda v: (total(h(xp, v)), 0.0), BACKENDS[backend_id], x, has_aux=True),
        di.InvalidInputError,
        inputs=(x,),
    )


@pytest.mark.parametrize("backend_id", ["jax", "torch-autograd", "fd-central"])
def test_prep_passed_positionally(backend_id: str) -> None:
    need(backend_id)
    fw = framework(backend_id)
    xp = xp_of(fw)
    x = as_input(X0, fw)
    backend = BACKENDS[backend_id]

    def f(v: Any) -> Any:
        return total(h(xp, v))

    prep = di.prepare_gradient(f, backend, x)
    error = check_case(lambda: di.gradient(f, backend, x, prep), di.ContextError, inputs=(x,))
    assert "prep=" in str(error), str(error)


@pytest.mark.parametrize("cut", ["float", "new-tensor"])
@pytest.mark.parametrize("backend_id", ["torch-autograd", "torch-func"])
def test_torch_graph_cut(backend_id: str, cut: str) -> None:
    need(backend_id)
    import torch

    x = torch.tensor(X0)

    def f(v: Any) -> Any:
        with warnings.catch_warnings():  # torch warns about float() of a tracked tensor; -W error
            warnings.simplefilter("ignore", UserWarning)  # would turn that into f's own exception
            value = float(total(h(torch, v)))
        return value if cut == "float" else torch.tensor(value, dtype=torch.float64)

    check_case(lambda: di.gradient(f, BACKENDS[backend_id], x), di.DiffifaceError, inputs=(x,))


# (not the complex step: it evaluates f at x + ih, whose real part never crosses a real
# boundary, and is documented for analytic f only; nothing at complex points can show the jump)
@pytest.mark.parametrize("backend_id", [b for b in BLACK_BOX_IDS if b != "fd-complex"])
def test_output_length_changes_between_evaluations(backend_id: str) -> None:
    need(backend_id)
    x = np.array([0.5, 0.5 + 1e-12, 0.9])  # perturbations cross the boundary x > 0.5 either way

    def f(v: Any) -> Any:
        kept = v[v.real > 0.5] if np.iscomplexobj(v) else v[v > 0.5]
        return kept.sum() * 0 + kept

    check_case(lambda: di.jacobian(f, BACKENDS[backend_id], x), di.DiffifaceError, inputs=(x,))


@pytest.mark.parametrize("problem", ["wrong-length", "wrong-dtype"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_unravel_refuses_a_wrong_vector(kind: str, problem: str) -> None:
    if kind == "torch":
        need("torch-autograd")
    tree = {"a": as_input(np.ones(2), kind), "b": as_input(np.zeros(3), kind)}
    _, unravel = di.tree.ravel(tree)
    vector = np.ones(4) if problem == "wrong-length" else np.ones(5, dtype=np.float32)
    vector = as_input(vector, kind)
    if kind == "torch" and problem == "wrong-dtype":
        vector = vector.to(dtype=__import__("torch").float32)
    check_case(lambda: unravel(vector), di.DiffifaceError, inputs=(tree, vector))


# == 8. dtype conventions ======================================================================

DTYPE_IDS = ("jax", "torch-autograd", "torch-func", "autograd", "fd-central")


def _cast64(fw: str, v: Any) -> Any:
    if fw == "torch":
        import torch

        return v.to(torch.float64)
    return v.astype(np.float64)


def _x64_scope(fw: str) -> Any:
    if fw == "jax":
        import jax

        return jax.enable_x64(True)
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize("backend_id", DTYPE_IDS)
def test_jacobian_float32_x_float64_output(backend_id: str) -> None:
    need(backend_id)
    fw = framework(backend_id)
    xp = xp_of(fw)
    x = as_input(X0.astype(np.float32), fw)
    expected_dtype = np.promote_types(np.float64, np.float32)  # (y leaf, x leaf)
    with _x64_scope(fw):
        check_case(
            lambda: di.jacobian(lambda v: _cast64(fw, h(xp, v)), BACKENDS[backend_id], x),
            RIGHT,
            np.diag(dh(X0.astype(np.float32).astype(np.float64))),
            inputs=(x,),
            rtol=1e-4,
            atol=1e-5,
            dtype=expected_dtype,
        )


@pytest.mark.parametrize("backend_id", DTYPE_IDS)
def test_hessian_of_mixed_precision_pytree(backend_id: str) -> None:
    need(backend_id)
    fw = framework(backend_id)
    xp = xp_of(fw)
    a0, b0 = X0[:2].astype(np.float32), X0[1:].astype(np.float64)
    x = {"a": as_input(a0, fw), "b": as_input(b0, fw)}

    def f(p: Any) -> Any:
        return _cast64(fw, total(h(xp, p["a"]))) + total(h(xp, p["b"]))

    ha, hb = np.diag(d2h(a0.astype(np.float64))), np.diag(d2h(b0))
    expected = {"a": {"a": ha, "b": np.zeros((2, 2))}, "b": {"a": np.zeros((2, 2)), "b": hb}}
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    rule = {
        (i, j): np.promote_types(d_i, d_j) for i, d_i in (("a", f32), ("b", f64)) for j, d_j in (("a", f32), ("b", f64))
    }

    def check(result: Any) -> None:
        from _adversarial_helpers import to_numpy

        for i in ("a", "b"):
            for j in ("a", "b"):
                block = to_numpy(result[i][j])
                assert block.dtype == rule[i, j], f"block [{i}][{j}]: dtype {block.dtype}, expected {rule[i, j]}"
                np.testing.assert_allclose(block.astype(np.float64), expected[i][j], rtol=1e-3, atol=1e-4)

    with _x64_scope(fw):
        check_case(lambda: di.hessian(f, BACKENDS[backend_id], x), RIGHT, check, inputs=(x,))
