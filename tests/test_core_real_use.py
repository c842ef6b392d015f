"""The core under real use: contexts that change between calls of a compiled program, outputs
whose structure depends on a context, misplaced arguments, errors classified by what happened,
and one dtype rule for derivatives that relate two leaves."""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from conftest import FIRST_ORDER, namespace, require

import diffiface as di
from diffiface._prep import prep_cache
from diffiface.test import assert_allclose, default_tolerances

EVERY = [pytest.param(name, id=name) for name in FIRST_ORDER]


# -- contexts under a compiled program ---------------------------------------------------------


class Settings:
    """A mutable object hashed by identity: jit cannot see a change to it."""

    scale = 1.0


@dataclass(frozen=True)
class FrozenSettings:
    scale: float
    name: str


def _scaled(x: Any, c: Any) -> Any:
    return (c.scale * x**2).sum()


def test_mutable_object_context_is_refused_under_jit() -> None:
    require("jax")
    x = np.ones(3, dtype=np.float32)
    with pytest.raises(di.ContextError, match=r"compared by identity.*AutoJAX\(jit=False\)"):
        di.gradient(_scaled, "jax", x, di.Constant(Settings()))


def test_mutable_object_context_is_seen_without_jit() -> None:
    require("jax")
    x = np.ones(3, dtype=np.float32)
    settings = Settings()
    first = di.gradient(_scaled, di.AutoJAX(jit=False), x, di.Constant(settings))
    settings.scale = 5.0
    second = di.gradient(_scaled, di.AutoJAX(jit=False), x, di.Constant(settings))
    np.testing.assert_allclose(first, 2 * x)
    np.testing.assert_allclose(second, 10 * x)


def test_frozen_dataclass_context_is_static_by_value() -> None:
    require("jax")
    x = np.ones(3, dtype=np.float32)
    for scale in (1.0, 3.0, 1.0):
        got = di.gradient(_scaled, "jax", x, di.Constant(FrozenSettings(scale, "a")))
        np.testing.assert_allclose(got, 2 * scale * x)


def test_dict_of_floats_mutated_between_calls() -> None:
    require("jax")
    x = np.ones(3, dtype=np.float32)
    config = {"scale": 1.0}

    def f(x: Any, c: Any) -> Any:
        return (c["scale"] * x**2).sum()

    np.testing.assert_allclose(di.gradient(f, "jax", x, di.Constant(config)), 2 * x)
    config["scale"] = 3.0
    np.testing.assert_allclose(di.gradient(f, "jax", x, di.Constant(config)), 6 * x)


def test_new_float_contexts_run_one_program() -> None:
    """A float context is an argument of the compiled program: twenty values, one trace."""
    require("jax")
    x = np.ones(3, dtype=np.float32)
    traces = []

    def f(x: Any, c: Any) -> Any:
        traces.append(1)
        return (c * x**2).sum()

    prep = di.prepare_gradient(f, "jax", x, di.Constant(0.5))
    before = len(traces)
    for value in np.linspace(1.0, 2.0, 20):
        got = di.gradient(f, "jax", x, di.Constant(float(value)), prep=prep)
        assert_allclose(got, (2 * float(value) * x).astype(np.float32))  # float32's tolerances
    assert len(traces) == before


def test_integer_context_stays_static() -> None:
    """An int can shape the program (a size, a count), so it stays a Python int in f."""
    require("jax")
    x = np.ones(4, dtype=np.float32)

    def f(x: Any, n: int) -> Any:
        assert isinstance(n, int)
        return (x[:n] ** 2).sum()

    for n in (2, 3, 2):
        expected = np.where(np.arange(4) < n, 2.0, 0.0)
        np.testing.assert_allclose(di.gradient(f, "jax", x, di.Constant(n)), expected)


