"""``mpifl export``: runs as long-form tables (CSV or Parquet) for pandas, R or a spreadsheet.

Three files, the tables of :func:`mpifl.report.load.tables`: ``rounds`` (one row per run and
training round), ``evals`` (per run and evaluation: the summaries) and ``clients`` (per run,
evaluation and client: accuracy and loss). Accuracies are fractions (docs/RESULTS.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from mpifl.core.errors import OutputError
from mpifl.report.load import load_noted, tables
from mpifl.store.sealed import reason

if TYPE_CHECKING:
    import pandas as pd


def export(runs: list[str], folder: Path, fmt: str) -> list[Path]:
    """Write ``folder/{rounds,evals,clients}.{csv,parquet}``; each file appears whole or not at
    all (written to a temporary name, then renamed).

    Args:
        runs: results files, or one sweep folder.
        fmt: ``csv`` or ``parquet``.

    Returns:
        The paths written.

    Raises:
        OutputError: unreadable runs, an unwritable folder, or Parquet without pyarrow.
    """
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise OutputError("--parquet needs pyarrow: pip install 'mpifl[parquet]' "
                              "(or use --csv)") from None
    source = runs[0] if len(runs) == 1 and Path(runs[0]).is_dir() else runs
    ds = load_noted(source)  # a large run lazily: its per-client arrays are read by tables()
    try:
        frames = tables(ds)
    finally:
        ds.close()  # the files a lazy load keeps open
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{folder}: cannot create the folder ({reason(exc)})") from None
    written = []
    for name, frame in frames.items():
        path = folder / f"{name}.{fmt}"
        _write_table(frame, path, fmt)
        written.append(path)
    return written


def _write_table(frame: pd.DataFrame, path: Path, fmt: str) -> None:
    """``frame`` as ``path``: a temporary file beside it, fsynced, renamed. Any I/O error (a
    full disk, EIO) is one :class:`OutputError` naming ``path``; the temporary is removed
    whatever fails, and an older ``path`` is kept.

    Raises:
        OutputError: the file cannot be written.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if fmt == "csv":
            frame.to_csv(tmp, index=False)
        else:
            frame.to_parquet(tmp, index=False)
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)  # a delayed ENOSPC or EIO shows up here, not after the rename
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(exc, OSError):  # pyarrow's I/O errors are OSErrors too
            raise OutputError(f"cannot write export table {path}: {reason(exc)}") from None
        raise
