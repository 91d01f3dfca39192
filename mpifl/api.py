"""``mpifl.run``: one experiment from Python (a notebook, a script), with the command line's
validation, and its results as :func:`mpifl.load` gives them.

>>> import mpifl
>>> ds = mpifl.run("jobs/fmnist-fedfv.toml", out="runs/nb.h5",
...                overrides={"run.rounds": 20, "server.algorithm": "fedavg"})  # doctest: +SKIP
>>> float(ds.worst5.isel(run=0, eval_round=-1))  # doctest: +SKIP

A mistake (an unknown key, a value out of range, missing data, an existing results file) raises
a :class:`mpifl.MpiflError` subclass whose message is the one line ``mpifl run`` prints, before
anything is trained or written. Under ``mpiexec`` every rank calls it and rank 0 gets the
results (the others None), as with ``mpiexec -n P python -m mpifl run``.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import tomli_w

from mpifl.core.errors import ConfigError, MpiflError

__all__ = ["run", "RunStopped"]

log = logging.getLogger("mpifl")

_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class RunStopped(MpiflError):
    """A run stopped by a signal (Ctrl-C, SIGTERM, SIGUSR1) after checkpointing: call
    :func:`run` again with ``mode="resume"`` to continue it."""

    exit_status = 3


def run(config: str | Path | Mapping[str, Any], *, out: str | Path | None = None,
        overrides: Mapping[str, Any] | Sequence[str] = (),
        mode: Literal["new", "overwrite", "resume"] = "new", progress: bool = True,
        lazy: bool | str = "auto", comm: Any = None):
    """Run one experiment in this process (or on every rank of an MPI job) and load its results.

    Args:
        config: a TOML job file (as ``mpifl run JOB``), or the same tables as a mapping
            (``{"server": {"algorithm": "fedfv"}, "run": {"rounds": 20}}``).
        out: the results file; default ``runs/<run.name>.h5`` (``runs/<run.name>_<values
            set>.h5`` with overrides), as the command line names it.
        overrides: ``{"section.key": value}`` (values as Python objects; a mapping value sets
            the keys under it) or ``["section.key=value", ...]`` as ``--set`` takes them.
        mode: ``"new"`` (refuse to replace an existing run), ``"overwrite"`` (replace it and
            its checkpoints) or ``"resume"`` (continue from its newest valid checkpoint, or
            start it).
        progress: show the progress bar.
        lazy: passed to :func:`mpifl.load`.
        comm: an mpi4py communicator to run on instead of MPI_COMM_WORLD (its rank 0 the
            server), e.g. a ``Split`` of the world so that several runs share one launched
            job; every rank of ``comm`` calls :func:`run` with the same arguments.

    Returns:
        On rank 0 (or in one process): the ``xarray.Dataset`` of :func:`mpifl.load` for
        ``out`` (one run: dims ``run`` = 1, ``round``, ``eval_round``, ``client``, ...); on the
        other ranks of an MPI job, None. Without a logging configuration of its own the
        ``mpifl`` log lines (set-up, evaluations) go to standard error during the call.

    Raises:
        ConfigError: an unknown key, wrong type, out-of-range value or inconsistent setting
            (the message names the key and, for a typo, the closest known one).
        OutputError: ``out`` exists (``mode="new"``), cannot be written, or holds another run.
        DataError: the data set cannot be found or read.
        RunStopped: a signal stopped the run after a checkpoint.
        MpiflError: any other failure the command line reports in one line.
    """
    from mpifl.experiment.run import run_experiment
    from mpifl.runtime.signals import StopRequest

    if mode not in ("new", "overwrite", "resume"):
        raise ConfigError(f"mode={mode!r}: expected 'new', 'overwrite' or 'resume'")
    sets = _override_list(overrides)
    source = _config_source(config)
    where: list[Path] = []

    def load():  # on every rank, before MPI_Init, as the command line does
        from mpifl.experiment.config import load_config
        from mpifl.experiment.naming import default_out

        cfg = load_config(source, sets)
        path = Path(out) if out is not None else default_out(cfg.run.name, sets)
        where.append(path)
        return cfg, path

    from mpifl.runtime.comm import communicator, launched_rank

    stop = StopRequest()
    with _stop_signals(stop), _log_to_stderr(), _callers_threads(), \
            communicator(comm) if comm is not None else nullcontext():
        status = run_experiment(load, mode=mode, progress=progress, stop=stop)
        rank = launched_rank()
    if status == 3:
        raise RunStopped(f"stopped by {stop.reason} after a checkpoint: run again with "
                         f"mode='resume' to continue {where[0]}")
    if rank != 0:
        return None
    from mpifl.report.load import load as load_results

    return load_results(where[0], lazy=lazy)


def _config_source(config: str | Path | Mapping[str, Any]) -> Path | dict[str, Any]:
    if isinstance(config, Mapping):
        return _plain(config, "config")
    if isinstance(config, (str, Path)):
        return Path(config)
    raise ConfigError(f"config: expected a TOML file's path or a mapping of tables, got "
                      f"{type(config).__name__}")


def _override_list(overrides: Mapping[str, Any] | Sequence[str]) -> list[str]:
    """``{"a.b": v}`` as ``["a.b=<v as TOML>"]`` (a mapping value: one line per key under it);
    a list of ``"a.b=v"`` strings as given."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides={overrides!r}: expected a mapping or a list of "
                          "'section.key=value' strings")
    if not isinstance(overrides, Mapping):
        bad = [o for o in overrides if not isinstance(o, str)]
        if bad:
            raise ConfigError(f"overrides: expected 'section.key=value' strings, got {bad[0]!r}")
        return list(overrides)
    lines: list[str] = []
    for key, value in overrides.items():
        if isinstance(value, Mapping):
            lines += _override_list({f"{key}.{k}": v for k, v in value.items()})
        else:
            lines.append(f"{key}={_toml_value(key, value)}")
    return lines


