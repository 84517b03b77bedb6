"""PyTorch's CUDA attention kernels called through their aten ops: cuDNN and flash.

Both take bf16/fp16, return the LSE in fp32, and accept a backward with an LSE and output that are
not their own (the merged ones), which is what the ring needs. cuDNN is the fastest on Hopper.
PyTorch's flash op is flash-attn v2 inside: its ``is_causal`` is bottom-right aligned, which is
top-left for square blocks, so it offers both causal masks; cuDNN's is top-left only.

Packed documents: PyTorch's flash op has a varlen form (``_flash_attention_forward`` /
``_backward`` with cumulative boundaries, one batch row at a time as [S, H, D] views); it is the
document kernel of fp32 mode on CUDA. cuDNN's ragged form (``_cudnn_attention_forward`` with
boundaries) is not used: with torch 2.11 and cuDNN 9.19 it was orders of magnitude slower than
flash's, and gave wrong rows for causal segments of unequal lengths. Through cudnn-frontend's graph
API its kernels are faster than flash's, but each call costs three times flash's host time, which
ate the gain in an eager zigzag rank (docs/design.md, "Measurements behind design choices").

Strided inputs: the schedules pass row slices of [B, H, S, D] tensors (zigzag's half blocks).
With torch 2.11 and cuDNN 9.19, cuDNN's forward and backward and flash's forward give the same
results on the views as on contiguous copies, so they get the views (a copy per tensor costs a
pass over it); flash's backward gives wrong gradients on row-sliced q/dout/out/lse views, so it
gets contiguous copies (``backward_takes_views``).

Sliding windows: an edge block's band goes to PyTorch's flash op with window sizes, for both
kernels (cuDNN through PyTorch takes no window), except the causal mask read backwards, which runs
as the kernel's own causal mask on reversed rows; ``windows.py``.
"""
import os

import torch
from torch.torch_version import TorchVersion

from .base import MASKS, NONE, BlockKernel, repeat_kv, sum_kv_groups
from . import windows as _windows

_aten = torch.ops.aten
_HALF = (torch.bfloat16, torch.float16)


