"""torch tensors (a DTensor is never gathered into one numpy array)."""

from __future__ import annotations

import operator
import sys
import threading
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from ._shared import Contents, MetaLeaves, array_words
from ._shared import block_like as block_like
from ._shared import dtype_scope as dtype_scope
from ._shared import eval_shape as eval_shape
from ._shared import jit_checked as jit_checked
from ._shared import laid_out_ravel as laid_out_ravel
from ._shared import layout as layout
from ._shared import opened as opened
from ._shared import trace_of as trace_of
from ._shared import traced as traced

NAME: Final = "torch"
ARRAY: Final = True
PASSED_THROUGH: Final = False
ARRAY_METHODS: Final = True
CODE_MODULES: Final[frozenset[str]] = frozenset()
PACKAGES: Final[frozenset[str]] = frozenset({"torch"})


def owns(cls: type) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and issubclass(cls, torch.Tensor)


def signature(leaf: Any) -> tuple[Any, ...]:
    return (NAME, tuple(leaf.shape), leaf.dtype, leaf.device)


def numpy_like() -> Any:
    return sys.modules["torch"]


def to_numpy(leaf: Any) -> np.ndarray:
    if type(leaf) is not sys.modules["torch"].Tensor and hasattr(leaf, "device_mesh"):
        from .._errors import UnsupportedOperationError

        raise UnsupportedOperationError(
            f"A DTensor (shape {tuple(leaf.shape)}, placements {tuple(leaf.placements)}) reached a step that "
            "works on one whole numpy array, which would gather it in one process; diffiface never does. Use "
            "AutoTorch() on DTensors, AutoFiniteDifferences() only for a jvp along a DTensor tangent, and "
            "diffiface.test.check_gradients for checks (random directions, collective)."
        )
    # (a conjugate view, torch.conj(z), has no memory of its own for numpy to read)
    tensor = leaf.detach().cpu().resolve_conj().resolve_neg()
    if tensor.dtype is sys.modules["torch"].bfloat16:  # (numpy has no bfloat16 of its own)
        values: np.ndarray = tensor.float().numpy()
        try:
            return values.astype("bfloat16")  # (where ml_dtypes has given numpy one)
        except TypeError:
            return values
    return tensor.numpy()  # type: ignore[no-any-return]


def from_numpy(array: np.ndarray, like: Any, dtype: Any) -> Any:
    torch = sys.modules["torch"]
    if array.dtype.name == "bfloat16":  # (ml_dtypes' own, which torch refuses: via float32, which holds it exactly)
        array = array.astype(np.float32)
        if like is None and dtype is None:
            dtype = torch.bfloat16
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = np.array(array, order="C")  # not np.ascontiguousarray: it makes 0-d arrays 1-d
    tensor = torch.from_numpy(array)
    if like is None:  # (the array's own dtype, on the CPU)
        return tensor if dtype is None else tensor.to(dtype=dtype)
    return tensor.to(device=like.device, dtype=like.dtype if dtype is None else dtype)


