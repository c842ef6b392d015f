"""The seams of issue 38: differentiate_with across engines with complex numbers, integer and
string outputs, Python complex leaves, autograd's own containers, real cotangents of complex
outputs, and the messages of three refusals. Each test is named after what it guards and holds
the issue's reproduction."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import diffiface as di

jax = pytest.importorskip("jax", reason="jax is not installed: the jax seams are untested")
torch = pytest.importorskip("torch", reason="torch is not installed: the torch seams are untested")
jnp = jax.numpy

Z = np.array([3 + 4j, 1 - 2j])
V = np.array([0.5 - 1j, 2 + 0.25j])
SQUARE = {
    "torch": lambda q: q * q,
    "autograd": lambda q: q * q,
    "finite_differences": lambda q: q * q,
}


# --- item 4: differentiate_with in jax's reverse mode for complex x ---------------------------------


@pytest.mark.parametrize("backend", sorted(SQUARE))
def test_jax_grad_through_g_of_complex_x_is_jaxs_own(backend: str) -> None:
    g = di.differentiate_with(SQUARE[backend], backend)
    with jax.enable_x64(True):
        z = jnp.asarray(Z)
        got = jax.grad(lambda q: jnp.sum(jnp.abs(g(q)) ** 2))(z)
        want = jax.grad(lambda q: jnp.sum(jnp.abs(q * q) ** 2))(z)
    np.testing.assert_allclose(np.asarray(want), [300 - 400j, 20 + 40j])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("backend", sorted(SQUARE))
def test_jax_jvp_vjp_and_batched_vjp_through_g_of_complex_x(backend: str) -> None:
    weights = torch.tensor([1.0, 2.0 + 0j]) if backend == "torch" else np.array([1.0, 2.0 + 0j])
    g = di.differentiate_with(lambda q: q * q * weights, backend)

    def native(q: Any) -> Any:
        return q * q * jnp.asarray([1.0, 2.0 + 0j])

    with jax.enable_x64(True):
        z, v = jnp.asarray(Z), jnp.asarray(V)
        np.testing.assert_allclose(jax.jvp(g, (z,), (v,))[1], jax.jvp(native, (z,), (v,))[1], rtol=1e-6)
        (got,) = jax.vjp(g, z)[1](v)
        (want,) = jax.vjp(native, z)[1](v)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        # a batch of cotangents: one Jacobian and a contraction (_inner.Inner.vjps)
        cts = jnp.stack([v, 1j * v, jnp.conj(v)])
        np.testing.assert_allclose(
            jax.vmap(jax.vjp(g, z)[1])(cts)[0], jax.vmap(jax.vjp(native, z)[1])(cts)[0], rtol=1e-6
        )
        np.testing.assert_allclose(
            jax.jacrev(g, holomorphic=True)(z), jax.jacrev(native, holomorphic=True)(z), rtol=1e-6
        )


@pytest.mark.parametrize("backend", ["torch", "autograd"])
def test_jax_second_order_through_g_of_complex_x(backend: str) -> None:
    g = di.differentiate_with(SQUARE[backend], backend)
    with jax.enable_x64(True):
        z, v = jnp.asarray(Z), jnp.asarray(V)

        def through(q: Any) -> Any:
            return jnp.sum(jnp.abs(g(q)) ** 2)

        def native(q: Any) -> Any:
            return jnp.sum(jnp.abs(q * q) ** 2)

        np.testing.assert_allclose(
            jax.jvp(jax.grad(through), (z,), (v,))[1], jax.jvp(jax.grad(native), (z,), (v,))[1], rtol=1e-6
        )
        np.testing.assert_allclose(
            jax.grad(lambda q: jnp.sum(jnp.abs(jax.grad(through)(q)) ** 2))(z),
            jax.grad(lambda q: jnp.sum(jnp.abs(jax.grad(native)(q)) ** 2))(z),
            rtol=1e-6,
        )


@pytest.mark.parametrize("backend", ["jax", "autograd", "finite_differences"])
def test_torch_backward_through_g_of_complex_x_is_torchs_own(backend: str) -> None:
    weights = np.array([1.0, 2.0 + 0j])
    inner = (lambda q: q * q * jnp.asarray(weights)) if backend == "jax" else (lambda q: q * q * weights)
    g = di.differentiate_with(inner, backend)
    z = torch.tensor(Z, requires_grad=True)
    (g(z).abs() ** 2).sum().backward()
    native = torch.tensor(Z, requires_grad=True)
    ((native * native * torch.tensor(weights)).abs() ** 2).sum().backward()
    np.testing.assert_allclose(z.grad.numpy(), native.grad.numpy(), rtol=1e-6)
    # a batch of cotangents through torch.func
    cts = torch.tensor(np.stack([V, 1j * V, V.conj()]))
    _, pullback = torch.func.vjp(g, torch.tensor(Z))
    _, native_pullback = torch.func.vjp(lambda q: q * q * torch.tensor(weights), torch.tensor(Z))
    np.testing.assert_allclose(
        torch.func.vmap(pullback)(cts)[0].numpy(), torch.func.vmap(native_pullback)(cts)[0].numpy(), rtol=1e-6
    )


# --- item 5: integer outputs -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["finite_differences", "scipy", "torch"])
def test_a_python_int_output_is_refused(backend: str) -> None:
    x = {"jax": jnp.asarray, "torch": torch.tensor}.get(backend, np.asarray)(np.array([1.0, 2.0]))
    with pytest.raises(di.InvalidOutputError, match=r"returned an int where gradient needs floating-point"):
        di.gradient(lambda v: int((v**2).sum()), backend, x)


def test_an_integer_array_output_is_refused_on_autograd() -> None:
    import autograd.numpy as anp

    with pytest.raises(di.InvalidOutputError, match=r"an array of dtype int64"):
        di.jacobian(lambda v: (v * 10).astype(np.int64), "autograd", np.array([1.0, 2.0]))
    with pytest.raises(di.InvalidOutputError, match=r"into integers.*floating point"):
        di.gradient(lambda v: anp.sum(v**2).astype(np.int64), "autograd", np.array([1.0, 2.0]))


# --- item 6: a Python complex leaf beside another leaf -----------------------------------------------


@pytest.mark.parametrize("backend", ["finite_differences", "scipy", "autograd", "jax", "torch"])
def test_a_python_complex_leaf_beside_a_float_gets_its_gradient(backend: str) -> None:
    grad = di.gradient(lambda z: abs(z[0]) ** 2 + abs(z[1]) ** 2, backend, (2.0, 3 + 4j))
    assert type(grad) is tuple and type(grad[0]) is float and type(grad[1]) is complex
    np.testing.assert_allclose(grad[0], 4.0, rtol=1e-6)
    np.testing.assert_allclose(grad[1], 6 + 8j, rtol=1e-6)


# --- item 16: a real cotangent of a complex output ---------------------------------------------------

ENGINES = {
    "finite_differences": (di.AutoFiniteDifferences(), np.asarray),
    "scipy": (di.AutoScipy(), np.asarray),
    "autograd": (di.AutoAutograd(), np.asarray),
    "jax": (di.AutoJAX(), jnp.asarray),
    "torch-autograd": (di.AutoTorch(), torch.tensor),
    "torch-func": (di.AutoTorch(mode="func"), torch.tensor),
}


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value)


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("cotangent", ["float", "real array"])
def test_a_real_cotangent_of_a_complex_output_is_the_complex_one(engine: str, cotangent: str) -> None:
    backend, array = ENGINES[engine]
    z = array(np.array([1 + 2j, 3 - 1j]))
    if cotangent == "float":
        f, ct, complex_ct = (lambda q: (q * q).sum()), 1.0, array(np.asarray(1 + 0j))
    else:
        f, ct, complex_ct = (lambda q: q * q), array(np.array([1.0, 2.0])), array(np.array([1.0, 2.0 + 0j]))
    got = di.vjp(f, backend, z, ct)
    np.testing.assert_allclose(_numpy(got), _numpy(di.vjp(f, backend, z, complex_ct)), rtol=1e-6)
    np.testing.assert_allclose(
        _numpy(got),
        np.conj(2 * np.array([1 + 2j, 3 - 1j])) * ([1.0, 1.0] if cotangent == "float" else [1.0, 2.0]),
        rtol=1e-6,
    )
    batch = di.batched_vjp(f, backend, z, di.Tangents(ct, ct))
    for product in batch:
        np.testing.assert_allclose(_numpy(product), _numpy(got), rtol=1e-6)


@pytest.mark.parametrize(
    "engine",
    list(ENGINES),
)
def test_a_real_cotangent_of_a_complex_output_of_real_x(engine: str) -> None:
    backend, array = ENGINES[engine]
    weights = array(np.array([1.0, -2.0], dtype=np.float32))

    def f(v: Any) -> Any:
        total = (v * weights).sum()
        if isinstance(total, torch.Tensor):
            total = total.to(torch.complex64)
        elif isinstance(total, jax.Array):  # (strict promotion: no float32 times a Python complex)
            total = total.astype(jnp.complex64)
        return total * (1 + 1j)

    got = di.vjp(f, backend, array(np.array([1.0, 2.0], dtype=np.float32)), 1.0)
    np.testing.assert_allclose(_numpy(got), [1.0, -2.0], rtol=1e-3)


# --- item 15: differentiate_with's raw engine errors -------------------------------------------------


# (not jax in jax nor torch in torch: f of the outer engine's own arrays crosses no engine, and g
# calls it as it is)
@pytest.mark.parametrize(
    ("backend", "outer"),
    [(b, o) for b in ["torch", "jax", "autograd", "finite_differences"] for o in ["jax", "torch"] if b != o],
)
def test_g_of_an_f_that_returns_a_string_is_refused(backend: str, outer: str) -> None:
    g = di.differentiate_with(lambda v: "hello", backend)
    x = np.array([1.0, 2.0], dtype=np.float32)
    call = (lambda: jax.grad(g)(jnp.asarray(x))) if outer == "jax" else (lambda: g(torch.tensor(x, requires_grad=True)))
    with pytest.raises(di.InvalidOutputError, match=r"f returned a str .*where g needs numbers"):
        call()


@pytest.mark.parametrize("backend", ["torch", "finite_differences"])
def test_jax_vmap_of_g_over_an_empty_batch(backend: str) -> None:
    g = di.differentiate_with(lambda v: (v**2).sum(), backend)
    empty = jnp.zeros((0, 2))
    values = jax.vmap(g)(empty)
    assert values.shape == (0,) and values.dtype == jnp.float32
    grads = jax.vmap(jax.grad(g))(empty)
    assert grads.shape == (0, 2) and grads.dtype == jnp.float32
    # and a batch of one still runs f
    np.testing.assert_allclose(jax.vmap(jax.grad(g))(jnp.ones((1, 2))), [[2.0, 2.0]], rtol=1e-4)


@pytest.mark.parametrize("backend", ["jax", "finite_differences"])
def test_torch_vmap_of_g_over_an_empty_batch(backend: str) -> None:
    f = (lambda v: jnp.sum(v**2)) if backend == "jax" else (lambda v: (v**2).sum())
    g = di.differentiate_with(f, backend)
    empty = torch.zeros((0, 2))
    values = torch.func.vmap(g)(empty)
    assert values.shape == (0,) and values.dtype == torch.float32
    grads = torch.func.vmap(torch.func.grad(g))(empty)
    assert grads.shape == (0, 2) and grads.dtype == torch.float32
    np.testing.assert_allclose(torch.func.vmap(torch.func.grad(g))(torch.ones((1, 2))).numpy(), [[2.0, 2.0]], rtol=1e-4)


def test_torch_through_jax_through_torch_nests() -> None:
    inner = di.differentiate_with(lambda v: (v**3).sum(), "torch")
    middle = di.differentiate_with(lambda v: jnp.sin(inner(v)), "jax")
    x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    middle(x).backward()
    want = torch.cos(torch.tensor(9.0, dtype=torch.float64)) * 3 * torch.tensor([1.0, 4.0], dtype=torch.float64)
    np.testing.assert_allclose(x.grad.numpy(), want.numpy(), rtol=1e-10)
    # and the other way round, which worked before
    inner_jax = di.differentiate_with(lambda v: jnp.sum(v**3), "jax")
    middle_torch = di.differentiate_with(lambda v: torch.sin(inner_jax(v)), "torch")
    with jax.enable_x64(True):
        got = jax.grad(middle_torch)(jnp.asarray([1.0, 2.0]))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-10)


# --- item 19: three misleading messages --------------------------------------------------------------


class _Params(dict):  # type: ignore[type-arg]
    """A dict subclass no pytree registry knows."""


class _JaxParams(dict):  # type: ignore[type-arg]
    """A dict subclass registered with jax's pytree registry, as the refusal advises."""


