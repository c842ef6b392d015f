"""The torch backend under real use: nesting, the caller's grad/inference mode, writes into the
inputs, and the errors that must replace silent zeros. Every case checks afterwards that x, the
tangent and the Constant arrays are bit-for-bit unchanged and that torch's modes are as before."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import diffiface as di

torch = pytest.importorskip("torch")

MODES = ["autograd", "func"]


def tb(mode: str) -> Any:
    return di.AutoTorch(mode=mode)


def g(v: Any) -> Any:
    return (torch.sin(v) * v**2).sum()


def g_grad(v: Any) -> Any:
    return 2 * v * torch.sin(v) + v**2 * torch.cos(v)


def g_hess(v: Any) -> Any:
    return torch.diag(2 * torch.sin(v) + 4 * v * torch.cos(v) - v**2 * torch.sin(v))


X = [0.3, -1.2, 2.0]


def x64() -> Any:
    return torch.tensor(X, dtype=torch.float64)


class _Watch:
    """Copies of the arrays a case hands diffiface, and torch's modes, to compare afterwards."""

    def __init__(self) -> None:
        self.arrays: list[tuple[Any, Any]] = []

    def __call__(self, *arrays: Any) -> Any:
        for a in arrays:
            copy = a.detach().clone() if isinstance(a, torch.Tensor) else np.array(a, copy=True)
            self.arrays.append((a, copy))
        return arrays[0] if len(arrays) == 1 else arrays


@pytest.fixture
def watch() -> Iterator[_Watch]:
    w = _Watch()
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    yield w
    assert torch.is_grad_enabled() == grad
    assert torch.is_inference_mode_enabled() == inference
    for original, copy in w.arrays:
        if isinstance(original, torch.Tensor):
            assert torch.equal(original.detach(), copy), "an input changed"
        else:
            assert np.array_equal(original, copy) and original.dtype == copy.dtype, "an input changed"


# -- 1. nesting -------------------------------------------------------------------------------------


@pytest.mark.parametrize("outer", MODES)
@pytest.mark.parametrize("inner", MODES)
def test_hessian_as_jacobian_of_gradient(outer: str, inner: str, watch: _Watch) -> None:
    # expected: the analytic Hessian, except func outer over autograd inner: a clear refusal
    x = watch(x64())
    if outer == "func" and inner == "autograd":
        with pytest.raises(di.UnsupportedOperationError, match="mode='func'"):
            di.jacobian(lambda v: di.gradient(g, tb(inner), v), tb(outer), x)
        return
    hessian = di.jacobian(lambda v: di.gradient(g, tb(inner), v), tb(outer), x)
    torch.testing.assert_close(hessian, g_hess(x))
    assert not hessian.requires_grad


@pytest.mark.parametrize("outer", MODES)
@pytest.mark.parametrize("inner", MODES)
def test_gradient_penalty(outer: str, inner: str, watch: _Watch) -> None:
    # d/dw sum(grad g(w)^2) = 2 H(w) grad g(w)
    w = watch(x64())
    if outer == "func" and inner == "autograd":
        with pytest.raises(di.UnsupportedOperationError):
            di.gradient(lambda v: (di.gradient(g, tb(inner), v) ** 2).sum(), tb(outer), w)
        return
    result = di.gradient(lambda v: (di.gradient(g, tb(inner), v) ** 2).sum(), tb(outer), w)
    torch.testing.assert_close(result, 2 * g_hess(w) @ g_grad(w))


@pytest.mark.parametrize("outer", MODES)
@pytest.mark.parametrize("inner", MODES)
def test_maml_step(outer: str, inner: str, watch: _Watch) -> None:
    # loss(w, a) = sum(a * w^3 / 3); one inner step w' = w - lr * a * w^2; outer loss(w', a)
    # d/dw loss(w', a) = a * w'^2 * (1 - 2 lr a w)
    a = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    w, _ = watch(x64(), a)
    lr = 0.1

    def loss(v: Any, c: Any) -> Any:
        return (c * v**3 / 3).sum()

    def outer_loss(v: Any, c: Any) -> Any:
        stepped = v - lr * di.gradient(loss, tb(inner), v, di.Constant(c))
        return loss(stepped, c)

    if outer == "func" and inner == "autograd":
        with pytest.raises(di.UnsupportedOperationError):
            di.gradient(outer_loss, tb(outer), w, di.Constant(a))
        return
    result = di.gradient(outer_loss, tb(outer), w, di.Constant(a))
    stepped = w - lr * a * w**2
    torch.testing.assert_close(result, a * stepped**2 * (1 - 2 * lr * a * w))


