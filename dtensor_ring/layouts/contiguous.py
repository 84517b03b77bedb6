r"""Contiguous layout: rank r holds global tokens [r*S, (r+1)*S).

Causal ring blocks, W = 4 (rows: rank holding q; columns: src of the K/V held this step):

            src 0   src 1   src 2   src 3
    rank 0   \       .       .       .        \ = causal (diagonal block)
    rank 1   #       \       .       .        # = full block
    rank 2   #       #       \       .        . = nothing to compute
    rank 3   #       #       #       \

Rank 3 computes W blocks while rank 0 computes one: simple but unbalanced (see zigzag, stripe).

Packed documents: the packed row is cut into W equal parts, so documents may cross ranks and need
no particular lengths. Rank r's piece of document d is [cu[d] - rS, cu[d+1] - rS) clipped to
[0, S); the blocks above become one varlen block each, whose segment d pairs rank r's piece of
document d with src's piece (an empty piece: a segment with no rows or no keys). Where the
boundaries are known on the host (given on the CPU), a step whose keys share no document with the
rank's rows is skipped: no kernel call.
"""
import torch

from .base import Layout, whole
from .blocks import Block, Segments
from .windows import Run


class Contiguous(Layout):
    name = "contiguous"

    def dense_positions(self, local_len, rank, world_size):
        return torch.arange(rank * local_len, (rank + 1) * local_len)

    def document_positions(self, local_len, rank, world_size, docs):
        return torch.arange(rank * local_len, (rank + 1) * local_len, device=docs.cu.device)

    def runs(self, local_len, rank, world_size):
        return [Run(0, local_len, rank * local_len, 1)]

    def causal_ring_blocks(self, local_len, rank, src, world_size):
        everything = slice(0, local_len)
        if src == rank:
            return [Block(everything, everything, "causal")]
        if src < rank:
            return [Block(everything, everything, "none")]
        return []

    def document_ring_blocks(self, local_len, rank, src, world_size, is_causal, docs):
        if is_causal and src > rank:
            return []
        if docs.host is not None and not _share_a_document(docs.host, local_len, rank, src):
            return []  # known on the host: this step's keys and rows share no document

        def pieces(holder):
            return docs.cached(("contiguous", local_len, holder), lambda: (
                docs.cu - holder * local_len).clamp(0, local_len).to(torch.int32))

        longest = min(docs.max_len, local_len)
        segments = Segments(pieces(rank), pieces(src), longest, longest)
        return [whole(local_len, "causal" if is_causal and src == rank else "none", segments)]


def _share_a_document(bounds: list[int], local_len: int, rank: int, src: int) -> bool:
    """Whether some document has tokens on both ``rank`` and ``src`` (host boundaries)."""
    def spans(holder):
        lo, hi = holder * local_len, (holder + 1) * local_len
        return {d for d, (a, b) in enumerate(zip(bounds, bounds[1:])) if a < hi and b > lo}
    return bool(spans(rank) & spans(src))


CONTIGUOUS = Contiguous()
