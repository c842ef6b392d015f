"""What several families build on: the test of a list of leaves by metadata read in C, and the
parts of the family API that most families answer alike, under the API's own names (a family
takes one as it is: ``from ._shared import opened as opened``)."""

from __future__ import annotations

import contextlib
import hashlib
import operator
import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np


class MetaLeaves:
    """The test of a list of leaves: their types, and the metadata ``meta`` reads of each (an
    ``operator.attrgetter``, so no Python frame per leaf). A plan inlines this test where it
    finds one (``type(test) is MetaLeaves``), since a call costs a frame on the hot path."""

    __slots__ = ("meta", "metas", "types")

    def __init__(self, leaves: list[Any], meta: Callable[[Any], Any]) -> None:
        self.meta = meta
        self.types = list(map(type, leaves))
        self.metas = list(map(meta, leaves))

    def __call__(self, leaves: list[Any]) -> bool:
        return list(map(type, leaves)) == self.types and list(map(self.meta, leaves)) == self.metas


def x_refusal(leaf: Any) -> str | None:
    """``x_refusal`` of a family whose every leaf has values to differentiate at."""
    return None


def opened(result: Any) -> Any:
    """``opened`` of a family with no traced containers."""
    return result


def traced(leaf: Any) -> Any:
    """``traced`` of a family whose leaves trace no other value."""
    return leaf


def dtype_scope(dtypes: Iterable[str]) -> contextlib.nullcontext[None]:
    """No dtype needs a scope in this family."""
    return contextlib.nullcontext()


def eval_shape(fn: Callable[..., Any], avals: list[tuple[tuple[int, ...], str]]) -> None:
    """No abstract evaluation in this family: f is evaluated at zeros."""
    return None


def laid_out_ravel(leaves: list[Any]) -> None:
    """No layout over several devices in this family: the plain ravel serves."""
    return None


class Held(Protocol):
    """What a closure keeps of an array f reads (:func:`contents`): the test that it still holds
    the same values."""

    def holds(self, value: Any) -> bool: ...


class Contents:
    """An array's contents as f read them, through ``view`` (its family's numpy view of one of
    its arrays: the array and its metadata, shape and dtype at least, or None): the metadata,
    and the bytes, kept up to ``kept`` bytes, else their SHA-1 digest; an array of Python
    objects by the identities of its entries."""

    __slots__ = ("bytes", "digest", "meta", "objects", "view")

    def __init__(
        self, array: np.ndarray, meta: Any, view: Callable[[Any], tuple[np.ndarray, Any] | None], kept: int
    ) -> None:
        self.meta = meta
        self.view = view
        self.objects: tuple[Any, ...] | None = None
        self.bytes: bytes | None = None
        self.digest: bytes | None = None
        if array.dtype.hasobject:
            self.objects = tuple(array.flat)
        elif array.nbytes <= kept:
            self.bytes = array.tobytes()
        else:
            self.digest = _digest(array)

    def holds(self, value: Any) -> bool:
        found = self.view(value)
        if found is None:
            return False
        array, meta = found
        if meta != self.meta:
            return False
        if self.objects is not None:
            return all(map(operator.is_, array.flat, self.objects))
        if self.bytes is not None:
            return array.tobytes() == self.bytes
        return _digest(array) == self.digest


def _digest(array: np.ndarray) -> bytes:
    return hashlib.sha1(np.ascontiguousarray(array).data, usedforsecurity=False).digest()


def contents(value: Any, kept: int) -> None:
    """``contents`` of a family whose arrays a closure compares by identity only."""
    return None


def array_words(signature: tuple[Any, ...]) -> str:
    """``describe`` of a family whose signature is its name, a shape and a dtype."""
    return f"a {signature[0]} array of shape {signature[1]} and dtype {signature[2]}"


def trace_of(signature: tuple[Any, ...]) -> None:
    """``trace_of`` of a family whose leaves a prep never meets traced."""
    return None


