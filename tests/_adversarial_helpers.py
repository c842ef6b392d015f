"""Shared pieces of the adversarial corpus (tests/test_adversarial*.py).

Every case states its expected outcome before it runs (``RIGHT``, an error class, or one of the
"either" outcomes the contract allows), runs the call through :func:`check_case`, and so gets
the same checks: the inputs are bit-identical afterwards (also when the call raised), no
process-wide state changed, and a result, when there is one, equals the analytic derivative.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree
import pytest

import diffiface as di
from diffiface.test import default_tolerances

# -- backends ---------------------------------------------------------------------------------

BACKENDS: dict[str, di.Backend] = {
    "jax": di.AutoJAX(),
    "torch-autograd": di.AutoTorch(mode="autograd"),
    "torch-func": di.AutoTorch(mode="func"),
    "autograd": di.AutoAutograd(),
    "fd-central": di.AutoFiniteDifferences(method="central"),
    "fd-forward": di.AutoFiniteDifferences(method="forward"),
    "fd-backward": di.AutoFiniteDifferences(method="backward"),
    "fd-complex": di.AutoFiniteDifferences(method="complex"),
    "fd-vectorize": di.AutoFiniteDifferences(vectorize=True),
    "scipy": di.AutoScipy(),
}
"""Every first-order backend and option the corpus runs, by test id."""

FD_IDS = ("fd-central", "fd-forward", "fd-backward", "fd-complex", "fd-vectorize")
BLACK_BOX_IDS = (*FD_IDS, "scipy")


def framework(backend_id: str) -> str:
    """The framework ``f`` is written for under a backend: jax, torch, autograd, or numpy."""
    if backend_id == "jax":
        return "jax"
    if backend_id.startswith("torch"):
        return "torch"
    if backend_id == "autograd":
        return "autograd"
    return "numpy"


def need(*backends: di.Backend | str) -> None:
    """Skip, naming the engine, when a backend's engine is not installed."""
    for backend in backends:
        b = BACKENDS.get(backend, backend) if isinstance(backend, str) else backend
        parts = (b.outer, b.inner) if isinstance(b, di.SecondOrder) else (b,)
        for part in parts:
            if not di.available(part):
                pytest.skip(f"the {part.name} engine is not installed")


