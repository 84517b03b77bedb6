"""The fp32 merge and accumulation of ``merge.py`` as Triton kernels: one pass over each tensor.

``_merge``:

    grid (row tiles of BLOCK_M, B * H): each program reads BLOCK_M rows of the fp32 accumulator
    (out, lse) and of the block (block_out in any float dtype, block_lse fp32), writes back

        e   = exp(-|lse - block_lse|)
        w   = sigmoid(block_lse - lse)  = (e if lse > block_lse else 1) / (1 + e)
        out = out - w * (out - block_out)
        lse = max(lse, block_lse) + log(1 + e)      (= lse - logsigmoid(lse - block_lse))

Memory: out read and written once (fp32), block_out read once; the torch form makes ~8 passes.

``_merge_into``: the same merge written out of place over every row of a target (fp32, or the
final 16-bit out): target = a merged with a block that covers rows [r0, r1) of it (rows outside it
take a as is). The forward uses it to start its fp32 accumulator from the first two blocks (no
separate copy of the first) and to write the last merge straight into the 16-bit result (no
separate cast).

``_accumulate``: acc = x, or acc += x (ADD), acc fp32, x any float dtype, same grid.

Both update their tensors in place, and a 1-D row vector (lse) is held by several threads at once
(Triton replicates it across the threads of the 2-D tile's rows): a thread that ran ahead could store
the new lse before another thread holding the same row had loaded the old one, which then weighs
that row of out wrongly. Measured on an H200: 6 of 3000 merges differed in a row while another
stream loaded memory. So every load completes, in every thread,
before the first store: a CTA barrier between them.

Tensors may be any strided views ([B, H, S, D] / [B, H, S]: the schedules merge row slices in
place). ``block_lse = -inf`` (a row that saw no key in this block) leaves the row unchanged.
Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the tests use that).
"""
import triton
import triton.language as tl

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
    diff = lse - block_lse
    small = tl.exp(-tl.abs(diff))  # in (0, 1]: no overflow whichever side dominates
    weight = tl.where(diff > 0, small, 1.0) / (1.0 + small)  # sigmoid(block_lse - lse)
    merged = out - weight[:, None] * (out - block_out)
    return merged, tl.maximum(lse, block_lse) + tl.log(1.0 + small)


@triton.jit
def _merge(Out, Lse, BlockOut, BlockLse,
           sob, soh, som, sod, slb, slh, slm, sbb, sbh, sbm, sbd, sxb, sxh, sxm,
           heads, seq, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    b, h, rows, dims, row_ok, tile_ok = _tile(heads, seq, head_dim, BLOCK_M, BLOCK_D)
    lse_ptrs = Lse + b * slb + h * slh + rows * slm
    lse = tl.load(lse_ptrs, mask=row_ok, other=0.0)
    block_lse = tl.load(BlockLse + b * sxb + h * sxh + rows * sxm, mask=row_ok, other=0.0)
    out_ptrs = Out + b * sob + h * soh + rows[:, None] * som + dims[None, :] * sod
    out = tl.load(out_ptrs, mask=tile_ok, other=0.0)
    block_out = tl.load(BlockOut + b * sbb + h * sbh + rows[:, None] * sbm + dims[None, :] * sbd,
                        mask=tile_ok, other=0.0).to(tl.float32)
    tl.debug_barrier()  # in place: no thread stores before every thread has loaded (see above)
    out, lse = merge_rows(out, lse, block_out, block_lse)
    tl.store(out_ptrs, out, mask=tile_ok)
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def _merge_into(Target, TargetLse, A, ALse, B, BLse,
                stb, sth, stm, std, slb, slh, slm, sab, sah, sam, sad, sxb, sxh, sxm,
                sbb, sbh, sbm, sbd, syb, syh, sym, r0, r1, heads, seq, head_dim,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    b, h, rows, dims, row_ok, tile_ok = _tile(heads, seq, head_dim, BLOCK_M, BLOCK_D)
    a = tl.load(A + b * sab + h * sah + rows[:, None] * sam + dims[None, :] * sad, mask=tile_ok,
                other=0.0).to(tl.float32)
    a_lse = tl.load(ALse + b * sxb + h * sxh + rows * sxm, mask=row_ok, other=0.0)
    in_block = row_ok & (rows >= r0) & (rows < r1)
    brows = rows - r0
    block = tl.load(B + b * sbb + h * sbh + brows[:, None] * sbm + dims[None, :] * sbd,
                    mask=in_block[:, None] & tile_ok, other=0.0).to(tl.float32)
    block_lse = tl.load(BLse + b * syb + h * syh + brows * sym, mask=in_block,
                        other=float("-inf"))  # rows outside the block: a as is
    tl.debug_barrier()  # TargetLse may be ALse (in place): every thread loads before any stores
    out, lse = merge_rows(a, a_lse, block, block_lse)
    tl.store(Target + b * stb + h * sth + rows[:, None] * stm + dims[None, :] * std,
             out.to(Target.dtype.element_ty), mask=tile_ok)
    tl.store(TargetLse + b * slb + h * slh + rows * slm, lse, mask=row_ok)


@triton.jit
def _accumulate(Acc, X, sab, sah, sam, sad, sxb, sxh, sxm, sxd, heads, seq, head_dim,
                ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    b, h, rows, dims, _, tile_ok = _tile(heads, seq, head_dim, BLOCK_M, BLOCK_D)
    acc_ptrs = Acc + b * sab + h * sah + rows[:, None] * sam + dims[None, :] * sad
    x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxm + dims[None, :] * sxd, mask=tile_ok,
                other=0.0).to(tl.float32)
    if ADD:
        x += tl.load(acc_ptrs, mask=tile_ok, other=0.0)
        tl.debug_barrier()  # in place (see above)
    tl.store(acc_ptrs, x, mask=tile_ok)


def _grid(tensor):
    batch, heads, seq, head_dim = tensor.shape
    return (triton.cdiv(seq, BLOCK_M), batch * heads), dict(
        BLOCK_M=BLOCK_M, BLOCK_D=max(16, triton.next_power_of_2(head_dim)))


def merge_(out, lse, block_out, block_lse) -> None:
    """``merge.merge_`` in one kernel launch (CUDA tensors, or CPU under TRITON_INTERPRET=1)."""
    grid, blocks = _grid(out)
    _merge[grid](out, lse, block_out, block_lse, *out.stride(), *lse.stride(),
                 *block_out.stride(), *block_lse.stride(), *out.shape[1:], **blocks)


def merge_into_(target, target_lse, a, a_lse, block_out, block_lse, rows: slice) -> None:
    """``merge.merge_into_`` in one kernel launch."""
    grid, blocks = _grid(target)
    _merge_into[grid](target, target_lse, a, a_lse, block_out, block_lse, *target.stride(),
                      *target_lse.stride(), *a.stride(), *a_lse.stride(), *block_out.stride(),
                      *block_lse.stride(), rows.start, rows.stop, *target.shape[1:], **blocks)


def accumulate_(acc, x, add: bool) -> None:
    """``merge.accumulate_`` in one kernel launch."""
    grid, blocks = _grid(acc)
    _accumulate[grid](acc, x, *acc.stride(), *x.stride(), *acc.shape[1:], ADD=add, **blocks)
