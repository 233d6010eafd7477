"""Install instructions name the distribution ``torch-fastdist``, and ``fastdist.testing`` imports
without its ``testing`` extra.

``fastdist`` on the package index is an unrelated project: an instruction that installs
``fastdist`` or ``fastdist[extra]`` installs that one. Every text file of the repository
(docs, README, docstrings, error messages, notebooks, CI scripts) is searched.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "fastdist"  # kept apart from the patterns so that this file does not match them

# "fastdist[extra]" without "torch-" in front: the other project with an extra
EXTRA = re.compile(r"(?<![\w.-])" + NAME + r"\[")
# an installer command whose first package is "fastdist": pip/pip3/python -m pip/uv pip
# install, uv/poetry add, pipx install, conda install (options before it allowed)
COMMAND = re.compile(
    r"(?:\bpip3?|\bpython3? -m pip|\buv pip|\bpipx|\bconda|\bmamba)\s+install"
    r"|(?:\buv|\bpoetry|\bpdm)\s+add"
)
FIRST_PACKAGE = re.compile(r"(?:\s+-{1,2}[\w-]+(?:[ =](?!['\"]?" + NAME + r")\S+)?)*\s+['\"]?(\S+)")
# a sentence that warns about the other project ("`pip install fastdist` does not install this
# library") is not an instruction
WARNING = re.compile(r"^\W*\s*(does not|doesn't|is not|isn't|would install|installs (an|the|a) )")

TEXT_SUFFIXES = {
    ".md",
    ".py",
    ".pyi",
    ".ipynb",
    ".toml",
    ".txt",
    ".cfg",
    ".ini",
    ".yml",
    ".yaml",
    ".rst",
    ".sh",
    ".html",
    ".json",
    "",
}
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "site", "__pycache__", ".mypy_cache"}


def _repo_files() -> list[Path]:
    """The repository's files: git's list (tracked and untracked, not ignored), or a walk of the
    tree where git is not there (an unpacked sdist)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = []
        for d, dirs, files in os.walk(ROOT):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")]
            names += [os.path.relpath(os.path.join(d, f), ROOT) for f in files]
    return [
        ROOT / n
        for n in names
        if Path(n).suffix in TEXT_SUFFIXES and not set(Path(n).parts) & SKIP_DIRS
    ]


def wrong_install_lines(text: str) -> list[str]:
    """The lines of ``text`` that tell to install the other project."""
    bad = []
    for line in text.splitlines():
        if EXTRA.search(line):
            bad.append(line.strip())
            continue
        for m in COMMAND.finditer(line):
            first = FIRST_PACKAGE.match(line, m.end())
            if first is None:
                continue
            package = re.split(r"[\[<>=!~;'\"`]", first.group(1))[0]
            if package == NAME and not WARNING.match(line[first.end() :].lstrip("`'\"")):
                bad.append(line.strip())
                break
    return bad


def test_every_install_instruction_names_torch_fastdist() -> None:
    files = _repo_files()
    assert len(files) > 50 and any(f.name == "README.md" for f in files), files[:5]
    found = []
    for path in files:
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{path.relative_to(ROOT)}: {line}" for line in wrong_install_lines(text)]
    assert not found, (
        "these install the unrelated 'fastdist' project; name the distribution torch-fastdist "
        '(pip install torch-fastdist, pip install "torch-fastdist[testing]"):\n' + "\n".join(found)
    )


def test_the_search_finds_what_it_must() -> None:
    """The patterns catch the wrong forms and pass the right ones (the test above cannot fail
    otherwise)."""
    n = NAME
    wrong = [
        f"pip install {n}",
        f"install `{n}[testing]`",
        f'pip install "{n}[hf]"',
        f"python -m pip install -U {n}",
        f"uv add {n}",
        f"pip install --upgrade {n}==0.3",
        f"needs hypothesis: ``pip install\n{n}[testing]``",
    ]
    right = [
        f"pip install torch-{n}",
        f'pip install "torch-{n}[testing]"',
        "python -m pip install -c constraints.txt -e .",
        "pip install -e '.[dev]'",
        f"`pip install {n}` does not install this library.",
        f"pip install torch-{n} hypothesis",
        f"import {n}.testing",
    ]
    assert [bool(wrong_install_lines(t)) for t in wrong] == [True] * len(wrong)
    assert [wrong_install_lines(t) for t in right] == [[]] * len(right)


BLOCK_HYPOTHESIS = textwrap.dedent(
    """
    import sys
    sys.modules["hypothesis"] = None  # import hypothesis now raises ImportError
    import torch
    import fastdist as fd
    from fastdist import P
    import fastdist.testing as t
    assert callable(t.run_on_gloo) and callable(t.shard_for_rank)
    mesh = fd.Mesh({"tp": 2})
    t.assert_matches_single_device(
        lambda x, w: fd.psum(x @ w, mesh, "tp"), lambda x, w: x @ w, mesh,
        [torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)],
        in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(),
    )
    for name, call in [
        ("meshes", lambda: t.meshes()),
        ("axes", lambda: t.axes(mesh)),
        ("shard_sizes", lambda: t.shard_sizes(2)),
        ("sharded", lambda: t.sharded(2)),
    ]:
        try:
            call()
        except ImportError as e:
            print(name, "|", e)
        else:
            print(name, "| no error")
    """
)


def test_fastdist_testing_imports_without_hypothesis() -> None:
    """Only the strategies need hypothesis; they say which extra to install."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_HYPOTHESIS],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == ["meshes", "axes", "shard_sizes", "sharded"]
    for ln in lines:
        name, message = ln.split(" | ")
        assert message == (
            f"fastdist.testing.{name} is a hypothesis strategy and hypothesis is not installed. "
            'Fix: pip install "torch-fastdist[testing]" (or pip install hypothesis)'
        ), ln
