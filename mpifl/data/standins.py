"""Generated stand-ins of the federated benchmarks: the published shapes and client-size
statistics, drawn in seconds, learnable (accuracy moves), for running the benchmark jobs where
the real data are absent (timing, CI). Swap one in with ``--set data.dataset=<name>``; every
parameter has a default, so nothing else in the job changes.

================== ============================ ==============================================
name               stands in for                shape (per client k / pool)
================== ============================ ==============================================
femnist_like       LEAF FEMNIST                 x (n_k, 1, 28, 28) float32 in [0, 1], 62 classes
shakespeare_like   LEAF Shakespeare             x (n_k, 80) int64 char ids, y (n_k,) next char
stackoverflow_like TFF StackOverflow            x, y (n_k, 20) int64 word ids, next-word targets
cifar100_like      TFF FedCIFAR100              x (100, 3, 32, 32) float32 standardised, 100 cls
cifar10_like       CIFAR-10 (a pool, no clients) x (60000, 3, 32, 32) float32, 10 classes
================== ============================ ==============================================

Published statistics matched (sources):

- FEMNIST: 3,550 writers, 805,263 samples, 226.83 samples a writer on average, standard
  deviation 88.94; 62 classes (10 digits, 26 upper- and 26 lower-case letters), 28 x 28 grey
  (Caldas et al., "LEAF: A Benchmark for Federated Settings", arXiv:1812.01097, Table 1; the
  LEAF README). FLUTE's FEMNIST task uses 3,400 writers (Dimitriadis et al., "FLUTE", 2022).
  Sizes: lognormal with that mean and standard deviation, rounded, at least 2.
- Shakespeare: 1,129 speaking roles, 4,226,158 samples, mean 3,743.2, standard deviation
  6,212.26 samples a role (LEAF Table 1); each sample is 80 characters and the next one
  (LEAF's 80-character alphabet). FLUTE uses 715 roles. Sizes: lognormal with that mean and
  standard deviation (heavy tail: one draw of 1,129 roles has a mean within about 20 % of the
  law's), at least 2. Ids: 0 = PAD (unused in x), 1..80 the characters.
- StackOverflow: 342,477 training users, 135,818,730 training sentences (about 397 a user;
  ``tff.simulation.datasets.stackoverflow.load_data``), the 10,000 most frequent words, sentences
  cut to 20 tokens (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, TFF's
  ``stackoverflow`` preprocessing; pfl-research's benchmark: vocab_size 10,000,
  max_sequence_length 20). Ids: 0 PAD, 1 out-of-vocabulary, 2 begin, 3 end, 4..10,003 words.
  Only the mean is published: sizes are lognormal with that mean and log-standard-deviation
  :data:`SO_LOG_SIGMA` (a heavy tail of a choice made here), at least 2.
- FedCIFAR100: 500 training clients of 100 images each, labels allotted by the Pachinko
  Allocation Method with alpha = 0.1 over the 20 coarse labels and beta = 10 over each coarse
  label's 5 fine labels (Reddi et al. 2021, appendix C; TFF ``cifar100.load_data``). Here each
  client's labels are drawn from its own PAM mixture (with replacement; TFF draws without
  replacement from the 50,000 images).
- CIFAR-10: 60,000 images (50,000 + 10,000 pooled as mpifl's ``cifar10`` is), 6,000 a class,
  split over clients by mpifl's partitions (``shards``, ``dirichlet``, ``pathological``).

How the samples are made (cheap numpy, learnable):

- Images: one smooth random prototype a class (a 7 x 7 or 8 x 8 Gaussian field upsampled by 4),
  plus per-pixel uniform noise of standard deviation ``noise``; FEMNIST adds a per-writer smooth
  offset (``style``) and per-writer label shares ``Dir(20 * base)``, digits 3.8 times as frequent
  as a letter (the EMNIST ByClass balance, about 42 % digits), clipped to [0, 1]; CIFAR images
  are ``(proto + noise * e) / sqrt(1 + noise^2)`` (e of variance 1): about mean 0, variance 1.
- Text: a first-order chain. Each next token follows the client's successor map
  ``succ_k[prev]`` with probability ``1 - randomness``, else it is a fresh draw from a Zipf
  unigram law (exponent 1); ``succ_k`` is a shared random map with a ``client_mix`` share of its
  entries redrawn per client, so the next token depends on the previous one and on the client.
  Drawn vectorised: after a fresh draw ``r``, the chain reads ``succ^j(r)`` from a table of the
  map's powers.

Randomness is keyed so that any client can be drawn alone: client k's samples from
``default_rng([seed, TAG, k])``, the shared world (prototypes, maps) from ``[seed, TAG + 2]`` and
every client's size at once from ``[seed, TAG + 1]`` (O(K), vectorised: K = 342,477 sizes in
milliseconds). Each data set registers a lazy factory (:class:`ClientSource`) and an eager loader
built from the same ``fill``, so the eager pool's client k equals the lazy client k bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import numpy as np
from pydantic import Field

from mpifl.core.params import Params
from mpifl.data.registry import (CLIENTS, LABELS, PAD, ClientSource, DataPool, DataShape,
                                 register_dataset)

__all__ = ["CIFAR10_TAG", "CIFAR100_TAG", "FEMNIST_TAG", "SHAKESPEARE_TAG", "SO_LOG_SIGMA",
           "STACKOVERFLOW_TAG", "STANDINS", "cifar100_like_clients", "eager_pool",
           "femnist_like_clients", "shakespeare_like_clients", "stackoverflow_like_clients"]

#: Stream tags (client k: [seed, TAG, k]; sizes: [seed, TAG + 1]; shared world: [seed, TAG + 2]).
FEMNIST_TAG = 0x6D707310
SHAKESPEARE_TAG = 0x6D707320
STACKOVERFLOW_TAG = 0x6D707330
CIFAR100_TAG = 0x6D707340
CIFAR10_TAG = 0x6D707350
_SIZES, _WORLD = 1, 2


class _FemnistFacts(TypedDict):
    writers: int
    mean: float  # samples a writer
    std: float
    classes: int


class _ShakespeareFacts(TypedDict):
    roles: int
    mean: float  # samples a role
    std: float
    chars: int


class _StackOverflowFacts(TypedDict):
    users: int
    mean: float  # sentences a user
    words: int


FEMNIST = _FemnistFacts(writers=3550, mean=226.83, std=88.94, classes=62)
SHAKESPEARE = _ShakespeareFacts(roles=1129, mean=3743.2, std=6212.26, chars=80)
STACKOVERFLOW = _StackOverflowFacts(users=342_477, mean=135_818_730 / 342_477, words=10_000)
#: log-standard-deviation of the StackOverflow stand-in's sentences a user (mean and std of
#: about 397 and 1,150): the published figure is the mean only
SO_LOG_SIGMA = 1.5
SO_OOV, SO_BOS, SO_EOS, SO_FIRST_WORD = 1, 2, 3, 4
SO_OOV_SHARE = 0.03      # share of fresh draws that are out of vocabulary
SO_MEAN_WORDS = 12.0     # words a sentence: 1 + Poisson(12)
FEMNIST_DIGIT_WEIGHT = 3.8  # a digit's weight against a letter's 1: ~42 % digits (EMNIST ByClass)
FEMNIST_CONCENTRATION = 20.0  # writers' label shares Dir(20 * base)


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng([seed, *key])


def _lognormal_sizes(rng: np.random.Generator, k: int, mean: float, sigma: float
                     ) -> np.ndarray:
    """(k,) int64 sizes, lognormal with the given mean and log-std, rounded, at least 2."""
    mu = math.log(mean) - sigma * sigma / 2
    return np.maximum(np.rint(rng.lognormal(mu, sigma, k)), 2).astype(np.int64)


def _log_sigma(mean: float, std: float) -> float:
    """The log-std of the lognormal law with this mean and standard deviation."""
    return math.sqrt(math.log1p((std / mean) ** 2))


def _smooth_fields(rng: np.random.Generator, shape: tuple[int, ...], factor: int) -> np.ndarray:
    """float32 Gaussian fields of ``shape`` (last two axes small) upsampled by ``factor``."""
    low = rng.standard_normal(shape, dtype=np.float32)
    return low.repeat(factor, axis=-1).repeat(factor, axis=-2)


def _zipf_cdf(n: int, rng: np.random.Generator) -> np.ndarray:
    """(n,) float64 cumulative Zipf(1) law over n symbols in a random order (last = 1)."""
    w = 1.0 / np.arange(1, n + 1)
    cdf = np.cumsum(w[rng.permutation(n)])
    return cdf / cdf[-1]


def _draw(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-cdf draws (int64 symbols) for uniforms u."""
    return np.minimum(np.searchsorted(cdf, u, side="right"), len(cdf) - 1)


