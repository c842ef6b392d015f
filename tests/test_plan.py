"""A prep's plan (``Prep.plan``): its leaves are taken when a call has the prep's signature,
the result equals that of the call's full signature, and a call that does not fit the plan
is never run on it."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import optree
import pytest
from conftest import FIRST_ORDER, assert_tree_close, namespace, require, to_numpy

import diffiface as di
from diffiface._dispatch import _arguments
from diffiface._plan import Unfit

MISS = object()


def _fast(prep: Any, operator: str, f: Any, backend: Any, x: Any, t: Any, contexts: tuple[Any, ...], aux: bool) -> Any:
    """The call run on the plan where its leaves fit, MISS where they do not: where the plan's
    tests refuse them, or the program (a jit-compiled one checks the shapes and dtypes of jax
    arrays itself, when traced for them)."""
    leaves = prep.plan.leaves(operator, f, backend, x, t, contexts, aux)
    if leaves is None:
        return MISS
    try:
        return prep.run(*leaves)
    except Unfit:
        return MISS


def loss(x: Any, *contexts: Any) -> Any:
    xp = namespace(x)
    y = xp.sum(xp.sin(x) * x**2)
    for c in contexts:
        y = y + xp.sum(c * x)
    return y


def vector(x: Any, *contexts: Any) -> Any:
    xp = namespace(x)
    y = xp.sin(x) * x
    for c in contexts:
        y = y + c * x
    return y


def native(backend_id: str, values: Any) -> Any:
    """``values`` as the backend's own array type (numpy for the others), float32 for the
    engines that default to it."""
    values = np.asarray(values, dtype=np.float64)
    if backend_id == "jax":
        import jax.numpy as jnp

        return jnp.asarray(values, dtype=jnp.float32)
    if backend_id.startswith("torch"):
        import torch

        return torch.tensor(values, dtype=torch.float32)
    return values


# (operator, f, takes a tangent of x / of y)
CASES = [
    ("gradient", loss, None),
    ("value_and_gradient", loss, None),
    ("jacobian", vector, None),
    ("hessian", loss, None),
    ("jvp", vector, "x"),
    ("vjp", vector, "y"),
    ("hvp", loss, "x"),
]


def _call(backend_id: str, operator: str, f: Any, tangent: str | None, contexts: int) -> tuple[Any, ...]:
    backend = require(backend_id)
    x = native(backend_id, [0.5, -1.0, 2.0])
    t = native(backend_id, [1.0, 0.25, -0.5]) if tangent else None
    values = (di.Constant(native(backend_id, [0.1, 0.2, 0.3])), di.Cache(native(backend_id, [0.0, -0.2, 0.4])))
    return backend, x, t, values[:contexts]


@pytest.mark.parametrize("with_context", [0, 1, 2], ids=["bare", "constant", "constant-and-cache"])
@pytest.mark.parametrize(("operator", "f", "tangent"), CASES, ids=[c[0] for c in CASES])
def test_quick_path_agrees_with_full_path(
    backend_id: str, operator: str, f: Any, tangent: str | None, with_context: int
) -> None:
    backend, x, t, contexts = _call(backend_id, operator, f, tangent, with_context)
    args = (x, t) if tangent else (x,)
    prep = getattr(di, "prepare_" + operator)(f, backend, *args, *contexts)
    quick = _fast(prep, operator, f, backend, x, t, contexts, False)
    assert quick is not MISS
    _, _, call = _arguments(operator, f, backend, x, t, contexts, False)
    full = prep.run(call.x_leaves, call.tangent_leaves, call.context_leaves)
    rtol, atol = (1e-6, 1e-6) if backend_id in ("jax", "torch-autograd", "torch-func") else (1e-12, 1e-12)
    assert_tree_close(quick, full, rtol, atol)
    for got, want in zip(optree.tree_leaves(quick), optree.tree_leaves(full), strict=True):
        assert type(got) is type(want)
    # and the public call, which takes the quick path, gives the same again
    again = getattr(di, operator)(f, backend, *args, *contexts, prep=prep)
    assert_tree_close(again, full, rtol, atol)


def _mismatches(backend_id: str) -> dict[str, tuple[Any, ...]]:
    """Calls that differ from ``(loss, backend, x, Constant(c))`` in one part each:
    ``(f, backend, x, contexts, has_aux)``."""
    backend = FIRST_ORDER[backend_id]
    x = native(backend_id, [0.5, -1.0, 2.0])
    c = native(backend_id, [0.1, 0.2, 0.3])
    other_dtype = np.asarray([0.5, -1.0, 2.0], dtype=np.float32 if isinstance(x, np.ndarray) else np.float64)
    other_backend = di.AutoFiniteDifferences() if backend_id != "finite_differences" else di.AutoScipy()
    return {
        "shape": (loss, backend, native(backend_id, [0.5, -1.0]), (di.Constant(native(backend_id, [0.1, 0.2])),)),
        "array type or dtype": (loss, backend, other_dtype, (di.Constant(c),)),
        "list": (loss, backend, [0.5, -1.0, 2.0], (di.Constant(c),)),
        "cache for constant": (loss, backend, x, (di.Cache(c),)),
        "context shape": (loss, backend, x, (di.Constant(native(backend_id, [0.1, 0.2])),)),
        "context count": (loss, backend, x, (di.Constant(c), di.Constant(c))),
        "bare context": (loss, backend, x, (c,)),
        "context as x": (loss, backend, di.Constant(x), (di.Constant(c),)),
        "function": (vector, backend, x, (di.Constant(c),)),
        "backend": (loss, other_backend, x, (di.Constant(c),)),
    }


@pytest.mark.parametrize(
    "part",
    [
        "shape",
        "array type or dtype",
        "list",
        "cache for constant",
        "context shape",
        "context count",
        "bare context",
        "context as x",
        "function",
        "backend",
    ],
)
def test_quick_path_refuses_what_does_not_fit(backend_id: str, part: str) -> None:
    backend = FIRST_ORDER[backend_id]
    x = native(backend_id, [0.5, -1.0, 2.0])
    c = native(backend_id, [0.1, 0.2, 0.3])
    prep = di.prepare_gradient(loss, backend, x, di.Constant(c))
    f, other_backend, other_x, contexts = _mismatches(backend_id)[part]
    assert _fast(prep, "gradient", f, other_backend, other_x, None, contexts, False) is MISS
    with pytest.raises(di.DiffifaceError):  # the full check names the difference
        di.gradient(f, other_backend, other_x, *contexts, prep=prep)


def test_quick_path_refuses_another_operator_or_aux(backend_id: str) -> None:
    backend = FIRST_ORDER[backend_id]
    x = native(backend_id, [0.5, -1.0, 2.0])
    t = native(backend_id, [1.0, 0.0, 0.0])
    prep = di.prepare_gradient(loss, backend, x)
    assert _fast(prep, "hvp", loss, backend, x, t, (), False) is MISS
    with pytest.raises(di.PreparationMismatchError, match="operator"):
        di.hvp(loss, backend, x, t, prep=prep)
    prep = di.prepare_value_and_gradient(loss, backend, x)
    assert _fast(prep, "value_and_gradient", loss, backend, x, None, (), True) is MISS


def test_a_prep_that_is_not_strict_prepares_afresh(backend_id: str) -> None:
    backend = FIRST_ORDER[backend_id]
    prep = di.prepare_gradient(loss, backend, native(backend_id, [0.5, -1.0, 2.0]), strict=False)
    x = native(backend_id, [0.25, 1.5])
    got = to_numpy(di.gradient(loss, backend, x, prep=prep))
    z = np.asarray([0.25, 1.5])
    rtol, atol = (
        (2e-3, 2e-3) if backend_id in ("finite_differences", "scipy", "jax") or "torch" in backend_id else (1e-7, 1e-8)
    )
    np.testing.assert_allclose(got, np.cos(z) * z**2 + 2 * z * np.sin(z), rtol=rtol, atol=atol)


def test_unprepared_calls_alternating_between_signatures(backend_id: str) -> None:
    """Unprepared calls try the prep f used last: calls that take turns between two shapes and
    two array types each get their own, right, result."""
    backend = FIRST_ORDER[backend_id]
    rtol = 2e-3 if backend_id in ("finite_differences", "scipy") else 1e-5

    def f(x: Any) -> Any:  # a fresh f: no prep from other tests
        return loss(x)

    for _ in range(3):
        for values in ([0.5, -1.0, 2.0], [0.25, 1.5], [0.75]):
            for x in (native(backend_id, values), np.asarray(values)):
                got = di.gradient(f, backend, x)
                assert type(got) is type(x)
                z = np.asarray(values)
                np.testing.assert_allclose(to_numpy(got), np.cos(z) * z**2 + 2 * z * np.sin(z), rtol=rtol, atol=rtol)


def test_torch_dtype_change_is_not_matched() -> None:
    torch = pytest.importorskip("torch")
    backend = di.AutoTorch()
    prep = di.prepare_gradient(loss, backend, torch.ones(3, dtype=torch.float32))
    assert _fast(prep, "gradient", loss, backend, torch.ones(3, dtype=torch.float64), None, (), False) is MISS
    parameter = torch.nn.Parameter(torch.ones(3))  # a subclass: the full signature decides
    assert _fast(prep, "gradient", loss, backend, parameter, None, (), False) is MISS
    with torch.no_grad():  # (under grad mode a parameter's gradient keeps its graph, for nesting)
        assert di.gradient(loss, backend, parameter, prep=prep).requires_grad is False


@pytest.mark.parametrize("operator", ["gradient", "hvp"])
def test_a_numpy_scalar_x_gets_a_numpy_scalar(backend_id: str, operator: str) -> None:
    """As numpy's own operations on a numpy scalar give, on every backend, prepared or not."""
    backend = FIRST_ORDER[backend_id]

    def cube(x: Any) -> Any:
        return x**3

    for scalar in (np.float64, np.float32, np.array):  # (a 0-d array keeps a 0-d array)
        args = (scalar(2.0), scalar(1.0)) if operator == "hvp" else (scalar(2.0),)
        prep = getattr(di, "prepare_" + operator)(cube, backend, *args)
        for result in (
            getattr(di, operator)(cube, backend, *args),
            getattr(di, operator)(cube, backend, *args, prep=prep),
        ):
            assert type(result) is type(args[0]) and result.dtype == args[0].dtype
            np.testing.assert_allclose(result, 12.0, rtol=1e-3)  # (3 x**2 and 6 x t at x = 2, t = 1)


