"""Preparation: the one-time work of an operator, the signature it was made for, and the
weak cache that lets unprepared calls reuse it."""

from __future__ import annotations

import contextlib
import dis
import functools
import itertools
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _arrays
from ._errors import PreparationMismatchError, UnsupportedOperationError
from ._families import foreign_contents
from ._families._shared import array_words
from ._keys import slots as _slots
from .tree import path_string

if TYPE_CHECKING:
    from ._families._shared import Held
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
    x_order: tuple[tuple[Any, ...], ...] = ()
    """The keys of x's dicts of two or more keys, each in its order (results mirror it; tree
    structures compare equal whatever the order)."""
    context_orders: tuple[tuple[tuple[Any, ...], ...], ...] = ()
    """Per context, the same: f gets each context rebuilt in the prep's structure, so another
    order would reach f as the prep's (``x, y = batch.values()`` would swap them)."""


class FunctionRef:
    """A weak reference to ``f`` that also works for bound methods and builtins.

    Preps and the cache never keep ``f`` alive: a closure made afresh for each call is
    collected as usual, and its cache entries with it.
    """

    __slots__ = ("name", "ref")

    def __init__(self, f: Callable[..., Any]) -> None:
        self.name = getattr(f, "__qualname__", None) or repr(f)
        ref: Callable[[], Any]
        try:
            ref = weakref.WeakMethod(f) if isinstance(f, types.MethodType) else weakref.ref(f)
        except TypeError:  # builtins, and methods of objects without weak references, live long
            ref = functools.partial(_identity, f)
        self.ref = ref

    def __call__(self) -> Callable[..., Any]:
        f = self.ref()
        if f is None:  # pragma: no cover - the caller holds f while calling
            raise ReferenceError(f"the function {self.name} no longer exists")
        return f  # type: ignore[no-any-return]

    def matches(self, f: Callable[..., Any]) -> bool:
        mine = self.ref()
        if mine is f:
            return True
        if isinstance(mine, types.MethodType) and isinstance(f, types.MethodType):
            return mine.__self__ is f.__self__ and mine.__func__ is f.__func__
        return False


def _identity(f: Any) -> Any:
    return f


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
    """What ``f`` reads besides its arguments, as a compiled program or a sparsity pattern keeps
    it: an unprepared call whose f reads anything else prepares again (the rule of
    docs/preparation.md, read by :func:`_reads`); each object compared by identity, arrays also
    by their contents."""

    __slots__ = ("_arrays", "_ids", "_keep", "holds")

    def __init__(self, f: Callable[..., Any]) -> None:
        chain: list[tuple[types.FunctionType, int, int]] = []
        values = _reads(f, chain)
        self._keep = values  # (the ids stay those of live objects)
        self._ids = list(map(id, values))
        self._arrays = [(i, found) for i, v in enumerate(values) if (found := _contents(v)) is not None]
        self.holds: Callable[[Callable[..., Any]], bool] = self._holds
        """``holds(f)``: whether ``f`` reads the same objects, and the arrays among them hold the
        same values."""
        if (
            type(f) is types.FunctionType
            and not any("__wrapped__" in fn.__dict__ for fn, _, _ in chain)
            and sum(n for _, _, n in chain) == len(values)  # (no object followed: its reads are no function's)
        ):
            # (f and the helpers it follows are functions, whose reads are all there is: a test
            # settled for each, _settled_holds, joined by _all_hold)
            parts = [
                _settled_holds(
                    fn,
                    values[start : start + n],
                    [(i - start, c) for i, c in self._arrays if start <= i < start + n],
                    self._holds if fn is f else _never,
                )
                for fn, start, n in chain
            ]
            self.holds = parts[0] if len(parts) == 1 else _all_hold(parts[0], parts[1:], [fn for fn, _, _ in chain[1:]])

    def rewritten(self) -> bool:
        """Whether an array f reads was read by an earlier closure (of any f) and written in
        place since: an engine that caches its traces by the arrays they read (jax) must forget
        them. Each array's contents are recorded for the next closure to compare."""
        rewritten = False
        for i, contents in self._arrays:
            value = self._keep[i]
            if _arrays.family_of(value) is None:  # (a pytree's leaves: jax's arrays, never written in place)
                continue
            key = id(value)
            seen = _READ.get(key)
            if seen is not None and seen[0]() is value and not seen[1].holds(value):
                rewritten = True
            try:
                ref = weakref.ref(value, functools.partial(_forget_read, key))
            except TypeError:  # (an array without weak references: not recorded)
                continue
            _READ[key] = (ref, contents)
        return rewritten

    def _holds(self, f: Callable[..., Any]) -> bool:
        values = _reads(f)
        if list(map(id, values)) != self._ids:
            return False
        for i, contents in self._arrays:  # noqa: SIM110
            if not contents.holds(values[i]):
                return False
        return True


