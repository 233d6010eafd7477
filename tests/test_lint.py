"""ruff (formatter and linter, lines <= 100 columns) is clean on every file it covers.

The configuration is in pyproject.toml; files still waiting for their first 100-column pass
are listed there under ``extend-exclude`` and leave the list once they pass.
"""

from __future__ import annotations

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


def test_ruff_covers_most_of_the_package() -> None:
    """The exclusion list only shrinks: it may not grow past the files that waited at its start."""
    import tomllib

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert conf["line-length"] == 100
    waiting = [f for f in conf["extend-exclude"] if f not in ("notebooks", "*.md")]
    assert len(waiting) <= 43, waiting
    assert all((ROOT / f).exists() for f in waiting), [
        f for f in waiting if not (ROOT / f).exists()
    ]
