"""A trainer whose failures name the user's code: when a plugin model's forward or a plugin
loss raises during training or evaluation, the run ends with one line such as
``model 'small_resnet' (mpifl_models.models:small_resnet) or loss 'smoothed_ce'
(mpifl_models.losses:smoothed_ce_fn) failed to train: RuntimeError: ...`` (exit status 2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from mpifl.clients.interface import ClientTrainer, TrainerWrapper
from mpifl.core.blame import blame

__all__ = ["Blamed"]

T = TypeVar("T")


class Blamed(TrainerWrapper):
    """Wraps a trainer; its model- and loss-running calls (training, every evaluation) report
    plugin failures.

    Args:
        trainer: any :class:`~mpifl.clients.interface.ClientTrainer`.
        parts: ``[(kind, name, object), ...]`` the parts to blame (plugins among them are
            named; mpifl's own are not), e.g. ``[("model", "small_resnet", factory)]``.
    """

    def __init__(self, trainer: ClientTrainer, parts: list[tuple[str, str, object]]):
        super().__init__(trainer)
        self.parts = parts

    def _call(self, phase: str, fn: Callable[..., T], *args: Any) -> T:
        with blame(self.parts, phase):
            return fn(*args)
