"""Shared fixtures of the project's own tests: the backends, array namespaces, comparisons.

The environment is stricter than the default (as equinox's is): warnings are errors
(pyproject's ``filterwarnings``), and jax refuses implicit rank promotion and mixes of
dtypes that would silently widen or narrow. jax's x64 flag is left off: diffiface must
compute float64 in a scoped ``jax.enable_x64``, and the tests check that it does.
"""

from __future__ import annotations

import importlib.util
import math
import typing
from typing import Any

import numpy as np
import optree
import pytest

import diffiface as di
from diffiface._adapters import BACKENDS, install_hint
from diffiface.test import default_tolerances

if importlib.util.find_spec("jax") is not None:
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")


# -- backends ---------------------------------------------------------------------------------


_TEST_OPTIONS: dict[str, dict[str, Any]] = {"pytensor": {"mode": "FAST_COMPILE"}}
"""Options the parametrised tests give an engine: PyTensor compiles every graph with numba by
default, seconds per graph, where the tests build thousands of small ones (its default mode
runs the scenario suite in tests/test_engine_pytensor.py)."""


def _first_order() -> dict[str, di.Backend]:
    """One backend per row of the registry, one per mode where a backend has modes (torch's),
    so that a new adapter is tested as soon as it is registered."""
    backends: dict[str, di.Backend] = {}
    for row in BACKENDS:
        modes = typing.get_args(typing.get_type_hints(row.config).get("mode"))
        if modes:
            backends.update({f"{row.name}-{mode}": row.config(mode=mode) for mode in modes})  # type: ignore[call-arg]
        else:
            backends[row.name] = row.config(**_TEST_OPTIONS.get(row.name, {}))
    return backends


FIRST_ORDER: dict[str, di.Backend] = _first_order()
"""Every first-order backend, by test id."""

SECOND_ORDER: dict[str, di.Backend] = {
    "fd-over-jax": di.SecondOrder(di.AutoFiniteDifferences(), di.AutoJAX()),
    "fd-over-torch": di.SecondOrder(di.AutoFiniteDifferences(), di.AutoTorch()),
    "jax-over-jax": di.SecondOrder(di.AutoJAX(), di.AutoJAX()),
    "torch-over-torch": di.SecondOrder(di.AutoTorch(mode="func"), di.AutoTorch(mode="func")),
    # the autograd mode twice: double backward (forward over it would lose the tangent)
    "torch-autograd-over-torch-autograd": di.SecondOrder(di.AutoTorch(), di.AutoTorch()),
    "autograd-over-autograd": di.SecondOrder(di.AutoAutograd(), di.AutoAutograd()),
}
"""Combinations of two backends, for the second-order operators."""

ALL_BACKENDS = {**FIRST_ORDER, **SECOND_ORDER}
BLACK_BOX = tuple(row.name for row in BACKENDS if row.any_array_type)
"""Backends that only evaluate f, so f may be written for any framework."""


@pytest.fixture(autouse=True)
def _x64_flag_left_as_found() -> Any:
    """No test may flip jax's global x64 flag (diffiface never does: it scopes jax.enable_x64),
    since the tests after it in the same worker would compute in another precision."""
    import sys

    jax_module = sys.modules.get("jax")
    before = jax_module.config.read("jax_enable_x64") if jax_module is not None else None
    yield
    jax_module = sys.modules.get("jax")
    if before is not None and jax_module is not None:
        assert jax_module.config.read("jax_enable_x64") == before, "the test changed jax's global x64 flag"


def require(backend: di.Backend | str) -> di.Backend:
    """``backend`` as an object; the test is skipped, naming the extra, if its engine is missing."""
    backend = ALL_BACKENDS.get(backend, backend) if isinstance(backend, str) else backend
    if not di.available(backend):
        for part in (backend.outer, backend.inner) if isinstance(backend, di.SecondOrder) else (backend,):
            if not di.available(part):
                pytest.skip(f"the {part.name} backend is not installed: {install_hint(part)}")
    return backend


def backend_params(names: Any = None) -> list[Any]:
    names = FIRST_ORDER if names is None else names
    return [pytest.param(name, id=name) for name in names]


@pytest.fixture(params=list(FIRST_ORDER))
def backend_id(request: pytest.FixtureRequest) -> str:
    """The test id of each first-order backend (skipping those not installed)."""
    require(request.param)
    return str(request.param)


@pytest.fixture
def backend(backend_id: str) -> di.Backend:
    """Each first-order backend object, skipped with the extra to install when missing."""
    return FIRST_ORDER[backend_id]


@pytest.fixture(params=list(SECOND_ORDER))
def second_order_backend(request: pytest.FixtureRequest) -> di.Backend:
    return require(request.param)


# -- writing f once for every framework -------------------------------------------------------


def namespace(tree: Any) -> Any:
    """The array namespace of the first leaf of ``tree``: what ``f`` computes with, whatever
    the backend hands it (numpy arrays or floats, torch tensors, jax arrays or tracers,
    autograd boxes)."""
    leaves = optree.tree_leaves(tree)
    module = type(leaves[0]).__module__ if leaves else "numpy"
    if module.startswith("torch"):
        import torch

        return torch
    if module.startswith("jax"):
        import jax.numpy as jnp

        return jnp
    if module.startswith("autograd"):
        import autograd.numpy as anp

        return anp
    if module.startswith("pytensor"):
        import pytensor.tensor as pt

        return pt
    if module.startswith("mlx"):
        import mlx.core

        return mlx.core
    if module.startswith(("tensorflow", "keras")):
        import tensorflow as tf

        return tf.experimental.numpy
    return np


