# Scratch measurement for docs/BENCHMARKS.md, "Peer benchmark W2" (not part of mpifl;
# it monkeypatches mpifl.clients.loop in its own process). Run from the repository root.
"""Profile steady mpifl W2 rounds (loop trainer) with torch.profiler; shares by category."""
import sys, time, tempfile, statistics, collections, os
from pathlib import Path
from pathlib import Path as _P
ROOT = _P(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "analysis"), str(ROOT)]
import torch
torch.set_num_threads(2)
import peer_bench as pb
from torch.profiler import profile, ProfilerActivity

WARM, PROF = 2, int(sys.argv[1]) if len(sys.argv) > 1 else 3
print("load at start", pb.loadavg())
wl = pb.Workload("cnn_mnist", "loop", WARM + PROF + 3)
tmp = tempfile.mkdtemp()
mp = pb.MpiflRounds(wl, Path(tmp) / "p.h5")
print("trainer", mp.path, type(mp.trainer).__name__)
if len(sys.argv) > 2 and sys.argv[2] == "cl":
    from mpifl.clients import loop as L
    tr = mp.trainer
    tr.net.to(memory_format=torch.channels_last)
    tr._state = [t for _, t in L.model_state(tr.net)]
    tr._params = list(tr.net.parameters())
    print("variant: channels_last model")
for _ in range(WARM):
    print("warm round %.0f ms" % (mp.round()[0] * 1e3))
print(pb.wait_quiet(300))
plain = [mp.round()[0] for _ in range(2)]
print("unprofiled steady rounds (ms):", [round(t * 1e3) for t in plain])
print(pb.wait_quiet(300))
meter = pb.Meter(); meter.start()
with profile(activities=[ProfilerActivity.CPU], with_stack=False) as prof:
    t0 = time.perf_counter()
    wall_rounds = [mp.round()[0] for _ in range(PROF)]
    wall = time.perf_counter() - t0
print("other processes during the profiled rounds: %.2f cores" % meter.stop()[1])
print("profiled rounds (ms):", [round(t * 1e3) for t in wall_rounds])

from categories import print_categories

print_categories(prof, wall, PROF)
print("load at end", pb.loadavg())
