"""clients — client-side computation: vectorised local training and evaluation of many clients
at once, the per-client loop for any model (BatchNorm, Dropout) and the choice between them,
FedMeta's server-held meta step, fault injection.

May import: core, metrics, data, models, aggregators.  Never imports: store, runtime or above.

See :mod:`mpifl.clients.trainer` (FedAvg local SGD, McMahan et al. 2017, with ``torch.func.vmap``)
and :mod:`mpifl.clients.uga` (UGA's keep-trace training, Yao et al. 2019) and
:mod:`mpifl.clients.mfairfl` (mFairFL's Lagrangian local training, Su et al. 2024).
"""

from mpifl.clients.minibatches import batch_order, client_minibatches
from mpifl.clients.interface import ClientTrainer, TrainOptions
from mpifl.clients.trainer import TrainerBase, VmapTrainer
from mpifl.core.registry import Registry
from mpifl.core.wire import Columns
from mpifl.clients.ditto import DittoTrainer
from mpifl.clients.mfairfl import LagrangianTrainer
from mpifl.clients.uga import UGATrainer
from mpifl.clients.loop import LoopTrainer
from mpifl.clients.select import select_trainer

#: Local-training kinds an aggregation rule can ask for (``Aggregator.needs.trainer``); a plugin
#: may add a :class:`VmapTrainer` subclass with ``@TRAINERS.register("kind")``.
TRAINERS: Registry[type[VmapTrainer]] = Registry("trainer")
for _kind, _cls in (("sgd", VmapTrainer), ("uga", UGATrainer), ("mfairfl", LagrangianTrainer),
                    ("ditto", DittoTrainer)):
    TRAINERS.add(_kind, _cls)

__all__ = ["TRAINERS", "ClientTrainer", "Columns", "DittoTrainer", "LagrangianTrainer",
           "LoopTrainer", "TrainOptions", "TrainerBase", "UGATrainer", "VmapTrainer",
           "batch_order", "client_minibatches", "select_trainer"]