@pytest.mark.parametrize("mode", MODES)
def test_second_order_by_hand_matches_hessian(mode: str, watch: _Watch) -> None:
    # hessian and hvp of the one backend, as the reference for the nested ones
    x, t = watch(x64(), torch.tensor([1.0, 0.5, -2.0], dtype=torch.float64))
    torch.testing.assert_close(di.hessian(g, tb(mode), x), g_hess(x))
    torch.testing.assert_close(di.hvp(g, tb(mode), x, t), g_hess(x) @ t)


@pytest.mark.parametrize("outer", MODES)
@pytest.mark.parametrize("inner", MODES)
def test_jvp_of_gradient(outer: str, inner: str, watch: _Watch) -> None:
    # forward over reverse: H t; torch.func outer over autograd inner is refused
    x, t = watch(x64(), torch.tensor([1.0, 0.5, -2.0], dtype=torch.float64))
    if outer == "func" and inner == "autograd":
        with pytest.raises(di.UnsupportedOperationError):
            di.jvp(lambda v: di.gradient(g, tb(inner), v), tb(outer), x, t)
        return
    result = di.jvp(lambda v: di.gradient(g, tb(inner), v), tb(outer), x, t)
    torch.testing.assert_close(result, g_hess(x) @ t)


@pytest.mark.parametrize("outer", MODES)
@pytest.mark.parametrize("inner", MODES)
def test_gradient_of_jvp(outer: str, inner: str, watch: _Watch) -> None:
    # reverse over forward: grad of <grad g, t> is H t
    x, t = watch(x64(), torch.tensor([1.0, 0.5, -2.0], dtype=torch.float64))

    def directional(v: Any) -> Any:
        return di.jvp(g, tb(inner), v, t)

    if outer == "func" and inner == "autograd":
        with pytest.raises(di.UnsupportedOperationError):
            di.gradient(directional, tb(outer), x)
        return
    torch.testing.assert_close(di.gradient(directional, tb(outer), x), g_hess(x) @ t)


def test_forward_inside_forward_autograd_refused(watch: _Watch) -> None:
    # torch.autograd.forward_ad has one level: a jvp inside a jvp in autograd mode is refused
    x, t = watch(x64(), torch.ones(3, dtype=torch.float64))
    with pytest.raises(di.UnsupportedOperationError, match="one dual level"):
        di.jvp(lambda v: di.jvp(torch.sin, tb("autograd"), v, t), tb("autograd"), x, t)


@pytest.mark.parametrize("mode", [*MODES, "autograd, default"])
def test_requires_grad_input_keeps_graph(mode: str, watch: _Watch) -> None:
    # x requiring grad under grad mode: the gradient keeps x's graph where asked for
    # (create_graph=True, as torch.autograd.grad's) and under torch.func (its semantics); by
    # default autograd mode detaches it, as torch.autograd.grad does; no .grad is written, the
    # flag stays
    x = x64().requires_grad_(True)
    watch(x)
    backend = di.AutoTorch(create_graph=True) if mode == "autograd" else tb(mode.partition(",")[0])
    grad = di.gradient(g, backend, x)
    if mode == "autograd, default":
        assert not grad.requires_grad and grad.grad_fn is None
        torch.testing.assert_close(grad, g_grad(x.detach()))
        assert x.grad is None and x.requires_grad and x.is_leaf
        return
    assert grad.requires_grad
    (second,) = torch.autograd.grad(grad.sum(), x)
    torch.testing.assert_close(second, g_hess(x.detach()).sum(0))
    assert x.grad is None and x.requires_grad and x.is_leaf


@pytest.mark.parametrize("mode", MODES)
def test_same_prep_plain_then_graph_carrying(mode: str, watch: _Watch) -> None:
    # a prep made for a plain tensor, then called with one that carries a graph: second order right
    x = watch(x64())
    prep = di.prepare_gradient(g, tb(mode), x)
    torch.testing.assert_close(di.gradient(g, tb(mode), x, prep=prep), g_grad(x))
    nested = di.jacobian(lambda v: di.gradient(g, tb(mode), v, prep=prep), tb(mode), x)
    torch.testing.assert_close(nested, g_hess(x))
    again = di.gradient(g, tb(mode), x, prep=prep)
    assert not again.requires_grad


