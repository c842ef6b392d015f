"""diffiface.test: the bundled lists pass on every backend, and the suite catches what it exists
to catch (a wrong custom derivative, a mutated state, a global random generator)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

import diffiface as di
from diffiface.test import (
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
