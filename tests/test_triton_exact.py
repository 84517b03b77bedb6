"""The Triton exact kernels against float64: on a GPU compiled, on CPU under TRITON_INTERPRET=1
(set by conftest.py; skipped where triton is not installed).

Tolerance: each of out, dq, dk, dv within LIMIT = 1.0 x the rel-RMS of the single-device SDPA
kernel in the same dtype on the same inputs. The Triton kernel rounds P and dS to fp16 for its
products (cuDNN and flash round them to the input dtype) and returns fp32, so it must not be worse;
on CPU, bf16 inputs, it measured 0.05-0.10x PyTorch's CPU kernel (whose bf16 results are rounded)
and fp16 inputs 0.43-0.71x. A 1% error, or a top-left instead of bottom-right mask, fails. Split
keys merged in fp32 must give the whole attention within 1.02x of the unsplit exact kernel's
error, and the schedules at W = 2 within 1.02x of W = 1.
"""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import dtensor_ring as dr  # noqa: E402
from dtensor_ring.kernels import EXACT_BACKENDS  # noqa: E402
from dtensor_ring.kernels import triton_exact  # noqa: E402
from dtensor_ring.kernels.base import CAUSAL, CAUSAL_BOTTOM_RIGHT, NONE, Into  # noqa: E402
from dtensor_ring.kernels.triton_exact import Tiles  # noqa: E402
from dtensor_ring.layouts import Segments  # noqa: E402
from dtensor_ring.layouts.windows import Band, Positions  # noqa: E402
from dtensor_ring.merge import init_, merge_  # noqa: E402
from dtensor_ring.tools.numerics import rel_rms  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL = EXACT_BACKENDS["triton_exact"]
HEAD_DIMS = (64, 80, 128) if DEVICE.type == "cuda" else (16, 80)
SIZE = 256 if DEVICE.type == "cuda" else 1  # lengths multiply by this on a GPU
LIMIT = 1.0


def _inputs(sq, sk, head_dim, dtype, q_heads=4, kv_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1, q_heads, sq, head_dim), (1, kv_heads, sk, head_dim), (1, kv_heads, sk, head_dim),
              (1, q_heads, sq, head_dim)]
    return [torch.randn(s, generator=gen).to(dtype).to(DEVICE) for s in shapes]


def _allowed(mask, sq, sk):
    if mask == NONE:
        return None
    diagonal = 0 if mask == CAUSAL else sk - sq
    return torch.ones(sq, sk, dtype=torch.bool, device=DEVICE).tril(diagonal)


def _sdpa(q, k, v, dout, allowed):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _triton(q, k, v, dout, mask, scale, tiles=None):
    out, lse = KERNEL.forward(q, k, v, mask, scale, tiles=tiles)
    return [out, *KERNEL.backward(dout, q, k, v, out, lse, mask, scale, tiles=tiles)]


def _check_against_float64(sq, sk, head_dim, dtype, mask, tiles=None, seed=0):
    """The kernel's out, dq, dk, dv (fp32) each within LIMIT x the single-device kernel's rel-RMS
    against float64, and a 1% error outside it; returns (inputs, allowed, got, reference)."""
    q, k, v, dout = _inputs(sq, sk, head_dim, dtype, seed=seed)
    allowed = _allowed(mask, sq, sk)
    reference = _sdpa(*(x.double() for x in (q, k, v, dout)), allowed)
    single = _sdpa(q, k, v, dout, allowed)
    got = _triton(q, k, v, dout, mask, head_dim ** -0.5, tiles)
    for name, x, s, ref in zip("out dq dk dv".split(), got, single, reference):
        assert x.dtype == torch.float32, name
        assert rel_rms(x, ref) <= LIMIT * rel_rms(s, ref), (name, rel_rms(x, ref), rel_rms(s, ref))
        assert rel_rms(x * 1.01, ref) > LIMIT * rel_rms(s, ref), name
    return (q, k, v, dout), allowed, got, reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("mask,sq,sk", [(NONE, 20, 37), (CAUSAL, 33, 33),
                                        (CAUSAL_BOTTOM_RIGHT, 19, 40)])
