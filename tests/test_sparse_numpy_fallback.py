"""Issue 38, item 17: the numpy detector takes what it cannot follow as dense and never crashes.

Each function below crashed the numpy detector (or was refused) before. Each pattern is compared
with the nonzeros of dense Jacobians (Hessians): it may hold more, never fewer, and where the
structure is cheap to read (einsum, kron, polyval, stacking) it holds exactly those."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import diffiface as di
from diffiface import sparse

autograd = pytest.importorskip("autograd")
anp = pytest.importorskip("autograd.numpy")
stats = pytest.importorskip("autograd.scipy.stats")
signal = pytest.importorskip("autograd.scipy.signal")
special = pytest.importorskip("autograd.scipy.special")
linalg = pytest.importorskip("autograd.scipy.linalg")

# autograd's own advice when it differentiates np.r_ and np.c_ (its boxes in an object array)
pytestmark = pytest.mark.filterwarnings("ignore:[rc]_ is slow for array inputs:UserWarning")

N = 12
X = np.linspace(0.2, 1.3, N) + 0.0123  # off the kinks of where, floor and clip below


def _matrix(v: Any) -> Any:
    return v[:4].reshape(2, 2)


def _gram(v: Any) -> Any:
    return anp.dot(_matrix(v), _matrix(v).T)


CASES: dict[str, Callable[[Any], Any]] = {
    # 'inconsistent shapes': two traced operands of different sizes
    "polyval": lambda v: anp.polyval(v[:3], v[3]),
    "correlate": lambda v: anp.correlate(v[:6], v[6:9]),
    "kron": lambda v: anp.kron(v[:2], v[2:5]),
    "kron-2d": lambda v: anp.kron(v[:4].reshape(2, 2), v[4:10].reshape(3, 2)).ravel(),
    "inner": lambda v: anp.inner(v[:4].reshape(2, 2), v[4:10].reshape(3, 2)).ravel(),
    "dot-3d": lambda v: anp.dot(v[:8].reshape(2, 2, 2), v[8:10]).ravel(),
    "tensordot": lambda v: anp.tensordot(v[:6].reshape(2, 3), v[4:10].reshape(3, 2), axes=1).ravel(),
    "einsum": lambda v: anp.einsum("ij,j->i", v[:6].reshape(2, 3), v[7:10]),
    "einsum-diagonal": lambda v: anp.einsum("ii,i->i", v[:4].reshape(2, 2), v[8:10]),
    # named-tuple results
    "eigh": lambda v: anp.linalg.eigh(_matrix(v) + _matrix(v).T)[0],
    "svd": lambda v: anp.linalg.svd(_matrix(v), full_matrices=False)[1],
    "eig": lambda v: anp.real(anp.linalg.eig(_matrix(v) + _matrix(v).T)[0]),
    # an AxisError
    "column_stack": lambda v: anp.column_stack([v[:3], v[3:6] ** 2]).ravel(),
    # idioms that were refused
    "array-of-scalars": lambda v: anp.array([v[0], v[1] * v[2], v[3]]),
    "array-nested": lambda v: anp.array([[v[0], 1.0], [v[2] ** 2, v[5]]]).ravel(),
    "norm.logpdf": lambda v: stats.norm.logpdf(v[:4], v[4], v[5]),
    "t.logpdf": lambda v: stats.t.logpdf(v[:4], 3.0, v[6], 1.0),
    "signal.convolve": lambda v: signal.convolve(v[:5], v[5:8]),
}

SWEEP: dict[str, Callable[[Any], Any]] = {
    "sin": lambda v: anp.sin(v),
    "exp-log": lambda v: anp.exp(v) * anp.log(v),
    "abs": lambda v: anp.abs(v - 0.5),
    "maximum": lambda v: anp.maximum(v[:6], v[6:]),
    "where": lambda v: anp.where(v > 0.6, v**2, -v),
    "clip": lambda v: anp.clip(v, 0.3, 0.8),
    "power": lambda v: v[:6] ** v[6:],
    "arctan2": lambda v: anp.arctan2(v[:6], v[6:]),
    "floor": lambda v: anp.floor(v * 3) + v,
    "sinc": lambda v: anp.sinc(v),
    "sum": lambda v: anp.sum(v**2),
    "sum-axis": lambda v: anp.sum(v.reshape(3, 4) ** 2, axis=1),
    "mean-keepdims": lambda v: anp.mean(v.reshape(3, 4), axis=1, keepdims=True).ravel(),
    "prod": lambda v: anp.prod(v.reshape(4, 3), axis=1),
    "max": lambda v: anp.max(v.reshape(3, 4), axis=1),
    "std": lambda v: anp.std(v),
    "var-axis": lambda v: anp.var(v.reshape(3, 4), axis=0),
    "logsumexp": lambda v: special.logsumexp(v),
    "gammaln": lambda v: special.gammaln(v + 1),
    "norm": lambda v: anp.linalg.norm(v),
    "cumsum": lambda v: anp.cumsum(v),
    "diff": lambda v: anp.diff(v, n=2),
    "dot": lambda v: anp.dot(v.reshape(3, 4), v[:4]),
    "dot-constant": lambda v: anp.dot(np.arange(12.0).reshape(3, 4), v[:4]),
    "matmul": lambda v: (v[:6].reshape(2, 3) @ v[6:].reshape(3, 2)).ravel(),
    "outer": lambda v: anp.outer(v[:3], v[3:6]).ravel(),
    "trace": lambda v: anp.trace(v[:9].reshape(3, 3)),
    "inv": lambda v: anp.linalg.inv(v[:9].reshape(3, 3) + 3 * np.eye(3)).ravel(),
    "det": lambda v: anp.linalg.det(_matrix(v)),
    "solve": lambda v: anp.linalg.solve(_matrix(v) + 2 * np.eye(2), v[4:6]),
    "slogdet": lambda v: anp.linalg.slogdet(_matrix(v) + 2 * np.eye(2))[1],
    "cholesky": lambda v: anp.linalg.cholesky(anp.dot(_matrix(v), _matrix(v).T) + np.eye(2)).ravel(),
    "mvn.logpdf": lambda v: stats.multivariate_normal.logpdf(v[:2], v[2:4], np.eye(2)),
    "gamma.logpdf": lambda v: stats.gamma.logpdf(v[:4], 2.0),
    "concatenate": lambda v: anp.concatenate([v[:3] ** 2, v[5:7]]),
    "stack": lambda v: anp.stack([v[:4], v[4:8] * 2]).ravel(),
    "hstack": lambda v: anp.hstack([v[:2], v[3:5]]),
    "vstack": lambda v: anp.vstack([v[:4], v[4:8]]).ravel(),
    "roll": lambda v: anp.roll(v, 2) * v,
    "repeat": lambda v: anp.repeat(v[:3], 2),
    "tile": lambda v: anp.tile(v[:3], 2),
    "triu": lambda v: anp.triu(v[:9].reshape(3, 3)).ravel(),
    "diag": lambda v: anp.diag(v[:9].reshape(3, 3)),
    "index": lambda v: v[[3, 1, 1]] * v[0],
    "slice": lambda v: v[1::3] - v[::3],
    "transpose": lambda v: v.reshape(3, 4).T.ravel() * v,
    "swapaxes": lambda v: anp.swapaxes(v.reshape(3, 4), 0, 1).ravel(),
    "split": lambda v: anp.split(v, 3)[1] * 2,
    "append": lambda v: anp.append(v[:3], v[5:6]),
    "atleast_2d": lambda v: anp.atleast_2d(v[:3]).ravel() ** 2,
    "full_like": lambda v: anp.full_like(v, 2.0) * v,
    "sort": lambda v: anp.sort(v),
    "select": lambda v: anp.select([v > 0.7, v < 0.3], [v, v**2], 0.0),
    "cross": lambda v: anp.cross(v[:3], v[3:6]),
    "fft": lambda v: anp.real(anp.fft.fft(v)),
    "median": lambda v: anp.median(v),
    "expit": lambda v: special.expit(v),
    "logsumexp-axis": lambda v: special.logsumexp(v.reshape(3, 4), axis=1),
    "dirichlet.logpdf": lambda v: stats.dirichlet.logpdf(v[:3] / anp.sum(v[:3]), v[3:6]),
    "mvn-covariance": lambda v: stats.multivariate_normal.logpdf(v[:2], np.zeros(2), _gram(v) + np.eye(2)),
    "scipy-cholesky": lambda v: linalg.cholesky(_gram(v) + np.eye(2)).ravel(),
    "einsum-implicit": lambda v: anp.einsum("ij,jk", v[:6].reshape(2, 3), v[6:].reshape(3, 2)).ravel(),
    "einsum-three": lambda v: anp.einsum("i,j,k->ijk", v[:2], v[2:4], v[4:6]).ravel(),
    "tensordot-pairs": lambda v: anp.tensordot(v.reshape(2, 3, 2), v[:6].reshape(3, 2), axes=([1, 2], [0, 1])),
    "dot-vector-3d": lambda v: anp.dot(v[:2], v.reshape(3, 2, 2)).ravel(),
    "matmul-4d": lambda v: (v.reshape(1, 3, 2, 2) @ v[:4].reshape(2, 2)).ravel(),
    "kron-constant": lambda v: anp.kron(np.eye(2), v[:4].reshape(2, 2)).ravel(),
    "einsum-ellipsis": lambda v: anp.einsum(
        "...jk,...lj->...lk", v[:8].reshape(2, 2, 2), v[4:].reshape(2, 2, 2)
    ).ravel(),
    "einsum-ellipsis-implicit": lambda v: anp.einsum("...i,...i", v[:6].reshape(3, 2), v[6:].reshape(3, 2)),
    "r_": lambda v: anp.r_[v[:3], np.arange(2.0), v[5:7], 1:4],
    "c_": lambda v: anp.c_[v[:6].reshape(3, 2), np.ones((3, 1)), v[6:9]].ravel(),
    "make_diagonal": lambda v: anp.make_diagonal(v[:6].reshape(2, 3), axis1=-1, axis2=-2).ravel(),
}
"""Elementwise maps, reductions, linear algebra, stacking and indexing: a sweep of what numpy- and
autograd-written functions do."""

EXACT = {
    "polyval", "correlate", "kron", "kron-2d", "inner", "dot-3d", "tensordot", "einsum", "einsum-diagonal",
    "column_stack", "array-of-scalars", "array-nested", "norm.logpdf", "t.logpdf", "einsum-implicit",
    "einsum-three", "tensordot-pairs", "dot-vector-3d", "matmul-4d", "einsum-ellipsis", "einsum-ellipsis-implicit", "r_",
    "c_", "make_diagonal",
}  # fmt: skip
"""Where the structure is read: the pattern is the nonzeros themselves."""

DENSE_BLOCKS = {"eigh": range(4), "svd": range(4), "eig": range(4), "signal.convolve": range(8)}
"""Operations taken as dense: each output depends on each of the operation's inputs, no others."""

