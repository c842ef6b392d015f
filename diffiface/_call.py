"""A call: the operator, the flattened arguments and the signature a prep is matched against;
the view of x without its static leaves, and the record of f's output. :class:`Operator` lives
here, at the bottom of the dispatch modules, because every other one speaks of it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree

from . import _arrays
from . import tree as _tree
from ._adapters._base import Adapter
from ._backends import Backend
from ._contexts import Context
from ._errors import ContextError, InvalidInputError
from ._flatten import key_orders
from ._keys import held_signature, key_or_identity, static_key
from ._keys import is_static as _is_static
from ._prep import Prep, Signature
from ._tangents import Tangents


@dataclass(frozen=True)
class Operator:
    """How one public operator is computed and what it returns.

    ``compute`` names the adapter method; ``parts`` picks ``(index, kind)`` pieces of its
    result, where kind says what the piece mirrors: ``value`` (a scalar), ``y`` (the output
    of f), ``dy`` (a derivative shaped as f's output), ``x``, ``jacobian`` (y-structure of
    x-structure), ``hessian`` (x of x). The dtype of ``dy``, ``jacobian`` and ``hessian``
    pieces is that of the pair of leaves they relate, promoted (:func:`promoted_dtype`); ``ys``
    and ``xs`` (batched operators) a :class:`~diffiface.Tangents` of ``y`` and ``x`` pieces.
    """

    name: str
    compute: str
    parts: tuple[tuple[int, str], ...]
    tangent: str | None = None
    scalar_output: bool = False
    scalar_input: bool = False
    aux: bool = False
    batch: bool = False
    """The tangent is a :class:`~diffiface.Tangents` batch; ``compute`` takes them all at once
    and the ``ys`` / ``xs`` parts hold one result per tangent."""

    @property
    def shaped_as_output(self) -> bool:
        """Whether a part is shaped as f's output, so that finishing it reads the record of f's
        output (which a compiled program's cached run does not make afresh)."""
        return any(kind in ("y", "dy", "jacobian", "ys") for _, kind in self.parts)


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
    Operator("batched_jvp", "value_and_pushforwards", ((2, "ys"),), tangent="x", batch=True),
    Operator(
        "value_and_batched_jvp", "value_and_pushforwards", ((0, "y"), (2, "ys")), tangent="x", aux=True, batch=True
    ),
    Operator("batched_vjp", "value_and_pullbacks", ((2, "xs"),), tangent="y", batch=True),
    Operator("value_and_batched_vjp", "value_and_pullbacks", ((0, "y"), (2, "xs")), tangent="y", aux=True, batch=True),
    Operator("hvp", "gradient_and_hvp", ((3, "x"),), tangent="x", scalar_output=True),
    Operator("gradient_and_hvp", "gradient_and_hvp", ((2, "x"), (3, "x")), tangent="x", scalar_output=True),
    Operator("batched_hvp", "gradient_and_hvps", ((3, "xs"),), tangent="x", scalar_output=True, batch=True),
    Operator(
        "gradient_and_batched_hvp",
        "gradient_and_hvps",
        ((2, "x"), (3, "xs")),
        tangent="x",
        scalar_output=True,
        batch=True,
    ),
)


OPERATORS: dict[str, Operator] = {op.name: op for op in _OPERATORS}


# -- a call: flattened arguments and their signature ------------------------------------------

_LEAF = _tree.structure(0)  # type: ignore[arg-type]  # a leaf's structure

_ARRAY_KINDS = frozenset(name for name, family in _arrays.BY_KIND.items() if family.ARRAY)
"""The kinds whose leaves are arrays (not Python numbers, not values an enclosing trace holds)."""


class Call:
    """The flattened arguments of one call, and the signature a prep is matched against."""

    __slots__ = ("context_leaves", "context_specs", "signature", "tangent_leaves", "x_leaves")

    def __init__(
        self,
        op: Operator,
        backend: Backend,
        x: Any,
        tangent: Any,
        contexts: tuple[Any, ...],
        has_aux: bool,
        by_value: bool = False,
    ) -> None:
        """``by_value``: the program is built for the values of the contexts' leaves that are not
        arrays (a sparsity pattern is), so they are part of the signature."""
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
            if op.batch or type(tangent) is Tangents:
                _check_batch(op, tangent)
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
            leaf_signatures = tuple(_context_leaf_signature(leaf, by_value) for leaf in leaves)
            context_signature.append((type(context), spec, leaf_signatures))
        self.signature = Signature(
            op.name,
            backend,
            has_aux,
            x_spec,
            x_signature,
            t_spec,
            tuple(leaf_signature(leaf) for leaf in self.tangent_leaves),
            tuple(context_signature),
            () if x_spec is _LEAF else key_orders(x_spec),
            tuple(() if spec is _LEAF else key_orders(spec) for spec in self.context_specs),
        )

    @property
    def leaf_types(self) -> tuple[Any, ...]:
        """The types of the call's leaves, which a plan's tests compare (an ``nn.Parameter`` is
        not a plain tensor there) and a signature does not: the cache keeps a prep per set of them."""
        return (
            tuple(map(type, self.x_leaves)),
            tuple(map(type, self.tangent_leaves)),
            tuple(tuple(map(type, leaves)) for leaves in self.context_leaves),
        )


def _context_leaf_signature(leaf: Any, by_value: bool) -> tuple[Any, ...]:
    if _arrays.is_array(leaf):
        return _arrays.leaf_signature(leaf)
    if by_value:
        # (and the arrays a plain object holds: a pattern found for their shapes holds for no other)
        held = held_signature(leaf)
        return (
            ("static", type(leaf), key_or_identity(leaf), held)
            if held
            else ("static", type(leaf), key_or_identity(leaf))
        )
    return ("static", type(leaf))


