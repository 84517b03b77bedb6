"""The public entry points: ``ring_attention`` on a real process group, and ``simulate_ring``, which
runs the same schedule code for W simulated ranks in one process.

Eagerly, ``ring_attention`` calls the schedule from its own ``autograd.Function``; traced (by
``torch.compile``, export, make_fx) it calls the custom ops of ``ops.py`` instead, which Dynamo and
AOTAutograd see as one node each and the graph pass expands. Both run the same schedule code. It
also calls the op eagerly while a dispatch mode is active (selective activation checkpointing's
policy, ``FlopCounterMode``, ``CommDebugMode``): a mode sees an op as one call it can save, count or
replay, but sees only the kernels and collectives inside an ``autograd.Function``. The
eager path skips the custom op's per-call dispatch (argument binding and its autograd wrapper,
host time that shows at short lengths: docs/design.md, "Measurements behind design choices"), and
its backward gets the 16-bit out's grad:
exact mode's fp32 out, kept for the backward, is not handed to autograd, so no fp32 gradient is
made and cast back.
"""
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import ops
from .call import RingCall
from .comm.mesh import check_device, resolve_mesh
from .comm.simulated import simulated_mesh
from .hybrid import ops as hybrid_ops
from .hybrid.comm import process_group_comm
from .hybrid.heads import head_split
from .hybrid.schedule import placed_schedule
from .layouts.windows import check_window
from .schedules import get_schedule
from .sharding import from_rank_major
from .validation import check_int, check_options, check_qkv


