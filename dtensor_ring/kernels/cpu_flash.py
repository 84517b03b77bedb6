"""PyTorch's CPU flash-attention kernel (bf16, fp16, fp32; native GQA; returns the LSE)."""
import torch

from .base import CAUSAL, CAUSAL_BOTTOM_RIGHT, MASKS, BlockKernel

_aten = torch.ops.aten


def _causal_and_bias(q, k, mask):
    """The kernel's ``is_causal`` (top-left) and, for bottom-right, an additive bias instead."""
    if mask != CAUSAL_BOTTOM_RIGHT:
        return mask == CAUSAL, None
    sq, sk = q.shape[2], k.shape[2]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    bias = torch.zeros(sq, sk, dtype=q.dtype, device=q.device)
    return False, bias.masked_fill_(~allowed, float("-inf"))


class CpuFlash(BlockKernel):
    name = "cpu_flash"
    masks = MASKS

    def available(self, device, dtype, head_dim):
        return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)

    def forward(self, q, k, v, mask, scale):
        causal, bias = _causal_and_bias(q, k, mask)
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                 attn_mask=bias, scale=scale)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        causal, bias = _causal_and_bias(q, k, mask)
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
