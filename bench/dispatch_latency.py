"""What a ring_attention call costs beyond its kernels: the eager path against the custom op's.

    torchrun --nproc-per-node=1 bench/dispatch_latency.py --device cuda --tokens 2048,8192,16384 \\
        --out dispatch.json
    torchrun --nproc-per-node=2 bench/dispatch_latency.py --device cpu --out dispatch_cpu.json

Per config, forward+backward of ``dr.ring_attention`` (eagerly: the schedule called from its own
``autograd.Function``) and of the same attention through ``dtensor_ring::ring_attention_fwd`` and
its registered autograd (what ``ring_attention`` ran eagerly before, and runs when traced; called
here without ``ring_attention``'s input checks, which the eager row includes, so the difference
understates the saving by their cost), in rounds that alternate which goes first: the time per
call (CUDA events with a synchronisation after each call, as ``speed.py`` times, so the host's work
before the first kernel shows; a host clock on CPU), median over rounds of medians, the max over
ranks. On CPU with tiny tensors the difference is the host cost of the dispatch itself.
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dtensor_ring as dr  # noqa: E402
from dtensor_ring import ops  # noqa: E402
from dtensor_ring.kernels import resolve_backend  # noqa: E402
from timing import local_median_ms  # noqa: E402


def paths(mesh, schedule, precision):
    """name -> attention(q, k, v): the eager path and the op's."""
    group = mesh.get_group()

    def eager(q, k, v):
        return dr.ring_attention(q, k, v, mesh=mesh, schedule=schedule, is_causal=True,
                                 precision=precision)

    def via_op(q, k, v):
        backend = resolve_backend("auto", q.device, q.dtype, q.shape[-1], precision)
        out, _ = ops.ring_attention_fwd(q, k, v, group.group_name, schedule, True,
                                        q.shape[-1] ** -0.5, backend, precision)
        return out.to(q.dtype)
    return {"eager": eager, "op": via_op}


def main():
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tokens", type=ints, default=None, help="per rank (default: 2048,8192 "
                        "on cuda, 64 on cpu)")
    parser.add_argument("--heads", type=int, default=None, help="q heads (32 cuda, 4 cpu)")
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None, help="128 cuda, 16 cpu")
    parser.add_argument("--schedules", default="zigzag,llama3")
    parser.add_argument("--precisions", default="fp32,exact")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    tokens = args.tokens or ([2048, 8192] if cuda else [64])
    heads = args.heads or (32 if cuda else 4)
    kv_heads = args.kv_heads or heads
    head_dim = args.head_dim or (128 if cuda else 16)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(args.device, (world,))
    torch.manual_seed(rank)
    rows = []
    for schedule in args.schedules.split(","):
        for precision in args.precisions.split(","):
            for n in tokens:
                q = torch.randn(1, heads, n, head_dim, device=args.device, dtype=torch.bfloat16)
                k, v = (torch.randn(1, kv_heads, n, head_dim, device=args.device,
                                    dtype=torch.bfloat16) for _ in range(2))
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                dout = torch.randn_like(q)
                times = {}
                for rnd in range(args.rounds):
                    order = list(paths(mesh, schedule, precision).items())
                    for name, attend in order[::-1] if rnd % 2 else order:  # who goes first
                        def step():
                            attend(q, k, v).backward(dout)
                        ms = local_median_ms(step, args.warmup, args.iters, args.device)
                        worst = torch.tensor(ms, device=args.device)
                        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                        times.setdefault(name, []).append(worst.item())
                row = dict(schedule=schedule, precision=precision, tokens_per_rank=n,
                           heads=heads, kv_heads=kv_heads, head_dim=head_dim, world=world,
                           ms={name: statistics.median(t) for name, t in times.items()},
                           rounds_ms=times)
                row["op_minus_eager_ms"] = row["ms"]["op"] - row["ms"]["eager"]
                rows.append(row)
                if rank == 0:
                    print(f"{schedule:7s} {precision:6s} {n:6d} tokens: eager "
                          f"{row['ms']['eager']:.3f} ms, op {row['ms']['op']:.3f} ms, op - eager "
                          f"{row['op_minus_eager_ms'] * 1e3:.0f} us", flush=True)
    if rank == 0:
        meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu",
                    torch=torch.__version__, world=world)
        Path(args.out).write_text(json.dumps(dict(meta=meta, args=vars(args), rows=rows),
                                             indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
