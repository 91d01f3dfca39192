"""aggregators — Aggregation rules, one file per algorithm, behind one interface and a registry by name.

May import: core, metrics.  Never imports: data, models, store, clients, runtime or above
(an aggregator sees updates, never data or MPI).

    from mpifl.aggregators import create, RoundUpdates
    agg = create("fedfv", alpha=0.1, tau=1, seed=0)
    step = agg.aggregate(RoundUpdates(...))          # the server sets w <- w - step

Importing this package imports every module in it, so a new algorithm is one new file whose
class carries ``@register("name")``; nothing else needs editing. What a rule needs from the run
is its ``needs`` record and the opt-in protocols it implements (:mod:`mpifl.aggregators.needs`).
"""

import importlib
import pkgutil

from mpifl.aggregators.base import Aggregator, RoundUpdates, available, create, register, rule
from mpifl.aggregators.needs import (BenchInputs, BenchSpec, MemoryRows, Needs, ObservesParams,
                                     PersonalModels, RoundInputs, Shards, StateRows)

__all__ = ["Aggregator", "BenchInputs", "BenchSpec", "MemoryRows", "Needs", "ObservesParams",
           "PersonalModels", "RoundInputs", "RoundUpdates", "Shards", "StateRows", "available",
           "create", "register", "rule"]


def _import_all() -> None:
    # sorted, so registration (and any name clash error) does not depend on the file system
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_import_all()
