"""The reproduction table: each paper's headline figures beside mpifl's runs, with a verdict.

Inputs are a *figures file* (``jobs/repro/figures.toml``: the papers' numbers, typed once, in
one place that is data, never a test) and the sweep folders of the reproduction suites
(``<out>/<suite>/index.json`` and its results files). Nothing here runs an experiment: every
figure of the table is computed from the HDF5 results, so the table is regenerated, never typed.

A row of the figures file::

    [[row]]
    suite = "mfairfl-adult"              # jobs/repro/<suite>.toml, results in <out>/<suite>
    section = "mFairFL (Su et al., AAAI 2024), Table 1: Adult"
    method = "mFairFL"                   # as the paper names it
    select = {"server.algorithm" = "mfairfl"}   # its runs: these swept values (all seeds)
    metric = "dp"                        # see METRICS
    value = 1.2                          # the paper's figure, in the table's units (%, pp)
    paper_text = "27 (FEMNIST)"          # or: the paper's figure as shown, not compared
    sd = 0.3                             # the paper's error bar, if it gives one
    claim = "dp-adult"                   # rows compared by their order (with ``rank``) ...
    rank = 1                             # ... the paper's rank in that claim (1 = smallest)
    why = "..."                          # the reason found, when it is not reproduced

Verdicts (:func:`verdict`): *reproduced* when mpifl's mean over seeds is within the larger of
the paper's error bar and 2 pp of the paper's figure, *close* within 5 pp, else *not
reproduced*. A row without ``value`` is judged by order only: *reproduced* when the rows of
its claim come in the paper's order.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mpifl.core.errors import ConfigError, OutputError
from mpifl.store.results import Damaged, read_many
from mpifl.store.sweep_index import INDEX, read_index

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: The metrics a row may name, their unit in the table, and how they come from a results file.
METRICS = {
    "mean": "%, mean client test accuracy",
    "std": "pp, std of the clients' accuracies (FedLF's fairness indicator)",
    "worst5": "%, mean accuracy of the worst 5% of clients",
    "best5": "%, mean accuracy of the best 5% of clients",
    "cf": "pp, client-fairness violation max_k |acc_k - mean|",
    "dp": "pp, demographic-parity violation",
    "eo": "pp, equal-opportunity violation",
    "ap": "pp, accuracy-parity violation",
    "mc": "model-level conflicts: selected clients a round with u_k . step < 0 (all rounds)",
    "lc": "layer-level conflicts: (client, layer) pairs a round with u_k,l . step_l < 0",
    "rounds_to:X": "rounds until the mean accuracy first reaches X% (an evaluated round)",
    # q-FFL's table (Li et al., ICLR 2020): tails of a tenth of the devices, spread as a variance
    "worst10": "%, mean accuracy of the worst 10% of clients (max(1, floor(K/10)))",
    "best10": "%, mean accuracy of the best 10% of clients (max(1, floor(K/10)))",
    "var": "%^2, population variance of the clients' accuracies (in %)",
    # FedProx's stability (Li et al., MLSys 2020): how much the global model's loss moves
    "loss_osc": "%, mean |L_e+1 - L_e| / mean L over the second half of the evaluations, L the "
                "global model's sample-weighted test loss over all clients",
}
REPRODUCED_PP, CLOSE_PP = 2.0, 5.0
SEED_KEY = "run.seed"
_absent = object()


class FigureRow(BaseModel):
    """One ``[[row]]`` of the figures file (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    suite: str
    section: str
    method: str
    select: dict[str, Any] = Field(default_factory=dict)
    metric: str
    value: float | None = None
    paper_text: str | None = None
    sd: float | None = Field(None, ge=0)
    claim: str | None = None
    rank: int | None = Field(None, ge=1)
    why: str | None = None

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, metric: str) -> str:
        if metric in METRICS or (metric.startswith("rounds_to:") and _milestone(metric) > 0):
            return metric
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")


def _milestone(metric: str) -> float:
    try:
        return float(metric.split(":", 1)[1])
    except ValueError:
        return -1.0


