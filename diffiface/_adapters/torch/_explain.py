"""Failures of f under torch explained to f's author: numpy code on tensors, torch.func's refusals,
nested modes torch cannot run.
"""

from __future__ import annotations

import dis
import re
from typing import Any

import torch

from ..._errors import MutationError, UnsupportedOperationError
from .._base import class_names, numpy_handed_its_method, raised_inside


def explain_failure(adapter: Any, exc: BaseException) -> str | None:
    """What ``exc``, raised by f under torch, says about f, worded for its author (None: f's own
    error); torch.func's refusals it cannot get past are raised here as diffiface errors."""
    text = str(exc)
    if "numpy()" in text and "requires grad" in text:
        return f"f turned a tensor that requires grad into a numpy array (a numpy function or .numpy() on its input). {_NUMPY_F}"
    if isinstance(exc, RuntimeError) and "Cannot access data pointer of Tensor that doesn't have storage" in text:
        # a tensor of a torch.func transform (or a forward-mode dual inside one) has no memory
        # of its own: numpy, or any code that reads a tensor's memory, cannot take it
        return (
            "f handed a tensor of torch.func's transforms, which has no memory of its own, to code that reads "
            f"a tensor's memory (a numpy function, .numpy() or np.asarray, even after .detach()). {_NUMPY_F}"
        )
    if "mixed torch.Tensor and DTensor" in text:
        return (
            "f mixes a DTensor (x is sharded) with a plain torch tensor (a di.Constant or a tensor f "
            "makes). Make every tensor f combines with x a DTensor on x's device mesh, e.g. "
            "torch.distributed.tensor.distribute_tensor(data, mesh, [Replicate()])."
        )
    operator = _numpy_operator_on_tensor(exc)
    if operator is not None:
        return (
            f"f applies {operator} to a numpy array and a torch tensor, which neither numpy nor torch "
            "computes: a numpy array f holds (a global, a closed-over matrix A in A @ x) meets the tensor "
            "diffiface gives f for x. Make that array a torch tensor (torch.as_tensor(A)) or pass it to f "
            "as a di.Constant (its numpy arrays reach f as torch tensors); or differentiate a numpy f with "
            "AutoFiniteDifferences()."
        )
    if numpy_handed_its_method(exc, torch.Tensor):
        return f"f calls numpy on torch tensors (np.sum(x), np.mean(x)). {_NUMPY_F}"
    if isinstance(exc, TypeError) and raised_inside(exc, "jax"):
        return "f calls jax on torch tensors; differentiate a jax function with AutoJAX()."
    if isinstance(exc, RuntimeError) and "Inference tensors cannot be saved for backward" in text:
        return (
            "f computes with a tensor made under torch.inference_mode() (a module built or loaded there, "
            "passed as a di.Constant or closed over), which autograd cannot save for the backward pass. "
            "diffiface copies inference tensors given as x or as a Constant's tensors, but not a module's: "
            "build or load the module outside inference mode, or pass copy.deepcopy(module), made outside "
            "it (its tensors are then ordinary ones)."
        )
    if isinstance(exc, NotImplementedError) and "Trying to use forward AD with " in text:
        # torch has no forward-mode rule for an operation of f: no way past it in forward mode
        operation = text.split("Trying to use forward AD with ", 1)[1].split(" ", 1)[0]
        raise UnsupportedOperationError(
            f"f calls {operation}, which torch has no forward-mode derivative of, {_IN_FORWARD_MODE}). Use "
            f"reverse mode: a vjp or a gradient; {_REVERSE_INSTEAD}, where torch can differentiate f's backward "
            "pass again."
        ) from exc
    if isinstance(exc, NotImplementedError) and "implement the jvp function for custom autograd.Function" in text:
        raise UnsupportedOperationError(
            f"f uses a torch.autograd.Function without a jvp staticmethod, {_IN_FORWARD_MODE}; AutoSparse's "
            f"row coloring, once, for the layout of f's output). Give the Function a jvp, or use reverse mode: "
            f"{_REVERSE_INSTEAD}."
        ) from exc
    if adapter.functional and isinstance(exc, RuntimeError) and "override the setup_context" in text:
        # torch.func's refusal of a classic torch.autograd.Function: the engine cannot run f
        raise UnsupportedOperationError(
            "f uses a torch.autograd.Function without a setup_context staticmethod, which torch.func "
            "cannot transform. Use AutoTorch(mode='autograd'), or give the Function setup_context "
            "(forward without ctx, and setup_context(ctx, inputs, output))."
        ) from exc
    if adapter.functional and isinstance(exc, RuntimeError) and "mutate a captured Tensor" in text:
        # torch.func's refusal, raised before the write: nothing of the caller's changed
        raise _CapturedWrite(
            "f writes in place into a tensor it closes over (an array of a di.Constant or di.Cache, "
            "or a global), which torch.func refuses inside its transforms; nothing was written. "
            "A Constant must only be read: compute out of place (y = c * 2, not c.mul_(2)). For an "
            "f that writes into scratch space (a di.Cache), use AutoTorch(mode='autograd')."
        ) from exc
    return None


