# Scratch measurement for docs/BENCHMARKS.md, "Peer benchmark W2" (not part of mpifl;
# it monkeypatches mpifl.clients.loop in its own process). Run from the repository root.
"""A/B of LoopTrainer variants on W2 (monkeypatched in this process; mpifl/ is not edited).
Each variant has its own MpiflRounds; round r of every variant trains the same clients from
its own w; variants are interleaved round by round, the order rotated each round."""
import sys, time, tempfile, statistics, math, types
from pathlib import Path
from pathlib import Path as _P
ROOT = _P(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "analysis"), str(ROOT)]
import numpy as np
import torch
torch.set_num_threads(2)
import peer_bench as pb
from mpifl.clients import loop as L

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
WARM = 2
NAMES = sys.argv[2].split(",") if len(sys.argv) > 2 else ["base", "cl", "fused", "cl+fused"]
# variants: base (mpifl as is), cl (module in channels_last), fused (SGD fused=True),
# foreach (SGD foreach=True), isel (index_select for the minibatch), joined by "+"


def train_one(self, begin, anchor, round, lr, cid, idx, mu, want_loss):
    """LoopTrainer._train_one with the variant's options (self._v)."""
    v = self._v
    with torch.no_grad():
        for t, val in zip(self._state, self.layout.unflatten(begin).values()):
            t.copy_(val)
    anchors = ([a.detach() for n, a in self.layout.unflatten(anchor).items()
                if n in dict(self.net.named_parameters())] if mu else None)
    kw = {}
    if v.get("fused"):
        kw["fused"] = True
    if v.get("foreach"):
        kw["foreach"] = True
    opt = torch.optim.SGD(self._params, lr=lr, momentum=self.momentum,
                          weight_decay=self.weight_decay, **kw)
    xs, ys = self._gather(np.asarray(idx, dtype=np.int64))
    n = len(idx)
    first_epoch_steps = 1 if self.batch_size == 0 else math.ceil(n / self.batch_size)
    total = torch.zeros((), dtype=torch.float64, device=self.device)
    for step, pos in enumerate(L.client_minibatches(self.seed, round, cid, n, self.epochs,
                                                    self.batch_size, self.order_tag)):
        p = torch.as_tensor(pos, device=self.device)
        loss = self.loss.per_sample(self.net(xs.index_select(0, p) if v.get("isel") else xs[p]), ys[p]).mean()
        if want_loss and step < first_epoch_steps:
            total += loss.detach().double() * len(pos)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(total)


def make(name, wl, tmp):
    mp = pb.MpiflRounds(wl, Path(tmp) / f"{name}.h5")
    tr = mp.trainer
    opts = set(name.split("+"))
    if name != "base":
        tr._v = {o: True for o in opts}
        tr._train_one = types.MethodType(train_one, tr)
    if "cl" in opts:
        tr.net.to(memory_format=torch.channels_last)
        tr._state = [t for _, t in L.model_state(tr.net)]
        tr._params = list(tr.net.parameters())
    return mp


print("load at start", pb.loadavg(), flush=True)
wl = pb.Workload("cnn_mnist", "loop", ROUNDS)
tmp = tempfile.mkdtemp()
mps = {n: make(n, wl, tmp) for n in NAMES}
times = {n: [] for n in NAMES}
for r in range(ROUNDS):
    order = NAMES[r % len(NAMES):] + NAMES[:r % len(NAMES)]
    for n in order:
        pb.wait_quiet(120, window_s=2.0)
        meter = pb.Meter(); meter.start()
        mps[n].round()
        dt, busy = meter.stop()
        times[n].append(dt if busy < pb.QUIET_CORES else float("nan"))
    if r == 0:
        base = mps[NAMES[0]].w
        for n in NAMES[1:]:
            rel = float((mps[n].w - base).norm() / (base - wl.parts.w0).norm())
            print(f"round 0: w of {n} vs {NAMES[0]}: |dw| / |step| = {rel:.2e}")
    print(f"round {r}: " + "  ".join(f"{n} {times[n][-1]*1e3:.0f}" for n in NAMES), flush=True)
def med(v):
    v = [x for x in v if x == x]
    return statistics.median(v) if v else float("nan")
print("disturbed rounds (others >= 0.15 cores) are nan and left out")
b = med(times[NAMES[0]][WARM:])
for n in NAMES:
    m = med(times[n][WARM:])
    ratios = [x / y for x, y in zip(times[NAMES[0]][WARM:], times[n][WARM:])]
    print(f"{n:12s} steady median {m*1e3:7.1f} ms   speed-up vs {NAMES[0]} {b/m:.3f}x "
          f"(per-round median {med(ratios):.3f}x)")
print("load at end", pb.loadavg())
