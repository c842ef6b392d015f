"""A property over the adversarial corpus: for f drawn from a family that includes plain smooth
functions, functions that write into their input (numpy, torch), and functions that call
diffiface inside themselves (an inner gradient of the same engine), on a drawn backend and a
drawn x (float64, shape (3,) or a dict of two arrays), a gradient either equals the analytic
gradient or raises a DiffifaceError, and never changes its inputs or process-wide state. The
same for complex f on complex x: right in the convention of docs/complex.md, or refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optree
import pytest
from _adversarial_helpers import (
    BACKENDS,
    RIGHT,
    RIGHT_OR_ERROR,
    RIGHT_OR_MUTATION,
    as_input,
    check_case,
    d2h,
    dh,
    framework,
    h,
    need,
    process_state_unchanged,
    to_numpy,
    tolerance,
    xp_of,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diffiface as di

__all__ = ["process_state_unchanged"]  # the autouse fixture, imported so that pytest finds it

settings.register_profile(
    "adversarial",
    max_examples=4,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

PROPERTY_BACKENDS = ("jax", "torch-autograd", "torch-func", "autograd", "fd-central", "fd-forward", "scipy")
FAMILIES = ("smooth", "write-in-place", "nested-gradient")
"""smooth: sum(sin(x) x^2); write-in-place: f doubles x in place first (numpy / torch; a
rebinding on jax and autograd), so it computes sum(h(2x)); nested-gradient: f = sum(g(x)^2)
with g an inner di.gradient of sum(h) on the same engine (finite differences: the numpy one)."""


def _leaves(x: Any) -> list[Any]:
    return [x["a"], x["b"]] if isinstance(x, dict) else [x]


def _expected(family: str, x0: Any) -> Any:
    def grad_leaf(v: np.ndarray) -> np.ndarray:
        if family == "smooth":
            return dh(v)
        if family == "write-in-place":
            return 2 * dh(2 * v)
        return 2 * dh(v) * d2h(v)  # d/dv sum(dh(v)^2)

    if isinstance(x0, dict):
        return {k: grad_leaf(v) for k, v in x0.items()}
    return grad_leaf(x0)


def _expectation(backend_id: str, family: str) -> Any:
    fw = framework(backend_id)
    if family == "write-in-place" and fw in ("numpy", "torch"):
        return RIGHT_OR_MUTATION  # a private copy, or MutationError
    # nested-gradient: the same engine traces through itself, and a black box outer only
    # evaluates the inner call: right in both cases
    return RIGHT


def _make_f(backend_id: str, family: str, tree: bool) -> Any:
    fw = framework(backend_id)
    xp = xp_of(fw)
    inner_backend = BACKENDS[backend_id] if fw != "numpy" else BACKENDS["fd-central"]

    def piece(v: Any) -> Any:
        if family == "smooth":
            return h(xp, v).sum()
        if family == "write-in-place":
            v *= 2  # in place on numpy arrays and torch tensors
            return h(xp, v).sum()
        inner = di.gradient(lambda u: h(xp, u).sum(), inner_backend, v)
        return (inner**2).sum()

    if tree:
        return lambda p: piece(p["a"]) + piece(p["b"])
    return piece


@st.composite
def cases(draw: Any) -> tuple[str, str, Any]:
    backend_id = draw(st.sampled_from(PROPERTY_BACKENDS))
    family = draw(st.sampled_from(FAMILIES))
    values = st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False)
    if draw(st.booleans()):
        x0: Any = {
            "a": np.array(draw(st.lists(values, min_size=2, max_size=2))),
            "b": np.array(draw(st.lists(values, min_size=3, max_size=3))),
        }
    else:
        x0 = np.array(draw(st.lists(values, min_size=3, max_size=3)))
    return backend_id, family, x0


@settings(settings.get_profile("adversarial"), max_examples=40)
@given(case=cases())
def test_right_or_refused_and_inputs_unchanged(case: tuple[str, str, Any]) -> None:
    backend_id, family, x0 = case
    need(backend_id)
    fw = framework(backend_id)
    x = {k: as_input(v, fw) for k, v in x0.items()} if isinstance(x0, dict) else as_input(x0, fw)
    f = _make_f(backend_id, family, isinstance(x0, dict))
    expect = _expectation(backend_id, family)
    tol = tolerance(backend_id, second_order=family == "nested-gradient")
    check_case(lambda: di.gradient(f, BACKENDS[backend_id], x), expect, _expected(family, x0), inputs=(x,), **tol)


# -- complex f -------------------------------------------------------------------------------------

COMPLEX_FAMILIES = ("real-part", "write-in-place", "complex-valued", "holomorphic-map", "conjugating-map")
"""On complex x (docs/complex.md): real-part: the gradient of sum(Re h(z)), conj(h'(z));
write-in-place: f doubles z in place first (numpy / torch; a rebinding on jax and autograd);
complex-valued: the gradient of sum(h(z)), refused (InvalidOutputError); holomorphic-map: the
Jacobian of h(z), diag(h'(z)); conjugating-map: the Jacobian of conj(z) h(z), refused
(UnsupportedOperationError, not holomorphic)."""


def _complex_f(backend_id: str, family: str, tree: bool) -> Any:
    xp = xp_of(framework(backend_id))

    def piece(v: Any) -> Any:
        if family == "real-part":
            return xp.real(h(xp, v)).sum()
        if family == "write-in-place":
            v *= 2
            return xp.real(h(xp, v)).sum()
        if family == "complex-valued":
            return h(xp, v).sum()
        if family == "holomorphic-map":
            return h(xp, v)
        return xp.conj(v) * h(xp, v)

    if tree:
        return lambda p: piece(p["a"]) + piece(p["b"])
    return piece


def _complex_expected(family: str, x0: Any) -> Any:
    def grad_leaf(v: np.ndarray) -> np.ndarray:
        return np.conj(dh(v)) if family == "real-part" else 2 * np.conj(dh(2 * v))

    expected = {k: grad_leaf(v) for k, v in x0.items()} if isinstance(x0, dict) else grad_leaf(x0)
    if family == "holomorphic-map":
        expected = np.diag(dh(x0))

    def check(result: Any) -> None:
        leaves = optree.tree_leaves(result)
        wanted = optree.tree_leaves(expected)
        assert len(leaves) == len(wanted)
        for got, want in zip(leaves, wanted, strict=True):
            got = to_numpy(got)
            assert np.iscomplexobj(got), f"a complex x got a {got.dtype} result"
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)

    return check


def _complex_expectation(backend_id: str, family: str) -> Any:
    if family == "complex-valued":
        return di.InvalidOutputError
    if family == "conjugating-map":
        return di.UnsupportedOperationError
    if family == "write-in-place" and framework(backend_id) in ("numpy", "torch"):
        return RIGHT_OR_MUTATION
    return RIGHT


@st.composite
def complex_cases(draw: Any) -> tuple[str, str, Any]:
    backend_id = draw(st.sampled_from(PROPERTY_BACKENDS))
    family = draw(st.sampled_from(COMPLEX_FAMILIES))
    parts = st.floats(-1.5, 1.5, allow_nan=False, allow_infinity=False)

    def vector(n: int) -> np.ndarray:
        re = np.array(draw(st.lists(parts, min_size=n, max_size=n)))
        im = np.array(draw(st.lists(parts, min_size=n, max_size=n)))
        return re + 1j * im

    x0: Any = (
        {"a": vector(2), "b": vector(2)}
        if family not in ("holomorphic-map", "conjugating-map") and draw(st.booleans())
        else vector(3)
    )
    return backend_id, family, x0


@settings(settings.get_profile("adversarial"), max_examples=30)
@given(case=complex_cases())
def test_complex_f_right_or_refused_and_inputs_unchanged(case: tuple[str, str, Any]) -> None:
    backend_id, family, x0 = case
    need(backend_id)
    fw = framework(backend_id)
    x = {k: as_input(v, fw) for k, v in x0.items()} if isinstance(x0, dict) else as_input(x0, fw)
    f = _complex_f(backend_id, family, isinstance(x0, dict))
    operator = di.jacobian if family in ("holomorphic-map", "conjugating-map") else di.gradient
    check_case(
        lambda: operator(f, BACKENDS[backend_id], x),
        _complex_expectation(backend_id, family),
        _complex_expected(family, x0),
        inputs=(x,),
    )


def test_expectations_are_written_for_every_draw() -> None:
    """Every (backend, family) pair has an expectation, and none is looser than the contract."""
    for backend_id in PROPERTY_BACKENDS:
        for family in FAMILIES:
            assert _expectation(backend_id, family) in (RIGHT, RIGHT_OR_MUTATION, RIGHT_OR_ERROR)
        for family in COMPLEX_FAMILIES:  # refusals name their type: never the looser "any error"
            assert _complex_expectation(backend_id, family) in (
                RIGHT,
                RIGHT_OR_MUTATION,
                di.InvalidOutputError,
                di.UnsupportedOperationError,
            )


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