def _chain(rng: np.random.Generator, reset: np.ndarray, succ: np.ndarray, cdf: np.ndarray
           ) -> np.ndarray:
    """A first-order chain over ``len(succ)`` symbols, vectorised: at the ``reset`` positions
    (bool, first one True) a fresh unigram draw r, elsewhere the successor of the previous one,
    i.e. ``succ^j(r)`` j steps after the last draw. Returns int64 symbols."""
    n = len(reset)
    pos = np.arange(n)
    last = np.maximum.accumulate(np.where(reset, pos, 0))
    fresh = np.zeros(n, dtype=np.int64)
    fresh[reset] = _draw(cdf, rng.random(int(reset.sum())))
    steps = pos - last
    powers = np.empty((int(steps.max(initial=0)) + 1, len(succ)), dtype=np.int64)
    powers[0] = np.arange(len(succ))
    for j in range(1, len(powers)):
        powers[j] = succ[powers[j - 1]]
    return powers[steps, fresh[last]]


def _client_succ(rng: np.random.Generator, succ: np.ndarray, mix: float) -> np.ndarray:
    """The shared successor map with a ``mix`` share of its entries redrawn for one client."""
    own = succ.copy()
    redraw = rng.random(len(succ)) < mix
    own[redraw] = rng.integers(0, len(succ), int(redraw.sum()))
    return own