def test_triton_exact_kernel_against_float64(dtype, head_dim, mask, sq, sk):
    if DEVICE.type == "cpu" and (dtype == torch.float16) != (head_dim == 80):
        pytest.skip("interpreter: one dtype per head dim keeps the CPU run short")
    inputs, allowed, got, reference = _check_against_float64(sq * SIZE, sk * SIZE, head_dim,
                                                             dtype, mask)
    if mask == CAUSAL_BOTTOM_RIGHT:
        top_left = _sdpa(*inputs, torch.ones_like(allowed).tril())
        assert rel_rms(top_left[0], reference[0]) > 100 * rel_rms(got[0], reference[0])


@pytest.mark.parametrize("mask,sq,sk", [(NONE, 40, 75), (CAUSAL, 70, 70),
                                        (CAUSAL_BOTTOM_RIGHT, 45, 99)])
def test_triton_exact_kernel_with_unequal_tiles(mask, sq, sk):
    """q tiles twice (forward, dq) or half (dK/dV) the k tiles, as the GPU's tuned tiles are:
    the masked band, the unmasked tiles and the ragged ends fall at other rows than with square
    tiles."""
    head_dim = 64 if DEVICE.type == "cuda" else 16
    base = 64 if DEVICE.type == "cuda" else 16
    tiles = dict(forward=Tiles(2 * base, base), dkdv=Tiles(base, 2 * base),
                 dq=Tiles(2 * base, base))
    scale_up = max(1, SIZE // 4)
    _check_against_float64(sq * scale_up, sk * scale_up, head_dim, torch.bfloat16, mask, tiles,
                           seed=3)


def test_fp16_scales_follow_each_head_exactly():
    """The fp16 copies' scales are powers of two per (batch, head), undone exactly. Scaling one GQA
    group's inputs (q by 2^a, k by 2^-a, v by 2^c, dO by 2^d; exponents up to 40, far outside
    fp16's range) scales its results by exactly 2^c (out), 2^(c+d-a) (dq), 2^(c+d+a) (dk),
    2^d (dv) and leaves the LSE as it was, bit for bit; one binade off anywhere fails."""
    head_dim, sq, sk, scale = 16, 19 * SIZE, 40 * SIZE, 0.3
    q, k, v, dout = (torch.cat([x, x.flip(2)]) for x in _inputs(sq, sk, head_dim, torch.bfloat16))
    # [batch, kv head] exponents: every group of 2 q heads scaled as its kv head
    a, c, d = (torch.tensor(e, device=DEVICE) for e in ([[30, -25], [-20, 12]],
                                                        [[-30, 20], [33, -7]],
                                                        [[-25, 18], [26, -40]]))

    def pow2(e, heads):  # [B, Hkv] exponents -> [B, heads, 1, 1] factors
        return torch.ldexp(torch.ones(e.shape), e.cpu()).repeat_interleave(heads // 2, 1)[
            ..., None, None].to(DEVICE)

    def run(q, k, v, dout):
        out, lse = KERNEL.forward(q, k, v, CAUSAL_BOTTOM_RIGHT, scale)
        return [out, lse, *KERNEL.backward(dout, q, k, v, out, lse, CAUSAL_BOTTOM_RIGHT, scale)]

    base = run(q, k, v, dout)
    scaled = run(*((x * pow2(e, x.shape[1])).bfloat16() for x, e in ((q, a), (k, -a), (v, c),
                                                                     (dout, d))))
    wants = [pow2(c, 4), 1.0, pow2(c + d - a, 4), pow2(c + d + a, 2), pow2(d, 2)]
    for name, got, x, want in zip("out lse dq dk dv".split(), scaled, base, wants):
        assert torch.equal(got, x * want), name
        assert not torch.equal(got, x * want * 2), name


def test_fp16_copies_scale_each_head_exactly():
    """One launch copies tensors of other head counts, lengths and strides: every (batch, head) of
    each copy is exactly x * 2^e, e putting that head's amax in [2^14, 2^15), and the amax it
    returns is the head's; heads 2^60 apart in magnitude each keep their own scale."""
    gen = torch.Generator().manual_seed(7)
    scales = torch.ldexp(torch.ones(2, 4, 1, 1), torch.tensor([[-30, 0, 7, 30], [12, -3, 20, -18]],
                                                              dtype=torch.int32)[..., None, None])
    q = (torch.randn(2, 4, 40, 16, generator=gen) * scales).bfloat16().to(DEVICE)
    k = (torch.randn(2, 2, 70, 16, generator=gen) * scales[:, 1:3]).bfloat16().to(DEVICE)
    k = k[:, :, 5:60]  # a strided view
    with triton_exact._launching():
        copies = triton_exact._fp16_copies(q, k)
    for x, (copy, amax) in zip((q, k), copies):
        assert copy.dtype == torch.float16 and copy.shape == x.shape
        assert torch.equal(amax, x.float().abs().amax(dim=(2, 3)))
        exponent = 15 - torch.frexp(amax).exponent  # amax < 2^E: amax * 2^(15 - E) < 2^15
        assert torch.equal(copy.float(), x.float() * torch.ldexp(torch.ones_like(amax), exponent)[
            ..., None, None])
        head_max = copy.float().abs().amax(dim=(2, 3))
        assert ((head_max >= 2 ** 14) & (head_max < 2 ** 15)).all()


def test_tiles_override_errors():
    q, k, v, _ = _inputs(16, 16, 16, torch.bfloat16)
    with pytest.raises(ValueError, match=r"tiles has the key 'fwd'; valid keys: \['forward', "
                                         r"'dkdv', 'dq'\]"):
        KERNEL.forward(q, k, v, NONE, 0.25, tiles={"fwd": Tiles(16, 16)})
    with pytest.raises(TypeError, match=r"tiles\['dq'\] must be a Tiles; got tuple"):
        KERNEL.forward(q, k, v, NONE, 0.25, tiles={"dq": (16, 16)})


@pytest.mark.parametrize("name", ["triton_exact", "math_exact"])
@pytest.mark.parametrize("fresh", [True, False])
def test_forward_into_writes_or_merges_into_accumulator_views(name, fresh):
    """``forward_into`` writes ``forward``'s fp32 out and LSE into row views of a larger running
    (out, lse) when ``fresh``, else merges them into what the rows hold: equal, within fp32
    rounding, to the float64 softmax-weighted merge; no row outside the view touched."""
    kernel = EXACT_BACKENDS[name]
    sq, sk, head_dim, scale = 19 * SIZE, 40 * SIZE, 64 if DEVICE.type == "cuda" else 16, 0.3
    q, k, v, _ = _inputs(sq, sk, head_dim, torch.bfloat16, seed=4)
    block_out, block_lse = kernel.forward(q, k, v, CAUSAL_BOTTOM_RIGHT, scale)
    gen = torch.Generator().manual_seed(6)
    out = torch.randn(1, q.shape[1], sq + 9, head_dim, generator=gen).to(DEVICE)
    lse = (torch.randn(1, q.shape[1], sq + 9, generator=gen) + block_lse.mean().item()).to(DEVICE)
    old_out, old_lse, rows = out.clone(), lse.clone(), slice(4, 4 + sq)
    kernel.forward_into(out[:, :, rows], lse[:, :, rows], fresh, q, k, v, CAUSAL_BOTTOM_RIGHT,
                        scale)
    if fresh:
        assert torch.equal(out[:, :, rows], block_out) and torch.equal(lse[:, :, rows], block_lse)
    else:
        a, b = old_lse[:, :, rows].double(), block_lse.double()
        want_lse = torch.logaddexp(a, b)
        want = ((a - want_lse).exp()[..., None] * old_out[:, :, rows].double()
                + (b - want_lse).exp()[..., None] * block_out.double())
        assert (out[:, :, rows].double() - want).abs().max() <= 1e-5 * want.abs().max()
        assert (lse[:, :, rows].double() - want_lse).abs().max() <= 1e-5 * want_lse.abs().max()
        assert (block_out.double() - want).abs().max() > 1e-2  # a write instead of a merge fails
    for new, old in ((out, old_out), (lse, old_lse)):
        assert torch.equal(new[:, :, :rows.start], old[:, :, :rows.start])
        assert torch.equal(new[:, :, rows.stop:], old[:, :, rows.stop:])


@pytest.mark.parametrize("name", ["triton_exact", "math_exact"])
@pytest.mark.parametrize("add_q,add_kv", [(False, False), (True, True), (True, False)])
def test_backward_into_writes_or_adds_into_accumulator_views(name, add_q, add_kv):
    """``backward_into`` puts exactly ``backward``'s fp32 gradients into row views of larger
    accumulators (the Triton kernels in their own stores, math_exact by the default accumulate
    pass): overwritten, or added to what the rows held, and no row outside the view touched."""
    kernel = EXACT_BACKENDS[name]
    sq, sk, head_dim, scale = 19 * SIZE, 40 * SIZE, 64 if DEVICE.type == "cuda" else 16, 0.3
    q, k, v, dout = _inputs(sq, sk, head_dim, torch.bfloat16, seed=2)
    out, lse = kernel.forward(q, k, v, CAUSAL_BOTTOM_RIGHT, scale)
    expected = kernel.backward(dout, q, k, v, out, lse, CAUSAL_BOTTOM_RIGHT, scale)
    gen = torch.Generator().manual_seed(5)
    accs = [torch.randn(x.shape[0], x.shape[1], x.shape[2] + 9, x.shape[3], generator=gen)
            .to(DEVICE) for x in (q, k, v)]
    before = [acc.clone() for acc in accs]
    rows = [slice(4, 4 + x.shape[2]) for x in (q, k, v)]
    into = [Into(acc[:, :, r], add) for acc, r, add in zip(accs, rows, (add_q, add_kv, add_kv))]
    assert kernel.backward_into(into, dout, q, k, v, out, lse, CAUSAL_BOTTOM_RIGHT, scale) == (
        None, None, None)
    for name_, acc, old, r, grad, target in zip("dq dk dv".split(), accs, before, rows, expected,
                                                into):
        if target.add:  # compiled, the kernel fuses dq's and dk's scale into the add (an FMA):
            # within one rounding of the product and one of the sum
            want = old[:, :, r] + grad
            slack = 2.0 ** -23 * (grad.abs() + want.abs())
            assert ((acc[:, :, r] - want).abs() <= slack).all(), name_
        else:
            assert torch.equal(acc[:, :, r], grad), name_
        assert torch.equal(acc[:, :, :r.start], old[:, :, :r.start]), name_
        assert torch.equal(acc[:, :, r.stop:], old[:, :, r.stop:]), name_
    # Only dq into an accumulator: dk and dv come back as backward's.
    dq_acc = torch.zeros_like(expected[0])
    got = kernel.backward_into((Into(dq_acc, False), None, None), dout, q, k, v, out, lse,
                               CAUSAL_BOTTOM_RIGHT, scale)
    assert got[0] is None and torch.equal(dq_acc, expected[0])
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])


