"""pytensor: ``pytensor.gradient`` (grad, pullback, pushforward, jacobian) on a symbolic graph,
compiled by ``pytensor.function``.

Every operator is one compiled function. At preparation the program is traced: ``f`` is
called once on symbolic variables of the shapes and dtypes of x's leaves, of the tangent's and
of the context arrays (numpy scalars included; other context leaves, Python numbers too, are
static, compared by value, one compiled function per value); the graph of the operator's
results is then compiled with the backend's mode, and later calls run it on numpy arrays
(:meth:`Adapter.compile`).

Forward mode is pytensor's own pushforward, two pullbacks (exact, and it needs no ``R_op`` of
every operation); the hvp is reverse over reverse, as ``pytensor.gradient.hessian_vector_product``.
Complex numbers are refused: pytensor's gradients of complex graphs are not those of any
convention diffiface keeps.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import optree
import pytensor
import pytensor.tensor as pt
from pytensor.gradient import grad, jacobian, pullback, pushforward
from pytensor.graph.basic import Variable
from pytensor.graph.traversal import ancestors
from pytensor.tensor.type import TensorType
from pytensor.tensor.variable import TensorVariable

from .. import _arrays
from .. import tree as _tree
from .._errors import DiffifaceError, FrameworkMismatchError, MutationError, UnsupportedOperationError
from .._flatten import structure_unflatten
from . import _base
from ._base import Blocks, Fn, Leaves

_function: Callable[..., Any] = pytensor.function  # type: ignore[attr-defined]

_LOCK = threading.RLock()
"""Held while a graph is built, differentiated and compiled (pytensor's graph rewriting and
compilation cache are not thread-safe; reentrant: f may call diffiface inside itself)."""


class _Known(TensorVariable):  # type: ignore[misc,type-arg]
    """A cotangent's symbolic variable whose ``shape`` is its static shape, as a tuple of ints:
    diffiface checks a cotangent's shape against f(x)'s while the program is traced."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.type.shape)


