"""The ring shift on the copy engines (``dtensor_ring/comm/peer_copy.py``; two or more GPUs of one
host, skipped otherwise).

On W = min(GPUs, 4) NCCL ranks, the ring schedules (ring, zigzag, stripe: the ones that shift
K/V and dK/dV to the next rank) in fp32 and exact, eagerly and zigzag compiled, run once through
the copy engines (the default) and once through NCCL's send/recv (``DTENSOR_RING_PEER_COPY=0``,
on a second process group): both must match float64 within the usual tolerance of the single-GPU
kernel's error, and the forward's output must be the same bits either way. A second, longer
sequence grows the arena. The check is shown to fail on a wrong answer: the result unsharded in
the wrong layout.
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import dtensor_ring as dr
from dtensor_ring.comm import peer_copy
from dtensor_ring.tools.numerics import attention_and_grads, check_ratios, make_inputs, ratios, sdpa
from dist_utils import run_on_gpus

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs several GPUs")

RUNS = [(s, p, False) for s in ("ring", "zigzag", "stripe") for p in ("fp32", "exact")]
RUNS.append(("zigzag", "fp32", True))


def _results(mesh, schedule, precision, compiled, bf16):
    def ring(a, b, c):
        return dr.ring_attention(a, b, c, mesh=mesh, schedule=schedule, is_causal=True,
                                 precision=precision)
    fn = torch.compile(ring, fullgraph=True) if compiled else ring
    layout = dr.SCHEDULE_LAYOUT[schedule]
    shards = [dr.shard_sequence(x, mesh, dim=2, layout=layout) for x in bf16]
    return [x.contiguous() for x in attention_and_grads(fn, *shards, torch.bfloat16)]


def _ranks(rank, world):
    copies = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    nccl = DeviceMesh.from_group(dist.new_group(list(range(world))), "cuda")
    for tokens in (1024, 2048):  # the second grows the arena
        q, k, v, dout = (x.cuda() for x in make_inputs(1, 8, 4, tokens * world, 128))
        bf16 = [x.bfloat16() for x in (q, k, v, dout)]
        reference = attention_and_grads(sdpa(True), q, k, v, dout, torch.float64)
        single = attention_and_grads(sdpa(True), q, k, v, dout, torch.bfloat16)
        for schedule, precision, compiled in RUNS:
            where = f"rank {rank}: {tokens} tokens, {schedule} {precision} compiled={compiled}"
            got = _results(copies, schedule, precision, compiled, bf16)
            os.environ[peer_copy.ENV] = "0"  # read when a group first shifts
            try:
                sent_by_nccl = _results(nccl, schedule, precision, compiled, bf16)
            finally:
                del os.environ[peer_copy.ENV]
            # The forward kernels are deterministic; cuDNN's backward need not be, so the
            # gradients are held to the reference below, not to NCCL's bits.
            assert torch.equal(got[0], sent_by_nccl[0]), f"{where}: out differs from NCCL's"
            layout = dr.SCHEDULE_LAYOUT[schedule]
            whole = [dr.unshard_sequence(x, copies, dim=2, layout=layout) for x in got]
            check_ratios(ratios(whole, single, reference), torch.bfloat16, where)
            if layout != "contiguous":  # a wrong answer fails the same check
                wrong = [dr.unshard_sequence(x, copies, dim=2, layout="contiguous")
                         for x in got]
                with pytest.raises(AssertionError):
                    check_ratios(ratios(wrong, single, reference), torch.bfloat16, where)
        ring = peer_copy._RINGS[dist.group.WORLD.group_name]
        assert ring is not None, f"rank {rank}: the copy engines were not used"
        assert peer_copy._RINGS[nccl.get_group().group_name] is None
        # the largest message: exact's fp32 dK and dV of a rank's rows
        assert ring.arena.numel() >= 2 * 4 * tokens * 128 * 4


def test_copy_engine_shift_matches_nccl_and_float64():
    world = min(torch.cuda.device_count(), 4)
    run_on_gpus(world, _ranks)