def _all_hold(
    first: Callable[[Callable[..., Any]], bool],
    helpers: list[Callable[[Callable[..., Any]], bool]],
    functions: list[types.FunctionType],
) -> Callable[[Callable[..., Any]], bool]:
    """:meth:`Closure.holds` of a function that follows helpers: its own test, then each
    helper's on the helper itself (the object its own test found unchanged)."""
    pairs = list(zip(helpers, functions, strict=True))

    def holds(f: Callable[..., Any]) -> bool:
        if not first(f):
            return False
        for test, function in pairs:  # noqa: SIM110
            if not test(function):
                return False
        return True

    return holds


def _never(f: Callable[..., Any]) -> bool:
    """A helper's test where its own settled one cannot tell (it gained ``__wrapped__``): not
    the same, so the call prepares again."""
    return False


def _settled_holds(
    function: types.FunctionType,
    values: list[Any],
    arrays: list[tuple[int, Any]],
    general: Callable[[Callable[..., Any]], bool],
) -> Callable[[Callable[..., Any]], bool]:
    """:meth:`Closure.holds` for one function, its reads (``values``, :func:`_function_reads`)
    settled once and compared by identity in plain loops (cheaper than the general test, which
    reads f again: ``python benchmarks/closure_test.py``). Another kind of f, an empty cell, a
    ``__wrapped__`` added since or defaults in another tuple are left to ``general``."""
    code = function.__code__
    cells = len(function.__closure__ or ())
    names, attributes, keys = _loads(code)
    namespace = function.__globals__
    absent = [name for name in names if name not in namespace]  # (a name defined since shadows)
    defaults = len(function.__defaults__ or ())
    keywords = tuple(function.__kwdefaults__ or {})
    globals_at = 1 + cells
    defaults_at = globals_at + len(names)
    if any(v is _EMPTY_CELL for v in values[1:globals_at]):
        return general  # (an empty cell: the general test tells)
    cell_values = values[1:globals_at]
    global_pairs = tuple(
        (name, value) for name, value in zip(names, values[globals_at:defaults_at], strict=True) if name in namespace
    )
    default_values = function.__defaults__  # (a tuple: where f still holds this one, its objects are these)
    entries_at = defaults_at + defaults + 1 + 2 * len(keywords)  # (after the keyword defaults)
    keyword_pairs = tuple(zip(keywords, values[defaults_at + defaults + 2 : entries_at : 2], strict=True))
    entries = values[entries_at + 1 :]  # (the entries the code names, where there are any)
    entry_ids = list(map(id, entries))
    holders = (*cell_values, *(v for _, v in global_pairs), *(default_values or ()), *(v for _, v in keyword_pairs))
    held = [(contents, values[i]) for i, contents in arrays]  # (the array read then: its contents now)
    function_type = types.FunctionType

    def holds(f: Any) -> bool:
        if type(f) is not function_type or "__wrapped__" in f.__dict__:
            return general(f)
        if f.__code__ is not code:
            return False
        g = f.__globals__
        for name in absent:
            if name in g:
                return False
        try:
            for name, value in global_pairs:
                if g[name] is not value:
                    return False
            if cells:
                for cell, value in zip(f.__closure__ or (), cell_values):  # noqa: B905 (the code fixes the count)
                    if cell.cell_contents is not value:
                        return False
        except KeyError:  # (a global deleted)
            return False
        except ValueError:  # (an empty cell)
            return general(f)
        if f.__defaults__ is not default_values:
            return general(f)  # (other defaults, or the same objects in a new tuple: read one by one)
        if keyword_pairs:
            now_keywords = f.__kwdefaults__
            if now_keywords is None or len(now_keywords) != len(keyword_pairs):
                return False
            for name, value in keyword_pairs:
                if now_keywords.get(name, _UNDEFINED) is not value:
                    return False
        elif f.__kwdefaults__:
            return False
        # (the same holders, as read above: what they hold under the names now; the names read
        # once above, not through _held_by, which would make this test hold f, kept weakly)
        if entries:
            now: list[Any] = []
            for holder in holders:
                _named_entries(holder, attributes, keys, now, _HELD_LEVELS)
            if list(map(id, now)) != entry_ids:
                return False
        for contents, value in held:  # noqa: SIM110
            if not contents.holds(value):
                return False
        return True

    return holds


