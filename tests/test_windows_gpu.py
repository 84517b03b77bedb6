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
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ring.tools.numerics import attention_and_grads, make_inputs
from dist_utils import run_on_gpus
from test_peer_copy import check_whole, results
from test_windows import windowed_sdpa

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs several GPUs")

TOKENS = 1024  # per rank: zigzag chunks of 512
LEFTS = (255, 511, 767)  # a window of 256, 512 (a chunk) and 768 tokens
RUNS = [("ring", "fp32", False), ("zigzag", "fp32", False), ("zigzag", "exact", False),
        ("zigzag", "fp32", True)]


def _ranks(rank, world):
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    q, k, v, dout = (x.cuda() for x in make_inputs(1, 8, 4, TOKENS * world, 128))
    bf16 = [x.bfloat16() for x in (q, k, v, dout)]
    for left in LEFTS:
        sdpa = windowed_sdpa(True, (left, 0))
        reference = attention_and_grads(sdpa, q, k, v, dout, torch.float64)
        single = attention_and_grads(sdpa, q, k, v, dout, torch.bfloat16)
        for schedule, precision, compiled in RUNS:
            where = f"rank {rank}: window ({left}, 0), {schedule} {precision} compiled={compiled}"
            got = results(mesh, schedule, precision, compiled, bf16, window=(left, 0))
            check_whole(got, mesh, schedule, single, reference, where)


def test_windowed_schedules_on_gpus_match_float64():
    run_on_gpus(min(torch.cuda.device_count(), 4), _ranks)
