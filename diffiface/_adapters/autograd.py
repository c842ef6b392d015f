"""autograd (reverse mode on numpy), through ``autograd.core``'s trace.

autograd differentiates one array-valued output, so a pytree output is concatenated into one
vector for the pullback and split again afterwards. It has no forward mode: a jvp is the
pullback's own pullback, and the hvp is reverse-over-reverse (:func:`._base.hvp_of`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import autograd.numpy as anp
import numpy as np
from autograd.builtins import list as ag_list
from autograd.builtins import tuple as ag_tuple
from autograd.core import VJPNode, backward_pass, vspace
from autograd.tracer import Box, getval, isbox, new_box, trace_stack

from .. import _arrays
from .. import tree as _tree
from .._errors import DiffifaceError, InvalidOutputError, MutationError, UnsupportedOperationError
from . import _base
from ._base import Fn, Leaves

# What numpy and autograd say when f writes in place into a traced array (ArrayBox).
_WRITE = re.compile(
    r"'ArrayBox' object does not support item assignment"
    r"|out=\(<autograd\.numpy\.numpy_boxes\.ArrayBox"
    r"|'ArrayBox' object has no attribute '(fill|sort|put|itemset|resize|partition|setfield|byteswap)'"
    r"|argument 1 must be a numpy\.ndarray, not ArrayBox"
)

# How numpy and other libraries name autograd's traced array when they refuse it: its class
# quoted or its repr, never the bare word (which f's own message may hold)
_NAMES_A_BOX = re.compile(r"'ArrayBox'|ArrayBox with value|numpy_boxes\.ArrayBox|'ArrayVSpace'")

# What autograd says when f makes an integer of a traced value.
_INTEGER_BOX = re.compile(r"Can't differentiate w\.r\.t\. type <class 'numpy\.(u?int\d*|bool_?)'>")


def _make_vjp(fun: Callable[[Any], Any], x: Any) -> tuple[Callable[[Any], Any], Any]:
    """``autograd.core.make_vjp``: ``(vjp, fun(x))``, without autograd's warning where ``fun(x)``
    does not depend on x (whose derivative is zero, as its vjp gives), which autograd raises from
    its trace: a filter of it would change the caller's warnings, and be lost where they reset."""
    with trace_stack.new_trace() as trace:
        start = new_box(x, trace, VJPNode.new_root())
        end = fun(start)
    if isbox(end) and end._trace == start._trace:
        node = end._node
        return (lambda g: backward_pass(g, node)), end._value
    return (lambda g: vspace(x).zeros()), end


def _leaves_vjp(fun: Callable[[Leaves], Any], xs: Leaves) -> tuple[Callable[[Any], Any], Any]:
    """:func:`_make_vjp` of ``fun`` at the leaves ``xs``: ``vjp`` gives x's leaves, as a tuple
    (one array) or autograd's traced tuple (several). One array is traced as it is: no tuple
    container for autograd to box and rebuild."""
    xs = _plain(xs)
    if len(xs) == 1:
        vjp, end = _make_vjp(lambda x: fun((x,)), xs[0])
        return (lambda g: (vjp(g),)), end
    return _make_vjp(fun, xs)


def _refuse_an_opaque_pullback(vjp: Callable[[Any], Any], start_point: Any, failure: Exception | None = None) -> None:
    """A jvp differentiates the pullback ``u -> J.T u`` in ``u``. One autograd did not trace in
    ``u`` is either zero (f apart from x: its jvp is zero) or made of code autograd cannot see (a
    custom primitive's vjp in plain numpy or scipy), whose jvp would read as zero: refused. So
    is one that failed on the traced ``u`` (``failure``) but runs on an array."""
    probe = np.random.default_rng(0).standard_normal(np.shape(start_point)).astype(start_point.dtype)
    try:
        pulled = vjp(probe)
    except Exception:
        if failure is not None:
            return  # (the pullback fails on any cotangent: its own error says why)
        raise
    if failure is not None or any(np.any(np.asarray(getval(g)) != 0) for g in pulled):
        raise UnsupportedOperationError(
            "f's pullback is made of code autograd cannot differentiate (a custom primitive whose "
            "vjp computes with plain numpy or scipy on its cotangent), and autograd's jvp is the "
            "derivative of that pullback, which would read as zero or fail. Use di.jacobian "
            "(reverse passes only) and its product with the tangent, or AutoFiniteDifferences()."
        ) from failure


