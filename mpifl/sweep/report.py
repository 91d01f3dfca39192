"""``mpifl report DIR`` on a sweep folder: paper-style tables over seeds (Markdown, CSV) and
accuracy curves (PNG), from the runs that the index lists."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

from mpifl.core.errors import OutputError
from mpifl.report.tables import damaged_lines, mean_sd
from mpifl.store.results import Damaged, DamagedResults
from mpifl.sweep.plan import INDEX, read_index
from mpifl.sweep.status import read_run

SEED_KEYS = ("run.seed",)

_COLUMNS = [("mean", "mean acc (%)"), ("std", "std (pp)"), ("worst5", "worst 5% (%)"),
            ("best5", "best 5% (%)")]


def collect(folder: Path, last: int = 1) -> list[dict[str, Any]]:
    """One row per run of the sweep in ``folder`` that has an evaluation: its params and
    :func:`mpifl.report.tables.summarise` metrics (accuracies in %, std in percentage points),
    each the mean of the run's last ``last`` evaluations; and one row per run whose results
    file cannot be read: its params, path and ``damaged`` (the reason). Runs without a
    results file yet are left out.

    Raises:
        OutputError: no index in ``folder``, or one that is not a sweep index.
    """
    from mpifl.report.tables import summarise

    if not (folder / INDEX).exists():
        raise OutputError(f"{folder}: not a sweep folder (no {INDEX}); mpifl report takes "
                          "results files or a sweep folder")
    rows = []
    for rid, run in read_index(folder)["runs"].items():
        path = folder / run["results"]
        res, damage = read_run(path)
        if damage is not None:
            rows.append({"id": rid, "params": run["params"], "path": path,
                         "damaged": damage.reason})
            continue
        if res is None:
            continue  # not run yet
        try:
            rows.append({"id": rid, "params": run["params"], "path": path,
                         **summarise(path, last, res=res)})
        except OutputError:
            continue  # no evaluation yet
    return rows


def group_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group runs that differ only in their seed; mean and sample std (n-1) over the seeds of
    mean accuracy, std, worst 5% and best 5% (0 std for one seed). Only a group's complete runs
    count, unless none is complete yet (then its latest evaluations, marked 0/n). Damaged runs
    (rows with ``damaged``) count among the group's seeds, never as complete nor in a figure
    (``damaged``: how many; a group with only damaged runs has None for every figure)."""
    groups: dict[str, list] = {}
    for row in rows:
        key = json.dumps({k: v for k, v in row["params"].items() if k not in SEED_KEYS},
                         sort_keys=True)
        groups.setdefault(key, []).append(row)
    out = []
    for key, listed in groups.items():
        bad = [m for m in listed if "damaged" in m]
        read = [m for m in listed if "damaged" not in m]
        members = [m for m in read if m["status"] == "complete"] or read
        params = json.loads(key)
        g = {"algorithm": (members[0]["algorithm"] if members
                           else str(params.get("server.algorithm", "?"))),
             "setting": _setting(params),
             "seeds": len(listed), "complete": sum(m["status"] == "complete" for m in read),
             "damaged": len(bad),
             "damaged_runs": [{"path": str(m["path"]), "reason": m["damaged"]} for m in bad],
             "round": min((m["round"] for m in members), default=None),
             "runs": [m["path"] for m in members],
             "evals": sorted({m["evals"] for m in members})}
        for metric in ("mean", "std", "worst5", "best5"):
            g[metric], g[metric + "_sd"] = (mean_sd([m[metric] for m in members]) if members
                                            else (None, None))
        out.append(g)
    return out


def _setting(params: dict[str, Any]) -> str:
    items = [f"{k.split('.')[1]}={v}" for k, v in params.items() if k != "server.algorithm"]
    return ", ".join(items) or "-"


