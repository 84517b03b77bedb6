"""What every schedule shares: running a list of blocks into an fp32 accumulator, and its backward."""
import torch

from ..kernels import BlockKernel
from ..layouts import Block
from ..merge import init_, merge_


def attend_(kernel: BlockKernel, q, k, v, block: Block, scale: float, out, lse, fresh: bool):
    """Attention of ``block`` merged into ``out``/``lse`` (fp32); ``fresh``: its rows are untouched."""
    block_out, block_lse = kernel.forward(q[:, :, block.q], k[:, :, block.k], v[:, :, block.k],
                                          block.mask, scale)
    (init_ if fresh else merge_)(out[:, :, block.q], lse[:, :, block.q], block_out, block_lse)


def block_grads(kernel: BlockKernel, dout, q, k, v, out, lse, block: Block, scale: float):
    """(dq, dk, dv) of ``block``: its share of the full attention's gradients, in the input dtype."""
    rows, cols = block.q, block.k
    return kernel.backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                           out[:, :, rows], lse[:, :, rows], block.mask, scale)


def add_grads_(block: Block, grads, dq, dk, dv):
    """Add a block's gradients into the fp32 accumulators."""
    dq_b, dk_b, dv_b = grads
    dq[:, :, block.q] += dq_b
    dk[:, :, block.k] += dk_b
    dv[:, :, block.k] += dv_b


def result_out(out: torch.Tensor, q: torch.Tensor, kernel: BlockKernel) -> torch.Tensor:
    """The merged fp32 ``out`` as a schedule returns it: cast to q's dtype, except for an exact
    kernel, whose backward takes the fp32 out (D = rowsum(dO * O)); the caller casts that one."""
    return out if kernel.exact else out.to(q.dtype)


def fp32_like(x: torch.Tensor, shape=None) -> torch.Tensor:
    return x.new_zeros(x.shape if shape is None else shape, dtype=torch.float32)