@pytest.mark.parametrize("operator", ["gradient", "hvp"])
def test_jax_weak_types_stay_as_jax_makes_them(operator: str) -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def cube(x: Any) -> Any:
        return x**3

    def native(x: Any, t: Any) -> Any:
        return jax.grad(cube)(x) if operator == "gradient" else jax.jvp(jax.grad(cube), (x,), (t,))[1]

    for x in (jnp.asarray(1.5), jnp.asarray(1.5, dtype=jnp.float32)):  # weakly and strongly typed
        t = x * 0 + 1
        args = (x, t) if operator == "hvp" else (x,)
        prep = getattr(di, "prepare_" + operator)(cube, di.AutoJAX(), *args)
        got = getattr(di, operator)(cube, di.AutoJAX(), *args, prep=prep)
        assert got.weak_type == native(x, t).weak_type and got.dtype == x.dtype


def test_equal_but_distinct_objects_do_not_share_preps() -> None:
    """The cache finds an owner by equality; a prep made for one object's method is not run for
    another object that compares equal to it."""
    from dataclasses import dataclass, field

    @dataclass(frozen=True)
    class Model:
        name: str
        scale: float = field(compare=False)

        def loss(self, x: Any) -> Any:
            return self.scale * np.sum(x**2)

    a, b = Model("m", 1.0), Model("m", 3.0)
    assert a == b and hash(a) == hash(b)
    x = np.array([1.0, 2.0])
    backend = di.AutoFiniteDifferences()
    np.testing.assert_allclose(di.gradient(a.loss, backend, x), 2 * x, rtol=1e-6)
    np.testing.assert_allclose(di.gradient(b.loss, backend, x), 6 * x, rtol=1e-6)
    prep = di.prepare_gradient(b.loss, backend, x)
    np.testing.assert_allclose(di.gradient(b.loss, backend, x, prep=prep), 6 * x, rtol=1e-6)
    np.testing.assert_allclose(di.gradient(a.loss, backend, x), 2 * x, rtol=1e-6)


