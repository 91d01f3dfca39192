"""The gradient-history ring: past rounds' client updates, kept for rules that project against
(or add QP rows for) clients that are absent from the current round.

Used by

- FedFV (Wang et al., "Federated Learning with Fair Averaging", IJCAI 2021): the last tau
  rounds' updates, each row flagged while it is still its client's latest one (Algorithm 3);
- FedLF (Pan et al., "FedLF: Layer-wise Fair Federated Learning", AAAI 2024): the absent
  clients' latest gradients ``u / lr`` of the last ``floor(M / m)`` rounds;
- FedMDFG (Pan et al., "FedMDFG: Federated Learning with Multi-Gradient Descent and Fair
  Guidance", AAAI 2023): one round, the last round's live clients, with each row's rescaling
  coefficient.

**What it stores.** A list of blocks, oldest round first (rounds strictly increase), one block
per stored round:

- ``round``: int, the round the rows were sent in;
- ``ids``: (b,) int64 numpy, the clients of the rows;
- ``rows``: (b, d) tensor, the updates (or gradients) themselves, in the dtype and on the
  device of the round's updates (float32 on the server's device in a job); a checkpoint loads
  them on the CPU and :meth:`HistoryRing.prepare` moves them on the next round;
- ``latest``: (b,) bool numpy, the row is still its client's latest update (a later round of
  the same client clears it: :meth:`HistoryRing.supersede`);
- ``scalars``: per-row numpy columns a rule declares (name -> (b,) array of a fixed dtype),
  e.g. FedMDFG's float64 rescaling coefficient.

The ring is bounded by the rule's horizon: :meth:`HistoryRing.push` and :meth:`HistoryRing.drop`
free every block older than the horizon or without a latest row. With ``copy=True`` a pushed
round is copied into the rows of a block being freed when one has the same shape, dtype and
device (no (m, d) allocation per round: FedFV, where the server reuses its gather buffer).

**Checkpoints.** :meth:`HistoryRing.state_dict` writes numpy arrays only (HDF5, no pickle) under
the key names the rule passes, so each rule keeps the layout it wrote before the ring existed:
``rounds`` (B,) int64, ``sizes`` (B,) int64 (rows per block), ``ids`` (N,) int64, ``latest``
(N,) uint8, ``rows`` (N, d) (``(0, 0)`` float32 when empty) and one (N,) array per scalar.
A rule that stores one round may leave out ``rounds`` and ``sizes`` (FedMDFG), one that frees
superseded rows may leave out ``latest`` (FedLF, FedMDFG).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np
import torch

__all__ = ["Block", "HistoryRing", "Selection"]


@dataclass
class Block:
    """One stored round (see the module docstring for the fields)."""

    round: int
    ids: np.ndarray
    rows: torch.Tensor
    latest: np.ndarray
    scalars: dict[str, np.ndarray] = field(default_factory=dict)


class RingKeys(TypedDict, total=False):
    """A rule's checkpoint key names for :meth:`HistoryRing.state_dict` / ``load_state_dict``."""

    ids: str
    rows: str
    rounds: str
    sizes: str
    latest: str


@dataclass
class Selection:
    """Rows picked from several blocks, oldest round first: ``ids`` (k,) int64, ``rows``
    (k, d) (None when k = 0) and the per-row ``scalars`` (k,)."""

    ids: np.ndarray
    rows: torch.Tensor | None
    scalars: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.ids)


