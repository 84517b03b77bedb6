"""Block kernels, on whatever device this runs (CPU here; CUDA backends on a GPU machine).

Each available backend must (1) match its own single-device SDPA kernel on whole inputs, (2) give
the float64 bottom-right causal result where it offers that mask, and (3) have the property the
ring relies on: attention split over two key blocks, merged in fp32, with each block's backward
taking the *merged* out and LSE, gives the whole attention's out and gradients, with error no more
than dtensor_ring/tools/numerics.py's tolerance times the unsplit kernel's.
"""
import pytest
import torch
import torch.nn.functional as F

from dtensor_ring.kernels import BACKENDS
from dtensor_ring.kernels.base import CAUSAL, CAUSAL_BOTTOM_RIGHT, NONE
from dtensor_ring.merge import init_, merge_
from dtensor_ring.schedules.base import backward_operands
from dtensor_ring.tools.numerics import TOLERANCE, rel_rms

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.bfloat16)
FP32_FLOOR = 1e-6  # rel-RMS: ~17 units of fp32 rounding; a wrong mask is 1e5x that


def _usable(name, dtype, head_dim=64):
    return BACKENDS[name].available(DEVICE, dtype, head_dim)


def _params():
    return [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}")
            for name in sorted(BACKENDS) for dtype in DTYPES if _usable(name, dtype)]


def _inputs(sq, sk, q_heads=4, kv_heads=2, head_dim=64, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shapes = [(2, q_heads, sq, head_dim), (2, kv_heads, sk, head_dim),
              (2, kv_heads, sk, head_dim), (2, q_heads, sq, head_dim)]
    return [torch.randn(s, generator=gen, device=DEVICE, dtype=torch.float64) for s in shapes]


def _reference(q, k, v, dout, allowed=None, is_causal=False):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=is_causal,
                                         enable_gqa=True)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _kernel_fwd_bwd(kernel, q, k, v, dout, mask, scale):
    out, lse = kernel.forward(q, k, v, mask, scale)
    return [out, *kernel.backward(dout, q, k, v, out, lse, mask, scale)]


@pytest.mark.parametrize("name,dtype", _params())
@pytest.mark.parametrize("mask", [NONE, CAUSAL])
def test_kernel_is_the_single_device_kernel(name, dtype, mask):
    q, k, v, dout = (x.to(dtype) for x in _inputs(64, 64))
    got = _kernel_fwd_bwd(BACKENDS[name], q, k, v, dout, mask, 64 ** -0.5)
    reference = _reference(*_inputs(64, 64), is_causal=mask == CAUSAL)
    limit = 1e-5 if dtype == torch.float32 else 2e-2
    for x, ref in zip(got, reference):
        assert x.dtype == dtype and rel_rms(x, ref) < limit


