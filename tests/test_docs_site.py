"""The documentation site builds with warnings as errors (broken links, bad API references)."""

from __future__ import annotations

import dataclasses
import html
import importlib
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVES = (
    "psum", "pvary", "pmean", "pmax", "pmin", "all_gather", "all_gather_invariant", "local_chunk",
    "psum_scatter", "all_to_all", "all_to_all_4d", "all_to_all_qkv", "ppermute", "ring_shift",
    "broadcast", "axis_index", "axis_size",
)  # fmt: skip
UNEVEN = (
    "all_gather_v", "reduce_scatter_v", "gather_v", "scatter_v", "ragged_all_to_all",
    "indexed_all_to_all_v", "exchange_sizes",
)  # fmt: skip


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


API_MODULES = (  # the modules whose ``__all__`` is the public API (docs/_ext/crossrefs_hook.py)
    "fastdist",
    "fastdist.nn",
    "fastdist.nn.moe",
    "fastdist.nn.plans",
    "fastdist.checkpoint",
    "fastdist.train",
    "fastdist.train.schedules",
    "fastdist.serving",
    "fastdist.profile",
    "fastdist.comm",
    "fastdist.comm.native",
    "fastdist.testing",
)
HEADING = re.compile(
    r'<h(\d) id="([^"]+)" class="doc doc-heading">\s*'
    r'<code class="doc-symbol doc-symbol-heading doc-symbol-(\w+)">'
)


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def _api_pages(site: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in sorted((site / "api").glob("*/index.html"))}


def _entries(page: str) -> list[tuple[str, str, str]]:
    """(identifier, kind, the HTML up to the next entry) for each object on an API page."""
    heads = list(HEADING.finditer(page))
    return [
        (
            m.group(2),
            m.group(3),
            page[m.end() : heads[k + 1].start() if k + 1 < len(heads) else None],
        )
        for k, m in enumerate(heads)
    ]


def _attribute(obj: object, name: str) -> object:
    """``getattr``, and a dataclass's field of that name where the class holds no attribute (a
    field with a ``default_factory``, documented by its ``#:`` comment)."""
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and not hasattr(obj, name):
        for f in dataclasses.fields(obj):
            if f.name == name:
                return f
    return getattr(obj, name)


def _resolve(identifier: str) -> object:
    """The object an identifier of the reference names (``fastdist.sim.simulate.simulate``: the
    function of the module that the package's ``simulate`` attribute shadows)."""
    parts = identifier.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = _attribute(obj, part)
        except AttributeError:
            continue
        return obj
    raise LookupError(identifier)


def test_mkdocs_builds_strict(site: Path) -> None:
    page = (site / "api" / "collectives" / "index.html").read_text()
    assert "fastdist.psum" in page and "All-reduce sum" in page  # docstrings rendered


def test_built_site_reads_right(site: Path) -> None:
    """The rendered HTML, as a reader sees it: no literal Sphinx roles, doctest examples and
    literal blocks (``Example::``) as code (not block quotes or prose), a Returns paragraph as one
    description, only the public API listed."""
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
    api = "\n".join(_api_pages(site).values())
    in_code = re.findall(
        r"<div class=\"highlight\"><pre>(?:(?!</pre>).)*</pre>", api, flags=re.DOTALL
    )
    prompts = sum(block.count("&gt;&gt;&gt;") for block in in_code)
    # every example line is in a code block
    assert prompts >= 80 and prompts == api.count("&gt;&gt;&gt;")
    prose = re.sub(r"<(pre|code)\b.*?</\1>", "", api, flags=re.DOTALL)
    assert not re.search(r"\w::\s*</p>", prose), "an Example:: literal block rendered as prose"
    serving = _api_pages(site)["serving"]
    example = re.search(r"Example \(every rank.*?</pre>", serving, flags=re.DOTALL)
    assert example and '<span class="n">MessageQueue</span>' in example.group(0)
    # internal helpers are not API
    assert "rank_binding" not in api and "fastdist.sim.simulate.promote" not in api
    assert "checked_call" not in api
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


def test_reference_is_a_page_per_module_in_the_nav(site: Path) -> None:
    """No single huge page: the reference is split by module, every page is in the navigation
    and the overview links each one."""
    pages = _api_pages(site)
    assert {"collectives", "mesh", "spmd", "parallelize", "testing", "train", "moe"} <= set(pages)
    overview = (site / "api" / "index.html").read_text()
    for name, page in pages.items():
        assert len(page) < 400_000, f"api/{name} is {len(page)} bytes"
        assert f'href="{name}/"' in overview, f"the overview does not link api/{name}"
        assert 'class="md-nav__link md-nav__link--active"' in page, name  # in the nav


