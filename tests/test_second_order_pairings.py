"""Every ``SecondOrder(outer, inner)`` pairing of every backend: right, or refused when made.

The expected outcome of each pairing is written here from the rules (docs/backends.md,
"SecondOrder pairings"), independently of the table in ``diffiface._backends``: a pairing
that is refused must say why and name a pairing that works; one that is accepted must give
the analytic second derivatives of every second-order operator, in float64.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np
import pytest
from conftest import namespace, require, to_numpy

import diffiface as di

ENGINES: dict[str, di.Backend] = {
    "jax": di.AutoJAX(),
    "jax-nojit": di.AutoJAX(jit=False),
    "torch-autograd": di.AutoTorch(mode="autograd"),
    "torch-func": di.AutoTorch(mode="func"),
    "autograd": di.AutoAutograd(),
    **{
        f"fd-{method}{'-vec' if vectorize else ''}": di.AutoFiniteDifferences(method=method, vectorize=vectorize)
        for method in ("central", "forward", "backward", "complex")
        for vectorize in (False, True)
    },
    "scipy": di.AutoScipy(),
}
AD = {"jax", "jax-nojit", "torch-autograd", "torch-func", "autograd"}


def family(name: str) -> str:
    """The engine a test id names: jax, torch, autograd, fd, scipy."""
    return name.split("-")[0]


def fd_method(name: str) -> str | None:
    return name.split("-")[1] if name.startswith("fd-") else None


def expected_refusal(outer: str, inner: str) -> bool:
    """The rules, restated: an AD outer needs its own engine inside (torch: the same mode); a
    complex step needs autograd or the complex step inside; real finite-difference gradients
    are differenced only by the same method (one engine's own second differences)."""
    if outer in AD:
        if inner not in AD or family(outer) != family(inner):
            return True
        return family(outer) == "torch" and outer != inner
    if fd_method(inner) not in (None, "complex") and fd_method(outer) != fd_method(inner):
        return True
    if fd_method(outer) == "complex":
        return not (inner == "autograd" or fd_method(inner) == "complex")
    return False


def tolerance(outer: str, inner: str) -> float:
    """Absolute tolerance (the values are of order one): tight where no step is taken."""
    if outer in AD or (fd_method(outer) == "complex" and inner == "autograd"):
        return 1e-12
    if outer == "scipy":
        return 1e-8
    return 1e-5  # a first difference of exact gradients, or one engine's second differences


PAIRS = list(itertools.product(ENGINES, ENGINES))
ACCEPTED = [(o, i) for o, i in PAIRS if not expected_refusal(o, i)]
REFUSED = [(o, i) for o, i in PAIRS if expected_refusal(o, i)]


def pair_id(pair: tuple[str, str]) -> str:
    return f"{pair[0]}-over-{pair[1]}"


def make(outer: str, inner: str) -> di.SecondOrder:
    require(ENGINES[outer])
    require(ENGINES[inner])
    return di.SecondOrder(ENGINES[outer], ENGINES[inner])


# -- the functions and their derivatives ------------------------------------------------------

X = np.array([0.3, -0.7, 1.1])
V = np.array([0.5, 1.0, -2.0])
S = 0.8


def f(x: Any) -> Any:
    """sum(sin(x) * x**2), in whatever framework x belongs to."""
    xp = namespace(x)
    return xp.sum(xp.sin(x) * x**2, axis=-1)  # over the last axis: vectorize=True batches x


def g(s: Any) -> Any:
    """sin(s) * s**3 of a scalar."""
    xp = namespace(s)
    return xp.sin(s) * s**3


def gradient_f(x: np.ndarray) -> np.ndarray:
    return 2 * x * np.sin(x) + x**2 * np.cos(x)


def hessian_f(x: np.ndarray) -> np.ndarray:
    return np.diag(2 * np.sin(x) + 4 * x * np.cos(x) - x**2 * np.sin(x))


def second_g(s: float) -> float:
    return float(6 * s * np.sin(s) + 6 * s**2 * np.cos(s) - s**3 * np.sin(s))


def close(actual: Any, expected: Any, atol: float) -> None:
    np.testing.assert_allclose(to_numpy(actual), expected, rtol=0, atol=atol)


# -- accepted pairings: right on every second-order operator ------------------------------------


@pytest.mark.parametrize(("outer", "inner"), ACCEPTED, ids=[pair_id(p) for p in ACCEPTED])
def test_accepted_pairing_is_right(outer: str, inner: str) -> None:
    backend = make(outer, inner)
    atol = tolerance(outer, inner)
    x, v = X.copy(), V.copy()

    close(di.hessian(f, backend, x), hessian_f(X), atol)
    close(di.hvp(f, backend, x, v), hessian_f(X) @ V, atol)
    value, gradient, hessian = di.value_gradient_and_hessian(f, backend, x)
    close(value, float(np.sum(np.sin(X) * X**2)), 1e-12)
    close(gradient, gradient_f(X), max(atol, 1e-7))  # the inner engine's gradient
    close(hessian, hessian_f(X), atol)
    gradient, hvp = di.gradient_and_hvp(f, backend, x, v)
    close(gradient, gradient_f(X), max(atol, 1e-7))
    close(hvp, hessian_f(X) @ V, atol)
    second = di.second_derivative(g, backend, S)
    assert isinstance(second, float)
    close(second, second_g(S), atol)
    # inputs untouched
    np.testing.assert_array_equal(x, X)
    np.testing.assert_array_equal(v, V)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("outer", ["fd-central", "fd-complex", "scipy"])
def test_black_box_outer_keeps_a_numpy_scalar_numpy(outer: str, dtype: type) -> None:
    """A numpy scalar x (np.float64 is also a Python float; scipy promotes float32 to it) reaches
    the inner engine as numpy of its dtype, never as a bare float that has no shape."""
    backend = make(outer, "autograd")
    second = di.second_derivative(g, backend, dtype(S))
    assert np.asarray(second).dtype == dtype
    close(second, second_g(S), 1e-3 if dtype is np.float32 else tolerance(outer, "autograd"))


# -- refused pairings: at construction, with the reason and a pairing that works ----------------

_SUGGESTED = re.compile(r"SecondOrder\((\w+\([^()]*\)), (\w+\([^()]*\))\)")


@pytest.mark.parametrize(("outer", "inner"), REFUSED, ids=[pair_id(p) for p in REFUSED])
def test_refused_pairing_says_why_and_what_works(outer: str, inner: str) -> None:
    with pytest.raises(di.UnsupportedOperationError) as info:
        di.SecondOrder(ENGINES[outer], ENGINES[inner])
    message = str(info.value)
    assert message.startswith("SecondOrder("), message
    suggestions = [m.groups() for m in _SUGGESTED.finditer(message)][1:]  # the first is the pairing itself
    if suggestions:
        for outer_text, inner_text in suggestions:
            namespace_ = {name: getattr(di, name) for name in di.__all__}
            suggested = eval(f"SecondOrder({outer_text}, {inner_text})", namespace_)  # must not raise
            assert isinstance(suggested, di.SecondOrder)
    else:  # finite differences of one method: their own second differences
        assert "one finite-difference engine" in message, message
        di.SecondOrder(ENGINES[inner], ENGINES[inner])


def test_the_table_is_exhaustive() -> None:
    """The matrix covers every outer and inner, and both outcomes occur for black-box outers."""
    assert len(PAIRS) == len(ENGINES) ** 2 == len(ACCEPTED) + len(REFUSED)
    assert ("fd-complex", "autograd") in ACCEPTED
    assert ("fd-complex", "jax") in REFUSED
    assert ("scipy", "jax") in ACCEPTED
    assert ("fd-central", "fd-forward") in REFUSED


@pytest.mark.parametrize(
    ("outer", "inner", "words"),
    [
        pytest.param(di.AutoJAX(), di.AutoScipy(), "nothing to trace", id="jax-over-scipy"),
        pytest.param(di.AutoTorch(), di.AutoFiniteDifferences(), "nothing to trace", id="torch-over-fd"),
        pytest.param(di.AutoAutograd(), di.AutoJAX(), "cannot trace through jax", id="autograd-over-jax"),
        pytest.param(di.AutoTorch(), di.AutoTorch(mode="func"), "same mode", id="torch-modes"),
        pytest.param(
            di.AutoFiniteDifferences(method="complex"), di.AutoJAX(), "real-valued functions", id="complex-over-jax"
        ),
        pytest.param(di.AutoFiniteDifferences(method="complex"), di.AutoTorch(), "conjugate", id="complex-over-torch"),
        pytest.param(
            di.AutoFiniteDifferences(method="complex"),
            di.AutoFiniteDifferences(),
            "imaginary step is lost",
            id="complex-over-fd-central",
        ),
        pytest.param(di.AutoScipy(), di.AutoFiniteDifferences(), "rounding error", id="scipy-over-fd-central"),
    ],
)
def test_refusal_reasons(outer: di.Backend, inner: di.Backend, words: str) -> None:
    with pytest.raises(di.UnsupportedOperationError, match=words):
        di.SecondOrder(outer, inner)


# -- what the accepted pairings carry beside the values -----------------------------------------


def test_scipy_outer_reports_its_error_estimate() -> None:
    """scipy differentiating an AD gradient: prep.error is shaped as the result, and small."""
    backend = make("scipy", "autograd")
    prep = di.prepare_value_gradient_and_hessian(f, backend, X)
    _, _, hessian = di.value_gradient_and_hessian(f, backend, X, prep=prep)
    close(hessian, hessian_f(X), 1e-8)
    value_error, gradient_error, hessian_error = prep.error
    assert np.shape(hessian_error) == (3, 3)
    assert np.shape(gradient_error) == (3,)
    assert float(np.max(hessian_error)) < 1e-6
    assert float(value_error) == 0.0


def test_vectorized_outer_is_point_by_point() -> None:
    """A vectorized finite-difference outer evaluates the inner gradient one point at a time;
    f itself is never called on a batch, so it need not broadcast."""
    calls: list[tuple[int, ...]] = []

    def scalar_only(x: Any) -> Any:
        calls.append(tuple(x.shape))
        return f(x)

    backend = make("fd-central-vec", "autograd")
    close(di.hessian(scalar_only, backend, X), hessian_f(X), 1e-5)
    assert set(calls) == {(3,)}


def test_complex_step_over_autograd_is_exact_to_rounding() -> None:
    backend = make("fd-complex", "autograd")
    x = np.array([2.0, -3.0, 0.25])
    close(di.hessian(f, backend, x), hessian_f(x), 1e-13)


TORCH_VARIANTS = {
    "default": {},
    "jvp-reverse": {"jvp": "reverse"},
    "jvp-auto": {"jvp": "auto"},
    "create-graph": {"create_graph": True},
    "create-graph-jvp-reverse": {"create_graph": True, "jvp": "reverse"},
}


@pytest.mark.parametrize("inner", list(TORCH_VARIANTS))
@pytest.mark.parametrize("outer", list(TORCH_VARIANTS))
def test_torch_autograd_variants_pair_rightly(outer: str, inner: str) -> None:
    """Two autograd-mode adapters of other options (a jvp by two backward passes, a kept graph)
    differ as objects: the outer's products must still reach through the inner's gradient,
    never read it as a constant (zeros)."""
    torch = pytest.importorskip("torch")
    backend = di.SecondOrder(di.AutoTorch(**TORCH_VARIANTS[outer]), di.AutoTorch(**TORCH_VARIANTS[inner]))
    x, v = torch.tensor(X), torch.tensor(V)
    close(di.hessian(f, backend, x).detach(), hessian_f(X), 1e-12)
    close(di.hvp(f, backend, x, v).detach(), hessian_f(X) @ V, 1e-12)
    hvps = di.batched_hvp(f, backend, x, di.Tangents(v, 2 * v))
    close(hvps[1].detach(), 2 * hessian_f(X) @ V, 1e-12)
    refusal = ""
    try:  # forward over forward: torch's one dual level refuses it, clearly, or it is right
        second = di.second_derivative(g, backend, torch.tensor(S, dtype=torch.float64))
    except di.UnsupportedOperationError as error:
        refusal = str(error)
    if refusal:
        assert "forward" in refusal
    else:
        close(second.detach(), second_g(S), 1e-12)
