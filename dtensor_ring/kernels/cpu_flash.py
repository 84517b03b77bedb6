"""PyTorch's CPU flash-attention kernel (bf16, fp16, fp32; native GQA; returns the LSE).

Its ``is_causal`` is top-left; the bottom-right mask, packed documents and sliding windows go in
as an additive bias (``segments.py``, ``windows.py``), with the rows that see no key set to out
0, LSE -inf afterwards (the kernel gives LSE 0 there).
"""
import torch

from .base import CAUSAL, CAUSAL_BOTTOM_RIGHT, MASKS, BlockKernel
from .segments import additive, visible, without_keys
from .windows import BAND, POSITIONS
from .windows import visible as window_visible

_aten = torch.ops.aten


def _bottom_right(sq, sk, device):
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)


def _causal_and_seen(q, k, mask, segments, window=None):
    """The kernel's ``is_causal`` (top-left), or the [Sq, Sk] mask to pass as a bias instead."""
    sq, sk = q.shape[2], k.shape[2]
    if window is not None:
        causal, seen = _causal_and_seen(q, k, mask, segments)
        if causal:
            seen = _bottom_right(sq, sk, q.device)  # square: top-left
        in_window = window_visible(window, sq, sk, q.device)
        return False, in_window if seen is None else seen & in_window
    if segments is not None:
        return False, visible(segments, sq, sk, mask)
    if mask == CAUSAL_BOTTOM_RIGHT:
        return False, _bottom_right(sq, sk, q.device)
    return mask == CAUSAL, None


class CpuFlash(BlockKernel):
    name = "cpu_flash"
    masks = MASKS
    documents = True
    windows = (BAND, POSITIONS)

    def available(self, device, dtype, head_dim):
        return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)

    def forward(self, q, k, v, mask, scale, segments=None, window=None):
        causal, seen = _causal_and_seen(q, k, mask, segments, window)
        bias = None if seen is None else additive(seen, q.dtype)
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                     attn_mask=bias, scale=scale)
        if segments is None and window is None:
            return out, lse
        return without_keys(out, lse, seen)

    def backward(self, dout, q, k, v, out, lse, mask, scale, segments=None, window=None):
        causal, seen = _causal_and_seen(q, k, mask, segments, window)
        bias = None if seen is None else additive(seen, q.dtype)
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
