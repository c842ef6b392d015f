"""The sparse route of :class:`~diffiface.AutoSparse`: detect, color, one product per color, gather.

Preparation finds the pattern (``diffiface.sparse``), colors it, and prepares the wrapped
engine's products once; a call runs one batched jvp (column coloring) or vjp (row coloring) for
all colors, or one batched hvp (star coloring of a Hessian), and decompresses with the gather
``compressed.reshape(-1)[index]``. x and f(x) are flattened in :func:`diffiface.tree.ravel`
order. On jax the products and the gather are one compiled program (``vmap`` over the seeds);
every other engine runs its own prepared batched ``jvp``/``vjp``/``hvp`` (one vmapped program
on torch.func, a loop elsewhere) through diffiface's operators, so their checks (mutation,
dtypes, contexts) hold unchanged. Scipy, which has no product cheaper than a full Jacobian,
differentiates ``z -> f(x + S z)`` for the ``count`` inputs ``z``.

A sparse prep is a plan of the one route (:mod:`diffiface._dispatch`) whose program runs the
products and the decompression: the route registers :class:`SparseProgram` for AutoSparse
(:func:`~diffiface._dispatch.register_program`), so that this module, which calls the public
operators, sits above them. An unprepared call finds its prep in the one prep cache, keyed by
the signature with the values of the contexts' other leaves (the pattern is detected for
them), so the pattern is found once per signature.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import optree

from . import _arrays, _backends, _complex, _families, sparse
from . import _batched as batched
from . import _operators as ops
from . import tree as _tree
from ._adapters import info, normalize
from ._backends import AutoScipy, SecondOrder
from ._call import Call
from ._contexts import Constant
from ._dispatch import register_program
from ._errors import InvalidBackendOptionError, InvalidInputError
from ._keys import held_arrays
from ._prep import FunctionRef, Prep, _contents
from ._tangents import Tangents

__all__ = ["SPARSE_OPERATORS", "SparsePrep", "SparseProgram"]


@dataclass(frozen=True, repr=False)
class AutoSparse(_backends.AutoSparse):
    __doc__ = _backends.AutoSparse.__doc__

    def __post_init__(self) -> None:
        # (what the config's own checks cannot know, from the layers above it: a backend from its
        # name, and the detectors and coloring orders of diffiface.sparse)
        if isinstance(self.backend, str):
            object.__setattr__(self, "backend", normalize(self.backend))
        if self.detector is None:
            object.__setattr__(self, "detector", sparse.GlobalDetector())
        if not isinstance(self.detector, (sparse.GlobalDetector, sparse.LocalDetector, sparse.KnownPattern)):
            raise InvalidBackendOptionError(
                f"AutoSparse(detector={self.detector!r}): the detector must be diffiface.sparse.GlobalDetector(), "
                "LocalDetector() or KnownPattern(pattern)."
            )
        if not isinstance(self.order, str) or self.order not in sparse.ORDERS:
            raise InvalidBackendOptionError(
                f"AutoSparse(order={self.order!r}) is not a coloring order; choose one of "
                f"{', '.join(map(repr, sparse.ORDERS))}."
            )
        super().__post_init__()


SPARSE_OPERATORS = AutoSparse.operators
_HESSIANS = frozenset({"hessian", "value_gradient_and_hessian"})


class SparsePrep(Prep):
    """A prep of a sparse operator: the pattern, its coloring and the engine's prepared product."""

    __slots__ = ()

    @property
    def pattern(self) -> Any:
        """The sparsity pattern, a boolean ``scipy.sparse.csr_array`` (m-by-n, or n-by-n for a Hessian)."""
        return self.plan.program.sparse.coloring.pattern  # type: ignore[attr-defined]

    @property
    def coloring(self) -> Any:
        """The :class:`diffiface.sparse.Coloring` used: ``coloring.count`` products per call,
        ``coloring.sides`` of them forward and reverse."""
        return self.plan.program.sparse.coloring  # type: ignore[attr-defined]

    @property
    def detection(self) -> Any:
        """How the pattern was found: a :class:`diffiface.sparse.Detection` (its ``tracer``, and
        ``notes`` naming the operations taken as dense), or None for a local or known pattern."""
        return self.plan.program.sparse.detection  # type: ignore[attr-defined]


