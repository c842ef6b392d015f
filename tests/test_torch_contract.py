"""The torch contract on what torch users pass: a write by f into x, a Constant tensor, a frozen
module's buffer or parameter is a MutationError that names the leaf, with the caller's data as
the rule says (docs/policies.md): on a prep's first call f works on copies and a write is undone;
on later calls nothing is copied, and a write is named and said to have landed (the buffers of
modules in training mode are put back on every call; under torch.func a write into a Constant
is refused before it lands). Results of nn.Parameters are
detached by default (as torch.autograd.grad's) and carry a graph with create_graph=True; the
route of Parameters, a module Constant and a frozen backbone is the detached leaves' one."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import diffiface as di

torch = pytest.importorskip("torch")

from test_torch_guard_cost import adapter_frames  # noqa: E402  (the same count of the adapter's frames)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

BACKENDS = {"autograd": di.AutoTorch(), "func": di.AutoTorch(mode="func")}


def snapshot(*trees: Any) -> list[Any]:
    return [t.detach().clone() for tree in trees for t in _tensors(tree)]


def _tensors(tree: Any) -> list[Any]:
    if isinstance(tree, torch.nn.Module):
        return [*tree.parameters(), *tree.buffers()]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return [tree]


def same(before: list[Any], *trees: Any) -> bool:
    now = [t for tree in trees for t in _tensors(tree)]
    return all(torch.equal(a, b) for a, b in zip(before, now, strict=True))


@pytest.mark.parametrize("mode", list(BACKENDS))
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_a_write_into_x_names_the_leaf(mode: str, prepared: bool) -> None:
    # expected: a MutationError naming x['b'], the caller's x bit for bit as it was
    x = {"w": torch.randn(3), "b": torch.randn(3)}
    before = snapshot(x)

    def f(p: Any) -> Any:
        with torch.no_grad():
            p["b"].mul_(2.0)
        return (p["w"] * p["b"]).sum()

    backend = BACKENDS[mode]
    prep = di.prepare_gradient(f, backend, {k: v.clone() for k, v in x.items()}) if prepared else None
    with pytest.raises(di.MutationError, match=r"x\['b'\]"):
        di.gradient(f, backend, x, prep=prep)
    assert same(before, x)


def _written(tensor: Any, through: str) -> Any:
    """The tensor f writes into to write into ``tensor``: itself, or another on its memory."""
    return {"itself": tensor, ".data": tensor.data, "detach()": tensor.detach(), "a view": tensor[1:]}[through]


@pytest.mark.parametrize("mode", list(BACKENDS))
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("through", ["itself", ".data", "detach()", "a view"])
def test_a_write_into_a_constant_tensor_names_the_leaf(mode: str, prepared: bool, through: str) -> None:
    # expected: a MutationError naming contexts[0]['scale'] (under torch.func, torch's own refusal
    # before the write, named the same, also where f writes through another tensor on its
    # memory); the caller's tensor bit for bit as it was
    w, data = torch.randn(3), {"scale": torch.randn(3), "shift": torch.randn(3)}
    before = snapshot(data)

    def f(v: Any, d: Any) -> Any:
        with torch.no_grad():
            _written(d["scale"], through).add_(1.0)
        return (v * d["scale"] + d["shift"]).sum()

    backend = BACKENDS[mode]
    prep = di.prepare_gradient(f, backend, w, di.Constant(data)) if prepared else None
    with pytest.raises(di.MutationError, match=r"contexts\[0\]\['scale'\]"):
        di.gradient(f, backend, w, di.Constant(data), prep=prep)
    assert same(before, data)


@pytest.mark.parametrize("mode", list(BACKENDS))
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_a_write_through_out_into_a_constant_on_the_first_call_is_undone(mode: str, prepared: bool) -> None:
    # expected: a MutationError naming contexts[1], the caller's tensor bit for bit as it was.
    # torch.func refuses an in-place method on a tensor f closes over, but not an out= argument
    # (torch.mul(a, 2, out=buffer)): on a prep's first call the write lands in a copy, in both modes
    x, a, buffer = torch.randn(3), torch.randn(3), torch.zeros(3)
    before = snapshot(buffer)

    def f(v: Any, a: Any, buffer: Any) -> Any:
        torch.mul(a, 2.0, out=buffer)  # (scratch space passed as a Constant, not a Cache)
        return (v * buffer).sum()

    backend = BACKENDS[mode]
    prep = di.prepare_gradient(f, backend, x, di.Constant(a), di.Constant(torch.zeros(3))) if prepared else None
    with pytest.raises(di.MutationError, match=r"contexts\[1\].*the caller's tensor is unchanged"):
        di.gradient(f, backend, x, di.Constant(a), di.Constant(buffer), prep=prep)
    assert same(before, buffer)


@pytest.mark.parametrize("mode", list(BACKENDS))
@pytest.mark.parametrize("into", ["x", "constant"])
@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_a_write_through_data_on_the_first_call_is_named(mode: str, into: str, raises: bool) -> None:
    # expected: a MutationError naming the leaf, the caller's tensors bit for bit as they were.
    # No version counter sees a write through .data; on a prep's first call f writes into copies,
    # whose values are compared (else f's derivative is taken at the values it wrote, silently)
    x, c = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.25, 0.125])
    before = snapshot(x, c)

    def f(v: Any, c: Any) -> Any:
        (v if into == "x" else c).data.mul_(2.0)
        if raises:
            raise ValueError("f's own error, after its write")
        return (v**2 * c).sum()

    named = "x" if into == "x" else r"contexts\[0\]"
    with pytest.raises(di.MutationError, match=named):
        di.gradient(f, BACKENDS[mode], x, di.Constant(c))
    assert same(before, x, c)


class _Strided(torch.nn.Module):
    """A module whose tensors are views torch will not read as bytes as they are: a strided
    buffer, a column of a matrix as a parameter, a conjugate view."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.randn(6)[::2])
        self.bias = torch.nn.Parameter(torch.randn(3, 2)[:, 0])
        self.register_buffer("phase", torch.randn(3, dtype=torch.complex64).conj())

    def forward(self, v: Any) -> Any:
        return v * self.scale + self.bias + self.phase.real


@pytest.mark.parametrize("mode", list(BACKENDS))
def test_a_modules_strided_and_conjugate_tensors_are_compared_and_put_back(mode: str) -> None:
    # expected: the gradient, on the first call and later ones (the comparison of a module's
    # tensors with their copies raised torch's RuntimeError on a strided buffer); a write into
    # the strided buffer on a first call named and put back
    module, x = _Strided(), torch.randn(3)
    before = snapshot(module)
    backend = BACKENDS[mode]
    for _ in range(2):
        torch.testing.assert_close(di.gradient(lambda v, m: m(v).sum(), backend, x, di.Constant(module)), module.scale)

    def writes(v: Any, m: Any) -> Any:
        m.scale.data.add_(1.0)
        return m(v).sum()

    with pytest.raises(di.MutationError, match="'scale'"):
        di.gradient(writes, backend, x, di.Constant(module))
    assert same(before, module)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, v: Any) -> Any:
        return self.norm(self.lin(v))


class _Trainer:
    """An object that holds the model f calls (``di.Constant(trainer)``), beside data."""

    def __init__(self, net: Any) -> None:
        self.parts = {"net": net}
        self.history = [0.0] * 100


@pytest.mark.parametrize("mode", list(BACKENDS))
@pytest.mark.parametrize("held", [False, True])
def test_a_batchnorm_in_train_mode_names_its_buffer_and_is_put_back(mode: str, held: bool) -> None:
    # expected: a MutationError naming a buffer of the norm layer of contexts[0]; every
    # parameter and buffer of the module bit for bit as it was; also for the module held by an
    # object in the Constant, whose BatchNorm's writes went unseen in autograd mode
    torch.manual_seed(0)
    net, head, batch = Net().train(), torch.randn(4), torch.randn(8, 4)
    net.requires_grad_(False)
    before = snapshot(net)
    constant = di.Constant(_Trainer(net) if held else net)

    def f(h: Any, model: Any, b: Any) -> Any:
        model = model.parts["net"] if held else model
        return (model(b) @ h).square().mean()

    with pytest.raises(
        di.MutationError, match=r"buffer 'norm\.(running_mean|running_var|num_batches_tracked)'.*contexts\[0\]"
    ):
        di.gradient(f, BACKENDS[mode], head, constant, di.Constant(batch))
    assert same(before, net)
    net.eval()  # (in eval mode the same call reads the buffers only)
    grad = di.gradient(f, BACKENDS[mode], head, constant, di.Constant(batch))
    assert grad.shape == head.shape and same(before, net)


