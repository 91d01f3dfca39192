"""The sweep file: its TOML tables checked by frozen pydantic models, and the parsed :class:`Sweep`.

A sweep file names a base experiment and the values to vary::

    [sweep]
    name = "smoke"                # names the default folder runs/sweeps/<name>
    base = "fmnist-fedfv.toml"    # the base job, relative to this file
    ranks = 2                     # MPI ranks per run (rank 0 server, the rest workers)
    threads = 1                   # torch/OpenMP threads per rank (OMP_NUM_THREADS)

    [set]                         # fixed overrides of every run ("section.key" = value)
    "run.rounds" = 30

    [grid]                        # every combination of these lists (seeds, partitions, sizes)
    "run.seed" = [0, 1]
    "data.partition" = ["shards", "dirichlet"]

    [algorithms.fedavg]           # one table per algorithm, each with its own axes;
    [algorithms.fedfv]            # runs = sum over algorithms of (its axes x the grid)
    "fedfv.alpha" = [0.1, 0.2]

    [slurm]                       # the SLURM launcher: see :class:`SlurmSpec`
    partition = "gpu"
    [local]                       # the local launcher: see :class:`LocalSpec`

The tables are pydantic models (``extra="forbid"``), so the keys known are the fields below;
every problem becomes one line of :class:`~mpifl.core.errors.ConfigError`. The validators
raise ValueError even for a wrong type: pydantic turns only ValueError into its own errors.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from mpifl.experiment.naming import plain_name
from mpifl.core.errors import ConfigError
from mpifl.experiment.config import bare_key_hint, read_toml

_TABLE = ConfigDict(frozen=True, extra="forbid")


class SweepHead(BaseModel):
    """``[sweep]``: the base experiment, the MPI ranks and threads of every run."""

    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True)

    name: str | None = None
    base: str
    ranks: int = 1
    threads: int = 1

    @field_validator("ranks", "threads", mode="before")
    @classmethod
    def _positive(cls, value: Any, info: ValidationInfo) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"sweep.{info.field_name}: expected an integer >= 1, got {value!r}")
        return value

    @field_validator("name")
    @classmethod
    def _plain(cls, name: str | None) -> str | None:
        """The name becomes a folder (runs/sweeps/<name>): a path there would write elsewhere."""
        if name is not None and not plain_name(name):
            raise ValueError(f"sweep.name = {name!r}: not a plain folder name (no '/', '..' or "
                             "absolute path), so it cannot name runs/sweeps/<sweep.name>; "
                             "pass --out DIR for another place")
        return name


class SlurmSpec(BaseModel):
    """``[slurm]``: the SLURM launcher's job parameters (sbatch options through submitit)."""

    model_config = _TABLE

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gpus_per_node: int | None = None
    setup: list[str] | None = None  # lines run in the job before srun
    time_min: int = 60
    nodes: int = 1
    mem_gb: float | None = None
    array_parallelism: int = 16
    signal_delay_s: int = 120
    srun_mpi: str = "pmi2"  # srun --mpi=...: pmi2, pmix, ...
    additional: dict[str, Any] = Field(default_factory=dict)  # any other sbatch option


class LocalSpec(BaseModel):
    """``[local]``: the local launcher (mpiexec on this machine)."""

    model_config = _TABLE

    parallelism: int = 1  # runs at once
    mpiexec: str = "mpiexec"
    time_min: int = 7 * 24 * 60


