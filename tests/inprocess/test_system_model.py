"""The simulated system model (mpifl.clients.system) and its traces (mpifl.clients.traces):
keyed draws, round times, periodic and traced availability, the CSV formats, and the FedScale
converter on pickles written in FedScale's published structure (plain dicts)."""

from __future__ import annotations

import collections
import pickle
import time

import numpy as np
import pytest
from pydantic import ValidationError

from mpifl.clients.system import DEFAULT_TIERS, SystemModel, SystemParams, Tier
from mpifl.clients.traces import (convert_fedscale, load_plain_pickle, read_availability_trace,
                                  write_availability_trace, write_device_trace)
from mpifl.core.errors import DataError

MODEL_BYTES = 2_000_000


def model(k=1000, seed=3, **params) -> SystemModel:
    return SystemModel(SystemParams(enabled=True, **params), seed, k, MODEL_BYTES)


def test_draws_are_keyed_by_seed():
    a, b, c = model(seed=3), model(seed=3), model(seed=4)
    for name in ("tier", "seconds_per_sample", "down_mbps", "up_mbps", "latency_s"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.seconds_per_sample, c.seconds_per_sample)
    assert a.tier.dtype == np.int64 and a.tier.shape == (1000,)
    assert a.tier_names == ["fast", "medium", "slow"]


def test_tier_shares_and_spread():
    m = model(k=100_000)
    shares = np.bincount(m.tier, minlength=3) / 100_000
    assert np.allclose(shares, [t.share for t in DEFAULT_TIERS], atol=0.01)
    for i, tier in enumerate(DEFAULT_TIERS):
        log_ratio = np.log(m.seconds_per_sample[m.tier == i] / tier.seconds_per_sample)
        assert abs(np.median(log_ratio)) < 0.03 and abs(log_ratio.std() - 0.5) < 0.03
        net = np.log(m.down_mbps[m.tier == i] / tier.down_mbps)
        assert np.allclose(net, np.log(m.up_mbps[m.tier == i] / tier.up_mbps))
    flat = model(k=500, spread=0.0)
    medians = np.array([t.seconds_per_sample for t in DEFAULT_TIERS])
    assert np.array_equal(flat.seconds_per_sample, medians[flat.tier])


def test_round_seconds_formula():
    m = model(k=50)
    ids = np.array([7, 0, 49, 7])
    samples = np.array([120, 3, 999, 1])
    got = m.round_seconds(ids, samples, epochs=3)
    assert got.shape == (4,) and got.dtype == np.float64
    for i, k in enumerate(ids):
        bits = MODEL_BYTES * 8
        want = (m.latency_s[k] + bits / (m.down_mbps[k] * 1e6)
                + 3 * samples[i] * m.seconds_per_sample[k]
                + m.latency_s[k] + bits / (m.up_mbps[k] * 1e6))
        assert got[i] == pytest.approx(want, rel=1e-12)
    with pytest.raises(IndexError):
        m.round_seconds(np.array([50]), np.array([1]), 1)


def test_always_available():
    m = model(k=30)
    assert m.available(123.0).all() and m.available(123.0).shape == (30,)
    assert np.isinf(m.available_until(np.arange(5), 9.0)).all()


def test_periodic_availability_fraction_and_until():
    period = 1000.0
    m = model(k=20_000, availability="periodic", period_s=period)
    grid = np.arange(0.0, 3 * period, 37.0)
    on = np.mean([m.available(t) for t in grid], axis=0)
    for i, tier in enumerate(DEFAULT_TIERS):
        assert on[m.tier == i].mean() == pytest.approx(tier.available_fraction, abs=0.02)
    assert model(k=20_000, availability="periodic", period_s=period, seed=5).available(
        0.0).mean() == pytest.approx(0.65, abs=0.02)  # 0.2*0.9 + 0.5*0.7 + 0.3*0.4
    t, ids = 1234.5, np.arange(2000)
    now, until = m.available(t)[ids], m.available_until(ids, t)
    assert np.array_equal(until[~now], np.full((~now).sum(), t))
    assert (until[now] > t).all() and (until[now] <= t + period).all()
    assert m.available(until[now][0] - 1e-6)[ids[now][0]]
    assert not m.available(until[now][0] + 1e-6)[ids[now][0]]
    nxt = m.next_available(t)
    assert t < nxt <= t + period
    assert (m.available(nxt + 1e-6) & ~m.available(nxt - 1e-6)).any()  # someone turns on
    assert model(k=3).next_available(t) == float("inf")
    always = SystemParams(availability="periodic", tiers=[
        Tier(name="x", share=1.0, seconds_per_sample=0.1, down_mbps=1, up_mbps=1)])
    assert np.isinf(SystemModel(always, 0, 10, 1).available_until(np.arange(10), 5.0)).all()


