"""models — the model zoo (ALGORITHMS.md §9) behind the model registry, and the contract that
vmapped training needs from a model (float32 parameters, no buffers).

May import: core, metrics.  Never imports: data, aggregators, store or anything above them.
"""

from mpifl.core.layout import Layer, ParamLayout
from mpifl.models.zoo import MODEL_FACTORIES, MODELS, OUTPUTS, build_model, check_model

__all__ = ["MODELS", "MODEL_FACTORIES", "OUTPUTS", "Layer", "ParamLayout", "build_model",
           "check_model"]
