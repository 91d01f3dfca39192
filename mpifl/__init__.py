"""mpifl: an MPI cluster simulator for fair federated learning.

Rank 0 is the server (global model, client update history, aggregation); every other rank
hosts many simulated clients and trains the selected ones together with ``torch.func.vmap``.
"""

from mpifl.core.version import __version__  # noqa: F401


def __getattr__(name: str):
    # ``mpifl.load`` and ``mpifl.run`` without importing xarray (or torch) when only the
    # version is wanted
    if name == "load":
        from mpifl.report.load import load

        return load
    if name in ("run", "RunStopped"):
        from mpifl import api

        return getattr(api, name)
    if name in ("MpiflError", "ConfigError", "DataError", "OutputError"):
        from mpifl.core import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'mpifl' has no attribute {name!r}")