def test_device_trace_round_trip(tmp_path):
    m = model(k=300)
    path = tmp_path / "devices.csv"
    write_device_trace(path, m.tier_names, m)
    back = model(k=200, seed=99, device_trace=str(path))
    for name in ("tier", "seconds_per_sample", "down_mbps", "up_mbps", "latency_s"):
        assert np.array_equal(getattr(back, name), getattr(m, name)[:200])
    ids = np.arange(0, 200, 7)
    assert np.array_equal(back.round_seconds(ids, ids + 1, 2), m.round_seconds(ids, ids + 1, 2))
    # quoted names and spaces: the line-by-line reader (numpy's is for plain files) agrees
    slow = tmp_path / "quoted.csv"
    slow.write_text(path.read_text().replace(",fast,", ',"fast",').replace(",slow,", ", slow ,"))
    again = model(k=200, device_trace=str(slow))
    for name in ("tier", "seconds_per_sample", "down_mbps", "up_mbps", "latency_s"):
        assert np.array_equal(getattr(again, name), getattr(back, name))
    with pytest.raises(DataError, match=r"300 clients, but the run has 301"):
        model(k=301, device_trace=str(path))


def test_availability_trace_against_brute_force(tmp_path):
    rows = [(0, 10, 20), (0, 15, 30), (0, 30, 40), (0, 50, 60),  # overlap, touch, gap
            (2, 100, 200), (2, 0, 5),  # unsorted
            (3, 7.5, 8.25), (9, 0, 1e9)]  # client 9 >= K is ignored; client 1 has no rows
    path = tmp_path / "availability.csv"
    write_availability_trace(path, *map(np.array, zip(*rows)))
    m = model(k=5, availability_trace=str(path))
    for t in np.arange(-1.0, 210.0, 0.25):
        want = np.zeros(5, dtype=bool)
        for k, s, e in rows:
            if k < 5 and s <= t < e:
                want[k] = True
        assert np.array_equal(m.available(t), want), t
        until = m.available_until(np.arange(5), t)
        for k in range(5):  # follow the chain of overlapping or touching rows
            end, longer = t, True
            while longer:
                reach = [e for kk, s, e in rows if kk == k and s <= end < e]
                longer = bool(reach)
                end = max(reach, default=end)
            assert until[k] == end, (t, k)
    assert m.next_available(5.0) == 7.5 and m.next_available(100.0) == float("inf")
    iv = read_availability_trace(path, 5)
    assert iv.indptr.tolist() == [0, 2, 2, 4, 5, 5]
    assert iv.end.tolist() == [40.0, 60.0, 5.0, 200.0, 8.25]


@pytest.mark.parametrize("text, problem", [
    ("client,tier,seconds_per_sample\n0,fast,1\n", ":1: header must be"),
    ("HEAD\n0,fast,0.1,1,1\n", ":2: 5 fields, expected 6"),
    ("HEAD\n0,fast,0.1,1,1,0\nx,fast,0.1,1,1,0\n", ":3: client 'x' is not an integer"),
    ("HEAD\n0,turbo,0.1,1,1,0\n", ":2: tier 'turbo' is not one of"),
    ("HEAD\n0,fast,0,1,1,0\n", ":2: seconds_per_sample must be finite and > 0"),
    ("HEAD\n0,fast,0.1,nan,1,0\n", ":2: down_mbps must be finite"),
    ("HEAD\n0,fast,0.1,1,1,-1\n", ":2: latency_s must be finite and >= 0"),
    ("HEAD\n0,fast,0.1,1,1,0\n\n0,slow,0.1,1,1,0\n", ":4: client 0 again (first on line 2)"),
    ("HEAD\n0,fast,0.1,1,1,0\n2,slow,0.1,1,1,0\n", ": client 1 has no row"),
])
def test_bad_device_trace_lines(tmp_path, text, problem):
    path = tmp_path / "dev.csv"
    path.write_text(text.replace("HEAD", "client,tier,seconds_per_sample,down_mbps,up_mbps,"
                                 "latency_s"))
    with pytest.raises(DataError) as err:
        model(k=1, device_trace=str(path))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(str(path)) and problem in msg


@pytest.mark.parametrize("text, problem", [
    ("client,start_s,end_s\n0,5,5\n", ":2: end_s 5 must be after start_s 5"),
    ("client,start_s,end_s\n0,1,2\n-1,1,2\n", ":3: client -1 is negative"),
    ("client,start_s,end_s\n0,a,2\n", ":2: start_s 'a' is not a number"),
    ("client,start_s,end_s\n0,1,inf\n", ":2: end_s must be finite"),
])
def test_bad_availability_trace_lines(tmp_path, text, problem):
    path = tmp_path / "av.csv"
    path.write_text(text)
    with pytest.raises(DataError) as err:
        model(k=1, availability_trace=str(path))
    assert "\n" not in str(err.value) and problem in str(err.value)
    with pytest.raises(DataError, match="cannot read"):
        model(k=1, availability_trace=str(tmp_path / "missing.csv"))


