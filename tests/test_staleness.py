"""Never stale, never silently wrong at the seams (issue 38, items 1, 2, 3, 14 and 19; issue
39's traps): each test reproduces one report and is named after what it guards."""

from __future__ import annotations

import functools
import gc
import linecache
import traceback
import weakref
from typing import Any

import numpy as np
import pytest
from conftest import require

import diffiface as di
from diffiface import _prep

SPARSE_ENGINES = ["finite_differences", "jax", "torch", "autograd"]


def _x(engine: str) -> Any:
    x = np.arange(1.0, 5.0)
    if engine == "jax":
        import jax.numpy as jnp

        return jnp.asarray(x, dtype=jnp.float32)
    if engine == "torch":
        import torch

        return torch.tensor(x)
    return x


def _dense(result: Any) -> np.ndarray:
    for name in ("toarray", "todense", "to_dense"):
        if hasattr(result, name):
            return np.asarray(getattr(result, name)())
    return np.asarray(result)


def _is_sparse(result: Any) -> bool:
    layout = getattr(result, "layout", None)
    if layout is not None:
        return str(layout) != "torch.strided"
    return type(result).__name__ in ("csr_array", "csc_array", "coo_array", "BCOO", "BCSR")


def _chain(v: Any) -> Any:
    return v[1:] * v[:-1]


def _chain_sum(v: Any) -> Any:
    return (v[1:] * v[:-1]).sum()


# -- item 1: an AutoSparse call never reuses a dense plan, nor a dense prep ------------------------


@pytest.mark.parametrize("dense_first", [True, False], ids=["dense-first", "sparse-first"])
@pytest.mark.parametrize("operator", ["jacobian", "hessian"])
@pytest.mark.parametrize("engine", SPARSE_ENGINES)
def test_a_sparse_call_after_a_dense_one_is_sparse(engine: str, operator: str, dense_first: bool) -> None:
    require(engine if engine != "torch" else "torch-autograd")
    f = _chain if operator == "jacobian" else _chain_sum
    call = getattr(di, operator)
    x = _x(engine)
    order = [engine, di.AutoSparse(engine)] if dense_first else [di.AutoSparse(engine), engine]
    results = [call(f, backend, x) for backend in order * 2]
    for backend, result in zip(order * 2, results, strict=True):
        assert _is_sparse(result) is isinstance(backend, di.AutoSparse), (backend, type(result))
    np.testing.assert_allclose(_dense(results[0]), _dense(results[1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("operator", ["jacobian", "hessian"])
@pytest.mark.parametrize("engine", SPARSE_ENGINES)
def test_a_dense_prep_is_refused_by_autosparse_naming_the_backend(engine: str, operator: str) -> None:
    require(engine if engine != "torch" else "torch-autograd")
    f = _chain if operator == "jacobian" else _chain_sum
    x = _x(engine)
    prep = getattr(di, f"prepare_{operator}")(f, engine, x)
    with pytest.raises(di.PreparationMismatchError, match=r"backend: prepared for Auto.*called with AutoSparse"):
        getattr(di, operator)(f, di.AutoSparse(engine), x, prep=prep)
    sparse = getattr(di, f"prepare_{operator}")(f, di.AutoSparse(engine), x)
    with pytest.raises(di.PreparationMismatchError, match="backend: prepared for AutoSparse"):
        getattr(di, operator)(f, engine, x, prep=sparse)


# -- item 2: an unprepared call never reuses a stale program ---------------------------------------

SCALE = 1.0


def _scaled_loss(v: Any, k: Any) -> Any:
    import jax.numpy as jnp

    return jnp.sum(SCALE * k * v**2)


@pytest.fixture
def scale() -> Any:
    global SCALE
    SCALE = 1.0
    yield
    SCALE = 1.0


def _set_scale(value: float) -> None:
    global SCALE
    SCALE = value


def test_an_unprepared_partial_sees_a_global_its_function_reads(scale: Any) -> None:
    require("jax")
    p = functools.partial(_scaled_loss, k=1.0)
    x = np.ones(3)
    np.testing.assert_allclose(di.gradient(p, "jax", x), 2 * x)
    _set_scale(3.0)
    np.testing.assert_allclose(di.gradient(p, "jax", x), 6 * x)


def test_an_unprepared_partial_sees_its_arguments_written_in_place() -> None:
    require("jax")
    k = np.ones(3)
    p = functools.partial(_scaled_loss, k=k)
    np.testing.assert_allclose(di.gradient(p, "jax", np.ones(3)), 2 * np.ones(3))
    k[0] = 4.0
    np.testing.assert_allclose(di.gradient(p, "jax", np.ones(3)), [8.0, 2.0, 2.0])


def test_an_unprepared_call_sees_keyword_only_defaults_changed() -> None:
    require("jax")
    import jax.numpy as jnp

    def loss(v: Any, *, k: float = 1.0) -> Any:
        return jnp.sum(k * v**2)

    x = np.ones(3)
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 2 * x)
    loss.__kwdefaults__["k"] = 3.0  # type: ignore[index]
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 6 * x)


def test_an_unprepared_callable_object_sees_a_global_its_call_reads(scale: Any) -> None:
    require("jax")
    import jax.numpy as jnp

    class Loss:
        def __call__(self, v: Any) -> Any:
            return jnp.sum(SCALE * v**2)

    loss, x = Loss(), np.ones(3)
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 2 * x)
    _set_scale(3.0)
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 6 * x)


def test_an_unprepared_callable_object_sees_its_attributes_rebound() -> None:
    require("jax")
    import jax.numpy as jnp

    class Loss:
        def __init__(self) -> None:
            self.weight = 1.0

        def __call__(self, v: Any) -> Any:
            return jnp.sum(self.weight * v**2)

    loss, x = Loss(), np.ones(3)
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 2 * x)
    loss.weight = 3.0
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 6 * x)


