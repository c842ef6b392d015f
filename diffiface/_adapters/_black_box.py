"""What the black-box engines share (finite differences and scipy's adaptive differences):
``x`` as one float64 vector and back (:class:`_Point`), f's output as one vector
(:func:`_flatten_out`), the guard that hands f read-only or watched points and Constants
(:meth:`BlackBoxAdapter.run`), the limit on inputs, and the blocks of Jacobians and Hessians. Neither engine's
adapter imports the other's: both import this module."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _arrays
from .. import tree as _tree
from .._contexts import Constant, held
from .._errors import (
    InputTooLargeError,
    InvalidBackendOptionError,
    InvalidOutputError,
    MutationError,
    UnsupportedOperationError,
)
from .._families import mlx as _mlx
from .._families import tensorflow as _tensorflow
from .._families import torch as _torch
from . import _base
from ._base import Blocks, Leaves, ProgramParts, read_only


class BlackBoxAdapter(_base.Adapter):
    """What the black-box engines' adapters share: the contexts' arrays in x's family, the
    guard on each evaluation of f (:meth:`run`), and each call's Constant torch modules watched
    (:func:`watch_constant_modules`)."""

    weak_floats = True  # (f gets x's Python floats as they are)

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        """A numpy context leaf in x's framework, so that f sees one framework."""
        if isinstance(leaf, np.ndarray) and _arrays.kind(like) in ("torch", "jax"):
            return _arrays.from_numpy(leaf, like, dtype=_same_dtype(leaf, like)), True
        return leaf, _arrays.is_array(leaf)

    def constant_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        """A Constant's leaf for f: numpy read-only (or, for torch x, a watched torch copy), torch
        a watched copy; so f can write into none of the caller's arrays unnoticed."""
        if type(leaf) is np.ndarray:
            target = _arrays.kind(like)
            if target == "jax":
                return self.context_to_native(leaf, like)  # jax copies into an immutable array
            if target != "torch":
                _pending_watch().numpy_constants = True
                return read_only(leaf), True
            tensor = _arrays.from_numpy(np.array(leaf), like, dtype=_same_dtype(leaf, like))
        elif _arrays.kind(leaf) == "torch":
            tensor = leaf.detach().clone()
        elif _arrays.kind(leaf) == "tensorflow":
            # a variable (tf.Variable, a Keras variable): its value, a tensor that f cannot assign to
            # (the caller's variable would move under the points that follow)
            return sys.modules["tensorflow"].convert_to_tensor(leaf), True
        else:
            return self.context_to_native(leaf, like)
        _pending_watch().tensors.append((tensor, _version(tensor)))
        return tensor, True

    def explain_failure(self, exc: BaseException) -> str | None:
        if isinstance(exc, AttributeError) and "Tensor' object has no attribute 'assign" in str(exc):
            raise MutationError(
                f"f assigns into x or a di.Constant (variable.assign...). The {self.backend.name} backend hands "
                "f tf.Tensor values of the caller's variables, which it never writes: compute out of place, "
                "or pass scratch variables as di.Cache."
            ) from exc
        return None

    def run(self, fn: Any, leaves: Leaves, batched: bool = False, kept: bool = False) -> Any:
        """f at ``leaves``: ``fn(leaves)`` (or ``fn.batched``) under ``torch.no_grad()``,
        refusing writes into the leaves (handed read-only or watched) and the call's Constants.
        With ``kept``, the arrays of f's output and aux are copies: an f(x) returned to the
        caller must not be an array that f writes again at the points that follow (a di.Cache,
        a global buffer)."""
        watch = _watch_of(fn)
        torch = sys.modules.get("torch")
        tensors = [(t, _version(t)) for t in leaves if _arrays.kind(t) == "torch"] if torch is not None else []
        try:
            with torch.no_grad() if torch is not None else contextlib.nullcontext():  # (f is evaluated, never traced)
                out = fn.batched(leaves) if batched else fn(leaves)
                if kept:
                    out = _kept(out)
        except ValueError as exc:
            read_only_write = type(exc) is ValueError and str(exc).endswith("read-only")
            if read_only_write and (watch.numpy_constants or any(type(a) is np.ndarray for a in leaves)):
                what = "its input x or a di.Constant" if watch.numpy_constants else "its input x"
                raise MutationError(
                    f"f wrote into {what} (numpy: {exc!s}), which it must only read. The {self.backend.name} backend "
                    "evaluates f at points near x and hands them to f read-only, since a write would shift the "
                    "points that follow. Compute out of place (y = x * 2, not x *= 2), or pass scratch space "
                    "as di.Cache(array)."
                ) from exc
            raise
        for tensor, version in tensors:
            if version is not None and _version(tensor) != version:
                raise MutationError(_torch_write(self.backend.name, "its input x"))
        for tensor, version in watch.tensors:
            if _version(tensor) != version:
                raise MutationError(_torch_write(self.backend.name, "a di.Constant"))
        return out

    def compile(
        self,
        program: Callable[..., Any],
        static: bool = True,
        arrays: bool = False,
        layouts: Any = None,
        parts: ProgramParts | None = None,
    ) -> Callable[..., Any]:
        return watch_constant_modules(program, parts, self.info.name)


