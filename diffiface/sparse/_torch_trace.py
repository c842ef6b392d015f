"""Global sparsity detection for torch-written functions: ``f`` run once under a dispatch mode
that sees each aten operation (after ``functionalize`` has turned in-place writes and views into
operations that make new tensors), with x and the contexts' tensors as handles without values (so
the pattern holds for every value of them), and index sets (``_index_sets``) carried through each
operation as it runs.

Rules: operations tagged ``torch.Tag.pointwise`` unite their operands' sets (broadcast);
operations that only move elements (views, slices, indexing with known indices, cat, stack, roll,
pad, scatter of known indices) are run by torch itself on tensors of positions; reductions,
cumulative operations, softmax and sort unite along their dimensions; mm, mv, bmm, addmm and dot
read the zeros of a constant operand; convolution, transposed or not, reads the zeros of a constant
kernel. Any other operation is dense (``sets.Trace.dense``). Tensors ``f`` closes over are
constants: their values count, but for those that require grad (a model's parameters).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _arrays, tree
from .._errors import InvalidOutputError, UnsupportedOperationError
from .._keys import held_arrays
from . import _index_sets as sets
from ._graphs import Detection, first_line, leaf_function

__all__ = ["Detection", "trace_pattern"]


_MOVES = {
    "view", "_unsafe_view", "reshape", "slice", "select", "index", "index_select", "gather", "roll", "flip",
    "permute", "transpose", "t", "expand", "unsqueeze", "squeeze", "cat", "stack", "alias", "narrow",
    "diagonal", "unfold", "repeat", "constant_pad_nd", "split", "split_with_sizes", "unbind", "chunk",
    "expand_copy", "view_copy", "slice_copy", "select_copy", "permute_copy", "transpose_copy", "t_copy",
    "copy", "tril", "triu", "index_put", "select_scatter", "slice_scatter", "diagonal_scatter",
    "masked_fill", "movedim", "flatten", "unflatten", "lift_fresh_copy", "take", "take_along_dim",
    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d", "circular_pad1d",
    "repeat_interleave", "rot90", "where", "scatter", "fill", "zero", "masked_scatter", "squeeze_copy",
    "unsqueeze_copy", "_reshape_alias", "_unsafe_index", "diagonal_copy", "unfold_copy", "unbind_copy",
    "split_copy", "split_with_sizes_copy", "narrow_copy", "alias_copy", "detach_copy", "_reshape_alias_copy",
    "movedim_copy",
}  # fmt: skip
"""Operations that only move elements: run on positions by torch itself."""

_COPIES = {"clone", "_to_copy", "contiguous", "detach", "alias", "lift_fresh", "positive", "to"}
_FACTORIES = {
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "new_zeros", "new_ones",
    "new_empty", "new_full", "randint_like", "empty_strided", "scalar_tensor", "_local_scalar_dense_",
}  # fmt: skip
"""Operations whose result depends on an operand's shape alone."""
_LINEAR_POINTWISE = {"add", "sub", "neg", "rsub", "clone", "_to_copy", "real", "conj", "positive"}
_REDUCTIONS = {
    "sum", "mean", "amax", "amin", "max", "min", "prod", "logsumexp", "linalg_vector_norm", "norm", "var",
    "std", "nansum", "nanmean", "all", "any", "aminmax", "var_mean", "std_mean",
}  # fmt: skip
_LINEAR_REDUCTIONS = {"sum", "mean", "nansum", "nanmean"}
_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"}
_ALONG = {"_softmax", "_log_softmax", "softmax", "log_softmax", "sort"}
_CONTRACTIONS = {"mm", "mv", "bmm", "addmm", "dot", "vdot", "addmv", "baddbmm", "addbmm"}


class _Refused(Exception):
    pass


class _Unfollowed(Exception):
    """What the dispatch mode cannot follow: make_fx traces f instead."""


def _torch() -> Any:
    import torch

    return torch


def _is_float_meta(meta: Any) -> bool:
    torch = _torch()
    return isinstance(meta, torch.Tensor) and (meta.dtype.is_floating_point or meta.dtype.is_complex)


def _concrete_shape(meta: Any, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in meta.shape)
    except Exception as error:
        raise _Refused(
            f"the size of {what} depends on the values of x (a boolean mask, nonzero, unique): a sparsity "
            "pattern needs sizes known without values"
        ) from error


_VALUE_REASON = (
    "f branches on, or converts to a Python number, a value computed from x or a context (a Python `if` on a "
    "tensor, float(t), int(t), .item()): the pattern could differ from one x to the next"
)
_SIZE_REASON = (
    "the size of a result depends on the values of x or a context (a boolean mask, nonzero, unique): a "
    "sparsity pattern needs sizes known without values"
)


