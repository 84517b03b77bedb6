"""FLOP formulas for the ring's custom ops, so ``torch.utils.flop_counter.FlopCounterMode`` counts
ring attention (``ring_attention`` calls the op while a dispatch mode is active; the mode cannot
see inside it).

Counted as ``FlopCounterMode`` counts SDPA: the whole product of this rank's queries with every
key, causal or not -- the local queries against the global keys, ``S_k = W * S_local`` -- so
the sum over the W ranks is what it counts for SDPA on the whole sequence on one device (with
packed documents too: as for SDPA with a mask, the whole product is counted).
Forward: 2 matmuls, ``4 B Hq S_q S_k D``; backward: 5 (the scores again, dV, dP, dQ, dK).
"""
import torch
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils.flop_counter import register_flop_formula

from . import ops  # noqa: F401 - registers torch.ops.dtensor_ring
from .hybrid import ops as _hybrid_ops  # noqa: F401 - registers the hybrid's ops


def _products(q_shape, *group_names) -> int:
    """B * Hq * S_q * S_k * D: one matmul's multiply-adds over the whole sequence (on a 2-D mesh
    the ring's and the all-to-all's groups: S_k = W_ring * W_a2a * S_local)."""
    batch, heads, local_len, head_dim = q_shape
    world = 1
    for name in group_names:
        world *= _resolve_process_group(name).size()
    return batch * heads * local_len * (world * local_len) * head_dim


@register_flop_formula(torch.ops.dtensor_ring.ring_attention_fwd)
def ring_attention_fwd_flops(q_shape, k_shape, v_shape, group_name, *args, **kwargs) -> int:
    return 2 * 2 * _products(q_shape, group_name)


@register_flop_formula(torch.ops.dtensor_ring.ring_attention_bwd)
def ring_attention_bwd_flops(dout_shape, q_shape, *args, **kwargs) -> int:
    group_name = args[4]  # after k, v, out, lse
    return 5 * 2 * _products(q_shape, group_name)


@register_flop_formula(torch.ops.dtensor_ring.hybrid_attention_fwd)
def hybrid_attention_fwd_flops(q_shape, k_shape, v_shape, outer_group, inner_group, *args,
                               **kwargs) -> int:
    return 2 * 2 * _products(q_shape, outer_group, inner_group)


@register_flop_formula(torch.ops.dtensor_ring.hybrid_attention_bwd)
def hybrid_attention_bwd_flops(dout_shape, q_shape, *args, **kwargs) -> int:
    return 5 * 2 * _products(q_shape, args[4], args[5])  # after k, v, out, lse