def _tree_loss(p: Any, batch: Any) -> Any:
    import jax.numpy as jnp

    h = jnp.tanh(batch["x"] @ p["w"] + p["b"][None, :])
    return jnp.sum((h - batch["y"]) ** 2)


def _tree(rows: int, dtype: Any = np.float32) -> tuple[Any, Any]:
    import jax.numpy as jnp

    rng = np.random.default_rng(rows)
    p = {"w": jnp.asarray(rng.normal(size=(3, 2)), dtype), "b": jnp.zeros(2, dtype)}
    batch = {"x": jnp.asarray(rng.normal(size=(rows, 3)), dtype), "y": jnp.asarray(rng.normal(size=(rows, 2)), dtype)}
    return p, batch


@pytest.mark.parametrize("backend_name", ["jax", "object"])
def test_a_jit_program_checks_the_shapes_and_dtypes_of_jax_arrays_itself(backend_name: str) -> None:
    """Under jit the plan tests a jax array's type only and the traced program its shape and
    dtype: a strict prep still refuses another batch shape or dtype, naming it; the unprepared
    route prepares anew for it; a weak type, which jit tells apart, is served."""
    require(di.AutoJAX())
    import jax.numpy as jnp

    backend = "jax" if backend_name == "jax" else di.AutoJAX()
    p, batch = _tree(4)
    prep = di.prepare_gradient(_tree_loss, backend, p, di.Constant(batch))
    assert prep.plan.x_checks is not None and type(prep.plan.x_checks).__name__ == "_Types"
    _, other_batch = _tree(5)
    with pytest.raises(di.PreparationMismatchError, match="context") as refused:
        di.gradient(_tree_loss, backend, p, di.Constant(other_batch), prep=prep)
    assert not isinstance(refused.value, Unfit)  # the full check names the difference
    wider = {"w": jnp.zeros((3, 3)), "b": jnp.zeros(3)}
    with pytest.raises(di.PreparationMismatchError, match="x"):
        di.gradient(_tree_loss, backend, wider, di.Constant(batch), prep=prep)
    with pytest.raises(di.PreparationMismatchError):
        di.gradient(
            _tree_loss, backend, optree.tree_map(lambda v: v.astype(jnp.bfloat16), p), di.Constant(batch), prep=prep
        )
    # unprepared: another shape is another prep, never the old program
    first = di.gradient(_tree_loss, backend, p, di.Constant(batch))
    second = di.gradient(_tree_loss, backend, p, di.Constant(other_batch))
    expected = di.gradient(_tree_loss, di.AutoJAX(jit=False), p, di.Constant(other_batch))
    assert_tree_close(second, expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(first["w"]), np.asarray(second["w"]))
    # a weak-typed leaf of the prep's shape and dtype: jit traces again, the prep serves it
    weak = {"w": p["w"], "b": jnp.zeros(2, jnp.float32) + jnp.asarray(0.0)}
    assert_tree_close(
        di.gradient(_tree_loss, backend, p, di.Constant(batch), prep=prep),
        di.gradient(_tree_loss, backend, weak, di.Constant(batch), prep=prep),
        rtol=1e-6,
        atol=1e-6,
    )


def test_numpy_contexts_under_jit_keep_the_plans_own_dtype_test() -> None:
    """jit gives a float32 and a float64 numpy array the same traced type while x64 is off:
    the plan, not the program, tells them apart."""
    require(di.AutoJAX())
    p, batch = _tree(4)
    as_numpy = {k: np.asarray(v, dtype=np.float32) for k, v in batch.items()}
    prep = di.prepare_gradient(_tree_loss, "jax", p, di.Constant(as_numpy))
    with pytest.raises(di.PreparationMismatchError, match="context"):
        di.gradient(
            _tree_loss, "jax", p, di.Constant({k: v.astype(np.float64) for k, v in as_numpy.items()}), prep=prep
        )


