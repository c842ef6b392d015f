"""The torch guard's cost on the common call, counted by route (never by time), and the
guarantees its fast path must keep: a write into x or a Constant, even under no_grad, is a
MutationError and the caller's tensors are bit-for-bit as they were."""

from __future__ import annotations

import sys
from typing import Any

import pytest

import diffiface as di

torch = pytest.importorskip("torch")

ADAPTER_FILE = "diffiface/_adapters/torch.py"


def loss(w: Any, data: Any) -> Any:
    return (torch.tanh(data @ w) ** 2).mean()


def adapter_frames(call: Any) -> list[str]:
    """The Python functions of the torch adapter that ``call`` enters, in order."""
    entered: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.replace("\\", "/").endswith(ADAPTER_FILE):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


def test_common_gradient_enters_only_the_guard_the_method_and_the_output_checks() -> None:
    # expected: guarded, value_and_gradient, untracked, output_leaf; no helper, listcomp or genexpr
    w, data = torch.randn(5), torch.randn(7, 5)
    backend, ctx = di.AutoTorch(), di.Constant(data)
    prep = di.prepare_gradient(loss, backend, w, ctx)

    def call() -> None:
        di.gradient(loss, backend, w, ctx, prep=prep)

    call()
    assert adapter_frames(call) == ["guarded", "value_and_gradient", "untracked", "output_leaf"]


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
def test_fast_path_refuses_writes_and_loses_nothing(f: Any, prepared: bool) -> None:
    # expected: a MutationError every time; w and data equal to their copies, versions unchanged
    w, data = torch.randn(5), torch.randn(7, 5)
    w0, data0 = w.clone(), data.clone()
    versions = (w._version, data._version)
    backend, ctx = di.AutoTorch(), di.Constant(data)

    def call() -> None:
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
