"""Attention of a query shard against key/value replicated in full: no communication at all.

The query rows are rank r's tokens in the sequence dimension's layout; key/value are the whole
sequence in natural order. Non-causal, the rows are independent: one kernel call. Causal, each
rank's view of the keys is cut into the W layout shards and attended in ring order with the same
blocks the ring would compute (``layouts/``), merged in fp32: the ring with the exchange replaced
by indexing. Key/value gradients are this rank's share of the sum over ranks (DTensor ``Partial``;
in fp32 from an exact kernel, which the caller sums before rounding). A sliding window takes the
windowed ring's blocks (``schedules/windowed.py``): only the keys within reach are indexed.
"""
import torch

from ..kernels.base import NONE
from ..layouts import Layout
from ..schedules.base import RowSums, attend_, block_backward, fp32_empty, result_out
from ..schedules.windowed import dense_pairs


def _shards(layout: Layout, local_len: int, rank: int, world: int, device, is_causal, window,
            kernel):
    """(positions of the keys src's blocks read, the blocks) in ring order, starting with this
    rank's own; the first block of the own covers every row."""
    pairs = None if window is None else dense_pairs(layout.name, local_len, world, is_causal,
                                                    window, tuple(kernel.masks))
    for step in range(world):
        src = (rank - step) % world
        positions = layout.positions(local_len, src, world).to(device)
        if pairs is None:
            yield positions, layout.ring_blocks(local_len, rank, src, world, True)
        elif pairs[rank][src] is not None:
            rows, blocks = pairs[rank][src][:2]
            yield positions[rows], blocks


def local_forward(q, k, v, *, layout, rank, world, is_causal, scale, kernel, window=None):
    if not is_causal and window is None:
        return kernel.forward(q, k, v, NONE, scale)
    local_len = q.shape[2]
    out, lse = fp32_empty(q), fp32_empty(q, q.shape[:3])
    fresh = True  # the own blocks' first covers every row (so do the diagonal blocks' together)
    for index, blocks in _shards(layout, local_len, rank, world, q.device, is_causal, window,
                                 kernel):
        ks, vs = k.index_select(2, index), v.index_select(2, index)
        written = []
        for block in blocks:
            attend_(kernel, q, ks, vs, block, scale, out, lse,
                    fresh=fresh and not _overlaps(block.q, written))
            written.append(block.q)
        fresh = False
    return result_out(out, q, kernel), lse


def _overlaps(rows: slice, written: list) -> bool:
    return any(rows.start < w.stop and w.start < rows.stop for w in written)


def local_backward(dout, q, k, v, out, lse, *, layout, rank, world, is_causal, scale, kernel,
                   window=None):
    if not is_causal and window is None:
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, NONE, scale)
        return dq.to(q.dtype), *_shares(kernel, k, dk, dv)  # exact kernels give fp32
    local_len = q.shape[2]
    dq = RowSums(fp32_empty(q))
    dk, dv = (x.new_zeros(x.shape, dtype=torch.float32) for x in (k, v))
    for index, blocks in _shards(layout, local_len, rank, world, q.device, is_causal, window,
                                 kernel):
        ks, vs = k.index_select(2, index), v.index_select(2, index)
        dks, dvs = RowSums(fp32_empty(ks)), RowSums(fp32_empty(vs))
        for block in blocks:
            block_backward(kernel, dout, q, ks, vs, out, lse, block, scale, dq, dks, dvs)
        dk.index_add_(2, index, dks.result())
        dv.index_add_(2, index, dvs.result())
    return dq.result().to(q.dtype), *_shares(kernel, k, dk, dv)


def _shares(kernel, k, dk, dv):
    """This rank's shares of dk and dv, to be summed over ranks: in fp32 from an exact kernel
    (the caller sums, then rounds once), else in the input dtype."""
    return (dk, dv) if kernel.exact else (dk.to(k.dtype), dv.to(k.dtype))