def test_a_callable_whose_methods_call_each_other_past_the_most_followed_is_served() -> None:
    """A callable object whose methods call one another, more of them than the callables
    followed, two of the later ones in a cycle (a bound flax linen module is one): what f
    reads was read without end (RecursionError); it stops where the following does."""
    require("jax")
    import jax.numpy as jnp

    namespace: dict[str, Any] = {}
    lines = ["class Chain:", "    weight = 1.0", "    def __call__(self, v):", "        return self.m0(v)"]
    for i in range(_prep._MOST_FOLLOWED + 3):
        lines += [f"    def m{i}(self, v):", f"        return self.m{i + 1}(v)"]
    lines += [
        f"    def m{_prep._MOST_FOLLOWED + 3}(self, v):",
        "        return self.even(v, 2)",
        "    def even(self, v, n):",
        "        return jnp.sum(self.weight * v**2) if n == 0 else self.odd(v, n - 1)",
        "    def odd(self, v, n):",
        "        return self.even(v, n - 1)",
    ]
    exec("\n".join(lines), {"jnp": jnp}, namespace)  # (a class of many methods)
    chain, x = namespace["Chain"](), np.ones(3)
    np.testing.assert_allclose(di.gradient(chain, "jax", x), 2 * x)
    chain.weight = 3.0  # (its own attribute, one level: still seen)
    np.testing.assert_allclose(di.gradient(chain, "jax", x), 6 * x)


def test_an_unprepared_method_sees_what_it_reads_through_its_class(scale: Any) -> None:
    """A method calling another of self's methods that reads a global, a class constant read
    through self, a slotted attribute rebound: each was missed, the old program reused."""
    require("jax")
    import jax.numpy as jnp

    class Model:
        factor = 1.0

        def forward(self, v: Any) -> Any:
            return SCALE * v

        def loss(self, v: Any) -> Any:
            return jnp.sum(self.factor * self.forward(v) ** 2)

    class Slotted:
        __slots__ = ("weight",)

        def __init__(self) -> None:
            self.weight = 1.0

        def __call__(self, v: Any) -> Any:
            return jnp.sum(self.weight * v**2)

    model, slotted, x = Model(), Slotted(), np.ones(3)
    np.testing.assert_allclose(di.gradient(model.loss, "jax", x), 2 * x)
    np.testing.assert_allclose(di.gradient(slotted, "jax", x), 2 * x)
    _set_scale(3.0)
    np.testing.assert_allclose(di.gradient(model.loss, "jax", x), 18 * x)
    Model.factor = 2.0
    np.testing.assert_allclose(di.gradient(model.loss, "jax", x), 36 * x)
    slotted.weight = 3.0
    np.testing.assert_allclose(di.gradient(slotted, "jax", x), 6 * x)


def test_a_frozen_dataclass_constant_holding_a_mutable_object_is_refused_under_jit() -> None:
    """A frozen dataclass is compared by its fields: one that holds an object compared by
    identity could change unseen, and is refused as that object alone is; 1 and 1.0 in a field
    are two programs."""
    require("jax")
    import dataclasses

    import jax.numpy as jnp

    class Schedule:
        def __init__(self, s: float) -> None:
            self.s = s

    @dataclasses.dataclass(frozen=True)
    class Config:
        value: Any

    def loss(v: Any, config: Any) -> Any:
        if isinstance(config.value, float):
            return jnp.sum(config.value * v**2)
        return jnp.sum(v**2)

    x = np.ones(3)
    with pytest.raises(di.ContextError, match="frozen dataclass of values"):
        di.gradient(loss, "jax", x, di.Constant(Config(Schedule(2.0))))
    np.testing.assert_allclose(di.gradient(loss, "jax", x, di.Constant(Config(3))), 2 * x)
    np.testing.assert_allclose(di.gradient(loss, "jax", x, di.Constant(Config(3.0))), 6 * x)


def test_an_unprepared_wrapped_function_sees_a_global_the_wrapped_one_reads(scale: Any) -> None:
    require("jax")
    import jax.numpy as jnp

    def decorate(function: Any) -> Any:
        @functools.wraps(function)
        def wrapper(v: Any) -> Any:
            return function(v)

        return wrapper

    @decorate
    def loss(v: Any) -> Any:
        return jnp.sum(SCALE * v**2)

    x = np.ones(3)
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 2 * x)
    _set_scale(3.0)
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 6 * x)


def _helper(v: Any) -> Any:
    return SCALE * v**2


def test_an_unprepared_call_sees_a_global_a_helper_of_its_module_reads(scale: Any) -> None:
    require("jax")
    import jax.numpy as jnp

    def loss(v: Any) -> Any:
        return jnp.sum(_helper(v))

    x = np.ones(3)
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 2 * x)
    _set_scale(3.0)
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 6 * x)


_TABLE = np.ones(3)


def _inner(v: Any) -> Any:
    return _TABLE * v


def _outer(v: Any) -> Any:
    return _inner(v) ** 2


