"""g inside jax: five primitives that run f's engine through jax's host callbacks.

- ``call``: f(x);
- ``jvp``: J(x) t, linear in t, computed by ``di.jvp``; its transpose is ``vjp``;
- ``vjp``: J(x)ᵀ c, linear in c, computed by ``di.vjp``; its transpose is ``jvp``;
- ``second_jvp``: D²f(x)[t1, t2] and ``second_vjp``: Σₖ cₖ ∇²fₖ(x) v, the derivatives of the two
  above with respect to x, bilinear, each the transpose of the other in one argument; served only
  where the inner backend nests (second order), and differentiating them again is refused.

Each primitive has its shapes from g's prep (abstract evaluation), a host implementation (eager
and, through ``jax.pure_callback``, compiled), JVP and transpose rules, and a batching rule:
``jvp``/``vjp`` with only the linear argument batched run once on the whole batch (one Jacobian
and a contraction when that is cheaper), everything else loops over the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import _arrays
from ._inner import Site, beyond_second_order, check_nests, check_shape, traced_refusal

__all__ = ["call"]


def _primitive(name: str) -> Primitive:
    primitive = Primitive(f"diffiface_{name}")
    primitive.multiple_results = True
    return primitive


call_p = _primitive("call")
jvp_p = _primitive("jvp")
vjp_p = _primitive("vjp")
second_jvp_p = _primitive("second_jvp")
second_vjp_p = _primitive("second_vjp")


def call(g: Any, x: Any, leaves: list[Any], spec: Any, contexts: tuple[Any, ...]) -> Any:
    """g(x) for x of jax arrays."""
    leaves = [jnp.asarray(leaf) if _arrays.kind(leaf) == "python" else leaf for leaf in leaves]
    concrete = not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
    site = g.outer_site(spec, leaves, contexts, concrete)
    return site.plan.y_spec.unflatten(call_p.bind(*leaves, site=site, batch=0))


# --- shapes ---------------------------------------------------------------------------------------


def _out_avals(primitive: Primitive, site: Site, batch: int) -> list[jax.core.ShapedArray]:
    avals = site.plan.out_avals(_what(primitive), batch)
    return [jax.core.ShapedArray(a.shape, jax.dtypes.canonicalize_dtype(np.dtype(a.dtype))) for a in avals]


def _what(primitive: Primitive) -> str:
    """The product a primitive computes, as :meth:`~._inner.Inner.product` names it."""
    return primitive.name[len("diffiface_") :]


# --- host work -------------------------------------------------------------------------------------


def _host(primitive: Primitive, site: Site, batch: int, arrays: Sequence[Any]) -> list[Any]:
    """The primitive's result as inner leaves, from its operands (numpy or concrete jax arrays)."""
    try:
        return site.inner.product(_what(primitive), site.plan, list(arrays), site.contexts, batch, conjugate=True)
    except (jax.errors.TracerArrayConversionError, jax.errors.UnexpectedTracerError) as exc:
        raise traced_refusal("f reads a value that", "a jax tracer") from exc


def _eager(primitive: Primitive, *arrays: Any, site: Site, batch: int) -> list[Any]:
    outs = _host(primitive, site, batch, arrays)
    avals = _out_avals(primitive, site, batch)
    results = []
    for out, aval in zip(outs, avals, strict=True):
        family = _arrays.family_of(out)
        shared = None if family is None else family.exchange(out)  # (f returned a parameter: a copy)
        if shared is not None:  # an array of another framework, passed zero-copy on a shared device
            if _arrays.dtype_name(shared) != str(aval.dtype):
                shared = family.cast(shared, str(aval.dtype))  # type: ignore[union-attr]
            try:
                # (a copy: f may keep what it returned, a buffer or a Constant's tensor, and write
                # it again later, where a jax array never changes)
                array = jnp.array(jnp.from_dlpack(shared), copy=True)
            except (BufferError, RuntimeError, TypeError, ValueError):
                array = jnp.array(_arrays.to_numpy(shared))
        else:
            array = jnp.asarray(np.asarray(_arrays.to_numpy(out), dtype=aval.dtype))
        check_shape(primitive.name, aval.shape, tuple(array.shape))
        results.append(array)
    return results


def _lowered(primitive: Primitive, *args: Any, site: Site, batch: int) -> Any:
    avals = _out_avals(primitive, site, batch)

    def host(*arrays: Any) -> list[np.ndarray]:
        results = []
        for out, aval in zip(_host(primitive, site, batch, arrays), avals, strict=True):
            array = np.asarray(_arrays.to_numpy(out), dtype=aval.dtype)
            check_shape(primitive.name, aval.shape, array.shape)
            results.append(array)
        return results

    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]

    return jax.pure_callback(host, shapes, *args)


