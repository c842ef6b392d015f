"""Compiled torch: ``AutoTorch(mode="func", compile=True)``, whose contract (results detached,
x and the Constants never written, what is refused) is docs/engines/torch-compile.md.

Each operator's torch.func program (the second-order ones as one program: ``jvp`` of ``grad``,
``jacfwd`` of ``grad``, ``jvp`` of ``jacrev``) is compiled by ``torch.compile`` (Inductor,
``fullgraph=True``, ``dynamic=False``) with f traced inside it, each prep's from code objects of
its own, so that one prep's graphs are never another's guard failures, nor count against torch's
recompile limit (:class:`_Program`). The first call of a prep evaluates f once eagerly, for
diffiface's checks of f's output. The torch adapter's guard stays around every call, uncompiled.
A gradient whose leaves are all tensors is compiled whole (:class:`_Retraced`). Nothing is
differentiated through a compiled graph: a call differentiated from outside is refused, and the
outer engine of a ``SecondOrder`` over this one differentiates the inner gradient uncompiled
(:meth:`gradient_function`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import optree
import torch
import torch.autograd.forward_ad as _forward_ad
from torch import func

from ... import tree as _tree
from ..._backends import AutoTorch
from ..._errors import UnsupportedOperationError
from ..._families.torch import CALLS as _CALLS
from ..._flatten import structure_unflatten
from .._base import NO_PARTS, Blocks, Deferred, Fn, Leaves
from .._base import Adapter as _BaseAdapter
from ._duals import _forward_locked
from ._engine import _BATCHED_WRONGLY, _for_func, _jacobian_by, _materialised, _on_one, _tensor_aux, graph_nodes
from ._guard import _guard, _out_of_graph, _transform_level, _version


class _Current(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Programs] = []  # the programs of the preps running in this thread, innermost last
        # the innermost compiled call's dynamic context leaves, and which are a Constant's (a recheck's watch)
        self.constants: tuple[Leaves, tuple[int, ...]] = ((), ())


_CURRENT = _Current()


class _Programs:
    """The compiled programs of one prep, by name, each compiled from a code object of its own;
    ``warm``: the names whose first call has evaluated f eagerly (diffiface's checks), and of
    those ``unbatchable``: the names where f's graph holds a node torch.func.vmap batches wrongly;
    ``custom``: whether f's graph holds a ``torch.autograd.Function``, whose own rules
    torch.compile ignores under torch.func (it differentiates the forward's operations: a
    silently wrong derivative), so that the prep runs uncompiled, as ``mode="func"``."""

    __slots__ = ("custom", "found", "reading", "unbatchable", "warm")

    def __init__(self, reading: bool = False) -> None:
        self.found: dict[str, _Program] = {}
        self.warm: set[str] = set()
        self.unbatchable: set[str] = set()
        self.custom = False
        self.reading = reading
        """Whether every call reads f's graph and runs uncompiled (:class:`_Retraced`, which
        compiles the whole program around the operator's own)."""


class _Uncompiled(Exception):
    """Raised by :func:`_entry` where torch runs it uncompiled (see :class:`_Program`)."""


def _entry(template: Callable[..., Any], *args: Any) -> Any:
    """What torch compiles: ``template(*args)``."""
    if not torch.compiler.is_compiling():
        raise _Uncompiled
    return template(*args)


class _Program:
    """One compiled program of a prep: ``template`` compiled, from a code object of its own.

    ``strict`` compiles (``fullgraph=True``, ``dynamic=False``: one graph, or
    :class:`~diffiface.UnsupportedOperationError`). Once it has, calls go through ``fast``,
    torch's run-only call of the same code object, which runs a graph already compiled without
    the compiling call's work on every call, and compiles nothing: where no graph fits (a guard
    fails: a value f closes over changed, or the process's state), torch runs :func:`_entry`
    itself, which raises :class:`_Uncompiled` before any work, and ``strict`` compiles one
    (:func:`_called`). Past torch's recompile limit the program runs uncompiled, with a warning."""

    __slots__ = ("fast", "recheck", "run_only", "strict", "template", "uncompiled")

    def __init__(self, template: Callable[..., Any]) -> None:
        entry = _fresh(_entry)
        self.template = template
        self.strict = torch.compile(entry, fullgraph=True, dynamic=False)
        run = getattr(torch._dynamo, "run", None)  # (None where this torch has none: strict runs every call)
        self.run_only: Callable[..., Any] | None = None if run is None else run(entry)
        self.fast: Callable[..., Any] | None = None  # (set once strict has compiled)
        self.uncompiled = False  # (torch's recompile limit reached)
        self.recheck: Callable[[], bool] | None = None  # (f's graph read again before a later compile)


def _fresh(template: Callable[..., Any]) -> Callable[..., Any]:
    """``template`` with a code object of its own: torch.compile keeps its graphs per code object."""
    code = template.__code__.replace()
    fresh = types.FunctionType(code, template.__globals__, template.__name__, template.__defaults__)
    if code is template.__code__:  # (a copy where replace() gave the same object back)
        fresh.__code__ = types.CodeType.replace(code, co_name=code.co_name + "_")
    return fresh


# -- the programs (templates: each prep compiles copies of them) -----------------------------------
# Written for torch.compile to trace: no locks, no checks that return Python values of tensors
# (the eager warm-up made diffiface's checks); what is not traceable is done around the call.


def _gradient(g: Callable[[Any], Any], has_aux: bool, primal: Any) -> Any:
    if has_aux:
        grads, (value, aux) = func.grad_and_value(g, has_aux=True)(primal)
        return value, aux, grads
    grads, value = func.grad_and_value(g)(primal)
    return value, None, grads


def _pushforward(g: Callable[[Any], Any], has_aux: bool, primals: Any, tangents: Any) -> Any:
    if has_aux:
        return func.jvp(g, primals, tangents, has_aux=True)
    out, tout = func.jvp(g, primals, tangents)  # type: ignore[misc]
    return out, tout, None


def _pullback(g: Callable[[Any], Any], has_aux: bool, primal: Any, touts: Any) -> Any:
    if has_aux:
        out, pullback, aux = func.vjp(g, primal, has_aux=True)  # type: ignore[misc]
    else:
        (out, pullback), aux = func.vjp(g, primal), None  # type: ignore[misc]
    return out, aux, pullback(touts)


def _jacobian(with_value: Callable[[Any], Any], forward: bool, primal: Any) -> Any:
    # (the value by f once more, not as the transform's aux, which torch.compile's graph capture
    # refuses under jacrev; Inductor computes the shared work once)
    transform = func.jacfwd if forward else func.jacrev
    return transform(lambda p: with_value(p)[0])(primal), with_value(primal)[1]


def _noted(out: Any, name: str, programs: _Programs) -> Any:
    """``out``, its graph read for a node torch.func.vmap batches wrongly (noted under ``name``)
    and for a ``torch.autograd.Function``'s (noted for the prep)."""
    for node in graph_nodes(out):
        if isinstance(node, _CUSTOM_RULES):
            programs.custom = True
        elif type(node).__name__ in _BATCHED_WRONGLY:
            programs.unbatchable.add(name)
    return out


_CUSTOM_RULES = torch.autograd.function.BackwardCFunction
"""The class of a ``torch.autograd.Function``'s node in a graph."""


def _read(programs: _Programs, name: str, fn: Fn, xs: Leaves, batched: bool) -> bool:
    """f's graph read, eagerly (:func:`_noted`): whether program ``name`` may be compiled."""
    func.vjp(lambda *leaves: _noted(fn(leaves)[0], name, programs), *xs)
    return not (programs.custom or (batched and name in programs.unbatchable))


def _reread(programs: _Programs, name: str, fn: Fn, xs: Leaves, batched: bool) -> bool:
    """:func:`_read` on a later call, before a compile: where f wrote into a Constant's tensor
    (the caller's own on a later call), :class:`_Written` stops the call before the compiled
    program runs f again, so that the write lands once; the guard names it."""
    dynamic, constant_at = _CURRENT.constants
    watched = [dynamic[i] for i in constant_at if isinstance(dynamic[i], torch.Tensor)]
    versions = list(map(_version, watched))
    fits = _read(programs, name, fn, xs, batched)
    if list(map(_version, watched)) != versions:
        raise _Written
    return fits


class _Written(Exception):
    """Raised by :func:`_reread` where f wrote into a Constant's tensor: the guard's counters
    name the write (a MutationError)."""


def _reading(fn: Fn, name: str) -> Fn:
    """``fn``, its graph read as it runs (:func:`_noted`, under program ``name``) where this is
    the retracing tier's eager run (:class:`_Retraced`), which reads f's graph before a compile:
    read in the run itself, not by :func:`_read`, f is evaluated once, so that a write f makes
    into a Constant on a later call lands once, as the guard names it."""
    stack = _CURRENT.stack
    if not stack or not stack[-1].reading or torch.compiler.is_compiling():
        return fn
    programs = stack[-1]

    def reading(xs: Leaves) -> Any:
        result = fn(xs)
        _noted(result[0], name, programs)
        return result

    reading.__dict__.update(fn.__dict__)  # (has_aux: an engine reads it)
    return reading


def _noting(g: Callable[[Any], Any], has_aux: bool, programs: _Programs) -> Callable[[Any], Any]:
    """``g`` with its output's graph read (:func:`_noted`), inside the gradient a second-order
    program differentiates: the outer graph holds the rules' results, not their nodes."""

    def noting(primal: Any) -> Any:
        result = g(primal)
        _noted(result[0] if has_aux else result, "gradient", programs)
        return result

    return noting


def _detached(xs: Leaves) -> Leaves:
    """x's leaves out of any graph they carry (an nn.Parameter's): nothing goes back through a
    compiled graph."""
    for x in xs:
        if x.requires_grad:
            return tuple(x.detach() for x in xs)
    return xs


def _called(program: _Program, *args: Any) -> Any:
    """``program``'s template on ``args``, compiled (see :class:`_Program`)."""
    template = program.template
    fast = program.fast
    if program.uncompiled:
        return template(*args)
    if fast is not None:
        try:
            return fast(template, *args)
        except _Uncompiled:  # no compiled graph fits this call: compile one, f's graph read again
            # first (a torch.autograd.Function, or a node vmap batches wrongly, that this call
            # reaches and the first did not: compiled, its derivative would be silently wrong)
            if program.recheck is not None and not program.recheck():
                raise _Eager from None
    try:
        # torch's compiler warns of its own deprecations, not the caller's (f's warnings came in
        # the eager warm-up before it)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            # (Inductor's note that it runs complex operators as torch does: its performance, not
            # the caller's code; as an error under the caller's filters it fails the compile)
            warnings.filterwarnings("ignore", "Torchinductor does not support code generation for complex")
            with _hook_guards():
                result = program.strict(template, *args)
    except _Uncompiled:  # torch ran it uncompiled (a stance of the caller's)
        return template(*args)
    except _RECOMPILE_LIMIT:  # (a value f reads took a new value on every call: uncompiled from now)
        program.uncompiled = True
        warnings.warn(_LIMIT, RuntimeWarning, stacklevel=2)
        return template(*args)
    # (an AssertionError is the compiler checking itself: f's own asserts ran in the eager warm-up)
    except (*_GRAPH_BREAKS, AssertionError) as exc:
        raise _unsupported(exc) from exc
    program.fast = program.run_only
    return result


@contextlib.contextmanager
def _hook_guards() -> Iterator[None]:
    """torch.compile's guards on the hooks of the modules f calls, installed while a program
    compiles: by default torch skips them (``skip_nnmodule_hook_guards``), so that a forward hook
    registered on a Constant module (or one f closes over) after the first compile, or one
    removed, would leave the graph compiled without it, or with it, running: a stale derivative.
    With them, such a change fails a guard and compiles anew. Guards are built as a graph
    compiles, so the setting is needed then only; the caller's own setting is put back after it
    (one compile at a time sets it, so that two threads' settings never cross)."""
    config = torch._dynamo.config
    if not hasattr(config, "skip_nnmodule_hook_guards"):
        yield
        return
    with _COMPILING, config.patch(skip_nnmodule_hook_guards=False):
        yield


_COMPILING = threading.RLock()
"""Held while a program compiles with the hooks' guards (:func:`_hook_guards`)."""


class _Eager(Exception):
    """Raised by :func:`_called` where a new compile found f's graph holding what a compiled
    program gets wrong: the call runs uncompiled, as the prep's first call would have."""


_RECOMPILE_LIMIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())
_LIMIT = (
    "torch.compile's recompile limit is reached for this prep: a value f reads (a Python number in a "
    "Constant, a closure or a global) took a new value on every compile. It runs uncompiled from now on "
    "(right, slower); pass a number that changes between calls as a 0-d tensor in a Constant, which is an "
    "argument of the compiled graph."
)