# -- 2. the caller's grad mode and inference mode ------------------------------------------------

OPERATORS = ["gradient", "jacobian", "jvp", "vjp", "hvp", "hessian"]


def _run(op: str, mode: str, x: Any, t: Any) -> tuple[Any, Any]:
    """The result of ``op`` on g (or sin for the vector operators) and its analytic value."""
    backend = tb(mode)
    if op == "gradient":
        return di.gradient(g, backend, x), g_grad(x)
    if op == "jacobian":
        return di.jacobian(torch.sin, backend, x), torch.diag(torch.cos(x))
    if op == "jvp":
        return di.jvp(torch.sin, backend, x, t), torch.cos(x) * t
    if op == "vjp":
        return di.vjp(torch.sin, backend, x, t), torch.cos(x) * t
    if op == "hvp":
        return di.hvp(g, backend, x, t), g_hess(x) @ t
    return di.hessian(g, backend, x), g_hess(x)


@pytest.mark.parametrize("op", OPERATORS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scope", ["no_grad", "inference_mode"])
def test_call_site_modes(scope: str, mode: str, op: str, watch: _Watch) -> None:
    # expected: the right derivative, never zeros; the modes unchanged after (fixture)
    x, t = watch(x64(), torch.tensor([1.0, 0.5, -2.0], dtype=torch.float64))
    with getattr(torch, scope)():
        result, expected = _run(op, mode, x, t)
        assert torch.is_grad_enabled() is False
    torch.testing.assert_close(result, expected)


@pytest.mark.parametrize("mode", MODES)
def test_inference_tensor_as_x(mode: str, watch: _Watch) -> None:
    # an inference tensor (made under inference_mode) as x and as a Constant: the right gradient
    with torch.inference_mode():
        x = x64()
        c = torch.tensor([2.0, 1.0, 3.0], dtype=torch.float64)
    watch(x, c)
    result = di.gradient(lambda v, k: (k * torch.sin(v)).sum(), tb(mode), x, di.Constant(c))
    torch.testing.assert_close(result, c * torch.cos(x))


@pytest.mark.parametrize("mode", MODES)
def test_modes_restored_after_f_raises(mode: str, watch: _Watch) -> None:
    x = watch(x64())

    def bad(v: Any) -> Any:
        raise KeyError("f's own error")

    for scope in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with scope():
            before = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            with pytest.raises(KeyError, match="f's own error"):
                di.gradient(bad, tb(mode), x)
            assert (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) == before


# -- 3. writes into the inputs -----------------------------------------------------------------------


def _writes_x(v: Any) -> Any:
    v.mul_(2)
    return (v**2).sum()


@pytest.mark.parametrize("op", ["gradient", "jvp", "vjp", "hvp", "hessian", "jacobian"])
@pytest.mark.parametrize("mode", MODES)
def test_f_writes_into_x(mode: str, op: str, watch: _Watch) -> None:
    # expected: MutationError naming x and the fix; x and the tangent untouched
    x, t = watch(x64(), torch.tensor([1.0, 0.5, -2.0], dtype=torch.float64))
    f: Callable[[Any], Any] = _writes_x
    if op in ("jvp", "vjp", "jacobian"):

        def f(v: Any) -> Any:
            v.mul_(2)
            return torch.sin(v)

    args = (x, t) if op in ("jvp", "vjp", "hvp") else (x,)
    with pytest.raises(di.MutationError, match="in place into its input") as info:
        getattr(di, op)(f, tb(mode), *args)
    assert "out of place" in str(info.value) and "di.Cache" in str(info.value)


@pytest.mark.parametrize("mode", MODES)
def test_f_writes_into_numpy_constant(mode: str, watch: _Watch) -> None:
    x = watch(x64())
    c = watch(np.array([1.0, 2.0, 3.0]))

    def f(v: Any, k: Any) -> Any:
        k.mul_(10)
        return (k * v).sum()

    # func mode: torch.func itself refuses a write into a captured tensor, before it happens
    with pytest.raises(di.MutationError if mode == "autograd" else RuntimeError):
        di.gradient(f, tb(mode), x, di.Constant(c))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises-after"])
def test_f_writes_into_torch_constant(mode: str, raises: bool, watch: _Watch) -> None:
    x, c = watch(x64(), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))

    def f(v: Any, k: Any) -> Any:
        k.add_(1)
        if raises:
            raise ValueError("half-way")
        return (k * v).sum()

    with pytest.raises(di.MutationError if mode == "autograd" else RuntimeError):
        di.gradient(f, tb(mode), x, di.Constant(c))


