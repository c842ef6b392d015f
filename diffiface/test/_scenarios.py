"""The bundled scenario lists: the core cases, the layer zoo, and the zoo as torch.nn modules."""

from __future__ import annotations

import math
from collections import namedtuple
from typing import Any

import numpy as np
import optree

from .. import _arrays
from .. import tree as _tree
from .._backends import AutoFiniteDifferences
from .._call import OPERATORS
from .._contexts import Cache, Constant
from .._tangents import Tangents
from ._scenario import Scenario

__all__ = ["core_scenarios", "layer_scenarios", "torch_module_scenarios"]

Pair = namedtuple("Pair", ["left", "right"])


# -- core: every operator x every input kind x contexts x dtypes ------------------------------------------


def _leaves(x: Any) -> list[Any]:
    return _tree.leaves(x)


def _sin(value: Any) -> Any:
    if isinstance(value, float):
        return math.sin(value)
    return _arrays.numpy_like(value).sin(value)


def scalar_function(x: Any, scale: Any = 1.0) -> Any:
    """``sum over leaves of sum(scale * sin(x) * x**2)``: smooth, every coordinate matters."""
    total = 0.0
    for leaf in _leaves(x):
        term = scale * _sin(leaf) * leaf**2
        total = total + (term if isinstance(leaf, float) else _arrays.numpy_like(term).sum(term))
    return total


def vector_function(x: Any, scale: Any = 1.0) -> Any:
    """A pytree output shaped as x: ``scale * sin(x) * x`` per leaf, plus ``x**3`` for the first."""
    leaves, spec = _tree.flatten(x)
    out = [scale * _sin(leaf) * leaf for leaf in leaves]
    if leaves:
        out[0] = Pair(out[0], leaves[0] ** 3)
    return optree.tree_unflatten(spec, out)


def curve(t: Any, scale: Any = 1.0) -> Any:
    """A scalar input to a pytree output, for derivatives."""
    return {"sin": scale * _sin(t), "poly": [t**3 - 2 * t, 0.5 * t**2]}


def with_cache(function: Any) -> Any:
    """``function`` that also writes its result into a Cache dict (allowed: Cache is scratch)."""

    def cached(x: Any, cache: dict[str, Any], scale: Any = 1.0) -> Any:
        value = function(x, scale)
        cache["last"] = value
        return value

    cached.__name__ = f"{function.__name__}_with_cache"
    return cached


def _inputs(dtype: Any) -> dict[str, Any]:
    rng = np.random.default_rng(0)

    def arr(*shape: int) -> np.ndarray:
        return (rng.uniform(-1.5, 1.5, size=shape)).astype(dtype)

    return {
        "scalar": arr(),
        "vector": arr(4),
        "matrix": arr(2, 3),
        "empty": arr(0),
        "pytree": {"w": arr(2, 2), "b": [arr(3), None, (arr(), Pair(arr(2), arr(1)))]},
    }


