"""Compiled torch, ``AutoTorch(mode="func", compile=True)`` ("torch-compile").

It is not in tests/conftest.py's FIRST_ORDER (that table takes one backend per torch *mode*;
``compile`` is an option, not a mode), so the parametrised suite does not compile every
scenario. The tests below compile a few programs on purpose, each a first compile of seconds:
a gradient with a Constant (float64, the contract, no recompile, a new shape refused), a vjp and
a jvp, a Jacobian (and one through cdist, which runs uncompiled), an hvp, a Hessian and a second derivative as one program each, the torch.nn
recipe, a tree's value and gradient, a closure changed between calls (compiled anew, never
stale, with the first compile's refusals), a caller's eager stance, and the refusals (a compiled
call differentiated from outside, a graph break, a Cache holding a traced tensor, a write into x
or a Constant), and what runs uncompiled: an f with a torch.autograd.Function, and a prep past
torch's recompile limit; a number Constant of -0.0 and a numpy scalar Constant.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import diffiface as di

torch = pytest.importorskip("torch")
from torch._dynamo.utils import counters  # noqa: E402

from tests.conftest import FIRST_ORDER  # noqa: E402

COMPILED = di.AutoTorch(mode="func", compile=True)


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


# -- the option: no compile needed -------------------------------------------------------------


def test_compile_is_an_option_of_func_mode_only() -> None:
    with pytest.raises(di.InvalidBackendOptionError, match="mode='func', compile=True"):
        di.AutoTorch(compile=True)
    with pytest.raises(di.InvalidBackendOptionError):
        di.AutoTorch(mode="func", compile="yes")  # type: ignore[arg-type]
    assert di.AutoTorch(mode="func", compile=True) == COMPILED


def test_named_torch_compile_but_not_in_every_parametrised_test() -> None:
    from diffiface._adapters import normalize
    from diffiface.test.__main__ import _DEFAULT

    assert normalize("torch-compile") == COMPILED
    assert not any(isinstance(b, di.AutoTorch) and b.compile for b in FIRST_ORDER.values())
    assert "torch-compile" not in _DEFAULT  # the main job compiles it only when asked


# -- compiled programs (each test compiles a few) -----------------------------------------------


def _f(x, w):
    return torch.sum(torch.tanh(x * w) * x)


def _expected_gradient(x, w):
    t = torch.tanh(x * w)
    return t + x * w * (1 - t**2)


def test_gradient_contract_and_no_recompile() -> None:
    x = torch.linspace(-1, 1, 10, dtype=torch.float64)
    w = torch.linspace(0.5, 2, 10, dtype=torch.float64)
    x0, w0 = x.clone(), w.clone()
    prep = di.prepare_gradient(_f, COMPILED, x, di.Constant(w))
    g = di.gradient(_f, COMPILED, x, di.Constant(w), prep=prep)  # the first call compiles
    assert g.dtype == torch.float64 and type(g) is torch.Tensor and not g.requires_grad
    torch.testing.assert_close(g, _expected_gradient(x, w), rtol=1e-12, atol=1e-12)
    before = graphs()
    for k in range(3):  # new values, same shapes: nothing compiles
        x2, w2 = x + k, w * (k + 1)
        torch.testing.assert_close(
            di.gradient(_f, COMPILED, x2, di.Constant(w2), prep=prep),
            _expected_gradient(x2, w2),
            rtol=1e-12,
            atol=1e-12,
        )
    assert graphs() == before
    assert torch.equal(x, x0) and torch.equal(w, w0)
    with pytest.raises(di.PreparationMismatchError):  # a strict prep refuses another shape
        di.gradient(_f, COMPILED, torch.ones(11, dtype=torch.float64), di.Constant(torch.ones(11)), prep=prep)


def test_first_order_products_and_jacobian() -> None:
    x = torch.linspace(-1, 1, 6, dtype=torch.float64)
    w = torch.linspace(0.5, 2, 6, dtype=torch.float64)
    v = torch.linspace(1, 2, 6, dtype=torch.float64)

    def g(x, w):
        return torch.sin(x) * w

    J = torch.diag(torch.cos(x) * w)
    torch.testing.assert_close(di.jvp(g, COMPILED, x, v, di.Constant(w)), J @ v)
    torch.testing.assert_close(di.vjp(g, COMPILED, x, v, di.Constant(w)), J.T @ v)
    jac = di.jacobian(g, COMPILED, x, di.Constant(w))
    assert jac.dtype == torch.float64
    torch.testing.assert_close(jac, J)


def test_a_jacobian_through_cdist_runs_uncompiled_and_right() -> None:
    # torch.func.vmap batches cdist's backward wrongly (jacrev's rows come out wrong, no error),
    # compiled or not: the Jacobian, prepared or not, takes the uncompiled rows one by one
    y = torch.tensor([[0.3, -1.0, 2.0], [1.5, 0.2, -0.7], [-0.4, 0.9, 0.1], [2.2, -1.3, 0.5]], dtype=torch.float64)
    x = torch.tensor([[0.1, 0.2, -0.3], [-1.1, 0.4, 0.8], [0.7, -0.6, 1.9]], dtype=torch.float64)

    def f(v, c):
        return torch.cdist(v, c, p=1.0).sum(0)

    expected = torch.autograd.functional.jacobian(lambda v: f(v, y), x)
    torch.testing.assert_close(di.jacobian(f, COMPILED, x, di.Constant(y)), expected)
    prep = di.prepare_jacobian(f, COMPILED, x, di.Constant(y))
    before = graphs()
    torch.testing.assert_close(di.jacobian(f, COMPILED, x, di.Constant(y), prep=prep), expected)
    assert graphs() == before  # (nothing compiled)


def test_second_order_is_one_compiled_program() -> None:
    x = torch.linspace(-1, 1, 5, dtype=torch.float64)
    v = torch.linspace(1, 2, 5, dtype=torch.float64)

    def f(x):
        return torch.sum(torch.sin(x) * x)

    H = torch.diag(2 * torch.cos(x) - x * torch.sin(x))
    prep = di.prepare_hvp(f, COMPILED, x, v)
    torch.testing.assert_close(di.hvp(f, COMPILED, x, v, prep=prep), H @ v)
    before = graphs()
    torch.testing.assert_close(
        di.hvp(f, COMPILED, x + 1, v, prep=prep), torch.diag(2 * torch.cos(x + 1) - (x + 1) * torch.sin(x + 1)) @ v
    )
    assert graphs() == before
    torch.testing.assert_close(di.hessian(f, COMPILED, x), H)
    s = torch.tensor(0.3, dtype=torch.float64)
    d2 = di.second_derivative(lambda s: torch.sin(s) * s, COMPILED, s)
    assert d2.dtype == torch.float64
    torch.testing.assert_close(d2, 2 * torch.cos(s) - s * torch.sin(s))


def test_a_second_derivative_of_x_times_a_number_and_a_derivative() -> None:
    # jvp over jvp, compiled, crashed the process where f multiplies x by a Python number; the
    # derivative failed for every f (a wrapper of the complex layer stored state in the trace)
    s = torch.tensor(0.3, dtype=torch.float64)
    torch.testing.assert_close(di.second_derivative(lambda s: torch.exp(3.0 * s), COMPILED, s), 9 * torch.exp(3 * s))

    def curve(s):
        return torch.stack([torch.sin(2.0 * s) * s, torch.exp(3.0 * s)])

    expected = torch.stack([4 * torch.cos(2 * s) - 4 * s * torch.sin(2 * s), 9 * torch.exp(3 * s)])
    torch.testing.assert_close(di.second_derivative(curve, COMPILED, s), expected)
    value, derivative = di.value_and_derivative(torch.sin, COMPILED, s)
    torch.testing.assert_close((value, derivative), (torch.sin(s), torch.cos(s)))
    torch.testing.assert_close(di.derivative(lambda s: torch.exp(1j * s), COMPILED, s), 1j * torch.exp(1j * s))


class _Rule(torch.autograd.Function):
    """x**2 forward, with rules of its own (backward 5x, jvp 7x): what torch.func uses."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x**2

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.x = inputs[0]

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 5 * x * g

    @staticmethod
    def jvp(ctx, t):
        return 7 * ctx.x * t


