import json, sys, numpy as np
def load(f):
    R = json.load(open(f))["rounds"]
    rows = []
    for r in R:
        t = r["test"]
        rows.append([r["mean_acc"], t["dp"], t["eo"], t["ap"], abs(t["rate0"] - t["rate1"]), t["soft_dp"]])
    return np.array(rows)
hdr = "acc dp eo ap pairdp softdp"
for group in sys.argv[1:]:
    files = group.split(",")
    fin = np.array([load(f)[-1] for f in files]); l3 = np.array([load(f)[-3:].mean(0) for f in files])
    def fmt(a):
        return " ".join(f"{m:.3f}±{s:.3f}" for m, s in zip(a.mean(0), a.std(0)))
    print(f"{group.split('/')[-1]:40s} n={len(files)} final: {fmt(fin)} | last3: {fmt(l3)}")
print("cols:", hdr)
