"""check_gradients on ops nobody here wrote (tests/_op_corpus.py): no false failure on the
right gradient, and the corrupted twin (1.01 times the gradient, or its largest entry moved by
1%) caught.

The CI sample is deterministic: every 16th torch OpInfo op (by name) and every 6th op of the
jax list, in float64 and float32 (about 80 checks, a minute of CPU). ``python
tests/_op_corpus.py`` runs the whole corpus (docs/testing.md quotes its counts)."""

from __future__ import annotations

import importlib.util

import _op_corpus as corpus
import pytest

import diffiface as di
from diffiface.test import check_gradients

TORCH_STRIDE, JAX_STRIDE = 16, 6


def _cases() -> list[corpus.Case]:
    cases: list[corpus.Case] = []
    for dtype in ("float64", "float32"):
        if importlib.util.find_spec("torch") is not None:
            cases.extend(corpus.torch_cases(dtype, TORCH_STRIDE))
        if importlib.util.find_spec("jax") is not None:
            cases.extend(corpus.jax_cases(dtype, JAX_STRIDE))
    return cases


CASES = _cases()


def _backends(case: corpus.Case) -> list[di.Backend]:
    return [di.AutoJAX(jit=False)] if case.framework == "jax" else [di.AutoTorch()]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.framework}-{c.dtype}-{c.name}" for c in CASES])
def test_right_gradient_passes_and_corrupted_twin_is_caught(case: corpus.Case) -> None:
    report = check_gradients(case.f, case.x, backends=_backends(case))
    (row,) = report.rows
    if row.status == "skipped":
        # the only honest skip here: torch's sample sits where f is not differentiable
        assert "not differentiable" in row.message, row.message
        return
    assert row.status == "passed", row.message
    with pytest.raises(AssertionError, match=r"differ|Taylor test"):
        check_gradients(case.twin, case.x, backends=_backends(case))


def test_the_sample_covers_both_frameworks_and_dtypes() -> None:
    seen = {(c.framework, c.dtype) for c in CASES}
    expected = {(f, d) for f in ("torch", "jax") if importlib.util.find_spec(f) for d in ("float64", "float32")}
    assert seen == expected
    assert len(CASES) >= 60


def _flat_float32_cases() -> list[corpus.Case]:
    cases: list[corpus.Case] = []
    if importlib.util.find_spec("torch") is not None:
        cases.extend(
            corpus.torch_cases("float32", 1, names=frozenset({"round", "round.decimals_0", "round.decimals_3"}))
        )
    if importlib.util.find_spec("jax") is not None:
        cases.extend(corpus.jax_cases("float32", 1, names=frozenset({"round", "trunc"})))
    return cases


FLAT = _flat_float32_cases()


@pytest.mark.parametrize("case", FLAT, ids=[f"{c.framework}-{c.dtype}-{c.name}" for c in FLAT])
def test_a_piecewise_constant_float32_op_is_not_taken_for_an_f_casting_back(case: corpus.Case) -> None:
    # these ops leave f unchanged by moves below float32's last place, as an f that casts its
    # float64 copies back to float32 does; the truth must keep float64's steps for them all the same
    test_right_gradient_passes_and_corrupted_twin_is_caught(case)