@pytest.mark.parametrize("backend_id", ["jax", "torch-autograd", "finite_differences"])
def test_the_plans_flattening_tells_apart_the_trees_optree_does(backend_id: str) -> None:
    """A structure of tuples, lists and dicts is flattened by a function written for it
    (:mod:`diffiface._flatten`), whose structure it returns is jax's where jax is imported
    (the plan compares jax's structures, from jax's faster C pytrees, elsewhere): every tree
    whose structure optree tells apart from the prep's is refused all the same."""
    import collections

    require(di.AutoJAX())
    backend = require(FIRST_ORDER[backend_id])

    def total(p: Any) -> Any:
        return sum((leaf**2).sum() for leaf in optree.tree_leaves(p))

    a, b = native(backend_id, [0.5, -1.0]), native(backend_id, [2.0, 0.25])
    x = {"outer": {"a": a, "b": b}, "c": [a, b]}
    prep = di.prepare_gradient(total, backend, x)
    import jax

    assert prep.plan.x_flatten.__code__.co_filename.startswith("<diffiface generated flatten #")
    assert prep.plan.x_key == jax.tree_util.tree_structure(x)  # (jax's structure: jax's flattening elsewhere)
    assert_tree_close(di.gradient(total, backend, x, prep=prep), di.gradient(total, backend, x), rtol=1e-6, atol=1e-6)
    others = {
        "extra key": {"outer": {"a": a, "b": b, "z": a}, "c": [a, b]},
        "missing key": {"outer": {"a": a}, "c": [a, b]},
        "tuple for list": {"outer": {"a": a, "b": b}, "c": (a, b)},
        "node for leaf": {"outer": {"a": (a,), "b": b}, "c": [a, b]},
        "None for leaf": {"outer": {"a": None, "b": b}, "c": [a, b]},
        "ordered dict": {"outer": collections.OrderedDict(a=a, b=b), "c": [a, b]},
        "renamed key": {"outer": {"a": a, "B": b}, "c": [a, b]},
        "longer list": {"outer": {"a": a, "b": b}, "c": [a, b, a]},
        "shorter list": {"outer": {"a": a, "b": b}, "c": [a]},
        "list for dict": {"outer": [a, b], "c": [a, b]},
        "leaf for node": {"outer": a, "c": [a, b]},
        "int key": {"outer": {"a": a, 1: b}, "c": [a, b]},
    }
    for name, other in others.items():
        assert optree.tree_structure(other) != optree.tree_structure(x), name
        with pytest.raises(di.PreparationMismatchError):
            di.gradient(total, backend, other, prep=prep)
    # (the same structure to optree, in another key order, which results mirror)
    with pytest.raises(di.PreparationMismatchError, match="dict keys"):
        di.gradient(total, backend, {"outer": {"b": b, "a": a}, "c": [a, b]}, prep=prep)


def test_a_jit_program_rebuilds_a_tree_x_where_jax_rebuilds_it_as_optree_does() -> None:
    """Under jit a gradient of a tree x comes out of the compiled program finished where jax
    rebuilds x as optree does (tuples, namedtuples, dicts with sorted keys); a dict whose keys
    are not sorted (jax would sort them) is rebuilt in x's own order, as before."""
    import collections

    require(di.AutoJAX())
    import jax.numpy as jnp

    def total(p: Any) -> Any:
        return sum(jnp.sum(jnp.sin(leaf) * leaf) for leaf in optree.tree_leaves(p))

    pair = collections.namedtuple("pair", ["w", "b"])
    a, b = jnp.asarray([0.5, -1.0], jnp.float32), jnp.asarray([2.0, 0.25, 1.0], jnp.float32)
    cases = {
        "tuple": ((a, b), True),
        "namedtuple": (pair(a, b), True),
        "sorted dict": ({"a": a, "b": {"c": b, "d": a}}, True),
        "unsorted dict": ({"z": a, "a": b}, False),
    }
    for name, (x, finished) in cases.items():
        prep = di.prepare_gradient(total, "jax", x)
        program = prep.plan.program
        assert type(program).__name__ == "JitProgram", name
        assert (program.tree is not None) is finished, name
        got = di.gradient(total, "jax", x, prep=prep)
        want = di.gradient(total, di.AutoJAX(jit=False), x)
        assert type(got) is type(x), name
        if isinstance(x, dict):
            assert list(got) == list(x), name
        assert_tree_close(got, want, rtol=1e-6, atol=1e-6)
        assert all(g.dtype == jnp.float32 for g in optree.tree_leaves(got)), name


def _python_calls(call: Any) -> list[str]:
    """The Python functions ``call()`` enters (C functions and jit's compiled call not counted)."""
    import sys

    names: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return names[1:]  # (the lambda itself)


