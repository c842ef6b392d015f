"""Bidirectional colorings: every nonzero read alone from one product, never more products
than the better one-sided coloring, 3 for an arrowhead at any size; and AutoSparse using them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import diffiface as di
from diffiface import sparse

sp = pytest.importorskip("scipy.sparse", reason="the bicoloring tests compare with scipy's sparse matrices")


def _arrowhead(n: int) -> Any:
    pattern = sp.lil_array((n, n), dtype=bool)
    pattern.setdiag(True)
    pattern[0, :] = True
    pattern[:, 0] = True
    return sp.csr_array(pattern)


def _random_pattern(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    m, n = rng.integers(1, 40, size=2)
    pattern = rng.random((m, n)) < rng.uniform(0.02, 0.3)
    for _ in range(rng.integers(0, 3)):  # a few dense rows and columns: where one side loses
        if rng.random() < 0.5:
            pattern[rng.integers(m), :] = True
        else:
            pattern[:, rng.integers(n)] = True
    return pattern


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("order", sparse.ORDERS)
def test_bidirectional_decompresses_exactly(seed: int, order: str) -> None:
    pattern = _random_pattern(seed)
    values = np.where(pattern, np.random.default_rng(seed + 100).standard_normal(pattern.shape), 0.0)
    coloring = sparse.color_jacobian(pattern, mode="bidirectional", order=order)
    assert coloring.mode == "bidirectional"
    forward = values @ coloring.seeds
    reverse = coloring.row_seeds.T @ values
    assert forward.shape[1] + reverse.shape[0] == coloring.count
    np.testing.assert_array_equal(coloring.decompress(forward, reverse).toarray(), values)
    one_sided = min(
        sparse.color_jacobian(pattern, mode="column", order=order).count,
        sparse.color_jacobian(pattern, mode="row", order=order).count,
    )
    assert coloring.count <= one_sided
    auto = sparse.color_jacobian(pattern, mode="auto", order=order)
    assert auto.count <= one_sided
    if auto.mode != "bidirectional":  # auto takes a split wherever one with both sides needs fewer
        assert coloring.count >= one_sided or not (coloring.row_count and coloring.column_count)


def test_arrowhead_takes_three_products_at_ten_thousand() -> None:
    pattern = _arrowhead(10_000)
    assert sparse.color_jacobian(pattern, mode="column").count == 10_000
    coloring = sparse.color_jacobian(pattern)  # auto
    assert coloring.mode == "bidirectional"
    assert coloring.count == 3
    assert coloring.sides == {"forward": 2, "reverse": 1}


def _arrow_numpy(x: Any) -> Any:
    import autograd.numpy as anp

    return anp.concatenate([anp.sum(x**2)[None], x[1:] * x[0] + anp.sin(x[1:])])


@pytest.mark.parametrize("backend", ["jax", "torch", "torch-func", "autograd"])
def test_autosparse_takes_the_bidirectional_coloring(backend: str) -> None:
    pytest.importorskip({"jax": "jax", "torch": "torch", "torch-func": "torch", "autograd": "autograd"}[backend])
    x: Any = np.linspace(0.1, 1.0, 30)
    if backend == "jax":
        import jax.numpy as jnp

        def f(x: Any) -> Any:
            return jnp.concatenate([jnp.sum(x**2)[None], x[1:] * x[0] + jnp.sin(x[1:])])
    elif backend.startswith("torch"):
        import torch

        x = torch.tensor(x)

        def f(x: Any) -> Any:
            return torch.cat([torch.sum(x**2)[None], x[1:] * x[0] + torch.sin(x[1:])])
    else:
        f = _arrow_numpy
    for coloring in ("auto", "bidirectional"):
        prep = di.prepare_jacobian(f, di.AutoSparse(backend, coloring=coloring), x)
        assert prep.coloring.mode == "bidirectional"
        assert prep.coloring.sides == {"forward": 2, "reverse": 1}
        result = di.jacobian(f, di.AutoSparse(backend, coloring=coloring), x, prep=prep)
        matrix = result.to_dense().numpy() if hasattr(result, "to_dense") else np.asarray(result.todense())
        dense = di.jacobian(f, backend, x)
        np.testing.assert_allclose(matrix, np.asarray(dense), rtol=1e-12, atol=1e-12)
        checked = di.AutoSparse(backend, coloring=coloring, check=True, dense=True)
        np.testing.assert_allclose(np.asarray(di.jacobian(f, checked, x)), np.asarray(dense), rtol=1e-12)


def test_bidirectional_needs_a_reverse_mode() -> None:
    with pytest.raises(di.InvalidBackendOptionError, match="reverse mode"):
        di.AutoSparse("finite_differences", coloring="bidirectional")
    with pytest.raises(di.InvalidInputError, match="bidirectional"):
        sparse.color_jacobian(np.eye(3), mode="sideways")
