"""Sparsity patterns of Jacobians and Hessians: traced once (global), sampled (local), or given."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _arrays, _families, tree
from .._contexts import Context
from .._errors import ContextError, InvalidInputError
from ._coloring import as_pattern
from ._graphs import Detection as Detection

if TYPE_CHECKING:
    from scipy.sparse import csr_array

__all__ = [
    "TRACERS",
    "Detection",
    "Detector",
    "GlobalDetector",
    "detect",
    "KnownPattern",
    "LocalDetector",
    "hessian_pattern",
    "jacobian_pattern",
]


TRACERS = ("auto", *(kind for kind in _arrays.BY_KIND if importlib.util.find_spec(f"{__package__}._{kind}_trace")))
"""The tracers of :class:`GlobalDetector`: each a family's (``sparse/_<family>_trace.py``, with
``trace_pattern(f, x, values, hessian)``), or ``"auto"``."""


def _tracer(name: str) -> Any:
    """The tracer module of family ``name``."""
    return importlib.import_module(f"{__package__}._{name}_trace")


@dataclass(frozen=True)
class GlobalDetector:
    """The pattern read from ``f``'s program, traced once, for every ``x`` and every value of the
    contexts (their arrays are traced as abstract arrays, those a plain object in them holds
    too): conservative, never missing a nonzero
    anywhere in the domain. Where an operation's structure is not known, each of its outputs
    depends on everything its inputs depend on (and the detection's notes name it); where the
    numpy tracer cannot follow ``f`` at all, every output depends on every input. Arrays ``f``
    closes over are constants: their values count (indices, zeros of a matrix). A ``f`` whose
    program depends on x's values (a Python ``if`` on them) is refused with the reason.

    ``tracer`` says which tracer reads the program:

    - ``"jax"``: ``jax.make_jaxpr``, for jax functions and functions written against the array
      API; a Hessian pattern is the Jacobian pattern of ``jax.grad(f)``'s program.
    - ``"torch"``: ``make_fx`` to a graph of aten operations on fake tensors, for torch-written f.
    - ``"numpy"``: f run once on an array of index sets that follows numpy's array protocols,
      for numpy- and autograd.numpy-written f.
    - ``"auto"`` (the default): torch when x holds torch tensors or the backend is torch's; jax
      when x holds jax arrays or the backend is jax's; numpy otherwise (autograd, finite
      differences, scipy on numpy x), then jax where f hands the numpy tracer's arrays to
      functions that fail on them or convert them (a function written with jax.numpy) and
      catches none of its refusals; a refusal for a value, or one f caught, stands.

    The torch and numpy tracers find a Hessian pattern with one more accumulator: each nonlinear
    operation adds the pairs of inputs its second derivative couples.
    """

    tracer: str = "auto"

    def __repr__(self) -> str:
        return "GlobalDetector()" if self.tracer == "auto" else f"GlobalDetector(tracer={self.tracer!r})"

    def __post_init__(self) -> None:
        if self.tracer not in TRACERS:
            raise InvalidInputError(
                f"GlobalDetector(tracer={self.tracer!r}) is not a tracer; choose one of {', '.join(map(repr, TRACERS))}."
            )


@dataclass(frozen=True)
class LocalDetector:
    """The nonzeros of ``points`` dense Jacobians (Hessians) at random points near ``x``,
    computed with the dense ``backend`` given, united.

    Local: a nonzero that vanishes at each of those points (a branch not taken there, a product
    with a coordinate that happens to be zero) is missed, and a sparse operator built on the
    pattern then returns zero for it. Use it for functions jax cannot trace, and check it, or
    give the pattern (:class:`KnownPattern`) where it is known.

    Each point multiplies each coordinate of ``x`` by ``1 + u / 10`` (``u`` uniform in
    ``[-1, 1]``, seeded by ``seed``), and sets a zero coordinate to ``u / 10``; signs are kept, so a
    function defined for positive inputs stays defined.
    """

    points: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("points", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise InvalidInputError(
                    f"LocalDetector({name}={value!r}): {name} must be an integer of at least {low}"
                    + (" (the number of random points)." if name == "points" else " (the seed of the points).")
                )


@dataclass(frozen=True, eq=False)
class KnownPattern:
    """A pattern the user knows: a scipy.sparse matrix or array, or a boolean (or numeric) 2-d
    array whose nonzeros are the pattern. Validated when used: ``m x n`` for a Jacobian (``m``
    numbers out, ``n`` in, flattened in ``diffiface.tree.ravel`` order), ``n x n`` for a Hessian
    (made symmetric). Compared and hashed by identity."""

    pattern: Any = field(repr=False)


Detector = GlobalDetector | LocalDetector | KnownPattern


# --- arguments ---------------------------------------------------------------------------------


def _arguments(detector: Any, x: Any, contexts: tuple[Any, ...]) -> tuple[list[Any], int]:
    """The contexts' values and the numbers in x, the detector, the contexts and x checked."""
    if not isinstance(detector, (GlobalDetector, LocalDetector, KnownPattern)):
        raise InvalidInputError(
            f"detector must be GlobalDetector(), LocalDetector(...) or KnownPattern(pattern); got {detector!r}."
        )
    values = []
    for i, context in enumerate(contexts):
        if not isinstance(context, Context):
            raise ContextError(
                f"Extra argument {i} of f is a bare {type(context).__name__}; wrap it as di.Constant(...) "
                "(read-only data) or di.Cache(...) (scratch space)."
            )
        values.append(context.value)
    leaves = tree.leaves(x)
    for leaf in leaves:
        if not _arrays.is_float_dtype(_arrays.dtype_name(leaf)):
            raise InvalidInputError(
                f"x must hold floating-point numbers to have a sparsity pattern; found a leaf of dtype "
                f"{_arrays.dtype_name(leaf)}."
            )
    return values, sum(int(np.prod(_arrays.shape(leaf), dtype=np.int64)) for leaf in leaves)