@pytest.mark.parametrize("shape", ["one array", "tuple", "dict with sorted keys"])
@pytest.mark.parametrize("operator", ["gradient", "hvp", "jvp", "vjp", "jacobian", "value_and_gradient"])
def test_a_prepared_jit_call_on_jax_arrays_runs_no_python_but_the_route(shape: str, operator: str) -> None:
    """Where jit checks every leaf itself, jax's tier runs the call (JitProgram): a prepared
    call enters the public operator, the route and the program's ``run``, and no other Python
    function where jit returns the result finished (a gradient or an hvp, a jvp of one array);
    by name or by an equal backend object. Its result is the one without jit."""
    require(di.AutoJAX())
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    w, b = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), jnp.asarray(rng.normal(size=2), jnp.float32)
    data = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    x: Any = {"one array": w, "tuple": (w, b), "dict with sorted keys": {"b": b, "w": w}}[shape]
    scalar = operator in ("gradient", "hvp", "value_and_gradient")

    def f(p: Any, d: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(p)
        out = jnp.tanh(d @ next(leaf for leaf in leaves if leaf.ndim == 2)) * sum(jnp.sum(leaf) for leaf in leaves)
        return jnp.sum(out**2) if scalar else out

    batch = di.Constant(data)
    tangent = {"hvp": x, "jvp": x, "vjp": f(x, data)}.get(operator)
    args = (x,) if tangent is None else (x, optree.tree_map(jnp.ones_like, tangent))
    op = getattr(di, operator)
    expected = op(f, di.AutoJAX(jit=False), *args, batch)
    for backend in ("jax", di.AutoJAX()):
        prep = getattr(di, f"prepare_{operator}")(f, backend, *args, batch)
        assert prep.plan.jit is not None
        got = op(f, backend, *args, batch, prep=prep)
        assert_tree_close(got, expected, rtol=1e-5, atol=1e-5)
        assert optree.tree_structure(got) == optree.tree_structure(expected)
        calls = _python_calls(lambda: op(f, backend, *args, batch, prep=prep))  # noqa: B023
        assert calls[:3] == [operator, "evaluate", "run"] and "leaves" not in calls, calls
        if operator in ("gradient", "hvp") or (operator == "jvp" and shape == "one array"):
            # (the second prep is the first one, from the cache: its backend is an equal object;
            # arguments holding a tree are taken apart by one function written for their structure)
            written = [] if shape == "one array" else ["flatten"]
            assert calls == [operator, "evaluate", "run", *written], calls


def test_a_bound_method_is_served_by_jax_tier_and_another_instance_is_not() -> None:
    """A bound method is made anew on each read (``model.loss is not model.loss``): jax's tier
    compares its instance and function, so a prepared call on it enters the operator, the route
    and the program's ``run`` (and the functions written for its trees) only, and the same
    method of another instance is refused, naming f."""
    require(di.AutoJAX())

    class Model:
        def __init__(self, scale: float) -> None:
            self.scale = scale

        def loss(self, p: Any, batch: Any) -> Any:
            return _tree_loss(p, batch) * self.scale

    p, batch = _tree(4)
    model = Model(2.0)
    prep = di.prepare_gradient(model.loss, "jax", p, di.Constant(batch))
    got = di.gradient(model.loss, "jax", p, di.Constant(batch), prep=prep)
    expected = di.gradient(_tree_loss, "jax", p, di.Constant(batch))
    assert_tree_close(got, optree.tree_map(lambda v: 2 * v, expected), rtol=1e-5, atol=1e-5)
    constant = di.Constant(batch)
    calls = _python_calls(lambda: di.gradient(model.loss, "jax", p, constant, prep=prep))
    # (x and the batch taken apart, and the gradient rebuilt in the caller's key order, by the
    # functions written for the structures, see _flatten)
    assert calls == ["gradient", "evaluate", "run", "flatten", "unflatten"], calls
    with pytest.raises(di.PreparationMismatchError, match="f"):
        di.gradient(Model(3.0).loss, "jax", p, di.Constant(batch), prep=prep)


def test_the_inline_steps_refuse_what_the_plan_refuses() -> None:
    """jax's tier (JitProgram.run) compares the structure and each leaf's type; jit's trace the
    shapes and dtypes: every call the plan's own steps refuse is refused, naming the difference,
    and an unprepared call never reuses a program f's closure has outgrown."""
    require(di.AutoJAX())
    import jax.numpy as jnp

    p, batch = _tree(4)
    prep = di.prepare_gradient(_tree_loss, "jax", p, di.Constant(batch))
    assert prep.plan.jit is not None
    numpy_leaf = {"w": np.asarray(p["w"]), "b": p["b"]}
    with pytest.raises(di.PreparationMismatchError, match="x"):
        di.gradient(_tree_loss, "jax", numpy_leaf, di.Constant(batch), prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="context"):
        di.gradient(_tree_loss, "jax", p, di.Cache(batch), prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="context"):
        di.gradient(_tree_loss, "jax", p, di.Constant({**batch, "x": batch["x"][:, :2]}), prep=prep)
    with pytest.raises(di.PreparationMismatchError):
        di.gradient(_tree_loss, "jax", {"w": p["w"], "b": p["b"].astype(jnp.bfloat16)}, di.Constant(batch), prep=prep)
    with pytest.raises(di.PreparationMismatchError):
        di.gradient(_tree_loss, "torch", p, di.Constant(batch), prep=prep)
    with pytest.raises(di.ContextError):
        di.gradient(_tree_loss, "jax", p, batch, prep=prep)  # (a bare context)
    with pytest.raises(di.PreparationMismatchError, match="x"):  # (as many keys, another one)
        di.gradient(_tree_loss, "jax", {"w": p["w"], "c": p["b"]}, di.Constant(batch), prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="context"):
        di.gradient(_tree_loss, "jax", p, di.Constant(batch), di.Constant(batch), prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="backend"):  # (another field)
        di.gradient(_tree_loss, di.AutoJAX(jit=False), p, di.Constant(batch), prep=prep)
    with pytest.raises(di.PreparationMismatchError, match="operator"):
        di.value_and_gradient(_tree_loss, "jax", p, di.Constant(batch), prep=prep)
    with pytest.raises(di.InvalidInputError, match="has_aux"):
        di.gradient(_tree_loss, "jax", p, di.Constant(batch), prep=prep, has_aux=True)
    with pytest.raises(di.PreparationMismatchError, match="f"):
        di.gradient(lambda q, d: _tree_loss(q, d), "jax", p, di.Constant(batch), prep=prep)
    # a node the steps are not written for (a namedtuple): jax's flattening, then the same tests
    import collections

    Pair = collections.namedtuple("Pair", "w b")

    def pair_f(q: Any, d: Any) -> Any:
        return _tree_loss(q._asdict(), d)

    pair_prep = di.prepare_gradient(pair_f, "jax", Pair(p["w"], p["b"]), di.Constant(batch))
    assert pair_prep.plan.jit is not None
    got = di.gradient(pair_f, "jax", Pair(p["w"], p["b"]), di.Constant(batch), prep=pair_prep)
    assert type(got) is Pair
    assert_tree_close(got._asdict(), di.gradient(_tree_loss, "jax", p, di.Constant(batch)), rtol=1e-6, atol=1e-6)
    with pytest.raises(di.PreparationMismatchError, match="x"):
        di.gradient(pair_f, "jax", (p["w"], p["b"]), di.Constant(batch), prep=pair_prep)
    assert_tree_close(  # an equal backend object is the prep's backend
        di.gradient(_tree_loss, di.AutoJAX(), p, di.Constant(batch), prep=prep),
        di.gradient(_tree_loss, di.AutoJAX(jit=False), p, di.Constant(batch)),
        rtol=1e-5,
        atol=1e-5,
    )
    # numpy leaves: their shapes and dtypes compared inline (jit gives float32 and float64 numpy
    # arrays the same traced type while x64 is off)
    as_numpy = optree.tree_map(np.asarray, batch)
    numpy_prep = di.prepare_gradient(_tree_loss, "jax", p, di.Constant(as_numpy))
    assert numpy_prep.plan.jit is not None and len(numpy_prep.plan.jit.numpy_leaves) == 2
    served = di.gradient(_tree_loss, "jax", p, di.Constant(as_numpy), prep=numpy_prep)
    assert_tree_close(served, di.gradient(_tree_loss, "jax", p, di.Constant(batch)), rtol=1e-6, atol=1e-6)
    numpy_batch = di.Constant(as_numpy)
    calls = _python_calls(lambda: di.gradient(_tree_loss, "jax", p, numpy_batch, prep=numpy_prep))
    assert calls[:2] == ["gradient", "evaluate"] and "leaves" not in calls, calls
    for other in (
        {**as_numpy, "y": as_numpy["y"].astype(np.float64)},
        {**as_numpy, "x": as_numpy["x"][:2]},
        {**as_numpy, "y": batch["y"]},  # (a jax array where a numpy one was prepared)
    ):
        with pytest.raises(di.PreparationMismatchError, match="context"):
            di.gradient(_tree_loss, "jax", p, di.Constant(other), prep=numpy_prep)

    # unprepared: f reads a closed-over scale; a new value is a new program, never the old one
    scale = jnp.asarray(1.0)

    def scaled(q: Any, d: Any) -> Any:
        return _tree_loss(q, d) * scale

    first = di.gradient(scaled, "jax", p, di.Constant(batch))
    assert di.gradient(scaled, "jax", p, di.Constant(batch))["w"] is not first["w"]  # (served again)
    scale = jnp.asarray(2.0)
    second = di.gradient(scaled, "jax", p, di.Constant(batch))
    assert_tree_close(second, optree.tree_map(lambda v: 2 * v, first), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("operator", ["jacobian", "hessian", "jvp"])
def test_a_compiled_tree_result_that_needs_only_rebuilding_is_rebuilt_without_the_finisher(operator: str) -> None:
    """Where x's leaves are jax arrays, jit's results need no conversion: they are rebuilt into
    the trees of x and of f's output with no frame per block (JitProgram). Mixed dtypes too: the
    blocks of a Jacobian or Hessian are cast to the promoted dtype inside the trace. Where the
    finisher converts a block (numpy x), it runs on every call. The results, and their dtypes,
    equal those without jit, call after call."""
    require(di.AutoJAX())
    import jax.numpy as jnp

    def f(p: Any, d: Any) -> Any:
        out = {"h": jnp.tanh(d @ p[0]) * jnp.sum(p[1]).astype(jnp.float32), "s": (jnp.sum(p[0] ** 2),)}
        return out["h"].sum() ** 2 + out["s"][0] if operator == "hessian" else out

    rng = np.random.default_rng(1)
    data = di.Constant(jnp.asarray(rng.normal(size=(4, 3)), jnp.float32))
    same = (jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), jnp.asarray(rng.normal(size=2), jnp.float32))
    mixed = (same[0], same[1].astype(jnp.bfloat16))
    as_numpy = tuple(np.asarray(leaf) for leaf in same)
    op = getattr(di, operator)
    # (a jvp's blocks are shaped and typed as f's output: mixed dtypes of x cast none of them)
    for x, settles in ((same, True), (mixed, True), (as_numpy, False)):
        args = (x, x) if operator == "jvp" else (x,)
        prep = getattr(di, f"prepare_{operator}")(f, "jax", *args, data)
        expected = op(f, di.AutoJAX(jit=False), *args, data)
        for _ in range(3):
            got = op(f, "jax", *args, data, prep=prep)
            assert optree.tree_structure(got) == optree.tree_structure(expected)
            for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected), strict=True):
                assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
            assert_tree_close(got, expected, rtol=1e-2 if x is mixed else 1e-5, atol=1e-2 if x is mixed else 1e-5)
        calls = _python_calls(lambda: op(f, "jax", *args, data, prep=prep))  # noqa: B023
        # (jax arrays: the result is rebuilt by the functions written for the structures of x
        # and of f's output, see _flatten; numpy leaves take the finisher's frames)
        assert (calls[:3] == [operator, "evaluate", "run"]) is settles, calls  # (numpy x: the plan's steps)
        assert ("convert" not in calls and "block" not in calls) is settles, calls


