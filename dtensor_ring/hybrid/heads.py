"""The all-to-all's buffers: a rank's tokens of every head <-> its head group's heads of every token.

Before attention, inner rank j of I holds all heads of its S tokens, [B, H, S, D]; after the
all-to-all it holds head group j -- query heads [j H/I, (j+1) H/I) and their key/value heads --
of the I * S tokens of its outer shard, [B, H/I, I S, D], inner ranks' tokens in rank order (which
is the outer shard's order: ``layout.py``). The output and the gradients go back the other way.

Head groups travel in ``chunks`` pieces (``HeadSplit.chunks``): the schedule posts the next
piece's all-to-all before it attends the current one (``schedule.py``).

Key/value heads (GQA, ``Hq = r Hkv``):

* ``Hkv % I == 0``: each inner rank gets Hkv / I of them, the ones its query heads use; nothing
  travels twice.
* ``I % Hkv == 0`` (fewer key/value heads than inner ranks): query group j uses one key/value
  head, j // (I / Hkv); each key/value head goes to the I / Hkv ranks that use it (the least a
  rank that attends it can receive), and their dk/dv shares are summed on the way back, in fp32 in
  rank order, then rounded once (each share is rounded to the input dtype by the outer schedule
  first, so exact mode's error grows with I / Hkv there; with ``Hkv % I == 0`` it does not).
* neither: a ValueError (a query group would need parts of two key/value heads).

Memory layouts, chosen so that the side that receives needs no copy where it can avoid one:

* sequence -> heads (q, k, v; dout, out and lse in the backward): the sender packs
  [I, S, B, h, D] (one copy, from any strides of its input); the receiver's [I, S, B, h, D] is the
  outer shard's [I S, B, h, D], viewed as [B, h, I S, D] without a copy (for B = 1 that is the
  [B, S, H, D] memory a model's q usually has);
* heads -> sequence (out, lse; dq, dk, dv): the sender packs [I, B, h, S, D] (one copy); the
  receiver writes each piece into its [B, H, S, D] result (one copy: the pieces of a head group
  interleave with the other groups' heads there).
"""
from dataclasses import dataclass

import torch

from ..comm import sum_in_rank_order

# Pieces per head group: only the first piece's inputs and the last piece's output wait on the
# all-to-all (schedule.py); more pieces would hide more but send more, smaller outer messages.
DEFAULT_CHUNKS = 2


@dataclass(frozen=True)
class HeadSplit:
    """How q_heads / kv_heads split over ``inner`` ranks and ``chunks`` pieces per rank."""

    inner: int
    q_heads: int
    kv_heads: int
    chunks: int

    @property
    def repeat(self) -> int:
        """Ranks that receive each key/value head (1: every one goes to one rank)."""
        return self.inner // self.kv_heads if self.kv_heads < self.inner else 1

    def piece(self, kv: bool) -> int:
        """Heads per piece of one rank's head group."""
        group = (max(self.kv_heads // self.inner, 1) if kv else self.q_heads // self.inner)
        return group // self.chunks


def head_split(q_heads: int, kv_heads: int, inner: int, chunks: int | None = None) -> HeadSplit:
    """The split of ``q_heads`` / ``kv_heads`` over ``inner`` ranks; ValueError naming what cannot
    split. ``chunks``: pieces per head group (default: up to ``DEFAULT_CHUNKS``, as many as the
    rank's key/value heads allow)."""
    if q_heads % inner:
        raise ValueError(
            f"query heads ({q_heads}) are not divisible by the all-to-all (inner) mesh dimension "
            f"size {inner}: every inner rank attends an equal group of heads; use an inner size "
            f"that divides {q_heads}")
    if kv_heads % inner and inner % kv_heads:
        raise ValueError(
            f"key/value heads ({kv_heads}) neither divide nor are divisible by the all-to-all "
            f"(inner) mesh dimension size {inner}: a group of query heads would need parts of "
            f"two key/value heads; use an inner size that divides {kv_heads} or a multiple of it")
    kv_group = max(kv_heads // inner, 1)
    if chunks is None:
        chunks = max(c for c in range(1, DEFAULT_CHUNKS + 1) if kv_group % c == 0)
    elif kv_group % chunks:
        raise ValueError(f"chunks={chunks} must divide the key/value heads per inner rank "
                         f"({kv_group})")
    return HeadSplit(inner, q_heads, kv_heads, chunks)


def to_heads(x: torch.Tensor, split: HeadSplit, chunk: int, kv: bool = False) -> torch.Tensor:
    """The all-to-all's send buffer for ``x`` [B, H, S, D] (this rank's tokens), piece ``chunk``:
    [I, S, B, h, D], row g for inner rank g; one copy."""
    batch, heads, length, dim = x.shape
    if kv and split.repeat > 1:  # one key/value head per rank: head g // repeat for rank g
        expanded = x.permute(1, 2, 0, 3).unsqueeze(1).expand(heads, split.repeat, length, batch,
                                                              dim)
        return expanded.contiguous().view(split.inner, length, batch, 1, dim)
    pieces = x.unflatten(1, (split.inner, split.chunks, split.piece(kv)))[:, :, chunk]
    return pieces.permute(1, 3, 0, 2, 4).contiguous()


def heads_of(received: torch.Tensor) -> torch.Tensor:
    """What ``to_heads`` buffers arrive as ([I, S, B, h, D], row j from inner rank j) as this
    rank's head piece of the outer shard, [B, h, I S, D]: a view."""
    inner, length, batch, heads, dim = received.shape
    return received.view(inner * length, batch, heads, dim).permute(1, 2, 0, 3)


def to_sequence(y: torch.Tensor, inner: int) -> torch.Tensor:
    """The all-to-all's send buffer for ``y`` [B, h, I S, ...] (a head piece of the outer shard):
    [I, B, h, S, ...], row j for inner rank j (its tokens)."""
    return y.unflatten(2, (inner, y.shape[2] // inner)).movedim(2, 0).contiguous()


def sequence_into_(target: torch.Tensor, received: torch.Tensor, split: HeadSplit, chunk: int,
                   kv: bool = False) -> None:
    """Write what ``to_sequence`` buffers arrive as ([I, B, h, S, ...], row g from inner rank g)
    into ``target`` [B, H, S, ...] (this rank's tokens), piece ``chunk``; dk/dv of key/value
    heads that several ranks used are summed in fp32, in rank order (the module docstring)."""
    if kv and split.repeat > 1:
        shares = received.squeeze(2).unflatten(0, (split.kv_heads, split.repeat)).movedim(1, 0)
        target.copy_(sum_in_rank_order(shares.float()).movedim(0, 1))
        return
    group = target.unflatten(1, (split.inner, split.chunks, split.piece(kv)))[:, :, chunk]
    group.copy_(received.movedim(0, 1))
