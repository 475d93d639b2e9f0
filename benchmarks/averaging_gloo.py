"""Converge-step cost on CPU/gloo: hdet's bucketed averaging against one all_reduce per tensor
(the reference implementation) and against one all_reduce of a single flat buffer (the floor).

    python benchmarks/averaging_gloo.py --out benchmarks/results/averaging_gloo.json

Same tensors, same processes, interleaved repeats; ratios are what to read (CPU times vary)."""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import hdet  # noqa: E402


def shapes(n_tensors: int, total: int) -> list[int]:
    # 150 tensors of uneven sizes adding up to ``total`` floats (a GPT-like mix of big and small)
    weights = [(i % 7 + 1) ** 3 for i in range(n_tensors)]
    s = sum(weights)
    sizes = [max(1, total * w // s) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


def worker(rank, world, init_method, n_tensors, total, repeats, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.manual_seed(rank)
    tensors = [torch.randn(n) for n in shapes(n_tensors, total)]
    flat = torch.randn(total)
    replicas = hdet.ProcessGroupReplicas()

    def per_tensor():
        for t in tensors:
            dist.all_reduce(t)
            t.div_(world)

    def bucketed():
        replicas.average_(tensors)

    def one_flat():
        dist.all_reduce(flat)
        flat.div_(world)

    fns = {"per_tensor_allreduce": per_tensor, "hdet_bucketed": bucketed, "single_flat_allreduce": one_flat}
    times = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up
    for _ in range(repeats):
        for k, f in fns.items():  # interleaved
            dist.barrier()
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        json.dump({"median_seconds": med,
                   "ratio_bucketed_over_flat": med["hdet_bucketed"] / med["single_flat_allreduce"],
                   "ratio_per_tensor_over_flat": med["per_tensor_allreduce"] / med["single_flat_allreduce"],
                   "all_seconds": times}, open(out, "w"))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tensors", type=int, default=150)
    p.add_argument("--floats", type=int, default=19_700_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/averaging_gloo.json")
    a = p.parse_args()
    import tempfile

    rdzv = tempfile.mkdtemp()  # a file:// rendezvous: no probed TCP port
    tmp = a.out + ".part"
    mp.spawn(worker, args=(a.world, "file://" + os.path.join(rdzv, "store"), a.tensors, a.floats, a.repeats, tmp), nprocs=a.world)
    res = json.load(open(tmp))
    os.remove(tmp)
    res = {"command": "python benchmarks/averaging_gloo.py " + " ".join(sys.argv[1:]), "world_size": a.world,
           "tensors": a.tensors, "floats": a.floats, "repeats": a.repeats, "backend": "gloo (CPU)",
           "cpu_cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__, **res}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "all_seconds"}, indent=1))


if __name__ == "__main__":
    main()
