"""The rule state check: does a rule resume exactly from its ``state_dict()``?

A rule that keeps something between rounds (momentum, multipliers, a history, counters) must
return it from ``state_dict()`` and take it back in ``load_state_dict()``; otherwise a resumed
run continues from a different state and silently ends elsewhere (a FedAdam plugin that forgot
its moments finished at 23.9% instead of 35.2% on resume). The check runs the rule on
synthetic rounds (the inputs of ``mpifl bench aggregation``, with the extras the rule needs,
each round made when it is aggregated),
hands its state after ``split`` rounds through an HDF5 round trip (as a checkpoint does) to a
fresh instance, and lets both aggregate the remaining rounds:

- every step of the two must be bit-for-bit equal;
- when they are not, the attributes that still differ between the two instances after the last
  round are named: the state the rule keeps without declaring it. (Attributes that differ only
  right after the restore, such as diagnostics of the last aggregation, are not state.)

Use it in a rule's tests (``assert check_rule_state("my_rule").ok``) or from the command line:
``mpifl check RULE [--plugins MODULE] [--set key=value]``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from mpifl.aggregators import ObservesParams, RoundUpdates
from mpifl.aggregators import rule as rule_class
from mpifl.bench.aggregation import Extras, _Inputs, _takes, extras_for
from mpifl.store.checkpoint import state_round_trip

__all__ = ["MAX_ROUNDS", "StateCheck", "check_rounds", "check_rule_state"]


@dataclass
class StateCheck:
    """Result of :func:`check_rule_state`.

    Attributes:
        rule: the rule's name. rounds, split: rounds run, and after which the state moved.
        state_keys: the keys of its ``state_dict()`` at the split.
        undeclared: attributes that differ between the rule and its restored copy.
        step_diff: largest absolute difference of the steps after the split (0.0: exact).
        error: why the check could not run (the rule raised), or None.
    """

    rule: str
    rounds: int
    split: int
    state_keys: list[str] = field(default_factory=list)
    undeclared: list[str] = field(default_factory=list)
    step_diff: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.undeclared and self.step_diff == 0.0

    def line(self) -> str:
        """The verdict in one line."""
        if self.error:
            return f"{self.rule}: the check could not run: {self.error}"
        if self.undeclared:
            names = ", ".join(f"'{a}'" for a in self.undeclared)
            return (f"{self.rule}: keeps {names} between rounds without declaring it in "
                    f"state_dict(): a resumed run would continue from another state (steps "
                    f"after the restore differ by up to {self.step_diff:.3g})")
        if self.step_diff:
            return (f"{self.rule}: a copy restored from state_dict() aggregates differently "
                    f"(steps differ by up to {self.step_diff:.3g})")
        keys = ", ".join(self.state_keys) or "none: stateless"
        return (f"{self.rule}: resumes exactly from state_dict() (state: {keys}; "
                f"{self.rounds - self.split} rounds compared after round {self.split})")


#: The most rounds :func:`check_rule_state` runs (each round is made when it is aggregated, so
#: memory does not grow with them; this bounds the time: a few seconds for any built-in rule).
MAX_ROUNDS = 10_000


def check_rule_state(name: str, *, rounds: int = 6, split: int = 3, m: int = 6, d: int = 48,
                     seed: int = 0, params: Mapping[str, Any] | None = None) -> StateCheck:
    """Run rule ``name`` ``rounds`` rounds and check that a copy restored from its
    ``state_dict()`` after ``split`` rounds is the same rule from then on.

    Args:
        name: a registered rule or ``"pkg.module:Class"``.
        rounds, split: 1 <= split < rounds <= :data:`MAX_ROUNDS`.
        m, d: clients per round and model size of the synthetic rounds.
        params: the rule's hyper-parameters (its ``Params``), besides what the check sets
            (``seed``, ``num_clients`` and the inputs the rule asks for:
            :func:`mpifl.bench.aggregation.extras_for`).

    Returns:
        The :class:`StateCheck`; an exception of the rule (built, aggregating, saving or
        restoring its state) is its ``error``, not raised.

    Raises:
        ValueError: ``split`` or ``rounds`` out of range. LookupError: an unknown rule.
    """
    check_rounds(rounds, split)
    cls = rule_class(name)
    result = StateCheck(name, rounds, split)
    try:
        ex = extras_for(cls)  # the rule's bench_inputs(): its own code
        kwargs = dict(ex.params, **(params or {}), seed=seed)
        if cls.needs.num_clients or _takes(name, "num_clients"):
            kwargs["num_clients"] = m if ex.all_clients else rounds * m
        data = _rounds(ex, m, d, rounds, seed)
        a = cls(**kwargs)
        w = torch.zeros(d)
        for _, r in zip(range(split), data):
            w = _step(a, r, w)
        state = a.state_dict()
        result.state_keys = sorted(state)
        b = cls(**kwargs)
        b.load_state_dict(state_round_trip(state))
        for r in data:
            w_a, w_b = _step(a, r, w), _step(b, r, w)
            result.step_diff = max(result.step_diff, float((w_a - w_b).abs().max()))
            w = w_a
        if result.step_diff:
            result.undeclared = _differences(vars(a), vars(b))
    except Exception as exc:  # noqa: BLE001 -- a plugin's rule may raise anything
        first = (str(exc).strip().splitlines() or [""])[0]
        result.error = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return result


def check_rounds(rounds: int, split: int) -> None:
    """Raise ValueError (one line, naming the option) unless 1 <= split < rounds <=
    :data:`MAX_ROUNDS`."""
    if not 2 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"--rounds {rounds}: expected 2 to {MAX_ROUNDS:,} (the state moves after "
                         f"--split rounds and at least one round follows)")
    if not 1 <= split < rounds:
        raise ValueError(f"--split {split}: expected 1 to {rounds - 1} (at least one round "
                         f"before the state moves and one after, of --rounds {rounds})")


def _rounds(ex: Extras, m: int, d: int, rounds: int, seed: int) -> Iterator[RoundUpdates]:
    """The synthetic rounds 0..rounds-1, each made when it is aggregated (memory O(m d), not
    O(rounds m d)): round t's updates from its own key, its stats columns from one shared
    :class:`~mpifl.bench.aggregation._Inputs` (keyed by t; a state column stays the same),
    client ids t*m .. (t+1)*m - 1 (0 .. m-1 every round for a rule that needs all clients)."""
    cpu = torch.device("cpu")
    shared = _Inputs(m, d, 0, cpu, seed)
    for t in range(rounds):
        key = int(np.random.SeedSequence([seed, t]).generate_state(1)[0])
        (r,), _ = _Inputs(m, d, 0, cpu, key).rounds(ex, 0)
        ids = np.arange(m) if ex.all_clients else np.arange(t * m, (t + 1) * m)
        stats = {k: shared.stat(k, shape, t) for k, shape in ex.stats.items()}
        yield replace(r, round=t, client_ids=ids, stats=stats)


def _step(agg, r, w: torch.Tensor) -> torch.Tensor:
    """One server round: aggregate, move w, show the rule the new model."""
    w = w - agg.aggregate(r).to(w)
    if isinstance(agg, ObservesParams):
        agg.observe_params(w)
    return w


def _differences(a: dict, b: dict) -> list[str]:
    """Names of the attributes whose values differ (tensors, arrays, containers, scalars)."""
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or not _same(a[k], b[k]))


def _same(x: Any, y: Any, depth: int = 0) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                and x.shape == y.shape and torch.equal(x.cpu(), y.cpu().to(x.dtype)))
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        return x.keys() == y.keys() and all(_same(x[k], y[k], depth + 1) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same(p, q, depth + 1) for p, q in zip(x, y))
    if isinstance(x, np.random.Generator) and isinstance(y, np.random.Generator):
        return x.bit_generator.state == y.bit_generator.state
    if type(x) is not type(y):
        return False
    if hasattr(x, "__dict__") and not callable(x) and depth < 8:  # a helper object: its fields
        return _same(vars(x), vars(y), depth + 1)
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 -- no usable ==: the same type is all we can tell
        return True
