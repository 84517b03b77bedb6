"""Packed documents for kernels without a varlen form: the segments as a dense mask.

``visible(segments, seq_q, seq_k, mask)`` is the [seq_q, seq_k] boolean of which q row sees which
key (``layouts.Segments``: the same segment, and within it the mask aligned to the segment's
bottom-right corner). It is built with tensor ops from the device boundaries (no host sync,
traceable). It costs seq_q x seq_k booleans per block, so it is for the CPU kernels and the
fallbacks; PyTorch's flash varlen op and the Triton kernels take the boundaries themselves.
"""
import torch

from .base import NONE


def visible(segments, seq_q: int, seq_k: int, mask: str) -> torch.Tensor:
    device = segments.cu_q.device
    cu_q, cu_k = segments.cu_q.long(), segments.cu_k.long()
    rows, cols = torch.arange(seq_q, device=device), torch.arange(seq_k, device=device)
    # right=True: of several segments starting at a row, the last, non-empty one holds it
    row_seg = torch.searchsorted(cu_q, rows, right=True) - 1
    col_seg = torch.searchsorted(cu_k, cols, right=True) - 1
    seen = row_seg[:, None] == col_seg[None, :]
    if mask == NONE:
        return seen
    # q row i (index a in its segment of n_q rows) sees key b of the n_k keys iff
    # b <= a + n_k - n_q: the bottom-right aligned causal mask
    limit = rows - cu_q[row_seg] + (cu_k[row_seg + 1] - cu_k[row_seg]) - (
        cu_q[row_seg + 1] - cu_q[row_seg])
    return seen & ((cols - cu_k[col_seg])[None, :] <= limit[:, None])


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``seen`` as an additive bias: 0 where seen, -inf elsewhere."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen,
                                                                                 float("-inf"))


def without_keys(out: torch.Tensor, lse: torch.Tensor, seen: torch.Tensor):
    """(out, lse) ([..., Sq, D], [..., Sq]) with the rows that see no key set to 0 and -inf (the
    kernels' convention)."""
    sees = seen.any(-1)
    return out.masked_fill(~sees[:, None], 0.0), lse.masked_fill(~sees, float("-inf"))
