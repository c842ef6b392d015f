"""torch, in two modes that take different code paths and so can check each other.

- ``mode="autograd"``: reverse mode by ``torch.autograd.grad`` on detached copies of the
  inputs (no ``.grad`` is ever written, no ``requires_grad`` flag of the caller's tensors
  changes), forward mode by ``torch.autograd.forward_ad`` dual tensors, second order by
  double backward.
- ``mode="func"``: ``torch.func.vjp``, ``jvp``, ``grad_and_value``, ``jacrev``/``jacfwd``;
  second order forward-over-reverse.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import torch
import torch.autograd.forward_ad as forward_ad
from torch import func

from .. import _arrays
from .. import tree as _tree
from . import _base
from ._base import Blocks, Fn, Leaves

# torch scripts its forward-mode decompositions on the first make_dual, warning that
# torch.jit.script is deprecated: torch's own business, which must not reach f's caller
# (an error under -W error). Load them once here, with that one warning silenced.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=DeprecationWarning)
    getattr(forward_ad, "_maybe_load_decompositions", lambda: None)()


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


class Adapter(_base.Adapter):
    xp = _Namespace

    def __init__(self, backend: Any, info: Any) -> None:
        super().__init__(backend, info)
        self.functional = backend.mode == "func"

    def to_native(self, leaf: Any) -> Any:
        kind = _arrays.kind(leaf)
        if kind == "python":
            return torch.tensor(leaf, dtype=torch.float64)
        if kind == "numpy":
            return torch.tensor(leaf)  # a copy: x stays the caller's
        return leaf

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        if isinstance(leaf, np.ndarray):
            device = like.device if isinstance(like, torch.Tensor) else None
            tensor = torch.from_numpy(leaf) if leaf.flags.writeable else torch.tensor(leaf)
            return tensor.to(device) if device is not None else tensor, True
        return leaf, isinstance(leaf, torch.Tensor)

    def output_leaf(self, leaf: Any, like: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf
        dtype = like.dtype if isinstance(like, torch.Tensor) else None
        return torch.as_tensor(np.asarray(leaf) if _arrays.kind(leaf) == "numpy" else leaf, dtype=dtype)

    def explain_failure(self, exc: BaseException) -> str | None:
        text = str(exc)
        if "numpy()" in text and "requires grad" in text:
            return (
                "f turned a tensor that requires grad into a numpy array (a numpy function or "
                ".numpy() on its input). Write f with torch operations, or differentiate a numpy f "
                "with AutoFiniteDifferences()."
            )
        if isinstance(exc, TypeError) and ("jax" in text.lower() or "JAX" in text):
            return "f calls jax on torch tensors; differentiate a jax function with AutoJAX()."
        return None

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
                return out, rebuild(aux), lambda touts: (pullback(touts)[0],)
            return out, rebuild(aux), lambda touts: pullback(touts)[0]
        with torch.enable_grad():
            inputs = _requiring_grad(xs)
            out, aux = fn(inputs)

        def vjp(touts: Any) -> Leaves:
            pairs = [(y, t) for y, t in zip(_leaves(out), _leaves(touts), strict=True) if y.requires_grad]
            return _grad([y for y, _ in pairs], inputs, [t for _, t in pairs])

        return _detached(out), _detached(aux), vjp

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
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
        with forward_ad.dual_level():
            duals = tuple(forward_ad.make_dual(x.detach(), t) for x, t in zip(xs, txs, strict=True))
            out, aux = fn(duals)
            primal = _tree.map(_primal, out)
            tangent = _tree.map(_tangent, out)
            aux = _tree.map(_primal, aux)
        return primal, aux, tangent

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        if self.functional:
            g, has_aux, rebuild = _for_func(fn, xs)
            if has_aux:
                grads, (value, aux) = func.grad_and_value(g, has_aux=True)(xs[0] if len(xs) == 1 else xs)
            else:
                (grads, value), aux = func.grad_and_value(g)(xs[0] if len(xs) == 1 else xs), None
            return value, rebuild(aux), (grads,) if len(xs) == 1 else grads
        if not torch.is_grad_enabled():  # entering enable_grad costs more than asking
            with torch.enable_grad():
                return self.value_and_gradient(fn, xs)
        inputs = _requiring_grad(xs)
        value, aux = fn(inputs)
        grads = _grad([value] if value.requires_grad else [], inputs, retain=False)
        return value, aux, grads  # results are detached as they are converted, if they are returned

    def value_and_jacobian(self, fn: Fn, xs: Leaves, mode: str | None = None) -> tuple[Any, Any, Blocks]:
        if not self.functional or any(x.numel() == 0 for x in xs):  # torch.func.jacfwd fails on empty inputs
            return super().value_and_jacobian(fn, xs, mode)
        transform = func.jacfwd if mode == "forward" else func.jacrev
        tensor_fn, rebuild = _tensor_aux(fn)

        def with_value(xs_: Leaves) -> tuple[Any, Any]:
            out, aux = tensor_fn(xs_)
            one = type(out) is tuple and len(out) == 1  # one output tensor, differentiated bare
            return out[0] if one else out, (out, aux)

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
        with torch.enable_grad():
            inputs = _requiring_grad(xs)
            value, aux = fn(inputs)
            grads = _grad(_if_graph(value), inputs, create_graph=True)
            # the gradient's pullback along txs (torch.autograd.grad's grad_outputs), not the
            # gradient of <grad, txs>: no extra products and sums in the graph
            pairs = [(g, t) for g, t in zip(grads, txs, strict=True) if g.requires_grad]
            hvps = _grad([g for g, _ in pairs], inputs, [t for _, t in pairs])
        return value.detach(), _detached(aux), _detached(grads), hvps

    def value_gradient_and_hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves, Blocks]:
        if self.functional:
            return super().value_gradient_and_hessian(fn, xs)
        with torch.enable_grad():
            inputs = _requiring_grad(xs)
            value, aux = fn(inputs)
            grads = _grad(_if_graph(value), inputs, create_graph=True)
            blocks = []
            for g, x in zip(grads, xs, strict=True):
                rows = [_grad(_if_graph(entry), inputs) for entry in g.reshape(-1)]
                blocks.append(
                    tuple(
                        torch.stack([row[j] for row in rows]).reshape((*x.shape, *xj.shape))
                        if rows
                        else torch.zeros((*x.shape, *xj.shape), dtype=xj.dtype)
                        for j, xj in enumerate(xs)
                    )
                )
        return value.detach(), _detached(aux), _detached(grads), tuple(blocks)

    def value_derivative_and_second_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
        if self.functional:
            return super().value_derivative_and_second_derivative(fn, xs)
        with torch.enable_grad():
            inputs = _requiring_grad(xs)
            out, aux = fn(inputs)
            derivs, seconds = [], []
            for y in _leaves(out):
                firsts = [_grad(_if_graph(entry), inputs, create_graph=True)[0] for entry in y.reshape(-1)]
                lasts = [_grad(_if_graph(d), inputs)[0] for d in firsts]
                derivs.append(_stacked(firsts, y).detach())
                seconds.append(_stacked(lasts, y))
        return _detached(out), _detached(aux), tuple(derivs), tuple(seconds)


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


def _requiring_grad(xs: Leaves) -> Leaves:
    """Fresh leaves of the graph: the caller's tensors and their flags stay as they are."""
    if len(xs) == 1:
        return (xs[0].detach().requires_grad_(True),)
    return tuple(x.detach().requires_grad_(True) for x in xs)


def _if_graph(value: Any) -> list[Any]:
    """``[value]`` if it depends on the inputs, else ``[]`` (its derivative is zero)."""
    return [value] if value.requires_grad else []


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
    if len(grads) == 1 and grads[0] is not None:
        return grads  # type: ignore[no-any-return]
    return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True))


def _stacked(entries: list[Any], like: Any) -> Any:
    return torch.stack(entries).reshape(like.shape) if entries else torch.zeros_like(like)


def _leaves(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def _detached(tree: Any) -> Any:
    if tree is None:
        return None
    if type(tree) is tuple and len(tree) == 1 and isinstance(tree[0], torch.Tensor):
        return (tree[0].detach(),)  # the common case of one output tensor
    return _tree.map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, tree)


def _primal(value: Any) -> Any:
    return forward_ad.unpack_dual(value).primal if isinstance(value, torch.Tensor) else value


def _tangent(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    primal, tangent = forward_ad.unpack_dual(value)
    return torch.zeros_like(primal) if tangent is None else tangent
