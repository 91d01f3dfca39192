"""What a run will need, estimated from its config alone, before anything is built.

:func:`check_budget` runs first in :func:`mpifl.experiment.plan.make_plan`, on every rank:
no data is loaded or drawn and no model is allocated (a model is built on torch's ``meta``
device, which holds shapes only), so an impossible size fails in a second, with one
line naming the config key, its value and the memory it would take, instead of running for
minutes before the machine runs out of memory.

The estimate, in bytes, adds up what the ranks on this node hold (L of them; every rank holds
the whole data set and the model, rank 0 also the server's matrices):

- **data** (every rank): N samples x (their inputs and targets + ``INDEX_BYTES`` of
  train/test index), plus ``PER_CLIENT_BYTES`` of per-client bookkeeping (CSR offsets, the
  partition's and the split's per-client arrays while they are built). Every data set states
  its sizes once, at registration (:class:`mpifl.data.registry.DataShape`): a fixed N, the
  nominal pool its files bound (the image and tabular sets; the loader refuses more clients
  than the pool can split, so K counts up to N here), or a mean client size (Synthetic: N = K
  x E[n_k], :func:`mpifl.data.synthetic.expected_samples_per_client`, about 237); float32
  features times the copies its loader holds, int64 token ids at 8 bytes. A data set that
  declares none counts as 0. A lazy population (``data.lazy``) holds instead
  ``LAZY_PER_CLIENT_BYTES`` a client (its sample counts and selection's (K,) temporaries) and
  the largest window it draws at once: a worker's share of the round's clients, or a streamed
  evaluation's ``run.eval_window_samples`` samples.
- **model** (every rank): ``MODEL_COPIES`` float32 copies of the d parameters (the model, the
  initial and current flat vectors, the trainer's). d is counted as the model's registration
  says (:func:`mpifl.models.zoo.register_model`: built on the meta device for the data set's
  input shape, or its own ``size`` function); unknown (0) for a factory registered without
  one, or a data set that declares no sizes.
- **training** (each worker rank): the clients it trains at once, ``TRAIN_COPIES`` x d floats
  each, at most ``client.memory_budget_mb`` (the trainer chunks to it) but at least one client.
- **updates** (rank 0, or spread over the ``server.shards`` ranks): the round's (m, d) update
  matrix and the rule's working copy of it, m = ``server.clients_per_round`` (K when
  ``server.sampling = "all"``).
- **rule state** (rank 0 or the shards), as the rule states it (``memory_rows`` of a
  :class:`~mpifl.aggregators.MemoryRows` rule, twice: a checkpoint stacks it into one array
  beside the live one; the K personal models of a
  :class:`~mpifl.aggregators.PersonalModels` rule): FedFV's history of ``fedfv.tau`` rounds
  (tau m rows of d), FedLF's absent clients' gradients (up to min(K, rounds x m) rows), FedMDFG's last round
  (m rows), a personal-model rule's K personal models (Ditto: the (K, d) store and its
  checkpoint copy on rank 0, each worker's share for evaluation); the server optimizer's d-sized
  moments.
- **results** (rank 0): every evaluation keeps K float64 accuracies and losses (and the
  personal and adapted ones when on) and every round its scalar columns and (m,) selection
  rows; x2 for the array written at each flush.

The total is compared with the memory available on this node: ``MPIFL_MEMORY_LIMIT_MB``
(MiB) when set, else the smaller of ``MemAvailable`` (``/proc/meminfo``) and what this process's
cgroup still allows. L is the launcher's ranks-on-this-node (``MPI_LOCALNRANKS``,
``OMPI_COMM_WORLD_LOCAL_SIZE``, ``SLURM_STEP_TASKS_PER_NODE``; 1 when none is set). The
estimate is of what the run holds, to within about a factor of two: GPU memory, the Python
interpreter and torch's own allocations are not counted.
"""

from __future__ import annotations

