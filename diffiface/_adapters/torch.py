"""torch, in two modes that take different code paths and so can check each other.

- ``mode="autograd"``: reverse mode by ``torch.autograd.grad`` on detached copies of the
  inputs (no ``.grad`` is ever written, no ``requires_grad`` flag of the caller's tensors
  changes), forward mode by ``torch.autograd.forward_ad`` dual tensors, second order by
  double backward. A jvp is forward mode, or reverse over reverse where ``AutoTorch(jvp=...)``
  asks for it (see ``_Pushforward``).
- ``mode="func"``: ``torch.func.vjp``, ``jvp``, ``grad_and_value``, ``jacrev``/``jacfwd``;
  second order forward-over-reverse.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import itertools
import operator
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import torch
import torch.autograd.forward_ad as forward_ad
from torch import func
from torch.overrides import TorchFunctionMode

from .. import _arrays
from .. import tree as _tree
from .._errors import (
    ArrayTypeError,
    FrameworkMismatchError,
    InvalidInputError,
    InvalidOutputError,
    MutationError,
    UnsupportedOperationError,
)
from . import _base
from ._base import Blocks, Fn, Leaves, raised_inside

# torch scripts its forward-mode decompositions on the first make_dual of the process, warning
# that torch.jit.script is deprecated: torch's own business, which must not reach f's caller (an
# error under -W error). diffiface's first forward-mode call makes one throwaway dual first, with
# that one warning silenced; f never runs inside the silence. The throwaway dual is multiplied
# by a plain tensor: torch's first such product imports its Python meta kernels (slow, once),
# which would otherwise fall inside the first call that a jvp's choice of way times.
_FORWARD_WARMED = [False]


def _warm_forward() -> None:
    """The throwaway dual of the process's first forward-mode call (see above)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*")  # Deprecation- or FutureWarning
        try:
            with forward_ad.dual_level():
                forward_ad.make_dual(torch.zeros(()), torch.zeros(())) * torch.zeros(())
        except RuntimeError:  # a dual level of the caller's is open: torch has loaded them
            pass
    _FORWARD_WARMED[0] = True


class _Namespace:
    """The few array functions ``_base`` needs, with torch's names."""

    stack = staticmethod(torch.stack)
    reshape = staticmethod(torch.reshape)
    zeros_like = staticmethod(torch.zeros_like)
    ones_like = staticmethod(torch.ones_like)
    sum = staticmethod(torch.sum)

    @staticmethod
    def zeros(shape: tuple[int, ...], dtype: Any = None) -> Any:
        return torch.zeros(shape, dtype=dtype)


# torch's forward-mode AD has one dual level for the whole process, not one per thread: two
# threads in forward mode at once break each other ("no level exists"). Forward-mode work is
# serialised; reverse mode runs in parallel.
_FORWARD_LOCK = threading.RLock()


_DUALS = [0]
"""How many of diffiface's forward-mode (dual level) calls are open, in the thread that holds
``_FORWARD_LOCK``: while one is, inputs may be dual tensors whose tangents must be kept."""


class _Calls(threading.local):
    def __init__(self) -> None:
        self.keep: list[bool] = []  # per open call, innermost last: does it keep its graph?


_CALLS = _Calls()


def inside_a_call() -> bool:
    """Whether this thread is inside a diffiface torch call (f is being differentiated)."""
    return bool(_CALLS.keep)


def _keeping() -> bool:
    """Whether the innermost open call keeps its graph (its inputs carried an outer one)."""
    stack = _CALLS.keep
    return stack[-1] if stack else False


