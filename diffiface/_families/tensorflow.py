"""TensorFlow tensors and variables: ``tf.Tensor``, ``tf.Variable``, and the variables of a
Keras 3 model on TensorFlow (``model.trainable_variables``), all derived from TensorFlow's
core tensor type. A result for any of them is a ``tf.Tensor`` of its dtype: a derivative is
never a variable, and a variable of the caller is never written."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from ._shared import array_words, held
from ._shared import block_like as block_like
from ._shared import contents as contents
from ._shared import dtype_scope as dtype_scope
from ._shared import eval_shape as eval_shape
from ._shared import exchange as exchange  # (crosses as a numpy copy: a variable's later assignments must not be seen)
from ._shared import laid_out_ravel as laid_out_ravel
from ._shared import layout as layout
from ._shared import leaves_test as leaves_test
from ._shared import opened as opened

# (tensors are immutable; a variable is read into a tensor by the adapter)
from ._shared import private_copy as private_copy
from ._shared import same as same
from ._shared import trace_of as trace_of
from ._shared import traced as traced
from ._shared import x_refusal as x_refusal

NAME: Final = "tensorflow"
ARRAY: Final = True
PASSED_THROUGH: Final = False
ARRAY_METHODS: Final = False


def owns(cls: type) -> bool:
    core = sys.modules.get("tensorflow.python.types.core")
    return core is not None and issubclass(cls, core.Tensor)


def _tf() -> Any:
    return sys.modules["tensorflow"]


def dtype_of(leaf: Any) -> Any:
    """``leaf``'s dtype as TensorFlow's (a Keras variable names its dtype by a string)."""
    dtype = leaf.dtype
    return dtype if type(dtype) is not str else _tf().as_dtype(dtype)


def signature(leaf: Any) -> tuple[Any, ...]:
    # (the dtype by its name, as the checks and messages name numpy's: "float32")
    return (NAME, tuple(leaf.shape), dtype_of(leaf).name)


def numpy_like() -> Any:
    return sys.modules["tensorflow"].experimental.numpy


def to_numpy(leaf: Any) -> np.ndarray:
    numpy = getattr(leaf, "numpy", None)
    try:
        return np.asarray(numpy() if numpy is not None else leaf)
    except (NotImplementedError, AttributeError, TypeError) as exc:  # a symbolic tensor of a tf.function
        from .._errors import UnsupportedOperationError

        raise UnsupportedOperationError(
            f"A symbolic TensorFlow tensor (shape {tuple(leaf.shape)}, inside a tf.function) reached a step "
            "that needs its values as numpy. Call diffiface outside tf.function, or with a backend that "
            "stays in TensorFlow (AutoTensorFlow())."
        ) from exc


def from_numpy(array: np.ndarray, like: Any, dtype: Any) -> Any:
    tf = _tf()
    if like is None and dtype is None:  # (the array's own dtype)
        return tf.constant(array)
    return tf.constant(array, dtype=dtype_of(like) if dtype is None else tf.as_dtype(dtype))


def _as_tensor(value: Any) -> Any:
    """A variable's value as a tensor (results are never the caller's variables)."""
    tf = _tf()
    return value if isinstance(value, tf.Tensor) else tf.convert_to_tensor(value)


def mirror(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is not _SELF:
        return from_numpy(np.asarray(as_numpy(value)), like, None)
    value = _as_tensor(value)
    dtype = dtype_of(like)
    return value if value.dtype == dtype else _tf().cast(value, dtype)


def as_own(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    if value_family is _SELF:
        return _as_tensor(value)
    if value_family is None:
        return value
    return _tf().constant(np.asarray(as_numpy(value)))


def cast(value: Any, dtype: str) -> Any:
    return _tf().cast(value, dtype)


def jit_checked(leaf: Any) -> bool:
    """A concrete (eager) tensor: a ``tf.function`` without ``reduce_retracing`` traces anew for
    each shape and dtype it meets, so a graph checks the leaf itself. A variable is not one: a
    graph takes its value, converted on each call."""
    return type(leaf) is sys.modules["tensorflow.python.framework.ops"].EagerTensor


_SELF = sys.modules[__name__]


CODE_MODULES: Final[frozenset[str]] = frozenset()
PACKAGES: Final[frozenset[str]] = frozenset({"tensorflow", "keras"})


def conj(leaf: Any) -> Any:
    return _tf().math.conj(leaf)


def parts(leaf: Any) -> tuple[Any, Any]:
    tf = _tf()
    return tf.math.real(leaf), tf.math.imag(leaf)


def from_parts(re: Any, im: Any) -> Any:
    tf = _tf()
    if owns(type(re)) and owns(type(im)):
        return tf.complex(re, im)
    return re + 1j * im


values = to_numpy
describe = array_words


def variables_of(leaf: object) -> list[Any]:
    """The variables a context's leaf is or holds: a variable, or those of a Keras model or
    layer, a ``tf.Module``, or an object holding one (:func:`~diffiface._families._shared.held`)."""
    if hasattr(leaf, "assign") and owns(type(leaf)):
        return [leaf]
    return [
        variable
        for holder in held(leaf, _holds_variables)
        for variable in (getattr(holder, "variables", None) or ())
        if hasattr(variable, "assign") and owns(type(variable))
    ]


def _holds_variables(value: object) -> bool:
    """A Keras model or layer, a ``tf.Module``: its class has ``variables`` (not read here: a
    property that builds a list)."""
    return hasattr(type(value), "variables")


def variable_values(variable: Any) -> np.ndarray:
    """A variable's values now, a numpy array of their own (a Keras variable's ``__array__``
    takes no ``copy``: read through a tensor)."""
    return np.array(_tf().convert_to_tensor(variable).numpy())


def put_back(variables: list[Any], kept: list[np.ndarray]) -> str:
    """The names of the variables whose values are no longer ``kept`` (NaN as NaN), each
    assigned its kept values again; empty where none changed."""
    written = [
        (variable, old)
        for variable, old in zip(variables, kept, strict=True)
        if not np.array_equal(variable_values(variable), old, equal_nan=True)
    ]
    for variable, old in written:
        variable.assign(old)
    return names([variable for variable, _ in written])


def names(variables: list[Any]) -> str:
    """The variables' names, as an error gives them (a Keras 3 variable's path)."""
    return ", ".join(str(getattr(variable, "path", None) or variable.name) for variable in variables)
