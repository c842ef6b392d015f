"""The adapter protocol, and every operator derived from two primitives.

An adapter differentiates *closed functions* ``fn(xs) -> (out, aux)``: ``xs`` is a tuple of
the engine's arrays (the leaves of ``x``), ``out`` is one 0-d array (scalar functions) or a
tuple of arrays (the leaves of ``f(x)``), ``aux`` is whatever ``f`` returned beside (``None``
without ``has_aux``, which diffiface's closed functions say in an attribute: read it with
``getattr(fn, "has_aux", True)``). Each adapter implements what its engine does natively; at
the least

- ``pullback_function(fn, xs) -> (out, aux, vjp)``, reverse mode, and
- ``value_and_pushforward(fn, xs, txs) -> (out, aux, tout)``, forward mode,

(one may be built from the other) and everything else comes from here: gradient from the
pullback of 1, jacobian from pullback rows or pushforward columns, derivative from the
pushforward of 1, hvp forward-over-reverse (or reverse-over-reverse without forward mode),
hessian as the jacobian of the gradient, second derivative as the derivative of the
derivative. The second-order rules take an ``outer`` and an ``inner`` adapter, so
:class:`SecondOrderAdapter` is the same code with two engines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _arrays
from .._errors import FrameworkMismatchError, InvalidOutputError

if TYPE_CHECKING:
    from .._backends import Backend, SecondOrder
    from ._row import BackendInfo

Leaves = tuple[Any, ...]
Fn = Callable[[Leaves], tuple[Any, Any]]
Blocks = tuple[tuple[Any, ...], ...]


def refuse_a_moved_output(value: Callable[[float], Sequence[Any]], resolution: float, engine: str) -> None:
    """Refuses f where the engine's trace does not lead from x to its output and the output
    moves with x (f cut the trace, and its derivative would read as zero); else f does not depend
    on x there, and zero is its derivative. ``value(t)``: f's output, as numpy arrays, at x moved
    by ``t (1 + |x|)`` (``value(0.0)``: at x); ``resolution``: the largest of x's epsilons. The
    move is ``1e-3``, or 4 epsilons where x's dtype is coarser: a bfloat16 x moved by ``1e-3``
    rounds back to x, and a cut f read as constant (its gradient zeros)."""
    before, after = value(0.0), value(max(1e-3, 4 * resolution))
    if len(before) == len(after) and all(
        a.shape == b.shape and np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after, strict=True)
    ):
        return
    raise InvalidOutputError(
        f"f's output changes with x, but not through the {engine} engine's trace: f turned a "
        "traced value into a plain number or a new array (float(y), y.item(), y.numpy(), "
        "torch.tensor(y.item()), np.asarray(y)), or computed it with torch's grad mode off (torch.no_grad(), "
        "torch.set_grad_enabled(False)), so its derivative would read as zero. Keep the computation in the "
        "engine's arrays, traced, from x to the output. (Or f draws from a global random generator, "
        "and its output changes from call to call: pass a seeded generator or key as a di.Constant.)"
    )


def handed_to_another_framework(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's or jax's refusal of an array of another engine that ``f``
    handed it: raised inside their code, or a compiled function's refusal of an argument that
    is not its own framework's tensor (``torch.sin`` given another engine's array: "must be
    Tensor, not array"), which leaves no Python frame of that framework to find."""
    return (
        raised_inside(exc, "torch")
        or raised_inside(exc, "jax")
        or (isinstance(exc, TypeError) and "must be Tensor, not" in str(exc))
    )


def raised_inside(exc: BaseException, package: str) -> bool:
    """Whether ``exc`` was raised from inside ``package``'s code (a frame of its modules), in
    its traceback or in that of the exceptions it chains (jax hides its frames in one): a
    failure is classified by where it happened, never by words in its message, which ``f``
    may have written."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__module__.startswith(package + "."):
            return True
        tb = current.__traceback__
        while tb is not None:
            module = tb.tb_frame.f_globals.get("__name__", "")
            if module == package or module.startswith(package + "."):
                return True
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return False


def raised_by(exc: BaseException) -> str:
    """The name of the function whose code raised ``exc`` (its innermost traceback frame)."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_name


