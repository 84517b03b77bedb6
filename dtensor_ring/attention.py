"""The public entry points: ``ring_attention`` on a real process group, and ``simulate_ring``, which
runs the same schedule code for W simulated ranks in one process.

Eagerly, ``ring_attention`` calls the schedule from its own ``autograd.Function``; traced (by
``torch.compile``, export, make_fx) it calls the custom ops of ``ops.py`` instead, which Dynamo and
AOTAutograd see as one node each and the graph pass expands. Both run the same schedule code. It
also calls the op eagerly while a dispatch mode is active (selective activation checkpointing's
policy, ``FlopCounterMode``, ``CommDebugMode``): a mode sees an op as one call it can save, count or
replay, but sees only the kernels and collectives inside an ``autograd.Function``. The
eager path skips the custom op's per-call dispatch (argument binding and its autograd wrapper:
0.16-0.36 ms per fwd+bwd call at 2K-4K tokens, H200), and its backward gets the 16-bit out's grad:
exact mode's fp32 out, kept for the backward, is not handed to autograd, so no fp32 gradient is
made and cast back.
"""
import math
import operator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import ops
from .comm import ProcessGroupComm
from .consistency import check as check_consistency
from .documents import documents
from .kernels import kernel_named, resolve_backend
from .mesh import check_device, resolve_group
from .schedules import get_schedule
from .sharding import from_rank_major
from .simulated import SimWorld
from .validation import check_int, check_options, check_qkv


def _prepare(q, k, v, *, schedule, is_causal, scale, precision, backend, attn_mask, dropout_p,
             cu_seqlens, max_seqlen, world_size, seq_len):
    check_qkv(q, k, v)
    check_options(is_causal=is_causal, scale=scale, precision=precision, attn_mask=attn_mask,
                  dropout_p=dropout_p)
    sched = get_schedule(schedule)
    docs = documents(cu_seqlens, max_seqlen, seq_len,
                     sched.layout.document_multiple(world_size), sched.layout.name, q.device,
                     world_size)
    # Under torch.compile a head dim seen to change (the same code compiled again) becomes
    # symbolic, which resolve_backend (a constant) cannot take. operator.index makes Dynamo
    # specialise it (a guard on its value); int() and math.trunc leave it symbolic.
    head_dim = operator.index(q.shape[-1])
    kernel = kernel_named(resolve_backend(backend, q.device, q.dtype, head_dim, precision,
                                          docs is not None))
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    return sched, dict(is_causal=is_causal, scale=scale, kernel=kernel, docs=docs)


def ring_attention(q, k, v, *, mesh, schedule="zigzag", is_causal=False, scale=None,
                   precision="fp32", backend="auto", attn_mask=None, dropout_p=0.0,
                   cu_seqlens=None, max_seqlen=None):
    """Attention over the whole sequence from this rank's shards; returns this rank's output shard.

    q [B, Hq, S_local, D], k/v [B, Hkv, S_local, D] hold this rank's tokens in the schedule's
    layout (``shard_sequence(x, mesh, layout=SCHEDULE_LAYOUT[schedule])``).

    Packed documents: ``cu_seqlens`` = [0, l1, l1+l2, ..., S], the document boundaries over the
    global sequence (the same for every batch row), with the shards in the layout's per-document
    form (``shard_sequence(..., cu_seqlens=cu_seqlens)``); attention stays within each document.
    ``max_seqlen``: the longest document's length (an upper bound will do); with ``cu_seqlens`` on
    the device, give it to avoid reading the boundaries back to the host (``documents.py``).
    """
    group = resolve_group(mesh)
    world = dist.get_world_size(group)
    sched, options = _prepare(q, k, v, schedule=schedule, is_causal=is_causal, scale=scale,
                              precision=precision, backend=backend, attn_mask=attn_mask,
                              dropout_p=dropout_p, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                              world_size=world, seq_len=q.shape[2] * world)
    check_device(mesh, q, "query")
    sched.layout.check_local_len(q.shape[2], "query.shape[2] (local sequence length)")
    docs = options["docs"]
    if not _use_op(q):
        check_consistency(group, q, k, schedule=schedule, is_causal=is_causal,
                          precision=precision, scale=options["scale"],
                          cu_seqlens=None if docs is None else docs.cu)  # ops.py checks the rest
        return _Ring.apply(q, k, v, group, sched, options)
    # The documents' boundaries go into the graph as a tensor (new boundaries: no recompile);
    # the bound on their length sizes kernel grids, so it is a constant of the graph
    # (operator.index: Dynamo specialises it, as the head dim above).
    out, _ = ops.ring_attention_fwd(q, k, v, group.group_name, schedule, is_causal,
                                    options["scale"], options["kernel"].name, precision,
                                    None if docs is None else docs.cu,
                                    0 if docs is None else operator.index(docs.max_len))
    return out.to(q.dtype)  # exact kernels leave the merged out in fp32 (kept for the backward)


