"""The engine's helpers shared by the adapter's methods and the fused calls: fresh leaves of a graph,
backward passes that give zeros for unused inputs, results detached or not, f as torch.func takes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
import torch.autograd.forward_ad as _forward_ad

from ... import _arrays
from ... import tree as _tree
from ..._errors import InvalidOutputError
from .._base import Blocks, Fn, Leaves, refuse_a_moved_output
from ._dtensor import _cotangents, _placed
from ._explain import _autograd_in_func
from ._guard import _clone, _memory, _unwrapped, _version, _wrapped


def _tensor_aux(fn: Fn) -> tuple[Fn, Callable[[Any], Any]]:
    """``fn`` with an aux of tensors only, as torch.func requires, and the way back: the other
    aux leaves (None, numbers, strings) wait beside the transform."""
    kept: list[Any] = []

    def tensor_fn(xs: Leaves) -> tuple[Any, Any]:
        out, aux = fn(xs)
        if aux is None:  # the common case: no aux
            kept.clear()
            return out, ()
        # (optree's flattening, not diffiface's: the aux's own tree was taken apart by ``close``,
        # its foreign nodes adopted there; what is flattened here is that result, whose
        # structure is a leaf no framework registry need be asked about, nor can be in a trace)
        leaves, spec = optree.tree_flatten(aux, namespace=_tree.NAMESPACE)
        mask = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        kept[:] = [spec, mask, [leaf for leaf, m in zip(leaves, mask, strict=True) if not m]]
        return out, tuple(leaf for leaf, m in zip(leaves, mask, strict=True) if m)

    def rebuild(tensors: Any) -> Any:
        if not kept:
            return None
        spec, mask, others = kept
        tensor_iter, other_iter = iter(tensors), iter(others)
        return optree.tree_unflatten(spec, [next(tensor_iter) if m else next(other_iter) for m in mask])

    return tensor_fn, rebuild


def _on_one(fn: Fn) -> Callable[[Any], tuple[Any, Any]]:
    """``fn`` on one tensor instead of a tuple of one."""
    return lambda x: fn((x,))


def _jacobian_by(transformed: Callable[[Any, Any], Any], fn: Fn, xs: Leaves, check: bool) -> tuple[Any, Any, Blocks]:
    """``(out, aux, blocks)`` of ``fn`` from ``transformed(g, primal)``, torch.func's jacrev or
    jacfwd of ``g`` (f's output, one tensor bare, with ``(out, aux)`` as its aux) at ``primal``:
    one tensor where ``xs`` holds one (a block per output, no tuple of one per input). ``check``:
    :class:`_BatchedWrongly` where f's graph holds a node vmap batches wrongly."""
    tensor_fn, rebuild = _tensor_aux(fn)

    def with_value(xs_: Leaves) -> tuple[Any, Any]:
        out, aux = tensor_fn(xs_)
        if check and batched_wrongly(out):
            raise _BatchedWrongly
        one = type(out) is tuple and len(out) == 1  # one output tensor, differentiated bare
        return out[0] if one else out, (out, aux)

    if len(xs) == 1:
        jacobian, (out, aux) = transformed(_on_one(with_value), xs[0])
        if not isinstance(out, tuple):
            return out, rebuild(aux), (jacobian,)
        if len(out) == 1:
            return out, rebuild(aux), ((jacobian,),)
        return out, rebuild(aux), tuple((block,) for block in jacobian)
    jacobian, (out, aux) = transformed(with_value, xs)
    return out, rebuild(aux), (jacobian,) if isinstance(out, tuple) and len(out) == 1 else jacobian


def _for_func(fn: Fn, xs: Leaves) -> tuple[Callable[[Any], Any], bool, Callable[[Any], Any]]:
    """``fn`` as torch.func takes it, whether it has an aux, and the aux's way back.

    On one tensor where ``xs`` holds one (less pytree work for torch.func); without an aux
    where ``fn`` says it has none (``fn.has_aux``, set by diffiface's closed functions), else
    with an aux of tensors only, as torch.func requires."""
    if getattr(fn, "has_aux", True):
        target, rebuild = _tensor_aux(fn)
        return (_on_one(target) if len(xs) == 1 else target), True, rebuild

    def value_only(xs_: Leaves) -> Any:
        return fn(xs_)[0]

    return (_on_one(value_only) if len(xs) == 1 else value_only), False, _no_aux


def _no_aux(aux: Any) -> None:
    return None


def _bare_output(g: Callable[[Any], Any], has_aux: bool) -> tuple[Callable[[Any], Any], list[bool]]:
    """``g`` returning its one output tensor bare, not in a tuple of one (less pytree work for
    torch.func), and a list that holds True once it has (for the caller to wrap it back)."""
    bare: list[bool] = []

    def unwrapped(primal: Any) -> Any:
        result = g(primal)
        out = result[0] if has_aux else result
        if type(out) is not tuple or len(out) != 1:
            return result
        bare.append(True)
        return (out[0], result[1]) if has_aux else out[0]

    return unwrapped, bare


_BATCHED_WRONGLY = frozenset({"CdistBackward0"})
"""Autograd nodes whose backward torch.func.vmap batches to wrong numbers without an error
(torch's batching rule of ``_cdist_backward``: a Jacobian of ``torch.cdist`` by ``jacrev`` came
out wrong for p of 1, 1.5, 2, 3 and inf): a Jacobian's rows through one are taken one by one."""


def graph_nodes(out: Any) -> Iterator[Any]:
    """The nodes of the graph behind ``out`` (a tensor or a tuple of them), each once. Read
    where the graph is built (inside torch.func.vjp or jacrev, whose tensors show their
    ``grad_fn``)."""
    todo = [t.grad_fn for t in (out if type(out) is tuple else (out,)) if isinstance(t, torch.Tensor)]
    seen: set[Any] = set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        todo.extend(parent for parent, _ in node.next_functions)


def batched_wrongly(out: Any) -> bool:
    """Whether the graph behind ``out`` holds a node that torch.func.vmap batches wrongly."""
    return any(type(node).__name__ in _BATCHED_WRONGLY for node in graph_nodes(out))


class _BatchedWrongly(Exception):
    """Raised inside a vmapped transform whose graph holds a node in ``_BATCHED_WRONGLY``."""


def _noting_batched_wrongly(g: Callable[[Any], Any], has_aux: bool) -> tuple[Callable[[Any], Any], list[bool]]:
    """``g`` noting, in the list it comes with, whether its output's graph holds a node that
    torch.func.vmap batches wrongly (:func:`batched_wrongly`)."""
    wrongly = [False]

    def noted(primal: Any) -> Any:
        result = g(primal)
        wrongly[0] = batched_wrongly(result[0] if has_aux else result)
        return result

    return noted, wrongly


class _FuncPullback:
    """torch.func.vjp's pullback of f, on cotangents laid out as f's outputs, giving x's leaves;
    ``batchable``: whether torch.func.vmap may run a batch of cotangents through it at once."""

    __slots__ = ("batchable", "out", "pullback", "xs")

    def __init__(self, pullback: Callable[[Any], Any], out: Any, xs: Leaves, batchable: bool) -> None:
        self.pullback, self.out, self.xs, self.batchable = pullback, out, xs, batchable

    def __call__(self, touts: Any) -> Leaves:
        grads = self.pullback(_cotangents(self.out, touts))[0]
        return _placed((grads,) if len(self.xs) == 1 else grads, self.xs)


def _requiring_grad(xs: Leaves) -> Leaves:
    """Fresh leaves of the graph: the caller's tensors and their flags stay as they are.

    Where x carries an outer graph (a nested call), an alias of x in that graph, so that the
    outer differentiation sees through this one; where x is a dual tensor of an outer forward
    mode, an alias that keeps its tangent."""
    if len(xs) == 1 and not xs[0].requires_grad and _forward_ad._current_level < 0:  # the common case
        x = xs[0]
        try:
            return (x.detach().requires_grad_(True),)
        except RuntimeError as exc:  # a tensor of a torch.func transform (jvp, vmap)
            raise _autograd_in_func() from exc
    leaves = []
    for x in xs:
        if x.requires_grad and torch.is_grad_enabled():
            if _wrapped(x):
                raise _autograd_in_func()
            leaves.append(x.view_as(x))
            continue
        try:
            leaves.append((x.view_as(x) if _forward_ad._current_level >= 0 else x.detach()).requires_grad_(True))
        except RuntimeError as exc:
            raise _autograd_in_func() from exc
    return tuple(leaves)


def _if_graph(value: Any) -> list[Any]:
    """``[value]`` if it depends on the inputs, else ``[]`` (its derivative is zero)."""
    return [value] if value.requires_grad else []


def _backward(
    outs: Leaves, touts: Leaves, inputs: Leaves, keep: bool = False, unreached: Callable[[], None] | None = None
) -> Leaves:
    """A vjp's backward pass: the outputs that require grad with their cotangents, gradients
    for ``inputs`` (zeros where one does not matter), laid out as ``inputs``; ``keep``: the
    gradients keep their graph (a nested call); ``unreached``: as :func:`_grad`'s."""
    ys, ts = [], []
    for y, t in zip(outs, touts, strict=True):  # (a loop, not a comprehension: on every call)
        if y.requires_grad:
            ys.append(y)
            ts.append(t)
    grads = _grad(ys, inputs, ts, create_graph=keep, unreached=unreached)
    for g in grads:
        if type(g) is not torch.Tensor:
            return _placed(grads, inputs)
    return grads


def _grad(
    outputs: list[Any],
    inputs: Leaves,
    grad_outputs: list[Any] | None = None,
    create_graph: bool = False,
    retain: bool = True,
    unreached: Callable[[], None] | None = None,
) -> Leaves:
    """``torch.autograd.grad`` that gives zeros, never None, for inputs that do not matter.
    ``retain=False`` frees the graph: for the last backward pass through it. ``unreached`` is
    called where outputs that require grad reach no input (:func:`_refuse_hidden_cut`)."""
    if not outputs:
        return tuple(torch.zeros_like(x) for x in inputs)
    grads = torch.autograd.grad(
        outputs,
        inputs,
        grad_outputs=grad_outputs,
        retain_graph=retain or create_graph,
        create_graph=create_graph,
        allow_unused=True,
    )
    for g in grads:  # (a loop, not a generator: on every call; cheaper than materialize_grads=True)
        if g is None:
            if unreached is not None and all(g is None for g in grads):
                unreached()
            return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True))
    return grads  # type: ignore[no-any-return]


