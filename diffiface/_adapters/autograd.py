"""autograd (reverse mode on numpy): ``autograd.make_vjp`` and ``autograd.value_and_grad``.

autograd differentiates one array-valued output, so a pytree output is concatenated into one
vector for the pullback and split again afterwards. It has no forward mode: jvp, jacobian
columns and the hvp are derived from the pullback (hvp reverse-over-reverse).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import autograd
import autograd.numpy as anp
import numpy as np
from autograd.core import make_vjp as _make_vjp
from autograd.core import vspace
from autograd.tracer import getval

from .. import _arrays
from .. import tree as _tree
from . import _base
from ._base import Fn, Leaves

# A function whose output does not depend on x is fine: its derivative is zero.
warnings.filterwarnings("ignore", message="Output seems independent of input", module="autograd")


class Adapter(_base.Adapter):
    xp = anp

    def to_native(self, leaf: Any) -> Any:
        if _arrays.kind(leaf) == "python":
            return np.asarray(leaf, dtype=np.float64)
        return leaf

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        return leaf, isinstance(leaf, np.ndarray)

    def output_leaf(self, leaf: Any, like: Any) -> Any:
        if _arrays.kind(leaf) == "python":
            return np.asarray(leaf, dtype=getattr(like, "dtype", np.float64))
        return leaf

    def explain_failure(self, exc: BaseException) -> str | None:
        # numpy often re-raises the TypeError about the ArrayBox as a ValueError of its own
        # ("setting an array element with a sequence"), so the whole chain is searched.
        chain: BaseException | None = exc
        text = ""
        for _ in range(8):
            if chain is None:
                break
            text += str(chain)
            chain = chain.__cause__ or chain.__context__
        if "ArrayBox" in text or "ArrayVSpace" in text:
            return (
                "f passed autograd's traced array (ArrayBox) to a function autograd does not know "
                "(torch, jax, or plain numpy imported as `numpy` instead of `autograd.numpy`). "
                "Write f with autograd.numpy, or use AutoFiniteDifferences()."
            )
        return None

    def _flat_pullback(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Any], Any]:
        """``(out, aux, vjp, flat)``: autograd differentiates one array, ``flat``: the output
        itself when it is one array, else its leaves concatenated into a vector; ``vjp`` takes
        a cotangent shaped as ``flat``."""
        captured: list[Any] = []

        def flat_fn(xs_: Leaves) -> Any:
            out, aux = fn(xs_)
            captured[:] = [out, aux]
            if not isinstance(out, tuple):
                return out
            if len(out) == 1:
                return out[0]
            return anp.concatenate([anp.reshape(y, (-1,)) for y in out]) if out else anp.zeros(0)

        if len(xs) == 1:  # one array: no tuple container for autograd to box and rebuild
            single_vjp, flat = _make_vjp(lambda x: flat_fn((x,)), xs[0])
            out, aux = captured
            return _unboxed(out), _unboxed(aux), lambda u: (single_vjp(u),), flat
        vjp, flat = autograd.make_vjp(flat_fn)(xs)
        out, aux = captured
        return _unboxed(out), _unboxed(aux), vjp, flat

    def pullback_function(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Callable[[Any], Leaves]]:
        out, aux, vjp, _ = self._flat_pullback(fn, xs)

        def pullback(touts: Any) -> Leaves:
            if isinstance(out, tuple):
                if len(out) == 1:
                    return tuple(vjp(touts[0]))
                touts = np.concatenate([np.reshape(t, -1) for t in touts]) if touts else np.zeros(0)
            return tuple(vjp(touts))

        return out, aux, pullback

    def value_and_pushforward(self, fn: Fn, xs: Leaves, txs: Leaves) -> tuple[Any, Any, Any]:
        """Forward mode from two reverse passes: the pullback ``u -> J.T u`` is linear in ``u``,
        and its own pullback along ``txs`` is ``J txs``."""
        out, aux, vjp, flat = self._flat_pullback(fn, xs)

        def pullback(u: Any) -> Any:  # one array out, so that autograd traces it
            grads = vjp(u)
            if len(xs) == 1:
                return grads[0]
            return anp.concatenate([anp.reshape(grads[i], (-1,)) for i in range(len(xs))]) if xs else anp.zeros(0)

        start_point = np.zeros(np.shape(getval(flat)), dtype=getval(flat).dtype)
        transpose, _ = _make_vjp(pullback, start_point)
        if len(txs) == 1:
            tangent = transpose(txs[0])
        else:
            tangent = transpose(np.concatenate([np.reshape(t, -1) for t in txs]) if txs else np.zeros(0))
        if not isinstance(out, tuple):
            return out, aux, tangent
        if len(out) == 1:
            return out, aux, (tangent,)
        pieces, start = [], 0
        for y in out:
            size = math.prod(np.shape(y))
            pieces.append(anp.reshape(tangent[start : start + size], np.shape(y)))
            start += size
        return out, aux, tuple(pieces)

    def value_and_gradient(self, fn: Fn, xs: Leaves) -> tuple[Any, Any, Leaves]:
        captured: list[Any] = []

        def scalar_fn(xs_: Leaves) -> Any:
            value, aux = fn(xs_)
            captured[:] = [aux]
            return value

        if len(xs) == 1:  # one array: no tuple container for autograd to box and rebuild
            vjp, value = _make_vjp(lambda x: scalar_fn((x,)), xs[0])
            grad = vjp(_real_one(value))
            aux = captured[0]
            return value, None if aux is None else _unboxed(aux), (grad,)
        vjp, value = autograd.make_vjp(scalar_fn)(xs)
        return value, _unboxed(captured[0]), tuple(vjp(_real_one(value)))

    def basis(self, like: Any, index: int) -> Any:
        flat = np.zeros(math.prod(np.shape(like)), dtype=getattr(getval(like), "dtype", np.float64))
        flat[index] = 1
        return flat.reshape(np.shape(like))


def _real_one(value: Any) -> Any:
    """The cotangent 1 of a scalar output. Real also where a complex step evaluates f at complex
    points: autograd's pullback of a real 1 through an analytic f is then f's derivative at the
    complex point (its vector space's ``ones()`` would be 1 + 1j)."""
    space = vspace(value)
    if not space.iscomplex:
        return space.ones()
    return np.ones(space.shape, dtype=np.real(getval(value)).dtype)


def _unboxed(tree: Any) -> Any:
    if tree is None:
        return None
    if type(tree) is tuple and len(tree) == 1 and _arrays.kind(tree[0]) in ("numpy", "autograd"):
        return (getval(tree[0]),)  # the common case of one output array
    return _tree.map(getval, tree)
