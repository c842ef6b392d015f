"""The bugs that lived between the routes the project had before one route served every call,
each as its reproduction: a sparse cache blind to static contexts, stale compiled programs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import require

import diffiface as di
from diffiface import _dispatch

# -- the bugs between the routes, each as its reproduction ----------------------------------------


def mode_map(v: Any, mode: Any) -> Any:
    return v**2 if mode == "diag" else v[::-1] ** 2


def sign_map(v: Any, s: Any) -> Any:
    return v**2 if s > 0 else v[::-1] ** 2


@pytest.mark.parametrize(("f", "first", "second"), [(mode_map, "diag", "flip"), (sign_map, 1.0, -1.0)])
@pytest.mark.parametrize("prepared", [False, True])
def test_the_sparse_cache_keys_on_the_values_of_static_contexts(
    f: Any, first: Any, second: Any, prepared: bool
) -> None:
    """A context f branches on changes the pattern: an unprepared call with another value gets
    its own pattern, and a prep made for one value refuses another, naming it."""
    backend = di.AutoSparse("finite_differences")
    x = np.linspace(0.5, 1.5, 4)
    diagonal = np.diag(2 * x)
    flipped = np.fliplr(np.diag(2 * x[::-1]))
    np.testing.assert_allclose(di.jacobian(f, backend, x, di.Constant(first)).toarray(), diagonal, atol=1e-6)
    if prepared:
        prep = di.prepare_jacobian(f, backend, x, di.Constant(first))
        with pytest.raises(di.PreparationMismatchError, match="context 0"):
            di.jacobian(f, backend, x, di.Constant(second), prep=prep)
    np.testing.assert_allclose(di.jacobian(f, backend, x, di.Constant(second)).toarray(), flipped, atol=1e-6)
    np.testing.assert_allclose(di.jacobian(f, backend, x, di.Constant(first)).toarray(), diagonal, atol=1e-6)


_weight = 1.0


def _global_weighted(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.sum(_weight * x**2)


def test_an_unprepared_call_is_never_stale_after_a_global_changes() -> None:
    """A compiled program bakes in what f reads: an unprepared call after a global f reads was
    rebound compiles anew instead of returning the old gradient."""
    require(di.AutoJAX())
    global _weight
    x = np.ones(3)
    try:
        _weight = 1.0
        np.testing.assert_allclose(di.gradient(_global_weighted, "jax", x), 2 * x)
        _weight = 3.0
        np.testing.assert_allclose(di.gradient(_global_weighted, "jax", x), 6 * x)
    finally:
        _weight = 1.0


def test_an_unprepared_call_is_never_stale_after_a_closed_over_value_changes() -> None:
    require(di.AutoJAX())
    import jax.numpy as jnp

    weight = 1.0
    scale = np.ones(3)

    def f(x: Any) -> Any:
        return jnp.sum(weight * scale * x**2)

    x = np.ones(3)
    np.testing.assert_allclose(di.gradient(f, "jax", x), 2 * x)
    weight = 2.0  # a closure cell rebound
    np.testing.assert_allclose(di.gradient(f, "jax", x), 4 * x)
    scale[0] = 5.0  # a closed-over numpy array written in place
    np.testing.assert_allclose(di.gradient(f, "jax", x), [20.0, 4.0, 4.0])


def test_an_unchanged_closure_reuses_its_program(monkeypatch: pytest.MonkeyPatch) -> None:
    require(di.AutoJAX())
    import jax.numpy as jnp

    scale = np.arange(3.0)

    def f(x: Any) -> Any:
        return jnp.sum(scale * x**2)

    di.gradient(f, "jax", np.ones(3))
    made = []
    original = _dispatch._prepare
    monkeypatch.setattr(_dispatch, "_prepare", lambda *a, **k: made.append(1) or original(*a, **k))
    for _ in range(3):
        np.testing.assert_allclose(di.gradient(f, "jax", np.ones(3)), 2 * scale)
    assert made == []


def test_the_closure_test_sees_every_change_to_what_f_reads() -> None:
    """``Closure.holds``, written for one function, and the general test both notice every change an unprepared call must notice: a global rebound,
    a name defined that was not (a builtin shadowed), a default, a closure cell rebound or
    emptied, a numpy array written in place; and nothing else (the same function, another
    function of the same code and reads, a bound method's function)."""
    from diffiface._prep import Closure

    namespace: dict[str, Any] = {"np": np, "table": np.arange(3.0), "scale": 2.0}
    exec(
        "def make(weight):\n"
        "    def f(x, power=2):\n"
        "        return len(x) * weight * scale * np.sum(table * x**power)\n"
        "    return f\n"
        "def make_late():\n"
        "    def g(x):\n"
        "        return late * x\n"
        "    late = 1.0\n"
        "    return g, lambda: g\n",
        namespace,
    )
    weight = 1.0
    f = namespace["make"](weight)
    written = Closure(f)
    assert written.holds != written._holds  # (settled for the function)

    class Both:
        """The settled test and the general one, which must agree."""

        def holds(self, g: Any) -> bool:
            found, general = written.holds(g), written._holds(g)
            assert found is general, g
            return bool(found)

    closure = Both()
    assert closure.holds(f)
    assert closure.holds(namespace["make"](weight))  # (another function: the same code, the same objects read)
    assert not closure.holds(namespace["make"](2.0))
    assert not closure.holds(lambda x: x)
    namespace["scale"] = 3.0  # a global rebound
    assert not closure.holds(f)
    namespace["scale"] = 2.0
    assert closure.holds(f)
    namespace["len"] = len  # a name f reads from the builtins, now a global
    assert not closure.holds(f)
    del namespace["len"]
    f.__defaults__ = (3,)  # another default
    assert not closure.holds(f)
    f.__defaults__ = (2,)
    assert closure.holds(f)  # (an equal small int is the same object)
    namespace["table"][0] = 7.0  # written in place
    assert not closure.holds(f)
    namespace["table"][0] = 0.0
    assert closure.holds(f)

    class Model:
        def loss(self, x: Any) -> Any:
            return np.sum(x)

    method = Model().loss
    assert Closure(method).holds(Model().loss)

    g, _ = namespace["make_late"]()
    late = Closure(g)
    assert late.holds(g)
    g.__closure__[0].cell_contents = 2.0  # a cell rebound
    assert not late.holds(g)
    del g.__closure__[0].cell_contents  # a cell emptied
    assert not late.holds(g)
