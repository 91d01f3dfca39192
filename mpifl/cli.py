"""The ``mpifl`` command line: run | resume | sweep | reproduce | report | export | plot | bench | data.

A user's mistake (bad config, missing data, unwritable output, damaged results file) prints one
line ``mpifl: error: ...`` on standard error and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from mpifl.core.version import __version__
from mpifl.runtime.allocator import keep_large_blocks
from mpifl.core.errors import MpiflError


def _env_rank() -> int:
    """This process's MPI rank from the launcher's environment (before MPI is initialised)."""
    from mpifl.runtime.comm import launched_rank

    return launched_rank()


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=f"[rank {_env_rank()}] %(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S", stream=sys.stderr)


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_run(args: argparse.Namespace) -> int:
    if args.seeds is not None:
        return _run_seeds(args)
    from mpifl.experiment.run import run_experiment

    def load():  # on every rank; a failure on any rank is agreed on after MPI_Init
        from mpifl.experiment.config import load_config
        from mpifl.experiment.naming import default_out

        cfg = load_config(args.config, args.set)  # validated before any rank does work
        if args.log:  # --log adds to the job's [run] loggers
            names = list(dict.fromkeys(cfg.run.loggers + args.log))
            cfg = load_config(args.config, [*args.set, "run.loggers=" + json.dumps(names)])
        return cfg, Path(args.out) if args.out else default_out(cfg.run.name, args.set)

    mode = "resume" if args.resume else "overwrite" if args.overwrite else "new"
    return run_experiment(load, mode=mode, progress=not args.no_progress)


def _run_seeds(args: argparse.Namespace) -> int:
    """``mpifl run JOB --seeds 3`` (seeds 0, 1, 2; or a range 0-4, a list 0,2,5, one seed 5,):
    a local sweep over the seeds, then the report of exactly those seeds."""
    from mpifl.sweep.seeds import default_folder, parse_seeds, run_seeds

    if args.overwrite or args.resume:
        raise MpiflError("--seeds resumes unfinished runs and skips finished ones by itself; "
                         "drop --overwrite/--resume (or remove the folder to start over)")
    from mpifl.runtime.comm import launched_size

    if launched_size() > 1:
        raise MpiflError("--seeds starts its own runs: call it without mpiexec/srun "
                         "(--ranks N sets the MPI ranks of each run)")
    if args.ranks < 1:
        raise MpiflError(f"--ranks {args.ranks}: expected at least 1")
    seeds = parse_seeds(args.seeds)
    folder = Path(args.out) if args.out else default_folder(Path(args.config), args.set)
    runs = run_seeds(Path(args.config), args.set, seeds, folder, ranks=args.ranks)
    failed = [r.id for r in runs.values() if r.status != "complete"]
    if failed:
        raise MpiflError(f"{len(failed)} of {len(runs)} runs did not complete ({', '.join(failed)}); "
                         f"logs under {folder}/logs; run the same command again to resume them")
    from mpifl.sweep.report import report_sweep

    report_sweep(folder, last=3)
    print(f"\n{len(runs)} seeds in {folder}; again with: mpifl report {folder}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    from mpifl.experiment.run import run_experiment

    return run_experiment(lambda: (None, Path(args.run)), mode="resume", rounds=args.rounds,
                          progress=not args.no_progress)


def cmd_report(args: argparse.Namespace) -> int:
    """``mpifl report RUNS``: the table of the runs that read (a run without an evaluation yet:
    its progress); damaged results files are listed (path and reason) and make the exit status
    2 (one ``mpifl: error:`` line); a path that does not exist is one error line, before
    anything is read. ``--json``: accuracies as fractions, as in the results files."""
    from mpifl.report.tables import (JSON_UNITS, as_fractions, damaged_lines, format_table,
                                     group_by_seed, setting_labels, summarise)
    from mpifl.store.results import DamagedResults, read_many
    from mpifl.sweep.plan import INDEX

    if args.last < 1:
        raise MpiflError(f"--last {args.last}: expected at least 1 evaluation")
    if args.target is not None and not 0 < args.target <= 100:  # nan fails the test too
        raise MpiflError(f"--target {args.target}: expected a mean accuracy in percent, "
                         "above 0 and at most 100")
    missing = [p for p in args.runs if not Path(p).exists()]
    if missing:
        raise MpiflError(f"no such file: {', '.join(missing)} (mpifl report takes results "
                         "files (.h5), folders of them, or one sweep folder)")
    if len(args.runs) == 1 and (Path(args.runs[0]) / INDEX).is_file():  # one sweep folder
        from mpifl.sweep.report import report_sweep

        return report_sweep(args.runs[0], as_json=args.json, last=args.last)
    files, notes = _results_files(args.runs)
    good, damaged = read_many(files)
    if not good:  # nothing to show: the error line names them all
        raise DamagedResults(damaged)
    rows = [summarise(res["path"], args.last, res=res, target=args.target) for res in good]
    grouped = group_by_seed(rows)
    if args.json:
        def plain(table):  # the setting label instead of the whole config; fractions
            labels = setting_labels([r.get("config", {}) for r in table])
            return [{**as_fractions({k: v for k, v in r.items() if k != "config"}),
                     "setting": label} for r, label in zip(table, labels)]

        print(json.dumps({"units": JSON_UNITS, "runs": plain(rows), "over_seeds": plain(grouped),
                          "damaged": [{"path": str(d.path), "reason": d.reason}
                                      for d in damaged], "notes": notes}, indent=2))
    else:
        print(format_table(rows))
        if 0 < len(grouped) < sum(bool(r["evals"]) for r in rows):  # some differ only in seed
            print("\nover seeds (mean ± sample std):\n" + format_table(grouped))
        if damaged:
            print("\n" + "\n".join(damaged_lines(damaged)))
        for note in notes:
            print("\n" + note)
    if damaged:
        raise DamagedResults(damaged)
    return 0


def _results_files(paths: list[str]) -> tuple[list[Path], list[str]]:
    """``mpifl report A B ...``: results files as given; a sweep (or ``--seeds``) folder gives
    the results its index lists that exist (a ``--seeds`` folder: of the seeds its seeds.toml
    lists, with a note on the others), any other folder the ``*.h5`` files in it (a damaged or
    foreign one among them is named by the reader, never left out).

    Returns:
        The files, and the ``--seeds`` folders' notes on the runs they leave out.

    Raises:
        MpiflError: a folder without results.
    """
    from mpifl.store.sweep_index import listed_runs
    from mpifl.sweep.plan import INDEX

    out: list[Path] = []
    notes: list[str] = []
    for p in map(Path, paths):
        if not p.is_dir():
            out.append(p)  # summarise names a foreign file in one line
            continue
        if (p / INDEX).is_file():
            runs, note = listed_runs(p)
            found = [f for f in (p / r["results"] for r in runs.values()) if f.is_file()]
            notes += [note] if note else []
        else:
            found = sorted(f for f in p.glob("*.h5") if f.is_file())
        if not found:
            raise MpiflError(f"{p}: a folder without results files (*.h5) or sweep runs")
        out.extend(found)
    return out, notes


def cmd_reproduce(args: argparse.Namespace) -> int:
    from mpifl.sweep.reproduce import run_suites, suite_files, write_doc

    if args.last < 1:
        raise MpiflError(f"--last {args.last}: expected at least 1 evaluation")
    suites = suite_files(Path(args.suites), args.suite)
    failed = [] if args.report_only else run_suites(suites, Path(args.out), args.executor,
                                                     args.only)
    summary, damaged = write_doc(Path(args.suites), Path(args.out), Path(args.doc), suites,
                                 args.last)
    print(f"{args.doc}: {summary}")
    if damaged:  # listed in the document; counted as damaged, not as not run: one line, 2
        from mpifl.store.results import DamagedResults

        raise DamagedResults(damaged)
    if failed:
        print(f"mpifl: error: suites with runs that did not complete: {', '.join(failed)} "
              f"(their logs: {args.out}/SUITE/logs; repeat the command to resume them)",
              file=sys.stderr)
        return 1
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """``mpifl export RUNS --csv DIR | --parquet DIR``: rounds, evals and clients tables."""
    from mpifl.report.export import export

    for path in export(args.runs, Path(args.csv or args.parquet), "csv" if args.csv else "parquet"):
        print(f"wrote {path}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """``mpifl plot curves|clients RUNS --out F.png``."""
    from mpifl.report.plots import plot

    print(f"wrote {plot(args.plot, args.runs, Path(args.out))}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``mpifl bench aggregation|simulate``: a table on stdout, or one JSON object (--json)."""
    if args.bench == "simulate":
        from mpifl.bench.simulate import bench_simulate, format_simulate

        try:
            res = bench_simulate(config=args.config, overrides=args.set,
                                 clients_per_round=args.clients, batch_size=args.batch_size,
                                 epochs=args.epochs, rounds=args.rounds, model=args.model,
                                 device=args.device, threads=args.threads,
                                 progress=not args.json)
        except ValueError as exc:  # bad arguments, found before any timing
            raise MpiflError(f"bench simulate: {exc}") from None
        print(json.dumps(res) if args.json else format_simulate(res))
        return 0

    from mpifl.bench.aggregation import bench_aggregation, format_report, write_hdf5

    if args.out is not None:
        _check_bench_out(args.out)
    _load_plugins(args.plugins)
    if args.shards is not None:
        return _bench_sharded(args)
    algorithms = None if args.algorithms == "all" else args.algorithms.split(",")
    try:
        res = bench_aggregation(algorithms, args.m, args.d, tau=args.tau, repeats=args.repeats,
                                warmup=args.warmup, baseline_repeats=args.baseline_repeats,
                                device=args.device, threads=args.threads,
                                progress=not args.json)
    except ValueError as exc:  # bad arguments, found before any timing
        raise MpiflError(f"bench aggregation: {exc}") from None
    if args.out is not None:
        write_hdf5(res, args.out)
    if args.json:
        print(json.dumps(res.to_json()))
    else:
        print(format_report(res))
        if args.out is not None:
            print(f"wrote {args.out}")
    return 0