def _x_signature(leaves: list[Any]) -> tuple[Any, ...]:
    """The signatures of x's leaves. A static leaf (:func:`_is_static`) is passed to f as it is,
    so a prep is made for its value (:func:`key_or_identity`)."""
    leaf_signature = _arrays.leaf_signature
    signature = tuple([leaf_signature(leaf) for leaf in leaves])
    for entry in signature:  # the common case, all arrays and floats: nothing more to do
        if entry[0] == "other" or (entry[0] == "python" and entry[1] is not float):
            return tuple(
                ("static", type(leaf), key_or_identity(leaf)) if _is_static(leaf) else entry
                for leaf, entry in zip(leaves, signature, strict=True)
            )
    return signature


# -- the view of x without its static leaves ---------------------------------------------------


class _DynamicView(Call):
    """A call whose x holds static leaves, seen as the tree of the leaves to differentiate:
    x's structure with ``None`` in place of each static leaf, which is how the results come
    back. ``rebuild(xs)`` makes f's x of those leaves and the prepared static ones."""

    __slots__ = ("rebuild",)
    rebuild: Callable[[Any], Any]


def _dynamic_view(adapter: Adapter, call: Call) -> tuple[Call, list[int] | None]:
    """``call`` itself where every leaf of x is differentiated (or none is: then x is refused);
    else the :class:`_DynamicView` of its leaves to differentiate, and their indices."""
    static = [_is_static(leaf) for leaf in call.x_leaves]
    if not any(static) or all(static):
        return call, None
    sig = call.signature
    paths = sig.x_spec.paths()
    if adapter.compiles:
        for path, leaf, is_static in zip(paths, call.x_leaves, static, strict=True):
            if is_static and static_key(leaf) is None and not callable(leaf):
                raise InvalidInputError(
                    f"x{_tree.path_string(path)} is a {type(leaf).__name__}, which is not differentiated but passed to f "
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

    # (x as the engine rebuilds it from all its leaves: compiled torch in Python, which its
    # trace follows, where optree's rebuild in C is refused)
    unflatten = adapter.rebuilder(full_spec) or full_spec.unflatten

    def rebuild(xs: tuple[Any, ...] | list[Any]) -> Any:
        leaves = list(prepared)
        for i, leaf in zip(dynamic_index, xs, strict=True):
            leaves[i] = leaf
        return unflatten(leaves)

    view.rebuild = rebuild
    return view, dynamic_index


# -- a batch of tangents ---------------------------------------------------------------------------


_BATCHED = {op.name.replace("batched_", ""): op.name for op in _OPERATORS if op.batch}
"""The batched form of each operator of one tangent."""


def _check_batch(op: Operator, tangent: Any) -> None:
    """A batched operator takes a non-empty :class:`Tangents`; any other takes one tangent."""
    role = "tangent" if op.tangent == "x" else "cotangent"
    if not op.batch:
        batched = _BATCHED.get(op.name)
        where = f" di.{batched} takes a batch." if batched is not None else ""
        raise InvalidInputError(
            f"The {role} of {op.name} is a di.Tangents batch; {op.name} takes one {role}, shaped as "
            f"{'x' if op.tangent == 'x' else 'f(x)'}.{where}"
        )
    if type(tangent) is not Tangents:
        raise InvalidInputError(
            f"{op.name} takes its {role}s as di.Tangents(t1, t2, ...), got a {type(tangent).__name__}: a tuple or "
            f"list would be ambiguous with one {role} of a tuple or list. For one {role} use "
            f"di.{op.name.replace('batched_', '')}."
        )
    if not len(tangent):
        raise InvalidInputError(
            f"{op.name} got an empty di.Tangents(): a batch holds at least one {role}, shaped as "
            f"{'x' if op.tangent == 'x' else 'f(x)'}."
        )


# -- arguments in the wrong place ----------------------------------------------------------------


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


# -- the record of f's output ----------------------------------------------------------------------


class _Output:
    """What a prep learns of f(x) from evaluating it: its structure, leaf shapes and dtypes, and
    the (type, dtype) pairs of output leaves already validated. The structure may depend on the
    contexts, so the record is kept per thread, and per static argument of a compiled program."""

    __slots__ = ("_by_static", "_local", "checked", "cotangent_fits")

    def __init__(self) -> None:
        self._local = threading.local()
        self._by_static: dict[Any, tuple[Any, Any, Any]] = {}
        self.checked: set[tuple[type, Any]] = set()
        self.cotangent_fits: tuple[Any, Any] | None = None  # the (spec, shapes) a cotangent was found to fit

    def current(self) -> tuple[Any, Any, Any]:
        """The record of this thread's last evaluation: (structure, leaf shapes, leaf dtypes)."""
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
            return self.current()[0]

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.current()[1]  # type: ignore[no-any-return]

    @property
    def dtypes(self) -> tuple[str | None, ...]:
        return self.current()[2]  # type: ignore[no-any-return]

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

    def repeats(self, shape: Any) -> bool:
        """Whether this thread's last evaluation returned one array leaf (``_checked``'s own
        structure) of this shape: a record of another such output would change nothing (the
        dtypes are those of a structure's first)."""
        local = self._local
        return getattr(local, "spec", None) is _LEAF and local.shapes[0] == shape

    def remember(self, static: Any) -> None:
        """Keep the record of a trace for the compiled program of this static argument."""
        self._by_static[static] = self.current()

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
    name = _arrays.dtype_name(leaf)
    # (a complex step's output is complex at its complex points; its cotangent is real: _complex.cotangent_fits)
    return name if _arrays.is_float_dtype(name) or "complex" in name else None
