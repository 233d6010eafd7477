"""Start-up cost: ``import fastdist`` and ``python -m fastdist --help`` against ``import torch``.

    python benchmarks/import_time.py            # 15 rounds, about 2 min on 2 CPU cores
    python benchmarks/import_time.py --quick    # 1 round, no warm-up (the smoke test)

Each command runs in a fresh interpreter (``python -c ...``), the commands of one round one after
another in a rotating order, so that every row and its baseline see the same machine load. A row
prints the median wall time of the command, the median of its baseline (``import torch``, or an
interpreter that imports nothing), their median per-round difference and ratio. The goals
(issue 32): ``--help`` under 0.5 s, ``import fastdist`` within 0.3 s of ``import torch``.
Nothing here is asserted in the test suite (tests/test_lazy_imports.py checks which modules each
command imports instead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: name -> the interpreter's arguments
COMMANDS = {
    "python (nothing imported)": ["-c", "pass"],
    "import torch": ["-c", "import torch"],
    "import fastdist": ["-c", "import fastdist"],
    "import fastdist; fd.Mesh, fd.psum, fd.simulate": [
        "-c",
        "import fastdist as fd; fd.Mesh, fd.psum, fd.simulate",
    ],
    "import fastdist.nn": ["-c", "import fastdist.nn"],
    "import fastdist.train": ["-c", "import fastdist.train"],
    "python -m fastdist --help": ["-m", "fastdist", "--help"],
}
#: row -> its baseline
ROWS = {
    "import fastdist": "import torch",
    "import fastdist; fd.Mesh, fd.psum, fd.simulate": "import torch",
    "import fastdist.nn": "import torch",
    "import fastdist.train": "import torch",
    "python -m fastdist --help": "python (nothing imported)",
}


def _run(args: list[str]) -> float:
    """Wall seconds of ``python <args>`` (it must exit 0)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, capture_output=True, timeout=300)
    return time.perf_counter() - t0


def measure(rounds: int, warmup: bool = True) -> dict[str, list[float]]:
    """Seconds per command per round, after one unmeasured round that warms the file cache."""
    names = list(COMMANDS)
    for name in names if warmup else ():
        _run(COMMANDS[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(_run(COMMANDS[name]))
    return times


def table(times: dict[str, list[float]]) -> str:
    """The markdown table of every row against its baseline."""
    out = [
        "| command | ms | baseline | baseline ms | added ms | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for row, base in ROWS.items():
        a, b = times[row], times[base]
        added = statistics.median(x - y for x, y in zip(a, b)) * 1e3
        ratio = statistics.median(x / y for x, y in zip(a, b))
        out.append(
            f"| `{row}` | {statistics.median(a) * 1e3:.0f} | `{base}` | "
            f"{statistics.median(b) * 1e3:.0f} | {added:+.0f} | {ratio:.2f} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, no warm-up (a smoke run)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, help="also write the times here as JSON")
    args = parser.parse_args()
    times = measure(1, warmup=False) if args.quick else measure(args.rounds)
    import torch

    print(
        f"start-up times, {len(times['import torch'])} rounds, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}\n"
    )
    print(table(times))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "import_time.json").write_text(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
