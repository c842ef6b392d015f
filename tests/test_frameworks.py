"""The jax and torch ecosystems' own objects, with the real frameworks: equinox modules, flax
linen and nnx, haiku, torch.nn through diffiface.functional.

Types only jax knows are pytrees everywhere a dict is; their leaves that are not arrays or
floats stay static, as in ``eqx.filter_grad`` (None in the results). Each framework that is
not installed skips its tests, naming the extra that brings it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import diffiface as di
from diffiface import tree
from diffiface.test import assert_allclose, check_gradients, default_tolerances

INSTALL = 'pip install "diffiface[frameworks]"'


def need(module: str) -> Any:
    return pytest.importorskip(module, reason=f"{module} is not installed: {INSTALL}")


def x64() -> Any:
    """A scope where jax makes float64 arrays (the flag stays off outside, as conftest wants)."""
    return need("jax").enable_x64(True)


def same_tree(actual: Any, expected: Any, rtol: float | None = None, atol: float | None = None) -> None:
    """Same jax structure (None where the other has None), leaves close: by default within the
    tolerances of the leaf's dtype (diffiface.test's, so float32 gets float32 tolerances)."""
    jax = need("jax")
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
        default_rtol, default_atol = default_tolerances(str(a.dtype))
        np.testing.assert_allclose(
            np.asarray(a),
            np.asarray(e),
            rtol=default_rtol if rtol is None else rtol,
            atol=default_atol if atol is None else atol,
        )


# -- equinox -----------------------------------------------------------------------------------------


def _mlp(width: int = 8, depth: int = 2, in_size: int = 3, out_size: int = 2, dtype: Any = None) -> Any:
    jax, eqx = need("jax"), need("equinox")
    return eqx.nn.MLP(in_size, out_size, width, depth, activation=jax.nn.tanh, key=jax.random.key(0), dtype=dtype)


def _mlp_loss(model: Any, inputs: Any) -> Any:
    jax = need("jax")
    return (jax.vmap(model)(inputs) ** 2).sum()


BACKENDS_ON_JAX_ARRAYS = ["jax", "jax-nojit", "finite_differences"]


def _backend(name: str) -> Any:
    return di.AutoJAX(jit=False) if name == "jax-nojit" else name


@pytest.mark.parametrize("backend", BACKENDS_ON_JAX_ARRAYS)
def test_equinox_module_as_x_matches_filter_grad(backend: str) -> None:
    """A whole module as x: a module-shaped gradient, None at the activation functions, equal
    leaf by leaf to eqx.filter_grad's; the module is unchanged."""
    jax, eqx = need("jax"), need("equinox")
    jnp = jax.numpy
    with x64():
        model = _mlp(dtype=jnp.float64)
        inputs = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float64).reshape(4, 3)
        expected = eqx.filter_grad(_mlp_loss)(model, inputs)
    before = jax.tree_util.tree_map(np.array, eqx.filter(model, eqx.is_array))
    grad = di.gradient(_mlp_loss, _backend(backend), model, di.Constant(inputs))
    assert type(grad) is type(model) and grad.activation is None and grad.final_activation is None
    same_tree(grad, expected, rtol=1e-6 if backend == "finite_differences" else 1e-12)
    for a, b in zip(
        jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)), strict=False
    ):
        np.testing.assert_array_equal(a, np.asarray(b))
    again = di.gradient(_mlp_loss, _backend(backend), model, di.Constant(inputs))  # the prep, reused
    same_tree(again, grad, rtol=0, atol=0)


def test_equinox_module_float32_on_jax_and_static_value_changes() -> None:
    """float32 stays float32; a new static leaf value (another activation) gets a new program,
    never the old one."""
    jax, eqx = need("jax"), need("equinox")
    jnp = jax.numpy
    model = _mlp()
    inputs = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(4, 3)
    grad = di.gradient(_mlp_loss, "jax", model, di.Constant(inputs))
    same_tree(grad, eqx.filter_grad(_mlp_loss)(model, inputs))
    assert grad.layers[0].weight.dtype == jnp.float32
    relu_model = eqx.tree_at(lambda m: m.activation, model, jax.nn.relu)
    relu_grad = di.gradient(_mlp_loss, "jax", relu_model, di.Constant(inputs))
    same_tree(relu_grad, eqx.filter_grad(_mlp_loss)(relu_model, inputs))
    assert not np.allclose(np.asarray(relu_grad.layers[0].weight), np.asarray(grad.layers[0].weight))


