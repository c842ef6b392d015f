"""torch tensors (a DTensor is never gathered into one numpy array)."""

from __future__ import annotations

import sys
from typing import Any, Final

import numpy as np

NAME: Final = "torch"
ARRAY: Final = True


def owns(cls: type) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and issubclass(cls, torch.Tensor)


def signature(leaf: Any) -> tuple[Any, ...]:
    return (NAME, tuple(leaf.shape), leaf.dtype, leaf.device)


def numpy_like() -> Any:
    return sys.modules["torch"]


def to_numpy(leaf: Any) -> np.ndarray:
    if type(leaf) is not sys.modules["torch"].Tensor and hasattr(leaf, "device_mesh"):
        raise _gather_refused(leaf)
    # (a conjugate view, torch.conj(z), has no memory of its own for numpy to read)
    return leaf.detach().cpu().resolve_conj().resolve_neg().numpy()  # type: ignore[no-any-return]


def _gather_refused(leaf: Any) -> Exception:
    from .._errors import UnsupportedOperationError

    return UnsupportedOperationError(
        f"A DTensor (shape {tuple(leaf.shape)}, placements {tuple(leaf.placements)}) reached a step that "
        "works on one whole numpy array, which would gather it in one process; diffiface never does. Use "
        "AutoTorch() on DTensors, AutoFiniteDifferences() only for a jvp along a DTensor tangent, and "
        "diffiface.test.check_gradients for checks (random directions, collective)."
    )


def from_numpy(array: np.ndarray, like: Any, dtype: Any) -> Any:
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = np.array(array, order="C")  # not np.ascontiguousarray: it makes 0-d arrays 1-d
    tensor = sys.modules["torch"].from_numpy(array)
    return tensor.to(device=like.device, dtype=like.dtype if dtype is None else dtype)
