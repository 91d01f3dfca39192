"""Plot accuracy and fairness curves of one or more runs (PNG).

    python analysis/curves.py runs/main.h5 runs/main-fedavg.h5 --out runs/curves.png

Three panels over rounds: mean client accuracy, worst-5% accuracy, and the standard deviation of
client accuracies (percentage points). Reads results files with :func:`mpifl.store.read_results`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mpifl.core.errors import MpiflError  # noqa: E402
from mpifl.store.results import read_results  # noqa: E402

PANELS = [("mean", "mean accuracy (%)", 100.0), ("worst5", "worst-5% accuracy (%)", 100.0),
          ("std", "std of client accuracy (pp)", 100.0)]


def plot(paths: list[str], out: Path) -> None:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4), constrained_layout=True)
    for path in paths:
        res = read_results(path)
        ev = res["eval"]
        label = f"{Path(path).stem} ({res['attrs'].get('algorithm', '?')})"
        for ax, (key, _, scale) in zip(axes, PANELS):
            ax.plot(ev["round"], scale * ev[key], marker="o", markersize=3, label=label)
    for ax, (_, title, _) in zip(axes, PANELS):
        ax.set_xlabel("round")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="results files (.h5)")
    p.add_argument("--out", type=Path, default=Path("curves.png"), help="PNG to write")
    args = p.parse_args(argv)
    try:
        plot(args.runs, args.out)
    except MpiflError as exc:
        print(f"curves: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
