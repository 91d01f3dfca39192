"""Where UGA learns: UGA (Yao et al. 2019) against FedAvg over a sweep's Dirichlet alpha, local
epochs E and client lr, globally and after one epoch of local adaptation (docs/notes/uga-map.md).

    mpifl sweep jobs/sweep-uga-map.toml --out runs/uga-map --executor local
    python analysis/uga_map.py runs/uga-map          # writes docs/notes/uga-map.md and .png

Reads the results files the folder's ``index.json`` names with :func:`mpifl.load` /
:func:`mpifl.report.load.tables` (as a list; see :func:`load_folder` for why not the folder), the
swept values from the index. Only runs whose results file says ``status = complete`` count as
finished seeds, so the script can be rerun while the sweep goes on; the tables say "k of n
seeds"; the figure and the note are each written to a temporary file, then renamed. For every setting (alpha, E, lr)
and method (FedAvg, UGA per eta_g) it takes each seed's final accuracy (mean of its last
``--last`` evaluations), then mean and std over seeds, and gives UGA a verdict against FedAvg
(rule in :func:`verdict`). Exit status 2 with one line on stderr when the folder is missing or
holds no run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mpifl.core.errors import MpiflError  # noqa: E402

SETTING = ["alpha", "E", "lr"]
RENAME = {"data.dirichlet_alpha": "alpha", "client.epochs": "E", "client.lr": "lr",
          "uga.eta_g": "eta_g"}
FEDAVG = "FedAvg"
MARGIN = 0.02      # "within 2 pp" of FedAvg, as a fraction
DIVERGED = 0.15    # a run whose final global accuracy is below this (or NaN) diverged
SWEEP_CMD = "mpifl sweep {sweep} --out {folder} --executor local"
DOC = Path("docs/notes/uga-map.md")
# disable_numparse: tabulate would otherwise turn the cell text "60.0" into 60
MARKDOWN = {"index": False, "disable_numparse": True}
ORDER = {"learns": 0, "learns after adaptation": 1, "fails": 2}


# ---------------------------------------------------------------------------- reading

def method_of(algorithm: str, eta_g) -> str:
    """Method label of a run: "FedAvg" or "UGA eta_g=<g>"; other algorithms keep their name."""
    if algorithm == "fedavg":
        return FEDAVG
    if algorithm == "uga":
        return f"UGA eta_g={float(eta_g):g}"
    return algorithm


def tidy(frame: pd.DataFrame) -> pd.DataFrame:
    """A ``tables()`` frame with the swept keys renamed to alpha, E, lr (eta_g) and a ``method``
    column added (eta_g NaN where absent). Same rows; fedavg runs may carry the base config's
    eta_g, which is ignored."""
    out = frame.rename(columns=RENAME)
    if "eta_g" not in out:
        out["eta_g"] = np.nan
    out["method"] = [method_of(a, g) for a, g in zip(out["algorithm"], out["eta_g"])]
    if "mean" in out and "adapted_mean" not in out:     # run.adapt_epochs = 0: no adapted metric
        out["adapted_mean"] = np.nan
    return out


def planned(folder: Path) -> pd.DataFrame:
    """The sweep's planned runs from ``index.json``: one row per run, columns run (the results
    file's stem), results (path), alpha, E, lr, eta_g (NaN where not swept), algorithm, method,
    seed.

    Raises:
        MpiflError: no such folder, an unreadable index, or no run planned in it.
    """
    from mpifl.store.sweep_index import read_index

    if not folder.is_dir():
        raise MpiflError(f"{folder}: no such sweep folder")
    runs = read_index(folder)["runs"].values()
    if not runs:
        raise MpiflError(f"{folder}: no runs (no index.json, or an empty one)")
    rows = [{**r["params"], "run": Path(r["results"]).stem, "results": folder / r["results"],
             "algorithm": r["params"].get("server.algorithm")} for r in runs]
    return tidy(pd.DataFrame(rows).rename(columns={"run.seed": "seed"}))


def sweep_file(folder: Path) -> str:
    """The sweep file named in ``index.json``, relative to the working directory when inside it."""
    path = Path(json.loads((folder / "index.json").read_text()).get("sweep_file", "SWEEP.toml"))
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def setup(folder: Path) -> str:
    """What the sweep's runs share, from the first planned run's config in ``index.json``: one
    sentence (dataset, clients, rounds, evaluation, model, batch size, adaptation epochs)."""
    c = next(iter(json.loads((folder / "index.json").read_text())["runs"].values()))["config"]
    run, data, model = c["run"], c["data"], c["model"]
    return (f"{data['dataset']}, {data['num_clients']} clients, {c['server']['clients_per_round']} "
            f"a round, {run['rounds']} rounds, evaluation every {run['eval_every']} rounds, "
            f"{model['name']} {model.get('hidden')}, B = {c['client']['batch_size']}, "
            f"`run.adapt_epochs = {run['adapt_epochs']}` (adapted accuracy: each client's test "
            f"accuracy after that many epochs of local SGD from the global model).")


def load_folder(folder: Path, plan: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(evals, rounds) long-form tables of the planned runs that have a results file, tidied,
    with the swept values taken from the plan (:func:`planned`).

    The files are loaded as a list, not as the folder: ``mpifl.load(folder)`` fails ("coordinate
    'uga.eta_g' not present in all datasets") while only FedAvg and eta_g = 1 runs are there,
    since a key swept for UGA alone is then in some runs' params and in no run's varying keys.

    Raises:
        MpiflError: no run has a results file yet, or one cannot be read.
    """
    import mpifl
    from mpifl.report.load import tables

    have = plan[[Path(r).is_file() for r in plan["results"]]]
    if have.empty:
        raise MpiflError(f"{folder}: no run has a results file yet")
    t = tables(mpifl.load(list(have["results"])))
    keys = have[["run", *SETTING, "eta_g", "method"]]
    out = []
    for name in ("evals", "rounds"):
        frame = t[name].drop(columns=[c for c in (*RENAME, *RENAME.values()) if c in t[name]])
        out.append(frame.merge(keys, on="run", how="left"))
    if out[0].empty:
        raise MpiflError(f"{folder}: no run has an evaluation yet")
    return out[0], out[1]


