r"""Sliding windows: the ``window=(left, right)`` argument, and the blocks it leaves.

Convention (flash-attn's ``window_size`` and PyTorch's flash op's ``window_size_left/right``): a
query at global position p sees the keys at positions p - left .. p + right; -1 leaves that side
unbounded; with ``is_causal`` the right side is the diagonal whatever ``right`` says.
Hugging Face's ``sliding_window=w`` (a query sees itself and the w - 1 tokens before it:
``kv_idx > q_idx - w`` in ``transformers.masking_utils.sliding_window_overlay``) is
``window=(w - 1, 0)`` with ``is_causal=True``. With packed documents the window applies within
each document (positions are global, documents contiguous, so the distance is the same).

Blocks. A layout's local tokens are *runs* (``Run``): rows [start, start + length) at global
positions first, first + stride, ... (contiguous: one run of stride 1; zigzag: two, one per chunk;
stripe: one of stride W). Between a run of query rows and a run of key rows of the same stride the
visible pairs are a *band* of the block: row i sees column j iff lo <= j - i <= hi. ``band_block``
trims the block to the band's bounding box and says what is left:

    nothing          the block lies outside the window: no kernel call (and no message)
    mask "none"      every row sees every column of the box: fully inside the window
    mask "causal" / "causal_bottom_right"   the band's left side lies outside the box
    window=Band      an edge block: the band cuts the box (a kernel with ``windows``)

W = 4 ranks of 8 tokens (contiguous), causal, window=(5, 0): rank 2's queries see its own keys as a
band (\\) and rank 1's last 5 keys as a triangle (/); rank 0's keys lie outside: no step.

            src 0      src 1      src 2      src 3
    rank 2  .          ...////    \\\\\\\\   .

After the trim the bounding box's bottom-right corner lies in the band (the last row sees the last
column), which is what flash's bottom-right aligned ``window_size_left/right`` (both >= 0) need.

With packed documents a block's rows are not one run (the layouts apply per document), so the
window rides along as ``Positions``: the global positions of the block's rows and keys, and the
window, applied with the block's segments and mask by the kernels that take it.
"""
import operator
from typing import NamedTuple, Optional

import torch

from .blocks import Block

# The masks of kernels/base.py (layouts do not import the kernels, which import this module).
NONE, CAUSAL, CAUSAL_BOTTOM_RIGHT = "none", "causal", "causal_bottom_right"


class Window(NamedTuple):
    """``(left, right)``: a query at p sees keys p - left .. p + right; -1: unbounded."""

    left: int
    right: int


class Band(NamedTuple):
    """An edge block's window: row i of the block sees column j iff lo <= j - i <= hi (None: no
    bound on that side). The block's ``mask`` is "none": the band holds the causal side too."""

    lo: Optional[int]
    hi: Optional[int]


class Positions(NamedTuple):
    """A window given by global positions (packed documents): row i sees column j iff
    k[j] >= q[i] - left (left >= 0) and k[j] <= q[i] + right (right >= 0), on top of the block's
    mask and segments. ``q``, ``k``: int tensors on the compute device, one per row / column."""

    q: torch.Tensor
    k: torch.Tensor
    left: int
    right: int


class Run(NamedTuple):
    """Local rows [start, start + length) at global positions first + stride * i."""

    start: int
    length: int
    first: int
    stride: int


def check_window(window) -> Optional[Window]:
    """``window`` as a ``Window`` (None stays None); ValueError naming it otherwise."""
    if window is None:
        return None
    valid = ("None or (left, right): two ints >= -1, the keys a query sees before and after "
             "itself (-1: unbounded)")
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window={window!r} must be {valid}")
    if any(isinstance(side, bool) or not isinstance(side, int) for side in window):
        raise ValueError(f"window={window!r} must be {valid}")
    # operator.index, not int: under torch.compile a window that changed between calls arrives
    # symbolic (automatic dynamic), and index specializes it (a guard on its value) where int
    # would keep it symbolic. The window is a static attribute of the call.
    left, right = map(operator.index, window)
    if left < -1 or right < -1:
        raise ValueError(f"window={window!r} must be {valid}")
    return Window(left, right)


def effective_window(window: Optional[Window], is_causal: bool, span: int) -> Optional[Window]:
    """The window that changes anything, or None: a side at least ``span`` - 1 long (``span``:
    the most tokens one attention spans, the sequence or the longest document) is unbounded, and
    with ``is_causal`` the right side is (the causal mask bounds it). A window that covers the
    span is plain attention and runs the unwindowed code: the same bits."""
    if window is None:
        return None
    left = -1 if window.left >= span - 1 else window.left
    right = -1 if is_causal or window.right >= span - 1 else window.right
    return None if left == right == -1 else Window(left, right)


def window_args(window: Optional[Window]) -> tuple[int, int]:
    """The window as the two ints the custom ops take (-1, -1: none)."""
    return (-1, -1) if window is None else (window.left, window.right)


