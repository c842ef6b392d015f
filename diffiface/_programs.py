"""The program a prep runs, ``(xs, ts, dynamic_contexts, static_contexts) -> native parts``:
how a call's leaves become its arguments (:class:`_Conversions`), f closed over its contexts
and checked (:func:`_closer`), and the runs of it (:class:`Run`, :class:`JitProgram`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import operator
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optree

from . import _arrays
from . import tree as _tree
from ._adapters._base import Adapter, Deferred, ProgramParts, force, without_leaves
from ._call import _LEAF, Call, Operator, _Output
from ._checks import _check_cotangent, _check_cotangents, _checked, _describe, _refuse_cut, batch_sizes
from ._contexts import Cache, Constant
from ._errors import ContextError, DiffifaceError, InvalidOutputError
from ._flatten import structure_flatten, structure_unflatten
from ._keys import held_arrays, static_key
from ._plan import Unfit, optree_flatten
from ._prep import FunctionRef, Signature
from ._results import _cast, _padded, _weak_or_dtype, promoted_dtype

_chain = itertools.chain.from_iterable

# -- the program --------------------------------------------------------------------------------------


def _program(
    op: Operator, adapter: Adapter, function: FunctionRef, call: Call, output: _Output, plan: _Conversions
) -> tuple[Callable[..., Any], ProgramParts]:
    """The program ``(xs, ts, dynamic_contexts, static_contexts) -> native parts``, and what an
    adapter's compile may read besides (:class:`~diffiface._adapters._base.ProgramParts`)."""
    sig = call.signature
    has_aux = sig.has_aux
    context_specs = list(call.context_specs)
    context_sizes = [len(leaves) for leaves in call.context_leaves]
    one_leaf_each = all(spec == _LEAF for spec in context_specs)
    leaf_contexts = one_leaf_each and all(plan.mask)  # (the dynamic leaves are the context values)
    # (None for a context of one leaf: _merge_contexts takes the leaf itself)
    context_rebuilds = [None if spec == _LEAF else _rebuilder(spec) for spec in context_specs]
    close, settle = _closer(op, adapter, sig.x_spec, has_aux, output, getattr(call, "rebuild", None))
    method = getattr(adapter, op.compute) if call.x_leaves else without_leaves(adapter, op.compute)
    pullback = op.compute == "value_and_pullback"
    pullback_function = adapter.pullback_function if call.x_leaves else without_leaves(adapter, "pullback_function")
    picked = [i for i, _ in op.parts] + ([1] if has_aux else [])  # the aux comes last
    only = picked[0] if len(picked) == 1 else None
    compiles = adapter.compiles
    ref = function.ref
    empty = plan.empty
    sizes = batch_sizes(sig) if op.batch else None  # (a batch: the leaves of each tangent)
    compute = op.compute

    def program(
        xs: tuple[Any, ...], ts: tuple[Any, ...], dynamic: tuple[Any, ...], static: _Static | None
    ) -> tuple[Any, ...]:
        if leaf_contexts:
            context_values = dynamic
        else:
            context_values = _merge_contexts(context_rebuilds, context_sizes, dynamic, static or empty)
        f = ref()  # (the weak reference itself: FunctionRef's call is a Python frame)
        fn = close(f if f is not None else function(), context_values, xs[0] if xs else None)
        if pullback:
            out, aux, vjp = pullback_function(fn, xs)
            ts = _check_cotangent(sig, output, ts, adapter.complex_outputs)
            result: tuple[Any, ...] = (out, aux, vjp(ts))
        elif op.tangent is None:
            result = method(fn, xs)
        elif sizes is not None:
            result = _batch_products(adapter, fn, xs, ts, sizes, sig, output, compute)
        else:
            result = method(fn, xs, ts)
        if compiles:
            output.remember(static)
        if only is not None:
            value = result[only]
            return (value.force() if type(value) is Deferred else value,)
        return tuple([force(result[i]) for i in picked])

    # what an adapter's compile may read to guard the call (torch: which context leaves f may
    # write, the Cache ones; the leaves' paths, for an error that names one)
    cache = [kind is Cache for kind, _, leaves in sig.contexts for _ in leaves]
    names = [f"contexts[{i}]{_tree.path_string(p)}" for i, spec in enumerate(context_specs) for p in spec.paths()]
    mask = plan.mask
    fused = None
    if compute in _FUSABLE and not has_aux and not compiles and getattr(call, "rebuild", None) is None:
        fused = Fused(
            function,
            sig.x_spec,
            close,
            settle,
            None if one_leaf_each else context_rebuilds,
            context_sizes,
            context_rebuilds,
            adapter,
            compute,
            len(picked) == 2,
            output.checked,
            empty,
        )
        if pullback:
            # (a partial, in C: no Python frame on the call)
            fused.cotangent = functools.partial(_check_cotangent, sig, output, complex_step=adapter.complex_outputs)
    parts = ProgramParts(
        cache_dynamic=tuple(c for c, m in zip(cache, mask, strict=True) if m),
        cache_static=tuple(c for c, m in zip(cache, mask, strict=True) if not m),
        x_names=tuple(f"x{_tree.path_string(p)}" for p in sig.x_spec.paths()),
        names_dynamic=tuple(n for n, m in zip(names, mask, strict=True) if m),
        names_static=tuple(n for n, m in zip(names, mask, strict=True) if not m),
        fused=fused,
        x_arrays=tuple(map(_weak_reference, call.x_leaves)),
    )
    return program, parts