# ---------------------------------------------------------------------------- numbers

def per_seed(evals: pd.DataFrame, last: int = 2) -> pd.DataFrame:
    """One row per finished run (status "complete"): the setting, method, seed and its final
    ``global``, ``adapted``, ``worst5`` (means of its last ``last`` evaluations, fractions; NaN
    stays NaN), ``final`` (global mean at the last evaluation) and ``diverged`` (final < 15% or
    NaN)."""
    done = evals[evals["status"] == "complete"].sort_values(["run", "eval_round"])
    tail = done.groupby("run", sort=False).tail(last)
    cols = {"mean": "global", "adapted_mean": "adapted", "worst5": "worst5"}
    keys = ["run", *SETTING, "method", "seed"]
    out = tail.groupby(keys)[list(cols)].agg(lambda s: s.mean(skipna=False)).rename(columns=cols)
    out["final"] = done.groupby(keys)["mean"].last()
    out["diverged"] = ~(out["final"] >= DIVERGED)     # NaN compares False: counts as diverged
    return out.reset_index()


def summarise(seeds: pd.DataFrame, expected: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (alpha, E, lr, method): ``n`` finished seeds of ``planned``, mean and std over seeds
    of global / adapted / worst5 (``<metric>_mean``, ``<metric>_std``, fractions) and the number
    ``diverged``. A NaN seed makes its mean NaN (a diverged run is no evidence of learning)."""
    keys = [*SETTING, "method"]
    g = seeds.groupby(keys)
    out = pd.DataFrame({"n": g.size(), "diverged": g["diverged"].sum()})
    for m in ("global", "adapted", "worst5"):
        out[f"{m}_mean"] = g[m].mean().where(g[m].count() == g.size())
        out[f"{m}_std"] = g[m].std(ddof=0)
    plan_n = (expected if expected is not None else seeds).groupby(keys).size().rename("planned")
    out = out.join(plan_n, how="outer").reset_index()
    out[["n", "diverged"]] = out[["n", "diverged"]].fillna(0).astype(int)
    return out.sort_values(keys, key=_method_order).reset_index(drop=True)


def _method_order(col: pd.Series) -> pd.Series:
    """Sort key: FedAvg before the UGA rows, other columns as they are."""
    return col.map(lambda m: f"{m != FEDAVG:d}{m}") if col.name == "method" else col


def verdict(fed_g: float, fed_a: float, uga_g: float, uga_a: float, margin: float = MARGIN) -> str:
    """"learns" if UGA's final global accuracy >= FedAvg's - margin; else "learns after
    adaptation" if its adapted accuracy >= FedAvg's adapted - margin; else "fails". Fractions;
    NaN on UGA's side fails a test, NaN on FedAvg's gives "pending"."""
    if np.isnan(fed_g) or np.isnan(fed_a):
        return "pending"
    if uga_g >= fed_g - margin:
        return "learns"
    if uga_a >= fed_a - margin:
        return "learns after adaptation"
    return "fails"


def verdicts(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (alpha, E, lr): FedAvg's and the best UGA eta_g's global and adapted means
    (fractions), the differences ``d_global`` / ``d_adapted`` (UGA - FedAvg), the ``verdict``,
    the best ``uga`` method, ``diverged`` (text) and ``seeds`` (finished/planned per method)."""
    return pd.DataFrame([_setting_verdict(key, rows)
                         for key, rows in summary.groupby(SETTING, sort=True)])


def _setting_verdict(key: tuple, rows: pd.DataFrame) -> dict:
    """The verdict row of one setting; UGA's best eta_g is the one with the best verdict, ties
    broken by global then adapted accuracy."""
    fed = rows[rows["method"] == FEDAVG]
    fed_g, fed_a = (fed[c].iloc[0] if len(fed) else np.nan for c in ("global_mean", "adapted_mean"))
    uga = rows[(rows["method"] != FEDAVG) & (rows["n"] > 0)].copy()
    uga["verdict"] = [verdict(fed_g, fed_a, g, a) for g, a in zip(uga["global_mean"], uga["adapted_mean"])]
    uga["rank"] = uga["verdict"].map(ORDER).fillna(len(ORDER))
    uga = uga.sort_values(["rank", "global_mean", "adapted_mean"], ascending=[True, False, False])
    best = uga.iloc[0] if len(uga) else pd.Series({"method": None, "global_mean": np.nan,
                                                   "adapted_mean": np.nan, "verdict": "pending"})
    div = rows[rows["diverged"] > 0]
    return {**dict(zip(SETTING, key)), "fedavg_global": fed_g, "fedavg_adapted": fed_a,
            "uga": best["method"], "uga_global": best["global_mean"],
            "uga_adapted": best["adapted_mean"], "d_global": best["global_mean"] - fed_g,
            "d_adapted": best["adapted_mean"] - fed_a, "verdict": best["verdict"],
            "diverged": ", ".join(f"{m} x{n}" for m, n in zip(div["method"], div["diverged"])) or "-",
            "seeds": _seeds(rows)}


def _seeds(rows: pd.DataFrame) -> str:
    """Finished seeds per method of one setting, in the rows' method order: "3 / 1 / 0 of 3",
    or "3/3 / 1/2" when the planned counts differ."""
    if rows["planned"].nunique() == 1:
        return " / ".join(map(str, rows["n"])) + f" of {rows['planned'].iloc[0]}"
    return " / ".join(f"{n}/{p}" for n, p in zip(rows["n"], rows["planned"]))


def deltas(summary: pd.DataFrame) -> pd.DataFrame:
    """UGA minus FedAvg per (alpha, E, lr, UGA method): ``d_global``, ``d_adapted`` in
    fractions (NaN where either side has no finished seed)."""
    fed = summary[summary["method"] == FEDAVG].set_index(SETTING)[["global_mean", "adapted_mean"]]
    uga = summary[summary["method"].str.startswith("UGA")].merge(
        fed.reset_index(), on=SETTING, how="left", suffixes=("", "_fed"))
    uga["d_global"] = uga["global_mean"] - uga["global_mean_fed"]
    uga["d_adapted"] = uga["adapted_mean"] - uga["adapted_mean_fed"]
    return uga[[*SETTING, "method", "d_global", "d_adapted"]].reset_index(drop=True)


def eval_cost(rounds: pd.DataFrame, evals: pd.DataFrame) -> pd.DataFrame:
    """Per (method, E): ``evaluations`` counted, mean ``time_eval`` per evaluation and mean
    ``time_train`` per round (seconds), and ``ratio`` = eval / train. Evaluation rounds are
    those whose rounds-completed (round + 1) is an eval_round of the run."""
    ev = evals[["run", "eval_round"]].assign(hit=1)
    r = rounds.assign(eval_round=rounds["round"] + 1).merge(ev, on=["run", "eval_round"], how="left")
    r["is_eval"] = r["hit"].notna()
    g = r.groupby(["method", "E"])
    out = pd.DataFrame({"evaluations": g["is_eval"].sum(),
                        "time_eval": r[r["is_eval"]].groupby(["method", "E"])["time_eval"].mean(),
                        "time_train": g["time_train"].mean()})
    out["ratio"] = out["time_eval"] / out["time_train"]
    return out.reset_index().sort_values(["method", "E"], key=_method_order).reset_index(drop=True)


# ---------------------------------------------------------------------------- text

def pct(x: float) -> str:
    """A fraction as percent with one decimal ("n/a" for NaN)."""
    return "n/a" if pd.isna(x) else f"{100 * x:.1f}"


def pp(x: float) -> str:
    """A difference of fractions as signed percentage points ("n/a" for NaN)."""
    return "n/a" if pd.isna(x) else f"{100 * x:+.1f}"


def pm(mean: float, std: float, n: int) -> str:
    """"mean ± std" in percent; the std is left out with fewer than 2 seeds."""
    return pct(mean) if n < 2 or pd.isna(mean) else f"{pct(mean)} ± {100 * std:.1f}"


def summary_markdown(summary: pd.DataFrame) -> str:
    """The per-method table of one or more settings as GitHub markdown (percent)."""
    s = summary

    def cell(m: str) -> list[str]:
        return [pm(a, b, n) for a, b, n in zip(s[f"{m}_mean"], s[f"{m}_std"], s["n"])]

    table = pd.DataFrame({"E": s["E"], "lr": s["lr"], "method": s["method"],
                          "seeds": [f"{n} of {p}" for n, p in zip(s["n"], s["planned"])],
                          "global mean %": cell("global"), "adapted mean %": cell("adapted"),
                          "worst-5% %": cell("worst5"), "diverged runs": s["diverged"]})
    return table.to_markdown(**MARKDOWN)


def verdict_markdown(v: pd.DataFrame, methods: list[str]) -> str:
    """The verdict table (one row per setting) as GitHub markdown (percent, pp); methods: the
    summary's methods in table order, naming the parts of the seeds column."""
    table = pd.DataFrame({
        "alpha": v["alpha"], "E": v["E"], "lr": v["lr"],
        "FedAvg global %": v["fedavg_global"].map(pct), "best UGA": v["uga"].astype(object).fillna("-"),
        "UGA global %": v["uga_global"].map(pct), "Δ global pp": v["d_global"].map(pp),
        "FedAvg adapted %": v["fedavg_adapted"].map(pct), "UGA adapted %": v["uga_adapted"].map(pct),
        "Δ adapted pp": v["d_adapted"].map(pp), "verdict": v["verdict"],
        "diverged (<15% or NaN)": v["diverged"], f"seeds done ({' / '.join(methods)})": v["seeds"]})
    return table.to_markdown(**MARKDOWN)


def cost_markdown(cost: pd.DataFrame) -> str:
    """The evaluation-cost table as GitHub markdown (seconds, ratio)."""
    table = pd.DataFrame({"method": cost["method"], "E": cost["E"], "evaluations": cost["evaluations"],
                          "time_eval s / evaluation": cost["time_eval"].map("{:.2f}".format),
                          "time_train s / round": cost["time_train"].map("{:.2f}".format),
                          "eval / round's training": cost["ratio"].map("{:.1f}x".format)})
    return table.to_markdown(**MARKDOWN)


def _name(row) -> str:
    """A setting's short label, "E=5, lr=0.02"."""
    return f"E={row['E']:g}, lr={row['lr']:g}"


def _listed(rows: pd.DataFrame, col: str) -> str:
    """"(E=2, lr=0.05: +1.3 pp; ...)" for rows, from the fraction column col; "" if none."""
    return "" if rows.empty else " (" + "; ".join(f"{_name(r)}: {pp(r[col])} pp"
                                                  for _, r in rows.iterrows()) + ")"


def alpha_paragraph(alpha: float, v: pd.DataFrame, d: pd.DataFrame) -> str:
    """A paragraph, filled from the numbers, on where UGA works at this alpha: the verdict
    counts with the settings and gaps, the range of the gaps, the better eta_g, divergences.
    v: verdict rows of this alpha; d: :func:`deltas` rows of this alpha."""
    done = v[v["verdict"] != "pending"]
    parts = [(f"**alpha = {alpha:g}.** {len(done)} of {len(v)} settings have finished seeds "
              "of both FedAvg and UGA.")]
    for name, col in (("learns", "d_global"), ("learns after adaptation", "d_adapted"),
                      ("fails", "d_global")) if len(done) else ():
        rows = done[done["verdict"] == name]
        parts.append(f"UGA {name} in {len(rows)} of them{_listed(rows, col)}.")
    if len(done):
        parts.append(_range_sentence(done))
    parts.append(_eta_sentence(d))
    n_div = int(v["diverged"].ne("-").sum())
    parts.append(f"Settings with a diverged run: {n_div}"
                 + ("" if not n_div else " (" + "; ".join(
                     f"{_name(r)}: {r['diverged']}" for _, r in v[v["diverged"].ne("-")].iterrows()) + ")")
                 + ".")
    return " ".join(parts)


def _range_sentence(done: pd.DataFrame) -> str:
    """The spread of the best UGA's gap to FedAvg, global and adapted, with where it is widest."""
    out = []
    for label, col in (("global", "d_global"), ("adapted", "d_adapted")):
        lo, hi = done.loc[done[col].idxmin()], done.loc[done[col].idxmax()]
        out.append(f"{label} {pp(lo[col])} pp ({_name(lo)}) to {pp(hi[col])} pp ({_name(hi)})")
    return "Best UGA minus FedAvg ranges: " + "; ".join(out) + "."


def _eta_sentence(d: pd.DataFrame) -> str:
    """How often each eta_g has the higher global accuracy where both have finished seeds."""
    wide = d.pivot_table(index=["E", "lr"], columns="method", values="d_global").dropna()
    if wide.shape[1] < 2 or wide.empty:
        return "Not enough finished runs to compare the eta_g values."
    wins = wide.idxmax(axis=1).value_counts()
    return "Higher global accuracy: " + ", ".join(
        f"{m} in {wins.get(m, 0)} of {len(wide)} settings" for m in wide.columns) + "."


def cost_sentence(cost: pd.DataFrame) -> str:
    """One sentence per (method, E) row of :func:`eval_cost`: seconds per evaluation and the
    multiple of a round's training it costs."""
    parts = [f"{r['method']} with E={r['E']:g}: {r['time_eval']:.2f} s per evaluation, "
             f"{r['ratio']:.1f}x the {r['time_train']:.2f} s of a round's training"
             for _, r in cost.iterrows()]
    return ("Mean time per evaluation against mean training time per round: " + "; ".join(parts)
            + ". `time_eval` holds the global model's evaluation as well as the adaptation of all "
            "clients, so it bounds the adaptation's cost from above; timings are from runs sharing "
            "the machine with other work.")


# ---------------------------------------------------------------------------- figure

def plot(d: pd.DataFrame, summary: pd.DataFrame, path: Path) -> None:
    """Heatmaps of UGA minus FedAvg (pp, from :func:`deltas`): rows global / adapted, one column
    per UGA method; each panel alpha (rows) x (E, lr) (columns) over the settings of summary,
    n/a where unfinished. Written atomically to path (PNG)."""
    methods = sorted(m for m in summary["method"].unique() if m != FEDAVG) or ["UGA"]
    alphas = sorted(summary["alpha"].unique())
    cols = sorted({(e, lr) for e, lr in zip(summary["E"], summary["lr"])})
    vals = 100 * d[["d_global", "d_adapted"]].to_numpy(dtype=float)
    lim = max(1.0, float(np.nanmax(np.abs(vals)))) if np.isfinite(vals).any() else 1.0
    fig, axes = plt.subplots(2, len(methods), figsize=(4.6 * len(methods) + 1, 7), squeeze=False,
                             layout="constrained")
    for j, m in enumerate(methods):
        cells = {(r["alpha"], r["E"], r["lr"]): r for _, r in d[d["method"] == m].iterrows()}
        for i, (metric, label) in enumerate((("d_global", "global"), ("d_adapted", "adapted"))):
            grid = np.array([[100 * cells[(a, *c)][metric] if (a, *c) in cells else np.nan
                              for c in cols] for a in alphas], dtype=float)
            im = _heatmap(axes[i, j], grid, alphas, cols, lim)
            axes[i, j].set_title(f"{m}: {label}", fontsize=9)
    fig.colorbar(im, ax=axes, shrink=0.8, label="UGA - FedAvg, final accuracy (pp)")
    fig.suptitle("UGA minus FedAvg, final mean client accuracy (pp); grey: no finished seeds")
    _save(fig, path)


def _heatmap(ax, values: np.ndarray, alphas: list, cols: list, lim: float):
    """One annotated panel: values (len(alphas), len(cols)) in pp, NaN cells marked n/a."""
    cmap = plt.get_cmap("RdBu").with_extremes(bad="0.85")
    im = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto")
    for (r, c), v in np.ndenumerate(values):
        dark = not np.isnan(v) and abs(v) > 0.6 * lim      # white text on the saturated cells
        ax.text(c, r, "n/a" if np.isnan(v) else f"{v:+.1f}", ha="center", va="center", fontsize=8,
                color="white" if dark else "black")
    ax.set_xticks(range(len(cols)), [f"E={e:g}\nlr={lr:g}" for e, lr in cols], fontsize=8)
    ax.set_yticks(range(len(alphas)), [f"α={a:g}" for a in alphas], fontsize=8)
    return im


def _save(fig, path: Path) -> None:
    """Save a figure to a temporary file beside path, then rename it over path."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---------------------------------------------------------------------------- document

def document(summary: pd.DataFrame, v: pd.DataFrame, d: pd.DataFrame, cost: pd.DataFrame,
             figure: str, intro: dict) -> str:
    """The markdown note: header, verdicts, figure, per-alpha paragraph and table, eval cost.
    intro: :func:`header`'s keyword arguments but summary."""
    out = [*header(summary, **intro),
           "## Verdicts", "", verdict_markdown(v, list(summary["method"].unique())), "",
           f"![UGA minus FedAvg, final accuracy]({figure})", ""]
    for alpha, rows in summary.groupby("alpha", sort=True):
        para = alpha_paragraph(alpha, v[v["alpha"] == alpha], d[d["alpha"] == alpha])
        out += [f"## alpha = {alpha:g}", "", para, "", summary_markdown(rows), ""]
    out += ["## Cost of the adapted evaluation", "", cost_sentence(cost), "", cost_markdown(cost), ""]
    return "\n".join(out)


def header(summary: pd.DataFrame, commands: list[str], sweep: str, shared: str,
           last: int) -> list[str]:
    """The note's opening lines: title, commands, what was run (shared: :func:`setup`), progress,
    definitions."""
    methods = ", ".join(summary["method"].unique())
    return [
        "# Where UGA learns: UGA vs FedAvg under Dirichlet(alpha) label splits", "",
        "Generated by `analysis/uga_map.py` from the sweep's results; rerun it, do not edit.", "",
        "```", *commands, "```", "",
        (f"{shared} Grid ({sweep}): alpha x E x lr x seed for {methods}; UGA is Yao et "
         "al. 2019's keep-trace local training."), "",
        (f"**Finished runs: {summary['n'].sum()} of {summary['planned'].sum()}.** A seed's final "
         f"accuracy is the mean of its last {last} evaluations; tables give mean ± std "
         "(population) over finished seeds, in %. Global: the global model on each client's "
         "test split, mean over clients; worst-5%: mean of the lowest 5% of clients."), "",
        (f"Verdict (best eta_g): *learns* if UGA's final global accuracy is at most "
         f"{100 * MARGIN:g} pp below FedAvg's or above; else *learns after adaptation* if its "
         f"adapted accuracy is at most {100 * MARGIN:g} pp below FedAvg's adapted; else *fails*. "
         f"A run diverged if its global accuracy at the last evaluation is below "
         f"{100 * DIVERGED:g}% or NaN."), ""]


def write_atomic(text: str, path: Path) -> None:
    """Write text to a temporary file beside path, then rename it over path."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def intro(args: argparse.Namespace) -> dict:
    """The header's inputs: the commands that made the note (options only where not default),
    the sweep file, :func:`setup`'s sentence and the evaluations averaged."""
    sweep = sweep_file(args.folder)
    script = " ".join(["python analysis/uga_map.py", str(args.folder),
                       *([f"--doc {args.doc}"] if args.doc != DOC else []),
                       *([f"--last {args.last}"] if args.last != 2 else [])])
    return {"commands": [SWEEP_CMD.format(sweep=sweep, folder=args.folder), script],
            "sweep": sweep, "shared": setup(args.folder), "last": args.last}


def main(argv: list[str] | None = None) -> int:
    """CLI: read the folder, write the note and its figure; 2 on a missing or empty folder."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", nargs="?", default="runs/uga-map", type=Path, help="sweep folder")
    ap.add_argument("--doc", type=Path, default=DOC, help="note to write")
    ap.add_argument("--last", type=int, default=2, help="evaluations averaged per seed (default 2)")
    args = ap.parse_args(argv)
    try:
        plan = planned(args.folder)
        evals, rounds = load_folder(args.folder, plan)
    except MpiflError as exc:
        print(f"uga_map: {exc}", file=sys.stderr)
        return 2
    summary = summarise(per_seed(evals, args.last), plan)
    v, d = verdicts(summary), deltas(summary)
    figure = args.doc.with_suffix(".png")
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    plot(d, summary, figure)
    text = document(summary, v, d, eval_cost(rounds, evals), figure.name, intro(args))
    write_atomic(text, args.doc)
    print(f"wrote {args.doc} and {figure} ({summary['n'].sum()} of {len(plan)} runs finished)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
