"""diffiface.test: the bundled lists pass on every backend, and the suite catches what it exists
to catch (a wrong custom derivative, a mutated state, a global random generator)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import diffiface as di
from diffiface.test import (
    Report,
    Scenario,
    assert_allclose,
    check_gradients,
    core_scenarios,
    layer_scenarios,
    parametrize,
    test_differentiation,
    torch_module_scenarios,
)

BACKENDS = [
    di.AutoFiniteDifferences(),
    di.AutoJAX(),
    di.AutoTorch(),
    di.AutoTorch(mode="func"),
    di.AutoAutograd(),
]


@parametrize(BACKENDS, core_scenarios(quick=True))
def test_core(backend, scenario):
    test_differentiation([backend], [scenario])


@parametrize(
    [*BACKENDS, di.AutoScipy()],
    [s for s in core_scenarios(dtypes=("float64",)) if "vector" in s.tags and "constant" in s.tags],
)
def test_core_vector_all_operators(backend, scenario):
    test_differentiation([backend], [scenario])


# the layer zoo needs array_api_compat (the "test" extra); without it the list is empty and
# pytest reports the test as skipped
LAYERS = layer_scenarios() if importlib.util.find_spec("array_api_compat") else []


@parametrize(BACKENDS, LAYERS)
def test_layers(backend, scenario):
    test_differentiation([backend], [scenario], prepared=(True,))


# -- the suite catches what it exists to catch --------------------------------------------------------


def test_wrong_jax_custom_jvp_is_caught():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")

    @jax.custom_jvp
    def square(x):
        return x**2

    @square.defjvp
    def square_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return x**2, 3 * x * t  # wrong: the derivative is 2x

    scenario = Scenario("wrong_custom_jvp", lambda x: jnp.sum(square(x)), np.linspace(0.5, 1.5, 4), "gradient")
    with pytest.raises(AssertionError, match="values differ"):
        test_differentiation([di.AutoJAX()], [scenario])
    report = test_differentiation([di.AutoFiniteDifferences()], [scenario])
    assert report.counts() == {"passed": 1}


def test_wrong_torch_autograd_function_is_caught():
    torch = pytest.importorskip("torch")

    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * 2 * x**2  # wrong: the derivative is 3x^2

    scenario = Scenario(
        "wrong_autograd_function",
        lambda x: Cube.apply(x).sum(),
        torch.linspace(0.5, 1.5, 4, dtype=torch.float64),
        "gradient",
        frameworks=frozenset({"torch"}),
    )
    report = test_differentiation([di.AutoTorch(), di.AutoFiniteDifferences()], [scenario], raise_on_failure=False)
    statuses = {row.backend: row.status for row in report.rows}
    assert statuses == {"torch": "failed", "finite_differences": "passed"}
    assert "values differ" in report.failed[0].message


def test_train_mode_batchnorm_as_constant_is_reported_as_mutation():
    pytest.importorskip("torch")
    mutating = [s for s in torch_module_scenarios(include_mutating=True) if "mutates_state" in s.tags]
    assert mutating, "the zoo must contain the train-mode BatchNorm module"
    report = test_differentiation([di.AutoTorch()], mutating, raise_on_failure=False, check_determinism=False)
    assert report.failed
    # diffiface itself refuses the call that updates the buffers, naming them
    assert "MutationError" in report.failed[0].message
    assert "running" in report.failed[0].message


def test_a_write_into_a_constant_is_a_mutation_and_leaves_the_callers_array():
    """The determinism check called f on the caller's own arrays: an f writing into its Constant
    was reported as drawing from a global random generator, and the caller's array was left
    changed. It runs on copies now: the write is the MutationError naming the Constant."""
    torch = pytest.importorskip("torch")
    for c, x, backend in (
        (torch.ones(3, dtype=torch.float64), torch.tensor([0.3, 0.7, -1.1], dtype=torch.float64), "torch"),
        (np.ones(3), np.array([0.3, 0.7, -1.1]), "finite_differences"),
    ):

        def f(v, c):
            c += 1.0
            return (v * c).sum()

        scenario = Scenario("writes", f, x, "gradient", contexts=(di.Constant(c),))
        with pytest.raises(
            AssertionError, match=r"MutationError: f wrote into the di\.Constant at position 1"
        ) as caught:
            test_differentiation([backend], [scenario])
        assert "not deterministic" not in str(caught.value)
        assert (np.asarray(c) == 1.0).all()


def test_global_random_generator_is_reported():
    rng = np.random.default_rng(0)

    def noisy(x):
        return float(rng.standard_normal()) * 1e-3 + (x**2).sum()

    scenario = Scenario("global_rng", noisy, np.ones(3), "gradient")
    with pytest.raises(AssertionError, match=r"global random generator.*di\.Constant"):
        test_differentiation([di.AutoFiniteDifferences()], [scenario])


def test_explicit_key_is_deterministic():
    def dropout(x, key):
        mask = np.random.default_rng(key).random(x.shape) > 0.5
        return (np.where(mask, x, 0.0) ** 2).sum()

    scenario = Scenario("explicit_key", dropout, np.linspace(0, 1, 6), "gradient", (di.Constant(7),))
    report = test_differentiation([di.AutoFiniteDifferences(), di.AutoAutograd()], [scenario], raise_on_failure=False)
    assert [row.status for row in report.rows if row.status != "skipped"] in (["passed", "passed"], ["passed"])


def test_broken_and_soft_fail_and_skip():
    bad = Scenario("bad", lambda x: (x**2).sum(), np.ones(2), "gradient", reference=np.array([1.0, 1.0]))
    report = test_differentiation(["finite_differences"], [bad], broken={"finite_differences": ["bad"]})
    assert report.counts() == {"xfailed": 1}
    good = Scenario("good", lambda x: (x**2).sum(), np.ones(2), "gradient", reference=np.array([2.0, 2.0]))
    report = test_differentiation(
        ["finite_differences"], [good], broken={"finite_differences": ["good"]}, raise_on_failure=False
    )
    assert report.counts() == {"xpassed": 1} and report.failed
    report = test_differentiation(["finite_differences"], [bad], soft_fail={"*": ["bad"]})
    assert report.counts() == {"soft_failed": 1}
    report = test_differentiation(["finite_differences"], [bad], skip={"finite_differences": ["*"]})
    assert report.counts() == {"skipped": 1}


def test_backends_that_check_nothing_are_refused_with_why():
    """Naming only backends that are not installed, or that cannot run the scenarios, checked
    nothing and passed: a CI test without them went green. It raises, saying what was skipped and
    why; a backend not installed beside one that runs is still reported as skipped."""
    pytest.importorskip("autograd")
    if importlib.util.find_spec("tensorflow") is not None:
        pytest.skip("needs tensorflow not installed")
    cube = Scenario("cube", lambda v: (v**3).sum(), np.array([0.5, -1.0]), "gradient")
    with pytest.raises(
        di.GradientCheckError, match=r'tensorflow is not installed: pip install "diffiface\[tensorflow\]"'
    ):
        test_differentiation(["tensorflow"], [cube])
    with pytest.raises(di.GradientCheckError, match=r"checked nothing.*tensorflow: not installed: pip install"):
        check_gradients(lambda v: (v**3).sum(), np.array([0.5, -1.0]), backends="tensorflow")
    report = test_differentiation(["tensorflow", "autograd"], [cube])
    assert [row.status for row in report.rows] == ["skipped", "passed"]
    report = check_gradients(lambda v: (v**3).sum(), np.array([0.5, -1.0]), backends=["tensorflow", "autograd"])
    assert [row.status for row in report.rows] == ["skipped", "passed"]
    torch = pytest.importorskip("torch")
    pytest.importorskip("jax")
    on_torch = _on_torch(torch)
    with pytest.raises(di.GradientCheckError, match="f is written for torch, not jax"):
        test_differentiation(["jax"], [on_torch])
    assert test_differentiation(["jax"], [on_torch], raise_on_failure=False).counts() == {"skipped": 1}


def _on_torch(torch: Any) -> Scenario:
    """A scenario whose f is written for torch (its x a torch tensor)."""
    return Scenario(
        "on_torch",
        lambda v: (v**3).sum(),
        torch.tensor([0.5, -1.0], dtype=torch.float64),
        "gradient",
        frameworks=frozenset({"torch"}),
    )


def test_parametrize_skips_the_pairs_that_cannot_be_checked():
    """test_differentiation refuses a pair that checks nothing: parametrize marks such pairs
    skipped, with the reason, as it does a backend that is not installed."""
    torch = pytest.importorskip("torch")
    on_torch = _on_torch(torch)
    params = parametrize(["jax", "torch"], [on_torch]).args[1]
    reasons = [[mark.kwargs["reason"] for mark in param.marks] for param in params]
    assert reasons == [["f is written for torch, not jax"], []]


def test_reference_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        Scenario("wrong_shape", lambda x: (x**2).sum(), np.ones(3), "gradient", reference=np.ones(2))
    with pytest.raises(ValueError, match="does not fit"):
        Scenario("wrong_jacobian", lambda x: x**2, np.ones(3), "jacobian", reference=np.ones(3))
    with pytest.raises(ValueError, match="unknown operator"):
        Scenario("bogus", lambda x: x, np.ones(3), "gradiant")


def test_analytic_reference():
    scenario = Scenario(
        "analytic", lambda x: np.sin(x).sum(), np.linspace(0, 1, 5), "gradient", reference=np.cos(np.linspace(0, 1, 5))
    )
    report = test_differentiation(["finite_differences", "autograd"], [scenario], raise_on_failure=False)
    assert all(row.status in ("passed", "skipped") for row in report.rows)


# -- assert_allclose ----------------------------------------------------------------------------------


def test_assert_allclose_names_path_index_and_errors():
    with pytest.raises(AssertionError) as info:
        assert_allclose({"a": [np.zeros(3)]}, {"a": [np.array([0.0, 0.5, 0.0])]})
    message = str(info.value)
    assert "['a'][0]" in message and "(1,)" in message and "abs error 0.5" in message


@pytest.mark.parametrize(
    ("actual", "expected", "match"),
    [
        ({"a": np.ones(2)}, {"b": np.ones(2)}, "structures differ"),
        (np.ones(2), np.ones(3), "shapes differ"),
        (np.ones(2, np.float32), np.ones(2), "dtypes differ"),
        (1.0, np.float64(1.0), "array types differ"),
        (np.array([np.nan]), np.array([0.0]), "values differ"),
    ],
    ids=["structure", "shape", "dtype", "array_type", "nan"],
)
def test_assert_allclose_checks_form_first(actual, expected, match):
    with pytest.raises(AssertionError, match=match):
        assert_allclose(actual, expected)


def test_assert_allclose_default_tolerances_by_dtype():
    assert_allclose(np.ones(2, np.float32), np.ones(2, np.float32) * (1 + 1e-5))
    with pytest.raises(AssertionError):
        assert_allclose(np.ones(2), np.ones(2) * (1 + 1e-5))
    assert_allclose(np.array([np.nan, np.inf]), np.array([np.nan, np.inf]))


# -- check_gradients ------------------------------------------------------------------------------------


def test_check_gradients_on_every_available_backend():
    report = check_gradients(lambda x, c: (c * np.tanh(x) ** 2).sum(), np.linspace(-1, 1, 7), di.Constant(1.5))
    assert report.rows and not report.failed


def test_check_gradients_catches_a_wrong_gradient():
    torch = pytest.importorskip("torch")

    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sin()

        @staticmethod
        def backward(ctx, grad):
            return grad  # wrong: cos(x)

    with pytest.raises(AssertionError, match="values differ"):
        check_gradients(lambda x: Wrong.apply(x).sum(), torch.linspace(0.1, 1, 5, dtype=torch.float64))


def test_check_gradients_uses_projections_for_large_models():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256)).double()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch = torch.randn(16, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    n = sum(p.numel() for p in params.values())
    assert n > 300_000

    def loss(params, model, batch):
        return (torch.func.functional_call(model, params, (batch,)) ** 2).mean()

    import time

    start = time.perf_counter()
    report = check_gradients(loss, params, di.Constant(model), di.Constant(batch))
    assert time.perf_counter() - start < 60  # the bound for a few hundred thousand parameters
    assert not report.failed
    assert all(p.grad is None for p in model.parameters())


# -- the main job ---------------------------------------------------------------------------------------


def test_main_job_runs_and_reports(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffiface.test",
            "--backends",
            "finite_differences,autograd",
            "--scenarios",
            "core",
            "--operators",
            "gradient,jvp",
            "--quick",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "finite_differences" in result.stdout and "passed" in result.stdout
    assert " 0 failed" in result.stdout


def test_main_job_fails_on_unknown_backend():
    result = subprocess.run(
        [sys.executable, "-m", "diffiface.test", "--backends", "nope"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "unknown backends" in result.stderr


def test_a_backend_is_not_its_own_reference():
    """Finite differences tested against a finite-difference reference are judged by scipy's
    adaptive differences instead: a bad step is caught, not compared with itself."""
    pytest.importorskip("scipy")
    coarse = di.AutoFiniteDifferences(step=0.5)
    scenario = Scenario(
        "coarse_step", lambda x: np.exp(x).sum(), np.linspace(0.0, 1.0, 4), "gradient", reference=coarse
    )
    report = test_differentiation([coarse], [scenario], raise_on_failure=False)
    assert report.counts() == {"failed": 1}
    assert "values differ" in report.failed[0].message


# -- check_gradients and test_differentiation: aux, references, precision, skips, warnings ---------


def _square_function():
    torch = pytest.importorskip("torch")

    class Square(torch.autograd.Function):  # the classic form: no setup_context
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**2

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    return torch, Square


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_check_gradients_has_aux_ignores_the_aux(framework):
    module = pytest.importorskip(framework)
    x = module.numpy.linspace(0.1, 1.0, 4) if framework == "jax" else module.linspace(0.1, 1.0, 4, dtype=module.float64)

    def loss(v):
        return (v**3).sum(), {"mean": v.mean(), "note": "state"}

    report = check_gradients(loss, x, has_aux=True)
    assert report.counts()["passed"] >= 1 and not report.failed


def test_check_gradients_has_aux_refuses_a_random_aux():
    rng = np.random.default_rng(0)
    with pytest.raises(AssertionError, match="not deterministic"):
        check_gradients(lambda v: ((v**2).sum(), rng.normal()), np.ones(3), backends=["autograd"], has_aux=True)


def test_every_row_names_its_reference():
    torch = pytest.importorskip("torch")
    report = check_gradients(lambda v: (v.sin() ** 2).sum(), torch.linspace(0, 1, 5, dtype=torch.float64))
    references = {row.backend: row.reference for row in report.rows}
    assert references == {
        "torch": "finite_differences",
        "torch-func": "finite_differences",
        "torch vs torch-func": "torch-func",
    }
    scenarios = [
        Scenario("fd", lambda v: (v**2).sum(), np.ones(2), "gradient"),
        Scenario("exact", lambda v: (v**2).sum(), np.ones(2), "gradient", reference=np.full(2, 2.0)),
        Scenario(
            "cross", lambda v: (v**2).sum(), np.ones(2), "gradient", reference="cross", frameworks=frozenset({"torch"})
        ),
    ]
    report = test_differentiation([di.AutoTorch()], scenarios)
    assert [row.reference for row in report.rows] == ["finite_differences", "analytic", "cross: torch-func"]
    table = report.table()
    assert "references" in table.splitlines()[0] and "cross: torch-func" in table


def test_finite_differences_named_as_the_suspect_when_engines_agree():
    """A coarse fixed step makes the finite differences wrong; torch's two modes agree with each
    other, so the failure says the finite differences may be at fault."""
    torch = pytest.importorskip("torch")
    x = torch.linspace(0.0, 1.0, 4, dtype=torch.float64)
    coarse = di.AutoFiniteDifferences(step=0.3)
    with pytest.raises(AssertionError, match="finite differences may be the side at fault") as info:
        check_gradients(lambda v: torch.sin(3 * v).sum(), x, reference=coarse)
    assert "agree with each other" in str(info.value)
    scenario = Scenario("coarse", lambda v: (3 * v).sin().sum(), x, "gradient", reference=coarse)
    report = test_differentiation([di.AutoTorch(), di.AutoTorch(mode="func")], [scenario], raise_on_failure=False)
    assert len(report.failed) == 2
    assert all("finite differences may be the side at fault" in row.message for row in report.failed)


def test_a_lone_failure_within_the_differences_noise_is_flagged():
    """scipy as the reference gives its own error estimate, quoted in the hint."""
    pytest.importorskip("scipy")
    with pytest.raises(AssertionError, match="scipy's error estimate") as info:
        check_gradients(
            lambda v: 1e4 * np.exp(v).sum(),
            np.linspace(0, 1, 3),
            backends=["autograd"],
            reference=di.AutoScipy(),
            atol=0.0,
            rtol=0.0,
        )
    assert "may be the side at fault" in str(info.value)


def test_float32_input_float64_ground_truth():
    """torch float32: the ground truth runs on float64 copies, so the float32 gradient is off
    by float32 rounding only (a float32 difference would be off by ~1e-3)."""
    torch = pytest.importorskip("torch")
    x = torch.linspace(0.1, 2.0, 6)
    report = check_gradients(lambda v: (v.exp() * v.sin()).sum(), x, backends=[di.AutoTorch()])
    (row,) = report.rows
    assert row.reference == "finite_differences (float64)"
    assert 0 < row.rel_error < 1e-6
    assert x.dtype == torch.float32


def test_projections_run_in_float64_for_a_float64_jax_model():
    """6000 float64 parameters of a jax model (x64 off): evaluated in float32, the projections'
    differences would be off by ~1; under the engines' x64 scope they are right."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    assert not jax.config.read("jax_enable_x64")
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        params = {"w": jnp.asarray(rng.normal(size=(200, 30))), "b": jnp.asarray(rng.normal(size=30))}
    data = di.Constant(rng.normal(size=(8, 200)))

    def loss(p, inputs):
        return jnp.sum(jnp.log(jnp.cosh(inputs @ p["w"] + p["b"][None, :]))) + 1e3

    report = check_gradients(loss, params, data, backends=[di.AutoJAX()])
    (row,) = report.rows
    assert row.status == "passed" and "random directions (float64)" in row.reference
    assert row.rel_error < 1e-7
    assert not jax.config.read("jax_enable_x64")