class _OptreeParams(dict):  # type: ignore[type-arg]
    """A dict subclass registered with optree in diffiface's namespace, as the refusal advises."""


jax.tree_util.register_pytree_node(
    _JaxParams,
    lambda d: (list(d.values()), list(d.keys())),
    lambda keys, values: _JaxParams(zip(keys, values, strict=True)),
)
__import__("optree").register_pytree_node(
    _OptreeParams,
    lambda d: (list(d.values()), list(d.keys())),
    lambda keys, values: _OptreeParams(zip(keys, values, strict=True)),
    namespace="diffiface",
)


@pytest.mark.parametrize("backend", ["finite_differences", "autograd"])
def test_a_dict_subclass_as_x_says_to_register_it_or_pass_a_dict(backend: str) -> None:
    def f(d: Any) -> Any:
        return (d["a"] ** 2).sum()

    with pytest.raises(di.InvalidInputError, match=r"a subclass of dict that no pytree registry knows.*dict\(x\)"):
        di.gradient(f, backend, _Params(a=np.ones(2)))
    # each way out the message names works
    np.testing.assert_allclose(di.gradient(f, backend, dict(_Params(a=np.ones(2))))["a"], [2.0, 2.0], rtol=1e-6)
    for registered in (_JaxParams, _OptreeParams):
        grad = di.gradient(f, backend, registered(a=np.ones(2)))
        assert type(grad) is registered
        np.testing.assert_allclose(grad["a"], [2.0, 2.0], rtol=1e-6)