def _weak_reference(leaf: Any) -> weakref.ref[Any] | None:
    """A weak reference to ``leaf``, or None for a value that takes none (a float): a program
    must not keep the caller's arrays alive."""
    try:
        return weakref.ref(leaf)
    except TypeError:
        return None


_FUSABLE = (
    "value_and_gradient",
    "value_and_pullback",
    "value_and_pushforward",
    "gradient_and_hvp",
    "value_and_jacobian",
)


@dataclasses.dataclass(slots=True, eq=False)
class Fused:
    """The parts of a program that an engine recording its graph as f runs (torch's
    :class:`~diffiface._adapters.torch._fused._Gradient` and the classes beside it) may run in
    one call of its own, without the program's frames:

    - ``function`` and ``ref``, its weak reference; ``single``: x is one leaf, else
      ``rebuild(leaves)`` is x;
    - ``close``, ``settle`` and ``checked``: as :func:`_closer` and :class:`_Output` have them;
    - ``contexts(dynamic, static)``: the context values; ``rebuilds``: ``merges``, or None where
      each context is one array leaf;
    - ``compute``: the adapter's method; ``value``: the program returns f's value (for an hvp,
      the gradient) before the derivative;
    - for a vjp (else None), ``cotangent(ts)``: the cotangent checked against f's output, as the
      engine takes it (the caller uses what it returns)."""

    function: FunctionRef
    x_spec: dataclasses.InitVar[Any]
    close: Callable[..., Any]
    settle: Callable[..., Any]
    rebuilds: list[Callable[[Any], Any] | None] | None
    sizes: list[int]
    merges: list[Callable[[Any], Any] | None]
    adapter: Adapter
    compute: str
    value: bool
    checked: set[tuple[type, Any]]
    empty: _Static
    ref: Any = dataclasses.field(init=False)
    single: bool = dataclasses.field(init=False)
    rebuild: Callable[[Any], Any] | None = dataclasses.field(init=False)
    cotangent: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None

    def __post_init__(self, x_spec: Any) -> None:
        self.ref = self.function.ref
        self.single = x_spec == _LEAF
        self.rebuild = None if self.single else structure_unflatten(x_spec) or x_spec.unflatten

    def contexts(self, dynamic: tuple[Any, ...], static: _Static | None = None) -> tuple[Any, ...]:
        return _merge_contexts(self.merges, self.sizes, dynamic, static or self.empty)


def _rebuilder(spec: Any) -> Callable[[Any], Any]:
    """``leaves -> tree`` of structure ``spec``: written for it where it can be (_flatten)."""
    if spec == _LEAF:
        return operator.itemgetter(0)
    return structure_unflatten(spec) or spec.unflatten


def _merge_contexts(
    rebuilds: list[Callable[[Any], Any] | None], sizes: list[int], dynamic: tuple[Any, ...], static: _Static
) -> tuple[Any, ...]:
    """The context values from their dynamic and static leaves, each rebuilt by its ``rebuilds``
    (None: the context is its one leaf, taken inline; torch.compile traces this function inside
    its graph, and cannot trace an ``operator.itemgetter``)."""
    if not static.leaves:  # every leaf dynamic (the common case): slices, in order
        values, start = [], 0
        for rebuild, size in zip(rebuilds, sizes, strict=True):
            values.append(dynamic[start] if rebuild is None else rebuild(dynamic[start : start + size]))
            start += size
        return tuple(values)
    dyn = iter(dynamic)
    stat = iter(static.leaves)
    flags = iter(static.mask)
    values = []
    for rebuild, size in zip(rebuilds, sizes, strict=True):
        leaves = [next(dyn) if next(flags) else next(stat) for _ in range(size)]
        values.append(leaves[0] if rebuild is None else rebuild(leaves))
    return tuple(values)


_PLAIN_AUX = frozenset({str, bytes, int, float, complex, bool, type(None)})


def _refuse_aux_in_objects(leaves: list[Any], adapter: Adapter, xs: tuple[Any, ...]) -> None:
    """Refuses an aux leaf that is no pytree (a plain object) holding an array of the engine's
    trace: the engine takes the leaves of f's result out of its trace, and diffiface converts
    them to x's array type; an array inside an object is neither, and would come back as a
    value of a trace that has ended (a tracer, a box, a tensor keeping its graph)."""
    for leaf in leaves:
        # (a number or a string first, by its type alone: torch.compile traces this too)
        if type(leaf) in _PLAIN_AUX or _arrays.family_of(leaf) is not None:
            continue
        for array in held_arrays(leaf):
            what = adapter.trace_value(array, xs)
            if what is not None:
                raise InvalidOutputError(
                    f"With has_aux=True, f's aux holds a {type(leaf).__name__}, which is no pytree, holding "
                    f"{what} from the {adapter.backend.name} engine's trace. The engine takes the arrays of aux "
                    "out of its trace, and diffiface gives them x's array type, only where they are pytree "
                    "leaves: this one would come back as a value of a trace that has ended. Return the arrays "
                    "in aux themselves (or in dicts, lists, tuples, namedtuples), or register "
                    f"{type(leaf).__name__} as a pytree (with optree, or the pytree registry of its framework)."
                )


