"""``python -m diffiface.test``: wrong options and selections that check nothing exit 2 with the
known names, the help has no markup, several processes give the table of one, the progress (a bar
over every planned row on a terminal, fed by every worker; a line per group off one), the table
fits 120 columns, exit codes; and the CLI's backend names are names the API takes."""

from __future__ import annotations

import io
import itertools
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
        (["--backends", "jax,theano"], "torch-func"),
        (["-j", "0"], "positive"),
        (
            ["--backends", ""],
            "choose from jax, torch, torch-autograd, torch-func, torch-compile, autograd",
        ),
        (
            ["--backends", ","],
            "choose from jax, torch, torch-autograd, torch-func, torch-compile, autograd",
        ),
        (["--operators", ","], "choose from batched_hvp, batched_jvp, batched_vjp, derivative"),
        (["--operators", "derivative", "--scenarios", "sparse"], "operators are hessian, jacobian"),
        (["--operators", "hvp", "--scenarios", "sparse", "--quick"], "(--quick) have no scenario of hvp"),
    ],
    ids=[
        "unknown-group",
        "no-group",
        "unknown-operator",
        "unknown-backend",
        "no-jobs",
        "no-backend",
        "comma-backend",
        "comma-operator",
        "nothing-to-check",
        "nothing-to-check-quick",
    ],
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
    assert "references" in lines[0] and "skipped" in lines[0]
    groups = {line.split()[1] for line in lines[2:] if line.startswith(("finite_differences", "autograd"))}
    assert groups == {"core"}  # the name --scenarios takes
    assert "e-0" not in lines[-1] and "e+0" not in lines[-1]  # "... in 1.2 s"


def test_failure_exits_1_and_names_the_reference(capsys, monkeypatch):
    wrong = Scenario(
        "wrong_analytic", lambda x: (x**2).sum(), np.array([1.0, 2.0]), "gradient", reference=np.array([2.0, 5.0])
    )
    from diffiface.test import _main_job

    for module in (cli, _main_job):
        monkeypatch.setattr(module, "dense_scenarios", lambda groups, quick, operators: [wrong])
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