COMPLEX_ENGINES = {
    "jax": (di.AutoJAX(), jnp.asarray),
    "autograd": (di.AutoAutograd(), np.asarray),
    "finite_differences": (di.AutoFiniteDifferences(), np.asarray),
    "scipy": (di.AutoScipy(), np.asarray),
    "torch-autograd": (di.AutoTorch(), torch.tensor),
    "torch-func": (di.AutoTorch(mode="func"), torch.tensor),
}


def _cube(z: Any) -> Any:
    return z * z * z


def _refusal_and_scope(engine: str) -> tuple[str, dict[str, Any]]:
    backend, array = COMPLEX_ENGINES[engine]
    x = array(np.complex128(1 + 1j))
    with pytest.raises(di.UnsupportedOperationError) as refusal:
        di.second_derivative(_cube, backend, x)
    return str(refusal.value), {"di": di, "f": _cube, "backend": backend, "x": x, "t": array(np.complex128(1.0))}


@pytest.mark.parametrize("engine", list(COMPLEX_ENGINES))
def test_the_complex_second_derivative_refusal_advises_what_runs(engine: str) -> None:
    from diffiface._complex import SECOND_DERIVATIVE_ADVICE

    with jax.enable_x64(True):
        message, scope = _refusal_and_scope(engine)
        assert SECOND_DERIVATIVE_ADVICE in message
        # f'' = 6 z: the advice, as written in the message, runs and gives it
        second = eval(SECOND_DERIVATIVE_ADVICE, scope)
    np.testing.assert_allclose(complex(np.asarray(second)), 6 + 6j, rtol=1e-5)


