"""Start one experiment on every rank: decide where it starts, build the parts, run the loops.

Rank 0 decides how the run starts (new, replacing an old one, or resuming from the newest valid
checkpoint) and sends the config to every rank as text; every rank then builds the same
federated data from the same seed. Setup failures are checked collectively (:func:`agree`), so a
missing dataset or an unwritable output on any rank ends every rank cleanly with one message
from rank 0, instead of a hang.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch

from mpifl import aggregators
from mpifl.core.errors import ConfigError, MpiflError, OutputError
from mpifl.experiment.assemble import (build_parts, device_for, make_trainer, meta_step_for,
                                       trainer_columns, uses_meta_step)
from mpifl.experiment.config import Config, config_diff, config_from_json
from mpifl.runtime.backends import LocalClients, RemoteClients, group_setup
from mpifl.runtime.comm import MPITransport, bcast_text, world
from mpifl.runtime.server import Server
from mpifl.runtime.signals import EXIT_CHECKPOINTED, StopRequest
from mpifl.runtime.worker import serve
from mpifl.store import checkpoint
from mpifl.store.results import ResultsWriter, preflight, read_results

log = logging.getLogger("mpifl")
T = TypeVar("T")


@dataclass
class Start:
    """Where a run starts: its config, and the checkpoint to continue from (None: round 0)."""

    cfg: Config
    ckpt: checkpoint.Checkpoint | None = None
    done: bool = False  # resuming a run that is already complete: nothing to do


def agree(comm, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it raised :class:`MpiflError` anywhere, raise it everywhere.

    Setup only (the error strings travel as small Python objects): the hot path never uses it.
    """
    error, result = None, None
    try:
        result = fn()
    except MpiflError as exc:
        error = str(exc)
    if comm is not None and comm.Get_size() > 1:
        errors = comm.allgather(error)
        error = next((e for e in errors if e), None)
    if error:
        raise MpiflError(error)
    return result


def plan_start(cfg: Config | None, out: Path, mode: str, rounds: int | None = None) -> Start:
    """Rank 0: how the run at ``out`` starts.

    Args:
        cfg: the requested config, or None to take the stored one (``mpifl resume``).
        mode: ``new`` (refuse to replace anything), ``overwrite`` (delete the old results and
            checkpoints) or ``resume`` (continue from the newest valid checkpoint; start at
            round 0 when there is none yet).
        rounds: with ``cfg=None``, a new ``run.rounds`` (to extend a finished run).

    Raises:
        OutputError: existing results without --overwrite/--resume, damaged files, no config.
        ConfigError: resuming with a changed config (the differences are listed).
    """
    folder = checkpoint.folder_for(out)
    if mode == "resume":
        ckpt = checkpoint.load_latest(folder)
        if ckpt is None and cfg is not None:  # nothing to continue yet: start at round 0
            if _complete(out):
                raise OutputError(f"{out} is complete but has no checkpoint to continue from; "
                                  "pass --overwrite to run it again")
            log.info("no checkpoint of %s yet: starting at round 0", out)
            preflight(out)
            return Start(cfg)
        stored = config_from_json(ckpt.config_json if ckpt else _results_config(out))
        if rounds is not None:
            stored = type(stored).model_validate({**stored.model_dump(), "run": {
                **stored.run.model_dump(), "rounds": rounds}})
        if cfg is None:
            cfg = stored
        elif diffs := config_diff(stored, cfg):
            raise ConfigError(f"cannot resume {out} with a changed config: " + "; ".join(diffs))
        if ckpt is not None and ckpt.round > cfg.run.rounds:
            raise ConfigError(f"run.rounds: {cfg.run.rounds} is less than the {ckpt.round} rounds "
                              f"already run in {out}")
        done = ckpt is not None and ckpt.round == cfg.run.rounds and _complete(out)
        preflight(out)
        return Start(cfg, ckpt, done)
    if out.exists() or folder.exists():
        if mode != "overwrite":
            raise OutputError(f"--out {out}: already exists; pass --resume to continue it or "
                              "--overwrite to replace it")
        shutil.rmtree(folder, ignore_errors=True)
    preflight(out)
    return Start(cfg)


def _results_config(out: Path) -> str:
    if not out.exists():
        raise OutputError(f"{out}: no such run to resume (no results file, no checkpoint)")
    return read_results(out)["attrs"]["config"]


def _complete(out: Path) -> bool:
    try:
        return read_results(out)["attrs"].get("status") == "complete"
    except OutputError:
        return False