def _uniform_noise(rng: np.random.Generator, std: float, x: np.ndarray) -> None:
    """x[:] = uniform noise of mean 0 and standard deviation ``std`` (float32, in place):
    a uniform draw costs a fifth of a Gaussian one, and the FEMNIST pool is 6 x 10^8 pixels."""
    rng.random(x.shape, dtype=np.float32, out=x)
    x -= np.float32(0.5)
    x *= np.float32(std * math.sqrt(12.0))


def _offsets(sizes: np.ndarray) -> np.ndarray:
    ptr = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=ptr[1:])
    return ptr


def eager_pool(source: ClientSource) -> DataPool:
    """Every client of ``source`` drawn into one pool (client k at rows ``sum(sizes[:k]) :
    sum(sizes[:k+1])``, ``client_sizes`` set), with the same ``fill`` a lazy population uses:
    equal bit for bit."""
    sizes = np.asarray(source.sizes, dtype=np.int64)
    ptr = _offsets(sizes)
    x = np.empty((int(ptr[-1]), *source.input_shape), dtype=source.x_dtype)
    y = np.empty((int(ptr[-1]), *source.target_shape), dtype=np.int64)
    for k in range(len(sizes)):
        source.fill(k, x[ptr[k]:ptr[k + 1]], y[ptr[k]:ptr[k + 1]])
    return DataPool(x, y, source.num_classes, client_sizes=sizes, vocab_size=source.vocab_size)


# --------------------------------------------------------------------------- femnist_like

class FemnistLikeParams(Params):
    """``femnist_like`` (LEAF FEMNIST's shapes and writer sizes)."""

    noise: float = Field(0.5, ge=0.0, le=100.0)
    """Standard deviation of the uniform noise added to each pixel of the class prototype
    (pixels in [0, 1], clipped after); 0: a writer's samples of a class are all alike."""
    style: float = Field(0.15, ge=0.0, le=100.0)
    """Standard deviation of each writer's smooth offset field (a 7 x 7 Gaussian field
    upsampled to 28 x 28, added to all the writer's images: its handwriting); 0: writers differ
    only in their label shares."""


