r"""Zigzag layout: the sequence is cut into 2W chunks of S/2 tokens; rank r holds chunks r and 2W-1-r.

Rank r's local tokens are [chunk r | chunk 2W-1-r], so every rank holds one early and one late chunk
and causal work is balanced. Causal ring blocks (a = first local half, b = second local half):

    src == rank : q[a b] x k[a b] causal        (chunk r < chunk 2W-1-r, so plain causal is right)
    src <  rank : q[a b] x k[a]   full          (chunk src precedes both q chunks; chunk 2W-1-src
                                                 follows both)
    src >  rank : q[b]   x k[a b] full          (only q chunk 2W-1-r is late enough, and it follows
                                                 both chunks src and 2W-1-src)

W = 2, chunks 0..3; rank 0 holds [0 3], rank 1 holds [1 2]:

                 k: 0  3 | 1  2
    rank 0  q 0     \  . | .  .        step src=0: causal      step src=1: q[b] x k[a b]
            q 3     #  \ | #  #
    rank 1  q 1     #  . | \  .        step src=1: causal      step src=0: q[a b] x k[a]
            q 2     #  . | #  \

Every off-diagonal step is one full block of S x S/2 (or S/2 x S) tokens: the same work on every rank.

Packed documents: the same per document (TransformerEngine's convention) for the documents long
enough to cut (``placement.py``: the others stay whole, each on one rank, and this grid applies
to the long part of the local rows, below): each document, of a length that is a multiple of 2W,
is cut into 2W chunks of c = length / 2W, and rank r holds chunks
r and 2W-1-r of every document, documents in order, so document d's local rows are
[o, o') = [cu[d] / W, cu[d+1] / W), its a part [o, o+c) and its b part [o+c, o'). Each step is
one varlen block over all local rows; its per-document blocks are the ones above, as segments,
with empty segments where a part takes no part, so that q rows and key rows stay packed:

    step         segments of document d (q rows | key rows)
    src == rank  [o, o') | [o, o')  causal
    src <  rank  [o, o') | [o, o+c)  full,   then  none | [o+c, o')      (b keys: seen by no one)
    src >  rank  [o, o+c) | none,             then  [o+c, o') | [o, o')  full
"""
import torch

from .base import Layout, doc_index, local_bounds, pairs, whole
from .blocks import Block, Segments
from .windows import Run


class Zigzag(Layout):
    name = "zigzag"
    places_documents = True  # the long documents as below, the short ones whole

    def document_multiple(self, world_size):
        return 2 * world_size

    def check_local_len(self, local_len, arg="local sequence length"):
        if local_len < 2 or local_len % 2:
            raise ValueError(
                f"{arg}={local_len} must be even (and at least 2) for layout 'zigzag', "
                "which holds two chunks per rank")

    def check_global_len(self, seq_len, world_size, arg="seq_len"):
        if seq_len % (2 * world_size):
            raise ValueError(
                f"{arg}={seq_len} is not divisible by 2 * mesh size = {2 * world_size}, "
                "as layout 'zigzag' needs")

    def dense_positions(self, local_len, rank, world_size):
        half = local_len // 2
        first = torch.arange(rank * half, (rank + 1) * half)
        late = 2 * world_size - 1 - rank
        return torch.cat([first, torch.arange(late * half, (late + 1) * half)])

    def runs(self, local_len, rank, world_size):
        half = local_len // 2
        return [Run(0, half, rank * half, 1), Run(half, half, (2 * world_size - 1 - rank) * half, 1)]

    def document_positions(self, local_len, rank, world_size, docs):
        bounds = local_bounds(docs, world_size)
        doc, j = doc_index(bounds, local_len)
        chunk = (bounds[1:] - bounds[:-1]).long()[doc] // 2
        late = 2 * world_size - 1 - rank
        within = torch.where(j < chunk, rank * chunk + j, late * chunk + j - chunk)
        return docs.cu.long()[doc] + within

    def causal_ring_blocks(self, local_len, rank, src, world_size):
        half = local_len // 2
        everything, first, second = slice(0, local_len), slice(0, half), slice(half, local_len)
        if src == rank:
            return [Block(everything, everything, "causal")]
        if src < rank:
            return [Block(everything, first, "none")]
        return [Block(second, everything, "none")]

    def document_ring_blocks(self, local_len, rank, src, world_size, is_causal, docs):
        bounds = local_bounds(docs, world_size)
        longest = docs.max_len // world_size  # a document's local rows; its chunks: half that
        if not is_causal or src == rank:
            mask = "causal" if is_causal else "none"
            return [whole(local_len, mask, Segments(bounds, bounds, longest, longest))]
        starts, stops = bounds[:-1], bounds[1:]  # views: the device work is in the lambdas

        def mids():
            return starts + (stops - starts) // 2

        if src < rank:
            cu_q, cu_k = docs.cached(("zigzag_early_keys", world_size), lambda: (
                pairs(starts, stops, last=bounds[-1]), pairs(starts, mids(), last=bounds[-1])))
            return [whole(local_len, "none", Segments(cu_q, cu_k, longest, longest // 2))]
        cu_q, cu_k = docs.cached(("zigzag_late_rows", world_size), lambda: (
            pairs(starts, mids(), last=bounds[-1]), pairs(starts, starts, last=bounds[-1])))
        return [whole(local_len, "none", Segments(cu_q, cu_k, longest // 2, longest))]


ZIGZAG = Zigzag()