# -- comparing results ------------------------------------------------------------------------


def native_tree(backend_id: str, tree: Any, dtype: str) -> Any:
    """``tree`` with every leaf as the backend's own array of ``dtype`` (numpy for the others)."""

    def leaf(a: Any) -> Any:
        a = np.asarray(a, dtype=dtype)
        if backend_id == "jax":
            import jax.numpy as jnp

            return jnp.asarray(a)
        if backend_id.startswith("torch"):
            import torch

            return torch.from_numpy(a.copy())
        if backend_id == "mlx":
            import mlx.core as mx

            return mx.array(a, dtype=getattr(mx, dtype))  # (without a dtype, float64 becomes float32)
        if backend_id.startswith("tensorflow"):
            import tensorflow as tf

            return tf.constant(a)
        return a

    return optree.tree_map(leaf, tree)


def to_numpy(leaf: Any) -> np.ndarray:
    if type(leaf).__module__.startswith("torch"):
        return leaf.detach().cpu().numpy()  # type: ignore[no-any-return]
    return np.asarray(leaf)


def tolerance(backend_id: str, dtype: Any, second_order: bool = False) -> tuple[float, float]:
    """``(rtol, atol)`` for a backend, a dtype and an operator order."""
    float32 = np.dtype(dtype) == np.float32
    row = next((r for r in BACKENDS if r.name == backend_id), None)
    if row is not None and row.float64_precision == "float32":
        float32 = True  # an engine whose float64 is accurate to float32 only (mlx)
    finite = backend_id == "finite_differences" or (second_order and backend_id.startswith("fd-over"))
    if backend_id == "scipy":
        return (1e-3, 1e-3) if float32 else (1e-7, 1e-8)
    if finite and second_order:
        return (1e-2, 1e-2) if float32 else (1e-6, 1e-6)
    if finite:
        return (2e-3, 2e-3) if float32 else (1e-7, 1e-8)
    # float32: diffiface.test's tolerances (float32 kernels differ across CPUs by more than 1e-5)
    return default_tolerances("float32") if float32 else (1e-10, 1e-10)


def assert_tree_close(actual: Any, expected: Any, rtol: float, atol: float, dtype: Any = None) -> None:
    """Same tree structure (``None`` is structure, so a ``None`` result where zeros are
    expected fails), same shapes, dtype ``dtype`` for array leaves, values close."""
    a_paths, a_leaves, a_spec = optree.tree_flatten_with_path(actual)
    e_leaves, e_spec = optree.tree_flatten(expected)
    assert a_spec == e_spec, f"structure: got {a_spec}, expected {e_spec}"
    for path, a, e in zip(a_paths, a_leaves, e_leaves, strict=True):
        where = "".join(f"[{p!r}]" for p in path) or "<root>"
        got = to_numpy(a)
        assert got.shape == np.shape(e), f"{where}: shape {got.shape}, expected {np.shape(e)}"
        if dtype is not None and not isinstance(a, float):
            assert got.dtype == np.dtype(dtype), f"{where}: dtype {got.dtype}, expected {np.dtype(dtype)}"
        np.testing.assert_allclose(got, np.asarray(e, dtype=np.float64), rtol=rtol, atol=atol, err_msg=where)


def flat(tree: Any) -> np.ndarray:
    """The leaves of a numpy tree as one float64 vector."""
    leaves = optree.tree_leaves(tree)
    if not leaves:
        return np.zeros(0)
    return np.concatenate([np.asarray(leaf, dtype=np.float64).reshape(-1) for leaf in leaves])


def unflat(vector: np.ndarray, like: Any, dtype: Any = np.float64) -> Any:
    """``vector`` shaped as the tree ``like`` (Python floats stay floats)."""
    leaves, spec = optree.tree_flatten(like)
    out, start = [], 0
    for leaf in leaves:
        shape = np.shape(leaf)
        size = math.prod(shape)
        piece = vector[start : start + size].reshape(shape)
        out.append(float(piece) if isinstance(leaf, float) else piece.astype(dtype))
        start += size
    return optree.tree_unflatten(spec, out)


def nested(matrix: np.ndarray, y_like: Any, x_like: Any) -> Any:
    """A dense matrix as diffiface nests Jacobians: y-structure of x-structure, blocks of
    shape ``y_i.shape + x_j.shape``."""
    y_leaves, y_spec = optree.tree_flatten(y_like)
    x_leaves, x_spec = optree.tree_flatten(x_like)
    rows, r = [], 0
    for y in y_leaves:
        m = math.prod(np.shape(y))
        blocks, c = [], 0
        for x in x_leaves:
            n = math.prod(np.shape(x))
            blocks.append(matrix[r : r + m, c : c + n].reshape(np.shape(y) + np.shape(x)))
            c += n
        rows.append(optree.tree_unflatten(x_spec, blocks))
        r += m
    return optree.tree_unflatten(y_spec, rows)