def _use_op(x: torch.Tensor) -> bool:
    """Whether to call the custom op: while this call is traced (Dynamo, export, make_fx, fake
    tensors), which must see one node, not the schedule's Python loop, and while a dispatch mode
    is active (see the module docstring)."""
    return (torch.compiler.is_compiling() or get_proxy_mode() is not None or is_fake(x)
            or torch._C._len_torch_dispatch_stack() > 0)


class _Ring(torch.autograd.Function):
    """Eager ``ring_attention`` (see the module docstring): the schedule on the process group."""

    @staticmethod
    def forward(ctx, q, k, v, group, schedule, options):
        out, lse = schedule.forward(ProcessGroupComm(group), q, k, v, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.schedule, ctx.options = group, schedule, options
        return out.to(q.dtype)  # exact kernels leave the merged out in fp32: saved, not returned

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.schedule.backward(ProcessGroupComm(ctx.group), dout, q, k, v, out,
                                           lse, **ctx.options)
        return dq, dk, dv, None, None, None


def _shard_all(x, layout, world, docs):
    local = x.shape[2] // world
    return [x.index_select(2, layout.positions(local, r, world, docs).to(x.device))
            for r in range(world)]


def _unshard_all(parts, layout, world, docs):
    return from_rank_major(torch.cat(parts, 2), layout, world, 2, docs)


class _SimulatedRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, world, schedule, options):
        docs = options["docs"]
        shards = [_shard_all(x, schedule.layout, world, docs) for x in (q, k, v)]
        results = SimWorld(world).run(
            lambda comm: schedule.forward(comm, *(s[comm.rank] for s in shards), **options))
        ctx.shards, ctx.results = shards, results
        ctx.world, ctx.schedule, ctx.options = world, schedule, options
        # .to: exact kernels leave the merged out in fp32 (kept in ctx.results for the backward)
        return _unshard_all([out.to(q.dtype) for out, _ in results], schedule.layout, world, docs)

    @staticmethod
    def backward(ctx, dout):
        world, layout, docs = ctx.world, ctx.schedule.layout, ctx.options["docs"]
        douts = _shard_all(dout.contiguous(), layout, world, docs)

        def rank_backward(comm):
            q, k, v = (s[comm.rank] for s in ctx.shards)
            out, lse = ctx.results[comm.rank]
            return ctx.schedule.backward(comm, douts[comm.rank], q, k, v, out, lse, **ctx.options)

        grads = SimWorld(world).run(rank_backward)
        dq, dk, dv = (_unshard_all([g[i] for g in grads], layout, world, docs) for i in range(3))
        return dq, dk, dv, None, None, None


def simulate_ring(q, k, v, *, world_size, schedule="zigzag", is_causal=False, scale=None,
                  precision="fp32", backend="auto", attn_mask=None, dropout_p=0.0,
                  cu_seqlens=None, max_seqlen=None):
    """``ring_attention`` for ``world_size`` simulated ranks in this process.

    Whole tensors in natural order in and out; each simulated rank runs the real schedule on its
    shard with the same kernels and arithmetic, so numerics at large W are testable on one device.
    ``cu_seqlens`` / ``max_seqlen``: packed documents, as in ``ring_attention``.
    """
    check_int(world_size, "world_size", 1, "a positive int")
    check_qkv(q, k, v)
    get_schedule(schedule).layout.check_global_len(q.shape[2], world_size,
                                                   "query.shape[2] (sequence length)")
    sched, options = _prepare(q, k, v, schedule=schedule, is_causal=is_causal, scale=scale,
                              precision=precision, backend=backend, attn_mask=attn_mask,
                              dropout_p=dropout_p, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                              world_size=world_size, seq_len=q.shape[2])
    return _SimulatedRing.apply(q, k, v, world_size, sched, options)