def numpy_handed_its_method(exc: BaseException, cls: type) -> bool:
    """Whether ``exc`` is a TypeError that numpy's own code raised calling a method of an array
    of class ``cls`` it was given: ``np.sum(tensor)`` calls ``tensor.sum(axis=None, out=None)``,
    which another framework's method does not take. Told by the innermost frame (numpy's, with
    such an array among its locals), never by the message."""
    tb = exc.__traceback__
    if not isinstance(exc, TypeError) or tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    if module != "numpy" and not module.startswith("numpy."):
        return False
    return any(isinstance(value, cls) for value in tb.tb_frame.f_locals.values())


def class_names(root: type) -> frozenset[str]:
    """The names of ``root`` and of every subclass of it defined by now: what an error message
    raised in compiled code (no Python frame to tell by) names one of its arrays by."""
    names: set[str] = set()
    todo: list[type] = [root]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return frozenset(names)


@dataclasses.dataclass(frozen=True)
class ProgramParts:
    """What :meth:`Adapter.compile` may read besides the program itself, settled once per prep
    (torch reads them to guard the call, and to run it in one call of its own).

    - ``cache_dynamic``, ``cache_static``: for each dynamic (array) and static context leaf,
      whether it belongs to a :class:`~diffiface.Cache` (f's scratch space, which f may write)
      rather than a :class:`~diffiface.Constant`;
    - ``x_names``, ``names_dynamic``, ``names_static``: the paths of x's leaves and of the
      dynamic and static context leaves (``x['w']``, ``contexts[0][1]``), for an error that
      names one;
    - ``fused``: the parts of the program an engine may run in one call of its own
      (:class:`~diffiface._programs.Fused`), where the operator allows it; else None;
    - ``x_arrays``: weak references to x's leaves in the call the program is built for (None
      for a leaf that takes none), where an engine that traces f with x's values abstract
      (jit) finds x's own arrays (:meth:`Adapter.refuse_a_read_of_x`).
    """

    cache_dynamic: tuple[bool, ...] = ()
    cache_static: tuple[bool, ...] = ()
    x_names: tuple[str, ...] = ()
    names_dynamic: tuple[str, ...] = ()
    names_static: tuple[str, ...] = ()
    fused: Any = None
    x_arrays: tuple[Any, ...] = dataclasses.field(default=(), compare=False)  # (weak references hash their arrays)


NO_PARTS = ProgramParts()
"""The parts of a program that has none to read."""


