"""Which route a call takes: every shape users pass (a flat vector, a tuple of weights, a
nested params dict with a dict batch, flax and haiku params, an equinox module, a torch
module's named parameters) is answered by the quick match once prepared, on every backend
and operator, float32 and float64. The route is counted (the full path's argument handling
is not entered), not timed; the quick result equals the full path's."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import optree
import pytest
from conftest import FIRST_ORDER, namespace, native_tree, require, to_numpy

import diffiface as di
from diffiface import _dispatch

# -- the shapes: (x, context values) of numpy arrays, made native per backend -----------------


def _shapes(rng: np.random.Generator) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    def normal(*shape: int) -> np.ndarray:
        return rng.normal(size=shape) * 0.5

    return {
        "flat": (normal(6), (normal(6),)),
        "tuple": ((normal(3, 2), normal(2)), ((normal(4, 3), normal(4, 2)),)),
        "dict": (
            {"l1": {"w": normal(3, 2), "b": normal(2)}, "l2": {"w": normal(2, 2), "b": normal(2)}},
            ({"x": normal(4, 3), "y": normal(4, 2)},),
        ),
        "list-and-none": ([normal(3, 2), None, normal(2)], (normal(4, 3), [normal(4, 2)])),
    }


def _layers(x: Any) -> list[tuple[Any, Any]]:
    """(weight, bias) pairs of any of the shapes above."""
    if isinstance(x, dict):
        return [(x[k]["w"], x[k]["b"]) for k in sorted(x)]
    leaves = [leaf for leaf in x if leaf is not None]
    return [(leaves[0], leaves[1])]


def _inputs_targets(contexts: tuple[Any, ...]) -> tuple[Any, Any]:
    first = contexts[0]
    if isinstance(first, dict):
        return first["x"], first["y"]
    if isinstance(first, tuple):
        return first
    return first, contexts[1][0]


def head(x: Any, *contexts: Any) -> Any:
    """A small network: its outputs as a tree (for jvp, vjp, jacobian)."""
    if not isinstance(x, (dict, tuple, list)):  # the flat shape
        xp = namespace(x)
        return {"y": xp.sin(x) * contexts[0], "s": xp.sum(x * x)}
    inputs, _ = _inputs_targets(contexts)
    xp = namespace(inputs)
    out = inputs
    for w, b in _layers(x):
        out = xp.tanh(out @ w + b[None])
    return {"y": out, "s": xp.sum(out)}


def loss(x: Any, *contexts: Any) -> Any:
    if not isinstance(x, (dict, tuple, list)):
        xp = namespace(x)
        return xp.sum(xp.sin(x) * contexts[0] * x)
    inputs, targets = _inputs_targets(contexts)
    xp = namespace(inputs)
    out = inputs
    for w, b in _layers(x):
        out = xp.tanh(out @ w + b[None])
    r = out - targets
    return xp.sum(r * r)


# -- native arrays --------------------------------------------------------------------------------


@contextlib.contextmanager
def _precision(backend_id: str, dtype: str) -> Iterator[None]:
    if backend_id == "jax" and dtype == "float64":
        import jax

        with jax.enable_x64(True):
            yield
    else:
        yield


class _FullPathCounter:
    """Counts the calls that took the full path (built a signature from the arguments)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = _dispatch._arguments

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(_dispatch, "_arguments", counted)


_OPERATORS: list[tuple[str, Callable[..., Any], str | None]] = [
    ("gradient", loss, None),
    ("value_and_gradient", loss, None),
    ("hessian", loss, None),
    ("hvp", loss, "x"),
    ("jvp", head, "x"),
    ("vjp", head, "y"),
    ("jacobian", head, None),
    ("batched_jvp", head, "xs"),
    ("value_and_batched_vjp", head, "ys"),
    ("batched_hvp", loss, "xs"),
    ("gradient_and_batched_hvp", loss, "xs"),
]


def _unbatched(result: Any) -> Any:
    """A batched operator's Tangents (within its result) as a tuple, to compare leaf by leaf."""
    if isinstance(result, di.Tangents):
        return ("batch", *result)
    if isinstance(result, tuple):
        return tuple(_unbatched(part) for part in result)
    return result


