"""The detectors of each engine's own code (torch's make_fx graphs, numpy's and autograd.numpy's
array protocols): conservative on corpora of each style, chosen by the default detector, and
refusing what depends on values. Also the sparse-side reproductions of issue 18."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import diffiface as di
from diffiface import sparse

torch = pytest.importorskip("torch")
anp = pytest.importorskip("autograd.numpy")
autograd = pytest.importorskip("autograd")

N = 7
RNG = np.random.default_rng(0)
A = RNG.standard_normal((N, N))
A[np.abs(A) < 0.9] = 0.0  # a constant matrix with structural zeros
INDEX = np.array([3, 0, 6, 1])
KERNEL = np.array([1.0, 0.0, -2.0])  # a zero tap: conv1d as a banded map of two diagonals


def _torch_corpus() -> dict[str, Callable[[Any], Any]]:
    a, index = torch.tensor(A), torch.tensor(INDEX)
    kernel = torch.tensor(KERNEL).reshape(1, 1, 3)

    def setitem(x: Any) -> Any:
        y = torch.zeros_like(x)
        y[1:] = x[:-1] ** 2
        return y + x

    def scaled_slice(x: Any) -> Any:
        y = x.clone()
        y[2:4] *= x[0]
        return y

    def diagonal(x: Any) -> Any:
        y = torch.zeros(3, 3, dtype=x.dtype)
        y.diagonal().copy_(x[:3])
        return (y @ x[3:6]).reshape(-1)

    def through_transpose(x: Any) -> Any:
        y = torch.zeros(N, 2, dtype=x.dtype)
        y.T[0] = x
        y.T[1] += x.flip(0) ** 2
        return y.reshape(-1)

    def view_of_view(x: Any) -> Any:
        y = torch.zeros_like(x)
        y[1:][1:].add_(x[:-2])
        return y * 2

    linear = torch.nn.Linear(N, 3).double()

    return {
        "scaled-slice": scaled_slice,
        "diagonal": diagonal,
        "through-transpose": through_transpose,
        "view-of-view": view_of_view,
        "linear-of-vector": linear,  # (torch's matmul of a vector squeezes its result in place)
        "unfold": lambda x: x.unfold(0, 3, 2).sum(1),
        "conv-transpose": lambda x: torch.nn.functional.conv_transpose1d(x.reshape(1, 1, -1), kernel, stride=2).reshape(
            -1
        ),
        "constant-mask": lambda x: x[torch.tensor(np.arange(N) % 3 != 1)] ** 2 * x[:5],
        "cat": lambda x: torch.cat([x[:2] * 3, torch.sin(x[2:]) * x[:-2]]),
        "stack": lambda x: torch.stack([x, x.flip(0)]).sum(0),
        "roll": lambda x: torch.roll(x, 2) * x,
        "cumsum": lambda x: torch.cumsum(x, 0),
        "conv1d": lambda x: torch.nn.functional.conv1d(x.reshape(1, 1, -1), kernel, padding=1).reshape(-1),
        "indexing": lambda x: x[index] ** 2 + (a @ x)[index],
        "diff": lambda x: torch.diff(x) * x[1:],
        "matmul": lambda x: (x[:6].reshape(2, 3) @ x[1:].reshape(3, 2)).reshape(-1),
        "softmax": lambda x: torch.softmax(x[:6].reshape(2, 3), dim=1).reshape(-1),
        "reductions": lambda x: torch.stack([x.sum(), x[:3].prod(), x.max(), torch.linalg.norm(x[2:])]),
        "where": lambda x: torch.where(x > 0, torch.exp(x), x.roll(1)),
        "pad": lambda x: torch.nn.functional.pad(x, (1, 2))[:N] * x,
        "setitem": setitem,
        "tridiagonal": lambda x: torch.cat([x[:1], x[1:-1] ** 2 - x[:-2] + torch.sin(x[2:]), x[-1:]]),
    }


def _numpy_corpus(xp: Any) -> dict[str, Callable[[Any], Any]]:
    corpus = {
        "cat": lambda x: xp.concatenate([x[:2] * 3, xp.sin(x[2:]) * x[:-2]]),
        "stack": lambda x: xp.sum(xp.stack([x, x[::-1]]), axis=0),
        "roll": lambda x: xp.roll(x, 2) * x,
        "cumsum": lambda x: xp.cumsum(x),
        "indexing": lambda x: x[INDEX] ** 2 + xp.dot(A, x)[INDEX],
        "diff": lambda x: xp.diff(x) * x[1:],
        "diff2": lambda x: xp.diff(x, n=2),
        "matmul": lambda x: (x[:6].reshape(2, 3) @ x[1:].reshape(3, 2)).reshape(-1),
        "reductions": lambda x: xp.stack([xp.sum(x), xp.prod(x[:3]), xp.max(x), xp.linalg.norm(x[2:])]),
        "where": lambda x: xp.where(x > 0, xp.exp(x), xp.roll(x, 1)),
        "tridiagonal": lambda x: xp.concatenate([x[:1], x[1:-1] ** 2 - x[:-2] + xp.sin(x[2:]), x[-1:]]),
        "outer": lambda x: xp.outer(x[:2], x[3:5]).ravel(),
        "tanh-ratio": lambda x: xp.tanh(x) / (1 + x[::-1] ** 2),
    }
    if xp is np:  # (autograd differentiates neither)
        corpus["conv1d"] = lambda x: np.convolve(x, KERNEL, mode="same")
        corpus["sort"] = lambda x: np.sort(x)

        def setitem(x: Any) -> Any:
            y = np.zeros_like(x)
            y[1:] = x[:-1] ** 2
            return y + x

        corpus["setitem"] = setitem

        def view_then_write(x: Any) -> Any:  # (the view sees the later write, as numpy's does)
            a = np.zeros_like(x)
            head = a[:3]
            a[0] = x[5]
            a[1] = x[0] * x[1]
            return head * 1.0 + a[3:6]

        corpus["view-then-write"] = view_then_write
        corpus["pad-mean"] = lambda x: np.pad(x[:4], 2, mode="mean")
        corpus["pad-ramp"] = lambda x: np.pad(x[:4], 2, mode="linear_ramp", end_values=0.0)
        corpus["average-weights"] = lambda x: np.atleast_1d(np.average(x[:3], weights=np.exp(x[3:6])))

        # a probe of the detectors found each of these read as sparser than it is (no error)
        def astype_alias(x: Any) -> Any:  # (numpy's astype(copy=False) returns the array itself)
            y = x * 1.0
            z = y.astype(np.float64, copy=False)
            y[0] = x[5]
            return z * 1.0

        corpus["astype-alias"] = astype_alias
        if np.lib.NumpyVersion(np.__version__) >= "2.1.0":  # (numpy 2.1 names np.clip's bounds min=, max=)
            corpus["clip-min-max"] = lambda x: np.clip(x[1:], min=x[0], max=x[0] + 0.5)
        corpus["pad-odd"] = lambda x: np.pad(x, (2, 0), mode="reflect", reflect_type="odd")
        corpus["initial"] = lambda x: np.stack(
            [np.sum(x[:3], initial=x[5]), np.max(x[:3], initial=x[5] + 10), np.add.reduce(x[:3], initial=x[4])]
        )
        corpus["full-like-list"] = lambda x: np.full_like(x[:2], [x[5], x[4]])
        corpus["complex-abs"] = lambda x: np.abs(x[:3] + 1j * x[3:6]) * x[6]
        corpus["ravel-F"] = lambda x: x[:6].reshape(2, 3).ravel("F") * x[6]
        corpus["flatten-F"] = lambda x: x[:6].reshape(2, 3).flatten("F") ** 2
    else:
        corpus["conv1d"] = lambda x: x[:-2] * KERNEL[2] + x[2:] * KERNEL[0]
    return corpus


TORCH = _torch_corpus()
NUMPY = _numpy_corpus(np)
AUTOGRAD = _numpy_corpus(anp)


def _points(count: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.uniform(-1.5, 1.5, N) for _ in range(count)]


def _torch_jacobian(f: Callable[[Any], Any], x: np.ndarray) -> np.ndarray:
    return torch.autograd.functional.jacobian(f, torch.tensor(x)).reshape(-1, N).numpy()


def _torch_hessian(f: Callable[[Any], Any], x: np.ndarray) -> np.ndarray:
    g = lambda t: (f(t) ** 2).sum() + f(t).sum()  # noqa: E731
    return torch.autograd.functional.hessian(g, torch.tensor(x)).numpy()


def _missing(pattern: Any, dense: np.ndarray) -> list[tuple[int, int]]:
    found = pattern.toarray()
    assert found.shape == dense.shape
    return [tuple(ij) for ij in np.argwhere((dense != 0) & ~found)]


# --- conservative on each corpus -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TORCH))
def test_torch_detector_never_misses_a_nonzero(name: str) -> None:
    f = TORCH[name]
    detector = sparse.GlobalDetector(tracer="torch")
    x = torch.tensor(_points(1)[0])
    pattern = sparse.jacobian_pattern(f, x, detector=detector)
    hessian = sparse.hessian_pattern(lambda t: (f(t) ** 2).sum() + f(t).sum(), x, detector=detector)
    for point in _points():
        assert not _missing(pattern, _torch_jacobian(f, point)), name
        assert not _missing(hessian, _torch_hessian(f, point)), name


@pytest.mark.parametrize("name", sorted(NUMPY))
def test_numpy_detector_never_misses_a_nonzero(name: str) -> None:
    f = NUMPY[name]
    pattern = sparse.jacobian_pattern(f, _points(1)[0], detector=sparse.GlobalDetector(tracer="numpy"))
    for point in _points():
        dense = np.asarray(di.jacobian(f, "finite_differences", point)).reshape(-1, N)
        assert not _missing(pattern, dense), name


@pytest.mark.parametrize("name", sorted(AUTOGRAD))
def test_autograd_detector_never_misses_a_nonzero(name: str) -> None:
    f = AUTOGRAD[name]

    def g(x: Any) -> Any:
        return anp.sum(f(x) ** 2) + anp.sum(f(x))

    detector = sparse.GlobalDetector(tracer="numpy")
    pattern = sparse.jacobian_pattern(f, _points(1)[0], detector=detector)
    hessian = sparse.hessian_pattern(g, _points(1)[0], detector=detector)
    for point in _points():
        assert not _missing(pattern, autograd.jacobian(f)(point).reshape(-1, N)), name
        assert not _missing(hessian, autograd.hessian(g)(point)), name


def test_structure_is_read_exactly_where_it_is_known() -> None:
    """Conservative, yet not dense: banded maps give their bands, indexing its rows."""
    tri = np.eye(N, dtype=bool) | np.eye(N, k=-1, dtype=bool) | np.eye(N, k=1, dtype=bool)
    tri[0] = tri[-1] = False
    tri[0, 0] = tri[-1, -1] = True
    torch_x = torch.tensor(_points(1)[0])
    assert (sparse.jacobian_pattern(TORCH["tridiagonal"], torch_x).toarray() == tri).all()
    assert (sparse.jacobian_pattern(AUTOGRAD["tridiagonal"], _points(1)[0]).toarray() == tri).all()
    conv = sparse.jacobian_pattern(TORCH["conv1d"], torch_x).toarray()
    assert (conv == (np.eye(N, k=-1, dtype=bool) | np.eye(N, k=1, dtype=bool))).all()  # the zero tap drops
    cumsum = sparse.jacobian_pattern(NUMPY["cumsum"], _points(1)[0]).toarray()
    assert (cumsum == np.tril(np.ones((N, N), dtype=bool))).all()
    diff = sparse.jacobian_pattern(lambda x: np.diff(x), _points(1)[0]).toarray()
    assert (diff == (np.eye(N - 1, N, dtype=bool) | np.eye(N - 1, N, k=1, dtype=bool))).all()
    rosenbrock = sparse.hessian_pattern(
        lambda x: anp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2), _points(1)[0]
    ).toarray()
    band = np.abs(np.subtract.outer(np.arange(N), np.arange(N))) <= 1
    assert (rosenbrock == band).all()


def test_transposed_convolution_is_banded() -> None:
    """A transposed convolution with a constant kernel: exactly the nonzeros of its Jacobian (strides,
    padding, output padding, dilation, groups, zero taps), where it was dense."""
    conv_t = torch.nn.functional.conv_transpose1d
    kernel_1d = torch.tensor(KERNEL).reshape(1, 1, 3)
    kernel_2d = torch.tensor(RNG.standard_normal((4, 3, 2, 3)))
    kernel_2d[0, 1] = 0.0
    kernel_2d[:, :, 1, 0] = 0.0
    cases = {
        "strided": (lambda x: conv_t(x.reshape(1, 1, -1), kernel_1d, stride=2).reshape(-1), 7),
        "padded": (
            lambda x: conv_t(x.reshape(1, 1, -1), kernel_1d, stride=2, padding=1, output_padding=1, dilation=2).reshape(
                -1
            ),
            7,
        ),
        "grouped-2d": (
            lambda x: torch.nn.functional.conv_transpose2d(
                x.reshape(2, 4, 2, 3), kernel_2d, stride=(2, 1), padding=(0, 1), groups=2
            ).reshape(-1),
            48,
        ),
        "kernel-from-x": (lambda x: conv_t(x[:6].reshape(1, 2, 3), x[6:].reshape(2, 1, 3), stride=2).reshape(-1), 12),
    }
    rng = np.random.default_rng(2)
    for name, (f, n) in cases.items():
        found = sparse.detect(f, torch.tensor(rng.standard_normal(n)), (), sparse.GlobalDetector("torch"), None, False)
        dense = torch.autograd.functional.jacobian(f, torch.tensor(rng.standard_normal(n))).reshape(-1, n).numpy()
        assert not found.notes, name
        assert (found.pattern.toarray() == (dense != 0)).all(), name


# --- the default detector follows the engine ---------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "f", "tracer", "as_torch"),
    [
        ("torch", TORCH["tridiagonal"], "torch", True),
        ("torch-func", TORCH["conv1d"], "torch", True),
        ("autograd", AUTOGRAD["tridiagonal"], "numpy", False),
        ("finite_differences", AUTOGRAD["indexing"], "numpy", False),
        ("finite_differences", NUMPY["conv1d"], "numpy", False),
    ],
    ids=["torch", "torch-func", "autograd", "fd-autograd-code", "fd-numpy-code"],
)
def test_default_detector_works_on_the_engines_own_code(
    backend: str, f: Callable[[Any], Any], tracer: str, as_torch: bool
) -> None:
    x = _points(1)[0]
    xs = torch.tensor(x) if as_torch else x
    sparse_backend = di.AutoSparse(backend)
    prep = di.prepare_jacobian(f, sparse_backend, xs)
    assert prep.detection.tracer == tracer
    result = di.jacobian(f, sparse_backend, xs, prep=prep)
    dense = di.jacobian(f, backend, xs)
    matrix = result.to_dense().numpy() if as_torch else result.toarray()
    expected = dense.numpy() if as_torch else np.asarray(dense)
    np.testing.assert_allclose(matrix, expected, rtol=1e-7, atol=1e-9)


def test_default_detector_hessian_of_autograd_code() -> None:
    def rosenbrock(x: Any) -> Any:
        return anp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)

    x = _points(1)[0]
    prep = di.prepare_hessian(rosenbrock, di.AutoSparse("autograd"), x)
    assert prep.detection.tracer == "numpy"
    assert prep.coloring.count == 3
    np.testing.assert_allclose(
        di.hessian(rosenbrock, di.AutoSparse("autograd"), x, prep=prep).toarray(),
        di.hessian(rosenbrock, "autograd", x),
        rtol=1e-12,
    )


def test_contexts_are_abstract_for_the_new_tracers() -> None:
    """A pattern holds for every value of a Constant: its zeros are not structural, its
    integers not known."""
    x = _points(1)[0]
    scale = np.zeros(N)
    for tracer, xs in (("numpy", x), ("torch", torch.tensor(x))):
        detector = sparse.GlobalDetector(tracer=tracer)
        scaled = sparse.jacobian_pattern(lambda x, c: x * c, xs, di.Constant(scale), detector=detector)
        assert (scaled.toarray() == np.eye(N, dtype=bool)).all()
        picked = sparse.jacobian_pattern(lambda x, i: x[i], xs, di.Constant(np.array([0, 1])), detector=detector)
        assert picked.toarray().all()


class _Model:
    """A plain object (no pytree) that holds a Constant's arrays in its attributes."""

    def __init__(self, w: Any) -> None:
        self.w = w


