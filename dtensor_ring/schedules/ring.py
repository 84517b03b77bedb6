r"""The ring exchange: K/V pass to the next rank W-1 times; the layout says what each step computes.

Used by the ``ring`` (contiguous), ``zigzag`` and ``stripe`` schedules; their block grids are drawn in
``layouts/``. At step t rank r holds the K/V of rank src = (r - t) mod W; step 0's is its own.

Forward, per step: post the send of the K/V held (K and V: two messages of one batch, no copy) to
rank r+1 and the receive of the next from rank r-1, compute this step's blocks, merge them into the
fp32 (out, lse), then wait for the next K/V. Step 0's blocks (the rank's own K/V) go to the first
post as the compute it overlaps (``Communicator.send_recv_next``): on the copy engines they are
launched first, so the GPU starts before the post's host time; the backward's early own blocks
likewise.

Backward: the same K/V pass, and an fp32 dK/dV accumulator for each rank's K/V that travels *with*
them: rank src+1 starts it at step 1 from its blocks' dk/dv, each later holder adds its own and
passes it on, and rank src-1 sends it home after step W-1. Each hop is posted after a step's compute
and waited on after the next step's compute. The rank's own block (its own K/V: no communication)
keeps its dk/dv at home in fp32 and is split in two, run first and last, so that compute covers
the first K/V hop and the last accumulator hop, which has no remote step after it:

    rank r, W = 3    own, early   | src r-1          | src r-2          | own, late
    K/V in flight    r-1's -> r   | r-2's -> r       |                  |
    dK/dV in flight               |                  | r-1's acc. -> r+1| r-2's acc. -> r+1 (home)
                                                                          r's own acc. <- r-1

The last hop carries fp32 (twice the bytes of 16-bit K/V), so the late part is the larger
(h = S_local // 2; \ causal, # full):

    causal        early  q[:h] x k[:h] \          late  q[h:] x k[:h] #,  q[h:] x k[h:] \
                                                (one block q[h:] x k, bottom-right causal, with a
                                                kernel that has that mask)
    non-causal    early  q x k[:h]     #          late  q x k[h:]     #

At home the arriving accumulator is added to the own part and rounded once to the input dtype.

Packed documents (``docs``): the layout gives each step one varlen block over all rows (its
per-document grid is drawn in its file), and the own block is split as above within each
document: the early part is every document's rows and keys before h (causal), the late part every
document's rows from h on against all of its keys (bottom-right causal: a document that starts
before h keeps seeing its keys there). With zigzag's and stripe's placement (``layouts/
placement.py``) only the long part's L rows travel (K/V and the dK/dV accumulators), the steps
after the first attend the long part, and step 0's block holds the short documents' segments
after the long part's (split with them); with no long document there is no exchange at all.

A sliding window (``window``) runs ``windowed.py`` instead: K/V only from the ranks within reach.
"""

from ..comm import Communicator
from ..kernels.base import CAUSAL, CAUSAL_BOTTOM_RIGHT, NONE
from ..layouts import Block, Layout
from ..layouts.placement import exchanged_rows
from ..merge import sum_many_
from . import windowed
from .base import (ForwardMerge, HeldSums, RowSums, attend_, backward_operands,
                   block_backward, forward_block, fp32_empty)


def split_own(block: Block, masks) -> tuple[list[Block], list[Block]]:
    """The own (diagonal) block as (early, late) blocks, for a kernel offering ``masks``; see the
    table above."""
    length = block.q.stop
    half = length // 2
    if half == 0:
        return [block], []
    if block.segments is not None:
        return _split_own_documents(block, half)
    first, second = slice(0, half), slice(half, length)
    if block.mask == CAUSAL and CAUSAL_BOTTOM_RIGHT in masks:
        return [Block(first, first, CAUSAL)], [Block(second, block.k, CAUSAL_BOTTOM_RIGHT)]
    if block.mask == CAUSAL:
        return ([Block(first, first, CAUSAL)],
                [Block(second, first, NONE), Block(second, second, CAUSAL)])
    return [Block(block.q, first, NONE)], [Block(block.q, second, NONE)]