@dataclass(frozen=True)
class _Femnist:
    seed: int
    proto: np.ndarray   # (62, 1, 28, 28) float32
    base: np.ndarray    # (62,) label frequencies
    noise: float
    style: float

    def fill(self, k: int, x: np.ndarray, y: np.ndarray) -> None:
        rng = _rng(self.seed, FEMNIST_TAG, k)
        shares = rng.dirichlet(FEMNIST_CONCENTRATION * self.base)
        offset = _smooth_fields(rng, (1, 7, 7), 4) * np.float32(self.style)
        y[:] = _draw(np.cumsum(shares), rng.random(len(y)))
        _uniform_noise(rng, self.noise, x)
        x += self.proto[y]
        x += offset
        np.clip(x, 0.0, 1.0, out=x)


def femnist_like_clients(*, seed: int, data_root: str | None = None, num_clients: int,
                         noise: float, style: float) -> ClientSource:
    """K writers drawn one at a time: sizes now, each writer's (n_k, 1, 28, 28) float32 images
    in [0, 1] and (n_k,) int64 labels in 0..61 when asked."""
    world = _rng(seed, FEMNIST_TAG + _WORLD)
    proto = 1.0 / (1.0 + np.exp(-3.0 * (_smooth_fields(world, (62, 1, 7, 7), 4) - 0.8)))
    base = np.r_[np.full(10, FEMNIST_DIGIT_WEIGHT), np.ones(52)]
    sizes = _lognormal_sizes(_rng(seed, FEMNIST_TAG + _SIZES), num_clients, FEMNIST["mean"],
                             _log_sigma(FEMNIST["mean"], FEMNIST["std"]))
    gen = _Femnist(seed, proto.astype(np.float32), base / base.sum(), noise, style)
    return ClientSource(sizes, FEMNIST["classes"], (1, 28, 28), gen.fill)


#: Sizes for the memory budget, at the default parameters (the published means above).
_SHAPES = {
    "femnist_like": DataShape((1, 28, 28), 62, samples_per_client=226.8),
    "shakespeare_like": DataShape((80,), 81, samples_per_client=3743.0, vocab_size=81),
    "stackoverflow_like": DataShape((20,), 10_004, samples_per_client=396.6, vocab_size=10_004,
                                    target_shape=(20,)),
    "cifar100_like": DataShape((3, 32, 32), 100, samples_per_client=100.0),
    "cifar10_like": DataShape((3, 32, 32), 10, samples=60_000),
}


@register_dataset("femnist_like", params=FemnistLikeParams, provides=(LABELS, CLIENTS),
                  lazy=femnist_like_clients,
                  shape=_SHAPES["femnist_like"])
def femnist_like(*, seed: int, data_root: str | None = None, num_clients: int, noise: float,
                 style: float) -> DataPool:
    """The K writers' samples in one pool, grouped by writer (``client_sizes``)."""
    return eager_pool(femnist_like_clients(seed=seed, num_clients=num_clients, noise=noise,
                                           style=style))


# --------------------------------------------------------------------------- text chains

class _ChainParams(Params):
    randomness: float = Field(0.4, ge=0.0, le=1.0)
    """Probability that a token is a fresh draw from the Zipf (exponent 1) unigram law rather
    than the successor of the previous token in the client's map; 1: no dependence on the
    previous token (nothing to learn beyond the unigram law), 0: after a fresh start every
    token follows from the previous one."""
    client_mix: float = Field(0.1, ge=0.0, le=1.0)
    """Share of the shared successor map's entries that each client redraws (on average): its
    own next-token habits; 0: every client has the same chain."""


class ShakespeareLikeParams(_ChainParams):
    """``shakespeare_like`` (LEAF Shakespeare's shapes and role sizes)."""

    sequence_length: int = Field(80, ge=1, le=4096)
    """T, characters of context a sample: x (n_k, T) a window of the role's text, y the next
    character (LEAF: 80)."""


@dataclass(frozen=True)
class _Shakespeare:
    seed: int
    succ: np.ndarray   # (80,) int64
    cdf: np.ndarray    # (80,) float64
    randomness: float
    mix: float
    length: int

    def fill(self, k: int, x: np.ndarray, y: np.ndarray) -> None:
        rng = _rng(self.seed, SHAKESPEARE_TAG, k)
        succ = _client_succ(rng, self.succ, self.mix)
        reset = rng.random(len(y) + self.length) < self.randomness
        reset[0] = True
        text = _chain(rng, reset, succ, self.cdf) + 1  # ids 1..80; 0 is PAD
        x[:] = np.lib.stride_tricks.sliding_window_view(text[:-1], self.length)
        y[:] = text[self.length:]


