"""The hybrid schedule as ``torch.library`` custom ops, beside the ring's (``dtensor_ring/ops.py``):

    dtensor_ring::hybrid_attention_fwd(q, k, v, outer_group, inner_group, whole_group, schedule,
                                       is_causal, scale, backend, precision, cu_seqlens,
                                       max_seqlen) -> (out, lse)
    dtensor_ring::hybrid_attention_bwd(dout, q, k, v, out, lse, outer_group, ...) -> (dq, dk, dv)

The same arguments as the ring's ops, with three process groups by name instead of one and no
window: the ring's (outer), the all-to-all's (inner) and one of all the mesh's ranks
(``comm/mesh.SequenceMesh.whole``, for the agreement check); a ``RingCall``'s (``call.py``) on a
2-D mesh. Tensors in and out are this rank's shards ([B, H, S_local, D] in the hybrid layout), as
for the ring; the ops' bodies are the ring's (``ops.py``), and the compile pass expands both
levels of each node.
"""
from typing import Optional

import torch

from ..ops import backward, fake_backward, fake_forward, forward, register_autograd


@torch.library.custom_op("dtensor_ring::hybrid_attention_fwd", mutates_args=())
def hybrid_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, outer_group: str,
                         inner_group: str, whole_group: str, schedule: str, is_causal: bool,
                         scale: float, backend: str, precision: str,
                         cu_seqlens: Optional[torch.Tensor],
                         max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, (outer_group, inner_group, whole_group),
                   (schedule, is_causal, scale, backend, precision, cu_seqlens, max_seqlen))


@hybrid_attention_fwd.register_fake
def _(q, k, v, outer_group, inner_group, whole_group, *options):
    return fake_forward(q, k, v, (outer_group, inner_group, whole_group), options)


@torch.library.custom_op("dtensor_ring::hybrid_attention_bwd", mutates_args=())
def hybrid_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, outer_group: str, inner_group: str,
                         whole_group: str, schedule: str, is_causal: bool, scale: float,
                         backend: str, precision: str, cu_seqlens: Optional[torch.Tensor],
                         max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(dout, q, k, v, out, lse, (outer_group, inner_group, whole_group),
                    (schedule, is_causal, scale, backend, precision, cu_seqlens, max_seqlen))


@hybrid_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, *options):
    return fake_backward(q, k, v)


register_autograd(hybrid_attention_fwd, hybrid_attention_bwd)