class Adapter:
    """Base adapter. Subclasses set ``xp`` (an array namespace) and override primitives."""

    xp: Any
    complex_outputs = False
    """True when ``f`` is evaluated at complex points (complex-step differences)."""
    complex_reverse_mode = True
    """False where the engine's reverse mode through complex operations is not to be trusted
    (mlx's vjp of a complex power): a complex function's Jacobian is then taken by columns."""
    estimates_errors = False
    """True when the engine estimates the error of its results (see :meth:`take_error`)."""
    batches = False
    """True when the engine may evaluate ``f`` at many points in one call, through the
    ``batched`` attribute of the closed function."""
    weak_floats = False
    """True where the engine takes a Python float in x weakly, in the dtype of the arrays it
    meets (jax's weak types, torch's 0-d tensors, a black box that passes it as it is); else the
    route gives it the dtype x's float arrays share (:class:`~diffiface._programs._Conversions`)."""
    retraces = False
    """True when a compiled program is traced anew for arguments of other shapes or dtypes
    (jax's jit, mlx's mx.compile, tf.function): the program then checks them itself, at no cost
    per call (the retracing engines' tier, :class:`~diffiface._programs.JitProgram`)."""

    def traced_dtype(self, dtype: Any) -> Any:
        """The dtype a leaf of this dtype has inside the compiled program's trace (jax without
        x64 traces numpy's int64 as int32); the program's own check of its arguments takes it."""
        return dtype

    def traces_call(self, compute: str, leaves: Sequence[Any], caches: bool, ref: Any) -> bool:
        """Whether the retracing tier takes a call of ``compute`` on these leaves (x's, the
        tangent's, the contexts'; ``caches``: a context is a :class:`~diffiface.Cache`; ``ref``:
        how the prep reaches f, or None): where each is a numpy array or one the compiled
        program checks itself (:meth:`~diffiface._families.Family.jit_checked`)."""
        for leaf in leaves:
            family = _arrays.family_of(leaf)
            if type(leaf) is not np.ndarray and (family is None or not family.jit_checked(leaf)):
                return False
        return True

    retracing_option: str | None = None
    """The name of the config's option that compiles with a retracing compiler (``jit`` of
    AutoJAX): where the engine has one, :attr:`compiles` and :attr:`retraces` follow it."""

    def __init__(self, backend: Backend, info: BackendInfo) -> None:
        self.backend = backend
        self.info = info
        if self.retracing_option is not None:
            self.compiles = self.retraces = bool(getattr(backend, self.retracing_option))

    # -- conversions and environment -------------------------------------------------------

    def to_native(self, leaf: Any) -> Any:
        """A differentiated leaf (of x or of a tangent) as the engine's array."""
        return leaf

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        """A context leaf for the engine, and whether it is an array (a dynamic argument).

        ``like`` is a leaf of x, already native (None when x has no leaves)."""
        return leaf, False

    def constant_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        """A :class:`~diffiface.Constant`'s leaf for the engine, as :meth:`context_to_native`
        gives a Cache's, but such that ``f`` cannot write into the caller's array unnoticed:
        an engine that hands numpy arrays to ``f`` as they are hands them read-only."""
        native, is_array = self.context_to_native(leaf, like)
        return (read_only(leaf) if native is leaf else native), is_array

    def output_leaf(self, leaf: Any, like: Any) -> Any:
        """A leaf of ``f``'s output as the engine's array (``like``: a leaf of x)."""
        return leaf

    def untracked(self, leaf: Any, xs: Leaves) -> bool:
        """Whether ``xs`` are traced by the engine and the output ``leaf`` of ``f`` is not: ``f``
        either does not depend on x (its derivative is zero) or cut the trace (``float(y)``,
        ``torch.tensor(y.item())``), which only evaluating ``f`` elsewhere can tell apart.
        Engines whose traced values cannot leave the trace unnoticed keep the default, False."""
        return False

    def plain(self, leaf: Any) -> Any:
        """A traced input leaf's value, outside any trace (for evaluating ``f`` elsewhere)."""
        return leaf

    def trace_value(self, leaf: Any, xs: Leaves) -> str | None:
        """What ``leaf``, an array ``f`` returned, is in words where it is a value of the
        engine's trace of ``xs`` that only the engine takes out of that trace, as it does the
        leaves of f's result (an aux's array inside an object that is no pytree would leave
        the trace with it); None where it is not. Engines that call f with plain values keep
        the default, None."""
        return None

    def refuse_a_read_of_x(self, at: Callable[[Leaves], list[Any]], xs: Leaves, given: Leaves) -> None:
        """Where the engine's trace does not lead from x to f's output: refuses an output that
        reads x's own arrays rather than f's argument (a model f calls, whose parameters x
        holds), by which f's output may change with x where the trace sees nothing.
        ``at(leaves)``: the output leaves the trace misses, of f at x's ``leaves``; ``xs``:
        x's leaves, plain values; ``given``: the leaves of the contexts f is given (an array
        of x among them is f's to read). Nothing by default."""

    cuts_unseen = True
    """Whether f can cut the engine's trace without an error (``float(y)``, ``y.item()``,
    ``torch.no_grad()``): an output the trace misses is then evaluated at a point apart too,
    and refused where it moves. False where every cut raises (jax's traced arrays refuse
    float(), .item() and numpy; ``lax.stop_gradient`` is a cut f asks for): such an output
    does not change with x, unless it reads x's own arrays (:meth:`refuse_a_read_of_x`)."""

    traced_function: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    """For an engine that sees less of an f compiled by itself (a ``tf.function``, whose call is
    one operation to the tape): ``f -> the function to trace``, its Python function, whose
    operations the engine then records one by one and diffiface's checks read (a cut from x
    inside it is found). None: f as it is."""

    output_values: Callable[[Any], Any] | None = None
    """For an engine whose traced values are not arrays (dual numbers in numpy object arrays):
    ``leaf -> array``, the values a traced output leaf of ``f`` stands for, which diffiface
    checks and records as f's output. None: the leaves are arrays, checked as they are."""

    def rebuilder(self, x_spec: Any) -> Callable[[Any], Any] | None:
        """``leaves -> x`` where the engine hands f its x otherwise than as ``x_spec.unflatten``
        of them (autograd: its own traced containers); None for the generic rebuild."""
        return None

    @property
    def scoped(self) -> bool:
        """Whether :meth:`scope` may give a context: where it never does, float64 calls take
        the same direct route as float32 ones."""
        return self.info.any_array_type

    def scope(self) -> contextlib.AbstractContextManager[Any] | None:
        """The context to run in when a float64 array is involved; None if there is none.

        A black-box engine hands ``f`` perturbed points as jax arrays when x is one; jax
        makes float64 arrays only under x64, so it gets a scoped ``jax.enable_x64(True)``."""
        jax = sys.modules.get("jax")
        if self.info.any_array_type and jax is not None and not jax.config.read("jax_enable_x64"):
            return jax.enable_x64(True)  # type: ignore[no-any-return]
        return None

    compiles = False
    """True when :meth:`compile` compiles (jax under jit)."""

    def compile(
        self,
        program: Callable[..., Any],
        static: bool = True,
        arrays: bool = False,
        layouts: Any = None,
        parts: ProgramParts | None = None,
    ) -> Callable[..., Any]:
        """Compile a program ``(xs, ts, dynamic_contexts, static_contexts) -> results``, or
        with ``static=False`` one whose every argument is an array; ``arrays``: its results
        are arrays only. ``layouts``: for a program on flat array arguments, where each one is
        laid out in every call (the prep's, one per argument; None for any): the compiled
        call then needs no record of its arguments. ``parts``: what the adapter may read to
        guard the call or run it in one call of its own (:class:`ProgramParts`)."""
        return program

    def forget_traces(self) -> None:
        """Drop what the engine keeps of f's earlier traces: called where an array f reads
        (from its closure or globals) has changed in place since a prep of f was built, before
        the new prep traces f again. Nothing to drop for most engines."""

    def returns_like(self, leaf: Any) -> bool:
        """Whether a compiled program's array results have the array type of ``leaf``."""
        return False

    def rebuilds_in_trace(self, spec: Any, leaves: list[Any]) -> bool:
        """Whether a compiled program may return x's tree of optree structure ``spec`` (on
        these leaves) rebuilt inside its trace, as optree rebuilds it (jax's pytrees do where
        they take the tree apart alike); else the tree is rebuilt after the call."""
        return False

    def concrete(self, out: Any) -> Any:
        """f's output, called on concrete arrays outside any transform, as concrete values: as it
        is, unless f builds a graph of its inputs under this engine (PyTensor's)."""
        return out

    def explain_failure(self, exc: BaseException) -> str | None:
        """If ``exc`` shows ``f`` was written for another framework, say why; else None."""
        return None

    def refuse_failure(self, exc: Exception) -> None:
        """Where f raised ``exc`` and :meth:`explain_failure` says why, the FrameworkMismatchError
        that says so, raised from it; else nothing (the caller raises ``exc`` itself)."""
        hint = self.explain_failure(exc)
        if hint is not None:
            raise FrameworkMismatchError(f"f failed under the {self.backend.name} backend: {hint}") from exc

    def take_error(self) -> Any:
        """The error estimate of the last call in this thread, for engines that give one."""
        return None

    # -- the two primitives ------------------------------------------------------------------

    def pullback_function(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
        """``(out, aux, vjp)``: ``vjp(tout)`` is the vector-Jacobian product, ``tout`` shaped
        as ``out``. Without a reverse mode, built from the full Jacobian."""
        out, aux, blocks = self._jacobian_by_columns(fn, xs)
        return out, aux, lambda tout: _transpose_apply(self.xp, blocks, as_tuple(tout), xs)

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        """``(out, aux, tout)``: ``tout`` is the Jacobian-vector product along ``txs``.
        Without a forward mode, built from the full Jacobian."""
        out, aux, blocks = self._jacobian_by_rows(fn, xs)
        return out, aux, shaped_as(out, _apply(self.xp, blocks, txs, as_tuple(out)))

    # -- batches of products: one program where the engine has vmap, a loop here -------------

    def value_and_pushforwards(self, fn: Fn, xs: Leaves, batch: Sequence[Leaves]) -> tuple[Any, Any, list[Any]]:
        """``(out, aux, touts)``: ``touts[k]`` the Jacobian-vector product along ``batch[k]``."""
        touts = []
        out = aux = None
        for txs in batch:
            out, aux, tout = self.value_and_pushforward(fn, xs, txs)
            touts.append(tout)
        if out is None:  # an empty batch: evaluate once for the value
            out, aux = fn(xs)
        return out, aux, touts

    def value_and_pullbacks(self, fn: Fn, xs: Leaves, batch: Sequence[Any]) -> tuple[Any, Any, list[Leaves]]:
        """``(out, aux, grads)``: ``grads[k]`` the vector-Jacobian product of ``batch[k]``."""
        out, aux, vjp = self.pullback_function(fn, xs)
        return out, aux, self.pullbacks(vjp, xs, batch)

    def pullbacks(self, vjp: Callable[[Any], Leaves], xs: Leaves, batch: Sequence[Any]) -> list[Leaves]:
        """``vjp`` (of :meth:`pullback_function`) of each cotangent of ``batch``."""
        return [vjp(touts) for touts in batch]

    # -- first order, derived --------------------------------------------------------------------

    def value_and_pullback(self, fn: Fn, xs: Leaves, touts: Any) -> tuple[Any, Any, Leaves]:
        out, aux, vjp = self.pullback_function(fn, xs)
        return out, aux, vjp(touts)

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        out, aux, vjp = self.pullback_function(fn, xs)
        return out, aux, vjp(self.xp.ones_like(out))

    def value_and_jacobian(self, fn: Fn, xs: Leaves, mode: str | None = None) -> tuple[Any, Any, Blocks]:
        """``(out, aux, blocks)`` with ``blocks[i][j]`` of shape ``out[i].shape + xs[j].shape``."""
        if mode is None:
            mode = "reverse" if self.info.reverse_mode else "forward"
        if mode == "reverse":
            return self._jacobian_by_rows(fn, xs)
        return self._jacobian_by_columns(fn, xs)

    def value_and_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any]:
        if self.info.forward_mode:
            return self.value_and_pushforward(fn, xs, (self.xp.ones_like(xs[0]),))
        out, aux, blocks = self.value_and_jacobian(fn, xs)
        return out, aux, tuple(row[0] for row in blocks)

    def gradient_function(self, fn: Fn) -> Fn:
        """``xs -> (gradient, (value, aux))``: a function the same engine can differentiate."""

        def gradient(xs: Leaves) -> tuple[Leaves, tuple[Any, Any]]:
            value, aux, grads = self.value_and_gradient(fn, xs)
            return grads, (value, aux)

        return gradient

    def derivative_function(self, fn: Fn) -> Fn:
        """``xs -> (derivative, (value, aux))`` for a scalar ``xs``."""

        def derivative(xs: Leaves) -> tuple[Any, tuple[Any, Any]]:
            value, aux, deriv = self.value_and_derivative(fn, xs)
            return deriv, (value, aux)

        return derivative

    # -- second order, derived ---------------------------------------------------------------------

    def gradient_and_hvp(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Leaves, Leaves]:
        """``(value, aux, gradient, hessian @ txs)``."""
        return hvp_of(self, self, fn, xs, txs)

    def gradient_and_hvps(self, fn: Fn, xs: Leaves, batch: Sequence[Leaves]) -> tuple[Any, Any, Leaves, list[Leaves]]:
        """``(value, aux, gradient, hvps)``: ``hvps[k]`` the Hessian-vector product along ``batch[k]``."""
        return hvps_of(self, self, fn, xs, batch)

    def value_gradient_and_hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves, Blocks]:
        return hessian_of(self, self, fn, xs)

    def value_derivative_and_second_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
        return second_derivative_of(self, self, fn, xs)

    # -- helpers ---------------------------------------------------------------------------------

    def basis(self, like: Any, index: int) -> Any:
        """The ``index``-th unit array of ``like``'s shape and dtype."""
        flat = self.xp.zeros((_size(like),), dtype=like.dtype)
        flat[index] = 1
        return self.xp.reshape(flat, tuple(like.shape))

    def _jacobian_by_rows(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Blocks]:
        xp = self.xp
        out, aux, vjp = self.pullback_function(fn, xs)
        outs = as_tuple(out)
        seeds = [
            shaped_as(out, tuple(self.basis(y, k) if m == i else xp.zeros_like(z) for m, z in enumerate(outs)))
            for i, y in enumerate(outs)
            for k in range(_size(y))
        ]
        every = self.pullbacks(vjp, xs, seeds) if seeds else []
        blocks = []
        start = 0
        for y in outs:
            rows = every[start : start + _size(y)]
            start += _size(y)
            blocks.append(
                tuple(
                    xp.reshape(xp.stack([row[j] for row in rows]), (*y.shape, *x.shape))
                    if rows
                    else xp.zeros((*y.shape, *x.shape), dtype=x.dtype)
                    for j, x in enumerate(xs)
                )
            )
        return out, aux, tuple(blocks)

    def _jacobian_by_columns(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Blocks]:
        xp = self.xp
        zeros = tuple(xp.zeros_like(x) for x in xs)
        seeds = [(*zeros[:j], self.basis(x, k), *zeros[j + 1 :]) for j, x in enumerate(xs) for k in range(_size(x))]
        out, aux, touts = self.value_and_pushforwards(fn, xs, seeds)  # (every leaf empty: f once, for the value)
        columns: list[list[Leaves]] = []
        start = 0
        for x in xs:
            columns.append([as_tuple(t) for t in touts[start : start + _size(x)]])
            start += _size(x)
        outs = as_tuple(out)
        blocks = tuple(
            tuple(
                xp.reshape(xp.stack([xp.reshape(col[i], (-1,)) for col in columns[j]], axis=-1), (*y.shape, *x.shape))
                if columns[j]
                else xp.zeros((*y.shape, *x.shape), dtype=y.dtype)
                for j, x in enumerate(xs)
            )
            for i, y in enumerate(outs)
        )
        return out, aux, blocks


