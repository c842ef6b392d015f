"""The machinery behind the public operators of ``_operators``: validate, normalise, prepare or reuse, run.

Data flows one way: arguments are flattened and their signature taken; a prep is checked
(or found in the cache, or made); the adapter works on native arrays inside a program
(compiled where the engine compiles); results are converted to mirror the inputs.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree

from . import _arrays
from . import tree as _tree
from ._adapters import adapter_for, info, normalize
from ._adapters._base import Adapter, force
from ._backends import Backend, SecondOrder
from ._contexts import Cache, Constant, Context
from ._errors import (
    ArrayTypeError,
    ContextError,
    FrameworkMismatchError,
    InvalidInputError,
    InvalidOutputError,
    TangentMismatchError,
)
from ._prep import MISS, FunctionRef, Prep, Signature, describe_mismatch, mismatch_error, prep_cache


@dataclass(frozen=True)
class Operator:
    """How one public operator is computed and what it returns.

    ``compute`` names the adapter method; ``parts`` picks ``(index, kind)`` pieces of its
    result, where kind says what the piece mirrors: ``value`` (a scalar), ``y`` (the output
    of f), ``dy`` (a derivative shaped as f's output), ``x``, ``jacobian`` (y-structure of
    x-structure), ``hessian`` (x of x). The dtype of ``dy``, ``jacobian`` and ``hessian``
    pieces is that of the pair of leaves they relate, promoted (:func:`promoted_dtype`).
    """

    name: str
    compute: str
    parts: tuple[tuple[int, str], ...]
    tangent: str | None = None
    scalar_output: bool = False
    scalar_input: bool = False
    aux: bool = False


_OPERATORS = (
    Operator("derivative", "value_and_derivative", ((2, "dy"),), scalar_input=True),
    Operator("value_and_derivative", "value_and_derivative", ((0, "y"), (2, "dy")), scalar_input=True),
    Operator("second_derivative", "value_derivative_and_second_derivative", ((3, "dy"),), scalar_input=True),
    Operator(
        "value_derivative_and_second_derivative",
        "value_derivative_and_second_derivative",
        ((0, "y"), (2, "dy"), (3, "dy")),
        scalar_input=True,
    ),
    Operator("gradient", "value_and_gradient", ((2, "x"),), scalar_output=True),
    Operator("value_and_gradient", "value_and_gradient", ((0, "value"), (2, "x")), scalar_output=True, aux=True),
    Operator("jacobian", "value_and_jacobian", ((2, "jacobian"),)),
    Operator("value_and_jacobian", "value_and_jacobian", ((0, "y"), (2, "jacobian"))),
    Operator("hessian", "value_gradient_and_hessian", ((3, "hessian"),), scalar_output=True),
    Operator(
        "value_gradient_and_hessian",
        "value_gradient_and_hessian",
        ((0, "value"), (2, "x"), (3, "hessian")),
        scalar_output=True,
    ),
    Operator("jvp", "value_and_pushforward", ((2, "y"),), tangent="x"),
    Operator("value_and_jvp", "value_and_pushforward", ((0, "y"), (2, "y")), tangent="x", aux=True),
    Operator("vjp", "value_and_pullback", ((2, "x"),), tangent="y"),
    Operator("value_and_vjp", "value_and_pullback", ((0, "y"), (2, "x")), tangent="y", aux=True),
    Operator("hvp", "gradient_and_hvp", ((3, "x"),), tangent="x", scalar_output=True),
    Operator("gradient_and_hvp", "gradient_and_hvp", ((2, "x"), (3, "x")), tangent="x", scalar_output=True),
)
OPERATORS: dict[str, Operator] = {op.name: op for op in _OPERATORS}


# -- a call: flattened arguments and their signature ------------------------------------------

_LEAF = _tree.structure(0)  # type: ignore[arg-type]  # a leaf's structure
_ARRAY_KINDS = frozenset({"numpy", "torch", "jax"})
_OUTPUT_LEAF_KINDS = _ARRAY_KINDS | {"autograd"}  # autograd's traced arrays are leaves too


class Call:
    """The flattened arguments of one call, and the signature a prep is matched against."""

    __slots__ = ("context_leaves", "context_specs", "signature", "tangent_leaves", "x_leaves")

    def __init__(
        self, op: Operator, backend: Backend, x: Any, tangent: Any, contexts: tuple[Any, ...], has_aux: bool
    ) -> None:
        leaf_signature = _arrays.leaf_signature
        if isinstance(x, Context):
            raise _misplaced_context(op, "x", x)
        if op.tangent is not None and isinstance(tangent, Context):
            raise _misplaced_context(op, "tangent" if op.tangent == "x" else "cotangent", tangent)
        if _arrays.kind(x) in _ARRAY_KINDS:  # one array: no tree to flatten
            self.x_leaves, x_spec = [x], _LEAF
            x_signature: tuple[Any, ...] = (leaf_signature(x),)
        else:
            self.x_leaves, x_spec = _tree.flatten(x)
            x_signature = _x_signature(self.x_leaves)
        if op.tangent is None:
            self.tangent_leaves: list[Any] = []
            t_spec = None
        else:
            self.tangent_leaves, t_spec = _tree.flatten(tangent)
        context_signature = []
        self.context_leaves = []
        self.context_specs = []
        for i, context in enumerate(contexts):
            if not isinstance(context, Context):
                raise _bare_argument(op, i, context)
            leaves, spec = _tree.flatten(context.value)
            self.context_leaves.append(leaves)
            self.context_specs.append(spec)
            context_signature.append(
                (
                    type(context),
                    spec,
                    tuple(
                        leaf_signature(leaf) if _arrays.is_array(leaf) else ("static", type(leaf)) for leaf in leaves
                    ),
                )
            )
        self.signature = Signature(
            op.name,
            backend,
            has_aux,
            x_spec,
            x_signature,
            t_spec,
            tuple(leaf_signature(leaf) for leaf in self.tangent_leaves),
            tuple(context_signature),
        )


def _x_signature(leaves: list[Any]) -> tuple[Any, ...]:
    """The signatures of x's leaves. A static leaf (:func:`_is_static`) is passed to f as it is,
    so a prep is made for its value: it is known by :func:`static_key`, or by identity (the prep
    holds it, so that identity is not reused)."""
    leaf_signature = _arrays.leaf_signature
    signature = tuple([leaf_signature(leaf) for leaf in leaves])
    for entry in signature:  # the common case, all arrays and floats: nothing more to do
        if entry[0] == "other" or (entry[0] == "python" and entry[1] is not float):
            return tuple(
                ("static", type(leaf), _static_x_key(leaf)) if _is_static(leaf) else entry
                for leaf, entry in zip(leaves, signature, strict=True)
            )
    return signature


def _is_static(leaf: Any) -> bool:
    """A leaf of x that is not differentiated but passed to f as it is, as ``eqx.filter_grad``
    treats it: anything but an array or a Python float (a function, an int, a bool, a string)."""
    kind = _arrays.kind(leaf)
    return kind == "other" or (kind == "python" and not isinstance(leaf, float))


def _static_x_key(leaf: Any) -> Any:
    key = static_key(leaf)
    return ("identity", id(leaf)) if key is None else key


def _misplaced_context(op: Operator, role: str, value: Context[Any]) -> ContextError:
    signature = f"di.{op.name}(f, backend, x{', tx' if op.tangent == 'x' else ', ty' if op.tangent else ''}, *contexts)"
    return ContextError(
        f"The {role} of {op.name} is a di.{type(value).__name__}, but the {role} is passed bare, "
        f"not wrapped: {signature}. Only the extra arguments of f after it are contexts."
    )


def _bare_argument(op: Operator, index: int, value: Any) -> ContextError:
    position = index + (5 if op.tangent else 4)
    if isinstance(value, Prep):
        return ContextError(
            f"Argument {position} of {op.name} is a Prep, passed positionally, where f's contexts go. "
            f"Pass it by keyword: di.{op.name}(f, backend, x, ..., prep=prep)."
        )
    return ContextError(
        f"Argument {position} of {op.name} is a {type(value).__name__}, not a context. Extra "
        "arguments of f must be wrapped: di.Constant(value) for data f only reads (a model, a "
        "batch, a state), di.Cache(value) for scratch space f may overwrite."
    )


# -- the entry point of every operator --------------------------------------------------------


def _arguments(
    name: str,
    f: Callable[..., Any],
    backend: Backend | str,
    x: Any,
    tangent: Any,
    contexts: tuple[Any, ...],
    has_aux: bool,
) -> tuple[Operator, Backend, Call]:
    """The operator, the backend object and the flattened call; a non-callable f is refused."""
    op = OPERATORS[name]
    if not callable(f):
        tangent_name = {"x": ", tx", "y": ", ty"}.get(op.tangent or "", "")
        raise InvalidInputError(
            f"f must be a callable f(x, *contexts), got {type(f).__name__}. The argument order "
            f"is di.{name}(f, backend, x{tangent_name}, *contexts)."
        )
    if has_aux and not op.aux:
        raise _no_aux(op)
    backend = normalize(backend)
    return op, backend, Call(op, backend, x, tangent, contexts, has_aux)


def _no_aux(op: Operator) -> InvalidInputError:
    with_aux = {"gradient": "value_and_gradient", "jvp": "value_and_jvp", "vjp": "value_and_vjp"}.get(op.name)
    if with_aux is not None:
        return InvalidInputError(
            f"{op.name} does not take has_aux=True; di.{with_aux}(..., has_aux=True) does, and returns "
            f"((value, aux), {op.name.removeprefix('value_and_')})."
        )
    return InvalidInputError(
        f"{op.name} does not take has_aux=True: only value_and_gradient, value_and_jvp and value_and_vjp "
        "do. Drop the aux inside f (lambda x, *c: f(x, *c)[0])."
    )


def evaluate(
    name: str,
    f: Callable[..., Any],
    backend: Backend | str,
    x: Any,
    tangent: Any,
    contexts: tuple[Any, ...],
    prep: Prep | None,
    has_aux: bool = False,
) -> Any:
    if prep is None:
        recent = prep_cache.recent(f, name)  # the prep f used last, likely to fit again
        if recent is not None:
            result = recent.fast(name, f, backend, x, tangent, contexts, has_aux)
            if result is not MISS:
                return result
    elif isinstance(prep, Prep):
        result = prep.fast(name, f, backend, x, tangent, contexts, has_aux)
        if result is not MISS:
            return result
    else:
        raise InvalidInputError(f"prep must come from di.prepare_{name}(...), got {type(prep).__name__}.")
    op, backend, call = _arguments(name, f, backend, x, tangent, contexts, has_aux)
    if prep is None:
        prep = prep_cache.get(f, call.signature)
        if prep is None:
            prep = _prepare(op, f, backend, call, strict=True)
            prep_cache.put(f, call.signature, prep)
    elif prep.signature != call.signature or not prep.function.matches(f):
        reason = describe_mismatch(prep, f, call.signature)
        if prep.strict and reason is not None:
            raise mismatch_error(prep, reason)
        return evaluate(name, f, backend, x, tangent, contexts, None, has_aux)
    return prep.run(call.x_leaves, call.tangent_leaves, call.context_leaves)


def prepare(
    name: str,
    f: Callable[..., Any],
    backend: Backend | str,
    x: Any,
    tangent: Any,
    contexts: tuple[Any, ...],
    strict: bool,
    has_aux: bool = False,
) -> Prep:
    op, backend, call = _arguments(name, f, backend, x, tangent, contexts, has_aux)
    cached = prep_cache.get(f, call.signature)
    if cached is not None:  # the work is done already: share it
        return cached.with_strictness(strict)
    prep = _prepare(op, f, backend, call, strict)
    if adapter_for(backend).compiles:
        prep.run(call.x_leaves, call.tangent_leaves, call.context_leaves)  # trace and compile now
    prep_cache.put(f, call.signature, prep)
    return prep


# -- preparation: validate once, build the program -----------------------------------------------


def _prepare(op: Operator, f: Callable[..., Any], backend: Backend, call: Call, strict: bool) -> Prep:
    full_signature = call.signature
    row = info(backend)
    adapter = adapter_for(backend)
    call, dynamic_index = _dynamic_view(op, adapter, call)  # from here on, x's leaves to differentiate
    signature = call.signature
    _check_x(op, backend, row.any_array_type, call)
    if op.tangent is not None:
        _check_tangent_kinds(op, backend, row.any_array_type, call)
    if op.tangent == "x":
        _check_tangent_like_x(op, call)
    function = FunctionRef(f)
    output = _Output()
    plan = _Conversions(adapter, op, call)
    program = _program(op, adapter, function, call, output, plan)
    finish, mirror = _finisher(op, call, output)
    direct_ok = plan.passthrough and plan.x_native and plan.tangent_native and not plan.float64
    flat: Callable[..., Any] | None = None
    finished, finish_rest = [False], finish
    if direct_ok and adapter.compiles and len(call.x_leaves) == 1 and len(call.tangent_leaves) <= 1:
        # a compiled program on flat arguments (x, [tangent,] *context arrays), which returns
        # the result itself where it is x's one leaf: no pytree for jit to take apart or build
        flat, finished, finish_rest = _flat_program(
            adapter,
            program,
            op,
            output,
            mirror,
            finish,
            bool(call.tangent_leaves),
            call.x_leaves[0],
            signature.has_aux,
            signature.x_spec == _LEAF,
        )

        def finish(out: Any) -> Any:
            return out if finished[0] else finish_rest(out)

        def compiled(xs: Any, ts: Any, dynamic: Any, static: Any) -> Any:
            return flat(*xs, *ts, *dynamic)  # type: ignore[misc]

    else:
        compiled = adapter.compile(program)
    estimates = adapter.estimates_errors
    parts = [i for i, _ in op.parts]

    compiles = adapter.compiles

    def run(x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]) -> tuple[Any, Any]:
        arguments = plan.native(x_leaves, tangent_leaves, context_leaves)
        native = compiled(*arguments)
        if compiles:  # a program from jit's cache did not evaluate f: its trace's record holds
            output.recall(arguments[3])
        result = finish(native)
        if not estimates:
            return result, None
        error = adapter.take_error()
        if error is None:
            return result, None
        picked = tuple(error[i] for i in parts)
        return result, finish((*picked, None) if signature.has_aux else picked)

    def scoped(x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]) -> tuple[Any, Any]:
        scope = adapter.scope()
        if scope is None:
            return run(x_leaves, tangent_leaves, context_leaves)
        with scope:
            return run(x_leaves, tangent_leaves, context_leaves)

    runner = scoped if plan.float64 else run
    fast = _fast_path(op, function, call, estimates, direct_ok, flat, finished, finish_rest, compiled, finish, runner)
    if dynamic_index is not None:  # x has static leaves: the program takes the others
        on_dynamic = runner

        def runner(x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]) -> tuple[Any, Any]:
            return on_dynamic([x_leaves[i] for i in dynamic_index], tangent_leaves, context_leaves)

    return Prep(function, full_signature, runner, strict, estimates, fast)


class _DynamicView(Call):
    """A call whose x holds static leaves, seen as the tree of the leaves to differentiate:
    x's structure with ``None`` in place of each static leaf, which is how the results come
    back. ``rebuild(xs)`` makes f's x of those leaves and the prepared static ones."""

    __slots__ = ("rebuild",)
    rebuild: Callable[[Any], Any]


