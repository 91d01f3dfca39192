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
from categories import print_categories

print_categories(prof, WALL, PROF)