def test_a_function_with_helpers_has_a_written_test_that_sees_each_helper(scale: Any) -> None:
    # expected: f that calls helpers of its module (one calling another) gets a test written for
    # each function, not the general walk; it sees a helper's global array written in place, a
    # helper rebound, and a global of the innermost helper, as the general test does
    require("jax")
    import jax.numpy as jnp

    global _inner

    def loss(v: Any) -> Any:
        return jnp.sum(SCALE * _outer(v))

    closure = _prep.Closure(loss)
    assert closure.holds != closure._holds
    assert closure.holds(loss) and closure._holds(loss)
    x = np.ones(3)
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 2 * x)
    _TABLE[:] = 2.0
    try:
        assert not closure.holds(loss) and not closure._holds(loss)
        np.testing.assert_allclose(di.gradient(loss, "jax", x), 8 * x)
        original = _inner
        _inner = lambda v: 3 * v  # noqa: E731  (a helper rebound)
        try:
            np.testing.assert_allclose(di.gradient(loss, "jax", x), 18 * x)
        finally:
            _inner = original
        np.testing.assert_allclose(di.gradient(loss, "jax", x), 8 * x)
        _set_scale(3.0)
        np.testing.assert_allclose(di.gradient(loss, "jax", x), 24 * x)
    finally:
        _TABLE[:] = 1.0


def test_an_unprepared_call_sees_a_large_numpy_array_written_in_place() -> None:
    """More than 65,536 entries (once compared by identity alone)."""
    require("jax")
    import jax.numpy as jnp

    big = np.ones(70_000)

    def loss(v: Any) -> Any:
        return jnp.sum(big[:3] * v**2)

    x = np.ones(3)
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 2 * x)
    big[:3] = 5.0
    np.testing.assert_allclose(di.gradient(loss, "jax", x), 10 * x)


_WEIGHTS = np.ones(2)


@pytest.mark.parametrize("operator", ["gradient", "hessian", "jacobian", "prepared"])
@pytest.mark.parametrize("backend", ["jax", "second-order jax", "sparse jax"])
def test_a_jax_trace_never_keeps_a_numpy_global_s_old_values(operator: str, backend: str) -> None:
    """A float32 jax x and a float64 numpy global written in place: jax's staging caches gave
    the new trace the old values (the gradient of ``W = [1, 1]`` after ``W[1] = 5``), though
    the route saw the write and prepared again."""
    require("jax")
    import jax
    import jax.numpy as jnp

    engine: Any = {
        "jax": "jax",
        "second-order jax": di.SecondOrder(di.AutoJAX(), di.AutoJAX()),
        "sparse jax": di.AutoSparse(di.AutoJAX()),
    }[backend]
    if backend == "sparse jax" and operator in ("gradient", "prepared"):
        pytest.skip("AutoSparse computes Jacobians and Hessians; its gradient is its engine's, the first row")
    _WEIGHTS[:] = 1.0

    def loss(v: Any) -> Any:
        return (_WEIGHTS * v**2).sum()

    def values(v: Any) -> Any:
        return _WEIGHTS * v**2

    x = jnp.ones(2, dtype=jnp.float32)

    def run() -> np.ndarray:
        if operator == "prepared":  # (a fresh prep, while the first one is kept alive)
            return np.asarray(di.gradient(loss, engine, x, prep=di.prepare_gradient(loss, engine, x)))
        f = values if operator == "jacobian" else loss
        return _dense(getattr(di, operator)(f, engine, x))

    # (the sparsity detection traces f with float64 enabled: a float64 global and a float32 x
    # promote as numpy promotes them, not under the tests' strict rule)
    with jax.numpy_dtype_promotion("standard"):
        kept = di.prepare_gradient(loss, engine, x) if operator == "prepared" else None
        first = run()
        _WEIGHTS[1] = 5.0
        try:
            expected = {"gradient": [2.0, 10.0], "prepared": [2.0, 10.0]}.get(operator, np.diag([2.0, 10.0]))
            np.testing.assert_allclose(run(), expected)
            np.testing.assert_allclose(first, np.asarray(expected) / [1.0, 5.0])
        finally:
            _WEIGHTS[:] = 1.0
            del kept


def test_a_new_lambda_on_a_buffer_written_in_place_sees_its_new_values() -> None:
    """A training loop's pattern: a numpy batch buffer refilled in place, and a new lambda per
    step closing over it. No prep of the lambda is stale (each is new), but jax's caches kept
    the values an earlier step's trace read."""
    require("jax")
    import jax.numpy as jnp

    batch = np.ones(2)
    x = jnp.ones(2, dtype=jnp.float32)
    for scale in (1.0, 5.0, 2.0):
        batch[1] = scale
        grad = di.gradient(lambda v: (batch * v**2).sum(), "jax", x)
        np.testing.assert_allclose(np.asarray(grad), [2.0, 2.0 * scale])


class _Holder:
    """An object f reads its data through (``holder.weights``, ``holder.inner.weights``)."""

    def __init__(self, weights: np.ndarray) -> None:
        self.weights = weights
        self.calls = 0


class _SlottedHolder:
    """An object that keeps its data in slots (a ``dataclass(slots=True)``), not a ``__dict__``."""

    __slots__ = ("inner", "weights")

    def __init__(self, weights: np.ndarray) -> None:
        self.weights = weights


_STATE: dict[str, Any] = {}
_HOLDER = _Holder(np.ones(2))


def _state_loss(v: Any) -> Any:
    return (_STATE["weights"] * v**2).sum()


