"""mlx: ``mx.value_and_grad``, ``mx.vjp``, ``mx.jvp``, ``mx.vmap`` and ``mx.compile``.

f is called with ``mlx.core`` arrays; a numpy input becomes an mlx array of its own dtype
(float64 stays float64: mlx computes it on the CPU). A jvp of a real x is the adjoint of the
pullback (:func:`_pushed`); the hvp and the Hessian are reverse over reverse. Batches of products
(Jacobians, Hessians, batched jvps and vjps) are a loop of such products, not one ``mx.vmap`` of
them: mlx's vmap of a vjp through a write into a slice (``y[1:3] = ...``) leaves the overwritten
entries' cotangents in place, a wrong row with no error, where each vjp alone is right. Forward-mode
columns (a complex x's, :class:`_ByForwardMode`) are one vmap of ``mx.jvp``, which that write does not mislead.
"""

from __future__ import annotations

import contextlib
import io
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from .. import _arrays
from .._contexts import held
from .._errors import InvalidOutputError, MutationError, UnsupportedOperationError
from .._families.mlx import from_numpy, is_module, mlx_dtype, module_arrays, put_back
from . import _base
from ._base import Fn, Leaves


def _refuse_complex128(where: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"{where} is complex128, and mlx has complex64 only: its derivatives would silently lose half "
        "of the precision. Pass complex64 arrays (np.complex64) to the mlx backend, or use another "
        "engine (AutoJAX(), AutoTorch()) for complex128."
    )


def _pushed(outputs: Callable[..., list[Any]], primals: list[Any], tangents: list[Any]) -> Any:
    """``(outs, J t)`` for a real ``primals``: the adjoint of mlx's pullback (the vjp of
    ``u -> J^T u`` along ``t``), not ``mx.jvp``. mlx's forward mode differentiates a
    ``mx.custom_function``'s own operations and ignores its ``vjp`` rule (a stable softplus's
    derivative read NaN at 100 where its gradient read 1); through the pullback every product
    follows the rule the gradient follows. A complex ``primals`` or output takes ``mx.jvp`` (see
    :class:`_ByForwardMode`)."""
    outs = outputs(*_own(primals))  # (on arrays of its own: f may write into them)
    if any(mx.issubdtype(a.dtype, mx.complexfloating) for a in (*primals, *outs)):
        return mx.jvp(outputs, primals, tangents)
    zeros = [mx.zeros_like(y) for y in outs]

    def pulled(*cotangents: Any) -> list[Any]:
        return list(mx.vjp(outputs, primals, list(cotangents))[1])

    return outs, mx.vjp(pulled, zeros, tangents)[1]


def _refuse_missing_rule(exc: BaseException) -> None:
    """mlx's refusal of an operation it has no forward-mode (a scatter, ``mx.cumprod``,
    ``mx.conv1d``'s) or reverse-mode (``mx.linalg.inv``'s) rule for, by name: raised by mlx's
    transforms, outside f, it reaches :meth:`Adapter.explain_failure` through the program's
    call, which explains every failure of the engine's work."""
    text = str(exc)
    if isinstance(exc, ValueError) and "with respect to indices" in text:
        raise UnsupportedOperationError(
            f"mlx differentiated f through the indices of a gather ({text}): an index computed from x "
            "(mx.argsort(x), mx.argmax(x)) or inside an mlx operation (mx.linalg.solve's pivots). Wrap "
            "such indices in mx.stop_gradient where f computes them, or use another engine (AutoJAX(), "
            "AutoTorch())."
        ) from exc
    if not isinstance(exc, (RuntimeError, ValueError)) or "implemented" not in text.lower():
        return
    if "JVP" in text or "jvp" in text:
        raise UnsupportedOperationError(
            f"mlx has no forward-mode rule for an operation f uses ({text}), which a jvp, an hvp, a Hessian "
            "and a second derivative need. Differentiate f with another engine (AutoJAX(), AutoTorch()), or "
            "take its gradient with mlx and differentiate that with AutoFiniteDifferences()."
        ) from exc
    if "VJP" in text or "vjp" in text:
        raise UnsupportedOperationError(
            f"mlx has no reverse-mode rule for an operation f uses ({text}), which a gradient, a vjp and a "
            "Jacobian by rows need. Differentiate f with another engine (AutoJAX(), AutoTorch()), or "
            "with AutoFiniteDifferences()."
        ) from exc


