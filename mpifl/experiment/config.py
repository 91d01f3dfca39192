"""Typed experiment configuration: TOML files plus ``--set section.key=value`` overrides.

Every section is a pydantic model with ``extra="forbid"`` and strict types, so an unknown key, a
wrong type or an out-of-range value is caught before any rank does work. :func:`load_config`
turns pydantic's report into one :class:`~mpifl.core.errors.ConfigError` line that names the key and,
for unknown keys, suggests the closest known one.

Each algorithm has its own table (``[fedfv]``, ``[fedavg]``), so ``--set server.algorithm=fedavg``
switches algorithm without editing the file; only the selected algorithm's table is used.
"""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mpifl.core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mpifl.data.federated import DATASETS, PARTITIONS  # noqa: E402  (one source of truth)
from mpifl.data.tabular import TABULAR  # noqa: E402
from mpifl.models import MODELS  # noqa: E402


class _Section(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", validate_default=True)


class RunConfig(_Section):
    name: str = "run"
    seed: int = Field(0, ge=0)
    rounds: int = Field(100, ge=1)
    eval_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(0, ge=0)


class DataConfig(_Section):
    dataset: Literal[DATASETS] = "fashion_mnist"  # type: ignore[valid-type]
    partition: Literal[PARTITIONS] = "shards"  # type: ignore[valid-type]
    num_clients: int = Field(100, ge=1)
    train_fraction: float = Field(0.8, gt=0.0, lt=1.0)
    data_root: str | None = None
    classes_per_client: int = Field(2, ge=1)
    dirichlet_alpha: float = Field(0.5, gt=0.0)
    classes: list[int] = Field(default_factory=lambda: [0, 2, 6], min_length=1)
    synthetic_alpha: float = Field(1.0, ge=0.0)
    synthetic_beta: float = Field(1.0, ge=0.0)
    # group_skew (mFairFL): a preset of the paper (5 clients) or explicit shares per group
    heterogeneity: Literal["high", "low"] = "high"
    group_proportions: list[list[float]] | None = None
    # tabular sets: the sensitive attribute's one-hot columns are also model inputs
    sensitive_feature: bool = True


class ModelConfig(_Section):
    name: Literal[MODELS] = "mlp"  # type: ignore[valid-type]
    hidden: list[int] = Field(default_factory=lambda: [200, 200])
    output: Literal["logits", "softmax"] = "logits"


class ClientConfig(_Section):
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(50, ge=0)
    lr: float = Field(0.1, gt=0.0)
    lr_decay: float = Field(1.0, gt=0.0, le=1.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    memory_budget_mb: float = Field(1024.0, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)


class ServerConfig(_Section):
    algorithm: str = "fedavg"
    clients_per_round: int = Field(10, ge=1)
    sampling: Literal["uniform", "weighted", "all"] = "uniform"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_update_norm: float | None = Field(None, gt=0.0)
    # FedMeta's meta step (SPEC §6, table [fedmeta]) after every aggregation, on top of any rule
    meta: bool = False


class FaultsConfig(_Section):
    nan_clients: list[int] = Field(default_factory=list)


class FedAvgConfig(_Section):
    weighting: Literal["samples", "uniform"] = "samples"


class FedFVConfig(_Section):
    alpha: float = Field(0.1, ge=0.0, lt=1.0)
    tau: int = Field(1, ge=0)
    order: Literal["loss", "random", "reverse"] = "loss"
    external_window: Literal["paper", "flgo"] = "paper"


class FedProxConfig(_Section):
    mu: float = Field(0.01, ge=0.0)
    weighting: Literal["samples", "uniform"] = "samples"


class QFedAvgConfig(_Section):
    q: float = Field(1.0, ge=0.0)


class DRFLConfig(_Section):
    pass


class AFLConfig(_Section):
    eta_lambda: float = Field(0.01, ge=0.0)


class FedMGDAPlusConfig(_Section):
    eps: float = Field(0.1, ge=0.0, le=1.0)
    eta: float = Field(1.0, gt=0.0)


class FedLFConfig(_Section):
    pass


class FedFaConfig(_Section):
    """FedFa (Huang et al. 2020/2022, SPEC §7): beta weighs participation frequency against
    training accuracy (alpha = 1 - beta); gamma_s is the server momentum, gamma_c the clients'
    local SGD momentum."""

    beta: float = Field(0.5, ge=0.0, le=1.0)
    gamma_s: float = Field(0.5, ge=0.0, lt=1.0)
    gamma_c: float = Field(0.5, ge=0.0, lt=1.0)


class DittoConfig(_Section):
    """Ditto (Li et al., ICML 2021, SPEC §7): lam pulls each personal model towards the global
    one; the global model is aggregated as FedAvg with ``weighting``."""

    lam: float = Field(0.1, ge=0.0)
    weighting: Literal["samples", "uniform"] = "samples"


class FedMDFGConfig(_Section):
    """FedMDFG (Pan et al., AAAI 2023, SPEC §7): theta is the angle in degrees between the loss
    vector and 1 above which the fair guidance joins; s bounds the line search (2^s .. 0.5^s)."""

    theta: float = Field(11.25, gt=0.0, lt=90.0)
    s: int = Field(5, ge=0, le=20)


class UGAConfig(_Section):
    """UGA (Yao et al. 2019, SPEC §6): server step size, and an optional cap on the number of
    clients whose local training is traced at once (the memory budget caps it anyway)."""

    eta_g: float = Field(1.0, gt=0.0)
    max_traced_clients: int | None = Field(None, ge=1)


class FedMetaConfig(_Section):
    """FedMeta's meta step (Yao et al. 2019, SPEC §6); used by ``fedmeta`` and ``server.meta``."""

    eta_meta: float = Field(0.1, gt=0.0)
    meta_size: int = Field(100, ge=1)
    meta_sampling: Literal["iid", "group_balanced"] = "iid"


class MFairFLConfig(_Section):
    """mFairFL (Su et al., AAAI 2024, SPEC §4): fairness notion and tolerance (client side),
    multiplier step size, gradient projecting rate alpha (share of low-loss clients curated) and
    the EMA rate beta of the pairwise similarity goals."""

    notion: Literal["dp", "eo", "ap"] = "dp"
    eps: float = Field(0.05, ge=0.0)
    eta_lambda: float = Field(0.1, ge=0.0)
    alpha: float = Field(0.9, ge=0.0, le=1.0)
    beta: float = Field(0.01, gt=0.0, le=1.0)


class Config(_Section):
    """A whole experiment. Sections: run, data, model, client, server, and one per algorithm."""

    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    client: ClientConfig = Field(default_factory=ClientConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    fedavg: FedAvgConfig = Field(default_factory=FedAvgConfig)
    fedfv: FedFVConfig = Field(default_factory=FedFVConfig)
    fedprox: FedProxConfig = Field(default_factory=FedProxConfig)
    qfedavg: QFedAvgConfig = Field(default_factory=QFedAvgConfig)
    drfl: DRFLConfig = Field(default_factory=DRFLConfig)
    afl: AFLConfig = Field(default_factory=AFLConfig)
    fedmgda_plus: FedMGDAPlusConfig = Field(default_factory=FedMGDAPlusConfig)
    fedlf: FedLFConfig = Field(default_factory=FedLFConfig)
    fedfa: FedFaConfig = Field(default_factory=FedFaConfig)
    ditto: DittoConfig = Field(default_factory=DittoConfig)
    fedmdfg: FedMDFGConfig = Field(default_factory=FedMDFGConfig)
    mfairfl: MFairFLConfig = Field(default_factory=MFairFLConfig)
    uga: UGAConfig = Field(default_factory=UGAConfig)
    fedmeta: FedMetaConfig = Field(default_factory=FedMetaConfig)

    def algorithm_params(self) -> dict[str, Any]:
        """Hyper-parameters of the selected algorithm (its own table; empty if it has none)."""
        section = getattr(self, self.server.algorithm, None)
        return section.model_dump() if isinstance(section, BaseModel) else {}

    def to_json(self) -> str:
        """Canonical JSON text of the config (stored in every results file)."""
        return json.dumps(self.model_dump(), sort_keys=True)


# ----------------------------------------------------------------------------------------------
# Loading, overrides, and error messages


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``section.key=value``; the value is read as a TOML value, else taken as a string.

    >>> parse_override("data.classes=[0,1]")
    (['data', 'classes'], [0, 1])
    """
    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or len(path) != 2 or not all(path):
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. server.algorithm=fedfv")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a TOML experiment file (or the defaults if ``path`` is None), apply overrides, validate.

    Raises:
        ConfigError: unreadable file, TOML syntax error, unknown key, wrong type, value out of
            range, or an inconsistent combination. The message is one line naming the key.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_toml(Path(path))
    for text in overrides:
        (section, key), value = parse_override(text)
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{section}: expected a table, got {type(table).__name__}")
        table[key] = value
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    _check_consistency(cfg)
    return cfg


def config_from_json(text: str) -> Config:
    """Rebuild a config stored by :meth:`Config.to_json` (e.g. from a results file)."""
    try:
        cfg = Config.model_validate(json.loads(text))
    except ValidationError as exc:
        raise ConfigError(f"stored config is invalid: {_describe(exc)}") from None
    except ValueError as exc:
        raise ConfigError(f"stored config is not valid JSON: {exc}") from None
    _check_consistency(cfg)
    return cfg


#: Keys a resumed run may change: they decide how long it runs, where things go, or how
#: clients are chunked in memory — never what is computed.
RESUME_MUTABLE = {"run.rounds", "run.name", "run.checkpoint_every", "data.data_root",
                  "server.device", "client.memory_budget_mb"}


def config_diff(old: Config, new: Config, ignore: set[str] = RESUME_MUTABLE) -> list[str]:
    """``["section.key: old -> new", ...]`` for every differing key not in ``ignore``."""
    a, b = old.model_dump(), new.model_dump()
    return [f"{sec}.{key}: {a[sec][key]!r} -> {b[sec][key]!r}"
            for sec in a for key in a[sec]
            if a[sec][key] != b[sec][key] and f"{sec}.{key}" not in ignore]


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


def _known_keys(loc: tuple) -> list[str]:
    """Field names valid at the parent of ``loc`` (for 'did you mean' suggestions)."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type):
            return []
        model = field.annotation
    return list(model.model_fields)


def _describe(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc)
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), _known_keys(loc), n=1)
        hint = f" (did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?)" if close else ""
        return f"unknown key '{key}'{hint}"
    got = err.get("input")
    return f"{key}: {err['msg'][0].lower()}{err['msg'][1:]} (got {got!r})"


def _closest(word: str, candidates: list[str]) -> str | None:
    """difflib's close matches, the one fewest edits away first ('fedfw' -> 'fedfv', whose
    difflib ratio ties with 'fedlf')."""
    close = difflib.get_close_matches(word, candidates, n=max(1, len(candidates)))
    return min(close, key=lambda c: (_edits(word, c), close.index(c))) if close else None


def _edits(a: str, b: str) -> int:
    """Levenshtein distance."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def _check_client_options(cfg: Config) -> None:
    """Refuse, before any work, a rule whose client-side training mpifl's trainer lacks."""
    import inspect

    from mpifl import aggregators
    from mpifl.clients import TRAINERS

    name = cfg.server.algorithm
    rule = aggregators.rule(name)
    options = rule.client_options(**cfg.algorithm_params())
    missing = sorted(set(options) - set(inspect.signature(TRAINERS[rule.trainer_kind]).parameters))
    if missing:
        raise ConfigError(
            f"server.algorithm: '{name}' needs local training that mpifl's trainer does not have "
            f"yet ({', '.join(missing)}); its aggregator can be used as a library "
            f"(mpifl.aggregators.create('{name}'))")


def _check_consistency(cfg: Config) -> None:
    """Cross-field rules and the algorithm name (the registry is the source of truth)."""
    from mpifl import aggregators
    from mpifl.aggregators import available

    algos = available()
    if cfg.server.algorithm not in algos:
        close = _closest(cfg.server.algorithm, algos)
        hint = f" (did you mean '{close}'?)" if close else ""
        raise ConfigError(
            f"server.algorithm: unknown algorithm '{cfg.server.algorithm}'{hint}; "
            f"known: {', '.join(algos)}"
        )
    _check_client_options(cfg)
    d, s = cfg.data, cfg.server
    if s.algorithm == "afl" and s.sampling != "all":
        raise ConfigError(f"server.sampling: afl needs every client every round, set "
                          f"server.sampling = \"all\" (got '{s.sampling}')")
    if s.sampling != "all" and s.clients_per_round > d.num_clients:
        raise ConfigError(
            f"server.clients_per_round: {s.clients_per_round} exceeds data.num_clients "
            f"({d.num_clients})"
        )
    if (d.dataset == "synthetic") != (d.partition == "natural"):
        raise ConfigError(
            "data.partition: 'natural' goes with dataset 'synthetic' and only with it "
            f"(got dataset '{d.dataset}', partition '{d.partition}')"
        )
    if d.partition == "one_class_per_client" and d.num_clients != len(d.classes):
        raise ConfigError(
            f"data.num_clients: one_class_per_client needs one client per class in data.classes "
            f"({len(d.classes)}), got {d.num_clients}"
        )
    _check_tabular(d)
    if s.algorithm == "mfairfl" and d.dataset not in TABULAR:
        raise ConfigError(f"data.dataset: mfairfl's group-fairness constraints need a binary task "
                          f"with a sensitive attribute ({', '.join(TABULAR)}), got '{d.dataset}'")
    meta = s.meta or getattr(aggregators.rule(s.algorithm), "meta_step", False)
    if meta and cfg.fedmeta.meta_sampling == "group_balanced" and d.dataset not in TABULAR:
        raise ConfigError(f"fedmeta.meta_sampling: 'group_balanced' needs a dataset with a "
                          f"sensitive attribute ({', '.join(TABULAR)}), got '{d.dataset}'")
    bad = [k for k in cfg.faults.nan_clients if not 0 <= k < d.num_clients]
    if bad:
        raise ConfigError(f"faults.nan_clients: ids {bad} are outside 0..{d.num_clients - 1}")
    if any(h < 1 for h in cfg.model.hidden):
        raise ConfigError(f"model.hidden: layer sizes must be >= 1 (got {cfg.model.hidden})")


def _check_tabular(d: DataConfig) -> None:
    """Tabular data: not one_class_per_client; group_skew needs a tabular dataset and one share
    per client in every proportion row."""
    if d.partition == "one_class_per_client" and d.dataset in TABULAR:
        raise ConfigError(f"data.partition: one_class_per_client is for the image datasets, "
                          f"got dataset '{d.dataset}'")
    if d.partition != "group_skew":
        return
    if d.dataset not in TABULAR:
        raise ConfigError(f"data.partition: group_skew needs a dataset with a sensitive "
                          f"attribute ({', '.join(TABULAR)}), got '{d.dataset}'")
    if d.group_proportions is None:
        if d.num_clients != 5:
            raise ConfigError(f"data.num_clients: the group_skew '{d.heterogeneity}' preset "
                              f"splits each group over 5 clients, got {d.num_clients}; set "
                              f"data.group_proportions for another number of clients")
        return
    for a, row in enumerate(d.group_proportions):
        if len(row) != d.num_clients:
            raise ConfigError(f"data.group_proportions: group {a} has {len(row)} shares, "
                              f"data.num_clients is {d.num_clients}")
        if any(v < 0 for v in row) or abs(sum(row) - 1.0) > 1e-6:
            raise ConfigError(f"data.group_proportions: group {a}'s shares must be >= 0 and "
                              f"sum to 1 (got {row})")