def test_an_autograd_function_keeps_its_rules_uncompiled() -> None:
    # torch.compile under torch.func differentiates a Function's forward (2x), silently: f's
    # graph is read on the first call and the prep runs as torch-func, compiling nothing
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    v = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)

    def f(x):
        return _Rule.apply(x).sum()

    before = graphs()
    torch.testing.assert_close(di.gradient(f, COMPILED, x), 5 * x)
    torch.testing.assert_close(di.vjp(_Rule.apply, COMPILED, x, v), 5 * x * v)
    torch.testing.assert_close(di.jvp(_Rule.apply, COMPILED, x, v), 7 * x * v)
    torch.testing.assert_close(di.jacobian(_Rule.apply, COMPILED, x), torch.diag(5 * x))
    torch.testing.assert_close(di.hvp(f, COMPILED, x, v), 5 * v)

    def scaled(x, c):
        return f(x) * c

    c = di.Constant(torch.tensor(2.0, dtype=torch.float64))  # (a context of arrays: one closed gradient call)
    prep = di.prepare_value_and_gradient(scaled, COMPILED, x, c)
    for _ in range(2):
        value, grad = di.value_and_gradient(scaled, COMPILED, x, c, prep=prep)
        torch.testing.assert_close((value, grad), (2 * torch.sum(x**2), 10 * x))
    assert graphs() == before


