"""The ring exchange: K/V pass to the next rank W-1 times; the layout says what each step computes.

Used by the ``ring`` (contiguous), ``zigzag`` and ``stripe`` schedules; their block grids are drawn in
``layouts/``. At step t rank r holds the K/V of rank src = (r - t) mod W.

Forward, per step: post the send of the K/V held (K and V stacked: one message) to rank r+1 and the
receive of the next from rank r-1, compute this step's blocks, merge them into the fp32 (out, lse),
then wait for the next K/V.

Backward, per step: the same K/V pass, plus an fp32 dK/dV accumulator that travels *with* the K/V it
belongs to: each rank adds its blocks' dk/dv, then passes it on; after W hops it is home. dq stays
local in fp32. The accumulator's send is posted after this step's compute and waited on after the next
step's compute, so it overlaps too.
"""
import torch

from ..comm import Communicator
from ..layouts import Layout
from .base import add_grads_, attend_, block_grads, fp32_like, result_out


class RingPass:
    exchange = "ring"

    def __init__(self, name: str, layout: Layout):
        self.name, self.layout = name, layout

    def _blocks(self, comm, step, local_len, is_causal):
        src = (comm.rank - step) % comm.world_size
        blocks = self.layout.ring_blocks(local_len, comm.rank, src, comm.world_size, is_causal)
        # The accumulator starts from step 0's block (the rank's own K/V), which covers every row.
        assert step or (len(blocks) == 1 and blocks[0].q == slice(0, local_len))
        return blocks

    def forward(self, comm: Communicator, q, k, v, *, is_causal, scale, kernel):
        world, local_len = comm.world_size, q.shape[2]
        out, lse = fp32_like(q), fp32_like(q, q.shape[:3])
        kv = torch.stack([k, v])
        for step in range(world):
            pending = comm.send_recv_next(kv) if step < world - 1 else None
            for block in self._blocks(comm, step, local_len, is_causal):
                attend_(kernel, q, kv[0], kv[1], block, scale, out, lse, fresh=step == 0)
            if pending is not None:
                kv = pending.wait()
        return result_out(out, q, kernel), lse

    def backward(self, comm: Communicator, dout, q, k, v, out, lse, *, is_causal, scale, kernel):
        world, local_len = comm.world_size, q.shape[2]
        dq = fp32_like(q)
        kv = torch.stack([k, v])
        pending_dkv = None
        for step in range(world):
            pending_kv = comm.send_recv_next(kv) if step < world - 1 else None
            blocks = self._blocks(comm, step, local_len, is_causal)
            grads = [block_grads(kernel, dout, q, kv[0], kv[1], out, lse, block, scale)
                     for block in blocks]
            # Wait for the travelling accumulator only now, so its transfer overlapped the compute.
            dkv = fp32_like(kv) if pending_dkv is None else pending_dkv.wait()
            for block, block_grad in zip(blocks, grads):
                add_grads_(block, block_grad, dq, dkv[0], dkv[1])
            pending_dkv = comm.send_recv_next(dkv)
            if pending_kv is not None:
                kv = pending_kv.wait()
        dkv = pending_dkv.wait()  # this rank's own dK/dV, home after W hops
        # copy=True: dk and dv must not alias (one buffer) even when no cast is needed.
        return dq.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)
