"""Simulated time that cannot train: each case ends in a one-line refusal (exit 2) or a
warning, never a run that "completes" with nothing trained (mpifl/runtime/clock.py,
mpifl/clients/system.py ``check_rounds``, docs/guides/simulated-time.md).

Known before the first round (set-up): an availability trace with none of the run's clients,
windows too short for any client's round, a deadline no client can meet, a round time that is
not finite. Known only as the rounds run: a trace that ends before the run, rounds in which no
selected client finishes (a warning each, rate-limited, and a count at the end), and a run in
which no round trained anything (an error at the end). A run whose clients come on only later
waits for them, as the asynchronous server does.

Round times are made exact by one tier without spread (or a device trace): latency 0.1 s
each way, so every round takes more than 0.2 s whatever a client's samples.
"""

from __future__ import annotations

import logging
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpifl.cli import main
from mpifl.clients.system import SystemModel, SystemParams, Tier
from mpifl.core.errors import ConfigError, DataError
from mpifl.runtime.clock import Clock

K = 12
JOB = f"""
[run]
name = "refusals"
seed = 3
rounds = 3
eval_every = 3
checkpoint_every = 0
threads = 1
[data]
dataset = "synthetic"
partition = "natural"
num_clients = {K}
[model]
name = "mlp"
hidden = [8]
[client]
epochs = 1
batch_size = 10
lr = 0.05
[server]
algorithm = "fedavg"
clients_per_round = 4
[system]
enabled = true
spread = 0.0
[[system.tiers]]
name = "only"
share = 1.0
seconds_per_sample = 0.001
down_mbps = 100.0
up_mbps = 100.0
latency_s = 0.1
"""
#: every round of the job's one tier takes at least this (two latencies)
MIN_ROUND_S = 0.2
#: the job's tier, for clocks built directly
TIER = Tier(name="only", share=1.0, seconds_per_sample=0.01, down_mbps=100.0, up_mbps=100.0,
            latency_s=0.1)


def _trace(path: Path, rows: list[tuple[int, float, float]]) -> Path:
    path.write_text("client,start_s,end_s\n" + "".join(f"{k},{s!r},{e!r}\n" for k, s, e in rows))
    return path


def _model(folder: Path, rows: list[tuple[int, float, float]], k: int,
           devices: list[tuple[float, float]] | None = None) -> SystemModel:
    """A system model of ``k`` clients on the job's tier, with the availability trace ``rows``
    and, if given, a device trace of (seconds_per_sample, latency_s) per client (bandwidths
    10^4 Mbit/s), both written to ``folder``."""
    extra = {}
    if devices is not None:
        extra["device_trace"] = str(folder / "devices.csv")
        (folder / "devices.csv").write_text(
            "client,tier,seconds_per_sample,down_mbps,up_mbps,latency_s\n"
            + "".join(f"{c},only,{s!r},1e4,1e4,{lat!r}\n" for c, (s, lat) in enumerate(devices)))
    trace = _trace(folder / "avail.csv", rows)
    params = SystemParams(enabled=True, tiers=[TIER], spread=0.0,
                          availability_trace=str(trace), **extra)
    return SystemModel(params, seed=0, num_clients=k, model_bytes=1000)


def _run(tmp_path: Path, capsys, *sets: str, out: str = "run.h5") -> tuple[int, str, Path]:
    """``mpifl run`` of the job with ``--set`` items: (exit status, stderr, results file)."""
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    result = tmp_path / out
    args = ["run", str(job), "--out", str(result), "--no-progress", "--overwrite"]
    for item in sets:
        args += ["--set", item]
    capsys.readouterr()
    code = main(args)
    return code, capsys.readouterr().err, result


