"""The one route of every call: flatten the arguments once, compare them with a plan, run the
plan's program on the leaves. Where the leaves do not fit the plan, the call's full signature
decides: a strict prep refuses the call, naming what differs; anything else is prepared (once:
the cache keeps it, keyed by that signature)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _complex
from ._adapters import adapter_for, info, names_of, normalize
from ._backends import AutoSparse, Backend
from ._call import _LEAF, OPERATORS, Call, Operator, _dynamic_view, _Output
from ._checks import _check_call, _check_tangent_kinds, _check_tangent_like_x, _check_x
from ._contexts import Cache
from ._errors import InvalidInputError
from ._plan import Plan, Unfit, flattener, leaf_check, leaves_check
from ._prep import Closure, FunctionRef, Prep, describe_mismatch, mismatch_error, prep_cache
from ._programs import MISSED, JitProgram, Run, _Conversions, _program
from ._results import finisher
from ._results import promoted_dtype as promoted_dtype  # imported from here by the tests

# -- programs the route does not build itself ---------------------------------------------------------

ProgramBuilder = Callable[[str, Callable[..., Any], Backend, Call], tuple[Callable[..., Any], type[Prep]]]
_BUILDERS: dict[type[Backend], ProgramBuilder] = {}


def register_program(config: type[Backend], builder: ProgramBuilder) -> None:
    """Let ``builder(name, f, backend, call) -> (program, prep class)`` make the programs of
    backends of type ``config`` (AutoSparse's, from ``_sparse_operators``, which calls the
    public operators and so sits above this route)."""
    _BUILDERS[config] = builder


# -- the route --------------------------------------------------------------------------------------


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
        known = prep_cache.recent(f, name)  # the prep f used last, likely to fit again
    elif isinstance(prep, Prep):
        known = prep
    else:
        raise InvalidInputError(f"prep must come from di.prepare_{name}(...), got {type(prep).__name__}.")
    if known is not None and (prep is not None or known.still_for(f)):
        plan = known.plan
        if plan.jit is not None:
            # (the retracing engines' tier: the compiled call on the arguments as passed, its
            # trace checking them, JitProgram)
            out = plan.jit.run(name, f, backend, x, tangent, contexts, has_aux)
            if out is not MISSED:
                return out
        found = plan.leaves(name, f, backend, x, tangent, contexts, has_aux)
        if found is not None:
            try:
                if plan.estimates:  # (the prep keeps the estimate)
                    return known.run(*found)
                return plan.program(*found)[0]
            except Unfit:  # (shapes or dtypes its program checks itself: the signature decides)
                pass
    op, backend, call = _arguments(name, f, backend, x, tangent, contexts, has_aux)
    if prep is not None:
        reason = describe_mismatch(prep, f, call.signature)
        if reason is None:  # (the same signature, told apart by a leaf test that is stricter: a weak type)
            return prep.run(call.x_leaves, call.tangent_leaves, call.context_leaves)
        if prep.strict:
            raise mismatch_error(prep, reason)
    # (unprepared, or a prep with strict=False that does not fit: the cache's prep for the signature)
    types = call.leaf_types
    cached = prep_cache.get(f, call.signature, types)
    if cached is None or not cached.still_for(f):
        cached = _prepare(op, f, backend, call, strict=True)
        prep_cache.put(f, call.signature, cached, types)
    return cached.run(call.x_leaves, call.tangent_leaves, call.context_leaves)


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
    types = call.leaf_types
    cached = prep_cache.get(f, call.signature, types)
    if cached is not None and cached.still_for(f):  # the work is done: share it
        return cached.with_strictness(strict)
    prep = _prepare(op, f, backend, call, strict)
    if type(backend) not in _BUILDERS and adapter_for(backend).compiles:
        prep.run(call.x_leaves, call.tangent_leaves, call.context_leaves)  # trace and compile now
    prep_cache.put(f, call.signature, prep, types)
    return prep


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
    _check_call(op, f, has_aux)
    engine = normalize(backend)
    sparse = isinstance(engine, AutoSparse)
    if sparse and name not in AutoSparse.operators:  # its other operators are its engine's
        engine, sparse = engine.backend, False  # type: ignore[attr-defined]
    # (a sparsity pattern is detected for the values of the contexts' other leaves)
    return op, engine, Call(op, engine, x, tangent, contexts, has_aux, by_value=sparse)


# -- preparation: validate once, build the plan -----------------------------------------------------


def _prepare(op: Operator, f: Callable[..., Any], backend: Backend, call: Call, strict: bool) -> Prep:
    function = FunctionRef(f)
    builder = _BUILDERS.get(type(backend))
    adapter = adapter_for(backend)
    # what f reads besides its arguments, where a program bakes it in (see Closure); the
    # engine forgets its earlier traces where one of those arrays has been written in place
    closure = Closure(f) if builder is not None or adapter.compiles else None
    if closure is not None and closure.rewritten():
        adapter.forget_traces()
    if builder is not None:  # (its program is built for f's closure and the contexts' values too)
        program, kind = builder(op.name, f, backend, call)
        plan = _plan(op, backend, function, call, program, estimates=False, by_value=True)
        return kind(plan, call.signature, strict, closure)
    program, estimates, engine = _program_of(op, f, backend, call, function)
    plan = _plan(op, backend, function, call, program, estimates, engine=engine)
    if type(program) is JitProgram:
        program.bind(plan)
        plan.jit = program
    return Prep(plan, call.signature, strict, closure)


def _plan(
    op: Operator,
    backend: Backend,
    function: FunctionRef,
    call: Call,
    program: Callable[..., Any],
    estimates: bool,
    by_value: bool = False,
    engine: bool = False,
) -> Plan:
    """``engine``: the program checks the shapes and dtypes of the leaves
    :func:`~diffiface._plan.engine_checked` names (the plan then tests their types only)."""
    sig = call.signature
    x_tests = [leaf_check(leaf, static_x=True, engine=engine) for leaf in call.x_leaves]
    tangent_tests = [leaf_check(leaf, engine=engine) for leaf in call.tangent_leaves]
    context_tests = [
        [leaf_check(leaf, by_value=by_value, engine=engine, context=True) for leaf in leaves]
        for leaves in call.context_leaves
    ]
    context_checks: list[Any] = [
        leaves_check(leaves, tests, engine) for leaves, tests in zip(call.context_leaves, context_tests, strict=True)
    ]
    return Plan(
        operator=op.name,
        backend=backend,
        names=names_of(backend),
        function=function,
        has_aux=sig.has_aux,
        x_checks=leaves_check(call.x_leaves, x_tests, engine),
        x_class=type(call.x_leaves[0]) if sig.x_spec == _LEAF else None,
        tangent=op.tangent is not None,
        tangent_checks=leaves_check(call.tangent_leaves, tangent_tests, engine),
        context_kinds=tuple(spec[0] for spec in sig.contexts),
        context_classes=tuple(
            type(leaves[0]) if spec == _LEAF and leaves else None
            for spec, leaves in zip(call.context_specs, call.context_leaves, strict=True)
        ),
        context_checks=None if any(checks is None for checks in context_checks) else tuple(context_checks),
        program=program,
        estimates=estimates,
        single=_single(op, call, x_tests, tangent_tests, context_tests),
        flatteners=(
            flattener(sig.x_spec, call.x_leaves, ordered=True),
            flattener(sig.tangent_spec, call.tangent_leaves),
            # (f gets each context rebuilt in the prep's structure, its dicts' keys in the prep's
            # order: a context whose keys come in another order does not fit, as x's does not)
            tuple(
                flattener(spec, leaves, ordered=True)
                for spec, leaves in zip(call.context_specs, call.context_leaves, strict=True)
            ),
        ),
    )


def _single(
    op: Operator, call: Call, x_tests: list[Any], tangent_tests: list[Any], context_tests: list[list[Any]]
) -> Any:
    """The tests of a call whose x, tangent (where it has one) and every context are one leaf:
    x's, the tangent's (None: no tangent) and each context's; from each leaf's test."""
    sig = call.signature
    if sig.x_spec != _LEAF or any(spec != _LEAF for spec in call.context_specs):
        return None
    if op.tangent is not None and sig.tangent_spec != _LEAF:
        return None
    contexts = tuple(tests[0] for tests in context_tests)
    if any(test is None for test in (*x_tests, *tangent_tests, *contexts)):
        return None
    return x_tests[0], tangent_tests[0] if tangent_tests else None, contexts


def _program_of(
    op: Operator, f: Callable[..., Any], backend: Backend, call: Call, function: FunctionRef
) -> tuple[Callable[..., Any], bool, bool]:
    """The program of a dense operator on a call's leaves, whether it estimates its error, and
    whether it checks its leaves' shapes and dtypes itself (:class:`JitProgram`)."""
    row = info(backend)
    adapter = adapter_for(backend)
    call, dynamic_index = _dynamic_view(adapter, call)  # from here on, x's leaves to differentiate
    _check_x(op, backend, row.any_array_type, call)
    if op.tangent is not None:
        _check_tangent_kinds(op, backend, row.any_array_type, call)
    if op.tangent == "x":
        _check_tangent_like_x(op, call)
    signature = call.signature
    adapter = _complex.adapter_for_call(op, adapter, call, f)  # complex numbers in the convention
    output = _Output()
    conversions = _Conversions(adapter, op, call)
    traced, parts = _program(op, adapter, function, call, output, conversions)
    finish, one = finisher(op, call, output, compiled=adapter.compiles)
    direct = conversions.passthrough and conversions.x_native and conversions.tangent_native
    if direct and adapter.retraces and dynamic_index is None and not signature.has_aux:
        # the retracing engines' tier, where the adapter's traces_call takes the call: one
        # compiled function of the arguments as passed, which checks them in its trace
        leaves = [*call.x_leaves, *call.tangent_leaves, *(leaf for part in call.context_leaves for leaf in part)]
        caches = any(kind is Cache for kind, _, _ in signature.contexts)
        if call.x_leaves and adapter.traces_call(op.compute, leaves, caches, function.ref):
            mirror = one.mirror if one is not None else None
            return JitProgram(adapter, traced, op, output, mirror, finish, call, conversions.scoped, parts), False, True
    # (jit returns arrays only: a program whose result holds none but arrays needs no help; a
    # static argument costs jit a slower call: only where a context leaf is one)
    compiled = adapter.compile(traced, static=not all(conversions.mask), arrays=not signature.has_aux, parts=parts)
    run = Run(adapter, conversions, compiled, output, finish, op, signature.has_aux, dynamic_index)
    return run, adapter.estimates_errors, False
