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

**The counter generator** (``[data.params] generator = "counter"``; the default ``"pcg64"`` is
the above). The same law, every draw a value of the counter-based generator of
:mod:`mpifl.core.counter` (Salmon et al., SC 2011) keyed by ``(seed, SYNTHETIC_COUNTER_TAG, k,
stream)`` and an index: stream 0 gives n_k, 1 gives u_k, B_k, W_k, b_k, v_k (in that order), 2
the samples (sample i's feature f at index 60 i + f), 3 the train/test split, a keyed
permutation (:func:`mpifl.core.counter.orders_torch`) replacing ``default_rng([seed, k,
SPLIT_TAG])`` for this generator, in the eager split and the lazy one alike. Uniforms are
``(v + 0.5) / 2^32`` of 32-bit values (exact in float64, never 0 or 1), normals Box-Muller
pairs in float64 (:func:`_normals`), cast to float32 where the pcg64 path has float32 (W_k,
b_k, v_k, x); the logits are summed in a fixed pairwise order (:func:`_logits`). So a whole
window of clients is drawn at once with torch on any device (:func:`counter_window`, a lazy
population's ``fill_many``), and the K sizes in one vectorised pass on the CPU
(:func:`counter_sizes`, K = 10^6: ~0.5 s against ~6 s for :func:`client_sizes`).

Exactness contract of the counter generator: the eager data (:func:`generate_counter`, every
client at once on the CPU) and a lazy window drawn on the CPU are bit-identical on one CPU type
(torch's vectorised float64 ``log``, ``cos`` and ``sin`` are not promised equal across
instruction sets, e.g. AVX2 and AVX-512) (a client's
rows depend on nothing but its key: every operation is element-wise or the row's own
fixed-order sum); the integers (hashes, n_k, always computed on the CPU, the split's
permutations) are exact on every device. On a GPU the float64 ``log``, ``cos`` and ``sin`` may
differ from the CPU's in the last ulp, so a window drawn on CUDA equals the CPU's within float
rounding, and a label may flip where two logits are a near-tie.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np
import torch
from torch import Tensor

from mpifl.core.counter import key_torch, orders_torch, values_torch
from mpifl.core.rng import SYNTHETIC_COUNTER_TAG, SYNTHETIC_TAG

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


# --------------------------------------------------------------------------- counter generator
#
# ``generator = "counter"``: the same law, every draw a value of the counter-based generator of
# mpifl.core.counter keyed by (seed, SYNTHETIC_COUNTER_TAG, k, stream), so a whole window of
# clients is drawn in a few element-wise torch kernels on any device (see the module docstring).

#: The streams of client k's key: its n_k, its model and feature means, its samples, its split.
STREAM_SIZE, STREAM_CLIENT, STREAM_SAMPLES, STREAM_SPLIT = 0, 1, 2, 3
#: Client k's normals of STREAM_CLIENT: u_k, B_k, then W_k (row-major 60 x 10), b_k, v_k.
_CLIENT_NORMALS = 2 + NUM_FEATURES * NUM_CLASSES + NUM_CLASSES + NUM_FEATURES
#: Sample rows drawn per kernel batch: the (rows, 60, 10) float32 products of the logits take
#: 2.4 KB a row, so a batch holds ~20 MB on a CPU (cache-sized) and ~300 MB on a GPU.
_ROWS_CPU, _ROWS_DEVICE = 1 << 13, 1 << 17


def _normals(v: Tensor) -> Tensor:
    """Box-Muller in float64: (..., 2p) 32-bit values (int64) -> (..., 2p) standard normals.

    Values 2i and 2i+1 give the uniforms ``u = (v + 0.5) / 2^32`` (exact in float64, in (0, 1),
    so the logarithm is finite; the normals' tails stop at ~6.66) and normals 2i, 2i+1 are
    ``r cos(theta)``, ``r sin(theta)`` with ``r = sqrt(-2 log u_2i)``, ``theta = 2 pi u_2i+1``.
    """
    u = (v.to(torch.float64) + 0.5) * 2.0**-32
    r = torch.sqrt(-2.0 * torch.log(u[..., 0::2]))
    theta = (2.0 * math.pi) * u[..., 1::2]
    return torch.stack((r * torch.cos(theta), r * torch.sin(theta)), dim=-1).flatten(-2)


def counter_sizes(num_clients: int, seed: int) -> np.ndarray:
    """(K,) int64 n_k of the counter generator, all at once on the CPU (K = 10^6: ~0.5 s).

    ``n_k = min(floor(exp(4 + 2 z_k)), 950) + 50`` (the lognormal(4, 2) of the module
    docstring, capped at 1,000) with z_k the first normal of client k's STREAM_SIZE. Always on
    the CPU, so every rank computes the same sizes whatever its device.
    """
    if num_clients < 0 or seed < 0:
        raise ValueError(f"num_clients and seed must be >= 0, got {num_clients}, {seed}")
    h1, h2 = key_torch(seed, SYNTHETIC_COUNTER_TAG, torch.arange(num_clients), STREAM_SIZE)
    z = _normals(values_torch(h1[:, None], h2[:, None], torch.arange(2)))[:, 0]
    n = torch.floor(torch.exp(LOG_MEAN + LOG_SIGMA * z))
    cap = MAX_SAMPLES_PER_CLIENT - MIN_SAMPLES_PER_CLIENT  # min before the cast: no inf to int
    return (torch.clamp(n, max=cap).to(torch.int64) + MIN_SAMPLES_PER_CLIENT).numpy()


def counter_window(ids: np.ndarray, sizes: np.ndarray, *, seed: int, alpha: float = 1.0,
                   beta: float = 1.0, device: torch.device | str = "cpu"
                   ) -> tuple[Tensor, Tensor, np.ndarray]:
    """Clients ``ids``' samples drawn at once by the counter generator on ``device``.

    Args:
        ids: (m,) int64 client ids (any order, repeats allowed).
        sizes: (m,) int64 their n_k (:func:`counter_sizes`).

    Returns:
        x (n, 60) float32 and y (n,) int64 on ``device``, and ptr (m+1,) int64 (numpy): client
        j's samples at rows ``ptr[j]:ptr[j+1]``.

    Exactness: a client's rows depend only on (seed, k, alpha, beta), not on the other clients
    of the window nor its batches (every operation is element-wise or a row's own sequential
    sum), so on the CPU any window's rows equal the eager data's bit for bit. Hashes are exact
    on every device; on a GPU the float64 log, cos and sin may differ from the CPU's in the last
    ulp, so x agrees with the CPU's within float32 rounding and a label may flip at a near-tie
    of two logits.
    """
    dev = torch.device(device)
    ptr = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(sizes, out=ptr[1:])
    n = int(ptr[-1])
    x = torch.empty((n, NUM_FEATURES), dtype=torch.float32, device=dev)
    y = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return x, y, ptr
    k = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=dev)
    h1, h2 = key_torch(seed, SYNTHETIC_COUNTER_TAG, k, STREAM_CLIENT, device=dev)
    z = _normals(values_torch(h1[:, None], h2[:, None],
                         torch.arange(_CLIENT_NORMALS, device=dev)))
    u, b_mean = alpha * z[:, :1], beta * z[:, 1:2]
    cut = 2 + NUM_FEATURES * NUM_CLASSES
    w = (u + z[:, 2:cut]).to(torch.float32).view(-1, NUM_FEATURES, NUM_CLASSES)
    b = (u + z[:, cut:cut + NUM_CLASSES]).to(torch.float32)
    v = (b_mean + z[:, cut + NUM_CLASSES:]).to(torch.float32)
    s1, s2 = key_torch(seed, SYNTHETIC_COUNTER_TAG, k, STREAM_SAMPLES, device=dev)
    starts = torch.as_tensor(ptr[:-1], device=dev)
    seg = torch.repeat_interleave(torch.arange(len(ids), device=dev),
                                  torch.as_tensor(np.asarray(sizes, dtype=np.int64), device=dev),
                                  output_size=n)
    std = torch.as_tensor(_FEATURE_STD, device=dev)
    cols = torch.arange(NUM_FEATURES, device=dev)
    step = _ROWS_CPU if dev.type == "cpu" else _ROWS_DEVICE
    for lo in range(0, n, step):
        rows = torch.arange(lo, min(lo + step, n), device=dev)
        j = seg[rows]
        # sample i of its client has counters 60 i + f: feature f's normal (pairs 2q, 2q + 1)
        counter = (rows - starts[j])[:, None] * NUM_FEATURES + cols
        xs = _normals(values_torch(s1[j, None], s2[j, None], counter)).to(torch.float32)
        xs = xs * std + v[j]  # two roundings, as the pcg64 path's `x *= std; x += v`
        x[lo:lo + len(rows)] = xs
        y[lo:lo + len(rows)] = torch.argmax(_logits(xs, w[j], b[j]), dim=1)
    return x, y, ptr


def _logits(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """(r, 10) float32 ``x_i W + b`` of each row with its own (60, 10) W and (10,) b: the 60
    products summed pairwise in a fixed tree of element-wise adds (no fused multiply-add, no
    matrix kernel or reduction whose summation order could depend on the batch's shape), so a
    row's logits are the same bits in any batch."""
    t = x[:, :, None] * w
    while t.shape[1] > 1:
        half = t.shape[1] // 2
        head = t[:, :half] + t[:, half:2 * half]
        t = head if t.shape[1] % 2 == 0 else torch.cat((head, t[:, 2 * half:]), dim=1)
    return t[:, 0] + b


def counter_orders(ids: np.ndarray, sizes: np.ndarray, *, seed: int,
                   device: torch.device | str = "cpu") -> Tensor:
    """The train/test split order of clients ``ids`` ((m,) int64 with (m,) sizes n_k): the
    permutations of range(n_k) keyed by (seed, SYNTHETIC_COUNTER_TAG, k, STREAM_SPLIT)
    (:func:`mpifl.core.counter.orders_torch`), one after another, (sum n_k,) int64 on
    ``device``; integers, so the same on every device."""
    dev = torch.device(device)
    k = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=dev)
    return orders_torch([seed, SYNTHETIC_COUNTER_TAG, k, STREAM_SPLIT],
                        torch.as_tensor(np.asarray(sizes, dtype=np.int64), device=dev))


def generate_counter(num_clients: int, seed: int, alpha: float = 1.0, beta: float = 1.0
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`generate_synthetic` with the counter generator: every client at once on the CPU
    (the eager data, which a lazy window drawn on the CPU equals bit for bit)."""
    sizes = counter_sizes(num_clients, seed)
    x, y, _ = counter_window(np.arange(num_clients, dtype=np.int64), sizes, seed=seed,
                             alpha=alpha, beta=beta)
    return x.numpy(), y.numpy(), sizes


def fill_counter(k: int, x: np.ndarray, y: np.ndarray, *, seed: int, alpha: float = 1.0,
                 beta: float = 1.0) -> None:
    """:func:`fill_client` with the counter generator: client k's samples into x (n_k, 60)
    float32 and y (n_k,) int64 (n_k = len(y))."""
    xs, ys, _ = counter_window(np.array([k], dtype=np.int64), np.array([len(y)]), seed=seed,
                               alpha=alpha, beta=beta)
    x[...], y[...] = xs.numpy(), ys.numpy()
