"""``triton_exact``: the exact block kernel on CUDA (the Triton kernels of ``triton_attention.py``).

Reads bf16/fp16 q, k, v (any strides: the schedules' sliced views are not copied; GQA through the
kv head index, never repeated); returns fp32 out and LSE, and fp32 dq, dk, dv, or with
``forward_into`` / ``backward_into`` writes (merges, adds) them straight into the schedules' fp32
accumulators. The backward takes the fp32 merged ``out`` for D = rowsum(dO * O). The products of
P and dS are rounded to fp16, against scaled fp16 copies of their other operands (made per call:
V in the forward; q, k, v, dO in the backward); see ``triton_attention.py``. Head dims up to
128 (non powers of two, e.g. 80, run in the next power-of-two tile, masked). Triton is optional:
``available`` is False without it. Under ``TRITON_INTERPRET=1`` the kernel also runs on CPU
tensors (the tests use that).
"""
import contextlib
import importlib.util
import math
import os
import threading
from typing import NamedTuple

import torch

from .base import CAUSAL, CAUSAL_BOTTOM_RIGHT, MASKS, NONE, BlockKernel, unclaimed
from .windows import BAND, POSITIONS

_HALF = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 128


_INTERPRETER_LOCK = threading.Lock()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launching():
    """The interpreter patches triton.language globally while a kernel runs, so simulated ranks
    (threads) take turns; compiled launches need no lock."""
    return _INTERPRETER_LOCK if interpreting() else contextlib.nullcontext()


class Tiles(NamedTuple):
    """One kernel's launch shape: (BLOCK_M, BLOCK_N) tile and Triton's warps and pipeline stages."""
    block_m: int
    block_n: int
    warps: int = 4
    stages: int = 2


# The fastest tiles of bench/triton_tune.py's sweep for d = 128, bf16, on zigzag's blocks, with a
# backward faster than with the first, untuned tiles (dK/dV 32 x 64, dq 64 x 32, 4 warps, 2
# stages). Hardware and figures: docs/results.md, "Exact mode's Triton tiles", and docs/design.md,
# "Measurements behind design choices".
TUNED = dict(forward=Tiles(128, 128, 8, 3), dkdv=Tiles(64, 128, 8, 3), dq=Tiles(128, 64, 8, 3))
# Under TRITON_INTERPRET=1 (CPU tests): small tiles, so short blocks still have several of them.
INTERPRETED = dict(forward=Tiles(16, 16), dkdv=Tiles(16, 16), dq=Tiles(16, 16))


def _tiles(overrides):
    """The launch shapes: the defaults, with ``overrides`` ({kernel: Tiles}) in their place."""
    defaults = INTERPRETED if interpreting() else TUNED
    for part, tiles in (overrides or {}).items():
        if part not in defaults:
            raise ValueError(f"tiles has the key {part!r}; valid keys: {list(defaults)}")
        if not isinstance(tiles, Tiles):
            raise TypeError(f"tiles[{part!r}] must be a Tiles; got {type(tiles).__name__}")
    return {**defaults, **(overrides or {})}


def _launch(tiles: Tiles) -> dict:
    return {} if interpreting() else dict(num_warps=tiles.warps, num_stages=tiles.stages)


def _offset(mask, seq_q, seq_k):
    if mask == CAUSAL and seq_q != seq_k:
        raise ValueError(f"mask='causal' needs a square block; got seq_q={seq_q}, seq_k={seq_k}")
    if mask == CAUSAL_BOTTOM_RIGHT and seq_q > seq_k:
        raise ValueError(f"mask='causal_bottom_right' needs seq_q <= seq_k; got {seq_q} > {seq_k}")
    return 0 if mask != CAUSAL_BOTTOM_RIGHT else seq_k - seq_q


def _document_rows(segments, seq_q, seq_k, device):
    """The kernels' view of packed documents: each q row's segment and last visible key
    (causal: the segment's bottom-right aligned diagonal) and each key's segment (int32), and
    the boundaries; without documents, placeholders the kernels do not read."""
    if segments is None:
        unused = torch.empty(1, dtype=torch.int32, device=device)
        return (unused,) * 5
    cu_q, cu_k = segments.cu_q.to(torch.int32), segments.cu_k.to(torch.int32)
    rows = torch.arange(seq_q, device=device, dtype=torch.int32)
    row_seg = (torch.searchsorted(cu_q, rows, right=True) - 1).to(torch.int32)
    # row i of segment s sees keys j <= i + (end of s's keys) - (end of s's rows)
    row_lim = (rows + cu_k[row_seg.long() + 1] - cu_q[row_seg.long() + 1]).to(torch.int32)
    cols = torch.arange(seq_k, device=device, dtype=torch.int32)
    col_seg = (torch.searchsorted(cu_k, cols, right=True) - 1).to(torch.int32)
    return row_seg, row_lim, col_seg, cu_q, cu_k


