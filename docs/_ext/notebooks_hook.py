"""mkdocs hook: the notebooks in notebooks/ as pages of the site (notebooks/<name>.md).

Each page shows the notebook's markdown cells as they are and its code cells as Python blocks,
under a note saying where the file is. Outputs are not stored in the repository (CI runs every
notebook and checks what its cells print: tests/test_docs_and_notebooks.py), so the pages show
the code and its explanation; run the notebook in Jupyter to see the results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]


def notebook_markdown(path: Path) -> str:
    """One notebook as a markdown page."""
    nb = nbformat.read(path, as_version=4)
    note = (
        f'!!! note "A notebook"\n    This page is `notebooks/{path.name}` in the repository; open '
        "it in Jupyter to run it (CI runs it and checks what its cells print).\n"
    )
    parts = [note]
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            parts.append(cell.source.strip() + "\n")
        elif cell.cell_type == "code" and cell.source.strip():
            parts.append("```python\n" + cell.source.rstrip() + "\n```\n")
    return "\n".join(parts)


def on_files(files: Files, config: Any) -> Files:
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        files.append(
            File.generated(config, f"notebooks/{path.stem}.md", content=notebook_markdown(path))
        )
    return files