#: What torch.compile raises where f cannot be captured as one graph (``fullgraph=True``), or its
#: graph not compiled (a tensor of a transform stored where the graph cannot return it: a Cache).
_GRAPH_BREAKS = tuple(
    getattr(torch._dynamo.exc, name)
    for name in ("Unsupported", "UserError", "UncapturedHigherOrderOpError", "BackendCompilerFailed")
    if hasattr(torch._dynamo.exc, name)
)


def _second(with_aux: Callable[[Any], Any], x: Any) -> Any:
    # forward over reverse mode (jvp over jvp, compiled, crashes torch where f multiplies x by a
    # Python number), the value and aux by f once more: no aux goes through a transform (torch.
    # compile's graph capture refuses one under nested forward mode)
    def value(p: Any) -> Any:
        return with_aux(p)[0]

    derivative, second = func.jvp(func.jacrev(value), (x,), (torch.ones_like(x),))  # type: ignore[misc]
    return with_aux(x), derivative, second


def _real_aux(aux: Any) -> Any:
    """An aux as a compiled graph gave it back (its leaves and structure, as ``close`` set them
    apart, maybe inside a second-order program's pairs): torch.compile traces optree through a
    stand-in, whose structures come out of the graph as that stand-in's objects. One that can be
    rebuilt (a tuple's, a list's) is made optree's again; one that cannot (a dict's) is refused
    by name, not left to fail later."""
    if type(aux) is tuple or type(aux) is list:
        return type(aux)(map(_real_aux, aux))
    if type(aux) is optree.PyTreeSpec or type(aux).__name__ != "PyTreeSpec":
        return aux
    try:
        skeleton = aux.unflatten(list(range(aux.num_leaves)))
        return optree.tree_structure(skeleton, none_is_leaf=aux.none_is_leaf, namespace=aux.namespace)
    except Exception as exc:
        raise UnsupportedOperationError(
            "torch.compile gave back the structure of f's aux in a form it cannot rebuild itself (a dict's, "
            "in the torch releases tried). Return the aux as tuples and lists under AutoTorch(mode='func', "
            "compile=True), or use AutoTorch(mode='func') uncompiled."
        ) from exc


