"""``mpifl reproduce``: the reproduction suites of jobs/repro are valid sweeps, and the table
generator (mpifl/report/reproductions.py) on a tiny real suite (2 rules x 2 seeds of a small
Fashion-MNIST job, run through the local sweep launcher) writes the figures that the results
files hold, computed here directly with h5py; verdicts and order claims on chosen numbers."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.report.reproductions import (FigureRow, Measured, load_figures, order_verdicts,
                                        render, verdict)
from mpifl.sweep.plan import check, grid_points
from mpifl.sweep.reproduce import FIGURES, suite_files
from mpifl.sweep.spec import load_sweep
from tests.helpers import small_fmnist_job, write_fmnist_job

pytestmark = pytest.mark.slow  # whole runs in every module fixture: left out of make check

ROOT = Path(__file__).resolve().parents[2]
REPRO = ROOT / "jobs" / "repro"


def mpifl(*args: str, code: int = 0) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "mpifl", *map(str, args)], capture_output=True,
                         text=True, cwd=ROOT, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == code, out.stdout[-2000:] + out.stderr[-3000:]
    return out


# ---------------------------------------------------------------- the shipped suites


@pytest.mark.parametrize("suite", sorted(p.stem for p in REPRO.glob("*.toml") if p.name != FIGURES))
def test_every_shipped_suite_expands_to_valid_runs_over_three_seeds(suite):
    sweep = load_sweep(REPRO / f"{suite}.toml")
    points = grid_points(sweep)
    for p in points:
        assert check(sweep, p)[1] is None, p.id
    seeds = {p.params["run.seed"] for p in points}
    assert len(seeds) >= 3
    header = (REPRO / f"{suite}.toml").read_text().split("\n[")[0]
    assert "Reproduces:" in header and "Departures from the paper" in header


def test_every_figure_row_selects_runs_of_its_suite():
    rows = load_figures(REPRO / FIGURES)
    suites = suite_files(REPRO, [])
    for row in rows:
        assert row.suite in suites, row
        params = [p.params for p in grid_points(load_sweep(suites[row.suite]))]
        picked = [p for p in params if all(p.get(k) == v for k, v in row.select.items())]
        assert len(picked) >= 3, (row.method, row.metric, row.select)
    for claim in {r.claim for r in rows if r.claim}:
        ranks = [r.rank for r in rows if r.claim == claim]
        assert len(ranks) >= 2 and len(set(ranks)) >= 2, claim


# ---------------------------------------------------------------- verdicts


def test_verdict_thresholds():
    assert verdict(80.0, None, 81.9) == "reproduced"
    assert verdict(80.0, 3.0, 77.5) == "reproduced"  # within the paper's error bar
    assert verdict(80.0, None, 84.0) == "close"
    assert verdict(80.0, None, 74.0) == "not reproduced"
    assert verdict(80.0, None, math.nan) == "not run"


def test_order_claims():
    rows = [FigureRow(suite="s", section="x", method=m, metric="std", claim="c", rank=k)
            for m, k in (("a", 1), ("b", 2), ("c", 2))]

    def measured(*means):
        return [Measured(values=[v]) for v in means]

    assert order_verdicts(rows, measured(1.0, 2.0, 1.5)) == {"c": "reproduced"}  # tie: any order
    assert order_verdicts(rows, measured(1.6, 2.0, 1.5)) == {"c": "not reproduced"}
    assert order_verdicts(rows, [Measured(), *measured(1, 2)]) == {"c": "not run"}


def test_a_milestone_never_reached_is_shown_and_ranked_last():
    assert Measured(values=[math.inf, 12.0]).shown() == "never (1 of 2 seeds; the others: 12.0)"
    assert Measured(values=[math.inf]).shown() == "never (1 of 1 seeds)"
    assert Measured(values=[10.0, 12.0]).shown() == "11.0 ± 1.4"
    rows = [FigureRow(suite="s", section="x", method=m, metric="rounds_to:60", claim="c", rank=k)
            for m, k in (("fast", 1), ("slow", 2))]
    slow_never = [Measured(values=[9.0, 11.0]), Measured(values=[math.inf, 5.0])]
    assert order_verdicts(rows, slow_never) == {"c": "reproduced"}
    assert order_verdicts(rows, slow_never[::-1]) == {"c": "not reproduced"}


def test_each_reason_is_written_once_a_section_and_rows_point_to_it():
    long = "the paper's split is not given; " * 20  # a long reason, shared by four rows

    def row(section, method, metric, value, why=None):
        return FigureRow(suite="s", section=section, method=method, metric=metric, value=value,
                         why=why)

    rows = [row("A", "FedAvg", "mean", 50.0, long),       # not reproduced [1]
            row("A", "FedAvg", "dp", 10.0, "two-group gap"),  # close [2]
            row("A", "FedAvg", "eo", 10.0, long),         # not reproduced [1]
            row("A", "Ditto", "mean", 80.0, long),        # reproduced: no reason shown
            row("A", "Ditto", "dp", 10.0),                # not reproduced, no why [3]
            row("A", "Ditto", "eo", 10.0, long),          # close [1]
            row("A", "Ditto", "ap", 10.0),                # not reproduced, no why [3]
            row("B", "FedAvg", "mean", 50.0, long),       # another section: its own note [1]
            row("B", "FedAvg", "cf", 10.0, "two-group gap")]  # [2]
    measured = [Measured(values=[v]) for v in (80.0, 14.0, 20.0, 80.0, 20.0, 6.0, 20.0, 80.0, 14.0)]
    text = render(rows, measured, command="mpifl reproduce", machine="m", suites={}, last=1)
    a, b = text.split("\n## ")[1:3]
    assert a.startswith("A\n") and b.startswith("B\n")
    verdicts = {(c[0], c[1]): c[7] for c in
                (line[2:-2].split(" | ") for line in a.splitlines() if line.startswith("| ")
                 and not line.startswith("| method"))}
    assert verdicts == {("FedAvg", "mean"): "not reproduced [1]", ("FedAvg", "dp"): "close [2]",
                        ("FedAvg", "eo"): "not reproduced [1]", ("Ditto", "mean"): "reproduced",
                        ("Ditto", "dp"): "not reproduced [3]", ("Ditto", "eo"): "close [1]",
                        ("Ditto", "ap"): "not reproduced [3]"}
    notes = [line for line in a.splitlines() if line.startswith("- [")]
    assert notes == [f"- [1] FedAvg (mean, eo), Ditto (eo): {long}",
                     "- [2] FedAvg (dp): two-group gap",
                     "- [3] Ditto (dp, ap): reason not found yet."]
    assert a.count(long) == 1 and text.count(long) == 2  # once a section
    assert "| FedAvg | mean | 50.0 | 80.0 ± 0.0 | 1 | +30.0 | - | not reproduced [1] |" in b
    assert "| FedAvg | cf | 10.0 | 14.0 ± 0.0 | 1 | +4.0 | - | close [2] |" in b
    assert [line for line in b.splitlines() if line.startswith("- [")] == [
        f"- [1] FedAvg (mean): {long}", "- [2] FedAvg (cf): two-group gap"]
    assert render(rows, measured, command="mpifl reproduce", machine="m", suites={},
                  last=1) == text  # deterministic


def test_bad_figures_file_is_one_line_exit_2(tmp_path):
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "a.toml").write_text((REPRO / "fedfv-order.toml").read_text()
                                   .replace('"../fmnist-fedfv.toml"', f'"{ROOT / "jobs" / "fmnist-fedfv.toml"}"'))
    (suites / FIGURES).write_text('[[row]]\nsuite = "a"\nsection = "s"\nmethod = "m"\n'
                                  'metric = "accuracy"\n')
    out = mpifl("reproduce", "--suites", suites, "--report-only", "--out", tmp_path / "o",
                "--doc", tmp_path / "R.md", code=2)
    assert out.stderr.count("\n") == 1 and "row 1: metric: " in out.stderr, out.stderr
    out = mpifl("reproduce", "nope", "--suites", suites, "--doc", tmp_path / "R.md", code=2)
    assert "unknown suite 'nope'; known: a" in out.stderr
    (suites / FIGURES).write_text('[[row]]\nsuite = "a"\nsection = "s"\nmethod = "m"\n'
                                  'metric = "mean"\n\n[[row]]\nsuite = "typo"\nsection = "s"\n'
                                  'method = "m"\nmetric = "mean"\n')
    out = mpifl("reproduce", "a", "--suites", suites, "--report-only", "--out", tmp_path / "o",
                "--doc", tmp_path / "R.md", code=2)
    assert "suite 'typo' has no file" in out.stderr and out.stderr.count("\n") == 1
    assert not (tmp_path / "R.md").exists()


# ---------------------------------------------------------------- a tiny real suite


TINY = """# Reproduces: nothing (a test suite).
# Departures from the paper: all.
[sweep]
name = "tiny"
base = "{base}"
ranks = 1

