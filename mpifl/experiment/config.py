"""Typed experiment configuration: TOML files plus ``--set section.key=value`` overrides.

Every section is a pydantic model with ``extra="forbid"`` and strict types, so an unknown key, a
wrong type or an out-of-range value is caught before any rank does work. :func:`load_config`
turns pydantic's report into one :class:`~mpifl.core.errors.ConfigError` line that names the key
and, for unknown keys, suggests the closest known one.

Each aggregation rule has its own table (``[fedfv]``, ``[fedavg]``, a plugin rule's ``[name]``),
whose schema is the rule's own ``Params`` (:mod:`mpifl.aggregators`): the schema of a config is
built from the registry once the ``[plugins]`` modules are imported (:func:`schema`). So
``--set server.algorithm=fedavg`` switches algorithm without editing the file; only the selected
rule's table is used. Models, data sets and partitions are names of their registries (or import
paths ``"pkg.module:obj"``), checked against them after the plugins are loaded.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model,
                      model_validator)
from pydantic_core import PydanticCustomError

from mpifl import aggregators
from mpifl.clients import TRAINERS
from mpifl.clients.interface import trainer_keywords
from mpifl.core.errors import ConfigError
from mpifl.core.params import Params
from mpifl.clients.system import SystemParams
from mpifl.core.plugins import PluginError, load_modules
from mpifl.core.registry import closest
from mpifl.data.compat import (IncompatibleData, check_combination, lazy_datasets, nest_params,
                               provided, providers)
from mpifl.data.registry import DATASET_LOADERS, PARTITIONERS, SENSITIVE
from mpifl.models import MODEL_FACTORIES, MODELS, get_loss
from mpifl.runtime.loggers import LOGGERS, missing_requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

INT32_MAX = 2**31 - 1  # counts stored as int32/int64 and used as tensor sizes


class _Section(BaseModel):
    # a field's docstring is its description (docs/hooks.py builds the reference from it)
    model_config = ConfigDict(strict=True, extra="forbid", validate_default=True,
                              allow_inf_nan=False, use_attribute_docstrings=True)


#: the shortest set-up bound accepted (run.init_timeout_s, run.setup_timeout_s): a launch
#: starts its ranks in seconds at best (Python, torch, MPI), so less could only fail
MIN_SETUP_BOUND_S = 5.0


def _setup_bound(value: float) -> float:
    if 0 < value < MIN_SETUP_BOUND_S:
        raise PydanticCustomError(
            "setup_bound", "must be 0 (no bound) or at least {least} s: ranks take seconds to "
            "start, so a shorter bound ends every launch", {"least": f"{MIN_SETUP_BOUND_S:g}"})
    return value


SetupBound = Annotated[float, Field(ge=0.0, le=1e7), AfterValidator(_setup_bound)]


class RunConfig(_Section):
    name: str = "run"
    """The run's name: the default results file is runs/<name>.h5 (a plain name, no path)."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """Keys every random draw (numpy's and torch's generators, by seed, round and client);
    < 2^63 so it fits an int64 attribute and torch."""
    rounds: int = Field(100, ge=1, le=INT32_MAX)
    """Server rounds to run (a resume may raise it: mpifl resume --rounds)."""
    eval_every: int = Field(10, ge=1, le=INT32_MAX)
    """Rounds between evaluations of the global model on every client's test split (the last
    round is always evaluated)."""
    checkpoint_every: int | None = Field(None, ge=0, le=INT32_MAX)
    """Rounds between checkpoints. Not set: 2% of run.rounds, held back while checkpoints would
    take over 4% of the run's time (mpifl/runtime/schedule.py); N: every N-th round exactly;
    0: no periodic checkpoints at all (only at the end and when stopped by a signal)."""
    checkpoint_minutes: float = Field(5.0, ge=0.0, le=1e6)
    """Wall-clock minutes between checkpoints (besides checkpoint_every's rounds); 0: by rounds
    only. The last 2 checkpoints are kept, so a killed or preempted run resumes (mpifl resume)."""
    progress_every_s: float = Field(30.0, ge=0.0, le=1e7)
    """Seconds between progress lines in the log (round, s/round, ETA, peak memory, last
    metrics), for batch jobs where the progress bar does not show; 0 = none."""
    loggers: list[str] = Field(default_factory=list)
    """Live loggers on rank 0 (mpifl.runtime.loggers.LOGGERS): "csv", "tensorboard",
    "wandb"."""
    peer_timeout_s: float = Field(0.0, ge=0.0, le=1e7)
    """Seconds a rank waits for the others before ending the job with status 4 (a hung rank, a
    lost node); 0 = forever. Set it above the longest phase (a round's training; aggregation +
    evaluation + checkpoint)."""
    init_timeout_s: SetupBound = 120.0
    """Seconds a rank may spend in MPI_Init (every rank waits there for all the others) before
    the job ends with one line naming the ranks that did not reach it (mpifl.runtime.init_watch),
    which a SLURM job then launches again; 0 = forever, else at least 5. Above the spread of the
    ranks' start-up times (imports on a slow disk). On one node, MPI_Init is also ended 30 s
    after the last rank arrived (a broken PMI exchange, slurm/README.md)."""
    setup_timeout_s: SetupBound = 180.0
    """Seconds a rank waits for the others at each step of set-up (plugins, config, data, model,
    checkpoint) before ending every rank with status 2, rank 0 naming the ranks that did not
    finish it; 0 = forever, else at least 5. Above the slowest rank's set-up step (reading a
    large checkpoint, building a large population)."""
    threads: int = Field(0, ge=0, le=4096)
    """Torch/OpenMP and BLAS threads of each rank (mpifl.runtime.threads): 0 = OMP_NUM_THREADS
    when set, else the cores this process may use divided among the ranks on its node. Stored in
    the results (attribute "threads"); a run is bit-identical only on the same count."""
    deterministic: bool = True
    """Exact GPU kernels (mpifl.runtime.determinism): deterministic algorithms, no TF32, no
    cuDNN autotuning; false trades bit-identical GPU runs for speed. CPU results are the same
    either way."""
    adapt_epochs: int = Field(0, ge=0, le=100_000)
    """Evaluation after local adaptation: at every evaluation each client also trains the global
    model for this many epochs of plain local SGD on its training split ([client] settings) and
    is evaluated on its test split (/eval/adapted/...); 0 = off. Not changeable on resume (it
    decides which columns the results hold)."""
    eval_clients: int = Field(0, ge=0, le=INT32_MAX)
    """Clients each evaluation tests: a random subset of this many, keyed by the seed and the
    round (resumed exactly), stored with NaN for the others; the evaluation's summaries are then
    estimates over them (populations too large to evaluate whole). 0 = every client."""
    full_eval_every: int = Field(0, ge=0, le=INT32_MAX)
    """With eval_clients: the evaluation after every multiple of this many rounds, and the last
    one, tests every client instead (a lazy population streams them through the workers in
    windows); 0 = every evaluation is sampled."""
    eval_window_samples: int = Field(2**18, ge=1, le=2**40)
    """Samples of a lazy population drawn at once in a streamed evaluation (a window); progress
    lines count windows and a stop signal (SIGTERM) stops an evaluation at its next window.
    Smaller: finer progress and a faster stop, more overhead a window. Not changeable on
    resume."""


class PluginsConfig(_Section):
    """Users' modules imported on every rank before anything else is validated; they register
    rules, models, data sets and partitions (mpifl.plugin's decorators)."""

    modules: list[str] = Field(default_factory=list)
    """Plugin modules imported on every rank first (beside the job file, on plugins.path, or
    installed)."""
    path: list[str] = Field(default_factory=list)
    """Folders put in front of sys.path (relative to the job file; stored absolute); the job
    file's own folder is always searched."""


class DataConfig(_Section):
    """``[data]``. A data set's and a partition's own parameters are the nested tables
    ``[data.params]`` and ``[data.partition_params]``, validated by the entry's ``Params``
    (:mod:`mpifl.data.builtin` for mpifl's own) and stored with its defaults filled in. The old
    flat keys (``dirichlet_alpha``, ``classes_per_client``, ``classes``, ``synthetic_alpha``,
    ``synthetic_beta``, ``heterogeneity``, ``group_proportions``, ``sensitive_feature``) are still
    read, for job files, ``--set`` and sweeps (which name ``section.key``) and stored configs:
    moved into the table of the entry that reads them (:func:`mpifl.data.compat.nest_params`)."""

    dataset: str = "fashion_mnist"
    """The data set: a built-in or plugin name, or "pkg.module:function" (checked by name once
    the plugins are loaded)."""
    partition: str = "shards"
    """How the pooled samples are split into clients: a built-in or plugin partition, or
    "pkg.module:function" (docs/ALGORITHMS.md §8)."""
    num_clients: int = Field(100, ge=1, le=INT32_MAX)
    """K, the clients of the population."""
    train_fraction: float = Field(0.8, gt=0.0, lt=1.0)
    """Share of each client's samples in its local training split; the rest is its test
    split."""
    data_root: str | None = None
    """The only folder data are read from (else $MPIFL_DATA, else ~/.cache/mpifl/data and
    /usr/share/datasets); a missing root or file is a one-line error naming it."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The data set loader's keywords (e.g. synthetic's alpha, beta; the tabular sets'
    sensitive_feature), validated by its Params."""
    partition_params: dict[str, Any] = Field(default_factory=dict)
    """The partition's keywords (e.g. dirichlet's alpha; pathological's classes_per_client;
    one_class_per_client's classes; group_skew's heterogeneity or group_proportions)."""
    lazy: bool = False
    """Draw each request's clients on demand (mpifl.data.lazy; data sets that declare lazy=,
    the natural partition): memory O(K) small numbers instead of O(K x samples)."""

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, raw: Any) -> Any:
        """Old flat keys into the nested tables; both tables validated by their entry."""
        if not isinstance(raw, dict):
            return raw
        names = {k: raw.get(k, cls.model_fields[k].default) for k in ("dataset", "partition")}
        return nest_params(raw, names["dataset"], names["partition"])


