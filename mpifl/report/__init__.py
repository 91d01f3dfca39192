"""report — what runs say: the fairness table (seeds averaged), ``mpifl.load`` (an xarray Dataset
of results files or a sweep folder), long-form tables and their export, figures.

May import: core, metrics, store.  Never imports: runtime, experiment, sweep, bench, cli.
"""

from mpifl.report.tables import format_table, summarise

__all__ = ["format_table", "summarise"]
