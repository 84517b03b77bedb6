"""The forward merge in traced code (the compile pass's ``make_fx``): one custom op,
``dtensor_ring::merged``, that runs eager's implementation of the device (``online.FP32_OPS``:
the Triton kernel of ``fused.py`` on CUDA, the torch ops elsewhere) and returns new tensors.

Why an op, not the torch ops for inductor to fuse: compiled llama3 merges each head group into its
own tensor and concatenates them, and inductor fused the four groups' merges and the concatenation
into one pointwise kernel that took 0.59 ms per forward (4 H200s, 8K tokens per GPU, 32/32 heads),
where eager's four Triton merges took 0.077 ms in all (docs/design.md, "Measurements behind design
choices"). Through the op a compiled forward merges exactly as an eager one, bit for bit.

The accumulations (``accumulate_``, ``sum_many_``) stay torch ops: a cast or a sum, which inductor
fuses into its neighbours.
"""
import torch

from .online import FP32_OPS, TorchFp32


@torch.library.custom_op("dtensor_ring::merged", mutates_args=())
def merged(first: torch.Tensor, first_lse: torch.Tensor, outs: list[torch.Tensor],
           lses: list[torch.Tensor], rows: list[int],
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``online.merge_many_`` into new contiguous tensors (out in ``dtype``, lse fp32): block i is
    (``outs[i]``, ``lses[i]``) for rows ``rows[2i]:rows[2i + 1]`` of ``first``."""
    target, target_lse = _empty(first, first_lse, dtype)
    blocks = [(o, s, slice(a, b)) for o, s, a, b in zip(outs, lses, rows[::2], rows[1::2])]
    FP32_OPS["cuda" if first.is_cuda else "other"].merge_many_(target, target_lse, first,
                                                              first_lse, blocks)
    return target, target_lse


@merged.register_fake
def _(first, first_lse, outs, lses, rows, dtype):
    return _empty(first, first_lse, dtype)


def _empty(first, first_lse, dtype):
    return (torch.empty(first.shape, dtype=dtype, device=first.device),
            torch.empty(first_lse.shape, dtype=torch.float32, device=first.device))


class TracedFp32(TorchFp32):
    """Traced code: the merges through ``merged``, each result copied where the in-place call
    writes it (functionalised, a copy over a whole target is the op's output itself)."""

    @staticmethod
    def merge_(out, lse, block_out, block_lse):
        TracedFp32.merge_many_(out, lse, out, lse, [(block_out, block_lse, slice(None))])

    @staticmethod
    def merge_many_(target, target_lse, first, first_lse, blocks):
        seq = first.shape[2]
        rows = [i for *_, r in blocks for i in r.indices(seq)[:2]]
        out, lse = merged(first, first_lse, [b[0] for b in blocks], [b[1] for b in blocks], rows,
                          target.dtype)
        target.copy_(out)
        target_lse.copy_(lse)
