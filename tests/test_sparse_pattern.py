"""diffiface.sparse: sparsity patterns (global, local, known) and their colorings.

- Each pattern family (elementwise maps, squared differences, banded linear and quadratic forms,
  arrowhead, 2-D Laplacian residual, separable sums) gets its analytic pattern from
  GlobalDetector, a pattern holding every dense nonzero from LocalDetector, and colorings whose
  decompression gives the dense Jacobian (Hessian) back bit for bit.
- GlobalDetector is conservative: on a corpus of functions (branches, gathers, scatters, loops,
  sorts, custom derivatives...) its pattern holds every nonzero of jax's dense Jacobian
  (Hessian) at many random points.
- Colorings are valid (no two columns of one color share a row; rows likewise; star: every
  path on four vertices has three colors) and banded patterns get one color per diagonal.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import diffiface as di

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
sp = pytest.importorskip("scipy.sparse")

from diffiface import sparse  # noqa: E402

RNG = np.random.default_rng(0)


# --- helpers -------------------------------------------------------------------------------------


def dense_jacobian(f: Callable[..., Any], x: np.ndarray) -> np.ndarray:
    """jax's dense Jacobian: forward mode (while loops), reverse where forward is refused
    (custom_vjp)."""
    with jax.enable_x64(True):
        size = int(np.prod(jax.eval_shape(f, jnp.asarray(x)).shape, dtype=np.int64))
        try:
            out = jax.jacfwd(f)(jnp.asarray(x))
        except TypeError:
            out = jax.jacrev(f)(jnp.asarray(x))
    return np.asarray(out).reshape(size, x.size)


def dense_hessian(f: Callable[..., Any], x: np.ndarray) -> np.ndarray:
    with jax.enable_x64(True):
        return np.asarray(jax.jit(jax.jacfwd(jax.jacfwd(f)))(jnp.asarray(x))).reshape(x.size, x.size)


def band(n: int, b: int) -> np.ndarray:
    i, j = np.indices((n, n))
    return np.abs(i - j) <= b


def assert_same(pattern: Any, expected: np.ndarray) -> None:
    assert isinstance(pattern, sp.csr_array)
    assert pattern.dtype == bool
    assert pattern.has_canonical_format
    assert pattern.shape == expected.shape
    got = pattern.toarray()
    missing = np.argwhere(expected & ~got)
    extra = np.argwhere(got & ~expected)
    assert not missing.size and not extra.size, f"missing {missing[:5].tolist()}, extra {extra[:5].tolist()}"


def check_column(coloring: sparse.Coloring, J: np.ndarray) -> None:
    pattern = coloring.pattern.toarray()
    assert coloring.mode == "column"
    for c in range(coloring.count):
        rows_hit = pattern[:, coloring.colors == c].sum(axis=1)
        assert rows_hit.max(initial=0) <= 1, "two columns of one color share a row"
    compressed = J @ coloring.seeds
    np.testing.assert_array_equal(compressed.reshape(-1)[coloring.index], J[pattern])


def check_row(coloring: sparse.Coloring, J: np.ndarray) -> None:
    pattern = coloring.pattern.toarray()
    assert coloring.mode == "row"
    for c in range(coloring.count):
        columns_hit = pattern[coloring.colors == c, :].sum(axis=0)
        assert columns_hit.max(initial=0) <= 1, "two rows of one color share a column"
    compressed = coloring.seeds.T @ J
    np.testing.assert_array_equal(compressed.reshape(-1)[coloring.index], J[pattern])


def check_any(coloring: sparse.Coloring, J: np.ndarray) -> None:
    """A coloring of any mode decompresses J exactly (bidirectional: forward and reverse products)."""
    if coloring.mode == "bidirectional":
        decompressed = coloring.decompress(J @ coloring.seeds, coloring.row_seeds.T @ J).toarray()
        np.testing.assert_array_equal(decompressed, J)
    else:
        (check_column if coloring.mode == "column" else check_row)(coloring, J)


def check_star(coloring: sparse.Coloring, H: np.ndarray) -> None:
    """Distance-1 proper, star (checked on every path of four vertices through each edge's
    neighborhood), and the direct decompression exact."""
    pattern = coloring.pattern.toarray()
    assert coloring.mode == "star"
    assert (pattern == pattern.T).all()
    colors = coloring.colors
    adjacency = pattern & ~np.eye(len(pattern), dtype=bool)
    i, j = np.nonzero(adjacency)
    assert (colors[i] != colors[j]).all(), "two neighbors share a color"
    neighbors = [np.flatnonzero(row) for row in adjacency]
    # A path a-b-c-d with two colors has colors(a) == colors(c) and colors(b) == colors(d).
    for b_, c_ in zip(i.tolist(), j.tolist(), strict=True):
        same_as_c = [a for a in neighbors[b_] if a != c_ and colors[a] == colors[c_]]
        same_as_b = [d for d in neighbors[c_] if d != b_ and colors[d] == colors[b_]]
        assert not (same_as_c and same_as_b), f"two-colored path {same_as_c[0]}-{b_}-{c_}-{same_as_b[0]}"
    compressed = H @ coloring.seeds
    np.testing.assert_array_equal(compressed.reshape(-1)[coloring.index], H[pattern])


def symmetric_values(pattern: np.ndarray) -> np.ndarray:
    values = RNG.standard_normal(pattern.shape)
    return np.where(pattern, values + values.T, 0.0)


# --- the pattern families --------------------------------------------------------------------------


def banded_linear(b: int) -> Callable[[Any], Any]:
    coefficients = np.linspace(1.0, 2.0, 2 * b + 1)

    def f(x: Any) -> Any:
        padded = jnp.pad(x, b)
        return sum(coefficients[k + b] * padded[b + k : b + k + x.shape[0]] for k in range(-b, b + 1))

    return f


def banded_quadratic(b: int) -> Callable[[Any], Any]:
    def f(x: Any) -> Any:
        return jnp.sum(x**2) + sum(jnp.sum(jnp.sin(x[k:]) * x[:-k]) for k in range(1, b + 1))

    return f


def laplacian(m: int) -> Callable[[Any], Any]:
    def f(x: Any) -> Any:
        u = x.reshape(m, m)
        p = jnp.pad(u, 1)
        return (4 * u - p[:-2, 1:-1] - p[2:, 1:-1] - p[1:-1, :-2] - p[1:-1, 2:] + u**3).reshape(-1)

    return f


def laplacian_pattern(m: int) -> np.ndarray:
    t = sp.diags_array([np.ones(m - 1), np.ones(m), np.ones(m - 1)], offsets=[-1, 0, 1]).toarray() != 0
    eye = np.eye(m, dtype=bool)
    return (np.kron(eye, t) | np.kron(t, eye)).astype(bool)


def arrowhead_jacobian(x: Any) -> Any:
    return jnp.concatenate([jnp.sum(x**2)[None], x[1:] * x[0]])


def arrow(n: int) -> np.ndarray:
    a = np.eye(n, dtype=bool)
    a[0, :] = True
    a[:, 0] = True
    return a


N = 24

JACOBIAN_FAMILIES: dict[str, tuple[Callable[[Any], Any], np.ndarray]] = {
    "elementwise": (lambda x: jnp.sin(x) * x**2 + jnp.exp(x) / (1 + x**2), np.eye(N, dtype=bool)),
    "squared-differences": (
        lambda x: (x[1:] - x[:-1]) ** 2,
        np.eye(N - 1, N, dtype=bool) | np.eye(N - 1, N, 1, dtype=bool),
    ),
    "banded-linear-5": (banded_linear(5), band(N, 5)),
    "banded-linear-10": (banded_linear(10), band(N, 10)),
    "banded-linear-20": (banded_linear(20), band(N, 20)),
    "arrowhead": (arrowhead_jacobian, arrow(N)),
    "laplacian-2d": (laplacian(5), laplacian_pattern(5)),
}

HESSIAN_FAMILIES: dict[str, tuple[Callable[[Any], Any], np.ndarray]] = {
    "squared-differences": (lambda x: jnp.sum((x[1:] - x[:-1]) ** 2), band(N, 1)),
    "banded-quadratic-5": (banded_quadratic(5), band(N, 5)),
    "banded-quadratic-10": (banded_quadratic(10), band(N, 10)),
    "banded-quadratic-20": (banded_quadratic(20), band(N, 20)),
    "arrowhead": (lambda x: x[0] * jnp.sum(x[1:] ** 2) + jnp.sum(x**2), arrow(N)),
    "separable-blocks": (
        lambda x: jnp.sum(jnp.prod(jnp.sin(x.reshape(-1, 4)), axis=1)) + jnp.sum(x**3),
        np.kron(np.eye(N // 4, dtype=bool), np.ones((4, 4), dtype=bool)),
    ),
}


def point(n: int = N) -> np.ndarray:
    return RNG.uniform(0.5, 1.5, n)


@pytest.mark.parametrize("name", JACOBIAN_FAMILIES)
def test_jacobian_family_global_is_analytic(name: str) -> None:
    f, expected = JACOBIAN_FAMILIES[name]
    x = point(expected.shape[1])
    pattern = sparse.jacobian_pattern(f, x)
    assert_same(pattern, expected)
    J = dense_jacobian(f, x)
    assert not (J != 0)[~expected].any()  # the analytic pattern is right too
    check_column(sparse.color_jacobian(pattern, mode="column"), J)
    check_row(sparse.color_jacobian(pattern, mode="row"), J)
    for order in sparse.ORDERS:
        check_any(sparse.color_jacobian(pattern, order=order), J)


@pytest.mark.parametrize("name", JACOBIAN_FAMILIES)
def test_jacobian_family_local_holds_the_dense_nonzeros(name: str) -> None:
    f, expected = JACOBIAN_FAMILIES[name]
    x = point(expected.shape[1])
    pattern = sparse.jacobian_pattern(f, x, detector=sparse.LocalDetector(points=2), backend="jax")
    got = pattern.toarray()
    assert not (got & ~expected).any()
    assert not ((dense_jacobian(f, x) != 0) & ~got).any()
    assert_same(pattern, expected)  # these functions have no zero that depends on the point


@pytest.mark.parametrize("name", HESSIAN_FAMILIES)
def test_hessian_family(name: str) -> None:
    f, expected = HESSIAN_FAMILIES[name]
    x = point(expected.shape[1])
    H = dense_hessian(f, x)
    assert not (H != 0)[~expected].any()
    assert_same(sparse.hessian_pattern(f, x), expected)
    assert_same(sparse.hessian_pattern(f, x, detector=sparse.LocalDetector(), backend="jax"), expected)
    assert_same(sparse.hessian_pattern(f, x, detector=sparse.KnownPattern(sp.csr_array(np.triu(expected)))), expected)
    for order in sparse.ORDERS:
        check_star(sparse.color_hessian(expected, order=order), H)


@pytest.mark.parametrize("b", [1, 5, 10, 20])
def test_banded_patterns_get_one_color_per_diagonal(b: int) -> None:
    pattern = band(200, b)
    assert sparse.color_jacobian(pattern).count == 2 * b + 1
    assert sparse.color_jacobian(pattern, mode="row").count == 2 * b + 1
    assert sparse.color_hessian(pattern).count == 2 * b + 1
    upper = np.triu(pattern) & ~np.triu(np.ones_like(pattern), b + 1)
    assert sparse.color_jacobian(upper).count == b + 1  # bandwidth b: b + 1 diagonals


def test_known_patterns_and_their_colorings() -> None:
    assert sparse.color_hessian(arrow(50)).count == 2
    for side in ("column", "row"):  # a dense row and a dense column: one side alone takes every color
        assert sparse.color_jacobian(arrow(50), mode=side).count == 50
    both = sparse.color_jacobian(arrow(50))  # auto: the dense row by a reverse product, the rest forward
    assert (both.mode, both.count, both.sides) == ("bidirectional", 3, {"forward": 2, "reverse": 1})
    one_dense_column = np.eye(6, dtype=bool)
    one_dense_column[:, 0] = True
    assert (sparse.color_jacobian(one_dense_column).mode, sparse.color_jacobian(one_dense_column).count) == (
        "column",
        2,
    )
    assert sparse.color_jacobian(one_dense_column.T).mode == "row"
    tie = np.eye(5, dtype=bool)
    assert sparse.color_jacobian(tie).mode == "column"
    assert sparse.color_hessian(np.kron(np.eye(10, dtype=bool), np.ones((4, 4), dtype=bool))).count == 4


# --- conservativeness ------------------------------------------------------------------------------


@jax.custom_jvp
def _odd_rule(x: Any) -> Any:
    return x * 2.0


@_odd_rule.defjvp
def _odd_rule_jvp(primals: Any, tangents: Any) -> Any:  # the rule, not the primal, sets the pattern
    (x,), (t,) = primals, tangents
    return x * 2.0, 2.0 * t + jnp.roll(t, 1)


@jax.custom_vjp
def _clip_gradient(x: Any) -> Any:
    return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))


@jax.custom_vjp
def _mix(x: Any, y: Any) -> Any:
    return x * y, x[::-1]


def _mix_bwd(residuals: Any, g: Any) -> Any:  # the reverse rule adds a dependence the primal lacks
    x, y = residuals
    return g[0] * y + g[1][::-1], g[0] * x + jnp.roll(g[0], 1)


_mix.defvjp(lambda x, y: (_mix(x, y), (x, y)), _mix_bwd)


def _while(x: Any) -> Any:
    def body(state: Any) -> Any:
        i, y = state
        return i + 1, jnp.sin(y) * jnp.roll(y, 1)

    return jax.lax.while_loop(lambda s: (s[0] < 3) & (jnp.sum(s[1]) < 1e6), body, (0, x))[1]


def _scan(x: Any) -> Any:
    def step(carry: Any, xi: Any) -> Any:
        return carry * xi + 1.0, carry + xi**2

    last, ys = jax.lax.scan(step, x[0], x[1:])
    return jnp.concatenate([last[None], ys])


_KERNEL = np.random.default_rng(3).uniform(0.5, 1.5, (3, 3, 2, 6))
_KERNEL[:, :, 1, 2] = 0.0  # known zeros of a constant kernel are structural
_KERNEL[0, 0] = 0.0


def _conv_groups(x: Any) -> Any:
    image = jnp.concatenate([x, x[::-1], x**2])[:30].reshape(1, 3, 5, 2)
    image = jnp.concatenate([image, image], axis=3)
    return jax.lax.conv_general_dilated(
        image, _KERNEL, (2, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2
    ).reshape(-1)


def _conv_both(x: Any) -> Any:
    image = jnp.tile(x, 3)[:28].reshape(1, 1, 7, 4)
    kernel = x[:8].reshape(2, 1, 2, 2) ** 2
    return jax.lax.conv_general_dilated(
        image, kernel, (1, 2), ((2, 0), (1, 1)), lhs_dilation=(2, 1), rhs_dilation=(1, 2)
    ).reshape(-1)


CORPUS: dict[str, Callable[[Any], Any]] = {
    "where": lambda x: jnp.where(x > 1.0, x**2, -x[::-1]),
    "cond": lambda x: jax.lax.cond(x[0] > 1.0, lambda y: y * 2.0, lambda y: jnp.roll(y, 2), x),
    "gather": lambda x: x[np.array([3, 0, 0, 7, 5])] * x[:5],
    "gather-traced-index": lambda x: x[jnp.argmax(x)] * x,
    "scatter-add": lambda x: x.at[np.array([1, 1, 4])].add(x[:3] ** 2),
    "scatter-set": lambda x: x.at[2:5].set(jnp.sin(x[5:8])),
    "cumsum": lambda x: jnp.cumsum(x**2)[::-1],
    "cumprod-2d": lambda x: jnp.cumprod(x.reshape(2, -1), axis=1).reshape(-1),
    "matmul": lambda x: jnp.outer(x[:4], x[4:]) @ x[4:],
    "matmul-constant": lambda x: np.triu(np.ones((x.shape[0], x.shape[0]))) @ x,
    "while": _while,
    "fori": lambda x: jax.lax.fori_loop(0, 4, lambda i, y: y * jnp.roll(x, i), x),
    "scan": _scan,
    "sort": lambda x: jnp.sort(x.reshape(2, -1) ** 2, axis=1).reshape(-1),
    "top-k": lambda x: jax.lax.top_k(x, 3)[0],
    "dynamic-slice": lambda x: jax.lax.dynamic_slice(x, (jnp.argmin(x),), (3,)),
    "dynamic-update": lambda x: jax.lax.dynamic_update_slice(x, x[:2] ** 2, (4,)),
    "reductions": lambda x: jnp.stack([jnp.max(x), jnp.min(x[2:]), jnp.prod(x[:3]), jnp.linalg.norm(x)]),
    "softmax-logsumexp": lambda x: jax.nn.softmax(x[:5]) * jax.nn.logsumexp(x[5:]),
    "relu-softplus": lambda x: jax.nn.relu(x - 1.0) + jax.nn.softplus(x[::-1]),
    "custom-jvp-rule": _odd_rule,
    "custom-vjp": lambda x: _clip_gradient(x) * x[0],
    "custom-vjp-rule": lambda x: jnp.concatenate(_mix(x[:5], x[5:])),
    "convolve": lambda x: jnp.convolve(x, jnp.array([1.0, -2.0, 1.0]), mode="same"),
    "conv-groups-strides": _conv_groups,
    "conv-dilations-both-inputs": _conv_both,
    "pad-interior": lambda x: jax.lax.pad(x, 0.0, ((1, -2, 1),)),
    "reshape-transpose": lambda x: (x.reshape(2, 5).T * jnp.arange(5.0)[:, None]).reshape(-1),
    "pooling": lambda x: jnp.concatenate(
        [
            jax.lax.reduce_window(x.reshape(2, 5), 0.0, jax.lax.add, (2, 2), (1, 2), "SAME").reshape(-1),
            jax.lax.reduce_window(x.reshape(5, 2) ** 2, -jnp.inf, jax.lax.max, (3, 1), (2, 1), "VALID").reshape(-1),
        ]
    ),
    "take-along-axis": lambda x: jnp.take_along_axis(x.reshape(2, 5), np.array([[4, 0], [1, 1]]), axis=1).ravel(),
    "vmap-gather-scatter": lambda x: jax.vmap(lambda r, i: r.at[i].add(r[0] ** 2) * r[i])(
        x.reshape(2, 5), np.array([3, 1])
    ).ravel(),
    "tile-repeat": lambda x: jnp.tile(x[:4], 2) * jnp.repeat(x[4:8], 2),
    "split-concatenate": lambda x: jnp.concatenate(jnp.split(x, 2)[::-1]) * jnp.floor(x),
    "integer-ops": lambda x: x * (x > 1.0).astype(x.dtype) + jnp.round(x) * x[0],
    "clip-select": lambda x: jnp.select([x < 0.8, x > 1.2], [x, x**2], jnp.sin(x)),
    "stop-gradient": lambda x: jax.lax.stop_gradient(x) * x[::-1],
    "linear-solve": lambda x: jnp.linalg.solve(jnp.eye(5) + jnp.outer(x[:5], x[5:]), x[:5]),
}


@pytest.mark.parametrize("name", CORPUS)
def test_global_jacobian_is_conservative(name: str) -> None:
    f = CORPUS[name]
    rng = np.random.default_rng(1)
    x0 = rng.uniform(0.5, 1.5, 10)
    pattern = sparse.jacobian_pattern(f, x0).toarray()
    for _ in range(6):
        x = rng.uniform(0.5, 1.5, 10)
        nonzero = dense_jacobian(f, x) != 0
        assert not (nonzero & ~pattern).any(), f"missed {np.argwhere(nonzero & ~pattern)[:5].tolist()}"


HESSIAN_CORPUS: dict[str, Callable[[Any], Any]] = {
    "where": lambda x: jnp.sum(jnp.where(x > 1.0, x**3, x[::-1] ** 2)),
    "gather": lambda x: jnp.sum(x[np.array([3, 0, 0, 7])] ** 2 * x[:4]),
    "cumsum": lambda x: jnp.sum(jnp.cumsum(x) ** 2),
    "matmul": lambda x: x[:5] @ (jnp.outer(x[:5], x[5:]) @ x[5:]),
    "fori": lambda x: jnp.sum(jax.lax.fori_loop(0, 3, lambda i, y: jnp.sin(y) * jnp.roll(y, 1), x)),
    "scan": lambda x: jnp.sum(_scan(x) ** 2),
    "sort": lambda x: jnp.sum(jnp.sort(x) * jnp.arange(10.0)) ** 2,
    "logsumexp": lambda x: jax.nn.logsumexp(x[:5]) + jnp.sum(x[5:] ** 3),
    "custom-jvp-rule": lambda x: jnp.sum(_odd_rule(x) ** 2),
    "while": lambda x: jnp.sum(_while(x)),
}


@pytest.mark.parametrize("name", HESSIAN_CORPUS)
def test_global_hessian_is_conservative(name: str) -> None:
    f = HESSIAN_CORPUS[name]
    rng = np.random.default_rng(2)
    pattern = sparse.hessian_pattern(f, rng.uniform(0.5, 1.5, 10)).toarray()
    assert (pattern == pattern.T).all()
    for _ in range(4):
        x = rng.uniform(0.5, 1.5, 10)
        nonzero = dense_hessian(f, x) != 0
        assert not (nonzero & ~pattern).any(), f"missed {np.argwhere(nonzero & ~pattern)[:5].tolist()}"


ZOO = ("dense_tanh", "conv_maxpool", "maxout", "conv_transpose", "layer_norm", "embedding", "dropout")


@pytest.mark.parametrize("name", ZOO)
def test_global_hessian_holds_on_the_layer_zoo(name: str) -> None:
    """The zoo's layers (array API, with Constant configs, data and states): the global pattern
    holds every nonzero of jax's dense Hessian at a point near the parameters."""
    from diffiface.test import layer_scenarios

    (scenario,) = [s for s in layer_scenarios(("float64",)) if s.name == f"{name}-float64"]
    found = sparse.hessian_pattern(scenario.f, scenario.x, *scenario.contexts)
    local = sparse.hessian_pattern(
        scenario.f, scenario.x, *scenario.contexts, detector=sparse.LocalDetector(points=1), backend="jax"
    )
    assert (local > found).nnz == 0
    if name != "embedding":  # its indices are data (a Constant): unknown when tracing, so dense
        assert found.nnz < found.shape[0] ** 2


