"""Docs, notebooks and the command line are part of the product: they must run."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import nbformat
import pytest

from tests.notebook_outputs import execute, normalize, printed

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
        # a diffusers Wan: "auto" (Ulysses) and ring vs one device; 3 heads refused by Ulysses
        8: [
            rf"Ulysses: output max error {SMALL}, gradients within 1e-6: True\n",
            rf"\n    ring: output max error {SMALL}, gradients within 1e-6: True\n",
        ],
        10: [
            r"Ulysses, 3 heads: .* has 3 heads, which the 4 ranks of 'sp' do not divide",
            rf"ring: output max error {SMALL}, gradients within 1e-6: True\n",
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
    stored = nbformat.read(path, as_version=4)
    assert any(c.cell_type == "code" for c in stored.cells), f"{path.name} has no code cells"
    nb = execute(path)
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
    # the outputs stored in the notebook (shown on GitHub and the site) are what it prints now
    for (i, text, kinds), (_, was, was_kinds) in zip(printed(nb), printed(stored)):
        assert (text, kinds) == (was, was_kinds), (
            f"{path.name} cell {i}: the stored outputs are not what the cell prints now (store "
            f"them: python -m tests.notebook_outputs {path.name})\n--- stored ({was_kinds}):\n"
            f"{was}\n--- printed now ({kinds}):\n{text}"
        )
    assert any(text for _, text, _ in printed(stored)), f"{path.name} is stored without outputs"


def test_notebook_output_comparison_ignores_noise_not_values() -> None:
    """Two runs differ in rounding noise, addresses, the kernel's file names and timings; the
    comparison ignores those and nothing else."""
    a = "err 6.661338147750939e-16 at 0x7f3a2c0d1e20 in /tmp/ipykernel_24270/2570426545.py:7 0.8 s"
    b = "err 1.1102230246251565e-15 at 0x7f99aa001234 in /tmp/ipykernel_311/99.py:7 1.25 s"
    assert normalize(a) == normalize(b) == "err ~0 at 0x? in <cell>:7 <time>"
    assert normalize("without pvary: 3.4960372403898976") == "without pvary: 3.49604"
    assert normalize("[6.0, 22.0]") != normalize("[6.0, 21.0]")
    assert normalize("error 1.0e-6") != normalize("error 2.0e-16")


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


# Examples that need a multi-process job are fenced ```py: highlighted as Python, not run in this
# process. Every one must parse and name only API that exists; the complete programs among them run
# on gloo processes below.
DIST_BLOCK = re.compile(r"^( *)```py\n(.*?)^\1```", flags=re.S | re.M)


def _dist_blocks(path: Path) -> list[str]:
    return [
        "\n".join(line[len(indent) :] for line in body.splitlines())
        for indent, body in DIST_BLOCK.findall(path.read_text())
    ]


def _unknown_names(codes: list[str]) -> list[list[str]]:
    """``tests/doc_names.py``'s check of each code block, in a fresh interpreter: there a
    submodule is an attribute of its package only if the package (or the block) imports it,
    whatever this test process imported before."""
    import json

    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "doc_names.py")],
        input=json.dumps(codes),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return cast(list[list[str]], json.loads(proc.stdout))


def test_doc_distributed_blocks_parse_and_name_real_api() -> None:
    blocks = [(path.name, i, code) for path in DOCS for i, code in enumerate(_dist_blocks(path))]
    for name, i, code in blocks:
        try:
            ast.parse(code)
        except SyntaxError as e:
            raise AssertionError(f"{name} ```py block {i} does not parse: {e}") from None
    unknown = _unknown_names([code for _, _, code in blocks])
    wrong = {f"{name}[{i}]": bad for (name, i, _), bad in zip(blocks, unknown) if bad}
    assert not wrong, wrong


def test_the_api_check_of_distributed_blocks_can_fail() -> None:
    assert _unknown_names(
        [
            "fd.connectt(tp=2)\nmesh.resett()\nfd.serving.node_info(m)",
            # a submodule the package does not import must be imported by the block
            "lib = fastdist.comm.native.fake.build('/tmp/x')",
            "from fastdist.comm.native import fake\nfake.build('/tmp/x')",
            "from fastdist.comm.native import fak\nimport fastdist.nope",
            "from fastdist.comm.native import fake\nfake.buld('/tmp/x')",
        ]
    ) == [
        ["fd.connectt", "mesh.resett (Mesh)"],
        ["fastdist.comm.native.fake.build"],
        [],
        ["from fastdist.comm.native import fak", "import fastdist.nope"],
        ["fake.buld"],
    ]
    assert sum(len(_dist_blocks(p)) for p in DOCS) >= 13  # the fences above are found


# (doc, index of its ```py block, processes, lines run after it on every rank)
DIST_PROGRAMS = [
    ("README.md", 0, 2, "assert dict(mesh.shape) == {'dp': 1, 'tp': 2}, mesh"),
    (
        "docs/distributed.md",
        0,
        4,
        "assert dict(mesh2.shape) == dict(mesh.shape) == {'dp': 1, 'tp': 4}\n"
        "assert mesh.rank == dist.get_rank() and dm.mesh.flatten().tolist() == [0, 1, 2, 3]",
    ),
    (
        "docs/serving.md",
        0,
        4,
        "assert q.is_writer == (mesh.rank == 0)\n"
        "assert q.is_writer or msg == {'step': 999, 'req_ids': [3, 5, 8]}, msg",
    ),
]


@pytest.mark.parametrize(
    "doc, index, world, after", DIST_PROGRAMS, ids=[f"{d}[{i}]" for d, i, _, _ in DIST_PROGRAMS]
)
def test_doc_distributed_program_runs_on_gloo(
    doc: str, index: int, world: int, after: str, tmp_path: Path
) -> None:
    """The example as written, on ``world`` gloo processes launched as torchrun would (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), then a check of what it built."""
    import datetime
    import os

    import torch.distributed as dist

    script = tmp_path / "example.py"
    code = _dist_blocks(ROOT / doc)[index]
    script.write_text(f"{code}\n{after}\nprint('example ok')\ndist.destroy_process_group()\n")
    # the rendezvous is hosted here, on a port the OS picks; every rank joins it as a client
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        0,
        world,
        is_master=True,
        timeout=datetime.timedelta(seconds=120),
        wait_for_workers=False,
    )
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and "example ok" in out, f"{doc} rank {r}:\n{out[-3000:]}"


def test_the_mesh_diagram_in_the_docs_is_what_show_draws() -> None:
    import fastdist as fd

    text = (ROOT / "docs" / "index.md").read_text()
    drawn = str(fd.Mesh({"dp": 2, "sp": 2, "tp": 2}).show("tp"))
    assert f"```text\n{drawn}\n```" in text, drawn


def test_the_gradient_pairs_diagram_states_the_real_backward_rules() -> None:
    """Each row of docs/gradients.md's diagram names an op and the op its backward runs on the
    cotangent; on 4 simulated ranks the vector-Jacobian product of the op equals that partner
    applied to a random cotangent."""
    import torch

    import fastdist as fd

    text = (ROOT / "docs" / "gradients.md").read_text()
    diagram = text[text.index("   forward      ") :]
    diagram = diagram[: diagram.index("```")]
    rows = re.findall(r"──(\w+)(?:\([^)]*\))?─*▶.*\(cotangent\) (\w+)", diagram)
    mesh = fd.Mesh({"tp": 4})
    perm = [(0, 1), (1, 2), (2, 3), (3, 0)]
    inverse = [(j, i) for i, j in perm]
    a2a = {"split_dim": 1, "concat_dim": 2}
    back = {"split_dim": 2, "concat_dim": 1}
    # op -> (forward, what the diagram's partner computes on the cotangent, input shape per rank)
    ops = {
        "pvary": (lambda x: fd.pvary(x, mesh, "tp"), lambda g: fd.psum(g, mesh, "tp"), (3,)),
        "psum": (lambda x: fd.psum(x, mesh, "tp"), lambda g: g, (3,)),
        "all_gather": (
            lambda x: fd.all_gather(x, mesh, "tp"),
            lambda g: fd.psum_scatter(g, mesh, "tp"),
            (2, 3),
        ),
        "psum_scatter": (
            lambda x: fd.psum_scatter(x, mesh, "tp"),
            lambda g: fd.all_gather(g, mesh, "tp"),
            (8, 3),
        ),
        "all_to_all": (
            lambda x: fd.all_to_all(x, mesh, "tp", **a2a),
            lambda g: fd.all_to_all(g, mesh, "tp", **back),
            (2, 8, 4),
        ),
        "ppermute": (
            lambda x: fd.ppermute(x, mesh, "tp", perm),
            lambda g: fd.ppermute(g, mesh, "tp", inverse),
            (3,),
        ),
    }
    partner_names = {
        "pvary": "psum",
        "psum": "identity",
        "all_gather": "psum_scatter",
        "psum_scatter": "all_gather",
        "all_to_all": "all_to_all",
        "ppermute": "ppermute",
    }
    assert dict(rows) == partner_names, rows
    g = torch.Generator().manual_seed(0)
    for op, (fwd, partner, shape) in ops.items():
        x = torch.randn(4, *shape, dtype=torch.float64, generator=g)
        if op == "pvary":  # an invariant input: the same on every rank
            x = x[:1].expand_as(x).clone()
        x.requires_grad_()
        y = fd.simulate(fwd, mesh)(x)
        cot = torch.randn(y.shape, dtype=torch.float64, generator=g)
        if op == "psum":  # psum's output is invariant: so is its cotangent
            cot = cot[:1].expand_as(cot).clone()
        (grad,) = torch.autograd.grad(y, x, cot)
        torch.testing.assert_close(grad, fd.simulate(partner, mesh)(cot), msg=op)


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
    import fastdist.tools.demo
    from fastdist.__main__ import main

    real = fastdist.tools.demo.run_demo

    def broken(*a, **k):
        res = real(*a, **k)
        res.max_grad_diff["W1"] = 1.0  # as if a gradient were wrong
        return res

    monkeypatch.setattr(fastdist.tools.demo, "run_demo", broken)
    assert main(["demo", "--dp", "1", "--tp", "2"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
