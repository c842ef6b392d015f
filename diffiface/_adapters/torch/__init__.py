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
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import torch
import torch.autograd.forward_ad as _forward_ad
from torch import func

from ... import _arrays
from ... import tree as _tree
from ..._errors import ArrayTypeError, InvalidInputError, InvalidOutputError
from ..._families.torch import CALLS as _CALLS
from ..._families.torch import x_refusal
from .. import _base
from .._base import NO_PARTS, Blocks, Fn, Leaves, ProgramParts
from ._dtensor import _any_dtensor, _cotangents, _dense_of_dtensors, _forward_on_dtensors, _placed, is_dtensor
from ._duals import (
    _DUALS,
    _FORWARD_LOCK,
    _FORWARD_WARMED,
    _close_dual_level,
    _dual_parts,
    _forward_locked,
    _made_duals,
    _open_dual_level,
    _primal,
    _tangent,
    _unpacked,
    _warm_forward,
)
from ._engine import (
    _backward,
    _bare_output,
    _BatchedWrongly,
    _detached,
    _for_func,
    _FuncPullback,
    _grad,
    _if_graph,
    _jacobian_by,
    _materialised,
    _NoSecondPass,
    _noting_batched_wrongly,
    _pushed_by_pullbacks,
    _refuse_a_read_of_x_itself,
    _refuse_hidden_cut,
    _requiring_grad,
    _stacked,
    _tensor_aux,
    _whole,
)
from ._explain import _autograd_in_func, _nested_forward, explain_failure
from ._fused import _FUSED
from ._guard import _guard, _keeping, _requires_grad, _wrapped, inside_a_call

__all__ = ["Adapter", "inside_a_call", "is_dtensor"]


# torch.func's value and gradient of f (the second argument) in the first, made once: a
# transform made on every call costs as much as the rest of the route's steps
# (``python benchmarks/torch_users.py``, row a in torch.func mode)
_GRAD_AND_VALUE = func.grad_and_value(lambda xs, fn: fn(xs)[0])
_GRAD_AND_VALUE_AT_ONE = func.grad_and_value(lambda x, fn: fn((x,))[0])
_GRAD_AND_VALUE_WITH_AUX = func.grad_and_value(lambda xs, fn: fn(xs), has_aux=True)
_GRAD_AND_VALUE_WITH_AUX_AT_ONE = func.grad_and_value(lambda x, fn: fn((x,)), has_aux=True)


class _Namespace:
    """The few array functions ``_base`` needs, with torch's names."""

    stack = staticmethod(torch.stack)
    reshape = staticmethod(torch.reshape)
    zeros_like = staticmethod(torch.zeros_like)
    ones_like = staticmethod(torch.ones_like)
    sum = staticmethod(torch.sum)
    zeros = staticmethod(torch.zeros)  # (dtype by keyword)