def _seq_major(x):
    """``x`` [B, H, S, D] with [B, S, H, D] memory: what a model's attention output and its
    gradient usually are (projections in [B, S, H * D])."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("name,dtype", _params())
def test_backward_does_not_depend_on_the_layout_of_dout_and_out(name, dtype):
    # PyTorch keys its cuDNN backward plan on q, k, v only: after a call with contiguous dout
    # and out, a [B, S, H, D]-memory dout or out used to give gradients off by more than 100%.
    q, k, v, dout = (x.to(dtype) for x in _inputs(128, 128))
    reference = _reference(*_inputs(128, 128), is_causal=True)[1:]
    kernel, scale = BACKENDS[name], 64 ** -0.5
    out, lse = kernel.forward(q, k, v, CAUSAL, scale)
    first = kernel.backward(dout, q, k, v, out, lse, CAUSAL, scale)  # builds and caches plans
    own = [rel_rms(g, ref) for g, ref in zip(first, reference)]
    for layout, (d, o) in {"dout": (_seq_major(dout), out), "out": (dout, _seq_major(out)),
                           "both": (_seq_major(dout), _seq_major(out))}.items():
        grads = kernel.backward(d, q, k, v, o, lse, CAUSAL, scale)
        for i, (g, ref) in enumerate(zip(grads, reference)):
            assert rel_rms(g, ref) <= 1.05 * own[i] + FP32_FLOOR, (
                f"{name}: gradient {i} with [B, S, H, D]-memory {layout}: rel-RMS "
                f"{rel_rms(g, ref):.2e} against {own[i]:.2e} with contiguous ones")


def test_backward_operands_copy_dout_only_when_its_memory_is_neither_layout():
    """A model's dout ([B, S, H, D] memory, like its q) and a contiguous one reach the kernel's
    backward_layout as they are; an expanded one (``out.sum()``'s gradient) is made contiguous."""
    q = _seq_major(torch.randn(1, 2, 8, 4))
    kernel = BACKENDS["math"]  # its backward_layout keeps any layout
    for dout in (_seq_major(torch.randn(1, 2, 8, 4)), torch.randn(1, 2, 8, 4)):
        got, _ = backward_operands(kernel, dout, q, q, None)
        assert got.data_ptr() == dout.data_ptr() and got.stride() == dout.stride()
    expanded = torch.ones(()).expand(1, 2, 8, 4)
    got, _ = backward_operands(kernel, expanded, q, q, None)
    assert got.is_contiguous() and torch.equal(got, expanded)


@pytest.mark.parametrize("name,dtype", _params())
def test_bottom_right_causal_where_offered(name, dtype):
    kernel = BACKENDS[name]
    if CAUSAL_BOTTOM_RIGHT not in kernel.masks:
        pytest.skip(f"{name} does not offer {CAUSAL_BOTTOM_RIGHT}")
    q, k, v, dout = _inputs(32, 96)
    allowed = torch.ones(32, 96, dtype=torch.bool, device=DEVICE).tril(96 - 32)
    reference = _reference(q, k, v, dout, allowed)
    single = _reference(*(x.to(dtype) for x in (q, k, v, dout)), allowed)
    got = _kernel_fwd_bwd(kernel, *(x.to(dtype) for x in (q, k, v, dout)), CAUSAL_BOTTOM_RIGHT,
                          64 ** -0.5)
    # Compared with SDPA's own masked kernel, which rounds differently from every block kernel (no
    # split involved): within 1.5x of its error. In fp32 both errors are a few units of fp32
    # rounding (3e-7 and 5e-7 for the efficient kernel on an H100), where a ratio says nothing:
    # there the bound is at least FP32_FLOOR.
    floor = FP32_FLOOR if dtype == torch.float32 else 0.0
    for x, s, ref in zip(got, single, reference):
        assert rel_rms(x, ref) <= max(1.5 * rel_rms(s, ref), floor)
    # Top-left would be wrong here: the check above must be able to fail.
    top_left = _reference(q, k, v, dout, torch.ones_like(allowed).tril())
    assert rel_rms(top_left[0], reference[0]) > 0.1


@pytest.mark.parametrize("name,dtype", _params())
def test_split_keys_merged_equal_whole_attention(name, dtype):
    kernel, scale = BACKENDS[name], 64 ** -0.5
    # 40 query rows: not a multiple of the efficient kernel's 32-row LSE padding, which its
    # backward must take from the merged LSE.
    q64, k64, v64, dout64 = _inputs(40, 128, seed=1)
    reference = _reference(q64, k64, v64, dout64)
    q, k, v, dout = (x.to(dtype) for x in (q64, k64, v64, dout64))
    single = _kernel_fwd_bwd(kernel, q, k, v, dout, NONE, scale)

    halves = (slice(0, 64), slice(64, 128))
    out = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=DEVICE)
    for i, cols in enumerate(halves):
        (init_ if i == 0 else merge_)(out, lse, *kernel.forward(q, k[:, :, cols], v[:, :, cols],
                                                                NONE, scale))
    out = out.to(dtype)
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=DEVICE) for x in (q, k, v))
    for cols in halves:
        dq_b, dk_b, dv_b = kernel.backward(dout, q, k[:, :, cols], v[:, :, cols], out, lse, NONE,
                                           scale)
        dq += dq_b
        dk[:, :, cols] += dk_b
        dv[:, :, cols] += dv_b
    for name_, x, s, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), single, reference):
        assert rel_rms(x, ref) <= TOLERANCE[dtype] * rel_rms(s, ref), name_
    # A wrong merge (plain average of the halves) lands far outside.
    wrong = sum(kernel.forward(q, k[:, :, c], v[:, :, c], NONE, scale)[0].float() for c in halves)
    assert rel_rms(wrong / 2, reference[0]) > 10 * TOLERANCE[dtype] * rel_rms(single[0],
                                                                              reference[0])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="which kernel auto picks on CUDA")
