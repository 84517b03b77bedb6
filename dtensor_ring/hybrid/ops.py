"""The hybrid schedule as ``torch.library`` custom ops, beside the ring's (``dtensor_ring/ops.py``):

    dtensor_ring::hybrid_attention_fwd(q, k, v, outer_group, inner_group, whole_group, schedule,
                                       is_causal, scale, backend, precision, cu_seqlens,
                                       max_seqlen) -> (out, lse)
    dtensor_ring::hybrid_attention_bwd(dout, q, k, v, out, lse, outer_group, ...) -> (dq, dk, dv)

The same arguments as the ring's ops, with three process groups by name instead of one: the ring's
(outer), the all-to-all's (inner) and one of all the mesh's ranks (``comm/mesh.SequenceMesh.whole``,
for the agreement check). Tensors in and out are this rank's shards ([B, H, S_local, D] in the
hybrid layout), as for the ring; the compile pass expands both levels of each node.
"""
from typing import Optional

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from ..comm.mesh import SequenceMesh
from ..consistency import check as check_consistency
from ..ops import schedule_call
from .comm import process_group_comm
from .heads import head_split
from .schedule import placed_schedule


def mesh_of(outer_group: str, inner_group: str, whole_group: str) -> SequenceMesh:
    return SequenceMesh(*map(_resolve_process_group, (outer_group, inner_group, whole_group)))


def hybrid_call(schedule, q, backend, precision, cu_seqlens, max_seqlen, mesh_shape):
    """``ops.schedule_call`` on a 2-D mesh: the hybrid schedule around the named one."""
    sched, options = schedule_call(schedule, q, backend, precision, cu_seqlens, max_seqlen)
    return placed_schedule(sched, *mesh_shape), options


def _check(mesh: SequenceMesh, q, k, schedule, is_causal, precision, scale, cu_seqlens):
    """The ranks' agreement (before any exchange), then what only the hybrid needs of the heads
    (the same on every rank once they agree)."""
    check_consistency(mesh.check_group, q, k, schedule=schedule, is_causal=is_causal,
                      precision=precision, scale=scale, cu_seqlens=cu_seqlens, mesh=mesh.shape)
    head_split(q.shape[1], k.shape[1], mesh.inner_size)


@torch.library.custom_op("dtensor_ring::hybrid_attention_fwd", mutates_args=())
def hybrid_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, outer_group: str,
                         inner_group: str, whole_group: str, schedule: str, is_causal: bool,
                         scale: float, backend: str, precision: str,
                         cu_seqlens: Optional[torch.Tensor],
                         max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    mesh = mesh_of(outer_group, inner_group, whole_group)
    _check(mesh, q, k, schedule, is_causal, precision, scale, cu_seqlens)
    sched, options = hybrid_call(schedule, q, backend, precision, cu_seqlens, max_seqlen,
                                 mesh.shape)
    return sched.forward(process_group_comm(mesh), q, k, v, is_causal=is_causal, scale=scale,
                         **options)


@hybrid_attention_fwd.register_fake
def _(q, k, v, outer_group, inner_group, whole_group, schedule, is_causal, scale, backend,
      precision, cu_seqlens, max_seqlen):
    # Traced (torch.compile), the ranks agree here, once per graph (consistency.py).
    _check(mesh_of(outer_group, inner_group, whole_group), q, k, schedule, is_causal, precision,
           scale, cu_seqlens)
    out_dtype = torch.float32 if precision == "exact" else q.dtype
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("dtensor_ring::hybrid_attention_bwd", mutates_args=())
def hybrid_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, outer_group: str, inner_group: str,
                         whole_group: str, schedule: str, is_causal: bool, scale: float,
                         backend: str, precision: str, cu_seqlens: Optional[torch.Tensor],
                         max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mesh = mesh_of(outer_group, inner_group, whole_group)
    sched, options = hybrid_call(schedule, q, backend, precision, cu_seqlens, max_seqlen,
                                 mesh.shape)
    return sched.backward(process_group_comm(mesh), dout, q, k, v, out, lse, is_causal=is_causal,
                          scale=scale, **options)


@hybrid_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_OPTIONS = 10  # outer_group .. max_seqlen


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.options = options


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = hybrid_attention_bwd(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * _OPTIONS


hybrid_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
