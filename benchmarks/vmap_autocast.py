"""Which layers keep autocast under ``torch.func.vmap``, with and without :mod:`hdet.autocast`.

For each function, one replica's call and the vmapped call over N = 3 replicas (own weights, and one weight for
all) inside ``torch.autocast(<device>, dtype=torch.bfloat16)``: the output dtypes, torch's own and routed through
``hdet.autocast.routed()`` (what the engine's eager vmap does). Writes JSON with the command, machine and versions.

    python benchmarks/vmap_autocast.py --out benchmarks/results/cpu/vmap_autocast.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import vmap

import hdet
from hdet import attention, autocast


def cases(dev: torch.device) -> dict:
    N = 3
    r = lambda *s: torch.randn(*s, device=dev)  # noqa: E731
    return {
        "linear": (lambda x, w: F.linear(x, w), (r(N, 4, 5), r(N, 6, 5))),
        "linear+bias": (lambda x, w, b: F.linear(x, w, b), (r(N, 4, 5), r(N, 6, 5), r(N, 6))),
        "linear+bias, one weight for all": (lambda x: F.linear(x, torch.ones(6, 5, device=dev), torch.ones(6, device=dev)),
                                            (r(N, 4, 5),)),
        "matmul": (lambda x, w: x @ w, (r(N, 4, 5), r(N, 5, 6))),
        "addmm": (lambda b, x, w: torch.addmm(b, x, w), (r(N, 6), r(N, 4, 5), r(N, 5, 6))),
        "baddbmm": (lambda b, x, w: torch.baddbmm(b, x, w), (r(N, 2, 4, 6), r(N, 2, 4, 5), r(N, 2, 5, 6))),
        "addbmm": (lambda b, x, w: torch.addbmm(b, x, w), (r(N, 4, 6), r(N, 2, 4, 5), r(N, 2, 5, 6))),
        "conv1d": (lambda x, w, b: F.conv1d(x, w, b), (r(N, 2, 3, 8), r(N, 4, 3, 3), r(N, 4))),
        "conv2d": (lambda x, w, b: F.conv2d(x, w, b), (r(N, 2, 3, 8, 8), r(N, 4, 3, 3, 3), r(N, 4))),
        "conv2d, no bias": (lambda x, w: F.conv2d(x, w), (r(N, 2, 3, 8, 8), r(N, 4, 3, 3, 3))),
        "conv3d": (lambda x, w, b: F.conv3d(x, w, b), (r(N, 2, 3, 4, 4, 4), r(N, 4, 3, 3, 3, 3), r(N, 4))),
        "conv_transpose2d": (lambda x, w: F.conv_transpose2d(x, w), (r(N, 2, 3, 8, 8), r(N, 3, 4, 3, 3))),
        "scaled_dot_product_attention": (lambda q: F.scaled_dot_product_attention(q, q, q), (r(N, 2, 4, 8),)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device(a.device)
    rows = {}
    for name, (fn, args) in cases(dev).items():
        row = {}
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            row["one replica"] = str(fn(*[t[0] for t in args]).dtype)
            for label, ctx in (("vmap, torch", None), ("vmap, hdet.autocast", autocast.routed),
                               ("vmap, engine routing", None)):
                try:
                    if label == "vmap, engine routing":
                        with attention.routed(), autocast.routed():
                            out = vmap(fn)(*args)
                    elif ctx is None:
                        out = vmap(fn)(*args)
                    else:
                        with ctx():
                            out = vmap(fn)(*args)
                    row[label] = str(out.dtype)
                except Exception as e:  # noqa: BLE001 - recorded
                    row[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        rows[name] = row
        print(f"{name:34s} {row}")
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "autocast_dtype": "bfloat16", "output_dtypes": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