class SparseProgram:
    """The program of a sparse prep, on a call's leaves: x and the contexts rebuilt, then one
    product per color and the decompression (:class:`_Plan`)."""

    __slots__ = ("backend", "context_kinds", "context_specs", "function", "kept", "name", "sparse", "x_spec")

    def __init__(self, name: str, f: Callable[..., Any], backend: AutoSparse, call: Call) -> None:
        _complex.refuse_sparse(call)
        self.name = name
        self.function = FunctionRef(f)
        self.backend = backend
        self.x_spec = call.signature.x_spec
        self.context_kinds = tuple(spec[0] for spec in call.signature.contexts)
        self.context_specs = tuple(call.context_specs)
        x, contexts = self.arguments(call.x_leaves, call.context_leaves)
        self.sparse = _Plan(name, f, backend, x, contexts)
        # A local pattern holds for the contexts' values it was found with (a Constant matrix's
        # zeros are the Jacobian's), a global one for those of the arrays its tracer read as they
        # are: what they held, to find it again where they change.
        # (the record and the plan found with it, together: None where nothing is kept)
        self.kept = _kept_arrays(call.context_leaves, self.sparse)

    def arguments(self, x_leaves: list[Any], context_leaves: list[list[Any]]) -> tuple[Any, tuple[Any, ...]]:
        x = optree.tree_unflatten(self.x_spec, x_leaves)
        contexts = tuple(
            kind(optree.tree_unflatten(spec, leaves))
            for kind, spec, leaves in zip(self.context_kinds, self.context_specs, context_leaves, strict=True)
        )
        return x, contexts

    def __call__(
        self, x_leaves: list[Any], tangent_leaves: list[Any], context_leaves: list[list[Any]]
    ) -> tuple[Any, Any]:
        x, contexts = self.arguments(x_leaves, context_leaves)
        found = self.kept
        plan = self.sparse
        if found is not None:
            kept, plan = found  # (read together: another thread may be finding the pattern anew)
            if not _arrays_hold(kept, context_leaves):
                plan = _Plan(self.name, self.function(), self.backend, x, contexts)
                self.sparse = plan
                self.kept = _kept_arrays(context_leaves, plan)
        return plan.run(self.name, self.function(), x, contexts), None


_Kept: TypeAlias = tuple[list[tuple[int, Any, Any]], "_Plan"]


def _kept_arrays(context_leaves: list[list[Any]], plan: _Plan) -> _Kept | None:
    """The contexts' arrays (:func:`_context_arrays`) whose values ``plan``'s pattern holds for,
    as a later call compares them, with that plan: every one for a local pattern, those its
    tracer read as they are for a global one (:attr:`diffiface.sparse.Detection.kept`); None
    where there are none. Each is ``(its place, None, contents)`` where its family keeps its
    contents, else ``(its place, the array, None)``, compared by identity (jax's arrays, which
    cannot change in place)."""
    arrays = _context_arrays(context_leaves)
    if isinstance(plan.backend.detector, sparse.LocalDetector):
        places = list(range(len(arrays)))
    else:
        read = {id(array) for array in plan.detection.kept}
        places = [i for i, array in enumerate(arrays) if id(array) in read]
        if not places:
            return None
    kept = []
    for i in places:
        contents = _contents(arrays[i])
        kept.append((i, None, contents) if contents is not None else (i, arrays[i], None))
    return kept, plan


def _arrays_hold(kept: list[tuple[int, Any, Any]], context_leaves: list[list[Any]]) -> bool:
    """Whether the contexts' arrays hold what ``kept`` recorded."""
    arrays = _context_arrays(context_leaves)
    for i, same, contents in kept:
        if i >= len(arrays) or not (contents.holds(arrays[i]) if contents is not None else arrays[i] is same):
            return False
    return True


def _context_arrays(context_leaves: list[list[Any]]) -> list[Any]:
    """The contexts' array leaves, and the arrays their plain objects hold (a model's ``.W``)."""
    return [
        array
        for leaves in context_leaves
        for leaf in leaves
        for array in ((leaf,) if _arrays.is_array(leaf) else held_arrays(leaf))
    ]


def _sparse_program(name: str, f: Callable[..., Any], backend: Any, call: Call) -> tuple[SparseProgram, type[Prep]]:
    return SparseProgram(name, f, backend, call), SparsePrep


register_program(AutoSparse, _sparse_program)