def _tracer_error(error: BaseException) -> str | None:
    """The reason, when ``error`` comes from make_fx's tracing rather than from f itself."""
    name = type(error).__name__
    text = str(error)
    if name in ("GuardOnDataDependentSymNode", "DataDependentOutputException"):
        return f"{_VALUE_REASON} ({first_line(error)})"
    if name == "DynamicOutputShapeException":
        return f"{_SIZE_REASON} ({first_line(error)})"
    if name in ("UnsupportedOperatorException", "UnsupportedFakeTensorException"):
        return f"torch cannot trace an operation of f on fake tensors ({first_line(error)})"
    if "FakeTensor" in text or "tensor subclass" in text or "Proxy" in text or "SymFloat" in text:
        return f"f does something torch cannot trace without values ({name}: {first_line(error)})"
    return None


_VALUE_READS = (
    "can't convert meta device type tensor to numpy",
    "Cannot copy out of meta tensor",
    "a tensor with unallocated storage",
    "cannot be called on meta tensors",
)
"""What torch says where f reads a handle's values (numpy(), tolist(), item() outside the dispatcher)."""


def _value_read(error: BaseException) -> str | None:
    """The reason, when f reached for the values of a handle (they live on the meta device, which has none)."""
    text = str(error)
    if not any(read in text for read in _VALUE_READS):
        return None
    if "item()" in text:
        return f"{_VALUE_REASON} ({first_line(error)})"
    return (
        "f reads the values of a tensor computed from x or a context (numpy(), tolist(), item(), a Python "
        f"conversion): the pattern could differ from one x to the next ({type(error).__name__}: {first_line(error)})"
    )


def _mentions_meta(error: BaseException) -> bool:
    """Whether torch refused something of the handles' device: make_fx may still follow f. A
    composite operation may compare its operands' devices before the dispatcher sees them
    (``torch.quantile``'s q, made on x's real device, beside a handle): "the same device"."""
    text = str(error)
    return isinstance(error, (RuntimeError, NotImplementedError, TypeError)) and (
        "meta" in text or "same device" in text
    )


def trace_pattern(f: Callable[..., Any], x: Any, values: list[Any], hessian: bool) -> Detection:
    """The Jacobian (``hessian=False``) or Hessian pattern of torch-written ``f`` at ``x``; with
    the arrays a plain object in a context holds that are not tensors, which reach f as they
    are and whose values count (``x[torch.as_tensor(model.index)]``)."""
    detection = _read_pattern(f, x, values, hessian)
    torch = _torch()
    kept = tuple(
        array
        for leaf in tree.leaves(values)
        if not _arrays.is_array(leaf)
        for array in held_arrays(leaf)
        if not isinstance(array, torch.Tensor)
    )
    return dataclasses.replace(detection, kept=kept) if kept else detection


