"""A rule declares its needs once: one frozen ``Needs`` record, opt-in
protocols for what only one or two rules need, and no code that tests a rule's name."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mpifl import aggregators
from mpifl.aggregators import (Aggregator, BenchInputs, MemoryRows, Needs, ObservesParams,
                               PersonalModels, RoundInputs, Shards, available, rule)
from mpifl.aggregators import base
from mpifl.aggregators.needs import PROTOCOLS
from mpifl.bench.aggregation import extras_for
from mpifl.experiment.budget import _rule_rows
from mpifl.experiment.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mpifl"
BUILT_IN = sorted(n for n in available() if rule(n).__module__.startswith("mpifl."))

#: what each protocol is for, and exactly the built-in rules that need it
EXPECTED = {
    ObservesParams: {"afl"},
    PersonalModels: {"ditto"},
    RoundInputs: {"mfairfl"},
    BenchInputs: {"ditto", "fedfa", "fedfv", "fedmdfg", "mfairfl"},
    MemoryRows: {"fedfv", "fedlf", "fedmdfg"},
}
#: the methods a rule may override (the one beyond the state and the step: local-training options)
OVERRIDABLE = {"aggregate", "state_dict", "load_state_dict", "client_options"}


# ---- (a) the base class: one record, at most four methods to override ----------------------

def _public(cls: type) -> dict[str, object]:
    return {k: v for k, v in vars(cls).items() if not k.startswith("_")}


def _is_method(v: object) -> bool:
    return inspect.isfunction(v) or isinstance(v, (classmethod, staticmethod, property))


def test_the_base_class_has_no_capability_flags():
    settings = {k for k, v in _public(Aggregator).items() if not _is_method(v)}
    assert settings == {"name", "Params", "needs"}
    assert isinstance(Aggregator.needs, Needs) and Aggregator.needs == Needs()
    assert not set(base.OLD_FLAGS) & set(vars(Aggregator))


def test_the_base_class_has_at_most_four_methods_a_rule_may_override():
    methods = {k for k, v in _public(Aggregator).items() if _is_method(v)}
    final = {k for k in methods if getattr(vars(Aggregator)[k], "__final__", False)}
    assert final == {"validate_params"}
    assert methods - final == OVERRIDABLE and len(OVERRIDABLE) <= 4
    for name in BUILT_IN:   # what the rules override is among them; nothing final is overridden
        cls = rule(name)
        overridden = {k for c in cls.__mro__ if c not in (Aggregator, object)
                      for k in vars(c) if k in methods}
        assert overridden <= OVERRIDABLE, (name, overridden - OVERRIDABLE)


def test_needs_is_a_frozen_record():
    n = Needs(num_clients=True, shards=Shards(state=("rows",)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.num_clients = False  # type: ignore[misc]
    assert n.sharded_state == ("rows",) and Needs().sharded_state == ()
    with pytest.raises(TypeError, match="losses"):
        Needs(losses=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shards"):
        Needs(shards=("rows",))  # type: ignore[arg-type]


def test_a_rule_with_an_old_flag_is_refused_naming_the_new_field(monkeypatch):
    monkeypatch.setattr(base.RULES, "_entries", dict(base.RULES._entries))
    with pytest.raises(TypeError, match=r"needs_losses.*Needs\(losses=False\)"):
        @aggregators.register("old_style")
        class OldStyle(Aggregator):
            needs_losses = False
    with pytest.raises(TypeError, match=r"supports_shards.*Shards"):
        @aggregators.register("old_shards")
        class OldShards(Aggregator):
            supports_shards = True
    with pytest.raises(TypeError, match="PersonalModels needs client_state, personal_params"):
        @aggregators.register("half_personal")
        class HalfPersonal(Aggregator):
            def client_state(self, ids, w):
                return None
    with pytest.raises(TypeError, match="Needs record"):
        @aggregators.register("bad_needs")
        class BadNeeds(Aggregator):
            needs = {"losses": False}  # type: ignore[assignment]

    @aggregators.register("new_style")
    class NewStyle(Aggregator):
        needs = Needs(losses=False, num_clients=True)

    assert rule("new_style").needs.num_clients and not rule("new_style").needs.losses


# ---- (b) no module tests a rule's name -----------------------------------------------------

def name_tests(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) for every string constant equal to one of ``names`` that the code compares
    (``==``, ``!=``, ``in``, ``is``, also inside tuples, lists, sets), matches (``case "x":``)
    or uses as a dict key (a table keyed by rule name)."""
    found = []

    def constants(node: ast.AST):
        for c in ast.walk(node):
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value in names:
                yield c

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            parts = [node.value]
        elif isinstance(node, ast.Dict):
            parts = [k for k in node.keys if k is not None]
        else:
            continue
        found += [(c.lineno, c.value) for p in parts for c in constants(p)]
    return sorted(set(found))


def _own_file(name: str) -> Path:
    return Path(sys.modules[rule(name).__module__].__file__).resolve()


