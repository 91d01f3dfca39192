"""``mpifl sweep``: a grid of MPI runs submitted with submitit to SLURM (or run locally), an
index of the runs, and ``mpifl report DIR``: paper-style tables over seeds and curves.

A sweep file (TOML) names a base experiment and the values to vary::

    [sweep]
    name = "smoke"
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

    [slurm]                       # SlurmExecutor: partition, account, time_min, nodes,
    partition = "gpu"             # gpus_per_node, mem_gb, array_parallelism, signal_delay_s,
                                  # srun_mpi ("pmi2" | "pmix" | ...), qos, constraint, setup
    [local]                       # the local executor: parallelism (runs at once), mpiexec

Every point of the grid is one MPI job: ``srun --mpi=pmi2 python -m mpifl run BASE --out
DIR/runs/ID.h5 --resume --set ...`` in a SLURM allocation of ``ranks`` tasks (``mpiexec -n
ranks`` with the local executor). Points go out as one job array of at most
``array_parallelism`` running jobs. ``DIR/index.json`` maps each run id to its overrides, full
config, status and results path. Running the same sweep again skips complete runs, leaves
queued ones alone and resumes the others from their newest checkpoint.

Preemption and time limits: the jobs ask for ``--signal=USR1@signal_delay_s`` and are
requeueable. mpifl's ranks checkpoint at the end of the round on SIGUSR1/SIGTERM and exit with
status 3; the job then requeues itself (``scontrol requeue``) unless SLURM is already requeueing
or cancelling it, and the requeued job resumes from the checkpoint.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import itertools
import json
import logging
import math
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpifl.experiment.config import parse_override, read_toml
from mpifl.core.errors import ConfigError, MpiflError, OutputError
from mpifl.runtime.signals import EXIT_CHECKPOINTED

log = logging.getLogger("mpifl.sweep.sweep")

SEED_KEYS = ("run.seed",)
INDEX = "index.json"

_SWEEP_KEYS = {"name", "base", "ranks", "threads"}
_SLURM_KEYS = {"partition", "account", "time_min", "nodes", "gpus_per_node", "mem_gb",
               "array_parallelism", "signal_delay_s", "srun_mpi", "qos", "constraint", "setup",
               "additional"}
_LOCAL_KEYS = {"parallelism", "mpiexec", "time_min"}
_TABLES = {"sweep", "set", "grid", "algorithms", "slurm", "local"}
# squeue states of a job that is over (anything else is still queued, running or requeueing)
_OVER = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}


# ----------------------------------------------------------------------------------------------
# The sweep file


@dataclass(frozen=True)
class Point:
    """One run of a sweep.

    Attributes:
        id: file-name-safe run id built from the varied values, e.g. ``fedfv_alpha0.1_seed0``.
        params: the varied keys of this run (``"section.key" -> value``), algorithm first.
        overrides: every ``--set`` of the run: the sweep's fixed ones, then ``params``.
    """

    id: str
    params: dict[str, Any]
    overrides: tuple[str, ...]


@dataclass
class Sweep:
    """A parsed sweep file (see the module docstring). Build it with :func:`load_sweep`."""

    path: Path
    name: str
    base: Path
    ranks: int = 1
    threads: int = 1
    fixed: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list] = field(default_factory=dict)
    algorithms: dict[str, dict[str, list]] = field(default_factory=dict)
    slurm: dict[str, Any] = field(default_factory=dict)
    local: dict[str, Any] = field(default_factory=dict)

    def points(self) -> list[Point]:
        """Expand the grid: every algorithm's axes times the shared grid, in file order.

        Raises:
            ConfigError: two points would get the same run id.
        """
        algos = self.algorithms or {None: {}}
        points = []
        for algo, axes in algos.items():
            head = {"server.algorithm": algo} if algo is not None else {}
            for values in _product({**axes, **self.grid}):
                params = {**head, **values}
                sets = {**self.fixed, **params}
                points.append(Point(_run_id(params), params,
                                    tuple(f"{k}={_toml_value(v)}" for k, v in sets.items())))
        _check_unique(points)
        return points


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file (syntax only: each run's config is checked by :func:`check`).

    Raises:
        ConfigError: unreadable file, TOML syntax error, unknown table or key, a grid value
            that is not a non-empty list, a key not of the form ``section.key``, a missing base.
    """
    path = Path(path)
    raw = read_toml(path, "sweep")
    _no_unknown(raw, _TABLES, "")
    head = _table(raw, "sweep")
    _no_unknown(head, _SWEEP_KEYS, "sweep.")
    if "base" not in head:
        raise ConfigError(f"{path}: [sweep] needs base = \"EXPERIMENT.toml\" (relative to the sweep file)")
    base = (path.parent / str(head["base"])).resolve()
    if not base.is_file():
        raise ConfigError(f"{path}: sweep.base: no such experiment file: {base}")
    sweep = Sweep(path=path.resolve(), name=str(head.get("name", path.stem)), base=base,
                  ranks=_positive(head, "ranks", 1), threads=_positive(head, "threads", 1),
                  fixed=_overrides(_table(raw, "set"), "set", lists=False),
                  grid=_overrides(_table(raw, "grid"), "grid", lists=True),
                  algorithms=_algorithms(_table(raw, "algorithms")),
                  slurm=_table(raw, "slurm"), local=_table(raw, "local"))
    _no_unknown(sweep.slurm, _SLURM_KEYS, "slurm.")
    _no_unknown(sweep.local, _LOCAL_KEYS, "local.")
    _check_axes(sweep)
    return sweep


