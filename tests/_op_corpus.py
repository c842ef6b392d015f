"""The op corpus of check_gradients: ops nobody here wrote, each with its right gradient and a
corrupted twin.

- torch: the OpInfo database that ships inside torch (``op_db``), with torch's own sample
  inputs: every op that supports autograd in the dtype, its first sample of 1 to 64 numbers,
  ``f(v) = sum(w * op(v, *args))`` with fixed random weights ``w``; sampled deterministically
  (every ``stride``-th op by name) when a budget asks for it.
- jax: a list of jax.numpy, lax, jax.nn and jax.scipy.special ops in their valid domains.

The twins: a ``torch.autograd.Function`` or ``jax.custom_vjp`` whose backward returns 1.01
times the gradient (even positions in the list), or the gradient with its largest entry moved
by 1% of the largest (odd positions; an absolute 0.01 where the gradient is zero).

``python tests/_op_corpus.py [stride] [torch,jax] [op,op...]`` prints the counts docs/testing.md
quotes (the third argument: those ops alone, each with the twin the whole corpus gives it).
"""

from __future__ import annotations

import math
import sys
import time
import types
import unittest
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import diffiface as di
from diffiface.test import check_gradients

#: ops whose values are random, or whose sample cannot be a function of one input
NOT_FUNCTIONS = ("dropout", "rand", "bernoulli", "multinomial", "normal", "uniform", "empty", "nn.functional.rrelu")


@dataclass
class Case:
    name: str
    framework: str
    dtype: str
    f: Callable[..., Any]
    x: Any
    twin: Callable[..., Any]
    twin_kind: str


@dataclass
class Outcome:
    checked: int = 0
    false_failures: list[str] = field(default_factory=list)
    false_passes: list[str] = field(default_factory=list)
    not_differentiable: list[str] = field(default_factory=list)
    twin_skipped: list[str] = field(default_factory=list)
    evaluations: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0


def torch_op_db() -> list[Any]:
    """torch's OpInfo list; its module imports ``expecttest`` (a test dependency of torch, not
    installed with it) for a base class alone: a stand-in serves."""
    if "expecttest" not in sys.modules:
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        sys.modules["expecttest"] = stand_in
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


def torch_cases(
    dtype: str = "float64", stride: int = 1, offset: int = 0, names: frozenset[str] | None = None
) -> Iterator[Case]:
    """The torch cases; ``names`` keeps those ops alone (each with the twin the whole corpus gives it)."""
    import torch

    torch_dtype = getattr(torch, dtype)
    ops = sorted(
        (op for op in torch_op_db() if op.supports_autograd and torch_dtype in op.supported_dtypes("cpu")),
        key=lambda op: (op.name, op.variant_test_name),
    )
    ops = [
        op
        for op in ops
        if not any(word in op.name for word in NOT_FUNCTIONS) and not _gradcheck_skipped(op, torch_dtype)
    ]
    for position, op in enumerate(ops[offset::stride]):
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if names is not None and name not in names:
            continue
        sample = _small_sample(op, torch_dtype)
        if sample is None:
            continue
        f = _torch_function(op, sample, torch_dtype)
        if f is None:
            continue
        x = sample.input.detach().clone()
        kind = "scaled" if position % 2 == 0 else "moved"
        yield Case(name, "torch", dtype, f, x, _torch_twin(f, kind), kind)


def _gradcheck_skipped(op: Any, dtype: Any) -> bool:
    """Whether torch's own test suite skips or expects to fail gradcheck for the op on cpu."""
    for rule in (*op.skips, *op.decorators):
        if getattr(rule, "test_name", None) not in ("test_fn_grad", "test_fn_fwgrad_bwgrad"):
            continue
        if getattr(rule, "device_type", None) not in (None, "cpu"):
            continue
        dtypes = getattr(rule, "dtypes", None)
        if dtypes is not None and dtype not in dtypes:
            continue
        if all(bool(a) for a in (rule.active_if if isinstance(rule.active_if, (list, tuple)) else [rule.active_if])):
            return True
    return False


def _small_sample(op: Any, dtype: Any) -> Any:
    import torch

    torch.manual_seed(0)
    try:
        for sample in op.sample_inputs("cpu", dtype, requires_grad=False):
            x = sample.input
            if isinstance(x, torch.Tensor) and x.dtype == dtype and x.layout == torch.strided and 1 <= x.numel() <= 64:
                return sample
    except Exception:
        return None
    return None