import inspect
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpifl import aggregators
from mpifl.core.errors import ConfigError
from mpifl.data.registry import DATASET_LOADERS, DataShape, data_shape
from mpifl.experiment.config import Config
from mpifl.models import MODEL_FACTORIES, get_loss
from mpifl.models.zoo import model_params, parameter_count

#: the environment variable that sets this node's memory limit in MiB (tests, shared nodes)
LIMIT_VAR = "MPIFL_MEMORY_LIMIT_MB"
#: a sample's place in its client's train or test index (int64)
INDEX_BYTES = 8
#: per-client bookkeeping while the data are set up: CSR offsets and the partition's and the
#: split's per-client numpy arrays (about 100 bytes of object each), label counts
PER_CLIENT_BYTES = 600
#: Bytes a client of a lazy population (data.lazy): three (K,) int64 count vectors, and the
#: (K,) float64 weights and int64 temporaries of selecting a round's clients.
LAZY_PER_CLIENT_BYTES = 64
#: float32 copies of the d parameters on every rank (model, w0, w, the trainer's flat copy)
MODEL_COPIES = 4
#: float32 rows of d per client being trained at once (parameters, gradients, momentum, update)
TRAIN_COPIES = 4
#: bytes a round adds to rank 0's results besides its (m,) rows: ~16 scalar columns as Python
#: floats in lists and the per-round numpy rows' headers
ROUND_BYTES = 900


@dataclass(frozen=True)
class Need:
    """One part of the estimate: ``nbytes`` held by each of ``holders`` ranks on this node.

    Attributes:
        key: the config key that decides it (``data.num_clients``, ``model.hidden``, ...).
        value: that key's value.
        what: what it is, e.g. ``"the synthetic data set would hold ~2.4e9 samples"``.
        nbytes: bytes on one holder.
        where: who holds it (``"on every rank"``, ``"on rank 0"``).
        holders: how many ranks on this node hold it (may be fractional: a share).
    """

    key: str
    value: Any
    what: str
    nbytes: float
    where: str
    holders: float = 1.0

    @property
    def total(self) -> float:
        return self.nbytes * self.holders


@dataclass(frozen=True)
class Estimate:
    """The parts of a run's memory on this node (:func:`estimate`).

    Attributes:
        needs: the parts, each with the key that decides it.
        samples: the data set's samples (None: a plugin data set, unknown before loading).
        d: the model's parameters (None: unknown before building it).
        ranks_on_node: L, the ranks on this node the estimate counts.
    """

    needs: tuple[Need, ...]
    samples: float | None
    d: int | None
    ranks_on_node: int

    @property
    def total(self) -> float:
        """Bytes on this node."""
        return sum(n.total for n in self.needs)

    def largest(self) -> Need:
        return max(self.needs, key=lambda n: n.total)

    def part(self, name: str) -> Need | None:
        """The need whose ``what`` starts with ``name`` (tests), or None."""
        return next((n for n in self.needs if n.what.startswith(name)), None)