def _refuse_hidden_cut(fn: Fn, xs: Leaves) -> None:
    """Where f's output requires grad but no gradient reached x: the output requires grad
    through a tensor of another graph (a Constant, or a tensor f closes over, that requires
    grad), so whether it requires grad does not say x's graph leads to it. f is evaluated at x
    and at a point apart, grad mode off: refused where its output moves (f cut x's graph:
    ``torch.tensor(y.item())``), else the derivative is zero. Only where every gradient is None,
    so no call that reaches x pays for it. Refused first where that other graph holds x's own
    tensors (:func:`_refuse_a_read_of_x_itself`)."""
    points = tuple(x.detach() for x in xs)
    _refuse_a_read_of_x_itself(lambda: fn(points)[0], points)

    def value(move: float) -> list[Any]:
        with torch.no_grad():
            out, _ = fn(tuple(x + move * (1 + x.abs()) for x in points) if move else points)
            return [_arrays.by_kind(_arrays.kind(y)).values(y) for y in (out if type(out) is tuple else (out,))]

    refuse_a_moved_output(value, max(map(_arrays.resolution, points), default=0.0), "torch")


def _refuse_a_read_of_x_itself(at_x: Callable[[], Any], points: Leaves) -> None:
    """Refused: f's output requires grad through a tensor on the memory of one of x's leaves, a
    tensor f reads itself rather than through its argument (``model(data)`` where x is
    ``dict(model.named_parameters())``): x's derivative through that read would be zero, with
    no error. f is evaluated once more at x (``at_x()``, its output), and its output's graph
    walked to its leaves; a leaf that holds x's values bit for bit counts too (on a prep's first
    call f gets copies of x)."""
    memory = {_memory(x) for x in points if x.numel()} - {None}
    with torch.enable_grad():
        out = at_x()
    # (under torch.func, f's output and x as the tensors they wrap: the caller's graph holds the read)
    points = tuple(map(_unwrapped, points))
    for node in graph_nodes(tuple(map(_unwrapped, _tree.leaves(out)))):
        variable = getattr(node, "variable", None)  # (a leaf's AccumulateGrad)
        if isinstance(variable, torch.Tensor) and (_memory(variable) in memory or _holds_one(variable, points)):
            raise InvalidOutputError(
                "f reads the tensors of x itself (a module's parameters it calls, model(data), where x is "
                "dict(model.named_parameters())), not only the leaves it is given for them: diffiface "
                "differentiates those leaves, so the derivative through that read would be zero. Compute with "
                "f's argument: torch.func.functional_call(model, params, (data,))."
            )


