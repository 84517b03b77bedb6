"""The ring schedules as ``torch.library`` custom ops, so Dynamo and AOTAutograd see single nodes.

    dtensor_ring::ring_attention_fwd(q, k, v, group_name, schedule, is_causal, scale, backend,
                                     precision, cu_seqlens, max_seqlen, window_left,
                                     window_right) -> (out, lse)
                                                                  out: fp32 if precision="exact"
    dtensor_ring::ring_attention_bwd(dout, q, k, v, out, lse, group_name, ...) -> (dq, dk, dv)

The arguments after the tensors are a ``RingCall``'s (``call.py``: ``op_args`` writes them,
``from_op_args`` reads them back). The process group travels by name (``ProcessGroup.group_name``),
as in PyTorch's functional collectives, since an op schema cannot hold a Python object. Packed
documents travel as their boundaries (``cu_seqlens``: int32 on the inputs' device, already
checked, or None) and the bound on their length (``max_seqlen``; 0 without documents), so a
compiled graph takes new boundaries as a new input, not a recompile. A sliding window travels as
two ints (``window_left``, ``window_right``; -1, -1: none): a static attribute of the node, so
calls with the same window share a graph. Each op sits next to its fake implementation; autograd
connects the two. ``ring_attention`` calls these ops; the compile pass (``dtensor_ring.passes``)
finds them in the graph and expands them into explicit steps. The bodies here serve the hybrid's
ops too (``hybrid/ops.py``: three process groups, no window).
"""
import operator
from typing import Optional

import torch

from .call import RingCall
from .comm.mesh import SequenceMesh
from .hybrid.comm import process_group_comm


def forward(q, k, v, groups: tuple, options: tuple):
    """A forward op's body: ``groups`` and ``options``, its arguments after q, k, v
    (``RingCall.from_op_args``)."""
    call, cu_seqlens = RingCall.from_op_args(groups, *options)
    mesh = SequenceMesh.named(*groups)
    call.check(mesh.check_group, q, k, cu_seqlens)  # before the first exchange
    return call.forward(process_group_comm(mesh), q, k, v, call.documents(cu_seqlens))


def fake_forward(q, k, v, groups: tuple, options: tuple):
    """A forward op's fake implementation. Traced (torch.compile), the ranks agree here, once per
    graph (consistency.py), and the sizes of q, k and v become constants (``static_sizes``)."""
    static_sizes(q, k, v)
    call, cu_seqlens = RingCall.from_op_args(groups, *options)
    call.check(SequenceMesh.named(*groups).check_group, q, k, cu_seqlens)
    # Exact mode keeps the merged out in fp32 (its backward reads it); callers cast it.
    out_dtype = torch.float32 if call.precision == "exact" else q.dtype
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(q.shape[:3], dtype=torch.float32)


def static_sizes(*tensors) -> None:
    """Every size of ``tensors`` as a constant of the traced graph, where Dynamo's automatic
    dynamic shapes made it symbolic (a second compile with another sequence length or head count:
    a benchmark's next row, a batch of another length): ``operator.index`` makes Dynamo
    specialise it, with a guard on its value, so each length compiles its own graph, the same on
    every rank. With symbolic sizes, compiled llama3 computed wrong gradients on GPUs, its
    output right (dq/dk/dv 28-280x the single-GPU kernel's error on 2 and 4 H100s, torch 2.11;
    specialising the sizes only in the compile pass, after Dynamo, did not help), and the ranks'
    graphs differed: a third length recompiled on some ranks and not on others, whose exchanges
    then met the wrong collectives (docs/design.md, "Measurements behind design choices").
    Packed documents' boundaries stay symbolic: a batch of other documents does not recompile."""
    for t in tensors:
        for size in t.shape:
            operator.index(size)


def backward(dout, q, k, v, out, lse, groups: tuple, options: tuple):
    """A backward op's body."""
    call, cu_seqlens = RingCall.from_op_args(groups, *options)
    comm = process_group_comm(SequenceMesh.named(*groups))
    return call.backward(comm, dout, q, k, v, out, lse, call.documents(cu_seqlens))


def fake_backward(q, k, v):
    # Contiguous, as the schedules return them, whatever the strides of q/k/v (a model's are often
    # transposed views): a graph traced with empty_like's strides made views the real dq breaks.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def register_autograd(forward_op, backward_op) -> None:
    """``backward_op`` as ``forward_op``'s gradient, taking the same arguments after its
    tensors."""
    def setup_context(ctx, inputs, output):
        q, k, v, *options = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.options = options

    def gradient(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward_op(dout, q, k, v, out, lse, *ctx.options)
        return (dq, dk, dv) + (None,) * len(ctx.options)

    forward_op.register_autograd(gradient, setup_context=setup_context)


@torch.library.custom_op("dtensor_ring::ring_attention_fwd", mutates_args=())
def ring_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                       schedule: str, is_causal: bool, scale: float, backend: str,
                       precision: str, cu_seqlens: Optional[torch.Tensor], max_seqlen: int,
                       window_left: int, window_right: int) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, (group_name,), (schedule, is_causal, scale, backend, precision,
                                            cu_seqlens, max_seqlen, window_left, window_right))


@ring_attention_fwd.register_fake
def _(q, k, v, group_name, *options):
    return fake_forward(q, k, v, (group_name,), options)


@torch.library.custom_op("dtensor_ring::ring_attention_bwd", mutates_args=())
def ring_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, group_name: str, schedule: str,
                       is_causal: bool, scale: float, backend: str, precision: str,
                       cu_seqlens: Optional[torch.Tensor], max_seqlen: int, window_left: int,
                       window_right: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(dout, q, k, v, out, lse, (group_name,),
                    (schedule, is_causal, scale, backend, precision, cu_seqlens, max_seqlen,
                     window_left, window_right))


@ring_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, *options):
    return fake_backward(q, k, v)


register_autograd(ring_attention_fwd, ring_attention_bwd)
