"""PyTorch's memory-efficient CUDA kernel (the CUTLASS kernels from xformers), called through its
aten ops: the CUDA fallback where cuDNN and flash do not apply.

Unlike those two it takes fp32 as well as bf16/fp16 and head dims above 256, and unlike ``math`` it
never materialises the S_q x S_k scores: ``math`` on one 16K x 16K block of 32 heads needs 32 GiB
for the fp32 scores alone (and three such tensors in its backward), which runs a GPU out of
memory at the sequence lengths context parallelism is for. ``efficient_exact`` (``upcast.py``)
runs it on fp32-upcast blocks: exact mode's fallback where the Triton kernel does not apply.

* Masks: its ``custom_mask_type`` has all three (0 none, 1 causal from the top left, 2 causal from
  the bottom right).
* Layout: it works in [B, S, H, D]; q, k and v go in as transposed views.
* GQA: none in the kernel, so k/v are repeated for it on the compute side (``repeat_kv``) and dk/dv
  summed back; they never travel repeated.
* LSE: its forward returns the LSE padded to a multiple of ``_LSE_ALIGN`` rows, and its backward
  reads that layout; the ring's merged LSE is put back into it.
* Its backward reads ``out`` and ``dout`` as dense [B, S, H, D] tensors, so they are copied
  into that layout: with 16-bit inputs (torch 2.11, CUDA), an ``out`` in the ring's [B, H, S, D]
  layout (a transposed view) gave wrong dq and dk, where its own forward's out, dense in
  [B, S, H, D], gave the right ones; fp32 was right either way (docs/design.md, "Measurements
  behind design choices").
* Its backward is a custom op (``efficient_backward``), so the compile pass can trace it (see
  there), and runs with ``num_splits_key=1``: with more splits the kernel adds dq across them
  with atomics, and the result would change from run to run.
"""
import torch

from .base import CAUSAL, CAUSAL_BOTTOM_RIGHT, MASKS, NONE, BlockKernel, repeat_kv, sum_kv_groups
from .cuda import _rows_strided

_aten = torch.ops.aten
_MASK_TYPE = {NONE: 0, CAUSAL: 1, CAUSAL_BOTTOM_RIGHT: 2}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LSE_ALIGN = 32  # the row padding of the kernel's LSE (kAlignLSE in PyTorch's kernel)


def _bshd(x):
    """[B, H, S, D] as the kernel's [B, S, H, D] view; a copy only if D is not dense."""
    return _rows_strided(x).transpose(1, 2)


def _bshd_dense(x):
    """[B, H, S, D] as a dense [B, S, H, D] tensor (one copy at most)."""
    return x.transpose(1, 2).contiguous()


class Efficient(BlockKernel):
    name = "efficient"
    masks = MASKS

    def available(self, device, dtype, head_dim):
        # PyTorch's own SDPA dispatch asks for a head dim that is a multiple of 8 (16-bit) or 4
        # (fp32) before it picks this kernel; 8 covers both.
        return (device.type == "cuda" and torch.cuda.is_available() and dtype in _DTYPES
                and head_dim % 8 == 0 and torch.backends.cuda.mem_efficient_sdp_enabled())

    def forward(self, q, k, v, mask, scale, segments=None, window=None):
        assert window is None, "no sliding windows (windows = ())"
        groups = q.shape[1] // k.shape[1]
        out, lse = _aten._efficient_attention_forward(
            _bshd(q), _bshd(repeat_kv(k, groups)), _bshd(repeat_kv(v, groups)), None, None, None,
            None, None, 0.0, _MASK_TYPE[mask], True, scale=scale)[:2]
        return out.transpose(1, 2), lse[:, :, :q.shape[2]]

    def backward(self, dout, q, k, v, out, lse, mask, scale, segments=None, window=None):
        assert window is None, "no sliding windows (windows = ())"
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = efficient_backward(dout, q, repeat_kv(k, groups), repeat_kv(v, groups), out,
                                        lse, _MASK_TYPE[mask], scale)
        return dq, sum_kv_groups(dk, groups), sum_kv_groups(dv, groups)


# The backward as a custom op: the aten op's fake (meta) implementation in torch 2.11 to 2.13
# lacks its ``out`` argument, so every later argument lands one place off and tracing it (the
# compile pass) fails with "got multiple values for argument 'scale'". The forward's traces.
@torch.library.custom_op("dtensor_ring::efficient_attention_backward", mutates_args=())
def efficient_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, mask_type: int,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of q, k, v with as many heads, contiguous [B, H, S, D] (what the kernel writes
    follows its inputs' strides; contiguous results keep the fake's strides the real ones)."""
    seq_q, seq_k = q.shape[2], k.shape[2]
    lse_padded = lse.new_zeros(*lse.shape[:2], -(-seq_q // _LSE_ALIGN) * _LSE_ALIGN)
    lse_padded[:, :, :seq_q] = lse
    no_dropout = torch.empty((), dtype=torch.long)  # the RNG state: never read at p = 0
    dq, dk, dv, _ = _aten._efficient_attention_backward(
        _bshd_dense(dout), _bshd(q), _bshd(k), _bshd(v), None, _bshd_dense(out),
        None, None, seq_q, seq_k, lse_padded, 0.0, no_dropout, no_dropout, mask_type, False,
        scale=scale, num_splits_key=1)
    return tuple(x.transpose(1, 2).contiguous() for x in (dq, dk, dv))


@efficient_backward.register_fake
def _(dout, q, k, v, out, lse, mask_type, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
