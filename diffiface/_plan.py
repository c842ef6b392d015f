"""A prep's plan: what it was made for, field by field (a test per leaf: its type, and for an
array its shape, dtype and device or layout), and the program it runs. The route
(:mod:`diffiface._dispatch`) compares every call with a plan (:meth:`Plan.leaves`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import optree

from . import _arrays
from ._backends import AutoSparse
from ._errors import PreparationMismatchError
from ._families._shared import MetaLeaves
from ._families.jax import jax_structure
from ._flatten import Flatten, key_orders, structure_flatten
from ._keys import held_signature, key_or_identity

__all__ = ["Check", "Unfit", "Plan", "engine_checked", "flattener", "leaf_check", "leaves_check", "optree_flatten"]

Check = tuple[type, Callable[[Any], bool] | None]
"""How a plan knows a leaf: its type, and a test of the rest (None: the type says all)."""

_LEAF = optree.tree_structure(0)  # type: ignore[arg-type]  # a leaf's structure


class _ByValue:
    """The test of a leaf compared by value (a static leaf of x, or a context value a program
    is built for): equal :func:`~diffiface._keys.key_or_identity`."""

    __slots__ = ("key",)

    def __init__(self, leaf: Any) -> None:
        self.key = key_or_identity(leaf)

    def __call__(self, value: Any) -> bool:
        return bool(key_or_identity(value) == self.key)


class _Holding(_ByValue):
    """The test of a context value a program is built for that may hold arrays (a model
    object): by value, and by the shapes and dtypes of the arrays it holds now
    (:func:`~diffiface._keys.held_signature`), which its signature records too."""

    __slots__ = ("held",)

    def __init__(self, leaf: Any) -> None:
        super().__init__(leaf)
        self.held = held_signature(leaf)

    def __call__(self, value: Any) -> bool:
        return bool(key_or_identity(value) == self.key) and held_signature(value) == self.held


def engine_checked(leaf: Any) -> bool:
    """Whether a program whose engine retraces for new shapes and dtypes (jit, mx.compile,
    tf.function) checks this leaf itself (:class:`~diffiface._programs.JitProgram`), keying its
    programs by exactly what a plan would compare: its family says."""
    family = _arrays.family_of(leaf)
    return family is not None and family.jit_checked(leaf)


def leaf_check(
    leaf: Any, static_x: bool = False, by_value: bool = False, engine: bool = False, context: bool = False
) -> Check | None:
    """How a plan knows a leaf like ``leaf``. A static leaf of x (``static_x``) and, with
    ``by_value``, any leaf that is not an array (a context a program was built for) are compared
    by value. A context's leaf that is no array (``context``: a torch module, a PRNG key, passed
    to f untouched) and, with ``engine``, a leaf the program checks itself
    (:func:`engine_checked`) are known by their type. None: a leaf no test can vouch for (a
    pytree only jax knows, in x); the plan then compares whole signatures."""
    if engine and engine_checked(leaf):
        return type(leaf), None
    kind = _arrays.kind(leaf)
    if static_x and (kind == "other" or (kind == "python" and not isinstance(leaf, float))):
        return type(leaf), _ByValue(leaf)
    if kind == "other" and not by_value:
        return (type(leaf), None) if context else None
    if by_value and kind in ("python", "other"):
        return type(leaf), _Holding(leaf) if kind == "other" else _ByValue(leaf)
    # (a kind with no family is refused by name: compared by its type alone, a later call of
    # another shape or dtype would be taken as fitting)
    return type(leaf), _arrays.by_kind(kind).same(leaf)


class _Leaves:
    """The test of a list of leaves, leaf by leaf (:func:`leaf_check`)."""

    __slots__ = ("checks",)

    def __init__(self, checks: tuple[Check, ...]) -> None:
        self.checks = checks

    def __call__(self, leaves: list[Any]) -> bool:
        # Hot code: a plain loop (no generator, no zip(strict=True): the lengths are compared first)
        checks = self.checks
        if len(leaves) != len(checks):
            return False
        for leaf, (cls, test) in zip(leaves, checks, strict=False):
            if type(leaf) is not cls or (test is not None and not test(leaf)):
                return False
        return True


class _Types:
    """The test of a list of leaves by their types alone, where the program checks the rest
    itself (:func:`engine_checked`)."""

    __slots__ = ("types",)

    def __init__(self, leaves: list[Any]) -> None:
        self.types = list(map(type, leaves))

    def __call__(self, leaves: list[Any]) -> bool:
        return list(map(type, leaves)) == self.types  # (no Python frame per leaf)


def leaves_check(leaves: list[Any], checks: list[Check | None], engine: bool) -> Callable[[list[Any]], bool] | None:
    """The test of a list of leaves like ``leaves``, each known by ``checks``: by their types
    alone where the program checks every leaf itself (``engine``); their family's, which reads
    them inline, where all are of one family that has one. None where a leaf has no check."""
    if any(check is None for check in checks):
        return None
    if engine and leaves and all(map(engine_checked, leaves)):
        return _Types(leaves)
    if leaves:
        family = _arrays.family_of(leaves[0])
        if family is not None and all(_arrays.family_of(leaf) is family for leaf in leaves):
            test = family.leaves_test(leaves)
            if test is not None:
                return test
    return _Leaves(tuple(checks))  # type: ignore[arg-type]  # (none is None)


def _namespace(spec: Any) -> str:
    """The namespace a structure was made in: diffiface's where it holds a type registered there,
    else optree's default one, which flattens faster (a namespace costs a lookup per node)."""
    return "" if spec is None else str(spec.namespace)


