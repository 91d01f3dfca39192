"""The GPU side of the memory budget (:mod:`mpifl.experiment.budget`, "GPU memory") and where
the sample store lives (``client.samples_on``), checked on a CPU: the decision is a pure
function of the config and the GPU's figures, so a 16 GiB GPU shared by 4 ranks is passed in;
the thin wrapper that asks torch.cuda is checked with torch.cuda's answers replaced."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from mpifl.core.errors import ConfigError
from mpifl.experiment import budget
from mpifl.experiment.assemble import build_parts, make_adapter, make_trainer, sample_store
from mpifl.experiment.config import load_config
from mpifl.experiment.plan import make_plan
from mpifl.runtime.protocol import TRAIN, Request
from mpifl.runtime.staging import Staging
from mpifl.runtime.worker import Worker

GiB = 2**30
SYNTHETIC = ["data.dataset=synthetic", "data.partition=natural"]
#: a million synthetic clients: ~2.4e8 samples of 60 float32 features, ~55 GiB on a device
MILLION = [*SYNTHETIC, "data.num_clients=1000000", "server.clients_per_round=1000",
           "model.hidden=[200]"]
#: the launcher's and SLURM's variables the estimate reads (the tests set what they need)
LAUNCHER = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE",
            "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_GPUS_ON_NODE",
            "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "MPI_LOCALRANKID",
            "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", budget.GPU_LIMIT_VAR)


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_samples_on_the_device_are_refused_on_a_16_gib_gpu_shared_by_4_ranks():
    cfg = load_config(None, [*MILLION, "client.samples_on=device"])
    with pytest.raises(ConfigError) as err:
        budget.check_gpu_budget(cfg, available=16 * GiB, gpus=1, ranks=4, world=4)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("client.samples_on = device: the synthetic data set's 2.4e8 samples")
    assert "GiB) on each worker's GPU" in line
    assert "on one GPU (4 ranks share it), which has 16 GiB" in line
    assert budget.GPU_LIMIT_VAR in line and "client.samples_on = host" in line
    # the same figures with the samples in host memory fit
    host = budget.check_gpu_budget(load_config(None, [*MILLION, "client.samples_on=host"]),
                                   available=16 * GiB, gpus=1, ranks=4, world=4)
    assert host.samples_on == "host" and host.total < 16 * GiB


def test_auto_keeps_the_samples_on_the_gpu_when_they_fit_else_in_host_memory():
    small = load_config(None, [*SYNTHETIC, "data.num_clients=1000"])
    est = budget.check_gpu_budget(small, available=16 * GiB, gpus=1, ranks=4, world=4)
    assert est.samples_on == "device"
    assert est.part("the synthetic data set's") is not None
    assert est.reason.startswith("client.samples_on = auto: the samples on the GPU")
    big = load_config(None, MILLION)
    est = budget.check_gpu_budget(big, available=16 * GiB, gpus=1, ranks=4, world=4,
                                  source=budget.GPU_LIMIT_VAR)
    assert est.samples_on == "host" and est.part("the synthetic data set's") is None
    assert est.reason.startswith("client.samples_on = auto: the samples in host memory")
    assert "4 ranks share it" in est.reason and budget.GPU_LIMIT_VAR in est.reason
    # on the device the same run needs what the samples add, on each of the 4 workers
    device = budget.gpu_estimate(big, samples_on="device", gpus=1, ranks=4, world=4)
    assert device.total > 16 * GiB > est.total


def test_a_gpu_too_small_even_without_the_samples_names_the_largest_part():
    cfg = load_config(None, [*SYNTHETIC, "data.num_clients=1000",
                             "server.clients_per_round=1000", "model.hidden=[4000]"])
    host = budget.gpu_estimate(cfg, samples_on="host", gpus=1, ranks=2, world=2)
    with pytest.raises(ConfigError) as err:
        budget.check_gpu_budget(cfg, available=host.total * 0.99, gpus=1, ranks=2, world=2)
    line = str(err.value)
    assert line.startswith("server.clients_per_round = 1000: the round's (m, d) update matrix")
    assert "on rank 0's GPU" in line and "2 ranks share it" in line
    assert "client.samples_on = host" not in line  # the samples are not what is too large
    assert budget.check_gpu_budget(cfg, available=host.total * 1.01, gpus=1, ranks=2,
                                   world=2).samples_on == "host"


def test_the_ranks_sharing_a_gpu_and_their_contexts():
    cfg = load_config(None, [*SYNTHETIC, "data.num_clients=100"])
    for ranks, gpus, per_gpu in [(4, 4, 1), (5, 4, 2), (8, 4, 2), (4, 1, 4), (1, 1, 1)]:
        est = budget.gpu_estimate(cfg, samples_on="device", gpus=gpus, ranks=ranks, world=ranks)
        assert est.ranks_per_gpu == per_gpu
        context = est.part("a CUDA context")
        assert context.holders == per_gpu and context.nbytes == budget.CONTEXT_BYTES
        # the workers' samples outweigh rank 0's parts: the GPU of R workers is the fullest
        assert est.part("the synthetic data set's").holders == per_gpu
        if ranks > 1:  # one process: rank 0 trains too, and holds both
            assert est.part("the round's") is None
        # rank 0's (m, d) matrices outweigh a worker's parts: rank 0 and R - 1 workers
        wide = load_config(None, [*SYNTHETIC, "data.num_clients=1000",
                                  "server.clients_per_round=1000", "model.hidden=[4000]"])
        est = budget.gpu_estimate(wide, samples_on="device", gpus=gpus, ranks=ranks, world=ranks)
        assert est.part("the round's").holders == 1
        samples = est.part("the synthetic data set's")  # None: rank 0 alone on its GPU
        assert (samples.holders if samples else 0) == (1 if ranks == 1 else per_gpu - 1)
    # 64 ranks' contexts alone exceed a 16 GiB GPU: that is what the refusal names
    with pytest.raises(ConfigError, match=r"^server.device = auto: a CUDA context"):
        budget.check_gpu_budget(cfg, available=16 * GiB, gpus=1, ranks=64, world=64)


def test_the_device_samples_match_the_store_built():
    """The resident samples within 0.5x..2x of the store actually built (synthetic, 300
    clients): a change of the generator or the store's dtypes cannot drift silently."""
    cfg = load_config(None, [*SYNTHETIC, "data.num_clients=300", "model.hidden=[32]"])
    parts = build_parts(make_plan(cfg))
    x, y = sample_store(parts.fed, torch.device("cpu"), "device")
    est = budget.gpu_estimate(cfg, samples_on="device", gpus=1, ranks=1, world=1)
    part = est.part("the synthetic data set's")
    assert 0.5 <= part.nbytes / (x.nbytes + y.nbytes) <= 2.0, (part.nbytes, x.nbytes + y.nbytes)
    assert est.part("the model has").nbytes == budget.MODEL_COPIES * 4 * parts.layout.d