def _dynamic_view(op: Operator, adapter: Adapter, call: Call) -> tuple[Call, list[int] | None]:
    """``call`` itself where every leaf of x is differentiated (or none is: then x is refused
    as before); else the :class:`_DynamicView` of its leaves to differentiate, and their indices."""
    static = [_is_static(leaf) for leaf in call.x_leaves]
    if not any(static) or all(static):
        return call, None
    sig = call.signature
    paths = sig.x_spec.paths()
    if adapter.compiles:
        for path, leaf, is_static in zip(paths, call.x_leaves, static, strict=True):
            if is_static and static_key(leaf) is None and not callable(leaf):
                raise InvalidInputError(
                    f"x{_path(path)} is a {type(leaf).__name__}, which is not differentiated but passed to f "
                    f"as static, compile-time data of the {adapter.backend.name} program. It is compared by "
                    "identity, not by value, so a later change to it would silently reuse the old value. "
                    "Pass it as a di.Constant, separate it from x (eqx.partition), or use AutoJAX(jit=False)."
                )
    dynamic_index = [i for i, is_static in enumerate(static) if not is_static]
    full_spec, prepared = sig.x_spec, list(call.x_leaves)
    view_spec = _tree.structure(
        optree.tree_unflatten(full_spec, [None if is_static else 0 for is_static in static])  # type: ignore[arg-type]
    )
    view = _DynamicView.__new__(_DynamicView)
    view.x_leaves = [prepared[i] for i in dynamic_index]
    view.tangent_leaves = call.tangent_leaves
    view.context_leaves, view.context_specs = call.context_leaves, call.context_specs
    view.signature = sig._replace(x_spec=view_spec, x_leaves=tuple(sig.x_leaves[i] for i in dynamic_index))

    def rebuild(xs: tuple[Any, ...] | list[Any]) -> Any:
        leaves = list(prepared)
        for i, leaf in zip(dynamic_index, xs, strict=True):
            leaves[i] = leaf
        return optree.tree_unflatten(full_spec, leaves)

    view.rebuild = rebuild
    return view, dynamic_index


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
) -> Callable[..., Any]:
    """:attr:`Prep.fast`: the quick match in front of the most direct way this prep can run."""
    with_tangent = bool(call.tangent_leaves)
    if estimates:  # the error estimate goes to the prep that runs: through Prep.run
        return _miss
    if flat is not None and finished[0]:  # the program's result is the call's
        return _matcher(op, function, call, flat)
    if flat is not None:
        compiled_flat = flat

        def direct_flat(*arrays: Any) -> Any:
            out = compiled_flat(*arrays)
            return out if finished[0] else finish_rest(out)

        return _matcher(op, function, call, direct_flat)
    if direct_ok:  # the engine takes the arguments as they are: straight to the program

        def direct(x: Any, *rest: Any) -> Any:
            if with_tangent:
                return finish(compiled((x,), rest[:1], rest[1:], None))
            return finish(compiled((x,), (), rest, None))

        return _matcher(op, function, call, direct)

    def converted(x: Any, *rest: Any) -> Any:
        tangents = [rest[0]] if with_tangent else []
        return runner([x], tangents, [[value] for value in rest[len(tangents) :]])[0]

    return _matcher(op, function, call, converted)


