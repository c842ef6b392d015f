"""mkdocs hooks: the parts of the site generated from the library at build time.

Markers in the pages are replaced when the site is built:

- ``<!-- support-matrix -->``: the backends' support matrix, from the registry rows;
- ``<!-- error-classes -->``: the table of every class in ``diffiface._errors.__all__``.

The benchmark plots under ``benchmarks/results/`` are copied into the site, where
docs/benchmarks.md shows them; its tables are written into the page by
``scripts/benchmark_docs.py``, not at build time.

``docs/policies.md`` is written separately; until it exists a placeholder page stands in, so
the navigation never points at a missing file.
"""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# Where benchmark assets (plots) land in the site, relative to the docs directory.
ASSETS_URI = "benchmarks/results"


def _load_renderers() -> Any:
    spec = importlib.util.spec_from_file_location("_diffiface_support_matrix", ROOT / "scripts" / "support_matrix.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    return markdown
