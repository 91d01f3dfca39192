"""Live loggers on rank 0: a per-round callback, with CSV, TensorBoard and W&B built in.

After every round the server calls each logger's ``log_round(round, row, summary)``: ``row`` is
the round's /rounds row (phase timings in seconds, train loss, bytes moved, ...; the columns of
:data:`mpifl.store.results.ROUND_COLUMNS`) and ``summary`` the evaluation's summaries on an
evaluation round (mean, worst5, std, ... as fractions; docs/RESULTS.md), else None. Loggers are
chosen by ``[run] loggers = ["csv", "tensorboard"]`` or ``mpifl run --log NAME`` and registered
in :data:`LOGGERS`, so a plugin adds its own with ``@LOGGERS.register("name")``.

Logging never changes results: loggers only read. A logger that raises is reported once
(a warning naming it) and dropped; the run goes on.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mpifl.core.registry import Registry

log = logging.getLogger("mpifl.loggers")


class RoundLogger(Protocol):
    """What a logger implements. Its class is built as ``cls(out, config, start)``: ``out`` the
    run's results file (outputs go beside it), ``config`` the run's config as a dict, ``start``
    the first round this process runs (> 0 after a resume: drop what was logged from ``start``
    on, it will be logged again)."""

    def log_round(self, rnd: int, row: dict[str, Any], summary: dict[str, float] | None) -> None: ...

    def close(self) -> None: ...


#: Logger classes by name. A class may set ``requires = ("module", "extra")``: the config is
#: refused, before any rank works, when ``module`` cannot be imported.
LOGGERS: Registry[type] = Registry("logger")


def scalars(row: dict[str, Any], summary: dict[str, float] | None) -> dict[str, float]:
    """The round's numbers as flat ``name -> float`` (per-layer and per-client columns left out;
    evaluation summaries as ``eval/<name>``)."""
    out = {k: int(v) if isinstance(v, (int, np.integer)) else float(v)
           for k, v in row.items() if k != "round" and np.ndim(v) == 0}
    out.update({f"eval/{k}": float(v) for k, v in (summary or {}).items()})
    return out


@LOGGERS.register("csv")
class CsvLogger:
    """``RUN.log.csv`` beside the results file: one line per round, flushed as it is written,
    evaluation columns filled on evaluation rounds (``tail -f`` or pandas while the run goes).
    ``time_checkpoint`` is 0 here: it is measured after the row is logged (the results file
    has it)."""

    def __init__(self, out: Path, config: dict[str, Any], start: int) -> None:
        self.path = Path(out).with_suffix(".log.csv")
        kept = self._rows_before(start)
        self.fields: list[str] | None = list(kept[0]) if kept else None
        self._rewrite(kept)

    def _rows_before(self, start: int) -> list[dict[str, str]]:
        if start == 0 or not self.path.exists():
            return []
        with open(self.path, newline="") as f:
            return [r for r in csv.DictReader(f) if int(r["round"]) < start]

    def _rewrite(self, rows: list[dict[str, str]]) -> None:
        """Replace the file by ``rows`` (atomically), then append from there."""
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", newline="") as f:
            if self.fields:
                self._writer(f).writeheader()
                self._writer(f).writerows(rows)
        os.replace(tmp, self.path)
        self.file = open(self.path, "a", newline="")

    def _writer(self, f) -> csv.DictWriter:
        return csv.DictWriter(f, fieldnames=self.fields, restval="", extrasaction="ignore")

    def log_round(self, rnd: int, row: dict[str, Any], summary: dict[str, float] | None) -> None:
        values = {"round": rnd, **scalars(row, summary)}
        if self.fields is None:
            self.fields = list(values)
            self._writer(self.file).writeheader()
        missing = [k for k in values if k not in self.fields]
        if missing:  # the first round had no evaluation: its summary columns come now
            self.file.close()
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
            self.fields += missing
            self._rewrite(rows)
        self._writer(self.file).writerow(values)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


@LOGGERS.register("tensorboard")
class TensorBoardLogger:
    """TensorBoard event files in ``RUN.tb/`` (``tensorboard --logdir RUN.tb``): every number of
    the round as a scalar at step = round + 1 (rounds completed). On resume, events from the
    resumed round on are purged (TensorBoard's ``purge_step``)."""

    requires = ("tensorboard", "tensorboard")

    def __init__(self, out: Path, config: dict[str, Any], start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(out).with_suffix(".tb")),
                                    purge_step=start + 1 if start else None)

    def log_round(self, rnd: int, row: dict[str, Any], summary: dict[str, float] | None) -> None:
        for name, value in scalars(row, summary).items():
            self.writer.add_scalar(name, value, global_step=rnd + 1)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@LOGGERS.register("wandb")
class WandbLogger:
    """Weights & Biases: one W&B run per mpifl run, files in ``RUN.wandb/``, the config as its
    config. Offline unless ``WANDB_MODE`` says otherwise (cluster nodes often have no network;
    ``wandb sync RUN.wandb/wandb/offline-run-*`` uploads later)."""

    requires = ("wandb", "wandb")

    def __init__(self, out: Path, config: dict[str, Any], start: int) -> None:
        import wandb

        folder = Path(out).with_suffix(".wandb")
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mpifl"),
                              name=config.get("run", {}).get("name"), config=config,
                              dir=str(folder), mode=os.environ.get("WANDB_MODE", "offline"),
                              resume="allow" if start else None, reinit=True)

    def log_round(self, rnd: int, row: dict[str, Any], summary: dict[str, float] | None) -> None:
        self.run.log(scalars(row, summary), step=rnd + 1)

    def close(self) -> None:
        self.run.finish()


def missing_requirement(name: str) -> str | None:
    """For a registered logger whose optional package is absent: the one-line advice."""
    module, extra = getattr(LOGGERS.get(name), "requires", (None, None))
    if module and importlib.util.find_spec(module) is None:
        return f"logger {name!r} needs the {module} package: pip install 'mpifl[{extra}]'"
    return None


class LoggerSet:
    """The run's loggers, called together; one that raises is dropped with one warning.

    Args:
        names: registered logger names (validated by the config).
        out: the results file; config: the run's config as a dict; start: first round run.
    """

    def __init__(self, names: list[str], out: Path, config: dict[str, Any], start: int) -> None:
        self.active: dict[str, Any] = {}
        for name in names:
            self._guard(name, lambda: self.active.__setitem__(
                name, LOGGERS.get(name)(Path(out), config, start)))

    def log_round(self, rnd: int, row: dict[str, Any], summary: dict[str, float] | None) -> None:
        for name, logger in list(self.active.items()):
            self._guard(name, lambda: logger.log_round(rnd, row, summary))

    def close(self) -> None:
        for name, logger in list(self.active.items()):
            self._guard(name, logger.close)
        self.active.clear()

    def _guard(self, name: str, call) -> None:
        try:
            call()
        except Exception as exc:  # a logger must never end a run
            log.warning("logger %r failed and is switched off (the run goes on): %s: %s",
                        name, type(exc).__name__, exc)
            self.active.pop(name, None)
