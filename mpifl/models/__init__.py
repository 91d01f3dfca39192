"""models — the model zoo (ALGORITHMS.md §9) behind the model registry, and the contract that
every trainer needs from a model (float32 parameters and buffers), what the vectorised ones need
beyond it (no buffers, no randomness: :func:`model_traits`), and the loss (``[model] loss``).

May import: core, metrics.  Never imports: data, aggregators, store or anything above them.
"""

from mpifl.core.layout import Layer, ParamLayout
from mpifl.models.losses import LOSSES, Loss, get_loss
from mpifl.models.zoo import (MODEL_FACTORIES, MODELS, OUTPUTS, ModelTraits, build_model,
                              check_model, model_traits)
# The federated benchmarks' models register themselves on import (ALGORITHMS.md §9).
from mpifl.models import char_lstm, cnn_femnist, resnet_gn, transformer_lm  # noqa: F401,E402

__all__ = ["LOSSES", "MODELS", "MODEL_FACTORIES", "OUTPUTS", "Layer", "Loss", "ModelTraits",
           "ParamLayout", "build_model", "check_model", "get_loss", "model_traits"]