for _p in (call_p, jvp_p, vjp_p, second_jvp_p, second_vjp_p):
    _p.def_abstract_eval(lambda *_, site, batch, _p=_p: _out_avals(_p, site, batch))
    _p.def_impl(partial(_eager, _p))
    mlir.register_lowering(_p, mlir.lower_fun(partial(_lowered, _p), multiple_results=True))


# --- JVP rules ---------------------------------------------------------------------------------


def _instantiate(tangents: Sequence[Any]) -> list[Any]:
    return [ad.instantiate_zeros(t) for t in tangents]


def _all_zero(tangents: Sequence[Any]) -> bool:
    return all(type(t) is ad.Zero for t in tangents)


def _zeros_out(primitive: Primitive, site: Site, batch: int) -> list[Any]:
    return [ad.Zero(a.to_tangent_aval()) for a in _out_avals(primitive, site, batch)]


def _add(a: list[Any], b: list[Any]) -> list[Any]:
    return [p + q for p, q in zip(a, b, strict=True)]


def _call_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, site: Site, batch: int) -> Any:
    y = call_p.bind(*primals, site=site, batch=batch)
    if _all_zero(tangents):
        return y, _zeros_out(call_p, site, batch)
    return y, jvp_p.bind(*primals, *_instantiate(tangents), site=site, batch=0)