def test_nnx_state_updated_in_place_is_seen() -> None:
    require("jax")
    nnx = pytest.importorskip("flax.nnx", reason="flax is not installed: pip install flax")
    import jax.numpy as jnp

    model = nnx.Linear(3, 1, use_bias=False, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def f(x: Any, state: Any) -> Any:
        return nnx.merge(graphdef, state)(x).sum()

    x = jnp.ones(3)
    di.gradient(f, "jax", x, di.Constant(state))
    state["kernel"][...] = jnp.full((3, 1), 2.0)  # what an optimizer step does
    np.testing.assert_allclose(di.gradient(f, "jax", x, di.Constant(state)), np.full(3, 2.0))


def test_equinox_module_as_context_follows_a_new_module() -> None:
    require("jax")
    eqx = pytest.importorskip("equinox", reason="equinox is not installed: pip install equinox")
    import jax
    import jax.numpy as jnp

    layer = eqx.nn.Linear(3, 1, use_bias=False, key=jax.random.key(0))

    def f(x: Any, layer: Any) -> Any:
        return layer(x).sum()

    x = jnp.ones(3)
    np.testing.assert_allclose(
        di.gradient(f, "jax", x, di.Constant(layer)), np.asarray(layer.weight[0]), *default_tolerances("float32")
    )
    moved = eqx.tree_at(lambda m: m.weight, layer, jnp.full((1, 3), 4.0))
    np.testing.assert_allclose(di.gradient(f, "jax", x, di.Constant(moved)), np.full(3, 4.0))


# -- outputs whose structure depends on a context ----------------------------------------------


def _shaped_by(x: Any, c: Any) -> Any:
    if c["mode"] == "tuple":
        return (x * 2, x * 3)
    return {"a": x * 2, "b": x * 3}


@pytest.mark.parametrize("name", EVERY)
@pytest.mark.parametrize("operator", ["jacobian", "jvp"])
def test_output_structure_follows_the_context(name: str, operator: str) -> None:
    backend = require(name)
    x = np.ones(2)
    for mode in ("tuple", "dict", "tuple", "dict"):
        context = di.Constant({"mode": mode})
        if operator == "jacobian":
            got = di.jacobian(_shaped_by, backend, x, context)
            first = got[0] if mode == "tuple" else got["a"]
            np.testing.assert_allclose(np.asarray(first), 2 * np.eye(2), rtol=1e-6)
        else:
            got = di.jvp(_shaped_by, backend, x, np.ones(2), context)
            first = got[0] if mode == "tuple" else got["a"]
            np.testing.assert_allclose(np.asarray(first), np.full(2, 2.0), rtol=1e-6)
        assert isinstance(got, tuple if mode == "tuple" else dict)


@pytest.mark.parametrize("name", ["jax", "torch-autograd", "autograd", "finite_differences"])
def test_threads_sharing_a_prep_each_get_their_structure(name: str) -> None:
    backend = require(name)
    x = np.ones(2)
    prep = di.prepare_jacobian(_shaped_by, backend, x, di.Constant({"mode": "tuple"}), strict=False)
    wrong: list[str] = []

    def work(mode: str) -> None:
        for _ in range(20):
            got = di.jacobian(_shaped_by, backend, x, di.Constant({"mode": mode}), prep=prep)
            if not isinstance(got, tuple if mode == "tuple" else dict):
                wrong.append(f"{mode}: {type(got).__name__}")

    threads = [threading.Thread(target=work, args=(mode,)) for mode in ("tuple", "dict", "tuple", "dict")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


# -- arguments in the wrong place ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("operator", "fix"),
    [("gradient", "value_and_gradient"), ("jvp", "value_and_jvp"), ("vjp", "value_and_vjp"), ("hessian", "Drop")],
)
def test_has_aux_on_an_operator_without_one(operator: str, fix: str) -> None:
    x = np.ones(2)
    args: tuple[Any, ...] = (np.ones(2),) if operator in ("jvp", "vjp") else ()
    if operator == "vjp":
        args = (np.ones(()),)
    with pytest.raises(di.InvalidInputError, match=fix):
        getattr(di, operator)(lambda x: (x**2).sum(), "finite_differences", x, *args, has_aux=True)
    with pytest.raises(di.InvalidInputError, match=fix):
        getattr(di, f"prepare_{operator}")(lambda x: (x**2).sum(), "finite_differences", x, *args, has_aux=True)


def test_prep_passed_positionally() -> None:
    def f(x: Any) -> Any:
        return (x**2).sum()

    x = np.ones(2)
    prep = di.prepare_gradient(f, "finite_differences", x)
    with pytest.raises(di.ContextError, match=r"prep=prep"):
        di.gradient(f, "finite_differences", x, prep)


@pytest.mark.parametrize(
    ("vector", "error"),
    [
        (np.ones(4), di.InvalidInputError),
        (np.ones((3, 1)), di.InvalidInputError),
        (np.ones(3, dtype=complex), di.InvalidInputError),
        ([1.0, 2.0, 3.0], di.ArrayTypeError),
    ],
    ids=["length", "rank", "complex", "list"],
)
def test_unravel_refuses_what_ravel_did_not_give(vector: Any, error: type[Exception]) -> None:
    _, unravel = di.tree.ravel({"a": np.ones(2, dtype=np.float32), "b": np.zeros(1)})
    with pytest.raises(error):
        unravel(vector)


def test_unravel_refuses_another_array_type() -> None:
    require("jax")
    import jax.numpy as jnp

    _, unravel = di.tree.ravel({"a": np.ones(2, dtype=np.float32), "b": np.zeros(1)})
    with pytest.raises(di.ArrayTypeError, match="numpy vector"):
        unravel(jnp.ones(3))  # would come back float32 without x64, the float64 leaf narrowed


# -- errors classified by what happened ----------------------------------------------------------


@pytest.mark.parametrize("name", EVERY)
@pytest.mark.parametrize("text", ["not a Tensor", "bad jax value", "JAX arrays", "ArrayBox"])
def test_f_own_type_error_passes_unchanged(name: str, text: str) -> None:
    backend = require(name)

    def f(x: Any) -> Any:
        raise TypeError(text)

    with pytest.raises(TypeError, match=text) as info:
        di.gradient(f, backend, np.ones(2))
    assert not isinstance(info.value, di.DiffifaceError)


def test_torch_function_on_jax_arrays_is_a_framework_mismatch() -> None:
    require("jax")
    torch = pytest.importorskip("torch")

    def f(x: Any) -> Any:
        return torch.sum(x)

    with pytest.raises(di.FrameworkMismatchError, match="AutoTorch"):
        di.gradient(f, "jax", np.ones(2))


def test_jax_in_place_assignment_is_a_mutation_error() -> None:
    require("jax")
    x = np.ones(3)

    def f(x: Any) -> Any:
        x[0] = 5.0
        return (x**2).sum()

    with pytest.raises(di.MutationError, match=r"\.at\[i\]\.set"):
        di.gradient(f, "jax", x)
    np.testing.assert_array_equal(x, np.ones(3))


@pytest.mark.parametrize("name", ["autograd", "finite_differences", "scipy"])
def test_write_into_a_numpy_constant(name: str) -> None:
    backend = require(name)
    c = np.ones(3)

    def f(x: Any, c: Any) -> Any:
        c[0] = 5.0
        return (x * c).sum()

    with pytest.raises(di.MutationError, match="Cache"):
        di.gradient(f, backend, np.ones(3), di.Constant(c))
    np.testing.assert_array_equal(c, np.ones(3))
    # the same f with its scratch space as a Cache is fine
    scratch = np.ones(3)
    got = di.gradient(f, backend, np.ones(3), di.Cache(scratch))
    np.testing.assert_allclose(got, [5.0, 1.0, 1.0], rtol=1e-6)


# -- one dtype rule --------------------------------------------------------------------------------


def _float64(x: Any) -> Any:
    """``x`` cast to float64 in its own framework, differentiably."""
    xp = namespace(x)
    if xp is np or xp.__name__.startswith(("autograd", "pytensor")):
        return x.astype(np.float64)
    if xp.__name__ == "torch":
        return x.to(xp.float64)
    if xp.__name__.startswith("tensorflow"):  # (its numpy API: tensors have no astype)
        return xp.asarray(x, dtype=xp.float64)
    return x.astype(xp.float64)


def _widened(x: Any) -> Any:
    return _float64(x) * 2


def _mixed(x: Any) -> Any:
    a, b = x["a"], x["b"]
    xp = namespace(a)
    return xp.sum(_float64(a) * b) + _float64(xp.sum(a**2))  # (TensorFlow adds no float32 to float64)


@pytest.mark.parametrize("name", [n for n in FIRST_ORDER if n != "jax"])
def test_jacobian_block_has_the_wider_dtype(name: str) -> None:
    """A float32 x and a float64 output: the Jacobian is float64 (jax without x64 cannot make
    float64 from float32 inputs, so it is left out)."""
    backend = require(name)
    got = di.jacobian(_widened, backend, np.ones(2, dtype=np.float32))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, 2 * np.eye(2), rtol=1e-5)


