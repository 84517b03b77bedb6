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
  [I, S, B, h, D] (one copy, from any strides of its input; several tensors of one dtype side by
  side along h, one message); the receiver's [I, S, B, h, D] is the outer shard's
  [I S, B, h, D], viewed as [B, h, I S, D] without a copy (for B = 1 and one tensor that is the
  [B, S, H, D] memory a model's q usually has; q, k and v together are head slices of it);
* heads -> sequence (out, lse; dq, dk, dv): the sender packs [I, B, h, S, D] (one copy; dq, dk
  and dv side by side along h); the receiver writes each piece into its [B, H, S, D] result (one
  copy: the pieces of a head group interleave with the other groups' heads there).
"""
from dataclasses import dataclass

import torch

from ..comm import sum_in_rank_order

# Pieces per head group. With two, only the first piece's inputs and the last piece's output wait
# on the all-to-all (schedule.py), but each piece runs the whole outer schedule: twice its host
# time and its outer messages (of half the size). On 4 H200s (2 x 2, zigzag, 32/8 heads, one
# lease) one piece was the faster: fwd / fwd+bwd 4.55 / 16.65 ms against 5.16 / 18.13 at 8K tokens
# per GPU (steady state 4.17 / 16.49 against 4.19 / 16.59), 2.47 / 7.78 against 5.03 / 12.44 at
# 4K (1.33 / 4.97 against 1.41 / 5.86): the all-to-all over NVLink costs less than the host time
# of a second pass. The pipelined path stays for a caller that passes chunks (tests pin 2).
DEFAULT_CHUNKS = 1


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


def to_heads(sources, split: HeadSplit, chunk: int) -> torch.Tensor:
    """The all-to-all's send buffer for ``sources`` ((x [B, H, S, D] of this rank's tokens, kv)
    pairs, one dtype and head dim), piece ``chunk``: [I, S, B, h_1 + h_2 + ..., D], row g for
    inner rank g, each x's heads beside the last's (one message for all: a collective's host time
    and handshake are paid once). One copy of each."""
    widths = [split.piece(kv) for _, kv in sources]
    batch, _, length, dim = sources[0][0].shape
    buffer = sources[0][0].new_empty(split.inner, length, batch, sum(widths), dim)
    for (x, kv), dest in zip(sources, buffer.split(widths, dim=3)):
        if kv and split.repeat > 1:  # one key/value head per rank: head g // repeat for rank g
            per_head = dest.unflatten(0, (split.kv_heads, split.repeat))  # [Hkv, r, S, B, 1, D]
            per_head.copy_(x.permute(1, 2, 0, 3)[:, None, :, :, None, :])
        else:
            pieces = x.unflatten(1, (split.inner, split.chunks, split.piece(kv)))[:, :, chunk]
            dest.copy_(pieces.permute(1, 3, 0, 2, 4))
    return buffer


def heads_of(received: torch.Tensor, widths: list[int]) -> tuple:
    """What a ``to_heads`` buffer arrives as ([I, S, B, h_1 + ..., D], row j from inner rank j) as
    this rank's head pieces of the outer shard, each [B, h_i, I S, D]: views."""
    inner, length, batch, heads, dim = received.shape
    whole = received.view(inner * length, batch, heads, dim).permute(1, 2, 0, 3)
    return whole.split(widths, dim=1)


def to_sequence(ys, inner: int) -> torch.Tensor:
    """The all-to-all's send buffer for ``ys`` (each [B, h_i, I S, ...], head pieces of the outer
    shard, one dtype and trailing dims): [I, B, h_1 + h_2 + ..., S, ...], row j for inner rank j
    (its tokens). One copy of each."""
    first = ys[0]
    batch, _, seq, *rest = first.shape
    buffer = first.new_empty(inner, batch, sum(y.shape[1] for y in ys), seq // inner, *rest)
    for y, dest in zip(ys, buffer.split([y.shape[1] for y in ys], dim=2)):
        dest.copy_(y.unflatten(2, (inner, seq // inner)).movedim(2, 0))
    return buffer


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