def _array_ufunc(self: Any, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
    # numpy's elementwise functions and operators on this variable as PyTensor's own: an
    # operator (a numpy matrix A @ x, A * x) as the variable's, np.sin(x) as pt.sin
    if method == "__call__" and not kwargs:
        symbolic = [
            pt.as_tensor_variable(value) if isinstance(value, (np.ndarray, np.generic)) else value for value in inputs
        ]
        operator_ = _NUMPY_OPERATORS.get(ufunc)
        if operator_ is not None:
            return operator_(*symbolic)
        same = getattr(pt, ufunc.__name__, None)
        if same is not None:
            return same(*symbolic)
    # (numpy would compute anything else on each variable as one object, or fail deep inside)
    call = f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
    if kwargs.get("out") is not None:
        why = f"{call}(..., out=...) writes numpy's result into an array, which cannot hold PyTensor's symbolic one"
    elif method != "__call__" or kwargs:
        why = f"{call} with {', '.join(kwargs) or 'this method'} has no PyTensor operation to stand for it"
    else:
        why = f"{call} has no PyTensor operation of that name"
    raise FrameworkMismatchError(
        f"f failed under the pytensor backend: {why}. Write f with pytensor.tensor operations "
        "(pt.cumsum, pt.sqrt(a**2 + b**2), out of place), or differentiate a numpy f with AutoFiniteDifferences()."
    )


def _no_array(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise FrameworkMismatchError(
        "f failed under the pytensor backend: f handed one of pytensor's symbolic variables to a "
        "numpy function (np.linalg.norm(x), np.asarray(x)), which would take it for one number. "
        "Write f with pytensor.tensor operations (pt.linalg.norm, pt.sum), or differentiate a numpy f "
        "with AutoFiniteDifferences()."
    )


@contextlib.contextmanager
def _numpy_guarded() -> Iterator[None]:
    """While f is traced (under ``_LOCK``): every TensorVariable, x's and those f derives from
    it (``2 * x``, ``x - mu``), takes numpy's elementwise functions as PyTensor's and refuses
    to become a numpy array. numpy would otherwise take it for one object in a 0-d array and
    compute something else (``np.linalg.norm(2 * x)``, the absolute value of each entry) out of
    PyTensor's operations on it, whose derivative is not f's."""
    saved = {name: TensorVariable.__dict__.get(name) for name in ("__array__", "__array_ufunc__")}
    setattr(TensorVariable, "__array__", _no_array)  # noqa: B010  # (no such attribute to type)
    setattr(TensorVariable, "__array_ufunc__", _array_ufunc)  # noqa: B010
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(TensorVariable, name)
            else:
                setattr(TensorVariable, name, value)


_NUMPY_OPERATORS: dict[Any, Callable[..., Any]] = {
    np.add: operator.add,
    np.subtract: operator.sub,
    np.multiply: operator.mul,
    np.true_divide: operator.truediv,
    np.floor_divide: operator.floordiv,
    np.remainder: operator.mod,
    np.power: operator.pow,
    np.matmul: operator.matmul,
    np.negative: operator.neg,
    np.positive: operator.pos,
    np.absolute: operator.abs,
    np.less: operator.lt,
    np.less_equal: operator.le,
    np.greater: operator.gt,
    np.greater_equal: operator.ge,
}
"""numpy's ufuncs behind Python's operators, which a numpy array on the left hands to them."""


def _refuse_complex(where: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"The pytensor backend does not differentiate complex numbers ({where} is complex): pytensor's "
        "gradients of complex graphs follow no convention diffiface keeps. Split the complex numbers "
        "into real and imaginary parts, or use AutoJAX() or AutoTorch()."
    )


def _refuse_complex_graph(leaf: Any) -> None:
    """f's output refused where a complex number lies on its graph (a complex constant, an
    ``exp(1j * x)`` on the way): pytensor's gradients through complex operations follow no
    convention diffiface keeps, and some read as zero. Traced once per program, so the walk of
    the graph costs nothing on a call."""
    for variable in ancestors([leaf]):
        if str(getattr(variable, "dtype", "")).startswith("complex"):
            raise _refuse_complex("a value f computes")


def _variable(value: Any, known: bool = False) -> Any:
    """A symbolic input of ``value``'s static shape and dtype."""
    array = np.asarray(value)
    if array.dtype.kind == "c":
        raise _refuse_complex("an input")
    kind = TensorType(dtype=str(_arrays.native_dtype(array.dtype)), shape=array.shape)
    return _Known(kind, None) if known else TensorVariable(kind, None)


def _contiguous(array: np.ndarray) -> np.ndarray:
    """``array`` itself where it is C-contiguous, else a C-contiguous copy (0-d stays 0-d)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


def _symbolic(xs: Sequence[Any]) -> bool:
    """Whether the leaves are traced variables (x has leaves: an empty x never reaches the adapter)."""
    return isinstance(xs[0], Variable)


_Compiled = tuple[Any, Callable[[Any], Any] | None, Any]
"""One compiled program: the pytensor function, how to rebuild the program's result from its
outputs (None: its one output is the result) and the function's lock."""


def _rebuild(spec: Any, leaves: list[Any]) -> Callable[[Any], Any] | None:
    """How to rebuild a result of structure ``spec`` and these leaves (symbolic where the
    compiled function computes them) from the function's outputs, in order."""
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Variable)]
    if spec.num_leaves == 1 and spec.num_nodes == 1 and len(positions) == 1:
        return None  # (one output not in a list: the compiled function returns the array itself)
    if len(positions) == len(leaves):
        return structure_unflatten(spec) or spec.unflatten
    kept = [None if isinstance(leaf, Variable) else leaf for leaf in leaves]

    def rebuild(outs: Any) -> Any:
        filled = list(kept)
        for position, out in zip(positions, outs, strict=True):
            filled[position] = out
        return spec.unflatten(filled)

    return rebuild


