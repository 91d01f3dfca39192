"""Scaling of aggregation cost: log-log plots and fitted exponents from ``mpifl bench aggregation``.

    mpifl bench aggregation --m 10,60,200 --d 199210 --out runs/agg-m.h5
    mpifl bench aggregation --m 60 --d 12450,49800,199210,796840 --out runs/agg-d.h5
    python analysis/agg_scaling.py runs/agg-m.h5 runs/agg-d.h5 --out runs/agg_scaling.png

Reads the benchmark's HDF5 files (plain datasets, no pickle; layout in :mod:`mpifl.bench.aggregation`; several
files are merged, the first one's value winning where a case repeats) and draws two panels: the
median time of one ``aggregate()`` against clients per round m and against the model size d, one
line per algorithm (FedFV's direct form as ``fedfv_direct``), both axes logarithmic.

The time-vs-m line holds d at the value timed with the most distinct m (ties: the largest d), or
``--at-d``; the time-vs-d line holds m at the value timed with the most distinct d (ties: the
largest m), or ``--at-m``. Where a rule was timed at several history lengths, the smallest
tau >= 1 is used (else the smallest).

Each line gets a least-squares fit of ``log t = b log x + c`` (``numpy.polyfit``); the table
printed on stdout gives the exponents b for m and for d (``-`` with fewer than two points):
time ~ m^b_m * d^b_d near the sizes measured. Exit status 2 with one line on stderr for a
missing or unreadable file.

**The number of shards P**: ``--sharded`` takes the files of the sharded benchmark,
one per P (``mpiexec -n P python -m mpifl bench aggregation --shards P --out ...``), and adds

* a table per algorithm and case: P, the time split (local statistics, allsum, apply, gather),
  the speed-up over P = 1, the server's memory per rank (peak minus the rank's memory before
  the inputs) and its ratio to the P = 1 figure against the ideal 1/P;
* the cost model fitted to those rows (non-negative least squares, ``scipy.optimize.nnls``)::

      time(m, d, P)   = a m^2 d / P  +  b m d / P  +  c m^2 [P > 1]  +  e d [P > 1]
      memory(m, d, P) = 4 (1 + tau) m d / P bytes  +  f

  a: the partial Gram (and other O(m^2) per-coordinate work), b: per-coordinate passes over
  the rows (norms, the step as a combination of rows), c: the allsums of m x m float64 sums,
  e: gathering the step's blocks; memory: the block of this round's updates and of tau
  history rounds per rank (no fit but f, the fixed part), and its prediction at ``--predict``
  (default m = 10,000, d = 1e6, P = 8 and 64);
* ``--sharded-out``: a PNG with the time split against P (stacked bars) and the server's
  memory per rank against P with the ideal 1/P line.

    mpiexec -n 1 python -m mpifl bench aggregation --shards 1 --algorithms fedfv --m 500 --d 1000000 \
        --repeats 1 --warmup 0 --threads 1 --out runs/shard-p1.h5
    mpiexec -n 2 python -m mpifl bench aggregation --shards 2 --algorithms fedfv --m 500 --d 1000000 \
        --repeats 1 --warmup 0 --threads 1 --out runs/shard-p2.h5
    python analysis/agg_scaling.py --sharded runs/shard-p1.h5 runs/shard-p2.h5 \
        --sharded-out runs/shard_scaling.png
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from mpifl.bench.aggregation import read_hdf5  # noqa: E402
from mpifl.bench.sharded import read_sharded_hdf5  # noqa: E402


def _pick_tau(tau: np.ndarray) -> int:
    """The tau whose rows are plotted: the smallest >= 1, else the smallest (-1: no tau)."""
    values = sorted(set(int(t) for t in tau))
    positive = [t for t in values if t >= 1]
    return positive[0] if positive else values[0]


def _fixed(group: dict[str, np.ndarray], sel: np.ndarray, axis: str, at: int | None) -> int:
    """The value of the other size at which the ``axis`` line is drawn."""
    other = "d" if axis == "m" else "m"
    if at is not None:
        return at
    values = np.unique(group[other][sel])
    counts = [len(np.unique(group[axis][sel & (group[other] == v)])) for v in values]
    best = max(counts)
    return int(max(v for v, c in zip(values, counts) if c == best))


def series(group: dict[str, np.ndarray], axis: str,
           at: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(x, median seconds, fixed size) of one algorithm along ``axis`` ("m" or "d"), the other
    size held fixed (see the module docstring), sorted by x."""
    tau = group["tau"]
    sel = tau == _pick_tau(tau)
    other = "d" if axis == "m" else "m"
    fixed = _fixed(group, sel, axis, at)
    sel &= group[other] == fixed
    x, t = group[axis][sel], group["median_s"][sel]
    order = np.argsort(x)
    return x[order].astype(np.float64), t[order].astype(np.float64), fixed


