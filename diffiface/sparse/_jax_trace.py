"""Global sparsity detection for jax programs: the program jax traces of ``f`` run on index sets
(``_index_sets``), one rule per primitive; a primitive without one is dense (each output depends
on everything its operands depend on). Values are followed too, where they do not depend on the
inputs (the arrays ``f`` closes over, ``iota``, what is computed from them), so that indices
known when ``f`` is traced pick exact rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _arrays, tree
from .._errors import BackendUnavailableError, DiffifaceError, InvalidOutputError, UnsupportedOperationError
from . import _index_sets as sets
from ._graphs import Detection, as_pattern, first_line, leaf_function

if TYPE_CHECKING:
    from scipy.sparse import csr_array

Pattern = sets.Rows

MAX_FIXED_POINT_ROUNDS = 64
"""Rounds of a loop body before a loop's carried values are taken to depend on everything."""

UNROLL_LIMIT = 4096
"""A scan whose iterations times body operations stay within this is run iteration by iteration."""


def _jax() -> Any:
    try:
        import jax
    except ImportError as error:
        raise BackendUnavailableError(
            'GlobalDetector traces f with jax, which is not installed: pip install "diffiface[jax]", or use '
            "LocalDetector(...) or KnownPattern(pattern)."
        ) from error
    return jax


# --- tracing ---------------------------------------------------------------------------------------


def _trace(fun: Callable[..., Any], x: Any, values: list[Any]) -> tuple[Any, int]:
    """The closed jaxpr of ``fun(x, *values)`` over the leaves of ``x`` then the context arrays
    (abstract: the pattern holds for every value they take), its outputs the leaves of the
    result; and the number of x leaves."""
    jax = _jax()
    leaves = tree.leaves(x)
    run, context_arrays = leaf_function(fun, x, values, _arrays.is_array)
    # (each leaf's dtype as jax names it, bfloat16 included; a Python number's is float64)
    structs = [
        jax.ShapeDtypeStruct(_arrays.shape(leaf), jax.numpy.dtype(_arrays.dtype_name(leaf)))
        for leaf in [*leaves, *context_arrays]
    ]
    try:
        with jax.enable_x64(True):
            closed = jax.make_jaxpr(run)(*structs)
    except DiffifaceError:
        raise
    except Exception as error:
        if not _tracing_error(error):
            raise  # f's own exception (a ValueError f raises on its input), as f raised it
        raise UnsupportedOperationError(
            f"GlobalDetector could not trace f with jax ({type(error).__name__}: {first_line(error)}). It reads "
            "the pattern from the program jax traces, so f must be written with jax.numpy or the array API "
            "(array_api_compat.array_namespace), without Python branches on values. Use "
            "LocalDetector(...) (dense derivatives at a few points, with the backend given) or "
            "KnownPattern(pattern) instead."
        ) from error
    return closed, len(leaves)


def _tracing_error(error: BaseException) -> bool:
    """Whether ``error`` comes from tracing f with jax (a tracer where f needs a value, a function
    of another library given a tracer) rather than from f itself."""
    jax = _jax()
    if isinstance(error, (jax.errors.JAXTypeError, jax.errors.JAXIndexError)):
        return True
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:  # jax chains its own frames as a cause
        seen.add(id(current))
        if type(current).__module__.startswith(("jax.", "jaxlib.")):
            return True
        current = current.__cause__ or current.__context__
    text = f"{type(error).__name__} {error}"
    return any(word in text for word in ("Tracer", "tracer", "jax", "Jaxpr", "ShapeDtypeStruct", "abstract"))


def output_size(f: Callable[..., Any], x: Any, values: list[Any]) -> int:
    closed, _ = _trace(f, x, values)
    return sum(_size(v.aval) for v in closed.jaxpr.outvars)


def _size(aval: Any) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def _is_float(aval: Any) -> bool:
    """Whether values of this type carry derivatives (floating or complex; bfloat16 included,
    which numpy alone does not count as inexact; float0, integers and booleans do not)."""
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and bool(_jax().numpy.issubdtype(dtype, np.inexact))


def _jacobian(f: Callable[..., Any], x: Any, values: list[Any], notes: list[str] | None = None) -> csr_array:
    """The Jacobian pattern of the program jax traces of ``f``: x's leaves depend each on itself,
    the contexts on nothing. ``notes``, where given, gets the operations taken as dense."""
    closed, k = _trace(f, x, values)
    invars = closed.jaxpr.invars
    sizes = [_size(v.aval) for v in invars[:k]]
    n = sum(sizes)
    inputs = sets.identity(sizes) + [None] * (len(invars) - k)
    with _jax().enable_x64(True):
        outs = _Interpreter(n, notes).run_closed(closed, inputs, [None] * len(inputs))[0]
    return sets.stack(outs, [_size(v.aval) for v in closed.jaxpr.outvars], n)


