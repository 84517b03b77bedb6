"""One-GPU probe for issue 5's per-step costs: do PyTorch's cuDNN and flash ops take the zigzag
half-block views (slices along seq of [B, H, S, D]) without ``.contiguous()``, and what does each
piece cost; the Triton merge against the torch merge; fp32 += 16-bit accumulation bandwidth.

    python bench/kernel_probe.py --tokens 8192 --heads 32 --kv-heads 32,8 --out probe.json

For each kernel and each block shape the schedules use (h = S/2; a = rows [:h], b = rows [h:]):
results on the strided views vs on contiguous copies (max abs difference: 0 means the op read the
views right), and the time of the kernel on views, on copies, and of the copies themselves.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dtensor_ring as dr
from dtensor_ring.kernels.cuda import Cudnn, Flash
from dtensor_ring.merge import TorchFp32, TritonFp32
from dtensor_ring.numerics import NAMES, errors, fwd_bwd


torch_merge_, triton_merge_ = TorchFp32.merge_, TritonFp32.merge_


def bench_ms(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def blocks(s):
    h = s // 2
    a, b, every = slice(0, h), slice(h, s), slice(0, s)
    return {"q[b] x k[ab]": (b, every, False), "q[ab] x k[a]": (every, a, False),
            "q[a] x k[a] causal": (a, a, True), "q[b] x k[a]": (b, a, False),
            "q[b] x k[b] causal": (b, b, True), "q[ab] x k[ab] causal": (every, every, True)}


def probe_kernels(args, kv_heads, rows):
    gen = torch.Generator(device="cuda").manual_seed(0)
    s, d = args.tokens, 128
    q, dout = (torch.randn(1, args.heads, s, d, generator=gen, device="cuda").bfloat16()
               for _ in range(2))
    k, v = (torch.randn(1, kv_heads, s, d, generator=gen, device="cuda").bfloat16()
            for _ in range(2))
    scale = d ** -0.5
    for kernel in (Cudnn(), Flash()):
        if not kernel.available(q.device, q.dtype, d):
            continue
        for name, (qr, kr, causal) in blocks(s).items():
            row = dict(kernel=kernel.name, kv_heads=kv_heads, tokens=s, block=name)
            views = [q[:, :, qr], k[:, :, kr], v[:, :, kr]]
            copies = [x.contiguous() for x in views]
            try:
                out_v, lse_v = kernel._forward(*views, causal, scale)
                out_c, lse_c = kernel._forward(*copies, causal, scale)
                row["fwd_maxdiff"] = max((out_v.float() - out_c.float()).abs().max().item(),
                                         (lse_v - lse_c).abs().max().item())
                # backward with the merged out / lse as the ring passes them: views of whole ones
                out_whole = torch.randn_like(q)
                lse_whole = torch.randn(q.shape[:3], device="cuda") + 10
                out_whole[:, :, qr], lse_whole[:, :, qr] = out_c, lse_c
                bviews = [dout[:, :, qr], *views, out_whole[:, :, qr], lse_whole[:, :, qr]]
                bcopies = [x.contiguous() for x in bviews]
                g_v = kernel._backward(*bviews, causal, scale)
                g_c = kernel._backward(*bcopies, causal, scale)
                row["bwd_maxdiff"] = max((x.float() - y.float()).abs().max().item()
                                         for x, y in zip(g_v, g_c))
                row["fwd_views_ms"] = bench_ms(lambda: kernel._forward(*views, causal, scale))
                row["fwd_copies_ms"] = bench_ms(lambda: kernel._forward(
                    *[x.contiguous() for x in views], causal, scale))
                row["bwd_views_ms"] = bench_ms(lambda: kernel._backward(*bviews, causal, scale))
                row["bwd_copies_ms"] = bench_ms(lambda: kernel._backward(
                    *[x.contiguous() for x in bviews], causal, scale))
            except Exception as exc:  # noqa: BLE001 - the probe reports, it does not stop
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            print(row, flush=True)


def probe_merge(args, rows):
    gen = torch.Generator(device="cuda").manual_seed(1)
    s, d, h = args.tokens, 128, args.tokens // 2
    for part, sl in (("all rows", slice(0, s)), ("rows [h:]", slice(h, s))):
        n = sl.stop - sl.start
        out = torch.randn(1, args.heads, s, d, generator=gen, device="cuda")
        lse = torch.randn(1, args.heads, s, generator=gen, device="cuda") * 3 + 10
        block_out = torch.randn(1, args.heads, n, d, generator=gen, device="cuda").bfloat16()
        block_lse = torch.randn(1, args.heads, n, 1, generator=gen, device="cuda")[..., 0] + 10
        ref = [out.clone(), lse.clone()]
        torch_merge_(ref[0][:, :, sl], ref[1][:, :, sl], block_out, block_lse)
        got = [out.clone(), lse.clone()]
        triton_merge_(got[0][:, :, sl], got[1][:, :, sl], block_out, block_lse)
        ref64 = [out.double(), lse.double()]
        w = torch.sigmoid(block_lse.double() - ref64[1][:, :, sl]).unsqueeze(-1)
        ref64[0][:, :, sl] -= w * (ref64[0][:, :, sl] - block_out.double())
        ref64[1][:, :, sl] = torch.logaddexp(ref64[1][:, :, sl], block_lse.double())
        row = dict(probe="merge", part=part, tokens=s, heads=args.heads)
        row["triton_vs_torch_maxdiff"] = max((a - b).abs().max().item() for a, b in zip(got, ref))
        row["triton_vs_f64_maxdiff"] = max((a.double() - b).abs().max().item()
                                           for a, b in zip(got, ref64))
        row["torch_vs_f64_maxdiff"] = max((a.double() - b).abs().max().item()
                                          for a, b in zip(ref, ref64))
        views = (out[:, :, sl], lse[:, :, sl], block_out, block_lse)
        row["torch_ms"] = bench_ms(lambda: torch_merge_(*views))
        row["triton_ms"] = bench_ms(lambda: triton_merge_(*views))
        row["min_bytes_ms"] = n * args.heads * d * (4 + 4 + 2) / 4.3e12 * 1e3  # at 4.3 TB/s
        rows.append(row)
        print(row, flush=True)


def probe_accumulate(args, rows):
    """fp32 accumulator += 16-bit block grads (what every backward step does), torch ops."""
    s, d = args.tokens, 128
    acc = torch.randn(1, args.heads, s, d, device="cuda")
    grad = torch.randn(1, args.heads, s, d, device="cuda").bfloat16()
    grad32 = grad.float()
    for name, fn in (("acc += bf16", lambda: acc.add_(grad)),
                     ("acc.copy_(bf16)", lambda: acc.copy_(grad)),
                     ("triton acc += bf16", lambda: TritonFp32.accumulate_(acc, grad, True)),
                     ("triton acc = bf16", lambda: TritonFp32.accumulate_(acc, grad, False)),
                     ("acc += fp32", lambda: acc.add_(grad32)),
                     ("acc[:, :, h:] += bf16 half", lambda: acc[:, :, s // 2:].add_(
                         grad[:, :, : s // 2])),
                     ("torch.add(fp32, fp32, out=bf16)", lambda: torch.add(
                         acc, grad32, out=torch.empty_like(grad)))):
        ms = bench_ms(fn)
        rows.append(dict(probe="accumulate", op=name, tokens=s, ms=ms))
        print(rows[-1], flush=True)


def probe_simulated(rows, seq=4096, heads=8):
    gen = torch.Generator(device="cuda").manual_seed(2)
    for kv_heads in (heads, heads // 4):
        shapes = [(1, heads, seq, 128), (1, kv_heads, seq, 128), (1, kv_heads, seq, 128),
                  (1, heads, seq, 128)]
        x64 = [torch.randn(sh, generator=gen, device="cuda", dtype=torch.float64) for sh in shapes]
        with sdpa_kernel(SDPBackend.MATH):
            ref = fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(
                a, b, c, is_causal=True, enable_gqa=True), *x64)
        x = [t.bfloat16() for t in x64]

        def single(a, b, c):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)

        base = errors(fwd_bwd(single, *x), ref)
        for schedule in sorted(dr.SCHEDULES):
            for precision in ("fp32", "exact"):
                row = dict(probe="simulate", schedule=schedule, precision=precision, world=4,
                           seq=seq, heads=heads, kv_heads=kv_heads)
                try:
                    got = errors(fwd_bwd(lambda a, b, c: dr.simulate_ring(
                        a, b, c, world_size=4, schedule=schedule, is_causal=True,
                        precision=precision), *x), ref)
                    row["ratio"] = {n: got[n]["rel_rms"] / base[n]["rel_rms"] for n in NAMES}
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                rows.append(row)
                print(row, flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", default="32,8")
    p.add_argument("--simulate", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    if args.simulate:
        probe_simulated(rows)
    for kv_heads in (int(x) for x in args.kv_heads.split(",")):
        probe_kernels(args, kv_heads, rows)
    probe_merge(args, rows)
    probe_accumulate(args, rows)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                cudnn=torch.backends.cudnn.version())
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
