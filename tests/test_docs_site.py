"""The documentation site builds with warnings as errors (broken links, bad API references)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built once, with warnings as errors."""
    out = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def test_mkdocs_builds_strict(site: Path) -> None:
    page = (site / "api" / "index.html").read_text()
    assert "fastdist.psum" in page and "All-reduce sum" in page  # docstrings rendered


def test_built_site_reads_right(site: Path) -> None:
    """The rendered HTML, as a reader sees it: no literal Sphinx roles, doctest examples as code
    (not nested block quotes), a Returns paragraph as one description, only the public API
    listed."""
    import re

    pages = {p.relative_to(site).as_posix(): p.read_text() for p in site.rglob("*.html")}
    assert len(pages) >= 12
    for name, page in pages.items():
        body = re.sub(r"<(script|style)\b.*?</\1>", "", page, flags=re.DOTALL)
        roles = re.findall(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj):`?", body)
        assert not roles, f"{name}: literal Sphinx roles {roles[:5]}"
        quoted = re.findall(
            r"<blockquote>(?:(?!</blockquote>).)*&gt;&gt;&gt;", body, flags=re.DOTALL
        )
        assert not quoted, f"{name}: a doctest rendered as a block quote"
    api = pages["api/index.html"]
    in_code = re.findall(
        r"<div class=\"highlight\"><pre>(?:(?!</pre>).)*</pre>", api, flags=re.DOTALL
    )
    prompts = sum(block.count("&gt;&gt;&gt;") for block in in_code)
    # every example line is in a code block
    assert prompts >= 80 and prompts == api.count("&gt;&gt;&gt;")
    # internal helpers are not API
    assert "rank_binding" not in api and "fastdist.simulate.promote" not in api
    assert re.search(
        r"<td[^>]*>(?:(?!</td>).)*A function taking the same arguments(?:(?!</td>).)*Results "
        r"carry the rank dimension",
        api,
        flags=re.DOTALL,
    )
    for anchor in re.findall(r'id="(fastdist\.[\w.]+)"', api):
        assert not any(
            p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
            for p in anchor.split(".")
        ), anchor


def test_site_has_install_notebooks_and_performance_pages(site: Path) -> None:
    import re

    index = (site / "index.html").read_text()
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", index))
    assert 'id="install"' in index and "pip install torch-fastdist" in text
    assert "MALLOC_MMAP_THRESHOLD_" not in index  # allocator tuning lives on the performance page
    assert "MALLOC_MMAP_THRESHOLD_" in (site / "performance" / "index.html").read_text()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        page = (site / "notebooks" / nb.stem / "index.html").read_text()
        assert f"notebooks/{nb.name}" in page and page.count('class="highlight"') >= 3, nb.name
    assert (
        "all_gather" in (site / "gradients" / "index.html").read_text()
        and "psum_scatter" in (site / "gradients" / "index.html").read_text()
    )


def test_distributed_examples_are_highlighted(site: Path) -> None:
    """The examples that need a job (fenced ```py, run on gloo by test_docs_and_notebooks) render
    as highlighted Python, not plain text."""
    for page in ("distributed", "serving", "native", "models"):
        html = (site / page / "index.html").read_text()
        assert '<span class="n">init_process_group</span>' in html, page
    serving = (site / "serving" / "index.html").read_text()
    assert '<span class="n">create_single_reader_mq_broadcasters</span>' in serving
