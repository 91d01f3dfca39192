"""sweep — grids of runs: the sweep file, its plan and index, launching locally or on SLURM
through submitit, the job that runs on the nodes, and sweep reports.

May import: every folder below it.  Never imports: bench, cli.

One job per module: ``spec`` reads and checks the sweep file, ``plan`` expands it into runs
(ids, output paths, the index), ``status`` reads each run's status from disk, ``launch/`` starts
the runs (``local``, ``slurm``), ``job`` is :class:`MpiRun` (what runs on the nodes),
``report`` makes the tables and plots, ``cli`` is ``mpifl sweep``.

``mpifl.sweep.MpiRun`` stays importable here: queued submitit jobs pickle it by this path. It
is loaded on first use, so that ``python -m mpifl.sweep.allocation`` (the sbatch templates) runs
a module the package's import has not loaded already.
"""

__all__ = ["MpiRun"]


def __getattr__(name: str):
    if name == "MpiRun":
        from mpifl.sweep.job import MpiRun

        return MpiRun
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
