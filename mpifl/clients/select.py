"""Which local-training path runs a model: ``client.trainer = "auto" | "vmap" | "loop"``.

- ``vmap``: the rule's vectorised trainer (:class:`~mpifl.clients.VmapTrainer` and its
  subclasses; the batched-matmul path for the plain MLP family). Exact for models without
  buffers or random layers.
- ``loop``: :class:`~mpifl.clients.loop.LoopTrainer`, one client at a time on a plain module:
  any model (BatchNorm, Dropout, ``F.dropout``), plain local SGD and FedProx only.
- ``auto``: the loop when the model needs it (buffers or randomness) or when vmap has no
  batching rule for one of its operators (``nn.LSTM`` on a CPU: vmap would loop over the
  clients inside that operator anyway); otherwise a rule measured
  on this project's 2-core CPU machine (docs/BENCHMARKS.md, "Trainer paths"): convolutional
  models train faster in the loop on a CPU (W2, the FedAvg CNN on Fashion-MNIST: loop 2.45 s
  against vmap 4.1 s a round), everything else faster vectorised (the MLP family by several
  times); on a GPU the vectorised path for every model it can take.
"""

from __future__ import annotations

from mpifl.core.errors import ConfigError
from mpifl.models.zoo import ModelTraits

__all__ = ["TRAINER_PATHS", "select_trainer"]

TRAINER_PATHS = ("auto", "vmap", "loop")


def select_trainer(requested: str, traits: ModelTraits, rule_kind: str, device_type: str,
                   rule: str = "the rule") -> tuple[str, str]:
    """The path that trains this model, and why (one phrase, for the log).

    Args:
        requested: ``client.trainer``. traits: :func:`mpifl.models.model_traits` of the model.
        rule_kind: the rule's ``needs.trainer`` (``"sgd"`` for plain local SGD).
        device_type: ``"cpu"`` or ``"cuda"``. rule: the rule's name, for messages.

    Returns:
        ``("vmap" | "loop", reason)``.

    Raises:
        ConfigError: the model needs the loop but the rule trains with its own vectorised
            trainer, or ``vmap`` was pinned for a model it cannot train exactly.
    """
    shown = ", ".join(traits.buffers[:2]) + (", ..." if len(traits.buffers) > 2 else "")
    needs = " and ".join([*([f"{len(traits.buffers)} buffers ({shown})"] if traits.buffers else []),
                          *(["random layers"] if traits.random else [])])
    if requested not in TRAINER_PATHS:
        raise ConfigError(f"client.trainer: unknown path {requested!r}; choose auto, vmap or loop")
    if not traits.vmappable:
        if requested == "vmap":
            raise ConfigError(f"client.trainer: 'vmap' cannot train this model exactly ({needs}); "
                              f"use 'loop' or 'auto'")
        if rule_kind != "sgd":
            raise ConfigError(f"model: {rule}'s local training ('{rule_kind}') is vectorised and "
                              f"cannot train this model ({needs}); use a model without them")
        return "loop", f"the model has {needs}"
    if requested != "auto":
        return requested, "pinned by client.trainer"
    if rule_kind != "sgd":
        return "vmap", f"{rule} has its own vectorised trainer"
    if traits.unbatched:
        return "loop", (f"vmap has no batching rule for {', '.join(traits.unbatched)} and would "
                        f"run it one client at a time anyway")
    if traits.convolutional and device_type == "cpu":
        return "loop", "convolutions on a CPU train faster one client at a time"
    return "vmap", "vectorised clients are faster for this model and device"