# --- the public functions ------------------------------------------------------------------------


def jacobian_pattern(
    f: Callable[..., Any],
    x: Any,
    *contexts: Any,
    detector: Any = GlobalDetector(),
    backend: Any = None,
) -> csr_array:
    """The sparsity pattern of the Jacobian of ``f`` at ``x``: an ``m x n`` boolean
    ``scipy.sparse.csr_array`` (canonical: sorted indices, no duplicates), ``n`` the numbers in
    ``x`` and ``m`` those in ``f(x, *context_values)``, both in ``diffiface.tree.ravel`` order.

    Parameters
    ----------
    detector
        :class:`GlobalDetector` (default), :class:`LocalDetector` or :class:`KnownPattern`.
    backend
        The dense backend :class:`LocalDetector` differentiates with (required for it).

    Raises
    ------
    InvalidInputError
        A known pattern of the wrong shape; a LocalDetector without a backend.
    UnsupportedOperationError
        ``f`` cannot be traced by jax under :class:`GlobalDetector`.

    Examples
    --------
    >>> import numpy as np
    >>> from diffiface.sparse import KnownPattern, jacobian_pattern
    >>> jacobian_pattern(lambda x: x**2, np.ones(3), detector=KnownPattern(np.eye(3))).toarray()
    array([[ True, False, False],
           [False,  True, False],
           [False, False,  True]])
    """
    return detect(f, x, contexts, detector, backend, hessian=False).pattern


def hessian_pattern(
    f: Callable[..., Any],
    x: Any,
    *contexts: Any,
    detector: Any = GlobalDetector(),
    backend: Any = None,
) -> csr_array:
    """The sparsity pattern of the Hessian of a scalar-valued ``f`` at ``x``: a symmetric
    ``n x n`` boolean ``scipy.sparse.csr_array``, ``n`` the numbers in ``x`` in
    ``diffiface.tree.ravel`` order.

    Parameters and errors as :func:`jacobian_pattern`; a known pattern is made symmetric.

    Examples
    --------
    >>> import numpy as np
    >>> from diffiface.sparse import KnownPattern, hessian_pattern
    >>> known = np.array([[1, 1, 0], [0, 1, 0], [0, 0, 1]])
    >>> hessian_pattern(lambda x: (x**2).sum(), np.ones(3), detector=KnownPattern(known)).toarray()
    array([[ True,  True, False],
           [ True,  True, False],
           [False, False,  True]])
    """
    return detect(f, x, contexts, detector, backend, hessian=True).pattern