def merge(files: list[tuple[dict, dict]]) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """Groups of several results files in one; a (m, d, tau) case already seen is dropped."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for groups, _ in files:
        for name, g in groups.items():
            if name not in out:
                out[name] = {k: v for k, v in g.items() if isinstance(v, np.ndarray)}
                continue
            have = set(zip(out[name]["m"].tolist(), out[name]["d"].tolist(),
                           out[name]["tau"].tolist()))
            new = np.array([(m, d, t) not in have for m, d, t in
                            zip(g["m"].tolist(), g["d"].tolist(), g["tau"].tolist())], bool)
            for k in list(out[name]):
                if k in g:
                    out[name][k] = np.concatenate([out[name][k], g[k][new]])
    return out, files[0][1]


def exponent(x: np.ndarray, t: np.ndarray) -> float:
    """Least-squares slope of log t against log x; NaN with fewer than two distinct x."""
    ok = (x > 0) & (t > 0)
    if len(np.unique(x[ok])) < 2:
        return math.nan
    return float(np.polyfit(np.log(x[ok]), np.log(t[ok]), 1)[0])


def fit_table(groups: dict[str, dict[str, np.ndarray]], at_m: int | None = None,
              at_d: int | None = None) -> list[dict]:
    """One row per algorithm: exponents along m and d and the sizes they were fitted at."""
    rows = []
    for name in sorted(groups):
        g = groups[name]
        xm, tm, fd = series(g, "m", at_d)
        xd, td, fm = series(g, "d", at_m)
        rows.append(dict(algorithm=name, exp_m=exponent(xm, tm), points_m=len(xm), at_d=fd,
                         exp_d=exponent(xd, td), points_d=len(xd), at_m=fm,
                         tau=_pick_tau(g["tau"])))
    return rows


def format_fits(rows: list[dict]) -> str:
    def f(v):
        return "-" if math.isnan(v) else f"{v:.2f}"

    head = f"{'algorithm':<14}{'tau':>4}{'exp m':>8}{'points':>7}{'at d':>9}" \
           f"{'exp d':>8}{'points':>7}{'at m':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        tau = "-" if r["tau"] < 0 else str(r["tau"])
        lines.append(f"{r['algorithm']:<14}{tau:>4}{f(r['exp_m']):>8}{r['points_m']:>7}"
                     f"{r['at_d']:>9}{f(r['exp_d']):>8}{r['points_d']:>7}{r['at_m']:>6}")
    return "\n".join(lines)


def plot(groups: dict[str, dict[str, np.ndarray]], attrs: dict, fits: list[dict],
         out: Path, at_m: int | None = None, at_d: int | None = None) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    exps = {r["algorithm"]: r for r in fits}
    cmap = plt.get_cmap("tab20")
    for i, name in enumerate(sorted(groups)):
        style = dict(color=cmap(i % 20), marker="o", markersize=3,
                     linestyle="--" if name.endswith("_direct") else "-")
        bm, bd = (("-" if math.isnan(exps[name][k]) else f"{exps[name][k]:.2f}")
                  for k in ("exp_m", "exp_d"))
        for ax, axis, at in ((axes[0], "m", at_d), (axes[1], "d", at_m)):
            x, t, _ = series(groups[name], axis, at)
            ax.plot(x, t, label=f"{name}  m^{bm} d^{bd}", **style)
    axes[0].set_xlabel("clients per round m")
    fixed_d = sorted({r["at_d"] for r in fits})
    fixed_m = sorted({r["at_m"] for r in fits})
    axes[0].set_title(f"time vs m (d = {', '.join(f'{v:,}' for v in fixed_d)})", fontsize=10)
    axes[1].set_xlabel("model size d")
    axes[1].set_title(f"time vs d (m = {', '.join(str(v) for v in fixed_m)})", fontsize=10)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("median aggregate() time (s)")
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False,
               title="rule  fitted exponents", title_fontsize=8)
    machine = f"{attrs.get('device_name', '?')}, {attrs.get('torch_threads', '?')} threads, " \
              f"torch {attrs.get('torch_version', '?')}"
    fig.suptitle(f"aggregation cost per round — {machine}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    fig.savefig(out, dpi=80)
    plt.close(fig)


# ---- the number of shards P ---------------------------------------------------------------

def sharded_rows(files: list[str]) -> list[dict]:
    """One dict per (algorithm, P, m, d, tau) of the sharded benchmark files (the first file's
    value winning where a case repeats)."""
    rows, seen = [], set()
    for path in files:
        groups, attrs = read_sharded_hdf5(path)
        P = int(attrs["shards"])
        # a process's later cases start on heap memory its earlier ones freed and kept: only a
        # file of one case measures memory (mpifl.bench.sharded)
        single = sum(len(g["m"]) for g in groups.values()) == 1
        for alg, g in groups.items():
            for i in range(len(g["m"])):
                key = (alg, P, int(g["m"][i]), int(g["d"][i]), int(g["tau"][i]))
                if key in seen:
                    continue
                seen.add(key)
                server = g["peak_rss_mb"][i] - g["base_rss_mb"][i]
                rows.append(dict(algorithm=alg, P=P, m=key[2], d=key[3], tau=key[4],
                                 time=float(g["median_s"][i]), local=float(g["local_s"][i]),
                                 allsum=float(g["allsum_s"][i]), apply=float(g["apply_s"][i]),
                                 gather=float(g["gather_s"][i]),
                                 server_mb=float(np.max(server)),
                                 diff=float(g["max_rel_diff"][i]), single=single))
    return sorted(rows, key=lambda r: (r["algorithm"], r["m"], r["d"], r["tau"], r["P"]))


def _features(m, d, P) -> np.ndarray:
    m, d, P = (np.asarray(v, dtype=np.float64) for v in (m, d, P))
    many = (P > 1).astype(np.float64)
    return np.stack([m * m * d / P, m * d / P, m * m * many, d * many], axis=-1)


def fit_cost_model(rows: list[dict]) -> dict:
    """Coefficients a, b, c, e (seconds per unit, module docstring) by non-negative least
    squares on the relative error of every row's time, and f (MiB), the median fixed memory
    of the rows measured alone (a file of one case; NaN when there is none)."""
    from scipy.optimize import nnls

    X = _features([r["m"] for r in rows], [r["d"] for r in rows], [r["P"] for r in rows])
    t = np.array([r["time"] + r["gather"] for r in rows])
    coef, _ = nnls(X / t[:, None], np.ones(len(t)))  # relative: small cases count as much
    fixed = [r["server_mb"] - _state_mb(r) for r in rows if r.get("single", True)]
    return dict(zip("abce", coef.tolist()), f=float(np.median(fixed)) if fixed else math.nan)


def _state_mb(r: dict) -> float:
    return 4 * (1 + max(r["tau"], 0)) * r["m"] * r["d"] / r["P"] / 2**20


def predict(model: dict, m: int, d: int, P: int, tau: int) -> tuple[float, float]:
    """(seconds, MiB per rank) of one aggregation under the fitted cost model."""
    x = _features(m, d, P)
    t = float(x @ np.array([model[k] for k in "abce"]))
    return t, _state_mb(dict(m=m, d=d, P=P, tau=tau)) + model["f"]


def _prediction(model: dict, m: int, d: int, P: int, tau: int) -> str:
    secs, mb = predict(model, m, d, P, tau)
    if math.isnan(mb):  # no one-case file: the state alone, a lower bound
        return f"P = {P}: {secs:.3g} s, >= {_state_mb(dict(m=m, d=d, P=P, tau=tau)) / 1024:.3g} GiB/rank"
    return f"P = {P}: {secs:.3g} s, {mb / 1024:.3g} GiB/rank"


def format_sharded_table(rows: list[dict]) -> str:
    head = (f"{'algorithm':<10}{'m':>6}{'d':>9}{'tau':>4}{'P':>4}{'time s':>9}{'local':>8}"
            f"{'allsum':>8}{'apply':>8}{'gather':>8}{'speed-up':>9}{'MiB/rank':>9}"
            f"{'x P=1':>7}{'1/P':>6}{'diff':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ref = next((q for q in rows if q["P"] == 1 and all(
            q[k] == r[k] for k in ("algorithm", "m", "d", "tau"))), None)
        up = f"{ref['time'] / r['time']:.2f}x" if ref else "-"
        mem = (f"{r['server_mb'] / ref['server_mb']:.2f}"
               if ref and r["single"] and ref["single"] and ref["server_mb"] > 0 else "-")
        tau = "-" if r["tau"] < 0 else str(r["tau"])
        mib = f"{r['server_mb']:.0f}" if r["single"] else "-"
        lines.append(f"{r['algorithm']:<10}{r['m']:>6}{r['d']:>9}{tau:>4}{r['P']:>4}"
                     f" {r['time']:>8.3g} {r['local']:>7.3g} {r['allsum']:>7.3g}"
                     f" {r['apply']:>7.3g} {r['gather']:>7.3g}{up:>9}{mib:>9}"
                     f"{mem:>7}{1 / r['P']:>6.2f}{r['diff']:>9.1e}")
    return "\n".join(lines)


def plot_sharded(rows: list[dict], out: Path) -> None:
    algs = sorted({r["algorithm"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(len(algs), 1)
    colors = {"local": "tab:blue", "allsum": "tab:orange", "apply": "tab:green",
              "gather": "tab:red"}
    for i, alg in enumerate(algs):
        big = max((r for r in rows if r["algorithm"] == alg), key=lambda r: (r["m"] * r["d"]))
        sel = [r for r in rows if r["algorithm"] == alg and
               (r["m"], r["d"], r["tau"]) == (big["m"], big["d"], big["tau"])]
        Ps = [r["P"] for r in sel]
        x = np.arange(len(Ps)) + i * width
        bottom = np.zeros(len(sel))
        for part, color in colors.items():
            h = np.array([r[part] for r in sel])
            axes[0].bar(x, h, width, bottom=bottom, color=color, alpha=0.4 + 0.6 * (i == 0),
                        label=part if i == 0 else None)
            bottom += h
        for xi, P in zip(x, Ps):
            axes[0].text(xi, 0, f"{alg}\nP={P}", ha="center", va="bottom", fontsize=6)
        alone = [r for r in sel if r["single"]]  # memory is measured by one-case files only
        mem, mPs = [r["server_mb"] for r in alone], [r["P"] for r in alone]
        if alone:
            axes[1].plot(mPs, mem, "o-", label=f"{alg} m={big['m']} d={big['d']:,}")
        if 1 in mPs:
            ref = mem[mPs.index(1)]
            axes[1].plot(mPs, [ref / P for P in mPs], "k:", lw=1)
    axes[0].set_ylabel("seconds per aggregation (rank 0)")
    axes[0].set_title("time split against P", fontsize=10)
    axes[0].set_xticks([])
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel("shards P")
    axes[1].set_ylabel("server memory per rank (MiB, peak - start)")
    axes[1].set_title("memory per rank against P (dotted: P = 1 figure / P)", fontsize=10)
    axes[1].legend(fontsize=7)
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def _sharded_report(files: list[str], out: Path | None, predict_at: str) -> str:
    rows = sharded_rows(files)
    if not rows:
        raise ValueError(f"{files[0]}: no sharded benchmark rows")
    lines = [format_sharded_table(rows), ""]
    m, d, *Ps = (int(float(v)) for v in predict_at.split(","))
    lines.append("cost model per algorithm (time = a m^2 d/P + b m d/P + c m^2 [P>1] + e d [P>1];"
                 " memory = 4 (1+tau) m d/P + f):")
    for alg in sorted({r["algorithm"] for r in rows}):
        sel = [r for r in rows if r["algorithm"] == alg]
        model = fit_cost_model(sel)
        tau = max(r["tau"] for r in sel)
        coef = ", ".join(f"{k} = {model[k]:.3g}" for k in "abce")
        pred = "; ".join(_prediction(model, m, d, P, tau) for P in Ps)
        lines.append(f"  {alg} ({len(sel)} rows): {coef}, f = {model['f']:.0f} MiB; "
                     f"at m = {m:,}, d = {d:,}, tau = {max(tau, 0)}: {pred}")
    if out is not None:
        plot_sharded(rows, out)
        lines.append(f"wrote {out}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="*", help="HDF5 files of mpifl bench aggregation --out")
    p.add_argument("--sharded", nargs="+", default=[], metavar="FILE",
                   help="HDF5 files of mpifl bench aggregation --shards P --out (one per P)")
    p.add_argument("--sharded-out", type=Path, help="PNG of time and memory against P")
    p.add_argument("--predict", default="10000,1000000,8,64", metavar="M,D,P[,P...]",
                   help="where the fitted cost model predicts (default 10000,1000000,8,64)")
    p.add_argument("--out", type=Path, default=Path("agg_scaling.png"), help="PNG to write")
    p.add_argument("--at-m", type=int, help="m at which time vs d is drawn (default: see above)")
    p.add_argument("--at-d", type=int, help="d at which time vs m is drawn (default: see above)")
    args = p.parse_args(argv)
    missing = [r for r in [*args.results, *args.sharded] if not Path(r).is_file()]
    if missing:
        print(f"agg_scaling: error: {missing[0]}: no such file", file=sys.stderr)
        return 2
    if not args.results and not args.sharded:
        print("agg_scaling: error: give benchmark files, or --sharded files", file=sys.stderr)
        return 2
    try:
        if args.sharded:
            print(_sharded_report(args.sharded, args.sharded_out, args.predict))
        if not args.results:
            return 0
        groups, attrs = merge([read_hdf5(r) for r in args.results])
        if not groups:
            raise ValueError(f"{args.results[0]}: no benchmarked algorithm in the file")
        fits = fit_table(groups, args.at_m, args.at_d)
        plot(groups, attrs, fits, args.out, args.at_m, args.at_d)
    except (ValueError, KeyError, OSError) as exc:
        print(f"agg_scaling: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(format_fits(fits))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
