"""The torch-free pre-check of ``mpifl run JOB`` (mpifl/experiment/precheck.py): it refuses an
unknown key, table or name with the very line the full validation (``load_config``) gives,
without importing torch; it passes every shipped job; it leaves what it cannot decide (types,
import paths, plugins, malformed ``--set``) to the full validation; and its keys.json is what
the models and the registries say.

The full validation's lines come from one fresh process (``reference``): the registries of this
process may hold the plugin entries other tests register, which the full validation would list
among the known names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mpifl.core.errors import ConfigError
from mpifl.experiment.precheck import KEYS, WRITE_COMMAND, check_job

ROOT = Path(__file__).resolve().parents[2]

JOB = """
[run]
name = "precheck"
rounds = 3
loggers = ["csv"]
[data]
dataset = "fashion_mnist"
partition = "dirichlet"
dirichlet_alpha = 0.5           # an old flat key, moved into partition_params: valid
num_clients = 10
[model]
name = "mlp"
hidden = [16]
loss = "cross_entropy"
[client]
lr = 0.1
[server]
algorithm = "fedfv"
clients_per_round = 4
[fedfv]
alpha = 0.1
tau = 1
"""


def edited(old: str, new: str) -> str:
    """:data:`JOB` with one line replaced (the line must be there)."""
    assert old in JOB
    return JOB.replace(old, new, 1)


#: name -> (job text, --set items, --log loggers): one mistake each, certainly wrong
REFUSED = {
    "key in the file": (edited("rounds = 3", "roudns = 3"), [], []),
    "key of a rule's table": (edited("tau = 1", "tua = 1"), [], []),
    "key beside old flat keys": (edited("num_clients = 10", "num_clientz = 10"), [], []),
    "table in the file": (edited("[fedfv]", "[fedvf]"), [], []),
    "plugins key": (JOB + "[plugins]\nmodule = ['x']\n", [], []),
    "two unknown keys": (edited("rounds = 3", "seeed = 1\nroudns = 3") + "[fedvf]\n", [], []),
    "rule name": (edited('algorithm = "fedfv"', 'algorithm = "fedvf"'), [], []),
    "model name": (edited('name = "mlp"', 'name = "mpl"'), [], []),
    "loss name": (edited('loss = "cross_entropy"', 'loss = "cross_entropi"'), [], []),
    "data set name": (edited('dataset = "fashion_mnist"', 'dataset = "fashion_mnits"'), [], []),
    "partition name": (edited('partition = "dirichlet"', 'partition = "dirichlett"'), [], []),
    "logger name": (edited('loggers = ["csv"]', 'loggers = ["cvs"]'), [], []),
    "--set key": (JOB, ["server.algoritm=fedfv"], []),
    "--set table": (JOB, ["fedvf.tau=3"], []),
    "--set nested key": (JOB, ["run.rounds=4", "model.parms.width=3"], []),
    "--set rule name": (JOB, ["server.algorithm=fedvf"], []),
    "--set quoted model name": (JOB, ['model.name="mpl"'], []),
    "--set data set name": (JOB, ["data.dataset=fmnist"], []),
    "--log logger": (JOB, [], ["cvs"]),
}

#: mistakes the pre-check cannot be sure of, and valid jobs it must not refuse
LEFT = {
    "wrong type": (edited("rounds = 3", 'rounds = "three"'), [], []),
    "value out of range": (edited("lr = 0.1", "lr = -1.0"), [], []),
    "import path": (edited('name = "mlp"', 'name = "no_such_pkg.models:mlp"'), [], []),
    "import path, then a typo": (edited('name = "mlp"', 'name = "no_such_pkg.m:mlp"')
                                 .replace('loss = "cross_entropy"', 'loss = "cross_entropi"'),
                                 [], []),
    "key of a data set's table": (JOB + "[data.params]\nwidht = 3\n", [], []),
    "malformed --set": (JOB, ["rounds=3"], []),
    "--set through a value": (JOB, ["run.rounds.x=3"], []),
    "loop trainer, then a logger typo": (edited("lr = 0.1", 'lr = 0.1\ntrainer = "loop"')
                                         .replace('["csv"]', '["cvs"]'), [], []),
    "valid": (JOB, ["server.algorithm=fedavg", "data.partition_params.alpha=0.5"], ["csv"]),
}


def write_jobs(folder: Path, cases: dict) -> dict[str, tuple[str, list[str], list[str]]]:
    """Each case's job file in ``folder``: name -> (path, --set, --log)."""
    out = {}
    for i, (name, (text, sets, logs)) in enumerate(cases.items()):
        path = folder / f"job{i}.toml"
        path.write_text(text)
        out[name] = (str(path), sets, logs)
    return out