def test_global_patterns_are_exact_where_they_can_be() -> None:
    """Known zeros stay zeros: what makes a pattern worth having."""
    x = point(10)
    assert_same(
        sparse.jacobian_pattern(CORPUS["gather"], x),
        np.eye(5, 10, dtype=bool) | (np.eye(10, dtype=bool)[[3, 0, 0, 7, 5]]),
    )
    assert_same(sparse.jacobian_pattern(CORPUS["cumsum"], x), np.tril(np.ones((10, 10), dtype=bool))[::-1])
    assert_same(sparse.jacobian_pattern(CORPUS["matmul-constant"], x), np.triu(np.ones((10, 10), dtype=bool)))
    expected = np.eye(10, dtype=bool)
    expected[1, 0] = expected[1, 1] = expected[4, 2] = True
    assert_same(sparse.jacobian_pattern(CORPUS["scatter-add"], x), expected)
    assert_same(
        sparse.jacobian_pattern(CORPUS["relu-softplus"], x), np.eye(10, dtype=bool) | np.eye(10, dtype=bool)[::-1]
    )
    assert_same(
        sparse.jacobian_pattern(_odd_rule, x), np.eye(10, dtype=bool) | np.roll(np.eye(10, dtype=bool), 1, axis=0)
    )
    assert_same(
        sparse.jacobian_pattern(CORPUS["integer-ops"], x), np.eye(10, dtype=bool) | np.eye(10, dtype=bool)[[0] * 10]
    )
    eye = np.eye(10, dtype=bool)
    assert_same(sparse.jacobian_pattern(CORPUS["custom-vjp"], x), eye | eye[[0] * 10])
    assert_same(sparse.jacobian_pattern(CORPUS["convolve"], x), band(10, 1))
    pooled = sparse.jacobian_pattern(CORPUS["pooling"], x)
    assert_same(pooled[:6], dense_jacobian(CORPUS["pooling"], x)[:6] != 0)  # sums; a max reads its whole window
    for name in (
        "conv-groups-strides",
        "conv-dilations-both-inputs",
        "tile-repeat",
        "take-along-axis",
        "vmap-gather-scatter",
    ):
        assert_same(sparse.jacobian_pattern(CORPUS[name], x), dense_jacobian(CORPUS[name], x) != 0)
    rule = sparse.jacobian_pattern(CORPUS["custom-vjp-rule"], x)
    assert_same(rule, dense_jacobian(CORPUS["custom-vjp-rule"], x) != 0)
    assert rule.toarray()[1, 5 + 2]  # from the reverse rule's roll alone: out[1] = x[1] * y[1]