def markdown_table(groups: list[dict[str, Any]]) -> str:
    """Paper-style table: one row per algorithm and setting, mean ± std over seeds."""
    head = ["algorithm", "setting", "seeds done", "rounds"] + [label for _, label in _COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        done = f"{g['complete']}/{g['seeds']}"
        if g.get("damaged"):
            done += f" ({g['damaged']} damaged)"
        cells = [g["algorithm"], g["setting"], done,
                 "-" if g["round"] is None else str(g["round"])]
        one = len(g["runs"]) < 2  # a single run: no spread to show
        cells += ["-" if g[m] is None else f"{g[m]:.2f}" if one
                  else f"{g[m]:.2f} ± {g[m + '_sd']:.2f}" for m, _ in _COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(groups: list[dict[str, Any]], path: Path) -> None:
    """The table as CSV: one row per group, ``metric`` and ``metric_sd`` columns."""
    keys = ["algorithm", "setting", "seeds", "complete", "round"]
    keys += [k for m, _ in _COLUMNS for k in (m, m + "_sd")] + ["damaged"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(groups)


def plot_curves(groups: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Mean accuracy (%) and std (pp) against rounds, averaged over seeds: ``curves.png`` with
    every algorithm and setting, and ``curves-<algorithm>.png`` with one algorithm's settings
    (groups whose every run is damaged have no curve)."""
    groups = [g for g in groups if g["runs"]]
    algos = list(dict.fromkeys(g["algorithm"] for g in groups))
    written = [_plot(groups, "all algorithms", folder / "curves.png",
                     lambda g: f"{g['algorithm']} {g['setting']}".removesuffix(" -"))]
    for algo in algos:
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", algo)
        written.append(_plot([g for g in groups if g["algorithm"] == algo], algo,
                             folder / f"curves-{name}.png", lambda g: g["setting"]))
    return written


def _plot(groups: list[dict[str, Any]], title: str, path: Path, label) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_std) = plt.subplots(1, 2, figsize=(11, 4))
    for g in groups:
        rounds, acc, std = _mean_curves(g["runs"])
        ax_acc.plot(rounds, acc, label=label(g))
        ax_std.plot(rounds, std, label=label(g))
    ax_acc.set(xlabel="round", ylabel="mean client accuracy (%)", title=title)
    ax_std.set(xlabel="round", ylabel="std of client accuracy (pp)", title=title)
    ax_std.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _mean_curves(paths: list[Path]):
    """The seeds' curves averaged over the rounds that every seed has reached."""
    import numpy as np

    from mpifl.store.results import read_results

    evs = [read_results(p)["eval"] for p in paths]
    n = min(len(e["round"]) for e in evs)
    acc = np.mean([100 * e["mean"][:n] for e in evs], axis=0)
    std = np.mean([100 * e["std"][:n] for e in evs], axis=0)
    return evs[0]["round"][:n], acc, std


def report_sweep(folder: str | Path, as_json: bool = False, last: int = 1) -> int:
    """``mpifl report DIR``: print the table; write report.md, report.csv and curves PNGs.
    Runs whose results file cannot be read are counted as damaged in their group, listed
    (path and reason) below the table, and end the command with one line (exit status 2).

    Raises:
        DamagedResults: after the table, when a run's results file cannot be read.
        OutputError: not a sweep folder, or no run has an evaluation yet.
    """
    folder = Path(folder)
    rows = collect(folder, last)
    damaged = [Damaged(r["path"], r["damaged"]) for r in rows if "damaged" in r]
    groups = group_rows(rows)
    if not any(g["runs"] for g in groups):
        if damaged:
            raise DamagedResults(damaged)
        raise OutputError(f"{folder}: no run of this sweep has an evaluation yet")
    used = sorted({k for g in groups for k in g["evals"]})
    table = markdown_table(groups) + (
        f"\n\nEach run: the mean of its last {'/'.join(map(str, used))} evaluation(s) (asked: "
        f"{last}); then mean ± sample std over seeds." if used != [1] else "")
    if damaged:
        table += "\n\n" + "\n".join(damaged_lines(damaged))
    (folder / "report.md").write_text(table + "\n")
    write_csv(groups, folder / "report.csv")
    try:
        pngs = plot_curves(groups, folder)
    except ImportError:  # plotting is an optional extra; the tables do not need it
        pngs = []
        print("curves not drawn: matplotlib is not installed (pip install 'mpifl[plot]')",
              file=sys.stderr)
    if as_json:
        print(json.dumps([{k: v for k, v in g.items() if k != "runs"} for g in groups], indent=2))
    else:
        print(table)
        print(f"\nwritten: " + ", ".join(str(p) for p in [folder / "report.md",
                                                            folder / "report.csv", *pngs]))
    if damaged:
        raise DamagedResults(damaged)
    return 0