def _closer(
    op: Operator,
    adapter: Adapter,
    x_spec: Any,
    has_aux: bool,
    output: _Output,
    rebuild: Callable[[Any], Any] | None = None,
) -> tuple[Callable[[Callable[..., Any], tuple[Any, ...], Any], Callable[[tuple[Any, ...]], tuple[Any, Any]]], Any]:
    """``close(f, context_values, like)``: ``f`` with its contexts bound, on a tuple of leaves,
    ``xs -> (out, aux)``, its output checked (``like``: a leaf of x, native); and
    ``settle(result, f, context_values, xs, like)``, a scalar output of f checked (what
    ``close`` runs where it is not a scalar of a type and dtype seen before). ``rebuild(xs)``:
    f's x from the leaves, where it is not ``x_spec`` of them (x has static leaves)."""
    single = x_spec == _LEAF
    if rebuild is None:
        rebuild = (None if single else adapter.rebuilder(x_spec)) or _rebuilder(x_spec)

    checked = output.checked
    scalar = op.scalar_output
    output_leaf = adapter.output_leaf
    untracked = adapter.untracked
    batches = adapter.batches
    traced_by_engine = adapter.traced_function

    def settle(
        result: Any, f: Callable[..., Any], context_values: tuple[Any, ...], xs: tuple[Any, ...], like: Any
    ) -> Any:
        """f's output, checked, where f is scalar-valued."""
        if untracked(result, xs):
            # (checked first: an output that is no number, None or a string, is refused as such)
            leaf = _checked(op, result, output, adapter)[0]
            _refuse_cut(f, context_values, xs, adapter, x_spec, rebuild, (0,))
            return output_leaf(leaf, like)
        # a scalar of a type and dtype seen before needs no more checks (nor recording:
        # what the results of scalar functions mirror does not depend on f's output)
        if (type(result), getattr(result, "dtype", None)) in checked and getattr(result, "shape", ()) == ():
            return output_leaf(result, like)
        return output_leaf(_checked(op, result, output, adapter)[0], like)

    def close(f: Callable[..., Any], context_values: tuple[Any, ...], like: Any) -> Callable[..., Any]:
        if traced_by_engine is not None:
            f = traced_by_engine(f)

        def fn(xs: tuple[Any, ...]) -> tuple[Any, Any]:
            x = xs[0] if single else rebuild(xs)
            try:
                result = f(x, *context_values)
            except Exception as exc:
                adapter.refuse_failure(exc)
                raise
            aux = None
            if has_aux:
                if not (isinstance(result, (tuple, list)) and len(result) == 2):
                    raise InvalidOutputError(
                        f"With has_aux=True, f must return a pair (value, aux); it returned {_describe(result)}."
                    )
                result, aux = result
                # its leaves and structure, apart: an engine takes the leaves through as a tuple,
                # and the structure, f's own (dict key order included), is rebuilt from it
                aux = tuple(_tree.flatten(aux))
                _refuse_aux_in_objects(aux[0], adapter, xs)
            if scalar:
                if (
                    (type(result), getattr(result, "dtype", None)) in checked
                    and getattr(result, "shape", ()) == ()
                    and not untracked(result, xs)
                ):
                    return output_leaf(result, like), aux  # (inline, not settle's frame: the common case)
                return settle(result, f, context_values, xs, like), aux
            if (type(result), getattr(result, "dtype", None)) in checked and output.repeats(
                getattr(result, "shape", ())
            ):  # one array of a type, dtype and shape seen last: checked, and its record unchanged
                if untracked(result, xs):
                    _refuse_cut(f, context_values, xs, adapter, x_spec, rebuild, (0,))
                return (output_leaf(result, like),), aux
            leaves = _checked(op, result, output, adapter)
            for leaf in leaves:
                if untracked(leaf, xs):  # (each leaf the trace misses must not change with x)
                    cut = tuple(i for i, leaf in enumerate(leaves) if untracked(leaf, xs))
                    _refuse_cut(f, context_values, xs, adapter, x_spec, rebuild, cut)
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

    return close, settle


def _batch_products(
    adapter: Adapter,
    fn: Callable[..., Any],
    xs: tuple[Any, ...],
    ts: tuple[Any, ...],
    sizes: tuple[int, ...],
    sig: Signature,
    output: _Output,
    compute: str,
) -> tuple[Any, ...]:
    """A batched operator's products, ``(out, aux, [product per tangent])`` (for hvps
    ``(value, aux, gradient, [hvp per tangent])``): the adapter's batch methods, one vmapped
    program on jax and torch.func, a loop elsewhere."""
    groups = []
    start = 0
    for size in sizes:
        groups.append(tuple(ts[start : start + size]))
        start += size
    if compute == "value_and_pullbacks":
        out, aux, vjp = (adapter.pullback_function if xs else without_leaves(adapter, "pullback_function"))(fn, xs)
        groups = _check_cotangents(sig, output, groups, adapter.complex_outputs)
        return out, aux, adapter.pullbacks(vjp, xs, groups)
    if not xs:  # (no leaves: each tangent's product is known without the engine, see without_leaves)
        one = without_leaves(adapter, compute[:-1])  # (value_and_pushforward, gradient_and_hvp)
        each = [one(fn, xs, group) for group in groups]
        return (*each[-1][:-1], [products[-1] for products in each])
    return getattr(adapter, compute)(fn, xs, groups)  # type: ignore[no-any-return]


MISSED: Any = object()
"""What :meth:`JitProgram.run` returns for a call that does not fit its prep."""


def _refused(explain: Callable[[BaseException], str | None], exc: Exception) -> None:
    """Raise the diffiface error ``explain`` gives where the engine refused f outside f's own
    code (jax refuses forward mode through a custom_vjp function when jit lowers the trace,
    after f has run). f's own errors were explained where f ran: no hint is repeated."""
    if not isinstance(exc, DiffifaceError):
        explain(exc)