def _bench_sharded(args: argparse.Namespace) -> int:
    """``mpiexec -n P python -m mpifl bench aggregation --shards P``: every rank one shard; rank 0
    prints and writes."""
    from mpifl.bench.sharded import bench_sharded, format_sharded, write_sharded_hdf5
    from mpifl.runtime.comm import world

    comm = world()
    size = 1 if comm is None else comm.Get_size()
    if args.shards != size:
        raise MpiflError(f"bench aggregation: --shards {args.shards} runs one shard per MPI "
                         f"rank: start it with mpiexec -n {args.shards} (this is {size} "
                         f"process{'es' if size > 1 else ''})")
    if args.device != "cpu":
        raise MpiflError("bench aggregation: --shards times the CPU path only (--device cpu)")
    algorithms = ("fedavg,fedfv,fedlf,mfairfl" if args.algorithms == "all"
                  else args.algorithms).split(",")
    try:
        res = bench_sharded(comm if size > 1 else None, algorithms, args.m, args.d,
                            tau=args.tau, repeats=args.repeats, warmup=args.warmup,
                            threads=args.threads, progress=not args.json)
    except (ValueError, KeyError) as exc:  # bad arguments, found before any timing
        raise MpiflError(f"bench aggregation: {str(exc).strip(chr(39))}") from None
    if comm is not None and comm.Get_rank() != 0:
        return 0
    if args.out is not None:
        write_sharded_hdf5(res, args.out)
    print(json.dumps(res.to_json()) if args.json else format_sharded(res))
    if args.out is not None and not args.json:
        print(f"wrote {args.out}")
    return 0