READS_HOST_ARRAYS = True
"""Whether this tracer reads a function of the host's (numpy) x too: one written with jax.numpy
or the array API, where the numpy tracer cannot follow it."""


def trace_pattern(f: Callable[..., Any], x: Any, values: list[Any], hessian: bool) -> Detection:
    """The Jacobian (``hessian=False``) or Hessian pattern of ``f(x, *values)``."""
    notes: list[str] = []
    pattern = _hessian(f, x, values, notes) if hessian else as_pattern(_jacobian(f, x, values, notes))
    return Detection(pattern, "jax", tuple(dict.fromkeys(notes)))


def _hessian(f: Callable[..., Any], x: Any, values: list[Any], notes: list[str]) -> csr_array:
    """The Jacobian pattern of ``jax.grad(f)``'s program, made symmetric."""
    jax = _jax()

    def scalar(xs: Any, *vals: Any) -> Any:
        out = tree.leaves(f(xs, *vals))
        if len(out) != 1 or tuple(getattr(out[0], "shape", ())) != ():
            raise InvalidOutputError(
                "A Hessian needs f to return one scalar; got "
                + ", ".join(str(getattr(o, "shape", type(o).__name__)) for o in out)
                + "."
            )
        return out[0]

    def grad(xs: Any, *vals: Any) -> Any:
        return jax.grad(lambda z: scalar(z, *vals))(xs)

    try:
        jac = _jacobian(grad, x, values, notes)
    except UnsupportedOperationError:
        # jax could trace f but not its gradient (a while loop with a traced bound): every pair
        # of inputs f depends on may interact.
        notes.clear()  # (those of the gradient's program, given up)
        first = _jacobian(scalar, x, values, notes)
        used = first.toarray().reshape(-1) if first.shape[0] else np.zeros(first.shape[1], dtype=bool)
        import scipy.sparse as sp

        support = sp.csr_array(used[:, None])
        return as_pattern(support @ support.T)
    return as_pattern(jac + jac.T)


# --- the interpreter -------------------------------------------------------------------------------


class _Interpreter:
    """Runs a jaxpr on patterns (and on values where they are known)."""

    def __init__(self, n: int, notes: list[str] | None = None) -> None:
        self.n = n
        self.notes = [] if notes is None else notes
        """The operations taken as dense (where a rule of its own could not tell, too)."""

    def run_closed(self, closed: Any, patterns: list[Pattern], values: list[Any]) -> tuple[list[Pattern], list[Any]]:
        return self.run(closed.jaxpr, list(closed.consts), patterns, values)

    def run(
        self, jaxpr: Any, consts: list[Any], patterns: list[Pattern], values: list[Any]
    ) -> tuple[list[Pattern], list[Any]]:
        pattern_of: dict[Any, Pattern] = {}
        value_of: dict[Any, Any] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            pattern_of[v] = None
            value_of[v] = c
        for v, p, val in zip(jaxpr.invars, patterns, values, strict=True):
            pattern_of[v] = p
            value_of[v] = val

        def read(v: Any) -> tuple[Pattern, Any]:
            if type(v).__name__ == "Literal":
                return None, v.val
            return pattern_of.get(v), value_of.get(v)

        for eqn in jaxpr.eqns:
            read_in = [read(v) for v in eqn.invars]
            ps = [p for p, _ in read_in]
            vs = [val for _, val in read_in]
            outs = eqn.outvars
            out_values: list[Any] = [None] * len(outs)
            if all(p is None for p in ps):
                out_patterns: list[Pattern] = [None] * len(outs)
                if all(val is not None for val in vs) and not eqn.effects:
                    out_values = _evaluate(eqn, vs)
            else:
                rule = _RULES.get(eqn.primitive.name)
                if rule is None:
                    if any(_is_float(v.aval) for v in outs):  # (a comparison's booleans carry nothing)
                        self.notes.append(f"{eqn.primitive.name} is not known to the jax detector: dense")
                    out_patterns = self.conservative(eqn, ps)
                else:
                    try:
                        result = rule(self, eqn, ps, vs)
                        if isinstance(result, tuple):  # patterns and the values the rule followed
                            out_patterns, out_values = result
                        else:
                            out_patterns = result
                    except Exception:  # _Unknown, or a form the rule does not know: never a wrong pattern
                        self.notes.append(
                            f"{eqn.primitive.name}: its rule cannot tell here (an index not known): dense"
                        )
                        out_patterns = self.conservative(eqn, ps)
                        out_values = [None] * len(outs)
            for v, p, val in zip(outs, out_patterns, out_values, strict=True):
                if type(v).__name__ == "DropVar":
                    continue
                if p is not None and (not _is_float(v.aval) or p.nnz == 0):
                    p = None  # integers and booleans carry no derivative
                if p is not None and p.shape[0] != _size(v.aval):
                    raise AssertionError(f"internal error: {eqn.primitive.name} gave {p.shape[0]} rows for {v.aval}")
                pattern_of[v] = p
                value_of[v] = val
        results = [read(v) for v in jaxpr.outvars]
        return [p for p, _ in results], [val for _, val in results]

    def conservative(self, eqn: Any, ps: Sequence[Pattern]) -> list[Pattern]:
        row = sets.everything(ps)
        return [sets.all_of(row, _size(v.aval)) for v in eqn.outvars]