class JitProgram:
    """The program of a prep that an engine compiles and retraces for new shapes and dtypes
    (jax's ``jit``, mlx's ``mx.compile``, ``tf.function``, torch.compile): one compiled function
    of the leaves of ``(x, tangent, *context values)``, taken as they are.

    :meth:`run` takes the call as the route has it and tests what the trace cannot (f, the
    operator, the backend, the contexts' kinds, structures, leaf types, numpy dtypes); the trace
    returns None where a leaf's shape or dtype is not the prep's, so a call that fits costs no
    test of them. The trace finishes the result as far as it can (:meth:`_pick`), :meth:`_after`
    the rest. :meth:`__call__` runs it on a call's leaves (the route's other steps)."""

    __slots__ = (
        "after", "arguments", "backend", "backend_fields", "candidate", "casts", "compiled", "dtype", "dtype_name",
        "expected", "explain", "finish", "fits_backend", "flatten", "kind", "kinds", "leaf_types", "method", "mirror",
        "names", "numpy_leaves", "operator", "output", "program", "records", "ref", "scope", "sizes", "structure",
        "tangent", "traced_dtype", "tree", "trees", "x_dtype_names", "x_dtypes", "x_rebuild",
    )  # fmt: skip

    def __init__(
        self,
        adapter: Adapter,
        program: Callable[..., Any],
        op: Operator,
        output: _Output,
        mirror: Callable[[Any], Any] | None,
        finish: Callable[[Any], Any],
        call: Call,
        scoped: bool,
        program_parts: ProgramParts,
    ) -> None:
        kind = op.parts[0][1]
        like = call.x_leaves[0]
        sig = call.signature
        self.explain = adapter.explain_failure
        self.tangent = op.tangent is not None
        parts = [call.x_leaves, *([call.tangent_leaves] if self.tangent else []), *call.context_leaves]
        specs = [sig.x_spec, *([sig.tangent_spec] if self.tangent else []), *call.context_specs]
        self.arguments: tuple[tuple[Any, Any], ...] = ()  # per argument, the plan's (flatten, structure)
        leaves = [leaf for part in parts for leaf in part]
        self.leaf_types = list(map(type, leaves))
        # Where a tree is among the arguments, one function written for the structure of them
        # all takes them apart in one frame; else each argument by the plan's flattening of it.
        self.flatten: Callable[[Any], tuple[Any, Any]] | None = None
        self.trees = not all(spec == _LEAF for spec in specs)
        self.structure: Any = None  # (what the written function returns for arguments that fit)
        if self.trees:
            arguments = [optree.tree_unflatten(spec, part) for part, spec in zip(parts, specs, strict=True)]
            found, spec = optree.tree_flatten(arguments)  # type: ignore[arg-type,var-annotated]
            if len(found) == len(leaves) and all(a is b for a, b in zip(found, leaves, strict=True)):
                self.flatten = structure_flatten(spec, spec, arguments, optree_flatten())
                self.structure = spec
        self.sizes = (len(call.x_leaves), len(call.x_leaves) + len(call.tangent_leaves))
        self.expected = tuple((leaf.shape, leaf.dtype) for leaf in leaves)
        self.numpy_leaves = tuple((i, leaf.dtype) for i, leaf in enumerate(leaves) if type(leaf) is np.ndarray)
        self.kind = kind
        one = len(op.parts) == 1
        # (a result that mirrors x is x's one leaf only where x is that leaf, not a tree holding it)
        self.candidate = adapter.returns_like(like) and one and (sig.x_spec == _LEAF or kind in ("value", "y"))
        self.dtype = like.dtype if self.candidate else None
        self.dtype_name = _arrays.dtype_name(like)
        # Where x's leaves are the engine's own arrays, the results' blocks come out of the trace
        # as they must be, and need at most rebuilding into the trees of x and of f's output:
        # inside the trace where the engine rebuilds x's tree as optree does (``tree``), else
        # after it (``x_rebuild``).
        own = (
            one
            and all(map(adapter.returns_like, call.x_leaves))
            and adapter.traces_call(op.compute, call.x_leaves, False, None)
        )
        self.x_dtypes = tuple(leaf.dtype for leaf in call.x_leaves)
        self.x_dtype_names = tuple(map(_arrays.dtype_name, call.x_leaves))
        self.tree = sig.x_spec if own and kind == "x" and adapter.rebuilds_in_trace(sig.x_spec, call.x_leaves) else None
        self.x_rebuild = _rebuilder(sig.x_spec) if own and kind in ("x", "jacobian", "hessian", "y") else None
        # A Jacobian's or Hessian's blocks cast inside the trace (x's dtypes, by leaf): mixed
        # dtypes (float32 params, a float64 batch) cost no cast per block on every call.
        self.casts: tuple[str | None, ...] | None = None
        if kind in ("jacobian", "hessian") and not self.candidate:
            self.casts = tuple(map(_weak_or_dtype, call.x_leaves))
        self.after: Callable[[Any], Any] | None = self._after  # (what finishes a result, :meth:`_after`)
        self.output = output
        self.mirror = mirror
        self.finish = finish
        self.records = op.shaped_as_output  # (see :meth:`_after`)
        self.program = program
        self.scope = adapter.scope if scoped else None
        self.operator = op.name
        self.traced_dtype = adapter.traced_dtype  # (a numpy leaf's dtype as the trace sees it)
        self.compiled = adapter.compile(self._traced, static=False, arrays=True, layouts=(), parts=program_parts)
        # (what :meth:`run` compares besides, taken from the plan by :meth:`bind`)
        self.ref: Any = None
        self.method: Any = None
        self.backend: Any = None
        self.backend_fields: dict[str, Any] | None = None
        self.names: frozenset[str] = frozenset()
        self.fits_backend: Callable[[Any], bool] = bool
        self.kinds: tuple[type, ...] = ()

    def bind(self, plan: Any) -> None:
        """Take what :meth:`run` compares from the plan made for this program."""
        self.ref = plan.function.ref
        prepared = plan.function.ref()
        if type(prepared) is types.MethodType:  # (made anew on each read: its instance and function)
            with contextlib.suppress(TypeError):  # (an instance without weak references: the plan's steps)
                self.ref, self.method = weakref.ref(prepared.__self__), weakref.ref(prepared.__func__)
        self.backend, self.names, self.fits_backend = plan.backend, plan.names, plan.fits_backend
        # (a frozen dataclass's fields are its __dict__, compared in C; its __eq__ is a frame)
        self.backend_fields = _fields_only(plan.backend)
        self.kinds = plan.context_kinds
        self.arguments = (
            (plan.x_flatten, plan.x_key),
            *([(plan.tangent_flatten, plan.tangent_key)] if self.tangent else []),
            *zip(plan.context_flattens, plan.context_keys, strict=True),
        )

    # -- inside the trace --------------------------------------------------------------------------

    def _traced(self, *leaves: Any) -> Any:
        for leaf, (shape, dtype) in zip(leaves, self.expected, strict=True):
            if leaf.shape != shape or (leaf.dtype != dtype and leaf.dtype != self.traced_dtype(dtype)):
                return None  # (no program's result: the call does not fit)
        xs, ts = self.sizes
        native = self.program(leaves[:xs], leaves[xs:ts], leaves[ts:], None)
        return self._pick(native)

    def _finishes(self) -> bool:
        """Whether :meth:`_pick` returns the result finished (read from the record of f's output)."""
        if self.candidate:
            kind = self.kind
            return kind in ("x", "value", "hessian") or (kind in ("jacobian", "y") and self.output.spec is _LEAF)
        return self.tree is not None

    def _pick(self, native: tuple[Any, ...]) -> Any:
        """The program's result, finished as far as it can be (inside the trace)."""
        kind = self.kind
        if kind == "x" and (self.candidate or self.x_rebuild is not None):
            leaves = [  # cast only where needed: a weak type stays weak
                leaf if leaf.dtype == dtype else _recast(leaf, name)
                for leaf, dtype, name in zip(native[0], self.x_dtypes, self.x_dtype_names, strict=True)
            ]
            if self.candidate:
                return leaves[0]
            return leaves if self.tree is None else optree.tree_unflatten(self.tree, leaves)
        if self._finishes():
            dtype, value = self.dtype, native[0]
            if kind == "value":
                return value
            if kind == "y":
                return value[0]
            leaf = value[0][0]
            if kind == "hessian":
                return leaf if leaf.dtype == dtype else _recast(leaf, self.dtype_name)
            return _cast(leaf, promoted_dtype(self.output.dtypes[0], self.dtype_name))
        if self.casts is not None and len(native) == 1:
            x_dtypes, rows = self.casts, native[0]
            dys = _padded(self.output.dtypes, len(rows)) if kind == "jacobian" else x_dtypes
            native = (
                tuple(
                    tuple(_cast(block, promoted_dtype(dy, dx)) for block, dx in zip(row, x_dtypes, strict=True))
                    for row, dy in zip(rows, dys, strict=True)
                ),
            )
        return native[0][0] if self.mirror is not None else native

    # -- the calls ----------------------------------------------------------------------------------

    def run(
        self, name: str, f: Any, backend: Any, x: Any, tangent: Any, contexts: tuple[Any, ...], has_aux: bool
    ) -> Any:
        """A call by the route's arguments: its result, or :data:`MISSED` where it does not fit."""
        # (hot code: one frame where no argument is a tree)
        if name != self.operator or has_aux or len(contexts) != len(self.kinds):
            return MISSED
        method = self.method
        if method is None:
            if self.ref() is not f:
                return MISSED
        elif type(f) is not types.MethodType or f.__self__ is not self.ref() or f.__func__ is not method():
            return MISSED
        mine = self.backend
        if backend is not mine:
            if type(backend) is str:
                if backend not in self.names:
                    return MISSED
            elif self.backend_fields is not None:
                if type(backend) is not type(mine) or vars(backend) != self.backend_fields:
                    return MISSED
            elif not self.fits_backend(backend):
                return MISSED
        # (index loops, not zip, map or list(): after the engine's work has emptied the
        # processor's caches, those builtins cost more here than these loops' bytecodes:
        # benchmarks/jit_route.py, pinned and interleaved)
        arguments = [x, tangent] if self.tangent else [x]
        kinds = self.kinds
        i = 0
        while i < len(kinds):
            context = contexts[i]
            if type(context) is not kinds[i]:
                return MISSED
            arguments.append(context.value)  # type: ignore[attr-defined]
            i += 1
        flatten = self.flatten
        if flatten is not None:
            leaves, key = flatten(arguments)
            if key is not self.structure:
                return MISSED
        elif self.trees:  # (no function written for them: each argument by the plan's flattening)
            found = self._leaves(arguments)
            if found is None:
                return MISSED
            leaves = found
        else:  # (every argument one array)
            leaves = arguments
        leaf_types = self.leaf_types
        if len(leaves) != len(leaf_types):
            return MISSED
        i = 0
        while i < len(leaf_types):
            if type(leaves[i]) is not leaf_types[i]:
                return MISSED
            i += 1
        if self.numpy_leaves:
            for i, dtype in self.numpy_leaves:
                if leaves[i].dtype != dtype:
                    return MISSED
        scoped = self.scope
        scope = None if scoped is None else scoped()  # (no walrus: AutoGraph reads this method)
        try:  # (f is traced here on a prep's first call where preparing did not trace it)
            if scope is None:
                out = self.compiled(*leaves)
            else:
                with scope:
                    out = self.compiled(*leaves)
        except Exception as exc:
            _refused(self.explain, exc)
            raise
        if out is None:  # (:meth:`_traced`: the shapes or dtypes are not the prep's)
            return MISSED
        after = self.after
        return out if after is None else after(out)

    def _leaves(self, arguments: list[Any]) -> list[Any] | None:
        """The leaves of the arguments, each flattened by the plan's flattening of it, where
        no function is written for their structure (a namedtuple, a registered class, a large
        tree); None where an argument's structure is not the prep's."""
        leaves: list[Any] = []
        for argument, (flatten, key) in zip(arguments, self.arguments):  # noqa: B905
            try:
                found, spec = flatten(argument)
            except Exception:  # (a tree the flattening cannot take apart: the full signature says why)
                return None
            if spec != key:
                return None
            leaves += found
        return leaves

    def __call__(
        self, x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]
    ) -> tuple[Any, Any]:
        leaves = [*x_leaves, *tangent_leaves, *_chain(context_leaves)]
        scope = None if self.scope is None else self.scope()
        try:  # (f is traced here on a prep's first call)
            if scope is None:
                out = self.compiled(*leaves)
            else:
                with scope:
                    out = self.compiled(*leaves)
        except Exception as exc:
            _refused(self.explain, exc)
            raise
        if out is None:
            raise Unfit("The arguments' shapes or dtypes are not the prep's.")
        after = self.after
        return (out if after is None else after(out)), None

    def _after(self, out: Any) -> Any:
        """The first result, finished; and what finishes the later ones, settled (:attr:`after`)."""
        after: Callable[[Any], Any] | None
        if self._finishes():
            after = None
        elif self.x_rebuild is not None and self.kind == "x":
            after = self.x_rebuild
        elif self.x_rebuild is not None:  # (the trace recorded f's output: its structure)
            after = _rebuilt(self.kind, _rebuilder(self.output.spec), self.x_rebuild)
        elif self.mirror is not None:
            after = self.mirror
        elif self.records:
            # a program from jit's cache does not evaluate f: the record of its trace is made the
            # current one before the finisher reads it (the program has no static argument)
            output, finish = self.output, self.finish

            def recalled(out: Any) -> Any:
                output.recall(None)
                return finish(out)

            after = recalled
        else:
            after = self.finish
        self.after = after
        return out if after is None else after(out)