def _rows_strided(x):
    """``x`` as is if its last dim is dense (any other strides), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


class _CudaKernel(BlockKernel):
    min_head_dim, max_head_dim = 8, 128
    backward_takes_views = True

    def available(self, device, dtype, head_dim):
        return (device.type == "cuda" and dtype in _HALF and head_dim % 8 == 0
                and self.min_head_dim <= head_dim <= self.max_head_dim
                and self._op_available())

    def _op_available(self):
        return True

    @property
    def windows(self):
        """Bands, through the flash op (``windows.py``), where it takes them and is enabled."""
        usable = _windows.FLASH_TAKES_WINDOWS and torch.backends.cuda.flash_sdp_enabled()
        return (_windows.BAND,) if usable else ()

    def forward(self, q, k, v, mask, scale, segments=None, window=None):
        if window is not None and _windows.reversed_causal(window, q.shape[2], k.shape[2]):
            return _windows.reversed_forward(self.forward, q, k, v, scale)
        if window is not None:
            return _windows.flash_forward(q, k, v, window, scale)
        if segments is not None:
            return self._varlen_forward(q, k, v, mask != NONE, scale, segments)
        groups, causal = q.shape[1] // k.shape[1], mask != NONE
        if not self.supports_gqa:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        return self._forward(_rows_strided(q), _rows_strided(k), _rows_strided(v), causal, scale)

    def backward(self, dout, q, k, v, out, lse, mask, scale, segments=None, window=None):
        if window is not None and _windows.reversed_causal(window, q.shape[2], k.shape[2]):
            return _windows.reversed_backward(self.backward, dout, q, k, v, out, lse, scale)
        if window is not None:
            return _windows.flash_backward(dout, q, k, v, out, lse, window, scale)
        if segments is not None:
            return self._varlen_backward(dout, q, k, v, out, lse, mask != NONE, scale, segments)
        causal = mask != NONE
        groups = q.shape[1] // k.shape[1]
        if not self.supports_gqa:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        tensors = [_rows_strided(x) for x in (dout, q, k, v, out)] + [lse]
        if not self.backward_takes_views:
            tensors = [x.contiguous() for x in tensors]
        dq, dk, dv = self._backward(*tensors, causal, scale)
        if not self.supports_gqa:
            dk, dv = sum_kv_groups(dk, groups), sum_kv_groups(dv, groups)
        return dq, dk, dv


class Cudnn(_CudaKernel):
    name = "cudnn"
    min_head_dim = 16  # the plan-cache marker must not be a multiple of the head dim (note below)

    def _op_available(self):
        return torch.backends.cudnn.is_available()

    def _forward(self, q, k, v, causal, scale):
        out, lse = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse.view(lse.shape[:3])  # cuDNN's LSE is [B, H, S, 1]

    # Dout and out take q's strides (once per backward, ``backward_layout``), and the keys a
    # marker (``unshared_keys``): see the note "cuDNN backward plans" below.

    def backward_layout(self, x, q, documents):
        return _strided_like(x, q)

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        dout, out = _strided_like(dout, q), _strided_like(out, q)  # no copy after backward_layout
        seed = offset = torch.empty(0, device=q.device)
        return _aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, unshared_keys(k), v, out, lse.unsqueeze(-1), seed, offset, None, None, None,
            q.shape[2], k.shape[2], 0.0, causal, scale=scale)


# Note "cuDNN backward plans" (torch 2.11 to 2.13; cuDNN 9.19).
#
# PyTorch caches each cuDNN backward plan under the dims and strides of q, k and v only
# (``MHAParams`` in aten/src/ATen/native/cudnn/MHA.cpp; one cache per thread, never cleared), but
# the plan holds the strides of out, dout and the LSE of the call that built it. A later call with
# the same q, k and v and other out/dout/LSE strides runs that plan on its own pointers: silently
# wrong gradients (seen with zigzag after PyTorch's context parallel had run in the process;
# tests/test_cudnn_plan_cache.py). Any cuDNN attention in the process can build such a plan
# first: PyTorch's own SDPA (its dout is whatever the model's next op gives), its context
# parallel (merged outs, chunk views), other libraries. Ours hand out/dout with q's strides and
# slices of a [B, H, S] LSE, which no other caller need share. torch 2.14 keys the plan on out,
# dout and the LSE as well.
#
# So on torch < 2.14 the keys a backward hands cuDNN carry a stride no other caller's tensors
# have: a plan cached under our key was built by one of our calls, whose out/dout/LSE strides are
# a function of q's (the same for every call with that key). Natural tensors' strides, other than
# the head dim's 1, are multiples of the head dim D (products of sizes that include it, or slices
# of such); the marker is 8 elements past a multiple of D (D >= 16: ``Cudnn.min_head_dim``), and
# a multiple of 8 elements (16 bytes, as cuDNN's tensor-memory loads need).
# * Batch 1 (usual in long-context training): the batch dim's stride, which no address uses,
#   becomes the marker, past the tensor's extent so that the dims keep their order; no copy.
# * Larger batches, or with TORCH_CUDNN_SDPA_AVOID_RECOMPILE set (PyTorch then keys every batch
#   stride as the same value): the keys are copied into a buffer whose head stride is S * D + 8
#   (one copy of a block's keys per call).
_PLAN_KEY_HOLDS_EVERY_OPERAND = TorchVersion(torch.__version__) >= "2.14.0"
_MARKER = 8  # elements


def unshared_keys(k: torch.Tensor) -> torch.Tensor:
    """``k`` ([B, H, S, D], D >= 16) with the plan-cache marker of the note above (as it is on a
    torch whose cache key holds every operand)."""
    if _PLAN_KEY_HOLDS_EVERY_OPERAND:
        return k
    b, h, s, d = k.shape
    if b == 1 and not _batch_stride_unkeyed():
        extent = max(stride * size for stride, size in zip(k.stride()[1:], k.shape[1:]))
        # The offset explicitly: traced, as_strided without one starts at the storage's start.
        return k.as_strided(k.shape, (-(-extent // d) * d + _MARKER, *k.stride()[1:]),
                            k.storage_offset())
    head = s * d + _MARKER
    marked = k.new_empty(b * h * head).as_strided(k.shape, (h * head, head, d, 1))
    return marked.copy_(k)


def _batch_stride_unkeyed() -> bool:
    return os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "").lower() in ("1", "true", "on",
                                                                            "yes")


class Flash(_CudaKernel):
    name = "flash"
    max_head_dim = 256
    masks = MASKS
    backward_takes_views = False
    documents = True

    def _op_available(self):
        return torch.backends.cuda.flash_sdp_enabled()

    def _forward(self, q, k, v, causal, scale):
        return _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                         scale=scale)[:2]

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        # No varlen (cum_seq None) and no dropout (the RNG state is never read).
        unused_rng = torch.empty(0, device=q.device)
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
            unused_rng, unused_rng, scale=scale)

    # Packed documents: the varlen op, per batch row, on [S, H, D] views of the [B, H, S, D]
    # tensors (any row and head strides; checked right on CUDA with zero-length q and k
    # segments, GQA and transposed views). Its causal mask is bottom-right aligned per segment.
    # A row that sees no key gets LSE +inf from the kernel: -inf here (the kernels' convention).

    def backward_layout(self, x, q, documents):
        # The varlen backward op copies dout and out to contiguous [S, H, D] on every call
        # (PyTorch's _flash_attention_backward): here once per backward instead, and not at all
        # when they are already (a model's attention output usually is: [B, S, H, D] memory seen
        # as [B, H, S, D]). The op's copies were a visible share of a zigzag rank's backward with
        # packed documents (measured: docs/design.md, "Measurements behind design choices").
        return x.transpose(1, 2).contiguous().transpose(1, 2) if documents else x

    def _varlen_forward(self, q, k, v, causal, scale, segments):
        # max_q >= 2: with max_q == 1 and GQA the op takes its decoding path, which assumes one
        # query per segment and fails on segments without rows (llama3's chunks of one token).
        max_q = max(segments.max_q, 2)
        outs, lses = [], []
        for b in range(q.shape[0]):
            out, lse = _aten._flash_attention_forward(
                _rows(q[b]), _rows(k[b]), _rows(v[b]), segments.cu_q, segments.cu_k,
                max_q, segments.max_k, 0.0, causal, False, scale=scale)[:2]
            outs.append(out.transpose(0, 1))
            # +inf -> -inf in one pass (-inf and nan kept as they are)
            lses.append(torch.nan_to_num(lse, nan=float("nan"), posinf=float("-inf"),
                                         neginf=float("-inf")))
        return _stack(outs), _stack(lses)

    def _varlen_backward(self, dout, q, k, v, out, lse, causal, scale, segments):
        unused_rng = torch.empty(0, device=q.device)
        grads = []
        for b in range(q.shape[0]):
            grads.append(_aten._flash_attention_backward(
                _rows(dout[b]), _rows(q[b]), _rows(k[b]), _rows(v[b]), _rows(out[b]),
                lse[b].contiguous(), segments.cu_q, segments.cu_k, segments.max_q,
                segments.max_k, 0.0, causal, unused_rng, unused_rng, scale=scale))
        return tuple(_stack([g[i].transpose(0, 1) for g in grads]) for i in range(3))


def _strided_like(x, q):
    """``x`` (q's shape) with q's strides: as it is if it has them, else a copy."""
    if x.stride() == q.stride():
        return x
    return torch.empty_strided(q.shape, q.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _rows(x):
    """[H, S, D] -> the varlen ops' [S, H, D] (a view; the head dim made dense if it is not)."""
    return _rows_strided(x).transpose(0, 1)


def _stack(rows):
    """Batch rows -> one tensor (no copy for a single row)."""
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)