@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_a_batchnorm_is_put_back_beside_another_write(prepared: bool) -> None:
    # expected: the MutationError names the Constant tensor f wrote first, and the train-mode
    # BatchNorm's buffers, which f also wrote, are put back all the same (they were lost)
    torch.manual_seed(0)
    norm, scale, x = torch.nn.BatchNorm1d(3).train(), torch.ones(3), torch.randn(5, 3)
    before = snapshot(norm)

    def f(v: Any, s: Any, model: Any) -> Any:
        s.add_(1.0)
        return model(v).square().sum()

    contexts = (di.Constant(scale), di.Constant(norm))
    prep = di.prepare_gradient(f, "torch", x, *contexts) if prepared else None
    with pytest.raises(di.MutationError, match=r"contexts\[0\]"):
        di.gradient(f, "torch", x, *contexts, prep=prep)
    assert same(before, norm) and torch.equal(scale, torch.ones(3))


def test_held_finds_models_in_attributes_and_small_containers() -> None:
    from diffiface._contexts import held

    def is_module(value: object) -> bool:
        return isinstance(value, torch.nn.Module)

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    class Box:
        pass

    outer, inner = Box(), Box()
    inner.model = b  # type: ignore[attr-defined]
    outer.__dict__.update(model=a, again=a, inner=inner, ensemble=[a, b], data=[b] + [0.0] * 100)
    assert held(a, is_module) == [a]
    assert {id(m) for m in held(outer, is_module)} == {id(a), id(b)}
    shallow = Box()
    shallow.__dict__.update(model=a, inner=inner)
    assert held(shallow, is_module, depth=1) == [a]  # (inner's model is two objects deep)
    only = Box()
    only.data = [b] + [0.0] * 100  # type: ignore[attr-defined]  # (a long list is data: not looked into)
    assert held(only, is_module) == []
    assert held(3.0, is_module) == []


@pytest.mark.parametrize("mode", list(BACKENDS))
@pytest.mark.parametrize("through", ["itself", ".data", "detach()", "a view"])
def test_a_write_into_a_frozen_parameter_on_the_first_call_is_put_back(mode: str, through: str) -> None:
    # expected: a MutationError naming parameter 'lin.weight' of contexts[0], and the module bit
    # for bit as it was: a prep's first call copies a Constant module's tensors (under torch.func
    # the write never lands); also a write through .data, which no version counter sees, and
    # (named under torch.func too) through another tensor on the parameter's memory
    torch.manual_seed(0)
    net, head, batch = Net().eval(), torch.randn(4), torch.randn(8, 4)
    net.requires_grad_(False)
    before = snapshot(net)

    def f(h: Any, model: Any, b: Any) -> Any:
        with torch.no_grad():
            _written(model.lin.weight, through).mul_(2.0)
        return (model(b) @ h).square().mean()

    message = r"parameter 'lin\.weight'.*contexts\[0\]"
    with pytest.raises(di.MutationError, match=message) as raised:
        di.gradient(f, BACKENDS[mode], head, di.Constant(net), di.Constant(batch))
    assert same(before, net)
    if mode == "autograd":
        assert "put back, bit for bit" in str(raised.value)


@pytest.mark.parametrize("mode", list(BACKENDS))
def test_a_write_into_a_frozen_parameter_on_a_later_call_is_named_and_says_where_it_landed(mode: str) -> None:
    # expected: after a clean first call, the prep watches the module by its counters: in
    # autograd mode a write is a MutationError that says the caller's module holds it (and it
    # does); under torch.func the write is refused before it lands
    torch.manual_seed(0)
    net, head, batch = Net().eval(), torch.randn(4), torch.randn(8, 4)
    net.requires_grad_(False)
    writes = [False]

    def f(h: Any, model: Any, b: Any) -> Any:
        if writes[0]:
            with torch.no_grad():
                model.lin.weight.mul_(2.0)
        return (model(b) @ h).square().mean()

    prep = di.prepare_gradient(f, BACKENDS[mode], head, di.Constant(net), di.Constant(batch))
    di.gradient(f, BACKENDS[mode], head, di.Constant(net), di.Constant(batch), prep=prep)
    before = snapshot(net)
    writes[0] = True
    message = r"parameter 'lin\.weight'.*contexts\[0\]"
    if mode == "autograd":
        message += r".*now holds what f wrote.*first call copies"
    with pytest.raises(di.MutationError, match=message):
        di.gradient(f, BACKENDS[mode], head, di.Constant(net), di.Constant(batch), prep=prep)
    assert same(before, net) == (mode == "func")


def test_a_module_holding_a_nan_is_not_taken_for_written() -> None:
    # expected: the first call's check compares bits, so a NaN parameter equals its copy
    net, head, batch = Net().eval(), torch.randn(4), torch.randn(8, 4)
    net.requires_grad_(False)
    with torch.no_grad():
        net.lin.bias[0] = float("nan")
    grad = di.gradient(
        lambda h, m, b: (m(b) @ h).sum(), BACKENDS["autograd"], head, di.Constant(net), di.Constant(batch)
    )
    assert grad.shape == head.shape


def test_a_frozen_backbones_later_calls_clone_none_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # expected: a frozen 4.2M-parameter backbone as a di.Constant is copied on the prep's first
    # call (the full guard) and on no later call (its version counters only)
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.LayerNorm(2048)).eval()
    backbone.requires_grad_(False)
    head, batch = torch.randn(2048), torch.randn(4, 2048)

    def f(h: Any, net: Any, b: Any) -> Any:
        return (net(b) @ h).square().sum()

    storages = {t.untyped_storage().data_ptr() for t in [*backbone.parameters(), *backbone.buffers()]}
    cloned: list[int] = []
    clone = torch.Tensor.clone

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.untyped_storage().data_ptr() in storages:
            cloned.append(self.numel())
        return clone(self, *args, **kwargs)

    prep = di.prepare_gradient(f, "torch", head, di.Constant(backbone), di.Constant(batch))
    monkeypatch.setattr(torch.Tensor, "clone", counting)
    di.gradient(f, "torch", head, di.Constant(backbone), di.Constant(batch), prep=prep)
    assert sum(cloned) >= 2048 * 2048  # (the count means something: the first call copies it)
    cloned.clear()
    for _ in range(3):
        di.gradient(f, "torch", head, di.Constant(backbone), di.Constant(batch), prep=prep)
    monkeypatch.undo()
    assert cloned == []


@pytest.mark.parametrize("mode", list(BACKENDS))
def test_a_write_into_a_parameter_as_x_names_it(mode: str) -> None:
    # expected: x = dict(named_parameters()); a write into one is a MutationError naming
    # x['weight'], the module's parameter bit for bit as it was and still a leaf without .grad
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    params = dict(layer.named_parameters())
    before = snapshot(params)
    batch = torch.randn(5, 3)

    def f(p: Any, b: Any) -> Any:
        with torch.no_grad():
            p["weight"].zero_()
        return torch.func.functional_call(layer, p, (b,)).square().sum()

    with pytest.raises(di.MutationError, match=r"x\['weight'\]"):
        di.gradient(f, BACKENDS[mode], params, di.Constant(batch))
    assert same(before, params)
    assert all(p.is_leaf and p.grad is None and p.requires_grad for p in layer.parameters())


def mlp_loss(p: Any, model: Any, b: Any) -> Any:
    return torch.func.functional_call(model, p, (b,)).square().mean()