def fedscale_files(tmp_path, value=float):
    """Tiny files in FedScale's published structure (benchmark/dataset/data/device_info)."""
    devices = {1: {"computation": value(20.0), "communication": value(8000.0)},
               2: {"computation": value(60.0), "communication": value(1500.0)},
               3: {"computation": value(150.0), "communication": value(300.0)}}
    behave = {1: {"duration": 100, "inactive": [30, 90], "finish_time": 100,
                  "active": [10, 60], "model": "SM-G950F"},
              2: {"duration": 100, "inactive": [50], "finish_time": 200, "active": [0],
                  "model": "Pixel"}}
    (tmp_path / "client_device_capacity").write_bytes(pickle.dumps(devices))
    (tmp_path / "client_behave_trace").write_bytes(pickle.dumps(behave))
    return tmp_path / "client_device_capacity", tmp_path / "client_behave_trace"


def test_fedscale_converter(tmp_path):
    dev, av = fedscale_files(tmp_path)
    out = convert_fedscale(dev, av, tmp_path / "out", num_clients=4, horizon_s=250)
    m = SystemModel(SystemParams(device_trace=str(out["device_trace"]),
                                 availability_trace=str(out["availability_trace"])), 0, 4, 1000)
    # client i <- the i-th id (sorted), cyclically; 3 x inference ms -> training s per sample
    assert np.allclose(m.seconds_per_sample, [0.06, 0.18, 0.45, 0.06])
    assert np.allclose(m.down_mbps, [8.0, 1.5, 0.3, 8.0]) and np.allclose(m.up_mbps, m.down_mbps)
    assert m.latency_s.tolist() == [0.0] * 4
    assert [m.tier_names[t] for t in m.tier] == ["fast", "medium", "slow", "fast"]
    # client 0 = FedScale 1: on [10,30) and [60,90), repeated every 100 s up to 250 s
    on0 = [t for t in range(0, 300) if m.available(float(t))[0]]
    want = [t for t in range(0, 300) for a, b in ((10, 30), (60, 90)) for r in range(3)
            if a + 100 * r <= t < b + 100 * r and a + 100 * r < 250]
    assert on0 == sorted(want)
    assert m.available_until(np.array([1, 2]), 20.0).tolist() == [50.0, 30.0]  # 2 cycles to 1
    assert not m.available(1000.0).any()  # no wrap beyond the horizon
    one = convert_fedscale(None, av, tmp_path / "one")
    assert set(one) == {"availability_trace"}
    assert read_availability_trace(one["availability_trace"], 2).end.tolist() == [30, 90, 50]


def test_fedscale_numpy_scalars_are_read(tmp_path):
    dev, _ = fedscale_files(tmp_path, value=np.float64)
    assert load_plain_pickle(dev)[2]["computation"] == 60.0
    out = convert_fedscale(dev, None, tmp_path / "out")
    assert model(k=3, device_trace=str(out["device_trace"])).down_mbps.tolist() == [8, 1.5, 0.3]


class _Opens:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickles_with_classes_are_refused(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil"
    evil.write_bytes(pickle.dumps({1: _Opens(str(marker))}))
    with pytest.raises(DataError, match=r"needs io\.open; only plain") as err:
        convert_fedscale(evil, None, tmp_path / "out")
    assert not marker.exists() and "\n" not in str(err.value)
    ordered = tmp_path / "ordered"
    ordered.write_bytes(pickle.dumps(collections.OrderedDict({1: {"computation": 1.0}})))
    with pytest.raises(DataError, match=r"needs collections\.OrderedDict"):
        convert_fedscale(ordered, None, tmp_path / "out")
    dev, _ = fedscale_files(tmp_path)
    (tmp_path / "cut").write_bytes(dev.read_bytes()[:-9])
    with pytest.raises(DataError, match="not a readable pickle"):
        convert_fedscale(tmp_path / "cut", None, tmp_path / "out")
    (tmp_path / "list").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(DataError, match="expected a non-empty dict"):
        convert_fedscale(tmp_path / "list", None, tmp_path / "out")
    (tmp_path / "nocomm").write_bytes(pickle.dumps({0: {"computation": 5.0}}))
    with pytest.raises(DataError, match="client 0 has no 'communication'"):
        convert_fedscale(tmp_path / "nocomm", None, tmp_path / "out")


def test_params_are_validated():
    tier = dict(seconds_per_sample=0.1, down_mbps=1.0, up_mbps=1.0)
    with pytest.raises(ValidationError, match="tiers\n.*shares must sum to 1"):
        SystemParams(tiers=[Tier(name="a", share=0.5, **tier)])
    with pytest.raises(ValidationError, match="names must be distinct"):
        SystemParams(tiers=[Tier(name="a", share=0.5, **tier), Tier(name="a", share=0.5, **tier)])
    with pytest.raises(ValidationError, match="replaces availability"):
        SystemParams(availability="periodic", availability_trace="x.csv")
    with pytest.raises(ValidationError):
        Tier(name="a", share=1.0, seconds_per_sample=0.0, down_mbps=1.0, up_mbps=1.0)
    with pytest.raises(ValidationError):
        SystemParams(spread=-1.0)
    assert [t.share for t in SystemParams().tiers] == [0.2, 0.5, 0.3]


def test_a_million_clients_build_quickly():
    start = time.perf_counter()
    m = model(k=1_000_000, availability="periodic")
    assert time.perf_counter() - start < 5.0  # a guard: ~0.3 s on a laptop core
    assert m.available(5.0).shape == (1_000_000,)
