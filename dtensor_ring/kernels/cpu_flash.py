"""PyTorch's CPU flash-attention kernel (bf16, fp16, fp32; native GQA; returns the LSE)."""
import torch

from .base import BlockKernel

_aten = torch.ops.aten


class CpuFlash(BlockKernel):
    name = "cpu_flash"

    def available(self, device, dtype, head_dim):
        return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)

    def forward(self, q, k, v, causal, scale):
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