def detect(
    f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], detector: Any, backend: Any, hessian: bool
) -> Detection:
    """The Jacobian (``hessian=False``) or Hessian pattern of ``f`` at ``x`` with what found it:
    :func:`jacobian_pattern` (:func:`hessian_pattern`) with the detection's ``tracer`` (``"jax"``,
    ``"torch"``, ``"numpy"``; ``"local"`` or ``"known"`` for the other detectors) and notes."""
    values, n = _arguments(detector, x, contexts)
    if isinstance(detector, KnownPattern):
        return Detection(_known(detector, f, x, values, n, hessian), "known")
    if isinstance(detector, LocalDetector):
        return Detection(_local(f, x, contexts, detector, backend, hessian), "local")
    return _global(f, x, values, detector, backend, hessian, contexts)


def _known(
    detector: KnownPattern, f: Callable[..., Any], x: Any, values: list[Any], n: int, hessian: bool
) -> csr_array:
    """The known pattern, checked against x's ``n`` numbers (and f's, where a tracer can tell)."""
    if hessian:
        p = as_pattern(detector.pattern, what="known Hessian pattern")
        if tuple(p.shape) != (n, n):
            raise InvalidInputError(
                f"The known Hessian pattern has shape {tuple(p.shape)}; x holds {n} numbers, so it must be "
                f"({n}, {n}), in diffiface.tree.ravel order."
            )
        return as_pattern(p + p.T, what="known Hessian pattern")
    p = as_pattern(detector.pattern, what="known Jacobian pattern")
    if p.shape[1] != n:
        raise InvalidInputError(
            f"The known Jacobian pattern has shape {tuple(p.shape)}: {p.shape[1]} columns, but x holds "
            f"{n} numbers. A Jacobian pattern is m x n, n the numbers in x and m those in f(x), both "
            "in diffiface.tree.ravel order."
        )
    m = _output_size(f, x, values)
    if m is not None and p.shape[0] != m:
        raise InvalidInputError(
            f"The known Jacobian pattern has shape {tuple(p.shape)}: {p.shape[0]} rows, but f(x) holds "
            f"{m} numbers. A Jacobian pattern is m x n, n the numbers in x and m those in f(x)."
        )
    return p


# --- global detection: the tracer of f's own engine ------------------------------------------------


def choose_tracer(x: Any, values: list[Any], backend: Any) -> str:
    """The tracer ``GlobalDetector(tracer="auto")`` uses for ``f(x, *values)`` under ``backend``:
    that of x's arrays, else of the arrays the backend's engine calls f with, else the host's
    (in the families' order where several have one)."""
    host = _families.HOST.NAME
    own = [name for name in TRACERS[1:] if name != host]
    kinds = {_arrays.kind(leaf) for leaf in tree.leaves(x)}
    engines = _engines(backend)
    for found in (kinds, engines):
        for name in own:
            if name in found:
                return name
    return host


def _engines(backend: Any) -> set[str]:
    """The families of the arrays the engines of ``backend`` call f with (their registry rows')."""
    if backend is None:
        return set()
    from .._adapters import BACKENDS
    from .._backends import SecondOrder

    if isinstance(backend, str):
        from .._adapters import normalize

        backend = normalize(backend)
    if isinstance(backend, SecondOrder):
        return _engines(backend.outer) | _engines(backend.inner)
    name = str(getattr(backend, "name", ""))
    return {row.arrays for row in BACKENDS if row.name == name}


def _global(
    f: Callable[..., Any],
    x: Any,
    values: list[Any],
    detector: GlobalDetector,
    backend: Any,
    hessian: bool,
    contexts: tuple[Any, ...] = (),
) -> Detection:
    """The global pattern of f's Jacobian (Hessian), read by the tracer ``detector`` names."""
    from .._errors import UnsupportedOperationError

    tracer = detector.tracer if detector.tracer != "auto" else choose_tracer(x, values, backend)
    if tracer != _families.HOST.NAME:
        return _tracer(tracer).trace_pattern(f, x, values, hessian)  # type: ignore[no-any-return]
    module = _tracer(tracer)
    fallback = _host_fallback() if detector.tracer == "auto" else None
    try:
        found: Detection = module.trace_pattern(f, x, values, hessian)
    except (UnsupportedOperationError, module.TracerFailure) as error:
        if fallback is not None and module.another_tracer_may_follow(error):
            try:  # a function written with another framework's array API (jax.numpy) on numpy x
                return _tracer(fallback).trace_pattern(f, x, values, hessian)  # type: ignore[no-any-return]
            except Exception:  # that one cannot follow it either: the host tracer's verdict stands
                pass
        if isinstance(error, UnsupportedOperationError):  # a refusal: what f does depends on x's values
            raise
        # conservative: dense, correct for every f (f runs once on x to count its outputs)
        found = module.dense_pattern(f, x, values, hessian, str(error), _by_engine(f, x, contexts, backend))
    return found


