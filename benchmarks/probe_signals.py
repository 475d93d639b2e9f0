"""Which per-replica signal says "LR too low / too high" without the short-horizon bias?

8 replicas in the engine, a tiny byte GPT (width 64, 2 layers), OneCycle, HDET spread alpha, no
controller. At every sync, per replica: the window training loss (L), a probe on a batch common to all
replicas at the end-of-window weights (P), and the same probe at the mean of the window's iterates (Q).
Prints per quarter of the run the mean slope dL/dlog(rho) and writes probe_signals_<LR>_<ALPHA>.json;
``--analyse FILES`` prints the parabola-fitted optimal log multiplier x* per quarter from those files.

    python benchmarks/probe_signals.py LR STEPS T [ALPHA]
    python benchmarks/probe_signals.py --analyse probe_signals_*.json
"""
from pathlib import Path
import sys

if len(sys.argv) > 1 and sys.argv[1] == "--analyse":
    import json
    import numpy as np
    for f in sorted(sys.argv[2:], key=lambda s: float(Path(s).name.split("_")[2])):
        d = json.load(open(f))
        rows = []
        for key in "LPQ":
            xs = []
            for rc in d["recs"][:-1]:
                q, b, _ = np.polyfit(np.log(rc["rho"]), np.array(rc[key]), 2)
                xs.append(float(np.clip(-b / (2 * q), -1, 1)) if q > 0 else float(np.sign(-b)))
            k = len(xs)
            rows.append(key + " " + " ".join(f"{np.mean(xs[i * k // 4:(i + 1) * k // 4]):+.2f}" for i in range(4)))
        print(d["lr"], round(d["val"], 4), " | ".join(rows))
    sys.exit(0)
import sys, math, json, time, torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from hdet.app.tasks import make_task
from hdet.engine import ReplicaEngine
from hdet.schedulers import OneCycleAutoLR
from hdet.app.run import evaluate
torch.set_num_threads(1)
lr = float(sys.argv[1]); steps = int(sys.argv[2]); T = int(sys.argv[3]); alpha = float(sys.argv[4]) if len(sys.argv) > 4 else 0.5
N = 8; B = 16
task = make_task("bytes", ctx=64, width=64, layers=2, dropout=0.0)
torch.manual_seed(0)
model = task.make_model()
eng = ReplicaEngine(model, N, lambda m: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01),
    lambda o, v, m: OneCycleAutoLR(o, max_lr=lr, total_steps=steps, ensemble_lr_spread_ratio=alpha,
                                   model_sync_interval=T, replicas=v, model=m), mode="vmap")
ens0 = eng.schedulers[0].ensemble
gens = [torch.Generator().manual_seed(r) for r in range(N)]
pg = torch.Generator().manual_seed(999)
acc = {k: torch.zeros_like(v) for k, v in eng.stacked_params.items()}
cnt = [0]
recs = []
from torch.func import functional_call, vmap
def probe_losses(params, xs):
    def one(p, x):
        return functional_call(eng._call, (p, {}), (x, task.loss_fn))
    with torch.no_grad():
        return vmap(one, in_dims=(0, None), randomness="different")(params, xs)
orig = ens0.sync
def wrapped(t):
    with torch.no_grad():
        for k, v in eng.stacked_params.items(): acc[k] += v
        cnt[0] += 1
        xs = torch.cat([task.sample("train", B, pg) for _ in range(4)])
        end = {"m." + k: v for k, v in eng.stacked_params.items()}
        mean = {"m." + k: acc[k] / cnt[0] for k in acc}
        P = probe_losses(end, xs).tolist(); Q = probe_losses(mean, xs).tolist()
    rho = [ens0.offsets[0][p] for p in ens0.perms[0]]
    rec = orig(t)
    recs.append({"t": t, "rho": rho, "L": rec.losses, "P": P, "Q": Q, "base": rec.bases[0]})
    for k in acc: acc[k].zero_()
    cnt[0] = 0
    return rec
ens0.sync = wrapped
t0 = time.time()
for t in range(steps):
    eng.step([task.sample("train", B, g) for g in gens], task.loss_fn)
    if (t + 1) % T:
        with torch.no_grad():
            for k, v in eng.stacked_params.items(): acc[k] += v
            cnt[0] += 1
val = evaluate(task, eng.models[0], 16, 32, torch.device("cpu"))
def slope(xs, ys):
    n = len(xs); mx = sum(xs)/n; my = sum(ys)/n
    return sum((x-mx)*(y-my) for x, y in zip(xs, ys)) / sum((x-mx)**2 for x in xs)
out = {"lr": lr, "val": val, "sec": time.time()-t0, "recs": recs}
json.dump(out, open(f"probe_signals_{lr}_{alpha}.json", "w"))
# summary: normalized slope dL/dlogrho per phase
for key in "LPQ":
    s = [slope([math.log(r) for r in rc["rho"]], rc[key]) for rc in recs[:-1]]
    k = len(s)
    print(key, " ".join(f"{sum(s[i*k//4:(i+1)*k//4])/max(1,len(s[i*k//4:(i+1)*k//4])):+.4f}" for i in range(4)))
print("lr", lr, "val", round(val, 4), "sec", round(time.time()-t0, 1))
