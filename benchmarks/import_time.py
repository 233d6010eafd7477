"""Start-up cost: every fastdist namespace and ``python -m fastdist --help`` vs ``import torch``.

    python benchmarks/import_time.py            # 9 rounds, about 5 min on 2 CPU cores
    python benchmarks/import_time.py --quick    # 1 round, no warm-up, 5 commands (the smoke test)

Two measures per namespace:

* wall: each command runs in a fresh interpreter (``python -c ...``), the commands of one round
  one after another in a rotating order, so that every row and its baseline see the same machine
  load. A row prints the median wall time of the command, the median of its baseline
  (``import torch``, or an interpreter that imports nothing), their median per-round difference
  and ratio.
* in-process: ``python -X importtime -c "import torch; import <namespace>"`` in a fresh
  interpreter. The cumulative ``-X importtime`` of every top-level import after ``torch`` is
  what the namespace adds over torch, without the interpreter's start and exit; the CPU time
  (``time.process_time``) of the same import is the least sensitive to other jobs on the machine
  (an import runs on one thread). Medians over rounds, and the three costliest modules it
  brought in (their own, ``self``, time, averaged over the rounds: the culprit of a regression).

Python writes and reads its bytecode caches here as for any user (``PYTHONDONTWRITEBYTECODE`` is
dropped for the commands: without the caches every import of fastdist compiles its sources,
about 0.5 s); the unmeasured warm-up round writes them.

The goals (issues 32 and 42): ``--help`` under 0.5 s, every namespace within 0.3 s of
``import torch``. Nothing here is asserted in the test suite (tests/test_lazy_imports.py and
tests/test_import_time.py check which modules each import loads instead).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: every namespace a user imports (``fastdist`` itself imports nothing until a name is used);
#: tests/test_import_time.py reads this list and checks it names every subpackage
NAMESPACES = (
    "fastdist.nn",
    "fastdist.train",
    "fastdist.checkpoint",
    "fastdist.profile",
    "fastdist.serving",
    "fastdist.core",
    "fastdist.comm",
    "fastdist.ops",
    "fastdist.sim",
    "fastdist.check",
    "fastdist.tools",
    "fastdist.testing",
)
#: name -> the interpreter's arguments
COMMANDS = {
    "python (nothing imported)": ["-c", "pass"],
    "import torch": ["-c", "import torch"],
    "import fastdist": ["-c", "import fastdist"],
    "import fastdist; fd.Mesh, fd.psum, fd.simulate": [
        "-c",
        "import fastdist as fd; fd.Mesh, fd.psum, fd.simulate",
    ],
    **{f"import {ns}": ["-c", f"import {ns}"] for ns in NAMESPACES},
    "python -m fastdist --help": ["-m", "fastdist", "--help"],
}
#: row -> its baseline
ROWS = {
    name: ("python (nothing imported)" if name.startswith("python -m") else "import torch")
    for name in COMMANDS
    if name not in ("python (nothing imported)", "import torch")
}


#: the commands' environment: bytecode caches written and read, as for a user
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _run(args: list[str]) -> float:
    """Wall seconds of ``python <args>`` (it must exit 0)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, capture_output=True, timeout=300, env=ENV)
    return time.perf_counter() - t0


#: the smoke run's commands (``--quick``): the baselines, the top-level import, one namespace
QUICK = (
    "python (nothing imported)",
    "import torch",
    "import fastdist",
    "import fastdist.nn",
    "python -m fastdist --help",
)