def _kept(result: Any) -> Any:
    """One evaluation of f, ``(out, aux)``, with its arrays of mutable kinds copied."""
    return _tree.map(_copy, result)


def _copy(leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray):
        return leaf.copy()
    family = _arrays.family_of(leaf)
    return leaf if family is None else family.private_copy(leaf)  # (immutable kinds: the leaf)


def check_size(backend: Any, xs: Leaves, operator: str, limit: int, what: str) -> None:
    """Refuse, before any allocation, an ``x`` with more inputs than ``limit`` (or the
    backend's ``max_inputs`` when set)."""
    n = sum(math.prod(_arrays.shape(x)) for x in xs)
    chosen = getattr(backend, "max_inputs", None)
    limit = limit if chosen is None else chosen
    if n > limit:
        raise InputTooLargeError(
            f"{operator} by {type(backend).__name__} of an x with {n:,} inputs: above the limit of "
            f"{limit:,} inputs ({what}). Use an automatic-differentiation backend (jax, torch, autograd), "
            "or check gradients along a few random directions with diffiface.test.check_gradients; for a "
            f"deliberate run, raise the limit with {type(backend).__name__}(max_inputs={n})."
        )


# -- what f must not write into -------------------------------------------------------------


class _Watch:
    """The arrays of one call that f must only read: torch Constant copies with their version
    counters, and whether numpy Constants were handed over read-only."""

    __slots__ = ("numpy_constants", "tensors")

    def __init__(self) -> None:
        self.tensors: list[tuple[Any, int | None]] = []
        self.numpy_constants = False


_pending = threading.local()
"""Constants converted for the call about to run in this thread; its closed ``fn`` takes them
at its first evaluation (conversion happens right before the adapter runs, so a nested call's
Constants go to the nested ``fn``)."""


def _pending_watch() -> _Watch:
    watch = getattr(_pending, "watch", None)
    if watch is None:
        watch = _pending.watch = _Watch()
    return watch


def _watch_of(fn: Any) -> _Watch:
    watch = getattr(fn, "_diffiface_watch", None)
    if watch is None:
        watch = getattr(_pending, "watch", None) or _Watch()
        _pending.watch = None
        with contextlib.suppress(AttributeError):
            fn._diffiface_watch = watch
    return watch  # type: ignore[no-any-return]


def _version(tensor: Any) -> int | None:
    try:
        return tensor._version  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):  # inference tensors keep no version counter
        return None


def watch_constant_modules(program: Callable[..., Any], parts: Any, backend_name: str) -> Callable[..., Any]:
    """``program`` with the models of the Constants' static leaves watched over each call
    (:func:`guard_constant_models`). A difference quotient is many calls of f: the copy is one per
    call of the backend, and a write shifts the points that follow."""
    cache_static = () if parts is None else parts.cache_static
    if all(cache_static):  # (no Constant static leaf: nothing a module of the caller's could be)
        return program
    why = f"The {backend_name} backend evaluates f at points near x, and a write shifts the points that follow."

    def watched(xs: Leaves, ts: Leaves, dynamic: Leaves, static: Any) -> Any:
        if static is None:
            return program(xs, ts, dynamic, static)
        holders = [value for value, cache in zip(static.leaves, cache_static, strict=False) if not cache]
        return guard_constant_models(lambda: program(xs, ts, dynamic, static), holders, why)

    return watched