class SweepFile(BaseModel):
    """The whole file: one field per table (``[set]`` is ``fixed``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    sweep: SweepHead
    fixed: dict[str, Any] = Field(default_factory=dict, alias="set")
    grid: dict[str, Any] = Field(default_factory=dict)
    algorithms: dict[str, Any] = Field(default_factory=dict)
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)
    local: LocalSpec = Field(default_factory=LocalSpec)

    @field_validator("fixed")
    @classmethod
    def _fixed(cls, table: dict) -> dict:
        return _overrides(table, "set", lists=False)

    @field_validator("grid")
    @classmethod
    def _grid(cls, table: dict) -> dict:
        return _overrides(table, "grid", lists=True)

    @field_validator("algorithms")
    @classmethod
    def _algorithms(cls, table: dict) -> dict:
        for name, axes in table.items():
            if not isinstance(axes, dict):
                raise ValueError(f"[algorithms.{name}] must be a table of lists")  # noqa: TRY004
            _overrides(axes, f"algorithms.{name}", lists=True)
        return table

    @model_validator(mode="after")
    def _axes(self) -> SweepFile:
        """Keys varied twice, and nodes that do not divide the ranks."""
        if self.algorithms and "server.algorithm" in {**self.grid, **self.fixed}:
            raise ValueError("server.algorithm is set by [algorithms.*] tables; "
                             "remove it from [grid]/[set]")
        for name, axes in self.algorithms.items():
            both = set(axes) & set(self.grid)
            if both:
                raise ValueError(f"'{min(both)}' is both in [grid] and in "
                                 f"[algorithms.{name}]")
        nodes = self.slurm.nodes
        if nodes < 1 or self.sweep.ranks % nodes:
            raise ValueError(f"slurm.nodes ({nodes!r}) must divide sweep.ranks "
                             f"({self.sweep.ranks})")
        return self


def _overrides(table: dict, where: str, *, lists: bool) -> dict[str, Any]:
    """Check ``"section.key" = value`` entries (or ``"section.table.key"``, a key of a nested
    table such as ``model.params``; ``lists``: values are non-empty lists): these become
    ``--set`` overrides, whose own checks come later, per run."""
    for key, value in table.items():
        if "." not in key or not all(key.split(".")):  # section.key, or section.table.key
            raise ValueError(f"[{where}] key '{key}': expected \"section.key\""
                             f"{_key_hint(key, value)}")
        if lists and (not isinstance(value, list) or not value):
            raise ValueError(f"{where}.'{key}': expected a non-empty list of values, got {value!r}")
        if any(isinstance(v, dict) for v in (value if lists else [value])):
            raise ValueError(f"{where}.'{key}': tables are not allowed as values")
    return table


def _key_hint(key: str, value: Any) -> str:
    """What a key without its section probably meant: an unquoted dotted key (which TOML reads
    as a table), or the closest known ``section.key``."""
    if "." in key:
        return ""
    if isinstance(value, dict) and value:
        return f"; write dotted keys in quotes: \"{key}.{next(iter(value))}\" = ..."
    return f"; {bare_key_hint(key)}"


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file, paths resolved. Build it with :func:`load_sweep`."""

    path: Path
    name: str
    base: Path
    ranks: int
    threads: int
    fixed: dict[str, Any]
    grid: dict[str, list]
    algorithms: dict[str, dict[str, list]]
    slurm: SlurmSpec
    local: LocalSpec


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file (syntax only: each run's config is checked by
    :func:`mpifl.sweep.plan.check`).

    Raises:
        ConfigError: unreadable file, TOML syntax error, unknown table or key, a grid value
            that is not a non-empty list, a key not of the form ``section.key``, a missing base,
            a sweep name that is not a plain folder name.
    """
    path = Path(path)
    raw = read_toml(path, "sweep")
    try:
        spec = SweepFile.model_validate({"sweep": {}, **raw})
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, path)) from None
    base = (path.parent / spec.sweep.base).resolve()
    if not base.is_file():
        raise ConfigError(f"{path}: sweep.base: no such experiment file: {base}")
    head = spec.sweep
    return Sweep(path=path.resolve(), name=head.name or path.stem, base=base, ranks=head.ranks,
                 threads=head.threads, fixed=spec.fixed, grid=spec.grid,
                 algorithms=spec.algorithms, slurm=spec.slurm, local=spec.local)


def _one_line(exc: ValidationError, path: Path) -> str:
    """pydantic's first error as mpifl's one line: the key, and what is wrong with it."""
    err = exc.errors()[0]
    loc, kind = tuple(map(str, err["loc"])), err["type"]
    if kind == "value_error":
        return f"sweep file: {err['ctx']['error']}"
    if kind == "missing" and loc == ("sweep", "base"):
        return f"{path}: [sweep] needs base = \"EXPERIMENT.toml\" (relative to the sweep file)"
    if kind == "extra_forbidden":
        prefix = "".join(f"{part}." for part in loc[:-1])
        close = difflib.get_close_matches(loc[-1], sorted(_known_keys(loc[:-1])), n=1)
        hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
        return f"sweep file: unknown key '{prefix}{loc[-1]}'{hint}"
    if kind in ("model_type", "dict_type") and len(loc) == 1:
        return f"sweep file: [{loc[0]}] must be a table, got {type(err['input']).__name__}"
    return f"sweep file: {'.'.join(loc)}: {err['msg'][0].lower()}{err['msg'][1:]} " \
           f"(got {err.get('input')!r})"


def _known_keys(table: tuple[str, ...]) -> list[str]:
    """The keys (TOML names) allowed in the table at ``table`` (``()``: the file's tables)."""
    model: Any = SweepFile
    for part in table:
        model = next(f.annotation for n, f in model.model_fields.items() if (f.alias or n) == part)
    return [f.alias or n for n, f in model.model_fields.items()]