def _tangent(x: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    return _tree.map(lambda leaf: rng.standard_normal(np.shape(leaf)).astype(leaf.dtype), x)


def core_scenarios(dtypes: tuple[str, ...] = ("float64", "float32"), quick: bool = False) -> list[Scenario]:
    """Every operator on scalar, vector, matrix, empty and nested-pytree inputs, with a
    Constant context (and, on vector inputs, none or a Cache), in float64 and float32.

    References are finite differences in float64 (float32 inputs are promoted for them).
    With ``quick``, only the vector and pytree inputs and Constant contexts.
    """
    scenarios = []
    for dtype in dtypes:
        inputs = _inputs(np.dtype(dtype))
        scale = np.asarray(0.75, dtype=dtype)
        for name, x in inputs.items():
            if quick and name not in ("vector", "pytree"):
                continue
            for op in OPERATORS.values():
                variants = ["constant"] if quick or name != "vector" else ["constant", "none", "cache"]
                if op.scalar_input and name != "scalar":
                    continue
                for variant in variants:
                    scenarios.append(_core(op.name, name, x, dtype, scale, variant))
    return scenarios


def _core(operator: str, input_name: str, x: Any, dtype: str, scale: Any, variant: str) -> Scenario:
    op = OPERATORS[operator]
    base = curve if op.scalar_input else scalar_function if op.scalar_output else vector_function
    if variant == "cache":
        f = with_cache(base)
        contexts: tuple[Any, ...] = (Cache({}), Constant(scale))
    elif variant == "constant":
        f, contexts = base, (Constant(scale),)
    else:
        f, contexts = base, ()
    tangent = None
    if op.tangent == "x":
        tangent = _tangent(x, 1)
        if op.batch:  # (a batch of two tangents, the second another draw)
            tangent = Tangents(tangent, _tangent(x, 3))
    elif op.tangent == "y":
        y = f(x, *(c.value for c in contexts)) if variant != "cache" else base(x, scale)
        tangent = Tangents(_tangent(y, 2), _tangent(y, 4)) if op.batch else _tangent(y, 2)
    tags = {"core", dtype, input_name, variant}
    second = op.name in (
        "hessian",
        "value_gradient_and_hessian",
        "hvp",
        "gradient_and_hvp",
        "batched_hvp",
        "gradient_and_batched_hvp",
        "second_derivative",
        "value_derivative_and_second_derivative",
    )
    rtol, atol = (1e-5, 1e-6) if dtype == "float64" else (2e-3, 2e-3)
    if second:
        tags.add("second_order")
        rtol, atol = (1e-4, 1e-5) if dtype == "float64" else (3e-2, 3e-2)
    reference: Any = AutoFiniteDifferences()
    if operator in ("hessian", "value_gradient_and_hessian"):
        # exact, and free: a Hessian by adaptive differences (scipy's, judging the finite
        # differences) costs seconds on the pytree, and is itself only accurate to ~1e-8
        reference = _exact_second_order(operator, x, 1.0 if variant == "none" else scale)
    return Scenario(
        name=f"{operator}-{input_name}-{variant}-{dtype}",
        f=f,
        x=x,
        operator=operator,
        contexts=contexts,
        tangent=tangent,
        rtol=rtol,
        atol=atol,
        tags=frozenset(tags),
        reference=reference,
        note="core case: reference by central finite differences in float64 (Hessians: exact)",
        # (f computes with its leaves' numpy-like module: TensorFlow's numpy and mlx.core too)
        frameworks=frozenset({"numpy", "jax", "torch", "autograd", "tensorflow", "mlx"}),
    )


def _exact_second_order(operator: str, x: Any, scale: Any) -> Any:
    """The exact Hessian (and value and gradient) of :func:`scalar_function`, in float64: it sums
    ``g(t) = scale * sin(t) * t**2`` over every coordinate, so its Hessian is diagonal, with
    ``g''(t) = scale * (2 sin t + 4 t cos t - t**2 sin t)``."""
    s = float(scale)
    leaves, spec = _tree.flatten(x)
    wide = [np.asarray(leaf, dtype=np.float64) for leaf in leaves]
    value = sum(float(np.sum(s * np.sin(t) * t**2)) for t in wide)
    gradient = [s * (np.cos(t) * t**2 + 2 * t * np.sin(t)) for t in wide]
    rows = []
    for i, ti in enumerate(wide):
        blocks = []
        for j, tj in enumerate(wide):
            block = np.zeros(ti.shape + tj.shape)
            if i == j:
                second = s * (2 * np.sin(ti) + 4 * ti * np.cos(ti) - ti**2 * np.sin(ti))
                block = np.diag(second.reshape(-1)).reshape(ti.shape + ti.shape)
            blocks.append(block)
        rows.append(optree.tree_unflatten(spec, blocks))
    hessian = optree.tree_unflatten(spec, rows)
    if operator == "hessian":
        return hessian
    return np.float64(value), optree.tree_unflatten(spec, gradient), hessian


# -- the layer zoo ------------------------------------------------------------------------------------------


def layer_scenarios(dtypes: tuple[str, ...] = ("float64", "float32"), quick: bool = False) -> list[Scenario]:
    """Every layer of the zoo (dense, conv, pooling, normalisation, recurrent cells, attention,
    embedding, dropout with an explicit key...), written once against the array API, as a
    gradient (value_and_gradient with has_aux for train-mode BatchNorm, which returns its new
    state instead of mutating it).

    float64 layers are checked against finite differences; float32 ones against finite
    differences in float64, except normalisation layers, whose float32 rounding makes finite
    differences meaningless: those compare two automatic-differentiation engines ("cross").
    """
    from ._layers import layer_cases

    scenarios = []
    for dtype in dtypes:
        for case in layer_cases(np.dtype(dtype)):
            if quick and "dense" not in case.tags and "normalization" not in case.tags:
                continue
            cross = dtype == "float32" and bool({"normalization", "piecewise"} & case.tags)
            contexts = (Constant(case.config), Constant(case.data), Constant(case.state))
            scenarios.append(
                Scenario(
                    name=f"{case.name}-{dtype}",
                    f=case.loss,
                    x=case.params,
                    operator="value_and_gradient" if case.has_aux else "gradient",
                    contexts=contexts,
                    has_aux=case.has_aux,
                    reference="cross" if cross else _fd_reference(),
                    rtol=(1e-5 if dtype == "float64" else 1e-2),
                    atol=(1e-6 if dtype == "float64" else 1e-3),
                    tags=frozenset({"layer", dtype, *case.tags}),
                    note=case.note
                    + (
                        " In float32, finite differences are too noisy here (normalisation) or step over kinks "
                        "(max): two automatic-differentiation engines are compared instead."
                        if cross
                        else ""
                    ),
                    finite_differences_ok=not cross,
                )
            )
    return scenarios


def _fd_reference() -> Any:
    from .._backends import AutoFiniteDifferences

    return AutoFiniteDifferences()


# -- torch.nn modules -------------------------------------------------------------------------------------


def torch_module_scenarios(dtypes: tuple[str, ...] = ("float64",), include_mutating: bool = False) -> list[Scenario]:
    """The zoo's layers as torch.nn modules called through ``torch.func.functional_call``, the
    module passed as a Constant and the parameters (a dict of tensors) differentiated.

    The train-mode BatchNorm module updates its running statistics in place on every call:
    a mutated Constant, which the suite must report. It is left out unless
    ``include_mutating`` (the project's tests use it to prove the suite catches it).
    """
    import torch

    from ._torch_modules import torch_module_cases

    scenarios = []
    for dtype in dtypes:
        for case in torch_module_cases(np.dtype(dtype)):
            if "mutates_state" in case.tags and not include_mutating:
                continue
            params = {name: torch.as_tensor(value) for name, value in case.params.items()}
            scenarios.append(
                Scenario(
                    name=f"torch-{case.name}-{dtype}",
                    f=case.loss,
                    x=params,
                    operator="value_and_gradient" if case.has_aux else "gradient",
                    has_aux=case.has_aux,
                    contexts=(Constant(case.module), Constant(case.data)),
                    rtol=1e-5,
                    atol=1e-6,
                    tags=frozenset({"torch_module", dtype, *case.tags}),
                    frameworks=frozenset({"torch"}),
                    note=case.note,
                )
            )
    return scenarios