def _prepare(q, k, v, *, schedule, is_causal, scale, precision, backend, attn_mask, dropout_p,
             cu_seqlens, max_seqlen, window, mesh_shape, seq_len):
    """The public arguments checked and resolved into (``RingCall``, its ``Documents`` or None).
    ``mesh_shape``: (ring ranks, all-to-all ranks); (W, 1) for a 1-D mesh."""
    check_qkv(q, k, v)
    check_options(is_causal=is_causal, scale=scale, precision=precision, attn_mask=attn_mask,
                  dropout_p=dropout_p)
    window = check_window(window)
    if window is not None and mesh_shape[1] > 1:
        raise ValueError(f"window={tuple(window)} with a 2-D mesh of shape {tuple(mesh_shape)}: sliding "
                         "windows run on a 1-D mesh (the hybrid schedule takes none)")
    return RingCall.resolve(q, schedule=schedule, mesh_shape=mesh_shape, is_causal=is_causal,
                            scale=scale, backend=backend, precision=precision, window=window,
                            seq_len=seq_len, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


def ring_attention(q, k, v, *, mesh, schedule="zigzag", is_causal=False, scale=None,
                   precision="fp32", backend="auto", attn_mask=None, dropout_p=0.0,
                   cu_seqlens=None, max_seqlen=None, window=None):
    """Attention over the whole sequence from this rank's shards; returns this rank's output shard.

    ``F.scaled_dot_product_attention`` of the whole (global) q, k, v, computed as a ring schedule
    over the ranks of ``mesh``: each rank passes its shard of the sequence and gets its shard of
    the output. A collective: every rank of ``mesh`` calls it with the same arguments (shapes,
    schedule, options); ranks that disagree all raise the same ``ValueError`` before any
    exchange (``consistency.py``). Differentiable in q, k and v; traceable by ``torch.compile``
    (one custom-op node, expanded by the compile pass).

    q [B, Hq, S_local, D], k/v [B, Hkv, S_local, D] hold this rank's tokens in the schedule's
    layout (``shard_sequence(x, mesh, layout=SCHEDULE_LAYOUT[schedule])``).

    Packed documents: ``cu_seqlens`` = [0, l1, l1+l2, ..., S], the document boundaries over the
    global sequence (the same for every batch row), with the shards in the layout's per-document
    form (``shard_sequence(..., cu_seqlens=cu_seqlens)``); attention stays within each document.
    ``max_seqlen``: the longest document's length (an upper bound will do); with ``cu_seqlens`` on
    the device, give it to avoid reading the boundaries back to the host (``documents.py``).

    Sliding window: ``window=(left, right)``, a query at position p sees the keys at p - left ..
    p + right (-1: unbounded; with ``is_causal`` the right side is the diagonal); Hugging Face's
    ``sliding_window=w`` is ``(w - 1, 0)`` (``layouts/windows.py``). Only the ranks within reach
    exchange K/V (``schedules/windowed.py``); with documents, within each document.

    ``mesh``: 1-D (the ring over it), or 2-D (ring ranks, all-to-all ranks): the schedule over the
    first dimension on head groups gathered by an all-to-all over the second
    (``dtensor_ring/hybrid/``); the shards are then in the hybrid layout
    (``shard_sequence(x, mesh, layout=...)`` with the same 2-D mesh).

    Args:
        q (torch.Tensor): [B, Hq, S_local, D], this rank's queries; any floating dtype a block
            kernel takes on its device (bf16 and fp16 run the fast kernels; fp32 runs too).
        k (torch.Tensor): [B, Hkv, S_local, D], this rank's keys: q's dtype, device, batch,
            local length and head dim; Hkv divides Hq (GQA: K/V travel at Hkv heads, never
            repeated).
        v (torch.Tensor): [B, Hkv, S_local, D], this rank's values, k's shape.
        mesh (DeviceMesh | ProcessGroup): the sequence ranks, keyword-only: a 1-D
            ``DeviceMesh`` (e.g. ``mesh["cp"]``) or a ``ProcessGroup``, or a 2-D ``DeviceMesh``
            (ring ranks, all-to-all ranks), e.g. ``mesh["cp_ring", "cp_a2a"]``. A
            ``DeviceMesh``'s device type must be the tensors'.
        schedule (str): ``"zigzag"`` (default), ``"ring"``, ``"stripe"``, ``"llama3"`` (keys of
            ``dr.SCHEDULES``) or ``"auto"`` (zigzag shards; the exchange picked per call:
            docs/design.md, "The cost model of auto"). The shards must be in
            ``dr.SCHEDULE_LAYOUT[schedule]``.
        is_causal (bool): the causal mask over global positions (a query sees the keys at and
            before its position; with documents, within its document). Default False.
        scale (float | None): the softmax scale, a positive number; None (default):
            1 / sqrt(D).
        precision (str): ``"fp32"`` (default: each block's result merged and summed in fp32)
            or ``"exact"`` (fp32 block results: error independent of the ranks' count).
        backend (str): the block kernel: ``"auto"`` (default: the first available kernel of
            the precision's registry, ``kernels/__init__.py``), a key of ``dr.BACKENDS``
            (``precision="fp32"``) or of the exact kernels' registry (``*_exact``, either
            precision).
        attn_mask (None): must be None (SDPA's argument, not supported: use ``is_causal``,
            ``cu_seqlens`` or ``window``).
        dropout_p (float): must be 0.0 (SDPA's argument, not supported).
        cu_seqlens (torch.Tensor | list[int] | None): packed documents' boundaries over the
            global sequence, [0, l1, l1+l2, ..., S] with S = S_local x the mesh's size: a 1-D
            integer tensor (on the CPU or on q's device) or a list of ints, strictly increasing;
            each document the layout cuts across the ranks a multiple of its factor (zigzag:
            2 x the ring's size, stripe: the ring's size; ``dr.pad_documents`` pads them).
            None (default): one sequence per batch row.
        max_seqlen (int | None): with ``cu_seqlens``, a positive bound on the longest
            document's length, at least that length; None (default): read from ``cu_seqlens``
            (one device-to-host copy when it is on the device).
        window (tuple[int, int] | None): a sliding window ``(left, right)``, two ints >= -1
            (-1: unbounded); 1-D meshes only. None (default): no window.

    Returns:
        torch.Tensor: this rank's output shard, [B, Hq, S_local, D] in q's dtype and device, in
        the same layout as q (``dr.unshard_sequence`` gathers the whole output).

    Raises:
        TypeError: q, k or v not a tensor; ``is_causal`` not a bool; ``mesh`` not a
            ``DeviceMesh`` or ``ProcessGroup``; ``cu_seqlens`` not an integer tensor or a list
            of ints.
        ValueError: (each naming the argument, its value and what is valid) q, k, v not 4-D,
            not floating point, or with mismatched dtypes, devices, batch, local length or
            head dim, or Hkv not dividing Hq; a local length the layout cannot hold (zigzag:
            even); an unknown ``schedule``, ``precision`` or ``backend``, or a backend that
            cannot run these inputs; ``scale`` not positive; ``attn_mask`` or ``dropout_p``
            given; a malformed ``window``, or one on a 2-D mesh; ``cu_seqlens`` / ``max_seqlen``
            not as described; tensors on another device type than the mesh's; on a 2-D mesh,
            head counts that do not split over the all-to-all ranks; ranks whose calls
            disagree.
    """
    key = _checked_key(q, k, v, mesh, schedule, is_causal, scale, precision, backend, attn_mask,
                       dropout_p, cu_seqlens, max_seqlen, window)
    known = _CHECKED.get(key) if key is not None else None
    if known is not None and known[0] is mesh:
        _, seq_mesh, call = known
        docs = None
    else:
        seq_mesh = resolve_mesh(mesh)
        call, docs = _prepare(q, k, v, schedule=schedule, is_causal=is_causal, scale=scale,
                              precision=precision, backend=backend, attn_mask=attn_mask,
                              dropout_p=dropout_p, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                              window=window, mesh_shape=seq_mesh.shape,
                              seq_len=q.shape[2] * seq_mesh.world_size)
        check_device(mesh, q, "query")
        call.placed.layout.check_local_len(q.shape[2], "query.shape[2] (local sequence length)")
        if key is not None:
            if len(_CHECKED) >= _CHECKED_MAX:
                _CHECKED.clear()
            _CHECKED[key] = (mesh, seq_mesh, call)
    cu = None if docs is None else docs.cu
    if key is not None or not _use_op(q):  # a key is made only for calls that are not traced
        call.check(seq_mesh.check_group, q, k, cu)  # ops.py checks the rest
        return _Ring.apply(q, k, v, seq_mesh, call, docs)
    # The documents' boundaries go into the graph as a tensor (new boundaries: no recompile).
    op = ops.ring_attention_fwd if seq_mesh.inner is None else hybrid_ops.hybrid_attention_fwd
    out, _ = op(q, k, v, *call.op_args(seq_mesh.group_names, cu))
    return out.to(q.dtype)  # exact kernels leave the merged out in fp32 (kept for the backward)


# Eager calls without documents whose arguments passed every check above, by what the checks
# read: the mesh (by identity), the options and the tensors' shapes, dtypes and devices. A model
# makes the same call at every layer and step; this skips its checks and resolution, a tenth of
# the host time before the first kernel starts (docs/design.md, "Host time of an eager call").
_CHECKED: dict = {}
_CHECKED_MAX = 256


def _checked_key(q, k, v, mesh, schedule, is_causal, scale, precision, backend, attn_mask,
                 dropout_p, cu_seqlens, max_seqlen, window):
    """``_CHECKED``'s key of an eager call without documents, else None. Each option with its
    type, so that a value the checks refuse for its type (``is_causal=1``) never meets the key
    of an accepted one it equals (``True``)."""
    if (cu_seqlens is not None or max_seqlen is not None or attn_mask is not None
            or not all(type(x) is torch.Tensor for x in (q, k, v)) or _use_op(q)):
        return None
    try:
        key = (id(mesh), *map(_typed, (schedule, is_causal, scale, precision, backend, dropout_p,
                                       window)),
               *((x.shape, x.dtype, x.device) for x in (q, k, v)))
        hash(key)
    except TypeError:  # an unhashable option: checked every time (and likely refused)
        return None
    return key


def _typed(option):
    if isinstance(option, (list, tuple)):
        return type(option), tuple(map(_typed, option))
    return type(option), option


def _use_op(x: torch.Tensor) -> bool:
    """Whether to call the custom op: while this call is traced (Dynamo, export, make_fx, fake
    tensors), which must see one node, not the schedule's Python loop, and while a dispatch mode
    is active (see the module docstring)."""
    return (torch.compiler.is_compiling() or get_proxy_mode() is not None or is_fake(x)
            or torch._C._len_torch_dispatch_stack() > 0)


class _Ring(torch.autograd.Function):
    """Eager ``ring_attention`` (see the module docstring): the call on the mesh's process groups
    (a ``comm/mesh.SequenceMesh``)."""

    @staticmethod
    def forward(ctx, q, k, v, mesh, call, docs):
        out, lse = call.forward(process_group_comm(mesh), q, k, v, docs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mesh, ctx.call, ctx.docs = mesh, call, docs
        return out.to(q.dtype)  # exact kernels leave the merged out in fp32: saved, not returned

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.call.backward(process_group_comm(ctx.mesh), dout, q, k, v, out, lse,
                                       ctx.docs)
        return dq, dk, dv, None, None, None


def _shard_all(x, layout, world, docs):
    local = x.shape[2] // world
    return [x.index_select(2, layout.positions(local, r, world, docs).to(x.device))
            for r in range(world)]


def _unshard_all(parts, layout, world, docs):
    return from_rank_major(torch.cat(parts, 2), layout, world, 2, docs)


class _SimulatedRing(torch.autograd.Function):
    """``world``: W simulated ranks, or (ring ranks, all-to-all ranks) for a 2-D mesh."""

    @staticmethod
    def forward(ctx, q, k, v, world, call, docs):
        ctx.mesh = world  # a fresh simulated mesh of this shape for the backward
        sim = simulated_mesh(world)
        world, layout = sim.world_size, call.placed.layout
        shards = [_shard_all(x, layout, world, docs) for x in (q, k, v)]
        results = sim.run(
            lambda comm: call.forward(comm, *(s[comm.rank] for s in shards), docs))
        ctx.shards, ctx.results = shards, results
        ctx.world, ctx.call, ctx.docs = world, call, docs
        # .to: exact kernels leave the merged out in fp32 (kept in ctx.results for the backward)
        return _unshard_all([out.to(q.dtype) for out, _ in results], layout, world, docs)

    @staticmethod
    def backward(ctx, dout):
        world, layout, docs = ctx.world, ctx.call.placed.layout, ctx.docs
        douts = _shard_all(dout.contiguous(), layout, world, docs)

        def rank_backward(comm):
            q, k, v = (s[comm.rank] for s in ctx.shards)
            out, lse = ctx.results[comm.rank]
            return ctx.call.backward(comm, douts[comm.rank], q, k, v, out, lse, docs)

        grads = simulated_mesh(ctx.mesh).run(rank_backward)
        dq, dk, dv = (_unshard_all([g[i] for g in grads], layout, world, docs) for i in range(3))
        return dq, dk, dv, None, None, None


def simulate_ring(q, k, v, *, world_size, schedule="zigzag", is_causal=False, scale=None,
                  precision="fp32", backend="auto", attn_mask=None, dropout_p=0.0,
                  cu_seqlens=None, max_seqlen=None, window=None):
    """``ring_attention`` for ``world_size`` simulated ranks in this process.

    Whole tensors in natural order in and out; each simulated rank runs the real schedule on its
    shard with the same kernels and arithmetic, so numerics at large W are testable on one device.
    ``world_size``: W ranks of a 1-D mesh, or (ring ranks, all-to-all ranks) of a 2-D one, e.g.
    ``(8, 8)`` for W = 64 as 8 nodes of 8 GPUs. ``cu_seqlens`` / ``max_seqlen``: packed documents,
    ``window``: a sliding window (1-D only), as in ``ring_attention``.

    No process group is needed: the ranks are simulated one after another in this process, and
    their exchanges are copies. Differentiable in q, k and v (the backward runs the schedule's
    backward on the simulated ranks).

    Args:
        q (torch.Tensor): [B, Hq, S, D], the whole sequence's queries in natural order; any
            floating dtype a block kernel takes on its device.
        k (torch.Tensor): [B, Hkv, S, D]: q's dtype, device, batch, length and head dim; Hkv
            divides Hq.
        v (torch.Tensor): [B, Hkv, S, D], k's shape.
        world_size (int | tuple[int, int]): keyword-only: W >= 1 simulated ranks of a 1-D
            mesh, or (ring ranks, all-to-all ranks) of a 2-D one, each >= 1. S must split as
            the schedule's layout needs on them (zigzag: S a multiple of 2W).
        schedule, is_causal, scale, precision, backend, attn_mask, dropout_p, cu_seqlens,
            max_seqlen, window: as in ``ring_attention`` (``cu_seqlens`` over S).

    Returns:
        torch.Tensor: the whole output, [B, Hq, S, D] in q's dtype and device, in natural
        order: what ``ring_attention`` on ``world_size`` ranks gives, unsharded (the same bits
        on gloo ranks: tests/test_ring_attention_gloo.py).

    Raises:
        ValueError: ``world_size`` not a positive int or a pair of them; S not divisible as the
            layout needs; on a 2-D ``world_size``, head counts that do not split over its
            all-to-all ranks; and every error of ``ring_attention`` (TypeError included) but
            the mesh's and the ranks' disagreement.
    """
    shape = _mesh_shape(world_size)
    check_qkv(q, k, v)
    placed_schedule(get_schedule(schedule), *shape).layout.check_global_len(
        q.shape[2], shape[0] * shape[1], "query.shape[2] (sequence length)")
    if shape[1] > 1:
        head_split(q.shape[1], k.shape[1], shape[1])
    call, docs = _prepare(q, k, v, schedule=schedule, is_causal=is_causal, scale=scale,
                          precision=precision, backend=backend, attn_mask=attn_mask,
                          dropout_p=dropout_p, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                          window=window, mesh_shape=shape, seq_len=q.shape[2])
    return _SimulatedRing.apply(q, k, v, world_size, call, docs)


def _mesh_shape(world_size) -> tuple[int, int]:
    """``simulate_ring``'s ``world_size`` as (ring ranks, all-to-all ranks)."""
    if isinstance(world_size, tuple) and len(world_size) == 2:
        for size in world_size:
            check_int(size, "world_size", 1, "a positive int or a pair of them (ring ranks, "
                      "all-to-all ranks)")
        return world_size
    check_int(world_size, "world_size", 1, "a positive int or a pair of them (ring ranks, "
              "all-to-all ranks)")
    return world_size, 1
