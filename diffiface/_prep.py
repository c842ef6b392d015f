"""Preparation: the one-time work of an operator, the signature it was made for, and the
weak cache that lets unprepared calls reuse it."""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ._errors import PreparationMismatchError, UnsupportedOperationError
from .tree import path_string

if TYPE_CHECKING:
    from ._plan import Plan

__all__ = ["Closure", "FunctionRef", "Prep", "Signature", "describe_mismatch", "prep_cache"]


class Signature(NamedTuple):
    """Everything a prep depends on, except ``f`` itself (compared by identity).

    A tuple, so that building, hashing and comparing one on every call stays cheap."""

    operator: str
    backend: Any
    has_aux: bool
    x_spec: Any
    x_leaves: tuple[Any, ...]
    tangent_spec: Any
    tangent_leaves: tuple[Any, ...]
    contexts: tuple[Any, ...]


class FunctionRef:
    """A weak reference to ``f`` that also works for bound methods and builtins.

    Preps and the cache never keep ``f`` alive: a closure made afresh for each call is
    collected as usual, and its cache entries with it.
    """

    __slots__ = ("name", "ref")

    def __init__(self, f: Callable[..., Any]) -> None:
        self.name = getattr(f, "__qualname__", None) or repr(f)
        ref: Callable[[], Any]
        if isinstance(f, types.MethodType):
            ref = weakref.WeakMethod(f)
        else:
            try:
                ref = weakref.ref(f)
            except TypeError:  # builtins and other objects without weak references live long
                ref = functools.partial(_identity, f)
        self.ref = ref

    def __call__(self) -> Callable[..., Any]:
        f = self.ref()
        if f is None:  # pragma: no cover - the caller holds f while calling
            raise ReferenceError(f"the function {self.name} no longer exists")
        return f  # type: ignore[no-any-return]

    def matches(self, f: Callable[..., Any]) -> bool:
        return _same_function(self.ref(), f)


def _identity(f: Any) -> Any:
    return f


def _same_function(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, types.MethodType) and isinstance(b, types.MethodType):
        return a.__self__ is b.__self__ and a.__func__ is b.__func__
    return False


class Prep:
    """The result of a ``prepare_*`` call: pass it back as ``prep=`` to skip one-time work.

    A prep records the signature it was made for: ``f``, the backend, the operator, and the
    tree structures, shapes, dtypes and array types of ``x``, the tangent and the contexts.
    With ``strict=True`` (the default) a call with anything else raises
    :class:`~diffiface.PreparationMismatchError`; with ``strict=False`` such a call is
    prepared afresh instead.

    A prep may be shared between threads.
    """

    __slots__ = ("_local", "closure", "plan", "signature", "strict")

    def __init__(self, plan: Plan, signature: Signature, strict: bool, closure: Closure | None = None) -> None:
        self.plan = plan
        """The plan: what the prep was made for, field by field, and its program."""
        self.signature = signature
        self.strict = strict
        self.closure = closure
        """What f read when its program was built, where the program keeps it (a compiled
        program bakes in the values f closes over): an unprepared call checks it still holds."""
        self._local = threading.local()

    @property
    def function(self) -> FunctionRef:
        return self.plan.function  # type: ignore[no-any-return]

    @property
    def operator(self) -> str:
        """The operator this prep is for (``"gradient"``, ``"jvp"``...)."""
        return self.signature.operator

    @property
    def backend(self) -> Any:
        """The backend this prep is for."""
        return self.signature.backend

    @property
    def error(self) -> Any:
        """The error estimate of the last call made with this prep in this thread, shaped as
        that call's result; None for backends that give no estimate (only ``AutoScipy`` does)."""
        return getattr(self._local, "error", None)

    def with_strictness(self, strict: bool) -> Prep:
        """A prep sharing this one's work, with its own strictness and error estimate."""
        return type(self)(self.plan, self.signature, strict, self.closure)

    def still_for(self, f: Callable[..., Any]) -> bool:
        """Whether f reads what it read when this prep's program was built (always, for a
        program that bakes nothing in): an unprepared call may reuse the prep."""
        return self.closure is None or self.closure.holds(f)

    def run(self, x_leaves: Any, tangent_leaves: Any, context_leaves: Any) -> Any:
        """The operator on flattened arguments that have this prep's signature."""
        result, error = self.plan.program(x_leaves, tangent_leaves, context_leaves)
        if error is not None or self.plan.estimates:
            self._local.error = error
        return result

    # A prep holds compiled programs and a reference to f, which neither pickle nor copy
    # faithfully (jit's and torch's programs belong to this process; a copy of f's reference
    # would be another f): both are refused, with what to do instead.

    def __reduce__(self) -> Any:
        raise self._not_copied("pickled", "in the new process")

    def __copy__(self) -> Prep:
        raise self._not_copied("copied", "where the copy is needed")

    def __deepcopy__(self, memo: Any) -> Prep:
        raise self._not_copied("deep-copied", "where the copy is needed")

    def _not_copied(self, done: str, where: str) -> UnsupportedOperationError:
        return UnsupportedOperationError(
            f"A prep cannot be {done}: it holds compiled programs and a reference to f, which belong to "
            f"this process. Call di.prepare_{self.operator}(f, backend, x, ...) again {where}. Within one "
            "process there is no need to copy it: a prep may be shared, also between threads, and "
            "prep.with_strictness(...) gives one with another strictness."
        )

    def __repr__(self) -> str:
        return (
            f"<Prep {self.operator} of {self.function.name} with {self.backend!r}"
            f"{'' if self.strict else ', strict=False'}>"
        )


