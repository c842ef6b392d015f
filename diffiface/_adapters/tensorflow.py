"""TensorFlow: ``tf.GradientTape`` for every derivative (a jvp is the pullback's adjoint, by
two tapes nested; second order nests them again), and ``tf.function`` under ``jit=True``.

``f`` is called with ``tf.Tensor`` leaves: a variable of x (``tf.Variable``, a Keras 3
variable) is read once into a tensor, which the tape watches; the variable itself is never
watched, written or returned. A tape answers once unless persistent, so the pullback of
:meth:`Adapter.pullback_function`, which may be applied many times (a Jacobian's rows), keeps
a persistent one; a gradient takes a plain one. Whether an output of ``f`` is traced is asked
of the tape running, so an output ``f`` cut from the trace whole (``.numpy()``,
``float(y)``) is found, never differentiated as zero. A number read inside ``f`` and
multiplied back into a traced output (``float(s) * s``) is a constant to the tape, as
``.item()`` is to torch's autograd: ``check_gradients`` tells such an f from its finite
differences.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.types import core as tensorflow_core

from .. import _arrays
from .._errors import ArrayTypeError, InvalidOutputError, MutationError, UnsupportedOperationError
from .._families.tensorflow import dtype_of, names, put_back, variables_of
from .._families.tensorflow import variable_values as _value
from . import _base
from ._base import Fn, Leaves, raised_inside

_ZERO = tf.UnconnectedGradients.ZERO
_TENSOR = tensorflow_core.Tensor  # tensors, variables, Keras 3 variables on TensorFlow
_EAGER = type(tf.constant(0.0))  # a concrete tensor (a graph's results are ones)
_POLYMORPHIC = tf.types.experimental.PolymorphicFunction  # what @tf.function makes


class _Namespace:
    """The few array functions ``_base`` needs, with TensorFlow's names."""

    stack = staticmethod(tf.stack)
    reshape = staticmethod(tf.reshape)
    zeros_like = staticmethod(tf.zeros_like)
    ones_like = staticmethod(tf.ones_like)
    sum = staticmethod(tf.reduce_sum)
    zeros = staticmethod(tf.zeros)


class _Tracing(threading.local):
    """What traces the current evaluation of ``f`` in this thread: how many calls' tapes are
    running; on a prep's first call, the float variables of its Caches, and all their variables
    (see :class:`_FirstCallWatch`)."""

    def __init__(self) -> None:
        self.tapes = 0
        self.caches: list[Any] | None = None
        self.scratch: list[Any] = []
        self.sources: list[Any] = []  # per argument of a graph being traced: its _SOURCES entry


_tracing = _Tracing()


