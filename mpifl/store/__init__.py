"""store — files: the HDF5 results of a run and its atomic, checksummed checkpoints.

May import: core, metrics.  Never imports: data, models, aggregators, clients, runtime or above.
"""

from mpifl.store.results import (MEASURED_COLUMNS, ROUND_COLUMNS, SCHEMA_VERSION, MetricHistory,
                                 ResultsWriter, preflight, read_results)

__all__ = ["MEASURED_COLUMNS", "ROUND_COLUMNS", "SCHEMA_VERSION", "MetricHistory",
           "ResultsWriter", "preflight", "read_results"]
