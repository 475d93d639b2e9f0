"""Save scheduler states with hdet at a811e77 (state format version 2), and the LRs that code then gives:
the fixture of tests/test_design.py. Made with

    git worktree add /tmp/oldhdet a811e77 && python tests/data/make_states_v2.py tests/data/states_v2.pt
"""
import sys, torch
from torch import nn
sys.path.insert(0, "/tmp/oldhdet/src")
import hdet
assert hdet.__file__.startswith("/tmp/oldhdet"), hdet.__file__

def build(kind):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.1), nn.Linear(4, 1))
    o = torch.optim.AdamW(m.parameters(), lr=0.1)
    if kind == "onecycle":
        s = hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=30, ensemble_lr_spread_ratio=0.2, model=m,
                                explore=[hdet.WeightDecay(o)], enable_auto_lr=True, auto_lr_warmup_steps=5,
                                model_sync_interval=5, controller="paper").record_schedule()
    else:
        s = hdet.HDETLR(o, torch.optim.lr_scheduler.StepLR(o, 5, gamma=0.5), total_steps=30, model=m,
                        ensemble_lr_spread_ratio=0.2, model_sync_interval=4)
    return m, o, s

out = {}
for kind in ("onecycle", "hdetlr"):
    m, o, s = build(kind)
    losses = [1.0, 0.9, 0.8, 0.7, 0.75, 0.6, 0.65, 0.5, 0.55, 0.5, 0.45, 0.4, 0.42]
    for L in losses:
        o.step(); s.step(torch.tensor(L))
    state = s.state_dict()
    after = []
    for L in (0.4, 0.38, 0.37, 0.36, 0.35, 0.3, 0.31, 0.29):
        o.step(); s.step(torch.tensor(L))
        after.append([g["lr"] for g in o.param_groups] + [g["weight_decay"] for g in o.param_groups])
    out[kind] = {"state": state, "lrs_after": after, "optimizer": None}
torch.save(out, sys.argv[1])
print("saved", {k: v["state"]["hdet"]["version"] for k, v in out.items()})
