"""The array families: one module per framework, each with the same small API.

A leaf's family is found from its class through ``sys.modules``: a framework's arrays can only
exist once the framework is imported, so finding a family never imports one. Every family module
has the API of :class:`Family`. A new framework is a new module here and a row in
:data:`FAMILIES`; nothing else in the package names it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

import numpy as np

from . import autograd, jax, mlx, numpy, pytensor, python, tensorflow, torch
from ._shared import Held

Kind = Literal["python", "numpy", "torch", "jax", "autograd", "pytensor", "mlx", "tensorflow", "other"]
"""A family's name, or ``"other"`` for a leaf no family owns (a foreign pytree, a string)."""


class Family(Protocol):
    """The API every family module has. ``as_numpy`` is the converter of a leaf of any family to
    numpy (:func:`diffiface._arrays.to_numpy`), passed in since a family knows no other family."""

    # the kind of its leaves (what diffiface._arrays.kind returns)
    @property
    def NAME(self) -> str: ...
    # whether its leaves are arrays (Python numbers and autograd's boxes are not)
    @property
    def ARRAY(self) -> bool: ...
    # whether leaves of class ``cls`` belong to it (tried in FAMILIES' order)
    def owns(self, cls: type) -> bool: ...
    # what a prep depends on for one leaf
    def signature(self, leaf: Any) -> tuple[Any, ...]: ...
    # its numpy-like module, already imported
    def numpy_like(self) -> Any: ...
    # its leaves to and from numpy
    def to_numpy(self, leaf: Any) -> np.ndarray: ...
    def from_numpy(self, array: np.ndarray, like: Any, dtype: Any) -> Any: ...
    # whether its values belong to an enclosing engine's trace and pass through results
    # untouched (autograd's boxes)
    @property
    def PASSED_THROUGH(self) -> bool: ...
    # whether its arrays have numpy's array methods (reshape, .T, @), by which a
    # cross-framework call flattens a Jacobian (TensorFlow's tensors have none)
    @property
    def ARRAY_METHODS(self) -> bool: ...
    # the top-level modules whose callable objects are code, compared by identity where a
    # static context holds one (jax's wrapped functions)
    @property
    def CODE_MODULES(self) -> frozenset[str]: ...
    # the top-level packages of its own objects (models, layers), which hold its arrays as its
    # engine needs them: a sparsity tracer does not look into them
    @property
    def PACKAGES(self) -> frozenset[str]: ...
    # a result (of any family, ``value_family`` None for none) with ``like``'s array type,
    # dtype and device: what mirrors x
    def mirror(self, value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any: ...
    # an output-shaped result in its array type, dtype kept: what mirrors f(x)
    def as_own(self, value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any: ...
    # one of its arrays in another dtype (named as numpy names it)
    def cast(self, value: Any, dtype: str) -> Any: ...
    # a derivative's block laid out as ``like``, the leaf of x it relates to
    def block_like(self, value: Any, like: Any) -> Any: ...
    # the test that a result is laid out as ``leaf`` (None: nothing to test)
    def layout(self, leaf: Any) -> Any: ...
    # the test that a later leaf of the same class is as the prepared ``leaf`` was (shape,
    # dtype, device, layout; None: the class says all)
    def same(self, leaf: Any) -> Callable[[Any], bool] | None: ...
    # a test of a list of leaves all of the family, read inline (None: none faster than leaf
    # by leaf)
    def leaves_test(self, leaves: list[Any]) -> Callable[[list[Any]], bool] | None: ...
    # whether a jit-compiled program checks the leaf itself
    def jit_checked(self, leaf: Any) -> bool: ...
    # the leaf as another framework may take it through dlpack (detached, a copy where the
    # caller could change it), or None: it crosses as a numpy copy
    def exchange(self, leaf: Any) -> Any: ...
    # a scope in which the family keeps arrays of these dtypes (jax keeps float64 only under
    # enable_x64; a null context elsewhere)
    def dtype_scope(self, dtypes: Iterable[str]) -> AbstractContextManager[Any]: ...
    # complex numbers in its arrays (``parts``: the real and imaginary parts, new arrays)
    def conj(self, leaf: Any) -> Any: ...
    def parts(self, leaf: Any) -> tuple[Any, Any]: ...
    def from_parts(self, re: Any, im: Any) -> Any: ...
    # a copy f may write into without the caller seeing it, where its arrays are mutable and a
    # write goes unchecked (torch); the leaf itself elsewhere
    def private_copy(self, leaf: Any) -> Any: ...
    # ``fn``'s output structure for inputs of these ``(shape, dtype)``, found without values;
    # None where the family cannot (f is then evaluated at zeros)
    def eval_shape(self, fn: Callable[..., Any], avals: list[tuple[tuple[int, ...], str]]) -> Any: ...
    # tree.ravel of leaves laid out over several devices, keeping their layout: ``(flat,
    # parts)``, or None where the plain ravel serves
    def laid_out_ravel(self, leaves: list[Any]) -> tuple[Any, Callable[[Any], list[Any]]] | None: ...
    # why a leaf of x has nothing to differentiate at (None: it has values)
    def x_refusal(self, leaf: Any) -> str | None: ...
    # its values as numpy, also of a leaf inside an engine's transform
    def values(self, leaf: Any) -> np.ndarray: ...
    # f's output with the containers its trace holds opened (a passed-through family's; else
    # ``result``)
    def opened(self, result: Any) -> Any: ...
    # the value one of its leaves traces (a passed-through family's; else ``leaf``)
    def traced(self, leaf: Any) -> Any: ...
    # what a prep keeps of one of its arrays that f reads (from its closure or globals) to tell
    # whether it still holds the same values (``holds(value)``): a copy of up to ``kept``
    # bytes, else a digest; None where its arrays are compared by identity only (immutable, or
    # not followed)
    def contents(self, value: Any, kept: int) -> Held | None: ...
    # a leaf of this ``signature`` in words, for a prep's mismatch message ("a torch array of
    # shape (3,) and dtype torch.float32 on cpu")
    def describe(self, signature: tuple[Any, ...]) -> str: ...
    # the trace a leaf of this ``signature`` is traced under, in words ("a jax trace (inside
    # jax.jit, ...)"), or None for a concrete leaf
    def trace_of(self, signature: tuple[Any, ...]) -> str | None: ...


FAMILIES: tuple[Family, ...] = (numpy, python, torch, jax, autograd, pytensor, mlx, tensorflow)
"""In the order their ``owns`` is asked: numpy before Python, since numpy's float64 is a float."""

BY_KIND: dict[str, Family] = {family.NAME: family for family in FAMILIES}

CODE_MODULES: frozenset[str] = frozenset().union(*(family.CODE_MODULES for family in FAMILIES))

PACKAGES: frozenset[str] = frozenset().union(*(family.PACKAGES for family in FAMILIES))

HOST: Family = numpy
"""The family every other converts through (``to_numpy``, ``from_numpy``): the arrays of the
engines that call f with the host's arrays (the black boxes), and of Python numbers raveled."""


def of_type(cls: type) -> Family | None:
    """The family owning leaves of class ``cls``, or None (the kind ``"other"``)."""
    for family in FAMILIES:
        if family.owns(cls):
            return family
    return None


def by_kind(kind: str) -> Family:
    """The family of ``kind``; a kind no family has is refused by name, never passed unchecked."""
    try:
        return BY_KIND[kind]
    except KeyError:
        from .._errors import UnsupportedOperationError

        raise UnsupportedOperationError(
            f"diffiface has no array family {kind!r}; the families are {', '.join(sorted(BY_KIND))}."
        ) from None


# a leaf no family owns, where a framework's pytree registry knows its class (a flax or
# equinox object) but diffiface's does not: jax's is the one registry read
foreign_contents = jax.foreign_contents
foreign_node = jax.foreign_node
foreign_tree = jax.foreign_tree
