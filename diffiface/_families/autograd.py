"""autograd's boxes: the values an enclosing autograd call traces (numpy arrays otherwise)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from ._shared import array_words, numpy_like_complex
from ._shared import contents as contents
from ._shared import dtype_scope as dtype_scope
from ._shared import eval_shape as eval_shape
from ._shared import exchange as exchange
from ._shared import from_parts as from_parts
from ._shared import laid_out_ravel as laid_out_ravel
from ._shared import private_copy as private_copy
from ._shared import trace_of as trace_of
from ._shared import x_refusal as x_refusal

# a box answers its value's shape and dtype: the tests are numpy's
from .numpy import block_like as block_like
from .numpy import cast as cast
from .numpy import from_numpy as from_numpy
from .numpy import jit_checked as jit_checked
from .numpy import layout as layout
from .numpy import leaves_test as leaves_test
from .numpy import same as same
from .numpy import to_numpy as to_numpy
from .numpy import values as values

NAME: Final = "autograd"
ARRAY: Final = False
PASSED_THROUGH: Final = True
"""Its values belong to an enclosing autograd call's trace, which differentiates through them:
results pass them on untouched."""
ARRAY_METHODS: Final = True
CODE_MODULES: Final[frozenset[str]] = frozenset()
PACKAGES: Final[frozenset[str]] = frozenset({"autograd"})


def owns(cls: type) -> bool:
    return cls.__module__.startswith("autograd")


def signature(leaf: Any) -> tuple[Any, ...]:
    return (NAME, tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", type(leaf)))


def numpy_like() -> Any:
    return sys.modules["autograd.numpy"]


def mirror(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    return value


def as_own(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is None or value_family is _SELF:
        return value
    return np.asarray(as_numpy(value))


conj, parts = numpy_like_complex("autograd.numpy")


def traced(leaf: Any) -> Any:
    """The value a box traces (itself perhaps a box of an outer trace)."""
    return leaf._value


def opened(result: Any) -> Any:
    """``result`` with autograd's traced containers opened: autograd traces a tuple, list or
    dict that a primitive returns (``np.split``'s list, ``eigh``'s named tuple) or that f builds
    with ``autograd.builtins`` as one value, whose items it takes through its own primitive.
    Opened, they are the Python containers of those items, each an array autograd traces, as
    any other engine's output. Nothing to open where no autograd trace runs."""
    builtins = sys.modules.get("autograd.builtins")
    if builtins is None or sys.modules["autograd.tracer"].trace_stack.top < 0:
        return result
    return _open(result, builtins.SequenceBox, builtins.DictBox)


def _open(value: Any, sequence: type, mapping: type) -> Any:
    box: Any = value  # (autograd's boxes: indexing one is its traced read of an item)
    if isinstance(value, sequence):
        inner = box._value
        items = [_open(box[i], sequence, mapping) for i in range(len(inner))]
        return type(inner)(*items) if hasattr(inner, "_fields") else type(inner)(items)
    if isinstance(value, mapping):
        inner = box._value
        return type(inner)((key, _open(box[key], sequence, mapping)) for key in inner)
    cls = type(value)
    if cls is tuple or cls is list:
        return cls(_open(item, sequence, mapping) for item in value)
    if cls is dict:
        return {key: _open(item, sequence, mapping) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return cls(*(_open(item, sequence, mapping) for item in value))
    return value


_SELF = sys.modules[__name__]


def numpy_wrappers() -> tuple[Any, list[Any], list[tuple[str, Any]]]:
    """autograd's modules that wrap numpy's and scipy's functions, those imported (for the
    numpy sparsity tracer, diffiface.sparse._numpy_trace): its ``numpy_wrapper`` (None where
    not imported), the namespaces f reads its functions from (``numpy_wrapper`` and
    ``autograd.numpy``), and its scipy modules by name."""
    module = sys.modules.get("autograd.numpy.numpy_wrapper")
    namespaces = {id(m): m for m in (module, sys.modules.get("autograd.numpy")) if m is not None}
    scipy_modules = [
        (name, found)
        for name, found in list(sys.modules.items())
        if name.startswith("autograd.scipy") and found is not None
    ]
    return module, list(namespaces.values()), scipy_modules


describe = array_words