class ModelConfig(_Section):
    name: str = "mlp"
    """The model: a built-in or plugin model, or "pkg.module:factory" (checked by name once the
    plugins are loaded)."""
    hidden: list[Annotated[int, Field(ge=1, le=2**20)]] = Field(
        default_factory=lambda: [200, 200], max_length=64)
    """Hidden layer widths of the built-in mlp (no other model reads them: a plugin model takes
    its own parameters, a "hidden" of its own included, from [model.params] only)."""
    output: Literal["logits", "softmax"] = "logits"
    """What the built-in models output: "logits", or "softmax" (the FedFV authors' double
    softmax under cross-entropy)."""
    loss: str = "cross_entropy"
    """The training and evaluation loss: cross_entropy, bce, mse, token_cross_entropy,
    multilabel_bce, a plugin's, or "pkg.module:fn" (mpifl/models/losses.py; checked by name
    later, and against the data set's targets at set-up)."""
    batchnorm: Literal["global", "local", "local_stats"] = "global"
    """Where BatchNorm's state lives (ALGORITHMS.md §9): "global" (statistics travel in w and
    are aggregated like parameters), "local" (FedBN: statistics and affine parameters stay with
    each client), "local_stats" (SiloBN: only the statistics stay)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the model's factory (a plugin model's, or a built-in one's own, e.g.
    char_lstm's hidden_size)."""


