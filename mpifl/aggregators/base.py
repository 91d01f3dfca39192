"""The aggregator interface: what the server hands over each round, and the registry of rules.

An aggregation rule is one subclass of :class:`Aggregator` in its own file, registered by name
with :func:`register`. The server builds one :class:`RoundUpdates` per round, calls
``aggregate`` and applies the returned step as ``w <- w - s`` (ALGORITHMS.md §0). Everything an
aggregator carries between rounds goes through ``state_dict`` / ``load_state_dict`` as numpy arrays
and scalars, so checkpoints are plain HDF5 datasets and a resumed run continues bit-for-bit.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, TypeVar, final

import numpy as np
import torch
from pydantic import ValidationError

from mpifl.aggregators.needs import Needs, partial_protocols
from mpifl.aggregators.shards import row_sq_norms
from mpifl.core.params import Params, params_error
from mpifl.core.registry import Registry

#: The base class by another name: inside ``Aggregator`` the name ``Params`` is the rule's own.
_BaseParams = Params

__all__ = ["RULES", "Aggregator", "NoParams", "RoundUpdates", "available", "create", "register",
           "rule", "check_seed", "OLD_FLAGS"]


def _as_tensor(x: Any, device: torch.device | None = None) -> torch.Tensor:
    """A tensor view of ``x`` (numpy array, list, tensor), on ``device`` if given."""
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    return t if device is None else t.to(device)


@dataclass
class RoundUpdates:
    """Everything the server knows about one round's client updates (ALGORITHMS.md §0).

    Attributes:
        round: round index ``t >= 0``.
        client_ids: (m,) int64 numpy array of the selected clients, all distinct.
        updates: (m, d) floating tensor (float32 from the server; float64 is accepted, e.g. in
            tests), row k is ``u_k = w^t - w_k^t`` — a pseudo-gradient that already contains lr.
        losses: (m,) float32 tensor on ``updates.device``: each client's mean loss of the
            **global** model ``w^t`` on its training split, measured before local training
            (converted to float32 whatever dtype it comes in).
        num_samples: (m,) int64 tensor on ``updates.device``: training samples per client.
        lr: client learning rate of this round (finite, > 0).
        layers: the layer map, one ``slice`` of the flat vector per layer in model order, or None.
        stats: optional extra per-client columns, each a tensor with leading dimension m
            (e.g. ``train_accuracy`` (m,) for FedFa, ``client_state`` (m, s) for Ditto's
            personal models, ``constraints`` (m, A) for mFairFL).
        loss_at: optional evaluation-only probe: ``loss_at(step)`` returns the (m,) float32
            mean training losses of these clients at ``w^t - step`` (step (d,) like a returned
            step), asking the clients without training them (FedMDFG's line search).
        shards: the server's :class:`~mpifl.aggregators.shards.ShardGroup` when it is sharded
            (``server.shards = P > 1``): then ``updates`` is this shard's column block
            (m, hi - lo), ``layers`` the layer map clipped to it (empty slices allowed), the
            returned step is this shard's block, and every sum over coordinates goes through
            :meth:`total` (or :meth:`gram`, :meth:`dots`, :meth:`dot`, :meth:`norm`). None:
            one server holds everything, and these methods are today's plain expressions.

    Numpy arrays and lists are accepted for every array field and converted on construction.

    Raises:
        ValueError: a shape, dtype or value does not fit (empty round, duplicate client ids,
            negative sample counts, a layer slice outside ``[0, d)``, ...).
    """

    round: int
    client_ids: np.ndarray
    updates: torch.Tensor
    losses: torch.Tensor
    num_samples: torch.Tensor
    lr: float
    layers: list[slice] | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    loss_at: Callable[[torch.Tensor], torch.Tensor] | None = None
    shards: Any = None

    def __post_init__(self) -> None:
        self.round = _index(self.round, "round")
        if self.round < 0:
            raise ValueError(f"round must be >= 0, got {self.round}")
        self.updates = _as_tensor(self.updates)
        if self.updates.ndim != 2 or not self.updates.is_floating_point():
            raise ValueError(f"updates must be a 2-D floating tensor (m, d), got "
                             f"shape {tuple(self.updates.shape)} dtype {self.updates.dtype}")
        m, dev = self.updates.shape[0], self.updates.device
        if m == 0:
            raise ValueError("a round needs at least one client update (m = 0)")
        self.client_ids = self._ids(self.client_ids, m)
        self.losses = _as_tensor(self.losses, dev).to(torch.float32)
        self.num_samples = _as_tensor(self.num_samples, dev)
        if self.num_samples.is_floating_point() or self.num_samples.dtype == torch.bool:
            raise ValueError(f"num_samples must be integers, got {self.num_samples.dtype}")
        self.num_samples = self.num_samples.to(torch.int64)
        for name in ("losses", "num_samples"):
            shape = tuple(getattr(self, name).shape)
            if shape != (m,):
                raise ValueError(f"{name} must have shape ({m},) to match updates, got {shape}")
        if bool((self.num_samples < 0).any()):
            raise ValueError("num_samples must be >= 0")
        self.lr = float(self.lr)
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be finite and > 0, got {self.lr}")
        self._check_layers()
        self.stats = {k: _as_tensor(v, dev) for k, v in dict(self.stats).items()}
        for k, v in self.stats.items():
            if v.ndim == 0 or v.shape[0] != m:
                raise ValueError(f"stats[{k!r}] must have leading dimension {m}, "
                                 f"got shape {tuple(v.shape)}")

    @property
    def m(self) -> int:
        """Number of clients in the round."""
        return self.updates.shape[0]

    @property
    def d(self) -> int:
        """Dimension of the flat parameter vector."""
        return self.updates.shape[1]

    @staticmethod
    def _ids(ids: Any, m: int) -> np.ndarray:
        arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        if arr.shape != (m,) or arr.dtype.kind not in "iu":
            raise ValueError(f"client_ids must be ({m},) integers to match updates, got "
                             f"shape {arr.shape} dtype {arr.dtype}")
        arr = arr.astype(np.int64)
        if len(np.unique(arr)) != m:
            raise ValueError("client_ids must be distinct within a round")
        return arr

    # ---- sums over coordinates: over every shard's block when the server is sharded --------

    def total(self, x: Any) -> np.ndarray:
        """A partial sum over this block's coordinates summed over all shards, as float64
        numpy (bit-identical on every shard); ``x`` itself as float64 numpy when unsharded."""
        if self.shards is None:
            return np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x,
                              dtype=np.float64)
        return self.shards.allsum(x)

    def gram(self, X: torch.Tensor) -> np.ndarray:
        """(n, n) float64 ``X X^T`` of (n, d) rows (:func:`~mpifl.aggregators.gram.gram`),
        over all coordinates."""
        from mpifl.aggregators.gram import gram

        return gram(X) if self.shards is None else self.shards.allsum(gram(X))

    def dots(self, A: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(n,) ``A @ v`` of (n, d) rows with a (d,) vector, over all coordinates, in A's dtype
        and on its device."""
        if self.shards is None:
            return A @ v
        return torch.as_tensor(self.shards.allsum(A @ v), dtype=A.dtype, device=A.device)

    def dot(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """``x . y`` of two (d,) vectors over all coordinates."""
        return float(x @ y) if self.shards is None else float(self.shards.allsum(float(x @ y)))

    def norm(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """``torch.linalg.vector_norm(x, dim=dim)`` over all coordinates (``dim`` None or the
        coordinate axis 1 of an (n, d) matrix), in x's dtype and on its device."""
        if self.shards is None:
            return torch.linalg.vector_norm(x, dim=dim)
        sq = (row_sq_norms(x) if dim in (1, -1) and x.dim() == 2
              else torch.linalg.vector_norm(x.double(), dim=dim) ** 2)
        return torch.as_tensor(np.sqrt(self.shards.allsum(sq)), dtype=x.dtype, device=x.device)

    def _check_layers(self) -> None:
        if self.layers is None:
            return
        self.layers = list(self.layers)
        shard = self.shards is not None  # a shard's clipped layer map may hold empty layers
        for s in self.layers:
            try:
                lo, hi = operator.index(s.start), operator.index(s.stop)
                ok = (isinstance(s, slice) and s.step in (None, 1)
                      and 0 <= lo and hi <= self.d and (lo < hi or (shard and lo == hi)))
            except (TypeError, AttributeError):
                ok = False
            if not ok:
                raise ValueError(f"layers must be slices within [0, {self.d}), got {s!r}")


def _index(x: Any, what: str) -> int:
    """``x`` as a Python int (numpy ints accepted); bools and floats are rejected."""
    if isinstance(x, bool):
        raise ValueError(f"{what} must be an integer, got {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {x!r}") from None


def check_seed(seed: Any) -> int:
    """The seed as an int >= 0 (``np.random.default_rng([seed, round])`` rejects negatives)."""
    seed = _index(seed, "seed")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return seed


def check_num_clients(rule: str, num_clients: Any) -> int | None:
    """K for rules with state over all clients: None (grow as ids appear) or an int >= 1.

    Raises:
        ValueError: not an integer, or < 1.
    """
    if num_clients is None:
        return None
    num_clients = _index(num_clients, f"{rule}: num_clients")
    if num_clients < 1:
        raise ValueError(f"{rule}: num_clients must be >= 1, got {num_clients}")
    return num_clients


def state_scalar(x: Any) -> Any:
    """A Python scalar from a ``state_dict`` value as HDF5 gives it back (0-d arrays, numpy
    scalars, bytes); anything else unchanged. For the rules' ``load_state_dict``."""
    x = np.asarray(x).item() if isinstance(x, (np.ndarray, np.generic)) else x
    return x.decode() if isinstance(x, bytes) else x


def check_round_order(rule: str, rnd: int, last: int) -> None:
    """Stateful rules see rounds in increasing order (a replayed or reordered round would corrupt
    their history).

    Raises:
        ValueError: ``rnd <= last``.
    """
    if rnd <= last:
        raise ValueError(f"{rule}: round {rnd} is not after the last aggregated round {last}")


class NoParams(Params):
    """A rule without hyper-parameters."""


class Aggregator:
    """Base class of an aggregation rule: one subclass per algorithm file, registered by name.

    A rule declares its hyper-parameters once, as a nested ``Params`` class (a frozen pydantic
    model, :class:`mpifl.core.params.Params`): the config's ``[name]`` table, the constructor's
    keyword arguments, their defaults and range checks all come from it. The constructor takes
    those keywords plus ``seed: int = 0`` (and, for rules that ask, ``num_clients`` /
    ``num_groups`` from the server); any randomness is drawn from RNGs keyed by
    ``(seed, round)`` so that no RNG state needs saving.

    Raises (constructor):
        TypeError: a keyword that is not one of the rule's hyper-parameters.
        ValueError: a hyper-parameter out of range (one line naming the rule and the key).
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type[_BaseParams]] = NoParams
    #: Everything the rule needs from the run, declared once (:class:`~mpifl.aggregators.needs.
    #: Needs`: num_clients, num_groups, all_clients, losses, trainer, meta_step, shards,
    #: shards_note). Whatever only one or two rules need is an opt-in protocol of
    #: :mod:`mpifl.aggregators.needs` (ObservesParams, PersonalModels, RoundInputs, BenchInputs,
    #: MemoryRows): the rule defines its methods, and the server tests ``isinstance``.
    needs: ClassVar[Needs] = Needs()

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        self.seed = check_seed(seed)
        #: the rule's own ``Params`` (Any: each rule reads the fields of its own class)
        self.params: Any = self.validate_params(params)

    @final
    @classmethod
    def validate_params(cls, params: Mapping[str, Any] | _BaseParams) -> _BaseParams:
        """``params`` as this rule's validated :attr:`Params` (an instance passes through).

        Raises:
            TypeError: an unknown key.  ValueError: a value of the wrong type or out of range.
        """
        if isinstance(params, cls.Params):
            return params
        try:
            return cls.Params.model_validate(dict(params))
        except ValidationError as exc:
            msg = params_error(cls.name or cls.__name__, exc)
            if exc.errors()[0]["type"] == "extra_forbidden":
                raise TypeError(msg) from None
            raise ValueError(msg) from None

    @classmethod
    def client_options(cls, p: Any) -> dict[str, Any]:
        """Local-training options this rule needs from its validated hyper-parameters ``p``
        (keyword arguments of the trainer ``needs.trainer`` names, e.g. FedProx's
        ``prox_mu = p.mu``); default none."""
        return {}

    def aggregate(self, r: RoundUpdates) -> torch.Tensor:
        """The step ``s``: (d,) tensor, dtype and device of ``r.updates``; the server sets
        ``w <- w - s``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray | int | float | str]:
        """State carried between rounds, as numpy arrays and scalars only (HDF5, no pickle).

        Stateless rules return ``{}``.
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: the state does not belong to this rule.
        """
        if state:
            raise ValueError(f"{type(self).__name__} is stateless; unexpected state keys "
                             f"{sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, seed={self.seed})"


#: The class attributes that came before ``Needs`` -> what replaced them (a rule still setting
#: one is refused at registration with this hint, never silently ignored).
OLD_FLAGS = {
    "needs_num_clients": "needs = Needs(num_clients=True)",
    "needs_num_groups": "needs = Needs(num_groups=True)",
    "needs_all_clients": "needs = Needs(all_clients=True)",
    "needs_losses": "needs = Needs(losses=False)",
    "trainer_kind": "needs = Needs(trainer=...)",
    "meta_step": "needs = Needs(meta_step=True)",
    "supports_shards": "needs = Needs(shards=Shards(...))",
    "sharded_state": "needs = Needs(shards=Shards(state=(...)))",
    "shards_note": "needs = Needs(shards_note=...)",
    "personal_models": "defining client_state and personal_params (protocol PersonalModels)",
}


def _check_rule(name: str, cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Aggregator)):
        raise TypeError(f"rule {name!r} must be an Aggregator subclass, got {cls!r}")
    if not (isinstance(cls.Params, type) and issubclass(cls.Params, Params)):
        raise TypeError(f"rule {name!r}: its Params must subclass mpifl.core.params.Params")
    old = [a for a in OLD_FLAGS if hasattr(cls, a)]
    if old:
        raise TypeError(f"rule {name!r} sets {', '.join(old)}: a rule declares its needs once, "
                        f"as {'; '.join(OLD_FLAGS[a] for a in old)} "
                        "(mpifl.aggregators.Needs, Shards)")
    if not isinstance(cls.needs, Needs):
        raise TypeError(f"rule {name!r}: needs must be a mpifl.aggregators.Needs record, got "
                        f"{cls.needs!r}")
    if partial := partial_protocols(cls):
        raise TypeError(f"rule {name!r} defines part of a protocol: {'; '.join(partial)}")


#: The aggregation rules by name (built-ins and plugins; ``"pkg.module:Class"`` also resolves).
RULES: Registry[type[Aggregator]] = Registry("algorithm", _check_rule)
A = TypeVar("A", bound=type[Aggregator])


def register(name: str) -> Callable[[A], A]:
    """Class decorator: make an :class:`Aggregator` subclass available as ``create(name)`` and
    as ``server.algorithm = "name"`` with a ``[name]`` config table from its ``Params``.

    Raises:
        ValueError: ``name`` is empty, contains ':', or is already taken by another class.
        TypeError: not an Aggregator subclass, or its Params is not a ``core.params.Params``.
    """
    deco = RULES.register(name)

    def named(cls: A) -> A:
        deco(cls)
        cls.name = name
        return cls

    return named


def create(name: str, **params: Any) -> Aggregator:
    """A new aggregator of the rule ``name`` (or ``"pkg.module:Class"``) with ``params``.

    Raises:
        ValueError: unknown ``name`` (the message lists the known ones), or a bad value.
        TypeError: a parameter the rule does not take.
    """
    try:
        cls = rule(name)
    except LookupError as exc:
        raise ValueError(str(exc)) from None
    return cls(**params)


def rule(name: str) -> type[Aggregator]:
    """The class of rule ``name`` or import path ``"pkg.module:Class"``.

    Raises:
        LookupError (:class:`mpifl.core.registry.UnknownName`): unknown, with a suggestion.
    """
    cls = RULES.get(name)
    if not cls.name:  # known by its import path only
        cls.name = name
    return cls


def available() -> list[str]:
    """The registered rule names, sorted."""
    return RULES.available()