def mirror(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is not _SELF:
        return from_numpy(np.asarray(as_numpy(value)), like, None)
    # (computed on like's device; out of the graph unless the call kept it: the adapter's guard detaches)
    return value if value.dtype == like.dtype else value.to(like.dtype)


def as_own(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is _SELF or value_family is None:
        return value  # (a tensor: out of the graph unless the call kept it: the adapter's guard detaches)
    array = np.asarray(as_numpy(value))
    return from_numpy(array, like, getattr(sys.modules["torch"], array.dtype.name))


def cast(value: Any, dtype: str) -> Any:
    return value.to(getattr(sys.modules["torch"], dtype))


def same(leaf: Any) -> Callable[[Any], bool]:
    """The test that a later tensor has the prepared one's shape, dtype and device."""
    shape, dtype, device = leaf.shape, leaf.dtype, leaf.device

    def test(value: Any) -> bool:
        return value.shape == shape and value.dtype == dtype and value.device == device  # type: ignore[no-any-return]

    return test


_meta = operator.attrgetter("shape", "dtype", "device")  # (compared in C, no frame per leaf)


def leaves_test(leaves: list[Any]) -> Callable[[list[Any]], bool]:
    """The test of a list of leaves all of this family, read inline."""
    return MetaLeaves(leaves, _meta)


def exchange(leaf: Any) -> Any:
    """``leaf`` as another framework may take it through dlpack: detached, contiguous, its lazy
    negation and conjugation applied (dlpack carries the memory alone, and a negated view, such
    as ``conj(z).imag``, would cross with its sign lost), and a copy where it is a parameter
    (whose later updates the other must not see)."""
    if leaf.is_leaf and leaf.requires_grad:
        leaf = leaf.clone()
    return leaf.detach().resolve_neg().resolve_conj().contiguous()


def conj(leaf: Any) -> Any:
    return leaf.conj().resolve_conj()


def parts(leaf: Any) -> tuple[Any, Any]:
    torch = sys.modules["torch"]
    if leaf.is_leaf and leaf.requires_grad and not inside_a_call():
        # (a parameter of the caller's, which no torch differentiation reads here: its parts are
        # numbers, as a real parameter is; parts that kept its graph would read as an outer
        # differentiation to a black box. Inside a diffiface torch call the graph is kept.)
        leaf = leaf.detach()
    return torch.real(leaf).clone(), torch.imag(leaf).clone()  # (not views: a black box may perturb them)


class _Calls(threading.local):
    def __init__(self) -> None:
        self.keep: list[bool] = []  # per open call, innermost last: does it keep its graph?


CALLS = _Calls()
"""The diffiface torch calls open on this thread, which the torch adapter's guard opens and
closes: kept here, below the adapters, since whether one is open decides what a tensor's parts
are (:func:`parts`)."""


def inside_a_call() -> bool:
    """Whether this thread is inside a diffiface torch call (f is being differentiated)."""
    return bool(CALLS.keep)


def from_parts(re: Any, im: Any) -> Any:
    if owns(type(im)):
        return sys.modules["torch"].complex(re, im)
    return re + 1j * im


def private_copy(leaf: Any) -> Any:
    """A copy f may write into: torch checks an in-place write to an inference tensor only after
    the kernel ran, so f never gets the caller's tensor itself."""
    return leaf.clone()


_SELF = sys.modules[__name__]


def x_refusal(leaf: Any) -> str | None:
    """Why ``leaf``, a leaf of x, has nothing to differentiate at; None where it has values."""
    if leaf.is_meta:
        return (
            "is a meta tensor, which has a shape but no values to differentiate at. Create it "
            "on a real device (torch.ones(..., device='cpu'))."
        )
    return None


def values(leaf: Any) -> np.ndarray:
    """Its values as numpy, read through ``tolist`` (a torch.func tensor has no storage for
    numpy to read)."""
    return np.asarray(leaf.detach().tolist())


def describe(signature: tuple[Any, ...]) -> str:
    return f"{array_words(signature)} on {signature[3]}"


def contents(value: Any, kept: int) -> Contents | _DeviceContents:
    """A tensor's contents, through its numpy view where it has one, else a copy on its device."""
    found = _numpy_view(value)
    if found is None:
        return _DeviceContents(value)
    return Contents(*found, _numpy_view, kept)


def _numpy_view(value: Any) -> tuple[np.ndarray, Any] | None:
    """A tensor's numpy view (no copy) and its shape and dtype, or None for a tensor with no
    such view."""
    torch = sys.modules["torch"]
    if not isinstance(value, torch.Tensor):
        return None
    if value.device.type != "cpu" or value.layout is not torch.strided or value.is_conj() or value.is_neg():
        return None
    try:
        array = value.detach().numpy()
    except (TypeError, RuntimeError):  # (a dtype numpy lacks, a tensor subclass)
        return None
    return array, (NAME, value.shape, value.dtype)


class _DeviceContents:
    """A tensor with no numpy view (on an accelerator, or of a dtype numpy lacks): a copy on
    its device, compared with ``torch.equal`` (a tensor holding NaN never compares equal: the
    call prepares again)."""

    __slots__ = ("copy",)

    def __init__(self, tensor: Any) -> None:
        self.copy = tensor.detach().clone()

    def holds(self, value: Any) -> bool:
        copy = self.copy
        if (value.shape, value.dtype, value.device, value.layout) != (copy.shape, copy.dtype, copy.device, copy.layout):
            return False
        try:
            return bool(sys.modules["torch"].equal(value.detach(), copy))
        except RuntimeError:  # (a layout torch.equal does not compare)
            return False


ModuleParts = tuple[Any, bool, dict[str, Any], dict[str, Any], dict[str, Any]]
"""A module, its train or eval mode and which objects its parameters, buffers and submodules are."""


def module_parts(module: Any) -> ModuleParts:
    """What :func:`restructured` compares a module with later (its own dicts, read directly:
    ``named_modules`` builds each prefix and a set of those seen)."""
    return (module, module.training, dict(module._parameters), dict(module._buffers), dict(module._modules))


def restructured(structure: list[ModuleParts]) -> bool:
    """Whether f changed a module's parameters, buffers or submodules (which objects they are)
    or its train or eval mode; each change put back."""
    found = False
    for module, training, *kept in structure:
        now = (module._parameters, module._buffers, module._modules)
        for current, old in zip(now, kept, strict=True):
            if len(current) != len(old) or any(current.get(k) is not v for k, v in old.items()):
                current.clear()
                current.update(old)
                found = True
        if module.training is not training:
            module.training = training
            found = True
    return found
