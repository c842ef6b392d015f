"""Property-based tests: random pytrees and random smooth functions, on every backend.

The functions are written once against an array namespace picked from the leaf type (numpy,
torch, jax.numpy, or autograd.numpy for autograd's traced ArrayBox), so the same function
runs on every engine and on finite differences of any array type.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diffiface as di
import diffiface._adapters as adapters
from diffiface._arrays import numpy_like

settings.register_profile(
    "ci",
    max_examples=5,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.load_profile("ci")

# (backend, array type of x): every backend on numpy inputs, the AD engines on their own
# arrays, finite differences on torch tensors (it calls f with x's own array type).
COMBINATIONS = [
    ("finite_differences", "numpy"),
    ("finite_differences", "torch"),
    ("jax", "numpy"),
    ("jax", "jax"),
    ("torch", "numpy"),
    ("torch", "torch"),
    ("autograd", "numpy"),
    ("scipy", "numpy"),
]
IDS = [f"{b}-{k}" for b, k in COMBINATIONS]


def need(*backends: str) -> None:
    for backend in backends:
        if not di.available(backend):
            pytest.skip(
                f'the {backend} backend is not installed: pip install "diffiface[{adapters.info(backend).extra}]"'
            )


def examples(backend: str) -> int:
    """scipy refines its steps adaptively with one Python call of f per point: fewer examples."""
    return 2 if backend == "scipy" else 5


# -- array namespaces ------------------------------------------------------------------------


xp_of = numpy_like  # the numpy-like module of a leaf's framework


OPS = (
    ("sin", lambda xp, v: xp.sin(v)),
    ("gauss", lambda xp, v: xp.exp(-(v * v))),
    ("square", lambda xp, v: v * v),
    ("tanh", lambda xp, v: xp.tanh(v)),
)


@dataclass(frozen=True)
class Problem:
    """A pytree x (numpy leaves of one dtype) and the parameters of a smooth function of it."""

    x: Any
    ops: tuple[int, ...]
    weights: tuple[float, ...]
    coupling: float
    seed: int

    def leaves(self, x: Any) -> list[Any]:
        return optree.tree_leaves(x)

    def scalar(self, x: Any) -> Any:
        """``sum_i w_i sum(op_i(x_i)) + c sum(x_0) sum(x_last)``: a scalar."""
        leaves = self.leaves(x)
        total = None
        for leaf, op, w in zip(leaves, self.ops, self.weights, strict=False):
            xp = xp_of(leaf)
            term = w * xp.sum(OPS[op][1](xp, leaf))
            total = term if total is None else total + term
        first, last = leaves[0], leaves[-1]
        return total + self.coupling * xp_of(first).sum(first) * xp_of(last).sum(last)

    def vector(self, x: Any) -> Any:
        """A tuple: each leaf mapped elementwise and coupled to all others, then the scalar."""
        leaves = self.leaves(x)
        s = self.scalar(x)
        outs = tuple(
            w * OPS[op][1](xp_of(leaf), leaf) + 0.25 * s * leaf
            for leaf, op, w in zip(leaves, self.ops, self.weights, strict=False)
        )
        return (*outs, s)


SHAPES = [(), (0,), (1,), (3,), (2, 2)]


@st.composite
def problems(draw: Any) -> Problem:
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    leaf = st.sampled_from(SHAPES).map(lambda shape: rng.uniform(-1.0, 1.0, shape).astype(dtype))
    tree = draw(
        st.recursive(
            leaf,
            lambda children: st.one_of(
                st.lists(children, min_size=1, max_size=2),
                st.dictionaries(st.sampled_from(["a", "b", "w"]), children, min_size=1, max_size=2),
                st.tuples(children, children),
            ),
            max_leaves=3,
        )
    )
    n = len(optree.tree_leaves(tree))
    ops = tuple(draw(st.integers(0, len(OPS) - 1)) for _ in range(n))
    weights = tuple(draw(st.sampled_from([-1.5, -0.5, 0.75, 2.0])) for _ in range(n))
    coupling = draw(st.sampled_from([0.0, 0.5, -1.0]))
    return Problem(tree, ops, weights, coupling, seed)


# -- moving trees between array types ---------------------------------------------------------


def as_kind(tree: Any, kind: str) -> Any:
    if kind == "numpy":
        return optree.tree_map(np.copy, tree)
    if kind == "torch":
        import torch

        return optree.tree_map(lambda a: torch.from_numpy(a.copy()), tree)
    import jax
    import jax.numpy as jnp

    with jax.enable_x64(True):
        return optree.tree_map(lambda a: jnp.asarray(a), tree)


def to_numpy(leaf: Any) -> np.ndarray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.Tensor):
        return leaf.detach().numpy()
    return np.asarray(leaf)


def flat(tree: Any) -> np.ndarray:
    """All leaves of ``tree`` as one float64 vector."""
    leaves = [to_numpy(leaf).astype(np.float64).reshape(-1) for leaf in optree.tree_leaves(tree)]
    return np.concatenate(leaves) if leaves else np.zeros(0)


def random_like(tree: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    return optree.tree_map(lambda a: rng.uniform(-1.0, 1.0, np.shape(a)).astype(a.dtype), tree)


def tolerance(problem: Problem) -> dict[str, float]:
    dtype = optree.tree_leaves(problem.x)[0].dtype
    return {"rtol": 1e-2, "atol": 2e-3} if dtype == np.float32 else {"rtol": 1e-6, "atol": 1e-7}


def close(a: np.ndarray, b: np.ndarray, problem: Problem, scale: float = 1.0) -> None:
    tol = tolerance(problem)
    np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, scale))


def out_dtype(problem: Problem) -> Any:
    return optree.tree_leaves(problem.x)[0].dtype


def check_mirrors(result: Any, like: Any) -> None:
    """Same structure; per leaf, the same shape, dtype and array type."""
    assert optree.tree_structure(result) == optree.tree_structure(like)
    for r, x in zip(optree.tree_leaves(result), optree.tree_leaves(like), strict=True):
        assert type(r) is type(x), (type(r), type(x))
        assert tuple(r.shape) == tuple(x.shape)
        assert r.dtype == x.dtype
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(r, torch.Tensor):
            assert not r.requires_grad


def run(backend: str, kind: str, check: Any) -> None:
    need(backend, *(() if kind == "numpy" else (kind,)))

    @settings(max_examples=examples(backend))
    @given(problems())
    def inner(problem: Problem) -> None:
        check(backend, as_kind(problem.x, kind), problem)

    inner()


# -- the properties ---------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "kind"), COMBINATIONS, ids=IDS)
def test_results_mirror_inputs(backend: str, kind: str) -> None:
    def check(backend: str, x: Any, problem: Problem) -> None:
        check_mirrors(di.gradient(problem.scalar, backend, x), x)
        ty = as_kind(random_like(problem.vector(problem.x), problem.seed), kind)
        check_mirrors(di.vjp(problem.vector, backend, x, ty), x)
        tx = as_kind(random_like(problem.x, problem.seed + 1), kind)
        check_mirrors(di.jvp(problem.vector, backend, x, tx), ty)
        check_mirrors(di.hvp(problem.scalar, backend, x, tx), x)

    run(backend, kind, check)


@pytest.mark.parametrize(("backend", "kind"), COMBINATIONS, ids=IDS)
def test_jvp_and_vjp_are_adjoint(backend: str, kind: str) -> None:
    def check(backend: str, x: Any, problem: Problem) -> None:
        tx = random_like(problem.x, problem.seed + 1)
        ty = random_like(problem.vector(problem.x), problem.seed + 2)
        jtx = di.jvp(problem.vector, backend, x, as_kind(tx, kind))
        jty = di.vjp(problem.vector, backend, x, as_kind(ty, kind))
        left, right = flat(ty) @ flat(jtx), flat(jty) @ flat(tx)
        scale = float(np.abs(flat(ty)) @ np.abs(flat(jtx)) + np.abs(flat(jty)) @ np.abs(flat(tx)))
        close(np.array(left), np.array(right), problem, scale)

    run(backend, kind, check)


@pytest.mark.parametrize(("backend", "kind"), COMBINATIONS, ids=IDS)
def test_gradient_is_vjp_of_one(backend: str, kind: str) -> None:
    def check(backend: str, x: Any, problem: Problem) -> None:
        one = as_kind(np.ones((), dtype=out_dtype(problem)), kind)
        grad = di.gradient(problem.scalar, backend, x)
        pulled = di.vjp(problem.scalar, backend, x, one)
        close(flat(grad), flat(pulled), problem)

    run(backend, kind, check)


def _hessian_matrix(hessian: Any, x: Any) -> np.ndarray:
    """The nested hessian (x-structure of x-structure) as one n-by-n matrix."""
    sizes = [math.prod(np.shape(to_numpy(leaf))) for leaf in optree.tree_leaves(x)]
    outer = optree.tree_structure(x).flatten_up_to(hessian)
    assert len(outer) == len(sizes)
    offsets = np.cumsum([0, *sizes])
    matrix = np.zeros((offsets[-1], offsets[-1]))
    for i, row in enumerate(outer):
        blocks = optree.tree_leaves(row)
        assert len(blocks) == len(sizes)
        for j, block in enumerate(blocks):
            matrix[offsets[i] : offsets[i + 1], offsets[j] : offsets[j + 1]] = to_numpy(block).reshape(
                sizes[i], sizes[j]
            )
    return matrix


@pytest.mark.parametrize(("backend", "kind"), COMBINATIONS, ids=IDS)
def test_hessian_is_symmetric_and_matches_hvp(backend: str, kind: str) -> None:
    def check(backend: str, x: Any, problem: Problem) -> None:
        hessian = di.hessian(problem.scalar, backend, x)
        matrix = _hessian_matrix(hessian, x)
        scale = float(np.abs(matrix).max(initial=0.0))
        close(matrix, matrix.T, problem, scale)
        tx = random_like(problem.x, problem.seed + 3)
        hv = di.hvp(problem.scalar, backend, x, as_kind(tx, kind))
        close(flat(hv), matrix @ flat(tx), problem, scale * max(1, matrix.shape[0]))

    run(backend, kind, check)


@pytest.mark.parametrize(("backend", "kind"), COMBINATIONS, ids=IDS)
def test_jacobian_rows_are_vjps_of_basis_vectors(backend: str, kind: str) -> None:
    def check(backend: str, x: Any, problem: Problem) -> None:
        y = problem.vector(problem.x)
        jacobian = di.jacobian(problem.vector, backend, x)
        assert isinstance(jacobian, tuple)
        assert len(jacobian) == len(y)
        for i, yi in enumerate(y):
            block_row = jacobian[i]
            assert optree.tree_structure(block_row) == optree.tree_structure(x)
            for k in range(yi.size):
                ty = tuple(np.zeros_like(v) for v in y)
                ty[i].reshape(-1)[k] = 1
                row = di.vjp(problem.vector, backend, x, as_kind(ty, kind))
                expected = flat(row)
                got = (
                    np.concatenate(
                        [to_numpy(b).astype(np.float64).reshape(yi.size, -1)[k] for b in optree.tree_leaves(block_row)]
                    )
                    if optree.tree_leaves(block_row)
                    else np.zeros(0)
                )
                close(got, expected, problem)
                for b, xj in zip(optree.tree_leaves(block_row), optree.tree_leaves(x), strict=True):
                    assert tuple(b.shape) == (*yi.shape, *xj.shape)

    run(backend, kind, check)


@pytest.mark.parametrize(("backend", "kind"), COMBINATIONS, ids=IDS)
def test_prepared_equals_unprepared(backend: str, kind: str) -> None:
    def check(backend: str, x: Any, problem: Problem) -> None:
        tx = as_kind(random_like(problem.x, problem.seed + 4), kind)
        for name, f, args in (
            ("gradient", problem.scalar, (x,)),
            ("jvp", problem.vector, (x, tx)),
            ("hessian", problem.scalar, (x,)),
        ):
            prep = getattr(di, f"prepare_{name}")(f, backend, *args)
            prepared = getattr(di, name)(f, backend, *args, prep=prep)
            unprepared = getattr(di, name)(f, backend, *args)
            assert optree.tree_structure(prepared) == optree.tree_structure(unprepared)
            np.testing.assert_array_equal(flat(prepared), flat(unprepared))

    run(backend, kind, check)


@pytest.mark.parametrize(
    ("backend", "kind"),
    [c for c in COMBINATIONS if c[0] != "finite_differences"],
    ids=[i for i in IDS if not i.startswith("finite")],
)
def test_agrees_with_finite_differences(backend: str, kind: str) -> None:
    def check(backend: str, x: Any, problem: Problem) -> None:
        x64 = optree.tree_map(lambda a: a.astype(np.float64), problem.x)
        grad = di.gradient(problem.scalar, backend, x)
        reference = di.gradient(problem.scalar, "finite_differences", x64)
        scale = float(np.abs(flat(reference)).max(initial=0.0))
        close(flat(grad), flat(reference), problem, scale)
        tx = random_like(problem.x, problem.seed + 5)
        jvp = di.jvp(problem.vector, backend, x, as_kind(tx, kind))
        reference = di.jvp(
            problem.vector, "finite_differences", x64, optree.tree_map(lambda a: a.astype(np.float64), tx)
        )
        close(flat(jvp), flat(reference), problem, float(np.abs(flat(reference)).max(initial=0.0)))

    run(backend, kind, check)
