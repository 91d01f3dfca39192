"""data — Datasets for mpifl: readers (IDX, CIFAR pickles read safely, Synthetic(alpha, beta), the
tabular fairness sets Adult, COMPAS and German credit with a sensitive attribute), partitions
over clients (ALGORITHMS.md §8), per-client train/test splits, and downloads. mpifl's own data
sets and partitions are registered like plugins (``registry``, ``builtin``), with their params
and what goes with what declared once (``compat``).

May import: core, metrics.  Never imports: models, aggregators, store or anything above them.

Public API::

    load_federated(dataset, *, partition, num_clients, seed, train_fraction, data_root,
                   dataset_params, partition_params) -> FederatedData
    load_population(dataset, *, partition="natural", num_clients, seed, ..., cache_size)
        -> LazyPopulation  (lazy data sets only: synthetic; .clients(ids) -> Window)
    fetch_dataset(name, root=None, base_url=None) -> Path
    DATASETS, PARTITIONS (the built-in names), FETCHABLE
"""

from mpifl.data.federated import DATASETS, PARTITIONS, FederatedData, load_federated
from mpifl.data.fetch import FETCHABLE, fetch_dataset
from mpifl.data.lazy import LazyPopulation, Window, load_population

__all__ = ["DATASETS", "FETCHABLE", "PARTITIONS", "FederatedData", "LazyPopulation", "Window",
           "fetch_dataset", "load_federated", "load_population"]
