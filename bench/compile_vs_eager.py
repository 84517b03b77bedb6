"""torch.compile (inductor, with dtensor_ring's graph pass) against eager, per schedule, on W GPUs.

    torchrun --nproc-per-node=4 bench/compile_vs_eager.py --out compile.json

Default config, Llama-3-8B's attention: 32 q / 8 kv heads, d = 128, --tokens-per-gpu 8192,
causal bf16. For each schedule: forward+backward time of ``ring_attention`` eagerly and compiled
with ``fullgraph=True`` (CUDA events, median of --iters after warm-up, max over ranks), their
ratio, the number of ring nodes the pass expanded, Dynamo's graph-break count, and the largest
difference between the compiled and eager out/dq/dk/dv.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

import dtensor_ring as dr
from dtensor_ring.tools.numerics import fwd_bwd
from report import versions
from timing import median_ms
from dtensor_ring import passes


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens-per-gpu", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--schedule", action="append", help="default: zigzag and llama3")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", required=True, help="JSON results")
    return parser.parse_args(argv)


def main():
    args = parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (world,))
    seq = args.tokens_per_gpu * world
    gen = torch.Generator(device="cuda").manual_seed(rank)
    shapes = [(1, args.heads, args.tokens_per_gpu, args.head_dim),
              (1, args.kv_heads, args.tokens_per_gpu, args.head_dim)]
    q, dout = (torch.randn(shapes[0], generator=gen, device="cuda", dtype=torch.bfloat16)
               for _ in range(2))
    k, v = (torch.randn(shapes[1], generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    rows = []
    for schedule in args.schedule or ["zigzag", "llama3"]:
        def attention(a, b, c, schedule=schedule):
            return dr.ring_attention(a, b, c, mesh=mesh, schedule=schedule, is_causal=True)

        compiled = torch.compile(attention, fullgraph=True)
        before = sum(passes.COUNTERS[k] for k in passes.COUNTERS if k.startswith("expanded"))
        breaks = sum(counters["graph_break"].values())
        eager_result, compiled_result = (fwd_bwd(fn, q, k, v, dout) for fn in (attention, compiled))
        diff = max((a.float() - b.float()).abs().max().item()
                   for a, b in zip(eager_result, compiled_result))
        eager_ms = median_ms(lambda: fwd_bwd(attention, q, k, v, dout), args.warmup, args.iters)
        compiled_ms = median_ms(lambda: fwd_bwd(compiled, q, k, v, dout), args.warmup, args.iters)
        rows.append({
            "schedule": schedule, "eager_fwd_bwd_ms": eager_ms, "compiled_fwd_bwd_ms": compiled_ms,
            "compiled_over_eager": compiled_ms / eager_ms, "max_abs_diff_vs_eager": diff,
            "ring_nodes_expanded": sum(passes.COUNTERS[k] for k in passes.COUNTERS
                                       if k.startswith("expanded")) - before,
            "graph_breaks": sum(counters["graph_break"].values()) - breaks})
    if rank == 0:
        meta = {**versions("cuda"),
                "world_size": world, "tokens_per_gpu": args.tokens_per_gpu, "seq": seq,
                "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                "dtype": "bfloat16", "causal": True}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"W={world} {args.tokens_per_gpu} tokens/GPU heads {args.heads}/{args.kv_heads} "
              f"d={args.head_dim} causal bf16 {meta['gpu']} torch {meta['torch']}")
        print("schedule  eager ms  compiled ms  compiled/eager  max|diff|  expanded  breaks")
        for r in rows:
            print(f"{r['schedule']:8} {r['eager_fwd_bwd_ms']:9.2f} {r['compiled_fwd_bwd_ms']:12.2f}"
                  f" {r['compiled_over_eager']:14.3f} {r['max_abs_diff_vs_eager']:10.2e}"
                  f" {r['ring_nodes_expanded']:9d} {r['graph_breaks']:7d}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