AUTOGRAD_CANNOT = {"polyval", "correlate", "einsum-diagonal", "median", "scipy-cholesky"}
"""autograd has no derivative of these (finite differences serve them)."""


def _dense(f: Callable[[Any], Any], backend: str) -> np.ndarray:
    # through a fresh function: a dense call of f itself would leave a plan that a later sparse
    # call of f reuses (issue 38, item 1, not this file's)
    return np.asarray(di.jacobian(lambda v: f(v), backend, X)).reshape(-1, N)


ALL = {**CASES, **SWEEP}


def _truth(name: str) -> np.ndarray:
    f = ALL[name]
    engines = ["finite_differences"] + ([] if name in AUTOGRAD_CANNOT else ["autograd"])
    return np.any([_dense(f, engine) != 0 for engine in engines], axis=0)


@pytest.mark.parametrize("name", sorted(ALL))
def test_numpy_detector_pattern_holds_every_nonzero(name: str) -> None:
    found = sparse.detect(ALL[name], X, (), sparse.GlobalDetector(tracer="numpy"), None, False)
    pattern, truth = found.pattern.toarray(), _truth(name)
    assert pattern.shape == truth.shape
    assert not (truth & ~pattern).any(), np.argwhere(truth & ~pattern)
    assert not any("could not follow f" in note for note in found.notes), found.notes
    if name in EXACT:
        assert (pattern == truth).all(), np.argwhere(pattern != truth)
    if name in DENSE_BLOCKS:
        columns = np.zeros(N, dtype=bool)
        columns[list(DENSE_BLOCKS[name])] = True
        assert pattern[:, columns].all() and not pattern[:, ~columns].any()


