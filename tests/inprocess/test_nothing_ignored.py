"""Nothing a user sets is ignored, and every mistake ends in one line with the right status,
through the real command line (``python -m mpifl`` in a subprocess): data roots that do not
exist or lack the files, ``--set`` keys that match nothing or are malformed (and nested keys,
``model.params.width=32``, that work), ``mpifl check``'s bounds and its status for a rule that
raises, a loss that does not depend on the model's output, a loss that is not callable, a TOML
value nested thousands deep, local BatchNorm on a model without BatchNorm.

One mistake of each kind runs as a real process (two at a time; they end at set-up), the
others through the same ``mpifl.cli.main`` in the test process, to keep the file fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import pytest

from mpifl.cli import main
from mpifl.core.errors import EXIT_BAD_INPUT, EXIT_CHECK_NOT_RUN
from mpifl.experiment.config import load_config, parse_override
from tests.helpers import small_fmnist_job, write_fmnist_job

pytestmark = pytest.mark.slow  # whole runs in every module fixture: left out of make check

ROOT = Path(__file__).resolve().parents[2]

PARTS = '''
import math

import torch
import torch.nn.functional as F
from torch import nn


def wide_mlp(input_shape, num_classes, *, seed, width=8):
    """784 -> width -> C: a model whose [model.params] key decides its size."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(),
                         nn.Linear(width, num_classes))


def constant(out, y):        # never looks at the output
    return torch.ones(out.shape[0])


def detached(out, y):        # looks at it, but cuts the gradient
    return F.cross_entropy(out.detach(), y, reduction="none")


def times_zero(out, y):      # depends on it only through a zero factor
    return (0.0 * out).sum(dim=1) + 1.0


NOT_A_FUNCTION = 3
'''

#: a rule registered only in the subprocess that checks it (the test session's registry stays
#: as it is for the tests that run every registered rule)
RULES = '''
from mpifl.plugin import Aggregator, register_rule


@register_rule("raising_rule")
class RaisingRule(Aggregator):
    """Aggregates two rounds, then raises: the state check cannot give a verdict."""

    def aggregate(self, r):
        if r.round >= 2:
            raise RuntimeError("lost its way")
        return r.updates.mean(dim=0)
