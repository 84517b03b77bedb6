"""Experiment (kept as the record of README.md here, not used by the package): dq from the dK/dV
kernel by TMA reduce-add (5 products per tile pair), against the package's 2-kernel backward
(7 products) and cuDNN, on zigzag's blocks at 16K tokens per GPU. One GPU:

    PYTHONPATH=/tmp/site python bench/results/2026-11-23_dq_tma_reduce_h200/exp_dq_atomic.py out.json
"""
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/
from timing import local_median_ms  # noqa: E402
import triton_tune as tt  # noqa: E402

from dtensor_ring.kernels import triton_attention as ta  # noqa: E402
from dtensor_ring.kernels.triton_exact import Tiles, _constants, _offset  # noqa: E402
from dtensor_ring.kernels.triton_attention import (  # noqa: E402
    _LOG2E, _dot, _dot_add, _load, _store, _visible)


@triton.jit
def _tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_desc, dq_bh, sqm, sqd, sdm, sdd,
           slm, cols, dims, lo, hi, seq_q, seq_k, offset, scale, scale_log2, MASKED: tl.constexpr,
           CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
           BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    for start in range(lo, hi, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        q = _load(q_base, rows, sqm, seq_q, dims, sqd, MASKED, HEAD_DIM, BLOCK_D)
        do = _load(do_base, rows, sdm, seq_q, dims, sdd, MASKED, HEAD_DIM, BLOCK_D)
        if MASKED:
            lse = tl.load(lse_base + rows * slm, mask=rows < seq_q, other=0.0)
            delta = tl.load(delta_base + rows * slm, mask=rows < seq_q, other=0.0)
        else:
            lse = tl.load(lse_base + rows * slm)
            delta = tl.load(delta_base + rows * slm)
        lse2 = lse * _LOG2E
        p_t = tl.exp2(_dot(k, tl.trans(q), UPCAST) * scale_log2 - lse2[None, :])
        if MASKED:
            p_t = tl.where(_visible(rows[None, :], cols[:, None], seq_q, seq_k, offset, CAUSAL),
                           p_t, 0.0)
        dv = _dot_add(p_t.to(do.dtype), do, dv, UPCAST)
        ds_t = (p_t * (_dot(v, tl.trans(do), UPCAST) - delta[None, :])).to(q.dtype)
        dk = _dot_add(ds_t, q, dk, UPCAST)
        dq = _dot(tl.trans(ds_t), k, UPCAST) * scale
        dq_desc.atomic_add([dq_bh, start, 0], dq[None, :, :])
    return dk, dv


@triton.jit
def _fused(Q, K, V, DO, Lse, Delta, DK, DV, dq_desc,
           sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
           sdb, sdh, sdm, sdd, slb, slh, slm, sgb, sgh, sgn, sgd,
           kv_heads, q_heads, groups, seq_q, seq_k, offset, scale, scale_log2,
           CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // kv_heads
    hk = bh % kv_heads
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k = _load(K + b * skb + hk * skh, cols, skn, seq_k, dims, skd, True, HEAD_DIM, BLOCK_D)
    v = _load(V + b * svb + hk * svh, cols, svn, seq_k, dims, svd, True, HEAD_DIM, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first = 0
    full_start = 0
    if CAUSAL:
        first = tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M
        full_start = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M
    rows_end = tl.cdiv(seq_q, BLOCK_M) * BLOCK_M
    if n0 + BLOCK_N > seq_k:
        full_start = rows_end
    full_start = tl.minimum(full_start, rows_end)
    full_end = tl.maximum(full_start, seq_q // BLOCK_M * BLOCK_M)
    for g in range(0, groups):
        h = hk * groups + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        lse_base = Lse + b * slb + h * slh
        delta_base = Delta + b * slb + h * slh
        dq_bh = b * q_heads + h
        dk, dv = _tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_desc, dq_bh, sqm,
                        sqd, sdm, sdd, slm, cols, dims, first, full_start, seq_q, seq_k, offset,
                        scale, scale_log2, True, CAUSAL, BLOCK_M, HEAD_DIM, BLOCK_D, UPCAST)
        dk, dv = _tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_desc, dq_bh, sqm,
                        sqd, sdm, sdd, slm, cols, dims, full_start, full_end, seq_q, seq_k, offset,
                        scale, scale_log2, False, CAUSAL, BLOCK_M, HEAD_DIM, BLOCK_D, UPCAST)
        dk, dv = _tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_desc, dq_bh, sqm,
                        sqd, sdm, sdd, slm, cols, dims, full_end, rows_end, seq_q, seq_k, offset,
                        scale, scale_log2, True, CAUSAL, BLOCK_M, HEAD_DIM, BLOCK_D, UPCAST)
    base = b * sgb + hk * sgh
    _store(DK + base, cols, sgn, seq_k, dims, sgd, dk * scale, HEAD_DIM, BLOCK_D)
    _store(DV + base, cols, sgn, seq_k, dims, sgd, dv, HEAD_DIM, BLOCK_D)


def backward_fused(dout, q, k, v, out, lse, mask, scale, tiles):
    offset = _offset(mask, q.shape[2], k.shape[2])
    lse = lse.float().contiguous()
    delta = (dout.float() * out.float()).sum(-1)
    batch, q_heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = k.new_empty(k.shape, dtype=torch.float32)
    dv = torch.empty_like(dk)
    consts = _constants(q, mask)
    desc = TensorDescriptor.from_tensor(dq.view(batch * q_heads, seq_q, head_dim),
                                        [1, tiles.block_m, consts["BLOCK_D"]])
    _fused[(triton.cdiv(seq_k, tiles.block_n), batch * kv_heads)](
        q, k, v, dout, lse, delta, dk, dv, desc, *q.stride(), *k.stride(), *v.stride(),
        *dout.stride(), *lse.stride(), *dk.stride(), kv_heads, q_heads, q_heads // kv_heads,
        seq_q, seq_k, offset, scale, scale * ta.LOG2E, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, num_warps=tiles.warps, num_stages=tiles.stages, **consts)
    return dq, dk, dv


FUSED = [Tiles(64, 128, 8, 3), Tiles(64, 128, 8, 2), Tiles(64, 64, 4, 3), Tiles(128, 128, 8, 2),
         Tiles(32, 128, 8, 3), Tiles(64, 128, 4, 2)]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def bits_differ(a, b):
    return int((a.view(torch.int32) != b.view(torch.int32)).sum())


def main():
    class A:
        tokens, heads, kv_heads, warmup, iters = 16384, 32, [32, 8], 2, 7
    out_path = sys.argv[1]
    rows = []
    scale = 128 ** -0.5
    for label, q, k, v, dout, out, lse, mask in tt.cases(A):
        ref = tt.KERNEL.backward(dout, q, k, v, out, lse, mask, scale)
        out16, lse16 = tt.CUDNN.forward(q, k, v, mask, scale)
        row = dict(case=label,
                   cudnn_bwd_ms=local_median_ms(lambda: tt.CUDNN.backward(
                       dout, q, k, v, out16, lse16, mask, scale), 2, 7),
                   two_kernel_ms=local_median_ms(lambda: tt.KERNEL.backward(
                       dout, q, k, v, out, lse, mask, scale), 2, 7), fused={})
        for tiles in FUSED:
            key = "x".join(map(str, tiles))
            try:
                got = backward_fused(dout, q, k, v, out, lse, mask, scale, tiles)
                again = backward_fused(dout, q, k, v, out, lse, mask, scale, tiles)
                row["fused"][key] = dict(
                    ms=local_median_ms(lambda t=tiles: backward_fused(
                        dout, q, k, v, out, lse, mask, scale, t), 2, 7),
                    rel_diff_vs_two_kernel=[rel(g, r) for g, r in zip(got, ref)],
                    dq_bits_differ_run_to_run=bits_differ(got[0], again[0]),
                    dq_bf16_differ_run_to_run=int((got[0].bfloat16() != again[0].bfloat16()).sum()))
            except Exception as exc:  # noqa: BLE001
                row["fused"][key] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(out_path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