def test_an_autograd_function_a_later_call_reaches_keeps_its_rules() -> None:
    # expected: f's graph was read on a program's first call only, so a Function reached once a
    # Constant flag turned on was compiled through on the recompile (the gradient 2x, not 5x);
    # f's graph is read again before each compile after the first, and the call runs uncompiled
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    v = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)

    def f(x, ruled):
        return (_Rule.apply(x) if ruled else x**2).sum()

    def g(x, ruled):
        return _Rule.apply(x) if ruled else x**2

    grad_prep = di.prepare_gradient(f, COMPILED, x, di.Constant(False))
    vjp_prep = di.prepare_vjp(g, COMPILED, x, v, di.Constant(False))
    torch.testing.assert_close(di.gradient(f, COMPILED, x, di.Constant(False), prep=grad_prep), 2 * x)
    torch.testing.assert_close(di.vjp(g, COMPILED, x, v, di.Constant(False), prep=vjp_prep), 2 * x * v)
    torch.testing.assert_close(di.gradient(f, COMPILED, x, di.Constant(True), prep=grad_prep), 5 * x)
    torch.testing.assert_close(di.vjp(g, COMPILED, x, v, di.Constant(True), prep=vjp_prep), 5 * x * v)
    # the same through a global flag beside a Constant tensor (the one closed gradient call)
    scale = di.Constant(torch.tensor(2.0, dtype=torch.float64))
    _RULED[0] = False
    torch.testing.assert_close(di.gradient(_flagged, COMPILED, x, scale), 4 * x)
    _RULED[0] = True
    torch.testing.assert_close(di.gradient(_flagged, COMPILED, x, scale), 10 * x)


_RULED = [False]


def _flagged(x, c):
    return c * (_Rule.apply(x) if _RULED[0] else x**2).sum()


def test_a_number_new_on_every_call_runs_uncompiled_at_the_limit() -> None:
    # torch's recompile limit with fullgraph=True raised its own error from the ninth value on
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)

    def f(x, t):
        return torch.sum(t * x**2)

    prep = di.prepare_gradient(f, COMPILED, x, di.Constant(0.0))
    limit = torch._dynamo.config.recompile_limit
    ts = [0.1 * (i + 1) for i in range(limit + 2)]
    for t in ts[:limit]:
        torch.testing.assert_close(di.gradient(f, COMPILED, x, di.Constant(t), prep=prep), 2 * t * x)
    with pytest.warns(RuntimeWarning, match="recompile limit"):
        grad = di.gradient(f, COMPILED, x, di.Constant(ts[limit]), prep=prep)
    torch.testing.assert_close(grad, 2 * ts[limit] * x)
    torch.testing.assert_close(di.gradient(f, COMPILED, x, di.Constant(ts[-1]), prep=prep), 2 * ts[-1] * x)


def test_a_negative_zero_number_gets_a_graph_of_its_own() -> None:
    # torch.compile's guards compare a number with ==, for which -0.0 is 0.0: the graph compiled
    # for c = 0.0 gave 1 / c = +inf where c = -0.0 asks for -inf, prepared or not
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)

    def f(x, c):
        return torch.sum(x / c)

    prep = di.prepare_gradient(f, COMPILED, x, di.Constant(0.0))
    for c in (0.0, -0.0, 0.0, -0.0):
        expected = torch.full_like(x, math.copysign(math.inf, c))
        torch.testing.assert_close(di.gradient(f, COMPILED, x, di.Constant(c), prep=prep), expected)
        torch.testing.assert_close(di.gradient(f, COMPILED, x, di.Constant(c)), expected)

    def g(x, c):  # (a complex number: the sign of a zero part)
        return torch.sum(x / c.real)

    prep = di.prepare_gradient(g, COMPILED, x, di.Constant(0j))
    assert torch.all(di.gradient(g, COMPILED, x, di.Constant(0j), prep=prep) == math.inf)
    assert torch.all(di.gradient(g, COMPILED, x, di.Constant(complex(-0.0, 0.0)), prep=prep) == -math.inf)


