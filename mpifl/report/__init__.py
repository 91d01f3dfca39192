"""report — what a finished run says: the fairness table of one or several results files.

May import: core, metrics, store.  Never imports: runtime, experiment, sweep, bench, cli.
"""

from mpifl.report.tables import format_table, summarise

__all__ = ["format_table", "summarise"]
