"""The ring schedules as ``torch.library`` custom ops, so Dynamo and AOTAutograd see single nodes.

    dtensor_ring::ring_attention_fwd(q, k, v, group_name, schedule, is_causal, scale, backend,
                                     precision) -> (out, lse)     out: fp32 if precision="exact"
    dtensor_ring::ring_attention_bwd(dout, q, k, v, out, lse, group_name, ...) -> (dq, dk, dv)

The process group travels by name (``ProcessGroup.group_name``), as in PyTorch's functional
collectives, since an op schema cannot hold a Python object. Each op sits next to its fake
implementation; autograd connects the two. ``ring_attention`` calls these ops; the compile pass
(``dtensor_ring.passes``) finds them in the graph and expands them into explicit steps.
"""
import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from .comm import ProcessGroupComm
from .consistency import check as check_consistency
from .kernels import get_kernel
from .schedules import get_schedule


def _run(group_name, schedule, q, backend, precision):
    comm = ProcessGroupComm(_resolve_process_group(group_name))
    kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1], precision)
    return comm, get_schedule(schedule), kernel


@torch.library.custom_op("dtensor_ring::ring_attention_fwd", mutates_args=())
def ring_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                       schedule: str, is_causal: bool, scale: float, backend: str,
                       precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    comm, sched, kernel = _run(group_name, schedule, q, backend, precision)
    check_consistency(comm.group, q, k, schedule=schedule, is_causal=is_causal,
                      precision=precision, scale=scale)  # before the first exchange
    return sched.forward(comm, q, k, v, is_causal=is_causal, scale=scale, kernel=kernel)


@ring_attention_fwd.register_fake
def _(q, k, v, group_name, schedule, is_causal, scale, backend, precision):
    # Traced (torch.compile), the ranks agree here, once per graph (consistency.py).
    check_consistency(_resolve_process_group(group_name), q, k, schedule=schedule,
                      is_causal=is_causal, precision=precision, scale=scale)
    # Exact mode keeps the merged out in fp32 (its backward reads it); callers cast it.
    out_dtype = torch.float32 if precision == "exact" else q.dtype
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("dtensor_ring::ring_attention_bwd", mutates_args=())
def ring_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, group_name: str, schedule: str,
                       is_causal: bool, scale: float, backend: str,
                       precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    comm, sched, kernel = _run(group_name, schedule, q, backend, precision)
    return sched.backward(comm, dout.contiguous(), q, k, v, out, lse, is_causal=is_causal,
                          scale=scale, kernel=kernel)


@ring_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, group_name, schedule, is_causal, scale, backend, precision):
    # Contiguous, as the schedules return them, whatever the strides of q/k/v (a model's are often
    # transposed views): a graph traced with empty_like's strides made views the real dq breaks.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_OPTIONS = ("group_name", "schedule", "is_causal", "scale", "backend", "precision")


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.options = options


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_attention_bwd(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv) + (None,) * len(_OPTIONS)


ring_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
