"""The fp32 merge of ``merge.py`` as one Triton kernel: one pass over the accumulator.

    grid (row tiles of BLOCK_M, B * H): each program reads BLOCK_M rows of the fp32 accumulator
    (out, lse) and of the block (block_out in any float dtype, block_lse fp32), writes back

        e   = exp(-|lse - block_lse|)
        w   = sigmoid(block_lse - lse)  = (e if lse > block_lse else 1) / (1 + e)
        out = out - w * (out - block_out)
        lse = max(lse, block_lse) + log(1 + e)      (= lse - logsigmoid(lse - block_lse))

Memory: out read and written once (fp32), block_out read once; the torch form makes ~8 passes.
Tensors may be any strided views ([B, H, S, D] / [B, H, S]: the schedules merge row slices in
place). ``block_lse = -inf`` (a row that saw no key in this block) leaves the row unchanged.
Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the tests use that).
"""
import triton
import triton.language as tl

BLOCK_M = 32


@triton.jit
def _merge(Out, Lse, BlockOut, BlockLse,
           sob, soh, som, sod, slb, slh, slm, sbb, sbh, sbm, sbd, sxb, sxh, sxm,
           heads, seq, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq
    tile_ok = row_ok[:, None] & (dims < head_dim)[None, :]
    lse_ptrs = Lse + b * slb + h * slh + rows * slm
    lse = tl.load(lse_ptrs, mask=row_ok, other=0.0)
    block_lse = tl.load(BlockLse + b * sxb + h * sxh + rows * sxm, mask=row_ok, other=0.0)
    diff = lse - block_lse
    small = tl.exp(-tl.abs(diff))  # in (0, 1]: no overflow whichever side dominates
    weight = tl.where(diff > 0, small, 1.0) / (1.0 + small)  # sigmoid(block_lse - lse)
    out_ptrs = Out + b * sob + h * soh + rows[:, None] * som + dims[None, :] * sod
    out = tl.load(out_ptrs, mask=tile_ok, other=0.0)
    block_out = tl.load(BlockOut + b * sbb + h * sbh + rows[:, None] * sbm + dims[None, :] * sbd,
                        mask=tile_ok, other=0.0).to(tl.float32)
    tl.store(out_ptrs, out - weight[:, None] * (out - block_out), mask=tile_ok)
    tl.store(lse_ptrs, tl.maximum(lse, block_lse) + tl.log(1.0 + small), mask=row_ok)


def merge_(out, lse, block_out, block_lse) -> None:
    """``merge.merge_`` in one kernel launch (CUDA tensors, or CPU under TRITON_INTERPRET=1)."""
    batch, heads, seq, head_dim = out.shape
    grid = (triton.cdiv(seq, BLOCK_M), batch * heads)
    _merge[grid](out, lse, block_out, block_lse, *out.stride(), *lse.stride(),
                 *block_out.stride(), *block_lse.stride(), heads, seq, head_dim,
                 BLOCK_M=BLOCK_M, BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