class HistoryRing:
    """A bounded ring of past rounds' update rows (module docstring).

    Args:
        rule: the rule's name, for error messages.
        scalars: the per-row scalar columns, name -> numpy dtype.
    """

    def __init__(self, rule: str, scalars: Mapping[str, type | np.dtype] | None = None) -> None:
        self.rule = rule
        self.scalar_dtypes = {k: np.dtype(v) for k, v in (scalars or {}).items()}
        self._blocks: list[Block] = []

    # ---- reading ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Block]:
        return iter(self._blocks)

    def __len__(self) -> int:
        """Stored rounds."""
        return len(self._blocks)

    @property
    def num_rows(self) -> int:
        """Update rows held (superseded rows of a kept block included)."""
        return sum(b.rows.shape[0] for b in self._blocks)

    def since(self, first_round: int) -> list[Block]:
        """The blocks of rounds ``>= first_round``, oldest first."""
        return [b for b in self._blocks if b.round >= first_round]

    def absent(self, selected: np.ndarray, since: int | None = None) -> Selection:
        """The latest rows of clients not in ``selected`` from the blocks of rounds ``>= since``
        (all blocks for None), oldest round first; rows in their block's order. ``rows`` may be
        a stored block's own tensor (read it, do not write to it)."""
        ids: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        cols: dict[str, list[np.ndarray]] = {k: [] for k in self.scalar_dtypes}
        for b in self._blocks:
            if since is not None and b.round < since:
                continue
            keep = b.latest & ~np.isin(b.ids, selected)
            if not keep.any():
                continue
            ids.append(b.ids[keep])
            rows.append(b.rows if keep.all() else
                        b.rows[torch.as_tensor(keep, device=b.rows.device)])
            for k, col in cols.items():
                col.append(b.scalars[k][keep])
        if not ids:
            return Selection(np.zeros(0, dtype=np.int64), None,
                             {k: np.zeros(0, dtype=t) for k, t in self.scalar_dtypes.items()})
        return Selection(np.concatenate(ids), rows[0] if len(rows) == 1 else torch.cat(rows),
                         {k: np.concatenate(v) for k, v in cols.items()})

    # ---- writing ----------------------------------------------------------------------------

    def prepare(self, d: int, device: torch.device, dtype: torch.dtype) -> None:
        """Check the stored rows' dimension against the round's ``d`` and move them to the
        round's device and dtype (once, after a checkpoint load).

        Raises:
            ValueError: the dimension changed.
        """
        for b in self._blocks:
            if b.rows.shape[1] != d:
                raise ValueError(f"{self.rule}: update dimension changed from "
                                 f"{b.rows.shape[1]} to {d}")
            b.rows = b.rows.to(device=device, dtype=dtype)

    def supersede(self, ids: np.ndarray, *, free: bool = False) -> None:
        """These clients have a newer update: clear their stored rows' ``latest`` flag, or with
        ``free`` remove the rows (a block left empty is dropped by the next push or drop)."""
        for b in self._blocks:
            old = np.isin(b.ids, ids)
            if not old.any():
                continue
            if not free:
                b.latest &= ~old
                continue
            keep = ~old
            b.ids, b.latest = b.ids[keep], b.latest[keep]
            b.rows = b.rows[torch.as_tensor(keep, device=b.rows.device)]
            b.scalars = {k: v[keep] for k, v in b.scalars.items()}

    def push(self, rnd: int, ids: np.ndarray, rows: torch.Tensor, *, horizon: int,
             copy: bool = False, **scalars: np.ndarray) -> None:
        """Store round ``rnd`` (every row latest), then drop the blocks :meth:`drop` drops.

        Args:
            rnd: the round, later than every stored one.
            ids: (b,) the rows' clients (copied).
            rows: (b, d) the rows; kept as they are unless ``copy``.
            horizon: the oldest round any later round can still use.
            copy: copy ``rows`` (the caller may overwrite them), into the rows of a block being
                dropped when one has the same shape, dtype and device (no allocation).
            scalars: (b,) per-row values of every declared scalar column.

        Raises:
            ValueError: a missing or unknown scalar column, or ``rnd`` not after the last
                stored round.
        """
        self._check_scalars(scalars)
        if self._blocks and rnd <= self._blocks[-1].round:
            raise ValueError(f"{self.rule}: history round {rnd} is not after "
                             f"{self._blocks[-1].round}")
        if copy:
            spare = next((b.rows for b in self._blocks if not self._alive(b, horizon)
                          and b.rows.shape == rows.shape and b.rows.dtype == rows.dtype
                          and b.rows.device == rows.device), None)
            rows = rows.clone() if spare is None else spare.copy_(rows)
        cols = {k: np.array(v, dtype=self.scalar_dtypes[k]).reshape(-1)
                for k, v in scalars.items()}
        self._blocks.append(Block(int(rnd), np.array(ids, dtype=np.int64).reshape(-1), rows,
                                  np.ones(len(ids), dtype=bool), cols))
        self.drop(horizon)

    def drop(self, horizon: int) -> None:
        """Free the blocks of rounds before ``horizon`` and those without a latest row."""
        self._blocks = [b for b in self._blocks if self._alive(b, horizon)]

    def clear(self) -> None:
        self._blocks = []

    def _check_scalars(self, given: Mapping[str, Any]) -> None:
        if set(given) != set(self.scalar_dtypes):
            raise ValueError(f"{self.rule}: history rows have the scalars "
                             f"{sorted(self.scalar_dtypes)}, got {sorted(given)}")

    @staticmethod
    def _alive(b: Block, horizon: int) -> bool:
        return b.round >= horizon and bool(b.latest.any())

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self, *, ids: str, rows: str, rounds: str | None = None,
                   sizes: str | None = None, latest: str | None = None,
                   **scalars: str) -> dict[str, np.ndarray]:
        """The ring as flat numpy arrays under the given key names (module docstring): the
        blocks' rows stacked, ``sizes`` splitting them back.

        Raises:
            ValueError: ``rounds`` or ``sizes`` left out with more than one block stored, or
                ``latest`` left out with a superseded row stored (they would not load back).
        """
        blocks = self._blocks
        if (rounds is None or sizes is None) and len(blocks) > 1:
            raise ValueError(f"{self.rule}: {len(blocks)} history rounds need the rounds and "
                             f"sizes keys")
        if latest is None and not all(b.latest.all() for b in blocks):
            raise ValueError(f"{self.rule}: superseded history rows need the latest key")
        self._check_scalars(scalars)
        out = {
            ids: np.concatenate([b.ids for b in blocks] or [np.zeros(0, np.int64)]),
            rows: (torch.cat([b.rows for b in blocks]).cpu().numpy() if blocks
                   else np.zeros((0, 0), dtype=np.float32)),
        }
        if rounds is not None:
            out[rounds] = np.array([b.round for b in blocks], dtype=np.int64)
        if sizes is not None:
            out[sizes] = np.array([len(b.ids) for b in blocks], dtype=np.int64)
        if latest is not None:
            out[latest] = np.concatenate([b.latest for b in blocks]
                                         or [np.zeros(0, bool)]).astype(np.uint8)
        for name, key in scalars.items():
            out[key] = np.concatenate([b.scalars[name] for b in blocks]
                                      or [np.zeros(0, self.scalar_dtypes[name])])
        return out

    def load_state_dict(self, state: Mapping[str, Any], *, ids: str, rows: str,
                        rounds: str | None = None,
                        sizes: str | None = None, latest: str | None = None,
                        default_round: int = -1, **scalars: str) -> None:
        """Restore :meth:`state_dict` output written with the same key names (rows land on the
        CPU). Without ``sizes`` all rows form one block (none if there are no rows), of round
        ``default_round`` when ``rounds`` is left out; without ``latest`` every row is latest.

        Raises:
            ValueError: a missing key or inconsistent arrays.
        """
        keys = [k for k in (ids, rows, rounds, sizes, latest, *scalars.values()) if k]
        if missing := [k for k in keys if k not in state]:
            raise ValueError(f"{self.rule} state is missing {sorted(missing)}")
        self._check_scalars(scalars)
        id_arr = np.asarray(state[ids], dtype=np.int64).reshape(-1)
        row_arr = np.asarray(state[rows])
        n = len(id_arr)
        size_arr = (np.asarray(state[sizes], dtype=np.int64).reshape(-1) if sizes
                    else np.array([n] if n else [], dtype=np.int64))
        round_arr = (np.asarray(state[rounds], dtype=np.int64).reshape(-1) if rounds
                     else np.full(len(size_arr), default_round, dtype=np.int64))
        flags = (np.asarray(state[latest]).reshape(-1).astype(bool) if latest
                 else np.ones(n, dtype=bool))
        cols = {k: np.asarray(state[key], dtype=self.scalar_dtypes[k]).reshape(-1)
                for k, key in scalars.items()}
        if (row_arr.ndim != 2 or len(round_arr) != len(size_arr) or int(size_arr.sum()) != n
                or (n and row_arr.shape[0] != n) or (not n and row_arr.shape[0] != 0)
                or len(flags) != n or any(len(c) != n for c in cols.values())
                or (size_arr < 0).any()):
            raise ValueError(f"{self.rule} state: history arrays have inconsistent lengths")
        bounds = np.concatenate([[0], np.cumsum(size_arr)])
        self._blocks = [
            Block(int(rd), id_arr[a:b].copy(), torch.tensor(row_arr[a:b]), flags[a:b].copy(),
                  {k: c[a:b].copy() for k, c in cols.items()})
            for rd, a, b in zip(round_arr, bounds[:-1], bounds[1:])
        ]
