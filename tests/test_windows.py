"""Sliding windows in one process: the convention (against transformers' own masks), the blocks a
window leaves (against brute force), the kernels' window masks, and every schedule through
``simulate_ring`` against float64 attention with the same window.

Reference: float64 SDPA with the window as a dense boolean mask built from global positions (with
documents: per document). Tolerances as everywhere (``tools/numerics.TOLERANCE``: the single-device
kernel's own error, here SDPA with the same mask), except at W = 64, where the fp32 path's error
grows with W as without a window (``test_simulate.test_runs_at_64_simulated_ranks``: bound 2x).
A window one token too wide must fail them.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

import dtensor_ring as dr
from dtensor_ring.kernels import BACKENDS, EXACT_BACKENDS, get_kernel
from dtensor_ring.kernels.base import CAUSAL, MASKS, NONE
from dtensor_ring.kernels.cpu_flash import CpuFlash
from dtensor_ring.kernels.windows import flash_window
from dtensor_ring.layouts import LAYOUTS, Segments
from dtensor_ring.layouts.placement import placement_of
from dtensor_ring.layouts.windows import (Band, Positions, Window, as_band, band_block,
                                          check_window, effective_window, split_rows)
from dtensor_ring.tools.numerics import (attention_and_grads, check_ratios, make_inputs, ratios,
                                         rel_rms)
from dtensor_ring.schedules.windowed import dense_plan, exchange_rows


def window_mask(positions_q, positions_k, window, is_causal, cu_seqlens=None):
    """[Sq, Sk] booleans from global positions: the definition the tests hold the code to (on
    the positions' device)."""
    q, k = positions_q[:, None], positions_k[None, :]
    seen = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=q.device)
    left, right = window
    if left >= 0:
        seen &= k >= q - left
    if is_causal:
        seen &= k <= q
    elif right >= 0:
        seen &= k <= q + right
    if cu_seqlens is not None:
        cu = torch.as_tensor(cu_seqlens, device=q.device)
        seen &= (torch.searchsorted(cu, q, right=True) == torch.searchsorted(cu, k, right=True))
    return seen


def windowed_sdpa(is_causal, window, cu_seqlens=None):
    """The single-device kernel with the window as a mask (SDPA), whole sequences (on q's
    device)."""
    def fn(q, k, v):
        positions = torch.arange(q.shape[2], device=q.device)
        mask = window_mask(positions, positions, window, is_causal, cu_seqlens)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return fn


# ---------------------------------------------------------------------------------------------
# The convention


@pytest.mark.parametrize("sliding_window", [1, 3, 16])
def test_hugging_face_sliding_window_is_left_w_minus_1(sliding_window):
    """transformers' sliding-window causal masks (``masking_utils``: the ones its SDPA and eager
    attention apply) are window=(w - 1, 0) with is_causal=True, and not (w, 0)."""
    masking = pytest.importorskip("transformers.masking_utils")
    seq = 24
    shape = dict(batch_size=1, q_length=seq, kv_length=seq,
                 mask_function=masking.sliding_window_causal_mask_function(sliding_window))
    sdpa = masking.sdpa_mask(**shape, allow_is_causal_skip=False)[0, 0]
    eager = masking.eager_mask(**shape)[0, 0] == 0  # additive: 0 where seen
    positions = torch.arange(seq)
    ours = window_mask(positions, positions, (sliding_window - 1, 0), True)
    assert torch.equal(sdpa, ours) and torch.equal(eager, ours)
    assert not torch.equal(sdpa, window_mask(positions, positions, (sliding_window, 0), True))


def test_window_arguments_are_checked_and_normalised():
    assert check_window(None) is None and check_window([3, -1]) == Window(3, -1)
    for bad in [(3,), (3, -2), (1.5, 0), "3,0", (True, 0), 3]:
        with pytest.raises(ValueError, match=r"window=.* must be None or \(left, right\)"):
            check_window(bad)
    assert effective_window(Window(5, 7), True, 64) == Window(5, -1)  # causal: no right side
    assert effective_window(Window(63, -1), True, 64) is None  # covers the span: no window
    assert effective_window(Window(62, -1), True, 64) == Window(62, -1)
    assert effective_window(Window(-1, 70), False, 64) is None


# ---------------------------------------------------------------------------------------------
# Blocks


def _band_mask(block, rows, cols):
    seen = torch.zeros(rows, cols, dtype=torch.bool)
    lo, hi = as_band(block)
    i = torch.arange(block.q.start, block.q.stop)[:, None] - block.q.start
    j = torch.arange(block.k.start, block.k.stop)[None, :] - block.k.start
    part = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if lo is not None:
        part &= j - i >= lo
    if hi is not None:
        part &= j - i <= hi
    seen[block.q, block.k] = part
    return seen