def test_every_public_name_has_an_entry(site: Path) -> None:
    """Each name in the ``__all__`` of the public modules has an entry (a heading) in the
    reference, under its own name or an alias of the same object; ``fastdist.spmd``,
    ``fastdist.simulate`` and ``fastdist.nn.parallelize`` are headed by their public names and
    rendered as the functions, and each entry appears once."""
    ids: list[str] = []
    for page in _api_pages(site).values():
        ids += [i for i, _, _ in _entries(page)]
    assert len(ids) == len(set(ids)), sorted(i for i in set(ids) if ids.count(i) > 1)
    shown = {id(_resolve(i)) for i in ids}
    missing = []
    for modname in API_MODULES:
        module = importlib.import_module(modname)
        for name in module.__all__:
            obj = getattr(module, name)
            if not isinstance(obj, types.ModuleType) and id(obj) not in shown:
                missing.append(f"{modname}.{name}")
    assert not missing, f"public names without an entry in docs/api/*.md: {missing}"
    for name in ("testing.meshes", "testing.axes", "testing.shard_sizes", "testing.sharded"):
        assert f"fastdist.{name}" in ids, name
    assert "fastdist.testing.Sharded" in ids and "fastdist.comm.GraphCaptureContext" in ids
    kinds = {i: k for page in _api_pages(site).values() for i, k, _ in _entries(page)}
    for function, where in (
        ("fastdist.spmd", "fastdist.check.spmd.spmd"),
        ("fastdist.simulate", "fastdist.sim.simulate.simulate"),
        ("fastdist.nn.parallelize", "fastdist.nn.parallelize.parallelize"),
    ):
        assert kinds.get(where) == "function", function
        assert function not in kinds  # not rendered as the module
        page = next(p for p in _api_pages(site).values() if f'id="{function}"' in p)
        heading = page[page.index(f'id="{function}"') :]
        heading = heading[heading.index("<h") : heading.index("</h")]
        assert "doc-symbol-function" in heading and _text(heading).split() == [function], function


def _signature_parameters(entry: str) -> list[str]:
    match = re.search(r'<div class="doc-signature highlight"><pre>(.*?)</pre>', entry, re.S)
    if match is None:
        return []
    sig = _text(match.group(1))
    inner = sig[sig.find("(") + 1 : sig.rfind(")")]
    params, depth, cur = [], 0, ""
    for ch in inner:  # split at top-level commas
        depth += ch in "([{" and 1 or (ch in ")]}" and -1 or 0)
        if ch == "," and depth == 0:
            params.append(cur.strip())
            cur = ""
        else:
            cur += ch
    params.append(cur.strip())
    return [p for p in params if p and p not in ("self", "cls", "*", "/")]


def test_every_callable_has_a_typed_signature_and_a_parameter_table(site: Path) -> None:
    """Each function, method and class with parameters shows them typed in its signature and
    in a Parameters table (with their types); the collectives describe every parameter and what
    they return."""
    count = 0
    untyped, tableless = [], []
    for page in _api_pages(site).values():
        for ident, kind, entry in _entries(page):
            if kind not in ("function", "method", "class"):
                continue
            params = _signature_parameters(entry)
            if not params:
                continue
            count += 1
            untyped += [f"{ident}({p})" for p in params if ":" not in p.split("=")[0]]
            if 'doc-section-title">Parameters:' not in entry:
                tableless.append(ident)
    assert count >= 190
    assert not tableless, f"no parameter table: {tableless}"
    assert not untyped, f"parameters without a type in the signature: {untyped}"
    pages = _api_pages(site)
    described = [(pages["collectives"], c) for c in COLLECTIVES]
    described += [(pages["uneven"], c) for c in UNEVEN]
    for page, op in described:
        entry = next(e for i, _, e in _entries(page) if i == f"fastdist.{op}")
        table = re.search(r"Parameters:</span></p>\s*<table>(.*?)</table>", entry, re.S)
        assert table, op
        rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table.group(1), re.S)[1:]
        assert len(rows) == len(_signature_parameters(entry)), op
        for row in rows:
            cells = [_text(c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            assert cells[1] and len(cells[2]) > 10, f"{op}: {cells}"  # a type, a description
        assert 'doc-section-title">Returns:' in entry, op
    # a Returns paragraph with a colon in its prose is one description, its type the annotation
    for name, page in pages.items():
        for table in re.findall(r"Returns:</span></p>\s*<table>(.*?)</table>", page, re.S):
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S)[1:]:
                kind = _text(re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)[0]).strip()
                assert not re.search(r"[a-z]+ [a-z]+", kind), f"api/{name}: Returns type {kind!r}"


