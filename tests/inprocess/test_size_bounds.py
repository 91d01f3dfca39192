"""Every size in the config has a bound checked before work starts: the
memory estimate of :mod:`mpifl.experiment.budget` refuses, in one line and within seconds, a
config that would not fit in this node's memory, naming the key, its value and the memory; the
estimate is kept honest against the data and model actually built."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import annotated_types
import pytest

from mpifl import aggregators
from mpifl.core.errors import ConfigError
from mpifl.experiment import budget
from mpifl.experiment.assemble import build_parts
from mpifl.experiment.plan import make_plan
from mpifl.experiment.config import load_config, schema
from mpifl.models import build_model

SYNTHETIC = ["data.dataset=synthetic", "data.partition=natural"]


def refused(tmp_path: Path, overrides: list[str], limit_mb: float | None) -> str:
    """Run ``mpifl run`` (one process) and return its one error line; exit 2, no traceback,
    refused before anything large was built: the process's peak memory (GNU time's figure)
    stays that of the imports, where the data it refuses would take hundreds of GiB."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop(budget.LIMIT_VAR, None)
    if limit_mb is not None:
        env[budget.LIMIT_VAR] = str(limit_mb)
    job = tmp_path / "job.toml"
    job.write_text('[run]\nname = "big"\n')
    args = [a for o in overrides for a in ("--set", o)]
    proc = subprocess.run(["/usr/bin/time", "-f", "peak_kb=%M", sys.executable, "-m", "mpifl",
                           "run", str(job), "--out", str(tmp_path / "big.h5"), "--no-progress",
                           *args], capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)
    peak_mb = int(proc.stderr.rsplit("peak_kb=", 1)[1].split()[0]) / 1024
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("mpifl: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert peak_mb < 2048, f"peak memory {peak_mb:.0f} MB before the refusal"
    assert not (tmp_path / "big.h5").exists()
    return lines[0]


def test_ten_million_synthetic_clients_are_refused_before_anything_is_built(tmp_path):
    # the node's own memory, unless it has more than the ~570 GiB this would take
    limit = 64 * 1024 if budget.available_memory()[0] > 400 * 2**30 else None
    line = refused(tmp_path, [*SYNTHETIC, "data.num_clients=10000000"], limit)
    assert "data.num_clients = 10000000" in line
    assert "~2.4e9 samples" in line and "GiB) on every rank" in line
    assert "available" in line and budget.LIMIT_VAR in line


def test_dittos_personal_models_are_refused_under_a_small_limit(tmp_path):
    # 1,000 clients x d = 71,010: the (K, d) store and its checkpoint copy are ~540 MiB
    over = [*SYNTHETIC, "data.num_clients=1000", "model.hidden=[1000]",
            "server.algorithm=ditto"]
    line = refused(tmp_path, over, 400)
    assert "data.num_clients = 1000: ditto keeps 1,000 personal models" in line
    assert "d = 71,010 (model.hidden = [1000])" in line
    assert "400 MiB available (MPIFL_MEMORY_LIMIT_MB)" in line
    # the same run with FedAvg keeps no (K, d) state and fits
    fedavg = load_config(None, [*over[:-1], "server.algorithm=fedavg"])
    assert budget.estimate(fedavg, ranks=1, world=1).total < 400 * 2**20


def test_a_wide_model_is_refused_before_it_is_built(tmp_path):
    line = refused(tmp_path, [*SYNTHETIC, "model.hidden=[100000,100000]"], 4096)
    assert "model.hidden = [100000, 100000]" in line and "d = 10,007,200,010" in line


def test_a_config_just_under_the_limit_is_accepted(monkeypatch):
    cfg = load_config(None, [*SYNTHETIC, "data.num_clients=500", "server.algorithm=fedfv",
                             "fedfv.tau=3"])
    est = budget.estimate(cfg, ranks=2, world=2)
    assert budget.check_budget(cfg, available=est.total * 1.001, ranks=2, world=2).total \
        == est.total
    with pytest.raises(ConfigError, match=r"on this node \(2 ranks\)"):
        budget.check_budget(cfg, available=est.total * 0.999, ranks=2, world=2)
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv(budget.LIMIT_VAR, str(est.total * 1.001 / 2**20))
    budget.check_budget(cfg)
    monkeypatch.setenv(budget.LIMIT_VAR, str(est.total * 0.999 / 2**20))
    with pytest.raises(ConfigError, match=budget.LIMIT_VAR):
        budget.check_budget(cfg)
    for bad in ("0", "-5", "lots", "nan"):
        monkeypatch.setenv(budget.LIMIT_VAR, bad)
        with pytest.raises(ConfigError, match=f"{budget.LIMIT_VAR}='{bad}'"):
            budget.available_memory()
    monkeypatch.delenv(budget.LIMIT_VAR)
    avail, source = budget.available_memory()
    assert 0 < avail < float("inf") and source != budget.LIMIT_VAR


def test_the_estimate_matches_the_data_and_model_built(monkeypatch):
    """The data part within 0.5x..2x of the arrays actually built (synthetic, 300 clients) and
    d exactly; so a change of the generator's law or the data layout cannot drift silently."""
    monkeypatch.delenv(budget.LIMIT_VAR, raising=False)
    cfg = load_config(None, [*SYNTHETIC, "data.num_clients=300", "server.algorithm=ditto",
                             "model.hidden=[32]"])
    est = budget.estimate(cfg, ranks=1, world=1)
    parts = build_parts(make_plan(cfg))
    fed = parts.fed
    actual = sum(a.nbytes for a in (fed.x, fed.y, fed.train_idx, fed.test_idx, fed.train_ptr,
                                    fed.test_ptr))
    data = est.part("the synthetic data set")
    assert 0.5 <= data.nbytes / actual <= 2.0, (data.nbytes, actual)
    assert 0.5 <= est.samples / len(fed.x) <= 2.0
    assert est.d == parts.layout.d
    ditto = est.part("ditto keeps")
    assert ditto.nbytes == 2 * 300 * 4 * parts.layout.d


@pytest.mark.parametrize("dataset, model", [("fashion_mnist", "cnn_mnist"),
                                            ("cifar10", "cnn_cifar"), ("adult", "logreg"),
                                            ("fashion_mnist", "mlp")])
def test_the_meta_built_model_has_the_real_size(dataset, model):
    cfg = load_config(None, [f"data.dataset={dataset}", f"model.name={model}"])
    samples, shape, classes, _ = budget._data_shape(cfg)
    d, _ = budget.model_size(cfg, shape, classes)
    real = build_model(model, shape, classes, hidden=cfg.model.hidden)
    assert d == sum(p.numel() for p in real.parameters())


def _upper_bound(annotation, metadata) -> bool:
    if any(isinstance(m, (annotated_types.Le, annotated_types.Lt)) for m in metadata):
        return True
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    inner = [a for a in args if typing.get_origin(a) is typing.Annotated]
    return bool(inner) and all(
        any(isinstance(m, (annotated_types.Le, annotated_types.Lt))
            for f in typing.get_args(a)[1:] for m in getattr(f, "metadata", [f]))
        for a in inner)


def _ints(annotation) -> bool:
    if annotation is int:
        return True
    return any(_ints(a) for a in typing.get_args(annotation))


#: integer keys bounded by a cross-field check instead of the schema
CHECKED_ELSEWHERE = {"faults.nan_clients"}  # ids in 0 .. data.num_clients - 1


def test_every_integer_key_of_the_config_has_an_upper_bound():
    cls = schema()
    unbounded = []
    for section, field in cls.model_fields.items():
        model = field.annotation
        for name, f in getattr(model, "model_fields", {}).items():
            key = f"{section}.{name}"
            if _ints(f.annotation) and key not in CHECKED_ELSEWHERE \
                    and not _upper_bound(f.annotation, f.metadata):
                unbounded.append(key)
    assert not unbounded, unbounded
    assert "fedfv" in cls.model_fields and aggregators.rule("fedfv")


def test_new_size_bounds_are_one_line_config_errors():
    with pytest.raises(ConfigError, match=r"data.classes_per_client: input should be less"):
        load_config(None, ["data.classes_per_client=9999999999"])
    with pytest.raises(ConfigError, match=r"data.classes.0: input should be greater"):
        load_config(None, ["data.classes=[-1]"])