def from_args(left: int, right: int) -> Optional[Window]:
    return None if left == right == -1 else Window(left, right)


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def band(q: Run, k: Run, window: Optional[Window], is_causal: bool):
    """(lo, hi) of the band between ``q`` and ``k`` (same stride): row i of q sees row j of k iff
    lo <= j - i <= hi; None: no bound."""
    assert q.stride == k.stride, (q, k)
    gap = k.first - q.first  # key position - query position = gap + stride * (j - i)
    left = None if window is None or window.left < 0 else window.left
    right = 0 if is_causal else (None if window is None or window.right < 0 else window.right)
    lo = None if left is None else _ceil_div(-left - gap, q.stride)
    hi = None if right is None else (right - gap) // q.stride
    return lo, hi


def band_block(q: Run, k: Run, window: Optional[Window], is_causal: bool,
               masks) -> Optional[Block]:
    """The block of ``q``'s rows against ``k``'s rows under the window, trimmed (module
    docstring); None if nothing in it is visible. ``masks``: the kernel's (a band stands in for
    the masks it lacks)."""
    return trimmed(slice(q.start, q.start + q.length), slice(k.start, k.start + k.length),
                   *band(q, k, window, is_causal), masks)


def trimmed(rows: slice, cols: slice, lo, hi, masks) -> Optional[Block]:
    """Rows ``rows`` against columns ``cols`` where row i sees column j iff lo <= j - i <= hi
    (block-local indices; None: no bound), cut to the bounding box of what is visible."""
    n_q, n_k = rows.stop - rows.start, cols.stop - cols.start
    if lo is not None and hi is not None and lo > hi:
        return None
    r0 = 0 if hi is None else max(0, -hi)
    r1 = n_q if lo is None else min(n_q, n_k - lo)
    if r0 >= r1:
        return None
    c0 = 0 if lo is None else max(0, r0 + lo)
    c1 = n_k if hi is None else min(n_k, r1 + hi)
    if c0 >= c1:
        return None
    n_q, n_k, shift = r1 - r0, c1 - c0, r0 - c0
    lo = None if lo is None or lo + shift <= -(n_q - 1) else lo + shift
    hi = None if hi is None or hi + shift >= n_k - 1 else hi + shift
    q_rows = slice(rows.start + r0, rows.start + r1)
    k_rows = slice(cols.start + c0, cols.start + c1)
    if lo is None and hi is None:
        return Block(q_rows, k_rows, NONE)
    if lo is None and hi == 0 and n_q == n_k and CAUSAL in masks:
        return Block(q_rows, k_rows, CAUSAL)
    if lo is None and hi == n_k - n_q and CAUSAL_BOTTOM_RIGHT in masks:
        return Block(q_rows, k_rows, CAUSAL_BOTTOM_RIGHT)
    return Block(q_rows, k_rows, NONE, window=Band(lo, hi))


def as_band(block: Block):
    """(lo, hi) of a plain block (no segments): its mask or band as a band."""
    if block.window is not None:
        return block.window.lo, block.window.hi
    n_q, n_k = block.q.stop - block.q.start, block.k.stop - block.k.start
    return None, {NONE: None, CAUSAL: 0, CAUSAL_BOTTOM_RIGHT: n_k - n_q}[block.mask]


def split_rows(block: Block, at: int, masks) -> list[Block]:
    """A plain block as the blocks of its first ``at`` rows and of the rest (each trimmed; empty
    parts left out)."""
    lo, hi = as_band(block)
    start, stop = block.q.start, block.q.stop
    first = trimmed(slice(start, start + at), block.k, lo, hi, masks)
    rest = trimmed(slice(start + at, stop), block.k, None if lo is None else lo + at,
                   None if hi is None else hi + at, masks)
    return [b for b in (first, rest) if b is not None]


def with_positions(block: Block, q_positions: torch.Tensor, k_positions: torch.Tensor,
                   window: Window) -> Block:
    """``block`` (rows and keys indexing ``q_positions`` / ``k_positions``) with the window as
    ``Positions``."""
    return Block(block.q, block.k, block.mask, block.segments,
                 Positions(q_positions[block.q], k_positions[block.k], window.left, window.right))


def visible_pairs(q_positions: torch.Tensor, k_positions: torch.Tensor, cu: torch.Tensor,
                  window: Window, is_causal: bool) -> bool:
    """Whether any query sees any key (host tensors: positions sorted, ``cu`` the documents'
    boundaries; same document, within the window, causal)."""
    if not len(q_positions) or not len(k_positions):
        return False
    cu = cu.long()
    doc = torch.searchsorted(cu, q_positions, right=True) - 1
    lo, hi = cu[doc], cu[doc + 1] - 1
    if window.left >= 0:
        lo = torch.maximum(lo, q_positions - window.left)
    if is_causal:
        hi = torch.minimum(hi, q_positions)
    elif window.right >= 0:
        hi = torch.minimum(hi, q_positions + window.right)
    first = torch.searchsorted(k_positions, lo)
    last = torch.searchsorted(k_positions, hi, right=True)
    return bool((last > first).any())
