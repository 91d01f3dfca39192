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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="HDF5 files of mpifl bench aggregation --out")
    p.add_argument("--out", type=Path, default=Path("agg_scaling.png"), help="PNG to write")
    p.add_argument("--at-m", type=int, help="m at which time vs d is drawn (default: see above)")
    p.add_argument("--at-d", type=int, help="d at which time vs m is drawn (default: see above)")
    args = p.parse_args(argv)
    missing = [r for r in args.results if not Path(r).is_file()]
    if missing:
        print(f"agg_scaling: error: {missing[0]}: no such file", file=sys.stderr)
        return 2
    try:
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
