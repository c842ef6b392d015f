"""``differentiate_with(f, backend)``: f differentiated by its own engine inside another engine's
differentiation (jax inside torch, torch inside jax, a numpy black box inside either).

The outer side lives in one module per outer engine (``jax.py``: primitives; ``torch.py``:
autograd Functions and torch.library ops), imported the first time g meets that engine's arrays;
the inner side (``_inner.py``) reaches the inner engine only through diffiface's operators.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .. import _arrays, _families
from .. import tree as _tree
from .._adapters import normalize
from .._backends import Backend
from .._contexts import Context
from .._errors import ArrayTypeError, PreparationMismatchError
from ._inner import (
    Aval,
    Inner,
    Plan,
    Site,
    aval_of,
    check_contexts,
    closure_traced,
    constant_values,
    outer_traced,
    output_avals,
    probe_avals,
    to_inner,
    traced_refusal,
)

__all__ = ["DifferentiateWith", "differentiate_with"]

_SITES_KEPT = 8  # sites (one per set of contexts) a g keeps; older ones are rebuilt on use


class DifferentiateWith:
    """``f`` wrapped so that its own backend differentiates it wherever it is called: see
    :func:`differentiate_with`."""

    def __init__(self, f: Callable[..., Any], backend: Backend | str) -> None:
        if not callable(f):
            raise TypeError(f"differentiate_with takes a function first, got {type(f).__name__}.")
        self.f = f
        self.backend = normalize(backend)
        self._inner = Inner(f, self.backend)
        self._plan: Plan | None = None
        self._sites: OrderedDict[tuple[int, ...], Site] = OrderedDict()
        self._lock = threading.Lock()
        weakref.finalize(self, _release_all, self._sites)

    def __repr__(self) -> str:
        return f"differentiate_with({getattr(self.f, '__name__', self.f)!r}, {self.backend!r})"

    @property
    def plan(self) -> Plan | None:
        """What g's prep serves (x's structure, shapes and dtypes, and f(x)'s), once recorded."""
        return self._plan

    def __call__(self, x: Any, *contexts: Any) -> Any:
        contexts = check_contexts(contexts)
        leaves, spec = _tree.flatten(x)
        outer = _arrays.family({_arrays.kind(leaf) for leaf in leaves})
        if outer == self._inner.kind or _untraced(outer):
            return self._direct(x, leaves, spec, contexts, outer)
        bridge = _bridge(outer)
        if bridge is None:
            kinds = sorted({_arrays.kind(leaf) for leaf in leaves} - {"python"})
            raise ArrayTypeError(
                f"g takes jax arrays, torch tensors or numpy arrays (one kind in one x); x holds "
                f"{' and '.join(kinds) or 'no array'} leaves. Convert x to one of those kinds first."
            )
        for position, context in enumerate(contexts, start=2):
            found = outer_traced(context.value, bridge.traced)
            if found is not None:
                raise traced_refusal(f"g's argument {position}, a di.{type(context).__name__},", found)
        found = closure_traced(self.f, bridge.traced)
        if found is not None:
            raise traced_refusal(f"f ({getattr(self.f, '__qualname__', self.f)!r}) closes over a value that", found)
        return bridge.call(self, x, leaves, spec, contexts)

    # --- for the outer modules ------------------------------------------------------------------

    def outer_site(self, spec: Any, leaves: list[Any], contexts: tuple[Context[Any], ...], concrete: bool) -> Any:
        """:meth:`_site` for x of the outer engine's leaves; ``concrete``: they hold values (no outer
        trace sees them), so a first call records g's prep by evaluating f on them."""
        avals = tuple(aval_of(leaf) for leaf in leaves)
        x_inner = None
        if self._plan is None and concrete:
            with self._inner.family.dtype_scope([a.dtype for a in avals]):
                x_inner = [to_inner(leaf, self._inner.kind) for leaf in leaves]
        return self._site(spec, avals, contexts, x_inner)

    def _site(self, spec: Any, avals: tuple[Aval, ...], contexts: tuple[Context[Any], ...], x_inner: Any = None) -> Any:
        """The site serving these contexts, after checking x against g's prep (recorded by the first
        call: with ``x_inner``, concrete inner leaves, by evaluating f; else by probing)."""
        with self._lock:
            plan = self._plan
        if plan is None:
            plan = self._record(spec, avals, contexts, x_inner)
        else:
            self._check(plan, spec, avals)
        key = constant_values(contexts)
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                site = Site(self._inner, plan, contexts)
                self._sites[key] = site
                while len(self._sites) > _SITES_KEPT:
                    self._sites.popitem(last=False)[1].release()
            else:
                self._sites.move_to_end(key)
            return site

    def _record(self, spec: Any, avals: tuple[Aval, ...], contexts: tuple[Context[Any], ...], x_inner: Any) -> Plan:
        if x_inner is not None:
            with self._inner.family.dtype_scope([a.dtype for a in avals]):
                y_leaves, y_spec = _tree.flatten(self._inner.evaluate(spec, x_inner, contexts))
            y_avals = output_avals(y_leaves)
        else:
            y_spec, y_avals = probe_avals(self._inner, spec, avals, contexts)
        plan = Plan(spec, avals, y_spec, y_avals)
        with self._lock:
            if self._plan is None:
                self._plan = plan
            return self._plan

    def _check(self, plan: Plan, spec: Any, avals: tuple[Aval, ...]) -> None:
        if spec != plan.x_spec:
            raise PreparationMismatchError(
                f"g was prepared for x of structure {plan.x_spec} and got {spec}. One g serves one "
                "signature of x; build another with di.differentiate_with(f, backend) for this one."
            )
        for index, (got, want) in enumerate(zip(avals, plan.x_avals, strict=True)):
            if got != want:
                raise PreparationMismatchError(
                    f"g was prepared for x whose leaf {index} has shape {want.shape} and dtype {want.dtype}; "
                    f"it got shape {got.shape} and dtype {got.dtype}. One g serves one signature of x (under "
                    "jax.vmap and torch.func.vmap g is called per example, so batching needs no new g); "
                    "build another with di.differentiate_with(f, backend) for this one."
                )

    def _direct(self, x: Any, leaves: list[Any], spec: Any, contexts: tuple[Context[Any], ...], outer: str) -> Any:
        """x of the inner engine's own kind, or numpy: no outer engine to bridge; f runs as it is,
        on the inner engine's arrays, and numpy comes back for numpy."""
        avals = tuple(aval_of(leaf) for leaf in leaves)
        if outer == self._inner.kind:
            if self._plan is not None:
                self._check(self._plan, spec, avals)
            # (f's writes never reach the caller's arrays: torch's get clones, kept in the graph)
            family = self._inner.family
            x = spec.unflatten([family.private_copy(leaf) if family.owns(type(leaf)) else leaf for leaf in leaves])
            return self._inner.call(x, contexts)
        x_inner = [to_inner(leaf, self._inner.kind) if _arrays.kind(leaf) != "python" else leaf for leaf in leaves]
        site = self._site(spec, avals, contexts, x_inner)
        y = self._inner.value(site.plan, x_inner, contexts)
        return site.plan.y_spec.unflatten([_arrays.to_numpy(leaf) for leaf in y])


