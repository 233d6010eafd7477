"""The notebooks' stored outputs: run them, compare what they print, store it.

The notebooks in ``notebooks/`` are stored with their outputs, so GitHub, Jupyter and the site
show the results. ``tests/test_docs_and_notebooks.py`` runs each notebook and compares what its
cells print with what is stored (through :func:`normalize`, which hides what changes from run to
run: float rounding noise, memory addresses, the kernel's cell file names, timings). After
changing a notebook, store its new outputs with::

    python -m tests.notebook_outputs            # every notebook
    python -m tests.notebook_outputs 02_tp_mlp_gradients.ipynb
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

FLOAT = re.compile(r"(?<![\w.])-?\d+\.\d+(?:e[-+]?\d+)?(?![\w.])")
TIMING = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)? ?(?:s|ms|us|µs|ns)\b")


def execute(path: Path) -> Any:
    """The notebook at ``path``, run top to bottom in a fresh Jupyter kernel (from the repository
    root), with its new outputs."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(ROOT)}},
    ).execute()
    return nb


def _float(m: re.Match[str]) -> str:
    value = float(m.group(0))
    return "~0" if abs(value) < 1e-9 else f"{value:.6g}"


def normalize(text: str) -> str:
    """``text`` without what differs between two runs of the same cell: rounding noise (a float
    under 1e-9 reads ``~0``, others 6 significant digits), timings, memory addresses, and the
    kernel's temporary file for the cell."""
    text = re.sub(r"/tmp/ipykernel_\d+/\d+\.py", "<cell>", text)
    text = re.sub(r"0x[0-9a-fA-F]{6,}", "0x?", text)
    text = TIMING.sub("<time>", text)
    return FLOAT.sub(_float, text)


def printed(nb: Any) -> list[tuple[int, str, list[str]]]:
    """Per code cell: (index among all cells, what it printed and displayed as text, normalized;
    the kinds of rich output it displayed, such as ``image/png``). Warnings on stderr are left
    out: they depend on the environment, not on the notebook."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        text, kinds = [], []
        for o in cell.get("outputs", []):
            if o["output_type"] == "stream" and o["name"] == "stdout":
                text.append(o["text"])
            elif o["output_type"] in ("execute_result", "display_data"):
                text.append(o["data"].get("text/plain", "") + "\n")
                kinds += sorted(k for k in o["data"] if k != "text/plain")
            elif o["output_type"] == "error":
                text.append(f"{o['ename']}: {o['evalue']}\n")
        out.append((i, normalize("".join(text)), kinds))
    return out


def store(path: Path) -> None:
    """Run the notebook and save it with its outputs."""
    nb = execute(path)
    for cell in nb.cells:
        if cell.cell_type == "code":  # warnings on stderr depend on the machine: not stored
            cell.outputs = [
                o
                for o in cell.outputs
                if not (o["output_type"] == "stream" and o["name"] == "stderr")
            ]
    nbformat.write(nb, path)


if __name__ == "__main__":
    names = sys.argv[1:]
    for path in NOTEBOOKS:
        if not names or path.name in names:
            store(path)
            print("stored", path.relative_to(ROOT))
