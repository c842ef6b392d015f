"""A torch.nn module as a pure function of its parameters and buffers, through torch.func.

Imported on first use of :func:`diffiface.functional`, so that ``import diffiface`` imports
no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["functional"]


def functional(module: Any) -> tuple[Callable[..., Any], dict[str, Any], dict[str, Any]]:
    """A ``torch.nn.Module`` as ``(f, params, buffers)``, a function of its tensors.

    ``f(params, buffers, *args, **kwargs)`` runs the module with those tensors in place of its
    own, through ``torch.func.functional_call(module, (params, buffers), args, kwargs)``; the
    module is not changed. ``params`` and ``buffers`` are dicts by qualified name (as
    ``named_parameters()`` and ``named_buffers()`` give them) of detached tensors sharing the
    module's storage: differentiate ``params`` as ``x``, pass ``buffers`` as a
    :class:`~diffiface.Constant` (eval mode), or clone them inside the loss and return their new
    values through ``has_aux=True`` (a BatchNorm in train mode: see the torch.nn page).

    Parameters
    ----------
    module : torch.nn.Module
        The module. Its mode (``train()``/``eval()``) is the one ``f`` runs in.

    Returns
    -------
    f : callable
        ``f(params, buffers, *args, **kwargs)``: the module's output.
    params : dict of str to torch.Tensor
        The parameters, detached (they require no grad; diffiface differentiates them).
    buffers : dict of str to torch.Tensor
        The buffers (running statistics...), detached.

    Raises
    ------
    InvalidInputError
        If ``module`` is not a ``torch.nn.Module``.

    Examples
    --------
    >>> import torch, diffiface as di
    >>> layer = torch.nn.Linear(3, 2, dtype=torch.float64)
    >>> f, params, buffers = di.functional(layer)
    >>> sorted(params), buffers
    (['bias', 'weight'], {})
    >>> inputs = torch.ones(4, 3, dtype=torch.float64)
    >>> def loss(params, buffers, inputs):
    ...     return f(params, buffers, inputs).pow(2).sum()
    >>> grad = di.gradient(loss, "torch", params, di.Constant(buffers), di.Constant(inputs))
    >>> grad["weight"].shape, layer.weight.grad is None
    (torch.Size([2, 3]), True)
    """
    import torch

    from ._errors import InvalidInputError

    if not isinstance(module, torch.nn.Module):
        raise InvalidInputError(
            f"diffiface.functional takes a torch.nn.Module, got a {type(module).__name__}. For a jax "
            "model (equinox, flax, haiku), pass its parameters as x directly: they are pytrees."
        )
    params = {name: p.detach() for name, p in module.named_parameters()}
    buffers = {name: b.detach() for name, b in module.named_buffers()}
    call = torch.func.functional_call

    def f(params: dict[str, Any], buffers: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        return call(module, (params, buffers), args, kwargs)

    f.__qualname__ = f"functional({type(module).__name__})"
    return f, params, buffers