class Adapter(_base.Adapter):
    xp = anp

    def to_native(self, leaf: Any) -> Any:
        if type(leaf) is np.ndarray:
            return leaf
        if _arrays.kind(leaf) == "python":
            return np.asarray(leaf, dtype=np.complex128 if isinstance(leaf, complex) else np.float64)
        return leaf

    def context_to_native(self, leaf: Any, like: Any) -> tuple[Any, bool]:
        return leaf, isinstance(leaf, (np.ndarray, Box))  # a Box: traced by an enclosing autograd call

    def untracked(self, leaf: Any, xs: Leaves) -> bool:
        return not isinstance(leaf, Box) and any(isinstance(x, Box) for x in xs)

    def plain(self, leaf: Any) -> Any:
        return getval(leaf)

    def trace_value(self, leaf: Any, xs: Leaves) -> str | None:
        # (a box of this trace: not one of an enclosing autograd call's, which is its to take)
        if isinstance(leaf, Box) and any(isinstance(x, Box) and x._trace == leaf._trace for x in xs):
            return f"an autograd {type(leaf).__name__}"
        return None

    def output_leaf(self, leaf: Any, like: Any) -> Any:
        if _arrays.kind(leaf) == "python":
            return np.asarray(leaf, dtype=getattr(like, "dtype", np.float64))
        return leaf

    def rebuilder(self, x_spec: Any) -> Callable[[Any], Any] | None:
        """x with its tuples and lists as autograd's own traced containers, as
        ``autograd.grad`` hands them to f: a primitive that takes a container (np.append's
        values, odeint's args) then sees the container traced, where a plain list of traced
        arrays would be read as a constant. None where x has no such node."""
        count = x_spec.num_leaves
        example = x_spec.unflatten(list(range(count)))
        below = example.values() if type(example) is dict else example if isinstance(example, (tuple, list)) else ()
        if not any(_has_containers(item) for item in below):
            return None
        unflatten = x_spec.unflatten

        def rebuild(xs: Any) -> Any:
            return _traced_containers(unflatten([xs[i] for i in range(count)]))

        return rebuild

    def explain_failure(self, exc: BaseException) -> str | None:
        if isinstance(exc, DiffifaceError):  # from a diffiface call inside f: it says what is wrong
            return None
        # numpy often re-raises the TypeError about the ArrayBox as a ValueError of its own
        # ("setting an array element with a sequence"), so the whole chain is searched.
        chain: BaseException | None = exc
        text = ""
        for _ in range(8):
            if chain is None:
                break
            text += str(chain)
            chain = chain.__cause__ or chain.__context__
        if type(exc) is ValueError and str(exc).endswith("read-only"):
            # numpy's refusal to write into a read-only array: a Constant's, handed over read-only
            raise MutationError(
                f"f wrote into an array of a di.Constant (numpy: {exc!s}), which it must only read. "
                "Compute out of place (y = c * 2, not c *= 2), or pass scratch space as di.Cache(array)."
            ) from exc
        if _WRITE.search(text):
            # not a framework mismatch: f wrote in place into a traced array, which autograd
            # cannot differentiate. Raised from here (the caller is handling exc), so that the
            # error says what f did; the caller's arrays are untouched (the write failed).
            raise MutationError(
                "f writes in place into an array that autograd traces (x, or an array computed from "
                "it): an item assignment, an out= argument, or an in-place method. autograd "
                "differentiates only out-of-place code: write y = x * 2, not x *= 2 or x[0] = ..."
            ) from exc
        if _INTEGER_BOX.search(text):
            # autograd boxes an integer result of a traced value (astype(int) of a scalar) and
            # refuses it; where it boxes an integer array, the output check refuses it
            raise InvalidOutputError(
                "f turned a value autograd traces into integers (astype(int), np.round(...).astype(...)): "
                "an integer has no derivative. Compute the output in floating point."
            ) from exc
        if _NAMES_A_BOX.search(text):
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

        vjp, flat = _leaves_vjp(flat_fn, xs)
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
        and its own pullback along ``txs`` (a tuple where x has several leaves) is ``J txs``."""
        out, aux, vjp, flat = self._flat_pullback(fn, xs)
        traced = []

        def pullback(u: Any) -> Any:
            grads = vjp(u)
            if len(xs) == 1:
                traced.append(isbox(grads[0]))
                return grads[0]
            traced.append(isbox(grads))
            # several leaves: the tuple autograd's vjp gives (a container it traces), not
            # concatenated (a concatenation and its split cost more than f on small inputs)
            return grads if xs else anp.zeros(0)

        start_point = np.zeros(np.shape(getval(flat)), dtype=getval(flat).dtype)
        try:
            transpose, _ = _make_vjp(pullback, start_point)
        except DiffifaceError:
            raise
        except Exception as exc:  # (a pullback that refuses autograd's traced cotangent, or f's own error)
            _refuse_an_opaque_pullback(vjp, start_point, exc)
            raise
        if not traced[0] and xs:
            _refuse_an_opaque_pullback(vjp, start_point)
        # (the tangent as the pullback's input is laid out: one array, a tuple, or none)
        tangent = transpose(txs[0] if len(txs) == 1 else tuple(txs) if txs else np.zeros(0))
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

        vjp, value = _leaves_vjp(scalar_fn, xs)
        return value, _unboxed(captured[0]), tuple(vjp(_real_one(value)))


def _has_containers(tree: Any) -> bool:
    """Whether ``tree`` holds a tuple or list node (a dict's or named tuple's items included)."""
    cls = type(tree)
    if cls is tuple or cls is list:
        return True
    if cls is dict:
        return any(_has_containers(item) for item in tree.values())
    if isinstance(tree, tuple):  # a named tuple
        return any(_has_containers(item) for item in tree)
    return False


_NUMERIC = (Box, np.ndarray, np.generic, float, complex)


def _traced_containers(tree: Any) -> Any:
    """x with its tuples and lists below the root as autograd's containers (:func:`_convert`).
    The root stays a plain container: f takes x apart itself, and each read of an autograd
    container is a traced step, in the forward and the backward pass."""
    cls = type(tree)
    if cls is tuple or cls is list:
        return cls(_convert(item)[0] for item in tree)
    if cls is dict:
        return {key: _convert(item)[0] for key, item in tree.items()}
    return _convert(tree)[0]


def _convert(tree: Any) -> tuple[Any, bool]:
    """``(tree converted, whether autograd can hold it in its containers)``: ``tree``'s tuples
    and lists (numpy's array-likes) as autograd's containers, innermost first, where a node
    holds only arrays and such containers (autograd cannot box a named tuple, None or an
    object: a node holding one stays plain, and so do the nodes above it). Dicts stay plain:
    no numpy function takes one as an array, and autograd's dict costs a traced step per read."""
    if isinstance(tree, _NUMERIC):
        return tree, True
    cls = type(tree)
    if cls is tuple or cls is list:
        items = [_convert(item) for item in tree]
        values = [value for value, _ in items]
        if all(ok for _, ok in items):
            return (ag_tuple(tuple(values)) if cls is tuple else ag_list(values)), True
        return cls(values), False
    if cls is dict:
        return {key: _convert(item)[0] for key, item in tree.items()}, False
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return cls(*(_convert(item)[0] for item in tree)), False
    return tree, False


def _plain(xs: Leaves) -> Leaves:
    """``xs`` with numpy subclasses (``np.memmap``...), which autograd cannot differentiate
    with respect to, as plain ndarray views of the same data."""
    for x in xs:
        if type(x) is not np.ndarray and isinstance(x, np.ndarray):
            return tuple(x.view(np.ndarray) if isinstance(x, np.ndarray) else x for x in xs)
    return xs


def _real_one(value: Any) -> Any:
    """The cotangent 1 of a scalar output. Real also where a complex step evaluates f at complex
    points: autograd's pullback of a real 1 through an analytic f is then f's derivative at the
    complex point (its vector space's ``ones()`` would be 1 + 1j)."""
    space = vspace(value)
    if not space.iscomplex:
        return space.ones()
    return np.ones(space.shape, dtype=np.real(getval(value)).dtype)


def _unboxed(tree: Any) -> Any:
    """``tree`` without the boxes of the trace that has just ended. Boxes of an enclosing
    autograd computation (one that differentiates through this diffiface call) stay, so
    that it differentiates through the results."""
    if tree is None:
        return None
    strip = getval if trace_stack.top < 0 else _outer_part
    if type(tree) is tuple and len(tree) == 1 and _arrays.kind(tree[0]) in ("numpy", "autograd"):
        return (strip(tree[0]),)  # the common case of one output array
    return _tree.map(strip, tree)


def _outer_part(value: Any) -> Any:
    """``value`` unboxed down to the level of the enclosing traces (trace levels are depths:
    the trace that has just ended is deeper than ``trace_stack.top``)."""
    top = trace_stack.top
    while isinstance(value, Box) and value._trace > top:
        value = value._value
    return value
