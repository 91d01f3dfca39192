"""The layout of a results file: its groups, dataset names, dtypes, units and schema version.

The full layout, with every attribute, is in :mod:`mpifl.store.results`' docstring and
docs/RESULTS.md; this module is what the writer (:mod:`mpifl.store.writer`), the reader
(:mod:`mpifl.store.reader`) and checkpoints (:mod:`mpifl.store.checkpoint`) share of it.
"""

from __future__ import annotations

from mpifl.metrics.summary import LOSS_SUMMARY_KEYS, SUMMARY_KEYS

SCHEMA_VERSION = 2
#: Versions :func:`read_results` reads (older ones are converted to the current units).
READABLE_VERSIONS = (1, 2)

#: /eval summaries on data with a sensitive attribute: violations on the union of test data.
GROUP_KEYS = ("group/dp", "group/eo", "group/ap")
#: /eval summaries of personal models (rules with ``personal_params``, e.g. Ditto).
PERSONAL_KEYS = tuple(f"personal/{k}" for k in SUMMARY_KEYS)
#: /eval summaries after local adaptation (``run.adapt_epochs`` > 0).
ADAPTED_KEYS = tuple(f"adapted/{k}" for k in SUMMARY_KEYS)
#: /eval summaries of the clients' test losses (regression tasks, ``[model] loss = "mse"``).
LOSS_KEYS = tuple(f"loss/{k}" for k in LOSS_SUMMARY_KEYS)

#: /rounds columns: name -> (dtype, unit/description), written once per round.
ROUND_COLUMNS: dict[str, tuple[str, str]] = {
    "round": ("i8", "round index t (0-based)"),
    "num_clients": ("i8", "clients whose updates were aggregated"),
    "train_loss": ("f8", "mean training loss of the aggregated clients: of the global model "
                         "before training for rules that need it (needs.losses), else the mean "
                         "minibatch loss of the first local epoch"),
    "lr": ("f8", "client learning rate lr_t"),
    "conflicts_model": ("i8", "MC: selected clients with u_k . s < 0"),
    "dropped": ("i8", "selected clients that dropped out (client.dropout)"),
    "rejected": ("i8", "updates excluded: NaN/Inf or norm above server.max_update_norm"),
    "bytes_moved": ("i8", "bytes sent over MPI this round (0 in one process)"),
    "time_broadcast": ("f8", "seconds"),
    "time_train": ("f8", "seconds, slowest rank's local training"),
    "time_gather": ("f8", "seconds, waiting for updates beyond the slowest training"),
    "time_aggregate": ("f8", "seconds"),
    "time_eval": ("f8", "seconds (0 when the round has no evaluation)"),
    "time_checkpoint": ("f8", "seconds writing the checkpoint after this round (0: none; also 0 "
                              "in the checkpoint's own copy of its last row)"),
    "peak_rss_server_mb": ("f8", "MiB, peak resident memory of rank 0 so far (the OS's "
                                 "maximum RSS, getrusage; after the round's evaluation too)"),
    "peak_rss_worker_mb": ("f8", "MiB, largest peak resident memory of a worker rank so far "
                                 "(the OS's maximum RSS, after the round's evaluation too; "
                                 "rank 0 in one process)"),
}

#: /rounds columns that are measurements of the machine (times, memory), not results: they
#: differ between an interrupted-and-resumed run and an uninterrupted one.
MEASURED_COLUMNS = tuple(k for k in ROUND_COLUMNS if k.startswith(("time_", "peak_rss_")))

#: /rounds columns added after schema 1 was first written: zeros when an older checkpoint lacks
#: them, so its runs still resume.
LATER_COLUMNS = ("time_checkpoint", "peak_rss_server_mb", "peak_rss_worker_mb")

#: /rounds columns with one value per model layer: (R, L).
LAYER_COLUMNS: dict[str, tuple[str, str]] = {
    "conflicts_layer": ("i8", "LC: per layer, selected clients with u_k,l . s_l < 0"),
}

#: /rounds columns with one value per selected client: (R, m), since schema 2. Rows that a
#: checkpoint from schema 1 lacks are filled with -1 (selected) and False (aggregated).
SELECTION_COLUMNS: dict[str, tuple[str, str, int]] = {
    "selected": ("i8", "client ids selected this round, ascending (-1: not recorded)", -1),
    "aggregated": ("bool", "the selected client's update was aggregated (not dropped, not "
                           "rejected)", False),
}

#: /system datasets of a run on simulated time (``[system] enabled``; absent otherwise): per
#: round and per client, what the virtual clock (:mod:`mpifl.runtime.clock`) recorded.
SYSTEM_COLUMNS: dict[str, str] = {
    "rounds/sim_time": "simulated seconds since the run began, at the end of the round",
    "rounds/selected": "clients selected (available at the round's start)",
    "rounds/finished": "selected clients that finished in time and were aggregated",
    "rounds/late": "selected clients past the deadline, beyond the first m, or gone offline",
    "rounds/staleness": "asynchronous rules: mean staleness (server steps) of the updates "
                        "aggregated at the step (NaN: none)",
    "clients/tier": "device tier index per client (names: attribute tier_names)",
    "clients/participations": "rounds in which the client was selected",
    "clients/finished": "rounds in which its update arrived in time",
    "clients/late": "rounds in which it was selected but its update was not aggregated",
    "clients/busy_s": "simulated seconds it spent on rounds (downloading, training, uploading)",
}

#: /clients datasets: per-client facts of the federated data, written once.
CLIENT_COLUMNS: dict[str, str] = {
    "num_train": "(K,) training samples",
    "num_test": "(K,) test samples",
    "label_counts": "(K, C) training samples per label",
}


#: /eval datasets that are fractions in [0, 1] (NaN allowed: no test data, or a diverged run).
FRACTIONS = ("client_accuracy", "personal_accuracy", "adapted/client_accuracy", "mean",
             "weighted_mean", "std", "worst5", "best5", "cf", "group/dp", "group/eo",
             "group/ap") + tuple(
    f"{sub}/{k}" for sub in ("personal", "adapted")
    for k in ("mean", "weighted_mean", "std", "worst5", "best5", "cf"))
