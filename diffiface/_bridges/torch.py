"""g inside torch: autograd Functions over one ``torch.library`` op.

- ``_Call``: f(x); backward through ``_Vjp``, forward mode (``jvp``) through ``_Jvp``;
- ``_Jvp``: J(x) t and ``_Vjp``: J(x)ᵀ c, each the other's backward in its linear argument, so
  that double backward and forward-over-reverse work; their derivatives in x are the second
  products (``_Second``), served where the inner backend nests and refused as first order only
  elsewhere; differentiating ``_Second`` again is refused (third order).

Every Function has ``setup_context`` (torch.func needs it) and a ``vmap`` rule (one product per
example). The engine's work runs inside the op ``diffiface::bridge``, registered with a fake
implementation from g's prep, so that ``torch.compile`` keeps each call as one opaque op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import _arrays
from .. import tree as _tree
from .._errors import DiffifaceError
from ._inner import Aval, Site, beyond_second_order, check_nests, check_shape, to_inner, traced_refusal

__all__ = ["call"]


def call(g: Any, x: Any, leaves: list[Any], spec: Any, contexts: tuple[Any, ...]) -> Any:
    """g(x) for x of torch tensors."""
    leaves = [torch.as_tensor(leaf) if _arrays.kind(leaf) == "python" else leaf for leaf in leaves]
    # (torch.compile traces optree with a structure of its own, which compares unequal to
    # optree's and cannot rebuild every tree outside the trace: x's is then taken outside it)
    compiling = torch.compiler.is_compiling()
    site = _prepare(g, leaves, x if compiling else spec, contexts, compiling)
    # dynamo cannot trace a Function with a jvp rule; compiled programs take the one without
    function = _CallCompiled if compiling else _Call
    return _rebuild(site, function.apply(site.number, *leaves))


@torch.compiler.disable  # type: ignore[misc, untyped-decorator]
def _rebuild(site: Site, outs: Sequence[torch.Tensor]) -> Any:
    return site.plan.y_spec.unflatten(list(outs))


@torch.compiler.disable  # type: ignore[misc, untyped-decorator]
def _prepare(g: Any, leaves: list[torch.Tensor], spec: Any, contexts: tuple[Any, ...], traced: bool) -> Site:
    """g's prep and site, outside torch.compile's graph (it evaluates f on the inner engine).
    ``traced``: ``spec`` is x itself, whose structure is taken here."""
    if traced:
        spec = _tree.flatten(spec)[1]
    # under torch.func's transforms the leaves are wrappers with no data of their own: g's prep
    # then comes from f at zeros, as under jax's tracing
    wrapped = any(torch._C._functorch.is_functorch_wrapped_tensor(leaf) for leaf in leaves)
    return g.outer_site(spec, leaves, contexts, concrete=not wrapped)  # type: ignore[no-any-return]


# --- the op ---------------------------------------------------------------------------------------


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # type: ignore[no-any-return]


def _site(number: int) -> Site:
    site = Site.registry.get(number)
    if site is None:
        raise DiffifaceError(
            f"diffiface::bridge was called for site {number}, which no g holds any more: a torch.compile'd "
            "program outlived the g it was traced with. Compile again with the g you call."
        )
    return site


@torch.library.custom_op("diffiface::bridge", mutates_args=())
def _bridge(what: str, site_name: str, batch: int, args: list[torch.Tensor]) -> list[torch.Tensor]:
    site = _site(int(site_name))
    device = args[0].device if args else torch.device("cpu")
    with site.inner.family.dtype_scope([_arrays.dtype_name(a) for a in args]), _autograd_on():
        try:
            outs = site.inner.product(what, site.plan, list(args), site.contexts, batch, conjugate=False)
        except TypeError as exc:
            if "Tensor" in str(exc) and "requires grad" in str(exc):
                raise traced_refusal("f reads a value that", "a torch tensor that requires grad") from exc
            raise
        results = [
            _to_torch(what, out, aval, device) for out, aval in zip(outs, site.plan.out_avals(what, batch), strict=True)
        ]
    inputs = {a.untyped_storage().data_ptr() for a in args if a.numel()}
    # an op's results may not share memory with its inputs (f returned its input, or a view of it)
    return [r.clone() if r.numel() and r.untyped_storage().data_ptr() in inputs else r for r in results]


@contextlib.contextmanager
def _autograd_on() -> Iterator[None]:
    """torch's autograd as plain Python code has it. An op's implementation runs below torch's
    autograd (its dispatch keys excluded, grad mode off), so a torch f that the inner engine
    reaches in turn (torch -> jax -> torch through two g's) would record no graph: its
    derivatives would read as cut. The inner work records its own graph, on its own tensors;
    what it returns to the op is detached (_to_torch)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    restored = excluded.remove(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), restored), torch.enable_grad():
        yield