def _recast(leaf: Any, dtype: str) -> Any:
    """A traced leaf cast to the dtype of this name, by its family (an engine's arrays need not
    have numpy's ``astype``)."""
    family = _arrays.family_of(leaf)
    assert family is not None  # (a leaf of the engine that retraces)
    return family.cast(leaf, dtype)


def _fields_only(backend: Any) -> dict[str, Any] | None:
    """A backend's ``vars`` where its attributes are its dataclass fields and nothing else (two
    such backends of one type are equal when their ``vars`` are); else None."""
    try:
        fields = vars(backend)
        return fields if set(fields) == {field.name for field in dataclasses.fields(backend)} else None
    except TypeError:
        return None


def _rebuilt(kind: str, y_rebuild: Callable[[Any], Any], x_rebuild: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A jvp's result (``kind`` ``"y"``), a Jacobian's or a Hessian's, whose blocks need no
    conversion (:class:`JitProgram`), rebuilt into the trees of f's output and of x."""

    def rebuilt(out: Any) -> Any:
        value = out[0]
        if kind == "y":
            return y_rebuild(value)
        rows = [x_rebuild(row) for row in value]
        return y_rebuild(rows) if kind == "jacobian" else x_rebuild(rows)

    return rebuilt


@dataclasses.dataclass(slots=True, eq=False)
class Run:
    """A prep's program on a call's leaves, ``(result, error estimate or None)``: the leaves
    converted (:class:`_Conversions`), the program run, the result finished. ``dynamic``: the
    indices of x's leaves to differentiate, where x holds static ones too."""

    adapter: Adapter
    conversions: _Conversions
    compiled: Callable[..., Any]
    output: _Output
    finish: Callable[[Any], Any]
    op: dataclasses.InitVar[Operator]
    has_aux: bool
    dynamic: list[int] | None = None
    records: bool = dataclasses.field(init=False)
    estimates: bool = dataclasses.field(init=False)
    parts: tuple[int, ...] = dataclasses.field(init=False)
    scoped: bool = dataclasses.field(init=False)
    direct: bool = dataclasses.field(init=False)
    kept: tuple[type | None, ...] = dataclasses.field(init=False)

    def __post_init__(self, op: Operator) -> None:
        conversions = self.conversions
        self.records = self.adapter.compiles and op.shaped_as_output  # (see JitProgram._after)
        self.estimates = self.adapter.estimates_errors
        self.parts = tuple(i for i, _ in op.parts)
        self.scoped = conversions.scoped
        # the engine takes the leaves as they are, in no scope, and nothing but the results is read
        passthrough = conversions.passthrough and conversions.x_native and conversions.tangent_native
        self.direct = passthrough and not (self.records or self.estimates or self.scoped) and self.dynamic is None
        self.kept = conversions.kept

    def __call__(
        self, x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]
    ) -> tuple[Any, Any]:
        try:
            if self.direct:  # (the common call, in this one frame)
                dynamic = tuple(_chain(context_leaves)) if context_leaves else ()
                if tuple(map(type, dynamic)) == self.kept:  # (else converted: see _Conversions.native)
                    return self.finish(self.compiled(tuple(x_leaves), tuple(tangent_leaves), dynamic, None)), None
            if self.dynamic is not None:
                x_leaves = [x_leaves[i] for i in self.dynamic]
            scope = self.adapter.scope() if self.scoped else None
            if scope is None:
                return self._run(x_leaves, tangent_leaves, context_leaves)
            with scope:
                return self._run(x_leaves, tangent_leaves, context_leaves)
        except Exception as exc:
            _refused(self.adapter.explain_failure, exc)
            raise

    def _run(self, x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]) -> tuple[Any, Any]:
        arguments = self.conversions.native(x_leaves, tangent_leaves, context_leaves)
        native = self.compiled(*arguments)
        if self.records:
            self.output.recall(arguments[3])
        result = self.finish(native)
        if not self.estimates:
            return result, None
        error = self.adapter.take_error()
        if error is None:
            return result, None
        picked = tuple(error[i] for i in self.parts)
        return result, self.finish((*picked, None) if self.has_aux else picked)