def _toml_value(key: str, value: Any) -> str:
    try:
        return tomli_w.dumps({"v": _plain(value, key)}).partition("=")[2].strip()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"overrides: {key}: {value!r} is not a TOML value ({exc})") from None


def _plain(value: Any, key: str) -> Any:
    """Tuples as lists and numpy scalars as Python numbers, so a mapping validates as TOML
    would (strict types: the config refuses a float where an int is meant)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, key) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


class _stop_signals:
    """SIGTERM, SIGUSR1 and SIGINT stop the run after a checkpoint while it runs (as under the
    command line); the caller's handlers come back afterwards, so Ctrl-C in a notebook raises
    KeyboardInterrupt again. Off the main thread (where Python allows no handler) none is
    installed."""

    def __init__(self, stop) -> None:
        self.stop = stop
        self.saved: dict[int, Any] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.saved = {sig: signal.getsignal(sig) for sig in _SIGNALS}
            self.stop.install()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


class _callers_threads:
    """The caller's torch intra-op and BLAS thread counts come back after the run, which sets
    its own (``run.threads``, mpifl.runtime.threads): a notebook keeps what it chose. Torch's
    inter-op pool cannot be resized once used, so it is left as the first run sized it."""

    def __enter__(self):
        import torch
        from threadpoolctl import threadpool_limits

        self.torch_threads = torch.get_num_threads()
        self.blas = threadpool_limits(limits=None, user_api="blas")  # records, sets nothing
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.set_num_threads(self.torch_threads)
        self.blas.restore_original_limits()


class _log_to_stderr:
    """The ``mpifl`` log lines on standard error during the call, unless the program set up
    logging itself (a handler on the root or the ``mpifl`` logger)."""

    def __init__(self) -> None:
        self.handler: logging.Handler | None = None

    def __enter__(self):
        if not logging.getLogger().handlers and not log.handlers:
            self.handler = logging.StreamHandler(sys.stderr)
            self.handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s",
                                                        "%H:%M:%S"))
            log.addHandler(self.handler)
            self.level = log.level
            log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        if self.handler is not None:
            log.removeHandler(self.handler)
            log.setLevel(self.level)