#: In a fresh process: keys.json's content as generated now, and load_config's line for each
#: job (--log added to run.loggers as `mpifl run` adds it), or None where it accepts the job.
REFERENCE = """
import json, sys
from mpifl.experiment.precheck import describe
keys = describe()  # before load_config imports the plugin job's modules
from mpifl.core.errors import ConfigError
from mpifl.experiment.config import load_config

def verdict(path, sets, logs):
    try:
        cfg = load_config(path, sets)
        if logs:
            names = json.dumps(list(dict.fromkeys([*cfg.run.loggers, *logs])))
            load_config(path, [*sets, "run.loggers=" + names])
    except ConfigError as exc:
        return str(exc)
    return None

jobs = json.load(sys.stdin)
print(json.dumps({"keys": keys, "lines": {k: verdict(*v) for k, v in jobs.items()}}))
"""


def fresh_python(code: str, stdin: str = "") -> str:
    """stdout of ``python -c code`` in a fresh process on this checkout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("precheck")
    plugin = ROOT / "examples" / "plugin" / "job.toml"
    return {**write_jobs(folder, {**REFUSED, **LEFT}),
            "plugins": (str(plugin), [], []), "plugins, a typo": (str(plugin), ["run.roudns=1"], [])}


@pytest.fixture(scope="module")
def reference(jobs):
    return json.loads(fresh_python(REFERENCE, json.dumps(jobs)))


def precheck_line(path: str, sets: list[str], logs: list[str]) -> str | None:
    try:
        check_job(path, sets, logs)
    except ConfigError as exc:
        return str(exc)
    return None


def test_keys_json_is_what_the_models_and_registries_say(reference):
    committed = json.loads(KEYS.read_text(encoding="utf-8"))
    assert committed == reference["keys"], f"{KEYS} is out of date: run {WRITE_COMMAND}"


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_certain_mistake_is_refused_with_the_full_validations_line(case, jobs, reference):
    line = reference["lines"][case]
    assert line is not None, f"load_config accepts {case!r}: not a mistake"
    assert precheck_line(*jobs[case]) == line


@pytest.mark.parametrize("case", list(LEFT))
def test_what_it_cannot_decide_is_left_to_the_full_validation(case, jobs, reference):
    assert precheck_line(*jobs[case]) is None
    if case != "valid":  # each is a real mistake, which the full validation reports
        assert reference["lines"][case] is not None
    else:
        assert reference["lines"][case] is None


def test_a_job_with_plugins_is_left_to_the_full_validation(jobs, reference):
    """The plugin's rule, data set and model are unknown to keys.json, and a plugin may
    register anything: no verdict, even on a typo, which the full validation then reports."""
    assert reference["lines"]["plugins"] is None
    assert precheck_line(*jobs["plugins"]) is None
    assert reference["lines"]["plugins, a typo"] is not None
    assert precheck_line(*jobs["plugins, a typo"]) is None


def shipped_run_jobs() -> list[Path]:
    """jobs/*.toml and examples/**/*.toml that are run jobs (not sweeps), without plugins."""
    found = []
    for path in sorted([*ROOT.glob("jobs/*.toml"), *ROOT.glob("examples/**/*.toml")]):
        raw = tomllib.loads(path.read_text())
        if "sweep" not in raw and not raw.get("plugins", {}).get("modules"):
            found.append(path)
    return found


def test_every_shipped_job_passes_and_would_be_checked():
    jobs = shipped_run_jobs()
    assert len(jobs) >= 10
    for path in jobs:
        assert precheck_line(str(path), [], []) is None, path
        # the same job with one typo is refused: it was looked at, not passed for lack of a verdict
        assert precheck_line(str(path), ["run.roudns=1"], []) is not None, path


def test_a_refusal_imports_neither_torch_nor_pydantic(jobs, reference):
    """In a fresh process: the pre-check alone, and the command line (``mpifl run``), end on
    the typo before torch or pydantic is imported."""
    path, _, _ = jobs["key in the file"]
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from mpifl.core.errors import ConfigError
        from mpifl.experiment.precheck import check_job
        try:
            check_job({path!r})
            line = None
        except ConfigError as exc:
            line = str(exc)
        heavy = [m for m in ("torch", "pydantic") if m in sys.modules]
        from mpifl.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = main(["run", {path!r}, "--out", "unused.h5"])
        print(json.dumps({{"line": line, "heavy": heavy, "status": status,
                          "stderr": err.getvalue(),
                          "heavy_after_cli": [m for m in ("torch", "pydantic")
                                              if m in sys.modules]}}))
    """)
    out = json.loads(fresh_python(code))
    assert out["line"] == reference["lines"]["key in the file"]
    assert out["heavy"] == [] and out["heavy_after_cli"] == []
    assert out["status"] == 2
    assert out["stderr"] == f"mpifl: error: {out['line']}\n"