class _Slotted:
    __slots__ = ("parts",)


def _dense_of(matrix: Any) -> np.ndarray:
    for name in ("to_dense", "toarray"):
        if hasattr(matrix, name):
            matrix = getattr(matrix, name)()
    return np.asarray(matrix.detach() if hasattr(matrix, "detach") else matrix)


@pytest.mark.parametrize("engine", ["finite_differences", "autograd", "jax", "torch"])
def test_arrays_a_plain_object_holds_in_a_constant_are_abstract(engine: str) -> None:
    """A Constant whose value is a plain object (no pytree) had its arrays read as known: the
    zeros of ``model.w`` were structural, and the pattern kept (in the prep, in the unprepared
    call's cache) after they changed, so the sparse Jacobian came back wrong without an error
    (off by 15 here). Such an object's arrays are as abstract as a dict's."""
    backend: Any = engine
    as_array: Callable[[np.ndarray], Any] = np.asarray
    x: Any = np.array([1.0, 2.0, 3.0])  # (numpy x under jax's backend: the jax tracer reads f)
    if engine == "jax":
        jax = pytest.importorskip("jax")

        def as_array(a: np.ndarray) -> Any:
            with jax.enable_x64(True):
                return jax.numpy.asarray(a)

        backend = di.AutoJAX(jit=False)  # (jit refuses a plain object in a Constant)
    elif engine == "torch":
        as_array = torch.tensor
        x = torch.tensor(x)
    model = _Model(as_array(np.diag([1.0, 0.0, 2.0])))
    f = lambda v, m: m.w @ v  # noqa: E731
    sparse_backend = di.AutoSparse(backend)
    prep = di.prepare_jacobian(f, sparse_backend, x, di.Constant(model))
    di.jacobian(f, sparse_backend, x, di.Constant(model))  # (the unprepared call's cache)
    first = model.w
    model.w = as_array(np.arange(1.0, 10.0).reshape(3, 3))
    dense = _dense_of(di.jacobian(f, backend, x, di.Constant(model)))
    for found in (
        di.jacobian(f, sparse_backend, x, di.Constant(model), prep=prep),
        di.jacobian(f, sparse_backend, x, di.Constant(model)),
    ):
        np.testing.assert_allclose(_dense_of(found), dense, rtol=1e-6, atol=1e-6)
    assert _dense_of(first).tolist() == np.diag([1.0, 0.0, 2.0]).tolist()  # (the caller's array untouched)