WINDOWS = [(0, 0), (1, -1), (3, 0), (5, 2), (-1, 3), (9, -1), (20, 1), (2, 2)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_band_blocks_cover_exactly_the_window(layout):
    """For every pair of ranks, the blocks ``band_block`` leaves are disjoint, their union is the
    window's visible set between the two ranks' tokens, every row of a block sees a key of it,
    flash's window sizes of an edge block are >= 0, and splitting a block by rows keeps its set."""
    lay, local = LAYOUTS[layout], 8
    for world, is_causal, window in itertools.product((1, 2, 3, 4), (True, False), WINDOWS):
        window = Window(*window)
        for rank, src in itertools.product(range(world), repeat=2):
            want = window_mask(lay.positions(local, rank, world), lay.positions(local, src, world),
                               window, is_causal)
            for masks in (MASKS, (NONE, CAUSAL)):
                got = torch.zeros(local, local, dtype=torch.bool)
                for q_run, k_run in itertools.product(lay.runs(local, rank, world),
                                                      lay.runs(local, src, world)):
                    block = band_block(q_run, k_run, window, is_causal, masks)
                    if block is None:
                        continue
                    assert block.mask in masks
                    seen = _band_mask(block, local, local)
                    assert seen[block.q, block.k].any(1).all(), block
                    assert not (got & seen).any(), block
                    got |= seen
                    if isinstance(block.window, Band):
                        flash_window(block.window, block.q.stop - block.q.start,
                                     block.k.stop - block.k.start)  # asserts >= 0
                    for at in range(1, block.q.stop - block.q.start):
                        parts = split_rows(block, at, masks)
                        assert torch.equal(sum(_band_mask(p, local, local).int()
                                               for p in parts) > 0, seen)
                where = f"{layout} W={world} causal={is_causal} {window} rank {rank} src {src}"
                assert torch.equal(got, want), where


def test_contiguous_exchange_is_a_bounded_ring():
    """Contiguous, causal: a window of w keys before each query reaches ceil(w / S_local) ranks
    back, so the plan has that many offsets, rank 0 receives nothing and the last rank sends
    nothing; messages carry only the rows within reach."""
    local, world = 16, 4
    for left, reach in [(5, 1), (16, 1), (17, 2), (40, 3)]:
        plans = [dense_plan(LAYOUTS["contiguous"], r, world, local, True, Window(left, -1),
                            MASKS) for r in range(world)]
        assert [len(p.steps) for p in plans] == [reach] * world
        assert plans[0].steps[0].recv_rows == slice(0, 0)
        assert plans[world - 1].steps[0].send_rows == slice(0, 0)
        assert plans[1].steps[0].recv_rows == slice(max(0, local - left), local)
    assert exchange_rows(LAYOUTS["contiguous"], local, world, True, Window(5, -1)) == (5, 1)
    # zigzag: both neighbours, a few rows each; stripe: every rank
    assert exchange_rows(LAYOUTS["zigzag"], local, world, True, Window(5, -1)) == (10, 2)
    assert exchange_rows(LAYOUTS["stripe"], local, world, True, Window(5, -1))[1] == world - 1


# ---------------------------------------------------------------------------------------------
# Kernels


def _kernel_cases():
    return [BACKENDS["cpu_flash"], BACKENDS["math"], EXACT_BACKENDS["cpu_flash_exact"],
            EXACT_BACKENDS["math_exact"]]


FP32_LIMIT = 1e-5  # rel-RMS against float64, as tests/test_kernels.py holds every kernel to


def _kernel_errors(kernel, q, k, v, dout, mask, segments, window, reference):
    out, lse = kernel.forward(q.float(), k.float(), v.float(), mask, 0.25, segments, window)
    grads = kernel.backward(dout.float(), q.float(), k.float(), v.float(), out, lse, mask, 0.25,
                            segments, window)
    return [rel_rms(x, ref) for x, ref in zip([out, *grads], reference)]


def _band_reference(window, q, k, v, dout):
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if window.lo is not None:
        mask &= j - i >= window.lo
    if window.hi is not None:
        mask &= j - i <= window.hi
    return attention_and_grads(  # scale 0.25: SDPA's default at head dim 16
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask,
                                                       enable_gqa=True), q, k, v, dout,
        torch.float64)


@pytest.mark.parametrize("kernel", _kernel_cases(), ids=lambda k: k.name)
@pytest.mark.parametrize("window", [Band(-3, 0), Band(None, 1), Band(2, None), Band(-1, 4)],
                         ids=str)