@pytest.mark.parametrize("mode", MODES)
def test_cache_may_be_written(mode: str, watch: _Watch) -> None:
    x = watch(x64())
    scratch = torch.zeros(3, dtype=torch.float64)

    def f(v: Any, s: Any) -> Any:
        s.copy_(torch.ones(3, dtype=torch.float64))
        return (s * torch.sin(v)).sum()

    if mode == "func":  # torch.func refuses writes into captured tensors, a Cache's too
        with pytest.raises(RuntimeError):
            di.gradient(f, tb(mode), x, di.Cache(scratch))
        return
    torch.testing.assert_close(di.gradient(f, tb(mode), x, di.Cache(scratch)), torch.cos(x))


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_train_mode_in_constant(mode: str, watch: _Watch) -> None:
    # expected: MutationError pointing to functional_call and has_aux; the running stats put back
    torch.manual_seed(0)
    model = torch.nn.BatchNorm1d(3).double().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = watch(torch.randn(4, 3, dtype=torch.float64))

    def f(v: Any, m: Any) -> Any:
        return (m(v) ** 2 * torch.arange(3.0, dtype=torch.float64)).sum()

    if mode == "func":  # torch.func refuses the update of a captured buffer itself
        with pytest.raises(RuntimeError):
            di.gradient(f, tb(mode), x, di.Constant(model))
    else:
        with pytest.raises(di.MutationError, match="functional_call") as info:
            di.gradient(f, tb(mode), x, di.Constant(model))
        assert "has_aux" in str(info.value)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_f_writes_tangent_through_dual(watch: _Watch) -> None:
    # forward mode hands f a dual of x and the tangent: a write would reach both
    x, t = watch(x64(), torch.ones(3, dtype=torch.float64))

    def f(v: Any) -> Any:
        v.mul_(3)
        return v

    with pytest.raises(di.MutationError):
        di.jvp(f, tb("autograd"), x, t)
    with pytest.raises(di.MutationError):
        di.derivative(f, tb("autograd"), torch.tensor(0.5, dtype=torch.float64))


# -- 4. errors instead of raw torch errors or zeros -------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_negative_stride_numpy(mode: str, watch: _Watch) -> None:
    # right results: x and a Constant with negative strides
    x = watch(np.arange(1.0, 6.0)[::-1])
    c = np.arange(5.0)[::-1]
    watch(c)
    result = di.gradient(lambda v, k: (torch.sin(v) * k).sum(), tb(mode), x, di.Constant(c))
    np.testing.assert_allclose(result, np.cos(x) * c)
    assert isinstance(result, np.ndarray)


@pytest.mark.parametrize("mode", MODES)
def test_meta_tensor_x(mode: str) -> None:
    with pytest.raises(di.InvalidInputError, match="meta tensor"):
        di.gradient(g, tb(mode), torch.empty(3, device="meta"))


@pytest.mark.parametrize("mode", MODES)
def test_meta_tensor_context(mode: str, watch: _Watch) -> None:
    x = watch(x64())
    with pytest.raises(di.DiffifaceError):  # (the message still says "cannot convert": to reword)
        di.gradient(lambda v, k: (v * k).sum(), tb(mode), x, di.Constant(torch.empty(3, device="meta")))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("framework", ["jax", "autograd"])
def test_foreign_tangent(mode: str, framework: str, watch: _Watch) -> None:
    x = watch(torch.tensor(X, dtype=torch.float32))
    if framework == "jax":
        jnp = pytest.importorskip("jax.numpy")
        tangent: Any = jnp.ones(3, dtype=jnp.float32)
    else:
        ag = pytest.importorskip("autograd")
        boxes = []
        ag.grad(lambda z: boxes.append(z) or z.sum())(np.ones(3, dtype=np.float32))
        tangent = boxes[0]
    with pytest.raises(di.ArrayTypeError, match=r"tangent of jvp is (jax|autograd).*numpy or torch arrays"):
        di.jvp(torch.sin, tb(mode), x, tangent)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cut", ["float", "item"])