# -- the program's arguments ---------------------------------------------------------------------------


class _Conversions:
    """How a call's leaves become the program's arguments ``(xs, ts, dynamic, static)``,
    settled once from the prepared call: a signature fixes every leaf's kind, and with it
    which conversions do nothing and which context leaves are arrays."""

    __slots__ = (
        "adapter", "empty", "kept", "mask", "op", "passthrough", "scoped", "signature", "tangent_native", "weak",
        "x_native",
    )  # fmt: skip

    def __init__(self, adapter: Adapter, op: Operator, call: Call) -> None:
        self.adapter, self.op, self.signature = adapter, op, call.signature
        # float64 work that may need the adapter's precision scope (jax's x64), checked per call
        self.scoped = adapter.scoped and _involves_float64(call)
        self.weak = None if adapter.weak_floats else _weak_dtypes(call.x_leaves)
        scope = adapter.scope() if self.scoped else None
        with scope if scope is not None else contextlib.nullcontext():
            xs = self._xs(call.x_leaves)
            self.x_native = all(a is b for a, b in zip(xs, call.x_leaves, strict=True))
            self.tangent_native = all(
                a is b for a, b in zip(self._tangents(call.tangent_leaves, xs), call.tangent_leaves, strict=True)
            )
            like = _float_like(xs)
            mask: list[bool] = []
            kept: list[type | None] = []
            passthrough = True
            for index, leaves in enumerate(call.context_leaves):
                for leaf in leaves:
                    native, is_array = self._context(leaf, like, index)
                    if not is_array and adapter.compiles:
                        _refuse_unseen_static(adapter, self.signature, index, native)
                    mask.append(is_array)
                    kept.append(type(leaf) if native is leaf else None)
                    passthrough = passthrough and is_array and native is leaf
        self.mask = tuple(mask)
        # each context leaf's type where the engine takes it as it is (a torch tensor, a module):
        # a later leaf of that type is taken so too, without the conversion's call
        self.kept = tuple(kept)
        self.passthrough = passthrough  # every context leaf an array the engine takes as it is
        self.empty = _Static([], self.mask)  # the static argument when no leaf is static

    def _xs(self, leaves: list[Any]) -> tuple[Any, ...]:
        """x's leaves for the engine. A Python float reaches f as an engine takes one weakly
        (jax's, torch's): where the engine has no weak number, as a 0-d array of the dtype x's
        float arrays share (``weak``, :func:`_weak_dtypes`), so that a float32 f stays float32."""
        if self.weak is None:
            return tuple(map(self.adapter.to_native, leaves))
        index, real, complex_ = self.weak
        like = leaves[index]
        return tuple(
            _number_to_native(self.adapter, leaf, complex_ if type(leaf) is complex else real, like)
            if type(leaf) in (float, complex)
            else self.adapter.to_native(leaf)
            for leaf in leaves
        )

    def _tangents(self, leaves: list[Any], xs: tuple[Any, ...] | list[Any]) -> tuple[Any, ...]:
        """Tangent leaves for the engine: those of a tangent of x take the dtypes of x's leaves."""
        if self.op.tangent == "x":
            if self.op.batch and xs:  # each tangent of the batch, leaf by leaf as x
                xs = tuple(xs) * (len(leaves) // len(xs))
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
        except DiffifaceError:  # (the adapter's own refusal says why)
            raise
        except (TypeError, ValueError) as exc:
            raise _unconvertible_context(self.adapter, self.signature, index, leaf) from exc

    def native(
        self, x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]
    ) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], _Static | None]:
        """The program's arguments; the static one is None when no context leaf is static
        (cheaper for jit to compare than an empty :class:`_Static`)."""
        xs = tuple(x_leaves) if self.x_native else self._xs(x_leaves)
        ts = tuple(tangent_leaves) if self.tangent_native else self._tangents(tangent_leaves, xs)
        if self.passthrough:
            if not context_leaves:
                return xs, ts, (), None
            flat = tuple(leaf for leaves in context_leaves for leaf in leaves)
            # (a leaf of another type that fits the signature, a numpy scalar for a 0-d array,
            # is converted below: the engine took the first as it was, not this one)
            if tuple(map(type, flat)) == self.kept:
                return xs, ts, flat, None
        like = MISSED  # (found only where a leaf is converted: a context's Python float takes its dtype)
        dynamic: list[Any] = []
        static: list[Any] = []
        kept, mask = self.kept, self.mask
        i = 0
        for index, leaves in enumerate(context_leaves):
            for leaf in leaves:
                if type(leaf) is kept[i]:
                    native = leaf
                else:
                    if like is MISSED:
                        like = _float_like(xs)
                    native = self._context(leaf, like, index)[0]
                (dynamic if mask[i] else static).append(native)
                i += 1
        return xs, ts, tuple(dynamic), _Static(static, mask) if static else None


