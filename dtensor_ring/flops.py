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


def _products(q_shape, group_name) -> int:
    """B * Hq * S_q * S_k * D: one matmul's multiply-adds over the whole sequence."""
    batch, heads, local_len, head_dim = q_shape
    world = _resolve_process_group(group_name).size()
    return batch * heads * local_len * (world * local_len) * head_dim


@register_flop_formula(torch.ops.dtensor_ring.ring_attention_fwd)
def ring_attention_fwd_flops(q_shape, k_shape, v_shape, group_name, *args, **kwargs) -> int:
    return 2 * 2 * _products(q_shape, group_name)


@register_flop_formula(torch.ops.dtensor_ring.ring_attention_bwd)
def ring_attention_bwd_flops(dout_shape, q_shape, *args, **kwargs) -> int:
    group_name = args[4]  # after k, v, out, lse
    return 5 * 2 * _products(q_shape, group_name)