def _split(primitive: Primitive, site: Site, values: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """A primitive's operands: x's, then its linear ones (one group for jvp_p and vjp_p, two for
    the second products: t1, t2 for second_jvp_p, c, v for second_vjp_p)."""
    n = len(site.plan.x_avals)
    first = {second_jvp_p: n, second_vjp_p: len(site.plan.y_avals)}.get(primitive, len(values) - n)
    return list(values[:n]), list(values[n : n + first]), list(values[n + first :])


def _zeros(primitive: Primitive, site: Site, batch: int) -> list[Any]:
    return [jnp.zeros(a.shape, a.dtype) for a in _out_avals(primitive, site, batch)]


def _per_row(primitive: Primitive, x: list[Any], rows: list[Any], last: list[Any], site: Site, batch: int) -> list[Any]:
    """``primitive(x, rows[b], last)`` stacked over b: the second-order term of a batched product."""
    if not batch:
        return list(primitive.bind(*x, *rows, *last, site=site, batch=0))
    outs = [primitive.bind(*x, *[r[b] for r in rows], *last, site=site, batch=0) for b in range(batch)]
    return [jnp.stack([o[i] for o in outs]) for i in range(len(outs[0]))]


def _product_jvp(
    primitive: Primitive,
    second: Primitive,
    what: str,
    primals: Sequence[Any],
    tangents: Sequence[Any],
    *,
    site: Site,
    batch: int,
) -> Any:
    """The jvp rule of jvp_p and vjp_p, linear in their second argument: the product along that
    argument's tangent, plus ``second``'s term along x's."""
    x, v, _ = _split(primitive, site, primals)
    dx, dv, _ = _split(primitive, site, tangents)
    out = primitive.bind(*primals, site=site, batch=batch)
    if _all_zero(dx) and _all_zero(dv):
        return out, _zeros_out(primitive, site, batch)
    d_out = (
        list(primitive.bind(*x, *_instantiate(dv), site=site, batch=batch))
        if not _all_zero(dv)
        else _zeros(primitive, site, batch)
    )
    if not _all_zero(dx):
        check_nests(site, what)
        d_out = _add(d_out, _per_row(second, x, v, _instantiate(dx), site, batch))
    return out, d_out


def _bilinear_jvp(
    primitive: Primitive, primals: Sequence[Any], tangents: Sequence[Any], *, site: Site, batch: int
) -> Any:
    x, a, b = _split(primitive, site, primals)
    dx, da, db = _split(primitive, site, tangents)
    out = primitive.bind(*primals, site=site, batch=batch)
    if not _all_zero(dx):
        raise beyond_second_order(site.inner.backend)
    d_out = _zeros(primitive, site, batch)
    if not _all_zero(da):
        d_out = _add(d_out, list(primitive.bind(*x, *_instantiate(da), *b, site=site, batch=batch)))
    if not _all_zero(db):
        d_out = _add(d_out, list(primitive.bind(*x, *a, *_instantiate(db), site=site, batch=batch)))
    return out, d_out


ad.primitive_jvps[call_p] = _call_jvp
ad.primitive_jvps[jvp_p] = partial(_product_jvp, jvp_p, second_jvp_p, "jvp")
ad.primitive_jvps[vjp_p] = partial(_product_jvp, vjp_p, second_vjp_p, "gradient (vjp)")
ad.primitive_jvps[second_jvp_p] = partial(_bilinear_jvp, second_jvp_p)
ad.primitive_jvps[second_vjp_p] = partial(_bilinear_jvp, second_vjp_p)


# --- transposes -------------------------------------------------------------------------------------


def _undefined(values: Sequence[Any]) -> bool:
    return any(ad.is_undefined_primal(v) for v in values)


def _defined(values: Sequence[Any], primitive: str) -> list[Any]:
    if _undefined(values):
        raise TypeError(f"diffiface_{primitive} is not linear in x; jax asked to transpose it there.")
    return list(values)


def _cotangents(cts: Sequence[Any], primitive: Primitive, site: Site, batch: int) -> list[Any]:
    avals = _out_avals(primitive, site, batch)
    return [jnp.zeros(a.shape, a.dtype) if type(c) is ad.Zero else c for c, a in zip(cts, avals, strict=True)]


def _product_transpose(
    primitive: Primitive, transposed: Primitive, cts: Sequence[Any], *args: Any, site: Site, batch: int
) -> list[Any]:
    """jvp_p and vjp_p are each other's transpose in their second argument."""
    x = _defined(_split(primitive, site, args)[0], _what(primitive))
    if _all_zero(cts):
        return [None] * len(args)
    ct = _cotangents(cts, primitive, site, batch)
    return [None] * len(x) + list(transposed.bind(*x, *ct, site=site, batch=batch))


def _second_transpose(primitive: Primitive, cts: Sequence[Any], *args: Any, site: Site, batch: int) -> list[Any]:
    """second_jvp(x, t1, t2) (y-shaped) and second_vjp(x, c, v) (x-shaped), bilinear: with w the
    cotangent, second_jvp's transpose in t2 is second_vjp(x, w, t1), second_vjp's in v is
    second_vjp(x, c, w) (Hessians are symmetric) and in c is second_jvp(x, v, w)."""
    x, a, b = _split(primitive, site, args)
    x = _defined(x, primitive.name)
    if batch:
        raise beyond_second_order(site.inner.backend)
    if _all_zero(cts):
        return [None] * len(args)
    w = _cotangents(cts, primitive, site, batch)
    a_undefined, b_undefined = _undefined(a), _undefined(b)
    if a_undefined and b_undefined:
        raise TypeError(f"{primitive.name} is bilinear; jax asked to transpose it in both arguments at once.")
    if primitive is second_jvp_p:
        known = b if a_undefined else a
        result = list(second_vjp_p.bind(*x, *w, *known, site=site, batch=0))
    elif b_undefined:
        result = list(second_vjp_p.bind(*x, *a, *w, site=site, batch=0))
    else:
        result = list(second_jvp_p.bind(*x, *b, *w, site=site, batch=0))
    if a_undefined:
        return [None] * len(x) + result + [None] * len(b)
    return [None] * (len(x) + len(a)) + result


ad.primitive_transposes[jvp_p] = partial(_product_transpose, jvp_p, vjp_p)
ad.primitive_transposes[vjp_p] = partial(_product_transpose, vjp_p, jvp_p)
ad.primitive_transposes[second_jvp_p] = partial(_second_transpose, second_jvp_p)
ad.primitive_transposes[second_vjp_p] = partial(_second_transpose, second_vjp_p)


# --- batching ----------------------------------------------------------------------------------------


def _batch(primitive: Primitive, args: Sequence[Any], dims: Sequence[Any], *, site: Site, batch: int) -> Any:
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    if size == 0:  # no row to run: empty results of the shapes g's prep recorded
        empty = [jnp.zeros((0, *a.shape), a.dtype) for a in _out_avals(primitive, site, batch)]
        return empty, [0] * len(empty)
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
    n = len(site.plan.x_avals)
    x_batched = any(d is not None for d in dims[:n])
    if primitive in (jvp_p, vjp_p) and not x_batched and not batch:
        linear = [
            a if d is not None else jnp.broadcast_to(a, (size, *a.shape))
            for a, d in zip(moved[n:], dims[n:], strict=True)
        ]
        outs = primitive.bind(*moved[:n], *linear, site=site, batch=size)
        return outs, [0] * len(outs)
    rows = []
    for b in range(size):
        row = [a if d is None else a[b] for a, d in zip(moved, dims, strict=True)]
        rows.append(primitive.bind(*row, site=site, batch=batch))
    outs = [jnp.stack([r[i] for r in rows]) for i in range(len(rows[0]))]
    return outs, [0] * len(outs)


for _p in (call_p, jvp_p, vjp_p, second_jvp_p, second_vjp_p):
    batching.primitive_batchers[_p] = partial(_batch, _p)


def traced(leaf: Any) -> str | None:
    """A description of ``leaf`` where jax traces it (a tracer), else None."""
    if isinstance(leaf, jax.core.Tracer):
        return f"a jax tracer of shape {tuple(leaf.shape)}"
    return None
