"""docs/explore.md's command-line demo, recorded: ``hdet train --explore lr-groups,weight-decay,dropout,grad-clip
--dropout 0.1 --auto-lr --controller paper`` on the default task, and how far the paper's controller moved each
explored base (from the run's syncs.jsonl).

    python benchmarks/explore_demo.py --out benchmarks/results/cpu/explore_demo.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ARGS = ["train", "--explore", "lr-groups,weight-decay,dropout,grad-clip", "--dropout", "0.1", "--auto-lr",
        "--controller", "paper", "--no-progress"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "hdet", *ARGS, "--out", str(run)], check=True,
                       stdout=subprocess.DEVNULL)
        summary = json.loads((run / "summary.json").read_text())
        syncs = [json.loads(line) for line in (run / "syncs.jsonl").read_text().splitlines() if line.strip()]
    first, last = syncs[0], syncs[-1]
    names = first["names"]
    moved = {n: abs(last["bases"][i] / first["bases"][i] - 1) if first["bases"][i] else abs(last["bases"][i])
             for i, n in enumerate(names) if not n.startswith("lr/")}
    moving = [s["step"] for s, prev in zip(syncs[1:], syncs) if any(
        b != c for n, b, c in zip(names, s["bases"], prev["bases"]) if not n.startswith("lr/"))]
    rec = {"command": "hdet " + " ".join(ARGS), "launch_command": "python " + " ".join(sys.argv),
           "python": platform.python_version(), "torch": torch.__version__,
           "machine": f"{os.cpu_count()} CPU cores" + (" (no GPU)" if not torch.cuda.is_available() else ""),
           "mode": summary["mode"], "train_seconds": summary["train_seconds"],
           "final_train_loss": summary["final_train_loss"], "final_val_loss": summary["final_val_loss"],
           "bases_first_sync": dict(zip(names, first["bases"])), "bases_last_sync": dict(zip(names, last["bases"])),
           "relative_move_first_to_last_sync": moved, "syncs_where_an_explored_base_moved": moving}
    Path(a.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: rec[k] for k in ("final_val_loss", "relative_move_first_to_last_sync",
                                          "syncs_where_an_explored_base_moved")}, indent=1))


if __name__ == "__main__":
    main()