def shakespeare_like_clients(*, seed: int, data_root: str | None = None, num_clients: int,
                             randomness: float, client_mix: float,
                             sequence_length: int) -> ClientSource:
    """K roles drawn one at a time: each role's (n_k, T) int64 windows of its text (ids 1..80)
    and (n_k,) int64 next characters; vocabulary 81 (PAD 0 and 80 characters)."""
    chars = SHAKESPEARE["chars"]
    world = _rng(seed, SHAKESPEARE_TAG + _WORLD)
    gen = _Shakespeare(seed, world.permutation(chars), _zipf_cdf(chars, world), randomness,
                       client_mix, sequence_length)
    sizes = _lognormal_sizes(_rng(seed, SHAKESPEARE_TAG + _SIZES), num_clients,
                             SHAKESPEARE["mean"],
                             _log_sigma(SHAKESPEARE["mean"], SHAKESPEARE["std"]))
    return ClientSource(sizes, chars + 1, (sequence_length,), gen.fill, x_dtype=np.int64,
                        vocab_size=chars + 1)


@register_dataset("shakespeare_like", params=ShakespeareLikeParams, provides=(LABELS, CLIENTS),
                  lazy=shakespeare_like_clients,
                  shape=_SHAPES["shakespeare_like"])
def shakespeare_like(*, seed: int, data_root: str | None = None, num_clients: int,
                     randomness: float, client_mix: float, sequence_length: int) -> DataPool:
    """The K roles' windows in one pool, grouped by role (``client_sizes``)."""
    return eager_pool(shakespeare_like_clients(
        seed=seed, num_clients=num_clients, randomness=randomness, client_mix=client_mix,
        sequence_length=sequence_length))


class StackOverflowLikeParams(_ChainParams):
    """``stackoverflow_like`` (TFF StackOverflow's shapes and user sizes)."""

    sequence_length: int = Field(20, ge=1, le=4096)
    """T, tokens a sample: a sentence is BOS, its words cut to T, EOS if it fits, PAD after;
    x its first T tokens, y the next token at each position (TFF / Reddi et al. 2021: 20)."""


@dataclass(frozen=True)
class _StackOverflow:
    seed: int
    succ: np.ndarray   # (10,001,) int64 over symbols: 0 = OOV, 1.. = words
    cdf: np.ndarray    # (10,001,) float64
    randomness: float
    mix: float
    length: int

    def fill(self, k: int, x: np.ndarray, y: np.ndarray) -> None:
        """Sentences ``[BOS] words [EOS]`` cut to T + 1 tokens, PAD after; x the first T, y
        the last T (the next token at every position)."""
        rng = _rng(self.seed, STACKOVERFLOW_TAG, k)
        succ = _client_succ(rng, self.succ, self.mix)
        n, t = len(y), self.length
        words = 1 + rng.poisson(SO_MEAN_WORDS, n)
        kept = np.minimum(words, t)
        reset = rng.random(int(kept.sum())) < self.randomness
        reset[_offsets(kept)[:-1]] = True  # every sentence starts with a fresh draw
        symbols = _chain(rng, reset, succ, self.cdf)
        ids = np.where(symbols == 0, SO_OOV, symbols + SO_FIRST_WORD - 1)
        seq = np.full((n, t + 1), PAD, dtype=np.int64)
        seq[:, 0] = SO_BOS
        cols = np.arange(t + 1)
        seq[(cols >= 1) & (cols <= kept[:, None])] = ids
        ends = words + 1 <= t
        seq[np.flatnonzero(ends), words[ends] + 1] = SO_EOS
        x[:] = seq[:, :t]
        y[:] = seq[:, 1:]


