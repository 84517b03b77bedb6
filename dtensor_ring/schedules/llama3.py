"""The Llama 3 schedule: zigzag layout, K/V all-gathered in groups of KV heads.

Each rank gathers the whole K/V of a group of KV heads (post the next group's all-gather before
computing this one, so the two overlap; two groups in flight bound the memory) and computes its
two q chunks against the keys each may see. Groups are disjoint heads, so no merge is needed
across them. Two plans say which blocks, on which arrangement of the gathered K/V:

Zigzag chunks held by rank r: c0 = r and c1 = 2W-1-r. q chunk c sees the natural-order K of the
group up to the end of its own chunk (C = S_local / 2 tokens per chunk):

    k:      [0, cC)              [cC, (c+1)C)
    q c     full                 causal (diagonal)

``_NaturalOrder``: with a kernel that offers the bottom-right causal mask, the gathered chunks
put in natural order and one call per chunk, no merge; also non-causal (all q rows against all K,
one block) and packed documents (below).

``_OwnThenOthers``: causal, for a kernel without that mask (cuDNN; fp32 mode). The rank first
attends its own K/V, all heads in one causal call before any gather (zigzag's first step: both
diagonals, and chunk c1 seeing chunk c0); each group then adds the keys of the other ranks in two
non-causal calls, merged with the own block's result in one pass written over it (its out in q's
dtype: no fp32 out of every head, no cast):

    k (natural chunks):   0 .. r-1     r     r+1 .. 2W-2-r     2W-1-r     2W-r ..
    q chunk r             X            own   .                 .          .
    q chunk 2W-1-r        X            own   Y                 own        .

Y's keys are the whole shards of ranks r+1 .. W-1, X's the first halves of ranks 0 .. r-1; X is
empty on rank 0 and Y on rank W-1. That is 1 + 2 * groups kernel calls in the forward and
3 * groups in the backward (the own block per group there: see ``Llama3.backward``) where
per-chunk blocks took 4 * groups (each kernel call costs host time comparable to a block's
compute at the lengths context parallelism runs), and no natural order to build.

Backward: gather K/V again per group, compute dq (local: the group's block results summed in
fp32 in one pass, written in q's dtype) and dK/dV for the gathered keys in fp32, and
reduce-scatter that (fp32) back to the owners, overlapped with the next group; each owner adds
its own block's dK/dV to the share it receives in one pass written in k's dtype.
Groups: min(Hkv, W), so a gathered group is about the size of the local K/V.

Packed documents (``docs``): the messages are sequence-major, the gathered K/V go to natural order
in one gather of whole rows (documents are zigzagged one by one), and each q chunk kind is one
varlen block over every local row and the whole gathered sequence, bottom-right causal per
segment. For document d (local rows [o, o'),
chunks of c rows; natural keys [D, D')), with e = (r + 1) c and f = (2W - r) c keys seen:

    block A (chunk r, fresh):        [o, o+c) | [D, D+e)   then  none | [D+e, D')   then
                                     [o+c, o') | none      (those rows: out 0, LSE -inf)
    block B (chunk 2W-1-r, merged):  [o, o+c) | none   then  [o+c, o') | [D, D+f)   then
                                     none | [D+f, D')

Every row sees keys in exactly one of the two, so the merge of B into A just places B's rows.

A sliding window (``window``): ``_NaturalOrder`` for every kernel, each q chunk's block cut to the
keys within reach (``layouts/windows.py``: skipped keys, a band at the edges; with documents the
window as positions). The all-gather still moves every rank's K/V: ``schedule="auto"`` weighs that
against the ring schedules' windowed exchange (``schedules/__init__.py``).
"""
import torch

