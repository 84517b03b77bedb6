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
fp32 sums of the forward's first block and of the backward's gradients. ``merge_many_`` and
``sum_many_`` merge or add several results in one pass (the forward's W <= 4 blocks, the ring
backward's own dK/dV with the accumulator that came home).

Implementations, one per device kind (``FP32_OPS``): on CUDA Triton kernels (``fused.py``:
each one pass over its tensors; PyTorch's merge is ~8 elementwise kernels, and its 16-bit -> fp32
copy and add take the slower mixed-dtype path), elsewhere torch ops. Traced code (the compile
pass's ``make_fx``, ``TracedFp32``) merges with eager's Triton kernel on CUDA, as a node of the
graph, through ``torch.library.wrap_triton``, which inductor launches with its own launcher;
elsewhere, and for the accumulations everywhere, the torch ops, which inductor fuses itself.

Why not the torch ops on CUDA too: compiled llama3 merges each head group into its own tensor and
concatenates them, and inductor fused the four groups' merges and the concatenation into one
pointwise kernel that took 0.59 ms per forward (4 H200s, 8K tokens per GPU, 32/32 heads), where
eager's four Triton merges took 0.077 ms in all. Why not a custom op around the eager call: its
host time, ~150 us a call on an H200's host (the op's dispatch and Triton's Python launch), left
the GPU idle in a compiled call run alone (llama3 at W = 2 on 2 H200s: 1.07x eager, against 1.01x
with the torch ops). Inductor's launch of the kernel costs host time too: a short call run alone
still waits for it (llama3 at W = 2, one rank, fwd+bwd: 1.03-1.07x eager, against 0.99-1.00x with
the torch ops and 1.14x with the custom op in another lease). In steady state it is within 3% of
eager wherever measured, and llama3's forward at W = 4 went from 1.12-1.15x eager to 1.01x
(docs/design.md, "Measurements behind design choices"). The compiled forward's out is eager's,
bit for bit.
"""
import importlib.util

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .slots import MAX_BLOCKS, MAX_PARTS


class TorchFp32:
    """The torch ops: any device, and traced code."""

    @staticmethod
    def merge_(out, lse, block_out, block_lse):
        # sigmoid / logsigmoid in the form of fused.merge_rows: a side at -inf (a row that
        # saw no key there) gives weight 0 or 1 and leaves the other side's lse, with no inf - inf;
        # both at -inf stay there (out 0)
        diff = torch.where(lse == block_lse, 0.0, lse - block_lse)
        small = torch.exp(-diff.abs())
        weight = torch.where(diff > 0, small, 1.0) / (1.0 + small)
        out.sub_(weight.unsqueeze(-1) * (out - block_out))
        lse.copy_(torch.maximum(lse, block_lse) + torch.log1p(small))

    @staticmethod
    def merge_many_(target, target_lse, first, first_lse, blocks):
        out, lse = first.float().clone(), first_lse.clone()
        for block_out, block_lse, rows in blocks:
            TorchFp32.merge_(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        target.copy_(out)
        target_lse.copy_(lse)

    @staticmethod
    def accumulate_(acc, x, add):
        acc.add_(x) if add else acc.copy_(x)

    @staticmethod
    def sum_many_(target, parts):
        acc = torch.zeros(target.shape, dtype=torch.float32, device=target.device)
        for x, rows in parts:
            acc[:, :, rows] += x
        target.copy_(acc)


class TritonFp32:
    """One Triton kernel per call (``fused.py``), on CUDA tensors (or CPU under
    TRITON_INTERPRET=1, in the tests)."""

    @staticmethod
    def merge_(out, lse, block_out, block_lse):
        from . import fused  # noqa: PLC0415 - triton is optional

        fused.merge_(out, lse, block_out, block_lse)

    @staticmethod
    def merge_many_(target, target_lse, first, first_lse, blocks):
        from . import fused  # noqa: PLC0415

        fused.merge_many_(target, target_lse, first, first_lse, blocks)

    @staticmethod
    def accumulate_(acc, x, add):
        from . import fused  # noqa: PLC0415

        fused.accumulate_(acc, x, add)

    @staticmethod
    def sum_many_(target, parts):
        from . import fused  # noqa: PLC0415

        fused.sum_many_(target, parts)


_HAS_TRITON = importlib.util.find_spec("triton") is not None
FP32_OPS = {"cuda": TritonFp32 if _HAS_TRITON else TorchFp32, "other": TorchFp32}


def _triton(tensor):
    return tensor.is_cuda and _HAS_TRITON


class TracedFp32(TorchFp32):
    """Traced code: the merges as eager's Triton kernel on CUDA, the torch ops elsewhere."""

    @staticmethod
    def merge_(out, lse, block_out, block_lse):
        if not _triton(out):
            return TorchFp32.merge_(out, lse, block_out, block_lse)
        from . import fused  # noqa: PLC0415 - triton is optional

        fused.merge_(out, lse, block_out, block_lse, traced=True)

    @staticmethod
    def merge_many_(target, target_lse, first, first_lse, blocks):
        if not _triton(target):
            return TorchFp32.merge_many_(target, target_lse, first, first_lse, blocks)
        from . import fused  # noqa: PLC0415 - triton is optional

        fused.merge_many_(target, target_lse, first, first_lse, blocks, traced=True)


def _ops(tensor: torch.Tensor):
    if get_proxy_mode() is not None or is_fake(tensor):
        return TracedFp32
    return FP32_OPS["cuda" if tensor.device.type == "cuda" else "other"]


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Merge one block into the fp32 accumulator in place.

    ``out`` [B, H, S, D] and ``lse`` [B, H, S] are fp32 (views are fine); ``block_out`` is in any
    float dtype, ``block_lse`` fp32. A row at -inf on one side (it saw no key there: packed
    documents) takes the other side's values, at -inf on both it stays there with out 0; start
    the accumulator with ``init_``.
    """
    _ops(out).merge_(out, lse, block_out, block_lse)


def merge_many_(target: torch.Tensor, target_lse: torch.Tensor, first: torch.Tensor,
                first_lse: torch.Tensor, blocks: list) -> None:
    """``target`` = (``first``, ``first_lse``) merged with each of ``blocks``, in order, in one
    pass: every row of ``target`` written once, the accumulation in fp32 registers, the cast to
    ``target``'s dtype the last step. ``blocks``: up to ``MAX_BLOCKS`` (out, lse, rows), a
    block's result for rows ``rows`` (a slice) of ``first``; rows outside a block are left as
    they are by it. ``target`` may be ``first`` and ``target_lse`` may be ``first_lse`` (in
    place); the merges are those of ``merge_`` in the same order, so the result is the same as
    merging one block at a time into an fp32 accumulator."""
    assert len(blocks) <= MAX_BLOCKS, f"{len(blocks)} blocks; merge_many_ takes {MAX_BLOCKS}"
    _ops(target).merge_many_(target, target_lse, first, first_lse, blocks)


def accumulate_(acc: torch.Tensor, x: torch.Tensor, add: bool) -> None:
    """``acc += x`` (``add``) or ``acc[...] = x``: ``acc`` fp32 [B, H, S, D] (views are fine),
    ``x`` of the same shape in any float dtype."""
    _ops(acc).accumulate_(acc, x, add)


def sum_many_(target: torch.Tensor, parts: list) -> None:
    """``target`` = the sum of ``parts`` in fp32, in order, in one pass, written once in
    ``target``'s dtype. ``parts``: up to ``MAX_PARTS`` (x, rows), x the values of rows ``rows``
    (a slice) of ``target``, in any float dtype; rows no part covers are 0. The sum starts at
    the first part (0 + x is x), so it rounds as adding the parts one at a time to an fp32
    accumulator does."""
    assert len(parts) <= MAX_PARTS, f"{len(parts)} parts; sum_many_ takes {MAX_PARTS}"
    _ops(target).sum_many_(target, parts)


def init_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> None:
    """Start the accumulator from a block that covers its rows."""
    accumulate_(out, block_out, add=False)
    lse.copy_(block_lse)