@pytest.mark.parametrize("name", EVERY)
def test_hessian_blocks_of_a_mixed_pytree(name: str) -> None:
    backend = require(name)
    x = {"a": np.ones(2, dtype=np.float32), "b": np.ones(2, dtype=np.float64)}
    strictness = contextlib.nullcontext()
    if name == "jax":  # jax's own jacrev of mixed dtypes fails under the suite's strict promotion
        import jax

        strictness = jax.numpy_dtype_promotion("standard")
    with strictness:
        got = di.hessian(_mixed, backend, x)
        gradient = di.gradient(_mixed, backend, x)
    dtypes = {(i, j): str(got[i][j].dtype) for i in "ab" for j in "ab"}
    assert dtypes == {("a", "a"): "float32", ("a", "b"): "float64", ("b", "a"): "float64", ("b", "b"): "float64"}
    np.testing.assert_allclose(got["a"]["b"], np.eye(2), atol=1e-3)
    assert (gradient["a"].dtype, gradient["b"].dtype) == (np.float32, np.float64)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("float32", "float32", "float32"),
        ("float32", "float64", "float64"),
        ("float16", "bfloat16", "float32"),
        (None, "float32", "float32"),
        ("float64", None, "float64"),
    ],
)
def test_promoted_dtype(a: str | None, b: str | None, expected: str) -> None:
    from diffiface._dispatch import promoted_dtype

    assert promoted_dtype(a, b) == expected
    assert promoted_dtype(b, a) == expected


def test_prep_cache_stays_small_with_new_floats() -> None:
    require("jax")
    x = np.ones(3, dtype=np.float32)

    def f(x: Any, c: Any) -> Any:
        return (c * x**2).sum()

    for value in range(30):
        di.gradient(f, "jax", x, di.Constant(float(value)))
    assert len(prep_cache._functions[weakref.ref(f)]) == 1  # one prep: a float's value is not part of a signature