def _flat_program(
    adapter: Adapter,
    program: Callable[..., Any],
    op: Operator,
    output: _Output,
    mirror: Callable[[Any], Any] | None,
    finish: Callable[[Any], Any],
    tangent: bool,
    like: Any,
    has_aux: bool,
    bare_x: bool,
) -> tuple[Callable[..., Any], list[bool], Callable[[Any], Any]]:
    """``program`` compiled on flat arguments; a cell that holds True once its results are
    known to come out finished; the finisher of its results otherwise.

    Where the result mirrors x's one leaf (``mirror``), the program returns that leaf itself.
    Where besides the engine's arrays are x's own type (``returns_like``) and the result is
    one array, the program finishes it: a cast to x's dtype for a gradient, nothing for the
    others; whether f's output is one array (for jvp and jacobian) shows when it is traced."""
    kinds = [kind for _, kind in op.parts]
    kind = kinds[0]
    # (a result that mirrors x is x's one leaf only where x is that leaf, not a tree holding it)
    candidate = adapter.returns_like(like) and len(kinds) == 1 and not has_aux and (bare_x or kind in ("value", "y"))
    inside = [candidate and kind in ("x", "value", "hessian")]  # settled by the trace for "y" and "jacobian"
    dtype = like.dtype if candidate else None

    def pick(native: tuple[Any, ...]) -> Any:
        if candidate:
            value = native[0]
            if kind == "x":
                leaf = value[0]  # cast only where needed: a weak type stays weak
                return leaf if leaf.dtype == dtype else leaf.astype(dtype)
            if kind == "value":
                return value
            if kind == "hessian" or (kind == "jacobian" and output.spec is _LEAF):
                inside[0] = True
                target = dtype if kind == "hessian" else promoted_dtype(output.dtypes[0], str(dtype))
                leaf = value[0][0]
                return leaf if target is None or leaf.dtype == target else leaf.astype(target)
            if kind == "y" and output.spec is _LEAF:
                inside[0] = True
                return value[0]
        return native[0][0] if mirror is not None else native

    def with_tangent(x: Any, t: Any, *values: Any) -> Any:
        return pick(program((x,), (t,), values, None))

    def without(x: Any, *values: Any) -> Any:
        return pick(program((x,), (), values, None))

    compiled = adapter.compile(with_tangent if tangent else without, static=False, arrays=not has_aux)
    return compiled, inside, mirror or finish


