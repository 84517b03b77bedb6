"""Sliding windows in the block kernels (``layouts/windows.py`` says what a block's window is).

Each kernel declares the window forms it takes in ``BlockKernel.windows``: ``"band"`` (a plain
block's ``Band``: row i sees column j iff lo <= j - i <= hi) and ``"positions"`` (packed
documents: ``Positions``, global positions of rows and keys). Only edge blocks carry one; blocks
fully inside the window have a plain mask and blocks outside it are never called.

* The CPU kernels and ``math`` apply either form as a dense mask (``visible``).
* PyTorch's flash op (``_flash_attention_forward`` / ``_backward``, keyword arguments
  ``window_size_left`` / ``window_size_right`` in torch 2.5 and later, so 2.11 to 2.14) takes a band
  as bottom-right aligned window sizes (``flash_forward`` / ``flash_backward``); cuDNN through
  PyTorch has none, so the cuDNN kernel hands its edge blocks to these. Flash's varlen form takes
  one window for all segments, which cannot hold the per-document offsets: no ``"positions"``.
  One band needs no window kernel: the causal mask read backwards (``reversed_causal``), which
  both CUDA kernels run as their plain causal mask on reversed rows.
* The Triton kernels mask by the band or the positions in their tiles (``triton_attention.py``).
"""
import torch

from ..layouts.windows import Band, Positions
from .base import CAUSAL
from .words import flipped_rows

BAND, POSITIONS = "band", "positions"
_aten = torch.ops.aten


def form(documents: bool) -> str:
    """The window form a call's blocks carry: positions with packed documents, else bands."""
    return POSITIONS if documents else BAND


def visible(window, seq_q: int, seq_k: int, device) -> torch.Tensor:
    """[seq_q, seq_k] booleans: which row sees which column under ``window`` (no in-place ops:
    traced by the compile pass, which functionalises them)."""
    if isinstance(window, Band):
        q = torch.arange(seq_q, device=device)[:, None]
        k = torch.arange(seq_k, device=device)[None, :]
        lowest, highest = window.lo, window.hi  # on k - q
    else:
        assert isinstance(window, Positions), window
        q, k = window.q.long()[:, None], window.k.long()[None, :]
        lowest = -window.left if window.left >= 0 else None
        highest = window.right if window.right >= 0 else None
    seen = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if lowest is not None:
        seen = seen & (k - q >= lowest)
    if highest is not None:
        seen = seen & (k - q <= highest)
    return seen


def _has_window_arguments(op) -> bool:
    return {"window_size_left", "window_size_right"} <= {a.name for a in op._schema.arguments}


# Checked on the op's schema rather than assumed from the torch version.
FLASH_TAKES_WINDOWS = all(_has_window_arguments(op) for op in (
    _aten._flash_attention_forward.default, _aten._flash_attention_backward.default))


def flash_window(window: Band, seq_q: int, seq_k: int) -> tuple[int, int]:
    """A band as flash's (window_size_left, window_size_right): bottom-right aligned, row i sees
    columns i + Sk - Sq - left .. i + Sk - Sq + right; -1 unbounded. A trimmed block's last row
    sees its last column (``layouts/windows.py``), so both are >= 0 or -1."""
    diagonal = seq_k - seq_q
    left = -1 if window.lo is None else diagonal - window.lo
    right = -1 if window.hi is None else window.hi - diagonal
    assert left >= -1 and right >= -1 and (left, right) != (-1, -1), (window, seq_q, seq_k)
    return left, right


def reversed_causal(window: Band, seq_q: int, seq_k: int) -> bool:
    """Whether a band is the causal mask read backwards: a square block whose row i sees columns
    i and after (lo = 0, no upper bound). A causal window leaves this triangle in every block of
    keys just before a block of queries no longer than the window (the keys of the previous
    chunk, ``layouts/windows.py``: 'rank 1's last 5 keys as a triangle'). With both its rows and
    its keys reversed it is the plain causal mask, which cuDNN runs at about twice the speed of
    flash's windowed kernel (docs/design.md, "Measurements behind design choices")."""
    return window.lo == 0 and window.hi is None and seq_q == seq_k


def reversed_forward(forward, q, k, v, scale: float):
    """(out, lse) of a ``reversed_causal`` block through a kernel's own causal
    ``forward(q, k, v, mask, scale)``, on its rows and keys reversed (``words.flipped_rows``:
    copies, in machine words where they can be)."""
    out, lse = forward(*map(flipped_rows, (q, k, v)), CAUSAL, scale)
    return flipped_rows(out), flipped_rows(lse)


def reversed_backward(backward, dout, q, k, v, out, lse, scale: float):
    """dq, dk, dv of a ``reversed_causal`` block through a kernel's own causal
    ``backward(dout, q, k, v, out, lse, mask, scale)``, on its rows and keys reversed."""
    grads = backward(*map(flipped_rows, (dout, q, k, v, out, lse)), CAUSAL, scale)
    return tuple(map(flipped_rows, grads))


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] as the op's [B, S, H, D] view (the head dim made dense if it is not)."""
    return (x if x.stride(-1) == 1 else x.contiguous()).transpose(1, 2)


def flash_forward(q, k, v, window: Band, scale: float):
    """out [B, H, Sq, D] and lse [B, H, Sq] of a band block (GQA native)."""
    left, right = flash_window(window, q.shape[2], k.shape[2])
    out, lse = _aten._flash_attention_forward(
        _bshd(q), _bshd(k), _bshd(v), None, None, q.shape[2], k.shape[2], 0.0, False, False,
        scale=scale, window_size_left=left, window_size_right=right)[:2]
    return out.transpose(1, 2), lse


def flash_backward(dout, q, k, v, out, lse, window: Band, scale: float):
    """dq, dk, dv of a band block (operands: ``_backward_operand``)."""
    left, right = flash_window(window, q.shape[2], k.shape[2])
    unused_rng = torch.empty(0, device=q.device)
    dq, dk, dv = _aten._flash_attention_backward(
        *map(_backward_operand, (dout, q, k, v, out)), lse.contiguous(), None, None, q.shape[2],
        k.shape[2], 0.0, False, unused_rng, unused_rng, scale=scale, window_size_left=left,
        window_size_right=right)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _backward_operand(x: torch.Tensor) -> torch.Tensor:
    """``x`` ([B, H, S, D]) as the backward op's [B, S, H, D] operand. Flash's backward gave wrong
    gradients on row-sliced views (``kernels/cuda.py``), so a slice is copied, into the op's own
    layout: the op copies dout and out there itself when they are not. A row slice of a model's
    [B, S, H, D] memory already is dense there (batch 1): no copy. A whole contiguous
    [B, H, S, D] tensor is handed over as it is, as PyTorch's SDPA does (copying it into the
    op's layout made the windowed ideal's backward slower). Measured: docs/design.md,
    "Measurements behind design choices"."""
    op_layout = x.transpose(1, 2)
    return op_layout if x.is_contiguous() or op_layout.is_contiguous() else op_layout.contiguous()
