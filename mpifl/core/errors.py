"""Errors that mean "the user (or the machine) got something wrong", not "mpifl has a bug".

The command line catches :class:`MpiflError`, prints its message on one line and exits with
status 2, never a traceback. Anything else is a bug and keeps its traceback.
"""


class MpiflError(Exception):
    """Base class: a one-line, user-facing problem (exit status 2)."""


class ConfigError(MpiflError):
    """An experiment configuration is invalid (unknown key, wrong type, out of range)."""


class DataError(MpiflError):
    """A dataset is missing, damaged or in an unexpected format."""


class OutputError(MpiflError):
    """An output path cannot be written, or a results file is damaged or foreign."""


class PeerLost(MpiflError):
    """Another MPI rank did not answer within ``run.peer_timeout_s`` (it hangs, or its node is
    lost): the job is ended rather than left waiting forever."""