def test_a_numpy_scalar_constant_is_the_number_it_holds() -> None:
    # torch.compile's trace of an np.float64 under torch.func raised torch's own AssertionError
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)

    def f(x, c):
        return torch.sum(x**2 * c)

    for c in (np.float64(3.0), np.float32(3.0), np.int64(3)):
        torch.testing.assert_close(di.gradient(f, COMPILED, x, di.Constant(c)), 6 * x)


def test_second_order_over_a_compiled_program_is_refused() -> None:
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)

    def f(x):
        return torch.sum(torch.sin(x) * x)

    def outer(x):  # a compiled call inside a function that torch.func differentiates
        return torch.sum(di.gradient(f, COMPILED, x) ** 2)

    with pytest.raises(di.UnsupportedOperationError, match="differentiated from outside"):
        di.gradient(outer, "torch-func", x)
    # an outer torch.func engine over it differentiates the inner gradient uncompiled: right, not compiled
    over = di.SecondOrder(di.AutoTorch(mode="func"), COMPILED)
    H = torch.diag(2 * torch.cos(x) - x * torch.sin(x))
    torch.testing.assert_close(di.hvp(f, over, x, torch.ones_like(x)), H @ torch.ones_like(x))


def test_a_graph_break_is_refused_clearly() -> None:
    def f(x):
        y = torch.sin(x)
        torch._dynamo.graph_break()  # (what code torch.compile cannot trace causes)
        return torch.sum(y**2)

    with pytest.raises(di.UnsupportedOperationError, match=r"torch\.compile could not compile"):
        di.gradient(f, COMPILED, torch.linspace(-1, 1, 4, dtype=torch.float64))

    def keeps(x, cache):  # a traced tensor stored in a Cache: the graph cannot return it
        y = torch.sum(torch.sin(x) * x)
        cache["last"] = y
        return y

    with pytest.raises(di.UnsupportedOperationError, match=r"could not compile(.|\n)*a di\.Cache written by f"):
        di.gradient(keeps, COMPILED, torch.linspace(-1, 1, 4, dtype=torch.float64), di.Cache({}))


_WEIGHTS = np.ones(3)


def test_a_compiler_s_own_assertion_is_an_unsupported_operation() -> None:
    """A numpy global read through torch.from_numpy: torch 2.13's compiler fails its own guard
    check on it (an AssertionError from inside torch.compile). It comes out as the
    UnsupportedOperationError a graph that does not compile gets; a torch whose compiler takes
    it gives the right gradient."""

    def f(x):
        return torch.sum(torch.from_numpy(_WEIGHTS) * x**2)

    x = torch.ones(3, dtype=torch.float64)
    try:
        grad = di.gradient(f, COMPILED, x)
    except di.UnsupportedOperationError as exc:
        message = str(exc)
    else:
        torch.testing.assert_close(grad, 2 * x)
        return
    assert "torch.compile could not compile" in message


def test_torch_nn_recipe_compiled() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    params = dict(model.named_parameters())
    before = {k: p.detach().clone() for k, p in params.items()}
    batch = (torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64))

    def loss(params, model, batch):
        inputs, targets = batch
        return ((torch.func.functional_call(model, params, (inputs,)) - targets) ** 2).mean()

    prep = di.prepare_gradient(loss, "torch-compile", params, di.Constant(model), di.Constant(batch))
    grads = di.gradient(loss, "torch-compile", params, di.Constant(model), di.Constant(batch), prep=prep)
    expected = di.gradient(loss, "torch-func", params, di.Constant(model), di.Constant(batch))
    assert grads.keys() == params.keys()
    for name in params:
        assert grads[name].dtype == torch.float64 and not grads[name].requires_grad
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-10, atol=1e-12)
        assert torch.equal(params[name].detach(), before[name])
    assert all(p.grad is None for p in model.parameters())
    compiled = graphs()
    batch2 = (batch[0] + 1, batch[1])  # a new batch of the same shapes: nothing compiles
    grads2 = di.gradient(loss, "torch-compile", params, di.Constant(model), di.Constant(batch2), prep=prep)
    expected2 = di.gradient(loss, "torch-func", params, di.Constant(model), di.Constant(batch2))
    for name in params:
        torch.testing.assert_close(grads2[name], expected2[name], rtol=1e-10, atol=1e-12)
    assert graphs() == compiled