def test_kernels_take_a_band(kernel, window):
    """A band block (GQA, 12 x 16; every row sees a key, as in a trimmed block) against float64
    attention with the same mask, fwd and bwd; the band one column wider is far off."""
    q, k, v, dout = make_inputs(2, 4, 2, 16, 16, seed=3)
    q, dout = q[:, :, :12], dout[:, :, :12]
    reference = _band_reference(window, q, k, v, dout)
    errors = _kernel_errors(kernel, q, k, v, dout, NONE, None, window, reference)
    assert max(errors) < FP32_LIMIT, errors
    wider = Band(window.lo, 5) if window.hi is None or window.hi < 5 else Band(-5, window.hi)
    assert max(_kernel_errors(kernel, q, k, v, dout, NONE, None, wider, reference)) > 1e-2


def test_the_causal_mask_read_backwards_is_causal_on_reversed_rows():
    """``kernels/windows.reversed_forward`` / ``reversed_backward`` (the CUDA kernels' route for
    the square band whose row i sees columns i and after) through the CPU kernels' causal mask:
    fwd and bwd against float64 attention with the band (GQA, 16 x 16); one column more visible
    is far off."""
    from dtensor_ring.kernels.windows import (reversed_backward, reversed_causal,
                                              reversed_forward)

    band = Band(0, None)
    assert reversed_causal(band, 16, 16)
    assert not reversed_causal(band, 12, 16) and not reversed_causal(Band(1, None), 16, 16)
    q, k, v, dout = make_inputs(2, 4, 2, 16, 16, seed=5)
    for kernel in (BACKENDS["cpu_flash"], BACKENDS["math"]):
        out, lse = reversed_forward(kernel.forward, q, k, v, 0.25)
        got = [out, *reversed_backward(kernel.backward, dout, q, k, v, out, lse, 0.25)]
        errors = [rel_rms(x, ref) for x, ref in zip(got, _band_reference(band, q, k, v, dout))]
        assert max(errors) < FP32_LIMIT, (kernel.name, errors)
        wider = _band_reference(Band(-1, None), q, k, v, dout)
        assert max(rel_rms(x, ref) for x, ref in zip(got, wider)) > 1e-2, kernel.name


def test_kernels_take_positions_with_segments():
    """Packed documents: the window as positions, on top of the segments and the causal mask."""
    q, k, v, dout = make_inputs(1, 2, 2, 24, 16, seed=4)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    positions = torch.arange(24)
    window = Window(3, -1)
    mask = window_mask(positions, positions, window, True, cu)
    reference = attention_and_grads(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask,
                                                       enable_gqa=True), q, k, v, dout,
        torch.float64)
    segments = Segments(cu, cu, 14, 14)
    for kernel in _kernel_cases():
        errors = _kernel_errors(kernel, q, k, v, dout, CAUSAL, segments,
                                Positions(positions, positions, 3, -1), reference)
        assert max(errors) < FP32_LIMIT, (kernel.name, errors)
        wrong = _kernel_errors(kernel, q, k, v, dout, CAUSAL, segments,
                               Positions(positions, positions, 4, -1), reference)
        assert max(wrong) > 1e-2, (kernel.name, wrong)


def test_flash_backward_operands_copy_only_row_slices_of_head_major_memory():
    """The windowed flash backward's operands (``kernels/windows._backward_operand``): a row slice
    of a model's [B, S, H, D] memory and a whole [B, H, S, D] tensor reach the op as they are;
    a row slice of [B, H, S, D] memory is copied once, dense in the op's [B, S, H, D] layout."""
    from dtensor_ring.kernels.windows import _backward_operand

    head_major = torch.randn(1, 4, 16, 8)
    seq_major = torch.randn(1, 16, 4, 8).transpose(1, 2)
    for x in (seq_major[:, :, 5:], head_major):
        got = _backward_operand(x)
        assert got.data_ptr() == x.data_ptr() and torch.equal(got, x.transpose(1, 2))
    got = _backward_operand(head_major[:, :, 5:])
    assert got.is_contiguous() and torch.equal(got, head_major[:, :, 5:].transpose(1, 2))


class NoWindows(CpuFlash):
    """The CPU kernel without window support, as cuDNN without PyTorch's flash op."""
    name = "cpu_flash_no_windows"
    windows = ()