def _own(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """x's leaves as arrays of f's own, where f runs on them outside a transform: an mlx array
    takes writes (``x[0] = v``), which on the caller's array object would change the caller's x
    (a transform gives f arrays of its own; so does this, without copying the data)."""
    return tuple(mx.array(leaf) for leaf in _mx(leaves))


def _mx(leaves: Sequence[Any]) -> list[Any]:
    """Leaves as mlx arrays (another part of diffiface may hand numpy ones: the real and
    imaginary parts of a complex x, say), each of its own dtype."""
    return [leaf if type(leaf) is mx.array else from_numpy(np.asarray(leaf), None, None) for leaf in leaves]


def _complex(xs: Sequence[Any]) -> bool:
    return any(mx.issubdtype(leaf.dtype, mx.complexfloating) for leaf in _mx(xs))


class _ByForwardMode:
    """The pullback of ``outputs`` at a complex ``xs`` as the adjoint of mlx's forward mode:
    mlx's vjp of a complex ``power`` (``z ** 2``) returns ``2 z`` times the cotangent where the
    convention's adjoint is ``conj(2 z)``, with no error, while its jvp is right. So f's output
    along each real direction of x (each entry's real and imaginary unit, ``J e``) comes from one
    vmapped jvp, and a cotangent ``u`` pulls back as ``Re<u, J e>`` per direction: one forward
    pass per real input, paid once per call, for any number of cotangents."""

    __slots__ = ("columns", "directions", "xs")

    def __init__(self, outputs: Callable[..., list[Any]], xs: Leaves) -> None:
        self.xs = tuple(_mx(xs))
        directions = []  # (leaf, flat index, unit) of each real direction
        for j, leaf in enumerate(self.xs):
            units = (1, 1j) if mx.issubdtype(leaf.dtype, mx.complexfloating) else (1,)
            directions += [(j, k, unit) for k in range(leaf.size) for unit in units]
        stacked = []
        for j, leaf in enumerate(self.xs):
            # (units, exact in any dtype: built in one numpy has, then cast to the leaf's, as
            # numpy has no bfloat16)
            complex_leaf = mx.issubdtype(leaf.dtype, mx.complexfloating)
            basis = np.zeros((len(directions), leaf.size), dtype=np.complex64 if complex_leaf else np.float32)
            for d, (i, k, unit) in enumerate(directions):
                if i == j:
                    basis[d, k] = unit
            stacked.append(mx.array(basis).astype(leaf.dtype).reshape((len(directions), *leaf.shape)))
        self.columns = mx.vmap(lambda *ts: list(mx.jvp(outputs, list(self.xs), list(ts))[1]))(*stacked)
        self.directions = directions

    def __call__(self, touts: Any) -> Leaves:
        us = _mx(_base.as_tuple(touts))
        # Re<u, J e> for every direction at once: (directions,)
        along = mx.zeros((len(self.directions),))
        for u, column in zip(us, self.columns, strict=True):
            along = along + mx.sum(mx.real(mx.conj(u) * column).reshape((column.shape[0], -1)), axis=1)
        grads = []
        start = 0
        for leaf in self.xs:
            if mx.issubdtype(leaf.dtype, mx.complexfloating):
                part = along[start : start + 2 * leaf.size].reshape((leaf.size, 2))
                grad = part[:, 0] + 1j * part[:, 1]
                start += 2 * leaf.size
            else:
                grad = along[start : start + leaf.size]
                start += leaf.size
            grads.append(grad.reshape(leaf.shape).astype(leaf.dtype))
        return tuple(grads)


class Adapter(_base.Adapter):
    xp = mx
    complex_reverse_mode = False  # (see _ByForwardMode)
    retracing_option = "compile"  # (mx.compile traces anew for each shape and dtype)

    # -- conversions -------------------------------------------------------------------------------

    def to_native(self, leaf: Any) -> Any:
        kind = _arrays.kind(leaf)
        if kind == "python":
            if isinstance(leaf, complex):
                raise _refuse_complex128("A Python complex number (complex128)")
            return mx.array(leaf, dtype=mx.float64)
        if kind == "numpy":
            array = np.asarray(leaf)
            if array.dtype == np.complex128:
                raise _refuse_complex128("A numpy array")
            # (mx.array of a float64 numpy array without a dtype makes it float32, silently)
            return mx.array(_arrays.in_native_byte_order(array), dtype=mlx_dtype(array.dtype))
        return leaf

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        kind = _arrays.kind(leaf)
        if kind == "mlx":
            return leaf, True
        if isinstance(leaf, np.generic) and leaf.dtype.kind in "biufc":
            # a numpy scalar (data.std()) as a 0-d array: its own product with an mx.array would
            # read the array's values through numpy, cut from x (a zero gradient)
            leaf, kind = np.asarray(leaf), "numpy"
        if kind == "numpy" and isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biufc":
            if leaf.dtype == np.complex128:
                raise _refuse_complex128("A context's numpy array")
            return mx.array(_arrays.in_native_byte_order(leaf), dtype=mlx_dtype(leaf.dtype)), True
        # Python numbers, strings and the rest: constants of a compiled program, one per value
        return leaf, False

    def constant_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        native, is_array = self.context_to_native(leaf, like)
        if native is leaf and is_array and not self.compiles:
            # f gets an array of its own: an item assignment (c[0] = v) rebinds the array f
            # holds, never the caller's (under mx.compile f sees the compiler's placeholders)
            return mx.stop_gradient(leaf), True
        return native, is_array

    def trace_value(self, leaf: Any, xs: Leaves) -> str | None:
        # (under mx.compile f's arrays are the compiler's placeholders, without values)
        return "an mlx array of mx.compile's trace" if self.compiles and isinstance(leaf, mx.array) else None

    def untracked(self, leaf: Any, xs: Leaves) -> bool:
        """An output leaf that is no mx.array where x is one: f left mlx (a numpy scalar's
        product with an mx.array reads the array's values through numpy), so the result is a
        constant to mlx, whose derivative would read as zero; the route tells a cut from an f
        that does not depend on x by evaluating f elsewhere. (Under mx.compile f's arrays have
        no values: a numpy function on them is refused as it runs.)"""
        if _CHECKING.own is not None and isinstance(leaf, mx.array):  # (a program's first call only)
            _refuse_a_read_of_x_itself(leaf, xs)
        return not self.compiles and bool(xs) and not isinstance(leaf, mx.array)

    def output_leaf(self, leaf: Any, like: Any) -> Any:
        kind = _arrays.kind(leaf)
        if kind == "python":
            if isinstance(leaf, complex):
                return mx.array(leaf, dtype=mx.complex64)
            return mx.array(leaf, dtype=getattr(like, "dtype", mx.float32))
        if kind == "numpy":
            return from_numpy(np.asarray(leaf), None, None)
        return leaf

    # -- float64 on the CPU ---------------------------------------------------------------------

    @property
    def scoped(self) -> bool:
        return mx.default_device() != mx.cpu

    def scope(self) -> contextlib.AbstractContextManager[Any] | None:
        """float64 exists on mlx's CPU only: where the default device is a GPU, float64 work
        runs on a CPU stream."""
        if mx.default_device() != mx.cpu:
            return mx.stream(mx.cpu)  # type: ignore[no-any-return]
        return None

    # -- compilation ----------------------------------------------------------------------------------

    def returns_like(self, leaf: Any) -> bool:
        return self.compiles and isinstance(leaf, mx.array)

    def compile(
        self,
        program: Callable[..., Any],
        static: bool = True,
        arrays: bool = False,
        layouts: Any = None,
        parts: Any = None,
    ) -> Callable[..., Any]:
        if parts is not None and any(parts.x_arrays):
            program = _FirstCallChecked(program, parts.x_arrays)
        if not self.compiles:
            watched = () if parts is None else tuple(not cache for cache in parts.cache_static)
            return _ModuleWatch(program, watched) if static and any(watched) else program
        if not static:  # every argument an array, a tuple of arrays, or None
            return mx.compile(program)  # type: ignore[no-any-return]
        # the static argument (the context leaves that are no arrays) is no tree mx.compile
        # takes: one compiled program per value of it, that value closed over
        programs: dict[Any, Callable[..., Any]] = {}

        def run(xs: Any, ts: Any, dynamic: Any, constants: Any) -> Any:
            compiled = programs.get(constants)
            if compiled is None:

                def with_constants(xs_: Any, ts_: Any, dynamic_: Any) -> Any:
                    return program(xs_, ts_, dynamic_, constants)

                compiled = programs.setdefault(constants, mx.compile(with_constants))
            return compiled(xs, ts, dynamic)

        return run

    def explain_failure(self, exc: BaseException) -> str | None:
        _refuse_missing_rule(exc)
        # (mlx's C++ core raises this with no Python frame of its own: its words tell it)
        if isinstance(exc, ValueError) and str(exc).startswith("[eval] Attempting to eval an array during"):
            return (
                "f reads the value of an array mlx traces (a numpy function or np.asarray on it, "
                "float(), .item(), or Python control flow on it) inside mlx's transformations. Write "
                "f with mlx.core operations (mx.where for branches), or differentiate a numpy f with "
                "AutoFiniteDifferences() or AutoAutograd()."
            )
        if _base.numpy_handed_its_method(exc, mx.array):
            return (
                "f calls numpy on mlx arrays (np.sum(x), np.mean(x)). Write f with mlx.core operations, or "
                "differentiate a numpy f with AutoFiniteDifferences() or AutoAutograd()."
            )
        if isinstance(exc, (TypeError, ValueError)) and _base.handed_to_another_framework(exc):
            return (
                "f handed an mlx array to a function of another framework (torch, jax); differentiate "
                "such a function with its own engine, or any function with AutoFiniteDifferences()."
            )
        return None

    # -- primitives ----------------------------------------------------------------------------------

    def _outputs(self, fn: Fn, captured: list[Any] | None = None) -> Callable[..., list[Any]]:
        """f's output as mlx's transformations take it: the primals positional, a list of
        arrays out; f's aux, if asked, kept in ``captured``."""

        def outputs(*primals: Any) -> list[Any]:
            out, aux = fn(primals)
            if captured is not None:
                captured[:] = [out, aux]
            return list(_base.as_tuple(out))

        return outputs

    def pullback_function(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
        out, aux = fn(_own(xs))
        outputs = self._outputs(fn)
        if _complex(xs) or _complex(_base.as_tuple(out)):  # (a complex output's cotangents too)
            return out, aux, _ByForwardMode(outputs, xs)

        def vjp(touts: Any) -> Leaves:  # (mlx's vjp takes its cotangents with the primal: one per call)
            return tuple(mx.vjp(outputs, _mx(xs), _mx(_base.as_tuple(touts)))[1])

        return out, aux, vjp

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        captured: list[Any] = []
        _, touts = _pushed(self._outputs(fn, captured), _mx(xs), _mx(txs))
        out, aux = captured
        return out, aux, _base.shaped_as(out, tuple(touts))

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        if _complex(xs):  # (mlx's reverse mode of a complex x: see _ByForwardMode)
            return super().value_and_gradient(fn, xs)
        captured: list[Any] = []

        def scalar(primals: list[Any]) -> Any:
            value, aux = fn(tuple(primals))
            captured[:] = [aux]
            return value

        # (x's leaves as one list argument: its gradient is a list of any length)
        value, grads = mx.value_and_grad(scalar)(_mx(xs))
        return value, captured[0], tuple(grads)

    def value_and_jacobian(self, fn: Fn, xs: Leaves, mode: str | None = None) -> tuple[Any, Any, Any]:
        """By rows (mlx's reverse mode), or with ``mode="forward"`` by columns of mlx's own
        forward mode, as the complex layer asks for a complex x (see :class:`_ByForwardMode`)."""
        if mode != "forward":
            return super().value_and_jacobian(fn, xs, mode)
        out, aux = fn(_own(xs))
        pushed = _ByForwardMode(self._outputs(fn), xs)  # (x is real here: a column per entry)
        blocks = []
        for y, column in zip(_base.as_tuple(out), pushed.columns, strict=True):  # column: (n, *y.shape)
            moved = mx.moveaxis(column, 0, -1)  # (*y.shape, n)
            row, start = [], 0
            for leaf in pushed.xs:
                row.append(moved[..., start : start + leaf.size].reshape((*y.shape, *leaf.shape)))
                start += leaf.size
            blocks.append(tuple(row))
        return out, aux, tuple(blocks)

    # -- second order: reverse over reverse for a real x ------------------------------------------
    # (the gradient's pullback along a tangent is the Hessian's product, the Hessian being
    # symmetric: two reverse passes, where forward over reverse takes three through _pushed)

    gradient_and_hvp = _base.hvp_as_a_batch

    def gradient_and_hvps(self, fn: Fn, xs: Leaves, batch: Sequence[Leaves]) -> tuple[Any, Any, Leaves, list[Leaves]]:
        return _base.hvps_of(self, self, fn, xs, batch, reverse=not _complex(xs))

    def value_gradient_and_hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves, Any]:
        return _base.hessian_of(self, self, fn, xs, "forward" if _complex(xs) else "reverse")


class _Checking(threading.local):
    own: tuple[Any, ...] | None = None  # x's own arrays, less those f is given, while checked
    first: Any = None  # the leaves f got in the first evaluation checked


_CHECKING = _Checking()


class _FirstCallChecked:
    """A program whose first call (under ``compile=True``, mx.compile's trace of it: its one run
    of f) checks the output of f's first evaluation for a read of x's own arrays, the caller's
    (:func:`_refuse_a_read_of_x_itself`); later calls check nothing, at the cost of an
    attribute test each. (The check is on f's code, which a prep keeps: a prep's first call,
    as jax checks each trace of jit.)"""

    __slots__ = ("first", "program", "x_arrays")

    def __init__(self, program: Callable[..., Any], x_arrays: tuple[Any, ...]) -> None:
        self.program = program
        self.x_arrays = x_arrays
        self.first = True

    def __call__(self, *args: Any) -> Any:
        if not self.first and _CHECKING.own is None:  # (the common call: nothing to check or hide)
            return self.program(*args)
        own = None
        if self.first:
            dynamic = args[2] if len(args) > 2 and isinstance(args[2], (tuple, list)) else ()
            given = {id(leaf) for leaf in dynamic}  # (an array of x in a context is f's to read)
            found = (ref() for ref in self.x_arrays if ref is not None)
            own = tuple(x for x in found if isinstance(x, mx.array) and id(x) not in given)
        before = (_CHECKING.own, _CHECKING.first)
        _CHECKING.own, _CHECKING.first = own or None, None  # (a program called inside checks its own x)
        try:
            result = self.program(*args)
        finally:
            _CHECKING.own, _CHECKING.first = before
        self.first = False  # (after a call that returns: a refused one is refused again)
        return result


_READ = re.compile(r'^"(\w+)" -> (\d+)$', re.MULTILINE)  # (an array an operation reads)
_MADE = re.compile(r'^(\d+) -> "(\w+)"$', re.MULTILINE)  # (an array an operation makes)
_LABEL = re.compile(r'^\{ (\d+) \[label ="(\w+)"', re.MULTILINE)


def _refuse_a_read_of_x_itself(leaf: Any, xs: Leaves) -> None:
    """Refused: an output leaf of f whose graph (mlx's, as ``mx.export_to_dot`` writes it) does
    not reach the leaves f is given for x but reads one of x's own arrays (``model(data)``
    where x is ``model.trainable_parameters()``): mlx differentiates the leaves f is given, so
    the derivative through that read would be zero, with no error. A read through
    ``mx.stop_gradient`` (a Constant's array, or f's own choice) is no such read; an output
    mlx has already evaluated shows no graph, and passes. Only f's first evaluation checked."""
    if _CHECKING.first is None:
        _CHECKING.first = xs
    if _CHECKING.first is not xs or any(leaf is x for x in xs):
        return
    own = _CHECKING.own or ()
    names = {f"xs{i}": x for i, x in enumerate(xs) if isinstance(x, mx.array)}
    names.update((f"own{i}", x) for i, x in enumerate(own) if not any(x is y for y in xs))
    text = io.StringIO()
    mx.export_to_dot(text, leaf, out=leaf, **names)  # (the named arrays' own graphs come with it)
    graph = text.getvalue()
    reads: dict[str, list[str]] = {}
    for array, node in _READ.findall(graph):
        reads.setdefault(node, []).append(array)
    made = {array: node for node, array in _MADE.findall(graph)}
    labels = dict(_LABEL.findall(graph))
    found, seen, stack = [], set(), ["out"]  # (the output's graph, back from it)
    while stack:
        node = made.get(stack.pop())
        if node is None or node in seen:
            continue
        seen.add(node)
        for array in reads.get(node, ()):
            if array.startswith("xs"):
                return  # (the output depends on x: its derivative is mlx's, whatever else f reads)
            if array.startswith("own") and labels.get(node) != "StopGradient":
                found.append(array)
            stack.append(array)
    if found:
        raise InvalidOutputError(
            "f reads the arrays of x itself (a model it closes over, model(data), where x is "
            "model.trainable_parameters()), not the arrays it is given for them: diffiface differentiates "
            "those, so the derivative through that read would be zero. Compute with f's argument: "
            "model.update(params) before model(data), or a function of the parameters."
        )


class _ModuleWatch:
    """An eager program (``compile=False``) around whose calls the ``mlx.nn`` modules of the
    Constants (or that an object in a Constant holds: :func:`~diffiface._contexts.held`) are
    watched, every array they hold (parameters and state), which f reaches as it is. f writes
    into a module by setting an attribute (``module.weight = ...``; a BatchNorm in train mode sets
    its running statistics so), which replaces the array object: each call compares the objects,
    puts the old ones back and refuses with a :class:`MutationError` naming them. A write into an
    array's elements (``module.weight[0] = v``) keeps the object: a prep's first call compares
    the values too. (Under ``compile=True`` a module is refused as a Constant.)"""

    __slots__ = ("first", "program", "watched")

    def __init__(self, program: Callable[..., Any], watched: tuple[bool, ...]) -> None:
        self.program = program
        self.watched = watched  # per static context leaf: a Constant's (a Cache's is f's to write)
        self.first = True

    def __call__(self, xs: Any, ts: Any, dynamic: Any, static: Any) -> Any:
        pairs = () if static is None else zip(static.leaves, self.watched, strict=True)
        modules = [module for leaf, constant in pairs if constant for module in held(leaf, is_module)]
        if not modules:
            return self.program(xs, ts, dynamic, static)
        kept = [module_arrays(module) for module in modules]
        copies = [[(path, mx.array(array)) for path, array in pairs] for pairs in kept] if self.first else None
        try:
            result = self.program(xs, ts, dynamic, static)
        finally:
            written = put_back(modules, kept, copies)
        if written:
            raise MutationError(
                f"f wrote into {', '.join(written)} of an mlx.nn module in a di.Constant (a BatchNorm in "
                "train mode sets its running statistics); they are put back. Call the module in eval mode "
                "(module.eval()), or return the new state as an aux (has_aux=True) and pass it as a di.Cache."
            )
        self.first = False
        return result
