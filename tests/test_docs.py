"""The documentation works: its code runs, its reference is complete, its site builds.

- Every ```python block of docs/**/*.md and README.md runs; the blocks of one page share a
  namespace and run in order. A block is left out only when preceded by
  ``<!-- skip: why it cannot run here -->`` (the reason is required) or by
  ``<!-- skip: needs diffiface.test.check_gradients, ... -->``. The last form names what the block
  is waiting for: once every named object exists the block runs again, so the docs cannot stay
  skipped after the function is written. A ``text`` block after ``<!-- output -->`` is what the
  python block before it prints; the test compares the two, numbers masked.
- Every number of a benchmark in a page sits between markers naming the results file it comes
  from, and equals what ``scripts/benchmark_docs.py`` renders from that file today.
- Every relative link of the Markdown pages (README, docs, CONTRIBUTING, CHANGELOG) reaches a file,
  and every ``#anchor`` a heading of it; the built site is checked the same way by mkdocs.
- The README stays a README: short, what diffiface is in its first lines, no lab notes, and the
  test command of ``.ci/run`` in its Development section.
- The doctests of every diffiface module pass (modules whose engine is missing are skipped).
- Every public name is in the API reference and has a docstring; every error class is on the
  errors page; the support matrix is generated, not written by hand.
- ``mkdocs build --strict`` passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import importlib
import importlib.util
import inspect
import io
import os
import pathlib
import pkgutil
import re
import subprocess
import sys
import types
from typing import Any

import pytest

import diffiface
from diffiface import _errors

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API = DOCS / "api"

# Engines a page or module may need; a missing one skips the test instead of failing it.
ENGINES = (
    "jax",
    "jaxlib",
    "torch",
    "autograd",
    "scipy",
    "array_api_compat",
    "equinox",
    "flax",
    "haiku",
    "tensorflow",
    "keras",
    "mlx",
    "pytensor",
)

# --- code blocks of the pages -------------------------------------------------------------------

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
_OUTPUT = "<!-- output -->"  # marks a text block as the output of the python block before it
_SKIP = re.compile(r"^<!--\s*skip(?:\s*:\s*(?:needs\s+(?P<needs>[^>]*?)|(?P<why>[^>]*?)))?\s*-->$")


@dataclasses.dataclass
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    source: str
    skip: bool  # always skipped
    needs: tuple[str, ...]  # skipped until all of these exist
    why: str  # the reason an always skipped block gives
    output: str | None = None  # what it prints, shown in a text block marked <!-- output -->


def _blocks(page: pathlib.Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    previous = ""  # the last non-blank line before a fence
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        indent, fence, info = match["indent"], match["fence"], match["info"].split()
        start = i
        body = []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence[0] * len(fence)) and not lines[i].strip().strip(fence[0])
        ):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1  # the closing fence
        if info and info[0].lower() == "text" and previous == _OUTPUT and blocks:
            blocks[-1].output = "\n".join(body) + "\n"
        if info and info[0].lower() in ("python", "py", "python3"):
            marker = _SKIP.match(previous)
            needs: tuple[str, ...] = ()
            if marker and marker["needs"]:
                needs = tuple(n.strip() for n in marker["needs"].split(",") if n.strip())
            always = "skip" in info[1:] or bool(marker and not needs)
            why = (marker["why"] or "").strip() if marker else ""
            blocks.append(Block(page, start + 1, "\n".join(body) + "\n", always, needs, why))
        previous = ""
    return blocks


def _pages() -> list[pathlib.Path]:
    pages = sorted(DOCS.rglob("*.md"))
    readme = ROOT / "README.md"
    if readme.is_file():
        pages.append(readme)
    return pages


def _exists(dotted: str) -> bool:
    """Whether ``package.module.attribute`` can be imported and looked up."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def _missing_engine(exc: BaseException) -> str | None:
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in ENGINES:
        return exc.name
    if isinstance(exc, diffiface.BackendUnavailableError):
        return str(exc)
    return None


PAGES_WITH_CODE = [page for page in _pages() if _blocks(page)]


