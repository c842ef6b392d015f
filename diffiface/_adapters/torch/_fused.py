"""The guard's steps, the program's and the engine's in one Python call, for the commonest
computations where ``benchmarks/torch_fused.py`` keeps it (:class:`_Gradient`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import func

from ..._errors import MutationError
from ..._families.torch import CALLS as _CALLS
from .._base import Fn, Leaves
from ._dtensor import _cotangents, _placed
from ._duals import (
    _FORWARD_LOCK,
    _FORWARD_WARMED,
    _close_dual_level,
    _made_duals,
    _open_dual_level,
    _unpacked,
    _warm_forward,
)
from ._engine import (
    _backward,
    _detached,
    _grad,
    _if_graph,
    _NoSecondPass,
    _pushed_by_pullbacks,
    _refuse_hidden_cut,
    _whole,
)
from ._explain import _TANGENT_WRITE
from ._guard import (
    _STRIDED,
    _clone,
    _cut_caches,
    _cut_held,
    _first,
    _held_caches,
    _loose_caches,
    _module_states,
    _Names,
    _refuse_failure,
    _refuse_writes,
    _requires_grad,
    _requiring,
    _transform_level,
    _version,
    _watched_constants,
)


class _Gradient:
    """The guard, the program and the engine's gradient of a gradient call, in one call.

    It serves the common call: grad mode on, inference mode off, no dual level open (ours, the
    caller's or torch.func's), no leaf of x carrying an outer graph (and, under torch.func,
    every leaf of x a plain tensor: a DTensor's gradient is laid out again). It does what
    :func:`_guard` and the program do for it, in their order: x's leaves, the Constant tensors
    and the Constant modules' tensors as the guard's rule gives them to f, f on them, f's output
    checked (a scalar of a type and dtype seen before takes no more checks; any other output,
    the program's own checks, ``settle``), the gradient, and the version counters read, a write
    refused with a MutationError. Any other call is ``guarded``'s, before anything has run.

    The gradient is ``torch.autograd.grad`` on those leaves made leaves of a fresh graph. The
    other fused calls share these steps and put their own engine (:meth:`engine`) in place of
    the gradient's.

    A fused call is kept only where ``benchmarks/torch_fused.py`` (pinned, interleaved against
    the guard's steps on the same prepared call) shows it more than 5% quicker: the calls in
    ``_FUSED``. torch.func's gradient and Jacobian, which it did not show so, take the guard's
    steps."""

    __slots__ = (
        "cache_at",
        "cache_held_at",
        "cache_static",
        "checked",
        "constant_at",
        "first",
        "functional",
        "fused",
        "guarded",
        "names",
        "plain",
    )

    def __init__(self, guarded: Callable[..., Any], fused: Any, parts: Any, functional: bool) -> None:
        self.guarded = guarded
        self.fused = fused
        self.checked = fused.checked
        self.constant_at = tuple(i for i, cache in enumerate(parts.cache_dynamic) if not cache)
        # (the Caches, cut from the call's graph after it, as the guard's rule says: autograd mode only)
        self.cache_at = () if functional else tuple(i for i, cache in enumerate(parts.cache_dynamic) if cache)
        self.cache_held_at = tuple(i for i, cache in enumerate(parts.cache_static) if cache)
        # (None: no static context leaf is a Constant, which may be a torch.nn.Module)
        self.cache_static = None if all(parts.cache_static) else parts.cache_static
        self.names = _Names(parts)
        self.functional = functional
        self.first = True  # no call has completed yet: f gets copies (see the guard's rule)
        # x's leaves (and the tangents) must be plain tensors (a DTensor's results are laid out
        # again), and f gets them plain; else leaves of a fresh graph (autograd's reverse mode)
        self.plain = functional or fused.compute == "value_and_pushforward"

    def __call__(self, xs: Leaves, ts: Leaves, dynamic: Leaves, static: Any) -> Any:
        if (
            _forward_ad._current_level >= 0  # (x may be a dual: its tangent kept, the guard's steps)
            or _CALLS.keep  # (inside an outer call or torch.func transform: the guard keeps the graph)
            or _transform_level() is not None
            or not torch.is_grad_enabled()
            or torch.is_inference_mode_enabled()
            or not xs
            or (self.plain and (set(map(type, xs)) != _PLAIN or (ts and set(map(type, ts)) != _PLAIN)))
        ):
            return self.guarded(xs, ts, dynamic, static)
        copy = self.first  # (the guard's rule: copies on a prep's first call, counters after it)
        if any(map(_requires_grad, xs)):  # (an nn.Parameter: its results detached, as torch.autograd.grad's)
            if self.functional:  # (torch.func's semantics: the graph kept)
                return self.guarded(xs, ts, dynamic, static)
            if copy or self.plain:  # (else the leaves below are detached aliases already)
                xs = tuple(map(torch.Tensor.detach, xs))
        if self.plain:
            if copy:
                inputs = tuple(map(_clone, xs))
            else:
                for x in xs:  # (a loop: on every call; an inference or an expanded leaf: the guard's copies)
                    if x.is_inference() or (x.layout is _STRIDED and 0 in x.stride()):
                        return self.guarded(xs, ts, dynamic, static)
                inputs = xs
        else:
            try:  # (a leaf that does not share x's graph: of a clone, or an alias of x itself)
                inputs = tuple(map(_requiring, map(_clone if copy else _detach, xs)))
            except RuntimeError:  # an inference tensor, or one of a torch.func transform: the guard's steps
                return self.guarded(xs, ts, dynamic, static)
        versions = list(map(_version, inputs))
        constants: list[tuple[int, Any, int]] = []
        given_dynamic = dynamic  # (the caller's: compared with f's copies after a first call)
        loose = _loose_caches(dynamic, self.cache_at) if self.cache_at and dynamic else None
        if dynamic and self.constant_at:
            dynamic, constants = _watched_constants(dynamic, self.constant_at, copy, not self.functional)
        fused = self.fused
        modules = None
        rebuilds = fused.rebuilds
        bound = None
        if static is not None:
            context_values = fused.contexts(dynamic, static)
            if self.cache_held_at:  # (a Cache module or object: its tensors cut after f, as the guard's)
                bound = _held_caches(static, self.cache_held_at)
            if self.cache_static is not None:
                modules = _module_states(static, self.cache_static, copy)
        elif rebuilds is None:
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
            if loose:
                _cut_caches(loose, self.names)  # (a view among them: f's own failure is the one raised)
            if bound:
                _cut_held(bound, self.names, not self.functional)
            watched = (inputs, xs, versions, constants, given_dynamic, modules, self.names, copy)
            _refuse_failure(exc, stack, True, watched, lambda: self.engine(inputs, xs, ts, f, context_values))
            raise
        stack.pop()
        # (a fused call keeps no graph: f's writes into its Caches cut from it, as the guard's)
        cut = _cut_caches(loose, self.names) if loose else None
        if bound:
            cut = _first(cut, _cut_held(bound, self.names, not self.functional))
        if not torch.is_grad_enabled():  # f switched it off (torch.set_grad_enabled) and did not switch back
            torch.set_grad_enabled(True)
        dirty = list(map(_version, inputs)) != versions or (modules is not None and modules.changed())
        for _, tensor, version in constants:  # (a loop, not a generator: this runs on every call)
            dirty = dirty or tensor._version != version
        if dirty or copy:
            _refuse_writes(dirty, (inputs, xs, versions, constants, given_dynamic, modules, self.names, copy))
        self.first = False
        if cut is not None:  # (a Cache that is a view, left in the graph: after f's other writes are named)
            raise cut
        return result

    def engine(self, inputs: Leaves, xs: Leaves, ts: Leaves, f: Callable[..., Any], context_values: Leaves) -> Any:
        """The engine's part of the call on ``inputs``, x's leaves ``xs`` as f gets them: the
        program's results, ``(gradient,)`` or ``(value, gradient)``."""
        fused = self.fused
        try:
            value = f(inputs[0] if fused.single else fused.rebuild(inputs), *context_values)
        except Exception as exc:
            fused.adapter.refuse_failure(exc)
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
            grads = torch.autograd.grad((value,), inputs, allow_unused=True)
            if set(map(type, grads)) != _PLAIN or any(map(_is_zero, grads)):  # (tests in C: on every call)
                if all(g is None for g in grads):  # no gradient reached x
                    _refuse_hidden_cut(fused.close(f, context_values, xs[0]), xs)
                grads = _whole(grads, inputs)  # (a None, a DTensor, a ZeroTensor)
        else:
            grads = _grad([], inputs)
        # (a fused call keeps no graph: f's value out of it; grads carry none without create_graph)
        return (value.detach(), grads) if fused.value else (grads,)


class _Pullback(_Gradient):
    """:class:`_Gradient`'s one call for a vjp: f closed and checked by the program's own
    ``close``, the cotangent checked against its output (``cotangent``), and the backward pass
    with the cotangent: one ``torch.autograd.grad``, or in torch.func mode the pullback of
    ``torch.func.vjp`` of the closed f (no closures made on every call, as the adapter's are)."""

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
        ts = fused.cotangent(ts)
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
            # (torch.func's semantics: what carries a Constant's or the cotangent's graph keeps it)
            return (out, grads) if fused.value else (grads,)
        grads = _backward(outs, touts, inputs, unreached=lambda: _refuse_hidden_cut(closed, xs))
        return (_detached(out, False), grads) if fused.value else (grads,)


class _Pushforward(_Gradient):
    """:class:`_Gradient`'s one call for a jvp in autograd mode: the same guard's steps around
    the engine's product, computed one of two ways, as ``AutoTorch(jvp=...)`` says (with
    ``"auto"``, the prep's first call chooses, see :meth:`choose`; every later call computes it
    as the chosen one does):

    - forward mode (:meth:`forward`): copies of the tangents made duals of x's leaves as f
      gets them in a dual level of ours, f closed and checked by the program's own ``close``, each
      output's primal and tangent unpacked once, and the tangents' version counters read (a
      write into one changes the derivative itself, and is refused);
    - reverse over reverse (:meth:`by_pullbacks`), as ``torch.autograd.functional.jvp``
      computes it: torch's forward mode builds, for each operation between a dual tensor and a
      plain one, a zero tangent whose shape a Python meta kernel computes, so that on a small
      function two backward passes may cost less.

    Every leaf of x and of the tangent must be a plain tensor; any other call is ``guarded``'s,
    before anything has run."""

    __slots__ = ("reverse",)

    def __init__(self, guarded: Callable[..., Any], fused: Any, parts: Any, functional: bool) -> None:
        super().__init__(guarded, fused, parts, functional)
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
        """The product by forward mode on ``inputs``, x's leaves as f gets them."""
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
            raise MutationError(_TANGENT_WRITE)
        # (a fused call keeps no graph: out of it, what carries a Constant's that requires grad)
        outs = tuple(map(torch.Tensor.detach, outs))
        return (tuple(map(torch.Tensor.detach, primals)), outs) if fused.value else (outs,)

    def by_pullbacks(
        self, inputs: Leaves, xs: Leaves, ts: Leaves, f: Callable[..., Any], context_values: Leaves
    ) -> Any:
        """The product by reverse over reverse on ``inputs``, x's leaves as f gets them: f on them
        made leaves of a fresh graph, then :func:`_pushed_by_pullbacks` (:class:`_NoSecondPass`
        where torch cannot differentiate the pullback)."""
        fused = self.fused
        versions = list(map(_version, inputs))
        leaves = tuple(map(_requiring, map(_detach, inputs)))  # (aliases: the caller's flags stay as they are)
        out, _ = fused.close(f, context_values, xs[0])(leaves)
        primals, outs = _pushed_by_pullbacks(out, leaves, ts, inputs, versions)
        return (primals, outs) if fused.value else (outs,)

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
    """:class:`_Gradient`'s one call for an hvp in autograd mode: f closed and checked by the
    program's own ``close``, its gradient with its graph, and that gradient's pullback along
    copies of the tangents (double backward)."""

    __slots__ = ()

    def engine(self, inputs: Leaves, xs: Leaves, ts: Leaves, f: Callable[..., Any], context_values: Leaves) -> Any:
        closed = self.fused.close(f, context_values, xs[0])
        value, _ = closed(inputs)
        grads = _grad(_if_graph(value), inputs, create_graph=True, unreached=lambda: _refuse_hidden_cut(closed, xs))
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


_detach = torch.Tensor.detach
_is_zero = torch.Tensor._is_zerotensor
_PLAIN = {torch.Tensor}
"""The type of a plain tensor, as a set: the types of x's leaves compared with it in C."""
