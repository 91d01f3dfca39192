"""``mpifl report``: the fairness table of one or more runs side by side, each metric the mean of
a run's last ``k`` evaluations, and runs that differ only in their seed as mean ± std over seeds.

Rows are metrics (mean accuracy, std in percentage points, worst/best 5%, Ditto's personal-model
mean and worst 5%, the mean and worst 5% after local adaptation (``run.adapt_epochs``), FedLF's
fair angle,
mFairFL's client-fairness violation and, on data with a sensitive attribute, the DP/EO/AP
violations) and, when K <= 10, every client's accuracy; columns are runs, named by their file
and by the settings that differ between them (:func:`setting_labels`). A regression run (``[model]
loss = "mse"``) has the clients' test losses (mean, std, worst/best 5%) instead of accuracies. A
run that has no evaluation yet shows its status and the rounds it has done; ``--json`` gives the
figures as fractions, as the results files store them (:func:`as_fractions`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from mpifl.core.errors import OutputError
from mpifl.core.locking import owner_alive
from mpifl.report.load import flat_config
from mpifl.store.checkpoint import folder_for, load_latest
from mpifl.store.results import Damaged, read_results

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
              res: dict[str, Any] | None = None, target: float | None = None) -> dict[str, Any]:
    """A run's metrics averaged over its last ``last`` evaluations, as plain numbers
    (accuracies and violations in percent or percentage points; DP/EO/AP as fractions; a
    regression run's ``loss_mean``, ``loss_std``, ``loss_worst5`` (the highest 5% of the
    clients' losses) and ``loss_best5`` in the loss's units instead of accuracies).

    Averaging a few evaluations steadies the comparison: between evaluations a non-IID run's
    mean accuracy swings by several points. ``res``: the file's :func:`read_results`, when
    already read (e.g. by :func:`mpifl.store.results.read_many`). A run on simulated time
    also gives its simulated hours, the share of late updates, its mean accuracy per device
    tier (``tier:<name>``, percent) and, with ``target`` (mean accuracy in percent), the
    simulated hours until an evaluation first reached it (:func:`system_rows`).

    A run that is not complete and has no evaluation yet gives its progress instead
    (:func:`progress_row`: ``evals`` 0, no metric).

    Raises:
        OutputError: unreadable or foreign file, or a complete run with no evaluation.
    """
    res = read_results(path) if res is None else res
    ev = res["eval"]
    if ev["round"].size == 0:
        if res["attrs"].get("status") == "complete":
            raise OutputError(f"{path}: the run is complete but has no evaluation (it ran "
                              "without run.eval_every?); nothing to summarise")
        return progress_row(path, res)
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
        "full_evals": int(np.isfinite(ev["client_loss" if "loss/mean" in ev else
                                         "client_accuracy"][-k:]).all(axis=1).sum()),
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
    if res.get("system"):
        row.update(system_rows(res, acc, target))
    if acc.size <= PER_CLIENT_MAX and not row["eval_clients"]:
        row["client_accuracy"] = [100 * float(a) for a in acc]
    return row


def system_rows(res: dict[str, Any], acc: np.ndarray,
                target: float | None = None) -> dict[str, Any]:
    """A run on simulated time (its /system group): ``sim_hours`` at its last evaluation,
    ``late`` (% of the selected clients' updates not aggregated), ``tier:<name>`` (mean
    accuracy in percent of the tier's clients, from ``acc`` (K,) fractions), and with
    ``target`` (percent) ``hours_to`` (simulated hours until the mean accuracy first reached
    it; NaN when it never did)."""
    system, ev = res["system"], res["eval"]
    sim = np.asarray(system["rounds/sim_time"], dtype=np.float64)

    def at(rounds_done: int) -> float:  # simulated hours after that many rounds
        return float(sim[rounds_done - 1]) / 3600 if rounds_done else 0.0

    selected = float(np.sum(system["rounds/selected"]))
    row: dict[str, Any] = {"sim_hours": at(int(ev["round"][-1])),
                           "late": 100 * float(np.sum(system["rounds/late"])) / max(selected, 1)}
    tiers = np.asarray(system["clients/tier"])
    for i, name in enumerate(system.get("tier_names", [])):
        mine = acc[tiers == i]
        row[f"tier:{name}"] = 100 * float(np.nanmean(mine)) if np.isfinite(mine).any() \
            else float("nan")
    if target is not None:
        reached = np.flatnonzero(100 * np.asarray(ev["mean"]) >= target)
        row["hours_to"] = at(int(ev["round"][reached[0]])) if len(reached) else float("nan")
        row["target"] = float(target)
    return row


def progress_row(path: str | Path, res: dict[str, Any]) -> dict[str, Any]:
    """What a run without an evaluation shows: ``status`` (:func:`run_status`: ``running``
    while a live process holds its lock), ``round`` (rounds done), ``rounds`` (of the config),
    ``last_round_at`` (local time the results file was last written: rounds are written at
    least once a second) and ``evals`` 0."""
    done = res["rounds"].get("round")
    config = res["config"]
    try:
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(Path(path).stat().st_mtime))
    except OSError:
        written = "?"
    return {"run": Path(path).stem, "algorithm": res["attrs"].get("algorithm", "?"),
            "status": run_status(path, res), "seed": config.get("run", {}).get("seed"),
            "config": config, "round": int(done[-1]) + 1 if done is not None and len(done) else 0,
            "rounds": config.get("run", {}).get("rounds"), "evals": 0,
            "clients": int(res["attrs"].get("num_clients", 0)), "last_round_at": written}


def group_by_seed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs whose configs differ only in ``run.seed`` (and ``run.name``), as one row each:
    every numeric metric's mean and sample std (n-1; 0 for one run) over the seeds
    (``metric`` and ``metric_sd``), ``seeds`` the number of runs, ``runs`` their names,
    ``config`` the first one's without seed and name. Runs without an evaluation yet
    (``evals`` 0) are left out."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if not row.get("evals"):
            continue
        cfg = json.loads(json.dumps(row.get("config", {})))
        for section, key in (("run", "seed"), ("run", "name")):
            cfg.get(section, {}).pop(key, None)
        groups.setdefault(json.dumps(cfg, sort_keys=True), []).append(row)
    out = []
    for text, members in groups.items():
        g = {"run": members[0]["run"] if len(members) == 1 else _common_name(members),
             "algorithm": members[0]["algorithm"], "seeds": len(members),
             "runs": [m["run"] for m in members], "round": min(m["round"] for m in members),
             "clients": members[0]["clients"], "eval_clients": members[0].get("eval_clients", 0),
             "full_evals": min(m.get("full_evals", 0) for m in members),
             "evals": min(m["evals"] for m in members), "config": json.loads(text)}
        for key, _, _ in _ROWS:
            vals = [m[key] for m in members if isinstance(m.get(key), (int, float))]
            if key not in g and len(vals) == len(members):
                g[key], g[key + "_sd"] = mean_sd(vals)
        out.append(g)
    return out


#: Config keys never used to tell runs apart: the name is the file's, the algorithm its own row.
_NOT_SETTINGS = ("run.name", "server.algorithm")


def setting_labels(configs: list[dict[str, Any]]) -> list[str]:
    """For each config (the stored JSON, as a dict), ``"section.key=value, ..."`` of the keys
    whose values differ between ``configs`` (e.g. ``model.batchnorm=local,
    server.optimizer=adam``), keys in sorted order; ``"-"`` where none differs."""
    flats = [flat_config(c) for c in configs]
    keys = sorted(set().union(*flats)) if flats else []
    varying = [k for k in keys if k not in _NOT_SETTINGS
               and len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1]
    return [", ".join(f"{k}={_shown(f[k])}" for k in varying if k in f) or "-" for f in flats]


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


#: Metrics that summarise() gives in percent (or percentage points); the files and --json
#: store them as fractions.
PERCENT_KEYS = ("mean", "std", "worst5", "best5", "personal_mean", "personal_worst5",
                "adapted_mean", "adapted_worst5", "cf")


def as_fractions(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` (from :func:`summarise`, :func:`group_by_seed` or a sweep's groups) with the
    percent metrics (:data:`PERCENT_KEYS`, their ``_sd`` and ``client_accuracy``) as
    fractions in [0, 1], the unit of the results files, and NaN (a diverged run, a client
    without test data) as None, so that the JSON is standard (``null``); everything else as
    it is."""
    out = dict(row)
    for key in PERCENT_KEYS:
        for name in (key, key + "_sd"):
            if isinstance(out.get(name), (int, float)):
                out[name] = out[name] / 100.0
    if isinstance(out.get("client_accuracy"), list):
        out["client_accuracy"] = [a / 100.0 for a in out["client_accuracy"]]
    for name in ("late", "target", *(k for k in row if k.startswith("tier:"))):
        if isinstance(out.get(name), (int, float)):
            out[name] = out[name] / 100.0
    return {k: _finite(v) for k, v in out.items()}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


#: What --json's numbers are in (printed beside them).
JSON_UNITS = ("mean, std, worst5, best5, personal_*, adapted_*, cf, client_accuracy (and their "
              "_sd): fractions in [0, 1]; dp, eo, ap: fractions; fair_angle: radians; loss_*: "
              "the [model] loss's units; tier:<name>, late, target (simulated time): fractions; "
              "sim_hours, hours_to: simulated hours; null: not a number (no test data, a "
              "diverged run)")


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
    ("sim_hours", "simulated hours", "{:.2f}"), ("late", "late updates (%)", "{:.1f}"),
    ("hours_to", "hours to target", "{:.2f}"),
]