@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_parameters_results_are_detached_by_default_and_keep_a_graph_when_asked(prepared: bool) -> None:
    # expected: gradients of named_parameters() equal torch.autograd.grad's; detached (no
    # requires_grad, no grad_fn) by default; with create_graph=True they carry the graph to the
    # parameters (a gradient penalty's derivative equals torch's own); no .grad written
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    params, batch = dict(model.named_parameters()), torch.randn(6, 3, dtype=torch.float64)
    native = torch.autograd.grad(mlp_loss(params, model, batch), list(params.values()), create_graph=True)
    for backend in (di.AutoTorch(), "torch", di.AutoTorch(create_graph=True)):
        ctx = (di.Constant(model), di.Constant(batch))
        prep = di.prepare_gradient(mlp_loss, backend, params, *ctx) if prepared else None
        graph = backend == di.AutoTorch(create_graph=True)
        for _ in range(2):  # (a prep's first call, on copies, and a later one, on aliases of the parameters)
            grads = di.gradient(mlp_loss, backend, params, *ctx, prep=prep)
            for got, want in zip(grads.values(), native, strict=True):
                torch.testing.assert_close(got.detach(), want.detach())
            assert all((g.grad_fn is not None) == graph and g.requires_grad == graph for g in grads.values())
        if graph:
            penalty = sum(g.square().sum() for g in grads.values())
            expected = torch.autograd.grad(sum(g.square().sum() for g in native), list(params.values()))
            got = torch.autograd.grad(penalty, list(params.values()))
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b)
    assert all(p.grad is None and p.is_leaf for p in model.parameters())


@pytest.mark.parametrize("backend", ["torch", "torch-func", di.AutoTorch(create_graph=True)], ids=str)
def test_one_parameter_at_two_leaves_gets_each_leafs_own_derivative(backend: Any) -> None:
    # expected: tied weights, one nn.Parameter at two leaves of x, get the partial derivative of
    # each leaf (2 and 3 here), on a prep's first call and on later ones, prepared or not; a
    # call differentiating the parameter itself would give both leaves the sum, 5
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))

    def f(p: Any) -> Any:
        return (p["a"] * 2 + p["b"] * 3).sum()

    x = {"a": w, "b": w}
    prep = di.prepare_gradient(f, backend, x)
    for _ in range(3):
        for grads in (di.gradient(f, backend, x), di.gradient(f, backend, x, prep=prep)):
            torch.testing.assert_close(grads["a"].detach(), torch.full((2,), 2.0, dtype=torch.float64))
            torch.testing.assert_close(grads["b"].detach(), torch.full((2,), 3.0, dtype=torch.float64))
    assert w.grad is None


@pytest.mark.parametrize("backend", ["torch", "torch-func", di.AutoTorch(create_graph=True)], ids=str)
def test_a_parameters_own_gradient_hook_does_not_change_the_derivative(backend: Any) -> None:
    # expected: a hook the caller registered on an nn.Parameter (here one that zeroes its
    # gradient, as torch.autograd.grad on the parameter itself applies) is not part of f: the
    # derivative of f, 3, on a prep's first call and on later ones, prepared or not
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    w.register_hook(lambda g: g * 0)

    def f(p: Any) -> Any:
        return (p["w"] * 3).sum()

    prep = di.prepare_gradient(f, backend, {"w": w})
    for _ in range(3):
        for grads in (di.gradient(f, backend, {"w": w}), di.gradient(f, backend, {"w": w}, prep=prep)):
            torch.testing.assert_close(grads["w"].detach(), torch.full((2,), 3.0, dtype=torch.float64))


def test_a_nested_call_on_parameters_keeps_its_graph_by_default() -> None:
    # expected: a diffiface gradient inside a function diffiface differentiates keeps the graph
    # (the outer call needs it): the outer Hessian-vector product equals torch's double backward
    w = torch.randn(4, dtype=torch.float64)
    t = torch.randn(4, dtype=torch.float64)

    def g(v: Any) -> Any:
        return (torch.sin(v) * v**2).sum()

    def directional(v: Any) -> Any:
        return di.gradient(g, "torch", v) @ t

    got = di.gradient(directional, "torch", w)
    leaf = w.clone().requires_grad_(True)
    (first,) = torch.autograd.grad(g(leaf), leaf, create_graph=True)
    (expected,) = torch.autograd.grad(first @ t, leaf)
    torch.testing.assert_close(got, expected)
    assert not got.requires_grad


def test_the_route_of_parameters_is_the_detached_leaves_one() -> None:
    # expected: x = dict(named_parameters()) enters the adapter through the same functions as
    # its detached copy: no slower path for leaves that require grad
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    params = dict(model.named_parameters())
    detached = {k: v.detach() for k, v in params.items()}
    batch = di.Constant(torch.randn(5, 3))

    def loss(p: Any, b: Any) -> Any:
        return torch.func.functional_call(model, p, (b,)).square().sum()

    routes = []
    for x in (detached, params):
        prep = di.prepare_gradient(loss, "torch", x, batch)
        di.gradient(loss, "torch", x, batch, prep=prep)
        routes.append(adapter_frames(lambda x=x, prep=prep: di.gradient(loss, "torch", x, batch, prep=prep)))
    assert routes[0] == routes[1]
    assert "guarded" not in " ".join(routes[1])


@pytest.mark.parametrize("backbone", [False, True], ids=["model Constant", "frozen backbone"])
def test_a_module_constant_takes_the_one_call_and_its_writes_are_named(backbone: bool) -> None:
    # expected: the model (or a frozen backbone) as di.Constant takes the same one call as a
    # tensor Constant, with the module's states watched (_module_states, _mutation), not the
    # guard's steps; the gradient is torch.autograd.grad's; a write into the module's
    # parameter on a later call is a MutationError naming it (as x's leaf where it is one)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    if backbone:
        model.requires_grad_(False)
    head = torch.nn.Linear(2, 1)
    x = dict((model if not backbone else head).named_parameters())
    batch = torch.randn(5, 3)
    write = [False]

    def loss(p: Any, net: Any, b: Any) -> Any:
        if write[0]:
            with torch.no_grad():
                net[0].weight.add_(1.0)
        if backbone:
            return torch.func.functional_call(head, p, (net(b),)).square().sum()
        return torch.func.functional_call(net, p, (b,)).square().sum()

    contexts = (di.Constant(model), di.Constant(batch))
    prep = di.prepare_gradient(loss, "torch", x, *contexts)
    di.gradient(loss, "torch", x, *contexts, prep=prep)
    route = adapter_frames(lambda: di.gradient(loss, "torch", x, *contexts, prep=prep))
    assert "_Gradient.__call__" in route and "_module_states" in route
    assert "guarded" not in " ".join(route)
    got = di.gradient(loss, "torch", x, *contexts, prep=prep)
    value = loss(x, model, batch)
    expected = dict(zip(x, torch.autograd.grad(value, list(x.values())), strict=True))
    for key, want in expected.items():
        assert not got[key].requires_grad
        torch.testing.assert_close(got[key], want)
    write[0] = True
    # (the model's parameters are x's own leaves, named as such; the backbone's are the module's)
    named = r"parameter '0\.weight'" if backbone else r"input x\['0\.weight'\]"
    with pytest.raises(di.MutationError, match=named):
        di.gradient(loss, "torch", x, *contexts, prep=prep)


