"""The machinery behind the public operators of ``_operators``: validate, normalise, prepare or reuse, run.

Data flows one way: arguments are flattened and their signature taken; a prep is checked
(or found in the cache, or made); the adapter works on native arrays inside a program
(compiled where the engine compiles); results are converted to mirror the inputs.

This module holds the entry points; each concern has its own module: the call and its
signature (``_call``), validation (``_checks``), the program (``_programs``), finishing
(``_results``) and the quick match (``_matching``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _complex
from . import _sparse_operators as _sparse
from ._adapters import adapter_for, info, normalize
from ._backends import AutoSparse, Backend
from ._call import _LEAF, OPERATORS, Call, Operator, _dynamic_view
from ._checks import _check_tangent_kinds, _check_tangent_like_x, _check_x
from ._errors import InvalidInputError
from ._matching import _fast_path, _tree_matcher
from ._prep import MISS, FunctionRef, Prep, describe_mismatch, mismatch_error, prep_cache
from ._programs import _Conversions, _flat_program, _Output, _program
from ._results import _finisher
from ._results import promoted_dtype as promoted_dtype  # imported from here by the tests

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
    if type(backend) is AutoSparse:  # its Jacobians and Hessians take their own route; the rest, the wrapped backend
        if name in _sparse.SPARSE_OPERATORS:
            return _sparse.evaluate(name, f, backend, x, contexts, prep, has_aux)
        backend = backend.backend
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
    if type(backend) is AutoSparse:  # as in evaluate
        if name in _sparse.SPARSE_OPERATORS:
            return _sparse.prepare(name, f, backend, x, contexts, strict, has_aux)
        backend = backend.backend
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
    full_call = call
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
    adapter = _complex.adapter_for_call(op, adapter, call, f)  # complex numbers in the convention
    function = FunctionRef(f)
    output = _Output()
    plan = _Conversions(adapter, op, call)
    program = _program(op, adapter, function, call, output, plan)
    finish, mirror = _finisher(op, call, output)
    direct_ok = plan.passthrough and plan.x_native and plan.tangent_native
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

    else:  # (jit returns arrays only: a program whose result holds none but arrays needs no help)
        compiled = adapter.compile(program, arrays=not signature.has_aux)
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

    runner = scoped if plan.scoped else run
    precision = adapter.scope if plan.scoped else None
    fast = _fast_path(
        op, function, call, estimates, direct_ok, flat, finished, finish_rest, compiled, finish, runner, precision
    )
    if dynamic_index is not None:  # x has static leaves: the program takes the others
        on_dynamic = runner

        def runner(x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]) -> tuple[Any, Any]:
            return on_dynamic([x_leaves[i] for i in dynamic_index], tangent_leaves, context_leaves)

        if not estimates:  # the quick match compares the static leaves too: on the whole call

            def leaves(x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]) -> Any:
                return runner(x_leaves, tangent_leaves, context_leaves)[0]

            fast = _tree_matcher(op, function, full_call, leaves)

    return Prep(function, full_signature, runner, strict, estimates, fast)
