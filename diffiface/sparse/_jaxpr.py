"""Global sparsity detection: the dependencies of each output number on each input number,
read from the program jax traces."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _arrays, tree
from .._errors import BackendUnavailableError, UnsupportedOperationError

if TYPE_CHECKING:
    from scipy.sparse import csr_array


def _jax() -> Any:
    try:
        import jax
    except ImportError as error:
        raise BackendUnavailableError(
            'GlobalDetector traces f with jax, which is not installed: pip install "diffiface[jax]", or use '
            "LocalDetector(...) or KnownPattern(pattern)."
        ) from error
    return jax


def _abstract(x: Any) -> tuple[list[Any], Any, bool]:
    jax = _jax()
    leaves, spec = tree.flatten(x)
    wide = any(_arrays.dtype_name(leaf) == "float64" for leaf in leaves)
    structs = []
    for leaf in leaves:
        name = _arrays.dtype_name(leaf)
        structs.append(jax.ShapeDtypeStruct(_arrays.shape(leaf), np.dtype(name)))
    return structs, spec, wide


def output_size(f: Callable[..., Any], x: Any, values: list[Any]) -> int:
    jax = _jax()
    structs, spec, wide = _abstract(x)
    import optree

    def run(*xs: Any) -> Any:
        return tree.leaves(f(optree.tree_unflatten(spec, list(xs)), *values))

    with jax.enable_x64(True) if wide else _null():
        out = jax.eval_shape(run, *structs)
    return sum(int(np.prod(o.shape, dtype=np.int64)) for o in out)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def jacobian_pattern(f: Callable[..., Any], x: Any, values: list[Any]) -> csr_array:
    raise UnsupportedOperationError(
        "GlobalDetector is not written yet; use LocalDetector(...) or KnownPattern(pattern)."
    )


def hessian_pattern(f: Callable[..., Any], x: Any, values: list[Any]) -> csr_array:
    raise UnsupportedOperationError(
        "GlobalDetector is not written yet; use LocalDetector(...) or KnownPattern(pattern)."
    )
