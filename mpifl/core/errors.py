"""Errors that mean "the user (or the machine) got something wrong", not "mpifl has a bug".

The command line catches :class:`MpiflError`, prints its message on one line and exits with
the error's ``exit_status`` (2; :data:`EXIT_PEER_LOST` for :class:`PeerLost`), never a
traceback. Anything else is a bug and keeps its traceback.
"""

#: Exit status of a command stopped by a :class:`MpiflError`: bad input, not worth retrying.
EXIT_BAD_INPUT = 2

#: Exit status of a job that ended because a rank stopped answering (:class:`PeerLost`): not
#: the input's fault, so the SLURM templates and sweep jobs launch it again with --resume
#: (status 2, bad input, they do not).
EXIT_PEER_LOST = 4

#: Exit status of ``mpifl check`` when the check could not run (the rule raised while it was
#: built, aggregated or restored): there is no verdict, unlike status 1 (the rule does not
#: resume exactly) or 0 (it does).
EXIT_CHECK_NOT_RUN = 5


class MpiflError(Exception):
    """Base class: a one-line, user-facing problem (exit status 2)."""

    exit_status = EXIT_BAD_INPUT


class ConfigError(MpiflError):
    """An experiment configuration is invalid (unknown key, wrong type, out of range)."""


class DataError(MpiflError):
    """A dataset is missing, damaged or in an unexpected format."""


class OutputError(MpiflError):
    """An output path cannot be written, or a results file is damaged or foreign."""


class PeerLost(MpiflError):
    """Another MPI rank did not answer within ``run.peer_timeout_s`` (it hangs, or its node is
    lost): the job is ended, with status :data:`EXIT_PEER_LOST`, rather than left waiting
    forever."""

    exit_status = EXIT_PEER_LOST


class PluginFailure(MpiflError):
    """User code from a plugin (a model, loss, data set or rule) raised: the message names the
    part, where it comes from (``pkg.module:object``) and the phase (build, check, load, train,
    aggregate). Exit status 2: the run cannot succeed until the plugin is fixed."""
