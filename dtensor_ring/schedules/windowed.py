r"""The ring schedules with a sliding window: K/V only from the ranks within reach, sent directly.

Used by ``ring``, ``zigzag`` and ``stripe`` (``RingSchedule``) when a call has a window
(``layouts/windows.py``). What each rank computes against each other rank's K/V is the layout's
runs cut by the window (``band_block``): blocks outside it are dropped, blocks inside need no
mask, edge blocks carry a band. A *pair* (rank, src) is needed when some block is left; the
message is the bounding rows of src's K/V those blocks read.

Exchange: for each *offset* d such that some rank needs rank - d's K/V, every rank sends the rows
rank + d needs of its own K/V straight to it and receives from rank - d the rows it needs
(``Communicator.send_recv``; a rank with nothing that way moves nothing). Offsets no rank needs are
skipped: no message at all. Offsets run nearest first, the next posted before the current step's
blocks are computed, the first around the own blocks (``send_recv``'s ``overlapping``: on the copy
engines they are launched first, and the GPU computes while the host posts). W = 4, 8 tokens per
rank, causal, window=(5, 0):

    contiguous   rank r needs the last 5 rows of rank r-1: one offset (d = 1), 5 of 8 rows;
                 rank 0 receives nothing, rank 3 sends nothing (no wrap-around message)
    zigzag       chunk r needs chunk r-1 (rank r-1's first half) and chunk 2W-1-r needs chunk
                 2W-2-r (rank r+1's second half): offsets 1 and W-1 (= -1), 4 rows each way
    stripe       every rank's tokens interleave, so the window reaches every rank: W-1 offsets

A ring of W-1 steps moves (W-1) local K/V per rank; here the contiguous layout moves
ceil(window / S_local) messages of at most S_local rows (``exchange_rows`` counts them; the cost
model of ``schedules/__init__.py`` uses it).

Backward: the same K/V messages; each rank's dK/dV for the rows it received (fp32) go straight
back to their owner (offset -d), posted after the step's blocks and received after the next
step's, and are summed at home with the own blocks' gradients, rounded once. The own blocks are
split in two (``split_rows``), run first and last, so that compute covers the first K/V message
and the last dK/dV message, as in the ring.

Packed documents: the layout's per-document blocks (``ring_blocks`` with ``docs``), the window as
``Positions``, whole K/V messages; a pair is skipped where the boundaries are known on the host
(a CPU ``cu_seqlens``) and show no query within reach of the pair's keys.
"""
import functools
from typing import NamedTuple

import torch

from ..comm import Communicator
from ..layouts import LAYOUTS, Block, Layout
from ..layouts.boundaries import Documents
from ..layouts.windows import Window, band_block, split_rows, visible_pairs, with_positions
from .base import (ForwardMerge, HeldSums, RowSums, attend_, backward_operands, block_backward,
                   fp32_empty, forward_block)

_NOTHING = slice(0, 0)


class Pair(NamedTuple):
    """What a rank computes against src's K/V: the rows it needs (the message) and the blocks,
    their key rows counted from ``rows.start``."""

    rows: slice
    blocks: tuple


class Step(NamedTuple):
    """One offset of a rank's exchange: the rows it receives from rank - offset and its blocks on
    them, the rows of its own K/V that rank + offset receives, and the most rows any rank's
    message at this offset has (the same on every rank: ``Communicator.send_recv``)."""

    offset: int
    recv_rows: slice
    blocks: tuple
    send_rows: slice
    most_rows: int


class RankPlan(NamedTuple):
    """A rank's windowed attention: its blocks on its own K/V (the first ``fresh`` of them cover
    every row once: each query sees itself), then its steps."""

    own: tuple
    fresh: int
    steps: tuple


def rows_of(blocks) -> slice:
    return slice(min(b.k.start for b in blocks), max(b.k.stop for b in blocks))