def _split_own_documents(block: Block, half: int) -> tuple[list[Block], list[Block]]:
    """``split_own`` with documents (the module docstring): the segments clipped at ``half``.
    The block's keys may end before its rows (the placement's own block of the long part, whose
    later rows see no key: ``layouts/placement.py``)."""
    seg, length, keys = block.segments, block.q.stop, block.k.stop
    if block.mask == CAUSAL:
        early_keys = min(half, keys)
        return ([Block(slice(0, half), slice(0, early_keys), CAUSAL,
                       seg._replace(cu_q=seg.cu_q.clamp(max=half),
                                    cu_k=seg.cu_k.clamp(max=early_keys)))],
                [Block(slice(half, length), block.k, CAUSAL_BOTTOM_RIGHT,
                       seg._replace(cu_q=(seg.cu_q - half).clamp(min=0)))])
    half = keys // 2
    return ([Block(block.q, slice(0, half), NONE, seg._replace(cu_k=seg.cu_k.clamp(max=half)))],
            [Block(block.q, slice(half, keys), NONE,
                   seg._replace(cu_k=(seg.cu_k - half).clamp(min=0)))])


class RingSchedule:
    exchange = "ring"

    def __init__(self, name: str, layout: Layout):
        self.name, self.layout = name, layout

    def _blocks(self, comm, step, local_len, is_causal, docs):
        src = (comm.rank - step) % comm.world_size
        blocks = self.layout.ring_blocks(local_len, comm.rank, src, comm.world_size, is_causal,
                                         docs)
        # Step 0 (the rank's own K/V) is one square block over every row: it starts the
        # forward's accumulator, and the backward splits it (split_own).
        assert step or (len(blocks) == 1 and blocks[0].q == blocks[0].k == slice(0, local_len))
        return blocks

    def _exchanged(self, local_len, world, docs):
        """The K/V rows another rank needs: with placed documents the long part's (those of the
        short ones are attended at home only, ``layouts/placement.py``), else every row."""
        if self.layout.places_documents:
            return exchanged_rows(docs, world, local_len)
        return local_len

    def forward(self, comm: Communicator, q, k, v, *, is_causal, scale, kernel, docs=None,
                window=None):
        if window is not None:
            return windowed.forward(self.layout, comm, q, k, v, is_causal=is_causal, scale=scale,
                                    kernel=kernel, docs=docs, window=window)
        world, local_len = comm.world_size, q.shape[2]
        exchanged = self._exchanged(local_len, world, docs)
        # placed documents, all short (every rank knows): nothing to exchange
        n_steps = world if exchanged else 1
        if kernel.exact:  # its kernel writes or merges into the fp32 accumulator itself
            out, lse = fp32_empty(q), fp32_empty(q, q.shape[:3])

        def attend(kv, block, fresh=False):
            """The block's (out, lse, rows) in q's dtype; exact: None, merged into out, lse."""
            if kernel.exact:
                return attend_(kernel, q, *kv, block, scale, out, lse, fresh=fresh)
            return (*forward_block(kernel, q, *kv, block, scale), block.q)

        (own,) = self._blocks(comm, 0, local_len, is_causal, docs)
        own_result = []

        def launch_own():
            own_result.append(attend([k, v], own, fresh=True))

        # The first K/V hop hides behind the own block (the communicator orders the two).
        pending = (comm.send_recv_next(_rows([k, v], exchanged, local_len), launch_own)
                   if n_steps > 1 else launch_own())
        steps = [self._blocks(comm, step, local_len, is_causal, docs)
                 for step in range(1, n_steps)]
        if not kernel.exact:  # the block results merged as they come (ForwardMerge)
            merged = ForwardMerge(q, 1 + sum(map(len, steps)))
            merged.add(*own_result[0])
        for step, blocks in enumerate(steps, start=1):
            kv = pending.wait()
            pending = comm.send_recv_next(kv) if step < n_steps - 1 else None
            for block in blocks:
                result = attend(kv, block)
                if not kernel.exact:
                    merged.add(*result)
        return (out, lse) if kernel.exact else merged.result()

    def backward(self, comm: Communicator, dout, q, k, v, out, lse, *, is_causal, scale, kernel,
                 docs=None, window=None):
        if window is not None:
            return windowed.backward(self.layout, comm, dout, q, k, v, out, lse,
                                     is_causal=is_causal, scale=scale, kernel=kernel, docs=docs,
                                     window=window)
        local_len = q.shape[2]
        exchanged = self._exchanged(local_len, comm.world_size, docs)
        world = comm.world_size if exchanged else 1  # placed documents, all short: no exchange
        dout, out = backward_operands(kernel, dout, out, q, docs)
        dq_sums = RowSums(fp32_empty(q)) if kernel.exact else HeldSums(q)
        # The rank's own K/V: their gradients stay here. An exact kernel adds them into fp32
        # sums itself; other kernels' results (in k's dtype) are held and added to the
        # accumulator that comes home in one pass at the end (``own_sum``).
        own_sums = (RowSums(fp32_empty(k)), RowSums(fp32_empty(v))) if kernel.exact else None
        own_parts = []  # (key rows, dk, dv) of each own block, without own_sums

        def own(blocks):
            for block in blocks:
                if own_sums is not None:
                    block_backward(kernel, dout, q, k, v, out, lse, block, scale, dq_sums,
                                   *own_sums)
                else:
                    own_parts.append((block.k, *block_backward(kernel, dout, q, k, v, out, lse,
                                                               block, scale, dq_sums)))

        (first,) = self._blocks(comm, 0, local_len, is_causal, docs)
        early, late = split_own(first, kernel.masks)
        pending_kv = (comm.send_recv_next(_rows([k, v], exchanged, local_len),
                                          lambda: own(early)) if world > 1
                      else own(early))
        pending_dkv = None
        for step in range(1, world):
            kv = pending_kv.wait()
            pending_kv = comm.send_recv_next(kv) if step < world - 1 else None
            blocks = self._blocks(comm, step, local_len, is_causal, docs)
            if pending_dkv is None:  # step 1 starts the travelling accumulator: kernels write it
                dk, dv = RowSums(fp32_empty(kv[0])), RowSums(fp32_empty(kv[1]))
                for block in blocks:
                    block_backward(kernel, dout, q, *kv, out, lse, block, scale, dq_sums,
                                   dk, dv)
            else:
                step_dkv = [block_backward(kernel, dout, q, *kv, out, lse, block, scale, dq_sums)
                            for block in blocks]
                # Wait for the accumulator only now, so its transfer overlapped the compute.
                dk, dv = (RowSums(t, written=True) for t in pending_dkv.wait())
                for block, (dk_block, dv_block) in zip(blocks, step_dkv):
                    dk.add_(block.k, dk_block)
                    dv.add_(block.k, dv_block)
            pending_dkv = comm.send_recv_next([dk.result(), dv.result()])
        own(late)
        # dq before dK/dV: its fp32 sum is freed before their outputs are allocated (the peak)
        dq = dq_sums.result_in(q.dtype)
        if own_sums is not None:
            own_parts = [(slice(0, local_len), *(sums.result() for sums in own_sums))]
        # This rank's accumulator, home after W-1 hops.
        home = pending_dkv.wait() if pending_dkv is not None else (None, None)
        dk, dv = (own_sum(x, [(rows, grads[i]) for rows, *grads in own_parts], home[i])
                  for i, x in enumerate((k, v)))
        return dq, dk, dv


def own_sum(x, parts, home):
    """dK (or dV) of the rank's own K/V in ``x``'s dtype, rounded once: the own blocks' ``parts``
    ((key rows, gradient), in order) plus the accumulator that came ``home`` (fp32, for the rows
    that were exchanged; None at W = 1), added in one pass in the order adding them one at a time
    to an fp32 accumulator would take. Contiguous, as the custom op's fake promises (``x`` may be
    a transposed view)."""
    target = x.new_empty(x.shape)
    sum_many_(target, [(grad, rows) for rows, grad in parts]
              + ([(home, slice(0, home.shape[2]))] if home is not None else []))
    return target


def _rows(kv, rows, local_len):
    """The K/V rows to send: the first ``rows`` (all of them: the tensors as they are)."""
    return kv if rows == local_len else [x[:, :, :rows] for x in kv]
