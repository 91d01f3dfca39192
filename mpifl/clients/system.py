"""Simulated devices and availability: how long each client takes for a round, and when it is on.

The config's ``[system]`` table (:class:`SystemParams`) describes a population of devices as a
few tiers (device classes), each with a share of the clients, a median compute time per sample,
median download/upload bandwidths, a latency and a mean availability. :class:`SystemModel` draws
every client's tier and its own log-normal multipliers once, from the keyed stream
``[seed, SYSTEM_TAG]`` (:mod:`mpifl.core.rng`), or reads them from a device trace; the server
then asks it how many simulated seconds a selected client needs for a round and whether the
client is (still) available. Pure numpy: no MPI, no torch, no dependence on the number of ranks.

A synchronous round of client k with n_k training samples and E epochs takes (seconds)::

    latency_k + 8 * model_bytes / (10^6 * down_k)        # download the global model
    + E * n_k * seconds_per_sample_k                     # local training
    + latency_k + 8 * model_bytes / (10^6 * up_k)        # upload the update

the accounting of FedScale's simulator (Lai et al., "FedScale: Benchmarking Model and System
Performance of Federated Learning at Scale", ICML 2022: compute time per sample times samples
processed, plus model size over bandwidth each way), with a latency per transfer added. With
``client.max_local_steps`` the samples processed are those of the client's capped steps
(:func:`mpifl.clients.minibatches.trained_samples`) instead of ``E * n_k``.

Draws (``[seed, SYSTEM_TAG]``, in this order, K values each): uniforms choosing the tier by its
share; standard normals z_c giving ``seconds_per_sample = tier median * exp(spread * z_c)``;
standard normals z_n giving both bandwidths ``= tier median * exp(spread * z_n)`` (one link per
device: a slow network is slow both ways). So ``spread`` is the log-normal sigma around the
tier's median; device speeds are log-normal in FedScale's model too (``client_metadata.py``,
``get_completion_time_lognormal``). Availability phases come from ``[seed, SYSTEM_TAG, 1]``.

Availability:

* ``"always"``: every client is available at every time.
* ``"periodic"``: client k is on for ``available_fraction * period_s`` seconds of every
  ``period_s`` (default one day), starting at its phase ``u_k * period_s``, u_k ~ U[0, 1): the
  diurnal on/off pattern of phones that train only while idle and charging (Bonawitz et al.,
  "Towards Federated Learning at Scale: System Design", MLSys 2019).
* ``availability_trace``: absolute on-intervals from a CSV (:mod:`mpifl.clients.traces`).

Default tiers: round numbers in the spirit of FedScale's device traces (compute from AI
Benchmark, Ignatov et al., 2019; bandwidth from MobiPerf), spanning ~16x in compute speed and
10-20x in bandwidth, with lower availability for slower devices. They are **not fitted** to any
trace; use :func:`mpifl.clients.traces.convert_fedscale` for FedScale's measured devices.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import Field, ValidationInfo, field_validator

from mpifl.clients.traces import Intervals, read_availability_trace, read_device_trace
from mpifl.core.errors import ConfigError, DataError
from mpifl.core.params import Params, finite
from mpifl.core.rng import SYSTEM_TAG

__all__ = ["Tier", "SystemParams", "SystemModel", "DEFAULT_TIERS"]


class Tier(Params):
    """One device class."""

    name: str = Field(min_length=1)
    """The tier's name (device traces name tiers by it)."""
    share: float = Field(ge=0.0, le=1.0)
    """Fraction of the clients in this tier; the shares of all tiers sum to 1."""
    seconds_per_sample: float = Field(gt=0.0)
    """Median local compute time per training sample per epoch (s)."""
    down_mbps: float = Field(gt=0.0)
    """Median download bandwidth (Mbit/s = 10^6 bit/s)."""
    up_mbps: float = Field(gt=0.0)
    """Median upload bandwidth (Mbit/s)."""
    latency_s: float = Field(0.05, ge=0.0)
    """Latency of each transfer (s); 0 = none."""
    available_fraction: float = Field(1.0, gt=0.0, le=1.0)
    """Mean share of time the device is available ("periodic"); 1 = always on."""

    _finite = field_validator("seconds_per_sample", "down_mbps", "up_mbps", "latency_s")(finite)


