"""The quick match of a prepared call (:attr:`Prep.fast`): a few type, shape and dtype
comparisons in front of the most direct way the prep can run, ``MISS`` where they do not
settle it.

Two routes, by the prepared call's shape: where x, the tangent and every context value are
one leaf each, :func:`_matcher` compares them and calls the program on them as they are;
otherwise (pytrees: a tuple of weights, a params dict, a batch as a dict) :func:`_tree_matcher`
flattens each argument once, compares its structure and leaves with the prep's, and runs the
prep on the leaves. Either way, no signature is built."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import optree

from . import _arrays, _placement
from ._call import _ARRAY_KINDS, _LEAF, Call, Operator, _is_static, _static_x_key
from ._prep import MISS, FunctionRef
from .tree import NAMESPACE

# -- the quick match of a prepared call --------------------------------------------------------


def _fast_path(
    op: Operator,
    function: FunctionRef,
    call: Call,
    estimates: bool,
    direct_ok: bool,
    flat: Callable[..., Any] | None,
    finished: list[bool],
    finish_rest: Callable[[Any], Any],
    compiled: Callable[..., Any],
    finish: Callable[[Any], Any],
    runner: Callable[..., Any],
    precision: Callable[[], Any] | None = None,
) -> Callable[..., Any]:
    """:attr:`Prep.fast`: the quick match in front of the most direct way this prep can run.
    ``precision``: the adapter's scope where a float64 call may need one (jax's x64 when it is
    off); the direct route is taken where it gives none, the runner, which enters it, otherwise."""
    with_tangent = bool(call.tangent_leaves)
    if estimates:  # the error estimate goes to the prep that runs: through Prep.run
        return _miss
    then: Callable[..., Any]
    if flat is not None and finished[0]:  # the program's result is the call's
        then = flat
    elif flat is not None:
        compiled_flat = flat

        def then(*arrays: Any) -> Any:
            out = compiled_flat(*arrays)
            return out if finished[0] else finish_rest(out)

    elif direct_ok:  # the engine takes the arguments as they are: straight to the program

        def then(x: Any, *rest: Any) -> Any:
            if with_tangent:
                return finish(compiled((x,), rest[:1], rest[1:], None))
            return finish(compiled((x,), (), rest, None))

    def converted(x: Any, *rest: Any) -> Any:
        tangents = [rest[0]] if with_tangent else []
        return runner([x], tangents, [[value] for value in rest[len(tangents) :]])[0]

    if not (flat is not None or direct_ok):
        then = converted
    elif precision is not None:
        direct = then

        def then(*arguments: Any) -> Any:
            if precision() is None:
                return direct(*arguments)
            return converted(*arguments)

    match = _matcher(op, function, call, then)
    if match is not _miss:
        return match

    def leaves(x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]) -> Any:
        return runner(x_leaves, tangent_leaves, context_leaves)[0]

    return _tree_matcher(op, function, call, leaves)


def _same_as(leaf: Any) -> tuple[type, Callable[[Any], bool] | None]:
    """How a quick match knows a leaf like ``leaf``: its type, and for an array a test of shape
    and dtype (and device), which reads a jax array's shape and dtype from its abstract value
    at a quarter of the cost of its properties. None: the type says all (not an array)."""
    kind = _arrays.kind(leaf)
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)

    def same_jax(value: Any) -> bool:
        aval = value.aval
        if aval.shape != shape or aval.dtype != dtype:
            return False
        # (results are laid out as x: another layout is another prep; a traced x's is the trace's)
        return layout is None or layout.holds(value)

    def same_numpy(value: Any) -> bool:
        return value.shape == shape and value.dtype == dtype  # type: ignore[no-any-return]

    def same_torch(value: Any) -> bool:
        return value.shape == shape and value.dtype == dtype and value.device == device  # type: ignore[no-any-return]

    if kind == "torch":
        device = leaf.device
        return type(leaf), same_torch
    concrete = kind == "jax" and not isinstance(leaf, sys.modules["jax"].core.Tracer)
    layout = _placement.Layout(leaf.sharding) if concrete else None
    return type(leaf), {"jax": same_jax, "numpy": same_numpy}.get(kind)


def _miss(*args: Any) -> Any:
    return MISS


def _matcher(op: Operator, function: FunctionRef, call: Call, then: Callable[..., Any]) -> Callable[..., Any]:
    """:attr:`Prep.fast` for the common case of one leaf each (x, the tangent, every context):
    ``then(x, [tangent,] *context_values)`` if a few types, shapes and dtypes show that the
    call has the prep's signature; ``MISS`` otherwise, to leave the decision to the full
    signature."""
    sig = call.signature
    one_leaf = sig.x_spec == _LEAF and _arrays.kind(call.x_leaves[0]) in _ARRAY_KINDS | {"python"}
    if op.tangent is not None:
        one_leaf = one_leaf and sig.tangent_spec == _LEAF and _arrays.kind(call.tangent_leaves[0]) != "other"
    if not one_leaf or any(spec != _LEAF for spec in call.context_specs):
        return _miss
    backend, has_aux, ref, name = sig.backend, sig.has_aux, function.ref, op.name
    x_cls, x_same = _same_as(call.x_leaves[0])
    with_tangent = op.tangent is not None
    t_cls, t_same = _same_as(call.tangent_leaves[0]) if with_tangent else (type(None), None)
    kinds = tuple(spec[0] for spec in sig.contexts)
    sames = tuple(_same_as(leaves[0]) for leaves in call.context_leaves)
    count = len(kinds)
    first_kind, (first_cls, first_same) = (kinds[0], sames[0]) if count else (None, (None, None))
    # Hot code: no comprehensions, generators or zip(strict=True) (the lengths are compared
    # first), each of which costs more than all the checks once an engine's work has evicted
    # this code from the processor's caches.

    def match(
        operator: str, f: Any, backend_: Any, x: Any, tangent: Any, contexts: tuple[Any, ...], has_aux_: bool
    ) -> Any:
        if (
            operator != name
            or (ref() is not f and not function.matches(f))
            or (backend_ is not backend and backend_ != backend)
            or has_aux_ != has_aux
            or len(contexts) != count
            or type(x) is not x_cls
            or (x_same is not None and not x_same(x))
        ):
            return MISS
        if with_tangent and (type(tangent) is not t_cls or (t_same is not None and not t_same(tangent))):
            return MISS
        if count == 0:
            return then(x, tangent) if with_tangent else then(x)
        if count == 1:  # the common case of one context, without a loop
            context = contexts[0]
            if type(context) is not first_kind:
                return MISS
            value = context.value
            if type(value) is not first_cls or (first_same is not None and not first_same(value)):
                return MISS
            return then(x, tangent, value) if with_tangent else then(x, value)
        values = [tangent] if with_tangent else []
        for context, kind, (cls, same) in zip(contexts, kinds, sames, strict=False):
            if type(context) is not kind:
                return MISS
            value = context.value
            if type(value) is not cls or (same is not None and not same(value)):
                return MISS
            values.append(value)
        return then(x, *values)

    return match


def _leaf_test(leaf: Any, static_x: bool = False) -> tuple[type, Callable[[Any], bool] | None] | None:
    """:func:`_same_as` for any leaf of a tree; a static leaf of x (passed to f as it is, and
    prepared for its value) is compared by :func:`~diffiface._call.static_key`. None: a leaf
    the quick match cannot vouch for (a pytree only jax knows)."""
    if static_x and _is_static(leaf):
        key = _static_x_key(leaf)
        return type(leaf), lambda value: _static_x_key(value) == key
    if _arrays.kind(leaf) == "other":
        return None
    return _same_as(leaf)


def _tree_matcher(op: Operator, function: FunctionRef, call: Call, then: Callable[..., Any]) -> Callable[..., Any]:
    """:attr:`Prep.fast` for pytrees: ``then(x_leaves, tangent_leaves, context_leaves)`` where
    one flatten of each argument gives the prep's structures (compared in C++) and each leaf
    has its prepared type, shape and dtype (and device); ``MISS`` otherwise. A tree holding a
    class only jax knows so far is not flattened as the full path does: it misses, and the
    full path adopts the class."""
    sig = call.signature
    x_spec, t_spec = sig.x_spec, sig.tangent_spec
    if hasattr(call, "rebuild"):  # a view of x without its static leaves: _prepare matches the whole call
        return _miss
    tests: list[Any] = [_leaf_test(leaf, static_x=True) for leaf in call.x_leaves]
    t_tests: list[Any] = [_leaf_test(leaf) for leaf in call.tangent_leaves]
    c_tests: list[list[Any]] = [[_leaf_test(leaf) for leaf in leaves] for leaves in call.context_leaves]
    if any(t is None for t in tests + t_tests) or any(t is None for ts in c_tests for t in ts):
        return _miss
    x_checks = tuple(tests)
    t_checks = tuple(t_tests)
    kinds = tuple(spec[0] for spec in sig.contexts)
    contexts_checked = tuple(zip(kinds, call.context_specs, [tuple(ts) for ts in c_tests], strict=True))
    count = len(kinds)
    backend, has_aux, ref, name = sig.backend, sig.has_aux, function.ref, op.name
    with_tangent = op.tangent is not None
    flatten = optree.tree_flatten

    def same(leaves: list[Any], checks: tuple[Any, ...]) -> bool:
        if len(leaves) != len(checks):
            return False
        for leaf, (cls, test) in zip(leaves, checks, strict=False):
            if type(leaf) is not cls or (test is not None and not test(leaf)):
                return False
        return True

    def match(
        operator: str, f: Any, backend_: Any, x: Any, tangent: Any, contexts: tuple[Any, ...], has_aux_: bool
    ) -> Any:
        if (
            operator != name
            or (ref() is not f and not function.matches(f))
            or (backend_ is not backend and backend_ != backend)
            or has_aux_ != has_aux
            or len(contexts) != count
        ):
            return MISS
        leaves, spec = flatten(x, namespace=NAMESPACE)
        if spec != x_spec or not same(leaves, x_checks):
            return MISS
        tangent_leaves: list[Any] = []
        if with_tangent:
            tangent_leaves, spec = flatten(tangent, namespace=NAMESPACE)
            if spec != t_spec or not same(tangent_leaves, t_checks):
                return MISS
        context_leaves = []
        for context, (kind, c_spec, checks) in zip(contexts, contexts_checked, strict=False):
            if type(context) is not kind:
                return MISS
            c_leaves, spec = flatten(context.value, namespace=NAMESPACE)
            if spec != c_spec or not same(c_leaves, checks):
                return MISS
            context_leaves.append(c_leaves)
        return then(leaves, tangent_leaves, context_leaves)

    return match
