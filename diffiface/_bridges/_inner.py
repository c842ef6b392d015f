"""The inner side of :func:`diffiface.differentiate_with`: ``f`` on its own engine's arrays.

Everything here runs on the inner engine's arrays (numpy for the black-box engines, torch
tensors, jax arrays) and reaches the engine only through diffiface's public operators
(``jvp``, ``vjp``, ``jacobian``), so that the outer side (jax primitives, torch Functions)
never needs to know which engine is inside.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .. import _arrays, _families
from .. import _operators as di
from .. import tree as _tree
from .._adapters import adapter_for, info
from .._adapters._black_box import guard_constants
from .._backends import (
    AutoAutograd,
    AutoJAX,
    AutoMLX,
    AutoSparse,
    AutoTensorFlow,
    AutoTorch,
    Backend,
    SecondOrder,
)
from .._contexts import Constant, Context
from .._errors import (
    ArrayTypeError,
    ContextError,
    DiffifaceError,
    InvalidBackendOptionError,
    InvalidOutputError,
    MutationError,
    UnsupportedOperationError,
)

Leaves = list[Any]


def inner_kind(backend: Backend) -> str:
    """Which arrays ``f`` takes under ``backend`` (no AutoSparse): the family its registry row
    names (the host's, numpy, for an engine that takes any array type: the black boxes)."""
    if isinstance(backend, SecondOrder):
        raise InvalidBackendOptionError(
            f"differentiate_with(f, {backend!r}): the outer engine asks f for first-order products (jvp, "
            "vjp) and builds its own second order from them; pass a first-order backend such as "
            "di.AutoTorch(), or di.AutoSparse(...) of one."
        )
    try:
        row = info(backend)
    except DiffifaceError:
        raise InvalidBackendOptionError(f"differentiate_with cannot run f under {backend!r}.") from None
    return _families.HOST.NAME if row.any_array_type else _arrays.by_kind(row.arrays).NAME


def check_nests(site: Site, action: str) -> None:
    """Refuse a second product (differentiating g's ``action`` with respect to x) where the inner
    engine does not nest."""
    if not site.inner.nestable:
        backend = site.inner.backend
        raise UnsupportedOperationError(
            f"differentiate_with(f, {backend!r}) is first order only: differentiating g's {action} with respect "
            f"to x needs the derivative of a derivative of f, and {backend!r} does not differentiate its own "
            "results (finite differences of finite differences would be inaccurate, so diffiface refuses rather "
            "than return them). Use an engine that nests (di.AutoJAX(), di.AutoTorch(), di.AutoAutograd()), or "
            "take the second order from the outer engine by finite differences of g's gradient."
        )


def beyond_second_order(backend: Backend) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"differentiate_with(f, {backend!r}) serves derivatives up to second order; a third derivative "
        "of f was asked for. Differentiate f with its own engine for that."
    )


@dataclass(frozen=True)
class Aval:
    """Shape and dtype (by name) of one leaf."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Plan:
    """What g's prep serves: the structure, shapes and dtypes of x, and those of f(x) there."""

    x_spec: Any
    x_avals: tuple[Aval, ...]
    y_spec: Any
    y_avals: tuple[Aval, ...]

    def out_avals(self, what: str, batch: int = 0) -> list[Aval]:
        """The avals of product ``what``'s results (f(x)'s, or x's for the vjps), with a leading
        axis of length ``batch`` where it is not 0."""
        base = self.y_avals if what in ("call", "jvp", "second_jvp") else self.x_avals
        prefix = (batch,) if batch else ()
        return [Aval(prefix + a.shape, a.dtype) for a in base]


# --- arrays of the inner engine -----------------------------------------------------------------


def to_inner(leaf: Any, kind: str) -> Any:
    """An outer leaf (an array of any family) as an array of the inner engine, zero-copy
    through dlpack where the two can share memory, a copy otherwise; dtype kept."""
    family = _arrays.by_kind(kind)
    source = _arrays.family_of(leaf)
    if family is _families.HOST:
        array = np.asarray(_arrays.to_numpy(leaf))
        if array.flags.writeable and not array.flags.owndata:
            array = array.view()  # a view of the caller's memory: f may read it, never write it
            array.flags.writeable = False
        return array
    shared = None if source is None else source.exchange(leaf)
    if source is family:
        return shared
    from_dlpack = getattr(family.numpy_like(), "from_dlpack", None)
    if shared is not None and from_dlpack is not None:
        try:
            inner = from_dlpack(shared)
        except (BufferError, RuntimeError, TypeError, ValueError):  # a layout or device dlpack cannot share
            leaf = _arrays.to_numpy(shared)
        else:
            if _arrays.dtype_name(inner) == _arrays.dtype_name(shared):  # (mlx's takes float64 as float32)
                return inner
            leaf = _arrays.to_numpy(shared)
    array = np.array(leaf if source is None else _arrays.to_numpy(leaf))  # (a copy, its own dtype)
    return family.from_numpy(array, None, None)