class Adapter(_base.Adapter):
    xp = _Namespace
    retracing_option = "jit"  # (a tf.function traces anew for each shape and dtype)

    # -- conversions ----------------------------------------------------------------------------

    def to_native(self, leaf: Any) -> Any:
        if isinstance(leaf, tf.Tensor):
            # eager, a tape watches tensors by identity: f gets a tensor of its
            # own, so that one tensor at two leaves of x, or x's tensor closed over by f, is not
            # differentiated as both (a graph's arguments are apart)
            return leaf if self.compiles else tf.identity(leaf)
        kind = _arrays.kind(leaf)
        if kind == "tensorflow":  # a variable: its value, read once (never the variable itself)
            tensor = tf.convert_to_tensor(leaf)
            _remember_source(tensor, leaf)
            return tensor
        if kind == "python":
            return tf.constant(leaf, dtype=tf.complex128 if isinstance(leaf, complex) else tf.float64)
        if kind == "numpy":
            return tf.constant(_arrays.in_native_byte_order(np.asarray(leaf)))
        raise ArrayTypeError(
            f"The tensorflow backend was given a {type(leaf).__module__}.{type(leaf).__name__} where it "
            "takes tf.Tensor, tf.Variable, numpy arrays or floats (a tangent of another framework?). "
            "Convert it to a tf.Tensor of x's dtype."
        )

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        if isinstance(leaf, tf.Tensor):  # (f gets a tensor of its own, as of x: see to_native)
            return self.to_native(leaf), True
        kind = _arrays.kind(leaf)
        if kind == "numpy":
            leaf = _arrays.in_native_byte_order(np.asarray(leaf))
            if leaf.dtype.kind not in "biufc":  # strings, objects: passed as they are
                return leaf, False
            return tf.constant(leaf), True  # (a copy: f cannot reach the caller's array)
        # a Python number stays one, as tf.function keeps it: f's own arithmetic on it is
        # Python's (a tensor of x's dtype made first rounds it: 1000000.1 - 1e6 is 0.125 in
        # float32), and under jit the graph is traced once per value
        return leaf, False

    def constant_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        if _arrays.kind(leaf) == "tensorflow" and not isinstance(leaf, tf.Tensor):
            # a variable in a Constant: its value, so that f cannot assign to the caller's variable
            return tf.convert_to_tensor(leaf), True
        return self.context_to_native(leaf, like)

    def output_leaf(self, leaf: Any, like: Any) -> Any:
        if isinstance(leaf, tf.Tensor):
            return leaf
        if isinstance(leaf, _TENSOR):  # f returned a variable: its value
            return tf.convert_to_tensor(leaf)
        # a number or numpy array that does not depend on x (untracked() has checked): a constant
        dtype = dtype_of(like) if isinstance(like, _TENSOR) and _arrays.kind(leaf) == "python" else None
        return tf.constant(leaf, dtype=dtype)

    def traced_function(self, f: Callable[..., Any]) -> Callable[..., Any]:  # type: ignore[override]
        """Under ``jit=True``, a ``tf.function``'s Python function (converted by autograph where
        the ``tf.function`` converts it), traced into the prep's graph op by op: called as a
        ``tf.function``, it is one operation whose gradient is zero where its output is cut from
        x (``tf.stop_gradient``, ``tf.numpy_function``), which the graph's checks cannot see
        inside. The graph is the same. Eagerly, f as it is: the graph call is its speed."""
        if self.compiles and isinstance(f, _POLYMORPHIC):
            inner = f.python_function
            return tf.autograph.to_graph(inner) if getattr(f, "_autograph", True) else inner  # type: ignore[no-any-return]
        return f

    def output_values(self, leaf: Any) -> Any:  # type: ignore[override]
        """An output leaf as it is; refused where a graph does not know its shape
        (``tf.py_function``'s output, ``tf.boolean_mask``'s under ``jit=True``)."""
        if isinstance(leaf, tf.Variable) and not tf.executing_eagerly():
            raise InvalidOutputError(
                "f returned a tf.Variable inside the tf.function graph of AutoTensorFlow(jit=True), which "
                "has no values to check and makes a variable on every trace: return the tensor it holds "
                "(the computation itself, or tf.identity(variable))."
            )
        shape = getattr(leaf, "shape", None)
        if isinstance(shape, tf.TensorShape) and not shape.is_fully_defined():
            raise InvalidOutputError(
                f"f returned a tensor of shape {shape} inside a tf.function graph, which does not know its "
                "shape (tf.py_function, tf.boolean_mask, tf.unique): its derivatives cannot be laid out. "
                "Use AutoTensorFlow(jit=False), or give the shape (tf.ensure_shape)."
            )
        return leaf

    def trace_value(self, leaf: Any, xs: Leaves) -> str | None:
        # (an eager tensor holds its values; a tensor of a tf.function's graph has none outside it)
        if isinstance(leaf, tf.Tensor) and not isinstance(leaf, _EAGER):
            return "a symbolic tensor of tf.function's graph"
        return None

    def untracked(self, leaf: Any, xs: Leaves) -> bool:
        if not _tracing.tapes or not xs:
            return False
        if not isinstance(leaf, tf.Tensor):
            # a number or numpy array while x is traced: f left TensorFlow; in a graph, where f
            # cannot read a tensor's value (float(y) is refused there), a constant of f
            return isinstance(xs[0], _EAGER)
        missed = not record.should_record_backprop([leaf])
        if not isinstance(leaf, _EAGER):  # (a graph has no values to evaluate f at again)
            _refuse_graph_cut(leaf, xs, missed)
            return False  # (x does not reach it where it is missed: its derivative is zero)
        return missed

    def basis(self, like: Any, index: int) -> Any:
        dtype = dtype_of(like)
        flat = np.zeros(int(np.prod(tuple(like.shape))), dtype=dtype.as_numpy_dtype)
        flat[index] = 1
        return tf.constant(flat.reshape(tuple(like.shape)), dtype=dtype)

    def explain_failure(self, exc: BaseException) -> str | None:
        if isinstance(exc, AttributeError) and any(
            f"has no attribute '{name}'" in str(exc)
            for name in ("assign", "assign_add", "assign_sub", "scatter_update")
        ):
            raise MutationError(
                "f assigns into x or a Constant (variable.assign...). diffiface hands f tf.Tensor values "
                "of the caller's variables, which it never writes: compute out of place and return the "
                "new value (has_aux=True), or pass scratch variables as di.Cache."
            ) from exc
        if isinstance(exc, LookupError) and raised_inside(exc, "tensorflow") and "gradient registry" in str(exc):
            raise UnsupportedOperationError(
                f"TensorFlow has no derivative of an operation f uses ({exc}). Compute f without it, "
                "give it a rule with tf.custom_gradient, or use AutoFiniteDifferences()."
            ) from exc
        if isinstance(exc, NotImplementedError) and "recompute_grad" in str(exc):
            raise UnsupportedOperationError(
                "f uses tf.recompute_grad, whose gradient TensorFlow does not differentiate again. A jvp, "
                "a derivative and a second derivative here are the adjoint of the pullback (a tape over "
                "the gradient), as an hvp and a Hessian are under jit=True: for those, call the block "
                "without tf.recompute_grad; gradient, vjp and jacobian take it as it is."
            ) from exc
        if isinstance(exc, (NotImplementedError, AttributeError)) and "numpy" in str(exc) and self.compiles:
            return (
                "f needs the values of its tensors as numpy (.numpy(), np.asarray, a numpy function), which "
                "a tf.function graph does not have. Write f with TensorFlow operations, or use "
                "AutoTensorFlow(jit=False)."
            )
        if isinstance(exc, TypeError) and "SymbolicTensor" in str(exc) and self.compiles:
            return (
                "f converts a tensor to a Python number (float(y), int(y)), which a tf.function graph does "
                "not have: return the tensor itself, or use AutoTensorFlow(jit=False)."
            )
        if isinstance(exc, TypeError) and "OperatorNotAllowedInGraphError" in type(exc).__name__:
            return (
                "f branches in Python on the value of a tensor (if, while, bool()), which a tf.function "
                "graph traced without autograph cannot do. Use tf.cond or tf.where, or AutoTensorFlow(jit=False)."
            )
        if isinstance(exc, TypeError) and _base.handed_to_another_framework(exc):
            return (
                "f handed a TensorFlow tensor to a function that does not take one (torch, jax); "
                "differentiate such an f with its own engine, any function with AutoFiniteDifferences()."
            )
        return None

    # -- jit: a tf.function per prep ---------------------------------------------------------------

    def returns_like(self, leaf: Any) -> bool:
        return self.compiles and type(leaf) is _EAGER

    def compile(
        self,
        program: Callable[..., Any],
        static: bool = True,
        arrays: bool = False,
        layouts: Any = None,
        parts: Any = None,
    ) -> Callable[..., Any]:
        if not self.compiles:
            watched = () if parts is None else tuple(not cache for cache in parts.cache_static)
            return _FirstCallWatch(program, watched) if static and watched else program
        if layouts is not None:  # a program of flat tensors whose results are tensors only
            return tf.function(_Flat(program), autograph=False, reduce_retracing=False)  # type: ignore[no-any-return]
        graphs: dict[Any, _Graph] = {}

        def run(*args: Any) -> Any:
            key = args[3] if static else None
            graph = graphs.get(key)
            if graph is None:
                graph = graphs[key] = _Graph(program, static, key)
            return graph.run(args[:3] if static else args)

        return run

    # -- primitives -------------------------------------------------------------------------------

    def pullback_function(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
        outside = record.could_possibly_record()  # (before this call's tape: another one records)
        # persistent: the pullback may be applied many times (a Jacobian's rows)
        with tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
            tape.watch(xs)
            out, aux = _traced(fn, xs)

        outs = list(_base.as_tuple(out))
        if outside:
            _refuse_hidden_cuts(tape, fn, xs, outs)

        def vjp(touts: Any) -> Leaves:
            # (each cotangent leaf in the dtype of f's output leaf: a Python float, taken as any float
            # dtype and made a float64 tensor, for a float32 output; the checks refused other dtypes)
            pairs = zip(_base.as_tuple(touts), outs, strict=True)
            touts = [t if t.dtype == y.dtype else tf.cast(t, y.dtype) for t, y in pairs]
            return _dense(tape.gradient(outs, list(xs), output_gradients=touts, unconnected_gradients=_ZERO))

        return out, aux, vjp

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        outer = record.could_possibly_record()  # (before this call's tape: another one records)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(xs)
            value, aux = _traced(fn, xs)
        # (the tape's own cotangent: ones of the value's dtype)
        if not outer:
            return value, aux, _dense(tape.gradient(value, list(xs), unconnected_gradients=_ZERO))
        grads = tape.gradient(value, list(xs))
        if all(g is None for g in grads):
            _refuse_hidden_cut(fn, xs, [0])
        return value, aux, _dense([tf.zeros_like(x) if g is None else g for g, x in zip(grads, xs, strict=True)])

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        """The jvp as the adjoint of the pullback, by reverse mode through it: a
        ``tf.autodiff.ForwardAccumulator`` differentiates the forward operations of a
        ``tf.custom_gradient`` and not its rule (a straight-through rounding's jvp was 0 where
        its gradient is 1), takes real primals only, and its complex rules are not the
        convention's. So every derivative of f is the tape's."""
        # the pullback's adjoint under Re<a, b>: the gradient in u of Re<t, vjp(u)> (the pullback
        # is linear in u over the reals)
        outside = record.could_possibly_record()
        with tf.GradientTape(watch_accessed_variables=False) as outer:
            with tf.GradientTape(persistent=outside, watch_accessed_variables=False) as inner:
                inner.watch(xs)
                out, aux = _traced(fn, xs)
            outs = list(_base.as_tuple(out))
            us = [tf.zeros_like(y) for y in outs]
            outer.watch(us)
            grads = inner.gradient(outs, list(xs), output_gradients=us, unconnected_gradients=_ZERO)
            total = tf.zeros((), dtype=tf.float64)
            for g, t in zip(grads, txs, strict=True):
                g = tf.convert_to_tensor(g)
                term = tf.reduce_sum(tf.math.real(tf.math.conj(tf.cast(t, g.dtype)) * g))
                total += tf.cast(term, tf.float64)
        found = _dense(outer.gradient(total, us, unconnected_gradients=_ZERO))  # (a gather's: IndexedSlices)
        if outside:
            _refuse_hidden_cuts(inner, fn, xs, outs)
        touts = tuple(tf.cast(t, y.dtype) for t, y in zip(found, outs, strict=True))
        return out, aux, _base.shaped_as(out, touts)


class _FirstCallWatch:
    """An eager program whose first call watches the variables of the Constants that hold them
    (a Keras model, a ``tf.Module``, or an object holding one: :func:`~diffiface._contexts.held`),
    which f reaches as they are: TensorFlow keeps no count of a
    variable's writes, so their values are kept before that call and compared after it (also
    when f raises), and a write is undone and refused with a :class:`MutationError` that names
    the variable (a BatchNormalization called with ``training=True`` updates its statistics).
    A prep's later calls with the static context leaves of a watched call (the same model, the
    same flags) run f as it did, so they are not watched: no copy of a model per call. Calls
    with others are watched as the first was: unprepared calls share one prep, and another
    model (one with a BatchNormalization) or ``training=True`` where the watched call had
    ``False`` may write where the first did not.

    A Cache's variables are f's to write, but TensorFlow does not differentiate through a
    variable's ``assign``: where f writes one (``cache.assign(2 * x)``) and reads it back into its
    output, that path reads as a constant, a wrong derivative with no error. So on the first call
    each evaluation of f watches them on a tape of its own (:func:`_traced`): an output that
    reads one whose value f leaves moving with x is refused."""

    __slots__ = ("program", "seen", "watched")

    def __init__(self, program: Callable[..., Any], watched: tuple[bool, ...]) -> None:
        self.program = program
        self.watched = watched  # per static context leaf: a Constant's (a Cache's is f's to write)
        # the static leaves of the last watched call that f passed: their keys, and weak
        # references to those compared by identity only (a model), which are not kept alive
        self.seen: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None

    def __call__(self, xs: Leaves, ts: Leaves, dynamic: Leaves, static: Any) -> Any:
        if static is None or self._seen(static):
            return self.program(xs, ts, dynamic, static)
        # (a Constant's variable itself is no static leaf: constant_to_native reads it)
        variables, caches, scratch = [], [], []
        for leaf, constant in zip(static.leaves, self.watched, strict=True):
            for variable in variables_of(leaf):
                if constant:
                    variables.append(variable)
                    continue
                scratch.append(variable)
                if _inexact(tf.as_dtype(variable.dtype)):  # (a Keras variable's dtype is a name)
                    # the tf.Variable a tape watches: a Keras 3 variable's own (its value)
                    value = getattr(variable, "value", None)
                    caches.append(value if isinstance(value, tf.Variable) else variable)
        kept = [_value(variable) for variable in variables]
        before = _tracing.caches, _tracing.scratch
        _tracing.caches, _tracing.scratch = caches or None, scratch
        try:
            result = self.program(xs, ts, dynamic, static)
        finally:
            _tracing.caches, _tracing.scratch = before
            restored = put_back(variables, kept)
        if restored:
            raise MutationError(
                f"f wrote into the variables {restored} of a di.Constant (a Keras layer called with "
                "training=True updates its statistics); they are restored. Call the model with "
                "training=False, compute with model.stateless_call and return the new state (has_aux=True), "
                "or pass the state to update as a di.Cache."
            )
        self.seen = (static.key, tuple(_weak(leaf) for leaf in _by_identity(static)))
        return result

    def _seen(self, static: Any) -> bool:
        """Whether the static leaves are those of the last watched call."""
        if self.seen is None or static.key != self.seen[0]:
            return False
        return all(
            ref is not None and ref() is leaf for ref, leaf in zip(self.seen[1], _by_identity(static), strict=True)
        )


def _by_identity(static: Any) -> list[Any]:
    """The static leaves with no key to compare them by value (a model): compared by identity."""
    return [leaf for key, leaf in zip(static.key, static.leaves, strict=True) if key is None]


def _weak(leaf: object) -> Any:
    """A weak reference to ``leaf``; None where it takes none (then every call is watched)."""
    try:
        return weakref.ref(leaf)
    except TypeError:
        return None


class _Flat:
    """A program of flat tensors, as one object per prep for ``tf.function`` (see :class:`_Graph`)."""

    __slots__ = ("__weakref__", "program")  # (tf.function takes a weak reference to it)

    def __init__(self, program: Callable[..., Any]) -> None:
        self.program = program

    def __call__(self, *leaves: Any) -> Any:
        return self.program(*leaves)


class _Graph:
    """A program as one ``tf.function``, for one value of its static argument. A graph returns
    tensors only: the other leaves of a result (None, an aux's string) are kept from the trace.
    (A callable object, not a closure: TensorFlow counts the retracings of a function by its
    code, which every prep's closure would share.)"""

    def __init__(self, program: Callable[..., Any], static: bool, key: Any) -> None:
        self.program, self.static, self.key = program, static, key
        self.kept: tuple[Any, list[bool], list[Any]] | None = None
        self.arguments: Any = None  # the structure of the arguments, whose leaves the graph takes
        self.function = tf.function(self, autograph=False, reduce_retracing=False)

    def __call__(self, *arguments: Any) -> list[Any]:
        for argument, entry in zip(arguments, _tracing.sources, strict=False):
            if entry is not None:  # (x's tensor read from a variable: so is the graph's argument)
                _remember_source(argument, entry[2])
        args = optree.tree_unflatten(self.arguments, arguments)
        result = self.program(*args, self.key) if self.static else self.program(*args)
        leaves, spec = optree.tree_flatten(result, none_is_leaf=True)
        mask = [isinstance(leaf, tf.Tensor) for leaf in leaves]
        self.kept = (spec, mask, [leaf for leaf, m in zip(leaves, mask, strict=True) if not m])
        return [leaf for leaf, m in zip(leaves, mask, strict=True) if m]

    def run(self, args: tuple[Any, ...]) -> Any:
        # the graph takes the arguments' leaves, flat: TensorFlow binds flat tensors quicker
        # than nested tuples
        leaves: list[Any]
        leaves, self.arguments = optree.tree_flatten(args)  # type: ignore[arg-type]
        _tracing.sources = [_SOURCES.get(id(leaf)) for leaf in leaves]
        try:
            out = self.function(*leaves)
        finally:
            _tracing.sources = []
        assert self.kept is not None  # (set by the trace, which the first call runs)
        spec, mask, others = self.kept
        tensors, rest = iter(out), iter(others)
        return optree.tree_unflatten(spec, [next(tensors) if m else next(rest) for m in mask])


_SOURCES: dict[int, tuple[Any, Any, Any]] = {}
"""Per tensor of x read from a variable (by id, while it lives): a weak reference to the
tensor, the ``tf.Variable`` a tape watches for it (a Keras 3 variable's own) and the variable."""


def _remember_source(tensor: Any, variable: Any) -> None:
    value = getattr(variable, "value", None)  # (a Keras 3 variable holds a tf.Variable)
    watched = value if isinstance(value, tf.Variable) else variable
    key = id(tensor)
    _SOURCES[key] = (weakref.ref(tensor, lambda _: _SOURCES.pop(key, None)), watched, variable)


def _sources(xs: Leaves) -> list[tuple[Any, Any]]:
    """The variables that x's tensors were read from: each as a tape watches it, and itself."""
    entries = [_SOURCES.get(id(x)) for x in xs]
    return [(entry[1], entry[2]) for entry, x in zip(entries, xs, strict=True) if entry is not None and entry[0]() is x]


def _traced(fn: Fn, xs: Leaves) -> tuple[Any, Any]:
    """``fn(xs)`` under a call's tape, which :meth:`Adapter.untracked` knows of; refused where
    its output reads a variable of x itself (:func:`_refuse_source_read`)."""
    sources = _sources(xs)
    if not sources:
        return _traced_caches(fn, xs)
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch([watched for watched, _ in sources])
        result = _traced_caches(fn, xs)
    _refuse_source_read(tape, result[0], sources)
    return result


def _refuse_source_read(tape: Any, out: Any, sources: list[tuple[Any, Any]]) -> None:
    """Refused: an output of f that reads a variable of x itself rather than the tensor f is
    given for it (``model(data)`` where x is ``model.trainable_variables``). The tape
    differentiates the tensors, so that read would be a constant: a zero or partial
    derivative with no error."""
    outs = [y for y in tf.nest.flatten(out) if isinstance(y, tf.Tensor) and _inexact(y.dtype)]
    if not outs:
        return
    grads = tape.gradient(outs, [watched for watched, _ in sources])
    read = [variable for (_, variable), g in zip(sources, grads, strict=True) if g is not None]
    if read:
        raise InvalidOutputError(
            f"f reads the variables {names(read)} of x itself (model(data) where x is model.trainable_variables), "
            "not the tensors it is given for them. diffiface differentiates those tensors, so the read would "
            "add nothing to the derivative. Compute with f's argument: model.stateless_call(trainable, "
            "non_trainable, data) for a Keras model."
        )


def _traced_caches(fn: Fn, xs: Leaves) -> tuple[Any, Any]:
    """``fn(xs)`` under a call's tape, which :meth:`Adapter.untracked` knows of; on a prep's
    first call, refused where its output reads a Cache's variable that f wrote."""
    _tracing.tapes += 1
    try:
        caches = _tracing.caches
        if caches is None:
            return fn(xs)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(caches)
            result = fn(xs)
        _refuse_read_back(tape, result[0], caches, fn, xs)
        return result
    finally:
        _tracing.tapes -= 1


def _refuse_read_back(tape: Any, out: Any, caches: list[Any], fn: Fn, xs: Leaves) -> None:
    """Refused: an output of f that reads a Cache's variable into which f writes a value of x.
    TensorFlow records no derivative through ``assign``, so x's path through the variable would
    be lost. Where the output reads one, f is evaluated again at a point apart, unwatched: a
    variable whose value moves with x is such a path (a value f reads and does not write, or
    writes the same at any x, is a constant of f). Every variable of the Caches is then put back
    to its value at x, also where f raises there: f's writes at the point apart are no part of
    the call (a BatchNormalization's statistics, updated a second time). (Tapes are left recording: ``record.stop_recording`` would stop the tapes of
    f's own derivatives too, a gradient's inside an hvp, whose outputs would then read as cut.)"""
    outs = [y for y in tf.nest.flatten(out) if isinstance(y, tf.Tensor) and _inexact(y.dtype)]
    if not outs or not all(isinstance(x, _EAGER) for x in xs):
        return
    read = [variable for variable, g in zip(caches, tape.gradient(outs, caches), strict=True) if g is not None]
    if not read:
        return
    at_x = [_value(variable) for variable in read]
    scratch = _tracing.scratch
    kept = [_value(variable) for variable in scratch]
    tapes, _tracing.tapes, _tracing.caches = _tracing.tapes, 0, None  # (f evaluated unchecked, unwatched)
    try:
        fn(_apart(xs))
    finally:
        _tracing.tapes, _tracing.caches = tapes, caches
        moved = [not np.array_equal(_value(variable), old) for variable, old in zip(read, at_x, strict=True)]
        for variable, old in zip(scratch, kept, strict=True):
            if not np.array_equal(_value(variable), old, equal_nan=True):
                variable.assign(old)
    written = [variable for variable, m in zip(read, moved, strict=True) if m]
    if written:
        raise InvalidOutputError(
            f"f writes values of x into the variables {names(written)} of a di.Cache (variable.assign) and reads them "
            "back into its output. TensorFlow does not differentiate through an assign, so x's path through "
            "them would read as a constant: a wrong derivative. Keep the value in a tensor (y = 2 * x, not "
            "cache.assign(2 * x)); a Cache's variables may take values that f's output does not read."
        )


def _dense(grads: list[Any]) -> Leaves:
    """Gradients (or tangents) as dense tensors (a gather's gradient is a ``tf.IndexedSlices``)."""
    return tuple(g if isinstance(g, tf.Tensor) else tf.convert_to_tensor(g) for g in grads)


def _refuse_hidden_cuts(tape: Any, fn: Fn, xs: Leaves, outs: list[Any]) -> None:
    """:func:`_refuse_hidden_cut` for the output leaves from which this call's persistent tape
    leads to no leaf of x."""
    cut = [
        index
        for index, y in enumerate(outs)
        if _inexact(y.dtype) and all(g is None for g in tape.gradient(y, list(xs)))
    ]
    if cut:
        _refuse_hidden_cut(fn, xs, cut)


def _refuse_hidden_cut(fn: Fn, xs: Leaves, cut: list[int]) -> None:
    """Under another tape (the caller's, or an outer diffiface call's), an output that a tape
    records may still be cut from x: whether any tape records it (what :meth:`Adapter.untracked`
    asks) does not say this call's does (a caller's tape records what reads its variables). Where
    no gradient reached x from the output leaves at ``cut``, f is evaluated at x and at a point
    apart: refused where one of them moves (a cut), else its derivative is zero. Eager only (a
    graph's outputs are checked by their operations). (Tapes are left recording, as in
    :func:`_refuse_read_back`: an f that differentiates inside itself needs its own.)"""
    if not all(isinstance(x, _EAGER) for x in xs):
        return

    def value(move: float) -> list[Any]:
        outs = _base.as_tuple(fn(_apart(xs, move) if move else xs)[0])
        return [_arrays.by_kind(_arrays.kind(outs[i])).values(outs[i]) for i in cut]

    _base.refuse_a_moved_output(value, max(map(_arrays.resolution, xs), default=0.0), "tensorflow")


def _apart(xs: Leaves, move: float = 1e-3) -> Leaves:
    """A point apart from x, where f is evaluated again to tell a cut from a constant."""
    return tuple(x + tf.cast(move * (1 + tf.abs(x)), x.dtype) for x in xs)


def _inexact(dtype: Any) -> bool:
    """Whether values of a TensorFlow dtype carry derivatives: floating or complex ones."""
    return bool(dtype.is_floating or dtype.is_complex)


def _refuse_graph_cut(leaf: Any, xs: Leaves, missed: bool) -> None:
    """Inside a graph (``tf.function``), where f's output leaf would read as having a zero
    derivative though x reaches it: refused. That is a leaf the tape does not
    trace (``missed``) that the graph's operations lead to from x (``tf.stop_gradient`` of all
    of it), or any leaf that x reaches through a numpy function (``tf.numpy_function``, whose
    operation TensorFlow records and differentiates as zero). Else f does not depend on x there."""
    if not _inexact(leaf.dtype):
        return  # (an int output: the output checks name its dtype)
    sources = {x.ref() for x in xs if isinstance(x, tf.Tensor)}
    found = _from_sources([leaf], sources)
    if found is None or not (missed or any(_from_sources(op.inputs, sources) is not None for op in found)):
        return
    raise InvalidOutputError(
        "f's output depends on x through an operation TensorFlow does not differentiate "
        "(tf.numpy_function, or tf.stop_gradient of the whole output), so its derivative would read as "
        "zero. Keep the computation in differentiable TensorFlow operations from x to the output."
    )


_NUMPY_OPS = frozenset({"PyFunc", "PyFuncStateless"})
"""The graph operations of ``tf.numpy_function``: Python code on numpy values, not differentiated."""


def _from_sources(tensors: Any, sources: set[Any]) -> list[Any] | None:
    """Where the graph's operations lead from a tensor of ``sources`` to one of ``tensors``
    through inexact values (a path through an integer or a bool, ``argmax``, a comparison,
    carries no derivative: ``one_hot(argmax(x))`` is piecewise constant): the numpy functions on
    the way back from them (a list, maybe empty); else None."""
    seen: set[str] = set()
    stack = list(tensors)
    numpy_ops: list[Any] = []
    reached = False
    while stack:
        tensor = stack.pop()
        if tensor.ref() in sources:
            reached = True
            continue
        if not _inexact(tensor.dtype):
            continue
        op = tensor.op
        if op.name not in seen:
            seen.add(op.name)
            if op.type in _NUMPY_OPS:
                numpy_ops.append(op)
            stack.extend(op.inputs)
    return numpy_ops if reached else None