def guard_constants(call: Callable[[], Any], contexts: Sequence[Any], why: str) -> Any:
    """:func:`guard_constant_models` over the leaves that are no arrays of the Constants among
    ``contexts`` (an evaluation of f outside any engine: ``differentiate_with``'s own, the
    checker's)."""
    models = [
        leaf
        for context in contexts
        if isinstance(context, Constant)
        for leaf in _tree.leaves(context.value)
        if not _arrays.is_array(leaf)
    ]
    return guard_constant_models(call, models, why)


def guard_constant_models(call: Callable[[], Any], holders: list[Any], why: str) -> Any:
    """``call()``, where a Constant's value among ``holders`` may be a ``torch.nn.Module`` (or hold
    one, a trainer its model, as :func:`~diffiface._contexts.held` finds them): their parameters
    and buffers copied before the call, compared after it (also where f raised), put back bit
    for bit and refused by name where f wrote into them (a batch norm's running statistics in
    training mode, a parameter); their structure and train or eval mode likewise
    (:func:`~diffiface._families.torch.restructured`). The variables of a Keras model or a
    ``tf.Module``, and the arrays of an ``mlx.nn`` module (or of an object holding one), are
    watched the same way (:func:`_watch_tensorflow`, :func:`_watch_mlx`). ``why``: the sentence
    the MutationError gives for refusing the write."""
    if "tensorflow" in sys.modules:
        call = _watch_tensorflow(call, holders, why)
    if "mlx.nn" in sys.modules:
        call = _watch_mlx(call, holders, why)
    torch: Any = sys.modules.get("torch")
    # (the module itself, or those an object holds: a trainer's model)
    modules: list[Any] = (
        [] if torch is None else [module for value in holders for module in held(value, _is_torch_module)]
    )
    if not modules:
        return call()
    copies = [
        (name, tensor, tensor.detach().clone())
        for module in modules
        for name, tensor in (*module.named_parameters(), *module.named_buffers())
    ]
    structure = [_torch.module_parts(part) for module in modules for part in module.modules()]
    failure: BaseException | None = None
    try:
        result = call()
    except BaseException as exc:
        failure = exc
    restructured = _torch.restructured(structure)  # (first: the module's own tensors back in it)
    written = []
    with torch.no_grad():
        for name, tensor, copy in copies:
            if not torch.equal(tensor, copy) and not (tensor.isnan() & copy.isnan()).equal(tensor.ne(copy)):
                tensor.copy_(copy)
                written.append(name)
    if restructured:
        raise MutationError(
            "f changed a di.Constant's torch.nn.Module: it set a parameter, a buffer or a submodule "
            f"into it, or switched its train or eval mode; put back as it was. {why} Set the module's "
            "mode before differentiating, and pass what f changes as x or return it through has_aux=True."
        ) from failure
    if written:
        raise MutationError(
            f"f wrote into a di.Constant's module ({', '.join(written)}: a batch norm's running "
            "statistics in training mode, a parameter set in place), which it must only read; "
            f"put back as it was. {why} Call module.eval() before differentiating, or "
            "pass the module as di.Cache(module) where f may change it."
        ) from failure
    if failure is not None:
        raise failure
    return result


def _watch_tensorflow(call: Callable[[], Any], leaves: list[Any], why: str) -> Callable[[], Any]:
    """``call`` guarding the TensorFlow variables of the Constants' ``leaves`` (a Keras model, a
    ``tf.Module``, an object holding one): TensorFlow counts no writes, so their values are kept
    before the call, compared after it (also where f raised), put back and refused."""
    variables = [variable for leaf in leaves for variable in _tensorflow.variables_of(leaf)]
    if not variables:
        return call

    def watched() -> Any:
        kept = [_tensorflow.variable_values(variable) for variable in variables]
        try:
            return call()
        finally:
            names = _tensorflow.put_back(variables, kept)
            if names:
                raise MutationError(
                    f"f wrote into the variables {names} of a di.Constant (a Keras layer called with training=True "
                    f"updates its statistics), which it must only read; put back as they were. {why} Call the "
                    "model with training=False, or pass it as di.Cache(model) where f may change it."
                )

    return watched