def test_a_write_into_x_or_a_constant_leaves_them_intact() -> None:
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    w = torch.linspace(1, 2, 4, dtype=torch.float64)
    x0, w0 = x.clone(), w.clone()

    def writes_x(x, w):
        x.mul_(2)
        return torch.sum(x * w)

    def writes_w(x, w):
        w.add_(1)
        return torch.sum(x * w)

    for f in (writes_x, writes_w):
        with pytest.raises((di.MutationError, RuntimeError)):
            di.gradient(f, COMPILED, x, di.Constant(w))
        assert torch.equal(x, x0) and torch.equal(w, w0)


def test_what_f_closes_over_is_never_stale() -> None:
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    state = {"k": 2.0}
    w = torch.ones(4, dtype=torch.float64)

    def f(x):
        return torch.sum(state["k"] * x**2 * w)

    prep = di.prepare_gradient(f, COMPILED, x)
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep), 4 * x)
    state["k"] = 3.0  # a Python number: torch.compile's guard sees it and compiles anew
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep), 6 * x)
    w.mul_(2)  # a tensor, changed in place: an argument of the compiled graph
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep), 12 * x)


def test_a_tree_and_its_value_in_one_compiled_call() -> None:
    # a gradient call whose contexts are arrays is one compiled program with f closed in its trace
    x = {"a": torch.linspace(-1, 1, 3, dtype=torch.float64), "b": torch.linspace(0.5, 2, 2, dtype=torch.float64)}
    w = torch.linspace(1, 2, 3, dtype=torch.float64, requires_grad=True)  # (results detached all the same)
    x0 = {k: v.clone() for k, v in x.items()}

    def f(x, w):
        return torch.sum(torch.sin(x["a"]) * w) * torch.sum(x["b"] ** 2)

    prep = di.prepare_value_and_gradient(f, COMPILED, x, di.Constant(w))
    for k in range(3):  # new values, same shapes: one compile, on the first call
        xk = {n: v + k for n, v in x.items()}
        wk = (w * (k + 1)).detach().requires_grad_()
        if k == 1:
            before = graphs()
        value, grads = di.value_and_gradient(f, COMPILED, xk, di.Constant(wk), prep=prep)
        expected_value, expected = di.value_and_gradient(f, "torch-func", xk, di.Constant(wk))
        assert not value.requires_grad
        torch.testing.assert_close(value, expected_value.detach(), rtol=1e-12, atol=1e-12)
        assert grads.keys() == x.keys()
        for name in x:
            assert grads[name].dtype == torch.float64 and not grads[name].requires_grad
            torch.testing.assert_close(grads[name], expected[name], rtol=1e-12, atol=1e-12)
    assert graphs() == before
    assert all(torch.equal(x[n], x0[n]) for n in x)


def test_a_change_after_the_first_compile_is_compiled_with_its_refusals() -> None:
    # a later call that no compiled graph fits compiles one: as one graph, f's writes refused
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    x0 = x.clone()
    state = {"break": False, "write": False}

    def f(x):
        y = torch.sin(x)
        if state["break"]:
            torch._dynamo.graph_break()
        if state["write"]:
            x.mul_(2)
        return torch.sum(y * x)

    prep = di.prepare_gradient(f, COMPILED, x)
    expected = torch.sin(x) + x * torch.cos(x)
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep), expected)
    state["break"] = True
    with pytest.raises(di.UnsupportedOperationError, match=r"torch\.compile could not compile"):
        di.gradient(f, COMPILED, x, prep=prep)
    state["break"], state["write"] = False, True
    with pytest.raises(di.MutationError, match="its input x"):
        di.gradient(f, COMPILED, x, prep=prep)
    assert torch.equal(x, x0)
    state["write"] = False
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep), expected)


def test_a_caller_that_runs_torch_compile_eagerly_gets_right_results() -> None:
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        pytest.skip("this torch has no torch.compiler.set_stance")
    x = torch.linspace(-1, 1, 5, dtype=torch.float64)

    def f(x):
        return torch.sum(torch.tanh(x) * x)

    def other(x):
        return 2 * f(x)

    expected = torch.tanh(x) + x * (1 - torch.tanh(x) ** 2)
    prep = di.prepare_gradient(f, COMPILED, x)
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep), expected)
    before = graphs()
    with set_stance("force_eager"):  # compiled graphs are not run, nor compiled: torch runs f itself
        torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep), expected)
        torch.testing.assert_close(di.gradient(other, COMPILED, x), 2 * expected)  # a new prep
    assert graphs() == before
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep), expected)


