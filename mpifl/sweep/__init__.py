"""sweep — grids of runs: the sweep file, its plan and index, launching locally or on SLURM
through submitit, the job that runs on the nodes, and sweep reports.

May import: every folder below it.  Never imports: bench, cli.

``mpifl.sweep.MpiRun`` stays importable here: queued submitit jobs pickle it by this path.
"""

from mpifl.sweep.sweep import MpiRun

__all__ = ["MpiRun"]
