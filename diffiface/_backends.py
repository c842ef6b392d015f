"""Backend configuration objects: small, frozen, hashable, and free of imports.

A backend says *which* engine differentiates and with which options; the engine's code
lives in ``diffiface._adapters`` and is imported on first use.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ._errors import InvalidBackendOptionError, UnsupportedOperationError


@dataclass(frozen=True)
class Backend:
    """Base class of every backend configuration."""

    name: ClassVar[str] = ""

    @property
    def black_box(self) -> bool:
        """True when the engine only evaluates ``f`` (finite differences), so it can
        differentiate a function written for any framework."""
        return False

    def _complex_points_problem(self) -> str | None:
        """Why this engine, as the inner of a complex-step outer, cannot carry the complex points
        through its gradient; None where it can (:func:`pairing_refusal`)."""
        return f"{self.name} is not known to carry complex points through its gradient"

    def _nesting_problem(self, inner: Backend) -> str | None:
        """Why this engine, as an AD outer, cannot trace ``inner``, the same engine with other
        options; None where it can (:func:`pairing_refusal`)."""
        return None


@dataclass(frozen=True)
class AutoJAX(Backend):
    """Differentiate with jax (``jax.grad``, ``jax.jvp``, ``jax.vjp``, ``jax.hessian``...).

    Parameters
    ----------
    jit:
        Compile each prepared operator with ``jax.jit``. Context arrays and floats are arguments
        of the compiled function, so new values never recompile; ints, strings and other
        hashable values are static, compared by value; an object that can only be compared by
        identity is refused (a change to it would go unseen), unless ``jit=False``.
    """

    name: ClassVar[str] = "jax"
    jit: bool = True

    def __post_init__(self) -> None:
        _check_bool(self, "jit", self.jit)

    def _complex_points_problem(self) -> str:
        return "jax's gradient takes real-valued functions only"


_PYTENSOR_MODES = ("FAST_RUN", "FAST_COMPILE", "NUMBA", "CVM")


@dataclass(frozen=True)
class AutoPyTensor(Backend):
    """Differentiate with PyTensor (PyMC's engine): ``pytensor.gradient`` on a symbolic graph,
    compiled by ``pytensor.function``.

    ``f`` is written with ``pytensor.tensor`` operations, as a PyMC log-density is. At
    preparation diffiface calls ``f`` once on symbolic variables of x's shapes and dtypes (and
    of the contexts' arrays and floats), differentiates the graph and compiles it; later calls
    run the compiled function on numpy arrays. ``f`` must not branch in Python on the values of
    its inputs (they are symbolic): use ``pytensor.tensor.switch`` or ``pytensor.ifelse``.
    Complex numbers are refused.

    Parameters
    ----------
    mode:
        The ``pytensor.function`` mode of each operator: ``"FAST_RUN"`` (the default: every
        graph rewrite and PyTensor's default linker; the quickest calls, the longest first
        compile), ``"FAST_COMPILE"`` (few rewrites: compiles several times quicker, calls
        several times slower), ``"NUMBA"`` (numba's JIT) or ``"CVM"`` (C code, cached on disk;
        slow matrix products where PyTensor finds no BLAS).
    """

    name: ClassVar[str] = "pytensor"
    mode: str = "FAST_RUN"

    def __post_init__(self) -> None:
        _check_choice(self, "mode", self.mode, _PYTENSOR_MODES, "a compile mode diffiface takes")


@dataclass(frozen=True)
class AutoTorch(Backend):
    """Differentiate with PyTorch.

    Parameters
    ----------
    mode:
        ``"autograd"`` uses ``torch.autograd.grad`` (and ``torch.autograd.forward_ad`` for
        forward mode); ``"func"`` uses ``torch.func`` transforms. The two take different code
        paths, so each can check the other.
    create_graph:
        Autograd mode only. As ``torch.autograd.grad(..., create_graph=True)``: where x's leaves
        require grad (an ``nn.Parameter``), the results carry the graph back to them, so that a
        loss built on a derivative (a gradient penalty) can be differentiated again. By default
        the results are detached, as ``torch.autograd.grad``'s are; a diffiface call inside a
        function that diffiface differentiates keeps its graph either way. ``mode="func"``
        results carry the graph of inputs that require grad, as ``torch.func``'s do.
    jvp:
        How autograd mode computes a jvp (``jvp``, ``value_and_jvp``, ``derivative``):
        ``"forward"`` (the default) by ``torch.autograd.forward_ad``; ``"reverse"`` by two
        backward passes (as ``torch.autograd.functional.jvp``), quicker on small functions
        where forward mode pays a per-operation cost; ``"auto"`` times the two on a prep's first
        call (which runs f several times) and keeps the quicker for that prep. Forward mode is
        kept where the two products differ (part of f under ``torch.no_grad()``), where f cannot
        be differentiated twice, for complex jvps, and on calls "auto" does not time (a module
        as a Constant, an aux, an x that carries an outer graph). Since the first call chooses,
        keep ``"forward"`` for an f that enters a ``torch.no_grad()`` part only at other x's:
        reverse mode would treat that part as constant.
    compile:
        ``mode="func"`` only. Each operator's torch.func program compiled by ``torch.compile``
        (Inductor, one graph, static shapes); a prep's first call compiles (seconds to a
        minute), later calls of its shapes compile nothing. f must be traceable without graph
        breaks; results are detached. See docs/engines/torch-compile.md.
    """

    name: ClassVar[str] = "torch"
    mode: Literal["autograd", "func"] = "autograd"
    create_graph: bool = False
    jvp: Literal["forward", "reverse", "auto"] = "forward"
    compile: bool = False

    def __post_init__(self) -> None:
        if self.mode not in _TORCH_MODES:
            raise InvalidBackendOptionError(
                f"AutoTorch(mode={self.mode!r}) is not a torch mode; use mode='autograd' "
                "(torch.autograd.grad) or mode='func' (torch.func transforms)."
            )
        _check_bool(self, "create_graph", self.create_graph)
        if self.create_graph and self.mode == "func":
            raise InvalidBackendOptionError(
                "AutoTorch(mode='func', create_graph=True): torch.func's results already carry the graph "
                "of inputs that require grad; create_graph is an option of mode='autograd'."
            )
        _check_choice(self, "jvp", self.jvp, ("forward", "reverse", "auto"), "a way to compute a jvp")
        if self.jvp != "forward" and self.mode == "func":
            raise InvalidBackendOptionError(
                f"AutoTorch(mode='func', jvp={self.jvp!r}): torch.func computes a jvp by torch.func.jvp; "
                "the jvp option is one of mode='autograd'."
            )
        _check_bool(self, "compile", self.compile)
        if self.compile and self.mode != "func":
            raise InvalidBackendOptionError(
                "AutoTorch(compile=True) compiles torch.func programs; use AutoTorch(mode='func', compile=True) "
                "(autograd mode's double backward cannot go through a compiled graph)."
            )

    def _complex_points_problem(self) -> str:
        return (
            "torch differentiates complex functions by conjugate Wirtinger calculus, so the complex "
            "step would read a conjugated gradient"
        )

    def _nesting_problem(self, inner: Backend) -> str | None:
        if isinstance(inner, AutoTorch) and self.mode != inner.mode:
            i = _short(inner)
            return (
                "torch's autograd and func modes do not nest in each other; use the same mode twice: "
                f"SecondOrder({i}, {i})."
            )
        return None


_TORCH_MODES: tuple[str, ...] = typing.get_args(typing.get_type_hints(AutoTorch)["mode"])


@dataclass(frozen=True)
class AutoAutograd(Backend):
    """Differentiate with the ``autograd`` package (reverse mode on numpy)."""

    name: ClassVar[str] = "autograd"

    def _complex_points_problem(self) -> None:
        return None  # (its gradient carries complex points through)


@dataclass(frozen=True)
class AutoMLX(Backend):
    """Differentiate with mlx (``mx.value_and_grad``, ``mx.vjp``, ``mx.jvp``, ``mx.vmap``).

    f is called with ``mlx.core`` arrays; x may be mlx arrays, numpy arrays or Python floats,
    in any pytree (``model.trainable_parameters()``), and results mirror it. float64 is
    computed on the CPU (mlx has float64 there only), where mlx's sin, cos, exp... are accurate
    to float32's precision only. complex128 is refused (mlx has none).

    Parameters
    ----------
    compile:
        Compile each prepared operator with ``mx.compile``. As ``jit`` of :class:`AutoJAX`,
        context arrays are arguments (new values never recompile) and other hashable values
        compile-time constants, compared by value: pass a number that changes on every call as
        an array. Arrays that f reads from its closure are baked into the program; pass them as
        a :class:`~diffiface.Constant`. ``compile=False`` runs eagerly, with no compile cost.
    """

    name: ClassVar[str] = "mlx"
    compile: bool = True

    def __post_init__(self) -> None:
        _check_bool(self, "compile", self.compile)


_FD_METHODS = ("central", "forward", "backward", "complex")


@dataclass(frozen=True)
class AutoFiniteDifferences(Backend):
    """Finite differences, on the input's own array type (numpy, torch, jax...).

    Parameters
    ----------
    method:
        ``"central"`` (2 evaluations per input coordinate, error O(h²)), ``"forward"`` or
        ``"backward"`` (1 per coordinate plus one at ``x``, error O(h)), or ``"complex"``
        (complex step: ``Im f(x + ih) / h``, exact to rounding for ``f`` analytic and real on
        real inputs).
    step:
        The absolute step used for every coordinate. By default each coordinate gets its own,
        ``eps**p * max(1, |x_i|)`` with ``eps`` the machine epsilon of the input's dtype and
        ``p`` the power that balances truncation against rounding (1/3 central, 1/2 forward
        and backward, 1/4 for second derivatives); a jvp or hvp takes one step along the
        tangent, the largest that moves no input further than its own. A fixed step that
        rounds to nothing (``x_i + step == x_i`` in x's dtype) is refused when called.
    vectorize:
        Evaluate all perturbations in one call of ``f`` on a batch (a leading axis on every
        leaf of ``x``). Only for functions that broadcast over such an axis.
    max_inputs:
        The most inputs (entries of ``x``) the backend differences. None: 100,000 for
        first-order operators, 1,000 for Hessians, 4,000 with ``vectorize`` (and Jacobians of
        at most 25 million entries); above, a call raises :class:`~diffiface.InputTooLargeError`
        before allocating anything. Set it to run a larger case deliberately.
    """

    name: ClassVar[str] = "finite_differences"
    black_box: ClassVar[bool] = True
    method: Literal["central", "forward", "backward", "complex"] = "central"
    step: float | None = None
    vectorize: bool = False
    max_inputs: int | None = None

    def __post_init__(self) -> None:
        _check_choice(self, "method", self.method, _FD_METHODS, "a method")
        if self.step is not None:
            if isinstance(self.step, bool) or not isinstance(self.step, (int, float)):
                raise InvalidBackendOptionError(
                    f"AutoFiniteDifferences(step={self.step!r}): the step must be a positive "
                    "float, or None to choose it from the dtype and |x|."
                )
            if not (math.isfinite(self.step) and self.step > 0):
                raise InvalidBackendOptionError(
                    f"AutoFiniteDifferences(step={self.step!r}): the step must be positive and finite."
                )
        _check_bool(self, "vectorize", self.vectorize)
        if self.max_inputs is not None:
            _check_int(self, "max_inputs", self.max_inputs, "an integer >= 1, or None", lambda v: v >= 1)

    def _complex_points_problem(self) -> str | None:
        if self.method == "complex":
            return None  # (the complex step itself)
        return "real finite differences evaluate f at real points: the imaginary step is lost"


@dataclass(frozen=True)
class AutoScipy(Backend):
    """Adaptive finite differences of ``scipy.differentiate`` (``jacobian`` and ``hessian``).

    Each call refines the step until the error estimate meets the tolerances; read the
    estimate of the last call made with a prep through ``prep.error``. An estimate scipy
    reports as failed (its ``status`` not 0, with an error above the square root of the
    dtype's epsilon, its fourth root for second derivatives, relative to the result or to f's
    own scale) or that is not finite where x and f(x) are, and a step along a tangent lost to
    rounding (``x_i + step == x_i``), raise
    :class:`~diffiface.InvalidBackendOptionError` naming the entry of x and scipy's status.

    Parameters
    ----------
    order:
        Order of the finite-difference formula (even, at least 2).
    initial_step, step_factor, maxiter:
        As in ``scipy.differentiate.jacobian``: the first step (positive, finite), the factor
        by which each iteration shrinks it (finite, above 1) and the most iterations (>= 1).
    atol, rtol:
        Absolute and relative tolerances of the error estimate (finite, >= 0; scipy's
        defaults when None).
    max_inputs:
        The most inputs (entries of ``x``) the backend differentiates. None: 1,000 for
        first-order operators, 100 for second-order ones (scipy builds arrays of n² points per
        iteration, n³ for a Hessian); above, a call raises
        :class:`~diffiface.InputTooLargeError` before allocating anything.
    """

    name: ClassVar[str] = "scipy"
    black_box: ClassVar[bool] = True
    order: int = 8
    initial_step: float = 0.5
    step_factor: float = 2.0
    maxiter: int = 10
    atol: float | None = None
    rtol: float | None = None
    max_inputs: int | None = None

    def __post_init__(self) -> None:
        _check_int(self, "order", self.order, "an even integer >= 2 (2, 4, 6, 8...)", lambda v: v >= 2 and v % 2 == 0)
        _check_int(self, "maxiter", self.maxiter, "an integer >= 1", lambda v: v >= 1)
        _check_real(self, "initial_step", self.initial_step, "a finite number > 0", lambda v: v > 0)
        _check_real(self, "step_factor", self.step_factor, "a finite number > 1", lambda v: v > 1)
        for option in ("atol", "rtol"):
            value = getattr(self, option)
            if value is not None:
                _check_real(self, option, value, "a finite number >= 0, or None for scipy's default", lambda v: v >= 0)
        if self.max_inputs is not None:
            _check_int(self, "max_inputs", self.max_inputs, "an integer >= 1, or None", lambda v: v >= 1)

    def _complex_points_problem(self) -> str:
        return "scipy's differences evaluate f at real points: the imaginary step is lost"


@dataclass(frozen=True)
class AutoTensorFlow(Backend):
    """Differentiate with TensorFlow (``tf.GradientTape``).

    ``x`` may hold ``tf.Tensor`` and ``tf.Variable`` leaves (a Keras 3 model's
    ``trainable_variables``), numpy arrays and floats; ``f`` is called with ``tf.Tensor``
    leaves (the variables' values, read once: a variable is never written). A result for a
    variable is a ``tf.Tensor`` of its dtype; for a numpy array, a numpy array. Every
    derivative is a ``GradientTape``'s: a jvp is the pullback's adjoint (two tapes nested), so
    that a ``tf.custom_gradient``'s rule holds in every operator; second order nests them again.

    Parameters
    ----------
    jit:
        Run each prepared operator as one ``tf.function`` (a TensorFlow graph, without XLA:
        ``jit_compile`` is left off, and autograph is off, so ``f`` must branch on values with
        ``tf.cond`` or ``tf.where``). Context arrays are arguments of the graph (new values
        never retrace); a Python number stays one, as ``tf.function`` keeps it (traced once per
        value), and other context leaves are compared by value. ``f`` is then traced once per
        prep and set of such values, and cannot call ``.numpy()`` on what it is given.
    """

    name: ClassVar[str] = "tensorflow"
    jit: bool = False

    def __post_init__(self) -> None:
        _check_bool(self, "jit", self.jit)


@dataclass(frozen=True)
class SecondOrder(Backend):
    """Second-order operators from two backends: ``outer`` differentiates what ``inner`` gives.

    ``SecondOrder(AutoJAX(), AutoJAX())`` is forward-over-reverse in jax;
    ``SecondOrder(AutoFiniteDifferences(), AutoTorch())`` differences torch gradients.
    First-order operators use ``inner``. Which pairings work, and why the others are refused
    when the ``SecondOrder`` is made, is the table of :func:`pairing_refusal`.
    """

    name: ClassVar[str] = "second_order"
    outer: Backend
    inner: Backend

    def __post_init__(self) -> None:
        for role in ("outer", "inner"):
            value = getattr(self, role)
            if not isinstance(value, Backend) or isinstance(value, SecondOrder):
                raise InvalidBackendOptionError(
                    f"SecondOrder({role}={value!r}): {role} must be a first-order backend such "
                    "as AutoJAX() or AutoFiniteDifferences()."
                )
        reason = pairing_refusal(self.outer, self.inner)
        if reason is not None:
            raise UnsupportedOperationError(f"SecondOrder({_short(self.outer)}, {_short(self.inner)}): {reason}")

    @property
    def black_box(self) -> bool:
        return self.outer.black_box and self.inner.black_box


_SPARSE_COLORINGS = ("auto", "column", "row", "bidirectional")


@dataclass(frozen=True)
class AutoSparse(Backend):
    """Sparse Jacobians and Hessians from ``backend``: detect the pattern, color it, and
    compute one product per color instead of one per row or column.

    ``jacobian``, ``value_and_jacobian``, ``hessian`` and ``value_gradient_and_hessian`` (and
    their ``prepare_*``) give sparse matrices: ``scipy.sparse.csr_array`` for numpy inputs,
    ``jax.experimental.sparse.BCOO`` for jax, a torch sparse CSR tensor for torch; x and f(x)
    are flattened to one vector each in :func:`diffiface.tree.ravel` order. Every other
    operator is the wrapped backend's own. See docs/sparse.md.

    Parameters
    ----------
    backend:
        The engine of the products: a first-order backend (or its name), or a
        :class:`SecondOrder` for Hessians.
    detector:
        How the pattern is found: ``diffiface.sparse.GlobalDetector()`` (the default; traces
        ``f`` with jax, valid at every x), ``LocalDetector()`` (at points near x: may miss a
        nonzero that vanishes there) or ``KnownPattern(pattern)`` (yours).
    coloring:
        ``"column"`` (forward products, one jvp per color), ``"row"`` (reverse products, one
        vjp per color), ``"bidirectional"`` (reverse products for some rows, forward ones for
        the rest: an arrowhead takes 3; ``prep.coloring.sides`` tells the products per side)
        or ``"auto"``: the fewest products of the three; on a tie, rows where reverse products
        cost less (torch, autograd...), else columns; black-box engines always take columns.
        Hessians always take a star coloring (one hvp per color).
    order:
        The vertex order of the greedy coloring (``"natural"``, ``"largest_first"``...).
    dense:
        Return the dense array the dense operator returns instead, computed the sparse way.
    check:
        After each call, compare the result with one dense product along a random direction
        and raise :class:`~diffiface.DiffifaceError` where they differ (a pattern that misses
        a nonzero). Costs one more product per call.
    """

    name: ClassVar[str] = "sparse"
    operators: ClassVar[frozenset[str]] = frozenset(
        {"jacobian", "value_and_jacobian", "hessian", "value_gradient_and_hessian"}
    )
    """The operators it makes sparse; the others are its engine's."""
    backend: Backend
    detector: Any = None
    coloring: Literal["auto", "column", "row", "bidirectional"] = "auto"
    order: str = "natural"
    dense: bool = False
    check: bool = False

    def __post_init__(self) -> None:
        # (the public class, diffiface.AutoSparse in _sparse_operators, takes a backend's name and
        # checks the detector and the order first: both are known above this module)
        backend = self.backend
        if not isinstance(backend, Backend) or isinstance(backend, AutoSparse):
            raise InvalidBackendOptionError(
                f"AutoSparse(backend={backend!r}): the backend must be a backend object or name such as "
                "AutoJAX() or 'torch' (not another AutoSparse)."
            )
        _check_choice(self, "coloring", self.coloring, _SPARSE_COLORINGS, "a coloring")
        _check_bool(self, "dense", self.dense)
        _check_bool(self, "check", self.check)
        if self.coloring in ("row", "bidirectional") and backend.black_box:
            raise InvalidBackendOptionError(
                f"AutoSparse({_short(backend)}, coloring={self.coloring!r}): {backend.name} has no reverse mode, so each "
                "row would cost a full Jacobian; use coloring='column' (or 'auto')."
            )

    def __repr__(self) -> str:
        options = [_short(self.backend)]
        for field in dataclasses.fields(self)[1:]:
            value = getattr(self, field.name)
            if field.name == "detector" or value != field.default:
                options.append(f"{field.name}={value!r}")
        return f"AutoSparse({', '.join(options)})"

    @property
    def black_box(self) -> bool:
        return self.backend.black_box


def one_difference_engine(outer: Backend, inner: Backend) -> bool:
    """True when both are finite differences of one method and step: the pair is that engine's
    own second order (second differences, with steps chosen for them), whatever ``vectorize``."""
    return (
        isinstance(outer, AutoFiniteDifferences)
        and isinstance(inner, AutoFiniteDifferences)
        and (outer.method, outer.step) == (inner.method, inner.step)
    )


def _short(backend: Backend) -> str:
    """``backend`` as it would be written: only the options that differ from the defaults."""
    options = [
        f"{field.name}={getattr(backend, field.name)!r}"
        for field in dataclasses.fields(backend)
        if getattr(backend, field.name) != field.default
    ]
    return f"{type(backend).__name__}({', '.join(options)})"


def _difference_outer_for(inner: Backend) -> str:
    """A finite-difference pairing that works over ``inner``, as it would be written."""
    if isinstance(inner, AutoFiniteDifferences) and inner.method != "complex":
        return f"SecondOrder({_short(inner)}, {_short(inner)})"  # one engine's own second differences
    return f"SecondOrder(AutoFiniteDifferences(), {_short(inner)})"


def pairing_refusal(outer: Backend, inner: Backend) -> str | None:
    """Why ``SecondOrder(outer, inner)`` cannot give right second derivatives, with a pairing
    that can; None when it can. The one table of the pairings, written out in docs/backends.md:

    - an AD outer (jax, torch, autograd) traces the inner engine's work, so the inner must be
      the same engine (torch: in the same mode); a black-box inner leaves nothing to trace;
    - a finite-difference or scipy outer only evaluates the inner gradient: any inner works,
      except that a complex step needs an inner that carries complex points through (autograd,
      or the complex step itself), and that differencing real finite-difference gradients
      amplifies their rounding error (allowed only as one engine's own second differences,
      or over a complex-step inner, whose gradients are exact to rounding).

    Each config class says what its engine knows of itself (``_nesting_problem``,
    ``_complex_points_problem``)."""
    if outer == inner:
        return None
    o, i = _short(outer), _short(inner)
    if not outer.black_box:
        if inner.black_box:
            return (
                f"{outer.name} differentiates by tracing f's operations, but {inner.name} only "
                f"evaluates f on plain numbers, which leaves {outer.name} nothing to trace. Use "
                f"SecondOrder({o}, {o}), or a finite-difference outer: {_difference_outer_for(inner)}."
            )
        if type(outer) is not type(inner):
            return (
                f"{outer.name} cannot trace through {inner.name}: the two engines do not see each "
                f"other's arrays. Use the same engine twice, SecondOrder({i}, {i}), or a finite-difference "
                f"outer: SecondOrder(AutoFiniteDifferences(), {i})."
            )
        return outer._nesting_problem(inner)
    if one_difference_engine(outer, inner):
        return None
    if isinstance(outer, AutoFiniteDifferences) and outer.method == "complex":
        problem = inner._complex_points_problem()
        if problem is None:
            return None
        return (
            f"a complex-step outer evaluates the inner gradient at complex points, and {problem}. "
            f"Use a real method outside, {_difference_outer_for(inner)}, or "
            "SecondOrder(AutoFiniteDifferences(method='complex'), AutoAutograd()) for an autograd f."
        )
    if isinstance(inner, AutoFiniteDifferences) and inner.method != "complex":
        return (
            f"differencing {inner.method} finite-difference gradients amplifies their rounding error "
            "(their steps are chosen for first derivatives), which would leave few correct digits. "
            f"Use one finite-difference engine, AutoFiniteDifferences(method={inner.method!r}), whose "
            "second-order operators take second differences with steps chosen for them; or an inner "
            "that gives exact gradients: AD, or AutoFiniteDifferences(method='complex')."
        )
    return None


def _check_bool(backend: Backend, option: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidBackendOptionError(
            f"{type(backend).__name__}({option}={value!r}): {option} must be True or False."
        )


def _check_choice(backend: Backend, option: str, value: object, choices: tuple[str, ...], what: str) -> None:
    if not isinstance(value, str) or value not in choices:
        raise InvalidBackendOptionError(
            f"{type(backend).__name__}({option}={value!r}) is not {what}; choose one of {', '.join(map(repr, choices))}."
        )


def _check_int(backend: Backend, option: str, value: object, valid: str, fits: Callable[[int], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not fits(int(value)):
        raise InvalidBackendOptionError(f"{type(backend).__name__}({option}={value!r}): {option} must be {valid}.")


def _check_real(backend: Backend, option: str, value: object, valid: str, fits: Callable[[float], bool]) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or not fits(float(value))
    ):
        raise InvalidBackendOptionError(f"{type(backend).__name__}({option}={value!r}): {option} must be {valid}.")