class _Clones(TorchDispatchMode):
    """Records the size of every tensor torch copies (``aten.clone``, ``aten.copy_``) below
    autograd, whoever asks for the copy."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default):
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def copied_by(call: Any) -> list[int]:
    with _Clones() as clones:
        call()
    return clones.sizes


@pytest.mark.parametrize("mode", list(BACKENDS))
@pytest.mark.parametrize("case", ["parameters", "module Constant", "frozen backbone"])
def test_a_preps_later_calls_copy_nothing(mode: str, case: str) -> None:
    # expected: what torch users pass (named_parameters() as x, the model or a frozen backbone in
    # eval mode as di.Constant, a batch as di.Constant) is copied on a prep's first call (the
    # full guard) and never after it: no tensor copied at all, x, Constants and module alike
    torch.manual_seed(0)
    if case == "frozen backbone":
        model = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.LayerNorm(64), torch.nn.BatchNorm1d(64)).eval()
        model.requires_grad_(False)
        x: Any = torch.randn(64)

        def f(p: Any, net: Any, b: Any) -> Any:
            return (net(b) @ p).square().sum()

    else:
        model = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
        x = dict(model.named_parameters())

        def f(p: Any, net: Any, b: Any) -> Any:
            return torch.func.functional_call(net if net is not None else model, p, (b,)).square().sum()

    contexts = (di.Constant(model if case != "parameters" else None), di.Constant(torch.randn(5, 3)))
    backend = BACKENDS[mode]
    prep = di.prepare_gradient(f, backend, x, *contexts)
    first = copied_by(lambda: di.gradient(f, backend, x, *contexts, prep=prep))
    assert first  # (the count means something: the first call copies)
    for _ in range(2):
        assert copied_by(lambda: di.gradient(f, backend, x, *contexts, prep=prep)) == []
    native = torch.func.grad(f)(x, *(c.value for c in contexts))
    got = di.gradient(f, backend, x, *contexts, prep=prep)
    for key in native if isinstance(x, dict) else [None]:
        torch.testing.assert_close(got[key] if key else got, native[key] if key else native)


@pytest.mark.parametrize("mode", list(BACKENDS))
@pytest.mark.parametrize("where", ["x", "Constant tensor"])
def test_a_write_on_a_later_call_is_named_and_says_where_it_landed(mode: str, where: str) -> None:
    # expected: after a clean first call, a write by f (under no_grad, which torch lets through)
    # into x or a Constant tensor is a MutationError that names the leaf and says the caller's
    # tensor now holds it (the rule of docs/policies.md); under torch.func a write into a
    # Constant tensor is refused by torch before it lands, named the same
    w, data = {"w": torch.randn(3), "b": torch.randn(3)}, {"scale": torch.randn(3)}
    writes = [False]

    def f(p: Any, d: Any) -> Any:
        if writes[0]:
            with torch.no_grad():
                (p["b"] if where == "x" else d["scale"]).add_(1.0)
        return (p["w"] * p["b"] * d["scale"]).sum()

    backend = BACKENDS[mode]
    prep = di.prepare_gradient(f, backend, w, di.Constant(data))
    di.gradient(f, backend, w, di.Constant(data), prep=prep)
    writes[0] = True
    leaf = r"x\['b'\]" if where == "x" else r"contexts\[0\]\['scale'\]"
    before = snapshot(w, data)
    lands = mode == "autograd" or where == "x"
    with pytest.raises(
        di.MutationError, match=leaf + (r".*now holds what f wrote" if lands else r".*nothing was written")
    ):
        di.gradient(f, backend, w, di.Constant(data), prep=prep)
    assert same(before, w, data) is not lands


@pytest.mark.parametrize("mode", list(BACKENDS))
def test_a_write_under_grad_mode_into_x_is_refused_before_it_lands_on_a_later_call(mode: str) -> None:
    # expected: on a later call f gets the caller's x as a leaf that requires grad (autograd
    # mode), which torch refuses to let f write into: a MutationError naming x, x unchanged
    x = torch.randn(3)
    writes = [False]

    def f(v: Any) -> Any:
        if writes[0]:
            v.mul_(2.0)
        return (v * v).sum()

    backend = BACKENDS[mode]
    prep = di.prepare_gradient(f, backend, x)
    di.gradient(f, backend, x, prep=prep)
    writes[0] = True
    before = x.clone()
    with pytest.raises(di.MutationError, match="x"):
        di.gradient(f, backend, x, prep=prep)
    if mode == "autograd":
        assert torch.equal(x, before)


class _HalfBackward(torch.autograd.Function):
    """x**2 whose backward pass reads a number out of its cotangent (torch.func cannot vmap it)."""

    @staticmethod
    def forward(v: Any) -> Any:
        return v**2

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        (v,) = ctx.saved_tensors
        return 2 * v * g * float(g.abs().max().item() >= 0.0)


def test_the_autograd_jacobian_is_jacrevs_and_falls_back_where_f_does_not_allow_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # expected: autograd mode's Jacobian equals torch.func.jacrev's through its one vmapped
    # program (jacrev called); an f that calls .item() on a tensor (a number cut from the graph),
    # and one whose backward pass cannot be vmapped (the rows one by one), get the right
    # Jacobian, detached, x unchanged
    import diffiface._adapters.torch as adapter

    a = torch.randn(6, 4, dtype=torch.float64)
    x = torch.randn(4, dtype=torch.float64)
    before = x.clone()

    def f(v: Any) -> Any:
        return torch.tanh(a @ v) * v.sum()

    transforms: list[str] = []
    jacrev = torch.func.jacrev
    monkeypatch.setattr(adapter.func, "jacrev", lambda *a, **k: transforms.append("jacrev") or jacrev(*a, **k))
    got = di.jacobian(f, "torch", x)
    assert transforms
    monkeypatch.undo()
    torch.testing.assert_close(got, torch.func.jacrev(f)(x))

    def with_item(v: Any) -> Any:
        return torch.sin(v) * float((v * 0).sum().item() + 2.0)

    def unbatchable(v: Any) -> Any:
        return _HalfBackward.apply(v) + v

    with pytest.raises(RuntimeError):  # (the case means something: torch.func cannot vmap its backward)
        torch.func.jacrev(unbatchable)(x)
    for g, expected in ((with_item, torch.diag(2 * torch.cos(x))), (unbatchable, torch.diag(2 * x + 1))):
        for backend in ("torch", di.AutoTorch()):
            jac = di.jacobian(g, backend, x)
            torch.testing.assert_close(jac, expected)
            assert not jac.requires_grad
    assert torch.equal(x, before)


@pytest.mark.parametrize("name", ["torch", "torch-func"])
def test_a_jacobian_through_cdist_is_right_though_torch_batches_its_backward_wrongly(name: str) -> None:
    """torch.func.vmap batches cdist's backward to wrong numbers without an error (jacrev of
    ``cdist(x, y, p=1)`` differs from the rows one by one): the Jacobian, a prepared one and a
    batch of vjps (a sparse Jacobian's rows) through it come from the rows one by one, equal to
    torch's own unbatched Jacobian; the graph of an f without cdist is not flagged."""
    from diffiface._adapters.torch import _engine

    y = torch.tensor([[0.3, -1.0, 2.0], [1.5, 0.2, -0.7], [-0.4, 0.9, 0.1], [2.2, -1.3, 0.5]], dtype=torch.float64)
    x = torch.tensor([[0.1, 0.2, -0.3], [-1.1, 0.4, 0.8], [0.7, -0.6, 1.9]], dtype=torch.float64)

    def f(v: Any, c: Any) -> Any:
        return torch.cdist(v, c, p=1.0).sum(0)

    expected = torch.autograd.functional.jacobian(lambda v: f(v, y), x)
    assert not torch.allclose(torch.func.jacrev(lambda v: f(v, y))(x), expected), (
        "torch batches cdist's backward rightly now: _engine._BATCHED_WRONGLY need not name CdistBackward0"
    )
    torch.testing.assert_close(di.jacobian(f, name, x, di.Constant(y)), expected)
    prep = di.prepare_jacobian(f, name, x, di.Constant(y))
    torch.testing.assert_close(di.jacobian(f, name, x, di.Constant(y), prep=prep), expected)
    seeds = di.Tangents(torch.eye(4, dtype=torch.float64)[0], torch.eye(4, dtype=torch.float64)[3])
    rows = di.batched_vjp(f, name, x, seeds, di.Constant(y))
    for row, k in zip(rows, (0, 3), strict=True):
        torch.testing.assert_close(row, expected[k])
    leaf = x.clone().requires_grad_()
    with torch.enable_grad():
        assert _engine.batched_wrongly(torch.cdist(leaf, y, p=1.0).sum(0))
        assert not _engine.batched_wrongly((leaf.sin() * 2).sum(0))


@pytest.mark.parametrize("name", ["torch", "torch-func"])
def test_an_operation_without_a_forward_mode_rule_is_named(name: str) -> None:
    """cdist has no forward-mode derivative in torch: a jvp through it raised torch's own
    NotImplementedError; it is an UnsupportedOperationError that names the operation and the
    reverse-mode ways, x unchanged, and a vjp through it still works."""
    y = torch.tensor([[0.3, -1.0, 2.0], [1.5, 0.2, -0.7]], dtype=torch.float64)
    x = torch.tensor([[0.1, 0.2, -0.3], [-1.1, 0.4, 0.8]], dtype=torch.float64)
    before = x.clone()

    def f(v: Any, c: Any) -> Any:
        return torch.cdist(v, c, p=1.0).sum(0)

    with pytest.raises(di.UnsupportedOperationError, match=r"f calls _cdist_forward.*AutoTorch\(jvp='reverse'\)"):
        di.jvp(f, name, x, torch.ones_like(x), di.Constant(y))
    if name == "torch-func":  # (forward over reverse)
        with pytest.raises(di.UnsupportedOperationError, match="_cdist_forward"):
            di.hvp(lambda v, c: f(v, c).sum(), name, x, torch.ones_like(x), di.Constant(y))
    assert torch.equal(x, before)
    expected = torch.autograd.functional.vjp(lambda v: f(v, y), x, torch.ones(2, dtype=torch.float64))[1]
    torch.testing.assert_close(di.vjp(f, name, x, torch.ones(2, dtype=torch.float64), di.Constant(y)), expected)


def _checkpointed(reentrant: bool) -> Any:
    def f(v: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(lambda a: (a.sin() ** 2).sum(), v, use_reentrant=reentrant)

    return f


def _dropout(v: Any) -> Any:
    return torch.nn.functional.dropout(v, 0.5, training=True).pow(2).sum()


def _out_into_x(v: Any) -> Any:
    torch.add(torch.ones_like(v), 1.0, out=v)  # (a write into x through out=)
    return (v**2).sum()


def _out_of_x(v: Any) -> Any:
    return torch.mul(v, 2.0, out=torch.empty_like(v)).pow(2).sum()


def _out_free(v: Any) -> Any:
    return torch.mul(v, 2.0).pow(2).sum()


@pytest.mark.parametrize(
    ("f", "name", "operator", "says", "way"),
    [
        (_checkpointed(False), "torch-func", "gradient", "saved-tensor hooks", (_checkpointed(False), "torch")),
        (_checkpointed(True), "torch", "gradient", "use_reentrant=False", (_checkpointed(False), "torch")),
        (_checkpointed(True), "torch", "hessian", "use_reentrant=False", (_checkpointed(False), "torch")),
        (_dropout, "torch-func", "hessian", "draws random numbers", (_dropout, "torch")),
        (_out_into_x, "torch", "gradient", "out= argument", (_out_free, "torch")),
        (_out_into_x, "torch-func", "gradient", "out= argument", (_out_free, "torch-func")),
        (_out_of_x, "torch", "gradient", "Compute out of place", (_out_free, "torch")),
        (_out_of_x, "torch-func", "gradient", "Compute out of place", (_out_free, "torch-func")),
    ],
    ids=[
        "checkpoint under torch.func",
        "reentrant checkpoint",
        "reentrant checkpoint, Hessian",
        "dropout's Hessian",
        "out= into x",
        "out= into x under torch.func",
        "out= of a value of x",
        "out= of a value of x under torch.func",
    ],
)
def test_what_torch_refuses_in_f_is_named(f: Any, name: str, operator: str, says: str, way: Any) -> None:
    """torch's own RuntimeErrors, raised by f or its backward pass (saved-tensor hooks under
    torch.func, a reentrant checkpoint under torch.autograd.grad, a random draw inside vmap, an
    out= argument where x's leaves require grad), are
    UnsupportedOperationErrors that say what to do; x unchanged; the way they name works."""
    x = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    before = x.clone()
    with pytest.raises(di.UnsupportedOperationError, match=says):
        getattr(di, operator)(f, name, x)
    assert torch.equal(x, before)
    fixed, backend = way
    assert torch.isfinite(getattr(di, operator)(fixed, backend, x)).all()


@pytest.mark.parametrize("name", ["torch", "torch-func"])
def test_forward_mode_refuses_an_output_cut_from_x(name: str) -> None:
    """Forward mode, ours or torch.func's: an output cut from x (.item(), .detach()) carries no
    tangent and is refused, not read as a zero derivative (torch.func's jvp gave zeros); an
    output apart from x keeps its zero tangent."""
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    t = torch.ones(3, dtype=torch.float64)
    with pytest.raises(di.InvalidOutputError):
        di.jvp(lambda v: torch.tensor([(v**2).sum().item()], dtype=torch.float64), name, x, t)
    with pytest.raises(di.InvalidOutputError):
        di.jvp(lambda v: {"a": v.sin(), "b": (v**2).detach()}, name, x, t)
    with pytest.raises(di.InvalidOutputError):
        di.derivative(lambda s: (s * x).detach(), name, torch.tensor(1.0, dtype=torch.float64))
    _, tangent = di.jvp(lambda v: (v.sin(), torch.ones(2, dtype=torch.float64)), name, x, t)
    torch.testing.assert_close(tangent, torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("name", ["torch", "torch-func"])
def test_a_cut_hidden_by_a_constant_that_requires_grad_is_refused(name: str) -> None:
    """f's output requires grad through a Constant of another graph: that does not say x's graph
    leads to it. A value cut from x (``torch.tensor(y.item())``) is refused, not differentiated as
    zero; an output apart from x keeps its zero gradient."""
    x = torch.tensor([1.0, 2.0])
    c = torch.tensor(3.0, requires_grad=True)
    cut = lambda v, k: torch.tensor((v**2).sum().detach().item()) * k  # noqa: E731
    with pytest.raises(di.InvalidOutputError, match="changes with x"):
        di.gradient(cut, name, x, di.Constant(c))
    with pytest.raises(di.InvalidOutputError, match="changes with x"):
        di.gradient(lambda z: di.gradient(cut, name, x, di.Constant(z.sum()))[0], name, torch.tensor([3.0]))
    np.testing.assert_array_equal(di.gradient(lambda v, k: k * 2.0, name, x, di.Constant(c)).numpy(), [0.0, 0.0])
    value, grad = di.value_and_gradient(lambda v, k: (k * v).sum(), name, x, di.Constant(c))
    assert float(value.detach()) == 9.0
    np.testing.assert_array_equal(grad.detach().numpy(), [3.0, 3.0])
    assert grad.requires_grad is (name == "torch-func")  # (torch.func's rule: c's graph kept)


@pytest.mark.parametrize("name", ["torch", "torch-func"])
def test_a_bfloat16_output_cut_from_x_is_refused(name: str) -> None:
    """A bfloat16 x moved by 1e-3 of its scale rounds back to x (1.7 + 0.0027 is 1.7 there), so
    an output cut from x read as constant: its gradient came back zeros, where 2 x is right.
    The move is a few of x's epsilons where they are coarser than 1e-3."""
    x = torch.tensor([-5e-4, 1.7, -2.6], dtype=torch.bfloat16)
    with pytest.raises(di.InvalidOutputError, match="changes with x"):
        di.gradient(lambda v: torch.tensor((v**2).sum().item(), dtype=v.dtype), name, x)
    assert not di.gradient(lambda v: (v**2).sum(), name, x).eq(0).all()


@pytest.mark.parametrize("name", ["torch", "torch-func"])
def test_a_cut_output_in_a_coarse_dtype_is_refused_not_read_as_a_jump(name: str) -> None:
    """A cut output rounded to bfloat16 moves by one step of its own, then stays, as x moves
    away: the pattern of a jump near x. Read as one, its gradient came back zeros, with no
    error, where 2 x is right: it is refused as cut."""
    x = torch.tensor([1.7, 2.3, 0.4])
    with pytest.raises(di.InvalidOutputError, match="changes with x"):
        di.gradient(lambda v: torch.tensor((v**2).sum().item()).to(torch.bfloat16), name, x)


@pytest.mark.parametrize("backend", [di.AutoTorch(create_graph=True), "torch-func"])
def test_a_gradient_penalty_through_a_constant_critic_keeps_its_graph(backend: Any) -> None:
    """A gradient penalty (the gradient of a critic with respect to its input, the critic a
    Constant whose parameters require grad): asked for, or under torch.func, the input gradient
    keeps its graph to the critic's parameters, as torch's own call does. It was detached because
    x itself requires no grad, and the penalty's part of the critic's gradient read as zero."""
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    points = torch.randn(16, 4, dtype=torch.float64)

    def critic_sum(x: Any, model: Any) -> Any:
        return model(x).sum()

    def penalty(input_grad: Any) -> Any:  # (with the critic's own loss, as a critic's step takes it)
        return critic(points).mean() + 10 * ((input_grad.norm(dim=1) - 1) ** 2).mean()

    leaf = points.clone().requires_grad_()
    (native,) = torch.autograd.grad(critic_sum(leaf, critic), leaf, create_graph=True)
    expected = torch.autograd.grad(penalty(native), list(critic.parameters()))
    got_grad = di.gradient(critic_sum, backend, points, di.Constant(critic))
    assert got_grad.requires_grad
    got = torch.autograd.grad(penalty(got_grad), list(critic.parameters()))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    (cotangent,) = torch.randn(1, dtype=torch.float64, requires_grad=True).expand(1, 1).clone().unbind(0)
    pulled = di.vjp(lambda x, m: m(x).sum().reshape(1), backend, points, cotangent, di.Constant(critic))
    assert pulled.requires_grad  # (the cotangent's graph and the critic's)
    plain = di.gradient(critic_sum, "torch", points, di.Constant(critic))
    assert not plain.requires_grad  # (not asked for: detached, as torch.autograd.grad's without create_graph)


def test_a_module_made_under_inference_mode_is_explained() -> None:
    """autograd cannot save inference tensors for backward: a Constant module built under
    torch.inference_mode() is refused with a diffiface error that says what to do."""
    import copy

    with torch.inference_mode():
        module = torch.nn.Linear(3, 1).double()
    x = torch.randn(3, dtype=torch.float64)
    with pytest.raises(di.FrameworkMismatchError, match="inference_mode"):
        di.gradient(lambda v, m: m(v).sum(), "torch", x, di.Constant(module))
    got = di.gradient(lambda v, m: m(v).sum(), "torch", x, di.Constant(copy.deepcopy(module)))
    torch.testing.assert_close(got, module.weight[0].clone())


@pytest.mark.parametrize("backend", ["torch", "torch-func", di.AutoTorch(create_graph=True)], ids=str)
def test_results_under_inference_mode_keep_no_graph(backend: Any) -> None:
    """The caller's inference_mode turns recording off, as no_grad does: an nn.Parameter's
    results (of one leaf or of a dict of them) come back with no graph under both, and right."""
    p = torch.nn.Parameter(torch.tensor([0.3, -1.2, 0.8], dtype=torch.float64))
    b = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
    f = lambda v: (torch.sin(v) * v**2).sum()  # noqa: E731
    g = lambda q: f(q["p"]) + q["b"] ** 2  # noqa: E731  (x of two leaves: their graph was kept)
    expected = torch.func.grad(f)(p.detach())
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = di.gradient(f, backend, p)
            two = di.gradient(g, backend, {"p": p, "b": b})
        for leaf in (got, *two.values()):
            assert not leaf.requires_grad and leaf.grad_fn is None
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(two, {"p": expected, "b": 2 * b.detach()})


@pytest.mark.parametrize("name", ["torch", "torch-func"])
def test_an_expanded_x_serves_every_call_of_a_prep(name: str) -> None:
    """An expanded x (a zero stride: its elements share memory) worked on a prep's first call,
    which copies x, and failed on the next, which handed f the caller's tensor: forward mode and
    torch.func's writes refuse it (the autograd-mode jvp blamed a torch.func transform)."""
    x = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64).expand(4, 3)
    t = torch.ones(4, 3, dtype=torch.float64)
    f = lambda v: torch.sin(v) * v  # noqa: E731
    expected = torch.cos(x) * x + torch.sin(x)
    prep = di.prepare_jvp(f, name, x, t)
    for _ in range(2):
        torch.testing.assert_close(di.jvp(f, name, x, t, prep=prep), expected)
    g = lambda v: (torch.sin(v) * v).sum()  # noqa: E731
    prep = di.prepare_hvp(g, name, x, t)
    for _ in range(2):
        torch.testing.assert_close(di.hvp(g, name, x, t, prep=prep), 2 * torch.cos(x) - x * torch.sin(x))


def test_a_batch_of_jvps_of_a_drawing_f_takes_one_draw() -> None:
    # expected: autograd mode evaluated f once per tangent, each drawing its own dropout mask: the
    # products of t and 2 t were no multiple of each other, nor of the value's mask; each
    # evaluation now starts from the generator's state before the first
    torch.manual_seed(0)
    x, t = torch.randn(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)

    def f(v: Any) -> Any:
        return torch.nn.functional.dropout(v, 0.5, training=True) * 3.0

    value, (first, second) = di.value_and_batched_jvp(f, "torch", x, di.Tangents(t, 2 * t))
    assert torch.equal(second, 2 * first)
    assert torch.equal(value != 0, first != 0)


@pytest.mark.parametrize("mode", list(BACKENDS))
def test_a_change_to_a_constant_modules_structure_is_put_back(mode: str) -> None:
    # expected: f setting a new Parameter into a Constant module, or switching it to eval mode,
    # left the caller's module changed with no error (the watch saw writes into the tensors it
    # had, not new ones); on a prep's first call the structure is compared, put back and refused
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).train()
    weight = model[0].weight

    def rebinds(v: Any, m: Any) -> Any:
        m[0].weight = torch.nn.Parameter(torch.zeros(2, 3))
        return m(v).sum()

    def evaluates(v: Any, m: Any) -> Any:
        m.eval()
        return m(v).sum()

    for f in (rebinds, evaluates):
        with pytest.raises(di.MutationError, match="put back"):
            di.gradient(f, BACKENDS[mode], torch.randn(3), di.Constant(model))
        assert model[0].weight is weight and model.training and model[0].training


@pytest.mark.parametrize("mode", list(BACKENDS))
def test_a_batchnorm_f_switches_to_train_mode_is_named_with_its_buffer(mode: str) -> None:
    # expected: on a prep's later call, f switching a Constant eval-mode module to train mode,
    # whose BatchNorm then updated its buffers, got a MutationError that said only "it has been
    # put back": the mode was, the buffers stayed written. The message names the buffer and says
    # it stayed, as any later call's write; on a prep's first call it is put back bit for bit
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).eval()
    params, batch = dict(net.named_parameters()), torch.randn(6, 3)

    def loss(p: Any, m: Any, b: Any, train: bool) -> Any:
        if train:
            m.train()
        return torch.func.functional_call(m, p, (b,)).pow(2).sum()

    contexts = (di.Constant(net), di.Constant(batch))
    prep = di.prepare_gradient(loss, BACKENDS[mode], params, *contexts, di.Constant(False))
    before = snapshot(net)
    writes = mode == "autograd"  # (torch.func refuses the BatchNorm's write before it lands)
    buffer = r"buffer '1\.(running_mean|running_var|num_batches_tracked)' of the torch\.nn\.Module contexts\[0\]"
    with pytest.raises(di.MutationError, match="mode; that change has been put back") as raised:
        di.gradient(loss, BACKENDS[mode], params, *contexts, di.Constant(True), prep=prep)
    assert bool(re.search(f"{buffer}.*put back, bit for bit", str(raised.value))) is writes
    assert same(before, net) and not net.training and not net[1].training
    di.gradient(loss, BACKENDS[mode], params, *contexts, di.Constant(False), prep=prep)
    with pytest.raises(di.MutationError, match="mode; that change has been put back") as raised:
        di.gradient(loss, BACKENDS[mode], params, *contexts, di.Constant(True), prep=prep)
    assert bool(re.search(f"{buffer}.*now holds what f wrote", str(raised.value))) is writes
    assert same(before, net) is not writes and not net.training and not net[1].training


