"""An engine from another package joins through the ``diffiface.engines`` entry point.

tests/engines/diffiface_toy is such a package: a forward-mode dual-number engine in pure Python
whose adapter gives ``value_and_pushforward`` only. It is installed (offline, from a copy, so the
tree stays clean) into a folder of its own, and used in subprocesses that put that folder on
PYTHONPATH, where importlib.metadata finds its dist-info. Broken packages are written as bare
dist-info folders, which is all an entry point is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "tests" / "engines" / "diffiface_toy"


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("toy")
    source = work / "source"
    shutil.copytree(TOY, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = work / "site"
    # offline: no build isolation, so the build uses the setuptools of this environment (the
    # "test" extra brings it)
    installed = subprocess.run(
        [
            sys.executable,
            *("-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"),
            *("--target", str(site), str(source)),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert installed.returncode == 0, installed.stderr[-4000:]
    assert (site / "diffiface_toy-0.1.0.dist-info" / "entry_points.txt").is_file()
    return site


def _run(code: str, *sites: Path) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, sites), str(ROOT)])
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def _broken(tmp_path: Path, package: str, value: str, name: str = "broken") -> Path:
    """A folder holding only the dist-info of ``package``, whose entry point ``name`` is ``value``."""
    info = tmp_path / f"{package}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[diffiface.engines]\n{name} = {value}\n")
    return tmp_path


def test_toy_by_name_and_by_config(toy_site: Path) -> None:
    out = _run(
        """
        import sys
        import numpy as np
        import diffiface as di
        from diffiface import _adapters

        assert _adapters._found is None  # importing diffiface read no entry point
        x = np.array([0.3, 1.2, -0.7])
        f = lambda x: np.sum(np.sin(x) * x**2)
        di.gradient(f, "finite_differences", x)
        assert _adapters._found is None  # nor did a built-in engine's call
        assert "diffiface_toy" not in sys.modules
        by_name = di.gradient(f, "toy", x)
        import diffiface_toy
        by_config = di.gradient(f, diffiface_toy.AutoToy(), x)
        exact = np.cos(x) * x**2 + 2 * x * np.sin(x)
        assert np.allclose(by_name, exact, rtol=1e-14) and np.allclose(by_config, exact, rtol=1e-14)
        hessian = di.hessian(f, "toy", x)
        exact_h = np.diag((2 - x**2) * np.sin(x) + 4 * x * np.cos(x))
        assert np.allclose(hessian, exact_h, rtol=1e-13, atol=1e-15), hessian
        assert di.gradient(f, "toy", x.astype(np.float32)).dtype == np.float32
        toy = diffiface_toy.AutoToy()
        over = di.hessian(f, di.SecondOrder(di.AutoFiniteDifferences(), toy), x)
        assert np.allclose(over, exact_h, rtol=1e-6, atol=1e-6), over
        try:  # the pairings' table refuses what it cannot vouch for, naming the engine
            di.SecondOrder(di.AutoFiniteDifferences(method="complex"), toy)
            raise AssertionError("a complex step over the toy was taken")
        except di.UnsupportedOperationError as exc:
            assert "toy is not known to carry complex points" in str(exc), exc
        assert "toy" in _adapters.labels() and di.available("toy")
        from diffiface.test import check_gradients
        report = check_gradients(f, x, backends=["toy"])
        assert {row.backend for row in report.rows} == {"toy"} and not report.failed, report
        # by default too, beside the built-in engines; and skipped with the reason where f uses
        # an operation the toy's duals lack
        defaults = check_gradients(f, x)
        lacking = check_gradients(lambda x: np.sum(np.tanh(x)), x)
        print(json.dumps([
            [row.backend, row.status] for report in (defaults, lacking) for row in report.rows if row.backend == "toy"
        ]))
        """.replace("import sys", "import json, sys"),
        toy_site,
    )
    assert json.loads(out) == [["toy", "passed"], ["toy", "skipped"]]


def test_toy_passes_the_core_scenarios(toy_site: Path) -> None:
    """Every core scenario, full list, in float64 and float32: none fails, the few that need
    an operation the toy lacks are skipped with that reason, and a clear majority pass."""
    out = _run(
        """
        import json
        import diffiface as di
        from diffiface.test import core_scenarios, test_differentiation

        scenarios = core_scenarios()
        report = test_differentiation(["toy"], scenarios, raise_on_failure=False)
        print(json.dumps([[row.scenario, row.status, row.message] for row in report.rows]))
        """,
        toy_site,
    )
    rows = json.loads(out)
    failed = [row for row in rows if row[1] not in ("passed", "skipped")]
    assert not failed, failed[:5]
    passed = {scenario for scenario, status, _ in rows if status == "passed"}
    assert len(passed) >= 0.9 * len({scenario for scenario, _, _ in rows}), sorted(passed)
    for name in ("gradient", "hessian", "jvp", "vjp", "hvp", "second_derivative"):
        assert any(name in scenario for scenario in passed), name


def test_the_main_job_lists_and_checks_the_toy(toy_site: Path) -> None:
    """``python -m diffiface.test`` lists the toy among its default backends and checks it like any
    other: none of its rows fails; the scenarios it cannot run (complex numbers, a ufunc its duals
    lack) are skipped with that reason."""
    out = _run(
        """
        import contextlib, io, json, sys
        from diffiface.test import __main__ as cli

        listed = list(cli._BACKENDS)
        sys.argv = ["diffiface.test", "--backends", "toy", "--quick", "--format", "json"]
        text = io.StringIO()
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
            with contextlib.suppress(SystemExit):
                cli.main()
        rows = json.loads(text.getvalue())["rows"]
        print(json.dumps({"listed": listed, "rows": [[r["scenario"], r["status"], r["message"]] for r in rows]}))
        """,
        toy_site,
    )
    found = json.loads(out)
    assert found["listed"][-1] == "toy"
    rows = found["rows"]
    assert not [row for row in rows if row[1] not in ("passed", "skipped")], rows
    assert sum(row[1] == "passed" for row in rows) >= 40
    reasons = {row[2] for row in rows if row[1] == "skipped"}
    assert any("dual numbers are real" in reason for reason in reasons), reasons


@pytest.mark.parametrize(
    ("value", "name", "says"),
    [
        ("no_such_module:ENGINE", "broken", "could not be loaded (ModuleNotFoundError"),
        ("json:dumps", "broken", "names a function; it must name a diffiface BackendInfo"),
        ("diffiface_toy:ENGINE", "other", "names a row called 'toy'"),
        ("diffiface_toy:ENGINE", "jax", "takes the name 'jax', which is a built-in backend's"),
    ],
)
def test_a_faulty_entry_point_is_refused_naming_its_package(
    toy_site: Path, tmp_path: Path, value: str, name: str, says: str
) -> None:
    broken = _broken(tmp_path, "faulty-engine", value, name)
    out = _run(
        f"""
        import diffiface as di
        from diffiface._adapters import labels

        for use in ("listed", "by name"):
            try:
                if use == "listed" or {name!r} == "jax":
                    labels()
                else:
                    di.gradient(lambda x: (x**2).sum(), {name!r}, __import__("numpy").ones(2))
            except di.DiffifaceError as exc:
                print(use, type(exc).__name__, exc)
        """,
        broken,
        toy_site,
    )
    lines = out.strip().splitlines()
    assert len(lines) == 2, out
    for line in lines:
        assert "'faulty-engine'" in line and says in line and "Fix or uninstall that package" in line, out
