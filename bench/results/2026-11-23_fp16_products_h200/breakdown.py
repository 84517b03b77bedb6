"""Where the fp16-products kernel's extra time goes, on one GPU (run after probe.py).

    python breakdown.py --out breakdown.json

* kernels alone: the new forward / backward Triton kernels on copies made beforehand, against the
  old kernels (``dtensor_ring_old``) and the new full calls (copies included); zigzag's blocks at
  16K tokens, 32/32 and 32/8 heads, 3 rotating rounds of medians of 10.
* the copy's two passes: ``torch.linalg.vector_norm`` (the package's amax) against a Triton amax
  with one atomic max per program (zero-filled buffer first), and the scaled cast with 64 and 128
  rows per program, on a [1, 32, 16384, 128] bf16 tensor.
* small blocks (2K and 4K tokens, 32/32, causal own block): old and new full calls, where launches
  and host work weigh most.
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/, for timing.py
from timing import local_median_ms  # noqa: E402

from dtensor_ring.kernels import triton_attention as ta  # noqa: E402
from dtensor_ring.kernels.base import CAUSAL, NONE  # noqa: E402
from dtensor_ring.kernels.triton_exact import (  # noqa: E402
    TUNED, TritonExact, _block_d, _constants, _fp16_copies, _launch, _offset)
from dtensor_ring_old.kernels.triton_exact import TritonExact as OldExact  # noqa: E402

SCALE = 128 ** -0.5
NEW, OLD = TritonExact(), OldExact()


@triton.jit
def _amax_atomic(X, Amax, sxb, sxh, sxm, sxd, heads, seq, ROWS: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    bh = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    x = tl.load(X + (bh // heads) * sxb + (bh % heads) * sxh + rows[:, None] * sxm
                + dims[None, :] * sxd, mask=rows[:, None] < seq, other=0.0)
    tl.atomic_max(Amax + bh, tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0))


def amax_atomic(x, rows):
    b, h, s, d = x.shape
    amax = torch.zeros(b, h, device=x.device)
    _amax_atomic[(math.ceil(s / rows), b * h)](x, amax, *x.stride(), h, s, ROWS=rows, BLOCK_D=d)
    return amax


def cast(x, amax, rows):
    b, h, s, d = x.shape
    y = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    slot = (*x.stride(), h, s, 0)
    ta._to_fp16[(math.ceil(s / rows), b * h, 1)](x, x, x, x, amax, y, b, h, *slot * 4, ROWS=rows,
                                                 HEAD_DIM=d, BLOCK_D=_block_d(d))
    return y


def forward_kernel(q, k, v16, v_amax, mask):
    """The new forward kernel alone (the copy made beforehand)."""
    out = q.new_empty(q.shape, dtype=torch.float32)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    shape = TUNED["forward"]
    ta._forward[(math.ceil(q.shape[2] / shape.block_m), q.shape[0] * q.shape[1])](
        q, k, v16, v_amax, out, lse, *q.stride(), *k.stride(), *v16.stride(), *out.stride(),
        *lse.stride(), q.shape[1], q.shape[1] // k.shape[1], q.shape[2], k.shape[2],
        _offset(mask, q.shape[2], k.shape[2]), SCALE * ta.LOG2E, MERGE=False,
        BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, **_constants(q, mask), **_launch(shape))


def backward_kernels(copies, q, out, lse, mask):
    """The new dq and dK/dV kernels alone, on copies (q16, k16, v16, do16, amaxes) made before."""
    q16, k16, v16, do16, *amaxes = copies
    delta = torch.empty_like(lse)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty(k16.shape, dtype=torch.float32, device=q.device)
    dv = torch.empty_like(dk)
    b, hq, sq, _ = q.shape
    hk, sk = k16.shape[1], k16.shape[2]
    args = (q16, k16, v16, do16, *amaxes, lse, delta)
    strides = (*q16.stride(), *k16.stride(), *v16.stride(), *do16.stride(), *lse.stride())
    sizes = (hq // hk, sq, sk, _offset(mask, sq, sk), SCALE, SCALE * ta.LOG2E)
    c, sdq, skv = _constants(q, mask), TUNED["dq"], TUNED["dkdv"]
    ta._dq[(math.ceil(sq / sdq.block_m), b * hq)](
        *args, dq, out, *strides, *dq.stride(), *out.stride(), hq, *sizes, ADD=False,
        BLOCK_M=sdq.block_m, BLOCK_N=sdq.block_n, **c, **_launch(sdq))
    ta._dkdv[(math.ceil(sk / skv.block_n), b * hk)](
        *args, dk, dv, *strides, *dk.stride(), *dv.stride(), hk, *sizes, ADD=False,
        BLOCK_M=skv.block_m, BLOCK_N=skv.block_n, **c, **_launch(skv))


def rotate(fns, rounds=3, warmup=3, iters=10):
    ms = {n: [] for n in fns}
    for rnd in range(rounds):
        names = list(fns)[rnd % len(fns):] + list(fns)[:rnd % len(fns)]
        for n in names:
            ms[n].append(local_median_ms(fns[n], warmup, iters))
    return {n: statistics.median(t) for n, t in ms.items()}


def blocks_16k(rows):
    s = 16384
    half, every = slice(0, s // 2), slice(0, s)
    for kv_heads in (32, 8):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, dout = (torch.randn(1, 32, s, 128, generator=gen, device="cuda").bfloat16()
                   for _ in range(2))
        k, v = (torch.randn(1, kv_heads, s, 128, generator=gen, device="cuda").bfloat16()
                for _ in range(2))
        for name, (r, c, mask) in {"SxS causal": (every, every, CAUSAL),
                                   "S/2xS": (half, every, NONE),
                                   "SxS/2": (every, half, NONE)}.items():
            qb, kb, vb, db = q[:, :, r], k[:, :, c], v[:, :, c], dout[:, :, r]
            out, lse = NEW.forward(qb, kb, vb, mask, SCALE)
            old_out, old_lse = OLD.forward(qb, kb, vb, mask, SCALE)
            [(v16, v_amax)] = _fp16_copies(vb)
            copies = _fp16_copies(qb, kb, vb, db)
            copies = [c_[0] for c_ in copies] + [c_[1] for c_ in copies]
            ms = rotate({
                "old_fwd": lambda: OLD.forward(qb, kb, vb, mask, SCALE),
                "new_fwd": lambda: NEW.forward(qb, kb, vb, mask, SCALE),
                "new_fwd_kernel": lambda: forward_kernel(qb, kb, v16, v_amax, mask),
                "old_bwd": lambda: OLD.backward(db, qb, kb, vb, old_out, old_lse, mask, SCALE),
                "new_bwd": lambda: NEW.backward(db, qb, kb, vb, out, lse, mask, SCALE),
                "new_bwd_kernels": lambda: backward_kernels(copies, qb, out, lse, mask)})
            rows.append(dict(block=f"{name} 32/{kv_heads}", ms=ms))
            print(json.dumps(rows[-1]), flush=True)


def copy_passes(rows):
    x = torch.randn(1, 32, 16384, 128, device="cuda").bfloat16()
    amax = torch.linalg.vector_norm(x, float("inf"), dim=(2, 3), dtype=torch.float32)
    assert torch.equal(amax, amax_atomic(x, 64))
    ms = rotate({
        "vector_norm": lambda: torch.linalg.vector_norm(x, float("inf"), dim=(2, 3)),
        "amax_atomic_64": lambda: amax_atomic(x, 64),
        "amax_atomic_256": lambda: amax_atomic(x, 256),
        "cast_64": lambda: cast(x, amax, 64),
        "cast_128": lambda: cast(x, amax, 128),
        "copy_package": lambda: _fp16_copies(x)}, iters=20)
    rows.append(dict(copy="[1, 32, 16384, 128] bf16", ms=ms))
    print(json.dumps(rows[-1]), flush=True)


def small(rows):
    for s in (2048, 4096):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(1, 32, s, 128, generator=gen, device="cuda").bfloat16()
                         for _ in range(4))
        out, lse = NEW.forward(q, k, v, CAUSAL, SCALE)
        old_out, old_lse = OLD.forward(q, k, v, CAUSAL, SCALE)
        ms = rotate({
            "old_fwd": lambda: OLD.forward(q, k, v, CAUSAL, SCALE),
            "new_fwd": lambda: NEW.forward(q, k, v, CAUSAL, SCALE),
            "old_bwd": lambda: OLD.backward(dout, q, k, v, old_out, old_lse, CAUSAL, SCALE),
            "new_bwd": lambda: NEW.backward(dout, q, k, v, out, lse, CAUSAL, SCALE)}, iters=30)
        rows.append(dict(block=f"SxS causal 32/32, S = {s}", ms=ms))
        print(json.dumps(rows[-1]), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [dict(device=torch.cuda.get_device_name(), torch=torch.__version__)]
    copy_passes(rows)
    small(rows)
    blocks_16k(rows)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