def run_experiment(cfg: Config | None, out: Path, *, mode: str = "new", rounds: int | None = None,
                   progress: bool = True) -> int:
    """Run an experiment on all ranks of MPI_COMM_WORLD (or in this process).

    Args:
        cfg: the config, or None to resume with the stored one (``mode="resume"``).
        out: the results file (written by rank 0); checkpoints go to ``out`` + ``.ckpt``.
        mode: ``new``, ``overwrite`` or ``resume`` (see :func:`plan_start`).

    Returns:
        The exit status: 0 when every round ran, :data:`EXIT_CHECKPOINTED` (3) when SIGTERM or
        SIGUSR1 stopped the run after a checkpoint.

    Raises:
        MpiflError: bad output path, damaged files, changed config or missing data (on every
            rank, the same message).
    """
    comm = world()
    size = comm.Get_size() if comm is not None else 1
    rank = comm.Get_rank() if comm is not None else 0
    stop = StopRequest().install()
    start = agree(comm, lambda: plan_start(cfg, out, mode, rounds) if rank == 0 else None)
    if size > 1:  # workers take the config rank 0 settled on
        text = bcast_text(comm, start.cfg.to_json() if rank == 0 else None)
        cfg = start.cfg if rank == 0 else config_from_json(text)
    else:
        cfg = start.cfg
    if rank == 0 and start.done:
        log.info("%s is already complete (%d rounds)", out, cfg.run.rounds)
    if _all(comm, start.done if rank == 0 else None):
        return 0
    device = agree(comm, lambda: device_for(cfg, rank))
    parts = agree(comm, lambda: build_parts(cfg))
    if rank == 0:
        log.info("%s: %s, %d clients (%d per round), d=%d, %s, %d rank(s)%s", cfg.run.name,
                 cfg.data.dataset, parts.fed.num_clients, cfg.server.clients_per_round,
                 parts.layout.d, cfg.server.algorithm, size,
                 f", resuming after round {start.ckpt.round}" if start.ckpt else "")
    if size == 1:
        clients = LocalClients(make_trainer(cfg, parts, device), parts.fed, device)
        return _serve_rounds(cfg, parts, clients, out, start, size, device, stop, progress)
    transport = MPITransport(comm, parts.layout.d, trainer_columns(cfg, parts))
    try:
        if rank == 0:
            clients = RemoteClients(transport, parts.fed, device)
            return _serve_rounds(cfg, parts, clients, out, start, size, device, stop, progress)
        return serve(transport, make_trainer(cfg, parts, device), parts.fed, device)
    except BaseException:
        log.exception("rank %d failed; aborting the job", rank)
        transport.abort(1)
        raise


def _all(comm, flag: bool | None) -> bool:
    """Rank 0's boolean, on every rank."""
    if comm is None or comm.Get_size() == 1:
        return bool(flag)
    return bool(comm.bcast(flag, root=0))


def _serve_rounds(cfg, parts, clients, out, start: Start, size, device, stop, progress) -> int:
    params = cfg.algorithm_params()
    rule = aggregators.rule(cfg.server.algorithm)
    if rule.needs_num_clients:
        params["num_clients"] = parts.fed.num_clients
    if rule.needs_num_groups:
        groups = group_setup(parts.fed, torch.device("cpu"))
        params["num_groups"] = groups[1] if groups else 0
    aggregator = aggregators.create(cfg.server.algorithm, seed=cfg.run.seed, **params)
    w, first = parts.w0, 0
    if start.ckpt is not None:
        aggregator.load_state_dict(start.ckpt.aggregator)
        w, first = torch.from_numpy(start.ckpt.w), start.ckpt.round
    writer = ResultsWriter(out, cfg.to_json(), world_size=size, num_clients=parts.fed.num_clients,
                           num_layers=len(parts.layout.layers), algorithm=cfg.server.algorithm,
                           group_metrics=group_setup(parts.fed, device) is not None,
                           personal_metrics=aggregator.personal_models,
                           history=start.ckpt.history if start.ckpt else None)
    try:
        meta = meta_step_for(cfg, parts, device) if uses_meta_step(cfg) else None
        server = Server(cfg, parts.fed, parts.layout, clients, aggregator, writer, device,
                        checkpoints=checkpoint.folder_for(out), stop=stop, world_size=size,
                        meta=meta)
        w, finished = server.run(w, start=first, progress=progress)
        if finished:
            layers = [(layer.name, layer.start, layer.stop) for layer in parts.layout.layers]
            writer.finish(w.detach().cpu().numpy(), layers)
        code = 0 if finished else EXIT_CHECKPOINTED
        clients.stop(code)  # only on success: after a failure the job is aborted instead
    finally:
        writer.close()
    log.info("results written to %s%s", out, "" if finished else " (stopped early; resume to continue)")
    return code
