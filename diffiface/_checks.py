"""Validation of a call's arguments and of f's output: x, tangents and cotangents once, when a
prep is made; output leaves the first time each (type, dtype) is seen."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _arrays, _complex
from . import tree as _tree
from ._adapters import info
from ._adapters._base import Adapter, refuse_a_moved_output
from ._backends import Backend, SecondOrder
from ._call import _ARRAY_KINDS, _LEAF, OPERATORS, Call, Operator, _DynamicView, _Output
from ._errors import ArrayTypeError, InvalidInputError, InvalidOutputError, TangentMismatchError
from ._prep import Signature

# -- the call itself -----------------------------------------------------------------------------


def _check_call(op: Operator, f: Any, has_aux: bool) -> None:
    """f is callable, and has_aux is asked of an operator that takes it."""
    if not callable(f):
        tangent_name = {"x": ", tx", "y": ", ty"}.get(op.tangent or "", "")
        raise InvalidInputError(
            f"f must be a callable f(x, *contexts), got {type(f).__name__}. The argument order "
            f"is di.{op.name}(f, backend, x{tangent_name}, *contexts)."
        )
    if has_aux and not op.aux:
        raise _no_aux(op)


def _no_aux(op: Operator) -> InvalidInputError:
    with_aux = OPERATORS.get(f"value_and_{op.name}")  # (its value_and_ form, where that takes has_aux)
    if with_aux is not None and with_aux.aux:
        return InvalidInputError(
            f"{op.name} does not take has_aux=True; di.{with_aux.name}(..., has_aux=True) does, and returns "
            f"((value, aux), {op.name})."
        )
    return InvalidInputError(
        f"{op.name} does not take has_aux=True: only value_and_gradient, value_and_jvp, value_and_vjp and "
        "their batched forms do. Drop the aux inside f (lambda x, *c: f(x, *c)[0])."
    )


# -- validation of x and tangents --------------------------------------------------------------------


def _check_x(op: Operator, backend: Backend, any_array_type: bool, call: Call) -> None:
    sig = call.signature
    paths = [_tree.path_string(p) for p in sig.x_spec.paths()]
    kinds: set[_arrays.Kind] = set()
    for path, leaf in zip(paths, call.x_leaves, strict=True):
        kind = _arrays.kind(leaf)
        dtype = _arrays.dtype_name(leaf)
        if kind == "other" and isinstance(leaf, (dict, list, tuple)):
            base = next(b for b in (dict, list, tuple) if isinstance(leaf, b)).__name__
            raise InvalidInputError(
                f"x{path} is a {type(leaf).__name__}, a subclass of {base} that no pytree registry knows, so it "
                f"is one opaque leaf, not a container of what it holds. Pass a plain {base} ({base}(x)), or "
                f"register {type(leaf).__name__} as a pytree (jax.tree_util.register_pytree_node, or "
                "optree.register_pytree_node with namespace='diffiface')."
            )
        if kind == "other":  # (x holds nothing else to differentiate: else it would be static)
            raise InvalidInputError(
                f"x{path} is a {type(leaf).__name__} and x holds no float or float array to differentiate; "
                "diffiface differentiates floats and float arrays (numpy, torch, jax) in pytrees (dicts, "
                "lists, tuples, namedtuples, equinox modules...), passing their other leaves to f as they "
                "are. Pass other values as di.Constant(...)."
            )
        kinds.add(kind)
        refusal = _arrays.by_kind(kind).x_refusal(leaf)
        if refusal is not None:
            raise InvalidInputError(f"x{path} {refusal}")
        if not _arrays.is_float_dtype(dtype) and not _complex.is_complex_dtype(dtype):
            raise InvalidInputError(
                f"x{path} has dtype {dtype}; only floating-point and complex (complex64, complex128) inputs "
                "can be differentiated. Cast it to a float dtype, or pass it as a di.Constant if it is not "
                "differentiated (for a model, split its integer arrays off with "
                "eqx.partition(model, eqx.is_inexact_array) and pass them as a di.Constant)."
            )
        if dtype in ("float16", "bfloat16") and any_array_type:
            raise InvalidInputError(
                f"x{path} has dtype {dtype}: finite differences in {dtype} have no correct digits. "
                "Cast x to float32 or float64 for finite differences."
            )
    family = _arrays.family(kinds)
    for traced in sorted(kinds & _TRACED):
        if not _traced_by(backend, traced):
            # arrays an outer engine traces (its call differentiates through this one): only
            # that engine can carry its trace on; another engine would read plain numbers
            raise ArrayTypeError(
                f"x holds arrays traced by {traced} (its boxes): a {traced} computation is "
                f"differentiating through this call, which the {backend.name} backend cannot trace. "
                f"Use the {traced} backend for this inner call ({traced} nests in itself), or call it "
                f"outside the {traced} computation."
            )
    if family == "other":
        raise ArrayTypeError(
            f"x mixes arrays of several frameworks ({', '.join(sorted(kinds - {'python'}))}); use one "
            "framework for all leaves of x."
        )
    if not any_array_type and family not in _ANY_ENGINE and family != backend_family(backend):
        # (a backend of that family's name: an engine's variables that are not its inputs, a
        # PyTensor shared variable, which its backend takes as numpy arrays)
        engine = backend_family(backend)
        wanted = _NUMPY if engine == _NUMPY else f"{_NUMPY} or {engine}"
        elsewhere = "" if family == backend.name else f", or use the {family} backend"
        raise ArrayTypeError(
            f"x holds {family} arrays, but the {backend.name} backend differentiates "
            f"{engine} arrays. Pass {wanted} arrays{elsewhere}."
        )
    scalar = len(call.x_leaves) == 1 and _arrays.shape(call.x_leaves[0]) == () and sig.x_spec.num_nodes == 1
    if op.scalar_input and not scalar:
        shape = _arrays.shape(call.x_leaves[0]) if len(call.x_leaves) == 1 else f"{len(call.x_leaves)} leaves"
        raise InvalidInputError(
            f"{op.name} needs a scalar x (a float or a 0-d array), got {shape}. For an array "
            "x use jacobian, or jvp for one direction."
        )


_NUMPY = _arrays.kind_of_type(np.ndarray)
_PYTHON = _arrays.kind_of_type(float)
_TRACED = frozenset(family.NAME for family in _arrays.BY_KIND.values() if family.PASSED_THROUGH)
"""The families of values an enclosing engine's trace holds (autograd's boxes)."""
_PLAIN = frozenset({_PYTHON, _NUMPY})
"""The families every engine takes: Python numbers and numpy arrays."""
_ANY_ENGINE = _PLAIN | _TRACED
"""The families of x no engine refuses by its array type (a traced one is refused by name)."""


def _traced_by(backend: Backend, traced: str) -> bool:
    """True when the engine named as the family ``traced`` does all the work, so that the
    values its trace holds may come in (an engine carries its own trace on)."""
    if isinstance(backend, SecondOrder):
        return _traced_by(backend.outer, traced) and _traced_by(backend.inner, traced)
    return backend.name == traced


def backend_family(backend: Backend) -> str:
    """The arrays the engine differentiates, from the registry (numpy for the black boxes)."""
    arrays = info(backend).arrays
    return _NUMPY if arrays == "any" else arrays


def _check_tangent_kinds(op: Operator, backend: Backend, any_array_type: bool, call: Call) -> None:
    """A tangent's leaves are Python numbers, numpy arrays, or arrays of x's framework (of the
    backend's for an engine that takes one framework): never another framework's."""
    x_family = _arrays.family({_arrays.kind(leaf) for leaf in call.x_leaves})
    allowed: set[str] = {*_PLAIN, x_family}
    if not any_array_type:
        allowed.add(backend_family(backend))
    role = "tangent" if op.tangent == "x" else "cotangent"
    if role == "cotangent" and any_array_type:
        # an engine that runs f on any array type: f's output may be of another framework than
        # x (a float x, a torch f); the cotangent is checked against that output once f has
        # run (_check_cotangent)
        return
    for path, leaf in zip(call.signature.tangent_spec.paths(), call.tangent_leaves, strict=True):
        kind = _arrays.kind(leaf)
        if kind not in allowed:
            wanted = dict.fromkeys((_NUMPY, x_family if x_family != _PYTHON else backend_family(backend)))
            raise ArrayTypeError(
                f"The {role}{_tree.path_string(path)} of {op.name} is {kind} ({type(leaf).__name__}), but x holds "
                f"{x_family} arrays under the {backend.name} backend. Pass the {role} as "
                f"{' or '.join(wanted)} arrays."
            )


def _check_tangent_like_x(op: Operator, call: Call) -> None:
    """The tangent has x's structure, shapes and dtypes; so has each tangent of a batch, named
    by its place in the batch."""
    spec = call.signature.tangent_spec
    if not op.batch:
        _check_one_tangent(op.name, call, spec, call.tangent_leaves)
        return
    start = 0
    for k, one in enumerate(spec.children()):
        leaves = call.tangent_leaves[start : start + one.num_leaves]
        start += one.num_leaves
        try:
            _check_one_tangent(op.name.replace("batched_", ""), call, one, leaves)
        except TangentMismatchError as exc:
            raise TangentMismatchError(f"Tangent {k} of the batch: {exc}") from None


def _check_one_tangent(name: str, call: Call, spec: Any, leaves: list[Any]) -> None:
    x_spec = call.signature.x_spec
    if spec != x_spec:
        static = " (None at the leaves of x that are not differentiated)" if isinstance(call, _DynamicView) else ""
        raise TangentMismatchError(
            f"The tangent of {name} must have the structure of x{static}, {x_spec}; it has {spec}."
        )
    paths = [_tree.path_string(p) for p in x_spec.paths()]
    for path, x, t in zip(paths, call.x_leaves, leaves, strict=True):
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


def batch_sizes(sig: Signature) -> tuple[int, ...]:
    """The number of leaves of each tangent of a batch, in order."""
    return tuple(spec.num_leaves for spec in sig.tangent_spec.children())


def _check_cotangents(sig: Signature, output: _Output, groups: list[Any], complex_step: bool) -> list[Any]:
    """Each cotangent of a batch against f(x) (:func:`_check_cotangent`), named by its place;
    the cotangents as the engine takes them."""
    fitted = output.cotangent_fits
    if fitted is not None and fitted[1] == output.shapes and (fitted[0] is output.spec or fitted[0] == output.spec):
        return groups
    start = 0
    checked = []
    for k, (spec, ts) in enumerate(zip(sig.tangent_spec.children(), groups, strict=True)):
        one = sig._replace(tangent_spec=spec, tangent_leaves=sig.tangent_leaves[start : start + len(ts)])
        start += len(ts)
        output.cotangent_fits = None
        try:
            checked.append(_check_cotangent(one, output, ts, complex_step))
        except TangentMismatchError as exc:
            raise TangentMismatchError(f"Cotangent {k} of the batch: {exc}") from None
    if any(c is not g for c, g in zip(checked, groups, strict=True)):  # (a cast, on every call: see _check_cotangent)
        output.cotangent_fits = None
    return checked


# -- validation of f's output and of a cotangent against it ------------------------------------------


_OUTPUT_LEAF_KINDS = _ARRAY_KINDS | _TRACED  # the values an outer trace holds are leaves too


def _refuse_cut(
    f: Callable[..., Any],
    context_values: tuple[Any, ...],
    xs: tuple[Any, ...],
    adapter: Adapter,
    x_spec: Any,
    rebuild: Callable[[Any], Any],
    untracked: tuple[int, ...] | None = None,
) -> None:
    """f returned a value the engine does not trace back to x. If f's value changes when x
    does, f cut the trace (its derivative would read as zero): refused. Else f does not depend
    on x, and zero is its derivative. ``untracked``: the positions of the output leaves the
    engine does not trace, where the others are traced (only they must not change; None: all)."""
    plain = [adapter.plain(leaf) for leaf in xs]

    def at(leaves: Sequence[Any]) -> list[Any]:
        """The output leaves the engine does not trace, of f at x's ``leaves``."""
        out = _tree.leaves(f(leaves[0] if x_spec == _LEAF else rebuild(leaves), *context_values))
        return out if untracked is None or len(out) <= max(untracked, default=-1) else [out[i] for i in untracked]

    def value(move: float) -> list[np.ndarray]:
        # (through tolist: a torch.func tensor has no storage for numpy to read)
        return [
            _arrays.by_kind(_arrays.kind(leaf)).values(leaf)
            for leaf in at([leaf + move * (1 + abs(leaf)) for leaf in plain] if move else plain)
        ]

    adapter.refuse_a_read_of_x(at, tuple(plain), tuple(_tree.leaves(context_values)))
    if adapter.cuts_unseen:
        refuse_a_moved_output(value, max(map(_arrays.resolution, plain), default=0.0), adapter.backend.name)


def _checked(op: Operator, result: Any, output: _Output, adapter: Adapter) -> list[Any]:
    """The leaves of ``f``'s output, recorded and checked: numeric, and one scalar for the
    operators of scalar functions."""
    if result is None:
        raise InvalidOutputError(
            f"f returned None where {op.name} needs floating-point numbers (float arrays or floats). "
            "Return the value from f (a missing return statement?)."
        )
    for traced in _TRACED:  # (their traced containers opened, as any other engine's output)
        result = _arrays.by_kind(traced).opened(result)
    if _arrays.kind(result) in _OUTPUT_LEAF_KINDS:
        leaves, spec = [result], _LEAF
    else:
        leaves, spec = _tree.flatten(result)
    values = adapter.output_values
    seen = leaves if values is None else [values(leaf) for leaf in leaves]
    output.record(spec, seen)
    checked = output.checked
    try:
        for leaf in seen:
            key = (type(leaf), getattr(leaf, "dtype", None))
            if key not in checked:
                if not adapter.complex_outputs:  # (a complex step's outputs are complex)
                    _complex.check_complex_output(op, leaf, adapter)
                _check_numeric(op, leaf)
                _check_output_kind(leaf, adapter)
                checked.add(key)
        if op.scalar_output and (len(seen) != 1 or _arrays.shape(seen[0]) != ()):
            raise InvalidOutputError(
                f"{op.name} needs f to return a scalar, but it returned {_describe(result)}. Reduce the "
                "output (say with .sum()), or use jacobian / vjp for a non-scalar output."
            )
    except InvalidOutputError as exc:
        if type(result) is tuple and len(result) == 2:  # (a (value, aux) pair, has_aux not asked)
            hint = f", pass has_aux=True to di.{op.name}." if op.aux else f": {_no_aux(op)}"
            raise InvalidOutputError(f"{exc} If f returns (value, aux){hint}") from None
        raise
    return leaves


def _check_output_kind(leaf: Any, adapter: Adapter) -> None:
    """An engine that runs f on its own arrays gets its own arrays back, numpy arrays or Python
    numbers: another framework's array is no value the engine can differentiate (autograd and
    jax raised their own TypeError on it, mlx its ValueError)."""
    arrays = adapter.info.arrays
    kind = _arrays.kind(leaf)
    if arrays == "any" or kind in _ANY_ENGINE or kind in (arrays, adapter.backend.name, "other"):
        return
    name = adapter.backend.name
    own = _NUMPY if arrays == _NUMPY else f"{arrays} or {_NUMPY}"
    raise InvalidOutputError(
        f"f returned a {kind} array ({type(leaf).__name__}) under the {name} backend, which differentiates "
        f"{own} arrays: a value of another framework is cut from {name}'s trace. Write f with the {name} "
        "backend's arrays, or differentiate it with di.AutoFiniteDifferences(), which calls f on any array type."
    )


def _describe(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)} and dtype {_arrays.dtype_name(value)}"
    leaves = _tree.leaves(value)
    if len(leaves) != 1 or leaves[0] is not value:
        return f"a {type(value).__name__} with {len(leaves)} leaves"
    return f"a {type(value).__name__}"