def _table(raw: dict, name: str) -> dict[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"sweep file: [{name}] must be a table, got {type(value).__name__}")
    return value


def _no_unknown(table: dict, known: set[str], prefix: str) -> None:
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"sweep file: unknown key '{prefix}{key}'{hint}")


def _positive(table: dict, key: str, default: int) -> int:
    value = table.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"sweep file: sweep.{key}: expected an integer >= 1, got {value!r}")
    return value


def _overrides(table: dict, where: str, *, lists: bool) -> dict[str, Any]:
    """Check ``"section.key" = value`` entries (``lists``: values are non-empty lists)."""
    for key, value in table.items():
        if key.count(".") != 1 or not all(key.split(".")):
            raise ConfigError(f"sweep file: [{where}] key '{key}': expected \"section.key\"")
        if lists and (not isinstance(value, list) or not value):
            raise ConfigError(f"sweep file: {where}.'{key}': expected a non-empty list of values, "
                              f"got {value!r}")
        for v in value if lists else [value]:
            if isinstance(v, dict):
                raise ConfigError(f"sweep file: {where}.'{key}': tables are not allowed as values")
    return dict(table)


def _algorithms(table: dict) -> dict[str, dict[str, list]]:
    out = {}
    for name, axes in table.items():
        if not isinstance(axes, dict):
            raise ConfigError(f"sweep file: [algorithms.{name}] must be a table of lists")
        out[name] = _overrides(axes, f"algorithms.{name}", lists=True)
    return out


def _check_axes(sweep: Sweep) -> None:
    if sweep.algorithms and ("server.algorithm" in sweep.grid or "server.algorithm" in sweep.fixed):
        raise ConfigError("sweep file: server.algorithm is set by [algorithms.*] tables; "
                          "remove it from [grid]/[set]")
    for name, axes in sweep.algorithms.items():
        both = set(axes) & set(sweep.grid)
        if both:
            raise ConfigError(f"sweep file: '{sorted(both)[0]}' is both in [grid] and in "
                              f"[algorithms.{name}]")
    nodes = sweep.slurm.get("nodes", 1)
    if not isinstance(nodes, int) or nodes < 1 or sweep.ranks % nodes:
        raise ConfigError(f"sweep file: slurm.nodes ({nodes!r}) must divide sweep.ranks "
                          f"({sweep.ranks})")


def _product(axes: dict[str, list]) -> list[dict[str, Any]]:
    keys = list(axes)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]


def _toml_value(v: Any) -> str:
    """A value as TOML text for ``--set`` (strings, numbers, booleans, lists of them)."""
    if isinstance(v, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", v) and v not in (
            "true", "false", "inf", "nan"):
        return v  # a bare word is a string for --set
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return json.dumps(v)


def _run_id(params: dict[str, Any]) -> str:
    parts = []
    for key, v in params.items():
        text = "-".join(map(str, v)) if isinstance(v, list) else str(v)
        parts.append(text if key == "server.algorithm" else key.split(".")[1] + text)
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", "_".join(parts)) or "run"


def _check_unique(points: list[Point]) -> None:
    seen: dict[str, Point] = {}
    for p in points:
        if p.id in seen:
            raise ConfigError(f"sweep file: runs {seen[p.id].params} and {p.params} get the same "
                              f"id '{p.id}'; make their values distinct")
        seen[p.id] = p


def select(points: list[Point], only: list[str]) -> list[Point]:
    """The points matching every ``--only section.key=value`` (several values of a key: any).

    Raises:
        ConfigError: a malformed filter, or a key that the sweep does not vary.
    """
    wanted: dict[str, list] = {}
    for text in only:
        (section, key), value = parse_override(text)
        wanted.setdefault(f"{section}.{key}", []).append(value)
    for key in wanted:
        if points and all(key not in p.params for p in points):
            raise ConfigError(f"--only {key}: the sweep does not vary this key")
    return [p for p in points if all(p.params.get(k, _MISSING) in vs for k, vs in wanted.items())]