def test_guides_link_into_the_reference(site: Path) -> None:
    """The guides' mentions of API names are links to their entries (mkdocs-autorefs), and each
    link goes to an entry that exists."""
    anchors = {
        f"api/{name}/#{i}"
        for name, page in _api_pages(site).items()
        for i in re.findall(r'id="([^"]+)"', page)
    }
    expect = {
        "index": ["fastdist.Mesh", "fastdist.simulate", "fastdist.psum"],
        "gradients": ["fastdist.psum", "fastdist.pvary", "fastdist.all_gather"],
        "models": ["fastdist.nn.parallelize"],
        "testing": ["fastdist.testing.run_on_gloo"],
        "uneven": ["fastdist.ragged_all_to_all"],
    }
    guides = [p for p in site.glob("*/index.html") if p.parent.name not in ("api", "search")]
    assert len(guides) >= 12
    for path in guides:
        page = path.read_text()
        links = re.findall(r'class="autorefs autorefs-internal"[^>]*href="\.\./([^"]+)"', page)
        for link in links:
            assert link in anchors, f"{path.parent.name}: link to a missing entry {link}"
        targets = {link.split("#", 1)[1] for link in links}
        for ident in expect.get(path.parent.name, []):
            assert ident in targets, f"{path.parent.name} does not link {ident}"
        if path.parent.name not in ("performance",):
            assert links, f"{path.parent.name} links nothing in the reference"


def test_site_has_install_notebooks_and_performance_pages(site: Path) -> None:
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


def test_notebook_pages_show_the_stored_outputs(site: Path) -> None:
    """Each notebook's page shows what its cells printed (text), its rich displays (the mesh
    and sharding tables) and its figures (PNG files of the site)."""
    import base64

    import nbformat

    images = 0
    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        page_dir = site / "notebooks" / nb_path.stem
        page = (page_dir / "index.html").read_text()
        text = html.unescape(re.sub(r"<[^>]+>", "", page))
        nb = nbformat.read(nb_path, as_version=4)
        for i, cell in enumerate(nb.cells):
            for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
                if o["output_type"] == "stream" and o["name"] == "stdout":
                    for line in o["text"].strip().splitlines():
                        assert line.strip() in text, f"{nb_path.name} cell {i}: {line!r}"
                elif "image/png" in o.get("data", {}):
                    srcs = re.findall(r'<img alt="[^"]*" src="([^"]+\.png)"', page)
                    pngs = [(page_dir / src).resolve() for src in srcs]
                    png = base64.b64decode(o["data"]["image/png"])
                    assert any(p.read_bytes() == png for p in pngs), f"{nb_path.name} cell {i}"
                    images += 1
                elif "text/html" in o.get("data", {}):
                    rows = re.findall(r"<tr>", o["data"]["text/html"])
                    assert rows and o["data"]["text/html"].splitlines()[0] in page, (
                        f"{nb_path.name} cell {i}: the display is not on the page"
                    )
    assert images >= 1
    tour = (site / "notebooks" / "01_tour_of_collectives" / "index.html").read_text()
    assert "ppermute 1-&gt;3  : [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 5.0]" in tour
    shown = html.unescape(re.sub(r"<[^>]+>", " ", tour))
    assert "global [8, 8] as P('dp', 'tp') on Mesh" in shown  # show_sharding's table


def test_distributed_examples_are_highlighted(site: Path) -> None:
    """The examples that need a job (fenced ```py, run on gloo by test_docs_and_notebooks) render
    as highlighted Python, not plain text."""
    for page in ("distributed", "serving", "native", "models"):
        html = (site / page / "index.html").read_text()
        assert '<span class="n">init_process_group</span>' in html, page
    serving = (site / "serving" / "index.html").read_text()
    assert '<span class="n">create_single_reader_mq_broadcasters</span>' in serving