class _Unknown(Exception):
    """A rule cannot tell (an index not known when tracing): the operation is made conservative."""


def _evaluate(eqn: Any, values: list[Any]) -> list[Any]:
    """The outputs of ``eqn`` on known values, or Nones where jax cannot compute them."""
    try:
        fun, order = _eqn_function(eqn)
        args = [values[i] for i in order]
        return list(fun(*args))
    except Exception:
        return [None] * len(eqn.outvars)


def _eqn_function(eqn: Any) -> tuple[Callable[..., Any], list[int]]:
    """``eqn`` as a function of its variable operands (each once, at the operand indices given),
    bound as jax's own evaluator binds it."""
    literals = {i: v.val for i, v in enumerate(eqn.invars) if type(v).__name__ == "Literal"}
    first: dict[Any, int] = {}
    for i, v in enumerate(eqn.invars):
        if i not in literals and v not in first:
            first[v] = i
    order = list(first.values())
    params = eqn.primitive.get_bind_params(eqn.params)

    def fun(*args: Any) -> list[Any]:
        given = dict(zip(order, args, strict=True))
        operands = [literals[i] if i in literals else given[first[v]] for i, v in enumerate(eqn.invars)]
        out = eqn.primitive.bind(*operands, **params)
        return list(out) if eqn.primitive.multiple_results else [out]

    return fun, order


# --- rules -------------------------------------------------------------------------------------------

Rule = Callable[[_Interpreter, Any, list[Pattern], list[Any]], list[Pattern]]
_RULES: dict[str, Rule] = {}


def _rule(*names: str) -> Callable[[Rule], Rule]:
    def register(rule: Rule) -> Rule:
        for name in names:
            _RULES[name] = rule
        return rule

    return register


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


_ELEMENTWISE = [
    "add_any", "complex", "abs", "acos", "acosh", "add", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma", "div", "erf", "erf_inv",
    "erfc", "exp", "exp2", "expm1", "floor", "igamma", "igammac", "imag", "integer_pow", "is_finite", "lgamma",
    "log", "log1p", "logistic", "max", "min", "mul", "ne", "neg", "nextafter", "polygamma", "pow", "real",
    "reduce_precision", "rem", "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan",
    "tanh", "bessel_i0e", "bessel_i1e", "random_gamma_grad", "regularized_incomplete_beta", "zeta",
]  # fmt: skip


@_rule("optimization_barrier", "device_put", "sharding_constraint", "mesh_cast", "reshard", "pvary",
       "layout_constraint", "stop_gradient")  # fmt: skip