class Adapter(_base.Adapter):
    xp = _Namespace
    weak_floats = True  # (a 0-d tensor takes the dtype of the tensors with dimensions it meets)

    def __new__(cls, backend: Any, info: Any) -> Adapter:
        if cls is Adapter and getattr(backend, "compile", False):  # AutoTorch(compile=True): _compiled
            from ._compiled import compiled_adapter

            return super().__new__(compiled_adapter(Adapter))  # type: ignore[return-value]
        return super().__new__(cls)

    def __init__(self, backend: Any, info: Any) -> None:
        super().__init__(backend, info)
        self.functional = backend.mode == "func"
        self.create_graph: bool = getattr(backend, "create_graph", False)
        # a jvp by reverse over reverse, forced (jvp="auto" times the two in the fused call only)
        self.reverse_jvp = getattr(backend, "jvp", "forward") == "reverse"

    def to_native(self, leaf: Any) -> Any:
        kind = _arrays.kind(leaf)
        if kind == "torch":
            if leaf.is_meta:
                raise InvalidInputError(f"x (or a tangent) {x_refusal(leaf)}")
            return leaf
        if kind == "python":
            return torch.tensor(leaf, dtype=torch.complex128 if isinstance(leaf, complex) else torch.float64)
        if kind == "numpy":
            return _tensor_copy(leaf)
        raise ArrayTypeError(
            f"The torch backend was given a {type(leaf).__module__}.{type(leaf).__name__} where it takes "
            "torch tensors, numpy arrays or floats (a tangent of another framework?). Convert it to a "
            "torch tensor of x's dtype."
        )

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        if isinstance(leaf, np.ndarray):
            device = like.device if isinstance(like, torch.Tensor) else None
            tensor = _tensor_copy(leaf)
            return tensor.to(device) if device is not None else tensor, True
        if isinstance(leaf, torch.Tensor) and leaf.is_meta:
            raise InvalidInputError(
                "A context holds a meta tensor, which has a shape but no values. Create it on a real device."
            )
        return leaf, isinstance(leaf, torch.Tensor)

    def trace_value(self, leaf: Any, xs: Leaves) -> str | None:
        if not isinstance(leaf, torch.Tensor):
            return None
        if torch._C._functorch.is_functorch_wrapped_tensor(leaf):
            return "a tensor of torch.func's transforms"
        return "a torch tensor that keeps its autograd graph" if leaf.grad_fn is not None else None

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
        if not _DUALS[0] and any(map(_requires_grad, xs)):  # reverse mode, torch.autograd's or torch.func's
            return True
        if _dual_parts(leaf)[1] is None:  # (a tangent: tracked, the common case)
            # forward mode, ours or torch.func's (inside its jvp each tensor is wrapped alike, but
            # one cut from x, by .item() or .detach(), carries no tangent of its level; under ours,
            # one may require grad through the caller's graph, create_graph's, and carry none)
            return any(_dual_parts(x)[1] is not None for x in xs)
        return False

    def refuse_a_read_of_x(self, at: Callable[[Leaves], list[Any]], xs: Leaves, given: Leaves) -> None:
        # (inside the caller's own torch.func transforms, a tensor f reads itself is a constant, by their design)
        if self.functional or not any(map(_wrapped, xs)):
            _refuse_a_read_of_x_itself(lambda: at(xs), tuple(x.detach() for x in xs if isinstance(x, torch.Tensor)))

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

    explain_failure = explain_failure

    # -- the guard around every call: state, nesting, writes into the inputs --------------------

    def compile(
        self,
        program: Callable[..., Any],
        static: bool = True,
        arrays: bool = False,
        layouts: Any = None,
        parts: ProgramParts | None = None,
    ) -> Callable[..., Any]:
        parts = NO_PARTS if parts is None else parts
        guarded = _guard(program, self.functional, self.create_graph, parts)
        fused = parts.fused
        if fused is None or self.create_graph:
            return guarded
        fuse = _FUSED.get((fused.compute, self.functional))
        if fuse is None or fused.adapter is not self:  # (no fused call kept: the guard's steps)
            return guarded
        return fuse(guarded, fused, parts, functional=self.functional)

    # -- primitives ---------------------------------------------------------------------------

    def pullback_function(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
        if self.functional:
            g, has_aux, rebuild = _for_func(fn, xs)
            g, wrongly = _noting_batched_wrongly(g, has_aux)
            g, bare = _bare_output(g, has_aux)
            primal = xs[0] if len(xs) == 1 else xs
            if has_aux:
                out, pullback, aux = func.vjp(g, primal, has_aux=True)  # type: ignore[misc]
            else:
                (out, pullback), aux = func.vjp(g, primal), None  # type: ignore[misc]
            if bare:  # one output tensor: its cotangent is the tuple's one leaf
                out, inner = (out,), pullback
                pullback = lambda touts: inner(touts[0])  # noqa: E731
            return out, rebuild(aux), _FuncPullback(pullback, out, xs, not wrongly[0])
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
            return _backward(outs, touts if type(touts) is tuple else (touts,), inputs, keep, unreached)

        def unreached() -> None:
            _refuse_hidden_cut(fn, xs)

        return _detached(out, keep), (None if aux is None else _detached(aux, keep)), vjp

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        if _any_dtensor(xs) or _any_dtensor(txs):
            raise _forward_on_dtensors(self.functional)
        if not _FORWARD_WARMED[0]:
            _warm_forward()
        with _FORWARD_LOCK:
            return self._value_and_pushforward(fn, xs, txs)

    def _value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        if _DUALS[0]:  # inside diffiface's own forward-mode call: torch has one dual level
            raise _nested_forward()
        if self.functional:
            g, has_aux, rebuild = _for_func(fn, xs)
            g, bare = _bare_output(g, has_aux)
            primals, tangents = (xs, txs) if len(xs) == 1 else ((xs,), (txs,))
            try:
                if has_aux:
                    out, tout, aux = func.jvp(g, primals, tangents, has_aux=True)  # type: ignore[misc]
                else:
                    (out, tout), aux = func.jvp(g, primals, tangents), None  # type: ignore[misc]
            except RuntimeError as exc:  # inside the caller's torch.autograd.forward_ad level
                if "Nested forward mode AD is not supported" in str(exc):
                    raise _nested_forward() from exc
                raise
            if bare:
                out, tout = (out,), (tout,)
            # torch.func.jvp promotes the tangent of a 0-d float32 output times a Python
            # float to float64; a tangent has its primal's dtype. A jvp of a jvp answers a
            # tangent that is zero by rule with a ZeroTensor: made an ordinary one.
            if type(tout) is tuple and len(tout) == 1:  # one output tensor
                if tout[0].dtype != out[0].dtype:
                    tout = (tout[0].to(out[0].dtype),)
                tout = _materialised(tout)
            else:
                tout = _tree.map(_as_tangent_of, tout, out)
            return out, rebuild(aux), tout
        keep = _keeping()
        if keep and any(x.requires_grad and _wrapped(x) for x in xs):
            raise _autograd_in_func()
        # (x's leaves and the tangents plain real tensors: a complex jvp, and a DTensor's, are forward mode's)
        if self.reverse_jvp and not keep and all(type(v) is torch.Tensor and not v.is_complex() for v in (*xs, *txs)):
            versions = [x._version for x in xs]
            stack = _CALLS.keep
            # (f's output is differentiated twice here: a derivative f takes itself, as a
            # SecondOrder's inner engine does, must keep its graph, as under forward mode's duals)
            stack.append(True)
            try:
                with torch.enable_grad():
                    leaves = _requiring_grad(xs)  # (sharing the guard's copies' version counters)
                    out, aux = fn(leaves)
            finally:
                del stack[-1]
            if type(out) is tuple:  # (the closed function's output leaves)
                try:
                    primal, tangent = _pushed_by_pullbacks(out, leaves, txs, leaves, versions)
                except _NoSecondPass:  # (f cannot be differentiated twice: forward mode, f once more)
                    pass
                else:
                    return primal, _detached(aux, False), tangent
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
        if not self.functional and len(batch) > 1:
            return _one_draw(super().value_and_pushforwards, fn, xs, batch)
        if len(batch) < 2 or _any_dtensor(xs):
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

        with _forward_locked():
            out, touts = func.vmap(pushed, out_dims=(None, 0))(stacked)  # type: ignore[arg-type]  # (a prefix tree)
        return out, found[-1], [optree.tree_map(lambda t, k=k: t[k], touts) for k in range(len(batch))]

    def pullbacks(self, vjp: Callable[[Any], Leaves], xs: Leaves, batch: Any) -> list[Leaves]:
        if not self.functional or len(batch) < 2 or _any_dtensor(xs) or not getattr(vjp, "batchable", True):
            return super().pullbacks(vjp, xs, batch)  # (one by one: see _FuncPullback.batchable)
        stacked = optree.tree_map(lambda *ts: torch.stack(ts), batch[0], *batch[1:])
        try:
            grads = func.vmap(vjp)(stacked)  # one program for the whole batch
        except RuntimeError as exc:  # (an operation vmap has no rule for: one by one)
            if _NO_BATCHING_RULE not in str(exc):
                raise
            return super().pullbacks(vjp, xs, batch)
        return [tuple(g[k] for g in grads) for k in range(len(batch))]

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        if self.functional:  # (fn as an argument of torch.func's transforms made once, see _GRAD_AND_VALUE)
            one = len(xs) == 1  # (on the tensor itself: less pytree work for torch.func)
            if getattr(fn, "has_aux", True):  # (as _for_func decides)
                target, rebuild = _tensor_aux(fn)
                transform = _GRAD_AND_VALUE_WITH_AUX_AT_ONE if one else _GRAD_AND_VALUE_WITH_AUX
                grads, (value, aux) = transform(xs[0] if one else xs, target)
                aux = rebuild(aux)
            else:
                transform = _GRAD_AND_VALUE_AT_ONE if one else _GRAD_AND_VALUE
                (grads, value), aux = transform(xs[0] if one else xs, fn), None
            if one:
                grads = (grads,) if type(grads) is torch.Tensor else _placed((grads,), xs)
                return value, aux, _materialised(grads)
            return value, aux, _materialised(_placed(grads, xs))
        if not torch.is_grad_enabled():  # entering enable_grad costs more than asking
            with torch.enable_grad():
                return self.value_and_gradient(fn, xs)
        stack = _CALLS.keep
        keep = stack[-1] if stack else False  # (_keeping(), inlined: this is the hot path)
        if len(xs) == 1 and not xs[0].requires_grad and _forward_ad._current_level < 0:  # the common case
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
        for found in grads:  # (a loop, not a generator: this runs on every call)
            if found is not None:
                break
        else:  # no gradient reached x
            _refuse_hidden_cut(fn, xs)
        grads = _whole(grads, inputs)
        return value, aux, grads  # results are detached as they are converted, if returned

    def value_and_jacobian(self, fn: Fn, xs: Leaves, mode: str | None = None) -> tuple[Any, Any, Blocks]:
        if _any_dtensor(xs):
            raise _dense_of_dtensors("A Jacobian")
        if not self.functional:
            return self._vectorised_jacobian(fn, xs, mode)
        if all(x.numel() for x in xs):  # (torch.func.jacfwd fails on empty inputs: the rows one by one)
            try:
                return self._jacobian_by_transform(fn, xs, mode)
            except (_BatchedWrongly, RuntimeError) as exc:
                if _EMPTY_OUTPUT in str(exc):  # torch.func.vjp refuses an output with no tensor: no rows
                    out, aux = fn(xs)
                    return out, aux, ()
                # _BatchedWrongly, or an operation vmap has no rule for (a complex conjugate's view
                # inside an outer transform): the rows one by one, f evaluated again
                if isinstance(exc, RuntimeError) and _NO_BATCHING_RULE not in str(exc):
                    raise
        return super().value_and_jacobian(fn, xs, mode)

    def _vectorised_jacobian(self, fn: Fn, xs: Leaves, mode: str | None) -> tuple[Any, Any, Blocks]:
        """Autograd mode's Jacobian in reverse mode: ``torch.func.jacrev``'s one vmapped program
        (of torch's vectorised ways the quickest: ``torch.autograd.functional.jacobian`` with
        ``vectorize=True`` batches only the backward pass, and took many times as long). Where
        f does not allow it (``.item()`` on a tensor, an operation without a batching rule, whose
        slow fallback torch warns about, a torch.autograd.Function without ``setup_context``),
        inside an outer call (the Jacobian keeps a graph) and for empty leaves, the rows one by
        one, a backward pass each; columns by forward mode where ``mode`` is ``"forward"``."""
        if mode == "forward" or _keeping() or _forward_ad._current_level >= 0 or any(x.numel() == 0 for x in xs):
            return super().value_and_jacobian(fn, xs, mode)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # (torch's slow fallback for an operation without a batching rule)
                found = self._jacobian_by_transform(fn, xs, "reverse")
        except (RuntimeError, Warning, _BatchedWrongly):  # (f's own errors come again from the rows)
            return super().value_and_jacobian(fn, xs, mode)
        if not any(bool(block.any()) for row in found[2] for block in row):  # (as the rows' backward passes refuse)
            points = tuple(x.detach() for x in xs)
            _refuse_a_read_of_x_itself(lambda: fn(points)[0], points)
        return found

    def _jacobian_by_transform(self, fn: Fn, xs: Leaves, mode: str | None) -> tuple[Any, Any, Blocks]:
        """``torch.func.jacrev`` (``jacfwd`` where ``mode`` is ``"forward"``) of ``fn``."""
        forward = mode == "forward"
        transform = func.jacfwd if forward else func.jacrev
        lock = _forward_locked()  # (warmed for jacrev too: the caller's own forward mode then warns of nothing)
        with lock if forward else contextlib.nullcontext():
            return _jacobian_by(lambda g, p: transform(g, has_aux=True)(p), fn, xs, not forward)

    # -- second order by double backward (autograd mode) ---------------------------------------

    def gradient_and_hvp(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Leaves, Leaves]:
        if self.functional:
            return super().gradient_and_hvp(fn, xs, txs)
        value, aux, grads, (hvps,) = self.gradient_and_hvps(fn, xs, [txs])
        return value, aux, grads, hvps

    def gradient_and_hvps(self, fn: Fn, xs: Leaves, batch: Any) -> tuple[Any, Any, Leaves, list[Leaves]]:
        """torch.func: one vmapped program (``_base``); autograd mode: f and its gradient's graph
        once, then the gradient's pullback along each tangent through that graph (torch.autograd.grad's
        grad_outputs, not the gradient of <grad, t>: no extra products and sums in the graph)."""
        if self.functional:
            return super().gradient_and_hvps(fn, xs, batch)
        keep = _keeping()
        with torch.enable_grad():
            inputs = _requiring_grad(xs)
            value, aux = fn(inputs)
            grads = _grad(_if_graph(value), inputs, create_graph=True, unreached=lambda: _refuse_hidden_cut(fn, xs))
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
            grads = _grad(_if_graph(value), inputs, create_graph=True, unreached=lambda: _refuse_hidden_cut(fn, xs))
            blocks = []
            for g, x in zip(grads, xs, strict=True):
                rows = [_grad(_if_graph(entry), inputs, create_graph=keep) for entry in g.reshape(-1)]
                blocks.append(
                    tuple(_stacked([row[j] for row in rows], (*x.shape, *xj.shape), xj) for j, xj in enumerate(xs))
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
            for y in out if isinstance(out, tuple) else (out,):
                firsts = [_grad(_if_graph(entry), inputs, create_graph=True)[0] for entry in y.reshape(-1)]
                lasts = [_grad(_if_graph(d), inputs, create_graph=keep)[0] for d in firsts]
                derivs.append(_detached(_stacked(firsts, y.shape, y), keep))
                seconds.append(_stacked(lasts, y.shape, y))
        return _detached(out, keep), _detached(aux, keep), tuple(derivs), tuple(seconds)


def _as_tangent_of(tangent: Any, primal: Any) -> Any:
    """A tangent from torch.func.jvp in its primal's dtype, an ordinary tensor (:func:`_materialised`)."""
    return _materialised((tangent.to(primal.dtype) if tangent.dtype != primal.dtype else tangent,))[0]


def _tensor_copy(array: Any) -> Any:
    """A tensor of a C-ordered copy of ``array`` in native byte order: f may not reach the
    caller's array through it, and torch takes no negative strides nor a big-endian array."""
    return torch.from_numpy(np.array(array, dtype=_arrays.native_dtype(array.dtype), order="C"))


_EMPTY_OUTPUT = "non-empty output"
"""torch.func.vjp's refusal of an f whose output holds no tensor."""
_NO_BATCHING_RULE = "Batching rule not implemented"


def _one_draw(
    pushforwards: Callable[..., tuple[Any, Any, list[Any]]], fn: Fn, xs: Leaves, batch: Any
) -> tuple[Any, Any, list[Any]]:
    """Autograd mode's batch of jvps, f evaluated once per tangent, each from the state torch's
    global random generators had before the first: the products of one draw (dropout's one mask),
    linear in the tangent and the value's own, where each evaluation drew anew (the products of
    t and 2 t were not a multiple of each other). The generators end as one evaluation leaves them."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    first = True

    def from_one_draw(fn_xs: Leaves) -> Any:
        nonlocal first
        if not first:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
        first = False
        return fn(fn_xs)

    return pushforwards(from_one_draw, xs, batch)