class ClientConfig(_Section):
    epochs: int = Field(1, ge=1, le=100_000)
    """E, local epochs over the client's training split each round."""
    batch_size: int = Field(50, ge=0, le=INT32_MAX)
    """B, local minibatch size; 0 = full batch (one step an epoch)."""
    max_local_steps: int | None = Field(None, ge=1, le=INT32_MAX)
    """A cap on local work: at most this many minibatch SGD steps per client per round (the
    first steps of its E epochs, in their keyed order), whatever its number of samples;
    unset = E epochs over all its samples (no cap). Bounds a round's time on data sets with
    large clients (Shakespeare, Stack Overflow), as the benchmarks' papers do; a client then
    sees at most max_local_steps * B samples a round. Applies to every trainer, not to
    run.adapt_epochs."""
    lr: float = Field(0.1, gt=0.0, le=1e3)
    """Local SGD learning rate (at most 1000: in float32 a larger step overflows the parameters
    in one step)."""
    lr_decay: float = Field(1.0, gt=0.0, le=1.0)
    """Learning-rate decay a round: lr_t = lr * lr_decay^t; 1 = constant."""
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    """Local SGD momentum, restarted every round; 0 = plain SGD."""
    weight_decay: float = Field(0.0, ge=0.0, le=1e3)
    """Local L2 weight decay added to the gradient; 0 = none."""
    memory_budget_mb: float = Field(1024.0, gt=0.0, le=2.0**30)
    """Memory (MB) a worker may use for clients trained at once; the round's clients are
    trained in chunks that fit. Changes no result."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Probability that a selected client drops out of a round (keyed by seed, round and client;
    counted in /rounds/dropped)."""
    trainer: Literal["auto", "vmap", "loop"] = "auto"
    """Local training path: "vmap" (vectorised clients), "loop" (one client at a time, any
    model: the oracle), "auto" (the fastest correct one for the model and device, logged and
    stored in the results as the attribute "trainer"; pin it for bit-for-bit
    reproducibility)."""
    minibatch_order: Literal["pcg64", "counter"] = "pcg64"
    """How each client's minibatch order is drawn from its key (seed, round, client, epoch):
    "pcg64" (numpy's generator, one client at a time on the host), or "counter" (a
    counter-based hash, mpifl/core/counter.py: every client of a chunk at once, on the
    trainer's device, for GPU rounds of thousands of clients). Another order, so other
    (equally valid) results; every recorded run is "pcg64"."""
    samples_on: Literal["auto", "device", "host"] = "auto"
    """Where a worker on a GPU keeps its clients' samples: "device" (moved to the GPU once at
    set-up; a round moves only the model and the updates), "host" (in host memory, each
    chunk's samples moved when it trains: data larger than the GPU), "auto" (the device when
    the GPU memory estimate fits, logged). The same on a CPU; changes no result."""