def _to_torch(what: str, out: Any, aval: Aval, device: torch.device) -> torch.Tensor:
    """An inner result as a detached tensor of the prep's dtype on ``device`` (zero-copy from
    another framework's array where dlpack can share it; a copy of a black box's buffer, which it
    may write again on its next call)."""
    tensor = to_inner(out, "torch").to(device=device, dtype=_torch_dtype(aval.dtype))
    check_shape(what, aval.shape, tuple(tensor.shape))
    return tensor  # type: ignore[no-any-return]


@_bridge.register_fake
def _bridge_fake(what: str, site_name: str, batch: int, args: list[torch.Tensor]) -> list[torch.Tensor]:
    site = _site(int(site_name))
    device = args[0].device if args else torch.device("cpu")
    return [torch.empty(a.shape, dtype=_torch_dtype(a.dtype), device=device) for a in site.plan.out_avals(what, batch)]


def _op(what: str, number: int, args: Sequence[torch.Tensor], batch: int = 0) -> tuple[torch.Tensor, ...]:
    # the site goes as a string: torch.compile keeps strings constant (and guards on them), where
    # an int that changes between calls would become a symbolic one
    return tuple(torch.ops.diffiface.bridge(what, str(number), batch, list(args)))


# --- the Functions -------------------------------------------------------------------------------


def _device(tensors: Sequence[Any]) -> torch.device | None:
    return next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)


def _zeros(avals: Sequence[Aval], device: torch.device | None, batch: tuple[int, ...] = ()) -> list[torch.Tensor]:
    return [torch.zeros((*batch, *a.shape), dtype=_torch_dtype(a.dtype), device=device) for a in avals]


