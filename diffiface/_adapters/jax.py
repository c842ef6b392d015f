"""jax: ``jax.vjp``, ``jax.jvp``, ``jax.value_and_grad``, ``jax.jacrev``/``jacfwd``, and ``jax.jit``.

Every operator is one program compiled with ``jax.jit``; context arrays and floats are its
arguments (new values never recompile), other context leaves are static, compared by value. float64 work runs
inside a scoped ``jax.enable_x64(True)``; the global flag is never changed.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import _arrays
from .._errors import InvalidOutputError, MutationError, UnsupportedOperationError
from .._families import _jax_placement as _placement
from .._families.jax import rebuilds_alike
from . import _base
from ._base import Blocks, Fn, Leaves, class_names, raised_by, raised_inside


def _names_a_tracer(exc: BaseException) -> bool:
    """Whether a library refused one of jax's traced arrays by its class name (an error raised
    in compiled code, torch's say, has no Python frame to tell where it came from)."""
    words = set(re.findall(r"\b\w*Tracer\b", str(exc)))
    return bool(words) and bool(words & class_names(jax.core.Tracer))


class Adapter(_base.Adapter):
    xp = jnp
    weak_floats = True
    retracing_option = "jit"  # (jit keys its programs by their arguments' shapes and dtypes)

    def to_native(self, leaf: Any) -> Any:
        kind = _arrays.kind(leaf)
        if kind == "python":
            # weakly typed, as jax takes a Python number: it takes the dtype of the arrays it
            # meets (float64 where x64 is on, as in diffiface's scope for float64 work)
            return jnp.asarray(leaf)
        if kind == "numpy":
            return jnp.asarray(_arrays.in_native_byte_order(leaf))
        return leaf

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        kind = _arrays.kind(leaf)
        if kind == "numpy":
            # a compiled program takes numpy arrays as jit does, moved to the device in its own
            # call (where f sees only traced arrays, which it cannot write into)
            leaf = _arrays.in_native_byte_order(leaf)
            numeric = leaf.dtype.kind in "biufc"  # (jnp.asarray refuses the others, as it should)
            return (leaf if self.compiles and numeric else jnp.asarray(leaf)), True
        # A float is an argument of the compiled program, as jit takes one: a new value runs
        # the same program, and is never a stale constant. Integers and booleans stay static
        # (sizes, flags, indices), compared by value.
        return leaf, kind == "jax" or type(leaf) in (float, complex)

    def constant_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        if self.compiles:  # (under jit f sees a Constant's arrays traced: nothing to write into)
            return self.context_to_native(leaf, like)
        return super().constant_to_native(leaf, like)

    def output_leaf(self, leaf: Any, like: Any) -> Any:
        kind = _arrays.kind(leaf)
        if kind == "python":
            return jnp.asarray(leaf, dtype=getattr(like, "dtype", None))
        if kind == "numpy":
            return jnp.asarray(leaf)
        return leaf

    scoped = True

    def scope(self) -> contextlib.AbstractContextManager[Any] | None:
        if not _X64.value:
            return jax.enable_x64(True)  # type: ignore[no-any-return]
        return None

    def returns_like(self, leaf: Any) -> bool:
        return self.compiles and isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)

    def untracked(self, leaf: Any, xs: Leaves) -> bool:
        # (an output that depends on x is a tracer of x's own trace, jax's differentiation of f:
        # any other, a concrete array or a tracer of an enclosing jit or vmap, does not)
        for x in xs:
            if isinstance(x, _Tracer):
                return not (isinstance(leaf, _Tracer) and leaf._trace is x._trace)
        return False

    cuts_unseen = False  # (float(), .item() and numpy refuse a traced array)

    def refuse_a_read_of_x(self, at: Callable[[Leaves], list[Any]], xs: Leaves, given: Leaves) -> None:
        own = _own_arrays(xs)
        if not own:
            return
        closed = jax.make_jaxpr(at)(tuple(xs))  # (x an argument: its values are no constants of the trace)
        # (``own`` keeps them alive meanwhile; an array f is given as a context is f's to read)
        ids = {id(array) for array in own} - {id(leaf) for leaf in given}
        if any(id(const) in ids for const in _read_constants(closed)):
            raise InvalidOutputError(
                "f reads the arrays of x itself (a model it closes over, jax.vmap(model)(data), where x is "
                "the model's arrays from eqx.partition(model, eqx.is_array) or nnx.split(model)), not the "
                "arrays it is given for them: diffiface differentiates those, so the derivative through that "
                "read would be zero. Compute with f's argument: eqx.combine(params, static), "
                "nnx.merge(graphdef, state)."
            )

    def trace_value(self, leaf: Any, xs: Leaves) -> str | None:
        return f"a jax tracer ({type(leaf).__name__})" if isinstance(leaf, _Tracer) else None

    traced_dtype = staticmethod(jax.dtypes.canonicalize_dtype)  # (int64 numpy labels: int32 without x64)
    rebuilds_in_trace = staticmethod(rebuilds_alike)

    def compile(
        self,
        program: Callable[..., Any],
        static: bool = True,
        arrays: bool = False,
        layouts: Any = None,
        parts: Any = None,
    ) -> Callable[..., Any]:
        if not self.compiles:
            return program
        if parts is not None and any(parts.x_arrays):
            program = _knowing_x(program, parts.x_arrays)
        if arrays and layouts is not None:
            # Every call's arguments are laid out as the prep's: the trace takes its layouts
            # from there, and the call goes straight to jit (on one device, none to know).
            return jax.jit(_placement.laid_out_as(program, layouts), static_argnums=3 if static else ())
        program = _placement.laid_out(program)
        layouts = _placement.pending_layouts
        # jit returns arrays only; the other leaves of a result (an aux holding a string,
        # say) are kept from the trace, per value of the static argument.
        kept: dict[Any, tuple[Any, list[bool], list[Any]] | None] = {}

        def arrays_only(*args: Any) -> Any:
            result = program(*args)
            key = args[3] if static else None
            leaves, spec = jax.tree_util.tree_flatten(result)
            mask = [isinstance(leaf, jax.Array) for leaf in leaves]
            if all(mask):  # the common case: the result goes through jit as it is
                kept[key] = None
                return result
            kept[key] = (spec, mask, [leaf for leaf, m in zip(leaves, mask, strict=True) if not m])
            return [leaf for leaf, m in zip(leaves, mask, strict=True) if m]

        jitted = jax.jit(program if arrays else arrays_only, static_argnums=3 if static else ())

        def run(*args: Any) -> Any:
            layouts.pending = args  # (read only if jit traces)
            try:
                out = jitted(*args)
            finally:
                layouts.pending = None  # (a stale record would keep the last call's arrays alive)
            found = None if arrays else kept[args[3] if static else None]
            if found is None:
                return out
            spec, mask, others = found
            computed, rest = iter(out), iter(others)
            return jax.tree_util.tree_unflatten(spec, [next(computed) if m else next(rest) for m in mask])

        return run

    def forget_traces(self) -> None:
        # jax's staging caches can give a new trace of a new function the constants an earlier
        # trace read from a numpy array that has since changed in place (a gradient of the old
        # values, without an error): every cache goes, and every jitted function of the process
        # compiles again on its next call, a cost paid only after such a change.
        jax.clear_caches()

    def explain_failure(self, exc: BaseException) -> str | None:
        if isinstance(exc, jax.errors.TracerArrayConversionError):
            return (
                "f turned a traced jax array into a numpy array (a numpy function or np.asarray "
                "on its input). Write f with jax.numpy, or differentiate a numpy f with "
                "AutoFiniteDifferences()."
            )
        if isinstance(exc, (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError)):
            return (
                "f uses the value of a traced array in Python control flow (if, while, int()). "
                "Under jit, x, array contexts and float contexts are traced. Use jnp.where or "
                "jax.lax.cond; pass a number that must stay a Python value as an int or a string; "
                "or use AutoJAX(jit=False)."
            )
        if isinstance(exc, TypeError) and raised_by(exc) == "_unimplemented_setitem":
            raise MutationError(
                "f assigns into a jax array in place (x[i] = v). jax arrays, a di.Cache's too, are "
                "immutable: write x = x.at[i].set(v), and return what f computes."
            ) from exc
        if (isinstance(exc, TypeError) and "to a custom_vjp function" in str(exc)) or (
            isinstance(exc, NotImplementedError) and "custom_lin" in str(exc)
        ):
            raise UnsupportedOperationError(
                "f calls a jax.custom_vjp function, which jax differentiates in reverse mode only, "
                "and this operator takes forward mode (a jvp, a derivative, a Jacobian or a second "
                "derivative of a scalar x). Use di.gradient or di.vjp, or give the function a "
                "jax.custom_jvp rule."
            ) from exc
        if isinstance(exc, TypeError) and (raised_inside(exc, "torch") or _names_a_tracer(exc)):
            return (
                "f handed a traced jax array to a function that does not take jax arrays (torch, "
                "say); differentiate a torch function with AutoTorch(), any function with "
                "AutoFiniteDifferences()."
            )
        return None

    # -- primitives ---------------------------------------------------------------------------------

    def pullback_function(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
        out, vjp, aux = jax.vjp(fn, xs, has_aux=True)
        return out, aux, lambda touts: _placement.as_inputs(vjp(touts)[0], xs)

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        out, tout, aux = jax.jvp(fn, (xs,), (txs,), has_aux=True)
        return out, aux, tout

    def value_and_pushforwards(self, fn: Fn, xs: Leaves, batch: Any) -> tuple[Any, Any, list[Any]]:
        if len(batch) < 2:
            return super().value_and_pushforwards(fn, xs, batch)
        stacked = tuple(jnp.stack([txs[j] for txs in batch]) for j in range(len(xs)))
        out, linear, aux = jax.linearize(fn, xs, has_aux=True)
        touts = jax.vmap(linear)(stacked)  # one program for the whole batch
        return out, aux, [jax.tree.map(lambda t, k=k: t[k], touts) for k in range(len(batch))]

    def pullbacks(self, vjp: Callable[[Any], Leaves], xs: Leaves, batch: Any) -> list[Leaves]:
        if len(batch) < 2:
            return super().pullbacks(vjp, xs, batch)
        stacked = jax.tree.map(lambda *ts: jnp.stack(ts), *batch)
        grads = jax.vmap(vjp)(stacked)  # one program for the whole batch
        return [jax.tree.map(lambda g, k=k: g[k], grads) for k in range(len(batch))]

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        (value, aux), grads = jax.value_and_grad(fn, has_aux=True)(xs)
        return value, aux, _placement.as_inputs(grads, xs)

    def value_and_jacobian(self, fn: Fn, xs: Leaves, mode: str | None = None) -> tuple[Any, Any, Blocks]:
        if len({x.dtype for x in xs}) > 1:
            # jax's jacfwd/jacrev build one basis for all leaves, promoting their dtypes together,
            # which fails under strict promotion: row by row, each leaf in its own dtype
            return super().value_and_jacobian(fn, xs, mode)
        transform = jax.jacfwd if mode == "forward" else jax.jacrev

        def with_value(xs_: Leaves) -> tuple[Any, Any]:
            out, aux = fn(xs_)
            return out, (out, aux)

        try:
            blocks, (out, aux) = transform(with_value, has_aux=True)(xs)
        except ValueError:
            if jax.tree_util.tree_leaves(jax.eval_shape(lambda xs_: fn(xs_)[0], xs)):
                raise
            # jax's jacobians refuse an output with no arrays; its rows are none at all
            return super().value_and_jacobian(fn, xs, mode)
        return out, aux, blocks

    def basis(self, like: Any, index: int) -> Any:
        return jnp.zeros(like.size, like.dtype).at[index].set(1).reshape(like.shape)


_Tracer = jax.core.Tracer


class _Tracing(threading.local):
    x: tuple[Any, ...] = ()
    """x's leaves in the call jit is tracing, where its program knows them (weakly)."""


_TRACING = _Tracing()


def _knowing_x(program: Callable[..., Any], x_arrays: tuple[Any, ...]) -> Callable[..., Any]:
    """``program`` (to be compiled by jax.jit) that, while traced, knows x's arrays of the call
    it was built for (``x_arrays``: weak references): under jit, x's values inside the trace are
    abstract, and f's constants are met by identity with those arrays (a read of x's own arrays)."""

    @functools.wraps(program)
    def traced(*args: Any) -> Any:
        before = _TRACING.x
        _TRACING.x = tuple(ref() for ref in x_arrays if ref is not None)
        try:
            return program(*args)
        finally:
            _TRACING.x = before

    return traced


def _own_arrays(xs: Leaves) -> list[Any]:
    """x's own arrays, concrete: the values under the traces of ``xs`` (jit=False), or those
    of the call jit is tracing."""
    own = []
    for x in xs:
        while isinstance(x, _Tracer) and hasattr(x, "primal"):  # (a forward-mode pass, an hvp's)
            x = x.primal
        if isinstance(x, jax.Array) and not isinstance(x, _Tracer):
            own.append(x)
    return own + [x for x in _TRACING.x if isinstance(x, jax.Array)]


def _read_constants(closed: Any) -> list[Any]:
    """The constants of a traced f (a ``ClosedJaxpr``) its outputs are computed from: the
    arrays it closes over, less those only its unused work reads."""
    jaxpr = closed.jaxpr
    needed = {id(v) for v in jaxpr.outvars}
    for eqn in reversed(jaxpr.eqns):
        if any(id(v) in needed for v in eqn.outvars):
            needed.update(id(v) for v in eqn.invars)
    return [const for var, const in zip(jaxpr.constvars, closed.consts, strict=True) if id(var) in needed]


class _X64Read:
    """jax's x64 flag read through its public config (where jax keeps no state object)."""

    __slots__ = ()

    @property
    def value(self) -> bool:
        return bool(jax.config.read("jax_enable_x64"))


def _x64_state() -> Any:
    """jax's x64 flag as an object whose ``value`` reads it (in C where jax keeps its state
    object: ``jax.config.read`` is two Python frames)."""
    state = getattr(getattr(getattr(jax, "_src", None), "config", None), "enable_x64", None)
    return state if isinstance(getattr(state, "value", None), bool) else _X64Read()


_X64 = _x64_state()