def need_module(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")


def xp_of(fw: str) -> Any:
    """The array namespace ``f`` computes with under a framework."""
    if fw == "jax":
        import jax.numpy as jnp

        return jnp
    if fw == "torch":
        import torch

        return torch
    if fw == "autograd":
        import autograd.numpy as anp

        return anp
    return np


def as_input(array: np.ndarray, fw: str) -> Any:
    """``array`` as a user of the framework passes it: torch users pass tensors, the others numpy."""
    if fw == "torch":
        import torch

        return torch.tensor(array)
    return np.array(array)


def to_numpy(leaf: Any) -> np.ndarray:
    if type(leaf).__module__.startswith("torch"):
        return leaf.detach().cpu().numpy()  # type: ignore[no-any-return]
    return np.asarray(leaf)


# -- the analytic test function -----------------------------------------------------------------
# h(v) = sin(v) * v**2 elementwise; f(x) = sum(h(x)).


def h(xp: Any, v: Any) -> Any:
    return xp.sin(v) * v**2


def dh(v: np.ndarray) -> np.ndarray:
    return np.cos(v) * v**2 + 2 * v * np.sin(v)


def d2h(v: np.ndarray) -> np.ndarray:
    return 4 * v * np.cos(v) + (2 - v**2) * np.sin(v)


def total(v: Any) -> Any:
    """The sum over the last axis, written once for numpy, jax, torch and autograd's boxes (so a
    batch of inputs on a leading axis, as vectorised finite differences pass, still works)."""
    return v.sum(-1)


# -- snapshots: inputs and process-wide state ---------------------------------------------------


@dataclass
class _Leaf:
    obj: Any
    values: np.ndarray | None
    dtype: Any
    requires_grad: bool | None = None
    grad: np.ndarray | None = None
    is_meta: bool = False


def _record(leaf: Any) -> _Leaf:
    module = type(leaf).__module__
    if module.startswith("torch"):
        if leaf.is_meta:
            return _Leaf(leaf, None, leaf.dtype, leaf.requires_grad, None, is_meta=True)
        grad = None if leaf.grad is None else leaf.grad.detach().clone().numpy()
        return _Leaf(leaf, leaf.detach().clone().numpy(), leaf.dtype, leaf.requires_grad, grad)
    if isinstance(leaf, (np.ndarray, np.generic)) or module.startswith("jax"):
        values = np.array(leaf, copy=True)
        return _Leaf(leaf, values, values.dtype)
    return _Leaf(leaf, None, type(leaf))  # Python numbers, strings: compared by value below


class Snapshot:
    """Copies of every array leaf of ``trees``; :meth:`assert_unchanged` compares bit for bit
    (dtype included), and for torch tensors also ``requires_grad`` and ``.grad``."""

    def __init__(self, *trees: Any) -> None:
        self.leaves = [_record(leaf) for tree in trees for leaf in optree.tree_leaves(tree, none_is_leaf=False)]
        self.scalars = [leaf.obj for leaf in self.leaves if leaf.values is None and not leaf.is_meta]

    def assert_unchanged(self) -> None:
        for i, rec in enumerate(self.leaves):
            now = rec.obj
            if type(now).__module__.startswith("torch"):
                assert now.dtype == rec.dtype, f"input leaf {i}: dtype changed {rec.dtype} -> {now.dtype}"
                assert now.requires_grad == rec.requires_grad, f"input leaf {i}: requires_grad changed"
                grad = None if now.grad is None else now.grad.detach().numpy()
                assert (grad is None) == (rec.grad is None), f"input leaf {i}: .grad changed (was {rec.grad})"
                if grad is not None:
                    assert np.array_equal(grad, rec.grad, equal_nan=True), f"input leaf {i}: .grad changed"
                if rec.is_meta:
                    continue
                values = now.detach().numpy()
            elif rec.values is None:
                continue
            else:
                values = np.asarray(now)
            assert values.dtype == rec.values.dtype, f"input leaf {i}: dtype changed"
            assert values.shape == rec.values.shape, f"input leaf {i}: shape changed"
            assert np.array_equal(values, rec.values, equal_nan=True), (
                f"input leaf {i} was changed by the call: before {rec.values!r}, after {values!r}"
            )


def process_state() -> dict[str, Any]:
    """Every process-wide flag an engine call might leave changed."""
    state: dict[str, Any] = {}
    if importlib.util.find_spec("torch") is not None:
        import torch
        import torch.autograd.forward_ad as fwad

        state["torch.is_grad_enabled"] = torch.is_grad_enabled()
        state["torch.is_inference_mode_enabled"] = torch.is_inference_mode_enabled()
        state["torch.get_default_dtype"] = torch.get_default_dtype()
        try:  # outside any dual level, making a dual tensor must fail
            with warnings.catch_warnings():  # torch scripts its decompositions on first use
                warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*")  # Deprecation- or FutureWarning
                fwad.make_dual(torch.zeros(1), torch.zeros(1))
            state["forward-AD level open"] = True
        except RuntimeError:
            state["forward-AD level open"] = False
    if importlib.util.find_spec("jax") is not None:
        import jax

        state["jax_enable_x64"] = jax.config.read("jax_enable_x64")
    return state


@pytest.fixture(autouse=True)
def process_state_unchanged() -> Iterator[None]:
    """Autouse (imported by each adversarial test module): no case may change process-wide state."""
    before = process_state()
    yield
    after = process_state()
    assert after == before, f"process-wide state changed: before {before}, after {after}"


# -- expected outcomes ----------------------------------------------------------------------------

RIGHT = "right"
"""The result must equal the analytic derivative."""
RIGHT_OR_ERROR = "right or DiffifaceError"
"""The contract allows either the right result or a DiffifaceError (only where the issue says so)."""
RIGHT_OR_MUTATION = "right or MutationError"
"""f writes into an input: the engine may give f a private copy (right), or refuse (MutationError)."""

Expect = Any  # RIGHT, RIGHT_OR_ERROR, RIGHT_OR_MUTATION, or a DiffifaceError subclass


def check_case(
    call: Callable[[], Any],
    expect: Expect,
    expected: Any = None,
    *,
    inputs: tuple[Any, ...] = (),
    rtol: float = 1e-6,
    atol: float = 1e-8,
    dtype: Any = None,
) -> Any:
    """Run ``call`` once and check it against ``expect``; the ``inputs`` must be unchanged after it.

    ``expected`` is the analytic result (a numpy tree) or a callable that checks the result.
    Returns the result, or the exception raised.
    """
    snapshot = Snapshot(*inputs)
    try:
        result = call()
    except di.DiffifaceError as error:
        snapshot.assert_unchanged()
        allowed: tuple[type[BaseException], ...]
        if expect == RIGHT:
            raise AssertionError(f"expected the right derivative, got {type(error).__name__}: {error}") from error
        if expect == RIGHT_OR_ERROR:
            allowed = (di.DiffifaceError,)
        elif expect == RIGHT_OR_MUTATION:
            allowed = (di.MutationError,)
        else:
            allowed = (expect,)
        if not isinstance(error, allowed):
            raise AssertionError(
                f"expected {' or '.join(a.__name__ for a in allowed)}, got {type(error).__name__}: {error}"
            ) from error
        assert_says_what(error)
        return error
    except Exception as error:
        snapshot.assert_unchanged()
        raise AssertionError(
            f"a raw {type(error).__module__}.{type(error).__name__} escaped (expected {describe(expect)}): {error}"
        ) from error
    snapshot.assert_unchanged()
    if isinstance(expect, type):
        raise AssertionError(f"expected {expect.__name__}, got a result: {result!r}")
    if callable(expected):
        expected(result)
    else:
        assert_tree_close(result, expected, rtol=rtol, atol=atol, dtype=dtype)
    return result


def assert_says_what(error: BaseException, *words: str) -> None:
    """A DiffifaceError's message is not empty, and names one of ``words`` when given."""
    message = str(error)
    assert message.strip(), f"{type(error).__name__} with an empty message"
    if words:
        assert any(w in message.lower() for w in words), f"the message names none of {words}: {message}"


def describe(expect: Expect) -> str:
    return expect.__name__ if isinstance(expect, type) else str(expect)


def assert_tree_close(actual: Any, expected: Any, rtol: float, atol: float, dtype: Any = None) -> None:
    """Same structure and shapes, values close (NaN where NaN is expected), dtype if given. A
    leaf of a narrower float than float64 is held to at least its dtype's default tolerances
    (diffiface.test's): a float32 result differs from the analytic one by more than 1e-6 on some
    CPUs' kernels."""
    a_leaves, a_spec = optree.tree_flatten(actual)
    e_leaves, e_spec = optree.tree_flatten(expected)
    assert a_spec == e_spec, f"structure: got {a_spec}, expected {e_spec}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        got = to_numpy(a)
        assert got.shape == np.shape(e), f"leaf {i}: shape {got.shape}, expected {np.shape(e)}"
        if dtype is not None:
            assert got.dtype == np.dtype(dtype), f"leaf {i}: dtype {got.dtype}, expected {np.dtype(dtype)}"
        leaf_rtol, leaf_atol = rtol, atol
        if got.dtype.kind == "f" and got.dtype.itemsize < 8:
            floor_rtol, floor_atol = default_tolerances(str(got.dtype))
            leaf_rtol, leaf_atol = max(rtol, floor_rtol), max(atol, floor_atol)
        np.testing.assert_allclose(
            got.astype(np.float64),
            np.asarray(e, dtype=np.float64),
            rtol=leaf_rtol,
            atol=leaf_atol,
            err_msg=f"leaf {i}",
        )


def tolerance(*backend_ids: str, second_order: bool = False) -> dict[str, float]:
    """1e-6 relative for AD; 1e-3 for anything involving finite differences (float64 inputs)."""
    finite = any(b.startswith(("fd", "scipy", "finite")) for b in backend_ids)
    if finite:
        return {"rtol": 1e-3, "atol": 1e-3 if second_order else 1e-5}
    return {"rtol": 1e-6, "atol": 1e-9}


def size(tree: Any) -> int:
    return sum(math.prod(np.shape(leaf)) for leaf in optree.tree_leaves(tree))
