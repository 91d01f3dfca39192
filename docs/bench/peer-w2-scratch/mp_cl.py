# Scratch measurement for docs/BENCHMARKS.md, "Peer benchmark W2" (not part of mpifl;
# it monkeypatches mpifl.clients.loop in its own process). Run from the repository root.
"""peer_bench --only mpifl with LoopTrainer's module in channels_last (scratch monkeypatch)."""
import sys
from pathlib import Path as _P
ROOT = _P(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "analysis"), str(ROOT)]
import torch
from mpifl.clients import loop as L
_init = L.LoopTrainer.__init__
def init(self, *a, **kw):
    _init(self, *a, **kw)
    self.net.to(memory_format=torch.channels_last)
    self._state = [t for _, t in L.model_state(self.net)]
    self._params = list(self.net.parameters())
L.LoopTrainer.__init__ = init
import peer_bench as pb
print("scratch variant: LoopTrainer.net in channels_last")
raise SystemExit(pb.main(sys.argv[1:]))
