"""``mpifl report DIR`` on a sweep folder: paper-style tables over seeds (Markdown, CSV) and
accuracy curves (PNG), from the runs that the index lists (in a ``--seeds`` folder, those of the
seeds its ``seeds.toml`` lists: :func:`mpifl.store.sweep_index.listed_runs`).

Units: the table, ``report.md`` and ``report.csv`` are in percent and percentage points (a
regression sweep: the loss's units); ``--json`` in fractions, as the results files.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

from mpifl.core.errors import OutputError
from mpifl.report.tables import as_fractions, damaged_lines, mean_sd
from mpifl.store.results import Damaged, DamagedResults
from mpifl.store.sweep_index import listed_runs
from mpifl.sweep.plan import INDEX
from mpifl.sweep.status import read_run

SEED_KEYS = ("run.seed",)

_COLUMNS = [("mean", "mean acc (%)"), ("std", "std (pp)"), ("worst5", "worst 5% (%)"),
            ("best5", "best 5% (%)")]
#: A regression sweep's columns (``[model] loss = "mse"``): the clients' test losses.
_LOSS_COLUMNS = [("loss_mean", "mean loss"), ("loss_std", "std of loss"),
                 ("loss_worst5", "worst 5% loss"), ("loss_best5", "best 5% loss")]


def collect(folder: Path, last: int = 1) -> tuple[list[dict[str, Any]], str | None]:
    """One row per run of the sweep in ``folder`` that has a results file: its params and
    :func:`mpifl.report.tables.summarise` metrics (accuracies in %, std in percentage points),
    each the mean of the run's last ``last`` evaluations (a run not complete and without an
    evaluation yet: its progress, ``evals`` 0); and one row per run whose results file cannot
    be read: its params, path and ``damaged`` (the reason). Runs without a results file yet,
    and complete runs without an evaluation, are left out. Also the note of a ``--seeds``
    folder on the runs of other seeds it holds (None if none).

    Raises:
        OutputError: no index in ``folder``, or one that is not a sweep index.
    """
    from mpifl.report.tables import summarise

    if not (folder / INDEX).exists():
        raise OutputError(f"{folder}: not a sweep folder (no {INDEX}); mpifl report takes "
                          "results files or a sweep folder")
    rows = []
    runs, note = listed_runs(folder)
    for rid, run in runs.items():
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
            continue  # complete without an evaluation: nothing to show
    return rows, note


def group_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group runs that differ only in their seed; mean and sample std (n-1) over the seeds of
    mean accuracy, std, worst 5% and best 5% (a regression sweep: of the loss summaries; 0 std
    for one seed). Only a group's complete runs count, unless none is complete yet (then its
    latest evaluations, marked 0/n). Damaged runs (rows with ``damaged``) and runs without an
    evaluation yet count among the group's seeds, never as complete nor in a figure
    (``damaged``: how many; a group with only such runs has None for every figure)."""
    groups: dict[str, list] = {}
    for row in rows:
        key = json.dumps({k: v for k, v in row["params"].items() if k not in SEED_KEYS},
                         sort_keys=True)
        groups.setdefault(key, []).append(row)
    out = []
    for key, listed in groups.items():
        bad = [m for m in listed if "damaged" in m]
        read = [m for m in listed if "damaged" not in m and m["evals"]]
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
        for metric, _ in _COLUMNS + _LOSS_COLUMNS:
            vals = [m[metric] for m in members if metric in m]
            g[metric], g[metric + "_sd"] = (mean_sd(vals) if vals and len(vals) == len(members)
                                            else (None, None))
        out.append(g)
    return out


