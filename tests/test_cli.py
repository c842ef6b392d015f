"""``python -m diffiface.test``: wrong options exit 2 with the known names, the help has no
markup, several processes give the table of one, no progress bar off a terminal, exit codes; and
the CLI's backend names are names the API takes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import diffiface as di
from diffiface.test import Scenario
from diffiface.test import __main__ as cli

SUBSET = ["--backends", "finite_differences,autograd", "--scenarios", "core", "--operators", "gradient,jvp", "--quick"]


def _run(args, capsys):
    code = cli.main([*args, "--no-progress"])
    return code, capsys.readouterr()


@pytest.mark.parametrize(
    ("args", "known"),
    [
        (["--scenarios", "core,layer"], "core, layers, torch"),
        (["--scenarios", ""], "core, layers, torch"),
        (["--operators", "gradient,grad"], "gradient_and_hvp"),
        (["--backends", "jax,tensorflow"], "torch-func"),
        (["-j", "0"], "positive"),
    ],
    ids=["unknown-group", "no-group", "unknown-operator", "unknown-backend", "no-jobs"],
)
def test_wrong_options_exit_2_with_the_known_names(args, known, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    assert known in capsys.readouterr().err


def test_help_has_no_markup(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--jobs" in text and "--scenarios" in text
    for markup in ("``", ":func:", ":class:", ":meth:"):
        assert markup not in text


def test_passing_subset_exits_0_and_names_groups_as_options_do(capsys):
    code, out = _run(SUBSET, capsys)
    assert code == 0, out.out
    lines = out.out.splitlines()
    assert lines[0].split()[:2] == ["backend", "group"]
    assert "references" in lines[0] and "skip reasons" in lines[0]
    groups = {line.split()[1] for line in lines[2:] if line.startswith(("finite_differences", "autograd"))}
    assert groups == {"core"}  # the name --scenarios takes
    assert "e-0" not in lines[-1] and "e+0" not in lines[-1]  # "... in 1.2 s"


def test_failure_exits_1_and_names_the_reference(capsys, monkeypatch):
    wrong = Scenario(
        "wrong_analytic", lambda x: (x**2).sum(), np.array([1.0, 2.0]), "gradient", reference=np.array([2.0, 5.0])
    )
    monkeypatch.setattr(cli, "_scenarios", lambda groups, quick, operators=None: ([wrong], []))
    code, out = _run(["--backends", "autograd", "--scenarios", "core", "-j", "1"], capsys)
    assert code == 1
    assert "against analytic" in out.out and "values differ" in out.out


def _rows(args, capsys):
    code, out = _run([*args, "--format", "json"], capsys)
    assert code == 0, out.out
    rows = json.loads(out.out)["rows"]
    return [(r["backend"], r["scenario"], r["operator"], r["status"], r["reference"], r["message"]) for r in rows]


def test_two_processes_give_the_table_of_one(capsys):
    one = _rows([*SUBSET, "-j", "1"], capsys)
    two = _rows([*SUBSET, "-j", "2"], capsys)
    assert len(one) >= 8
    assert two == one


def test_no_progress_bar_off_a_terminal():
    assert cli._progress(io.StringIO())[0] is None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-m", "diffiface.test", *SUBSET, "--operators", "gradient", "-j", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    assert "passed" in result.stdout


@pytest.mark.parametrize(("name", "mode"), [("torch-func", "func"), ("torch-autograd", "autograd")])
def test_cli_backend_names_are_api_names(name, mode):
    pytest.importorskip("torch")
    assert cli._BACKENDS.get(name, di.AutoTorch(mode=mode)) == di.AutoTorch(mode=mode)
    gradient = di.gradient(lambda x: (x**2).sum(), name, np.array([1.0, 3.0]))
    np.testing.assert_allclose(gradient, [2.0, 6.0])


def test_every_cli_backend_name_is_an_api_name():
    from diffiface._adapters import normalize

    for name, backend in cli._BACKENDS.items():
        assert normalize(name) == backend


def test_unknown_backend_name_lists_the_aliases():
    with pytest.raises(di.UnknownBackendError, match="torch-func"):
        di.gradient(lambda x: x.sum(), "torch_func", np.ones(2))