def check_shape(what: str, want: tuple[int, ...], got: tuple[int, ...]) -> None:
    """Refuse a product's result whose shape is not the one g's prep recorded."""
    if got != want:
        raise InvalidOutputError(
            f"{what} of g gave a result of shape {got} where g's prep recorded {want}: f must give "
            "results of one shape for every x of one shape."
        )


def aval_of(leaf: Any) -> Aval:
    return Aval(tuple(int(n) for n in _arrays.shape(leaf)), _arrays.dtype_name(leaf))


def output_avals(leaves: Sequence[Any]) -> tuple[Aval, ...]:
    """The avals of f's output leaves, each an array or a number: what crosses back to the
    outer engine. Anything else (a string, an object) is refused before an engine meets it."""
    for index, leaf in enumerate(leaves):
        family = _arrays.family_of(leaf)
        host = family is _families.HOST
        if family is not None and not family.PASSED_THROUGH and not host:  # another array, a number
            continue
        if host and np.asarray(leaf).dtype.kind in "biufc":
            continue
        what = f"an array of dtype {np.asarray(leaf).dtype}" if host else f"a {type(leaf).__name__}"
        raise InvalidOutputError(
            f"f returned {what} (output leaf {index}) where g needs numbers: float arrays or floats (a pytree "
            "of them), which the outer engine can differentiate. Return the value f computes, and keep other "
            "results apart from g (a string, a label, an object)."
        )
    return tuple(aval_of(leaf) for leaf in leaves)


# --- contexts --------------------------------------------------------------------------------------


def check_contexts(contexts: Sequence[Any]) -> tuple[Context[Any], ...]:
    for position, context in enumerate(contexts, start=2):
        if not isinstance(context, Context):
            raise ContextError(
                f"g's argument {position} is a bare {type(context).__name__}; wrap what f only reads in "
                "di.Constant(...) (or scratch space in di.Cache(...)), as for the operators: "
                "g(x, di.Constant(model))."
            )
    return tuple(contexts)


def context_values(contexts: Sequence[Context[Any]], kind: str) -> list[Any]:
    """The values f is called with, numpy leaves converted to the inner engine's arrays as the
    operators convert them. A Constant's arrays are guarded as x's are: numpy f gets read-only
    views (a write raises before it lands), torch f clones; a Cache's are f's to write."""
    family = _arrays.by_kind(kind)
    host = family is _families.HOST

    def constant(leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray):
            return _read_only(leaf) if host else to_inner(leaf, kind)
        return family.private_copy(leaf) if family.owns(type(leaf)) else leaf

    def cache(leaf: Any) -> Any:
        return to_inner(leaf, kind) if isinstance(leaf, np.ndarray) else leaf

    return [
        _tree.map(constant, c.value) if isinstance(c, Constant) else c.value if host else _tree.map(cache, c.value)
        for c in contexts
    ]


_READ_ONLY = "g hands f the caller's Constants as they are, and a Constant is read-only."


def _read_only(array: np.ndarray) -> np.ndarray:
    if not array.flags.writeable:
        return array
    view = array.view()
    view.flags.writeable = False
    return view


def outer_traced(value: Any, traced: Callable[[Any], str | None]) -> str | None:
    """A description of the first array inside ``value`` that the outer engine traces (its
    bridge's ``traced`` tells), else None. Arrays of the inner engine are f's own business: a
    torch model's parameters inside jax are constants."""
    try:
        leaves = _tree.leaves(value)
    except Exception:  # an object optree cannot walk holds no array we could see
        return None
    for leaf in leaves:
        found = traced(leaf)
        if found is not None:
            return found
    return None


def closure_traced(f: Callable[..., Any], traced: Callable[[Any], str | None]) -> str | None:
    """An outer traced array that f closes over (its closure cells and defaults), else None."""
    seen: list[Any] = []
    target = getattr(f, "__func__", f)  # a bound method closes over what its function does
    cells = getattr(target, "__closure__", None) or ()
    for cell in cells:
        with contextlib.suppress(ValueError):  # an empty cell
            seen.append(cell.cell_contents)
    seen.extend(getattr(target, "__defaults__", None) or ())
    for value in seen:
        if callable(value) and not hasattr(value, "shape"):
            continue
        found = outer_traced(value, traced)
        if found is not None:
            return found
    return None