def test_typed_jax_key_in_a_context():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    key = di.Constant(jax.random.key(0))

    def noisy(v, k):
        return jnp.sum(v**2 * jax.random.uniform(k, v.shape, dtype=v.dtype))

    report = check_gradients(noisy, jnp.linspace(0.5, 1.0, 3), key)
    assert not report.failed and report.rows[0].status == "passed"
    scenario = Scenario(
        "typed_key", noisy, jnp.linspace(0.5, 1.0, 3), "gradient", (key,), frameworks=frozenset({"jax"})
    )
    assert test_differentiation([di.AutoJAX()], [scenario]).counts() == {"passed": 1}


def test_torch_func_refusing_a_classic_autograd_function_is_skipped():
    torch, square = _square_function()
    x = torch.linspace(0.5, 1.5, 3, dtype=torch.float64)
    report = check_gradients(lambda v: square.apply(v).sum(), x)
    status = {row.backend: (row.status, row.message) for row in report.rows}
    assert status["torch"][0] == "passed"
    assert status["torch-func"][0] == "skipped" and "setup_context" in status["torch-func"][1]
    scenario = Scenario(
        "classic_function", lambda v: square.apply(v).sum(), x, "gradient", frameworks=frozenset({"torch"})
    )
    report = test_differentiation([di.AutoTorch(), di.AutoTorch(mode="func")], [scenario])
    assert [row.status for row in report.rows] == ["passed", "skipped"]
    assert "skipped" in report.table().splitlines()[0] and "setup_context" in report.table()