#: Round numbers in the spirit of FedScale's traces (module docstring), not fitted.
DEFAULT_TIERS = (
    Tier(name="fast", share=0.2, seconds_per_sample=0.005, down_mbps=50.0, up_mbps=20.0,
         latency_s=0.02, available_fraction=0.9),
    Tier(name="medium", share=0.5, seconds_per_sample=0.02, down_mbps=20.0, up_mbps=5.0,
         latency_s=0.05, available_fraction=0.7),
    Tier(name="slow", share=0.3, seconds_per_sample=0.08, down_mbps=5.0, up_mbps=1.0,
         latency_s=0.2, available_fraction=0.4),
)


class SystemParams(Params):
    """The config's ``[system]`` table (module docstring)."""

    enabled: bool = False
    """Simulate time at all; false = every selected client finishes, no clock."""
    tiers: list[Tier] = Field(default_factory=lambda: list(DEFAULT_TIERS), min_length=1)
    """Device classes; shares must sum to 1, names be distinct."""
    spread: float = Field(0.5, ge=0.0, le=5.0)
    """Log-normal sigma of a client's speed and bandwidth around its tier's median; 0 = all
    alike."""
    availability: Literal["always", "periodic"] = "always"
    """Clients available "always", or "periodic" (on available_fraction of every period_s)."""
    period_s: float = Field(86400.0, gt=0.0)
    """Period of "periodic" availability (s); default one day."""
    device_trace: str | None = None
    """CSV of per-client devices (mpifl.clients.traces); replaces the tiers' draws."""
    availability_trace: str | None = None
    """CSV of on-intervals (mpifl.clients.traces); replaces availability."""
    deadline_s: float | None = Field(None, gt=0.0)
    """Round deadline (s): clients not done by then are left out; None = wait for all."""
    over_commit: float = Field(0.0, ge=0.0, le=100.0)
    """Select ceil(m * (1 + over_commit)) clients and keep the first m to finish; 0 = m."""

    _finite = field_validator("period_s")(finite)

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, tiers: list[Tier]) -> list[Tier]:
        total = sum(t.share for t in tiers)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"shares must sum to 1 (they sum to {total:g})")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"names must be distinct (got {', '.join(names)})")
        return tiers

    @field_validator("availability_trace")
    @classmethod
    def _one_availability(cls, trace: str | None, info: ValidationInfo) -> str | None:
        if trace is not None and info.data.get("availability", "always") != "always":
            raise ValueError("replaces availability: leave availability unset (\"always\") "
                             "when giving a trace")
        return trace


