"""HDF5 results files: one per run, written by rank 0 only.

Layout (also in docs/RESULTS.md)::

    /                        attrs: schema_version, mpifl_version, config (JSON), world_size,
                                    status ("running" | "complete"), algorithm, num_clients
    /rounds/<column>         (R,)   one row per completed round (see ROUND_COLUMNS)
    /rounds/conflicts_layer  (R, L) per-layer conflict counts (LAYER_COLUMNS)
    /rounds/selected         (R, m) int64, the clients selected in each round, ascending
                                    (-1: not recorded, rounds run before schema 2)
    /rounds/aggregated       (R, m) bool, whether that client's update was aggregated (False:
                                    dropped out or rejected)
    /clients/num_train, num_test   (K,)   int64, each client's training / test samples
    /clients/label_counts    (K, C) int64, each client's training samples per label
    /clients/local_state     (K, s) float32, each client's local BatchNorm coordinates at the
                                    end of the run (model.batchnorm "local" or "local_stats";
                                    attrs names, column_start, column_stop, offset: which
                                    parameter each column block is and where it sits in w)
    /system/rounds/<column>  (R,)   a run on simulated time ([system] enabled): sim_time,
                                    selected, finished, late (SYSTEM_COLUMNS)
    /system/clients/<column> (K,)   tier, participations, finished, late, busy_s
    /eval/round              (E,)   int, rounds completed at that evaluation
    /eval/client_accuracy    (E, K) float64, fraction in [0, 1], on each client's local test split
    /eval/client_loss        (E, K) float64, mean of [model] loss (cross-entropy by default)
    /eval/<summary>          (E,)   mean, weighted_mean, std, worst5, best5, cf (fractions of 1),
                                    fair_angle (radians)
    /eval/group/{dp,eo,ap}   (E,)   group-fairness violations on the union of the clients' test
                                    data (only for binary tasks with a sensitive attribute)
    /eval/personal_accuracy, personal_loss   (E, K)  each client's personal model (Ditto only)
    /eval/personal/<summary> (E,)   the summaries of the personal accuracies (Ditto only)
    /eval/adapted/client_accuracy, client_loss   (E, K)  after local adaptation: each client's
                                    global model trained run.adapt_epochs local epochs (only
                                    with run.adapt_epochs > 0; absent = off)
    /eval/adapted/<summary>  (E,)   the summaries of the adapted accuracies
    /eval/loss/{mean,std,worst5,best5}  (E,)  summaries of the client losses (regression
                                    losses only, where client_accuracy and its summaries are NaN)
    /model/global            (d,)   float32, final global parameters (and float buffers such as
                                    BatchNorm's running statistics), model_state order
    /model/layer_names, layer_start, layer_stop   (L,) the layer map (module -> slice of /model/global)

Every accuracy (and its std) is a fraction in [0, 1]; percentage points appear only in printed
reports. Schema 1 (before 2026-11-24) had no /rounds/selected, /rounds/aggregated or /clients and
stored std in percentage points: :func:`read_results` converts it, so readers see one unit.
docs/RESULTS.md is the full reference.

The file is rewritten atomically (temporary file, SHA-256 seal, rename) after every evaluation,
checkpoint and at least every FLUSH_SECONDS, so a run that dies or hits a full disk keeps its
evaluations and the file is never half-written.
Nothing is pickled: the config is a JSON text attribute and everything else is a plain dataset.

This module is the stable import surface; the work is split by job:

- :mod:`mpifl.store.schema`: the layout (dataset names, dtypes, units, schema version);
- :mod:`mpifl.store.encoding`: values <-> HDF5 arrays (chunking, deflate, the chunk cache);
- :mod:`mpifl.store.history`: the rows in memory (:class:`MetricHistory`, also in checkpoints);
- :mod:`mpifl.store.writer`: :class:`ResultsWriter` (why the file is rewritten, not appended to);
- :mod:`mpifl.store.reader`: reading and validating a file (:func:`read_results`,
  :func:`read_many`).
"""

from mpifl.store.encoding import (CHUNK_ELEMENTS, COMPRESS_MIN_BYTES, GZIP_LEVEL, ChunkCache,
                                  LocalState, chunk_shape, create_dataset)
from mpifl.store.history import MetricHistory, MetricSet
from mpifl.store.reader import (Damaged, DamagedResults, LazyArray, check_values, damage_reason,
                                read_many, read_results)
from mpifl.store.schema import (ADAPTED_KEYS, CLIENT_COLUMNS, GROUP_KEYS, LAYER_COLUMNS,
                                LOSS_KEYS, MEASURED_COLUMNS, PERSONAL_KEYS, READABLE_VERSIONS,
                                ROUND_COLUMNS, SCHEMA_VERSION, SELECTION_COLUMNS, SYSTEM_COLUMNS)
from mpifl.store.writer import FLUSH_SECONDS, ResultsWriter, preflight

__all__ = ["ADAPTED_KEYS", "CHUNK_ELEMENTS", "CLIENT_COLUMNS", "COMPRESS_MIN_BYTES",
           "FLUSH_SECONDS", "GROUP_KEYS", "GZIP_LEVEL", "LAYER_COLUMNS", "LOSS_KEYS",
           "MEASURED_COLUMNS", "PERSONAL_KEYS", "READABLE_VERSIONS", "ROUND_COLUMNS",
           "SCHEMA_VERSION", "SELECTION_COLUMNS", "SYSTEM_COLUMNS", "ChunkCache", "Damaged",
           "DamagedResults", "LazyArray", "LocalState", "MetricHistory", "MetricSet", "ResultsWriter",
           "check_values", "chunk_shape", "create_dataset", "damage_reason", "preflight",
           "read_many", "read_results"]
