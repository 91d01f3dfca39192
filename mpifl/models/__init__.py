"""models — the model zoo (ALGORITHMS.md §9) behind the model registry, and the contract that
every trainer needs from a model (float32 parameters and buffers), what the vectorised ones need
beyond it (no buffers, no randomness: :func:`model_traits`), and the loss (``[model] loss``).

May import: core, metrics.  Never imports: data, aggregators, store or anything above them.
"""

import importlib
import pkgutil

from mpifl.core.layout import Layer, ParamLayout
from mpifl.models.losses import LOSSES, Loss, get_loss
from mpifl.models.zoo import (MODEL_FACTORIES, OUTPUTS, ModelTraits, build_model, check_model,
                              model_traits, register_model)


def _import_all() -> None:
    """Every module here, so that a model is one new file registering its factory (the
    federated benchmarks' models: cnn_femnist, char_lstm, transformer_lm, resnet_gn)."""
    # sorted, so registration (and any name clash error) does not depend on the file system
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_import_all()

#: The built-in models (ALGORITHMS.md §9): those the modules here register, before any plugin
#: can add its own.
MODELS = tuple(MODEL_FACTORIES.available())

__all__ = ["LOSSES", "MODELS", "MODEL_FACTORIES", "OUTPUTS", "Layer", "Loss", "ModelTraits",
           "ParamLayout", "build_model", "check_model", "get_loss", "model_traits",
           "register_model"]