@pytest.mark.parametrize(
    "engine",
    [
        name
        for name in COMPLEX_ENGINES
        if name != "torch-autograd"  # (the message says: under torch, with mode='func')
    ],
)
def test_the_complex_second_derivative_refusal_advises_a_directional_one_that_runs(engine: str) -> None:
    from diffiface._complex import SECOND_JVP_ADVICE

    with jax.enable_x64(True):
        message, scope = _refusal_and_scope(engine)
        assert SECOND_JVP_ADVICE in message
        directional = eval(SECOND_JVP_ADVICE, scope)
    np.testing.assert_allclose(complex(np.asarray(directional)), 6 + 6j, rtol=1e-5)


def test_a_sparse_hessian_of_an_equinox_module_with_a_function_leaf_names_the_leaf() -> None:
    eqx = pytest.importorskip("equinox", reason="equinox is not installed: its modules are untested")

    class Model(eqx.Module):  # type: ignore[misc]
        w: Any
        activation: Any

        def __call__(self, v: Any) -> Any:
            return self.activation(self.w * v)

    with jax.enable_x64(True):
        model = Model(jnp.asarray([1.0, 2.0, 3.0]), jnp.tanh)

        def loss(m: Any) -> Any:
            return jnp.sum(m(jnp.ones(3)) ** 2)

        with pytest.raises(di.ArrayTypeError, match=r"a PjitFunction at \['activation'\].*eqx\.partition"):
            di.hessian(loss, di.AutoSparse("jax"), model)
        # the way out the message names
        params, static = eqx.partition(model, eqx.is_inexact_array)
        sparse = di.hessian(lambda p, s: loss(eqx.combine(p, s)), di.AutoSparse("jax"), params, di.Constant(static))
        dense = di.hessian(loss, "jax", model)
        np.testing.assert_allclose(np.asarray(sparse.todense()), np.asarray(dense.w.w), rtol=1e-10)


