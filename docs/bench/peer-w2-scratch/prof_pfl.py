# Scratch measurement for docs/BENCHMARKS.md, "Peer benchmark W2" (not part of mpifl;
# it monkeypatches mpifl.clients.loop in its own process). Run from the repository root.
"""Profile steady pfl W2 rounds with torch.profiler (rounds 3..5), same categories as prof.py."""
import sys, time, collections
from pathlib import Path as _P
ROOT = _P(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "analysis"), str(ROOT)]
import torch
torch.set_num_threads(2)
import peer_bench as pb
from torch.profiler import profile, ProfilerActivity
from pfl.callback.base import TrainingProcessCallback
from pfl.metrics import Metrics
wl = pb.Workload("cnn_mnist", "loop", 8)
algo, params, backend, model, train, evalp = pb.pfl_setup(wl, 6)
prof = profile(activities=[ProfilerActivity.CPU])
st = {}
class CB(TrainingProcessCallback):
    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        t = time.perf_counter()
        print("round", central_iteration, "done", flush=True)
        if central_iteration == 2:
            print(pb.wait_quiet(300)); st["m"] = pb.Meter(); st["m"].start()
            prof.start(); st["t0"] = time.perf_counter()
        if central_iteration == 5:
            st["wall"] = time.perf_counter() - st["t0"]; prof.stop(); print("others %.2f" % st["m"].stop()[1])
        return False, Metrics()
algo.run(algorithm_params=params, backend=backend, model=model, model_train_params=train,
         model_eval_params=evalp, callbacks=[CB()], send_metrics_to_platform=False)
PROF = 3
WALL = st['wall']
print('profiled wall %.3f s' % WALL)
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
print(f"\nprofiled WALL {WALL:.3f} s for {PROF} rounds; self CPU time of all ops {total_ops:.3f} s "
      f"(main thread + autograd; ops inside ops counted once)")
for cat, us in agg.most_common():
    top = ", ".join(f"{n} {t/1e3:.0f}" for n, t in names[cat].most_common(3))
    print(f"{cat:38s} {us/1e3/PROF:8.1f} ms/round  {100*us/1e6/WALL:5.1f}% of WALL   [{top}]")
print(f"{'not in any op (Python, etc.)':38s} {(WALL - total_ops)*1e3/PROF:8.1f} ms/round  {100*(WALL-total_ops)/WALL:5.1f}% of WALL")
print("\n", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
print("load at end", pb.loadavg())