def load_figures(path: Path) -> list[FigureRow]:
    """The rows of a figures file.

    Raises:
        ConfigError: an unreadable file or bad TOML, no rows, a row with a wrong or missing key, or a
            ``rank`` without ``claim``.
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    rows = data.get("row")
    if not isinstance(rows, list) or not rows or set(data) != {"row"}:
        raise ConfigError(f"{path}: expected only [[row]] tables, at least one")
    out = []
    for i, row in enumerate(rows, 1):
        try:
            out.append(FigureRow(**row))
        except (ValidationError, TypeError) as exc:
            first = exc.errors()[0] if isinstance(exc, ValidationError) else {"msg": str(exc)}
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise ConfigError(f"{path}: row {i}: {where + ': ' if where else ''}{first['msg']}") from None
        if out[-1].rank is not None and out[-1].claim is None:
            raise ConfigError(f"{path}: row {i}: rank needs a claim (the rows it is ranked among)")
    return out


def run_metric(res: dict[str, Any], metric: str, last: int) -> float:
    """One run's ``metric`` in the table's units: the mean of its last ``last`` evaluations
    (accuracies in %, std and violations in pp); for ``rounds_to:X``, the number of rounds
    until the mean accuracy first reached X% (``inf`` if it never did); for ``mc``/``lc``, the
    mean conflict count a round over all rounds. ``res``: the run's
    :func:`mpifl.store.results.read_results`.

    Raises:
        OutputError: no evaluation yet, or a metric the run did not record.
    """
    if metric in ("mc", "lc"):
        counts = res["rounds"]["conflicts_model" if metric == "mc" else "conflicts_layer"]
        return float(counts.reshape(len(counts), -1).sum(axis=1).mean())
    ev = res["eval"]
    if ev["round"].size == 0:
        raise OutputError("no evaluation yet")
    if metric.startswith("rounds_to:"):
        reached = np.flatnonzero(ev["mean"] >= _milestone(metric) / 100)
        return float(ev["round"][reached[0]] + 1) if reached.size else math.inf
    if metric in CLIENT_METRICS:
        return client_metric(res, metric, last)
    name = f"group/{metric}" if metric in ("dp", "eo", "ap") else metric
    if name not in ev:
        raise OutputError(f"the run did not record {metric}")
    return 100.0 * float(np.mean(ev[name][-max(1, last):]))


#: Metrics computed from the per-client arrays (``/eval/client_accuracy``, ``client_loss``).
CLIENT_METRICS = ("worst10", "best10", "var", "loss_osc")


def client_metric(res: dict[str, Any], metric: str, last: int) -> float:
    """A metric of :data:`CLIENT_METRICS` from a run's per-client evaluations, in the table's
    units: ``worst10``/``best10``/``var`` for each of the last ``last`` evaluations (a tenth of
    the K clients, at least one; the variance with ddof 0, in %^2), then averaged; ``loss_osc``
    over the second half of all evaluations (at least two of them), in % of their mean loss.

    Raises:
        OutputError: the run did not record per-client figures, or ``loss_osc`` with fewer
            than three evaluations (two in the second half).
    """
    ev = res["eval"]
    name = "client_loss" if metric == "loss_osc" else "client_accuracy"
    if name not in ev:
        raise OutputError(f"the run did not record {name}, needed for {metric}")
    if metric == "loss_osc":
        n = np.asarray(res.get("clients", {}).get("num_test", []), dtype=np.float64)
        loss = np.asarray(ev[name], dtype=np.float64)
        if n.shape != loss.shape[1:] or n.sum() <= 0:
            n = np.ones(loss.shape[1])
        curve = loss @ n / n.sum()  # (E,) the sample-weighted loss over all clients
        tail = curve[len(curve) // 2:]
        if len(tail) < 2:
            raise OutputError("loss_osc needs at least three evaluations")
        return 100.0 * float(np.mean(np.abs(np.diff(tail))) / np.mean(tail))
    acc = 100.0 * np.asarray(ev[name], dtype=np.float64)[-max(1, last):]  # (e, K) in %
    if metric == "var":
        return float(np.mean(np.var(acc, axis=1)))
    tenth = max(1, acc.shape[1] // 10)
    ordered = np.sort(acc, axis=1)
    part = ordered[:, :tenth] if metric == "worst10" else ordered[:, -tenth:]
    return float(np.mean(part))


@dataclass
class Measured:
    """mpifl's side of a row: one value per seed (complete runs only), what is missing and
    what is damaged."""

    values: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    missing: int = 0  # runs of the row not complete (not run, running, failed)
    damaged: list[Damaged] = field(default_factory=list)  # results files that cannot be read

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values) if self.values else math.nan

    @property
    def sd(self) -> float:
        if any(math.isinf(v) for v in self.values):
            return math.nan
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0

    def shown(self) -> str:
        """``mean ± sd``; for a milestone some seeds never reached: ``never (k of n seeds;
        the others: mean)``."""
        if not self.values:
            return "-"
        never = [v for v in self.values if math.isinf(v)]
        if not never:
            return f"{_fmt(self.mean)} ± {_fmt(self.sd)}"
        reached = [v for v in self.values if not math.isinf(v)]
        rest = f"; the others: {_fmt(statistics.fmean(reached))}" if reached else ""
        return f"never ({len(never)} of {len(self.values)} seeds{rest})"


def measure(row: FigureRow, folder: Path, last: int) -> Measured:
    """The runs of ``folder`` (a sweep folder) that ``row.select`` picks, over all seeds: a
    run without a results file, or not complete, is missing; one whose results file cannot
    be read is damaged (``Measured.damaged``), never counted as missing."""
    out = Measured()
    if not (folder / INDEX).exists():
        return out
    for run in read_index(folder)["runs"].values():
        params = run["params"]
        if any(params.get(k, _absent) != v for k, v in row.select.items()):
            continue
        path = folder / run["results"]
        good, damaged = read_many([path]) if path.exists() else ([], [])
        out.damaged += damaged
        if damaged:
            continue
        try:
            if not good:
                raise OutputError("not run")
            res = good[0]
            if res["attrs"].get("status") != "complete":
                raise OutputError("not complete")
            out.values.append(run_metric(res, row.metric, last))
        except OutputError:
            out.missing += 1
            continue
        out.seeds.append(int(params.get(SEED_KEY, res["config"]["run"]["seed"])))
    return out


def suite_seconds(folder: Path, damaged: list[Damaged] | None = None) -> list[float]:
    """Each complete run's summed round times (seconds: broadcast, training, gather,
    aggregation, evaluation, checkpoint) in the sweep folder ``folder``; the results files
    that cannot be read are added to ``damaged`` when given."""
    out: list[float] = []
    if not (folder / INDEX).exists():
        return out
    paths = [folder / run["results"] for run in read_index(folder)["runs"].values()]
    good, bad = read_many(p for p in paths if p.exists())
    if damaged is not None:
        damaged += bad
    for res in good:
        if res["attrs"].get("status") == "complete":
            out.append(float(sum(res["rounds"][c].sum() for c in res["rounds"]
                                 if c.startswith("time_"))))
    return out


def verdict(paper: float, paper_sd: float | None, mean: float) -> str:
    """*reproduced* (within max(paper's error bar, 2 pp)), *close* (within 5 pp) or *not
    reproduced*, comparing mpifl's mean over seeds with the paper's figure (same units)."""
    if math.isnan(mean):
        return "not run"
    gap = abs(mean - paper)
    if gap <= max(REPRODUCED_PP, paper_sd or 0.0):
        return "reproduced"
    return "close" if gap <= CLOSE_PP else "not reproduced"


def order_verdicts(rows: list[FigureRow], measured: list[Measured]) -> dict[str, str]:
    """Per claim: *reproduced* when mpifl's means rank the claim's rows as the paper does
    (ties in the paper's ranks may come in either order), else *not reproduced*."""
    out = {}
    for claim in {r.claim for r in rows if r.claim and r.rank}:
        members = [(r.rank, m.mean) for r, m in zip(rows, measured) if r.claim == claim and r.rank]
        if any(math.isnan(mean) for _, mean in members):
            empty = [m for r, m in zip(rows, measured) if r.claim == claim and r.rank
                     and not m.values]
            out[claim] = "damaged" if any(m.damaged for m in empty) else "not run"
            continue
        ok = all(a_mean < b_mean for a_rank, a_mean in members for b_rank, b_mean in members
                 if a_rank < b_rank)
        out[claim] = "reproduced" if ok else "not reproduced"
    return out


def _fmt(x: float) -> str:
    if math.isinf(x):
        return "never"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"


def render(rows: list[FigureRow], measured: list[Measured], *, command: str, machine: str,
           suites: dict[str, tuple[str, list[float]]], last: int,
           damaged: Sequence[Damaged] = ()) -> str:
    """The Markdown document: a summary, the results files that cannot be read (``damaged``:
    left out of every figure; a row with only damaged runs has the verdict *damaged*), one
    table per section, each suite's departures from its paper and the time its runs took
    (``suites``: name -> (the suite file's header, each complete run's seconds))."""
    orders = order_verdicts(rows, measured)
    verdicts = []
    for r, m in zip(rows, measured):
        v = (verdict(r.value, r.sd, m.mean) if r.value is not None
             else orders.get(r.claim, "-") if r.claim is not None else "-")
        if r.value is None and r.claim is None:
            v = "-"
        if r.value is not None and not m.values and m.damaged:
            v = "damaged"
        verdicts.append(v)
    lines = ["# Reproductions", "",
             "Generated by `" + command + "` from the HDF5 results; do not edit by hand.", "",
             f"Machine: {machine}. mpifl's figure per row: mean ± sample std over the seeds "
             f"(each run: the mean of its last {last} evaluations; `rounds_to:X`: the first "
             "evaluated round whose mean accuracy reaches X%). Verdicts: **reproduced** within "
             f"the paper's error bar or {REPRODUCED_PP:g} pp, **close** within {CLOSE_PP:g} pp, "
             "else **not reproduced**; a verdict's [n] points to the reason, note n below its "
             "section's table (each reason written once a section); rows that the paper reports "
             "on other data are judged by their order only (the claim column).", ""]
    counts = {v: verdicts.count(v) for v in sorted(set(verdicts), key=_verdict_rank)}
    claims = list(orders.values())
    claim_counts = {v: claims.count(v) for v in sorted(set(claims), key=_verdict_rank)}
    lines += ["Summary: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + "; order claims: "
              + (", ".join(f"{n} {v}" for v, n in claim_counts.items()) or "none")
              + (f"; {len(damaged)} damaged results file(s), left out" if damaged else "")
              + ".", ""]
    if damaged:
        lines += [f"Damaged results files, left out of every figure below ({len(damaged)}):", ""]
        lines += [f"- `{d.path}`: {d.reason}" for d in damaged] + [""]
    for section in dict.fromkeys(r.section for r in rows):
        idx = [i for i, r in enumerate(rows) if r.section == section]
        lines += [f"## {section}", "",
                  "| method | metric | paper | mpifl | seeds | diff | claim | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        marks, notes = reason_notes([rows[i] for i in idx], [verdicts[i] for i in idx])
        for i, mark in zip(idx, marks):
            r, m, v = rows[i], measured[i], verdicts[i]
            paper = (r.paper_text or "-" if r.value is None
                     else _fmt(r.value) + (f" ± {_fmt(r.sd)}" if r.sd else ""))
            mine = m.shown()
            more = ([f"+{m.missing} not done"] if m.missing else []) + (
                [f"+{len(m.damaged)} damaged"] if m.damaged else [])
            seeds = f"{len(m.values)}" + (f" ({', '.join(more)})" if more else "")
            diff = ("-" if r.value is None or not m.values or math.isinf(m.mean)
                    else f"{m.mean - r.value:+.1f}")
            claim = f"{r.claim} #{r.rank}" if r.claim and r.rank else "-"
            lines.append(f"| {r.method} | {r.metric} | {paper} | {mine} | {seeds} | {diff} | "
                         f"{claim} | {v}{mark} |")
        lines += [""] + (notes + [""] if notes else [])
        claims = _claim_lines([rows[i] for i in idx], [measured[i] for i in idx], orders)
        lines += claims + ([""] if claims else [])
    times = [t for _, ts in suites.values() for t in ts]
    lines += ["## Suites: settings, departures from the papers, time", "",
              f"The {len(times)} complete runs took {sum(times) / 3600:.1f} h of round time on "
              "this machine, one process and one thread each (the local launcher ran two at a "
              "time on its 2 cores, so the wall time was about half). On a cluster each run is "
              "one SLURM job (`--executor slurm`), so a suite takes about its longest run: "
              f"{max(times, default=0) / 60:.0f} min here, less on faster cores. Round times "
              "include any contention from other work on the machine while the runs ran.", ""]
    for name, (header, secs) in suites.items():
        lines += [f"### {name}", "", f"`jobs/repro/{name}.toml`: {len(secs)} complete runs, "
                  f"{sum(secs) / 60:.0f} min of round time, the longest "
                  f"{max(secs, default=0) / 60:.1f} min.", "", "```", header.rstrip(), "```", ""]
    return "\n".join(lines)


def reason_notes(rows: list[FigureRow], verdicts: list[str]) -> tuple[list[str], list[str]]:
    """A section's reasons, each written once: per row its pointer (`` [n]``, or ``""`` for a
    row that needs no reason) and the notes, ``- [n] rows: reason``, numbered in the order of
    their first row. A row *close* or *not reproduced* needs its ``why`` (*not reproduced*
    without one: "reason not found yet."); rows with the same reason share its note, which
    names them as ``method (metric, metric), method (metric)``."""
    concerns: dict[str, dict[str, list[str]]] = {}  # reason -> method -> metrics, in row order
    marks = []
    for r, v in zip(rows, verdicts):
        why = (r.why if v in ("not reproduced", "close") and r.why
               else "reason not found yet." if v == "not reproduced" else None)
        if why is None:
            marks.append("")
            continue
        concerns.setdefault(why, {}).setdefault(r.method, []).append(r.metric)
        marks.append(f" [{list(concerns).index(why) + 1}]")
    notes = [f"- [{n}] " + ", ".join(f"{method} ({', '.join(metrics)})"
                                      for method, metrics in by_method.items()) + f": {why}"
             for n, (why, by_method) in enumerate(concerns.items(), 1)]
    return marks, notes


def _claim_lines(rows: list[FigureRow], measured: list[Measured], orders: dict[str, str]
                 ) -> list[str]:
    """One line per order claim of a section: the paper's ranks, mpifl's means, the verdict."""
    out = []
    for claim in dict.fromkeys(r.claim for r in rows if r.claim and r.rank):
        members = sorted((r.rank, r.method, m) for r, m in zip(rows, measured) if r.claim == claim)
        shown = "; ".join(f"#{rank} {method}: {m.shown()}" for rank, method, m in members)
        out.append(f"- Order claim `{claim}` (paper's rank, 1 = smallest; mpifl's figure): "
                   f"{shown} — **{orders[claim]}**")
    return out


def suite_header(path: Path) -> str:
    """The leading comment block of a suite file, without the ``#`` marks."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        out.append(line[2:] if line.startswith("# ") else line[1:])
    return "\n".join(out)


def _verdict_rank(verdict: str) -> tuple[int, str]:
    """Summary order: reproduced, close, not reproduced (then anything else by name), so the
    generated document does not change with the order the results were read in."""
    order = ("reproduced", "close", "not reproduced")
    return (order.index(verdict) if verdict in order else len(order), verdict)