def _check_numeric(op: Operator, leaf: Any) -> None:
    kind = _arrays.kind(leaf)
    while kind in _TRACED:  # a traced array: the value it traces decides
        leaf = _arrays.by_kind(kind).traced(leaf)
        kind = _arrays.kind(leaf)
    # (a Python int or bool is no float: it has no derivative, whatever an engine would make of it)
    if kind == "python" and isinstance(leaf, (float, complex)):
        return
    dtype = _arrays.dtype_name(leaf)
    if kind in ("other", "python") or not (_arrays.is_float_dtype(dtype) or "complex" in dtype):
        name = type(leaf).__name__
        what = f"a{'n' * (name[0] in 'aeiou')} {name}" if kind in ("other", "python") else f"an array of dtype {dtype}"
        raise InvalidOutputError(
            f"f returned {what} where {op.name} needs floating-point numbers (float arrays or "
            "floats). Compute the output in floating point."
        )


def _check_cotangent(sig: Signature, output: _Output, ts: tuple[Any, ...], complex_step: bool) -> tuple[Any, ...]:
    """The cotangent against f(x), whose structure and shapes the last evaluation recorded:
    ``ts`` as the engine takes it (a real cotangent of a complex output cast to complex); an
    output structure and shapes it fitted before need no second look."""
    out_spec, out_shapes, out_dtypes = output.current()  # (one read: this runs on every call)
    fitted = output.cotangent_fits
    if fitted is not None and fitted[1] == out_shapes and (fitted[0] is out_spec or fitted[0] == out_spec):
        return ts
    if out_spec != sig.tangent_spec:
        raise TangentMismatchError(
            f"The cotangent must have the structure of f(x), {out_spec}; it has {sig.tangent_spec}."
        )
    # (the array types of f's output leaves, from those validated; none yet: nothing to compare)
    out_kinds = {_arrays.kind_of_type(cls) for cls, _ in output.checked}
    allowed = _PLAIN | out_kinds
    for i, t in enumerate(sig.tangent_leaves):
        if out_kinds and t[0] not in allowed:
            frameworks = " or ".join(sorted(out_kinds - _PLAIN - {"other"}))
            fix = f"{_NUMPY} or {frameworks} arrays" if frameworks else f"{_NUMPY} arrays or floats"
            raise ArrayTypeError(
                f"Cotangent leaf {i} is a {t[0]} array, but f(x) holds {frameworks or _NUMPY} arrays. Pass "
                f"the cotangent as {fix}, as f(x)."
            )
    for i, (shape, t) in enumerate(zip(out_shapes, ts, strict=True)):
        if shape != _arrays.shape(t):
            raise TangentMismatchError(
                f"Cotangent leaf {i} has shape {_arrays.shape(t)}, but f(x)'s leaf {i} has shape "
                f"{shape}; a cotangent has the shape of f(x)."
            )
    widen: list[tuple[int, str]] = []
    for i, (dtype, t) in enumerate(zip(out_dtypes, sig.tangent_leaves, strict=False)):
        if dtype is None:
            continue
        # a real cotangent of a complex output leaf (a float, or a real array of its precision)
        # is the complex cotangent with no imaginary part: the engines that take only the complex
        # one (jax, torch) get it cast. Where the output is complex only because the complex step
        # evaluates f at complex points, the real cotangent is the right one, as it is.
        if t[0] == "python":  # (a Python number is taken as any float or complex dtype: cast to f(x)'s)
            value_dtype = "complex128" if issubclass(t[1], complex) else "float64"
            fits = _complex.is_complex_dtype(dtype) or (
                value_dtype == "float64" and dtype.startswith(("float", "bfloat"))
            )
            if not fits:  # (a complex number for a real output: its imaginary part has no meaning)
                raise TangentMismatchError(
                    f"Cotangent leaf {i} is a Python complex number, but f(x)'s leaf {i} has dtype {dtype}; the "
                    "cotangent of a real output is real. Pass a float."
                )
            if dtype != value_dtype and not complex_step:
                widen.append((i, dtype))
            continue
        found = str(t[2]).rpartition(".")[2]  # ("torch.float32", "mlx.core.float32": the name alone)
        if found == dtype:
            continue
        if not _complex.cotangent_fits(found, dtype):
            raise TangentMismatchError(
                f"Cotangent leaf {i} has dtype {found}, but f(x)'s leaf {i} has dtype {dtype}; cast the "
                f"cotangent to {dtype}."
            )
        if not complex_step:
            widen.append((i, dtype))
    if not widen:  # (a cast is taken on every call: only a cotangent that needs none is remembered)
        output.cotangent_fits = (out_spec, out_shapes)
        return ts
    cast = list(ts)
    for i, dtype in widen:
        cast[i] = _complex.as_complex(cast[i], dtype)
    return tuple(cast)