def cast(value: Any, dtype: str) -> Any:
    """``cast`` of a family whose arrays' ``astype`` takes numpy's dtype names."""
    return value.astype(dtype)


def block_like(value: Any, like: Any) -> Any:
    """``block_like`` of a family whose blocks come out as the family's arrays already."""
    return value


def layout(leaf: Any) -> None:
    """``layout`` of a family whose arrays have no layout over devices."""
    return None


def same(leaf: Any) -> Callable[[Any], bool]:
    """``same`` of a family whose leaves are told apart by shape and dtype alone (mlx's,
    TensorFlow's): the test that a later leaf has the prepared one's shape and dtype."""
    shape, dtype = tuple(leaf.shape), leaf.dtype

    def test(value: Any) -> bool:
        return tuple(value.shape) == shape and value.dtype == dtype  # type: ignore[no-any-return]

    return test


_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")  # (read in C, no frame per leaf)


def leaves_test(leaves: list[Any]) -> Callable[[list[Any]], bool]:
    """``leaves_test`` of such a family: the leaves' types, shapes and dtypes, read inline."""
    return MetaLeaves(leaves, _SHAPE_DTYPE)


def jit_checked(leaf: Any) -> bool:
    """``jit_checked`` of a family that no retracing engine compiles for."""
    return False


def exchange(leaf: Any) -> None:
    """``exchange`` of a family whose leaves cross to another framework as numpy copies."""
    return None


def private_copy(leaf: Any) -> Any:
    """``private_copy`` of a family whose leaves f cannot write into unseen: the leaf itself."""
    return leaf


def from_parts(re: Any, im: Any) -> Any:
    """``from_parts`` of a family whose arrays take numpy's complex arithmetic."""
    return re + 1j * im


def numpy_like_complex(module: str) -> tuple[Callable[[Any], Any], Callable[[Any], tuple[Any, Any]]]:
    """``conj`` and ``parts`` of a family whose numpy-like module, named ``module`` (imported
    once its arrays exist), has numpy's ``conj``, ``real`` and ``imag``."""

    def conj(leaf: Any) -> Any:
        return sys.modules[module].conj(leaf)

    def parts(leaf: Any) -> tuple[Any, Any]:
        xp = sys.modules[module]
        return xp.real(leaf), xp.imag(leaf)

    return conj, parts


_OPAQUE = (int, float, complex, str, bytes, bool, type(None), type)
_MOST = 64
"""The longest list, tuple or dict :func:`held` looks into."""


def held(leaf: object, wanted: Callable[[object], bool], depth: int = 2) -> list[object]:
    """The objects ``wanted`` picks (an engine's models: a ``torch.nn.Module``, a Keras model)
    that a Constant's leaf holds: the leaf itself, or objects in its attributes, and in the
    lists, tuples and dicts among them (of at most 64 items), ``depth`` objects deep
    (``di.Constant(trainer)``, whose ``trainer.model`` f calls). An engine's guard watches each
    as it watches a Constant model."""
    if wanted(leaf):
        return [leaf]
    if depth == 0 or isinstance(leaf, _OPAQUE):
        return []
    found: list[object] = []
    seen = {id(leaf)}
    todo: list[tuple[object, int]] = [(leaf, depth)]
    while todo:
        value, left = todo.pop()
        if isinstance(value, (list, tuple, dict)):
            if len(value) > _MOST:  # (data, not a few models: not walked on every call)
                continue
            items: Iterable[object] = value.values() if isinstance(value, dict) else value
        else:
            attributes = getattr(value, "__dict__", None)
            if type(attributes) is not dict or left == 0:
                continue
            items = attributes.values()
            left -= 1
        for item in items:
            if id(item) in seen or isinstance(item, _OPAQUE):
                continue
            seen.add(id(item))
            if wanted(item):
                found.append(item)
            else:
                todo.append((item, left))
    return found