def _by_engine(f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], backend: Any) -> Callable[[], Any] | None:
    """``f(x)`` as the backend's engine computes it (None without a backend): an engine no tracer
    reads may call f with arrays or symbolic variables of its own (mlx's, pytensor's), which f
    needs and a numpy copy of x is not."""
    if backend is None:
        return None
    from .. import _operators

    zeros = tree.map(lambda leaf: _arrays.from_numpy(np.zeros(_arrays.shape(leaf)), like=leaf), x)
    return lambda: _operators.value_and_jvp(f, backend, x, zeros, *contexts)[0]


def _host_fallback() -> str | None:
    """The tracer tried where the host's cannot follow f: the first that reads host arrays too
    (``READS_HOST_ARRAYS``) and whose framework is installed; None where there is none."""
    for name in TRACERS[1:]:
        if name == _families.HOST.NAME or not getattr(_tracer(name), "READS_HOST_ARRAYS", False):
            continue
        if name in sys.modules or importlib.util.find_spec(name) is not None:
            return name
    return None


def _output_size(f: Callable[..., Any], x: Any, values: list[Any]) -> int | None:
    """The numbers in ``f(x)`` where a tracer whose framework is imported can tell without
    running f (None where none can: the check is then left to the operator that runs ``f``)."""
    for name in TRACERS[1:]:
        if name not in sys.modules:  # not worth importing a framework for a check the operator makes anyway
            continue
        size = getattr(_tracer(name), "output_size", None)
        if size is None:
            continue
        try:
            return int(size(f, x, values))
        except Exception:
            return None
    return None


# --- local detection -------------------------------------------------------------------------------


def _near(x: Any, rng: np.random.Generator) -> Any:
    def move(leaf: Any) -> Any:
        a = _arrays.to_numpy(leaf).astype(np.float64)
        u = rng.uniform(-1.0, 1.0, a.shape) / 10
        moved = np.where(a == 0, u, a * (1 + u))
        return _arrays.from_numpy(np.asarray(moved), like=leaf)

    return tree.map(move, x)


def _local(
    f: Callable[..., Any],
    x: Any,
    contexts: tuple[Any, ...],
    detector: LocalDetector,
    backend: Any,
    hessian: bool,
) -> csr_array:
    import scipy.sparse as sp

    from .. import _operators

    if backend is None:
        raise InvalidInputError(
            "LocalDetector differentiates f densely at a few points and needs the dense backend to do it "
            "with: pass backend=... (say di.AutoJAX() or 'finite_differences')."
        )
    rng = np.random.default_rng(detector.seed)
    x_sizes = [int(np.prod(_arrays.shape(leaf), dtype=np.int64)) for leaf in tree.leaves(x)]
    found: np.ndarray | None = None
    for _ in range(detector.points):
        point = _near(x, rng)
        operator = _operators.hessian if hessian else _operators.jacobian
        dense = _assemble(tree.leaves(operator(f, backend, point, *contexts)), x_sizes if hessian else None, x_sizes)
        nonzero = dense != 0  # NaN counts as a nonzero
        found = nonzero if found is None else found | nonzero
    assert found is not None
    if hessian:
        found = found | found.T
    return as_pattern(sp.csr_array(found))


def _assemble(blocks: list[Any], row_sizes: list[int] | None, col_sizes: list[int]) -> np.ndarray:
    """One dense matrix from the leaves of a nested Jacobian (Hessian): row leaf i of column
    leaf j is ``blocks[i * len(col_sizes) + j]``."""
    k = len(col_sizes)
    n = sum(col_sizes)
    if k == 0:
        return np.zeros((0 if row_sizes is None else sum(row_sizes), 0))
    rows = []
    for i in range(len(blocks) // k):
        row = [
            _arrays.to_numpy(blocks[i * k + j]).astype(np.float64).reshape(-1, col_sizes[j]) if col_sizes[j] else None
            for j in range(k)
        ]
        height = next((b.shape[0] for b in row if b is not None), None)
        if height is None:  # every leaf of x is empty: the rows' heights are unknown from here
            height = row_sizes[i] if row_sizes is not None else 0
        rows.append(np.concatenate([b if b is not None else np.zeros((height, 0)) for b in row], axis=1))
    return np.concatenate(rows, axis=0) if rows else np.zeros((0, n))