class _Window(NamedTuple):
    """The kernels' view of a block's mask and window (``triton_attention.py``): CAUSAL with
    ``offset``, WINDOW (0 none, 1 a band's lower side ``lo``, 2 positions) and its operands."""

    causal: bool
    offset: int
    kind: int
    lo: int
    pos_q: torch.Tensor
    pos_k: torch.Tensor
    left: int
    right: int


_UNBOUNDED = 2 ** 30  # a window side of -1, as the position difference no window reaches


def _window(mask, window, segments, seq_q, seq_k, device) -> _Window:
    unused = torch.empty(1, dtype=torch.int32, device=device)
    if window is None or segments is not None:
        offset = 0 if segments is not None else _offset(mask, seq_q, seq_k)
        if window is None:
            return _Window(mask != NONE, offset, 0, 0, unused, unused, 0, 0)
        return _Window(mask != NONE, offset, 2, 0, window.q.to(torch.int32),
                       window.k.to(torch.int32),
                       window.left if window.left >= 0 else _UNBOUNDED,
                       window.right if window.right >= 0 else _UNBOUNDED)
    # A band (mask "none"); trimmed, so lo <= 0 <= hi: hi is a causal offset, lo a lower side.
    return _Window(window.hi is not None, window.hi or 0, int(window.lo is not None),
                   window.lo or 0, unused, unused, 0, 0)


class TritonExact(BlockKernel):
    name = "triton_exact"
    exact = True
    masks = MASKS
    documents = True
    windows = (BAND, POSITIONS)

    def available(self, device, dtype, head_dim):
        return ((device.type == "cuda" or interpreting()) and dtype in _HALF
                and 1 <= head_dim <= MAX_HEAD_DIM
                and importlib.util.find_spec("triton") is not None)

    def forward(self, q, k, v, mask, scale, segments=None, window=None, tiles=None):
        """``tiles``: {"forward": Tiles} to override the tuned launch shape (the tuning bench)."""
        out = q.new_empty(q.shape, dtype=torch.float32)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        self.forward_into(out, lse, True, q, k, v, mask, scale, segments, window, tiles=tiles)
        return out, lse

    def forward_into(self, out, lse, fresh, q, k, v, mask, scale, segments=None, window=None,
                     tiles=None):
        """The kernel writes ``out``/``lse`` (any strides) or merges into them; see BlockKernel."""
        from . import triton_attention as ta  # noqa: PLC0415 - triton is optional

        if mask not in MASKS:
            raise ValueError(f"mask={mask!r} is not known; valid: {list(MASKS)}")
        batch, q_heads, seq_q, head_dim = q.shape
        seq_k = k.shape[2]
        win = _window(mask, window, segments, seq_q, seq_k, q.device)
        documents = _document_rows(segments, seq_q, seq_k, q.device)
        shape = _tiles(tiles)["forward"]
        grid = (math.ceil(seq_q / shape.block_m), batch * q_heads)
        with _launching():
            [(v16, v_amax)] = _fp16_copies(v)
            ta._forward[grid](q, k, v16, v_amax, out, lse, *documents, win.pos_q, win.pos_k,
                              *q.stride(), *k.stride(), *v16.stride(), *out.stride(),
                              *lse.stride(), q_heads, q_heads // k.shape[1],
                              seq_q, seq_k, win.offset, scale * ta.LOG2E, win.lo, win.left,
                              win.right, MERGE=not fresh, BLOCK_M=shape.block_m,
                              BLOCK_N=shape.block_n, **_constants(q, win, segments),
                              **_launch(shape))

    def backward(self, dout, q, k, v, out, lse, mask, scale, segments=None, window=None,
                 tiles=None):
        """``tiles``: {"dkdv": Tiles, "dq": Tiles} to override the tuned launch shapes."""
        return self.backward_into((None, None, None), dout, q, k, v, out, lse, mask, scale,
                                  segments, window, tiles=tiles)

    def backward_into(self, into, dout, q, k, v, out, lse, mask, scale, segments=None,
                      window=None, tiles=None):
        """The kernels store (or add) straight into the ``Into`` views; see ``BlockKernel``."""
        from . import triton_attention as ta  # noqa: PLC0415 - triton is optional

        dq_into, dk_into, dv_into = into
        if (dk_into is None) != (dv_into is None) or (dk_into and dk_into.add != dv_into.add):
            def said(x):
                return "None" if x is None else f"Into(add={x.add})"
            raise ValueError(f"into: dk and dv go into accumulators together, with the same add; "
                             f"got dk {said(dk_into)}, dv {said(dv_into)}")
        win = _window(mask, window, segments, q.shape[2], k.shape[2], q.device)
        documents = _document_rows(segments, q.shape[2], k.shape[2], q.device)
        lse = lse.float().contiguous()
        delta = torch.empty_like(lse)  # D = rowsum(dO * O), from the fp32 merged out: _dq writes it
        dq = dq_into.view if dq_into else q.new_empty(q.shape, dtype=torch.float32)
        dk = dk_into.view if dk_into else k.new_empty(k.shape, dtype=torch.float32)
        dv = dv_into.view if dv_into else torch.empty_like(dk)
        batch, q_heads, seq_q, _ = q.shape
        kv_heads, seq_k = k.shape[1], k.shape[2]
        sizes = (q_heads // kv_heads, seq_q, seq_k, win.offset, scale, scale * ta.LOG2E, win.lo,
                 win.left, win.right)
        chosen, constants = _tiles(tiles), _constants(q, win, segments)
        shape_dkdv, shape_dq = chosen["dkdv"], chosen["dq"]
        with _launching():
            (q16, q_amax), (k16, k_amax), (v16, v_amax), (do16, do_amax) = _fp16_copies(
                q, k, v, dout.to(q.dtype))  # lossless: autograd may hand back the fp32 out's grad
            copies = (q16, k16, v16, do16, q_amax, k_amax, v_amax, do_amax, lse, delta)
            strides = (*q16.stride(), *k16.stride(), *v16.stride(), *do16.stride(),
                       *lse.stride())
            ta._dq[(math.ceil(seq_q / shape_dq.block_m), batch * q_heads)](
                *copies, dq, out, *documents, win.pos_q, win.pos_k, *strides, *dq.stride(),
                *out.stride(),
                q_heads, *sizes, ADD=bool(dq_into and dq_into.add), BLOCK_M=shape_dq.block_m,
                BLOCK_N=shape_dq.block_n, **constants, **_launch(shape_dq))
            ta._dkdv[(math.ceil(seq_k / shape_dkdv.block_n), batch * kv_heads)](
                *copies, dk, dv, *documents, win.pos_q, win.pos_k, *strides, *dk.stride(),
                *dv.stride(),
                kv_heads, *sizes, ADD=bool(dk_into and dk_into.add),
                BLOCK_M=shape_dkdv.block_m, BLOCK_N=shape_dkdv.block_n, **constants,
                **_launch(shape_dkdv))
        return unclaimed(into, (dq, dk, dv))