def _untraced(kind: str) -> bool:
    """Whether x of this kind is no engine's to trace (the host's arrays, Python numbers): f then
    runs on it directly, with no outer engine to bridge."""
    family = _arrays.BY_KIND.get(kind)
    return family is _families.HOST or (family is not None and not family.ARRAY and not family.PASSED_THROUGH)


_BRIDGES: dict[str, Any] = {}  # (not functools.cache: torch.compile traces g's call, and dynamo cannot trace one)


def _bridge(kind: str) -> Any:
    """The bridge of an outer engine whose arrays are of family ``kind``: the module of this
    package named as the family (``_bridges/<kind>.py``), imported the first time g meets its
    arrays; None where there is none (x is then refused, never passed unbridged)."""
    if kind not in _BRIDGES:
        name = f"{__name__}.{kind}"
        found = _arrays.BY_KIND.get(kind) is not None and importlib.util.find_spec(name) is not None
        _BRIDGES[kind] = importlib.import_module(name) if found else None
    return _BRIDGES[kind]


def _release_all(sites: OrderedDict[tuple[int, ...], Site]) -> None:
    for site in sites.values():
        site.release()


def differentiate_with(f: Callable[..., Any], backend: Backend | str) -> DifferentiateWith:
    """``f``, to be differentiated by ``backend`` wherever it is called, also inside another engine's
    differentiation.

    ``f(x, *context_values)`` is written for ``backend``'s engine (numpy for finite differences and
    scipy). The returned ``g`` is called with jax arrays, torch tensors or numpy arrays (one kind
    per x) and returns the same kind, in x's dtype where f keeps it:

    - inside jax, ``g`` is one jax primitive: ``jit``, ``grad``, ``jvp``, ``vjp``, ``jacfwd``,
      ``jacrev`` and ``vmap`` go through it; its derivatives are ``di.jvp`` and ``di.vjp`` of f,
      run through jax's host callbacks;
    - inside torch, ``g`` is an ``autograd.Function`` over ``torch.library`` ops: ``.backward()``,
      double backward, ``torch.func.jvp``, ``grad``, ``vmap`` and ``torch.compile`` (one opaque op).

    An x of f's own engine (or numpy with a numpy ``f``) crosses no engine: f is called as it is.

    Second derivatives work where ``backend`` nests (jax, torch, autograd); finite differences and
    scipy are first order only, and a second derivative through them is refused.

    The first call records g's prep: x's structure, shapes and dtypes, and f(x)'s (by evaluating f,
    or, when the outer engine is tracing, f at zeros of x's shapes, through ``jax.eval_shape`` for
    jax). A later x of another signature is refused with
    :class:`~diffiface.PreparationMismatchError`.

    Parameters
    ----------
    f:
        ``f(x, *context_values)``, written for ``backend``'s engine.
    backend:
        A first-order backend or its name; :class:`~diffiface.AutoSparse` of one too (batched
        products, as in ``jacfwd``, then take one sparse Jacobian).

    Returns
    -------
    DifferentiateWith
        ``g(x, *contexts)``: contexts are :class:`~diffiface.Constant` (or
        :class:`~diffiface.Cache`) and reach the operators as they are. A context, or a value that
        f closes over, that is an array the outer engine is tracing is refused: pass it as part of x.

    Examples
    --------
    >>> import numpy as np, diffiface as di
    >>> g = di.differentiate_with(lambda x: np.sin(x) * 2.0, "finite_differences")
    >>> g(np.zeros(2))
    array([0., 0.])
    """
    return DifferentiateWith(f, backend)