def rebased(blocks, rows: slice) -> tuple:
    """``blocks`` with their key rows counted from ``rows.start`` (the message's first row)."""
    return tuple(Block(b.q, slice(b.k.start - rows.start, b.k.stop - rows.start), b.mask,
                       b.segments, b.window) for b in blocks)


@functools.lru_cache(maxsize=128)
def dense_pairs(layout_name: str, local_len: int, world: int, is_causal: bool, window: Window,
                masks: tuple) -> tuple:
    """[rank][src]: the ``Pair`` (None: nothing to compute), without documents; for the own K/V
    ``(rows, blocks, fresh)`` with the diagonal blocks first. Host work only, cached."""
    layout = LAYOUTS[layout_name]
    runs = [layout.runs(local_len, r, world) for r in range(world)]
    table = []
    for rank in range(world):
        row = []
        for src in range(world):
            if src == rank:
                diagonal = [band_block(run, run, window, is_causal, masks) for run in runs[rank]]
                assert all(b is not None and b.q == slice(run.start, run.start + run.length)
                           for b, run in zip(diagonal, runs[rank])), "a query sees itself"
                cross = [band_block(rq, rk, window, is_causal, masks)
                         for i, rq in enumerate(runs[rank]) for j, rk in enumerate(runs[src])
                         if i != j]
                row.append((slice(0, local_len), tuple(diagonal + [b for b in cross if b]),
                            len(diagonal)))
                continue
            blocks = [b for rq in runs[rank] for rk in runs[src]
                      if (b := band_block(rq, rk, window, is_causal, masks)) is not None]
            row.append(Pair(rows_of(blocks), rebased(blocks, rows_of(blocks))) if blocks
                       else None)
        table.append(row)
    return tuple(tuple(r) for r in table)


def offsets(needed, world: int) -> list[int]:
    """The offsets some rank needs (``needed(rank, src)``), nearest first."""
    found = {(r - s) % world for r in range(world) for s in range(world)
             if r != s and needed(r, s)}
    return sorted(found, key=lambda d: (min(d, world - d), d))


@functools.lru_cache(maxsize=1024)
def dense_plan(layout: Layout, rank: int, world: int, local_len: int, is_causal: bool,
               window: Window, masks: tuple) -> RankPlan:
    """A rank's plan without documents (host work only, cached: a call costs a lookup)."""
    table = dense_pairs(layout.name, local_len, world, is_causal, window, masks)
    _, own, fresh = table[rank][rank]
    steps = []
    for d in offsets(lambda r, s: table[r][s] is not None, world):
        got, sent = table[rank][(rank - d) % world], table[(rank + d) % world][rank]
        messages = [table[r][(r - d) % world] for r in range(world)]
        most = max(m.rows.stop - m.rows.start for m in messages if m is not None)
        steps.append(Step(d, got.rows if got else _NOTHING, got.blocks if got else (),
                          sent.rows if sent else _NOTHING, most))
    return RankPlan(own, fresh, tuple(steps))


def document_plan(layout: Layout, rank: int, world: int, local_len: int, is_causal: bool,
                  window: Window, docs) -> RankPlan:
    """With packed documents: the layout's per-document blocks with the window as positions,
    whole messages (module docstring)."""
    def positions(r):
        return docs.cached(("positions", layout.name, local_len, r, world),
                           lambda: layout.positions(local_len, r, world, docs))

    def blocks(r, s):
        return layout.ring_blocks(local_len, r, s, world, is_causal, docs)

    def pairs():
        reach = _reach(layout, local_len, world, is_causal, window, docs)
        return [[(reach is None or reach[r][s]) and bool(blocks(r, s)) for s in range(world)]
                for r in range(world)]

    needed = docs.cached(("window_pairs", layout.name, local_len, world, is_causal, window),
                         pairs)
    own = [with_positions(b, positions(rank), positions(rank), window)
           for b in blocks(rank, rank)]
    steps, everything = [], slice(0, local_len)
    for d in offsets(lambda r, s: needed[r][s], world):
        src, dst = (rank - d) % world, (rank + d) % world
        got = needed[rank][src]
        steps.append(Step(d, everything if got else _NOTHING,
                          tuple(with_positions(b, positions(rank), positions(src), window)
                                for b in blocks(rank, src)) if got else (),
                          everything if needed[dst][rank] else _NOTHING, local_len))
    return RankPlan(tuple(own), 1, tuple(steps))


