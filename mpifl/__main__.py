"""``python -m mpifl`` and the ``mpifl`` command.

The entry point imports nothing heavy before it has set up signals: importing the command line
takes seconds (torch), and a Ctrl-C there would otherwise print a traceback; for ``run`` and
``resume`` a signal is recorded instead and the run's set-up stops at its next step, on every
rank together (:mod:`mpifl.runtime.agreement`).
"""

import signal
import sys


def entry() -> int:
    """Run the ``mpifl`` command line (``sys.argv``); its exit status."""
    words = [a for a in sys.argv[1:] if not a.startswith("-")]
    launched = words[:1] in (["run"], ["resume"]) and "--seeds" not in sys.argv
    if launched:
        from mpifl.runtime.signals import StopRequest

        StopRequest.process()
    try:
        from mpifl.cli import main
    except KeyboardInterrupt:
        print("mpifl: interrupted", file=sys.stderr)
        return 130
    status = main()
    if launched:
        # the status is decided (and agreed by every rank); a launcher that kills the ranks
        # still exiting once one has exited non-zero (srun --kill-on-bad-exit) must not turn
        # it into 143 while Python finalises: SIG_IGN is the one handler that outlives that
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return status


if __name__ == "__main__":
    sys.exit(entry())
