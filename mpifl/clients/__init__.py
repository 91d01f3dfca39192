"""Client-side computation: vectorised local training and evaluation of many clients at once.

See :mod:`mpifl.clients.trainer` (FedAvg local SGD, McMahan et al. 2017, with ``torch.func.vmap``)
and :mod:`mpifl.clients.uga` (UGA's keep-trace training, Yao et al. 2019).
"""

from mpifl.clients.trainer import Columns, VmapTrainer, batch_order
from mpifl.clients.uga import UGATrainer

#: Local-training kinds an aggregation rule can ask for (``Aggregator.trainer_kind``).
TRAINERS = {"sgd": VmapTrainer, "uga": UGATrainer}

__all__ = ["TRAINERS", "Columns", "UGATrainer", "VmapTrainer", "batch_order"]
