"""Complex numbers, with one convention on every engine: torch's, stated in docs/complex.md.

Each engine's registry row declares its ``complex_convention``: ``"direct"`` (torch: the
convention already), ``"conjugate"`` (jax, autograd: the gradient is its conjugate, the vjp
``conj(vjp(conj(ybar)))``) or ``"split"`` (real engines: each complex leaf is two real ones).
:func:`adapter_for_call` wraps an adapter in :class:`ComplexAdapter` for the calls that need
it. Jacobians, derivatives and Hessian-vector products are computed on the split function on
every engine, so that no mode of any engine needs its own conversion.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from . import _arrays, _families
from ._adapters._base import Deferred
from ._errors import InvalidBackendOptionError, InvalidOutputError, UnsupportedOperationError

if TYPE_CHECKING:
    from ._adapters._base import Adapter
    from ._call import Call, Operator

Leaves = tuple[Any, ...]

_REAL_OF = {"complex64": "float32", "complex128": "float64"}
_JACOBIAN_FAMILY = frozenset({"value_and_jacobian", "value_and_derivative"})


# -- dtypes -----------------------------------------------------------------------------------------


def is_complex_dtype(name: str) -> bool:
    return name in _REAL_OF


def is_complex(leaf: Any) -> bool:
    """Whether a leaf (an array of any framework, a traced one, or a Python number) is complex."""
    return _arrays.dtype_name(leaf) in _REAL_OF


def cotangent_fits(found: str, expected: str) -> bool:
    """A real cotangent of an output leaf that is complex only because the complex step
    evaluates f at complex points, of its precision."""
    return _REAL_OF.get(expected) == found


# -- checks: what is refused, and where ---------------------------------------------------------------


def check_complex_output(op: Operator, leaf: Any, adapter: Any) -> None:
    """f may return this leaf complex, but not where the operator needs a real scalar (refused,
    with what to use instead), nor where the call runs on the engine directly because f's
    outputs were real when it was first made (:class:`ComplexAdapter`)."""
    if isinstance(adapter, ComplexAdapter) and adapter.real_outputs and is_complex(leaf):
        raise InvalidOutputError(
            f"f returned a complex value (dtype {_arrays.dtype_name(leaf)}) where it returned real ones "
            f"when this {op.name} was first run with x of these dtypes. Make f's output dtype depend on x's "
            "dtype alone (say, cast to complex always), or call without this prep."
        )
    if op.scalar_output and is_complex(leaf):
        raise InvalidOutputError(
            f"f returned a complex value (dtype {_arrays.dtype_name(leaf)}) where {op.name} needs a real "
            "scalar: a complex-valued function has no gradient. Use jvp (the directional derivative) or "
            "vjp (its adjoint under Re<a, b>), or differentiate a real loss of it (abs(y)**2, y.real)."
        )


def refuse_sparse(call: Call) -> None:
    """AutoSparse compresses Jacobian columns along real seeds; complex x is not taken."""
    if any(is_complex(leaf) for leaf in call.x_leaves):
        raise UnsupportedOperationError(
            "AutoSparse does not take a complex x: its compressed columns are real directions, which give "
            "the derivative along the real axis only, and the holomorphy of f would go unchecked. Use the "
            "wrapped backend itself (dense), or split x into its real and imaginary parts."
        )


SECOND_DERIVATIVE_ADVICE = (
    "di.derivative(lambda z: di.derivative(f, backend, z, holomorphic=True), backend, x, holomorphic=True)"
)
SECOND_JVP_ADVICE = "di.jvp(lambda z: di.jvp(f, backend, z, t), backend, x, t)"


def adapter_for_call(op: Operator, adapter: Adapter, call: Call, f: Any) -> Adapter:
    """The adapter a prepared call runs on: ``adapter`` itself where nothing is complex, else
    the :class:`ComplexAdapter` around it. Refuses what has no meaning for complex ``x``."""
    x_complex = any(is_complex(leaf) for leaf in call.x_leaves)
    t_complex = any(is_complex(leaf) for leaf in call.tangent_leaves)
    if adapter.complex_outputs:  # the complex step evaluates f at complex points of a real x
        if x_complex or t_complex:
            raise InvalidBackendOptionError(
                f"{type(adapter.backend).__name__}(method='complex') cannot differentiate complex "
                f"{'x' if x_complex else 'tangents'}: the complex step takes the imaginary axis for its "
                "step, which a complex x already uses. Use central differences "
                "(AutoFiniteDifferences(method='central'), the default)."
            )
        return adapter
    if x_complex and op.compute == "value_gradient_and_hessian":
        raise UnsupportedOperationError(
            f"{op.name} of a function of complex x: its second derivative is a real-linear map "
            "v -> H v, which no complex matrix represents in general. Use hvp (the jvp of the "
            "gradient map, v -> d/dh grad f(x + h v)), or split x into its real and imaginary parts "
            "for the real Hessian."
        )
    if x_complex and op.compute == "value_derivative_and_second_derivative":
        # (the advice runs on every engine: a derivative inside a derivative must not read
        # traced values, as the holomorphy check does, so holomorphy is asserted there)
        raise UnsupportedOperationError(
            f"{op.name} of a function of complex x is not computed. For a holomorphic f, take the "
            "derivative of the derivative with holomorphy asserted, "
            f"{SECOND_DERIVATIVE_ADVICE}, after checking it once: di.derivative(f, backend, x) refuses an f "
            "that is not holomorphic. For any f, the second directional derivative along t is "
            f"{SECOND_JVP_ADVICE} (under torch, with AutoTorch(mode='func'))."
        )
    refused = adapter.info.complex_second_order
    if refused and (x_complex or t_complex) and op.compute in ("gradient_and_hvp", "gradient_and_hvps"):
        raise UnsupportedOperationError(
            f"The {adapter.backend.name} backend does not take second derivatives of complex numbers: "
            f"{refused}. Use AutoJAX() or AutoTorch() for an hvp of a function of complex x."
        )
    if not (x_complex or t_complex or _may_return_complex(op, adapter)):
        return adapter
    return cast("Adapter", ComplexAdapter(adapter, op, isinstance(f, Holomorphic), x_complex, t_complex))


def _may_return_complex(op: Operator, adapter: Adapter) -> bool:
    """Whether a call on real x and tangents needs the :class:`ComplexAdapter` in case f returns
    complex values: for Jacobians and derivatives (real units would miss the imaginary parts)
    and on engines that see real numbers only; not for an engine's own jvp and vjp, which are
    the convention for real x."""
    if op.scalar_output:
        return False
    return (
        op.compute in _JACOBIAN_FAMILY
        or op.compute == "value_derivative_and_second_derivative"
        or adapter.info.complex_convention == "split"  # (a SecondOrder pair's info is its inner engine's)
    )


# -- holomorphy, asserted by the caller -------------------------------------------------------------


class Holomorphic:
    """``f``, asserted holomorphic by the caller (``holomorphic=True``): its Jacobian is taken
    along the real axis only, ``df/dz = df/dRe z``, unchecked. It holds ``f`` weakly, as preps
    do: the table of :func:`holomorphic` keeps it while ``f`` lives, and not after."""

    __slots__ = ("__weakref__", "_f")

    def __init__(self, f: Callable[..., Any]) -> None:
        try:
            self._f: Callable[[], Any] = weakref.ref(f, functools.partial(_forget, id(f)))
        except TypeError:  # no weak references (a builtin): kept, as builtins live long
            self._f = lambda: f

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._f()(*args, **kwargs)


_HOLOMORPHIC: dict[int, Holomorphic] = {}
_HOLOMORPHIC_LOCK = threading.Lock()


def holomorphic(f: Callable[..., Any]) -> Holomorphic:
    """The one :class:`Holomorphic` of ``f`` (the same object each time, so that preps and the
    prep cache know it again); dropped when ``f`` is collected."""
    if isinstance(f, Holomorphic):
        return f
    key = id(f)
    with _HOLOMORPHIC_LOCK:
        found = _HOLOMORPHIC.get(key)
        if found is not None and found._f() is f:
            return found
        marked = _HOLOMORPHIC[key] = Holomorphic(f)
        return marked


def _forget(key: int, _: Any) -> None:
    table = _HOLOMORPHIC  # (None while the interpreter shuts down)
    if table is not None:
        table.pop(key, None)


def _tolerance(dtype: str, exact: bool) -> float:
    """How far from holomorphic (|B| against |A| + |B|, B = df/dconj z) a Jacobian in this
    precision may be: eps ** (1/2) for an exact engine (B is rounding), eps ** (1/4) for
    differences (truncation error about eps ** (2/3))."""
    eps = float(np.finfo(np.float32 if dtype in ("float32", "complex64") else np.float64).eps)
    return float(eps**0.5 if exact else eps**0.25)


# -- conversions --------------------------------------------------------------------------------------


def _conjugated(values: Leaves) -> Leaves:
    """A ``"conjugate"`` engine's gradient or vjp leaves in the convention, or a cotangent's as
    the engine takes it: each complex leaf conjugated. ``jvp`` needs nothing: every engine agrees
    on it."""
    return tuple((_arrays.family_of(v) or _families.HOST).conj(v) if is_complex(v) else v for v in values)


def as_complex(leaf: Any, dtype: str) -> Any:
    """A real cotangent leaf as the complex one of ``dtype`` it means (imaginary part zero), or a
    Python number as the float of ``dtype``, cast by its family where it has one (pytensor's
    symbolic cotangent refuses to become a numpy array)."""
    family = _arrays.family_of(leaf)
    if family is not None and _arrays.kind(leaf) != "python":
        return family.cast(leaf, dtype)
    return np.asarray(leaf, dtype=dtype)


def _parts(leaf: Any) -> tuple[Any, Any]:
    """The real and imaginary parts of a complex leaf, as new arrays of its framework (never
    views of the caller's memory: a black-box engine may perturb them in place)."""
    family = _arrays.family_of(leaf) or _families.HOST
    return family.parts(leaf)  # type: ignore[no-any-return]


def from_parts(re: Any, im: Any) -> Any:
    """``re + i im``, in the complex dtype of their precision, differentiable by their engine
    (the family of ``re``, or of ``im`` where ``re`` is a number or a traced value)."""
    family = _arrays.family_of(re)
    if family is None or not family.ARRAY:
        family = _arrays.family_of(im) or family
    return re + 1j * im if family is None else family.from_parts(re, im)


class _Split:
    """Which leaves of a tuple are complex, each seen as two real leaves (real, imaginary)."""

    __slots__ = ("flags",)

    def __init__(self, leaves: Leaves) -> None:
        self.flags = tuple(is_complex(leaf) for leaf in leaves)

    @property
    def any(self) -> bool:
        return any(self.flags)

    def split(self, leaves: Leaves) -> Leaves:
        return tuple(
            part for leaf, flag in zip(leaves, self.flags, strict=True) for part in (_parts(leaf) if flag else (leaf,))
        )

    def join(self, leaves: Leaves) -> Leaves:
        it = iter(leaves)
        return tuple(from_parts(next(it), next(it)) if flag else next(it) for flag in self.flags)

    def join_gradient(self, grads: Any) -> Any:
        """:meth:`join` of a gradient, which a black-box outer engine may defer."""
        if isinstance(grads, Deferred):
            return Deferred(lambda: self.join(tuple(grads.force())))
        return self.join(tuple(grads))


class _Realified:
    """``fn`` on real leaves with real outputs: each complex leaf of x and of the output as its
    two parts (``held``: the imaginary parts of x, fixed, along the real axis only)."""

    def __init__(self, fn: Callable[[Leaves], tuple[Any, Any]], x_split: _Split, held: Leaves | None = None) -> None:
        self.fn = fn
        self.x_split = x_split
        self.held = held  # the imaginary parts, for the real axis only (None: both parts vary)
        self.out_split: _Split | None = None
        self.has_aux = getattr(fn, "has_aux", True)
        if getattr(fn, "batched", None) is not None:
            self.batched = self._batched

    def _xs(self, rs: Leaves) -> Leaves:
        if self.held is None:
            return self.x_split.join(rs)
        return tuple(
            from_parts(r, im) if flag else r for r, im, flag in zip(rs, self.held, self.x_split.flags, strict=True)
        )

    def __call__(self, rs: Leaves) -> tuple[Any, Any]:
        out, aux = self.fn(self._xs(rs))
        if isinstance(out, tuple):
            self.out_split = split = _Split(out)
            if split.any:
                out = split.split(out)
        return out, aux

    def _batched(self, rs: Leaves) -> Leaves:
        outs = self.fn.batched(self._xs(rs))  # type: ignore[attr-defined]
        split = _Split(outs)
        return split.split(outs) if split.any else outs

    def join_out(self, out: Any) -> Any:
        if isinstance(out, Deferred):  # f(x) a black-box engine computes only when asked
            return Deferred(lambda: self.join_out(out.force()))
        if isinstance(out, tuple) and self.out_split is not None and self.out_split.any:
            return self.out_split.join(out)
        return out


def complex_blocks(
    blocks: tuple[tuple[Any, ...], ...],
    out_split: _Split | None,
    x_split: _Split,
    along_real_axis: bool,
    check: bool | None,
    errors: bool = False,
) -> tuple[tuple[Any, ...], ...]:
    """The Jacobian blocks ``df_i/dz_j`` from those of the split function.

    With both parts of ``z_j`` varied, ``df/dz = (df/dRe z - i df/dIm z) / 2`` and
    ``df/dconj z = (df/dRe z + i df/dIm z) / 2``; f is holomorphic where the second is zero
    (the Cauchy-Riemann equations), which ``check`` asserts (True: the engine's derivatives are
    exact, up to rounding; False: they are differences; None: nothing checked). Along the real axis only
    (holomorphy asserted), ``df/dz = df/dRe z``. With ``errors``, the blocks are error estimates
    of the split blocks, combined as bounds (each part the half sum of the parts it is made of)."""
    out_flags = out_split.flags if out_split is not None else (False,) * len(blocks)
    split_rows = iter(blocks)  # rows: complex outputs' two parts joined
    rows = [
        tuple(from_parts(re, im) for re, im in zip(next(split_rows), next(split_rows), strict=True))
        if flag
        else next(split_rows)
        for flag in out_flags
    ]
    result: list[tuple[Any, ...]] = []
    for i, row in enumerate(rows):
        columns = iter(row)
        joined: list[Any] = []
        for j, flag in enumerate(x_split.flags):
            if not flag or along_real_axis:
                joined.append(next(columns))
                continue
            d_re, d_im = next(columns), next(columns)
            d_z = _half_sum(d_re, d_im, -1.0, errors)
            if check is not None:
                _check_holomorphic(d_z, _half_sum(d_re, d_im, 1.0), out_flags[i], i, j, check)
            joined.append(d_z)
        result.append(tuple(joined))
    return tuple(result)


def _half_sum(a: Any, b: Any, sign: float, bound: bool = False) -> Any:
    """``(a + sign i b) / 2``, through the parts of each (no mixed-type arithmetic, which jax's
    strict dtype promotion refuses); with ``bound``, of error estimates: ``|.|`` of each part summed."""
    a_re, a_im = _parts(a) if is_complex(a) else (a, _arrays.numpy_like(a).zeros_like(a))
    b_re, b_im = _parts(b) if is_complex(b) else (b, _arrays.numpy_like(b).zeros_like(b))
    if bound:
        return from_parts((abs(a_re) + abs(b_im)) / 2, (abs(a_im) + abs(b_re)) / 2)
    return from_parts((a_re - sign * b_im) / 2, (a_im + sign * b_re) / 2)


def _check_holomorphic(d_z: Any, d_conj: Any, complex_out: bool, i: int, j: int, exact: bool) -> None:
    try:
        a, b = _norm(d_z), _norm(d_conj)
    except Exception as exc:  # (a traced leaf, inside jax.jit or vmap, say: no values to read)
        raise UnsupportedOperationError(
            "The complex Jacobian of f is checked for holomorphy by its values, which a traced call "
            "(inside jax.jit, vmap or another transform) does not have: call it outside the "
            "transform, or pass holomorphic=True if f is holomorphic (nothing is then checked)."
        ) from exc
    if not np.isfinite(a + b):
        return  # NaN and inf propagate
    if b <= _tolerance(_arrays.dtype_name(d_z), exact) * (a + b) or b == 0.0:
        return
    where = "" if i == 0 and j == 0 else f" (output leaf {i}, x leaf {j})"
    if not complex_out:
        raise UnsupportedOperationError(
            f"f is real-valued, so it is not holomorphic in its complex x{where}, and has no complex "
            "Jacobian: use gradient (df/dRe x + i df/dIm x) for a real scalar, or jvp/vjp."
        )
    raise UnsupportedOperationError(
        f"f is not holomorphic in its complex x{where}: |df/dconj z| = {b:.3g} against |df/dz| = {a:.3g}, "
        "so it has no complex Jacobian. Use jvp (the directional derivative, A xdot + B conj(xdot)) or "
        "vjp, or gradient for a real-valued f; pass holomorphic=True only if f is holomorphic (then "
        "nothing is checked, and the derivative is taken along the real axis)."
    )


def _norm(value: Any) -> float:
    family = _arrays.family_of(value)  # (its values, also of a leaf inside an engine's transform)
    array = np.asarray(value if family is None else family.values(value))
    return float(np.sqrt(np.sum(np.abs(array) ** 2)))


# -- the adapter for complex calls ---------------------------------------------------------------------


class ComplexAdapter:
    """An adapter that runs ``inner`` in the convention: everything not overridden here is
    ``inner``'s own (reached through ``__getattr__``). The operators of a scalar f have it for
    complex x only (:func:`adapter_for_call`)."""

    def __init__(self, inner: Adapter, op: Operator, holomorphic: bool, x_complex: bool, t_complex: bool) -> None:
        self._inner = inner
        # a call on real x and tangents whose f returned real outputs when first run (its output
        # dtypes are fixed by x's): the engine's own methods, directly, from then on
        self._real = not (x_complex or t_complex)
        self.real_outputs = False
        self._complex_outputs = False  # (f's outputs found complex, for an engine without complex_reverse_mode)
        self._convention = inner.info.complex_convention
        self._holomorphic = holomorphic
        # checking holomorphy reads the Jacobian's values: not inside a compiled trace
        self._eager = x_complex and not holomorphic and op.compute in _JACOBIAN_FAMILY and inner.compiles
        self._local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # -- compilation: none where holomorphy is checked on values --------------------------------

    @property
    def compiles(self) -> bool:
        return bool(self._inner.compiles) and not self._eager

    @property
    def retraces(self) -> bool:
        return bool(self._inner.retraces) and not self._eager

    def compile(self, program: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        return program if self._eager else self._inner.compile(program, **options)

    def returns_like(self, leaf: Any) -> bool:
        return self.compiles and self._inner.returns_like(leaf)

    def rebuilds_in_trace(self, spec: Any, leaves: list[Any]) -> bool:
        return self.compiles and self._inner.rebuilds_in_trace(spec, leaves)

    def take_error(self) -> Any:
        batch_error = getattr(self._local, "batch_error", None)
        if batch_error is not None:  # (of a batch: one estimate per product)
            self._local.batch_error = None
            return batch_error
        error = self._inner.take_error()
        rejoin = getattr(self._local, "rejoin", None)
        self._local.rejoin = None
        if error is None or rejoin is None:
            return error
        return rejoin(error)

    def _errors(self, rejoin: Callable[[Any], Any] | None) -> None:
        if self._inner.estimates_errors:
            self._local.rejoin = rejoin

    def _joined(self, result: Any, *joins: Callable[[Any], Any] | None) -> Any:
        """``result``'s parts each through its join (None: as it is), and so the call's error
        estimate, where the engine makes one (:meth:`take_error`)."""

        def rejoin(parts: Any) -> tuple[Any, ...]:
            return tuple(part if join is None else join(part) for part, join in zip(parts, joins, strict=False))

        self._errors(rejoin)
        return rejoin(result)

    def _learn(self, g: _Realified) -> None:
        if self._real and g.out_split is not None and not g.out_split.any:
            self.real_outputs = True

    # -- first order --------------------------------------------------------------------------------

    def value_and_gradient(self, fn: Callable[[Leaves], Any], xs: Leaves) -> tuple[Any, Any, Leaves]:
        if self._convention == "split":
            x_split = _Split(xs)
            result = self._inner.value_and_gradient(_Realified(fn, x_split), x_split.split(xs))
            return self._joined(result, None, None, x_split.join)  # type: ignore[no-any-return]
        value, aux, grads = self._inner.value_and_gradient(fn, xs)
        return value, aux, _conjugated(grads) if self._convention == "conjugate" else tuple(grads)

    def value_and_pushforward(self, fn: Callable[[Leaves], Any], xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        # (every engine's jvp is the directional derivative; a split engine's too, of real outputs)
        if self._convention != "split" or self.real_outputs:
            return self._inner.value_and_pushforward(fn, xs, txs)
        x_split = _Split(xs)
        g = _Realified(fn, x_split)
        result = self._inner.value_and_pushforward(g, x_split.split(xs), x_split.split(txs))
        self._learn(g)
        return self._joined(result, g.join_out, None, g.join_out)  # type: ignore[no-any-return]

    def pullback_function(self, fn: Callable[[Leaves], Any], xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
        convention = self._convention
        if convention == "direct":
            return self._inner.pullback_function(fn, xs)
        if convention == "conjugate":
            out, aux, vjp = self._inner.pullback_function(fn, xs)

            def pullback(touts: Any) -> Leaves:
                engine = _conjugated(touts if isinstance(touts, tuple) else (touts,))
                grads = vjp(engine if isinstance(touts, tuple) else engine[0])
                return _conjugated(grads)

            return out, aux, pullback
        if self.real_outputs:
            return self._inner.pullback_function(fn, xs)
        x_split = _Split(xs)
        g = _Realified(fn, x_split)
        out, aux, vjp = self._inner.pullback_function(g, x_split.split(xs))
        self._learn(g)

        def split_pullback(touts: Any) -> Leaves:
            if isinstance(touts, tuple) and g.out_split is not None and g.out_split.any:
                touts = g.out_split.split(touts)
            return x_split.join(tuple(vjp(touts)))

        self._errors(lambda e: (g.join_out(e[0]), e[1], x_split.join(e[2])))
        return g.join_out(out), aux, split_pullback

    # -- batches: one product at a time, each in the convention (the engine's vmapped batch
    # would skip the conversion); an engine's estimates come one per product

    def value_and_pushforwards(self, fn: Callable[[Leaves], Any], xs: Leaves, batch: Any) -> tuple[Any, Any, list[Any]]:
        estimates = self._inner.estimates_errors
        touts, errors = [], []
        out = aux = head = None
        for txs in batch:
            out, aux, tout = self.value_and_pushforward(fn, xs, txs)
            touts.append(tout)
            if estimates:
                error = self.take_error()
                head = None if error is None else error[0]
                errors.append(None if error is None else error[2])
        if estimates and head is not None:
            self._local.batch_error = (head, None, errors)
        return out, aux, touts

    def pullbacks(self, vjp: Callable[[Any], Leaves], xs: Leaves, batch: Any) -> list[Leaves]:
        return [vjp(touts) for touts in batch]

    def value_and_jacobian(
        self, fn: Callable[[Leaves], Any], xs: Leaves, mode: str | None = None
    ) -> tuple[Any, Any, tuple[tuple[Any, ...], ...]]:
        if self.real_outputs:
            return self._inner.value_and_jacobian(fn, xs, mode)
        x_split = _Split(xs)
        along_real_axis = self._holomorphic
        if along_real_axis and x_split.any:
            parts = [_parts(x) if f else (x, None) for x, f in zip(xs, x_split.flags, strict=True)]
            g = _Realified(fn, x_split, held=tuple(im for _, im in parts))
            rs = tuple(re for re, _ in parts)
        else:
            g = _Realified(fn, x_split)
            rs = x_split.split(xs)
        by_rows = self._inner.complex_reverse_mode  # (else its vjps through complex operations are wrong)
        if not by_rows and (x_split.any or self._complex_outputs):
            mode = "forward"
        out, aux, blocks = self._inner.value_and_jacobian(g, rs, mode)
        if not by_rows and mode != "forward" and g.out_split is not None and g.out_split.any:
            self._complex_outputs = True  # (found complex: by columns, now and from now on)
            out, aux, blocks = self._inner.value_and_jacobian(g, rs, "forward")
        self._learn(g)
        # (an engine with a reverse mode differentiates exactly; one without, by differences)
        check = None if along_real_axis else self._inner.info.reverse_mode
        result = complex_blocks(blocks, g.out_split, x_split, along_real_axis, check)
        self._errors(
            lambda e: (
                g.join_out(e[0]),
                e[1],
                complex_blocks(e[2], g.out_split, x_split, along_real_axis, None, errors=True),
            )
        )
        return g.join_out(out), aux, result

    def value_and_derivative(self, fn: Callable[[Leaves], Any], xs: Leaves) -> tuple[Any, Any, Any]:
        if self.real_outputs:
            return self._inner.value_and_derivative(fn, xs)
        x_split = _Split(xs)
        if x_split.any:  # both columns (along 1 and along i) of the split Jacobian
            out, aux, blocks = self.value_and_jacobian(fn, xs)
            rejoin = getattr(self._local, "rejoin", None)
            if rejoin is not None:
                self._local.rejoin = lambda e: (lambda r: (r[0], r[1], tuple(row[0] for row in r[2])))(rejoin(e))
            return out, aux, tuple(row[0] for row in blocks)
        if self._convention != "split" and self._inner.info.forward_mode:
            # (the jvp along 1 of a real x, the engine's own: its jvp is the directional
            # derivative, complex outputs included; no wrapper, which compiled torch cannot trace)
            return self._inner.value_and_derivative(fn, xs)
        g = _Realified(fn, x_split)
        result = self._inner.value_and_derivative(g, xs)
        self._learn(g)
        return self._joined(result, g.join_out, None, g.join_out)  # type: ignore[no-any-return]

    def value_derivative_and_second_derivative(
        self, fn: Callable[[Leaves], Any], xs: Leaves
    ) -> tuple[Any, Any, Any, Any]:
        if self.real_outputs:
            return self._inner.value_derivative_and_second_derivative(fn, xs)
        g = _Realified(fn, _Split(xs))  # (complex x is refused at preparation)
        result = self._inner.value_derivative_and_second_derivative(g, xs)
        self._learn(g)
        return self._joined(result, g.join_out, None, g.join_out, g.join_out)  # type: ignore[no-any-return]

    # -- second order ---------------------------------------------------------------------------------

    def gradient_and_hvp(self, fn: Callable[[Leaves], Any], xs: Leaves, txs: Leaves) -> tuple[Any, Any, Leaves, Leaves]:
        """The jvp of the gradient map, ``v -> d/dh grad f(x + h v)``: on the split function the
        real Hessian-vector product, whose two parts are joined as the gradient's are."""
        x_split = _Split(xs)
        result = self._inner.gradient_and_hvp(_Realified(fn, x_split), x_split.split(xs), x_split.split(txs))
        return self._joined(result, None, None, x_split.join_gradient, x_split.join)  # type: ignore[no-any-return]

    def gradient_and_hvps(
        self, fn: Callable[[Leaves], Any], xs: Leaves, batch: Any
    ) -> tuple[Any, Any, Leaves, list[Leaves]]:
        """:meth:`gradient_and_hvp` along each tangent of the batch: the split function's batch
        of real Hessian-vector products (one program where the engine has one), each joined."""
        x_split = _Split(xs)
        result = self._inner.gradient_and_hvps(
            _Realified(fn, x_split), x_split.split(xs), [x_split.split(txs) for txs in batch]
        )
        return self._joined(result, None, None, x_split.join_gradient, lambda hvps: [x_split.join(h) for h in hvps])  # type: ignore[no-any-return]
