"""Synchronous rounds on simulated time (``[system]``, mpifl/runtime/clock.py): selection among
the available clients, deadlines and over-commitment against a direct oracle, the clock carried
by checkpoints (resume exact on 1 and 3 ranks, runs of the shared MPI world, tests/world.py),
every built-in rule under it, the system model off changing nothing, and what the results,
``mpifl.load``, ``mpifl report`` and ``mpifl plot time`` show."""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpifl
from mpifl.aggregators import available, rule
from mpifl.cli import main
from mpifl.clients.system import SystemModel, SystemParams, Tier
from mpifl.core.rng import SAMPLING_TAG
from mpifl.runtime.clock import Clock
from tests.world import world_run

ROOT = Path(__file__).resolve().parents[2]
JOB = """
[run]
name = "clock"
seed = 3
rounds = 6
eval_every = 2
checkpoint_every = 3
threads = 1
[data]
dataset = "synthetic"
partition = "natural"
num_clients = 24
[model]
hidden = [16]
[client]
batch_size = 20
lr = 0.05
[server]
algorithm = "fedavg"
clients_per_round = 5
[system]
enabled = true
availability = "periodic"
period_s = 600.0
deadline_s = 8.0
over_commit = 0.6
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("clock") / "job.toml"
    path.write_text(JOB)
    return path


def _world(name: str, ranks: int, *words: str, command: str = "run"):
    """A world run (tests/world.py) of the job (``mpifl run``) into ``{dir}/<name>.h5``, or
    ``mpifl resume`` of ``{dir}/<name>.h5``."""
    out = f"{{dir}}/{name}.h5"
    if command == "resume":
        return world_run(f"{name}-resumed", ["resume", out, *words, "--no-progress"],
                         ranks=ranks)
    return world_run(name, ["run", "{dir}/clock.toml", *words, "--out", out, "--no-progress"],
                     ranks=ranks, files={"clock.toml": JOB})


ONE = _world("clock-one", 1)
THREE = _world("clock-three", 3)
PART = _world("clock-part", 3, "--set", "run.rounds=3")
RESUMED = _world("clock-part", 3, "--rounds", "6", command="resume")


def _datasets(path: Path, group: str) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path, "r") as f:
        f[group].visititems(lambda name, d: out.__setitem__(name, d[()])
                            if isinstance(d, h5py.Dataset) else None)
    return out


# --------------------------------------------------------------------------- the clock itself


def _one_tier(seconds_per_sample: float, available_fraction: float = 1.0) -> SystemParams:
    tier = Tier(name="only", share=1.0, seconds_per_sample=seconds_per_sample, down_mbps=8.0,
                up_mbps=8.0, latency_s=0.0, available_fraction=available_fraction)
    return SystemParams(enabled=True, tiers=[tier], spread=0.0)


def test_a_round_keeps_the_first_m_to_finish_within_the_deadline():
    """Direct oracle: one tier, no spread, so a client's round time is 2 s of transfers plus
    its samples x 0.1 s; 8 of 12 selected, the first 5 by (time, id) under 6 s kept."""
    sizes = np.array([10, 50, 20, 20, 5, 60, 30, 40, 15, 35, 45, 25, 8, 12], np.int64)
    system = SystemModel(_one_tier(0.1), seed=0, num_clients=len(sizes), model_bytes=10**6)
    clock = Clock(system, sizes, epochs=1, seed=7, deadline_s=6.0, over_commit=0.6)
    rt = clock.round(4, m=5, sampling="uniform")
    rng = np.random.default_rng([7, 4, SAMPLING_TAG])  # select_clients' draw, 8 of 14
    want = np.sort(rng.choice(len(sizes), size=8, replace=False))
    np.testing.assert_array_equal(rt.selected, want)
    seconds = 2.0 + 0.1 * sizes[want]
    np.testing.assert_allclose(system.round_seconds(want, sizes[want], 1), seconds)
    by_time = want[np.lexsort((want, seconds))][:5]
    kept = np.sort([k for k in by_time if 2.0 + 0.1 * sizes[k] <= 6.0])
    np.testing.assert_array_equal(rt.kept, kept)
    assert rt.seconds == (6.0 if len(kept) < 5 else max(2.0 + 0.1 * sizes[kept]))
    assert clock.now == 0.0  # nothing moves until the round is kept
    clock.advance(rt)
    assert clock.now == rt.seconds and clock.counters["participations"][want].tolist() == [1] * 8
    assert clock.counters["late"].sum() == 8 - len(kept)
    np.testing.assert_allclose(clock.counters["busy_s"][want], np.minimum(seconds, rt.seconds))


def test_only_available_clients_are_selected_and_the_state_round_trips():
    system = SystemModel(SystemParams(enabled=True, availability="periodic", period_s=100.0),
                         seed=1, num_clients=500, model_bytes=10**5)
    clock = Clock(system, np.full(500, 30), epochs=2, seed=1, deadline_s=30.0)
    for rnd in range(4):
        on = system.available(clock.now)
        rt = clock.round(rnd, m=20, sampling="uniform")
        assert on[rt.selected].all() and len(rt.selected) == 20
        clock.advance(rt)
    again = Clock(system, np.full(500, 30), epochs=2, seed=1, deadline_s=30.0)
    again.load_state_dict(json.loads(json.dumps({k: np.asarray(v).tolist() for k, v in
                                                 clock.state_dict().items()})))
    assert again.now == clock.now and again.rounds == clock.rounds
    a, b = clock.round(4, 20, "uniform"), again.round(4, 20, "uniform")
    assert np.array_equal(a.kept, b.kept) and a.seconds == b.seconds
    with pytest.raises(ValueError, match="counts 500 clients, the run has 10"):
        Clock(system, np.full(10, 30), 1, 1).load_state_dict(clock.state_dict())


# --------------------------------------------------------------------------- whole runs


def test_runs_on_simulated_time_resume_exactly_on_one_and_three_ranks(world):
    assert world.status(PART) == 0
    one, three = world.file(ONE), world.file(THREE)
    part = world.file(RESUMED, "clock-part.h5")
    system = _datasets(one, "system")
    with h5py.File(three, "r") as a, h5py.File(part, "r") as b:  # resumed: bit for bit
        assert np.array_equal(a["model/global"][()], b["model/global"][()])
        rows = np.isin(b["eval/round"][()], a["eval/round"][()])  # part also evaluated at 3
        assert np.array_equal(a["eval/client_accuracy"][()], b["eval/client_accuracy"][()][rows])
    with h5py.File(one, "r") as a, h5py.File(three, "r") as b:
        # the clock is rank-free; the vectorised trainer's float sums are chunked by rank
        np.testing.assert_allclose(a["model/global"][()], b["model/global"][()], atol=1e-5)
    for other in (three, part):
        got = _datasets(other, "system")
        assert got.keys() == system.keys()
        for name in system:
            assert np.array_equal(got[name], system[name]), name
    late = system["rounds/late"]
    assert late.sum() > 0 and np.all(np.diff(system["rounds/sim_time"]) > 0)
    with h5py.File(one, "r") as f:  # the aggregated clients are exactly those in time
        assert np.array_equal(f["rounds/num_clients"][()], system["rounds/finished"])


def test_every_synchronous_built_in_rule_runs_on_simulated_time(job, tmp_path, capsys):
    for name in sorted(available()):
        # mfairfl needs a sensitive attribute (its own tests); the asynchronous rules have no
        # rounds to time out (tests/inprocess/test_async_rules.py)
        if name == "mfairfl" or rule(name).needs.asynchronous:
            continue
        extra = ["--set", "server.sampling=all"] if name == "afl" else []
        out = tmp_path / f"{name}.h5"
        code = main(["run", str(job), "--set", f"server.algorithm={name}", "--set",
                     "run.rounds=2", "--set", "run.checkpoint_every=0", *extra, "--out",
                     str(out), "--no-progress"])
        assert code == 0, (name, capsys.readouterr().err[-2000:])
        with h5py.File(out, "r") as f:
            assert f["system/rounds/sim_time"].shape == (2,), name
            assert np.isfinite(f["model/global"][()]).all(), name


def test_the_system_model_off_changes_nothing(job, tmp_path):
    off, default = tmp_path / "off.h5", tmp_path / "default.h5"
    text = job.read_text().split("[system]")[0]
    plain = tmp_path / "plain.toml"
    plain.write_text(text)
    assert main(["run", str(plain), "--out", str(default), "--no-progress"]) == 0
    plain.write_text(text + "[system]\nenabled = false\ndeadline_s = 1.0\n")
    assert main(["run", str(plain), "--out", str(off), "--no-progress"]) == 0
    with h5py.File(off, "r") as a, h5py.File(default, "r") as b:
        assert "system" not in a and "system" not in b
        assert np.array_equal(a["model/global"][()], b["model/global"][()])
        assert np.array_equal(a["rounds/selected"][()], b["rounds/selected"][()])


def test_results_report_and_plot_show_simulated_time(job, tmp_path, capsys):
    out = tmp_path / "r.h5"
    assert main(["run", str(job), "--out", str(out), "--no-progress"]) == 0
    ds = mpifl.load(out)
    assert ds["sim_time"].shape == (1, 6) and ds["tier"].shape == (1, 24)
    assert list(ds["tier_name"].values) == ["fast", "medium", "slow"]
    assert int(ds["participations"].sum()) == int(ds["sim_selected"].sum())
    capsys.readouterr()
    assert main(["report", str(out), "--target", "1"]) == 0
    table = capsys.readouterr().out
    for label in ("simulated hours", "late updates (%)", "hours to target", "fast tier acc (%)",
                  "slow tier acc (%)"):
        assert label in table, label
    hours = float(next(line for line in table.splitlines()
                       if line.startswith("simulated hours")).split()[-1])
    assert math.isclose(hours, ds["sim_time"].values[0, -1] / 3600, abs_tol=0.01)
    png = tmp_path / "time.png"
    assert main(["plot", "time", str(out), "--out", str(png)]) == 0
    assert png.stat().st_size > 10_000
    plain = tmp_path / "plain.h5"
    text = job.read_text().split("[system]")[0]
    (tmp_path / "plain.toml").write_text(text)
    assert main(["run", str(tmp_path / "plain.toml"), "--out", str(plain), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["plot", "time", str(plain), "--out", str(png)]) == 2
    assert "have no simulated time" in capsys.readouterr().err