def test_a_float64_prep_under_x64_runs_inline_and_keeps_float64_when_x64_is_off() -> None:
    """A float64 prep made with jax's x64 on runs in jax's tier while it stays on (the flag read
    in C by the adapter's ``scope``), and, with x64 off, in the x64 scope: float64 either way."""
    require(di.AutoJAX())
    import jax
    import jax.numpy as jnp

    def f(x: Any, c: Any) -> Any:
        return jnp.sum(jnp.sin(x) * c)

    with jax.enable_x64(True):
        x, c = jnp.linspace(0.1, 1.0, 10), di.Constant(jnp.linspace(1.0, 2.0, 10))
        prep = di.prepare_gradient(f, "jax", x, c)
        assert prep.plan.jit is not None and prep.plan.jit.scope is not None
        inside = di.gradient(f, "jax", x, c, prep=prep)
        calls = _python_calls(lambda: di.gradient(f, "jax", x, c, prep=prep))
        assert calls == ["gradient", "evaluate", "run", "scope"], calls
    outside = di.gradient(f, "jax", x, c, prep=prep)
    assert inside.dtype == outside.dtype == np.float64
    np.testing.assert_allclose(np.asarray(outside), np.cos(np.asarray(x)) * np.asarray(c.value), rtol=1e-14)
    np.testing.assert_allclose(np.asarray(inside), np.asarray(outside), rtol=1e-14)