def test_short_loops_are_followed_iteration_by_iteration() -> None:
    """A fori_loop with static bounds is a scan: run step by step, its counter indexes exactly,
    also in the reverse scan of its gradient. A while loop with a known predicate likewise."""
    n = 12
    x = point(n)

    def pairs(x: Any) -> Any:
        return jax.lax.fori_loop(0, n - 1, lambda i, s: s + (x[i + 1] - x[i]) ** 2, 0.0)

    def steps(x: Any) -> Any:
        return jax.lax.scan(lambda c, xi: (c * 0.5 + xi, c * xi), 1.0, x, reverse=True)[1]

    assert_same(sparse.hessian_pattern(pairs, x), band(n, 1))

    def counted(x: Any) -> Any:  # a while loop whose predicate reads only a counter
        return jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.roll(s[1], 1) * s[1]), (0, x))[1]

    assert_same(sparse.jacobian_pattern(counted, x), dense_jacobian(counted, x) != 0)

    def alternating(x: Any) -> Any:  # a branch on the counter: known at each step
        return jax.lax.fori_loop(
            0, 4, lambda i, y: jax.lax.cond(i % 2 == 0, lambda z: z * 2.0, lambda z: jnp.roll(z, 1), y), x
        )

    assert_same(sparse.jacobian_pattern(alternating, x), np.roll(np.eye(n, dtype=bool), 2, axis=0))
    clamped = sparse.jacobian_pattern(lambda x: jax.lax.switch(5, [lambda z: z, lambda z: z[::-1]], x), x)
    assert_same(clamped, np.eye(n, dtype=bool)[::-1])  # jax clamps the index to the last branch
    assert_same(sparse.jacobian_pattern(steps, x), dense_jacobian(steps, x) != 0)
    assert_same(sparse.jacobian_pattern(steps, x), np.triu(np.ones((n, n), dtype=bool)))


