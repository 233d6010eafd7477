"""ruff (formatter and linter, lines <= 100 columns) is clean on every file it covers.

The configuration is in pyproject.toml. Every Python file and notebook is covered; Markdown is
excluded (ruff would rewrite the code blocks in the docs).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> list[str]:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    assert Path(exe).exists(), (
        "ruff is not installed: pip install -e '.[dev]' (it is a dev dependency)"
    )
    return [exe]


def test_ruff_format_is_clean() -> None:
    proc = subprocess.run(
        [*_ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_ruff_check_is_clean() -> None:
    proc = subprocess.run(
        [*_ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_ruff_covers_every_python_file() -> None:
    """Nothing Python is excluded: every module, test, benchmark, example and notebook is
    formatted and linted at 100 columns (Markdown stays out: ruff would reformat the docs' code
    blocks)."""
    import tomllib

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert conf["line-length"] == 100
    assert set(conf.get("extend-exclude", [])) <= {"*.md"}, conf["extend-exclude"]
    # ruff lets a line run past the limit for a pragma, or when it is one token (a long string
    # without spaces); here only the pragma itself may: code, strings and comments fit
    pragma = re.compile(r"\s*# (type: ignore(\[[\w, -]+\])?|noqa(: [A-Z0-9, ]+)?)")
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "src/fastdist/ops/reductions.py" in tracked, tracked[:5]
    long = [
        f"{name}:{i}"
        for name in tracked
        for i, line in enumerate((ROOT / name).read_text().splitlines(), 1)
        if len(pragma.sub("", line)) > 100
    ]
    assert not long, long