def test_arrays_deeper_in_a_plain_object_are_abstract_and_it_is_not_written() -> None:
    """Slots, nested objects (one held twice: one copy), lists and integer indices, written in
    place after detection."""
    holder = _Slotted()
    shared = _Model(np.diag([1.0, 0.0, 2.0]))
    holder.parts = [shared, np.array([0, 1]), shared]
    x = np.array([1.0, 2.0, 3.0])

    def f(v: Any, h: Any) -> Any:
        assert h.parts[0] is h.parts[2]
        return (h.parts[0].w @ v + h.parts[2].w @ v**2)[h.parts[1]]

    backend = di.AutoSparse("finite_differences")
    prep = di.prepare_jacobian(f, backend, x, di.Constant(holder))
    parts = holder.parts
    holder.parts[0].w[1, 0] = 5.0
    holder.parts[1][0] = 2
    assert holder.parts is parts and type(holder.parts[0]) is _Model
    dense = np.asarray(di.jacobian(f, "finite_differences", x, di.Constant(holder)))
    found = di.jacobian(f, backend, x, di.Constant(holder), prep=prep).toarray()
    np.testing.assert_allclose(found, dense, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("engine", ["finite_differences", "autograd", "jax", "torch"])
def test_a_plain_object_s_arrays_of_another_shape_are_another_signature(engine: str) -> None:
    """The arrays a plain object in a Constant holds are abstract, but their shapes are not: a
    filter of one tap has a diagonal Jacobian, of three taps three diagonals. Their shapes were
    not part of the prep's signature, so after ``model.w`` got two more taps the prep, and the
    unprepared call's cache, reused the diagonal pattern: the two new diagonals were added into
    the old one (6 where 1, 0 and 0 were due), without an error (or a raw ValueError or
    IndexError where the output's length changed). Now a strict prep refuses the call, naming
    the shapes, and an unprepared or non-strict call detects the pattern again."""
    backend: Any = engine
    as_array: Callable[[np.ndarray], Any] = np.asarray
    roll: Callable[[Any, int], Any] = anp.roll
    x: Any = np.arange(1.0, 7.0)
    if engine == "jax":
        jax = pytest.importorskip("jax")

        def as_array(a: np.ndarray) -> Any:
            with jax.enable_x64(True):
                return jax.numpy.asarray(a)

        roll = jax.numpy.roll
        backend = di.AutoJAX(jit=False)  # (jit refuses a plain object in a Constant)
    elif engine == "torch":
        as_array, roll, x = torch.tensor, lambda v, k: torch.roll(v, k), torch.tensor(x)
    model = _Model(as_array(np.array([1.0])))

    def f(v: Any, m: Any) -> Any:  # a circular filter of len(m.w) taps
        return sum(m.w[k] * roll(v, k) for k in range(len(m.w)))

    sparse_backend = di.AutoSparse(backend)
    prep = di.prepare_jacobian(f, sparse_backend, x, di.Constant(model))
    loose = prep.with_strictness(False)
    di.jacobian(f, sparse_backend, x, di.Constant(model))  # (the unprepared call's cache)
    model.w = as_array(np.array([1.0, 2.0, 3.0]))
    dense = _dense_of(di.jacobian(f, backend, x, di.Constant(model)))
    assert np.count_nonzero(dense) == 18
    with pytest.raises(di.PreparationMismatchError, match=r"holding .*shape \(3,\)"):
        di.jacobian(f, sparse_backend, x, di.Constant(model), prep=prep)
    for found in (
        di.jacobian(f, sparse_backend, x, di.Constant(model)),
        di.jacobian(f, sparse_backend, x, di.Constant(model), prep=loose),
    ):
        np.testing.assert_allclose(_dense_of(found), dense, rtol=1e-6, atol=1e-6)


def test_a_local_pattern_is_found_again_for_a_plain_object_s_new_values() -> None:
    """LocalDetector's pattern holds for the contexts' values it was found with, and is found
    again where they change; the arrays of a plain object in a Constant were not compared, so
    ``model.w`` made dense kept the diagonal pattern (4 on the diagonal, zeros elsewhere)."""
    model = _Model(np.eye(4))
    f = lambda v, m: m.w @ v  # noqa: E731
    backend = di.AutoSparse("autograd", detector=sparse.LocalDetector())
    x = np.arange(1.0, 5.0)
    prep = di.prepare_jacobian(f, backend, x, di.Constant(model))
    di.jacobian(f, backend, x, di.Constant(model))
    model.w = np.ones((4, 4))
    for found in (
        di.jacobian(f, backend, x, di.Constant(model), prep=prep),
        di.jacobian(f, backend, x, di.Constant(model)),
    ):
        np.testing.assert_allclose(found.toarray(), np.ones((4, 4)))


def test_numpy_arrays_a_plain_object_holds_are_read_again_by_the_torch_tracer() -> None:
    """Under the torch tracer a plain object's numpy arrays reach f as they are (f converts them),
    so their values count: an index array gives the pattern of a gather. The prep, and the
    unprepared call's cache, kept the pattern of the first indices after the array was replaced
    or written in place (the diagonal where the anti-diagonal was due; 8 at one entry where a
    column of 2s was), without an error. The pattern is now found again where they change."""
    model = _Model(np.array([0, 1, 2, 3]))
    f = lambda v, m: v[torch.as_tensor(m.w)] * 2.0  # noqa: E731
    x = torch.arange(1.0, 5.0, dtype=torch.float64)
    backend = di.AutoSparse("torch")
    prep = di.prepare_jacobian(f, backend, x, di.Constant(model))
    di.jacobian(f, backend, x, di.Constant(model))
    for change in (lambda: setattr(model, "w", np.array([3, 2, 1, 0])), lambda: model.w.__setitem__(0, 1)):
        change()
        dense = di.jacobian(f, "torch", x, di.Constant(model))
        for found in (
            di.jacobian(f, backend, x, di.Constant(model), prep=prep),
            di.jacobian(f, backend, x, di.Constant(model)),
        ):
            torch.testing.assert_close(found.to_dense(), dense)


def test_torch_tensors_beside_a_module_in_a_plain_object_are_abstract() -> None:
    """A trainer object holding a module (its parameters abstract, as they require grad) and a
    tensor: its zeros are not structural either."""

    class Trainer:
        def __init__(self) -> None:
            self.model = torch.nn.Linear(3, 2).double()
            self.mix = torch.diag(torch.tensor([1.0, 0.0], dtype=torch.float64))

    trainer = Trainer()
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    f = lambda v, t: t.mix @ t.model(v)  # noqa: E731
    prep = di.prepare_jacobian(f, di.AutoSparse("torch"), x, di.Constant(trainer))
    trainer.mix[1, 1] = 1.0
    found = di.jacobian(f, di.AutoSparse("torch"), x, di.Constant(trainer), prep=prep).to_dense()
    torch.testing.assert_close(found, di.jacobian(f, "torch", x, di.Constant(trainer)))


def test_an_object_holding_a_constant_s_arrays_that_cannot_be_copied_is_refused() -> None:
    class Uncopied(_Model):
        def __copy__(self) -> Any:
            raise TypeError("no copies")

    with pytest.raises(di.UnsupportedOperationError, match="cannot be copied"):
        sparse.jacobian_pattern(
            lambda v, m: m.w @ v, np.ones(3), di.Constant(Uncopied(np.eye(3))), detector=sparse.GlobalDetector("jax")
        )


# --- refusals, notes and f's own errors --------------------------------------------------------------


def test_value_dependent_control_flow_is_refused_with_the_reason() -> None:
    def torch_branch(x: Any) -> Any:
        return x * 2 if x.sum() > 0 else -x

    def numpy_branch(x: Any) -> Any:
        return x * 2 if x[0] > 0 else -x

    with pytest.raises(di.UnsupportedOperationError, match="branches"):
        sparse.jacobian_pattern(torch_branch, torch.tensor(_points(1)[0]))
    with pytest.raises(di.UnsupportedOperationError, match="branches"):
        sparse.jacobian_pattern(numpy_branch, _points(1)[0], detector=sparse.GlobalDetector(tracer="numpy"))
    with pytest.raises(di.UnsupportedOperationError, match="Python number"):
        sparse.jacobian_pattern(lambda x: x * x[0].item(), torch.tensor(_points(1)[0]))
    with pytest.raises(di.UnsupportedOperationError, match="Python number"):
        sparse.jacobian_pattern(
            lambda x: x * float(x[0]), _points(1)[0], detector=sparse.GlobalDetector(tracer="numpy")
        )


def test_an_unknown_operation_is_dense_with_a_note() -> None:
    x = _points(1)[0]
    found = sparse.detect(
        lambda t: torch.linalg.inv(t[:4].reshape(2, 2)).reshape(-1),
        torch.tensor(x),
        (),
        sparse.GlobalDetector(),
        None,
        False,
    )
    assert found.notes and "inv" in found.notes[0]
    assert found.pattern.toarray()[:, :4].all() and not found.pattern.toarray()[:, 4:].any()
    found = sparse.detect(
        lambda t: np.linalg.inv(t[:4].reshape(2, 2)).reshape(-1), x, (), sparse.GlobalDetector("numpy"), None, False
    )
    assert found.notes and "inv" in found.notes[0]
    assert found.pattern.toarray()[:, :4].all() and not found.pattern.toarray()[:, 4:].any()
    prep = di.prepare_jacobian(
        lambda t: np.linalg.inv(t[:4].reshape(2, 2)).reshape(-1), di.AutoSparse("finite_differences"), x
    )
    assert prep.detection.notes == found.notes


@pytest.mark.parametrize("family", ["torch", "numpy", "jax"])
def test_a_hessian_of_a_vector_f_is_refused_as_its_output_on_every_tracer(family: str) -> None:
    """The torch tracer called it a refusal to trace ("Write f without branches on values"),
    an UnsupportedOperationError; the others an InvalidOutputError that says what f returned."""
    x = _points(1)[0]
    if family == "torch":
        x = torch.tensor(x)
    elif family == "jax":
        x = pytest.importorskip("jax.numpy").asarray(x)
    with pytest.raises(di.InvalidOutputError, match="one scalar"):
        sparse.hessian_pattern(lambda t: t**2, x)


def test_the_jax_detector_names_what_it_takes_as_dense() -> None:
    """The docs say an operation a tracer does not know is named in the notes; jax's gave none."""
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.asarray(_points(1)[0])
    fft = sparse.detect(lambda t: jnp.abs(jnp.fft.rfft(t)), x, (), sparse.GlobalDetector(), None, False)
    assert fft.tracer == "jax" and fft.notes == ("fft is not known to the jax detector: dense",)
    gather = sparse.detect(lambda t: t[jnp.argsort(t)][:3], x, (), sparse.GlobalDetector(), None, False)
    assert len(gather.notes) == 1 and gather.notes[0].startswith("gather: its rule cannot tell")
    banded = sparse.detect(lambda t: t[1:] * t[:-1], x, (), sparse.GlobalDetector(), None, False)
    assert banded.notes == ()
    hessian = sparse.detect(lambda t: jnp.sum(jnp.abs(jnp.fft.rfft(t))), x, (), sparse.GlobalDetector(), None, True)
    assert hessian.notes == ("fft is not known to the jax detector: dense",)


def test_torch_detector_in_a_fresh_process() -> None:
    """Issue 22: the first torch detection of a process imported torch's compiler (torch._dynamo,
    torch._inductor, sympy: about 2 s, through make_fx and fake tensors). In a fresh process: the
    right pattern of the benchmark's tridiagonal map at n = 10^4, without that import. The time is
    printed (pytest -s), not asserted."""
    code = textwrap.dedent(
        """
        import json, sys, time
        import numpy as np
        import torch
        import diffiface as di
        from diffiface import sparse

        def tridiagonal(x):
            zero = x[:1] * 0
            return 2 * x**2 - torch.cat([zero, x[:-1]]) - torch.cat([x[1:] ** 3, zero])

        n = 10_000
        x = torch.linspace(0.1, 1.0, n, dtype=torch.float32)
        start = time.perf_counter()
        pattern = sparse.jacobian_pattern(tridiagonal, x)
        seconds = time.perf_counter() - start
        coo = pattern.tocoo()
        outside = np.abs(coo.row - coo.col) > 1
        print(json.dumps({
            "seconds": seconds, "shape": list(pattern.shape), "nnz": int(pattern.nnz),
            "outside": [[int(i), int(j)] for i, j in zip(coo.row[outside], coo.col[outside])],
            "compiler": sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules),
        }))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    # the band (3n - 2 entries), and the padding x[:1] * 0 of the last row, which reads x[0]
    # (its derivative is zero: counted, conservatively)
    assert found["shape"] == [10_000, 10_000] and found["outside"] == [[9_999, 0]]
    assert found["nnz"] == 3 * 10_000 - 2 + 1
    assert found["compiler"] == []
    print(f"first torch detection in a fresh process, n = 10^4: {found['seconds']:.3f} s")


def test_torch_cond_falls_back_to_make_fx() -> None:
    """torch.cond (a higher-order operator, compiled by torch on the handles) is not followed by the
    dispatch mode: make_fx traces f instead, in a fresh process (both branches: conservative); where
    torch's compiler was imported before, a refusal with the reason."""
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import torch
        from diffiface import sparse

        def f(x):
            return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: torch.sin(t) * t.roll(1), (x,))

        x = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
        found = sparse.jacobian_pattern(f, x).toarray()
        expected = np.eye(5, dtype=bool) | np.roll(np.eye(5, dtype=bool), 1, axis=1)
        print(bool((found >= expected).all()))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"


def test_an_operation_with_sizes_beside_tensors_is_dense() -> None:
    """An operation returning a tensor and a number (a library's own operator): its tensor is dense in
    its operands, with a note, never without dependencies."""
    library = torch.library.Library("diffiface_tracer_test", "DEF")
    library.define("pair(Tensor x) -> (Tensor, int)")
    library.impl("pair", lambda t: (t.flip(0) * 2, 3), "CompositeExplicitAutograd")

    def f(x: Any) -> Any:
        y, k = torch.ops.diffiface_tracer_test.pair(x[:3])
        return torch.cat([y * k, x[3:]])

    found = sparse.detect(f, torch.tensor(_points(1)[0]), (), sparse.GlobalDetector("torch"), None, False)
    expected = np.zeros((N, N), dtype=bool)
    expected[:3, :3] = True
    expected[3:, 3:] = np.eye(N - 3, dtype=bool)
    assert (found.pattern.toarray() == expected).all()
    assert found.notes and "pair" in found.notes[0]


def test_torch_detector_refuses_reading_values() -> None:
    """Values of x reach Python or numpy only by a refusal, with the reason, also where f catches it."""
    x = torch.tensor(_points(1)[0])

    def swallowed(t: Any) -> Any:
        try:
            if t.sum() > 0:
                return t * 2
        except Exception:
            pass
        return t.sum() * t

    cases = {
        "numpy": (lambda t: t * float(t.sum().numpy()), "reads the values"),
        "tolist": (lambda t: t * t.tolist()[0], "reads the values"),
        "mask": (lambda t: t[t > 0], "size of a result"),
        "nonzero": (lambda t: t[torch.nonzero(t > 0).reshape(-1)], "size of a result"),
        "caught": (swallowed, "branches"),
    }
    for name, (f, reason) in cases.items():
        with pytest.raises(di.UnsupportedOperationError, match=reason):
            sparse.jacobian_pattern(f, x)
        del name


def test_an_autograd_function_without_setup_context_is_refused_by_name() -> None:
    """The tracer runs f under torch.func.functionalize, which refuses an old-style
    torch.autograd.Function: torch's RuntimeError reached the caller. Now the refusal names the
    Function's missing setup_context and the detectors that need none, and the advice works; a
    jvp of it (torch's NotImplementedError before) names the missing jvp and the reverse way."""

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: Any) -> Any:
            ctx.save_for_backward(t)
            return t * t

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (t,) = ctx.saved_tensors
            return 2 * t * g

    def f(t: Any) -> Any:
        return Square.apply(t) + torch.roll(t, 1)

    x = torch.arange(1.0, 6.0, dtype=torch.float64)
    with pytest.raises(di.UnsupportedOperationError, match="without a setup_context staticmethod"):
        di.jacobian(f, di.AutoSparse(di.AutoTorch()), x)
    # (its row coloring evaluates f once by a jvp, which the Function's missing jvp refuses by name)
    with pytest.raises(di.UnsupportedOperationError, match="without a jvp staticmethod"):
        di.jacobian(f, di.AutoSparse(di.AutoTorch(), detector=sparse.LocalDetector()), x)
    found = di.jacobian(f, di.AutoSparse(di.AutoTorch(jvp="reverse"), detector=sparse.LocalDetector()), x)
    assert np.array_equal(found.to_dense().numpy(), di.jacobian(f, "torch", x).numpy())
    with pytest.raises(di.UnsupportedOperationError, match="without a jvp staticmethod"):
        di.jvp(f, "torch", x, x)
    assert torch.equal(di.jvp(f, di.AutoTorch(jvp="reverse"), x, x), di.jacobian(f, "torch", x) @ x)


