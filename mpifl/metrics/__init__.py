"""metrics — evaluation summaries (mean, worst-5%, fair angle), conflict counts, and group /
client fairness metrics (demographic parity, equalized odds, accuracy parity).

May import: core.  Never imports: data, models, aggregators, store or anything above them.
"""

from mpifl.metrics.summary import (LOSS_SUMMARY_KEYS, SUMMARY_KEYS, client_summary,
                                   count_conflicts, count_layer_conflicts, loss_summary)

__all__ = ["LOSS_SUMMARY_KEYS", "SUMMARY_KEYS", "client_summary", "count_conflicts",
           "count_layer_conflicts", "loss_summary"]
