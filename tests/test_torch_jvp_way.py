"""torch's jvp in autograd mode, computed by forward mode (the default, ``AutoTorch(jvp="forward")``)
or by reverse over reverse (``jvp="reverse"``); with ``jvp="auto"`` a prep's first call chooses
(``_Pushforward.choose``), by timing the two where forward mode is quick, and keeps forward mode
wherever the two products differ. Every test fixes the timing (never measured here), so that the
way chosen is the test's; each asserts the way, the product against ``torch.func.jvp``'s, and that
the caller's tensors are unchanged."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import diffiface as di

torch = pytest.importorskip("torch")

import diffiface._adapters.torch._fused as adapter  # noqa: E402
from diffiface._prep import prep_cache  # noqa: E402

AUTO = di.AutoTorch(jvp="auto")


def forced(reverse: bool) -> Any:
    return di.AutoTorch(jvp="reverse" if reverse else "forward")


def timing(reverse_faster: bool) -> Callable[..., tuple[Any, float]]:
    """A stand-in for ``_timed``: reverse over reverse takes a tenth of forward mode's time, or
    ten times it (both well under the limit of a quick call)."""

    def timed(call: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        forward = call.__name__ == "forward"
        return call(*args), 1e-4 if forward == reverse_faster else 1e-5

    return timed


_WAYS: dict[Any, bool] = {}
"""The way of each fused jvp call of a test, by its prep's call object (latest way kept)."""


