"""The fp32 merge and accumulation of ``online.py`` as Triton kernels: one pass over each tensor.

``_merge_many``: target = first merged with up to three blocks in turn, each block the result for
rows [r0, r1) of first (rows outside it are left as they are by it):

    grid (row tiles of BLOCK_M, B * H): each program reads BLOCK_M rows of first (out in any
    float dtype, lse fp32) and of every block, merges in fp32 registers, block after block,

        e   = exp(-|lse - block_lse|)
        w   = sigmoid(block_lse - lse)  = (e if lse > block_lse else 1) / (1 + e)
        out = out - w * (out - block_out)
        lse = max(lse, block_lse) + log(1 + e)      (= lse - logsigmoid(lse - block_lse))

    and writes target (fp32, or the final 16-bit out: the cast is the last step) and its lse.

The forward merges a step's blocks with it: its W results in one pass written over the first's
(W <= 4), or, for more, one block at a time into an fp32 accumulator (``merge_`` is the in-place
call with one block). The torch form makes ~8 passes per block.

``_sum_many``: target = the sum of up to four parts in fp32 registers, in order, each part the
values of rows [r0, r1) of target (rows no part covers: 0), written once in target's dtype; same
grid. ``accumulate_`` (acc = x, or acc += x: the part acc itself first, in place) and the ring
backward's dK/dV of the rank's own blocks with the accumulator that comes home use it.

Both may update their tensors in place, and a 1-D row vector (lse) is held by several threads at
once (Triton replicates it across the threads of the 2-D tile's rows): a thread that ran ahead
could store the new lse before another thread holding the same row had loaded the old one, which
then weighs that row of out wrongly. Seen on CUDA while another stream loaded memory (a few merges
in thousands: docs/design.md, "Measurements behind design choices"). So every load completes, in
every thread, before the first store: a CTA barrier between them.

Tensors may be any strided views ([B, H, S, D] / [B, H, S]: the schedules merge row slices in
place). ``block_lse = -inf`` (a row that saw no key in this block) leaves the row unchanged.
Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the tests use that).
"""
import torch
import triton
import triton.language as tl

from .slots import MAX_BLOCKS, MAX_PARTS  # the slots of _merge_many and _sum_many

BLOCK_M = 32