_MISSING = object()


# ----------------------------------------------------------------------------------------------
# Checking runs against mpifl's config, and the index


@dataclass
class RunState:
    """What the index knows about one run (one line of ``DIR/index.json``)."""

    id: str
    params: dict[str, Any]
    overrides: list[str]
    results: str  # relative to the sweep folder
    status: str = "new"  # new | queued | running | unfinished | failed | complete | invalid
    config: dict | None = None
    job_id: str | None = None
    log: str | None = None
    error: str | None = None


def check(sweep: Sweep, point: Point) -> tuple[dict | None, str | None]:
    """Validate one run's config: ``(config as a dict, None)`` or ``(None, one-line reason)``.

    An algorithm that this mpifl does not implement is reported (not raised), so that sweeps
    naming future algorithms still expand.
    """
    from mpifl.aggregators import available
    from mpifl.experiment.config import load_config

    algo = point.params.get("server.algorithm") or _base_algorithm(sweep)
    if algo not in available():
        return None, (f"algorithm '{algo}' is not implemented in this mpifl "
                      f"(known: {', '.join(available())})")
    try:
        return json.loads(load_config(sweep.base, list(point.overrides)).to_json()), None
    except ConfigError as exc:
        return None, str(exc)


def _base_algorithm(sweep: Sweep) -> str:
    fixed = sweep.fixed.get("server.algorithm")
    if fixed is not None:
        return str(fixed)
    return str(read_toml(sweep.base).get("server", {}).get("algorithm", "fedavg"))


def read_index(folder: Path) -> dict[str, Any]:
    """``DIR/index.json`` as a dict (``{"runs": {}}`` when there is none yet).

    Raises:
        OutputError: the file exists but is not valid JSON.
    """
    path = folder / INDEX
    if not path.exists():
        return {"runs": {}}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise OutputError(f"{path}: cannot read the sweep index ({exc})") from None


