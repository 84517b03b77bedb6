"""fp32 online-softmax merge of partial attention results, and fp32 accumulation of block results.

Two partial results over disjoint key sets, (out_a, lse_a) and (out_b, lse_b), combine into the
attention over their union:

    out = (exp(lse_a) out_a + exp(lse_b) out_b) / (exp(lse_a) + exp(lse_b))
    lse = log(exp(lse_a) + exp(lse_b))

written in the form that never overflows and loses least when one side dominates:

    out -= sigmoid(lse_b - lse_a) * (out_a - out_b)
    lse -= logsigmoid(lse_a - lse_b)

The accumulator (out, lse) is fp32 whatever the input dtype; the block is upcast as it is read.
``accumulate_`` copies (casts) a block's result into an fp32 accumulator or adds it there: the
fp32 sums of the forward's first block and of the backward's gradients.

Implementations, one per device kind (``FP32_OPS``): on CUDA Triton kernels (``triton_merge.py``:
each one pass over its tensors; PyTorch's merge is ~8 elementwise kernels, and its 16-bit -> fp32
copy and add take the slower mixed-dtype path), elsewhere torch ops. Traced code (the compile
pass's ``make_fx``) takes the torch ops on any device: inductor fuses them itself.
"""
import importlib.util

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode


class TorchFp32:
    """The torch ops: any device, and traced code."""

    @staticmethod
    def merge_(out, lse, block_out, block_lse):
        # sigmoid / logsigmoid in the form of triton_merge.merge_rows: a side at -inf (a row that
        # saw no key there) gives weight 0 or 1 and leaves the other side's lse, with no inf - inf
        diff = lse - block_lse
        small = torch.exp(-diff.abs())
        weight = torch.where(diff > 0, small, 1.0) / (1.0 + small)
        out.sub_(weight.unsqueeze(-1) * (out - block_out))
        lse.copy_(torch.maximum(lse, block_lse) + torch.log1p(small))

    @staticmethod
    def merge_into_(target, target_lse, a, a_lse, block_out, block_lse, rows):
        out, lse = a.float().clone(), a_lse.clone()
        TorchFp32.merge_(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        target.copy_(out)
        target_lse.copy_(lse)

    @staticmethod
    def accumulate_(acc, x, add):
        acc.add_(x) if add else acc.copy_(x)


class TritonFp32:
    """One Triton kernel per call (``triton_merge.py``), on CUDA tensors (or CPU under
    TRITON_INTERPRET=1, in the tests)."""

    @staticmethod
    def merge_(out, lse, block_out, block_lse):
        from . import triton_merge  # noqa: PLC0415 - triton is optional

        triton_merge.merge_(out, lse, block_out, block_lse)

    @staticmethod
    def merge_into_(target, target_lse, a, a_lse, block_out, block_lse, rows):
        from . import triton_merge  # noqa: PLC0415

        triton_merge.merge_into_(target, target_lse, a, a_lse, block_out, block_lse, rows)

    @staticmethod
    def accumulate_(acc, x, add):
        from . import triton_merge  # noqa: PLC0415

        triton_merge.accumulate_(acc, x, add)


_HAS_TRITON = importlib.util.find_spec("triton") is not None
FP32_OPS = {"cuda": TritonFp32 if _HAS_TRITON else TorchFp32, "other": TorchFp32}


def _ops(tensor: torch.Tensor):
    traced = get_proxy_mode() is not None or is_fake(tensor)
    return FP32_OPS["cuda" if tensor.device.type == "cuda" and not traced else "other"]


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Merge one block into the fp32 accumulator in place.

    ``out`` [B, H, S, D] and ``lse`` [B, H, S] are fp32 (views are fine); ``block_out`` is in any
    float dtype, ``block_lse`` fp32. A row at -inf on one side (it saw no key there: packed
    documents) takes the other side's values; start the accumulator with ``init_``.
    """
    _ops(out).merge_(out, lse, block_out, block_lse)


def merge_into_(target: torch.Tensor, target_lse: torch.Tensor, a: torch.Tensor,
                a_lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
                rows: slice) -> None:
    """``target`` = (``a``, ``a_lse``) merged with a block over rows ``rows`` of it, every row
    written (rows outside the block: ``a``); ``target`` in any float dtype (the cast is the last
    step), ``target_lse`` fp32 and may be ``a_lse`` (updated in place). ``a`` must not be
    ``target``: for that, ``merge_``."""
    _ops(target).merge_into_(target, target_lse, a, a_lse, block_out, block_lse, rows)


def accumulate_(acc: torch.Tensor, x: torch.Tensor, add: bool) -> None:
    """``acc += x`` (``add``) or ``acc[...] = x``: ``acc`` fp32 [B, H, S, D] (views are fine),
    ``x`` of the same shape in any float dtype."""
    _ops(acc).accumulate_(acc, x, add)


def init_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> None:
    """Start the accumulator from a block that covers its rows."""
    accumulate_(out, block_out, add=False)
    lse.copy_(block_lse)