_NUMPY_F = "Write f with torch operations, or differentiate a numpy f with AutoFiniteDifferences()."
_IN_FORWARD_MODE = (
    "and this operator runs f in forward mode (a jvp or a derivative; under torch.func also an hvp or a "
    "Hessian, forward over reverse"
)
_REVERSE_INSTEAD = (
    "for a jvp AutoTorch(jvp='reverse') (two backward passes), for an hvp or a Hessian AutoTorch() (double backward)"
)

_OPERAND_TYPES = re.compile(
    r"(?:unsupported operand type\(s\) for (?P<binary>.+?):|'(?P<compare>.+?)' not supported between instances of)"
    r" '(?P<a>[\w.]+)' and '(?P<b>[\w.]+)'"
)
_NUMPY_CONCATENATION = "Concatenation operation is not implemented for NumPy arrays"
"""numpy's refusal of ``array + tensor`` (numpy defers to the tensor, which declines)."""


def _numpy_operator_on_tensor(exc: BaseException) -> str | None:
    """The operator (``@``, ``+``, ``<``...) of ``exc`` where the interpreter itself raised it at
    an operator of f's code, between a numpy array and a torch tensor; else None.

    Told by where it was raised: the innermost frame is executing an operator instruction
    (not a ``raise`` statement of f, not a library's Python code); only then is the message,
    the interpreter's own, read for the operand types."""
    if type(exc) is not TypeError:
        return None
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    instruction = next((i for i in dis.get_instructions(tb.tb_frame.f_code) if i.offset == tb.tb_lasti), None)
    if instruction is None or instruction.opname not in ("BINARY_OP", "COMPARE_OP"):
        return None
    text = str(exc)
    if text.startswith(_NUMPY_CONCATENATION):
        return "+"
    found = _OPERAND_TYPES.fullmatch(text)
    if found is None:
        return None
    types = {found["a"], found["b"]}
    numpy_side = any(name.startswith("numpy.") for name in types)
    tensor_side = bool(types & class_names(torch.Tensor))
    if not (numpy_side and tensor_side):
        return None
    return found["binary"] or found["compare"]