def _reach(layout, local_len, world, is_causal, window, docs):
    """[rank][src]: whether any query of rank sees a key of src, from the boundaries on the host
    (None where they are not: every pair may)."""
    if docs.host is None:
        return None
    cu = torch.tensor(docs.host)
    host = Documents(cu.to(torch.int32), docs.max_len, docs.host)
    positions = [layout.positions(local_len, r, world, host) for r in range(world)]
    return [[visible_pairs(positions[r], positions[s], cu, window, is_causal)
             for s in range(world)] for r in range(world)]


def plan_for(layout, comm, local_len, is_causal, window, kernel, docs) -> RankPlan:
    if docs is None:
        return dense_plan(layout, comm.rank, comm.world_size, local_len, is_causal, window,
                          tuple(kernel.masks))
    return document_plan(layout, comm.rank, comm.world_size, local_len, is_causal, window, docs)


@functools.lru_cache(maxsize=256)
def exchange_rows(layout: Layout, local_len: int, world: int, is_causal: bool,
                  window: Window) -> tuple[int, int]:
    """(the most K/V rows one rank receives in a forward, the messages it takes), no documents."""
    plans = [dense_plan(layout, r, world, local_len, is_causal, window, ("none", "causal"))
             for r in range(world)]
    rows = [sum(s.recv_rows.stop - s.recv_rows.start for s in p.steps) for p in plans]
    return max(rows), max((len(p.steps) for p in plans), default=0)


def _shape(x: torch.Tensor, rows: slice) -> tuple:
    return (*x.shape[:2], rows.stop - rows.start, x.shape[3])


class _Exchange:
    """Posts a plan's K/V messages in order (``Communicator.send_recv``)."""

    def __init__(self, comm, plan: RankPlan, k, v):
        self.comm, self.plan, self.k, self.v = comm, plan, k, v

    def post(self, i, overlapping=None):
        """Step ``i``'s message (None past the last step); ``overlapping``: compute that needs
        nothing from it, launched around the post (``Communicator.send_recv``)."""
        if i >= len(self.plan.steps):
            if overlapping is not None:
                overlapping()
            return None
        step = self.plan.steps[i]
        send = [x[:, :, step.send_rows] for x in (self.k, self.v)]
        return self.comm.send_recv(step.offset, send, [_shape(x, step.recv_rows)
                                                        for x in (self.k, self.v)], step.most_rows,
                                   overlapping)


def forward(layout, comm: Communicator, q, k, v, *, is_causal, scale, kernel, docs, window):
    plan = plan_for(layout, comm, q.shape[2], is_causal, window, kernel, docs)
    if kernel.exact:  # its kernel writes or merges into the fp32 accumulator itself
        out, lse = fp32_empty(q), fp32_empty(q, q.shape[:3])

        def own():
            for i, block in enumerate(plan.own):
                attend_(kernel, q, k, v, block, scale, out, lse, fresh=i < plan.fresh)
    else:
        merged = ForwardMerge(q, 1 + len(plan.own) - plan.fresh
                              + sum(len(s.blocks) for s in plan.steps))

        def own():
            merged.add(*_first(kernel, q, k, v, plan, scale), slice(0, q.shape[2]))
            for block in plan.own[plan.fresh:]:
                merged.add(*forward_block(kernel, q, k, v, block, scale), block.q)
    exchange = _Exchange(comm, plan, k, v)
    pending = exchange.post(0, own)  # the own blocks need no message: they overlap the first
    for i, step in enumerate(plan.steps):
        kv = pending.wait()
        pending = exchange.post(i + 1)
        for block in step.blocks:
            if kernel.exact:
                attend_(kernel, q, *kv, block, scale, out, lse, fresh=False)
            else:
                merged.add(*forward_block(kernel, q, *kv, block, scale), block.q)
    return (out, lse) if kernel.exact else merged.result()