def _watch_mlx(call: Callable[[], Any], leaves: list[Any], why: str) -> Callable[[], Any]:
    """``call`` guarding the ``mlx.nn`` modules of the Constants' ``leaves`` (or that an object
    holds): every array they hold kept, with a copy of its values, compared after the call (also
    where f raised), put back and refused."""
    modules = [module for leaf in leaves for module in held(leaf, _mlx.is_module)]
    if not modules:
        return call
    copy = sys.modules["mlx.core"].array

    def watched() -> Any:
        kept = [_mlx.module_arrays(module) for module in modules]
        copies = [[(path, copy(array)) for path, array in pairs] for pairs in kept]
        try:
            return call()
        finally:
            written = _mlx.put_back(modules, kept, copies)
            if written:
                raise MutationError(
                    f"f wrote into {', '.join(written)} of an mlx.nn module in a di.Constant (a BatchNorm in train "
                    f"mode sets its running statistics), which it must only read; put back as they were. {why} "
                    "Call the module in eval mode (module.eval()), or pass it as di.Cache(module) where f may "
                    "change it."
                )

    return watched


def _is_torch_module(value: object) -> bool:
    return isinstance(value, sys.modules["torch"].nn.Module)


def _torch_write(backend_name: str, what: str) -> str:
    return (
        f"f wrote into {what} in place (its tensor's version counter moved: an operation such as "
        f"x.add_(1), x *= 2 or x[0] = 0), which it must only read. The {backend_name} backend evaluates f "
        "at points near x, and a write would shift the points that follow. Compute out of place "
        "(y = x * 2), or pass scratch space as di.Cache(tensor)."
    )


def _same_dtype(array: np.ndarray, like: Any) -> Any:
    if _arrays.kind(like) == "torch":
        return getattr(sys.modules["torch"], array.dtype.name, None)
    return array.dtype


def _traced_by_torch(x: Any) -> bool:
    """Whether a tensor carries an outer torch differentiation, which evaluating f on numbers
    would cut: it was computed from tensors that require grad, or is the input of an enclosing
    diffiface torch call, or a torch.func tensor (these have no storage), or a forward-mode
    dual. A leaf the caller made requiring grad (a module's parameter) is not: its finite
    differences are numbers, as a checker expects."""
    torch = sys.modules["torch"]
    if x.requires_grad and torch.is_grad_enabled():
        if x.grad_fn is not None:
            return True
        adapter = sys.modules.get("diffiface._adapters.torch")
        if adapter is not None and adapter.inside_a_call():
            return True
    if x.device.type != "meta":
        try:
            x.data_ptr()
        except RuntimeError:
            return True
    return torch.autograd.forward_ad.unpack_dual(x).tangent is not None


def _inside_torch() -> UnsupportedOperationError:
    return UnsupportedOperationError(
        "Finite differences were asked for inside a torch differentiation (x carries torch's "
        "graph, a torch.func transform or a forward-mode dual): torch cannot differentiate "
        "through them, and the outer derivative would silently lose this part. Differentiate "
        "the inner function with AutoTorch() too, or make the outer call finite differences "
        "(di.SecondOrder(di.AutoFiniteDifferences(), di.AutoTorch()) for second order)."
    )