def test_the_scanner_finds_a_name_test():
    names = set(BUILT_IN)
    src = (PACKAGE / "experiment" / "assemble.py").read_text()
    assert name_tests(src, names) == []
    bad = src + '\n\ndef _special(cfg):\n    if cfg.server.algorithm == "ditto":\n        pass\n'
    assert [n for _, n in name_tests(bad, names)] == ["ditto"]
    for snippet, want in [('x = name in ("fedfv", "fedlf")', ["fedfv", "fedlf"]),
                          ('ok = "afl" != rule_name', ["afl"]),
                          ('T = {"mfairfl": 4}', ["mfairfl"]),
                          ('match alg:\n    case "uga":\n        pass', ["uga"]),
                          ('trainer = TRAINERS.get("ditto")', []),      # a lookup, no test
                          ('if cfg.server.algorithm == "sgd": pass', [])]:
        assert [n for _, n in name_tests(snippet, names)] == want, snippet


def test_no_module_tests_a_rules_name():
    names = set(BUILT_IN)
    registry = {PACKAGE / "aggregators" / "base.py", PACKAGE / "aggregators" / "__init__.py"}
    own = {name: _own_file(name) for name in names}
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        path = path.resolve()
        if path in registry:
            continue
        for line, name in name_tests(path.read_text(), names):
            if own[name] != path:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name!r}")
    assert bad == []


# ---- (c) each protocol is satisfied by exactly the rules that need it ----------------------

@pytest.mark.parametrize("proto", PROTOCOLS, ids=lambda p: p.__name__)
def test_each_protocol_is_met_by_exactly_the_rules_that_need_it(proto):
    assert {n for n in BUILT_IN if isinstance(rule(n), proto)} == EXPECTED[proto]
    assert not isinstance(Aggregator, proto)
    assert set(EXPECTED) == set(PROTOCOLS)


def test_an_instance_meets_its_protocols_too():
    afl, fedavg = aggregators.create("afl"), aggregators.create("fedavg")
    assert isinstance(afl, ObservesParams) and not isinstance(fedavg, ObservesParams)
    ditto = aggregators.create("ditto", num_clients=3)
    assert isinstance(ditto, PersonalModels) and not isinstance(ditto, RoundInputs)
    assert isinstance(aggregators.create("mfairfl", num_constraints=2), RoundInputs)


def test_the_bench_inputs_are_what_the_old_table_gave():
    got = {n: extras_for(rule(n)) for n in BUILT_IN}
    asked = {n for n, ex in got.items()
             if ex.params or ex.stats or ex.loss_at or ex.all_clients or ex.baseline}
    assert asked == {"afl", "ditto", "fedfa", "fedfv", "fedmdfg", "mfairfl"}
    assert got["afl"].all_clients and not got["fedavg"].all_clients
    assert got["mfairfl"].params == {"num_constraints": 4}
    assert got["mfairfl"].stats == {"constraints": (4,)}
    assert got["fedfa"].stats == {"train_accuracy": ()}
    assert got["ditto"].stats == {"client_state": ("d",)}
    assert got["fedmdfg"].loss_at and not got["fedfv"].loss_at
    assert got["fedfv"].baseline and got["fedfv"].forms == ("gram", "direct")
    assert got["fedavg"].forms[0] == "default"


def _cfg(algorithm: str, *extra: str):
    return load_config(None, [f"server.algorithm={algorithm}", "data.num_clients=50",
                              "server.clients_per_round=10", "run.rounds=3", *extra])


def test_the_memory_rows_are_what_the_old_name_lookups_gave_with_a_checkpoint_copy():
    assert _rule_rows(_cfg("fedfv", "fedfv.tau=2"), 50, 10, 1) == [
        ("fedfv.tau", 2, "FedFV's history of 2 round(s) of 10 updates and its checkpoint copy", 40,
         "server")]
    assert _rule_rows(_cfg("fedfv", "fedfv.tau=2", "fedfv.external_window=flgo"), 50, 10, 1) == [
        ("fedfv.tau", 2, "FedFV's history of 1 round(s) of 10 updates and its checkpoint copy", 20,
         "server")]
    assert _rule_rows(_cfg("fedlf"), 50, 10, 1) == [
        ("data.num_clients", 50, "FedLF's history of up to 30 absent clients' gradients and its checkpoint copy",
         60,
         "server")]
    assert _rule_rows(_cfg("fedmdfg"), 50, 10, 1) == [
        ("server.clients_per_round", 10, "FedMDFG's last round of 10 updates and its checkpoint copy", 20,
         "server")]
    assert _rule_rows(_cfg("fedavg"), 50, 10, 1) == []
    ditto = _rule_rows(_cfg("ditto"), 50, 10, 3)
    assert [(k, v, rows, place) for k, v, _, rows, place in ditto] == [
        ("data.num_clients", 50, 100, "rank0"), ("data.num_clients", 50, 25.0, "workers")]


def test_the_server_serves_a_protocol_only_to_rules_that_meet_it():
    """The hooks are gone from the base class: a plain rule is never asked for them."""
    agg = aggregators.create("fedavg")
    for hook in ("observe_params", "evaluation_params", "client_state", "personal_params",
                 "round_inputs", "bench_inputs", "memory_rows"):
        assert not hasattr(agg, hook), hook
    w = torch.zeros(3)
    afl = aggregators.create("afl")
    afl.aggregate(aggregators.RoundUpdates(round=0, client_ids=np.arange(2),
                                           updates=torch.eye(2, 3), losses=np.ones(2),
                                           num_samples=np.ones(2, dtype=np.int64), lr=0.1))
    afl.observe_params(w)
    assert torch.equal(afl.evaluation_params(w), w)