def format_table(rows: list[dict[str, Any]]) -> str:
    """Metrics down, runs across, as aligned plain text; rows from :func:`group_by_seed`
    print ``mean ± sd`` over their seeds. Columns are headed by the run's name and, when the
    runs' configs differ, a ``setting`` line (:func:`setting_labels`). A run without an
    evaluation yet shows its status and rounds done of all, and a line under the table."""
    header = ["metric"] + [r["run"] for r in rows]
    labels = setting_labels([r.get("config", {}) for r in rows])
    settings = [["setting"] + labels] if len(rows) > 1 and set(labels) != {"-"} else []

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        if key == "round" and not r.get("evals", 1):
            return f"{r['round']} of {r.get('rounds', '?')}"
        if key not in r:
            return "-"
        text = fmt.format(r[key])
        spread = key + "_sd" in r and r.get("seeds", 1) > 1  # one seed: no spread to show
        return text + " ± " + fmt.format(r[key + "_sd"]) if spread else text

    extra = [("seeds", "seeds", "{}")] if any("seeds" in r for r in rows) else []
    lines = settings + [[label] + [cell(r, key, fmt) for r in rows]
                        for key, label, fmt in _ROWS + extra if any(key in r for r in rows)]
    tiers = list(dict.fromkeys(key for r in rows for key in r if key.startswith("tier:")))
    for key in tiers:  # a run on simulated time: accuracy per device tier
        lines.append([f"{key[5:]} tier acc (%)"] + [cell(r, key, "{:.2f}") for r in rows])
    k = max(len(r.get("client_accuracy", [])) for r in rows)
    for i in range(k):
        lines.append([f"client {i} (%)"] + [
            f"{r['client_accuracy'][i]:.2f}" if i < len(r.get("client_accuracy", [])) else "-"
            for r in rows])
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    out = ["  ".join(x.ljust(w) if j == 0 else x.rjust(w) for j, (x, w) in enumerate(zip(line, widths)))
           for line in [header, *lines]]
    out.insert(1 + len(settings), "  ".join("-" * w for w in widths))
    for r in rows:
        if not r.get("evals", 1):
            out.append(f"({r['run']}: {r['status']}, no evaluation yet: round {r['round']} of "
                       f"{r.get('rounds', '?')} done, last round written {r['last_round_at']})")
    targets = sorted({r["target"] for r in rows if "target" in r})
    if targets:
        out.append(f"(hours to target: simulated hours until the mean accuracy first reached "
                   f"{'/'.join(f'{t:g}' for t in targets)}%)")
    evals = sorted({r["evals"] for r in rows if r.get("evals")})
    if evals and evals != [1]:  # what was used: a run with fewer evaluations uses them all
        out.append(f"(metrics: mean of each run's last {'/'.join(map(str, evals))} evaluations)")
    sampled = sorted({(r["eval_clients"], r["clients"], r.get("full_evals", 0), r["evals"])
                      for r in rows if r.get("eval_clients") and r.get("evals")})
    for n, k, full, used in sampled:  # run.eval_clients (and run.full_eval_every)
        if full >= used:
            out.append(f"(sampled evaluations tested {n} of {k} clients; the ones used here "
                       f"tested all {k})")
            continue
        what = "each evaluation" if not full else f"{used - full} of the {used} evaluations used"
        out.append(f"(sampled evaluation: {what} tested {n} of {k} clients, drawn anew; "
                   "the metrics are estimates over them)")
    return "\n".join(out)


def damaged_lines(damaged: list[Damaged]) -> list[str]:
    """What a summary prints (and writes, in Markdown) about the results files it could not
    read (:class:`mpifl.store.results.Damaged`): a heading, then ``- PATH: reason`` each."""
    return ([f"damaged results files, left out of the figures above ({len(damaged)}):"]
            + [f"- {d.path}: {d.reason}" for d in damaged])