def _read_pattern(f: Callable[..., Any], x: Any, values: list[Any], hessian: bool) -> Detection:
    torch = _torch()
    from torch.func import functionalize

    def tensor(leaf: Any) -> bool:  # (numpy arrays in the contexts reach f as tensors, as under torch's backend)
        return isinstance(leaf, torch.Tensor) or (
            isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype.kind in "fciub"
        )

    leaves = tree.leaves(x)
    # (of the arrays a plain object in a context holds, the tensors: its numpy arrays reach f as
    # they are under torch's backend, not as tensors, and f converts them itself)
    run, contexts = leaf_function(f, x, values, tensor, lambda leaf: isinstance(leaf, torch.Tensor))
    contexts = [torch.as_tensor(leaf) for leaf in contexts]
    inputs = [
        leaf
        if isinstance(leaf, torch.Tensor)
        else torch.as_tensor(leaf, dtype=getattr(torch, _arrays.dtype_name(leaf)))
        for leaf in leaves
    ]
    sizes = [int(np.prod(_arrays.shape(leaf), dtype=np.int64)) for leaf in leaves]
    interpreter = _Interpreter(sizes, hessian)
    device = inputs[0].device if inputs else torch.device("cpu")
    mode = _tracer_class()(interpreter, device)
    handles = [mode.placeholder(t, interpreter.input_rows[i]) for i, t in enumerate(inputs)]
    handles += [mode.placeholder(t, None) for t in contexts]
    devices = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
    compiler_before = "torch._dynamo" in sys.modules
    fallback = False
    try:
        # f's random draws must not move the caller's generators; grad mode as the engines run f
        # (an f may branch on torch.is_grad_enabled(): the pattern is of the branch they run)
        with _fork_rng(torch, devices), torch.enable_grad(), mode:
            outputs = functionalize(run, remove="mutations_and_views")(*handles)
        results = [mode.node_of(out) for out in outputs]
    except _Unfollowed:
        fallback = True
    except _Refused as error:
        raise UnsupportedOperationError(_refusal(str(error))) from error
    except Exception as error:
        if mode.unfollowed is None and mode.refused is not None:
            raise UnsupportedOperationError(_refusal(mode.refused)) from error
        if mode.unfollowed is None:
            reason = _value_read(error)
            if reason is not None:
                raise UnsupportedOperationError(_refusal(reason)) from error
            if isinstance(error, RuntimeError) and "override the setup_context" in str(error):
                raise UnsupportedOperationError(
                    "GlobalDetector could not read the sparsity pattern of torch-written f: f uses a "
                    "torch.autograd.Function without a setup_context staticmethod, which the tracer's "
                    "torch.func.functionalize cannot run. Give the Function setup_context (forward without "
                    "ctx, and setup_context(ctx, inputs, output)), or use LocalDetector(...) or KnownPattern(pattern)."
                ) from error
            if not _mentions_meta(error):
                raise  # f's own exception, as f raised it
        fallback = True
    if fallback or mode.unfollowed is not None:
        # what the dispatch mode cannot follow (torch.cond and the other higher-order operators make
        # tensors on the meta device; a torch function that refuses the handles' device): torch's own
        # tracer, make_fx on fake tensors (slower to start)
        if not compiler_before and "torch._dynamo" in sys.modules:
            # torch.cond compiled its branches with dynamo on the handles, and dynamo keeps that
            # failure; its caches hold nothing of the caller's (dynamo came in during this call)
            import torch._dynamo

            torch._dynamo.reset()
        try:
            with _fork_rng(torch, devices):
                return _make_fx_pattern(run, [*inputs, *contexts], sizes, hessian)
        except Exception as error:
            if type(error).__module__.startswith("torch._dynamo"):
                raise UnsupportedOperationError(
                    _refusal(
                        f"{mode.unfollowed} (torch.cond or another higher-order operator): torch's tracers "
                        f"cannot follow it here ({type(error).__name__}: {first_line(error)})"
                    )
                ) from error
            raise
    if mode.refused is not None:  # refused inside f, and f caught it: its other branch is not f at x
        raise UnsupportedOperationError(_refusal(mode.refused))
    try:
        return interpreter.finish(results)
    except _Refused as error:
        raise UnsupportedOperationError(_refusal(str(error))) from error


def _fork_rng(torch: Any, devices: list[int]) -> Any:
    if devices:
        return torch.random.fork_rng(devices=devices, device_type="cuda")
    return torch.random.fork_rng(devices=[])


def _make_fx_pattern(run: Callable[..., Any], args: list[Any], sizes: list[int], hessian: bool) -> Detection:
    """The pattern from make_fx's graph of ``run`` on fake tensors."""
    torch = _torch()
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        with torch.enable_grad():  # (as the engines run f: see trace_pattern)
            graph = make_fx(
                functionalize(run, remove="mutations_and_views"), tracing_mode="fake", _allow_non_fake_inputs=True
            )(*args)
    except Exception as error:
        reason = _tracer_error(error)
        if reason is None:
            raise  # f's own exception, as f raised it
        raise UnsupportedOperationError(_refusal(reason)) from error
    try:
        return _Interpreter(sizes, hessian).run_graph(graph)
    except _Refused as error:
        raise UnsupportedOperationError(_refusal(str(error))) from error


def _refusal(reason: str) -> str:
    return (
        f"GlobalDetector could not read the sparsity pattern of torch-written f: {reason}. Write f without "
        "branches on values, or use LocalDetector(...) (dense derivatives at a few points, with the backend "
        "given) or KnownPattern(pattern)."
    )


class _Node:
    """One recorded operation (or input, or constant), in the shape of an fx node: what the rules read."""

    __slots__ = ("args", "kwargs", "meta", "op", "target")

    def __init__(self, op: str, target: Any, args: Any, kwargs: Any, val: Any) -> None:
        self.op = op
        self.target = target
        self.args = args
        self.kwargs = kwargs
        self.meta = {"val": val}


_RESHAPED_IN_PLACE = {"squeeze_", "unsqueeze_"}
"""In-place operations that change a tensor's shape and keep its elements' order."""
_SHAPE_ONLY = {"is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride"}
"""Operations whose non-tensor result reads shapes, not values."""