@pytest.mark.parametrize("engine", ["jax", "pytensor"])
@pytest.mark.parametrize(
    "path",
    [
        "global dict entry",
        "attribute of a global",
        "attribute two levels down",
        "closed-over list entry",
        "slot of a closed-over object",
        "slot two levels down",
    ],
)
def test_data_read_through_a_container_or_an_attribute_is_never_stale(engine: str, path: str) -> None:
    """A compiling engine bakes in what f reads, also through ``state["w"]`` or ``model.w``: an
    unprepared call after that entry was replaced (or written in place) must not reuse it.
    Before, only the global or the closure cell itself was compared, and both engines gave the
    gradient of the old weights; an object's slots (not in its ``__dict__``) were not read."""
    require(engine)
    x = np.ones(2)
    if path == "global dict entry":
        _STATE["weights"] = np.array([1.0, 2.0])

        def put(w: np.ndarray) -> None:
            _STATE["weights"] = w

        f: Any = _state_loss
    elif path == "attribute of a global":
        _HOLDER.weights = np.array([1.0, 2.0])

        def put(w: np.ndarray) -> None:
            _HOLDER.weights = w

        f = lambda v: (_HOLDER.weights * v**2).sum()  # noqa: E731
    elif path == "attribute two levels down":
        outer = _Holder(np.zeros(2))
        outer.inner = _Holder(np.array([1.0, 2.0]))  # type: ignore[attr-defined]

        def put(w: np.ndarray) -> None:
            outer.inner.weights = w  # type: ignore[attr-defined]

        f = lambda v: (outer.inner.weights * v**2).sum()  # type: ignore[attr-defined]  # noqa: E731
    elif path == "slot of a closed-over object":
        slotted = _SlottedHolder(np.array([1.0, 2.0]))

        def put(w: np.ndarray) -> None:
            slotted.weights = w

        f = lambda v: (slotted.weights * v**2).sum()  # noqa: E731
    elif path == "slot two levels down":
        top = _SlottedHolder(np.zeros(2))
        top.inner = _SlottedHolder(np.array([1.0, 2.0]))

        def put(w: np.ndarray) -> None:
            top.inner.weights = w

        f = lambda v: (top.inner.weights * v**2).sum()  # noqa: E731
    else:
        kept = [np.array([1.0, 2.0])]

        def put(w: np.ndarray) -> None:
            kept[0] = w

        f = lambda v: (kept[0] * v**2).sum()  # noqa: E731
    np.testing.assert_allclose(np.asarray(di.gradient(f, engine, x)), [2.0, 4.0])
    put(np.array([5.0, 7.0]))
    np.testing.assert_allclose(np.asarray(di.gradient(f, engine, x)), [10.0, 14.0])
    if path == "global dict entry":  # (the entry's array written in place: its contents count too)
        _STATE["weights"][0] = 9.0
        np.testing.assert_allclose(np.asarray(di.gradient(f, engine, x)), [18.0, 14.0])


class _Model:
    """An object whose methods read its data two levels down (``self.model.weights``)."""

    def __init__(self) -> None:
        self.model = _Holder(np.array([1.0, 2.0]))

    def loss(self, v: Any) -> Any:
        return (self.model.weights * v**2).sum()

    def __call__(self, v: Any) -> Any:
        return self.helper(v)

    def helper(self, v: Any) -> Any:
        return (self.model.weights * v**2).sum()


@pytest.mark.parametrize("kind", ["bound method", "callable object"])
def test_data_a_method_reads_below_its_instance_is_never_stale(kind: str) -> None:
    """A bound method, or a callable object whose ``__call__`` calls another method, reading
    ``self.model.weights``: only the instance's own attributes were compared, and jax gave the
    gradient of the old weights after ``model.weights`` was replaced."""
    require("jax")
    owner = _Model()
    f = owner.loss if kind == "bound method" else owner
    np.testing.assert_allclose(np.asarray(di.gradient(f, "jax", np.ones(2))), [2.0, 4.0])
    owner.model.weights = np.array([5.0, 7.0])
    np.testing.assert_allclose(np.asarray(di.gradient(f, "jax", np.ones(2))), [10.0, 14.0])


class _Scaling:
    def __init__(self, weights: np.ndarray) -> None:
        self.weights = weights

    def __call__(self, v: Any) -> Any:
        return self.weights * v**2

    def apply(self, v: Any) -> Any:
        return self.weights * v**2


_SCALING = _Scaling(np.array([0.0, 2.0]))


@pytest.mark.parametrize("backend", ["jax", "sparse finite_differences"])
@pytest.mark.parametrize("kind", ["global called", "global's method", "closure cell called"])
def test_data_an_object_f_calls_reads_is_never_stale(kind: str, backend: str) -> None:
    """f calling an object it reads as a global or a closure cell (``model(v)``,
    ``model.apply(v)``): what the object's methods read through it was not followed, and the
    Jacobian of the old weights came back after they were written in place or replaced."""
    if backend == "jax":
        require("jax")
    engine: Any = "jax" if backend == "jax" else di.AutoSparse("finite_differences")
    scaling = _SCALING if kind.startswith("global") else _Scaling(np.array([0.0, 2.0]))
    scaling.weights = np.array([0.0, 2.0])  # (a zero a sparsity pattern must not keep)
    if kind == "global called":
        f = lambda v: _SCALING(v)  # noqa: E731
    elif kind == "global's method":
        f = lambda v: _SCALING.apply(v)  # noqa: E731
    else:
        f = lambda v: scaling(v)  # noqa: E731
    x = np.array([1.0, 1.0])
    np.testing.assert_allclose(np.diag(_dense(di.jacobian(f, engine, x))), [0.0, 4.0], rtol=1e-6, atol=1e-9)
    scaling.weights[:] = [3.0, 5.0]
    np.testing.assert_allclose(np.diag(_dense(di.jacobian(f, engine, x))), [6.0, 10.0], rtol=1e-6)
    scaling.weights = np.array([7.0, 11.0])
    np.testing.assert_allclose(np.diag(_dense(di.jacobian(f, engine, x))), [14.0, 22.0], rtol=1e-6)


def _loss_of_state(state: dict[str, Any], v: Any) -> Any:
    return (state["weights"] * v**2).sum()


def _loss_with_state(v: Any, state: dict[str, Any]) -> Any:
    return (state["weights"] * v**2).sum()