class Closure:
    """What ``f`` reads besides its arguments, where a program keeps it: the objects its closure
    cells hold, the globals its code names (and its nested functions'), and its defaults, each
    by identity; numpy arrays among them also by their values, which can change in place.

    A compiled program bakes these in when it traces f (as ``jax.jit`` does), and a sparsity
    pattern is detected for them, so an unprepared call whose f reads anything else prepares
    again rather than reuse a stale program. What objects hold (an attribute set on a model
    f reads) is not followed: pass such data as a :class:`~diffiface.Constant`."""

    __slots__ = ("_arrays", "_code", "_ids", "_keep", "_names", "holds")

    def __init__(self, f: Callable[..., Any]) -> None:
        function = getattr(f, "__func__", f)
        self._code = getattr(function, "__code__", None)
        self._names = _names(self._code) if self._code is not None else ()
        values = _read_values(function, self._names)
        self._keep = values  # (the ids stay those of live objects)
        self._ids = tuple(map(id, values))
        self._arrays = [(i, v.copy()) for i, v in enumerate(values) if type(v) is np.ndarray and v.size <= _COPIED]
        self.holds: Callable[[Callable[..., Any]], bool] = self._holds
        """``holds(f)``: whether ``f`` reads the same objects (and the same array values)."""
        if type(function) is types.FunctionType:
            self.holds = _write_holds(function, self._names, values, self._arrays, self._holds)

    def _holds(self, f: Callable[..., Any]) -> bool:
        function = getattr(f, "__func__", f)
        if getattr(function, "__code__", None) is not self._code:
            return False
        values = _read_values(function, self._names)
        if tuple(map(id, values)) != self._ids:
            return False
        for i, copy in self._arrays:  # noqa: SIM110
            if not np.array_equal(values[i], copy, equal_nan=copy.dtype.kind in "fc"):
                return False
        return True