def _holds_one(tensor: Any, points: Leaves) -> bool:
    """Whether ``tensor`` holds one of ``points``' values bit for bit (shape, dtype and values)."""
    with torch.no_grad():
        return any(
            x.shape == tensor.shape and x.dtype == tensor.dtype and x.device == tensor.device and torch.equal(x, tensor)
            for x in points
        )


def _whole(grads: Leaves, inputs: Leaves) -> Leaves:
    """``torch.autograd.grad``'s gradients (``allow_unused=True``) as diffiface returns them:
    zeros where an input did not matter, :func:`_placed`, :func:`_materialised`."""
    for found in grads:  # (loops, not comprehensions: this runs on every call)
        if found is None:
            grads = tuple(torch.zeros_like(x) if d is None else d for d, x in zip(grads, inputs, strict=True))
            break
    for found in grads:
        if type(found) is not torch.Tensor:  # a DTensor
            grads = _placed(grads, inputs)
            break
    for found in grads:
        if found._is_zerotensor():
            return _materialised(grads)
    return grads


def _materialised(grads: Leaves) -> Leaves:
    """Gradients as ordinary tensors: torch answers an f whose derivative is zero by rule
    (``sgn``, ``sign``) with a ZeroTensor, which ``.numpy()`` and in-place updates refuse. A
    compiled graph gives ordinary tensors (and torch.compile traces no test of a ZeroTensor).
    Added to ordinary zeros, a ZeroTensor keeps the graph it carries (torch.func's results do)."""
    if torch.compiler.is_compiling():
        return grads
    for g in grads:  # (a loop first: no generator where there is none, the common case)
        if g._is_zerotensor():
            return tuple(
                torch.zeros(g.shape, dtype=g.dtype, device=g.device) + g if g._is_zerotensor() else g for g in grads
            )
    return grads


