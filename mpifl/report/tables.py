"""``mpifl report``: the fairness table of one or more runs at their last evaluation, side by side.

Rows are metrics (mean accuracy, std in percentage points, worst/best 5%, Ditto's personal-model
mean and worst 5%, FedLF's fair angle,
mFairFL's client-fairness violation and, on data with a sensitive attribute, the DP/EO/AP
violations) and, when K <= 10, every client's accuracy; columns are runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mpifl.core.errors import OutputError
from mpifl.store.results import read_results

PER_CLIENT_MAX = 10


def summarise(path: str | Path) -> dict[str, Any]:
    """The last evaluation of a run as plain numbers (accuracies in percent).

    Raises:
        OutputError: unreadable or foreign file, or a run with no evaluation yet.
    """
    res = read_results(path)
    ev = res["eval"]
    if ev["round"].size == 0:
        raise OutputError(f"{path}: the run has no evaluation yet")
    acc = ev["client_accuracy"][-1]
    row = {
        "run": Path(path).stem,
        "algorithm": res["attrs"].get("algorithm", "?"),
        "status": res["attrs"].get("status", "?"),
        "round": int(ev["round"][-1]),
        "clients": int(acc.size),
        "mean": 100 * float(ev["mean"][-1]),
        "std": float(ev["std"][-1]),
        "worst5": 100 * float(ev["worst5"][-1]),
        "best5": 100 * float(ev["best5"][-1]),
        "fair_angle": float(ev["fair_angle"][-1]),
    }
    if "cf" in ev:
        row["cf"] = 100 * float(ev["cf"][-1])
    for key in ("dp", "eo", "ap"):
        if f"group/{key}" in ev:
            row[key] = float(ev[f"group/{key}"][-1])
    for key in ("mean", "worst5"):  # Ditto: each client's personal model
        if f"personal/{key}" in ev:
            row[f"personal_{key}"] = 100 * float(ev[f"personal/{key}"][-1])
    if acc.size <= PER_CLIENT_MAX:
        row["client_accuracy"] = [100 * float(a) for a in acc]
    return row


_ROWS = [
    ("algorithm", "algorithm", "{}"), ("status", "status", "{}"), ("round", "rounds", "{}"),
    ("clients", "clients", "{}"), ("mean", "mean acc (%)", "{:.2f}"),
    ("std", "std (pp)", "{:.2f}"), ("worst5", "worst 5% (%)", "{:.2f}"),
    ("best5", "best 5% (%)", "{:.2f}"), ("personal_mean", "personal mean acc (%)", "{:.2f}"),
    ("personal_worst5", "personal worst 5% (%)", "{:.2f}"),
    ("fair_angle", "fair angle (rad)", "{:.4f}"),
    ("cf", "CF violation (pp)", "{:.2f}"), ("dp", "DP violation", "{:.4f}"),
    ("eo", "EO violation", "{:.4f}"), ("ap", "AP violation", "{:.4f}"),
]


def format_table(rows: list[dict[str, Any]]) -> str:
    """Metrics down, runs across, as aligned plain text."""
    header = ["metric"] + [r["run"] for r in rows]
    lines = [[label] + [fmt.format(r[key]) if key in r else "-" for r in rows]
             for key, label, fmt in _ROWS if any(key in r for r in rows)]
    k = max(len(r.get("client_accuracy", [])) for r in rows)
    for i in range(k):
        lines.append([f"client {i} (%)"] + [
            f"{r['client_accuracy'][i]:.2f}" if i < len(r.get("client_accuracy", [])) else "-"
            for r in rows])
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    out = ["  ".join(x.ljust(w) if j == 0 else x.rjust(w) for j, (x, w) in enumerate(zip(line, widths)))
           for line in [header, *lines]]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)