def test_backward_into_needs_dk_and_dv_together():
    q, k, v, dout = _inputs(16, 16, 16, torch.bfloat16)
    out, lse = KERNEL.forward(q, k, v, NONE, 0.25)
    dk = torch.zeros(k.shape, device=DEVICE)
    with pytest.raises(ValueError, match=r"into: dk and dv go into accumulators together, with "
                                         r"the same add; got dk Into\(add=False\), dv None"):
        KERNEL.backward_into((None, Into(dk, False), None), dout, q, k, v, out, lse, NONE, 0.25)


def test_split_keys_merged_equal_whole_attention():
    """A strided view of K/V (no copy) in two halves, merged in fp32, each half's backward taking
    the fp32 merged out: the whole attention within 1.02x of the unsplit exact kernel's error."""
    sq, sk, head_dim, scale = 32 * SIZE, 64 * SIZE, 64 if DEVICE.type == "cuda" else 16, 0.3
    q, k, v, dout = _inputs(sq, sk, head_dim, torch.bfloat16, seed=1)
    reference = _sdpa_scaled(q, k, v, dout, scale)
    whole = _triton(q, k, v, dout, NONE, scale)
    halves = (slice(0, sk // 2), slice(sk // 2, sk))
    out = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=DEVICE)
    for i, cols in enumerate(halves):
        (init_ if i == 0 else merge_)(out, lse, *KERNEL.forward(q, k[:, :, cols], v[:, :, cols],
                                                                NONE, scale))
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=DEVICE) for x in (q, k, v))
    for cols in halves:
        dq_b, dk_b, dv_b = KERNEL.backward(dout, q, k[:, :, cols], v[:, :, cols], out, lse, NONE,
                                           scale)
        dq += dq_b
        dk[:, :, cols] += dk_b
        dv[:, :, cols] += dv_b
    for name, x, w, ref in zip("out dq dk dv".split(), (out, dq, dk, dv), whole, reference):
        assert rel_rms(x, ref) <= 1.02 * rel_rms(w, ref), name
    wrong = (KERNEL.forward(q, k[:, :, halves[0]], v[:, :, halves[0]], NONE, scale)[0] + out) / 2
    assert rel_rms(wrong, reference[0]) > 10 * rel_rms(whole[0], reference[0])