@pytest.mark.parametrize("kind", ["partial argument", "partial keyword", "default", "keyword-only default"])
def test_data_held_by_an_argument_f_is_bound_to_is_never_stale(kind: str) -> None:
    """The dict f is bound to (a ``functools.partial``'s argument, a default) holding the
    weights: only the dict itself was compared, and jax gave the gradient of the old weights
    after its entry was replaced."""
    require("jax")
    state = {"weights": np.array([1.0, 2.0])}
    if kind == "partial argument":
        f: Any = functools.partial(_loss_of_state, state)
    elif kind == "partial keyword":
        f = functools.partial(_loss_with_state, state=state)
    elif kind == "default":

        def f(v: Any, state: dict[str, Any] = state) -> Any:
            return (state["weights"] * v**2).sum()

    else:

        def f(v: Any, *, state: dict[str, Any] = state) -> Any:
            return (state["weights"] * v**2).sum()

    np.testing.assert_allclose(np.asarray(di.gradient(f, "jax", np.ones(2))), [2.0, 4.0])
    state["weights"] = np.array([5.0, 7.0])
    np.testing.assert_allclose(np.asarray(di.gradient(f, "jax", np.ones(2))), [10.0, 14.0])


def test_an_mlx_global_written_in_place_is_never_baked_in() -> None:
    """An mx.array takes item assignment: after ``w[1] = 5`` an unprepared mlx call reused the
    program ``mx.compile`` had traced with the old values (the closure compared mlx arrays by
    identity only, as if they were immutable like jax's)."""
    require("mlx")
    import mlx.core as mx

    weights = mx.array([1.0, 2.0])
    f = lambda v: (weights * v**2).sum()  # noqa: E731
    x = mx.ones(2)
    np.testing.assert_allclose(np.array(di.gradient(f, "mlx", x)), [2.0, 4.0])
    weights[1] = 5.0
    np.testing.assert_allclose(np.array(di.gradient(f, "mlx", x)), [2.0, 10.0])


def test_an_attribute_f_does_not_name_costs_no_new_prep() -> None:
    """Only the entries f's code names are followed: a counter beside the weights that changes
    on every call leaves the prep in use."""
    require("jax")
    holder = _Holder(np.array([1.0, 2.0]))
    f = lambda v: (holder.weights * v**2).sum()  # noqa: E731
    first = di.gradient(f, "jax", np.ones(2))
    prep = _prep.prep_cache.recent(f, "gradient")
    holder.calls = 10**6  # (a new int object)
    np.testing.assert_allclose(np.asarray(di.gradient(f, "jax", np.ones(2))), np.asarray(first))
    assert _prep.prep_cache.recent(f, "gradient") is prep


@pytest.mark.parametrize("engine", ["finite_differences", "torch"])
def test_every_entry_of_a_large_global_counts(engine: str) -> None:
    """The 70,000-entry global of issue 39, on an engine without jax: a write to its last
    entry, past any prefix a cheap comparison might read, gives the new gradient."""
    if engine == "torch":
        require("torch")
        import torch

        big: Any = torch.ones(70_000, dtype=torch.float64)
        x: Any = torch.ones(3, dtype=torch.float64)
    else:
        big, x = np.ones(70_000), np.ones(3)

    def loss(v: Any) -> Any:
        return (big[-3:] * v**2).sum()

    np.testing.assert_allclose(np.asarray(di.gradient(loss, engine, x)), [2.0, 2.0, 2.0], rtol=1e-6)
    big[-3:] = 5.0
    np.testing.assert_allclose(np.asarray(di.gradient(loss, engine, x)), [10.0, 10.0, 10.0], rtol=1e-6)


def test_an_array_above_the_kept_size_is_compared_by_its_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_prep, "_KEPT", 16)
    big = np.ones(100)

    def f(v: Any) -> Any:
        return big * v

    closure = _prep.Closure(f)
    assert any(contents.digest is not None for _, contents in closure._arrays)  # type: ignore[union-attr]
    assert closure.holds(f)
    big[50] = 2.0
    assert not closure.holds(f)
    big[50] = 1.0
    assert closure.holds(f)


def test_an_unprepared_sparse_partial_sees_a_new_pattern(scale: Any) -> None:
    """A stale pattern misses entries: the pattern is detected afresh."""

    def f(v: Any, k: Any) -> Any:
        return v * k + SCALE * v[::-1]

    p = functools.partial(f, k=1.0)
    backend = di.AutoSparse("finite_differences")
    x = np.arange(1.0, 4.0)
    _set_scale(0.0)
    np.testing.assert_allclose(di.jacobian(p, backend, x).toarray(), np.eye(3), atol=1e-6)
    _set_scale(1.0)
    np.testing.assert_allclose(di.jacobian(p, backend, x).toarray(), np.eye(3) + np.fliplr(np.eye(3)), atol=1e-6)


def test_an_unprepared_sparse_call_sees_a_torch_tensor_written_in_place() -> None:
    require("torch-autograd")
    import torch

    mask = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)

    def f(v: Any) -> Any:
        return v * mask

    x = torch.ones(3, dtype=torch.float64)
    backend = di.AutoSparse("torch")
    np.testing.assert_allclose(di.jacobian(f, backend, x).to_dense().numpy(), np.diag([1.0, 0, 0]))
    mask[1] = 1.0
    np.testing.assert_allclose(di.jacobian(f, backend, x).to_dense().numpy(), np.diag([1.0, 1, 0]))


# -- item 3: results mirror the dict key order of this call's x -----------------------------------