# -- second-order rules, shared by single adapters and SecondOrder ---------------------------


def hvp_of(outer: Adapter, inner: Adapter, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Leaves, Leaves]:
    """Forward-over-reverse when ``outer`` has a forward mode (or is a black box);
    reverse-over-reverse otherwise (the gradient of ``<grad f, v>``). Here and below, a
    black-box outer engine may defer the inner engine's value and aux (:class:`Deferred`)."""
    if outer.info.forward_mode or outer is not inner:
        grads, packed, hvps = outer.value_and_pushforward(inner.gradient_function(fn), xs, txs)
        value, aux = force(packed)  # a black-box outer engine may defer it
        return value, aux, grads, hvps

    def directional(xs_: Leaves) -> tuple[Any, Any]:
        value, aux, grads = inner.value_and_gradient(fn, xs_)
        return vdot(inner.xp, grads, txs), (value, aux, grads)

    _, (value, aux, grads), hvps = outer.value_and_gradient(directional, xs)
    return value, aux, grads, hvps


def hvps_of(
    outer: Adapter, inner: Adapter, fn: Fn, xs: Leaves, batch: Sequence[Leaves], reverse: bool = False
) -> tuple[Any, Any, Leaves, list[Leaves]]:
    """:func:`hvp_of` for a batch of tangents. Forward over reverse: the outer engine's batch of
    pushforwards of the gradient map (one vmapped program on jax and torch.func). Reverse over
    reverse (without a forward mode, or where ``reverse`` asks): the gradient map's pullback,
    built once and applied to each tangent (the Hessian is symmetric, so its pullback along v is
    H v)."""
    if not reverse and (outer.info.forward_mode or outer is not inner):
        grads, packed, hvps = outer.value_and_pushforwards(inner.gradient_function(fn), xs, batch)
        value, aux = force(packed)
        return value, aux, grads, hvps
    grads, packed, vjp = outer.pullback_function(inner.gradient_function(fn), xs)
    value, aux = packed
    return value, aux, grads, outer.pullbacks(vjp, xs, batch)