[grid]
"run.seed" = [0, 1]

[algorithms.fedavg]
[algorithms.fedfv]
"fedfv.alpha" = [0.0]
"fedfv.tau" = [0]

[local]
parallelism = 2
"""

FIGS = """
[[row]]
suite = "tiny"
section = "A paper, Table 1"
method = "FedAvg"
select = {{"server.algorithm" = "fedavg"}}
metric = "mean"
value = {fedavg_mean}
claim = "tiny-mean"
rank = 1

[[row]]
suite = "tiny"
section = "A paper, Table 1"
method = "FedFV"
select = {{"server.algorithm" = "fedfv"}}
metric = "mean"
claim = "tiny-mean"
rank = 2

[[row]]
suite = "tiny"
section = "A paper, Table 1"
method = "FedFV"
select = {{"server.algorithm" = "fedfv"}}
metric = "worst5"
value = 99.0
why = "the test's made-up figure"

[[row]]
suite = "tiny"
section = "A paper, Table 1"
method = "FedFV"
select = {{"server.algorithm" = "fedfv"}}
metric = "rounds_to:15"
paper_text = "12 (elsewhere)"
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    job = write_fmnist_job(tmp_path_factory, "tiny.toml", small_fmnist_job(
        "tiny", seed=0, rounds=4, eval_every=1, checkpoint_every=0,
        partition='partition = "shards"', algorithm="fedavg"))
    suites = job.parent / "suites"
    suites.mkdir()
    (suites / "tiny.toml").write_text(TINY.format(base=job))
    (suites / FIGURES).write_text(FIGS.format(fedavg_mean=12.5))
    out, doc = job.parent / "out", job.parent / "R.md"
    run = mpifl("reproduce", "--suites", suites, "--out", out, "--doc", doc, "--last", 2)
    return suites, out, doc, run