def test_torch_detector_changes_nothing_of_the_caller() -> None:
    """Tensors f closes over, x, the contexts and torch's random generator are left as they were."""
    x = torch.tensor(_points(1)[0])
    before = x.clone()
    closed = torch.tensor(A)
    closed_before = closed.clone()
    with pytest.raises(di.UnsupportedOperationError, match="closes over"):
        sparse.jacobian_pattern(lambda t: closed.mul_(2) @ t, x)
    assert torch.equal(closed, closed_before) and torch.equal(x, before)
    with pytest.raises(di.UnsupportedOperationError, match="in place"):
        sparse.jacobian_pattern(lambda t: t.mul_(2), x)
    assert torch.equal(x, before)
    state = torch.get_rng_state()
    noisy = sparse.jacobian_pattern(lambda t: t * torch.rand(N, dtype=t.dtype), x)
    assert torch.equal(state, torch.get_rng_state())
    assert (noisy.toarray() == np.eye(N, dtype=bool)).all()
    scale = torch.tensor(_points(1)[0])
    scale_before = scale.clone()
    pattern = sparse.jacobian_pattern(lambda t, c: t * c.exp(), x, di.Constant(scale))
    assert torch.equal(scale, scale_before) and (pattern.toarray() == np.eye(N, dtype=bool)).all()


