"""torch's forward mode as diffiface runs it: its one dual level per process (a lock, a count of
diffiface's open levels), dual tensors made and unpacked in the level diffiface opened.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad

from .._base import Leaves
from ._explain import _autograd_in_func, _nested_forward

# torch scripts its forward-mode decompositions on the first make_dual of the process, warning
# that torch.jit.script is deprecated: torch's own business, which must not reach f's caller (an
# error under -W error). diffiface's first forward-mode call makes one throwaway dual first, with
# that one warning silenced; f never runs inside the silence. The throwaway dual is multiplied
# by a plain tensor: torch's first such product imports its Python meta kernels (slow, once),
# which would otherwise fall inside the first call that a jvp's choice of way times.
_FORWARD_WARMED = [False]


def _warm_forward() -> None:
    """The throwaway dual (see above), made once, under the forward-mode lock: two threads'
    first calls must not both take it for done while one is still loading the decompositions."""
    with _FORWARD_LOCK:
        if _FORWARD_WARMED[0]:
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*")  # Deprecation- or FutureWarning
            try:
                with forward_ad.dual_level():
                    forward_ad.make_dual(torch.zeros(()), torch.zeros(())) * torch.zeros(())
            except RuntimeError:  # a dual level is open (the caller's, or ours): a throwaway dual in it
                forward_ad.make_dual(torch.zeros(()), torch.zeros(()))
        _FORWARD_WARMED[0] = True


# torch's forward-mode AD has one dual level for the whole process, not one per thread: two
# threads in forward mode at once break each other ("no level exists"). Forward-mode work is
# serialised; reverse mode runs in parallel.
_FORWARD_LOCK = threading.RLock()


def _forward_locked() -> threading.RLock:
    """``_FORWARD_LOCK``, for a ``with``, once the process's first forward-mode call is warmed."""
    if not _FORWARD_WARMED[0]:
        _warm_forward()
    return _FORWARD_LOCK


_DUALS = [0]
"""How many of diffiface's forward-mode (dual level) calls are open, in the thread that holds
``_FORWARD_LOCK``. Whether any dual level is open (ours, the caller's, a ``torch.func.jvp``'s)
is ``forward_ad._current_level >= 0``, read inline on every call: x may then be a dual tensor,
whose leaves are aliased, never detached (:func:`~._engine._requiring_grad`)."""


# torch's public make_dual and unpack_dual pass through three Python frames each (torch.export's
# pre-dispatch hook, the dtype checks, the default level), several times the cost of the
# operations under them: once for each leaf of x and each output leaf of every jvp. Where no
# torch-function mode is active (the hook's mode is one), diffiface calls those operations with
# the level it opened; the plan has made x's leaves and the tangents floating or complex.
_make_dual = torch._make_dual
_unpack_dual = torch._unpack_dual
_function_mode = torch._C._is_torch_function_mode_enabled


class _ForwardGrad(threading.local):
    def __init__(self) -> None:
        self.before: list[bool] = []  # per open level of ours, innermost last: forward grad mode before it


_FORWARD_GRAD = _ForwardGrad()


def _open_dual_level() -> int:
    """A dual level of ours, entered (torch has one at a time: where the caller's is open, a
    nested forward mode, refused), with forward grad mode on until it closes: torch turns it off
    in an ``autograd.Function``'s forward (a user's own, or a bridge's, where another engine's
    rule runs this one), where the duals would carry no tangent and the jvp read zero with no
    error."""
    if not _FORWARD_WARMED[0]:
        _warm_forward()
    try:
        level: int = forward_ad.enter_dual_level()
    except RuntimeError as exc:  # the caller's own dual level is open
        raise _nested_forward() from exc
    _DUALS[0] += 1
    _FORWARD_GRAD.before.append(torch._C._is_fwd_grad_enabled())
    torch._C._set_fwd_grad_enabled(True)
    return level


def _close_dual_level(level: int) -> None:
    _DUALS[0] -= 1
    torch._C._set_fwd_grad_enabled(_FORWARD_GRAD.before.pop())
    forward_ad.exit_dual_level(level=level)


def _made_duals(xs: Leaves, txs: Leaves, level: int) -> Leaves:
    """Dual tensors of ``xs`` with tangents ``txs``, in the open dual level ``level`` of ours."""
    try:
        if _function_mode():
            return tuple(map(forward_ad.make_dual, xs, txs))
        return tuple(map(_make_dual, xs, txs, itertools.repeat(level, len(xs))))
    except RuntimeError as exc:  # duals of torch.func's wrapped tensors
        raise _autograd_in_func() from exc


def _unpacked(out: Leaves, level: int) -> tuple[Leaves, Leaves]:
    """Output leaves of a forward-mode call in the open dual level ``level`` split into their
    primals and tangents, each dual unpacked once (zeros where an output has no tangent; a leaf
    that is not a tensor, as it is)."""
    unpack = forward_ad.unpack_dual if _function_mode() else _unpack_dual
    primals, tangents = [], []
    for y in out:  # (a loop: on every call)
        if isinstance(y, torch.Tensor):
            primal, tangent = unpack(y, level=level)
            primals.append(primal)
            tangents.append(torch.zeros_like(primal) if tangent is None else tangent)
        else:
            primals.append(y)
            tangents.append(y)
    return tuple(primals), tuple(tangents)


def _dual_parts(value: Any) -> Any:
    """``(primal, tangent)`` of tensor ``value`` in the open dual level (tangent None: none;
    the primal ``value`` itself where no level is open)."""
    level = forward_ad._current_level
    if level < 0 or _function_mode():
        return forward_ad.unpack_dual(value)
    return _unpack_dual(value, level)


def _primal(value: Any) -> Any:
    return _dual_parts(value)[0] if isinstance(value, torch.Tensor) else value


def _tangent(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    primal, tangent = _dual_parts(value)
    return torch.zeros_like(primal) if tangent is None else tangent