def _torch_function(op: Any, sample: Any, dtype: Any) -> Callable[..., Any] | None:
    import torch

    def output(v: Any) -> Any:
        # torch's own gradcheck calls the op through this wrapper (a symmetric input for
        # cholesky and eigh, a triangular one for cholesky_inverse...)
        out = op.gradcheck_wrapper(op, v, *sample.args, **sample.kwargs)
        if isinstance(out, (tuple, list)):
            out = next((o for o in out if isinstance(o, torch.Tensor) and o.is_floating_point()), None)
        return out

    try:
        with torch.no_grad():
            first, second = output(sample.input.clone()), output(sample.input.clone())
    except Exception:
        return None
    if not isinstance(first, torch.Tensor) or first.dtype != dtype or first.layout != torch.strided:
        return None
    if first.numel() == 0 or not torch.isfinite(first).all() or not torch.equal(first, second):
        return None
    weights = torch.randn(first.shape, dtype=first.dtype, generator=torch.Generator().manual_seed(1))
    probe = sample.input.detach().clone().requires_grad_(True)
    try:
        out = output(probe)
        if not out.requires_grad:
            return None
    except Exception:
        return None

    def f(v: Any) -> Any:
        return (weights * output(v)).sum()

    return f


def _corrupt(g: np.ndarray, kind: str) -> np.ndarray:
    g = np.array(g, dtype=np.float64)
    if kind == "scaled" and np.any(g):
        return np.asarray(1.01 * g)
    moved = g.copy().reshape(-1)
    i = int(np.argmax(np.abs(moved)))
    moved[i] += 0.01 * (float(np.abs(moved[i])) or 1.0)
    return moved.reshape(g.shape)


def _torch_twin(f: Callable[..., Any], kind: str) -> Callable[..., Any]:
    import torch

    class Twin(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, v: Any) -> Any:
            with torch.enable_grad():
                w = v.detach().requires_grad_(True)
                y = f(w)
                (g,) = torch.autograd.grad(y, w, allow_unused=True)
            g = torch.zeros_like(v) if g is None else g
            ctx.save_for_backward(torch.from_numpy(_corrupt(g.numpy(), kind)).to(v.dtype))
            return y.detach()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (g,) = ctx.saved_tensors
            return grad * g

    return lambda v: Twin.apply(v)


# -- jax ----------------------------------------------------------------------------------------------