@pytest.fixture(autouse=True)
def fresh_ways(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The ways of this test's calls recorded; no prep of another test; torch's modes as they were."""
    _WAYS.clear()
    prep_cache.clear()  # (a prep of another test has chosen its way)
    engine = adapter._Pushforward.engine

    def recorded(self: Any, *args: Any) -> Any:
        result = engine(self, *args)
        _WAYS[self] = bool(self.reverse)
        return result

    monkeypatch.setattr(adapter._Pushforward, "engine", recorded)
    grad = torch.is_grad_enabled()
    yield
    assert torch.is_grad_enabled() == grad
    _WAYS.clear()


def ways() -> list[bool]:
    """The way each prep of the test computes its jvp by now (True: reverse over reverse)."""
    return list(_WAYS.values())


def reference(f: Callable[..., Any], x: Any, t: Any, *contexts: Any) -> Any:
    with warnings.catch_warnings():  # (torch scripts its decompositions on its first jvp, warning)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*")
        return torch.func.jvp(lambda v: f(v, *contexts), (x,), (t,))[1]


def elementwise(v: Any, c: Any) -> Any:
    return torch.tanh(v * c) * v


def layer(w: Any, data: Any) -> Any:
    return torch.tanh(data @ w).sum(0)


def scalar(v: Any, c: Any) -> Any:
    return torch.sin(v * c) + v**3


@pytest.mark.parametrize("reverse_faster", [True, False], ids=["reverse", "forward"])
@pytest.mark.parametrize("how", ["auto", "forced"])
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("f", [elementwise, layer], ids=["elementwise", "layer"])
def test_either_way_gives_forward_modes_product(
    f: Any, prepared: bool, how: str, reverse_faster: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # expected: the way the timing says (jvp="auto") or the option forces, the product of
    # torch.func.jvp on every call (float64 and float32), value_and_jvp's value f(x), x, the
    # tangent and the Constant unchanged, and a result that is not the caller's tangent
    monkeypatch.setattr(adapter, "_timed", timing(reverse_faster))
    backend = AUTO if how == "auto" else forced(reverse_faster)
    for dtype in (torch.float64, torch.float32):
        gen = torch.Generator().manual_seed(0)
        shape = (6,) if f is elementwise else (5, 3)
        x, t = torch.randn(shape, generator=gen, dtype=dtype), torch.randn(shape, generator=gen, dtype=dtype)
        c = torch.randn(6, generator=gen, dtype=dtype) if f is elementwise else torch.randn(4, 5, dtype=dtype)
        copies = [v.clone() for v in (x, t, c)]
        prep = di.prepare_jvp(f, backend, x, t, di.Constant(c)) if prepared else None
        expected = reference(f, x, t, c)
        for _ in range(3):
            got = di.jvp(f, backend, x, t, di.Constant(c), prep=prep)
            torch.testing.assert_close(got, expected)
            assert got.dtype == dtype and not got.requires_grad
        value, product = di.value_and_jvp(f, backend, x, t, di.Constant(c))
        torch.testing.assert_close(value, f(x, c))
        torch.testing.assert_close(product, expected)
        got.add_(1.0)
        assert all(torch.equal(v, w) for v, w in zip((x, t, c), copies, strict=True))
    assert set(ways()) == {reverse_faster}


@pytest.mark.parametrize("reverse_faster", [True, False], ids=["reverse", "forward"])
def test_either_way_on_many_output_leaves_and_a_scalar_x(reverse_faster: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # expected: a dict output with a leaf that does not depend on x (zeros), one of another
    # dtype and one that does, as forward mode gives them; a derivative of a 0-d x
    monkeypatch.setattr(adapter, "_timed", timing(reverse_faster))
    x, t, c = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64), torch.randn(4)

    def tree(v: Any, k: Any) -> Any:
        return {"y": torch.sin(v) * k, "n": torch.sin(v[:3].float()), "z": k.double() * 2}

    got = di.jvp(tree, AUTO, x, t, di.Constant(c))
    torch.testing.assert_close(got["y"], torch.cos(x) * c * t)
    torch.testing.assert_close(got["n"], (torch.cos(x[:3]) * t[:3]).float())
    assert torch.equal(got["z"], torch.zeros(4, dtype=torch.float64))
    s = torch.tensor(0.7, dtype=torch.float64)
    torch.testing.assert_close(di.derivative(scalar, AUTO, s, di.Constant(1.5)), 1.5 * torch.cos(1.5 * s) + 3 * s**2)
    assert set(ways()) == {reverse_faster}


def under_no_grad(v: Any, c: Any) -> Any:
    with torch.no_grad():
        s = (v * c).sum()  # forward mode differentiates it; reverse mode does not
    return v * s


def test_a_part_under_no_grad_keeps_forward_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    # expected: the two products differ (the case means something), so forward mode is kept
    # although reverse over reverse is timed faster, and every call gives forward mode's product
    monkeypatch.setattr(adapter, "_timed", timing(True))
    x, t, c = (torch.randn(5, dtype=torch.float64) for _ in range(3))
    v = x.clone().requires_grad_(True)
    u = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    (pulled,) = torch.autograd.grad(under_no_grad(v, c), v, u, create_graph=True)
    (reverse,) = torch.autograd.grad(pulled, u, t)
    assert not torch.allclose(reverse, reference(under_no_grad, x, t, c))
    prep = di.prepare_jvp(under_no_grad, AUTO, x, t, di.Constant(c))
    for _ in range(2):
        torch.testing.assert_close(
            di.jvp(under_no_grad, AUTO, x, t, di.Constant(c), prep=prep), reference(under_no_grad, x, t, c)
        )
    assert ways() == [False]


class _Cube(torch.autograd.Function):
    """x**3 with a forward-mode rule and a backward pass torch cannot differentiate again."""

    @staticmethod
    def forward(v: Any) -> Any:
        return v**3

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: Any) -> Any:
        (v,) = ctx.saved_tensors
        return 3 * v**2 * g

    @staticmethod
    def jvp(ctx: Any, tv: Any) -> Any:
        (v,) = ctx.saved_tensors
        return 3 * v**2 * tv


def once_differentiable(v: Any, c: Any) -> Any:
    return _Cube.apply(v) * c


def test_an_operation_without_a_double_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    # expected: the choice's reverse trial fails, so forward mode (jvp="auto"); where reverse
    # over reverse is forced (jvp="reverse"), the call falls back to forward mode, keeps it for
    # the prep, and gives the right product; x and the tangent unchanged
    monkeypatch.setattr(adapter, "_timed", timing(True))
    x, t, c = (torch.randn(4, dtype=torch.float64) for _ in range(3))
    copies = [x.clone(), t.clone()]
    expected = 3 * x**2 * t * c
    torch.testing.assert_close(di.jvp(once_differentiable, AUTO, x, t, di.Constant(c)), expected)
    assert ways() == [False]
    _WAYS.clear()
    prep = di.prepare_jvp(once_differentiable, forced(True), x, t, di.Constant(c))
    for _ in range(2):
        torch.testing.assert_close(di.jvp(once_differentiable, forced(True), x, t, di.Constant(c), prep=prep), expected)
        assert ways() == [False]
    assert torch.equal(x, copies[0]) and torch.equal(t, copies[1])


def writes_into_x(v: Any, c: Any) -> Any:
    with torch.no_grad():
        v.mul_(2.0)
    return v * c


@pytest.mark.parametrize("reverse_faster", [True, False], ids=["reverse", "forward"])
def test_a_write_into_x_is_refused_either_way(reverse_faster: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # expected: a MutationError on every call, also where reverse over reverse is forced, and
    # x, the tangent and the Constant bit for bit as they were
    monkeypatch.setattr(adapter, "_timed", timing(reverse_faster))
    x, t, c = (torch.randn(3, dtype=torch.float64) for _ in range(3))
    copies = [v.clone() for v in (x, t, c)]
    for backend in (forced(reverse_faster), AUTO):
        prep = di.prepare_jvp(writes_into_x, backend, x, t, di.Constant(c))
        for _ in range(2):
            with pytest.raises(di.MutationError, match=r"its input x;"):
                di.jvp(writes_into_x, backend, x, t, di.Constant(c), prep=prep)
        assert all(torch.equal(v, w) for v, w in zip((x, t, c), copies, strict=True))


@pytest.mark.parametrize("backend", ["torch", di.AutoTorch(), forced(True)], ids=["by name", "default", "reverse"])
def test_f_runs_once_per_call_unless_the_way_is_timed(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # expected: by default (forward mode) and with a forced way, f runs once on every call, the
    # first included, prepared or not; the product right
    monkeypatch.setattr(adapter, "_timed", timing(True))
    calls = []
    x, t, c = (torch.randn(3, dtype=torch.float64) for _ in range(3))

    def f(v: Any, k: Any) -> Any:
        calls.append(1)
        return torch.tanh(v * k)

    expected = reference(f, x, t, c)
    prep = di.prepare_jvp(f, backend, x, t, di.Constant(c))
    for p in (prep, prep, None, None):
        calls.clear()
        got = di.jvp(f, backend, x, t, di.Constant(c), prep=p)
        torch.testing.assert_close(got, expected)
        assert len(calls) == 1


def test_auto_times_on_a_preps_first_call_and_remembers_in_the_prep_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # expected: with jvp="auto", the first call of each prep evaluates f five times (forward mode,
    # then each way twice) and later calls of it once; a new lambda of the same code on the next
    # unprepared call chooses again (no way kept outside a prep); a forward mode over the limit,
    # a complex x, are kept after one evaluation
    monkeypatch.setattr(adapter, "_timed", timing(True))
    calls = []
    c = torch.randn(3, dtype=torch.float64)
    x, t = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)

    def new_lambda() -> Any:
        return lambda v, k: calls.append(1) or torch.tanh(v * k)

    f = new_lambda()
    prep = di.prepare_jvp(f, AUTO, x, t, di.Constant(c))
    calls.clear()
    for expected in (5, 1, 1):
        calls.clear()
        di.jvp(f, AUTO, x, t, di.Constant(c), prep=prep)
        assert len(calls) == expected
    for _ in range(2):
        calls.clear()
        di.jvp(new_lambda(), AUTO, x, t, di.Constant(c))
        assert len(calls) == 5
    assert set(ways()) == {True}
    monkeypatch.setattr(adapter, "_CHOICE_LIMIT", 0.0)
    for x in (torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.complex128)):
        calls.clear()
        got = di.jvp(lambda v: calls.append(1) or torch.sin(v), AUTO, x, torch.ones_like(x))
        torch.testing.assert_close(got, torch.cos(x))
        assert len(calls) == 1
    assert ways()[-1] is False  # (the real x over the limit; a complex x takes the complex wrapper)


def test_the_numpy_caller_gets_numpy() -> None:
    # expected: numpy in, numpy out, on the measured way (whichever it is), the product right
    x, t, c = np.linspace(0.1, 1.0, 5), np.ones(5), np.arange(5.0)
    got = di.jvp(lambda v, k: torch.sin(v * torch.as_tensor(k)), "torch", x, t, di.Constant(c))
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got, np.cos(x * c) * c * t)


def test_a_function_that_draws_keeps_forward_mode_and_the_generators_state(monkeypatch: pytest.MonkeyPatch) -> None:
    # expected: the products of two draws differ, so forward mode; torch's generator advanced
    # by the first call's one evaluation only, as a forward-mode call would leave it
    monkeypatch.setattr(adapter, "_timed", timing(True))
    x, t = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)

    def noisy(v: Any) -> Any:
        return v * torch.randn(4, dtype=torch.float64)

    torch.manual_seed(3)
    got = di.jvp(noisy, AUTO, x, t)
    after = torch.randn(2)
    torch.manual_seed(3)
    noise = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(got, noise * t)
    assert torch.equal(after, torch.randn(2))
    assert ways() == [False]


@pytest.mark.parametrize("backend", ["torch", di.AutoTorch()], ids=["by name", "by object"])
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_duals_under_a_torch_function_mode_take_torchs_public_functions(
    prepared: bool, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # expected: forward mode makes and unpacks its duals with torch's operations under
    # forward_ad's functions (not entered) where no torch-function mode is active, and with
    # forward_ad's own (entered) under one, as torch.export's pre-dispatch tracing has; the
    # product torch.func.jvp's either way, value and jvp, one and two output leaves
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    entered: list[str] = []
    forward_ad = torch.autograd.forward_ad
    for name in ("make_dual", "unpack_dual"):
        public = getattr(forward_ad, name)
        monkeypatch.setattr(forward_ad, name, lambda *a, _f=public, _n=name, **k: entered.append(_n) or _f(*a, **k))
    monkeypatch.setattr(adapter, "_timed", timing(reverse_faster=False))

    def two(v: Any, c: Any) -> Any:
        return {"y": elementwise(v, c), "z": v.sum()}

    gen = torch.Generator().manual_seed(1)
    x, t, c = (torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(3))
    for f in (elementwise, two):
        expected = reference(f, x, t, c)
        prep = di.prepare_jvp(f, backend, x, t, di.Constant(c)) if prepared else None
        for mode in (False, True, False):
            entered.clear()
            with Passing() if mode else contextlib.nullcontext():
                got = di.jvp(f, backend, x, t, di.Constant(c), prep=prep)
                value, product = di.value_and_jvp(f, backend, x, t, di.Constant(c))
            torch.testing.assert_close(got, expected)
            torch.testing.assert_close(product, expected)
            torch.testing.assert_close(value, f(x, c))
            assert ("make_dual" in entered and "unpack_dual" in entered) == mode, entered
    assert set(ways()) == {False}


@pytest.mark.parametrize("way", ["forward", "reverse"])
def test_the_way_is_forced_on_the_guards_steps_too(way: str) -> None:
    # expected: a jvp the fused call does not serve (a module as a Constant) computes by the way
    # jvp= forces: reverse over reverse (_pushed_by_pullbacks, no dual made) or forward mode
    # (duals, no pullbacks); the product torch.func.jvp's; an f torch cannot differentiate
    # twice falls back to forward mode with the right product
    import sys

    import diffiface._adapters.torch as package

    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3).double()
    x, t = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)

    def f(v: Any, m: Any) -> Any:
        return torch.tanh(m(v)) * v

    entered: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(str(Path(package.__file__).parent)):
            entered.append(frame.f_code.co_name)

    backend = di.AutoTorch(jvp=way)
    di.jvp(f, backend, x, t, di.Constant(layer))
    sys.setprofile(profile)
    try:
        got = di.jvp(f, backend, x, t, di.Constant(layer))
    finally:
        sys.setprofile(None)
    torch.testing.assert_close(got, reference(f, x, t, layer))
    assert ("_pushed_by_pullbacks" in entered) == (way == "reverse")
    assert ("_made_duals" in entered) == (way == "forward")
    c = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(
        di.jvp(lambda v, m: once_differentiable(v, c), backend, x, t, di.Constant(layer)), 3 * x**2 * t * c
    )


def test_reverse_over_reverse_pulls_back_at_a_cotangent_of_ones() -> None:
    # expected: the pullback was built at a zero cotangent (it is linear in it: any point serves),
    # where logcumsumexp's backward pass takes the log of the cotangent's parts: NaN; at ones the
    # product is forward mode's
    torch.manual_seed(0)
    x, t = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)

    def f(v: Any) -> Any:
        return torch.tanh(torch.logcumsumexp(2 * v, 0)) * v

    torch.testing.assert_close(di.jvp(f, di.AutoTorch(jvp="reverse"), x, t), di.jvp(f, "torch", x, t))


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_reverse_over_reverse_lets_f_raise_its_own_error(grad_mode: bool) -> None:
    # expected: f's error as f raised it; the reverse-over-reverse steps, which the caller's
    # no_grad leaves to the adapter, read f's output in a finally block, so its error became an
    # UnboundLocalError
    raised = ValueError("f's own")

    def f(v: Any) -> Any:
        raise raised

    x, t = torch.ones(3), torch.ones(3)
    with torch.set_grad_enabled(grad_mode), pytest.raises(ValueError, match="f's own") as info:
        di.jvp(f, di.AutoTorch(jvp="reverse"), x, t)
    assert info.value is raised