def _write_holds(
    function: types.FunctionType,
    names: tuple[str, ...],
    values: list[Any],
    arrays: list[tuple[int, np.ndarray]],
    slow: Callable[[Callable[..., Any]], bool],
) -> Callable[[Callable[..., Any]], bool]:
    """:meth:`Closure.holds` written for one function: each object it read compared by
    identity with the one it read then, in one Python frame (it runs on every unprepared call,
    where a frame and a loop cost). An empty closure cell is left to ``slow``, the general
    test."""
    constants: dict[str, Any] = {"FUNCTION": types.FunctionType, "CODE": function.__code__, "SLOW": slow}
    constants["ARRAY_EQUAL"] = np.array_equal
    lines = [
        "function = f if type(f) is FUNCTION else getattr(f, '__func__', f)",
        "if type(function) is not FUNCTION or function.__code__ is not CODE: return False",
    ]
    read: list[str] = []  # (the objects read, in _read_values's order: each one's name)

    def tests(expressions: list[str]) -> str:
        """``e is not V<k>`` for each expression, V<k> the object it gave then, joined by ``or``."""
        for expression in expressions:
            constants[f"V{len(read)}"] = values[len(read)]
            read.append(f"{expression} is not V{len(read)}")
        return " or ".join(read[len(read) - len(expressions) :])

    cells = function.__closure__ or ()
    if cells:
        lines += [
            "cells = function.__closure__",
            "try:",
            f"    if {tests([f'cells[{i}].cell_contents' for i in range(len(cells))])}: return False",
            "except ValueError:  # (an empty cell)",
            "    return SLOW(f)",
        ]
    namespace = function.__globals__
    lines.append("g = function.__globals__")
    present = [name for name in names if name in namespace]
    absent = [name for name in dict.fromkeys(names) if name not in namespace]
    if present:
        found = tests([f"g[{name!r}]" for name in present])
        lines += ["try:", f"    if {found}: return False", "except KeyError:", "    return False"]
    if absent:
        lines.append(f"if {' or '.join(f'{name!r} in g' for name in absent)}: return False")
    defaults = function.__defaults__ or ()
    constants["DEFAULTS"] = function.__defaults__
    if defaults:
        same = tests([f"defaults[{i}]" for i in range(len(defaults))])
        lines += [
            "defaults = function.__defaults__",
            "if defaults is not DEFAULTS:",
            f"    if defaults is None or len(defaults) != {len(defaults)} or {same}: return False",
        ]
    else:
        lines.append("if function.__defaults__: return False")
    if len(read) != len(values):  # (never: the same reads as _read_values)
        return slow
    for i, copy in arrays:  # (the array is the one read then: its values now against the copy)
        constants[f"C{i}"] = copy
        nan = copy.dtype.kind in "fc"
        lines.append(f"if not ARRAY_EQUAL(V{i}, C{i}, equal_nan={nan}): return False")
    source = "def holds(f):\n" + "".join(f"    {line}\n" for line in lines) + "    return True\n"
    exec(compile(source, "<diffiface: what f read, compared>", "exec"), constants)
    written: Callable[[Callable[..., Any]], bool] = constants["holds"]
    return written


_COPIED = 1 << 16  # numpy arrays f reads are compared by value up to this size; larger, by identity


def _read_values(function: Any, names: tuple[str, ...]) -> list[Any]:
    values: list[Any] = []
    for cell in getattr(function, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            values.append(None)
    namespace = getattr(function, "__globals__", None)
    if namespace is not None:
        for name in names:
            if name in namespace:
                values.append(namespace[name])
    values.extend(getattr(function, "__defaults__", None) or ())
    return values


@functools.lru_cache(maxsize=1024)
def _names(code: types.CodeType) -> tuple[str, ...]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_names(const))
    return tuple(names)


def describe_mismatch(prep: Prep, f: Callable[..., Any], signature: Signature) -> str | None:
    """What differs between ``prep`` and a call, in words; None when nothing does."""
    old = prep.signature
    if not prep.function.matches(f):
        name = getattr(f, "__qualname__", repr(f))
        return f"f: prepared for {prep.function.name}, called with {name}"
    for part in ("operator", "backend", "has_aux"):
        if getattr(old, part) != getattr(signature, part):
            return f"{part}: prepared for {getattr(old, part)!r}, called with {getattr(signature, part)!r}"
    for label, spec, leaves in (("x", "x_spec", "x_leaves"), ("tangent", "tangent_spec", "tangent_leaves")):
        found = _tree_difference(
            label, getattr(old, spec), getattr(signature, spec), getattr(old, leaves), getattr(signature, leaves)
        )
        if found:
            return found
    if len(old.contexts) != len(signature.contexts):
        return f"contexts: prepared with {len(old.contexts)}, called with {len(signature.contexts)}"
    for i, (a, b) in enumerate(zip(old.contexts, signature.contexts, strict=True)):
        if a[0] is not b[0]:
            return f"context {i}: prepared as {a[0].__name__}, called with {b[0].__name__}"
        found = _tree_difference(f"context {i}", a[1], b[1], a[2], b[2])
        if found:
            return found
    return None


def _tree_difference(
    label: str, spec_a: Any, spec_b: Any, leaves_a: tuple[Any, ...], leaves_b: tuple[Any, ...]
) -> str | None:
    if spec_a != spec_b:
        return f"{label} structure: prepared for {spec_a}, called with {spec_b}"
    if leaves_a == leaves_b:
        return None
    paths = spec_a.paths() if spec_a is not None else []
    for i, (a, b) in enumerate(zip(leaves_a, leaves_b, strict=True)):
        if a != b:
            where = path_string(paths[i]) if i < len(paths) else f"leaf {i}"
            return f"{label}{where}: prepared for {_describe_leaf(a)}, called with {_describe_leaf(b)}"
    return None  # pragma: no cover - equal specs and unequal leaves differ somewhere


