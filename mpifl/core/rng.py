"""Every random stream of mpifl, in one table: each draw comes from a numpy generator keyed by
the experiment seed, a tag from this table where needed, and the coordinates it belongs to, so
there is no hidden RNG state to checkpoint and the same run gives the same draws on any number of
ranks (ALGORITHMS.md §1, "Reproducibility").

=========================  ==========================================  ==========================
stream                     key                                         where
=========================  ==========================================  ==========================
client partition           ``[seed, PARTITION_TAG]``                   data.federated
client train/test split    ``[seed, k, SPLIT_TAG]``                    data.federated
Synthetic(alpha, beta)     ``[seed, SYNTHETIC_TAG, k]``                data.synthetic
minibatch order            ``[seed, round, k, epoch]`` (no tag)        clients.minibatches
adapted-evaluation order   ``[seed, round, k, epoch, ADAPT_TAG]``      clients.minibatches
counter minibatch order    ``(seed, MINIBATCH_TAG, round, k, epoch)``  clients.minibatches
Synthetic, counter         ``(seed, SYNTHETIC_COUNTER_TAG, k, s)``     data.synthetic
client dropout             ``[seed, round, k, DROPOUT_TAG]``           clients.faults
FedMeta's meta set         ``[seed, META_TAG]``                        clients.meta
client sampling            ``[seed, round, SAMPLING_TAG]``             runtime.server
sampled evaluation         ``[seed, round, EVAL_TAG]``                 runtime.server
random layers (dropout)    ``[seed, round, k, step, LAYER_TAG(, t)]``  clients.loop
FedFV's random order       ``[seed, round]`` (no tag)                  aggregators.fedfv
bench simulate's clients   ``[seed, round, BENCH_SIMULATE_TAG]``       bench.simulate
device tiers and speeds    ``[seed, SYSTEM_TAG]``                      clients.system
availability phases        ``[seed, SYSTEM_TAG, 1]``                   clients.system
=========================  ==========================================  ==========================

The values are part of the results: changing one changes every run that uses the stream.
"""

PARTITION_TAG = 0x6D706601
SPLIT_TAG = 0x6D706602
SYNTHETIC_TAG = 0x6D706603
META_TAG = 0x6D6D6574
DROPOUT_TAG = 0xD809
SAMPLING_TAG = 0x5A3
BENCH_SIMULATE_TAG = 0x51B
#: run.adapt_epochs: the minibatch order of the local adaptation before an evaluation (round =
#: rounds completed), a stream apart from training's so the option changes no trained model.
ADAPT_TAG = 0x6D706164
#: Random layers of a model (Dropout, ``F.dropout``) in the per-client loop trainer: torch's
#: generator is reseeded at every local step from this key (+ the order tag t of adaptation).
LAYER_TAG = 0x6D70666C
#: run.eval_clients: the clients an evaluation after ``round`` rounds tests (a stream apart from
#: selection's, so the option changes no trained model).
EVAL_TAG = 0x6D706576
#: [system]: every client's device tier, speed and bandwidth multipliers (``[seed, SYSTEM_TAG]``)
#: and, with ``availability = "periodic"``, its on/off phase (``[seed, SYSTEM_TAG, 1]``), drawn
#: once for all K clients, so they depend on neither the round nor the number of ranks.
SYSTEM_TAG = 0x6D706673
#: ``client.minibatch_order = "counter"``: the first words after the seed of the counter-based
#: order's key (:mod:`mpifl.core.counter`), so its values share no key with another stream;
#: adaptation's order puts its own tag after the round.
MINIBATCH_TAG = 0x6D70626F
#: ``[data.params] generator = "counter"`` of Synthetic: the counter-based key of client k's
#: draws, ``(seed, SYNTHETIC_COUNTER_TAG, k, stream)`` with stream 0 its n_k, 1 its model and
#: feature means, 2 its samples, 3 its train/test split (:mod:`mpifl.data.synthetic`).
SYNTHETIC_COUNTER_TAG = 0x6D706373