@pytest.mark.parametrize("mode", list(BACKENDS))
def test_a_force_field_in_a_forward_mode_jvp_is_named(mode: str) -> None:
    # expected: f's own torch.autograd.grad of an energy failed on a jvp's x (a forward-mode dual,
    # a torch.func tensor: it does not require grad) with torch's bare RuntimeError; it is an
    # UnsupportedOperationError naming the way round, which gives the Jacobian's product
    torch.manual_seed(0)
    x, t = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)

    def forces(v: Any) -> Any:
        (grad,) = torch.autograd.grad((torch.sin(v) * v**2).sum(), v, create_graph=True)
        return -grad

    with pytest.raises(di.UnsupportedOperationError, match=r"jvp='reverse'"):
        di.jvp(forces, BACKENDS[mode], x, t)
    expected = di.jacobian(forces, "torch", x) @ t
    torch.testing.assert_close(di.jvp(forces, di.AutoTorch(jvp="reverse"), x, t), expected)


@pytest.mark.parametrize(
    "backend", ["torch", di.AutoTorch(create_graph=True), "torch-func"], ids=["autograd", "create_graph", "func"]
)
@pytest.mark.parametrize("detached", [False, True], ids=["parameters", "detached"])
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_an_f_that_runs_the_module_instead_of_its_argument_is_refused(
    backend: Any, detached: bool, prepared: bool
) -> None:
    """The torch user's slip: ``model(data)`` in f, where x is ``dict(model.named_parameters())``
    (or detached views of them), rather than ``functional_call(model, params, ...)``. f reads
    x's tensors itself, and the gradient through that read came back zeros, with no error (in
    torch.func mode, and create_graph's jvp, until the engine's output test saw the read there too)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1)).double()
    params = {k: p.detach() if detached else p for k, p in model.named_parameters()}
    data = torch.randn(5, 3, dtype=torch.float64)

    def slip(p: Any) -> Any:
        return (model(data) ** 2).mean()

    prep = di.prepare_gradient(slip, backend, params) if prepared else None
    for operator in (di.gradient, di.value_and_gradient):
        with pytest.raises(di.InvalidOutputError, match="reads the tensors of x itself"):
            operator(slip, backend, params, prep=prep if operator is di.gradient else None)
    # the other operators whose engine in autograd mode is a backward or forward pass of f
    ones = {k: torch.ones_like(v) for k, v in params.items()}
    others: list[Callable[[], Any]] = [
        lambda: di.vjp(lambda p: model(data).reshape(-1), backend, params, torch.ones(5, dtype=torch.float64)),
        lambda: di.jacobian(lambda p: model(data).reshape(-1), backend, params),
        lambda: di.hvp(slip, backend, params, ones),
        lambda: di.hessian(slip, backend, params),
        lambda: di.jvp(lambda p: model(data).reshape(-1), backend, params, ones),
    ]
    for other in others:
        with pytest.raises(di.InvalidOutputError, match="reads the tensors of x itself"):
            other()
    # f on its argument, and an f that truly ignores x beside a tensor that requires grad, are served
    right = di.gradient(lambda p: (torch.func.functional_call(model, p, (data,)) ** 2).mean(), backend, params)
    assert all(bool(g.abs().sum() > 0) for g in right.values())
    other = torch.randn(3, dtype=torch.float64, requires_grad=True)
    zero = di.gradient(lambda p: (other**2).sum(), backend, params)
    assert all(bool(g.eq(0).all()) for g in zero.values())


def _writes_its_cache(how: str) -> Callable[..., Any]:
    """An f that reads its Cache (what the last call left there), then writes into it a value
    computed from x (``cache.copy_(h)`` or ``cache[:] = h``)."""

    def f(x: Any, cache: Any) -> Any:
        y = (cache + x).sum()
        if how == "copy_":
            cache.copy_(x * 2)
        else:
            cache[:] = x * 2
        return y * (cache**2).sum()

    return f


def _read_only(x: Any, last: Any) -> Any:
    """The f of :func:`_writes_its_cache` with what its Cache held on entry as a Constant."""
    return (last + x).sum() * ((x * 2) ** 2).sum()


_CACHE_CALLS: dict[str, Callable[..., Any]] = {
    "gradient": lambda f, b, x, c, prep: di.gradient(f, b, x, c, prep=prep),
    "value_and_gradient": lambda f, b, x, c, prep: di.value_and_gradient(f, b, x, c, prep=prep)[1],
    "vjp": lambda f, b, x, c, prep: di.vjp(f, b, x, torch.tensor(1.0, dtype=x.dtype), c, prep=prep),
    "jvp": lambda f, b, x, c, prep: di.jvp(f, b, x, torch.ones_like(x), c, prep=prep),
    "jacobian": lambda f, b, x, c, prep: di.jacobian(f, b, x, c, prep=prep),
    "hvp": lambda f, b, x, c, prep: di.hvp(f, b, x, torch.ones_like(x), c, prep=prep),
    "hessian": lambda f, b, x, c, prep: di.hessian(f, b, x, c, prep=prep),
}


def _cache_prep(operator: str, f: Any, backend: Any, x: Any, cache: Any) -> Any:
    if operator in ("vjp", "jvp", "hvp"):
        tangent = torch.tensor(1.0, dtype=x.dtype) if operator == "vjp" else torch.ones_like(x)
        return getattr(di, f"prepare_{operator}")(f, backend, x, tangent, di.Cache(cache))
    return getattr(di, f"prepare_{operator}")(f, backend, x, di.Cache(cache))


@pytest.mark.parametrize("how", ["copy_", "setitem"])
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("operator", list(_CACHE_CALLS))
def test_a_cache_f_writes_from_x_keeps_no_graph_after_the_call(operator: str, prepared: bool, how: str) -> None:
    """A Cache tensor f wrote a value of x into was left in the call's graph (requires_grad, a
    CopyBackwards grad_fn): the caller's tensor kept that graph alive, and a backward pass of the
    caller's through it met a graph already freed (torch's raw RuntimeError)."""
    # expected: after every call the Cache holds what f wrote, requires no grad and has no
    # grad_fn; each call's derivative is that of f with what the last call left as a constant;
    # the caller's own backward pass through the Cache works
    backend = di.AutoTorch(jvp="reverse") if operator == "jvp" else "torch"  # (forward mode records no graph)
    f = _writes_its_cache(how)
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    cache = torch.zeros(3, dtype=torch.float64)
    call = _CACHE_CALLS[operator]
    prep = _cache_prep(operator, f, backend, x, cache) if prepared else None
    for step in range(3):
        last = cache.clone()
        got = call(f, backend, x + step, di.Cache(cache), prep)
        expected = call(_read_only, backend, x + step, di.Constant(last), None)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(cache, 2 * (x + step))
        assert not cache.requires_grad and cache.grad_fn is None
    weight = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (cache * weight).sum().backward()
    torch.testing.assert_close(weight.grad, cache)


def test_a_cache_keeps_its_graph_where_the_call_keeps_one() -> None:
    # expected: with create_graph=True the Cache keeps the graph f's write gave it (the results
    # carry theirs); a Cache that carried the caller's graph before the call is left as it is;
    # under torch.func the write is refused, a MutationError that says to use autograd mode
    f = _writes_its_cache("copy_")
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    cache = torch.zeros(3, dtype=torch.float64)
    grad = di.gradient(f, di.AutoTorch(create_graph=True), x, di.Cache(cache))
    assert grad.requires_grad and cache.requires_grad and cache.grad_fn is not None
    weight = torch.ones(3, dtype=torch.float64, requires_grad=True)
    carried = torch.zeros(3, dtype=torch.float64) * weight
    node = carried.grad_fn
    di.gradient(lambda x, c: (c * x).sum(), "torch", x, di.Cache(carried))
    assert carried.grad_fn is node
    with pytest.raises(di.MutationError, match="mode='autograd'"):
        di.gradient(f, "torch-func", x, di.Cache(torch.zeros(3, dtype=torch.float64)))


@pytest.mark.parametrize("operator", ["gradient", "hessian"])
def test_a_cache_that_is_a_view_f_writes_from_x_into_is_refused(operator: str) -> None:
    # expected: torch cannot detach a view in place: a ContextError naming the Cache's leaf and
    # saying to pass a tensor of its own; one that owns its memory beside it is cut all the same;
    # a view f does not write from x into is served
    f = _writes_its_cache("setitem")
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    buffer, own = torch.zeros(5, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)

    def g(x: Any, caches: Any) -> Any:
        caches["own"].copy_(x)
        return f(x, caches["view"])

    with pytest.raises(di.ContextError, match=r"contexts\[0\]\['view'\].*view.*clone\(\)"):
        getattr(di, operator)(g, "torch", x, di.Cache({"own": own, "view": buffer[:3]}))
    assert not own.requires_grad
    torch.testing.assert_close(own, x)
    read = torch.ones(5, dtype=torch.float64)[:3]
    torch.testing.assert_close(di.gradient(lambda x, c: (c * x).sum(), "torch", x, di.Cache(read)), read)


class _Scratch(torch.nn.Module):
    """f's scratch state: a buffer ``h`` and a tensor attribute ``t``, and a module inside."""

    def __init__(self, inner: bool = True) -> None:
        super().__init__()
        self.register_buffer("h", torch.zeros(3, dtype=torch.float64))
        self.t = torch.zeros(3, dtype=torch.float64)
        self.frozen = torch.nn.Parameter(torch.ones(3, dtype=torch.float64), requires_grad=False)
        self.inner = _Scratch(False) if inner else None