_BACKENDS = ["jax", "mlx", "tensorflow-jit", "torch-autograd", "torch-func", "autograd", "finite_differences"]
_OPTIONS = {"tensorflow-jit": di.AutoTensorFlow(jit=True)}
"""Backends of the route tests with an option set (by test id), beside the registry's."""


def _backend(backend_id: str) -> di.Backend:
    return require(_OPTIONS.get(backend_id) or FIRST_ORDER[backend_id])


def _leaves_equal(a: Any, b: Any) -> None:
    a, b = _unbatched(a), _unbatched(b)
    a_leaves, a_spec = optree.tree_flatten(a)
    b_leaves, b_spec = optree.tree_flatten(b)
    assert a_spec == b_spec
    for u, v in zip(a_leaves, b_leaves, strict=True):
        assert type(u) is type(v)
        np.testing.assert_array_equal(to_numpy(u), to_numpy(v))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", ["flat", "tuple", "dict", "list-and-none"])
@pytest.mark.parametrize(("operator", "f", "tangent"), _OPERATORS, ids=[op[0] for op in _OPERATORS])
@pytest.mark.parametrize("backend_id", _BACKENDS)
def test_every_shape_takes_the_quick_route(
    backend_id: str,
    operator: str,
    f: Callable[..., Any],
    tangent: str | None,
    shape: str,
    dtype: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = _backend(backend_id)
    if backend_id in ("autograd", "finite_differences") and dtype == "float32" and operator == "hessian":
        dtype = "float64"  # (second differences in float32 are noise; the route is what is counted)
    x_np, contexts_np = _shapes(np.random.default_rng(0))[shape]
    with _precision(backend_id, dtype):
        x = native_tree(backend_id, x_np, dtype)
        contexts = tuple(di.Constant(native_tree(backend_id, c, dtype)) for c in contexts_np)
        args: tuple[Any, ...] = (x,)
        if tangent == "x":
            args = (x, native_tree(backend_id, optree.tree_map(np.ones_like, x_np), dtype))
        elif tangent == "y":
            y = head(x, *(c.value for c in contexts))
            args = (x, optree.tree_map(lambda leaf: leaf * 0 + 1, y))
        elif tangent == "xs":  # a batch of three tangents
            args = (
                x,
                di.Tangents(
                    *(
                        native_tree(backend_id, optree.tree_map(lambda a, k=k: np.full_like(a, k), x_np), dtype)
                        for k in range(3)
                    )
                ),
            )
        elif tangent == "ys":
            y = head(x, *(c.value for c in contexts))
            args = (x, di.Tangents(*(optree.tree_map(lambda leaf, k=k: leaf * 0 + k, y) for k in range(3))))
        operate = getattr(di, operator)
        prep = getattr(di, "prepare_" + operator)(f, backend, *args, *contexts)
        full = operate(f, backend, *args, *contexts, prep=prep)  # (may be the quick route too)
        counter = _FullPathCounter(monkeypatch)
        prepared = [operate(f, backend, *args, *contexts, prep=prep) for _ in range(2)]
        assert counter.count == 0, "a prepared call took the full path"
        unprepared = [operate(f, backend, *args, *contexts) for _ in range(2)]
        assert counter.count == 0, "an unprepared call took the full path"
        for result in (*prepared, *unprepared):
            _leaves_equal(result, full)


@pytest.mark.parametrize("backend_id", _BACKENDS)
def test_a_call_that_does_not_fit_leaves_the_quick_route(backend_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leaf of another dtype, another shape, or another structure misses the quick match and
    meets the strict check of the full path."""
    backend = _backend(backend_id)
    x_np, contexts_np = _shapes(np.random.default_rng(0))["dict"]
    x = native_tree(backend_id, x_np, "float32")
    batch = di.Constant(native_tree(backend_id, contexts_np[0], "float32"))
    prep = di.prepare_gradient(loss, backend, x, batch)
    counter = _FullPathCounter(monkeypatch)
    other_dtype = {
        **x,
        "l2": {**x["l2"], "b": native_tree(backend_id, x_np["l2"]["b"], "float16")},
    }  # (jax without x64 has no float64)
    other_shape = {**x, "l2": {"w": x["l2"]["w"], "b": native_tree(backend_id, np.zeros(3), "float32")}}
    other_structure = {**x, "l3": x["l2"]}
    for bad, part in ((other_dtype, "['l2']['b']"), (other_shape, "['l2']['b']"), (other_structure, "structure")):
        with pytest.raises(di.PreparationMismatchError, match=part.replace("[", r"\[").replace("]", r"\]")):
            di.gradient(loss, backend, bad, batch, prep=prep)
    assert counter.count == 3


@pytest.mark.parametrize("framework", ["flax", "haiku", "equinox"])
def test_jax_frameworks_take_the_quick_route(framework: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = require("jax")
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    inputs = jax.random.normal(key, (4, 3))
    targets = jax.random.normal(key, (4, 2))
    if framework == "flax":
        nn = pytest.importorskip("flax.linen", reason="flax is not installed: pip install flax")
        model = nn.Dense(2)
        x = model.init(key, inputs)["params"]

        def f(p: Any, batch: Any) -> Any:
            return jnp.sum((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    elif framework == "haiku":
        hk = pytest.importorskip("haiku", reason="dm-haiku is not installed: pip install dm-haiku")
        net = hk.without_apply_rng(hk.transform(lambda z: hk.Linear(2)(z)))
        x = net.init(key, inputs)

        def f(p: Any, batch: Any) -> Any:
            return jnp.sum((net.apply(p, batch["x"]) - batch["y"]) ** 2)

    else:
        eqx = pytest.importorskip("equinox", reason="equinox is not installed: pip install equinox")
        x = eqx.nn.Linear(3, 2, key=key)  # a module: arrays and static leaves (its activation-free call)

        def f(m: Any, batch: Any) -> Any:
            return jnp.sum((jax.vmap(m)(batch["x"]) - batch["y"]) ** 2)

    _assert_quick_gradient(f, backend, x, di.Constant({"x": inputs, "y": targets}), monkeypatch, jax_tree=True)


@pytest.mark.parametrize("mode", ["autograd", "func"])
def test_torch_module_parameters_take_the_quick_route(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = require(di.AutoTorch(mode=mode))
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    params = {name: p.detach() for name, p in module.named_parameters()}
    batch = di.Constant({"x": torch.randn(5, 3), "y": torch.randn(5, 2)})

    def f(p: Any, b: Any) -> Any:
        return torch.sum((torch.func.functional_call(module, p, (b["x"],)) - b["y"]) ** 2)

    _assert_quick_gradient(f, backend, params, batch, monkeypatch)


@pytest.mark.parametrize("mode", ["autograd", "func"])
def test_parameters_and_their_detached_tensors_each_take_the_quick_route(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An nn.Parameter and a plain tensor of its shape and dtype have one signature, and a
    plan tests the leaves' types: the preps of the two shared one plan, and the one prepared
    second took the full path on every call (1.5 times the native call at MLP size). Each gets
    a prep of its own, prepared or not, both ways round."""
    backend = require(di.AutoTorch(mode=mode))
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    batch = di.Constant({"x": torch.randn(5, 3), "y": torch.randn(5, 2)})

    def f(p: Any, b: Any) -> Any:
        return torch.sum((torch.func.functional_call(module, p, (b["x"],)) - b["y"]) ** 2)

    parameters = dict(module.named_parameters())
    detached = {name: p.detach() for name, p in parameters.items()}
    for first, second in ((parameters, detached), (detached, parameters)):
        _assert_quick_gradient(f, backend, first, batch, monkeypatch)
        _assert_quick_gradient(f, backend, second, batch, monkeypatch)
        monkeypatch.undo()
        di.gradient(f, backend, first, batch)  # (the unprepared call of the other types, then...)
        counter = _FullPathCounter(monkeypatch)
        di.gradient(f, backend, first, batch)  # (... its own prep again, found by the quick match)
        assert counter.count == 0
        monkeypatch.undo()


def _assert_quick_gradient(
    f: Callable[..., Any],
    backend: di.Backend,
    x: Any,
    batch: Any,
    monkeypatch: pytest.MonkeyPatch,
    jax_tree: bool = False,
) -> None:
    """Prepared and unprepared gradients after the first take the quick route, with the full
    path's result (``jax_tree``: x is a pytree only jax knows, compared through jax)."""
    prep = di.prepare_gradient(f, backend, x, batch)
    full = di.gradient(f, backend, x, batch, prep=prep)
    counter = _FullPathCounter(monkeypatch)
    results = [di.gradient(f, backend, x, batch, prep=prep), di.gradient(f, backend, x, batch)]
    assert counter.count == 0
    for result in results:
        if jax_tree:
            import jax

            assert jax.tree_util.tree_structure(result) == jax.tree_util.tree_structure(full)
            _leaves_equal(jax.tree_util.tree_leaves(result), jax.tree_util.tree_leaves(full))
        else:
            _leaves_equal(result, full)


# -- a backend by name, numpy contexts under jax, AutoSparse and SecondOrder ----------------------


def mlp_loss(params: Any, batch: Any) -> Any:
    import jax.numpy as jnp

    hidden = jnp.tanh(batch["x"] @ params["l1"]["w"] + params["l1"]["b"][None])
    return jnp.mean((hidden @ params["l2"]["w"] - batch["y"]) ** 2)


def _mlp(rng: np.random.Generator) -> tuple[Any, Any]:
    import jax.numpy as jnp

    params = {
        "l1": {"w": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32), "b": jnp.zeros(8, jnp.float32)},
        "l2": {"w": jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)},
    }
    batch = {"x": rng.normal(size=(5, 4)).astype(np.float32), "y": rng.normal(size=(5, 2)).astype(np.float32)}
    return params, batch