def _load_plugins(modules: str | None) -> None:
    """``--plugins a,b``: import users' modules (from the working directory or sys.path) so their
    rules are benchmarked with the built-in ones; entry-point plugins always load."""
    from mpifl.core.plugins import PluginError, load_modules

    try:
        load_modules(modules.split(",") if modules else [], [str(Path.cwd())])
    except PluginError as exc:
        raise MpiflError(f"--plugins: {exc}") from None


def _check_bench_out(path: str) -> None:
    """Refuse, before any timing, an output whose folder is missing or not writable."""
    folder = Path(path).resolve().parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise MpiflError(f"bench aggregation: cannot write {path}: folder {folder} does not "
                         f"exist or is not writable")


def cmd_check(args: argparse.Namespace) -> int:
    """``mpifl check RULE``: does the rule resume exactly from its state_dict()? 0 yes, 1 no,
    2 bad arguments, 5 (:data:`EXIT_CHECK_NOT_RUN`) the check could not run (the rule raised)."""
    from mpifl.bench.statecheck import check_rounds, check_rule_state
    from mpifl.core.errors import EXIT_CHECK_NOT_RUN

    try:  # before any plugin is imported or any round is made
        check_rounds(args.rounds, args.split)
    except ValueError as exc:
        raise MpiflError(f"check: {exc}") from None
    _load_plugins(args.plugins)
    names = args.rules.split(",")
    params = _check_params(names, args.set)
    verdicts = []
    for name in names:
        res = check_rule_state(name, rounds=args.rounds, split=args.split, params=params)
        if res.error:  # no verdict: the rule raised
            print(f"mpifl: error: check: {res.line()}", file=sys.stderr)
        else:
            print(res.line())
        verdicts.append(EXIT_CHECK_NOT_RUN if res.error else int(not res.ok))
    return max(verdicts)


