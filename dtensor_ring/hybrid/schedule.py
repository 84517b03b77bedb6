"""The hybrid schedule: an all-to-all over heads among the inner ranks, and the outer schedule (any
of ``dr.SCHEDULES``) over the outer ranks on each head group.

Rank (i, j) holds S_loc tokens of every head (``layout.py``). The all-to-all trades them for head
group j of all I S_loc tokens of outer shard i (``heads.py``); the outer schedule then runs on the
outer ranks' group, exactly as on a 1-D mesh of O ranks with H / I heads (its layout, block grid,
fp32 or exact arithmetic are its own); the output goes back the other way. The backward sends
dout, q, k, v, out and the LSE to heads (the forward keeps only what autograd saves: this rank's
shards), runs the outer backward, and sends dq, dk, dv back. In fp32 mode nothing here rounds
(the all-to-all moves values, the outer schedule does the arithmetic); exact mode's fp32 out and
LSE travel in fp32.

Overlap: each head group travels in ``chunks`` pieces (``heads.head_split``; by default one:
``heads.DEFAULT_CHUNKS`` says why; with 2, as the key/value heads per rank allow, as follows).
The all-to-all of piece c + 1 is posted before the outer schedule
attends piece c, and piece c's output is sent back while piece c + 1 is attended, so only the
first piece's inputs and the last piece's output wait on the inner links (forward, C = 2):

    inner all-to-all   q,k,v[0] | q,k,v[1]             | out[0]               | out[1]
    outer schedule              | piece 0 (its own ring, overlapped as it is) | piece 1
                       exposed  |    hidden by piece 0's compute and ring     | exposed

A piece's q, k and v travel in one all-to-all, side by side in one buffer (``heads.to_heads``),
and so do the backward's dout, q, k, v and out, and dq, dk and dv on the way back: one message per
run of tensors of one dtype and head dim (the LSE, and exact mode's fp32 out, go alone). Each
all-to-all costs host time and a handshake with every inner rank (on the copy engines a
collective waits for its peers' slots), whatever its size: per forward+backward with two pieces,
12 all-to-alls where one per tensor made 28.

The outer schedule's exchanges and the all-to-all use different groups (and, across nodes,
different links), so they run at the same time; each piece runs the whole outer schedule (its
W_outer - 1 ring steps), so C pieces send C times as many, C times smaller, outer messages.
The backward is the same with (dout, q, k, v, out, LSE) in and (dq, dk, dv) out.
"""
import itertools

import torch

from ..layouts import Layout
from .comm import HybridComm
from .heads import head_split, heads_of, sequence_into_, to_heads, to_sequence
from .layout import HybridLayout