class _Conversions:
    """How a call's leaves become the program's arguments ``(xs, ts, dynamic, static)``,
    settled once from the prepared call: a signature fixes every leaf's kind, and with it
    which conversions do nothing and which context leaves are arrays."""

    __slots__ = ("adapter", "empty", "float64", "mask", "op", "passthrough", "signature", "tangent_native", "x_native")

    def __init__(self, adapter: Adapter, op: Operator, call: Call) -> None:
        self.adapter, self.op, self.signature = adapter, op, call.signature
        self.float64 = _involves_float64(call)
        scope = adapter.scope() if self.float64 else None
        with scope if scope is not None else contextlib.nullcontext():
            xs = [adapter.to_native(leaf) for leaf in call.x_leaves]
            self.x_native = all(a is b for a, b in zip(xs, call.x_leaves, strict=True))
            self.tangent_native = all(
                a is b for a, b in zip(self._tangents(call.tangent_leaves, xs), call.tangent_leaves, strict=True)
            )
            like = xs[0] if xs else None
            mask: list[bool] = []
            passthrough = True
            for index, leaves in enumerate(call.context_leaves):
                for leaf in leaves:
                    native, is_array = self._context(leaf, like, index)
                    if not is_array and adapter.compiles:
                        _refuse_unseen_static(adapter, self.signature, index, native)
                    mask.append(is_array)
                    passthrough = passthrough and is_array and native is leaf
        self.mask = tuple(mask)
        self.passthrough = passthrough  # every context leaf an array the engine takes as it is
        self.empty = _Static([], self.mask)  # the static argument when no leaf is static

    def _tangents(self, leaves: list[Any], xs: tuple[Any, ...] | list[Any]) -> tuple[Any, ...]:
        """Tangent leaves for the engine: those of a tangent of x take the dtypes of x's leaves."""
        if self.op.tangent == "x":
            return tuple(_tangent_to_native(self.adapter, t, x) for t, x in zip(leaves, xs, strict=True))
        return tuple(map(self.adapter.to_native, leaves))

    def _context(self, leaf: Any, like: Any, index: int) -> tuple[Any, bool]:
        # A Constant's arrays reach f read-only or watched (Adapter.constant_to_native); a Cache's
        # as they are, for f to write into.
        convert = self.adapter.context_to_native
        if issubclass(self.signature.contexts[index][0], Constant):
            convert = self.adapter.constant_to_native
        try:
            return convert(leaf, like)
        except (TypeError, ValueError) as exc:
            raise _unconvertible_context(self.adapter, self.signature, index, leaf) from exc

    def native(
        self, x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]
    ) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], _Static | None]:
        """The program's arguments; the static one is None when no context leaf is static
        (cheaper for jit to compare than an empty :class:`_Static`)."""
        xs = tuple(x_leaves) if self.x_native else tuple(map(self.adapter.to_native, x_leaves))
        ts = tuple(tangent_leaves) if self.tangent_native else self._tangents(tangent_leaves, xs)
        if self.passthrough:
            if not context_leaves:
                return xs, ts, (), None
            return xs, ts, tuple(leaf for leaves in context_leaves for leaf in leaves), None
        like = xs[0] if xs else None
        dynamic: list[Any] = []
        static: list[Any] = []
        for index, leaves in enumerate(context_leaves):
            for leaf in leaves:
                native, is_array = self._context(leaf, like, index)
                (dynamic if is_array else static).append(native)
        return xs, ts, tuple(dynamic), _Static(static, self.mask) if static else None


def _unconvertible_context(adapter: Adapter, signature: Signature, index: int, leaf: Any) -> ContextError:
    kind = signature.contexts[index][0].__name__
    what = f"an array of dtype {_arrays.dtype_name(leaf)}" if hasattr(leaf, "dtype") else f"a {type(leaf).__name__}"
    return ContextError(
        f"Context {index} (a di.{kind}) holds {what}, which the {adapter.backend.name} backend "
        "cannot convert to its arrays. Pass non-numeric data as a Python list or tuple "
        "(array.tolist()), or convert it to a numeric dtype."
    )


def _tangent_to_native(adapter: Adapter, t: Any, like: Any) -> Any:
    """A tangent leaf for the engine; a Python number takes the dtype of its primal leaf."""
    if isinstance(t, (int, float)) and hasattr(like, "dtype"):
        t = np.asarray(t, dtype=np.dtype(_arrays.dtype_name(like)))
    return adapter.to_native(t)


# -- the quick match of a prepared call --------------------------------------------------------


def _same_as(leaf: Any) -> tuple[type, Callable[[Any], bool] | None]:
    """How a quick match knows a leaf like ``leaf``: its type, and for an array a test of shape
    and dtype (and device), which reads a jax array's shape and dtype from its abstract value
    at a quarter of the cost of its properties. None: the type says all (not an array)."""
    kind = _arrays.kind(leaf)
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)

    def same_jax(value: Any) -> bool:
        aval = value.aval
        return aval.shape == shape and aval.dtype == dtype  # type: ignore[no-any-return]

    def same_numpy(value: Any) -> bool:
        return value.shape == shape and value.dtype == dtype  # type: ignore[no-any-return]

    def same_torch(value: Any) -> bool:
        return value.shape == shape and value.dtype == dtype and value.device == device  # type: ignore[no-any-return]

    if kind == "torch":
        device = leaf.device
        return type(leaf), same_torch
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


class _Static:
    """The non-array context leaves, hashable so that jit can take them as a static argument.

    Each leaf is compared by value (numbers, strings, frozen dataclasses, anything with its own
    ``__eq__`` and ``__hash__``) or, for code (functions, classes, modules), by identity: see
    :func:`static_key`. A compiling engine refuses other leaves at preparation, since a change
    to them would not be seen (:func:`_refuse_unseen_static`).
    """

    __slots__ = ("_hash", "_key", "leaves", "mask")

    def __init__(self, leaves: list[Any], mask: tuple[bool, ...]) -> None:
        self.leaves = leaves
        self.mask = mask
        self._key = tuple(static_key(v) for v in leaves)
        self._hash = hash((self._key, self.mask))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key == other._key and self.mask == other.mask


_BY_VALUE = (int, float, complex, str, bytes, bool, type(None))
# jax's wrapped functions (jax.nn.relu is a jitted function, others custom_jvp objects): code
_JAX_CODE = frozenset({"jax", "jaxlib"})
_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type, functools.partial)


def static_key(value: Any) -> Any:
    """What a static context leaf is compared by between calls of a compiled program: its
    value where it has one that can be hashed, its identity where it is code, which does not
    change; ``None`` where neither holds (a mutable object hashed by identity)."""
    cls = type(value)
    if cls in _BY_VALUE:
        return (cls, value)
    if isinstance(value, (*_CODE, enum.Enum)) or (callable(value) and cls.__module__.split(".")[0] in _JAX_CODE):
        return (cls, id(value))
    if cls.__hash__ is None or (
        cls.__hash__ is object.__hash__ and cls.__eq__ is object.__eq__  # type: ignore[comparison-overlap]
    ):
        return None  # unhashable, or hashed by identity: a change to it would go unseen
    try:
        hash(value)
    except TypeError:
        return None
    return (cls, value)


def _refuse_unseen_static(adapter: Adapter, signature: Signature, index: int, leaf: Any) -> None:
    """A compiled program bakes static context leaves in; one it could not tell changed from
    unchanged would be reused stale, so it is refused."""
    if static_key(leaf) is not None:
        return
    kind = signature.contexts[index][0].__name__
    raise ContextError(
        f"Context {index} (a di.{kind}) holds a {type(leaf).__name__}, which the compiled "
        f"{adapter.backend.name} program must take as static, compile-time data. It is compared by "
        "identity, not by value, so a later change to it (an attribute set, an in-place update) "
        "would silently reuse the old value. Pass its numbers as arrays or in a dict or dataclass "
        "registered as a pytree (di.Constant({'a': obj.a})), make it a frozen dataclass, or use "
        "AutoJAX(jit=False)."
    )