def test_an_output_changed_after_the_first_compile_is_checked_again() -> None:
    # where a later call needs a new compile (f's global changed), f's output is checked again
    # eagerly first: a vector or a complex scalar is refused with diffiface's own error, as on a
    # first call (inside the trace torch.compile would report it as a graph break), and a real
    # scalar compiles anew
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    state = {"out": "scalar"}

    def f(x):
        y = x**2
        if state["out"] == "vector":
            return y
        if state["out"] == "complex":
            return torch.sum(y).to(torch.complex128)
        return torch.sum(y) * (3.0 if state["out"] == "scaled" else 1.0)

    prep = di.prepare_gradient(f, COMPILED, x)
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep), 2 * x)
    for out in ("vector", "complex"):
        state["out"] = out
        with pytest.raises(di.InvalidOutputError):
            di.gradient(f, COMPILED, x, prep=prep)
    state["out"] = "scaled"
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep), 6 * x)
    state["out"] = "scalar"
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep), 2 * x)


def test_an_aux_comes_back_as_f_returned_it_or_is_refused_by_name() -> None:
    """torch.compile traces optree through a stand-in whose structures come out of the graph as
    its own objects: a tuple's and a list's are rebuilt (strings and None beside the tensors,
    with jax imported too: no pytree registry is asked in the trace), a dict's is refused by
    name."""
    x = torch.tensor([0.3, -1.2, 0.8], dtype=torch.float64)
    (_, aux), grad = di.value_and_gradient(
        lambda v: ((v**2).sum(), (v.mean(), [v.sum(), None, "tag"])), "torch-compile", x, has_aux=True
    )
    torch.testing.assert_close(grad, 2 * x)
    assert type(aux) is tuple and type(aux[1]) is list and aux[1][1:] == [None, "tag"]
    torch.testing.assert_close(aux[0], x.mean())
    with pytest.raises(di.UnsupportedOperationError, match="structure of f's aux"):
        di.value_and_gradient(lambda v: ((v**2).sum(), {"m": v.mean()}), "torch-compile", x, has_aux=True)


def test_a_gradient_of_tensors_is_the_retracing_tier() -> None:
    """A gradient whose x (here nn.Parameters, as a model's) and contexts are tensors is compiled
    whole, the route's program with f in one graph (JitProgram, as jax's jit): later calls of the
    same shapes run that graph alone, compile nothing, give detached results equal to
    torch-func's, and write nothing; a call with a Cache keeps the operator's own program (a
    Cache is f's to write, and the whole trace would write into a rebuilt one)."""
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 2).double()
    params = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    data = torch.randn(5, 3, dtype=torch.float64)

    def loss(params, data):
        return torch.sum(torch.tanh(torch.func.functional_call(model, params, (data,))) ** 2)

    prep = di.prepare_gradient(loss, COMPILED, params, di.Constant(data))
    assert prep.plan.jit is not None
    di.gradient(loss, COMPILED, params, di.Constant(data), prep=prep)  # (compiles)
    compiled = graphs()
    for k in range(3):
        batch = data * (k + 1)
        grads = di.gradient(loss, COMPILED, params, di.Constant(batch), prep=prep)
        expected = di.gradient(loss, "torch-func", params, di.Constant(batch))
        assert grads.keys() == params.keys()
        for name in params:
            assert type(grads[name]) is torch.Tensor and not grads[name].requires_grad
            torch.testing.assert_close(grads[name], expected[name], rtol=1e-12, atol=1e-12)
    assert graphs() == compiled
    assert all(torch.equal(p.detach(), before[name]) for name, p in params.items())
    assert di.prepare_gradient(lambda x, c: torch.sum(x**2), COMPILED, data, di.Cache({})).plan.jit is None


class _Scaled:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def loss(self, x):
        return torch.sum(self.scale * _GLOBAL_SCALE[0] * x**2)


_GLOBAL_SCALE = [1.0]


def test_a_bound_method_and_what_it_reads_through_the_retracing_tier() -> None:
    """A bound method (its weak reference cannot be traced) keeps the operator's own compiled
    program, right; a function takes the retracing tier, and a global it reads is still
    guarded there (a change compiles anew), never stale."""
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    model = _Scaled(2.0)
    prep = di.prepare_gradient(model.loss, COMPILED, x)
    torch.testing.assert_close(di.gradient(model.loss, COMPILED, x, prep=prep), 4 * x)
    model.scale = 3.0
    torch.testing.assert_close(di.gradient(model.loss, COMPILED, x, prep=prep), 6 * x)

    def loss(x):
        return torch.sum(_GLOBAL_SCALE[0] * x**2)

    prep = di.prepare_gradient(loss, COMPILED, x)
    assert prep.plan.jit is not None
    torch.testing.assert_close(di.gradient(loss, COMPILED, x, prep=prep), 2 * x)
    _GLOBAL_SCALE[0] = 5.0
    try:
        torch.testing.assert_close(di.gradient(loss, COMPILED, x, prep=prep), 10 * x)
    finally:
        _GLOBAL_SCALE[0] = 1.0


