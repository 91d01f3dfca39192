"""The token-id convention shared by the data sets that hold text and the loss that reads it."""

from __future__ import annotations

__all__ = ["PAD"]

#: The padding token id of every mpifl token data set, in inputs and sequence targets alike:
#: id 0 of its vocabulary, skipped by the ``token_cross_entropy`` loss and its accuracy.
PAD = 0