def _filled(values: Sequence[Any], avals: Sequence[Aval], saved: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients or tangents torch passes, with zeros where it passes None."""
    device = _device(saved)
    return [
        v if v is not None else torch.zeros(a.shape, dtype=_torch_dtype(a.dtype), device=device)
        for v, a in zip(values, avals, strict=True)
    ]


def _saved(ctx: Any) -> tuple[Site, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The site of a Function's call, and the x and linear operands it saved."""
    site = _site(ctx.number)
    saved = ctx.saved_tensors
    n = len(site.plan.x_avals)
    return site, saved[:n], saved[n:]


def _sum(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(p + q for p, q in zip(a, b, strict=True))


class _Looped(torch.autograd.Function):
    """A Function whose vmap rule runs it once per example."""

    generate_vmap_rule = False

    @classmethod
    def vmap(cls, info: Any, in_dims: Sequence[Any], *args: Any) -> Any:  # type: ignore[override]
        if info.batch_size == 0:  # no row to run: empty results of the shapes g's prep recorded
            what = args[1] if cls is _Second else _PRODUCT[cls]
            empty = tuple(_zeros(_site(args[0]).plan.out_avals(what), _device(args), (0,)))
            return empty, (0,) * len(empty)
        outs = []
        for b in range(info.batch_size):
            row = [a if d is None else a.select(d, b) for a, d in zip(args, in_dims, strict=True)]
            outs.append(cls.apply(*row))
        stacked = tuple(torch.stack([o[i] for o in outs]) for i in range(len(outs[0])))
        return stacked, (0,) * len(stacked)


class _Saving(_Looped):
    """A Function of the site's number and tensors, which it saves for its backward and jvp."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.number = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.save_for_forward(*inputs[1:])


class _CallCompiled(_Saving):
    """f(x) with reverse mode and vmap: the form torch.compile traces, one op forward and one op
    backward (dynamo traces neither a jvp rule nor a Function inside a backward)."""

    @staticmethod
    def forward(number: int, *x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return _op("call", number, x)

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        site, x, _ = _saved(ctx)
        ct = _filled(cotangents, site.plan.y_avals, x)
        return (None, *_op("vjp", ctx.number, (*x, *ct)))  # one op: compiled backward is not differentiated


class _Call(_CallCompiled):
    """f(x) with forward mode, and a backward that is differentiable again (through _Vjp)."""

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        site, x, _ = _saved(ctx)
        return (None, *_Vjp.apply(site.number, *x, *_filled(cotangents, site.plan.y_avals, x)))

    @staticmethod
    def jvp(ctx: Any, _number_tangent: Any, *tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        site, x, _ = _saved(ctx)
        return _Jvp.apply(site.number, *x, *_filled(tangents, site.plan.x_avals, x))  # type: ignore[no-any-return]


def _product(what: str, action: str) -> Any:
    """The Function of g's ``what`` ("jvp": J(x) t, "vjp": J(x)ᵀ c), linear in its second
    argument: its backward there is the other product; in x, the second product (where the
    engine nests). ``action`` names it in the refusal where the engine does not nest."""
    jvp = what == "jvp"

    class Product(_Saving):
        @staticmethod
        def forward(number: int, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
            return _op(what, number, args)

        @staticmethod
        def backward(ctx: Any, *cotangents: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
            site, x, v = _saved(ctx)
            plan, n = site.plan, len(x)
            w = _filled(cotangents, plan.y_avals if jvp else plan.x_avals, x)
            grad_x: tuple[Any, ...] = (None,) * n
            if any(ctx.needs_input_grad[1 : 1 + n]):
                check_nests(site, action)
                # second_vjp(x, c, v): c y-shaped, v x-shaped
                grad_x = _Second.apply(site.number, "second_vjp", *x, *((*w, *v) if jvp else (*v, *w)))
            transposed = _Vjp if jvp else _Jvp
            grad_v = transposed.apply(site.number, *x, *w) if any(ctx.needs_input_grad[1 + n :]) else (None,) * len(v)
            return (None, *grad_x, *grad_v)

        @staticmethod
        def jvp(ctx: Any, _number_tangent: Any, *tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
            site, x, v = _saved(ctx)
            plan, n = site.plan, len(x)
            dx, dv = tangents[:n], tangents[n:]
            out = Product.apply(site.number, *x, *_filled(dv, plan.x_avals if jvp else plan.y_avals, x))
            if any(d is not None for d in dx):
                check_nests(site, action)
                second = _Second.apply(site.number, f"second_{what}", *x, *v, *_filled(dx, plan.x_avals, x))
                out = _sum(out, second)
            return out  # type: ignore[no-any-return]

    Product.__name__ = Product.__qualname__ = f"_{what.capitalize()}"
    return Product


_Jvp = _product("jvp", "jvp")
_Vjp = _product("vjp", "gradient")


class _Second(_Looped):
    """D²f(x)[t1, t2] (``second_jvp``) or Σₖ cₖ ∇²fₖ(x) v (``second_vjp``); not differentiated again."""

    @staticmethod
    def forward(number: int, what: str, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return _op(what, number, args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.number = inputs[0]

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        raise beyond_second_order(_site(ctx.number).inner.backend)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise beyond_second_order(_site(ctx.number).inner.backend)


_PRODUCT = {_CallCompiled: "call", _Call: "call", _Jvp: "jvp", _Vjp: "vjp"}
"""What each Function computes, as the op names it (_Second names its own)."""


def traced(leaf: Any) -> str | None:
    """A description of ``leaf`` where torch traces it (a tensor that requires grad, or one of
    torch.func's wrappers), else None."""
    if isinstance(leaf, torch.Tensor):
        if leaf.requires_grad:
            return f"a torch tensor of shape {tuple(leaf.shape)} that requires grad"
        if torch._C._functorch.is_functorch_wrapped_tensor(leaf):
            return f"a tensor of shape {tuple(leaf.shape)} traced by torch.func"
    return None