class SystemModel:
    """Every client's device and availability, drawn once (or read from traces).

    Args:
        params: the ``[system]`` table.
        seed: the experiment seed (draws are keyed ``[seed, SYSTEM_TAG]``).
        num_clients: K, the population size.
        model_bytes: bytes of the model sent down and of the update sent up each round.

    Attributes:
        tier: (K,) int64, index into ``tier_names`` (= the params' tier names, in order).
        tier_names: list[str].
        seconds_per_sample, down_mbps, up_mbps, latency_s: (K,) float64 per-client devices.

    Raises:
        DataError: a trace file is missing, malformed or too short (one line).
        ValueError: num_clients < 1 or model_bytes < 0.
    """

    def __init__(self, params: SystemParams, seed: int, num_clients: int,
                 model_bytes: int) -> None:
        if num_clients < 1 or model_bytes < 0:
            raise ValueError(f"need num_clients >= 1 and model_bytes >= 0 "
                             f"(got {num_clients}, {model_bytes})")
        self.params = params
        self.num_clients = int(num_clients)
        self.model_bits = 8.0 * float(model_bytes)
        self.tier_names = [t.name for t in params.tiers]
        if params.device_trace is not None:
            dev = read_device_trace(params.device_trace, self.num_clients, self.tier_names)
            self.tier = dev.tier
            self.seconds_per_sample, self.down_mbps = dev.seconds_per_sample, dev.down_mbps
            self.up_mbps, self.latency_s = dev.up_mbps, dev.latency_s
        else:
            self._draw_devices(seed)
        self._phase = None
        self._intervals: Intervals | None = None
        if params.availability_trace is not None:
            self._intervals = read_availability_trace(params.availability_trace,
                                                      self.num_clients)
        elif params.availability == "periodic":
            self._phase = np.random.default_rng([seed, SYSTEM_TAG, 1]).random(self.num_clients)
            self._phase *= params.period_s

    def _draw_devices(self, seed: int) -> None:
        p, k = self.params, self.num_clients
        rng = np.random.default_rng([seed, SYSTEM_TAG])
        cdf = np.cumsum([t.share for t in p.tiers])
        cdf /= cdf[-1]  # shares sum to 1 within 1e-6; make the last edge exactly 1
        self.tier = np.searchsorted(cdf, rng.random(k), side="right").astype(np.int64)
        compute = np.exp(p.spread * rng.standard_normal(k))
        network = np.exp(p.spread * rng.standard_normal(k))
        median = np.array([[t.seconds_per_sample, t.down_mbps, t.up_mbps, t.latency_s]
                           for t in p.tiers])[self.tier]
        self.seconds_per_sample = median[:, 0] * compute
        self.down_mbps = median[:, 1] * network
        self.up_mbps = median[:, 2] * network
        self.latency_s = np.ascontiguousarray(median[:, 3])

    def _check(self, ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_clients):
            raise IndexError(f"client ids must be in 0..{self.num_clients - 1}")
        return ids

    def round_seconds(self, ids: np.ndarray, num_samples: np.ndarray, epochs: int) -> np.ndarray:
        """(m,) float64: simulated seconds for client ``ids[i]`` to download the model, train
        ``epochs`` epochs over its ``num_samples[i]`` samples and upload (module docstring)."""
        ids = self._check(ids)
        n = np.asarray(num_samples, dtype=np.float64)
        lat = self.latency_s[ids]
        down = lat + self.model_bits / (self.down_mbps[ids] * 1e6)
        up = lat + self.model_bits / (self.up_mbps[ids] * 1e6)
        return down + epochs * n * self.seconds_per_sample[ids] + up

    def _on_length(self, ids: np.ndarray | None = None) -> np.ndarray:
        frac = np.array([t.available_fraction for t in self.params.tiers], dtype=np.float64)
        tier = self.tier if ids is None else self.tier[ids]
        return frac[tier] * self.params.period_s

    def available(self, t: float) -> np.ndarray:
        """(K,) bool: which clients are available at simulated time ``t`` (s)."""
        if self._intervals is not None:
            out = np.zeros(self.num_clients, dtype=bool)
            out[self._intervals.owner[self._intervals.contains(t)]] = True
            return out
        if self._phase is None:
            return np.ones(self.num_clients, dtype=bool)
        return np.mod(t - self._phase, self.params.period_s) < self._on_length()

    def available_until(self, ids: np.ndarray, t: float) -> np.ndarray:
        """(m,) float64: when the on-interval of ``ids[i]`` that contains ``t`` ends (s);
        ``inf`` when it never ends ("always", or available_fraction = 1), and ``t`` itself for a
        client not available at ``t``."""
        ids = self._check(ids)
        until = np.full(len(ids), float(t))
        if self._intervals is not None:
            iv = self._intervals
            hit = np.flatnonzero(iv.contains(t))  # at most one per client (merged), by owner
            owners = iv.owner[hit]
            if len(hit):
                pos = np.minimum(np.searchsorted(owners, ids), len(hit) - 1)
                found = owners[pos] == ids
                until[found] = iv.end[hit[pos[found]]]
            return until
        if self._phase is None:
            return np.full(len(ids), np.inf)
        on = self._on_length(ids)
        into = np.mod(t - self._phase[ids], self.params.period_s)
        live = into < on
        until[live] = t + (on - into)[live]
        until[live & (on >= self.params.period_s)] = np.inf
        return until

    def longest_window(self) -> np.ndarray:
        """(K,) float64: each client's longest on-interval (s): ``inf`` when it is never
        interrupted ("always", or available_fraction = 1), 0 for a client with no rows in an
        availability trace."""
        if self._intervals is not None:
            iv = self._intervals
            out = np.zeros(self.num_clients)
            np.maximum.at(out, iv.owner, iv.end - iv.start)
            return out
        if self._phase is None:
            return np.full(self.num_clients, np.inf)
        on = self._on_length()
        return np.where(on >= self.params.period_s, np.inf, on)

    def check_rounds(self, num_samples: npt.ArrayLike, epochs: int,
                     deadline_s: float | None = None) -> npt.NDArray[np.bool_]:
        """Which clients can ever finish a round: its round time (:meth:`round_seconds`) is
        finite, within ``deadline_s``, and fits in one of its on-intervals. Called before the
        first round, so a run in which no client could ever finish is refused instead of
        running every round without training.

        Args:
            num_samples: (n,) training samples of clients 0..n-1 (n = K in a run).
            epochs: local epochs a round.
            deadline_s: a synchronous round's deadline (s), or None.

        Returns:
            (n,) bool, True for the clients that can finish some round.

        Raises:
            DataError: a trace that makes a round time non-finite, that gives none of the K
                clients an interval, or whose intervals are all too short for a round.
            ConfigError: the same from ``[system]`` settings (tiers, periodic availability,
                ``deadline_s``).
        """
        p, samples = self.params, np.asarray(num_samples, dtype=np.int64)
        k = len(samples)
        with np.errstate(over="ignore"):  # an overflow is refused just below
            seconds = self.round_seconds(np.arange(k), samples, epochs)
        bad = np.flatnonzero(~np.isfinite(seconds))
        if len(bad):
            c = int(bad[0])
            where = (DataError, f"{p.device_trace}") if p.device_trace is not None else (
                ConfigError, "system.tiers")
            raise where[0](f"{where[1]}: client {c}'s round time is not finite (download "
                           f"{self.down_mbps[c]:g} Mbit/s, {self.seconds_per_sample[c]:g} s a "
                           f"sample x {int(samples[c])} samples x {epochs} "
                           f"epochs, upload {self.up_mbps[c]:g} Mbit/s): simulated time "
                           "would be infinite")
        window = self.longest_window()[:k]
        if p.availability_trace is not None and not (window > 0).any():
            raise DataError(f"{p.availability_trace}: no interval for any of the run's {k} "
                            f"clients (0..{k - 1}): no client is ever available")
        fits = seconds <= window  # as the clock compares: round time <= time left
        quick = seconds <= (np.inf if deadline_s is None else deadline_s)
        can = fits & quick
        if can.any():
            return can
        if not quick.any():
            c = int(np.argmin(seconds))
            raise ConfigError(f"system.deadline_s = {deadline_s:g} s: no client can finish a "
                              f"round within it; the fastest (client {c}) needs "
                              f"{seconds[c]:.4g} s (download, {epochs} epoch(s) over its "
                              f"{int(samples[c])} samples, upload)")
        if not fits.any():
            c = int(np.argmax(window / seconds))
            what = (DataError, f"{p.availability_trace}") if p.availability_trace is not None \
                else (ConfigError, "system.period_s, tiers' available_fraction")
            raise what[0](f"{what[1]}: no client is available long enough to finish a round: "
                          f"the best, client {c}, is on for at most {window[c]:.4g} s at a "
                          f"time and needs {seconds[c]:.4g} s")
        raise ConfigError(f"system.deadline_s = {deadline_s:g} s: the clients fast enough for "
                          "it are never available long enough to finish a round; no client "
                          "can ever finish one")

    def next_available(self, t: float) -> float:
        """The first time strictly after ``t`` (s) at which some client's on-interval starts
        (a periodic phase or a trace interval); ``inf`` when none ever does ("always", or a
        trace that has ended), so an idle simulation can jump to it."""
        if self._intervals is not None:
            later = self._intervals.start[self._intervals.start > t]
            return float(later.min()) if len(later) else float("inf")
        if self._phase is None:
            return float("inf")
        period = self.params.period_s
        wait = np.mod(self._phase - t, period)
        wait[wait <= 0] = period
        return float(t + wait.min())