_MOST_FOLLOWED = 32
"""Callables followed per f at most (f itself, what it wraps, the helpers it calls)."""


# (what stands among the objects f reads for: a global f names, not defined; an empty closure
# cell; a callable's type without __call__; where the defaults end and the keyword-only begin;
# where the entries its code names start)
_UNDEFINED, _EMPTY_CELL, _NO_CALL, _KEYWORD_DEFAULTS, _HELD = object(), object(), object(), object(), object()
_HELD_LEVELS = 3
"""Levels of entries followed below an object f reads (``self.model.w``: two)."""
_MOST_HELD = 256
"""Entries followed per function at most (names and objects): past it, no more are followed."""
_NOT_HOLDERS = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
"""Objects whose attributes are not followed as entries: modules, classes (their attributes a
method reads are :func:`_class_reads`'), functions (followed as functions)."""


def _reads(f: Any, chain: list[tuple[types.FunctionType, int, int]] | None = None) -> list[Any]:
    """The objects calling ``f`` reads besides its arguments, in an order fixed by them.
    ``chain``, where given, gets each function followed (``f`` first), where its own reads
    start among them and how many there are."""
    if type(f) is types.FunctionType:  # the common case: a function that reads no other one
        values = _function_reads(f)
        if (
            types.FunctionType not in map(type, values)
            and "__wrapped__" not in f.__dict__
            and not _objects_called(f, values)
        ):
            if chain is not None:
                chain.append((f, 0, len(values)))
            return values
    values = []
    _follow(f, values, set(), chain)
    return values


def _follow(f: Any, values: list[Any], seen: set[int], chain: list[Any] | None = None) -> None:
    if id(f) in seen or len(seen) >= _MOST_FOLLOWED:
        return
    seen.add(id(f))
    cls = type(f)
    if cls is types.FunctionType:
        start = len(values)
        values += _function_reads(f)
        if chain is not None:
            chain.append((f, start, len(values) - start))
        namespace = f.__globals__
        cells = start + len(f.__closure__ or ())  # (values[start + 1 : cells + 1]: its closure cells' objects)
        # the functions it closes over, and the helpers of its own module that it names
        for i in range(start + 1, len(values)):
            value = values[i]
            if type(value) is types.FunctionType and (i <= cells or value.__globals__ is namespace):
                _follow(value, values, seen, chain)
        # the objects it calls or calls a method of (``model(x)``, ``model.apply(x)``): what
        # their methods read through them (``self.W``), as for f itself
        for value in _objects_called(f, values[start:]):
            values.append(type(value))
            _class_reads(value, f, values, seen)
            if "__call__" in _methods(type(value)):
                _follow(value, values, seen)
    elif cls is types.MethodType:
        values.append(f.__func__)  # (not f.__self__: the cache is keyed weakly on it)
        _instance(f.__self__, values)
        values += _held_by((f.__self__,), f.__func__, _HELD_LEVELS + 1)  # (self.model.w)
        _follow(f.__func__, values, seen)
        _class_reads(f.__self__, f.__func__, values, seen)
        return  # (a method's __wrapped__ is its function's, followed there)
    elif isinstance(f, functools.partial):
        values += (cls, f.func, f.args, f.keywords, *f.args)
        for item in f.keywords.items():
            values += item
        if type(f.func) is types.FunctionType:  # (its arguments hold data as globals do)
            values += _held_by((*f.args, *f.keywords.values()), f.func)
        _follow(f.func, values, seen)
    else:  # a callable object: what its type's __call__ reads, and its own attributes
        call = getattr(cls, "__call__", _NO_CALL)  # noqa: B004  (the function itself is followed)
        values += (cls, call)
        _instance(f, values)
        if type(call) is types.FunctionType:
            values += _held_by((f,), call, _HELD_LEVELS + 1)
            _follow(call, values, seen)
            _class_reads(f, call, values, seen)
    wrapped = getattr(f, "__wrapped__", None)
    if wrapped is not None:
        values.append(wrapped)
        _follow(wrapped, values, seen)