def _unsupported(exc: BaseException) -> UnsupportedOperationError:
    first = " ".join([line.strip() for line in str(exc).splitlines() if line.strip()][:2]) or type(exc).__name__
    return UnsupportedOperationError(
        f"torch.compile could not compile this program as one graph ({type(exc).__name__}: {first}). "
        "f must be traceable by torch.compile without graph breaks: no .tolist() or .numpy() "
        "on a traced tensor, no Python control flow on tensor values, no print, no traced tensor stored "
        "outside f's output (a di.Cache written by f); and a vector-valued f must return one tensor "
        "(diffiface's checks of a pytree output are not compiled). Use "
        "AutoTorch(mode='func') (uncompiled) for such an f."
    )


def _nested() -> UnsupportedOperationError:
    return UnsupportedOperationError(
        "A compiled torch program (AutoTorch(mode='func', compile=True)) is being differentiated from "
        "outside (an outer diffiface call, a torch.func transform, or another engine over it in a "
        "SecondOrder): torch cannot differentiate through a compiled graph's backward. Ask the compiled "
        "backend for the second-order operator itself (hvp, hessian, second_derivative compile as one "
        "program), or use AutoTorch(mode='func') uncompiled for the inner function."
    )


class _Retraced:
    """The retracing tier's compiled function (:class:`~diffiface._programs.JitProgram`):
    ``traced``, the whole program of the call's leaves, compiled with f and the engine's
    torch.func program traced inside it (``Adapter._program`` gives None while torch traces).

    Every compile comes after the guard's steps around ``traced`` ran eagerly on the call's
    leaves: f's output checked, f's graph read (:class:`_Programs`), a write refused, in which
    case nothing is compiled. A compiled graph is the trace of the f that run watched, which
    wrote nowhere. So a call that a compiled graph fits, made outside any other differentiation
    once a call has completed, runs through the run-only call with nothing around it (no copy,
    no version counter: the counters alone cost a sixth of a small gradient's time). Any other
    call takes the guard's steps, then a compile where the leaves fit the prep."""

    __slots__ = ("contexts", "guarded", "program", "programs", "ready", "xs")

    def __init__(self, traced: Callable[..., Any], parts: Any) -> None:
        self.program = _Program(traced)
        self.programs = _Programs(reading=True)
        self.xs = len(parts.x_names)
        self.contexts = len(parts.names_dynamic)
        self.guarded = _guard(self._checked, True, False, parts)
        self.ready = False  # (a call has completed, and a graph is compiled)

    def __call__(self, *leaves: Any) -> Any:
        program = self.program
        fast = program.fast
        # (not where a forward-mode level is open: a dual x's tangent would be dropped by the
        # graph without an error; the guard's steps refuse such a call, as any call
        # differentiated from outside)
        if self.ready and fast is not None and not _CALLS.keep and _forward_ad._current_level < 0:
            try:
                return fast(program.template, *leaves)
            except _Uncompiled:  # no compiled graph fits: the guard's steps, then a compile
                pass
        xs, contexts = self.xs, len(leaves) - self.contexts
        eager = self.guarded(leaves[:xs], leaves[xs:contexts], leaves[contexts:], None)
        if eager is None or self.programs.custom or program.uncompiled or torch.is_inference_mode_enabled():
            return eager  # (None: the shapes are not the prep's)
        # compiled on the caller's own leaves, as later calls run it (the guard's copies of an
        # nn.Parameter are no leaves of their own): f wrote nowhere in the run just watched
        result = _called(program, *leaves)
        self.ready = program.fast is not None and not program.uncompiled
        return result

    def _checked(self, xs: Leaves, ts: Leaves, dynamic: Leaves, static: Any) -> Any:
        """The guarded call: ``traced`` eagerly, f's graph read."""
        stack = _CURRENT.stack
        stack.append(self.programs)
        try:
            return self.program.template(*xs, *ts, *dynamic)
        finally:
            stack.pop()