def test_auto_on_cuda_never_materialises_the_scores_where_a_fused_kernel_fits():
    """fp32 inputs (no cuDNN or flash) and exact mode at head dim 256 (no Triton kernel) get the
    memory-efficient kernel, not ``math`` / ``math_exact``, which hold S_q x S_k fp32 scores."""
    from dtensor_ring.kernels import get_kernel

    assert get_kernel("auto", DEVICE, torch.float32, 128).name == "efficient"
    assert get_kernel("auto", DEVICE, torch.bfloat16, 256, "exact").name == "efficient_exact"
    assert get_kernel("auto", DEVICE, torch.float32, 128, "exact").name == "efficient_exact"


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the efficient kernel runs on CUDA")
def test_efficient_backward_op_is_checked_and_traceable():
    """The efficient kernel's backward is a custom op: opcheck passes, and make_fx over fake
    tensors (what the compile pass does) traces it; the aten op alone failed there, its meta
    function lacking the ``out`` argument."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dtensor_ring.kernels.efficient import _MASK_TYPE, efficient_backward

    kernel, scale = BACKENDS["efficient"], 64 ** -0.5
    q, k, v, dout = (x.float() for x in _inputs(40, 64, kv_heads=4))
    out, lse = kernel.forward(q, k, v, CAUSAL_BOTTOM_RIGHT, scale)
    torch.library.opcheck(efficient_backward,
                          (dout, q, k, v, out, lse, _MASK_TYPE[CAUSAL_BOTTOM_RIGHT], scale))
    traced = make_fx(lambda *t: kernel.backward(*t, CAUSAL_BOTTOM_RIGHT, scale),
                     tracing_mode="fake")(dout, q, k, v, out, lse)
    assert "dtensor_ring.efficient_attention_backward" in traced.code


@pytest.mark.skipif(DEVICE.type != "cuda", reason="flash's windowed op runs on CUDA")
@pytest.mark.parametrize("name", ["cudnn", "flash"])
def test_windowed_backward_on_row_slices_of_either_memory(name):
    """A band block's backward (PyTorch's flash op with window sizes, for cuDNN's edge blocks
    too) on row slices of [B, H, S, D] memory, of a model's [B, S, H, D] memory (handed to the op
    without a copy) and on contiguous copies: each within TOLERANCE of the copies' error against
    float64; a band one column wider is far off."""
    from dtensor_ring.layouts.windows import Band

    kernel, scale, band = BACKENDS[name], 64 ** -0.5, Band(-40, 0)
    if not _usable(name, torch.bfloat16) or not kernel.windows:
        pytest.skip(f"{name} or its windows unavailable")
    rows, keys = slice(32, 160), slice(16, 144)  # 128 x 128: row i sees keys i - 40 .. i
    full = [x[:1] for x in _inputs(160, 160)]
    i, j = torch.arange(128, device=DEVICE)[:, None], torch.arange(128, device=DEVICE)[None, :]
    reference = _reference(full[0][:, :, rows], full[1][:, :, keys], full[2][:, :, keys],
                           full[3][:, :, rows], allowed=(j - i >= -40) & (j <= i))

    def errors(memory, window, copies=False):
        q, k, v, dout = (memory(x.to(torch.bfloat16)) for x in full)
        q, k, v, dout = q[:, :, rows], k[:, :, keys], v[:, :, keys], dout[:, :, rows]
        if copies:
            q, k, v, dout = (x.contiguous() for x in (q, k, v, dout))
        out, lse = kernel.forward(q, k, v, NONE, scale, None, window)
        grads = kernel.backward(dout, q, k, v, out, lse, NONE, scale, None, window)
        return [rel_rms(x, ref) for x, ref in zip([out, *grads], reference)]

    copies = errors(lambda x: x, band, copies=True)
    for memory in (lambda x: x, _seq_major):
        for got, own in zip(errors(memory, band), copies):
            assert got <= TOLERANCE[torch.bfloat16] * own, (got, own)
    assert max(errors(_seq_major, Band(-41, 0))) > 10 * TOLERANCE[torch.bfloat16] * max(copies)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA kernels' bands run on CUDA")
@pytest.mark.parametrize("name", ["cudnn", "flash"])
def test_the_causal_mask_read_backwards_runs_as_causal_on_reversed_rows(name):
    """The band a causal window leaves in the previous chunk's keys (square, row i sees columns i
    and after: ``kernels/windows.reversed_causal``) runs as the kernel's causal mask on reversed
    rows: fwd and bwd on row slices within TOLERANCE of flash's windowed kernel's own error
    against float64; against the band one column wider it is far off."""
    from dtensor_ring.kernels import windows
    from dtensor_ring.layouts.windows import Band

    kernel, scale, band = BACKENDS[name], 64 ** -0.5, Band(0, None)
    if not _usable(name, torch.bfloat16) or not kernel.windows:
        pytest.skip(f"{name} or its windows unavailable")
    assert windows.reversed_causal(band, 128, 128) and not windows.reversed_causal(band, 96, 128)
    rows, keys = slice(32, 160), slice(16, 144)
    q, k, v, dout = (x.to(torch.bfloat16)[:, :, part] for x, part in
                     zip(_inputs(160, 160), (rows, keys, keys, rows)))
    i, j = torch.arange(128, device=DEVICE)[:, None], torch.arange(128, device=DEVICE)[None, :]

    def reference(lo):
        return _reference(*(x.double() for x in (q, k, v, dout)), allowed=j - i >= lo)

    out, lse = kernel.forward(q, k, v, NONE, scale, None, band)
    got = [out, *kernel.backward(dout, q, k, v, out, lse, NONE, scale, None, band)]
    out, lse = windows.flash_forward(q, k, v, band, scale)
    flash = [out, *windows.flash_backward(dout, q, k, v, out, lse, band, scale)]
    for x, by_flash, ref in zip(got, flash, reference(0)):
        assert rel_rms(x, ref) <= TOLERANCE[torch.bfloat16] * rel_rms(by_flash, ref)
    wider = [rel_rms(x, ref) for x, ref in zip(got, reference(-1))]
    assert max(wider) > 10 * TOLERANCE[torch.bfloat16] * max(
        rel_rms(x, ref) for x, ref in zip(flash, reference(0)))


# Packed documents: segments of unequal lengths, and empty ones (rows that see no key, keys no
# row sees), as the layouts make them. q rows 0..47, k rows 0..39.
SEGMENTS_Q = [0, 10, 10, 30, 40, 48]
SEGMENTS_K = [0, 6, 14, 14, 30, 40]


def _document_mask(mask):
    """The segments' [Sq, Sk] visibility, written out pair by pair (independent of the
    package's own ``kernels/segments.py``)."""
    seen = torch.zeros(SEGMENTS_Q[-1], SEGMENTS_K[-1], dtype=torch.bool)
    for s in range(len(SEGMENTS_Q) - 1):
        q0, q1, k0, k1 = SEGMENTS_Q[s], SEGMENTS_Q[s + 1], SEGMENTS_K[s], SEGMENTS_K[s + 1]
        for i in range(q0, q1):
            for j in range(k0, k1):
                bottom_right = (j - k0) <= (i - q0) + (k1 - k0) - (q1 - q0)
                seen[i, j] = mask == NONE or bottom_right
    return seen.to(DEVICE)


