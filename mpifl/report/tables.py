"""``mpifl report``: the fairness table of one or more runs side by side, each metric the mean of
a run's last ``k`` evaluations, and runs that differ only in their seed as mean ± std over seeds.

Rows are metrics (mean accuracy, std in percentage points, worst/best 5%, Ditto's personal-model
mean and worst 5%, the mean and worst 5% after local adaptation (``run.adapt_epochs``), FedLF's
fair angle,
mFairFL's client-fairness violation and, on data with a sensitive attribute, the DP/EO/AP
violations) and, when K <= 10, every client's accuracy; columns are runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from mpifl.core.errors import OutputError
from mpifl.core.locking import owner_alive
from mpifl.store.checkpoint import folder_for, load_latest
from mpifl.store.results import read_results

PER_CLIENT_MAX = 10


def run_status(path: str | Path, res: dict[str, Any]) -> str:
    """``complete``, ``running`` (a live process holds the run lock), or for a run whose
    writer is gone ``interrupted at round r (resumable from round c)`` / ``(not resumable)``
    (c: the newest valid checkpoint; ``mpifl resume`` continues from it)."""
    status = res["attrs"].get("status", "?")
    if status != "running" or owner_alive(Path(path)):
        return status
    rounds = res["rounds"].get("round")
    done = int(rounds[-1]) + 1 if rounds is not None and len(rounds) else 0
    try:
        ckpt = load_latest(folder_for(Path(path)))
    except OutputError:
        ckpt = None
    tail = f"resumable from round {ckpt.round}" if ckpt is not None else "not resumable"
    return f"interrupted at round {done} ({tail})"


def summarise(path: str | Path, last: int = 1,
              res: dict[str, Any] | None = None) -> dict[str, Any]:
    """A run's metrics averaged over its last ``last`` evaluations, as plain numbers
    (accuracies and violations in percent or percentage points; DP/EO/AP as fractions).

    Averaging a few evaluations steadies the comparison: between evaluations a non-IID run's
    mean accuracy swings by several points. ``res``: the file's :func:`read_results`, when
    already read (e.g. by :func:`mpifl.store.results.read_many`).

    Raises:
        OutputError: unreadable or foreign file, or a run with no evaluation yet.
    """
    res = read_results(path) if res is None else res
    ev = res["eval"]
    if ev["round"].size == 0:
        raise OutputError(f"{path}: the run has no evaluation yet")
    k = min(max(1, last), ev["round"].size)

    def tail(name: str, scale: float = 1.0) -> float:
        return scale * float(ev[name][-k:].mean())

    acc = ev["client_accuracy"][-k:].mean(axis=0)
    row = {
        "run": Path(path).stem,
        "algorithm": res["attrs"].get("algorithm", "?"),
        "status": run_status(path, res),
        "seed": res["config"].get("run", {}).get("seed"),
        "config": res["config"],
        "round": int(ev["round"][-1]),
        "evals": k,
        "clients": int(acc.size),
        # run.eval_clients: each evaluation tested this many of them (the rest are NaN)
        "eval_clients": int(res["config"].get("run", {}).get("eval_clients", 0) or 0),
        # of the evaluations used, those that tested every client (run.full_eval_every)
        "full_evals": int(np.isfinite(ev["client_accuracy"][-k:]).all(axis=1).sum()),
        "mean": tail("mean", 100), "std": tail("std", 100), "worst5": tail("worst5", 100),
        "best5": tail("best5", 100), "fair_angle": tail("fair_angle"),
    }
    if "cf" in ev:
        row["cf"] = tail("cf", 100)
    for key in ("dp", "eo", "ap"):
        if f"group/{key}" in ev:
            row[key] = tail(f"group/{key}")
    for key in ("mean", "worst5"):  # Ditto: each client's personal model
        if f"personal/{key}" in ev:
            row[f"personal_{key}"] = tail(f"personal/{key}", 100)
        if f"adapted/{key}" in ev:  # run.adapt_epochs: after local adaptation
            row[f"adapted_{key}"] = tail(f"adapted/{key}", 100)
    if "loss/mean" in ev:  # a regression task: the clients' test losses, no accuracy
        for key in ("mean", "std", "worst5", "best5"):
            row[f"loss_{key}"] = tail(f"loss/{key}")
            row.pop(key, None)
        row.pop("fair_angle", None)
        row.pop("cf", None)
        return row
    if acc.size <= PER_CLIENT_MAX and not row["eval_clients"]:
        row["client_accuracy"] = [100 * float(a) for a in acc]
    return row


def group_by_seed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs whose configs differ only in ``run.seed`` (and ``run.name``), as one row each:
    every numeric metric's mean and sample std (n-1; 0 for one run) over the seeds
    (``metric`` and ``metric_sd``), ``seeds`` the number of runs, ``runs`` their names."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        cfg = json.loads(json.dumps(row.get("config", {})))
        for section, key in (("run", "seed"), ("run", "name")):
            cfg.get(section, {}).pop(key, None)
        groups.setdefault(json.dumps(cfg, sort_keys=True), []).append(row)
    out = []
    for members in groups.values():
        g = {"run": members[0]["run"] if len(members) == 1 else _common_name(members),
             "algorithm": members[0]["algorithm"], "seeds": len(members),
             "runs": [m["run"] for m in members], "round": min(m["round"] for m in members),
             "clients": members[0]["clients"], "eval_clients": members[0].get("eval_clients", 0),
             "full_evals": min(m.get("full_evals", 0) for m in members), "evals": min(m["evals"] for m in members)}
        for key, _, _ in _ROWS:
            vals = [m[key] for m in members if isinstance(m.get(key), (int, float))]
            if key not in g and len(vals) == len(members):
                g[key], g[key + "_sd"] = mean_sd(vals)
        out.append(g)
    return out


def _common_name(members: list[dict[str, Any]]) -> str:
    """The runs' names without their seed part (``fedfv-s0``, ``fedfv-s1`` -> ``fedfv-s*``)."""
    names = [m["run"] for m in members]
    prefix = names[0][:next((i for i, chars in enumerate(zip(*names)) if len(set(chars)) > 1),
                            min(map(len, names)))]
    return prefix + "*"


