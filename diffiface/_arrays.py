"""What kind of array a leaf is, and moving leaves between kinds, without importing frameworks.

"Is this a torch tensor?" is answered through ``sys.modules``: a torch tensor can only exist
once torch has been imported, so a framework that is not imported needs no checking.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Literal

import numpy as np

Kind = Literal["python", "numpy", "torch", "jax", "autograd", "other"]

_KIND_BY_TYPE: dict[type, Kind] = {
    float: "python",
    int: "python",
    bool: "python",
    complex: "python",
    np.ndarray: "numpy",
}


def kind(leaf: Any) -> Kind:
    """The array kind of one leaf."""
    cls = type(leaf)
    found = _KIND_BY_TYPE.get(cls)
    if found is not None:
        return found
    found = _classify(cls)
    if found != "other":
        _KIND_BY_TYPE[cls] = found
    return found


def kind_of_type(cls: type) -> Kind:
    """The array kind of the leaves of class ``cls``."""
    found = _KIND_BY_TYPE.get(cls)
    return found if found is not None else _classify(cls)


def _classify(cls: type) -> Kind:
    if issubclass(cls, np.ma.MaskedArray):
        raise _masked_refused()
    if issubclass(cls, (np.ndarray, np.generic)):
        return "numpy"
    if issubclass(cls, (float, int, complex)):
        return "python"
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(cls, torch.Tensor):
        return "torch"
    jax = sys.modules.get("jax")
    if jax is not None and (issubclass(cls, jax.Array) or issubclass(cls, jax.core.Tracer)):
        return "jax"
    if cls.__module__.startswith("autograd"):
        return "autograd"
    return "other"


def _masked_refused() -> Exception:
    from ._errors import InvalidInputError

    # (never cached as a kind: every leaf of the class is refused, wherever it is met)
    return InvalidInputError(
        "A numpy masked array (np.ma.MaskedArray) was passed as x, as a tangent or in a context. "
        "No engine differentiates through its mask: jax refuses it, the others would drop the mask "
        "and compute on the hidden values too. Pass its values, a.filled(fill_value) or a.data, and "
        "its mask as a di.Constant(a.mask) that f applies (np.where(mask, 0.0, x), say)."
    )


def numpy_like(leaf: Any) -> Any:
    """The numpy-like module for ``leaf``'s framework (``torch``, ``jax.numpy``,
    ``autograd.numpy``, else ``numpy``), already imported since the leaf exists."""
    k = kind(leaf)
    if k == "torch":
        return sys.modules["torch"]
    if k == "jax":
        return sys.modules["jax.numpy"]
    if k == "autograd":
        return sys.modules["autograd.numpy"]
    return np


def is_array(leaf: Any) -> bool:
    """True for numpy, torch and jax arrays (not Python numbers)."""
    return kind(leaf) in ("numpy", "torch", "jax")


def dtype_name(leaf: Any) -> str:
    """The dtype of a leaf as a plain string ('float32', 'int64', ...)."""
    if isinstance(leaf, bool):
        return "bool"
    if isinstance(leaf, int):
        return "int64"
    if isinstance(leaf, float):
        return "float64"
    if isinstance(leaf, complex):
        return "complex128"
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return type(leaf).__name__
    try:
        return _DTYPE_NAMES[dtype]  # (str() of a dtype costs more than the rest of a quick call's checks)
    except (KeyError, TypeError):
        # (a non-native byte order, ">f8" as read from FITS or HDF5, is the same number type)
        name = str(native_dtype(dtype))
        name = name[6:] if name.startswith("torch.") else name
        with contextlib.suppress(TypeError):  # an unhashable dtype of some other library: not kept
            _DTYPE_NAMES[dtype] = name
        return name


_DTYPE_NAMES: dict[Any, str] = {}


def in_native_byte_order(array: np.ndarray) -> np.ndarray:
    """``array`` itself where its bytes are in this machine's order, else a copy that is: a
    big-endian ``>f8`` array (as read from FITS or HDF5) is a float64 array, which jax and
    torch take only in native order."""
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def native_dtype(dtype: Any) -> Any:
    """``dtype`` in this machine's byte order (a numpy dtype; any other dtype as it is)."""
    if isinstance(dtype, np.dtype) and not dtype.isnative:
        return dtype.newbyteorder("=")
    return dtype


