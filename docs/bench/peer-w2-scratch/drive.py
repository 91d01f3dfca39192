# Scratch measurement for docs/BENCHMARKS.md, "Peer benchmark W2" (not part of mpifl;
# it monkeypatches mpifl.clients.loop in its own process). Run from the repository root.
"""Alternating separate processes: mpifl loop, mpifl loop + channels_last (scratch), pfl."""
import sys, subprocess, json, statistics
from pathlib import Path as _P
ROOT = _P(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "analysis"), str(ROOT)]
N = int(sys.argv[1]); model = sys.argv[2] if len(sys.argv) > 2 else "cnn_mnist"
rounds = sys.argv[3] if len(sys.argv) > 3 else "18"
common = ["--model", model, "--rounds", rounds, "--warmup", "3", "--threads", "2", "--quiet-wait", "120"]
V = {"mpifl-loop": [str(ROOT / "analysis" / "peer_bench.py"), "--only", "mpifl", "--trainer", "loop"],
     "mpifl-loop-cl": [str(ROOT / "docs" / "bench" / "peer-w2-scratch" / "mp_cl.py"), "--only", "mpifl", "--trainer", "loop"],
     "pfl": [str(ROOT / "analysis" / "peer_bench.py"), "--only", "pfl"]}
names = list(V); res = {n: [] for n in names}
import peer_bench as pb
for c in range(N):
    for n in (names if c % 2 == 0 else names[::-1]):
        print(f"=== cycle {c+1} {n}: {pb.wait_quiet(120)}; load {pb.loadavg()}", flush=True)
        p = subprocess.run([sys.executable, *V[n], *common], capture_output=True, text=True)
        print(p.stdout, p.stderr[-2000:] if p.returncode else "", flush=True)
        r = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
        res[n].append(r["steady_quiet"] if r["steady_quiet"] is not None else float("nan"))
print("=== summary (median of quiet steady rounds per run, ms)")
for n in names:
    v = [x for x in res[n] if x == x]
    print(f"{n:15s} runs {' '.join(f'{x*1e3:.1f}' for x in res[n])}  median {statistics.median(v)*1e3:.1f}")
pm = statistics.median([x for x in res['pfl'] if x == x])
for n in names[:-1]:
    print(f"ratio pfl/{n}: {pm / statistics.median([x for x in res[n] if x == x]):.2f}x; per cycle "
          + " ".join(f"{p/m:.2f}" for p, m in zip(res['pfl'], res[n])))
