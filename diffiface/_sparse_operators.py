"""The sparse route of :class:`~diffiface.AutoSparse`: detect, color, one product per color, gather.

Preparation finds the pattern (``diffiface.sparse``), colors it, and prepares the wrapped
engine's products once; a call runs one batched jvp (column coloring) or vjp (row coloring) for
all colors, or one batched hvp (star coloring of a Hessian), and decompresses with the gather
``compressed.reshape(-1)[index]``. x and f(x) are flattened in :func:`diffiface.tree.ravel`
order. On jax the products and the gather are one compiled program (``vmap`` over the seeds);
every other engine runs its own prepared batched ``jvp``/``vjp``/``hvp`` (one vmapped program
on torch.func, a loop elsewhere) through diffiface's operators, so their checks
(mutation, dtypes, contexts) hold unchanged. Scipy, which has no
product cheaper than a full Jacobian, differentiates ``z -> f(x + S z)`` for the ``count``
inputs ``z``.

A sparse prep is a plan of the one route (:mod:`diffiface._dispatch`) whose program runs the
products and the decompression: the route registers :class:`SparseProgram` for AutoSparse
(:func:`~diffiface._dispatch.register_program`), so that this module, which calls the public
operators, sits above them. An unprepared call finds its prep in the one prep cache, keyed by
the signature with the values of the contexts' other leaves (the pattern is detected for
them), so the pattern is found once per signature.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree

from . import _arrays, _backends, _complex, sparse
from . import _batched as batched
from . import _operators as ops
from . import tree as _tree
from ._adapters import info, normalize
from ._backends import AutoJAX, AutoScipy, Backend, SecondOrder
from ._call import Call
from ._contexts import Constant
from ._dispatch import register_program
from ._errors import InvalidBackendOptionError, InvalidInputError
from ._prep import FunctionRef, Prep
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
_ARRAY_KINDS = frozenset({"numpy", "torch", "jax"})


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

    __slots__ = ("context_kinds", "context_specs", "function", "name", "sparse", "x_spec")

    def __init__(self, name: str, f: Callable[..., Any], backend: AutoSparse, call: Call) -> None:
        _complex.refuse_sparse(call)
        self.name = name
        self.function = FunctionRef(f)
        self.x_spec = call.signature.x_spec
        self.context_kinds = tuple(spec[0] for spec in call.signature.contexts)
        self.context_specs = tuple(call.context_specs)
        x, contexts = self.arguments(call.x_leaves, call.context_leaves)
        self.sparse = _Plan(name, f, backend, x, contexts)

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
        return self.sparse.run(self.name, self.function(), x, contexts), None


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


def _family(flat: Any) -> str:
    kind = _arrays.kind(flat)
    return kind if kind in ("torch", "jax") else "numpy"


def _xp(family: str) -> Any:
    if family == "torch":
        return sys.modules["torch"]
    if family == "jax":
        return sys.modules["jax.numpy"]
    return np


def _promote(family: str, names: list[str]) -> Any:
    """The common dtype of these dtype names (the dense operators' rule for a pair of leaves)."""
    floats = [name for name in names if _arrays.is_float_dtype(name) or "complex" in name] or ["float64"]
    if family == "torch":
        torch = sys.modules["torch"]
        dtype = getattr(torch, floats[0])
        for name in floats[1:]:
            dtype = torch.promote_types(dtype, getattr(torch, name))
        return dtype
    if family == "jax":
        return sys.modules["jax.numpy"].dtype(np.result_type(*floats).name)  # numpy's rule: no strict mode
    return np.result_type(*floats)


def _x64(on: bool) -> Any:
    return _tree._x64(on)  # a scope where jax keeps float64; nothing when off


# -- the plan: pattern, coloring, the engine's product --------------------------------------------


_TORCH_CSR_WARNED = False
"""Whether torch has given its once-per-process warning on sparse CSR tensors (under a filter
that hid it): later results are built without changing the warning filters."""


def _torch_csr_warned() -> None:
    global _TORCH_CSR_WARNED
    _TORCH_CSR_WARNED = True


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
        self.family = _family(flat)
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
        elif backend.coloring == "auto" and _reverse_first(first):
            # reverse products cost less than forward ones on these engines (autograd's forward
            # mode is two reverse passes; torch's forward mode runs decompositions): rows on a tie
            column = sparse.color_jacobian(pattern, mode="column", order=backend.order)
            row = sparse.color_jacobian(pattern, mode="row", order=backend.order)
            coloring = row if row.count <= column.count else column
            best = sparse.color_jacobian(pattern, mode="auto", order=backend.order)  # bidirectional where it wins
            coloring = best if best.mode == "bidirectional" and best.count < coloring.count else coloring
        else:
            coloring = sparse.color_jacobian(pattern, mode=backend.coloring, order=backend.order)
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
        kind = _arrays.kind(x)
        self.array_key = _arrays.leaf_signature(x) if kind in _ARRAY_KINDS and not contexts else None
        """The signature of x where x is one array and there are no contexts (the fast check)."""
        self.indptr = np.asarray(pattern.indptr, dtype=np.int64)
        self.indices = np.asarray(pattern.indices, dtype=np.int64)
        self._bcoo_treedef: Any = None
        self.route: _Route = _route(self, f, x, contexts)

    def run(self, name: str, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> Any:
        out = self.route.run(f, x, contexts)
        values = out[-1]
        if self.backend.check:
            self.route.check(f, x, contexts, values)
        matrix = self._dense(values) if self.backend.dense else self._sparse(values)
        if name == "jacobian" or name == "hessian":
            return matrix
        return (*out[:-1], matrix)

    # -- results ---------------------------------------------------------------------------

    def _sparse(self, values: Any) -> Any:
        shape = (self.m, self.n)
        if self.family == "torch":
            torch = sys.modules["torch"]
            device = values.device

            def build() -> Any:
                return torch.sparse_csr_tensor(
                    torch.from_numpy(self.indptr.copy()).to(device),
                    torch.from_numpy(self.indices.copy()).to(device),
                    values,
                    size=shape,
                    check_invariants=False,  # built from a canonical pattern
                )

            if _TORCH_CSR_WARNED:
                return build()
            with warnings.catch_warnings():  # torch says once per process that sparse CSR is in beta
                warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
                matrix = build()
            _torch_csr_warned()
            return matrix
        if self.family == "jax":
            treedef = self._bcoo_treedef
            if treedef is None:
                from jax.experimental import sparse as jax_sparse

                made = jax_sparse.BCOO(
                    (values, _bcoo_indices(self)), shape=shape, indices_sorted=True, unique_indices=True
                )
                self._bcoo_treedef = sys.modules["jax"].tree_util.tree_structure(made)
                return made
            # rebuilt from its parts: BCOO's constructor checks its arguments, which costs more
            # than the products of a small Jacobian
            return treedef.unflatten((values, _bcoo_indices(self)))
        import scipy.sparse

        return scipy.sparse.csr_array((np.asarray(values), self.indices.copy(), self.indptr.copy()), shape=shape)

    def _dense(self, values: Any) -> Any:
        xp = _xp(self.family)
        rows = np.repeat(np.arange(self.m), np.diff(self.indptr))
        with _x64(self.family == "jax" and "float64" in str(values.dtype)):
            if self.family == "torch":
                matrix = xp.zeros((self.m, self.n), dtype=values.dtype, device=values.device)
                matrix[xp.from_numpy(rows).to(values.device), xp.from_numpy(self.indices).to(values.device)] = values
            elif self.family == "jax":
                matrix = xp.zeros((self.m, self.n), dtype=values.dtype).at[rows, self.indices].set(values)
            else:
                matrix = np.zeros((self.m, self.n), dtype=np.asarray(values).dtype)
                matrix[rows, self.indices] = values
            outer = self.x_layout if self.hessian else self.route.y_layout
            inner = self.x_layout
            blocks = []
            for i in range(len(outer.shapes)):
                row = []
                for j in range(len(inner.shapes)):
                    block = matrix[outer.offsets[i] : outer.offsets[i + 1], inner.offsets[j] : inner.offsets[j + 1]]
                    block = xp.reshape(block, (*outer.shapes[i], *inner.shapes[j]))
                    dtype = _promote(self.family, [outer.dtypes[i], inner.dtypes[j]])
                    block = block.to(dtype) if self.family == "torch" else block.astype(dtype)
                    if outer.kinds[i] == "python" and inner.kinds[j] == "python":
                        block = float(block)
                    row.append(block)
                blocks.append(optree.tree_unflatten(inner.spec, row))
            return optree.tree_unflatten(outer.spec, blocks)


class _Route:
    y_layout: _Layout

    def run(self, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        raise NotImplementedError

    def check(self, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], values: Any) -> None:
        raise NotImplementedError


def _route(plan: _Plan, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> _Route:
    compiled = isinstance(plan.engine, AutoJAX) and plan.engine.jit and plan.family in ("numpy", "jax")
    if compiled and all(_jax_ready(leaf) for c in contexts for leaf in _tree.leaves(c.value)):
        try:
            return _JaxRoute(plan, f, x, contexts, plan.with_value)
        except Exception:  # f that jax cannot compile as is (say it writes into a Cache): the
            pass  # generic route runs it through diffiface's jax adapter, which says why or copes
    if isinstance(plan.engine, AutoScipy) and not plan.hessian:  # (its Hessians: one directional hvp per color)
        return _CompressedInputRoute(plan, f, x, contexts)
    return _ProductRoute(plan, f, x, contexts)


def _reverse_first(engine: Backend) -> bool:
    return info(engine).reverse_first


def _jax_ready(leaf: Any) -> bool:
    kind = _arrays.kind(leaf)
    return (kind in ("numpy", "jax") and _arrays.is_float_dtype(_arrays.dtype_name(leaf))) or type(leaf) is float


# -- every engine: its own prepared batch of jvps / vjps / hvps ----------------------------------------


class _ProductRoute(_Route):
    """The colors' products as the engine's prepared batched jvp / vjp / hvp: one vmapped
    program on torch.func (and jax without jit), a loop of the engine's products elsewhere."""

    def __init__(self, plan: _Plan, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> None:
        self.plan = plan
        flat, unravel = _tree.ravel(x)
        self.xp = _xp(plan.family)
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
        self.index = _index_like(plan.family, flat, plan.stacked_index)

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
            head = (_value(f, x, contexts),) if not plan.hessian else head
        values = self._gather([_tree.ravel(p)[0] for p in products])
        return (*head, values)

    def _gather(self, flats: list[Any]) -> Any:
        xp, dtype = self.xp, self.dtype
        if not flats:
            return _cast(xp.zeros((0,)), dtype, self.plan.family)
        stacked = xp.concatenate([_cast(v.reshape(-1), dtype, self.plan.family) for v in flats])
        return _take(self.plan.family, stacked, self.index)

    def check(self, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], values: Any) -> None:
        _check_against_dense(self.plan, f, x, contexts, values)


def _value(f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> Any:
    return f(x, *(c.value for c in contexts))


def _like(flat: Any, vector: np.ndarray) -> Any:
    """``vector`` as an array of ``flat``'s type and dtype (a tangent, a seed)."""
    family = _family(flat)
    if family == "torch":
        return sys.modules["torch"].from_numpy(np.ascontiguousarray(vector)).to(dtype=flat.dtype, device=flat.device)
    if family == "jax":
        jnp = sys.modules["jax.numpy"]
        with _x64(str(flat.dtype) == "float64"):
            return jnp.asarray(vector, dtype=flat.dtype)
    return np.asarray(vector, dtype=flat.dtype)


def _take(family: str, compressed: Any, index: Any) -> Any:
    """The decompression: ``compressed.reshape(-1)[index]``."""
    if family == "torch":  # indexing by a tensor is slow on some of torch's outputs (10 ms at 3e4)
        return sys.modules["torch"].index_select(compressed.reshape(-1), 0, index)
    return compressed.reshape(-1)[index]


def _cast(array: Any, dtype: Any, family: str) -> Any:
    if family == "torch":
        return array.to(dtype)
    with _x64(family == "jax" and str(dtype) == "float64"):
        return array.astype(dtype)


def _index_like(family: str, flat: Any, index: np.ndarray) -> Any:
    if family == "torch":
        return sys.modules["torch"].from_numpy(index).to(flat.device)
    if family == "jax":
        with _x64(True):
            return sys.modules["jax.numpy"].asarray(index)
    return index


def _bcoo_indices(plan: _Plan) -> Any:
    cached = getattr(plan, "_bcoo", None)
    if cached is None:
        jnp = sys.modules["jax.numpy"]
        rows = np.repeat(np.arange(plan.m), np.diff(plan.indptr))
        cached = jnp.asarray(np.stack([rows, plan.indices], axis=1).astype(np.int32))
        plan._bcoo = cached  # type: ignore[attr-defined]
    return cached


def _check_rows(plan: _Plan, y_layout: _Layout) -> None:
    if plan.hessian:
        return
    if y_layout.size != plan.m:
        raise InvalidInputError(
            f"The sparsity pattern has {plan.m} rows, but f(x) has {y_layout.size} numbers: a Jacobian "
            f"pattern must have shape ({y_layout.size}, {plan.n})."
        )


# -- scipy: the Jacobian of z -> f(x + S z), for count inputs z ------------------------------------


class _CompressedInputRoute(_Route):
    def __init__(self, plan: _Plan, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> None:
        self.plan = plan
        flat, unravel = _tree.ravel(x)
        family = plan.family
        seeds = _like(flat, np.asarray(plan.coloring.seeds))
        with _x64(family == "jax" and plan.flat_dtype == "float64"):
            y = _value(f, x, contexts)
        self.y_layout = _Layout(y)
        _check_rows(plan, self.y_layout)
        self.unravel_y = _tree.ravel(y)[1]

        def compressed(z: Any, x_flat: Any, *values: Any) -> Any:
            return _tree.ravel(f(unravel(x_flat + seeds @ z), *values))[0]

        self.compressed = compressed  # held here: the prep of scipy's Jacobian refers to it weakly
        self.z = _like(flat, np.zeros(plan.count))
        self.jacobian_prep = ops.prepare_value_and_jacobian(compressed, plan.engine, self.z, Constant(flat), *contexts)
        self.dtype = _promote(family, [*plan.x_layout.dtypes, *self.y_layout.dtypes])
        self.index = _index_like(family, flat, _untransposed(plan))

    def run(self, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        flat, _ = _tree.ravel(x)
        y_flat, compressed = ops.value_and_jacobian(
            self.compressed, self.plan.engine, self.z, Constant(flat), *contexts, prep=self.jacobian_prep
        )
        values = _take(self.plan.family, _cast(compressed, self.dtype, self.plan.family), self.index)
        return (self.unravel_y(y_flat), values)

    def check(self, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], values: Any) -> None:
        _check_against_dense(self.plan, f, x, contexts, values)


def _untransposed(plan: _Plan) -> np.ndarray:
    return np.asarray(plan.coloring.index, dtype=np.int64)


# -- jax: the products and the gather in one compiled program --------------------------------------


class _JaxRoute(_Route):
    def __init__(self, plan: _Plan, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], with_value: bool) -> None:
        import jax
        import jax.numpy as jnp

        self.plan = plan
        layout = plan.x_layout
        self.wide = "float64" in layout.dtypes or "float64" in {
            _arrays.dtype_name(leaf) for c in contexts for leaf in _tree.leaves(c.value)
        }
        seeds_t = np.ascontiguousarray(np.asarray(plan.coloring.seeds).T)
        forward_t = seeds_t
        backward_t = np.ascontiguousarray(np.asarray(plan.coloring.row_seeds).T)
        index = plan.stacked_index.astype(
            np.int32 if plan.stacked_index.size and plan.stacked_index.max() < 2**31 else np.int64
        )
        mode, hessian, count = plan.coloring.mode, plan.hessian, plan.count
        offsets, shapes, dtypes, spec = layout.offsets, layout.shapes, layout.dtypes, layout.spec
        y_info: list[Any] = []

        x_dtype = plan.flat_dtype

        def unflatten(flat: Any) -> Any:
            leaves = [
                jnp.reshape(flat[offsets[i] : offsets[i + 1]], shapes[i]).astype(dtypes[i]) for i in range(len(shapes))
            ]
            return optree.tree_unflatten(spec, leaves)

        def flat_output(flat: Any, values: tuple[Any, ...]) -> Any:
            y = f(unflatten(flat), *values)
            leaves, y_spec = _tree.flatten(y)
            arrays = [jnp.asarray(leaf) for leaf in leaves]
            if not y_info:
                y_info.append(y_spec)
            if not arrays:
                return jnp.zeros((0,)), arrays
            common = np.result_type(*[a.dtype.name for a in arrays]).name  # cast explicitly: jax
            return jnp.concatenate([a.reshape(-1).astype(common) for a in arrays]), arrays  # may be strict

        def program(xs: tuple[Any, ...], values: tuple[Any, ...]) -> Any:
            flat = (
                jnp.concatenate([jnp.reshape(jnp.asarray(leaf), (-1,)).astype(x_dtype) for leaf in xs])
                if xs
                else jnp.zeros((0,))
            )
            seeds = jnp.asarray(seeds_t, dtype=flat.dtype)
            if hessian:

                def scalar(v: Any) -> Any:
                    out = f(unflatten(v), *values)
                    return jnp.reshape(jnp.asarray(out), ())

                (value, grad), linear = jax.linearize(jax.value_and_grad(scalar), flat)
                stacked = jax.vmap(lambda s: linear(s)[1])(seeds) if count else jnp.zeros((0,), flat.dtype)
                return value, grad, stacked.reshape(-1)[index]
            if mode == "bidirectional":  # forward products for the columns, reverse for the rows
                (y_flat, y_leaves), pull = jax.vjp(lambda v: flat_output(v, values), flat)
                cotangent_leaves = [jnp.zeros_like(a) for a in y_leaves]
                forward = jnp.asarray(forward_t, dtype=flat.dtype)
                backward = jnp.asarray(backward_t, dtype=flat.dtype)
                pushed = (
                    jax.vmap(lambda s: jax.jvp(lambda v: flat_output(v, values)[0], (flat,), (s,))[1])(forward)
                    if forward.shape[0]
                    else jnp.zeros((0,), y_flat.dtype)
                )
                pulled = (
                    jax.vmap(lambda s: pull((s.astype(y_flat.dtype), cotangent_leaves))[0])(backward)
                    if backward.shape[0]
                    else jnp.zeros((0,), flat.dtype)
                )
                dtype = np.result_type(flat.dtype.name, y_flat.dtype.name).name
                both = jnp.concatenate([pushed.astype(dtype).reshape(-1), pulled.astype(dtype).reshape(-1)])
                return tuple(y_leaves), both[index]
            if mode == "row":
                (y_flat, y_leaves), pull = jax.vjp(lambda v: flat_output(v, values), flat)
                cotangent_leaves = [jnp.zeros_like(a) for a in y_leaves]
                stacked = (
                    jax.vmap(lambda s: pull((s.astype(y_flat.dtype), cotangent_leaves))[0])(seeds)
                    if count
                    else jnp.zeros((0,), flat.dtype)
                )
            else:
                (y_flat, y_leaves), linear = jax.linearize(lambda v: flat_output(v, values), flat)
                stacked = jax.vmap(lambda s: linear(s)[0])(seeds) if count else jnp.zeros((0,), y_flat.dtype)
            dtype = np.result_type(flat.dtype.name, y_flat.dtype.name).name
            return tuple(y_leaves), stacked.astype(dtype).reshape(-1)[index]

        self.program = jax.jit(program)
        # one array x and no contexts: a program of that array alone, which jax calls without
        # taking a tree apart; for jacobian and hessian, one that returns the values alone
        self.single = len(layout.shapes) == 1 and not contexts and layout.kinds[0] != "python"
        self.values_only = self.single and not with_value
        self.flat: Any = None
        if self.single:
            self.flat = jax.jit(
                (lambda leaf: program((leaf,), ())[-1]) if self.values_only else (lambda leaf: program((leaf,), ()))
            )
        self.to_numpy = plan.family == "numpy"
        with _x64(self.wide):
            xs = self._xs(x)
            values = self._values(contexts)
            structs = jax.eval_shape(program, xs, values)  # f's output structure, without compiling
            out = self.program(xs, values) if self.flat is None else self.flat(xs[0])  # traced, compiled
        if hessian:
            self.y_layout = _Layout(np.zeros(structs[0].shape, structs[0].dtype))
        else:
            self.y_spec = y_info[0]
            self.y_layout = _Layout(
                optree.tree_unflatten(self.y_spec, [np.zeros(a.shape, a.dtype) for a in structs[0]])
            )
            _check_rows(plan, self.y_layout)
        del out
        self.x_python = [kind == "python" for kind in layout.kinds]

    def _xs(self, x: Any) -> tuple[Any, ...]:
        return tuple(_tree.flatten(x)[0])

    def _values(self, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(c.value for c in contexts)

    def run(self, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.flat is not None and not self.wide:
            out = self.flat(x)
        elif self.flat is not None:
            with _x64(True):
                out = self.flat(x)
        elif self.wide:
            with _x64(True):
                out = self.program(self._xs(x), self._values(contexts))
        else:
            out = self.program(self._xs(x), self._values(contexts))
        if self.values_only:
            return (np.asarray(out) if self.to_numpy else out,)
        if self.plan.hessian:
            value, grad, values = out
            if self.to_numpy:
                value, values = _numpy_float(value), np.asarray(values)
                grad = self._x_tree(np.asarray(grad))
            else:
                grad = self._x_tree(grad)
            return value, grad, values
        y_leaves, values = out
        if self.to_numpy:
            y_leaves = [np.asarray(leaf) for leaf in y_leaves]
            values = np.asarray(values)
        return optree.tree_unflatten(self.y_spec, list(y_leaves)), values

    def _x_tree(self, flat: Any) -> Any:
        layout = self.plan.x_layout
        leaves = []
        for i, shape in enumerate(layout.shapes):
            piece = flat[layout.offsets[i] : layout.offsets[i + 1]].reshape(shape).astype(layout.dtypes[i])
            leaves.append(float(piece) if self.x_python[i] else piece)
        return optree.tree_unflatten(layout.spec, leaves)

    def check(self, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], values: Any) -> None:
        _check_against_dense(self.plan, f, x, contexts, values)


def _numpy_float(value: Any) -> Any:
    return np.asarray(value)[()]


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
        if plan.hessian:
            dense = _tree.ravel(ops.hvp(f, plan.engine, x, tangent, *contexts))[0]
        else:
            dense = _tree.ravel(ops.jvp(f, plan.first, x, tangent, *contexts))[0]
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
    longer = dataclasses.replace(engine, step=step)
    if plan.hessian:
        other = _tree.ravel(ops.hvp(f, longer, x, tangent, *contexts))[0]
    else:
        other = _tree.ravel(ops.jvp(f, longer, x, tangent, *contexts))[0]
    difference = float(np.max(np.abs(_arrays.to_numpy(other).astype(np.float64) - reference), initial=0.0))
    scale = 1.0 + float(np.max(np.abs(reference), initial=0.0))
    balanced = float(eps ** (1.0 - power if not plan.hessian else 0.5)) * scale
    return 10.0 * max(difference, balanced)
