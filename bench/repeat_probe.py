"""Run-to-run reproducibility on W GPUs: the same inputs through each schedule N times; does any
output change, and where? The kernels, merges and sums are deterministic, so any difference means
a race (a buffer read before it was written, or reused while still in flight).

    torchrun --nproc-per-node=2 bench/repeat_probe.py --tokens-per-gpu 4096 --heads 8 --kv-heads 8 \\
        --repeats 6 --out repeat.json

Per schedule x precision: out, dq, dk, dv of ``ring_attention`` (local shards, before any gather)
compared bit for bit with the first call's, per rank: how many elements differ, in which local
rows, and the largest difference; then the same for the gathered (``unshard_sequence``) results,
and the error of each call against float64 (rel-RMS of out).

``--poison``: before every call, fill 8 GiB of the caching allocator's free memory with NaN (allocate,
fill, free), so a read of memory nothing wrote shows up as NaN in the outputs (counted per call).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dtensor_ring as dr
from dtensor_ring.numerics import NAMES, fwd_bwd, rel_rms


def compare(first, later):
    """Differences of ``later`` from ``first`` ([B, H, S, D] each): count, rows, largest."""
    diff = (later.float() - first.float()).abs()
    rows = diff.amax(dim=(0, 1, 3)).nonzero().flatten()
    return dict(count=int((diff > 0).sum()), max=float(diff.max()),
                rows=[int(rows.min()), int(rows.max())] if rows.numel() else None,
                n_rows=int(rows.numel()))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens-per-gpu", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--schedules", default="zigzag,ring,stripe,llama3")
    p.add_argument("--precisions", default="exact,fp32")
    p.add_argument("--poison", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world,))
    seq, d = args.tokens_per_gpu * world, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1, args.heads, seq, d), (1, args.kv_heads, seq, d), (1, args.kv_heads, seq, d),
              (1, args.heads, seq, d)]
    x64 = [torch.randn(s, generator=gen, device="cuda", dtype=torch.float64) for s in shapes]
    inputs = [x.bfloat16() for x in x64]
    ref_out = torch.nn.functional.scaled_dot_product_attention(
        *x64[:3], is_causal=True, enable_gqa=args.heads != args.kv_heads)
    rows = []
    for schedule in args.schedules.split(","):
        layout = dr.SCHEDULE_LAYOUT[schedule]
        shards = [dr.shard_sequence(x, mesh, layout=layout) for x in inputs]
        for precision in args.precisions.split(","):
            def ring(a, b, c):
                return dr.ring_attention(a, b, c, mesh=mesh, schedule=schedule, is_causal=True,
                                         precision=precision)

            calls = []
            for _ in range(args.repeats):
                if args.poison:
                    torch.full((2 << 30,), float("nan"), device="cuda")  # freed at once, cached
                local = fwd_bwd(ring, *shards)
                gathered = [dr.unshard_sequence(x.contiguous(), mesh, layout=layout)
                            for x in local]
                torch.cuda.synchronize()
                calls.append((local, [g.clone() for g in gathered]))
            row = dict(rank=rank, schedule=schedule, precision=precision,
                       out_rel_rms=[rel_rms(c[1][0], ref_out) for c in calls],
                       nan_counts=[[int(x.isnan().sum()) for x in c[0]] for c in calls])
            for i, (local, gathered) in enumerate(calls[1:], start=1):
                row[f"call{i}_local"] = {n: compare(a, b) for n, a, b in
                                        zip(NAMES, calls[0][0], local)}
                row[f"call{i}_gathered"] = {n: compare(a, b) for n, a, b in
                                           zip(NAMES, calls[0][1], gathered)}
            rows.append(row)
            changed = sum(v[n]["count"] for k, v in row.items() if k.startswith("call")
                          for n in NAMES)
            print(json.dumps(dict(rank=rank, schedule=schedule, precision=precision,
                                  elements_changed=changed, nans=row["nan_counts"],
                                  out_rel_rms=[round(x, 7) for x in row["out_rel_rms"]])),
                  flush=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump([r for part in everyone for r in part], f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
