r"""Contiguous layout: rank r holds global tokens [r*S, (r+1)*S).

Causal ring blocks, W = 4 (rows: rank holding q; columns: src of the K/V held this step):

            src 0   src 1   src 2   src 3
    rank 0   \       .       .       .        \ = causal (diagonal block)
    rank 1   #       \       .       .        # = full block
    rank 2   #       #       \       .        . = nothing to compute
    rank 3   #       #       #       \

Rank 3 computes W blocks while rank 0 computes one: simple but unbalanced (see zigzag, stripe).
"""
import torch

from .base import Block, Layout


class Contiguous(Layout):
    name = "contiguous"

    def positions(self, local_len, rank, world_size):
        return torch.arange(rank * local_len, (rank + 1) * local_len)

    def causal_ring_blocks(self, local_len, rank, src, world_size):
        everything = slice(0, local_len)
        if src == rank:
            return [Block(everything, everything, "causal")]
        if src < rank:
            return [Block(everything, everything, "none")]
        return []


CONTIGUOUS = Contiguous()
