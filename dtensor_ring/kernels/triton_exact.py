"""``triton_exact``: the exact block kernel on CUDA (the Triton kernels of ``triton_attention.py``).

Reads bf16/fp16 q, k, v (any strides: the schedules' sliced views are not copied; GQA through the
kv head index, never repeated); returns fp32 out and LSE, and fp32 dq, dk, dv. ``backward`` takes
the fp32 merged ``out`` for D = rowsum(dO * O). Head dims up to 128 (non powers of two, e.g. 80,
run in the next power-of-two tile, masked). Triton is optional: ``available`` is False without it.
Under ``TRITON_INTERPRET=1`` the kernel also runs on CPU tensors (the tests use that).
"""
import contextlib
import importlib.util
import math
import os
import threading

import torch

from .base import CAUSAL, CAUSAL_BOTTOM_RIGHT, MASKS, NONE, BlockKernel

_HALF = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 128


_INTERPRETER_LOCK = threading.Lock()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launching():
    """The interpreter patches triton.language globally while a kernel runs, so simulated ranks
    (threads) take turns; compiled launches need no lock."""
    return _INTERPRETER_LOCK if interpreting() else contextlib.nullcontext()


def _config(head_dim):
    """(BLOCK_M, BLOCK_N) for forward / dkdv / dq, warps, stages; 16-wide tiles when interpreting."""
    block_d = max(16, triton_next_pow2(head_dim))
    if interpreting():
        return dict(fwd=(16, 16), dkdv=(16, 16), dq=(16, 16), block_d=block_d, warps={},
                    upcast=True)
    return dict(fwd=(128, 64), dkdv=(32, 64), dq=(64, 32), block_d=block_d,
                warps=dict(num_warps=4, num_stages=2), upcast=False)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _offset(mask, seq_q, seq_k):
    if mask == CAUSAL and seq_q != seq_k:
        raise ValueError(f"mask='causal' needs a square block; got seq_q={seq_q}, seq_k={seq_k}")
    if mask == CAUSAL_BOTTOM_RIGHT and seq_q > seq_k:
        raise ValueError(f"mask='causal_bottom_right' needs seq_q <= seq_k; got {seq_q} > {seq_k}")
    return 0 if mask != CAUSAL_BOTTOM_RIGHT else seq_k - seq_q


class TritonExact(BlockKernel):
    name = "triton_exact"
    exact = True
    masks = MASKS

    def available(self, device, dtype, head_dim):
        return ((device.type == "cuda" or interpreting()) and dtype in _HALF
                and 1 <= head_dim <= MAX_HEAD_DIM
                and importlib.util.find_spec("triton") is not None)

    def forward(self, q, k, v, mask, scale):
        from . import triton_attention as ta  # noqa: PLC0415 - triton is optional

        if mask not in MASKS:
            raise ValueError(f"mask={mask!r} is not known; valid: {list(MASKS)}")
        batch, q_heads, seq_q, head_dim = q.shape
        seq_k = k.shape[2]
        offset = _offset(mask, seq_q, seq_k)
        cfg = _config(head_dim)
        out = q.new_empty(q.shape, dtype=torch.float32)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        block_m, block_n = cfg["fwd"]
        grid = (math.ceil(seq_q / block_m), batch * q_heads)
        with _launching():
            ta._forward[grid](q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(),
                              *out.stride(), *lse.stride(), q_heads, q_heads // k.shape[1],
                              seq_q, seq_k, head_dim, offset, scale * ta.LOG2E,
                              CAUSAL=mask != NONE, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_D=cfg["block_d"],
                              UPCAST=cfg["upcast"] and q.dtype == torch.bfloat16, **cfg["warps"])
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        from . import triton_attention as ta  # noqa: PLC0415 - triton is optional

        offset = _offset(mask, q.shape[2], k.shape[2])
        cfg = _config(q.shape[3])
        dout = dout.to(q.dtype)  # lossless: autograd may hand back the fp32 out's gradient
        lse = lse.float().contiguous()
        delta = (dout.float() * out.float()).sum(-1)  # D from the fp32 merged out
        dq = q.new_empty(q.shape, dtype=torch.float32)
        dk = k.new_empty(k.shape, dtype=torch.float32)
        dv = torch.empty_like(dk)
        with _launching():
            self._backward(ta, cfg, q, k, v, dout, lse, delta, dq, dk, dv, offset, scale, mask)
        return dq, dk, dv

    @staticmethod
    def _backward(ta, cfg, q, k, v, dout, lse, delta, dq, dk, dv, offset, scale, mask):
        """Launch dK/dV (one program per k tile and kv head) and dq (per q tile and q head)."""
        batch, q_heads, seq_q, head_dim = q.shape
        kv_heads, seq_k = k.shape[1], k.shape[2]
        common = dict(CAUSAL=mask != NONE, BLOCK_D=cfg["block_d"],
                      UPCAST=cfg["upcast"] and q.dtype == torch.bfloat16, **cfg["warps"])
        strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride())
        block_m, block_n = cfg["dkdv"]
        ta._dkdv[(math.ceil(seq_k / block_n), batch * kv_heads)](
            q, k, v, dout, lse, delta, dk, dv, *strides, *dk.stride(), kv_heads,
            q_heads // kv_heads, seq_q, seq_k, head_dim, offset, scale, scale * ta.LOG2E,
            BLOCK_M=block_m, BLOCK_N=block_n, **common)
        block_m, block_n = cfg["dq"]
        ta._dq[(math.ceil(seq_q / block_m), batch * q_heads)](
            q, k, v, dout, lse, delta, dq, *strides, *dq.stride(), q_heads, q_heads // kv_heads,
            seq_q, seq_k, head_dim, offset, scale, scale * ta.LOG2E,
            BLOCK_M=block_m, BLOCK_N=block_n, **common)