@triton.jit
def _tile(heads, seq, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's (batch, head), its BLOCK_M rows and BLOCK_D dims, and their in-bounds masks
    (grid: row tiles x B * H, as ``_grid`` launches it)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq
    return bh // heads, bh % heads, rows, dims, row_ok, row_ok[:, None] & (dims < head_dim)[None, :]


@triton.jit
def merge_rows(out, lse, block_out, block_lse):
    """(out, lse) merged with (block_out, block_lse): fp32 [M, D] tiles and [M] rows, the formulas
    above. Also used by the exact forward kernel, which merges its block in its own epilogue."""
    # Both sides at -inf (a row no key reached yet: placed documents, traced) stay there, out 0
    diff = tl.where(lse == block_lse, 0.0, lse - block_lse)
    small = tl.exp(-tl.abs(diff))  # in (0, 1]: no overflow whichever side dominates
    weight = tl.where(diff > 0, small, 1.0) / (1.0 + small)  # sigmoid(block_lse - lse)
    merged = out - weight[:, None] * (out - block_out)
    return merged, tl.maximum(lse, block_lse) + tl.log(1.0 + small)


@triton.jit
def _rows_of(X, sxb, sxh, sxm, sxd, r0, r1, b, h, rows, dims, row_ok, tile_ok):
    """This program's tile of X, which holds rows [r0, r1) (its rows counted from r0), in fp32
    with 0 in the rows it does not hold; and which rows it holds."""
    held = row_ok & (rows >= r0) & (rows < r1)
    tile = tl.load(X + b * sxb + h * sxh + (rows - r0)[:, None] * sxm + dims[None, :] * sxd,
                   mask=held[:, None] & tile_ok, other=0.0).to(tl.float32)
    return tile, held


@triton.jit
def _merged_with(out, lse, B, BLse, sbb, sbh, sbm, sbd, syb, syh, sym, r0, r1, b, h, rows, dims,
                 row_ok, tile_ok):
    """(out, lse) merged with the block over rows [r0, r1)."""
    block, held = _rows_of(B, sbb, sbh, sbm, sbd, r0, r1, b, h, rows, dims, row_ok, tile_ok)
    block_lse = tl.load(BLse + b * syb + h * syh + (rows - r0) * sym, mask=held,
                        other=float("-inf"))  # rows outside the block: as they are
    return merge_rows(out, lse, block, block_lse)


@triton.jit
def _merge_many(Target, TargetLse, A, ALse, B0, L0, B1, L1, B2, L2,
                stb, sth, stm, std, slb, slh, slm, sab, sah, sam, sad, sxb, sxh, sxm,
                s0b, s0h, s0m, s0d, t0b, t0h, t0m, r00, r01,
                s1b, s1h, s1m, s1d, t1b, t1h, t1m, r10, r11,
                s2b, s2h, s2m, s2d, t2b, t2h, t2m, r20, r21,
                heads, seq, head_dim, BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr):
    b, h, rows, dims, row_ok, tile_ok = _tile(heads, seq, head_dim, BLOCK_M, BLOCK_D)
    out = tl.load(A + b * sab + h * sah + rows[:, None] * sam + dims[None, :] * sad,
                  mask=tile_ok, other=0.0).to(tl.float32)
    lse = tl.load(ALse + b * sxb + h * sxh + rows * sxm, mask=row_ok, other=0.0)
    out, lse = _merged_with(out, lse, B0, L0, s0b, s0h, s0m, s0d, t0b, t0h, t0m, r00, r01, b, h,
                            rows, dims, row_ok, tile_ok)
    if BLOCKS > 1:
        out, lse = _merged_with(out, lse, B1, L1, s1b, s1h, s1m, s1d, t1b, t1h, t1m, r10, r11,
                                b, h, rows, dims, row_ok, tile_ok)
    if BLOCKS > 2:
        out, lse = _merged_with(out, lse, B2, L2, s2b, s2h, s2m, s2d, t2b, t2h, t2m, r20, r21,
                                b, h, rows, dims, row_ok, tile_ok)
    tl.debug_barrier()  # Target may be A (in place): every thread loads before any stores
    tl.store(Target + b * stb + h * sth + rows[:, None] * stm + dims[None, :] * std,
             out.to(Target.dtype.element_ty), mask=tile_ok)
    tl.store(TargetLse + b * slb + h * slh + rows * slm, lse, mask=row_ok)


@triton.jit
def _plus(acc, P, spb, sph, spm, spd, r0, r1, b, h, rows, dims, row_ok, tile_ok):
    """acc plus the part over rows [r0, r1)."""
    return acc + _rows_of(P, spb, sph, spm, spd, r0, r1, b, h, rows, dims, row_ok, tile_ok)[0]


@triton.jit
def _sum_many(Target, P0, P1, P2, P3, stb, sth, stm, std,
              s0b, s0h, s0m, s0d, r00, r01, s1b, s1h, s1m, s1d, r10, r11,
              s2b, s2h, s2m, s2d, r20, r21, s3b, s3h, s3m, s3d, r30, r31,
              heads, seq, head_dim, PARTS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_D: tl.constexpr):
    b, h, rows, dims, row_ok, tile_ok = _tile(heads, seq, head_dim, BLOCK_M, BLOCK_D)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    acc = _plus(acc, P0, s0b, s0h, s0m, s0d, r00, r01, b, h, rows, dims, row_ok, tile_ok)
    if PARTS > 1:
        acc = _plus(acc, P1, s1b, s1h, s1m, s1d, r10, r11, b, h, rows, dims, row_ok, tile_ok)
    if PARTS > 2:
        acc = _plus(acc, P2, s2b, s2h, s2m, s2d, r20, r21, b, h, rows, dims, row_ok, tile_ok)
    if PARTS > 3:
        acc = _plus(acc, P3, s3b, s3h, s3m, s3d, r30, r31, b, h, rows, dims, row_ok, tile_ok)
    tl.debug_barrier()  # Target may be a part (in place): every thread loads before any stores
    tl.store(Target + b * stb + h * sth + rows[:, None] * stm + dims[None, :] * std,
             acc.to(Target.dtype.element_ty), mask=tile_ok)


def _grid(tensor):
    batch, heads, seq, head_dim = tensor.shape
    return (triton.cdiv(seq, BLOCK_M), batch * heads), dict(
        BLOCK_M=BLOCK_M, BLOCK_D=max(16, triton.next_power_of_2(head_dim)))


def merge_(out, lse, block_out, block_lse, traced=False) -> None:
    """``online.merge_``: the block merged in place over every row of ``out`` (``traced``: as
    ``merge_many_``'s)."""
    merge_many_(out, lse, out, lse, [(block_out, block_lse, slice(0, out.shape[2]))], traced)


def _slots(entries, capacity, seq):
    """A kernel's fixed slots for ``entries`` ((*tensors, rows)): their tensors, and per slot the
    tensors' strides and the rows' (start, stop); slots past the entries repeat the first (the
    kernel reads no more than it is told)."""
    tensors, args = [], []
    for *xs, rows in entries + entries[:1] * (capacity - len(entries)):
        tensors += xs
        args += [*(s for x in xs for s in x.stride()), *rows.indices(seq)[:2]]
    return tensors, args


def merge_many_(target, target_lse, first, first_lse, blocks, traced=False) -> None:
    """``online.merge_many_`` in one kernel launch (1 to MAX_BLOCKS blocks). ``traced``: the
    launch through ``torch.library.wrap_triton``, a node of the traced graph that inductor
    launches itself (``online.TracedFp32``)."""
    grid, meta = _grid(target)
    tensors, args = _slots(blocks, MAX_BLOCKS, first.shape[2])
    kernel = torch.library.wrap_triton(_merge_many) if traced else _merge_many
    kernel[grid](target, target_lse, first, first_lse, *tensors, *target.stride(),
                 *target_lse.stride(), *first.stride(), *first_lse.stride(), *args,
                 *target.shape[1:], BLOCKS=len(blocks), **meta)


def sum_many_(target, parts) -> None:
    """``online.sum_many_`` in one kernel launch (1 to MAX_PARTS parts)."""
    grid, meta = _grid(target)
    tensors, args = _slots(parts, MAX_PARTS, target.shape[2])
    _sum_many[grid](target, *tensors, *target.stride(), *args, *target.shape[1:],
                    PARTS=len(parts), **meta)


def accumulate_(acc, x, add: bool) -> None:
    """``online.accumulate_`` in one kernel launch."""
    every = slice(0, acc.shape[2])
    sum_many_(acc, [(acc, every), (x, every)] if add else [(x, every)])
