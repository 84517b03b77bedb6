"""The flash-attn package's kernels (optional; used when ``import flash_attn`` works).

flash-attn works in [B, S, H, D]; we transpose views in and out. Its ``causal`` is bottom-right
aligned, which is top-left for square blocks: it offers both causal masks, and its window sizes
take a sliding window's band (``windows.flash_window``).
"""
import importlib.util

import torch

from .base import MASKS, NONE, BlockKernel
from .windows import BAND, flash_window

_HALF = (torch.bfloat16, torch.float16)


def _interface():
    from flash_attn import flash_attn_interface  # noqa: PLC0415 - optional dependency
    return flash_attn_interface


class FlashAttn(BlockKernel):
    name = "flash_attn"
    masks = MASKS
    windows = (BAND,)

    def available(self, device, dtype, head_dim):
        return (device.type == "cuda" and dtype in _HALF and head_dim <= 256
                and importlib.util.find_spec("flash_attn") is not None)

    def forward(self, q, k, v, mask, scale, segments=None, window=None):
        causal = mask != NONE
        left, right = _window_sizes(q, k, window)
        bshd = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
        out, lse = _interface()._flash_attn_forward(
            *bshd, 0.0, scale, causal=causal, window_size_left=left, window_size_right=right,
            softcap=0.0, alibi_slopes=None, return_softmax=False)[:2]
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, mask, scale, segments=None, window=None):
        causal = mask != NONE
        left, right = _window_sizes(q, k, window)
        bshd = [x.transpose(1, 2).contiguous() for x in (dout, q, k, v, out)]
        dq, dk, dv = (torch.empty_like(x) for x in bshd[1:4])
        _interface()._flash_attn_backward(
            *bshd, lse.contiguous(), dq, dk, dv, 0.0, scale, causal, left, right, 0.0, None,
            False)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _window_sizes(q, k, window):
    """flash-attn's (window_size_left, window_size_right): -1, -1 without a window."""
    return (-1, -1) if window is None else flash_window(window, q.shape[2], k.shape[2])