class Adapter(_base.Adapter):
    xp = _Namespace

    def __init__(self, backend: Any, info: Any) -> None:
        super().__init__(backend, info)
        self.functional = backend.mode == "func"
        self.create_graph: bool = getattr(backend, "create_graph", False)

    def to_native(self, leaf: Any) -> Any:
        kind = _arrays.kind(leaf)
        if kind == "torch":
            if leaf.is_meta:
                raise InvalidInputError(
                    "x (or a tangent) is a meta tensor, which has a shape but no values to differentiate "
                    "at. Create it on a real device (device='cpu' or 'cuda')."
                )
            return leaf
        if kind == "python":
            return torch.tensor(leaf, dtype=torch.complex128 if isinstance(leaf, complex) else torch.float64)
        if kind == "numpy":
            # a C-ordered copy in native byte order: x stays the caller's, and torch takes no
            # negative strides nor a big-endian array
            return torch.from_numpy(np.array(leaf, dtype=_arrays.native_dtype(leaf.dtype), order="C"))
        raise ArrayTypeError(
            f"The torch backend was given a {type(leaf).__module__}.{type(leaf).__name__} where it takes "
            "torch tensors, numpy arrays or floats (a tangent of another framework?). Convert it to a "
            "torch tensor of x's dtype."
        )

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        if isinstance(leaf, np.ndarray):
            device = like.device if isinstance(like, torch.Tensor) else None
            # a copy (np.array, C-ordered: torch takes no negative strides): f may not reach the
            # caller's array through it; from_numpy then shares the copy without a second one
            tensor = torch.from_numpy(np.array(leaf, dtype=_arrays.native_dtype(leaf.dtype), order="C"))
            return tensor.to(device) if device is not None else tensor, True
        if isinstance(leaf, torch.Tensor) and leaf.is_meta:
            raise InvalidInputError(
                "A context holds a meta tensor, which has a shape but no values. Create it on a real device."
            )
        return leaf, isinstance(leaf, torch.Tensor)

    def untracked(self, leaf: Any, xs: Leaves) -> bool:
        if not isinstance(leaf, torch.Tensor):
            return False
        if not torch.is_grad_enabled():
            if not any(map(_requires_grad, xs)):
                return False
            # x requires grad only where the engine traces with grad mode on: f switched it off
            # (torch.set_grad_enabled(False)) and left it off. Back on for the engine's own work
            # (a double backward); the guard restores the caller's mode on the way out.
            torch.set_grad_enabled(True)
            return not leaf.requires_grad
        if leaf.requires_grad and not _DUALS[0]:  # the common case: tracked in reverse mode
            return False
        if any(map(_requires_grad, xs)):  # reverse mode, torch.autograd's or torch.func's
            return not leaf.requires_grad
        if _DUALS[0] and _dual_parts(leaf)[1] is None:  # (a tangent: tracked, the common case)
            return any(_dual_parts(x)[1] is not None for x in xs)  # forward mode of ours
        return False  # (torch.func's forward mode: every tensor made inside is wrapped alike)

    def plain(self, leaf: Any) -> Any:
        if _wrapped(leaf):  # a torch.func tensor: its value is reached through the transform
            return leaf
        return _dual_parts(leaf)[0].detach() if isinstance(leaf, torch.Tensor) else leaf

    def output_leaf(self, leaf: Any, like: Any) -> Any:
        if type(leaf) is torch.Tensor or isinstance(leaf, torch.Tensor):
            return leaf
        # a Python number or numpy array out of a torch f has left torch's graph (float(...),
        # .item(), .numpy()): its derivative would read as zero
        raise InvalidOutputError(
            f"f returned a {type(leaf).__name__} where the torch backend needs a torch tensor: a number "
            "made with float(...), .item() or .numpy() is cut from torch's graph, and its derivative would "
            "read as zero. Keep the output a tensor (return y, not y.item()); for a constant, return "
            "torch.tensor(c)."
        )

    def explain_failure(self, exc: BaseException) -> str | None:
        text = str(exc)
        if "numpy()" in text and "requires grad" in text:
            return (
                "f turned a tensor that requires grad into a numpy array (a numpy function or "
                ".numpy() on its input). Write f with torch operations, or differentiate a numpy f "
                "with AutoFiniteDifferences()."
            )
        if "mixed torch.Tensor and DTensor" in text:
            return (
                "f mixes a DTensor (x is sharded) with a plain torch tensor (a di.Constant or a tensor f "
                "makes). Make every tensor f combines with x a DTensor on x's device mesh, e.g. "
                "torch.distributed.tensor.distribute_tensor(data, mesh, [Replicate()])."
            )
        operator = _numpy_operator_on_tensor(exc)
        if operator is not None:
            return (
                f"f applies {operator} to a numpy array and a torch tensor, which neither numpy nor torch "
                "computes: a numpy array f holds (a global, a closed-over matrix A in A @ x) meets the tensor "
                "diffiface gives f for x. Make that array a torch tensor (torch.as_tensor(A)) or pass it to f "
                "as a di.Constant (its numpy arrays reach f as torch tensors); or differentiate a numpy f with "
                "AutoFiniteDifferences()."
            )
        if isinstance(exc, TypeError) and raised_inside(exc, "jax"):
            return "f calls jax on torch tensors; differentiate a jax function with AutoJAX()."
        if self.functional and isinstance(exc, RuntimeError) and "override the setup_context" in text:
            # torch.func's refusal of a classic torch.autograd.Function: the engine cannot run f
            raise UnsupportedOperationError(
                "f uses a torch.autograd.Function without a setup_context staticmethod, which torch.func "
                "cannot transform. Use AutoTorch(mode='autograd'), or give the Function setup_context "
                "(forward without ctx, and setup_context(ctx, inputs, output))."
            ) from exc
        if self.functional and isinstance(exc, RuntimeError) and "mutate a captured Tensor" in text:
            # torch.func's refusal, raised before the write: nothing of the caller's changed
            raise _CapturedWrite(
                "f writes in place into a tensor it closes over (an array of a di.Constant or di.Cache, "
                "or a global), which torch.func refuses inside its transforms; nothing was written. "
                "A Constant must only be read: compute out of place (y = c * 2, not c.mul_(2)). For an "
                "f that writes into scratch space (a di.Cache), use AutoTorch(mode='autograd')."
            ) from exc
        return None

    # -- the guard around every call: state, nesting, writes into the inputs --------------------

    def compile(
        self, program: Callable[..., Any], static: bool = True, arrays: bool = False, layouts: Any = None
    ) -> Callable[..., Any]:
        guarded = _guard(program, self.functional, self.create_graph)
        fused = getattr(program, "fused", None)
        if fused is None or not fused.dynamic or self.create_graph:
            return guarded
        fuse = _FUSED.get((fused.compute, self.functional))
        if fuse is None or fused.adapter is not self:  # (no fused call kept: the guard's steps)
            return guarded
        return fuse(guarded, fused, program, functional=self.functional)

    # -- primitives ---------------------------------------------------------------------------

    def pullback_function(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
        if self.functional:
            g, has_aux, rebuild = _for_func(fn, xs)
            g, bare = _bare_output(g, has_aux)
            primal = xs[0] if len(xs) == 1 else xs
            if has_aux:
                out, pullback, aux = func.vjp(g, primal, has_aux=True)  # type: ignore[misc]
            else:
                (out, pullback), aux = func.vjp(g, primal), None  # type: ignore[misc]
            if bare:  # one output tensor: its cotangent is the tuple's one leaf
                out, inner = (out,), pullback
                pullback = lambda touts: inner(touts[0])  # noqa: E731
            if len(xs) == 1:
                return out, rebuild(aux), lambda touts: _placed((pullback(_cotangents(out, touts))[0],), xs)
            return out, rebuild(aux), lambda touts: _placed(pullback(_cotangents(out, touts))[0], xs)
        stack = _CALLS.keep
        keep = stack[-1] if stack else False  # (_keeping(), inlined: this is the hot path)
        if torch.is_grad_enabled() and not keep:  # (entering enable_grad costs more than asking)
            inputs = _requiring_grad(xs)
            out, aux = fn(inputs)  # (a grad mode f leaves switched off is restored by the guard)
        else:
            with torch.enable_grad():
                inputs = _requiring_grad(xs)
                out, aux = fn(inputs)
        outs = out if type(out) is tuple else (out,)
        plain = True  # (no DTensor among the outputs: the cotangents need no look)
        for y in outs:  # (loops, not generators: this runs on every call)
            if type(y) is not torch.Tensor:
                plain = False

        def vjp(touts: Any) -> Leaves:
            if not plain:
                touts = _cotangents(out, touts)
            return _backward(outs, touts if type(touts) is tuple else (touts,), inputs, keep)

        return _detached(out, keep), (None if aux is None else _detached(aux, keep)), vjp

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        if _any_dtensor(xs) or _any_dtensor(txs):
            raise _forward_on_dtensors(self.functional)
        if not _FORWARD_WARMED[0]:
            _warm_forward()
        with _FORWARD_LOCK:
            return self._value_and_pushforward(fn, xs, txs)

    def _value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        if self.functional:
            g, has_aux, rebuild = _for_func(fn, xs)
            g, bare = _bare_output(g, has_aux)
            primals, tangents = (xs, txs) if len(xs) == 1 else ((xs,), (txs,))
            if has_aux:
                out, tout, aux = func.jvp(g, primals, tangents, has_aux=True)  # type: ignore[misc]
            else:
                (out, tout), aux = func.jvp(g, primals, tangents), None  # type: ignore[misc]
            if bare:
                out, tout = (out,), (tout,)
            # torch.func.jvp promotes the tangent of a 0-d float32 output times a Python
            # float to float64; a tangent has its primal's dtype.
            if type(tout) is tuple and len(tout) == 1:  # one output tensor
                if tout[0].dtype != out[0].dtype:
                    tout = (tout[0].to(out[0].dtype),)
            else:
                tout = _tree.map(lambda t, y: t.to(y.dtype) if t.dtype != y.dtype else t, tout, out)
            return out, rebuild(aux), tout
        if _DUALS[0]:  # inside diffiface's own forward-mode call: torch has one dual level
            raise _nested_forward()
        keep = _keeping()
        if keep and any(x.requires_grad and _wrapped(x) for x in xs):
            raise _autograd_in_func()
        level = _open_dual_level()
        try:
            # x itself where it carries an outer graph (reverse over forward), else detached
            out, aux = fn(_made_duals(xs if keep else tuple(map(torch.Tensor.detach, xs)), txs, level))
            if type(out) is tuple:  # (the closed function's output leaves: no tree to walk)
                primal, tangent = _unpacked(out, level)
            else:
                primal, tangent = _tree.map(_primal, out), _tree.map(_tangent, out)
            aux = None if aux is None else _tree.map(_primal, aux)
        finally:
            _close_dual_level(level)
        return primal, aux, tangent

    def value_and_pushforwards(self, fn: Fn, xs: Leaves, batch: Any) -> tuple[Any, Any, list[Any]]:
        if not self.functional or len(batch) < 2 or _any_dtensor(xs):
            return super().value_and_pushforwards(fn, xs, batch)
        # torch.func.vmap runs the whole batch as one program, f evaluated once: the value does
        # not depend on the tangent, so it comes out unbatched (out_dims None), and the aux,
        # which may hold other leaves than tensors, is taken from the one evaluation
        stacked = tuple(torch.stack([txs[j] for txs in batch]) for j in range(len(xs)))
        found: list[Any] = []

        def pushed(txs: Leaves) -> tuple[Any, Any]:
            out, aux, tout = self._value_and_pushforward(fn, xs, txs)
            found.append(aux)
            return out, tout

        if not _FORWARD_WARMED[0]:
            _warm_forward()
        with _FORWARD_LOCK:
            out, touts = func.vmap(pushed, out_dims=(None, 0))(stacked)  # type: ignore[arg-type]  # (a prefix tree)
        return out, found[-1], [optree.tree_map(lambda t, k=k: t[k], touts) for k in range(len(batch))]

    def pullbacks(self, vjp: Callable[[Any], Leaves], xs: Leaves, batch: Any) -> list[Leaves]:
        if not self.functional or len(batch) < 2 or _any_dtensor(xs):
            return super().pullbacks(vjp, xs, batch)
        stacked = optree.tree_map(lambda *ts: torch.stack(ts), batch[0], *batch[1:])
        grads = func.vmap(vjp)(stacked)  # one program for the whole batch
        return [tuple(g[k] for g in grads) for k in range(len(batch))]

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        if self.functional:
            g, has_aux, rebuild = _for_func(fn, xs)
            if has_aux:
                grads, (value, aux) = func.grad_and_value(g, has_aux=True)(xs[0] if len(xs) == 1 else xs)
            else:
                (grads, value), aux = func.grad_and_value(g)(xs[0] if len(xs) == 1 else xs), None
            if len(xs) == 1:
                one = (grads,) if type(grads) is torch.Tensor else _placed((grads,), xs)
                return value, rebuild(aux), _materialised(one)
            return value, rebuild(aux), _materialised(_placed(grads, xs))
        if not torch.is_grad_enabled():  # entering enable_grad costs more than asking
            with torch.enable_grad():
                return self.value_and_gradient(fn, xs)
        stack = _CALLS.keep
        keep = stack[-1] if stack else False  # (_keeping(), inlined: this is the hot path)
        if len(xs) == 1 and not xs[0].requires_grad and not _DUALS[0]:  # the common case
            try:
                inputs = (xs[0].detach().requires_grad_(True),)
            except RuntimeError as exc:  # a tensor of a torch.func transform (jvp, vmap)
                raise _autograd_in_func() from exc
        else:
            inputs = _requiring_grad(xs)
        value, aux = fn(inputs)
        if not value.requires_grad:
            return value, aux, _grad([], inputs)
        grads = torch.autograd.grad((value,), inputs, retain_graph=keep, create_graph=keep, allow_unused=True)
        grads = _whole(grads, inputs)
        return value, aux, grads  # results are detached as they are converted, if returned

    def value_and_jacobian(self, fn: Fn, xs: Leaves, mode: str | None = None) -> tuple[Any, Any, Blocks]:
        if _any_dtensor(xs):
            raise _dense_of_dtensors("A Jacobian")
        if not self.functional:
            return self._vectorised_jacobian(fn, xs, mode)
        if any(x.numel() == 0 for x in xs):  # torch.func.jacfwd fails on empty inputs
            return super().value_and_jacobian(fn, xs, mode)
        return self._jacobian_by_transform(fn, xs, mode)

    def _vectorised_jacobian(self, fn: Fn, xs: Leaves, mode: str | None) -> tuple[Any, Any, Blocks]:
        """Autograd mode's Jacobian in reverse mode: ``torch.func.jacrev``'s one vmapped program
        (of torch's vectorised ways the quickest: ``torch.autograd.functional.jacobian`` with
        ``vectorize=True`` batches only the backward pass, and took many times as long), where
        the rows one by one took a backward pass each. Where f does not allow it (``.item()``
        on a tensor, an operation without a batching rule, whose slow fallback torch warns
        about, a torch.autograd.Function without ``setup_context``), the rows one by one, f
        evaluated again; also the rows inside an outer call (the Jacobian keeps a graph) and for
        empty leaves, and columns by forward mode where ``mode`` is ``"forward"``."""
        if mode == "forward" or _keeping() or _DUALS[0] or any(x.numel() == 0 for x in xs):
            return super().value_and_jacobian(fn, xs, mode)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # (torch's slow fallback for an operation without a batching rule)
                return self._jacobian_by_transform(fn, xs, "reverse")
        except (RuntimeError, Warning):  # (f's own errors come again from the rows)
            return super().value_and_jacobian(fn, xs, mode)

    def _jacobian_by_transform(self, fn: Fn, xs: Leaves, mode: str | None) -> tuple[Any, Any, Blocks]:
        """``torch.func.jacrev`` (``jacfwd`` where ``mode`` is ``"forward"``) of ``fn``."""
        transform = func.jacfwd if mode == "forward" else func.jacrev
        tensor_fn, rebuild = _tensor_aux(fn)

        def with_value(xs_: Leaves) -> tuple[Any, Any]:
            out, aux = tensor_fn(xs_)
            one = type(out) is tuple and len(out) == 1  # one output tensor, differentiated bare
            return out[0] if one else out, (out, aux)

        if not _FORWARD_WARMED[0]:
            _warm_forward()
        with _FORWARD_LOCK if mode == "forward" else contextlib.nullcontext():
            if len(xs) == 1:  # one tensor, not a tuple: a block per output, no tuple of one per input
                per_output, (out, aux) = transform(_on_one(with_value), has_aux=True)(xs[0])
                blocks: Blocks
                if not isinstance(out, tuple):
                    blocks = (per_output,)
                elif len(out) == 1:
                    blocks = ((per_output,),)
                else:
                    blocks = tuple((block,) for block in per_output)
            else:
                blocks, (out, aux) = transform(with_value, has_aux=True)(xs)
                if isinstance(out, tuple) and len(out) == 1:
                    blocks = (blocks,)
        return out, rebuild(aux), blocks

    # -- second order by double backward (autograd mode) ---------------------------------------

    def gradient_and_hvp(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Leaves, Leaves]:
        if self.functional:
            return super().gradient_and_hvp(fn, xs, txs)
        keep = _keeping()
        with torch.enable_grad():
            inputs = _requiring_grad(xs)
            value, aux = fn(inputs)
            grads = _grad(_if_graph(value), inputs, create_graph=True)
            # the gradient's pullback along txs (torch.autograd.grad's grad_outputs), not the
            # gradient of <grad, txs>: no extra products and sums in the graph
            hvps = _backward(grads, txs, inputs, keep)
        grads = _placed(grads, inputs)
        return _detached(value, keep), _detached(aux, keep), _detached(grads, keep), hvps

    def gradient_and_hvps(self, fn: Fn, xs: Leaves, batch: Any) -> tuple[Any, Any, Leaves, list[Leaves]]:
        """torch.func: one vmapped program (``_base``); autograd mode: f and its gradient's graph
        once, then the gradient's pullback along each tangent through that graph."""
        if self.functional:
            return super().gradient_and_hvps(fn, xs, batch)
        keep = _keeping()
        with torch.enable_grad():
            inputs = _requiring_grad(xs)
            value, aux = fn(inputs)
            grads = _grad(_if_graph(value), inputs, create_graph=True)
            wanted = [k for k, g in enumerate(grads) if g.requires_grad]
            outputs = [grads[k] for k in wanted]
            last = len(batch) - 1
            hvps = [
                _placed(_grad(outputs, inputs, [txs[k] for k in wanted], create_graph=keep, retain=i < last), inputs)
                for i, txs in enumerate(batch)
            ]
        return _detached(value, keep), _detached(aux, keep), _detached(_placed(grads, inputs), keep), hvps

    def value_gradient_and_hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves, Blocks]:
        if _any_dtensor(xs):
            raise _dense_of_dtensors("A Hessian")
        if self.functional:
            return super().value_gradient_and_hessian(fn, xs)
        keep = _keeping()
        with torch.enable_grad():
            inputs = _requiring_grad(xs)
            value, aux = fn(inputs)
            grads = _grad(_if_graph(value), inputs, create_graph=True)
            blocks = []
            for g, x in zip(grads, xs, strict=True):
                rows = [_grad(_if_graph(entry), inputs, create_graph=keep) for entry in g.reshape(-1)]
                blocks.append(
                    tuple(
                        torch.stack([row[j] for row in rows]).reshape((*x.shape, *xj.shape))
                        if rows
                        else torch.zeros((*x.shape, *xj.shape), dtype=xj.dtype)
                        for j, xj in enumerate(xs)
                    )
                )
        return _detached(value, keep), _detached(aux, keep), _detached(grads, keep), tuple(blocks)

    def value_derivative_and_second_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
        if _any_dtensor(xs):
            raise _dense_of_dtensors("A second derivative")
        if self.functional:
            return super().value_derivative_and_second_derivative(fn, xs)
        keep = _keeping()
        with torch.enable_grad():
            inputs = _requiring_grad(xs)
            out, aux = fn(inputs)
            derivs, seconds = [], []
            for y in _leaves(out):
                firsts = [_grad(_if_graph(entry), inputs, create_graph=True)[0] for entry in y.reshape(-1)]
                lasts = [_grad(_if_graph(d), inputs, create_graph=keep)[0] for d in firsts]
                derivs.append(_detached(_stacked(firsts, y), keep))
                seconds.append(_stacked(lasts, y))
        return _detached(out, keep), _detached(aux, keep), tuple(derivs), tuple(seconds)


