"""Host <-> device staging of a worker's round buffers: the global parameters in, the block's
updates, losses and statistics out (:class:`mpifl.runtime.worker.Worker`).

On a CUDA device a copy from pageable host memory is synchronous and goes through a driver
bounce buffer; from page-locked (pinned) memory it is a DMA that ``non_blocking=True`` leaves
queued on the stream. :class:`Staging` keeps one pinned host buffer per slot (``w``, the
state rows, each output), reused round after round and grown when a round needs more, so
pinning (a slow, page-locking allocation) happens a few times per run, not per round. On any
other device it is the plain path: ``torch.from_numpy(a).to(device)`` in, ``.cpu().numpy()``
out, zero-copy on a CPU (pinning needs CUDA).
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    """Reusable host buffers for one rank's copies to and from ``device``.

    The arrays :meth:`to_host` returns on CUDA are views of its buffers: they hold their
    values until the next :meth:`to_host` call, which overwrites them. A TRAIN's reply is
    gathered before the worker serves the next request (:meth:`mpifl.runtime.protocol.Train.
    serve`), so one set of out buffers is enough.

    Args:
        device: where the rank computes.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        #: pinned buffers are used (CUDA only)
        self.pinned = self.device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}  # slot -> (capacity,) uint8, pinned
        self._copied: dict[str, torch.cuda.Event] = {}  # slot -> its last copy to the device

    def _host(self, slot: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A (shape, dtype) view of slot's pinned buffer, grown (to the request) if smaller."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buf
        return buf[:nbytes].view(dtype).view(shape)

    def to_device(self, a: np.ndarray, slot: str = "w") -> torch.Tensor:
        """``a`` as a tensor on the device (its dtype and shape; a new tensor on CUDA, the
        same memory on a CPU).

        On CUDA, ``a`` is copied into slot's pinned buffer and from there with
        ``non_blocking=True``: ``a`` may be overwritten as soon as this returns, and kernels
        queued after it on the current stream see the copy. Before the buffer is written again
        the previous copy out of it is waited for (a CUDA event).
        """
        t = torch.from_numpy(a)
        if not self.pinned:
            return t.to(self.device)
        done = self._copied.get(slot)
        if done is not None:
            done.synchronize()
        host = self._host(slot, tuple(t.shape), t.dtype)
        host.copy_(t)
        out = host.to(self.device, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        event.record(torch.cuda.current_stream(self.device))
        self._copied[slot] = event
        return out

    def to_host(self, *tensors: torch.Tensor) -> tuple[np.ndarray, ...]:
        """The tensors as numpy arrays (same shapes and dtypes), in order.

        On CUDA: each copied with ``non_blocking=True`` into its own pinned out buffer, then
        one synchronisation of the current stream, so the arrays are complete when this
        returns (MPI reads them). They are views of the buffers, valid until the next call.
        Elsewhere: ``t.cpu().numpy()`` (zero-copy for CPU tensors).
        """
        if not self.pinned:
            return tuple(t.detach().cpu().numpy() for t in tensors)
        out = []
        for i, t in enumerate(tensors):
            host = self._host(f"out{i}", tuple(t.shape), t.dtype)
            host.copy_(t.detach(), non_blocking=True)
            out.append(host.numpy())
        torch.cuda.current_stream(self.device).synchronize()
        return tuple(out)

    @property
    def nbytes(self) -> int:
        """Bytes of pinned host memory held."""
        return sum(b.numel() for b in self._buffers.values())