def test_equinox_module_as_context() -> None:
    jax, _eqx = need("jax"), need("equinox")
    jnp = jax.numpy
    with x64():
        model = _mlp(dtype=jnp.float64)
        inputs = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float64).reshape(4, 3)
        expected = jax.grad(lambda i: _mlp_loss(model, i))(inputs)
    for backend in ("jax", "finite_differences"):
        grad = di.gradient(lambda i, m: _mlp_loss(m, i), backend, inputs, di.Constant(model))
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-7)


def test_equinox_static_leaves_in_every_operator() -> None:
    """Jacobian and Hessian blocks, vjp and hvp results hold None at a static leaf; a tangent
    takes None there, as eqx.filter gives it."""
    jax, eqx = need("jax"), need("equinox")
    jnp = jax.numpy

    class Scaled(eqx.Module):
        weight: Any
        power: int  # a plain field: a leaf, not differentiated
        act: Any

    with x64():
        model = Scaled(jnp.array([1.0, 2.0], dtype=jnp.float64), 3, jnp.sin)
        expected_hessian = np.asarray(jax.hessian(lambda w: jnp.sin(w**3).sum())(model.weight))
        expected_jacobian = np.asarray(jax.jacobian(lambda w: jnp.sin(w**3))(model.weight))
        tangent = jax.tree_util.tree_map(jnp.ones_like, eqx.filter(model, eqx.is_array))  # None at the rest

    def scalar(m: Any) -> Any:
        return m.act(m.weight**m.power).sum()

    def vector(m: Any) -> Any:
        return m.act(m.weight**m.power)

    for backend in ("jax", "finite_differences"):
        tol = 1e-12 if backend == "jax" else 1e-5
        hessian = di.hessian(scalar, backend, model)
        assert hessian.power is None and hessian.act is None and hessian.weight.power is None
        np.testing.assert_allclose(np.asarray(hessian.weight.weight), np.asarray(expected_hessian), rtol=tol)
        jacobian = di.jacobian(vector, backend, model)
        assert jacobian.power is None
        np.testing.assert_allclose(np.asarray(jacobian.weight), np.asarray(expected_jacobian), rtol=tol)
        hvp = di.hvp(scalar, backend, model, tangent)
        np.testing.assert_allclose(np.asarray(hvp.weight), np.asarray(expected_hessian.sum(1)), rtol=tol)
        vjp = di.vjp(vector, backend, model, np.ones(2))
        assert vjp.power is None and vjp.act is None
        jvp = di.jvp(vector, backend, model, tangent)
        np.testing.assert_allclose(np.asarray(jvp), np.asarray(expected_jacobian.sum(1)), rtol=tol)
    with pytest.raises(di.TangentMismatchError, match="None at the leaves of x that are not differentiated"):
        di.hvp(scalar, "jax", model, {"weight": np.ones(2)})


def test_integer_array_in_module_is_refused_with_the_way_out() -> None:
    """An integer array field is not static (it may be data): an InvalidInputError naming
    eqx.partition and di.Constant, never a raw jax TypeError."""
    jax, eqx = need("jax"), need("equinox")
    jnp = jax.numpy

    class Indexed(eqx.Module):
        weight: Any
        index: Any

    model = Indexed(jnp.ones(3), jnp.arange(2))
    for backend in ("jax", "finite_differences"):
        with pytest.raises(di.InvalidInputError, match=r"x\.index|x\['index'\]|index.*int|eqx\.partition") as caught:
            di.gradient(lambda m: m.weight[m.index].sum(), backend, model)
        assert "eqx.partition" in str(caught.value) and "di.Constant" in str(caught.value)
    # the documented way: the integer part as a Constant
    params, static = eqx.partition(model, eqx.is_inexact_array)
    grad = di.gradient(
        lambda p, s: eqx.combine(p, s).weight[eqx.combine(p, s).index].sum(), "jax", params, di.Constant(static)
    )
    np.testing.assert_array_equal(np.asarray(grad.weight), [1.0, 1.0, 0.0])