def hvp_as_a_batch(adapter: Adapter, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Leaves, Leaves]:
    """``gradient_and_hvp`` as a batch of one, for an adapter whose ``gradient_and_hvps`` is its own."""
    value, aux, grads, (hvp,) = adapter.gradient_and_hvps(fn, xs, [txs])
    return value, aux, grads, hvp


def hessian_of(
    outer: Adapter, inner: Adapter, fn: Fn, xs: Leaves, mode: str | None = None
) -> tuple[Any, Any, Leaves, Blocks]:
    """The Jacobian of the gradient map, by ``mode``; by default forward where the outer engine has one."""
    mode = mode or ("forward" if outer.info.forward_mode else "reverse")
    grads, packed, blocks = outer.value_and_jacobian(inner.gradient_function(fn), xs, mode)
    value, aux = force(packed)
    return value, aux, grads, blocks


def second_derivative_of(outer: Adapter, inner: Adapter, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
    derivs, packed, seconds = outer.value_and_derivative(inner.derivative_function(fn), xs)
    value, aux = force(packed)
    return value, aux, derivs, seconds


_INNER_PARTS = (
    "xp",
    "weak_floats",
    "output_values",
    "traced_function",
    "batches",
    "to_native",
    "context_to_native",
    "constant_to_native",
    "untracked",
    "trace_value",
    "refuse_a_read_of_x",
    "cuts_unseen",
    "plain",
    "output_leaf",
    "scope",
    "explain_failure",
    "pullback_function",
    "value_and_pushforward",
    "value_and_gradient",
    "value_and_jacobian",
    "value_and_derivative",
)
"""What a :class:`SecondOrderAdapter` takes of its inner adapter as it is: the conversions
and checks of ``f``'s arrays, and every first-order product."""

_SECOND_ORDER = (
    "gradient_and_hvp",
    "gradient_and_hvps",
    "value_gradient_and_hessian",
    "value_derivative_and_second_derivative",
)
"""What it takes of its inner adapter besides where the pair is one engine."""


class SecondOrderAdapter(Adapter):
    """First order by ``inner``; second order by ``outer`` differentiating ``inner``'s results."""

    def __init__(
        self, backend: SecondOrder, outer: Adapter, inner: Adapter, make: Callable[[Backend], Adapter]
    ) -> None:
        """``make(backend)``: the registry's adapter of a backend."""
        from .._backends import one_difference_engine

        super().__init__(backend, inner.info)
        native = outer is inner
        if one_difference_engine(outer.backend, inner.backend):
            native = True  # one finite-difference engine: its own second differences
        elif outer.batches:
            # the outer evaluates the inner engine's derivative, which takes one point at a
            # time: its evaluations cannot be batched
            unbatched: Any = outer.backend
            outer = make(dataclasses.replace(unbatched, vectorize=False))
        self.outer = outer
        self.inner = inner
        # one engine twice is that engine's own second order, whose adapter knows how it nests
        # (torch's autograd mode, say, differentiates twice backward, never forward over reverse)
        for name in _INNER_PARTS + (_SECOND_ORDER if native else ()):
            setattr(self, name, getattr(inner, name))
        self.complex_outputs = outer.complex_outputs or inner.complex_outputs
        self.estimates_errors = outer.estimates_errors
        if type(outer) is type(inner):  # one engine twice compiles as that engine does; two run uncompiled
            self.compile = inner.compile  # type: ignore[method-assign]
            self.compiles = inner.compiles
        self._local = threading.local()

    @property
    def scoped(self) -> bool:
        return self.inner.scoped or self.outer.scoped

    def forget_traces(self) -> None:
        self.outer.forget_traces()
        self.inner.forget_traces()

    def take_error(self) -> Any:
        error = self.outer.take_error()
        second = getattr(self._local, "second", None)
        self._local.second = None
        if error is None or second is None:
            return error
        # the outer engine estimated the error of differentiating the inner derivative:
        # ``(error of that derivative's value, None, error of its derivative)``; the inner
        # derivative and f's value, computed by the inner engine, carry no estimate (zero)
        derivative_error = error[0]
        value_error = derivative_error if second == "derivative" else np.zeros(())
        return value_error, None, derivative_error, error[2]

    def gradient_and_hvp(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Leaves, Leaves]:
        self._local.second = "gradient"
        return hvp_of(self.outer, self.inner, fn, xs, txs)

    def gradient_and_hvps(self, fn: Fn, xs: Leaves, batch: Sequence[Leaves]) -> tuple[Any, Any, Leaves, list[Leaves]]:
        self._local.second = "gradient"
        return hvps_of(self.outer, self.inner, fn, xs, batch)

    def value_gradient_and_hessian(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves, Blocks]:
        self._local.second = "gradient"
        return hessian_of(self.outer, self.inner, fn, xs)

    def value_derivative_and_second_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
        self._local.second = "derivative"
        return second_derivative_of(self.outer, self.inner, fn, xs)


# -- small array helpers ---------------------------------------------------------------------


class Deferred:
    """A value an engine does not get for free (``f(x)`` for central differences): computed
    only if the operator returns it, so ``gradient`` costs no evaluation it does not need."""

    __slots__ = ("_compute", "_done", "_value")

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute = compute
        self._done = False
        self._value: Any = None

    def force(self) -> Any:
        if not self._done:
            self._value = self._compute()
            self._done = True
        return self._value


def read_only(array: Any) -> Any:
    """A read-only view of a numpy array (other leaves as they are)."""
    if type(array) is np.ndarray:
        view = array.view()
        view.flags.writeable = False
        return view
    return array


def force(value: Any) -> Any:
    return value.force() if isinstance(value, Deferred) else value


def _size(leaf: Any) -> int:
    return math.prod(tuple(leaf.shape))


def without_leaves(adapter: Adapter, compute: str) -> Callable[..., tuple[Any, ...]]:
    """The adapter's ``compute`` where x has no leaves (an empty dict, the trainable parameters of
    a layer that has none): f evaluated once, and every derivative with respect to nothing, known
    without the engine, which may refuse to take one (torch.func's jvp, jax's and torch's
    Jacobians): no gradient leaves, no Jacobian or Hessian blocks, and a jvp of zeros like f's
    output."""
    xp = adapter.xp

    def method(fn: Fn, xs: Leaves, *tangents: Any) -> tuple[Any, ...]:
        out, aux = fn(xs)
        if compute == "pullback_function":
            return out, aux, lambda touts: ()
        if compute == "value_and_pushforward":
            return out, aux, shaped_as(out, tuple(xp.zeros_like(y) for y in as_tuple(out)))
        if compute == "value_and_jacobian":
            return out, aux, tuple(() for _ in as_tuple(out))
        if compute in ("gradient_and_hvp", "value_gradient_and_hessian"):
            return out, aux, (), ()
        return out, aux, ()  # (a gradient, a vjp)

    return method


def as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def shaped_as(out: Any, leaves: tuple[Any, ...]) -> Any:
    return leaves if isinstance(out, tuple) else leaves[0]


def vdot(xp: Any, a: Leaves, b: Leaves) -> Any:
    """The sum over leaves of ``sum(a * b)``."""
    total = None
    for u, v in zip(a, b, strict=True):
        term = xp.sum(u * v)
        total = term if total is None else total + term
    return total if total is not None else xp.zeros(())


def _apply(xp: Any, blocks: Blocks, txs: Leaves, outs: tuple[Any, ...]) -> Leaves:
    """``J @ t``, block by block."""
    result = []
    for row, y in zip(blocks, outs, strict=True):
        acc = xp.zeros_like(y)
        for block, t in zip(row, txs, strict=True):
            n = _size(t)
            # explicit sizes: a -1 cannot be inferred when a leaf is empty
            acc = acc + xp.reshape(xp.reshape(block, (_size(y), n)) @ xp.reshape(t, (n,)), tuple(y.shape))
        result.append(acc)
    return tuple(result)


def _transpose_apply(xp: Any, blocks: Blocks, touts: tuple[Any, ...], xs: Leaves) -> Leaves:
    """``J.T @ t``, block by block."""
    result = []
    for j, x in enumerate(xs):
        acc = xp.zeros_like(x)
        n = _size(x)
        for row, t in zip(blocks, touts, strict=True):
            m = _size(t)
            acc = acc + xp.reshape(xp.reshape(t, (m,)) @ xp.reshape(row[j], (m, n)), tuple(x.shape))
        result.append(acc)
    return tuple(result)