def test_a_kernel_without_windows_is_refused_by_name_and_skipped_by_auto(monkeypatch):
    monkeypatch.setitem(BACKENDS, NoWindows.name, NoWindows())
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="backend='cpu_flash_no_windows' cannot run with a "
                                         "sliding window on device=cpu"):
        get_kernel(NoWindows.name, cpu, torch.float32, 16, window=True)
    assert get_kernel("auto", cpu, torch.float32, 16, window=True).name == "cpu_flash"
    q = torch.randn(1, 2, 32, 16)
    with pytest.raises(ValueError, match="cannot run with a sliding window"):
        dr.simulate_ring(q, q, q, world_size=2, schedule="ring", is_causal=True, window=(3, 0),
                         backend=NoWindows.name)
    # a window covering the sequence is no window: any kernel
    dr.simulate_ring(q, q, q, world_size=2, schedule="ring", is_causal=True, window=(31, 0),
                     backend=NoWindows.name)


# ---------------------------------------------------------------------------------------------
# Schedules against float64


def _run(schedule, world, q, k, v, dout, dtype, *, is_causal, window, precision="fp32",
         cu_seqlens=None):
    return attention_and_grads(
        lambda a, b, c: dr.simulate_ring(a, b, c, world_size=world, schedule=schedule,
                                         is_causal=is_causal, window=window, precision=precision,
                                         cu_seqlens=cu_seqlens), q, k, v, dout, dtype)


LOCAL = 16
# (is_causal, window) against a rank's share of LOCAL tokens: smaller, equal, larger; left-only
# and two-sided
CASES = [(True, (5, -1)), (True, (LOCAL - 1, 0)), (True, (40, 0)), (False, (5, 3)),
         (False, (LOCAL, 2 * LOCAL))]


# stripe, fp32 inputs: a row's keys within reach lie on every rank, a few per block, so a row
# merges W results of a few keys each, and the fp32 merge's own rounding is of the order of the
# kernel's whole error over so few keys (measured: 1.16x at W = 8, 1.25x at W = 64, where the
# other schedules stay <= 1.10x). Without a window its blocks hold S_local keys. bf16: the usual
# bound (the blocks' 16-bit rounding dominates).
STRIPE_FP32_WINDOW_TOLERANCE = 1.3


def _check(ratio_by_name, schedule, dtype, where):
    if schedule == "stripe" and dtype == torch.float32:
        worst = max(ratio_by_name.values())
        assert worst <= STRIPE_FP32_WINDOW_TOLERANCE, f"{where}: {ratio_by_name}"
    else:
        check_ratios(ratio_by_name, dtype, where)


@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"),
                                             (torch.bfloat16, "exact")])
def test_schedules_at_8_simulated_ranks(schedule, dtype, precision):
    world = 8
    q, k, v, dout = make_inputs(1, 4, 2, world * LOCAL, 16, seed=1)
    for is_causal, window in CASES:
        sdpa = windowed_sdpa(is_causal, window)
        reference = attention_and_grads(sdpa, q, k, v, dout, torch.float64)
        single = attention_and_grads(sdpa, q, k, v, dout, dtype)
        got = _run(schedule, world, q, k, v, dout, dtype, is_causal=is_causal, window=window,
                   precision=precision)
        _check(ratios(got, single, reference), schedule, dtype,
               f"{schedule} {precision} {dtype} causal={is_causal} window={window}")


@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
def test_schedules_at_64_simulated_ranks(schedule):
    """One token per rank within reach of a query's window on either side (stripe: every key its
    own block): bound 2x, as without a window at W = 64."""
    world, local = 64, 4
    q, k, v, dout = make_inputs(1, 2, 1, world * local, 16, seed=2)
    for is_causal, window in [(True, (6, -1)), (False, (9, 5))]:
        sdpa = windowed_sdpa(is_causal, window)
        reference = attention_and_grads(sdpa, q, k, v, dout, torch.float64)
        single = attention_and_grads(sdpa, q, k, v, dout, torch.float32)
        got = _run(schedule, world, q, k, v, dout, torch.float32, is_causal=is_causal,
                   window=window)
        worst = max(ratios(got, single, reference).values())
        assert worst <= 2.0, f"{schedule} W=64 causal={is_causal} {window}: {worst:.3f}"