@pytest.mark.parametrize("engine", ["autograd", "finite_differences"])
@pytest.mark.parametrize("name", sorted(ALL))
def test_sparse_jacobian_equals_the_dense_one(name: str, engine: str) -> None:
    if engine == "autograd" and name in AUTOGRAD_CANNOT:
        with pytest.raises((NotImplementedError, ValueError)):  # autograd's own limit, not the detector's
            di.jacobian(ALL[name], di.AutoSparse(engine), X)
        return
    jac = di.jacobian(ALL[name], di.AutoSparse(engine), X)
    tolerance = 1e-6 if engine == "finite_differences" else 1e-10
    np.testing.assert_allclose(jac.toarray(), _dense(ALL[name], engine), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", sorted(set(ALL) - AUTOGRAD_CANNOT))
def test_numpy_detector_hessian_holds_every_nonzero(name: str) -> None:
    f = ALL[name]

    def g(v: Any) -> Any:
        return anp.sum(f(v) ** 2) + anp.sum(f(v))

    pattern = sparse.hessian_pattern(g, X, detector=sparse.GlobalDetector(tracer="numpy")).toarray()
    truth = autograd.hessian(g)(X) != 0
    assert not (truth & ~pattern).any(), np.argwhere(truth & ~pattern)


def _windows(v: Any) -> Any:
    """Sums of three neighbours through numpy's strides, which the tracer does not have."""
    step = v.strides[0]
    return np.lib.stride_tricks.as_strided(v, shape=(N - 2, 3), strides=(step, step)).sum(axis=1)


def test_what_the_tracer_cannot_follow_is_dense_with_a_note() -> None:
    found = sparse.detect(_windows, X, (), sparse.GlobalDetector(tracer="numpy"), None, False)
    assert found.pattern.shape == (N - 2, N) and found.pattern.toarray().all()
    assert any("could not follow f" in note and "strides" in note for note in found.notes), found.notes
    prep = di.prepare_jacobian(_windows, di.AutoSparse("finite_differences"), X)
    assert prep.detection.tracer == "numpy" and prep.pattern.toarray().all()
    jac = di.jacobian(_windows, di.AutoSparse("finite_differences"), X, prep=prep)
    np.testing.assert_allclose(jac.toarray(), _dense(_windows, "finite_differences"), rtol=1e-6, atol=1e-6)
    hessian = sparse.hessian_pattern(lambda v: np.sum(_windows(v) ** 2), X, detector=sparse.GlobalDetector("numpy"))
    assert hessian.shape == (N, N) and hessian.toarray().all()


def test_a_failure_f_catches_still_makes_it_dense() -> None:
    """f's other branch is not what f does at x: a diagonal pattern here would drop nonzeros."""

    def duck_typed(v: Any) -> Any:
        return _windows(v) if hasattr(v, "strides") else v[1:-1] * 2.0

    found = sparse.detect(duck_typed, X, (), sparse.GlobalDetector(tracer="numpy"), None, False)
    assert found.pattern.toarray().all()
    assert not (_dense(duck_typed, "finite_differences") != 0)[~found.pattern.toarray()].any()


def test_a_refusal_f_catches_is_still_a_refusal() -> None:
    def scaled(v: Any) -> Any:
        try:
            scale = float(v[0])
        except Exception:
            scale = 1.0
        return v * scale

    with pytest.raises(di.UnsupportedOperationError, match="Python number"):
        sparse.jacobian_pattern(scaled, X, detector=sparse.GlobalDetector(tracer="numpy"))


def test_fs_own_exception_reaches_the_caller_through_the_dense_fallback() -> None:
    """The trace fails, and so does f on x itself: f's error, not a dense pattern."""

    def bad(v: Any) -> Any:
        return np.lib.stride_tricks.as_strided(v, shape=(3,), strides=(v.strides[0],)) @ np.ones(4)

    with pytest.raises(ValueError, match="mismatch"):
        sparse.jacobian_pattern(bad, X, detector=sparse.GlobalDetector(tracer="numpy"))
    with pytest.raises(ValueError, match="mismatch"):
        di.jacobian(bad, di.AutoSparse("finite_differences"), X)


def test_dense_fallback_leaves_x_unchanged() -> None:
    def writes(v: Any) -> Any:
        windows = _windows(v)
        v[0] = 100.0
        return windows

    x = X.copy()
    found = sparse.detect(writes, x, (), sparse.GlobalDetector(tracer="numpy"), None, False)
    assert found.pattern.toarray().all()
    np.testing.assert_array_equal(x, X)


def test_a_dense_fallback_too_large_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the limit a dense pattern costs more than the dense Jacobian: refused, naming why."""
    from diffiface.sparse import _numpy_trace

    monkeypatch.setattr(_numpy_trace, "DENSE_LIMIT", (N - 2) * N - 1)
    with pytest.raises(di.UnsupportedOperationError, match=r"strides.*10 x 12.*too large"):
        sparse.jacobian_pattern(_windows, X, detector=sparse.GlobalDetector(tracer="numpy"))
    monkeypatch.setattr(_numpy_trace, "DENSE_LIMIT", (N - 2) * N)
    assert sparse.jacobian_pattern(_windows, X, detector=sparse.GlobalDetector(tracer="numpy")).toarray().all()


@pytest.mark.parametrize("engine", ["pytensor", "mlx"])
def test_an_engines_own_functions_are_dense_counted_by_the_engine(engine: str) -> None:
    """No tracer reads pt.sum or mx.sum: the pattern is dense, and f's outputs are counted as the
    engine runs f (on its own variables or arrays), not on a numpy copy f cannot take."""
    xp = pytest.importorskip({"pytensor": "pytensor.tensor", "mlx": "mlx.core"}[engine])

    def chain(v: Any) -> Any:
        return xp.sum(v[1:] ** 2 * v[:-1])

    def sines(v: Any) -> Any:
        return xp.sin(v[1:]) * v[:-1]

    x = np.linspace(0.1, 1.0, 6)
    prep = di.prepare_hessian(chain, di.AutoSparse(engine), x)
    assert prep.pattern.toarray().all() and any("could not follow f" in note for note in prep.detection.notes)
    hessian = di.hessian(chain, di.AutoSparse(engine), x, prep=prep)
    np.testing.assert_allclose(hessian.toarray(), np.asarray(di.hessian(chain, engine, x)), rtol=1e-6, atol=1e-6)
    jacobian = di.jacobian(sines, di.AutoSparse(engine), x)
    assert jacobian.shape == (5, 6)
    np.testing.assert_allclose(jacobian.toarray(), np.asarray(di.jacobian(sines, engine, x)), rtol=1e-6, atol=1e-6)
