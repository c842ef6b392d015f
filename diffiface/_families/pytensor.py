"""pytensor's symbolic variables: what ``f`` computes with under the pytensor backend.

They stand for arrays while a graph is built, and hold no values: diffiface meets them only
inside the trace of a pytensor program (as f's output, or as the arrays ``f`` is handed), where
their numpy-like module is ``pytensor.tensor``. A symbolic variable passed as x or as a
context is refused: pass the numpy values instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from ._shared import array_words, numpy_like_complex
from ._shared import contents as contents
from ._shared import dtype_scope as dtype_scope
from ._shared import eval_shape as eval_shape
from ._shared import from_parts as from_parts
from ._shared import laid_out_ravel as laid_out_ravel
from ._shared import opened as opened
from ._shared import private_copy as private_copy  # (symbolic: nothing to write into)
from ._shared import trace_of as trace_of
from ._shared import traced as traced
from ._shared import x_refusal as x_refusal

# a symbolic variable answers its dtype as numpy names it: the tests are numpy's
from .numpy import block_like as block_like
from .numpy import cast as cast
from .numpy import from_numpy as from_numpy
from .numpy import jit_checked as jit_checked
from .numpy import layout as layout
from .numpy import leaves_test as leaves_test

NAME: Final = "pytensor"
ARRAY: Final = False
"""Not arrays: symbolic variables, which hold no values."""
PASSED_THROUGH: Final = False
ARRAY_METHODS: Final = True


def owns(cls: type) -> bool:
    basic = sys.modules.get("pytensor.graph.basic")
    return basic is not None and issubclass(cls, basic.Variable)


def _symbolic(leaf: Any) -> Exception:
    from .._errors import ArrayTypeError

    return ArrayTypeError(
        f"A pytensor symbolic variable ({leaf}) was passed where diffiface needs values: pass x, "
        "tangents and contexts as numpy arrays; under the pytensor backend f is handed symbolic "
        "variables of their shapes and dtypes, and its graph is compiled."
    )


def signature(leaf: Any) -> tuple[Any, ...]:
    shape = getattr(getattr(leaf, "type", None), "shape", None)
    return (NAME, shape, getattr(leaf, "dtype", None))


def numpy_like() -> Any:
    return sys.modules["pytensor.tensor"]


def to_numpy(leaf: Any) -> np.ndarray:
    """The value of a graph of constants (f called on numpy arrays builds one: a reference
    engine evaluates f so), evaluated; a graph of symbolic inputs has no value."""
    from pytensor.graph.basic import Constant
    from pytensor.graph.traversal import graph_inputs

    if any(not isinstance(node, Constant) for node in graph_inputs([leaf])):
        raise _symbolic(leaf)
    return np.asarray(leaf.eval())


def mirror(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    raise _symbolic(like)


def as_own(value: Any, value_family: Any, like: Any, as_numpy: Callable[[Any], np.ndarray]) -> Any:
    raise _symbolic(like)


def same(leaf: Any) -> Callable[[Any], bool] | None:
    raise _symbolic(leaf)  # (never a leaf of a call: no test that would pass it unchecked)


CODE_MODULES: Final[frozenset[str]] = frozenset()
PACKAGES: Final[frozenset[str]] = frozenset({"pytensor"})


def exchange(leaf: Any) -> None:
    raise _symbolic(leaf)


conj, parts = numpy_like_complex("pytensor.tensor")


def values(leaf: Any) -> np.ndarray:
    raise _symbolic(leaf)


describe = array_words