@pytest.mark.parametrize("name", ["jax", "AutoJAX()"])
@pytest.mark.parametrize("batch_kind", ["numpy", "jax"])
def test_a_backend_by_name_and_numpy_contexts_take_the_plan(
    name: str, batch_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's style, ``di.gradient(loss, "jax", params, di.Constant(batch), prep=prep)``,
    with the batch as numpy arrays or jax arrays: never the full signature once prepared."""
    require(di.AutoJAX())
    import jax.numpy as jnp

    params, batch = _mlp(np.random.default_rng(0))
    if batch_kind == "jax":
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
    backend: Any = "jax" if name == "jax" else di.AutoJAX()
    prep = di.prepare_gradient(mlp_loss, backend, params, di.Constant(batch))
    expected = di.gradient(mlp_loss, di.AutoJAX(), params, di.Constant(batch), prep=prep)
    counter = _FullPathCounter(monkeypatch)
    for other in ("jax", di.AutoJAX()):  # either spelling fits a prep made with the other
        got = di.gradient(mlp_loss, other, params, di.Constant(batch), prep=prep)
        for a, b in zip(di.tree.leaves(got), di.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    di.gradient(mlp_loss, backend, params, di.Constant(batch))  # unprepared: the cached prep
    assert counter.count == 0


def test_numpy_contexts_reach_the_compiled_program_unconverted() -> None:
    """Under jit a numpy Constant is an argument of the compiled program as it is: no jax copy
    per call (f sees it traced, so it cannot write into it)."""
    require(di.AutoJAX())
    params, batch = _mlp(np.random.default_rng(1))
    prep = di.prepare_gradient(mlp_loss, "jax", params, di.Constant(batch))
    program = prep.plan.program  # (jax's tier: the compiled function takes the numpy leaves as they are)
    assert type(program).__name__ == "JitProgram" and len(program.numpy_leaves) == len(batch)


def test_int64_numpy_labels_beside_float32_jax_params_without_x64() -> None:
    """numpy's default integers (int64, the labels of a classifier) reach jit as int32 where x64
    is off: the compiled program takes them, as jit does, where it refused every call before
    ("the arguments' shapes or dtypes are not the prep's", a flax nnx State or any jax x)."""
    require(di.AutoJAX())
    import jax
    import jax.numpy as jnp

    if jax.config.read("jax_enable_x64"):
        pytest.skip("x64 is on: jit keeps int64")
    w = jnp.asarray([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], dtype=jnp.float32)
    inputs, labels = np.array([[1.0, 2.0], [-1.0, 0.5]], dtype=np.float32), np.array([2, 0])

    def loss(w: Any, batch: Any) -> Any:
        return -jnp.mean(jax.nn.log_softmax(batch[0] @ w)[jnp.arange(2), batch[1]])

    expected = jax.grad(loss)(w, (inputs, labels))
    for unsigned in (False, True):
        batch = (inputs, labels.astype(np.uint64) if unsigned else labels)
        grad = di.gradient(loss, "jax", w, di.Constant(batch))
        assert grad.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-6)
        prep = di.prepare_gradient(loss, "jax", w, di.Constant(batch))
        again = di.gradient(loss, "jax", w, di.Constant(batch), prep=prep)
        np.testing.assert_allclose(np.asarray(again), np.asarray(expected), rtol=1e-6)


@pytest.mark.parametrize("backend_id", ["finite_differences", "jax", "torch"])
def test_autosparse_and_second_order_take_the_plan(backend_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engines = {"finite_differences": di.AutoFiniteDifferences(), "jax": di.AutoJAX(), "torch": di.AutoTorch()}
    engine = require(engines[backend_id])
    x = np.linspace(0.5, 1.5, 6)

    def residual(v: Any, scale: Any) -> Any:
        return v[1:] ** 2 - scale * v[:-1]

    def energy(v: Any) -> Any:
        return ((v[1:] - v[:-1]) ** 2).sum() + (v**4).sum()

    sparse = di.AutoSparse(engine)
    jacobian_prep = di.prepare_jacobian(residual, sparse, x, di.Constant(2.0))
    second = di.SecondOrder(engine, engine)
    hessian_prep = di.prepare_hessian(energy, second, x)
    first_j = di.jacobian(residual, sparse, x, di.Constant(2.0), prep=jacobian_prep)
    first_h = di.hessian(energy, second, x, prep=hessian_prep)
    counter = _FullPathCounter(monkeypatch)
    np.testing.assert_array_equal(
        di.jacobian(residual, sparse, x, di.Constant(2.0), prep=jacobian_prep).toarray(), first_j.toarray()
    )
    np.testing.assert_array_equal(di.hessian(energy, second, x, prep=hessian_prep), first_h)
    assert counter.count == 0
    expected = np.zeros((5, 6))
    expected[np.arange(5), np.arange(1, 6)] = 2 * x[1:]
    expected[np.arange(5), np.arange(5)] = -2.0
    np.testing.assert_allclose(first_j.toarray(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend_id", ["jax", "mlx", "tensorflow-jit"])
def test_a_call_that_misses_the_jit_tier_traces_once(backend_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call whose shapes are not the recent prep's misses its compiled program in the trace;
    the engine keeps that trace, so batches that alternate between two sizes trace each program
    once, and the gradients stay right."""
    from diffiface._programs import JitProgram

    traces = []
    traced = JitProgram._traced

    def counted(self: Any, *leaves: Any) -> Any:
        traces.append(tuple(tuple(leaf.shape) for leaf in leaves))
        return traced(self, *leaves)

    monkeypatch.setattr(JitProgram, "_traced", counted)
    backend = _backend(backend_id)
    eager = dataclasses.replace(backend, **{"compile" if backend_id == "mlx" else "jit": False})
    rng = np.random.default_rng(3)
    params_np, _ = _shapes(rng)["dict"]
    params = native_tree(backend_id, params_np, "float32")
    batches = [
        di.Constant(native_tree(backend_id, (rng.normal(size=(n, 3)), rng.normal(size=(n, 2))), "float32"))
        for n in (5, 7)
    ]
    for batch in batches * 2:  # (each program traced for its own shapes, and for the other's)
        di.gradient(loss, backend, params, batch)
    warm = len(traces)
    for batch in batches * 3:
        got = di.gradient(loss, backend, params, batch)
        expected = di.gradient(loss, eager, params, batch)
        for leaf, same in zip(*map(di.tree.leaves, (got, expected)), strict=True):
            np.testing.assert_allclose(to_numpy(leaf), to_numpy(same), rtol=1e-5)
    assert len(traces) == warm


@pytest.mark.parametrize("backend_id", ["mlx", "tensorflow-jit"])
def test_retracing_engines_take_the_jit_tier(backend_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """mx.compile and tf.function trace anew for each shape and dtype, so a compiled prep of
    the engine's own arrays is one compiled function of the leaves, which checks them in its
    trace (as jax's jit): the call's shapes and dtypes are not tested before it. A call of
    another shape or dtype misses it in the trace and meets the strict check; a numpy batch
    (converted per call) takes the plan."""
    backend = _backend(backend_id)
    params_np, batch_np = _shapes(np.random.default_rng(2))["dict"]
    params = native_tree(backend_id, params_np, "float32")
    batch = di.Constant(native_tree(backend_id, batch_np[0], "float32"))
    prep = di.prepare_gradient(loss, backend, params, batch)
    assert type(prep.plan.program).__name__ == "JitProgram"
    eager = dataclasses.replace(backend, **{"compile" if backend_id == "mlx" else "jit": False})
    expected = di.gradient(loss, eager, params, batch)
    counter = _FullPathCounter(monkeypatch)
    got = di.gradient(loss, backend, params, batch, prep=prep)
    assert counter.count == 0
    assert di.tree.structure(got) == di.tree.structure(expected)
    for leaf, same, reference in zip(*map(di.tree.leaves, (got, expected, params)), strict=True):
        assert type(leaf) is type(reference) and leaf.dtype == reference.dtype
        # (a graph's arithmetic may round otherwise than eager mode's)
        np.testing.assert_allclose(to_numpy(leaf), to_numpy(same), rtol=1e-5)
    wider = {**params, "l2": {**params["l2"], "b": native_tree(backend_id, params_np["l2"]["b"], "float64")}}
    longer = {**params, "l2": {**params["l2"], "b": native_tree(backend_id, np.zeros(3), "float32")}}
    for bad in (wider, longer):
        with pytest.raises(di.PreparationMismatchError, match=r"\['l2'\]\['b'\]"):
            di.gradient(loss, backend, bad, batch, prep=prep)
    numpy_batch = di.Constant(optree.tree_map(lambda a: a.astype(np.float32), batch_np[0]))
    numpy_prep = di.prepare_gradient(loss, backend, params, numpy_batch)
    assert type(numpy_prep.plan.program).__name__ != "JitProgram"


@pytest.mark.parametrize("tree", ["namedtuple", "OrderedDict", "equinox", "300 leaves"])
def test_trees_no_function_is_written_for_take_the_jit_tier(tree: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """jax's tier flattens each argument by the plan's flattening where no function is written
    for their structure (a namedtuple, an OrderedDict, a registered class, a tree over 256
    leaves): a prepared call of such an x runs there, not through the plan's match, and gives
    the gradient jax gives."""
    import collections

    backend = require("jax")
    import jax
    import jax.numpy as jnp

    from diffiface import _plan

    pair = collections.namedtuple("pair", "w b")
    rng = np.random.default_rng(4)
    w, b = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), jnp.asarray(rng.normal(size=2), jnp.float32)
    if tree == "namedtuple":
        x: Any = pair(w, b)
    elif tree == "OrderedDict":
        x = collections.OrderedDict(w=w, b=b)
    elif tree == "equinox":
        eqx = pytest.importorskip("equinox", reason="equinox is not installed: pip install equinox")
        x = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))
    else:
        x = [jnp.full((2,), float(i), jnp.float32) for i in range(300)]

    def loss(x: Any, inputs: Any) -> Any:
        return sum(jnp.sum(jnp.tanh(leaf * jnp.mean(inputs)) ** 2) for leaf in jax.tree.leaves(x))

    inputs = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    prep = di.prepare_gradient(loss, backend, x, di.Constant(inputs))
    assert prep.plan.jit is not None
    matched = []
    leaves = _plan.Plan.leaves
    monkeypatch.setattr(_plan.Plan, "leaves", lambda self, *args: matched.append(1) or leaves(self, *args))
    for _ in range(2):
        got = di.gradient(loss, backend, x, di.Constant(inputs), prep=prep)
    assert matched == []
    expected = jax.grad(loss)(x, inputs)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for leaf, same in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(same), rtol=1e-6)