def _constants(q, win: _Window, segments) -> dict:
    """The kernels' compile-time arguments other than the tile sizes."""
    head_dim = q.shape[3]
    return dict(CAUSAL=win.causal, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
                UPCAST=interpreting(), DOCS=segments is not None, WINDOW=win.kind)


def _block_d(head_dim: int) -> int:
    import triton  # noqa: PLC0415 - triton is optional

    return max(16, triton.next_power_of_2(head_dim))


# Rows per program of the fp16 copy: a bandwidth-bound pass, so tiles of 64 rows keep every SM busy.
_COPY_ROWS = 16 if interpreting() else 64


def _fp16_copies(*xs):
    """[(copy, amax)] for each x ([B, H, S, D], at most four, one dtype, any strides, the same B
    and D): x as a contiguous fp16 tensor times 2^e per (batch, head), e putting that head's
    amax(|x|) in [2^14, 2^15) (``_to_fp16``), and that amax (fp32 [B, H], contiguous), which the
    kernels take the scales from. One amax reduction per x and one launch for all the copies: on
    short blocks the launches, not the bytes, are the cost. Call under ``_launching()``."""
    from . import triton_attention as ta  # noqa: PLC0415 - triton is optional

    batch, head_dim = xs[0].shape[0], xs[0].shape[3]
    heads_max = max(x.shape[1] for x in xs)
    device = xs[0].device
    amax = torch.empty(len(xs) * batch * heads_max, device=device)
    flat = torch.empty(sum(x.numel() for x in xs), dtype=torch.float16, device=device)
    results, slots, start = [], [], 0
    for t, x in enumerate(xs):
        x_amax = amax[t * batch * heads_max:][:batch * x.shape[1]].view(batch, x.shape[1])
        torch.linalg.vector_norm(x, float("inf"), dim=(2, 3), dtype=torch.float32, out=x_amax)
        results.append((flat[start:start + x.numel()].view(x.shape), x_amax))
        slots.append((*x.stride(), x.shape[1], x.shape[2], start))
        start += x.numel()
    slots += [slots[0]] * (4 - len(xs))
    ta._to_fp16[(math.ceil(max(x.shape[2] for x in xs) / _COPY_ROWS), batch * heads_max,
                 len(xs))](*xs, *[xs[0]] * (4 - len(xs)), amax, flat, batch, heads_max,
                           *(value for slot in slots for value in slot), ROWS=_COPY_ROWS,
                           HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim))
    return results
