"""AutoSparse's products under ``jax.jit``: the colors' products and their gather in one
compiled program of x's leaves and the contexts' values (diffiface._sparse_operators takes it
for a jit-compiling engine whose arrays are jax's, ``sparse/_<family>_products.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optree

from .. import _arrays, tree
from ._jax_matrices import _x64


class Products:
    """The compiled program of a sparse plan (``plan``: its x layout, coloring and decompression
    index), traced and compiled once here: ``out_structs`` is f's output structure (f's value's,
    for a Hessian), ``y_spec`` f's output tree structure (None for a Hessian)."""

    def __init__(self, plan: Any, f: Callable[..., Any], x: Any, contexts: tuple[Any, ...], with_value: bool) -> None:
        layout = plan.x_layout
        self.wide = "float64" in layout.dtypes or "float64" in {
            _arrays.dtype_name(leaf) for c in contexts for leaf in tree.leaves(c.value)
        }
        mode, hessian, count = plan.coloring.mode, plan.hessian, plan.count
        seeds_t = np.ascontiguousarray(np.asarray(plan.coloring.seeds).T)
        # the seeds of the forward products and of the reverse ones (a row coloring's: all reverse)
        forward_t = seeds_t[:0] if mode == "row" else seeds_t
        backward_t = seeds_t if mode == "row" else np.ascontiguousarray(np.asarray(plan.coloring.row_seeds).T)
        index = plan.stacked_index.astype(
            np.int32 if plan.stacked_index.size and plan.stacked_index.max() < 2**31 else np.int64
        )
        offsets, shapes, dtypes, spec = layout.offsets, layout.shapes, layout.dtypes, layout.spec
        y_info: list[Any] = []
        x_dtype = plan.flat_dtype

        def unflatten(flat: Any) -> Any:
            leaves = [
                jnp.reshape(flat[offsets[i] : offsets[i + 1]], shapes[i]).astype(dtypes[i]) for i in range(len(shapes))
            ]
            return optree.tree_unflatten(spec, leaves)

        def flat_output(flat: Any, values: tuple[Any, ...]) -> Any:
            y = f(unflatten(flat), *values)
            leaves, y_spec = tree.flatten(y)
            arrays = [jnp.asarray(leaf) for leaf in leaves]
            if not y_info:
                y_info.append(y_spec)
            if not arrays:
                return jnp.zeros((0,)), arrays
            common = np.result_type(*[a.dtype.name for a in arrays]).name  # cast explicitly: jax
            return jnp.concatenate([a.reshape(-1).astype(common) for a in arrays]), arrays  # may be strict

        def program(xs: tuple[Any, ...], values: tuple[Any, ...]) -> Any:
            flat = (
                jnp.concatenate([jnp.reshape(jnp.asarray(leaf), (-1,)).astype(x_dtype) for leaf in xs])
                if xs
                else jnp.zeros((0,))
            )
            seeds = jnp.asarray(seeds_t, dtype=flat.dtype)
            if hessian:

                def scalar(v: Any) -> Any:
                    out = f(unflatten(v), *values)
                    return jnp.reshape(jnp.asarray(out), ())

                (value, grad), linear = jax.linearize(jax.value_and_grad(scalar), flat)
                stacked = jax.vmap(lambda s: linear(s)[1])(seeds) if count else jnp.zeros((0,), flat.dtype)
                return value, grad, stacked.reshape(-1)[index]
            if mode in ("row", "bidirectional"):  # forward products for the columns, reverse for the rows
                (y_flat, y_leaves), pull = jax.vjp(lambda v: flat_output(v, values), flat)
                cotangent_leaves = [jnp.zeros_like(a) for a in y_leaves]
                forward = jnp.asarray(forward_t, dtype=flat.dtype)
                backward = jnp.asarray(backward_t, dtype=flat.dtype)
                pushed = (
                    jax.vmap(lambda s: jax.jvp(lambda v: flat_output(v, values)[0], (flat,), (s,))[1])(forward)
                    if forward.shape[0]
                    else jnp.zeros((0,), y_flat.dtype)
                )
                pulled = (
                    jax.vmap(lambda s: pull((s.astype(y_flat.dtype), cotangent_leaves))[0])(backward)
                    if backward.shape[0]
                    else jnp.zeros((0,), flat.dtype)
                )
                dtype = np.result_type(flat.dtype.name, y_flat.dtype.name).name
                both = jnp.concatenate([pushed.astype(dtype).reshape(-1), pulled.astype(dtype).reshape(-1)])
                return tuple(y_leaves), both[index]
            (y_flat, y_leaves), linear = jax.linearize(lambda v: flat_output(v, values), flat)
            stacked = jax.vmap(lambda s: linear(s)[0])(seeds) if count else jnp.zeros((0,), y_flat.dtype)
            dtype = np.result_type(flat.dtype.name, y_flat.dtype.name).name
            return tuple(y_leaves), stacked.astype(dtype).reshape(-1)[index]

        self.program = jax.jit(program)
        # one array x and no contexts: a program of that array alone, which jax calls without
        # taking a tree apart; for jacobian and hessian, one that returns the values alone
        self.single = len(layout.shapes) == 1 and not contexts and layout.kinds[0] != "python"
        self.values_only = self.single and not with_value
        self.flat: Any = None
        if self.single:
            self.flat = jax.jit(
                (lambda leaf: program((leaf,), ())[-1]) if self.values_only else (lambda leaf: program((leaf,), ()))
            )
        with _x64(self.wide):
            xs = tuple(tree.flatten(x)[0])
            values = tuple(c.value for c in contexts)
            structs = jax.eval_shape(program, xs, values)  # f's output structure, without compiling
            out = self.program(xs, values) if self.flat is None else self.flat(xs[0])  # traced, compiled
        del out
        self.out_structs = structs[0]
        self.y_spec = y_info[0] if y_info else None

    def __call__(self, x: Any, contexts: tuple[Any, ...]) -> Any:
        """The program's outputs at ``x`` and the contexts' values."""
        if not self.wide:  # (the common case, with no scope to enter)
            return self._call(x, contexts)
        with jax.enable_x64(True):
            return self._call(x, contexts)

    def _call(self, x: Any, contexts: tuple[Any, ...]) -> Any:
        if self.flat is not None:
            return self.flat(x)
        return self.program(tuple(tree.flatten(x)[0]), tuple(c.value for c in contexts))
