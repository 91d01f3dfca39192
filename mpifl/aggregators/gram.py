"""The Gram matrix ``X X^T`` of stacked updates: the one O(m^2 d) product of the Gram-space
rules (FedFV, FedMGDA+, mFairFL's curation, FedLF, FedMDFG)."""

from __future__ import annotations

import functools

import numpy as np
import torch
from threadpoolctl import ThreadpoolController
from torch import Tensor


@functools.cache
def _blas() -> ThreadpoolController:
    return ThreadpoolController()


def gram(X: Tensor) -> np.ndarray:
    """All pairwise dot products of the rows of X.

    Args:
        X: (m, d) float32 or float64 tensor on any device (a column slice of a larger matrix
            is fine).

    Returns:
        (m, m) float64 numpy array ``X X^T``, accumulated in X's dtype.

    When torch runs on one CPU thread (MPI ranks with ``OMP_NUM_THREADS=1``, as the SLURM
    templates set) the product is numpy's, on one BLAS thread: numpy's matmul of an array with
    its own transpose calls BLAS ``syrk``, which computes one triangle, half a GEMM's flops
    (1.7x torch's GEMM at m = 60, d = 199,210 and 2.2x at m = 1,000, d = 54,410 on the 2-core
    VM). With several threads torch's ``X @ X.T`` is used: OpenBLAS's and torch's OpenMP
    thread pools then compete for the cores and both slow down. Elsewhere (CUDA, other
    dtypes) torch's product as well.
    """
    X = X.detach()
    if (X.device.type == "cpu" and X.dtype in (torch.float32, torch.float64)
            and torch.get_num_threads() == 1):
        a = X.numpy()
        with _blas().limit(limits=1, user_api="blas"):
            return np.asarray(a @ a.T, dtype=np.float64)
    return (X @ X.T).to(torch.float64).cpu().numpy()
