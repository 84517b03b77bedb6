"""What every schedule shares: running a list of blocks into an fp32 accumulator, and its backward."""
import torch

from ..kernels import BlockKernel
from ..kernels.base import Into
from ..layouts import Block
from ..merge import MAX_BLOCKS, MAX_PARTS, accumulate_, merge_, merge_many_, sum_many_
from ..kernels.words import zero_


def attend_(kernel: BlockKernel, q, k, v, block: Block, scale: float, out, lse, fresh: bool):
    """Attention of ``block`` merged into ``out``/``lse`` (fp32); ``fresh``: its rows are untouched."""
    kernel.forward_into(out[:, :, block.q], lse[:, :, block.q], fresh, q[:, :, block.q],
                        k[:, :, block.k], v[:, :, block.k], block.mask, scale, block.segments,
                        block.window)


def forward_block(kernel: BlockKernel, q, k, v, block: Block, scale: float):
    """(out, lse) of ``block`` as the kernel returns them."""
    return kernel.forward(q[:, :, block.q], k[:, :, block.k], v[:, :, block.k], block.mask,
                          scale, block.segments, block.window)


def backward_operands(kernel: BlockKernel, dout, out, q, docs):
    """A schedule's (dout, out) for its blocks' backward: dout in q's dtype (exact mode's is fp32
    holding 16-bit values: one cast, lossless), and both in the layout the kernel's backward
    needs (``BlockKernel.backward_layout``), once for the whole tensors.

    dout keeps its memory where that is [B, H, S, D] or [B, S, H, D] (a model's attention
    output's gradient usually is the latter, like its q: cuDNN then needs no copy of it), or q's
    strides (the 2-D mesh's head pieces: views of one received buffer); any other (an expanded
    or overlapping gradient, as ``out.sum()`` gives) is copied contiguous."""
    if not (dout.is_contiguous() or dout.transpose(1, 2).is_contiguous()
            or (dout.shape == q.shape and dout.stride() == q.stride())):
        dout = dout.contiguous()
    dout = dout.to(q.dtype)
    return tuple(kernel.backward_layout(x, q, docs is not None) for x in (dout, out))


def block_backward(kernel: BlockKernel, dout, q, k, v, out, lse, block: Block, scale: float,
                   dq: "RowSums | HeldSums", dk: "RowSums | None" = None,
                   dv: "RowSums | None" = None):
    """The gradients of ``block``, its share of the full attention's: dq goes into ``dq``'s rows,
    dk and dv into ``dk``'s and ``dv``'s when given; else they are returned (for the caller to add
    later) as (dk, dv)."""
    rows, cols = block.q, block.k
    into = (dq.claim(rows), *((dk.claim(cols), dv.claim(cols)) if dk is not None else (None,) * 2))
    dq_block, dk_block, dv_block = kernel.backward_into(
        into, dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows],
        lse[:, :, rows], block.mask, scale, block.segments, block.window)
    if into[0] is None:
        dq.hold(rows, dq_block)
    return None if dk is not None else (dk_block, dv_block)


class RowSums:
    """An fp32 sum of blocks' results over row slices of a [B, H, S, D] tensor, with no zero-fill:
    the first result to reach a row is written there (``claim`` says where and how), later ones
    are added; rows no result reached are zeroed by ``result()``. Rows are
    ``slice(start, stop)``s along dim 2.

    ``value``: the fp32 tensor to sum into, uninitialised (``fp32_empty``) or, with
    ``written=True``, holding values in every row already (e.g. a received accumulator)."""

    def __init__(self, value: torch.Tensor, written: bool = False):
        self.value = value
        self._written = [(0, value.shape[2])] if written else []  # disjoint, sorted (start, stop)

    def _gaps(self, start, stop):
        gaps = []
        for a, b in self._written:
            if a > start:
                gaps.append((start, min(a, stop)))
            start = max(start, b)
            if start >= stop:
                break
        return gaps + ([(start, stop)] if start < stop else [])

    def _mark(self, start, stop):
        spans = sorted(self._written + [(start, stop)])
        self._written = [spans[0]]
        for a, b in spans[1:]:
            if a <= self._written[-1][1]:
                self._written[-1] = (self._written[-1][0], max(b, self._written[-1][1]))
            else:
                self._written.append((a, b))

    def claim(self, rows: slice) -> Into:
        """Where a result for ``rows`` goes: their view, to be added to (``add=True``) where any
        of them holds a value, else overwritten. Rows no result reached yet are zeroed first when
        others in the span were."""
        start, stop, _ = rows.indices(self.value.shape[2])
        gaps = self._gaps(start, stop)
        fresh = gaps == [(start, stop)]
        if not fresh:
            for a, b in gaps:
                zero_(self.value[:, :, a:b])
        self._mark(start, stop)
        return Into(self.value[:, :, start:stop], add=not fresh)

    def add_(self, rows: slice, x: torch.Tensor) -> None:
        target = self.claim(rows)
        accumulate_(target.view, x, target.add)

    def result(self) -> torch.Tensor:
        for a, b in self._gaps(0, self.value.shape[2]):
            zero_(self.value[:, :, a:b])
        return self.value

    def result_in(self, dtype: torch.dtype) -> torch.Tensor:
        return self.result().to(dtype)