@functools.cache
def _tracer_class() -> Any:
    """The dispatch mode, made on first use (torch is imported only by a torch-written f)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Tracer(TorchDispatchMode):  # type: ignore[no-untyped-call]
        """Records each aten operation of f as it runs and carries the index sets through it.

        The tensors f sees for x and the contexts are handles on the meta device: no values, so f
        cannot branch on them or read them into Python or numpy unnoticed. Each handle has a shadow,
        a real tensor (a copy of x's or a context's values), on which the operation runs: that
        gives the result's shape and dtype without torch's meta kernels (several are Python
        functions that import torch's compiler, about 1.7 s, on their first call). The shadows'
        values are never read by a rule; constants' values are (tensors f closes over, and what
        is computed from them alone, run as they are). ``functionalize`` (outside this mode)
        turns f's in-place writes and views into operations that make new tensors, so no
        handle aliases another."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # torch wraps a mode's __torch_dispatch__ to keep its compiler out of it, and that
            # wrapper imports the compiler on its first call; nothing here is compiled
            return False

        def __init__(self, interpreter: _Interpreter, device: Any) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.interpreter = interpreter
            self.device = device
            self.entries: dict[int, tuple[Any, Any, _Node]] = {}  # id(handle) -> handle, shadow, node
            self.constants: dict[int, tuple[Any, _Node]] = {}
            self.refused: str | None = None
            self.unfollowed: str | None = None

        def placeholder(self, tensor: Any, rows: Any) -> Any:
            node = _Node("placeholder", None, (), {}, tensor)
            self.interpreter.rows[node] = rows
            return self.handle(tensor.detach().clone(), node)

        def handle(self, shadow: Any, node: _Node) -> Any:
            meta = torch.empty_strided(tuple(shadow.shape), tuple(shadow.stride()), dtype=shadow.dtype, device="meta")
            self.entries[id(meta)] = (meta, shadow, node)
            return meta

        def unfollow(self, reason: str) -> Any:
            if self.unfollowed is None:
                self.unfollowed = reason
            raise _Unfollowed(reason)

        def refuse(self, reason: str) -> Any:
            if self.refused is None:
                self.refused = reason
            raise _Refused(reason)

        def node_of(self, a: Any) -> Any:
            """The node of an operand or of one of f's outputs: a handle's, or a constant's."""
            if not isinstance(a, torch.Tensor):
                return a
            entry = self.entries.get(id(a))
            if entry is not None:
                return entry[2]
            if a.device.type == "meta":
                self.unfollow("f made a tensor on the meta device")
            constant = self.constants.get(id(a))
            if constant is None:
                node = _Node("get_attr", None, (), {}, a)
                self.interpreter.rows[node] = None
                if _values_count(a):
                    self.interpreter.values[node] = a
                constant = self.constants[id(a)] = (a, node)
            return constant[1]

        def real(self, a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                entry = self.entries.get(id(a))
                return a if entry is None else entry[1]
            if isinstance(a, torch.device) and a.type == "meta":
                return self.device
            return a

        def reshape_in_place(self, func: Any, args: Any, kwargs: Any) -> Any:
            """``squeeze_``/``unsqueeze_`` of a handle (functionalize passes these down; torch's matmul
            of a vector uses one): a new shape, the same elements in the same order."""
            handle, shadow, node = self.entries[id(args[0])]
            func(shadow, *args[1:], **kwargs)
            func(handle, *args[1:], **kwargs)
            reshaped = _Node("call_function", func, (node, *args[1:]), kwargs, shadow)
            self.interpreter.rows[reshaped] = self.interpreter.rows.get(node)
            self.entries[id(handle)] = (handle, shadow, reshaped)
            return handle

        def mixed(self, node: _Node, out: Any) -> Any:
            """Tensors beside other results (sizes, None): each tensor dense in the operands."""
            interpreter = self.interpreter
            every = interpreter.dense_row(node)
            results = []
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    child = _Node("call_function", operator.getitem, (node, i), {}, o)
                    interpreter.rows[child] = sets.all_of(every, o.numel()) if _is_float_meta(o) else None
                    results.append(self.handle(o, child))
                elif isinstance(o, (bool, float, complex)):
                    self.refuse(_VALUE_REASON)
                else:
                    results.append(o)
            return type(out)(results)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            from torch.utils import _pytree as pytree

            kwargs = kwargs or {}
            flat = pytree.tree_leaves((args, kwargs))
            handles = [a for a in flat if isinstance(a, torch.Tensor) and id(a) in self.entries]
            schema = getattr(func, "_schema", None)
            mutable = schema is not None and schema.is_mutable
            name = _name(func)
            if not handles:
                if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in flat):
                    self.unfollow("f made a tensor on the meta device")
                if mutable and any(isinstance(a, torch.Tensor) for a in flat):
                    self.refuse(
                        f"f writes in place ({func}) into a tensor it closes over; the detector does not change "
                        "f's tensors"
                    )
                # a constant: computed from constants alone, its values count
                return func(*pytree.tree_map(self.real, args), **pytree.tree_map(self.real, kwargs))
            tags = getattr(func, "tags", ())
            if name in _RESHAPED_IN_PLACE and id(args[0]) in self.entries and len(handles) == 1:
                return self.reshape_in_place(func, args, kwargs)
            if mutable:
                self.refuse(f"the traced program writes in place ({func}), which the detector does not follow")
            if torch.Tag.data_dependent_output in tags or name in ("_local_scalar_dense", "is_nonzero"):
                self.refuse(_VALUE_REASON)
            if torch.Tag.dynamic_output_shape in tags:
                by_index = name in ("index", "_unsafe_index", "index_put")
                if not by_index or any(h.dtype in (torch.bool, torch.uint8) for h in handles):
                    self.refuse(_SIZE_REASON)
            out = func(*pytree.tree_map(self.real, args), **pytree.tree_map(self.real, kwargs))
            node = _Node(
                "call_function", func, pytree.tree_map(self.node_of, args), pytree.tree_map(self.node_of, kwargs), out
            )
            self.interpreter.call(node)
            if isinstance(out, torch.Tensor):
                return self.handle(out, node)
            if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
                wrapped = []
                for i, o in enumerate(out):
                    child = _Node("call_function", operator.getitem, (node, i), {}, o)
                    self.interpreter.call(child)
                    wrapped.append(self.handle(o, child))
                return type(out)(wrapped)
            if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
                return self.mixed(node, out)
            if name not in _SHAPE_ONLY and any(
                isinstance(o, (bool, int, float, complex)) for o in pytree.tree_leaves(out)
            ):
                self.refuse(_VALUE_REASON)
            return out

    return Tracer