def test_off_a_terminal_a_line_per_finished_group():
    """No bar off a terminal: the plan first, then one line per group as it is finished (name,
    counts, elapsed); --no-progress: nothing."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, "-m", "diffiface.test", "--backends", "finite_differences,autograd"]
    args += ["--scenarios", "core,sparse", "--operators", "gradient,jacobian", "--quick", "-j", "1"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert "\r" not in result.stderr and len(lines) == 3, result.stderr
    total = int(lines[0].split()[1])
    assert lines[0].startswith(f"checking {total} rows (core ") and "sparse " in lines[0]
    counts = []
    for line, group in zip(lines[1:], ("core", "sparse"), strict=True):
        assert line.startswith(f"{group}: ") and line.endswith(" elapsed"), line
        counts.append(int(line.split()[1]))
    assert sum(counts) == total
    quiet = subprocess.run([*args, "--no-progress"], capture_output=True, text=True, timeout=300, env=env)
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert "passed" in quiet.stdout


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _draws(text):
    """The (done, total) of every bar drawn."""
    found = []
    for frame in text.split("\r"):
        if frame.startswith("[") and "] " in frame:
            done, total = frame.split("] ", 1)[1].split()[0].split("/")
            found.append((int(done), int(total)))
    return found


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_the_bar_counts_every_planned_row_from_every_worker(jobs, capsys, monkeypatch):
    """The total is known before the first row (sparse rows included) and never changes; the
    bar moves row by row, with -j 2 as well (the workers report each row); it ends full."""
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    args = [
        "--backends", "finite_differences,autograd", "--scenarios", "core,sparse",
        "--operators", "gradient,jacobian", "--quick", "-j", jobs,
    ]  # fmt: skip
    assert cli.main(args) == 0
    draws = _draws(stream.getvalue())
    rows = capsys.readouterr().out.splitlines()[-1]
    total = sum(int(rows.split()[i]) for i in (0, 2, 4))  # passed, failed, skipped
    assert draws[0] == (0, total) and {t for _, t in draws} == {total}
    assert draws[-1] == (total, total)
    dones = [d for d, _ in draws]
    assert dones == sorted(dones)
    steps = {b - a for a, b in itertools.pairwise(dones)} - {0}
    assert steps and max(steps) < 10, steps  # row by row, not a part at a time
    assert "sparse: " in stream.getvalue() and "core: " in stream.getvalue()


def test_the_estimate_waits_for_measured_costs():
    from diffiface.test._main_job import Progress
    from diffiface.test._running import Row

    stream = _Terminal()
    planned = [("core", "jax")] * 10 + [("sparse", "sparse-scipy-known-dense")] * 10
    progress = Progress(stream, planned, jobs=1, terminal=True)
    assert progress.eta() is None
    for i in range(10):
        progress.row(0, "core", "jax", 1.0, f"jax {i}")
    assert progress.eta() is None  # half the rows left are of a kind not measured yet
    progress.row(1, "sparse", "sparse-scipy-known-dense", 3.0, "scipy 0")
    eta = progress.eta()
    assert eta is not None and eta > 0
    progress.part_done(0, [Row("jax", f"s{i}", "gradient", "passed", tags=frozenset({"core"})) for i in range(10)])
    assert "core: 10 rows, 10 passed, 0 failed, 0 skipped" in stream.getvalue()
    assert "~" in stream.getvalue().split("\r")[-1] and " left " in stream.getvalue().split("\r")[-1]


def test_the_table_fits_120_columns_and_names_each_reference_once(capsys):
    from diffiface.test import Report
    from diffiface.test._running import Row

    long = "finite differences cannot serve here: " + "a reason that goes on " * 12
    rows = [
        Row("sparse-finite_differences-global-dense", "a", "jacobian", "passed", tags=frozenset({"sparse"}),
            reference="analytic"),
        Row("jax", "b", "gradient", "passed", tags=frozenset({"core"}), reference="finite_differences"),
        Row("jax", "c", "gradient", "passed", tags=frozenset({"core"}), reference="finite_differences (float64)"),
        Row("jax", "d", "gradient", "passed", tags=frozenset({"core"}), reference="analytic"),
        Row("jax", "e", "gradient", "skipped", long, tags=frozenset({"core"})),
        Row("jax", "f", "gradient", "skipped", "short reason", tags=frozenset({"core"})),
        Row("torch-func", "g", "hvp", "skipped", "short reason", tags=frozenset({"layer"})),
    ]  # fmt: skip
    report = Report(rows)
    text = report.table()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120
    jax = next(line for line in lines if line.startswith("jax "))
    assert jax.count("finite_differences") == 1 and "float64" not in jax and "analytic" in jax
    assert "2 [1,2]" in jax and "1 [2]" in next(line for line in lines if line.startswith("torch-func"))
    assert any(line.startswith("finite_differences-global  sparse") for line in lines)  # no sparse-, no -dense
    assert "[1] finite differences cannot serve here" in text
    assert long.strip() == " ".join(text.split("[1] ", 1)[1].split("\n[2]")[0].split())  # in full, wrapped
    assert str(report) == f"{text}\n\n{report.summary()}"
    assert report.summary() == "None of the 7 checks failed (4 passed, 3 skipped)."


@pytest.mark.parametrize(("name", "label"), [("torch-func", "torch-func"), ("torch-autograd", "torch")])
def test_cli_takes_every_backend_name_the_api_takes(name, label, capsys):
    pytest.importorskip("torch")
    gradient = di.gradient(lambda x: (x**2).sum(), name, np.array([1.0, 3.0]))
    np.testing.assert_allclose(gradient, [2.0, 6.0])
    args = ["--backends", name, "--scenarios", "core", "--operators", "gradient", "--quick"]
    code = cli.main([*args, "--no-progress", "-j", "1", "--format", "json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert code == 0 and rows and {row["backend"] for row in rows} == {label}


def test_cli_names_are_read_from_the_registry():
    from diffiface._adapters import _ALIASES, BACKENDS

    assert set(cli._accepted()) == {row.name for row in BACKENDS} | set(_ALIASES)


def test_every_cli_backend_name_is_an_api_name():
    from diffiface._adapters import normalize

    for name, backend in cli._BACKENDS.items():
        assert normalize(name) == backend


def test_unknown_backend_name_lists_the_aliases():
    with pytest.raises(di.UnknownBackendError, match="torch-func"):
        di.gradient(lambda x: x.sum(), "torch_func", np.ones(2))


def test_help_says_what_a_check_is_the_groups_examples_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "what a check is:" in text and "unprepared and with a" in text
    for group in cli._GROUPS:
        assert f"\n  {group} " in text, group
    assert "rel error" in text and "max|result - reference|" in text
    assert "examples:" in text and "python -m diffiface.test --quick" in text
    assert "exit status:" in text and all(f"\n  {code}  " in text for code in (0, 1, 2))
    assert "torch-autograd" in text  # every name the API takes


def test_a_selection_whose_every_check_is_skipped_exits_2_and_says_why(capsys):
    """--backends jax --scenarios torch ran 24 checks, skipped all, and exited 0: a CI job checked
    nothing and passed. It exits 2, as a selection with no backend installed does, saying why."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    for fmt in ("table", "json"):
        code, out = _run(["--backends", "jax", "--scenarios", "torch", "-j", "1", "--format", fmt], capsys)
        assert code == 2, out.out
        assert "the selection checks nothing" in out.err and "f is written for torch, not jax" in out.err


def test_a_backend_not_installed_is_reported_skipped_in_every_format(capsys, monkeypatch):
    """The JSON report dropped a backend that is not installed (the table listed it, with 0
    skipped, and the closing line did not count it): both say it is skipped, and why."""
    real = cli.available
    monkeypatch.setattr(cli, "available", lambda backend: backend.name != "autograd" and real(backend))
    args = ["--backends", "finite_differences,autograd", "--scenarios", "core", "--quick", "-j", "1"]
    code, out = _run([*args, "--format", "json"], capsys)
    missing = json.loads(out.out)["not installed"]
    assert [entry["backend"] for entry in missing] == ["autograd"] and "pip install" in missing[0]["reason"]
    code, out = _run(args, capsys)
    assert code == 0
    assert "1 skipped" in out.out.splitlines()[-1] and "autograd is not installed" in out.out