def test_output_cut_from_graph(mode: str, cut: str, watch: _Watch) -> None:
    x = watch(x64())

    def f(v: Any) -> Any:
        y = (v**2).sum()
        return float(y.detach()) if cut == "float" else y.detach().item()

    with pytest.raises(di.InvalidOutputError, match="Keep the output a tensor"):
        di.gradient(f, tb(mode), x)


@pytest.mark.parametrize("mode", MODES)
def test_constant_tensor_output_gives_zeros(mode: str, watch: _Watch) -> None:
    # a legitimately constant f, computed with torch ops not involving x: zeros
    x = watch(x64())
    result = di.gradient(lambda v: torch.ones(3, dtype=torch.float64).sum(), tb(mode), x)
    torch.testing.assert_close(result, torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("mode", MODES)
def test_f_own_error_mentioning_jax_propagates(mode: str, watch: _Watch) -> None:
    # f's own TypeError whose text names jax is f's, unchanged
    x = watch(x64())

    def f(v: Any) -> Any:
        raise TypeError("expected a jax config object")

    with pytest.raises(TypeError, match="expected a jax config object") as info:
        di.gradient(f, tb(mode), x)
    assert not isinstance(info.value, di.DiffifaceError)


@pytest.mark.parametrize("mode", MODES)
def test_jax_function_on_torch_tensor(mode: str, watch: _Watch) -> None:
    jnp = pytest.importorskip("jax.numpy")
    x = watch(x64())
    with pytest.raises(di.FrameworkMismatchError, match="AutoJAX"):
        di.gradient(lambda v: jnp.sum(jnp.sin(v)), tb(mode), x)


# -- 5. no private engine API, no warning --------------------------------------------------------------


def test_no_private_forward_ad_api() -> None:
    import inspect
    from pathlib import Path

    import diffiface._adapters.torch as adapter

    source = "".join(p.read_text() for p in Path(inspect.getfile(adapter)).parent.glob("*.py"))
    assert "_maybe_load_decompositions" not in source


@pytest.mark.parametrize("mode", MODES)
def test_forward_mode_emits_no_warning(mode: str, watch: _Watch) -> None:
    x, t = watch(x64(), torch.ones(3, dtype=torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(di.jvp(torch.sin, tb(mode), x, t), torch.cos(x))


def _clamped_in_place(x: Any) -> Any:
    y = x.exp()
    y.clamp_(max=2.0)  # exp's backward pass reads y: torch refuses to differentiate this
    return (y**2).sum()


@pytest.mark.parametrize("mode", ["autograd", "func"])
@pytest.mark.parametrize("operator", ["gradient", "hessian", "hvp", "vjp"])
def test_overwriting_a_saved_intermediate_is_refused_in_diffiface_terms(mode: str, operator: str) -> None:
    """f writing in place into a tensor torch saved for its backward pass: torch's own
    RuntimeError is raised by the engine, not by f, and must come out as diffiface's refusal."""
    x = torch.tensor([0.3, -0.5, 0.8], dtype=torch.float64)
    backend = di.AutoTorch(mode=mode)
    args: tuple[Any, ...] = ()
    if operator == "hvp":
        args = (torch.ones(3, dtype=torch.float64),)
    if operator == "vjp":
        args = (torch.tensor(1.0, dtype=torch.float64),)
    for prep in (None, getattr(di, f"prepare_{operator}")):
        kwargs = {} if prep is None else {"prep": prep(_clamped_in_place, backend, x, *args)}
        with pytest.raises(di.UnsupportedOperationError, match="out of place"):
            getattr(di, operator)(_clamped_in_place, backend, x, *args, **kwargs)
    # forward mode reads no saved tensor: the jvp is right
    got = di.jvp(_clamped_in_place, backend, x, torch.ones(3, dtype=torch.float64))
    want = torch.func.jvp(lambda x: (x.exp().clamp(max=2.0) ** 2).sum(), (x,), (torch.ones(3, dtype=torch.float64),))[1]
    torch.testing.assert_close(got, want)


_NUMPY_ON_DETACHED = {
    "np.asarray": lambda x: (x**2).sum() * float(np.asarray(x.detach()).sum()),
    "detach().numpy()": lambda x: (x**2).sum() * float(x.detach().numpy().sum()),
    "np.sin": lambda x: torch.as_tensor(np.sin(x)).sum(),
}


@pytest.mark.parametrize("operator", ["gradient", "jvp", "hessian"])
@pytest.mark.parametrize("name", list(_NUMPY_ON_DETACHED))
def test_numpy_on_a_torch_func_tensor_is_a_framework_mismatch(name: str, operator: str) -> None:
    """Under torch.func's transforms a tensor has no memory, even detached: numpy reading it
    fails inside torch, and the caller must hear it as a framework mismatch, not torch's words."""
    x = torch.tensor([0.3, 0.6], dtype=torch.float64)
    args = (torch.ones(2, dtype=torch.float64),) if operator == "jvp" else ()
    with pytest.raises(di.FrameworkMismatchError, match="torch operations"):
        getattr(di, operator)(_NUMPY_ON_DETACHED[name], di.AutoTorch(mode="func"), x, *args)


@pytest.mark.parametrize("change", ["train", "parameter"])
@pytest.mark.parametrize("mode", ["autograd", "func"])
@pytest.mark.parametrize("operator", ["gradient", "value_and_gradient", "jacobian"])
def test_a_module_change_by_f_is_refused_on_every_call(mode: str, operator: str, change: str) -> None:
    """f switching a Constant module into train mode, or setting a new parameter into it, is put
    back and refused on a prep's later calls too, not only on its first: the caller's module
    must not change behind its back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).double().eval()
    weight = model[0].weight
    calls = {"n": 0}

    def f(x: Any, model: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3 and change == "train":
            model.train()
        if calls["n"] == 3 and change == "parameter":
            model[0].weight = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
        out = model(x)
        return out if operator == "jacobian" else (out**2).sum()

    backend = di.AutoTorch(mode=mode)
    x = torch.ones(2, dtype=torch.float64)
    prep = getattr(di, f"prepare_{operator}")(f, backend, x, di.Constant(model))
    calls["n"] = 0
    getattr(di, operator)(f, backend, x, di.Constant(model), prep=prep)
    getattr(di, operator)(f, backend, x, di.Constant(model), prep=prep)
    with pytest.raises(di.MutationError, match="has been put back"):
        getattr(di, operator)(f, backend, x, di.Constant(model), prep=prep)
    assert not any(module.training for module in model.modules())
    assert model[0].weight is weight
    getattr(di, operator)(f, backend, x, di.Constant(model), prep=prep)  # the module as it was


@pytest.mark.parametrize(
    "backend",
    [di.AutoTorch(), di.AutoTorch(create_graph=True), di.AutoTorch(mode="func")],
    ids=["autograd", "create_graph", "func"],
)
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_a_hook_on_a_parameter_does_not_change_its_derivative(backend: Any, prepared: bool) -> None:
    """A tensor hook on a leaf of x (gradient clipping registered on an nn.Parameter) rewrites
    what ``torch.autograd.grad`` returns for it; diffiface's result is f's derivative, the one
    every other engine gives, and the hook is not called."""
    weight = torch.nn.Parameter(torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64))
    seen = []
    weight.register_hook(lambda grad: seen.append(grad) or grad * 10)
    params = {"w": weight}

    def f(params: Any) -> Any:
        return g(params["w"])

    assert torch.allclose(torch.autograd.grad(f(params), [weight])[0], 10 * g_grad(weight.detach()))
    seen.clear()
    prep = {"prep": di.prepare_gradient(f, backend, params)} if prepared else {}
    for _ in range(3):  # (a prep's first call and the later ones take different steps)
        torch.testing.assert_close(di.gradient(f, backend, params, **prep)["w"].detach(), g_grad(weight.detach()))
    tangent = {"w": torch.ones(3, dtype=torch.float64)}
    torch.testing.assert_close(di.hvp(f, backend, params, tangent)["w"].detach(), g_hess(weight.detach()).sum(1))
    torch.testing.assert_close(
        di.vjp(f, backend, params, torch.tensor(1.0, dtype=torch.float64))["w"].detach(), g_grad(weight.detach())
    )
    assert seen == []