def test_a_structure_of_tuples_lists_and_dicts_is_flattened_by_a_function_written_for_it() -> None:
    """The function written for a structure (:mod:`diffiface._flatten`) gives the leaves and
    structure optree gives, for any tree of that structure; for a tree of any other one, a
    structure unequal to the prepared one from either side of ``==`` and ``!=`` (jax's among
    them); and none is written for nodes it does not know, for one leaf or a huge tree."""
    import collections

    from diffiface._flatten import structure_flatten
    from diffiface._plan import optree_flatten

    flatten = optree_flatten()
    tree = {"b": (np.ones(2), None, [np.zeros(3), 1.5]), "a": {"z": np.ones(1), 3: np.ones(4)}}
    spec = flatten(tree)[1]
    written = structure_flatten(spec, spec, tree, flatten)
    assert written is not None
    for same in (tree, optree.tree_map(lambda leaf: leaf * 2, tree)):
        got, key = written(same)
        want, want_key = flatten(same)
        assert key is spec and want_key == spec
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want, strict=True))
    others = {
        "extra key": {**tree, "c": np.ones(1)},
        "other key": {"b": tree["b"], "A": tree["a"]},
        "list for tuple": {**tree, "b": list(tree["b"])},
        "leaf for None": {**tree, "b": (np.ones(2), np.ones(2), [np.zeros(3), 1.5])},
        "shorter list": {**tree, "b": (np.ones(2), None, [np.zeros(3)])},
        "leaf for node": {**tree, "a": np.ones(2)},
        "ordered dict": collections.OrderedDict(tree),
        "not a tree": None,
    }
    structures = [spec]
    jax = sys.modules.get("jax") or pytest.importorskip("jax")
    structures.append(jax.tree_util.tree_structure([1, (2,)]))
    for name, other in others.items():
        got, key = written(other)
        assert got is None, name
        for structure in structures:
            assert (key == structure) is False and (key != structure) is True, name
            assert (structure == key) is False, name
    assert structure_flatten(spec, spec, {"b": tree["b"]}, flatten) is None  # (not the prepared tree)
    pair = collections.namedtuple("pair", ["a", "b"])
    for unknown in (
        pair(np.ones(1), np.ones(2)),
        {"x": collections.OrderedDict(a=np.ones(1))},
        {(1, 2): np.ones(1)},
        [np.ones(1)] * 300,
    ):
        spec = flatten(unknown)[1]
        assert structure_flatten(spec, spec, unknown, flatten) is None, type(unknown)
    leaf = np.ones(2)
    assert structure_flatten(flatten(leaf)[1], flatten(leaf)[1], leaf, flatten) is None


