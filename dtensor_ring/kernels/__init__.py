"""Block kernels and the registry ``backend=`` picks from.

``"auto"`` takes the first available in ``AUTO_ORDER``: on CUDA cuDNN (fastest on Hopper), then
flash-attn, then PyTorch's flash, then the fp32 math fallback; on CPU PyTorch's CPU flash kernel.
"""
import torch

from .base import BlockKernel
from .cpu_flash import CpuFlash
from .cuda import Cudnn, Flash
from .flash_attn import FlashAttn
from .math import Math

BACKENDS: dict[str, BlockKernel] = {
    kernel.name: kernel for kernel in (CpuFlash(), Cudnn(), FlashAttn(), Flash(), Math())}
AUTO_ORDER = ("cpu_flash", "cudnn", "flash_attn", "flash", "math")


def get_kernel(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> BlockKernel:
    """The kernel named ``backend`` (or the first available for ``"auto"``); ValueError if unusable."""
    if backend == "auto":
        for name in AUTO_ORDER:
            if BACKENDS[name].available(device, dtype, head_dim):
                return BACKENDS[name]
        raise ValueError(f"no block kernel supports device={device}, dtype={dtype}, "
                         f"head_dim={head_dim}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; valid backends: "
                         f"{['auto', *sorted(BACKENDS)]}")
    kernel = BACKENDS[backend]
    if not kernel.available(device, dtype, head_dim):
        usable = [n for n in AUTO_ORDER if BACKENDS[n].available(device, dtype, head_dim)]
        raise ValueError(f"backend={backend!r} cannot run on device={device}, dtype={dtype}, "
                         f"head_dim={head_dim}; usable here: {usable}")
    return kernel


__all__ = ["BACKENDS", "BlockKernel", "get_kernel"]