class _Point:
    """``x`` as one float64 vector, with the way back to leaves of x's kinds and dtypes."""

    def __init__(self, xs: Leaves, promote: bool = False) -> None:
        _refuse_sharded(xs)
        for x in xs:
            if _arrays.kind(x) == "jax" and isinstance(x, sys.modules["jax"].core.Tracer):
                raise UnsupportedOperationError(
                    "Finite differences were asked for inside a jax transformation (x is a traced jax "
                    "array): they evaluate f at numbers, which jax cannot trace. Differentiate the inner "
                    "function with AutoJAX() too, or make the outer call finite differences "
                    "(di.SecondOrder(di.AutoFiniteDifferences(), di.AutoJAX()) for second order)."
                )
            if _arrays.kind(x) == "torch" and _traced_by_torch(x):
                raise _inside_torch()
        self.likes = tuple(_promoted(x) for x in xs) if promote else xs
        arrays = [_arrays.to_numpy(x) for x in xs]
        self.shapes = [a.shape for a in arrays]
        self.dtypes = [a.dtype for a in arrays]  # x's own, also when the likes are promoted
        self.offsets = np.cumsum([0, *(a.size for a in arrays)])
        self.vector = np.concatenate([a.reshape(-1).astype(np.float64) for a in arrays]) if arrays else np.zeros(0)
        # a Python float is weak: f computes with it in the precision of x's arrays, so its step
        # is theirs (float32's beside a float32 array, not float64's, which float32 rounds away)
        weak = [_arrays.kind(x) == "python" for x in xs]
        own = [max(float(np.finfo(a.dtype).eps), _arrays.resolution(x)) for a, x in zip(arrays, xs, strict=True)]
        floor = max((e for e, w in zip(own, weak, strict=True) if not w), default=float(np.finfo(np.float64).eps))
        steps = [floor if w else e for e, w in zip(own, weak, strict=True)]
        self.eps = np.repeat(steps, [a.size for a in arrays]) if arrays else np.zeros(0)
        self.size = self.vector.size

    def leaves(self, vector: np.ndarray) -> Leaves:
        """x's leaves at ``vector``; for a ``(k, n)`` array of ``k`` points, leaves holding them
        along a new leading axis (a Python float's as a numpy array)."""
        complex_step = np.iscomplexobj(vector)
        batch = vector.shape[:-1]
        leaves: list[Any] = []
        for i, like in enumerate(self.likes):
            piece = vector[..., self.offsets[i] : self.offsets[i + 1]].reshape((*batch, *self.shapes[i]))
            # type, not isinstance: np.float64 subclasses float, and a numpy scalar comes back as
            # numpy (a 0-d array of its dtype), which engines read a shape from
            python_float = type(like) is float
            if python_float and not batch:
                leaves.append(complex(piece.item()) if complex_step else float(piece.item()))
            elif python_float:
                leaves.append(read_only(piece))
            else:
                dtype = _complex_dtype(like) if complex_step else None
                leaves.append(read_only(_arrays.from_numpy(piece, like, dtype=dtype)))
        return tuple(leaves)

    def coarsen(self, out: Any) -> None:
        """Steps no finer than f's values resolve, given ``f(x)``: where f computes in a coarser
        precision than x's dtype (a float32 f of a float64 x, mlx's float64 functions, which are
        float32-accurate), a step chosen for x's dtype is swamped by f's rounding."""
        found = max(map(_arrays.resolution, _base.as_tuple(out)), default=0.0)
        if found > 0:
            self.eps = np.maximum(self.eps, found)

    def steps(self, power: float, fixed: float | None, exact: bool = True) -> np.ndarray:
        if fixed is not None:
            steps = np.full(self.size, float(fixed))
        else:
            steps = self.eps**power * np.maximum(1.0, np.abs(self.vector))
        return self._exact(steps) if exact else steps

    def check_step(self, backend: Any, steps: np.ndarray, where: np.ndarray | None = None) -> None:
        """Refuse a fixed step that rounds to 0 (``x_i + h == x_i`` in x's dtype) on some input
        (among ``where``): its derivative would come out 0."""
        lost = (steps == 0) & np.isfinite(self.vector)
        if where is not None:
            lost &= where
        if not lost.any():
            return
        spacing = np.zeros(self.size)
        for i, dtype in enumerate(self.dtypes):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            spacing[lo:hi] = np.spacing(np.abs(self.vector[lo:hi]).astype(dtype)).astype(np.float64)
        smallest = float(np.max(spacing[lost]))
        raise InvalidBackendOptionError(
            f"{type(backend).__name__}(step={backend.step!r}) is too small for this x: x_i + step == x_i in "
            f"x's dtype for {int(lost.sum())} of its {self.size} inputs, whose derivatives would come out 0. "
            f"The smallest step that moves every input is {smallest:.3g} (one spacing of floating-point "
            "numbers there); a much larger one balances rounding against truncation. Or use step=None to "
            "choose each input's step from its dtype and magnitude."
        )

    def check_complex_step(self, backend: Any, step: float) -> None:
        """Refuse a complex step below the smallest normal number of x's dtype: ``Im f(x + ih)``
        would lose its precision (or vanish) there."""
        tiny = max((float(np.finfo(np.result_type(d, np.float32)).tiny) for d in self.dtypes), default=0.0)
        if step < tiny:
            raise InvalidBackendOptionError(
                f"{type(backend).__name__}(step={backend.step!r}, method='complex') is too small for this x: "
                f"the imaginary parts of f would be subnormal or 0. Use a step of at least {tiny:.3g} "
                "(1e-20 serves nearly every function), or step=None."
            )

    def _exact(self, steps: np.ndarray) -> np.ndarray:
        """Steps rounded so that ``x + h`` is representable in each leaf's dtype."""
        out = np.empty_like(steps)
        for i, like in enumerate(self.likes):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            dtype = np.dtype(_arrays.dtype_name(like))
            x = self.vector[lo:hi].astype(dtype)
            out[lo:hi] = (x + steps[lo:hi].astype(dtype)).astype(np.float64) - x.astype(np.float64)
        return out