def test_scipy_with_static_leaves_of_numpy_x() -> None:
    """scipy differentiates numpy leaves; the int, string and function leaves stay static."""
    need("scipy")
    x = {"w": np.array([0.5, 1.5]), "power": 2, "name": "layer", "act": np.tanh}

    def f(p: Any) -> Any:
        assert p["name"] == "layer"
        return p["act"](p["w"] ** p["power"]).sum()

    grad = di.gradient(f, "scipy", x)
    assert grad["power"] is None and grad["name"] is None and grad["act"] is None
    np.testing.assert_allclose(grad["w"], 2 * x["w"] / np.cosh(x["w"] ** 2) ** 2, rtol=1e-9)


def test_tree_ravel_and_assert_allclose_on_equinox_gradients() -> None:
    jax, eqx = need("jax"), need("equinox")
    model = _mlp()
    params = eqx.filter(model, eqx.is_array)
    flat, unravel = tree.ravel(params)
    assert flat.shape == (sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)),)
    rebuilt = unravel(flat)
    assert type(rebuilt) is type(model) and rebuilt.activation is None
    inputs = jax.numpy.ones((4, 3))
    grad = di.gradient(_mlp_loss, "jax", model, di.Constant(inputs))
    assert_allclose(grad, eqx.filter_grad(_mlp_loss)(model, inputs))  # float32's tolerances


# -- flax ----------------------------------------------------------------------------------------------


def test_flax_linen_params_as_x_and_as_context() -> None:
    jax, nn = need("jax"), need("flax.linen")
    jnp = jax.numpy

    class Model(nn.Module):
        @nn.compact
        def __call__(self, inputs: Any) -> Any:
            dense = {"param_dtype": jnp.float64, "dtype": jnp.float64}
            return nn.Dense(2, **dense)(nn.tanh(nn.Dense(5, **dense)(inputs)))

    module = Model()
    with x64():
        inputs = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float64).reshape(4, 3)
        params = module.init(jax.random.key(0), inputs)

        def loss(p: Any, data: Any) -> Any:
            return (module.apply(p, data) ** 2).sum()

        expected = jax.grad(loss)(params, inputs)
        expected_inputs = jax.grad(loss, argnums=1)(params, inputs)
    for backend in ("jax", "finite_differences"):
        same_tree(di.gradient(loss, backend, params, di.Constant(inputs)), expected, rtol=1e-6)
        grad = di.gradient(lambda i, p: loss(p, i), backend, inputs, di.Constant(params))
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected_inputs), rtol=1e-6)


def test_a_bound_flax_linen_module_as_f() -> None:
    """``module.bind(variables)`` is f itself: its methods call one another beyond the
    callables an unprepared call follows, which once recursed without end (RecursionError)."""
    jax, nn = need("jax"), need("flax.linen")
    jnp = jax.numpy

    class Model(nn.Module):
        @nn.compact
        def __call__(self, inputs: Any) -> Any:
            return jnp.sum(nn.Dense(1)(inputs[None, :]) ** 2)

    module, inputs = Model(), jnp.linspace(-1.0, 1.0, 3)
    variables = module.init(jax.random.key(0), inputs)
    for scale in (1.0, 2.0):
        scaled = jax.tree_util.tree_map(lambda a, s=scale: s * a, variables)
        expected = jax.grad(lambda i, v=scaled: module.apply(v, i))(inputs)
        np.testing.assert_allclose(di.gradient(module.bind(scaled), "jax", inputs), expected, rtol=1e-6)


def test_flax_nnx_state_as_x_and_as_context() -> None:
    """nnx.split gives (graphdef, state): the State as x (an nnx.State gradient back), the graph
    definition as a Constant; the State as a Constant differentiating the input."""
    jax, nnx = need("jax"), need("flax.nnx")
    jnp = jax.numpy
    with x64():
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0), param_dtype=jnp.float64, dtype=jnp.float64)
        graphdef, state = nnx.split(model)
        inputs = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float64).reshape(4, 3)

        def loss(s: Any, g: Any, data: Any) -> Any:
            return (jnp.tanh(nnx.merge(g, s)(data)) ** 2).sum()

        expected = jax.grad(loss)(state, graphdef, inputs)
        expected_inputs = jax.grad(loss, argnums=2)(state, graphdef, inputs)
    for backend in BACKENDS_ON_JAX_ARRAYS:
        grad = di.gradient(loss, _backend(backend), state, di.Constant(graphdef), di.Constant(inputs))
        assert isinstance(grad, nnx.State)
        same_tree(grad, expected, rtol=1e-6)
        by_input = di.gradient(
            lambda i, s, g: loss(s, g, i), _backend(backend), inputs, di.Constant(state), di.Constant(graphdef)
        )
        np.testing.assert_allclose(np.asarray(by_input), np.asarray(expected_inputs), rtol=1e-6)
    flat, unravel = tree.ravel(state)
    assert flat.shape == (3 * 2 + 2,) and isinstance(unravel(flat), nnx.State)


