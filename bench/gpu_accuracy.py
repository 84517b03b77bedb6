"""Accuracy (vs float64) and time of every schedule with each CUDA block kernel, on W GPUs.

    torchrun --nproc-per-node=4 bench/gpu_accuracy.py --out results.json

For each block kernel (cudnn and flash in fp32 mode, triton_exact in exact mode; ``--backends``
picks some) and schedule: rel-RMS and max-abs error of out, dq, dk, dv over the whole sequence
against a float64 reference on the same bf16 inputs (as the numerics report: the rounding of the
inputs, common to every kernel, is not in the errors: it would pull the ratios towards 1 and
leave max-abs ratios to chance), each as a ratio to a single-GPU SDPA kernel on the whole
sequence (the same kernel for cudnn/flash; cuDNN, the fastest, for exact mode), 1.00 = splitting
added no error; and forward / forward+backward time (CUDA events, median of --iters after
warm-up, max over ranks), with that single-GPU kernel's time / W as the ideal.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

import dtensor_ring as dr
from dtensor_ring.tools.numerics import errors, fwd_bwd
from report import versions
from timing import median_ms

# (our backend, precision, the single-GPU SDPA kernel it is compared with)
RUNS = [("cudnn", "fp32", SDPBackend.CUDNN_ATTENTION), ("flash", "fp32", SDPBackend.FLASH_ATTENTION),
        ("triton_exact", "exact", SDPBackend.CUDNN_ATTENTION)]
NAMES = ("out", "dq", "dk", "dv")


def _backends(value: str) -> list:
    """--backends: a comma list of RUNS' block kernels, each known."""
    valid = [run[0] for run in RUNS]
    names = value.split(",")
    for name in names:
        if name not in valid:
            raise argparse.ArgumentTypeError(f"has {name!r}; valid: {valid}")
    return names


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=8192, help="global sequence length")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backends", type=_backends, default=[run[0] for run in RUNS],
                        help="comma list of the block kernels to run")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main():
    args = parse_args()
    runs = [run for run in RUNS if run[0] in args.backends]

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (world,))
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q = (1, args.heads, args.seq, args.head_dim)
    shape_kv = (1, args.kv_heads, args.seq, args.head_dim)
    q, k, v, dout = (torch.randn(s, generator=gen, device="cuda", dtype=torch.float64).bfloat16()
                     for s in (shape_q, shape_kv, shape_kv, shape_q))
    gqa = args.heads != args.kv_heads
    with sdpa_kernel(SDPBackend.MATH):
        reference = fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(
            a, b, c, is_causal=True, enable_gqa=gqa), *(x.double() for x in (q, k, v, dout)))
    rows = []
    for backend, precision, sdpa_backend in runs:
        def single(a, b, c, sdpa_backend=sdpa_backend):
            with sdpa_kernel(sdpa_backend):
                return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=gqa)
        try:
            single_err = errors(fwd_bwd(single, q, k, v, dout), reference)
        except RuntimeError as error:  # e.g. a kernel that does not take GQA on this torch
            if rank == 0:
                print(f"single-GPU {sdpa_backend} unavailable: {error}".splitlines()[0])
            continue
        ideal_fwd = median_ms(lambda: single(q, k, v), args.warmup, args.iters) / world
        ideal_fb = median_ms(lambda: fwd_bwd(single, q, k, v, dout), args.warmup,
                             args.iters) / world
        for schedule in sorted(dr.SCHEDULES):
            layout = dr.SCHEDULE_LAYOUT[schedule]
            shards = [dr.shard_sequence(x, mesh, layout=layout) for x in (q, k, v, dout)]

            def ring(a, b, c, schedule=schedule, backend=backend, precision=precision):
                return dr.ring_attention(a, b, c, mesh=mesh, schedule=schedule, is_causal=True,
                                         backend=backend, precision=precision)

            local = fwd_bwd(ring, *shards)
            whole = [dr.unshard_sequence(x.contiguous(), mesh, layout=layout) for x in local]
            err = errors(whole, reference)
            with torch.no_grad():
                fwd_ms = median_ms(lambda: ring(*shards[:3]), args.warmup, args.iters)
            fb_ms = median_ms(lambda: fwd_bwd(ring, *shards), args.warmup, args.iters)
            rows.append({
                "backend": backend, "precision": precision, "schedule": schedule,
                "world_size": world,
                "ratio_rel_rms": {n: err[n]["rel_rms"] / single_err[n]["rel_rms"] for n in NAMES},
                "ratio_max_abs": {n: err[n]["max_abs"] / single_err[n]["max_abs"] for n in NAMES},
                "errors": err, "single_gpu_errors": single_err,
                "fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms,
                "ideal_fwd_ms": ideal_fwd, "ideal_fwd_bwd_ms": ideal_fb,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30})
    if rank == 0:
        meta = {**versions("cuda"), "world_size": world, "seq": args.seq,
                "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                "dtype": "bfloat16", "causal": True}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"W={world} S={args.seq} H={args.heads}/{args.kv_heads} d={args.head_dim} "
              f"causal bf16 {meta['gpu']} torch {meta['torch']} cudnn {meta['cudnn']}")
        print("backend      schedule rel-RMS ratio out/dq/dk/dv   max-abs ratio out/dq/dk/dv   "
              "fwd ms (ideal)   fwd+bwd ms (ideal)")
        for r in rows:
            rr = "/".join(f"{r['ratio_rel_rms'][n]:.2f}" for n in NAMES)
            ma = "/".join(f"{r['ratio_max_abs'][n]:.2f}" for n in NAMES)
            print(f"{r['backend']:12} {r['schedule']:8} {rr:28} {ma:28} "
                  f"{r['fwd_ms']:6.2f} ({r['ideal_fwd_ms']:.2f})   "
                  f"{r['fwd_bwd_ms']:6.2f} ({r['ideal_fwd_bwd_ms']:.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
