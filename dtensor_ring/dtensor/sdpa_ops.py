"""The SDPA aten ops the rule handles, and how to read their arguments and build their results.

DTensor sees the op that ``F.scaled_dot_product_attention`` picked: on CPU the CPU flash op, on CUDA
flash, efficient or cuDNN. Under ``torch.inference_mode`` it sees SDPA itself (and, if that is
decomposed, the math op), which training mode decomposes before DTensor sees them. Forward and
backward ops of every backend are handled by the same logic; this table says where their arguments
are and what their results look like.

The LSE returned by a forward is the ring's merged fp32 LSE, [B, H, S_local] as a DTensor placed
like the query: only our own backward reads it (whatever the backend's native LSE layout).
Outputs that only the native kernels use (cumulative lengths, RNG state, debug mask) come back as
empty replicated tensors.
"""
from dataclasses import dataclass

import torch
from torch.fx.operator_schemas import normalize_function

aten = torch.ops.aten


@dataclass(frozen=True)
class SdpaOp:
    backward: bool
    mask_arg: str | None        # the optional mask / bias argument, rejected when set
    grad_arg: str = "grad_out"  # backward: the incoming gradient
    # forward: the results after (out, lse): "empty" tensors, or "max" ints (max_q, max_k)
    extras: tuple[str, ...] = ()
    # backward: how many results follow (dq, dk, dv) (efficient's bias gradient)
    extra_grads: int = 0
    out_only: bool = False  # forward returns the output alone (SDPA itself)


FORWARD_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: SdpaOp(False, "attn_mask"),
    aten._scaled_dot_product_flash_attention.default: SdpaOp(
        False, None, extras=("empty", "empty", "max", "max", "empty", "empty", "empty")),
    aten._scaled_dot_product_efficient_attention.default: SdpaOp(
        False, "attn_bias", extras=("empty", "empty")),
    aten._scaled_dot_product_cudnn_attention.default: SdpaOp(
        False, "attn_bias", extras=("empty", "empty", "max", "max", "empty", "empty", "empty")),
    aten._scaled_dot_product_attention_math.default: SdpaOp(False, "attn_mask", extras=("empty",)),
    # Under inference_mode DTensor sees SDPA itself before its decomposition: take it whole.
    aten.scaled_dot_product_attention.default: SdpaOp(False, "attn_mask", out_only=True),
}
BACKWARD_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: SdpaOp(True, "attn_mask"),
    aten._scaled_dot_product_flash_attention_backward.default: SdpaOp(True, None),
    aten._scaled_dot_product_efficient_attention_backward.default: SdpaOp(
        True, None, grad_arg="grad_out_", extra_grads=1),
    aten._scaled_dot_product_cudnn_attention_backward.default: SdpaOp(True, None),
}
SDPA_OPS = {**FORWARD_OPS, **BACKWARD_OPS}


def bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by schema name, defaults filled in."""
    bound = normalize_function(op, args, kwargs, normalize_to_only_use_kwargs=True)
    if bound is None:
        raise TypeError(f"the arguments do not match {op}'s schema {op._schema}")
    return dict(bound.kwargs)