def _masked_reference(q, k, v, dout, seen):
    """Attention under ``seen`` with rows that see no key giving 0 (SDPA gives NaN there), and
    its gradients, in q's dtype (products in fp32 for 16-bit, as the kernels do)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kk, vv = (x.to(compute).repeat_interleave(groups, 1) for x in (k, v))
    sees = seen.any(1, keepdim=True)
    scores = q.to(compute) @ kk.transpose(-1, -2) * 64 ** -0.5
    scores = scores.masked_fill(~seen, float("-inf")).masked_fill(~sees, 0.0)
    out = ((scores.softmax(-1) * sees) @ vv).to(q.dtype)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _document_params():
    from dtensor_ring.kernels import EXACT_BACKENDS  # noqa: PLC0415

    kernels = {**BACKENDS, **EXACT_BACKENDS}
    return [pytest.param(kernels[name], dtype, id=f"{name}-{str(dtype)[6:]}")
            for name in sorted(kernels) for dtype in DTYPES
            if kernels[name].documents and kernels[name].available(DEVICE, dtype, 64)]


@pytest.mark.parametrize("kernel,dtype", _document_params())
@pytest.mark.parametrize("mask", [NONE, CAUSAL_BOTTOM_RIGHT])
def test_documents_attend_within_their_segments(kernel, dtype, mask):
    """Each kernel with a document form against float64 attention under the segments' mask:
    within 1.5x of SDPA's own masked error (fp32: at least FP32_FLOOR), rows with no key out 0
    and LSE -inf, their dq 0, and keys no row sees dk = dv = 0."""
    from dtensor_ring.layouts import Segments  # noqa: PLC0415

    segments = Segments(torch.tensor(SEGMENTS_Q, dtype=torch.int32, device=DEVICE),
                        torch.tensor(SEGMENTS_K, dtype=torch.int32, device=DEVICE), 20, 16)
    seen = _document_mask(mask)
    q, k, v, dout = _inputs(48, 40)
    sees = seen.any(1)
    reference = _masked_reference(q, k, v, dout, seen)
    single = _masked_reference(*(x.to(dtype) for x in (q, k, v, dout)), seen)
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))
    out, lse = kernel.forward(q, k, v, mask, 64 ** -0.5, segments)
    grads = kernel.backward(dout, q, k, v, out, lse.masked_fill(~sees, 0.0), mask, 64 ** -0.5,
                            segments)
    floor = FP32_FLOOR if dtype == torch.float32 else 0.0
    for name, x, s, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), single, reference):
        bound = max(1.5 * rel_rms(s, ref), floor)
        assert rel_rms(x, ref) <= bound, (name, rel_rms(x, ref), bound)
    assert bool((lse[:, :, ~sees] == float("-inf")).all()) and not bool(out[:, :, ~sees].any())
    assert bool(torch.isfinite(lse[:, :, sees]).all())
    assert not bool(grads[0][:, :, ~sees].any())
    unseen_keys = ~seen.any(0)
    assert bool(unseen_keys.any()) and not bool(grads[1][:, :, unseen_keys].any())
    assert not bool(grads[2][:, :, unseen_keys].any())
