"""check_gradients on jax arrays that live on devices of their own (sharded, or committed away
from the default device): random directions are drawn on x's devices with x's sharding, the
float64 ground truth along them is computed there, and only scalars (one number per
direction and backend) come back to the host, each by an explicit ``jax.device_get``."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import optree

from .. import _placement
from .. import tree as _tree
from .._contexts import Constant


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

    @functools.partial(jax.jit, static_argnums=(0, 2, 3))
    def normal(seed: int, index: Any, shape: tuple[int, ...], layout: Any) -> Any:
        key = jax.random.fold_in(jax.random.key(seed), index)
        return pin(jax.random.normal(key, shape, jnp.float64), layout)

    @functools.partial(jax.jit)
    def squared_norm(parts: Any) -> Any:
        return sum((jnp.sum(p * p) for p in parts), jnp.zeros((), jnp.float64))

    @functools.partial(jax.jit, static_argnums=2)
    def normalized(part: Any, norm2: Any, layout: Any) -> Any:
        return pin(part / jnp.where(norm2 > 0, jnp.sqrt(norm2), 1), layout)

    @functools.partial(jax.jit, static_argnums=1)
    def wide(leaf: Any, layout: Any) -> Any:
        return pin(leaf.astype(jnp.float64), layout)

    @functools.partial(jax.jit)
    def dot(gradient: Any, direction: Any) -> Any:
        return sum(
            (jnp.sum(g.astype(jnp.float64) * u) for g, u in zip(gradient, direction, strict=True)),
            jnp.zeros((), jnp.float64),
        )

    @functools.partial(jax.jit, static_argnums=3)
    def moved(leaf: Any, u: Any, t: Any, layout: Any) -> Any:
        return pin(leaf + t * u, layout)

    @functools.partial(jax.jit)
    def largest(leaves: Any) -> Any:
        return jnp.max(jnp.stack([jnp.max(jnp.abs(leaf)) for leaf in leaves if leaf.size] + [jnp.ones(())]))

    return normal, squared_norm, normalized, wide, dot, moved, largest


def _scalar(value: Any, like: Any) -> Any:
    """A number on ``like``'s devices, replicated (an explicit transfer of a few bytes)."""
    jax = sys.modules["jax"]
    sharding = like.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.device_put(value, sharding)


def random_directions(x: Any, k: int, seed: int) -> list[list[Any]]:
    """``k`` random unit directions (float64, one array per leaf of x, in its sharding)."""
    normal, squared_norm, normalized, *_ = _programs()
    leaves = _tree.leaves(x)
    directions = []
    with _x64():
        for d in range(k):
            parts = []
            for i, leaf in enumerate(leaves):
                with _placement.on_mesh(leaf.sharding):
                    index = _scalar(np.uint32(d * len(leaves) + i), leaf)
                    parts.append(normal(seed, index, tuple(leaf.shape), leaf.sharding))
            norm2 = squared_norm(parts)
            directions.append([normalized(p, norm2, leaf.sharding) for p, leaf in zip(parts, leaves, strict=True)])
    return directions


def dot(gradient: Any, direction: list[Any]) -> float:
    """``gradient . direction`` on the devices; one number comes back."""
    jax = sys.modules["jax"]
    with _x64():
        return float(jax.device_get(_programs()[4](_tree.leaves(gradient), direction)))


def projected_truth(
    f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], directions: list[list[Any]], has_aux: bool
) -> list[float]:
    """``u . grad f`` by Richardson-extrapolated central differences of ``t -> f(x + t u)`` in
    float64, every point made on x's devices; one number per evaluation comes back."""
    jax = sys.modules["jax"]
    *_, wide, _, moved, largest = _programs()
    with _x64():
        leaves, spec = _tree.flatten(x)
        leaves = [wide(leaf, leaf.sharding) for leaf in leaves]
        values = tuple(
            _tree.map(lambda v: wide(v, v.sharding) if _float32_jax(v) else v, c.value)
            if isinstance(c, Constant)
            else c.value
            for c in contexts
        )
        scale = float(jax.device_get(largest(leaves)))
        h = float(2.220446049250313e-16 ** (1 / 5)) * scale

        def along(u: list[Any], t: float) -> float:
            point = [
                moved(leaf, p, _scalar(np.float64(t), leaf), leaf.sharding) for leaf, p in zip(leaves, u, strict=True)
            ]
            out = f(optree.tree_unflatten(spec, point), *values)
            return float(jax.device_get(out[0] if has_aux else out))

        def central(u: list[Any], step: float) -> float:
            return (along(u, step) - along(u, -step)) / (2 * step)

        return [(4 * central(u, h / 2) - central(u, h)) / 3 for u in directions]


def _float32_jax(value: Any) -> bool:
    jax = sys.modules["jax"]
    return isinstance(value, jax.Array) and str(value.dtype) in ("float32", "float16", "bfloat16")
