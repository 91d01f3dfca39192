"""The parameter layout: where every parameter and layer of a model lives in the flat float32
vector ``w`` (ALGORITHMS.md §0: the concatenation of ``model.named_parameters()`` in order, each
module's floating-point buffers, e.g. BatchNorm's running statistics, after its parameters)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["Layer", "ParamLayout", "buffer_names", "model_state"]


def model_state(model: nn.Module) -> list[tuple[str, Tensor]]:
    """The tensors that make up w: per module (``named_modules()`` order), its own parameters,
    then its persistent floating-point buffers. Shared parameters appear once, as in
    ``named_parameters()``."""
    out: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((dot + name, p))
        for name, b in module.named_buffers(recurse=False):
            if (b is not None and b.is_floating_point()
                    and name not in module._non_persistent_buffers_set):
                out.append((dot + name, b))
    return out


def buffer_names(model: nn.Module) -> list[str]:
    """Names of the entries of :func:`model_state` that are buffers (empty: parameters only)."""
    params = {n for n, _ in model.named_parameters()}
    return [n for n, _ in model_state(model) if n not in params]


@dataclass(frozen=True)
class Layer:
    """One module's parameters (weight and bias together) as a slice ``[start, stop)`` of w."""

    name: str
    start: int
    stop: int

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)


class ParamLayout:
    """Where every parameter and every layer lives in the flat float32 vector ``w`` of size d.

    Attributes:
        names: entry names in :func:`model_state` order (``named_parameters()``, each module's
            float buffers after its parameters), e.g. ``"fc1.weight"``, ``"bn1.running_mean"``.
        shapes: their shapes.
        numels: their element counts.
        offsets: start of each parameter in w (``offsets[i] : offsets[i] + numels[i]``).
        d: total number of parameters.
        layers: one :class:`Layer` per module owning parameters, in model order; the slices
            tile ``[0, d)`` (FedLF's layers, ALGORITHMS.md §5; the per-layer conflict counts,
            ALGORITHMS.md §10).
    """

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]]):
        if len(names) != len(shapes):
            raise ValueError(f"{len(names)} names but {len(shapes)} shapes")
        self.names: list[str] = list(names)
        self.shapes: list[torch.Size] = [torch.Size(s) for s in shapes]
        self.numels: list[int] = [s.numel() for s in self.shapes]
        self.offsets: list[int] = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.d: int = sum(self.numels)
        self.layers: list[Layer] = self._group_layers()

    @classmethod
    def from_module(cls, model: nn.Module) -> ParamLayout:
        """Layout of the model's state: ``model.named_parameters()`` in order, each module's
        persistent floating-point buffers (BatchNorm's ``running_mean`` and ``running_var``)
        right after its own parameters. Integer buffers (``num_batches_tracked``) are not part
        of w. For a model without buffers this is exactly ``named_parameters()``."""
        named = model_state(model)
        return cls([n for n, _ in named], [p.shape for _, p in named])


    def _group_layers(self) -> list[Layer]:
        # named_parameters() yields each module's own parameters consecutively, so grouping
        # consecutive names by their module prefix gives contiguous layers.
        layers: list[Layer] = []
        for name, off, n in zip(self.names, self.offsets, self.numels):
            module = name.rpartition(".")[0] or name
            if layers and layers[-1].name == module and layers[-1].stop == off:
                layers[-1] = Layer(module, layers[-1].start, off + n)
            else:
                layers.append(Layer(module, off, off + n))
        return layers

    def __repr__(self) -> str:
        return f"ParamLayout(d={self.d}, layers={[(l.name, l.stop - l.start) for l in self.layers]})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParamLayout):
            return NotImplemented
        return self.names == other.names and self.shapes == other.shapes

    def flatten(self, params: Mapping[str, Tensor]) -> Tensor:
        """Concatenate named parameters into w.

        Args:
            params: name -> tensor of shape ``(*batch, *shape)``; the same leading batch shape
                (possibly empty) for all of them.

        Returns:
            float32 tensor ``(*batch, d)`` (a new tensor; gradients flow through it).

        Raises:
            ValueError: a parameter is missing or has the wrong shape.
        """
        missing = [n for n in self.names if n not in params]
        if missing:
            raise ValueError(f"parameters missing from the mapping: {missing}")
        first = params[self.names[0]]
        batch = first.shape[: first.dim() - len(self.shapes[0])]
        pieces = []
        for name, shape in zip(self.names, self.shapes):
            p = params[name]
            if p.shape != batch + shape:
                raise ValueError(f"parameter {name} has shape {tuple(p.shape)}, "
                                 f"expected {tuple(batch + shape)}")
            pieces.append(p.reshape(*batch, -1))
        return torch.cat(pieces, dim=-1).to(torch.float32)

    def flatten_module(self, model: nn.Module) -> Tensor:
        """w of ``model`` (parameters and float buffers) as a detached float32 ``(d,)`` tensor
        on the model's device."""
        return self.flatten(dict(model_state(model))).detach()

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Split ``flat`` of shape ``(..., d)`` into name -> view of shape ``(..., *shape)``.

        Uses ``split`` so that, under ``torch.func.grad``, the gradient with respect to ``flat``
        is assembled by one concatenation (slicing would scatter into d-sized zeros per tensor).

        Raises:
            ValueError: the last dimension is not d.
        """
        if flat.dim() == 0 or flat.shape[-1] != self.d:
            raise ValueError(f"expected a tensor of shape (..., {self.d}), got {tuple(flat.shape)}")
        lead = flat.shape[:-1]
        pieces = torch.split(flat, self.numels, dim=-1)
        # reshape is a view whenever flat's last dimension is contiguous (the usual case).
        return {n: p.reshape(*lead, *s) for n, p, s in zip(self.names, pieces, self.shapes)}
