"""``mpifl plot``: figures of runs, built on :func:`mpifl.load` (matplotlib, an optional extra).

Runs that differ only in their seed form one line: the mean over seeds, with a band of ± one
sample standard deviation when there are several.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mpifl.core.errors import OutputError
from mpifl.report.load import load_noted

if TYPE_CHECKING:
    import xarray as xr

#: curves: (variable, panel title, scale to the printed unit)
CURVES = [("mean", "mean client accuracy (%)", 100.0), ("worst5", "worst-5% accuracy (%)", 100.0),
          ("std", "std of client accuracy (pp)", 100.0)]
#: the same for regression runs (no accuracy): the clients' test losses
LOSS_CURVES = [("loss_mean", "mean client loss", 1.0),
               ("loss_worst5", "worst-5% loss (highest)", 1.0),
               ("loss_std", "std of client loss", 1.0)]


def plot(kind: str, runs: list[str], out: Path) -> Path:
    """Draw ``kind`` (``curves``, ``clients`` or ``time``: accuracy against simulated hours,
    for runs on simulated time) for ``runs`` (results files or one sweep folder) into the PNG
    ``out``.

    Raises:
        OutputError: matplotlib missing, unreadable runs, ``time`` for runs without simulated
            time, or ``out`` not writable.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OutputError("mpifl plot needs matplotlib: pip install 'mpifl[plot]'") from None
    ds = load_noted(runs[0] if len(runs) == 1 and Path(runs[0]).is_dir() else runs)
    draw = {"curves": _curves, "clients": _clients, "time": _time}[kind]
    fig = draw(plt, ds)
    try:
        fig.savefig(out, dpi=110)
    except OSError as exc:
        raise OutputError(f"{out}: cannot write ({exc.strerror})") from None
    finally:
        plt.close(fig)
    return out


def _groups(ds: xr.Dataset) -> dict[str, list[int]]:
    """Label -> indices of runs that differ only in seed (algorithm and swept values)."""
    keys = [str(c) for c in ds.coords
            if ds[c].dims == ("run",) and c not in ("run", "seed", "status")]
    groups: dict[str, list[int]] = {}
    for i in range(ds.sizes["run"]):
        parts = [str(ds[k].values[i]) if k == "algorithm" else f"{k.split('.')[-1]}="
                 f"{ds[k].values[i]}" for k in keys]
        groups.setdefault(" ".join(parts), []).append(i)
    return groups


def _curves(plt: Any, ds: xr.Dataset) -> Any:
    curves = CURVES if "mean" in ds else LOSS_CURVES
    fig, axes = plt.subplots(1, len(curves), figsize=(4.3 * len(curves), 3.5),
                             constrained_layout=True)
    rounds = ds["eval_round"].values
    for label, idx in _groups(ds).items():
        for ax, (name, _, scale) in zip(axes, curves):
            values = scale * ds[name].values[idx]  # (runs, evaluations), NaN past a run's end
            with warnings.catch_warnings():  # rounds no run of this group reached: NaN, no line
                warnings.simplefilter("ignore", RuntimeWarning)
                mean = np.nanmean(values, axis=0)
                sd = np.nanstd(values, axis=0, ddof=1) if len(idx) > 1 else None
            line, = ax.plot(rounds, mean, marker="o", markersize=2.5,
                            label=f"{label} ({len(idx)} seed{'s' * (len(idx) > 1)})")
            if sd is not None:
                ax.fill_between(rounds, mean - sd, mean + sd, color=line.get_color(), alpha=0.2)
    for ax, (_, title, _) in zip(axes, curves):
        ax.set(xlabel="round", title=title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return fig


def _time(plt: Any, ds: xr.Dataset) -> Any:
    """Mean and worst-5% accuracy against simulated hours, one line a run (runs on the same
    clock take different times to the same round, so seeds are not pooled)."""
    if "sim_time" not in ds:
        raise OutputError("mpifl plot time: the runs have no simulated time (run them with "
                          "[system] enabled = true)")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), constrained_layout=True)
    done = ds["eval_round"].values
    for i in range(ds.sizes["run"]):
        sim = ds["sim_time"].values[i]
        keep = (done >= 1) & (done <= len(sim))
        hours = sim[np.clip(done[keep] - 1, 0, None)] / 3600
        label = f"{ds['algorithm'].values[i]} ({ds['run'].values[i]})"
        for ax, name in zip(axes, ("mean", "worst5")):
            ax.plot(hours, 100 * ds[name].values[i][keep], marker="o", markersize=2.5,
                    label=label)
    for ax, title in zip(axes, ("mean accuracy (%)", "worst-5% accuracy (%)")):
        ax.set(xlabel="simulated hours", title=title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return fig


def _clients(plt: Any, ds: xr.Dataset) -> Any:
    """Each client's accuracy (regression: loss) at every run's last evaluation, sorted: the
    lower the left end, the worse the worst clients fare (regression: the higher the right)."""
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    what, scale = ("accuracy", 100) if "accuracy" in ds else ("loss", 1)
    acc = ds[what].values  # (runs, evaluations, clients)
    for label, idx in _groups(ds).items():
        finals = []
        for i in idx:
            done = np.flatnonzero(~np.isnan(acc[i, :, 0]))
            finals.append(np.sort(acc[i, done[-1]]) if done.size else np.array([]))
        pooled = np.sort(np.concatenate(finals))
        ax.plot(np.linspace(0, 100, pooled.size), scale * pooled, label=label)
    unit = " (%)" if what == "accuracy" else ""
    ax.set(xlabel=f"clients, sorted by {what} (percentile)", ylabel=f"final {what}{unit}",
           title=f"per-client {what} at the last evaluation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig
