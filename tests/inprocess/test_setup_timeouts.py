"""Set-up bounds that name the rank that did not arrive (mpifl.runtime.init_watch before
MPI_Init, mpifl.runtime.agreement after it), with defaults of minutes and a lower bound every
launch can meet. Real mpiexec ranks: one that never reaches MPI_Init (an MPMD launch whose
rank 1 only sleeps), rank 0 stopped during set-up; real abstract sockets for the arrival marks.
The tests that start mpiexec themselves are in tests/mpi/test_setup_timeouts.py.
"""

from __future__ import annotations

import os

import pytest

from mpifl.core.errors import ConfigError
from mpifl.experiment.config import MIN_SETUP_BOUND_S, RunConfig, load_config
from mpifl.runtime.init_watch import arrived, mark_arrival, message
from tests.helpers import small_fmnist_job
from tests.inprocess.test_setup_agreement import mpifl_lines
from tests.world import world_run

# --------------------------------------------------------------------------- the bounds


def test_defaults_are_minutes():
    run = RunConfig()
    assert (run.init_timeout_s, run.setup_timeout_s) == (120.0, 180.0)
    assert MIN_SETUP_BOUND_S == 5.0


@pytest.mark.parametrize("key", ["init_timeout_s", "setup_timeout_s"])
@pytest.mark.parametrize("value", ["0.001", "4.9", "1"])
def test_a_bound_no_launch_can_meet_is_refused(key, value):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"run.{key}={value}"])
    assert str(info.value) == (
        f"run.{key}: must be 0 (no bound) or at least 5 s: ranks take seconds to start, so a "
        f"shorter bound ends every launch (got {value})")


@pytest.mark.parametrize("value", ["0", "5", "5.5", "3600"])
def test_zero_and_reachable_bounds_are_accepted(value):
    cfg = load_config(None, [f"run.init_timeout_s={value}", f"run.setup_timeout_s={value}"])
    assert cfg.run.init_timeout_s == cfg.run.setup_timeout_s == float(value)


# --------------------------------------------------------------------------- arrival marks


def test_arrival_marks_are_seen_while_held():
    agent = os.getpid()  # any number both sides agree on; the launcher's agent in a real job
    marks = [mark_arrival(agent, r) for r in (0, 2)]
    try:
        assert arrived(agent, 4) == [0, 2]
        assert arrived(agent + 1, 4) == []  # another job's agent
    finally:
        for m in marks:
            m.close()
    assert arrived(agent, 4) == []
    assert mark_arrival(None, 0) is None


def test_the_watchdog_lines():
    # every rank on this node: the missing ones are known
    assert message(0, 3, 5, [0, 2], 3).startswith(
        "rank(s) 1 did not reach MPI_Init within run.init_timeout_s = 5 s, while rank(s) 0, 2 "
        "waited there for them (hung or failed before it: their own output may say why); "
        "ending the job")
    assert message(0, 3, 5, [0, 1, 2], 3).startswith(
        "MPI_Init did not finish within run.init_timeout_s = 5 s although every rank (0-2) "
        "reached it: the launcher's PMI exchange broke")
    # ranks on other nodes, or no marks: only what this node knows
    assert message(1, 8, 120, [0, 1], 2).startswith(
        "rank 1 waited run.init_timeout_s = 120 s in MPI_Init for the other ranks (0, 2-7); on "
        "this node rank(s) 0-1 arrived of 2: one of them did not reach MPI_Init")
    assert message(2, 3, 5, None, 3).startswith(
        "rank 2 waited run.init_timeout_s = 5 s in MPI_Init for the other ranks (0-1): one of them")
    # every rank arrived and the exchange bound passed first
    assert message(0, 2, 120, [0, 1], 2, exchange_s=30).startswith(
        "MPI_Init did not finish within 30 s of the last rank's arrival although every rank "
        "(0-1) reached it: the launcher's PMI exchange broke")