# --- inputs, contexts, pytrees, array API ------------------------------------------------------------------


def test_pytrees_in_ravel_order() -> None:
    x = {"b": np.ones(2), "a": np.ones((2, 2))}

    def f(x: Any) -> Any:
        return {"sum": jnp.sum(x["a"], axis=1) * x["b"], "first": x["b"][:1] ** 2}

    flat_x, _ = di.tree.ravel(x)
    assert flat_x.shape == (6,)
    pattern = sparse.jacobian_pattern(f, x)
    local = sparse.jacobian_pattern(f, x, detector=sparse.LocalDetector(), backend="jax")
    assert_same(pattern, local.toarray())
    # leaves in ravel order: a (4 numbers) then b (2); outputs: first (1) then sum (2)
    expected = np.array(
        [[0, 0, 0, 0, 1, 0], [1, 1, 0, 0, 1, 0], [0, 0, 1, 1, 0, 1]],
        dtype=bool,
    )
    assert_same(pattern, expected)


def test_contexts_are_traced_abstract() -> None:
    """A pattern must hold for every value of a Constant: an index read from one is unknown."""
    x = point(6)
    scale = np.zeros(6)
    scaled = sparse.jacobian_pattern(lambda x, c: x * c, x, di.Constant(scale))
    assert_same(scaled, np.eye(6, dtype=bool))  # zeros in a Constant are not structural
    picked = sparse.jacobian_pattern(lambda x, idx: x[idx], x, di.Constant(np.array([0, 1])))
    assert_same(picked, np.ones((2, 6), dtype=bool))
    with pytest.raises(di.ContextError):
        sparse.jacobian_pattern(lambda x, c: x * c, x, scale)