def _compiled(inputs: list[Any], result: Any, mode: Any) -> tuple[Any, Callable[[Any], Any] | None]:
    """A pytensor function of ``inputs`` that computes the symbolic leaves of ``result``, and how
    to rebuild ``result`` from its outputs (:func:`_rebuild`)."""
    leaves, spec = optree.tree_flatten(result)
    rebuild = _rebuild(spec, leaves)
    outputs = [leaf for leaf in leaves if isinstance(leaf, Variable)]
    return _function(
        inputs, outputs if rebuild is not None else outputs[0], mode=mode, on_unused_input="ignore"
    ), rebuild


class Adapter(_base.Adapter):
    xp = pt
    compiles = True

    def __init__(self, backend: Any, info: Any) -> None:
        super().__init__(backend, info)
        self.mode = backend.mode
        self._local = threading.local()

    # -- conversions -------------------------------------------------------------------------------

    def to_native(self, leaf: Any) -> Any:
        if isinstance(leaf, complex) or getattr(getattr(leaf, "dtype", None), "kind", "") == "c":
            raise _refuse_complex("x or a tangent")
        if isinstance(leaf, (np.ndarray, np.generic)):
            # (C-contiguous, in this machine's byte order: the array itself where it is one, as
            # the compiled function's code is specialised for the layout it first meets)
            return _contiguous(_arrays.in_native_byte_order(np.asarray(leaf)))
        if _arrays.kind(leaf) == "python":
            return np.asarray(leaf, dtype=np.float64)
        return leaf

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        if isinstance(leaf, np.ndarray):
            if leaf.dtype.kind == "c":
                raise _refuse_complex("a context array")
            # (numeric arrays are arguments of the compiled function; others stay static)
            return _contiguous(_arrays.in_native_byte_order(leaf)), leaf.dtype.kind in "biuf"
        if isinstance(leaf, np.generic) and leaf.dtype.kind in "biuf":
            return np.asarray(leaf), True
        # A Python number stays one, static, compared by value (one compiled function per
        # value): f's own arithmetic on it is Python's (a variable of x's dtype made first
        # rounds it: 1000000.1 - 1e6 is 0.125 in float32). A numpy scalar is an argument.
        return leaf, False

    constant_to_native = context_to_native  # (f sees a Constant's arrays as symbolic variables: nothing to write into)

    def trace_value(self, leaf: Any, xs: Leaves) -> str | None:
        return f"a symbolic pytensor {type(leaf).__name__}" if isinstance(leaf, Variable) else None

    def output_leaf(self, leaf: Any, like: Any) -> Any:
        if isinstance(leaf, Variable):
            _refuse_complex_graph(leaf)
            return leaf
        if _arrays.kind(leaf) == "python":
            return pt.as_tensor_variable(np.asarray(leaf, dtype=getattr(like, "dtype", "float64")))
        return pt.as_tensor_variable(np.asarray(leaf))

    def output_values(self, leaf: Any) -> Any:  # type: ignore[override]
        """A symbolic output leaf as an array of its shape and dtype (zeros, never read), which
        diffiface checks and records as f's output."""
        if not isinstance(leaf, Variable):
            if (
                isinstance(leaf, np.ndarray)
                and leaf.dtype == object
                and any(isinstance(v, Variable) for v in leaf.flat)
            ):
                raise FrameworkMismatchError(
                    "f failed under the pytensor backend: f handed pytensor's symbolic variables to a numpy "
                    "function, which made an array of objects. Write f with pytensor.tensor operations, or "
                    "differentiate a numpy f with AutoFiniteDifferences()."
                )
            return leaf
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not isinstance(leaf, TensorVariable):
            return leaf  # (not a tensor: refused by the output check, which names its type)
        if str(dtype).startswith("complex"):
            raise _refuse_complex("f's output")
        shape = tuple(leaf.type.shape)
        if None in shape:
            shape = self._evaluated_shape(leaf)
        return np.broadcast_to(np.zeros((), dtype=dtype), shape)

    def concrete(self, out: Any) -> Any:
        """f given numpy arrays builds a graph of constants: its symbolic leaves evaluated (one
        compilation each)."""
        return _tree.map(lambda leaf: leaf.eval() if isinstance(leaf, Variable) else leaf, out)

    def _evaluated_shape(self, leaf: Any) -> tuple[int, ...]:
        """The shape of an output whose static shape pytensor does not infer, evaluated at the
        point being traced."""
        givens: dict[Any, Any] = getattr(self._local, "givens", None) or {}
        shape_of = _function(list(givens), leaf.shape, mode="FAST_COMPILE", on_unused_input="ignore")
        return tuple(int(n) for n in shape_of(*givens.values()))

    def explain_failure(self, exc: BaseException) -> str | None:
        if isinstance(exc, DiffifaceError):
            return None
        if type(exc) is ValueError and str(exc).endswith("read-only"):
            raise MutationError(
                f"f wrote into an array it was given ({exc!s}); under the pytensor backend f builds a "
                "symbolic graph: compute out of place (pytensor.tensor.set_subtensor)."
            ) from exc
        if type(exc).__name__ == "NullTypeGradError" and _base.raised_inside(exc, "pytensor"):
            raise UnsupportedOperationError(
                f"PyTensor has no derivative of an operation f uses, or of its derivative ({exc!s}). A jvp "
                "and a derivative here are two pullbacks, and an hvp and a Hessian differentiate the "
                "gradient, so they need the gradient's own derivative (pt.prod's has none): take the "
                "Jacobian, whose rows are plain gradients, or use another backend."
            ) from exc
        if type(exc).__name__ == "MissingInputError" and _base.raised_inside(exc, "pytensor"):
            return (
                "f evaluated a symbolic variable (.eval() on x, on a context array or on a value made "
                "from them). Under the pytensor backend they have no values while f runs: f builds a "
                "graph, which diffiface compiles and evaluates. Keep f symbolic (pytensor.tensor "
                "operations on its arguments), or differentiate a numpy f with AutoFiniteDifferences()."
            )
        if isinstance(exc, TypeError) and "TensorVariable" in str(exc) and "bool" in str(exc):
            return (
                "f uses the value of x (or of a context array or float) in Python control flow (if, "
                "while, bool()). Under the pytensor backend they are symbolic variables: use "
                "pytensor.tensor.switch or pytensor.ifelse.ifelse, or pass a value that must stay a "
                "Python value as an int or a string."
            )
        if type(exc) is ValueError and _base.raised_inside(exc, "pytensor.link"):  # (a compiled graph's run)
            raise UnsupportedOperationError(
                f"PyTensor's compiled graph of f failed on this call's values ({exc!s}). A graph that served "
                "another x and fails at this one most often has an output whose shape depends on x's "
                "values (x[x > 0], nonzero): a compiled graph, traced once, checks a cotangent against "
                "the output's shape at its trace only. Give f outputs whose shapes x's shape fixes "
                "(pytensor.tensor.switch in place of the selection), or use another backend."
            ) from exc
        if type(exc) is NotImplementedError and _base.raised_inside(exc, "numba"):  # (numba compiles on a first call)
            raise UnsupportedOperationError(
                f"PyTensor's numba backend, the linker of AutoPyTensor's mode 'FAST_RUN' (the default) and "
                f"'NUMBA', cannot compile the graph of f ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                "numba has no float16, for one. Compute in float32 or float64, or use "
                "AutoPyTensor(mode='CVM') or AutoPyTensor(mode='FAST_COMPILE'), which do without numba."
            ) from exc
        if isinstance(exc, (TypeError, ValueError, AttributeError, NotImplementedError)) and (
            _base.raised_inside(exc, "numpy") or _base.raised_inside(exc, "pytensor")
        ):
            return (
                f"f failed while pytensor built its graph ({type(exc).__name__}: {exc}). Under the pytensor "
                "backend f is called with symbolic variables: write it with pytensor.tensor operations "
                "(pt.sum, pt.exp, pt.switch), not numpy functions or in-place writes; differentiate a "
                "numpy f with AutoFiniteDifferences()."
            )
        if _base.handed_to_another_framework(exc):
            return (
                "f handed a pytensor symbolic variable to another framework. Write f with "
                "pytensor.tensor operations, or differentiate it with AutoFiniteDifferences()."
            )
        return None

    # -- compilation -------------------------------------------------------------------------------

    def compile(
        self,
        program: Callable[..., Any],
        static: bool = True,
        arrays: bool = False,
        layouts: Any = None,
        parts: Any = None,
    ) -> Callable[..., Any]:
        compiled: dict[Any, _Compiled] = {}
        trace = self._trace

        # A compiled function keeps its arguments and outputs in storage of its own between
        # setting and reading them: two threads calling it at once would take each other's
        # values (wrong results, no error). Each call holds the function's lock.
        def run(xs: Leaves, ts: Leaves, dynamic: Leaves, static_part: Any) -> Any:
            key = static_part if static else None
            found = compiled.get(key)
            if found is None:
                found = compiled[key] = trace(program, xs, ts, dynamic, static_part)
            function, rebuild, lock = found
            lock.acquire()
            try:
                outs = function(*xs, *ts, *dynamic)
            finally:
                lock.release()
            return outs if rebuild is None else rebuild(outs)

        return run

    def _trace(
        self, program: Callable[..., Any], xs: Leaves, ts: Leaves, dynamic: Leaves, static_part: Any
    ) -> _Compiled:
        """Trace ``program`` on symbolic variables of its arguments and compile its result."""
        with _LOCK:
            values = [*xs, *ts, *dynamic]
            n, m = len(xs), len(xs) + len(ts)  # (the cotangents: values[n:m])
            variables = [_variable(v, known=n <= i < m) for i, v in enumerate(values)]
            before = getattr(self._local, "givens", None)
            self._local.givens = dict(zip(variables, values, strict=True))
            try:
                with _numpy_guarded():
                    result = program(tuple(variables[:n]), tuple(variables[n:m]), tuple(variables[m:]), static_part)
            finally:
                self._local.givens = before
            function, rebuild = _compiled(variables, result, self.mode)
            # No check of the arguments in the call: each is a numpy array of the shape and dtype
            # traced, a leaf whose type, shape and dtype the plan checked (in any strides, which
            # the compiled code reads) or one this adapter made (to_native, context_to_native).
            function.trust_input = True
            return function, rebuild, threading.Lock()

    # -- eager calls: outside a compiled program (a second-order pair with another engine) --------

    def _eager(self, method: str, fn: Fn, xs: Leaves, *rest: Any) -> Any:
        """``method`` on concrete arrays: traced on symbolic variables, compiled and run once."""
        with _LOCK:
            values = [np.asarray(x) for x in xs]
            variables = [_variable(v) for v in values]
            extra_leaves, extra_spec = optree.tree_flatten(rest)  # type: ignore[arg-type,var-annotated]
            extra_values = [np.asarray(v) for v in extra_leaves]
            extra_variables = [_variable(v) for v in extra_values]
            symbolic_rest = optree.tree_unflatten(extra_spec, extra_variables)
            with _numpy_guarded():
                result = getattr(self, method)(fn, tuple(variables), *symbolic_rest)
            function, rebuild = _compiled([*variables, *extra_variables], result, "FAST_COMPILE")
            outs = function(*values, *extra_values)
            return outs if rebuild is None else rebuild(outs)

    # -- primitives (on symbolic variables, inside a traced program) -------------------------------

    def pullback_function(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
        if not _symbolic(xs):
            out, aux = self._eager("_value", fn, xs)
            return out, aux, lambda touts: self._eager("value_and_pullback", fn, xs, touts)[2]
        out, aux = fn(xs)
        outs = _base.as_tuple(out)

        def vjp(touts: Any) -> Leaves:
            cotangents = [pt.cast(t, y.dtype) for t, y in zip(_base.as_tuple(touts), outs, strict=True)]
            if not outs:
                return tuple(pt.zeros_like(x) for x in xs)
            grads = pullback(list(outs), list(xs), cotangents, disconnected_inputs="ignore", return_disconnected="zero")
            return tuple(grads)  # type: ignore[arg-type]  # (a list of variables: typed as any result of pullback)

        return out, aux, vjp

    def _value(self, fn: Fn, xs: Leaves) -> tuple[Any, Any]:
        return fn(xs)

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        if not _symbolic(xs):
            return self._eager("value_and_pushforward", fn, xs, txs)  # type: ignore[no-any-return]
        out, aux = fn(xs)
        outs = _base.as_tuple(out)
        if not outs:
            return out, aux, ()
        tangents = [pt.cast(t, x.dtype) for t, x in zip(txs, xs, strict=True)]
        found = pushforward(list(outs), list(xs), tangents, disconnected_outputs="ignore", return_disconnected="zero")
        touts = [pt.cast(t, y.dtype) for t, y in zip(found, outs, strict=True)]  # type: ignore[arg-type]
        return out, aux, _base.shaped_as(out, tuple(touts))

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        if not _symbolic(xs):
            return self._eager("value_and_gradient", fn, xs)  # type: ignore[no-any-return]
        value, aux = fn(xs)
        return value, aux, self._grad(value, xs)

    def _grad(self, value: Any, xs: Leaves) -> Leaves:
        grads = grad(value, list(xs), disconnected_inputs="ignore", return_disconnected="zero")
        return tuple(grads)  # type: ignore[arg-type]

    def value_and_jacobian(self, fn: Fn, xs: Leaves, mode: str | None = None) -> tuple[Any, Any, Blocks]:
        if not _symbolic(xs):
            return self._eager("value_and_jacobian", fn, xs)  # type: ignore[no-any-return]
        out, aux = fn(xs)
        outs = _base.as_tuple(out)
        return out, aux, tuple(self._jacobian(y, xs) for y in outs)

    def _jacobian(self, y: Any, xs: Leaves) -> tuple[Any, ...]:
        """The blocks of ``y``'s Jacobian, ``y.shape + x.shape`` for each leaf x."""
        shape = tuple(y.type.shape)
        # (an empty block, of an empty y or an empty leaf of x, holds no number: zeros of its
        # shape; only the leaves that are not empty are differentiated)
        full = [x for x in xs if 0 not in x.type.shape]
        found = (
            iter(jacobian(y, full, disconnected_inputs="ignore", vectorize=True)) if full and 0 not in shape else None
        )
        blocks = []
        for x in xs:
            block = next(found) if found is not None and 0 not in x.type.shape else None
            blocks.append(pt.zeros((*shape, *x.type.shape), dtype=x.dtype) if block is None else block)
        return tuple(blocks)

    def value_and_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any]:
        if not _symbolic(xs):
            return self._eager("value_and_derivative", fn, xs)  # type: ignore[no-any-return]
        return self.value_and_pushforward(fn, xs, (pt.ones_like(xs[0]),))

    gradient_and_hvp = _base.hvp_as_a_batch

    def gradient_and_hvps(self, fn: Fn, xs: Leaves, batch: Sequence[Leaves]) -> tuple[Any, Any, Leaves, list[Leaves]]:
        if not _symbolic(xs):
            return self._eager("gradient_and_hvps", fn, xs, list(batch))  # type: ignore[no-any-return]
        value, aux = fn(xs)
        grads = self._grad(value, xs)
        hvps = []
        for txs in batch:  # reverse over reverse: the gradient of <grad f, v>
            directional = _base.vdot(pt, grads, tuple(pt.cast(t, x.dtype) for t, x in zip(txs, xs, strict=True)))
            hvps.append(self._grad(directional, xs))
        return value, aux, grads, hvps

    # (the base's rules on PyTensor's own gradient, Jacobian and derivative, in one graph)

    def value_gradient_and_hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves, Blocks]:
        if not _symbolic(xs):
            return self._eager("value_gradient_and_hessian", fn, xs)  # type: ignore[no-any-return]
        return _base.hessian_of(self, self, fn, xs)

    def value_derivative_and_second_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
        if not _symbolic(xs):
            return self._eager("value_derivative_and_second_derivative", fn, xs)  # type: ignore[no-any-return]
        return _base.second_derivative_of(self, self, fn, xs)
