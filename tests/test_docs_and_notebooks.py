"""Docs, notebooks and the command line are part of the product: they must run."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@contextmanager
def fresh_module(name: str) -> Iterator[dict[str, object]]:
    """A real, importable module namespace (torch.compile resolves globals through sys.modules)."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        yield module.__dict__
    finally:
        del sys.modules[name]


SMALL = r"(\d\.\d+e-1[5-9]|0\.0(e\+00)?)"  # a float-rounding difference, printed
# What each notebook's cells must print (regular expressions searched in the cell's text output,
# by code-cell index among all cells): the prose around them states these facts.
NOTEBOOK_PRINTS: dict[str, dict[int, list[str]]] = {
    "01_tour_of_collectives.ipynb": {
        6: [
            r"psum tp: \[6\.0, 6\.0, 6\.0, 6\.0, 22\.0, 22\.0, 22\.0, 22\.0\]",
            r"pmean dp: \[2\.0, 3\.0, 4\.0, 5\.0, 2\.0",
        ],
        14: [
            r"ring_shift tp  : \[3\.0, 0\.0, 1\.0, 2\.0, 7\.0, 4\.0, 5\.0, 6\.0\]",
            r"axis_size tp   : 4",
        ],
        16: [
            r"0:4 │ rank 0 │ rank 1 │ rank 2 │ rank 3 │",
            r"4:8 │ rank 4 │ rank 5 │ rank 6 │ rank 7 │",
        ],
    },
    "02_tp_mlp_gradients.ipynb": {
        5: [
            rf"max \|dx  - single device\|: {SMALL}\n",
            rf"max \|dW1 - single device\|: {SMALL}\n",
            rf"max \|dW2 - single device\|: {SMALL}\n",
        ],
        7: [r"without pvary: [1-9]\d*\.\d+\n", r"but the partials sum to dx: True\n"],
        9: [rf"compiled: max \|dx - single device\|: {SMALL}\n"],
        13: [
            rf"max grad diff vs single device: {SMALL}\n",
            r"Fix: wrap operand 0 in fastdist\.pvary",
        ],
    },
    "03_ulysses_vs_ring_attention.ipynb": {
        3: [
            rf"Ulysses max error: {SMALL}\n",
            rf"\nring    max error: {SMALL}\n",
            rf"causal ring max error: {SMALL}\n",
        ],
        5: [
            r"Ulysses: max gradient error \d\.\de[+-]\d\d",
            r"ring: max gradient error \d\.\de-1[5-9]",
        ],
    },
}
# cells that must display a figure (inline, as in Jupyter)
NOTEBOOK_FIGURES = {"01_tour_of_collectives.ipynb": [8]}


def _cell_text(cell: Any) -> str:
    parts = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            parts.append(o["text"])
        elif o["output_type"] in ("execute_result", "display_data"):
            parts.append(o["data"].get("text/plain", ""))
    return "".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_prints_what_its_text_says(path: Path) -> None:
    """Execute the notebook in a real Jupyter kernel; no cell errors, each checked cell prints what
    the prose claims."""
    nb = nbformat.read(path, as_version=4)
    assert any(c.cell_type == "code" for c in nb.cells), f"{path.name} has no code cells"
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    for i, patterns in NOTEBOOK_PRINTS[path.name].items():
        assert nb.cells[i].cell_type == "code", f"{path.name} cell {i} is not code"
        text = _cell_text(nb.cells[i])
        for pat in patterns:
            assert re.search(pat, text), (
                f"{path.name} cell {i} does not print {pat!r}; it printed:\n{text}"
            )
    for i in NOTEBOOK_FIGURES.get(path.name, []):
        kinds = [
            k for o in nb.cells[i].outputs if o["output_type"] == "display_data" for k in o["data"]
        ]
        assert "image/png" in kinds, f"{path.name} cell {i} shows no figure (outputs: {kinds})"
    for cell in nb.cells:  # a notebook must not switch Jupyter's inline backend off
        assert 'matplotlib.use("Agg")' not in cell.source


def test_there_are_the_three_notebooks() -> None:
    assert [p.name for p in NOTEBOOKS] == [
        "01_tour_of_collectives.ipynb",
        "02_tp_mlp_gradients.ipynb",
        "03_ulysses_vs_ring_attention.ipynb",
    ]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_python_blocks_run(path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    with fresh_module(f"doc_{path.stem}") as namespace:
        for i, block in enumerate(blocks):
            exec(compile(block, f"{path.name}[block {i}]", "exec"), namespace)


def test_readme_opens_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    cmds = [ln for ln in lines[:6] if ln.startswith("python -m pip install")]
    assert len(cmds) == 2
    assert "python -m fastdist demo" in cmds[0] and "python -m pytest" in cmds[1]
    assert all("-c constraints.txt" in c for c in cmds)
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()


def test_cli_demo_exits_zero_and_reports() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fastdist", "demo", "--dp", "2", "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "rank 3 (dp=1, tp=1): loss" in proc.stdout and "OK: every rank matches" in proc.stdout


def test_cli_help_is_plain_text_and_names_how_it_was_called() -> None:
    """No reStructuredText markup in --help, and the usage line says what the user typed."""
    as_module = subprocess.run(
        [sys.executable, "-m", "fastdist", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert (
        as_module.startswith("usage: python -m fastdist ")
        and "python -m fastdist demo --tp 8 --compile" in as_module
    )
    script = Path(sys.executable).parent / "fastdist"
    if script.exists():  # the console script of the installed distribution
        out = subprocess.run(
            [str(script), "demo", "--help"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        assert (
            out.startswith("usage: fastdist demo ")
            and "Exit status 0 when every rank matches" in out
        )
        as_module += out
    assert "``" not in as_module and ":class:" not in as_module and ":func:" not in as_module


def test_cli_demo_exits_nonzero_on_mismatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import fastdist.demo
    from fastdist.__main__ import main

    real = fastdist.demo.run_demo

    def broken(*a, **k):
        res = real(*a, **k)
        res.max_grad_diff["W1"] = 1.0  # as if a gradient were wrong
        return res

    monkeypatch.setattr(fastdist.demo, "run_demo", broken)
    assert main(["demo", "--dp", "1", "--tp", "2"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