class HeldSums:
    """The fp32 sum of blocks' 16-bit results over row slices of a [B, H, S, D] tensor like
    ``like``, for a kernel that returns them (fp32 mode): ``claim`` takes none (None), the caller
    ``hold``s each result, and they are summed ``per_pass`` at a time (``sum_many_``), the fp32 sum
    so far being one of them after the first pass; ``result_into`` sums the rest straight into
    the output. Rows no result reached are 0. The sums and their order are RowSums's, so the bits
    are too.

    Why: RowSums reads and writes the fp32 sum for every result and casts it at the end. For the
    ring's dq at W = 4 (zigzag rank 3: six results over 9 half-blocks of rows), in bytes per
    element of a half-block: 94 there, 54 here. The default ``per_pass`` = 3 holds at most two
    results (and the fp32 sum) at a time: more would save a pass but hold more memory. Llama 3's
    three results per head group take ``MAX_PARTS``: one pass, no fp32 sum at all."""

    def __init__(self, like: torch.Tensor, per_pass: int = 3):
        assert 2 <= per_pass <= MAX_PARTS, per_pass
        self.like, self.per_pass = like, per_pass
        self.sum: torch.Tensor | None = None
        self.held: list = []  # (x, rows)

    def claim(self, rows: slice) -> None:
        return None

    def hold(self, rows: slice, x: torch.Tensor) -> None:
        self.held.append((x, rows))
        parts = self._parts()
        if len(parts) == self.per_pass:
            target = fp32_empty(self.like) if self.sum is None else self.sum
            sum_many_(target, parts)
            self.sum, self.held = target, []

    def _parts(self) -> list:
        every = slice(0, self.like.shape[2])
        return ([(self.sum, every)] if self.sum is not None else []) + self.held

    def result_in(self, dtype: torch.dtype) -> torch.Tensor:
        return self.result_into(self.like.new_empty(self.like.shape, dtype=dtype))

    def result_into(self, target: torch.Tensor) -> torch.Tensor:
        """The sum written into ``target`` (``like``'s shape, any float dtype and strides)."""
        sum_many_(target, self._parts())
        self.sum, self.held = None, []
        return target


class ForwardMerge:
    """The forward's (out, lse) over a known number of blocks, for a kernel that returns each
    block's out in q's dtype (fp32 mode). The first block's result covers every row.

    Up to ``MAX_BLOCKS`` + 1 blocks (W <= 4): every result is held until the last, and all are
    merged in one pass, written over the first block's (its out in q's dtype, its lse; or a new
    contiguous out: ``merge_target``): one pass over out, where merging as they come took W - 1,
    and no more memory: at most four results, where merging as they come held the fp32
    accumulator (two results' bytes), a result and the first result or the output.

    More blocks: merged as they come, the second with the first into an fp32 accumulator, later
    ones in place, the last straight into the result in q's dtype (no separate cast)."""

    def __init__(self, q: torch.Tensor, blocks: int):
        self.q, self.left = q, blocks
        self.held = [] if blocks <= MAX_BLOCKS + 1 else None  # None: merged as they come
        self.out = self.lse = None
        self.accumulating = False  # out is the fp32 accumulator (else the first block's out)

    def add(self, block_out: torch.Tensor, block_lse: torch.Tensor, rows: slice) -> None:
        self.left -= 1
        if self.out is None:
            assert rows.indices(self.q.shape[2]) == (0, self.q.shape[2], 1), "first: every row"
            # Kept as it is for the merge (``merge_target``); a lone block is the result:
            # contiguous. (The CPU kernel's LSE is a transposed view.)
            self.out = block_out if self.left else block_out.contiguous()
            self.lse = block_lse.contiguous()
        elif self.held is not None:
            self.held.append((block_out, block_lse, rows))
            if not self.left:
                target = merge_target(self.out)
                merge_many_(target, self.lse, self.out, self.lse, self.held)
                self.out, self.held = target, []
        elif self.accumulating and self.left:
            merge_(self.out[:, :, rows], self.lse[:, :, rows], block_out, block_lse)
        else:
            target = fp32_empty(self.q) if self.left else self.q.new_empty(self.q.shape)
            merge_many_(target, self.lse, self.out, self.lse, [(block_out, block_lse, rows)])
            self.out, self.accumulating = target, bool(self.left)

    def result(self):
        return self.out, self.lse


def merge_target(first: torch.Tensor) -> torch.Tensor:
    """Where a forward merge over ``first`` (a block's out in q's dtype) writes its result:
    ``first`` itself (in place) where it is contiguous, else a new contiguous tensor. The result
    must be contiguous (the custom op's fake promises it), and a block's out may follow q's
    strides (cuDNN's does, and a model's q is [B, S, H, D] memory): merging into a new tensor
    saves copying ``first`` contiguous before the merge."""
    return first if first.is_contiguous() else first.new_empty(first.shape)


def result_out(out: torch.Tensor, q: torch.Tensor, kernel: BlockKernel) -> torch.Tensor:
    """The merged fp32 ``out`` as a schedule returns it: cast to q's dtype, except for an exact
    kernel, whose backward takes the fp32 out (D = rowsum(dO * O)); the caller casts that one."""
    return out if kernel.exact else out.to(q.dtype)


def fp32_empty(x: torch.Tensor, shape=None) -> torch.Tensor:
    """An uninitialised fp32 accumulator, for a schedule whose first blocks cover every row."""
    return x.new_empty(x.shape if shape is None else shape, dtype=torch.float32)