def test_results_keep_no_graph_of_an_unfrozen_constant_module() -> None:
    # a head trained on a backbone left unfrozen, the model a Constant: the backbone's parameters
    # require grad, and the compiled graph's results would carry its backward (which nothing may
    # differentiate); detached, as every compiled result, on the first call and the later ones
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh()).double()  # (not frozen)
    tuned = torch.nn.Sequential(backbone, torch.nn.Linear(5, 1).double())
    head = {name: p for name, p in tuned.named_parameters() if name.startswith("1.")}
    inputs = torch.randn(6, 3, dtype=torch.float64)
    tangent = {name: torch.ones_like(p) for name, p in head.items()}

    def loss(params, model, inputs):
        return torch.func.functional_call(model, params, (inputs,)).pow(2).sum()

    contexts = (di.Constant(tuned), di.Constant(inputs))
    expected = di.gradient(loss, "torch-func", head, *contexts)
    value_prep = di.prepare_value_and_gradient(loss, COMPILED, head, *contexts)
    hvp_prep = di.prepare_hvp(loss, COMPILED, head, tangent, *contexts)
    for _ in range(2):
        value, grads = di.value_and_gradient(loss, COMPILED, head, *contexts, prep=value_prep)
        hvps = di.hvp(loss, COMPILED, head, tangent, *contexts, prep=hvp_prep)
        assert not value.requires_grad
        for name in head:
            assert not grads[name].requires_grad and not hvps[name].requires_grad
            torch.testing.assert_close(grads[name], expected[name].detach())


def test_a_hook_added_or_removed_after_the_first_compile_is_never_stale() -> None:
    # torch.compile skips guards on module hooks by default: a forward hook registered on the
    # Constant module (or one f closes over) after the first compile would leave the graph
    # compiled without it running; diffiface compiles with those guards, so a change compiles anew
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    params = dict(net.named_parameters())
    contexts = (di.Constant(net), di.Constant(torch.randn(5, 3, dtype=torch.float64)))

    def loss(params, model, inputs):
        return torch.func.functional_call(model, params, (inputs,)).pow(2).sum()

    prep = di.prepare_gradient(loss, COMPILED, params, *contexts)

    def agrees() -> bool:
        grads = di.gradient(loss, COMPILED, params, *contexts, prep=prep)
        expected = di.gradient(loss, "torch-func", params, *contexts)
        return all(torch.allclose(grads[name], expected[name].detach()) for name in params)

    assert agrees() and agrees()
    hook = net[1].register_forward_hook(lambda module, args, out: out * 3.0)
    assert agrees()  # the hook runs: compiled anew
    hook.remove()
    assert agrees()  # and without it again

    closed = torch.nn.Linear(3, 1).double()  # the retracing tier: x a tensor, the module in f's closure
    x = torch.linspace(-1, 1, 3, dtype=torch.float64)

    def f(x):
        return closed(x).pow(2).sum()

    prep_x = di.prepare_gradient(f, COMPILED, x)
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep_x), di.gradient(f, "torch-func", x))
    closed.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    torch.testing.assert_close(di.gradient(f, COMPILED, x, prep=prep_x), di.gradient(f, "torch-func", x))
    assert torch._dynamo.config.skip_nnmodule_hook_guards  # (the caller's setting, torch's default, as it was)


def test_a_dual_x_on_a_warm_prep_is_refused_not_stripped_of_its_tangent() -> None:
    # a gradient of tensors runs its compiled graph alone once a call has completed; a call on
    # the caller's forward-mode dual is differentiated from outside, and refused as on the first
    # call, not run by a graph that drops the tangent (it came back None, with no error)
    import torch.autograd.forward_ad as forward_ad

    x = torch.linspace(-1, 1, 3, dtype=torch.float64)
    c = torch.linspace(1, 2, 3, dtype=torch.float64)

    def f(x, c):
        return torch.sum(x**3 * c)

    prep = di.prepare_gradient(f, COMPILED, x, di.Constant(c))
    for _ in range(2):  # (warm: the compiled graph runs alone)
        torch.testing.assert_close(di.gradient(f, COMPILED, x, di.Constant(c), prep=prep), 3 * x**2 * c)
    di.jvp(f, "torch", x, torch.ones_like(x), di.Constant(c))  # (torch loads its forward-mode rules once)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.ones_like(x))
        with pytest.raises(di.UnsupportedOperationError, match="differentiated from outside"):
            di.gradient(f, COMPILED, dual, di.Constant(c), prep=prep)
    torch.testing.assert_close(di.gradient(f, COMPILED, x, di.Constant(c), prep=prep), 3 * x**2 * c)


