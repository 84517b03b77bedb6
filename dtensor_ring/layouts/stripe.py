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

Packed documents: the same per document, for the documents long enough to cut (``placement.py``:
the others stay whole, each on one rank; this applies to the long part of the local rows), each
of length a multiple of W: rank r holds tokens
r, r+W, ... of every document (documents in order), so document d's local rows are
[cu[d] / W, cu[d+1] / W). src <= rank: one causal segment per document. src > rank: the shifted
block per document, as three segments, so that the q rows and key rows stay packed:

    document d's local rows [o, o')    q rows     key rows
    segment 1                          [o, o+1)   none          (row 0 sees nothing)
    segment 2                          [o+1, o')  [o, o'-1)     causal
    segment 3                          none       [o'-1, o')    (the last key: no row sees it)
"""
import torch

from .base import Layout, doc_index, local_bounds, pairs, whole
from .blocks import Block, Segments
from .windows import Run


class Stripe(Layout):
    name = "stripe"
    places_documents = True  # the long documents as below, the short ones whole

    def document_multiple(self, world_size):
        return world_size

    def dense_positions(self, local_len, rank, world_size):
        return torch.arange(local_len) * world_size + rank

    def document_positions(self, local_len, rank, world_size, docs):
        bounds = local_bounds(docs, world_size)
        doc, j = doc_index(bounds, local_len)
        return docs.cu.long()[doc] + j * world_size + rank

    def runs(self, local_len, rank, world_size):
        return [Run(0, local_len, rank, world_size)]

    def causal_ring_blocks(self, local_len, rank, src, world_size):
        if src <= rank:
            return [Block(slice(0, local_len), slice(0, local_len), "causal")]
        if local_len == 1:
            return []
        return [Block(slice(1, local_len), slice(0, local_len - 1), "causal")]

    def document_ring_blocks(self, local_len, rank, src, world_size, is_causal, docs):
        bounds = local_bounds(docs, world_size)
        longest = docs.max_len // world_size
        if not is_causal or src <= rank:
            mask = "causal" if is_causal else "none"
            return [whole(local_len, mask, Segments(bounds, bounds, longest, longest))]
        starts, stops = bounds[:-1], bounds[1:]
        # (clamped: a document with no rows here -- the placement's, traced -- has empty ones)
        cu_q, cu_k = docs.cached(("stripe_shifted", world_size), lambda: (
            pairs(starts, torch.minimum(starts + 1, stops), stops, last=bounds[-1]),
            pairs(starts, starts, torch.maximum(stops - 1, starts), last=bounds[-1])))
        return [whole(local_len, "causal", Segments(cu_q, cu_k, longest, longest))]


STRIPE = Stripe()