def test_array_api_function_and_dtypes() -> None:
    array_api_compat = pytest.importorskip("array_api_compat")

    def f(x: Any) -> Any:
        xp = array_api_compat.array_namespace(x)
        return xp.concat([x[1:] * x[:-1], xp.sum(x, keepdims=True)])

    expected = np.eye(4, 5, dtype=bool) | np.eye(4, 5, 1, dtype=bool)
    expected = np.vstack([expected, np.ones((1, 5), dtype=bool)])
    assert_same(sparse.jacobian_pattern(f, point(5)), expected)
    assert_same(sparse.jacobian_pattern(f, point(5).astype(np.float32)), expected)
    for dtype in (jnp.bfloat16, jnp.float16):  # numpy does not count bfloat16 as floating
        assert_same(sparse.jacobian_pattern(f, jnp.asarray(point(5), dtype=dtype)), expected)
    assert_same(sparse.jacobian_pattern(lambda x: jnp.sin(x), 1.5), np.ones((1, 1), dtype=bool))


def test_local_detector_with_other_backends() -> None:
    def f(x: Any) -> Any:
        return (x[1:] - x[:-1]) ** 2

    expected = np.eye(5, 6, dtype=bool) | np.eye(5, 6, 1, dtype=bool)
    got = sparse.jacobian_pattern(f, point(6), detector=sparse.LocalDetector(), backend="jax")
    assert_same(got, expected)
    if di.available("torch"):
        import torch

        def g(x: Any) -> Any:
            return (x[1:] - x[:-1]) ** 2

        got = sparse.jacobian_pattern(g, torch.tensor(point(6)), detector=sparse.LocalDetector(), backend="torch")
        assert_same(got, expected)
        h = sparse.hessian_pattern(
            lambda x: ((x[1:] - x[:-1]) ** 2).sum(),
            torch.tensor(point(6)),
            detector=sparse.LocalDetector(),
            backend="torch",
        )
        assert_same(h, band(6, 1))