def _promoted(leaf: Any) -> Any:
    """A float32 numpy leaf, array or scalar, as float64 (f then computes in float64); other
    leaves as they are."""
    if isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype != np.float64:
        return leaf.astype(np.float64)
    return leaf


def _complex_dtype(like: Any) -> Any:
    name = _arrays.dtype_name(like)
    target = "complex64" if name in ("float32", "float16", "bfloat16") else "complex128"
    if _arrays.kind(like) == "torch":
        return getattr(sys.modules["torch"], target)
    return np.dtype(target)


class _Layout(list[tuple[tuple[int, ...], Any]]):
    """Shapes and dtypes of the leaves of f(x); ``tuple_out`` tells a tuple from one leaf."""

    tuple_out = True


def _flatten_out(out: Any) -> tuple[np.ndarray, _Layout]:
    arrays = [np.asarray(_arrays.to_numpy(leaf)) for leaf in _base.as_tuple(out)]
    layout = _Layout((a.shape, _real_dtype(a.dtype)) for a in arrays)
    layout.tuple_out = isinstance(out, tuple)
    vector = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    return vector, layout


def _real_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return np.dtype(np.float32) if dtype == np.complex64 else np.dtype(np.float64) if dtype.kind == "c" else dtype


# -- DTensors (torch.distributed.tensor): collective directional differences only ------------


def _is_dtensor(leaf: Any) -> bool:
    kind = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return kind is not None and isinstance(leaf, kind)


def _sharded_torch(leaves: Leaves) -> bool:
    """Whether a leaf is a DTensor (checked only once torch.distributed.tensor is imported)."""
    return "torch.distributed.tensor" in sys.modules and any(
        _arrays.kind(x) == "torch" and _is_dtensor(x) for x in leaves
    )


def _refuse_sharded(xs: Leaves) -> None:
    jax = sys.modules.get("jax")
    if jax is not None and any(
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and len(x.sharding.device_set) > 1
        and not x.sharding.is_fully_replicated  # (a replicated array is read from one device)
        for x in xs
    ):
        raise UnsupportedOperationError(
            "x holds a jax array sharded over several devices: finite differences of a Jacobian, vjp, "
            "Hessian or hvp (and of a gradient or jvp with the complex step, a fixed step, vectorize=True "
            "or a non-finite tangent) build their matrices in numpy, which would gather x on the host. "
            "On sharded arrays, finite differences give di.gradient and di.jvp on the devices; "
            "diffiface.test.check_gradients(f, x, ...) checks a gradient along random directions on "
            "them; AutoJAX() gives every operator without moving x."
        )
    if _sharded_torch(xs):
        raise UnsupportedOperationError(
            "x holds a DTensor (a tensor sharded over processes): finite differences of a gradient, vjp, "
            "Jacobian or Hessian perturb x one entry at a time, which needs x gathered in one process. "
            "Check the gradient along random directions instead (collective, nothing gathered): "
            "diffiface.test.check_gradients(f, x, ...) does so for DTensors, or "
            "di.jvp(f, di.AutoFiniteDifferences(), x, t) with a DTensor tangent t gives one product."
        )


