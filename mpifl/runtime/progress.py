"""Progress lines for batch jobs: under ``mpiexec`` or ``srun`` stderr is a pipe into a log
file and the progress bar does not show, so the server also logs, every
``run.progress_every_s`` seconds and at every evaluation, one line a user can ``tail -f``::

    progress: round 37/100 (37%), 0.42 s/round, ETA 0:00:26, peak memory 0.81 GB/rank, mean acc 0.7512, worst5 0.3011
"""

from __future__ import annotations

import datetime
import logging
import time

log = logging.getLogger("mpifl.server")

__all__ = ["ProgressLog"]


class ProgressLog:
    """Decides when to log a progress line and writes it.

    Args:
        total: ``run.rounds``. start: the first round of this process (after a resume, the
            rounds already done; the rate counts this process's rounds only).
        every_s: seconds between lines (0: none, not even at evaluations).
        clock: monotonic seconds (a parameter for tests).
    """

    def __init__(self, total: int, start: int, every_s: float, clock=time.monotonic):
        self.total, self.start, self.every_s, self.clock = total, start, float(every_s), clock
        self.t0 = self.last = clock()
        self.metrics = ""

    def round_done(self, rnd: int, row: dict, summary: dict | None) -> bool:
        """After round ``rnd`` (0-based): log a line if the interval passed or it evaluated.
        ``row`` is the round's /rounds row (peak memory), ``summary`` its evaluation or None.
        Returns whether a line was logged."""
        if not self.every_s:
            return False
        if summary is not None:
            self.metrics = _metrics(summary)
        now = self.clock()
        if summary is None and now - self.last < self.every_s:
            return False
        self.last = now
        done = rnd + 1
        per_round = (now - self.t0) / max(1, done - self.start)
        eta = datetime.timedelta(seconds=round(per_round * (self.total - done)))
        peak = max(row.get("peak_rss_server_mb", 0.0), row.get("peak_rss_worker_mb", 0.0))
        log.info("progress: round %d/%d (%.0f%%), %.3g s/round, ETA %s, peak memory %.2f GB/rank%s",
                 done, self.total, 100 * done / self.total, per_round, eta, peak / 1024,
                 f", {self.metrics}" if self.metrics else "")
        return True


def _metrics(summary: dict) -> str:
    if "loss/mean" in summary:
        return f"mean loss {summary['loss/mean']:.5g}, worst5 loss {summary['loss/worst5']:.5g}"
    return f"mean acc {summary['mean']:.4f}, worst5 {summary['worst5']:.4f}"