def _objects_called(function: types.FunctionType, reads: list[Any]) -> list[Any]:
    """The objects among a function's closure cells and globals (``reads``, from
    :func:`_function_reads`) whose class defines in Python ``__call__`` or a method or property
    its code names: objects it may call into, whose methods read what they hold. Not arrays,
    whose families compare them by contents."""
    names, attributes, _ = _loads(function.__code__)
    found = []
    for value in reads[1 : 1 + len(function.__closure__ or ()) + len(names)]:
        if isinstance(value, _NOT_HOLDERS) or _arrays.family_of(value) is not None:
            continue
        methods = _methods(type(value))
        if methods and ("__call__" in methods or not methods.isdisjoint(attributes)):
            found.append(value)
    return found


_METHODS: dict[type, frozenset[str]] = {}


def _methods(cls: type) -> frozenset[str]:
    """The names of the Python functions and properties a class and its bases (not the
    builtins) define; kept per class, a bounded table."""
    methods = _METHODS.get(cls)
    if methods is None:
        methods = frozenset(
            name
            for klass in cls.__mro__
            if klass.__module__ != "builtins"
            for name, value in vars(klass).items()
            if type(value) is types.FunctionType or isinstance(value, property)
        )
        if len(_METHODS) >= 1024:
            _METHODS.clear()
        _METHODS[cls] = methods
    return methods


def _function_reads(function: types.FunctionType) -> list[Any]:
    """What one function reads: its code, its closure cells' objects, the globals its code
    names, its defaults and keyword-only defaults (names and objects)."""
    code = function.__code__
    values: list[Any] = [code]
    cells = function.__closure__
    if cells:
        for cell in cells:
            try:
                values.append(cell.cell_contents)
            except ValueError:
                values.append(_EMPTY_CELL)
    values += map(function.__globals__.get, _loads(code)[0], itertools.repeat(_UNDEFINED))
    holders = values[1:]  # (its closure cells' objects and its globals; then its defaults)
    defaults = function.__defaults__
    if defaults:
        values += defaults
    values.append(_KEYWORD_DEFAULTS)  # (where the defaults end)
    keyword_defaults = function.__kwdefaults__
    if keyword_defaults:
        for item in keyword_defaults.items():
            values += item
    entries = _held_by((*holders, *(defaults or ()), *(keyword_defaults or {}).values()), function)
    if entries:
        values.append(_HELD)  # (where the entries its code names start)
        values += entries
    return values


def _held_by(holders: Iterable[Any], function: types.FunctionType, levels: int = _HELD_LEVELS) -> list[Any]:
    """What ``holders`` hold under the names ``function``'s code uses (:func:`_named_entries`)."""
    _, attributes, keys = _loads(function.__code__)
    entries: list[Any] = []
    if attributes or keys:
        for holder in holders:
            _named_entries(holder, attributes, keys, entries, levels)
    return entries


def _named_entries(
    holder: Any, attributes: tuple[str, ...], keys: tuple[Any, ...], values: list[Any], levels: int
) -> None:
    """What ``holder`` (an object f reads) holds under the names f's code uses, added to
    ``values``, each name and the object: a dict's entries under its constant subscripts, a
    list's at its constant indices, another object's own attributes (not a module's, a class's
    or a function's); so on, ``levels`` deep, up to ``_MOST_HELD`` (``jax.jit`` bakes in
    ``state["w"]`` and ``self.model.w`` as it does a global)."""
    if len(values) >= _MOST_HELD:
        return
    start = len(values)
    if isinstance(holder, dict):
        for key in keys:
            value = dict.get(holder, key, _UNDEFINED)
            if value is not _UNDEFINED:
                values += (key, value)
    elif type(holder) is list:
        for key in keys:
            if type(key) is int and -len(holder) <= key < len(holder):
                values += (key, holder[key])
    elif not isinstance(holder, _NOT_HOLDERS):
        try:
            own = getattr(holder, "__dict__", None)
        except Exception:  # (a proxy whose attribute lookup fails otherwise: not followed)
            return
        if type(own) is dict and own:
            for name in attributes:
                value = own.get(name, _UNDEFINED)
                if value is not _UNDEFINED:
                    values += (name, value)
        slots = _slots(type(holder))
        if slots:
            for name in attributes:
                slot = slots.get(name)
                if slot is not None:
                    with contextlib.suppress(AttributeError):  # (a slot not set: passed over)
                        values += (name, slot.__get__(holder, None))
    if levels > 1:
        for value in values[start + 1 :: 2]:
            _named_entries(value, attributes, keys, values, levels - 1)