def test_parameters_in_an_ordered_dict_or_a_namedtuple_are_compiled() -> None:
    # x's tree is rebuilt inside the compiled trace; optree's C rebuild of an OrderedDict (what
    # OrderedDict(model.named_parameters()) gives) or a namedtuple is not traceable, and the call
    # was refused as a graph break of f's; rebuilt in Python, it compiles and mirrors x's type
    import collections

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    params = collections.OrderedDict(model.named_parameters())
    inputs = torch.randn(5, 3, dtype=torch.float64)

    def loss(params, model, inputs):
        return torch.func.functional_call(model, dict(params), (inputs,)).pow(2).sum()

    contexts = (di.Constant(model), di.Constant(inputs))
    grads = di.gradient(loss, COMPILED, params, *contexts)
    expected = di.gradient(loss, "torch-func", params, *contexts)
    assert type(grads) is collections.OrderedDict and list(grads) == list(params)
    for name in params:
        torch.testing.assert_close(grads[name], expected[name].detach())

    pair = collections.namedtuple("pair", "a b")
    x = pair(torch.linspace(-1, 1, 3, dtype=torch.float64), torch.linspace(0.5, 1, 3, dtype=torch.float64))
    hvp = di.hvp(lambda p: torch.sum(p.a**2 * p.b), COMPILED, x, x)
    assert type(hvp) is pair
    torch.testing.assert_close(hvp.a, 2 * x.b * x.a + 2 * x.a * x.b)
    torch.testing.assert_close(hvp.b, 2 * x.a * x.a)


def test_a_static_leaf_of_x_is_rebuilt_in_the_compiled_trace() -> None:
    # x with a leaf that is not differentiated (a string: a layer's name, a mode) was rebuilt
    # around its static leaves by optree's C rebuild, which torch.compile cannot trace: refused
    # as a graph break of f's, where torch.func mode gives the gradient
    x = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64), "mode": "double"}

    def f(p):
        return (p["w"] ** 2).sum() * (2.0 if p["mode"] == "double" else 1.0)

    grads = di.gradient(f, COMPILED, x)
    assert grads["mode"] is None
    torch.testing.assert_close(grads["w"], 4 * x["w"])


def test_a_tensor_constant_beside_a_dict_constant_is_compiled() -> None:
    # di.functional's own example (an empty buffers dict beside a batch): the one-tensor Constant
    # was taken out by an operator.itemgetter of diffiface's, inside the whole gradient's trace,
    # which torch.compile cannot trace: refused as a graph break of f's
    layer = torch.nn.Linear(3, 2, dtype=torch.float64)
    f, params, buffers = di.functional(layer)
    inputs = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)

    def loss(params, buffers, inputs):
        return f(params, buffers, inputs).pow(2).sum()

    contexts = (di.Constant(buffers), di.Constant(inputs))
    grads = di.gradient(loss, COMPILED, params, *contexts)
    expected = di.gradient(loss, "torch-func", params, *contexts)
    for name in params:
        torch.testing.assert_close(grads[name], expected[name].detach())


def test_a_write_into_a_constant_on_a_later_call_lands_once() -> None:
    # expected, as "torch" gives it: named, and in the caller's tensor once (docs/policies.md). A
    # later call's new compile read f's graph eagerly first, and the compiled program wrote again
    x = torch.tensor([1.0, 2.0])

    def f(x, c, inplace):
        if inplace:
            torch.mul(c, 2.0, out=c)
        return (x * c).sum()

    c = torch.tensor([3.0, 4.0])
    di.gradient(f, COMPILED, x, di.Constant(c), di.Constant(False))
    with pytest.raises(di.MutationError, match=r"contexts\[0\]"):
        di.gradient(f, COMPILED, x, di.Constant(c), di.Constant(True))
    assert c.tolist() == [6.0, 8.0]
    # the same through the retracing tier (tensors alone), whose eager run read f's graph by a
    # run of f of its own before the gradient's
    inplace = [False]

    def g(x, c):
        return f(x, c, inplace[0])

    c = torch.tensor([3.0, 4.0])
    di.gradient(g, COMPILED, x, di.Constant(c))
    inplace[0] = True
    with pytest.raises(di.MutationError, match=r"contexts\[0\]"):
        di.gradient(g, COMPILED, x, di.Constant(c))
    assert c.tolist() == [6.0, 8.0]
