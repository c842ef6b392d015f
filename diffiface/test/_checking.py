"""check_gradients: a layer author's one call, and its ground truth."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optree

import diffiface as di

from .. import _arrays
from .. import tree as _tree
from .._adapters import BACKENDS, available, info, install_hint, normalize, rows
from .._backends import AutoFiniteDifferences, AutoJAX, AutoScipy, AutoTorch, Backend
from .._errors import (
    DiffifaceError,
    GradientCheckError,
    InvalidOptionError,
    InvalidOutputError,
    MutationError,
)
from . import _complex_checks, _on_device
from ._compare import assert_allclose, default_tolerances, max_errors
from ._running import (
    _WRITE,
    Report,
    Row,
    _changes_in_float64,
    _computed_reference,
    _copied,
    _float64_copies_scope,
    _float64_scope,
    _is_difference,
    _like,
    _no_grad,
    _on_float64_copies,
    _outcome,
    _promotes,
    _reference_label,
    _twice_on_copies,
    _value,
    _warnings_apart,
    backend_label,
    jax_widened,
    own_call,
)
from ._scenario import Scenario, promote, promote_contexts
from ._snapshot import changes, snapshot

__all__ = ["check_gradients"]


# -- check_gradients ----------------------------------------------------------------------------------

_PROJECTION_THRESHOLD = 4096
"""Above this many inputs the gradient is compared along random directions (8 by default)."""

_SAFETY = 4.0
"""How many of its own error estimates a finite-difference value may be off."""

_RANDOM_ROUNDING = 6.0
"""Along a random direction ``v``, drawn apart from the gradient, how many root sums of squares
``sqrt(sum (floor_i v_i)**2)`` its narrow dtype's rounding may project: the signs of ``v`` are fair
coins, so the projection of rounding errors within the floors exceeds that with a chance below
``2 exp(-c**2 / 2)`` (Hoeffding, given the sizes ``|v_i|``), for each of the directions compared."""

_LAST_BITS = 1.5
"""Where no float64 copy serves, an engine's own rounding per entry is taken as this many times the
spread (root mean square over its leaf) of its gradient's change when every input of x moves by
two units in its last place, at random signs (:meth:`_Check._last_bits`). At the optimum of a
float32 least-squares loss the rounding's own spread measured 1.2 to 1.4 times that change's."""

_RESOLVES = 1e-3
"""Finite differences certify a gradient when their error stays below this fraction of its scale
(a 1% error is then seen by a margin of ten); else the Taylor test judges as well."""

_LOOSE = 0.01
"""An entry whose differences' error allows this fraction of it or more is not judged by them alone."""

_UNJUDGED = 0.1
"""An entry whose differences allow this fraction of it or more, and that no Taylor test decides,
is named "not checked"."""

_VISIBLE = 100.0
"""An entry the differences cannot judge goes to the Taylor test where its first-order term over
the test's top step stands this many times above f's rounding noise (where the test can see it)."""

_TAYLOR_STEPS = 5
_PROBE_FACTOR = 64.0
_PROBES = 6
"""At an edge of f's domain nearer than the step, probes towards it fall by 64, at most 6 times..."""
_HINT_MARGIN = 256.0
"""The first probe: this fraction of x_i's distance to the nearest integer (the cubic's error
estimate, the square of it, stays far below 1% there)."""
_SPARE_EVALUATIONS = 4
"""... within the evaluations the input would have taken and at least this many more, for all the
edges together: the cost stays 4n + 20."""
_NARROW_EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
_LEAF_DIRECTIONS = 16
"""Leaves of x that get a projected direction of their own, beyond the random ones over all."""
_TAYLOR_RATIO = 4.0
_NOISE_DRAWS = 4
"""How many fourth differences at each of two short steps measure f's rounding (:meth:`_Check._measured_noise`)."""


def _float64_precision(backend: Backend) -> str:
    """The dtype whose precision ``backend``'s float64 results have (its registry row's)."""
    try:
        return info(backend).float64_precision
    except Exception:  # (a backend the registry does not know: as its dtype says)
        return "float64"


def check_gradients(
    f: Callable[..., Any],
    x: Any,
    *contexts: Any,
    backends: Sequence[Backend | str] | Backend | str = "available",
    reference: Backend | str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    projections: int | None = None,
    seed: int = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
) -> Report:
    """Check the gradient of ``f`` at ``x`` on every backend, in one call.

    Every requested backend (by default every installed engine that can run ``f``) is compared
    with a finite-difference ground truth and with the other engines; ``f`` must be
    deterministic. Every call made of ``f`` itself gets copies of ``x`` and of the Constants, so
    the caller's data is never touched; an ``f`` that writes into them raises
    :class:`~diffiface.MutationError`. A default engine that cannot run ``f`` (written for another
    framework, numpy code under torch, a pytree with function leaves) is reported skipped with
    the reason: it is judged by its own evaluation of ``f``, which raised; so is one that runs
    ``f`` and refuses to differentiate it with a diffiface error. A string ``backends`` names
    one backend.

    The ground truth stays in f's domain and knows its own error. Per input, central differences
    at the finite-difference default step ``h = eps**(1/3) * max(1, |x_i|)`` and at ``2h``,
    combined by Richardson extrapolation; their difference estimates the error, with the rounding
    error ``eps * |f| / h``, or, where the stencils show f rounding more than that (the terms it
    adds up far larger than f: a naive variance), the rounding measured by fourth differences at
    shorter steps (32 evaluations more). Where a point raises or gives a non-finite value (an edge of f's
    domain), the input gets a step of its own, probed towards the edge (docs/testing.md); inputs
    of x at inf or NaN are held fixed and their entries named unchecked. Each entry of each
    engine's gradient must agree with it within four times that entry's estimate, plus ``rtol``
    (default by dtype) of the entry, plus the rounding of the gradient's dtype (``4 eps`` times
    f's condition over the input's scale): no entry's tolerance depends on the largest entry. An
    AD engine computing in float32 whose entry fails gets its own rounding added (four times its
    gradient's distance from its own gradient on the float64 copies). Where the truth runs on
    float64 copies at float64's precision, that measured rounding replaces float32's share of the
    floor, which grows with ``|f|`` (a rule giving twice the gradient of ``3e7 + sum(x**2)`` in
    float32 passed by it); where the engine's rounding cannot be measured, the floor stands and
    the entries passing by it alone are named not checked on the row. So are the entries the
    differences leave loose where f's own float64 rounding hides whether f rounds as x on the
    copies (``1e8 + sum(x**2)``: the truth then keeps x's precision, docs/testing.md).
    Engines agree with each other within the tolerances of their dtype. The ground truth runs on
    float64 copies of float32 leaves of x and of the Constant contexts when f computes the same
    value there, the float32 tensors f closes over widened as it runs (docs/testing.md). It costs
    ``4n`` evaluations of f for ``n`` inputs, edges included; the whole
    check at most ``4n + 20`` (``4n + 30`` with the second look, ``4n + 50`` with the looks below
    it).

    Where finite differences cannot settle it (they disagree with an engine, or their error is
    too large to see a 1% error: float32 f, large magnitudes, normalisation layers), the Taylor
    remainder test decides, with no step to tune: along a direction ``v``, the remainder
    ``|f(x + hv) - f(x) - h <g, v>|`` over ``h, h/4, ...`` shrinks as ``h**2`` (its odd part as
    ``h**3``) for the right ``g`` and only as ``h`` for a wrong one. Where ``f(x + hv) + f(x - hv)
    - 2 f(x)`` does not shrink as ``h**2``, f is not differentiable at x along v (a jump or a kink),
    and so where a remainder shrinking as ``h`` is no first-order error (it falls away at shorter
    steps, or f's second difference shows kinks within them: a float32 ReLU network's):
    the row is skipped with that reason, and failed only if the engines disagree with each other
    or if a second look finds the gradient wrong: the test again along the disagreement, without
    the inputs whose own differences show a kink within their step and without steps scaled by
    ``|x_i|`` (a kink at one input hides no wrong entry at another; ``sin`` at ``x = 1e6`` turns
    within a step of ``1e-3 |x|``). A gradient found wrong over steps scaled by ``|x_i|`` passes
    if the second look finds it right. 10 more evaluations of f (20 with the second look).

    For a large ``x`` (more than 4096 numbers, or when ``projections`` is given) the comparison is
    on ``k`` random directions ``u``: ``u . grad f`` against a central difference of
    ``t -> f(x + t u)`` (``2k`` evaluations), a float32 engine's own rounding along ``u`` allowed
    as an entry's is, the direction of the worst disagreement checked by the Taylor test.

    With ``has_aux=True``, ``f`` returns ``(value, aux)``: the value is differentiated and the
    aux ignored (it must be deterministic too). A given ``reference`` backend replaces the ground
    truth (compared with the default tolerances and its noise).

    Each row of the returned :class:`Report` names its reference. Warnings the engines raise are
    collected on the rows (:attr:`Report.warnings`), never failures. Raises
    :class:`~diffiface.GradientCheckError` (an ``AssertionError``) on any failure: its message
    names ``f`` by its ``__qualname__`` and every disagreement, with a line per leaf of x that
    differs (entries that differ, relative error, the worst entry's two results and their
    ratio); its ``report`` is the whole :class:`Report`. ``projections`` other than a whole
    number of at least 1 is an :class:`~diffiface.InvalidOptionError`.

    For a complex x, the gradient is ``df/dRe x + i df/dIm x`` (docs/complex.md), judged as the
    gradient of f of the real inputs ``Re x`` and ``Im x`` (the same ground truth), and also along
    random complex directions, which tell a gradient from its conjugate (a custom rule returning
    the conjugate fails, and is told so); a direction whose own error estimate exceeds the
    gradient's norm (a branch cut) does not judge. ``holomorphic=True`` checks a complex-valued ``f``
    asserted holomorphic instead: the Cauchy-Riemann equations, and each backend's
    ``jacobian(..., holomorphic=True)``.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> from diffiface.test import check_gradients
    >>> report = check_gradients(lambda x, c: (c * np.sin(x)).sum(), np.linspace(0, 1, 5),
    ...                          di.Constant(2.0), backends=["finite_differences"])
    >>> [(row.status, row.reference) for row in report.rows]
    [('passed', 'finite_differences')]
    """
    _validate_options(projections, rtol, atol)
    name = _name_of(f)
    try:
        report = _run(f, x, tuple(contexts), backends, reference, rtol, atol, projections, seed, has_aux, holomorphic)
    except GradientCheckError as exc:
        report = exc.report if exc.report is not None else Report()
        _named(report, name)
        raise GradientCheckError(_failure_text(name, report, str(exc)), report) from None
    return _named(report, name)


def _run(
    f: Callable[..., Any],
    x: Any,
    contexts: tuple[Any, ...],
    backends: Sequence[Backend | str] | Backend | str,
    reference: Backend | str | None,
    rtol: float | None,
    atol: float | None,
    projections: int | None,
    seed: int,
    has_aux: bool,
    holomorphic: bool,
) -> Report:
    automatic = isinstance(backends, str) and backends == "available"
    if automatic:
        chosen = _available_backends(x)
    elif isinstance(backends, (str, Backend)):
        chosen = [normalize(backends)]
    else:
        chosen = [normalize(b) for b in backends]
    if not chosen:
        raise GradientCheckError('no backend to check: install one (pip install "diffiface[jax]") or pass backends=...')
    if holomorphic:
        return _complex_checks.check_holomorphic(f, x, contexts, chosen, rtol, atol)
    complex_x = _complex_checks.applies(x)
    if reference is not None or _sharded(x) or _on_device.applies(x):
        given = normalize(reference) if reference is not None else None
        return _check_against_engines_reference(
            f, x, contexts, chosen, given, rtol, atol, projections, seed, has_aux, complex_x, automatic
        )
    return _Check(f, x, contexts, chosen, automatic, rtol, atol, projections, seed, has_aux).run()


def _validate_options(projections: Any, rtol: Any, atol: Any) -> None:
    if projections is not None and (
        isinstance(projections, bool) or not isinstance(projections, (int, np.integer)) or projections < 1
    ):
        raise InvalidOptionError(
            f"check_gradients(projections={projections!r}): projections is the number of random directions "
            "to compare the gradient along, a whole number of at least 1 (or None: every input, and 8 "
            f"directions above {_PROJECTION_THRESHOLD} inputs)."
        )
    for option, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or not value >= 0
        ):
            raise InvalidOptionError(
                f"check_gradients({option}={value!r}): {option} is a tolerance, a number of at least 0 "
                "(or None: the default of the gradient's dtype)."
            )


def _name_of(f: Any) -> str:
    """f as a reader knows it: its ``__qualname__`` (a partial's or a callable object's too)."""
    inner = f.func if isinstance(f, functools.partial) else f
    name = getattr(inner, "__qualname__", None) or type(inner).__qualname__
    return str(name)


def _named(report: Report, name: str) -> Report:
    for row in report.rows:
        if row.scenario == "f":
            row.scenario = name
    return report


def _failure_text(name: str, report: Report, message: str) -> str:
    """The failure's message: f by name, then the report's account of each failure."""
    body = report.summary() if report.failed else message
    return f"check_gradients({name}): {body}"


