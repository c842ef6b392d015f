"""The torch contract, stated once: the guard around every call (the caller's modes, the graph kept
or not, the copies f gets and the version counters that see a write into x or a Constant), and
the MutationError that names the leaf written.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad
from torch.overrides import TorchFunctionMode

from ... import tree as _tree
from ..._contexts import held
from ..._errors import ContextError, DiffifaceError, MutationError
from ..._families.torch import CALLS as _CALLS
from ..._families.torch import ModuleParts, module_parts
from ..._families.torch import inside_a_call as inside_a_call
from ..._families.torch import restructured as _restructured
from .._base import Leaves, ProgramParts
from ._dtensor import _refuse_fully_sharded
from ._duals import _dual_parts
from ._explain import _FIX, _LEAF_WRITE, _TANGENT_WRITE, _CapturedWrite, torch_refusal


def _keeping() -> bool:
    """Whether the innermost open call keeps its graph (its inputs carried an outer one)."""
    stack = _CALLS.keep
    return stack[-1] if stack else False


# -- the guard: process state, nesting, writes into the inputs --------------------------------


def _wrapped(x: Any) -> bool:
    """Whether ``x`` is a tensor of a torch.func transform (such tensors have no storage)."""
    try:
        x.data_ptr()
    except RuntimeError:
        return True
    return False


def _guard(
    program: Callable[..., Any], functional: bool, create_graph: bool, parts: ProgramParts
) -> Callable[..., Any]:
    """``program`` run so that the caller's state and arrays come out as they went in.

    - Under the caller's ``inference_mode`` it runs with inference mode off (nothing is recorded
      in inference mode). Grad mode is set by each method where it needs it. Both are restored on
      the way out, also on errors, and also where f itself switched grad mode and left it switched.
    - Results keep their graph where the caller asks for it (``create_graph``), under torch.func
      (its semantics), where an outer diffiface call differentiates f, or where x carries the
      caller's forward-mode tangent (:func:`_keeps`); else they are detached, as
      ``torch.autograd.grad``'s are, and a Cache tensor f's write put in the graph is detached in
      place (:func:`_cut_caches`).
    - What f may write: one rule for x and every Constant, tensor or module, stated in
      docs/policies.md ("In-place f"): copies on a prep's first call (a write undone and named),
      version counters on later calls (a write named, not undone). Copied on every call besides:
      the tangents (a write into one changes the derivative itself), inference and expanded
      tensors (below), and the buffers of submodules in training mode (:class:`_Watch`).

    The common call (one x, no tangent, one Constant tensor or none) takes no Python call
    besides ``program``'s: this runs on every call, and its cost is the library's overhead.
    """
    cache_dynamic = parts.cache_dynamic
    cache_static = parts.cache_static
    names = _Names(parts)
    # which dynamic context leaves are Constants (watched), not Caches (f's scratch space)
    constant_at = tuple(i for i, cache in enumerate(cache_dynamic) if not cache)
    # (and which are Caches, cut from the call's graph after it: in autograd mode, where f's write
    # lands; torch.func refuses it)
    cache_at = () if functional else tuple(i for i, cache in enumerate(cache_dynamic) if cache)
    # (and which static ones are Caches, whose modules' and objects' tensors are cut as well; under
    # torch.func, a tensor of its transform f bound there is unwrapped)
    cache_static_at = tuple(i for i, cache in enumerate(cache_static) if cache)
    watch_static = not all(cache_static)  # a Constant static leaf may be a torch.nn.Module
    autograd = not functional  # (an inference tensor: copied on every call in autograd mode only)
    asked = functional or create_graph
    first = [True]  # no call of this prep has completed yet: a Constant module's tensors are copied

    def guarded(xs: Leaves, ts: Leaves, dynamic: Leaves, static: Any) -> Any:
        if torch.is_inference_mode_enabled():
            # (recording off, as the caller asked: the call runs as under no_grad, whose results
            # keep no graph, and each method turns grad mode on where its engine needs it)
            with torch.inference_mode(False), torch.no_grad():
                return guarded(xs, ts, dynamic, static)
        # (asked for, or under torch.func's semantics, the graph is kept whatever carries it:
        # x, a Constant's tensor that requires grad, a tangent; else only where x needs it;
        # under the caller's no_grad, none is recorded)
        keep = asked and torch.is_grad_enabled()
        nested = bool(_CALLS.keep) or _transform_level() is not None
        copy = first[0]
        given, given_dynamic = xs, dynamic  # (the caller's: compared with f's copies after a first call)
        if len(xs) == 1:
            x = xs[0]
            if not keep and (nested or x.requires_grad or _forward_ad._current_level >= 0):
                keep = nested or _keeps(x)
            # (a clone of an inference tensor is a normal one; an expanded tensor's elements share
            # memory, which forward mode and torch.func's writes refuse: both copied on every call)
            if copy or x.is_inference() or (x.layout is _STRIDED and 0 in x.stride()):
                x = x.clone() if keep or not x.requires_grad else x.detach().clone()
            elif x.requires_grad and not keep:
                x = x.detach()
            xs = (x,)
            versions = [x._version]  # (a fresh clone's counter starts at 0; read, not assumed)
        else:
            keep = keep or nested  # (asked for and recording, or nested: kept whatever x carries, as one x's)
            if not keep:
                for x in xs:
                    if (x.requires_grad or _forward_ad._current_level >= 0) and _keeps(x):
                        keep = True
                        break
            if not keep:
                xs = tuple(map(torch.Tensor.detach, xs))
            copy_x = copy
            for x in xs:  # (a loop, not a generator: this runs on every call)
                if x.is_inference() or (x.layout is _STRIDED and 0 in x.stride()):  # (as one x's)
                    copy_x = True
            if copy_x:
                xs = tuple(map(_clone, xs))  # (map, not a comprehension: no frame on the hot path)
            versions = list(map(_version, xs))
        if ts:
            ts = tuple(map(_clone, ts))
            tangent_versions = list(map(_version, ts))
        loose = _loose_caches(dynamic, cache_at) if cache_at and dynamic else None
        tidy = not nested if functional else not keep  # (the Cache modules' tensors: :func:`_cut_held`)
        bound = _held_caches(static, cache_static_at) if cache_static_at and static is not None and tidy else None
        constants: list[tuple[int, Any, int]] = []
        if dynamic and constant_at:
            dynamic, constants = _watched_constants(dynamic, constant_at, copy, autograd)
        modules = _module_states(static, cache_static, copy) if static is not None and watch_static else None
        stack = _CALLS.keep
        stack.append(keep)
        grad_mode = torch.is_grad_enabled()  # f may switch it (torch.set_grad_enabled) and not switch back
        try:
            result = program(xs, ts, dynamic, static)
        except BaseException as exc:
            if loose and not keep:
                _cut_caches(loose, names)  # (a view among them: f's own failure is the one raised)
            if bound:
                _cut_held(bound, names, autograd)
            watched = (xs, given, versions, constants, given_dynamic, modules, names, copy)
            _refuse_failure(exc, stack, grad_mode, watched, lambda: program(xs, ts, dynamic, static))
            raise
        stack.pop()
        if torch.is_grad_enabled() is not grad_mode:
            torch.set_grad_enabled(grad_mode)
        if not keep:  # (a call that keeps no graph gives its results as torch.autograd.grad does)
            result = _out_of_graph(result)
        cut = _cut_caches(loose, names) if loose and not keep else None
        if bound:
            cut = _first(cut, _cut_held(bound, names, autograd))
        # (as the fused calls read them: map, in C, costs less than a loop on every call)
        dirty = list(map(_version, xs)) != versions or (modules is not None and modules.changed())
        for _, tensor, version in constants:
            dirty = dirty or tensor._version != version
        if dirty or copy:
            _refuse_writes(dirty, (xs, given, versions, constants, given_dynamic, modules, names, copy))
        first[0] = False
        if ts and list(map(_version, ts)) != tangent_versions:
            raise MutationError(_TANGENT_WRITE)
        if cut is not None:  # (a Cache that is a view, left in the graph: after f's other writes are named)
            raise cut
        return result

    return guarded


def _out_of_graph(result: Any) -> Any:
    """A program's results with each tensor that carries a graph detached, in the same tuples
    and lists (the very object where none carries one)."""
    if isinstance(result, torch.Tensor):
        return result.detach() if result.requires_grad else result
    if type(result) is tuple or type(result) is list:
        parts = [_out_of_graph(part) for part in result]
        for new, old in zip(parts, result, strict=True):
            if new is not old:
                return type(result)(parts)
    return result


def _keeps(x: Any) -> bool:
    """Whether a call on ``x`` (which requires grad, or a dual level is open), outside any other
    differentiation and with no graph asked for, keeps the graph x carries: where x is a dual of
    the caller's forward mode (a detached result drops its tangent) or a tensor of a torch.func
    transform; else the results are detached, as ``torch.autograd.grad``'s. (Inside an outer
    diffiface call or a torch.func transform every call keeps its graph, whatever x carries:
    the outer one differentiates through this one, also through a tensor f closes over, and a
    detached result would read as a zero derivative.)"""
    if x.is_inference():
        return False
    if x.requires_grad and not torch.is_grad_enabled():  # (a graph only in a torch.func transform)
        return _wrapped(x)
    return (_forward_ad._current_level >= 0 and _dual_parts(x)[1] is not None) or (x.requires_grad and _wrapped(x))


class _Names:
    """The paths of a program's leaves (``x['w']``, ``contexts[0][1]``), read where an error
    names one."""

    __slots__ = ("dynamic", "static", "x")

    def __init__(self, parts: ProgramParts) -> None:
        self.x: tuple[str, ...] = parts.x_names
        self.dynamic: tuple[str, ...] = parts.names_dynamic
        self.static: tuple[str, ...] = parts.names_static

    def of_x(self, i: int, count: int) -> str:
        if i < len(self.x):
            return self.x[i]
        return f"leaf {i} of x" if count > 1 else "x"

    def of_dynamic(self, i: int) -> str:
        return self.dynamic[i] if i < len(self.dynamic) else f"array context leaf {i}"

    def of_static(self, i: int) -> str:
        return self.static[i] if i < len(self.static) else f"context leaf {i}"


_clone = torch.Tensor.clone
# the innermost torch.func transform open (grad, jvp, vmap), or None: a call inside one keeps its graph
_transform_level = torch._C._functorch.peek_interpreter_stack
_version = operator.attrgetter("_version")
_requires_grad = operator.attrgetter("requires_grad")
_requiring = torch.Tensor.requires_grad_
_STRIDED = torch.strided


def _watched_constants(
    dynamic: Leaves, constant_at: tuple[int, ...], copy: bool, autograd: bool
) -> tuple[Leaves, list[tuple[int, Any, int]]]:
    """The dynamic context leaves for f, and (index, tensor, its version) for each Constant
    tensor, to see a write by: where ``copy`` (a prep's first call, in both modes, see
    :func:`_guard`), a copy of each in its place; else the caller's own, watched by its counter.
    In ``autograd`` mode an inference tensor is always copied (it cannot be saved for the
    backward pass); under torch.func, which refuses any write into it, it is passed as it is and
    not watched."""
    fresh: list[Any] | None = None  # (a new tuple only where a leaf is replaced by its copy)
    constants = []
    for i in constant_at:
        if i >= len(dynamic):  # (only the leaves this call has)
            break
        value = dynamic[i]
        if isinstance(value, torch.Tensor):
            if copy or value.is_inference():
                if not (copy or autograd):  # (torch.func refuses any write into it outside inference mode)
                    continue
                if fresh is None:
                    fresh = list(dynamic)
                fresh[i] = value = value.clone()
            constants.append((i, value, value._version))
    return dynamic if fresh is None else tuple(fresh), constants


def _loose_caches(dynamic: Leaves, cache_at: tuple[int, ...]) -> list[tuple[int, Any]]:
    """(index, tensor) of each Cache tensor among the dynamic context leaves that carries no
    graph before f runs, for :func:`_cut_caches` after it (one that requires grad is the
    caller's: left as it is)."""
    return [
        (i, dynamic[i])
        for i in cache_at
        if i < len(dynamic) and isinstance(dynamic[i], torch.Tensor) and not dynamic[i].requires_grad
    ]


def _cut_caches(caches: list[tuple[int, Any]], names: _Names) -> ContextError | None:
    """Each Cache tensor of :func:`_loose_caches` that f's write of a value it computed from x
    attached to the call's graph (``cache.copy_(h)``, ``cache[:] = h``), detached in place, in a
    call that keeps no graph: it holds what f wrote, and the caller's tensor keeps neither the
    graph's memory nor a graph a later use would differentiate through. torch cannot detach a
    view in place (its base would give it its graph back): for one, the ContextError the call
    raises once its checks of f's other writes are done (None where there is none)."""
    refusal = None
    for i, tensor in caches:
        if tensor.requires_grad:  # (each one cut, whatever the ones before it were)
            found = _cut(tensor, f"{names.of_dynamic(i)}, a di.Cache tensor")
            refusal = refusal or found
    return refusal


def _cut(tensor: Any, where: str) -> ContextError | None:
    """``tensor``, a Cache's, detached in place; None, or for a view, which torch cannot detach
    in place (its base would give it its graph back), the ContextError that names ``where``."""
    if not tensor._is_view():
        tensor.detach_()
        return None
    return ContextError(
        f"f wrote a value computed from x into {where}, a view of another tensor (such as buffer[:n]): "
        "torch made it part of this call's graph and cannot detach a view in place, so it would keep that "
        "graph, and its memory, alive after the call. Give the Cache a tensor that owns its memory (the whole "
        "buffer, or buffer[:n].clone()) and take the view inside f."
    )


def _first(refusal: ContextError | None, other: ContextError | None) -> ContextError | None:
    """The refusal a call raises: the first of two, where either is one."""
    return other if refusal is None else refusal


_Bound = list[tuple[int, dict[str, Any], dict[str, Any], set[str]]]


def _held_caches(static: Any, cache_static_at: tuple[int, ...]) -> _Bound:
    """Where the Cache static leaves (``cache_static_at``) hold tensors, for :func:`_cut_held`
    after f runs: each torch.nn.Module among them, its submodules, a plain object and the modules
    it holds, as (the dict that binds their names to tensors: a module's parameters, buffers and
    attributes, an object's attributes; a copy of it as it was before f ran; the names bound to a
    tensor that carried a graph then, the caller's)."""
    holders: list[tuple[int, Any]] = []
    leaves = static.leaves
    for i in cache_static_at:
        if i >= len(leaves):
            break
        value = leaves[i]
        if isinstance(value, torch.nn.Module):
            holders.extend((i, module) for module in value.modules())
        elif type(getattr(value, "__dict__", None)) is dict and not isinstance(value, type):
            holders.append((i, value))
            for module in held(value, _is_module):
                if isinstance(module, torch.nn.Module):
                    holders.extend((i, inner) for inner in module.modules())
    bound = []
    for i, holder in holders:
        places = (holder._parameters, holder._buffers, holder.__dict__) if _is_module(holder) else (holder.__dict__,)
        for place in places:
            graphed = {k for k, v in place.items() if isinstance(v, torch.Tensor) and v.requires_grad}
            bound.append((i, place, dict(place), graphed))
    return bound


def _cut_held(bound: _Bound, names: _Names, autograd: bool) -> ContextError | None:
    """:func:`_cut_caches` for the tensors a Cache's module or plain object holds (its parameters
    that require no grad, its buffers, its tensor attributes): each one that carried no graph
    before f ran and carries one now, detached in place, and each that f bound in place of another
    (``module.h = h``, ``register_buffer``, or inside a tuple or list f bound, an LSTM's
    ``(h, c)``) carrying a graph, bound again to its ``detach()`` (an ``nn.Parameter`` of the
    caller's, bound by f, is left as it is: :func:`_bound_again`). Under torch.func
    (``autograd`` False), whose graph a call keeps, only a tensor of its transform f bound there,
    dead once the call is over, is bound again to the tensor it wraps."""
    refusal = None
    for i, place, before, graphed in bound:
        for key, tensor in list(place.items()):
            if autograd and isinstance(tensor, (tuple, list)) and before.get(key) is not tensor:
                # (a tuple or list f bound there, an LSTM's state (h, c): each tensor as one bound alone)
                if any(_bound_again(leaf) is not leaf for leaf in _tree.leaves(tensor)):
                    place[key] = _tree.map(_bound_again, tensor)
                continue
            if isinstance(tensor, torch.Tensor) and _is_wrapped(tensor) and before.get(key) is not tensor:
                place[key] = tensor = _unwrapped(tensor)
            if not autograd or not (isinstance(tensor, torch.Tensor) and tensor.requires_grad):
                continue
            if before.get(key) is not tensor:
                place[key] = _bound_again(tensor)
            elif key not in graphed:
                found = _cut(tensor, f"the tensor {key!r} that {names.of_static(i)}, a di.Cache, holds")
                refusal = refusal or found
    return refusal


def _bound_again(value: Any) -> Any:
    """What a Cache holds in place of a value f bound there: a tensor that carries a graph, its
    ``detach()`` (f's values); an ``nn.Parameter`` of the caller's, or any other value, itself."""
    if isinstance(value, torch.Tensor) and value.requires_grad and not isinstance(value, torch.nn.Parameter):
        return value.detach()
    return value


_Watched = tuple[Leaves, Leaves, list[int], list[tuple[int, Any, int]], Leaves, "_Watch | None", "_Names", bool]
"""What a call watches for f's writes: the leaves f got for x, the caller's x (``given``), their
version counters, each Constant tensor f got with its index and counter, the caller's dynamic
context leaves, the Constant modules' watch, the names, and whether f got copies (a prep's
first call)."""


def _refuse_failure(
    exc: BaseException, stack: list[bool], grad_mode: bool, watched: _Watched, rerun: Callable[[], Any]
) -> None:
    """After f or the engine raised ``exc`` inside the guard: the caller's state put back (the
    call's stack entry, grad mode), and the error the caller gets instead of ``exc`` raised
    from it (where none, the caller raises ``exc`` itself): the MutationError that names a write
    f made (seen by a counter; on a prep's first call, through ``.data`` into f's copies;
    refused by torch.func, found by ``rerun``, the call once more), or the
    UnsupportedOperationError for an operation torch refused."""
    xs, given, versions, constants, given_dynamic, modules, names, copy = watched
    stack.pop()
    if torch.is_grad_enabled() is not grad_mode:
        torch.set_grad_enabled(grad_mode)
    problem = _mutation(xs, versions, constants, modules, names, copy)
    if problem is None and isinstance(exc, RuntimeError) and _LEAF_WRITE in str(exc):
        # torch refused a write into the leaf f got for x (refused before writing)
        where = names.of_x(0, 1) if len(xs) == 1 else "x"
        problem = f"f wrote in place into its input {where}; torch refused it. {_FIX}"
    if problem is not None:
        raise MutationError(problem) from exc
    refusal: DiffifaceError | None = torch_refusal(exc)
    if refusal is None and copy and isinstance(exc, Exception):  # (f failed after a write through .data)
        problem = _unseen_write(xs, given, constants, given_dynamic, names)
        refusal = None if problem is None else MutationError(problem)
    if refusal is None and type(exc) is _CapturedWrite:
        refusal = _named_capture(rerun, constants, modules, names)
    if refusal is not None:
        raise refusal from exc


def _refuse_writes(dirty: bool, watched: _Watched) -> None:
    """After f returned: the MutationError naming a write f made, seen by a counter (``dirty``)
    or, on a prep's first call, through ``.data`` into f's copies, which no counter sees."""
    xs, given, versions, constants, given_dynamic, modules, names, copy = watched
    problem = _mutation(xs, versions, constants, modules, names, copy) if dirty else None
    if problem is None and copy:
        problem = _unseen_write(xs, given, constants, given_dynamic, names)
    if problem is not None:
        raise MutationError(problem)


def _module_states(static: Any, cache_static: tuple[bool, ...], full: bool) -> _Watch | None:
    """The watch over the Constant ``torch.nn.Module`` s (and the modules an object in a Constant
    holds, a trainer's model) among the static leaves; None where there is none."""
    roots: list[tuple[int, Any]] = []
    for index, (value, cache) in enumerate(zip(static.leaves, cache_static, strict=False)):
        if cache:
            continue
        if isinstance(value, torch.nn.Module):
            roots.append((index, value))
        elif hasattr(value, "__dict__"):  # (an object holding modules: a trainer's model)
            roots.extend((index, module) for module in held(value, _is_module))
    if not roots:
        return None
    for _, module in roots:
        _refuse_fully_sharded(module)
    return _Watch(roots, full)


def _is_module(value: object) -> bool:
    return isinstance(value, torch.nn.Module)


class _Watch:
    """Every parameter and buffer of the Constant modules ``roots`` ((index among the static
    leaves, module)), over one call: their version counters, and copies that put back what f
    wrote.

    ``full`` (a prep's first call): a copy of every tensor. Else a copy of the buffers of
    submodules in training mode only (the guard's rule, :func:`_guard`), so that a frozen
    backbone costs its counters per call, not its size. Which tensor is which (its module, its
    name) is found only where an error names one (:meth:`named`).

    Every call also keeps each module's structure (its parameters, buffers and submodules, its
    train or eval mode), which f may change by setting an attribute (``model[0].weight =
    nn.Parameter(...)``, ``model.train()``): put back and refused (:meth:`restructured`). The
    walk visits every module anyway; what it keeps per module is a few references."""

    __slots__ = ("copies", "roots", "structure", "tensors", "versions")

    def __init__(self, roots: list[tuple[int, Any]], full: bool) -> None:
        self.roots = roots
        self.tensors: list[Any] = []
        self.copies: list[tuple[Any, Any]] = []
        self.structure: list[ModuleParts] = []
        for _, module in roots:
            self._walk(module, full)
        self.versions = list(map(_version, self.tensors))

    def _walk(self, module: Any, full: bool) -> None:
        self.structure.append(module_parts(module))
        tensors = self.tensors
        for tensor in module._parameters.values():
            if tensor is not None and not tensor.is_inference():  # (torch refuses writes into those)
                tensors.append(tensor)
                if full:
                    self.copies.append((tensor, tensor.detach().clone()))
        training = module.training
        for tensor in module._buffers.values():
            if tensor is not None and not tensor.is_inference():
                tensors.append(tensor)
                if training or full:
                    self.copies.append((tensor, tensor.detach().clone()))
        for child in module._modules.values():
            if child is not None:
                self._walk(child, full)

    def restructured(self) -> bool:
        """Whether f changed a module's structure or mode, each put back."""
        return _restructured(self.structure)

    def changed(self) -> bool:
        """Whether a tensor may have been written (a counter moved, or a copy is to compare), or a
        module's structure or mode changed."""
        if self.copies or list(map(_version, self.tensors)) != self.versions:
            return True
        for module, training, parameters, buffers, modules in self.structure:  # (a loop: every call)
            if module.training is not training:
                return True
            for current, kept in (
                (module._parameters, parameters),
                (module._buffers, buffers),
                (module._modules, modules),
            ):
                if len(current) != len(kept):
                    return True
                for key, value in kept.items():
                    if current.get(key) is not value:
                        return True
        return False

    def named(self) -> dict[int, tuple[Any, int, str, str]]:
        """Each watched tensor, by ``id``: (the tensor, the index of its Constant, ``"parameter"``
        or ``"buffer"``, its name as the root's ``named_parameters()`` gives it)."""
        names: dict[int, tuple[Any, int, str, str]] = {}
        for index, root in self.roots:
            for what, pairs in (("parameter", root.named_parameters), ("buffer", root.named_buffers)):
                for name, tensor in pairs(remove_duplicate=False):
                    names.setdefault(id(tensor), (tensor, index, what, name))
        return names

    def written(self) -> tuple[int, str, str, bool] | None:
        """The first tensor f wrote into, as (index of its Constant, what, name, whether it was
        put back); every tensor written that has a copy is put back. None where f wrote none."""
        copies = {id(tensor): copy for tensor, copy in self.copies}
        first = None
        for tensor, version in zip(self.tensors, self.versions, strict=True):
            copy = copies.get(id(tensor))
            if tensor._version != version or (copy is not None and not _same_bits(tensor, copy)):
                if first is None:
                    first = (tensor, copy is not None)
                if copy is not None:
                    with torch.no_grad():
                        tensor.copy_(copy)
        if first is None:
            return None
        # (a tensor f also took out of its module is named by the first Constant module)
        _, index, what, name = self.named().get(id(first[0]), (None, self.roots[0][0], "parameter", "(removed by f)"))
        return index, what, name, first[1]


def _mutation(
    xs: Leaves,
    versions: list[int],
    constants: list[tuple[int, Any, int]],
    modules: _Watch | None,
    names: _Names,
    copied: bool,
) -> str | None:
    """What f wrote into, named by its path, restored where a copy was kept; None if it wrote
    nothing. ``copied``: the leaves f got for x and the Constant tensors were copies (a prep's
    first call)."""
    # (first: a module's copies and structure are put back whatever else f wrote)
    changed = modules.written() if modules is not None and modules.changed() else None
    if modules is not None and modules.restructured():
        where = names.of_static(modules.roots[0][0])
        change = (
            f"f changed the torch.nn.Module {where}, a di.Constant: it set a parameter, a buffer or a "
            "submodule, or its train or eval mode; that change has been put back."
        )
        if changed is not None:  # (a BatchNorm f switched to train mode wrote its buffers: named as any write)
            return f"{change} {_module_write(changed, names)}"
        return f"{change} A Constant is read-only: pass what f changes as x or through has_aux. {_FIX}"
    for i, (x, version) in enumerate(zip(xs, versions, strict=True)):
        if x._version != version:
            state = "the caller's x and tangent are unchanged" if copied else _LANDED_X
            return f"f wrote in place into its input {names.of_x(i, len(xs))}; {state}. {_FIX}"
    for i, tensor, version in constants:
        if tensor._version != version:
            where = names.of_dynamic(i)
            state = "the caller's tensor is unchanged (f wrote into a copy)" if copied else _LANDED_TENSOR
            return f"f wrote in place into {where}, a tensor of a di.Constant; {state}. A Constant is read-only: {_FIX}"
    return None if changed is None else _module_write(changed, names)


def _module_write(changed: tuple[int, str, str, bool], names: _Names) -> str:
    """The words for f's write into a Constant module's parameter or buffer (:meth:`_Watch.written`):
    put back where a copy was kept, else left in the caller's module, as the message says."""
    index, what, name, restored = changed
    where = names.of_static(index)
    state = _PUT_BACK if restored else _LANDED
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


def _unseen_write(
    xs: Leaves, given: Leaves, constants: list[tuple[int, Any, int]], given_dynamic: Leaves, names: _Names
) -> str | None:
    """On a prep's first call, where f got copies of x's leaves (``xs``, of the caller's
    ``given``) and of the Constant tensors: the write no version counter saw (through ``.data``),
    told by a copy's bits that differ from the caller's tensor, named; None where f wrote none.
    The caller's tensors are untouched (f wrote into its copies), but f computed at the values
    it wrote, not at the caller's: its derivative would be another point's. A first call only:
    later calls copy nothing, and such a write is not seen there (docs/policies.md)."""
    for i, (x, original) in enumerate(zip(xs, given, strict=True)):
        if x is not original and _differs(x, original):
            where = names.of_x(i, len(xs))
            return f"f wrote in place into its input {where} (through .data); the caller's x is unchanged. {_FIX}"
    for i, tensor, _ in constants:
        original = given_dynamic[i]
        if tensor is not original and _differs(tensor, original):
            where = names.of_dynamic(i)
            return (
                f"f wrote in place into {where}, a tensor of a di.Constant (through .data); the caller's tensor "
                f"is unchanged (f wrote into a copy). A Constant is read-only: {_FIX}"
            )
    return None


def _differs(copy: Any, original: Any) -> bool:
    """Whether f's ``copy`` of a strided tensor no longer holds ``original``'s bits (a layout or
    subclass whose bits are not compared here: False)."""
    if not (isinstance(original, torch.Tensor) and original.layout is _STRIDED and copy.layout is _STRIDED):
        return False
    if copy.shape != original.shape or copy.dtype != original.dtype or _wrapped(copy) or _wrapped(original):
        return False
    with torch.no_grad():
        return not _same_bits(copy.detach(), original.detach())


def _same_bits(tensor: Any, copy: Any) -> bool:
    """Whether ``tensor`` holds its ``copy``'s bits (a NaN equals itself: a module holding one
    is not taken for written). Each is read as bytes of its values in order: a strided view
    (``buffer[::2]``, a column of a matrix) and a conjugate or negative view (``z.conj()``) are
    made plain first, which torch's view as bytes refuses to take as they are."""
    if (tensor.is_floating_point() or tensor.is_complex()) and type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return torch.equal(_bytes(tensor), _bytes(copy))
    return torch.equal(tensor, copy)


def _bytes(tensor: Any) -> Any:
    """``tensor``'s values as one row of bytes (a copy only where it is not plain and contiguous;
    an empty tensor, whose strides may be 0, which torch's view as bytes refuses, holds none)."""
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


_PUT_BACK = "it has been put back, bit for bit"
_LATER = (
    "a prep's first call copies (and undoes a write into) x and the Constants; its later calls watch their "
    "version counters, which see a write but cannot undo it (nor see one through .data)"
)
_LANDED_X = f"the caller's x now holds what f wrote: {_LATER}"
_LANDED_TENSOR = f"the caller's tensor now holds what f wrote: {_LATER}"
_LANDED = f"the caller's module now holds what f wrote: {_LATER}"

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
    ``x.add_``, an in-place operator, an ``out=``) into one of the ``watched`` tensors ((tensor,
    what it is, as an error names it)): into the tensor itself, or into another on its memory
    (its ``.data``, a ``detach()`` or a view of it)."""

    def __init__(self, watched: list[tuple[Any, str]]) -> None:
        super().__init__()
        self.watched = {id(tensor): where for tensor, where in watched}
        self.memory = {_memory(tensor): where for tensor, where in reversed(watched) if tensor.numel()}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        targets = list(_tree.leaves(kwargs.get("out")))
        if args and ((name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_OPERATORS):
            targets.append(args[0])
        for target in targets:
            where = self.watched.get(id(target))
            if where is None and isinstance(target, torch.Tensor) and target.numel():
                where = self.memory.get(_memory(target))
            if where is not None:
                raise _Found(where)
        return func(*args, **kwargs)


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _unwrapped(tensor: Any) -> Any:
    """The tensor a torch.func transform's tensor wraps, level by level; any other value itself."""
    while isinstance(tensor, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


def _memory(tensor: Any) -> int | None:
    """Where a tensor's storage begins (under a torch.func transform, that of the tensor it
    wraps: a ``detach()`` of a tensor f closes over is one); None where it has none."""
    try:
        return int(_unwrapped(tensor).untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def _named_capture(
    rerun: Callable[[], Any],
    constants: list[tuple[int, Any, int]],
    modules: _Watch | None,
    names: _Names,
) -> MutationError | None:
    """Where torch.func refused a write by f into a tensor it closes over (before the write, so
    nothing was written), the MutationError that names the leaf: f is run once more, as the call
    ran it, and stopped at its first in-place operation into a Constant's tensor or a Constant
    module's parameter or buffer. None where it does not reach one (a global; or f takes
    another path on its second run): torch.func's own refusal stands."""
    watched = [(tensor, f"{names.of_dynamic(i)}, a tensor of a di.Constant") for i, tensor, _ in constants]
    for tensor, index, what, name in (modules.named() if modules is not None else {}).values():
        watched.append((tensor, f"the {what} {name!r} of the torch.nn.Module {names.of_static(index)}, a di.Constant"))
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