def _fake_cuda(monkeypatch, free_bytes: float, count: int = 2) -> list[int]:
    """torch.cuda as a node with ``count`` GPUs of ``free_bytes`` free; returns the indices
    mem_get_info was asked for."""
    asked: list[int] = []

    def mem_get_info(index=None):
        asked.append(index)
        return int(free_bytes), int(80 * GiB)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return asked


def test_the_wrapper_reads_this_ranks_gpu_or_the_limit(clean_env, caplog):
    monkeypatch = clean_env
    asked = _fake_cuda(monkeypatch, 16 * GiB)
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("MPI_LOCALRANKID", "3")
    assert budget.gpu_memory(1) == (16 * GiB, "cuda:1's free memory")
    asked.clear()
    big = load_config(None, MILLION)
    with caplog.at_level(logging.DEBUG, logger="mpifl"):
        assert budget.check_gpu(big) == "host"
    assert asked == [1]  # local rank 3 of 2 GPUs: cuda:1, as device_for picks
    assert any("the samples in host memory" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv(budget.GPU_LIMIT_VAR, str(1024 * 1024))  # 1 TiB
    assert budget.check_gpu(big) == "device"
    monkeypatch.setenv(budget.GPU_LIMIT_VAR, "1")
    with pytest.raises(ConfigError, match=budget.GPU_LIMIT_VAR + r"\)$"):
        budget.check_gpu(big)
    for bad in ("0", "-5", "lots", "inf"):
        monkeypatch.setenv(budget.GPU_LIMIT_VAR, bad)
        with pytest.raises(ConfigError, match=f"{budget.GPU_LIMIT_VAR}='{bad}'"):
            budget.gpu_memory(0)
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")  # each rank bound to one of the node's 4
    assert budget.gpus_on_node() == 4


def test_the_plan_carries_the_decision_and_a_cpu_run_asks_no_gpu(clean_env):
    monkeypatch = clean_env
    monkeypatch.setenv(budget.LIMIT_VAR, str(2**30))  # the host check is not under test here
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    monkeypatch.setenv("PMI_SIZE", "4")
    cfg = load_config(None, MILLION)
    cpu = load_config(None, [*MILLION, "server.device=cpu"])
    asked = _fake_cuda(monkeypatch, 16 * GiB, count=1)
    assert make_plan(cfg).samples_on == "host" and asked == [0]
    assert make_plan(cpu).samples_on == "auto" and asked == [0]  # no GPU asked for
    monkeypatch.setenv(budget.GPU_LIMIT_VAR, "1000")
    with pytest.raises(ConfigError, match="on one GPU"):
        make_plan(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine: no CUDA
    assert make_plan(cfg).samples_on == "auto"


# ------------------------------------------------------------------ the store and the worker

def _setup(samples_on: str, lazy: bool = False):
    over = [*SYNTHETIC, "data.num_clients=20", "server.clients_per_round=6", "model.hidden=[16]",
            "client.epochs=2", "client.batch_size=8", "client.momentum=0.5",
            f"client.samples_on={samples_on}", "run.adapt_epochs=1",
            f"data.lazy={str(lazy).lower()}"]
    plan = make_plan(load_config(None, over))
    parts = build_parts(plan)
    return plan, parts, make_trainer(plan, parts, torch.device("cpu"))


@pytest.mark.parametrize("lazy", [False, True])
def test_samples_on_host_and_device_train_the_same_on_a_cpu(lazy):
    got = {}
    for on in ("host", "device", "auto"):
        plan, parts, trainer = _setup(on, lazy)
        assert plan.samples_on == on  # a CPU run: the config's value, nothing resolved
        assert trainer.x.device.type == "cpu" and not trainer.x.is_pinned()
        adapter = make_adapter(plan, parts, torch.device("cpu"), trainer)
        assert adapter.x is trainer.x  # the adapter shares the trainer's store
        ids = np.array([2, 5, 11, 17])
        worker = Worker(1, 1, trainer, parts.fed, torch.device("cpu"))
        block = worker.train(Request(TRAIN, 3, 0.1, ids, parts.w0.numpy().copy()))
        got[on] = block
        assert block.updates.shape == (4, parts.layout.d) and np.abs(block.updates).max() > 0
    for on in ("device", "auto"):
        np.testing.assert_array_equal(got[on].updates, got["host"].updates)
        np.testing.assert_array_equal(got[on].losses, got["host"].losses)


def test_the_worker_replies_what_the_trainer_computes():
    """Worker.train through its staging (on a CPU: views of the trainer's tensors) returns
    the trainer's own updates and losses for its block."""
    plan, parts, trainer = _setup("host")
    ids = np.array([1, 4, 9])
    worker = Worker(1, 1, trainer, parts.fed, torch.device("cpu"))
    block = worker.train(Request(TRAIN, 2, 0.05, ids, parts.w0.numpy().copy()))
    from mpifl.runtime.backends import client_rows
    with client_rows(parts.fed, ids, trainer) as (idx, _):
        updates, losses, _ = trainer.run_round(parts.w0.clone(), 2, 0.05, ids, idx)
    np.testing.assert_array_equal(block.updates, updates.numpy())
    np.testing.assert_array_equal(block.losses, losses.numpy())
    assert block.updates.dtype == np.float32


def test_staging_on_a_cpu_is_zero_copy():
    staging = Staging("cpu")
    assert not staging.pinned
    w = np.arange(7, dtype=np.float32)
    t = staging.to_device(w)
    assert t.device.type == "cpu" and np.shares_memory(t.numpy(), w)
    u = torch.randn(3, 5)
    loss = torch.rand(3, dtype=torch.float64)
    a, b = staging.to_host(u, loss)
    assert np.shares_memory(a, u.numpy()) and b.dtype == np.float64
    np.testing.assert_array_equal(a, u.numpy())
    assert staging.nbytes == 0  # nothing pinned without CUDA