def _check_windows_in_documents(schedule, world, cu, inputs, long_window, label, max_seqlen=None):
    """Three windows over packed documents ``cu`` on ``world`` simulated ranks, each against
    float64: a short causal one (fp32), a long causal one (``long_window`` tokens, bf16 exact)
    and a two-sided one without causality (fp32)."""
    for is_causal, window, dtype, precision in [(True, (5, 0), torch.float32, "fp32"),
                                                (True, (long_window, 0), torch.bfloat16, "exact"),
                                                (False, (6, 2), torch.float32, "fp32")]:
        sdpa = windowed_sdpa(is_causal, window, cu)
        reference = attention_and_grads(sdpa, *inputs, torch.float64)
        single = attention_and_grads(sdpa, *inputs, dtype)
        got = attention_and_grads(
            lambda a, b, c: dr.simulate_ring(
                a, b, c, world_size=world, schedule=schedule, is_causal=is_causal,
                window=window, precision=precision, cu_seqlens=torch.tensor(cu),
                max_seqlen=max_seqlen), *inputs, dtype)
        _check(ratios(got, single, reference), schedule, dtype,
               f"{schedule} {label} causal={is_causal} window={window}")


@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
@pytest.mark.parametrize("host", [True, False], ids=["boundaries on the host", "not read"])
def test_window_applies_within_each_document(monkeypatch, schedule, host):
    """Packed documents of 32, 16 and 80 tokens (W = 4), a window shorter than a document and
    one longer than a rank's share; with the boundaries known on the host (pairs out of reach
    skipped) and not (as from a GPU tensor with max_seqlen: every pair exchanged)."""
    if not host:
        monkeypatch.setattr(dr.documents, "_host_values", lambda cu_seqlens: None)
    _check_windows_in_documents(schedule, 4, [0, 32, 48, 128],
                                make_inputs(2, 4, 2, 128, 16, seed=5), 40, "documents",
                                max_seqlen=None if host else 80)


@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
def test_window_with_short_documents_placed_whole(schedule):
    """A row as pad_documents(world_size=4) places it (layouts/placement.py): two long documents
    cut across the ranks, the short ones whole on one rank each (their keys exchanged with no
    one); windows shorter than a short document and longer than a rank's share."""
    world = 4
    lengths = [150, 97, 5, 9, 12, 3, 6, 11, 7, 4, 13, 8, 10, 2]
    ids = torch.arange(sum(lengths))
    cu_in = torch.tensor([0, *itertools.accumulate(lengths)])
    cu = dr.pad_documents(ids, cu_in, world_size=world).cu_seqlens.tolist()
    docs = dr.layouts.boundaries.Documents.of(torch.tensor(cu),
                                              max(b - a for a, b in zip(cu, cu[1:])), cu)
    placement = placement_of(docs, world, cu[-1] // world)
    assert 0 < placement.cut.count(True) < len(cu) - 1, "some documents whole, some cut"
    _check_windows_in_documents(schedule, world, cu, make_inputs(1, 4, 2, cu[-1], 16, seed=7),
                                90, "placed documents")


@pytest.mark.parametrize("schedule", sorted(dr.SCHEDULES))
def test_a_window_one_token_too_wide_fails(schedule):
    world = 4
    q, k, v, dout = make_inputs(1, 4, 2, world * LOCAL, 16, seed=6)
    sdpa = windowed_sdpa(True, (5, 0))
    reference = attention_and_grads(sdpa, q, k, v, dout, torch.float64)
    single = attention_and_grads(sdpa, q, k, v, dout, torch.float32)
    wrong = _run(schedule, world, q, k, v, dout, torch.float32, is_causal=True, window=(6, 0))
    with pytest.raises(AssertionError):
        _check(ratios(wrong, single, reference), schedule, torch.float32, "one token too wide")
    assert rel_rms(wrong[0], reference[0]) > 100 * rel_rms(single[0], reference[0])


def test_a_window_covering_the_sequence_gives_the_unwindowed_bits():
    q, k, v, dout = make_inputs(1, 4, 2, 64, 16, seed=7)
    for schedule in sorted(dr.SCHEDULES):
        plain = _run(schedule, 4, q, k, v, dout, torch.bfloat16, is_causal=True, window=None)
        covered = _run(schedule, 4, q, k, v, dout, torch.bfloat16, is_causal=True,
                       window=(63, 5))
        assert all(torch.equal(a, b) for a, b in zip(plain, covered)), schedule


def test_auto_picks_the_windowed_exchange_when_it_moves_less():
    """auto with strong GQA: llama3 without a window or with one reaching every rank, zigzag's
    windowed exchange when it moves at most half of the all-gather's rows."""
    auto = dr.schedules.AUTO
    assert auto.choose(8, 2, LOCAL, 4, True, None) == "llama3"
    assert auto.choose(8, 2, LOCAL, 4, True, Window(5, -1)) == "zigzag"
    assert auto.choose(8, 2, LOCAL, 4, True, Window(3 * LOCAL, -1)) == "llama3"
    assert auto.choose(4, 4, LOCAL, 4, True, Window(3 * LOCAL, -1)) == "zigzag"