def _error_line(err: str) -> str:
    """The run's one error line (and assert there is exactly one, without a traceback)."""
    lines = [x for x in err.splitlines() if x.startswith("mpifl: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def _system(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: f["system/rounds"][k][()] for k in f["system/rounds"]} | {
            "num_clients": f["rounds/num_clients"][()]}


# --------------------------------------------------------------------------- set-up refusals


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbuff"])
@pytest.mark.parametrize("rows", [[], [(K, 0.0, 1e6), (K + 5, 0.0, 1e6)]],
                         ids=["header-only", "only-other-clients"])
def test_a_trace_without_any_of_the_run_s_clients_is_refused(tmp_path, capsys, algorithm, rows):
    trace = _trace(tmp_path / "avail.csv", rows)
    code, err, _ = _run(tmp_path, capsys, f'system.availability_trace="{trace}"',
                        f'server.algorithm="{algorithm}"')
    line = _error_line(err)
    assert code == 2
    assert str(trace) in line and "no client is ever available" in line, line
    assert "round 1/" not in err  # refused before any round


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbuff"])
def test_windows_too_short_for_any_round_are_refused(tmp_path, capsys, algorithm):
    """1e-9 s windows: before, the synchronous clock kept clients that never finish and wrote
    sim_time = inf."""
    trace = _trace(tmp_path / "avail.csv", [(k, 0.0, 1e-9) for k in range(K)])
    code, err, _ = _run(tmp_path, capsys, f'system.availability_trace="{trace}"',
                        f'server.algorithm="{algorithm}"')
    line = _error_line(err)
    assert code == 2
    assert str(trace) in line and "available long enough to finish a round" in line, line
    assert "1e-09 s" in line


def test_a_deadline_no_client_can_meet_is_refused(tmp_path, capsys):
    code, err, _ = _run(tmp_path, capsys, "system.deadline_s=1e-9")
    line = _error_line(err)
    assert code == 2
    assert "system.deadline_s = 1e-09 s: no client can finish a round within it" in line, line
    # the fastest client's time is named, and it is one no client beats
    needed = float(line.split(" needs ")[1].split(" s ")[0])
    assert needed >= MIN_ROUND_S


def test_a_deadline_met_only_by_clients_never_on_long_enough_is_refused(tmp_path):
    """Client 0 meets the deadline but is on 0.01 s at a time; client 1 is on long enough but
    too slow: each constraint alone is met by a client, both by none."""
    devices = [(1e-6, 0.01), (1.0, 0.01)]  # ~0.02 s and > 10 s for 10 samples
    sizes = np.array([10, 10])
    short = _model(tmp_path, [(0, 0.0, 0.01), (1, 0.0, 100.0)], 2, devices)
    with pytest.raises(ConfigError, match="never available long enough"):
        short.check_rounds(sizes, 1, deadline_s=1.0)
    with pytest.raises(ConfigError, match="never available long enough"):
        Clock(short, sizes, epochs=1, seed=0, deadline_s=1.0)
    # with client 0 on long enough it can finish: accepted, and it alone
    long = _model(tmp_path, [(0, 0.0, 1.0), (1, 0.0, 100.0)], 2, devices)
    assert long.check_rounds(sizes, 1, deadline_s=1.0).tolist() == [True, False]
    assert long.check_rounds(sizes, 1).tolist() == [True, True]  # no deadline: both


def test_a_round_time_that_is_not_finite_is_refused(tmp_path, capsys):
    """1e307 s a sample: finite in the device trace, infinite times the samples."""
    devices = tmp_path / "devices.csv"
    devices.write_text("client,tier,seconds_per_sample,down_mbps,up_mbps,latency_s\n" + "".join(
        f"{k},only,1e307,100,100,0.1\n" for k in range(K)))
    code, err, _ = _run(tmp_path, capsys, f'system.device_trace="{devices}"')
    line = _error_line(err)
    assert code == 2 and str(devices) in line and "round time is not finite" in line, line
    tier = Tier(name="only", share=1.0, seconds_per_sample=1e307, down_mbps=1.0, up_mbps=1.0)
    system = SystemModel(SystemParams(enabled=True, tiers=[tier], spread=0.0), 0, 3, 100)
    with pytest.raises(ConfigError, match=r"^system\.tiers: client 0's round time is not finite"):
        Clock(system, np.array([50, 60, 70]), epochs=1, seed=0)


# --------------------------------------------------------------------------- as the rounds run


def test_clients_that_go_off_before_finishing_are_never_kept(tmp_path):
    """No deadline: a selected client whose window ends before its round does not count, and
    the round lasts until the kept one finishes (finite)."""
    sizes = np.array([10, 10, 10])
    probe = _model(tmp_path, [(k, 0.0, 100.0) for k in range(3)], 3)
    seconds = probe.round_seconds(np.arange(3), sizes, 1)
    short = float(seconds[0]) / 2  # clients 0 and 2 leave halfway through
    system = _model(tmp_path, [(0, 0.0, short), (1, 0.0, 100.0), (2, 0.0, short)], 3)
    clock = Clock(system, sizes, epochs=1, seed=0)
    rt = clock.round(0, m=3, sampling="all")
    assert rt.kept.tolist() == [1] and rt.offline == 2
    assert rt.seconds == seconds[1] and np.isfinite(rt.seconds)
    clock.advance(rt)
    assert clock.rounds == [(float(seconds[1]), 3, 1, 2)]


def test_a_run_whose_clients_come_on_later_waits_for_them(tmp_path, capsys, caplog):
    """Every client on only from 10^7 s: the first round starts then (before, the clock stayed
    at 0 and every round selected nobody)."""
    on = 1e7
    trace = _trace(tmp_path / "avail.csv", [(k, on, 2 * on) for k in range(K)])
    code, err, out = _run(tmp_path, capsys, f'system.availability_trace="{trace}"')
    assert code == 0, err[-3000:]
    got = _system(out)
    assert (got["finished"] > 0).all() and (got["num_clients"] == got["finished"]).all()
    assert got["sim_time"][0] >= on + MIN_ROUND_S and np.all(np.diff(got["sim_time"]) > 0)
    assert "trained no client" not in err and "trained no client" not in caplog.text


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbuff"])
def test_a_trace_that_ends_before_the_run_stops_it_in_one_line(tmp_path, capsys, algorithm):
    """Everyone on for [0, 1) s, every round > 0.2 s, 20 rounds: the trace runs out."""
    trace = _trace(tmp_path / "avail.csv", [(k, 0.0, 1.0) for k in range(K)])
    code, err, out = _run(tmp_path, capsys, f'system.availability_trace="{trace}"',
                          f'server.algorithm="{algorithm}"', "run.rounds=20")
    line = _error_line(err)
    assert code == 2
    assert "no client is available at simulated time" in line and "or later" in line, line
    with h5py.File(out, "r") as f:  # the rounds before are kept; the run is not complete
        assert 0 < len(f["rounds/round"][()]) < 20
        assert f.attrs["status"] != "complete"


def _gaps(first_long: float) -> list[tuple[int, float, float]]:
    """Every client on for 0.05 s at each whole second (too short for a round, > 0.2 s), then
    for good from ``first_long``: a round starting at second s trains nobody and lasts 0.05 s,
    so the next one waits for second s + 1."""
    rows = [(k, float(s), s + 0.05) for k in range(K) for s in range(int(first_long))]
    return rows + [(k, first_long, 1e6) for k in range(K)]


def test_rounds_that_train_nothing_are_warned_about_and_counted(tmp_path, capsys, caplog):
    trace = _trace(tmp_path / "avail.csv", _gaps(2.0))
    code, err, out = _run(tmp_path, capsys, f'system.availability_trace="{trace}"',
                          "run.rounds=4")
    assert code == 0, err[-3000:]
    got = _system(out)
    assert got["finished"][:2].tolist() == [0, 0] and (got["finished"][2:] > 0).all()
    assert got["late"][:2].tolist() == [4, 4]  # all 4 selected left before finishing
    np.testing.assert_allclose(got["sim_time"][:2], [0.05, 1.05])
    warnings = [x for x in caplog.messages if "none of the 4 selected clients finished" in x]
    assert len(warnings) == 2 and "round 1:" in warnings[0] and "round 2:" in warnings[1]
    assert "4 went off before finishing" in warnings[0]
    assert "(2 such round(s) so far" in warnings[1]
    assert any("2 of 4 rounds trained no client" in x for x in caplog.messages)


def test_empty_round_warnings_are_rate_limited(tmp_path):
    """Logged at the 1st, 2nd, 4th, 8th, ... empty round only."""
    system = _model(tmp_path, [(k, float(s), s + 0.05) for k in range(2) for s in range(20)]
                    + [(k, 100.0, 200.0) for k in range(2)], 2)
    clock = Clock(system, np.array([10, 10]), epochs=1, seed=0)
    logged = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("mpifl.server").addHandler(handler)
    try:
        for rnd in range(9):
            clock.advance(clock.round(rnd, m=2, sampling="uniform"))
    finally:
        logging.getLogger("mpifl.server").removeHandler(handler)
    assert clock.empty_rounds() == 9
    assert [int(x.split(":")[0].split()[1]) for x in logged] == [1, 2, 4, 8]
    resumed = Clock(system, np.array([10, 10]), epochs=1, seed=0)
    resumed.load_state_dict(clock.state_dict())  # a resume goes on counting
    assert resumed.empty_rounds() == 9
    with pytest.raises(ConfigError, match=r"^system: none of the run's 9 round\(s\) trained"):
        clock.check_trained()


def test_a_run_in_which_no_round_trains_ends_in_an_error(tmp_path, capsys, caplog):
    """All clients always on, but only client 0 meets the deadline and it comes on only at
    10^5 s: each round is the deadline long and keeps nobody, so set-up cannot know."""
    devices = tmp_path / "devices.csv"
    devices.write_text("client,tier,seconds_per_sample,down_mbps,up_mbps,latency_s\n" + "".join(
        f"{k},only,{1e-6 if k == 0 else 1.0},1e4,1e4,{0.0 if k == 0 else 1.0}\n"
        for k in range(K)))
    trace = _trace(tmp_path / "avail.csv",
                   [(0, 1e5, 1e6)] + [(k, 0.0, 1e6) for k in range(1, K)])
    code, err, out = _run(tmp_path, capsys, f'system.device_trace="{devices}"',
                          f'system.availability_trace="{trace}"', "system.deadline_s=0.5")
    line = _error_line(err)
    assert code == 2
    assert line.startswith("mpifl: error: system: none of the run's 3 round(s) trained a "
                           "client"), line
    assert "system.deadline_s = 0.5 s" in line
    warnings = [x for x in caplog.messages if "selected clients finished" in x]
    assert len(warnings) == 2 and "4 needed more than the 0.5 s deadline" in warnings[0]
    got = _system(out)  # the rounds are written, and show why
    assert got["finished"].tolist() == [0, 0, 0] and got["late"].tolist() == [4, 4, 4]
    np.testing.assert_allclose(got["sim_time"], [0.5, 1.0, 1.5])
    with h5py.File(out, "r") as f:
        assert f.attrs["status"] != "complete"


def test_simulated_time_past_the_largest_float_is_refused(tmp_path):
    """Client 0 on only from 1.5e308 s, client 1 never: the round waits for client 0, and with
    fewer than m clients it lasts the deadline, 1e308 s, past the largest float."""
    system = _model(tmp_path, [(0, 1.5e308, 1.7e308)], 2)
    clock = Clock(system, np.array([10, 10]), epochs=1, seed=0, deadline_s=1e308)
    with pytest.raises(DataError, match=r"avail\.csv: round 1 would end at simulated time"):
        clock.round(0, m=2, sampling="uniform")


def test_with_periodic_availability_a_round_starts_when_someone_is_on():
    """Clients on 1% of each 100 s period: mostly nobody is on, and each round waits for the
    next one to come on (never a round of nobody, never a clock that stands still)."""
    rare = Tier(name="only", share=1.0, seconds_per_sample=1e-4, down_mbps=1e4, up_mbps=1e4,
                latency_s=0.01, available_fraction=0.01)
    params = SystemParams(enabled=True, tiers=[rare], spread=0.0, availability="periodic",
                          period_s=100.0)
    system = SystemModel(params, seed=5, num_clients=3, model_bytes=1000)
    clock = Clock(system, np.array([10, 10, 10]), epochs=1, seed=5)
    for rnd in range(12):
        before = clock.now
        rt = clock.round(rnd, m=1, sampling="all")
        assert len(rt.selected) and rt.start >= before
        assert system.available(rt.start)[rt.selected].all()
        clock.advance(rt)
        assert clock.now > before
