"""Live loggers on rank 0: a per-round callback, with CSV, TensorBoard and W&B built in.

After every round the server calls each logger's ``log_round(round, row, summary)``: ``row`` is
the round's /rounds row (phase timings in seconds, train loss, bytes moved, ...; the columns of
:data:`mpifl.store.results.ROUND_COLUMNS`) and ``summary`` the evaluation's summaries on an
evaluation round (mean, worst5, std, ... as fractions; docs/RESULTS.md), else None. Loggers are
chosen by ``[run] loggers = ["csv", "tensorboard"]`` or ``mpifl run --log NAME`` and registered
in :data:`LOGGERS`, so a plugin adds its own with ``@LOGGERS.register("name")``.

Logging never changes results: loggers only read. A logger that raises is reported once
(a warning naming it and, on an I/O error such as a full disk or EIO, the path it could not
write) and dropped; the run goes on, since the results file and the checkpoints are the record
(a failure to write those ends the run). Loggers may set ``path``, what they write, for that
warning.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
import os
import threading
from collections.abc import Callable
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

    # optional: ``path``, the file or folder it writes (named when it fails)


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

    suffix = ".log.csv"

    def __init__(self, out: Path, config: dict[str, Any], start: int) -> None:
        self.path = Path(out).with_suffix(self.suffix)
        self.fd, self.size = -1, 0  # the file, open for appending, and its length of whole rows
        kept = self._rows_before(start)
        self.fields: list[str] | None = list(kept[0]) if kept else None
        self._rewrite(kept)

    def _rows_before(self, start: int) -> list[dict[str, str]]:
        if start == 0 or not self.path.exists():
            return []
        with open(self.path, newline="") as f:
            return [r for r in csv.DictReader(f) if int(r["round"]) < start]

    def _rewrite(self, rows: list[dict[str, str]]) -> None:
        """Replace the file by ``rows`` (atomically: a temporary file, renamed; removed when
        the write fails), then append from there."""
        self.close()
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, self._text(rows, header=True).encode() if self.fields else b"")
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size

    def _text(self, rows: list[dict[str, Any]], header: bool) -> str:
        buf = io.StringIO(newline="")
        assert self.fields is not None  # set by the first round, before any text
        writer = csv.DictWriter(buf, fieldnames=self.fields, restval="", extrasaction="ignore")
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()

    def log_round(self, rnd: int, row: dict[str, Any], summary: dict[str, float] | None) -> None:
        values = {"round": rnd, **scalars(row, summary)}
        fields = self.fields
        header = fields is None
        if fields is None:
            fields = self.fields = list(values)
        missing = [k for k in values if k not in fields]
        if missing:  # the first round had no evaluation: its summary columns come now
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
            fields += missing  # in place: the same list as self.fields
            self._rewrite(rows)
        self._append(self._text([values], header))

    def _append(self, text: str) -> None:
        """One unbuffered write (``tail -f`` sees whole rows); a failed one (a full disk) is
        cut back, so the file keeps whole rows only."""
        data = text.encode()
        try:
            _write_all(self.fd, data)
        except OSError:
            try:
                os.ftruncate(self.fd, self.size)
            except OSError:
                pass
            raise
        self.size += len(data)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _quiet_tensorboard_thread(args: threading.ExceptHookArgs) -> None:
    """TensorBoard writes from a thread that re-raises its I/O error (a traceback on stderr);
    the same error is raised again by the writer's next call, where :class:`LoggerSet`
    reports it in one line and switches the logger off."""
    if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type,
                                                                          Exception):
        return
    _previous_excepthook(args)


_previous_excepthook = threading.excepthook


@LOGGERS.register("tensorboard")
class TensorBoardLogger:
    """TensorBoard event files in ``RUN.tb/`` (``tensorboard --logdir RUN.tb``): every number of
    the round as a scalar at step = round + 1 (rounds completed). On resume, events from the
    resumed round on are purged (TensorBoard's ``purge_step``)."""

    requires = ("tensorboard", "tensorboard")
    suffix = ".tb"

    def __init__(self, out: Path, config: dict[str, Any], start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if threading.excepthook is not _quiet_tensorboard_thread:
            global _previous_excepthook
            _previous_excepthook, threading.excepthook = (threading.excepthook,
                                                          _quiet_tensorboard_thread)
        self.path = Path(out).with_suffix(self.suffix)
        self.writer = SummaryWriter(log_dir=str(self.path),
                                    purge_step=start + 1 if start else None)

    def log_round(self, rnd: int, row: dict[str, Any], summary: dict[str, float] | None) -> None:
        for name, value in scalars(row, summary).items():
            self.writer.add_scalar(name, value, global_step=rnd + 1)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


#: seconds the W&B logger lets wandb's service take to start (wandb's own default: 30)
SERVICE_WAIT_S = 300


@LOGGERS.register("wandb")
class WandbLogger:
    """Weights & Biases: one W&B run per mpifl run, files in ``RUN.wandb/``, the config as its
    config. Offline unless ``WANDB_MODE`` says otherwise (cluster nodes often have no network;
    ``wandb sync RUN.wandb/wandb/offline-run-*`` uploads later)."""

    requires = ("wandb", "wandb")
    suffix = ".wandb"

    def __init__(self, out: Path, config: dict[str, Any], start: int) -> None:
        import wandb

        folder = self.path = Path(out).with_suffix(self.suffix)
        folder.mkdir(parents=True, exist_ok=True)
        # wandb gives its service 30 s to start; on a node busy with the run's own ranks it
        # can take longer, and the logger would be dropped (WANDB__SERVICE_WAIT still wins)
        os.environ.setdefault("WANDB__SERVICE_WAIT", str(SERVICE_WAIT_S))
        mode: Any = os.environ.get("WANDB_MODE", "offline")  # wandb's own variable; it checks it
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mpifl"),
                              name=config.get("run", {}).get("name"), config=config,
                              dir=str(folder), mode=mode,
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
    """The run's loggers, called together; one that raises is dropped with one warning (naming
    the path it could not write, on an I/O error) and closed; the run goes on.

    Args:
        names: registered logger names (validated by the config).
        out: the results file; config: the run's config as a dict; start: first round run.
    """

    def __init__(self, names: list[str], out: Path, config: dict[str, Any], start: int) -> None:
        self.active: dict[str, Any] = {}
        self.out = Path(out)
        for name in names:
            self._guard(name, lambda: self.active.__setitem__(
                name, LOGGERS.get(name)(Path(out), config, start)))

    def log_round(self, rnd: int, row: dict[str, Any], summary: dict[str, float] | None) -> None:
        for name, logger in list(self.active.items()):
            self._guard(name, lambda: logger.log_round(rnd, row, summary))

    def close(self) -> None:
        for name, logger in list(self.active.items()):
            self._guard(name, logger.close, closing=True)
        self.active.clear()

    def _guard(self, name: str, call: Callable[[], None], closing: bool = False) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 -- a logger must never end a run
            logger = self.active.pop(name, None)
            log.warning("logger %r %s; it is switched off%s", name,
                        _failure(exc, logger, LOGGERS.get(name), self.out),
                        "" if closing else " and the run goes on (the results file and the "
                        "checkpoints are the record)")
            if logger is not None and not closing:
                try:  # release its files now, not when it is garbage-collected
                    logger.close()
                except Exception:  # noqa: BLE001 -- it failed already, once is enough
                    pass


def _failure(exc: Exception, logger: Any, cls: type, out: Path) -> str:
    """``cannot write PATH: No space left on device`` for an I/O error, else the error."""
    if isinstance(exc, OSError):
        from mpifl.store.sealed import reason

        suffix = getattr(cls, "suffix", None)  # a logger that failed while being built
        path = (getattr(logger, "path", None) or (out.with_suffix(suffix) if suffix else None)
                or exc.filename)
        return f"cannot write {path}: {reason(exc)}" if path else f"failed: {reason(exc)}"
    return f"failed: {type(exc).__name__}: {' '.join(str(exc).split())}"
