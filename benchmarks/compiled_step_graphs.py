"""How many graphs ``torch.compile(optimizer.step)`` makes under OneCycleAutoLR in 20 steps, with its momentum cycled
(AdamW's beta1 a float set anew each step) and not. Writes benchmarks/results/compiled_step_graphs_torch<ver>.json.

    python benchmarks/compiled_step_graphs.py
"""
import json
import platform
import sys
import warnings
from pathlib import Path

import torch
from torch._dynamo.utils import counters

import hdet

warnings.simplefilter("ignore")
out = {"command": "python benchmarks/compiled_step_graphs.py", "torch": torch.__version__,
       "python": platform.python_version(), "steps": 20, "backend": "eager", "graphs": {}}
for cycle in (True, False):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=torch.tensor(1e-3))
    sched = hdet.OneCycleAutoLR(opt, max_lr=1e-2, total_steps=20, cycle_momentum=cycle)
    step = torch.compile(opt.step, backend="eager")
    for _ in range(20):
        net(torch.randn(4, 8)).sum().backward()
        step()
        opt.zero_grad()
        sched.step()
    out["graphs"][f"cycle_momentum={cycle}"] = counters["stats"]["unique_graphs"]
print(json.dumps(out["graphs"]))
path = Path(__file__).parent / "results" / f"compiled_step_graphs_torch{torch.__version__.split('+')[0]}.json"
path.write_text(json.dumps(out, indent=1) + "\n")
sys.exit(0)
