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

# Categorise every event's self CPU time by its first ancestor that names a category.
RULES = [
    ("conv backward", lambda n: n.startswith("autograd::engine::evaluate_function: ConvolutionBackward")),
    ("linear backward", lambda n: n.startswith("autograd::engine::evaluate_function: AddmmBackward") or n.startswith("autograd::engine::evaluate_function: TBackward") or n.startswith("autograd::engine::evaluate_function: MmBackward")),
    ("pool backward", lambda n: n.startswith("autograd::engine::evaluate_function: MaxPool")),
    ("relu backward", lambda n: n.startswith("autograd::engine::evaluate_function: ReluBackward") or n.startswith("autograd::engine::evaluate_function: ThresholdBackward")),
    ("loss backward", lambda n: n.startswith("autograd::engine::evaluate_function: ") and any(k in n for k in ("LogSoftmax", "Nll", "Mean", "Div", "CrossEntropy", "Sum"))),
    ("other backward", lambda n: n.startswith("autograd::engine::evaluate_function")),
    ("optimizer step", lambda n: n.startswith("Optimizer.step")),
    ("zero_grad", lambda n: n.startswith("Optimizer.zero_grad")),
    ("conv forward", lambda n: n in ("aten::conv2d",)),
    ("linear forward", lambda n: n in ("aten::linear",)),
    ("pool forward", lambda n: n in ("aten::max_pool2d",)),
    ("relu forward", lambda n: n in ("aten::relu",)),
    ("loss forward", lambda n: n in ("aten::cross_entropy_loss", "aten::log_softmax", "aten::nll_loss", "aten::mean", "aten::nll_loss_nd")),
    ("minibatch gather (index)", lambda n: n in ("aten::index", "aten::index_select")),
    ("backward driver", lambda n: n.startswith("autograd::engine") ),
]
events = prof.events()
agg = collections.Counter()
names = collections.defaultdict(collections.Counter)
for ev in events:
    node, cat = ev, None
    while node is not None:
        for c, rule in RULES:
            if rule(node.name):
                cat = c
                break
        if cat:
            break
        node = node.cpu_parent
    if cat is None:
        # top-level op name of the chain
        top = ev
        while top.cpu_parent is not None:
            top = top.cpu_parent
        cat = "other: " + top.name
    agg[cat] += ev.self_cpu_time_total
    names[cat][ev.name] += ev.self_cpu_time_total
total_ops = sum(agg.values()) / 1e6
print(f"\nprofiled wall {wall:.3f} s for {PROF} rounds; self CPU time of all ops {total_ops:.3f} s "
      f"(main thread + autograd; ops inside ops counted once)")
for cat, us in agg.most_common():
    top = ", ".join(f"{n} {t/1e3:.0f}" for n, t in names[cat].most_common(3))
    print(f"{cat:38s} {us/1e3/PROF:8.1f} ms/round  {100*us/1e6/wall:5.1f}% of wall   [{top}]")
print(f"{'not in any op (Python, etc.)':38s} {(wall - total_ops)*1e3/PROF:8.1f} ms/round  {100*(wall-total_ops)/wall:5.1f}% of wall")
print("\n", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
print("load at end", pb.loadavg())