_REFUSALS = (
    (
        "don't yet support saved tensor hooks",
        "f uses saved-tensor hooks (torch.utils.checkpoint, torch.autograd.graph.save_on_cpu), which "
        "torch.func's transforms do not support. Use AutoTorch() (autograd mode) for such an f.",
    ),
    (
        "torch.utils.checkpoint is incompatible with .grad()",
        "f uses torch.utils.checkpoint with use_reentrant=True, whose backward pass runs only under "
        ".backward(), not torch.autograd.grad, which diffiface differentiates with. Pass "
        "use_reentrant=False to torch.utils.checkpoint (torch's recommended setting).",
    ),
    (
        "called random operation while in randomness error mode",
        "f draws random numbers (a dropout in training mode, torch.rand) inside torch.func.vmap, which "
        "batches this operator's products (a Hessian, a Jacobian or a batch of products) and refuses a "
        "random f: derivatives of one random draw are a derivative of one fixed f. Fix the draw (a "
        "module in eval mode, a mask passed as a di.Constant), or use AutoTorch() (autograd mode), whose "
        "products reuse f's one evaluation.",
    ),
    (
        "arguments don't support automatic differentiation, but one of the arguments requires grad",
        "f passes an out= argument to a torch function (torch.add(a, b, out=y)) where an argument, or the "
        "out= tensor itself, requires grad: torch does not differentiate a function with out=, and refused "
        "it before writing. x's leaves require grad inside the call, so an out= that is x, or that a value "
        "computed from x goes into, is refused. Compute out of place (y = torch.add(a, b)); x and the "
        "Constants are read-only, and scratch space f may overwrite is a di.Cache.",
    ),
    (
        "needed for gradient computation has been modified by an inplace operation",
        "f overwrites in place a tensor that torch saved for its backward pass (y.clamp_() on y = "
        "x.exp(), whose derivative reads y), so torch cannot differentiate f in reverse mode. Compute "
        "that step out of place (y = y.clamp(max=2.0)); an in-place operation on a tensor that no "
        "backward pass reads (a fresh y = x.clone(), written before use) is fine.",
    ),
    (
        "does not require grad and does not have a grad_fn",
        "f calls torch.autograd.grad (or .backward()) on a value that does not require grad: a force "
        "field's gradient of an energy, say. Where that value comes from x, this operator gave f an x "
        "that does not require grad (a jvp's forward-mode duals, a torch.func transform's tensors): take "
        "the product with AutoTorch(jvp='reverse'), or a reverse-mode operator (jacobian, vjp, hvp) in "
        "autograd mode, where f's own torch.autograd.grad(..., create_graph=True) is differentiated.",
    ),
)
"""torch's refusals of what f uses, raised while f or its backward pass runs, and what to do."""


def torch_refusal(exc: BaseException) -> UnsupportedOperationError | None:
    """Where torch refused an operation of f that the engine cannot get past (``exc``, raised by
    f or by its backward pass), an UnsupportedOperationError that says what to do; else None."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    for found, message in _REFUSALS:
        if found in text:
            return UnsupportedOperationError(message)
    return None


def _autograd_in_func() -> UnsupportedOperationError:
    return UnsupportedOperationError(
        "AutoTorch(mode='autograd') was called on a tensor of a torch.func transform (an outer "
        "AutoTorch(mode='func') call, or torch.func.grad/jvp/vmap around it): torch does not support "
        "torch.autograd.grad or forward_ad inside torch.func transforms. Use AutoTorch(mode='func') for "
        "the inner call, or AutoTorch(mode='autograd') for the outer one."
    )


def _nested_forward() -> UnsupportedOperationError:
    return UnsupportedOperationError(
        "AutoTorch(mode='autograd') computes forward mode (jvp, derivative) with torch.autograd.forward_ad, "
        "which has one dual level per process: no forward mode (of either mode) can run inside it, and it "
        "cannot run inside another forward-mode differentiation. Use AutoTorch(mode='func') for both calls, "
        "or a reverse-mode operator (gradient, vjp) inside."
    )


_FIX = "Compute out of place (y = x * 2, not x.mul_(2)); for scratch space f may overwrite, pass a di.Cache."
_TANGENT_WRITE = f"f wrote in place into the tangent of its input (forward mode). {_FIX}"
"""A write into the tangent f reaches through its dual input, refused: it changes the derivative itself."""


_LEAF_WRITE = "a leaf Variable that requires grad is being used in an in-place operation"
"""torch's refusal of a write into a leaf that requires grad, such as the leaf f gets for x."""


class _CapturedWrite(MutationError):
    """torch.func's refusal of a write by f into a tensor it closes over, before the write."""