def _float_like(xs: Sequence[Any]) -> Any:
    """The leaf of x whose dtype a context's Python float takes (``Adapter.context_to_native``'s
    ``like``): x's first inexact leaf where all of them share one dtype; else None."""
    inexact = [leaf for leaf in xs if _arrays.dtype_name(leaf).startswith(("float", "complex", "bfloat"))]
    return inexact[0] if inexact and len(set(map(_arrays.dtype_name, inexact))) == 1 else None


_NARROW = {
    "float16": ("float16", "complex64"),
    "bfloat16": ("bfloat16", "complex64"),
    "float32": ("float32", "complex64"),
    "complex64": ("float32", "complex64"),
}
"""A dtype narrower than float64, and the real and complex dtypes of its precision."""


def _weak_dtypes(leaves: Sequence[Any]) -> tuple[int, str, str] | None:
    """Where x holds a Python float or complex and its float arrays share one dtype narrower
    than float64: the index of the first such array, and the real and complex dtypes the number
    takes, as the engines' promotion gives it; else None."""
    if not any(type(leaf) in (float, complex) for leaf in leaves):
        return None
    arrays = [i for i, leaf in enumerate(leaves) if type(leaf) not in (float, complex)]
    like = _float_like([leaves[i] for i in arrays])
    if like is None:
        return None
    narrow = _NARROW.get(_arrays.dtype_name(like))
    if narrow is None:
        return None
    index = next(i for i in arrays if leaves[i] is like)
    return index, *narrow