def _jax_ops() -> list[tuple[str, Callable[[Any], Any], float, float]]:
    """``(name, op of a vector, low, high)``: the inputs are drawn in ``[low, high]``."""
    import jax
    import jax.numpy as jnp
    import jax.scipy.special as special
    from jax import lax

    def square(v: Any) -> Any:
        return v.reshape(3, 3)

    return [
        ("sin", jnp.sin, -3, 3),
        ("cos", jnp.cos, -3, 3),
        ("tan", jnp.tan, -1.4, 1.4),
        ("arcsin", jnp.arcsin, -0.95, 0.95),
        ("arccos", jnp.arccos, -0.95, 0.95),
        ("arctan", jnp.arctan, -3, 3),
        ("sinh", jnp.sinh, -3, 3),
        ("cosh", jnp.cosh, -3, 3),
        ("tanh", jnp.tanh, -3, 3),
        ("arcsinh", jnp.arcsinh, -3, 3),
        ("arccosh", jnp.arccosh, 1.05, 3),
        ("arctanh", jnp.arctanh, -0.95, 0.95),
        ("exp", jnp.exp, -3, 3),
        ("expm1", jnp.expm1, -3, 3),
        ("exp2", jnp.exp2, -3, 3),
        ("log", jnp.log, 0.05, 3),
        ("log1p", jnp.log1p, -0.9, 3),
        ("log2", jnp.log2, 0.05, 3),
        ("log10", jnp.log10, 0.05, 3),
        ("sqrt", jnp.sqrt, 0.05, 3),
        ("cbrt", jnp.cbrt, 0.1, 3),
        ("square", jnp.square, -3, 3),
        ("reciprocal", jnp.reciprocal, 0.3, 3),
        ("abs", jnp.abs, -3, 3),
        ("sinc", jnp.sinc, -3, 3),
        ("floor", jnp.floor, -3, 3),
        ("ceil", jnp.ceil, -3, 3),
        ("round", jnp.round, -3, 3),
        ("trunc", jnp.trunc, -3, 3),
        ("sign", jnp.sign, -3, 3),
        ("deg2rad", jnp.deg2rad, -3, 3),
        ("hypot", lambda v: jnp.hypot(v, v[::-1]), -3, 3),
        ("arctan2", lambda v: jnp.arctan2(v, v[::-1] + 5.0), -3, 3),
        ("logaddexp", lambda v: jnp.logaddexp(v, 2 * v[::-1]), -3, 3),
        ("power", lambda v: jnp.power(v, 2.5), 0.1, 3),
        ("maximum", lambda v: jnp.maximum(v, 0.5 * v[::-1]), -3, 3),
        ("cumsum", jnp.cumsum, -3, 3),
        ("cumprod", jnp.cumprod, 0.5, 1.5),
        ("prod", jnp.prod, 0.5, 1.5),
        ("mean", jnp.mean, -3, 3),
        ("std", jnp.std, -3, 3),
        ("var", jnp.var, -3, 3),
        ("max", jnp.max, -3, 3),
        ("min", jnp.min, -3, 3),
        ("sort", jnp.sort, -3, 3),
        ("median", jnp.median, -3, 3),
        ("quantile", lambda v: jnp.quantile(v, 0.3), -3, 3),
        ("percentile", lambda v: jnp.percentile(v, 80.0), -3, 3),
        ("norm", jnp.linalg.norm, -3, 3),
        ("det", lambda v: jnp.linalg.det(square(v) + 3 * jnp.eye(3, dtype=v.dtype)), -1, 1),
        ("inv", lambda v: jnp.linalg.inv(square(v) + 3 * jnp.eye(3, dtype=v.dtype)), -1, 1),
        ("slogdet", lambda v: jnp.linalg.slogdet(square(v) + 3 * jnp.eye(3, dtype=v.dtype))[1], -1, 1),
        ("eigh", lambda v: jnp.linalg.eigh(square(v) + square(v).T)[0], -1, 1),
        ("svd", lambda v: jnp.linalg.svd(square(v), compute_uv=False), -1, 1),
        ("solve", lambda v: jnp.linalg.solve(square(v) + 3 * jnp.eye(3, dtype=v.dtype), v[:3]), -1, 1),
        ("matmul", lambda v: square(v) @ square(v).T, -1, 1),
        ("einsum", lambda v: jnp.einsum("ij,jk->ik", square(v), square(v)), -1, 1),
        ("outer", lambda v: jnp.outer(v, v[::-1]), -1, 1),
        ("convolve", lambda v: jnp.convolve(v, v[:3]), -1, 1),
        ("softmax", jax.nn.softmax, -3, 3),
        ("log_softmax", jax.nn.log_softmax, -3, 3),
        ("logsumexp", jax.nn.logsumexp, -3, 3),
        ("relu", jax.nn.relu, -3, 3),
        ("gelu", jax.nn.gelu, -3, 3),
        ("silu", jax.nn.silu, -3, 3),
        ("sigmoid", jax.nn.sigmoid, -3, 3),
        ("softplus", jax.nn.softplus, -3, 3),
        ("elu", jax.nn.elu, -3, 3),
        ("celu", jax.nn.celu, -3, 3),
        ("selu", jax.nn.selu, -3, 3),
        ("leaky_relu", jax.nn.leaky_relu, -3, 3),
        ("standardize", jax.nn.standardize, -3, 3),
        ("erf", special.erf, -2, 2),
        ("erfc", special.erfc, -2, 2),
        ("erfinv", special.erfinv, -0.95, 0.95),
        ("ndtr", special.ndtr, -3, 3),
        ("ndtri", special.ndtri, 0.05, 0.95),
        ("log_ndtr", special.log_ndtr, -3, 3),
        ("logit", special.logit, 0.05, 0.95),
        ("expit", special.expit, -3, 3),
        ("gammaln", special.gammaln, 0.5, 5),
        ("digamma", special.digamma, 0.5, 5),
        ("entr", special.entr, 0.05, 3),
        ("xlogy", lambda v: special.xlogy(v, v[::-1] + 4.0), 0.1, 3),
        ("i0e", special.i0e, -3, 3),
        ("i1e", special.i1e, -3, 3),
        ("lax.erf_inv", lax.erf_inv, -0.95, 0.95),
        ("lax.logistic", lax.logistic, -3, 3),
        ("lax.rsqrt", lax.rsqrt, 0.2, 3),
        ("lax.integer_pow", lambda v: lax.integer_pow(v, 3), -2, 2),
        ("lax.cummax", lambda v: lax.cummax(v, axis=0), -3, 3),
        ("lax.reduce_max", lambda v: lax.reduce_max(v, axes=(0,)), -3, 3),
        ("lax.sort", lambda v: lax.sort(v), -3, 3),
        ("lax.clamp", lambda v: lax.clamp(-1.0, v, 1.0), -3, 3),
        ("lax.atan2", lambda v: lax.atan2(v, v[::-1] + 5.0), -3, 3),
    ]