def shape(leaf: Any) -> tuple[int, ...]:
    return tuple(getattr(leaf, "shape", ()))


_FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}


def is_float_dtype(name: str) -> bool:
    return name in _FLOAT_DTYPES


def leaf_signature(leaf: Any) -> tuple[Any, ...]:
    """What a prep depends on for one array leaf: kind, shape, dtype (and device for torch)."""
    k = kind(leaf)
    if k == "torch":
        return (k, tuple(leaf.shape), leaf.dtype, leaf.device)
    if k == "python":
        return (k, type(leaf))
    if k == "other":
        return (k, type(leaf), *_foreign_tree(leaf))
    if k == "jax" and not isinstance(leaf, sys.modules["jax"].core.Tracer):
        # where its shards live: results are laid out as x (diffiface._placement)
        return (k, tuple(leaf.shape), leaf.dtype, leaf.sharding)
    return (k, tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", type(leaf)))


def _foreign_tree(leaf: Any) -> tuple[Any, ...]:
    """Structure and leaf shapes of a pytree that only jax knows (a flax or equinox object)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return ()
    leaves, treedef = jax.tree_util.tree_flatten(leaf)
    if len(leaves) == 1 and leaves[0] is leaf:
        return ()
    return (treedef, tuple((tuple(getattr(a, "shape", ())), getattr(a, "dtype", None)) for a in leaves))


def to_numpy(leaf: Any) -> np.ndarray:
    """A numpy copy or view of a leaf of any kind (detached from any graph)."""
    k = kind(leaf)
    if k == "torch":
        if type(leaf) is not sys.modules["torch"].Tensor and hasattr(leaf, "device_mesh"):
            raise _gather_refused(leaf)
        # (a conjugate view, torch.conj(z), has no memory of its own for numpy to read)
        return leaf.detach().cpu().resolve_conj().resolve_neg().numpy()  # type: ignore[no-any-return]
    if k == "python":
        return np.asarray(leaf, dtype=np.complex128 if isinstance(leaf, complex) else np.float64)
    return np.asarray(leaf)


def _gather_refused(leaf: Any) -> Exception:
    from ._errors import UnsupportedOperationError

    return UnsupportedOperationError(
        f"A DTensor (shape {tuple(leaf.shape)}, placements {tuple(leaf.placements)}) reached a step that "
        "works on one whole numpy array, which would gather it in one process; diffiface never does. Use "
        "AutoTorch() on DTensors, AutoFiniteDifferences() only for a jvp along a DTensor tangent, and "
        "diffiface.test.check_gradients for checks (random directions, collective)."
    )


def from_numpy(array: np.ndarray, like: Any, dtype: Any = None) -> Any:
    """``array`` as a leaf of ``like``'s kind, on its device, with ``like``'s dtype unless given."""
    k = kind(like)
    if k == "python":
        return array.item() if array.ndim == 0 else array
    if k == "torch":
        torch = sys.modules["torch"]
        if not (array.flags.c_contiguous and array.flags.writeable):
            array = np.array(array, order="C")  # not np.ascontiguousarray: it makes 0-d arrays 1-d
        tensor = torch.from_numpy(array)
        return tensor.to(device=like.device, dtype=like.dtype if dtype is None else dtype)
    if k == "jax":
        jnp = sys.modules["jax.numpy"]
        return jnp.asarray(array, dtype=like.dtype if dtype is None else dtype)
    return np.asarray(array, dtype=getattr(like, "dtype", None) if dtype is None else dtype)


def family(kinds: set[Kind]) -> Kind:
    """The one array kind of a set of leaves; Python numbers go with any kind."""
    arrays = kinds - {"python"}
    if not arrays:
        return "python"
    if len(arrays) == 1:
        return next(iter(arrays))
    return "other"


class _GraphState(threading.local):
    """Whether the results of the current call keep their autograd graph.

    Set by an adapter at the start of each call (torch: when an input carried an outer
    graph, a nested call), read where results are converted: a result is detached only
    where the call's inputs carried no graph."""

    keep = False


graph_state = _GraphState()
