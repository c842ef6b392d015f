"""The torch guard's cost on the common call, counted by route (never by time), and the
guarantees its fast path must keep: a write into x or a Constant, even under no_grad, is a
MutationError and the caller's tensors are bit-for-bit as they were."""

from __future__ import annotations

import sys
from typing import Any

import pytest

import diffiface as di

torch = pytest.importorskip("torch")

ADAPTER_FILE = "diffiface/_adapters/torch/"


def loss(w: Any, data: Any) -> Any:
    return (torch.tanh(data @ w) ** 2).mean()


def adapter_frames(call: Any) -> list[str]:
    """The Python functions of the torch adapter that ``call`` enters, in order."""
    entered: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and ADAPTER_FILE in frame.f_code.co_filename.replace("\\", "/"):
            entered.append(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


FUSED = {
    # (the gradients' types tested in C: _whole only for a None, a DTensor or a ZeroTensor)
    "autograd": ["_Gradient.__call__", "_watched_constants", "_Gradient.engine"],
    # (torch.func's transform, built once for the prep, runs f through one method)
    # (torch.func's gradient: no fused call, the guard's steps; benchmarks/torch_fused.py)
    "func": ["_guard.<locals>.guarded", "_watched_constants", "Adapter.value_and_gradient"],
}


@pytest.mark.parametrize("shape", ["one tensor", "nested dict, tuple batch"])
@pytest.mark.parametrize("operator", ["gradient", "value_and_gradient"])
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("mode", ["autograd", "func"])
def test_common_gradient_enters_the_adapter_once(shape: str, operator: str, prepared: bool, mode: str) -> None:
    # expected: one call of the fused guard, program and backward pass (_Gradient; in torch.func mode
    # its method f runs in), the Constant's copy (_watched_constants) and the
    # gradients made whole (_whole; _materialised), by name or by object; no other helper,
    # listcomp or genexpr; the result is the general steps' one
    w, data = torch.randn(5), torch.randn(7, 5)
    x: Any = w if shape == "one tensor" else {"l": {"w": w, "b": torch.randn(7)}}
    batch: Any = data if shape == "one tensor" else (data, torch.randn(7))

    def f(p: Any, d: Any) -> Any:
        if shape == "one tensor":
            return loss(p, d)
        return loss(p["l"]["w"], d[0]) + ((p["l"]["b"] - d[1]) ** 2).sum()

    op = getattr(di, operator)
    for backend in ("torch", di.AutoTorch()) if mode == "autograd" else ("torch", di.AutoTorch(mode="func")):
        ctx = di.Constant(batch)
        prep = getattr(di, f"prepare_{operator}")(f, backend, x, ctx) if prepared else None

        def call() -> Any:
            return op(f, backend, x, ctx, prep=prep)  # noqa: B023

        if mode == "func" and backend == "torch":
            continue  # (the name means autograd mode)
        call()
        frames = adapter_frames(call)
        assert (frames if mode == "autograd" else frames[:3]) == FUSED[mode]
        # x of leaves that require grad (nn.Parameters): in autograd mode the same route, its
        # results detached as torch.autograd.grad's; under torch.func, torch.func's semantics
        # (the graph kept), which the guard's steps serve, handed on before anything ran
        requiring = optree_map(lambda t: t.clone().requires_grad_(True), x)
        routed = adapter_frames(lambda: op(f, backend, requiring, ctx))  # noqa: B023
        if mode == "autograd":
            assert routed == FUSED[mode]
        else:  # (the graph kept, as torch.func's rule: the guard's steps)
            assert routed[0] == FUSED[mode][0] and FUSED[mode][2] in routed
        # the general steps: the guard's (a graph asked for: no fused call)
        general_backend = di.AutoTorch(create_graph=True) if mode == "autograd" else backend
        general = op(f, general_backend, requiring, ctx)
        assert any(n.endswith("guarded") for n in adapter_frames(lambda: op(f, general_backend, requiring, ctx))[:2])  # noqa: B023
        for got, want in zip(_leaves(call()), _leaves(general), strict=True):
            assert not got.requires_grad
            torch.testing.assert_close(got, want.detach())


@pytest.mark.parametrize("has_aux", [False, True], ids=["no aux", "aux"])
@pytest.mark.parametrize("shape", ["one tensor", "nested dict"])
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_the_func_gradient_makes_no_transform_per_call(
    has_aux: bool, shape: str, prepared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch.func's transform, made on every call, was a measurable share of row a of
    # benchmarks/torch_users.py: the adapter makes it once, f passed as an argument; the
    # gradient, value and aux stay torch.func.grad_and_value's own
    w, data = torch.randn(5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    x: Any = w if shape == "one tensor" else {"l": {"w": w, "b": torch.randn(7, dtype=torch.float64)}}

    def f(p: Any, d: Any) -> Any:
        value = loss(p, d) if shape == "one tensor" else loss(p["l"]["w"], d) + (p["l"]["b"] ** 2).sum()
        return (value, {"scale": 2.0, "norm": value.detach() * 2}) if has_aux else value

    backend, ctx = di.AutoTorch(mode="func"), di.Constant(data)
    prep = di.prepare_value_and_gradient(f, backend, x, ctx, has_aux=has_aux) if prepared else None
    di.value_and_gradient(f, backend, x, ctx, prep=prep, has_aux=has_aux)
    made = []
    original = torch.func.grad_and_value
    monkeypatch.setattr(torch.func, "grad_and_value", lambda *a, **k: made.append(a) or original(*a, **k))
    got = di.value_and_gradient(f, backend, x, ctx, prep=prep, has_aux=has_aux)
    assert made == []
    plain = (lambda p: f(p, data)[0]) if has_aux else (lambda p: f(p, data))
    want_grad, want_value = original(plain)(x)
    (value, aux), grad = got if has_aux else ((got[0], None), got[1])
    torch.testing.assert_close(value, want_value)
    for a, b in zip(_leaves(grad), _leaves(want_grad), strict=True):
        torch.testing.assert_close(a, b)
    if has_aux:
        assert aux["scale"] == 2.0
        torch.testing.assert_close(aux["norm"], want_value * 2)


@pytest.mark.parametrize("operator", ["vjp", "value_and_vjp"])
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize(
    "backend", ["torch", di.AutoTorch(), di.AutoTorch(mode="func")], ids=["by name", "by object", "func"]
)
def test_common_vjp_enters_the_adapter_once(operator: str, prepared: bool, backend: Any) -> None:
    # expected: one call of the fused guard, program and backward pass (_Pullback's engine), the
    # Constant's copy, the output's two checks (the program's own), the backward pass (_grad)
    # and, for the value, its detaching (under torch.func: torch.func.vjp of the closed f's
    # output, _output, and its pullback); the results are the general steps' ones
    w = torch.randn(5)
    x, batch = {"l": {"w": w, "b": torch.randn(7)}}, (torch.randn(7, 5), torch.randn(7))

    def f(p: Any, d: Any) -> Any:
        return {"y": torch.tanh(d[0] @ p["l"]["w"]) + p["l"]["b"] * d[1]}

    t, ctx = {"y": torch.randn(7)}, di.Constant(batch)
    op = getattr(di, operator)
    prep = getattr(di, f"prepare_{operator}")(f, backend, x, t, ctx) if prepared else None

    def call() -> Any:
        return op(f, backend, x, t, ctx, prep=prep)

    call()
    frames = [
        "_Gradient.__call__",
        "_watched_constants",
        "_Pullback.engine",
        "Adapter.untracked",
        "Adapter.output_leaf",
    ]
    if getattr(backend, "mode", "autograd") == "func":
        frames.insert(3, "_output")
    else:
        frames += ["_backward", "_grad"] + (["_detached"] if operator == "value_and_vjp" else [])
    assert adapter_frames(call) == frames
    with torch.enable_grad():  # the general steps: x requiring grad (a nested call's shape)
        general = op(f, backend, optree_map(lambda v: v.clone().requires_grad_(True), x), t, ctx)
    got = call()
    for a, b in zip(_leaves(got), _leaves(general), strict=True):
        assert not a.requires_grad
        torch.testing.assert_close(a, b.detach())
    with torch.no_grad():  # the caller's grad mode off: the guard's steps, the same result
        for a, b in zip(_leaves(call()), _leaves(got), strict=True):
            torch.testing.assert_close(a, b)
        assert not torch.is_grad_enabled()
    with pytest.raises(di.TangentMismatchError):  # the cotangent checked against f(x), as before
        op(f, backend, x, {"y": torch.randn(6)}, ctx)


FORWARD = ["_Gradient.__call__", "_watched_constants", "_Pushforward.engine", "_Pushforward.forward"]
FORWARD += ["_open_dual_level", "_made_duals", "Adapter.untracked", "_dual_parts", "Adapter.output_leaf", "_unpacked"]
FORWARD += ["_close_dual_level"]
REVERSE = ["_Gradient.__call__", "_watched_constants", "_Pushforward.engine", "_Pushforward.by_pullbacks"]
REVERSE += ["Adapter.untracked", "Adapter.output_leaf", "_pushed_by_pullbacks"]
SECOND = ["_Gradient.__call__", "_watched_constants", "_Hvp.engine", "Adapter.untracked", "Adapter.output_leaf"]
SECOND += ["_if_graph", "_grad", "_backward", "_grad"]


@pytest.mark.parametrize("operator", ["jvp by forward mode", "jvp by reverse over reverse", "hvp", "gradient_and_hvp"])
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("backend", ["torch", di.AutoTorch()], ids=["by name", "by object"])
def test_common_jvp_and_hvp_enter_the_adapter_once(
    operator: str, prepared: bool, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # expected: one call of the fused guard, program and engine (_Pushforward's: duals in a dual
    # level of ours, or reverse over reverse, as the first call chose, here by a timing the test
    # fixes; _Hvp's: double backward), the Constant's copy and the output's checks (the
    # program's own); the results are the general steps' ones (x requiring grad: the guard's),
    # also under the caller's no_grad (the guard's steps, its mode kept); a tangent of
    # another shape is refused; the caller's tangent is not aliased by the result
    import diffiface._adapters.torch._fused as adapter
    from diffiface._prep import prep_cache

    way = operator.partition(" by ")[2]
    operator = operator.partition(" by ")[0]
    forward_took = {"forward mode": 1e-5, "reverse over reverse": 1e-3}.get(way)

    def timed(call: Any, *args: Any) -> tuple[Any, float]:  # (the first call's timing, fixed)
        return call(*args), forward_took if call.__name__ == "forward" else 1e-4

    monkeypatch.setattr(adapter, "_timed", timed)
    prep_cache.clear()
    if way == "reverse over reverse":  # (chosen by AutoTorch(jvp="auto") on the timing fixed above)
        backend = di.AutoTorch(jvp="auto")
    x, batch = {"l": {"w": torch.randn(5), "b": torch.randn(7)}}, (torch.randn(7, 5), torch.randn(7))

    def f(p: Any, d: Any) -> Any:
        y = torch.tanh(d[0] @ p["l"]["w"]) + p["l"]["b"] * d[1]
        return {"y": y} if operator == "jvp" else (y**2).sum() + (p["l"]["w"] ** 2).sum() / 2

    t, ctx = {"l": {"w": torch.randn(5), "b": torch.randn(7)}}, di.Constant(batch)
    t0 = optree_map(torch.clone, t)
    op = getattr(di, operator)
    prep = getattr(di, f"prepare_{operator}")(f, backend, x, t, ctx) if prepared else None

    def call() -> Any:
        return op(f, backend, x, t, ctx, prep=prep)

    got = call()
    jvp_frames = REVERSE if way == "reverse over reverse" else FORWARD
    frames = jvp_frames if operator == "jvp" else SECOND + (["_placed"] if operator == "gradient_and_hvp" else [])
    assert adapter_frames(call) == frames
    with torch.enable_grad():  # the general steps: x requiring grad (a nested call's shape)
        general = op(f, backend, optree_map(lambda v: v.clone().requires_grad_(True), x), t, ctx)
    for a, b in zip(_leaves(got), _leaves(general), strict=True):
        assert not a.requires_grad
        torch.testing.assert_close(a, b.detach())
    with torch.no_grad():
        for a, b in zip(_leaves(call()), _leaves(got), strict=True):
            torch.testing.assert_close(a, b)
        assert not torch.is_grad_enabled()
    for a in _leaves(got):  # (a result is never the caller's tangent itself)
        a.add_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(_leaves(t), _leaves(t0), strict=True))
    with pytest.raises((di.TangentMismatchError, di.PreparationMismatchError)):
        op(f, backend, x, {"l": {"w": torch.randn(4), "b": torch.randn(7)}}, ctx, prep=prep)


def test_the_fused_jvp_refuses_writes_and_nested_forward_mode() -> None:
    # expected: a write into the dual input or into the tangent f reaches is a MutationError, the
    # caller's x and tangent unchanged; a constant f gets zeros; a jvp inside f's jvp is refused
    # as torch's one dual level requires (UnsupportedOperationError), and the next call works
    w, t, data = torch.randn(5), torch.randn(5), torch.randn(7, 5)
    w0, t0 = w.clone(), t.clone()
    backend, ctx = di.AutoTorch(), di.Constant(data)

    def into_x(w: Any, d: Any) -> Any:
        w.mul_(2.0)
        return d @ w

    def into_tangent(w: Any, d: Any) -> Any:
        import torch.autograd.forward_ad as forward_ad

        forward_ad.unpack_dual(w).tangent.mul_(2.0)
        return d @ w

    for g in (into_x, into_tangent):
        prep = di.prepare_jvp(g, backend, w, t, ctx)
        for _ in range(2):
            with pytest.raises(di.MutationError):
                di.jvp(g, backend, w, t, ctx, prep=prep)
            assert torch.equal(w, w0) and torch.equal(t, t0)
    assert torch.equal(di.jvp(lambda w, d: d.sum(1), backend, w, t, ctx), torch.zeros(7))

    def nested(w: Any, d: Any) -> Any:
        return di.jvp(lambda v, e: e @ v, backend, w, t, di.Constant(d))

    with pytest.raises(di.UnsupportedOperationError):
        di.jvp(nested, backend, w, t, ctx)
    torch.testing.assert_close(di.jvp(lambda w, d: d @ w, backend, w, t, ctx), data @ t)


def optree_map(fn: Any, tree: Any) -> Any:
    import optree

    return optree.tree_map(fn, tree)


def _leaves(tree: Any) -> list[Any]:
    import optree

    return optree.tree_leaves(tree)


def _write_x(w: Any, data: Any) -> Any:
    with torch.no_grad():
        w.mul_(3.0)
    return loss(w, data)


def _write_constant(w: Any, data: Any) -> Any:
    data.add_(1.0)
    return loss(w, data)


def _write_constant_then_raise(w: Any, data: Any) -> Any:
    data.add_(1.0)
    raise ValueError("half-way")


@pytest.mark.parametrize(
    "f",
    [_write_x, _write_constant, _write_constant_then_raise],
    ids=["x-under-no-grad", "constant", "constant-then-raise"],
)
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("mode", ["autograd", "func", "autograd vjp", "func vjp", "autograd jvp", "autograd hvp"])
def test_fast_path_refuses_writes_and_loses_nothing(f: Any, prepared: bool, mode: str) -> None:
    # expected: a MutationError every time; w and data equal to their copies, versions unchanged
    w, data = torch.randn(5), torch.randn(7, 5)
    w0, data0 = w.clone(), data.clone()
    versions = (w._version, data._version)
    backend, ctx = di.AutoTorch(mode=mode.split()[0]), di.Constant(data)
    product = mode.split()[1] if " " in mode else None  # (a vjp's cotangent: f's output is a 0-d tensor)

    def call() -> None:
        if product is not None:
            t = torch.tensor(1.0) if product == "vjp" else torch.ones(5)
            prep = getattr(di, f"prepare_{product}")(f, backend, w, t, ctx) if prepared else None
            getattr(di, product)(f, backend, w, t, ctx, prep=prep)
            return
        prep = di.prepare_gradient(f, backend, w, ctx) if prepared else None
        di.gradient(f, backend, w, ctx, prep=prep)

    for _ in range(2):  # twice: the second call takes the warm route
        with pytest.raises(di.MutationError):
            call()
        assert torch.equal(w, w0) and torch.equal(data, data0)
        assert (w._version, data._version) == versions


def test_a_second_constant_written_is_seen() -> None:
    # expected: a MutationError naming the Constant; both Constants unchanged
    w, a, b = torch.randn(5), torch.randn(7, 5), torch.randn(7)

    def f(w: Any, a: Any, b: Any) -> Any:
        b.zero_()
        return ((a @ w - b) ** 2).mean()

    a0, b0 = a.clone(), b.clone()
    with pytest.raises(di.MutationError, match="Constant"):
        di.gradient(f, di.AutoTorch(), w, di.Constant(a), di.Constant(b))
    assert torch.equal(a, a0) and torch.equal(b, b0)


def _into_cache(w: Any, data: Any, scratch: Any) -> Any:
    scratch.copy_(data @ w)
    return (scratch**2).sum()


def _into_constant(w: Any, data: Any, scratch: Any) -> Any:
    data.mul_(2.0)
    return (data @ w).sum()


def _switches_grad_off(w: Any, data: Any, scratch: Any) -> Any:
    y = (data @ w).sum()
    torch.set_grad_enabled(False)
    return y


def test_the_func_gradient_refuses_writes_into_its_contexts_and_keeps_grad_mode() -> None:
    # expected: under torch.func a write into a Cache or a Constant is refused (torch.func refuses
    # writes into what f closes over; the guard passes the contexts so that they stay closed
    # over), the caller's tensors unchanged; a constant f gets zeros; the caller's grad mode
    # survives an f that turns it off; a float output is refused
    backend = di.AutoTorch(mode="func")
    w, data, scratch = torch.randn(5), torch.randn(7, 5), torch.zeros(7)
    contexts = (di.Constant(data), di.Cache(scratch))

    def reads(w: Any, data: Any, scratch: Any) -> Any:
        return ((data @ w) ** 2).sum()

    prep = di.prepare_gradient(reads, backend, w, *contexts)
    assert adapter_frames(lambda: di.gradient(reads, backend, w, *contexts, prep=prep))[0] == "_guard.<locals>.guarded"
    torch.testing.assert_close(di.gradient(reads, backend, w, *contexts, prep=prep), 2 * data.T @ (data @ w))

    before, scratch_before = data.clone(), scratch.clone()
    for g in (_into_cache, _into_constant):
        with pytest.raises(di.MutationError):
            di.gradient(g, backend, w, *contexts)
        assert torch.equal(data, before) and torch.equal(scratch, scratch_before)
    assert torch.equal(di.gradient(lambda w, d, s: (d**2).sum(), backend, w, *contexts), torch.zeros(5))
    got = di.gradient(_switches_grad_off, backend, w, *contexts)
    assert torch.is_grad_enabled()
    torch.testing.assert_close(got, data.sum(0))
    with pytest.raises(di.InvalidOutputError):
        di.gradient(lambda w, d, s: float((d @ w).sum().detach()), backend, w, *contexts)


@pytest.mark.parametrize("backend", ["torch", di.AutoTorch()], ids=["by name", "by object"])
def test_the_fused_gradient_copies_the_constants_and_lets_f_write_its_caches(backend: Any) -> None:
    # expected: with a Constant beside a Cache, a write into the Cache is f's own business (the
    # gradient is right, the scratch space holds what f wrote), a write into the Constant is a
    # MutationError with the caller's tensor unchanged; a constant f gets zeros; the caller's
    # grad mode survives an f that turns it off
    w, data, scratch = torch.randn(5), torch.randn(7, 5), torch.zeros(7)

    contexts = (di.Constant(data), di.Cache(scratch))
    prep = di.prepare_gradient(_into_cache, backend, w, *contexts)
    got = di.gradient(_into_cache, backend, w, *contexts, prep=prep)
    assert adapter_frames(lambda: di.gradient(_into_cache, backend, w, *contexts, prep=prep))[0] == "_Gradient.__call__"
    torch.testing.assert_close(got, 2 * data.T @ (data @ w))
    torch.testing.assert_close(scratch, data @ w)
    before = data.clone()
    with pytest.raises(di.MutationError, match="Constant"):
        di.gradient(_into_constant, backend, w, *contexts)
    assert torch.equal(data, before)
    assert torch.equal(di.gradient(lambda w, d, s: (d**2).sum(), backend, w, *contexts), torch.zeros(5))
    got = di.gradient(_switches_grad_off, backend, w, *contexts)
    assert torch.is_grad_enabled()
    torch.testing.assert_close(got, data.sum(0))


JACOBIAN = ["_guard.<locals>.guarded", "_watched_constants", "Adapter.value_and_jacobian"]


@pytest.mark.parametrize("shape", ["one tensor, one output", "nested dict, two outputs", "empty leaf"])
@pytest.mark.parametrize("operator", ["jacobian", "value_and_jacobian"])
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_common_func_jacobian_takes_the_guards_steps(shape: str, operator: str, prepared: bool) -> None:
    # expected: torch.func's Jacobian (no fused call: benchmarks/torch_fused.py showed none
    # quicker) is the guard's steps, the Constant watched, and the adapter's torch.func.jacrev
    # (_jacobian_by_transform); an x with an empty leaf takes the rows inside the same guard;
    # the results are autograd mode's (float64), x and the batch unchanged; a complex output
    # after real ones is refused
    backend = di.AutoTorch(mode="func")
    gen = torch.Generator().manual_seed(3)
    data = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    if shape == "one tensor, one output":
        x: Any = torch.randn(3, generator=gen, dtype=torch.float64)

        def f(v: Any, d: Any) -> Any:
            return torch.tanh(d @ v) * v.sum()

    elif shape == "nested dict, two outputs":
        x = {"l": {"w": torch.randn(3, 2, generator=gen, dtype=torch.float64), "b": torch.randn(2, generator=gen)}}
        x["l"]["b"] = x["l"]["b"].double()

        def f(v: Any, d: Any) -> Any:
            h = torch.tanh(d @ v["l"]["w"] + v["l"]["b"])
            return {"h": h, "n": (h**2).sum()}

    else:
        x = (torch.randn(3, generator=gen, dtype=torch.float64), torch.zeros(0, dtype=torch.float64))

        def f(v: Any, d: Any) -> Any:
            return d @ v[0] + v[1].sum()

    copies = (optree_map(torch.clone, x), data.clone())
    ctx = di.Constant(data)
    op = getattr(di, operator)
    prep = getattr(di, f"prepare_{operator}")(f, backend, x, ctx) if prepared else None

    def call() -> Any:
        return op(f, backend, x, ctx, prep=prep)

    call()  # (f's outputs found real)
    frames = adapter_frames(call)
    assert frames[:3] == JACOBIAN
    assert ("Adapter._jacobian_by_transform" in frames) == (shape != "empty leaf")
    want = op(f, di.AutoTorch(), x, ctx)
    for got, expected in zip(_leaves(call()), _leaves(want), strict=True):
        assert not got.requires_grad and got.dtype == expected.dtype
        torch.testing.assert_close(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(_leaves(x), _leaves(copies[0]), strict=True))
    assert torch.equal(data, copies[1])
    if shape == "one tensor, one output":  # a complex output where real ones were found: refused

        def g(v: Any, d: Any) -> Any:
            return f(v, d) * 1j if bool(v.sum() > 100) else f(v, d)

        g_prep = getattr(di, f"prepare_{operator}")(g, backend, x, ctx)
        for _ in range(2):  # (the second call, the fused one)
            op(g, backend, x, ctx, prep=g_prep)
        with pytest.raises(di.InvalidOutputError, match="complex"):
            op(g, backend, x + 1000, ctx, prep=g_prep)