class _Interpreter(sets.Trace):
    def __init__(self, sizes: list[int], hessian: bool) -> None:
        super().__init__(int(sum(sizes)), hessian, "torch")
        self.sizes = sizes
        self.rows: dict[Any, Any] = {}
        self.values: dict[Any, Any] = {}
        self.input_rows = sets.identity(sizes)
        """The sets of x's leaves: each element depends on itself."""

    def run_graph(self, graph: Any) -> Detection:
        """The pattern from make_fx's graph: its placeholders are x's leaves, then the contexts'."""
        placeholders = 0
        outputs: list[Any] = []
        for node in graph.graph.nodes:
            if node.op == "placeholder":
                self.rows[node] = self.input_rows[placeholders] if placeholders < len(self.sizes) else None
                placeholders += 1
            elif node.op == "get_attr":
                self.rows[node] = None
                value = getattr(graph, node.target)
                if _values_count(value):
                    self.values[node] = value
            elif node.op == "call_function":
                self.call(node)
            elif node.op == "output":
                outputs = list(node.args[0])
        return self.finish(outputs)

    def finish(self, outputs: list[Any]) -> Detection:
        """The pattern of f's outputs (nodes, or Python numbers)."""
        blocks, sizes = [], []
        for out in outputs:
            if hasattr(out, "op"):
                meta = out.meta.get("val")
                size = sets.size(_concrete_shape(meta, "f's output"))
                rows = self.rows.get(out) if _is_float_meta(meta) else None
            else:  # (a tensor is always a node: the mode's node_of, or make_fx's get_attr)
                size, rows = sets.size(np.shape(out)), None
            blocks.append(rows)
            sizes.append(size)
        if self.pairs is not None and sum(sizes) != 1:  # (f's output, not something it did: as the other tracers say)
            raise InvalidOutputError(f"A Hessian needs f to return one scalar; f returns {sum(sizes)} numbers.")
        return Detection(self.pattern(blocks, sizes), "torch", tuple(dict.fromkeys(self.notes)))

    def call(self, node: Any) -> None:
        torch = _torch()
        target = node.target
        if target is operator.getitem:
            source, i = node.args
            self.rows[node] = self.rows[source][i] if isinstance(self.rows[source], list) else self.rows[source]
            value = self.values.get(source)
            if value is not None:
                self.values[node] = value[i]
            return
        operands = [a for a in _nodes(node.args) + _nodes(node.kwargs) if a.op != "output"]
        depends = any(_any_rows(self.rows.get(a)) for a in operands)
        if not depends:
            self.rows[node] = None
            if all(a in self.values for a in operands):
                try:
                    with torch.no_grad():
                        self.values[node] = target(*self._with_values(node.args), **self._with_values(node.kwargs))
                except Exception:
                    pass
            return
        name = _name(target)
        meta = node.meta.get("val")
        schema = getattr(target, "_schema", None)
        if schema is not None and schema.is_mutable:
            raise _Refused(f"the traced program writes in place ({target}), which the detector does not follow")
        if name in _FACTORIES:
            self.rows[node] = None
            return
        if name == "_local_scalar_dense":
            raise _Refused("f reads a value computed from x as a Python number (.item(), float(t))")
        if isinstance(meta, (list, tuple)) and all(isinstance(m, torch.Tensor) for m in meta):
            self.rows[node] = self.multiple(node, name, list(meta))
        elif not isinstance(meta, torch.Tensor):
            self.rows[node] = None
        else:  # (integers and booleans: no derivative)
            shape = _concrete_shape(meta, f"the result of {name}")
            self.rows[node] = self.single(node, name, shape) if _is_float_meta(meta) else None

    # -- rules -------------------------------------------------------------------------------

    def single(self, node: Any, name: str, shape: tuple[int, ...]) -> Any:
        torch = _torch()
        if name in _COPIES and node.args and hasattr(node.args[0], "op"):
            source = node.args[0]
            if sets.size(_shape(source)) == sets.size(shape):
                return self.rows[source]
        if name in _MOVES and not _accumulates(node):
            moved = self.move(node, shape)
            if moved is not _UNKNOWN:
                return moved
        if torch.Tag.pointwise in getattr(node.target, "tags", ()):
            return self.pointwise(node, name, shape)
        if name in _REDUCTIONS:
            return self.reduction(node, name, shape)
        if name in _CUMULATIVE or name in _ALONG:
            return self.along(node, name)
        if name in _CONTRACTIONS:
            return self.contraction(node, name, shape)
        if name == "convolution":
            result = self.convolution(node, shape)
            if result is not _UNKNOWN:
                return result
        return sets.all_of(self.dense_row(node), sets.size(shape))

    def multiple(self, node: Any, name: str, metas: list[Any]) -> list[Any]:
        shapes = [_concrete_shape(m, f"a result of {name}") for m in metas]
        if name in _MOVES:
            moved = self.move(node, None)
            if moved is not _UNKNOWN:
                return [r if _is_float_meta(m) else None for r, m in zip(moved, metas, strict=True)]
        if name in _REDUCTIONS or name in _CUMULATIVE or name in _ALONG:  # (max, aminmax, var_mean, sort, cummax)
            rows = self.reduction(node, name, shapes[0]) if name in _REDUCTIONS else self.along(node, name)
            return [rows if _is_float_meta(m) else None for m in metas]
        every = self.dense_row(node)
        return [
            sets.all_of(every, sets.size(s)) if _is_float_meta(m) else None for s, m in zip(shapes, metas, strict=True)
        ]

    def dense_row(self, node: Any) -> Any:
        """:meth:`sets.Trace.dense` of ``node``'s operands (a list of tensors' each)."""
        rows: list[Any] = []
        for a in _nodes(node.args) + _nodes(node.kwargs):
            r = self.rows.get(a)
            rows.extend(r if isinstance(r, list) else [r])
        return self.dense(rows, str(node.target))

    def move(self, node: Any, shape: tuple[int, ...] | None) -> Any:
        """Run the operation on positions; _UNKNOWN where an index it needs is not known."""
        torch = _torch()
        sources: list[Any] = []
        sizes: list[int] = []
        unknown = [False]

        def substitute(a: Any) -> Any:
            if isinstance(a, (list, tuple)):
                return type(a)(substitute(b) for b in a)
            if isinstance(a, float):
                return 0  # a fill value: depends on nothing
            if not hasattr(a, "op"):
                return a
            meta = a.meta.get("val")
            if _is_float_meta(meta):
                a_shape = _shape(a)
                rows = self.rows.get(a)
                if rows is None:
                    return torch.zeros(a_shape, dtype=torch.int64)
                pos = torch.from_numpy(sets.positions(a_shape, sum(sizes)).copy())
                sources.append(rows)
                sizes.append(sets.size(a_shape))
                return pos
            if a in self.values:
                return self.values[a]
            unknown[0] = True
            return a

        args = substitute(node.args)
        kwargs = {key: substitute(v) for key, v in node.kwargs.items() if key != "dtype"}
        if unknown[0]:
            return _UNKNOWN
        try:
            with torch.no_grad():
                out = node.target(*args, **kwargs)
        except Exception:
            return _UNKNOWN
        if any(_not_a_position(o, sum(sizes)) for o in (out if isinstance(out, (list, tuple)) else [out])):
            return _UNKNOWN
        if isinstance(out, (list, tuple)):
            return [sets.gather(sources, sizes, o.numpy(), self.n) for o in out]
        if shape is not None and tuple(out.shape) != shape:
            return _UNKNOWN
        rows = sets.gather(sources, sizes, out.numpy(), self.n)
        shared = _shared_writes(_name(node.target), args)
        if shared is None:
            return rows
        targets, writers = shared
        return sets.union([rows, sets.gather_all(sources, sizes, targets, writers, out.numel(), self.n)])

    def pointwise(self, node: Any, name: str, shape: tuple[int, ...]) -> Any:
        operands = [
            (self.rows.get(a), _shape(a))
            for a in _nodes(node.args) + _nodes(node.kwargs)
            if _is_float_meta(a.meta.get("val"))
        ]
        # linear: a quotient by a constant, a selection (in each branch)
        linear = name in _LINEAR_POINTWISE or name == "where" or (name == "div" and _numerator_alone(node, self.rows))
        return self.unite(sets.elementwise(operands, shape, self.n), linear, name == "mul")

    def reduction(self, node: Any, name: str, shape: tuple[int, ...]) -> Any:
        source = node.args[0]
        in_shape = _shape(source)
        rows = self.rows.get(source)
        if rows is None:
            return None
        position = 2 if name in ("linalg_vector_norm", "norm") else 1
        dim = node.kwargs.get("dim", node.args[position] if len(node.args) > position else None)
        # (no dim, or an empty list of them: every dimension; reduction_matrix takes them modulo the rank)
        dims = [dim] if isinstance(dim, int) else [int(d) for d in dim or range(len(in_shape))]
        matrix = sets.reduction_matrix(in_shape, dims)
        if matrix.shape[0] != sets.size(shape):
            return sets.all_of(self.dense_row(node), sets.size(shape))
        out = sets.apply(matrix, rows)
        return out if name in _LINEAR_REDUCTIONS else self.nonlinear(out)

    def along(self, node: Any, name: str) -> Any:
        """Each output depends on its input's slice along the operation's dimension: up to it (a
        cumulative operation), or the whole slice (softmax, sort)."""
        source = node.args[0]
        in_shape = _shape(source)
        rows = self.rows.get(source)
        if rows is None or not in_shape:
            return rows
        cumulative = name in _CUMULATIVE
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0 if cumulative else -1)
        out = sets.along(rows, in_shape, int(dim) if cumulative or isinstance(dim, int) else -1, not cumulative)
        return out if name == "cumsum" else self.nonlinear(out)

    def _value_or_none(self, a: Any) -> Any:
        if not hasattr(a, "op"):
            return None
        value = self.values.get(a)
        return None if value is None else value.detach().to("cpu").numpy() != 0

    def contraction(self, node: Any, name: str, shape: tuple[int, ...]) -> Any:
        args = list(node.args)
        bias = None
        if name in ("addmm", "addmv", "baddbmm", "addbmm"):
            bias, args = args[0], args[1:]
        a, b = args[0], args[1]
        a_shape, b_shape = _shape(a), _shape(b)
        if name == "mv":
            b_shape = (*b_shape, 1)
        elif name in ("dot", "vdot"):
            a_shape, b_shape = (1, *a_shape), (*b_shape, 1)
        if len(a_shape) == 2 and len(b_shape) == 2:
            a_shape, b_shape = (1, *a_shape), (1, *b_shape)
        if len(a_shape) != 3 or len(b_shape) != 3 or name == "addbmm":
            return sets.all_of(self.dense_row(node), sets.size(shape))
        left, right = ((self.rows.get(v), self._value_or_none(v), s) for v, s in ((a, a_shape), (b, b_shape)))
        out = sets.matmul(left, right, self.n, self.pairs)
        if bias is not None and hasattr(bias, "op"):
            out = sets.union([out, sets.broadcast(self.rows.get(bias), _shape(bias), shape, self.n)])
        return out

    def convolution(self, node: Any, shape: tuple[int, ...]) -> Any:
        """A convolution, transposed or not, by :func:`sets.convolution`: input (B, C, *L), weight
        (O, C / groups, *K), output (B, O, *L_out). Transposed, the weight is (C, O / groups, *K),
        and input element (b, c, *l) adds ``w[c, o_local, *k]`` times itself into output (b, o,
        *(l * stride - padding + k * dilation)), o the channel o_local of c's group: output
        position s reads input position (s + padding - k * dilation) / stride. A constant
        kernel's zeros drop their terms; every output position of a channel reads a traced
        weight's taps, but a transposed one's only where the tap reaches it."""
        source, weight, bias = node.args[:3]
        stride, padding, dilation, transposed, _, groups = node.args[3:9]
        in_shape, w_shape = _shape(source), _shape(weight)
        if len(in_shape) < 3 or len(w_shape) != len(in_shape):
            return _UNKNOWN  # (an unbatched input reaches aten batched; anything else: dense)
        kernel: Any = self._value_or_none(weight)
        w_at: Any = sets.positions(w_shape) - 1
        if transposed:  # the weight in the layout (O, C / groups, *K)
            regrouped = (groups, w_shape[0] // groups, w_shape[1], -1)
            kernel, w_at = (
                None if a is None else a.reshape(regrouped).swapaxes(1, 2).reshape(-1, regrouped[1], *w_shape[2:])
                for a in (kernel, w_at)
            )
            taps = sets.taps(in_shape[2:], w_shape[2:], shape[2:], 1, padding, -np.asarray(dilation), stride)
        else:
            taps = sets.taps(in_shape[2:], w_shape[2:], shape[2:], stride, -np.asarray(padding), dilation, 1)
        lhs, rhs = (self.rows.get(source), None, sets.positions(in_shape) - 1), (self.rows.get(weight), kernel, w_at)
        parts = [sets.convolution(lhs, rhs, sets.positions(shape) - 1, taps, groups, not transposed)]
        if bias is not None and hasattr(bias, "op") and self.rows.get(bias) is not None:
            out_size = sets.size(shape)
            channel = sets.selection(np.arange(out_size), np.indices(shape)[1].reshape(-1), (out_size, shape[1]))
            parts.append(sets.apply(channel, self.rows[bias]))
        if self.pairs is not None and self.rows.get(source) is not None and self.rows.get(weight) is not None:
            self.pairs.add_all(sets.all_of(sets.union(parts), 1))
        return sets.union(parts)

    def _with_values(self, a: Any) -> Any:
        if isinstance(a, dict):
            return {k: self._with_values(v) for k, v in a.items()}
        if isinstance(a, (list, tuple)):
            return type(a)(self._with_values(b) for b in a)
        if hasattr(a, "op"):
            return self.values[a]
        return a


_UNKNOWN: Any = object()
"""What a rule returns where it cannot tell (an index not known): the next rule, or dense, instead."""


def _nodes(a: Any) -> list[Any]:
    if isinstance(a, dict):
        return [n for v in a.values() for n in _nodes(v)]
    if isinstance(a, (list, tuple)):
        return [n for b in a for n in _nodes(b)]
    return [a] if hasattr(a, "op") else []


def _numerator_alone(node: Any, rows: dict[Any, Any]) -> bool:
    """Whether a division's numerator depends on x and its denominator does not."""
    numerator, denominator = node.args[0], node.args[1] if len(node.args) > 1 else None
    if not hasattr(numerator, "op") or rows.get(numerator) is None:
        return False
    return not hasattr(denominator, "op") or rows.get(denominator) is None


def _accumulates(node: Any) -> bool:
    """Whether a scatter adds (or reduces) into its target instead of writing: not a move."""
    overload = str(getattr(node.target, "_overloadname", ""))
    if "reduce" in overload or "reduce" in node.kwargs:
        return True
    if _name(node.target) == "index_put":
        return bool(node.kwargs.get("accumulate", node.args[3] if len(node.args) > 3 else False))
    return False


def _not_a_position(out: Any, count: int) -> bool:
    """Whether a move's result holds a number that is no position of its operands (1 to
    ``count``, 0 for a constant): an integer that was no position took part, a fill value
    (``masked_fill(mask, 50)``) or an integer tensor's values beside the operands'
    (``torch.cat([x, torch.tensor([3, 40])])``), and where it lies out of range, what its element
    depends on is not known; a rule of its own, or the dense one, reads the operation instead."""
    if out.numel() == 0:
        return False
    return bool(out.min() < 0 or out.max() > count)


def _shared_writes(name: str, args: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """Of a scatter that writes (``index_put``, ``scatter`` of a tensor) run on positions, the
    targets two or more of its writes land on and the position each of those writes brings;
    None where no target takes two. torch keeps one of them, and the winner alone is f's
    dependence, but torch's reverse mode gives every writer the target's cotangent: a pattern
    with the winner alone would let a reverse product add a loser's share into another row's
    entry of its color (an entry silently wrong). So every writer counts."""
    torch = _torch()
    if name == "index_put" and len(args) >= 3:
        target, indices, values = args[0], args[1], args[2]
        ids = torch.arange(target.numel()).view(target.shape)
        hit = ids[tuple(slice(None) if i is None else i for i in indices)]
        writers = values.expand(hit.shape)
    elif name == "scatter" and len(args) >= 4 and isinstance(args[3], torch.Tensor):
        target, dim, index, src = args[0], args[1], args[2], args[3]
        hit = torch.arange(target.numel()).view(target.shape).gather(dim, index)
        writers = src[tuple(slice(0, s) for s in index.shape)]
    else:
        return None
    hit_ids, brought = hit.reshape(-1).numpy(), writers.reshape(-1).numpy()
    many = np.bincount(hit_ids, minlength=target.numel())[hit_ids] > 1
    return (hit_ids[many], brought[many]) if many.any() else None


def _values_count(constant: Any) -> bool:
    """Whether the values of a tensor f closes over count (its zeros, its indices): not where it
    requires grad, a model's parameter or what f computes from one, which an optimizer's step
    changes in place (a zero-initialised layer, a Module in a Constant): the pattern must hold
    for every value of it."""
    return not getattr(constant, "requires_grad", False)


def _any_rows(rows: Any) -> bool:
    if isinstance(rows, list):
        return any(r is not None for r in rows)
    return rows is not None


def _shape(node: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in node.meta["val"].shape)


def _name(target: Any) -> str:
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))
    return str(name).split(".")[-1]
