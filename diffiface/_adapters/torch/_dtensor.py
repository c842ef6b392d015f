"""DTensors (torch.distributed.tensor): sharded over processes, never gathered; derivatives laid
out as their inputs.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..._errors import InvalidInputError, UnsupportedOperationError
from .._base import Leaves


def is_dtensor(leaf: Any) -> bool:
    """Whether ``leaf`` is a DTensor (a tensor sharded or replicated over a device mesh)."""
    if type(leaf) is torch.Tensor:
        return False
    # (None while torch.distributed.tensor is not imported: then no tensor can be one)
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(leaf, cls)


def _any_dtensor(leaves: Any) -> bool:
    for leaf in leaves:  # noqa: SIM110  # (a loop, not a generator: this runs on every call)
        if type(leaf) is not torch.Tensor and is_dtensor(leaf):
            return True
    return False


def _placed(grads: Leaves, xs: Leaves) -> Leaves:
    """Derivatives laid out as their inputs: a DTensor's on x's device mesh with x's placements.

    torch's backward chooses its own placements (a sharded weight used in a matrix product
    gets a replicated gradient, an elementwise use a sharded one); redistributing to x's
    slices a replicated gradient locally or reduce-scatters a partial one, never gathers."""
    for g in grads:  # (a loop, not all(...): this runs on every call of several leaves)
        if type(g) is not torch.Tensor:
            break
    else:
        return grads
    return tuple(
        g.redistribute(x.device_mesh, x.placements)
        if is_dtensor(g) and is_dtensor(x) and (g.placements != x.placements or g.device_mesh != x.device_mesh)
        else g
        for g, x in zip(grads, xs, strict=True)
    )


def _cotangents(out: Any, touts: Any) -> Any:
    """``touts``, refused where a plain tensor stands for a DTensor output (torch would fail on
    the mix half-way through its backward pass)."""
    for y, t in zip(
        out if isinstance(out, tuple) else (out,), touts if isinstance(touts, tuple) else (touts,), strict=False
    ):
        if is_dtensor(y) and isinstance(t, torch.Tensor) and not is_dtensor(t):
            raise InvalidInputError(
                "The cotangent of a DTensor output of f is a plain torch tensor: torch cannot mix the two. "
                "Make it a DTensor on the output's device mesh, e.g. "
                "torch.distributed.tensor.distribute_tensor(t, y.device_mesh, y.placements) (same t on "
                "every rank), or DTensor.from_local(local_t, mesh, placements) for a sharded one."
            )
    return touts


def _forward_on_dtensors(functional: bool) -> UnsupportedOperationError:
    mode = "torch.func.jvp" if functional else "torch.autograd.forward_ad"
    return UnsupportedOperationError(
        f"Forward mode ({mode}) does not run on DTensors in torch {torch.__version__}: torch has no sharding "
        "rule for the operators that make dual tensors. For a jvp of a sharded f use "
        "di.jvp(f, di.AutoFiniteDifferences(), x, t) with a DTensor tangent (one collective difference "
        "along t) or a vjp; for an hvp use AutoTorch(mode='autograd') (reverse over reverse)."
    )


def _dense_of_dtensors(what: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(
        f"{what} with respect to a DTensor x is a dense matrix built one row or entry at a time, which "
        "torch cannot do on sharded tensors without gathering them (and which would be as large as the "
        "model squared). Use products, which stay sharded: di.vjp (a row), di.hvp with "
        "AutoTorch(mode='autograd') (a Hessian column), di.gradient."
    )


def _refuse_fully_sharded(module: Any) -> None:
    """Refuse a module sharded by FSDP2's ``fully_shard``: its forward hooks gather its own
    parameters and put them in place of those ``torch.func.functional_call`` passes, so f would
    not depend on x and its gradient would read zero."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    if kind is None or not any(isinstance(m, kind) for m in module.modules()):
        return
    raise UnsupportedOperationError(
        "A di.Constant holds a module sharded by FSDP2 (fully_shard): its forward hooks gather its own "
        "parameters and use them in place of any passed by torch.func.functional_call, so the gradient "
        "with respect to x would read zero. Differentiate an unwrapped copy of the module whose parameters "
        "are DTensors (torch.distributed.tensor.distribute_module or distribute_tensor on each parameter), "
        "with x = its parameters and f calling torch.func.functional_call; or train the FSDP2 module with "
        "its own loss.backward()."
    )