def _instance(obj: Any, values: list[Any]) -> None:
    """An object's own attributes, one level: each name and the object it holds (in its
    ``__dict__`` and its classes' ``__slots__``)."""
    attributes = getattr(obj, "__dict__", None)
    if type(attributes) is dict:
        for item in attributes.items():
            if item[1] is not obj:  # (not itself: the cache is keyed weakly on it)
                values += item
    for name, slot in _slots(type(obj)).items():
        try:
            value = slot.__get__(obj, None)
        except AttributeError:  # (a slot not set)
            value = _EMPTY_CELL
        if value is not obj:
            values += (name, value)


def _class_reads(obj: Any, function: types.FunctionType, values: list[Any], seen: set[int]) -> None:
    """What a method ``function`` of ``obj``'s class reads through its attributes from the class:
    each attribute its code names that the class holds (a class constant, a method), and what
    the methods and properties among them read in turn (``self.forward(x)`` reading a global)."""
    mro = type(obj).__mro__
    for name in _loads(function.__code__)[1]:
        for klass in mro:
            if name in klass.__dict__:
                value = klass.__dict__[name]
                values += (name, value)
                method = value.fget if isinstance(value, property) else value
                if type(method) is types.FunctionType and id(method) not in seen:
                    values += _held_by((obj,), method, _HELD_LEVELS + 1)
                    _follow(method, values, seen)
                    # (past the most callables followed, _follow takes no more: nor is what the
                    # method reads through the class read then, or two methods that call each
                    # other would be read in turn without end)
                    if id(method) in seen:
                        _class_reads(obj, method, values, seen)
                break


@functools.lru_cache(maxsize=1024)
def _loads(code: types.CodeType) -> tuple[tuple[str, ...], tuple[str, ...], tuple[Any, ...]]:
    """The global names, the attribute names (``self.forward``: ``forward``) and the constant
    subscripts (``state["w"]``: ``"w"``) a code object and the code nested in it load, each once."""
    loaded: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
    before = None
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            loaded[0].append(instruction.argval)
        elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            loaded[1].append(instruction.argval)
        elif (
            instruction.opname == "BINARY_SUBSCR"
            and before is not None
            and before.opname == "LOAD_CONST"
            and isinstance(before.argval, (str, int))
        ):
            loaded[2].append(before.argval)
        before = instruction
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            for names, inner in zip(loaded, _loads(const), strict=True):
                names.extend(inner)
    return tuple(dict.fromkeys(loaded[0])), tuple(dict.fromkeys(loaded[1])), tuple(dict.fromkeys(loaded[2]))


_KEPT = 1 << 24
"""Bytes of an array whose contents a closure keeps a copy of; a larger array's are hashed
(a copy would double the memory it takes; comparing a copy costs less than hashing)."""


_READ: dict[int, tuple[weakref.ref[Any], Held]] = {}
"""Each array a closure has read (by id, while it lives), with its contents then: what
:meth:`Closure.rewritten` compares."""


def _forget_read(key: int, ref: weakref.ref[Any]) -> None:
    seen = _READ.get(key)
    if seen is not None and seen[0] is ref:  # (not a newer array at that address)
        del _READ[key]


def _contents(value: Any) -> Held | None:
    """What a closure keeps of ``value`` to compare its contents: an array's, by its family; a
    pytree only jax knows, its leaves (a flax nnx ``Variable`` holds a new array after an
    update); None where it is compared by identity only."""
    family = _arrays.family_of(value)
    return foreign_contents(value) if family is None else family.contents(value, _KEPT)