def size_text(nbytes: float) -> str:
    """``"606 GiB"``, ``"22.2 GiB"``, ``"350 MiB"``: three significant digits, binary units."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:.3g} {unit}" if v < 1000 else f"{v:,.0f} {unit}"
    return f"{nbytes:.0f} B"


def count_text(n: float) -> str:
    """``"236,790"`` below a million, else ``"2.4e9"``."""
    if n < 1e6:
        return f"{n:,.0f}"
    mantissa, exponent = f"{n:.2g}".split("e")
    return f"{mantissa}e{int(exponent)}"


# ------------------------------------------------------------------------------------ the node

def _env_int(*names: str) -> int | None:
    for name in names:
        text = os.environ.get(name, "")
        m = re.match(r"\s*(\d+)", text)  # SLURM's "4(x2),3" starts with this node's count
        if m and int(m.group(1)) > 0:
            return int(m.group(1))
    return None


def ranks_on_node() -> int:
    """L, this node's ranks, from the launcher's environment (1 when it does not say)."""
    return _env_int("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                    "SLURM_STEP_TASKS_PER_NODE") or 1


def world_size() -> int | None:
    """The job's ranks, from the launcher's environment (None when it does not say)."""
    return _env_int("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")


def available_memory() -> tuple[float, str]:
    """(bytes, where that number comes from): ``MPIFL_MEMORY_LIMIT_MB`` (MiB) when set, else the
    smaller of MemAvailable and the cgroup's remaining allowance (inf when neither is readable).

    Raises:
        ConfigError: ``MPIFL_MEMORY_LIMIT_MB`` is not a positive number.
    """
    text = os.environ.get(LIMIT_VAR)
    if text is not None and text.strip():
        try:
            mb = float(text)
        except ValueError:
            mb = math.nan
        if not (mb > 0 and math.isfinite(mb)):
            raise ConfigError(f"{LIMIT_VAR}={text!r}: expected a positive number of MiB")
        return mb * 2**20, LIMIT_VAR
    found: list[tuple[float, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024.0, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        try:
            found.append((float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")),
                          "free physical memory"))
        except (OSError, ValueError, AttributeError):
            pass
    try:  # cgroup v2: the container's limit minus what it uses
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append((max(0.0, float(int(limit) - used)), "the cgroup's memory.max"))
    except (OSError, ValueError):
        pass
    return min(found) if found else (math.inf, "unknown")


# ------------------------------------------------------------------------------------ the parts

def _data_shape(cfg: Config) -> tuple[float | None, tuple[int, ...] | None, int | None, float]:
    """(samples N, input shape, classes C, bytes per sample: inputs and targets) of the data
    set, as it declares them at registration; (None, None, None, 0) for one that declares none."""
    d = cfg.data
    declared = _declared(d.dataset)
    if declared is None:
        return None, None, None, 0.0
    c = declared.num_classes
    if d.partition == "one_class_per_client":  # relabels its chosen classes 0..len - 1
        c = len(d.partition_params["classes"])
    return (declared.num_samples(d.num_clients), declared.input_shape, c,
            declared.sample_bytes())


def _declared(name: str) -> DataShape | None:
    """The sizes a registered data set declares (``register_dataset(shape=)``), or None."""
    try:
        return data_shape(DATASET_LOADERS.get(name))
    except (LookupError, TypeError, ValueError):
        return None


def model_size(cfg: Config, input_shape: tuple[int, ...], num_classes: int,
               vocab_size: int | None = None) -> tuple[int, int] | None:
    """(d, layers) of the config's model for this input, as its registration says to count it
    (:func:`mpifl.models.zoo.register_model`: built on the meta device, no memory); None for a
    factory registered without a ``size`` (it is not run twice) or one that cannot be built
    (the real build then reports why)."""
    name = cfg.model.name
    params = model_params(name, cfg.model.hidden, cfg.model.params)
    try:
        factory = MODEL_FACTORIES.get(name)
        if vocab_size is not None and "vocab_size" in inspect.signature(factory).parameters:
            params.setdefault("vocab_size", int(vocab_size))
        width = get_loss(cfg.model.loss).width(num_classes)
    except Exception:  # noqa: BLE001 -- validation and the real build name the problem
        return None
    return parameter_count(name, input_shape, width, seed=cfg.run.seed, params=params)


def _model_key(cfg: Config) -> tuple[str, Any]:
    m = cfg.model
    return ("model.hidden", m.hidden) if m.name == "mlp" and m.hidden else ("model.name", m.name)


def _key_value(cfg: Config, key: str, k: int) -> Any:
    """The value of the config key ``key`` ("section.field"), K for ``data.num_clients`` (the
    clients the data set can hold)."""
    if key == "data.num_clients":
        return k
    section, _, attr = key.partition(".")
    table = getattr(cfg, section, None)
    if table is None and section == cfg.server.algorithm:
        table = cfg.rule_params()
    return getattr(table, attr, None)


def _rule_rows(cfg: Config, k: int, m: int, world: int
               ) -> list[tuple[str, Any, str, float, str]]:
    """The rule's own d-sized rows: (key, value, what, rows, place), place ``"server"`` (rank 0,
    or spread over the shards), ``"rank0"`` or ``"workers"`` (split over the worker ranks)."""
    s = cfg.server
    name = s.algorithm
    rule = aggregators.rule(name)
    out: list[tuple[str, Any, str, float, str]] = []
    if isinstance(rule, aggregators.MemoryRows):  # the rule's own d-sized state
        rows = rule.memory_rows(cfg.rule_params(), num_clients=k, per_round=m,
                                rounds=cfg.run.rounds)
        # x2: a checkpoint stacks the history into one array beside the live one
        out.append((rows.key, _key_value(cfg, rows.key, k), f"{rows.what} and its checkpoint "
                    f"copy", 2 * rows.rows, "server"))
    if isinstance(rule, aggregators.PersonalModels):
        out.append(("data.num_clients", k, f"{name} keeps {k:,} personal models and a "
                    f"checkpoint copy", 2 * k, "rank0"))
        if world > 1:  # every evaluation scatters them to the workers
            out.append(("data.num_clients", k, f"the workers' shares of the {k:,} personal "
                        f"models", k / (world - 1), "workers"))
    moments = {"sgd": 0, "momentum": 1, "adagrad": 1, "adam": 2, "yogi": 2}[s.optimizer]
    if moments:
        out.append(("server.optimizer", s.optimizer, f"the server optimizer's {moments} "
                    f"moment(s)", moments, "rank0"))
    return out


def estimate(cfg: Config, *, ranks: int | None = None, world: int | None = None) -> Estimate:
    """The memory a run of ``cfg`` needs on this node (module docstring), from the config alone.

    Args:
        ranks: L, ranks on this node (default: the launcher's environment, :func:`ranks_on_node`).
        world: ranks in the job (default: the launcher's environment, else L).
    """
    d_cfg, s = cfg.data, cfg.server
    nodes_ranks = max(1, int(ranks if ranks is not None else ranks_on_node()))
    world = max(nodes_ranks, int(world if world is not None else (world_size() or nodes_ranks)))
    workers_here = nodes_ranks - 1 if world > 1 else 1   # one process: rank 0 trains too
    workers = max(world - 1, 1)
    k = d_cfg.num_clients
    samples, shape, classes, sample_bytes = _data_shape(cfg)
    declared = _declared(d_cfg.dataset)
    if declared is not None and declared.samples is not None:
        k = min(k, declared.samples)  # the loader refuses more clients than the pool can split
    m = k if s.sampling == "all" else min(s.clients_per_round, k)
    m_key, m_value = (("server.sampling", "all") if s.sampling == "all"
                      else ("server.clients_per_round", s.clients_per_round))
    every = f"on every rank (x{nodes_ranks} on this node)" if nodes_ranks > 1 else "on every rank"
    needs: list[Need] = []

    # data: every rank holds the whole set (a lazy population: its counts and one window)
    data_bytes = (samples or 0.0) * (sample_bytes + INDEX_BYTES) + PER_CLIENT_BYTES * k
    if d_cfg.lazy and samples is not None:
        per_client = samples / max(k, 1)
        window = max(-(-m // workers) * per_client, cfg.run.eval_window_samples)
        data_bytes = LAZY_PER_CLIENT_BYTES * k + 2 * window * (sample_bytes + INDEX_BYTES)
        what = (f"a lazy population of {k:,} clients, drawing up to {count_text(window)} "
                f"samples at once")
        key, value = "data.num_clients", d_cfg.num_clients
    elif declared is not None and declared.key == "data.num_clients":
        what = f"the {d_cfg.dataset} data set would hold ~{count_text(samples or 0.0)} samples"
        key, value = "data.num_clients", d_cfg.num_clients
    elif samples is not None:
        what = f"the {d_cfg.dataset} data set holds {samples:,.0f} samples for {k:,} clients"
        key, value = "data.dataset", d_cfg.dataset
    else:
        what = f"the per-client arrays of {k:,} clients"
        key, value = "data.num_clients", d_cfg.num_clients
    needs.append(Need(key, value, what, data_bytes, every, nodes_ranks))

    vocab = declared.vocab_size if declared is not None else None
    built = model_size(cfg, shape, classes, vocab) if shape is not None else None
    d, layers = built if built is not None else (None, 1)

    # results on rank 0: per evaluation K per-client values, per round its rows
    evaluations = -(-cfg.run.rounds // cfg.run.eval_every) + 1
    columns = 2 * (1 + isinstance(aggregators.rule(s.algorithm), aggregators.PersonalModels)
                   + bool(cfg.run.adapt_epochs))
    eval_bytes = 2.0 * evaluations * k * 8 * columns
    round_bytes = 2.0 * cfg.run.rounds * (ROUND_BYTES + 9 * m + 8 * layers)
    if eval_bytes >= round_bytes:
        needs.append(Need("run.rounds", cfg.run.rounds,
                          f"the results of {evaluations:,} evaluations (run.eval_every = "
                          f"{cfg.run.eval_every}) of {k:,} clients", eval_bytes + round_bytes,
                          "on rank 0"))
    else:
        needs.append(Need("run.rounds", cfg.run.rounds,
                          f"the results of {cfg.run.rounds:,} rounds of {m:,} clients",
                          eval_bytes + round_bytes, "on rank 0"))
    if d is None:
        return Estimate(tuple(needs), samples, None, nodes_ranks)

    row = 4.0 * d  # one float32 parameter vector
    key, value = _model_key(cfg)
    needs.append(Need(key, value, f"the model has d = {d:,} parameters ({MODEL_COPIES} copies)",
                      MODEL_COPIES * row, every, nodes_ranks))
    dtext = f"d = {d:,} ({key} = {value})"
    # training: each worker's clients at once, chunked to the memory budget (at least one)
    per_worker = -(-m // workers)
    one = TRAIN_COPIES * row
    train = max(one, min(per_worker * one, cfg.client.memory_budget_mb * 2**20))
    needs.append(Need(m_key, m_value,
                      f"training {per_worker:,} client(s) of {dtext} at once", train,
                      "on each worker rank", workers_here))
    # the server: on rank 0, or a block on each of the shards (those on this node count)
    shards = s.shards
    share = min(shards, nodes_ranks) / shards
    needs.append(Need(m_key, m_value,
                      f"the round's (m, d) update matrix and the rule's copy, m = {m:,}, {dtext}",
                      2 * m * row, "on rank 0" if shards == 1 else "over the shard ranks", share))
    places = {"server": ("on rank 0" if shards == 1 else "over the shard ranks", share),
              "rank0": ("on rank 0", 1.0), "workers": ("on each worker rank", workers_here)}
    for key, value, what, rows, place in _rule_rows(cfg, k, m, world):
        needs.append(Need(key, value, f"{what}, {dtext}", rows * row, *places[place]))
    return Estimate(tuple(needs), samples, d, nodes_ranks)


def check_budget(cfg: Config, *, available: float | None = None, ranks: int | None = None,
                 world: int | None = None) -> Estimate:
    """Refuse a config whose run would need more memory than this node has, before any work.

    Args:
        available: bytes available (default: :func:`available_memory`).
        ranks, world: as :func:`estimate`.

    Returns:
        The estimate (it fits).

    Raises:
        ConfigError: one line naming the key of the largest part, its value, that part's
            memory, the total and the memory available.
    """
    est = estimate(cfg, ranks=ranks, world=world)
    source = "given"
    if available is None:
        available, source = available_memory()
    if est.total <= available:
        return est
    big = est.largest()
    where = "" if est.ranks_on_node == 1 else f" ({est.ranks_on_node} ranks)"
    hint = (f"{LIMIT_VAR}" if source == LIMIT_VAR
            else f"{source}; {LIMIT_VAR} overrides it")
    raise ConfigError(f"{big.key} = {big.value}: {big.what} ({size_text(big.nbytes)}) "
                      f"{big.where}; the run would need ~{size_text(est.total)} on this node"
                      f"{where}, which has {size_text(available)} available ({hint})")