def _program(
    op: Operator, adapter: Adapter, function: FunctionRef, call: Call, output: _Output, plan: _Conversions
) -> Callable[..., Any]:
    """The program ``(xs, ts, dynamic_contexts, static_contexts) -> native parts``."""
    sig = call.signature
    has_aux = sig.has_aux
    context_specs = list(call.context_specs)
    context_sizes = [len(leaves) for leaves in call.context_leaves]
    # one array leaf per context: the dynamic arguments are the context values
    leaf_contexts = all(spec == _LEAF for spec in context_specs) and all(plan.mask)
    close = _closer(op, adapter, sig.x_spec, has_aux, output, getattr(call, "rebuild", None))
    method = getattr(adapter, op.compute)
    pullback = op.compute == "value_and_pullback"
    picked = [i for i, _ in op.parts] + ([1] if has_aux else [])  # the aux comes last
    only = picked[0] if len(picked) == 1 else None
    compiles = adapter.compiles

    empty = plan.empty

    def program(
        xs: tuple[Any, ...], ts: tuple[Any, ...], dynamic: tuple[Any, ...], static: _Static | None
    ) -> tuple[Any, ...]:
        if leaf_contexts:
            context_values = dynamic
        else:
            context_values = _merge_contexts(context_specs, context_sizes, dynamic, static or empty)
        fn = close(function(), context_values, xs[0] if xs else None)
        if pullback:
            out, aux, vjp = adapter.pullback_function(fn, xs)
            _check_cotangent(sig, output, ts)
            result: tuple[Any, ...] = (out, aux, vjp(ts))
        elif op.tangent is None:
            result = method(fn, xs)
        else:
            result = method(fn, xs, ts)
        if compiles:
            output.remember(static)
        if only is not None:
            return (force(result[only]),)
        return tuple([force(result[i]) for i in picked])

    # what an adapter's compile may read to guard the call (torch: which context leaves f may
    # write, the Cache ones)
    cache = [kind is Cache for kind, _, leaves in sig.contexts for _ in leaves]
    program.cache_dynamic = tuple(c for c, m in zip(cache, plan.mask, strict=True) if m)  # type: ignore[attr-defined]
    program.cache_static = tuple(c for c, m in zip(cache, plan.mask, strict=True) if not m)  # type: ignore[attr-defined]
    return program


def _merge_contexts(specs: list[Any], sizes: list[int], dynamic: tuple[Any, ...], static: _Static) -> tuple[Any, ...]:
    dyn = iter(dynamic)
    stat = iter(static.leaves)
    flags = iter(static.mask)
    values = []
    for spec, size in zip(specs, sizes, strict=True):
        leaves = [next(dyn) if next(flags) else next(stat) for _ in range(size)]
        values.append(optree.tree_unflatten(spec, leaves))
    return tuple(values)


def _closer(
    op: Operator,
    adapter: Adapter,
    x_spec: Any,
    has_aux: bool,
    output: _Output,
    rebuild: Callable[[Any], Any] | None = None,
) -> Callable[[Callable[..., Any], tuple[Any, ...], Any], Callable[[tuple[Any, ...]], tuple[Any, Any]]]:
    """``close(f, context_values, like)``: ``f`` with its contexts bound, on a tuple of leaves,
    ``xs -> (out, aux)``, its output checked (``like``: a leaf of x, native). ``rebuild(xs)``:
    f's x from the leaves, where it is not ``x_spec`` of them (x has static leaves)."""
    single = x_spec == _LEAF
    if rebuild is None:

        def rebuild(xs: Any) -> Any:
            return optree.tree_unflatten(x_spec, list(xs))

    checked = output.checked
    scalar = op.scalar_output
    output_leaf = adapter.output_leaf
    untracked = adapter.untracked
    batches = adapter.batches

    def close(f: Callable[..., Any], context_values: tuple[Any, ...], like: Any) -> Callable[..., Any]:
        def fn(xs: tuple[Any, ...]) -> tuple[Any, Any]:
            x = xs[0] if single else rebuild(xs)
            try:
                result = f(x, *context_values)
            except Exception as exc:
                hint = adapter.explain_failure(exc)
                if hint is not None:
                    raise FrameworkMismatchError(f"f failed under the {adapter.backend.name} backend: {hint}") from exc
                raise
            aux = None
            if has_aux:
                if not (isinstance(result, (tuple, list)) and len(result) == 2):
                    raise InvalidOutputError(
                        f"With has_aux=True, f must return a pair (value, aux); it returned {_describe(result)}."
                    )
                result, aux = result
            if scalar:
                if untracked(result, xs):
                    _refuse_cut(f, context_values, xs, adapter, x_spec, rebuild)
                # a scalar of a type and dtype seen before needs no more checks (nor recording:
                # what the results of scalar functions mirror does not depend on f's output)
                if (type(result), getattr(result, "dtype", None)) in checked and getattr(result, "shape", ()) == ():
                    return output_leaf(result, like), aux
                return output_leaf(_checked(op, result, output, adapter)[0], like), aux
            leaves = _checked(op, result, output, adapter)
            for leaf in leaves:
                if untracked(leaf, xs):
                    _refuse_cut(f, context_values, xs, adapter, x_spec, rebuild)
                    break
            if len(leaves) == 1:
                return (output_leaf(leaves[0], like),), aux
            return tuple([output_leaf(leaf, like) for leaf in leaves]), aux

        fn.has_aux = has_aux  # type: ignore[attr-defined]  # without, an engine may skip its aux handling
        if batches:

            def batched(xs: tuple[Any, ...]) -> tuple[Any, ...]:
                """f on a batch of points (a leading axis on every leaf), its output leaves unchecked:
                for finite differences with ``vectorize=True``."""
                x = xs[0] if single else rebuild(xs)
                result = f(x, *context_values)
                leaves, spec = _tree.flatten(result[0] if has_aux else result)
                output.record(spec, leaves, batched=True)
                return tuple(leaves)

            fn.batched = batched  # type: ignore[attr-defined]
        return fn

    return close


def _refuse_cut(
    f: Callable[..., Any],
    context_values: tuple[Any, ...],
    xs: tuple[Any, ...],
    adapter: Adapter,
    x_spec: Any,
    rebuild: Callable[[Any], Any],
) -> None:
    """f returned a value the engine does not trace back to x. If f's value changes when x
    does, f cut the trace (its derivative would read as zero): refused. Else f does not depend
    on x, and zero is its derivative."""
    plain = [adapter.plain(leaf) for leaf in xs]
    moved = [leaf + 1e-3 * (1 + abs(leaf)) for leaf in plain]

    def value(leaves: list[Any]) -> list[np.ndarray]:
        x = leaves[0] if x_spec == _LEAF else rebuild(leaves)
        # (through tolist: a torch.func tensor has no storage for numpy to read)
        return [
            np.asarray(leaf.detach().tolist() if _arrays.kind(leaf) == "torch" else _arrays.to_numpy(leaf))
            for leaf in _tree.leaves(f(x, *context_values))
        ]

    before, after = value(plain), value(moved)
    if len(before) != len(after) or any(
        a.shape != b.shape or not np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after, strict=True)
    ):
        raise InvalidOutputError(
            f"f's output changes with x, but not through the {adapter.backend.name} engine's trace: f turned a "
            "traced value into a plain number or a new array (float(y), y.item(), y.numpy(), "
            "torch.tensor(y.item()), np.asarray(y)), so its derivative would read as zero. Keep the "
            "computation in the engine's arrays from x to the output."
        )