def traced_refusal(where: str, found: str) -> DiffifaceError:
    return ArrayTypeError(
        f"{where} holds {found} of the outer engine. g runs f on the inner engine's arrays, outside the "
        "outer trace, so the outer engine could not see how f's result depends on it: its derivative "
        "would be lost. Pass it to g as an argument instead, as part of x (g(x) with x a tuple or dict "
        "holding it), so that the outer engine differentiates through it; or pass a concrete value."
    )


# --- the inner engine's work ------------------------------------------------------------------------


class Inner:
    """``f`` and its backend, with the products the outer side asks for, on inner arrays."""

    def __init__(self, f: Callable[..., Any], backend: Backend) -> None:
        self.f = f
        self.backend = backend
        self.engine = backend.backend if isinstance(backend, AutoSparse) else backend
        """The backend whose engine runs f: AutoSparse's own engine under AutoSparse."""
        self.kind = inner_kind(self.engine)
        # the family of f's arrays, its engine's modules imported (f's arrays may be made here
        # before the engine's adapter is)
        for module in info(backend).requires:
            importlib.import_module(module)
        self.family = _arrays.by_kind(self.kind)
        # (whether the engine differentiates its own derivatives: second order through g)
        self.nestable = isinstance(self.engine, (AutoJAX, AutoTorch, AutoAutograd, AutoMLX, AutoTensorFlow))
        # f(x) compiled once per set of contexts, for jax with jit: (contexts, program) pairs
        self._programs: list[tuple[tuple[Context[Any], ...], Callable[..., Any]]] = []
        self._programs_lock = threading.Lock()

    # every product takes and returns flat lists of inner leaves

    def value(self, plan: Plan, x: Leaves, contexts: Sequence[Context[Any]]) -> Leaves:
        with self.family.dtype_scope([a.dtype for a in plan.x_avals]):
            program = self._program(plan, tuple(contexts))
            if program is not None:
                return list(program(x, context_values(contexts, self.kind)))
            return self._leaves_of(plan, self.evaluate(plan.x_spec, x, contexts))

    def evaluate(self, spec: Any, x: Leaves, contexts: Sequence[Context[Any]]) -> Any:
        """f(x) as f returns it. x may share memory with the caller's arrays: numpy views are
        read-only (a write raises before it lands) and jax arrays immutable, but torch checks an
        in-place write to an inference tensor only after the kernel ran, so torch gets clones,
        as the operators' torch engine makes its own."""
        return self.call(spec.unflatten([self.family.private_copy(leaf) for leaf in x]), contexts)

    def call(self, x: Any, contexts: Sequence[Context[Any]]) -> Any:
        """f(x) on x as it is, with its contexts' values (:func:`context_values`), as f returns it.
        A Constant's model (a torch module, a Keras model, an mlx module) reaches f as it is:
        watched as the black-box engines watch it, so that g's own calls of f refuse a write into
        it (a BatchNorm in train mode) as its derivatives do."""
        values = context_values(contexts, self.kind)
        try:
            return guard_constants(lambda: self.concrete(self.f(x, *values)), contexts, _READ_ONLY)
        except ValueError as exc:
            if self.family is _families.HOST and "read-only" in str(exc):
                raise MutationError(
                    "f wrote into its input x or a di.Constant, which g shares with the caller's arrays, read-only; "
                    "write into a copy instead (x = x.copy()), or compute out of place; for scratch space f may "
                    "overwrite, pass a di.Cache."
                ) from exc
            raise

    def _program(self, plan: Plan, contexts: tuple[Context[Any], ...]) -> Callable[..., Any] | None:
        """f(x) compiled by its engine (jax.jit for AutoJAX(jit=True)), where every context leaf is
        an array (an argument of the program, so new values never go unseen); None where f runs
        eagerly."""
        adapter = adapter_for(self.engine)
        if not adapter.compiles or self.family is _families.HOST:  # (a numpy engine's programs are its own)
            return None
        if not all(_arrays.is_array(leaf) for c in contexts for leaf in _tree.leaves(c.value)):
            return None
        with self._programs_lock:
            for held, program in self._programs:
                if len(held) == len(contexts) and all(a is b for a, b in zip(held, contexts, strict=True)):
                    return program
        f, spec = self.f, plan.x_spec

        def run(x: Leaves, values: list[Any]) -> Any:
            return self._leaves_of(plan, f(spec.unflatten(list(x)), *values))

        program = adapter.compile(run, static=False, arrays=True)
        with self._programs_lock:
            self._programs.append((contexts, program))
            del self._programs[:-8]
        return program

    def product(
        self, what: str, plan: Plan, args: Leaves, contexts: Sequence[Context[Any]], batch: int, conjugate: bool
    ) -> Leaves:
        """g's product ``what`` (``call``, ``jvp``, ``vjp``, ``second_jvp``, ``second_vjp``) of the
        outer engine's operands ``args`` (x's leaves, then the linear ones), as inner leaves;
        ``batch``: the linear operand of a jvp or vjp has a leading axis that long. ``conjugate``:
        the outer engine transposes in its own convention, ``conj(vjp(conj(c)))`` of diffiface's
        (jax's, docs/complex.md), so a vjp's cotangent and result are conjugated."""
        n, m = len(plan.x_avals), len(plan.y_avals)
        args = [to_inner(a, self.kind) for a in args]
        x_avals, y_avals = list(plan.x_avals), list(plan.y_avals)
        linear = {
            "call": [],
            "jvp": x_avals,
            "vjp": y_avals,
            "second_jvp": x_avals + x_avals,
            "second_vjp": y_avals + x_avals,
        }[what]
        x, rest = args[:n], self.cast(args[n:], linear)
        if what == "call":
            return self.value(plan, x, contexts)
        if what == "jvp":
            return self._products(plan, x, rest, contexts, jvp=True) if batch else self.jvp(plan, x, rest, contexts)
        if what == "second_jvp":
            return self.second_jvp(plan, x, rest[:n], rest[n:], contexts)
        if conjugate:  # (second_vjp's derivative in x, a real direction, is conjugated as the vjp is)
            rest = _conjugated(rest[:m]) + rest[m:]
        if what == "vjp":
            outs = self._products(plan, x, rest, contexts, jvp=False) if batch else self.vjp(plan, x, rest, contexts)
        else:
            outs = self.second_vjp(plan, x, rest[:m], rest[m:], contexts)
        return _conjugated(outs) if conjugate else outs

    def cast(self, leaves: Leaves, avals: Sequence[Aval]) -> Leaves:
        """Tangents and cotangents in the dtypes of g's prep: the outer engine may hold f(x) in
        another dtype than f gives (jax without x64 holds float32 where f gives float64)."""
        return [
            leaf if _arrays.dtype_name(leaf) == aval.dtype else self.family.cast(leaf, aval.dtype)
            for leaf, aval in zip(leaves, avals, strict=True)
        ]

    def jvp(self, plan: Plan, x: Leaves, tx: Leaves, contexts: Sequence[Context[Any]]) -> Leaves:
        ty = di.jvp(self.f, self.backend, plan.x_spec.unflatten(x), plan.x_spec.unflatten(tx), *contexts)
        return self._leaves_of(plan, ty)

    def vjp(self, plan: Plan, x: Leaves, ty: Leaves, contexts: Sequence[Context[Any]]) -> Leaves:
        tx = di.vjp(self.f, self.backend, plan.x_spec.unflatten(x), plan.y_spec.unflatten(ty), *contexts)
        return _tree.leaves(tx)

    def _products(self, plan: Plan, x: Leaves, linear: Leaves, contexts: Sequence[Context[Any]], jvp: bool) -> Leaves:
        """jvps (or vjps) along a batch of tangents (a leading axis on each leaf): one Jacobian and
        a contraction where that costs less than one product per tangent (or the backend is
        sparse), else one product each."""
        batch = int(_arrays.shape(linear[0])[0]) if linear else 0
        avals = plan.y_avals if jvp else plan.x_avals
        xp = self.family.numpy_like()
        if self._by_jacobian(plan, batch):
            jac = self._flat_jacobian(plan, x, contexts)
            flat = xp.concatenate([t.reshape(batch, -1) for t in linear], axis=1)  # (batch, n) or (batch, m)
            # conj(J)ᵀ c, the vjp of docs/complex.md (for a holomorphic f: J's conjugate transpose)
            products = (jac @ flat.T).T if jvp else _conj((jac.T @ _conj(flat).T).T)
            pieces = _split_vector(products.T, list(itertools.accumulate(a.size for a in avals))[:-1])
            return [p.T.reshape((batch, *a.shape)) for p, a in zip(pieces, avals, strict=True)]
        product = self.jvp if jvp else self.vjp
        rows = [product(plan, x, [t[b] for t in linear], contexts) for b in range(batch)]
        return [xp.stack([row[i] for row in rows]) for i in range(len(avals))]

    def second_jvp(self, plan: Plan, x: Leaves, t1: Leaves, t2: Leaves, contexts: Sequence[Context[Any]]) -> Leaves:
        """D²f(x)[t1, t2], y-shaped: the jvp along t2 of x -> jvp(f, x, t1)."""
        first = self._first(di.jvp, plan.x_spec.unflatten(t1), contexts)
        ty = di.jvp(first, self.backend, plan.x_spec.unflatten(x), plan.x_spec.unflatten(t2))
        return self._leaves_of(plan, ty)

    def second_vjp(self, plan: Plan, x: Leaves, ct: Leaves, v: Leaves, contexts: Sequence[Context[Any]]) -> Leaves:
        """Σ_k ct_k ∇²f_k(x) v, x-shaped: the jvp along v of x -> vjp(f, x, ct)."""
        first = self._first(di.vjp, plan.y_spec.unflatten(ct), contexts)
        tx = di.jvp(first, self.backend, plan.x_spec.unflatten(x), plan.x_spec.unflatten(v))
        return _tree.leaves(tx)

    # helpers

    def concrete(self, out: Any) -> Any:
        """f's output on concrete arrays as concrete values, as f's engine gives them (a graph of
        constants evaluated, under PyTensor)."""
        return adapter_for(self.engine).concrete(out)

    def _first(self, op: Callable[..., Any], linear: Any, contexts: Sequence[Context[Any]]) -> Callable[[Any], Any]:
        """x -> op(f, x, linear): the first product (``di.jvp``, ``di.vjp``) as a function of x."""

        def first(x: Any) -> Any:
            return op(self.f, self.backend, x, linear, *contexts)

        return first

    def _leaves_of(self, plan: Plan, y: Any) -> Leaves:
        leaves, spec = _tree.flatten(y)
        if spec != plan.y_spec:
            raise InvalidOutputError(
                f"f returned a result of structure {spec}, where g's prep recorded {plan.y_spec}; f must "
                "return the same structure for every x of one shape."
            )
        return leaves

    def _by_jacobian(self, plan: Plan, batch: int) -> bool:
        dtypes = {a.dtype for a in (*plan.x_avals, *plan.y_avals)}
        if len(dtypes) != 1 or not plan.x_avals or not plan.y_avals:
            return False
        if "complex" in next(iter(dtypes)):  # (a complex Jacobian exists only for a holomorphic f)
            return False
        if not self.family.ARRAY_METHODS:  # (the flat Jacobian is taken apart by array methods)
            return False
        n = sum(a.size for a in plan.x_avals)
        m = sum(a.size for a in plan.y_avals)
        return isinstance(self.backend, AutoSparse) or batch >= min(n, m)

    def _flat_jacobian(self, plan: Plan, x: Leaves, contexts: Sequence[Context[Any]]) -> Any:
        """The Jacobian of f from the flat vector of x to that of f(x): (m, n), dense, or sparse
        under AutoSparse."""
        xp = self.family.numpy_like()
        f = self.f
        if not isinstance(self.backend, AutoSparse):
            # f's own Jacobian, its blocks (per leaf of f(x), per leaf of x) laid out flat after
            # it: no wrapper of diffiface's inside what the engine traces (torch.compile traces f,
            # and cannot trace optree's rebuild of x)
            blocks = _tree.leaves(di.jacobian(f, self.backend, plan.x_spec.unflatten(x), *contexts))
            across = len(plan.x_avals)
            if len(blocks) != across * len(plan.y_avals):
                raise InvalidOutputError(
                    f"f returned {len(blocks) // max(across, 1)} arrays, where g's prep recorded "
                    f"{len(plan.y_avals)}; f must return the same structure for every x of one shape."
                )
            rows = [
                xp.concatenate(
                    [blocks[i * across + j].reshape((y.size, a.size)) for j, a in enumerate(plan.x_avals)], axis=1
                )
                for i, y in enumerate(plan.y_avals)
            ]
            return xp.concatenate(rows, axis=0)
        cuts = list(itertools.accumulate(a.size for a in plan.x_avals))[:-1]

        def flat_f(vector: Any, *values: Any) -> Any:
            pieces = _split_vector(vector, cuts)
            x_tree = plan.x_spec.unflatten([p.reshape(a.shape) for p, a in zip(pieces, plan.x_avals, strict=True)])
            y_leaves = _tree.leaves(f(x_tree, *values))
            # (the engine's own namespace: autograd traces f with boxes, which numpy would make
            # objects; a shape as a tuple: PyTensor's reshape takes no bare -1)
            return _arrays.numpy_like(vector).concatenate([leaf.reshape((-1,)) for leaf in y_leaves])

        vector = xp.concatenate([leaf.reshape((-1,)) for leaf in x])
        jac = di.jacobian(flat_f, self.backend, vector, *contexts)
        # (a Jacobian that takes ``@`` with a dense matrix on both sides: scipy and jax sparse do;
        # torch's sparse compressed layouts do with ``.T`` through ``to_sparse_coo``)
        return jac.to_sparse_coo() if getattr(jac, "is_sparse_csr", False) else jac


