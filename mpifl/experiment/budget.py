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
estimate is of what the run holds, to within about a factor of two: the Python interpreter and
torch's own allocations are not counted.

**GPU memory** (:func:`check_gpu`, right after :func:`check_budget` in ``make_plan``; its
decision is :func:`check_gpu_budget`, a function of the config and the GPU's figures alone),
when the run trains on CUDA (``server.device = "cuda"``, or ``"auto"`` where torch sees a
GPU): the R = ceil(L / G) ranks that share one of the node's G GPUs
(:func:`mpifl.experiment.assemble.device_for`: cuda:(local rank % G)) hold, each, a CUDA
context (``CONTEXT_BYTES``), and

- **worker** ranks: the resident samples when ``client.samples_on`` puts them on the device
  (the whole pool, one copy of its inputs and targets; a lazy population's largest window),
  ``MODEL_COPIES`` d-sized rows, the training working memory (as above, at most
  ``client.memory_budget_mb``: the trainer chunks to it) and the block's (m_r, d) updates, and
  the workers' share of a rule's rows;
- **rank 0** (it aggregates on its device): ``MODEL_COPIES`` rows, the (m, d) updates and the
  rule's copy, the rule's state and the server optimizer's moments (a sharded server: the
  shards that can share the GPU, their blocks).

The most loaded GPU holds rank 0 and R - 1 workers, or R workers, whichever is more (one
process: rank 0 trains too, and holds both). ``client.samples_on = "auto"`` keeps the samples
on the device when that total fits, else in host memory (pinned); either way a run that does
not fit is refused before round 1, in one line like the host check's. The figure compared
with is ``MPIFL_GPU_MEMORY_LIMIT_MB`` (MiB) when set, else the free memory
(``torch.cuda.mem_get_info``) of this rank's GPU; G is the larger of torch's device count and
``SLURM_GPUS_ON_NODE`` (a rank bound to one GPU sees one).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mpifl import aggregators
from mpifl.core.errors import ConfigError
from mpifl.data.bounds import env_limit, memory_bound
from mpifl.data.registry import DATASET_LOADERS, DataShape, data_shape
from mpifl.experiment.config import Config
from mpifl.models import MODEL_FACTORIES, get_loss
from mpifl.models.zoo import model_params, parameter_count

log = logging.getLogger("mpifl")

#: the environment variable that sets this node's memory limit in MiB (tests, shared nodes)
LIMIT_VAR = "MPIFL_MEMORY_LIMIT_MB"
#: the environment variable that sets the memory of one GPU in MiB (tests, shared GPUs)
GPU_LIMIT_VAR = "MPIFL_GPU_MEMORY_LIMIT_MB"
#: bytes a rank's CUDA context and torch's caching allocator take on its GPU (about 0.5 GB)
CONTEXT_BYTES = 512 * 2**20
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


class _Needs:
    """What :class:`Estimate` and :class:`GpuEstimate` share: their ``needs`` summed."""

    needs: tuple[Need, ...]

    @property
    def total(self) -> float:
        """Bytes of every need: on this node (:class:`Estimate`), on the most loaded GPU
        (:class:`GpuEstimate`)."""
        return sum(n.total for n in self.needs)

    def largest(self) -> Need:
        return max(self.needs, key=lambda n: n.total)

    def part(self, name: str) -> Need | None:
        """The need whose ``what`` starts with ``name`` (tests), or None."""
        return next((n for n in self.needs if n.what.startswith(name)), None)


@dataclass(frozen=True)
class Estimate(_Needs):
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
    """The job's ranks, from the launcher's environment (None when it does not say); inside
    :func:`mpifl.runtime.comm.communicator`, that communicator's size."""
    from mpifl.runtime.comm import launched_size, substituted

    if substituted():
        return launched_size()
    return _env_int("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")


def available_memory() -> tuple[float, str]:
    """(bytes, where that number comes from): ``MPIFL_MEMORY_LIMIT_MB`` (MiB) when set, else the
    smaller of MemAvailable and the cgroup's remaining allowance (inf when neither is readable).

    Raises:
        ConfigError: ``MPIFL_MEMORY_LIMIT_MB`` is not a positive number.
    """
    return memory_bound()  # the readers' bound too (mpifl.data.bounds)


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


def _round_sizes(cfg: Config, declared: DataShape | None) -> tuple[int, int, str, Any]:
    """(K the data set can hold, m a round's clients, the key deciding m and its value)."""
    s, k = cfg.server, cfg.data.num_clients
    if declared is not None and declared.samples is not None:
        k = min(k, declared.samples)  # the loader refuses more clients than the pool can split
    m = k if s.sampling == "all" else min(s.clients_per_round, k)
    m_key, m_value = (("server.sampling", "all") if s.sampling == "all"
                      else ("server.clients_per_round", s.clients_per_round))
    return k, m, m_key, m_value


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
    samples, shape, classes, sample_bytes = _data_shape(cfg)
    declared = _declared(d_cfg.dataset)
    k, m, m_key, m_value = _round_sizes(cfg, declared)
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


# ------------------------------------------------------------------------------------ GPU memory

#: where a worker keeps its samples, resolved (``client.samples_on`` less "auto")
SamplesOn = Literal["device", "host"]


@dataclass(frozen=True)
class GpuEstimate(_Needs):
    """What the most loaded GPU of this node holds (module docstring, "GPU memory").

    Attributes:
        needs: the parts, each held by ``holders`` ranks on that GPU.
        samples_on: where the workers keep their samples, ``"device"`` or ``"host"``.
        ranks_per_gpu: R = ceil(L / G), the ranks that share one GPU.
        available: bytes of the GPU's memory compared with (inf: not compared).
        source: where ``available`` comes from (``MPIFL_GPU_MEMORY_LIMIT_MB``, the device's
            free memory, ``"given"``).
        reason: one line, what ``client.samples_on`` resolved to and why.
    """

    needs: tuple[Need, ...]
    samples_on: SamplesOn
    ranks_per_gpu: int
    available: float = math.inf
    source: str = "given"
    reason: str = ""


def _device_sample_bytes(declared: DataShape) -> float:
    """Bytes one sample takes in the device store: one copy of its inputs (int64 token ids or
    float32 features) and its targets (the loader's extra peak copies stay on the host)."""
    x = math.prod(declared.input_shape) * (8.0 if declared.vocab_size else 4.0)
    return x + 8.0 * math.prod(declared.target_shape)


def gpu_estimate(cfg: Config, *, samples_on: SamplesOn, gpus: int, ranks: int | None = None,
                 world: int | None = None) -> GpuEstimate:
    """The memory the most loaded of this node's GPUs holds in a run of ``cfg`` with the
    samples ``samples_on`` (module docstring), from the config alone.

    Args:
        samples_on: ``"device"`` (each worker's GPU holds the sample store) or ``"host"``.
        gpus: G, the GPUs on this node (>= 1).
        ranks, world: as :func:`estimate`.

    Raises:
        ValueError: ``samples_on`` is neither "device" nor "host".
    """
    if samples_on not in ("device", "host"):
        raise ValueError(f"samples_on must be 'device' or 'host', got {samples_on!r}")
    d_cfg, s = cfg.data, cfg.server
    nodes_ranks = max(1, int(ranks if ranks is not None else ranks_on_node()))
    world = max(nodes_ranks, int(world if world is not None else (world_size() or nodes_ranks)))
    per_gpu = -(-nodes_ranks // max(1, int(gpus)))
    workers = max(world - 1, 1)
    samples, shape, classes, _ = _data_shape(cfg)
    declared = _declared(d_cfg.dataset)
    k, m, m_key, m_value = _round_sizes(cfg, declared)
    on_worker, on_rank0 = "on each worker's GPU", "on rank 0's GPU"
    worker: list[Need] = []
    server: list[Need] = []
    if samples_on == "device" and samples is not None and declared is not None:
        if d_cfg.lazy:  # the store is empty; each request's window is staged in it
            window = max(-(-m // workers) * samples / max(k, 1), cfg.run.eval_window_samples)
            n, what = window, f"a lazy population's windows of up to {count_text(window)} samples"
        else:
            n, what = samples, (f"the {d_cfg.dataset} data set's {count_text(samples)} samples "
                                f"for {k:,} clients")
        worker.append(Need("client.samples_on", cfg.client.samples_on, f"{what}, resident",
                           n * _device_sample_bytes(declared), on_worker))
    vocab = declared.vocab_size if declared is not None else None
    built = model_size(cfg, shape, classes, vocab) if shape is not None else None
    if built is not None:
        d = built[0]
        row = 4.0 * d
        key, value = _model_key(cfg)
        dtext = f"d = {d:,} ({key} = {value})"
        model = f"the model has d = {d:,} parameters ({MODEL_COPIES} copies)"
        worker.append(Need(key, value, model, MODEL_COPIES * row, on_worker))
        server.append(Need(key, value, model, MODEL_COPIES * row, on_rank0))
        per_worker = -(-m // workers)
        one = TRAIN_COPIES * row
        budget = cfg.client.memory_budget_mb * 2**20
        train = max(one, min(per_worker * one, budget))
        capped = per_worker * one > budget and train == budget
        worker.append(Need("client.memory_budget_mb" if capped else m_key,
                           cfg.client.memory_budget_mb if capped else m_value,
                           f"training {per_worker:,} client(s) of {dtext}, chunked to "
                           f"client.memory_budget_mb", train, on_worker))
        worker.append(Need(m_key, m_value, f"a worker's block of {per_worker:,} updates, {dtext}",
                           per_worker * row, on_worker))
        share = min(s.shards, per_gpu) / s.shards  # the shards that may share this GPU
        server.append(Need(m_key, m_value, f"the round's (m, d) update matrix and the rule's "
                           f"copy, m = {m:,}, {dtext}", 2 * m * row * share, on_rank0))
        for rkey, rvalue, what, rows, place in _rule_rows(cfg, k, m, world):
            scale = share if place == "server" else 1.0
            (worker if place == "workers" else server).append(
                Need(rkey, rvalue, f"{what}, {dtext}", rows * row * scale,
                     on_worker if place == "workers" else on_rank0))
    if world == 1:  # one process: rank 0 trains too
        worker_holders, rank0_holders = 1.0, 1.0
    else:  # GPU 0 holds rank 0 and R - 1 workers; another GPU up to R workers
        rank0_on = sum(n.nbytes for n in server) >= sum(n.nbytes for n in worker)
        worker_holders = float(per_gpu - 1 + (not rank0_on))
        rank0_holders = float(rank0_on)
    context = Need("server.device", s.device, "a CUDA context and torch's allocator",
                   CONTEXT_BYTES, "on each rank's GPU", float(per_gpu if world > 1 else 1))
    needs = [context,  # first: the refusal names another part unless these alone do not fit
             *(Need(n.key, n.value, n.what, n.nbytes, n.where, worker_holders) for n in worker),
             *(Need(n.key, n.value, n.what, n.nbytes, n.where, rank0_holders) for n in server)]
    return GpuEstimate(tuple(n for n in needs if n.holders > 0), samples_on, per_gpu)


def check_gpu_budget(cfg: Config, *, available: float, gpus: int, ranks: int | None = None,
                     world: int | None = None, source: str = "given") -> GpuEstimate:
    """Decide where the samples live and refuse a run that would not fit in one GPU's memory,
    from the config and the GPU's figures alone (no CUDA call: :func:`check_gpu` measures).

    ``client.samples_on = "auto"`` resolves to ``"device"`` when that estimate fits, else to
    ``"host"``; ``"device"`` and ``"host"`` are taken as they are.

    Args:
        available: bytes of one GPU's memory the run may use.
        gpus: G, the GPUs on this node (>= 1).
        ranks, world: as :func:`estimate`.
        source: where ``available`` comes from (named in the refusal and the reason).

    Returns:
        The estimate that fits, its ``samples_on`` resolved and its ``reason`` one line.

    Raises:
        ConfigError: one line naming the key of the largest part on the GPU, its value, that
            part's memory, the GPU total, the ranks sharing the GPU and its memory.
    """
    want = cfg.client.samples_on
    tries: list[SamplesOn] = ["device", "host"] if want == "auto" else [want]
    found = [gpu_estimate(cfg, samples_on=on, gpus=gpus, ranks=ranks, world=world)
             for on in tries]
    fits = [e for e in found if e.total <= available]
    per_gpu = found[0].ranks_per_gpu
    sharing = f"{per_gpu} ranks share it" if per_gpu > 1 else "one rank"
    if not fits:
        est = found[-1]
        # name what the config sizes, unless the ranks' contexts alone do not fit
        context = est.needs[0]
        rest = list(est.needs[1:])
        big = (context if context.total > available or not rest
               else max(rest, key=lambda n: n.total))
        hint = (GPU_LIMIT_VAR if source == GPU_LIMIT_VAR
                else f"{source}; {GPU_LIMIT_VAR} overrides it")
        host = ("" if big.key != "client.samples_on" else
                "; client.samples_on = host keeps the samples in host memory")
        raise ConfigError(f"{big.key} = {big.value}: {big.what} ({size_text(big.nbytes)}) "
                          f"{big.where}; the run would need ~{size_text(est.total)} on one GPU "
                          f"({sharing}), which has {size_text(available)} ({hint}){host}")
    est = fits[0]
    figures = (f"~{size_text(est.total)} on one GPU ({sharing}) of {size_text(available)} "
               f"({source})")
    if want != "auto":
        reason = f"client.samples_on = {want}: {figures}"
    elif est.samples_on == "device":
        reason = f"client.samples_on = auto: the samples on the GPU, {figures}"
    else:
        reason = (f"client.samples_on = auto: the samples in host memory (pinned), since on "
                  f"the GPU the run would need ~{size_text(found[0].total)} on one GPU "
                  f"({sharing}) of {size_text(available)} ({source})")
    return GpuEstimate(est.needs, est.samples_on, per_gpu, available, source, reason)


def uses_cuda(cfg: Config) -> bool:
    """The run trains on CUDA: ``server.device`` is "cuda" or "auto" and torch sees a GPU
    (``"cuda"`` without one is :func:`mpifl.experiment.assemble.device_for`'s error)."""
    return cfg.server.device != "cpu" and torch.cuda.is_available()


def gpus_on_node() -> int:
    """G, this node's GPUs: the larger of torch's device count and ``SLURM_GPUS_ON_NODE`` (a
    rank bound to one GPU sees one); at least 1."""
    return max(1, torch.cuda.device_count(), _env_int("SLURM_GPUS_ON_NODE") or 0)


def gpu_memory(index: int) -> tuple[float, str]:
    """(bytes, where that number comes from) of GPU ``index``: ``MPIFL_GPU_MEMORY_LIMIT_MB``
    (MiB) when set, else its free memory (``torch.cuda.mem_get_info``).

    Raises:
        ConfigError: ``MPIFL_GPU_MEMORY_LIMIT_MB`` is not a positive number.
    """
    limit = env_limit(GPU_LIMIT_VAR)
    if limit is not None:
        return limit, GPU_LIMIT_VAR
    free, _ = torch.cuda.mem_get_info(index)
    return float(free), f"cuda:{index}'s free memory"


def check_gpu(cfg: Config) -> str:
    """``client.samples_on`` for the plan: on a CUDA run, resolved and checked against this
    rank's GPU (:func:`check_gpu_budget`; the "auto" decision logged); elsewhere the config's
    value (every placement is the same on a CPU).

    Raises:
        ConfigError: the run would not fit in the GPU's memory (:func:`check_gpu_budget`).
    """
    if not uses_cuda(cfg):
        return cfg.client.samples_on
    from mpifl.runtime.comm import launched_rank, local_rank

    rank = launched_rank()
    index = local_rank(rank) % torch.cuda.device_count()  # this rank's GPU (device_for's)
    available, source = gpu_memory(index)
    est = check_gpu_budget(cfg, available=available, gpus=gpus_on_node(), source=source)
    level = logging.INFO if cfg.client.samples_on == "auto" and rank == 0 else logging.DEBUG
    log.log(level, "%s", est.reason)
    return est.samples_on
