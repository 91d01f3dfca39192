"""In-process replica of `mpifl run` for mFairFL / FedAvg jobs (one process, all clients every
round), recording per round: lambda, soft (probability) and hard DP on train and test unions.

usage: python analysis/mfairfl_dp_drive.py JOB OUT.json [key=value ...]
"""
import json, sys, time
import numpy as np
import torch
import torch.nn.functional as F

from mpifl import aggregators
from mpifl.aggregators.base import RoundUpdates
from mpifl.experiment.config import load_config
from mpifl.experiment.assemble import build_parts, make_trainer
from mpifl.experiment.plan import make_plan
from mpifl.metrics import fairness
from torch.func import functional_call

job, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
cfg = load_config(job, overrides)
plan = make_plan(cfg)
parts = build_parts(plan)
fed = parts.fed
dev = torch.device("cpu")
trainer = make_trainer(plan, parts, dev)
import os
TEMP = float(os.environ.get("MF_TEMP", "1"))
if TEMP != 1.0:  # sharper DP surrogate: sigmoid((z1 - z0) / T) instead of softmax[:, 1]
    def _sharp(out, T=TEMP):
        return torch.sigmoid((out[..., 1] - out[..., 0]) / T)
    trainer._positive_probability = _sharp
    print("surrogate temperature", TEMP)
rule = aggregators.rule(cfg.server.algorithm)
kw = {}
if rule.needs.num_groups:
    kw["num_groups"] = int(fed.sensitive.max()) + 1
params = cfg.algorithm_params()
if rule.needs.num_clients:
    params["num_clients"] = fed.num_clients
params.update(kw)
agg = aggregators.create(cfg.server.algorithm, seed=cfg.run.seed, **params)
K = fed.num_clients
ids = np.arange(K)
tr = [fed.train_indices(k) for k in ids]
te = [fed.test_indices(k) for k in ids]
x = torch.from_numpy(fed.x).float(); y = torch.from_numpy(fed.y).long()
s = torch.from_numpy(fed.sensitive).long()
model = parts.model
names = [n for n, _ in model.named_parameters()]


def probs(w, idx):
    with torch.no_grad():
        out = functional_call(model, parts.layout.unflatten(w), (x[idx],))
    return torch.softmax(out, -1)[:, 1]


def stats(w, idxs):
    idx = np.concatenate(idxs)
    p = probs(w, idx)
    yy, ss = y[idx].numpy(), s[idx].numpy()
    pred = (p >= 0.5).long().numpy() if True else None
    pred = (p > 0.5).long().numpy()
    h = fairness.group_violations(pred, yy, ss)
    soft_dp = float(fairness.group_gaps("dp", p.double(), y[idx], s[idx], 2).max())
    acc = float((pred == yy).mean())
    rate = {a: float(pred[ss == a].mean()) for a in (0, 1)}
    return dict(acc=acc, soft_dp=soft_dp, rate0=rate[0], rate1=rate[1],
                prate0=float(p[ss == 0].mean()), prate1=float(p[ss == 1].mean()), **h)


def client_stats(w):
    accs, dps = [], []
    for k in ids:
        p = probs(w, te[k]); pred = (p > 0.5).long().numpy()
        accs.append(float((pred == y[te[k]].numpy()).mean()))
        dps.append(fairness.dp_violation(pred, s[te[k]].numpy()))
    return accs, dps


w = parts.w0.clone()
log = []
t0 = time.time()
for rnd in range(cfg.run.rounds):
    lr = cfg.client.lr * cfg.client.lr_decay ** rnd
    lam = agg.round_inputs() if hasattr(agg, "round_inputs") and cfg.server.algorithm == "mfairfl" else None
    if cfg.server.algorithm == "mfairfl":
        upd, losses, st = trainer.run_round(w, rnd, lr, ids, tr, inputs=lam)
        cons = st["constraints"].double().numpy()
    else:
        upd, losses, st = trainer.run_round(w, rnd, lr, ids, tr)
        cons = None
    r = RoundUpdates(round=rnd, client_ids=ids, updates=upd, losses=losses,
                     num_samples=torch.as_tensor(fed.num_train), lr=lr, layers=None, stats=st,
                     loss_at=None)
    w = w - agg.aggregate(r)
    row = dict(round=rnd + 1, lam_in=None if lam is None else np.asarray(lam).tolist(),
               cons_at_w=None if cons is None else cons.tolist(),
               test=stats(w, te), train=stats(w, tr))
    accs, dps = client_stats(w)
    row["client_acc"], row["client_dp"] = accs, dps
    row["mean_acc"] = float(np.mean(accs))
    log.append(row)
    print(rnd + 1, "lam", row["lam_in"], "acc %.4f dp %.4f soft_dp(test) %.4f eo %.4f ap %.4f | train soft %.4f hard %.4f | rates %.3f %.3f  (%.0fs)" % (
        row["mean_acc"], row["test"]["dp"], row["test"]["soft_dp"], row["test"]["eo"], row["test"]["ap"],
        row["train"]["soft_dp"], row["train"]["dp"], row["test"]["rate0"], row["test"]["rate1"], time.time() - t0), flush=True)
json.dump(dict(job=job, overrides=overrides, temp=TEMP, rounds=log), open(out, "w"))
