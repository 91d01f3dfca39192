"""Where the time of a run goes, phase by phase, as the number of clients K and clients per round
m grow (PNG and a table).

    python analysis/run_profile.py runs/main.h5 --out runs/main-profile.png
    python analysis/run_profile.py runs/sweeps/scale --out runs/scale-profile.png   # a sweep

Reads results files (``mpifl run`` / ``mpifl sweep``; every /rounds row carries the phase
columns ``time_broadcast``, ``time_train``, ``time_gather``, ``time_aggregate``, ``time_eval``,
``time_checkpoint``, plus ``bytes_moved`` and the peak resident memory of rank 0 and of the
largest worker). For each run it prints the mean seconds per round of every phase, its share of
the round, the MPI share (broadcast + gather), MB moved per round and peak memory, and draws one
stacked bar per run, runs sorted by K then m. A folder is read as a sweep: every ``*.h5`` under
``DIR/runs`` (or under DIR itself).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mpifl.core.errors import MpiflError  # noqa: E402
from mpifl.store.results import read_results  # noqa: E402

PHASES = ("time_broadcast", "time_train", "time_gather", "time_aggregate", "time_eval",
          "time_checkpoint")


def run_paths(args: list[str]) -> list[Path]:
    """Results files named, and those of the sweep folders named.

    Raises:
        MpiflError: a path does not exist, or a folder holds no results.
    """
    out: list[Path] = []
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            found = sorted((path / "runs").glob("*.h5")) or sorted(path.glob("*.h5"))
            if not found:
                raise MpiflError(f"{path}: no results files (*.h5) in it or in its runs/")
            out += found
        elif path.is_file():
            out.append(path)
        else:
            raise MpiflError(f"{path}: no such results file or sweep folder")
    return out


def profile(path: Path) -> dict:
    """Per-round means of one run: ``{"name", "K", "m", "ranks", "rounds", <phase>: seconds,
    "total", "mpi_share", "mb_per_round", "rss_server_mb", "rss_worker_mb"}``.

    Raises:
        MpiflError: not a readable mpifl results file (see :func:`mpifl.store.read_results`).
    """
    res = read_results(path)
    rounds, cfg = res["rounds"], res["config"]
    n = len(rounds.get("round", []))
    if n == 0:
        raise MpiflError(f"{path}: no completed rounds to profile")
    row = {"name": path.stem, "K": cfg["data"]["num_clients"],
           "m": cfg["server"]["clients_per_round"], "ranks": res["attrs"].get("world_size", 1),
           "rounds": n}
    for phase in PHASES:  # files from before a phase was recorded read as 0
        row[phase] = float(np.mean(rounds[phase])) if phase in rounds else 0.0
    row["total"] = sum(row[p] for p in PHASES)
    row["mpi_share"] = (row["time_broadcast"] + row["time_gather"]) / row["total"] if row["total"] else 0.0
    row["mb_per_round"] = float(np.mean(rounds["bytes_moved"])) / 2**20
    for key in ("server", "worker"):
        col = rounds.get(f"peak_rss_{key}_mb")
        row[f"rss_{key}_mb"] = float(np.max(col)) if col is not None else float("nan")
    return row


def table(rows: list[dict]) -> str:
    """A plain-text table, one line per run."""
    head = (f"{'run':<24} {'K':>7} {'m':>6} {'ranks':>5} " + " ".join(
        f"{p[5:]:>10}" for p in PHASES) + f" {'s/round':>8} {'MPI %':>6} {'MB/round':>9}"
        f" {'RSS0 MB':>8} {'RSSw MB':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['name'][:24]:<24} {r['K']:>7} {r['m']:>6} {r['ranks']:>5} " + " ".join(
            f"{r[p]:>10.4f}" for p in PHASES) + f" {r['total']:>8.3f} {100 * r['mpi_share']:>6.1f}"
            f" {r['mb_per_round']:>9.1f} {r['rss_server_mb']:>8.0f} {r['rss_worker_mb']:>8.0f}")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    """Stacked bars of the per-round phase seconds, one bar per run."""
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(rows) + 2), 4.0), constrained_layout=True)
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for phase in PHASES:
        vals = np.array([r[phase] for r in rows])
        ax.bar(x, vals, bottom=bottom, label=phase[5:])
        bottom += vals
    ax.set_xticks(x, [f"{r['name']}\nK={r['K']} m={r['m']}" for r in rows], fontsize=7)
    ax.set_ylabel("seconds per round (mean)")
    ax.set_title("where a round's time goes")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="results files (.h5) or sweep folders")
    p.add_argument("--out", type=Path, default=Path("profile.png"), help="PNG to write")
    args = p.parse_args(argv)
    try:
        rows = sorted((profile(path) for path in run_paths(args.runs)),
                      key=lambda r: (r["K"], r["m"], r["name"]))
        print(table(rows))
        plot(rows, args.out)
    except MpiflError as exc:
        print(f"run_profile: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
