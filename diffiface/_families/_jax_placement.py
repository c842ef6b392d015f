"""Where a jax result lives: on x's devices, laid out as x (a sharded array's shards stay where
they are; nothing goes through the host).

jax decides a compiled program's output layout itself. Under a mesh with explicit axes
(``jax.make_mesh``'s default) a gradient comes out sharded as its input; under automatic axes
the compiler may choose otherwise (a gradient reduced over a data-sharded batch comes out
replicated along the data axis). The rules diffiface keeps, whatever jax chose:

- a result that mirrors x (a gradient, a vjp, an hvp) has x's sharding, leaf by leaf;
- a Jacobian or Hessian block ``d y_i / d x_j`` (shape ``y_i.shape + x_j.shape``) is sharded as
  ``x_j`` along its trailing dims and replicated along its leading dims: each row of it is laid
  out as a gradient with respect to ``x_j``.

A result already laid out so is returned as it is; else it is moved with ``jax.device_put``
between devices (an explicit device-to-device copy, never through the host).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np


def like_x(value: Any, like: Any) -> Any:
    """``value`` (a jax array shaped as the jax array ``like``) with ``like``'s sharding."""
    if _is_tracer(value) or _is_tracer(like):
        return value
    wanted = getattr(like, "sharding", None)
    found = getattr(value, "sharding", None)
    if wanted is None or found is None or found is wanted:
        return value
    if found == wanted or found.is_equivalent_to(wanted, len(value.shape)):
        return value
    return sys.modules["jax"].device_put(value, wanted)


def on_devices_of(value: Any, like: Any) -> Any:
    """A jax array shaped otherwise than x (f's output, from a numpy computation) on x's
    devices: on x's one device, or replicated over x's mesh."""
    if _is_tracer(value) or _is_tracer(like):
        return value
    jax = sys.modules["jax"]
    wanted = getattr(like, "sharding", None)
    if isinstance(wanted, jax.sharding.NamedSharding):
        wanted = jax.sharding.NamedSharding(wanted.mesh, jax.sharding.PartitionSpec())
    elif not isinstance(wanted, jax.sharding.SingleDeviceSharding):
        return value
    found = value.sharding
    if found == wanted or found.is_equivalent_to(wanted, len(value.shape)):
        return value
    return jax.device_put(value, wanted)


def block_like(value: Any, like: Any) -> Any:
    """A Jacobian or Hessian block (a jax array of shape ``(*lead, *like.shape)``) sharded as
    ``like`` along its trailing dims and replicated along the leading ones."""
    if _is_tracer(value) or _is_tracer(like):
        return value
    wanted = getattr(like, "sharding", None)
    found = getattr(value, "sharding", None)
    if wanted is None or found is None:
        return value
    jax = sys.modules["jax"]
    lead = len(value.shape) - len(like.shape)
    if lead < 0:
        return value
    if isinstance(wanted, jax.sharding.NamedSharding):
        spec = (*(None,) * lead, *_padded(wanted.spec, len(like.shape)))
        wanted = jax.sharding.NamedSharding(
            wanted.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=wanted.memory_kind
        )
    elif not isinstance(wanted, jax.sharding.SingleDeviceSharding):
        return value  # (another kind of layout: left as jax made it)
    if found == wanted or (found.is_equivalent_to(wanted, len(value.shape))):
        return value
    return jax.device_put(value, wanted)


def _padded(spec: Any, ndim: int) -> tuple[Any, ...]:
    entries = tuple(spec)
    return entries + (None,) * (ndim - len(entries))


def _is_tracer(value: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(value, jax.core.Tracer)


def pin(value: Any, layout: Any) -> Any:
    """Inside a compiled program: ``value`` laid out as ``layout`` (jax's ``reshard`` for a mesh
    with explicit axes, a sharding constraint otherwise)."""
    jax = sys.modules["jax"]
    mesh = getattr(layout, "mesh", None)
    if mesh is not None and any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(value, layout)
    return jax.lax.with_sharding_constraint(value, layout)


def on_mesh(layout: Any) -> Any:
    """The mesh of ``layout`` as jax's current mesh (compiled programs that make arrays with
    explicit-axis shardings need it); nothing for another layout."""
    jax = sys.modules["jax"]
    mesh = getattr(layout, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh):
        return jax.set_mesh(mesh)
    return contextlib.nullcontext()


# -- inside compiled programs: results laid out as x from the start ---------------------------------
#
# Under a mesh with automatic axes the compiler may lay a gradient out otherwise than x (say
# replicated, the whole model on every device), and moving it afterwards comes too late for
# memory. A program records, while jit traces it, which traced array stands for which concrete
# argument's layout; the engine's primitives then constrain their x-shaped results to it. A
# prep is made for one layout of its arguments (the sharding is part of the signature), so a
# trace's layouts hold for every later run of its program.


class _Layouts(threading.local):
    pending: tuple[Any, ...] | None = None
    by_tracer: dict[int, Any] | None = None


_layouts = _Layouts()
pending_layouts = _layouts
"""Where a compiled call notes its concrete arguments (``pending``) before it runs, read only if
it traces, and None after it."""


def laid_out(program: Callable[..., Any]) -> Callable[..., Any]:
    """``program`` (to be compiled by jax.jit) that knows its arguments' layouts while traced."""
    jax = sys.modules["jax"]

    @functools.wraps(program)
    def traced(*args: Any) -> Any:
        pending, _layouts.pending = _layouts.pending, None
        if pending is None:
            return program(*args)
        leaves = jax.tree_util.tree_leaves(args)
        concrete = jax.tree_util.tree_leaves(pending)
        if len(concrete) != len(leaves):
            return program(*args)
        before = _layouts.by_tracer
        _layouts.by_tracer = {
            id(t): c.sharding
            for t, c in zip(leaves, concrete, strict=True)
            if isinstance(c, jax.Array) and not isinstance(c, jax.core.Tracer)
        }
        try:
            return program(*args)
        finally:
            _layouts.by_tracer = before

    return traced


def laid_out_as(program: Callable[..., Any], layouts: tuple[Any, ...]) -> Callable[..., Any]:
    """``program`` on flat array arguments, laid out as ``layouts`` in every call (one sharding
    per argument, or None), to be compiled by jax.jit: it knows them while traced. Where no
    argument spans devices, ``program`` itself (nothing to constrain)."""
    if not any(layout is not None and len(layout.device_set) > 1 for layout in layouts):
        return program

    @functools.wraps(program)
    def traced(*args: Any) -> Any:
        before = _layouts.by_tracer
        _layouts.by_tracer = {id(arg): layout for arg, layout in zip(args, layouts, strict=False) if layout is not None}
        try:
            return program(*args)
        finally:
            _layouts.by_tracer = before

    return traced


def as_inputs(results: Any, xs: Any) -> Any:
    """x-shaped results (a gradient, a vjp) constrained to the layouts of the traced ``xs``,
    where this trace knows them; else as they are."""
    by_tracer = _layouts.by_tracer
    if not by_tracer:
        return results
    out = []
    for result, x in zip(results, xs, strict=True):
        layout = by_tracer.get(id(x))
        while layout is None and hasattr(x, "primal"):  # inside a forward-mode pass (an hvp)
            x = x.primal
            layout = by_tracer.get(id(x))
        out.append(result if layout is None or len(layout.device_set) < 2 else pin(result, layout))
    return type(results)(out) if isinstance(results, (tuple, list)) else out


class Layout:
    """A test that an array is laid out as ``sharding`` (a concrete jax array's), cheap on the hot
    path: jax shares one sharding object among the results of a compiled program and among the
    arrays it makes on one device, so the last equal object seen is kept and met by identity."""

    __slots__ = ("seen", "sharding")

    def __init__(self, sharding: Any) -> None:
        self.sharding = sharding
        self.seen = sharding

    def holds(self, value: Any) -> bool:
        found = value.sharding
        if found is self.seen or found is self.sharding:
            return True
        if found == self.sharding:
            self.seen = found  # (a benign race between threads: any equal object will do)
            return True
        return False


# -- tree.ravel of sharded leaves ---------------------------------------------------------------------


def laid_out_ravel(leaves: list[Any]) -> tuple[Any, Callable[[Any], list[Any]]] | None:
    """tree.ravel for jax leaves all sharded over one mesh of several devices (None otherwise):
    the flat vector is made on the mesh's devices, sharded along all its axes (replicated when
    its size does not divide), and the returned ``parts`` gives back each leaf with its
    sharding; nothing goes through the host."""
    mesh = _placed_on_one_mesh(leaves)
    if mesh is None:
        return None
    jax = sys.modules["jax"]
    jnp = sys.modules["jax.numpy"]
    wide = any(str(leaf.dtype) == "float64" for leaf in leaves)
    shapes = [tuple(leaf.shape) for leaf in leaves]
    dtypes = [leaf.dtype for leaf in leaves]
    shardings = [leaf.sharding for leaf in leaves]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    offsets = [int(o) for o in np.cumsum([0, *sizes])]
    total = offsets[-1]
    axes = tuple(mesh.axis_names)
    split = jax.sharding.PartitionSpec(axes) if total % mesh.devices.size == 0 else jax.sharding.PartitionSpec()
    flat_sharding = jax.sharding.NamedSharding(mesh, split)
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

    def program(body: Callable[[Any], Any], out: Any) -> Callable[[Any], Any]:
        if explicit:  # (reshapes across sharded dims are the compiler's to lay out)
            return jax.jit(lambda arg: jax.sharding.auto_axes(body, out_sharding=out)(arg))  # type: ignore[no-any-return]
        return jax.jit(body, out_shardings=out)  # type: ignore[no-any-return]

    def join(arrays: list[Any]) -> Any:
        return jnp.concatenate([a.reshape(-1) for a in arrays])

    def part(vector: Any) -> list[Any]:
        return [
            vector[offsets[i] : offsets[i + 1]].reshape(shape).astype(dtype)
            for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True))
        ]

    scope = jax.enable_x64(True) if wide else contextlib.nullcontext()
    with scope:  # jax makes float64 arrays only where x64 is on: on here, never globally
        flat = program(join, flat_sharding)(list(leaves))
    parts = program(part, shardings)

    def unravel(vector: Any) -> list[Any]:
        with jax.enable_x64(True) if wide else contextlib.nullcontext():
            return parts(vector)  # type: ignore[no-any-return]

    return flat, unravel


def _placed_on_one_mesh(leaves: list[Any]) -> Any:
    """The mesh of jax leaves that are all sharded over one mesh (not traced); else None."""
    jax = sys.modules["jax"]
    meshes = set()
    for leaf in leaves:
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            return None
        sharding = leaf.sharding
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return None
        meshes.add(sharding.mesh)
    return next(iter(meshes)) if len(meshes) == 1 and len(next(iter(meshes)).devices.flat) > 1 else None