class ServerConfig(_Section):
    algorithm: str = "fedavg"
    """The aggregation rule: a registered name (its hyper-parameters are the table of that name)
    or "pkg.module:Class"."""
    clients_per_round: int = Field(10, ge=1, le=INT32_MAX)
    """m, the clients selected each round."""
    sampling: Literal["uniform", "weighted", "all"] = "uniform"
    """How clients are selected: "uniform" without replacement, "weighted" by their samples,
    or "all" every round."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where training and aggregation run: "auto" takes a GPU when torch sees one (each rank
    cuda:(local rank % GPUs))."""
    max_update_norm: float | None = Field(None, gt=0.0)
    """Updates with a larger L2 norm are rejected (counted in /rounds/rejected), like NaN/Inf
    ones; none = no bound."""
    meta: bool = False
    """FedMeta's meta step (ALGORITHMS.md §6, table [fedmeta]) after every aggregation, on top
    of any rule."""
    shards: int = Field(1, ge=1, le=4096)
    """Coordinate shards of the server (docs/ARCHITECTURE.md "Sharded server"): ranks 0 ..
    shards-1 each aggregate one block of the parameters; 1 = rank 0 alone (the oracle)."""
    optimizer: Literal["sgd", "momentum", "adagrad", "adam", "yogi"] = "sgd"
    """Server optimizer after the rule (docs/ALGORITHMS.md "Server optimizers"; Reddi et al.,
    ICLR 2021): sgd (the rule's step x lr), momentum (FedAvgM), adagrad, adam, yogi."""
    lr: float = Field(1.0, gt=0.0, le=1e3)
    """Server learning rate eta (1 with sgd: the rule's step alone)."""
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """FedAvgM's momentum beta (optimizer = "momentum")."""
    betas: list[Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        default_factory=lambda: [0.9, 0.99], min_length=2, max_length=2)
    """beta1, beta2 of adagrad/adam/yogi (adagrad uses beta1 only)."""
    tau: float = Field(1e-3, gt=0.0, le=10.0)
    """tau, the adaptivity of adagrad/adam/yogi: added to sqrt(v); v starts at tau^2."""


class FaultsConfig(_Section):
    nan_clients: list[int] = Field(default_factory=list)
    """These clients send NaN updates (robustness tests); each must be < data.num_clients."""