@pytest.mark.parametrize(
    "backend_id", ["jax", "torch-autograd", "torch-func", "autograd", "finite_differences", "scipy"]
)
def test_dict_key_order_comes_from_this_calls_x(backend_id: str) -> None:
    backend = require(backend_id)
    from conftest import namespace, native_tree

    def f(t: Any) -> Any:
        xp = namespace(t["a"])
        return xp.sum(t["a"] ** 2) + xp.sum(t["b"] ** 3)

    first = native_tree(backend_id, {"a": np.ones(2), "b": np.ones(3)}, "float64")
    second = {"b": first["b"], "a": first["a"]}
    for _ in range(2):
        assert list(di.gradient(f, backend, first)) == ["a", "b"]
        assert list(di.gradient(f, backend, second)) == ["b", "a"]
    prep = di.prepare_gradient(f, backend, first)
    with pytest.raises(di.PreparationMismatchError, match="dict keys"):
        di.gradient(f, backend, second, prep=prep)


# -- item 14: deep trees, and generated code that tracebacks show ---------------------------------


def _nested(depth: int, leaf: Any) -> Any:
    tree = leaf(np.ones(2))
    for _ in range(depth):
        tree = {"a": tree, "b": leaf(np.ones(1))}
    return tree


def _nested_loss(tree: Any) -> Any:
    total = 0.0
    while isinstance(tree, dict):
        total = total + tree["b"].sum()
        tree = tree["a"]
    return total + (tree**2).sum()


@pytest.mark.parametrize("depth", [200, 500])
@pytest.mark.parametrize("backend_id", ["jax", "finite_differences"])
def test_a_deep_tree_is_differentiated_without_generated_code(backend_id: str, depth: int) -> None:
    require(backend_id)
    leaf = np.asarray
    if backend_id == "jax":
        import jax.numpy as jnp

        leaf = jnp.asarray
    x = _nested(depth, leaf)
    for _ in range(2):  # unprepared, then from the cache
        g = di.gradient(_nested_loss, backend_id, x)
    for _ in range(depth):
        np.testing.assert_allclose(np.asarray(g["b"]), [1.0], rtol=1e-6)
        g = g["a"]
    np.testing.assert_allclose(np.asarray(g), [2.0, 2.0], rtol=1e-6)


def test_generated_code_is_shown_in_tracebacks() -> None:
    from diffiface._flatten import generated

    function = generated("def boom(x):\n    return x.not_there\n", "boom", {})
    other = generated("def boom(x):\n    return x\n", "boom", {})
    filename = function.__code__.co_filename
    assert filename != other.__code__.co_filename  # (a file name of its own)
    with pytest.raises(AttributeError) as raised:
        function(1)
    assert "return x.not_there" in "".join(traceback.format_tb(raised.tb))
    assert linecache.getline(filename, 2).strip() == "return x.not_there"
    del function, raised
    gc.collect()
    assert filename not in linecache.cache  # (dropped with its function)


def test_every_compile_of_generated_code_goes_through_one_helper() -> None:
    import pathlib
    import re

    root = pathlib.Path(di.__file__).parent
    sites = [
        f"{path.relative_to(root)}:{number}"
        for path in root.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"(?<![.\w])(exec|compile)\(", line) and not re.search(r"def compile\(", line)
    ]
    assert len(sites) == 2 and all(site.startswith("_flatten.py:") for site in sites), sites


def test_only_the_structure_helpers_write_code() -> None:
    """``_flatten.generated`` is called by ``structure_flatten`` and ``structure_unflatten`` alone:
    no other step of a call is code written at run time (issue 39)."""
    import ast
    import pathlib

    root = pathlib.Path(di.__file__).parent
    callers = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == (
                    "generated"
                ):
                    callers.append(f"{path.relative_to(root).as_posix()}:{function.name}")
    assert sorted(set(callers)) == ["_flatten.py:structure_flatten", "_flatten.py:structure_unflatten"], callers


# -- item 19: messages that say what happened ----------------------------------------------------


def test_a_prep_for_a_redefined_function_says_so() -> None:
    require("jax")
    import jax.numpy as jnp

    def loss(v: Any) -> Any:
        return jnp.sum(v**2)

    x = np.ones(3)
    prep = di.prepare_gradient(loss, "jax", x)
    keep = loss

    def loss(v: Any) -> Any:  # type: ignore[no-redef]  # (a notebook cell run again)
        return jnp.sum(v**3)

    with pytest.raises(di.PreparationMismatchError, match=r"different function object with the same name `.*loss`"):
        di.gradient(loss, "jax", x, prep=prep)
    del keep
    gc.collect()
    with pytest.raises(di.PreparationMismatchError, match=r"no longer exists.*redefined"):
        di.gradient(loss, "jax", x, prep=prep)


def test_a_prep_used_under_a_jax_trace_says_so() -> None:
    require("jax")
    import jax
    import jax.numpy as jnp

    def loss(v: Any) -> Any:
        return jnp.sum(v**2)

    x = jnp.ones(3)
    prep = di.prepare_gradient(loss, "jax", x)
    with pytest.raises(di.PreparationMismatchError, match="under a jax trace") as raised:
        jax.jit(lambda v: di.gradient(loss, "jax", v, prep=prep))(x)
    assert "called with a jax array" not in str(raised.value)


# -- issue 39's traps -----------------------------------------------------------------------------


def test_a_leaf_kind_without_a_test_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffiface import _arrays, _plan

    monkeypatch.setattr(_arrays, "kind", lambda leaf: "newkind")
    with pytest.raises(di.UnsupportedOperationError, match="'newkind'"):
        _plan.leaf_check(np.ones(2))