def _check_params(names: list[str], items: list[str]) -> dict:
    """``mpifl check --set KEY=VALUE``: the rules' own keys, values read as ``mpifl run``'s
    ``--set`` values, validated by every rule named.

    Raises:
        MpiflError: a malformed item, an unknown rule, or a key or value a rule refuses.
    """
    from mpifl.aggregators import rule as rule_class
    from mpifl.experiment.config import parse_override

    params = {}
    for item in items:
        key = item.partition("=")[0].strip()
        if "=" not in item or not key:
            raise MpiflError(f"check: --set {item!r}: expected KEY=VALUE, a key of the rule's "
                             f"table, e.g. --set tau=2")
        (_, key), value = parse_override(f"rule.{item}")
        params[key] = value
    for name in names:
        try:
            rule_class(name).validate_params(params)
        except LookupError as exc:  # UnknownName: unknown rule or import path
            raise MpiflError(f"check: {exc}") from None
        except (TypeError, ValueError) as exc:  # an unknown key; a value refused (pydantic)
            first = (str(exc).splitlines() or [""])[0]
            raise MpiflError(f"check: {first}") from None
    return params


def cmd_data_fetch(args: argparse.Namespace) -> int:
    from mpifl.data.fetch import fetch_dataset

    path = fetch_dataset(args.name, args.root)
    print(f"{args.name}: files verified in {path}")
    return 0


