"""Synthetic(alpha, beta): the heterogeneous logistic-regression data of FedProx.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous
Networks", MLSys 2020, section 5.1 and its reference code ``generate_synthetic.py``. Per client k:

- ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)`` (model and data heterogeneity),
- ``W_k ~ N(u_k, 1)`` (60 x 10), ``b_k ~ N(u_k, 1)`` (10), ``v_k ~ N(B_k, 1)`` (60),
- ``x ~ N(v_k, diag(j^-1.2))`` for feature j = 1..60,
- ``y = argmax(softmax(W_k^T x + b_k))``,
- ``n_k = floor(lognormal(4, 2)) + 50`` samples.

Deviations, both deliberate: as in the reference code, alpha and beta are used as standard
deviations (numpy's ``scale``; the paper writes N(0, alpha) without saying which), and n_k is
capped at :data:`MAX_SAMPLES_PER_CLIENT` because the lognormal tail (up to ~10^5 samples for one
client when K = 10,000) would otherwise dominate memory; with the cap the mean is about 240
samples, so K = 10,000 clients take about 0.6 GB of float32 features. Each client is drawn from
its own generator ``default_rng([seed, tag, k])``, so client k's data does not depend on K.
"""

from __future__ import annotations

import math

import numpy as np

from mpifl.core.rng import SYNTHETIC_TAG

NUM_FEATURES = 60
NUM_CLASSES = 10
MIN_SAMPLES_PER_CLIENT = 50
MAX_SAMPLES_PER_CLIENT = 1000
#: n_k's lognormal law: the mean and standard deviation of log n (numpy's mean, sigma)
LOG_MEAN, LOG_SIGMA = 4.0, 2.0

# Feature j (1-based) has variance j^-1.2: later features carry less signal.
_FEATURE_STD = (np.arange(1, NUM_FEATURES + 1, dtype=np.float64) ** -0.6).astype(np.float32)


def _num_samples(rng: np.random.Generator) -> int:
    """n_k, the first draw of client k's generator."""
    n = int(rng.lognormal(LOG_MEAN, LOG_SIGMA)) + MIN_SAMPLES_PER_CLIENT
    return min(n, MAX_SAMPLES_PER_CLIENT)


def expected_samples_per_client() -> float:
    """E[n_k] of :func:`_num_samples`'s law, without drawing: ``min(floor(X) + 50, 1000)`` with
    ``log X ~ N(4, 2^2)`` has mean ``50 + sum_{j=1}^{950} P(X >= j)`` (about 236.8). What a
    client costs on average, for estimating a run's memory before any client is drawn."""
    z = LOG_SIGMA * math.sqrt(2.0)
    tail = sum(0.5 * math.erfc((math.log(j) - LOG_MEAN) / z)
               for j in range(1, MAX_SAMPLES_PER_CLIENT - MIN_SAMPLES_PER_CLIENT + 1))
    return MIN_SAMPLES_PER_CLIENT + tail


def _fill_client(rng: np.random.Generator, alpha: float, beta: float,
                 x: np.ndarray, y: np.ndarray) -> None:
    """Write one client's samples into the views x (n, 60) float32 and y (n,) int64."""
    _num_samples(rng)  # keep the stream aligned with generate_synthetic's first pass
    u = rng.normal(0.0, alpha)
    b_mean = rng.normal(0.0, beta)
    w = rng.normal(u, 1.0, (NUM_FEATURES, NUM_CLASSES)).astype(np.float32)
    b = rng.normal(u, 1.0, NUM_CLASSES).astype(np.float32)
    v = rng.normal(b_mean, 1.0, NUM_FEATURES).astype(np.float32)
    # float32 draws: half the memory traffic of float64, and x is stored as float32 anyway
    rng.standard_normal(x.shape, dtype=np.float32, out=x)
    x *= _FEATURE_STD
    x += v
    # softmax is monotone, so argmax of the logits is argmax of softmax(logits). einsum, not
    # `x @ w`: OpenBLAS threads on these tiny products were 4x slower on a busy machine.
    y[:] = np.argmax(np.einsum("nf,fc->nc", x, w) + b, axis=1)


def generate_synthetic(
    num_clients: int, seed: int, alpha: float = 1.0, beta: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw Synthetic(alpha, beta) for ``num_clients`` clients.

    Returns:
        x (N, 60) float32, y (N,) int64 in 0..9, and sizes (K,) int64 with client k's samples
        at rows ``sum(sizes[:k]) : sum(sizes[:k+1])`` (the "natural" partition).
    """
    def client_rng(k: int) -> np.random.Generator:
        return np.random.default_rng([seed, SYNTHETIC_TAG, k])

    # Two passes so the output is allocated once (no concatenation: half the peak memory).
    sizes = np.array([_num_samples(client_rng(k)) for k in range(num_clients)], dtype=np.int64)
    x = np.empty((int(sizes.sum()), NUM_FEATURES), dtype=np.float32)
    y = np.empty(len(x), dtype=np.int64)
    ptr = np.concatenate([[0], np.cumsum(sizes)])
    for k in range(num_clients):
        lo, hi = ptr[k], ptr[k + 1]
        _fill_client(client_rng(k), alpha, beta, x[lo:hi], y[lo:hi])
    return x, y, sizes
