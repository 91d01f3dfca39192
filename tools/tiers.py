"""Run the test suite's tiers one after another and print each one's wall time against its
budget (``make test``, ``make check``; CONTRIBUTING.md, "The suite's map").

    python tools/tiers.py test      # checks, in-process (with the shared MPI world), real ranks
    python tools/tiers.py check     # lint, types, the in-process tests without MPI

Every tier runs even when an earlier one fails, so one run shows every failure and every
time; the exit status is the first failing tier's. A tier over its budget is named on its own
line: the budget is watched, not enforced (timings differ between machines).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

PY = sys.executable
#: pytest for the tiers: the in-process one on every core (a module's fixtures built once per
#: worker with --dist loadfile); the real-rank one three files at a time: much of its time is
#: spent waiting (for a kill point, a timeout, a SLURM daemon), which a third file fills
#: (CONTRIBUTING.md, "Budget", has the figures), and a file's tests stay in order
IN_PROCESS = [PY, "-m", "pytest", "-q", "-n", "auto", "--dist", "loadfile"]
REAL_RANKS = [PY, "-m", "pytest", "-q", "-n", "3", "--dist", "loadfile"]

#: (tier, commands, budget in seconds on a 2-core machine)
TIERS = {
    "test": [
        ("checks: ruff, mypy, the site", [[PY, "-m", "ruff", "check", "mpifl", "tests"],
                                          [PY, "-m", "mypy"],
                                          [PY, "-m", "mkdocs", "build", "--strict", "-q",
                                           "-d", "build/site"]], 60),
        ("in-process tests and the shared MPI world",
         [[*IN_PROCESS, "-m", "not mpi and not slurm and not replay", "--durations=15"]], 600),
        ("real ranks: mpi and slurm",
         [[*REAL_RANKS, "-m", "(mpi or slurm) and not replay", "--durations=25"]], 540),
    ],
    "check": [
        ("lint and types", [[PY, "-m", "ruff", "check", "mpifl", "tests"], [PY, "-m", "mypy"]],
         60),
        ("in-process tests without MPI",
         [[*IN_PROCESS, "-m", "not mpi and not slurm and not slow and not world and not replay"]],
         240),
    ],
}
#: the whole of each target (README.md, CONTRIBUTING.md)
TOTAL = {"test": 1200, "check": 300}


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def _counts(report: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) of a pytest JUnit XML report (zeros when it is missing)."""
    if not report.exists():
        return 0, 0, 0
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return tests - failed - skipped, failed, skipped


def main(target: str) -> int:
    results = []
    counts = [0, 0, 0]
    start = time.monotonic()
    reports = Path(tempfile.mkdtemp(prefix="mpifl-tiers-"))
    for i, (name, commands, budget) in enumerate(TIERS[target]):
        t0, status = time.monotonic(), 0
        print(f"\n=== {name} ===", flush=True)
        for j, cmd in enumerate(commands):
            report = reports / f"{i}-{j}.xml"
            if "pytest" in cmd:
                cmd = [*cmd, f"--junitxml={report}"]
            status = subprocess.run(cmd, env=os.environ).returncode
            counts = [a + b for a, b in zip(counts, _counts(report))]
            if status:
                break
        results.append((name, time.monotonic() - t0, budget, status))
    total = time.monotonic() - start
    print(f"\n=== make {target}: wall time per tier (budget on a 2-core machine) ===")
    for name, took, budget, status in results:
        verdict = "ok" if status == 0 else f"FAILED (exit {status})"
        print(f"{name:<45} {_minutes(took):>14}   budget {_minutes(budget):>14}   {verdict}")
    print(f"{'total':<45} {_minutes(total):>14}   budget {_minutes(TOTAL[target]):>14}")
    over = [name for name, took, budget, _ in results if took > budget]
    if total > TOTAL[target]:
        over.append("the whole run")
    for name in over:
        print(f"over budget: {name} (CONTRIBUTING.md, 'The suite's map', says where time goes)")
    passed, failed, skipped = counts
    print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    return next((status for *_, status in results if status), 0)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in TIERS:
        sys.exit(f"usage: python tools/tiers.py {{{'|'.join(TIERS)}}}")
    sys.exit(main(sys.argv[1]))