# -- haiku ---------------------------------------------------------------------------------------------


def test_haiku_transform_with_state_params_and_state() -> None:
    """A haiku BatchNorm network: params as x, state as a Constant; the new state through has_aux."""
    jax, hk = need("jax"), need("haiku")
    jnp = jax.numpy

    def forward(inputs: Any, is_training: bool) -> Any:
        hidden = hk.Linear(4)(inputs)
        hidden = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(hidden, is_training)
        return hk.Linear(1)(jnp.tanh(hidden))

    network = hk.without_apply_rng(hk.transform_with_state(forward))
    # (haiku's moving averages add an int32 counter to float64 statistics: standard promotion)
    with x64(), jax.numpy_dtype_promotion("standard"):
        inputs = jnp.linspace(-1.0, 1.0, 15, dtype=jnp.float64).reshape(5, 3)
        params, state = network.init(jax.random.key(0), inputs, True)
        params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), params)
        state = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64) if a.dtype == jnp.float32 else a, state)

        def loss(p: Any, s: Any, data: Any) -> Any:
            out, new_state = network.apply(p, s, data, True)
            return (out**2).sum(), new_state

        (expected_value, expected_state), expected = jax.value_and_grad(loss, has_aux=True)(params, state, inputs)
    for backend in ("jax", "finite_differences"):
        with jax.numpy_dtype_promotion("standard"):
            (value, new_state), grad = di.value_and_gradient(
                loss, backend, params, di.Constant(state), di.Constant(inputs), has_aux=True
            )
        same_tree(grad, expected, rtol=1e-5, atol=1e-8)
        same_tree(new_state, expected_state, rtol=1e-12)
        np.testing.assert_allclose(float(value), float(expected_value), rtol=1e-12)


# -- torch.nn -------------------------------------------------------------------------------------------


def test_functional_gives_detached_params_and_buffers() -> None:
    torch = need("torch")
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    f, params, buffers = di.functional(module)
    assert set(params) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert not any(p.requires_grad for p in params.values())
    module.eval()
    inputs = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(f(params, buffers, inputs), module(inputs), rtol=0, atol=0)
    with pytest.raises(di.InvalidInputError, match=r"torch\.nn\.Module"):
        di.functional(lambda x: x)


def test_torch_batchnorm_train_mode_through_has_aux() -> None:
    """Buffers cloned inside the loss, the new running statistics returned as the aux, the
    module's own buffers bit-identical after; torch agrees with finite differences."""
    torch = need("torch")
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Tanh()).double().train()
    seeded = torch.Generator().manual_seed(3)  # values independent of the tests run before
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, dtype=torch.float64, generator=seeded))
    f, params, buffers = di.functional(module)
    before = {name: b.clone() for name, b in module.named_buffers()}
    inputs = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss(p: Any, b: Any, data: Any) -> Any:
        fresh = {name: buffer.clone() for name, buffer in b.items()}
        value = f(p, fresh, data).pow(2).sum()
        return value, fresh

    results = {}
    for backend in ("torch", di.AutoTorch(mode="func"), "finite_differences"):
        (_value, new_buffers), grad = di.value_and_gradient(
            loss, backend, params, di.Constant(buffers), di.Constant(inputs), has_aux=True
        )
        results[str(backend)] = grad
        assert int(new_buffers["1.num_batches_tracked"]) == 1
        expected_mean = 0.1 * f(params, {k: v.clone() for k, v in buffers.items()}, inputs).new_tensor(0) + 0.1 * (
            inputs @ params["0.weight"].T + params["0.bias"]
        ).mean(0)
        torch.testing.assert_close(new_buffers["1.running_mean"], expected_mean)
    for name, buffer in module.named_buffers():
        assert torch.equal(buffer, before[name]), f"{name} changed"
    reference = results["finite_differences"]
    for grad in results.values():
        for name in params:
            torch.testing.assert_close(grad[name], reference[name], rtol=1e-5, atol=1e-7)


