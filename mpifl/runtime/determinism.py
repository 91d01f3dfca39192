"""Exact or fast GPU kernels: ``run.deterministic``, set on every rank before any CUDA work.

A GPU run is bit-identical across world sizes, client orders and a kill and resume only when
every kernel sums in a fixed order. ``run.deterministic = true`` (the default) asks torch for
that (PyTorch, "Reproducibility", https://pytorch.org/docs/stable/notes/randomness.html):
deterministic algorithms, cuDNN's deterministic convolutions without autotuning, no TF32
(float32 products rounded to 10-bit mantissas) and a fixed cuBLAS workspace
(``CUBLAS_WORKSPACE_CONFIG=:4096:8``, NVIDIA's cuBLAS guide, "Results reproducibility"), which
must be in the environment before the first cuBLAS call. ``false`` lets cuDNN pick the fastest
kernels (autotuning, TF32) and results may then differ in the last bits from run to run.

On the CPU nothing changes: mpifl's CPU kernels are deterministic already, and ``false``
touches only the CUDA settings. A kernel torch has no deterministic form of raises when it
runs; :func:`nondeterministic_line` turns that into one line naming it and the setting.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mpifl.core.errors import MpiflError

__all__ = ["CUBLAS_WORKSPACE", "Determinism", "apply_determinism", "nondeterministic_line",
           "named_nondeterminism"]

#: cuBLAS's fixed workspace for reproducible results (the larger of NVIDIA's two settings)
CUBLAS_WORKSPACE = ":4096:8"

#: torch's message for an operation without a deterministic implementation, naming it
_NO_DETERMINISTIC = re.compile(r"^(?P<op>\S+) does not have a deterministic implementation")
#: torch's message for cuBLAS without a fixed workspace (it was set after the first call)
_CUBLAS = "CUBLAS_WORKSPACE_CONFIG"


@dataclass(frozen=True)
class Determinism:
    """torch's process-wide settings that decide exactness against speed (a snapshot).

    Attributes:
        algorithms: ``torch.are_deterministic_algorithms_enabled()``.
        cudnn_deterministic, cudnn_benchmark: ``torch.backends.cudnn``'s flags.
        matmul_tf32, cudnn_tf32: TF32 allowed in cuBLAS products and cuDNN convolutions.
        matmul_precision: ``torch.get_float32_matmul_precision()``.
    """

    algorithms: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    matmul_tf32: bool
    cudnn_tf32: bool
    matmul_precision: str

    @classmethod
    def now(cls) -> Determinism:
        """The settings in force in this process."""
        return cls(torch.are_deterministic_algorithms_enabled(),
                   torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
                   torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                   torch.get_float32_matmul_precision())

    def restore(self) -> None:
        """Put these settings back (after an in-process run: :func:`mpifl.run`)."""
        torch.use_deterministic_algorithms(self.algorithms)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cuda.matmul.allow_tf32 = self.matmul_tf32
        torch.backends.cudnn.allow_tf32 = self.cudnn_tf32
        torch.set_float32_matmul_precision(self.matmul_precision)


def apply_determinism(deterministic: bool) -> None:
    """Set this process's torch for exact (``True``) or fast (``False``) GPU kernels.

    ``True``: deterministic algorithms (an operation without one raises), cuDNN deterministic
    and not autotuned, TF32 off, float32 matmul precision "highest", and
    ``CUBLAS_WORKSPACE_CONFIG`` set to :data:`CUBLAS_WORKSPACE` unless the environment sets it.
    Call it before any CUDA work: cuBLAS reads the variable when it starts.

    ``False``: torch's algorithms as they come, cuDNN autotuned, TF32 allowed, only where a
    CUDA device exists (so CPU float32 products keep their full precision).
    """
    if deterministic:
        os.environ.setdefault(_CUBLAS, CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        return
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 precision "high" too
        torch.backends.cudnn.allow_tf32 = True


def nondeterministic_line(exc: BaseException | None) -> str | None:
    """One line for a failure that deterministic mode caused, else None.

    It looks through ``exc``'s causes too (a plugin model's failure,
    :class:`mpifl.core.errors.PluginFailure`, carries torch's error as its cause).
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError):
            text = (str(exc).strip().splitlines() or [""])[0]
            if match := _NO_DETERMINISTIC.match(text):
                return (f"{match['op']} has no deterministic implementation on this device "
                        "(run.deterministic = true); set run.deterministic = false to trade "
                        "exactness for speed (results may then differ in the last bits)")
            if _CUBLAS in text and "deterministic" in text:
                return (f"cuBLAS ran without a fixed workspace (run.deterministic = true): "
                        f"start the job with {_CUBLAS}={CUBLAS_WORKSPACE} in the environment, "
                        "or set run.deterministic = false to trade exactness for speed")
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def named_nondeterminism() -> Iterator[None]:
    """Re-raise a failure of deterministic mode inside the block as one-line
    :class:`MpiflError` (:func:`nondeterministic_line`); anything else passes unchanged."""
    try:
        yield
    except Exception as exc:
        line = nondeterministic_line(exc)
        if line is None:
            raise
        raise MpiflError(line) from exc
