"""Exact kernels built from an fp32 kernel: upcast the block to fp32, run it, keep the fp32 results.

``cpu_flash_exact`` (PyTorch's CPU flash kernel in fp32; what ``precision="exact"`` uses on CPU, so
CI tests exact mode), ``efficient_exact`` (PyTorch's memory-efficient CUDA kernel in fp32: exact
mode on CUDA where the Triton kernel does not apply) and ``math_exact`` (the plain-PyTorch fp32
fallback, any device). They have the exact kernels' result semantics (fp32 out, LSE, dq, dk, dv;
the backward takes the fp32 merged out), though the arithmetic inside is fp32 where the Triton
kernel's products read bf16/fp16.
"""
import torch

from .base import BlockKernel
from .cpu_flash import CpuFlash
from .efficient import Efficient
from .math import Math

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class Upcast(BlockKernel):
    exact = True

    def __init__(self, name: str, inner: BlockKernel):
        self.name, self.inner, self.masks = name, inner, inner.masks
        self.supports_gqa, self.documents = inner.supports_gqa, inner.documents
        self.windows = inner.windows

    def available(self, device, dtype, head_dim):
        return dtype in _FLOATS and self.inner.available(device, torch.float32, head_dim)

    def forward(self, q, k, v, mask, scale, segments=None, window=None):
        return self.inner.forward(q.float(), k.float(), v.float(), mask, scale, segments, window)

    def backward(self, dout, q, k, v, out, lse, mask, scale, segments=None, window=None):
        return self.inner.backward(dout.float(), q.float(), k.float(), v.float(), out.float(),
                                   lse, mask, scale, segments, window)


def cpu_flash_exact() -> Upcast:
    return Upcast("cpu_flash_exact", CpuFlash())


def efficient_exact() -> Upcast:
    return Upcast("efficient_exact", Efficient())


def math_exact() -> Upcast:
    return Upcast("math_exact", Math())