class _Holder:
    """A plain object holding a tensor and a module."""

    def __init__(self) -> None:
        self.h = torch.zeros(3, dtype=torch.float64)
        self.model = _Scratch(False)


def _writes_its_module(how: str) -> Callable[..., Any]:
    """An f that reads what its Cache module or object held (``where``), then writes there a value
    computed from x: in place, or by binding a new tensor (``holder.h = h``, ``register_buffer``)."""

    def f(x: Any, holder: Any) -> Any:
        target, name = {
            "buffer_copy_": (holder, "h"),
            "buffer_rebound": (holder, "h"),
            "register_buffer": (holder, "h"),
            "attribute": (holder, "t"),
            "inner_module": (getattr(holder, "inner", None), "h"),
            "object": (holder, "h"),
            "object_module": (getattr(holder, "model", None), "h"),
        }[how]
        y = (getattr(target, name) + x).sum()
        if how in ("buffer_copy_", "inner_module", "object_module"):
            getattr(target, name).copy_(x * 2)
        elif how == "register_buffer":
            target.register_buffer(name, x * 2)
        else:
            setattr(target, name, x * 2)
        return y * (getattr(target, name) ** 2).sum()

    return f


_MODULE_WRITES = [
    "buffer_copy_",
    "buffer_rebound",
    "register_buffer",
    "attribute",
    "inner_module",
    "object",
    "object_module",
]