def measure(
    rounds: int, warmup: bool = True, names: list[str] | None = None
) -> dict[str, list[float]]:
    """Seconds per command (default all) per round, after one unmeasured round that warms the
    file cache."""
    names = list(COMMANDS) if names is None else names
    for name in names if warmup else ():
        _run(COMMANDS[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(_run(COMMANDS[name]))
    return times


def importtime(ns: str) -> tuple[float, float, dict[str, float]]:
    """Seconds ``import <ns>`` adds after ``import torch`` by ``-X importtime`` (the cumulative
    time of the top-level imports after torch's), its CPU seconds, and each module's own seconds
    among them."""
    code = (
        f"import torch, time; c = time.process_time(); import {ns}; print(time.process_time() - c)"
    )
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    total, after_torch = 0.0, False
    own: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, name = line.removeprefix("import time:").split("|")
        if name.strip() == "torch" and not name.startswith("  "):
            after_torch = True
        elif after_torch:
            own[name.strip()] = own.get(name.strip(), 0.0) + int(self_us) / 1e6
            if not name.startswith("  "):  # a top-level import: its cumulative time counts
                total += int(cum_us) / 1e6
    return total, float(proc.stdout.split()[-1]), own


def measure_importtime(
    rounds: int, namespaces: tuple[str, ...] = NAMESPACES
) -> dict[str, dict[str, object]]:
    """Per namespace: the seconds of every round and the costliest modules of all rounds."""
    out: dict[str, dict[str, object]] = {}
    for ns in namespaces:
        totals, cpu, own = [], [], dict[str, float]()
        for _ in range(rounds):
            t, c, o = importtime(ns)
            totals.append(t)
            cpu.append(c)
            for m, x in o.items():
                own[m] = own.get(m, 0.0) + x
        top = sorted(own.items(), key=lambda kv: -kv[1])[:3]
        out[ns] = {"seconds": totals, "cpu_seconds": cpu, "top": top}
    return out


def table(times: dict[str, list[float]], xtimes: dict[str, dict[str, object]]) -> str:
    """The markdown table of every row against its baseline."""
    out = [
        "| command | ms | baseline | baseline ms | added ms | ratio | `-X importtime` ms "
        "| CPU ms | costliest modules (own ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row, base in ROWS.items():
        if row not in times:  # not measured (--quick)
            continue
        a, b = times[row], times[base]
        added = statistics.median(x - y for x, y in zip(a, b)) * 1e3
        ratio = statistics.median(x / y for x, y in zip(a, b))
        x = xtimes.get(row.removeprefix("import "))
        xs, cs, top = "", "", ""
        if x is not None:
            secs: list[float] = x["seconds"]  # type: ignore[assignment]
            cpu: list[float] = x["cpu_seconds"]  # type: ignore[assignment]
            xs, cs = f"{statistics.median(secs) * 1e3:.0f}", f"{statistics.median(cpu) * 1e3:.0f}"
            pairs: list[tuple[str, float]] = x["top"]  # type: ignore[assignment]
            top = ", ".join(f"{m} {s / len(secs) * 1e3:.0f}" for m, s in pairs)
        out.append(
            f"| `{row}` | {statistics.median(a) * 1e3:.0f} | `{base}` | "
            f"{statistics.median(b) * 1e3:.0f} | {added:+.0f} | {ratio:.2f} | {xs} | {cs} | {top} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 round, no warm-up, 5 commands (a smoke run)"
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, help="also write the times here as JSON")
    args = parser.parse_args()
    load_before = os.getloadavg()
    if args.quick:
        times = measure(1, warmup=False, names=list(QUICK))
        xtimes = measure_importtime(1, ("fastdist.nn",))
    else:
        times, xtimes = measure(args.rounds), measure_importtime(args.rounds)
    load_after = os.getloadavg()
    import torch

    print(
        f"start-up times, {len(times['import torch'])} rounds, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average (1, 5, 15 min) "
        f"{' '.join(f'{x:.2f}' for x in load_before)} before, "
        f"{' '.join(f'{x:.2f}' for x in load_after)} after\n"
    )
    print(table(times, xtimes))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "import_time.json").write_text(json.dumps(times, indent=1))
        (args.out / "import_time_x.json").write_text(json.dumps(xtimes, indent=1))


if __name__ == "__main__":
    main()
