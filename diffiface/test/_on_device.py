"""check_gradients on jax arrays that live on devices of their own (sharded, or committed away
from the default device): random directions are drawn on x's devices with x's sharding, the
float64 ground truth along them is computed there, and only scalars (one number per
direction and backend) come back to the host, each by an explicit ``jax.device_get``."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import optree

from .. import tree as _tree
from .._contexts import Constant
from .._families import _jax_placement as _placement


def applies(x: Any) -> bool:
    """Whether every leaf of x is a jax array and one is placed (several devices, or another
    than the default one)."""
    jax = sys.modules.get("jax")
    leaves = _tree.leaves(x)
    if jax is None or not leaves or not all(isinstance(leaf, jax.Array) for leaf in leaves):
        return False
    default = jax.devices()[0]
    return any(len(leaf.sharding.device_set) > 1 or leaf.sharding.device_set != {default} for leaf in leaves)


def _x64() -> Any:
    return sys.modules["jax"].enable_x64(True)


@functools.cache
def _programs() -> Any:
    jax = sys.modules["jax"]
    jnp = sys.modules["jax.numpy"]
    pin = _placement.pin

    # A direction is never stored: each program draws its part of it again from (seed,
    # direction, leaf), laid out as the leaf, so that no array of the model's size outlives
    # the program that needs it.
    def normal(seed: int, index: Any, leaf: Any, layout: Any) -> Any:
        key = jax.random.fold_in(jax.random.key(seed), index)
        return pin(jax.random.normal(key, leaf.shape, jnp.float64), layout)

    @functools.partial(jax.jit, static_argnums=(0, 3))
    def squared_norm(seed: int, indices: Any, leaves: Any, layouts: Any) -> Any:
        parts = [normal(seed, i, leaf, layout) for i, leaf, layout in zip(indices, leaves, layouts, strict=True)]
        return sum((jnp.sum(p * p) for p in parts), jnp.zeros((), jnp.float64))

    @functools.partial(jax.jit, static_argnums=(0, 4))
    def dot(seed: int, indices: Any, norm2: Any, gradient: Any, layouts: Any) -> Any:
        total = jnp.zeros((), jnp.float64)
        for i, g, layout in zip(indices, gradient, layouts, strict=True):
            total = total + jnp.sum(g.astype(jnp.float64) * normal(seed, i, g, layout))
        return total / jnp.sqrt(norm2)

    @functools.partial(jax.jit, static_argnums=(0, 5))
    def moved(seed: int, index: Any, norm2: Any, leaf: Any, t: Any, layout: Any) -> Any:
        u = normal(seed, index, leaf, layout) / jnp.sqrt(norm2)
        return pin(leaf.astype(jnp.float64) + t * u, layout)

    @functools.partial(jax.jit, static_argnums=1)
    def wide(leaf: Any, layout: Any) -> Any:
        return pin(leaf.astype(jnp.float64), layout)

    @functools.partial(jax.jit)
    def largest(leaves: Any) -> Any:
        return jnp.max(
            jnp.stack(
                [jnp.max(jnp.abs(leaf)).astype(jnp.float64) for leaf in leaves if leaf.size]
                + [jnp.ones((), jnp.float64)]
            )
        )

    return squared_norm, dot, moved, wide, largest


def _scalar(value: Any, like: Any) -> Any:
    """A number on ``like``'s devices, replicated (an explicit transfer of a few bytes)."""
    jax = sys.modules["jax"]
    sharding = like.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.device_put(value, sharding)


class Direction:
    """One random unit direction, by its seed, its number and its squared norm (a number on
    the devices): its values are drawn where they are used."""

    def __init__(self, seed: int, number: int, leaves: list[Any]) -> None:
        self.seed = seed
        self.indices = tuple(_scalar(np.uint32(number * len(leaves) + i), leaf) for i, leaf in enumerate(leaves))
        self.layouts = tuple(leaf.sharding for leaf in leaves)
        with _on_meshes(self.layouts):
            self.norm2 = _programs()[0](seed, self.indices, list(leaves), self.layouts)


def _on_meshes(layouts: tuple[Any, ...]) -> Any:
    return _placement.on_mesh(layouts[0]) if layouts else contextlib.nullcontext()


def random_directions(x: Any, k: int, seed: int) -> list[Direction]:
    """``k`` random unit directions (float64, drawn on x's devices in each leaf's sharding)."""
    leaves = _tree.leaves(x)
    with _x64():
        return [Direction(seed, d, leaves) for d in range(k)]


def dot(gradient: Any, direction: Direction) -> float:
    """``gradient . direction`` on the devices; one number comes back."""
    jax = sys.modules["jax"]
    with _x64(), _on_meshes(direction.layouts):
        total = _programs()[1](
            direction.seed, direction.indices, direction.norm2, _tree.leaves(gradient), direction.layouts
        )
        return float(jax.device_get(total))


def projected_truth(
    f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], directions: list[Direction], has_aux: bool
) -> list[float]:
    """``u . grad f`` by Richardson-extrapolated central differences of ``t -> f(x + t u)`` in
    float64, every point made on x's devices (x itself stays at its precision: each point is
    cast and moved in one program); one number per evaluation comes back."""
    jax = sys.modules["jax"]
    _, _, moved, wide, largest = _programs()
    with _x64():
        leaves, spec = _tree.flatten(x)
        values = tuple(
            _tree.map(lambda v: wide(v, v.sharding) if _float32_jax(v) else v, c.value)
            if isinstance(c, Constant)
            else c.value
            for c in contexts
        )
        scale = float(jax.device_get(largest(leaves)))
        h = float(2.220446049250313e-16 ** (1 / 5)) * scale

        def along(u: Direction, t: float) -> float:
            point = []
            for leaf, index in zip(leaves, u.indices, strict=True):
                with _placement.on_mesh(leaf.sharding):
                    point.append(moved(u.seed, index, u.norm2, leaf, _scalar(np.float64(t), leaf), leaf.sharding))
            out = f(optree.tree_unflatten(spec, point), *values)
            del point
            return float(jax.device_get(out[0] if has_aux else out))

        def central(u: Direction, step: float) -> float:
            return (along(u, step) - along(u, -step)) / (2 * step)

        return [(4 * central(u, h / 2) - central(u, h)) / 3 for u in directions]


def _float32_jax(value: Any) -> bool:
    jax = sys.modules["jax"]
    return isinstance(value, jax.Array) and str(value.dtype) in ("float32", "float16", "bfloat16")