def jax_cases(
    dtype: str = "float64", stride: int = 1, offset: int = 0, names: frozenset[str] | None = None
) -> Iterator[Case]:
    """The jax cases; ``names`` keeps those ops alone (each with the twin the whole corpus gives it)."""
    import jax

    rng = np.random.default_rng(0)
    for position, (name, op, low, high) in enumerate(_jax_ops()[offset::stride]):
        numbers = rng.uniform(low, high, size=9)
        kind = "scaled" if position % 2 == 0 else "moved"
        with jax.enable_x64(dtype == "float64"):
            x = jax.numpy.asarray(numbers, dtype=dtype)
            weights = jax.numpy.asarray(rng.standard_normal(np.shape(op(x))), dtype=dtype)
        if names is not None and name not in names:
            continue
        f = _jax_function(op, weights)
        yield Case(name, "jax", dtype, f, x, _jax_twin(f, kind), kind)


def _jax_function(op: Callable[[Any], Any], weights: Any) -> Callable[[Any], Any]:
    import jax.numpy as jnp

    def f(v: Any) -> Any:
        return jnp.sum(weights.astype(v.dtype) * op(v))

    return f


def _jax_twin(f: Callable[[Any], Any], kind: str) -> Callable[[Any], Any]:
    import jax

    @jax.custom_vjp
    def twin(v: Any) -> Any:
        return f(v)

    def forward(v: Any) -> Any:
        value, pullback = jax.vjp(f, v)
        (g,) = pullback(jax.numpy.ones_like(value))
        return value, g

    def backward(g: Any, ct: Any) -> Any:
        corrupted = jax.pure_callback(
            lambda a: _corrupt(np.asarray(a), kind).astype(np.asarray(a).dtype),
            jax.ShapeDtypeStruct(g.shape, g.dtype),
            g,
        )
        return (ct * corrupted,)

    twin.defvjp(forward, backward)
    return twin


# -- running ------------------------------------------------------------------------------------------


def run(cases: Iterator[Case]) -> Outcome:
    outcome = Outcome()
    start = time.perf_counter()
    for case in cases:
        backends = [di.AutoJAX(jit=False)] if case.framework == "jax" else [di.AutoTorch()]
        outcome.checked += 1
        calls = [0]

        def counted(v: Any, f: Callable[..., Any] = case.f, calls: list[int] = calls) -> Any:
            calls[0] += 1
            return f(v)

        try:
            report = check_gradients(counted, case.x, backends=backends)
            if any(row.status == "skipped" and "not differentiable" in row.message for row in report.rows):
                outcome.not_differentiable.append(case.name)
        except Exception as exc:
            outcome.false_failures.append(f"{case.framework} {case.dtype} {case.name}: {str(exc)[:400]}")
            continue
        outcome.evaluations.append((math.prod(tuple(case.x.shape)), calls[0]))
        if outcome.not_differentiable and outcome.not_differentiable[-1] == case.name:
            outcome.twin_skipped.append(case.name)
            continue
        try:
            check_gradients(case.twin, case.x, backends=backends)
        except AssertionError:
            continue
        except Exception as exc:
            outcome.false_passes.append(f"{case.framework} {case.dtype} {case.name}: the twin raised {exc!r:.200}")
            continue
        outcome.false_passes.append(f"{case.framework} {case.dtype} {case.name} ({case.twin_kind})")
    outcome.seconds = time.perf_counter() - start
    return outcome


def _print(title: str, outcome: Outcome) -> None:
    worst = max((calls - 4 * n for n, calls in outcome.evaluations), default=0)
    print(
        f"{title}: {outcome.checked} ops, {len(outcome.false_failures)} false failures, "
        f"{len(outcome.false_passes)} twins passed, {len(outcome.not_differentiable)} not differentiable at x "
        f"(skipped), evaluations at most 4n + {worst}, {outcome.seconds:.1f} s"
    )
    for line in outcome.false_failures + outcome.false_passes:
        print("   ", line)
    if outcome.not_differentiable:
        print("    not differentiable:", ", ".join(outcome.not_differentiable))


if __name__ == "__main__":
    stride = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    which = sys.argv[2] if len(sys.argv) > 2 else "torch,jax"
    names = frozenset(sys.argv[3].split(",")) if len(sys.argv) > 3 else None
    di.AutoTorch()  # (nothing to do: keeps the import used for readers running this by hand)
    for framework in which.split(","):
        for dtype in ("float64", "float32"):
            cases = (
                torch_cases(dtype, stride, names=names)
                if framework == "torch"
                else jax_cases(dtype, stride, names=names)
            )
            _print(f"{framework} {dtype}", run(cases))