def _checked(op: Operator, result: Any, output: _Output, adapter: Adapter) -> list[Any]:
    """The leaves of ``f``'s output, recorded and checked: numeric, and one scalar for the
    operators of scalar functions."""
    if result is None:
        raise InvalidOutputError(
            f"f returned None where {op.name} needs floating-point numbers (float arrays or floats). "
            "Return the value from f (a missing return statement?)."
        )
    if _arrays.kind(result) in _OUTPUT_LEAF_KINDS:
        leaves, spec = [result], _LEAF
    else:
        leaves, spec = _tree.flatten(result)
    output.record(spec, leaves)
    checked = output.checked
    for leaf in leaves:
        key = (type(leaf), getattr(leaf, "dtype", None))
        if key not in checked:
            _check_numeric(op, leaf, adapter.complex_outputs)
            checked.add(key)
    if op.scalar_output and (len(leaves) != 1 or _arrays.shape(leaves[0]) != ()):
        raise InvalidOutputError(
            f"{op.name} needs f to return a scalar, but it returned {_describe(result)}. Reduce the "
            "output (say with .sum()), or use jacobian / vjp for a non-scalar output."
        )
    return leaves


class _Output:
    """What a prep learns of f(x) from evaluating it: its structure, leaf shapes and dtypes, and
    the (type, dtype) pairs of output leaves already validated.

    The structure may depend on the contexts (a tuple for one value, a dict for another), so
    the record of the last evaluation is kept per thread, and where a compiled program does not
    evaluate f again, per value of its static argument, recorded when it was traced."""

    __slots__ = ("_by_static", "_local", "checked", "cotangent_fits")

    def __init__(self) -> None:
        self._local = threading.local()
        self._by_static: dict[Any, tuple[Any, Any, Any]] = {}
        self.checked: set[tuple[type, Any]] = set()
        self.cotangent_fits: tuple[Any, Any] | None = None  # the (spec, shapes) a cotangent was found to fit

    def _current(self) -> tuple[Any, Any, Any]:
        local = self._local
        try:
            return local.spec, local.shapes, local.dtypes
        except AttributeError:  # a thread that has only run compiled programs traced by others
            return self._by_static.get(None, (None, (), ()))

    @property
    def spec(self) -> Any:
        try:
            return self._local.spec
        except AttributeError:
            return self._current()[0]

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return self._current()[1]  # type: ignore[no-any-return]

    @property
    def dtypes(self) -> tuple[str | None, ...]:
        return self._current()[2]  # type: ignore[no-any-return]

    def record(self, spec: Any, leaves: list[Any], batched: bool = False) -> None:
        """From one evaluation; ``batched``: the leaves hold a batch along a leading axis."""
        local = self._local
        if len(leaves) == 1 and not batched:
            shapes: tuple[tuple[int, ...], ...] = (_arrays.shape(leaves[0]),)
        else:
            shapes = tuple([_arrays.shape(leaf)[1:] if batched else _arrays.shape(leaf) for leaf in leaves])
        previous = getattr(local, "spec", None)
        if not getattr(local, "dtypes", ()) or (previous is not spec and previous != spec):
            # from the first evaluation of a structure, at x: scipy evaluates later ones promoted to float64
            local.dtypes = tuple(_output_dtype(leaf) for leaf in leaves)
        local.spec, local.shapes = spec, shapes

    def remember(self, static: Any) -> None:
        """Keep the record of a trace for the compiled program of this static argument."""
        self._by_static[static] = (self.spec, self.shapes, self.dtypes)

    def recall(self, static: Any) -> None:
        """Make the record of the compiled program of this static argument the current one."""
        found = self._by_static.get(static)
        if found is not None:
            local = self._local
            local.spec, local.shapes, local.dtypes = found


def _output_dtype(leaf: Any) -> str | None:
    """The dtype a cotangent of this output leaf must have; None where any float will do."""
    if _arrays.kind(leaf) == "python":
        return None
    name = {"complex64": "float32", "complex128": "float64"}.get(_arrays.dtype_name(leaf), _arrays.dtype_name(leaf))
    return name if _arrays.is_float_dtype(name) else None  # a complex step evaluates f at complex points


def _describe(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)} and dtype {_arrays.dtype_name(value)}"
    leaves = _tree.leaves(value)
    if len(leaves) != 1 or leaves[0] is not value:
        return f"a {type(value).__name__} with {len(leaves)} leaves"
    return f"a {type(value).__name__}"


def _check_numeric(op: Operator, leaf: Any, complex_ok: bool) -> None:
    kind = _arrays.kind(leaf)
    if kind == "autograd" or (
        kind == "python" and not isinstance(leaf, bool) and (complex_ok or not isinstance(leaf, complex))
    ):
        return
    dtype = _arrays.dtype_name(leaf)
    if (
        kind == "other"
        or kind == "python"
        or not (_arrays.is_float_dtype(dtype) or (complex_ok and "complex" in dtype))
    ):
        what = type(leaf).__name__ if kind in ("other", "python") else f"array of dtype {_arrays.dtype_name(leaf)}"
        raise InvalidOutputError(
            f"f returned a {what} where {op.name} needs floating-point numbers (float arrays or "
            "floats). Compute the output in floating point."
        )


def _check_cotangent(sig: Signature, output: _Output, ts: tuple[Any, ...]) -> None:
    """The cotangent against f(x), whose structure and shapes the last evaluation recorded.

    A prep's signature fixes the cotangent's structure, shapes and dtypes, so an output
    structure and shapes the cotangent fitted before need no second look."""
    out_spec, out_shapes, out_dtypes = output.spec, output.shapes, output.dtypes
    fitted = output.cotangent_fits
    if fitted is not None and fitted[1] == out_shapes and (fitted[0] is out_spec or fitted[0] == out_spec):
        return
    if out_spec != sig.tangent_spec:
        raise TangentMismatchError(
            f"The cotangent must have the structure of f(x), {out_spec}; it has {sig.tangent_spec}."
        )
    for i, (shape, t) in enumerate(zip(out_shapes, ts, strict=True)):
        if shape != _arrays.shape(t):
            raise TangentMismatchError(
                f"Cotangent leaf {i} has shape {_arrays.shape(t)}, but f(x)'s leaf {i} has shape "
                f"{shape}; a cotangent has the shape of f(x)."
            )
    for i, (dtype, t) in enumerate(zip(out_dtypes, sig.tangent_leaves, strict=False)):
        if dtype is None or t[0] == "python":
            continue
        found = str(t[2]).removeprefix("torch.")
        if found != dtype:
            raise TangentMismatchError(
                f"Cotangent leaf {i} has dtype {found}, but f(x)'s leaf {i} has dtype {dtype}; cast the "
                f"cotangent to {dtype}."
            )
    output.cotangent_fits = (out_spec, out_shapes)


# -- validation of x and tangents --------------------------------------------------------------------