def _columns(groups: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The accuracy columns, or the loss columns when the figures are losses (regression)."""
    losses = any(g["loss_mean"] is not None for g in groups)
    accuracies = any(g["mean"] is not None for g in groups)
    return (_LOSS_COLUMNS if losses and not accuracies else
            _COLUMNS + _LOSS_COLUMNS if losses else _COLUMNS)


def _setting(params: dict[str, Any]) -> str:
    items = [f"{k.split('.')[1]}={v}" for k, v in params.items() if k != "server.algorithm"]
    return ", ".join(items) or "-"


def markdown_table(groups: list[dict[str, Any]]) -> str:
    """Paper-style table: one row per algorithm and setting, mean ± std over seeds."""
    columns = _columns(groups)
    head = ["algorithm", "setting", "seeds done", "rounds"] + [label for _, label in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        done = f"{g['complete']}/{g['seeds']}"
        if g.get("damaged"):
            done += f" ({g['damaged']} damaged)"
        cells = [g["algorithm"], g["setting"], done,
                 "-" if g["round"] is None else str(g["round"])]
        one = len(g["runs"]) < 2  # a single run: no spread to show
        cells += ["-" if g[m] is None else _fmt(m, g[m]) if one
                  else f"{_fmt(m, g[m])} ± {_fmt(m, g[m + '_sd'])}" for m, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(metric: str, value: float) -> str:
    return f"{value:.5g}" if metric.startswith("loss_") else f"{value:.2f}"


def write_csv(groups: list[dict[str, Any]], path: Path) -> None:
    """The table as CSV: one row per group, ``metric`` and ``metric_sd`` columns (percent and
    percentage points, as the table; a regression sweep's losses in the loss's units)."""
    keys = ["algorithm", "setting", "seeds", "complete", "round"]
    keys += [k for m, _ in _columns(groups) for k in (m, m + "_sd")] + ["damaged"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(groups)


def plot_curves(groups: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Mean accuracy (%) and std (pp) against rounds (a regression sweep: mean and std of the
    clients' losses), averaged over seeds: ``curves.png`` with every algorithm and setting, and
    ``curves-<algorithm>.png`` with one algorithm's settings (groups without an evaluated run
    have no curve; none at all: no file)."""
    groups = [g for g in groups if g["runs"]]
    if not groups:
        return []
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

    losses = groups[0]["mean"] is None  # a regression sweep
    fig, (ax_acc, ax_std) = plt.subplots(1, 2, figsize=(11, 4))
    for g in groups:
        rounds, acc, std = _mean_curves(g["runs"], losses)
        ax_acc.plot(rounds, acc, label=label(g))
        ax_std.plot(rounds, std, label=label(g))
    what = ("client loss", "") if losses else ("client accuracy", " (%)")
    ax_acc.set(xlabel="round", ylabel=f"mean {what[0]}{what[1]}", title=title)
    ax_std.set(xlabel="round", ylabel=f"std of {what[0]}{' (pp)' if what[1] else ''}",
               title=title)
    ax_std.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _mean_curves(paths: list[Path], losses: bool = False):
    """The seeds' curves (mean and std: accuracies in % and pp, or losses) averaged over the
    rounds that every seed has reached."""
    import numpy as np

    from mpifl.store.results import read_results

    evs = [read_results(p)["eval"] for p in paths]
    n = min(len(e["round"]) for e in evs)
    keys, scale = (("loss/mean", "loss/std"), 1.0) if losses else (("mean", "std"), 100.0)
    acc = np.mean([scale * e[keys[0]][:n] for e in evs], axis=0)
    std = np.mean([scale * e[keys[1]][:n] for e in evs], axis=0)
    return evs[0]["round"][:n], acc, std


def progress_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per run that has no evaluation yet: its status, rounds done and when its
    results file was last written."""
    return [f"{r['id']}: {r['status']}, no evaluation yet: round {r['round']} of "
            f"{r.get('rounds', '?')} done, last round written {r['last_round_at']}"
            for r in rows if "damaged" not in r and not r["evals"]]


def report_sweep(folder: str | Path, as_json: bool = False, last: int = 1) -> int:
    """``mpifl report DIR``: print the table; write report.md, report.csv and curves PNGs.
    Runs whose results file cannot be read are counted as damaged in their group, listed
    (path and reason) below the table, and end the command with one line (exit status 2).
    Runs without an evaluation yet are listed with their progress below it; in a ``--seeds``
    folder, a note names the runs of seeds that ``seeds.toml`` does not list (left out).
    ``--json`` prints the groups with accuracies as fractions (the note on standard error).

    Raises:
        DamagedResults: after the table, when a run's results file cannot be read.
        OutputError: not a sweep folder, or no run has an evaluation yet nor is under way.
    """
    folder = Path(folder)
    rows, note = collect(folder, last)
    damaged = [Damaged(r["path"], r["damaged"]) for r in rows if "damaged" in r]
    pending = progress_lines(rows)
    groups = group_rows(rows)
    if not any(g["runs"] for g in groups) and not pending:
        if damaged:
            raise DamagedResults(damaged)
        raise OutputError(f"{folder}: no run of this sweep has an evaluation yet")
    used = sorted({k for g in groups for k in g["evals"]})
    table = markdown_table(groups) + (
        f"\n\nEach run: the mean of its last {'/'.join(map(str, used))} evaluation(s) (asked: "
        f"{last}); then mean ± sample std over seeds." if used not in ([1], []) else "")
    if pending:
        table += "\n\n" + "\n".join(pending)
    if damaged:
        table += "\n\n" + "\n".join(damaged_lines(damaged))
    if note:
        table += "\n\n" + note
    (folder / "report.md").write_text(table + "\n")
    write_csv(groups, folder / "report.csv")
    try:
        pngs = plot_curves(groups, folder)
    except ImportError:  # plotting is an optional extra; the tables do not need it
        pngs = []
        print("curves not drawn: matplotlib is not installed (pip install 'mpifl[plot]')",
              file=sys.stderr)
    if as_json:
        shown = {m for m, _ in _columns(groups)}  # the figures the table shows, no others
        hidden = {k for m, _ in _COLUMNS + _LOSS_COLUMNS if m not in shown for k in (m, m + "_sd")}
        print(json.dumps([as_fractions({k: v for k, v in g.items() if k not in {"runs", *hidden}})
                          for g in groups], indent=2))
        if note:
            print(note, file=sys.stderr)
    else:
        print(table)
        print("\nwritten: " + ", ".join(str(p) for p in [folder / "report.md",
                                                            folder / "report.csv", *pngs]))
    if damaged:
        raise DamagedResults(damaged)
    return 0