def describe_mismatch(prep: Prep, f: Callable[..., Any], signature: Signature) -> str | None:
    """What differs between ``prep`` and a call, in words; None when nothing does."""
    old = prep.signature
    if not prep.function.matches(f):
        name = getattr(f, "__qualname__", repr(f))
        if name != prep.function.name:
            return f"f: prepared for {prep.function.name}, called with {name}"
        if prep.function.ref() is None:
            what = f"a function named `{name}` that no longer exists, called with a new function of that name"
        else:
            what = f"a different function object with the same name `{name}`"
        return f"f: prepared for {what} (redefined? a notebook cell run again makes a new one)"
    for part in ("operator", "backend", "has_aux"):
        if getattr(old, part) != getattr(signature, part):
            return f"{part}: prepared for {getattr(old, part)!r}, called with {getattr(signature, part)!r}"
    for label, spec, leaves in (("x", "x_spec", "x_leaves"), ("tangent", "tangent_spec", "tangent_leaves")):
        found = _tree_difference(
            label, getattr(old, spec), getattr(signature, spec), getattr(old, leaves), getattr(signature, leaves)
        )
        if found:
            return found
    for a, b in zip(old.x_order, signature.x_order, strict=False):
        if a != b:
            return f"x's dict keys: prepared in the order {list(a)}, called in the order {list(b)}"
    if len(old.contexts) != len(signature.contexts):
        return f"contexts: prepared with {len(old.contexts)}, called with {len(signature.contexts)}"
    for i, (a, b) in enumerate(zip(old.contexts, signature.contexts, strict=True)):
        if a[0] is not b[0]:
            return f"context {i}: prepared as {a[0].__name__}, called with {b[0].__name__}"
        found = _tree_difference(f"context {i}", a[1], b[1], a[2], b[2])
        if found:
            return found
    for i, (a, b) in enumerate(zip(old.context_orders, signature.context_orders, strict=False)):
        for keys_a, keys_b in zip(a, b, strict=False):
            if keys_a != keys_b:
                return (
                    f"context {i}'s dict keys: prepared in the order {list(keys_a)}, called in the order {list(keys_b)}"
                )
    return None


def _tree_difference(
    label: str, spec_a: Any, spec_b: Any, leaves_a: tuple[Any, ...], leaves_b: tuple[Any, ...]
) -> str | None:
    if spec_a != spec_b:
        return f"{label} structure: prepared for {spec_a}, called with {spec_b}"
    if leaves_a == leaves_b:
        return None
    for i, (a, b) in enumerate(zip(leaves_a, leaves_b, strict=True)):
        if a != b:
            where = path_string(spec_a.paths()[i])  # (leaves_a's structure: None has no leaves)
            trace = _trace_of(b)
            if trace is not None and _trace_of(a) is None:
                return (
                    f"{label}{where}: prepared for {_describe_leaf(a)}, called under {trace} with a traced "
                    "array. A prep holds a program made for concrete arrays: call without prep= inside the "
                    "trace, or prepare inside it"
                )
            prepared, called = _describe_leaf(a), _describe_leaf(b)
            if prepared == called:  # (a difference the words above do not show)
                prepared, called = _told_apart(a, b, prepared, called)
            return f"{label}{where}: prepared for {prepared}, called with {called}"
    return None  # pragma: no cover - equal specs and unequal leaves differ somewhere


def _told_apart(a: tuple[Any, ...], b: tuple[Any, ...], prepared: str, called: str) -> tuple[str, str]:
    """The words for two leaves :func:`_describe_leaf` gives alike: a static leaf by its value,
    or as another object where a prep keeps the one it was made for (a model a sparsity
    pattern was found for); else the signatures themselves."""
    if a[0] == b[0] == "static" and len(a) > 2 and len(b) > 2:
        if a[2][0] == b[2][0] == "identity":
            return prepared, f"another {b[1].__name__} object (a prep is made for the object it was given)"
        if a[2][0] is a[1] and b[2][0] is b[1]:  # (compared by value)
            return f"{prepared} equal to {_keyed_value(a[2])!r}", f"{called} equal to {_keyed_value(b[2])!r}"
    return f"{prepared} {a!r}", f"{called} {b!r}"


def _keyed_value(key: tuple[Any, ...]) -> Any:
    """The value a static key (:func:`~diffiface._keys.static_key`) compares by."""
    if key[0] is float:
        return float.fromhex(key[1])
    if key[0] is complex:
        return complex(float.fromhex(key[1]), float.fromhex(key[2]))
    return key[1]


def _trace_of(signature: tuple[Any, ...]) -> str | None:
    """The trace a leaf of this signature was traced under, in words; None for a concrete leaf."""
    family = _arrays.BY_KIND.get(signature[0])
    return None if family is None else family.trace_of(signature)