def _copies(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """The contexts' values for one evaluation of f: a Constant's numpy arrays read-only (a write
    raises), its tensors cloned; a Cache's as they are (f may write there)."""

    def shielded(leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray):
            view = leaf.view()
            view.flags.writeable = False
            return view
        return _copied(leaf, deep=False)

    return tuple(_tree.map(shielded, v.value) if isinstance(v, di.Constant) else v.value for v in values)


def _no_gradient(report: Report, automatic: bool) -> GradientCheckError:
    """The error where no engine gave a gradient, and none failed: nothing was checked, which must
    not pass in silence (a CI test naming a backend that is not installed would go green)."""
    reasons = "; ".join(f"{r.backend}: {r.message}" for r in report.rows)
    if automatic:
        return GradientCheckError(f"no installed engine can run f ({reasons}). Pass backends=... explicitly.", report)
    return GradientCheckError(
        f"checked nothing: no backend named gave a gradient ({reasons}). Install them, or name others.", report
    )


def _not_for_this_engine(exc: BaseException, message: str, counted: _Counted, returned: int) -> tuple[str, str]:
    """``(status, message)`` of a default engine that raised: skipped where its own evaluation of
    f raised (f itself runs: it cannot run f), or where it ran f and refused to differentiate it
    with a diffiface error (a float output under torch, a constant); failed otherwise."""
    if counted.returned == returned:
        return "skipped", f"cannot run f: {message}"
    if isinstance(exc, DiffifaceError) and not isinstance(exc, MutationError):
        return "skipped", f"cannot differentiate f: {message}"
    return "failed", message


def _differs(first: Any, second: Any, has_aux: bool) -> str | None:
    """Why two outputs of f at the same input show it draws from a global random generator."""
    paired = has_aux and all(isinstance(out, (tuple, list)) and len(out) == 2 for out in (first, second))
    pairs = [("values", first[0], second[0]), ("aux", first[1], second[1])] if paired else [("values", first, second)]
    for what, a, b in pairs:
        la, lb = _tree.leaves(a), _tree.leaves(b)
        same = len(la) == len(lb)
        for u, v in zip(la, lb, strict=False):
            if same and _arrays.kind(u) in ("numpy", "torch", "jax", "mlx", "python") and not isinstance(u, str):
                p, q = np.asarray(_arrays.to_numpy(u)), np.asarray(_arrays.to_numpy(v))
                same = p.shape == q.shape and bool(np.array_equal(p, q, equal_nan=p.dtype.kind in "fc"))
        if not same:
            gave = "different values" if what == "values" else "the same value but a different aux"
            return (
                f"f is not deterministic: two calls with the same input gave {gave}, so it probably draws from "
                "a global random generator. Pass a seeded generator or key as a di.Constant and draw from it "
                "explicitly."
            )
    return None


class _Counted:
    """f, counting its calls and the calls that returned: an engine whose own evaluation of f
    raised, where f itself runs, cannot run f."""

    def __init__(self, f: Callable[..., Any]) -> None:
        self.f = f
        self.calls = 0
        self.returned = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        out = self.f(*args)
        self.returned += 1
        return out


_COMPLEX_PARTS = {"complex128": np.float64, "complex64": np.float32}


@dataclasses.dataclass
class _Flat:
    """The float leaves of x as one float64 vector, and the way back to f's arguments. A complex
    leaf gives two pieces, its real parts then its imaginary parts: f of complex x is checked as
    f of the real inputs Re x and Im x, whose gradient is ``df/dRe x + i df/dIm x``."""

    leaves: list[Any]
    spec: Any
    where: list[int]
    """The indices of the leaves that are floating-point or complex numbers (the others stay as
    they are)."""
    offsets: np.ndarray
    vector: np.ndarray
    eps: np.ndarray
    parts: list[np.dtype[Any]]
    """Per leaf in ``where``, the real dtype of its numbers."""
    complex_leaves: list[bool]

    @classmethod
    def of(cls, x: Any) -> _Flat:
        leaves, spec = _tree.flatten(x)
        where, pieces, eps, parts, complex_leaves = [], [], [], [], []
        for i, leaf in enumerate(leaves):
            name = _arrays.dtype_name(leaf)
            is_complex = name in _COMPLEX_PARTS and (isinstance(leaf, complex) or _arrays.is_array(leaf))
            if isinstance(leaf, bool) or not (
                isinstance(leaf, float)
                or is_complex
                or (_arrays.is_array(leaf) and _arrays.is_float_dtype(name))  # (of any array family)
            ):
                continue
            array = np.asarray(_arrays.to_numpy(leaf))
            part: np.dtype[Any] = (
                np.dtype(_COMPLEX_PARTS[name])
                if is_complex
                else (array.dtype if array.dtype.kind == "f" else np.dtype(np.float64))
            )
            flat = array.reshape(-1)
            piece = np.concatenate([flat.real, flat.imag]) if is_complex else flat
            where.append(i)
            pieces.append(piece.astype(np.float64))
            eps.append(np.full(piece.size, float(np.finfo(part).eps)))  # type: ignore[type-var]
            parts.append(part)
            complex_leaves.append(is_complex)
        vector = np.concatenate(pieces) if pieces else np.zeros(0)
        offsets = np.cumsum([0, *(p.size for p in pieces)])
        return cls(
            leaves, spec, where, offsets, vector, np.concatenate(eps) if eps else np.zeros(0), parts, complex_leaves
        )

    @property
    def size(self) -> int:
        return int(self.vector.size)

    def tree(self, vector: np.ndarray) -> Any:
        leaves = list(self.leaves)
        for j, i in enumerate(self.where):
            like = leaves[i]
            piece = vector[self.offsets[j] : self.offsets[j + 1]]
            if self.complex_leaves[j]:
                half = piece.size // 2
                piece = piece[:half] + 1j * piece[half:]
            if isinstance(like, (float, complex)):
                leaves[i] = complex(piece[0]) if isinstance(like, complex) else float(piece[0])
            else:
                leaves[i] = _arrays.from_numpy(piece.reshape(_arrays.shape(like)).copy(), like)
        return optree.tree_unflatten(self.spec, leaves)

    def read(self, tree: Any) -> np.ndarray:
        """A gradient (x's structure) as a float64 vector over the float leaves (a complex
        leaf's real parts, then its imaginary parts)."""
        leaves = _tree.leaves(tree)
        if len(leaves) == len(self.where) != len(self.leaves):  # the non-float leaves dropped (jax)
            leaves = [leaves[self.where.index(i)] if i in self.where else None for i in range(len(self.leaves))]
        if len(leaves) != len(self.leaves):
            raise AssertionError(f"the gradient has {len(leaves)} leaves where x has {len(self.leaves)}")
        pieces = []
        for j, i in enumerate(self.where):
            array = np.asarray(_arrays.to_numpy(leaves[i])).reshape(-1)
            if self.complex_leaves[j]:
                array = (
                    np.concatenate([array.real, array.imag]) if np.iscomplexobj(array) else np.tile(array, 2) * np.nan
                )
            pieces.append(array.astype(np.float64))
        return np.concatenate(pieces) if pieces else np.zeros(0)

    def part(self, i: int) -> tuple[int, int, str]:
        """Input i as ``(leaf index j, entry of the leaf, "" or " (real part)"/" (imaginary part)")``."""
        j = int(np.searchsorted(self.offsets, i, side="right")) - 1
        local = i - int(self.offsets[j])
        if not self.complex_leaves[j]:
            return j, local, ""
        half = (int(self.offsets[j + 1]) - int(self.offsets[j])) // 2
        return j, local % half, " (real part)" if local < half else " (imaginary part)"

    def exact(self, steps: np.ndarray) -> np.ndarray:
        """Steps rounded so that ``x + h`` is representable in each leaf's dtype."""
        out = np.empty_like(steps)
        for j in range(len(self.where)):
            lo, hi = self.offsets[j], self.offsets[j + 1]
            dtype = self.parts[j]
            base = self.vector[lo:hi]
            with np.errstate(invalid="ignore", over="ignore"):  # (inputs at inf: held fixed)
                out[lo:hi] = (base.astype(dtype) + steps[lo:hi].astype(dtype)).astype(np.float64) - base
        return out


@dataclasses.dataclass
class _Truth:
    """Finite-difference derivatives (per input, or per direction) with their error estimates."""

    values: np.ndarray
    errors: np.ndarray
    """Each value's error estimate; inf where no stencil stayed in f's domain."""
    plain: np.ndarray
    """The plain central difference at the default step (what a finite-difference engine gives)."""
    one_sided: int = 0


@dataclasses.dataclass
class _Taylor:
    """f along ``x + h v`` for a falling sequence of h (None where f raised or was not finite)."""

    direction: np.ndarray
    steps: np.ndarray
    plus: list[float | None]
    minus: list[float | None]
    why: str
    random: bool = False
    """Whether ``direction`` was drawn at random, apart from the gradient (not along a disagreement)."""


@dataclasses.dataclass(frozen=True)
class _Own:
    """An engine's own rounding, per entry of its gradient. ``signed``: its error itself, measured
    against the same engine on float64 copies, which projects on a direction as it is; else sizes,
    measured by moving x by its last bits (:meth:`_Check._last_bits`), which project as the
    narrow dtype's floors do."""

    values: np.ndarray
    signed: bool

    def sizes(self) -> np.ndarray:
        sizes: np.ndarray = np.abs(self.values)
        return sizes

    def along(self, v: np.ndarray, random: bool) -> float:
        """How far the rounding may move ``<g, v>``: four times its projection where it is signed;
        else the sum of the sizes along ``v``, or, along a direction drawn at random, their random
        walk (``_RANDOM_ROUNDING`` root sums of squares) where that is less."""
        if self.signed:
            return _SAFETY * abs(float(np.dot(self.values, v)))
        terms = np.abs(self.values * v)
        total = float(np.sum(terms))
        return min(total, _RANDOM_ROUNDING * float(np.linalg.norm(terms))) if random else total


class _Check:
    def __init__(
        self,
        f: Callable[..., Any],
        x: Any,
        contexts: tuple[Any, ...],
        chosen: list[Backend],
        automatic: bool,
        rtol: float | None,
        atol: float | None,
        projections: int | None,
        seed: int,
        has_aux: bool,
    ) -> None:
        self.f, self.x, self.contexts, self.chosen, self.automatic = f, x, contexts, chosen, automatic
        self.rtol, self.atol, self.seed, self.has_aux = rtol, atol, seed, has_aux
        self.counted = _Counted(f)
        self.widened: Callable[[Any], Any] | None = None
        """f as the ground truth evaluates it where it is a jax f computing in a narrower float
        inside (:func:`~diffiface.test._running.jax_widened`); None: f itself."""
        self.narrowest: str | None = None
        """The narrowest float dtype f computes in, where the truth runs it widened."""
        self.scenario = Scenario(
            "f",
            self.counted,
            x,
            "value_and_gradient" if has_aux else "gradient",
            contexts,
            reference=None,
            has_aux=has_aux,
        )
        self.flat = _Flat.of(x)
        self.projections = projections
        self.report = Report()
        self.leaf_lines: dict[str, list[str]] = {}
        self.outside = Row("(reference)", "f", "gradient", "passed")
        # (f runs under jax's x64 where the engines run it: a float64 leaf of x or of a context's
        # array, a numpy batch, makes them; jax.random draws another mask there)
        context_arrays = [
            leaf for c in contexts for leaf in _tree.leaves(getattr(c, "value", c)) if _arrays.is_array(leaf)
        ]
        self.wide_x = any(
            _arrays.dtype_name(leaf) in ("float64", "complex128") for leaf in (*_tree.leaves(x), *context_arrays)
        )
        self.promoted = False  # (whether the ground truth runs on float64 copies: set with it)
        # entries of x at +-inf or NaN (a mask of -inf before a softmax): held where they are, no
        # difference taken along them
        self.fixed = ~np.isfinite(self.flat.vector)
        self.finite_x = np.where(self.fixed, 0.0, self.flat.vector)

    # -- evaluations of f ----------------------------------------------------------------------

    def _scalar(self, out: Any) -> float:
        if self.has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise InvalidOutputError(
                    f"check_gradients(has_aux=True) needs f to return (value, aux); it returned "
                    f"{_describe(out)}. Return a pair, or drop has_aux=True."
                )
            out = out[0]
        leaves = _tree.leaves(out)
        if len(leaves) != 1 or int(np.prod(_arrays.shape(leaves[0]))) != 1:
            raise InvalidOutputError(
                f"check_gradients checks the gradient of a scalar f; f returned {_describe(out)}. Sum or "
                "reduce its output (or check a jvp/vjp with test_differentiation)."
            )
        return float(np.asarray(_arrays.to_numpy(leaves[0]), dtype=np.float64).reshape(-1)[0].real)

    def _at(self, vector: np.ndarray) -> float | None:
        """f at a point of the reference (its float64 copies where they serve), None where f
        raises or is not finite there: an edge of its domain."""
        try:
            scope = _float64_copies_scope() if self.promoted else _float64_scope() if self.wide else None
            with _no_grad(), scope or contextlib.nullcontext():
                if self.widened is None:
                    point, values = self.truth_flat.tree(vector), _copies(self.truth_contexts)
                    out = own_call(functools.partial(self.counted, point, *values), self.truth_contexts)
                else:
                    out = self.widened(self.truth_flat.tree(vector))
                    self.counted.calls += 1
                    self.counted.returned += 1
            value = self._scalar(out)
            self.output_dtype = _arrays.dtype_name(_tree.leaves(out[0] if self.has_aux else out)[0])
        except (InvalidOutputError, MutationError):
            raise
        except ValueError as exc:
            if str(exc).endswith("read-only"):  # a write into a Constant, handed read-only
                raise MutationError(_WRITE.format(what="a di.Constant", detail=f" ({exc})")) from exc
            return None
        except Exception:
            return None
        return value if np.isfinite(value) else None

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> Report:
        with _warnings_apart(self.outside), _float64_scope() if self.wide_x else contextlib.nullcontext():
            first_out, second_out = _twice_on_copies(self.f, self.x, self.contexts)
            self.counted.calls += 2
            self.f0 = self._scalar(first_out)
            second = self._scalar(second_out)
        if not np.isfinite(self.f0):
            raise InvalidOutputError(f"f(x) = {self.f0}: there is no gradient to check at this x; choose another x.")
        gradients = self._engines()
        self._judge_determinism(second, first_out, second_out, gradients)
        size = self.flat.size
        k = self.projections if self.projections is not None else (8 if size > _PROJECTION_THRESHOLD else 0)
        with _warnings_apart(self.outside):
            self._prepare_truth(first_out)
            if k:
                self._projected(gradients, k)
            else:
                self._dense(gradients)
        notes = []
        if self.fixed.any():
            held = ", ".join(self._where(int(i)) for i in np.flatnonzero(self.fixed)[:4])
            notes.append(
                f"[{int(self.fixed.sum())} inputs of x are inf or NaN ({held}, ...): held fixed, their "
                "gradient entries not checked]"
            )
        if self.unchecked.any():
            near = ", ".join(self._where(int(i)) for i in np.flatnonzero(self.unchecked)[:4])
            notes.append(
                f"[{int(self.unchecked.sum())} inputs nearer an edge of f's domain than any step the "
                f"4n + 20 evaluations allowed ({near}, ...): their gradient entries not checked]"
            )
        if self.hidden.any():
            where = ", ".join(self._where(int(i)) for i in np.flatnonzero(self.hidden)[:4])
            notes.append(
                f"[{int(self.hidden.sum())} inputs whose gradient entries neither the differences nor the "
                f"Taylor test resolve ({where}, ...): not checked]"
            )
        for note in notes:
            for label in gradients:
                row = self._row(label)
                row.message = f"{row.message} {note}".strip()
        for label, floored in self.floored.items():
            if floored.any():
                row = self._row(label)
                where = ", ".join(self._where(int(i)) for i in np.flatnonzero(floored)[:4])
                row.message = (
                    f"{row.message} [{int(floored.sum())} inputs whose gradient entries agree with the ground "
                    f"truth only within the rounding f's condition allows their dtype ({where}, ...), the "
                    "engine's own rounding not measured on float64 copies: not checked]"
                ).strip()
        self._pairwise(gradients)
        self._not_differentiable_but_disagreeing()
        if _complex_checks.applies(self.x):
            # along random complex directions, which tell a gradient from its conjugate
            shielded = tuple(di.Constant(v) for v in _copies(self.contexts))
            _complex_checks.check_adjoint(
                self.report, self.f, self.x, shielded, self.native, self.has_aux, self.seed, self.rtol
            )
        for label, lines in self.leaf_lines.items():
            row = self._row(label)
            if row.status == "failed" and lines:
                row.message += "".join(f"\n    {line}" for line in lines)
        if self.report.failed:
            raise GradientCheckError(self.report.summary(), self.report)
        return self.report

    def _engines(self) -> dict[str, np.ndarray]:
        """Each engine's gradient, flat; rows of engines that cannot run f are skipped."""
        gradients: dict[str, np.ndarray] = {}
        self.native: dict[str, Any] = {}
        for backend in self.chosen:
            label = backend_label(backend)
            row = Row(label, "f", "gradient", "passed", warnings=self.outside.warnings)
            self.report.rows.append(row)
            if not available(backend):
                row.status, row.message = "skipped", f"not installed: {install_hint(backend)}"
                continue
            constants = [c for c in self.contexts if isinstance(c, di.Constant)]
            taken = snapshot((self.x, constants))
            returned = self.counted.returned
            start = time.perf_counter()
            with _warnings_apart(row):
                try:
                    if self.has_aux:
                        (_, _aux), gradient = di.value_and_gradient(
                            self.counted, backend, self.x, *self.contexts, has_aux=True
                        )
                    else:
                        gradient = di.gradient(self.counted, backend, self.x, *self.contexts)
                    row.seconds = time.perf_counter() - start
                    changed = changes(taken)
                    if changed:
                        raise AssertionError(
                            f"the call mutated {', '.join(changed[:4])}. x and Constants must stay as they were: "
                            "return new state through has_aux=True (say a BatchNorm's running statistics)."
                        )
                    gradients[label] = self.flat.read(gradient)
                    self.native[label] = gradient
                except Exception as exc:
                    row.status, row.message = _outcome(exc)
                    if row.status == "failed" and self.automatic and label not in gradients:
                        row.status, row.message = _not_for_this_engine(exc, row.message, self.counted, returned)
        if not gradients and not self.report.failed:
            raise _no_gradient(self.report, self.automatic)
        return gradients

    def _row(self, label: str) -> Row:
        return next(r for r in self.report.rows if r.backend == label)

    def _judge_determinism(
        self, second: float, first_out: Any, second_out: Any, gradients: dict[str, np.ndarray]
    ) -> None:
        """Two calls of f at x agree within a few ulps times f's condition (rounding that changes
        from run to run, say LAPACK's, is no random generator); a global random generator moves f
        at f's own scale."""
        condition = abs(self.f0) + max(
            (float(np.sum(np.abs(self.finite_x * g))) for g in gradients.values() if np.all(np.isfinite(g))),
            default=0.0,
        )
        self.condition = condition
        eps = self._output_eps()
        if abs(second - self.f0) > 64 * eps * condition:
            what = f"different values ({self.f0!r} and {second!r})"
        elif self.has_aux and not _same_within(first_out[1], second_out[1], 64 * eps):
            what = f"the same value ({self.f0!r}) but a different aux (the second item f returns)"
        else:
            return
        self._not_deterministic(what)

    def _not_deterministic(self, what: str) -> None:
        self.outside.status = "failed"
        self.outside.message = (
            f"f is not deterministic: two calls with the same input gave {what}, so it probably draws from "
            "a global random generator. Pass a seeded generator or key as a di.Constant and draw from it "
            "explicitly."
        )
        for row in self.report.rows:  # (compared with nothing: none passed)
            if row.status == "passed":
                row.status, row.message = "skipped", "not compared: f is not deterministic"
        self.report.rows.insert(0, self.outside)
        raise GradientCheckError(self.outside.message, self.report)

    def _output_eps(self) -> float:
        dtypes = [np.asarray(_arrays.to_numpy(leaf)).dtype for leaf in _tree.leaves(self.x) if _arrays.is_array(leaf)]
        floats = [d for d in dtypes if d.kind in "fc"]
        return float(max((np.finfo(d).eps for d in floats), default=np.finfo(np.float64).eps))

    # -- the ground truth ---------------------------------------------------------------------------

    def _prepare_truth(self, value: Any) -> None:
        scenario = self.scenario
        wide = _on_float64_copies(scenario) if _promotes(scenario) else None
        self.wide = _promotes(scenario) and not _changes_in_float64(scenario, value[0] if self.has_aux else value, wide)
        self.wide = self.wide or self.wide_x
        promoted = self.promoted = _promotes(scenario) and self.wide
        self.truth_flat = _Flat.of(promote(self.x)) if promoted else self.flat
        self.truth_contexts = tuple(promote_contexts(self.contexts) if promoted else self.contexts)
        self.label = "finite_differences (float64)" if promoted else "finite_differences"
        self.eps = self.truth_flat.eps  # of the dtype f runs in, per input
        self.scale = np.maximum(1.0, np.abs(self.finite_x))
        # how far, per input, the Taylor test may move x (in units of its top step): x's scale, a
        # step of its own at an edge of f's domain, nothing along inputs held fixed
        self.reach = np.where(self.fixed, 0.0, self.scale)
        self.edge = np.zeros(self.flat.size, dtype=bool)
        self.unchecked = np.zeros(self.flat.size, dtype=bool)
        self.hidden = np.zeros(self.flat.size, dtype=bool)
        self.blind = False
        """Whether f may round as x on the float64 copies, which the move by x's last bits cannot
        tell from f's own rounding there (:meth:`_rounds_as_x`): the entries the differences then
        leave loose are named not checked, whatever f's rounding in x's dtype."""
        self.floored: dict[str, np.ndarray] = {}
        """Per engine, the entries that agree with the ground truth only within the narrow dtype's
        floor, where its own rounding could not be measured (:meth:`_unmeasured`): not checked."""
        self.kinked = np.zeros(self.flat.size, dtype=bool)
        self.at_x: dict[bytes, bool] = {}  # (:meth:`_kinked_at_x`'s answers, per set of inputs)
        self.measured = 0.0
        """The standard deviation of f's rounding near x where measured above its prediction (else 0)."""
        self.inside: dict[float, float] = {}
        """Per side of an edge (-1, 1), the point furthest that way an edge input found in f's domain."""
        # f(x) as the ground truth computes it (on the float64 copies, where they serve)
        self.output_dtype = _arrays.dtype_name(_tree.leaves(value[0] if self.has_aux else value)[0])
        # (a jax f casting to a narrower float inside: the truth runs it widened, its engines'
        # results keep that dtype's precision)
        if self.wide and all(type(c) is di.Constant for c in self.truth_contexts):
            with _float64_copies_scope() if promoted else _float64_scope():
                found = jax_widened(
                    self.f, self.truth_flat.tree(self.truth_flat.vector), [c.value for c in self.truth_contexts]
                )
            if found is not None:
                self.widened, self.narrowest = found
        center = self._at(self.truth_flat.vector) if promoted or self.widened is not None else self.f0
        if promoted and center is not None and wide is not None and self.widened is None:
            # (a draw from a global generator hides in f's rounding at f's own precision, not
            # in float64's, where the truth evaluates f: the check's evaluation there, again; a
            # widened f's jaxpr is another computation, whose value differs by f's own rounding)
            again = self._scalar((wide, None) if self.has_aux else wide)
            if abs(again - center) > 64 * np.finfo(np.float64).eps * self.condition:
                self._not_deterministic(f"different values on float64 copies ({center!r} and {again!r})")
        self.center = self.f0 if center is None else center
        if self.output_dtype in ("float32", "float16", "bfloat16"):
            # f computes in a narrower dtype than its inputs: its rounding is that dtype's
            self.eps = np.maximum(self.eps, _NARROW_EPS[self.output_dtype])
        elif self.output_dtype == "float64":
            # a framework whose float64 functions are accurate to float32 only (mlx's sin, exp)
            first = _tree.leaves(value[0] if self.has_aux else value)[0]
            precision = getattr(_arrays.family_of(first), "FLOAT64_PRECISION", "float64")
            if precision in _NARROW_EPS:
                self.eps = np.maximum(self.eps, _NARROW_EPS[precision])
        if promoted and center is not None and self._rounds_as_x(center):
            # f casts the copies back to x's own dtype inside (an astype, a layer's compute
            # dtype) and returns float64 only through a widened Constant: its rounding is x's
            self.eps = np.maximum(self.eps, self.flat.eps)

    def _rounds_as_x(self, center: float) -> bool:
        """Whether f on the float64 copies rounds as x's own dtype does: moving every nonzero
        input by up to a 256th of its unit in the last place of x's dtype (a point a cast back
        rounds to x itself) leaves f exactly as it was, and moving it by up to 16 such units
        does not. A computation in float64 moves at both scales; a piecewise-constant f
        (``round``, ``trunc``) at neither, and keeps float64's steps. One evaluation, two where
        the first leaves f as it was. Where f's own float64 rounding would swallow the first move
        as well (the terms ``x_i g_i`` it moves by below 16 ulps of f: ``1e8 + sum(x**2)`` at x
        near 1), x's rounding is taken all the same and :attr:`blind` is set."""
        vector = self.truth_flat.vector
        moving = ~self.fixed & np.isfinite(vector) & (vector != 0) & (self.flat.eps > np.finfo(np.float64).eps)
        if not np.any(moving):
            return False
        # (random fractions, not signs alone: equal terms of opposite signs, log's, cancel exactly)
        fractions = np.random.default_rng(0).uniform(-1.0, 1.0, size=vector.shape)
        unit = np.where(moving, np.abs(vector) * self.flat.eps * fractions, 0.0)
        if self._at(vector + unit / 256) != center:
            return False
        # (f's float64 rounding may swallow the move too: the terms x_i g_i moved by a 256th of
        # their last place fall below a few of f's own ulps, 1e8 + sum(x**2) at x near 1)
        terms = max(self.condition - abs(self.f0), 0.0)
        swallowed = terms * float(np.max(self.flat.eps)) / 256 < 16 * float(np.spacing(abs(center)))
        moved = self._at(vector + 16 * unit)
        rounds = moved is not None and np.isfinite(moved) and moved != center
        self.blind = rounds and swallowed
        return rounds

    def _dense(self, gradients: dict[str, np.ndarray]) -> None:
        truth = self._coordinate_truth()
        self.truth = truth
        known = np.isfinite(truth.errors)
        magnitude = float(np.max(np.abs(truth.values[known]), initial=0.0))
        resolves = bool(np.all(_SAFETY * truth.errors[known] <= _RESOLVES * max(magnitude, np.finfo(float).tiny)))
        noisy = not resolves or not bool(np.all(known | self.fixed))
        # (an entry the differences could not estimate: its condition overflows, no step fits)
        self.hidden = ~known & ~self.fixed & ~self.unchecked
        disagreements: dict[str, np.ndarray] = {}
        own_edge: dict[str, np.ndarray] = {}
        # entries whose differences would pass a gradient 1% off (f's rounding over a step is
        # near their size), where the Taylor test's top step would show such an error
        unresolved = np.zeros(self.flat.size, dtype=bool)
        unjudged = np.zeros(self.flat.size, dtype=bool)
        # (asked only where an entry or the Taylor test fails without it, once per engine)
        owns = {label: functools.cache(functools.partial(self._own, label, g)) for label, g in gradients.items()}
        for label, g in gradients.items():
            row = self._row(label)
            row.reference = self.label
            tol = self._tolerance(label, truth)
            with np.errstate(invalid="ignore"):
                err = np.abs(g - truth.values)
            bad = known & ~(err <= tol)
            if np.any(bad):
                own = owns[label]()
                if own is not None:
                    tol = tol + _SAFETY * own.sizes()
                else:
                    # (its own rounding not measured: the floor stands, and what passes by it alone
                    # is named, not passed in silence)
                    tol = tol + self._unmeasured(label)
                    self.floored[label] = bad & (err <= tol)
                bad = known & ~(err <= tol)
            bad |= known & ~np.isfinite(g)
            with np.errstate(invalid="ignore", over="ignore"):
                noise = self._noise(g)
                # (by the differences' own error; the Taylor test only where the gradient's dtype is
                # finer than that, its floors: a float32 QR's entries near its rounding read as wrong)
                differences = _SAFETY * truth.errors
                loose = known & ~self.fixed & ~bad & (differences >= _LOOSE * np.abs(g))
                seen = np.abs(g) * self.reach * self._taylor_top() > _VISIBLE * noise
                seen &= tol - differences < _LOOSE * np.abs(g)
                unresolved |= loose & seen
                # (an entry the differences allow a tenth off, not negligible in its leaf, that moves f
                # by more than its rounding over x's scale, which no step of the checker resolves:
                # reported, not passed in silence)
                unjudged |= known & ~self.fixed & ~bad & (differences >= _UNJUDGED * np.abs(g)) & self._in_leaf(g)
                # (where f's float64 copies may resolve it, unless it rounds as x, which no probe
                # could tell: :meth:`_rounds_as_x`)
                self.hidden |= unjudged & loose & ~seen & ((np.abs(g) * self.reach > noise) | self.blind)
            crossed = ~np.isfinite(g) & ~self.fixed
            if label.split("-")[0] in ("finite_differences", "scipy") and np.any(crossed):
                # f(x) is finite: a finite-difference engine's NaN is its own step crossing an edge
                # of f's domain (the ground truth steps short of it), no fault of f's gradient
                own_edge[label] = crossed
                bad &= ~crossed
            finite = known & np.isfinite(err)
            row.abs_error = float(np.max(err[finite], initial=0.0))
            row.rel_error = row.abs_error / magnitude if magnitude else (0.0 if row.abs_error == 0 else float("inf"))
            if np.any(bad):
                i = int(np.flatnonzero(bad)[np.argmax(err[bad] / np.maximum(tol[bad], 1e-300))])
                row.status = "failed"
                row.message = (
                    f"values differ at input {self._where(i)}: gradient {g[i]:.10g}, finite differences give {truth.values[i]:.10g} "
                    f"(error estimate {truth.errors[i]:.3g}; abs error {err[i]:.3g}, tolerance {tol[i]:.3g}); "
                    f"{int(np.sum(bad))} of {g.size} inputs differ"
                )
                disagreements[label] = np.where(bad | ~known, g - np.nan_to_num(truth.values), 0.0)
                self.leaf_lines[label] = self._leaf_lines(g, truth.values, bad)
        for label, where in own_edge.items():
            row = self._row(label)
            if row.status != "failed":
                inputs = ", ".join(self._where(int(i)) for i in np.flatnonzero(where)[:4])
                row.status = "skipped"
                row.message = (
                    f"its own step leaves f's domain at input {inputs} ({int(np.sum(where))} in all; "
                    "the gradient is not finite there), nearer an edge than its step; the other inputs agree "
                    "with the ground truth"
                )
        if disagreements or noisy or np.any(unresolved):
            first = next(iter(disagreements.values()), None)
            if first is None and gradients:
                # the engine's departure from the noisy differences, where a wrong entry shows (at
                # the entries the differences cannot judge, where only they are)
                within = known if noisy else unresolved
                first = np.where(within, next(iter(gradients.values())) - np.nan_to_num(truth.values), 0.0)
            if first is not None and np.all(np.isfinite(first)) and np.any(first):
                direction, drawn = first * self.reach, False
                why = "along the disagreement with finite differences" + (
                    "" if disagreements else " (too noisy to judge alone)"
                )
            else:
                direction = np.random.default_rng(self.seed).standard_normal(self.flat.size) * self.reach
                drawn = True
                why = "along a random direction (finite differences too noisy to judge alone)"
            taylor = self._taylor(direction, why, random=drawn)
            verdicts: dict[str, str] = {}
            for label, g in gradients.items():
                row = self._row(label)
                if (row.status == "failed" and label not in disagreements) or label in own_edge:
                    continue
                verdicts[label] = self._apply_taylor(
                    row, taylor, g, fd_failed=label in disagreements, reference=truth.values, own=owns[label]
                )
            for label, verdict in list(verdicts.items()):
                # every input where the gradient differs has a stencil that crossed a kink (sort's
                # tie nearer than its step): that difference is no derivative, and where the Taylor
                # test cannot judge either, nothing says the gradient is wrong
                differ = disagreements[label] != 0 if label in disagreements else None
                if differ is None or not differ.any() or not self.kinked[differ].all():
                    continue
                row = self._row(label)
                at = ", ".join(self._where(int(i)) for i in np.flatnonzero(differ)[:4])
                if verdict == "inconclusive":
                    row.status = "skipped"
                    row.tags = row.tags | {"not_differentiable"}
                    row.message = (
                        f"f is not differentiable at x: every input where the gradient differs ({at}) shows a "
                        f"kink within its step, and the Taylor test cannot judge [{row.message}]"
                    )
                elif verdict == "wrong" and self._kinked_at_x(differ):
                    # a convex and a concave kink at x (a clamp at both bounds) leave f linear along
                    # the disagreement, whose slope no gradient at x need match: f is not
                    # differentiable at x, and no later look may call it wrong there
                    row.status = "skipped"
                    row.tags = row.tags | {"not_differentiable"}
                    row.message = (
                        f"f is not differentiable at x: every input where the gradient differs ({at}) shows a "
                        f"kink at x, at steps 4**5 and 4**10 times below the differences' [{row.message}]"
                    )
                    del verdicts[label]
            if not disagreements and "inconclusive" in verdicts.values():
                # (the loose entries, which the differences alone do not judge, judged by nothing)
                self.hidden |= unresolved & unjudged
            if first is not None:
                self._second_look(gradients, verdicts, first, np.nan_to_num(truth.values), set(disagreements))

    def _kinked_at_x(self, differ: np.ndarray) -> bool:
        """Whether f shows a kink at x along every input in ``differ``: at steps s of ``4**5`` and
        ``4**10`` times below the differences' (8 evaluations an input), f's second difference at
        2s is about twice the one at s, and the one at s falls by about ``4**5`` from the longer
        steps to the shorter: a kink's, shrinking as s. A smooth f's falls as ``s**2`` (``sin`` at
        ``|x| = 1e4`` turns within the differences' steps, not within these), and f's rounding
        does not fall at all (the variance of ``v + 1000``, whose rounding no stencil foresees)."""
        key = differ.tobytes()
        if key not in self.at_x:
            self.at_x[key] = all(self._kink_at_x(i) for i in np.flatnonzero(differ).tolist())
        return self.at_x[key]

    def _kink_at_x(self, i: int) -> bool:
        x = self.truth_flat.vector
        shrink = _TAYLOR_RATIO**_TAYLOR_STEPS
        seconds = []
        for scale in (shrink, shrink * shrink):
            s = float(self.truth_flat.exact(self.eps ** (1 / 3) * self.scale / scale)[i])
            near = [self._moved(x, i, t) for t in (s, -s, 2 * s, -2 * s)]
            if s == 0 or any(f is None for f in near):
                return False
            p1, m1, p2, m2 = near
            at_s, at_2s = p1 + m1 - 2 * self.center, p2 + m2 - 2 * self.center  # type: ignore[operator]
            if not (at_s != 0 and 1.5 < at_2s / at_s < 2.5):
                return False
            seconds.append(at_s)
        return bool(np.sqrt(shrink) < seconds[0] / seconds[1] < shrink * np.sqrt(shrink))

    def _in_leaf(self, g: np.ndarray) -> np.ndarray:
        """Per entry, whether it is at least 1e-3 of its leaf's largest (a softplus's saturated
        entries, 1e-10 beside 1e-7, are not named unchecked; a leaf of its own is never small)."""
        offsets = self.flat.offsets
        sizes = np.diff(offsets)
        magnitude = np.nan_to_num(np.abs(g), posinf=0.0)
        largest = np.repeat([np.max(magnitude[lo:hi], initial=0.0) for lo, hi in itertools.pairwise(offsets)], sizes)
        return magnitude >= 1e-3 * largest  # type: ignore[no-any-return]

    def _second_look(
        self,
        gradients: dict[str, np.ndarray],
        verdicts: dict[str, str],
        first: np.ndarray,
        reference: np.ndarray,
        fd_failed: set[str],
    ) -> None:
        """The Taylor test once more along the disagreement (10 evaluations more), without what
        may have misled the first: the inputs whose own differences show a kink within their
        step, and steps scaled by ``|x_i|``, at most ``1e-3`` there (``sin`` at ``x = 1e6`` turns
        many times within ``1e-3 |x|``, where no Taylor expansion holds).

        Taken where the first found f not differentiable along the disagreement: a row stays
        skipped unless this test finds its gradient wrong (a kink at one input must not hide a
        wrong entry at another). And where the first found a gradient wrong over steps scaled by
        ``|x_i|`` and no input is left out: the row passes if this test finds it right, and is
        skipped if this test is inconclusive and every input that differs showed a kink within
        its own step (f is no polynomial over either test's steps: ``sin`` at ``x = 1e12``).

        And where the first found f not differentiable along the disagreement, though the
        differences, whose stencils showed no kink, disagreed with the gradient: over steps below
        the first test's shortest (a kink of ``relu(w . a)`` at ``w . a = 1e-4``, which the
        differences' steps along one input each do not reach and the first test's steps along all
        inputs at once cross); the row fails only if this test finds its gradient wrong. So also
        where the look without the kinked inputs or the scaled steps does not settle it (every
        unit of a ReLU layer near its kink, each step crossing some; sort's ties 1e-5 apart).

        And where the first found a gradient wrong over unit steps at inputs far below their unit
        scale: at steps scaled by ``|x_i|`` (``tanh(w / 1e-8)`` at ``w`` of ``1e-8`` is flat to unit
        steps, its fourth differences read as noise); the row passes if this test finds it right,
        on the noise f's condition predicts where its second differences there show the measured
        noise to be none of f's rounding at these steps."""
        first = np.nan_to_num(first)
        rest = np.where(self.kinked, 0.0, first)
        kinks = self.kinked & (first != 0)
        # (every input that differs has a stencil that is no polynomial: neither test can trust its steps)
        unsmooth = bool(np.any(kinks)) and not np.any(rest)
        if not np.any(rest) or not np.any(kinks):
            rest, kinks = first, np.zeros_like(kinks)
        reach = np.minimum(self.reach, 1.0)
        rescaled = bool(np.any((rest != 0) & (reach < self.reach)))
        # inputs far below their unit scale (a capacitance of 1e-9, parameters of 1e-8) where f
        # varies at their own scale: unit steps cross all of its structure, and a saturated f reads
        # as flat to them. Steps scaled by |x_i| instead, where every input that differs has a
        # scale of its own (an input at 0 has none, and an edge input has its step already)
        size = np.abs(self.finite_x)
        differ = rest != 0
        small = differ & (size < 1.0)
        shrunk = (
            not rescaled
            and "wrong" in verdicts.values()
            and not kinks.any()
            and bool(np.any(small))
            and not np.any(differ & ((size == 0.0) | self.edge))
        )
        if shrunk:
            reach = np.where(size < 1.0, reach * size, reach)
        skipped = [label for label, verdict in verdicts.items() if verdict == "not differentiable"]
        # rows the first test could not judge, skipped as every input that differs showed a kink
        # within its step: f may only turn within the steps (sin at |x| = 1e4), which shorter
        # steps resolve; there such a row fails where it reads wrong and passes where right
        undecided = tuple(
            label
            for label, verdict in verdicts.items()
            if verdict == "inconclusive" and self._row(label).status == "skipped" and not kinks.any()
        )
        skipped += undecided
        wrong = (
            [label for label, verdict in verdicts.items() if verdict == "wrong"]
            if (rescaled or shrunk) and not kinks.any()
            else []
        )
        shorter = [] if kinks.any() or rescaled or shrunk else [label for label in skipped if label in fd_failed]
        if not np.any(rest) or not ((skipped and (kinks.any() or rescaled)) or wrong or shorter):
            return
        below = "again along the disagreement, below the first test's steps"
        if shorter:
            skipped = shorter
            reach = reach * _TAYLOR_RATIO ** -float(_TAYLOR_STEPS)
            why = below
        else:
            without = []
            if np.any(kinks):
                at = ", ".join(self._where(int(i)) for i in np.flatnonzero(kinks)[:4])
                without.append(f"the inputs at a kink of f ({at})")
            if rescaled:
                without.append("steps scaled by |x|")
            if shrunk:
                without.append("unit steps, at steps scaled by |x| below 1")
            why = f"again along the disagreement, without {' and '.join(without)}"
        taylor = self._taylor(rest * reach, why, reach=reach)
        measured = not (shrunk and self._below_measured(taylor))
        # (where every input that differs showed a kink within its step, a kink at x along each, a
        # clamp's at both bounds, leaves f linear along the disagreement: a slope no gradient matches)
        kinked = first != 0 if unsmooth else None
        still = self._judge_again(taylor, gradients, reference, skipped, wrong, unsmooth, measured, undecided, kinked)
        # (kinks nearer x than these steps too, which no stencil showed: below them, where the
        # differences, their stencils smooth, disagreed; only a verdict of wrong counts there)
        still = [label for label in still if label in fd_failed]
        for _ in range(0 if shrunk else 1 if shorter else 2):
            if not still:
                break
            reach = reach * _TAYLOR_RATIO ** -float(_TAYLOR_STEPS)
            taylor = self._taylor(rest * reach, below, reach=reach)
            still = self._judge_again(taylor, gradients, reference, still, [], False, True, undecided, kinked)

    def _judge_again(
        self,
        taylor: _Taylor,
        gradients: dict[str, np.ndarray],
        reference: np.ndarray,
        skipped: list[str],
        wrong: list[str],
        unsmooth: bool,
        measured: bool = True,
        undecided: tuple[str, ...] = (),
        differ: np.ndarray | None = None,
    ) -> list[str]:
        """:meth:`_second_look`'s verdicts along ``taylor``, written on the rows: a skipped row
        fails where its gradient reads wrong, unless every input in ``differ`` (those where the
        gradient differs, each showing a kink within its step) shows a kink at x; a wrong one, or
        an ``undecided`` skipped one, passes where it reads right, and a wrong one is skipped where
        it is inconclusive and ``unsmooth``. The skipped rows this look did not settle (not
        differentiable, or inconclusive) are returned. ``measured``: whether the noise the
        differences measured stands (:meth:`_noise`)."""
        still = []
        for label in (*skipped, *wrong):
            row, g = self._row(label), gradients[label]
            claimed = abs(float(np.dot(g - reference, taylor.direction)))
            verdict, detail = self._verdict(taylor, g, claimed, measured=measured)
            if label in skipped and verdict in ("not differentiable", "inconclusive"):
                still.append(label)
            if label in skipped and verdict == "wrong":
                if differ is not None and self._kinked_at_x(differ):
                    continue
                row.status = "failed"
                row.tags = row.tags - {"not_differentiable"}
                row.message = f"Taylor test {taylor.why}: {detail} [{row.message}]"
            elif (label in wrong or label in undecided) and verdict == "right":
                row.status = "passed"
                row.tags = row.tags - {"not_differentiable"}
                row.message = (
                    f"Taylor test {taylor.why}: {detail}; the first test's steps were too long for f [{row.message}]"
                )
            elif label in wrong and verdict == "inconclusive" and unsmooth:
                row.status = "skipped"
                row.message = (
                    f"not judged: f is no polynomial over the steps scaled by |x| where the gradient differs "
                    f"(finite differences there show a kink), and Taylor test {taylor.why}: {detail} [{row.message}]"
                )
        return still

    def _leaf_lines(self, g: np.ndarray, truth: np.ndarray, bad: np.ndarray) -> list[str]:
        """One line per leaf of x with entries that differ: how many, the leaf's relative error
        (its largest difference over its largest finite-difference entry), and at its worst entry
        both results and their ratio."""
        lines = []
        for j in range(len(self.flat.where)):
            lo, hi = int(self.flat.offsets[j]), int(self.flat.offsets[j + 1])
            wrong = bad[lo:hi]
            if not np.any(wrong):
                continue
            with np.errstate(invalid="ignore"):
                err = np.abs(g[lo:hi] - truth[lo:hi])
            k = lo + int(np.argmax(np.where(wrong, np.nan_to_num(err, nan=np.inf), -1.0)))
            finite = np.isfinite(err) & np.isfinite(truth[lo:hi])
            top = float(np.max(np.abs(truth[lo:hi][finite]), initial=0.0))
            largest = float(np.max(err[finite], initial=0.0))
            relative = largest / top if top else float("inf")
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = g[k] / truth[k]
            lines.append(
                f"{self._leaf_name(j)}: {int(np.sum(wrong))} of {hi - lo} entries differ, relative error "
                f"{relative:.3g}; worst at {self._where(k)}: gradient {g[k]:.6g}, finite differences {truth[k]:.6g} "
                f"(ratio {ratio:.4g})"
            )
        return lines

    def _leaf_name(self, j: int) -> str:
        if len(self.flat.leaves) == 1:
            return "x"
        return "x" + _tree.path_string(self.flat.spec.paths()[self.flat.where[j]])

    def _where(self, i: int) -> str:
        j, local, part = self.flat.part(i)
        leaf = self.flat.leaves[self.flat.where[j]]
        shape = _arrays.shape(leaf)
        index = tuple(int(a) for a in np.unravel_index(local, shape)) if shape else ()
        path = _tree.path_string(self.flat.spec.paths()[self.flat.where[j]]) if len(self.flat.leaves) > 1 else ""
        return (f"{path}{list(index) if index else ''}" or "x") + part

    def _tolerance(self, label: str, truth: _Truth) -> np.ndarray:
        """Per input, from that entry alone: four times the ground truth's error estimate, plus
        rtol of the entry, plus a floor from the gradient's dtype, the rounding a gradient
        computed in that dtype carries (``4 eps`` times f's condition over the input's scale); a
        finite-difference engine's own error (its plain central difference's) besides. No entry's
        tolerance depends on another's magnitude (a small entry 200% off beside a huge one fails),
        and no absolute floor lets a tiny gradient pass."""
        precisions = self._precisions(label)
        rtol: Any = self.rtol
        if rtol is None:
            rtol = self._per_entry([default_tolerances(p)[0] for p in precisions])
        if self.atol is None:
            atol: Any = self._rounding_floor(label, measured=True) + np.finfo(np.float64).tiny
        else:
            atol = self.atol
        tol: np.ndarray = _SAFETY * truth.errors + rtol * np.abs(truth.values) + atol
        if label.split("-")[0] in ("finite_differences", "scipy"):
            own = np.abs(truth.plain - truth.values) + _difference_noise(self.f0, self.flat.size)
            if label.split("-")[0] == "finite_differences":
                # (the engine differences x at x's own precision: where the truth runs on float64
                # copies of float32 inputs, its plain difference is float64's, a step and a
                # rounding far finer than the engine's; the truncation grows as the step squared,
                # eps**(2/3), and the rounding is the engine's eps over its step)
                narrow = self._entry_eps(label) / self.eps
                noise = _difference_noise(self.f0, self.flat.size, self._entry_eps(label))
                own = own * np.maximum(1.0, narrow ** (2 / 3)) + np.where(narrow > 1, noise, 0.0)
            tol = tol + _SAFETY * np.nan_to_num(own, nan=np.inf)
        return tol

    def _precisions(self, label: str) -> list[str]:
        """Per leaf of the flat vector, the dtype whose precision the engine's gradient of it has:
        the leaf's own where it is narrow (float32, float16, bfloat16; a complex64 leaf's parts
        float32), else the engine's float64 precision (mlx's is float32's). Each leaf's entries
        are judged by their own dtype: in a tree of a float32 and a float64 leaf, the first leaf's
        dtype gave every entry its tolerance (a float64 rule 0.08% off passed beside a float32 leaf,
        and a float32 leaf's rounding failed beside a float64 one)."""
        backend = next(b for b in self.chosen if backend_label(b) == label)
        out = []
        for i in self.flat.where:
            name = _arrays.dtype_name(self.flat.leaves[i])
            name = "float32" if name == "complex64" else name
            name = name if name in _NARROW_EPS else _float64_precision(backend)
            narrowest = self.narrowest  # (f computes in a narrower float inside)
            if narrowest is not None and _NARROW_EPS[narrowest] > _NARROW_EPS.get(name, 0.0):
                name = narrowest
            out.append(name)
        return out

    def _entry_eps(self, label: str, wide: float = float(np.finfo(np.float64).eps)) -> np.ndarray:
        """Per entry, the epsilon of the precision :meth:`_precisions` gives its leaf (``wide``
        for a float64 one)."""
        return self._per_entry([_NARROW_EPS.get(p, wide) for p in self._precisions(label)])

    def _rounding_floor(
        self, label: str, wide: float = float(np.finfo(np.float64).eps), measured: bool = False
    ) -> np.ndarray:
        """Per entry, the rounding a gradient computed at its leaf's precision carries: ``4 eps``
        times f's condition over the input's scale (``wide``: the epsilon of a float64 leaf).
        ``measured``: the entries whose rounding the engine's own gradient on the float64 copies
        measures (:meth:`_measurable`) get ``wide`` too."""
        eps = self._entry_eps(label, wide)
        if measured:
            eps = np.where(self._measurable(label), wide, eps)
        floor = 4 * eps * self.condition / self.scale
        return np.asarray(floor, dtype=np.float64) * np.ones(self.flat.size)

    def _measurable(self, label: str) -> np.ndarray:
        """Per entry, whether the engine's own rounding, its narrow gradient's distance from its
        gradient on the float64 copies (:meth:`_own_difference`), stands for the narrow dtype's
        floor: a narrow entry, where the copies serve and the ground truth computes on them at
        float64's precision (f keeps float64 there, and no narrower float inside is widened for
        the truth alone). The floor grows with f's condition, and so with ``|f|``: a float32
        ``3e7 + sum(x**2)`` let a gradient twice the right one pass by 14 an entry, though a
        gradient's own rounding has nothing to do with f's offset, and the copies measure it."""
        differences = label.split("-")[0] in ("finite_differences", "scipy")  # (their own error is allowed apart)
        if differences or self.widened is not None or not self._float64_copies_serve(label):
            return np.zeros(self.flat.size, dtype=bool)
        narrow = self._per_entry([p in _NARROW_EPS for p in self._precisions(label)]) > 0
        measurable: np.ndarray = narrow & (self.eps <= np.finfo(np.float64).eps)
        return measurable

    def _unmeasured(self, label: str) -> np.ndarray:
        """Per entry, the part of the narrow floor that :meth:`_measurable` took away: allowed back
        where the engine's own rounding cannot be measured, and the entries that pass by it alone
        named not checked."""
        unmeasured: np.ndarray = self._rounding_floor(label) - self._rounding_floor(label, measured=True)
        return unmeasured

    def _per_entry(self, per_leaf: list[float]) -> np.ndarray:
        """A value per leaf of the flat vector, repeated over each leaf's entries."""
        return np.repeat(np.asarray(per_leaf, dtype=np.float64), np.diff(self.flat.offsets))

    def _own(self, label: str, g: np.ndarray) -> _Own | None:
        """An AD engine's own rounding: against its gradient on float64 copies where they serve
        (:meth:`_own_difference`), else as its gradient's change over x's last bits
        (:meth:`_last_bits`); None for a finite-difference engine (its own error is in the
        tolerance already, and costs 2n evaluations here) or where neither applies."""
        if label.split("-")[0] in ("finite_differences", "scipy"):
            return None
        if self._float64_copies_serve(label):
            difference = self._own_difference(label, g)
            return None if difference is None else _Own(difference, signed=True)
        sizes = self._last_bits(label, g)
        return None if sizes is None else _Own(sizes, signed=False)

    def _float64_copies_serve(self, label: str) -> bool:
        """Whether the engine's gradient has narrow entries and f computes the same value on the
        float64 copies of x and the Constants."""
        narrow = [p in _NARROW_EPS for p in self._precisions(label)]
        return any(narrow) and self.wide and _promotes(self.scenario)

    def _last_bits(self, label: str, g: np.ndarray) -> np.ndarray | None:
        """An engine's own rounding per entry, where no float64 copy serves (f computes another
        value there, or x is float64 already): ``_LAST_BITS`` times the spread, over each leaf, of
        its gradient's change when every input moves by two units in its last place, at random
        signs. A gradient that is a difference of far larger terms (at an optimum of a
        least-squares loss, ``A.T (A w - b)`` with ``A w`` and ``b`` nearly equal) carries their
        rounding, which is no multiple of its own size and which the floors, from f's condition,
        do not see; the terms round anew a few units away, so its change there shows it. A wrong
        rule moves no more over x's last bits than a right one. The inputs whose stencils showed a
        kink of f stay where they are (a move by the last bits may cross it, and the gradient's jump
        there is no rounding); None where a second call at the same x gives another gradient."""
        still = self.kinked | self.fixed
        backend = next(b for b in self.chosen if backend_label(b) == label)
        rng = np.random.default_rng(self.seed)
        vector = self.flat.vector.copy()
        for j, dtype in enumerate(self.flat.parts):
            lo, hi = self.flat.offsets[j], self.flat.offsets[j + 1]
            with np.errstate(invalid="ignore", over="ignore"):
                base = vector[lo:hi].astype(dtype)
                signs = rng.choice(np.array([-2, 2], dtype=dtype), size=hi - lo)
                moved = (base + signs * np.abs(np.spacing(base))).astype(np.float64)
            vector[lo:hi] = np.where(np.isfinite(moved) & ~still[lo:hi], moved, vector[lo:hi])
        try:  # (2 engine calls, as on the float64 copies)
            change = np.nan_to_num(self.flat.read(self._engine_gradient(backend, label, self.flat.tree(vector))) - g)
        except Exception:
            return None
        if not self._steady(backend, label, g):
            return None
        spread = [_root_mean_square(change[lo:hi]) for lo, hi in itertools.pairwise(self.flat.offsets)]
        return _LAST_BITS * self._per_entry(spread)

    def _steady(self, backend: Backend, label: str, g: np.ndarray) -> bool:
        """Whether the engine's gradient at x, asked again, is ``g`` within 4 eps of each entry: a
        rule that draws noise (1 + 0.1 N(0, 1)) would read its own noise as rounding."""
        try:
            again = self.flat.read(self._engine_gradient(backend, label, self.x))
        except Exception:
            return False
        eps = self._entry_eps(label)
        return bool(np.all(np.abs(again - g) <= 4 * eps * np.abs(g) + np.finfo(np.float64).tiny))

    def _engine_gradient(self, backend: Backend, label: str, x: Any) -> Any:
        """The engine's gradient at ``x`` (on the caller's contexts), as the check's first call."""
        with _warnings_apart(self._row(label)):
            if self.has_aux:
                return di.value_and_gradient(self.counted, backend, x, *self.contexts, has_aux=True)[1]
            return di.gradient(self.counted, backend, x, *self.contexts)

    def _own_difference(self, label: str, g: np.ndarray) -> np.ndarray | None:
        """A narrow-dtype engine's own rounding, per entry, signed: its float32 (float16, bfloat16)
        gradient against the same engine's gradient on the float64 copies of x and the Constants,
        where f computes the same value there. Cancellation in a float32 backward pass (sinc near
        0: two terms of size 1/|x| subtracted) costs an entry far more than the float32 epsilon of
        its own size, and is the engine's precision, not a wrong rule (its error is as steady as
        a rule's: a few ulps away it stays, so no test of x's last bits tells the two apart). A
        rule wrong in the narrow dtype alone hides behind this term (docs/testing.md). Asked only
        for entries that fail without it: a passing check evaluates f no more. None where it does
        engine cannot run, and where a second call at the same x gives another
        gradient: a rule that draws noise (1 + 0.1 N(0, 1)) would read its own noise as rounding.
        Asked where :meth:`_float64_copies_serve`."""
        narrow = self._per_entry([p in _NARROW_EPS for p in self._precisions(label)]) > 0
        backend = next(b for b in self.chosen if backend_label(b) == label)
        try:
            with _warnings_apart(self._row(label)), _float64_copies_scope():
                x = self.truth_flat.tree(self.truth_flat.vector)
                contexts = tuple(
                    type(c)(v) for c, v in zip(self.truth_contexts, _copies(self.truth_contexts), strict=True)
                )
                if self.has_aux:
                    _, wide = di.value_and_gradient(self.counted, backend, x, *contexts, has_aux=True)
                else:
                    wide = di.gradient(self.counted, backend, x, *contexts)
            own: np.ndarray = g - self.truth_flat.read(wide)
        except Exception:
            return None
        if not self._steady(backend, label, g):
            return None
        rounding: np.ndarray = np.where(narrow, np.nan_to_num(own, nan=0.0), 0.0)  # (a float64 entry has none)
        return rounding

    def _coordinate_truth(self) -> _Truth:
        """Richardson-extrapolated central differences at h and 2h, per input, with their error
        estimates. An input nearer an edge of f's domain than h gets a step of its own, found by
        probing towards the edge (1 evaluation a probe), within the 4n + 20 of the whole check."""
        x = self.truth_flat.vector
        n = x.size
        free = np.flatnonzero(~self.fixed)
        h = self.truth_flat.exact(self.eps ** (1 / 3) * self.scale)
        h2 = self.truth_flat.exact(2 * h)
        values, errors, plain = np.zeros(n), np.full(n, np.inf), np.full(n, np.nan)
        fourth = np.zeros(n)  # |f's fourth difference| along each input, where its stencil is whole
        one_sided = 0
        # what the edges may spend: the evaluations an ordinary input would have taken and what
        # the 4n + 20 leaves beside f(x), the engines' evaluations and the Taylor test; 4 kept
        # for each input still to come
        spare = max(_SPARE_EVALUATIONS, 20 - 2 * _TAYLOR_STEPS - self.counted.calls)
        budget = self.counted.calls + 4 * free.size + spare
        for position, i in enumerate(free.tolist()):
            toward = self._first_side(x[i], h[i])
            first = self._moved(x, i, toward * h[i])
            second = self._moved(x, i, -toward * h[i]) if first is not None else None
            if first is None or second is None:
                bad, good_at_h = (toward, None) if first is None else (-toward, first)
                self.edge[i] = True
                left = budget - 4 * (free.size - position - 1)
                found = self._edge_stencil(x, i, bad, h[i], left) if left - self.counted.calls >= 3 else None
                if found is None:
                    # no step found in the domain within the budget: this entry is not checked (and
                    # the row says so); the Taylor test keeps off this input
                    self.reach[i] = 0.0
                    self.unchecked[i] = True
                    if good_at_h is not None:
                        values[i], errors[i] = -bad * (good_at_h - self.center) / h[i], np.inf
                    one_sided += 1
                else:
                    values[i], errors[i], room = found
                    self.reach[i] = room / self._taylor_top()
                continue
            samples: dict[str, float | None] = (
                {"+1": first, "-1": second} if toward > 0 else {"+1": second, "-1": first}
            )
            samples["+2"], samples["-2"] = self._moved(x, i, h2[i]), self._moved(x, i, -h2[i])
            rounding = 4 * self.eps[i] * (self.condition + 1e-300) / h[i]
            values[i], errors[i], plain[i] = _stencil(self.center, samples, h[i], h2[i], rounding)
            self.kinked[i] = _kink_within(self.center, samples, self.eps[i])
            if None not in samples.values():
                fourth[i] = abs(_fourth_difference(self.center, samples))
            if samples["-2"] is None or samples["+2"] is None:
                # an edge between h and 2h: x +- h are too near it for an accurate difference
                one_sided += 1
                self.edge[i] = True
                bad = 1.0 if samples["+2"] is None else -1.0
                left = budget - 4 * (free.size - position - 1)
                found = self._edge_stencil(x, i, bad, h[i], left) if left - self.counted.calls >= 3 else None
                if found is None:
                    self.reach[i] = h[i] / self._taylor_top()
                else:
                    values[i], errors[i], room = found
                    self.reach[i] = room / self._taylor_top()
        self.measured = self._measured_noise(x, fourth, h)
        errors += 4 * self.measured / h  # (twice the Richardson value's own noise, 0.95 sigma / h)
        return _Truth(values, errors, plain, one_sided)

    def _measured_noise(self, x: np.ndarray, fourth: np.ndarray, h: np.ndarray) -> float:
        """The standard deviation of f's rounding near x as measured, where the stencils show more
        of it than f's condition predicts (the terms f adds up may be far larger than f and its
        gradient: a naive variance, ``exp(x) - exp(c x)``); 0 elsewhere, and where an input is
        near an edge of f's domain (its own steps are judged apart).

        A fourth difference amplifies independent rounding by ``sqrt(70)``, and a smooth f by
        ``h**4`` times its fourth derivative. Rounding does not shrink with the step; a kink's
        fourth difference shrinks as the step, a smooth term's (``sin`` at ``x = 1e6``, turning
        within the step) as its fourth power. So the fourth differences are taken again at a
        sixteenth and at a 64th of the step (four draws each, along the inputs that showed more than
        rounding: 32 evaluations more), and they measure noise only where the shorter steps' do
        not fall to a third of the longer ones' or below (a kink at x gives a quarter; four draws
        of rounding fall so by chance about one time in forty). A step whose differences all come out 0
        (rounding in quanta of a large term's ulp may show none over a short step) says nothing."""
        predicted = 64 * np.sqrt(70.0) * self.eps * (self.condition + 1e-300)
        loud = np.flatnonzero(fourth > predicted).tolist()
        if not loud or np.any(self.edge):
            return 0.0
        estimates = []
        for level in (16, 64):
            draws = []
            for j in range(_NOISE_DRAWS):  # (steps a little apart: each draw at points of its own)
                i = loud[j % len(loud)]
                step = self.truth_flat.exact(h / (level * (1 + j / 4)))[i]
                samples = {
                    key: self._moved(x, i, k * step) for key, k in (("+1", 1), ("-1", -1), ("+2", 2), ("-2", -2))
                }
                if None in samples.values():
                    return 0.0
                draws.append(_fourth_difference(self.center, samples))
            estimates.append(_root_mean_square(np.array(draws)) / math.sqrt(70.0))
        longer, shorter = estimates
        if longer == 0.0 or shorter == 0.0:
            return max(longer, shorter)
        return min(longer, shorter) if shorter > longer / 3 else 0.0

    def _first_side(self, value: float, h: float) -> float:
        """The side to step to first: towards an edge another input found within h, else towards
        the nearest integer, where the edges of domains sit most often (log, sqrt at 0; acos,
        atanh, logit at 1 or -1). Where x_i + h crosses an edge there, that 1 evaluation finds it."""
        for side, point in self.inside.items():
            if 0 < (point - value) * side < h:
                return side
        return 1.0 if np.round(value) > value else -1.0

    def _moved(self, x: np.ndarray, i: int, step: float) -> float | None:
        point = x.copy()
        point[i] = x[i] + step
        return self._at(point)

    def _edge_stencil(
        self, x: np.ndarray, i: int, bad: float, h: float, budget: int
    ) -> tuple[float, float, float] | None:
        """``(value, error estimate, a step known to stay in f's domain towards the edge)`` of the
        derivative along input i, whose step h crosses an edge of f's domain on side ``bad``.

        Probes towards the edge: first steps of 1/256 of x_i's distance to the point nearest the
        edge another input found in the domain on that side (inputs often share an edge), and to
        the nearest integer (where most edges sit); at either the derivative needs 2 evaluations
        more: a cubic through x - c, x, x + c, x + 2c, its error estimated by the central
        difference's departure from it. Then steps falling by 64 (central differences at half the
        probe's step and at it, the probe's point reused: 3 more)."""
        n = x.size
        exact = self.truth_flat.exact
        candidates: list[tuple[float, bool]] = []
        known = self.inside.get(bad)
        distances = [abs(known - x[i])] if known is not None and (known - x[i]) * bad > 0 else []
        distances.append(abs(x[i] - np.round(x[i])))
        for distance in distances:
            hint = float(exact(np.full(n, distance / _HINT_MARGIN))[i])
            if 0 < hint < h / _PROBE_FACTOR and all(hint != c for c, _ in candidates):
                candidates.append((hint, True))
        probe = h / _PROBE_FACTOR
        while probe > h * self.eps[i] and len(candidates) < _PROBES:
            candidates.append((float(exact(np.full(n, probe))[i]), False))
            probe /= _PROBE_FACTOR
        for step, hinted in candidates:
            if step <= 0 or budget - self.counted.calls < (3 if hinted else 4):
                return None
            at_edge_side = self._moved(x, i, bad * step)
            if at_edge_side is None:
                continue
            reached = x[i] + bad * step
            self.inside[bad] = reached if known is None else (min if bad < 0 else max)(known, reached)
            if hinted:
                near, far = self._moved(x, i, -bad * step), self._moved(x, i, -2 * bad * step)
                if near is None or far is None:
                    return None
                # the points at -1, 0, 1, 2 steps away from the edge (sign by ``bad``)
                d1 = (near - at_edge_side) / (2 * step) * -bad
                cubic = (-2 * at_edge_side - 3 * self.center + 6 * near - far) / (6 * step) * -bad
                rounding = 4 * self.eps[i] * (self.condition + 1e-300) / step
                return cubic, abs(d1 - cubic) + 3 * rounding, step
            half = float(exact(np.full(n, step / 2))[i])
            samples = {
                "+1": self._moved(x, i, half),
                "-1": self._moved(x, i, -half),
                ("+2" if bad > 0 else "-2"): at_edge_side,
                ("-2" if bad > 0 else "+2"): self._moved(x, i, -bad * step),
            }
            if samples["+1"] is None or samples["-1"] is None:
                return None
            rounding = 4 * self.eps[i] * (self.condition + 1e-300) / half
            value, error, _ = _stencil(self.center, samples, half, step, rounding)
            return value, error, step
        return None

    # -- projections ---------------------------------------------------------------------------------

    def _projected(self, gradients: dict[str, np.ndarray], k: int) -> None:
        rng = np.random.default_rng(self.seed)
        # (no direction moves an input held fixed: inf or NaN)
        directions = [
            u / np.linalg.norm(u)
            for u in (np.where(self.fixed, 0.0, rng.standard_normal(self.flat.size)) for _ in range(k))
        ]
        # and one direction in each leaf of a tree (the first _LEAF_DIRECTIONS): along directions
        # over every input, a small leaf's error is diluted by the others' (a whole leaf's gradient
        # 0 where it is 2e-6 b passed beside 5000 entries of order 1)
        leaf_of: list[int | None] = [None] * len(directions)  # (None: a direction over every leaf)
        offsets = self.flat.offsets
        if len(offsets) > 2:
            for i, (start, stop) in enumerate(itertools.pairwise(offsets)):
                if i == _LEAF_DIRECTIONS:
                    break
                u = np.zeros(self.flat.size)
                u[start:stop] = rng.standard_normal(stop - start)
                u = np.where(self.fixed, 0.0, u)
                if np.any(u):
                    directions.append(u / np.linalg.norm(u))
                    leaf_of.append(i)
        k = len(directions)
        x = self.truth_flat.vector
        eps = float(np.max(self.eps, initial=np.finfo(np.float64).eps))
        h = eps ** (1 / 3) * float(np.max(self.scale, initial=1.0))
        values, errors, plain = np.zeros(k), np.full(k, np.inf), np.zeros(k)
        for j, u in enumerate(directions):
            plus, minus = self._at(x + h * u), self._at(x - h * u)
            rounding = 4 * eps * self.condition / h
            if plus is not None and minus is not None:
                values[j] = plain[j] = (plus - minus) / (2 * h)
                # truncation, taking f's third derivative along u as its second over the scale of x
                curvature = abs(plus + minus - 2 * self.center) / (h * h)
                errors[j] = rounding + curvature * h * h / float(np.max(self.scale, initial=1.0))
            elif plus is not None or minus is not None:
                side, sign = (plus, 1.0) if plus is not None else (minus, -1.0)
                assert side is not None
                values[j] = plain[j] = sign * (side - self.center) / h
                errors[j] = np.inf  # one-sided and first order: the Taylor test judges
        self.label = "central differences along random directions" + (" (float64)" if self.wide else "")
        truth = _Truth(values, errors, plain)
        magnitude = float(np.max(np.abs(values), initial=0.0))
        worst: tuple[float, int] | None = None
        failing: set[str] = set()
        # (asked only where a direction fails without it, once per engine: 2 engine calls more)
        owns = {label: functools.cache(functools.partial(self._own, label, g)) for label, g in gradients.items()}
        for label, g in gradients.items():
            row = self._row(label)
            row.reference = self.label
            got = np.array([float(np.dot(g, u)) for u in directions])
            # (a direction over every leaf is judged at the coarsest leaf's precision, one in a
            # leaf at that leaf's own, against the size of its own projection)
            precisions = self._precisions(label)
            coarsest = max(precisions, key=lambda p: default_tolerances(p)[0])
            wanted = [default_tolerances(coarsest if i is None else precisions[i]) for i in leaf_of]
            rtol = np.array([w[0] for w in wanted]) if self.rtol is None else self.rtol
            own_size = np.array([magnitude if i is None else abs(v) for i, v in zip(leaf_of, values, strict=True)])
            atol = np.array([w[1] for w in wanted]) * own_size if self.atol is None else self.atol
            tol = _SAFETY * errors + rtol * np.abs(values) + atol
            err = np.abs(got - values)
            row.abs_error = float(np.max(err[np.isfinite(err)], initial=0.0))
            row.rel_error = row.abs_error / magnitude if magnitude else 0.0
            bad = ~(err <= tol) | ~np.isfinite(got)
            if np.any(bad):
                # a float32 engine's own rounding along each direction, as the entries get it
                # (its sizes from x's last bits only in the Taylor test, which looks for kinks first:
                # with no stencils here, a move by the last bits may cross one unseen)
                own = owns[label]() if self._float64_copies_serve(label) else None
                if own is not None:
                    tol = tol + np.array([own.along(u, random=True) for u in directions])
                    bad = ~(err <= tol) | ~np.isfinite(got)
            if np.any(bad):
                ratio = np.where(bad, np.nan_to_num(err / np.maximum(tol, 1e-300), nan=np.inf, posinf=np.inf), 0.0)
                j = int(np.argmax(ratio))
                row.status = "failed"
                row.message = (
                    f"projection {j}: u . grad f = {got[j]:.10g}, finite differences give {values[j]:.10g} "
                    f"(error estimate {errors[j]:.3g}, abs error {err[j]:.3g}, tolerance {tol[j]:.3g})"
                )
                failing.add(label)
                if worst is None or ratio[j] > worst[0]:
                    worst = (float(ratio[j]), j)
        resolves = bool(np.all(_SAFETY * errors <= _RESOLVES * max(magnitude, np.finfo(float).tiny)))
        if failing or not resolves:
            scaled = [u * self.scale / float(np.max(self.scale)) for u in directions]
            j = worst[1] if worst is not None else self._most_visible(scaled, gradients)
            why = f"along projection {j}" + ("" if failing else " (finite differences too noisy to judge alone)")
            # three steps (6 evaluations): projected mode stays within 2k + 10 evaluations of f
            taylor = self._taylor(scaled[j], why, count=3, random=True)
            for label, g in gradients.items():
                row = self._row(label)
                if row.status == "failed" and label not in failing:
                    continue
                self._apply_taylor(row, taylor, g, fd_failed=label in failing, own=owns[label])
        self.truth = truth

    def _most_visible(self, directions: list[np.ndarray], gradients: dict[str, np.ndarray]) -> int:
        """The direction along which an error of a fixed fraction of ``<g, v>`` shows most above
        f's rounding in the Taylor test: the largest ``|<g, v>|``, v scaled as the test's steps
        scale it (the noise floor it compares with does not depend on v). Each direction was
        drawn at random, apart from the errors: picking one by the gradient's projection picks
        none by the error's."""
        g = np.nan_to_num(next(iter(gradients.values()), np.zeros(self.flat.size)))
        movable = self.reach > 0
        scores = []
        for v in directions:
            largest = float(np.max(np.abs(v[movable]) / self.reach[movable], initial=0.0))
            scores.append(abs(float(np.dot(g, v))) / largest if largest > 0 else 0.0)
        return int(np.argmax(scores))

    # -- the Taylor remainder test --------------------------------------------------------------------

    def _taylor(
        self,
        direction: np.ndarray,
        why: str,
        count: int = _TAYLOR_STEPS,
        reach: np.ndarray | None = None,
        random: bool = False,
    ) -> _Taylor:
        """f at ``x +- h v`` for h falling by 4 from ``1000 eps**(1/3)`` of the scale of x (at most
        0.1 of it; of ``reach`` where given): the largest step moves each input by at most that much.
        ``random``: ``direction`` was drawn at random, apart from the gradient."""
        reach = self.reach if reach is None else reach
        movable = reach > 0
        direction = np.where(movable, np.nan_to_num(direction), 0.0)
        largest = float(np.max(np.abs(direction[movable]) / reach[movable], initial=0.0))
        v = direction / largest if largest > 0 else direction
        # no step beyond an edge of f's domain the differences found near x: its reach is the step
        # found in the domain there, over the top step
        steps = self._taylor_top() / _TAYLOR_RATIO ** np.arange(count)
        x = self.truth_flat.vector
        plus = [self._at(x + t * v) for t in steps]
        minus = [self._at(x - t * v) for t in steps]
        return _Taylor(v, steps, plus, minus, why, random)

    def _taylor_top(self) -> float:
        eps = float(np.max(self.eps, initial=np.finfo(np.float64).eps))
        return float(min(0.1, 1000 * eps ** (1 / 3)))

    def _apply_taylor(
        self,
        row: Row,
        taylor: _Taylor,
        g: np.ndarray,
        fd_failed: bool,
        reference: np.ndarray | None = None,
        own: Callable[[], _Own | None] | None = None,
    ) -> str:
        """The Taylor test's verdict on ``g``, written on ``row``; returned. ``own``: the engine's
        own rounding per entry (:meth:`_own`), asked only where the verdict is "wrong" without it."""
        claimed = 0.0 if reference is None else abs(float(np.dot(g - np.nan_to_num(reference), taylor.direction)))
        engine = any(backend_label(b) == row.backend for b in self.chosen)
        measured = self._measurable(row.backend) if engine else np.zeros(self.flat.size, dtype=bool)

        def along(floor: np.ndarray) -> float:
            # every entry's rounding at its floor, with the signs of v: only a direction chosen from
            # the gradient (along a disagreement) lines them up. Along a random one they add up as
            # a random walk; their sum over thousands of inputs hid a whole float32 leaf 1% off.
            floors = np.abs(floor * taylor.direction)
            total = float(np.sum(floors))
            return min(total, _RANDOM_ROUNDING * float(np.linalg.norm(floors))) if taylor.random else total

        narrow = self._narrow_floor(row.backend)
        allowed = along(np.where(measured, 0.0, narrow))
        verdict, detail = self._verdict(taylor, g, claimed if fd_failed else 0.0, allowed)
        rounding = own() if own is not None and verdict == "wrong" else None
        unmeasured = verdict == "wrong" and rounding is None and bool(measured.any())
        if rounding is not None:
            allowed += rounding.along(taylor.direction, taylor.random)
        elif unmeasured:  # (the floor stands where the engine's own rounding is not measured)
            allowed = along(narrow)
        if rounding is not None or unmeasured:
            verdict, detail = self._verdict(taylor, g, claimed if fd_failed else 0.0, allowed)
        if unmeasured and verdict != "wrong":
            detail += (
                " [the gradient not checked along v: only the rounding f's condition allows its dtype hides "
                "the error, the engine's own rounding not measured on float64 copies]"
            )
        note = f"Taylor test {taylor.why}: {detail}"
        if verdict == "wrong":
            row.status = "failed"
            row.message = f"{row.message}; {note}" if fd_failed else note
        elif verdict == "not differentiable":
            row.status = "skipped"
            row.message = f"f is not differentiable at x along v: {note}" + (f" [{row.message}]" if fd_failed else "")
            row.tags = row.tags | {"not_differentiable"}
        elif verdict == "right":
            if fd_failed:
                row.status = "passed"
                row.message = f"finite differences disagreed ({row.message}), but {note}: they are the side at fault"
            else:
                row.message = note
        elif fd_failed:
            row.message = f"{row.message}; {note}"
        else:
            row.message = note
        return verdict

    def _verdict(
        self, taylor: _Taylor, g: np.ndarray, claimed: float, allowed: float = 0.0, measured: bool = True
    ) -> tuple[str, str]:
        """:func:`_taylor_verdict` on ``g`` along ``taylor``'s direction; ``claimed``: how far the
        reference that disagreed puts ``<g, v>`` (0: none); ``allowed``: the error of ``<g, v>``
        the gradient's narrow dtype carries (0: none); ``measured``: whether the noise the
        differences measured stands (:meth:`_noise`)."""
        return _taylor_verdict(
            self.center,
            taylor,
            float(np.dot(g, taylor.direction)),
            self._noise(g, measured),
            float(np.sum(np.abs(g * taylor.direction))),
            claimed,
            allowed,
        )

    def _narrow_floor(self, label: str) -> np.ndarray:
        """Per entry, the rounding a gradient computed in a narrow dtype carries (``4 eps`` times
        f's condition over the input's scale, as :meth:`_tolerance` allows it); 0 for a float64
        entry and for a label that is no engine's. The Taylor test runs on the float64 copies: a
        float32 gradient of 0 where the true one is 7e-10, below float32's resolution of f
        (sigmoid(30 v) saturated), was called wrong there though the differences allowed it."""
        if not any(backend_label(b) == label for b in self.chosen):
            return np.zeros(self.flat.size)
        return self._rounding_floor(label, wide=0.0)

    def _noise(self, g: np.ndarray, measured: bool = True) -> float:
        """The rounding noise of f's values: a few ulps of f and of the terms ``x_i g_i``, or twice
        the noise the differences measured, where that is larger (and ``measured``)."""
        eps = float(np.max(self.eps, initial=np.finfo(np.float64).eps))
        terms = float(np.sum(np.abs(self.finite_x * np.nan_to_num(g))))
        return max(2 * eps * (abs(self.center) + terms), 2 * self.measured if measured else 0.0)

    def _below_measured(self, taylor: _Taylor) -> bool:
        """Whether f's second differences ``f(x+hv) + f(x-hv) - 2f(x)`` at the three shortest
        steps of ``taylor`` all lie below a hundredth of the noise the differences measured: that
        noise is then no rounding of f over these steps (rounding keeps its size at any step, and
        three draws of it so far below their spread do not happen by chance). Steps beyond f's
        own scale measure as noise what f does between them: a saturated ``tanh(w / 1e-8)``,
        ``sin(w / 1e-8)``. The gradient plays no part: a wrong one is judged on the same noise."""
        plus, minus = taylor.plus[-3:], taylor.minus[-3:]
        if self.measured <= 0.0 or len(plus) < 3 or any(p is None for p in (*plus, *minus)):
            return False
        even = np.abs(np.asarray(plus, dtype=float) + np.asarray(minus, dtype=float) - 2 * self.center)
        return bool(np.all(even < self.measured / 100))

    # -- engines against each other --------------------------------------------------------------------

    def _pairwise(self, gradients: dict[str, np.ndarray]) -> None:
        # finite-difference engines are judged by the ground truth alone: their own error is no
        # tight tolerance
        labels = [label for label in gradients if label.split("-")[0] not in ("finite_differences", "scipy")]
        self.disagreeing: set[str] = set()
        for i, a in enumerate(labels):
            for b in labels[i + 1 :]:
                row = Row(f"{a} vs {b}", "f", "gradient", "passed", reference=b)
                self.report.rows.append(row)
                try:
                    assert_allclose(
                        self.native[a], _like(self.native[b], self.native[a]), self.rtol, self.atol, check_dtype=False
                    )
                except AssertionError as exc:
                    if self._within_rounding(gradients[a], gradients[b], a, b):
                        row.message = "within the rounding both gradients carry at their dtypes (f's condition)"
                        continue
                    row.status, row.message = "failed", str(exc)
                    self.disagreeing.update((a, b))

    def _within_rounding(self, ga: np.ndarray, gb: np.ndarray, a: str, b: str) -> bool:
        """Whether two engines' gradients differ, entry by entry, by no more than the rounding
        floors each carries at its precision (:meth:`_rounding_floor`: ``4 eps`` times f's
        condition over the input's scale) beside the rtol of their dtypes: engines that sum
        cancelling terms in another order (a least-squares gradient at its optimum, 1e4 terms
        cancelling to near 0) differ by that, as each differs from the ground truth. Only where
        the default tolerances are in use (no ``atol`` given)."""
        if self.atol is not None or ga.shape != gb.shape:
            return False
        rtol = self.rtol
        if rtol is None:
            rtol = np.maximum(
                *(self._per_entry([default_tolerances(p)[0] for p in self._precisions(label)]) for label in (a, b))
            )
        floor = self._rounding_floor(a) + self._rounding_floor(b)
        with np.errstate(invalid="ignore"):
            return bool(np.all(np.abs(ga - gb) <= rtol * np.maximum(np.abs(ga), np.abs(gb)) + floor))

    def _not_differentiable_but_disagreeing(self) -> None:
        for row in self.report.rows:
            if "not_differentiable" in row.tags and row.backend in self.disagreeing:
                row.status = "failed"
                row.message += " [and the engines disagree with each other]"


def _stencil(
    f0: float, samples: dict[str, float | None], h: float, h2: float, rounding: float
) -> tuple[float, float, float]:
    """``(value, error estimate, plain central difference)`` of one derivative from f at
    ``x +- h`` and ``x +- 2h`` (None where f left its domain)."""
    p1, m1, p2, m2 = samples["+1"], samples["-1"], samples["+2"], samples["-2"]
    if p1 is not None and m1 is not None:
        d1 = (p1 - m1) / (2 * h)
        if p2 is not None and m2 is not None:
            d2 = (p2 - m2) / (2 * h2)
            r = d1 + (d1 - d2) * h * h / (h2 * h2 - h * h)  # Richardson: the h^2 terms cancel
            return r, abs(d1 - d2) / 3 + 2 * rounding, d1
        # the outer points left the domain: the one-sided differences bound the central one's error
        spread = abs((p1 - f0) / h - (f0 - m1) / h)
        return d1, spread + 2 * rounding, d1
    for near, far, sign in ((p1, p2, 1.0), (m1, m2, -1.0)):
        if near is None:
            continue
        if far is not None:
            f1 = sign * (near - f0) / h
            f2 = sign * (far - f0) / h2
            r = f1 + (f1 - f2) * h / (h2 - h)  # one-sided Richardson: the h terms cancel
            return r, abs(f1 - f2) + 4 * rounding, f1
        return sign * (near - f0) / h, np.inf, sign * (near - f0) / h
    return np.nan, np.inf, np.nan


def _root_mean_square(values: np.ndarray) -> float:
    """The root mean square of ``values`` (0 for none), taken over their largest: the squares of
    values beyond 1e154 overflow (to inf, a tolerance that passes any gradient; a Python float's
    square raises), while f near the top of float64 is finite and so are its differences."""
    top = float(np.max(np.abs(values), initial=0.0))
    if top == 0.0 or not np.isfinite(top):
        return top
    return top * float(np.sqrt(np.mean(np.square(values / top))))


def _fourth_difference(f0: float, samples: dict[str, float | None]) -> float:
    """f's fourth difference over ``x - 2h .. x + 2h`` along one input: ``h**4`` times its fourth
    derivative for a smooth f, far below its rounding, which this difference amplifies by
    ``sqrt(70)``."""
    p1, m1, p2, m2 = samples["+1"], samples["-1"], samples["+2"], samples["-2"]
    return float(m2 - 4 * m1 + 6 * f0 - 4 * p1 + p2)  # type: ignore[operator]


def _kink_within(f0: float, samples: dict[str, float | None], eps: float) -> bool:
    """Whether f at ``x +- h`` and ``x +- 2h`` along one input shows a kink within ``2h``: the
    second difference at 2h is 4 times the one at h for a smooth f (to ``h**4`` times its fourth
    derivative), about twice it across a kink, and far above 4 times it with a kink between h
    and 2h. The mismatch, f's fourth difference, must stand 64 times above f's rounding, and
    above ``_SMOOTH_MISMATCH`` of the second differences themselves: f's rounding may be far
    above its epsilon times its values (at the optimum of a least-squares loss, ``f = |A w - b|^2``
    near 0, each residual carries the rounding of ``A w`` and ``b``), but a kink's mismatch is of
    the second differences' own order."""
    p1, m1, p2, m2 = samples["+1"], samples["-1"], samples["+2"], samples["-2"]
    if p1 is None or m1 is None or p2 is None or m2 is None:
        return False
    mismatch = abs(_fourth_difference(f0, samples))
    seconds = abs(p2 + m2 - 2 * f0) + 4 * abs(p1 + m1 - 2 * f0)
    return bool(
        mismatch > 64 * 8 * eps * (abs(f0) + abs(p1) + abs(m1) + abs(p2) + abs(m2))
        and mismatch > _SMOOTH_MISMATCH * seconds
    )


_SMOOTH_MISMATCH = 1e-6
"""The most f's fourth difference may be of its second differences, ``h**2`` times its fourth
derivative over 12 times its second, for f to read as smooth within its stencil: a fourth
derivative a million times the second at the checker's float64 step (``sin(1e3 x)``), or a slope
jump of 1e-5 times the curvature times the step, still read as kinks."""


def _taylor_verdict(
    f0: float, taylor: _Taylor, slope: float, noise: float, size: float, claimed: float = 0.0, allowed: float = 0.0
) -> tuple[str, str]:
    """``(verdict, detail)``: right, wrong, not differentiable, or inconclusive, from the observed
    orders of the remainders over the falling steps (those above 30 times the noise). ``claimed``:
    how far the reference that disagreed puts ``<g, v>`` (0: none)."""
    steps = taylor.steps
    if not (np.isfinite(slope) and np.isfinite(noise)):  # (an inf gradient entry, f's terms overflowing)
        return "inconclusive", f"<g, v> = {slope:.3g} and f's rounding noise {noise:.3g}: nothing to compare"
    # where a step leaves f's domain, an edge lies within it: f is no polynomial at that scale, on
    # either side, so only the steps 16 times smaller count
    left = [steps[i] for i in range(len(steps)) if taylor.plus[i] is None or taylor.minus[i] is None]
    limit = min(left, default=np.inf) / 16
    taylor = dataclasses.replace(
        taylor,
        plus=[p if t < limit else None for p, t in zip(taylor.plus, steps, strict=True)],
        minus=[m if t < limit else None for m, t in zip(taylor.minus, steps, strict=True)],
    )
    both = [i for i in range(len(steps)) if taylor.plus[i] is not None and taylor.minus[i] is not None]
    floor = 10 * noise
    if len(both) >= 3:
        odd = [abs((taylor.plus[i] - taylor.minus[i]) / 2 - steps[i] * slope) for i in both]  # type: ignore[operator]
        even = [abs(taylor.plus[i] + taylor.minus[i] - 2 * f0) for i in both]  # type: ignore[operator]
        used = [steps[i] for i in both]
        even_order = _last_order(used, even, floor)
        if even_order is not None and even_order < 1.5 and even[-1] > floor:  # (a kink far away: f is smooth near x)
            return "not differentiable", (
                f"f(x+hv) + f(x-hv) - 2f(x) shrinks as h^{even_order:.2g}, not h^2, over h = {used[0]:.2g} .. "
                f"{used[-1]:.2g} (a jump or a kink)"
            )
        order = _last_order(used, odd, floor)
        expected, remainders = 3.0, odd
        # (over steps scaled by |x_i| > 1 the second look, at unit steps, settles it instead)
        unit = float(np.max(np.abs(taylor.direction), initial=0.0)) <= 1.0
        crossed = _kinks_crossed(used, odd, even, floor, noise, anywhere=unit)
    else:
        crossed = None
        one = [i for i in range(len(steps)) if taylor.plus[i] is not None]
        sign = 1.0
        if len(one) < 3:
            one = [i for i in range(len(steps)) if taylor.minus[i] is not None]
            sign = -1.0
        if len(one) < 3:
            if left:
                return "inconclusive", (
                    f"f left its domain at h = {min(left):.2g} along v: too near an edge for the steps "
                    f"{steps[0]:.2g} .. {steps[-1]:.2g}"
                )
            return "inconclusive", "f left its domain at every step"
        side = taylor.plus if sign > 0 else taylor.minus
        remainders = [abs(side[i] - f0 - sign * steps[i] * slope) for i in one]  # type: ignore[operator]
        used = [steps[i] for i in one]
        order = _last_order(used, remainders, floor)
        expected = 2.0
    shown = ", ".join(f"{r:.2g}" for r in remainders)
    bound = floor / used[-1]  # (the least error of <g, v> the smallest step shows)
    resolved = bound <= _RESOLVES * max(size, 1e-300) or 2 * bound < claimed
    above = [i for i, r in enumerate(remainders) if r > floor]
    if order is not None and remainders[-1] <= floor and above:
        # At the smallest steps the remainder is f's rounding noise, having stood one step before
        # far above it, higher than a first-order error of <g, v> (which falls by the steps' ratio
        # only) could fall from in one step: the larger steps crossed a kink of f (a ReLU's), and
        # the smallest one bounds the error by the noise over it.
        last = above[-1]
        if remainders[last] > (used[last] / used[last + 1]) ** 2 * floor:
            if not resolved:
                return "inconclusive", (
                    f"remainders {shown} fall to f's rounding noise at the smallest steps, where an error of "
                    f"<g, v> below {bound:.2g} . |v| would not show"
                )
            ruled_out = f"; the reference's {claimed:.2g} is ruled out" if claimed else ""
            return "right", (
                f"remainders {shown} fall to f's rounding noise at the smallest steps: <g, v> is right to "
                f"{bound:.2g} . |v|{ruled_out}, and the larger steps cross a kink of f"
            )
    if order is None:
        smallest = used[-1]
        if all(r <= floor for r in remainders[-2:]) and floor / smallest <= _RESOLVES * max(size, 1e-300):
            return (
                "right",
                f"remainders {shown} at f's rounding noise (an error would show as {floor / smallest:.2g} . |v|)",
            )
        return "inconclusive", f"remainders {shown} within f's rounding noise {noise:.2g}"
    error = remainders[-1] / used[-1]  # what a first-order term of the last remainder would say <g, v> is off by
    if order >= (expected + 1) / 2:
        if error <= 1e-4 * max(size, 1e-300):
            return "right", f"remainders {shown} shrink as h^{order:.2g}"
        return (
            "inconclusive",
            f"remainders {shown} shrink as h^{order:.2g}, yet at the last step <g, v> may be off by {error:.3g}",
        )
    if 0.7 <= order <= 1.5 and error > _RESOLVES * max(size, 1e-300) * 1e-2:
        if crossed is not None:
            return "not differentiable", (
                f"remainders {shown} shrink as h^{order:.2g}, but not as a first-order error of <g, v> does: "
                f"{crossed} (the steps cross kinks of f, a ReLU network's, which no first-order term explains)"
            )
        if error <= allowed:  # (within the rounding of the gradient's narrow dtype)
            return "inconclusive", (
                f"remainders {shown} shrink only as h^{order:.2g}: <g, v> is off by about {error:.3g}, "
                f"within the {allowed:.2g} its dtype's rounding allows"
            )
        return "wrong", f"remainders {shown} shrink only as h^{order:.2g}: <g, v> is off by about {error:.3g}"
    return "inconclusive", f"remainders {shown} shrink as h^{order:.2g}"


def _kinks_crossed(
    steps: list[float], odd: list[float], even: list[float], floor: float, noise: float, anywhere: bool = True
) -> str | None:
    """Why the remainders over the steps that would call ``<g, v>`` wrong are no first-order error
    of it, where they show f kinked at those steps (None where they do not).

    A first-order error ``e`` makes the odd remainder ``e h + c h**3``: where it shrinks only as
    ``h`` over two steps, ``c h**2`` is at most a fourteenth of ``e`` there, so over every shorter
    step it stays above half what ``e h`` predicts (less f's rounding, twice its noise). A remainder
    falling below that was no first-order term: the longer steps crossed a kink. And f's second
    difference ``f(x+hv) + f(x-hv) - 2f(x)`` shrinks as ``h**2`` where f is smooth over the steps;
    over two of them from the deciding pair down, both above the noise floor, shrinking as
    ``h**1.5`` or slower shows a kink within them (a ReLU network's kinks lie at every scale). So
    do two such pairs anywhere over the steps, where one may be a kink far from x, f smooth near
    it: a float32 ReLU network's second differences shrank as ``h**1.4`` and ``h**1.3`` over the
    longest steps, then as ``h**1.6``, and its right gradient was called wrong. ``anywhere``: no
    step moves an input beyond its unit scale (over steps scaled by a large ``|x_i|`` the second
    look, at unit steps, tells a kink from an error)."""
    above = [i for i, r in enumerate(odd) if r > floor]
    pairs = [(a, b) for a, b in itertools.pairwise(above) if b == a + 1]
    if not pairs:
        return None
    a, b = pairs[-1]
    slope = odd[b] / steps[b]
    for j in range(b + 1, len(steps)):
        if odd[j] < slope * steps[j] / 2 - 2 * noise:
            return (
                f"at h = {steps[j]:.2g} the remainder {odd[j]:.2g} is below half the {slope * steps[j]:.2g} "
                f"a first-order error seen at h = {steps[b]:.2g} leaves"
            )
    for i in range(a, len(steps) - 1):
        if even[i] > floor and even[i + 1] > floor:
            order = float(np.log(even[i] / even[i + 1]) / np.log(steps[i] / steps[i + 1]))
            if order < 1.5:
                return (
                    f"f(x+hv) + f(x-hv) - 2f(x) shrinks as h^{order:.2g}, not h^2, from h = {steps[i]:.2g} "
                    f"to {steps[i + 1]:.2g}"
                )
    # (above the deciding pair one such pair may be a kink far from x, f smooth near it; two are
    # kinks at every scale the steps reach, a ReLU network's, whose first-order look is no error)
    slow = [
        i
        for i in range(len(steps) - 1)
        if even[i] > floor
        and even[i + 1] > floor
        and np.log(even[i] / even[i + 1]) / np.log(steps[i] / steps[i + 1]) < 1.5
    ]
    if anywhere and len(slow) >= 2:
        return (
            f"f(x+hv) + f(x-hv) - 2f(x) shrinks slower than h^1.5 over {len(slow)} pairs of steps from "
            f"h = {steps[slow[0]]:.2g} down"
        )
    return None


def _last_order(steps: list[float], remainders: list[float], floor: float) -> float | None:
    """The convergence order over the smallest two steps whose remainders are above the floor."""
    above = [i for i, r in enumerate(remainders) if r > floor]
    pairs = [(a, b) for a, b in itertools.pairwise(above) if b == a + 1]
    if not pairs:
        return None
    a, b = pairs[-1]
    return float(np.log(remainders[a] / remainders[b]) / np.log(steps[a] / steps[b]))


def _same_within(a: Any, b: Any, rel: float) -> bool:
    """Two auxes agree: the same structure, equal non-numbers, numbers within ``rel`` of their scale."""
    try:
        la, lb = _tree.leaves(a), _tree.leaves(b)
    except Exception:
        return True
    if len(la) != len(lb):
        return False
    for u, v in zip(la, lb, strict=True):
        if _arrays.kind(u) in ("numpy", "torch", "jax", "mlx", "python") and not isinstance(u, str):
            try:
                p, q = np.asarray(_arrays.to_numpy(u)), np.asarray(_arrays.to_numpy(v))
            except Exception:
                continue
            if p.shape != q.shape:
                return False
            if p.dtype.kind in "fc":
                scale = float(np.max(np.abs(p[np.isfinite(p)]), initial=0.0))
                with np.errstate(invalid="ignore"):
                    if not np.all((np.abs(p - q) <= rel * scale) | (np.isnan(p) & np.isnan(q)) | (p == q)):
                        return False
            elif not np.array_equal(p, q):
                return False
    return True


def _describe(out: Any) -> str:
    leaves = _tree.leaves(out) if not isinstance(out, (int, float)) else [out]
    if len(leaves) == 1:
        return f"{type(out).__name__} of shape {_arrays.shape(leaves[0])}"
    return f"a {type(out).__name__} of {len(leaves)} leaves"


def _check_against_engines_reference(
    f: Callable[..., Any],
    x: Any,
    contexts: tuple[Any, ...],
    chosen: list[Backend],
    reference: Backend | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    projections: int | None = None,
    seed: int = 0,
    has_aux: bool = False,
    complex_x: bool = False,
    automatic: bool = False,
) -> Report:
    """The seed's checker, kept where it serves: a given ``reference`` backend, complex x (its
    truth along the real and imaginary axes, and the adjoint identity along complex directions,
    diffiface.test._complex_checks), DTensors, and jax arrays placed on devices of their own
    (random directions drawn and judged there)."""
    report = Report()
    counted = _Counted(f)
    f = counted
    operator = "value_and_gradient" if has_aux else "gradient"
    scenario = Scenario("f", f, x, operator, tuple(contexts), reference=None, has_aux=has_aux)
    outside = Row("(reference)", "f", "gradient", "passed")
    wide = any(_arrays.dtype_name(leaf) == "float64" for leaf in _tree.leaves(x))
    sharded = _sharded(x)  # DTensors: checked along random directions, collectively, nothing gathered
    with _warnings_apart(outside), _float64_scope() if wide else contextlib.nullcontext():
        if sharded:
            problem = _sharded_determinism_problem(scenario)
            value = f(x, *scenario.context_values)
        else:
            first, second = _twice_on_copies(f, x, tuple(contexts))
            problem = _differs(first, second, has_aux)
            value = first
        if problem:
            outside.status, outside.message = "failed", problem
            report.rows.append(outside)
            raise GradientCheckError(problem, report)
        value = value[0] if has_aux else value
    size = sum(int(np.prod(_arrays.shape(leaf))) for leaf in _tree.leaves(x))
    noise = _difference_noise(_sharded_scalar(value) if sharded else value, size)
    k = projections if projections is not None else (8 if size > _PROJECTION_THRESHOLD or sharded else 0)
    k = 0 if complex_x else k  # (complex x: its directions are the adjoint check's)
    rng = np.random.default_rng(seed)
    placed = bool(k) and not sharded and _on_device.applies(x)  # jax arrays on devices of their own: kept there
    directions: list[Any]
    if sharded:
        directions = [_sharded_direction(x, seed, i) for i in range(k)]
    elif placed:
        directions = list(_on_device.random_directions(x, k, seed))
    else:
        directions = [_random_direction(x, rng) for _ in range(k)]
    projected: dict[str, np.ndarray] = {}
    estimate: float | None = None
    with _warnings_apart(outside):
        if k and sharded:
            truth = _sharded_projected_truth(f, x, contexts, directions, has_aux)
            truth_label = "central differences along random directions (float64, collective)"
        elif k:
            truth = (
                np.array(_on_device.projected_truth(f, x, tuple(contexts), directions, has_aux), dtype=np.float64)
                if placed
                else _projected_truth(f, x, contexts, directions, has_aux)
            )
            truth_label = "central differences along random directions (float64)"
        else:
            reference_backend = normalize(reference) if reference is not None else AutoFiniteDifferences()
            if isinstance(reference_backend, AutoFiniteDifferences) and reference_backend in chosen:
                # no backend checks itself: scipy's adaptive differences judge finite differences
                reference_backend = AutoScipy() if available(AutoScipy()) else reference_backend
            truth_scenario = dataclasses.replace(scenario, reference=reference_backend)
            wide = _promotes(truth_scenario) and not _changes_in_float64(truth_scenario, value)
            truth_scenario = dataclasses.replace(truth_scenario, tags=frozenset(() if wide else {"no_promote"}))
            truth, estimate = _reference_with_estimate(truth_scenario, reference_backend)
            truth_label = _reference_label(reference_backend, wide)
    gradients: dict[str, Any] = {}
    against_truth: dict[str, float] = {}
    for backend in chosen:
        label = backend_label(backend)
        row = Row(label, "f", "gradient", "passed", reference=truth_label, warnings=outside.warnings)
        report.rows.append(row)
        if not available(backend):
            row.status, row.message = "skipped", f"not installed: {install_hint(backend)}"
            continue
        constants = [c for c in contexts if isinstance(c, di.Constant)]
        taken = snapshot(_local_views((x, [c.value for c in constants])) if sharded else (x, constants))
        returned = counted.returned
        start = time.perf_counter()
        with _warnings_apart(row):
            try:
                if has_aux:
                    (_, _aux), gradient = di.value_and_gradient(f, backend, x, *contexts, has_aux=True)
                else:
                    gradient = di.gradient(f, backend, x, *contexts)
                row.seconds = time.perf_counter() - start
                changed = changes(taken)
                if changed:
                    raise AssertionError(f"the call mutated {', '.join(changed[:4])}")
                gradients[label] = gradient
                if k:
                    dot: Callable[[Any, Any], float] = _sharded_dot if sharded else _on_device.dot if placed else _dot
                    got = projected[label] = np.array([dot(gradient, u) for u in directions])
                    _close_projections(got, truth, rtol, atol, noise, row)
                else:
                    tolerance = _with_noise(atol, x, noise if _is_difference(truth_label) else 0.0)
                    row.abs_error, row.rel_error = max_errors(gradient, _like(truth, gradient))
                    try:
                        assert_allclose(gradient, _like(truth, gradient), rtol, tolerance)
                    except AssertionError:
                        against_truth[label] = row.abs_error
                        raise
            except Exception as exc:
                row.status, row.message = _outcome(exc)
                if row.status == "failed" and automatic and label not in gradients:
                    row.status, row.message = _not_for_this_engine(exc, row.message, counted, returned)
                if k and row.status == "failed" and label in gradients:
                    against_truth[label] = row.abs_error
    if complex_x:
        _complex_checks.check_adjoint(report, f, x, contexts, gradients, has_aux, seed, rtol)
    if not gradients and not report.failed:
        raise _no_gradient(report, automatic)
    labels = list(gradients)
    disagreements: set[str] = set()
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            row = Row(f"{a} vs {b}", "f", "gradient", "passed", reference=b)
            report.rows.append(row)
            try:
                if sharded:  # their projections: nothing but scalars leaves a rank
                    _close_projections(projected[a], projected[b], rtol, atol, 0.0, row)
                else:
                    assert_allclose(gradients[a], _like(gradients[b], gradients[a]), rtol, atol, check_dtype=False)
            except AssertionError as exc:
                row.status, row.message = "failed", str(exc)
                disagreements.update((a, b))
    _hint_truth_at_fault(report, against_truth, disagreements, noise, estimate)
    if report.failed:
        raise GradientCheckError(report.summary(), report)
    return report


def _reference_with_estimate(scenario: Scenario, backend: Backend) -> tuple[Any, float | None]:
    """The ground truth (value dropped when f has an aux), and scipy's own error estimate when
    scipy computes it."""
    if not isinstance(backend, AutoScipy):
        result = _computed_reference(scenario, backend, _promotes(scenario))
        return (result[1] if scenario.has_aux else result), None
    head = (promote(scenario.x),) if _promotes(scenario) else (scenario.x,)
    contexts = promote_contexts(scenario.contexts) if _promotes(scenario) else scenario.contexts
    kwargs = {"has_aux": True} if scenario.has_aux else {}
    prep = getattr(di, f"prepare_{scenario.operator}")(scenario.f, backend, *head, *contexts, **kwargs)
    result = getattr(di, scenario.operator)(scenario.f, backend, *head, *contexts, prep=prep, **kwargs)
    error = prep.error
    gradient_error = error[1] if scenario.has_aux and isinstance(error, tuple) else error
    leaves = [np.asarray(_arrays.to_numpy(e), dtype=np.float64) for e in _tree.leaves(gradient_error)]
    estimate = max((float(np.max(e)) for e in leaves if e.size), default=None)
    return (result[1] if scenario.has_aux else result), estimate


def _difference_noise(value: Any, size: int, eps: Any = None) -> Any:
    """The rounding noise of a central difference of ``f`` in float64 (or at ``eps``, per entry):
    each evaluation of f errs by about ``eps * |f| * sqrt(n)`` (n, the number of inputs, stands
    for the number of terms a loss sums), divided by a step of ``eps**(1/3)`` at least."""
    values = [np.asarray(_arrays.to_numpy(v), dtype=np.float64) for v in _tree.leaves(value)]
    magnitude = max((float(np.max(np.abs(v))) for v in values if v.size), default=0.0)
    if not np.isfinite(magnitude):
        return 0.0
    if eps is None:
        eps = float(np.finfo(np.float64).eps)
        return float(eps ** (2 / 3) * magnitude * np.sqrt(max(size, 1)))
    return np.asarray(eps, dtype=np.float64) ** (2 / 3) * magnitude * np.sqrt(max(size, 1))


def _with_noise(atol: float | None, x: Any, noise: float) -> float | None:
    """A given ``atol`` as it is; by default, the widest dtype default of x plus the noise."""
    if atol is not None or not noise:
        return atol
    return max((default_tolerances(_arrays.dtype_name(leaf))[1] for leaf in _tree.leaves(x)), default=0.0) + noise


def _hint_truth_at_fault(
    report: Report, against_truth: dict[str, float], disagreements: set[str], noise: float, estimate: float | None
) -> None:
    """Say when finite differences may be the side at fault: the engines that failed against
    them agree with each other, or the error is within the differences' own error."""
    failed = [row for row in report.rows if row.backend in against_truth and row.status == "failed"]
    if not failed:
        return
    own = f"scipy's error estimate is {estimate:.3g}" if estimate is not None else f"their noise is about {noise:.3g}"
    agreeing = len(failed) >= 2 and not (disagreements & set(against_truth))
    for row in failed:
        if agreeing:
            names = ", ".join(r.backend for r in failed)
            row.message += (
                f" [the automatic engines {names} agree with each other but not with {row.reference}: "
                f"finite differences may be the side at fault ({own}; a large or ill-conditioned f, a kink near x)]"
            )
        elif against_truth[row.backend] <= 10 * max(noise, estimate or 0.0):
            row.message += (
                f" [the error is within ten times the finite differences' own error ({own}): "
                "they may be the side at fault]"
            )


def _available_backends(x: Any) -> list[Backend]:
    kinds = {_arrays.kind(leaf) for leaf in _tree.leaves(x)}
    family = _arrays.family(kinds)
    by_family: dict[str, list[Backend]] = {"torch": [AutoTorch(), AutoTorch(mode="func")], "jax": [AutoJAX()]}
    own = [row.config() for row in BACKENDS if row.arrays == family and family not in ("numpy", "python")]
    # (an engine whose arrays are its own, TensorFlow's, is the one that can run f on them)
    candidates = by_family.get(
        family,
        own or [AutoJAX(), AutoTorch(), AutoTorch(mode="func"), di.AutoAutograd(), di.AutoPyTensor(), di.AutoMLX()],
    )
    # engines of other packages, whose registry rows say which arrays they take (Python numbers: numpy's)
    arrays = "numpy" if family == "python" else family
    candidates += [row.config() for row in rows()[len(BACKENDS) :] if row.arrays == arrays]
    return [b for b in candidates if available(b)]


def _random_direction(x: Any, rng: np.random.Generator) -> list[np.ndarray]:
    leaves = _tree.leaves(x)
    parts = [rng.standard_normal(_arrays.shape(leaf)) for leaf in leaves]
    norm = np.sqrt(sum(float(np.sum(p * p)) for p in parts)) or 1.0
    return [p / norm for p in parts]


def _dot(gradient: Any, direction: list[np.ndarray]) -> float:
    leaves = _tree.leaves(gradient)
    return float(
        sum(
            np.sum(np.asarray(_arrays.to_numpy(g), dtype=np.float64) * u)
            for g, u in zip(leaves, direction, strict=True)
        )
    )


def _projected_truth(
    f: Callable[..., Any],
    x: Any,
    contexts: tuple[Any, ...],
    directions: list[list[np.ndarray]],
    has_aux: bool = False,
) -> np.ndarray:
    """``u . grad f`` by Richardson-extrapolated central differences of ``t -> f(x + t u)``,
    in float64: x and the Constant contexts cast (their structure and array types kept), and
    f evaluated under the scope the engines use for float64 (jax's x64, scoped)."""
    leaves, spec = _tree.flatten(promote(x))
    values = tuple(c.value for c in promote_contexts(tuple(contexts)))
    scale = max(
        [1.0] + [float(np.max(np.abs(_arrays.to_numpy(leaf)))) for leaf in leaves if np.size(_arrays.to_numpy(leaf))]
    )
    h = float(np.finfo(np.float64).eps ** (1 / 5)) * scale

    def along(direction: list[np.ndarray], t: float) -> float:
        moved = [
            _arrays.from_numpy(np.asarray(_arrays.to_numpy(leaf), dtype=np.float64) + t * u, leaf)
            for leaf, u in zip(leaves, direction, strict=True)
        ]
        out = f(optree.tree_unflatten(spec, moved), *values)
        return float(np.asarray(_arrays.to_numpy(out[0] if has_aux else out), dtype=np.float64))

    def central(u: list[np.ndarray], step: float) -> float:
        return (along(u, step) - along(u, -step)) / (2 * step)

    with _no_grad(), _float64_copies_scope():
        # Richardson: the O(h^2) terms of two central differences cancel
        return np.array([(4 * central(u, h / 2) - central(u, h)) / 3 for u in directions])


def _close_projections(
    got: np.ndarray, truth: Any, rtol: float | None, atol: float | None, noise: float, row: Row
) -> None:
    rtol = 1e-4 if rtol is None else rtol
    atol = 1e-6 + noise if atol is None else atol
    scale = max(1.0, float(np.max(np.abs(truth))))
    err = np.abs(got - truth)
    row.abs_error = float(np.max(err)) if err.size else 0.0
    row.rel_error = row.abs_error / scale
    if np.any(err > atol + rtol * scale):
        i = int(np.argmax(err))
        raise AssertionError(
            f"projection {i}: u . grad f = {got[i]:.8g}, finite differences give {truth[i]:.8g} "
            f"(abs error {err[i]:.3g}, rtol {rtol:g}, atol {atol:g})"
        )


# -- DTensors (torch.distributed.tensor): every rank runs check_gradients; scalars are all it shares --


def _dtensor_class() -> Any:
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _sharded(x: Any) -> bool:
    """Whether a leaf of ``x`` is a DTensor."""
    kind = _dtensor_class()
    return kind is not None and any(isinstance(leaf, kind) for leaf in _tree.leaves(x))


def _sharded_scalar(value: Any) -> float:
    """A scalar as a float, the same on every rank: a DTensor's (partial or replicated) by one
    scalar all-reduce."""
    if isinstance(value, _dtensor_class()):
        if value.numel() != 1:
            raise AssertionError(f"f must return a scalar; it returned a DTensor of shape {tuple(value.shape)}")
        replicate = sys.modules["torch.distributed.tensor"].Replicate()
        value = value.redistribute(value.device_mesh, [replicate] * value.device_mesh.ndim).to_local()
    return float(np.asarray(_arrays.to_numpy(value), dtype=np.float64))


def _local_views(tree: Any) -> Any:
    """DTensor leaves as this rank's slices (views: a write into x shows), for the snapshot."""
    kind = _dtensor_class()
    return _tree.map(lambda leaf: leaf.to_local() if isinstance(leaf, kind) else leaf, tree)


def _sharded_determinism_problem(scenario: Scenario) -> str | None:
    first, second = _sharded_scalar(_value(scenario)), _sharded_scalar(_value(scenario))
    if first == second or (np.isnan(first) and np.isnan(second)):
        return None
    return (
        "f is not deterministic: two calls with the same input gave different values, so it probably draws "
        "from a global random generator. Pass a seeded generator as a di.Constant and draw from it explicitly."
    )


def _sharded_direction(x: Any, seed: int, index: int) -> list[Any]:
    """A random unit direction with x's structure: float64 DTensors on each leaf's mesh with its
    placements (partial ones drawn replicated), plain tensors for plain leaves. Each rank draws
    only its own slice, from a generator seeded by ``seed``, the direction's index, the leaf and
    the rank's coordinates along the sharded mesh dimensions: ranks holding the same slice draw
    the same numbers, on every run."""
    torch = sys.modules["torch"]
    tensor_module = sys.modules["torch.distributed.tensor"]
    kind = _dtensor_class()
    parts = []
    for i, leaf in enumerate(_tree.leaves(x)):
        if not isinstance(leaf, kind):
            key = [seed, index, i]
            generator = torch.Generator().manual_seed(int(np.random.SeedSequence(key).generate_state(1)[0]))
            parts.append(torch.randn(tuple(leaf.shape), generator=generator, dtype=torch.float64).to(leaf.device))
            continue
        mesh, placements = leaf.device_mesh, leaf.placements
        coordinate = mesh.get_coordinate() or []
        sharded = [c for c, p in zip(coordinate, placements, strict=True) if p.is_shard()]
        key = [seed, index, i, *sharded]
        generator = torch.Generator().manual_seed(int(np.random.SeedSequence(key).generate_state(1)[0]))
        local = torch.randn(tuple(leaf.to_local().shape), generator=generator, dtype=torch.float64)
        placed = [tensor_module.Replicate() if p.is_partial() else p for p in placements]
        parts.append(
            kind.from_local(
                local.to(leaf.device), mesh, placed, run_check=False, shape=leaf.shape, stride=leaf.stride()
            )
        )
    norm = float(np.sqrt(sum(_sharded_scalar((p * p).sum()) for p in parts))) or 1.0
    return [p / norm for p in parts]


def _sharded_dot(gradient: Any, direction: list[Any]) -> float:
    """``u . grad`` in float64, per leaf a local product and one scalar all-reduce."""
    leaves = _tree.leaves(gradient)
    return sum(
        (_sharded_scalar((g.double() * u).sum()) for g, u in zip(leaves, direction, strict=True)),
        0.0,
    )


def _sharded_projected_truth(
    f: Callable[..., Any],
    x: Any,
    contexts: tuple[Any, ...],
    directions: list[list[Any]],
    has_aux: bool = False,
) -> np.ndarray:
    """:func:`_projected_truth` on DTensors: the points ``x + t u`` are DTensor arithmetic, on
    each rank's slices; f's values and the largest ``|x_i|`` are the only numbers shared."""
    from .._adapters._black_box import _largest

    leaves, spec = _tree.flatten(promote(x))
    values = tuple(c.value for c in promote_contexts(tuple(contexts)))
    scale = max([1.0, *(_largest(leaf) for leaf in leaves)])
    h = float(np.finfo(np.float64).eps ** (1 / 5)) * scale

    def along(direction: list[Any], t: float) -> float:
        moved = [leaf.double() + t * u for leaf, u in zip(leaves, direction, strict=True)]
        out = f(optree.tree_unflatten(spec, moved), *values)
        return _sharded_scalar(out[0] if has_aux else out)

    def central(u: list[Any], step: float) -> float:
        return (along(u, step) - along(u, -step)) / (2 * step)

    with _no_grad():
        return np.array([(4 * central(u, h / 2) - central(u, h)) / 3 for u in directions])