def flattener(spec: Any, leaves: list[Any], ordered: bool = False) -> tuple[Flatten, Any]:
    """How a plan flattens an argument of structure ``spec`` (optree's, with these leaves), and
    the structure as that flattening gives it: a function written for the structure
    (:mod:`~diffiface._flatten`) where it can be, else jax's where jax is imported and takes
    the tree apart into the same leaves (about three times faster than optree on nested dicts),
    else optree's. With ``ordered``, a tree whose dicts hold their keys in another order does
    not fit (the C flattening's structure is then paired with the tree's key orders)."""
    found = jax_structure(spec, leaves)
    flatten: Flatten
    if found is not None:
        flatten, key = found[2], found[1]
    else:
        flatten, key = optree_flatten(_namespace(spec)), spec
    if spec is None or spec == _LEAF:
        return flatten, key
    # a structure of tuples, lists and dicts: indexed by a function written for it (_flatten)
    written = structure_flatten(spec, key, optree.tree_unflatten(spec, leaves), flatten)
    if written is not None:
        return written, key
    orders = _dict_orders(optree.tree_unflatten(spec, leaves)) if ordered else ()
    if ordered and len(key_orders(spec)) > len(orders):
        # more dicts than the walk reaches, inside nodes it does not open (a registered
        # dataclass holding a dict): their orders are read from optree's structure of each call
        return _Ordered(optree_flatten(_namespace(spec)), from_spec=True), (spec, key_orders(spec))
    if not orders:
        return flatten, key
    return _Ordered(flatten), (key, orders)


class _Ordered:
    """A C flattening whose structure is paired with the tree's dict key orders: read by a walk
    of the tree, or, ``from_spec``, from optree's structure (dicts inside registered nodes)."""

    __slots__ = ("flatten", "from_spec")

    def __init__(self, flatten: Flatten, from_spec: bool = False) -> None:
        self.flatten = flatten
        self.from_spec = from_spec

    def __call__(self, tree: Any) -> tuple[Any, Any]:
        leaves, key = self.flatten(tree)
        return leaves, (key, key_orders(key) if self.from_spec else _dict_orders(tree))


def _dict_orders(tree: Any) -> tuple[tuple[Any, ...], ...]:
    """The keys of each dict of two or more keys in a tree of dicts, lists and tuples, in their
    order, as :func:`~diffiface._flatten.key_orders` reads them from a structure (a dict
    subclass's order is not read: its structure holds it). Without recursion (a hot path)."""
    orders = []
    pending = [tree]
    containers = (dict, list, tuple)
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if type(node) is dict and len(node) > 1:
                orders.append(tuple(node))
            node = node.values()
        elif not isinstance(node, (list, tuple)):  # (x itself of another type)
            continue
        pending += [child for child in node if isinstance(child, containers)]
    return tuple(orders)