def test_local_detector_is_local() -> None:
    """Documented: a nonzero that vanishes at the points sampled is missed (a branch not taken)."""

    def f(x: Any) -> Any:
        return jnp.where(x > 100.0, x[::-1], x)

    local = sparse.jacobian_pattern(f, point(4), detector=sparse.LocalDetector(), backend="jax")
    assert_same(local, np.eye(4, dtype=bool))
    assert_same(sparse.jacobian_pattern(f, point(4)), np.eye(4, dtype=bool) | np.eye(4, dtype=bool)[::-1])


# --- errors -------------------------------------------------------------------------------------


def test_known_pattern_of_the_wrong_shape() -> None:
    x = point(4)
    with pytest.raises(di.InvalidInputError, match="5 columns"):
        sparse.jacobian_pattern(lambda x: x, x, detector=sparse.KnownPattern(np.eye(4, 5)))
    with pytest.raises(di.InvalidInputError, match="3 rows"):
        sparse.jacobian_pattern(lambda x: x, x, detector=sparse.KnownPattern(np.eye(3, 4)))
    with pytest.raises(di.InvalidInputError, match=r"\(4, 4\)"):
        sparse.hessian_pattern(lambda x: jnp.sum(x), x, detector=sparse.KnownPattern(np.eye(3)))
    with pytest.raises(di.InvalidInputError, match="2-d"):
        sparse.jacobian_pattern(lambda x: x, x, detector=sparse.KnownPattern(np.ones(4)))
    known = sparse.jacobian_pattern(lambda x: x, x, detector=sparse.KnownPattern(sp.coo_array(np.eye(4) * 3.0)))
    assert_same(known, np.eye(4, dtype=bool))


