"""The MPICH network module for a launch under ``srun --mpi=pmi2``.

MPICH's pip wheel is built with two ch4 netmods, UCX (its default) and libfabric (``ofi``).
Under SLURM's PMI-2 server the UCX business card, hex-encoded into PMI ``put`` lines, can exceed
the 1,024 bytes a line may hold and MPI_Init then fails or hangs; libfabric's card always fits
(slurm/README.md, "MPI_Init under srun, and the libfabric netmod"). The sbatch templates and
:class:`mpifl.sweep.job.MpiRun` therefore choose ``ofi`` when the MPI that mpi4py loads offers
both and the user chose nothing (``MPIR_CVAR_CH4_NETMOD``):

    python -m mpifl.sweep.netmod     # prints "ofi", or nothing when no choice is needed
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping

#: MPICH's variable that picks the ch4 netmod at MPI_Init
VARIABLE = "MPIR_CVAR_CH4_NETMOD"


def choose_netmod(library_version: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The netmod to set for srun: ``"ofi"`` for an MPICH whose ch4 device has both UCX and
    libfabric (the pip wheel: ``MPICH Device: ch4:ucx ofi``) when ``MPIR_CVAR_CH4_NETMOD`` is
    unset; None otherwise (another MPI, an MPICH with one netmod, or the user's own choice).

    Args:
        library_version: ``MPI_Get_library_version``'s text.
        environ: the launch's environment.
    """
    if environ.get(VARIABLE):
        return None
    device = re.search(r"^MPICH Device:\s*(\S.*)$", library_version, re.MULTILINE)
    if device is None or not device.group(1).startswith("ch4"):
        return None
    netmods = set(re.split(r"[:,\s]+", device.group(1))[1:])
    return "ofi" if {"ucx", "ofi"} <= netmods else None


def library_version() -> str:
    """The text of ``MPI_Get_library_version`` of the MPI mpi4py loads (empty without mpi4py),
    from a child process: MPI is neither initialised nor loaded in this one."""
    probe = ("import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False\n"
             "from mpi4py import MPI; print(MPI.Get_library_version())")
    try:
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def srun_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``{MPIR_CVAR_CH4_NETMOD: "ofi"}`` where :func:`choose_netmod` says so, else ``{}``."""
    if environ.get(VARIABLE):
        return {}
    netmod = choose_netmod(library_version(), environ)
    return {VARIABLE: netmod} if netmod else {}


if __name__ == "__main__":  # the sbatch templates
    if sys.argv[1:]:
        print("usage: python -m mpifl.sweep.netmod  (the MPICH netmod to use under srun, or "
              "nothing)", file=sys.stderr)
        sys.exit(2)
    print(srun_env().get(VARIABLE, ""))