@pytest.mark.parametrize("tracer", ["jax", "torch", "numpy"])
def test_fs_own_exception_reaches_the_caller(tracer: str) -> None:
    """Issue 18: under the default detector, f's ValueError became UnsupportedOperationError."""
    if tracer == "jax":
        pytest.importorskip("jax")

    def f(x: Any) -> Any:
        raise ValueError("f refuses this input")

    x: Any = torch.tensor(_points(1)[0]) if tracer == "torch" else _points(1)[0]
    with pytest.raises(ValueError, match="f refuses this input"):
        sparse.jacobian_pattern(f, x, detector=sparse.GlobalDetector(tracer=tracer))
    backend = {"jax": "jax", "torch": "torch", "numpy": "autograd"}[tracer]
    with pytest.raises(ValueError, match="f refuses this input"):
        di.jacobian(f, di.AutoSparse(backend), x)


@pytest.mark.parametrize("options", [{"points": 2.0}, {"points": 0}, {"points": True}, {"seed": -1}, {"seed": 0.5}])
def test_local_detector_options_are_validated(options: dict[str, Any]) -> None:
    """Issue 18: LocalDetector(points=2.0) and LocalDetector(seed=-1) gave raw errors."""
    with pytest.raises(di.InvalidInputError, match=next(iter(options))):
        sparse.LocalDetector(**options)


def test_unknown_tracer_is_refused() -> None:
    with pytest.raises(di.InvalidInputError, match="tracer"):
        sparse.GlobalDetector(tracer="tensorflow")


# --- the check of finite differences: its tolerance from the step's error ---------------------


def _small_entry(x: Any) -> Any:
    return anp.stack([3 * x[0] + 0.002 * x[1], 2 * x[1], 3 * anp.sin(x[2])])


@pytest.mark.parametrize("backend", ["finite_differences", di.AutoFiniteDifferences(method="forward"), "autograd"])
def test_check_catches_a_missing_small_entry(backend: Any) -> None:
    """Issue 18: a missing entry of 0.002 next to one of 3 slipped through the check of finite
    differences (a tolerance of 1e-3 of the scale); jax and autograd caught it."""
    x = np.array([0.3, 0.5, 0.7])
    missing = sparse.KnownPattern(np.eye(3))
    with pytest.raises(di.DiffifaceError, match="misses nonzeros"):
        di.jacobian(_small_entry, di.AutoSparse(backend, detector=missing, check=True), x)


@pytest.mark.parametrize("name", sorted(AUTOGRAD))
def test_check_does_not_cry_wolf_on_finite_differences(name: str) -> None:
    f = AUTOGRAD[name]
    for method in ("central", "forward"):
        backend = di.AutoSparse(di.AutoFiniteDifferences(method=method), check=True)
        for point in _points(2):
            di.jacobian(f, backend, point)  # raises where the check fails


def test_check_does_not_cry_wolf_on_a_finite_difference_hessian() -> None:
    def rosenbrock(x: Any) -> Any:
        return anp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)

    for point in _points(2):
        di.hessian(rosenbrock, di.AutoSparse("finite_differences", check=True), point)


def _put(x: Any) -> Any:
    y = np.zeros_like(x)
    np.put(y, [0, 1], x[:2])
    return y


def _dot_out(x: Any) -> Any:
    out = np.zeros(3)
    np.dot(np.ones((3, N)), x, out=out)
    return out


def _iadd_alias(x: Any) -> Any:
    y = np.zeros_like(x)
    z = y
    z += x[::-1] ** 2
    return y


def _sort_in_place(x: Any) -> Any:
    y = x * 1.0
    y.sort()
    return y


def _transposed_then_write(x: Any) -> Any:
    a = np.zeros_like(x[:6]).reshape(2, 3)
    t = a.T
    a[0, 0] = x[5]
    return t.ravel()


@pytest.mark.parametrize("f", [_put, _dot_out, _iadd_alias, _sort_in_place, _transposed_then_write])
def test_numpy_writes_in_place_are_refused_not_read_as_jax(f: Callable[[Any], Any]) -> None:
    """A write numpy's views and aliases see (np.put, out=, y += on an alias, y.sort(), a write
    after a transposed view) was dropped, or the default detector read f again as jax.numpy
    code, whose arrays are copies: refused by name."""
    for detector in (sparse.GlobalDetector(tracer="numpy"), sparse.GlobalDetector()):
        with pytest.raises(di.UnsupportedOperationError, match=r"writes|sorts"):
            sparse.jacobian_pattern(f, _points(1)[0], detector=detector)