@pytest.mark.parametrize("tree", ["equinox MLP", "list with None"])
def test_trees_with_static_leaves_or_none_are_rebuilt_not_finished_again(
    tree: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree whose results hold None (an equinox module's activations, static leaves, or a None
    in x) is, once its first result was seen to come out of the engine unchanged, only rebuilt:
    later calls do not run the finisher's conversion leaf by leaf. An equinox module, whose
    classes jax's pytrees know, is flattened by jax's pytrees, not one node at a time through
    diffiface's namespace. The results equal the engine's own."""
    from diffiface import _results
    from diffiface._families import jax as jax_family

    if tree == "equinox MLP":
        backend = require("jax")
        eqx = pytest.importorskip("equinox", reason="equinox is not installed: pip install equinox")
        import jax
        import jax.numpy as jnp

        x: Any = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.PRNGKey(0))
        batch = (jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), jnp.ones((4, 2)))

        def loss(m: Any, batch: Any) -> Any:
            return jnp.sum((jax.vmap(m)(batch[0]) - batch[1]) ** 2)

        params, static = eqx.partition(x, eqx.is_array)
        expected = jax.grad(lambda p: loss(eqx.combine(p, static), batch))(params)
    else:
        backend = require("torch-autograd")
        import torch

        x = [torch.linspace(-1.0, 1.0, 6).reshape(3, 2), None, torch.ones(2)]
        batch = (torch.linspace(0.0, 1.0, 12).reshape(4, 3), torch.zeros(4, 2))

        def loss(p: Any, batch: Any) -> Any:
            return ((batch[0] @ p[0] + p[2] - batch[1]) ** 2).sum()

        leaves = [leaf.clone().requires_grad_(True) for leaf in (x[0], x[2])]
        grads = torch.autograd.grad(loss([leaves[0], None, leaves[1]], batch), leaves)
        expected = [grads[0], None, grads[1]]
    prep = di.prepare_gradient(loss, backend, x, di.Constant(batch))
    di.gradient(loss, backend, x, di.Constant(batch), prep=prep)  # (the first result, seen once)
    converted, one_level = [], []
    convert, children = _results.Finisher.convert, jax_family._children
    monkeypatch.setattr(_results.Finisher, "convert", lambda self, *a: converted.append(1) or convert(self, *a))
    monkeypatch.setattr(jax_family, "_children", lambda node: one_level.append(1) or children(node))
    got = di.gradient(loss, backend, x, di.Constant(batch), prep=prep)
    assert converted == []
    assert one_level == []
    got_leaves, got_spec = optree.tree_flatten(got, namespace="diffiface")
    expected_leaves, expected_spec = optree.tree_flatten(expected, namespace="diffiface")
    assert got_spec == expected_spec
    for leaf, same in zip(got_leaves, expected_leaves, strict=True):
        assert type(leaf) is type(same)
        np.testing.assert_allclose(to_numpy(leaf), to_numpy(same), rtol=1e-6)


def test_a_dict_inside_a_module_keeps_its_order_in_jax_tier() -> None:
    """jax's tier rebuilds x's tree inside the trace only where jax's pytrees rebuild it as x
    is: an equinox module holding a dict whose keys are not in sorted order gets its gradient's
    dict in x's order (jax's own rebuild sorts them)."""
    backend = require("jax")
    eqx = pytest.importorskip("equinox", reason="equinox is not installed: pip install equinox")
    import jax.numpy as jnp

    class Holder(eqx.Module):
        weights: dict[str, Any]

    x = Holder({"b": jnp.ones(2), "a": jnp.full(3, 2.0)})

    def loss(m: Any, scale: Any) -> Any:
        return jnp.sum(m.weights["a"] ** 2) * scale + jnp.sum(m.weights["b"] ** 3)

    prep = di.prepare_gradient(loss, backend, x, di.Constant(jnp.float32(2.0)))
    for _ in range(2):
        got = di.gradient(loss, backend, x, di.Constant(jnp.float32(2.0)), prep=prep)
        assert list(got.weights) == ["b", "a"]
        np.testing.assert_allclose(np.asarray(got.weights["a"]), np.full(3, 8.0))
        np.testing.assert_allclose(np.asarray(got.weights["b"]), np.full(2, 3.0))