class Config(_Section):
    """A whole experiment: the sections below plus one table per registered rule (added by
    :func:`schema`, from each rule's ``Params``)."""

    run: RunConfig = Field(default_factory=RunConfig)
    plugins: PluginsConfig = Field(default_factory=PluginsConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    client: ClientConfig = Field(default_factory=ClientConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    system: SystemParams = Field(default_factory=SystemParams)
    """Simulated time: the clients' devices, availability and the round deadline
    (mpifl/clients/system.py, mpifl/runtime/clock.py); off by default."""

    def rule_params(self) -> Params:
        """The selected rule's validated hyper-parameters (its ``Params``; defaults for a rule
        known only by import path)."""
        section = getattr(self, self.server.algorithm, None)
        if isinstance(section, Params):
            return section
        return aggregators.rule(self.server.algorithm).validate_params({})

    def algorithm_params(self) -> dict[str, Any]:
        """Hyper-parameters of the selected algorithm as a dict (its table; empty if none)."""
        return self.rule_params().model_dump()

    def to_json(self) -> str:
        """Canonical JSON text of the config (stored in every results file)."""
        return json.dumps(self.model_dump(), sort_keys=True)


def _table_name(name: str) -> bool:
    return name.isidentifier() and name not in Config.model_fields


@functools.lru_cache(maxsize=None)
def _schema(rules: tuple[str, ...]) -> type[Config]:
    fields = {name: (aggregators.rule(name).Params,
                     Field(default_factory=aggregators.rule(name).Params))
              for name in rules}
    return create_model("Config", __base__=Config, **fields)


def schema() -> type[Config]:
    """The Config class with one table per registered rule (call after loading plugins)."""
    return _schema(tuple(n for n in aggregators.available() if _table_name(n)))


# ----------------------------------------------------------------------------------------------
# Loading, overrides, and error messages


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``section.key=value``; the value is read as a TOML value, else taken as a string.

    ``key`` may itself be dotted: a key of a nested table (``model.params.width=32`` sets
    ``width`` in ``[model.params]``), returned as ``[section, "table.key"]``.

    >>> parse_override("data.classes=[0,1]")
    (['data', 'classes'], [0, 1])
    >>> parse_override("model.params.width=32")
    (['model', 'params.width'], 32)

    Raises:
        ConfigError: no ``=``, a key without a section (the message suggests the closest full
            key), an empty part, or a value nested too deeply to read.
    """
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(f"--set {text!r}: expected section.key=value (a key of a nested "
                          f"table: section.table.key=value), e.g. server.algorithm=fedfv or "
                          f"model.params.width=32")
    parts = [p.strip() for p in parts]
    if len(parts) == 1:
        raise ConfigError(f"--set {text!r}: expected section.key=value; "
                          f"{bare_key_hint(parts[0], raw.strip())}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    except RecursionError:
        raise ConfigError(f"--set {key.strip()}: the value is nested too deeply") from None
    return [parts[0], ".".join(parts[1:])], value


def bare_key_hint(word: str, value: str = "VALUE") -> str:
    """For a key given without its section: the closest known ``section.key`` (by the key, else
    by the section), as ``"did you mean 'run.rounds=VALUE'?"``, else an example."""
    sections = schema().model_fields
    by_key: dict[str, str] = {}
    for s, f in sections.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            for k in f.annotation.model_fields:
                by_key.setdefault(k, f"{s}.{k}")  # the first section that has it
    close = closest(word, list(by_key))
    if close is None and (section := closest(word, list(sections))):
        return f"'{word}' is not a key (did you mean a key of [{section}], '{section}.KEY'?)"
    if close is None:
        return f"'{word}' is not a key of any section, e.g. run.rounds=10"
    return f"'{word}' is not a key (did you mean '{by_key[close]}={value}'?)"


def _set_key(raw: dict[str, Any], path: list[str], value: Any, text: str) -> None:
    """``raw[path[0]][path[1]]... = value``, making the tables on the way; a part that is a
    value (not a table) in the file or the schema is refused in one line."""
    table, model = raw, schema()
    for i, part in enumerate(path[:-1]):
        where = ".".join(path[:i + 1])
        model = _subtable(model, part, where, text)
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {text!r}: '{where}' holds a value, not a table; set "
                              f"it as {where}=VALUE")
    table[path[-1]] = value


def _subtable(model: Any, part: str, where: str, text: str) -> Any:
    """The schema of table ``part`` inside ``model`` (None: not known here, e.g. a free dict
    table or a plugin's section: checked later by whatever reads it)."""
    if model is None:
        return None
    field = model.model_fields.get(part)
    if field is None:
        return None  # an unknown key: pydantic names it, with the closest known one
    ann = field.annotation
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    if ann is dict or getattr(ann, "__origin__", None) is dict:
        return None
    raise ConfigError(f"--set {text!r}: '{where}' is a value, not a table; set it as "
                      f"{where}=VALUE")


def load_config(path: str | Path | Mapping[str, Any] | None,
                overrides: list[str] = ()) -> Config:
    """Read a TOML experiment file (or the defaults if ``path`` is None; or the file's tables as
    a mapping, from :func:`mpifl.run`), apply overrides, import the ``[plugins]`` modules,
    validate.

    Plugin folders (``plugins.path``) and the TOML file's own folder (a mapping's: the working
    directory) are searched for the plugin modules, so a plugin beside its job file needs no
    installing.

    Raises:
        ConfigError: unreadable file, TOML syntax error, a plugin that cannot be imported, unknown
            key, wrong type, value out of range, or an inconsistent combination. The message is
            one line naming the key.
    """
    raw: dict[str, Any] = {}
    if isinstance(path, Mapping):
        raw, path = copy.deepcopy(dict(path)), Path.cwd() / "config.toml"
    elif path is not None:
        raw = read_toml(Path(path))
    _check_depth(raw, f"{path}: " if path is not None else "")
    for text in overrides:
        (section, key), value = parse_override(text)
        _set_key(raw, [section, *key.split(".")], value, text)
    _check_depth(raw, "--set ")
    if path is not None:
        _anchor_plugin_path(raw, Path(path).resolve().parent)
    return _validate(raw, [])


#: The deepest nesting of tables and arrays a config may have (real ones have 3 or 4 levels);
#: deeper values would exhaust the recursion of validation and of the stored JSON.
MAX_DEPTH = 64


def _check_depth(raw: dict[str, Any], source: str) -> None:
    """Refuse tables or arrays nested deeper than :data:`MAX_DEPTH` (dotted table headers and
    ``--set`` keys can nest without TOML's own limit), naming ``source`` and where."""
    stack: list[tuple[list[str], Any]] = [([], raw)]
    while stack:
        where, value = stack.pop()
        if len(where) > MAX_DEPTH:
            shown = ".".join(where[:3])
            raise ConfigError(f"{source}{shown}...: nested too deeply (more than {MAX_DEPTH} "
                              f"levels of tables or arrays)")
        items = value.items() if isinstance(value, dict) else \
            enumerate(value) if isinstance(value, list) else ()
        stack.extend(([*where, str(k)], v) for k, v in items)


def _anchor_plugin_path(raw: dict[str, Any], folder: Path) -> None:
    """Make ``plugins.path`` absolute (relative to the job file's folder) and append that folder,
    so every rank, a resumed run and a sweep job find the same plugin modules from anywhere."""
    table = raw.get("plugins")
    if not isinstance(table, dict) or not table.get("modules"):
        return
    path = table.get("path", [])
    if isinstance(path, list) and all(isinstance(p, str) for p in path):
        table["path"] = list(dict.fromkeys([*(str(folder / p) for p in path), str(folder)]))


def config_from_json(text: str) -> Config:
    """Rebuild a config stored by :meth:`Config.to_json` (e.g. from a results file), importing
    its plugin modules first.

    Raises:
        ConfigError: invalid JSON or config, or a plugin that cannot be imported here.
    """
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"stored config is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError("stored config is nested too deeply to read") from None
    if not isinstance(raw, dict):
        raise ConfigError("stored config is not a JSON object")
    return _validate(raw, [], stored=True)


def _validate(raw: dict[str, Any], search_path: list[str], stored: bool = False) -> Config:
    _load_plugins(raw.get("plugins"), search_path)
    try:
        cfg = schema().model_validate(raw)
    except ValidationError as exc:
        what = "stored config is invalid: " if stored else ""
        raise ConfigError(what + _describe(exc)) from None
    _check_consistency(cfg)
    return cfg


def _load_plugins(table: Any, search_path: list[str]) -> None:
    """Import the plugin modules a raw ``[plugins]`` table names (validated first)."""
    try:
        plugins = PluginsConfig.model_validate(table if table is not None else {})
    except ValidationError as exc:
        raise ConfigError(_describe(exc, prefix=("plugins",))) from None
    try:
        load_modules(plugins.modules, [*plugins.path, *search_path])
    except PluginError as exc:
        raise ConfigError(str(exc)) from None


#: Keys a resumed run may change: they decide how long it runs, where things go, or how
#: clients are chunked in memory — never what is computed.
RESUME_MUTABLE = {"run.rounds", "run.name", "run.checkpoint_every", "run.checkpoint_minutes",
                  "run.progress_every_s", "run.loggers",
                  "run.peer_timeout_s", "run.init_timeout_s", "run.setup_timeout_s",
                  "run.threads", "run.deterministic",
                  "data.data_root",
                  "plugins.path",
                  "server.device", "server.shards", "client.memory_budget_mb"}


def config_diff(old: Config, new: Config, ignore: set[str] = RESUME_MUTABLE) -> list[str]:
    """``["section.key: old -> new", ...]`` for every differing key not in ``ignore``."""
    a, b = old.model_dump(), new.model_dump()
    return [f"{sec}.{key}: {a[sec].get(key)!r} -> {b.get(sec, {}).get(key)!r}"
            for sec in sorted(set(a) | set(b)) for key in {**a.get(sec, {}), **b.get(sec, {})}
            if a.get(sec, {}).get(key) != b.get(sec, {}).get(key)
            and f"{sec}.{key}" not in ignore]


def read_toml(path: Path, what: str = "config") -> dict[str, Any]:
    """A TOML file as a dict; any problem is a one-line ConfigError naming ``what`` and the path."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: TOML syntax error: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): TOML files are UTF-8") \
            from None
    except RecursionError:  # tomllib recurses once per level of arrays and inline tables
        raise ConfigError(f"{path}: a value nested too deeply (arrays or inline tables a few "
                          f"hundred levels deep); flatten it") from None


def _known_keys(loc: tuple, model: type[BaseModel]) -> list[str]:
    """Field names valid at the parent of ``loc`` (for 'did you mean' suggestions)."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type):
            return []
        model = field.annotation
    return list(model.model_fields)


def _describe(exc: ValidationError, prefix: tuple = ()) -> str:
    err = exc.errors()[0]
    loc = (*prefix, *err["loc"])
    key = ".".join(str(p) for p in loc)
    if err["type"] == "extra_forbidden":
        close = closest(str(loc[-1]), _known_keys(loc, schema()))
        hint = f" (did you mean '{'.'.join([*map(str, loc[:-1]), close])}'?)" if close else ""
        return f"unknown key '{key}'{hint}"
    got = err.get("input")
    return f"{key}: {err['msg'][0].lower()}{err['msg'][1:]} (got {got!r})"


def _check_client_options(cfg: Config) -> None:
    """Refuse, before any work, a rule whose client-side training mpifl's trainer lacks."""
    name = cfg.server.algorithm
    rule = aggregators.rule(name)
    options = rule.client_options(cfg.rule_params())
    missing = sorted(set(options) - trainer_keywords(TRAINERS[rule.needs.trainer]))
    if missing:
        raise ConfigError(
            f"server.algorithm: '{name}' needs local training that mpifl's trainer does not have "
            f"yet ({', '.join(missing)}); its aggregator can be used as a library "
            f"(mpifl.aggregators.create('{name}'))")


def _check_names(cfg: Config) -> None:
    """The rule, model, data set and partition name registered entries (or import paths)."""
    try:
        aggregators.rule(cfg.server.algorithm)
    except LookupError as exc:
        raise ConfigError(f"server.algorithm: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"server.algorithm: '{cfg.server.algorithm}': {exc}") from None
    d = cfg.data
    checks = (("model.name", "model", cfg.model.name, MODELS, MODEL_FACTORIES),
              ("data.dataset", "data set", d.dataset, (), DATASET_LOADERS),
              ("data.partition", "partition", d.partition, (), PARTITIONERS))
    for key, kind, name, builtin, registry in checks:
        if name in builtin:
            continue
        try:
            registry.get(name)
        except LookupError as exc:
            if ":" in name:
                raise ConfigError(f"{key}: {exc}") from None
            known = sorted({*builtin, *registry.available()})
            close = closest(name, known)
            hint = f" (did you mean '{close}'?)" if close else ""
            raise ConfigError(f"{key}: unknown {kind} '{name}'{hint}; known: {', '.join(known)}, "
                              f"or an import path 'package.module:object'") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key}: '{name}': {exc}") from None
    get_loss(cfg.model.loss)  # ConfigError "model.loss: ..." for an unknown name
    rule = aggregators.rule(cfg.server.algorithm)
    if cfg.client.trainer == "loop" and rule.needs.trainer != "sgd":
        raise ConfigError(f"client.trainer: 'loop' runs plain local SGD (and FedProx); "
                          f"'{cfg.server.algorithm}' trains with its own vectorised trainer "
                          f"'{rule.needs.trainer}' (use client.trainer = 'auto' or 'vmap')")


def _check_loggers(names: list[str]) -> None:
    """Each of ``run.loggers`` registered, and its optional package installed."""
    for name in names:
        if name not in LOGGERS:
            close = closest(name, LOGGERS.available())
            hint = f" (did you mean '{close}'?)" if close else ""
            raise ConfigError(f"run.loggers: unknown logger '{name}'{hint}; known: "
                              f"{', '.join(LOGGERS.available())}")
        if advice := missing_requirement(name):
            raise ConfigError(f"run.loggers: {advice}")


def _check_lazy(cfg: Config, rule, meta: bool) -> None:
    """``data.lazy``: a data set that declares itself lazy, its natural clients, and nothing
    that reads every sample (FedMeta's meta set, group statistics)."""
    d = cfg.data
    if d.dataset not in lazy_datasets():
        raise ConfigError(f"data.lazy: '{d.dataset}' cannot be loaded lazily (lazy: "
                          f"{', '.join(lazy_datasets()) or 'none'}); set data.lazy = false")
    if d.partition != "natural":
        raise ConfigError(f"data.lazy: a lazy population keeps its own clients (data.partition "
                          f"= \"natural\"), got '{d.partition}'")
    if meta:
        raise ConfigError("data.lazy: FedMeta's meta step draws its meta set from every "
                          "client's samples; set data.lazy = false or server.meta = false")
    if rule.needs.num_groups:
        raise ConfigError(f"data.lazy: {cfg.server.algorithm} needs sensitive groups, which a "
                          f"lazy population does not have")


def _check_consistency(cfg: Config) -> None:
    """Cross-field rules; names are checked against the registries (the source of truth)."""
    _check_names(cfg)
    _check_loggers(cfg.run.loggers)
    _check_client_options(cfg)
    d, s = cfg.data, cfg.server
    rule = aggregators.rule(s.algorithm)
    if rule.needs.all_clients and s.sampling != "all":
        raise ConfigError(f"server.sampling: {s.algorithm} needs every client every round, set "
                          f"server.sampling = \"all\" (got '{s.sampling}')")
    if s.sampling != "all" and s.clients_per_round > d.num_clients:
        raise ConfigError(
            f"server.clients_per_round: {s.clients_per_round} exceeds data.num_clients "
            f"({d.num_clients})"
        )
    if cfg.run.eval_clients > d.num_clients:
        raise ConfigError(f"run.eval_clients: {cfg.run.eval_clients} exceeds data.num_clients "
                          f"({d.num_clients}); 0 evaluates every client")
    try:  # the data layer's rule, as load_federated applies it
        check_combination(d.dataset, d.partition, d.partition_params, d.num_clients)
    except IncompatibleData as exc:
        raise ConfigError(f"{exc.key}: {exc}") from None
    declared = provided(d.dataset)  # None: a plugin that declares nothing (checked once loaded)
    without_groups = declared is not None and SENSITIVE not in declared
    with_groups = ", ".join(providers(SENSITIVE))
    if rule.needs.num_groups and without_groups:
        raise ConfigError(f"data.dataset: {s.algorithm}'s group-fairness constraints need a binary "
                          f"task with a sensitive attribute ({with_groups} or a plugin data "
                          f"set with one), got '{d.dataset}'")
    meta = s.meta or rule.needs.meta_step
    if s.shards > 1:
        if rule.needs.shards is None:
            raise ConfigError(f"server.shards: {s.algorithm} cannot run on a sharded server "
                              f"({rule.needs.shards_note}); set server.shards = 1")
        if s.meta:
            raise ConfigError("server.shards: FedMeta's meta step (server.meta) trains the whole "
                              "model at one place; set server.shards = 1 or server.meta = false")
    sim = cfg.system
    if (rule.needs.asynchronous and sim.enabled
            and (sim.deadline_s is not None or sim.over_commit)):
        raise ConfigError(f"system.deadline_s, system.over_commit: {s.algorithm} is "
                          "asynchronous, with no round to time out or over-commit "
                          f"({s.algorithm}.concurrency sets how many clients train at once); "
                          "leave both unset")
    if meta and cfg.fedmeta.meta_sampling == "group_balanced" and without_groups:
        raise ConfigError(f"fedmeta.meta_sampling: 'group_balanced' needs a dataset with a "
                          f"sensitive attribute ({with_groups}), got '{d.dataset}'")
    if d.lazy:
        _check_lazy(cfg, rule, meta)
    bad = [k for k in cfg.faults.nan_clients if not 0 <= k < d.num_clients]
    if bad:
        raise ConfigError(f"faults.nan_clients: ids {bad} are outside 0..{d.num_clients - 1}")