def write_index(folder: Path, sweep: Sweep, runs: dict[str, RunState]) -> None:
    """Write ``DIR/index.json`` atomically: sweep file, base, ranks and every run's state.
    Runs already in the index but not in ``runs`` (left out by ``--only``) are kept."""
    merged = {**read_index(folder).get("runs", {}), **{rid: vars(r) for rid, r in runs.items()}}
    data = {"sweep": sweep.name, "sweep_file": str(sweep.path), "base": str(sweep.base),
            "ranks": sweep.ranks, "updated": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": merged}
    tmp = folder / f".{INDEX}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, folder / INDEX)


def plan(sweep: Sweep, folder: Path, points: list[Point]) -> dict[str, RunState]:
    """Every run's state: its config (or why it is invalid) and its status from disk and SLURM.

    Raises:
        ConfigError: a started run whose config has changed since (resuming would mix them).
    """
    old = read_index(folder).get("runs", {})
    runs = {}
    for p in points:
        prev = old.get(p.id, {})
        r = RunState(p.id, p.params, list(p.overrides), f"runs/{p.id}.h5",
                     job_id=prev.get("job_id"), log=prev.get("log"), error=prev.get("error"))
        r.config, reason = check(sweep, p)
        if reason:
            r.status, r.error = "invalid", reason
        runs[p.id] = r
    refresh(folder, runs)
    _check_unchanged(folder, runs)
    return runs


def refresh(folder: Path, runs: dict[str, RunState]) -> None:
    """Update each run's status: complete (results say so), queued/running (live SLURM job),
    unfinished (results or checkpoints on disk), new (nothing yet)."""
    live = slurm_states([r.job_id for r in runs.values() if r.job_id])
    for r in runs.values():
        if r.status == "invalid":
            continue
        state = live.get(r.job_id or "")
        path = folder / r.results
        if _results_status(path) == "complete" and _rounds_done(path, r.config):
            r.status, r.error = "complete", None
        elif state is not None:
            r.status = "running" if state in ("RUNNING", "COMPLETING") else "queued"
        else:
            r.error = _log_error(folder, r.log) if r.log else r.error
            started = path.exists() or path.with_name(path.name + ".ckpt").exists()
            r.status = "failed" if r.error else "unfinished" if started else "new"


def _log_error(folder: Path, log_path: str) -> str | None:
    """The most telling error line of a job's log: mpifl's own one-line error, else the last
    Python exception (other than "mpifl run exited with status N"), else that one."""
    lines = []
    for path in (folder / log_path, folder / log_path.replace("_log.out", "_log.err")):
        try:
            lines += path.read_text(errors="replace").splitlines()[-300:]
        except OSError:
            continue
    found = [m.group(1).strip() for line in lines
             if (m := re.search(r"(mpifl: error: .*|\b[A-Z]\w*Error: .*)", line))]
    for good in (lambda e: e.startswith("mpifl: error: "),
                 lambda e: "mpifl run exited with status" not in e, lambda e: True):
        picked = [e for e in found if good(e)]
        if picked:
            return picked[-1]
    return None


def _results_status(path: Path) -> str | None:
    import h5py

    try:
        with h5py.File(path, "r") as f:
            status = f.attrs.get("status")
    except OSError:  # missing, or being written by a running job
        return None
    return status.decode() if isinstance(status, bytes) else status


def _rounds_done(path: Path, config: dict | None) -> bool:
    """A complete results file ran as many rounds as the sweep now asks for."""
    from mpifl.store.results import read_results

    if config is None:
        return True
    stored = read_results(path)["config"]
    return stored.get("run", {}).get("rounds") == config["run"]["rounds"]


def _check_unchanged(folder: Path, runs: dict[str, RunState]) -> None:
    from mpifl.experiment.config import config_diff, config_from_json

    for r in runs.values():
        if r.status in ("new", "invalid") or r.config is None:
            continue
        stored = _stored_config(folder / r.results)
        if stored is None:
            continue
        diffs = config_diff(config_from_json(stored), config_from_json(json.dumps(r.config)))
        if diffs:
            raise ConfigError(f"run {r.id}: its config changed since it was started "
                              f"({'; '.join(diffs)}); use another --out folder")


def _stored_config(path: Path) -> str | None:
    from mpifl.store import checkpoint
    from mpifl.store.results import read_results

    try:
        if path.exists():
            return json.dumps(read_results(path)["config"])
        ckpt = checkpoint.load_latest(checkpoint.folder_for(path))
    except OutputError:
        return None  # damaged: mpifl run --resume reports it
    return ckpt.config_json if ckpt is not None else None


# ----------------------------------------------------------------------------------------------
# SLURM queries


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """``job id -> squeue state`` for those of ``job_ids`` that are not over yet (queued,
    running, completing, requeueing). ``{}`` on a machine without SLURM.

    Raises:
        MpiflError: squeue is there but fails (controller down): the sweep cannot tell which
            jobs are still queued, and would otherwise submit them twice.
    """
    if not job_ids or shutil.which("squeue") is None:
        return {}
    user = pwd.getpwuid(os.getuid()).pw_name
    try:
        proc = subprocess.run(["squeue", "-h", "-r", "-u", user, "-o", "%i|%T"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MpiflError(f"squeue failed: {exc}") from None
    if proc.returncode != 0:
        raise MpiflError(f"squeue failed: {' '.join(proc.stderr.split())[:200]} "
                         "(is the SLURM controller up? SLURM_CONF?)")
    states = dict(line.split("|", 1) for line in proc.stdout.split() if "|" in line)
    wanted = set(job_ids)
    return {j: s for j, s in states.items() if j in wanted and s not in _OVER}


def _job_state(job_id: str) -> str | None:
    """JobState of one job from ``scontrol show job`` (None when unknown)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bJobState=(\S+)", out)
    return m.group(1) if m else None


# ----------------------------------------------------------------------------------------------
# One run as a job: what submitit pickles and runs in the batch script


@dataclass
class MpiRun:
    """The job of one sweep point: launch ``mpifl run --resume`` on all ranks, requeue on stop.

    Called by submitit in the job (one process, not under srun). ``argv`` is the full launch
    command (``srun --mpi=pmi2 ...`` or ``mpiexec -n N ...``). SIGTERM, SIGUSR1 and SIGUSR2
    received by this process are passed on to the ranks as SIGUSR1 (srun would turn a SIGTERM
    into killing the step); the ranks checkpoint and exit with status 3.

    A launch that fails otherwise (status not 0, 2 or 3) is tried again, up to ``launches``
    times in all, while the job is still running: ``--resume`` continues where it stopped.

    Returns:
        ``{"id", "status": "complete" | "checkpointed", "results"}``.

    Raises:
        RuntimeError: ``mpifl run`` failed (status other than 0 and 3); see the job's log.
    """

    id: str
    argv: list[str]
    results: str
    env: dict[str, str]
    slurm: bool

    launches: int = 3
    retry_wait_s: float = 5.0

    def __call__(self) -> dict[str, str]:
        for attempt in range(1, self.launches + 1):
            _say(f"{self.id}: {shlex.join(self.argv)}")
            rc = _run_forwarding(self.argv, {**os.environ, **self.env})
            if rc in (0, 2, EXIT_CHECKPOINTED) or attempt == self.launches or not _may_retry():
                break
            _say(f"{self.id}: launch {attempt} failed with status {rc}; trying again (--resume)")
            time.sleep(self.retry_wait_s)
        if rc == 0:
            return {"id": self.id, "status": "complete", "results": self.results}
        if rc != EXIT_CHECKPOINTED:
            raise RuntimeError(f"{self.id}: mpifl run exited with status {rc}")
        if self.slurm:
            _requeue_self(self.id)
        return {"id": self.id, "status": "checkpointed", "results": self.results}


def _may_retry() -> bool:
    """Whether to launch again after a failure: not when SLURM is ending this job. (MPICH's
    wheel under ``srun --mpi=pmi2`` has been seen to fail in MPI_Init now and then, with
    "UCX ERROR failed to unpack address"; a new launch works and resumes the run.)"""
    job = os.environ.get("SLURM_JOB_ID")
    return job is None or _job_state(job) in (None, "RUNNING")


def _run_forwarding(argv: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(argv, env=env)

    def forward(signum, _frame):
        _say(f"got {signal.Signals(signum).name}: asking the ranks to checkpoint")
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _requeue_self(run_id: str) -> None:
    """Requeue this SLURM job unless SLURM is already ending it (requeue, cancel, preemption),
    then leave without a result: the requeued job resumes from the checkpoint."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        return
    state = _job_state(job)
    if state in (None, "RUNNING"):
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        _say(f"{run_id}: checkpointed; scontrol requeue {job}: "
             + ("ok" if done.returncode == 0 else done.stderr.strip()))
    else:
        _say(f"{run_id}: checkpointed; job {job} is {state}: SLURM requeues or ends it")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no submitit result: the job is not over


def _say(text: str) -> None:
    """A line in the job's log (submitit's process has no logging set up)."""
    print(f"[mpifl sweep {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def launch_argv(sweep: Sweep, folder: Path, run: RunState, executor: str) -> list[str]:
    """The command that runs one point on all its ranks (``srun`` or ``mpiexec``)."""
    mpifl = [sys.executable, "-m", "mpifl", "run", str(sweep.base), "--out",
             str(folder / run.results), "--resume", "--no-progress"]
    for o in run.overrides:
        mpifl += ["--set", o]
    if executor == "slurm":
        mpi = str(sweep.slurm.get("srun_mpi", "pmi2"))
        return ["srun", f"--mpi={mpi}", f"--ntasks={sweep.ranks}", "--kill-on-bad-exit=1", *mpifl]
    if sweep.ranks == 1:
        return mpifl
    return [str(sweep.local.get("mpiexec", "mpiexec")), "-n", str(sweep.ranks), *mpifl]


def _thread_env(sweep: Sweep) -> dict[str, str]:
    n = str(sweep.threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "PYTHONUNBUFFERED": "1"}


# ----------------------------------------------------------------------------------------------
# Submission


def slurm_executor(sweep: Sweep, folder: Path):
    """A submitit SlurmExecutor for the sweep's jobs: ``ranks`` tasks (each one MPI rank,
    started by the job's own ``srun``), ``threads`` CPUs per task, USR1 before the time limit,
    requeueable, at most ``array_parallelism`` array jobs at once.

    Raises:
        MpiflError: no SLURM commands on this machine.
    """
    import submitit

    if shutil.which("sbatch") is None:
        raise MpiflError("--executor slurm: sbatch not found (no SLURM here; try --executor local,"
                         " or slurm/local-cluster.sh up)")
    s = sweep.slurm
    nodes = int(s.get("nodes", 1))
    ex = submitit.SlurmExecutor(folder=folder / "logs", max_num_timeout=1000)
    params = {"job_name": f"mpifl-{sweep.name}", "nodes": nodes,
              "ntasks_per_node": sweep.ranks // nodes, "cpus_per_task": sweep.threads,
              "time": int(s.get("time_min", 60)), "use_srun": False,
              "array_parallelism": int(s.get("array_parallelism", 16)),
              "signal_delay_s": int(s.get("signal_delay_s", 120)), "stderr_to_stdout": True,
              "additional_parameters": {"signal": f"USR1@{int(s.get('signal_delay_s', 120))}",
                                        "requeue": True, **s.get("additional", {})}}
    for key in ("partition", "account", "qos", "constraint", "gpus_per_node", "setup"):
        if key in s:
            params[key] = s[key]
    if "mem_gb" in s:
        params["mem"] = f"{int(s['mem_gb'])}GB"
    ex.update_parameters(**params)
    return ex


def submit_slurm(sweep: Sweep, folder: Path, runs: list[RunState]) -> None:
    """Submit ``runs`` as one submitit job array; record job ids and log paths in ``runs``.

    Raises:
        MpiflError: sbatch refused the jobs (its message, one line).
    """
    ex = slurm_executor(sweep, folder)
    fns = [MpiRun(r.id, launch_argv(sweep, folder, r, "slurm"), r.results, _thread_env(sweep), True)
           for r in runs]
    try:
        jobs = ex.submit_array(fns)
    except Exception as exc:  # submitit raises CalledProcessError/FailedSubmissionError
        detail = getattr(exc, "stderr", None) or getattr(exc, "output", None) or exc
        text = detail.decode() if isinstance(detail, bytes) else str(detail)
        raise MpiflError(f"sbatch failed: {' '.join(text.split())[:300]}") from None
    for r, job in zip(runs, jobs):
        r.job_id, r.status, r.error = job.job_id, "queued", None
        r.log = os.path.relpath(job.paths.stdout, folder)


def wait_slurm(folder: Path, runs: dict[str, RunState], poll_s: float = 2.0,
               timeout_s: float | None = None) -> None:
    """Block until none of the runs' jobs is queued, running or requeueing.

    Raises:
        MpiflError: ``timeout_s`` passed first.
    """
    start, last = time.monotonic(), 0.0
    ids = [r.job_id for r in runs.values() if r.job_id]
    while live := _states_retrying(ids):
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise MpiflError(f"sweep: still {len(live)} job(s) in SLURM after {timeout_s:.0f} s")
        if time.monotonic() - last > 60:
            log.info("waiting for %d job(s): %s", len(live), _counts(live.values()))
            last = time.monotonic()
        time.sleep(poll_s)


def _states_retrying(ids: list[str], tries: int = 5) -> dict[str, str]:
    """:func:`slurm_states`, trying again for a while when squeue fails (a busy controller)."""
    for attempt in range(tries):
        try:
            return slurm_states(ids)
        except MpiflError:
            if attempt == tries - 1:
                raise
            time.sleep(10)
    return {}


def run_local(sweep: Sweep, folder: Path, runs: list[RunState]) -> None:
    """Run ``runs`` with submitit's LocalExecutor, at most ``local.parallelism`` at once, and
    wait for them; a failed run's error is kept in its state."""
    import submitit

    ex = submitit.LocalExecutor(folder=folder / "logs")
    ex.update_parameters(timeout_min=int(sweep.local.get("time_min", 7 * 24 * 60)))
    todo, active = list(runs), []
    parallel = int(sweep.local.get("parallelism", 1))
    while todo or active:
        while todo and len(active) < parallel:
            r = todo.pop(0)
            job = ex.submit(MpiRun(r.id, launch_argv(sweep, folder, r, "local"), r.results,
                                   _thread_env(sweep), False))
            r.job_id, r.status, r.error = None, "running", None
            r.log = os.path.relpath(job.paths.stdout, folder)
            active.append((r, job))
        time.sleep(0.5)
        for r, job in [a for a in active if a[1].done()]:
            active.remove((r, job))
            r.error = _log_error(folder, r.log) if job.exception() else None
            log.info("%s: %s", r.id, f"failed: {r.error}" if r.error else "over")


def _counts(states) -> str:
    counts: dict[str, int] = {}
    for s in states:
        counts[s] = counts.get(s, 0) + 1
    return ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items()))


def run_sweep(sweep: Sweep, folder: Path, *, executor: str = "local", wait: bool = False,
              only: list[str] = (), timeout_s: float | None = None) -> dict[str, RunState]:
    """Submit (or run) every unfinished run of ``sweep``; write ``folder/index.json``.

    Complete runs are skipped, runs whose job is still queued or running are left alone, the
    others start or resume from their newest checkpoint. With the local executor this returns
    when the runs are done; with SLURM only with ``wait``.

    Raises:
        ConfigError: an invalid run among those selected (its id and the reason), or a started
            run whose config has changed.
        MpiflError: SLURM refused the jobs or is not there.
    """
    points = select(sweep.points(), list(only))
    if not points:
        raise ConfigError("sweep: no run matches --only")
    folder.mkdir(parents=True, exist_ok=True)
    runs = plan(sweep, folder, points)
    _no_invalid(runs)
    todo = [r for r in runs.values() if r.status in ("new", "unfinished", "failed")]
    log.info("sweep %s: %d runs (%s); starting %d", sweep.name, len(runs),
             _counts(r.status for r in runs.values()), len(todo))
    if executor == "slurm" and todo:
        submit_slurm(sweep, folder, todo)
    write_index(folder, sweep, runs)
    if executor == "local" and todo:
        run_local(sweep, folder, todo)
    elif executor == "slurm" and wait:
        wait_slurm(folder, runs, timeout_s=timeout_s)
    refresh(folder, runs)
    write_index(folder, sweep, runs)
    return runs


def _no_invalid(runs: dict[str, RunState]) -> None:
    bad = [r for r in runs.values() if r.status == "invalid"]
    if bad:
        raise ConfigError(f"sweep: {len(bad)} of {len(runs)} runs are invalid; first {bad[0].id}: "
                          f"{bad[0].error} (see --dry-run; select runs with --only KEY=VALUE)")


# ----------------------------------------------------------------------------------------------
# mpifl report DIR


def collect(folder: Path) -> list[dict[str, Any]]:
    """One row per run of the sweep in ``folder`` that has an evaluation: its params and
    :func:`mpifl.report.summarise` metrics (accuracies in %, std in percentage points).

    Raises:
        OutputError: no index in ``folder``.
    """
    from mpifl.report.tables import summarise

    if not (folder / INDEX).exists():
        raise OutputError(f"{folder}: not a sweep folder (no {INDEX}); mpifl report takes "
                          "results files or a sweep folder")
    rows = []
    for rid, run in read_index(folder)["runs"].items():
        path = folder / run["results"]
        if _results_status(path) is None:
            continue
        try:
            rows.append({"id": rid, "params": run["params"], "path": path, **summarise(path)})
        except OutputError:
            continue  # no evaluation yet
    return rows


def group_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group runs that differ only in their seed; mean and sample std (n-1) over the seeds of
    mean accuracy, std, worst 5% and best 5% (0 std for one seed). Only a group's complete runs
    count, unless none is complete yet (then its latest evaluations, marked 0/n)."""
    groups: dict[str, list] = {}
    for row in rows:
        key = json.dumps({k: v for k, v in row["params"].items() if k not in SEED_KEYS},
                         sort_keys=True)
        groups.setdefault(key, []).append(row)
    out = []
    for key, listed in groups.items():
        members = [m for m in listed if m["status"] == "complete"] or listed
        g = {"algorithm": members[0]["algorithm"], "setting": _setting(json.loads(key)),
             "seeds": len(listed), "complete": sum(m["status"] == "complete" for m in listed),
             "round": min(m["round"] for m in members), "runs": [m["path"] for m in members]}
        for metric in ("mean", "std", "worst5", "best5"):
            vals = [m[metric] for m in members]
            mu = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
            g[metric], g[metric + "_sd"] = mu, sd
        out.append(g)
    return out


def _setting(params: dict[str, Any]) -> str:
    items = [f"{k.split('.')[1]}={v}" for k, v in params.items() if k != "server.algorithm"]
    return ", ".join(items) or "-"


_COLUMNS = [("mean", "mean acc (%)"), ("std", "std (pp)"), ("worst5", "worst 5% (%)"),
            ("best5", "best 5% (%)")]


def markdown_table(groups: list[dict[str, Any]]) -> str:
    """Paper-style table: one row per algorithm and setting, mean ± std over seeds."""
    head = ["algorithm", "setting", "seeds done", "rounds"] + [label for _, label in _COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        cells = [g["algorithm"], g["setting"], f"{g['complete']}/{g['seeds']}", str(g["round"])]
        cells += [f"{g[m]:.2f} ± {g[m + '_sd']:.2f}" for m, _ in _COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(groups: list[dict[str, Any]], path: Path) -> None:
    """The table as CSV: one row per group, ``metric`` and ``metric_sd`` columns."""
    keys = ["algorithm", "setting", "seeds", "complete", "round"]
    keys += [k for m, _ in _COLUMNS for k in (m, m + "_sd")]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(groups)


def plot_curves(groups: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Mean accuracy (%) and std (pp) against rounds, averaged over seeds: ``curves.png`` with
    every algorithm and setting, and ``curves-<algorithm>.png`` with one algorithm's settings."""
    algos = list(dict.fromkeys(g["algorithm"] for g in groups))
    written = [_plot(groups, "all algorithms", folder / "curves.png",
                     lambda g: f"{g['algorithm']} {g['setting']}".removesuffix(" -"))]
    for algo in algos:
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", algo)
        written.append(_plot([g for g in groups if g["algorithm"] == algo], algo,
                             folder / f"curves-{name}.png", lambda g: g["setting"]))
    return written


def _plot(groups: list[dict[str, Any]], title: str, path: Path, label) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_std) = plt.subplots(1, 2, figsize=(11, 4))
    for g in groups:
        rounds, acc, std = _mean_curves(g["runs"])
        ax_acc.plot(rounds, acc, label=label(g))
        ax_std.plot(rounds, std, label=label(g))
    ax_acc.set(xlabel="round", ylabel="mean client accuracy (%)", title=title)
    ax_std.set(xlabel="round", ylabel="std of client accuracy (pp)", title=title)
    ax_std.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _mean_curves(paths: list[Path]):
    import numpy as np

    from mpifl.store.results import read_results

    evs = [read_results(p)["eval"] for p in paths]
    n = min(len(e["round"]) for e in evs)
    acc = np.mean([100 * e["mean"][:n] for e in evs], axis=0)
    std = np.mean([e["std"][:n] for e in evs], axis=0)
    return evs[0]["round"][:n], acc, std


def report_sweep(folder: str | Path, as_json: bool = False) -> int:
    """``mpifl report DIR``: print the table; write report.md, report.csv and curves PNGs.

    Raises:
        OutputError: not a sweep folder, or no run has an evaluation yet.
    """
    folder = Path(folder)
    groups = group_rows(collect(folder))
    if not groups:
        raise OutputError(f"{folder}: no run of this sweep has an evaluation yet")
    table = markdown_table(groups)
    (folder / "report.md").write_text(table + "\n")
    write_csv(groups, folder / "report.csv")
    pngs = plot_curves(groups, folder)
    if as_json:
        print(json.dumps([{k: v for k, v in g.items() if k != "runs"} for g in groups], indent=2))
    else:
        print(table)
        print(f"\nwritten: {folder / 'report.md'}, {folder / 'report.csv'}, "
              + ", ".join(str(p) for p in pngs))
    return 0


# ----------------------------------------------------------------------------------------------
# Command line


def add_sweep_parser(subparsers) -> None:
    """Add ``mpifl sweep`` to the ``mpifl`` command line."""
    s = subparsers.add_parser("sweep", help="submit a grid of runs (SLURM via submitit, or local)")
    s.add_argument("sweep", help="sweep file (TOML; see jobs/sweep-smoke.toml)")
    s.add_argument("--out", help="sweep folder (default runs/sweeps/<sweep.name>)")
    s.add_argument("--executor", choices=["auto", "slurm", "local"], default="auto",
                   help="slurm (sbatch via submitit), local (mpiexec here, in the foreground), "
                        "auto: slurm when sbatch is on PATH")
    s.add_argument("--wait", action="store_true", help="with slurm: wait until every job is over")
    s.add_argument("--only", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="run only the points with this value (repeatable)")
    s.add_argument("--dry-run", action="store_true",
                   help="list the runs and their status; submit nothing")
    s.add_argument("--print-args", action="store_true",
                   help="print the mpifl run arguments of each unfinished run, one per line "
                        "(the list file of slurm/mpifl-array.sbatch); submit nothing")
    s.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run ``mpifl sweep``: exit 0 when submitted (or all complete with --wait), 1 when a run
    ended without completing, 2 for a bad sweep file (one line)."""
    sweep = load_sweep(args.sweep)
    folder = Path(args.out) if args.out else Path("runs") / "sweeps" / sweep.name
    if args.dry_run or args.print_args:
        return _preview(sweep, folder, args)
    executor = args.executor
    if executor == "auto":
        executor = "slurm" if shutil.which("sbatch") else "local"
    runs = run_sweep(sweep, folder, executor=executor, wait=args.wait, only=args.only)
    print(format_runs(runs))
    print(f"index: {folder / INDEX}")
    if executor == "slurm" and not args.wait:
        return 0
    return 0 if all(r.status == "complete" for r in runs.values()) else 1


def _preview(sweep: Sweep, folder: Path, args: argparse.Namespace) -> int:
    points = select(sweep.points(), args.only)
    old = read_index(folder).get("runs", {}) if folder.exists() else {}
    runs = {}
    for p in points:
        r = RunState(p.id, p.params, list(p.overrides), f"runs/{p.id}.h5",
                     job_id=old.get(p.id, {}).get("job_id"))
        r.config, r.error = check(sweep, p)
        r.status = "invalid" if r.error else "new"
        runs[p.id] = r
    refresh(folder, runs)
    if args.print_args:
        for r in runs.values():
            if r.status in ("new", "unfinished", "failed"):
                sets = [x for o in r.overrides for x in ("--set", o)]
                print(shlex.join([str(sweep.base), "--out", str(folder / r.results), *sets]))
        return 0
    print(format_runs(runs))
    print(f"{len(runs)} runs: {_counts(r.status for r in runs.values())}")
    return 0


def format_runs(runs: dict[str, RunState]) -> str:
    """One line per run: id, status, job id, and the reason when invalid or failed."""
    width = max((len(r) for r in runs), default=2)
    lines = []
    for r in runs.values():
        note = f"  ({r.error})" if r.error and r.status != "complete" else ""
        lines.append(f"{r.id:<{width}}  {r.status:<10}  {r.job_id or '-':<10}{note}")
    return "\n".join(lines)