def test_untraceable_f_names_the_other_detectors() -> None:
    def branchy(x: Any) -> Any:
        return x * 2 if x[0] > 0 else x

    for f in (branchy, lambda x: np.sin(np.asarray(x))):
        with pytest.raises(di.UnsupportedOperationError, match="LocalDetector") as info:
            sparse.jacobian_pattern(f, point(3))
        assert "KnownPattern" in str(info.value)
    with pytest.raises(di.UnsupportedOperationError, match="LocalDetector"):
        sparse.hessian_pattern(lambda x: np.sum(np.asarray(x)), point(3))
    # and the local detector takes it
    local = sparse.jacobian_pattern(branchy, point(3), detector=sparse.LocalDetector(), backend=di.AutoJAX(jit=False))
    assert_same(local, np.eye(3, dtype=bool))


def test_other_errors() -> None:
    x = point(3)
    with pytest.raises(di.InvalidInputError, match="backend"):
        sparse.jacobian_pattern(lambda x: x, x, detector=sparse.LocalDetector())
    with pytest.raises(di.InvalidOutputError, match="scalar"):
        sparse.hessian_pattern(lambda x: x**2, x)
    with pytest.raises(di.InvalidInputError, match="detector"):
        sparse.jacobian_pattern(lambda x: x, x, detector="global")
    with pytest.raises(di.InvalidInputError, match="order"):
        sparse.color_jacobian(np.eye(3), order="random")
    with pytest.raises(di.InvalidInputError, match="mode"):
        sparse.color_jacobian(np.eye(3), mode="star")
    with pytest.raises(di.InvalidInputError, match="square"):
        sparse.color_hessian(np.ones((2, 3)))
    with pytest.raises(di.InvalidInputError, match="floating"):
        sparse.jacobian_pattern(lambda x: x, np.arange(3))


