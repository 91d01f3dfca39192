"""A trainer whose failures name the user's code: when a plugin model's forward or a plugin
loss raises during training or evaluation, the run ends with one line such as
``model 'small_resnet' (mpifl_models.models:small_resnet) or loss 'smoothed_ce'
(mpifl_models.losses:smoothed_ce_fn) failed to train: RuntimeError: ...`` (exit status 2).
"""

from __future__ import annotations

from mpifl.core.blame import blame

__all__ = ["Blamed"]

#: Trainer methods that run the model and the loss, and the phase each one is.
_PHASES = {"run_round": "train", "train": "train", "evaluate": "evaluate",
           "evaluate_groups": "evaluate", "evaluate_each": "evaluate",
           "evaluate_local": "evaluate", "evaluate_adapted": "evaluate (adapted)"}


class Blamed:
    """Wraps a trainer; its model- and loss-running methods report plugin failures.

    Args:
        trainer: any trainer of :mod:`mpifl.clients`.
        parts: ``[(kind, name, object), ...]`` the parts to blame (plugins among them are
            named; mpifl's own are not), e.g. ``[("model", "small_resnet", factory)]``.
    """

    def __init__(self, trainer, parts: list[tuple[str, str, object]]):
        self.trainer, self.parts = trainer, parts

    def __getattr__(self, name):
        attr = getattr(self.trainer, name)
        phase = _PHASES.get(name)
        if phase is None or not callable(attr):
            return attr

        def call(*args, **kwargs):
            with blame(self.parts, phase):
                return attr(*args, **kwargs)

        return call