def _conjugated(leaves: Sequence[Any]) -> list[Any]:
    """Complex inner leaves conjugated, real ones as they are."""
    return [leaf.conj() if "complex" in _arrays.dtype_name(leaf) else leaf for leaf in leaves]


def _conj(array: Any) -> Any:
    """A complex array's conjugate, materialised (torch's lazy conjugate does not reach sparse
    products); a real array as it is."""
    if "complex" not in _arrays.dtype_name(array):
        return array
    family = _arrays.family_of(array)
    return array.conj() if family is None else family.conj(array)


def _split_vector(vector: Any, cuts: list[int]) -> Leaves:
    starts = [0, *cuts]
    # (the last piece to the end: a symbolic vector's length is no int)
    return [*(vector[start:end] for start, end in zip(starts, cuts, strict=False)), vector[starts[-1] :]]


# --- probing the shape of f(x) ------------------------------------------------------------------


def probe_avals(inner: Inner, x_spec: Any, x_avals: tuple[Aval, ...], contexts: Sequence[Context[Any]]) -> Any:
    """f's output structure and avals for inputs of ``x_avals``, found without concrete values
    (the outer engine is tracing): jax.eval_shape for jax, zeros for the others."""
    try:
        with inner.family.dtype_scope([a.dtype for a in x_avals]):
            values = context_values(contexts, inner.kind)
            shapes = [(a.shape, a.dtype) for a in x_avals]
            out = inner.family.eval_shape(lambda *leaves: inner.f(x_spec.unflatten(list(leaves)), *values), shapes)
            abstract = out is not None  # (else: no abstract evaluation in this family, f at zeros)
            if not abstract:
                family = inner.family
                zeros = [family.cast(family.numpy_like().zeros(a.shape), a.dtype) for a in x_avals]
                out = inner.call(x_spec.unflatten(zeros), contexts)
    except DiffifaceError:
        raise
    except Exception as exc:
        raise UnsupportedOperationError(
            f"g met x for the first time while the outer engine was tracing it, so it evaluated f at zeros "
            f"of x's shapes to learn the shape of f(x), and f raised {type(exc).__name__}: {exc}. Call g once "
            "on a concrete x of these shapes first (outside jit, vmap and grad): that call records its prep."
        ) from exc
    leaves, spec = _tree.flatten(out)
    if abstract:  # (the engine's abstract values: it would have refused anything else)
        return spec, tuple(aval_of(leaf) for leaf in leaves)
    return spec, output_avals(leaves)


# --- sites: one g, one set of contexts --------------------------------------------------------------


class Site:
    """One g with one set of contexts: what the outer engine's primitive or op refers to.

    Hashed by identity (jax primitives take it as a parameter); registered by number for torch's
    ops, whose schema takes no Python objects."""

    _ids = itertools.count()
    #: the sites that a g holds, by number; a g removes its own when it drops them or is collected
    registry: ClassVar[dict[int, Site]] = {}
    _lock = threading.Lock()

    def __init__(self, inner: Inner, plan: Plan, contexts: tuple[Context[Any], ...]) -> None:
        self.inner = inner
        self.plan = plan
        self.contexts = contexts
        with Site._lock:
            self.number = next(Site._ids)
            Site.registry[self.number] = self

    def release(self) -> None:
        with Site._lock:
            Site.registry.pop(self.number, None)

    def __repr__(self) -> str:
        return f"Site({self.number})"


def constant_values(contexts: Sequence[Context[Any]]) -> tuple[int, ...]:
    return tuple(id(c.value) for c in contexts) + tuple(isinstance(c, Constant) for c in contexts)
