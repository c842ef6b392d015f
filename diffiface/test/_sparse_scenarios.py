"""Sparse scenarios: functions with sparse Jacobians and Hessians, their patterns and analytic results.

Each :class:`SparseScenario` is a :class:`Scenario` of ``jacobian``, ``value_and_jacobian``,
``hessian`` or ``value_gradient_and_hessian`` whose reference is the dense result, worked out
by hand, and which carries the right sparsity pattern (for ``KnownPattern``). The functions
use only indexing and arithmetic, so they run on numpy, torch, jax and autograd, and jax can
trace them (``GlobalDetector``). :func:`sparse_backends` wraps engines in
:class:`~diffiface.AutoSparse` with each detector, ``dense=True``, so that
:func:`test_differentiation` compares them with the dense references.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .._backends import Backend
from .._contexts import Constant
from .._sparse_operators import AutoSparse
from ._scenario import Scenario

__all__ = [
    "SparseScenario",
    "engines_own_code_scenarios",
    "run_sparse",
    "run_sparse_part",
    "sparse_backends",
    "sparse_scenarios",
]


@dataclasses.dataclass(frozen=True, eq=False)
class SparseScenario(Scenario):
    """A :class:`Scenario` with the sparsity pattern of its Jacobian or Hessian (a boolean
    m-by-n array in :func:`diffiface.tree.ravel` order)."""

    pattern: Any = None


#: Finite differences leave ~1e-6 of rounding where a Hessian is zero (detected as nonzero by a
#: conservative pattern or by differences at a point); first-order ones are much closer.
_RTOL, _ATOL = 1e-5, 1e-6
_HESSIAN_ATOL = 1e-5


def _banded(n: int, band: int, seed: int) -> np.ndarray:
    """A random n-by-n matrix with ``band`` diagonals beside the main one (lower ``band // 2``)."""
    lower = band // 2
    upper = band - lower
    rows, cols = np.indices((n, n))
    mask = (cols - rows <= upper) & (rows - cols <= lower)
    return np.where(mask, np.random.default_rng(seed).uniform(0.5, 1.5, (n, n)), 0.0)


def _elementwise(x: Any) -> Any:
    return x**3 - 2.0 * x


def _quartic(x: Any) -> Any:
    return (x**4).sum()


def _differences(x: Any) -> Any:
    return (x[1:] - x[:-1]) ** 2


def _differences_sum(x: Any) -> Any:
    return ((x[1:] - x[:-1]) ** 2).sum()


def _linear(x: Any, matrix: Any) -> Any:
    return matrix @ x


def _quadratic(x: Any, matrix: Any) -> Any:
    return 0.5 * (x * (matrix @ x)).sum()


def _arrowhead(x: Any) -> Any:
    return {"head": (x**2).sum(), "tail": x[1:] * x[0]}


def _arrowhead_sum(x: Any) -> Any:
    return x[0] * (x[1:] ** 2).sum() + (x**2).sum()


def _laplacian(u: Any) -> Any:
    inner = u[1:-1, 1:-1]
    return 4.0 * inner - u[:-2, 1:-1] - u[2:, 1:-1] - u[1:-1, :-2] - u[1:-1, 2:] + inner**3


def _separable(x: Any) -> Any:
    return (x[:, 0] * x[:, 1] * x[:, 2] + x[:, 0] ** 2 * x[:, 1]).sum()


def _jacobian_cases(n: int, bands: Sequence[int]) -> list[tuple[Any, ...]]:
    """(name, f, x, contexts, y, dense Jacobian) of each Jacobian case."""
    x = np.linspace(0.3, 1.7, n)
    cases: list[tuple[Any, ...]] = [("elementwise", _elementwise, x, (), _elementwise(x), np.diag(3 * x**2 - 2.0))]
    d = x[1:] - x[:-1]
    jac = np.zeros((n - 1, n))
    jac[np.arange(n - 1), np.arange(n - 1)] = -2 * d
    jac[np.arange(n - 1), np.arange(1, n)] = 2 * d
    cases.append(("differences", _differences, x, (), _differences(x), jac))
    for band in bands:
        matrix = _banded(n, band, band)
        cases.append((f"banded{band}_linear", _linear, x, (Constant(matrix),), matrix @ x, matrix))
    head = 2 * x
    tail = np.zeros((n - 1, n))
    tail[:, 0] = x[1:]
    tail[np.arange(n - 1), np.arange(1, n)] = x[0]
    cases.append(("arrowhead", _arrowhead, x, (), _arrowhead(x), {"head": head, "tail": tail}))
    k = 5
    u = np.linspace(0.1, 0.9, k * k).reshape(k, k)
    jac4 = np.zeros((k - 2, k - 2, k, k))
    for i in range(k - 2):
        for j in range(k - 2):
            jac4[i, j, i + 1, j + 1] = 4.0 + 3 * u[i + 1, j + 1] ** 2
            for di, dj in ((-1, 0), (1, 0), (0, -1), (0, 1)):
                jac4[i, j, i + 1 + di, j + 1 + dj] = -1.0
    cases.append(("laplacian2d", _laplacian, u, (), _laplacian(u), jac4))
    return cases


def _hessian_cases(n: int, bands: Sequence[int]) -> list[tuple[Any, ...]]:
    """(name, f, x, contexts, value, gradient, dense Hessian) of each Hessian case."""
    x = np.linspace(0.3, 1.7, n)
    cases: list[tuple[Any, ...]] = []
    cases.append(("elementwise_sum", _quartic, x, (), _quartic(x), 4 * x**3, np.diag(12 * x**2)))
    d = x[1:] - x[:-1]
    gradient = np.zeros(n)
    gradient[:-1] -= 2 * d
    gradient[1:] += 2 * d
    diff = np.zeros((n - 1, n))
    diff[np.arange(n - 1), np.arange(n - 1)] = -1
    diff[np.arange(n - 1), np.arange(1, n)] = 1
    cases.append(("differences_sum", _differences_sum, x, (), _differences_sum(x), gradient, 2 * diff.T @ diff))
    for band in bands:
        half = _banded(n, band, band)
        matrix = half + half.T  # symmetric, with the band on both sides
        cases.append(
            (f"banded{band}_quadratic", _quadratic, x, (Constant(matrix),), _quadratic(x, matrix), matrix @ x, matrix)
        )
    hess = np.diag(np.full(n, 2.0))
    hess[np.arange(1, n), np.arange(1, n)] += 2 * x[0]
    hess[0, 1:] = hess[1:, 0] = 2 * x[1:]
    grad = 2 * x
    grad[0] += (x[1:] ** 2).sum()
    grad[1:] += 2 * x[0] * x[1:]
    cases.append(("arrowhead_sum", _arrowhead_sum, x, (), _arrowhead_sum(x), grad, hess))
    blocks = 4
    v = np.linspace(0.2, 1.4, blocks * 3).reshape(blocks, 3)
    hess4 = np.zeros((blocks, 3, blocks, 3))
    grad2 = np.zeros((blocks, 3))
    for b in range(blocks):
        v0, v1, v2 = v[b]
        grad2[b] = (v1 * v2 + 2 * v0 * v1, v0 * v2 + v0**2, v0 * v1)
        block = np.array([[2 * v1, v2 + 2 * v0, v1], [v2 + 2 * v0, 0.0, v0], [v1, v0, 0.0]])
        hess4[b, :, b, :] = block
    cases.append(("separable_blocks", _separable, v, (), _separable(v), grad2, hess4))
    return cases


# --- functions written with each engine's own library: the default detector reads each ----------


_KERNEL = (1.0, 0.0, -2.0)  # a zero tap: the convolution is a map of two diagonals


def _tridiagonal_torch(x: Any) -> Any:
    import torch

    return torch.cat([x[:1], x[1:-1] ** 2 - x[:-2] + torch.sin(x[2:]), x[-1:]])


def _conv1d_torch(x: Any) -> Any:
    import torch

    kernel = torch.tensor(_KERNEL, dtype=x.dtype).reshape(1, 1, 3)
    return torch.nn.functional.conv1d(x.reshape(1, 1, -1), kernel, padding=1).reshape(-1)


def _arrowhead_torch(x: Any) -> Any:
    import torch

    return torch.cat([torch.sum(x**2).reshape(1), x[1:] * x[0]])


def _rosenbrock_torch(x: Any) -> Any:
    return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()


def _tridiagonal_autograd(x: Any) -> Any:
    import autograd.numpy as anp

    return anp.concatenate([x[:1], x[1:-1] ** 2 - x[:-2] + anp.sin(x[2:]), x[-1:]])


def _roll_autograd(x: Any) -> Any:
    import autograd.numpy as anp

    return anp.roll(x, 1) * x


def _cumsum_autograd(x: Any) -> Any:
    import autograd.numpy as anp

    return anp.cumsum(x) ** 2


def _rosenbrock_autograd(x: Any) -> Any:
    import autograd.numpy as anp

    return anp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


def _convolve_numpy(x: Any) -> Any:
    return np.convolve(x, np.array(_KERNEL), mode="same")


def _diff_numpy(x: Any) -> Any:
    return np.sum(np.diff(x) ** 2)


def _tridiagonal_jacobian(x: np.ndarray) -> np.ndarray:
    n = x.size
    jac = np.zeros((n, n))
    jac[0, 0] = jac[-1, -1] = 1.0
    i = np.arange(1, n - 1)
    jac[i, i] = 2 * x[i]
    jac[i, i - 1] = -1.0
    jac[i, i + 1] = np.cos(x[i + 1])
    return jac


def _two_diagonals(n: int) -> np.ndarray:
    """The Jacobian of y_i = x_{i-1} - 2 x_{i+1} (zero beyond the ends)."""
    return np.eye(n, k=-1) - 2.0 * np.eye(n, k=1)


def _arrowhead_jacobian(x: np.ndarray) -> np.ndarray:
    n = x.size
    jac = np.zeros((n, n))
    jac[0] = 2 * x
    jac[np.arange(1, n), 0] = x[1:]
    jac[np.arange(1, n), np.arange(1, n)] = x[0]
    return jac


def _rosenbrock_value_gradient_hessian(x: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    n = x.size
    inner = x[1:] - x[:-1] ** 2
    value = float(np.sum(100 * inner**2 + (1 - x[:-1]) ** 2))
    gradient = np.zeros(n)
    gradient[:-1] += -400 * x[:-1] * inner - 2 * (1 - x[:-1])
    gradient[1:] += 200 * inner
    hessian = np.zeros((n, n))
    i = np.arange(n - 1)
    hessian[i, i] += 1200 * x[:-1] ** 2 - 400 * x[1:] + 2
    hessian[i + 1, i + 1] += 200
    hessian[i, i + 1] = hessian[i + 1, i] = -400 * x[:-1]
    return value, gradient, hessian


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def engines_own_code_scenarios(quick: bool = False) -> list[SparseScenario]:
    """Functions written with torch (x torch tensors), autograd.numpy and numpy (x numpy arrays),
    each with an analytic reference: the default detector reads each with the tracer of its code
    (torch's make_fx graph, the numpy tracer). The frameworks each runs on are its own (numpy-
    written ones on finite differences and scipy alone). Frameworks not installed give none."""
    n = 12
    x = np.linspace(0.3, 1.4, n)
    cases: list[tuple[str, Any, Any, str, Any, frozenset[str]]] = []
    diff = np.eye(n - 1, n, k=1) - np.eye(n - 1, n)
    if _installed("torch"):
        import torch

        xt = torch.tensor(x)
        torch_only = frozenset({"torch"})
        cases += [
            ("torch_tridiagonal", _tridiagonal_torch, xt, "jacobian", _tridiagonal_jacobian(x), torch_only),
            ("torch_conv1d", _conv1d_torch, xt, "jacobian", _two_diagonals(n), torch_only),
            ("torch_arrowhead", _arrowhead_torch, xt, "jacobian", _arrowhead_jacobian(x), torch_only),
            (
                "torch_rosenbrock",
                _rosenbrock_torch,
                xt,
                "hessian",
                _rosenbrock_value_gradient_hessian(x)[2],
                torch_only,
            ),
        ]
    if _installed("autograd"):
        own = frozenset({"autograd"})
        rolled = np.roll(x, 1)
        roll_jac = np.diag(rolled)
        roll_jac[np.arange(n), np.arange(-1, n - 1) % n] = x
        csum = np.cumsum(x)
        cumsum_jac = np.tril(np.ones((n, n))) * (2 * csum)[:, None]
        cases += [
            ("autograd_tridiagonal", _tridiagonal_autograd, x, "jacobian", _tridiagonal_jacobian(x), own),
            ("autograd_roll", _roll_autograd, x, "jacobian", roll_jac, own),
            ("autograd_cumsum", _cumsum_autograd, x, "jacobian", cumsum_jac, own),
            ("autograd_rosenbrock", _rosenbrock_autograd, x, "hessian", _rosenbrock_value_gradient_hessian(x)[2], own),
        ]
    numpy_only = frozenset({"numpy"})
    cases += [
        ("numpy_convolve", _convolve_numpy, x, "jacobian", _convolve_jacobian(n), numpy_only),
        ("numpy_diff", _diff_numpy, x, "hessian", 2 * diff.T @ diff, numpy_only),
    ]
    wanted = {"torch_arrowhead", "autograd_rosenbrock", "numpy_convolve"}
    scenarios = []
    for name, f, point, operator, reference, frameworks in cases:
        if quick and name not in wanted:
            continue
        pattern = reference != 0
        if frameworks == {"torch"}:  # results mirror x: torch tensors
            import torch

            reference = torch.tensor(reference)
        scenarios.append(
            SparseScenario(
                name,
                f,
                point,
                operator,
                (),
                reference=reference,
                tags=frozenset({"sparse", "jacobian" if operator == "jacobian" else "hessian", "own_code"}),
                pattern=pattern,
                rtol=_RTOL,
                atol=_ATOL if operator == "jacobian" else _HESSIAN_ATOL,
                frameworks=frameworks,
            )
        )
    return scenarios


def _convolve_jacobian(n: int) -> np.ndarray:
    """The Jacobian of np.convolve(x, (1, 0, -2), "same"): y_k = x_{k+1} - 2 x_{k-1}."""
    return np.eye(n, k=1) - 2.0 * np.eye(n, k=-1)


def _pattern(dense: Any, rows: int) -> np.ndarray:
    leaves = dense.values() if isinstance(dense, dict) else [dense]
    flat = np.concatenate([np.asarray(leaf).reshape(-1) for leaf in leaves])
    pattern: np.ndarray = flat.reshape(rows, -1) != 0
    return pattern


def sparse_scenarios(quick: bool = False) -> list[SparseScenario]:
    """The sparse cases: elementwise maps; the differences ``(x[i+1]-x[i])**2``; banded linear
    and quadratic forms (bands 5, 10 and 20); an arrowhead; a 2-D Laplacian residual; the
    block-diagonal Hessian of a sum of separable terms. Each as ``jacobian`` and
    ``value_and_jacobian`` (or ``hessian`` and ``value_gradient_and_hessian``), with analytic
    references and patterns; ``quick``: the plain operators of four cases (the differences,
    the arrowhead, the sum of differences, the separable blocks). Then the functions written with
    each engine's own library (:func:`engines_own_code_scenarios`)."""
    n = 30
    bands = () if quick else (5, 10, 20)
    wanted = {"differences", "arrowhead", "differences_sum", "separable_blocks"}
    scenarios = []
    for name, f, x, contexts, y, jac in _jacobian_cases(n, bands):
        if quick and name not in wanted:
            continue
        size = int(np.size(y)) if not isinstance(y, dict) else sum(int(np.size(v)) for v in y.values())
        pattern = _pattern(jac, size)
        scenarios.append(
            SparseScenario(
                name,
                f,
                x,
                "jacobian",
                contexts,
                reference=jac,
                tags=frozenset({"sparse", "jacobian"}),
                pattern=pattern,
                rtol=_RTOL,
                atol=_ATOL,
            )
        )
        if not quick:
            scenarios.append(
                SparseScenario(
                    name,
                    f,
                    x,
                    "value_and_jacobian",
                    contexts,
                    reference=(y, jac),
                    tags=frozenset({"sparse", "jacobian"}),
                    pattern=pattern,
                    rtol=_RTOL,
                    atol=_ATOL,
                )
            )
    for name, f, x, contexts, value, gradient, hess in _hessian_cases(n, bands):
        if quick and name not in wanted:
            continue
        pattern = _pattern(hess, int(np.size(x)))
        tags = frozenset({"sparse", "hessian"})
        scenarios.append(
            SparseScenario(
                name,
                f,
                x,
                "hessian",
                contexts,
                reference=hess,
                tags=tags,
                pattern=pattern,
                rtol=_RTOL,
                atol=_HESSIAN_ATOL,
            )
        )
        if not quick:
            scenarios.append(
                SparseScenario(
                    name,
                    f,
                    x,
                    "value_gradient_and_hessian",
                    contexts,
                    reference=(value, gradient, hess),
                    tags=tags,
                    pattern=pattern,
                    rtol=_RTOL,
                    atol=_HESSIAN_ATOL,
                )
            )
    return scenarios + engines_own_code_scenarios(quick)


def sparse_backends(engines: Iterable[Backend], scenario: SparseScenario) -> list[AutoSparse]:
    """Each engine wrapped in :class:`~diffiface.AutoSparse` with each detector (global, local,
    and the scenario's known pattern), ``dense=True``."""
    from .. import sparse

    detectors = (sparse.GlobalDetector(), sparse.LocalDetector(), sparse.KnownPattern(scenario.pattern))
    return [AutoSparse(engine, detector=d, dense=True) for engine in engines for d in detectors]


def run_sparse(
    engines: Sequence[Backend], quick: bool = False, indices: Iterable[int] | None = None, **options: Any
) -> Any:
    """:func:`test_differentiation` of the sparse scenarios (all, or those at ``indices`` of
    :func:`sparse_scenarios`) on :func:`sparse_backends` of ``engines``; one :class:`Report`.
    ``options`` go to test_differentiation."""
    from ._running import Report, test_differentiation

    scenarios = sparse_scenarios(quick=quick)
    rows = []
    for index in range(len(scenarios)) if indices is None else indices:
        scenario = scenarios[index]
        report = test_differentiation(sparse_backends(engines, scenario), [scenario], raise_on_failure=False, **options)
        rows += report.rows
    return Report(rows)


def run_sparse_part(quick: bool, engines: Sequence[Backend], index: int) -> list[Any]:
    """The rows of one sparse scenario (by index), for a worker process of the main job."""
    return list(run_sparse(engines, quick=quick, indices=[index]).rows)
