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

Per client, for a lazy population (:mod:`mpifl.data.lazy`): :func:`client_sizes` gives every
n_k without drawing any sample (O(K) time and 8 bytes a client), :func:`fill_client` draws one
client's samples, bit-identical to its rows in :func:`generate_synthetic`'s output.
"""

from __future__ import annotations

import math
from typing import TypedDict

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


def _client_rng(seed: int, k: int) -> np.random.Generator:
    """Client k's generator: every draw of client k (n_k, then its samples) comes from it."""
    return np.random.default_rng([seed, SYNTHETIC_TAG, k])


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
        return _client_rng(seed, k)

    # Two passes so the output is allocated once (no concatenation: half the peak memory).
    sizes = np.array([_num_samples(client_rng(k)) for k in range(num_clients)], dtype=np.int64)
    x = np.empty((int(sizes.sum()), NUM_FEATURES), dtype=np.float32)
    y = np.empty(len(x), dtype=np.int64)
    ptr = np.concatenate([[0], np.cumsum(sizes)])
    for k in range(num_clients):
        lo, hi = ptr[k], ptr[k + 1]
        _fill_client(client_rng(k), alpha, beta, x[lo:hi], y[lo:hi])
    return x, y, sizes


# --------------------------------------------------------------------------- per client

def fill_client(k: int, x: np.ndarray, y: np.ndarray, *, seed: int, alpha: float = 1.0,
                beta: float = 1.0) -> None:
    """Write client k's samples into x (n_k, 60) float32 and y (n_k,) int64 (views allowed):
    the same values as its rows in ``generate_synthetic(K, seed, alpha, beta)`` for any K > k.
    """
    _fill_client(_client_rng(seed, k), alpha, beta, x, y)


class _PCG64Internal(TypedDict):
    state: int
    inc: int


class _PCG64State(TypedDict):
    """``PCG64.state``'s layout (numpy/random/_pcg64.pyx)."""

    bit_generator: str
    state: _PCG64Internal
    has_uint32: int
    uinteger: int


def client_sizes(num_clients: int, seed: int, chunk: int = 1 << 13) -> np.ndarray:
    """(K,) int64: n_k of every client, equal to ``generate_synthetic(K, seed)[2]``.

    n_k is the first draw of ``default_rng([seed, SYNTHETIC_TAG, k])``. Building K generators
    costs ~30 us each (K = 10^6: half a minute), almost all of it in SeedSequence's hashing,
    which is done here for a chunk of clients at once in numpy (:func:`_pcg64_states`); each
    client then only sets the state of one reused PCG64 and draws its lognormal (~4 us).
    Memory: the output plus O(chunk) temporaries (~0.5 KB a client of the chunk: the states
    as Python ints).
    """
    if num_clients < 0 or seed < 0:
        raise ValueError(f"num_clients and seed must be >= 0, got {num_clients}, {seed}")
    if num_clients > 2**32:
        raise ValueError(f"at most 2^32 clients (one 32-bit entropy word for k), got "
                         f"{num_clients}")
    bits = np.random.PCG64()
    gen = np.random.Generator(bits)
    state: _PCG64State = {"bit_generator": "PCG64", "state": {"state": 0, "inc": 0},
                          "has_uint32": 0, "uinteger": 0}
    sizes = np.empty(num_clients, dtype=np.int64)
    for lo in range(0, num_clients, chunk):
        ks = np.arange(lo, min(lo + chunk, num_clients), dtype=np.uint32)
        for j, (s, inc) in enumerate(_pcg64_states(seed, ks)):
            state["state"]["state"], state["state"]["inc"] = s, inc
            bits.state = state
            sizes[lo + j] = _num_samples(gen)
    return sizes


# SeedSequence's hashing constants (numpy/random/bit_generator.pyx; O'Neill's seed_seq_fe) and
# PCG64's 128-bit LCG multiplier (numpy/random/src/pcg64/pcg64.h).
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645
_M32, _M128 = (1 << 32) - 1, (1 << 128) - 1


def _words(n: int) -> list[int]:
    """n >= 0 as SeedSequence reads an int: little-endian 32-bit words, [0] for 0."""
    out = [n & _M32]
    while n > _M32:
        n >>= 32
        out.append(n & _M32)
    return out


def _pcg64_states(seed: int, ks: np.ndarray) -> list[tuple[int, int]]:
    """(state, inc) of ``PCG64(SeedSequence([seed, SYNTHETIC_TAG, k]))`` for each k of ks
    ((m,) uint32), as Python ints: SeedSequence's mix_entropy and generate_state(4, uint64),
    vectorised over the clients, then PCG64's seeding (pcg_setseq_128_srandom_r).

    The hash constants' sequence does not depend on the entropy, so one scalar walks beside
    the (m,) uint32 arrays; uint32 arithmetic wraps mod 2^32 as the C code's does.
    """
    fixed = [np.full(len(ks), w, dtype=np.uint32) for w in _words(seed) + _words(SYNTHETIC_TAG)]
    entropy = [*fixed, ks.astype(np.uint32)]
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_A) & _M32
        value = value * np.uint32(hash_const)
        return value ^ (value >> np.uint32(16))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        r = np.uint32(_MIX_L) * x - np.uint32(_MIX_R) * y
        return r ^ (r >> np.uint32(16))

    zero = np.zeros(len(ks), dtype=np.uint32)
    pool = [hashmix(entropy[i] if i < len(entropy) else zero) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(4, len(entropy)):
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(entropy[src]))
    hash_const = _INIT_B
    words = []
    for i in range(8):  # generate_state(4, uint64): 8 words, read in little-endian pairs
        value = pool[i % 4] ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_B) & _M32
        value = value * np.uint32(hash_const)
        words.append((value ^ (value >> np.uint32(16))).astype(np.uint64))
    val = [(words[2 * j] | (words[2 * j + 1] << np.uint64(32))).tolist() for j in range(4)]
    return [_pcg64_seeded((v0 << 64) | v1, (v2 << 64) | v3) for v0, v1, v2, v3 in zip(*val)]


def _pcg64_seeded(initstate: int, initseq: int) -> tuple[int, int]:
    """PCG64's (state, inc) after ``pcg_setseq_128_srandom_r(initstate, initseq)``."""
    inc = ((initseq << 1) | 1) & _M128
    state = (inc + initstate) & _M128  # step from state 0 gives inc, then += initstate
    return (state * _PCG_MULT + inc) & _M128, inc