# --- items 7 and 13: autograd's own containers --------------------------------------------------------


def _autograd_numpy() -> Any:
    return pytest.importorskip("autograd.numpy", reason="autograd is not installed: its containers are untested")


def test_a_nested_list_x_under_autograd_is_traced_through_np_append() -> None:
    anp = _autograd_numpy()
    x = ([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], [[7.0, 8.0, 9.0]])

    def f(x: Any) -> Any:
        return anp.sum(anp.append(x[0], x[1], axis=0) ** 2)

    got = di.gradient(f, "autograd", x)
    want = di.gradient(f, "finite_differences", x)
    np.testing.assert_allclose(np.asarray(got[1]), [[14.0, 16.0, 18.0]], rtol=1e-12)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
    assert type(got) is tuple and type(got[0]) is list and type(got[0][0][0]) is float


def _containers() -> dict[str, Any]:
    anp = _autograd_numpy()
    from autograd.builtins import dict as ag_dict
    from autograd.builtins import list as ag_list
    from autograd.builtins import tuple as ag_tuple

    return {
        "ag_tuple": lambda v: ag_tuple((v**2, anp.sin(v))),
        "ag_list": lambda v: ag_list([v**2, anp.sin(v)]),
        "ag_dict": lambda v: ag_dict({"a": v**2, "b": anp.sin(v)}),
        "np.split": lambda v: anp.split(v**2, 2),
        "np.gradient": lambda v: anp.gradient(anp.reshape(v, (4, 4)) ** 2),
        "np.linalg.eigh": lambda v: anp.linalg.eigh(anp.reshape(v, (4, 4)) + anp.reshape(v, (4, 4)).T),
    }


@pytest.mark.parametrize("name", ["ag_tuple", "ag_list", "ag_dict", "np.split", "np.gradient", "np.linalg.eigh"])
def test_autograds_own_containers_as_outputs_are_served(name: str) -> None:
    f = _containers()[name]
    x = np.linspace(0.1, 1.6, 16) ** 1.5
    got = di.jacobian(f, "autograd", x)
    want = di.jacobian(f, "finite_differences", x)
    assert type(got) is type(want)
    got_leaves, want_leaves = di.tree.leaves(got), di.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) >= 2
    for a, b in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # and a vjp along a cotangent of that structure
    y = f(x)
    cotangent = di.tree.map(lambda leaf: np.ones_like(np.asarray(leaf)), y)
    got_vjp = di.vjp(f, "autograd", x, cotangent)
    np.testing.assert_allclose(got_vjp, di.vjp(f, "finite_differences", x, cotangent), rtol=1e-5, atol=1e-6)


def test_odeint_with_an_args_tuple_in_x_under_autograd() -> None:
    _autograd_numpy()
    from autograd.scipy.integrate import odeint

    def decay(y: Any, t: Any, rate: Any, source: Any) -> Any:
        return -rate * y + source

    times = np.linspace(0.0, 1.0, 5)

    def final(x: Any) -> Any:
        return odeint(decay, x[0], times, x[1])[-1]

    x = (np.array([1.0, 2.0]), (np.array(0.5), np.array(0.3)))
    got = di.jacobian(final, "autograd", x)
    want = di.jacobian(final, "finite_differences", x)
    for a, b in zip(di.tree.leaves(got), di.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # the closed form at t = 1: d y / d y0 = e^{-rate}
    np.testing.assert_allclose(np.diag(got[0]), np.exp(-0.5) * np.ones(2), rtol=1e-5)