class Hybrid:
    """``outer`` (a schedule) over ``outer_size`` ranks, on head groups of ``inner_size`` ranks."""

    exchange = "all-to-all + ring"

    def __init__(self, outer, outer_size: int, inner_size: int, chunks: int | None = None):
        self.outer, self.chunks = outer, chunks
        self.name = outer.name
        self.layout: Layout = HybridLayout(outer.layout, outer_size, inner_size)

    def _split(self, comm: HybridComm, q, k):
        return head_split(q.shape[1], k.shape[1], comm.inner.world_size, self.chunks)

    def forward(self, comm: HybridComm, q, k, v, *, is_causal, scale, kernel, docs=None,
                window=None):
        split, inner = self._split(comm, q, k), comm.inner
        sources = ((q, False), (k, True), (v, True))

        def post(chunk):
            return _post(inner, sources, split, chunk)

        out = lse = None
        pending, returning = post(0), None
        for chunk in range(split.chunks):
            q_h, k_h, v_h = _arrived(pending)
            if chunk + 1 < split.chunks:
                pending = post(chunk + 1)
            out_h, lse_h = self.outer.forward(comm.outer, q_h, k_h, v_h, is_causal=is_causal,
                                              scale=scale, kernel=kernel, docs=docs, window=window)
            if out is None:  # exact kernels' out is fp32
                out = q.new_empty(q.shape, dtype=out_h.dtype)
                lse = q.new_empty(q.shape[:3], dtype=torch.float32)
            _land(returning, split)  # the previous piece's, overlapped by this one's
            returning = _return(inner, [(out, out_h, False), (lse, lse_h, False)], split, chunk)
        _land(returning, split)
        return out, lse

    def backward(self, comm: HybridComm, dout, q, k, v, out, lse, *, is_causal, scale, kernel,
                 docs=None, window=None):
        split, inner = self._split(comm, q, k), comm.inner
        # dout in q's dtype: exact mode's may come as fp32 holding 16-bit values (lossless).
        sources = ((dout.to(q.dtype), False), (q, False), (k, True), (v, True), (out, False),
                   (lse.unsqueeze(-1), False))

        def post(chunk):
            return _post(inner, sources, split, chunk)

        grads = None
        pending, returning = post(0), None
        for chunk in range(split.chunks):
            dout_h, q_h, k_h, v_h, out_h, lse_h = _arrived(pending)
            if chunk + 1 < split.chunks:
                pending = post(chunk + 1)
            dq_h, dk_h, dv_h = self.outer.backward(
                comm.outer, dout_h, q_h, k_h, v_h, out_h, lse_h.squeeze(-1).contiguous(),
                is_causal=is_causal, scale=scale, kernel=kernel, docs=docs, window=window)
            if grads is None:
                grads = tuple(x.new_empty(x.shape, dtype=g.dtype)
                              for x, g in ((q, dq_h), (k, dk_h), (v, dv_h)))
            _land(returning, split)
            returning = _return(inner, [(grads[0], dq_h, False), (grads[1], dk_h, True),
                                        (grads[2], dv_h, True)], split, chunk)
        _land(returning, split)
        return grads


def _messages(items, key) -> list[list]:
    """``items`` grouped into messages: runs of consecutive items whose ``key`` (dtype and
    trailing dims) agrees travel together."""
    return [list(run) for _, run in itertools.groupby(items, key)]


def _post(inner, sources, split, chunk):
    """The all-to-alls of piece ``chunk`` of ``sources`` ((x, kv) pairs): one per run of
    tensors with the same dtype and head dim (q, k and v: one). [(pending, head widths)]."""
    return [(inner.all_to_all(to_heads(group, split, chunk)), [split.piece(kv) for _, kv in group])
            for group in _messages(sources, lambda s: (s[0].dtype, s[0].shape[-1]))]


def _arrived(pending) -> list:
    """The head pieces of ``_post``'s messages, in the sources' order."""
    return [piece for p, widths in pending for piece in heads_of(p.wait(), widths)]


def _return(inner, results, split, chunk):
    """Post piece ``chunk``'s results ((target, y, kv) triples, y [B, h, I S, ...]) back to the
    ranks that hold their tokens, one all-to-all per run of one dtype and trailing dims:
    (chunk, [(pending, targets)]) for ``_land``."""
    return chunk, [(inner.all_to_all(to_sequence([y for _, y, _ in group], split.inner)),
                    [(target, y.shape[1], kv) for target, y, kv in group])
                   for group in _messages(results, lambda r: (r[1].dtype, r[1].shape[3:]))]


def _land(returning, split) -> None:
    """Wait for one piece's results on their way back and write them into their targets."""
    if returning is None:
        return
    chunk, pending = returning
    for p, targets in pending:
        received = p.wait()
        widths = [width for _, width, _ in targets]
        for (target, _, kv), part in zip(targets, received.split(widths, dim=2)):
            sequence_into_(target, part, split, chunk, kv)


def placed_schedule(schedule, outer_size: int, inner_size: int):
    """``schedule`` on a mesh of ``outer_size`` x ``inner_size`` ranks: itself on a 1-D one."""
    return schedule if inner_size == 1 else Hybrid(schedule, outer_size, inner_size)