def test_a_numpy_scalar_constant_is_abstract_as_an_array_is() -> None:
    """A Constant's np.int64 index was traced as its one value, and the pattern kept for the
    next call, with another index: the column it reads was lost. It is abstract as any
    context array is: the pattern holds for every value."""
    x = _points(1)[0]
    f = lambda v, k: v * v[k]  # noqa: E731
    first = di.jacobian(f, di.AutoSparse("finite_differences"), x, di.Constant(np.int64(1)))
    second = di.jacobian(f, di.AutoSparse("finite_differences"), x, di.Constant(np.int64(4)))
    for got, k in ((first, 1), (second, 4)):
        dense = np.asarray(di.jacobian(f, "finite_differences", x, di.Constant(np.int64(k))))
        np.testing.assert_allclose(got.toarray(), dense, atol=1e-8)


def test_a_torch_operation_comparing_devices_before_the_dispatcher_is_not_a_raw_error() -> None:
    """torch.quantile compares its q (made on x's device) with the handle's (meta) device before
    any aten operation: a raw RuntimeError escaped. make_fx follows it instead (and refuses its
    in-place lerp_ by name)."""
    f = lambda x: torch.quantile(x.reshape(2, 4), 0.5, dim=1)  # noqa: E731
    with pytest.raises(di.UnsupportedOperationError, match="in place"):
        sparse.jacobian_pattern(f, torch.linspace(0.5, 2.0, 8, dtype=torch.float64))


@pytest.mark.parametrize("how", ["closed-over", "constant"])
def test_the_zeros_of_a_torch_parameter_are_not_structural(how: str) -> None:
    """A zero-initialised layer's weights were read as constant zeros: after an optimizer's
    step in place, the pattern kept (an unprepared call's cache, a prep with the Module in a
    Constant) said the output depends on none of x, and the Jacobian came back zero, or with
    its columns mixed. A tensor that requires grad holds for every value of it."""
    layer = torch.nn.Linear(4, 3).double()
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[0, 0] = 1.0
    x = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)
    backend = di.AutoSparse("torch")
    if how == "closed-over":
        f = lambda v: layer(v)  # noqa: E731
        jacobian = lambda: di.jacobian(f, backend, x)  # noqa: E731
    else:
        g = lambda v, module: module(v)  # noqa: E731
        prep = di.prepare_jacobian(g, backend, x, di.Constant(layer))
        jacobian = lambda: di.jacobian(g, backend, x, di.Constant(layer), prep=prep)  # noqa: E731
    torch.testing.assert_close(jacobian().to_dense(), layer.weight.detach())
    with torch.no_grad():
        layer.weight += torch.arange(12, dtype=torch.float64).reshape(3, 4)
    torch.testing.assert_close(jacobian().to_dense(), layer.weight.detach())


def test_jax_top_k_along_another_axis_keeps_its_lines() -> None:
    """jax 0.10 names top_k's axis ``axis``: read as the last axis, an axis-0 top_k lost entries."""
    jax = pytest.importorskip("jax")
    x = _points(1)[0][:6].reshape(3, 2)
    f = lambda v: jax.lax.top_k(v, 2, axis=0)[0].ravel()  # noqa: E731
    pattern = sparse.jacobian_pattern(f, jax.numpy.asarray(x), detector=sparse.GlobalDetector(tracer="jax"))
    dense = np.asarray(jax.jacobian(f)(jax.numpy.asarray(x))).reshape(4, 6)
    assert not _missing(pattern, dense)


# --- rules that must match numpy's definitions ------------------------------------------------------


def _dense_jacobian(f: Callable[[Any], Any], x: np.ndarray) -> np.ndarray:
    return np.asarray(di.jacobian(f, "finite_differences", x)).reshape(-1, x.size)


def test_vdot_flattens_both_operands() -> None:
    """np.vdot of two matrices is one number: the rule contracted the last axis only, so
    ``np.vdot(A, A) * A`` lost entries and ``np.vdot(A, A)[None]`` had four rows."""
    x = np.array([1.0, 2.0, 3.0, 4.0])
    scaled = lambda v: (np.vdot(v.reshape(2, 2), v.reshape(2, 2)) * v.reshape(2, 2)).ravel()  # noqa: E731
    one = lambda v: np.vdot(v.reshape(2, 2), v.reshape(2, 2))[None]  # noqa: E731
    detector = sparse.GlobalDetector(tracer="numpy")
    for f in (scaled, one):
        pattern = sparse.jacobian_pattern(f, x, detector=detector)
        assert (pattern.toarray() == (_dense_jacobian(f, x) != 0)).all()
    hessian = sparse.hessian_pattern(lambda v: np.vdot(v.reshape(2, 2), np.sin(v.reshape(2, 2))), x, detector=detector)
    assert (hessian.toarray() == np.eye(4, dtype=bool)).all()


@pytest.mark.parametrize("mode", ["full", "same", "valid"])
@pytest.mark.parametrize("name", ["convolve", "correlate"])
def test_convolve_and_correlate_patterns_are_exact(name: str, mode: str) -> None:
    """Every length pair and mode, with a constant operand (its zero taps dropped) on either side
    or both operands traced: correlate's "same" was aligned as convolve's with the kernel
    reversed, which numpy's operand swap for a longer kernel does not keep."""
    func = getattr(np, name)
    rng = np.random.default_rng(3)
    detector = sparse.GlobalDetector(tracer="numpy")
    for la in range(1, 7):
        for lv in range(1, 7):
            constant = rng.standard_normal(lv)
            constant[rng.random(lv) < 0.3] = 0.0
            x = rng.standard_normal(la + lv)
            cases = {
                "constant-v": lambda v, la=la, c=constant: func(v[:la], c, mode),
                "constant-a": lambda v, la=la, c=constant: func(c, v[:la], mode),
                "both": lambda v, la=la: func(v[:la], v[la:], mode),
            }
            for case, f in cases.items():
                pattern = sparse.jacobian_pattern(f, x, detector=detector).toarray()
                assert (pattern == (_dense_jacobian(f, x) != 0)).all(), (la, lv, case)


def test_diff_reads_prepend_and_append_given_by_position() -> None:
    """np.diff(x, 1, -1, prepend) was read without its prepend: a pattern one row short."""
    x = np.array([1.0, 2.0, 4.0, 7.0])
    detector = sparse.GlobalDetector(tracer="numpy")
    cases = {
        "prepend-by-position": lambda v: np.diff(v, 1, -1, v[:1] * 0.5),
        "append-by-position": lambda v: np.diff(v, 2, 0, 0.0, v[-1:] ** 2),
        "both-by-keyword": lambda v: np.diff(v, prepend=0.0, append=v[0]),
        "matrix": lambda v: np.diff(v.reshape(2, 2), 1, 0, v[2:].reshape(1, 2) ** 2, 3.0).ravel(),
    }
    for case, f in cases.items():
        pattern = sparse.jacobian_pattern(f, x, detector=detector)
        assert (pattern.toarray() == (_dense_jacobian(f, x) != 0)).all(), case


def test_torch_unknown_operations_on_operands_of_different_sizes_are_dense() -> None:
    """An operation without a rule whose traced operands differ in size (solve's matrix and
    vector, index_add's target and updates) crashed detection with scipy's ValueError: each
    output now depends on everything its operands depend on."""
    index = torch.tensor([0, 1, 1, 0])
    cases = {
        "solve": lambda t: torch.linalg.solve(t[:4].reshape(2, 2), t[4:]),
        "index_add": lambda t: t[:2].index_add(0, index, t[2:] ** 2),
        "index_copy": lambda t: t[:4].index_copy(0, torch.tensor([2, 0]), t[4:]),
        "cdist": lambda t: torch.cdist(t[:4].reshape(2, 2), t[4:].reshape(1, 2)).ravel(),
    }
    x = torch.tensor([2.0, 0.5, 0.3, 3.0, 1.0, -1.0], dtype=torch.float64)
    for name, f in cases.items():
        dense = di.jacobian(f, "torch", x).reshape(-1, 6).numpy()
        assert not _missing(sparse.jacobian_pattern(f, x), dense), name
    for name in ("solve", "index_add"):
        sparse_jacobian = di.jacobian(cases[name], di.AutoSparse("torch"), x).to_dense()
        torch.testing.assert_close(sparse_jacobian, di.jacobian(cases[name], "torch", x), msg=name)
    g = lambda t: cases["solve"](t).sum() ** 2  # noqa: E731
    torch.testing.assert_close(di.hessian(g, di.AutoSparse("torch"), x).to_dense(), di.hessian(g, "torch", x))