def _describe_leaf(signature: tuple[Any, ...]) -> str:
    kind = signature[0]
    if kind == "static":
        if len(signature) > 3:  # (a plain object in a sparse prep's context: the arrays it holds)
            held = ", ".join(_describe_leaf(leaf) for leaf in signature[3])
            return f"a {signature[1].__name__} holding {held}"
        return f"a {signature[1].__name__} (not an array)"
    if kind == "other":  # a pytree only jax knows: its class, then its leaves' shapes and dtypes
        leaves = ", ".join(f"{shape} {dtype}" for shape, dtype in (signature[3] if len(signature) > 3 else ()))
        return f"a {signature[1].__name__} with leaves of shape and dtype [{leaves}]"
    family = _arrays.BY_KIND.get(kind)
    return array_words(signature) if family is None else family.describe(signature)


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
    """Preps of unprepared calls, keyed weakly on ``f`` (for a bound method, its object; its
    entries go when it is collected) and then on the signature, at most ``per_function`` each,
    least recently used leaving first. :meth:`recent` finds the prep a call most likely reuses
    without taking the call's signature."""

    per_function = 16

    def __init__(self) -> None:
        self._functions: dict[weakref.ref[Any], _Entries] = {}
        self._strong: OrderedDict[Any, _Entries] = OrderedDict()
        self._lock = threading.Lock()

    def _entries(self, f: Callable[..., Any]) -> tuple[_Entries | None, Any]:
        """``f``'s entries (None: none) and the method function its keys hold (None: f is no method)."""
        owner, sub = (f.__self__, f.__func__) if isinstance(f, types.MethodType) else (f, None)
        try:
            return self._functions.get(weakref.ref(owner)), sub
        except TypeError:  # (an owner without weak references; or an unhashable one: no caching)
            try:
                return self._strong.get(owner), sub
            except TypeError:
                return None, sub

    def get(self, f: Callable[..., Any], signature: Signature, types: Any) -> Prep | None:
        """The prep of ``f`` for ``signature`` and the call's leaf ``types`` (a plan tests the
        leaves' types: a prep of nn.Parameters would never fit plain tensors of the same
        signature, each call taking the slow path); None if there is none."""
        entries, sub = self._entries(f)
        if entries is None:
            return None
        key = (sub, signature, types)
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
        if type(f) is types.FunctionType:  # the common case, without the checks of _entries
            # (functions by weak reference, in a dict of this class's own: a weak key
            # dictionary's get() is a Python frame, and its inner dict is CPython's detail)
            try:
                entries = self._functions.get(weakref.ref(f))
            except TypeError:  # (an unhashable function object)
                return None
            sub = None
        else:
            entries, sub = self._entries(f)
        return None if entries is None else entries.latest.get((sub, operator))

    def put(self, f: Callable[..., Any], signature: Signature, prep: Prep, leaf_types: Any) -> None:
        owner, sub = (f.__self__, f.__func__) if isinstance(f, types.MethodType) else (f, None)
        with self._lock:
            key: Any
            table: Any
            try:
                try:
                    key, table = weakref.ref(owner, self._collected), self._functions
                except TypeError:  # (an owner without weak references)
                    key, table = owner, self._strong
                entries = table.get(key)
                if entries is None:
                    entries = table[key] = _Entries()
            except TypeError:  # (an unhashable owner: not cached)
                return
            entries[(sub, signature, leaf_types)] = prep
            entries.latest[sub, signature.operator] = prep
            while len(entries) > self.per_function:
                entries.popitem(last=False)
            if table is self._strong:
                table.move_to_end(owner)
                while len(table) > 256:
                    table.popitem(last=False)

    def _collected(self, reference: weakref.ref[Any]) -> None:
        """A weakly referenced owner was collected: its entries go (a dead reference is equal to
        itself only, and keeps the hash it had)."""
        self._functions.pop(reference, None)  # (no lock: the collector may run while it is held)

    def clear(self) -> None:
        with self._lock:
            self._functions.clear()
            self._strong.clear()

    def __len__(self) -> int:
        with self._lock:  # (entries are added under the lock: none while this counts)
            return sum(len(e) for e in list(self._functions.values())) + sum(len(e) for e in self._strong.values())


prep_cache = _PrepCache()
