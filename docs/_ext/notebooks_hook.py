"""mkdocs hook: the notebooks in notebooks/ as pages of the site (notebooks/<name>.md).

Each page shows the notebook's markdown cells as they are, its code cells as Python blocks and,
under each, the outputs stored in the notebook as Jupyter shows them: printed text as a text
block, rich displays (``show_ranks``, ``show_sharding``, ``Mesh.show``) as their HTML, figures as
PNG images (files of the site: ``notebooks/<notebook>_<cell>_<n>.png``). The stored outputs are
current: tests/test_docs_and_notebooks.py runs every notebook and compares what it prints with
them (``python -m tests.notebook_outputs`` stores new ones).
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import nbformat
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _text_block(text: str) -> str:
    return "```text\n" + ANSI.sub("", text).rstrip("\n") + "\n```\n"


def _outputs(cell: Any, name: str, images: dict[str, bytes]) -> list[str]:
    """A code cell's stored outputs as markdown; its figures are added to ``images``."""
    parts = []
    for k, o in enumerate(cell.get("outputs", [])):
        kind = o["output_type"]
        if kind == "stream" and o["name"] == "stdout":
            parts.append(_text_block(o["text"]))
        elif kind in ("execute_result", "display_data"):
            data = o["data"]
            if "image/png" in data:
                file = f"{name}_{k}.png"
                images[file] = base64.b64decode(data["image/png"])
                parts.append(f"![The figure the cell draws]({file})\n")
            elif "text/html" in data:  # a block of raw HTML: no blank line inside
                html = "\n".join(line for line in data["text/html"].splitlines() if line.strip())
                parts.append(f'<div class="nb-output">\n{html}\n</div>\n')
            elif "text/plain" in data:
                parts.append(_text_block(data["text/plain"]))
        elif kind == "error":
            parts.append(_text_block(f"{o['ename']}: {o['evalue']}"))
    return parts


def notebook_markdown(path: Path, images: dict[str, bytes] | None = None) -> str:
    """One notebook as a markdown page; the PNG files its figures need are added to
    ``images`` (name in ``notebooks/`` -> bytes)."""
    images = {} if images is None else images
    nb = nbformat.read(path, as_version=4)
    note = (
        f'!!! note "A notebook"\n    This page is `notebooks/{path.name}` in the repository, with '
        "the outputs stored in it; open it in Jupyter to run it (CI runs it and checks that it "
        "prints what is shown here).\n"
    )
    parts = [note]
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            parts.append(cell.source.strip() + "\n")
        elif cell.cell_type == "code" and cell.source.strip():
            parts.append("```python\n" + cell.source.rstrip() + "\n```\n")
            parts += _outputs(cell, f"{path.stem}_{i}", images)
    return "\n".join(parts)


def on_files(files: Files, config: Any) -> Files:
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        images: dict[str, bytes] = {}
        page = notebook_markdown(path, images)
        files.append(File.generated(config, f"notebooks/{path.stem}.md", content=page))
        for name, png in images.items():
            files.append(File.generated(config, f"notebooks/{name}", content=png))
    return files