def test_a_jax_array_in_a_constant_is_abstract_for_the_numpy_tracer() -> None:
    """The numpy tracer made only numpy arrays abstract: a jax matrix's zeros set the pattern,
    and the pattern was kept for the next call with another matrix of the same shape."""
    jnp = pytest.importorskip("jax.numpy")
    x = np.linspace(1.0, 2.0, 4, dtype=np.float32)
    f = lambda v, a: a @ v  # noqa: E731
    backend = di.AutoSparse("finite_differences")
    di.jacobian(f, backend, x, di.Constant(jnp.eye(4, dtype=jnp.float32)))
    full = jnp.ones((4, 4), dtype=jnp.float32)
    np.testing.assert_allclose(di.jacobian(f, backend, x, di.Constant(full)).toarray(), np.ones((4, 4)), rtol=1e-3)


def _catches_a_refusal(x: Any) -> Any:
    try:
        big = bool(x[0] > 0)
    except Exception:
        big = False
    return x * x[1] if big else x * 2.0


def _catches_a_type_error(x: Any) -> Any:
    try:
        big = bool(x[0] > 0)
    except TypeError:  # (jax's tracers raise TypeErrors: the numpy tracer's refusal is none)
        big = False
    return x * x[1] if big else x * 2.0


@pytest.mark.parametrize(
    "f",
    [_catches_a_refusal, _catches_a_type_error, lambda x: np.repeat(x, np.argsort(x)) * 2.0],
    ids=["caught", "caught-by-the-retry", "repeat-computed-counts"],
)
def test_a_numpy_refusal_is_not_read_again_by_jax(f: Callable[[Any], Any]) -> None:
    """After the numpy tracer refused f for a value, the default detector read f again with jax:
    f's except branch then ran silently (a diagonal pattern where x[1] scales every output), or
    jax's own NotImplementedError escaped raw. The refusal stands."""
    pytest.importorskip("jax")
    with pytest.raises(di.UnsupportedOperationError, match="GlobalDetector could not read"):
        sparse.jacobian_pattern(f, np.array([1.0, 2.0, 3.0]))


@pytest.mark.parametrize(
    ("f", "indices"),
    [
        (lambda x, i: np.take(x, i) * x[:3], np.array([2, 0, 1])),
        (lambda x, i: np.take(x.reshape(2, 3), i, axis=1).ravel() * x, np.array([2, 0, 1])),
        (lambda x, i: np.take(x.reshape(2, 3), indices=i, axis=0).ravel(), np.array([1])),
        (lambda x, i: np.take_along_axis(x.reshape(2, 3), i, axis=1).ravel() ** 2, np.array([[1, 0], [2, 2]])),
    ],
    ids=["take", "take-axis", "take-keywords", "take-along-axis"],
)
def test_take_with_a_constants_indices_is_read_as_indexing(f: Callable[..., Any], indices: np.ndarray) -> None:
    """A Constant's integers are abstract, as in x[i]: np.take was refused, its message saying
    they were computed from x. Each element may read any of x's, which holds every nonzero."""
    x = np.arange(1.0, 7.0)
    dense = np.asarray(di.jacobian(f, "finite_differences", x, di.Constant(indices)))
    found = sparse.jacobian_pattern(f, x, di.Constant(indices))
    assert not _missing(found, dense)
    jacobian = di.jacobian(f, di.AutoSparse("finite_differences"), x, di.Constant(indices))
    np.testing.assert_allclose(jacobian.toarray(), dense, rtol=1e-6, atol=1e-9)


def test_jax_numpy_code_on_numpy_x_is_still_read_by_jax() -> None:
    jnp = pytest.importorskip("jax.numpy")
    x = np.array([1.0, 2.0, 3.0])
    for f in (lambda v: jnp.sin(v) * v[::-1], lambda v: jnp.asarray(v) * v[::-1]):
        found = sparse.detect(f, x, (), sparse.GlobalDetector(), "finite_differences", False)
        assert found.tracer == "jax"
        assert (found.pattern.toarray() == (np.eye(3) + np.eye(3)[::-1]).astype(bool)).all()


# --- what a probe of the detectors found read as sparser than it is (no error) ----------------------


def test_the_hessian_of_a_complex_modulus_pairs_its_parts() -> None:
    # expected: no nonzero. |z| and z / |z| of a complex z were read as piecewise linear, as they
    # are of a real one, so the sparse Hessian of sum |x[:4] + i x[4:]| came back all zeros
    def f(x: Any) -> Any:
        return anp.sum(anp.abs(x[:4] + 1j * x[4:])) + anp.sum(anp.real(anp.sign(x[:4] + 1j * x[4:])))

    x = np.random.default_rng(1).standard_normal(8)
    pattern = sparse.hessian_pattern(f, x, detector=sparse.GlobalDetector(tracer="numpy"))
    assert not _missing(pattern, autograd.hessian(f)(x))


def test_a_list_of_traced_numbers_written_into_an_array_is_refused() -> None:
    # expected: a pattern with no nonzero, and a Jacobian of zeros
    def f(x: Any) -> Any:
        y = np.zeros_like(x)
        y[1:] = [x[i] ** 2 - x[i - 1] for i in range(1, 6)]
        return y

    with pytest.raises(di.UnsupportedOperationError, match="list or tuple of values computed from x"):
        sparse.jacobian_pattern(f, np.ones(6), detector=sparse.GlobalDetector(tracer="numpy"))


def test_a_gufunc_is_no_elementwise_map() -> None:
    # expected: np.vecdot read as elementwise, each output depending on one input of each operand
    vecdot = getattr(np, "vecdot", None)
    if vecdot is None:
        pytest.skip("numpy < 2 has no np.vecdot")

    def f(x: Any) -> Any:
        return vecdot(x[:6].reshape(2, 3), x[6:].reshape(2, 3)).ravel()

    x = np.random.default_rng(0).standard_normal(12)
    pattern = sparse.jacobian_pattern(f, x, detector=sparse.GlobalDetector(tracer="numpy"))
    assert not _missing(pattern, np.asarray(di.jacobian(f, "finite_differences", x)).reshape(-1, 12))


@pytest.mark.parametrize("mode", ["func", "autograd"])
def test_the_torch_detector_runs_f_in_the_grad_mode_the_engines_run_it(mode: str) -> None:
    # expected: the pattern of the no_grad branch (diagonal), the detector having traced f under
    # torch.no_grad(), where each engine runs f with grad mode on
    def f(x: Any) -> Any:
        return x * x.flip(0) if torch.is_grad_enabled() else x * 2.0

    x = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    backend = di.AutoSparse(di.AutoTorch(mode=mode))
    np.testing.assert_allclose(
        di.jacobian(f, backend, x).to_dense().numpy(), di.jacobian(f, di.AutoTorch(mode=mode), x).numpy()
    )


def _shared_target_writes() -> dict[str, Callable[[Any], Any]]:
    """Writes where two land on one target (torch keeps one), each writer also read elsewhere."""
    index = torch.tensor([0, 0, 2])

    def index_put(x: Any) -> Any:
        y = torch.zeros(4, dtype=x.dtype).index_put((index,), x[:3] * 2.0)
        return torch.cat([y, x**2])

    def setitem_2d(x: Any) -> Any:
        y = torch.zeros(2, 4, dtype=x.dtype)
        y[:, index] = x[:6].reshape(2, 3) * 2.0
        return torch.cat([y.reshape(-1), x**2])

    def scatter(x: Any) -> Any:
        y = torch.zeros(4, dtype=x.dtype).scatter(0, index, x[:3] * 2.0)
        return torch.cat([y, x**2])

    return {"index_put": index_put, "setitem 2-d": setitem_2d, "scatter": scatter}


@pytest.mark.parametrize("write", sorted(_shared_target_writes()))
@pytest.mark.parametrize("mode", ["autograd", "func"])
def test_every_write_to_a_shared_target_is_in_the_torch_pattern(write: str, mode: str) -> None:
    # expected: index_put's d(x_0**2)/dx_0 = 2 x_0 came out 4 x_0 with reverse products (row
    # coloring). The pattern held the write torch keeps alone (x_1 at target 0), but torch's
    # backward gives every writer the target's cotangent, and the product of the color shared by
    # target 0 and x_0**2 (no common column in that pattern) added x_0's share into the other row
    f = _shared_target_writes()[write]
    x = torch.tensor(_points(1)[0])
    dense = _torch_jacobian(f, x.numpy())
    assert not _missing(sparse.jacobian_pattern(f, x, detector=sparse.GlobalDetector(tracer="torch")), dense)
    found = di.jacobian(f, di.AutoSparse(di.AutoTorch(mode=mode), coloring="row"), x).to_dense().numpy()
    np.testing.assert_allclose(found, dense, rtol=1e-12)