def _tensor_aux(fn: Fn) -> tuple[Fn, Callable[[Any], Any]]:
    """``fn`` with an aux of tensors only, as torch.func requires, and the way back: the other
    aux leaves (None, numbers, strings) wait beside the transform."""
    kept: list[Any] = []

    def tensor_fn(xs: Leaves) -> tuple[Any, Any]:
        out, aux = fn(xs)
        if aux is None:  # the common case: no aux
            kept.clear()
            return out, ()
        leaves, spec = _tree.flatten(aux)
        mask = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        kept[:] = [spec, mask, [leaf for leaf, m in zip(leaves, mask, strict=True) if not m]]
        return out, tuple(leaf for leaf, m in zip(leaves, mask, strict=True) if m)

    def rebuild(tensors: Any) -> Any:
        if not kept:
            return None
        spec, mask, others = kept
        tensor_iter, other_iter = iter(tensors), iter(others)
        return optree.tree_unflatten(spec, [next(tensor_iter) if m else next(other_iter) for m in mask])

    return tensor_fn, rebuild


def _on_one(fn: Fn) -> Callable[[Any], tuple[Any, Any]]:
    """``fn`` on one tensor instead of a tuple of one."""
    return lambda x: fn((x,))


def _for_func(fn: Fn, xs: Leaves) -> tuple[Callable[[Any], Any], bool, Callable[[Any], Any]]:
    """``fn`` as torch.func takes it, whether it has an aux, and the aux's way back.

    On one tensor where ``xs`` holds one (less pytree work for torch.func); without an aux
    where ``fn`` says it has none (``fn.has_aux``, set by diffiface's closed functions), else
    with an aux of tensors only, as torch.func requires."""
    if getattr(fn, "has_aux", True):
        target, rebuild = _tensor_aux(fn)
        return (_on_one(target) if len(xs) == 1 else target), True, rebuild

    def value_only(xs_: Leaves) -> Any:
        return fn(xs_)[0]

    return (_on_one(value_only) if len(xs) == 1 else value_only), False, _no_aux


def _no_aux(aux: Any) -> None:
    return None


def _bare_output(g: Callable[[Any], Any], has_aux: bool) -> tuple[Callable[[Any], Any], list[bool]]:
    """``g`` returning its one output tensor bare, not in a tuple of one (less pytree work for
    torch.func), and a list that holds True once it has (for the caller to wrap it back)."""
    bare: list[bool] = []

    def unwrapped(primal: Any) -> Any:
        result = g(primal)
        out = result[0] if has_aux else result
        if type(out) is not tuple or len(out) != 1:
            return result
        bare.append(True)
        return (out[0], result[1]) if has_aux else out[0]

    return unwrapped, bare


_OPERAND_TYPES = re.compile(
    r"(?:unsupported operand type\(s\) for (?P<binary>.+?):|'(?P<compare>.+?)' not supported between instances of)"
    r" '(?P<a>[\w.]+)' and '(?P<b>[\w.]+)'"
)
_NUMPY_CONCATENATION = "Concatenation operation is not implemented for NumPy arrays"
"""numpy's refusal of ``array + tensor`` (numpy defers to the tensor, which declines)."""


def _numpy_operator_on_tensor(exc: BaseException) -> str | None:
    """The operator (``@``, ``+``, ``<``...) of ``exc`` where the interpreter itself raised it at
    an operator of f's code, between a numpy array and a torch tensor; else None.

    Told by where it was raised: the innermost frame is executing an operator instruction
    (not a ``raise`` statement of f, not a library's Python code); only then is the message,
    the interpreter's own, read for the operand types."""
    if type(exc) is not TypeError:
        return None
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    instruction = next((i for i in dis.get_instructions(tb.tb_frame.f_code) if i.offset == tb.tb_lasti), None)
    if instruction is None or instruction.opname not in ("BINARY_OP", "COMPARE_OP"):
        return None
    text = str(exc)
    if text.startswith(_NUMPY_CONCATENATION):
        return "+"
    found = _OPERAND_TYPES.fullmatch(text)
    if found is None:
        return None
    types = {found["a"], found["b"]}
    numpy_side = any(name.startswith("numpy.") for name in types)
    tensor_side = bool(types & _tensor_class_names())
    if not (numpy_side and tensor_side):
        return None
    return found["binary"] or found["compare"]


