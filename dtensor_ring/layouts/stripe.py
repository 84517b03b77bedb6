r"""Stripe layout: rank r holds global tokens r, r+W, r+2W, ... (local index i is global i*W + r).

q row i (global iW + r) may see k row j of rank src (global jW + src) iff jW + src <= iW + r, that is
j < i, or j == i and src <= r. So each causal ring step is one near-square block:

    src <= rank : q x k causal (j <= i)
    src >  rank : q[1:] x k[:-1] causal (j <= i - 1); q row 0 sees nothing this step

W = 2, S_local = 3; global token numbers in the cells' row/column labels:

                  rank 0 k: 0 2 4    rank 1 k: 1 3 5
    rank 0  q 0             \ . .              . . .     src 1 > rank 0: shifted by one
            q 2             # \ .              \ . .
            q 4             # # \              # \ .
    rank 1  q 1             \ . .              \ . .     src 0 <= rank 1: plain causal
            q 3             # \ .              # \ .
            q 5             # # \              # # \

Every rank does the same work at every step, and blocks need no half-size kernels.
"""
import torch

from .base import Block, Layout


class Stripe(Layout):
    name = "stripe"

    def positions(self, local_len, rank, world_size):
        return torch.arange(local_len) * world_size + rank

    def causal_ring_blocks(self, local_len, rank, src, world_size):
        if src <= rank:
            return [Block(slice(0, local_len), slice(0, local_len), "causal")]
        if local_len == 1:
            return []
        return [Block(slice(1, local_len), slice(0, local_len - 1), "causal")]


STRIPE = Stripe()