def _sdpa_scaled(q, k, v, dout, scale):
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("schedule", ["zigzag", "stripe"])
def test_simulated_ring_with_the_triton_kernel(schedule):
    """zigzag (half blocks) and stripe (shifted, strided views) at W = 2 through the schedules:
    within 1.02x of the same kernel at W = 1."""
    world, head_dim = 2, 64 if DEVICE.type == "cuda" else 16
    q, k, v, dout = _inputs(32 * SIZE, 32 * SIZE, head_dim, torch.bfloat16, q_heads=2,
                            kv_heads=1, seed=2)
    reference = _sdpa(*(x.double() for x in (q, k, v, dout)), _allowed(CAUSAL, q.shape[2],
                                                                        q.shape[2]))

    def run(w):
        return _sdpa_like(lambda a, b, c: dr.simulate_ring(
            a, b, c, world_size=w, schedule=schedule, is_causal=True, precision="exact",
            backend="triton_exact"), q, k, v, dout)

    single, split = run(1), run(world)
    for name, x, s, ref in zip("out dq dk dv".split(), split, single, reference):
        assert x.dtype == torch.bfloat16
        assert rel_rms(x, ref) <= 1.02 * rel_rms(s, ref), name


def _sdpa_like(fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _band_allowed(band, sq, sk):
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if band.lo is not None:
        allowed &= j - i >= band.lo
    if band.hi is not None:
        allowed &= j - i <= band.hi
    return allowed.to(DEVICE)


@pytest.mark.parametrize("sq,sk,band", [
    (40, 40, Band(-5, 0)), (33, 50, Band(0, None)), (37, 37, Band(-20, 3))], ids=str)
def test_triton_exact_kernel_takes_a_band(sq, sk, band):
    """A sliding window's edge block (``layouts/windows.py``: trimmed, lo <= 0 <= hi), tiles
    masked at both of the band's edges and whole in between: within LIMIT of the single-device
    kernel with the band as a mask; the band one key wider on its left fails."""
    q, k, v, dout = _inputs(sq * SIZE, sk * SIZE, 16 if DEVICE.type == "cpu" else 64,
                            torch.bfloat16, seed=3)
    band = Band(None if band.lo is None else band.lo * SIZE,
                None if band.hi is None else band.hi * SIZE)
    allowed = _band_allowed(band, q.shape[2], k.shape[2])
    reference = _sdpa(*(x.double() for x in (q, k, v, dout)), allowed)
    single = _sdpa(q, k, v, dout, allowed)
    scale = q.shape[3] ** -0.5
    out, lse = KERNEL.forward(q, k, v, NONE, scale, window=band)
    got = [out, *KERNEL.backward(dout, q, k, v, out, lse, NONE, scale, window=band)]
    for name, x, s, ref in zip("out dq dk dv".split(), got, single, reference):
        assert rel_rms(x, ref) <= LIMIT * rel_rms(s, ref), (name, rel_rms(x, ref),
                                                            rel_rms(s, ref))
    if band.lo is not None:
        wider = Band(band.lo - 1, band.hi)
        out, lse = KERNEL.forward(q, k, v, NONE, scale, window=wider)
        assert rel_rms(out, reference[0]) > 10 * rel_rms(single[0], reference[0])


def test_triton_exact_kernel_takes_a_window_as_positions_with_documents():
    """Packed documents of 20 and 28 tokens, causal, a window of 5 keys given by positions."""
    q, k, v, dout = _inputs(48, 48, 16 if DEVICE.type == "cpu" else 64, torch.bfloat16,
                            q_heads=2, kv_heads=2, seed=4)
    cu = torch.tensor([0, 20, 48], dtype=torch.int32, device=DEVICE)
    positions = torch.arange(48, device=DEVICE)
    document = torch.searchsorted(cu.long(), positions, right=True)
    i, j = positions[:, None], positions[None, :]
    allowed = (document[:, None] == document[None, :]) & (j <= i) & (j >= i - 5)
    reference = _sdpa(*(x.double() for x in (q, k, v, dout)), allowed)
    single = _sdpa(q, k, v, dout, allowed)
    segments, scale = Segments(cu, cu, 28, 28), q.shape[3] ** -0.5
    window = Positions(positions, positions, 5, -1)
    out, lse = KERNEL.forward(q, k, v, CAUSAL, scale, segments, window)
    got = [out, *KERNEL.backward(dout, q, k, v, out, lse, CAUSAL, scale, segments, window)]
    for name, x, s, ref in zip("out dq dk dv".split(), got, single, reference):
        assert rel_rms(x, ref) <= LIMIT * rel_rms(s, ref), (name, rel_rms(x, ref),
                                                            rel_rms(s, ref))


def test_simulated_ring_with_a_window_on_the_triton_kernel():
    """zigzag, a window shorter than a rank's share at W = 4 (edge blocks, skipped steps, two
    neighbours): within 1.02x of the same kernel and window at W = 1."""
    schedule = "zigzag"
    head_dim = 64 if DEVICE.type == "cuda" else 16
    q, k, v, dout = _inputs(64 * SIZE, 64 * SIZE, head_dim, torch.bfloat16, q_heads=2,
                            kv_heads=1, seed=5)
    window = (5 * SIZE, 0)
    allowed = _band_allowed(Band(-window[0], 0), q.shape[2], q.shape[2])
    reference = _sdpa(*(x.double() for x in (q, k, v, dout)), allowed)

    def run(w):
        return _sdpa_like(lambda a, b, c: dr.simulate_ring(
            a, b, c, world_size=w, schedule=schedule, is_causal=True, precision="exact",
            backend="triton_exact", window=window), q, k, v, dout)

    single, split = run(1), run(4)
    for name, x, s, ref in zip("out dq dk dv".split(), split, single, reference):
        assert rel_rms(x, ref) <= 1.02 * rel_rms(s, ref), name
