"""Deep snapshots of arguments, to prove that nothing was mutated.

A snapshot copies every array leaf (numpy, jax, torch: data, ``requires_grad`` and ``.grad``)
and every torch module's parameters, buffers, their ``.grad`` and ``requires_grad``, and its
``training`` flag. :func:`changes` compares a snapshot with the live objects and names each
difference by its path.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .. import _arrays
from .. import tree as _tree
from .._contexts import Context
from ..tree import path_string

__all__ = ["changes", "snapshot"]


def snapshot(tree: Any) -> list[tuple[str, Any, Any]]:
    """``(path, object, copy of its state)`` for every leaf of ``tree`` that holds state."""
    taken = []
    paths, leaves, _ = _tree.flatten_with_path(_unwrap(tree))
    for path, leaf in zip(paths, leaves, strict=True):
        state = _state(leaf)
        if state is not None:
            taken.append((path_string(path) or "value", leaf, state))
    return taken


def changes(taken: list[tuple[str, Any, Any]]) -> list[str]:
    """What differs between a snapshot and the objects now, one line per difference."""
    found = []
    for path, leaf, before in taken:
        after = _state(leaf) or {}
        for key in before:
            if not _equal(before[key], after.get(key)):
                found.append(f"{path}{key}")
    return found


def _unwrap(tree: Any) -> Any:
    """Context wrappers hold their value: snapshot the value."""
    return _tree.map(lambda leaf: _unwrap(leaf.value) if isinstance(leaf, Context) else leaf, tree)


def _state(leaf: Any) -> dict[str, Any] | None:
    kind = _arrays.kind(leaf)
    if kind == "numpy":
        return {"": np.array(leaf, copy=True)}
    if kind == "jax":
        if _is_tracer(leaf):
            return None
        if _placed(leaf):
            # a jax array cannot change in place, only be deleted (a donated buffer): the array
            # itself is its state, and its shards stay on their devices
            return {"": _Held(leaf)}
        return {"": _jax_copy(leaf)}
    if kind == "torch":
        return _tensor_state("", leaf)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.nn.Module):
        state: dict[str, Any] = {".training": leaf.training}
        for name, tensor in [*leaf.named_parameters(), *leaf.named_buffers()]:
            state.update(_tensor_state(f".{name}", tensor))
        return state
    return None


def _tensor_state(prefix: str, tensor: Any) -> dict[str, Any]:
    grad = tensor.grad
    return {
        prefix: _tensor_copy(tensor),
        f"{prefix}.requires_grad": tensor.requires_grad,
        f"{prefix}.grad": None if grad is None else _tensor_copy(grad),
    }


def _tensor_copy(tensor: Any) -> np.ndarray:
    """A tensor's values in numpy (a bfloat16 one's in float32, which holds each exactly)."""
    values = tensor.detach().cpu()
    if values.dtype is sys.modules["torch"].bfloat16:
        values = values.float()
    return values.numpy().copy()  # type: ignore[no-any-return]


def _jax_copy(leaf: Any) -> np.ndarray:
    """The bits of a jax array; a typed key (``jax.random.key(0)``) by its key data, since
    numpy cannot hold a key dtype."""
    jax = sys.modules["jax"]
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return np.array(jax.random.key_data(leaf), copy=True)
    return np.array(leaf, copy=True)


def _placed(leaf: Any) -> bool:
    """Whether a jax array spans several devices or lives away from the default one."""
    devices = leaf.sharding.device_set
    return len(devices) > 1 or devices != {sys.modules["jax"].devices()[0]}


class _Held:
    """A jax array's identity, and whether its buffers were deleted."""

    __slots__ = ("array", "deleted")

    def __init__(self, array: Any) -> None:
        self.array, self.deleted = array, array.is_deleted()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Held) and other.array is self.array and other.deleted == self.deleted

    __hash__ = None  # type: ignore[assignment]


def _is_tracer(leaf: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(leaf, jax.core.Tracer)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        # bit for bit: NaN equals NaN, -0.0 differs from 0.0
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return bool(a == b)