@pytest.mark.parametrize("how", _MODULE_WRITES)
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("operator", [*_CACHE_CALLS, "jvp_forward"])
def test_a_cache_module_f_writes_from_x_keeps_no_graph_after_the_call(operator: str, prepared: bool, how: str) -> None:
    """A tensor that a Cache module (or a plain object in a Cache) holds, which f filled with a
    value of x (``module.h.copy_(h)``) or bound to one (``module.h = h``), kept the call's graph
    after the call: a leak across a training loop, and a freed graph for a later backward pass."""
    # expected: after every call each tensor the Cache holds requires no grad, holds what f
    # wrote; the derivative is f's with what the last call left as a constant; the module's
    # frozen parameter is left as it was; a backward pass of the caller's through it works
    forward = operator == "jvp_forward"
    operator = "jvp" if forward else operator
    backend = di.AutoTorch(jvp="forward" if forward else "reverse")
    f = _writes_its_module(how)
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    holder = _Holder() if how.startswith("object") else _Scratch()
    target = holder.model if how == "object_module" else holder.inner if how == "inner_module" else holder
    name = "t" if how == "attribute" else "h"
    call = _CACHE_CALLS[operator]
    prep = _cache_prep(operator, f, backend, x, holder) if prepared else None
    for step in range(3):
        last = getattr(target, name).clone()
        got = call(f, backend, x + step, di.Cache(holder), prep)
        expected = call(_read_only, backend, x + step, di.Constant(last), None)
        torch.testing.assert_close(got, expected)
        state = getattr(target, name)
        torch.testing.assert_close(state, 2 * (x + step))
        assert not state.requires_grad and state.grad_fn is None
    if isinstance(holder, torch.nn.Module):
        assert all(not tensor.requires_grad for tensor in holder.buffers())
        assert isinstance(holder.frozen, torch.nn.Parameter) and not holder.frozen.requires_grad
    weight = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (getattr(target, name) * weight).sum().backward()
    torch.testing.assert_close(weight.grad, getattr(target, name))