def _largest(tensor: Any) -> float:
    """``max |tensor_i|`` as a Python float, the same on every rank for a DTensor (one scalar
    all-reduce); 0 for an empty tensor."""
    if tensor.numel() == 0:
        return 0.0
    largest = tensor.detach().abs().max()
    if _is_dtensor(largest):
        replicate = sys.modules["torch.distributed.tensor"].Replicate()
        largest = largest.redistribute(largest.device_mesh, [replicate] * largest.device_mesh.ndim).to_local()
    return float(largest)


def _times_non_finite(column: np.ndarray, t: float) -> np.ndarray:
    """``column * t`` for a non-finite ``t``, with exact zeros of ``column`` (outputs that do not
    depend on that input) kept 0, as a forward-mode engine gives them."""
    with np.errstate(invalid="ignore"):
        return np.where(column != 0, column * t, 0.0)  # type: ignore[no-any-return]


def _fit(layout: _Layout, found: _Layout) -> None:
    """Fill an empty ``layout`` with ``found``, or check that f's output kept its shapes."""
    if not layout:
        layout.extend(found)
        layout.tuple_out = found.tuple_out
        return
    before, after = [shape for shape, _ in layout], [shape for shape, _ in found]
    if before != after:
        raise InvalidOutputError(
            f"f's output changed shape between evaluations at nearby points: {_shapes(before)} at one, "
            f"{_shapes(after)} at another. Its derivative does not exist there (an output whose length "
            "depends on x's values, as x[x > 0], jumps). Return an output whose shape does not depend "
            "on x's values (say np.where(x > 0, x, 0) instead of x[x > 0])."
        )


def _shapes(shapes: list[tuple[int, ...]]) -> str:
    return ", ".join(f"shape {shape}" for shape in shapes) if shapes else "no output"


# -- reshaping flat results --------------------------------------------------------------------


def _split(vector: np.ndarray, point: _Point) -> Leaves:
    """A flat vector shaped as x (numpy pieces; the caller converts to x's kinds)."""
    return tuple(
        vector[point.offsets[i] : point.offsets[i + 1]].reshape(point.shapes[i]) for i in range(len(point.shapes))
    )


def _split_out(vector: np.ndarray, layout: list[Any]) -> Leaves:
    """A flat vector shaped as f(x), each piece in its output leaf's dtype."""
    pieces, start = [], 0
    for shape, dtype in layout:
        size = math.prod(shape)
        pieces.append(vector[start : start + size].reshape(shape).astype(dtype))
        start += size
    return tuple(pieces)


def _blocks(matrix: np.ndarray, layout: list[Any], point: _Point) -> Blocks:
    rows, start = [], 0
    for shape, dtype in layout:
        size = math.prod(shape)
        row = matrix[start : start + size]
        rows.append(
            tuple(
                row[:, point.offsets[j] : point.offsets[j + 1]].reshape((*shape, *point.shapes[j])).astype(dtype)
                for j in range(len(point.shapes))
            )
        )
        start += size
    return tuple(rows)


def _hessian_blocks(matrix: np.ndarray, point: _Point) -> Blocks:
    """Blocks ``(i, j)`` in the dtype of x's leaves (float32 x gets a float32 Hessian)."""
    dtypes = point.dtypes
    return tuple(
        tuple(
            matrix[point.offsets[i] : point.offsets[i + 1], point.offsets[j] : point.offsets[j + 1]]
            .reshape((*point.shapes[i], *point.shapes[j]))
            .astype(np.result_type(dtypes[i], dtypes[j]))
            for j in range(len(point.shapes))
        )
        for i in range(len(point.shapes))
    )
