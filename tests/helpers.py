"""Shared by the tests: where real Fashion-MNIST is, the real mpiexec, and one round of a
trainer's training."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    from torch import Tensor

    from mpifl.clients.interface import ClientTrainer

FMNIST = Path("/usr/share/datasets/fashion-mnist")
#: the original Adult, COMPAS and German credit files (adult/, compas/, german/): the folder
#: MPIFL_TEST_DATA names, else shared/data beside the repository (where CI keeps them)
TABULAR_DATA = Path(os.environ.get("MPIFL_TEST_DATA")
                    or Path(__file__).resolve().parents[2] / "shared" / "data")


def mpiexec() -> str:
    """The mpiexec of the MPICH wheel (or the system's); fail, never skip, when missing."""
    exe = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    if not Path(exe).exists():
        pytest.fail("mpiexec not found: pip install mpi4py mpich (the README's test command does)")
    return exe


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, deepest first (mpiexec's ranks live in their own
    sessions, so a process-group kill would miss them)."""
    import subprocess

    rows = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in rows.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    order, stack = [], [pid]
    while stack:
        p = stack.pop()
        order.append(p)
        stack.extend(children.get(p, []))
    return order[::-1]


def kill_tree(pid: int) -> None:
    """SIGKILL a whole mpiexec job (ranks, proxy, mpiexec) in one sweep."""
    import os
    import signal

    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port_pair() -> int:
    """A port p with p and p+1 free (slurmctld, slurmd: the SLURM clusters of the tests)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    pytest.fail("no two consecutive free ports")


def small_fmnist_job(name: str, *, seed: int, rounds: int, eval_every: int,
                     checkpoint_every: int, partition: str, algorithm: str) -> str:
    """TOML of a small job on real Fashion-MNIST for the MPI tests: 10 clients, 4 per round,
    MLP 784-16-10, one full-batch step a round. ``partition`` is the partition's TOML lines
    (e.g. ``'partition = "shards"'``)."""
    return f"""
[run]
name = "{name}"
seed = {seed}
rounds = {rounds}
eval_every = {eval_every}
checkpoint_every = {checkpoint_every}
[data]
dataset = "fashion_mnist"
{partition}
num_clients = 10
[model]
name = "mlp"
hidden = [16]
[client]
epochs = 1
batch_size = 0
lr = 0.1
[server]
algorithm = "{algorithm}"
clients_per_round = 4
"""


def write_fmnist_job(tmp_path_factory, name: str, text: str) -> Path:
    """A TOML job on real Fashion-MNIST in a fresh temp folder (fails if the data is missing)."""
    if not FMNIST.is_dir():
        pytest.fail(f"{FMNIST} missing: apt-get install dataset-fashion-mnist")
    path = tmp_path_factory.mktemp("job") / name
    path.write_text(text)
    return path


def h5_round_trip(state: dict, path: Path) -> dict:
    """An aggregator ``state_dict()`` written and read back by the real checkpoint code."""
    import h5py

    from mpifl.store.checkpoint import _read_state, _write_state

    with h5py.File(path, "w") as f:
        _write_state(f.create_group("aggregator"), state)
    with h5py.File(path, "r") as f:
        return _read_state(f["aggregator"])


def fill_disk(folder: Path, leave: int = 0) -> Path:
    """Fill the file system of ``folder`` from outside (as another process would) until at most
    ``leave`` bytes are free; returns the filler file (delete it, or remount bigger, to free)."""
    import os

    filler = folder / f"filler-{os.getpid()}-{len(list(folder.glob('filler-*')))}"
    with open(filler, "wb", buffering=0) as f:
        for _ in range(100_000):
            st = os.statvfs(folder)
            free = st.f_bavail * st.f_frsize
            if free <= leave:
                break
            try:
                f.write(bytes(min(free - leave, 1 << 20)))
            except OSError:  # full (tmpfs rounds to pages)
                break
    return filler


def train(trainer: ClientTrainer, w: Tensor, round: int, lr: float, client_ids: np.ndarray,
          sample_idx: Sequence[np.ndarray]) -> tuple[Tensor, Tensor]:
    """The ``(updates, losses)`` pair of one round of ``trainer.run_round``, the trainers' one
    training entry point, with no round inputs or state rows: for tests of the training itself
    (the statistics, when the trainer reports any, are dropped)."""
    updates, losses, _ = trainer.run_round(w, round, lr, client_ids, sample_idx)
    return updates, losses