@pytest.mark.parametrize("container", [tuple, list])
@pytest.mark.parametrize("operator", ["gradient", "hessian", "vjp"])
def test_a_cache_module_s_state_f_binds_as_a_tuple_keeps_no_graph(operator: str, container: type) -> None:
    """An LSTM's way with its state: f binds ``module.state = (h, c)``, a tuple (or list) of
    tensors computed from x, in a Cache module. The tensors a Cache holds alone were cut from the
    call's graph; those inside a tuple kept it after the call (a leak across a training loop)."""
    # expected: after each call the state holds f's values and no graph, and the derivative
    # reads the state the call before left as a constant
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    module = torch.nn.Module()
    module.state = container([torch.zeros(3, dtype=torch.float64), "kept as it is"])

    def f(v: Any, cache: Any) -> Any:
        h = cache.state[0]
        cache.state = container([v * 2, "kept as it is"])
        y = (h * v).sum() + (v**3).sum()
        return y if operator != "vjp" else y.reshape(1)

    def read(v: Any, h: Any) -> Any:
        y = (h * v).sum() + (v**3).sum()
        return y if operator != "vjp" else y.reshape(1)

    call = {
        "gradient": lambda g, c: di.gradient(g, "torch", x, c),
        "hessian": lambda g, c: di.hessian(g, "torch", x, c),
        "vjp": lambda g, c: di.vjp(g, "torch", x, torch.ones(1, dtype=torch.float64), c),
    }[operator]
    for _ in range(2):
        last = module.state[0].clone()
        got = call(f, di.Cache(module))
        torch.testing.assert_close(got, call(read, di.Constant(last)))
        assert type(module.state) is container and module.state[1] == "kept as it is"
        torch.testing.assert_close(module.state[0], 2 * x)
        assert not module.state[0].requires_grad and module.state[0].grad_fn is None


def test_a_cache_module_keeps_what_the_caller_put_in_a_graph_and_torch_func_leaves_no_wrapper() -> None:
    # expected: a buffer f writes into in place that is a view is refused (a ContextError naming
    # the Cache and saying to pass a tensor of its own); a tensor bound to a graph of the
    # caller's before the call is left as it is; with create_graph=True the graph is kept; under
    # torch.func a tensor f binds in the module is the plain value, not a dead wrapper of its
    # transform
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    module = _Scratch()
    module.h = torch.zeros(5, dtype=torch.float64)[:3]
    with pytest.raises(di.ContextError, match=r"'h'.*contexts\[0\].*view.*clone\(\)"):
        di.gradient(_writes_its_module("buffer_copy_"), "torch", x, di.Cache(module))
    weight = torch.ones(3, dtype=torch.float64, requires_grad=True)
    module = _Scratch()
    module.t = weight * 3
    node = module.t.grad_fn
    di.gradient(_writes_its_module("buffer_copy_"), "torch", x, di.Cache(module))
    assert module.t.grad_fn is node and not module.h.requires_grad
    di.gradient(_writes_its_module("buffer_rebound"), di.AutoTorch(create_graph=True), x, di.Cache(module))
    assert module.h.grad_fn is not None
    module = _Scratch()
    got = di.gradient(_writes_its_module("buffer_rebound"), "torch-func", x, di.Cache(module))
    torch.testing.assert_close(
        got, di.gradient(_read_only, "torch", x, di.Constant(torch.zeros(3, dtype=torch.float64)))
    )
    assert not torch._C._functorch.is_functorch_wrapped_tensor(module.h)
    torch.testing.assert_close(module.h, 2 * x)