def test_torch_func_refusal_is_a_diffiface_error():
    torch, square = _square_function()
    with pytest.raises(di.UnsupportedOperationError, match="setup_context"):
        di.gradient(lambda v: square.apply(v).sum(), di.AutoTorch(mode="func"), torch.ones(3, dtype=torch.float64))


def test_engine_warnings_are_apart_never_failures():
    """pytest runs with warnings as errors here: the warning is still collected, not raised."""
    import warnings

    def loud(v):
        warnings.warn("loud loss", RuntimeWarning, stacklevel=1)
        return (v**2).sum()

    report = check_gradients(loud, np.ones(3), backends=["autograd", "finite_differences"])
    assert not report.failed
    assert report.warnings == ["RuntimeWarning: loud loss"]
    assert report.summary().count("loud loss") == 1
    scenario = Scenario("loud", loud, np.ones(3), "gradient")
    report = test_differentiation([di.AutoAutograd()], [scenario])
    assert report.counts() == {"passed": 1} and report.warnings == ["RuntimeWarning: loud loss"]


def test_summaries_are_sentences():
    """No dangling colon when nothing failed; a failure is listed after a sentence that says so."""
    scenario = Scenario("square", lambda v: (v**2).sum(), np.ones(3), "gradient", reference=np.full(3, 2.0))
    wrong = Scenario("wrong", lambda v: (v**2).sum(), np.ones(3), "gradient", reference=np.full(3, 3.0))
    report = test_differentiation([di.AutoFiniteDifferences()], [scenario, scenario])
    assert report.summary() == "None of the 2 checks failed (2 passed)."
    assert Report().summary() == "No checks ran."
    report = test_differentiation([di.AutoFiniteDifferences()], [scenario, wrong], raise_on_failure=False)
    first, *failures = report.summary().splitlines()
    assert first == "1 of the 2 checks failed (1 passed); each failure, with its reference:"
    assert failures[0].startswith("- finite_differences on wrong (gradient) against analytic: failed: ")
    assert str(report).endswith(report.summary()) and str(report).startswith(report.table())