def test_detectors_are_frozen_and_hashable() -> None:
    assert hash(sparse.GlobalDetector()) == hash(sparse.GlobalDetector())
    assert sparse.LocalDetector(points=2) == sparse.LocalDetector(points=2)
    assert len({sparse.LocalDetector(), sparse.LocalDetector(seed=1), sparse.GlobalDetector()}) == 3
    known = sparse.KnownPattern(np.eye(2))
    assert hash(known) == hash(known)
    with pytest.raises(AttributeError):
        sparse.LocalDetector().points = 5  # type: ignore[misc]


def test_inputs_are_not_mutated() -> None:
    x = point(5)
    before = x.copy()
    known = np.eye(5)
    sparse.jacobian_pattern(lambda x: x**2, x, detector=sparse.LocalDetector(), backend="jax")
    sparse.jacobian_pattern(lambda x: x**2, x, detector=sparse.KnownPattern(known))
    sparse.jacobian_pattern(lambda x: x**2, x)
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(known, np.eye(5))


# --- colorings on random patterns ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_colorings_of_random_patterns(seed: int) -> None:
    rng = np.random.default_rng(seed)
    m, n = rng.integers(1, 30, 2)
    density = rng.uniform(0.02, 0.4)
    pattern = rng.uniform(size=(m, n)) < density
    J = np.where(pattern, rng.standard_normal((m, n)), 0.0)
    for order in sparse.ORDERS:
        check_column(sparse.color_jacobian(pattern, mode="column", order=order), J)
        check_row(sparse.color_jacobian(pattern, mode="row", order=order), J)
        auto = sparse.color_jacobian(pattern, order=order)
        column = sparse.color_jacobian(pattern, mode="column", order=order)
        row = sparse.color_jacobian(pattern, mode="row", order=order)
        if auto.mode == "bidirectional":  # where a split of the rows takes fewer products than either side
            assert auto.count < min(column.count, row.count) and auto.row_count and auto.column_count
        else:
            assert auto.count == min(column.count, row.count)
            assert auto.mode == ("row" if row.count < column.count else "column")
        square = rng.uniform(size=(n, n)) < density
        square = square | square.T
        check_star(sparse.color_hessian(square, order=order), symmetric_values(square))


def test_star_property_by_brute_force() -> None:
    """Every path on four vertices has three colors, checked path by path on small graphs."""
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        n = 9
        adjacency = np.triu(rng.uniform(size=(n, n)) < 0.35, 1)
        adjacency = adjacency | adjacency.T
        colors = sparse.color_hessian(adjacency | np.eye(n, dtype=bool)).colors
        for path in itertools.permutations(range(n), 4):
            if all(adjacency[a, b] for a, b in itertools.pairwise(path)):
                assert len({colors[v] for v in path}) >= 3, path


def test_empty_and_tiny_patterns() -> None:
    empty = sparse.color_jacobian(np.zeros((3, 4), dtype=bool))
    assert empty.count == 1
    np.testing.assert_array_equal(empty.index, np.zeros(0, dtype=np.int64))
    nothing = sparse.color_jacobian(np.zeros((0, 0), dtype=bool))
    assert nothing.count == 0 and nothing.seeds.shape == (0, 0)
    assert sparse.color_hessian(np.ones((1, 1), dtype=bool)).count == 1
    assert sparse.jacobian_pattern(lambda x: jnp.sum(x) * 0.0 + 1.0, point(3)).nnz == 3  # 0 * x is not structural


def test_decompress_gives_csr() -> None:
    J = np.diag([1.0, 2.0, 3.0]) + np.diag([4.0, 5.0], 1)
    coloring = sparse.color_jacobian(J != 0)
    np.testing.assert_array_equal(coloring.decompress(J @ coloring.seeds).toarray(), J)


def test_importing_sparse_imports_no_framework() -> None:
    code = textwrap.dedent(
        """
        import sys
        import diffiface as di
        import diffiface.sparse
        di.sparse.LocalDetector(), di.sparse.GlobalDetector()
        print(sorted(n for n in ("jax", "torch", "scipy", "autograd") if n in sys.modules))
        """
    )
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