def _first(kernel, q, k, v, plan: RankPlan, scale):
    """The fresh own blocks' (out, lse) over every row: the one block's, or the several put
    together (zigzag: one per chunk)."""
    if plan.fresh == 1:
        return forward_block(kernel, q, k, v, plan.own[0], scale)
    out, lse = q.new_empty(q.shape), fp32_empty(q, q.shape[:3])
    for block in plan.own[:plan.fresh]:
        block_out, block_lse = forward_block(kernel, q, k, v, block, scale)
        out[:, :, block.q].copy_(block_out)
        lse[:, :, block.q].copy_(block_lse)
    return out, lse


def _own_parts(plan: RankPlan, masks, docs) -> tuple[list, list]:
    """The own blocks as (early, late), about half the rows each (module docstring)."""
    own = list(plan.own)
    if docs is not None:
        return own, []
    if len(own) == 1:
        block = own[0]
        parts = split_rows(block, (block.q.stop - block.q.start) // 2, masks)
        return parts[:1], parts[1:]
    return own[:len(own) // 2], own[len(own) // 2:]


def backward(layout, comm: Communicator, dout, q, k, v, out, lse, *, is_causal, scale, kernel,
             docs, window):
    plan = plan_for(layout, comm, q.shape[2], is_causal, window, kernel, docs)
    dout, out = backward_operands(kernel, dout, out, q, docs)
    dq = RowSums(fp32_empty(q)) if kernel.exact else HeldSums(q)
    # The own K/V's gradients: the own blocks' and what comes home, summed at the end and
    # rounded once (an exact kernel adds into fp32 sums itself; others' results are held).
    home = ((RowSums(fp32_empty(k)), RowSums(fp32_empty(v))) if kernel.exact
            else (HeldSums(k), HeldSums(v)))

    def add_home(rows, grads):
        if rows.stop == rows.start:
            return  # nothing came home at this offset
        for sums, grad in zip(home, grads):
            (sums.add_ if kernel.exact else sums.hold)(rows, grad)

    def own(blocks):
        for block in blocks:
            if kernel.exact:
                block_backward(kernel, dout, q, k, v, out, lse, block, scale, dq, *home)
            else:
                add_home(block.k, block_backward(kernel, dout, q, k, v, out, lse, block, scale,
                                                 dq))

    early, late = _own_parts(plan, kernel.masks, docs)
    exchange = _Exchange(comm, plan, k, v)
    pending_kv = exchange.post(0, lambda: own(early))
    returning = None  # (pending dK/dV of the last step, the rows of this rank's K/V they are)
    for i, step in enumerate(plan.steps):
        kv = pending_kv.wait()
        pending_kv = exchange.post(i + 1)
        dk, dv = (RowSums(fp32_empty(x, _shape(x, step.recv_rows))) for x in (k, v))
        for block in step.blocks:
            block_backward(kernel, dout, q, *kv, out, lse, block, scale, dq, dk, dv)
        if returning is not None:  # waited on only now: its transfer overlapped this compute
            add_home(returning[1], returning[0].wait())
        returning = (comm.send_recv(-step.offset, [dk.result(), dv.result()],
                                    [_shape(x, step.send_rows) for x in (k, v)], step.most_rows),
                     step.send_rows)
    own(late)
    dq = dq.result_in(q.dtype)  # before dK/dV: its fp32 sum is freed first
    if returning is not None:
        add_home(returning[1], returning[0].wait())
    dk, dv = (sums.result_in(x.dtype) for sums, x in zip(home, (k, v)))
    return dq, dk, dv
