"""Smoke test of benchmark_differentiation: row structure and call counts, never wall-clock."""

import numpy as np

import diffiface as di
from diffiface.test import Scenario
from diffiface.test._benchmark import CountingFunction, benchmark_differentiation

KEYS = {
    "backend",
    "scenario",
    "operator",
    "prepared",
    "calls_of_f",
    "calls_first",
    "first_s",
    "median_s",
    "min_s",
    "native_s",
    "ratio",
}


def _f(x):
    return (x**3).sum()


def test_finite_difference_rows_and_counts():
    n = 5
    x = np.linspace(0.5, 1.5, n)
    scenario = Scenario("cube5", _f, x, "gradient", reference=3 * x**2)
    backends = [di.AutoFiniteDifferences(), di.AutoFiniteDifferences(method="forward")]
    rows = benchmark_differentiation(backends, [scenario], rounds=2, number=2)
    assert len(rows) == 4
    for row in rows:
        assert set(row) == KEYS
        assert row["scenario"] == "cube5" and row["operator"] == "gradient"
        assert isinstance(row["prepared"], bool)
        assert row["median_s"] >= row["min_s"] > 0
        assert row["native_s"] is None and row["ratio"] is None
    assert {(r["backend"], r["prepared"]) for r in rows} == {
        ("finite_differences", False),
        ("finite_differences", True),
        ("finite_differences-forward", False),
        ("finite_differences-forward", True),
    }
    for row in rows:
        expected = 2 * n if row["backend"] == "finite_differences" else n + 1
        assert row["calls_of_f"] == expected, row


def test_operator_filter_and_counter():
    scenario = Scenario("cube5", _f, np.ones(5), "gradient", reference=3 * np.ones(5))
    assert benchmark_differentiation(["finite_differences"], [scenario], operators=["jacobian"]) == []
    counted = CountingFunction(_f)
    counted(np.ones(2))
    counted(np.ones(2))
    assert counted.calls == 2
