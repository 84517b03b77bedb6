r"""Which global tokens rank (i, j) of a 2-D context-parallel mesh holds: the outer layout over the
outer ranks, each outer shard cut in contiguous sub-chunks over the inner ranks.

Outer rank i of O holds the tokens the outer schedule's layout gives rank i of O ranks (its outer
shard, O_i: S / O tokens in that layout's order); inner rank j of I holds the j-th contiguous
sub-chunk of S / (O I) tokens of O_i. Flat rank i I + j (``SequenceMesh.rank``) orders all ranks:
shards concatenated in flat-rank order are the outer layout's rank-major order.

S = 16, zigzag over O = 2 (chunks of 4: outer rank 0 holds chunks 0 and 3, outer rank 1 chunks 1
and 2), I = 2:

    global token     0  1  2  3 | 4  5  6  7 | 8  9 10 11 |12 13 14 15
    outer shard      O_0         | O_1         | O_1         | O_0
    rank (0, 0)      0  1  2  3                                              (O_0's first half)
    rank (0, 1)                                              12 13 14 15     (O_0's second half)
    rank (1, 0)                    4  5  6  7                                (O_1's first half)
    rank (1, 1)                                  8  9 10 11                  (O_1's second half)

Why contiguous sub-chunks: the all-to-all hands each inner rank its head group of *every* token
of O_i, in inner-rank order, so with contiguous sub-chunks what arrives is O_i in the outer
layout's order -- the outer schedule's input as it is, no permutation (``heads.py``). The
attention's balance is the outer layout's alone: after the all-to-all every inner rank of outer
rank i attends all of O_i (its head group), whatever the sub-chunks hold, and every rank holds
S / (O I) tokens for the rest of the model. Per-chunk halves (zigzag's two chunks each split over
the inner ranks) would balance nothing more and make the all-to-all's result need a permutation.
For a contiguous outer layout (schedule ``ring``) this is DTensor's own ``(Shard(2), Shard(2))``.

Packed documents: the outer layout's per-document form over the O outer ranks (zigzag cuts each
document in 2 O chunks: documents need lengths that are multiples of 2 O, not 2 O I), then the
contiguous cut, which may split a document between inner ranks, and need not respect documents:
the all-to-all puts O_i back together before any attention.
"""
import torch

from ..layouts import Layout


class HybridLayout(Layout):
    """``outer`` over ``outer_size`` ranks, each outer shard cut contiguously over ``inner_size``;
    ``positions`` and the length checks take the flat rank and the whole mesh's size."""

    def __init__(self, outer: Layout, outer_size: int, inner_size: int):
        self.outer, self.outer_size, self.inner_size = outer, outer_size, inner_size
        self.name = outer.name

    def _check_world(self, world_size: int) -> None:
        assert world_size == self.outer_size * self.inner_size, (world_size, self.outer_size,
                                                                  self.inner_size)

    def placement_world(self, world_size: int) -> int:
        self._check_world(world_size)
        return self.outer_size

    def document_multiple(self, world_size: int) -> int:
        self._check_world(world_size)
        return self.outer.document_multiple(self.outer_size)

    def check_local_len(self, local_len: int, arg: str = "local sequence length") -> None:
        if local_len < 1:
            raise ValueError(f"{arg}={local_len} must be at least 1")
        self.outer.check_local_len(local_len * self.inner_size,
                                   f"{arg} x all-to-all size {self.inner_size}")

    def check_global_len(self, seq_len: int, world_size: int, arg: str = "seq_len") -> None:
        self._check_world(world_size)
        if seq_len % world_size:
            raise ValueError(
                f"{arg}={seq_len} is not divisible by the mesh size {world_size} "
                f"({self.outer_size} ring x {self.inner_size} all-to-all ranks)")
        self.outer.check_global_len(seq_len, self.outer_size, arg)

    def positions(self, local_len: int, rank: int, world_size: int, docs=None) -> torch.Tensor:
        self._check_world(world_size)
        outer_rank, inner_rank = divmod(rank, self.inner_size)
        shard = self.outer.positions(local_len * self.inner_size, outer_rank, self.outer_size,
                                     docs)
        return shard[inner_rank * local_len:(inner_rank + 1) * local_len]


def placed_layout(layout: Layout, outer_size: int, inner_size: int) -> Layout:
    """``layout`` on a mesh of ``outer_size`` x ``inner_size`` ranks (itself on a 1-D one)."""
    return layout if inner_size == 1 else HybridLayout(layout, outer_size, inner_size)
