"""The package version, here (below every layer) so that files can record it without importing
the top-level package (whose ``mpifl.load`` belongs to the report layer)."""

__version__ = "0.1.0"