def _tensor_class_names() -> set[str]:
    names: set[str] = set()
    todo: list[type] = [torch.Tensor]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _requiring_grad(xs: Leaves) -> Leaves:
    """Fresh leaves of the graph: the caller's tensors and their flags stay as they are.

    Where x carries an outer graph (a nested call), an alias of x in that graph, so that the
    outer differentiation sees through this one; where x is a dual tensor of an outer forward
    mode, an alias that keeps its tangent."""
    if len(xs) == 1 and not xs[0].requires_grad and not _DUALS[0]:  # the common case
        x = xs[0]
        try:
            return (x.detach().requires_grad_(True),)
        except RuntimeError as exc:  # a tensor of a torch.func transform (jvp, vmap)
            raise _autograd_in_func() from exc
    leaves = []
    for x in xs:
        if x.requires_grad and torch.is_grad_enabled():
            if _wrapped(x):
                raise _autograd_in_func()
            leaves.append(x.view_as(x))
            continue
        try:
            leaves.append((x.view_as(x) if _DUALS[0] else x.detach()).requires_grad_(True))
        except RuntimeError as exc:
            raise _autograd_in_func() from exc
    return tuple(leaves)


def _if_graph(value: Any) -> list[Any]:
    """``[value]`` if it depends on the inputs, else ``[]`` (its derivative is zero)."""
    return [value] if value.requires_grad else []


def _backward(outs: Leaves, touts: Leaves, inputs: Leaves, keep: bool = False) -> Leaves:
    """A vjp's backward pass: the outputs that require grad with their cotangents, gradients
    for ``inputs`` (zeros where one does not matter), laid out as ``inputs``; ``keep``: the
    gradients keep their graph (a nested call)."""
    ys, ts = [], []
    for y, t in zip(outs, touts, strict=True):  # (a loop, not a comprehension: on every call)
        if y.requires_grad:
            ys.append(y)
            ts.append(t)
    grads = _grad(ys, inputs, ts, create_graph=keep)
    for g in grads:
        if type(g) is not torch.Tensor:
            return _placed(grads, inputs)
    return grads


def _grad(
    outputs: list[Any],
    inputs: Leaves,
    grad_outputs: list[Any] | None = None,
    create_graph: bool = False,
    retain: bool = True,
) -> Leaves:
    """``torch.autograd.grad`` that gives zeros, never None, for inputs that do not matter.
    ``retain=False`` frees the graph: for the last backward pass through it."""
    if not outputs:
        return tuple(torch.zeros_like(x) for x in inputs)
    grads = torch.autograd.grad(
        outputs,
        inputs,
        grad_outputs=grad_outputs,
        retain_graph=retain or create_graph,
        create_graph=create_graph,
        allow_unused=True,
    )
    # zeros where an input did not matter (cheaper than materialize_grads=True)
    for g in grads:  # (a loop, not a generator: this runs on every call)
        if g is None:
            return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True))
    return grads  # type: ignore[no-any-return]


# -- DTensors (torch.distributed.tensor): sharded over processes, never gathered ----------------


def _dtensor_class() -> Any:
    """torch's DTensor class, or None while torch.distributed.tensor is not imported (then no
    tensor can be one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(leaf: Any) -> bool:
    """Whether ``leaf`` is a DTensor (a tensor sharded or replicated over a device mesh)."""
    if type(leaf) is torch.Tensor:
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(leaf, cls)


def _any_dtensor(leaves: Any) -> bool:
    for leaf in leaves:  # noqa: SIM110  # (a loop, not a generator: this runs on every call)
        if type(leaf) is not torch.Tensor and is_dtensor(leaf):
            return True
    return False


def _whole(grads: Leaves, inputs: Leaves) -> Leaves:
    """``torch.autograd.grad``'s gradients (``allow_unused=True``) as diffiface returns them:
    zeros where an input did not matter, laid out as the inputs (DTensors), ordinary tensors
    for torch's ZeroTensors."""
    for found in grads:  # (loops, not comprehensions: this runs on every call)
        if found is None:
            grads = tuple(torch.zeros_like(x) if d is None else d for d, x in zip(grads, inputs, strict=True))
            break
    for found in grads:
        if type(found) is not torch.Tensor:  # a DTensor
            grads = _placed(grads, inputs)
            break
    for found in grads:
        if found._is_zerotensor():
            return _materialised(grads)
    return grads


def _materialised(grads: Leaves) -> Leaves:
    """Gradients as ordinary tensors: torch answers an f whose derivative is zero by rule
    (``sgn``, ``sign``) with a ZeroTensor, which ``.numpy()`` and in-place updates refuse."""
    for g in grads:  # (a loop first: no generator where there is none, the common case)
        if g._is_zerotensor():
            return tuple(
                torch.zeros(g.shape, dtype=g.dtype, device=g.device) if g._is_zerotensor() else g for g in grads
            )
    return grads


def _placed(grads: Leaves, xs: Leaves) -> Leaves:
    """Derivatives laid out as their inputs: a DTensor's on x's device mesh with x's placements.

    torch's backward chooses its own placements (a sharded weight used in a matrix product
    gets a replicated gradient, an elementwise use a sharded one); redistributing to x's
    slices a replicated gradient locally or reduce-scatters a partial one, never gathers."""
    for g in grads:  # (a loop, not all(...): this runs on every call of several leaves)
        if type(g) is not torch.Tensor:
            break
    else:
        return grads
    return tuple(
        g.redistribute(x.device_mesh, x.placements)
        if is_dtensor(g) and is_dtensor(x) and (g.placements != x.placements or g.device_mesh != x.device_mesh)
        else g
        for g, x in zip(grads, xs, strict=True)
    )


def _cotangents(out: Any, touts: Any) -> Any:
    """``touts``, refused where a plain tensor stands for a DTensor output (torch would fail on
    the mix half-way through its backward pass)."""
    for y, t in zip(_leaves(out), _leaves(touts), strict=False):
        if is_dtensor(y) and isinstance(t, torch.Tensor) and not is_dtensor(t):
            raise InvalidInputError(
                "The cotangent of a DTensor output of f is a plain torch tensor: torch cannot mix the two. "
                "Make it a DTensor on the output's device mesh, e.g. "
                "torch.distributed.tensor.distribute_tensor(t, y.device_mesh, y.placements) (same t on "
                "every rank), or DTensor.from_local(local_t, mesh, placements) for a sharded one."
            )
    return touts


def _forward_on_dtensors(functional: bool) -> UnsupportedOperationError:
    mode = "torch.func.jvp" if functional else "torch.autograd.forward_ad"
    return UnsupportedOperationError(
        f"Forward mode ({mode}) does not run on DTensors in torch {torch.__version__}: torch has no sharding "
        "rule for the operators that make dual tensors. For a jvp of a sharded f use "
        "di.jvp(f, di.AutoFiniteDifferences(), x, t) with a DTensor tangent (one collective difference "
        "along t) or a vjp; for an hvp use AutoTorch(mode='autograd') (reverse over reverse)."
    )


def _dense_of_dtensors(what: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"{what} with respect to a DTensor x is a dense matrix built one row or entry at a time, which "
        "torch cannot do on sharded tensors without gathering them (and which would be as large as the "
        "model squared). Use products, which stay sharded: di.vjp (a row), di.hvp with "
        "AutoTorch(mode='autograd') (a Hessian column), di.gradient."
    )


def _stacked(entries: list[Any], like: Any) -> Any:
    return torch.stack(entries).reshape(like.shape) if entries else torch.zeros_like(like)


def _leaves(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def _detached(tree: Any, keep: bool) -> Any:
    """``tree`` out of the graph, unless the call keeps it (its inputs carried one)."""
    if tree is None or keep:
        return tree
    if isinstance(tree, torch.Tensor):
        return tree.detach()
    if type(tree) is tuple:  # the common case: a tuple of output tensors
        for leaf in tree:
            if type(leaf) is not torch.Tensor:
                break
        else:
            return tuple(map(torch.Tensor.detach, tree))
    return _tree.map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, tree)


# torch's public make_dual and unpack_dual pass through three Python frames each (torch.export's
# pre-dispatch hook, the dtype checks, the default level), several times the cost of the
# operations under them: once for each leaf of x and each output leaf of every jvp. Where no
# torch-function mode is active (the hook's mode is one), diffiface calls those operations with
# the level it opened; the plan has made x's leaves and the tangents floating or complex.
_make_dual = torch._make_dual
_unpack_dual = torch._unpack_dual
_function_mode = torch._C._is_torch_function_mode_enabled


def _open_dual_level() -> int:
    """A dual level of ours, entered (torch has one at a time: where the caller's is open, a
    nested forward mode, refused)."""
    if not _FORWARD_WARMED[0]:
        _warm_forward()
    try:
        level: int = forward_ad.enter_dual_level()
    except RuntimeError as exc:  # the caller's own dual level is open
        raise _nested_forward() from exc
    _DUALS[0] += 1
    return level


def _close_dual_level(level: int) -> None:
    _DUALS[0] -= 1
    forward_ad.exit_dual_level(level=level)


def _made_duals(xs: Leaves, txs: Leaves, level: int) -> Leaves:
    """Dual tensors of ``xs`` with tangents ``txs``, in the open dual level ``level`` of ours."""
    try:
        if _function_mode():
            return tuple(map(forward_ad.make_dual, xs, txs))
        return tuple(map(_make_dual, xs, txs, itertools.repeat(level, len(xs))))
    except RuntimeError as exc:  # duals of torch.func's wrapped tensors
        raise _autograd_in_func() from exc