def _reductions_given_by_position() -> dict[str, Callable[[Any], Any]]:
    """numpy reductions whose keepdims (or average's returned) comes by position: each result
    broadcast against a square matrix, where a wrong shape broadcasts along the other axis; and
    zeros_like's shape by position."""

    def square(x: Any) -> Any:
        return x[:4].reshape(2, 2)

    return {
        "mean": lambda x: (square(x) - np.mean(square(x), 1, None, None, True)).ravel(),
        "max": lambda x: (square(x) * np.max(square(x), 1, None, True)).ravel(),
        "std": lambda x: (square(x) * np.std(square(x), 1, None, None, 0, True)).ravel(),
        "norm": lambda x: (square(x) - np.linalg.norm(square(x), None, 1, True)).ravel(),
        "average returned": lambda x: (lambda a, w: a * x[:2])(*np.average(x.reshape(2, 4), 1, None, True)),
        "zeros_like shape": lambda x: (np.zeros_like(x[:2], None, "C", True, (2, 1)) + x[:2]).ravel() * x[2],
    }


@pytest.mark.parametrize("name", sorted(_reductions_given_by_position()))
def test_numpy_reductions_read_their_arguments_given_by_position(name: str) -> None:
    # expected: np.mean(a, 1, None, None, True) read without its keepdims (the rule looked for it
    # among the keywords alone): a result of shape (2,) for (2, 1), broadcast along the rows
    # instead of the columns, a pattern that missed entries and a sparse Jacobian off by 0.5;
    # np.average(..., returned=True) read as the average alone, its rows taken apart as two values
    f = _reductions_given_by_position()[name]
    x = np.random.default_rng(0).uniform(-1.5, 1.5, 8)
    dense = np.asarray(di.jacobian(f, "finite_differences", x)).reshape(-1, 8)
    pattern = sparse.jacobian_pattern(f, x, detector=sparse.GlobalDetector(tracer="numpy"))
    assert not _missing(pattern, np.where(np.abs(dense) > 1e-8, dense, 0.0))
    found = di.jacobian(f, di.AutoSparse("finite_differences"), x).toarray()
    np.testing.assert_allclose(found, dense, atol=1e-8)


def _integers_beside_positions() -> dict[str, Callable[[Any], Any]]:
    """torch moves that take an integer that is no position: a fill value, an integer tensor."""
    mask = torch.arange(N) % 2 == 0
    return {
        "masked_fill": lambda x: torch.cat([x.masked_fill(mask, 50), x**2]),
        "cat": lambda x: torch.cat([x * 2.0, torch.tensor([3, 40]), x**2]),
    }


@pytest.mark.parametrize("name", sorted(_integers_beside_positions()))
def test_an_integer_beside_the_positions_of_a_torch_move_is_no_position(name: str) -> None:
    # expected: IndexError from the detector, the fill value 50 (or the tensor's 40) read as the
    # position of an operand's element, past the last one
    f = _integers_beside_positions()[name]
    x = torch.tensor(_points(1)[0])
    dense = _torch_jacobian(f, x.numpy())
    assert not _missing(sparse.jacobian_pattern(f, x, detector=sparse.GlobalDetector(tracer="torch")), dense)
    found = di.jacobian(f, di.AutoSparse(di.AutoTorch(), coloring="row"), x).to_dense().numpy()
    np.testing.assert_allclose(found, dense, rtol=1e-12)


def _sum_out_by_position(x: Any) -> Any:
    o = np.empty(2)
    np.sum(x.reshape(2, 4), 1, None, o)
    return o * 2.0


def _cumsum_out_by_position(x: Any) -> Any:
    o = np.empty(8)
    np.cumsum(x, 0, None, o)
    return o


def _dot_out_by_position(x: Any) -> Any:
    o = np.empty(2)
    np.dot(x[:4].reshape(2, 2), x[4:6], o)
    return o


@pytest.mark.parametrize("f", [_sum_out_by_position, _cumsum_out_by_position, _dot_out_by_position])
def test_a_numpy_out_given_by_position_is_refused(f: Callable[[Any], Any]) -> None:
    # expected: the refusal of out=...; the write into o by position went unseen, f returned o
    # as a plain array, and the sparse Jacobian was all zeros where the dense one is not
    x = np.random.default_rng(0).uniform(-1.5, 1.5, 8)
    with pytest.raises(di.UnsupportedOperationError, match="out="):
        di.jacobian(f, di.AutoSparse("finite_differences"), x)


def test_numpy_linalg_trace_sums_the_diagonals_of_the_last_two_axes() -> None:
    # expected: np.linalg.trace read as np.trace (its namesake), the diagonal of axes 0 and 1
    # with offset -1 summed: a result of one number broadcast against x[:2], a pattern that
    # missed 4 entries, and a sparse Jacobian off by 1.4
    linalg_trace = getattr(np.linalg, "trace", None)
    if linalg_trace is None:
        pytest.skip("numpy < 2 has no np.linalg.trace")

    def f(x: Any) -> Any:
        return linalg_trace(x.reshape(2, 3, 2), offset=-1) * x[:2]

    x = np.random.default_rng(0).uniform(-1.5, 1.5, 12)
    dense = np.asarray(di.jacobian(f, "finite_differences", x)).reshape(-1, 12)
    pattern = sparse.jacobian_pattern(f, x, detector=sparse.GlobalDetector(tracer="numpy"))
    assert not _missing(pattern, np.where(np.abs(dense) > 1e-8, dense, 0.0))
    assert pattern.nnz == 6  # each output: the two entries of its diagonal and its own factor
    np.testing.assert_allclose(di.jacobian(f, di.AutoSparse("finite_differences"), x).toarray(), dense, atol=1e-8)


def test_numpy_matmul_with_axes_is_not_read_as_a_plain_product() -> None:
    # expected: np.matmul(..., axes=...) read as the product of the last two axes, its output
    # transposed back: a pattern that missed 2 entries and a sparse Jacobian off by 1.2
    c = np.array([[1.0, 0.0], [0.0, 2.0]])

    def f(x: Any) -> Any:
        return np.matmul(x[:4].reshape(2, 2), c, axes=[(-2, -1), (-2, -1), (-1, -2)]).ravel() * x[4:]

    x = np.random.default_rng(0).uniform(-1.5, 1.5, 8)
    dense = np.asarray(di.jacobian(f, "finite_differences", x))
    pattern = sparse.jacobian_pattern(f, x, detector=sparse.GlobalDetector(tracer="numpy"))
    assert not _missing(pattern, np.where(np.abs(dense) > 1e-8, dense, 0.0))
    np.testing.assert_allclose(di.jacobian(f, di.AutoSparse("finite_differences"), x).toarray(), dense, atol=1e-8)


def test_a_sparse_prep_s_other_object_or_value_is_named_in_words() -> None:
    """A sparse prep is made for its Constant's object (or value): another object of the same
    class holding arrays of the same shapes, or another string, was refused with the words
    alike on both sides and the raw signature tuples after them (an object's id)."""
    backend = di.AutoSparse(di.AutoFiniteDifferences())

    def f(v: Any, m: Any) -> Any:
        return m.w * v

    x, model = np.ones(3), _Model(np.ones(3))
    prep = di.prepare_jacobian(f, backend, x, di.Constant(model))
    with pytest.raises(di.PreparationMismatchError) as raised:
        di.jacobian(f, backend, x, di.Constant(_Model(np.ones(3))), prep=prep)
    message = str(raised.value)
    assert "called with another _Model object (a prep is made for the object it was given)" in message
    assert "identity" not in message and "'static'" not in message

    def g(v: Any, s: str) -> Any:
        return v * len(s)

    prep = di.prepare_jacobian(g, backend, x, di.Constant("ab"))
    with pytest.raises(di.PreparationMismatchError, match=r"equal to 'ab', called with a str .*equal to 'abc'"):
        di.jacobian(g, backend, x, di.Constant("abc"), prep=prep)
