"""A :class:`Scenario`: one function, one point, one operator, and what the answer must be."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _arrays
from .. import tree as _tree
from .._backends import AutoFiniteDifferences, Backend
from .._call import OPERATORS
from .._contexts import Constant, Context
from .._tangents import Tangents

__all__ = ["Scenario"]

Reference = Any
"""An explicit result (analytic), a :class:`~diffiface.Backend` that computes it, or ``"cross"``."""


@dataclasses.dataclass(frozen=True, eq=False)
class Scenario:
    """One test case of the suite.

    Parameters
    ----------
    name:
        A readable identifier, used in test ids and reports.
    f, x, contexts:
        The function, the point, and the wrapped extra arguments (:class:`~diffiface.Constant`,
        :class:`~diffiface.Cache`).
    operator:
        The name of a diffiface operator (``"gradient"``, ``"jvp"``, ...).
    tangent:
        ``tx`` for jvp, value_and_jvp, hvp and gradient_and_hvp; ``ty`` for vjp and value_and_vjp.
    reference:
        The right result. Either given (an analytic result: it is checked against the
        operator's result shape when the scenario is built), or a backend that computes it
        (default: central finite differences, in float64 when the inputs are float32), or
        ``"cross"``: compared with another automatic-differentiation code path (for cases
        where finite differences cannot serve; say why in ``note``).
    rtol, atol:
        Tolerances; None for the defaults of the result's dtype.
    has_aux:
        Whether ``f`` returns ``(value, aux)`` (value_and_gradient, value_and_jvp, value_and_vjp).
    tags:
        Labels for selecting scenarios (``"core"``, ``"layer"``, ``"float32"``, ``"torch"``...).
    frameworks:
        The array frameworks ``f`` is written for; backends of other frameworks skip the
        scenario (finite differences and scipy run on any).
    note:
        Why the scenario exists, or why its reference is what it is.
    finite_differences_ok:
        False where finite differences cannot serve (float32 normalisation, kinks nearer than
        a float32 step): finite-difference backends then skip the scenario, and the
        reference should be ``"cross"``.
    """

    name: str
    f: Callable[..., Any]
    x: Any
    operator: str
    contexts: tuple[Context[Any], ...] = ()
    tangent: Any = None
    reference: Reference = dataclasses.field(default_factory=AutoFiniteDifferences)
    rtol: float | None = None
    atol: float | None = None
    has_aux: bool = False
    tags: frozenset[str] = frozenset()
    frameworks: frozenset[str] = frozenset({"numpy", "jax", "torch", "autograd", "mlx"})
    note: str = ""
    finite_differences_ok: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.contexts, Context):  # one context, given bare
            object.__setattr__(self, "contexts", (self.contexts,))
        elif isinstance(self.contexts, list):
            object.__setattr__(self, "contexts", tuple(self.contexts))
        elif not isinstance(self.contexts, tuple):
            raise ValueError(
                f"Scenario {self.name!r}: contexts must be a tuple of di.Constant or di.Cache (or one of them), "
                f"got {type(self.contexts).__name__}."
            )
        op = OPERATORS.get(self.operator)
        if op is None:
            raise ValueError(
                f"Scenario {self.name!r}: unknown operator {self.operator!r}; choose from {sorted(OPERATORS)}."
            )
        if (op.tangent is None) != (self.tangent is None):
            need = "needs a tangent" if op.tangent else "takes no tangent"
            raise ValueError(f"Scenario {self.name!r}: {self.operator} {need}.")
        for context in self.contexts:
            if not isinstance(context, Context):
                raise ValueError(
                    f"Scenario {self.name!r}: contexts must be di.Constant or di.Cache, got {type(context).__name__}."
                )
        if not (isinstance(self.reference, (Backend, str)) or self.reference is None):
            expected = result_layout(self)
            given = _layout(self.reference)
            # (compared as flat trees: a di.Tangents equals only itself)
            if _tree.flatten(given) != _tree.flatten(expected):
                raise ValueError(
                    f"Scenario {self.name!r}: the given reference does not fit {self.operator}'s result: "
                    f"expected the layout {expected}, got {given}."
                )
        elif isinstance(self.reference, str) and self.reference != "cross":
            raise ValueError(
                f"Scenario {self.name!r}: reference must be a result, a backend or 'cross', got {self.reference!r}."
            )

    @property
    def context_values(self) -> tuple[Any, ...]:
        return tuple(c.value for c in self.contexts)

    def arguments(self) -> tuple[Any, ...]:
        """The positional arguments of the operator after ``f`` and the backend."""
        head = (self.x,) if self.tangent is None else (self.x, self.tangent)
        return (*head, *self.contexts)

    def evaluate(self) -> Any:
        """``f(x, *contexts)`` as the user would call it."""
        return self.f(self.x, *self.context_values)


def result_layout(scenario: Scenario) -> Any:
    """The structure and shapes the operator's result must have (for checking references)."""
    op = OPERATORS[scenario.operator]
    x_layout = _layout(scenario.x)
    y: Any = scenario.evaluate() if any(kind in ("y", "ys", "jacobian", "value") for _, kind in op.parts) else None
    if scenario.has_aux and y is not None:
        y = y[0]
    pieces = []
    for _, kind in op.parts:
        if kind == "x":
            pieces.append(x_layout)
        elif kind in ("y", "value"):
            pieces.append(_layout(y))
        elif kind in ("ys", "xs"):  # one piece per tangent of the batch
            pieces.append(Tangents(*[_layout(y if kind == "ys" else scenario.x)] * len(scenario.tangent)))
        elif kind == "jacobian":
            pieces.append(
                _tree.map(lambda yl: _tree.map(lambda xl: (*_arrays.shape(yl), *_arrays.shape(xl)), scenario.x), y)
            )
        else:
            pieces.append(
                _tree.map(
                    lambda xi: _tree.map(lambda xj: (*_arrays.shape(xi), *_arrays.shape(xj)), scenario.x),
                    scenario.x,
                )
            )
    if scenario.has_aux:
        return None  # an aux result is whatever f returns; only its value part is checked
    return pieces[0] if len(pieces) == 1 else tuple(pieces)


def _layout(tree: Any) -> Any:
    return _tree.map(lambda leaf: _arrays.shape(leaf), tree)


def promote(tree: Any) -> Any:
    """float32 array leaves as float64 (for a float64 finite-difference reference)."""

    def up(leaf: Any) -> Any:
        if _arrays.dtype_name(leaf) not in ("float32", "float16", "bfloat16"):
            return leaf
        kind = _arrays.kind(leaf)
        if kind == "numpy":
            return leaf.astype(np.float64)
        if kind == "torch":
            return leaf.double()
        if kind == "jax":
            return _jax_float64(leaf)
        if kind == "mlx":
            return leaf.astype(sys.modules["mlx.core"].float64)
        return leaf

    return _tree.map(up, tree)


def _jax_float64(leaf: Any) -> Any:
    """A float64 jax array of ``leaf`` (made under a scoped x64; the global flag is untouched).
    Engines run f under x64 when a float64 array is involved, so the values stay float64."""
    jax = sys.modules["jax"]
    with contextlib.ExitStack() as stack:
        if not jax.config.read("jax_enable_x64"):
            stack.enter_context(jax.enable_x64(True))
        return jax.numpy.asarray(np.asarray(leaf, dtype=np.float64))


def promote_contexts(contexts: tuple[Context[Any], ...]) -> tuple[Context[Any], ...]:
    return tuple(type(c)(promote(c.value)) if isinstance(c, Constant) else c for c in contexts)


def shifted(tree: Any, amount: float = 0.25) -> Any:
    """The same structure, shapes, dtypes and array types, other values: a point to prepare at."""

    def shift(leaf: Any) -> Any:
        if isinstance(leaf, float):
            return leaf + amount
        dtype = _arrays.dtype_name(leaf)
        if _arrays.kind(leaf) in ("numpy", "torch", "jax", "mlx") and (
            _arrays.is_float_dtype(dtype) or "complex" in dtype
        ):
            return leaf + amount
        return leaf

    return _tree.map(shift, tree)