def build_parser(run_only: bool = False) -> argparse.ArgumentParser:
    """The ``mpifl`` parser; ``run_only``: with the ``run`` command alone, which imports
    nothing heavy (the others' parsers import torch, through the sweep and store modules)."""
    p = argparse.ArgumentParser(prog="mpifl", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"mpifl {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run an experiment (under mpiexec/srun for several ranks)")
    r.add_argument("config", help="TOML experiment file (see jobs/)")
    r.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value; lists as [0,1]; repeatable")
    r.add_argument("--out", help="results file (default runs/<run.name>.h5, or "
                                 "runs/<run.name>_<values set>.h5 with --set)")
    how = r.add_mutually_exclusive_group()
    how.add_argument("--overwrite", action="store_true",
                     help="replace an existing results file and its checkpoints")
    how.add_argument("--resume", action="store_true",
                     help="continue from the newest valid checkpoint if there is one, else start")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--seeds", metavar="SEEDS",
                   help="run once per seed as a local sweep: N runs N seeds 0..N-1 (3: seeds "
                        "0, 1, 2); a range 0-4 or a list 0,2,5 runs those seeds (one given "
                        "seed: 5, with its comma; a single run: --set run.seed=5 without "
                        "--seeds); --out is then its folder (default runs/sweeps/<name>-seeds); "
                        "prints mean ± std over exactly these seeds")
    r.add_argument("--ranks", type=int, default=1,
                   help="with --seeds: MPI ranks of each run (default 1)")
    r.add_argument("--log", action="append", default=[], metavar="LOGGER",
                   help="live logger on rank 0: csv, tensorboard or wandb (repeatable; adds to "
                        "the job's [run] loggers)")
    r.set_defaults(func=cmd_run)
    if run_only:
        return p

    res = sub.add_parser("resume", help="continue a run from its newest valid checkpoint")
    res.add_argument("run", help="results file of the run (its checkpoints are in RUN.h5.ckpt/)")
    res.add_argument("--rounds", type=int, help="extend the run to this many rounds")
    res.add_argument("--no-progress", action="store_true", help="no progress bar")
    res.set_defaults(func=cmd_resume)

    from mpifl.sweep.cli import add_sweep_parser

    add_sweep_parser(sub)

    rep = sub.add_parser("report", help="fairness table of runs; seeds averaged (mean ± std)")
    rep.add_argument("runs", nargs="+", help="results files (.h5), or one sweep folder")
    rep.add_argument("--last", type=int, default=3, metavar="K",
                     help="average each run's last K evaluations (default 3)")
    rep.add_argument("--json", action="store_true",
                     help="print JSON instead of a table: accuracies, std, worst/best 5%% and "
                          "cf as fractions in [0, 1], as in the results files (the table: "
                          "percent and percentage points)")
    rep.add_argument("--target", type=float, metavar="PCT",
                     help="for runs on simulated time ([system]): the simulated hours until "
                          "the mean accuracy first reached PCT percent")
    rep.set_defaults(func=cmd_report)

    rp = sub.add_parser("reproduce", help="run the papers' reproduction suites (jobs/repro) "
                                          "and write docs/REPRODUCTIONS.md from their results")
    rp.add_argument("suite", nargs="*", help="suites to run (default: all in --suites)")
    rp.add_argument("--suites", default="jobs/repro", metavar="DIR",
                    help="folder of suite sweep files and figures.toml (default jobs/repro)")
    rp.add_argument("--out", default="runs/repro", metavar="DIR",
                    help="results: one sweep folder per suite (default runs/repro)")
    rp.add_argument("--doc", default="docs/REPRODUCTIONS.md", help="the document to write")
    rp.add_argument("--executor", choices=["auto", "slurm", "local"], default="local",
                    help="local (default: here, in the foreground), slurm (submitit; waits), "
                         "auto: slurm when sbatch is on PATH and a controller answers, "
                         "else local")
    rp.add_argument("--only", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="run only the points with this value (repeatable; e.g. run.seed=0)")
    rp.add_argument("--report-only", action="store_true",
                    help="run nothing; write the document from the finished runs")
    rp.add_argument("--last", type=int, default=3, metavar="K",
                    help="average each run's last K evaluations (default 3)")
    rp.set_defaults(func=cmd_reproduce)

    ex = sub.add_parser("export", help="results as long-form tables (CSV or Parquet) for pandas, "
                                       "R, spreadsheets")
    ex.add_argument("runs", nargs="+", help="results files (.h5), or one sweep folder")
    fmt = ex.add_mutually_exclusive_group(required=True)
    fmt.add_argument("--csv", metavar="DIR", help="write DIR/{rounds,evals,clients}.csv")
    fmt.add_argument("--parquet", metavar="DIR", help="write DIR/{rounds,evals,clients}.parquet "
                                                      "(pip install 'mpifl[parquet]')")
    ex.set_defaults(func=cmd_export)

    pl = sub.add_parser("plot", help="figures of runs (PNG; pip install 'mpifl[plot]')")
    pl.add_argument("plot", choices=["curves", "clients", "time"],
                    help="curves: mean, worst-5%% accuracy and std over rounds (mean ± std band "
                         "over seeds); clients: each client's final accuracy, per algorithm; "
                         "time: accuracy against simulated hours (runs with [system])")
    pl.add_argument("runs", nargs="+", help="results files (.h5), or one sweep folder")
    pl.add_argument("--out", required=True, help="PNG file to write")
    pl.set_defaults(func=cmd_plot)

    b = sub.add_parser("bench", help="benchmarks that print ratios against a baseline")
    bsub = b.add_subparsers(dest="bench", required=True)
    ba = bsub.add_parser("aggregation", help="aggregate() time of every rule over m, d, tau; "
                                             "FedFV Gram form vs direct form")
    ba.add_argument("--algorithms", default="all",
                    help="comma-separated registered names, or all (default)")
    ba.add_argument("--m", type=_csv_ints, default=[10, 60, 200], help="clients per round, e.g. 10,60,200")
    ba.add_argument("--d", type=_csv_ints, default=[199210],
                    help="model size(s), e.g. 10000,199210 (default: MLP 200-200 on FMNIST)")
    ba.add_argument("--tau", type=_csv_ints, default=[1],
                    help="history length(s) for rules that take tau (default 1)")
    ba.add_argument("--repeats", type=int, default=5, help="timed calls per case (median)")
    ba.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    ba.add_argument("--baseline-repeats", type=int, default=None,
                    help="timed calls of the slow direct FedFV (default: --repeats; 0: not run, "
                         "for m where it would take hours)")
    ba.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ba.add_argument("--threads", type=int, help="torch and BLAS threads (default: their own choice)")
    ba.add_argument("--out", help="also write the results to this HDF5 file (replaced)")
    ba.add_argument("--json", action="store_true", help="print one JSON object")
    ba.add_argument("--shards", type=int, metavar="P",
                    help="the sharded server's aggregation under mpiexec -n P, one shard per "
                         "rank: time split, peak memory per rank, difference from P = 1 "
                         "(default algorithms: fedavg,fedfv,fedlf,mfairfl)")
    ba.add_argument("--plugins", metavar="MODULE[,MODULE]",
                    help="import these plugin modules first, so their rules are benchmarked too")
    ba.set_defaults(func=cmd_bench)

    bs = bsub.add_parser("simulate", help="local training: vectorised trainer vs per-client "
                                          "sequential loop, same workload, same run")
    bs.add_argument("--config", help="TOML experiment file for data, model and client settings "
                                     "(default: jobs/fmnist-fedfv.toml's)")
    bs.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value; repeatable")
    bs.add_argument("--clients", type=int, default=100, help="clients per round (default 100)")
    bs.add_argument("--batch-size", type=int, default=None, help="B (default: the config's, 50)")
    bs.add_argument("--epochs", type=int, default=None, help="E (default: the config's, 1)")
    bs.add_argument("--rounds", type=int, default=3, help="timed rounds per path (default 3)")
    bs.add_argument("--model", default=None, help="model name (default: the config's, mlp)")
    bs.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    bs.add_argument("--threads", type=int, help="torch and BLAS threads (default: their own choice)")
    bs.add_argument("--json", action="store_true", help="print one JSON object")
    bs.set_defaults(func=cmd_bench)

    c = sub.add_parser("check", help="does a rule resume exactly from its state_dict()? "
                                     "(exit 0 yes; 1 no: the state it keeps undeclared is named; "
                                     "2 bad arguments; 5 the check could not run: the rule "
                                     "raised, named in one line)")
    c.add_argument("rules", help="rule name(s), comma-separated, or 'pkg.module:Class'")
    c.add_argument("--plugins", metavar="MODULE[,MODULE]", help="import these modules first")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a hyper-parameter of the rule (its table's key); repeatable")
    c.add_argument("--rounds", type=int, default=6, help="rounds run, 2 to 10,000 (default 6)")
    c.add_argument("--split", type=int, default=3,
                   help="the state moves to a fresh instance after this round, 1 to "
                        "rounds - 1 (default 3)")
    c.set_defaults(func=cmd_check)

    d = sub.add_parser("data", help="data sets: download and verify their official files")
    dsub = d.add_subparsers(dest="data", required=True)
    f = dsub.add_parser("fetch", help="download a dataset's official files and verify checksums")
    from mpifl.data.fetch import FETCHABLE

    f.add_argument("name", choices=list(FETCHABLE), help="the data set to download")
    f.add_argument("--root", help="target folder (default ~/.cache/mpifl/data)")
    f.set_defaults(func=cmd_data_fetch)
    return p


def _precheck_run(argv: list[str]) -> None:
    """``mpifl run JOB``: refuse a job with an unknown key, table or name before anything
    imports torch (:mod:`mpifl.experiment.precheck`; the full validation stays the authority).
    Every rank reads the same file and reaches the same verdict, so a typo ends every rank in
    well under a second instead of after each has imported torch."""
    words = list(argv)
    while words[:1] in (["-v"], ["--verbose"]):
        words = words[1:]
    if words[:1] != ["run"] or "torch" in sys.modules or "mpifl.runtime.loggers" in sys.modules:
        # main() called from Python (a notebook, a test) with the registries imported (all but
        # the loggers' import torch): they may hold entries of that process's own, which
        # keys.json does not list, and the full validation is as quick there
        return
    args = build_parser(run_only=True).parse_args(argv)  # the full parser's errors, sooner
    from mpifl.experiment.precheck import check_job

    # --seeds runs without the --log loggers, so they are not the job's there
    check_job(args.config, args.set, args.log if args.seeds is None else [])


def _failed(exc: MpiflError) -> int:
    """Print ``exc`` as one line (rank 0 only) and give its exit status."""
    if _env_rank() == 0:
        label = getattr(exc, "label", "error")  # "stopped" for a signal during set-up
        print(f"mpifl: {label}: " + " ".join(str(exc).split()), file=sys.stderr)  # one line
    return exc.exit_status


def main(argv: list[str] | None = None) -> int:
    try:
        _precheck_run(sys.argv[1:] if argv is None else argv)
    except MpiflError as exc:
        return _failed(exc)
    try:
        args = build_parser().parse_args(argv)  # imports torch (the sweep and store commands)
    except KeyboardInterrupt:
        print("mpifl: interrupted", file=sys.stderr)
        return 130
    _setup_logging(args.verbose)
    keep_large_blocks()  # before the first big tensor: per-step buffers then reuse the heap
    try:
        status = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that left (| head) is seen here
        return status
    except BrokenPipeError:
        # the reader of our output stopped (`mpifl sweep F --dry-run | head`): end quietly, with
        # the status of a process ended by SIGPIPE (128 + 13), as a shell reports it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except MpiflError as exc:
        return _failed(exc)
    except KeyboardInterrupt:
        print("mpifl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