# -- layouts: a tree's leaves as one flat vector --------------------------------------------------


class _Layout:
    """A tree's structure, leaves' shapes, dtypes and kinds, and where each sits in the flat vector."""

    def __init__(self, value: Any) -> None:
        leaves, self.spec = _tree.flatten(value)
        self.kinds = [_arrays.kind(leaf) for leaf in leaves]
        self.shapes = [_arrays.shape(leaf) for leaf in leaves]
        self.dtypes = [_arrays.dtype_name(leaf) for leaf in leaves]
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]
        self.offsets = np.cumsum([0, *sizes]).tolist()
        self.size = int(self.offsets[-1])


@functools.cache
def _matrices(family: str) -> Any:
    """The module of AutoSparse's results on arrays of ``family``: ``sparse/_<family>_matrices.py``."""
    return importlib.import_module(f"{sparse.__name__}._{family}_matrices")


@functools.cache
def _family(kind: str) -> str:
    """The family of the results on a flat vector of ``kind``: its own where it has a matrices module, else the host's."""
    known = kind in _arrays.BY_KIND and importlib.util.find_spec(f"{sparse.__name__}._{kind}_matrices") is not None
    return kind if known else _families.HOST.NAME


def _promote(family: str, names: list[str]) -> Any:
    """The common dtype of these dtype names (the dense operators' rule for a pair of leaves)."""
    floats = [name for name in names if _arrays.is_float_dtype(name) or "complex" in name] or ["float64"]
    return _matrices(family).promote(floats)


# -- the plan: pattern, coloring, the engine's product --------------------------------------------