def _negative_zeros(key: tuple[Any, ...]) -> tuple[int, ...]:
    """The static context leaves (by their keys, :func:`~diffiface._keys.static_key`) that hold
    a negative zero. torch.compile's guards compare a number with ``==``, for which ``-0.0`` is
    ``0.0``, so a graph compiled for one would serve the other (``1 / c``, ``atan2`` and
    ``copysign`` tell them apart): such calls take programs of their own."""
    return tuple(i for i, leaf in enumerate(key) if _holds_negative_zero(leaf))


def _holds_negative_zero(key: Any) -> bool:
    if type(key) is tuple:
        return any(map(_holds_negative_zero, key))
    if type(key) is str:  # (a Python float's key holds its bits so written)
        return key == _NEGATIVE_ZERO
    return isinstance(key, (float, np.floating)) and key == 0 and math.copysign(1.0, key) < 0


_NEGATIVE_ZERO = (-0.0).hex()


_TRACED_TYPES = (torch.Tensor, torch.nn.Parameter)
"""The leaves the retracing tier takes (``traces_call``): torch.compile's guards check their
shapes, dtypes, devices, strides and flags."""


# -- the adapter -----------------------------------------------------------------------------------


@functools.cache
def compiled_adapter(base: type[_BaseAdapter]) -> type[_BaseAdapter]:
    """The compiled adapter class over torch's adapter class ``base`` (mode="func"): made from
    it, so that this module imports nothing of the adapter's module, which imports this one."""

    class Adapter(base):  # type: ignore[valid-type,misc]
        """The torch adapter compiled (``mode="func"``; see the module's docstring)."""

        def __init__(self, backend: Any, info: Any) -> None:
            super().__init__(backend, info)
            self.retraces = True  # (torch.compile's guards check each tensor's shape and dtype)
            # the uncompiled torch.func adapter whose methods the compiled programs trace
            self.eager: Any = base(AutoTorch(mode="func"), info)

        # -- per prep: the programs of its own ---------------------------------------------------

        def compile(
            self,
            program: Callable[..., Any],
            static: bool = True,
            arrays: bool = False,
            layouts: Any = None,
            parts: Any = None,
        ) -> Callable[..., Any]:
            parts = NO_PARTS if parts is None else parts
            if layouts is not None:  # the retracing tier's function of the leaves, compiled whole
                return _Retraced(program, parts)
            guarded = _guard(program, True, False, parts)  # (no fused call: the compiled program is the call)
            constant_at = tuple(i for i, cache in enumerate(parts.cache_dynamic) if not cache)
            current = _CURRENT
            programs = _Programs()
            signed: dict[tuple[int, ...], _Programs] = {}  # (by the static leaves that are -0.0)
            stack = _CURRENT.stack

            def run(xs: Leaves, ts: Leaves, dynamic: Leaves, static: Any) -> Any:
                found = programs
                if static is not None:
                    zeros = _negative_zeros(static.key)
                    if zeros:
                        found = signed.get(zeros) or signed.setdefault(zeros, _Programs())
                stack.append(found)
                outer, current.constants = current.constants, (dynamic, constant_at)
                try:
                    # (detached: a Constant's tensor that requires grad, an unfrozen backbone's
                    # parameter, would give the results a graph through the compiled graph's
                    # backward, which nothing may differentiate; x's graph is cut before f runs)
                    return _out_of_graph(guarded(xs, ts, dynamic, static))
                finally:
                    stack.pop()
                    current.constants = outer  # (nor does the thread keep the caller's tensors alive)

            run.programs = programs  # type: ignore[attr-defined]  # (for the tests: what was compiled)
            return run

        def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
            # a numpy scalar is taken as the Python number it holds, which every torch operation
            # takes alike: torch.compile's trace of one under torch.func's transforms fails on
            # a guard of its own (an AssertionError of torch's, no result)
            if isinstance(leaf, (np.number, np.bool_)):
                leaf = leaf.item()
            return super().context_to_native(leaf, like)  # type: ignore[no-any-return]

        def rebuilder(self, x_spec: Any) -> Callable[[Any], Any] | None:
            # (x's tree is rebuilt inside the compiled trace, where torch.compile cannot trace
            # optree's C rebuild: in Python, whatever its size)
            return None if x_spec is None or x_spec.is_leaf() else structure_unflatten(x_spec, largest=None)

        def returns_like(self, leaf: Any) -> bool:
            return type(leaf) is torch.Tensor  # (a compiled graph's results are plain tensors)

        def traces_call(self, compute: str, leaves: Any, caches: bool, ref: Any) -> bool:
            # (the gradient's program traces whole; the others hold what torch.compile does not
            # trace, such as the forward-mode lock, and compile the operator's program alone. A
            # Cache is f's to write, and the whole trace would write into a rebuilt one; a bound
            # method's weak reference, which the trace calls, is one torch.compile cannot trace)
            return (
                compute == "value_and_gradient"
                and not caches
                and not isinstance(ref, weakref.WeakMethod)
                and all(type(leaf) in _TRACED_TYPES and not leaf.is_complex() for leaf in leaves)
            )

        def _program(self, name: str, template: Callable[..., Any], fn: Fn, xs: Leaves, batched: bool = False) -> Any:
            """This call's compiled program ``name``, f evaluated once eagerly before its first call;
            None where the call runs uncompiled: outside a prep of its own (another engine's
            SecondOrder program), or where f's graph holds what a compiled program gets wrong
            (:class:`_Programs`). A call differentiated from outside is refused."""
            if torch.compiler.is_compiling():  # (the retracing tier's trace: f traced with the rest)
                return None
            if len(_CALLS.keep) > 1 or _transform_level() is not None or _forward_ad._current_level >= 0:
                raise _nested()
            stack = _CURRENT.stack
            if not stack:
                return None
            programs = stack[-1]
            if programs.reading:  # (f's graph read as the eager run evaluates f: _reading)
                return None
            if name not in programs.warm:
                # f once, uncompiled, under a torch.func transform as "torch-func" runs it:
                # diffiface's checks of its output, and torch.func's refusal of a write into a
                # Constant (a compiled graph would carry the write out to the caller's tensor)
                _read(programs, name, fn, xs, batched)
                programs.warm.add(name)
            if programs.custom or (batched and name in programs.unbatchable):
                return None
            # (two threads' first calls may each make one: both keep the one stored first)
            program = programs.found.get(name) or programs.found.setdefault(name, _Program(template))
            # (f's graph read again, eagerly, before a compile after a program's first)
            program.recheck = lambda: _reread(programs, name, fn, xs, batched)
            return program

        def untracked(self, leaf: Any, xs: Leaves) -> bool:
            # (checked by the eager warm-up: the compiled trace has no duals nor autograd leaves)
            return False if torch.compiler.is_compiling() else super().untracked(leaf, xs)

        # -- the compiled operators ------------------------------------------------------------

        def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
            xs = _detached(xs)
            program = self._program("gradient", _gradient, fn, xs)
            if program is not None:
                g, has_aux, rebuild = _for_func(fn, xs)
                with contextlib.suppress(_Eager):
                    value, aux, grads = _called(program, g, has_aux, xs[0] if len(xs) == 1 else xs)
                    return value, _real_aux(rebuild(aux)), _materialised((grads,) if len(xs) == 1 else tuple(grads))
            # uncompiled, or traced by the retracing tier: detached all the same (only what carries
            # a graph, a Constant's: a detached output of a compiled graph is a view, which torch
            # rebuilds on every call)
            value, aux, grads = self.eager.value_and_gradient(_reading(fn, "gradient"), xs)
            return _out_of_graph(value), aux, _out_of_graph(grads)

        def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
            xs = _detached(xs)
            with _forward_locked():
                program = self._program("pushforward", _pushforward, fn, xs)
                if program is not None:
                    g, has_aux, rebuild = _for_func(fn, xs)
                    primals, tangents = (xs, txs) if len(xs) == 1 else ((xs,), (txs,))
                    with contextlib.suppress(_Eager):
                        out, tout, aux = _called(program, g, has_aux, primals, tangents)
                        # (a tangent has its primal's dtype: torch.func may promote a 0-d one)
                        tout = _tree.map(lambda t, y: t.to(y.dtype) if t.dtype != y.dtype else t, tout, out)
                        return out, _real_aux(rebuild(aux)), tout
                return self.eager._value_and_pushforward(fn, xs, txs)  # type: ignore[no-any-return]

        # (one compiled jvp per tangent, one compiled vjp per cotangent: not torch.func.vmap's batch)
        value_and_pushforwards = _BaseAdapter.value_and_pushforwards
        pullbacks = _BaseAdapter.pullbacks

        def pullback_function(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
            xs = _detached(xs)
            program = self._program("pullback", _pullback, fn, xs)
            if program is None:
                return self.eager.pullback_function(fn, xs)  # type: ignore[no-any-return]
            done: list[Any] = []

            def vjp(touts: Any) -> Leaves:
                g, has_aux, rebuild = _for_func(fn, xs)
                given, touts = touts, touts if type(touts) is tuple else (touts,)
                try:
                    out, aux, grads = _called(program, g, has_aux, xs[0] if len(xs) == 1 else xs, touts)
                except _Eager:
                    out, aux, pullback = self.eager.pullback_function(fn, xs)
                    done[:] = [out, aux]
                    return pullback(given)  # type: ignore[no-any-return]
                done[:] = [out, _real_aux(rebuild(aux))]
                return _materialised((grads[0],) if len(xs) == 1 else tuple(grads[0]))

            def value(i: int) -> Any:
                if not done:  # (no cotangent came, an empty batch: f's value alone, uncompiled)
                    done[:] = self.eager.pullback_function(fn, xs)[:2]
                return done[i]

            return Deferred(lambda: value(0)), Deferred(lambda: value(1)), vjp

        def value_and_jacobian(self, fn: Fn, xs: Leaves, mode: str | None = None) -> tuple[Any, Any, Blocks]:
            xs = _detached(xs)
            if any(x.numel() == 0 for x in xs):
                return self.eager.value_and_jacobian(fn, xs, mode)  # type: ignore[no-any-return]
            forward = mode == "forward"
            with _forward_locked():
                program = self._program("jacobian", _jacobian, fn, xs, batched=not forward)
                if program is not None:
                    with contextlib.suppress(_Eager):
                        out, aux, blocks = _jacobian_by(lambda g, p: _called(program, g, forward, p), fn, xs, False)
                        return out, _real_aux(aux), blocks
                return self.eager.value_and_jacobian(fn, xs, mode)  # type: ignore[no-any-return]

        # -- second order: one compiled program over these traceable first-order functions ------

        def gradient_function(self, fn: Fn) -> Fn:
            def gradient(xs: Leaves) -> tuple[Leaves, tuple[Any, Any]]:
                g, has_aux, rebuild = _for_func(fn, xs)
                stack = _CURRENT.stack
                if stack and not torch.compiler.is_compiling():  # (an eager warm-up: f's graph read)
                    g = _noting(g, has_aux, stack[-1])
                value, aux, grads = _gradient(g, has_aux, xs[0] if len(xs) == 1 else xs)
                return ((grads,) if len(xs) == 1 else tuple(grads)), (value, rebuild(aux))

            return gradient

        def value_derivative_and_second_derivative(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Any, Any]:
            xs = _detached(xs)
            with _forward_locked():
                program = self._program("second", _second, fn, xs, batched=True)
                if program is not None:
                    tensor_fn, rebuild = _tensor_aux(fn)
                    with contextlib.suppress(_Eager):
                        (out, aux), first, second = _called(program, _on_one(tensor_fn), xs[0])
                        return out, _real_aux(rebuild(aux)), first, second
                return self.eager.value_derivative_and_second_derivative(fn, xs)  # type: ignore[no-any-return]

    Adapter.__qualname__ = "Adapter"
    return Adapter
