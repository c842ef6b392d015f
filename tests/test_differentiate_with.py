"""differentiate_with: one engine's function inside another engine's differentiation.

Real models: a torch nn.Module inside jax (grad, jit, jvp, jacfwd, jacrev, vmap, hessian), a jax
network trained by torch (backward, an optimizer step, gradcheck and gradgradcheck in float64,
torch.func.jvp, vmap, torch.compile), and a numpy black box (np.linalg.solve) under finite
differences inside jax.jit(jax.grad(...)). References are the engines' own derivatives of the
same function written natively, or closed forms.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

import diffiface as di
from diffiface.test import assert_allclose

jax = pytest.importorskip("jax", reason="jax is not installed: the jax side of differentiate_with is untested")
torch = pytest.importorskip("torch", reason="torch is not installed: the torch side of differentiate_with is untested")
jnp = jax.numpy


# --- a torch model inside jax ---------------------------------------------------------------------


def _torch_model(dtype: Any = None) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3)
    ).eval()  # eval: dropout off, so the model is a function of its input
    return model.to(dtype) if dtype is not None else model


def _apply(x: Any, model: Any) -> Any:
    return model(x)


def _batch(dtype: Any = np.float32) -> np.ndarray:
    return np.random.default_rng(1).normal(size=(4, 5)).astype(dtype)


def _torch_gradient(model: Any, x: np.ndarray) -> np.ndarray:
    xt = torch.tensor(x, requires_grad=True)
    (model(xt) ** 2).sum().backward()
    return xt.grad.numpy()  # type: ignore[no-any-return]


def _torch_jacobian(model: Any, x: np.ndarray) -> np.ndarray:
    return torch.autograd.functional.jacobian(model, torch.tensor(x)).numpy()  # type: ignore[no-any-return]


@pytest.fixture
def model_in_jax() -> tuple[Any, Any, Any]:
    model = _torch_model()
    g = di.differentiate_with(_apply, "torch")

    def loss(x: Any) -> Any:
        return jnp.sum(g(x, di.Constant(model)) ** 2)

    return model, g, loss


TRANSFORMS = ["grad", "jit-grad", "jvp", "vmap-grad"]


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_jax_gradient_of_a_torch_module(model_in_jax: Any, transform: str) -> None:
    model, _, loss = model_in_jax
    x = _batch()
    expected = _torch_gradient(model, x)
    if transform == "grad":
        got = jax.grad(loss)(jnp.asarray(x))
    elif transform == "jit-grad":
        got = jax.jit(jax.grad(loss))(jnp.asarray(x))
    elif transform == "jvp":
        direction = np.random.default_rng(2).normal(size=x.shape).astype(np.float32)
        _, derivative = jax.jvp(loss, (jnp.asarray(x),), (jnp.asarray(direction),))
        assert_allclose(np.asarray(derivative), np.float32(np.sum(expected * direction)))
        return
    else:
        rows = np.stack([x, 2 * x])
        got = jax.vmap(jax.grad(loss))(jnp.asarray(rows))
        expected = np.stack([expected, _torch_gradient(model, 2 * x)])
    assert isinstance(got, jax.Array)
    assert_allclose(np.asarray(got), expected)


@pytest.mark.parametrize("transform", ["jacfwd", "jacrev", "jit-jacrev"])
def test_jax_jacobian_of_a_torch_module(model_in_jax: Any, transform: str) -> None:
    model, g, _ = model_in_jax
    x = _batch()
    fn = {"jacfwd": jax.jacfwd, "jacrev": jax.jacrev, "jit-jacrev": lambda h: jax.jit(jax.jacrev(h))}[transform]
    got = fn(lambda x: g(x, di.Constant(model)))(jnp.asarray(x))
    assert_allclose(np.asarray(got), _torch_jacobian(model, x))


def test_jax_vmap_over_a_few_tangents(model_in_jax: Any) -> None:
    """Two tangents at one point: one jvp each (fewer than a Jacobian's products)."""
    model, g, _ = model_in_jax
    x = _batch()
    tangents = np.random.default_rng(4).normal(size=(2, *x.shape)).astype(np.float32)

    def pushforward(t: Any) -> Any:
        return jax.jvp(lambda x: g(x, di.Constant(model)), (jnp.asarray(x),), (t,))[1]

    got = jax.jit(jax.vmap(pushforward))(jnp.asarray(tangents))
    jacobian = _torch_jacobian(model, x).reshape(12, 20)
    expected = np.stack([(jacobian @ t.reshape(-1)).reshape(4, 3) for t in tangents])
    assert_allclose(np.asarray(got), expected)


def test_jax_hessian_through_torch_nests(model_in_jax: Any) -> None:
    model, _, loss = model_in_jax
    x = _batch()[:1]
    got = jax.hessian(loss)(jnp.asarray(x))
    expected = torch.autograd.functional.hessian(lambda t: (model(t) ** 2).sum(), torch.tensor(x)).numpy()
    assert_allclose(np.asarray(got), expected)
    # reverse over reverse, through the transposes of the second products
    got = jax.grad(lambda x: jnp.sum(jax.grad(loss)(x) ** 2))(jnp.asarray(x))
    xt = torch.tensor(x, requires_grad=True)
    (gx,) = torch.autograd.grad((model(xt) ** 2).sum(), xt, create_graph=True)
    (expected_rr,) = torch.autograd.grad((gx**2).sum(), xt)
    assert_allclose(np.asarray(got), expected_rr.numpy())


def test_jax_float64_stays_float64_inside_torch() -> None:
    model = _torch_model(torch.float64)
    g = di.differentiate_with(_apply, "torch")
    x = _batch(np.float64)
    with jax.enable_x64(True):
        y = g(jnp.asarray(x), di.Constant(model))
        grad = jax.jit(jax.grad(lambda x: jnp.sum(g(x, di.Constant(model)) ** 2)))(jnp.asarray(x))
    assert y.dtype == jnp.float64 and grad.dtype == jnp.float64
    assert_allclose(np.asarray(grad), _torch_gradient(model, x))


def test_arrays_cross_without_a_copy() -> None:
    seen: list[int] = []

    def f(x: Any) -> Any:
        seen.append(x.unsafe_buffer_pointer())
        return x * 2

    x = torch.arange(4.0)
    y = di.differentiate_with(f, di.AutoJAX(jit=False))(x)  # eager, so that f sees the arrays themselves
    assert seen == [x.data_ptr()] * 2  # the prep's call and the call itself
    assert isinstance(y, torch.Tensor)
    assert_allclose(y, torch.arange(4.0) * 2)
    views: list[Any] = []

    def solver(b: np.ndarray) -> np.ndarray:
        views.append(b)
        return b * 2

    b = jnp.arange(3.0, dtype=jnp.float32)
    di.differentiate_with(solver, "finite_differences")(b)
    assert views[-1].__array_interface__["data"][0] == b.unsafe_buffer_pointer()


def test_f_never_writes_into_the_callers_arrays() -> None:
    x = jnp.ones(3)
    y = di.differentiate_with(lambda x: x.add_(1.0), "torch")(x)  # torch's f writes into a clone of x
    np.testing.assert_array_equal(np.asarray(x), np.ones(3, dtype=np.float32))
    assert_allclose(np.asarray(y), np.full(3, 2.0, dtype=np.float32))

    def writes(b: np.ndarray) -> np.ndarray:
        b[0] = 5.0
        return b

    t = torch.ones(3)
    with pytest.raises(di.MutationError, match="wrote into its input"):
        di.differentiate_with(writes, "finite_differences")(t)
    assert torch.equal(t, torch.ones(3))


def test_f_never_writes_into_the_callers_constants() -> None:
    # expected: g's own call of f (its value, and the first call that records its prep) passed
    # a Constant's arrays as they were, so f's write landed in the caller's: a torch weight
    # went 1 -> 3 after one g(x), a numpy one too, while the derivatives refused the write
    def scale_torch(x: Any, w: Any) -> Any:
        w.add_(1.0)
        return (x * w).sum()

    def scale_numpy(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        w += 1.0
        return (x * w).sum()

    w = torch.ones(3)
    y = di.differentiate_with(scale_torch, "torch")(jnp.ones(3), di.Constant(w))  # f writes into a clone
    assert float(y) == 6.0
    assert torch.equal(w, torch.ones(3))

    for x in (jnp.ones(3), torch.ones(3), np.ones(3)):
        w_numpy = np.ones(3)
        with pytest.raises(di.MutationError, match=r"di\.Constant"):
            di.differentiate_with(scale_numpy, "finite_differences")(x, di.Constant(w_numpy))
        np.testing.assert_array_equal(w_numpy, np.ones(3))
    scratch = np.ones(3)  # (a Cache is f's to write)
    di.differentiate_with(scale_numpy, "finite_differences")(jnp.ones(3), di.Cache(scratch))
    assert scratch[0] > 1.0


# --- a jax network trained by torch ---------------------------------------------------------------


def _jax_net(params: dict[str, Any], data: Any) -> Any:
    hidden = jnp.tanh(data @ params["w1"] + params["b1"][None, :])
    return hidden @ params["w2"]


def _torch_net(params: dict[str, Any], data: Any) -> Any:
    hidden = torch.tanh(data @ params["w1"] + params["b1"])
    return hidden @ params["w2"]


def _params(dtype: Any) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(3)
    return {
        "w1": torch.randn(5, 8, dtype=dtype, generator=generator),
        "b1": torch.randn(8, dtype=dtype, generator=generator),
        "w2": torch.randn(8, 2, dtype=dtype, generator=generator),
    }


def test_torch_training_step_over_a_jax_network() -> None:
    data = _batch()
    target = np.ones((4, 2), dtype=np.float32)
    g = di.differentiate_with(_jax_net, "jax")
    params = {k: torch.nn.Parameter(v) for k, v in _params(torch.float32).items()}
    reference = {k: torch.nn.Parameter(v.detach().clone()) for k, v in params.items()}
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        loss = ((g(params, di.Constant(data)) - torch.tensor(target)) ** 2).mean()
        loss.backward()
        optimizer.step()
    reference_optimizer = torch.optim.SGD(reference.values(), lr=0.1)
    for _ in range(2):
        reference_optimizer.zero_grad()
        ((_torch_net(reference, torch.tensor(data)) - torch.tensor(target)) ** 2).mean().backward()
        reference_optimizer.step()
    for name in params:
        assert params[name].grad is not None
        assert_allclose(params[name].grad.numpy(), reference[name].grad.numpy())
        assert_allclose(params[name].detach().numpy(), reference[name].detach().numpy())


def test_torch_gradcheck_in_float64_through_jax() -> None:
    data = _batch(np.float64)
    g = di.differentiate_with(_jax_net, "jax")
    params = {k: v.requires_grad_() for k, v in _params(torch.float64).items()}

    def fn(w1: Any, b1: Any, w2: Any) -> Any:
        return g({"w1": w1, "b1": b1, "w2": w2}, di.Constant(data))

    inputs = (params["w1"], params["b1"], params["w2"])
    assert fn(*inputs).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


# torch scripts its forward-mode decompositions on the first forward-mode call of a process, warning
# that torch.jit.script is deprecated: torch's own warning, not one of diffiface's
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torch_func_jvp_and_vmap_through_jax() -> None:
    data = _batch(np.float64)
    g = di.differentiate_with(_jax_net, "jax")
    params = _params(torch.float64)
    tangent = {k: torch.randn_like(v) for k, v in params.items()}
    contexts = di.Constant(data)
    value, derivative = torch.func.jvp(lambda p: g(p, contexts), (params,), (tangent,))
    ref_value, ref_derivative = torch.func.jvp(lambda p: _torch_net(p, torch.tensor(data)), (params,), (tangent,))
    assert_allclose(value, ref_value)
    assert_allclose(derivative, ref_derivative)
    # per-example gradients: vmap over grad; g sees one row at a time, as x's second part
    g_row = di.differentiate_with(lambda x: _jax_net(x[0], x[1][None]).sum(), "jax")
    rows = torch.tensor(data)
    got = torch.func.vmap(torch.func.grad(lambda p, row: g_row((p, row))), in_dims=(None, 0))(params, rows)
    want = torch.func.vmap(torch.func.grad(lambda p, row: _torch_net(p, row[None]).sum()), in_dims=(None, 0))(
        params, rows
    )
    assert_allclose(got, want)


def test_torch_func_hessian_through_jax() -> None:
    data = _batch(np.float64)
    g = di.differentiate_with(_jax_net, "jax")
    params = _params(torch.float64)

    def loss(p: Any, net: Any) -> Any:
        return (net(p) ** 2).sum()

    got = torch.func.hessian(lambda w1: loss({**params, "w1": w1}, lambda p: g(p, di.Constant(data))))(params["w1"])
    want = torch.func.hessian(lambda w1: loss({**params, "w1": w1}, lambda p: _torch_net(p, torch.tensor(data))))(
        params["w1"]
    )
    assert_allclose(got, want)


def test_torch_compile_keeps_g_as_one_op() -> None:
    g = di.differentiate_with(lambda x: jnp.sin(x) * 2.0, "jax")
    graphs: list[Any] = []

    def capture(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def loss(x: Any) -> Any:
        return (g(x) ** 2).sum()

    x = torch.linspace(-1, 1, 5, requires_grad=True)
    with warnings.catch_warnings():
        # dynamo's own warnings while it traces: it instantiates the autograd.Function, and reads
        # .grad of non-leaf tensors when it resumes a frame after a graph break
        warnings.filterwarnings("ignore", message=".*should not be instantiated", category=DeprecationWarning)
        warnings.filterwarnings(
            "ignore", message="The .grad attribute of a Tensor that is not a leaf", category=UserWarning
        )
        out = torch.compile(loss, backend=capture)(x)
        out.backward()
    assert x.grad is not None
    assert_allclose(x.grad, 8 * torch.sin(x.detach()) * torch.cos(x.detach()))
    bodies = [str(m.code) for gm in graphs for m in gm.modules() if hasattr(m, "code")]
    calls = [body.count("torch.ops.diffiface.bridge('call'") for body in bodies]
    products = [body.count("torch.ops.diffiface.bridge('vjp'") for body in bodies]
    assert sum(calls) == 1 and sum(products) == 1, bodies  # one op forward, one op backward


def test_torch_compile_sees_new_contexts() -> None:
    """A compiled program never calls f with the contexts of an earlier call."""
    g = di.differentiate_with(lambda x, s: x * s, "jax")
    compiled = torch.compile(lambda x, s: g(x, di.Constant(s)).sum(), backend="eager")
    x = torch.ones(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*should not be instantiated", category=DeprecationWarning)
        warnings.filterwarnings(
            "ignore", message="The .grad attribute of a Tensor that is not a leaf", category=UserWarning
        )
        for scale in (2.0, 3.0, 5.0):
            x.grad = None
            out = compiled(x, np.asarray(scale, dtype=np.float32))
            out.backward()
            assert out.item() == 3 * scale
            assert_allclose(x.grad, torch.full((3,), scale))


@pytest.mark.parametrize("first", ["eager", "compiled"])
@pytest.mark.parametrize("tree", ["leaf", "dict"])
def test_one_g_serves_eager_and_compiled_calls(first: str, tree: str) -> None:
    """torch.compile's trace of optree flattens x into a structure that names diffiface's
    namespace where optree's own does not: one x all the same, served by the same g."""
    g = di.differentiate_with(lambda x: jnp.sin(x["a"]) * 2.0 if isinstance(x, dict) else jnp.sin(x) * 2.0, "jax")

    def loss(x: Any) -> Any:
        return (g({"a": x} if tree == "dict" else x) ** 2).sum()

    compiled = torch.compile(loss, backend="eager")
    x = torch.linspace(-1, 1, 5, dtype=torch.float64, requires_grad=True)
    want = 8 * torch.sin(x.detach()) * torch.cos(x.detach())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*should not be instantiated", category=DeprecationWarning)
        warnings.filterwarnings(
            "ignore", message="The .grad attribute of a Tensor that is not a leaf", category=UserWarning
        )
        for run in (loss, compiled) if first == "eager" else (compiled, loss):
            x.grad = None
            run(x).backward()
            assert_allclose(x.grad, want)


# --- a numpy black box under finite differences ----------------------------------------------------


A = np.array([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]])


def _solve(b: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    assert isinstance(b, np.ndarray)  # a black box: it only ever sees numpy
    return np.linalg.solve(matrix, b)


@pytest.mark.parametrize("backend", ["finite_differences", "scipy"])
def test_numpy_solver_inside_jax_jit_grad(backend: str) -> None:
    g = di.differentiate_with(_solve, backend)
    b = np.array([1.0, 2.0, 3.0], dtype=np.float32)

    @jax.jit
    def gradient(b: Any) -> Any:
        return jax.grad(lambda b: jnp.sum(g(b, di.Constant(A)) ** 2))(b)

    inverse = np.linalg.inv(A)
    expected = (2 * inverse.T @ (inverse @ b)).astype(np.float32)  # f returns float64; jax holds float32
    assert_allclose(np.asarray(gradient(jnp.asarray(b))), expected)


def test_numpy_solver_in_float64_under_x64() -> None:
    g = di.differentiate_with(_solve, "finite_differences")
    b = np.array([1.0, 2.0, 3.0])
    inverse = np.linalg.inv(A)
    with jax.enable_x64(True):
        got = jax.jit(jax.jacrev(lambda b: g(b, di.Constant(A))))(jnp.asarray(b))
    assert got.dtype == jnp.float64
    assert_allclose(np.asarray(got), inverse, rtol=1e-6, atol=1e-8)


def test_numpy_solver_inside_torch() -> None:
    g = di.differentiate_with(_solve, "finite_differences")
    b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    (g(b, di.Constant(A)) ** 2).sum().backward()
    inverse = np.linalg.inv(A)
    assert b.grad is not None
    assert_allclose(b.grad.numpy(), 2 * inverse.T @ (inverse @ b.detach().numpy()), rtol=1e-6, atol=1e-8)


def test_second_order_through_finite_differences_is_refused() -> None:
    g = di.differentiate_with(_solve, "finite_differences")
    with pytest.raises(di.UnsupportedOperationError, match="first order only"):
        jax.hessian(lambda b: jnp.sum(g(b, di.Constant(A)) ** 2))(jnp.ones(3))
    g = di.differentiate_with(_solve, "finite_differences")  # one g serves one signature: float64 here
    b = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad((g(b, di.Constant(A)) ** 2).sum(), b, create_graph=True)
    with pytest.raises(di.UnsupportedOperationError, match="first order only"):
        grad.sum().backward()


def test_auto_sparse_serves_jacfwd() -> None:
    def f(x: np.ndarray) -> np.ndarray:
        return np.sin(x) * x

    backend = di.AutoSparse(di.AutoFiniteDifferences(), detector=di.sparse.LocalDetector())
    g = di.differentiate_with(f, backend)
    x = np.linspace(0.5, 2.0, 6)
    with jax.enable_x64(True):
        got = jax.jacfwd(g)(jnp.asarray(x))
    assert_allclose(np.asarray(got), np.diag(np.cos(x) * x + np.sin(x)), rtol=1e-6, atol=1e-8)


def test_autograd_inside_jax_and_torch_to_second_order() -> None:
    anp = pytest.importorskip("autograd.numpy", reason="autograd is not installed")

    def energy(x: Any) -> Any:
        return anp.sum(anp.sin(x) ** 2)

    x = np.linspace(0.1, 1.0, 3)
    with jax.enable_x64(True):
        g = di.differentiate_with(energy, "autograd")
        assert_allclose(np.asarray(jax.grad(g)(jnp.asarray(x))), np.sin(2 * x))
        assert_allclose(np.asarray(jax.hessian(g)(jnp.asarray(x))), np.diag(2 * np.cos(2 * x)))
    g = di.differentiate_with(energy, "autograd")
    t = torch.tensor(x, requires_grad=True)
    assert torch.autograd.gradgradcheck(g, (t,))


def test_numpy_in_numpy_out() -> None:
    g = di.differentiate_with(lambda x: x * 3.0, "torch")
    y = g(np.ones(2, dtype=np.float32))
    assert isinstance(y, np.ndarray) and y.dtype == np.float32


# --- refusals -----------------------------------------------------------------------------------------


def test_a_third_array_kind_is_refused() -> None:
    autograd = pytest.importorskip("autograd", reason="autograd is not installed")
    g = di.differentiate_with(lambda x: torch.sin(x), "torch")
    with pytest.raises(di.ArrayTypeError, match="autograd"):
        autograd.grad(lambda x: g(x).sum())(np.ones(3))
    with pytest.raises(di.ArrayTypeError, match="one kind"):
        g({"a": jnp.ones(2), "b": torch.ones(2)})


def test_a_shape_outside_the_prep_is_refused() -> None:
    g = di.differentiate_with(lambda x: torch.sin(x), "torch")
    jax.grad(lambda x: jnp.sum(g(x)))(jnp.ones(3))
    with pytest.raises(di.PreparationMismatchError, match=r"shape \(3,\).*got shape \(4,\)"):
        jax.grad(lambda x: jnp.sum(g(x)))(jnp.ones(4))
    with pytest.raises(di.PreparationMismatchError, match="structure"):
        g((jnp.ones(3),))


def test_closing_over_a_traced_jax_array_is_refused() -> None:
    def loss(x: Any, scale: Any) -> Any:
        g = di.differentiate_with(lambda y: torch.sin(y) * torch.as_tensor(np.asarray(scale)), "torch")
        return jnp.sum(g(x))

    with pytest.raises(di.ArrayTypeError, match="Pass it to g as an argument"):
        jax.grad(loss, argnums=1)(jnp.ones(3), 2.0)
    g = di.differentiate_with(lambda x, s: torch.sin(x) * s, "torch")
    with pytest.raises(di.ArrayTypeError, match=r"di\.Constant.*jax tracer"):
        jax.grad(lambda x, s: jnp.sum(g(x, di.Constant(s))), argnums=1)(jnp.ones(3), 2.0)


def test_closing_over_a_torch_tensor_that_requires_grad_is_refused() -> None:
    weight = torch.ones(3, requires_grad=True)
    g = di.differentiate_with(lambda x: x * jnp.asarray(weight.detach().numpy()) + 0 * weight.sum().item(), "jax")
    with pytest.raises(di.ArrayTypeError, match="requires grad"):
        g(torch.ones(3, requires_grad=True))


def test_the_inner_engines_own_tensors_are_not_refused() -> None:
    """A torch tensor that requires grad is f's business inside jax, not a traced array of jax."""
    weight = torch.full((3,), 2.0, requires_grad=True)
    g = di.differentiate_with(lambda x, w: x * w, "torch")
    got = jax.grad(lambda x: jnp.sum(g(x, di.Constant(weight))))(jnp.ones(3))
    assert_allclose(np.asarray(got), np.full(3, 2.0, dtype=np.float32))
    assert weight.grad is None


def test_a_bare_context_is_refused() -> None:
    g = di.differentiate_with(lambda x, c: x * c, "torch")
    with pytest.raises(di.ContextError, match=r"di\.Constant"):
        g(jnp.ones(2), 2.0)


def test_second_order_backends_are_refused() -> None:
    with pytest.raises(di.InvalidBackendOptionError, match="first-order backend"):
        di.differentiate_with(lambda x: x, di.SecondOrder(di.AutoJAX(), di.AutoJAX()))


@pytest.mark.parametrize("kind", ["torch", "numpy", "jax", "jax-jit"])
def test_gs_own_call_refuses_a_write_into_a_constant_module(kind: str) -> None:
    # expected: g's own call of f (its value; the first call, which records its prep) ran a
    # BatchNorm in train mode on the Constant model, whose running mean moved from 0 to about
    # 0.04 per call, while di.gradient of the same f refused the write and put it back
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).double().train()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    g = di.differentiate_with(lambda x, m: m(x).sum(), "torch")
    x = np.random.default_rng(0).normal(size=(4, 3))
    call = {
        "torch": lambda: g(torch.tensor(x), di.Constant(model)),
        "numpy": lambda: g(x, di.Constant(model)),
        "jax": lambda: g(jnp.asarray(x), di.Constant(model)),
        "jax-jit": lambda: jax.jit(lambda x: g(x, di.Constant(model)))(jnp.asarray(x)),
    }[kind]
    with jax.enable_x64(True), pytest.raises(di.MutationError, match=r"running_mean"):
        call()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    with pytest.raises(di.MutationError, match=r"running_mean"):  # (as the derivative calls refuse it)
        di.gradient(lambda x, m: m(x).sum(), "torch", torch.tensor(x), di.Constant(model))
    assert model.training
    model.eval()  # (an eval-mode model is only read: g runs it)
    with torch.no_grad():
        torch.testing.assert_close(g(torch.tensor(x), di.Constant(model)), model(torch.tensor(x)).sum())


def test_inputs_and_contexts_are_not_mutated(model_in_jax: Any) -> None:
    model, _, loss = model_in_jax
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = jnp.asarray(_batch())
    copy = np.array(x)
    jax.jit(jax.grad(loss))(x)
    np.testing.assert_array_equal(np.asarray(x), copy)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("backend", ["torch", "torch-func"])
def test_a_torch_g_on_torch_tensors_never_writes_the_callers(backend: str) -> None:
    """Called on its own engine's tensors, g runs f as it is: f got the caller's tensor, and a
    write (x.mul_(2)) landed in it, also where f then raised. f gets a clone, in the graph."""
    torch = pytest.importorskip("torch")

    def scale(x: Any) -> Any:
        x.mul_(2.0)
        return (x**2).sum()

    g = di.differentiate_with(scale, backend)
    x = torch.ones(3, dtype=torch.float64)
    assert float(g(x)) == 12.0
    torch.testing.assert_close(x, torch.ones(3, dtype=torch.float64))
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(g(w), w)
    torch.testing.assert_close(grad, torch.full((3,), 8.0, dtype=torch.float64))


def test_a_negated_view_from_torch_crosses_into_jax_with_its_sign() -> None:
    # expected: the value and the jvp came with their signs flipped outside jax.jit. torch gives
    # conj(z).imag as a view marked "negate on read", and dlpack carried the memory alone
    def f(z: Any) -> Any:
        return torch.conj(z * 1).imag[0]

    def reference(z: Any) -> Any:
        return -jnp.imag(z[0])

    g = di.differentiate_with(f, "torch")
    z = jnp.asarray([1 + 2j, 3 - 1j], dtype=jnp.complex64)
    t = jnp.asarray([1j, 0], dtype=jnp.complex64)
    assert float(g(z)) == float(reference(z)) == -2.0
    assert float(jax.jvp(g, (z,), (t,))[1]) == float(jax.jvp(reference, (z,), (t,))[1]) == -1.0
    np.testing.assert_array_equal(jax.vmap(g)(jnp.stack([z, 2 * z])), [-2.0, -4.0])


def test_a_batch_of_complex_tangents_of_a_non_holomorphic_f() -> None:
    # expected: jvps along three tangents (as many as x has entries) were taken from f's complex
    # Jacobian, which a non-holomorphic f has none of: UnsupportedOperationError, where each
    # jvp alone was right
    def reference(z: Any) -> Any:
        return jnp.conj(z) * z.real.astype(z.dtype)

    g = di.differentiate_with(lambda z: torch.conj(z) * z.real, "torch")
    z = jnp.asarray([3 + 4j, 1 - 2j], dtype=jnp.complex64)
    tangents = jnp.asarray([[1 + 0j, 1j], [0.5 - 1j, 2 + 0j], [1j, -1 + 1j]], dtype=jnp.complex64)
    pushed = jax.vmap(lambda t: jax.jvp(g, (z,), (t,))[1])(tangents)
    np.testing.assert_allclose(pushed, jax.vmap(lambda t: jax.jvp(reference, (z,), (t,))[1])(tangents), rtol=1e-6)
    pulled = jax.vmap(jax.vjp(g, z)[1])(tangents)[0]
    np.testing.assert_allclose(pulled, jax.vmap(jax.vjp(reference, z)[1])(tangents)[0], rtol=1e-6)


def test_a_jax_result_of_a_torch_f_never_changes_afterwards() -> None:
    # expected: the jax array shared the memory of the tensor f returned: f's own buffer, written
    # again on its next call, or a Constant's tensor, written by the caller later
    buffer = torch.zeros(3)

    def into_buffer(x: Any) -> Any:
        with torch.no_grad():
            torch.mul(x, 2.0, out=buffer)
        return buffer

    g = di.differentiate_with(into_buffer, "torch")
    first = g(jnp.asarray([1.0, 2.0, 3.0]))
    g(jnp.asarray([10.0, 20.0, 30.0]))
    np.testing.assert_array_equal(first, [2.0, 4.0, 6.0])
    weights = torch.tensor([1.0, 2.0, 3.0])
    returned = di.differentiate_with(lambda x, w: w, "torch")(jnp.ones(3), di.Constant(weights))
    weights.mul_(100.0)
    np.testing.assert_array_equal(returned, [1.0, 2.0, 3.0])


def test_torch_inside_jax_inside_torch_to_second_order() -> None:
    # expected: a second derivative of zeros. jax's second product of the inner torch f ran inside
    # the outer torch Function's forward, where torch turns forward grad mode off
    inner = di.differentiate_with(lambda x: x**3, "torch")
    g = di.differentiate_with(lambda x: inner(x), "jax")
    with jax.enable_x64(True):
        x = torch.tensor([0.5, 2.0], dtype=torch.float64, requires_grad=True)
        (first,) = torch.autograd.grad(g(x).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad(first.sum(), x)
    torch.testing.assert_close(first.detach(), 3 * x.detach() ** 2)
    torch.testing.assert_close(second, 6 * x.detach())


def test_jax_jacobians_of_a_compiled_torch_f_of_a_tree() -> None:
    # jacfwd and jacrev take g's Jacobian whole (a batch of as many tangents as x has entries),
    # which wrapped f in a function of diffiface's that rebuilt x by optree, inside what
    # torch.compile traces: refused as a graph break of f's
    def f(x: Any) -> Any:
        return torch.sin(x["a"]) * x["b"].flip(0)

    def f_jax(x: Any) -> Any:
        return jnp.sin(x["a"]) * x["b"][::-1]

    x = {"a": jnp.array([0.3, -1.2, 0.7]), "b": jnp.array([1.5, 0.5, -2.0])}
    g = di.differentiate_with(f, di.AutoTorch(mode="func", compile=True))
    for transform in (jax.jacfwd, jax.jacrev):
        got, want = transform(g)(x), transform(f_jax)(x)
        for name in ("a", "b"):
            assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=1e-6)
    # the Jacobian's blocks laid out flat, for a tree f(x) too (uncompiled: torch.func)
    g_pair = di.differentiate_with(lambda x: (f(x), (x["a"] * x["b"]).sum()), "torch-func")
    for transform in (jax.jacfwd, jax.jacrev):
        got, want = transform(g_pair)(x), transform(lambda x: (f_jax(x), (x["a"] * x["b"]).sum()))(x)
        for part in range(2):
            for name in ("a", "b"):
                assert_allclose(np.asarray(got[part][name]), np.asarray(want[part][name]), rtol=1e-6)
