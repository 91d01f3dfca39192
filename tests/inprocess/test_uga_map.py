"""analysis/uga_map.py: verdicts, tables and text on a small evals table with known numbers
(no training), and the exit-2 path on a missing or empty sweep folder."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "analysis" / "uga_map.py"


@pytest.fixture(scope="module")
def um():
    """The script as a module (analysis/ is not a package)."""
    spec = importlib.util.spec_from_file_location("uga_map", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (alpha, E, algorithm, eta_g, seed, status, final global, final adapted); lr = 0.02 everywhere.
RUNS = [
    (0.1, 2, "fedavg", 1.0, 0, "complete", 0.58, 0.89),
    (0.1, 2, "fedavg", 1.0, 1, "complete", 0.62, 0.91),
    (0.1, 2, "uga", 1.0, 0, "complete", 0.59, 0.80),     # -1 pp: learns
    (0.1, 2, "uga", 2.0, 0, "complete", 0.40, 0.70),
    (0.1, 5, "fedavg", 1.0, 0, "complete", 0.60, 0.90),
    (0.1, 5, "uga", 1.0, 0, "complete", 0.50, 0.89),     # -10 / -1 pp: after adaptation
    (0.5, 2, "fedavg", 1.0, 0, "complete", 0.70, 0.85),
    (0.5, 2, "uga", 1.0, 0, "complete", 0.10, 0.20),     # fails, diverged
    (0.5, 2, "uga", 2.0, 0, "complete", 0.30, 0.50),     # fails
    (0.5, 5, "fedavg", 1.0, 0, "complete", 0.70, 0.85),
    (0.5, 5, "uga", 1.0, 0, "running", 0.69, 0.84),      # unfinished: not counted
]


def evals_frame() -> pd.DataFrame:
    """A ``tables()["evals"]``-like frame: 3 evaluations a run; the last two average to the
    run's final values, the first (0.0) must not count."""
    rows = []
    for alpha, e, alg, eta, seed, status, g, a in RUNS:
        run = f"{alg}{eta:g}_a{alpha}_E{e}_s{seed}"
        for rnd, off in ((10, None), (20, -0.01), (30, 0.01)):
            rows.append({"run": run, "eval_round": rnd, "status": status, "algorithm": alg,
                         "uga.eta_g": eta, "data.dirichlet_alpha": alpha, "client.epochs": e,
                         "client.lr": 0.02, "seed": seed,
                         "mean": 0.0 if off is None else g + off,
                         "adapted_mean": 0.0 if off is None else a + off,
                         "worst5": 0.0 if off is None else g / 2})
    return pd.DataFrame(rows)


def expected_frame(um) -> pd.DataFrame:
    """The planned grid: 2 FedAvg seeds and 1 seed per UGA eta_g for every setting."""
    rows = [{"alpha": al, "E": e, "lr": 0.02, "method": m, "seed": s}
            for al in (0.1, 0.5) for e in (2, 5)
            for m, seeds in (("FedAvg", (0, 1)), ("UGA eta_g=1", (0,)), ("UGA eta_g=2", (0,)))
            for s in seeds]
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def results(um):
    evals = um.tidy(evals_frame())
    summary = um.summarise(um.per_seed(evals), expected_frame(um))
    return summary, um.verdicts(summary), um.deltas(summary)


