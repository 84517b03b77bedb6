"""Block kernels and the registries ``backend=`` picks from, one per ``precision``.

``precision="fp32"``: ``BACKENDS``; ``"auto"`` takes the first available in ``AUTO_ORDER``: on CUDA
cuDNN (fastest on Hopper), then flash-attn, then PyTorch's flash, then PyTorch's memory-efficient
kernel (fp32 inputs, head dims above 256), then the fp32 math fallback; on CPU PyTorch's CPU flash
kernel.

``precision="exact"``: ``EXACT_BACKENDS`` (kernels with fp32 out and gradients, ``exact = True``);
``"auto"`` takes the first available in ``EXACT_AUTO_ORDER``: on CPU the CPU flash kernel in fp32,
on CUDA the Triton kernel (bf16/fp16, head dim <= 128), else the memory-efficient kernel on fp32
blocks, else the fp32 math fallback. Exact kernels have their own names (``*_exact``), so a
resolved kernel name alone says which precision it is.

Packed documents (``documents=True``) take the first available kernel that has a document form
(``documents``): on CUDA PyTorch's flash varlen op (fp32 mode) or the Triton kernel (exact mode),
else the math fallback (a dense mask per block); on CPU the CPU flash kernel with a mask.

Sliding windows (``window=True``) take the first available kernel whose ``windows`` lists the form
the call's edge blocks carry (``windows.form``: a band, or positions with packed documents): on
CUDA cuDNN (its edge blocks through PyTorch's flash op) or flash, in exact mode the Triton
kernel; with packed documents in fp32 mode the math fallback (flash's varlen form takes one
window for all segments); on CPU the CPU flash kernel with a mask.
"""
import torch

from ..validation import check_precision
from .base import BlockKernel
from .cpu_flash import CpuFlash
from .cuda import Cudnn, Flash
from .efficient import Efficient
from .flash_attn import FlashAttn
from .math import Math
from .triton_exact import TritonExact
from .upcast import cpu_flash_exact, efficient_exact, math_exact
from .windows import form

BACKENDS: dict[str, BlockKernel] = {
    kernel.name: kernel
    for kernel in (CpuFlash(), Cudnn(), FlashAttn(), Flash(), Efficient(), Math())}
AUTO_ORDER = ("cpu_flash", "cudnn", "flash_attn", "flash", "efficient", "math")

EXACT_BACKENDS: dict[str, BlockKernel] = {
    kernel.name: kernel
    for kernel in (cpu_flash_exact(), TritonExact(), efficient_exact(), math_exact())}
EXACT_AUTO_ORDER = ("cpu_flash_exact", "triton_exact", "efficient_exact", "math_exact")

_REGISTRIES = {"fp32": (BACKENDS, AUTO_ORDER), "exact": (EXACT_BACKENDS, EXACT_AUTO_ORDER)}


def get_kernel(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
               precision: str = "fp32", documents: bool = False,
               window: bool = False) -> BlockKernel:
    """The kernel named ``backend``, or for ``"auto"`` the first available of ``precision``'s
    registry (with ``documents``: the first that also takes packed documents; with ``window``: a
    sliding window's edge blocks); ValueError if unusable.

    A name means one kernel, so an exact kernel's name resolves whatever ``precision`` says (that is
    how a resolved kernel travels by name, e.g. through ``ops.py``); ``precision="exact"`` refuses
    the fp32 kernels, which round each block to 16 bits.
    """
    check_precision(precision)
    backends, order = _REGISTRIES[precision]

    def takes(kernel):
        return ((kernel.documents or not documents)
                and (not window or form(documents) in kernel.windows))

    def usable(kernel):
        return kernel.available(device, dtype, head_dim) and takes(kernel)

    needs = " and ".join(n for n, on in (("packed documents (cu_seqlens)", documents),
                                         ("a sliding window", window)) if on)
    if backend == "auto":
        for name in order:
            if usable(backends[name]):
                return backends[name]
        raise ValueError(f"no block kernel supports device={device}, dtype={dtype}, "
                         f"head_dim={head_dim}, precision={precision!r}"
                         + (f" with {needs}" if needs else ""))
    known = backends if precision == "exact" else {**BACKENDS, **EXACT_BACKENDS}
    if backend not in known:
        hint = " (an fp32 kernel: it rounds each block)" if backend in BACKENDS else ""
        raise ValueError(f"backend={backend!r} is not known{hint}; valid backends with "
                         f"precision={precision!r}: {['auto', *sorted(known)]}")
    kernel = known[backend]
    if not usable(kernel):
        which = f"with {needs} " if kernel.available(device, dtype, head_dim) else ""
        raise ValueError(f"backend={backend!r} cannot run {which}on device={device}, "
                         f"dtype={dtype}, head_dim={head_dim}; usable here: "
                         f"{[n for n in order if usable(backends[n])]}")
    return kernel


@torch.compiler.assume_constant_result
def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                    precision: str = "fp32", documents: bool = False,
                    window: bool = False) -> str:
    """``get_kernel(...).name``, a constant under torch.compile: the availability checks call into
    ``torch.backends`` (e.g. ``cudnn.is_available``), which Dynamo cannot trace."""
    return get_kernel(backend, device, dtype, head_dim, precision, documents, window).name


def kernel_named(name: str) -> BlockKernel:
    """The kernel a ``resolve_backend`` name stands for (no availability check: it was done)."""
    return BACKENDS.get(name) or EXACT_BACKENDS[name]


__all__ = ["BACKENDS", "BlockKernel", "EXACT_BACKENDS", "get_kernel", "kernel_named",
           "resolve_backend"]