def test_every_array_kind_has_a_leaf_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kind diffiface knows has a test of shape and dtype, or is said to need none: none is
    refused as a kind without a test."""
    import typing

    from diffiface import _arrays, _plan

    for kind in typing.get_args(_arrays.Kind):
        if kind == "other":  # (compared by value or by whole signatures, never by a leaf test)
            continue
        monkeypatch.setattr(_arrays, "kind", lambda leaf, kind=kind: kind)
        try:
            check = _plan.leaf_check(np.ones(2))
        except di.UnsupportedOperationError:
            pytest.fail(f"no leaf test for the kind {kind!r}")
        except Exception:  # (a numpy array is not that kind's leaf: its test does not fit it)
            continue
        assert check is not None
        if kind != "python":  # (a Python number's type says all; an array's does not)
            assert check[1] is not None, kind
    monkeypatch.undo()
    numpy_test = _plan.leaf_check(np.ones(2))[1]  # type: ignore[index]
    assert numpy_test is not None and numpy_test(np.ones(2)) and not numpy_test(np.ones(3))


def test_the_prep_cache_reads_no_weak_key_dictionary_internals() -> None:
    require("jax")
    import inspect

    import jax.numpy as jnp

    assert ".data" not in inspect.getsource(_prep._PrepCache)

    def make() -> Any:
        def loss(v: Any) -> Any:
            return jnp.sum(v**2)

        return loss

    f = make()
    di.gradient(f, "jax", np.ones(3))
    assert _prep.prep_cache.recent(f, "gradient") is not None
    reference = weakref.ref(f)
    assert reference in _prep.prep_cache._functions
    del f
    gc.collect()
    assert reference() is None  # (the cache kept no strong reference to f)
    assert all(key() is not None for key in list(_prep.prep_cache._functions))  # (its entry went with it)


def test_the_prep_module_cites_only_names_that_exist() -> None:
    import inspect

    source = inspect.getsource(_prep)
    for gone in ("Prep.fast", "_matching", "test_quick_match"):
        assert gone not in source


_Pair = __import__("collections").namedtuple("_Pair", "d e")


@pytest.mark.parametrize("backend_id", ["jax", "torch-autograd", "finite_differences"])
def test_dict_key_order_is_mirrored_where_no_flattening_is_written(backend_id: str) -> None:
    """A dict inside a namedtuple, and one of 300 keys: x is flattened in C, which does not see
    the order; the order is compared beside it."""
    backend = require(backend_id)
    from conftest import native_tree

    def f(t: Any) -> Any:
        return (t.d["a"] ** 2).sum() + (t.d["b"] ** 3).sum() + t.e.sum()

    first = _Pair(native_tree(backend_id, {"a": np.ones(2), "b": np.ones(2)}, "float64"), np.ones(1))
    first = _Pair(first.d, native_tree(backend_id, np.ones(1), "float64"))
    second = _Pair({"b": first.d["b"], "a": first.d["a"]}, first.e)
    for _ in range(2):
        assert list(di.gradient(f, backend, first).d) == ["a", "b"]
        assert list(di.gradient(f, backend, second).d) == ["b", "a"]
    many = native_tree(backend_id, {f"k{i}": np.ones(1) for i in range(300)}, "float64")
    reversed_keys = dict(reversed(list(many.items())))

    def total(t: Any) -> Any:
        return sum((v**2).sum() for v in t.values())

    for _ in range(2):
        assert list(di.gradient(total, backend, many)) == list(many)
        assert list(di.gradient(total, backend, reversed_keys)) == list(reversed_keys)


@pytest.mark.parametrize("backend_id", ["jax", "torch-autograd", "autograd", "finite_differences"])
def test_a_contexts_dict_key_order_comes_from_this_call(backend_id: str) -> None:
    """f gets a context rebuilt in the structure its prep was made for: a batch dict whose keys
    come in another order (``inputs, targets = batch.values()``) is not handed to f in the
    first call's order, in a written flattening, a namedtuple's (flattened in C) or one of 300
    keys; a strict prep names the order, a loose one prepares again."""
    backend = require(backend_id)
    from conftest import namespace, native_tree

    def f(x: Any, batch: Any) -> Any:
        inputs, targets = batch.values()
        return namespace(x).sum(x * inputs - targets)

    first = native_tree(backend_id, {"inputs": np.array([1.0, 2.0]), "targets": np.array([3.0, 4.0])}, "float64")
    second = {"targets": first["targets"], "inputs": first["inputs"]}
    x = native_tree(backend_id, np.ones(2), "float64")
    for _ in range(2):
        np.testing.assert_allclose(np.asarray(di.gradient(f, backend, x, di.Constant(first))), [1.0, 2.0])
        np.testing.assert_allclose(np.asarray(di.gradient(f, backend, x, di.Constant(second))), [3.0, 4.0])
    prep = di.prepare_gradient(f, backend, x, di.Constant(first))
    with pytest.raises(di.PreparationMismatchError, match="context 0's dict keys"):
        di.gradient(f, backend, x, di.Constant(second), prep=prep)
    loose = prep.with_strictness(False)
    np.testing.assert_allclose(np.asarray(di.gradient(f, backend, x, di.Constant(second), prep=loose)), [3.0, 4.0])

    def g(x: Any, pair: Any) -> Any:
        inputs, targets = pair.d.values()
        return namespace(x).sum(x * inputs - targets) + pair.e.sum()

    for _ in range(2):
        np.testing.assert_allclose(np.asarray(di.gradient(g, backend, x, di.Constant(_Pair(first, x)))), [1.0, 2.0])
        np.testing.assert_allclose(np.asarray(di.gradient(g, backend, x, di.Constant(_Pair(second, x)))), [3.0, 4.0])
    many = native_tree(backend_id, {f"k{i:03d}": np.full(1, float(i)) for i in range(300)}, "float64")
    reversed_keys = dict(reversed(list(many.items())))
    y = native_tree(backend_id, np.ones(300), "float64")

    def weighted(x: Any, table: Any) -> Any:
        xp = namespace(x)
        return xp.sum(x * xp.concatenate(list(table.values())))

    for _ in range(2):
        assert float(di.gradient(weighted, backend, y, di.Constant(many))[0]) == pytest.approx(0.0, abs=1e-6)
        assert float(di.gradient(weighted, backend, y, di.Constant(reversed_keys))[0]) == pytest.approx(299.0)


def test_dict_key_order_inside_a_registered_node_comes_from_this_call() -> None:
    """A dict held by a class registered with jax (a dataclass field), in x or in a context:
    the walk that tells key orders on every call did not look inside it, and a later call
    whose dict came in another order got the first call's (its gradient under the wrong keys,
    f handed the old order)."""
    require("jax")
    import dataclasses

    import jax
    import jax.numpy as jnp

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Holder:
        d: dict[str, Any]

    def f(p: Any) -> Any:
        return jnp.sum(jnp.concatenate(list(p.d.values())) * jnp.arange(1.0, 5.0))

    first = Holder({"a": np.array([1.0, 2.0]), "b": np.array([3.0, 4.0])})
    second = Holder({"b": first.d["b"], "a": first.d["a"]})
    for _ in range(2):
        g = di.gradient(f, "jax", first)
        assert list(g.d) == ["a", "b"]
        np.testing.assert_allclose(g.d["a"], [1.0, 2.0])
        g = di.gradient(f, "jax", second)
        assert list(g.d) == ["b", "a"]
        np.testing.assert_allclose(g.d["b"], [1.0, 2.0])
    with pytest.raises(di.PreparationMismatchError, match="x's dict keys"):
        di.gradient(f, "jax", second, prep=di.prepare_gradient(f, "jax", first))

    def h(x: Any, holder: Any) -> Any:
        return jnp.sum(x * jnp.concatenate(list(holder.d.values())))

    x = np.ones(4)
    for _ in range(2):
        np.testing.assert_allclose(di.gradient(h, "jax", x, di.Constant(first)), [1.0, 2.0, 3.0, 4.0])
        np.testing.assert_allclose(di.gradient(h, "jax", x, di.Constant(second)), [3.0, 4.0, 1.0, 2.0])


def test_a_tensor_without_a_numpy_view_is_compared_with_a_copy() -> None:
    """A bfloat16 tensor (a dtype numpy lacks; an accelerator's tensor takes the same path):
    compared with a copy on its device."""
    require("torch-autograd")
    import torch

    mask = torch.tensor([1.0, 0.0, 0.0], dtype=torch.bfloat16)

    def f(v: Any) -> Any:
        return v * mask

    closure = _prep.Closure(f)
    assert [type(contents).__name__ for _, contents in closure._arrays] == ["_DeviceContents"]
    assert closure.holds(f)
    mask[1] = 1.0
    assert not closure.holds(f)


def test_a_method_of_an_object_without_weak_references_is_served() -> None:
    """A bound method of a ``dataclass(slots=True)`` instance (no weak reference to it) raised
    TypeError from the prep cache; it is held as builtins are, and a rebound field is seen."""
    import dataclasses

    @dataclasses.dataclass(slots=True)
    class Model:
        scale: float

        def loss(self, v: Any) -> Any:
            return (self.scale * v**2).sum()

    model, x = Model(2.0), np.ones(3)
    np.testing.assert_allclose(di.gradient(model.loss, "finite_differences", x), 4 * x, rtol=1e-6)
    model.scale = 3.0
    np.testing.assert_allclose(di.gradient(model.loss, "finite_differences", x), 6 * x, rtol=1e-6)


def test_an_nnx_variable_f_closes_over_is_never_stale() -> None:
    """A flax nnx ``Variable`` keeps its value in a slot and f reads it through ``w[...]`` (a
    ``__getitem__``), which no name in f's code reaches: after ``w[...] = ...`` an unprepared
    jax call reused the program traced with the old value, with no error. A pytree only jax
    knows is compared by its leaves."""
    require("jax")
    nnx = pytest.importorskip("flax.nnx", reason="flax is not installed")
    import jax.numpy as jnp

    w = nnx.Param(jnp.array([1.0, 2.0, 3.0]))
    f = lambda v: (w[...] * v**2).sum()  # noqa: E731
    x = jnp.ones(3)
    np.testing.assert_allclose(di.gradient(f, "jax", x), [2.0, 4.0, 6.0])
    w[...] = w[...] * 10
    np.testing.assert_allclose(di.gradient(f, "jax", x), [20.0, 40.0, 60.0])


_NNX_MODEL: Any = None


def _nnx_output(v: Any) -> Any:
    return _NNX_MODEL(v).sum()


def test_an_nnx_module_a_global_f_calls_is_never_stale_while_it_trains() -> None:
    """The gradient of a model's output by its input, the model a global updated in place each
    step (as ``nnx.Optimizer.update`` does): the unprepared call gave the first step's gradient
    at every step. Each step's must be jax's own."""
    global _NNX_MODEL
    require("jax")
    nnx = pytest.importorskip("flax.nnx", reason="flax is not installed")
    import jax
    import jax.numpy as jnp

    _NNX_MODEL = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    x = jnp.array([0.3, -0.2])
    try:
        for _ in range(3):
            np.testing.assert_allclose(di.gradient(_nnx_output, "jax", x), jax.grad(_nnx_output)(x), rtol=1e-6)
            _NNX_MODEL.kernel[...] = _NNX_MODEL.kernel[...] * 0.5 + 1.0  # (an update in place)
    finally:
        _NNX_MODEL = None
