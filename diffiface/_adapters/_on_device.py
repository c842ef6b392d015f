"""Finite differences on jax arrays that live on devices of their own (sharded over several, or
committed to one other than the default): every perturbed point is made on x's devices, with
x's sharding, and the differences are taken there; nothing goes through the host.

The steps are those of the numpy path (:mod:`.finite_differences`, per coordinate and along a
tangent). The arithmetic runs in small compiled programs (jax's eager arithmetic would send Python
constants from the host); a coordinate's index goes to the devices explicitly, a few bytes.
Only the first-order operators of a scalar ``f`` (gradient) and of any ``f`` along a tangent
(jvp, derivative) take this path; the others build matrices in numpy.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import InvalidOutputError
from .._families import _jax_placement as _placement
from ._base import Deferred, Fn, Leaves

_POWER = {"central": 1 / 3, "forward": 1 / 2, "backward": 1 / 2}


def applies(xs: Leaves, method: str, fixed_step: float | None, vectorize: bool) -> bool:
    """Whether x is all jax arrays placed away from the default device (sharded, or committed
    elsewhere), and the method is one this path takes."""
    jax = sys.modules.get("jax")
    if jax is None or not xs or method not in _POWER or fixed_step is not None or vectorize:
        return False
    if not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in xs):
        return False
    default = jax.devices()[0]
    return any(len(x.sharding.device_set) > 1 or x.sharding.device_set != {default} for x in xs)


@functools.cache
def _programs() -> Any:
    jax = sys.modules["jax"]
    jnp = sys.modules["jax.numpy"]

    # (each result is pinned to x's layout: the compiler would otherwise choose its own)
    pin = _placement.pin

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def steps(leaf: Any, power: float, layout: Any) -> Any:
        h = jnp.finfo(leaf.dtype).eps ** power * jnp.maximum(1, jnp.abs(leaf))
        return pin((leaf + h) - leaf, layout)  # exact: x + h is representable

    def mask(leaf: Any, index: Any, layout: Any) -> Any:
        # the coordinate as a mask laid out as x (a sharded dimension takes no dynamic index)
        return pin(jnp.arange(leaf.size).reshape(leaf.shape) == index, layout)

    @functools.partial(jax.jit, static_argnums=(3, 4))
    def bumped(leaf: Any, h: Any, index: Any, sign: int, layout: Any) -> Any:
        return pin(jnp.where(mask(leaf, index, layout), leaf + sign * h, leaf), layout)

    @functools.partial(jax.jit, static_argnums=(2, 3))
    def assemble(differences: Any, h: Any, divisor: int, layout: Any) -> Any:
        flat = jnp.stack([d.reshape(-1)[0] for d in differences]).astype(h.dtype)
        return pin(flat.reshape(h.shape) / (divisor * h), layout)

    @functools.partial(jax.jit)
    def subtract(a: Any, b: Any) -> Any:
        return a - b

    @functools.partial(jax.jit, static_argnums=2)
    def tangent_step(xs: Any, ts: Any, power: float) -> Any:
        # the numpy path's rule: s |t_i| <= eps**p * max(1, |x_i|) on every input t moves
        dtype = jnp.promote_types(jnp.result_type(*xs, *ts), jnp.float32)
        pairs = [(x, t) for x, t in zip(xs, ts, strict=True) if x.size]
        eps = [jnp.where(jnp.any(t != 0), jnp.finfo(x.dtype).eps, 0).astype(dtype) for x, t in pairs]
        ratio = [
            jnp.max(jnp.abs(t).astype(dtype) / jnp.where(jnp.isfinite(x), jnp.maximum(1, jnp.abs(x)), 1).astype(dtype))
            for x, t in pairs
        ]
        largest = jnp.max(jnp.stack(ratio or [jnp.zeros((), dtype)]))
        h = jnp.max(jnp.stack(eps or [jnp.zeros((), dtype)])) ** power / jnp.where(largest == 0, 1, largest)
        return h, largest == 0

    @functools.partial(jax.jit, static_argnums=(3, 4))
    def along(x: Any, t: Any, h: Any, sign: int, layout: Any) -> Any:
        return pin((x + (sign * h * t).astype(x.dtype)).astype(x.dtype), layout)

    @functools.partial(jax.jit, static_argnums=3)
    def quotient(a: Any, b: Any, h: Any, divisor: int, zero: Any) -> Any:
        return jnp.where(zero, jnp.zeros_like(a), (a - b) / (divisor * h).astype(a.dtype))

    @functools.partial(jax.jit)
    def all_finite(ts: Any) -> Any:
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(t)) for t in ts] or [jnp.bool_(True)]))

    return steps, bumped, assemble, subtract, tangent_step, along, quotient, all_finite


def finite(txs: Leaves) -> bool:
    """Whether every entry of the tangent is finite: one boolean comes back, by an explicit
    ``jax.device_get`` (a non-finite entry takes the numpy path, which gives ``J[:, i] * t_i``
    as forward mode would)."""
    *_, all_finite = _programs()
    return bool(sys.modules["jax"].device_get(all_finite(tuple(txs))))


def _index(i: int, like: Any) -> Any:
    """The coordinate ``i`` on ``like``'s devices, replicated (an explicit transfer of an int)."""
    jax = sys.modules["jax"]
    sharding = like.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.device_put(np.int32(i), sharding)