def _identity(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    return list(ps)


@_rule(*_ELEMENTWISE)
def _elementwise(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    operands = [(p, _shape(v)) for v, p in zip(eqn.invars, ps, strict=True)]
    return [sets.union(sets.elementwise(operands, _shape(out), it.n)) for out in eqn.outvars]


def _copy_rule(make: Callable[[Any, list[np.ndarray], list[Any]], Any]) -> Rule:
    """A rule for an operation that copies elements: ``make(eqn, positions, values)`` applies it
    to the operands' 1-based positions (a list of results for an operation of several)."""

    def rule(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
        sizes = [_size(v.aval) for v in eqn.invars]
        offsets = np.cumsum([0, *sizes[:-1]])
        positions = [sets.positions(_shape(v), int(o)) for v, o in zip(eqn.invars, offsets, strict=True)]
        made = make(eqn, positions, vs)
        return [sets.gather(ps, sizes, m, it.n) for m in (made if isinstance(made, list) else [made])]

    return rule


def _reshape(eqn: Any, pos: list[np.ndarray], vs: list[Any]) -> np.ndarray:
    p = pos[0]
    dims = eqn.params.get("dimensions")
    if dims is not None:
        p = p.transpose(dims)
    return p.reshape(_shape(eqn.outvars[0]))


def _broadcast_in_dim(eqn: Any, pos: list[np.ndarray], vs: list[Any]) -> np.ndarray:
    shape = tuple(eqn.params["shape"])
    dims = eqn.params["broadcast_dimensions"]
    expanded = [1] * len(shape)
    for d, size in zip(dims, pos[0].shape, strict=True):
        expanded[d] = size
    return np.broadcast_to(pos[0].reshape(expanded), shape)


def _slice(eqn: Any, pos: list[np.ndarray], vs: list[Any]) -> np.ndarray:
    strides = eqn.params.get("strides") or (1,) * pos[0].ndim
    index = tuple(
        slice(s, e, st)
        for s, e, st in zip(eqn.params["start_indices"], eqn.params["limit_indices"], strides, strict=True)
    )
    return pos[0][index]


def _pad(eqn: Any, pos: list[np.ndarray], vs: list[Any]) -> np.ndarray:
    operand = pos[0]
    fill = pos[1].reshape(())
    for axis, (lo, hi, interior) in enumerate(eqn.params["padding_config"]):
        lo, hi, interior = int(lo), int(hi), int(interior)
        d = operand.shape[axis]
        size = d + max(d - 1, 0) * interior
        shape = list(operand.shape)
        shape[axis] = size
        spread = np.full(shape, fill, dtype=np.int64)
        index: list[Any] = [slice(None)] * operand.ndim
        index[axis] = slice(0, size, interior + 1)
        spread[tuple(index)] = operand
        widths = [(0, 0)] * operand.ndim
        widths[axis] = (max(lo, 0), max(hi, 0))
        spread = np.pad(spread, widths, constant_values=fill)
        index = [slice(None)] * operand.ndim
        index[axis] = slice(max(-lo, 0), spread.shape[axis] - max(-hi, 0))
        operand = spread[tuple(index)]
    return operand


def _window(starts: Sequence[Any], sizes: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    """The slices of a dynamic slice's window: jax clamps the starts (known) so that it fits."""
    if any(s is None for s in starts):
        raise _Unknown
    known = [int(np.asarray(s)) for s in starts]
    clamped = [min(max(s, 0), d - size) for s, size, d in zip(known, sizes, shape, strict=True)]
    return tuple(slice(s, s + size) for s, size in zip(clamped, sizes, strict=True))


def _dynamic_slice(eqn: Any, pos: list[np.ndarray], vs: list[Any]) -> np.ndarray:
    operand = pos[0]
    return operand[_window(vs[1 : 1 + operand.ndim], eqn.params["slice_sizes"], operand.shape)]


def _dynamic_update_slice(eqn: Any, pos: list[np.ndarray], vs: list[Any]) -> np.ndarray:
    operand, update = pos[0], pos[1]
    result = operand.copy()
    result[_window(vs[2 : 2 + operand.ndim], update.shape, operand.shape)] = update
    return result


_RULES["reshape"] = _copy_rule(_reshape)
_RULES["squeeze"] = _copy_rule(lambda eqn, pos, vs: pos[0].reshape(_shape(eqn.outvars[0])))
_RULES["expand_dims"] = _RULES["squeeze"]
_RULES["broadcast_in_dim"] = _copy_rule(_broadcast_in_dim)
_RULES["transpose"] = _copy_rule(lambda eqn, pos, vs: pos[0].transpose(eqn.params["permutation"]))
_RULES["rev"] = _copy_rule(lambda eqn, pos, vs: np.flip(pos[0], tuple(eqn.params["dimensions"])))
_RULES["slice"] = _copy_rule(_slice)
_RULES["concatenate"] = _copy_rule(lambda eqn, pos, vs: np.concatenate(pos, axis=eqn.params["dimension"]))
_RULES["pad"] = _copy_rule(_pad)
_RULES["tile"] = _copy_rule(lambda eqn, pos, vs: np.tile(pos[0], eqn.params["reps"]))
_RULES["stack"] = _copy_rule(lambda eqn, pos, vs: np.stack(pos, axis=eqn.params["axis"]))
_RULES["dynamic_slice"] = _copy_rule(_dynamic_slice)
_RULES["dynamic_update_slice"] = _copy_rule(_dynamic_update_slice)
_RULES["unstack"] = _copy_rule(lambda eqn, pos, vs: list(np.moveaxis(pos[0], eqn.params["axis"], 0)))
_RULES["split"] = _copy_rule(
    lambda eqn, pos, vs: np.split(pos[0], np.cumsum(eqn.params["sizes"])[:-1], axis=eqn.params["axis"])
)


@_rule("zeros_like")
def _zeros(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    return [None for _ in eqn.outvars]


def _window_sources(
    eqn: Any, indices: Any, element_shape: tuple[int, ...], names: str
) -> tuple[np.ndarray, np.ndarray]:
    """(element, operand flat index) pairs for a gather's outputs or a scatter's updates (the
    elements, of ``element_shape``), ``indices`` known; ``names``, of its dimension numbers'
    fields: ``index_map``, ``offset_dims``, ``skipped``, the indices' batching dimensions.

    Element ``e`` reads (writes) the operand at ``start + offset``: ``start`` from the index
    vector of its coordinates off ``offset_dims`` (placed on the operand dimensions ``index_map``;
    on a batching dimension, its own batch coordinate), ``offset`` its coordinates on
    ``offset_dims`` (placed on the operand dimensions neither ``skipped`` nor batching, whose
    window sizes they span). jax clamps the start so that the window fits (clip), or fills and
    drops (fill or drop), or assumes it fits: both the clamped position and the unclamped one
    where it is in bounds are kept, which covers every mode.
    """
    if indices is None:
        raise _Unknown
    dn, indices, operand_shape = eqn.params["dimension_numbers"], np.asarray(indices), _shape(eqn.invars[0])
    index_map, offset_dims, skipped, indices_batching = (getattr(dn, name, ()) for name in names.split())
    operand_batching = getattr(dn, "operand_batching_dims", ())
    rank = len(operand_shape)
    count = sets.size(element_shape)
    coords = np.indices(element_shape).reshape(len(element_shape), count)
    batch = [coords[d] for d in range(len(element_shape)) if d not in offset_dims]
    vectors = indices[tuple(batch)] if batch else np.broadcast_to(indices, (count, indices.shape[-1]))
    vectors = vectors.reshape(count, -1).astype(np.int64)
    start = np.zeros((rank, count), dtype=np.int64)
    for j, d in enumerate(index_map):
        start[d] = vectors[:, j]
    for d, k in zip(operand_batching, indices_batching, strict=True):  # the element's own batch coordinate
        start[d] = batch[k]
    offset = np.zeros((rank, count), dtype=np.int64)
    sizes = np.ones((rank, 1), dtype=np.int64)
    window_dims = [d for d in range(rank) if d not in {*skipped, *operand_batching}]
    for d, o in zip(window_dims, offset_dims, strict=True):
        offset[d] = coords[o]
        sizes[d] = element_shape[o]
    dims = np.asarray(operand_shape, dtype=np.int64)[:, None]
    clipped = np.clip(start, 0, np.maximum(dims - sizes, 0)) + offset
    raw = start + offset
    inside = ((raw >= 0) & (raw < dims)).all(axis=0)
    elements = np.arange(count)
    if rank == 0:
        return elements, np.zeros(count, dtype=np.int64)
    flat_clipped = np.ravel_multi_index(tuple(np.minimum(clipped, dims - 1)), operand_shape)
    flat_raw = np.ravel_multi_index(tuple(raw[:, inside]), operand_shape)
    return np.concatenate([elements, elements[inside]]), np.concatenate([flat_clipped, flat_raw])


@_rule("gather")
def _gather(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    operand, out = eqn.invars[0], eqn.outvars[0]
    names = "start_index_map offset_dims collapsed_slice_dims start_indices_batching_dims"
    rows, cols = _window_sources(eqn, vs[1], _shape(out), names)
    return [sets.apply(sets.selection(rows, cols, (_size(out.aval), _size(operand.aval))), ps[0])]


@_rule("scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
       "scatter-max", "scatter_max", "scatter-sub", "scatter_sub")  # fmt: skip
def _scatter(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    """operand, indices, updates: each output unites its operand element and the updates sent to
    it (also where an update overwrites, or multiplies: conservative)."""
    operand, _, updates = eqn.invars[:3]
    if vs[1] is None:
        raise _Unknown
    pieces = [ps[0]]
    if ps[2] is not None and _size(updates.aval):
        names = "scatter_dims_to_operand_dims update_window_dims inserted_window_dims scatter_indices_batching_dims"
        cols, rows = _window_sources(eqn, vs[1], _shape(updates), names)
        pieces.append(sets.apply(sets.selection(rows, cols, (_size(operand.aval), _size(updates.aval))), ps[2]))
    return [sets.union(pieces)]


@_rule("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "reduce_and", "reduce_or")
def _reduce(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    return [sets.apply(sets.reduction_matrix(_shape(eqn.invars[0]), tuple(eqn.params["axes"])), ps[0])]


@_rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    return [sets.along(ps[0], _shape(eqn.invars[0]), eqn.params["axis"], False, eqn.params.get("reverse", False))]


@_rule("sort", "top_k")
def _sort(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    """Each output unites the whole line (along the sorted axis) of every operand."""
    shape = _shape(eqn.invars[0])
    axis = eqn.params.get("dimension", eqn.params.get("axis", len(shape) - 1))  # (top_k's is "axis")
    axis = axis % len(shape) if shape else 0
    matrix = sets.reduction_matrix(shape, (axis,))
    line = sets.union([sets.apply(matrix, p) for p in ps])
    kept = ([1 if a == axis else d for a, d in enumerate(_shape(out))] for out in eqn.outvars)
    return [sets.broadcast(line, k, _shape(out), it.n) for k, out in zip(kept, eqn.outvars, strict=True)]


@_rule("dot_general")
def _dot_general(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    """A batched matmul of lhs (batch, free, contracted) by rhs (batch, contracted, free), each
    operand's rows (and a known operand's zeros) taken in that order of its axes."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    lf = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rf = [d for d in range(len(rs)) if d not in rc and d not in rb]
    batch, left, inner, right = (
        sets.size([s[d] for d in dims]) for s, dims in ((ls, lb), (ls, lf), (ls, lc), (rs, rf))
    )

    def arranged(k: int, order: list[int], shaped: tuple[int, int, int]) -> tuple[Any, Any, tuple[int, int, int]]:
        shape = _shape(eqn.invars[k])
        rows = sets.gather([ps[k]], [sets.size(shape)], sets.positions(shape).transpose(order), it.n)
        known = None if vs[k] is None or ps[k] is not None else (np.asarray(vs[k]) != 0).transpose(order)
        return rows, known, shaped

    lhs = arranged(0, [*lb, *lf, *lc], (batch, left, inner))
    rhs = arranged(1, [*rb, *rc, *rf], (batch, inner, right))
    return [sets.matmul(lhs, rhs, it.n, None)]


@_rule("conv_general_dilated")
def _conv(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    """out[n, o, s] unites lhs[n, i, source(t, s)] over the taps ``t`` and input channels ``i``
    of o's group where the kernel may be nonzero, and rhs[o, i, t] where that lhs element may be
    nonzero (:func:`sets.convolution`); ``source(t, s)`` from the strides, padding and dilations."""
    params = eqn.params
    if params["batch_group_count"] != 1:
        raise _Unknown
    specs = params["dimension_numbers"]
    # every array in canonical layout (batch/out, feature/in, spatial...), holding its flat index
    lhs_at, rhs_at, out_at = (
        (sets.positions(_shape(v)) - 1).transpose(spec)
        for v, spec in zip([*eqn.invars, *eqn.outvars], specs, strict=True)
    )
    lhs, rhs = (
        (pattern, None if value is None or pattern is not None else (np.asarray(value) != 0).transpose(spec), at)
        for pattern, value, spec, at in zip(ps, vs, specs[:2], (lhs_at, rhs_at), strict=True)
    )  # (a known operand's nonzeros; None: anywhere)
    source = _window_taps(lhs_at.shape[2:], rhs_at.shape[2:], out_at.shape[2:], params, "lhs_dilation", "rhs_dilation")
    return [sets.convolution(lhs, rhs, out_at, source, params["feature_group_count"])]


def _window_taps(space: Any, window: Any, out_space: Any, params: Any, base: str, dilation: str) -> np.ndarray:
    """:func:`sets.taps` of a jax window: the input dilated by ``params[base]``, then padded."""
    shift = [-int(lo) for lo, _ in params["padding"]]
    return sets.taps(space, window, out_space, params["window_strides"], shift, params[dilation], params[base])


@_rule("reduce_window_sum", "reduce_window_max", "reduce_window_min")
def _reduce_window(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    """Pooling: each output unites its window, found as a convolution's taps are (padding and
    dilation holes read nothing)."""
    shape, window = _shape(eqn.invars[0]), eqn.params["window_dimensions"]
    source = _window_taps(shape, window, _shape(eqn.outvars[0]), eqn.params, "base_dilation", "window_dilation")
    t, o = np.nonzero(source >= 0)
    matrix = sets.selection(o, source[t, o], (source.shape[1], _size(eqn.invars[0].aval)))
    return [sets.apply(matrix, ps[0])]


# control flow and calls ------------------------------------------------------------------------------


@_rule(
    "jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "custom_lin", "xla_call", "named_call"
)
def _call_rule(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if inner is None:
        raise _Unknown
    if hasattr(inner, "consts"):
        return it.run_closed(inner, list(ps), list(vs))[0]
    return it.run(inner, [], list(ps), list(vs))[0]


@_rule("custom_jvp_call")
def _custom_jvp(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    """The Jacobian of a function with a custom derivative is the one its rule gives: the rule's
    tangent outputs are read from jax.jvp's program, tangents in, primals depending on nothing."""
    jax = _jax()
    fun, order = _eqn_function(eqn)
    avals = [eqn.invars[i].aval for i in order]
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    floats = [i for i, a in enumerate(avals) if _is_float(a)]

    def tangents_out(*args: Any) -> Any:
        primals, tangents = args[: len(avals)], args[len(avals) :]
        full = [
            tangents[floats.index(i)] if i in floats else np.zeros(a.shape, jax.dtypes.float0)
            for i, a in enumerate(avals)
        ]
        return jax.jvp(lambda *p: fun(*p), tuple(primals), tuple(full))[1]

    closed = jax.make_jaxpr(tangents_out)(*structs, *[structs[i] for i in floats])  # (failing: conservative)
    patterns = [None] * len(avals) + [ps[order[i]] for i in floats]  # (primals depending on nothing)
    return it.run_closed(closed, patterns, [vs[i] for i in order] + [None] * len(floats))[0]


@_rule("custom_vjp_call", "custom_vjp_call_jaxpr")
def _custom_vjp(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> list[Pattern]:
    """The Jacobian of a function with a custom reverse rule is the one its rule gives: read from
    jax.vjp's program, run on cotangents that each depend on one output number (so each operand's
    cotangent tells which output numbers reach it: the transposed Jacobian)."""
    jax = _jax()
    fun, order = _eqn_function(eqn)
    avals = [eqn.invars[i].aval for i in order]
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    outs = [v.aval for v in eqn.outvars]
    float_outs = [k for k, a in enumerate(outs) if _is_float(a)]
    out_structs = [jax.ShapeDtypeStruct(outs[k].shape, outs[k].dtype) for k in float_outs]

    def cotangents_in(*args: Any) -> Any:
        primals, cts = args[: len(avals)], args[len(avals) :]
        _, pull = jax.vjp(fun, *primals)
        full = [np.zeros(a.shape, dtype=jax.dtypes.float0) for a in outs]
        for k, ct in zip(float_outs, cts, strict=True):
            full[k] = ct
        return pull(full)

    closed = jax.make_jaxpr(cotangents_in)(*structs, *out_structs)  # (failing: conservative)
    sizes = [_size(outs[k]) for k in float_outs]
    local = _Interpreter(sum(sizes), it.notes)
    patterns = [None] * len(avals) + sets.identity(sizes)
    transposed = local.run_closed(closed, patterns, [vs[i] for i in order] + [None] * len(sizes))[0]
    rows = sets.union([None if t is None else sets.apply(t.T, ps[order[k]]) for k, t in enumerate(transposed)])
    results: list[Pattern] = [None] * len(outs)
    start = 0
    for k, size in zip(float_outs, sizes, strict=True):
        results[k] = None if rows is None else rows[start : start + size]
        start += size
    return results


@_rule("cond")
def _cond(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> Any:
    branches = eqn.params["branches"]
    if vs[0] is not None:  # the branch is known (jax clamps the index)
        index = min(max(int(np.asarray(vs[0])), 0), len(branches) - 1)
        taken = it.run_closed(branches[index], list(ps[1:]), list(vs[1:]))
        return list(taken[0]), list(taken[1])
    results = [it.run_closed(b, list(ps[1:]), list(vs[1:]))[0] for b in branches]
    return [sets.union(list(outs)) for outs in zip(*results, strict=True)]


def _fixed_point(
    body: Callable[[list[Pattern]], list[Pattern]], carry: list[Pattern], sizes: list[int], everything: Pattern
) -> list[Pattern]:
    """The least patterns containing ``carry`` that ``body`` keeps; if they do not settle within
    the rounds allowed, each carried element depends on ``everything`` (what every operand of the
    loop depends on: a set the body cannot leave)."""
    for _ in range(MAX_FIXED_POINT_ROUNDS):
        new = [sets.union([c, b]) for c, b in zip(carry, body(carry), strict=True)]
        if all(_same(a, b) for a, b in zip(new, carry, strict=True)):
            return new
        carry = new
    return [sets.all_of(everything, size) for size in sizes]


def _same(a: Pattern, b: Pattern) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(a.nnz == b.nnz and (a != b).nnz == 0)


@_rule("while")
def _while(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> Any:
    """While the predicate is known (it reads only values followed: a counter from a constant
    start), the loop runs step by step, within the unrolling budget; from the first step where it
    is not, the carry is taken to its fixed point (the loop stops at that step or a later one)."""
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    body, cond = eqn.params["body_jaxpr"], eqn.params["cond_jaxpr"]
    consts_p, consts_v = list(ps[cn : cn + bn]), list(vs[cn : cn + bn])
    cond_p, cond_v = list(ps[:cn]), list(vs[:cn])
    carry, carry_v = list(ps[cn + bn :]), list(vs[cn + bn :])
    budget = UNROLL_LIMIT // max(len(body.jaxpr.eqns) + len(cond.jaxpr.eqns), 1)
    for _ in range(budget):
        go = it.run_closed(cond, cond_p + carry, cond_v + carry_v)[1][0]
        if go is None:
            break
        if not bool(np.asarray(go)):
            return carry, carry_v
        carry, carry_v = (list(r) for r in it.run_closed(body, consts_p + carry, consts_v + carry_v))
    everything = sets.everything(ps)
    sizes = [_size(v.aval) for v in eqn.invars[cn + bn :]]

    def step(c: list[Pattern]) -> list[Pattern]:
        return it.run_closed(body, consts_p + c, consts_v + [None] * len(c))[0]

    return _fixed_point(step, carry, sizes, everything)


@_rule("scan")
def _scan(it: _Interpreter, eqn: Any, ps: list[Pattern], vs: list[Any]) -> Any:
    """A short scan is run iteration by iteration (its carried values followed, so that a
    ``fori_loop``'s counter indexes exactly). A long one: every iteration is taken to see the union
    of the slices of ``xs`` (rows of element e of a slice: rows of element e of every slice), the
    carry is taken to its fixed point, and each slice of ``ys`` gets the union over iterations."""
    nc, nk, length, body = (eqn.params[k] for k in ("num_consts", "num_carry", "length", "jaxpr"))
    consts_p, consts_v = list(ps[:nc]), list(vs[:nc])
    carry, carry_v = list(ps[nc : nc + nk]), list(vs[nc : nc + nk])
    xs_vars, ys_vars = eqn.invars[nc + nk :], eqn.outvars[nk:]
    if length > 0 and length * max(len(body.jaxpr.eqns), 1) <= UNROLL_LIMIT:
        xs_p, xs_v = list(ps[nc + nk :]), list(vs[nc + nk :])
        xs_per = [_size(v.aval) // length for v in xs_vars]
        ys_p: list[list[Pattern]] = [[None] * length for _ in ys_vars]
        ys_v: list[list[Any]] = [[None] * length for _ in ys_vars]
        for t in range(length - 1, -1, -1) if eqn.params.get("reverse", False) else range(length):
            slice_p = [None if p is None else p[t * per : (t + 1) * per] for p, per in zip(xs_p, xs_per, strict=True)]
            slice_v = [None if v is None else np.asarray(v)[t] for v in xs_v]
            outs_p, outs_v = it.run_closed(body, consts_p + carry + slice_p, consts_v + carry_v + slice_v)
            carry, carry_v = list(outs_p[:nk]), list(outs_v[:nk])
            for j in range(len(ys_vars)):
                ys_p[j][t] = outs_p[nk + j]
                ys_v[j][t] = outs_v[nk + j]
        ys_patterns: list[Pattern] = []
        ys_values: list[Any] = []
        for v, pieces, values in zip(ys_vars, ys_p, ys_v, strict=True):
            per = _size(v.aval) // length
            ys_patterns.append(None if all(p is None for p in pieces) else sets.stack(pieces, [per] * length, it.n))
            ys_values.append(
                None if any(val is None for val in values) else np.stack([np.asarray(val) for val in values])
            )
        return carry + ys_patterns, carry_v + ys_values
    # element e of a slice: element e of every slice
    slices: list[Pattern] = [
        None
        if p is None or not length
        else sets.apply(sets.reduction_matrix((length, _size(v.aval) // length), [0]), p)
        for v, p in zip(xs_vars, ps[nc + nk :], strict=True)
    ]

    def step(c: list[Pattern]) -> list[Pattern]:
        return it.run_closed(body, consts_p + c + slices, consts_v + [None] * (len(c) + len(slices)))[0][:nk]

    carry = _fixed_point(step, carry, [_size(v.aval) for v in eqn.invars[nc : nc + nk]], sets.everything(ps))
    outs = it.run_closed(body, consts_p + carry + slices, consts_v + [None] * (len(carry) + len(slices)))[0]
    ys = [None if p is None or not length else p[np.tile(np.arange(p.shape[0]), length)] for p in outs[nk:]]
    return list(carry) + ys