def optree_flatten(namespace: str = "") -> Flatten:
    """optree's flattening in ``namespace``, by its C function where optree has it (its
    ``tree_flatten`` is a Python frame around it)."""
    flatten = getattr(getattr(optree, "_C", None), "flatten", None)
    if flatten is None:  # pragma: no cover - optree without its C module's flatten
        return functools.partial(optree.tree_flatten, namespace=namespace)
    return functools.partial(flatten, leaf_predicate=None, none_is_leaf=False, namespace=namespace)


@dataclasses.dataclass(slots=True, eq=False, kw_only=True)
class Plan:
    """What a prep was made for and what it runs. ``leaves(...)``: a call's leaves where they
    fit the fields, else None; ``program(x_leaves, tangent_leaves, context_leaves)``:
    ``(result, error estimate or None)``."""

    operator: str
    backend: Any
    names: frozenset[str]
    """The string names that mean :attr:`backend` (``"jax"`` for ``AutoJAX()``)."""
    function: Any
    has_aux: bool
    x_checks: Callable[[list[Any]], bool] | None
    x_class: type | None
    """Where x is one array, its type: its type is its structure (optree takes arrays for leaves)."""
    tangent: bool
    tangent_checks: Callable[[list[Any]], bool] | None
    context_kinds: tuple[type, ...]
    context_classes: tuple[type | None, ...]
    """Per context, the type of its one array (its type is its structure, as for x), else None."""
    context_checks: tuple[Callable[[list[Any]], bool], ...] | None
    program: Callable[..., tuple[Any, Any]]
    estimates: bool = False
    """Whether the program estimates its error (the prep keeps the last estimate)."""
    single: tuple[Check, Check | None, tuple[Check, ...]] | None = None
    """Where x, the tangent (if the operator takes one) and every context are one leaf each
    (most calls): the test of x's leaf, of the tangent's (None: no tangent) and of each
    context's, compared without building a list of leaves."""
    flatteners: dataclasses.InitVar[tuple[tuple[Flatten, Any], tuple[Flatten, Any], tuple[tuple[Flatten, Any], ...]]]
    """How each argument is flattened, and its structure as so flattened (:func:`flattener`).
    A tree that holds a type registered in diffiface's namespace where the prep's did not
    then misses the plan, and its full signature decides."""
    x_flatten: Flatten = dataclasses.field(init=False)
    x_key: Any = dataclasses.field(init=False)
    tangent_flatten: Flatten = dataclasses.field(init=False)
    tangent_key: Any = dataclasses.field(init=False)
    context_flattens: tuple[Flatten, ...] = dataclasses.field(init=False)
    context_keys: tuple[Any, ...] = dataclasses.field(init=False)
    context_rows: tuple[tuple[type, type | None, Flatten, Any, Callable[[list[Any]], bool]], ...] | None = (
        dataclasses.field(init=False)
    )
    """Per context, its kind, class, flattening, structure and test, read together by a call
    (None where a context has no test: no call fits)."""
    jit: Any = dataclasses.field(default=None, init=False)
    """Where the program is jax's tier (:class:`~diffiface._programs.JitProgram`): that
    program, whose ``run`` the route calls on the arguments as passed."""

    def __post_init__(
        self, flatteners: tuple[tuple[Flatten, Any], tuple[Flatten, Any], tuple[tuple[Flatten, Any], ...]]
    ) -> None:
        (self.x_flatten, self.x_key), (self.tangent_flatten, self.tangent_key), contexts = flatteners
        self.context_flattens = tuple(flatten for flatten, _ in contexts)
        self.context_keys = tuple(key for _, key in contexts)
        checks = self.context_checks
        columns = (self.context_kinds, self.context_classes, self.context_flattens, self.context_keys)
        self.context_rows = None if checks is None else tuple(zip(*columns, checks, strict=True))

    def fits_backend(self, backend: Any) -> bool:
        """Whether a backend object other than the plan's own one means it."""
        mine = self.backend
        # (an AutoSparse's operators other than Jacobians and Hessians are its engine's; its own
        # are sparse programs, never the dense plan of its engine)
        return bool(backend == mine) or (
            isinstance(backend, AutoSparse) and self.operator not in AutoSparse.operators and backend.backend == mine
        )

    def leaves(
        self, operator: str, f: Any, backend: Any, x: Any, tangent: Any, contexts: tuple[Any, ...], has_aux: bool
    ) -> tuple[list[Any], list[Any], list[list[Any]]] | None:
        """A call's leaves where it fits this plan; None where it does not."""
        # (fits, inlined: this runs on every call)
        if operator != self.operator or has_aux != self.has_aux or len(contexts) != len(self.context_kinds):
            return None
        function = self.function
        if function.ref() is not f and not function.matches(f):
            return None
        mine = self.backend
        if backend is not mine and not (backend in self.names if type(backend) is str else self.fits_backend(backend)):
            return None
        single = self.single
        if single is not None:
            (cls, test), tangent_test, context_tests = single
            if type(x) is not cls or (test is not None and not test(x)):
                return None
            one_tangent: list[Any] = []
            if tangent_test is not None:
                cls, test = tangent_test
                if type(tangent) is not cls or (test is not None and not test(tangent)):
                    return None
                one_tangent = [tangent]
            values = []
            for context, kind, (context_cls, context_test) in zip(
                contexts, self.context_kinds, context_tests, strict=False
            ):
                if type(context) is not kind:
                    return None
                value = context.value  # type: ignore[attr-defined]
                if type(value) is not context_cls or (context_test is not None and not context_test(value)):
                    return None
                values.append([value])
            return [x], one_tangent, values
        x_checks = self.x_checks
        context_rows = self.context_rows
        if x_checks is None or self.tangent_checks is None or context_rows is None:
            return None
        if type(x) is self.x_class:
            x_leaves = [x]
            if not x_checks(x_leaves):
                return None
        else:
            try:
                x_leaves, spec = self.x_flatten(x)
            except Exception:  # (a tree jax's pytrees cannot take apart, such as unsortable keys)
                return None  # (the full signature says why)
            # (a function written for the structure gives back the key itself where the tree fits)
            if spec is not self.x_key and spec != self.x_key:
                return None
            if type(x_checks) is MetaLeaves:  # (its test inline: a frame costs)
                if list(map(type, x_leaves)) != x_checks.types or list(map(x_checks.meta, x_leaves)) != x_checks.metas:
                    return None
            elif not x_checks(x_leaves):
                return None
        tangent_leaves: list[Any] = []
        if self.tangent:
            try:
                tangent_leaves, spec = self.tangent_flatten(tangent)
            except Exception:  # (as x's)
                return None
            if spec is not self.tangent_key and spec != self.tangent_key:
                return None
            checks = self.tangent_checks
            if type(checks) is MetaLeaves:  # (inline, as x's)
                if (
                    list(map(type, tangent_leaves)) != checks.types
                    or list(map(checks.meta, tangent_leaves)) != checks.metas
                ):
                    return None
            elif not checks(tangent_leaves):
                return None
        context_leaves = []
        for context, (kind, value_class, flatten, context_key, checks) in zip(contexts, context_rows, strict=False):
            if type(context) is not kind:
                return None
            value = context.value  # type: ignore[attr-defined]
            if value_class is not None and type(value) is value_class:
                leaves = [value]
                if not checks(leaves):
                    return None
            else:
                try:
                    leaves, spec = flatten(value)
                except Exception:  # (as x's)
                    return None
                if spec is not context_key and spec != context_key:
                    return None
                if type(checks) is MetaLeaves:  # (inline, as x's)
                    if list(map(type, leaves)) != checks.types or list(map(checks.meta, leaves)) != checks.metas:
                        return None
                elif not checks(leaves):
                    return None
            context_leaves.append(leaves)
        return x_leaves, tangent_leaves, context_leaves


class Unfit(PreparationMismatchError):
    """Raised where a :class:`~diffiface._programs.JitProgram` is called on arguments whose
    shapes or dtypes are not the prep's: the route then compares the call's whole signature
    with the prep's."""