def _involves_float64(call: Call) -> bool:
    """Whether a call's arguments hold float64 data: a float64 or complex128 array, or a Python
    number in x or a tangent where x's float arrays share no narrower dtype for it to take
    (:func:`_weak_dtypes`; beside float32 arrays it is float32 data, as the engines take it)."""
    arrays = [leaf for leaf in call.x_leaves if type(leaf) not in (float, complex)]
    like = _float_like(arrays)
    numbers_wide = like is None or _arrays.dtype_name(like) not in _NARROW
    for leaf in (*call.x_leaves, *call.tangent_leaves):
        if isinstance(leaf, (float, complex)):
            if numbers_wide:
                return True
        elif _arrays.dtype_name(leaf) in ("float64", "complex128"):
            return True
    return any(
        _arrays.is_array(leaf) and _arrays.dtype_name(leaf) in ("float64", "complex128")
        for leaves in call.context_leaves
        for leaf in leaves
    )


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
        return _number_to_native(adapter, float(t), _arrays.dtype_name(like), like)
    return adapter.to_native(t)


def _number_to_native(adapter: Adapter, number: Any, name: str, like: Any) -> Any:
    """A Python number as the engine's 0-d array of dtype ``name``, cast by the family of
    ``like`` (an array) where numpy has no such dtype (bfloat16, unless ml_dtypes is imported)."""
    try:
        dtype = np.dtype(name)
    except TypeError:
        family = _arrays.family_of(like)
        if family is None or not family.ARRAY:
            raise
        return family.cast(adapter.to_native(number), name)
    return adapter.to_native(np.asarray(number, dtype=dtype))


class _Static:
    """The non-array context leaves, hashable so that jit can take them as a static argument:
    compared by :func:`static_key` (a compiling engine refuses leaves that have none,
    :func:`_refuse_unseen_static`)."""

    __slots__ = ("_key", "leaves", "mask")

    def __init__(self, leaves: list[Any], mask: tuple[bool, ...]) -> None:
        self.leaves = leaves
        self.mask = mask
        self._key: tuple[Any, ...] | None = None  # (made where compared: an engine that does not jit never does)

    @property
    def key(self) -> tuple[Any, ...]:
        if self._key is None:
            self._key = tuple(static_key(v) for v in self.leaves)
        return self._key

    def __hash__(self) -> int:
        return hash((self.key, self.mask))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self.key == other.key and self.mask == other.mask


def _refuse_unseen_static(adapter: Adapter, signature: Signature, index: int, leaf: Any) -> None:
    """A compiled program bakes static context leaves in; one it could not tell changed from
    unchanged would be reused stale, so it is refused."""
    if static_key(leaf) is not None:
        return
    kind = signature.contexts[index][0].__name__
    backend = adapter.backend
    option = next((name for name in ("jit", "compile") if getattr(backend, name, None) is True), None)
    eager = f"{type(backend).__name__}({option}=False)" if option else "a backend that does not compile"
    raise ContextError(
        f"Context {index} (a di.{kind}) holds a {type(leaf).__name__}, which the compiled "
        f"{backend.name} program must take as static, compile-time data. It is compared by "
        "identity, not by value, so a later change to it (an attribute set, an in-place update) "
        "would silently reuse the old value. Pass its numbers as arrays or in a dict or dataclass "
        "registered as a pytree (di.Constant({'a': obj.a})), make it a frozen dataclass of values "
        "(numbers, strings, other such dataclasses), or use "
        f"{eager}."
    )