def _check_x(op: Operator, backend: Backend, any_array_type: bool, call: Call) -> None:
    sig = call.signature
    paths = [_path(p) for p in sig.x_spec.paths()]
    kinds: set[_arrays.Kind] = set()
    for path, leaf in zip(paths, call.x_leaves, strict=True):
        kind = _arrays.kind(leaf)
        dtype = _arrays.dtype_name(leaf)
        if kind == "other":  # (x holds nothing else to differentiate: else it would be static)
            raise InvalidInputError(
                f"x{path} is a {type(leaf).__name__} and x holds no float or float array to differentiate; "
                "diffiface differentiates floats and float arrays (numpy, torch, jax) in pytrees (dicts, "
                "lists, tuples, namedtuples, equinox modules...), passing their other leaves to f as they "
                "are. Pass other values as di.Constant(...)."
            )
        kinds.add(kind)
        if kind == "torch" and leaf.is_meta:
            raise InvalidInputError(
                f"x{path} is a meta tensor, which has a shape but no values to differentiate at. Create it "
                "on a real device (torch.ones(..., device='cpu'))."
            )
        if not _arrays.is_float_dtype(dtype):
            what = "complex" if "complex" in dtype else dtype
            raise InvalidInputError(
                f"x{path} has dtype {what}; only real floating-point inputs can be differentiated. "
                + (
                    "Split a complex input into its real and imaginary parts."
                    if what == "complex"
                    else "Cast it to a float dtype, or pass it as a di.Constant if it is not differentiated "
                    "(for a model, split its integer arrays off with eqx.partition(model, eqx.is_inexact_array) "
                    "and pass them as a di.Constant)."
                )
            )
        if dtype in ("float16", "bfloat16") and any_array_type:
            raise InvalidInputError(
                f"x{path} has dtype {dtype}: finite differences in {dtype} have no correct digits. "
                "Cast x to float32 or float64 for finite differences."
            )
    family = _arrays.family(kinds)
    if "autograd" in kinds and not _autograd_only(backend):
        # autograd's traced arrays (an outer autograd call differentiates through this one):
        # only autograd can carry its trace on; another engine would read plain numbers
        raise ArrayTypeError(
            f"x holds arrays traced by autograd (ArrayBox): an autograd computation is "
            f"differentiating through this call, which the {backend.name} backend cannot trace. "
            "Use the autograd backend for this inner call (autograd nests in itself), or call it "
            "outside the autograd computation."
        )
    if family == "other":
        raise ArrayTypeError(
            f"x mixes arrays of several frameworks ({', '.join(sorted(kinds - {'python'}))}); use one "
            "framework for all leaves of x."
        )
    if not any_array_type and family not in ("python", "numpy", "autograd", backend_family(backend)):
        raise ArrayTypeError(
            f"x holds {family} arrays, but the {backend.name} backend differentiates "
            f"{backend_family(backend)} arrays. Pass numpy or {backend_family(backend)} arrays, or use the "
            f"{family} backend."
        )
    scalar = len(call.x_leaves) == 1 and _arrays.shape(call.x_leaves[0]) == () and sig.x_spec.num_nodes == 1
    if op.scalar_input and not scalar:
        shape = _arrays.shape(call.x_leaves[0]) if len(call.x_leaves) == 1 else f"{len(call.x_leaves)} leaves"
        raise InvalidInputError(
            f"{op.name} needs a scalar x (a float or a 0-d array), got {shape}. For an array "
            "x use jacobian, or jvp for one direction."
        )


def _autograd_only(backend: Backend) -> bool:
    """True when autograd does all the work, so that autograd's traced arrays may come in."""
    if isinstance(backend, SecondOrder):
        return _autograd_only(backend.outer) and _autograd_only(backend.inner)
    return backend.name == "autograd"


def backend_family(backend: Backend) -> str:
    inner = backend.inner if isinstance(backend, SecondOrder) else backend
    return {"jax": "jax", "torch": "torch", "autograd": "numpy"}.get(inner.name, "numpy")


def _check_tangent_kinds(op: Operator, backend: Backend, any_array_type: bool, call: Call) -> None:
    """A tangent's leaves are Python numbers, numpy arrays, or arrays of x's framework (of the
    backend's for an engine that takes one framework): never another framework's."""
    x_family = _arrays.family({_arrays.kind(leaf) for leaf in call.x_leaves})
    allowed = {"python", "numpy", x_family}
    if not any_array_type:
        allowed.add(backend_family(backend))
    role = "tangent" if op.tangent == "x" else "cotangent"
    for path, leaf in zip(call.signature.tangent_spec.paths(), call.tangent_leaves, strict=True):
        kind = _arrays.kind(leaf)
        if kind not in allowed:
            raise ArrayTypeError(
                f"The {role}{_path(path)} of {op.name} is {kind} ({type(leaf).__name__}), but x holds "
                f"{x_family} arrays under the {backend.name} backend. Pass the {role} as numpy or "
                f"{x_family if x_family != 'python' else backend_family(backend)} arrays."
            )


def _check_tangent_like_x(op: Operator, call: Call) -> None:
    sig = call.signature
    if sig.tangent_spec != sig.x_spec:
        static = " (None at the leaves of x that are not differentiated)" if isinstance(call, _DynamicView) else ""
        raise TangentMismatchError(
            f"The tangent of {op.name} must have the structure of x{static}, {sig.x_spec}; it has {sig.tangent_spec}."
        )
    paths = [_path(p) for p in sig.x_spec.paths()]
    for path, x, t in zip(paths, call.x_leaves, call.tangent_leaves, strict=True):
        if _arrays.shape(x) != _arrays.shape(t):
            raise TangentMismatchError(
                f"The tangent{path} has shape {_arrays.shape(t)}, but x{path} has shape {_arrays.shape(x)}."
            )
        tx, tt = _arrays.dtype_name(x), _arrays.dtype_name(t)
        if isinstance(t, float) or (isinstance(x, float) and tt == "float64"):
            continue
        if tt != tx:
            raise TangentMismatchError(
                f"The tangent{path} has dtype {tt}, but x{path} has dtype {tx}; cast the tangent to {tx}."
            )


def _path(path: tuple[Any, ...]) -> str:
    return "".join(f"[{entry!r}]" for entry in path)


def _involves_float64(call: Call) -> bool:
    for leaf in (*call.x_leaves, *call.tangent_leaves):
        if isinstance(leaf, float) or _arrays.dtype_name(leaf) == "float64":
            return True
    return any(
        _arrays.is_array(leaf) and _arrays.dtype_name(leaf) == "float64"
        for leaves in call.context_leaves
        for leaf in leaves
    )


# -- results: mirror the inputs ----------------------------------------------------------------------