def _watchdog(victim: int, agent: int, timeout_s: float, exchange_s: float):
    """The watchdog of process ``victim``, a rank of 2 on one SLURM node whose launcher's agent
    is ``agent``, as :func:`mpifl.runtime.init_watch.start` runs it (its stdin open)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("MPI_LOCALNRANKS",
                                                            "OMPI_COMM_WORLD_LOCAL_SIZE")}
    code = ("import sys; from mpifl.runtime.init_watch import _watch; "
            f"_watch({victim}, {timeout_s}, 0, 2, {agent}, {exchange_s})")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**env, "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2"})


@pytest.mark.parametrize("ranks_up", [(0, 1), (0,)], ids=["every rank arrived", "rank 1 missing"])
def test_a_hung_exchange_ends_the_rank_soon_after_the_last_arrival(ranks_up):
    """Every rank's mark up and MPI_Init still waiting: the watchdog fires 1 s after it saw
    the last arrival, not at run.init_timeout_s (60 s here); with rank 1 missing it waits for
    the timeout (3 s here) and names rank 1. Real processes, real abstract sockets."""
    import signal
    import subprocess
    import time

    victim = subprocess.Popen(["sleep", "600"])  # a rank stuck in MPI_Init
    agent = victim.pid  # any number the marks and the watchdog agree on
    marks = [mark_arrival(agent, r) for r in ranks_up]
    timeout_s = 60.0 if len(ranks_up) == 2 else 3.0
    t0 = time.monotonic()
    watchdog = _watchdog(victim.pid, agent, timeout_s, exchange_s=1.0)
    try:
        assert victim.wait(timeout=30) == -signal.SIGKILL
        took = time.monotonic() - t0
        for m in marks:  # the other ranks end with it (the watchdog holds its report till then)
            m.close()
        _, err = watchdog.communicate(timeout=60)
    finally:
        victim.kill()
        watchdog.kill()
        for m in marks:
            m.close()
    if len(ranks_up) == 2:
        assert took < 20, took  # 1 s after the marks were seen; the timeout was 60 s
        assert err.startswith("mpifl: error: MPI_Init did not finish within 1 s of the last "
                              "rank's arrival although every rank (0-1) reached it"), err
    else:
        assert took >= 3, took
        assert err.startswith("mpifl: error: rank(s) 1 did not reach MPI_Init within "
                              "run.init_timeout_s = 3 s"), err


# --------------------------------------------------------------------------- real launches


SHORT_INIT = world_run("timeouts-short-init", [
    "run", "{dir}/timeouts-short.toml", "--out", "{dir}/timeouts-short-init.h5", "--no-progress"],
    files={"timeouts-short.toml": small_fmnist_job(
        "timeouts", seed=1, rounds=2, eval_every=1, checkpoint_every=0,
        partition='partition = "shards"', algorithm="fedavg").replace(
            "[run]", "[run]\ninit_timeout_s = 0.001")})


def test_an_unreachable_init_bound_is_refused_on_every_rank(world):
    """3 ranks (the shared world, tests/world.py): refused on every rank, one line, nothing
    written."""
    assert world.status(SHORT_INIT) == 2, world.output(SHORT_INIT)[-3000:]
    assert mpifl_lines(world.output(SHORT_INIT)) == [
        "mpifl: error: run.init_timeout_s: must be 0 (no bound) or at least 5 s: ranks take "
        "seconds to start, so a shorter bound ends every launch (got 0.001)"]
    assert not world.path("timeouts-short-init.h5").exists()


@pytest.mark.parametrize("init_returns", [False, True], ids=["stuck", "returns in time"])
def test_sigterm_in_mpi_init_ends_a_stuck_rank_after_the_grace(init_returns):
    """SIGTERM to the step while a rank waits in MPI_Init: the watchdog ends the rank
    TERM_GRACE_S later unless MPI_Init returns first (its stdin closes), instead of leaving it
    to the launcher's SIGKILL. Real processes and signals."""
    import signal
    import subprocess
    import time

    from mpifl.runtime.init_watch import TERM_GRACE_S

    victim = subprocess.Popen(["sleep", "600"])
    watchdog = _watchdog(victim.pid, victim.pid, timeout_s=600, exchange_s=600)
    try:
        time.sleep(2)  # the watchdog has started and installed its handler
        t0 = time.monotonic()
        watchdog.send_signal(signal.SIGTERM)
        if init_returns:
            time.sleep(1)
            watchdog.stdin.close()  # MPI_Init returned within the grace
            assert watchdog.wait(timeout=30) == 0
            assert victim.poll() is None  # left to act on the signal itself
        else:
            assert victim.wait(timeout=30) == -signal.SIGKILL
            assert TERM_GRACE_S <= time.monotonic() - t0 < TERM_GRACE_S + 10
            assert watchdog.wait(timeout=30) == 0
    finally:
        victim.kill()
        watchdog.kill()