'''


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """The tiny job, the plugin module beside it, an empty data root and a deep TOML file."""
    job = write_fmnist_job(tmp_path_factory, "tiny.toml", small_fmnist_job(
        "tiny", seed=0, rounds=1, eval_every=1, checkpoint_every=0,
        partition='partition = "shards"', algorithm="fedavg"))
    folder = job.parent
    (folder / "ni_parts.py").write_text(PARTS)
    (folder / "ni_rules.py").write_text(RULES)
    empty = folder / "empty_root"
    (empty / "fashion-mnist").mkdir(parents=True)
    (empty / "fashion-mnist" / "train-images-idx3-ubyte").write_bytes(b"")
    deep = folder / "deep.toml"
    deep.write_text(job.read_text() + "\n[faults]\nnan_clients = " + "[" * 5000 + "]" * 5000 + "\n")
    sweep = folder / "sweep.toml"
    sweep.write_text(f"[sweep]\nbase = '{job.name}'\n[grid]\nseed = [0, 1]\n")
    return folder


def _env(folder: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MPIFL_DATA"}
    return {**env, "PYTHONPATH": f"{folder}:{ROOT}", "OMP_NUM_THREADS": "1", **extra}


def _run(folder: Path, name: str, args: list[str], env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    out = folder / "out" / name
    out.mkdir(parents=True, exist_ok=True)
    argv = [a.format(dir=folder, out=out) for a in args]
    return subprocess.run([sys.executable, "-m", "mpifl", *argv], capture_output=True,
                          text=True, cwd=folder, env=_env(folder, **(env or {})), timeout=300)


RUN = ["run", "{dir}/tiny.toml", "--out", "{out}/run.h5", "--no-progress"]

#: name -> (argv, extra environment, exit status, what the one line must say)
CASES = {
    # data roots: named, so never a fall-back to another root
    "data_root missing": ([*RUN, "--set", "data.data_root={dir}/nowhere"], {}, 2,
                          "data.data_root is {dir}/nowhere, which does not exist"),
    "MPIFL_DATA missing": (RUN, {"MPIFL_DATA": "{dir}/gone"}, 2,
                           "$MPIFL_DATA is {dir}/gone, which does not exist"),
    "data_root lacks files": ([*RUN, "--set", "data.data_root={dir}/empty_root"], {}, 2,
                              "{dir}/empty_root/fashion-mnist lacks train-labels-idx1-ubyte"),
    # --set keys that match nothing, or malformed
    "bare key": ([*RUN, "--set", "nonsense=1"], {}, 2,
                 "--set 'nonsense=1': expected section.key=value; 'nonsense' is not a key"),
    "bare known key": ([*RUN, "--set", "rounds=3"], {}, 2, "did you mean 'run.rounds=3'?"),
    "no value": ([*RUN, "--set", "model.params.width"], {}, 2,
                 "expected section.key=value (a key of a nested table: section.table.key=value)"),
    "value not a table": ([*RUN, "--set", "run.rounds.x=1"], {}, 2,
                          "'run.rounds' is a value, not a table; set it as run.rounds=VALUE"),
    "model.params unknown": ([*RUN, "--set", "model.params.width=32"], {}, 2,
                             "unknown key 'model.params.width': model 'mlp' takes no parameter "
                             "'width' (its parameters: hidden)"),
    "model.params typo": ([*RUN, "--set", "model.name=ni_parts:wide_mlp",
                           "--set", "model.params.widht=32"], {}, 2,
                          "unknown key 'model.params.widht' (did you mean 'model.params.width'?)"),
    "sweep bare key": (["sweep", "{dir}/sweep.toml", "--dry-run", "--out", "{out}"], {}, 2,
                       "[grid] key 'seed': expected \"section.key\"; 'seed' is not a key (did "
                       "you mean 'run.seed=VALUE'?)"),
    # the loss, the TOML file, BatchNorm
    "loss constant": ([*RUN, "--set", "model.loss=ni_parts:constant"], {}, 2,
                      "model.loss: 'ni_parts:constant' does not depend on the model's output"),
    "loss detached": ([*RUN, "--set", "model.loss=ni_parts:detached"], {}, 2,
                      "model.loss: 'ni_parts:detached' does not depend on the model's output"),
    "loss times zero": ([*RUN, "--set", "model.loss=ni_parts:times_zero"], {}, 2,
                        "model.loss: 'ni_parts:times_zero' does not depend on the model's output"),
    "loss not callable": ([*RUN, "--set", "model.loss=ni_parts:NOT_A_FUNCTION"], {}, 2,
                          "model.loss: 'ni_parts:NOT_A_FUNCTION' is not callable"),
    "toml deep": (["run", "{dir}/deep.toml", "--out", "{out}/run.h5"], {}, 2,
                  "{dir}/deep.toml: a value nested too deeply"),
    "batchnorm local": ([*RUN, "--set", "model.batchnorm=local"], {}, 2,
                        "model.batchnorm = 'local': the model has no BatchNorm layers"),
    "batchnorm local_stats": ([*RUN, "--set", "model.batchnorm=local_stats"], {}, 2,
                              "model.batchnorm = 'local_stats': the model has no BatchNorm"),
    # mpifl check: bounds up front, and a rule that raises
    "check rounds 0": (["check", "fedavg", "--rounds", "0"], {}, 2,
                       "check: --rounds 0: expected 2 to 10,000"),
    "check rounds -3": (["check", "fedavg", "--rounds", "-3"], {}, 2,
                        "check: --rounds -3: expected 2 to 10,000"),
    "check rounds huge": (["check", "fedavg", "--rounds", "99999999999"], {}, 2,
                          "check: --rounds 99999999999: expected 2 to 10,000"),
    "check split 10": (["check", "fedavg", "--split", "10"], {}, 2,
                       "check: --split 10: expected 1 to 5"),
    "check split -1": (["check", "fedavg", "--split", "-1"], {}, 2,
                       "check: --split -1: expected 1 to 5"),
    "check unknown key": (["check", "fedavg", "--set", "nonsense=1"], {}, 2,
                          "check: fedavg: unknown parameter 'nonsense'"),
    "check no value": (["check", "fedavg", "--set", "tau"], {}, 2,
                       "check: --set 'tau': expected KEY=VALUE"),
    "check rule raises": (["check", "fedavg,raising_rule", "--plugins", "ni_rules"], {}, 5,
                          "check: raising_rule: the check could not run: RuntimeError: lost its "
                          "way"),
}


#: the cases run as real processes (``python -m mpifl``), one of each kind of mistake; the
#: others go through the same ``main()`` in this process (a process costs seconds of imports)
PROCESSES = ("data_root missing", "bare key", "loss constant", "toml deep", "check rounds huge",
             "check rule raises")


@pytest.fixture(scope="module")
def processes(setting):
    """The :data:`PROCESSES` cases' processes, run two at a time (they end at set-up)."""
    def one(name):
        args, env, _, _ = CASES[name]
        env = {k: v.format(dir=setting) for k, v in env.items()}
        return name, _run(setting, _folder(name), args, env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(one, PROCESSES))


def _folder(name: str) -> str:
    return name.replace(" ", "_")


@pytest.mark.parametrize("name", PROCESSES)
def test_a_real_process_ends_in_one_line_with_the_right_status(name, processes, setting):
    _, _, status, message = CASES[name]
    proc = processes[name]
    assert proc.returncode == status, proc.stderr[-2000:]
    _assert_one_line(proc.stderr, message.format(dir=setting), setting / "out" / _folder(name))


@pytest.mark.parametrize("name", [n for n in CASES if n not in PROCESSES and
                                  CASES[n][0][0] != "check"])
def test_each_mistake_ends_in_one_line_with_status_2(name, setting, capsys, monkeypatch):
    args, env, status, message = CASES[name]
    out = setting / "out" / _folder(name)
    out.mkdir(parents=True, exist_ok=True)
    monkeypatch.delenv("MPIFL_DATA", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(dir=setting))
    monkeypatch.syspath_prepend(str(setting))
    monkeypatch.chdir(setting)
    assert main([a.format(dir=setting, out=out) for a in args]) == status
    _assert_one_line(capsys.readouterr().err, message.format(dir=setting), out)


@pytest.mark.parametrize("name", [n for n in CASES if n not in PROCESSES and
                                  CASES[n][0][0] == "check"])
def test_check_refuses_bad_arguments_before_any_round(name, capsys):
    args, _, status, message = CASES[name]
    assert main(args) == status
    _assert_one_line(capsys.readouterr().err, message, None)


def _assert_one_line(err: str, message: str, out: Path | None) -> None:
    """One ``mpifl: error:`` line saying ``message``, no traceback, nothing written."""
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("mpifl: error:")]
    assert len(lines) == 1, err[-2000:]
    assert message in lines[0], lines[0]
    assert not any("error" in line.lower() for line in err.splitlines() if line not in lines)
    if out is not None:
        assert not list(out.rglob("*.h5")), "nothing may be written"


def test_check_statuses_are_distinct_and_the_verdicts_still_print(processes):
    proc = processes["check rule raises"]
    assert EXIT_CHECK_NOT_RUN not in (0, 1, EXIT_BAD_INPUT, 3, 4)  # 3 checkpointed, 4 peer lost
    assert proc.stdout.startswith("fedavg: resumes exactly from state_dict()"), proc.stdout


def test_nested_set_keys_reach_the_model(setting, monkeypatch):
    """``--set model.params.width=32`` sets the factory's keyword: the stored config has it and
    the trained model has the width (784*32 + 32 + 32*10 + 10 parameters)."""
    monkeypatch.syspath_prepend(str(setting))
    out = setting / "out" / "nested"
    assert main(["run", str(setting / "tiny.toml"), "--out", str(out / "run.h5"),
                 "--no-progress", "--set", "model.name=ni_parts:wide_mlp",
                 "--set", "model.params.width=32"]) == 0
    with h5py.File(out / "run.h5", "r") as f:
        assert json.loads(f.attrs["config"])["model"]["params"] == {"width": 32}
        assert f["model/global"].shape == (784 * 32 + 32 + 32 * 10 + 10,)


def test_parse_override_nested_and_load_config(setting):
    assert parse_override("model.params.width=32") == (["model", "params.width"], 32)
    assert parse_override("server.algorithm=fedfv") == (["server", "algorithm"], "fedfv")
    cfg = load_config(setting / "tiny.toml", [
        "data.partition=dirichlet", "data.partition_params.alpha=0.3",
        "model.params={a = 1}", "model.params.b.c=2", "fedfv.alpha=0.2"])
    assert cfg.data.partition_params == {"alpha": 0.3}
    assert cfg.model.params == {"a": 1, "b": {"c": 2}}  # into the table, beside its keys
    assert cfg.fedfv.alpha == 0.2


def test_the_check_makes_each_round_when_it_is_aggregated():
    """Memory does not grow with --rounds: a round's inputs are freed once the next is made."""
    from mpifl.aggregators import rule
    from mpifl.bench.aggregation import extras_for
    from mpifl.bench.statecheck import _rounds

    alive = []
    ids = []
    for r in _rounds(extras_for(rule("fedavg")), 6, 48, 200, 0):
        alive.append(weakref.ref(r.updates))
        ids.append(r.client_ids.tolist())
    assert sum(ref() is not None for ref in alive) <= 1
    assert len({i for row in ids for i in row}) == 200 * 6  # distinct clients, as before