def _page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def _masked(text: str) -> list[str]:
    """Printed text with its numbers masked (timings and rounding vary), spaces collapsed."""
    lines = [re.sub(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", "#", line).split() for line in text.strip().splitlines()]
    return [" ".join(words) for words in lines]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=_page_id)
def test_code_blocks_run(page: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the page's blocks run in a module of their own, importable by name as a script's are
    # (torch.compile imports the module of the functions it traces)
    module = types.ModuleType(f"docs_{page.stem.replace('-', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace: dict[str, Any] = module.__dict__
    for block in _blocks(page):
        where = f"{_page_id(page)}:{block.line}"
        code = compile(
            block.source, where, "exec", dont_inherit=True
        )  # valid Python even if skipped; no flags of this file
        if block.skip or not all(_exists(name) for name in block.needs):
            continue
        try:
            if block.output is None:
                exec(code, namespace)
            else:
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    exec(code, namespace)
                assert _masked(printed.getvalue()) == _masked(block.output), (
                    f"{where}: the output the page shows is not what the block prints:\n{printed.getvalue()}"
                )
        except Exception as exc:
            engine = _missing_engine(exc)
            if engine is not None:
                pytest.skip(f"{where} needs an engine that is not installed: {engine}")
            raise


def test_every_page_is_in_the_nav() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.rglob("*.md"):
        uri = page.relative_to(DOCS).as_posix()
        assert uri in config, f"{uri} is not in the nav of mkdocs.yml"


def test_skipped_blocks_say_why() -> None:
    """A block that cannot run here says why in its marker (``<!-- skip: reason -->``)."""
    for page in _pages():
        for block in _blocks(page):
            if block.skip:
                assert block.why, (
                    f"{_page_id(page)}:{block.line}: a skipped block must say why it cannot run: "
                    "precede it with <!-- skip: the reason -->"
                )


def test_skip_markers_name_real_needs() -> None:
    """A ``needs`` marker names objects of diffiface, so that it lifts once they exist."""
    for page in _pages():
        for block in _blocks(page):
            for name in block.needs:
                assert name.startswith("diffiface."), f"{_page_id(page)}:{block.line}: skip marker needs {name!r}"


# --- doctests of the modules -------------------------------------------------------------------------


def _modules() -> list[str]:
    names = ["diffiface"]
    for info in pkgutil.walk_packages(diffiface.__path__, "diffiface.", onerror=lambda _: None):
        if info.name.rsplit(".", 1)[-1] != "__main__":
            names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_doctests(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        if (exc.name or "").split(".")[0] in ENGINES:
            pytest.skip(f"{name} needs {exc.name}, which is not installed")
        raise
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = [t for t in finder.find(module, name) if t.examples]
    if not tests:
        return  # nothing to run; not a skip, so that real skips stand out
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report: list[str] = []
    for test in tests:
        runner.run(test, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(report)


# --- the reference is complete ---------------------------------------------------------------------


def _documented_identifiers() -> set[str]:
    found = set()
    for page in API.rglob("*.md"):
        found.update(re.findall(r"^:::\s+(\S+)", page.read_text(encoding="utf-8"), flags=re.M))
    return found


@pytest.mark.parametrize("name", diffiface.__all__)
def test_public_name_in_api_reference(name: str) -> None:
    assert f"diffiface.{name}" in _documented_identifiers(), (
        f"diffiface.{name} is public but no page under docs/api/ renders it; add '::: diffiface.{name}'."
    )
    obj = getattr(diffiface, name)
    assert inspect.getdoc(obj), f"diffiface.{name} has no docstring."


@pytest.mark.parametrize("name", diffiface.tree.__all__)
def test_tree_names_have_docstrings(name: str) -> None:
    assert inspect.getdoc(getattr(diffiface.tree, name)), f"diffiface.tree.{name} has no docstring."


def test_errors_page_names_every_class() -> None:
    text = (DOCS / "errors.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^## (\w+)$", text, flags=re.M))
    missing = sorted(set(_errors.__all__) - headings)
    assert not missing, f"docs/errors.md has no section for {missing}: say when each is raised and how to fix it."
    assert "<!-- error-classes -->" in text


def _support_matrix_module() -> Any:
    """scripts/support_matrix.py, the generator the docs build uses."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("support_matrix")


def test_support_matrix_is_generated_from_the_registry() -> None:
    from diffiface._adapters import BACKENDS

    page = (DOCS / "backends.md").read_text(encoding="utf-8")
    assert "<!-- support-matrix -->" in page
    table = _support_matrix_module().support_matrix()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(BACKENDS)
    for row, backend in zip(rows, BACKENDS, strict=True):
        assert f"`{backend.config.__name__}()`" in row
        assert f'"{backend.name}"' in row
        # the hand-written part of the page must not repeat the generated table
        assert row not in page


def _benchmark_docs_module() -> Any:
    """scripts/benchmark_docs.py, which writes every number of the docs from its file."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("benchmark_docs")


def test_generated_numbers_agree_with_their_files() -> None:
    """Every marked region of every page is what its results file gives today: a new benchmark
    run, or a number edited by hand, fails here until ``python scripts/benchmark_docs.py``."""
    module = _benchmark_docs_module()
    problems = []
    used = set()
    for page in module.pages():
        text = page.read_text(encoding="utf-8")
        used |= {match["name"] for match in module.REGION.finditer(text)}
        problems += module.regenerate(text, str(page.relative_to(ROOT)))[1]
    assert not problems, "\n".join([*problems, "run: python scripts/benchmark_docs.py"])
    unused = sorted(set(module.GENERATORS) - used)
    assert not unused, f"generators of scripts/benchmark_docs.py that no page uses: {unused}"


def test_a_changed_number_is_caught() -> None:
    """The check above can fail: one digit changed in a region is reported, naming the file."""
    module = _benchmark_docs_module()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    region = next(m for m in module.REGION.finditer(text) if m["name"] == "readme-torch-users")
    body = region["body"]
    digit = re.search(r"\d\.\d\d", body)
    assert digit is not None
    changed = body[: digit.start()] + ("2" if digit[0][0] != "2" else "3") + body[digit.start() + 1 :]
    edited = text[: region.start("body")] + changed + text[region.end("body") :]
    problems = module.regenerate(edited, "README.md")[1]
    assert problems == [
        "README.md: region 'readme-torch-users' differs from what benchmarks/results/torch_users.json gives"
    ]


def test_benchmark_pages_cite_their_files() -> None:
    """The README's performance table and docs/benchmarks.md are generated, and name their files."""
    module = _benchmark_docs_module()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    names = {m["name"]: m["source"] for m in module.REGION.finditer(readme)}
    assert names.get("readme-torch-users") == "benchmarks/results/torch_users.json"
    assert names.get("support-matrix") == module.REGISTRY
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    sources = {m["source"] for m in module.REGION.finditer(page)}
    expected = {f"benchmarks/results/{p.name}" for p in (ROOT / "benchmarks" / "results").glob("*.json")}
    assert sources == expected, f"docs/benchmarks.md should show every results file: missing {expected - sources}"
    for plot in (ROOT / "benchmarks" / "results").glob("*.png"):
        assert f"](benchmarks/results/{plot.name})" in page, f"docs/benchmarks.md does not show {plot.name}"


# --- the README stays a README --------------------------------------------------------------------

# Words of the project's working notes, which mean nothing to a reader of the README or the
# benchmarks page.
_LAB_NOTES = ("session", "FlatCall", "Settled", "../shared", "copy-once", "contract wrapper")


def test_readme_is_short_and_says_what_diffiface_is_first() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert 100 <= len(lines) <= 150, f"README.md has {len(lines)} lines; keep it between 100 and 150"
    first = " ".join(lines[:10])
    assert "diffiface differentiates a Python function" in first


@pytest.mark.parametrize("page", ["README.md", "docs/benchmarks.md"])
def test_no_lab_notes(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    # the benchmarks page gives each run's conditions, the load of the machine among them
    found = [word for word in (*_LAB_NOTES, *(["load average"] if page == "README.md" else [])) if word in text]
    assert not found, f"{page} reads as a lab notebook: {found}"


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_readme_development_has_the_commands_ci_runs() -> None:
    """.ci/run runs the README's test command: the two stay the same command, under Development."""
    readme = _section((ROOT / "README.md").read_text(encoding="utf-8"), "Development")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    at = next(i for i, line in enumerate(ci) if line.startswith("echo") and "README's test command" in line)
    command = ci[at + 1].strip()
    assert command == 'pip install "torch==2.13.0" -e ".[all,test,frameworks]" && python -m pytest -n auto'
    assert f"\n{command}\n" in readme
    assert '\npip install ".[all,test]" && python -m diffiface.test\n' in readme


# --- links and anchors --------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!\\)!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (its default slugify)."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: pathlib.Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"(?ms)^```.*?^```", "", text)  # a # in a code block is no heading
    found: set[str] = set()
    for heading in re.findall(r"(?m)^#{1,6} (.+?)\s*#*$", text):
        slug, n = _slug(heading), 1
        while slug in found:  # a repeated heading gets _1, _2, ...
            slug = f"{_slug(heading)}_{n}"
            n += 1
        found.add(slug)
    return found


def _link_pages() -> list[pathlib.Path]:
    pages = [*_pages(), *(ROOT / name for name in ("CONTRIBUTING.md", "CHANGELOG.md"))]
    return [page for page in pages if page.is_file()]


@pytest.mark.parametrize("page", _link_pages(), ids=_page_id)
def test_links_reach_their_targets(page: pathlib.Path) -> None:
    """Offline: a relative link names a file that exists, and its anchor a heading there. (Links
    to the web are not followed; the site's own links are checked again by mkdocs --strict.)"""
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for match in _LINK.finditer(text):
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # http:, mailto:, ...
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if path.startswith("benchmarks/results/") and page.parent == DOCS:
            resolved = ROOT / path  # the docs hook copies the plots there
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{_page_id(page)} has broken links: {broken}"


# --- the site builds ---------------------------------------------------------------------------------------


def _site_tools_missing() -> str | None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return module
    return None


@pytest.mark.skipif(
    _site_tools_missing() is not None,
    reason=f"the docs tools are not installed ({_site_tools_missing()}); pip install -e '.[dev]'",
)
def test_mkdocs_build_strict(tmp_path: pathlib.Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    backends = (site / "backends" / "index.html").read_text(encoding="utf-8")
    assert "<!-- support-matrix -->" not in backends, "the support-matrix marker was not replaced"
    assert "AutoFiniteDifferences()" in backends
    index = (site / "index.html").read_text(encoding="utf-8")
    assert "fonts.googleapis.com" not in index, "the site loads web fonts; keep theme.font: false"