def mean_sd(vals: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n-1; 0 for one value)."""
    mu = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return mu, sd


_ROWS = [
    ("algorithm", "algorithm", "{}"), ("status", "status", "{}"), ("round", "rounds", "{}"),
    ("clients", "clients", "{}"), ("mean", "mean acc (%)", "{:.2f}"),
    ("std", "std (pp)", "{:.2f}"), ("worst5", "worst 5% (%)", "{:.2f}"),
    ("best5", "best 5% (%)", "{:.2f}"), ("personal_mean", "personal mean acc (%)", "{:.2f}"),
    ("personal_worst5", "personal worst 5% (%)", "{:.2f}"),
    ("adapted_mean", "adapted mean acc (%)", "{:.2f}"),
    ("adapted_worst5", "adapted worst 5% (%)", "{:.2f}"),
    ("fair_angle", "fair angle (rad)", "{:.4f}"),
    ("cf", "CF violation (pp)", "{:.2f}"), ("loss_mean", "mean loss", "{:.5g}"),
    ("loss_std", "std of loss", "{:.4g}"), ("loss_worst5", "worst 5% loss", "{:.5g}"),
    ("loss_best5", "best 5% loss", "{:.5g}"), ("dp", "DP violation", "{:.4f}"),
    ("eo", "EO violation", "{:.4f}"), ("ap", "AP violation", "{:.4f}"),
]


def format_table(rows: list[dict[str, Any]]) -> str:
    """Metrics down, runs across, as aligned plain text; rows from :func:`group_by_seed`
    print ``mean ± sd`` over their seeds."""
    header = ["metric"] + [r["run"] for r in rows]

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        if key not in r:
            return "-"
        text = fmt.format(r[key])
        spread = key + "_sd" in r and r.get("seeds", 1) > 1  # one seed: no spread to show
        return text + " ± " + fmt.format(r[key + "_sd"]) if spread else text

    extra = [("seeds", "seeds", "{}")] if any("seeds" in r for r in rows) else []
    lines = [[label] + [cell(r, key, fmt) for r in rows]
             for key, label, fmt in _ROWS + extra if any(key in r for r in rows)]
    k = max(len(r.get("client_accuracy", [])) for r in rows)
    for i in range(k):
        lines.append([f"client {i} (%)"] + [
            f"{r['client_accuracy'][i]:.2f}" if i < len(r.get("client_accuracy", [])) else "-"
            for r in rows])
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    out = ["  ".join(x.ljust(w) if j == 0 else x.rjust(w) for j, (x, w) in enumerate(zip(line, widths)))
           for line in [header, *lines]]
    out.insert(1, "  ".join("-" * w for w in widths))
    evals = sorted({r["evals"] for r in rows if "evals" in r})
    if evals and evals != [1]:  # what was used: a run with fewer evaluations uses them all
        out.append(f"(metrics: mean of each run's last {'/'.join(map(str, evals))} evaluations)")
    sampled = sorted({(r["eval_clients"], r["clients"], r.get("full_evals", 0), r["evals"])
                      for r in rows if r.get("eval_clients")})
    for n, k, full, used in sampled:  # run.eval_clients (and run.full_eval_every)
        if full >= used:
            out.append(f"(sampled evaluations tested {n} of {k} clients; the ones used here "
                       f"tested all {k})")
            continue
        what = "each evaluation" if not full else f"{used - full} of the {used} evaluations used"
        out.append(f"(sampled evaluation: {what} tested {n} of {k} clients, drawn anew; "
                   "the metrics are estimates over them)")
    return "\n".join(out)


def damaged_lines(damaged) -> list[str]:
    """What a summary prints (and writes, in Markdown) about the results files it could not
    read (:class:`mpifl.store.results.Damaged`): a heading, then ``- PATH: reason`` each."""
    return ([f"damaged results files, left out of the figures above ({len(damaged)}):"]
            + [f"- {d.path}: {d.reason}" for d in damaged])