def _dropout_model(torch: Any) -> Any:
    from diffiface.test._torch_modules import _generator_dropout_type

    return _generator_dropout_type()(4, 3, 0.5).double()


def test_torch_dropout_with_an_explicit_generator() -> None:
    """The generator is a Constant; the loss draws from a copy of its state, so two calls (and
    every finite-difference evaluation) see the same mask and the caller's generator stays put."""
    torch = need("torch")
    module = _dropout_model(torch)
    f, params, _ = di.functional(module)
    generator = torch.Generator().manual_seed(7)
    state_before = generator.get_state().clone()
    inputs = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def loss(p: Any, g: Any, data: Any) -> Any:
        copy = torch.Generator()
        copy.set_state(g.get_state())
        return f(p, {}, data, generator=copy).pow(2).sum()

    first = di.gradient(loss, "torch", params, di.Constant(generator), di.Constant(inputs))
    second = di.gradient(loss, "torch", params, di.Constant(generator), di.Constant(inputs))
    for name in params:
        assert torch.equal(first[name], second[name])
    fd = di.gradient(loss, "finite_differences", params, di.Constant(generator), di.Constant(inputs))
    for name in params:
        torch.testing.assert_close(first[name], fd[name], rtol=1e-6, atol=1e-8)
    assert torch.equal(generator.get_state(), state_before)
    # the mask is really random: another seed gives another gradient
    other = di.gradient(loss, "torch", params, di.Constant(torch.Generator().manual_seed(8)), di.Constant(inputs))
    assert not torch.equal(other["dense.weight"], first["dense.weight"])


def test_torch_module_scenarios_hold_the_recipes() -> None:
    need("torch")
    from diffiface.test import test_differentiation, torch_module_scenarios

    recipes = [
        s
        for s in torch_module_scenarios()
        if s.name.endswith(("batch_norm_train_aux-float64", "dropout_generator-float64"))
    ]
    assert len(recipes) == 2 and recipes[0].has_aux
    report = test_differentiation([di.AutoTorch(), di.AutoFiniteDifferences()], recipes)
    assert {row.status for row in report.rows} == {"passed"}


# -- a large model, and a wrong derivative caught -----------------------------------------------------


def _wide_mlp(dtype: Any) -> tuple[Any, Any]:
    """An equinox MLP of about 200k parameters, and a batch."""
    jax = need("jax")
    jnp = jax.numpy
    model = _mlp(width=440, depth=2, in_size=8, out_size=4, dtype=dtype)
    inputs = jnp.linspace(-1.0, 1.0, 32 * 8, dtype=dtype).reshape(32, 8)
    return model, inputs


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_check_gradients_on_a_200k_parameter_model(precision: str) -> None:
    jax, eqx = need("jax"), need("equinox")
    with x64() if precision == "float64" else _nothing():
        model, inputs = _wide_mlp(getattr(jax.numpy, precision))
    params, static = eqx.partition(model, eqx.is_array)
    count = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))
    assert 190_000 < count < 210_000

    def loss(p: Any, s: Any, data: Any) -> Any:
        return jax.numpy.mean(jax.vmap(eqx.combine(p, s))(data) ** 2)

    report = check_gradients(loss, params, di.Constant(static), di.Constant(inputs), backends=["jax"], projections=4)
    assert [row.status for row in report.rows] == ["passed"]


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()


def test_check_gradients_catches_one_wrong_gradient_entry() -> None:
    """A custom_vjp whose backward gets one entry wrong: check_gradients raises, naming jax."""
    jax = need("jax")
    jnp = jax.numpy

    @jax.custom_vjp
    def square(w: Any) -> Any:
        return w**2

    def forward(w: Any) -> Any:
        return square(w), w

    def backward(w: Any, cotangent: Any) -> Any:
        wrong = 2 * w * cotangent
        return (wrong.at[1].multiply(1.01),)

    square.defvjp(forward, backward)
    with x64():
        x = {"w": jnp.array([0.5, 1.0, 1.5], dtype=jnp.float64), "b": jnp.array(0.3, dtype=jnp.float64)}

    def loss(p: Any) -> Any:
        return square(p["w"]).sum() + p["b"]

    with pytest.raises(AssertionError, match="jax"):
        check_gradients(loss, x, backends=["jax"])