def direct(out: Path, algorithm: str, key: str, last: int = 2) -> list[float]:
    """The oracle: each seed's figure read straight from its results file."""
    values = []
    for seed in (0, 1):
        name = f"{algorithm}_seed{seed}" if algorithm == "fedavg" else f"fedfv_alpha0.0_tau0_seed{seed}"
        with h5py.File(out / "tiny" / "runs" / f"{name}.h5") as f:
            assert f.attrs["status"] == "complete"
            if key.startswith("rounds_to:"):
                hit = np.flatnonzero(f["eval/mean"][()] >= float(key.split(":")[1]) / 100)
                values.append(float(f["eval/round"][hit[0]] + 1) if hit.size else math.inf)
            else:
                values.append(100 * float(f[f"eval/{key}"][-last:].mean()))
    return values


def test_tiny_suite_table_holds_the_results_files_figures(tiny):
    suites, out, doc, run = tiny
    text = doc.read_text()
    assert f"{doc}: Summary:" in run.stdout
    fedavg = direct(out, "fedavg", "mean")
    m, sd = np.mean(fedavg), np.std(fedavg, ddof=1)
    row = next(line for line in text.splitlines() if line.startswith("| FedAvg | mean |"))
    assert f"| 12.5 | {m:.1f} ± {sd:.1f} | 2 | {m - 12.5:+.1f} |" in row, row
    worst = direct(out, "fedfv", "worst5")
    row = next(line for line in text.splitlines() if line.startswith("| FedFV | worst5 |"))
    assert f"{np.mean(worst):.1f} ± {np.std(worst, ddof=1):.1f}" in row and "not reproduced" in row
    note = row.rsplit("[", 1)[1].split("]")[0]  # FedAvg's row may come first, without a why
    assert row.endswith(f"| not reproduced [{note}] |")
    assert f"- [{note}] FedFV (worst5): the test's made-up figure" in text
    reached = direct(out, "fedfv", "rounds_to:15")
    row = next(line for line in text.splitlines() if line.startswith("| FedFV | rounds_to:15 |"))
    shown = "never" if math.isinf(np.mean(reached)) else f"{np.mean(reached):.1f}"
    assert f"| 12 (elsewhere) | {shown} ±" in row, row
    assert "Reproduces: nothing (a test suite)." in text  # the suite's header, copied
    fedfv = direct(out, "fedfv", "mean")
    held = "reproduced" if np.mean(fedavg) < np.mean(fedfv) else "not reproduced"
    claim = next(line for line in text.splitlines() if line.startswith("- Order claim `tiny-mean`"))
    assert f"#1 FedAvg: {m:.1f} ± {sd:.1f}; #2 FedFV: {np.mean(fedfv):.1f}" in claim, claim
    assert claim.endswith(f"**{held}**") and f"order claims: 1 {held}" in text


def test_rerun_skips_finished_runs_and_report_only_rewrites(tiny):
    suites, out, doc, _ = tiny
    before = {p: p.stat().st_mtime_ns for p in (out / "tiny" / "runs").glob("*.h5")}
    (suites / FIGURES).write_text(FIGS.format(fedavg_mean=40.0))
    mpifl("reproduce", "--suites", suites, "--out", out, "--doc", doc, "--last", 2)
    assert {p: p.stat().st_mtime_ns for p in (out / "tiny" / "runs").glob("*.h5")} == before
    assert "| FedAvg | mean | 40.0 |" in doc.read_text()
    mpifl("reproduce", "--suites", suites, "--out", out, "--doc", doc, "--report-only", "--only",
          "run.seed=0")
    assert "| FedAvg | mean | 40.0 |" in doc.read_text()