def _describe_leaf(signature: tuple[Any, ...]) -> str:
    kind = signature[0]
    if kind == "python":
        return f"a Python {signature[1].__name__}"
    if kind == "static":
        return f"a {signature[1].__name__} (not an array)"
    if kind == "other":  # a pytree only jax knows: its class, then its leaves' shapes and dtypes
        leaves = ", ".join(f"{shape} {dtype}" for shape, dtype in (signature[3] if len(signature) > 3 else ()))
        return f"a {signature[1].__name__} with leaves of shape and dtype [{leaves}]"
    shape, dtype = signature[1], signature[2]
    text = f"a {kind} array of shape {shape} and dtype {dtype}"
    if kind == "torch":
        text += f" on {signature[3]}"
    if kind == "jax" and len(signature) > 3:
        text += f" laid out as {signature[3]}"
    return text


def mismatch_error(prep: Prep, reason: str) -> PreparationMismatchError:
    return PreparationMismatchError(
        f"This prep does not fit the call. {reason}. Prepare again for these arguments "
        f"(di.prepare_{prep.operator}(...)), or prepare with strict=False to let mismatched "
        "calls prepare afresh."
    )


class _Entries(OrderedDict[Any, Prep]):
    """One function's preps by ``(method function, signature)``, least recently used first,
    and the prep each ``(method function, operator)`` used last."""

    def __init__(self) -> None:
        super().__init__()
        self.latest: dict[tuple[Any, str], Prep] = {}


class _PrepCache:
    """Preps of unprepared calls, keyed weakly on ``f`` and then on the signature.

    An entry lives as long as ``f`` does (for a bound method, as long as its object), and
    each function keeps at most ``per_function`` signatures, the least recently used leaving
    first. :meth:`recent` finds the prep a call most likely reuses without taking the call's
    signature: its :attr:`Prep.fast` tells whether it fits.
    """

    per_function = 16

    def __init__(self) -> None:
        self._weak: weakref.WeakKeyDictionary[Any, _Entries] = weakref.WeakKeyDictionary()
        self._strong: OrderedDict[Any, _Entries] = OrderedDict()
        self._lock = threading.Lock()

    def _owner(self, f: Callable[..., Any]) -> tuple[Any, Any, bool]:
        if isinstance(f, types.MethodType):
            owner, sub = f.__self__, f.__func__
        else:
            owner, sub = f, None
        try:
            weakref.ref(owner)
        except TypeError:
            return owner, sub, False
        return owner, sub, True

    def get(self, f: Callable[..., Any], signature: Signature) -> Prep | None:
        owner, sub, weak = self._owner(f)
        table = self._weak if weak else self._strong
        try:
            entries = table.get(owner)
        except TypeError:  # an unhashable callable object: no caching
            return None
        if entries is None:
            return None
        key = (sub, signature)
        with self._lock:
            prep = entries.get(key)
            if prep is None or not prep.function.matches(f):
                # (the table compares owners by equality: an equal, distinct object is not f's)
                return None
            entries.move_to_end(key)
            entries.latest[sub, signature.operator] = prep
        return prep

    def recent(self, f: Callable[..., Any], operator: str) -> Prep | None:
        """The prep of ``operator`` that ``f`` used last; None if there is none."""
        if type(f) is types.FunctionType:  # the common case, without the checks of _owner
            # (the table's own dict, keyed by weak references: its get() is a Python frame)
            entries = self._weak.data.get(weakref.ref(f))  # type: ignore[attr-defined]
            sub = None
        else:
            owner, sub, weak = self._owner(f)
            try:
                entries = (self._weak if weak else self._strong).get(owner)
            except TypeError:
                return None
        return None if entries is None else entries.latest.get((sub, operator))

    def put(self, f: Callable[..., Any], signature: Signature, prep: Prep) -> None:
        owner, sub, weak = self._owner(f)
        table: Any = self._weak if weak else self._strong
        with self._lock:
            try:
                entries = table.get(owner)
                if entries is None:
                    entries = table[owner] = _Entries()
            except TypeError:
                return
            entries[(sub, signature)] = prep
            entries.latest[sub, signature.operator] = prep
            while len(entries) > self.per_function:
                entries.popitem(last=False)
            if not weak:
                table.move_to_end(owner)
                while len(table) > 256:
                    table.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._weak.clear()
            self._strong.clear()

    def __len__(self) -> int:
        with self._lock:  # (entries are added under the lock: none while this counts)
            return sum(len(e) for e in list(self._weak.values())) + sum(len(e) for e in self._strong.values())


prep_cache = _PrepCache()
