"""mpifl: an MPI cluster simulator for fair federated learning.

Rank 0 is the server (global model, client update history, aggregation); every other rank
hosts many simulated clients and trains the selected ones together with ``torch.func.vmap``.
"""

from mpifl.core.version import __version__  # noqa: F401


def __getattr__(name: str):
    # ``mpifl.load`` without importing xarray (or torch) when only the version is wanted
    if name == "load":
        from mpifl.report.load import load

        return load
    raise AttributeError(f"module 'mpifl' has no attribute {name!r}")