class _Plan:
    def __init__(
        self, name: str, f: Callable[..., Any], backend: AutoSparse, x: Any, contexts: tuple[Any, ...]
    ) -> None:
        self.hessian = name in _HESSIANS
        self.with_value = name.startswith("value")
        self.backend = backend
        engine = backend.backend
        first = engine.inner if isinstance(engine, SecondOrder) else engine
        self.engine, self.first = engine, first
        flat, _ = _tree.ravel(x)
        self.x_layout = _Layout(x)
        self.family = _family(_arrays.kind(flat))
        self.flat_dtype = _arrays.dtype_name(flat)
        n = self.x_layout.size
        self.detection = sparse.detect(
            f, x, contexts, backend.detector, engine if self.hessian else first, self.hessian
        )
        pattern = self.detection.pattern
        if pattern.shape[1] != n or (self.hessian and pattern.shape[0] != n):
            expected = f"({n}, {n})" if self.hessian else f"(m, {n})"
            raise InvalidInputError(
                f"The sparsity pattern has shape {pattern.shape}, but x has {n} numbers: a "
                f"{'Hessian' if self.hessian else 'Jacobian'} pattern of x must have shape {expected}."
            )
        if self.hessian:
            coloring = sparse.color_hessian(pattern, order=backend.order)
        elif backend.coloring == "auto" and engine.black_box:
            coloring = sparse.color_jacobian(pattern, mode="column", order=backend.order)
        else:
            coloring = sparse.color_jacobian(pattern, mode=backend.coloring, order=backend.order)
            if backend.coloring == "auto" and coloring.mode == "column" and info(first).reverse_first:
                # reverse products cost less than forward ones on these engines (autograd's forward
                # mode is two reverse passes; torch's forward mode runs decompositions): rows on a
                # tie, where "auto" takes columns
                row = sparse.color_jacobian(pattern, mode="row", order=backend.order)
                coloring = row if row.count <= coloring.count else coloring
        self.coloring = coloring
        self.m = int(pattern.shape[0])
        self.n = n
        self.count = int(coloring.count)
        index = np.asarray(coloring.index, dtype=np.int64)
        if coloring.mode in ("row", "bidirectional"):
            self.stacked_index = index  # the products laid end to end (rows of seeds.T @ J, stacked)
        else:  # the products J @ seed_k (H @ seed_k) stacked as rows: transpose the index
            rows = self.n if self.hessian else self.m
            self.stacked_index = (index % max(self.count, 1)) * rows + index // max(self.count, 1)
        self.indptr = np.asarray(pattern.indptr, dtype=np.int64)
        self.indices = np.asarray(pattern.indices, dtype=np.int64)
        self.route: _Route = _route(self, f, x, contexts)

    def run(self, name: str, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> Any:
        out = self.route.run(f, x, contexts)
        values = out[-1]
        if self.backend.check:
            _check_against_dense(self, f, x, contexts, values)
        if self.backend.dense:
            matrix = self._dense(values)
        else:
            matrix = _matrices(self.family).sparse(self, self.indptr, self.indices, values, (self.m, self.n))
        if name == "jacobian" or name == "hessian":
            return matrix
        return (*out[:-1], matrix)

    def _dense(self, values: Any) -> Any:
        xp = _arrays.by_kind(self.family).numpy_like()
        matrices = _matrices(self.family)
        rows = np.repeat(np.arange(self.m), np.diff(self.indptr))
        with _arrays.by_kind(self.family).dtype_scope([_arrays.dtype_name(values)]):  # (jax's x64)
            matrix = matrices.dense(rows, self.indices, values, (self.m, self.n))
            outer = self.x_layout if self.hessian else self.route.y_layout
            inner = self.x_layout
            blocks = []
            for i in range(len(outer.shapes)):
                row = []
                for j in range(len(inner.shapes)):
                    block = matrix[outer.offsets[i] : outer.offsets[i + 1], inner.offsets[j] : inner.offsets[j + 1]]
                    block = xp.reshape(block, (*outer.shapes[i], *inner.shapes[j]))
                    dtype = _promote(self.family, [outer.dtypes[i], inner.dtypes[j]])
                    block = matrices.cast(block, dtype)
                    if outer.kinds[i] == "python" and inner.kinds[j] == "python":
                        block = float(block)
                    row.append(block)
                blocks.append(optree.tree_unflatten(inner.spec, row))
            return optree.tree_unflatten(outer.spec, blocks)


def _route(plan: _Plan, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> _Route:
    products, own = _compiled_products(plan)
    if products is not None and all(_jit_ready(leaf, own) for c in contexts for leaf in _tree.leaves(c.value)):
        try:
            return _CompiledRoute(plan, f, x, contexts, products)
        except Exception:  # f that the engine cannot compile as is (say it writes into a Cache): the
            pass  # generic route runs it through diffiface's adapter, which says why or copes
    if isinstance(plan.engine, AutoScipy) and not plan.hessian:  # (its Hessians: one directional hvp per color)
        return _CompressedInputRoute(plan, f, x, contexts)
    return _ProductRoute(plan, f, x, contexts)


def _compiled_products(plan: _Plan) -> tuple[Any, tuple[str, ...]]:
    """The module that compiles the plan's products into one program (``sparse/_<family>_products.py``
    of the engine's arrays), where the engine compiles (its row's ``jit``, and its option on) and x
    holds the host's arrays or the engine's own; and those two families. None where there is none."""
    engine = plan.engine
    if isinstance(engine, SecondOrder) or not getattr(engine, "jit", False):
        return None, ()
    row = info(engine)
    own = (_families.HOST.NAME, row.arrays)
    name = f"{sparse.__name__}._{row.arrays}_products"
    if not row.jit or plan.family not in own or importlib.util.find_spec(name) is None:
        return None, ()
    return importlib.import_module(name), own


def _jit_ready(leaf: Any, own: tuple[str, ...]) -> bool:
    """Whether a context leaf goes into the compiled program as it is: a float array of the host's
    or the engine's own, or a float."""
    kind = _arrays.kind(leaf)
    return (kind in own and _arrays.is_float_dtype(_arrays.dtype_name(leaf))) or type(leaf) is float


# -- every engine: its own prepared batch of jvps / vjps / hvps ----------------------------------------


class _ProductRoute:
    """The colors' products as the engine's prepared batched jvp / vjp / hvp: one vmapped
    program on torch.func (and jax without jit), a loop of the engine's products elsewhere."""

    def __init__(self, plan: _Plan, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> None:
        self.plan = plan
        flat, unravel = _tree.ravel(x)
        self.xp = _arrays.by_kind(plan.family).numpy_like()
        seeds = np.asarray(plan.coloring.seeds)
        mode = plan.coloring.mode
        self.product_prep: Prep | None = None
        self.reverse_prep: Prep | None = None
        self.tangents: list[Any] = []
        self.cotangents: list[Any] = []
        if mode != "row":
            self.tangents = [unravel(_like(flat, seeds[:, k])) for k in range(seeds.shape[1])]
        self.batch = Tangents(*self.tangents)
        self.gradient_prep: Prep | None = None
        if plan.hessian and plan.with_value:  # (f's value and gradient, returned beside the Hessian)
            self.gradient_prep = ops.prepare_value_and_gradient(f, plan.engine, x, *contexts)
            y, _ = ops.value_and_gradient(f, plan.engine, x, *contexts, prep=self.gradient_prep)
        elif plan.hessian:  # (f's value once, for its dtype)
            y, _ = ops.value_and_gradient(f, plan.engine, x, *contexts)
        elif self.tangents:
            batch = self.batch
            self.product_prep = batched.prepare_value_and_batched_jvp(f, plan.first, x, batch, *contexts)
            y, _ = batched.value_and_batched_jvp(f, plan.first, x, batch, *contexts, prep=self.product_prep)
        else:  # (no forward colors: f's value, for its layout)
            y, _ = ops.value_and_jvp(f, plan.first, x, unravel(_like(flat, np.zeros(plan.n))), *contexts)
        self.y_layout = _Layout(y)
        _check_rows(plan, self.y_layout)
        if mode in ("row", "bidirectional"):  # the rows of the reverse side (after the forward ones)
            y_flat, unravel_y = _tree.ravel(y)
            row_seeds = seeds if mode == "row" else np.asarray(plan.coloring.row_seeds)
            self.cotangents = [unravel_y(_like(y_flat, row_seeds[:, k])) for k in range(row_seeds.shape[1])]
            self.cobatch = Tangents(*self.cotangents)
            if self.cotangents:
                self.reverse_prep = batched.prepare_value_and_batched_vjp(f, plan.first, x, self.cobatch, *contexts)
        elif plan.hessian and plan.count:  # every color in one batch
            self.product_prep = batched.prepare_batched_hvp(f, plan.engine, x, self.batch, *contexts)
        self.dtype = _promote(plan.family, [*plan.x_layout.dtypes, *self.y_layout.dtypes])
        self.index = _matrices(plan.family).index_like(flat, plan.stacked_index)

    def run(self, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        plan, prep = self.plan, self.product_prep
        products: list[Any] = []
        head: tuple[Any, ...] = ()
        if plan.hessian:
            if self.gradient_prep is not None:
                value, gradient = ops.value_and_gradient(f, plan.engine, x, *contexts, prep=self.gradient_prep)
                head = (value, gradient)
            if self.tangents:  # the colors, one batch
                products.extend(batched.batched_hvp(f, plan.engine, x, self.batch, *contexts, prep=prep))
        else:
            if self.tangents:  # the forward colors, one batch
                y, pushed = batched.value_and_batched_jvp(f, plan.first, x, self.batch, *contexts, prep=prep)
                head = (y,)
                products.extend(pushed)
            if self.cotangents:  # the reverse colors, one batch
                y, pulled = batched.value_and_batched_vjp(
                    f, plan.first, x, self.cobatch, *contexts, prep=self.reverse_prep
                )
                head = (y,)
                products.extend(pulled)
        if not head:  # no colors: an empty pattern, and f's value from one call
            head = (f(x, *(c.value for c in contexts)),) if not plan.hessian else head
        values = self._gather([_tree.ravel(p)[0] for p in products])
        return (*head, values)

    def _gather(self, flats: list[Any]) -> Any:
        xp, dtype, matrices = self.xp, self.dtype, _matrices(self.plan.family)
        if not flats:
            return matrices.cast(xp.zeros((0,)), dtype)
        stacked = xp.concatenate([matrices.cast(v.reshape(-1), dtype) for v in flats])
        return matrices.take(stacked, self.index)


def _like(flat: Any, vector: np.ndarray) -> Any:
    """``vector`` as an array of ``flat``'s type and dtype (a tangent, a seed)."""
    return _matrices(_family(_arrays.kind(flat))).like(flat, vector)


def _check_rows(plan: _Plan, y_layout: _Layout) -> None:
    if plan.hessian:
        return
    if y_layout.size != plan.m:
        raise InvalidInputError(
            f"The sparsity pattern has {plan.m} rows, but f(x) has {y_layout.size} numbers: a Jacobian "
            f"pattern must have shape ({y_layout.size}, {plan.n})."
        )


# -- scipy: the Jacobian of z -> f(x + S z), for count inputs z ------------------------------------


class _CompressedInputRoute:
    def __init__(self, plan: _Plan, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> None:
        self.plan = plan
        flat, unravel = _tree.ravel(x)
        # scipy evaluates f at float64 points where x holds float32 numpy arrays, as its dense
        # operators do (its adaptive steps need that precision): x + S z is float64 there, and
        # x's own unravel would round it, and so the steps, to float32
        wide = _tree.ravel(_tree.map(_float64, x))[1]
        family = plan.family
        seeds = _like(flat, np.asarray(plan.coloring.seeds))
        with _arrays.by_kind(family).dtype_scope([plan.flat_dtype]):  # (jax's x64)
            y = f(x, *(c.value for c in contexts))
        self.y_layout = _Layout(y)
        _check_rows(plan, self.y_layout)
        self.unravel_y = _tree.ravel(y)[1]

        def compressed(z: Any, x_flat: Any, *values: Any) -> Any:
            point = x_flat + seeds @ z  # (at x itself, x's dtype: f(x) as f computes it)
            return _tree.ravel(f((wide if point.dtype == np.float64 else unravel)(point), *values))[0]

        self.compressed = compressed  # held here: the prep of scipy's Jacobian refers to it weakly
        self.z = _like(flat, np.zeros(plan.count))
        self.jacobian_prep = ops.prepare_value_and_jacobian(compressed, plan.engine, self.z, Constant(flat), *contexts)
        self.dtype = _promote(family, [*plan.x_layout.dtypes, *self.y_layout.dtypes])
        self.index = _matrices(family).index_like(flat, np.asarray(plan.coloring.index, dtype=np.int64))

    def run(self, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        flat, _ = _tree.ravel(x)
        y_flat, compressed = ops.value_and_jacobian(
            self.compressed, self.plan.engine, self.z, Constant(flat), *contexts, prep=self.jacobian_prep
        )
        matrices = _matrices(self.plan.family)
        values = matrices.take(matrices.cast(compressed, self.dtype), self.index)
        return (self.unravel_y(y_flat), values)


def _float64(leaf: Any) -> Any:
    """A float32 numpy leaf, array or scalar, as float64; other leaves as they are."""
    if isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype == np.float32:
        return leaf.astype(np.float64)
    return leaf


# -- jax: the products and the gather in one compiled program --------------------------------------


class _CompiledRoute:
    """The products of an engine that compiles them with the gather into one program
    (``sparse/_<family>_products.py``'s ``Products``)."""

    def __init__(self, plan: _Plan, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], products: Any) -> None:
        self.plan = plan
        self.products = products.Products(plan, f, x, contexts, plan.with_value)
        structs = self.products.out_structs
        if plan.hessian:
            self.y_layout = _Layout(np.zeros(structs.shape, structs.dtype))
        else:
            self.y_spec = self.products.y_spec
            self.y_layout = _Layout(optree.tree_unflatten(self.y_spec, [np.zeros(a.shape, a.dtype) for a in structs]))
            _check_rows(plan, self.y_layout)
        self.values_only = self.products.values_only
        self.to_numpy = plan.family == _families.HOST.NAME
        self.x_python = [kind == "python" for kind in plan.x_layout.kinds]

    def run(self, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        out = self.products(x, contexts)
        if self.values_only:
            return (np.asarray(out) if self.to_numpy else out,)
        if self.plan.hessian:
            value, grad, values = out
            if self.to_numpy:
                value, grad, values = np.asarray(value)[()], np.asarray(grad), np.asarray(values)
            layout, leaves = self.plan.x_layout, []
            for i, shape in enumerate(layout.shapes):  # (the gradient as a tree like x)
                piece = grad[layout.offsets[i] : layout.offsets[i + 1]].reshape(shape).astype(layout.dtypes[i])
                leaves.append(float(piece) if self.x_python[i] else piece)
            return value, optree.tree_unflatten(layout.spec, leaves), values
        y_leaves, values = out
        if self.to_numpy:
            y_leaves = [np.asarray(leaf) for leaf in y_leaves]
            values = np.asarray(values)
        return optree.tree_unflatten(self.y_spec, list(y_leaves)), values


_Route: TypeAlias = _ProductRoute | _CompressedInputRoute | _CompiledRoute
"""A plan's products and their gather; each route has ``run(f, x, contexts)`` (f's value or
value and gradient, then the matrix's values) and ``y_layout``."""


# -- the opt-in check: one dense product along a random direction ----------------------------------


def _check_against_dense(plan: _Plan, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], values: Any) -> None:
    import scipy.sparse

    from ._errors import DiffifaceError

    flat, unravel = _tree.ravel(x)
    data = _arrays.to_numpy(values).astype(np.float64)
    matrix = scipy.sparse.csr_array((data, plan.indices, plan.indptr), shape=(plan.m, plan.n))
    rng = np.random.default_rng(0)
    tangent: Any = None
    if plan.coloring.mode == "row":
        y, _ = ops.value_and_jvp(f, plan.first, x, unravel(_like(flat, np.zeros(plan.n))), *contexts)
        y_flat, unravel_y = _tree.ravel(y)
        w = rng.standard_normal(plan.m)
        dense = _tree.ravel(ops.vjp(f, plan.first, x, unravel_y(_like(y_flat, w)), *contexts))[0]
        sparse_product = matrix.T @ w
    else:
        v = rng.standard_normal(plan.n)
        tangent = unravel(_like(flat, v))
        dense = _product(plan, plan.engine if plan.hessian else plan.first, f, x, tangent, contexts)
        sparse_product = matrix @ v
    reference = _arrays.to_numpy(dense).astype(np.float64)
    scale = 1.0 + float(np.max(np.abs(reference), initial=0.0))
    estimated = _difference_error(plan, f, x, contexts, tangent, reference) if plan.coloring.mode != "row" else None
    if estimated is not None:
        tolerance = estimated / scale
    else:
        exact = not plan.engine.black_box and "float64" in plan.flat_dtype
        tolerance = 1e-8 if exact else 1e-3
    worst = float(np.max(np.abs(sparse_product - reference), initial=0.0))
    if worst > tolerance * scale:
        what = "Hessian" if plan.hessian else "Jacobian"
        raise DiffifaceError(
            f"AutoSparse(check=True): the sparse {what} times a random direction differs from the dense "
            f"product by {worst:.3g} (tolerance {tolerance * scale:.3g}): the sparsity pattern misses nonzeros "
            f"of the {what}. A LocalDetector or KnownPattern pattern holds only where it was found; use "
            "GlobalDetector() or a pattern that covers every nonzero."
        )


def _difference_error(
    plan: _Plan, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], tangent: Any, reference: np.ndarray
) -> float | None:
    """The error of a finite-difference product, from the engine's own error: the same product
    with a step four times as long differs from it by about its truncation error times 16 (2 for
    one-sided differences), and by its rounding error; ten times that difference, and never less
    than ten times the error the method's step balances to, is the tolerance. None where the
    engine is not finite differences of a known step."""
    import dataclasses

    from ._backends import AutoFiniteDifferences

    engine = plan.engine if plan.hessian else plan.first
    if not isinstance(engine, AutoFiniteDifferences) or engine.method == "complex":
        return None
    flat, _ = _tree.ravel(x)
    eps = float(
        np.finfo(np.dtype(plan.flat_dtype) if plan.flat_dtype in ("float16", "float32", "float64") else np.float64).eps
    )
    power = 0.25 if plan.hessian else (1.0 / 3.0 if engine.method == "central" else 0.5)
    size = max(1.0, float(np.max(np.abs(_arrays.to_numpy(flat)), initial=0.0)))
    step = 4.0 * (engine.step if engine.step is not None else eps**power * size)
    other = _product(plan, dataclasses.replace(engine, step=step), f, x, tangent, contexts)
    difference = float(np.max(np.abs(_arrays.to_numpy(other).astype(np.float64) - reference), initial=0.0))
    scale = 1.0 + float(np.max(np.abs(reference), initial=0.0))
    balanced = float(eps ** (1.0 - power if not plan.hessian else 0.5)) * scale
    return 10.0 * max(difference, balanced)


def _product(plan: _Plan, engine: Any, f: Callable[..., Any], x: Any, tangent: Any, contexts: tuple[Any, ...]) -> Any:
    """The dense Hessian-vector (Jacobian-vector) product along ``tangent``, flat."""
    return _tree.ravel((ops.hvp if plan.hessian else ops.jvp)(f, engine, x, tangent, *contexts))[0]