def test_a_structure_of_tuples_lists_and_dicts_is_rebuilt_by_a_function_written_for_it() -> None:
    """The function written to rebuild a structure (:func:`diffiface._flatten.structure_unflatten`)
    builds what optree's ``unflatten`` builds: the same nodes, dict keys in the order the
    structure keeps (not sorted), the leaves themselves; none is written for other nodes."""
    import collections

    from diffiface._flatten import structure_unflatten

    tree = {"z": {"w": 1.0, "b": 2.0}, "a": (3.0, None, [4.0, ()]), 5: {}}
    leaves, spec = optree.tree_flatten(tree)
    rebuild = structure_unflatten(spec)
    assert rebuild is not None
    fresh = [np.ones(1) * i for i in range(len(leaves))]
    built, expected = rebuild(fresh), spec.unflatten(fresh)
    assert optree.tree_structure(built) == optree.tree_structure(expected)
    assert list(built) == list(expected) == ["z", "a", 5] and list(built["z"]) == ["w", "b"]
    assert type(built["a"]) is tuple and type(built["a"][2]) is list and built["a"][1] is None
    assert all(a is b for a, b in zip(optree.tree_leaves(built), fresh, strict=True))
    # a namedtuple and an OrderedDict too, called by their classes (optree's C rebuild is one
    # torch.compile cannot trace: compiled torch rebuilds x with this function)
    pair = collections.namedtuple("pair", ["a", "b"])
    empty = collections.namedtuple("empty", [])
    tree = {"p": pair(1.0, [2.0]), "o": collections.OrderedDict(b=3.0, a=4.0), "e": empty(), "t": (5.0,)}
    leaves, spec = optree.tree_flatten(tree)
    rebuild = structure_unflatten(spec)
    assert rebuild is not None
    fresh = [np.ones(1) * i for i in range(len(leaves))]
    built = rebuild(fresh)
    assert built == spec.unflatten(fresh) and list(built) == ["p", "o", "e", "t"]
    assert type(built["p"]) is pair and type(built["o"]) is collections.OrderedDict and list(built["o"]) == ["b", "a"]
    assert type(built["e"]) is empty and type(built["t"]) is tuple
    assert all(a is b for a, b in zip(optree.tree_leaves(built), fresh, strict=True))
    many = optree.tree_structure([1.0] * 300)
    assert structure_unflatten(many) is None and structure_unflatten(many, largest=None) is not None
    for unknown in (collections.defaultdict(list, a=1.0), collections.deque([1.0]), 1.0):
        assert structure_unflatten(optree.tree_structure(unknown)) is None, type(unknown)


def test_a_tree_jax_cannot_take_apart_is_refused_by_the_plan_not_raised_raw() -> None:
    """A prep flattened by jax's pytrees (a namedtuple holds its dict, so no function is
    written for the structure) meets a dict whose keys jax cannot sort: the plan's steps name
    the difference (PreparationMismatchError), and the call without the prep is served."""
    require(di.AutoJAX())
    import collections

    import jax.numpy as jnp

    pair = collections.namedtuple("pair", ["a", "b"])

    def total(p: Any) -> Any:
        return sum((leaf**2).sum() for leaf in optree.tree_leaves(p))

    x = pair(jnp.ones(2), {"u": jnp.ones(1), "v": jnp.ones(1)})
    mixed = pair(jnp.ones(2), {"u": jnp.ones(1), 1: jnp.ones(1)})
    for backend in ("jax", di.AutoJAX(jit=False)):
        prep = di.prepare_gradient(total, backend, x)
        with pytest.raises(di.PreparationMismatchError, match="x structure"):
            di.gradient(total, backend, mixed, prep=prep)
        got = di.gradient(total, backend, mixed)
        assert type(got) is pair and float(got.b[1][0]) == 2.0


@pytest.mark.parametrize("mode", ["autograd", "func"])
def test_a_module_constant_is_known_by_its_type_on_the_plans_path(mode: str) -> None:
    """A context leaf that is no array (a torch module passed as di.Constant) is known by its
    type, as the signature knows it: the prepared call takes the plan's path, not the whole
    signature's; a module of another type is still refused."""
    torch = pytest.importorskip("torch")
    backend = di.AutoTorch(mode=mode)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch = torch.randn(5, 3, dtype=torch.float64)

    def loss(p: Any, module: Any, inputs: Any) -> Any:
        return torch.func.functional_call(module, p, (inputs,)).sum()

    contexts = (di.Constant(model), di.Constant(batch))
    prep = di.prepare_gradient(loss, backend, params, *contexts)
    found = prep.plan.leaves("gradient", loss, backend, params, None, contexts, False)
    assert found is not None
    assert found[2][0] == [model]
    grads = di.gradient(loss, backend, params, *contexts, prep=prep)
    expected = torch.func.grad(loss)(params, model, batch)
    for name in params:
        torch.testing.assert_close(grads[name], expected[name])
    other = torch.nn.Linear(3, 1).double()
    assert prep.plan.leaves("gradient", loss, backend, params, None, (di.Constant(other), contexts[1]), False) is None
    with pytest.raises(di.PreparationMismatchError):
        di.gradient(loss, backend, params, di.Constant(other), contexts[1], prep=prep)


def test_a_leaf_of_a_kind_without_a_family_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan knows a leaf by its family's test of shape and dtype; a kind no family has (a new
    framework not yet given one) is refused, naming the kind, never known by its type alone
    (which would let a later call of another shape or dtype fit)."""
    from diffiface import _arrays, _plan

    monkeypatch.setattr(_arrays, "kind", lambda leaf: "theano")
    with pytest.raises(di.UnsupportedOperationError, match="theano"):
        _plan.leaf_check(np.zeros(3))