def _finisher(
    op: Operator, call: Call, output: _Output
) -> tuple[Callable[[tuple[Any, ...]], Any], Callable[[Any], Any] | None]:
    """``finish(native_parts)``: the result mirroring the inputs; and where the result is one
    leaf mirroring x's one leaf, ``mirror(leaf)`` for it (else None)."""
    x_spec = call.signature.x_spec
    x_likes = list(call.x_leaves)
    family = _arrays.family({_arrays.kind(leaf) for leaf in x_likes}) if x_likes else "numpy"
    python_x = family == "python"

    like: Any = x_likes[0] if x_likes else None

    def as_y(value: Any) -> Any:
        return _to_family(value, family, python_x, like)

    single_x = x_spec == _LEAF

    x_dtypes = [_weak_or_dtype(leaf) for leaf in x_likes]

    def block(value: Any, dtype: str | None) -> Any:
        return _cast(as_y(value), dtype)

    def convert(kind: str, value: Any) -> Any:
        # (f's output is one array when its recorded structure is _LEAF itself)
        if kind == "value":
            return as_y(value)
        if kind in ("y", "dy"):
            if kind == "y":
                if output.spec is _LEAF:
                    return as_y(value[0])
                return optree.tree_unflatten(output.spec, [as_y(v) for v in value])
            x_dtype = x_dtypes[0] if x_dtypes else None
            dtypes = output.dtypes
            if output.spec is _LEAF:
                return block(value[0], promoted_dtype(dtypes[0] if dtypes else None, x_dtype))
            return optree.tree_unflatten(
                output.spec,
                [block(v, promoted_dtype(d, x_dtype)) for v, d in zip(value, _padded(dtypes, len(value)), strict=True)],
            )
        if kind == "x":
            if single_x:
                return _mirror(value[0], like)
            return optree.tree_unflatten(x_spec, [_mirror(v, like) for v, like in zip(value, x_likes, strict=True)])
        if kind == "jacobian":
            dtypes = _padded(output.dtypes, len(value))
            if single_x and output.spec is _LEAF:
                return block(value[0][0], promoted_dtype(dtypes[0], x_dtypes[0]))
            rows = [
                optree.tree_unflatten(
                    x_spec, [block(b, promoted_dtype(dy, dx)) for b, dx in zip(row, x_dtypes, strict=True)]
                )
                for row, dy in zip(value, dtypes, strict=True)
            ]
            return optree.tree_unflatten(output.spec, rows)
        if single_x:
            return block(value[0][0], x_dtypes[0])
        rows = [
            optree.tree_unflatten(
                x_spec, [block(b, promoted_dtype(di, dj)) for b, dj in zip(row, x_dtypes, strict=True)]
            )
            for row, di in zip(value, x_dtypes, strict=True)
        ]
        return optree.tree_unflatten(x_spec, rows)

    has_aux = call.signature.has_aux
    kinds = [kind for _, kind in op.parts]

    def finish(native: tuple[Any, ...]) -> Any:
        parts = [convert(kind, value) for kind, value in zip(kinds, native, strict=False)]
        if has_aux:
            aux = _tree.map(as_y, native[-1])
            return ((parts[0], aux), *parts[1:]) if len(parts) > 1 else (parts[0], aux)
        return parts[0] if len(parts) == 1 else tuple(parts)

    if len(kinds) == 1 and not has_aux:
        only = kinds[0]

        def finish(native: tuple[Any, ...]) -> Any:
            return convert(only, native[0])

    if (
        kinds == ["x"]
        and not has_aux
        and x_spec == _LEAF
        and _arrays.kind(like) in _ARRAY_KINDS
        and not isinstance(like, np.generic)  # a numpy scalar x gets a 0-d array, as from _mirror
    ):
        # the hot path of gradient, vjp and hvp on one array: no tree to rebuild, and most
        # often nothing to convert
        cls, dtype, tensor = type(like), like.dtype, _arrays.kind(like) == "torch"

        def mirror(value: Any) -> Any:
            if type(value) is cls and value.dtype == dtype and not (tensor and value.requires_grad):
                return value
            return _mirror(value, like)

        def first(native: tuple[Any, ...]) -> Any:
            value = native[0][0]
            if type(value) is cls and value.dtype == dtype and not (tensor and value.requires_grad):
                return value
            return _mirror(value, like)

        return first, mirror
    return finish, None


_PRECISION = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def promoted_dtype(a: str | None, b: str | None) -> str | None:
    """The dtype of a derivative relating a leaf of dtype ``a`` to one of dtype ``b``: the wider
    of the two, so that no precision is lost on either side (float16 with bfloat16 gives
    float32, as both jax and torch promote them). ``None`` is a Python number's weak dtype,
    which takes the other's."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    width = max(_PRECISION.get(a, 64), _PRECISION.get(b, 64))
    if width == 16:
        return "float32"
    return "float64" if width == 64 else "float32"


def _weak_or_dtype(leaf: Any) -> str | None:
    """A leaf's dtype name; None for a Python number, which takes the dtype it meets."""
    return None if _arrays.kind(leaf) == "python" else _arrays.dtype_name(leaf)


def _padded(dtypes: tuple[str | None, ...], count: int) -> tuple[str | None, ...]:
    return dtypes if len(dtypes) == count else (None,) * count


def _cast(value: Any, dtype: str | None) -> Any:
    """A result block in the dtype the promotion rule gives (where it is an array)."""
    if dtype is None:
        return value
    current = getattr(value, "dtype", None)
    if current is None or _arrays.dtype_name(value) == dtype or not _arrays.is_float_dtype(_arrays.dtype_name(value)):
        return value
    if _arrays.kind(value) == "torch":
        return value.to(getattr(sys.modules["torch"], dtype))
    return value.astype(dtype)


def _to_family(value: Any, family: str, python_x: bool, like: Any) -> Any:
    """An output-shaped result in the array type of x (numpy for Python numbers), dtype kept."""
    kind = _arrays.kind(value)
    if family in ("python", "numpy"):
        if kind == "python" or kind == "autograd":  # autograd: traced by an enclosing autograd call
            return value
        array = np.asarray(value) if kind == "numpy" else _arrays.to_numpy(value)
        return array.item() if python_x and array.ndim == 0 else array
    if kind == family:
        # a nested call keeps the graph its inputs carried (_arrays.graph_state, set by the adapter)
        return value.detach() if kind == "torch" and not _arrays.graph_state.keep else value
    if kind not in ("python", "numpy", "autograd", "jax", "torch"):
        return value
    array = np.asarray(_arrays.to_numpy(value))
    return _arrays.from_numpy(array, like, dtype=_framework_dtype(array.dtype, family))


def _framework_dtype(dtype: np.dtype[Any], family: str) -> Any:
    if family == "torch":
        return getattr(sys.modules["torch"], dtype.name)
    return dtype


def _mirror(value: Any, like: Any) -> Any:
    """``value`` with ``like``'s array type and dtype (and device)."""
    value_kind = _arrays.kind(value)
    if value_kind == "autograd":  # traced by an enclosing autograd call, which differentiates through it
        return value
    kind = _arrays.kind(like)
    if kind == "python":
        return float(np.asarray(_arrays.to_numpy(value)))
    if kind == "numpy":
        array = value if value_kind == "numpy" else _arrays.to_numpy(value)
        return np.asarray(array, dtype=like.dtype)
    if kind == "torch" and value_kind == "torch":  # computed on like's device
        if value.requires_grad and not _arrays.graph_state.keep:  # kept where x carried a graph
            value = value.detach()
        return value if value.dtype == like.dtype else value.to(like.dtype)
    if kind == "jax" and value_kind == "jax":
        return value if value.dtype == like.dtype else value.astype(like.dtype)
    if kind in ("torch", "jax"):
        return _arrays.from_numpy(np.asarray(_arrays.to_numpy(value)), like)
    return value