def _unpacked(out: Leaves, level: int) -> tuple[Leaves, Leaves]:
    """Output leaves of a forward-mode call in the open dual level ``level`` split into their
    primals and tangents, each dual unpacked once (zeros where an output has no tangent; a leaf
    that is not a tensor, as it is)."""
    unpack = forward_ad.unpack_dual if _function_mode() else _unpack_dual
    primals, tangents = [], []
    for y in out:  # (a loop: on every call)
        if isinstance(y, torch.Tensor):
            primal, tangent = unpack(y, level=level)
            primals.append(primal)
            tangents.append(torch.zeros_like(primal) if tangent is None else tangent)
        else:
            primals.append(y)
            tangents.append(y)
    return tuple(primals), tuple(tangents)


def _dual_parts(value: Any) -> Any:
    """``(primal, tangent)`` of tensor ``value`` in the open dual level (tangent None: none;
    the primal ``value`` itself where no level is open)."""
    level = forward_ad._current_level
    if level < 0 or _function_mode():
        return forward_ad.unpack_dual(value)
    return _unpack_dual(value, level)


def _primal(value: Any) -> Any:
    return _dual_parts(value)[0] if isinstance(value, torch.Tensor) else value


def _tangent(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    primal, tangent = _dual_parts(value)
    return torch.zeros_like(primal) if tangent is None else tangent


# -- the guard: process state, nesting, writes into the inputs --------------------------------


def _wrapped(x: Any) -> bool:
    """Whether ``x`` is a tensor of a torch.func transform (such tensors have no storage)."""
    try:
        x.data_ptr()
    except RuntimeError:
        return True
    return False


def _carries_graph(x: Any) -> bool:
    """Whether ``x`` carries an outer differentiation: it requires grad under grad mode (or in
    a torch.func transform), or is a dual tensor of diffiface's open forward-mode call."""
    if x.requires_grad:
        return torch.is_grad_enabled() or _wrapped(x)
    return bool(_DUALS[0]) and _dual_parts(x)[1] is not None


def _autograd_in_func() -> UnsupportedOperationError:
    return UnsupportedOperationError(
        "AutoTorch(mode='autograd') was called on a tensor of a torch.func transform (an outer "
        "AutoTorch(mode='func') call, or torch.func.grad/jvp/vmap around it): torch does not support "
        "torch.autograd.grad or forward_ad inside torch.func transforms. Use AutoTorch(mode='func') for "
        "the inner call, or AutoTorch(mode='autograd') for the outer one."
    )


def _nested_forward() -> UnsupportedOperationError:
    return UnsupportedOperationError(
        "AutoTorch(mode='autograd') computes forward mode (jvp, derivative) with torch.autograd.forward_ad, "
        "which has one dual level per process: it cannot run inside another forward-mode differentiation. "
        "Use AutoTorch(mode='func') for the inner or the outer call, or a reverse-mode operator (gradient, "
        "vjp) inside."
    )


_FIX = "Compute out of place (y = x * 2, not x.mul_(2)); for scratch space f may overwrite, pass a di.Cache."


def _guard(program: Callable[..., Any], functional: bool, create_graph: bool) -> Callable[..., Any]:
    """``program`` run so that the caller's state and arrays come out as they went in.

    - Under the caller's ``inference_mode`` it runs with inference mode off (nothing is recorded
      in inference mode); inference tensors are copied into normal ones. Grad mode is set by
      each method where it needs it. Both are restored on the way out, also on errors, and also
      where f itself switched grad mode and left it switched.
    - Results keep the graph of x's leaves (:func:`_keeps`) only where the caller asks for it
      (``create_graph``), under torch.func, or where an outer diffiface call differentiates f;
      else they are detached, as ``torch.autograd.grad``'s are.
    - What f may write, and where a write lands (:func:`_watch`): f gets copies of x and of the
      tangents (what it would get otherwise shares the caller's memory: duals in forward mode,
      torch.func's wrappers, and in reverse mode the detached leaf, which torch lets f write
      into under no_grad). In autograd mode f also gets copies of the Constants' tensors, which
      torch lets f write into; under torch.func it gets the caller's own, which torch.func
      refuses to let f write. A Constant module is passed as it is: its parameters are watched
      by their version counters, its buffers too, and the buffers of its submodules in training
      mode are also kept in copies (torch's batch norm writes its running statistics without a
      version bump) and put back. A write is refused with a MutationError naming the leaf.

    The common call (one x, no tangent, one Constant tensor or none) takes no Python call
    besides ``program``'s: this runs on every call, and its cost is the library's overhead.
    """
    cache_dynamic = getattr(program, "cache_dynamic", ())
    cache_static = getattr(program, "cache_static", ())
    names = _Names(program)
    # which dynamic context leaves are Constants (watched), not Caches (f's scratch space)
    constant_at = tuple(i for i, cache in enumerate(cache_dynamic) if not cache)
    watch_static = not all(cache_static)  # a Constant static leaf may be a torch.nn.Module
    copy_constants = not functional

    def guarded(xs: Leaves, ts: Leaves, dynamic: Leaves, static: Any) -> Any:
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return guarded(xs, ts, dynamic, static)
        keep = False
        if len(xs) == 1:
            x = xs[0]
            if x.requires_grad or _DUALS[0]:
                keep = _keeps(x, functional, create_graph)
            # (a clone of an inference tensor is a normal one)
            x = x.clone() if keep or not x.requires_grad else x.detach().clone()
            xs = (x,)
            versions = [x._version]  # (a fresh clone's counter starts at 0; read, not assumed)
        else:
            for x in xs:
                if (x.requires_grad or _DUALS[0]) and _keeps(x, functional, create_graph):
                    keep = True
            if not keep:
                xs = tuple(map(torch.Tensor.detach, xs))
            xs = tuple(map(_clone, xs))  # (map, not a comprehension: no frame on the hot path)
            versions = list(map(_version, xs))
        if ts:
            ts = tuple(map(_clone, ts))
            tangent_versions = list(map(_version, ts))
        constants: list[tuple[int, Any, int]] = []
        if dynamic and constant_at:
            dynamic, constants = _watched_constants(dynamic, constant_at, copy_constants)
        modules = _module_states(static, cache_static) if static is not None and watch_static else None
        stack = _CALLS.keep
        stack.append(keep)
        grad_mode = torch.is_grad_enabled()  # f may switch it (torch.set_grad_enabled) and not switch back
        try:
            result = program(xs, ts, dynamic, static)
        except BaseException as exc:
            refusal = _after_failure(
                exc, stack, grad_mode, keep, xs, versions, constants, modules, names, copy_constants
            )
            if refusal is None and type(exc) is _CapturedWrite:
                refusal = _named_capture(lambda: program(xs, ts, dynamic, static), constants, modules, names)
            if refusal is not None:
                raise refusal from exc
            raise
        stack.pop()
        if torch.is_grad_enabled() is not grad_mode:
            torch.set_grad_enabled(grad_mode)
        _arrays.graph_state.keep = keep
        dirty = modules is not None
        for x, version in zip(xs, versions, strict=False):  # (a loop: this runs on every call)
            if x._version != version:
                dirty = True
        for _, tensor, version in constants:
            dirty = dirty or tensor._version != version
        if dirty:
            problem = _mutation(xs, versions, constants, modules, names, copy_constants)
            if problem is not None:
                raise MutationError(problem)
        if ts:
            for t, v in zip(ts, tangent_versions, strict=True):
                if t._version != v:
                    # (the tangent f reaches through its dual input: a write changes the derivative itself)
                    raise MutationError(f"f wrote in place into the tangent of its input (forward mode). {_FIX}")
        return result

    return guarded


def _keeps(x: Any, functional: bool, create_graph: bool) -> bool:
    """Whether a call on ``x`` (which requires grad, or a dual level of ours is open) keeps the
    graph x carries: under torch.func (its semantics), where the caller asks for it
    (``create_graph``), or inside an outer diffiface call, which differentiates through this
    one; else the results are detached, as ``torch.autograd.grad``'s."""
    if x.is_inference() or not _carries_graph(x):
        return False
    return functional or create_graph or bool(_CALLS.keep) or _wrapped(x)


class _Names:
    """The paths of a program's leaves (``x['w']``, ``contexts[0][1]``), read where an error
    names one."""

    __slots__ = ("dynamic", "static", "x")

    def __init__(self, program: Any) -> None:
        self.x: tuple[str, ...] = getattr(program, "x_names", ())
        self.dynamic: tuple[str, ...] = getattr(program, "names_dynamic", ())
        self.static: tuple[str, ...] = getattr(program, "names_static", ())

    def of_x(self, i: int, count: int) -> str:
        if i < len(self.x):
            return self.x[i]
        return f"leaf {i} of x" if count > 1 else "x"

    def of_dynamic(self, i: int) -> str:
        return self.dynamic[i] if i < len(self.dynamic) else f"array context leaf {i}"

    def of_static(self, i: int) -> str:
        return self.static[i] if i < len(self.static) else f"context leaf {i}"


_clone = torch.Tensor.clone
_version = operator.attrgetter("_version")
_requires_grad = operator.attrgetter("requires_grad")
_requiring = torch.Tensor.requires_grad_


class _Gradient:
    """The guard, the program and the engine's gradient of a gradient call, in one call.

    It serves the common call: grad mode on, inference mode off, no forward-mode call of ours
    open, no leaf of x requiring grad (no outer graph), every context leaf dynamic (and, under
    torch.func, every leaf of x a plain tensor: a DTensor's gradient is laid out again). It
    does what :func:`_guard` and the program do for it, in their order: copies of x's leaves
    and of the Constant tensors, f on them, f's output checked (a scalar of a type and dtype
    seen before takes no more checks; any other output, the program's own checks,
    ``settle``), the gradient, and the version counters read, a write refused with a
    MutationError. Any other call is ``guarded``'s, before anything has run.

    The gradient is ``torch.autograd.grad`` on the copies made leaves of a fresh graph. The
    other fused calls (:class:`_Pullback`, :class:`_Pushforward`, :class:`_Hvp`) share these
    steps and put their own engine in place of the gradient's.

    A fused call is kept only where ``taskset -c 1 python benchmarks/torch_fused.py`` (a pinned,
    interleaved benchmark against the guard's steps on the same prepared call) shows it more
    than 5% quicker: autograd mode's gradient, both modes' vjp, autograd mode's jvp and hvp.
    torch.func's gradient and Jacobian, which it did not show so, take the guard's steps."""

    __slots__ = ("checked", "constant_at", "functional", "fused", "guarded", "names", "plain")

    def __init__(self, guarded: Callable[..., Any], fused: Any, program: Any, functional: bool = False) -> None:
        self.guarded = guarded
        self.fused = fused
        self.checked = fused.checked
        self.constant_at = tuple(i for i, cache in enumerate(program.cache_dynamic) if not cache)
        self.names = _Names(program)
        self.functional = functional
        # x's leaves (and the tangents) must be plain tensors (a DTensor's results are laid out
        # again), and f gets plain copies of them; else leaves of a fresh graph (autograd's reverse mode)
        self.plain = functional or fused.compute == "value_and_pushforward"

    def __call__(self, xs: Leaves, ts: Leaves, dynamic: Leaves, static: Any) -> Any:
        if (
            static is not None
            or _DUALS[0]
            or not torch.is_grad_enabled()
            or torch.is_inference_mode_enabled()
            or not xs
            or (self.plain and (set(map(type, xs)) != _PLAIN or (ts and set(map(type, ts)) != _PLAIN)))
        ):
            return self.guarded(xs, ts, dynamic, static)
        if any(map(_requires_grad, xs)):  # (an nn.Parameter: its results detached, as torch.autograd.grad's)
            if self.functional or _CALLS.keep:  # (torch.func's semantics, or an outer call: the graph kept)
                return self.guarded(xs, ts, dynamic, static)
            xs = tuple(map(torch.Tensor.detach, xs))
        if self.plain:
            inputs = tuple(map(_clone, xs))
        else:
            try:
                inputs = tuple(map(_requiring, map(_clone, xs)))  # (a clone of x that does not require grad: a leaf)
            except RuntimeError:  # a tensor of a torch.func transform (the guard's steps say so)
                return self.guarded(xs, ts, dynamic, static)
        versions = list(map(_version, inputs))
        constants: list[tuple[int, Any, int]] = []
        if dynamic and self.constant_at:
            dynamic, constants = _watched_constants(dynamic, self.constant_at, not self.functional)
        fused = self.fused
        rebuilds = fused.rebuilds
        if rebuilds is None:
            context_values = dynamic
        elif len(rebuilds) == 1:
            context_values = (rebuilds[0](dynamic),)
        else:
            context_values = fused.contexts(dynamic)
        f = fused.ref()
        if f is None:
            f = fused.function()
        stack = _CALLS.keep
        stack.append(False)
        try:
            result = self.engine(inputs, xs, ts, f, context_values)
        except BaseException as exc:
            refusal = _after_failure(
                exc, stack, True, False, inputs, versions, constants, None, self.names, not self.functional
            )
            if refusal is None and type(exc) is _CapturedWrite:
                refusal = _named_capture(
                    lambda: self.engine(inputs, xs, ts, f, context_values), constants, None, self.names
                )
            if refusal is not None:
                raise refusal from exc
            raise
        stack.pop()
        if not torch.is_grad_enabled():  # f switched it off (torch.set_grad_enabled) and did not switch back
            torch.set_grad_enabled(True)
        _arrays.graph_state.keep = False
        dirty = list(map(_version, inputs)) != versions
        for _, tensor, version in constants:  # (a loop, not a generator: this runs on every call)
            dirty = dirty or tensor._version != version
        if dirty:
            problem = _mutation(inputs, versions, constants, None, self.names, not self.functional)
            if problem is not None:
                raise MutationError(problem)
        return result

    def engine(self, inputs: Leaves, xs: Leaves, ts: Leaves, f: Callable[..., Any], context_values: Leaves) -> Any:
        """The engine's part of the call on the copies ``inputs`` of x's leaves ``xs``: the
        program's results, ``(gradient,)`` or ``(value, gradient)``."""
        fused = self.fused
        try:
            value = f(inputs[0] if fused.single else fused.rebuild(inputs), *context_values)
        except Exception as exc:
            _explained(exc, fused.adapter)
            raise
        if not (
            type(value) is torch.Tensor
            and value.requires_grad
            and (torch.Tensor, value.dtype) in self.checked
            and value.shape == ()
            and torch.is_grad_enabled()
        ):
            value = fused.settle(value, f, context_values, inputs, inputs[0])
        if value.requires_grad:
            grads = _whole(torch.autograd.grad((value,), inputs, allow_unused=True), inputs)
        else:
            grads = _grad([], inputs)
        return (value, grads) if fused.value else (grads,)


class _Pullback(_Gradient):
    """:class:`_Gradient`'s one call for a vjp: the same guard's steps around f closed and
    checked by the program's own ``close`` (its output recorded), the cotangent checked against
    that record (``cotangent``), and the backward pass with the cotangent: one
    ``torch.autograd.grad``, or in torch.func mode the pullback of ``torch.func.vjp`` of the
    closed f on the tuple of x's leaves, where the guard, the program and the adapter's pullback
    take their Python frames and, in torch.func mode, closures made on every call. It serves the
    call :class:`_Gradient` serves; any other is ``guarded``'s, before anything has run. Kept by
    ``benchmarks/torch_fused.py`` (see :class:`_Gradient`)."""

    __slots__ = ()

    def engine(self, inputs: Leaves, xs: Leaves, ts: Leaves, f: Callable[..., Any], context_values: Leaves) -> Any:
        fused = self.fused
        closed = fused.close(f, context_values, xs[0])
        if self.functional:  # torch.func.vjp of the closed f: on one tensor, or the tuple of x's leaves
            single = fused.single
            out, pullback = func.vjp(functools.partial(_output, closed, single), inputs[0] if single else inputs)  # type: ignore[misc]
            bare = type(out) is not tuple  # (one output tensor, bare: less pytree work for torch.func)
            if bare:
                out = (out,)
        else:
            out, _ = closed(inputs)
        fused.cotangent(ts)
        outs = out if type(out) is tuple else (out,)
        touts = ts
        for y in outs:  # (a loop: no generator on the common path)
            if type(y) is not torch.Tensor:  # a DTensor: its cotangents laid out as it is
                touts = _cotangents(out, ts)
                break
        if self.functional:
            grads = pullback(touts[0] if bare else touts)[0]
            if single:
                grads = (grads,)
            return (out, grads) if fused.value else (grads,)
        grads = _backward(outs, touts, inputs)
        return (_detached(out, False), grads) if fused.value else (grads,)


class _Pushforward(_Gradient):
    """:class:`_Gradient`'s one call for a jvp in autograd mode: the same guard's steps around
    the engine's product, computed one of two ways, as ``AutoTorch(jvp=...)`` says (with
    ``"auto"``, the prep's first call chooses, see :meth:`choose`; every later call computes it
    as the chosen one does):

    - forward mode (:meth:`forward`): copies of the tangents made duals of the copies of x's
      leaves in a dual level of ours, f closed and checked by the program's own ``close``, each
      output's primal and tangent unpacked once, and the tangents' version counters read (a
      write into one changes the derivative itself, and is refused);
    - reverse over reverse (:meth:`by_pullbacks`), as ``torch.autograd.functional.jvp``
      computes it: torch's forward mode builds, for each operation between a dual tensor and a
      plain one, a zero tangent whose shape a Python meta kernel computes, so that on a small
      function two backward passes may cost less.

    Every leaf of x and of the tangent must be a plain tensor; any other call is ``guarded``'s,
    before anything has run. Kept by ``benchmarks/torch_fused.py`` (see :class:`_Gradient`)."""

    __slots__ = ("reverse",)

    def __init__(self, guarded: Callable[..., Any], fused: Any, program: Any, functional: bool = False) -> None:
        super().__init__(guarded, fused, program, functional)
        way = fused.adapter.backend.jvp
        self.reverse: bool | None = None if way == "auto" else way == "reverse"
        """Whether the product is reverse over reverse (None: not chosen yet, ``jvp="auto"``)."""

    def engine(self, inputs: Leaves, xs: Leaves, ts: Leaves, f: Callable[..., Any], context_values: Leaves) -> Any:
        reverse = self.reverse
        if reverse is None:
            return self.choose(inputs, xs, ts, f, context_values)
        if reverse:
            try:
                return self.by_pullbacks(inputs, xs, ts, f, context_values)
            except _NoSecondPass:  # an operation torch cannot differentiate twice: forward mode from now on
                self.reverse = False
                inputs = tuple(map(torch.Tensor.detach, inputs))  # (their version counters: the guard's)
        return self.forward(inputs, xs, ts, f, context_values)

    def forward(self, inputs: Leaves, xs: Leaves, ts: Leaves, f: Callable[..., Any], context_values: Leaves) -> Any:
        """The product by forward mode on ``inputs``, copies of x's leaves."""
        fused = self.fused
        tangents = tuple(map(_clone, ts))
        versions = list(map(_version, tangents))
        with _FORWARD_LOCK:
            level = _open_dual_level()
            try:
                out, _ = fused.close(f, context_values, xs[0])(_made_duals(inputs, tangents, level))
                primals, outs = _unpacked(out, level)  # (close gives a tuple of output leaves)
            finally:
                _close_dual_level(level)
        if list(map(_version, tangents)) != versions:
            # (the tangent f reaches through its dual input: a write changes the derivative itself)
            raise MutationError(f"f wrote in place into the tangent of its input (forward mode). {_FIX}")
        return (primals, outs) if fused.value else (outs,)

    def by_pullbacks(
        self, inputs: Leaves, xs: Leaves, ts: Leaves, f: Callable[..., Any], context_values: Leaves
    ) -> Any:
        """The product by reverse over reverse on ``inputs``, copies of x's leaves: f on them made
        leaves of a fresh graph, its pullback along zero cotangents that require grad (linear in
        them, with its graph), and that pullback's own along copies of the tangents (a product
        the graphs pass through unchanged would be the caller's tangent itself). An output leaf
        the graph does not reach has a zero product, as in forward mode. Where torch cannot
        differentiate the pullback, :class:`_NoSecondPass`: it raises, a pullback comes out
        without a graph (a backward pass of a piecewise constant operation, whose zero forward
        mode computes as well), or the pullbacks' graph does not reach a cotangent (a
        ``once_differentiable`` backward pass; or an output traced through a Constant that
        requires grad, not through x): a zero product there could be wrong."""
        fused = self.fused
        versions = list(map(_version, inputs))
        leaves = tuple(map(_requiring, inputs))  # (copies: leaves, made to require grad in place)
        out, _ = fused.close(f, context_values, xs[0])(leaves)
        tracked, zeros = [], []
        for y in out:  # (loops, not comprehensions: no frame of their own on every call)
            if isinstance(y, torch.Tensor) and y.requires_grad:
                tracked.append(y)
                zeros.append(torch.zeros_like(y, requires_grad=True))
        products: Leaves = ()
        if tracked:
            try:
                pulled = torch.autograd.grad(tracked, leaves, zeros, create_graph=True, allow_unused=True)
                linear, along = [], []
                for g, t in zip(pulled, ts, strict=True):
                    if g is not None:
                        # (a pullback without a graph: a zero product from it could be wrong)
                        if not g.requires_grad:
                            raise _NoSecondPass
                        linear.append(g)
                        along.append(_clone(t))
                if linear:  # (every zero cotangent reached, or torch raises: a pullback's graph is cut)
                    products = torch.autograd.grad(linear, zeros, along)
            except RuntimeError as exc:
                if list(map(_version, inputs)) != versions:  # f wrote into x: the guard says so
                    raise
                raise _NoSecondPass from exc
        found = iter(products)
        primals, outs = [], []
        for y in out:  # (a loop: on every call)
            if isinstance(y, torch.Tensor):
                product = next(found, None) if y.requires_grad else None
                primals.append(y.detach())
                outs.append(torch.zeros_like(y) if product is None else product)
            else:
                primals.append(y)
                outs.append(y)
        return (tuple(primals), tuple(outs)) if fused.value else (tuple(outs),)

    def choose(self, inputs: Leaves, xs: Leaves, ts: Leaves, f: Callable[..., Any], context_values: Leaves) -> Any:
        """The first call's product, and the way of every later call's: forward mode, unless
        reverse over reverse, timed beside it twice each on further copies of x, takes under
        four fifths of its time and gives the same product, entry by entry within the square
        root of the dtype's resolution times the largest entry (:func:`_agree`: a part of f
        computed under ``torch.no_grad()``, which forward mode differentiates and reverse mode
        does not, tells them apart). Forward mode is kept without timing the other where it
        took over ``_CHOICE_LIMIT`` seconds (the timing would cost what f does), where x, the
        tangent or f's output holds a complex or not a plain tensor, or where f wrote into x.
        The calls that time the ways leave torch's random generators as the first left them (a
        function that draws from them gives products that differ, and keeps forward mode).
        Only ``AutoTorch(jvp="auto")`` chooses; the way chosen is kept in this prep only."""
        if not _FORWARD_WARMED[0]:  # (not timed: once per process)
            _warm_forward()
        versions = list(map(_version, inputs))
        result, took = _timed(self.forward, inputs, xs, ts, f, context_values)
        self.reverse = False
        if list(map(_version, inputs)) != versions:  # (a write by f into x: the guard refuses it)
            return result
        products = result[-1]
        if (
            took > _CHOICE_LIMIT
            or any(map(torch.Tensor.is_complex, (*xs, *ts)))
            or any(isinstance(y, torch.Tensor) and (type(y) is not torch.Tensor or y.is_complex()) for y in products)
        ):
            return result
        forward_took, reverse_took = [took], []
        # (the calls that time the two ways leave torch's random generators as this call's left them)
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        try:
            for _ in range(2):
                other, took = _timed(self.by_pullbacks, tuple(map(_clone, xs)), xs, ts, f, context_values)
                reverse_took.append(took)
                forward_took.append(_timed(self.forward, tuple(map(_clone, xs)), xs, ts, f, context_values)[1])
        except Exception:  # (forward mode computed this call's product: it is the call's)
            return result
        finally:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
        self.reverse = min(reverse_took) < 0.8 * min(forward_took) and _agree(products, other[-1])
        return other if self.reverse else result


_CHOICE_LIMIT = 0.01
"""The time of a forward-mode jvp (seconds) above which its first call keeps forward mode
without timing reverse over reverse beside it (:meth:`_Pushforward.choose`)."""


def _timed(call: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``call(*args)`` and the seconds it took."""
    start = time.perf_counter()
    result = call(*args)
    return result, time.perf_counter() - start


class _NoSecondPass(Exception):
    """torch cannot differentiate a pullback of f (an operation without a double backward)."""


def _agree(one: Leaves, other: Leaves) -> bool:
    """Whether two products of f's output leaves hold the same values, each floating entry
    within the square root of its dtype's resolution times the largest entry of all (a product
    that keeps a graph, of an f differentiating inside, compared by its values)."""
    tensors = [(a.detach(), b.detach()) for a, b in zip(one, other, strict=True) if isinstance(a, torch.Tensor)]
    if any(a.shape != b.shape or a.dtype != b.dtype for a, b in tensors):
        return False
    floating = [(a, b) for a, b in tensors if a.is_floating_point() and a.numel()]
    if not all(bool(torch.isfinite(a).all() and torch.isfinite(b).all()) for a, b in floating):
        return False
    scale = max((float(a.abs().max()) for a, _ in floating), default=0.0)
    close = all(float((a - b).abs().max()) <= torch.finfo(a.dtype).eps ** 0.5 * scale for a, b in floating)
    return close and all(bool(torch.equal(a, b)) for a, b in tensors if not a.is_floating_point())


class _Hvp(_Gradient):
    """:class:`_Gradient`'s one call for an hvp in autograd mode: the same guard's steps
    around f closed and checked by the program's own ``close`` on the copies of x's leaves,
    its gradient with its graph, and that gradient's pullback along copies of the tangents
    (double backward), where the guard, the program and the adapter's method take their Python
    frames. It serves the call :class:`_Gradient` serves. Kept by ``benchmarks/torch_fused.py``
    (see :class:`_Gradient`)."""

    __slots__ = ()

    def engine(self, inputs: Leaves, xs: Leaves, ts: Leaves, f: Callable[..., Any], context_values: Leaves) -> Any:
        value, _ = self.fused.close(f, context_values, xs[0])(inputs)
        grads = _grad(_if_graph(value), inputs, create_graph=True)
        # the gradient's pullback along copies of the tangents (a product the graph passes
        # through unchanged would be the caller's tangent)
        hvps = _backward(grads, tuple(map(_clone, ts)), inputs)
        if self.fused.value:  # the gradient too
            return tuple(map(torch.Tensor.detach, _placed(grads, inputs))), hvps
        return (hvps,)


_FUSED = {
    ("value_and_gradient", False): _Gradient,
    ("value_and_pullback", False): _Pullback,
    ("value_and_pullback", True): _Pullback,
    ("value_and_pushforward", False): _Pushforward,
    ("gradient_and_hvp", False): _Hvp,
}
"""Each computation's one call, by (computation, torch.func mode); any other, the guard's steps."""


def _output(closed: Fn, single: bool, x: Any) -> Any:
    """The closed f's output leaves without its aux (None: no aux), as torch.func.vjp takes
    them: on one tensor where ``single``, else on the tuple of x's leaves; one output tensor
    bare, not in a tuple of one (less pytree work for torch.func)."""
    out = closed((x,) if single else x)[0]
    return out[0] if len(out) == 1 else out


def _explained(exc: Exception, adapter: Adapter) -> None:
    """Where f failed in a way the adapter explains (numpy code on torch tensors), a
    FrameworkMismatchError that says so, raised from ``exc``; else nothing (``exc`` is f's own)."""
    hint = adapter.explain_failure(exc)
    if hint is not None:
        raise FrameworkMismatchError(f"f failed under the {adapter.backend.name} backend: {hint}") from exc


_PLAIN = {torch.Tensor}
"""The type of a plain tensor, as a set: the types of x's leaves compared with it in C."""


_LEAF_WRITE = "a leaf Variable that requires grad is being used in an in-place operation"
"""torch's refusal of a write into a leaf that requires grad, such as the leaf f gets for x."""


def _watched_constants(
    dynamic: Leaves, constant_at: tuple[int, ...], copy: bool
) -> tuple[Leaves, list[tuple[int, Any, int]]]:
    """The dynamic context leaves for f, and (index, tensor, its version) for each Constant
    tensor, to see a write by: where ``copy`` (autograd mode, where torch lets f write into
    them), a copy of each in its place (f cannot reach the caller's memory through it); else
    (torch.func, which refuses writes into the tensors f closes over) the caller's own."""
    fresh = list(dynamic) if copy else dynamic
    constants = []
    for i in constant_at:
        if i >= len(fresh):  # (only the leaves this call has)
            break
        value = fresh[i]
        if isinstance(value, torch.Tensor):
            if copy:
                fresh[i] = value = value.clone()  # type: ignore[index]
            elif value.is_inference():  # (torch refuses any write into it outside inference mode)
                continue
            constants.append((i, value, value._version))
    return tuple(fresh), constants


def _after_failure(
    exc: BaseException,
    stack: list[bool],
    grad_mode: bool,
    keep: bool,
    xs: Leaves,
    versions: list[int],
    constants: list[tuple[int, Any, int]],
    modules: list[tuple[int, str, str, str, Any, int, Any]] | None,
    names: _Names | None,
    copied: bool = True,
) -> MutationError | None:
    """After f or the engine raised ``exc`` inside the guard: the caller's state put back (the
    call's stack entry, grad mode, the graph flag), and the MutationError that names a write f
    made, where it made one (None: ``exc`` itself is what the caller gets)."""
    stack.pop()
    if torch.is_grad_enabled() is not grad_mode:
        torch.set_grad_enabled(grad_mode)
    _arrays.graph_state.keep = keep
    problem = _mutation(xs, versions, constants, modules, names, copied)
    if problem is not None:
        return MutationError(problem)
    if isinstance(exc, RuntimeError) and _LEAF_WRITE in str(exc):
        # torch refused a write into the leaf f got for x (refused before writing)
        where = "x" if names is None else names.of_x(0, len(xs)) if len(xs) == 1 else "x"
        return MutationError(f"f wrote in place into its input {where}; torch refused it. {_FIX}")
    return None


def _module_states(
    static: Any, cache_static: tuple[bool, ...]
) -> list[tuple[int, str, str, str, Any, int, Any]] | None:
    """For each Constant ``torch.nn.Module`` (by its index among the static leaves): each
    parameter and buffer as (index, what, its module's prefix, name, tensor, version, copy). The copy, kept only of
    the buffers of submodules in training mode, puts back what torch's batch norm writes into
    its running statistics without a version bump; nothing else is copied (a frozen backbone
    costs its counters, not its size). The qualified name is joined only where an error names it."""
    states: list[tuple[int, str, str, str, Any, int, Any]] = []
    for index, (value, cache) in enumerate(zip(static.leaves, cache_static, strict=False)):
        if cache or not isinstance(value, torch.nn.Module):
            continue
        _refuse_fully_sharded(value)
        for prefix, module in value.named_modules():
            training = module.training
            for name, tensor in module._parameters.items():
                if tensor is not None and not tensor.is_inference():  # (torch refuses writes into those)
                    states.append((index, "parameter", prefix, name, tensor, tensor._version, None))
            for name, tensor in module._buffers.items():
                if tensor is not None and not tensor.is_inference():
                    copy = tensor.detach().clone() if training else None
                    states.append((index, "buffer", prefix, name, tensor, tensor._version, copy))
    return states or None


def _refuse_fully_sharded(module: Any) -> None:
    """Refuse a module sharded by FSDP2's ``fully_shard``: its forward hooks gather its own
    parameters and put them in place of those ``torch.func.functional_call`` passes, so f would
    not depend on x and its gradient would read zero."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    if kind is None or not any(isinstance(m, kind) for m in module.modules()):
        return
    raise UnsupportedOperationError(
        "A di.Constant holds a module sharded by FSDP2 (fully_shard): its forward hooks gather its own "
        "parameters and use them in place of any passed by torch.func.functional_call, so the gradient "
        "with respect to x would read zero. Differentiate an unwrapped copy of the module whose parameters "
        "are DTensors (torch.distributed.tensor.distribute_module or distribute_tensor on each parameter), "
        "with x = its parameters and f calling torch.func.functional_call; or train the FSDP2 module with "
        "its own loss.backward()."
    )


def _mutation(
    xs: Leaves,
    versions: list[int],
    constants: list[tuple[int, Any, int]],
    modules: list[tuple[int, str, str, str, Any, int, Any]] | None,
    names: _Names | None,
    copied: bool = True,
) -> str | None:
    """What f wrote into, named by its path, restored where a copy was kept; None if it wrote
    nothing. ``copied``: the Constant tensors f got were copies (autograd mode)."""
    for i, (x, version) in enumerate(zip(xs, versions, strict=True)):
        if x._version != version:
            where = names.of_x(i, len(xs)) if names is not None else (f"leaf {i} of x" if len(xs) > 1 else "x")
            return f"f wrote in place into its input {where}; the caller's x and tangent are unchanged. {_FIX}"
    for i, tensor, version in constants:
        if tensor._version != version:
            where = names.of_dynamic(i) if names is not None else f"array context leaf {i}"
            state = (
                "the caller's tensor is unchanged (f wrote into a copy)"
                if copied
                else "torch.func lets no such write through, yet the caller's tensor now holds what f wrote"
            )
            return f"f wrote in place into {where}, a tensor of a di.Constant; {state}. A Constant is read-only: {_FIX}"
    if modules:
        changed = None
        for index, what, prefix, name, tensor, version, copy in modules:
            if tensor._version != version or (copy is not None and not torch.equal(tensor, copy)):
                if changed is None:
                    changed = (index, what, f"{prefix}.{name}" if prefix else name, copy is not None)
                if copy is not None:
                    with torch.no_grad():
                        tensor.copy_(copy)
        if changed is not None:
            index, what, name, restored = changed
            where = names.of_static(index) if names is not None else "a di.Constant"
            state = "it has been put back" if restored else "the caller's module now holds what f wrote"
            if what == "parameter":
                return (
                    f"f wrote in place into the parameter {name!r} of the torch.nn.Module {where}, a di.Constant; "
                    f"{state}. A Constant is read-only: {_FIX}"
                )
            return (
                f"f updated the buffer {name!r} of the torch.nn.Module {where}, a di.Constant (a BatchNorm in "
                f"train mode updates its running statistics); {state}. Call the module "
                "through torch.func.functional_call(model, {**params, **{k: b.clone() for k, b in "
                "model.named_buffers()}}, args) and return the new buffers as an aux with "
                "di.value_and_gradient(..., has_aux=True), or put the module in eval mode."
            )
    return None


class _CapturedWrite(MutationError):
    """torch.func's refusal of a write by f into a tensor it closes over, before the write."""


_IN_PLACE_OPERATORS = frozenset(
    f"__i{name}__"
    for name in (
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "matmul",
        "and",
        "or",
        "xor",
        "lshift",
        "rshift",
    )
) | {"__setitem__"}


class _Found(Exception):
    """The leaf f was about to write into (:class:`_WriteFinder`)."""


class _WriteFinder(TorchFunctionMode):
    """Raises :class:`_Found`, before the write, at f's first in-place operation (a method
    ``x.add_``, an in-place operator, an ``out=``) into one of the ``watched`` tensors (by
    identity: what each is, as an error names it)."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched = watched

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        targets = list(_tree.leaves(kwargs.get("out")))
        if args and ((name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_OPERATORS):
            targets.append(args[0])
        for target in targets:
            where = self.watched.get(id(target))
            if where is not None:
                raise _Found(where)
        return func(*args, **kwargs)


def _named_capture(
    rerun: Callable[[], Any],
    constants: list[tuple[int, Any, int]],
    modules: list[tuple[int, str, str, str, Any, int, Any]] | None,
    names: _Names,
) -> MutationError | None:
    """Where torch.func refused a write by f into a tensor it closes over (before the write, so
    nothing was written), the MutationError that names the leaf: f is run once more, as the call
    ran it, and stopped at its first in-place operation into a Constant's tensor or a Constant
    module's parameter or buffer. None where it does not reach one (a global; or f takes
    another path on its second run): torch.func's own refusal stands."""
    watched = {id(tensor): f"{names.of_dynamic(i)}, a tensor of a di.Constant" for i, tensor, _ in constants}
    for index, what, prefix, name, tensor, _, _ in modules or ():
        qualified = f"{prefix}.{name}" if prefix else name
        watched[id(tensor)] = f"the {what} {qualified!r} of the torch.nn.Module {names.of_static(index)}, a di.Constant"
    if not watched:
        return None
    grad_mode = torch.is_grad_enabled()
    stack = _CALLS.keep
    depth = len(stack)
    try:
        with _WriteFinder(watched):
            rerun()
    except _Found as found:
        return MutationError(
            f"f wrote in place into {found}; torch.func refused it before the write, so nothing was written. "
            f"A Constant is read-only: {_FIX} For a BatchNorm in train mode, put the module in eval mode or "
            "pass its buffers as x's companions through torch.func.functional_call and has_aux=True."
        )
    except Exception:  # (f failed another way on its second run: torch.func's refusal stands)
        return None
    finally:
        del stack[depth:]
        torch.set_grad_enabled(grad_mode)
    return None
