"""Start one experiment on every rank: decide where it starts, build the parts, run the loops.

Rank 0 takes the run lock, decides how the run starts (new, replacing an old one, or resuming
from the newest valid checkpoint) and sends the config to every rank as text; every rank then
builds the same federated data from the same seed. Set-up is one agreed phase
(:class:`mpifl.runtime.agreement.SetUp`): plugins, config, start plan, data, model and shards are
steps after which every rank learns whether any rank failed, was stopped by a signal or never
arrived, so a missing data set, a plugin that raises on one rank or a damaged file ends every
rank with that rank's one line and status 2, instead of a hang; a failure during the rounds ends
every rank too (:func:`_end_all_ranks`).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from mpifl.aggregators import PersonalModels
from mpifl.aggregators.shards import ShardGroup, shard_bounds
from mpifl.core.errors import EXIT_BAD_INPUT, ConfigError, MpiflError, OutputError
from mpifl.core.locking import RunLock
from mpifl.experiment.assemble import (build_parts, device_for, local_work, make_adapter,
                                       make_aggregator, make_clock, make_trainer, server_parts,
                                       trainer_columns)
from mpifl.experiment.config import Config, RunConfig, config_diff, config_from_json
from mpifl.experiment.plan import Plan, make_plan
from mpifl.runtime.backends import LocalClients, RemoteClients
from mpifl.runtime.agreement import Outcome, SetUp, one_line
from mpifl.runtime.comm import launched_size, wait_idle, world
from mpifl.runtime.determinism import (Determinism, apply_determinism, named_nondeterminism,
                                       nondeterministic_line)
from mpifl.runtime.installs import mismatch, this_install, venv_warning
from mpifl.runtime.protocol import MPITransport
from mpifl.runtime.loggers import LoggerSet
from mpifl.clients.system import SystemModel
from mpifl.runtime.asynchronous import AsyncServer
from mpifl.runtime.server import Server, ServerSetup
from mpifl.runtime.shard_comm import MPIShardCollectives
from mpifl.runtime.sharding import ShardServer
from mpifl.runtime.signals import EXIT_CHECKPOINTED, StopRequest
from mpifl.runtime.threads import (apply_threads, decide_threads, node_ranks, threads_line,
                                   usable_cores)
from mpifl.runtime.worker import serve
from mpifl.store import checkpoint
from mpifl.store.results import LocalState, MetricSet, ResultsWriter, preflight, read_results

log = logging.getLogger("mpifl")

#: Exit status of every rank when a rank failed: that of a user error (one line, status 2),
#: unless the error says otherwise (:class:`PeerLost`: 4).
EXIT_FAILED = EXIT_BAD_INPUT


@dataclass
class Start:
    """Where a run starts: its config, and the checkpoint to continue from (None: round 0)."""

    cfg: Config
    ckpt: checkpoint.Checkpoint | None = None
    done: bool = False  # resuming a run that is already complete: nothing to do


def plan_start(cfg: Config | None, out: Path, mode: str, rounds: int | None = None) -> Start:
    """Rank 0: how the run at ``out`` starts. Reads only: nothing is deleted or truncated here
    except a replaced run's checkpoints (``overwrite``), so a refusal leaves every file as it was.
    Call it holding the run lock (:class:`mpifl.core.locking.RunLock`).

    Args:
        cfg: the requested config, or None to take the stored one (``mpifl resume``).
        mode: ``new`` (refuse to replace anything), ``overwrite`` (delete the old results and
            checkpoints) or ``resume`` (continue from the newest valid checkpoint; start at
            round 0 only when the run has no completed round yet).
        rounds: with ``cfg=None``, a new ``run.rounds`` (to extend a finished run).

    Raises:
        OutputError: existing results without --overwrite/--resume, damaged files, no config,
            completed rounds but no checkpoint to continue from, a checkpoint of another run.
        ConfigError: resuming with a changed config (the differences are listed).
    """
    folder = checkpoint.folder_for(out)
    if rounds is not None and rounds < 1:
        raise ConfigError(f"--rounds {rounds}: must be at least 1")
    if mode == "resume":
        ckpt = checkpoint.load_latest(folder)
        if ckpt is None:
            return _start_without_checkpoint(cfg, out, folder, rounds)
        stored = config_from_json(ckpt.config_json)
        if (own := _results_config(out)) is not None:
            if diffs := config_diff(config_from_json(own), stored):
                raise OutputError(f"{ckpt.path} belongs to another run than {out}: "
                                  + "; ".join(diffs))
        cfg = _resume_config(stored, cfg, rounds, out)
        if ckpt.round > cfg.run.rounds:
            raise ConfigError(f"run.rounds: {cfg.run.rounds} is less than the {ckpt.round} rounds "
                              f"already run in {out}")
        done = ckpt.round == cfg.run.rounds and _complete(out)
        preflight(out)
        return Start(cfg, ckpt, done)
    if out.exists() or folder.exists():
        if mode != "overwrite":
            raise OutputError(f"--out {out}: already exists; pass --resume to continue it or "
                              "--overwrite to replace it")
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
        elif folder.exists() or folder.is_symlink():
            folder.unlink()
    preflight(out)
    return Start(cfg)


def _start_without_checkpoint(cfg: Config | None, out: Path, folder: Path,
                              rounds: int | None) -> Start:
    """Resume with no checkpoint: start at round 0 only if no completed round would be lost."""
    if not out.exists():
        if cfg is None:
            raise OutputError(f"{out}: no such run to resume (no results file, no checkpoint)")
        log.info("no checkpoint of %s yet: starting at round 0", out)
        preflight(out)
        return Start(cfg)
    res = read_results(out)  # a damaged file: refused (nothing to continue from, nothing lost)
    done = len(res["rounds"].get("round", ()))
    if done or res["attrs"].get("status") == "complete":
        where = "is not a folder" if folder.exists() else "is missing"
        raise OutputError(f"{out} has {done} completed round(s) but no checkpoint to continue "
                          f"from ({folder} {where}); pass --overwrite to run it again")
    cfg = _resume_config(config_from_json(res["attrs"]["config"]), cfg, rounds, out)
    log.info("no checkpoint of %s yet and no completed round: starting at round 0", out)
    preflight(out)
    return Start(cfg)


def _resume_config(stored: Config, cfg: Config | None, rounds: int | None, out: Path) -> Config:
    """The config a resumed run continues with: the stored one (``rounds`` replacing its
    run.rounds), or the requested one when it differs only in what a resume may change.

    Raises:
        ConfigError: a bad ``rounds``, or other differences (listed).
    """
    if rounds is not None:
        stored = _with_rounds(stored, rounds)
    if cfg is None:
        return stored
    if diffs := config_diff(stored, cfg):
        raise ConfigError(f"cannot resume {out} with a changed config: " + "; ".join(diffs))
    return cfg


def _with_rounds(cfg: Config, rounds: int) -> Config:
    try:
        return type(cfg).model_validate({**cfg.model_dump(), "run": {**cfg.run.model_dump(),
                                                                  "rounds": rounds}})
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        errors = getattr(exc, "errors", None)
        msg = errors()[0]["msg"] if callable(errors) and errors() else str(exc).splitlines()[0]
        raise ConfigError(f"--rounds {rounds}: {msg}") from None


def _results_config(out: Path) -> str | None:
    """The config stored in the results file, or None when it is missing or unreadable (a
    checkpoint holds the whole history, so resuming rebuilds it)."""
    try:
        return read_results(out)["attrs"]["config"]
    except (OutputError, KeyError):
        return None


def _complete(out: Path) -> bool:
    try:
        return read_results(out)["attrs"].get("status") == "complete"
    except OutputError:
        return False


def _plan_locked(lock: RunLock, cfg: Config | None, out: Path, mode: str,
                 rounds: int | None, size: int = 1) -> Start:
    """Take the run lock (before anything is opened for writing), then plan the start; a
    config that cannot run on ``size`` ranks is refused before an old run is replaced."""
    if cfg is not None:  # before an --overwrite removes anything
        _check_shards(cfg.server.shards, size)
    if cfg is None and not out.parent.is_dir():  # `mpifl resume` needs an existing run
        raise OutputError(f"{out}: no such run to resume (no folder {out.parent})")
    if not out.parent.is_dir():  # a new run, or `run --resume` of a run not started yet
        if out.parent.exists():
            raise OutputError(f"--out {out}: cannot write there (not a folder: {out.parent})")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"--out {out}: cannot write there ({exc.strerror})") from None
    lock.acquire()
    start = plan_start(cfg, out, mode, rounds)
    if cfg is None:  # `mpifl resume`: the stored config, known only now
        _check_shards(start.cfg.server.shards, size)
    return start


def run_experiment(load: Callable[[], tuple[Config | None, Path]], *, mode: str = "new",
                   rounds: int | None = None, progress: bool = True,
                   stop: StopRequest | None = None) -> int:
    """Run an experiment on all ranks of MPI_COMM_WORLD (or in this process).

    Args:
        load: called on every rank before MPI_Init: the config (None to resume with the stored
            one, ``mode="resume"``) and the results file (written by rank 0; checkpoints go to
            ``out`` + ``.ckpt``). It imports the plugins, so a failure in it on any rank is
            agreed on like every other set-up step.
        mode: ``new``, ``overwrite`` or ``resume`` (see :func:`plan_start`).
        stop: the stop request the rounds watch; default this process's, installed on first
            use (:meth:`StopRequest.process`); :func:`mpifl.run` passes its own for one call.

    Returns:
        The exit status: 0 when every round ran, :data:`EXIT_CHECKPOINTED` (3) when SIGTERM or
        SIGUSR1 stopped the run after a checkpoint.

    Raises:
        MpiflError: bad output path, damaged files, changed config, missing data, a failing
            plugin (on every rank, the same message); :class:`SetupStopped` for a signal during
            set-up.
    """
    stop = StopRequest.process() if stop is None else stop
    loaded = Outcome(load)
    if loaded.error is not None and launched_size() == 1:
        loaded.get()  # one process: nothing to agree on, no MPI_Init for a mistyped config
    run_cfg = loaded.value[0].run if loaded.value and loaded.value[0] else RunConfig()
    comm = world(run_cfg.init_timeout_s)  # every rank reaches MPI_Init, whatever `load` gave
    setup = SetUp(comm, run_cfg.setup_timeout_s, stop)
    _check_installs(setup)
    cfg, out = setup.settle("plugins and config", loaded)
    lock = RunLock(out)
    settings = Determinism.now()  # run.deterministic changes them for this run only
    try:
        return _run(setup, lock, cfg, out, mode, rounds, progress, stop)
    finally:
        settings.restore()
        lock.release()


def _check_installs(setup: SetUp) -> None:
    """Every rank runs the same mpifl from the same place under the same Python; rank 0 logs
    which.

    Raises:
        MpiflError: on every rank, naming the ranks of each install
            (:func:`mpifl.runtime.installs.mismatch`).
    """
    installs = setup.allgather("installs", this_install())
    if line := mismatch(installs):  # the same list, so the same verdict, on every rank
        raise MpiflError(line)
    if setup.rank == 0:
        log.info("mpifl %s from %s, python %s %s, on %s", installs[0][1], installs[0][0],
                 installs[0][2], installs[0][3],
                 f"all {setup.size} ranks" if setup.size > 1 else "one process")
        if warning := venv_warning(installs[0]):
            log.warning(warning)


def _set_threads(setup: SetUp, plan: Plan) -> list[int] | None:
    """Decide and set every rank's threads (:mod:`mpifl.runtime.threads`) and exact or fast
    GPU kernels (``run.deterministic``, :mod:`mpifl.runtime.determinism`) before anything
    heavy runs; rank 0 logs the threads in one line. Each rank's count on rank 0, None
    elsewhere."""
    on_node, sharing = setup.together("ranks on this node", node_ranks)
    with setup.stage("threads"):
        threads = decide_threads(plan.threads, os.environ.get("OMP_NUM_THREADS"),
                                 usable_cores(), on_node, sharing)
        apply_threads(threads.count)
        apply_determinism(plan.config["run"]["deterministic"])
    chosen = setup.gather("threads", (torch.get_num_threads(), threads.why))  # as set
    if chosen is None:
        return None
    log.info(threads_line(chosen))
    return [count for count, _ in chosen]


def _run(setup: SetUp, lock, cfg, out, mode, rounds, progress, stop) -> int:
    """The config agreed on and planned (:func:`mpifl.experiment.plan.make_plan`); from here
    on every rank works from the plan."""
    rank, size = setup.rank, setup.size
    with setup.stage("start plan"):
        start = _plan_locked(lock, cfg, out, mode, rounds, size) if rank == 0 else None
    text = setup.share("config", start.cfg.to_json() if rank == 0 else None)
    with setup.stage("config"):
        plan = make_plan(start.cfg if rank == 0 else config_from_json(text))
    setup.timeout_s = plan.setup_timeout_s  # `mpifl resume`: the stored config's bound
    if setup.share("complete", start.done if rank == 0 else None):
        if rank == 0:
            log.info("%s is already complete (%d rounds)", out, plan.rounds.rounds)
        return 0
    return _build_and_run(setup, plan, start, out, progress, stop)


def _build_and_run(setup: SetUp, plan: Plan, start: Start | None, out: Path, progress: bool,
                   stop: StopRequest) -> int:
    """Every rank builds its parts from the plan (one agreed step each), then rank 0 serves
    the rounds and the others train (:func:`mpifl.runtime.worker.serve`)."""
    rank, size = setup.rank, setup.size
    trains = rank > 0 or size == 1
    threads = _set_threads(setup, plan)
    with setup.stage("device"):
        device = device_for(plan, rank)
    with setup.stage("data and model"), named_nondeterminism():  # checks run the model
        parts = build_parts(plan)
    with setup.stage("trainer"), named_nondeterminism():
        trainer = make_trainer(plan, parts, device) if trains else None
    with setup.stage("adapter"), named_nondeterminism():
        adapter = make_adapter(plan, parts, device, trainer) if trains else None
    hosts = setup.gather("hosts", socket.gethostname())
    if rank == 0:
        log.info("%s: %s, %d clients (%d per round), d=%d, %s, %d rank(s)%s", plan.rounds.name,
                 plan.data.dataset, parts.fed.num_clients, plan.rounds.clients_per_round,
                 parts.layout.d, plan.rule, size,
                 f", resuming after round {start.ckpt.round}" if start.ckpt else "")
        log.info("ranks on hosts: %s", ", ".join(f"{r}:{h}" for r, h in enumerate(hosts)))
    # training ends at its next local step once this rank's stop is requested; not on a
    # sharded server, whose shards aggregate whatever the workers send
    stopping = (lambda: stop.requested) if plan.shards == 1 else None
    if size == 1:
        clients: LocalClients | RemoteClients = LocalClients(trainer, parts.fed, device, adapter,
                                                             stopping)
        try:
            return _serve_rounds(plan, parts, clients, out, start, size, device, stop, progress,
                                 threads=threads)
        except Exception as exc:  # noqa: BLE001 -- one line; the traceback with -v
            if (line := nondeterministic_line(exc)) is not None:  # a plugin's failure too
                raise MpiflError(line) from exc
            if isinstance(exc, MpiflError):
                raise
            log.debug("run failed", exc_info=True)
            raise MpiflError(one_line(exc)) from None
    shard = _shard_setup(setup, plan, parts, start)
    transport = MPITransport(setup.comm, parts.layout.d, trainer_columns(plan, parts),
                             peer_timeout=plan.peer_timeout_s,
                             shard_bounds=(shard_bounds(parts.layout.d, plan.shards)
                                           if plan.shards > 1 else None))
    try:
        if rank == 0:
            clients = RemoteClients(transport, parts.fed, device)
            return _serve_rounds(plan, parts, clients, out, start, size, device, stop, progress,
                                 shard, threads=threads)
        if shard is not None:
            log.info("rank %d: shard %d of %d, parameters [%d, %d)", rank, shard.group.index,
                     shard.group.size, shard.group.lo, shard.group.hi)
        return serve(transport, trainer, parts.fed, device, adapter, shard,
                     checkpoint.folder_for(out), stopping)
    except BaseException as exc:
        _end_all_ranks(transport, rank, exc, shard)
        raise


def _shard_setup(setup: SetUp, plan: Plan, parts, start: Start | None):
    """A sharded server (``server.shards = P > 1``): ranks 0 .. P-1 build the shard
    communicator, their copy of the rule and their :class:`ShardServer`, restoring their block
    of the rule's state when resuming (from a checkpoint of any P). None elsewhere, and on
    every rank when P = 1. Collective on every rank.

    Raises:
        MpiflError: a missing or damaged shard file (every rank; fewer ranks than shards is
            refused earlier, by :func:`_plan_locked`).
    """
    P = plan.shards
    if P == 1:
        return None
    rank = setup.rank
    path = setup.share("checkpoint path", str(start.ckpt.path) if rank == 0 and start.ckpt
                       else "")
    sub = setup.split("shard group", rank < P)

    with setup.stage("shards"):
        if rank >= P:
            return None
        timeout = plan.peer_timeout_s
        wait = None if not timeout else (lambda req: wait_idle(
            req, max_sleep=0.0, timeout=timeout, waiting_for="another shard rank"))
        group = ShardGroup(MPIShardCollectives(sub, wait) if sub is not None else None,
                           parts.layout.d)
        shard = ShardServer(group, make_aggregator(plan, parts),
                            [layer.slice for layer in parts.layout.layers], parts.fed.num_train,
                            plan.rounds.max_update_norm, trainer_columns(plan, parts))
        if path:  # rank 0 has read the checkpoint already; the others read its small main file
            shard.load(start.ckpt if rank == 0 else checkpoint.read(Path(path),
                                                                      verify_shards=False))
    return shard


def _check_shards(shards: int, size: int) -> None:
    """Raises ConfigError: fewer ranks than ``server.shards``."""
    if size < shards:
        raise ConfigError(f"server.shards = {shards} needs at least {shards} MPI ranks (ranks "
                          f"0 .. {shards - 1} are the shards), this job has {size}: start it "
                          f"with mpiexec -n {max(shards, 2)} (or srun --ntasks) or lower "
                          "server.shards")


def _end_all_ranks(transport: MPITransport, rank: int, exc: BaseException,
                   shard=None) -> None:
    """A rank failed during the rounds: end every rank in bounded time.

    Rank 0 failing between requests (a results or checkpoint write, aggregation) sends STOP
    with status 2, so the workers leave their loop cleanly and every rank exits 2 with rank 0's
    one-line message. Anywhere else (a worker, or rank 0 inside a collective) the failing rank
    prints its one line and calls MPI_Abort, which ends the whole job within seconds. The
    status is 4 (EXIT_PEER_LOST) instead of 2 when a rank stopped answering: launching again
    may well work.
    """
    named = nondeterministic_line(exc)  # run.deterministic's refusal, named as such
    line = named or one_line(exc)
    if not isinstance(exc, (MpiflError, KeyboardInterrupt)):
        log.debug("rank %d failed", rank, exc_info=True)
    in_shards = shard is not None and shard.busy  # the other shards wait in a collective
    code = exc.exit_status if isinstance(exc, MpiflError) else EXIT_FAILED
    if rank == 0 and not transport.busy and not in_shards and isinstance(exc, Exception):
        transport.stop.request(code)
        if named or not isinstance(exc, MpiflError):
            raise MpiflError(line) from None
        return
    print(f"mpifl: error: rank {rank}: {line}; ending every rank of the job", file=sys.stderr,
          flush=True)
    transport.abort(code)


def _serve_rounds(plan: Plan, parts, clients, out, start: Start, size, device, stop, progress,
                  shard=None, threads: list[int] | None = None) -> int:
    """Rank 0: the server's parts, restored from the checkpoint when resuming, then the rounds;
    the results file is finished only when every round ran."""
    own = server_parts(plan, parts, device, start.ckpt, shard)
    w, first = parts.w0, 0
    if start.ckpt is not None:
        w, first = torch.from_numpy(start.ckpt.w), start.ckpt.round
    metrics = MetricSet(parts.fed.num_clients, len(parts.layout.layers),
                        group=parts.num_groups > 0,
                        personal=isinstance(own.aggregator, PersonalModels),
                        adapted=plan.adapt is not None, loss=not parts.loss.classification)
    writer = ResultsWriter(out, plan.rounds.config_json, metrics, world_size=size,
                           algorithm=plan.rule,
                           history=start.ckpt.history if start.ckpt else None,
                           clients=_client_table(parts.fed))
    path, why = own.trainer_path
    writer.attrs["trainer"] = path  # what client.trainer = "auto" chose, for the record
    writer.attrs["threads"] = np.asarray(threads, np.int64)  # each rank's, for the record
    writer.attrs["deterministic"] = np.bool_(plan.config["run"]["deterministic"])  # GPU kernels
    log.info("local training: %s trainer (%s), loss %s", path, why, parts.loss.name)
    loggers = LoggerSet(list(plan.loggers), out, plan.config, first)
    asynchronous = plan.needs.asynchronous  # its own simulated time (AsyncServer)
    clock = None if asynchronous else make_clock(plan, parts, start.ckpt)
    if clock is not None:
        writer.system = (clock.tables, clock.system.tier_names)
    try:
        driven = ServerSetup(parts.fed, parts.layout, clients, own.aggregator, writer, device,
                             checkpoints=checkpoint.folder_for(out), stop=stop,
                             world_size=size, meta=own.meta, loggers=loggers, shard=shard,
                             local=own.local, optimizer=own.optimizer, clock=clock)
        server = (_async_server(plan, driven, start, writer) if asynchronous
                  else Server(plan.rounds, driven))
        w, finished = server.run(w, start=first, progress=progress)
        if finished:
            layers = [(layer.name, layer.start, layer.stop) for layer in parts.layout.layers]
            local = (None if own.local is None else  # FedBN's rows: /clients/local_state
                     LocalState.of(own.local.rows.numpy(), own.local.index, parts.layout))
            writer.finish(w.detach().cpu().numpy(), layers, local)
        code = 0 if finished else EXIT_CHECKPOINTED
    except BaseException:
        writer.try_flush()  # keep every row computed so far, if the disk allows
        raise
    finally:
        writer.close()
        loggers.close()
    log.info("results written to %s%s", out, "" if finished else " (stopped early; resume to continue)")
    # only on success (after a failure the job is aborted instead), and only once the results
    # file is closed: a worker that exits 3 before this rank does can end it (srun
    # --kill-on-bad-exit), which must not catch the file open
    clients.stop(code)
    return code


def _async_server(plan: Plan, driven: ServerSetup, start: Start, writer: ResultsWriter
                  ) -> AsyncServer:
    """An asynchronous rule's server (:class:`mpifl.runtime.asynchronous.AsyncServer`) driving
    ``driven``: on the ``[system]`` model when enabled (else equal speeds), its state restored
    from the checkpoint, its tables for the results file's /system.

    Raises:
        OutputError: the checkpoint lacks the asynchronous server's state.
    """
    system = None  # deadline_s and over_commit were refused with the config
    if plan.system is not None:
        system = SystemModel(plan.system, plan.seed, driven.fed.num_clients,
                             model_bytes=4 * driven.layout.d)
    server = AsyncServer(plan.rounds, driven, system=system, epochs=plan.epochs,
                         work=local_work(plan, driven.fed.num_train))
    if start.ckpt is not None:
        try:
            server.load_state_dict(start.ckpt.server_state)
        except ValueError as exc:
            raise OutputError(f"{start.ckpt.path}: {exc}") from None
    writer.system = (server.tables, server.tier_names)
    return server


def _client_table(fed) -> dict[str, np.ndarray]:
    """The results file's /clients: sample counts, and label counts unless the population is
    lazy (they would draw every client's samples)."""
    table = {"num_train": fed.num_train, "num_test": fed.num_test}
    counts = fed.label_counts()
    if counts is not None:
        table["label_counts"] = counts
    return table