def stackoverflow_like_clients(*, seed: int, data_root: str | None = None, num_clients: int,
                               randomness: float, client_mix: float,
                               sequence_length: int) -> ClientSource:
    """K users drawn one at a time (the (K,) sizes in O(K), vectorised): each user's (n_k, T)
    int64 sentences and (n_k, T) int64 next-token targets, PAD (0) after the end; vocabulary
    10,004 (PAD, OOV, BOS, EOS and 10,000 words)."""
    symbols = STACKOVERFLOW["words"] + 1
    world = _rng(seed, STACKOVERFLOW_TAG + _WORLD)
    succ = world.integers(0, symbols, symbols)
    words = _zipf_cdf(symbols - 1, world) * (1 - SO_OOV_SHARE) + SO_OOV_SHARE
    gen = _StackOverflow(seed, succ, np.r_[SO_OOV_SHARE, words], randomness, client_mix,
                         sequence_length)
    sizes = _lognormal_sizes(_rng(seed, STACKOVERFLOW_TAG + _SIZES), num_clients,
                             STACKOVERFLOW["mean"], SO_LOG_SIGMA)
    vocab = STACKOVERFLOW["words"] + SO_FIRST_WORD
    return ClientSource(sizes, vocab, (sequence_length,), gen.fill, x_dtype=np.int64,
                        target_shape=(sequence_length,), vocab_size=vocab)


@register_dataset("stackoverflow_like", params=StackOverflowLikeParams, provides=(CLIENTS,),
                  lazy=stackoverflow_like_clients,
                  shape=_SHAPES["stackoverflow_like"])
def stackoverflow_like(*, seed: int, data_root: str | None = None, num_clients: int,
                       randomness: float, client_mix: float, sequence_length: int) -> DataPool:
    """The K users' sentences in one pool, grouped by user (``client_sizes``): only for a few
    users; K = 342,477 (~136 M sentences) is meant for ``data.lazy = true``."""
    return eager_pool(stackoverflow_like_clients(
        seed=seed, num_clients=num_clients, randomness=randomness, client_mix=client_mix,
        sequence_length=sequence_length))


# --------------------------------------------------------------------------- CIFAR

def _cifar_prototypes(seed: int, tag: int, classes: int) -> np.ndarray:
    """(C, 3, 32, 32) float32 smooth class prototypes, about mean 0 and variance 1 a pixel."""
    return _smooth_fields(_rng(seed, tag + _WORLD), (classes, 3, 8, 8), 4)


def _cifar_images(rng: np.random.Generator, proto: np.ndarray, y: np.ndarray, noise: float,
                  x: np.ndarray) -> None:
    """x[:] = (proto[y] + noise * e) / sqrt(1 + noise^2), e of mean 0 and variance 1."""
    _uniform_noise(rng, noise, x)
    x += proto[y]
    x *= np.float32(1.0 / math.sqrt(1.0 + noise * noise))


class Cifar100LikeParams(Params):
    """``cifar100_like`` (TFF FedCIFAR100's shapes and label skew)."""

    noise: float = Field(2.0, ge=0.0, le=100.0)
    """Standard deviation of the uniform per-pixel noise against the unit-variance class
    prototype: an image is (prototype + noise e) / sqrt(1 + noise^2), about mean 0 and
    variance 1 a pixel; larger = a harder task."""
    alpha: float = Field(0.1, gt=0.0, le=1e6)
    """Pachinko allocation, first level: a client's shares of the 20 coarse labels
    ~ Dir(alpha) (TFF's FedCIFAR100, Reddi et al. 2021, appendix C: 0.1); small = each client
    sees few coarse labels, large = little label skew."""
    beta: float = Field(10.0, gt=0.0, le=1e6)
    """Pachinko allocation, second level: a client's shares of each coarse label's 5 fine
    labels ~ Dir(beta) (Reddi et al. 2021: 10); small = few fine labels of each coarse one."""
    samples_per_client: int = Field(100, ge=2, le=2**31 - 1)
    """Images a client, the same for every client (TFF: 100)."""


@dataclass(frozen=True)
class _Cifar100:
    seed: int
    proto: np.ndarray   # (100, 3, 32, 32) float32
    noise: float
    alpha: float
    beta: float

    def fill(self, k: int, x: np.ndarray, y: np.ndarray) -> None:
        rng = _rng(self.seed, CIFAR100_TAG, k)
        coarse_shares = rng.dirichlet(np.full(20, self.alpha))
        fine_shares = rng.dirichlet(np.full(5, self.beta), size=20)
        coarse = _draw(np.cumsum(coarse_shares), rng.random(len(y)))
        fine_cdf = np.cumsum(fine_shares, axis=1)[coarse]
        fine = np.minimum((rng.random(len(y))[:, None] >= fine_cdf).sum(axis=1), 4)
        y[:] = coarse * 5 + fine
        _cifar_images(rng, self.proto, y, self.noise, x)