from ..comm import Communicator
from ..kernels.base import CAUSAL, CAUSAL_BOTTOM_RIGHT, NONE
from ..layouts import ZIGZAG, Block, Segments
from ..layouts.base import local_bounds, pairs
from ..layouts.boundaries import is_traced
from ..layouts.placement import exchanged_rows, placement_of, with_inert_tail
from ..layouts.windows import Run, band_block, with_positions
from ..merge import MAX_PARTS, accumulate_, merge_many_, sum_many_
from .base import (HeldSums, RowSums, attend_, backward_operands, block_backward, fp32_empty,
                   merge_target, result_out)
from ..kernels.words import as_words, copied, gathered_rows, stacked, zero_


def head_groups(kv_heads: int, world_size: int) -> list[slice]:
    count = min(kv_heads, world_size)
    bounds = [round(i * kv_heads / count) for i in range(count + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def to_natural(gathered: torch.Tensor) -> torch.Tensor:
    """[W, ..., S_local, D] gathered zigzag shards -> [..., W * S_local, D] in sequence order,
    in one pass: natural chunk r is rank r's first half, chunk 2W-1-r its second half."""
    world, half = gathered.shape[0], gathered.shape[-2] // 2
    (words,) = as_words(gathered)
    lead, width = words.shape[1:-2], words.shape[-1]
    halves = words.view(world, *lead, 2, half, width).movedim(0, -4)  # [..., W, 2, C, w]
    natural = words.new_empty(*lead, 2 * world, half, width)
    natural[..., :world, :, :].copy_(halves[..., 0, :, :])
    for rank in range(world):  # second halves in reverse rank order (torch has no negative strides)
        natural[..., 2 * world - 1 - rank, :, :].copy_(halves[..., rank, 1, :, :])
    return natural.view(*lead, 2 * world * half, width).view(gathered.dtype)


def to_rank_major(natural: torch.Tensor, world: int) -> torch.Tensor:
    """Inverse of ``to_natural``: [..., W * S_local, D] -> [W, ..., S_local, D], in one pass."""
    (words,) = as_words(natural)
    *lead, seq, width = words.shape
    half = seq // (2 * world)
    chunks = words.view(*lead, 2 * world, half, width)
    shards = words.new_empty(world, *lead, 2, half, width)
    halves = shards.movedim(0, -4)  # [..., W, 2, C, w]
    halves[..., 0, :, :].copy_(chunks[..., :world, :, :])
    for rank in range(world):
        halves[..., rank, 1, :, :].copy_(chunks[..., 2 * world - 1 - rank, :, :])
    return shards.view(world, *lead, 2 * half, width).view(natural.dtype)


def documents_to_natural(gathered: torch.Tensor, placement) -> torch.Tensor:
    """``to_natural`` with documents: [W, R, ...] gathered sequence-major messages (R the rows
    each rank sends, ``Placement.exchanged_rows``) -> [W * R, ...] in the order of the long
    documents (the rows past them after: ``Placement.gathered_positions``), in one gather of
    whole rows (measured: docs/design.md, "Measurements behind design choices")."""
    order = placement.docs.cached(
        ("llama3_natural_order", placement.world, placement.local_len),
        lambda: placement.gathered_positions(ZIGZAG).argsort())
    return gathered_rows(gathered.flatten(0, 1), order)


def documents_to_rank_major(natural: torch.Tensor, placement, world: int) -> torch.Tensor:
    """Inverse of ``documents_to_natural``: [W * R, ...] -> [W, R, ...], one gather of rows."""
    taken = gathered_rows(natural, placement.gathered_positions(ZIGZAG))
    return taken.view(world, -1, *taken.shape[1:])


def _document_blocks(rank, world, placement, is_causal):
    """(block, fresh) pairs with documents: the long documents' grid of the module docstring on
    the gathered long part (traced, past it inert: ``placement.with_inert_tail``), the first
    block fresh unless the short documents' block covered every row before it (traced)."""
    local_len = placement.exchanged_rows()
    if local_len == 0:
        return []
    blocks = _long_blocks(rank, world, local_len, is_causal, placement.long)
    if placement.known:
        return blocks
    return [(with_inert_tail(block, local_len, world * local_len), False)
            for block, _ in blocks]


def _long_blocks(rank, world, local_len, is_causal, docs):
    """(block, fresh) pairs of the long documents ``docs``, on ``local_len`` rows each."""
    rows, keys = slice(0, local_len), slice(0, world * local_len)
    bounds, starts = local_bounds(docs, world), docs.cu
    if not is_causal:
        segments = Segments(bounds, starts, docs.max_len // world, docs.max_len)
        return [(Block(rows, keys, NONE, segments), True)]

    def plans():
        o, d = bounds[:-1], starts[:-1]
        chunk = (bounds[1:] - o) // 2
        first = (pairs(o, o + chunk, o + chunk, last=bounds[-1]),
                 pairs(d, d + (rank + 1) * chunk, starts[1:], last=starts[-1]))
        second = (pairs(o, o + chunk, bounds[1:], last=bounds[-1]),
                  pairs(d, d, d + (2 * world - rank) * chunk, last=starts[-1]))
        return first, second

    first, second = docs.cached(("llama3_blocks", rank, world), plans)
    longest_chunk = docs.max_len // (2 * world)
    return [(Block(rows, keys, CAUSAL_BOTTOM_RIGHT, Segments(*first, longest_chunk, docs.max_len)),
             True),
            (Block(rows, keys, CAUSAL_BOTTOM_RIGHT, Segments(*second, longest_chunk,
                                                             docs.max_len)), False)]


class _NaturalOrder:
    """Each gathered group put in natural order (with documents through an index), and the
    blocks of the grids above on it: bottom-right causal per chunk, non-causal, documents. With
    documents, ``local`` is the block of the rank's short ones on its own K/V (None if it holds
    none): computed in ``start`` for all heads, its gradients per group as the own block's."""

    local = None

    def __init__(self, rank, world, local_len, is_causal, docs, window=None, masks=()):
        self.world, self.docs = world, docs
        half = local_len // 2
        if docs is not None:
            self.placement = placement_of(docs, world, local_len)
            self.blocks = _document_blocks(rank, world, self.placement, is_causal)
            self.local = self.placement.short_block(rank, is_causal)
            if window is not None:
                self.blocks, self.local = _with_window(self.blocks, self.local, rank,
                                                       self.placement, window)
        elif window is not None:  # each chunk's rows against the natural keys within reach
            keys = Run(0, world * local_len, 0, 1)
            self.blocks = [(band_block(run, keys, window, is_causal, masks), True)
                           for run in ZIGZAG.runs(local_len, rank, world)]
        elif not is_causal:
            self.blocks = [(Block(slice(0, local_len), slice(0, world * local_len), NONE), True)]
        else:
            self.blocks = [(Block(slice(j * half, (j + 1) * half), slice(0, (chunk + 1) * half),
                                  CAUSAL_BOTTOM_RIGHT), True)
                           for j, chunk in enumerate((rank, 2 * world - 1 - rank))]

    @staticmethod
    def message(k, v, heads: slice, rows: int, docs) -> torch.Tensor:
        """K and V of a group of kv heads as one message (a copy of each): [2, B, Hg, S, D], or
        with documents sequence-major, [R, 2, B, Hg, D], their first R = ``rows`` rows (the long
        part's, ``exchanged_rows``), for ``documents_to_natural``'s gather of whole rows."""
        if docs is None:
            return stacked([k[:, heads], v[:, heads]], 0)
        return _OwnThenOthers.message(k[:, :, :rows], v[:, :, :rows], heads, rows, None)

    def _natural(self, gathered):
        """The gathered group's (k, v) in natural order, [B, Hg, W * S, D] each."""
        if self.docs is None:
            return to_natural(gathered)
        return _heads_major(documents_to_natural(gathered, self.placement))

    def start(self, kernel, q, k, v, scale):
        """The forward's (out, lse) to fill group by group: fp32 (the fresh blocks, and the short
        documents' block, computed here for all heads, cover every row)."""
        out, lse = fp32_empty(q), fp32_empty(q, q.shape[:3])
        if self.local is not None:
            attend_(kernel, q, k, v, self.local, scale, out, lse, fresh=True)
        return out, lse

    def forward_(self, kernel, q, gathered, scale, out, lse, into):
        """The blocks of a group of q heads on its gathered K/V, into its out/lse (``into`` is
        None: ``start``'s accumulator is contiguous)."""
        k_all, v_all = self._natural(gathered)
        for block, fresh in self.blocks:
            attend_(kernel, q, k_all, v_all, block, scale, out, lse, fresh)

    @staticmethod
    def result(kernel, q, out, lse):
        return result_out(out, q, kernel), lse

    def backward(self, kernel, dout, q, out, lse, gathered, scale,
                 dq: "RowSums | HeldSums") -> torch.Tensor:
        """dq into ``dq``; returns the group's dK/dV to reduce-scatter, rank-major."""
        k_all, v_all = self._natural(gathered)
        if self.docs is None:
            dkv_all = fp32_empty(q, (2, *k_all.shape))
            dk_all, dv_all = dkv_all[0], dkv_all[1]
        else:  # sequence-major, as the messages: [W * R, 2, B, Hg, D]
            dkv_all = fp32_empty(gathered, (k_all.shape[2], *gathered.shape[2:]))
            dk_all, dv_all = _heads_major(dkv_all)
        sums = [dq, RowSums(dk_all), RowSums(dv_all)]
        for block, _ in self.blocks:
            block_backward(kernel, dout, q, k_all, v_all, out, lse, block, scale, *sums)
        for row_sums in sums[1:]:
            row_sums.result()  # keys no local query sees: zero
        if self.docs is None:
            return to_rank_major(dkv_all, self.world)
        return documents_to_rank_major(dkv_all, self.placement, self.world)

    def owned(self, received):
        """A reduce-scattered share as [2, B, Hg, S_local, D] (with documents it arrives as
        [R, 2, B, Hg, D], the messages' layout)."""
        return received if self.docs is None else received.movedim(0, -2)


def _with_window(blocks, local, rank, placement, window):
    """The document blocks and the short documents' block (None: none) with the window as
    positions: the rank's rows, the gathered keys in their natural order (the long part's, then,
    traced, the rows past it), its own keys for the short documents' block."""
    docs, world, local_len = placement.docs, placement.world, placement.local_len
    rows = docs.cached(("positions", ZIGZAG.name, local_len, rank, world),
                       lambda: ZIGZAG.positions(local_len, rank, world, docs))

    def natural_keys():
        sent = placement.exchanged_rows()
        gathered = torch.cat([ZIGZAG.positions(local_len, r, world, docs)[:sent]
                              for r in range(world)])
        return gathered[placement.gathered_positions(ZIGZAG).argsort()]

    keys = docs.cached(("llama3_key_positions", local_len, world), natural_keys)
    return ([(with_positions(block, rows, keys, window), fresh) for block, fresh in blocks],
            None if local is None else with_positions(local, rows, rows, window))


class _OwnThenOthers:
    """Causal, for a kernel without the bottom-right mask: the rank's own K/V in one causal block
    (``local``), then per group X and Y of the grid above, on the gathered K/V as they arrive.

    Messages are sequence-major, [S_local, 2, B, Hg, D], so that the gathered shards of ranks
    r+1 .. W-1, Y's keys (their order does not matter: Y is not masked), are one strided view of
    the gathered buffer, and X's keys (the first halves of ranks 0 .. r-1) one small copy;
    natural order is never built. The backward writes Y's dK/dV straight into the buffer that is
    reduce-scattered and copies X's into it."""

    def __init__(self, rank, world, local_len, is_causal, docs, window=None, masks=()):
        assert window is None, "plan_class sends windows to _NaturalOrder"
        self.rank, self.world, self.half = rank, world, local_len // 2
        self.local = Block(slice(0, local_len), slice(0, local_len), CAUSAL)

    @staticmethod
    def message(k, v, heads: slice, rows: int, docs) -> torch.Tensor:
        """K and V of a group of kv heads as one [S, 2, B, Hg, D] message (a copy of each; no
        documents here: every row)."""
        return stacked([k[:, heads].permute(2, 0, 1, 3), v[:, heads].permute(2, 0, 1, 3)], 1)

    def x(self, gathered):
        """X: (block, keys [r * C, 2, B, Hg, D]: the first halves of ranks 0 .. r-1, a copy), or
        None on rank 0."""
        if self.rank == 0:
            return None
        keys = copied(gathered, lambda x: x[:self.rank, :self.half].flatten(0, 1))
        return Block(slice(0, 2 * self.half), slice(0, keys.shape[0]), NONE), keys

    def y(self, gathered):
        """Y: (block, keys [(W-1-r) * S_local, 2, B, Hg, D]: the shards of ranks r+1 .. W-1, a
        view), or None on rank W-1."""
        if self.rank == self.world - 1:
            return None
        keys = gathered[self.rank + 1:].flatten(0, 1)
        return Block(slice(self.half, 2 * self.half), slice(0, keys.shape[0]), NONE), keys

    def others(self, gathered):
        """X and Y where they are not empty: (block, keys) pairs."""
        return [b for b in (self.x(gathered), self.y(gathered)) if b is not None]

    def start(self, kernel, q, k, v, scale):
        """The own block, all heads in one call, while the first group is gathered: the
        forward's (out, lse), which each group's merge overwrites with its final values (or
        writes into a contiguous out, where this one has a model's q strides)."""
        assert not kernel.exact, f"{kernel.name}: exact kernels offer the bottom-right mask"
        out, lse = kernel.forward(q, k, v, self.local.mask, scale)
        # A contiguous copy of the LSE, never a view of the kernel's output: the merges write it
        # in place through head and row slices, and compiled, where it was a view of cuDNN's
        # [B, H, S, 1] LSE, inductor (torch 2.11) put a functionalised write before the view it
        # writes into at W >= 2 ("used before it has been defined"). 1 MB at 8K tokens, 32 heads.
        return out, lse.clone(memory_format=torch.contiguous_format)

    def forward_(self, kernel, q, gathered, scale, out, lse, into):
        """X and Y of a group of q heads, merged with the group's own-block result ``out`` in one
        pass, in place, or written into ``into`` (a contiguous result) where it is given."""
        blocks = [(*kernel.forward(q[:, :, block.q], *_heads_major(keys), NONE, scale), block.q)
                  for block, keys in self.others(gathered)]
        if blocks:
            merge_many_(out if into is None else into, lse, out, lse, blocks)
        elif into is not None:  # W = 1: nothing to merge
            into.copy_(out)

    @staticmethod
    def result(kernel, q, out, lse):
        return out, lse

    def backward(self, kernel, dout, q, out, lse, gathered, scale,
                 dq: "RowSums | HeldSums") -> torch.Tensor:
        """dq into ``dq``; returns the group's dK/dV to reduce-scatter: [W, S_local, 2, B, Hg, D]
        (the messages' layout)."""
        r, half = self.rank, self.half
        dkv_all = fp32_empty(gathered)
        dkv_all[r].zero_()  # the local block's keys: their gradients stay on this rank
        x, y = self.x(gathered), self.y(gathered)
        if y is not None:
            block, keys = y
            dk_y, dv_y = _heads_major(dkv_all[r + 1:].flatten(0, 1))  # a view: written in place
            block_backward(kernel, dout, q, *_heads_major(keys), out, lse, block, scale, dq,
                           RowSums(dk_y), RowSums(dv_y))
        if x is not None:
            block, keys = x
            dk_x, dv_x = block_backward(kernel, dout, q, *_heads_major(keys), out, lse, block,
                                        scale, dq)
            firsts = dkv_all[:r, :half]  # [r, C, 2, B, Hg, D]
            batch_heads = dk_x.shape[0] * dk_x.shape[1]
            for i, grad in enumerate((dk_x, dv_x)):  # [B, Hg, r * C, D]
                # One cast pass (fp32 ops), the ranks as its batch: [r, B * Hg, C, D] both sides.
                # (Not a strided copy_, which was slower: docs/design.md, "Measurements behind
                # design choices".)
                by_rank = grad.unflatten(2, (r, half)).permute(2, 0, 1, 3, 4)
                accumulate_(firsts[:, :, i].permute(0, 2, 3, 1, 4).view(r, batch_heads, half, -1),
                            by_rank.reshape(r, batch_heads, half, -1), add=False)
            zero_(dkv_all[:r, half:])  # the second halves of ranks 0 .. r-1: seen by no row
        return dkv_all

    @staticmethod
    def owned(received):
        """A reduce-scattered share, [S_local, 2, B, Hg, D], as [2, B, Hg, S_local, D]."""
        return received.movedim(0, -2)


def _heads_major(kv):
    """[S, 2, B, Hg, D] K/V -> (k, v) as [B, Hg, S, D] views."""
    return tuple(kv[:, i].permute(1, 2, 0, 3) for i in range(2))


def plan_class(is_causal, kernel, docs, window=None):
    """The plan class; constructed after the first gather is posted (with documents, building
    the blocks takes device work)."""
    if is_causal and docs is None and window is None and CAUSAL_BOTTOM_RIGHT not in kernel.masks:
        return _OwnThenOthers
    return _NaturalOrder


class Llama3:
    name, exchange, layout = "llama3", "allgather", ZIGZAG

    def forward(self, comm: Communicator, q, k, v, *, is_causal, scale, kernel, docs=None,
                window=None):
        groups, q_per_kv = head_groups(k.shape[1], comm.world_size), q.shape[1] // k.shape[1]
        plan_cls = plan_class(is_causal, kernel, docs, window)
        rows = exchanged_rows(docs, comm.world_size, q.shape[2])
        pending = comm.all_gather(plan_cls.message(k, v, groups[0], rows, docs)) if rows else None
        plan = plan_cls(comm.rank, comm.world_size, q.shape[2], is_causal, docs, window,
                        kernel.masks)
        if pending is None:  # placed documents, all short: each rank attends its own
            return plan.result(kernel, q, *plan.start(kernel, q, k, v, scale))
        first, lse = plan.start(kernel, q, k, v, scale)
        out = merge_target(first)
        # Traced (the compile pass), each group's result is its own tensor and the groups are
        # concatenated at the end. Written through head slices of one tensor, each group's
        # functionalised write was a pass over every head under inductor (4 H200s, 8K tokens per
        # GPU, 32/32 heads: 0.11-0.14 ms per group; eager's in-place merges, 0.08 ms for all
        # four). The merges are eager's Triton kernel (merge/online.TracedFp32); the cat is one
        # copy.
        traced, results = is_traced(q), []
        for i, heads in enumerate(groups):
            gathered = pending.wait()
            if i + 1 < len(groups):
                pending = comm.all_gather(plan.message(k, v, groups[i + 1], rows, docs))
            q_heads = slice(heads.start * q_per_kv, heads.stop * q_per_kv)
            if traced:
                results.append((first[:, q_heads].clone(), lse[:, q_heads].clone()))
                plan.forward_(kernel, q[:, q_heads], gathered, scale, *results[-1], None)
            else:
                plan.forward_(kernel, q[:, q_heads], gathered, scale, first[:, q_heads],
                              lse[:, q_heads], None if out is first else out[:, q_heads])
        if traced:
            out, lse = (torch.cat(parts, 1) for parts in zip(*results))
        return plan.result(kernel, q, out, lse)

    def backward(self, comm: Communicator, dout, q, k, v, out, lse, *, is_causal, scale, kernel,
                 docs=None, window=None):
        world = comm.world_size
        dout, out = backward_operands(kernel, dout, out, q, docs)
        groups, q_per_kv = head_groups(k.shape[1], world), q.shape[1] // k.shape[1]
        # dq: an exact kernel adds into fp32 sums itself; other kernels' results (in q's dtype)
        # are held and summed per group in one pass straight into the output (HeldSums)
        dq = fp32_empty(q) if kernel.exact else q.new_empty(q.shape)
        # dK/dV: per group, the own block's (16-bit, or an exact kernel's fp32 sums) and the
        # reduce-scattered share (fp32) summed in one pass straight into the outputs
        dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)
        plan_cls = plan_class(is_causal, kernel, docs, window)
        rows = exchanged_rows(docs, world, q.shape[2])  # 0: placed documents, all short
        pending_kv = (comm.all_gather(plan_cls.message(k, v, groups[0], rows, docs)) if rows
                      else None)
        pending_grad = None
        plan = plan_cls(comm.rank, world, q.shape[2], is_causal, docs, window, kernel.masks)
        own = {}  # group index -> the own block's (key rows, dk, dv) of that group's heads

        def receive(g):
            share = plan.owned(pending_grad.wait()) if rows else None
            mine = own.pop(g, None)
            for i, target in enumerate((dk, dv)):
                sum_many_(target[:, groups[g]], ([(mine[1 + i], mine[0])] if mine else [])
                          + ([(share[i], slice(0, rows))] if rows else []))

        for i, heads in enumerate(groups):
            q_heads = slice(heads.start * q_per_kv, heads.stop * q_per_kv)
            dq_heads = (RowSums(dq[:, q_heads]) if kernel.exact
                        else HeldSums(q[:, q_heads], per_pass=MAX_PARTS))
            if plan.local is not None:
                # The group's share of the rank's own block, while its K/V are gathered: every
                # row of dq, dk and dv, which the others' blocks add to. Per group, not for all
                # heads at once as in the forward: its backward's temporaries grow with the heads
                # (cuDNN keeps dq in fp32 too), and at 8K tokens, 32/8 heads that raised the peak.
                operands = (kernel, dout[:, q_heads], q[:, q_heads], k[:, heads], v[:, heads],
                            out[:, q_heads], lse[:, q_heads], plan.local, scale, dq_heads)
                if kernel.exact:
                    sums = [RowSums(fp32_empty(x[:, heads])) for x in (k, v)]
                    block_backward(*operands, *sums)
                    own[i] = (slice(0, k.shape[2]), *(x.result() for x in sums))
                else:
                    own[i] = (plan.local.k, *block_backward(*operands))
            if not rows:  # nothing gathered: the own block is all
                (dq_heads.result() if kernel.exact else dq_heads.result_into(dq[:, q_heads]))
                receive(i)
                continue
            gathered = pending_kv.wait()
            if i + 1 < len(groups):
                pending_kv = comm.all_gather(plan.message(k, v, groups[i + 1], rows, docs))
            dkv_all = plan.backward(kernel, dout[:, q_heads], q[:, q_heads], out[:, q_heads],
                                    lse[:, q_heads], gathered, scale, dq_heads)
            if kernel.exact:
                dq_heads.result()  # rows no block reached: zero
            else:
                dq_heads.result_into(dq[:, q_heads])
            if pending_grad is not None:
                receive(i - 1)
            pending_grad = comm.reduce_scatter(dkv_all)
            # The communicator holds it while it needs it. Kept here until the next group's was
            # built, it raised the peak memory (measured: docs/design.md, "Measurements behind
            # design choices").
            del dkv_all
        if rows:
            receive(len(groups) - 1)
        return dq.to(q.dtype), dk, dv