def _stacked(entries: list[Any], shape: tuple[int, ...], like: Any) -> Any:
    return torch.stack(entries).reshape(shape) if entries else torch.zeros(shape, dtype=like.dtype, device=like.device)


def _detached(tree: Any, keep: bool) -> Any:
    """``tree`` out of the graph, unless the call keeps it (its inputs carried one)."""
    if tree is None or keep:
        return tree
    if isinstance(tree, torch.Tensor):
        return tree.detach()
    if type(tree) is tuple:  # the common case: a tuple of output tensors
        for leaf in tree:
            if type(leaf) is not torch.Tensor:
                break
        else:
            return tuple(map(torch.Tensor.detach, tree))
    return _tree.map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, tree)


class _NoSecondPass(Exception):
    """torch cannot differentiate a pullback of f (an operation without a double backward)."""


def _pushed_by_pullbacks(
    out: Leaves, leaves: Leaves, ts: Leaves, inputs: Leaves, versions: list[int]
) -> tuple[Leaves, Leaves]:
    """A jvp's primals and products by reverse over reverse, as ``torch.autograd.functional.jvp``
    computes it: ``out``, f's output leaves on ``leaves`` (leaves of a fresh graph), pulled back
    along cotangents of ones that require grad (linear in them: any point serves, and at zero a
    backward pass that takes the log of its cotangent's parts, logcumsumexp's, reads NaN), and
    that pullback's own along copies of the tangents ``ts`` (a product the graphs pass through
    unchanged would be the caller's tangent itself). An output leaf the graph does not reach has
    a zero product, as in forward mode. :class:`_NoSecondPass` where a zero product could be
    wrong: torch cannot differentiate the pullback, a pullback comes out without a graph (a
    piecewise constant operation's), or the pullbacks' graph does not reach a cotangent (a
    ``once_differentiable`` backward; an output traced through a Constant that requires grad).
    A failure after f wrote into ``inputs`` (their ``versions`` moved) is raised as it is: the
    guard refuses the write."""
    tracked, ones = [], []
    for y in out:  # (loops, not comprehensions: no frame of their own on every call)
        if isinstance(y, torch.Tensor) and y.requires_grad:
            tracked.append(y)
            ones.append(torch.ones_like(y, requires_grad=True))
    products: Leaves = ()
    if tracked:
        try:
            pulled = torch.autograd.grad(tracked, leaves, ones, create_graph=True, allow_unused=True)
            linear, along = [], []
            for g, t in zip(pulled, ts, strict=True):
                if g is not None:
                    # (a pullback without a graph: a zero product from it could be wrong)
                    if not g.requires_grad:
                        raise _NoSecondPass
                    linear.append(g)
                    along.append(_clone(t))
            if linear:  # (every cotangent reached, or torch raises: a pullback's graph is cut)
                products = torch.autograd.grad(linear, ones, along)
        except RuntimeError as exc:
            if list(map(_version, inputs)) != versions:  # f wrote into x: the guard says so
                raise
            raise _NoSecondPass from exc
    found = iter(products)
    primals, outs = [], []
    for y in out:  # (a loop: on every call)
        if isinstance(y, torch.Tensor):
            product = next(found, None) if y.requires_grad else None
            primals.append(y.detach())
            outs.append(torch.zeros_like(y) if product is None else product)
        else:
            primals.append(y)
            outs.append(y)
    return tuple(primals), tuple(outs)
