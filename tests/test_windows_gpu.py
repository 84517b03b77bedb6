"""Sliding windows on real GPU ranks (two or more GPUs of one host; skipped otherwise).

On W = min(GPUs, 4) NCCL ranks, the windowed exchange (``schedules/windowed.py``: K/V rows to the
ranks within reach over NCCL, dK/dV back) with the CUDA block kernels: the causal edge blocks that
``kernels/windows.reversed_causal`` runs on cuDNN with their rows reversed, the other bands on
PyTorch's flash op. ring and zigzag, fp32 and exact, eager, and zigzag compiled; windows shorter
than a zigzag chunk, as long as one (every edge block reversed) and longer (bands with no upper
bound on flash, and reversed squares cut from the chunk before the previous one). Each is held to
float64 attention with the same window within the usual tolerance of the single-GPU kernel's
error (SDPA with the window as a mask), on every rank; the result unsharded in the wrong layout
fails the same check.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

import dtensor_ring as dr
from dtensor_ring.tools.numerics import attention_and_grads, check_ratios, make_inputs, ratios
from dist_utils import run_on_gpus

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs several GPUs")

TOKENS = 1024  # per rank: zigzag chunks of 512
LEFTS = (255, 511, 767)  # a window of 256, 512 (a chunk) and 768 tokens
RUNS = [("ring", "fp32", False), ("zigzag", "fp32", False), ("zigzag", "exact", False),
        ("zigzag", "fp32", True)]


def _windowed_sdpa(left):
    def fn(q, k, v):
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j >= i - left),
                                              enable_gqa=True)
    return fn


def _ranks(rank, world):
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    q, k, v, dout = (x.cuda() for x in make_inputs(1, 8, 4, TOKENS * world, 128))
    bf16 = [x.bfloat16() for x in (q, k, v, dout)]
    for left in LEFTS:
        reference = attention_and_grads(_windowed_sdpa(left), q, k, v, dout, torch.float64)
        single = attention_and_grads(_windowed_sdpa(left), q, k, v, dout, torch.bfloat16)
        for schedule, precision, compiled in RUNS:
            where = f"rank {rank}: window ({left}, 0), {schedule} {precision} compiled={compiled}"

            def ring(a, b, c):
                return dr.ring_attention(a, b, c, mesh=mesh, schedule=schedule, is_causal=True,
                                         precision=precision, window=(left, 0))
            fn = torch.compile(ring, fullgraph=True) if compiled else ring
            layout = dr.SCHEDULE_LAYOUT[schedule]
            shards = [dr.shard_sequence(x, mesh, dim=2, layout=layout) for x in bf16]
            got = [x.contiguous() for x in attention_and_grads(fn, *shards, torch.bfloat16)]
            whole = [dr.unshard_sequence(x, mesh, dim=2, layout=layout) for x in got]
            check_ratios(ratios(whole, single, reference), torch.bfloat16, where)
            if layout != "contiguous":  # a wrong answer fails the same check
                wrong = [dr.unshard_sequence(x, mesh, dim=2, layout="contiguous") for x in got]
                with pytest.raises(AssertionError):
                    check_ratios(ratios(wrong, single, reference), torch.bfloat16, where)


def test_windowed_schedules_on_gpus_match_float64():
    run_on_gpus(min(torch.cuda.device_count(), 4), _ranks)