def cifar100_like_clients(*, seed: int, data_root: str | None = None, num_clients: int,
                          noise: float, alpha: float, beta: float,
                          samples_per_client: int) -> ClientSource:
    """K clients of ``samples_per_client`` (3, 32, 32) float32 images, labels 0..99 (fine label
    = 5 * coarse + j), drawn one at a time."""
    gen = _Cifar100(seed, _cifar_prototypes(seed, CIFAR100_TAG, 100), noise, alpha, beta)
    sizes = np.full(num_clients, samples_per_client, dtype=np.int64)
    return ClientSource(sizes, 100, (3, 32, 32), gen.fill)


@register_dataset("cifar100_like", params=Cifar100LikeParams, provides=(LABELS, CLIENTS),
                  lazy=cifar100_like_clients,
                  shape=_SHAPES["cifar100_like"])
def cifar100_like(*, seed: int, data_root: str | None = None, num_clients: int, noise: float,
                  alpha: float, beta: float, samples_per_client: int) -> DataPool:
    """The K clients' images in one pool, grouped by client (``client_sizes``)."""
    return eager_pool(cifar100_like_clients(seed=seed, num_clients=num_clients, noise=noise,
                                            alpha=alpha, beta=beta,
                                            samples_per_client=samples_per_client))


class Cifar10LikeParams(Params):
    """``cifar10_like`` (CIFAR-10's pool, split by a partition)."""

    noise: float = Field(2.0, ge=0.0, le=100.0)
    """Standard deviation of the uniform per-pixel noise against the unit-variance class
    prototype: an image is (prototype + noise e) / sqrt(1 + noise^2), about mean 0 and
    variance 1 a pixel; larger = a harder task."""
    num_samples: int = Field(60_000, ge=10, le=2**31 - 1)
    """N, images in the pool, equally many a class (N // 10 or one more), split over clients
    by the partition (CIFAR-10: 60,000, train and test pooled as mpifl's cifar10 is)."""


#: images drawn per generator (block b from [seed, CIFAR10_TAG, b]): bounds the temporaries
CIFAR10_BLOCK = 1024


@register_dataset("cifar10_like", params=Cifar10LikeParams, provides=(LABELS,),
                  shape=_SHAPES["cifar10_like"])
def cifar10_like(*, seed: int, data_root: str | None = None, noise: float,
                 num_samples: int) -> DataPool:
    """A pool of ``num_samples`` (3, 32, 32) float32 images (about mean 0, variance 1 a pixel)
    and (N,) int64 labels 0..9, ``num_samples // 10`` or one more a class, in random order;
    no clients of its own (split by ``shards``, ``dirichlet``, ``pathological``, ``iid``)."""
    proto = _cifar_prototypes(seed, CIFAR10_TAG, 10)
    y = _rng(seed, CIFAR10_TAG + _SIZES).permutation(np.arange(num_samples, dtype=np.int64) % 10)
    x = np.empty((num_samples, 3, 32, 32), dtype=np.float32)
    for b, lo in enumerate(range(0, num_samples, CIFAR10_BLOCK)):
        hi = min(lo + CIFAR10_BLOCK, num_samples)
        _cifar_images(_rng(seed, CIFAR10_TAG, b), proto, y[lo:hi], noise, x[lo:hi])
    return DataPool(x, y, 10)


#: name -> (the real data set it stands in for, its lazy factory or None)
STANDINS: dict[str, tuple[str, Callable[..., ClientSource] | None]] = {
    "femnist_like": ("leaf_femnist", femnist_like_clients),
    "shakespeare_like": ("leaf_shakespeare", shakespeare_like_clients),
    "stackoverflow_like": ("tff_stackoverflow", stackoverflow_like_clients),
    "cifar100_like": ("tff_cifar100", cifar100_like_clients),
    "cifar10_like": ("cifar10", None),
}
