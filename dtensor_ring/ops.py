"""The ring schedules as ``torch.library`` custom ops, so Dynamo and AOTAutograd see single nodes.

    dtensor_ring::ring_attention_fwd(q, k, v, group_name, schedule, is_causal, scale, backend,
                                     precision, cu_seqlens, max_seqlen, window_left,
                                     window_right) -> (out, lse)
                                                                  out: fp32 if precision="exact"
    dtensor_ring::ring_attention_bwd(dout, q, k, v, out, lse, group_name, ...) -> (dq, dk, dv)

The process group travels by name (``ProcessGroup.group_name``), as in PyTorch's functional
collectives, since an op schema cannot hold a Python object. Packed documents travel as their
boundaries (``cu_seqlens``: int32 on the inputs' device, already checked, or None) and the bound
on their length (``max_seqlen``; 0 without documents), so a compiled graph takes new boundaries
as a new input, not a recompile. A sliding window travels as two ints (``window_left``,
``window_right``; -1, -1: none): a static attribute of the node, so calls with the same window
share a graph. Each op sits next to its fake implementation; autograd connects
the two. ``ring_attention`` calls these ops; the compile pass (``dtensor_ring.passes``) finds them
in the graph and expands them into explicit steps.
"""
from typing import Optional

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from .comm import ProcessGroupComm
from .consistency import check as check_consistency
from .kernels import get_kernel
from .layouts.boundaries import Documents
from .layouts.windows import from_args
from .schedules import get_schedule


def schedule_call(schedule, q, backend, precision, cu_seqlens, max_seqlen, window_left=-1,
                  window_right=-1):
    """The schedule, its kernel and its keyword options for an op's arguments."""
    docs = None if cu_seqlens is None else Documents.of(cu_seqlens, max_seqlen)
    window = from_args(window_left, window_right)
    kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1], precision, docs is not None,
                        window is not None)
    return get_schedule(schedule), dict(kernel=kernel, docs=docs, window=window)


@torch.library.custom_op("dtensor_ring::ring_attention_fwd", mutates_args=())
def ring_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                       schedule: str, is_causal: bool, scale: float, backend: str,
                       precision: str, cu_seqlens: Optional[torch.Tensor], max_seqlen: int,
                       window_left: int, window_right: int) -> tuple[torch.Tensor, torch.Tensor]:
    comm = ProcessGroupComm(_resolve_process_group(group_name))
    check_consistency(comm.group, q, k, schedule=schedule, is_causal=is_causal,
                      precision=precision, scale=scale, cu_seqlens=cu_seqlens,
                      window=from_args(window_left, window_right))  # before the first exchange
    sched, options = schedule_call(schedule, q, backend, precision, cu_seqlens, max_seqlen,
                                   window_left, window_right)
    return sched.forward(comm, q, k, v, is_causal=is_causal, scale=scale, **options)


@ring_attention_fwd.register_fake
def _(q, k, v, group_name, schedule, is_causal, scale, backend, precision, cu_seqlens,
      max_seqlen, window_left, window_right):
    # Traced (torch.compile), the ranks agree here, once per graph (consistency.py).
    check_consistency(_resolve_process_group(group_name), q, k, schedule=schedule,
                      is_causal=is_causal, precision=precision, scale=scale,
                      cu_seqlens=cu_seqlens, window=from_args(window_left, window_right))
    # Exact mode keeps the merged out in fp32 (its backward reads it); callers cast it.
    out_dtype = torch.float32 if precision == "exact" else q.dtype
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("dtensor_ring::ring_attention_bwd", mutates_args=())
def ring_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, group_name: str, schedule: str,
                       is_causal: bool, scale: float, backend: str, precision: str,
                       cu_seqlens: Optional[torch.Tensor], max_seqlen: int, window_left: int,
                       window_right: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    comm = ProcessGroupComm(_resolve_process_group(group_name))
    sched, options = schedule_call(schedule, q, backend, precision, cu_seqlens, max_seqlen,
                                   window_left, window_right)
    return sched.backward(comm, dout, q, k, v, out, lse, is_causal=is_causal,
                          scale=scale, **options)


@ring_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, group_name, schedule, is_causal, scale, backend, precision,
      cu_seqlens, max_seqlen, window_left, window_right):
    # Contiguous, as the schedules return them, whatever the strides of q/k/v (a model's are often
    # transposed views): a graph traced with empty_like's strides made views the real dq breaks.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_OPTIONS = ("group_name", "schedule", "is_causal", "scale", "backend", "precision",
            "cu_seqlens", "max_seqlen", "window_left", "window_right")


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.options = options


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_attention_bwd(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * len(_OPTIONS)


ring_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
