"""The forward merge in traced code (the compile pass's ``make_fx``): on CUDA, eager's Triton
kernel (``fused.py``) as a node of the graph, through ``torch.library.wrap_triton``, which inductor
launches with its own launcher; elsewhere the torch ops, which inductor fuses.

Why not the torch ops on CUDA too: compiled llama3 merges each head group into its own tensor and
concatenates them, and inductor fused the four groups' merges and the concatenation into one
pointwise kernel that took 0.59 ms per forward (4 H200s, 8K tokens per GPU, 32/32 heads), where
eager's four Triton merges took 0.077 ms in all. Why not a custom op around the eager call: its
host time, ~150 us a call on an H200's host (the op's dispatch and Triton's Python launch), left
the GPU idle in a compiled call run alone (llama3 at W = 2 on 2 H200s: 1.07x eager, against 1.01x
with the torch ops). Inductor's launch of the kernel costs host time too, less: a short call run
alone still waits for it (llama3 at W = 2, one rank: fwd+bwd 1.03-1.07x eager against 0.99-1.00x
with the torch ops). In steady state it is within 3% of eager wherever measured, and llama3's
forward at W = 4 went from 1.12-1.15x eager to 1.01x (docs/design.md, "Measurements behind design
choices"). The compiled forward's out is eager's, bit for bit.

The accumulations (``accumulate_``, ``sum_many_``) stay torch ops: a cast or a sum, which inductor
fuses into its neighbours.
"""
from .online import _HAS_TRITON, TorchFp32


class TracedFp32(TorchFp32):
    """Traced code: the merges as eager's Triton kernel on CUDA, the torch ops elsewhere."""

    @staticmethod
    def merge_(out, lse, block_out, block_lse):
        if not _triton(out):
            return TorchFp32.merge_(out, lse, block_out, block_lse)
        TracedFp32.merge_many_(out, lse, out, lse, [(block_out, block_lse, slice(None))])

    @staticmethod
    def merge_many_(target, target_lse, first, first_lse, blocks):
        if not _triton(target):
            return TorchFp32.merge_many_(target, target_lse, first, first_lse, blocks)
        from . import fused  # noqa: PLC0415 - triton is optional

        fused.merge_many_(target, target_lse, first, first_lse, blocks, traced=True)


def _triton(tensor):
    return tensor.is_cuda and _HAS_TRITON
