"""Smoke test of benchmark_differentiation: row structure and call counts, never wall-clock."""

import functools

import numpy as np
import pytest

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
        expected = 2 * n + 1 if row["backend"] == "finite_differences" else n + 1  # (f(x) first: central too)
        assert row["calls_of_f"] == expected, row


def test_operator_filter_and_counter():
    scenario = Scenario("cube5", _f, np.ones(5), "gradient", reference=3 * np.ones(5))
    assert benchmark_differentiation(["finite_differences"], [scenario], operators=["jacobian"]) == []
    counted = CountingFunction(_f)
    counted(np.ones(2))
    counted(np.ones(2))
    assert counted.calls == 2


def _run_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
    spec = importlib.util.spec_from_file_location("_benchmarks_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_goal_rows_judge_each_gradient_against_its_goal():
    run = _run_module()
    mlp = f"mlp-{run.MLP_SIZE}"

    def row(scenario, prepared, ratio, operator="gradient"):
        return {"backend": "b", "scenario": scenario, "operator": operator, "prepared": prepared, "ratio": ratio}

    rows = run.goal_rows(
        [
            row("tiny-10", True, 1.19),
            row("tiny-10", False, 3.0),  # unprepared tiny calls have no goal
            row(mlp, True, 1.06),
            row(mlp, False, 1.49),
            row(mlp, True, 2.0, operator="hvp"),  # the goals are on gradients
            row(mlp, True, None),  # no native call to compare with
        ]
    )
    assert [(r["scenario"], r["prepared"], r["goal"], r["met"]) for r in rows] == [
        ("tiny-10", True, 1.2, "yes"),
        (mlp, True, 1.05, "no (+1.0%)"),
        (mlp, False, 1.5, "yes"),
    ]


def test_shape_goal_by_size_operator_and_preparation():
    run = _run_module()
    assert run.shape_goal("mlp", "gradient", True) == 1.05
    assert run.shape_goal("mlp", "gradient", False) == 1.10
    assert run.shape_goal("10-input", "gradient", True) == 1.25
    assert run.shape_goal("10-input", "gradient", False) is None
    assert run.shape_goal("mlp", "hvp", True) is None


def test_shape_table_pivots_gradient_ratios_by_shape_and_backend():
    run = _run_module()

    def row(backend, shape, prepared, ratio, size="mlp", operator="gradient"):
        return {
            "backend": backend,
            "shape": shape,
            "size": size,
            "operator": operator,
            "prepared": prepared,
            "ratio": ratio,
        }

    rows = [
        row("torch", "dict", True, 1.031),
        row("jax", "flat", True, 1.004),
        row("jax", "flat", False, 1.087),
        row("jax", "flax", True, 1.2),
        row("jax", "dict", True, 9.0, size="10-input"),  # another size: not in this table
        row("torch", "flat", True, 3.0, operator="hvp"),  # not a gradient
        row("torch", "flat", True, None),  # failed: no ratio
    ]
    lines, keys = run.shape_table(rows, "mlp")
    assert keys == ["shape", "jax", "torch"]
    assert lines == [
        {"shape": "flat", "jax": "1.00 (1.09)", "torch": "-"},
        {"shape": "dict", "jax": "-", "torch": "1.03"},
        {"shape": "flax", "jax": "1.20", "torch": "-"},
    ]


def test_floor_table_divides_each_torch_operator_by_its_wrappers():
    run = _run_module()

    def row(backend, ratio, variant=None, shape="tuple", operator="gradient", prepared=True):
        base = {"backend": backend, "shape": shape, "size": "mlp", "operator": operator, "prepared": prepared}
        return {**base, "ratio": ratio, **({"variant": variant} if variant else {})}

    rows = [
        row("torch", 1.16),
        row("torch", 1.10, "floor: a wrapper that copies x once"),
        row("torch", 1.16, "floor: a wrapper that keeps the contract"),
        row("torch", 1.12, "floor: a wrapper that copies x once", shape="dict"),  # another shape's floor
        row("torch", 1.3, prepared=False),  # unprepared: no floor
        row("torch", 1.2, operator="vjp"),  # a vjp: its copy-once floor, no contract floor
        row("torch", 1.15, "floor: a wrapper that copies x once", operator="vjp"),
        row("torch", 2.0, operator="jacobian"),  # a Jacobian: its contract floor only
        row("torch", 1.6, "floor: a wrapper that keeps the contract", operator="jacobian"),
        row("torch", 3.0, operator="jvp", prepared=None),  # no prepared flag: not in the table
        {**row("torch", 1.1, "floor: a wrapper that copies x once", shape="flat"), "over_floor": 0.98},
        row("torch", 1.2, shape="flat"),  # timed against its floor itself: that ratio, not 1.2 / 1.1
        row("torch-func", 1.2),  # no floor timed: None
        row("jax", 1.01),  # not torch
    ]
    assert run.floor_table(rows) == [
        {
            "backend": "torch",
            "shape": "tuple",
            "size": "mlp",
            "operator": "gradient",
            "diffiface": 1.16,
            "copy-once wrapper": 1.10,
            "diffiface / it (goal 1.05)": 1.055,
            "contract wrapper": 1.16,
            "diffiface / it": 1.0,
        },
        {
            "backend": "torch",
            "shape": "tuple",
            "size": "mlp",
            "operator": "vjp",
            "diffiface": 1.2,
            "copy-once wrapper": 1.15,
            "diffiface / it (goal 1.05)": 1.043,
            "contract wrapper": None,
            "diffiface / it": None,
        },
        {
            "backend": "torch",
            "shape": "tuple",
            "size": "mlp",
            "operator": "jacobian",
            "diffiface": 2.0,
            "copy-once wrapper": None,
            "diffiface / it (goal 1.05)": None,
            "contract wrapper": 1.6,
            "diffiface / it": 1.25,
        },
        {
            "backend": "torch",
            "shape": "flat",
            "size": "mlp",
            "operator": "gradient",
            "diffiface": 1.2,
            "copy-once wrapper": 1.1,
            "diffiface / it (goal 1.05)": 0.98,
            "contract wrapper": None,
            "diffiface / it": None,
        },
        {
            "backend": "torch-func",
            "shape": "tuple",
            "size": "mlp",
            "operator": "gradient",
            "diffiface": 1.2,
            "copy-once wrapper": None,
            "diffiface / it (goal 1.05)": None,
            "contract wrapper": None,
            "diffiface / it": None,
        },
    ]


def test_contract_wrapper_agrees_with_torch_and_refuses_a_write():
    """The torch floor that keeps the contract computes torch's gradient, and it is not a floor
    that skips the work: a write into a Constant is seen by its version counters."""
    torch = pytest.importorskip("torch")
    run = _run_module()
    rng = np.random.default_rng(0)
    for name in ("torch", "torch-func"):
        case = next(c for c in run.shape_cases(name, rng) if c["shape"] == "tuple")
        base = {"backend": name, "shape": "tuple", "size": "mlp"}
        row = run._clone_once_row(name, case, base, case["loss"], (case["x"],), rounds=2, contract=True)
        assert row["variant"] == "floor: a wrapper that keeps the contract"
        assert row["check"] == "same" and row["ratio"] > 0

        def writes(wb, xy):
            with torch.no_grad():
                xy[0].add_(1.0)  # into the Constant's copy
            return run.tuple_loss(wb, xy)

        before = case["ctx"][0][0].clone()
        with pytest.raises(ValueError, match="wrote"):
            run._clone_once_row(name, case, base, writes, (case["x"],), rounds=1, contract=True)
        assert torch.equal(case["ctx"][0][0], before)  # the caller's tensor: unchanged


def test_copy_once_jvp_wrapper_is_the_engines_forward_mode():
    """The torch jvp floor computes the engine's jvp (forward mode's duals in autograd mode,
    torch.func.jvp in torch.func mode), the same values as the native call it is timed against;
    the contract wrapper's jvp and hvp too, and they see a write into a Constant's copy."""
    torch = pytest.importorskip("torch")
    run = _run_module()
    for name in ("torch", "torch-func"):
        case = next(c for c in run.shape_cases(name, np.random.default_rng(0)) if c["shape"] == "dict")
        base = {"backend": name, "shape": "dict", "size": "mlp"}
        args = (case["x"], case["tx"])
        row = run._clone_once_row(name, case, base, case["head"], args, rounds=2, op="jvp")
        assert row["variant"] == "floor: a wrapper that copies x once" and row["operator"] == "jvp"
        assert row["check"] == "same" and row["ratio"] > 0
        for op, f in (("jvp", case["head"]), ("hvp", case["loss"])):
            row = run._clone_once_row(name, case, base, f, args, rounds=1, op=op, contract=True)
            assert row["check"] == "same"

            def writes(params, batch, f=f):
                batch["x"].mul_(2.0)  # into the Constant's copy
                return f(params, batch)

            before = case["ctx"][0]["x"].clone()
            # (the wrapper's version counters see it; torch.func refuses it before writing)
            with pytest.raises((ValueError, RuntimeError), match=r"wrote|mutate a captured"):
                run._clone_once_row(name, case, base, writes, args, rounds=1, op=op, contract=True)
            assert torch.equal(case["ctx"][0]["x"], before)  # the caller's tensor: unchanged


def test_jacobian_and_hessian_wrappers_are_the_native_calls_on_copies():
    """The torch Jacobian and Hessian floors compute what the native calls do (torch.func's
    jacrev and hessian built once, torch.autograd.functional's on x's leaves) on copies of x:
    the same values, and a write by f into x or a Constant is seen by the contract wrapper and
    leaves the caller's tensors unchanged."""
    torch = pytest.importorskip("torch")
    run = _run_module()
    for name in ("torch", "torch-func"):
        cases = run.shape_cases(name, np.random.default_rng(0))
        for op, size in (("jacobian", "mlp"), ("hessian", "10-input")):
            case = next(c for c in cases if c["shape"] == "tuple" and c["size"] == size)
            f = case["head"] if op == "jacobian" else case["loss"]
            base = {"backend": name, "shape": "tuple", "size": size}
            backend = run.backend(name)
            constants = [di.Constant(c) for c in case["ctx"]]
            prep = getattr(di, "prepare_" + op)(f, backend, case["x"], *constants)
            ours = functools.partial(getattr(di, op), f, backend, case["x"], *constants, prep=prep)
            for contract in (False, True):
                row = run._clone_once_row(name, case, base, f, (case["x"],), 1, op, contract, ours)
                assert row["operator"] == op and row["check"] == "same" and row["ratio"] > 0
                assert row["over_floor"] > 0  # diffiface timed against the wrapper itself

            def writes(x, *ctx, f=f):
                with torch.no_grad():
                    x[0].mul_(2.0)  # into x's copy
                return f(x, *ctx)

            before = case["x"][0].clone()
            with pytest.raises((ValueError, RuntimeError), match=r"wrote|mutate|in-place"):
                run._clone_once_row(name, case, base, writes, (case["x"],), rounds=1, op=op, contract=True)
            assert torch.equal(case["x"][0], before)


def test_contract_wrapper_checks_and_copies_the_tangent():
    """The contract floor compares the tangent or cotangent with the prepared one (a strict
    prep's signature holds it) and gives a jvp copies of the tangent: a write by f into x,
    which reaches the jvp's tangent, is seen and leaves the caller's tangent unchanged."""
    torch = pytest.importorskip("torch")
    optree = pytest.importorskip("optree")
    run = _run_module()
    case = next(c for c in run.shape_cases("torch", np.random.default_rng(0)) if c["shape"] == "dict")
    for op, f in (("jvp", case["head"]), ("vjp", case["head"]), ("hvp", case["loss"])):
        tangent = case["ty"] if op == "vjp" else case["tx"]
        wrapper = run.clone_once_wrapper("torch", case, f, op, contract=True, tangent=tangent)
        constants = [di.Constant(c) for c in case["ctx"]]
        wrapper(f, "torch", case["x"], tangent, *constants)
        if op == "vjp":
            other = tangent.double()
        else:
            other = {**tangent, "layer1": {**tangent["layer1"], "b": tangent["layer1"]["b"][:1]}}
        with pytest.raises(ValueError, match="not the prepared call"):
            wrapper(f, "torch", case["x"], other, *constants)

    def writes(params, batch):
        with torch.no_grad():
            params["layer1"]["b"].mul_(2.0)  # into the copy of x, whose tangent is the copy's
        return case["head"](params, batch)

    before = [t.clone() for t in optree.tree_leaves(case["tx"])]
    wrapper = run.clone_once_wrapper("torch", case, writes, "jvp", contract=True, tangent=case["tx"])
    with pytest.raises(ValueError, match="wrote"):
        wrapper(writes, "torch", case["x"], case["tx"], *[di.Constant(c) for c in case["ctx"]])
    assert all(map(torch.equal, optree.tree_leaves(case["tx"]), before))


def test_same_values_compares_leaves_across_container_kinds():
    run = _run_module()
    a = {"w": np.ones((2, 3)), "b": np.zeros(3)}
    assert run.same_values(a, {"b": np.zeros(3), "w": np.ones((2, 3))})  # optree sorts dict keys
    assert run.same_values((np.ones(2), np.zeros(1)), [np.ones(2), np.zeros(1)])
    assert not run.same_values((np.ones(2), np.zeros(1)), (np.ones(2), np.ones(1)))
    assert not run.same_values((np.ones(2),), (np.ones(2), np.ones(1)))
    assert not run.same_values(np.ones((2, 1)), np.ones((1, 2)))


def test_docs_quote_the_latest_main_job_measurement():
    """README.md and docs/testing.md give the main job's durations of benchmarks/results/main_job.json,
    with its date: a new measurement means new numbers in both."""
    import json
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    measured = json.loads((root / "benchmarks" / "results" / "main_job.json").read_text())
    date = measured["meta"]["date"][:10]
    quick, full = measured["main_job"]
    assert quick["job"].endswith("--quick") and not full["job"].endswith("--quick")
    for page in ("README.md", "docs/testing.md"):
        text = " ".join((root / page).read_text(encoding="utf-8").split())
        assert f"measured {date}" in text, page
        for row in (quick, full):
            assert f"{row['cpu_s']:.0f} CPU-seconds" in text, (page, row["job"])
            assert f"{row['checks']:,} checks" in text, (page, row["job"])


def _torch_users_module():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "torch_users.py"
    spec = importlib.util.spec_from_file_location("_benchmarks_torch_users", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up there)
    spec.loader.exec_module(module)
    return module


def test_torch_user_rows_give_the_native_gradients():
    """Every row of what torch users pass (Parameters, a 4 MB batch, detached parameters, the
    model as a Constant, a frozen backbone; autograd and torch.func mode) runs, one round of one
    call, and diffiface's gradient holds the values of the user's own call."""
    pytest.importorskip("torch")
    users = _torch_users_module()
    rows = users.rows(rounds=1, number=1)
    ways = {(r["row"], r["backend"]) for r in rows}
    assert ways >= {(row, b) for row in ("a", "a-f64", "b", "c", "d", "e", "e-recipe") for b in ("torch", "torch-func")}
    for row in rows:
        assert "note" not in row, row
        assert row["check"] == "same", row
        assert row["ratio"] > 0 and row["goal"] == users.GOALS.get(row["row"])
        if row["backend"].startswith("AutoTorch(create_graph=True)"):
            assert row["graph"] == "yes" and row["native graph"] == "yes", row


def test_torch_user_check_sees_a_wrong_gradient():
    """The rows' check is not a rubber stamp: a changed value, a missing key or another dtype
    is not the native gradient."""
    torch = pytest.importorskip("torch")
    users = _torch_users_module()
    theirs = {"w": torch.ones(3, 2), "b": torch.zeros(2)}
    assert users.same_gradient({"w": torch.ones(3, 2), "b": torch.zeros(2)}, theirs)
    wrong = torch.ones(3, 2)
    wrong[2, 1] = 1.01
    assert not users.same_gradient({"w": wrong, "b": torch.zeros(2)}, theirs)
    assert not users.same_gradient({"w": torch.ones(3, 2)}, theirs)
    assert not users.same_gradient({"w": torch.ones(3, 2, dtype=torch.float64), "b": torch.zeros(2)}, theirs)
    assert not users.same_gradient((torch.ones(3, 2), torch.zeros(2)), theirs)


def test_time_pair_alternates_which_call_runs_first():
    # expected: the native call first in even rounds, diffiface's first in odd ones (the second
    # of a pair runs a percent or two faster or slower than the first); before, always native first
    from diffiface.test._benchmark import time_pair

    log: list[str] = []
    time_pair(lambda: log.append("ours"), lambda: log.append("native"), rounds=4, number=1)
    rounds = log[2:]  # (after one untimed call of each)
    assert [rounds[i] for i in range(0, 8, 2)] == ["native", "ours", "native", "ours"]
    assert sorted(rounds) == ["native"] * 4 + ["ours"] * 4