Run = Callable[[Fn, Leaves], tuple[Any, Any]]
"""How the engine evaluates f (``run(fn, leaves)``: its guard against writes into the inputs)."""


def value_and_gradient(fn: Fn, xs: Leaves, method: str, run: Run) -> tuple[Any, Any, Leaves]:
    evaluated = Deferred(lambda: run(fn, tuple(xs)))
    value = None
    if method != "central":
        value = _scalar(evaluated.force()[0])
    grads = []
    for k, leaf in enumerate(xs):
        with _placement.on_mesh(leaf.sharding):
            grads.append(_leaf_gradient(fn, xs, k, method, value, run))
    return Deferred(lambda: evaluated.force()[0]), Deferred(lambda: evaluated.force()[1]), tuple(grads)


def _leaf_gradient(fn: Fn, xs: Leaves, k: int, method: str, value: Any, run: Run) -> Any:
    steps, bumped, assemble, subtract, *_ = _programs()
    leaf = xs[k]
    layout = leaf.sharding
    h = steps(leaf, _POWER[method], layout)
    differences = []
    for i in range(math.prod(leaf.shape)):
        index = _index(i, leaf)

        def at(sign: int, index: Any = index) -> Any:
            moved = (*xs[:k], bumped(leaf, h, index, sign, layout), *xs[k + 1 :])
            return _scalar(run(fn, tuple(moved))[0])

        plus, minus, _ = ends(method, at, lambda: value)
        differences.append(subtract(plus, minus))
    # one program at the end: the differences (replicated numbers) divided by the steps, in x's
    # layout; no collective besides f's own
    return assemble(tuple(differences), h, 2 if method == "central" else 1, layout)


def value_and_pushforward(fn: Fn, xs: Leaves, txs: Leaves, method: str, run: Run) -> tuple[Any, Any, Any]:
    jax = sys.modules["jax"]
    *_, tangent_step, along, quotient, _ = _programs()
    h, zero = tangent_step(tuple(xs), tuple(txs), _POWER[method])
    evaluated = Deferred(lambda: run(fn, tuple(xs)))

    def at(sign: int) -> Any:
        moved = []
        for x, t in zip(xs, txs, strict=True):
            with _placement.on_mesh(x.sharding):
                moved.append(along(x, t, h, sign, x.sharding))
        return run(fn, tuple(moved))[0]

    plus, minus, divisor = ends(method, at, lambda: evaluated.force()[0])
    tout = jax.tree_util.tree_map(lambda a, b: quotient(a, b, h, divisor, zero), plus, minus)
    return Deferred(lambda: evaluated.force()[0]), Deferred(lambda: evaluated.force()[1]), tout


def ends(method: str, at: Callable[[int], Any], value: Callable[[], Any]) -> tuple[Any, Any, int]:
    """``(plus, minus, divisor)`` of a difference ``(plus - minus) / (divisor h)`` by ``method``
    (central, forward, backward), from ``at(sign)``, f at x moved by ``sign`` steps, and
    ``value()``, f at x, each called only where the method needs it."""
    if method == "central":
        return at(1), at(-1), 2
    if method == "forward":
        return at(1), value(), 1
    return value(), at(-1), 1


def _scalar(out: Any) -> Any:
    leaves = sys.modules["jax"].tree_util.tree_leaves(out)
    if len(leaves) != 1 or getattr(leaves[0], "size", 1) != 1:
        raise InvalidOutputError("a gradient needs f to return a scalar")
    return leaves[0]
