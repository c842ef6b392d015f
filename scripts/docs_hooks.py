"""mkdocs hooks: the parts of the site generated from the library at build time.

Markers in the pages are replaced when the site is built:

- ``<!-- support-matrix -->``: the backends' support matrix, from the registry rows;
- ``<!-- error-classes -->``: the table of every class in ``diffiface._errors.__all__``;
- ``<!-- benchmark-results -->``: ``benchmarks/results/results.md`` when it exists, otherwise
  how to produce it.

``docs/policies.md`` is written separately; until it exists a placeholder page stands in, so
the navigation never points at a missing file.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_PAGE = RESULTS / "results.md"
# Where benchmark assets (plots) land in the site, relative to the docs directory.
ASSETS_URI = "benchmarks/results"


def _load_renderers() -> Any:
    spec = importlib.util.spec_from_file_location("_diffiface_support_matrix", ROOT / "scripts" / "support_matrix.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_NO_RESULTS = """\
!!! note "No benchmark results in this build"
    This page shows `benchmarks/results/results.md` when that file exists at build time. Produce it
    with the benchmark scripts under `benchmarks/` (they time the scenarios of `diffiface.test`, prepared
    and unprepared, beside the engines' native calls) and rebuild the docs.
"""


def _benchmark_results() -> str:
    if not RESULTS_PAGE.is_file():
        return _NO_RESULTS
    text = RESULTS_PAGE.read_text(encoding="utf-8")
    # One level down, so that the included file's headings sit under this page's title.
    text = re.sub(r"(?m)^(#{1,5}) ", r"#\1 ", text)

    # Relative links (plots, tables) point into the copy of benchmarks/results/ in the site.
    def relink(match: re.Match[str]) -> str:
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
            return match.group(0)
        return f"{match.group(1)}({ASSETS_URI}/{target})"

    return re.sub(r"(!?\[[^\]]*\])\(([^)\s]+)\)", relink, text)


def on_files(files: Files, config: Any) -> Files:
    if files.get_file_from_path("policies.md") is None:
        files.append(
            File.generated(
                config,
                "policies.md",
                content="# Policies\n\nThis page is being written.\n",
            )
        )
    if RESULTS.is_dir():
        for path in sorted(RESULTS.rglob("*")):
            if path.is_file() and path.suffix != ".md":
                uri = f"{ASSETS_URI}/{path.relative_to(RESULTS).as_posix()}"
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if "<!-- support-matrix -->" in markdown or "<!-- error-classes -->" in markdown:
        renderers = _load_renderers()
        markdown = markdown.replace("<!-- support-matrix -->", renderers.support_matrix())
        markdown = markdown.replace("<!-- error-classes -->", renderers.error_table())
    if "<!-- benchmark-results -->" in markdown:
        markdown = markdown.replace("<!-- benchmark-results -->", _benchmark_results())
    return markdown