def cells(markdown: str) -> list[list[str]]:
    """The data rows of a markdown table, each a list of stripped cells."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in markdown.splitlines()[2:]]


def test_per_seed_uses_last_two_evaluations_and_flags_divergence(um):
    seeds = um.per_seed(um.tidy(evals_frame())).set_index("run")
    assert len(seeds) == 10                                # the running run is left out
    assert seeds.loc["fedavg1_a0.1_E2_s0", "global"] == pytest.approx(0.58)
    assert seeds.loc["uga1_a0.5_E2_s0", "diverged"]
    assert not seeds.loc["uga2_a0.5_E2_s0", "diverged"]


def test_verdicts(um, results):
    _, v, _ = results
    got = {(r.alpha, r.E): (r.verdict, r.uga if isinstance(r.uga, str) else None)
           for r in v.itertuples()}
    assert got == {(0.1, 2): ("learns", "UGA eta_g=1"),
                   (0.1, 5): ("learns after adaptation", "UGA eta_g=1"),
                   (0.5, 2): ("fails", "UGA eta_g=2"),
                   (0.5, 5): ("pending", None)}
    row = v[(v.alpha == 0.1) & (v.E == 2)].iloc[0]
    assert row.d_global == pytest.approx(-0.01) and row.fedavg_global == pytest.approx(0.60)
    assert v[(v.alpha == 0.5) & (v.E == 2)].iloc[0].diverged == "UGA eta_g=1 x1"
    assert um.verdict(0.6, 0.9, np.nan, np.nan) == "fails"
    assert um.verdict(np.nan, np.nan, 0.5, 0.5) == "pending"


def test_rendered_rows(um, results):
    summary, v, _ = results
    rows = cells(um.summary_markdown(summary[summary.alpha == 0.1]))
    assert rows[0] == ["2", "0.02", "FedAvg", "2 of 2", "60.0 ± 2.0", "90.0 ± 1.0", "30.0 ± 1.0", "0"]
    assert rows[1][2:6] == ["UGA eta_g=1", "1 of 1", "59.0", "80.0"]
    pending = cells(um.summary_markdown(summary[summary.alpha == 0.5]))
    assert pending[4][2:5] == ["UGA eta_g=1", "0 of 1", "n/a"]
    methods = ["FedAvg", "UGA eta_g=1", "UGA eta_g=2"]
    table = um.verdict_markdown(v, methods)
    assert "seeds done (FedAvg / UGA eta_g=1 / UGA eta_g=2)" in table.splitlines()[0]
    vrows = cells(table)
    assert vrows[0][12] == "2/2 / 1/1 / 1/1" and vrows[3][10] == "pending"
    assert vrows[0][3:7] == ["60.0", "UGA eta_g=1", "59.0", "-1.0"]
    assert vrows[1][10] == "learns after adaptation" and vrows[1][9] == "-1.0"
    assert vrows[2][10:12] == ["fails", "UGA eta_g=1 x1"]


def test_paragraph_and_figure(um, results, tmp_path):
    summary, v, d = results
    text = um.alpha_paragraph(0.1, v[v.alpha == 0.1], d[d.alpha == 0.1])
    assert "2 of 2 settings" in text and "UGA learns in 1 of them (E=2, lr=0.02: -1.0 pp)" in text
    assert "UGA eta_g=1 in 1 of 1 settings" in text        # eta_g=1 beats eta_g=2 at E=2
    png = tmp_path / "m.png"
    um.plot(d, summary, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_eval_cost(um):
    evals = evals_frame()
    runs = evals[["run", "algorithm", "uga.eta_g", "data.dirichlet_alpha", "client.epochs",
                  "client.lr"]].drop_duplicates()
    rounds = runs.merge(pd.DataFrame({"round": range(30)}), how="cross")
    rounds["time_train"] = 1.0
    rounds["time_eval"] = np.where(rounds["round"] % 10 == 9, 4.0, 0.0)
    cost = um.eval_cost(um.tidy(rounds), um.tidy(evals)).set_index(["method", "E"])
    assert cost.loc[("FedAvg", 2), "evaluations"] == 9     # 3 FedAvg runs with E=2 x 3
    assert cost.loc[("FedAvg", 2), "ratio"] == pytest.approx(4.0)


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_exit_2_on_missing_or_empty_folder(tmp_path, make):
    folder = tmp_path / "sweep"
    if make == "empty":
        folder.mkdir()
        (folder / "index.json").write_text(json.dumps({"runs": {}}))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(folder), "--doc", str(tmp_path / "n.md")],
                          check=False, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "n.md").exists()


def test_document(um, results):
    summary, v, d = results
    cost = pd.DataFrame({"method": ["FedAvg"], "E": [2], "evaluations": [6], "time_eval": [6.5],
                         "time_train": [0.65], "ratio": [10.0]})
    intro = {"commands": ["mpifl sweep S.toml --out F --executor local", "python x.py F"],
             "sweep": "S.toml", "shared": "Shared setup.", "last": 2}
    text = um.document(summary, v, d, cost, "m.png", intro)
    assert "**Finished runs: 10 of 16.**" in text and "python x.py F" in text
    assert "![UGA minus FedAvg, final accuracy](m.png)" in text
    assert text.count("## alpha = ") == 2
    assert "FedAvg with E=2: 6.50 s per evaluation, 10.0x the 0.65 s of a round's training" in text
